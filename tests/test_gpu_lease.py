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


def test_concurrent_leases_get_distinct_devices_and_wait_with_a_clear_error(
    eight_gpus: Path,
) -> None:
    with gpu_lease(5, lock_dir=eight_gpus) as first, gpu_lease(3, lock_dir=eight_gpus) as second:
        assert set(first).isdisjoint(second)
        assert set(first) | set(second) == {str(index) for index in range(8)}
        with (
            pytest.raises(TimeoutError, match=r"no 1 free GPU.*holders: 0: pid"),
            gpu_lease(1, lock_dir=eight_gpus, timeout_s=0.3, poll_s=0.1),
        ):
            pass
    # Both released: the whole machine can be leased again.
    with gpu_lease(8, lock_dir=eight_gpus) as everything:
        assert len(everything) == 8


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
    with pytest.raises(ValueError, match="needs 9 GPU.*offers 8"), gpu_lease(9):
        pass


def test_visible_devices_narrow_the_pool(
    eight_gpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    with pytest.raises(ValueError, match="gave job 42 2 GPU"), gpu_lease(4):
        pass


HOLDER = textwrap.dedent(
    """
    import sys, time
    from draftflow.workflow.gpu import gpu_lease
    with gpu_lease(int(sys.argv[1]), lock_dir=sys.argv[2]) as devices:
        print(",".join(devices), flush=True)
        time.sleep(600)
    """
)


def test_a_killed_job_releases_its_devices(eight_gpus: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "8", str(eight_gpus)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None
        assert len(holder.stdout.readline().strip().split(",")) == 8
        with pytest.raises(TimeoutError), gpu_lease(1, timeout_s=0.3, poll_s=0.1):
            pass
        # SIGKILL: no finally block runs; only the kernel can drop the flocks.
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with gpu_lease(8, timeout_s=10, poll_s=0.1) as devices:
            assert len(devices) == 8
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


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
        [str(SNAKEMAKE), "--cores", "8", "--resources", f"gpu={gpu_budget}"]
        + ["--config", f"lock_dir={lock_dir}", "--quiet", "all"],
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
