"""Stage times, bytes written and peak GPU memory per engine of a workflow run, against its plans.

tools/gpu_example_llama.sh runs the workflow on one GPU while ``nvidia-smi`` samples the
device's used memory every 500 ms, then calls this on the run's working directory:

- stage times: each job's wall seconds from its Snakemake ``benchmark:`` TSV (column ``s``), with
  its start and end from Snakemake's own log (``[date]`` lines before each job's block and
  before its ``Finished jobid`` or ``Error in rule`` line); a job without a TSV (failed, or
  stopped by the time limit) gets its seconds from the log;
- bytes written: the apparent size of every folder under ``results/`` (links not followed), and
  each capture store against the disk plan (``results/extract/plan.json``, rule plan_extract);
- peak GPU memory per engine: every job that takes the GPU (``resources: gpu``) holds it alone
  (``--resources gpu=1``), so each sample inside a job's interval is that job's. The bench job
  starts its engines one after the other (``bench.schedule: one_at_a_time``): its log's
  ``starting engine k=K`` and ``stopped engine k=K`` lines split its interval per engine. Samples
  in the first ``GRACE_S`` seconds of an interval are left out: the log's times are whole
  seconds, so the previous job's memory may still show there, and no job reaches the GPU that
  early (its imports alone take longer). An extract job's interval holds its capture engine and
  then its transformers check (``extract.verify``), which starts after the engine is shut down;
- the plan: ``draftflow.plan.engines.plan_engines`` (what ``python -m draftflow.plan`` prints)
  for the run's config files and the target's config.json, on the measured device's memory;
  each measured engine is matched to the planned engine whose jobs name it.

    python tools/gpu_example_report.py --workdir W --configfile A.yaml B.yaml \\
        --target-config config.json --gpu-samples gpu-memory.csv --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
GIB = 1 << 30
# Rules whose jobs take the GPU (rules/*.smk: resources gpu).
GPU_RULES = ("regenerate", "extract", "train", "bench_engines")
GRACE_S = 2.0

_SNAKEMAKE_TIME = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_JOB_START = re.compile(r"^(?:local)?rule (\S+):$")
_JOB_FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\S+)\)$")
_JOB_ERROR = re.compile(r"^Error in rule (\S+):$")
_JOB_KEY = re.compile(r"^    (\w+): (.*)$")
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ \S+: (.*)$")
_ENGINE_START = re.compile(r"^starting engine k=(\d+)$")
_ENGINE_STOP = re.compile(r"^stopped engine k=(\d+)$")
_MARGINS = "measuring the plain target's margin"


@dataclass
class Job:
    """One job of the run, as Snakemake's log tells it."""

    jobid: int
    rule: str
    start: datetime
    wildcards: dict[str, str]
    benchmark: str | None = None
    log: str | None = None
    end: datetime | None = None
    # finished, failed, or unfinished (running when the run stopped)
    status: str = "unfinished"

    @property
    def name(self) -> str:
        """The job as the engine plan names it: ``extract train/shard-00000``, else the rule."""
        if self.rule == "extract":
            return f"extract {self.wildcards['split']}/{self.wildcards['shard']}"
        if self.wildcards:
            return f"{self.rule} " + "/".join(self.wildcards.values())
        return self.rule


@dataclass(frozen=True)
class Window:
    """Where one engine (or other GPU work) held the GPU."""

    name: str
    job: str
    start: datetime
    end: datetime | None


def parse_wildcards(text: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in text.split(", ") if "=" in item)
    return {key: value for key, value in pairs}


