"""Benchmark engines: one configuration (k = 0 is the plain target) over every prompt set.

``run_engine`` runs one configuration in a fresh process (``draftflow.bench.engine``) and writes
its raw result (timings, vLLM counters, every response's token ids) as JSON; the tables are made
from those results by ``draftflow.bench.tables``. Kept apart so that a change to the tables
doesn't rerun the engines.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from draftflow.bench.engine import engine_kwargs
from draftflow.engine import engine_env
from draftflow.io import atomic_write_json, read_json

log = logging.getLogger(__name__)

# The directory holding the draftflow package, so the engine process imports the same code.
SOURCE_ROOT = Path(__file__).resolve().parents[2]


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
    # engine, so runs compare (and the worker's core isn't oversubscribed); spawn on GPUs.
    tensor_parallel_size = int(request["engine"].get("tensor_parallel_size", 1))
    env.update(engine_env(reserved_cpus=reserved_cpus, tensor_parallel_size=tensor_parallel_size))
    command = [sys.executable, "-m", "draftflow.bench.engine", str(request_path), str(result_path)]
    log.info("starting engine %s", name)
    sys.stderr.flush()
    completed = subprocess.run(command, env=env, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"benchmark engine {name} failed with exit code {completed.returncode}")
    return read_json(result_path)


def engine_request(
    target: str,
    draft: str | None,
    k: int,
    prompt_sets: dict[str, list[dict[str, Any]]],
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int = 128,
    seed: int = 0,
    repeats: int = 1,
    warmup_tokens: int = 16,
    engine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The request ``draftflow.bench.engine`` runs: identical for every k but the draft."""
    return {
        "engine": engine_kwargs(target, draft if k else None, k, **dict(engine or {})),
        "sampling": {
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "seed": seed,
        },
        "prompt_sets": prompt_sets,
        "repeats": repeats,
        "warmup_tokens": warmup_tokens,
    }


def request_settings(
    bench: dict[str, Any],
    *,
    dtype: str,
    trust_remote_code: bool = False,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """``engine_request``'s keyword arguments from the config's ``bench:`` section."""
    return {
        "temperature": bench.get("temperature", 0.0),
        "top_p": bench.get("top_p", 1.0),
        "max_tokens": bench["max_tokens"],
        "seed": bench.get("seed", 0),
        "repeats": bench.get("repeats", 1),
        "warmup_tokens": bench.get("warmup_tokens", 16),
        "engine": {
            "max_model_len": bench["max_model_len"],
            "max_num_seqs": bench["max_num_seqs"],
            "gpu_memory_utilization": bench.get("gpu_memory_utilization"),
            "kv_cache_memory_bytes": bench.get("kv_cache_memory_bytes"),
            "dtype": dtype,
            "seed": bench.get("seed", 0),
            "trust_remote_code": trust_remote_code,
            "tensor_parallel_size": tensor_parallel_size,
            "extra": bench.get("engine_args") or {},
        },
    }


def run_engine(
    request: dict[str, Any], k: int, out_json: str | Path, reserved_cpus: int | None = 1
) -> dict[str, Any]:
    """Run one configuration in its own process; write its result (with ``k``) atomically."""
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"bench-k{k}-", dir=out_json.parent) as tmp:
        result = run_engine_process(request, Path(tmp), f"k{k}", reserved_cpus)
    result["k"] = k
    atomic_write_json(out_json, result)
    return result
