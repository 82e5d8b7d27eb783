"""Benchmark tables: one prompt set's tidy CSV and per-request outputs from engine results.

CSV (``results/bench/{dataset}.csv``): one row per (dataset, k, run); k = 0 is the plain target.
Columns are listed in ``CSV_COLUMNS``. ``accepted_per_pos`` holds the raw per-position accepted
counts and ``acceptance_per_pos`` the same divided by the number of drafts, both as JSON lists.
The speed-up divides a run's throughput by the plain target's mean throughput over its runs.
Under greedy decoding every run is compared token by token with the plain target's first run;
differing requests are counted and the first one named (``first_difference``); those the
plain target measured as near-ties (``draftflow.bench.margins``, ``bench.tie_margin``) are
counted in ``num_near_ties``, and ``lossless`` says "identical", "near-ties only" or "differs".

Units (``results/bench/{dataset}/units.csv``): one row per (k, run, unit), a unit being the
conversations the engines timed one after the other (``draftflow.bench.engine``); its columns
(``UNIT_COLUMNS``) are the additive quantities ``draftflow.bench.stats`` resamples for the
report's intervals.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pandas as pd

from draftflow.bench.counters import SpecCounters
from draftflow.bench.lossless import compare_runs
from draftflow.bench.margins import count_near_ties, verdict
from draftflow.bench.stats import QUANTITIES
from draftflow.io import atomic_path

log = logging.getLogger(__name__)

# Copied from each engine run as they are.
_RUN_KEYS = (
    "num_prompts",
    "num_requests",
    "prompt_tokens",
    "output_tokens",
    "elapsed_s",
    "tokens_per_s",
    "tpot_ms",
    "requests_per_s",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
)
# The CSV's columns, in order: the configuration, the run's own figures (the speed-up after
# throughput), then the acceptance and lossless columns derived here.
CSV_COLUMNS = [
    "dataset",
    "k",
    "run",
    "method",
    "temperature",
    "max_tokens",
    *_RUN_KEYS[: _RUN_KEYS.index("requests_per_s") + 1],
    "speedup",
    *_RUN_KEYS[_RUN_KEYS.index("requests_per_s") + 1 :],
    "accepted_per_pos",
    "acceptance_length",
    "acceptance_rate",
    "acceptance_per_pos",
    "outputs_identical",
    "num_requests_differ",
    "first_difference",
    "num_near_ties",
    "lossless",
]


UNIT_COLUMNS = ["dataset", "k", "run", "unit", *QUANTITIES]


def _rows(
    dataset: str, k: int, temperature: float, max_tokens: int, runs: list[dict[str, Any]]
) -> list[dict]:
    rows = []
    for run in runs:
        counters = SpecCounters(
            run["num_drafts"],
            run["num_draft_tokens"],
            run["num_accepted_tokens"],
            tuple(run["accepted_per_pos"]),
        )
        rows.append(
            {
                "dataset": dataset,
                "k": k,
                "run": run["run"],
                "method": "eagle3" if k else "plain",
                "temperature": temperature,
                "max_tokens": max_tokens,
                **{key: run[key] for key in _RUN_KEYS},
                "accepted_per_pos": json.dumps(list(counters.accepted_per_pos)),
                # A plain step yields exactly one token.
                "acceptance_length": counters.acceptance_length if k else 1.0,
                "acceptance_rate": counters.acceptance_rate,
                "acceptance_per_pos": json.dumps(
                    [round(x, 4) for x in counters.acceptance_per_pos()]
                ),
            }
        )
    return rows


def _token_ids(run: dict[str, Any]) -> dict[str, list[list[int]]]:
    return {pid: [r["token_ids"] for r in turns] for pid, turns in run["responses"].items()}


def write_dataset_results(
    dataset: str,
    results: list[dict[str, Any]],
    out_csv: str | Path,
    out_outputs: str | Path,
    out_units: str | Path,
) -> pd.DataFrame:
    """One prompt set's CSV, outputs and units from the engines' results (one with k = 0)."""
    by_k = {int(r["k"]): _dataset_runs(r, dataset) for r in results}
    if 0 not in by_k:
        raise ValueError("the plain target's result (k = 0) is missing: speed-ups need it")
    sampling = results[0]["sampling"]
    for result in results[1:]:
        if result["sampling"] != sampling:
            raise ValueError(
                f"engine results were sampled differently: {sampling} vs {result['sampling']}"
            )
    temperature = float(sampling["temperature"])
    max_tokens = int(sampling["max_tokens"])
    rows = []
    for k in sorted(by_k):
        rows += _rows(dataset, k, temperature, max_tokens, by_k[k])
    table = pd.DataFrame(rows)
    base_tps = table.loc[table["k"] == 0, "tokens_per_s"].mean()
    table["speedup"] = table["tokens_per_s"] / base_tps

    # Losslessness: only greedy decoding promises the same tokens.
    reference = _token_ids(by_k[0][0])
    margins = results[0].get("margins", [])
    tie_margin = float(results[0].get("tie_margin", 0.0))
    identical, differ, first, ties, lossless = [], [], [], [], []
    for k in sorted(by_k):
        for run in by_k[k]:
            if temperature > 0:
                identical.append(None)
                differ.append(None)
                first.append("not checked (sampled)")
                ties.append(None)
                lossless.append("not checked (sampled)")
                continue
            candidate = _token_ids(run)
            differences = compare_runs(reference, candidate)
            near = count_near_ties(dataset, differences, reference, candidate, margins, tie_margin)
            ties.append(near)
            lossless.append(verdict(len(differences), near))
            for difference in differences:
                log.warning(
                    "%s: k=%d run %d differs from the plain target at %s",
                    dataset,
                    k,
                    run["run"],
                    difference.describe(),
                )
            identical.append(not differences)
            differ.append(len(differences))
            first.append(differences[0].describe() if differences else "none")
    table["outputs_identical"] = identical
    table["num_requests_differ"] = differ
    table["first_difference"] = first
    table["num_near_ties"] = ties
    table["lossless"] = lossless
    table = table[CSV_COLUMNS]
    with atomic_path(out_csv) as tmp_csv:
        table.to_csv(tmp_csv, index=False)
    write_outputs(out_outputs, dataset, {k: by_k[k] for k in sorted(by_k)})
    write_units(out_units, dataset, {k: by_k[k] for k in sorted(by_k)})
    return table


def _dataset_runs(result: dict[str, Any], dataset: str) -> list[dict[str, Any]]:
    runs = [run for run in result["runs"] if run["dataset"] == dataset]
    if not runs:
        served = sorted({run["dataset"] for run in result["runs"]})
        raise ValueError(f"the k={result['k']} engine did not run {dataset!r} (it ran {served})")
    return runs


def write_outputs(
    path: str | Path, dataset: str, runs_by_k: dict[int, list[dict[str, Any]]]
) -> None:
    """Per-request outputs: one line per (k, run, prompt) with every turn's text and token ids."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for k, runs in runs_by_k.items():
            for run in runs:
                for prompt_id, turns in run["responses"].items():
                    record = {
                        "dataset": dataset,
                        "k": k,
                        "run": run["run"],
                        "id": prompt_id,
                        "turns": turns,
                    }
                    handle.write(json.dumps(record, ensure_ascii=False, allow_nan=True) + "\n")


