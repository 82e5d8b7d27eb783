"""Capture determinism: the same prompts captured several times, by one engine or several.

Per call, against the first call of the first engine: whether each prompt's states are the same
bytes, the share of elements that differ, the largest |difference|, the lowest token cosine, and
whether the worker saw the same forwards (which prompts shared each forward, how many tokens
each). ``--solo`` also captures every prompt alone (one prompt per forward) and compares it with
its states from the batched call: that tells whether a prompt's bits depend on its neighbours.
``--cost-rounds`` then times calls of the same prompts on the first engine, alternating the
first step held (every request in before the engine steps, as ``extract.deterministic`` does)
and not held, and counts the distinct schedules of each. ``--random-lengths N LOW HIGH`` draws
N prompt lengths instead of ``--lengths`` (the demo's chunk: 64 samples).

Usage (results go to docs/capture.md, "Determinism")::

    flock /tmp/draftflow-heavy.lock .venv/bin/python perf/capture_determinism.py \\
        --model .test-cache/smollm2 --calls 3 --solo --out /tmp/det.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

# The prompts of tests/test_capture_fp8.py's hooks test, whose two calls differed in CI.
DEFAULT_LENGTHS = [120, 7, 300, 45, 64]


def make_prompts(lengths: list[int], seed: int = 4) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 49_000, (n,), generator=generator).tolist() for n in lengths]


def compare(reference: list[torch.Tensor], states: list[torch.Tensor]) -> dict:
    """How far ``states`` is from ``reference``, prompt by prompt and in total."""
    differing, elements, max_delta, min_cosine, equal = 0, 0, 0.0, 1.0, []
    for ref, got in zip(reference, states, strict=True):
        same = torch.equal(ref.view(torch.int16), got.view(torch.int16))
        equal.append(same)
        elements += ref.numel()
        if same:
            continue
        a, b = ref.float(), got.float()
        differing += int((a != b).sum())
        max_delta = max(max_delta, float((a - b).abs().max()))
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        min_cosine = min(min_cosine, float(cosine.min()))
    return {
        "bytes_equal": all(equal),
        "prompts_equal": equal,
        "differing_fraction": differing / max(elements, 1),
        "max_abs_delta": max_delta,
        "min_token_cosine": min_cosine,
    }


def capture_call(backend, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list, float]:
    began = time.perf_counter()
    states = [s.clone() for s in backend.capture(prompts)]
    seconds = time.perf_counter() - began
    return states, backend.last_stats.get("schedule", []), seconds


def keyless(schedule: list) -> list:
    """A schedule with each file key reduced to the prompt's place in its call."""
    return [[(key.rpartition("-")[2], count) for key, count in forward] for forward in schedule]


def run(args: argparse.Namespace) -> dict:
    from draftflow.capture.backends import CaptureEngineSettings, make_backend
    from draftflow.capture.layers import capture_layers

    layers = capture_layers(args.model, None)  # no config: EAGLE-3's own aux layers
    prompts = make_prompts(args.lengths)
    settings = CaptureEngineSettings(
        max_model_len=max(args.lengths) + 1,
        tp_size=1,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        reserved_cpus=args.reserved_cpus,
        trust_remote_code=False,
        model_runner="default",
        deterministic=args.deterministic,
        engine_args={},
        store_dtype="bfloat16",
        hf_dtype="float32",
        device="cpu",
    )
    reference, reference_schedule, calls, solo, cost = None, None, [], None, None
    for engine in range(args.engines):
        backend = make_backend("hooks", args.model, layers.layer_ids, settings)
        try:
            for call in range(args.calls):
                states, schedule, seconds = capture_call(backend, prompts)
                if reference is None:
                    reference, reference_schedule = states, keyless(schedule)
                result = compare(reference, states)
                result.update(
                    engine=engine,
                    call=call,
                    seconds=round(seconds, 3),
                    tokens_per_s=round(sum(args.lengths) / seconds, 1),
                    same_schedule=keyless(schedule) == reference_schedule,
                    schedule=keyless(schedule),
                )
                calls.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "schedule"}), flush=True)
            if args.solo and engine == 0:
                alone = [capture_call(backend, [p])[0][0] for p in prompts]
                solo = compare(reference, alone)
                print("solo", json.dumps(solo), flush=True)
            if args.cost_rounds and engine == 0:
                cost = measure_hold_cost(backend, prompts, args.cost_rounds)
                print("cost", json.dumps(cost), flush=True)
        finally:
            backend.close()
    return {
        "machine": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)),
        "lengths": args.lengths,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "deterministic": args.deterministic,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "ONEDNN"))},
        "calls": calls,
        "solo_vs_batched": solo,
        "hold_cost": cost,
    }


def measure_hold_cost(backend, prompts: list[list[int]], rounds: int) -> dict:
    """Seconds per call with the first step held and not, alternating on one engine."""
    import statistics

    from draftflow.engine import can_hold_first_step

    if not can_hold_first_step(backend.llm):
        raise SystemExit("this vLLM cannot hold the first step: nothing to compare")
    runs: dict[bool, list[float]] = {False: [], True: []}
    schedules: dict[bool, set[str]] = {False: set(), True: set()}
    can_hold = backend.hold_first_step
    first: dict[bool, list[torch.Tensor]] = {}
    differing: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for hold in (False, True):
            backend.hold_first_step = hold
            states, schedule, seconds = capture_call(backend, prompts)
            runs[hold].append(seconds)
            schedules[hold].add(json.dumps(keyless(schedule)))
            reference = first.setdefault(hold, states)
            differing[hold].append(compare(reference, states)["differing_fraction"])
    backend.hold_first_step = can_hold
    tokens = sum(map(len, prompts))
    result: dict = {"prompts": len(prompts), "tokens": tokens}
    for hold, name in ((False, "free"), (True, "held")):
        median = statistics.median(runs[hold])
        result[name] = {
            "median_s": round(median, 3),
            "min_s": round(min(runs[hold]), 3),
            "tokens_per_s": round(tokens / median, 1),
            "seconds": [round(x, 3) for x in runs[hold]],
            "distinct_schedules": len(schedules[hold]),
            # against the first call of the same mode
            "calls_with_other_bytes": sum(1 for x in differing[hold] if x > 0),
            "max_differing_fraction": max(differing[hold]),
        }
    for stat in ("median_s", "min_s"):
        ratio = result["held"][stat] / result["free"][stat]
        result[f"held_over_free_{stat[:-2]}"] = round(ratio, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--kv-cache-bytes", type=int, default=33_554_432)
    parser.add_argument("--reserved-cpus", type=int, help="extract.reserved_cpus")
    parser.add_argument("--solo", action="store_true", help="also capture each prompt alone")
    parser.add_argument("--cost-rounds", type=int, default=0)
    parser.add_argument("--random-lengths", type=int, nargs=3, metavar=("N", "LOW", "HIGH"))
    parser.add_argument("--deterministic", action="store_true", help="extract.deterministic")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.random_lengths:
        count, low, high = args.random_lengths
        generator = torch.Generator().manual_seed(7)
        args.lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    result = run(args)
    if args.out:
        from draftflow.io import atomic_write_json

        atomic_write_json(args.out, result)


if __name__ == "__main__":
    main()
