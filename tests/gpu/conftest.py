"""The GPU lane: tests that need a CUDA device and the official vLLM (``make test-gpu``).

Everywhere else (the CPU build, no GPU) every test here is skipped with one line saying why.
The check creates no CUDA context in this process: vLLM's worker start must be tested from a
driver in the state a user's is in, and nothing here should decide that state by accident.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
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


# A file each failure is appended to as it happens (e.g. under a lent machine's $OUT).
REPORT_ENV = "DRAFTFLOW_GPU_REPORT"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Print a failure's message the moment its test ends, and append it to
    ``$DRAFTFLOW_GPU_REPORT``: a GPU run cut off by a time limit never prints pytest's closing
    report, which would hold every failure's cause."""
    if not report.failed:
        return
    text = f"\n[gpu lane] FAILED {report.nodeid} ({report.when}):\n{report.longreprtext}\n"
    sys.stderr.write(text)
    sys.stderr.flush()
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(text + captured_tail(report))


# Lines of each captured stream kept in the report: the engine processes' and vLLM's model
# registry's own errors land there, before the summary exception that pytest shows.
CAPTURED_TAIL_LINES = 150


def captured_tail(report: pytest.TestReport) -> str:
    """The end of what the test printed (stdout, stderr, log), as pytest captured it."""
    parts = []
    for name, content in report.sections:
        lines = content.splitlines()[-CAPTURED_TAIL_LINES:]
        parts.append(f"--- {name} (last {len(lines)} lines)\n" + "\n".join(lines) + "\n")
    return "".join(parts)
