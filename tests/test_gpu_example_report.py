"""tools/gpu_example_report.py: a run's jobs, bytes and peak GPU memory per engine, from
Snakemake's log, benchmark TSVs, job logs and nvidia-smi samples (written here in the formats
those tools write), and the engine plan of config/examples/overlays/llama3.1-8b-one-gpu.yaml."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import gpu_example_report as report  # noqa: E402

EXAMPLE = REPO / "config" / "examples" / "llama3.1-8b-8gpu.yaml"
OVERLAY = REPO / "config" / "examples" / "overlays" / "llama3.1-8b-one-gpu.yaml"
LLAMA = REPO / "tests" / "data" / "targets" / "llama-3.1-8b" / "config.json"
T0 = datetime(2026, 12, 5, 18, 0, 0)

BENCHMARK_HEADER = (
    "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time"
)


def stamp(seconds: float) -> str:
    """Snakemake's own time line (ctime, day padded with a space)."""
    return f"[{(T0 + timedelta(seconds=seconds)).strftime('%a %b %e %H:%M:%S %Y')}]"


def job_block(seconds: float, rule: str, jobid: int, **keys: str) -> str:
    lines = [stamp(seconds), f"rule {rule}:", "    output: something"]
    lines += [f"    {key}: {value}" for key, value in keys.items()]
    lines += [f"    jobid: {jobid}", "    resources: tmpdir=/tmp"]
    return "\n".join(lines) + "\n"


def finished(seconds: float, rule: str, jobid: int) -> str:
    return f"{stamp(seconds)}\nFinished jobid: {jobid} (Rule: {rule})\n1 of 9 steps done\n"


SNAKEMAKE_LOG = (
    "Building DAG of jobs...\nExecute 2 jobs...\n\n"
    + job_block(0, "prepare_target", 3, log="logs/prepare_target.log")
    + job_block(0, "ingest", 4, benchmark="benchmarks/ingest.tsv")
    + finished(4, "ingest", 4)
    + finished(20, "prepare_target", 3)
    + job_block(20, "regenerate", 5, benchmark="benchmarks/regenerate.tsv")
    + finished(100, "regenerate", 5)
    + job_block(
        100,
        "extract",
        7,
        log="logs/extract/train/shard-00000.log",
        benchmark="benchmarks/extract/train/shard-00000.tsv",
        wildcards="split=train, shard=shard-00000",
    )
    + finished(170, "extract", 7)
    # the next GPU job starts in the second the last one ended
    + job_block(
        170,
        "extract",
        8,
        log="logs/extract/val/shard-00000.log",
        benchmark="benchmarks/extract/val/shard-00000.tsv",
        wildcards="split=val, shard=shard-00000",
    )
    + "RuleException:\nCalledProcessError in file Snakefile\n"
    + f"{stamp(230)}\nError in rule extract:\n    message: None\n    jobid: 8\n"
    + "    log: logs/extract/val/shard-00000.log (check log file(s) for error details)\n"
    + job_block(240, "bench_engines", 9, log="logs/bench/engines.log")
    + "Terminating processes on user request, this might take some time.\n"
)


def engines_log(seconds_and_messages: list[tuple[float, str]]) -> str:
    lines = []
    for seconds, message in seconds_and_messages:
        when = T0 + timedelta(seconds=seconds)
        stamp_text = when.strftime("%Y-%m-%d %H:%M:%S") + f",{when.microsecond // 1000:03d}"
        lines.append(f"{stamp_text} INFO draftflow.bench.rounds: {message}")
    return "\n".join(lines) + "\n"


def samples(points: list[tuple[float, int]]) -> str:
    """nvidia-smi's csv,noheader,nounits lines of timestamp and memory.used."""
    lines = ["[N/A], [N/A]"]
    for seconds, mib in points:
        when = T0 + timedelta(seconds=seconds)
        lines.append(f"{when.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {mib}")
    return "\n".join(lines) + "\n"


