"""Benchmark engines: every configuration (k = 0 is the plain target) over every prompt set.

``run_engines`` runs all configurations side by side, each engine in a fresh process of its own
(``draftflow.bench.engine``), interleaved unit by unit (``draftflow.bench.rounds``), or one after
the other where their memory cannot be shared (``draftflow.bench.schedule``), and writes each one's raw
result (timings per unit, vLLM counters, every response's token ids) as JSON; the tables are
made from those results by ``draftflow.bench.tables``. Kept apart so that a change to the tables
doesn't rerun the engines.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from draftflow.bench.engine import engine_kwargs
from draftflow.bench.margins import find_differences
from draftflow.bench.rounds import engine_processes, run_rounds
from draftflow.bench.schedule import (
    SIDE_BY_SIDE,
    TOGETHER,
    engine_schedule,
    engine_starts,
)
from draftflow.bench.settings import BenchSettings
from draftflow.engine import engine_env, on_cpu_build
from draftflow.io import atomic_write_json

log = logging.getLogger(__name__)

# The directory holding the draftflow package, so the engine process imports the same code.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
# Not a config key: the bench engines run without CUDA graphs (bench.engine_args may say
# otherwise: they are applied last).
ENFORCE_EAGER = True


def measure_differences(
    request: dict[str, Any],
    runs: dict[int, list[dict[str, Any]]],
    workdir: Path,
    env: dict[str, str],
) -> list[dict[str, Any]]:
    """The plain target's margin at every greedy difference (``draftflow.bench.margins``), in
    a plain engine started again after the timed rounds, so it costs the timings nothing; no
    engine starts where nothing differs."""
    if (
        float(request["sampling"]["temperature"]) > 0
        or not request.get("tie_margin")
        or 0 not in runs
    ):
        return []
    differences = find_differences(runs)
    if not differences:
        return []
    log.info("measuring the plain target's margin at %d difference(s)", len(differences))
    shared = {key: request[key] for key in ("sampling", "prompt_sets", "warmup_tokens")}
    plain = {0: {**shared, "engine": request["engines"]["0"]}}
    with (
        tempfile.TemporaryDirectory(prefix="margins-", dir=workdir) as tmp,
        engine_processes(plain, Path(tmp), env) as processes,
    ):
        return processes[0].margins(differences)


def engine_environment(request: dict[str, Any]) -> dict[str, str]:
    """The environment every engine process of ``request`` starts with."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    # On the CPU build: the same reserved scheduler cores and matching thread counts for every
    # engine, so runs compare (and the worker's core isn't oversubscribed); spawn on GPUs.
    # The engines' own arguments (engine_kwargs leaves out a tensor_parallel_size of 1 and an
    # unset KV-cache size); the bench has no model runner or determinism keys.
    first = next(iter(request["engines"].values()))
    env.update(
        engine_env(
            reserved_cpus=request["reserved_cpus"],
            model_runner="default",
            kv_cache_memory_bytes=first.get("kv_cache_memory_bytes"),
            tensor_parallel_size=int(first.get("tensor_parallel_size", 1)),
            cpu=on_cpu_build(),
            deterministic=False,
        )
    )
    return env


def engine_arguments(settings: BenchSettings) -> dict[str, Any]:
    """``draftflow.bench.engine.engine_kwargs``'s settings, the same for every k."""
    engine = settings.engine
    return {
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "kv_cache_memory_bytes": engine.kv_cache_memory_bytes,
        "dtype": engine.dtype,
        "seed": settings.seed,
        "enforce_eager": ENFORCE_EAGER,
        "trust_remote_code": settings.trust_remote_code,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "extra": dict(engine.engine_args),
    }


def engine_request(
    target: str,
    draft: str | None,
    ks: list[int],
    prompt_sets: dict[str, list[dict[str, Any]]],
    settings: BenchSettings,
) -> dict[str, Any]:
    """The request ``draftflow.bench.engine`` runs: one engine per k in ``ks``, identical but
    for the draft, alive at once or one at a time (``settings.schedule``, resolved here)."""
    if len(set(ks)) != len(ks) or not ks:
        raise ValueError(f"engine configurations must be distinct and at least one, got {ks}")
    engine = engine_arguments(settings)
    return {
        "schedule": engine_schedule(
            settings.schedule,
            len(ks),
            engine["gpu_memory_utilization"],
            engine["kv_cache_memory_bytes"],
        ),
        "starts": engine_starts(settings.starts, engine["kv_cache_memory_bytes"]),
        "engines": {
            str(k): engine_kwargs(target, draft if k else None, k, **engine) for k in sorted(ks)
        },
        "sampling": {
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "max_tokens": settings.max_tokens,
            "seed": settings.seed,
        },
        "prompt_sets": prompt_sets,
        "repeats": settings.repeats,
        # Greedy differences within this many logits are near-ties (0: not measured).
        "tie_margin": settings.tie_margin,
        "warmup_tokens": settings.warmup_tokens,
        # CPU build: scheduler cores of every engine (VLLM_CPU_NUM_OF_RESERVED_CPU).
        "reserved_cpus": settings.engine.reserved_cpus,
    }


def run_engines(
    request: dict[str, Any], out_jsons: dict[int, str | Path]
) -> dict[int, dict[str, Any]]:
    """Run every configuration of ``request``, side by side or one at a time as its
    ``schedule`` says (``draftflow.bench.rounds``); write each one's result (with its ``k``)
    atomically to ``out_jsons[k]``."""
    ks = sorted(int(k) for k in request["engines"])
    if sorted(out_jsons) != ks:
        raise ValueError(f"result paths for k={sorted(out_jsons)}, engines for k={ks}")
    paths = {k: Path(path) for k, path in out_jsons.items()}
    workdir = paths[ks[0]].parent
    workdir.mkdir(parents=True, exist_ok=True)
    shared = {key: request[key] for key in ("sampling", "prompt_sets", "warmup_tokens")}
    engines = {int(k): kwargs for k, kwargs in request["engines"].items()}
    max_num_seqs = int(engines[ks[0]]["max_num_seqs"])
    schedule = request["schedule"]
    groups = [ks] if schedule == SIDE_BY_SIDE else [[k] for k in ks]
    log.info("bench schedule: %s (%s)", schedule, " | ".join(map(str, groups)))
    env = engine_environment(request)
    runs: dict[int, list[dict[str, Any]]] = {}
    for group in groups:
        with (
            tempfile.TemporaryDirectory(prefix="bench-", dir=workdir) as tmp,
            engine_processes(
                {k: {**shared, "engine": engines[k]} for k in group},
                Path(tmp),
                env,
                together=request["starts"] == TOGETHER,
            ) as processes,
        ):
            runs.update(
                run_rounds(processes, request["prompt_sets"], int(request["repeats"]), max_num_seqs)
            )
    margins = measure_differences(request, runs, Path(workdir), env)
    results = {}
    for k in ks:
        result = {
            "engine": engines[k],
            "sampling": request["sampling"],
            "schedule": schedule,
            "runs": runs[k],
            "k": k,
            "tie_margin": request["tie_margin"],
            "margins": margins,
        }
        paths[k].parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(paths[k], result)
        results[k] = result
    return results