def parse_snakemake_log(text: str) -> list[Job]:
    """Every job the log starts, with its end and status where the log has them."""
    jobs: dict[int, Job] = {}
    now: datetime | None = None
    block: dict[str, str] | None = None
    block_rule = ""
    block_start: datetime | None = None
    failed_rule: str | None = None

    def close_block() -> None:
        nonlocal block
        if block is not None and "jobid" in block and block_start is not None:
            jobid = int(block["jobid"])
            jobs[jobid] = Job(
                jobid=jobid,
                rule=block_rule,
                start=block_start,
                wildcards=parse_wildcards(block.get("wildcards", "")),
                benchmark=block.get("benchmark"),
                log=block.get("log", "").split(" (")[0] or None,
            )
        block = None

    for line in text.splitlines():
        stamp = _SNAKEMAKE_TIME.match(line)
        if stamp:
            close_block()
            now = datetime.strptime(stamp.group(1), "%a %b %d %H:%M:%S %Y")
            continue
        start = _JOB_START.match(line)
        if start and now is not None:
            close_block()
            block, block_rule, block_start = {}, start.group(1), now
            continue
        key = _JOB_KEY.match(line)
        if key and block is not None:
            block.setdefault(key.group(1), key.group(2))
            continue
        if key and failed_rule is not None and key.group(1) == "jobid":
            job = jobs.get(int(key.group(2)))
            if job is not None:
                job.end, job.status = now, "failed"
            failed_rule = None
            continue
        close_block()
        finished = _JOB_FINISHED.match(line)
        if finished and int(finished.group(1)) in jobs:
            job = jobs[int(finished.group(1))]
            job.end, job.status = now, "finished"
            continue
        error = _JOB_ERROR.match(line)
        failed_rule = error.group(1) if error else failed_rule
    close_block()
    return sorted(jobs.values(), key=lambda job: (job.start, job.jobid))


def read_benchmark(path: Path) -> dict[str, float]:
    """The numeric columns of a Snakemake benchmark TSV's first row (s, max_rss, io_out, ...)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if len(lines) < 2:
        return {}
    row = {}
    for key, value in zip(lines[0].split("\t"), lines[1].split("\t"), strict=False):
        try:
            row[key] = float(value)
        except ValueError:
            continue
    return row


def parse_gpu_samples(text: str) -> list[tuple[datetime, int]]:
    """``nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits`` lines as
    (time, MiB); lines of one GPU only (the first index seen where several are listed)."""
    samples = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            when = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            samples.append((when, int(float(parts[1]))))
        except ValueError:
            continue
    return samples


def bench_windows(log_text: str, job: Job) -> list[Window]:
    """The bench job's engines, one after the other, from its log's start and stop lines."""
    windows: list[Window] = []
    open_engines: dict[int, tuple[str, datetime]] = {}
    margins = False
    for line in log_text.splitlines():
        match = _LOG_LINE.match(line)
        if not match:
            continue
        when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S") + timedelta(
            milliseconds=int(match.group(2))
        )
        message = match.group(3)
        if message.startswith(_MARGINS):
            margins = True
        started = _ENGINE_START.match(message)
        if started:
            k = int(started.group(1))
            name = f"bench k={k}" + (" (margins)" if margins else "")
            open_engines[k] = (name, when)
            continue
        stopped = _ENGINE_STOP.match(message)
        if stopped and int(stopped.group(1)) in open_engines:
            name, began = open_engines.pop(int(stopped.group(1)))
            windows.append(Window(name, job.name, began, when))
    for name, began in open_engines.values():
        windows.append(Window(name, job.name, began, job.end))
    return sorted(windows, key=lambda window: window.start)


def gpu_windows(jobs: Sequence[Job], workdir: Path) -> list[Window]:
    """Where each engine held the GPU: the GPU jobs, the bench job split per engine."""
    windows = []
    for job in jobs:
        if job.rule not in GPU_RULES:
            continue
        log_path = workdir / job.log if job.log else None
        if job.rule == "bench_engines" and log_path is not None and log_path.is_file():
            split = bench_windows(log_path.read_text(encoding="utf-8", errors="replace"), job)
            if split:
                windows.extend(split)
                continue
        windows.append(Window(job.name, job.name, job.start, job.end))
    return windows


def peak_mib(samples: Sequence[tuple[datetime, int]], window: Window) -> int | None:
    """The largest sample inside ``window`` (past its first GRACE_S seconds); None if none."""
    begin = window.start + timedelta(seconds=GRACE_S)
    inside = [
        mib for when, mib in samples if when >= begin and (window.end is None or when <= window.end)
    ]
    return max(inside) if inside else None


def tree_bytes(path: Path) -> int:
    """Apparent bytes of the files under ``path`` (links counted as links, not followed)."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        total += sum((Path(root) / name).lstat().st_size for name in files)
    return total


