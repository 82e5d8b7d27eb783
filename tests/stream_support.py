"""The stored and the streamed mode on the tiny workflow, side by side (tests/test_stream.py,
tests/test_slurm.py, perf/streamed_vs_stored.py): one upstream run (data, vocab, val capture)
cloned into a stored and a streamed copy, with the bytes under results/ sampled while a copy runs.
The fixtures are session-wide (tests/conftest.py registers them): both test modules clone the
same upstream run and compare with the same stored draft."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from workflow_support import (
    clone_workdir,
    merge,
    prepare_tiny_workdir,
    read_config,
    run_snakemake,
    tiny_config,
    write_config,
)

# Two train shards, two epochs: four links, so a window of one keeps half the store at most.
STREAM_TEST = {
    "extract": {"num_shards": {"train": 2, "val": 1}, "mode": "stored", "window": 1},
    "train": {
        "epochs": 2,
        "max_steps": None,
        "order": "by_shard",
        "eval_every": 3,
        "checkpoint_every": 100,
    },
}
# Every output the train stage's inputs need, but no train capture: what both copies share.
UPSTREAM_TARGETS = [
    "results/vocab/vocab.safetensors",
    "results/extract/val/shard-00000",
    "results/shard/manifest.json",
]
DRAFT = "results/train/draft"
# Wall-clock fields of the metrics log: the only ones two runs of one job may differ in.
TIMING_KEYS = {"tokens_per_s"}


def stream_test_config(**extract: Any) -> dict[str, Any]:
    """The tiny config with two train shards, two epochs, by_shard order (and ``extract``)."""
    return merge(tiny_config(), merge(STREAM_TEST, {"extract": extract}))


def set_mode(workdir: Path, mode: str, window: int = 1) -> None:
    config = read_config(workdir)
    config["extract"].update(mode=mode, window=window)
    write_config(workdir, config)


def tree_bytes(root: Path) -> int:
    """Bytes of every file under ``root`` (0 when it does not exist); files that vanish while
    it walks (temp outputs being deleted) count as gone."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with suppress(FileNotFoundError):
                total += os.stat(os.path.join(directory, name)).st_size
    return total


def capture_bytes(stream_dir: Path) -> int:
    """Bytes of the links' captures (finished or being written) under results/stream/."""
    total = 0
    for link in stream_dir.glob("link-*"):
        total += tree_bytes(link)
        marker = link / "done.json"
        with suppress(FileNotFoundError):
            total -= marker.stat().st_size
    return total


class DiskSampler:
    """The largest value seen of each of ``measures`` (bytes), polled every ``interval`` s."""

    def __init__(self, measures: dict[str, Callable[[], int]], interval: float = 0.2) -> None:
        self.measures = measures
        self.interval = interval
        self.peak = dict.fromkeys(measures, 0)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, measure in self.measures.items():
                self.peak[name] = max(self.peak[name], measure())
            self.samples += 1
            self._stop.wait(self.interval)

    @contextmanager
    def running(self) -> Iterator[DiskSampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def untimed_metrics(workdir: Path) -> list[dict]:
    lines = (workdir / "results" / "train" / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
        for line in lines
        if line.strip()
    ]


def benchmark_seconds(workdir: Path, pattern: str) -> float:
    """Wall seconds summed over the Snakemake benchmark files matching ``pattern``."""
    total = 0.0
    for path in sorted(workdir.glob(pattern)):
        header, row = path.read_text().splitlines()[:2]
        total += float(dict(zip(header.split("\t"), row.split("\t"), strict=True))["s"])
    return total


def largest_store(workdir: Path, split: str = "train") -> int:
    return max(tree_bytes(d) for d in (workdir / "results" / "extract" / split).iterdir())


@pytest.fixture(scope="session")
def stream_upstream(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny workflow (hf capture backend: no engine start per link) up to the vocabulary
    and the val capture, the part both modes share. Tests clone it, never change it."""
    workdir = prepare_tiny_workdir(tmp_path_factory.mktemp("stream") / "upstream", smollm2_dir)
    write_config(workdir, stream_test_config(backend="hf"))
    run_snakemake(workdir, "--cores", "2", *UPSTREAM_TARGETS, timeout=1200)
    return workdir


@pytest.fixture(scope="session")
def stream_stored(stream_upstream: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stored mode's draft from the upstream run: what every streamed run must equal."""
    workdir = clone_workdir(stream_upstream, tmp_path_factory.mktemp("stream") / "stored")
    run_snakemake(workdir, "--cores", "2", DRAFT, timeout=1200)
    return workdir
