"""studies/quality_curve.py: its configs validate, and it reads a finished workflow run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def curve():
    spec = importlib.util.spec_from_file_location(
        "quality_curve", REPO / "studies/quality_curve.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("conversations", [6000, 24000])
def test_each_size_validates_over_the_gpu_example(curve, conversations):
    """What Snakemake reads for one size: the default, the GPU example, the size's overlay."""
    import yaml
    from snakemake.utils import update_config, validate

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    update_config(config, yaml.safe_load((REPO / curve.BASE_CONFIG).read_text()))
    update_config(config, curve.overlay(conversations, per_shard=4000))
    validate(config, str(REPO / "config" / "schema.yaml"))
    assert config["corpus"]["max_conversations"] == conversations
    assert config["extract"]["num_shards"]["train"] == conversations // 4000 + (
        conversations % 4000 > 0
    )
    assert config["bench"]["num_speculative_tokens"] == [1, 2, 3, 4, 5]
    assert all(dataset["limit"] is None for dataset in config["bench"]["datasets"])
    assert config["bench"]["temperature"] == 0.0  # greedy: the lossless check applies
    # The six engines fit on one GPU together (the H200 run with 0.2 each lost its k=4 engine).
    from draftflow.bench.schedule import SIDE_BY_SIDE, engine_schedule

    assert engine_schedule("side_by_side", 6, config["bench"]["gpu_memory_utilization"], None)
    assert engine_schedule("auto", 6, config["bench"]["gpu_memory_utilization"], None) == (
        SIDE_BY_SIDE
    )


def test_a_finished_run_is_read_as_one_point(curve, tiny_pipeline, tmp_path):
    """The tiny workflow's real outputs: tokens, val accuracy, τ per k, seconds per stage."""
    point = curve.collect_point(tiny_pipeline)
    manifests = (tiny_pipeline / "results/extract/train").glob("*/manifest.json")
    assert point["train_tokens"] == sum(json.loads(m.read_text())["num_tokens"] for m in manifests)
    assert point["train_tokens"] > 0
    assert len(point["val"]["full_acc"]) == len(point["val"]["cond_acc"]) > 0
    (rows,) = point["bench"].values()  # tests/configs/tiny.yaml benches one dataset
    assert sorted({row["k"] for row in rows}) == [1, 2]
    for row in rows:
        assert row["acceptance_length"] >= 1.0
        assert len(row["acceptance_per_pos"]) == row["k"]
        assert row["outputs_identical"] is True
    assert point["stage_seconds"]["train"] > 0
    curve.plot([point, point], tmp_path / "curve.png", k=2)
    assert (tmp_path / "curve.png").stat().st_size > 0
