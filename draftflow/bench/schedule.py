"""Which bench engines are alive at once: all of them, or one after the other.

Side by side (``draftflow.bench.rounds``) every configuration times each unit seconds apart from
the others, so a slow phase of the machine cancels in their ratios. It needs the memory of every
engine at once: ``bench.gpu_memory_utilization`` is each engine's share (of the device's memory,
on the CPU build of RAM), and the plain target plus one engine per k add up. A target that
fills its GPUs (Kimi-K2.5 on one node) cannot have two copies alive, so its engines run one at a
time; the units stay the same, so the statistics stay paired, but they are no longer timed
side by side.
"""

from __future__ import annotations

from typing import Any

SIDE_BY_SIDE = "side_by_side"
ONE_AT_A_TIME = "one_at_a_time"
AUTO = "auto"
SCHEDULES = (AUTO, SIDE_BY_SIDE, ONE_AT_A_TIME)
# How the engines alive at once start: each waits for the last to be ready (starts don't compete
# for the cores), or all at once (a GPU host's spare cores take the imports and compiles).
IN_TURN = "in_turn"
TOGETHER = "together"
STARTS = (IN_TURN, TOGETHER)
# The most of the memory the engines' shares may take together: vLLM also needs room outside
# its share (each engine's CUDA context or process, the bench's own process).
MAX_SHARED = 0.9


def engine_schedule(
    schedule: str, engines: int, share: float | None, kv_cache_memory_bytes: int | None
) -> str:
    """``side_by_side`` or ``one_at_a_time`` for ``engines`` engines of ``share`` each.

    ``auto`` runs them side by side where their shares fit together, or where each engine's KV
    cache is given in bytes (its total is then unknown here); else one at a time. An explicit
    ``side_by_side`` whose shares cannot fit is refused, with what would fit.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"bench.schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == ONE_AT_A_TIME or kv_cache_memory_bytes is not None or share is None:
        return SIDE_BY_SIDE if schedule == AUTO else schedule
    together = engines * share
    if together <= MAX_SHARED:
        return SIDE_BY_SIDE
    if schedule == AUTO:
        return ONE_AT_A_TIME
    raise ValueError(
        f"bench.schedule: side_by_side keeps {engines} engines alive at once (the plain target "
        f"and one per num_speculative_tokens), each with bench.gpu_memory_utilization {share}: "
        f"{together:.2f} of the memory together, above the {MAX_SHARED} they can share. Set "
        f"bench.gpu_memory_utilization to at most {MAX_SHARED / engines:.3f}, give each engine "
        f"its KV cache in bytes (bench.kv_cache_memory_bytes), or run them one at a time "
        f"(bench.schedule: {ONE_AT_A_TIME}, or {AUTO})."
    )


def bench_schedule(bench: dict[str, Any]) -> str:
    """The schedule of the config's validated ``bench:`` section (the plain target counts);
    its ``starts`` checked too, so that a config that cannot run stops at start."""
    engine_starts(bench["starts"], bench["kv_cache_memory_bytes"])
    return engine_schedule(
        bench["schedule"],
        1 + len(bench["num_speculative_tokens"]),
        bench["gpu_memory_utilization"],
        bench["kv_cache_memory_bytes"],
    )


def engine_starts(starts: str, kv_cache_memory_bytes: int | None) -> str:
    """``in_turn`` or ``together``, checked: vLLM sizes a GPU engine's KV cache by profiling
    the device's free memory, which engines starting beside it change (vLLM then stops with
    "Error in memory profiling"), so starting together needs each engine's KV cache in bytes."""
    if starts not in STARTS:
        raise ValueError(f"bench.starts must be one of {STARTS}, got {starts!r}")
    if starts == TOGETHER and kv_cache_memory_bytes is None:
        raise ValueError(
            f"bench.starts: {TOGETHER} needs bench.kv_cache_memory_bytes: vLLM sizes a GPU "
            "engine's KV cache by profiling free memory, which engines starting beside it "
            f"change. Set bench.kv_cache_memory_bytes, or bench.starts: {IN_TURN}."
        )
    return starts
