"""The demo's draft trained on a GPU and on the CPU from the same CPU-extracted shards.

Does training on the GPU (bf16 autocast, flex attention, padded batches) reach
the val accuracy of the CPU (fp32, SDPA)? Both runs use the train rule's code path
(``draftflow.train.cli.launch`` with a ``TrainJob`` built as ``scripts/train.py`` builds it from
config/demo.yaml's ``train:`` section); only ``device`` and ``threads`` differ, plus an
optional ``--epochs`` override used by both runs alike.

``pack`` copies a small subset, so what the GPU node needs fits in one small transfer:

- the val samples in file order up to ``--val-max-mb`` of hidden states, then the train
  samples in file order up to ``--max-mb`` in all, rewritten with the capture stage's
  ``CaptureWriter`` (same layers and provenance);
- the draft vocabulary;
- the target's ``config.json`` and the three tensors the draft reads from it (embeddings,
  lm_head when untied, final norm). Rows that neither a sample's tokens, token 0 (the padding
  of later TTT steps) nor the draft vocabulary use are zeroed so the file compresses: training
  never reads them, so the runs train exactly as with the full target.

Files are gzipped; ``train`` unpacks them to a scratch folder first::

    python studies/gpu_vs_cpu_train.py pack --results results --target resources/target --out .gpu-e2e
    python studies/gpu_vs_cpu_train.py train --data .gpu-e2e --work /tmp/e2e --device cpu --threads 1
    python studies/gpu_vs_cpu_train.py train --data .gpu-e2e --work /tmp/e2e --device cuda
    python studies/gpu_vs_cpu_train.py compare cpu/metrics-cpu.jsonl gpu/metrics-cuda.jsonl ...
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_KEYS = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")


def _gzip(source: Path, dest: Path) -> None:
    with source.open("rb") as raw, gzip.open(dest, "wb", compresslevel=6) as packed:
        shutil.copyfileobj(raw, packed, 1 << 20)


def _copy_subset(shard_dirs: list[Path], out: Path, max_bytes: float | None) -> dict:
    """Samples of ``shard_dirs`` in order (until ``max_bytes`` of states) into one new shard."""

    from draftflow.capture.store import CaptureReader, CaptureWriter

    readers = [CaptureReader(d) for d in shard_dirs]
    first = readers[0].manifest
    writer = CaptureWriter(
        out,
        layer_ids=first["layer_ids"],
        aux_layer_ids=first["aux_layer_ids"],
        hidden_size=first["hidden_size"],
        meta={**first.get("meta", {}), "subset_of": [str(d) for d in shard_dirs]},
        # Chunked and stored as the source shards are.
        chunk_samples=first["chunk_samples"],
        store_dtype=first["store_dtype"],
    )
    per_token = 2 * len(first["layer_ids"]) * int(first["hidden_size"])
    used, samples, tokens = 0, 0, set()
    for reader in readers:
        for i, sample_id in enumerate(reader.sample_ids):
            size = reader.num_tokens[i] * per_token
            if max_bytes is not None and used + size > max_bytes:
                break
            sample = reader.get(i)
            writer.add(sample_id, sample["input_ids"], sample["loss_mask"], sample["hidden_states"])
            tokens.update(sample["input_ids"].tolist())
            used += size
            samples += 1
        else:
            continue
        break
    writer.close()
    total = sum(len(r) for r in readers)
    return {"samples": samples, "of": total, "state_bytes": used, "token_ids": tokens}


def _keep_rows(weight, rows):
    # where, not a product: 0 * a negative weight is -0.0, whose sign bits do not compress.
    import torch

    return torch.where(rows[:, None], weight, torch.zeros_like(weight))


def _reduced_target(target: Path, out: Path, keep_rows: set[int], t2d) -> dict:
    """config.json + the draft's tensors from the target, unused rows zeroed."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    found: dict[str, torch.Tensor] = {}
    for path in sorted(target.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key in TARGET_KEYS:
                    found[key] = handle.get_tensor(key)
    if "model.embed_tokens.weight" not in found:
        raise ValueError(f"{target} has no model.embed_tokens.weight in its safetensors")
    embed = found["model.embed_tokens.weight"]
    rows = torch.zeros(embed.shape[0], dtype=torch.bool)
    rows[sorted(keep_rows)] = True
    if "lm_head.weight" not in found:
        # Tied: the draft's lm_head is the embedding restricted to the draft vocabulary.
        rows |= t2d.to(torch.bool)
    else:
        found["lm_head.weight"] = _keep_rows(found["lm_head.weight"], t2d.to(torch.bool))
    found["model.embed_tokens.weight"] = _keep_rows(embed, rows)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(target / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in found.items()}, str(out / "model.safetensors"))
    return {"kept_rows": int(rows.sum()), "rows": int(rows.numel()), "keys": sorted(found)}


