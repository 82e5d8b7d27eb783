"""Capture on each model family's random-weight target (tests/families.py) on a GPU with the
official vLLM: hooks (V1 runner and Model Runner V2) and native against transformers fp32,
with the extract job's verification thresholds. Llava runs here (the official wheels bring
torchvision); on the CPU build tests/test_families.py asserts its clear error instead.
"""

from __future__ import annotations

import pytest
import torch

from draftflow.capture.backends import EngineSettings, make_backend
from draftflow.capture.extract import VerifySettings
from draftflow.capture.layers import capture_layers
from draftflow.capture.verify import cosine_summary, token_cosines

FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "llava"]
THRESHOLDS = VerifySettings()
LENGTHS = [7, 300, 40, 130, 64]


def engine_settings(model_runner: str = "default", **changes) -> EngineSettings:
    values = {
        "max_model_len": 320,
        "max_num_batched_tokens": 128,
        "max_num_seqs": 4,
        "kv_cache_memory_bytes": 64 << 20,
        "model_runner": model_runner,
        "device": "cuda",
        **changes,
    }
    return EngineSettings(**values)


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 49_000, (n,), generator=generator).tolist() for n in lengths]


def reference_states(target, layer_ids, prompts):
    backend = make_backend("hf", target, layer_ids, EngineSettings(320, device="cuda"))
    try:
        return [states.cpu() for states in backend.capture(prompts)]
    finally:
        backend.close()


def assert_verifies(captured, reference, layer_ids) -> dict:
    assert [c.shape for c in captured] == [r.shape for r in reference]
    cosines = torch.cat(
        [token_cosines(c.cpu(), r) for c, r in zip(captured, reference, strict=True)]
    )
    summary = cosine_summary(cosines, layer_ids)
    for layer, values in summary.items():
        assert values["mean"] >= THRESHOLDS.min_mean_cosine, (layer, values)
        assert values["p01"] >= THRESHOLDS.min_p01_cosine, (layer, values)
    return summary


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_capture_matches_hf(family, runner, family_targets):
    target = family_targets(family)
    layer_ids = capture_layers(target).layer_ids
    prompts = make_prompts(LENGTHS, seed=0)
    backend = make_backend("hooks", target, layer_ids, engine_settings(runner))
    try:
        captured = backend.capture(prompts)
    finally:
        backend.close()
    summary = assert_verifies(captured, reference_states(target, layer_ids, prompts), layer_ids)
    print(family, runner, "hooks vs hf fp32:", summary)


@pytest.mark.parametrize("family", FAMILIES)
def test_native_capture_matches_hf(family, family_targets):
    """vLLM's extractor needs the class to take EAGLE-3 aux layers (all five do in vLLM)."""
    target = family_targets(family)
    layer_ids = capture_layers(target).layer_ids
    prompts = make_prompts(LENGTHS, seed=4)
    backend = make_backend("native", target, layer_ids, engine_settings())
    try:
        captured = backend.capture(prompts)
    finally:
        backend.close()
    summary = assert_verifies(captured, reference_states(target, layer_ids, prompts), layer_ids)
    print(family, "native vs hf fp32:", summary)
