"""Summaries of the benchmark: one row per (dataset, k), the best k, and where the time goes.

Runs of one configuration are pooled: counters are summed before ratios are taken (so a run
with many drafts weighs more), throughput is the mean over runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

SUMMARY_COLUMNS = [
    "dataset",
    "k",
    "acceptance_length",
    "acceptance_rate",
    "acceptance_per_pos",
    "tokens_per_s",
    "tpot_ms",
    "requests_per_s",
    "speedup",
    "step_cost",
    "outputs_identical",
    "num_requests_differ",
    "num_requests",
    "num_runs",
    "temperature",
]


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


def summarise(bench: pd.DataFrame) -> pd.DataFrame:
    """One row per (dataset, temperature, k); k = 0 is the plain target."""
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
                "num_requests": int(group["num_requests"].iloc[0]),
                "num_runs": len(group),
                "temperature": float(temperature),
            }
        )
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS).sort_values(
        ["dataset", "temperature", "k"], ignore_index=True
    )


def best_k(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (dataset, temperature): the speculative k with the highest speed-up."""
    spec = summary[(summary["k"] > 0) & summary["speedup"].notna()]
    if spec.empty:
        return spec
    index = spec.groupby(["dataset", "temperature"])["speedup"].idxmax()
    return spec.loc[index].reset_index(drop=True)


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
