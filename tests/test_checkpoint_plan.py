"""The training checkpoints' disk (draftflow.plan.checkpoints) against checkpoints written for
real: the streamed runs of perf/streamed_vs_stored.py kept train.keep_checkpoints of them and
measured their bytes on an H200 and on the CPU (docs/results)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stream_support import stream_test_config
from workflow_support import merge

from draftflow.plan.checkpoints import plan_checkpoints
from draftflow.plan.target_shape import read_target_shape

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "tests/data/targets/smollm2-135m/config.json"
MEASURED = ("streamed-vs-stored-gpu-h200-2026-12-06.json", "streamed-vs-stored-cpu.json")


@pytest.mark.parametrize("record", MEASURED)
def test_plan_matches_the_checkpoints_a_streamed_run_kept(record):
    data = json.loads((REPO / "docs/results" / record).read_text())
    measured = data["runs"]["streamed_window_1"]["final_checkpoint_bytes"]
    plan = plan_checkpoints(stream_test_config(backend="hooks"), read_target_shape(SMOLLM2))
    # What the plan leaves out: the RNG states, step counters and the files' headers (KiB).
    assert plan.total_bytes <= measured < plan.total_bytes * 1.001


def test_adamw_keeps_two_moments_where_muon_keeps_one():
    config = stream_test_config(backend="hooks")
    shape = read_target_shape(SMOLLM2)
    muon = plan_checkpoints(merge(config, {"train": {"optimizer": "muon"}}), shape)
    adamw = plan_checkpoints(merge(config, {"train": {"optimizer": "adamw"}}), shape)
    kept = plan_checkpoints(merge(config, {"train": {"keep_checkpoints": 5}}), shape)
    assert adamw.bytes_each - muon.bytes_each == 4 * muon.matrix_parameters
    assert kept.total_bytes == 5 * kept.bytes_each
