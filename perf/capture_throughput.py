"""Capture throughput: hooks vs vLLM's native extractor vs plain prefill vs transformers.

Each mode runs in its own process (one engine each, same settings, same thread pinning):

- ``plain``: ``LLM.generate(max_tokens=1)`` without capture: the ceiling;
- ``hooks``: the hooks backend, fetching the states included;
- ``native``: vLLM's ``extract_hidden_states`` + our CPU-safe connector, reading files included;
- ``hf``: transformers bf16, one prompt at a time.

Usage (results go to a JSON file in docs/results/ with machine, date and command)::

    .venv/bin/python perf/capture_throughput.py --model .test-cache/smollm2 \\
        --prompts 64 --length 300 --threads 1 --modes plain hooks native hf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(10, 30_000, (length,), generator=generator).tolist() for _ in range(count)
    ]


def pin_threads(threads: int) -> None:
    """Same CPU budget for every mode: vLLM's OMP threads on cores [1..threads], none reserved."""
    cores = f"1-{threads}" if threads > 1 else "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    os.environ["OMP_NUM_THREADS"] = str(threads)


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this process; returns its measurement."""
    import torch

    from draftflow.capture.backends import CaptureEngineSettings, make_backend
    from draftflow.capture.layers import capture_layers

    torch.set_num_threads(args.threads)
    layers = capture_layers(args.model, None)  # no config: EAGLE-3's own aux layers
    prompts = make_prompts(args.prompts, args.length)
    settings = CaptureEngineSettings(
        max_model_len=args.length + 1,
        tp_size=1,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        reserved_cpus=None,
        trust_remote_code=False,
        model_runner="default",
        deterministic=False,
        engine_args={},
        store_dtype="bfloat16",
        hf_dtype="bfloat16",
        device="cpu",
    )
    started = time.perf_counter()
    if args.mode == "plain":
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from draftflow.capture.backends import capture_engine_env, capture_engine_kwargs
        from draftflow.engine import start_engine

        llm = start_engine(
            capture_engine_kwargs(args.model, settings),
            capture_engine_env(settings, settings.model_runner),
        )
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

        def run(batch):
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)

    else:
        backend = make_backend(args.mode, args.model, layers.layer_ids, settings)
        run = backend.capture
    startup = time.perf_counter() - started
    run(prompts[:4])  # warm-up
    timings = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        run(prompts)
        timings.append(time.perf_counter() - began)
    tokens = args.prompts * args.length
    best = min(timings)
    return {
        "mode": args.mode,
        "threads": args.threads,
        "prompts": args.prompts,
        "length": args.length,
        "startup_s": round(startup, 1),
        "seconds": [round(t, 3) for t in timings],
        "tokens_per_s": round(tokens / best, 1),
        "bytes_per_token": len(layers.layer_ids) * layers.hidden_size * 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(REPO, ".test-cache", "smollm2"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--modes", nargs="+", default=["plain", "hooks", "native", "hf"])
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # set in the per-mode child process
    args = parser.parse_args()

    if args.mode:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return
    pin_threads(args.threads)
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    for mode in args.modes:
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--mode", mode],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if child.returncode != 0 or not lines:
            print(f"{mode}: failed (exit {child.returncode})\n{child.stderr[-3000:]}", flush=True)
            continue
        print(json.dumps(json.loads(lines[-1][len("RESULT ") :])), flush=True)


if __name__ == "__main__":
    main()
