"""Split: a pure hash of (id, seed), stable when data is added, fractions close to asked."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from draftflow.data.samples import samples_table, write_samples
from draftflow.data.split import SPLITS, assign_split, split_samples


def fake_samples(ids: list[str]):
    return samples_table(ids, [[1, 2, 3]] * len(ids), [[0, 1, 1]] * len(ids))


def run_split(tmp_path: Path, ids: list[str], **fractions) -> dict[str, set[str]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_samples(tmp_path / "samples.parquet", fake_samples(ids))
    outputs = {name: tmp_path / f"{name}.parquet" for name in SPLITS}
    split_samples(tmp_path / "samples.parquet", outputs, tmp_path / "summary.json", **fractions)
    return {name: set(pq.read_table(path)["id"].to_pylist()) for name, path in outputs.items()}


def test_existing_ids_keep_their_split_when_data_is_added(tmp_path):
    fractions = {"seed": 3, "val_fraction": 0.1, "test_fraction": 0.1}
    old = [f"sharegpt-{i:06x}" for i in range(2000)]
    new = [f"other-{i:06x}" for i in range(3000)]
    before = run_split(tmp_path / "before", old, **fractions)
    grown = old + new
    random.Random(0).shuffle(grown)  # new data may also arrive in another order
    after = run_split(tmp_path / "after", grown, **fractions)
    for name in SPLITS:
        assert before[name] <= after[name]
        assert after[name] & set(old) == before[name]


def test_fractions_are_roughly_right():
    ids = [f"conv-{i}" for i in range(20000)]
    labels = [assign_split(i, 0, 0.1, 0.05) for i in ids]
    assert abs(labels.count("val") / len(ids) - 0.1) < 0.01
    assert abs(labels.count("test") / len(ids) - 0.05) < 0.01
    assert all(assign_split(i, 0, 0.0, 0.0) == "train" for i in ids[:500])


def test_split_depends_on_seed_and_growing_val_only_moves_train_to_val():
    ids = [f"conv-{i}" for i in range(5000)]
    seed0 = [assign_split(i, 0, 0.2, 0.0) for i in ids]
    seed1 = [assign_split(i, 1, 0.2, 0.0) for i in ids]
    assert seed0 != seed1
    larger = [assign_split(i, 0, 0.3, 0.0) for i in ids]
    for small, large in zip(seed0, larger, strict=True):
        assert small == large or (small, large) == ("train", "val")


def test_split_files_partition_the_samples_and_summary_counts(tmp_path):
    ids = [f"conv-{i}" for i in range(500)]
    parts = run_split(tmp_path, ids, seed=0, val_fraction=0.2, test_fraction=0.0)
    assert parts["test"] == set()
    assert parts["train"] | parts["val"] == set(ids)
    assert not parts["train"] & parts["val"]
    # An empty split still has the sample schema, so later stages can read it.
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 0


@pytest.mark.parametrize("val,test", [(-0.1, 0.0), (0.7, 0.6), (1.5, 0.0)])
def test_bad_fractions_are_rejected(val, test):
    with pytest.raises(ValueError, match="fraction"):
        assign_split("x", 0, val, test)


def test_corpus_subset_and_split_are_independent() -> None:
    # Regression: both used one hash, so the lowest-ranked subset landed entirely in val.
    from draftflow.corpus.formats import subset_rank

    ids = [f"sharegpt-{index}" for index in range(20_000)]
    subset = sorted(ids, key=lambda cid: subset_rank(0, cid))[:400]
    splits = [assign_split(cid, 0, 0.05, 0.0) for cid in subset]
    assert 0.9 < splits.count("train") / len(subset) < 0.99
