"""What the fp8 capture store costs: bf16 and fp8 stores of the same shards, drafts trained on each.

Run in a workdir whose stages up to the shards and the vocabulary have run (``results/shard``,
``results/vocab``, ``resources/target``) by ``make demo``: its config is config/demo.yaml over
the workdir's config/config.yaml, as that run merged them. Each phase is one
command and writes one JSON under ``--out``; ``report`` gathers them into one file:

- ``extract``: one hooks engine captures every shard into a bf16 and an fp8 store, in turns
  (extract tokens/s of each, verification included), then compares the stores (cosine of the
  dequantized fp8 states to bf16 per layer, and on the tokens with massive activations) and the
  plan's estimate with the bytes written;
- ``compare``: the store comparison of ``extract`` again, from the stores on disk;
- ``train --dtype D``: the config's draft trained on the D stores (same seed and steps for both);
  train tokens/s (median of the logged steps) and val accuracy per position;
- ``bench --dtype D``: that draft in a vLLM engine at ``--k`` on the config's first prompt set:
  acceptance length tau;
- ``report --json docs/results/store_dtype_cost.json``.

Usage (docs/storage.md, "bf16 or fp8")::

    PYTHONPATH=$PWD .venv/bin/python studies/store_dtype_cost.py extract --out results/dtype-cost
    PYTHONPATH=$PWD .venv/bin/python studies/store_dtype_cost.py train --dtype bfloat16 --steps 200
    PYTHONPATH=$PWD .venv/bin/python studies/store_dtype_cost.py train --dtype float8_e4m3fn --steps 200
    PYTHONPATH=$PWD .venv/bin/python studies/store_dtype_cost.py bench --dtype bfloat16
    PYTHONPATH=$PWD .venv/bin/python studies/store_dtype_cost.py bench --dtype float8_e4m3fn
    PYTHONPATH=$PWD .venv/bin/python studies/store_dtype_cost.py report --json docs/results/store_dtype_cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

DTYPES = ("bfloat16", "float8_e4m3fn")
RESULTS = Path("results")
TARGET = Path("resources/target")
# A row (token, layer) is a "massive activation" when its largest |value| exceeds this many
# times the median of that layer's rows: the few tokens whose magnitude dwarfs the rest.
MASSIVE_FACTOR = 10.0


def load_config() -> dict:
    from draftflow import config

    # As the workdir's make demo merged it: config/demo.yaml over its own config/config.yaml.
    return config.load_config(Path("config/demo.yaml"), base=Path("config/config.yaml"))


def shard_inputs() -> dict[str, Path]:
    return {
        split: path
        for split in ("train", "val")
        for path in sorted((RESULTS / "shard" / split).glob("shard-*.parquet"))
    }


def store_dir(out: Path, dtype: str, split: str) -> Path:
    return out / dtype / "extract" / split / "shard-00000"


def chunk_bytes(directory: Path) -> tuple[int, int]:
    """(tensor bytes, file bytes) of a store's chunks."""
    tensors = files = 0
    for chunk in directory.glob("chunk-*.safetensors"):
        with open(chunk, "rb") as handle:
            header = int.from_bytes(handle.read(8), "little")
        size = chunk.stat().st_size
        tensors, files = tensors + size - 8 - header, files + size
    return tensors, files


def compare_stores(bf16_dir: Path, fp8_dir: Path, layer_ids: list[int]) -> dict:
    """Per layer: cosine of dequantized fp8 to bf16 over every token, and over massive tokens."""
    from draftflow.capture.store import CaptureReader

    bf16, fp8 = CaptureReader(bf16_dir), CaptureReader(fp8_dir)
    cosines, amaxes, rel_err = [], [], []
    for i in range(len(bf16)):
        want, got = bf16.hidden_states(i), fp8.hidden_states(i)
        cosines.append(torch.nn.functional.cosine_similarity(got, want, dim=-1))
        amaxes.append(want.abs().amax(-1))
        rel_err.append((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12))
    cos, amax, err = torch.cat(cosines), torch.cat(amaxes), torch.cat(rel_err)
    big = amax > MASSIVE_FACTOR * amax.median(dim=0).values
    summary = {}
    for column, layer in enumerate(layer_ids):
        values = cos[:, column].contiguous()
        rank = max(1, math.ceil(0.01 * values.numel()))
        flagged = big[:, column]
        summary[str(layer)] = {
            "mean_cosine": float(values.mean()),
            "p01_cosine": float(values.kthvalue(rank).values),
            "min_cosine": float(values.min()),
            "mean_relative_error": float(err[:, column].mean()),
            "median_row_amax": float(amax[:, column].median()),
            "max_row_amax": float(amax[:, column].max()),
            "massive_tokens": int(flagged.sum()),
            "massive_mean_cosine": float(values[flagged].mean()) if flagged.any() else None,
            "massive_mean_relative_error": float(err[flagged, column].mean())
            if flagged.any()
            else None,
        }
    return {"tokens": int(cos.shape[0]), "per_layer": summary}


