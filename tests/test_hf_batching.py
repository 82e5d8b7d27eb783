"""The hf backend's padded batches against its one-at-a-time path on the real target (SmolLM2)."""

from __future__ import annotations

import pytest
import torch
from config_support import capture_engine_settings, demo_capture_layers

from draftflow.capture.backends.hf import HFBackend
from draftflow.capture.verify import cosine_summary, token_cosines

LENGTHS = [7, 300, 33, 120, 64, 1]
MIN_EXACT_COSINE = 0.99999  # fp32 batched vs fp32 one at a time: kernel noise only
# bf16 vs fp32 thresholds of tests/test_capture.py
MIN_MEAN_COSINE = 0.995
MIN_P01_COSINE = 0.995


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 49_000, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Two OpenMP threads on 2 cores stall badly when another job holds a core (1.9 s for one
    # token measured); one thread keeps this file fast and its timings steady.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def layer_ids(smollm2_dir) -> list[int]:
    return demo_capture_layers(smollm2_dir).layer_ids


def backend(smollm2_dir, layer_ids, dtype: str, **batching: int) -> HFBackend:
    return HFBackend(
        smollm2_dir, layer_ids, capture_engine_settings(1024, hf_dtype=dtype), **batching
    )


@pytest.fixture(scope="module")
def fp32(smollm2_dir, layer_ids):
    hf = backend(smollm2_dir, layer_ids, "float32")
    yield hf
    hf.close()


@pytest.fixture(scope="module")
def bf16(smollm2_dir, layer_ids):
    hf = backend(smollm2_dir, layer_ids, "bfloat16")
    yield hf
    hf.close()


def one_at_a_time(hf: HFBackend, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [hf.capture([ids])[0] for ids in prompts]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=0)


@pytest.fixture(scope="module")
def reference(fp32, prompts) -> list[torch.Tensor]:
    """fp32, one prompt at a time: computed once, shared by the tests (a slow CPU)."""
    return one_at_a_time(fp32, prompts)


def test_batches_pack_by_length_within_budget(fp32):
    lengths = [7, 300, 33, 120, 64, 1, 300]
    groups = fp32.batches(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert any(len(group) > 1 for group in groups)
    for group in groups:
        widths = [lengths[i] for i in group]
        assert widths == sorted(widths, reverse=True)
        assert len(group) == 1 or len(group) * widths[0] <= fp32.max_batch_tokens
        assert len(group) <= fp32.max_batch_prompts
    fp32.max_batch_tokens = 0  # forced one at a time
    try:
        assert all(len(group) == 1 for group in fp32.batches(lengths))
    finally:
        fp32.max_batch_tokens = HFBackend.max_batch_tokens


def test_fp32_batched_matches_one_at_a_time(fp32, layer_ids, prompts, reference):
    assert len(fp32.batches(LENGTHS)) < len(LENGTHS), "nothing was batched"
    batched = fp32.capture(prompts)
    single = reference
    assert [b.shape for b in batched] == [(n, len(layer_ids), 576) for n in LENGTHS]
    assert [b.shape for b in batched] == [s.shape for s in single]
    assert all(b.device.type == "cpu" for b in batched)
    for b, s in zip(batched, single, strict=True):
        assert token_cosines(b, s).min() >= MIN_EXACT_COSINE
    # Order kept: a prompt's states differ from another prompt's of the same length.
    swapped = make_prompts([16, 16], seed=5)
    first, second = fp32.capture(swapped)
    alone = one_at_a_time(fp32, swapped)
    assert token_cosines(first, alone[0]).min() >= MIN_EXACT_COSINE
    assert token_cosines(second, alone[1]).min() >= MIN_EXACT_COSINE
    assert token_cosines(first, alone[1])[1:].mean() < 0.99


def test_bf16_batched_is_close_to_fp32(bf16, layer_ids, prompts, reference):
    batched = bf16.capture(prompts)
    assert all(b.dtype == torch.bfloat16 for b in batched)
    cosines = torch.cat([token_cosines(b, r) for b, r in zip(batched, reference, strict=True)])
    summary = cosine_summary(cosines, layer_ids)
    for layer, values in summary.items():
        assert values["mean"] >= MIN_MEAN_COSINE, (layer, values)
        assert values["p01"] >= MIN_P01_COSINE, (layer, values)
