"""Summaries of the benchmark: one row per (dataset, k), the best k, and where the time goes.

Runs of one configuration are pooled: counters are summed before ratios are taken (so a run
with many drafts weighs more). Given the bench units tables, tokens/s, time per output token,
speed-up and acceptance length are ratios of sums over every timed unit and round, each with a
bootstrap confidence interval (``draftflow.bench.stats``: ``*_low`` and ``*_high`` columns), and
a k is named best only where its speed-up interval lies above every other k's. Without them
throughput is the mean over runs and the bounds stay empty.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from draftflow.bench.stats import Grid, Interval, Verdict, best_or_tie, intervals

# Figures that carry a confidence interval: each has ``{name}_low`` and ``{name}_high`` beside it.
WITH_INTERVALS = ("acceptance_length", "tokens_per_s", "tpot_ms", "speedup")


def _near_ties(group: pd.DataFrame) -> int | None:
    """Near-ties among the differing requests of the run with the most (greedy runs with their
    margins measured; tables older than the column have none)."""
    if "num_near_ties" not in group or group["num_near_ties"].isna().any():
        return None
    return int(group["num_near_ties"].max())


def _bounded(name: str) -> list[str]:
    return [name, f"{name}_low", f"{name}_high"] if name in WITH_INTERVALS else [name]


SUMMARY_COLUMNS = [
    "dataset",
    "k",
    *_bounded("acceptance_length"),
    "acceptance_rate",
    "acceptance_per_pos",
    *_bounded("tokens_per_s"),
    *_bounded("tpot_ms"),
    "requests_per_s",
    *_bounded("speedup"),
    "step_cost",
    "outputs_identical",
    "num_requests_differ",
    "num_near_ties",
    "num_requests",
    "num_units",
    "num_runs",
    "temperature",
]


@dataclass(frozen=True)
class Bootstrap:
    """How the intervals are drawn (config: bench.bootstrap_samples, confidence, seed)."""

    samples: int
    confidence: float
    seed: int


def read_bench_tables(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Concatenate the per-dataset bench CSVs."""
    frames = [pd.read_csv(path) for path in paths]
    if not frames:
        raise ValueError("no bench CSV given")
    return pd.concat(frames, ignore_index=True)


def _pooled_per_pos(counts: Iterable[str], drafts: int) -> str:
    total: list[int] = []
    for text in counts:
        values = json.loads(text) if isinstance(text, str) and text else []
        total += [0] * (len(values) - len(total))
        for pos, value in enumerate(values):
            total[pos] += int(value)
    return json.dumps([round(c / drafts, 4) for c in total] if drafts else [])


def step_cost(baseline_tokens_per_s: float, tokens_per_s: float, acceptance_length: float) -> float:
    """Time of one speculative step in plain decoding steps.

    A speculative step yields ``acceptance_length`` tokens in ``acceptance_length / tokens_per_s``
    seconds; a plain step yields one token in ``1 / baseline_tokens_per_s``. Their ratio is
    (baseline / speculative throughput) x acceptance length; speed-up = acceptance length / cost.
    """
    if tokens_per_s <= 0 or not math.isfinite(acceptance_length):
        return float("nan")
    return baseline_tokens_per_s / tokens_per_s * acceptance_length


def unit_intervals(
    units: pd.DataFrame, bootstrap: Bootstrap
) -> dict[tuple[str, int], dict[str, Interval]]:
    """Per (dataset, k): every figure with its interval, from the bench units tables."""
    out = {}
    for dataset, table in units.groupby("dataset"):
        names = list(dict.fromkeys(str(u) for u in table["unit"]))
        runs = sorted(int(r) for r in table["run"].unique())
        grids = {
            int(k): Grid.from_rows(group.to_dict("records"), names, runs)
            for k, group in table.groupby("k")
        }
        measured = intervals(
            grids, samples=bootstrap.samples, confidence=bootstrap.confidence, seed=bootstrap.seed
        )
        for k, figures in measured.items():
            out[(str(dataset), k)] = figures
    return out


