"""studies/quality_curve.py: its configs validate, and it reads a finished workflow run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from study_support import load_study

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def curve():
    return load_study("quality_curve")


@pytest.mark.parametrize("conversations", [6000, 24000])
def test_each_size_validates_over_the_gpu_example(curve, conversations, tmp_path):
    """What Snakemake reads for one size: the schema's defaults, config/config.yaml, the GPU
    example, the size's overlay."""
    from draftflow.config import load_config

    overlay = tmp_path / "curve.yaml"
    overlay.write_text(json.dumps(curve.overlay(conversations, per_shard=4000)))  # JSON is YAML
    config = load_config(REPO / curve.BASE_CONFIG, overlay)
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
    assert point["variant"] == "eagle3"  # tests/configs/tiny.yaml leaves the schema's
    curve.plot([point, point], tmp_path / "curve.png", k=2)
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_an_engine_share_lets_sizes_share_one_gpu(curve, tmp_path):
    """``--engine-share``: every engine of a size takes that fraction, and each size running at
    once leases the GPU through locks of its own."""
    from draftflow.config import load_config
    from draftflow.workflow.gpu import LOCK_DIR_ENV

    workdir = curve.prepare_workdir(tmp_path, 640, 4000, tokens_per_batch=1024, engine_share=0.04)
    config = load_config(
        workdir / curve.BASE_CONFIG, workdir / curve.OVERLAY, base=workdir / "config/config.yaml"
    )
    assert config["corpus"]["regenerate"]["gpu_memory_utilization"] == 0.04
    assert config["corpus"]["regenerate"]["max_tokens"] == 192  # the example's, kept
    assert config["extract"]["gpu_memory_utilization"] == 0.04
    assert config["bench"]["gpu_memory_utilization"] == 0.04
    assert config["train"]["tokens_per_batch"] == 1024
    assert curve.size_environment(workdir)[LOCK_DIR_ENV] == str(workdir / ".gpu-locks")
    assert config["bench"]["kv_cache_memory_bytes"] is None
    assert config["bench"]["starts"] == "in_turn"


def test_a_kv_size_starts_the_bench_engines_together(curve, tmp_path):
    """``--engine-kv-gib``: no engine profiles the memory that the other sizes change, and the
    bench's six engines start at once."""
    from draftflow.bench.schedule import TOGETHER, bench_schedule
    from draftflow.config import load_config

    workdir = curve.prepare_workdir(
        tmp_path, 640, 4000, tokens_per_batch=1024, engine_share=0.04, engine_kv_gib=2, epochs=20
    )
    config = load_config(
        workdir / curve.BASE_CONFIG, workdir / curve.OVERLAY, base=workdir / "config/config.yaml"
    )
    for section in (config["corpus"]["regenerate"], config["extract"], config["bench"]):
        assert section["kv_cache_memory_bytes"] == 2 * 2**30
    assert config["corpus"]["regenerate"]["gpu_memory_utilization"] == 0.04
    assert config["bench"]["starts"] == TOGETHER
    assert bench_schedule(config["bench"]) == "side_by_side"
    assert config["train"]["epochs"] == 20


def test_gpu_seconds_leave_out_the_wait_for_the_lease(curve, tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train.log").write_text(
        "2026-12-03 19:19:41,303 INFO datasets: ready\n"
        "2026-12-03 19:19:41,966 INFO draftflow.workflow.gpu: waiting for 1 free GPU(s)\n"
        "2026-12-03 19:20:09,303 INFO draftflow.workflow.gpu: leased GPU(s) 0\n"
        "2026-12-03 19:22:00,000 INFO draftflow.train: done\n"
    )
    (tmp_path / "logs" / "vocab.log").write_text("2026-12-03 19:19:00,000 INFO vocab\n")
    held = curve._gpu_seconds(tmp_path, {"train": 160.0, "vocab": 20.0})
    assert held == {"train": 132.0}  # 28 s in the queue; vocab holds no GPU


def test_the_runs_on_record_plot_together(curve, tmp_path):
    """``plot``: the committed runs' points (docs/results) in one figure, each size from the
    latest run that holds it."""
    runs = [REPO / f"docs/results/quality-curve{suffix}.json" for suffix in ("", "-2", "-3")]
    out = tmp_path / "curve.png"
    curve.main(["plot", "--json", *map(str, runs), "--out", str(out)])
    assert out.stat().st_size > 0
    points = curve.latest_points([json.loads(run.read_text())["points"] for run in runs])
    assert [point["workdir"] for point in points] == ["640", "1280", "2560"]
    assert all(point["bench"] for point in points)
    third = json.loads(runs[2].read_text())["points"]
    assert points[1:] == third  # the third run's 1,280 and 2,560 replace the earlier ones


