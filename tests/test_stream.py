"""The streamed mode (extract.mode: streamed, issue 41): its plan, its window, and the same draft
as the stored mode for less disk, on the real tiny workflow.

The chain's numbering, the by_shard plan and the disk plan's window are checked on their own
first; then one upstream run of the tiny workflow (two train shards, two epochs) is cloned into
a stored and a streamed copy, and the streamed copy's link job is killed with SIGKILL half-way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from stream_support import (
    DRAFT,
    DiskSampler,
    capture_bytes,
    largest_store,
    set_mode,
    sha256,
    stream_test_config,
    tree_bytes,
    untimed_metrics,
)
from workflow_support import (
    clone_workdir,
    prepare_tiny_workdir,
    run_snakemake,
    snakemake_command,
    snakemake_env,
    write_config,
)

from draftflow.capture.layers import CaptureLayers
from draftflow.capture.plan import format_plan, plan_extract
from draftflow.train.captures import ShardLengths, TrainPlan, epoch_order, pack
from draftflow.train.stream import link_chain, shard_order, stream_settings


# ---------------------------------------------------------------- the plan
def test_shard_order_is_a_seeded_permutation():
    orders = {tuple(shard_order(8, seed, epoch)) for seed in (0, 1) for epoch in range(3)}
    assert all(sorted(order) == list(range(8)) for order in orders)
    assert len(orders) > 1  # epochs and seeds visit the shards in different orders
    assert shard_order(8, 0, 1) == shard_order(8, 0, 1)


def test_links_number_epoch_times_shards_plus_position():
    links = link_chain(3, 2, seed=5)
    assert [link.index for link in links] == list(range(6))
    for link in links:
        assert link.index == link.epoch * 3 + link.position
        assert link.shard == shard_order(3, 5, link.epoch)[link.position]


def _lengths(shards: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [
            int(n)
            for n in torch.randint(
                1, 90, (int(torch.randint(3, 12, (1,), generator=generator)),), generator=generator
            )
        ]
        for _ in range(shards)
    ]


@pytest.mark.parametrize("world_size", [1, 2])
def test_by_shard_plan_runs_each_epoch_shard_by_shard(world_size):
    lengths = _lengths(4)
    planned = ShardLengths(lengths)
    plan = TrainPlan(
        planned, 128, epochs=2, seed=3, world_size=world_size, max_steps=None, order="by_shard"
    )
    step = 0
    for link in link_chain(4, 2, seed=3):
        start, end = plan.span(link.epoch, link.shard)
        assert start == step  # the links' spans tile the steps in chain order
        for s in range(start, end):
            for rank in range(world_size):
                assert {ref.shard for ref in plan.batch(s, rank)} == {link.shard}
            assert plan.position(s)[0] == link.epoch
        step = end
    assert step == plan.total_steps
    if world_size == 1:  # every trainable sample once per epoch
        for epoch in range(2):
            first = min(plan.span(epoch, shard)[0] for shard in range(4))
            last = max(plan.span(epoch, shard)[1] for shard in range(4))
            seen = sorted((r.shard, r.index) for s in range(first, last) for r in plan.batch(s))
            assert seen == sorted((r.shard, r.index) for r in planned.samples)


def test_global_plan_is_unchanged_by_the_orders():
    """order global: one shuffle over every shard each epoch, as before by_shard existed."""
    planned = ShardLengths(_lengths(3, seed=1))
    plan = TrainPlan(planned, 128, epochs=2, seed=7, world_size=1, max_steps=None, order="global")
    steps = 0
    for epoch in range(2):
        batches = pack(planned.samples, epoch_order(len(planned.samples), 7, epoch), 128)
        for n, indices in enumerate(batches):
            assert plan.batch(steps + n) == [planned.samples[i] for i in indices]
        steps += len(batches)
    assert plan.total_steps == steps


def test_streamed_config_refuses_max_steps():
    config = stream_test_config(mode="streamed")
    assert stream_settings(config) == {"mode": "streamed", "window": 1}
    config["train"]["max_steps"] = 30
    with pytest.raises(ValueError, match=r"train\.max_steps: null"):
        stream_settings(config)


def test_disk_plan_reports_the_windows_peak(tmp_path):
    layers = CaptureLayers(num_hidden_layers=8, hidden_size=48, aux_layer_ids=[2, 4, 5])
    tokens = {"train": [300, 500, 400, 100], "val": [50]}
    manifest = {
        "splits": {
            split: {
                "shards": [
                    {
                        "name": f"shard-{i:05d}",
                        "path": f"results/shard/{split}/shard-{i:05d}.parquet",
                        "samples": 10,
                        "tokens": n,
                    }
                    for i, n in enumerate(counts)
                ]
            }
            for split, counts in tokens.items()
        }
    }
    stored = plan_extract(manifest, layers, "bfloat16", 8, tmp_path, 0, window=None)
    sizes = {
        Path(s["output"]).name + Path(s["output"]).parent.name: s["total_bytes"]
        for s in stored["shards"]
    }
    assert stored["peak_bytes"] == stored["total_bytes"] == sum(sizes.values())
    for window in (1, 2):
        streamed = plan_extract(manifest, layers, "bfloat16", 8, tmp_path, 0, window=window)
        train = sorted((v for k, v in sizes.items() if k.endswith("train")), reverse=True)
        assert streamed["peak_bytes"] == sum(train[:window]) + sizes["shard-00000val"]
        assert streamed["total_bytes"] == stored["total_bytes"]
        assert f"streamed, window {window}" in format_plan(streamed)
    # Judged on the peak: a disk that holds the window but not the store fits.
    small = plan_extract(
        manifest,
        layers,
        "bfloat16",
        8,
        tmp_path,
        stored["free_bytes"] - streamed["peak_bytes"],
        window=2,
    )
    assert (
        small["fits"]
        and not plan_extract(
            manifest, layers, "bfloat16", 8, tmp_path, small["margin_bytes"], window=None
        )["fits"]
    )


# ---------------------------------------------------------------- the DAG
def _dry_run_jobs(workdir: Path) -> tuple[dict[tuple[str, str | None], list[str]], dict]:
    """(rule, link or None) -> the job's inputs, and the job count per rule, from a dry run."""
    result = run_snakemake(workdir, "--dry-run", "--cores", "2", DRAFT)
    counts = {
        rule: int(count)
        for rule, count in re.findall(
            r"^(\w+)\s+(\d+)$", result.stdout.split("Job stats:")[1], re.M
        )
    }
    jobs = {}
    for block in re.split(r"\n\s*\n", result.stdout):
        rule = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        if rule is None:
            continue
        inputs = re.search(r"^\s+input: (.*)$", block, re.M)
        link = re.search(r"wildcards: link=(\d+)", block)
        key = (rule.group(1), link.group(1) if link else None)
        jobs[key] = inputs.group(1).split(", ") if inputs else []
    return jobs, counts