def bytes_written(workdir: Path) -> dict[str, int]:
    """Bytes of each folder under results/ (and of resources/target, links to the target)."""
    sizes = {}
    results = workdir / "results"
    if results.is_dir():
        for path in sorted(results.iterdir()):
            sizes[f"results/{path.name}"] = tree_bytes(path)
    target = workdir / "resources" / "target"
    if target.exists():
        sizes["resources/target"] = tree_bytes(target)
    return sizes


def disk_plan_check(workdir: Path) -> list[dict[str, Any]]:
    """Each capture store's planned bytes (results/extract/plan.json) against its bytes, with
    the backend that wrote it and its check's verdict (the store's manifest)."""
    plan_path = workdir / "results" / "extract" / "plan.json"
    if not plan_path.is_file():
        return []
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    rows = []
    for shard in plan["shards"]:
        output = Path(shard["output"])
        store = output if output.is_absolute() else workdir / output
        written = tree_bytes(store) if store.exists() else None
        manifest_path = store / "manifest.json"
        manifest = (
            json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else {}
        )
        rows.append(
            {
                "store": str(Path(shard["output"]).relative_to(Path(shard["output"]).parents[2])),
                "samples": shard["num_samples"],
                "tokens": shard["num_tokens"],
                "planned_bytes": shard["total_bytes"],
                "written_bytes": written,
                "written_over_planned": round(written / shard["total_bytes"], 4)
                if written is not None and shard["total_bytes"]
                else None,
                "backend": manifest.get("backend"),
                "verification_passed": manifest.get("verification", {}).get("passed"),
            }
        )
    return rows


def planned_engines(
    configfiles: Sequence[Path], base: Path, target_config: Path, device_bytes: int
) -> list[dict[str, Any]]:
    """The engine plan of the run's config (draftflow.plan.engines), engine by engine."""
    from draftflow.config import load_config
    from draftflow.plan.engines import plan_engines
    from draftflow.plan.target_shape import read_target_shape

    plan = plan_engines(
        load_config(*configfiles, base=base), read_target_shape(target_config), device_bytes
    )
    return [
        {
            "name": engine.name,
            "jobs": list(engine.jobs),
            "weight_bytes": engine.weight_bytes_per_device,
            "kv_cache_bytes": engine.kv_cache_bytes,
            "overhead_bytes": engine.overhead_bytes,
            "memory_bytes": engine.memory_bytes_per_device,
        }
        for engine in plan.engines
    ]


