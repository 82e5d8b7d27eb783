"""The token sample table shared by tokenize, split, shard and extract (docs/design.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from draftflow.io import atomic_path

SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("num_masked", pa.int32(), nullable=False),
    ]
)


def samples_table(
    ids: list[str], input_ids: list[list[int]], loss_masks: list[list[int]]
) -> pa.Table:
    """Build a table in the contract's schema; the count columns are derived, never passed in."""
    return pa.table(
        {
            "id": ids,
            "input_ids": input_ids,
            "loss_mask": loss_masks,
            "num_tokens": [len(ids_) for ids_ in input_ids],
            "num_masked": [sum(mask) for mask in loss_masks],
        },
        schema=SAMPLE_SCHEMA,
    )


def read_samples(path: str | os.PathLike[str]) -> pa.Table:
    table = pq.read_table(path)
    if not table.schema.equals(SAMPLE_SCHEMA, check_metadata=False):
        raise ValueError(
            f"{path}: columns {table.schema} do not match the sample schema {SAMPLE_SCHEMA}"
        )
    return table


def write_samples(path: str | os.PathLike[str], table: pa.Table) -> None:
    """Write a whole table atomically (readers never see half a file)."""
    with atomic_path(path) as tmp:
        pq.write_table(table.cast(SAMPLE_SCHEMA), tmp)


@contextmanager
def sample_writer(path: str | os.PathLike[str]) -> Iterator[pq.ParquetWriter]:
    """Stream row groups into ``path``; the file appears only when the block ends without error."""
    with atomic_path(Path(path)) as tmp:
        writer = pq.ParquetWriter(tmp, SAMPLE_SCHEMA)
        try:
            yield writer
        finally:
            writer.close()
