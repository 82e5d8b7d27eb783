"""The whole benchmark in one call (outside the workflow): every engine, then every table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from draftflow.bench.run import engine_request, run_engines
from draftflow.bench.settings import BenchSettings
from draftflow.bench.tables import write_dataset_results


def run_benchmark(
    *,
    prompt_sets: dict[str, list[dict[str, Any]]],
    target: str,
    draft: str,
    ks: list[int],
    out_dir: str | Path,
    settings: BenchSettings,
) -> dict[str, pd.DataFrame]:
    """The plain target and each k over every prompt set, side by side:
    ``out_dir/engines/k{k}.json``, then ``out_dir/{dataset}.csv``,
    ``out_dir/{dataset}/outputs.jsonl`` and ``out_dir/{dataset}/units.csv`` per prompt set.

    ``settings``: the config's bench settings (``draftflow.bench.settings.bench_settings``).
    """
    if sorted(set(ks)) != sorted(ks) or any(k < 1 for k in ks):
        raise ValueError(f"num_speculative_tokens must be distinct integers >= 1, got {ks}")
    out_dir = Path(out_dir)
    configurations = [0, *ks]
    results = run_engines(
        engine_request(target, draft, configurations, prompt_sets, settings),
        {k: out_dir / "engines" / f"k{k}.json" for k in configurations},
    )
    return {
        dataset: write_dataset_results(
            dataset,
            list(results.values()),
            out_dir / f"{dataset}.csv",
            out_dir / dataset / "outputs.jsonl",
            out_dir / dataset / "units.csv",
        )
        for dataset in prompt_sets
    }
