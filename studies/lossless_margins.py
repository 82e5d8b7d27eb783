"""Is a failed lossless check a near-tie or a defect? The target's own margin at each difference.

The bench (rule bench_table) reports, per request, where the speculative engine's greedy output
first departs from the plain target's. Greedy decoding flips where the two best logits are nearly
equal and the two engines' arithmetic differs (other kernels, batch shapes, TF32 in attention):
that is numerics, not a wrong draft-verification. A verification defect instead picks a token the
target ranks far below its best.

For every first difference in a bench's ``outputs.jsonl`` this recomputes the target's logits at
that position in float64 with transformers on the CPU (the conversation as the engine saw it,
rendered by the target's chat template, then the plain engine's tokens up to the difference) and
reports the gap between the plain engine's token and the speculative engine's token, in logits.

Usage (results: docs/results/lossless-margins.json)::

    PYTHONPATH=$PWD .venv/bin/python studies/lossless_margins.py \\
        --outputs W/results/bench/mtbench/outputs.jsonl --prompts W/results/bench/prompts/mtbench.jsonl \\
        --target W/resources/target --out docs/results/lossless-margins.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def read_outputs(path: Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Per request id, per k, the turns (token ids and text) of the bench's first run."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(dict)
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if int(row.get("run", 0)) == 0:
                runs[row["id"]][int(row["k"])] = row["turns"]
    return runs


def differences(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Each (request, k > 0) whose tokens depart from k = 0: turn, position and both tokens."""
    found = []
    for request_id, by_k in sorted(runs.items()):
        plain = by_k[0]
        for k, turns in sorted(by_k.items()):
            if k == 0:
                continue
            for turn, (want, got) in enumerate(zip(plain, turns, strict=False)):
                a, b = want["token_ids"], got["token_ids"]
                position = next(
                    (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None
                )
                if position is None:
                    continue  # equal up to the shorter one's end: a length difference only
                found.append(
                    {
                        "id": request_id,
                        "k": k,
                        "turn": turn,
                        "position": position,
                        "plain_token": a[position],
                        "speculative_token": b[position],
                    }
                )
                break
    return found


def context_ids(
    tokenizer: Any, prompt: dict[str, Any], plain_turns: list[dict[str, Any]], turn: int
) -> list[int]:
    """The engine's input for ``turn``: earlier turns with the plain engine's answers (equal in
    both engines up to this turn), the turn's user message, the generation prompt."""
    messages = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    for earlier in range(turn):
        messages.append({"role": "user", "content": prompt["turns"][earlier]})
        messages.append({"role": "assistant", "content": plain_turns[earlier]["text"]})
    messages.append({"role": "user", "content": prompt["turns"][turn]})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def margins(
    target: Path, prompts: dict[str, dict[str, Any]], runs: dict, found: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    measured = []
    for item in found:
        plain_turns = runs[item["id"]][0]
        prefix = plain_turns[item["turn"]]["token_ids"][: item["position"]]
        ids = context_ids(tokenizer, prompts[item["id"]], plain_turns, item["turn"]) + prefix
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        best = int(torch.argmax(logits))
        plain, speculative = item["plain_token"], item["speculative_token"]
        measured.append(
            {
                **item,
                "target_best_fp64": best,
                "plain_is_best_fp64": best == plain,
                "logit_gap": float(logits[plain] - logits[speculative]),
                "speculative_rank": int((logits > logits[speculative]).sum()),
            }
        )
    return measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from draftflow.bench.prompts import read_prompts
    from draftflow.io import atomic_write_json

    runs = read_outputs(args.outputs)
    prompts = {prompt["id"]: prompt for prompt in read_prompts(args.prompts)}
    measured = margins(args.target, prompts, runs, differences(runs))
    gaps = sorted(abs(item["logit_gap"]) for item in measured)
    atomic_write_json(
        args.out,
        {
            "outputs": str(args.outputs),
            "differences": measured,
            "largest_abs_logit_gap": gaps[-1] if gaps else None,
        },
    )
    for item in measured:
        print(item)


if __name__ == "__main__":
    main()