def pack(args: argparse.Namespace) -> None:
    from draftflow.train.vocab import read_vocab

    out: Path = args.out
    staging = out.with_name(out.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    extract = args.results / "extract"
    train_dirs = sorted((extract / "train").glob("shard-*"))
    val_dirs = sorted((extract / "val").glob("shard-*"))
    val = _copy_subset(val_dirs, staging / "val" / "shard-00000", args.val_max_mb * 2**20)
    budget = args.max_mb * 2**20 - val["state_bytes"]
    train = _copy_subset(train_dirs, staging / "train" / "shard-00000", budget)
    vocab = args.results / "vocab" / "vocab.safetensors"
    shutil.copy(vocab, staging / "vocab.safetensors")
    _, t2d = read_vocab(vocab)
    target = _reduced_target(
        args.target, staging / "target", train["token_ids"] | val["token_ids"] | {0}, t2d
    )
    out.mkdir(parents=True)
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        dest = out / path.relative_to(staging)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            _gzip(path, dest.with_name(dest.name + ".gz"))
        else:
            shutil.copy(path, dest)
    shutil.rmtree(staging)
    info = {
        "source": str(args.results),
        "train": {k: v for k, v in train.items() if k != "token_ids"},
        "val": {k: v for k, v in val.items() if k != "token_ids"},
        "target": target,
        "packed_bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
    }
    (out / "packed.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info))


def unpack(data: Path, work: Path) -> Path:
    """The packed folder with its .gz files expanded, under ``work/data``."""
    dest_root = work / "data"
    shutil.rmtree(dest_root, ignore_errors=True)
    for path in sorted(p for p in data.rglob("*") if p.is_file()):
        dest = dest_root / path.relative_to(data)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as packed, dest.with_suffix("").open("wb") as raw:
                shutil.copyfileobj(packed, raw, 1 << 20)
        else:
            shutil.copy(path, dest)
    return dest_root


def train(args: argparse.Namespace) -> None:
    import torch

    from draftflow.config import DEMO_CONFIG, from_section, load_config
    from draftflow.train.cli import launch
    from draftflow.train.job import TrainJob
    from draftflow.train.metrics import read_metrics
    from draftflow.train.settings import TrainSettings

    data = unpack(args.data, args.work)
    config = load_config(DEMO_CONFIG)
    settings = from_section(TrainSettings, config["train"], "train")
    overrides = {"device": args.device, "threads": args.threads}
    if args.epochs is not None:
        overrides["epochs"] = args.epochs
    if args.seed is not None:
        overrides["seed"] = args.seed
    tag = args.device if args.seed is None else f"{args.device}-seed{args.seed}"
    settings = dataclasses.replace(settings, **overrides)
    run = args.work / tag
    shutil.rmtree(run, ignore_errors=True)
    job = TrainJob(
        target_dir=str(data / "target"),
        vocab_path=str(data / "vocab.safetensors"),
        train_shards=[str(data / "train" / "shard-00000")],
        val_shards=[str(data / "val" / "shard-00000")],
        draft_dir=str(run / "draft"),
        metrics_path=str(run / "metrics.jsonl"),
        checkpoint_dir=str(run / "checkpoints"),
        settings=settings,
        trust_remote_code=config["target"]["trust_remote_code"],
    )
    began = time.perf_counter()
    launch(job, 1 if args.device == "cuda" else 0)
    seconds = time.perf_counter() - began
    records = read_metrics(job.metrics_path)
    steps = [r for r in records if r["kind"] == "train"]
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "settings": settings.to_dict(),
        "steps": len(steps),
        "train_tokens": sum(r["tokens"] for r in steps),
        "wall_s": round(seconds, 1),
        "val": [r for r in records if r["kind"] == "val"],
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(job.metrics_path, args.out / f"metrics-{tag}.jsonl")
        (args.out / f"result-{tag}.json").write_text(json.dumps(result, indent=2))
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "settings"}))


def compare(args: argparse.Namespace) -> None:
    """Val records of several runs, step by step (full accuracy per TTT position, loss), and
    each run's final full accuracy minus the first run's, against one binomial standard error."""
    from draftflow.train.metrics import read_metrics

    runs = [[r for r in read_metrics(p) if r["kind"] == "val"] for p in args.metrics]
    names = [p.stem.removeprefix("metrics-") for p in args.metrics]
    print("| step | run | val loss | full acc pos 1 / 2 / 3 | cond acc pos 1 / 2 / 3 | positions |")
    print("|---|---|---|---|---|---|")
    for records in zip(*runs, strict=True):
        for name, r in zip(names, records, strict=True):
            full = " / ".join(f"{a:.3f}" for a in r["full_acc"])
            cond = " / ".join(f"{a:.3f}" for a in r["cond_acc"])
            print(
                f"| {r['step']} | {name} | {r['loss']:.4f} | {full} | {cond} | "
                f"{r['positions']:.0f} |"
            )
    first = runs[0][-1]
    n = first["positions"]
    # Binomial standard error of an accuracy measured on n positions (a yardstick for "noise").
    errors = [math.sqrt(max(a * (1 - a), 1e-12) / n) for a in first["full_acc"]]
    print(f"one binomial standard error ({names[0]}): " + " / ".join(f"{e:.3f}" for e in errors))
    for name, records in zip(names[1:], runs[1:], strict=True):
        diffs = [b - a for a, b in zip(first["full_acc"], records[-1]["full_acc"], strict=True)]
        print(f"final full acc {name} - {names[0]}: " + " / ".join(f"{d:+.3f}" for d in diffs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--results", type=Path, default=REPO / "results")
    p.add_argument("--target", type=Path, default=REPO / "resources" / "target")
    p.add_argument("--out", type=Path, default=REPO / ".gpu-e2e")
    p.add_argument("--max-mb", type=float, default=40.0, help="hidden states carried, MiB")
    p.add_argument("--val-max-mb", type=float, default=10.0, help="of which val, at most")
    p = sub.add_parser("train")
    p.add_argument("--data", type=Path, default=REPO / ".gpu-e2e")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--epochs", type=int, help="override train.epochs (both runs alike)")
    p.add_argument("--seed", type=int, help="override train.seed (run-to-run spread)")
    p.add_argument("--out", type=Path, help="copy metrics.jsonl and a result JSON here")
    p = sub.add_parser("compare")
    p.add_argument(
        "metrics", nargs="+", type=Path, help="metrics.jsonl files; the first is the base"
    )
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    {"pack": pack, "train": train, "compare": compare}[args.what](args)


if __name__ == "__main__":
    main()
