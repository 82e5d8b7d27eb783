"""The capture store: layout, resume after a kill, checksums."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from capture_stores import StoreShape, open_writer, random_samples, write_store
from safetensors import safe_open

from draftflow.capture.store import CaptureReader, CorruptCaptureError, update_manifest

LAYERS = [2, 4, 7, 8]
AUX = [2, 4, 7]
HIDDEN = 16
META = {"model": "toy", "model_revision": "abc", "vllm_version": None, "backend": "test"}


SHAPE = StoreShape(LAYERS, AUX, HIDDEN)


def make_samples(count: int, seed: int = 0) -> list[dict]:
    return random_samples(count, SHAPE, seed)


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_round_trip_layout_and_manifest(tmp_path):
    samples = make_samples(10)
    manifest = write_store(tmp_path / "shard", samples, SHAPE, META)
    assert manifest["num_samples"] == 10
    assert manifest["num_tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert manifest["layer_ids"] == LAYERS and manifest["aux_layer_ids"] == AUX
    assert manifest["complete"] is True and manifest["backend"] == "test"
    # chunk k holds samples [4k, 4k+4): 3 chunks for 10 samples
    assert sorted(manifest["files"]) == [
        "chunk-00000.safetensors",
        "chunk-00001.safetensors",
        "chunk-00002.safetensors",
        "index.json",
    ]
    index = json.loads((tmp_path / "shard" / "index.json").read_text())["samples"]
    assert [e["chunk"] for e in index] == ["chunk-00000.safetensors"] * 4 + [
        "chunk-00001.safetensors"
    ] * 4 + ["chunk-00002.safetensors"] * 2
    with safe_open(tmp_path / "shard" / "chunk-00002.safetensors", framework="pt") as handle:
        assert handle.get_tensor("hidden_states").dtype == torch.bfloat16
        assert handle.get_tensor("input_ids").dtype == torch.int32
        assert handle.get_tensor("loss_mask").dtype == torch.int8

    reader = CaptureReader(tmp_path / "shard")
    assert len(reader) == 10
    assert reader.sample_ids == [s["id"] for s in samples]
    for i, sample in enumerate(samples):
        got = reader.get(i)
        for name in ("input_ids", "loss_mask", "hidden_states"):
            assert got[name].dtype == sample[name].dtype
            assert torch.equal(got[name], sample[name]), (i, name)


def test_resume_after_partial_run_is_byte_identical(tmp_path):
    samples = make_samples(11)
    reference = tmp_path / "reference"
    write_store(reference, samples, SHAPE, META)

    resumed = tmp_path / "resumed"
    writer = open_writer(resumed, SHAPE, META, chunk_samples=4)
    for sample in samples[:10]:  # two full chunks written, two samples only buffered: "killed"
        writer.add(sample["id"], sample["input_ids"], sample["loss_mask"], sample["hidden_states"])
    writer.wait_written()
    del writer
    (resumed / ".chunk-00002.safetensors.junk.tmp").write_bytes(b"half a chunk")
    assert sorted(p.name for p in resumed.iterdir() if not p.name.endswith(".tmp")) == [
        "chunk-00000.safetensors",
        "chunk-00001.safetensors",
    ]
    write_store(resumed, samples, SHAPE, META)
    assert file_bytes(resumed) == file_bytes(reference)


def test_resume_discards_short_and_foreign_chunks(tmp_path):
    samples = make_samples(9)
    out = tmp_path / "shard"
    write_store(out, samples, SHAPE, META)  # complete: chunks of 4, 4, 1
    # The short last chunk is recaptured; chunks of another configuration are not reused.
    writer = open_writer(out, SHAPE, META, chunk_samples=4)
    assert len(writer.done_ids()) == 8
    assert not (out / "manifest.json").exists()
    other = open_writer(out, SHAPE, {**META, "model_revision": "changed"}, chunk_samples=4)
    assert other.done_ids() == set()
    assert not any(out.glob("chunk-*"))


def test_resume_refuses_a_reordered_input(tmp_path):
    samples = make_samples(9)
    write_store(tmp_path / "shard", samples, SHAPE, META)
    with pytest.raises(ValueError, match="input order changed"):
        write_store(tmp_path / "shard", list(reversed(samples)), SHAPE, META)


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_capture_store import make_samples, LAYERS, AUX, HIDDEN, META
    from draftflow.capture.store import CaptureWriter
    writer = CaptureWriter({out!r}, layer_ids=LAYERS, aux_layer_ids=AUX, hidden_size=HIDDEN,
                         meta=META, chunk_samples=4, store_dtype="bfloat16")
    for count, s in enumerate(make_samples(11), start=1):
        writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
        if count == 6:
            writer.wait_written()  # chunks are written on threads: chunk 0 is on disk now
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_kill_and_resume_in_subprocess(tmp_path):
    samples = make_samples(11)
    reference = tmp_path / "reference"
    write_store(reference, samples, SHAPE, META)
    killed = tmp_path / "killed"
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), out=str(killed))
    result = subprocess.run([sys.executable, "-c", script], check=False)
    assert result.returncode == -9
    assert [p.name for p in killed.glob("chunk-*")] == ["chunk-00000.safetensors"]
    write_store(killed, samples, SHAPE, META)
    assert file_bytes(killed) == file_bytes(reference)


def test_corrupt_file_is_named(tmp_path):
    out = tmp_path / "shard"
    write_store(out, make_samples(6), SHAPE, META)
    CaptureReader(out)  # intact
    chunk = out / "chunk-00001.safetensors"
    data = bytearray(chunk.read_bytes())
    data[-3] ^= 0xFF  # flip bits in the last tensor's bytes
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptCaptureError, match=r"chunk-00001\.safetensors"):
        CaptureReader(out)
    CaptureReader(out, verify=False)  # opt-out still opens it
    chunk.unlink()
    with pytest.raises(CorruptCaptureError, match="missing"):
        CaptureReader(out)


def test_update_manifest_keeps_checksums(tmp_path):
    out = tmp_path / "shard"
    write_store(out, make_samples(3), SHAPE, META)
    manifest = update_manifest(out, {"verification": {"passed": True}})
    assert manifest["verification"] == {"passed": True}
    CaptureReader(out)
    with pytest.raises(ValueError, match="files"):
        update_manifest(out, {"files": {}})


def test_bad_shapes_are_rejected(tmp_path):
    writer = open_writer(tmp_path, SHAPE, META)
    ids = torch.zeros(5, dtype=torch.int32)
    mask = torch.ones(5, dtype=torch.int8)
    with pytest.raises(ValueError, match="expected"):
        writer.add("a", ids, mask, torch.zeros(5, 3, HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="same non-zero length"):
        writer.add("a", ids, mask[:4], torch.zeros(5, 4, HIDDEN, dtype=torch.bfloat16))
    writer.add("a", ids, mask, torch.zeros(5, 4, HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="already"):
        writer.add("a", ids, mask, torch.zeros(5, 4, HIDDEN, dtype=torch.bfloat16))