@pytest.mark.workflow
@pytest.mark.parametrize(("window", "keep_first_epoch"), [(1, False), (2, False), (2, True)])
def test_the_dag_holds_the_window(tmp_path, smollm2_dir, window, keep_first_epoch):
    """Capture of link i waits for the training of link i - window; training of link i for
    link i - 1; with keep_first_epoch every link trains on its shard's stored capture."""
    workdir = prepare_tiny_workdir(tmp_path / "workflow", smollm2_dir)
    config = stream_test_config(mode="streamed", window=window, keep_first_epoch=keep_first_epoch)
    write_config(workdir, config)
    jobs, counts = _dry_run_jobs(workdir)
    links = link_chain(2, 2, config["train"]["seed"])
    marker = "results/stream/link-{:05d}/done.json".format
    for link in links:
        name = f"{link.index:05d}"
        trains = jobs[("train_link", name)]
        assert (marker(link.index - 1) in trains) == (link.index > 0)
        if keep_first_epoch:
            assert f"results/extract/train/shard-{link.shard:05d}" in trains
            assert ("extract_stream", name) not in jobs
            continue
        assert f"results/stream/link-{name}/capture" in trains
        captures = jobs[("extract_stream", name)]
        assert f"results/shard/train/shard-{link.shard:05d}.parquet" in captures
        waits = [path for path in captures if path.endswith("done.json")]
        assert waits == ([marker(link.index - window)] if link.index >= window else [])
    assert jobs[("train_export", None)][0] == marker(len(links) - 1)
    # The val shard, and with keep_first_epoch each train shard once; no stored train job.
    assert counts["extract"] == (3 if keep_first_epoch else 1)
    assert counts.get("extract_stream", 0) == (0 if keep_first_epoch else len(links))
    assert counts["train_link"] == len(links) and "train" not in counts


