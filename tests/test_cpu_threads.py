"""Thread settings for vLLM's CPU build (draftflow.workflow.cpu_threads)."""

import pytest
from config_support import demo_engine_env, demo_engine_kwargs

from draftflow.workflow.cpu_threads import cpu_engine_env


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


def test_engine_env_per_platform():
    # This machine has no GPU: the CPU build's thread rules; a GPU engine spawns its workers
    # (a driver that touched CUDA cannot fork them).
    from draftflow.engine import on_cpu_build

    here = demo_engine_env(
        "regenerate", reserved_cpus=1, kv_cache_memory_bytes=None, cpu=on_cpu_build()
    )
    assert here == cpu_engine_env(1)
    gpu = demo_engine_env("regenerate", reserved_cpus=1, cpu=False)
    assert gpu["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "OMP_NUM_THREADS" not in gpu
    runner = "VLLM_USE_V2_MODEL_RUNNER"
    assert demo_engine_env("extract", cpu=False, model_runner="v2")[runner] == "1"
    assert demo_engine_env("extract", cpu=True, model_runner="v1")[runner] == "0"
    assert runner not in demo_engine_env("extract", cpu=False)
    with pytest.raises(ValueError, match="allowed are default, v1, v2"):
        demo_engine_env("extract", model_runner="v3")


def test_engine_kwargs_keep_the_share_beside_an_exact_kv_cache():
    """The exact size sizes the cache; the share stays, since a GPU engine checks at start that
    it is free (vLLM's own default, 0.92, failed every engine sharing the H200)."""
    exact = demo_engine_kwargs("m", kv_cache_memory_bytes=1 << 20, gpu_memory_utilization=0.5)
    assert exact["kv_cache_memory_bytes"] == 1 << 20 and exact["gpu_memory_utilization"] == 0.5
    bytes_only = demo_engine_kwargs("m", kv_cache_memory_bytes=1 << 20, gpu_memory_utilization=None)
    assert "gpu_memory_utilization" not in bytes_only
    share = demo_engine_kwargs("m", kv_cache_memory_bytes=None, gpu_memory_utilization=0.5)
    assert share["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in share
    assert "tensor_parallel_size" not in share
    assert demo_engine_kwargs("m", tensor_parallel_size=2)["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match="kv_cache_memory_bytes or gpu_memory_utilization"):
        demo_engine_kwargs("m", kv_cache_memory_bytes=None, gpu_memory_utilization=None)


def test_tensor_parallel_ranks_get_their_own_cores():
    from draftflow.workflow.cpu_threads import rank_core_lists

    # 2 cores, tp 2: one core per rank (vLLM's NUMA-based binding refuses this machine).
    assert rank_core_lists(2, 0, cores=[0, 1]) == [[0], [1]]
    assert rank_core_lists(2, 1, cores=[0, 1]) == [[0], [1]]  # never fewer cores than ranks
    assert rank_core_lists(2, 2, cores=list(range(8))) == [[0, 1, 2], [3, 4, 5]]
    assert rank_core_lists(4, None, cores=[4, 5, 6, 7, 8, 9, 10, 11]) == [
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
    ]
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .* needs at least"):
        rank_core_lists(3, 0, cores=[0, 1])


def test_engine_env_binds_tensor_parallel_ranks(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    env = demo_engine_env("extract", reserved_cpus=0, tensor_parallel_size=2, cpu=True)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|0")  # the user's own binding wins
    for cpu in (True, False):
        tp2 = demo_engine_env("extract", tensor_parallel_size=2, cpu=cpu)
        assert "VLLM_CPU_OMP_THREADS_BIND" not in tp2


def test_deterministic_env_is_batch_invariance_on_gpus_only():
    from draftflow.engine import deterministic_summary

    gpu = demo_engine_env("extract", cpu=False, deterministic=True)
    assert gpu["VLLM_BATCH_INVARIANT"] == "1"
    assert "batch-invariant" in deterministic_summary(gpu)
    assert "VLLM_BATCH_INVARIANT" not in demo_engine_env("extract", cpu=False, deterministic=False)
    # The CPU build has no batch-invariant kernels: the capture fixes each call's forwards.
    cpu = demo_engine_env(
        "extract", reserved_cpus=1, kv_cache_memory_bytes=None, cpu=True, deterministic=True
    )
    assert cpu == cpu_engine_env(1)
    assert "no batch-invariant kernels" in deterministic_summary(cpu)
