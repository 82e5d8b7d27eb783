"""Capture on each model family's random-weight target (tests/families.py) on a GPU with the
official vLLM: hooks (V1 runner and Model Runner V2) and native against transformers fp32,
with the extract job's verification thresholds. Llava runs here (the official wheels bring
torchvision); on the CPU build tests/test_families.py asserts its clear error instead.
"""

from __future__ import annotations

import pytest
from capture_checks import (
    assert_cosines_at_least,
    assert_model_runner_v2,
    async_scheduling,
    gpu_engine,
    hf_reference_engine,
    random_prompts,
    skip_native_v2_where_unsupported,
)
from config_support import demo_capture_layers
from packaging.version import Version

from draftflow.capture.backends import CaptureEngineSettings, make_backend
from draftflow.capture.backends.native import native_refusal
from draftflow.capture.extract import VerifySettings
from draftflow.config import DEMO_CONFIG, from_section, load_config
from draftflow.engine import EngineStartError, installed_vllm_version

FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "llava", "gpt_oss"]
# The demo's verification thresholds (config/demo.yaml, extract.verify).
THRESHOLDS = from_section(
    VerifySettings, load_config(DEMO_CONFIG)["extract"]["verify"], "extract.verify"
)
LENGTHS = [7, 300, 40, 130, 64]
# Families that vLLM releases below a version cannot start on GPUs, and the words the job's
# error must then carry (vLLM 0.24.0 on an H200: GPT-OSS's loader refused bf16 experts).
START_LIMITS = {"gpt_oss": ("0.32", "mxfp4")}


def assert_start_refused_where_known(
    backend: str, family: str, target, layer_ids, settings
) -> bool:
    """True (after checking the error) where this vLLM is known not to start ``family``."""
    if family not in START_LIMITS:
        return False
    fixed_in, words = START_LIMITS[family]
    if Version(installed_vllm_version()) >= Version(fixed_in):
        return False
    with pytest.raises(EngineStartError, match=words) as raised:
        make_backend(backend, target, layer_ids, settings)
    print(family, "refused as known:", raised.value)
    return True


def engine_settings(model_runner: str = "default", **changes) -> CaptureEngineSettings:
    return gpu_engine(320, model_runner, **{"kv_cache_memory_bytes": 64 << 20, **changes})


def reference_states(target, layer_ids, prompts):
    backend = make_backend("hf", target, layer_ids, hf_reference_engine(320))
    try:
        return [states.cpu() for states in backend.capture(prompts)]
    finally:
        backend.close()


def assert_verifies(captured, reference, layer_ids) -> dict:
    return assert_cosines_at_least(
        captured, reference, layer_ids, THRESHOLDS.min_mean_cosine, THRESHOLDS.min_p01_cosine
    )


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_capture_matches_hf(family, runner, family_targets):
    target = family_targets(family)
    layer_ids = demo_capture_layers(target).layer_ids
    prompts = random_prompts(LENGTHS, seed=0)
    if assert_start_refused_where_known(
        "hooks", family, target, layer_ids, engine_settings(runner)
    ):
        return
    backend = make_backend("hooks", target, layer_ids, engine_settings(runner))
    try:
        assert backend.setup["runner"] == runner
        assert async_scheduling(backend.llm), "async scheduling is off: not the GPU default"
        captured = backend.capture(prompts)
    finally:
        backend.close()
    summary = assert_verifies(captured, reference_states(target, layer_ids, prompts), layer_ids)
    print(family, runner, "hooks vs hf fp32:", summary)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_native_capture_matches_hf(family, runner, family_targets):
    """vLLM's extractor needs the class to take EAGLE-3 aux layers (all five do in vLLM); under
    V1 and under Model Runner V2 (vLLM >= 0.32), both forced."""
    skip_native_v2_where_unsupported(runner)
    target = family_targets(family)
    layer_ids = demo_capture_layers(target).layer_ids
    prompts = random_prompts(LENGTHS, seed=4)
    refusal = native_refusal(target, installed_vllm_version(), cpu_build=False)
    if refusal:  # before any engine starts, in the job's words
        with pytest.raises(RuntimeError, match="MLA"):
            make_backend("native", target, layer_ids, engine_settings(runner))
        pytest.skip(refusal)
    settings = engine_settings(runner)
    if assert_start_refused_where_known("native", family, target, layer_ids, settings):
        return
    backend = make_backend("native", target, layer_ids, settings)
    try:
        assert async_scheduling(backend.llm), "async scheduling is off: not the GPU default"
        assert_model_runner_v2(backend.llm, runner == "v2")
        captured = backend.capture(prompts)
    finally:
        backend.close()
    summary = assert_verifies(captured, reference_states(target, layer_ids, prompts), layer_ids)
    print(family, "native", runner, "vs hf fp32:", summary)
