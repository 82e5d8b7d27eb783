"""Capture on a GPU with the official vLLM: hooks (V1 runner and Model Runner V2) and native
against transformers fp32, with async scheduling on, chunked prefill, preemption and repeated
calls; and every engine draftflow starts, started from a driver that has already used CUDA.

The prompts and engine shape are the CPU tests' (tests/test_capture.py): more prompts than
``max_num_seqs``, prompts longer than ``max_num_batched_tokens``, a KV cache of ~880 tokens.
"""

from __future__ import annotations

import pytest
import torch
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

from draftflow.capture.backends import CaptureEngineSettings, make_backend

LENGTHS = [7, 600, 33, 250, 120, 7, 410, 64, 300]
MAX_MODEL_LEN = 641
# Measured on the CPU build with the same prompts: mean >= 0.9999, p01 >= 0.9995.
MIN_MEAN_COSINE = 0.995
MIN_P01_COSINE = 0.995


def engine_settings(model_runner: str = "default", **changes) -> CaptureEngineSettings:
    shape = {
        "kv_cache_memory_bytes": 21_900_000,  # ~880 tokens: requests are preempted
        "engine_args": {"long_prefill_token_threshold": 32},
    }
    return gpu_engine(MAX_MODEL_LEN, model_runner, **{**shape, **changes})


@pytest.fixture(scope="module")
def layers(smollm2_dir):
    return demo_capture_layers(smollm2_dir)


@pytest.fixture(scope="module")
def hf_reference(smollm2_dir, layers):
    """fp32 transformers on the GPU: from here on the driver process holds a CUDA context,
    so every engine below must start its workers without forking it."""
    backend = make_backend("hf", smollm2_dir, layers.layer_ids, hf_reference_engine(MAX_MODEL_LEN))
    assert torch.cuda.is_initialized()
    yield backend
    backend.close()


def assert_close_to(captured, reference, layer_ids) -> dict:
    return assert_cosines_at_least(captured, reference, layer_ids, MIN_MEAN_COSINE, MIN_P01_COSINE)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_hooks_match_hf_under_both_runners(runner, smollm2_dir, layers, hf_reference):
    backend = make_backend("hooks", smollm2_dir, layers.layer_ids, engine_settings(runner))
    try:
        assert backend.setup["runner"] == runner and backend.setup["device"].startswith("cuda")
        assert async_scheduling(backend.llm), "async scheduling is off: not the GPU default"
        assert_model_runner_v2(backend.llm, runner == "v2")
        prompts = random_prompts(LENGTHS, seed=0)
        captured = backend.capture(prompts)
        stats = backend.last_stats
        assert stats["requests"] == len(LENGTHS) > 4
        assert stats["max_forwards_per_request"] > 1, "no prompt was prefilled in chunks"
        assert stats["overwritten_tokens"] > 0, "no request was preempted and recomputed"
        summary = assert_close_to(captured, hf_reference.capture(prompts), layers.layer_ids)
        print(f"hooks {runner} vs hf fp32:", summary, stats)
        # Repeated calls on one engine, reversed order and a duplicate: each its own prompt.
        again = random_prompts([90, 7, 300, 12], seed=1)
        for batch in (again, [*reversed(again), again[0]]):
            assert_close_to(backend.capture(batch), hf_reference.capture(batch), layers.layer_ids)
    finally:
        backend.close()


def test_hooks_quantize_fp8_on_the_gpu(smollm2_dir, layers, hf_reference):
    """``extract.store_dtype: float8_e4m3fn``: the worker quantizes each forward's states on the
    GPU before the copy to the host (half the bytes cross); every row uses e4m3's range, and the
    dequantized states match transformers fp32."""
    from draftflow.capture.quant import FP8, FP8_MAX, Quantized, dequantize

    settings = engine_settings("v2", store_dtype=FP8)
    backend = make_backend("hooks", smollm2_dir, layers.layer_ids, settings)
    try:
        assert backend.setup["store_dtype"] == FP8 and backend.setup["device"].startswith("cuda")
        prompts = random_prompts(LENGTHS, seed=5)
        captured = backend.capture(prompts)
        assert backend.last_stats["max_forwards_per_request"] > 1
    finally:
        backend.close()
    assert all(isinstance(states, Quantized) for states in captured)
    for states in captured:
        assert states.values.dtype == torch.float8_e4m3fn and states.scales.dtype == torch.float32
        peaks = states.values.float().abs().amax(-1)[states.scales != 1.0]
        assert torch.equal(peaks, torch.full_like(peaks, FP8_MAX))
    wide = [dequantize(states.values, states.scales, torch.float32) for states in captured]
    summary = assert_cosines_at_least(
        wide, hf_reference.capture(prompts), layers.layer_ids, MIN_MEAN_COSINE, 0.99
    )
    print("hooks v2 fp8 (quantized on the GPU) vs hf fp32:", summary)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_native_matches_hf(runner, smollm2_dir, layers, hf_reference):
    """vLLM's own extractor with its stock (CUDA) connector, under V1 and under Model Runner V2
    (vLLM >= 0.32; 0.24 runs it under V1 only), both forced."""
    skip_native_v2_where_unsupported(runner)
    settings = engine_settings(runner, kv_cache_memory_bytes=64 << 20)
    backend = make_backend("native", smollm2_dir, layers.layer_ids, settings)
    try:
        assert async_scheduling(backend.llm)
        assert_model_runner_v2(backend.llm, runner == "v2")
        prompts = random_prompts([7, 600, 33, 250, 120, 64], seed=4)
        captured = backend.capture(prompts)
        again = backend.capture(prompts[:2])
    finally:
        backend.close()
    assert [a.shape for a in again] == [(7, 4, 576), (600, 4, 576)]
    print(
        f"native {runner} vs hf fp32:",
        assert_close_to(captured, hf_reference.capture(prompts), layers.layer_ids),
    )


def test_regenerate_engine_starts_after_cuda_was_used(smollm2_dir, hf_reference):
    """The fork crash: a driver with a CUDA context (hf_reference) starting a generation engine."""
    from config_support import demo_engine_settings, make_engine_arguments
    from vllm import SamplingParams

    from draftflow.corpus.regenerate import make_engine
    from draftflow.engine import shutdown_engine

    assert torch.cuda.is_initialized()
    engine = demo_engine_settings(
        "regenerate",
        device="gpu",
        max_model_len=256,
        gpu_memory_utilization=0.2,
        kv_cache_memory_bytes=None,
        reserved_cpus=None,
    )
    llm = make_engine(smollm2_dir, engine, **make_engine_arguments())
    try:
        (output,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
        assert len(output.outputs[0].token_ids) == 8
        assert async_scheduling(llm)
    finally:
        shutdown_engine(llm)