# ---------------------------------------------------------------- the workflow
# stream_upstream and stream_stored: tests/stream_support.py (session-wide, also for test_slurm.py).


def _link_job_pid(workdir: Path) -> int | None:
    """The process of a running train_link job in ``workdir`` (Snakemake runs the rule's script
    as a copy named after it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if "train_link.py" in command and Path(cwd) == workdir.resolve():
            return int(entry.name)
    return None


def _kill_link_when(workdir: Path, log: Path, text: str, process: subprocess.Popen) -> None:
    """SIGKILL the train_link job once its log shows ``text``."""
    while process.poll() is None:
        if log.is_file() and text in log.read_text():
            pid = _link_job_pid(workdir)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                return
        time.sleep(0.05)
    raise AssertionError(f"the run ended before {log} showed {text!r}")


@pytest.mark.workflow
def test_streamed_run_gives_the_stored_draft_with_a_window_of_disk(
    stream_upstream, stream_stored, tmp_path
):
    stored = stream_stored
    workdir = clone_workdir(stream_upstream, tmp_path / "streamed")
    set_mode(workdir, "streamed", window=1)
    results = workdir / "results"
    sampler = DiskSampler(
        {
            "results": lambda: tree_bytes(results),
            "captures": lambda: capture_bytes(results / "stream"),
        }
    )
    with sampler.running():
        # Link 2 (epoch 1) is killed while it trains, after links 0 and 1 finished.
        process = subprocess.Popen(
            [*snakemake_command(), "--cores", "2", DRAFT],
            cwd=workdir,
            env=snakemake_env(workdir),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        _kill_link_when(
            workdir, workdir / "logs/stream/link-00002/train.log", "training to step", process
        )
        first, _ = process.communicate(timeout=600)
        assert process.returncode != 0, first[-3000:]
        assert (results / "stream/link-00001/done.json").is_file()
        assert not (results / "stream/link-00002/done.json").exists()
        rerun = run_snakemake(workdir, "--cores", "2", DRAFT, timeout=1200)
    output = rerun.stdout + rerun.stderr
    # The rerun starts at the killed link: the finished links and their captures stay done.
    assert "link=00002" in output
    assert "link=00000" not in output and "link=00001" not in output
    # Link 2 resumed from the checkpoint link 1 ended with (no checkpoint of its own yet).
    link1_end = json.loads((results / "stream/link-00001/done.json").read_text())["end"]
    resumed = (workdir / "logs/stream/link-00002/train.log").read_text()
    assert f"resumed from results/train/checkpoints/step-{link1_end:08d}" in resumed
    # Switching the mode recaptures no val shard (extract.mode and window shape only the DAG).
    assert "rule extract:" not in first + output

    # Same draft, same metrics, bit for bit.
    assert sha256(workdir / DRAFT / "model.safetensors") == sha256(
        stored / DRAFT / "model.safetensors"
    )
    assert untimed_metrics(workdir) == untimed_metrics(stored)
    assert len([r for r in untimed_metrics(workdir) if r["kind"] == "val"]) >= 3

    # Less disk: never more than the window's captures; none left at the end.
    largest = largest_store(stored)
    store = tree_bytes(stored / "results/extract/train")
    print("peak capture bytes", sampler.peak["captures"], "largest", largest, "store", store)
    assert sampler.samples > 20
    # A recaptured store is the stored one but for its manifest's timings: 1 % of slack.
    assert 0.5 * largest < sampler.peak["captures"] <= 1.01 * largest < store
    assert not list((results / "stream").glob("link-*/capture"))
    rest = tree_bytes(results)
    assert sampler.peak["results"] <= largest + rest + tree_bytes(results / "train/checkpoints")
