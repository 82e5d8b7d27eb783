"""Deterministic train/val/test split by a hash of the conversation id."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from draftflow.data.samples import read_samples, write_samples
from draftflow.io import atomic_write_json

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class SplitSettings:
    """The ``split:`` section: which split each conversation falls into (tokenize counts the
    train split's tokens with it, the split stage writes the splits)."""

    seed: int
    val_fraction: float
    test_fraction: float

    def __post_init__(self) -> None:
        _check_fractions(self.val_fraction, self.test_fraction)

    def assign(self, conversation_id: str) -> str:
        return assign_split(conversation_id, self.seed, self.val_fraction, self.test_fraction)


def _check_fractions(val_fraction: float, test_fraction: float) -> None:
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"split.{name} = {value!r}: must lie in [0, 1]")
    if val_fraction + test_fraction > 1.0:
        raise ValueError(
            f"split.val_fraction + split.test_fraction = {val_fraction + test_fraction!r}: "
            "must be at most 1"
        )


def split_point(conversation_id: str, seed: int) -> float:
    """Map (id, seed) to [0, 1) with SHA-256: stable across runs, machines and Python versions."""
    # Salted apart from the corpus subset hash (draftflow.corpus.formats.subset_rank): with the
    # same hash, a subset of the lowest ranks would fall entirely into val.
    digest = hashlib.sha256(f"split:{seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def assign_split(conversation_id: str, seed: int, val_fraction: float, test_fraction: float) -> str:
    """Return "train", "val" or "test" for one conversation: a function of its id and seed.

    Test takes the lowest hash values, val the next ones, so adding data never moves a
    conversation, and growing a fraction only moves conversations into that split.
    """
    _check_fractions(val_fraction, test_fraction)
    point = split_point(conversation_id, seed)
    if point < test_fraction:
        return "test"
    if point < test_fraction + val_fraction:
        return "val"
    return "train"


def split_table(
    table: pa.Table, seed: int, val_fraction: float, test_fraction: float
) -> dict[str, pa.Table]:
    """Rows of ``table`` per split, in their original order."""
    labels = pa.array(
        [assign_split(i, seed, val_fraction, test_fraction) for i in table["id"].to_pylist()]
    )
    return {name: table.filter(pc.equal(labels, name)) for name in SPLITS}


def split_samples(
    samples_path: str | os.PathLike[str],
    outputs: Mapping[str, str | os.PathLike[str]],
    summary_path: str | os.PathLike[str],
    seed: int,
    val_fraction: float,
    test_fraction: float,
) -> dict:
    """Write one Parquet file per split (empty ones included) and a JSON summary."""
    missing = set(SPLITS) - set(outputs)
    if missing:
        raise ValueError(f"split outputs lack {sorted(missing)}; need all of {list(SPLITS)}")
    table = read_samples(samples_path)
    parts = split_table(table, seed, val_fraction, test_fraction)
    summary: dict = {
        "seed": seed,
        "val_fraction": val_fraction,
        "test_fraction": test_fraction,
        "splits": {},
    }
    for name, part in parts.items():
        write_samples(outputs[name], part)
        summary["splits"][name] = {
            "samples": part.num_rows,
            "tokens": int(pc.sum(part["num_tokens"]).as_py() or 0),
            "masked_tokens": int(pc.sum(part["num_masked"]).as_py() or 0),
        }
    atomic_write_json(summary_path, summary)
    return summary
