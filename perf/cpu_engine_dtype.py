"""A CPU-build vLLM engine's prefill and decode in bf16 against float32, one engine per dtype.

Why ``draftflow.engine.platform_dtype`` runs engines in float32 on CPUs without native bf16
(AVX512-BF16 or AMX): there oneDNN emulates bf16 GEMMs. Random prompts of ``--length`` tokens::

    .venv/bin/python perf/cpu_engine_dtype.py --model .test-cache/smollm2 --out engine-dtype.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time


def measure(model: str, dtype: str, prompts: int, length: int, decode_tokens: int) -> dict:
    from vllm import SamplingParams, TokensPrompt

    from draftflow.engine import engine_env, engine_kwargs, shutdown_engine, start_engine

    # No config here: one plain CPU engine with a 256 MiB KV cache and one scheduler core.
    kv_cache_memory_bytes = 256 << 20
    kwargs = engine_kwargs(
        model,
        max_model_len=2 * length + decode_tokens,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        gpu_memory_utilization=None,
        tensor_parallel_size=1,
        seed=0,
        trust_remote_code=False,
        enforce_eager=True,
        extra={},
    )
    env = engine_env(
        reserved_cpus=1,
        model_runner="default",
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        tensor_parallel_size=1,
        cpu=True,
        deterministic=False,
    )
    llm = start_engine({**kwargs, "dtype": dtype}, env)
    try:
        rng = random.Random(0)
        batch = [
            TokensPrompt(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(length)])
            for _ in range(prompts)
        ]
        one_token = SamplingParams(max_tokens=1, temperature=0)
        llm.generate(batch[:2], one_token, use_tqdm=False)  # warm-up
        began = time.perf_counter()
        llm.generate(batch, one_token, use_tqdm=False)
        prefill = time.perf_counter() - began
        decode = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
        began = time.perf_counter()
        llm.generate(batch[:4], decode, use_tqdm=False)
        decoding = time.perf_counter() - began
    finally:
        shutdown_engine(llm)
    return {
        "dtype": dtype,
        "prefill_tokens_per_s": prompts * length / prefill,
        "decode_tokens_per_s": 4 * decode_tokens / decoding,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a prepared target (bf16 checkpoint)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    from draftflow.hardware import cpu_has_native_bf16

    rows = [
        measure(args.model, dtype, args.prompts, args.length, args.decode_tokens)
        for dtype in ("float32", "bfloat16")
    ]
    result = {
        "machine": platform.processor() or platform.machine(),
        "native_bf16": cpu_has_native_bf16(),
        "prompts": args.prompts,
        "length": args.length,
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        from draftflow.io import atomic_write_json

        atomic_write_json(args.out, result)


if __name__ == "__main__":
    main()
