"""What the GPU capture tests share: their prompts, their engine shape and their check."""

from __future__ import annotations

from typing import Any

import torch
from config_support import capture_engine_settings
from packaging.version import Version

from draftflow.capture.backends import CaptureEngineSettings
from draftflow.capture.verify import cosine_summary, token_cosines


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 49_000, (n,), generator=generator).tolist() for n in lengths]


def gpu_engine(
    max_model_len: int, model_runner: str = "default", **changes: Any
) -> CaptureEngineSettings:
    """A small KV cache and token budget, so that requests are chunked and preempted."""
    values = {
        "max_num_batched_tokens": 128,
        "max_num_seqs": 4,
        "model_runner": model_runner,
        "device": "cuda",
        # Not the demo's CPU values: the GPU's share (gpu_memory_utilization) unless a test
        # sets exact bytes, vLLM's own choice of cores, vLLM's default (not batch-invariant)
        # kernels.
        "kv_cache_memory_bytes": None,
        "reserved_cpus": None,
        "deterministic": False,
        **changes,
    }
    return capture_engine_settings(max_model_len, **values)


def hf_reference_engine(max_model_len: int) -> CaptureEngineSettings:
    """transformers fp32 on the GPU: the reference of every capture."""
    return capture_engine_settings(max_model_len, hf_dtype="float32", device="cuda")


def assert_cosines_at_least(
    captured, reference, layer_ids, min_mean: float, min_p01: float
) -> dict[str, Any]:
    """Every layer's token cosines against the reference: mean and 1st percentile bounded."""
    assert [c.shape for c in captured] == [r.shape for r in reference]
    cosines = torch.cat(
        [token_cosines(c.cpu(), r.cpu()) for c, r in zip(captured, reference, strict=True)]
    )
    summary = cosine_summary(cosines, layer_ids)
    for layer, values in summary.items():
        assert values["mean"] >= min_mean, (layer, values)
        assert values["p01"] >= min_p01, (layer, values)
    return summary


def async_scheduling(llm) -> bool:
    return bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)


# vLLM runs its extract_hidden_states method under Model Runner V2 from 0.32 (0.24 refuses it).
NATIVE_UNDER_V2 = "0.32"


def skip_native_v2_where_unsupported(runner: str) -> None:
    import pytest

    from draftflow.engine import installed_vllm_version

    if runner == "v2" and Version(installed_vllm_version()) < Version(NATIVE_UNDER_V2):
        pytest.skip(f"vLLM < {NATIVE_UNDER_V2} runs extract_hidden_states under V1 only")


def assert_model_runner_v2(llm, expected: bool) -> None:
    """The engine's config resolves to Model Runner V2 (or not), as its workers chose at start:
    ``VllmConfig.use_v2_model_runner`` (vLLM >= 0.22) reads VLLM_USE_V2_MODEL_RUNNER, which the
    engine's start set for its own processes only, and else the config's unsupported features."""
    import os

    config = llm.llm_engine.vllm_config
    if not hasattr(type(config), "use_v2_model_runner"):
        assert not expected, "this vLLM has no Model Runner V2"
        return
    forced = os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    try:
        chosen = bool(config.use_v2_model_runner)
    finally:
        if forced is not None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = forced
    if expected:
        assert chosen, "vLLM's config does not pick Model Runner V2 for this engine"