def engine_memory(
    windows: Sequence[Window],
    samples: Sequence[tuple[datetime, int]],
    plan: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Each window's peak (MiB as nvidia-smi counts, and bytes) beside its planned engine's."""
    rows = []
    for window in windows:
        peak = peak_mib(samples, window)
        job_name = window.name.removesuffix(" (margins)")
        planned = next((engine for engine in plan if job_name in engine["jobs"]), None)
        planned_bytes = planned["memory_bytes"] if planned else None
        rows.append(
            {
                "engine": window.name,
                "job": window.job,
                "start": window.start.isoformat(timespec="seconds"),
                "end": window.end.isoformat(timespec="seconds") if window.end else None,
                "peak_mib": peak,
                "peak_bytes": peak * MIB if peak is not None else None,
                "peak_gib": round(peak / 1024, 1) if peak is not None else None,
                "planned_engine": planned["name"] if planned else None,
                "planned_bytes": planned_bytes,
                "planned_gib": round(planned_bytes / 2**30, 1) if planned_bytes else None,
                "peak_over_planned": round(peak * MIB / planned_bytes, 4)
                if peak is not None and planned_bytes
                else None,
            }
        )
    return rows


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(
    example: Sequence[Path], run: Sequence[Path], base: Path
) -> list[dict[str, Any]]:
    """Every setting the run's config files change from the example's (defaults filled)."""
    from draftflow.config import load_config

    before = flatten(load_config(*example, base=base))
    after = flatten(load_config(*run, base=base))
    return [
        {"key": key, "example": before.get(key), "run": after.get(key)}
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key)
    ]


def job_rows(jobs: Iterable[Job], workdir: Path) -> list[dict[str, Any]]:
    rows = []
    for job in jobs:
        if job.rule == "all":
            continue
        measured = (
            read_benchmark(workdir / job.benchmark)
            if job.benchmark and (workdir / job.benchmark).is_file()
            else {}
        )
        from_log = (job.end - job.start).total_seconds() if job.end else None
        rows.append(
            {
                "job": job.name,
                "status": job.status,
                "start": job.start.isoformat(timespec="seconds"),
                "end": job.end.isoformat(timespec="seconds") if job.end else None,
                "seconds": measured.get("s", from_log),
                "seconds_from": "benchmark" if "s" in measured else "snakemake log",
                "max_rss_mb": measured.get("max_rss"),
                "io_out_mb": measured.get("io_out"),
            }
        )
    return rows


def build_report(
    workdir: Path,
    snakemake_log: str,
    gpu_samples: str,
    plan: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """Jobs, bytes and engine memory of the run in ``workdir`` (no plan computed here)."""
    jobs = parse_snakemake_log(snakemake_log)
    rows = job_rows(jobs, workdir)
    samples = parse_gpu_samples(gpu_samples)
    windows = gpu_windows(jobs, workdir)
    first_gpu = min((window.start for window in windows), default=None)
    before = [mib for when, mib in samples if first_gpu is None or when < first_gpu]
    return {
        "jobs": rows,
        "stage_seconds": {row["job"]: row["seconds"] for row in rows if row["seconds"] is not None},
        "bytes_written": bytes_written(workdir),
        "extract_disk_plan": disk_plan_check(workdir),
        "gpu_memory": {
            "samples": len(samples),
            "idle_mib": min(before) if before else None,
            "peak_mib": max((mib for _, mib in samples), default=None),
            "engines": engine_memory(windows, samples, plan),
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--example", type=Path, nargs="+", required=True)
    parser.add_argument("--configfile", type=Path, nargs="+", required=True)
    parser.add_argument("--target-config", type=Path, required=True)
    parser.add_argument("--snakemake-log", type=Path, required=True)
    parser.add_argument("--gpu-samples", type=Path, required=True)
    parser.add_argument("--device-memory-mib", type=float, required=True)
    parser.add_argument("--facts", type=Path, help="a JSON object of the run, merged in first")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    base = workdir / "config" / "config.yaml"
    example = [path.resolve() for path in args.example]
    configfiles = [path.resolve() for path in args.configfile]
    target_config = args.target_config.resolve()
    # the config's relative paths (target.path) are the working directory's
    os.chdir(workdir)
    sys.path.insert(0, str(workdir))
    device_bytes = int(args.device_memory_mib * MIB)
    plan = planned_engines(configfiles, base, target_config, device_bytes)
    facts = json.loads(args.facts.read_text(encoding="utf-8")) if args.facts else {}
    report = {
        **facts,
        "config_changes": config_changes(example, configfiles, base),
        **build_report(
            workdir,
            args.snakemake_log.read_text(encoding="utf-8", errors="replace"),
            args.gpu_samples.read_text(encoding="utf-8", errors="replace")
            if args.gpu_samples.is_file()
            else "",
            plan,
        ),
        "engine_plan": {"device_memory_bytes": device_bytes, "engines": plan},
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
