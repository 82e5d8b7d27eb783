"""Speculative decoding on a GPU: the plain target against a draft trained by the project.

The bench stage's own engines (``draftflow.bench.run``: one fresh process per k, greedy, every
response's token ids kept) at batch 1 (``max_num_seqs`` 1) and with 16 concurrent requests, for
k = 0 (plain) and each ``--ks``. Per (batch, k): acceptance length τ, per-position acceptance,
output tokens/s, speed-up over k = 0, whether every greedy output equals the plain target's, and
the cost of one speculative step in plain decoding steps
(``(decode time / steps) / (plain decode time / plain tokens)``, steps = drafts at batch 1).

    python bench/gpu_spec_decode.py --target T --draft D --prompts P.jsonl --out R.json

``P.jsonl``: chat prompts as the bench stage reads them (``{"id", "turns": [...]}`` per line).
Results: docs/benchmarks.md, "Speculative decoding on the GPU".
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from draftflow.bench.run import engine_request, run_engine


def summarize(result: dict, plain: dict | None) -> dict:
    (run,) = result["runs"]
    drafts = run["num_drafts"]
    summary = {
        "k": result["k"],
        "output_tokens": run["output_tokens"],
        "elapsed_s": round(run["elapsed_s"], 3),
        "tokens_per_s": round(run["tokens_per_s"], 1),
        "tpot_ms": round(run["tpot_ms"], 3),
        "num_drafts": drafts,
        "acceptance_length": round(1 + run["num_accepted_tokens"] / drafts, 3) if drafts else 1.0,
        "acceptance_per_pos": [round(a / drafts, 3) for a in run["accepted_per_pos"]]
        if drafts
        else [],
    }
    if plain is not None:
        (base,) = plain["runs"]
        summary["speed_up"] = round(run["tokens_per_s"] / base["tokens_per_s"], 3)
        same = [
            mine["token_ids"] == theirs["token_ids"]
            for pid, turns in run["responses"].items()
            for mine, theirs in zip(turns, base["responses"][pid], strict=True)
        ]
        summary["outputs_identical"] = all(same)
        summary["identical_responses"] = f"{sum(same)}/{len(same)}"
        if drafts:
            step = run["elapsed_s"] / drafts
            plain_step = base["elapsed_s"] / base["output_tokens"]
            summary["step_cost_in_plain_steps"] = round(step / plain_step, 3)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="capture CUDA graphs (default: eager engines)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    lines = args.prompts.read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line) for line in lines if line.strip()][: args.limit]
    prompts = [{"id": str(p["id"]), "turns": list(p["turns"])} for p in prompts]
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-spec-") as tmp:
        for batch in args.batches:
            engine = {
                "max_model_len": 2048,
                "max_num_seqs": batch,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "dtype": args.dtype,
                "enforce_eager": not args.cuda_graphs,
            }
            plain = None
            for k in [0, *args.ks]:
                request = engine_request(
                    args.target,
                    args.draft,
                    k,
                    {"prompts": prompts},
                    max_tokens=args.max_tokens,
                    engine=engine,
                )
                result = run_engine(request, k, Path(tmp) / f"b{batch}-k{k}.json", None)
                row = {"batch": batch, **summarize(result, plain)}
                plain = plain or result
                results.append(row)
                print(json.dumps(row), flush=True)
    out = {
        "target": args.target,
        "draft": args.draft,
        "prompts": len(prompts),
        "cuda_graphs": args.cuda_graphs,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "rows": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
