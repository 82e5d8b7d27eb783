"""vLLM's speculative-decoding counters and the acceptance statistics derived from them.

vLLM (with ``disable_log_stats=False``) keeps cumulative Prometheus counters; ``LLM.get_metrics()``
returns them as ``Counter`` (``.value``) and ``Vector`` (``.values``) objects. A run is measured as
the difference of two snapshots, so the warm-up request never counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative speculative-decoding counts (all zero for a plain target)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = field(default_factory=tuple)

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = list(self.accepted_per_pos) + [0] * (width - len(self.accepted_per_pos))
        theirs = list(other.accepted_per_pos) + [0] * (width - len(other.accepted_per_pos))
        return SpecCounters(
            num_drafts=self.num_drafts + sign * other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + sign * other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + sign * other.num_accepted_tokens,
            accepted_per_pos=tuple(a + sign * b for a, b in zip(mine, theirs, strict=True)),
        )

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        return self._combine(earlier, -1)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a speculative step yields: the target's own token plus accepted drafts."""
        if self.num_drafts == 0:
            return float("nan")
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> float:
        """Share of proposed draft tokens the target accepted."""
        if self.num_draft_tokens == 0:
            return float("nan")
        return self.num_accepted_tokens / self.num_draft_tokens

    def acceptance_per_pos(self) -> list[float]:
        """Share of drafts whose token at position i (0-based) was accepted."""
        if self.num_drafts == 0:
            return [float("nan")] * len(self.accepted_per_pos)
        return [count / self.num_drafts for count in self.accepted_per_pos]


def read_spec_counters(metrics: Iterable[Any]) -> SpecCounters:
    """Sum the counters over every engine/label set in ``LLM.get_metrics()``'s list."""
    drafts = draft_tokens = accepted = 0
    per_pos: list[int] = []
    for metric in metrics:
        if metric.name == NUM_DRAFTS:
            drafts += int(metric.value)
        elif metric.name == NUM_DRAFT_TOKENS:
            draft_tokens += int(metric.value)
        elif metric.name == NUM_ACCEPTED_TOKENS:
            accepted += int(metric.value)
        elif metric.name == ACCEPTED_PER_POS:
            values = [int(v) for v in metric.values]
            per_pos += [0] * (len(values) - len(per_pos))
            for pos, value in enumerate(values):
                per_pos[pos] += value
    return SpecCounters(drafts, draft_tokens, accepted, tuple(per_pos))
