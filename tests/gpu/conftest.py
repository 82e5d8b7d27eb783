"""The GPU lane: tests that need a CUDA device and the official vLLM (``make test-gpu``).

Everywhere else (the CPU build, no GPU) every test here is skipped with one line saying why.
The check creates no CUDA context in this process: vLLM's worker start must be tested from a
driver in the state a user's is in, and nothing here should decide that state by accident.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _gpu_lane_missing() -> str | None:
    """Why the GPU lane cannot run here, or None."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return "no CUDA device (nvidia-smi not found)"
    listed = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, check=False)
    if listed.returncode != 0 or "GPU " not in listed.stdout:
        return "no CUDA device (nvidia-smi lists none)"
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "the official vLLM is not installed (envs/gpu-lane.txt, docs/gpu.md)"
    return None


MISSING = _gpu_lane_missing()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MISSING is None:
        return
    skip = pytest.mark.skip(reason=f"GPU lane: {MISSING}")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
