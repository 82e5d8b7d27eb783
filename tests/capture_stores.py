"""Capture stores for the tests: written through CaptureWriter from samples held in memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftflow.capture.quant import BF16
from draftflow.capture.store import CaptureWriter


@dataclass(frozen=True)
class StoreShape:
    """What every sample of one store has in common."""

    layer_ids: Sequence[int]
    aux_layer_ids: Sequence[int]
    hidden_size: int


def random_samples(
    count: int, shape: StoreShape, seed: int = 0, min_length: int = 1, id_prefix: str = "sample-"
) -> list[dict[str, Any]]:
    """``count`` samples of 1 to 39 tokens (at least ``min_length``), bf16 states of ``shape``."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        length = int(torch.randint(min_length, 40, (1,), generator=generator))
        samples.append(
            {
                "id": f"{id_prefix}{index:03d}",
                "input_ids": torch.randint(0, 1000, (length,), generator=generator).int(),
                "loss_mask": torch.randint(0, 2, (length,), generator=generator).to(torch.int8),
                "hidden_states": torch.randn(
                    length, len(shape.layer_ids), shape.hidden_size, generator=generator
                ).to(torch.bfloat16),
            }
        )
    return samples


def open_writer(
    out: str | Path,
    shape: StoreShape,
    meta: dict[str, Any],
    chunk_samples: int = 4,
    store_dtype: str = BF16,
) -> CaptureWriter:
    """A CaptureWriter of ``shape``: small chunks (4 samples), bf16 unless told."""
    return CaptureWriter(
        out,
        layer_ids=list(shape.layer_ids),
        aux_layer_ids=list(shape.aux_layer_ids),
        hidden_size=shape.hidden_size,
        meta=meta,
        chunk_samples=chunk_samples,
        store_dtype=store_dtype,
    )


def write_store(
    out: str | Path,
    samples: Sequence[dict[str, Any]],
    shape: StoreShape,
    meta: dict[str, Any],
    chunk_samples: int = 4,
    store_dtype: str = BF16,
) -> dict[str, Any]:
    """Write (or finish, resuming what is there) a store of ``samples``; return its manifest."""
    writer = open_writer(out, shape, meta, chunk_samples=chunk_samples, store_dtype=store_dtype)
    skip = writer.resume_position([s["id"] for s in samples])
    # Resuming keeps exactly a prefix of the samples.
    assert writer.done_ids() == {s["id"] for s in samples[:skip]}
    for sample in samples[skip:]:
        writer.add(sample["id"], sample["input_ids"], sample["loss_mask"], sample["hidden_states"])
    return writer.close()
