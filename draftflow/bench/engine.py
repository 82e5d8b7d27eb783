"""One benchmark configuration in one vLLM engine: warm up, then timed multi-turn runs.

vLLM can't change its speculative config after start, so every configuration (the plain target,
and one per ``num_speculative_tokens``) gets its own engine, and the benchmark driver runs each
in a fresh process (``python -m draftflow.bench.engine REQUEST.json RESULT.json``): the process
gives back all memory, starts with fresh counters and gets the same thread pinning. One engine
serves every prompt set in turn (an engine start costs ~30 s on the CPU).

A request JSON holds ``engine`` (keyword arguments for ``vllm.LLM``), ``sampling``
(temperature, top_p, max_tokens, seed), ``prompt_sets`` (prompt-set name -> normalised prompt
records), ``repeats`` and ``warmup_tokens``. The result JSON holds ``engine``, ``sampling`` and
one entry per (timed run, prompt set) under ``runs``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from draftflow.bench.counters import read_spec_counters
from draftflow.engine import engine_kwargs as common_engine_kwargs
from draftflow.io import atomic_write_json

log = logging.getLogger(__name__)


def engine_kwargs(
    target: str,
    draft: str | None,
    k: int,
    *,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_utilization: float | None = None,
    kv_cache_memory_bytes: int | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
    enforce_eager: bool = True,
    trust_remote_code: bool = False,
    tensor_parallel_size: int = 1,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``: identical for every k except the speculative config.

    The shared part (KV cache, tensor parallelism, eager mode) comes from ``draftflow.engine``.
    """
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0 (0 = plain target), got {k}")
    if k > 0 and not draft:
        raise ValueError(f"num_speculative_tokens={k} needs a draft model directory")
    kwargs = common_engine_kwargs(
        target,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        seed=seed,
        trust_remote_code=trust_remote_code,
        enforce_eager=enforce_eager,
        extra={
            "tokenizer": str(target),
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
            # The spec-decode counters exist only with stats logging on.
            "disable_log_stats": False,
            **(extra or {}),
        },
    )
    if k > 0:
        kwargs["speculative_config"] = {
            "method": "eagle3",
            "model": str(draft),
            "num_speculative_tokens": k,
        }
    return kwargs


