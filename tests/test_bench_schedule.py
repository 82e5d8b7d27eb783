"""The bench engines side by side or one at a time (draftflow.bench.schedule): which one a
config gets, the refusal at start where the engines cannot share the memory, a real run of two
engines one after the other on the tiny workflow's target and draft, and the tiny workflow's own
bench, whose engines start together."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from workflow_support import copy_workflow, read_config, run_snakemake, tiny_config, write_config

from draftflow.bench.schedule import (
    IN_TURN,
    ONE_AT_A_TIME,
    SIDE_BY_SIDE,
    TOGETHER,
    bench_schedule,
    engine_schedule,
    engine_starts,
)
from draftflow.config import load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("schedule", "engines", "share", "kv_bytes", "expected"),
    [
        ("auto", 3, 0.05, None, SIDE_BY_SIDE),
        ("auto", 6, 0.15, None, SIDE_BY_SIDE),  # 0.90 together: fits
        ("auto", 6, 0.2, None, ONE_AT_A_TIME),  # 1.2: the H200 run that lost its k=4 engine
        ("auto", 6, 0.9, 64 << 20, SIDE_BY_SIDE),  # KV cache in bytes: the share is not used
        ("one_at_a_time", 2, 0.05, None, ONE_AT_A_TIME),
        ("side_by_side", 4, 0.2, None, SIDE_BY_SIDE),
    ],
)
def test_schedule_of_engines(schedule, engines, share, kv_bytes, expected):
    assert engine_schedule(schedule, engines, share, kv_bytes) == expected


def test_side_by_side_that_cannot_fit_is_refused_with_what_would():
    with pytest.raises(ValueError) as refused:
        engine_schedule("side_by_side", 6, 0.2, None)
    message = str(refused.value)
    assert "6 engines alive at once" in message and "1.20 of the memory" in message
    assert "at most 0.150" in message and "one_at_a_time" in message
    with pytest.raises(ValueError, match="must be one of"):
        engine_schedule("sometimes", 2, 0.1, None)


def test_starting_together_needs_each_engines_kv_cache_in_bytes():
    assert engine_starts(IN_TURN, None) == IN_TURN
    assert engine_starts(TOGETHER, 64 << 20) == TOGETHER
    with pytest.raises(ValueError, match=r"needs bench\.kv_cache_memory_bytes"):
        engine_starts(TOGETHER, None)
    with pytest.raises(ValueError, match="must be one of"):
        engine_starts("at_once", 64 << 20)
    bench = load_config(REPO / "config/demo.yaml")["bench"]
    assert bench["starts"] == IN_TURN  # the 2-core demo: starts don't compete for its cores
    with pytest.raises(ValueError, match=r"needs bench\.kv_cache_memory_bytes"):
        bench_schedule({**bench, "starts": TOGETHER, "kv_cache_memory_bytes": None})


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("config/demo.yaml", SIDE_BY_SIDE),
        ("config/examples/smollm2-gpu.yaml", SIDE_BY_SIDE),
        # Six copies of an 8B target (15 GiB each) overflow one 80 GiB GPU side by side.
        ("config/examples/llama3.1-8b-8gpu.yaml", ONE_AT_A_TIME),
        ("config/examples/slurm-cluster.yaml", ONE_AT_A_TIME),
        # Six copies of a 1T target cannot share one node.
        ("config/examples/kimi-k2.5-8gpu.yaml", ONE_AT_A_TIME),
    ],
)
def test_shipped_configs_schedule(config, expected):
    """Each merged as Snakemake merges it: over the schema's defaults, not the demo."""
    assert bench_schedule(load_config(REPO / config)["bench"]) == expected


def test_workflow_refuses_engines_that_cannot_share_at_start(tmp_path):
    workdir = copy_workflow(tmp_path / "workflow")
    config = tiny_config()
    # in_turn: tests/configs/tiny.yaml starts its engines together, which needs the bytes.
    config["bench"].update(
        schedule="side_by_side",
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=None,
        starts="in_turn",
    )
    write_config(workdir, config)
    result = run_snakemake(workdir, "-n", check=False, timeout=300)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "bench.schedule: side_by_side keeps 3 engines alive at once" in output, output[-3000:]


