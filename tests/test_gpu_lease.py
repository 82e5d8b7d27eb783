"""GPU leases: distinct devices per concurrent job, released on exit, crash or exception.

The machine has no GPU; ``DRAFTFLOW_NUM_GPUS=8`` makes the lease manage 8 device ids, which is
all it does with them (it never touches CUDA), so the locking is tested for real.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from draftflow.workflow.gpu import count_gpus, gpu_lease

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).parent / "snakemake"


@pytest.fixture
def eight_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """8 simulated devices, no scheduler assignment; returns the lock directory."""
    monkeypatch.setenv("DRAFTFLOW_NUM_GPUS", "8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    lock_dir = tmp_path / "locks"
    monkeypatch.setenv("DRAFTFLOW_GPU_LOCK_DIR", str(lock_dir))
    return lock_dir


def test_count_gpus_reads_env(eight_gpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert count_gpus() == 8
    monkeypatch.setenv("DRAFTFLOW_NUM_GPUS", "eight")
    with pytest.raises(ValueError, match="eight"):
        count_gpus()


def test_lease_sets_and_restores_visible_devices(eight_gpus: Path) -> None:
    with gpu_lease(3) as devices:
        assert len(devices) == 3 and len(set(devices)) == 3
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(devices)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


HOLDER = textwrap.dedent(
    """
    import sys, time
    from draftflow.workflow.gpu import gpu_lease
    with gpu_lease(int(sys.argv[1]), lock_dir=sys.argv[2]) as devices:
        print(",".join(devices), flush=True)
        time.sleep(600)
    """
)


class Holder:
    """Another job: a process that holds a lease of ``count`` devices until it is killed."""

    def __init__(self, count: int, lock_dir: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(count), str(lock_dir)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.process.stdout is not None
        self.devices = self.process.stdout.readline().strip().split(",")

    def kill(self) -> None:
        if self.process.poll() is None:
            # SIGKILL: no finally block runs; only the kernel can drop the flocks.
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)


def test_concurrent_jobs_get_distinct_devices_and_wait_with_a_clear_error(
    eight_gpus: Path,
) -> None:
    other = Holder(5, eight_gpus)
    try:
        assert len(other.devices) == 5
        with gpu_lease(3, lock_dir=eight_gpus) as mine:
            assert set(mine).isdisjoint(other.devices)
            assert set(mine) | set(other.devices) == {str(index) for index in range(8)}
        with (
            pytest.raises(TimeoutError, match=r"no 4 free GPU.*holders: 0: pid \d+"),
            gpu_lease(4, lock_dir=eight_gpus, timeout_s=0.3, poll_s=0.1),
        ):
            pass
    finally:
        other.kill()


def test_a_nested_lease_reuses_the_jobs_devices(eight_gpus: Path) -> None:
    with gpu_lease(3) as outer:
        with gpu_lease(2, timeout_s=0.3) as inner:
            assert inner == outer  # its own job's locks must not make it wait
        with (
            pytest.raises(ValueError, match="enclosing draftflow lease gave this job 3"),
            gpu_lease(4),
        ):
            pass
    assert "DRAFTFLOW_GPU_LEASED" not in os.environ


def test_lease_released_when_the_job_raises(eight_gpus: Path) -> None:
    with pytest.raises(RuntimeError, match="job failed"), gpu_lease(8):
        raise RuntimeError("job failed")
    with gpu_lease(8, timeout_s=0.3, poll_s=0.1) as devices:
        assert len(devices) == 8


def test_zero_gpus_is_a_no_op(eight_gpus: Path) -> None:
    with gpu_lease(0) as devices:
        assert devices == []
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert not eight_gpus.exists()


def test_more_gpus_than_the_machine_has_is_an_error(eight_gpus: Path) -> None:
    with pytest.raises(ValueError, match=r"needs 9 GPU.*offers 8"), gpu_lease(9):
        pass


def test_visible_devices_narrow_the_pool(eight_gpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    with gpu_lease(2) as devices:
        assert sorted(devices) == ["2", "5"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,5"


def test_scheduler_assignment_is_kept(eight_gpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    with gpu_lease(2) as devices:
        assert devices == ["6", "7"]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert not eight_gpus.exists()  # no lock taken: SLURM owns the devices
    with pytest.raises(ValueError, match="SLURM job 42 gave this job 2 GPU"), gpu_lease(4):
        pass


def test_a_killed_job_releases_its_devices(eight_gpus: Path) -> None:
    holder = Holder(8, eight_gpus)
    try:
        assert len(holder.devices) == 8
        with pytest.raises(TimeoutError), gpu_lease(1, timeout_s=0.3, poll_s=0.1):
            pass
        holder.kill()
        with gpu_lease(8, timeout_s=10, poll_s=0.1) as devices:
            assert len(devices) == 8
    finally:
        holder.kill()


# A workflow of GPU jobs of 1-4 GPUs (20 GPUs in all) on a machine with 8.
JOB_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from draftflow.workflow.gpu import gpu_lease
    count, out, lock_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    with gpu_lease(count, lock_dir=lock_dir, poll_s=0.2) as devices:
        start = time.time()
        visible = os.environ["CUDA_VISIBLE_DEVICES"]
        time.sleep(2.0)
        end = time.time()
    with open(out, "w") as handle:
        json.dump({"devices": devices, "visible": visible, "start": start, "end": end,
                   "count": count}, handle)
    """
)

