"""Thread settings for vLLM's CPU build (draftflow.workflow.cpu_threads)."""

import pytest

from draftflow.workflow.cpu_threads import apply_cpu_engine_env, cpu_engine_env


def test_threads_match_the_cores_the_worker_gets():
    # Snakemake exports MKL_NUM_THREADS = rule threads; the worker must get its own core count.
    assert cpu_engine_env(1, cores=2) == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    assert cpu_engine_env(0, cores=2)["MKL_NUM_THREADS"] == "2"
    assert cpu_engine_env(2, cores=8)["OMP_NUM_THREADS"] == "6"


def test_default_and_edge_cases():
    # None keeps vLLM's own default: one scheduler core when there are several.
    assert cpu_engine_env(None, cores=4)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert cpu_engine_env(None, cores=1) == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    # More reserved than there are cores: the worker still computes on one.
    assert cpu_engine_env(4, cores=2)["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ValueError, match="reserved_cpus"):
        cpu_engine_env(-1, cores=2)


def test_apply_overrides_snakemake_thread_variables():
    env = {"MKL_NUM_THREADS": "2", "OMP_NUM_THREADS": "2", "PATH": "/bin"}
    updates = apply_cpu_engine_env(1, env)  # this machine has no GPU: the CPU build's rules
    assert updates and env["MKL_NUM_THREADS"] == updates["MKL_NUM_THREADS"]
    assert env["PATH"] == "/bin"
