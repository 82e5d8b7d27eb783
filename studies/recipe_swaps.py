"""One training setting changed at a time on a finished workdir's data (issue 18: which part of
the recipe separates draftflow's draft from speculators' defaults).

Given a workdir whose Snakemake run reached the train stage (its ``results/extract`` shards,
``results/vocab`` and ``resources/target``), each ``--swap key=value`` trains the draft again
through the train rule's own code (``draftflow.train.cli.launch`` with a ``TrainJob`` built as
``scripts/train.py`` builds it) with that one setting changed, into ``--out/<swap>/``. The
workdir's own training (``results/train/metrics.jsonl``) is the baseline. Keys are the config's:
``train.<setting>`` or ``vocab.draft_vocab_size`` (which writes a vocabulary of that size from
the workdir's token counts first). Settings joined by commas change together in one variant
(``train.epochs=20,train.tokens_per_batch=8192``). A variant already trained is read, not
trained again.

``summary.json`` then holds each variant's last validation (accuracy per position, loss, steps)
and its training seconds; with ``--bench-ks`` each variant's draft is also benched as the
workdir's bench stage benches its own (``workdir_study.py``: its prompts, target and settings, at
those k), and the summary holds its τ beside the workdir's own bench.

Usage::

    python studies/recipe_swaps.py run --workdir W --out S --swap train.epochs=6 \\
        --swap train.optimizer=muon --swap vocab.draft_vocab_size=49152
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import yaml
from workdir_study import add_run_parser, workdir_config

# The demo's workdir (make demo: --configfile config/demo.yaml).
CONFIG_FILES: tuple[str, ...] = ("config/demo.yaml",)
SECTIONS = ("train", "vocab")


def parse_swap(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` as (section, key, value), the value read as YAML (numbers, names)."""
    name, separator, value = text.partition("=")
    section, _, key = name.partition(".")
    if not separator or not key or section not in SECTIONS:
        raise ValueError(
            f"a swap is train.<key>=<value> or vocab.draft_vocab_size=<n>, got {text!r}"
        )
    if section == "vocab" and key != "draft_vocab_size":
        raise ValueError(f"of the vocab section only draft_vocab_size can be swapped, got {key!r}")
    return section, key, yaml.safe_load(value)


def parse_variant(text: str) -> list[tuple[str, str, Any]]:
    """A variant's settings: one swap, or several joined by commas, each as ``parse_swap``."""
    swaps = [parse_swap(part) for part in text.split(",")]
    names = [(section, key) for section, key, _ in swaps]
    if len(set(names)) != len(names):
        raise ValueError(f"a variant sets each key once, got {text!r}")
    return swaps


def swap_name(text: str) -> str:
    """A directory name for a swap: ``train.epochs=6`` -> ``train.epochs-6``; a variant's
    settings are joined by ``_``."""
    return text.replace("=", "-").replace("/", "_").replace(",", "_")


def last_val(metrics: Path) -> dict[str, Any]:
    """What the summary keeps of a metrics file's last validation."""
    from draftflow.train.metrics import last_val as last_val_record

    record = last_val_record(metrics)
    return {key: record[key] for key in ("step", "loss", "full_acc")}


def variant_job(workdir: Path, out: Path, config: dict[str, Any], swap: str, device: str | None):
    """The train rule's job for ``workdir`` with ``swap``'s settings applied, writing under
    ``out``."""
    import dataclasses

    from draftflow.config import from_section
    from draftflow.train.job import TrainJob
    from draftflow.train.settings import TrainSettings
    from draftflow.train.vocab import write_vocab

    train = dict(config["train"])
    vocab = workdir / "results" / "vocab" / "vocab.safetensors"
    for section, key, value in parse_variant(swap):
        if section == "train":
            train[key] = value
            continue
        vocab = out / "vocab.safetensors"
        if not vocab.exists():
            write_vocab(
                workdir / "results" / "tokenize" / "token_freq.safetensors",
                vocab,
                out / "vocab-summary.json",
                draft_vocab_size=int(value),
            )
    if device:
        train["device"] = device
    settings = from_section(TrainSettings, train, "train")
    if settings.threads == 0:  # the rule's threads: here the whole machine
        import os

        settings = dataclasses.replace(settings, threads=os.cpu_count() or 1)
    extract = workdir / "results" / "extract"
    return TrainJob(
        target_dir=str(workdir / "resources" / "target"),
        vocab_path=str(vocab),
        train_shards=sorted(str(path) for path in (extract / "train").iterdir() if path.is_dir()),
        val_shards=sorted(str(path) for path in (extract / "val").iterdir() if path.is_dir()),
        draft_dir=str(out / "draft"),
        metrics_path=str(out / "metrics.jsonl"),
        checkpoint_dir=str(out / "checkpoints"),
        settings=settings,
        trust_remote_code=config["target"]["trust_remote_code"],
    )


def bench_variant(
    workdir: Path, config: dict[str, Any], out: Path, ks: list[int]
) -> dict[str, list[dict[str, Any]]]:
    """The variant's draft benched at ``ks`` (once: ``bench/done.json`` marks it), its rows."""
    from workdir_study import bench_draft

    from draftflow.bench.tables import read_speculative_rows
    from draftflow.io import atomic_write_json

    done = out / "bench" / "done.json"
    if not done.exists():
        names = bench_draft(workdir, config, out / "draft", ks, out / "bench")
        atomic_write_json(done, {"datasets": names, "ks": ks})
    return read_speculative_rows(out / "bench")


def run(args: argparse.Namespace) -> None:
    from draftflow.bench.tables import read_speculative_rows
    from draftflow.io import atomic_write_json, read_json
    from draftflow.train.cli import launch

    workdir = args.workdir.resolve()
    config = workdir_config(workdir, tuple(args.configfiles))
    summary: dict[str, Any] = {"workdir": str(workdir), "swaps": {}}
    for swap in args.swap:
        out = args.out.resolve() / swap_name(swap)
        done = out / "done.json"
        if not done.exists():
            out.mkdir(parents=True, exist_ok=True)
            job = variant_job(workdir, out, config, swap, args.device)
            start = time.monotonic()
            launch(job, 1)
            atomic_write_json(done, {"seconds": round(time.monotonic() - start, 2)})
        summary["swaps"][swap] = {
            "seconds": read_json(done)["seconds"],
            "val": last_val(out / "metrics.jsonl"),
        }
        if args.bench_ks:
            summary["swaps"][swap]["bench"] = bench_variant(workdir, config, out, args.bench_ks)
        print(swap, json.dumps(summary["swaps"][swap]), flush=True)
    # Read last: the variants can train while the workdir's own bench still runs.
    summary["baseline"] = {
        "train": config["train"],
        "vocab": config["vocab"],
        "val": last_val(workdir / "results" / "train" / "metrics.jsonl"),
        "bench": read_speculative_rows(workdir / "results" / "bench"),
    }
    atomic_write_json(args.out / "summary.json", summary)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = add_run_parser(sub, CONFIG_FILES)
    run_parser.add_argument(
        "--swap",
        action="append",
        required=True,
        help="section.key=value, or several joined by commas to change together",
    )
    run_parser.add_argument("--device", help="train.device for every variant (default: config)")
    run_parser.add_argument(
        "--bench-ks", type=int, nargs="+", help="bench each variant's draft at these k"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    {"run": run}[args.command](args)


if __name__ == "__main__":
    main()
