"""What the studies that train other drafts on a finished workdir's data share
(``speculators_side.py``, ``recipe_swaps.py``): their ``run`` command's workdir arguments, the
workdir's config as its Snakemake run saw it, and a draft benched the way the workdir's bench
stage benches its own."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

TARGET = Path("resources/target")


# The Snakefile's own ``configfile:``; Snakemake merges every ``--configfile`` over it.
WORKFLOW_CONFIG = "config/config.yaml"


def add_run_parser(commands: Any, config_files: tuple[str, ...]) -> argparse.ArgumentParser:
    """The ``run`` subcommand with ``--workdir``, ``--out`` and ``--configfiles`` (defaulting
    to ``config_files``); the study adds its own options."""
    parser = commands.add_parser("run")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--configfiles",
        nargs="*",
        default=list(config_files),
        help=f"the --configfile arguments of the workdir's Snakemake run, in order "
        f"({WORKFLOW_CONFIG}, which the Snakefile loads first, is always merged first)",
    )
    return parser


def workdir_files(files: tuple[str, ...]) -> list[str]:
    """The config files in the order the workdir's Snakemake run merged them: the Snakefile's
    own first (config/config.yaml, which a test's workflow copy fills), then ``files``."""
    return [WORKFLOW_CONFIG, *(name for name in files if name != WORKFLOW_CONFIG)]


def workdir_config(workdir: Path, files: tuple[str, ...]) -> dict[str, Any]:
    """The workdir's config as its Snakemake run saw it: ``workdir_files`` merged in order,
    validated, defaults filled."""
    from draftflow.config import load_config

    base, *overlays = workdir_files(files)
    return load_config(*(workdir / name for name in overlays), base=workdir / base)


def bench_draft(
    workdir: Path, config: dict[str, Any], draft: str | Path, ks: list[int], out_dir: Path
) -> list[str]:
    """``draft`` against the workdir's plain target at each of ``ks``, tables in ``out_dir`` as
    in the workdir's ``results/bench/``; the prompt sets' names."""
    from draftflow.bench.prompts import read_prompts
    from draftflow.bench.settings import bench_settings
    from draftflow.bench.suite import run_benchmark

    bench = config["bench"]
    prompts = workdir / "results" / "bench" / "prompts"
    names = [dataset["name"] for dataset in bench["datasets"]]
    run_benchmark(
        prompt_sets={name: read_prompts(prompts / f"{name}.jsonl") for name in names},
        target=str(workdir / TARGET),
        draft=str(draft),
        ks=ks,
        out_dir=out_dir,
        settings=bench_settings(config),
    )
    return names
