"""The extract stage's disk plan: its estimate against the bytes written, and a disk too small."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from capture_stores import StoreShape, open_writer
from config_support import demo_capture_layers, extract_settings

from draftflow.capture.extract import partial_dir, run_extract
from draftflow.capture.layers import CaptureLayers
from draftflow.capture.plan import (
    InsufficientSpaceError,
    bytes_per_token,
    format_plan,
    plan_extract,
)
from draftflow.capture.store import CaptureReader, CorruptCaptureError
from draftflow.data.samples import samples_table, write_samples
from draftflow.io import DiskFullError

LAYERS = CaptureLayers(num_hidden_layers=8, hidden_size=48, aux_layer_ids=[2, 4, 5])

REPO = Path(__file__).resolve().parents[1]


def store_bytes(directory: Path) -> tuple[int, int]:
    """(tensor bytes, all bytes) of a store: each chunk's size less its safetensors header."""
    tensors = 0
    for chunk in directory.glob("chunk-*.safetensors"):
        with open(chunk, "rb") as handle:
            header = int.from_bytes(handle.read(8), "little")
        tensors += chunk.stat().st_size - 8 - header
    return tensors, sum(p.stat().st_size for p in directory.iterdir())


def shard_manifest(splits: dict[str, list[list[int]]]) -> dict:
    """What the shard rule writes, for shards of these sample lengths (one shard per split)."""
    return {
        "splits": {
            split: {
                "shards": [
                    {
                        "name": "shard-00000",
                        "path": f"results/shard/{split}/shard-00000.parquet",
                        "samples": len(lengths),
                        "tokens": sum(lengths),
                    }
                ]
            }
            for split, lengths in splits.items()
        }
    }


@pytest.mark.parametrize("store_dtype", ["bfloat16", "float8_e4m3fn"])
def test_plan_is_exact_for_tensors_and_bounds_the_rest(tmp_path, store_dtype):
    generator = torch.Generator().manual_seed(0)
    lengths = {
        "train": [int(n) for n in torch.randint(1, 300, (37,), generator=generator)],
        "val": [5, 90],
    }
    plan = plan_extract(
        shard_manifest(lengths),
        LAYERS,
        store_dtype,
        8,
        tmp_path / "results",
        margin_bytes=0,
        window=None,
    )
    expected_per_token = (4 * 48 * (2 if store_dtype == "bfloat16" else 1) + 5) + (
        4 * 4 if store_dtype == "float8_e4m3fn" else 0
    )
    assert plan["bytes_per_token"] == expected_per_token
    for entry in plan["shards"]:
        split = Path(entry["output"]).parent.name
        writer = open_writer(
            entry["output"],
            StoreShape(LAYERS.layer_ids, LAYERS.aux_layer_ids, LAYERS.hidden_size),
            # A long model path: headers and manifests grow with it.
            {"model": "/" + "m" * 200, "model_revision": "r" * 64, "backend": "test"},
            chunk_samples=8,
            store_dtype=store_dtype,
        )
        for index, length in enumerate(lengths[split]):
            writer.add(
                f"{split}-conversation-{uuid.UUID(int=index)}",
                torch.zeros(length, dtype=torch.int32),
                torch.zeros(length, dtype=torch.int8),
                torch.randn(length, 4, 48, generator=generator),
            )
        writer.close()
        tensors, everything = store_bytes(Path(entry["output"]))
        assert tensors == entry["tensor_bytes"]
        assert tensors < everything <= entry["total_bytes"]
    assert plan["tensor_bytes"] == sum(map(sum, lengths.values())) * expected_per_token
    text = format_plan(plan)
    assert "train/shard-00000" in text and str(plan["tensor_bytes"]) in text