def phase_extract(args: argparse.Namespace) -> dict:
    from draftflow.capture.backends import make_backend
    from draftflow.capture.extract import extract_settings, run_extract
    from draftflow.capture.layers import capture_layers
    from draftflow.capture.plan import plan_extract
    from draftflow.data.samples import read_samples
    from draftflow.io import read_json

    config = load_config()
    base = extract_settings(config)
    layers = capture_layers(TARGET, base.aux_layers)
    shards = shard_inputs()
    longest = max(
        max(map(len, read_samples(p).column("input_ids").to_pylist())) for p in shards.values()
    )
    backend = make_backend("hooks", TARGET, layers.layer_ids, base.capture_engine(longest + 1))
    runs = []
    try:
        for split, shard in shards.items():
            # bf16 then fp8, then fp8 then bf16 on a second pass: drift on a shared machine
            # (another job starting) falls on both.
            orders = [DTYPES, DTYPES[::-1]][: args.passes]
            for pass_index, order in enumerate(orders):
                for dtype in order:
                    settings = dataclasses.replace(base, backend="hooks", store_dtype=dtype)
                    out = store_dir(args.out, dtype, split)
                    began = time.monotonic()
                    manifest = run_extract(shard, TARGET, out, settings, backend=backend)
                    seconds = time.monotonic() - began
                    tensors, files = chunk_bytes(out)
                    runs.append(
                        {
                            "split": split,
                            "pass": pass_index,
                            "dtype": dtype,
                            "tokens": manifest["num_tokens"],
                            "seconds": seconds,
                            "tokens_per_s": manifest["num_tokens"] / seconds,
                            "tensor_bytes": tensors,
                            "chunk_file_bytes": files,
                            "verification": manifest["verification"]["per_layer"],
                        }
                    )
                    logging.info("%s %s: %.0f tokens/s", split, dtype, runs[-1]["tokens_per_s"])
    finally:
        backend.close()
    plans = {
        dtype: plan_extract(
            read_json(RESULTS / "shard" / "manifest.json"),
            layers,
            dtype,
            base.chunk_samples,
            args.out / dtype,
            margin_bytes=0,
            window=None,  # the stored layout
        )
        for dtype in DTYPES
    }
    return {
        "runs": runs,
        "plans": {
            dtype: {
                "bytes_per_token": plan["bytes_per_token"],
                "tensor_bytes": plan["tensor_bytes"],
                "total_bytes": plan["total_bytes"],
                "written_tensor_bytes": sum(
                    chunk_bytes(store_dir(args.out, dtype, split))[0] for split in shards
                ),
                "written_bytes": sum(
                    p.stat().st_size
                    for split in shards
                    for p in store_dir(args.out, dtype, split).iterdir()
                ),
            }
            for dtype, plan in plans.items()
        },
        "fp8_vs_bf16": {
            split: compare_stores(
                store_dir(args.out, "bfloat16", split),
                store_dir(args.out, "float8_e4m3fn", split),
                layers.layer_ids,
            )
            for split in shards
        },
    }


def phase_compare(args: argparse.Namespace) -> dict:
    """Redo extract.json's store comparison from the stores on disk (no engine)."""
    from draftflow.io import read_json

    result = read_json(args.out / "extract.json")
    layer_ids = read_json(store_dir(args.out, "bfloat16", "train") / "manifest.json")["layer_ids"]
    result["fp8_vs_bf16"] = {
        split: compare_stores(
            store_dir(args.out, "bfloat16", split),
            store_dir(args.out, "float8_e4m3fn", split),
            layer_ids,
        )
        for split in ("train", "val")
    }
    return result


