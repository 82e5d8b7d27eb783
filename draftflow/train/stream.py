"""The link chain of the streamed mode (extract.mode: streamed), without torch.

Training runs as links i = epoch * S + position over S train shards: link i trains the batches
of one (epoch, shard), the shard at ``position`` of that epoch's seeded shard order, and its
capture is a Snakemake ``temp()`` output deleted once the link finishes (rules/stream.smk). The
rules and the training loop both need the same numbering, so it lives here, free of torch: the
Snakefile imports it when it builds the DAG.

The stream plan (``results/stream/train/plan/manifest.json``) holds every train shard's sample
lengths, read from the shard files before any capture: the batch plan of every link, and the
total step count the learning-rate schedule needs, are known before the first capture runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftflow.io import atomic_write_json, read_json, staged_dir

MODES = ("stored", "streamed")
PLAN_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Link:
    """One training job of the chain: the batches of ``shard`` in ``epoch``."""

    index: int
    epoch: int
    position: int
    shard: int


def shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The order an epoch visits the shards in (train.order: by_shard): a seeded permutation.

    sha256-ranked rather than torch's generator so that the Snakefile computes it without torch.
    """

    def rank(shard: int) -> bytes:
        return hashlib.sha256(f"{seed}:{epoch}:{shard}".encode()).digest()

    return sorted(range(num_shards), key=rank)


def link_chain(num_shards: int, epochs: int, seed: int) -> list[Link]:
    """Every link of a streamed run, in training order."""
    return [
        Link(epoch * num_shards + position, epoch, position, shard)
        for epoch in range(epochs)
        for position, shard in enumerate(shard_order(num_shards, seed, epoch))
    ]


def link_name(index: int) -> str:
    return f"link-{index:05d}"


def stream_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The checks of a streamed config, once at start; returns the mode's keys.

    Streamed training visits the shards one at a time, so it trains in train.order by_shard
    (forced, and said so by the caller); train.max_steps would cut or extend the chain at a step
    only known once the shards are cut, so it is refused.
    """
    extract, train = config["extract"], config["train"]
    if extract["mode"] != "streamed":
        return {"mode": extract["mode"], "window": None}
    if train["max_steps"] is not None:
        raise ValueError(
            f"extract.mode: streamed with train.max_steps: {train['max_steps']}: the chain of "
            "training links is one per epoch and shard, so its length is set by train.epochs; "
            "set train.max_steps: null (and train.epochs), or use extract.mode: stored"
        )
    return {"mode": "streamed", "window": int(extract["window"])}


# ---------------------------------------------------------------- the stream plan
def read_shard_lengths(parquets: Sequence[str | os.PathLike[str]]) -> list[list[int]]:
    """Tokens of every sample of every shard file, in file order (a capture store's order)."""
    import pyarrow.parquet as pq

    return [
        [int(n) for n in pq.read_table(path, columns=["num_tokens"])["num_tokens"].to_pylist()]
        for path in parquets
    ]


def write_stream_plan(
    parquets: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str]
) -> dict[str, Any]:
    """``out_dir/manifest.json``: sample lengths per train shard, with the totals a capture
    store's manifest has (``num_samples``, ``num_tokens``), so the report reads it as one."""
    lengths = read_shard_lengths(parquets)
    plan = {
        "shards": [str(path) for path in parquets],
        "lengths": lengths,
        "num_samples": sum(len(shard) for shard in lengths),
        "num_tokens": sum(sum(shard) for shard in lengths),
        "digest": lengths_digest(lengths),
    }
    with staged_dir(Path(out_dir)) as tmp:
        atomic_write_json(tmp / PLAN_MANIFEST, plan)
    return plan


def lengths_digest(lengths: Sequence[Sequence[int]]) -> str:
    """Identity of the planned data: checkpoints of other data are not resumed."""
    return hashlib.sha256(json.dumps([list(s) for s in lengths]).encode()).hexdigest()


def read_stream_plan(plan_dir: str | os.PathLike[str]) -> dict[str, Any]:
    return read_json(Path(plan_dir) / PLAN_MANIFEST)


def write_marker(path: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    """The link's only output: small, so the chain's bookkeeping costs no disk."""
    atomic_write_json(Path(path), dict(record))