def write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    write(tmp_path / "benchmarks/ingest.tsv", f"{BENCHMARK_HEADER}\n3.81\t0:00:03\t120.5\n")
    write(tmp_path / "benchmarks/regenerate.tsv", f"{BENCHMARK_HEADER}\n79.50\t0:01:19\t9000\n")
    write(tmp_path / "benchmarks/extract/train/shard-00000.tsv", f"{BENCHMARK_HEADER}\n69.2\n")
    write(
        tmp_path / "logs/bench/engines.log",
        engines_log(
            [
                (241.0, "bench schedule: one_at_a_time ([0] | [3])"),
                (241.5, "starting engine k=0"),
                (270.0, "engine k=0 ready"),
                (285.25, "stopped engine k=0"),
                (285.5, "starting engine k=3"),
                (330.0, "stopped engine k=3"),
                (330.5, "measuring the plain target's margin at 2 difference(s)"),
                (331.0, "starting engine k=0"),
            ]
        ),
    )
    write(tmp_path / "results/corpus/ingested.jsonl", b"x" * 1000)
    write(tmp_path / "results/corpus/regenerated.jsonl", b"x" * 500)
    write(tmp_path / "results/extract/train/shard-00000/chunk-00000.safetensors", b"x" * 7000)
    manifest = json.dumps({"backend": "native", "verification": {"passed": True}}).encode()
    write(tmp_path / "results/extract/train/shard-00000/manifest.json", manifest.ljust(100))
    plan = {
        "shards": [
            {
                "output": "results/extract/train/shard-00000",
                "num_samples": 196,
                "num_tokens": 200,
                "total_bytes": 8000,
            },
            {
                "output": "results/extract/val/shard-00000",
                "num_samples": 4,
                "num_tokens": 10,
                "total_bytes": 400,
            },
        ]
    }
    write(tmp_path / "results/extract/plan.json", json.dumps(plan))
    (tmp_path / "resources").mkdir()
    (tmp_path / "resources/target").symlink_to(tmp_path / "results/corpus")
    return tmp_path


GPU_SAMPLES = samples(
    [
        (1, 0),
        (10, 3),
        (21, 900),  # regenerate's first grace seconds: no engine yet
        (60, 70_000),
        (99, 70_100),
        (100.5, 70_100),  # regenerate's memory, sampled as extract train starts
        (101, 70_100),
        (140, 69_000),
        (160, 33_000),  # the transformers check after the engine
        (171, 69_500),  # extract train's, in the grace of extract val
        (200, 68_000),
        (250, 100),
        (280, 71_000),
        (300, 72_500),
        (335, 71_900),
    ]
)
PLAN = [
    {"name": "regenerate", "jobs": ["regenerate"], "memory_bytes": 72 << 30},
    {
        "name": "extract train (1 jobs)",
        "jobs": ["extract train/shard-00000"],
        "memory_bytes": 70 << 30,
    },
    {"name": "extract val (1 jobs)", "jobs": ["extract val/shard-00000"], "memory_bytes": 0},
    {"name": "bench k=0", "jobs": ["bench k=0"], "memory_bytes": 72 << 30},
    {"name": "bench k=3", "jobs": ["bench k=3"], "memory_bytes": 72 << 30},
]


def test_jobs_from_snakemakes_log():
    jobs = {job.jobid: job for job in report.parse_snakemake_log(SNAKEMAKE_LOG)}
    assert [jobs[i].name for i in sorted(jobs)] == [
        "prepare_target",
        "ingest",
        "regenerate",
        "extract train/shard-00000",
        "extract val/shard-00000",
        "bench_engines",
    ]
    assert jobs[3].start == T0 and jobs[3].end == T0 + timedelta(seconds=20)
    assert jobs[7].benchmark == "benchmarks/extract/train/shard-00000.tsv"
    assert jobs[8].status == "failed" and jobs[8].end == T0 + timedelta(seconds=230)
    assert jobs[8].log == "logs/extract/val/shard-00000.log"
    assert jobs[9].status == "unfinished" and jobs[9].end is None


