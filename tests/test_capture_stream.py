"""Chunks written sample by sample (CaptureWriter.expect): the same bytes as a whole-chunk writer."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import draftflow.capture.chunk_file as chunk_file
from draftflow.capture.quant import quantize_fp8
from draftflow.capture.store import CaptureReader, CaptureWriter

LAYERS = [1, 3, 5, 6]
AUX = [1, 3, 5]
HIDDEN = 24
META = {"model": "toy", "model_revision": "abc", "backend": "test"}
DTYPES = ["bfloat16", "float8_e4m3fn"]


def make_samples(lengths: list[int], seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index, length in enumerate(lengths):
        states = torch.randn(length, len(LAYERS), HIDDEN, generator=generator)
        states[0, -1, 2] = 2500.0  # a massive activation: its row's scale differs
        samples.append(
            {
                "id": f"s{index:03d}",
                "input_ids": torch.randint(0, 5000, (length,), generator=generator).int(),
                "loss_mask": torch.randint(0, 2, (length,), generator=generator).to(torch.int8),
                "hidden_states": states.bfloat16(),
            }
        )
    return samples


# Very different lengths: one token, a few, a long one; 11 samples make chunks of 4, 4, 3.
LENGTHS = [1, 700, 3, 37, 1, 2, 1500, 9, 64, 1, 250]


def new_writer(out: Path, store_dtype: str, chunk_samples: int = 4) -> CaptureWriter:
    return CaptureWriter(
        out,
        layer_ids=LAYERS,
        aux_layer_ids=AUX,
        hidden_size=HIDDEN,
        meta=META,
        chunk_samples=chunk_samples,
        store_dtype=store_dtype,
    )


def write_store(out: Path, samples: list[dict], store_dtype: str, announce: bool) -> dict:
    writer = new_writer(out, store_dtype)
    rest = samples[writer.resume_position([s["id"] for s in samples]) :]
    if announce:
        writer.expect((s["id"], len(s["input_ids"])) for s in rest)
    for s in rest:
        writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    return writer.close()


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def reference_chunk(samples: list[dict], metadata: dict[str, str], store_dtype: str) -> bytes:
    """The chunk written in one go from whole tensors, in the documented order."""
    states = torch.cat([s["hidden_states"] for s in samples])
    tensors = {}
    if store_dtype == "float8_e4m3fn":
        # Scales are per row, so the whole chunk quantizes as its samples do one by one.
        tensors["hidden_states"], tensors["hidden_scales"] = quantize_fp8(states)
    else:
        tensors["hidden_states"] = states
    tensors["input_ids"] = torch.cat([s["input_ids"] for s in samples])
    tensors["loss_mask"] = torch.cat([s["loss_mask"] for s in samples])
    codes = {
        torch.bfloat16: "BF16",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float32: "F32",
        torch.int32: "I32",
        torch.int8: "I8",
    }
    header: dict = {"__metadata__": metadata}
    data, offset = b"", 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": codes[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        data += raw
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded + data


@pytest.mark.parametrize("store_dtype", DTYPES)
def test_streamed_chunks_equal_a_reference_writer_and_the_buffered_store(tmp_path, store_dtype):
    samples = make_samples(LENGTHS)
    streamed = write_store(tmp_path / "streamed", samples, store_dtype, announce=True)
    write_store(tmp_path / "buffered", samples, store_dtype, announce=False)
    assert file_bytes(tmp_path / "streamed") == file_bytes(tmp_path / "buffered")
    assert streamed["num_chunks"] == 3  # 4, 4 and a short last chunk of 3
    for index, first in enumerate(range(0, len(samples), 4)):
        name = f"chunk-{index:05d}.safetensors"
        path = tmp_path / "streamed" / name
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata()
        chunk = samples[first : first + 4]
        data = path.read_bytes()
        assert data == reference_chunk(chunk, metadata, store_dtype)
        assert streamed["files"][name] == hashlib.sha256(data).hexdigest()
        header = json.loads(metadata["draftflow"])
        assert header["format"] == "draftflow-capture-chunk/2"
        assert [entry[0] for entry in header["samples"]] == [s["id"] for s in chunk]
        # Every reader of safetensors takes this order: load_file as well as safe_open.
        loaded = load_file(path)
        assert torch.equal(loaded["input_ids"], torch.cat([s["input_ids"] for s in chunk]))
        assert torch.equal(loaded["loss_mask"], torch.cat([s["loss_mask"] for s in chunk]))
        assert loaded["hidden_states"].dtype == getattr(torch, store_dtype)
    reader = CaptureReader(tmp_path / "streamed")
    for i, sample in enumerate(samples):
        got = reader.get(i)
        assert torch.equal(got["input_ids"], sample["input_ids"])
        if store_dtype == "bfloat16":
            assert torch.equal(got["hidden_states"], sample["hidden_states"])
        else:
            states, scales = quantize_fp8(sample["hidden_states"])
            assert torch.equal(got["hidden_scales"], scales)
            assert torch.equal(got["hidden_states"].view(torch.uint8), states.view(torch.uint8))


def test_samples_are_on_disk_before_their_chunk_is_full(tmp_path):
    samples = make_samples([300, 300, 300, 300])
    writer = new_writer(tmp_path, "bfloat16")
    writer.expect((s["id"], len(s["input_ids"])) for s in samples)
    for s in samples[:3]:
        writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    state_bytes = 3 * 300 * len(LAYERS) * HIDDEN * 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        written = sum(p.stat().st_size for p in tmp_path.glob(".chunk-00000.safetensors.*.tmp"))
        if written >= state_bytes:
            break
        time.sleep(0.01)
    assert written >= state_bytes  # header and three samples' states, before the fourth
    assert not (tmp_path / "chunk-00000.safetensors").exists()
    s = samples[3]
    writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    writer.close()
    assert not list(tmp_path.glob(".*.tmp"))
    assert len(CaptureReader(tmp_path)) == 4


def test_announced_samples_must_come_as_announced(tmp_path):
    samples = make_samples([5, 6, 7])
    writer = new_writer(tmp_path, "bfloat16", chunk_samples=2)
    writer.expect((s["id"], len(s["input_ids"])) for s in samples)
    with pytest.raises(RuntimeError, match="twice"):
        writer.expect([])
    first, second = samples[0], samples[1]
    with pytest.raises(ValueError, match="announced 's000' with 5 tokens"):
        writer.add(second["id"], second["input_ids"], second["loss_mask"], second["hidden_states"])
    for s in samples[:2]:
        writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    with pytest.raises(RuntimeError, match="before the first add"):
        writer.expect([])
    with pytest.raises(ValueError, match="close\\(\\) after 2 of the 3 samples"):
        writer.close()
    # The complete chunk is kept for a resumed run; nothing half written is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk-00000.safetensors"]
    assert first["id"] in new_writer(tmp_path, "bfloat16", chunk_samples=2).done_ids()


def test_an_announced_short_chunk_cut_short_leaves_no_file(tmp_path):
    samples = make_samples([5, 6, 7])
    writer = new_writer(tmp_path, "float8_e4m3fn", chunk_samples=4)
    writer.expect((s["id"], len(s["input_ids"])) for s in samples)
    s = samples[0]
    writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    with pytest.raises(ValueError, match="1 of the 3"):
        writer.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("announce", [True, False])
def test_a_failing_writer_thread_surfaces_and_publishes_nothing(tmp_path, monkeypatch, announce):
    def broken_quantize(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(states) == 6:  # the third sample, in chunk 0
            raise OSError("No space left on device (simulated)")
        return quantize_fp8(states)

    monkeypatch.setattr(chunk_file, "quantize_fp8", broken_quantize)
    samples = make_samples([4, 5, 6, 7, 8, 9])
    writer = new_writer(tmp_path, "float8_e4m3fn", chunk_samples=4)
    if announce:
        writer.expect((s["id"], len(s["input_ids"])) for s in samples)
    with pytest.raises(RuntimeError, match=r"chunk-00000\.safetensors failed: No space left"):
        for s in samples:
            writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
        writer.close()
    # Chunk 1 may be published (a resumed run drops it: chunk 0 is missing); nothing is half
    # written and no writer thread is left running.
    assert not list(tmp_path.glob("chunk-00000*")) and not list(tmp_path.glob(".*.tmp"))


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_capture_stream import LENGTHS, make_samples, new_writer
    samples = make_samples(LENGTHS)
    writer = new_writer({out!r}, {dtype!r})
    writer.expect((s["id"], len(s["input_ids"])) for s in samples)
    for count, s in enumerate(samples, start=1):
        writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
        if count == 6:
            writer.wait_written()  # chunk 0 is on disk, chunk 1 half written
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("store_dtype", DTYPES)
def test_killed_and_resumed_stream_writes_the_same_bytes(tmp_path, store_dtype):
    samples = make_samples(LENGTHS)
    reference = tmp_path / "reference"
    write_store(reference, samples, store_dtype, announce=True)
    killed = tmp_path / "killed"
    script = KILL_SCRIPT.format(
        tests=str(Path(__file__).parent), out=str(killed), dtype=store_dtype
    )
    assert subprocess.run([sys.executable, "-c", script], check=False).returncode == -9
    assert [p.name for p in killed.glob("chunk-*")] == ["chunk-00000.safetensors"]
    write_store(killed, samples, store_dtype, announce=True)
    assert file_bytes(killed) == file_bytes(reference)


class ListBackend:
    """A capture backend that hands over prepared states (the extract loop without an engine)."""

    name = "test"

    def __init__(self, states: dict[tuple[int, ...], torch.Tensor]) -> None:
        self.states = states

    def capture(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        return [self.states[tuple(ids)] for ids in token_ids]


def test_the_extract_loop_announces_its_samples_across_engine_calls(tmp_path):
    """Engine calls of 5 samples over chunks of 4 (perf/gpu_capture.py runs calls of 256 over
    chunks of 8), from the start and resumed after one chunk: the bytes of a buffered store."""
    from draftflow.capture.extract import _capture_all

    samples = make_samples(LENGTHS)
    backend = ListBackend({tuple(s["input_ids"].tolist()): s["hidden_states"] for s in samples})
    ids = [s["id"] for s in samples]
    prompts = [s["input_ids"].tolist() for s in samples]
    masks = [s["loss_mask"].tolist() for s in samples]
    write_store(tmp_path / "buffered", samples, "bfloat16", announce=False)
    for name, keep in (("fresh", 0), ("resumed", 1)):
        out = tmp_path / name
        out.mkdir()
        for index in range(keep):
            chunk = f"chunk-{index:05d}.safetensors"
            (out / chunk).write_bytes((tmp_path / "buffered" / chunk).read_bytes())
        writer = new_writer(out, "bfloat16")
        start = writer.resume_position(ids)
        assert start == 4 * keep
        _capture_all(writer, backend, start, ids, prompts, masks, 5)
        writer.close()
        assert file_bytes(out) == file_bytes(tmp_path / "buffered"), name
