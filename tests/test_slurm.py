"""The SLURM profile on a real one-node SLURM cluster (.ci/slurm/up.sh).

Jobs go through the real ``snakemake-executor-plugin-slurm`` and ``sbatch``; the tests read
SLURM's own records (the job completion log and ``scontrol show job``) to prove it, and check
that the outputs equal those of a local run: a small synthetic workflow with GPU jobs, and
draftflow itself on tests/configs/tiny.yaml up to the first extract job. Without root or the SLURM packages the tests skip
locally; in CI (``CI=true``), where .ci/slurm/install.sh has run, they fail instead.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from workflow_support import REPO, SNAKEMAKE, prepare_tiny_workdir, run_snakemake, snakemake_env

CI_SLURM = REPO / ".ci" / "slurm"
STATE = Path(os.environ.get("DRAFTFLOW_SLURM_STATE", "/tmp/draftflow-slurm"))
JOBCOMP_LOG = STATE / "jobcomp.log"

pytestmark = [pytest.mark.slurm, pytest.mark.workflow]


def _unavailable() -> str | None:
    """Why a test cluster cannot run here, or None when it can."""
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "snakemake-executor-plugin-slurm is not installed"
    missing = [tool for tool in ("slurmctld", "slurmd", "munged", "sbatch") if not _which(tool)]
    if missing:
        return f"SLURM is not installed (missing {', '.join(missing)}; run .ci/slurm/install.sh)"
    if os.geteuid() != 0:
        return "starting a SLURM cluster needs root"
    return None


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/bin")


def _cluster_answers() -> bool:
    result = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, check=False
    )
    return result.returncode == 0 and "localhost" in result.stdout


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[Path]:
    """A running one-node cluster; started (and stopped afterwards) unless one already runs."""
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must test the SLURM profile, but {reason}")
        pytest.skip(reason)
    started_here = not _cluster_answers()
    if started_here:
        subprocess.run([str(CI_SLURM / "up.sh")], check=True, timeout=120)
    try:
        yield STATE
    finally:
        if started_here:
            subprocess.run([str(CI_SLURM / "down.sh")], check=False, timeout=120)


# Two GPU jobs and a CPU job that gathers them. The GPU rule is named `extract` so that the
# profile's per-rule settings (GPU partition) apply; it leases its device the way every draftflow
# GPU rule does, which under SLURM must keep the scheduler's assignment.
SNAKEFILE = textwrap.dedent(
    """
    import sys

    localrules:
        all,


    rule all:
        input:
            "out/total.txt",


    rule extract:
        output:
            value="out/square_{n}.txt",
            devices="devices/square_{n}.txt",
        resources:
            gpu=1,
            mem_mb=500,
        shell:
            "{sys.executable} square.py {wildcards.n} {output.value} {output.devices}"


    rule gather:
        input:
            expand("out/square_{n}.txt", n=[3, 4]),
        output:
            "out/total.txt",
        resources:
            mem_mb=500,
        shell:
            "awk '{{total += $1}} END {{print total}}' {input} > {output}"
    """
)

SQUARE = textwrap.dedent(
    """
    import os, sys
    from draftflow.workflow.gpu import gpu_lease

    n, value_path, devices_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    with gpu_lease(1) as devices:
        with open(devices_path, "w") as handle:
            handle.write(f"{os.environ.get('SLURM_JOB_ID', '')} {','.join(devices)}\\n")
    with open(value_path, "w") as handle:
        handle.write(f"{n * n}\\n")
    """
)


def _write_workflow(workdir: Path) -> None:
    workdir.mkdir()
    (workdir / "Snakefile").write_text(SNAKEFILE)
    (workdir / "square.py").write_text(SQUARE)


def _env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    # A local run must lease from simulated devices; under SLURM the scheduler's choice wins.
    env.update({"PYTHONPATH": str(REPO), "DRAFTFLOW_NUM_GPUS": "8"})
    return env


def _jobcomp_lines() -> list[str]:
    return JOBCOMP_LOG.read_text().splitlines() if JOBCOMP_LOG.exists() else []


def _records_of(workdir: Path, known_records: int) -> list[str]:
    """Job completion records written since ``known_records`` by jobs run in ``workdir``.

    The cluster may serve other test sessions at the same time; their jobs have other WorkDirs.
    """
    return [
        record
        for record in _jobcomp_lines()[known_records:]
        if re.search(rf"WorkDir={re.escape(str(workdir))}(\s|$)", record)
    ]


def _rule_of(job_id: str) -> str:
    """The rule of a SLURM job, from the comment the executor plugin sets (rule_<name>...)."""
    details = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    comment = re.search(r"Comment=rule_(\S+)", details).group(1)
    return comment.split("_wildcards_")[0]


def test_slurm_profile_runs_jobs_through_sbatch(slurm_cluster: Path, tmp_path: Path) -> None:
    known_records = len(_jobcomp_lines())

    slurm_dir = tmp_path / "slurm"
    _write_workflow(slurm_dir)
    result = subprocess.run(
        [
            *(str(SNAKEMAKE), "--profile", str(REPO / "profiles" / "slurm")),
            # The test cluster has no accounting database, so no sacct: squeue (MinJobAge=3600).
            *("--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "2"),
        ],
        cwd=slurm_dir,
        env={**_env(), "DRAFTFLOW_GPU_LOCK_DIR": str(tmp_path / "slurm-locks")},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    # SLURM's own records: every rule but the local `all` finished as a SLURM job.
    new_records = _records_of(slurm_dir, known_records)
    assert len(new_records) == 3, new_records
    assert all("JobState=COMPLETED" in record for record in new_records), new_records
    job_ids = [re.search(r"JobId=(\d+)", record).group(1) for record in new_records]
    details = {
        job_id: subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
        ).stdout
        for job_id in job_ids
    }
    rules = sorted(
        re.search(r"Comment=rule_(extract|gather)", text).group(1) for text in details.values()
    )
    assert rules == ["extract", "extract", "gather"], details
    for text in details.values():
        gpu_job = "Comment=rule_extract" in text
        # The profile's partitions, and --gpus=1 from the rule's gpu resource.
        assert f"Partition={'gpu' if gpu_job else 'cpu'}" in text, text
        assert ("gres/gpu=1" in text or "gres:gpu:1" in text) == gpu_job, text

    # Inside SLURM the lease kept the scheduler's device (no lock taken by draftflow).
    for devices_file in (slurm_dir / "devices").glob("*.txt"):
        slurm_job_id, devices = devices_file.read_text().split()
        assert slurm_job_id in job_ids
        assert len(devices.split(",")) == 1
    assert not (tmp_path / "slurm-locks").exists()

    # The same workflow run locally gives the same outputs.
    local_dir = tmp_path / "local"
    _write_workflow(local_dir)
    local = subprocess.run(
        [str(SNAKEMAKE), "--cores", "2"],
        cwd=local_dir,
        env={**_env(), "DRAFTFLOW_GPU_LOCK_DIR": str(tmp_path / "local-locks")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert local.returncode == 0, local.stderr[-4000:]
    outputs = sorted(path.name for path in (local_dir / "out").iterdir())
    assert outputs == ["square_3.txt", "square_4.txt", "total.txt"]
    for name in outputs:
        assert (slurm_dir / "out" / name).read_text() == (local_dir / "out" / name).read_text()
    assert (local_dir / "out" / "total.txt").read_text() == "25\n"


# draftflow on the tiny config up to the capture of the one train shard: ingest, tokenize,
# split, shard and one extract job (vLLM) on the cluster.
DRAFTFLOW_TARGET = "results/extract/train/shard-00000"
DRAFTFLOW_JOBS = ["extract", "ingest", "shard", "split", "tokenize"]


def _assert_same_capture(local: Path, cluster: Path) -> None:
    """Two capture stores of one shard: the same samples, tokens and masks, and hidden states
    equal up to the CPU kernels' run-to-run rounding (vLLM's CPU capture is not bit-exact
    between runs: about one bf16 value in eight differs in its last bits)."""
    import torch
    from safetensors.torch import load_file

    assert (cluster / "index.json").read_bytes() == (local / "index.json").read_bytes()
    chunks = sorted(path.name for path in local.glob("*.safetensors"))
    assert chunks and chunks == sorted(path.name for path in cluster.glob("*.safetensors"))
    for name in chunks:
        ours, theirs = load_file(local / name), load_file(cluster / name)
        assert sorted(ours) == sorted(theirs), name
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(ours[key], theirs[key]), (name, key)
        cosine = torch.nn.functional.cosine_similarity(
            ours["hidden_states"].float(), theirs["hidden_states"].float(), dim=-1
        )
        # the store's own verification threshold against transformers is 0.995 (mean)
        assert cosine.min() > 0.99 and cosine.mean() > 0.9999, (name, cosine.min(), cosine.mean())


def test_draftflow_runs_on_slurm_like_locally(
    slurm_cluster: Path, tmp_path: Path, smollm2_dir: Path, tiny_pipeline: Path
) -> None:
    known_records = len(_jobcomp_lines())
    workdir = prepare_tiny_workdir(tmp_path / "workflow", smollm2_dir)
    run_snakemake(
        workdir,
        *("--profile", str(workdir / "profiles" / "slurm")),
        *("--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "2"),
        DRAFTFLOW_TARGET,
        timeout=900,
        env=snakemake_env(workdir, DRAFTFLOW_GPU_LOCK_DIR=str(tmp_path / "locks")),
    )

    # One SLURM job per rule, each COMPLETED.
    new_records = _records_of(workdir, known_records)
    assert all("JobState=COMPLETED" in record for record in new_records), new_records
    job_ids = [re.search(r"JobId=(\d+)", record).group(1) for record in new_records]
    assert sorted(_rule_of(job_id) for job_id in job_ids) == DRAFTFLOW_JOBS, new_records

    # As the local tiny run: the same shard bytes, and the same capture (up to rounding).
    for name in ("train/shard-00000.parquet", "val/shard-00000.parquet"):
        local, cluster = (root / "results" / "shard" / name for root in (tiny_pipeline, workdir))
        assert cluster.read_bytes() == local.read_bytes(), name
    _assert_same_capture(tiny_pipeline / DRAFTFLOW_TARGET, workdir / DRAFTFLOW_TARGET)
