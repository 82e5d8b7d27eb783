"""Greedy losslessness: speculative decoding must reproduce the plain target's tokens.

Each request is a list of turns, each turn the generated token ids. A request whose first turn
differs also gets a different second prompt, so only the first difference is meaningful; it is
reported as (turn, position) and never hidden.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Difference:
    """Where a request's output first departs from the baseline's."""

    request_id: str
    turn: int
    position: int

    def describe(self) -> str:
        return f"{self.request_id}: turn {self.turn}, token {self.position}"


def first_difference(
    baseline: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]
) -> tuple[int, int] | None:
    """(turn, token position) of the first differing token, or None when both are equal."""
    for turn, (want, got) in enumerate(zip(baseline, candidate, strict=False)):
        for position, (a, b) in enumerate(zip(want, got, strict=False)):
            if a != b:
                return turn, position
        if len(want) != len(got):
            # One stopped early (EOS or length): the difference is where the shorter one ends.
            return turn, min(len(want), len(got))
    if len(baseline) != len(candidate):
        return min(len(baseline), len(candidate)), 0
    return None


def compare_runs(
    baseline: Mapping[str, Sequence[Sequence[int]]],
    candidate: Mapping[str, Sequence[Sequence[int]]],
) -> list[Difference]:
    """Every request of ``candidate`` that differs from ``baseline`` (same request ids)."""
    if set(baseline) != set(candidate):
        missing = sorted(set(baseline) ^ set(candidate))
        raise ValueError(f"runs cover different requests: {missing[:5]} ...")
    differences = []
    for request_id in sorted(baseline):
        where = first_difference(baseline[request_id], candidate[request_id])
        if where is not None:
            differences.append(Difference(request_id, *where))
    return differences