def phase_train(args: argparse.Namespace) -> dict:
    from draftflow.config import from_section
    from draftflow.train.job import TrainJob
    from draftflow.train.loop import train
    from draftflow.train.settings import TrainSettings

    config = load_config()
    section = dict(config["train"])
    if args.steps:
        section["max_steps"] = args.steps
    settings = from_section(TrainSettings, section, "train")
    work = args.out / args.dtype / "train"
    job = TrainJob(
        target_dir=str(TARGET),
        vocab_path=str(RESULTS / "vocab" / "vocab.safetensors"),
        train_shards=[str(store_dir(args.out, args.dtype, "train"))],
        val_shards=[str(store_dir(args.out, args.dtype, "val"))],
        draft_dir=str(work / "draft"),
        metrics_path=str(work / "metrics.jsonl"),
        checkpoint_dir=str(work / "checkpoints"),
        settings=settings,
        trust_remote_code=config["target"]["trust_remote_code"],
    )
    began = time.monotonic()
    summary = train(job)
    seconds = time.monotonic() - began
    records = [json.loads(line) for line in Path(job.metrics_path).read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train" and "tokens_per_s" in r]
    vals = [r for r in records if r["kind"] == "val"]
    return {
        "dtype": args.dtype,
        "settings": settings.to_dict(),
        "seconds": seconds,
        "train_tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in steps),
        "train_tokens": sum(r["tokens"] for r in steps),
        "val": [
            {
                "step": r["step"],
                "loss": r["loss"],
                "full_acc": r["full_acc"],
                "cond_acc": r["cond_acc"],
            }
            for r in vals
        ],
        "summary": summary,
    }


def phase_bench(args: argparse.Namespace) -> dict:
    from draftflow.bench.prompts import read_prompts
    from draftflow.bench.run import engine_request, run_engines
    from draftflow.bench.settings import bench_settings

    config = load_config()
    bench = config["bench"]
    name = bench["datasets"][0]["name"]
    prompts = read_prompts(RESULTS / "bench" / "prompts" / f"{name}.jsonl")
    # The plain target beside the draft's engine, measured in the same rounds (the bench stage's
    # paired design), so the speed-up of each store's draft is a ratio of paired times.
    ks = [0, args.k]
    request = engine_request(
        target=str(TARGET),
        draft=str(args.out / args.dtype / "train" / "draft"),
        ks=ks,
        prompt_sets={name: prompts},
        settings=bench_settings(config),
    )
    paths = {k: args.out / args.dtype / f"bench-k{k}.json" for k in ks}
    results = run_engines(request, paths)
    return {
        "dtype": args.dtype,
        "k": args.k,
        "dataset": name,
        "runs": results[args.k]["runs"],
        "plain_runs": results[0]["runs"],
    }


def _without_responses(result: dict) -> dict:
    # The answers' texts and token ids are for the lossless check, not for the figures.
    stripped = {
        key: [{k: v for k, v in run.items() if k != "responses"} for run in result[key]]
        for key in ("runs", "plain_runs")
        if key in result
    }
    return {**result, **stripped}


def phase_report(args: argparse.Namespace) -> dict:
    from draftflow.io import atomic_write_json, read_json

    benched = [d for d in DTYPES if (args.out / f"bench-{d}.json").exists()]

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "cpu",
    )
    report = {
        "command": "studies/store_dtype_cost.py (docs/storage.md, 'bf16 or fp8')",
        "machine": f"{platform.machine()} {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "notes": args.notes,
        "extract": read_json(args.out / "extract.json"),
        "train": {d: read_json(args.out / f"train-{d}.json") for d in DTYPES},
        "bench": {d: _without_responses(read_json(args.out / f"bench-{d}.json")) for d in benched},
    }
    atomic_write_json(args.json, report)
    return report


def main(argv: list[str] | None = None) -> None:
    from draftflow.io import atomic_write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["extract", "compare", "train", "bench", "report"])
    parser.add_argument("--out", type=Path, default=RESULTS / "dtype-cost")
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--steps", type=int, default=None, help="train: max_steps (both runs)")
    parser.add_argument("--passes", type=int, default=1, choices=[1, 2], help="extract passes")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("docs/results/store_dtype_cost.json"))
    parser.add_argument("--notes", default="", help="report: what was run, in words")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.phase in ("train", "bench") and not args.dtype:
        parser.error(f"{args.phase} needs --dtype")
    result = {
        "extract": phase_extract,
        "compare": phase_compare,
        "train": phase_train,
        "bench": phase_bench,
        "report": phase_report,
    }[args.phase](args)
    if args.phase != "report":
        suffix = f"-{args.dtype}" if args.dtype else ""
        name = "extract" if args.phase == "compare" else args.phase
        atomic_write_json(args.out / f"{name}{suffix}.json", result)


if __name__ == "__main__":
    main()
