"""Shared helpers of the workflow tests: a copy of the workflow in a temporary directory, the
tiny corpus and prompt set, and snakemake runs on that copy.

Every test that runs snakemake works on a copy (never on the repository): the copy's own
``draftflow`` package comes first on ``PYTHONPATH``, so a test may edit its code. The prepared
demo target (the ``smollm2_dir`` fixture) is linked into ``resources/target``, so
``prepare_target`` never runs in a test.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).parent / "snakemake"


def snakemake_command() -> list[str]:
    """The venv's snakemake, or this interpreter's module where packages sit on PYTHONPATH
    (the GPU lane installs its wheels there)."""
    return [str(SNAKEMAKE)] if SNAKEMAKE.exists() else [sys.executable, "-m", "snakemake"]


TINY_CONFIG = REPO / "tests" / "configs" / "tiny.yaml"
WORKFLOW_PARTS = [
    "Snakefile",
    "rules",
    "scripts",
    "draftflow",
    "config",
    "envs",
    "profiles",
    "docs",
]

# The files tests/configs/tiny.yaml names, relative to the workflow copy.
TINY_CORPUS = "tiny_corpus.jsonl"
TINY_PROMPTS = "tiny_prompts.jsonl"
TINY_TOPICS = ["rivers", "prime numbers", "bread", "owls", "tides", "chess", "glass", "maps"]


def copy_workflow(dest: Path) -> Path:
    """The workflow's own files in ``dest``, so runs never touch the repository."""
    dest.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        source = REPO / part
        if source.is_dir():
            shutil.copytree(
                source,
                dest / part,
                ignore=shutil.ignore_patterns("__pycache__"),
                dirs_exist_ok=True,
            )
        elif source.exists():
            shutil.copy2(source, dest / part)
    return dest


def link_target(workdir: Path, target: Path) -> None:
    """The prepared target's files as links in ``resources/target`` (prepare_target's output)."""
    linked = workdir / "resources" / "target"
    linked.mkdir(parents=True, exist_ok=True)
    for path in target.iterdir():
        if not (linked / path.name).exists():
            (linked / path.name).symlink_to(path.resolve())


def write_tiny_corpus(path: Path, count: int = 24) -> None:
    """ShareGPT-format conversations (what ingest reads), one or two turns each.

    The answers repeat a few patterns, so a draft trained for a few hundred steps predicts
    the target well on these prompts.
    """
    records = []
    for index in range(count):
        topic = TINY_TOPICS[index % len(TINY_TOPICS)]
        turns = [
            {"from": "human", "value": f"Tell me one fact about {topic} (#{index})."},
            {
                "from": "gpt",
                "value": f"Here is a fact about {topic}: it is interesting. " * (1 + index % 4),
            },
        ]
        if index % 2:
            turns += [
                {"from": "human", "value": "And another?"},
                {"from": "gpt", "value": f"Another fact: {topic} appear in many stories."},
            ]
        records.append({"id": f"tiny-{index}", "conversations": turns})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def write_tiny_prompts(corpus: Path, path: Path, count: int = 4) -> None:
    """A chat prompt set of the first user turns of the corpus's first ``count`` conversations."""
    records = []
    for line in corpus.read_text().splitlines()[:count]:
        record = json.loads(line)
        first_user = next(t["value"] for t in record["conversations"] if t["from"] == "human")
        records.append({"id": record["id"], "turns": [first_user]})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` merged in as Snakemake merges config files (lists replaced)."""
    from draftflow.config import merge_config

    merged = copy.deepcopy(base)
    merge_config(merged, copy.deepcopy(update))
    return merged


def tiny_config() -> dict[str, Any]:
    """The demo (config/demo.yaml) with tests/configs/tiny.yaml merged over it, as Snakemake
    merges --configfile files over the schema's defaults (draftflow.config.load_config)."""
    from draftflow.config import DEMO_CONFIG, load_config

    return load_config(DEMO_CONFIG, TINY_CONFIG)


def write_config(workdir: Path, config: dict[str, Any]) -> None:
    """Make ``config`` the copy's config/config.yaml (what its Snakefile loads)."""
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def read_config(workdir: Path) -> dict[str, Any]:
    return yaml.safe_load((workdir / "config" / "config.yaml").read_text())


def prepare_tiny_workdir(dest: Path, target: Path) -> Path:
    """A workflow copy with the tiny config, its corpus and prompts, and the target linked in."""
    workdir = copy_workflow(dest)
    link_target(workdir, target)
    write_tiny_corpus(workdir / TINY_CORPUS)
    write_tiny_prompts(workdir / TINY_CORPUS, workdir / TINY_PROMPTS)
    write_config(workdir, tiny_config())
    return workdir


def snakemake_env(workdir: Path, **extra: str) -> dict[str, str]:
    """Offline, no inherited SLURM job, and the copy's own draftflow package first."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PATH"] = f"{SNAKEMAKE.parent}{os.pathsep}{env.get('PATH', '')}"
    # The copy's package first; packages installed on PYTHONPATH (the GPU lane's) stay visible.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_snakemake(
    workdir: Path,
    *args: str,
    check: bool = True,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``snakemake ARGS`` in ``workdir``; with ``check`` a failure shows the end of its output."""
    result = subprocess.run(
        [*snakemake_command(), *args],
        cwd=workdir,
        env=env or snakemake_env(workdir),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert result.returncode == 0, (
            f"snakemake {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result


def clone_workdir(source: Path, dest: Path) -> Path:
    """A copy of a finished workdir with its timestamps and Snakemake metadata (``cp -a``)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(source), str(dest)], check=True)
    return dest
