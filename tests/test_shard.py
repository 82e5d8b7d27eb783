"""Shard: token-balanced, deterministic, every sample exactly once, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from draftflow.data.samples import samples_table, write_samples
from draftflow.data.shard import balance_shards, shard_splits


def chat_lengths(count: int, seed: int) -> list[int]:
    """Lengths like a chat corpus: log-normal, many short samples, a long tail, capped."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=5.5, sigma=0.9, size=count), 8, 2048).astype(int).tolist()


def write_split(path: Path, lengths: list[int], prefix: str) -> None:
    ids = [f"{prefix}-{i}" for i in range(len(lengths))]
    write_samples(
        path, samples_table(ids, [[7] * n for n in lengths], [[0] + [1] * (n - 1) for n in lengths])
    )


@pytest.mark.parametrize("count,num_shards", [(2000, 8), (300, 4), (64, 2)])
def test_shards_are_balanced_on_chat_lengths(count, num_shards):
    lengths = chat_lengths(count, seed=count)
    shards = balance_shards(lengths, num_shards)
    totals = [sum(lengths[row] for row in rows) for rows in shards]
    assert sorted(row for rows in shards for row in rows) == list(range(count))
    assert max(totals) / min(totals) < 1.05
    # Greedy largest-first is within max(length) of perfect balance.
    assert max(totals) - min(totals) <= max(lengths)


def test_balance_is_deterministic_with_ties():
    lengths = [100] * 37 + [5] * 11
    first = balance_shards(lengths, 5)
    assert first == balance_shards(list(lengths), 5)
    # 37 long samples go round-robin (ties: lowest shard index first): 8, 8, 7, 7, 7; the
    # 11 short ones fill the three lighter shards in turn: 4, 4, 3.
    assert [len(rows) for rows in first] == [8, 8, 11, 11, 10]
    assert first[0][:2] == [0, 5]


def test_shard_splits_writes_shards_and_manifest(tmp_path):
    write_split(tmp_path / "train.parquet", chat_lengths(400, seed=1), "t")
    write_split(tmp_path / "val.parquet", chat_lengths(30, seed=2), "v")
    outputs = {
        "train": [tmp_path / "shard" / "train" / f"shard-{i:05d}.parquet" for i in range(3)],
        "val": [tmp_path / "shard" / "val" / "shard-00000.parquet"],
    }
    inputs = {"train": tmp_path / "train.parquet", "val": tmp_path / "val.parquet"}
    manifest = shard_splits(inputs, outputs, tmp_path / "shard" / "manifest.json")
    assert json.loads((tmp_path / "shard" / "manifest.json").read_text()) == json.loads(
        json.dumps(manifest)
    )
    for split, paths in outputs.items():
        source = pq.read_table(inputs[split])
        shards = [pq.read_table(path) for path in paths]
        entries = manifest["splits"][split]["shards"]
        assert [e["name"] for e in entries] == [p.stem for p in paths]
        assert [e["samples"] for e in entries] == [s.num_rows for s in shards]
        assert [e["tokens"] for e in entries] == [sum(s["num_tokens"].to_pylist()) for s in shards]
        ids = [i for s in shards for i in s["id"].to_pylist()]
        assert sorted(ids) == sorted(source["id"].to_pylist())
        assert all(s.schema.equals(source.schema, check_metadata=False) for s in shards)
    assert manifest["splits"]["train"]["max_min_token_ratio"] < 1.05

    # Same input, same bytes: a rerun must not invalidate extract's work.
    hashes = [e["sha256"] for e in manifest["splits"]["train"]["shards"]]
    again = shard_splits(inputs, outputs, tmp_path / "shard" / "manifest.json")
    assert [e["sha256"] for e in again["splits"]["train"]["shards"]] == hashes


def test_too_few_samples_for_the_shards_is_a_clear_error(tmp_path):
    write_split(tmp_path / "val.parquet", [10, 20], "v")
    outputs = {"val": [tmp_path / f"shard-{i:05d}.parquet" for i in range(3)]}
    with pytest.raises(
        ValueError, match=r"split 'val' has 2 samples but extract.num_shards.val = 3"
    ):
        shard_splits({"val": tmp_path / "val.parquet"}, outputs, tmp_path / "manifest.json")
    assert not (tmp_path / "manifest.json").exists()