def _request_seed(seed: int, prompt_id: str, turn: int) -> int:
    """A per-request sampling seed that doesn't depend on batch order or configuration."""
    digest = hashlib.sha1(f"{seed}:{prompt_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _sampling_params(sampling: dict[str, Any], prompt_id: str, turn: int) -> Any:
    from vllm import SamplingParams

    temperature = float(sampling.get("temperature", 0.0))
    return SamplingParams(
        temperature=temperature,
        top_p=float(sampling.get("top_p", 1.0)) if temperature > 0 else 1.0,
        max_tokens=int(sampling["max_tokens"]),
        seed=_request_seed(int(sampling.get("seed", 0)), prompt_id, turn),
    )


def _progress(*args: Any, **kwargs: Any) -> Any:
    """vLLM's per-batch progress bar, throttled for log files."""
    from tqdm import tqdm

    kwargs["mininterval"] = 5
    return tqdm(*args, **kwargs)


def _decode_seconds(output: Any) -> float | None:
    """Time between a response's first and last token (engine-core clock), if vLLM kept it."""
    stats = getattr(output, "metrics", None)
    first = getattr(stats, "first_token_ts", 0.0) if stats is not None else 0.0
    last = getattr(stats, "last_token_ts", 0.0) if stats is not None else 0.0
    return last - first if first > 0 and last >= first else None


def run_conversations(
    llm: Any, prompts: list[dict[str, Any]], sampling: dict[str, Any]
) -> tuple[dict[str, list[dict[str, Any]]], float]:
    """Answer every prompt turn by turn, feeding the model's own answers back.

    All conversations' turn t go to the engine as one batch. Returns per prompt id the list of
    responses (token ids, text, counts, decode time) and the seconds spent inside ``llm.chat``.
    """
    conversations = {
        p["id"]: ([{"role": "system", "content": p["system"]}] if p.get("system") else [])
        for p in prompts
    }
    responses: dict[str, list[dict[str, Any]]] = {p["id"]: [] for p in prompts}
    elapsed = 0.0
    for turn in range(max(len(p["turns"]) for p in prompts)):
        active = [p for p in prompts if len(p["turns"]) > turn]
        for prompt in active:
            conversations[prompt["id"]].append({"role": "user", "content": prompt["turns"][turn]})
        params = [_sampling_params(sampling, p["id"], turn) for p in active]
        start = time.perf_counter()
        outputs = llm.chat([conversations[p["id"]] for p in active], params, use_tqdm=_progress)
        elapsed += time.perf_counter() - start
        for prompt, output in zip(active, outputs, strict=True):
            completion = output.outputs[0]
            conversations[prompt["id"]].append({"role": "assistant", "content": completion.text})
            responses[prompt["id"]].append(
                {
                    "turn": turn,
                    "token_ids": list(completion.token_ids),
                    "text": completion.text,
                    "prompt_tokens": len(output.prompt_token_ids or []),
                    "finish_reason": completion.finish_reason,
                    "decode_s": _decode_seconds(output),
                }
            )
    return responses, elapsed


def _run_stats(responses: dict[str, list[dict[str, Any]]], elapsed: float) -> dict[str, Any]:
    flat = [r for turns in responses.values() for r in turns]
    output_tokens = sum(len(r["token_ids"]) for r in flat)
    # Time per output token: per response, decode time over the tokens after the first.
    per_token = [
        r["decode_s"] / (len(r["token_ids"]) - 1)
        for r in flat
        if r["decode_s"] is not None and len(r["token_ids"]) > 1
    ]
    return {
        "num_prompts": len(responses),
        "num_requests": len(flat),
        "prompt_tokens": sum(r["prompt_tokens"] for r in flat),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": output_tokens / elapsed if elapsed > 0 else float("nan"),
        "requests_per_s": len(flat) / elapsed if elapsed > 0 else float("nan"),
        "tpot_ms": 1000.0 * sum(per_token) / len(per_token) if per_token else float("nan"),
    }


def run_configuration(request: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, warm it up, and time ``repeats`` passes over every prompt set."""
    from vllm import SamplingParams

    from draftflow.engine import start_engine

    prompt_sets: dict[str, list[dict[str, Any]]] = request["prompt_sets"]
    empty = [name for name, prompts in prompt_sets.items() if not prompts]
    if not prompt_sets or empty:
        raise ValueError(f"empty prompt set(s): {empty or 'none given'}")
    sampling = request["sampling"]
    # The driver set the engine's environment when it started this process.
    llm = start_engine(request["engine"], {})
    # Warm-up: the first request pays for lazy initialisation; it's outside every timed run.
    first = next(iter(prompt_sets.values()))[0]
    warmup = SamplingParams(temperature=0.0, max_tokens=int(request.get("warmup_tokens", 16)))
    llm.chat([[{"role": "user", "content": first["turns"][0]}]], warmup, use_tqdm=False)

    runs = []
    for run in range(int(request.get("repeats", 1))):
        for dataset, prompts in prompt_sets.items():
            before = read_spec_counters(llm.get_metrics())
            responses, elapsed = run_conversations(llm, prompts, sampling)
            counters = read_spec_counters(llm.get_metrics()) - before
            stats = _run_stats(responses, elapsed)
            log.info(
                "run %d, %s: %.1f output tokens/s, %s",
                run,
                dataset,
                stats["tokens_per_s"],
                counters,
            )
            runs.append(
                {
                    "run": run,
                    "dataset": dataset,
                    **stats,
                    "num_drafts": counters.num_drafts,
                    "num_draft_tokens": counters.num_draft_tokens,
                    "num_accepted_tokens": counters.num_accepted_tokens,
                    "accepted_per_pos": list(counters.accepted_per_pos),
                    "responses": responses,
                }
            )
    return {"engine": request["engine"], "sampling": sampling, "runs": runs}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m draftflow.bench.engine REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    atomic_write_json(argv[1], run_configuration(request))
    return 0


if __name__ == "__main__":  # vLLM starts its workers with spawn: keep start-up under a guard
    sys.exit(main(sys.argv[1:]))
