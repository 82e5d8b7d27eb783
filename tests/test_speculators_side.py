"""studies/speculators_side.py: speculators' recipe on a draftflow run's conversations.

Its data stage's first half runs for real here: a vLLM server (the CPU build) launched as
speculators launches it, and ``speculators prepare-data`` rendering the tiny workflow's
conversations through it. Its hidden-state generation needs a GPU (vLLM's
ExampleHiddenStatesConnector pins host memory, which the CPU build cannot), and so does its
trainer; docs/results/side-by-side.json holds its GPU results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from study_support import load_study

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = ("config/config.yaml",)  # the tiny workflow writes its config there


@pytest.fixture(scope="module")
def side():
    return load_study("speculators_side")


def test_conversations_are_the_train_split(side, tiny_pipeline, tmp_path):
    """Only the conversations draftflow trained on, with their messages as draftflow read them."""
    out = tmp_path / "conversations.jsonl"
    count = side.write_conversations(tiny_pipeline, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    train = set(pq.read_table(tiny_pipeline / "results/split/train.parquet")["id"].to_pylist())
    assert count == len(rows) == len(train)
    assert {row["id"] for row in rows} == train
    corpus = {
        record["id"]: record["messages"]
        for record in map(json.loads, side.corpus_path(tiny_pipeline).read_text().splitlines())
    }
    assert all(row["conversations"] == corpus[row["id"]] for row in rows)


def test_draftflow_recipe_resolves_in_speculators(side):
    """The draftflow recipe's flags, read by speculators' own resolver, are the GPU example's
    training settings."""
    from speculators.train.config import TrainConfig

    config = side.workdir_config(REPO, ("config/examples/smollm2-gpu.yaml",))
    flags = side.train_arguments("draftflow", config)
    resolved = TrainConfig.resolve(["--verifier-name-or-path", "t", "--data-path", "d", *flags])
    train = config["train"]
    assert resolved.trainer.epochs == train["epochs"] == 3
    assert resolved.data.total_seq_len == train["tokens_per_batch"]
    assert resolved.optimizer.optimizer == train["optimizer"]
    assert resolved.optimizer.lr == train["lr"]
    assert resolved.scheduler.scheduler_type == train["scheduler"]
    assert resolved.scheduler.scheduler_warmup_steps == train["warmup_steps"]
    assert resolved.loss.ttt_steps == train["ttt_steps"]
    assert resolved.loss.loss_fn == train["loss"]
    assert resolved.draft.num_layers == train["num_layers"]
    assert resolved.draft.draft_vocab_size == config["vocab"]["draft_vocab_size"]
    eager = TrainConfig.resolve(
        ["--verifier-name-or-path", "t", "--loss-implementation", side.LOSS_IMPLEMENTATION]
    )
    assert eager.loss.loss_implementation == "eager"
    # speculators' own defaults differ where the comparison means something
    defaults = TrainConfig.resolve(["--verifier-name-or-path", "t", "--data-path", "d"])
    assert side.train_arguments("defaults", config) == []
    assert (defaults.trainer.epochs, defaults.optimizer.optimizer) == (20, "muon")
    assert defaults.draft.draft_vocab_size is None  # the target's whole vocabulary
    with pytest.raises(ValueError, match="recipe"):
        side.train_arguments("other", config)


def test_the_last_epoch_is_the_draft(side, tmp_path):
    for epoch in ("0", "2", "10", "checkpoint_best"):
        (tmp_path / epoch).mkdir()
        (tmp_path / epoch / "config.json").write_text("{}")
    assert side.last_checkpoint(tmp_path).name == "10"
    (tmp_path / "11").mkdir()  # an epoch still being written
    with pytest.raises(FileNotFoundError, match="no finished epoch"):
        side.last_checkpoint(tmp_path)


def test_server_command_is_speculators_launch(side, tmp_path):
    """The launch settings of speculators' scripts/launch_vllm.py: extract_hidden_states with the
    capture layers, the connector writing to disk."""
    command = side.server_command(
        tmp_path / "target",
        tmp_path / "hs",
        [2, 15, 27, 30],
        8999,
        {"max_model_len": 448, "gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": None},
    )
    speculative = json.loads(command[command.index("--speculative-config") + 1])
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert speculative["method"] == "extract_hidden_states"
    layers = speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert layers == [2, 15, 27, 30]
    assert transfer["kv_connector"] == "ExampleHiddenStatesConnector"
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "hs")
    assert "--kv-cache-memory-bytes" not in command
    assert "--trust-remote-code" not in command


def test_a_server_that_cannot_start_says_why(side, tmp_path):
    command = side.server_command(
        tmp_path / "no-such-model",
        tmp_path / "hs",
        [1, 2],
        8998,
        {"max_model_len": 64, "gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 1 << 25},
    )
    with (
        pytest.raises(RuntimeError, match="did not start"),
        side.vllm_server(command, 8998, tmp_path / "server.log"),
    ):
        pass


def test_speculators_renders_the_tokens_draftflow_trains_on(side, tiny_pipeline, tmp_path):
    """vLLM (CPU build) serving as speculators launches it, ``speculators prepare-data``
    rendering the tiny workflow's train conversations through it: every row it makes is a
    prefix of one of draftflow's samples (the same tokens), and it trains on draftflow's
    tokens plus the newline after each assistant turn's end token."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from draftflow.capture.layers import capture_layers
    from draftflow.engine_settings import engine_settings

    stages = side.Stages(tiny_pipeline, tmp_path / "side", 8997, 1, TINY_CONFIG)
    assert stages.ks == [int(k) for k in stages.config["bench"]["num_speculative_tokens"]]
    assert side.Stages(tiny_pipeline, tmp_path / "k3", 8997, 1, TINY_CONFIG, [3]).ks == [3]
    stages.conversations()
    seq_length = stages.config["tokenize"]["max_length"]
    assert side.server_context(stages.target, seq_length) == 8192  # SmolLM2's own context
    # One conversation longer than --seq-length: the renderer must take it, prepare-data cut it.
    long_answer = " ".join(["The answer goes on and on."] * (seq_length // 2))
    with (tmp_path / "side" / "conversations.jsonl").open("a", encoding="utf-8") as handle:
        messages = [
            {"role": "user", "content": "Tell me a long story."},
            {"role": "assistant", "content": long_answer},
        ]
        handle.write(json.dumps({"id": "long", "conversations": messages}) + "\n")
    extract = engine_settings(stages.config, "extract")
    command = side.server_command(
        stages.target,
        tmp_path / "hs",
        capture_layers(stages.target, stages.config["extract"]["aux_layers"]).layer_ids,
        8997,
        {
            # Above the long conversation; the target's whole 8,192 would not fit the tiny KV cache.
            "max_model_len": 8 * seq_length,
            "gpu_memory_utilization": extract.gpu_memory_utilization,
            "kv_cache_memory_bytes": extract.kv_cache_memory_bytes,
        },
    )
    data = tmp_path / "side" / "data"
    env = side.server_env(extract)  # as the data stage starts it
    with side.vllm_server(command, 8997, tmp_path / "server.log", env) as url:
        side.speculators_cli(
            "prepare-data",
            "--model", str(stages.target),
            "--data", str(tmp_path / "side" / "conversations.jsonl"),
            "--render-endpoint", url,
            "--output", str(data),
            "--seq-length", str(stages.config["tokenize"]["max_length"]),
            "--num-preprocessing-workers", "1",
            log_path=tmp_path / "prepare-data.log",
        )  # fmt: skip
    rows = load_from_disk(str(data)).with_format("python")
    samples = pq.read_table(tiny_pipeline / "results/split/train.parquet").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(stages.target)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(rows) >= len(samples) + 1  # one row per assistant turn
    extra = 0
    unmatched = []
    for row in rows:
        ids, mask = list(row["input_ids"]), [int(m) for m in row["loss_mask"]]
        sample = next((s for s in samples if list(s["input_ids"][: len(ids)]) == ids), None)
        if sample is None:
            unmatched.append(row)
            continue
        for position, masked in enumerate(mask):
            if masked and not sample["loss_mask"][position]:
                assert ids[position - 1] == end and [ids[position]] == newline, position
                extra += 1
    assert extra > 0  # the newline after <|im_end|>: the one place the two masks differ
    # The long conversation: rendered whole, cut at --seq-length, its answer trained on.
    assert len(unmatched) == 1 and len(unmatched[0]["input_ids"]) == seq_length
    assert sum(int(m) for m in unmatched[0]["loss_mask"]) > seq_length // 2


def test_side_by_side_pairs_each_size_with_its_recipes(side, tmp_path):
    """The comparison takes τ at one k from the curve's point and from each recipe's bench, and
    skips sizes without a side."""

    def rows(*taus):
        return [{"k": k, "acceptance_length": tau} for k, tau in enumerate(taus, start=1)]

    points = [
        {
            "workdir": "640",
            "train_tokens": 100,
            "gpu_seconds": {"train": 5.0},
            "bench": {"mtbench": rows(1.2, 1.3, 1.4), "humaneval": rows(1.1, 1.2, 1.3)},
        },
        {"workdir": "1280", "train_tokens": 200, "gpu_seconds": {}, "bench": {}},
    ]
    summary = {
        "stage_seconds": {"data": 9.0},
        "recipes": {
            "defaults": {"bench": {"mtbench": [{"k": 3, "acceptance_length": 1.5}]}},
            "draftflow": {"bench": {"mtbench": [{"k": 3, "acceptance_length": 1.35}]}},
        },
    }
    (tmp_path / "640").mkdir()
    (tmp_path / "640" / "summary.json").write_text(json.dumps(summary))
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"points": points}))
    out = tmp_path / "side-by-side.json"
    side.main(
        ["compare", "--curve", str(curve), "--summaries", str(tmp_path / "640" / "summary.json"),
         "--out", str(out), "--plot", str(tmp_path / "side.png")]
    )  # fmt: skip
    assert (tmp_path / "side.png").stat().st_size > 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["workdir"] == "640" and row["k"] == 3
    assert row["tau"] == {
        "draftflow": {"mtbench": 1.4, "humaneval": 1.3},
        "speculators-defaults": {"mtbench": 1.5},
        "speculators-draftflow": {"mtbench": 1.35},
    }
    assert row["seconds"] == {"draftflow": {"train": 5.0}, "speculators": {"data": 9.0}}
    (tmp_path / "x").mkdir()  # a side whose size the curve does not hold
    (tmp_path / "x" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match="no curve point"):
        side.main(
            ["compare", "--curve", str(curve), "--summaries", str(tmp_path / "x" / "summary.json"),
             "--out", str(out)]
        )  # fmt: skip
