"""vLLM-internals adapters of the hooks backend: ``decoder`` (model and call conventions, shared)
and one batch-layout adapter per model runner (``v1_runner``, ``v2_runner``)."""

from __future__ import annotations

import logging
import os
from typing import Any

from packaging.version import Version

from draftflow.capture.adapters.v1_runner import V1RunnerAdapter
from draftflow.capture.adapters.v2_runner import V2RunnerAdapter

RUNNER_ADAPTERS = (V1RunnerAdapter, V2RunnerAdapter)
# vLLM versions the hooks backend supports: 0.16 (first tested) up to the newest release a GPU
# lane passed on: 0.24 (envs/gpu-lane.txt) and 0.33 (envs/gpu-lane-033.txt,
# docs/results/gpu-lane-033-2026-12-06.json), under the V1 runner and Model Runner V2; 0.25 - 0.32
# rest on the CPU lane (0.32) and tools/vllm_contract.py. Widen only after a release's contract
# check and GPU lane both pass (docs/capture.md, "A new vLLM release").
HOOKS_VERSIONS = ">=0.16, <0.34"
HOOKS_MIN = Version("0.16")
# The GPU lane of a release beyond the gate names it here to test it (tools/gpu_lane_env.sh); only
# that exact version is let through, with a warning.
UNTESTED_VLLM_ENV = "DRAFTFLOW_HOOKS_UNTESTED_VLLM"
HOOKS_MAX_EXCLUSIVE = Version("0.34")


def hooks_support(vllm_version: str) -> bool:
    version = Version(Version(vllm_version).base_version)
    return HOOKS_MIN <= version < HOOKS_MAX_EXCLUSIVE


log = logging.getLogger(__name__)


def check_hooks_version(vllm_version: str) -> None:
    if not hooks_support(vllm_version) and os.environ.get(UNTESTED_VLLM_ENV) == vllm_version:
        log.warning(
            "hooks backend on vLLM %s, beyond %s: %s is set",
            vllm_version,
            HOOKS_VERSIONS,
            UNTESTED_VLLM_ENV,
        )
        return
    if not hooks_support(vllm_version):
        from draftflow.capture.backends.native import NATIVE_MIN_VERSION

        raise RuntimeError(
            f"extract.backend 'hooks' does not support vLLM {vllm_version}: supported are "
            f"{HOOKS_VERSIONS}; use backend 'native' (vLLM >= {NATIVE_MIN_VERSION}) or 'hf'"
        )


def select_runner_adapter(runner: Any) -> type[V1RunnerAdapter] | type[V2RunnerAdapter]:
    """The batch-layout adapter for a worker's model runner, or an error naming the runner."""
    for adapter in RUNNER_ADAPTERS:
        if adapter.matches(runner):
            return adapter
    raise RuntimeError(
        f"model runner {type(runner).__module__}.{type(runner).__qualname__} is neither vLLM's "
        "V1 runner (input_batch) nor Model Runner V2 (req_states): the hooks backend cannot "
        "read its batch layout; use extract.backend native or hf"
    )
