"""Draft training throughput: packed train tokens per second for the demo's draft.

Builds a synthetic capture store (random hidden states of the target's shape, written with the
capture stage's CaptureWriter) and a draft vocabulary, then runs the real training loop for a few
steps. Reports the median tokens/s of the timed steps (the first ``--warmup`` steps excluded).

Usage (results go to a JSON file in docs/results/ with machine, date and command)::

    .venv/bin/python perf/train_throughput.py --target .test-cache/smollm2 \\
        --tokens-per-batch 2048 --steps 8 --threads 1 [--store-dtype float8_e4m3fn]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from synthetic_store import write_synthetic_store  # perf/, beside this script


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="resources/target")
    parser.add_argument("--tokens-per-batch", type=int, default=2048)
    parser.add_argument("--sample-length", type=int, default=512)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--gpus", type=int, default=0, help="> 1: data parallel under torchrun")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    parser.add_argument(
        "--attn-impl",
        default="auto",
        choices=["auto", "packed_sdpa", "sdpa"],
        help="draft attention (auto: flex attention on GPUs, packed_sdpa on the CPU)",
    )
    parser.add_argument(
        "--store-dtype",
        default="bfloat16",
        choices=["bfloat16", "float8_e4m3fn"],
        help="capture store dtype (fp8 is dequantized where the batch is built)",
    )
    args = parser.parse_args(argv)

    from draftflow.config import DEMO_CONFIG, from_section, load_config
    from draftflow.train.cli import launch
    from draftflow.train.job import TrainJob
    from draftflow.train.metrics import read_metrics
    from draftflow.train.settings import TrainSettings

    with tempfile.TemporaryDirectory(prefix="train-throughput-") as tmp:
        root = Path(tmp)
        per_batch = max(1, args.tokens_per_batch // (args.sample_length - 1))
        samples = per_batch * args.steps * max(1, args.gpus)
        dirs = write_synthetic_store(
            root,
            args.target,
            train_samples=samples,
            val_samples=2,
            length=args.sample_length,
            draft_vocab=args.draft_vocab,
            store_dtype=args.store_dtype,
        )
        # The demo's train section (config/demo.yaml) with this measurement's sizes.
        config = load_config(DEMO_CONFIG)
        settings = from_section(
            TrainSettings,
            {
                **config["train"],
                "num_layers": args.num_layers,
                "ttt_steps": args.ttt_steps,
                "tokens_per_batch": args.tokens_per_batch,
                "max_steps": args.steps,
                "eval_every": 10**9,
                "checkpoint_every": 10**9,
                "threads": args.threads,
                "precision": args.precision,
                "optimizer": args.optimizer,
                "attn_impl": args.attn_impl,
            },
            "train",
        )
        job = TrainJob(
            target_dir=args.target,
            vocab_path=str(root / "vocab.safetensors"),
            train_shards=dirs["train"],
            val_shards=dirs["val"],
            draft_dir=str(root / "draft"),
            metrics_path=str(root / "metrics.jsonl"),
            checkpoint_dir=str(root / "checkpoints"),
            settings=settings,
            trust_remote_code=config["target"]["trust_remote_code"],
        )
        launch(job, args.gpus)
        steps = [r for r in read_metrics(job.metrics_path) if r["kind"] == "train"]
    # With several ranks a step's tokens and tokens/s are summed over them.
    timed = [r["tokens_per_s"] for r in steps[args.warmup :]]
    result = {
        "machine": _machine(),
        "device": "cuda" if _cuda() else "cpu",
        "gpus": args.gpus,
        "threads": args.threads,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "attn_impl": args.attn_impl,
        "sample_length": args.sample_length,
        "store_dtype": args.store_dtype,
        "tokens_per_batch": args.tokens_per_batch,
        "draft_vocab": args.draft_vocab,
        "num_layers": args.num_layers,
        "ttt_steps": args.ttt_steps,
        "timed_steps": len(timed),
        "tokens_per_s_median": statistics.median(timed),
        "tokens_per_s_min": min(timed),
        "tokens_per_s_max": max(timed),
    }
    print(json.dumps(result, indent=2))


def _machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"{platform.machine()} {platform.processor()} {os.cpu_count()} CPUs"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