SNAKEFILE = textwrap.dedent(
    """
    import sys

    GPUS = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 1, "f": 2, "g": 3, "h": 4}


    rule all:
        input:
            expand("out/{job}.json", job=GPUS),


    rule gpu_job:
        output:
            "out/{job}.json",
        params:
            lock_dir=config["lock_dir"],
        resources:
            gpu=lambda wildcards: GPUS[wildcards.job],
        shell:
            "{sys.executable} job.py {resources.gpu} {output} {params.lock_dir}"
    """
)


def run_gpu_workflow(workdir: Path, lock_dir: Path, gpu_budget: int) -> list[dict]:
    workdir.mkdir()
    (workdir / "Snakefile").write_text(SNAKEFILE)
    (workdir / "job.py").write_text(JOB_SCRIPT)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update({"DRAFTFLOW_NUM_GPUS": "8", "PYTHONPATH": str(REPO)})
    result = subprocess.run(
        [
            *(str(SNAKEMAKE), "--cores", "8", "--resources", f"gpu={gpu_budget}"),
            *("--config", f"lock_dir={lock_dir}", "--quiet", "all"),
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(path.read_text()) for path in sorted((workdir / "out").glob("*.json"))]


def assert_no_shared_devices(jobs: list[dict]) -> None:
    assert len(jobs) == 8
    for job in jobs:
        assert len(set(job["devices"])) == job["count"]
        assert job["visible"] == ",".join(job["devices"])
    overlapping_pairs = 0
    for first, second in itertools.combinations(jobs, 2):
        if first["start"] < second["end"] and second["start"] < first["end"]:
            overlapping_pairs += 1
            assert set(first["devices"]).isdisjoint(second["devices"]), (first, second)
    # Otherwise the jobs ran one after another and the test would prove nothing.
    assert overlapping_pairs > 0


@pytest.mark.workflow
@pytest.mark.parametrize(
    "gpu_budget",
    [
        # Snakemake keeps the sum of running jobs' GPUs at 8; the lease picks which ones.
        8,
        # Snakemake starts all jobs at once (20 GPUs asked of 8): the lease must make them wait.
        64,
    ],
)
def test_snakemake_jobs_never_share_a_device(tmp_path: Path, gpu_budget: int) -> None:
    jobs = run_gpu_workflow(tmp_path / "wf", tmp_path / "locks", gpu_budget)
    assert_no_shared_devices(jobs)