def write_units(path: str | Path, dataset: str, runs_by_k: dict[int, list[dict[str, Any]]]) -> None:
    """Every engine's timed units; all engines must have timed the same units in the same runs,
    since the statistics pair them."""
    rows = [
        {"dataset": dataset, "k": k, "run": run["run"], **{c: unit[c] for c in UNIT_COLUMNS[3:]}}
        for k, runs in runs_by_k.items()
        for run in runs
        for unit in run.get("units", [])
    ]
    table = pd.DataFrame(rows, columns=UNIT_COLUMNS)
    cells = {k: set(zip(g["run"], g["unit"], strict=True)) for k, g in table.groupby("k")}
    if len(cells) != len(runs_by_k) or len({frozenset(c) for c in cells.values()}) != 1:
        raise ValueError(
            f"{dataset}: the engines did not all time the same units in the same runs "
            "(results from separate engine runs cannot be paired)"
        )
    with atomic_path(path) as tmp:
        table.to_csv(tmp, index=False)


def read_speculative_rows(directory: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Per prompt set (each ``{dataset}.csv`` in ``directory``), one row per speculative run:
    τ, acceptance per position, the lossless check and the speed-up (for the studies)."""
    tables = {}
    for path in sorted(Path(directory).glob("*.csv")):
        rows = pd.read_csv(path, keep_default_na=False)
        tables[path.stem] = [
            {
                "k": int(row["k"]),
                "acceptance_length": float(row["acceptance_length"]),
                "acceptance_per_pos": json.loads(row["acceptance_per_pos"]),
                "outputs_identical": str(row["outputs_identical"]) == "True",
                "lossless": row.get("lossless"),
                "num_requests_differ": int(row["num_requests_differ"]),
                "first_difference": row["first_difference"],
                "speedup": float(row["speedup"]),
                "num_drafts": int(float(row["num_drafts"])),
            }
            for row in rows.to_dict("records")
            if int(row["k"]) > 0
        ]
    return tables