def test_fp8_plan_is_about_half_of_bf16_for_a_large_target():
    # A 7168-wide target with four captured layers: 57 KB a token in bf16.
    layers = CaptureLayers(num_hidden_layers=61, hidden_size=7168, aux_layer_ids=[2, 30, 58])
    bf16, fp8 = bytes_per_token(layers, "bfloat16"), bytes_per_token(layers, "float8_e4m3fn")
    assert bf16 == 4 * 7168 * 2 + 5
    assert fp8 / bf16 < 0.51


def write_shard(path: Path, lengths: list[int]) -> None:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 20000, (n,), generator=generator).tolist() for n in lengths]
    masks = [[1] * n for n in lengths]
    ids = [f"c{i}" for i in range(len(lengths))]
    write_samples(path, samples_table(ids, prompts, masks))


def test_extract_refuses_a_disk_too_small_and_fits_one_of_the_planned_size(
    tmp_path, smollm2_dir, small_filesystem
):
    """Real extract jobs (transformers backend) on real small file systems."""
    shard = tmp_path / "shard-00000.parquet"
    lengths = [300, 200, 150, 120, 40]
    write_shard(shard, lengths)
    layers = demo_capture_layers(smollm2_dir)
    plan = plan_extract(
        shard_manifest({"train": lengths}),
        layers,
        "float8_e4m3fn",
        2,
        tmp_path,
        margin_bytes=0,
        window=None,
    )
    need = plan["total_bytes"]
    settings = extract_settings(
        backend="hf",
        chunk_samples=2,
        store_dtype="float8_e4m3fn",
        disk_margin_mb=0,
        verify={"fraction": 0.2},
    )

    # bf16 would need twice as much: on a disk of 3/4 of its size it does not start.
    bf16_plan = plan_extract(
        shard_manifest({"train": lengths}),
        layers,
        "bfloat16",
        2,
        tmp_path,
        margin_bytes=0,
        window=None,
    )
    small = small_filesystem(bf16_plan["total_bytes"] * 3 // 4)
    out = small / "extract" / "train" / "shard-00000"
    bf16 = replace(settings, store_dtype="bfloat16")
    with pytest.raises(InsufficientSpaceError) as refused:
        run_extract(shard, smollm2_dir, out, bf16)
    message = str(refused.value)
    assert f"will write {bf16_plan['total_bytes']} bytes" in message
    assert "extract.disk_margin_mb" in message and "float8_e4m3fn" in message
    # Refused before any capture: no chunk was written.
    assert not list(partial_dir(out).glob("chunk-*"))

    # The margin counts too: fp8 fits that disk, but not with a margin larger than the disk.
    with pytest.raises(InsufficientSpaceError, match="with the margin of 1048576 bytes"):
        run_extract(
            shard,
            smollm2_dir,
            out,
            replace(settings, disk_margin_mb=1),
        )

    # A disk of exactly the planned size (rounded up to tmpfs pages) holds the finished store.
    exact = small_filesystem(-(-need // 4096) * 4096)
    out = exact / "extract" / "train" / "shard-00000"
    manifest = run_extract(shard, smollm2_dir, out, settings)
    assert manifest["dtype"] == "float8_e4m3fn" and manifest["verification"]["passed"]
    tensors, everything = store_bytes(out)
    assert tensors == plan["tensor_bytes"] and everything <= need
    assert CaptureReader(out).hidden_states(0).shape == (300, 4, 576)


def fill_when(first: Path, filler: Path, stop: threading.Event) -> threading.Thread:
    """Another writer: once ``first`` appears, ``filler`` takes every free byte of its disk."""

    def run() -> None:
        while not stop.is_set():
            if first.exists():
                with open(filler, "wb") as handle:
                    free = os.statvfs(filler).f_bavail * os.statvfs(filler).f_frsize
                    os.posix_fallocate(handle.fileno(), 0, free)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_extract_on_a_disk_that_fills_mid_run_keeps_its_chunks_and_resumes_to_the_same_bytes(
    tmp_path, smollm2_dir, small_filesystem
):
    """A real extract job (transformers backend); another writer fills its disk after chunk 0."""
    shard = tmp_path / "shard-00000.parquet"
    lengths = [int(n) for n in torch.randint(40, 160, (16,), generator=torch.Generator())]
    write_shard(shard, lengths)
    settings = extract_settings(
        backend="hf", chunk_samples=1, disk_margin_mb=0, verify={"fraction": 0.1}
    )
    reference = run_extract(shard, smollm2_dir, tmp_path / "reference", settings)

    layers = demo_capture_layers(smollm2_dir)
    plan = plan_extract(
        shard_manifest({"train": lengths}),
        layers,
        "bfloat16",
        1,
        tmp_path,
        margin_bytes=0,
        window=None,
    )
    disk = small_filesystem(plan["total_bytes"] * 2)
    out = disk / "extract" / "train" / "shard-00000"
    filler, stop = disk / "another-job.bin", threading.Event()
    thread = fill_when(partial_dir(out) / "chunk-00000.safetensors", filler, stop)
    try:
        with pytest.raises(DiskFullError) as full:
            run_extract(shard, smollm2_dir, out, settings)
    finally:
        stop.set()
        thread.join()
    message = str(full.value)
    assert "no space left on the file system of" in message and str(disk) in message
    assert "chunk-000" in message and "it needs" in message and "rerun" in message
    # Nothing partial: complete chunks only, no temporary file, no store a reader accepts.
    kept = sorted(p.name for p in partial_dir(out).iterdir())
    assert "chunk-00000.safetensors" in kept and not [n for n in kept if n.endswith(".tmp")]
    assert len([n for n in kept if n.startswith("chunk-")]) < len(lengths)
    assert not (out / "manifest.json").exists()
    with pytest.raises(CorruptCaptureError, match="is missing"):
        CaptureReader(out)

    # Space freed: the rerun keeps the finished chunks and ends with the reference's bytes.
    filler.unlink()
    resumed = run_extract(shard, smollm2_dir, out, settings)
    assert resumed["files"] == reference["files"]


@pytest.mark.workflow
def test_plan_rule_before_extraction(tmp_path, smollm2_dir):
    """``make plan``'s rule in a real workflow: the stages up to the shards, then the plan."""
    from workflow_support import prepare_tiny_workdir, read_config, run_snakemake, write_config

    workdir = prepare_tiny_workdir(tmp_path / "wf", smollm2_dir)
    config = read_config(workdir)
    config["extract"]["store_dtype"] = "float8_e4m3fn"
    write_config(workdir, config)
    out = run_snakemake(workdir, "--cores", "2", "results/extract/plan.json")
    plan = json.loads((workdir / "results/extract/plan.json").read_text())
    shards = json.loads((workdir / "results/shard/manifest.json").read_text())
    tokens = sum(entry["tokens"] for entry in shards["splits"].values())
    assert plan["store_dtype"] == "float8_e4m3fn"
    assert plan["layer_ids"] == [2, 15, 27, 30]
    assert plan["tensor_bytes"] == tokens * (4 * 576 + 4 * 4 + 5)
    assert [Path(s["output"]).parent.name for s in plan["shards"]] == ["train", "val"]
    # Nothing was captured: the plan comes before extraction.
    assert not (workdir / "results/extract/train").exists()
    assert "extract disk plan" in (workdir / "logs/extract/plan.log").read_text()
    assert "extract disk plan" in out.stdout + out.stderr
    # make plan CURVE=...: the forecast reads this run's train tokens from the same plan.
    from draftflow import forecast

    train_tokens = shards["splits"]["train"]["tokens"]
    assert forecast.planned_train_tokens(plan) == train_tokens
    curve = [REPO / "docs/results/quality-curve-4.json", REPO / "docs/results/quality-curve-5.json"]
    result = forecast.plan_forecast(forecast.read_curve(curve), plan, 0.9)
    assert result["train_tokens"] == train_tokens
    assert result["rests_on"]["reach"] < 1  # the tiny run is smaller than any measured size
