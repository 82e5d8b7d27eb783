"""Kill -9 a stage's job at random moments, rerun it through Snakemake, compare with a clean run.

For each stage (regenerate, extract, train, bench): one uninterrupted forced rerun (does the
stage give the same bytes twice?), then ``--kills`` runs killed with SIGKILL (the whole process
group: Snakemake, the job and its engine) at a moment drawn uniformly over the stage's duration
in the reference run, each followed by ``snakemake --unlock`` and a plain rerun. Every rerun's
outputs are compared with the reference: identical bytes, within the stage's tolerance (the
capture's verification cosine; train's metrics; bench's structure, since its timings differ by
nature), or lost (the rerun failed or its outputs differ beyond the tolerance).

    python perf/kill_matrix.py --tiny .test-cache/smollm2 --workdir /tmp/kills --out km.json
    python perf/kill_matrix.py --workdir DIR_OF_A_FINISHED_RUN --stages extract train

``--tiny TARGET`` builds the test suite's tiny workflow (tests/configs/tiny.yaml, with
regeneration on and a train checkpoint every 10 steps) in ``--workdir`` and runs it once as the
reference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


@dataclass(frozen=True)
class Stage:
    rule: str
    outputs: tuple[str, ...]
    log: str
    benchmark: str
    # JSONL outputs whose records carry wall-clock fields: compared without them.
    timed: tuple[str, ...] = ()


# Wall-clock fields: the only ones two runs of a deterministic stage may differ in.
TIMING_KEYS = {"tokens_per_s"}


STAGES = {
    "regenerate": Stage(
        "regenerate",
        ("results/corpus/regenerated.jsonl",),
        "logs/regenerate.log",
        "benchmarks/regenerate.tsv",
    ),
    "extract": Stage(
        "extract",
        ("results/extract/train/shard-00000",),
        "logs/extract/train/shard-00000.log",
        "benchmarks/extract/train/shard-00000.tsv",
    ),
    "train": Stage(
        "train",
        ("results/train/draft", "results/train/metrics.jsonl"),
        "logs/train.log",
        "benchmarks/train.tsv",
        timed=("results/train/metrics.jsonl",),
    ),
    "bench": Stage(
        "bench_engines",
        ("results/bench/engines/k*.json",),
        "logs/bench/engines.log",
        "benchmarks/bench/engines.tsv",
    ),
}


def expanded(stage: Stage, reference: Path) -> Stage:
    """The stage with its output patterns (``k*.json``) expanded in the reference run."""
    outputs = tuple(
        str(path.relative_to(reference))
        for pattern in stage.outputs
        for path in (sorted(reference.glob(pattern)) if "*" in pattern else [reference / pattern])
    )
    return Stage(stage.rule, outputs, stage.log, stage.benchmark, stage.timed)


def snakemake(workdir: Path, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    from workflow_support import snakemake_command, snakemake_env

    return subprocess.run(
        [*snakemake_command(), "--cores", "2", *args],
        cwd=workdir,
        env=snakemake_env(workdir),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def digests(workdir: Path, stage: Stage) -> dict[str, str]:
    """sha256 of every file of the stage's outputs (Snakemake's own markers left out); timed
    JSONL files hashed without their wall-clock fields."""
    found = {}
    for output in stage.outputs:
        root = workdir / output
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            name = str(path.relative_to(workdir))
            if path.name == ".snakemake_timestamp":
                continue
            data = path.read_bytes()
            if name in stage.timed:
                data = json.dumps(_untimed_records(path), sort_keys=True).encode()
            found[name] = hashlib.sha256(data).hexdigest()
    return found


def within_tolerance(name: str, reference: Path, rerun: Path) -> bool:
    """The stage's documented tolerance, for outputs whose bytes differ."""
    if name == "extract":
        from draftflow.capture.store import CaptureReader

        out = STAGES["extract"].outputs[0]
        a, b = CaptureReader(reference / out), CaptureReader(rerun / out)
        if len(a) != len(b):
            return False
        for i in range(len(a)):
            x, y = a.get(i), b.get(i)
            if not (x["input_ids"] == y["input_ids"]).all():
                return False
            cosine = _cosine(a.hidden_states(i), b.hidden_states(i))
            if cosine.mean() < 0.995 or cosine.min() < 0.95:  # the extract job's verification
                return False
        return True
    if name == "train":
        untimed = [_untimed_records(d / "results/train/metrics.jsonl") for d in (reference, rerun)]
        return untimed[0] == untimed[1]
    if name == "regenerate":
        ids = [
            _conversation_ids(d / "results/corpus/regenerated.jsonl") for d in (reference, rerun)
        ]
        return ids[0] == ids[1]
    if name == "bench":
        shapes = [_bench_shape(d / "results/bench/engines") for d in (reference, rerun)]
        return shapes[0] == shapes[1]
    return False


