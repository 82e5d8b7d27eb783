"""Benchmark driver: the plain target and one engine per k on one prompt set → tidy CSV.

CSV (``results/bench/{dataset}.csv``): one row per (dataset, k, run); k = 0 is the plain target.
Columns are listed in ``CSV_COLUMNS``. ``accepted_per_pos`` holds the raw per-position accepted
counts and ``acceptance_per_pos`` the same divided by the number of drafts, both as JSON lists.
The speed-up divides a run's throughput by the plain target's mean throughput over its runs.
Under greedy decoding every run is compared token by token with the plain target's first run;
differing requests are counted and the first one named (``first_difference``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from draftflow.bench.counters import SpecCounters
from draftflow.bench.engine import engine_kwargs
from draftflow.bench.lossless import compare_runs
from draftflow.io import atomic_path, atomic_write_json, read_json
from draftflow.workflow.cpu_threads import apply_cpu_engine_env

log = logging.getLogger(__name__)

# The directory holding the draftflow package, so the engine process imports the same code.
SOURCE_ROOT = Path(__file__).resolve().parents[2]

CSV_COLUMNS = [
    "dataset",
    "k",
    "run",
    "method",
    "temperature",
    "max_tokens",
    "num_prompts",
    "num_requests",
    "prompt_tokens",
    "output_tokens",
    "elapsed_s",
    "tokens_per_s",
    "tpot_ms",
    "requests_per_s",
    "speedup",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "accepted_per_pos",
    "acceptance_length",
    "acceptance_rate",
    "acceptance_per_pos",
    "outputs_identical",
    "num_requests_differ",
    "first_difference",
]


def run_engine_process(
    request: dict[str, Any], workdir: Path, name: str, reserved_cpus: int | None
) -> dict[str, Any]:
    """Run one configuration in a fresh Python process (see ``draftflow.bench.engine``)."""
    request_path = workdir / f"{name}.request.json"
    result_path = workdir / f"{name}.result.json"
    atomic_write_json(request_path, request)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    # On the CPU build: the same reserved scheduler cores and matching thread counts for every
    # engine, so runs compare (and the worker's core isn't oversubscribed).
    apply_cpu_engine_env(reserved_cpus, env)
    command = [sys.executable, "-m", "draftflow.bench.engine", str(request_path), str(result_path)]
    log.info("starting engine %s", name)
    sys.stderr.flush()
    completed = subprocess.run(command, env=env, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"benchmark engine {name} failed with exit code {completed.returncode}")
    return read_json(result_path)


def _rows(dataset: str, k: int, temperature: float, max_tokens: int, result: dict) -> list[dict]:
    rows = []
    for run in result["runs"]:
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


def _token_ids(run: dict[str, Any]) -> dict[str, list[list[int]]]:
    return {pid: [r["token_ids"] for r in turns] for pid, turns in run["responses"].items()}


def run_benchmark(
    *,
    dataset: str,
    prompts: list[dict[str, Any]],
    target: str,
    draft: str,
    ks: list[int],
    out_csv: str | Path,
    out_outputs: str | Path,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int = 128,
    seed: int = 0,
    repeats: int = 1,
    warmup_tokens: int = 16,
    reserved_cpus: int | None = 1,
    engine: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """Benchmark the plain target and each k; write the CSV and the per-request outputs."""
    if sorted(set(ks)) != sorted(ks) or any(k < 1 for k in ks):
        raise ValueError(f"num_speculative_tokens must be distinct integers >= 1, got {ks}")
    engine = dict(engine or {})
    sampling = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed}
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix=f"bench-{dataset}-") as tmp:
        for k in [0, *ks]:
            request = {
                "engine": engine_kwargs(target, draft if k else None, k, **engine),
                "sampling": sampling,
                "prompts": prompts,
                "repeats": repeats,
                "warmup_tokens": warmup_tokens,
            }
            results[k] = run_engine_process(request, Path(tmp), f"k{k}", reserved_cpus)

    rows = []
    for k, result in results.items():
        rows += _rows(dataset, k, temperature, max_tokens, result)
    table = pd.DataFrame(rows)
    base_tps = table.loc[table["k"] == 0, "tokens_per_s"].mean()
    table["speedup"] = table["tokens_per_s"] / base_tps

    # Losslessness: only greedy decoding promises the same tokens.
    reference = _token_ids(results[0]["runs"][0])
    identical, differ, first = [], [], []
    for k, result in results.items():
        for run in result["runs"]:
            if temperature > 0:
                identical.append(None)
                differ.append(None)
                first.append("not checked (sampled)")
                continue
            differences = compare_runs(reference, _token_ids(run))
            for difference in differences:
                log.warning(
                    "k=%d run %d differs from the plain target at %s",
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
    table = table[CSV_COLUMNS]
    with atomic_path(out_csv) as tmp_csv:
        table.to_csv(tmp_csv, index=False)
    write_outputs(out_outputs, dataset, results)
    return table


def write_outputs(path: str | Path, dataset: str, results: dict[int, dict[str, Any]]) -> None:
    """Per-request outputs: one line per (k, run, prompt) with every turn's text and token ids."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for k, result in results.items():
            for run in result["runs"]:
                for prompt_id, turns in run["responses"].items():
                    record = {
                        "dataset": dataset,
                        "k": k,
                        "run": run["run"],
                        "id": prompt_id,
                        "turns": turns,
                    }
                    handle.write(json.dumps(record, ensure_ascii=False, allow_nan=True) + "\n")
