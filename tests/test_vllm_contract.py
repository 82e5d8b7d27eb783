"""The contract check (tools/vllm_contract.py): every supported vLLM release's official wheel has
every internal the capture adapters rely on, and a wheel with one of them renamed fails, naming
the release and the name.

The releases' members come from the cache that ``python tools/vllm_contract.py fetch`` fills
(CI runs it before ``make test``, .ci/run). Without the cache the release tests fail in CI
(``CI=true``) and are skipped elsewhere; the renamed-wheel tests need only the 0.33.0 entry.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from draftflow.capture.adapters import HOOKS_MAX_EXCLUSIVE, HOOKS_MIN
from draftflow.capture.backends.native import NATIVE_MIN_VERSION

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "vllm_contract.py"
_spec = importlib.util.spec_from_file_location("vllm_contract", TOOL)
contract = importlib.util.module_from_spec(_spec)
sys.modules["vllm_contract"] = contract  # dataclasses look their module up by name
_spec.loader.exec_module(contract)

RENAME_RELEASE = "0.33.0"


def cached(release: str) -> Path:
    path = contract.cache_path(release)
    if not path.exists():
        message = f"no contract cache for vLLM {release}: run python tools/vllm_contract.py fetch"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.mark.parametrize("release", contract.RELEASES)
def test_release_keeps_every_internal_the_adapters_use(release):
    problems = contract.check_release(contract.CachedSource(cached(release)), release)
    assert problems == []


def test_the_checked_releases_are_the_gate_of_the_hooks_backend():
    """Widening HOOKS_VERSIONS without adding the release to the contract check fails here."""
    minors = sorted(contract.release_key(r)[:2] for r in contract.RELEASES)
    assert minors[0] == (HOOKS_MIN.major, HOOKS_MIN.minor)
    assert minors[-1] >= (HOOKS_MAX_EXCLUSIVE.major, HOOKS_MAX_EXCLUSIVE.minor - 1)
    assert len(minors) == minors[-1][1] - minors[0][1] + 1  # every minor release in between
    assert contract.NATIVE_SINCE == NATIVE_MIN_VERSION


def write_wheel(tmp_path: Path, release: str, edits: dict[str, tuple[str, str]]) -> Path:
    """A wheel holding the release's cached members, with ``old -> new`` replaced by hand in
    the members named in ``edits``."""
    members = json.loads(cached(release).read_text())["members"]
    wheel = tmp_path / f"vllm-{release}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in members.items():
            if text is None:
                continue
            if name in edits:
                old, new = edits[name]
                assert old in text, (name, old)
                text = text.replace(old, new)
            archive.writestr(name, text)
    return wheel


def test_the_cached_wheel_passes_as_a_control(tmp_path):
    assert contract.check_wheel(write_wheel(tmp_path, RENAME_RELEASE, {})) == []


@pytest.mark.parametrize(
    ("member", "old", "new", "expected"),
    [
        (contract.V2, "self.req_states", "self.request_states", "no attribute req_states"),
        (
            "vllm/v1/worker/gpu/input_batch.py",
            "num_scheduled_tokens:",
            "scheduled_tokens:",
            "InputBatch has no attribute num_scheduled_tokens",
        ),
        (contract.V1, "def sample_tokens(", "def sample(", "no method sample_tokens"),
        (
            "vllm/entrypoints/llm.py",
            "def collective_rpc(",
            "def run_on_workers(",
            "LLM has no method collective_rpc",
        ),
        (
            contract.MODELS + "qwen3.py",
            "        positions: torch.Tensor,\n        hidden_states",
            "        position_ids: torch.Tensor,\n        hidden_states",
            "Qwen3DecoderLayer.forward has no parameter positions",
        ),
        (
            contract.MODELS + "interfaces.py",
            "def get_eagle3_default_aux_hidden_state_layers(",
            "def get_eagle3_aux_layers(",
            "no method get_eagle3_default_aux_hidden_state_layers",
        ),
    ],
    ids=[
        "v2-req_states",
        "v2-num_scheduled_tokens",
        "v1-sample_tokens",
        "collective_rpc",
        "qwen3-positions",
        "eagle3-aux-layers",
    ],
)
def test_a_wheel_with_an_internal_renamed_fails_naming_release_and_name(
    tmp_path, member, old, new, expected
):
    wheel = write_wheel(tmp_path, RENAME_RELEASE, {member: (old, new)})
    problems = contract.check_wheel(wheel)
    assert problems, "the renamed internal was not noticed"
    assert all(p.startswith(f"vLLM {RENAME_RELEASE}: ") for p in problems)
    assert any(expected in p for p in problems), problems


def test_the_command_line_fails_on_a_renamed_wheel(tmp_path):
    wheel = write_wheel(tmp_path, RENAME_RELEASE, {contract.V2: ("self.req_states", "self.rs")})
    result = subprocess.run(
        [sys.executable, str(TOOL), "check", "--wheel", str(wheel)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert f"vLLM {RENAME_RELEASE}: {contract.V2}: GPUModelRunner has no attribute req_states" in (
        result.stdout
    )