def run_engine_pair(tiny_pipeline, tmp_path, caplog, prompts, **settings):
    """k = 0 and k = 1 on the tiny workflow's target and draft: their results, and the bench's
    engine events (starting, ready, stopped) in order."""
    from config_support import demo_bench_settings

    from draftflow.bench.run import engine_request, run_engines

    request = engine_request(
        str(tiny_pipeline / "resources" / "target"),
        str(tiny_pipeline / "results" / "train" / "draft"),
        [0, 1],
        {"set": prompts},
        # The demo's bench but for these; bf16 as the tiny workflow's own bench runs it.
        demo_bench_settings(
            engine={
                "max_model_len": 512,
                "max_num_seqs": 1,
                "kv_cache_memory_bytes": 64 << 20,
                "dtype": "bfloat16",
            },
            tie_margin=0.0,
            **settings,
        ),
    )
    with caplog.at_level(logging.INFO, logger="draftflow.bench"):
        results = run_engines(request, {k: tmp_path / f"k{k}.json" for k in (0, 1)})
    messages = (record.getMessage() for record in caplog.records)
    events = [
        message
        for message in messages
        if message.startswith(("starting engine", "stopped engine", "engine k="))
    ]
    return results, events


@pytest.mark.vllm
def test_engines_one_at_a_time_on_the_tiny_workflow(tiny_pipeline, tmp_path, caplog):
    """k = 0 and k = 1, each engine stopped before the next starts; the same units, and the
    lossless check's greedy outputs, as side by side."""
    prompts = [
        {"id": "a", "turns": ["Name three colours."]},
        {"id": "b", "turns": ["What is two plus two?"]},
    ]
    results, events = run_engine_pair(
        tiny_pipeline, tmp_path, caplog, prompts, max_tokens=16, repeats=2, schedule="one_at_a_time"
    )
    assert [event for event in events if not event.endswith("ready")] == [
        "starting engine k=0",
        "stopped engine k=0",
        "starting engine k=1",
        "stopped engine k=1",
    ]
    assert {k: result["schedule"] for k, result in results.items()} == {
        0: ONE_AT_A_TIME,
        1: ONE_AT_A_TIME,
    }
    for k in (0, 1):
        runs = results[k]["runs"]
        assert [run["run"] for run in runs] == [0, 1]
        assert [unit["unit"] for unit in runs[0]["units"]] == ["a", "b"]
    plain, drafted = (results[k]["runs"][0]["responses"] for k in (0, 1))
    assert {pid: [r["token_ids"] for r in turns] for pid, turns in plain.items()} == {
        pid: [r["token_ids"] for r in turns] for pid, turns in drafted.items()
    }
    assert results[1]["runs"][0]["num_drafts"] > 0


# The bench's own engine events in the bench job's log (vLLM's lines come between them).
ENGINE_EVENT = re.compile(
    r" draftflow\.bench\.rounds: (starting engine k=\d+|engine k=\d+ ready|stopped engine k=\d+)$"
)


@pytest.mark.vllm
def test_engines_started_together_on_the_tiny_workflow(tiny_pipeline):
    """bench.starts together (tests/configs/tiny.yaml): the workflow's bench job starts every
    engine (k = 0, 1, 2) before any is ready, then times them side by side as usual; its log
    (logs/bench/engines.log) and its results are the record."""
    bench = read_config(tiny_pipeline)["bench"]
    assert bench["starts"] == TOGETHER
    ks = [0, *bench["num_speculative_tokens"]]
    assert len(ks) >= 2
    log = (tiny_pipeline / "logs" / "bench" / "engines.log").read_text()
    events = [match.group(1) for match in map(ENGINE_EVENT.search, log.splitlines()) if match]
    count = len(ks)
    assert events[:count] == [f"starting engine k={k}" for k in ks], events
    assert sorted(events[count : 2 * count]) == [f"engine k={k} ready" for k in ks], events
    assert sorted(events[2 * count : 3 * count]) == [f"stopped engine k={k}" for k in ks], events
    assert f"bench schedule: {SIDE_BY_SIDE} ({ks})" in log
    engines = tiny_pipeline / "results" / "bench" / "engines"
    results = {k: json.loads((engines / f"k{k}.json").read_text()) for k in ks}
    assert {k: result["schedule"] for k, result in results.items()} == dict.fromkeys(
        ks, SIDE_BY_SIDE
    )
    for k in ks[1:]:
        assert all(run["num_drafts"] > 0 for run in results[k]["runs"]), k
