"""Bench statistics on hand-made grids: known inputs give known intervals, ties are named."""

from __future__ import annotations

import numpy as np
import pytest
from config_support import demo_config

from draftflow.bench.stats import QUANTITIES, Grid, Interval, best_or_tie
from draftflow.bench.stats import intervals as bootstrap_intervals


def intervals(grids, **changes):
    """The intervals drawn as the demo's config says (bench.bootstrap_samples, confidence,
    seed), with ``changes``."""
    bench = demo_config()["bench"]
    drawn = {
        "samples": bench["bootstrap_samples"],
        "confidence": bench["confidence"],
        "seed": bench["seed"],
    }
    return bootstrap_intervals(grids, **{**drawn, **changes})


def grid(seconds, tokens=100.0, drafts=0.0, accepted=0.0) -> Grid:
    """A grid whose every cell decodes ``tokens`` tokens in the cell's ``seconds``."""
    seconds = np.asarray(seconds, dtype=float)
    full = np.full_like(seconds, 1.0)
    return Grid(
        {
            "seconds": seconds,
            "output_tokens": tokens * full,
            "decode_seconds": 0.9 * seconds,
            "decode_tokens": (tokens - 1) * full,
            "num_drafts": np.broadcast_to(np.asarray(drafts, dtype=float), seconds.shape),
            "num_accepted_tokens": np.broadcast_to(
                np.asarray(accepted, dtype=float), seconds.shape
            ),
        }
    )


def test_noise_free_speedup_has_a_zero_width_interval():
    plain = grid([[2.0, 2.0], [4.0, 4.0], [1.0, 1.0]])
    # Every prompt takes 1.25x less time with the draft: the speed-up is 1.25 in every draw.
    spec = grid([[1.6, 1.6], [3.2, 3.2], [0.8, 0.8]], drafts=50, accepted=25)
    result = intervals({0: plain, 1: spec}, samples=500)
    speedup = result[1]["speedup"]
    assert speedup.point == pytest.approx(1.25)
    assert speedup.low == pytest.approx(1.25) and speedup.high == pytest.approx(1.25)
    assert result[0]["speedup"].point == pytest.approx(1.0)
    assert result[1]["acceptance_length"].point == pytest.approx(1.5)
    assert result[0]["acceptance_length"].point == 1.0
    # Prompts differ in length, so throughput itself varies between draws.
    tps = result[0]["tokens_per_s"]
    assert tps.point == pytest.approx(600 / 14)
    assert tps.low < tps.point < tps.high


def test_pairing_cancels_drift_that_hits_every_configuration():
    rng = np.random.default_rng(1)
    # A slow phase of the machine (x1.5 in repeat 1) and prompts of very different lengths hit
    # plain and speculative alike; the paired ratio stays 1.2 within 1 % noise.
    drift = np.array([1.0, 1.5, 1.1])
    lengths = rng.uniform(0.5, 5.0, size=(8, 1))
    plain = lengths * drift * rng.normal(1, 0.01, size=(8, 3))
    spec = lengths * drift / 1.2 * rng.normal(1, 0.01, size=(8, 3))
    result = intervals({0: grid(plain), 2: grid(spec, drafts=10, accepted=5)}, seed=3)
    speedup = result[2]["speedup"]
    assert speedup.low <= 1.2 <= speedup.high
    assert speedup.half_width < 0.02
    # Unpaired throughputs carry the drift and the prompt lengths: far wider intervals.
    assert result[0]["tokens_per_s"].half_width / result[0]["tokens_per_s"].point > 0.05


def test_noisier_measurements_give_wider_intervals_and_more_data_narrower():
    def width(noise: float, units: int) -> float:
        rng = np.random.default_rng(0)
        plain = rng.normal(1, noise, size=(units, 2))
        spec = rng.normal(1, noise, size=(units, 2)) / 1.1
        return intervals({0: grid(plain), 1: grid(spec)}, seed=0)[1]["speedup"].half_width

    assert width(0.2, 10) > width(0.05, 10)
    assert width(0.1, 40) < width(0.1, 10)


def test_intervals_are_reproducible_with_a_seed():
    rng = np.random.default_rng(5)
    grids = {0: grid(rng.uniform(1, 2, (5, 2))), 1: grid(rng.uniform(1, 2, (5, 2)))}
    first, again, other = (intervals(grids, seed=s)[1]["speedup"] for s in (7, 7, 8))
    assert first == again
    assert first != other


def test_grid_from_rows_and_its_errors():
    rows = [
        {"unit": u, "run": r, **{name: 1.0 + i for name in QUANTITIES}}
        for i, (u, r) in enumerate([("a", 0), ("b", 0), ("a", 1), ("b", 1)])
    ]
    built = Grid.from_rows(rows, ["a", "b"], [0, 1])
    assert built.values["seconds"].tolist() == [[1.0, 3.0], [2.0, 4.0]]
    with pytest.raises(ValueError, match="missing"):
        Grid.from_rows(rows[:3], ["a", "b"], [0, 1])
    with pytest.raises(ValueError, match="plain target"):
        intervals({1: built})
    with pytest.raises(ValueError, match="different grids"):
        intervals({0: built, 1: grid([[1.0]])})


def test_best_k_is_named_only_where_its_interval_beats_the_others():
    clear = {
        1: Interval(1.10, 1.05, 1.15),
        2: Interval(1.30, 1.25, 1.35),
        3: Interval(1.2, 1.16, 1.24),
    }
    verdict = best_or_tie(clear)
    assert verdict.best == 2 and verdict.describe() == "k=2"
    # k=3's interval reaches k=2's: the two tie, k=1 stays out.
    close = {**clear, 3: Interval(1.22, 1.18, 1.26)}
    verdict = best_or_tie(close)
    assert verdict.best is None and verdict.tied == (2, 3)
    assert verdict.describe() == "tie between k=2, k=3"
    assert best_or_tie({1: Interval(0.9, 0.8, 1.0)}).best == 1
    assert best_or_tie({}).tied == ()
