"""Split train/val samples into shards of nearly equal token count (one extract job each)."""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from draftflow.data.samples import read_samples, write_samples
from draftflow.io import atomic_write_json, sha256_file


def balance_shards(token_counts: Sequence[int], num_shards: int) -> list[list[int]]:
    """Row indices per shard: longest sample first into the lightest shard (LPT greedy).

    Ties are broken by row index (samples) and shard index (shards), so the result depends
    only on the input. Indices within a shard are returned in ascending (input) order.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards = {num_shards!r}: must be at least 1")
    if len(token_counts) < num_shards:
        raise ValueError(
            f"{len(token_counts)} samples cannot fill {num_shards} shards: every shard needs "
            "at least one sample (lower extract.num_shards or add data)"
        )
    order = sorted(range(len(token_counts)), key=lambda row: (-token_counts[row], row))
    # Heap of (tokens, samples, shard): the lightest shard, then the emptiest, then the lowest index.
    heap = [(0, 0, shard) for shard in range(num_shards)]
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for row in order:
        tokens, count, shard = heapq.heappop(heap)
        members[shard].append(row)
        heapq.heappush(heap, (tokens + token_counts[row], count + 1, shard))
    return [sorted(rows) for rows in members]


def shard_split(
    table: pa.Table, split: str, outputs: Sequence[str | os.PathLike[str]]
) -> list[dict]:
    """Write ``len(outputs)`` shards of ``table``; return their manifest entries."""
    if table.num_rows < len(outputs):
        raise ValueError(
            f"split {split!r} has {table.num_rows} samples but extract.num_shards.{split} = "
            f"{len(outputs)}: every shard needs at least one sample (lower the shard count "
            "or add data)"
        )
    rows_per_shard = balance_shards(table["num_tokens"].to_pylist(), len(outputs))
    entries = []
    for path, rows in zip(outputs, rows_per_shard, strict=True):
        shard = table.take(pa.array(rows, type=pa.int64()))
        write_samples(path, shard)
        entries.append(
            {
                "name": Path(path).stem,
                "path": str(path),
                "samples": shard.num_rows,
                "tokens": int(pc.sum(shard["num_tokens"]).as_py() or 0),
                "masked_tokens": int(pc.sum(shard["num_masked"]).as_py() or 0),
                "sha256": sha256_file(path),
            }
        )
    return entries


def shard_splits(
    inputs: dict[str, str | os.PathLike[str]],
    outputs: dict[str, Sequence[str | os.PathLike[str]]],
    manifest_path: str | os.PathLike[str],
) -> dict:
    """Shard every split in ``inputs`` into its ``outputs`` and write the manifest last."""
    manifest: dict = {"splits": {}}
    for split, source in inputs.items():
        entries = shard_split(read_samples(source), split, outputs[split])
        tokens = [entry["tokens"] for entry in entries]
        manifest["splits"][split] = {
            "num_shards": len(entries),
            "samples": sum(entry["samples"] for entry in entries),
            "tokens": sum(tokens),
            "max_min_token_ratio": max(tokens) / max(min(tokens), 1),
            "shards": entries,
        }
    atomic_write_json(manifest_path, manifest)
    return manifest
