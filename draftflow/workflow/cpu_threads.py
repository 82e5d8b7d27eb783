"""Thread settings for vLLM engines on the CPU build.

vLLM's CPU worker pins itself to the cores it may use minus ``VLLM_CPU_NUM_OF_RESERVED_CPU``
(kept for the scheduler). Snakemake exports ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = the rule's
``threads`` to every job, and with ``MKL_NUM_THREADS=2`` a worker pinned to one core ran two
oneDNN threads on it: SmolLM2 generation fell by more than an order of magnitude. So
every CPU engine gets thread counts equal to the cores its worker really gets
(``draftflow.engine.engine_env`` applies them).
"""

from __future__ import annotations

import os

# Thread-count variables that the worker's math libraries read.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which SLURM and taskset narrow)."""
    return len(os.sched_getaffinity(0))


def cpu_engine_env(reserved_cpus: int | None, cores: int | None = None) -> dict[str, str]:
    """Environment for a vLLM engine on the CPU: reserved scheduler cores and matching threads.

    ``reserved_cpus`` None keeps vLLM's default of one reserved core when there are several.
    The worker computes on ``cores - reserved`` cores (at least one).
    """
    cores = available_cores() if cores is None else cores
    if reserved_cpus is None:
        reserved_cpus = 1 if cores > 1 else 0
    if reserved_cpus < 0:
        raise ValueError(f"reserved_cpus must be >= 0, got {reserved_cpus}")
    compute = max(1, cores - reserved_cpus)
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(min(reserved_cpus, cores - 1) if cores > 1 else 0)}
    env.update({name: str(compute) for name in THREAD_VARIABLES})
    return env


def rank_core_lists(
    tensor_parallel_size: int, reserved_cpus: int | None, cores: list[int] | None = None
) -> list[list[int]]:
    """The cores of each tensor-parallel rank of a CPU engine: the job's cores (its affinity
    mask) less the reserved ones, split evenly; the reserved cores are the last ones.

    vLLM's own binding places one rank per NUMA node and fails where there are fewer nodes than
    ranks ("Not enough allowed NUMA nodes"); an explicit list per rank avoids that.
    """
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    if tensor_parallel_size > len(cores):
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} on the CPU build needs at least that "
            f"many cores; this job has {len(cores)} ({cores})"
        )
    reserved = 0 if reserved_cpus is None else reserved_cpus
    usable = cores[: max(tensor_parallel_size, len(cores) - reserved)]
    per_rank = len(usable) // tensor_parallel_size
    return [usable[i * per_rank : (i + 1) * per_rank] for i in range(tensor_parallel_size)]


def tensor_parallel_env(tensor_parallel_size: int, reserved_cpus: int | None) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` (one core list per rank) and matching thread counts."""
    lists = rank_core_lists(tensor_parallel_size, reserved_cpus)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, c)) for c in lists)}
    env.update({name: str(len(lists[0])) for name in THREAD_VARIABLES})
    return env
