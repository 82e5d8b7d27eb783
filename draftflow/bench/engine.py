"""One benchmark engine in its own process, timing the units its driver sends it.

vLLM can't change its speculative config after start, so every configuration (the plain target,
k = 0, and one per ``num_speculative_tokens``) gets its own engine, each in a fresh process
(``python -m draftflow.bench.engine REQUEST.json COMMANDS_FD REPLIES_FD``): the process gives
back all memory, has its own spec-decode counters (vLLM keeps them in a registry per process,
which a second engine in the same process would reset) and gets the driver's thread pinning.
All engines of a benchmark are alive at once and the driver (``draftflow.bench.rounds``) sends
each unit to every one in turn; an idle engine waits on its pipe without using the CPU.

A request JSON holds ``engine`` (keyword arguments for ``vllm.LLM``), ``sampling``
(temperature, top_p, max_tokens, seed), ``prompt_sets`` (prompt-set name -> normalised prompt
records) and ``warmup_tokens``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from draftflow.bench.counters import SpecCounters, read_spec_counters
from draftflow.engine import engine_kwargs as common_engine_kwargs
from draftflow.engine import shutdown_engine

log = logging.getLogger(__name__)


def engine_kwargs(
    target: str,
    draft: str | None,
    k: int,
    *,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_utilization: float | None,
    kv_cache_memory_bytes: int | None,
    dtype: str,
    seed: int,
    enforce_eager: bool,
    trust_remote_code: bool,
    tensor_parallel_size: int,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``: identical for every k except the speculative config.

    Every setting is the bench config's (``draftflow.bench.run.engine_arguments``); none has a
    default. The shared part (KV cache, tensor parallelism, eager mode) comes from
    ``draftflow.engine``.
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
            **extra,
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


def _read_counters(llm: Any) -> SpecCounters:
    return read_spec_counters(llm.get_metrics())


def serve(request: dict[str, Any], commands: TextIO, replies: TextIO) -> None:
    """Start one engine, warm it up, then time the units the driver asks for, one at a time.

    Every line on ``commands`` is ``{"dataset", "prompts": [ids]}`` (answered with the unit's
    responses, seconds inside ``llm.chat`` and spec-decode counters), ``{"margins": [...]}``
    (differences to measure, ``draftflow.bench.margins``) or ``{"stop": true}``.
    The first line on ``replies`` says the engine is ready.
    """
    from vllm import SamplingParams

    from draftflow.bench.margins import measure as measure_margin
    from draftflow.engine import start_engine

    prompt_sets: dict[str, list[dict[str, Any]]] = request["prompt_sets"]
    empty = [name for name, prompts in prompt_sets.items() if not prompts]
    if not prompt_sets or empty:
        raise ValueError(f"empty prompt set(s): {empty or 'none given'}")
    by_id = {name: {p["id"]: p for p in prompts} for name, prompts in prompt_sets.items()}
    sampling = request["sampling"]
    # The driver set the engine's environment when it started this process.
    llm = start_engine(request["engine"], {})
    # Warm-up: the first requests pay for lazy initialisation; never timed.
    warmup = SamplingParams(temperature=0.0, max_tokens=int(request.get("warmup_tokens", 16)))
    for prompts in prompt_sets.values():
        llm.chat([[{"role": "user", "content": prompts[0]["turns"][0]}]], warmup, use_tqdm=False)
    _reply(replies, {"ready": True})
    for line in commands:
        command = json.loads(line)
        if command.get("stop"):
            break
        if "margins" in command:
            margins = [
                measure_margin(llm, by_id[item["dataset"]][item["id"]], item)
                for item in command["margins"]
            ]
            _reply(replies, {"margins": margins})
            continue
        unit = [by_id[command["dataset"]][pid] for pid in command["prompts"]]
        before = _read_counters(llm)
        responses, elapsed = run_conversations(llm, unit, sampling)
        counters = _read_counters(llm) - before
        _reply(
            replies,
            {
                "responses": responses,
                "elapsed_s": elapsed,
                "counters": {
                    "num_drafts": counters.num_drafts,
                    "num_draft_tokens": counters.num_draft_tokens,
                    "num_accepted_tokens": counters.num_accepted_tokens,
                    "accepted_per_pos": list(counters.accepted_per_pos),
                },
            },
        )
    shutdown_engine(llm)


def _reply(replies: TextIO, message: dict[str, Any]) -> None:
    replies.write(json.dumps(message, allow_nan=True) + "\n")
    replies.flush()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(
            "usage: python -m draftflow.bench.engine REQUEST.json COMMANDS_FD REPLIES_FD",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    # The driver's pipes, not stdout: vLLM logs to stdout.
    with (
        open(int(argv[1]), encoding="utf-8") as commands,
        open(int(argv[2]), "w", encoding="utf-8") as replies,
    ):
        try:
            serve(request, commands, replies)
        except Exception as error:
            # The driver raises this in the job's own exception; the traceback goes to the log.
            _reply(replies, {"error": f"{type(error).__name__}: {error}"})
            raise
    return 0


if __name__ == "__main__":  # vLLM starts its workers with spawn: keep start-up under a guard
    sys.exit(main(sys.argv[1:]))