def test_report_of_a_run(workdir: Path):
    result = report.build_report(workdir, SNAKEMAKE_LOG, GPU_SAMPLES, PLAN)
    seconds = result["stage_seconds"]
    # the TSV's s where there is one, else the log's interval
    assert seconds["ingest"] == 3.81 and seconds["regenerate"] == 79.5
    assert seconds["prepare_target"] == 20.0 and seconds["extract val/shard-00000"] == 60.0
    assert "bench_engines" not in seconds
    rows = {row["job"]: row for row in result["jobs"]}
    assert (
        rows["regenerate"]["max_rss_mb"] == 9000 and rows["ingest"]["seconds_from"] == "benchmark"
    )

    assert result["bytes_written"] == {
        "results/corpus": 1500,
        "results/extract": 7100 + len((workdir / "results/extract/plan.json").read_bytes()),
        "resources/target": len(str(workdir / "results/corpus")),
    }
    train, val = result["extract_disk_plan"]
    assert (train["store"], train["planned_bytes"], train["written_bytes"]) == (
        "extract/train/shard-00000",
        8000,
        7100,
    )
    assert train["written_over_planned"] == pytest.approx(7100 / 8000, abs=1e-4)
    assert (train["backend"], train["verification_passed"]) == ("native", True)
    assert val["written_bytes"] is None and val["backend"] is None

    memory = result["gpu_memory"]
    assert memory["idle_mib"] == 0 and memory["peak_mib"] == 72_500
    engines = {row["engine"]: row for row in memory["engines"]}
    assert list(engines) == [
        "regenerate",
        "extract train/shard-00000",
        "extract val/shard-00000",
        "bench k=0",
        "bench k=3",
        "bench k=0 (margins)",
    ]
    assert engines["regenerate"]["peak_mib"] == 70_100
    # the samples of the next job's first seconds are the last job's, not its own
    assert engines["extract train/shard-00000"]["peak_mib"] == 69_000
    assert engines["extract val/shard-00000"]["peak_mib"] == 68_000
    assert engines["bench k=0"]["peak_mib"] == 71_000
    assert engines["bench k=3"]["peak_mib"] == 72_500
    assert engines["bench k=0 (margins)"]["peak_mib"] == 71_900
    assert engines["bench k=0 (margins)"]["planned_engine"] == "bench k=0"
    assert engines["extract train/shard-00000"]["planned_bytes"] == 70 << 30
    assert engines["extract train/shard-00000"]["peak_over_planned"] == pytest.approx(
        69_000 / (70 * 1024), abs=1e-4
    )
    assert engines["extract val/shard-00000"]["peak_over_planned"] is None


def test_the_plan_names_the_jobs_the_log_names():
    """Every GPU job of the overlay's run has its planned engine (the names must agree)."""
    plan = report.planned_engines([EXAMPLE, OVERLAY], REPO / "config/config.yaml", LLAMA, 80 << 30)
    jobs = {job for engine in plan for job in engine["jobs"]}
    assert jobs == {
        "regenerate",
        "extract train/shard-00000",
        "extract val/shard-00000",
        "bench k=0",
        "bench k=3",
    }
    assert all(engine["memory_bytes"] <= 0.9 * (80 << 30) for engine in plan)
    regenerate = next(engine for engine in plan if engine["name"] == "regenerate")
    # Llama-3.1-8B's 8.03B parameters in bf16
    assert regenerate["weight_bytes"] == pytest.approx(16.06e9, rel=0.01)


def test_the_overlay_keeps_the_examples_engine_settings():
    changes = report.config_changes([EXAMPLE], [EXAMPLE, OVERLAY], REPO / "config/config.yaml")
    changed = {change["key"] for change in changes}
    assert {
        "resources.train_gpus",
        "corpus.max_conversations",
        "extract.num_shards.train",
    } <= changed
    engine_keys = [
        "target.dtype",
        "engine.device",
        "engine.tensor_parallel_size",
        "tokenize.max_length",
        "corpus.regenerate.gpu_memory_utilization",
        "extract.gpu_memory_utilization",
        "extract.max_num_batched_tokens",
        "extract.max_num_seqs",
        "bench.gpu_memory_utilization",
        "bench.max_num_seqs",
        "bench.schedule",
    ]
    assert not changed & set(engine_keys)