def test_run_benches_only_the_ks_it_is_given(curve, tmp_path, monkeypatch):
    """``run --ks 3``: the size's overlay benches k = 3 alone (two engines: the plain target and
    k = 3), and Snakemake is called on that overlay over the GPU example."""
    import yaml

    calls = []
    monkeypatch.setattr(curve.subprocess, "run", lambda command, **kw: calls.append((command, kw)))
    curve.main(["run", "--work", str(tmp_path), "--sizes", "64", "--ks", "3", "--epochs", "2"])
    workdir = tmp_path / "64"
    overlay = yaml.safe_load((workdir / curve.OVERLAY).read_text())
    assert overlay["bench"]["num_speculative_tokens"] == [3]
    assert overlay["train"]["epochs"] == 2
    ((command, options),) = calls
    assert command[command.index("--configfile") + 1 :][:2] == [curve.BASE_CONFIG, curve.OVERLAY]
    assert options["cwd"] == workdir and options["check"] is True
    # Without --ks, every k of the curve.
    assert curve.overlay(64, per_shard=4000)["bench"]["num_speculative_tokens"] == curve.KS


def test_longer_conversations_reach_regeneration_samples_and_store(curve, tmp_path, monkeypatch):
    """``run --turns 2 --answer-tokens 256 --max-length 1024 --store-dtype float8_e4m3fn``: what
    Snakemake's merged config gives regeneration, the samples and the capture store; a size
    without them keeps the example's one answer of at most 192 tokens in 448, in bf16."""
    from draftflow.config import load_config

    monkeypatch.setattr(curve.subprocess, "run", lambda command, **kw: None)
    longer = ["--turns", "2", "--answer-tokens", "256", "--max-length", "1024"]
    longer += ["--store-dtype", "float8_e4m3fn"]
    curve.main(["run", "--work", str(tmp_path / "long"), "--sizes", "64", *longer])
    curve.main(["run", "--work", str(tmp_path / "plain"), "--sizes", "64"])

    def merged(work: Path) -> dict:
        workdir = work / "64"
        files = (curve.BASE_CONFIG, curve.OVERLAY)
        return load_config(*(workdir / name for name in files), base=workdir / "config/config.yaml")

    config = merged(tmp_path / "long")
    regenerate = config["corpus"]["regenerate"]
    assert (regenerate["max_turns"], regenerate["max_tokens"]) == (2, 256)
    assert regenerate["max_model_len"] == config["tokenize"]["max_length"] == 1024
    assert config["extract"]["store_dtype"] == "float8_e4m3fn"
    assert regenerate["batch_size"] == 1024  # the example's, kept
    config = merged(tmp_path / "plain")
    regenerate = config["corpus"]["regenerate"]
    assert (regenerate["max_turns"], regenerate["max_tokens"]) == (1, 192)
    assert regenerate["max_model_len"] == config["tokenize"]["max_length"] == 448
    assert config["extract"]["store_dtype"] == "bfloat16"


def test_a_variant_overlay_retrains_on_the_same_captures(curve, tmp_path):
    """``--variant eagle3.1`` on a workdir changes the train section only: Snakemake reruns
    train and bench, and regenerate, tokenize and extract keep their outputs."""
    from draftflow.config import load_config

    def merged(variant):
        workdir = curve.prepare_workdir(tmp_path, 640, 4000, variant=variant)
        return load_config(
            workdir / curve.BASE_CONFIG,
            workdir / curve.OVERLAY,
            base=workdir / "config/config.yaml",
        )

    plain, variant = merged(None), merged("eagle3.1")
    assert plain["train"]["variant"] == "eagle3" and variant["train"]["variant"] == "eagle3.1"
    changed = {key for key in plain if plain[key] != variant[key]}
    assert changed == {"train"}


def test_the_carried_data_gives_the_packages_conversations(curve, tmp_path):
    """``--data`` (tools/gpu_curve_data.py's folder, for a GPU machine without the data
    packages): ingest keeps the same conversations under the same ids as from the package's
    whole file, and the prompt sets are the packages' own."""
    import importlib.util
    import sys

    from draftflow.config import load_config
    from draftflow.corpus.ingest import ingest
    from draftflow.resources import resolve_path

    spec = importlib.util.spec_from_file_location(
        "gpu_curve_data", REPO / "tools/gpu_curve_data.py"
    )
    tool = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_curve_data", tool)
    spec.loader.exec_module(tool)
    data = tmp_path / "data"
    sizes = tool.write_curve_data(data, 40)
    assert set(sizes) == set(curve.DATA_FILES.values())

    def ingested(workdir):
        config = load_config(
            workdir / curve.BASE_CONFIG,
            workdir / curve.OVERLAY,
            base=workdir / "config/config.yaml",
        )
        out = workdir / "ingested.jsonl"
        corpus = config["corpus"]
        ingest(
            corpus["sources"],
            out,
            workdir / "rejects.jsonl",
            workdir / "summary.json",
            max_conversations=corpus["max_conversations"],
            seed=corpus["seed"],
            on_bad_record="skip",
        )
        return config, out.read_text(encoding="utf-8")

    packaged_config, packaged = ingested(curve.prepare_workdir(tmp_path / "packaged", 40, 4000))
    carried_config, carried = ingested(
        curve.prepare_workdir(tmp_path / "carried", 40, 4000, data=data)
    )
    assert carried == packaged and packaged.count("\n") == 40
    for packaged_set, carried_set in zip(
        packaged_config["bench"]["datasets"], carried_config["bench"]["datasets"], strict=True
    ):
        assert carried_set["path"].startswith(str(data))
        assert (
            Path(carried_set["path"]).read_bytes()
            == resolve_path(packaged_set["path"]).read_bytes()
        )
