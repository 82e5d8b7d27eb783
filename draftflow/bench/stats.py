"""Confidence intervals for the benchmark's figures, and which k (if any) is best.

Every engine measures the same timed units (one conversation each at batch 1, the whole prompt
set when requests are batched) in the same repeats, so a configuration's measurements form a
``[unit, repeat]`` grid of additive quantities (seconds, output tokens, drafts, ...), and every
figure is a ratio of two sums over that grid: tokens/s = tokens / seconds, time per output
token = decode seconds / decode tokens, acceptance length = 1 + accepted / drafts, speed-up =
(tokens_k / seconds_k) / (tokens_0 / seconds_0).

Intervals come from a two-way bootstrap: each draw resamples the units and, independently, the
repeats, with replacement, and recomputes every ratio from the reweighted sums. Resampling
units covers the spread between prompts; resampling repeats covers slow phases of the machine
that hit a whole repeat. One draw uses the same units and repeats for every k, so a speed-up is
always a ratio of times on the same prompts in the same repeats (paired). A fixed seed makes the
intervals reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# The additive quantities one timed unit records (columns of a bench units table).
QUANTITIES = (
    "seconds",
    "output_tokens",
    "decode_seconds",
    "decode_tokens",
    "num_drafts",
    "num_accepted_tokens",
)


@dataclass(frozen=True)
class Interval:
    """A point estimate with the bounds of its confidence interval."""

    point: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high


@dataclass(frozen=True)
class Grid:
    """One configuration on one prompt set: each quantity as a ``[unit, repeat]`` array."""

    values: Mapping[str, np.ndarray]

    @classmethod
    def from_rows(
        cls, rows: Sequence[Mapping[str, float]], units: Sequence[str], repeats: Sequence[int]
    ) -> Grid:
        """From one row per (unit, repeat): each row has ``unit``, ``run`` and the quantities."""
        unit_index = {unit: i for i, unit in enumerate(units)}
        repeat_index = {repeat: j for j, repeat in enumerate(repeats)}
        values = {name: np.full((len(units), len(repeats)), np.nan) for name in QUANTITIES}
        for row in rows:
            i, j = unit_index[str(row["unit"])], repeat_index[int(row["run"])]
            for name in QUANTITIES:
                values[name][i, j] = float(row[name])
        missing = [name for name, array in values.items() if np.isnan(array).any()]
        if missing:
            raise ValueError(f"units or repeats missing from the grid ({missing})")
        return cls(values)

    def sums(self, unit_weights: np.ndarray, repeat_weights: np.ndarray) -> dict[str, np.ndarray]:
        """Each quantity summed with weights ``[draws, units]`` and ``[draws, repeats]``."""
        return {
            name: np.einsum("bu,ur,br->b", unit_weights, array, repeat_weights)
            for name, array in self.values.items()
        }


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(
            denominator > 0, numerator / np.where(denominator > 0, denominator, 1), np.nan
        )


def figures(sums: Mapping[str, np.ndarray], plain: Mapping[str, np.ndarray], k: int) -> dict:
    """The benchmark's figures from summed quantities (one value per draw)."""
    tokens_per_s = _ratio(sums["output_tokens"], sums["seconds"])
    plain_tokens_per_s = _ratio(plain["output_tokens"], plain["seconds"])
    out = {
        "tokens_per_s": tokens_per_s,
        "tpot_ms": 1000.0 * _ratio(sums["decode_seconds"], sums["decode_tokens"]),
        "speedup": _ratio(tokens_per_s, plain_tokens_per_s),
    }
    # A plain step yields exactly one token.
    out["acceptance_length"] = (
        1.0 + _ratio(sums["num_accepted_tokens"], sums["num_drafts"])
        if k
        else np.ones_like(tokens_per_s)
    )
    return out


def _weights(rng: np.random.Generator, draws: int, size: int) -> np.ndarray:
    """How often each of ``size`` items is picked in each of ``draws`` resamples."""
    picks = rng.integers(0, size, size=(draws, size))
    return np.stack([np.bincount(row, minlength=size) for row in picks]).astype(float)


def intervals(
    grids: Mapping[int, Grid],
    *,
    samples: int,
    confidence: float,
    seed: int,
) -> dict[int, dict[str, Interval]]:
    """Per k: tokens/s, tpot_ms, speedup and acceptance_length, each with its interval, drawn
    as the config says (bench.bootstrap_samples, confidence, seed; no defaults here).

    ``grids`` holds every configuration of one prompt set (k = 0, the plain target, among them),
    all over the same units and repeats.
    """
    if 0 not in grids:
        raise ValueError("the plain target's grid (k = 0) is missing: speed-ups need it")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    shapes = {k: next(iter(g.values.values())).shape for k, g in grids.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"configurations were measured on different grids: {shapes}")
    units, repeats = shapes[0]
    rng = np.random.default_rng(seed)
    unit_weights = _weights(rng, samples, units)
    repeat_weights = _weights(rng, samples, repeats)
    ones_units, ones_repeats = np.ones((1, units)), np.ones((1, repeats))
    plain_point = grids[0].sums(ones_units, ones_repeats)
    plain_draws = grids[0].sums(unit_weights, repeat_weights)
    tail = (1 - confidence) / 2
    result = {}
    for k, grid in sorted(grids.items()):
        point = figures(grid.sums(ones_units, ones_repeats), plain_point, k)
        draws = figures(grid.sums(unit_weights, repeat_weights), plain_draws, k)
        result[k] = {}
        for name, values in draws.items():
            finite = values[np.isfinite(values)]
            low, high = (
                np.quantile(finite, [tail, 1 - tail]) if finite.size else (math.nan, math.nan)
            )
            result[k][name] = Interval(float(point[name][0]), float(low), float(high))
    return result


@dataclass(frozen=True)
class Verdict:
    """The best k where its interval lies above every other k's, else the k that tie."""

    best: int | None
    tied: tuple[int, ...]

    def describe(self) -> str:
        if self.best is not None:
            return f"k={self.best}"
        return "tie between " + ", ".join(f"k={k}" for k in self.tied)


def best_or_tie(speedups: Mapping[int, Interval]) -> Verdict:
    """Name the k with the highest speed-up only where its interval's lower bound beats every
    other k's upper bound; otherwise every k whose interval reaches the leader's ties."""
    finite = {k: v for k, v in speedups.items() if math.isfinite(v.point)}
    if not finite:
        return Verdict(None, ())
    leader = max(finite, key=lambda k: finite[k].point)
    rivals = [k for k in finite if k != leader]
    if all(finite[leader].low > finite[k].high for k in rivals):
        return Verdict(leader, (leader,))
    tied = tuple(sorted(k for k in finite if finite[k].high >= finite[leader].low))
    return Verdict(None, tied)
