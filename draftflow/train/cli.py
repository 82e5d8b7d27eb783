"""Run a training job: in this process, or under torchrun for data parallelism over GPUs.

``python -m draftflow.train.cli JOB.json`` is what each torchrun worker runs; ``launch`` is what
the rule's script calls.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from draftflow.io import atomic_write_text
from draftflow.train.job import TrainJob
from draftflow.train.loop import train
from draftflow.workflow.cpu_threads import available_cores

log = logging.getLogger(__name__)


def launch(job: TrainJob, gpus: int) -> None:
    """One process (CPU or one GPU), or ``gpus`` torchrun workers that each run this module."""
    if gpus <= 1 or "LOCAL_RANK" in os.environ:
        train(job)
        return
    job_path = Path(job.checkpoint_dir) / "job.json"
    atomic_write_text(job_path, job.to_json())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        "-m",
        "draftflow.train.cli",
        str(job_path),
    ]
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        # torchrun would set 1: too few to pack each step's batch (hundreds of MB of hidden
        # states) in time: one thread per rank starved the GPUs of batches.
        cpus = available_cores()
        env["OMP_NUM_THREADS"] = str(job.settings.threads or max(1, cpus // gpus))
    log.info("launching %s", " ".join(command))
    # Workers inherit stderr, so their logs land in the rule's log file.
    subprocess.run(command, check=True, env=env, stderr=sys.stderr, stdout=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("job", help="a TrainJob as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    train(TrainJob.from_json(args.job))


if __name__ == "__main__":
    main()