def _cosine(a, b):
    import torch

    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def _untimed_records(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def _conversation_ids(path: Path) -> list[str]:
    return [json.loads(line).get("id") for line in path.read_text().splitlines() if line.strip()]


def _bench_shape(directory: Path) -> list[tuple[str, list[str]]]:
    return [
        (path.name, sorted(json.loads(path.read_text())))
        for path in sorted(directory.glob("*.json"))
    ]


def stage_seconds(workdir: Path, stage: Stage) -> float:
    """The stage's wall time in the reference run (its benchmark file), else its log's span."""
    tsv = workdir / stage.benchmark if stage.benchmark else None
    if tsv is not None and tsv.is_file():
        header, values = tsv.read_text().splitlines()[:2]
        return float(dict(zip(header.split("\t"), values.split("\t"), strict=False))["s"])
    return 60.0


def killed_run(workdir: Path, stage: Stage, delay: float) -> str:
    """Force the stage, SIGKILL the whole process group ``delay`` s after its job started."""
    from workflow_support import snakemake_command, snakemake_env

    log = workdir / stage.log
    started_before = log.stat().st_mtime if log.exists() else 0.0
    process = subprocess.Popen(
        [*snakemake_command(), "--cores", "2", "--forcerun", stage.rule, *stage.outputs],
        cwd=workdir,
        env=snakemake_env(workdir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # The job has started once its log is rewritten.
    while process.poll() is None:
        if log.exists() and log.stat().st_mtime > started_before:
            break
        time.sleep(0.05)
    deadline = time.monotonic() + delay
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if process.poll() is not None:
        return "finished before the kill"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return "killed"


def clone(source: Path, dest: Path) -> Path:
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    subprocess.run(["cp", "-a", str(source), str(dest)], check=True)
    return dest


def compare(name: str, reference: Path, rerun: Path) -> str:
    stage = expanded(STAGES[name], reference)
    if not all((rerun / output).exists() for output in stage.outputs):
        return "lost"
    if digests(reference, stage) == digests(rerun, stage):
        return "identical"
    return "within tolerance" if within_tolerance(name, reference, rerun) else "lost"


def run_stage(name: str, reference: Path, scratch: Path, kills: int, rng: random.Random) -> dict:
    stage = expanded(STAGES[name], reference)
    seconds = stage_seconds(reference, stage)
    row: dict = {"stage": name, "reference_seconds": seconds, "kills": []}
    clean = clone(reference, scratch / f"{name}-clean")
    forced = snakemake(clean, "--forcerun", stage.rule, *stage.outputs)
    row["uninterrupted_rerun"] = (
        compare(name, reference, clean) if forced.returncode == 0 else "lost"
    )
    for attempt in range(kills):
        work = clone(reference, scratch / f"{name}-kill{attempt}")
        delay = rng.uniform(0.05, 0.95) * seconds
        what = killed_run(work, stage, delay)
        # A SIGKILLed Snakemake leaves its lock: the recovery a user needs.
        unlock = snakemake(work, "--unlock")
        rerun = snakemake(work, *stage.outputs)
        outcome = (
            compare(name, reference, work)
            if unlock.returncode == 0 and rerun.returncode == 0
            else "lost"
        )
        row["kills"].append(
            {"delay_s": round(delay, 2), "kill": what, "outcome": outcome, "dir": str(work)}
        )
        print(name, attempt, f"{delay:.1f} s", what, outcome, flush=True)
    return row


def prepare_tiny(workdir: Path, target: Path) -> None:
    from workflow_support import prepare_tiny_workdir, read_config, write_config

    prepare_tiny_workdir(workdir, target)
    config = read_config(workdir)
    config["corpus"]["regenerate"] = {
        **config["corpus"].get("regenerate", {}),
        "enabled": True,
        "max_tokens": 48,
        "kv_cache_memory_bytes": 33554432,
    }
    # Checkpoints before the last step, so that a kill lands after one and the resumed job must
    # rebuild metrics.jsonl from the history beside them (tiny.yaml checkpoints only at the end).
    config["train"]["checkpoint_every"] = 10
    write_config(workdir, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--tiny", type=Path, help="a prepared target: build the tiny workflow")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--recompare", type=Path, help="an earlier --out: judge its runs' directories again"
    )
    args = parser.parse_args()
    if args.recompare is not None:
        write_result(args, recompare(json.loads(args.recompare.read_text()), args.workdir))
        return
    reference = args.workdir / "reference"
    if args.tiny is not None and not reference.exists():
        prepare_tiny(reference, args.tiny.resolve())
    # Only as far as the stages asked for (a pattern such as bench's needs the whole run).
    targets = [o for n in args.stages for o in STAGES[n].outputs]
    done = snakemake(reference, *([] if any("*" in t for t in targets) else targets))
    if done.returncode != 0:
        sys.exit(f"the reference run failed:\n{done.stderr[-3000:]}")
    rng = random.Random(args.seed)
    rows = [run_stage(n, reference, args.workdir, args.kills, rng) for n in args.stages]
    if args.out.exists():  # an earlier matrix's other stages are kept
        earlier = json.loads(args.out.read_text())["stages"]
        rows = [r for r in earlier if r["stage"] not in args.stages] + rows
    write_result(args, rows)


def recompare(previous: dict, workdir: Path) -> list[dict]:
    """The outcomes of an earlier matrix judged again from the directories it left."""
    reference = workdir / "reference"
    rows = previous["stages"]
    for row in rows:
        name = row["stage"]
        row.setdefault("clean_dir", str(workdir / f"{name}-clean"))
        if row.get("uninterrupted_rerun") != "lost":
            row["uninterrupted_rerun"] = compare(name, reference, Path(row["clean_dir"]))
        for attempt, kill in enumerate(row["kills"]):
            kill.setdefault("dir", str(workdir / f"{name}-kill{attempt}"))
            if kill["outcome"] != "lost":
                kill["outcome"] = compare(name, reference, Path(kill["dir"]))
    return rows


def write_result(args: argparse.Namespace, rows: list[dict]) -> None:
    outcomes = [k["outcome"] for row in rows for k in row["kills"] if k["kill"] == "killed"]
    result = {
        "command": " ".join(sys.argv),
        "stages": rows,
        "counts": {
            "kills": len(outcomes),
            "identical": outcomes.count("identical"),
            "within_tolerance": outcomes.count("within tolerance"),
            "lost": outcomes.count("lost"),
        },
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["counts"]))


if __name__ == "__main__":
    main()
