"""studies/lossless_margins.py on the tiny workflow's real bench outputs (vLLM, CPU build).

Each position the plain engine decoded greedily is one where the target's own float64 argmax is
that token (short of a near-tie): so a difference placed there, against a token the target ranks
low, must come back with the plain token as the target's best, a wide positive gap and a high
rank. That holds only if the script rebuilds the engine's input as the engine saw it (chat
template, earlier turns, generation prompt).
"""

from __future__ import annotations

import json

import pytest
from study_support import load_study


@pytest.fixture(scope="module")
def margins_study():
    return load_study("lossless_margins")


def test_a_planted_difference_is_measured_against_the_target(
    margins_study, tiny_pipeline, tmp_path
):
    outputs = tiny_pipeline / "results/bench/tiny/outputs.jsonl"
    rows = [json.loads(line) for line in outputs.read_text().splitlines()]
    plain = [row for row in rows if row["k"] == 0 and row["run"] == 0]
    # The speculative run is the plain one with one token replaced, per request, at a spread of
    # positions: the planted differences.
    planted = []
    for index, row in enumerate(plain[:4]):
        turns = json.loads(json.dumps(row["turns"]))
        tokens = turns[0]["token_ids"]
        position = min(index * 3, len(tokens) - 1)
        tokens[position] = 0  # <|endoftext|>: a token no answer continues with mid-sentence
        planted.append({**row, "k": 1, "turns": turns})
    fake = tmp_path / "outputs.jsonl"
    fake.write_text("".join(json.dumps(row) + "\n" for row in [*plain[:4], *planted]))
    runs = margins_study.read_outputs(fake)
    found = margins_study.differences(runs)
    assert len(found) == 4 and all(item["speculative_token"] == 0 for item in found)

    from draftflow.bench.prompts import read_prompts

    prompts = {p["id"]: p for p in read_prompts(tiny_pipeline / "results/bench/prompts/tiny.jsonl")}
    measured = margins_study.margins(tiny_pipeline / "resources/target", prompts, runs, found)
    for item in measured:
        assert item["plain_is_best_fp64"], item  # the input rebuilt as vLLM saw it
        assert item["logit_gap"] > 1.0 and item["speculative_rank"] > 10, item
