"""Speculative decoding on a GPU: the plain target against a draft trained by the project.

The bench stage's own engines and statistics (``draftflow.bench.suite.run_benchmark``: the plain
target and every k alive at once on the GPU, each prompt unit timed on every engine in turn,
``--repeats`` rounds, greedy, every response's token ids kept; ``draftflow.report.summary``:
bootstrap intervals over prompt units and rounds) at batch 1 (``max_num_seqs`` 1) and with 16
concurrent requests. Per (batch, k): acceptance length τ, per-position acceptance, output
tokens/s, time per output token and the speed-up over k = 0, each with its confidence interval,
whether every greedy output equals the plain target's, and the cost of one speculative step in
plain decoding steps (τ / speed-up); per batch, the best k where its speed-up interval lies above
every other k's, else the k that tie.

    python perf/gpu_spec_decode.py --target T --draft D --prompts P.jsonl --out R.json

``P.jsonl``: chat prompts as the bench stage reads them (``{"id", "turns": [...]}`` per line).
At batch 1 a unit is one conversation; at batch B, B conversations decoded together, so
``--limit`` should hold several batches. Results: docs/results/gpu-spec-decode.json and
docs/results/gpu-spec-decode-b16.json.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import pandas as pd

from draftflow.bench.settings import BenchSettings
from draftflow.bench.suite import run_benchmark
from draftflow.engine_settings import EngineSettings
from draftflow.io import atomic_write_json
from draftflow.report.summary import Bootstrap, best_k, summarise

FIGURES = ("acceptance_length", "tokens_per_s", "tpot_ms", "speedup")


def _round(value: float, digits: int = 3) -> float | None:
    return round(float(value), digits) if value is not None and math.isfinite(value) else None


def summary_rows(summary: pd.DataFrame, batch: int) -> list[dict]:
    """One JSON row per k: every figure as ``[point, low, high]``."""
    rows = []
    for _, row in summary.sort_values("k").iterrows():
        out = {"batch": batch, "k": int(row["k"])}
        for name in FIGURES:
            out[name] = [_round(row[name]), _round(row[f"{name}_low"]), _round(row[f"{name}_high"])]
        out["acceptance_per_pos"] = json.loads(row["acceptance_per_pos"] or "[]")
        out["step_cost_in_plain_steps"] = _round(row["step_cost"])
        out["outputs_identical"] = bool(row["outputs_identical"])
        out["num_requests_differ"] = int(row["num_requests_differ"])
        out["num_units"], out["num_runs"] = int(row["num_units"]), int(row["num_runs"])
        rows.append(out)
    return rows


def verdict(summary: pd.DataFrame) -> str:
    (row,) = best_k(summary).itertuples()
    return (
        f"k={row.k}"
        if row.named_best
        else "tie: " + ", ".join(f"k={k}" for k in row.tied.split(","))
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    # Every engine is alive at once: their shares of the GPU's memory add up.
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="capture CUDA graphs (default: eager engines)"
    )
    parser.add_argument("--bootstrap-samples", type=int, default=2000)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    lines = args.prompts.read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line) for line in lines if line.strip()][: args.limit]
    prompts = [{"id": str(p["id"]), "turns": list(p["turns"])} for p in prompts]
    share = args.gpu_memory_utilization or round(0.85 / (1 + len(args.ks)), 3)
    bootstrap = Bootstrap(args.bootstrap_samples, args.confidence, args.seed)
    rows, verdicts = [], {}
    with tempfile.TemporaryDirectory(prefix="gpu-spec-") as tmp:
        for batch in args.batches:
            out_dir = Path(tmp) / f"b{batch}"
            tables = run_benchmark(
                prompt_sets={"prompts": prompts},
                target=args.target,
                draft=args.draft,
                ks=args.ks,
                out_dir=out_dir,
                settings=BenchSettings(
                    temperature=0.0,
                    top_p=1.0,
                    max_tokens=args.max_tokens,
                    seed=args.seed,
                    repeats=args.repeats,
                    warmup_tokens=16,
                    schedule="auto",
                    starts="in_turn",
                    tie_margin=0.0,
                    trust_remote_code=False,
                    engine=EngineSettings(
                        device="gpu",
                        tensor_parallel_size=1,
                        dtype=args.dtype,
                        max_model_len=2048,
                        max_num_seqs=batch,
                        max_num_batched_tokens=None,
                        gpu_memory_utilization=share,
                        kv_cache_memory_bytes=None,
                        reserved_cpus=None,
                        engine_args={"enforce_eager": not args.cuda_graphs},
                    ),
                ),
            )
            units = pd.read_csv(out_dir / "prompts" / "units.csv")
            summary = summarise(tables["prompts"], units, bootstrap)
            for row in summary_rows(summary, batch):
                rows.append(row)
                print(json.dumps(row), flush=True)
            verdicts[str(batch)] = verdict(summary)
            print(json.dumps({"batch": batch, "best": verdicts[str(batch)]}), flush=True)
    out = {
        "target": args.target,
        "draft": args.draft,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "cuda_graphs": args.cuda_graphs,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "confidence": args.confidence,
        "bootstrap_samples": args.bootstrap_samples,
        "rows": rows,
        "best_k": verdicts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, out)


if __name__ == "__main__":
    main()