def summarise(
    bench: pd.DataFrame, units: pd.DataFrame | None = None, bootstrap: Bootstrap | None = None
) -> pd.DataFrame:
    """One row per (dataset, temperature, k); k = 0 is the plain target. ``units`` (the bench
    units tables) give every figure its interval, drawn as ``bootstrap`` (the config's) says."""
    if units is not None and bootstrap is None:
        raise ValueError("intervals from bench units need the config's bootstrap settings")
    measured = unit_intervals(units, bootstrap) if units is not None else {}
    rows = []
    for (dataset, temperature, k), group in bench.groupby(["dataset", "temperature", "k"]):
        drafts = int(group["num_drafts"].sum())
        draft_tokens = int(group["num_draft_tokens"].sum())
        accepted = int(group["num_accepted_tokens"].sum())
        base = bench[
            (bench["dataset"] == dataset)
            & (bench["temperature"] == temperature)
            & (bench["k"] == 0)
        ]
        base_tps = float(base["tokens_per_s"].mean()) if not base.empty else float("nan")
        tps = float(group["tokens_per_s"].mean())
        tau = 1.0 + accepted / drafts if drafts else (1.0 if k == 0 else float("nan"))
        identical = group["outputs_identical"]
        rows.append(
            {
                "dataset": dataset,
                "k": int(k),
                "acceptance_length": tau,
                "acceptance_rate": accepted / draft_tokens if draft_tokens else float("nan"),
                "acceptance_per_pos": _pooled_per_pos(group["accepted_per_pos"], drafts),
                "tokens_per_s": tps,
                "tpot_ms": float(group["tpot_ms"].mean()),
                "requests_per_s": float(group["requests_per_s"].mean()),
                "speedup": tps / base_tps if base_tps > 0 else float("nan"),
                "step_cost": step_cost(base_tps, tps, tau),
                # Lossless only means something under greedy decoding; sampled runs stay empty.
                "outputs_identical": bool(identical.astype(bool).all())
                if identical.notna().all()
                else None,
                "num_requests_differ": int(group["num_requests_differ"].max())
                if identical.notna().all()
                else None,
                "num_near_ties": _near_ties(group),
                "num_requests": int(group["num_requests"].iloc[0]),
                "num_units": None,
                "num_runs": len(group),
                "temperature": float(temperature),
            }
        )
        figures = measured.get((str(dataset), int(k)))
        if figures is not None:
            for name, interval in figures.items():
                rows[-1].update(
                    {
                        name: interval.point,
                        f"{name}_low": interval.low,
                        f"{name}_high": interval.high,
                    }
                )
            rows[-1]["step_cost"] = (
                rows[-1]["acceptance_length"] / rows[-1]["speedup"]
                if rows[-1]["speedup"] > 0
                else float("nan")
            )
            rows[-1]["num_units"] = int(
                units[(units["dataset"] == dataset) & (units["k"] == k)]["unit"].nunique()
            )
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS).sort_values(
        ["dataset", "temperature", "k"], ignore_index=True
    )


def _interval(row: pd.Series, name: str) -> Interval:
    """A row's figure with its bounds; without bounds the point stands for both."""
    point = float(row[name])
    low, high = row.get(f"{name}_low", np.nan), row.get(f"{name}_high", np.nan)
    if pd.isna(low) or pd.isna(high):
        return Interval(point, point, point)
    return Interval(point, float(low), float(high))


def verdicts(summary: pd.DataFrame) -> dict[tuple[str, float], Verdict]:
    """Per (dataset, temperature): the best speculative k, or the k that tie."""
    spec = summary[(summary["k"] > 0) & summary["speedup"].notna()]
    return {
        (str(dataset), float(temperature)): best_or_tie(
            {int(row["k"]): _interval(row, "speedup") for _, row in group.iterrows()}
        )
        for (dataset, temperature), group in spec.groupby(["dataset", "temperature"])
    }


def best_k(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (dataset, temperature): the row of the k with the highest speed-up, with
    ``named_best`` (its interval lies above every other k's) and ``tied`` (the k whose
    intervals reach its own, comma-separated)."""
    spec = summary[(summary["k"] > 0) & summary["speedup"].notna()]
    if spec.empty:
        return spec.assign(named_best=[], tied=[])
    index = spec.groupby(["dataset", "temperature"])["speedup"].idxmax()
    best = spec.loc[index].reset_index(drop=True)
    found = verdicts(summary)
    keys = list(zip(best["dataset"].astype(str), best["temperature"].astype(float), strict=True))
    best["named_best"] = [found[key].best is not None for key in keys]
    best["tied"] = [",".join(str(k) for k in found[key].tied) for key in keys]
    return best


def where_the_time_goes(summary: pd.DataFrame) -> list[str]:
    """Sentences, computed from the measurements, on why a k pays off or not."""
    lines = []
    for (dataset, temperature), group in summary.groupby(["dataset", "temperature"]):
        spec = group[(group["k"] > 0) & group["step_cost"].notna()].sort_values("k")
        if spec.empty:
            continue
        base = group[group["k"] == 0]
        base_tps = float(base["tokens_per_s"].iloc[0]) if not base.empty else float("nan")
        parts = []
        for row in spec.itertuples():
            extra = (row.step_cost - 1.0) / row.k
            verdict = "pays off" if row.acceptance_length > row.step_cost else "does not pay off"
            parts.append(
                f"at k={row.k} a speculative step costs {row.step_cost:.2f} plain steps "
                f"({extra:.2f} per draft token) and yields τ={row.acceptance_length:.2f} tokens, "
                f"so speed-up = τ / cost = {row.speedup:.2f} ({verdict}; break-even τ = "
                f"{row.step_cost:.2f})"
            )
        lines.append(
            f"**{dataset}** (temperature {temperature:g}, plain target {base_tps:.1f} tokens/s): "
            + "; ".join(parts)
            + "."
        )
    return lines
