"""Stored against streamed extract on the tiny workflow: capture and train seconds, peak disk.

One upstream run (data, vocab, val capture) of the tiny workflow with two train shards and two
epochs (tests/stream_support.py) is cloned into a stored copy (train.order by_shard) and one
streamed copy per window; each runs up to the draft while the bytes under results/ and of the
links' captures are sampled every 0.2 s. Capture and train seconds are the Snakemake benchmark
files' wall seconds; the drafts' sha256 must agree.

    python perf/streamed_vs_stored.py --target .test-cache/smollm2 --workdir /tmp/streamed \\
        --out docs/results/streamed-vs-stored-cpu.json

``--gpu`` runs every engine and the trainer on one GPU (``engine.device: gpu``, ``--resources
gpu=1``, as tests/gpu/test_gpu_workflow.py does), so jobs take the GPU in turn. Where one command
may not run that long, ``--runs stored`` and then ``--runs streamed --keep-workdir`` split it in
two (the second reuses the first's upstream run; each writes its own ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from stream_support import (  # noqa: E402
    DRAFT,
    UPSTREAM_TARGETS,
    DiskSampler,
    benchmark_seconds,
    capture_bytes,
    set_mode,
    sha256,
    stream_test_config,
    tree_bytes,
    untimed_metrics,
)
from workflow_support import (  # noqa: E402
    clone_workdir,
    merge,
    prepare_tiny_workdir,
    run_snakemake,
    write_config,
)


def job_seconds(workdir: Path, mode: str) -> dict:
    """Wall seconds of every train capture and training job of a finished copy (its Snakemake
    benchmark files), and the checkpoint bytes it keeps."""
    if mode == "streamed":
        captures = sorted(workdir.glob("benchmarks/stream/link-*/extract.tsv"))
        trains = [*sorted(workdir.glob("benchmarks/stream/link-*/train.tsv"))]
        trains.append(workdir / "benchmarks/train.tsv")
    else:
        captures = sorted(workdir.glob("benchmarks/extract/train/*.tsv"))
        trains = [workdir / "benchmarks/train.tsv"]
    return {
        "capture_job_seconds": [
            round(benchmark_seconds(path.parent, path.name), 2) for path in captures
        ],
        "train_job_seconds": [
            round(benchmark_seconds(path.parent, path.name), 2) for path in trains
        ],
        "final_checkpoint_bytes": tree_bytes(workdir / "results" / "train" / "checkpoints"),
    }


# One GPU for every job: the engines take a share of it sized by profiling, the trainer the rest.
GPU_OVERLAY = {
    "engine": {"device": "gpu"},
    "extract": {"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": None},
    "bench": {"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": None, "starts": "in_turn"},
    "resources": {"train_gpus": 1},
}
GPU_SNAKEMAKE_ARGS = ("--cores", "8", "--resources", "gpu=1")
CPU_SNAKEMAKE_ARGS = ("--cores", "2")


def machine(gpu: bool) -> str:
    cores = os.cpu_count()
    if not gpu:
        return f"{platform.machine()} {platform.system()}, {cores} cores, vLLM CPU build"
    import torch
    import vllm

    return (
        f"one {torch.cuda.get_device_name()}, {cores} CPU cores; torch {torch.__version__}, "
        f"vLLM {vllm.__version__}"
    )


def measured_run(workdir: Path, mode: str, snakemake_args: tuple[str, ...]) -> dict:
    results = workdir / "results"
    sampler = DiskSampler(
        {
            "results_bytes": lambda: tree_bytes(results),
            "train_capture_bytes": lambda: (
                capture_bytes(results / "stream")
                if mode == "streamed"
                else tree_bytes(results / "extract" / "train")
            ),
        }
    )
    start = time.perf_counter()
    with sampler.running():
        run_snakemake(workdir, DRAFT, *snakemake_args, timeout=3600)
    wall = time.perf_counter() - start
    if mode == "streamed":
        capture = benchmark_seconds(workdir, "benchmarks/stream/link-*/extract.tsv")
        train = benchmark_seconds(workdir, "benchmarks/stream/link-*/train.tsv")
        train += benchmark_seconds(workdir, "benchmarks/train.tsv")
    else:
        capture = benchmark_seconds(workdir, "benchmarks/extract/train/*.tsv")
        train = benchmark_seconds(workdir, "benchmarks/train.tsv")
    return {
        "wall_seconds": round(wall, 2),
        "train_capture_seconds": round(capture, 2),
        "train_seconds": round(train, 2),
        "peak_results_bytes": sampler.peak["results_bytes"],
        "peak_train_capture_bytes": sampler.peak["train_capture_bytes"],
        "final_results_bytes": tree_bytes(results),
        "draft_sha256": sha256(workdir / DRAFT / "model.safetensors"),
        **job_seconds(workdir, mode),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True, help="a prepared SmolLM2 target")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--backend", default="hooks", help="extract.backend (hooks: vLLM)")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gpu", action="store_true", help="every job on one GPU")
    parser.add_argument(
        "--runs", nargs="+", choices=("stored", "streamed"), default=["stored", "streamed"]
    )
    parser.add_argument(
        "--keep-workdir", action="store_true", help="reuse the upstream run a former call left"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    config = stream_test_config(backend=args.backend)
    if args.gpu:
        config = merge(config, GPU_OVERLAY)
    snakemake_args = GPU_SNAKEMAKE_ARGS if args.gpu else CPU_SNAKEMAKE_ARGS
    upstream = args.workdir / "upstream"
    if not (args.keep_workdir and upstream.is_dir()):
        shutil.rmtree(args.workdir, ignore_errors=True)
        prepare_tiny_workdir(upstream, args.target)
        write_config(upstream, config)
    run_snakemake(upstream, *UPSTREAM_TARGETS, *snakemake_args, timeout=3600)

    runs = {}
    stored = args.workdir / "stored"
    if "stored" in args.runs:
        shutil.rmtree(stored, ignore_errors=True)
        clone_workdir(upstream, stored)
        runs["stored"] = measured_run(stored, "stored", snakemake_args)
    for window in args.windows if "streamed" in args.runs else ():
        shutil.rmtree(args.workdir / f"streamed-w{window}", ignore_errors=True)
        streamed = clone_workdir(upstream, args.workdir / f"streamed-w{window}")
        set_mode(streamed, "streamed", window=window)
        runs[f"streamed_window_{window}"] = measured_run(streamed, "streamed", snakemake_args)
        if (stored / DRAFT).is_dir():
            runs[f"streamed_window_{window}"]["metrics_equal_stored"] = untimed_metrics(
                streamed
            ) == untimed_metrics(stored)
    record = {
        "machine": machine(args.gpu),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", "perf/streamed_vs_stored.py", *(argv or sys.argv[1:])]),
        "workflow": (
            "tests/configs/tiny.yaml over config/demo.yaml (SmolLM2-135M) with "
            f"{'engine.device gpu, ' if args.gpu else ''}"
            f"extract.num_shards.train {config['extract']['num_shards']['train']}, "
            f"train.epochs {config['train']['epochs']}, train.order by_shard, "
            f"extract.backend {args.backend}, extract.deterministic "
            f"{config['extract']['deterministic']}"
        ),
        "largest_train_store_bytes": max(
            (tree_bytes(d) for d in (stored / "results" / "extract" / "train").glob("shard-*")),
            default=None,
        ),
        "runs": runs,
        "same_draft": len({run["draft_sha256"] for run in runs.values()}) == 1,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
