"""Quick check of an exported draft in vLLM: greedy speculative decoding, mean acceptance length.

``python -m draftflow.train.acceptance --target T --draft D --prompts P.json --out R.json`` starts
one engine (vLLM starts its worker with spawn, hence the ``__main__`` guard and the separate
process) and writes ``{"acceptance_length": tau, "num_drafts": ..., "texts": [...]}`` to R.json.
tau = 1 + accepted / drafts from vLLM's spec-decode counters. The full benchmark is the bench stage.
"""

from __future__ import annotations

import argparse
import json

from draftflow.io import atomic_write_json


def measure_acceptance(
    target: str,
    draft: str,
    prompts: list[str],
    *,
    num_speculative_tokens: int = 3,
    max_tokens: int = 48,
    max_model_len: int = 1024,
    kv_cache_memory_bytes: int = 128 << 20,
) -> dict:
    """Greedy generation of ``prompts`` with the draft; tau and the texts.

    The KV cache gets a fixed size: on a shared CPU machine a RAM fraction
    (``gpu_memory_utilization``) may find nothing left.
    """
    from vllm import LLM, SamplingParams

    from draftflow.bench.counters import read_spec_counters

    llm = LLM(
        model=target,
        speculative_config={
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": num_speculative_tokens,
        },
        enforce_eager=True,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        disable_log_stats=False,
        seed=0,
    )
    before = read_spec_counters(llm.get_metrics())
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    counts = read_spec_counters(llm.get_metrics()) - before
    return {
        "acceptance_length": counts.acceptance_length,
        "num_drafts": counts.num_drafts,
        "num_accepted_tokens": counts.num_accepted_tokens,
        "acceptance_per_pos": counts.acceptance_per_pos(),
        "texts": [o.outputs[0].text for o in outputs],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of prompt strings")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", required=True, help="where the JSON result goes")
    args = parser.parse_args(argv)
    with open(args.prompts, encoding="utf-8") as handle:
        prompts = json.load(handle)
    result = measure_acceptance(
        args.target,
        args.draft,
        prompts,
        num_speculative_tokens=args.num_speculative_tokens,
        max_tokens=args.max_tokens,
    )
    atomic_write_json(args.out, result)


if __name__ == "__main__":
    main()
