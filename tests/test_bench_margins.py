"""draftflow.bench.margins: the plain target's own margin where a greedy output departs from it.

The real-engine test plants differences into the tiny workflow's plain outputs and has a plain
vLLM engine (CPU build) measure them: its gaps must agree with transformers' float32 logits of
the same position, and a token the target ranks low must come out far from a tie.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from study_support import load_study

from draftflow.bench.lossless import compare_runs
from draftflow.bench.margins import (
    count_near_ties,
    find_differences,
    is_near_tie,
    verdict,
)
from draftflow.bench.tables import write_dataset_results


def _run(k: int, tokens: dict[str, list[list[int]]], dataset: str = "d") -> dict:
    responses = {
        request: [
            {"token_ids": ids, "text": f"answer {turn}", "prompt_tokens": 7}
            for turn, ids in enumerate(turns)
        ]
        for request, turns in tokens.items()
    }
    return {"dataset": dataset, "run": 0, "k": k, "responses": responses}


def test_differences_are_found_once_with_what_rebuilds_them():
    plain = _run(0, {"a": [[1, 2, 3], [4, 5]], "b": [[1, 2]], "c": [[9, 9, 9]]})
    k1 = _run(1, {"a": [[1, 2, 3], [4, 6]], "b": [[1, 2]], "c": [[9, 9]]})
    k2 = _run(2, {"a": [[1, 2, 3], [4, 6]], "b": [[7, 2]], "c": [[9, 9, 9]]})
    found = find_differences({0: [plain], 1: [k1], 2: [k2]})
    # a: the same difference at k = 1 and 2, measured once; c only stops earlier: nothing to
    # measure; b differs at its first token.
    assert sorted((d["id"], d["turn"], d["position"]) for d in found) == [("a", 1, 1), ("b", 0, 0)]
    a = next(d for d in found if d["id"] == "a")
    assert (a["plain_token"], a["speculative_token"], a["prefix"]) == (5, 6, [4])
    assert a["answers"] == ["answer 0"] and a["prompt_tokens"] == 7


def test_near_ties_and_the_verdict():
    margin = {
        "dataset": "d",
        "id": "a",
        "turn": 1,
        "position": 1,
        "plain_token": 5,
        "speculative_token": 6,
        "context_matches": True,
        "logit_gap": 0.004,
    }
    assert is_near_tie(margin, 0.05)
    assert not is_near_tie({**margin, "logit_gap": 2.0}, 0.05)
    assert not is_near_tie({**margin, "context_matches": False}, 0.05)
    assert not is_near_tie({**margin, "logit_gap": None}, 0.05)
    assert not is_near_tie(None, 0.05)
    reference = {"a": [[1], [4, 5]], "b": [[1, 2]]}
    candidate = {"a": [[1], [4, 6]], "b": [[1, 3]]}
    differences = compare_runs(reference, candidate)
    assert count_near_ties("d", differences, reference, candidate, [margin], 0.05) == 1
    assert verdict(0, 0) == "identical"
    assert verdict(2, 2) == "near-ties only"
    assert verdict(2, 1) == "differs"


def test_the_table_says_near_ties_only(tmp_path):
    run = {
        "run": 0,
        "dataset": "d",
        "num_prompts": 1,
        "num_requests": 1,
        "prompt_tokens": 7,
        "output_tokens": 2,
        "elapsed_s": 1.0,
        "tokens_per_s": 2.0,
        "tpot_ms": 1.0,
        "requests_per_s": 1.0,
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_pos": [],
    }
    unit = {
        "unit": "a",
        "seconds": 1.0,
        "output_tokens": 2,
        "decode_seconds": 1.0,
        "decode_tokens": 2,
        "num_drafts": 0,
        "num_accepted_tokens": 0,
    }
    sampling = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 2, "seed": 0}
    margin = {
        "dataset": "d",
        "id": "a",
        "turn": 0,
        "position": 1,
        "plain_token": 5,
        "speculative_token": 6,
        "context_matches": True,
        "logit_gap": 0.01,
    }
    results = [
        {
            "k": k,
            "sampling": sampling,
            "tie_margin": 0.05,
            "margins": [margin],
            "runs": [
                {
                    **run,
                    "num_drafts": k,
                    "num_draft_tokens": k,
                    "accepted_per_pos": [0] * k,
                    "units": [unit],
                    "responses": {
                        "a": [
                            {"token_ids": [4, 5 if k == 0 else 6], "text": "x", "prompt_tokens": 7}
                        ]
                    },
                }
            ],
        }
        for k in (0, 1)
    ]
    table = write_dataset_results(
        "d", results, tmp_path / "d.csv", tmp_path / "o.jsonl", tmp_path / "u.csv"
    )
    rows = pd.read_csv(tmp_path / "d.csv").set_index("k")
    assert list(table["lossless"]) == ["identical", "near-ties only"]
    assert rows.loc[1, "num_near_ties"] == 1 and not rows.loc[1, "outputs_identical"]


def test_the_tiny_bench_records_its_check(tiny_pipeline):
    """The workflow's bench: every engine's result names the tie margin and the margins it
    measured, and its table a lossless verdict per run."""
    for path in (tiny_pipeline / "results/bench/engines").glob("k*.json"):
        result = json.loads(path.read_text())
        assert result["tie_margin"] == 0.05 and isinstance(result["margins"], list)
    table = pd.read_csv(tiny_pipeline / "results/bench/tiny.csv")
    assert set(table["lossless"]) <= {"identical", "near-ties only", "differs"}
    assert (table["lossless"] == "identical").eq(table["outputs_identical"]).all()


@pytest.fixture(scope="module")
def study():
    return load_study("lossless_margins")


def test_a_plain_engine_measures_planted_differences(study, tiny_pipeline, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftflow.bench.prompts import read_prompts
    from draftflow.bench.rounds import engine_processes
    from draftflow.bench.run import engine_environment

    target = tiny_pipeline / "resources/target"
    plain = json.loads((tiny_pipeline / "results/bench/engines/k0.json").read_text())
    engine = {**plain["engine"], "model": str(target), "tokenizer": str(target)}
    prompts = read_prompts(tiny_pipeline / "results/bench/prompts/tiny.jsonl")
    by_id = {p["id"]: p for p in prompts}
    run = next(r for r in plain["runs"] if r["run"] == 0)
    # transformers' own logits at each planted position: its second-best token is a near-tie
    # candidate, token 0 (<|endoftext|>) one the target ranks low mid-answer.
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    planted, expected = [], {}
    for index, (request_id, turns) in enumerate(sorted(run["responses"].items())[:3]):
        tokens = turns[0]["token_ids"]
        position = min(2 * index, len(tokens) - 1)
        ids = study.context_ids(tokenizer, by_id[request_id], turns, 0) + tokens[:position]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        second = int(torch.topk(logits, 2).indices[1])
        for speculative in (second, 0):
            item = {
                "dataset": "tiny",
                "id": request_id,
                "turn": 0,
                "position": position,
                "plain_token": tokens[position],
                "speculative_token": speculative,
                "answers": [],
                "prefix": tokens[:position],
                "prompt_tokens": turns[0]["prompt_tokens"],
            }
            planted.append(item)
            expected[(request_id, speculative)] = float(
                logits[tokens[position]] - logits[speculative]
            )
    request = {
        "engines": {"0": engine},
        "sampling": plain["sampling"],
        "prompt_sets": {"tiny": prompts},
        "warmup_tokens": 4,
    }
    shared = {key: request[key] for key in ("sampling", "prompt_sets", "warmup_tokens")}
    with engine_processes(
        {0: {**shared, "engine": engine}},
        tmp_path,
        engine_environment({**request, "reserved_cpus": 1}),
    ) as processes:
        measured = processes[0].margins(planted)
    assert len(measured) == len(planted)
    for margin in measured:
        assert margin["context_matches"], margin  # the prompt rebuilt as the bench gave it
        assert margin["best_token"] == margin["plain_token"], margin
        want = expected[(margin["id"], margin["speculative_token"])]
        if margin["speculative_token"] == 0:
            gap = margin["logit_gap"] or margin["logit_gap_at_least"]
            assert gap > 1.0, margin
        else:
            assert margin["logit_gap"] == pytest.approx(want, abs=2e-3), margin
