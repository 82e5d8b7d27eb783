"""The fp8 capture store: per-token-and-layer scales, its bytes, resume, and training batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from capture_stores import StoreShape, open_writer, random_samples, write_store
from safetensors import safe_open

from draftflow.capture.quant import FP8_MAX, dequantize, quantize_fp8, state_bytes_per_token
from draftflow.capture.store import CaptureReader
from draftflow.train.captures import CaptureSet, collate, dequantize_batch

LAYERS = [2, 4, 7, 8]
AUX = [2, 4, 7]
HIDDEN = 64
META = {"model": "toy", "backend": "test"}


SHAPE = StoreShape(LAYERS, AUX, HIDDEN)


def make_samples(count: int, seed: int = 0) -> list[dict]:
    samples = random_samples(count, SHAPE, seed, min_length=2, id_prefix="s")
    for sample in samples:
        # A massive activation, as real targets have on a few tokens of deep layers.
        sample["hidden_states"][0, -1, 3] = 3000.0
    return samples


def test_quantize_never_saturates_and_keeps_direction():
    generator = torch.Generator().manual_seed(1)
    states = torch.randn(50, 4, 576, generator=generator) * torch.logspace(-3, 3, 50)[:, None, None]
    states[7, 2, 11] = 1e5  # one huge value in one row
    states[9, 1] = 0.0  # an all-zero row
    quantized, scales = quantize_fp8(states.bfloat16())
    assert quantized.dtype == torch.float8_e4m3fn and scales.shape == (50, 4)
    wide = quantized.float()
    assert torch.isfinite(wide).all()
    # Every row's largest magnitude lands on e4m3's largest value: the range is used, not exceeded.
    nonzero = scales != 1.0
    assert torch.equal(wide.abs().amax(-1)[nonzero], torch.full_like(scales[nonzero], FP8_MAX))
    back = dequantize(quantized, scales, torch.float32)
    assert torch.equal(back[9, 1], torch.zeros(576))
    assert back[7, 2, 11] == pytest.approx(states[7, 2, 11].bfloat16().item(), rel=1 / 16)
    cosine = torch.nn.functional.cosine_similarity(back, states.bfloat16().float(), dim=-1)
    keep = states.abs().amax(-1) > 0
    assert cosine[keep].min() > 0.995 and cosine[keep].mean() > 0.999


def test_fp8_store_round_trip_bytes_and_manifest(tmp_path):
    samples = make_samples(10)
    bf16 = write_store(tmp_path / "bf16", samples, SHAPE, META, store_dtype="bfloat16")
    fp8 = write_store(tmp_path / "fp8", samples, SHAPE, META, store_dtype="float8_e4m3fn")
    assert bf16["dtype"] == "bfloat16" and "scales" not in bf16
    assert fp8["dtype"] == "float8_e4m3fn"
    assert fp8["scales"]["tensor"] == "hidden_scales" and fp8["scales"]["dtype"] == "float32"
    bf16_reader, fp8_reader = CaptureReader(tmp_path / "bf16"), CaptureReader(tmp_path / "fp8")
    for i, sample in enumerate(samples):
        raw = fp8_reader.get(i)
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn
        assert raw["hidden_scales"].shape == (len(sample["input_ids"]), len(LAYERS))
        assert torch.equal(raw["input_ids"], sample["input_ids"])
        states = fp8_reader.hidden_states(i)
        reference = bf16_reader.hidden_states(i)
        assert torch.equal(reference, sample["hidden_states"].float())
        cosine = torch.nn.functional.cosine_similarity(states, reference, dim=-1)
        assert cosine.min() > 0.995
        # The massive activation survives: its row's scale is set by it.
        assert states[0, -1, 3] == pytest.approx(3000.0, rel=1 / 16)

    def state_bytes(directory: Path) -> int:
        total = 0
        for chunk in sorted(directory.glob("chunk-*.safetensors")):
            with safe_open(chunk, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if name.startswith("hidden_"):
                        tensor = handle.get_tensor(name)
                        total += tensor.numel() * tensor.element_size()
        return total

    tokens = bf16["num_tokens"]
    assert state_bytes(tmp_path / "bf16") == tokens * state_bytes_per_token(4, HIDDEN, "bfloat16")
    assert state_bytes(tmp_path / "fp8") == tokens * state_bytes_per_token(
        4, HIDDEN, "float8_e4m3fn"
    )
    # A float32 scale per row: (H + 4) / 2H of bf16; for SmolLM2's H = 576 that is 0.5035.
    ratio = state_bytes_per_token(4, 576, "float8_e4m3fn") / state_bytes_per_token(
        4, 576, "bfloat16"
    )
    assert ratio <= 0.51


def test_fp8_resume_is_byte_identical_and_dtype_change_discards(tmp_path):
    samples = make_samples(9)
    full = tmp_path / "full"
    write_store(full, samples, SHAPE, META, store_dtype="float8_e4m3fn")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "chunk-00000.safetensors").write_bytes(
        (full / "chunk-00000.safetensors").read_bytes()
    )
    writer = open_writer(resumed, SHAPE, META, chunk_samples=4, store_dtype="float8_e4m3fn")
    assert writer.resume_position([s["id"] for s in samples]) == 4
    for sample in samples[4:]:
        writer.add(sample["id"], sample["input_ids"], sample["loss_mask"], sample["hidden_states"])
    writer.close()
    assert {p.name: p.read_bytes() for p in resumed.iterdir()} == {
        p.name: p.read_bytes() for p in full.iterdir()
    }
    # The same chunk under a bf16 writer is foreign: it is recaptured, not mixed in.
    bf16 = open_writer(full, SHAPE, META, chunk_samples=4)
    assert bf16.resume_position([s["id"] for s in samples]) == 0


def test_collate_dequantizes_on_the_host_and_on_the_device_alike(tmp_path):
    samples = make_samples(6, seed=3)
    write_store(tmp_path / "bf16", samples, SHAPE, META, store_dtype="bfloat16", chunk_samples=2)
    write_store(
        tmp_path / "fp8", samples, SHAPE, META, store_dtype="float8_e4m3fn", chunk_samples=2
    )
    fp8_shards, bf16_shards = CaptureSet([tmp_path / "fp8"]), CaptureSet([tmp_path / "bf16"])
    refs = fp8_shards.samples[:4]
    tokens = sum(r.num_tokens for r in refs)  # room for all, plus padding
    for dtype in (torch.float32, torch.bfloat16):
        host = collate(fp8_shards, refs, tokens, dtype, pad=True)
        kept = collate(fp8_shards, refs, tokens, dtype, pad=True, dequantize_states=False)
        assert kept["hidden_states"].dtype == torch.float8_e4m3fn
        assert kept["hidden_scales"].shape == (1, tokens, len(AUX))
        device = dequantize_batch(kept, dtype)
        assert set(device) == set(host)
        for key in host:
            assert torch.equal(device[key], host[key]), key
        # Against the bf16 store of the same states: the same batch but for fp8 rounding.
        plain = collate(bf16_shards, bf16_shards.samples[:4], tokens, dtype, pad=True)
        for key in ("input_ids", "loss_mask", "position_ids", "document_ids"):
            assert torch.equal(plain[key], host[key])
        for key in ("hidden_states", "verifier_last_hidden_states"):
            assert host[key].dtype == dtype
            width = HIDDEN
            got = host[key].float().unflatten(-1, (-1, width))
            want = plain[key].float().unflatten(-1, (-1, width))
            used = want.abs().amax(-1) > 0
            cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
            assert cosine[used].min() > 0.995
            assert torch.equal(got[~used], want[~used])  # padding stays zero


@pytest.mark.vllm
def test_hooks_extract_to_fp8_against_bf16_and_the_reference(tmp_path, smollm2_dir):
    """Real vLLM engines capture a shard into both store dtypes; the fp8 store's states are
    quantized by the hooks backend's worker (``Quantized``), hold exactly the bits of the bf16
    capture quantized, verify (dequantized) against transformers fp32, take about half the
    bytes and match the plan."""
    from dataclasses import replace

    from config_support import capture_engine_settings, demo_capture_layers, extract_settings

    from draftflow.capture.backends import make_backend
    from draftflow.capture.extract import run_extract
    from draftflow.capture.plan import plan_store
    from draftflow.capture.quant import Quantized
    from draftflow.data.samples import samples_table, write_samples

    generator = torch.Generator().manual_seed(4)
    lengths = [120, 7, 300, 45, 64]
    prompts = [torch.randint(10, 49_000, (n,), generator=generator).tolist() for n in lengths]
    shard = tmp_path / "shard-00000.parquet"
    write_samples(
        shard, samples_table([f"c{i}" for i in range(5)], prompts, [[1] * n for n in lengths])
    )
    layers = demo_capture_layers(smollm2_dir)
    # Deterministic engines: the same calls give the same bf16 bits on either engine
    # (docs/capture.md, "Determinism"), so the two stores can be compared bit for bit.
    engine = capture_engine_settings(
        301,
        max_num_batched_tokens=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=33_554_432,
        reserved_cpus=None,
        deterministic=True,
    )
    stores = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        settings = extract_settings(
            backend="hooks",
            chunk_samples=2,
            store_dtype=dtype,
            verify={"fraction": 1.0, "min_mean_cosine": 0.995, "min_p01_cosine": 0.95},
        )
        backend = make_backend(
            "hooks", smollm2_dir, layers.layer_ids, replace(engine, store_dtype=dtype)
        )
        try:
            out = tmp_path / dtype / "shard-00000"
            stores[dtype] = (run_extract(shard, smollm2_dir, out, settings, backend=backend), out)
            handed = backend.capture(prompts[1:2])[0]
            assert isinstance(handed, Quantized) == (dtype == "float8_e4m3fn")
        finally:
            backend.close()
    bf16_manifest, bf16_dir = stores["bfloat16"]
    fp8_manifest, fp8_dir = stores["float8_e4m3fn"]
    assert fp8_manifest["dtype"] == "float8_e4m3fn" and fp8_manifest["scales"]
    verification = fp8_manifest["verification"]
    assert verification["passed"] and verification["store_dtype"] == "float8_e4m3fn"
    for layer, stats in verification["per_layer"].items():
        # fp8's 3 mantissa bits cost a little cosine against bf16, never the threshold.
        assert stats["mean"] > 0.998, layer
        assert stats["mean"] <= bf16_manifest["verification"]["per_layer"][layer]["mean"] + 1e-4
    # The worker's fp8 is the bf16 capture quantized, bit for bit.
    bf16_reader, fp8_reader = CaptureReader(bf16_dir), CaptureReader(fp8_dir)
    for i in range(len(lengths)):
        values, scales = quantize_fp8(bf16_reader.get(i)["hidden_states"])
        stored = fp8_reader.get(i)
        assert torch.equal(stored["hidden_scales"], scales), i
        assert torch.equal(stored["hidden_states"].view(torch.uint8), values.view(torch.uint8)), i

    def chunk_bytes(directory: Path) -> int:
        return sum(p.stat().st_size for p in directory.glob("chunk-*.safetensors"))

    tokens = sum(lengths)
    for dtype, (_, out) in stores.items():
        tensors, overhead = plan_store(tokens, len(lengths), layers, dtype, 2)
        assert tensors < chunk_bytes(out) <= tensors + overhead
    assert chunk_bytes(fp8_dir) / chunk_bytes(bf16_dir) < 0.51
