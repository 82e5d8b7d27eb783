"""Loss masks: decode every masked span and compare it with the assistant's text + end of turn."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from config_support import demo_config, split_settings, tokenize_settings
from mask_support import masked_runs
from safetensors.numpy import load_file

from draftflow.data.masks import ChatTemplateMasker, mask_from_spans
from draftflow.data.split import assign_split
from draftflow.data.tokenize import limit_turns, tokenize_corpus

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>"]
GEMMA_SPECIALS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]

# Meta's Llama-3 template (bos, role headers, trimmed content, <|eot_id|> after every turn).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Gemma-like: the assistant is called "model", and a system message is refused.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Qwen3-like: the last assistant turn gets an empty think block that earlier turns don't,
# so rendering is not prefix-stable and the masker must fall back to searching.
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "You are a helpful assistant. What is the capital of France? Paris is the capital.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0123456789 and punctuation !?.,;:'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]

CONVERSATIONS = {
    "single": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
    ],
    "multi_turn_with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Now write code.\n"},
        {"role": "assistant", "content": "  def add(a, b):\n    return a + b\n"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "assistant"},
    ],
    "assistant_first": [
        {"role": "assistant", "content": "Hi, I start."},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "Bye"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "1"},
        {"role": "user", "content": "Two?"},
        {"role": "assistant", "content": "2, then 3."},
    ],
}


def build_local_tokenizer(specials: list[str], template: str, bos: str | None, eos: str):
    """A small byte-level BPE trained in-test, wrapped like a hub tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TRAINING_TEXT * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def llama3_tokenizer():
    return build_local_tokenizer(
        LLAMA3_SPECIALS, LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>"
    )


@pytest.fixture(scope="module")
def gemma_tokenizer():
    return build_local_tokenizer(GEMMA_SPECIALS, GEMMA_TEMPLATE, "<bos>", "<eos>")


@pytest.fixture(scope="module")
def think_tokenizer():
    return build_local_tokenizer(CHATML_SPECIALS, THINK_TEMPLATE, None, "<|im_end|>")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def check_masks(tokenizer, messages, end_of_turn: str, trims: bool) -> None:
    """Every masked run decodes to one assistant message as rendered, plus the end of turn.

    ``trims``: the template strips message content (Llama-3) or copies it verbatim (ChatML).
    A masked run may start with extra whitespace only where BPE merged the header's last
    whitespace with the content's first character into one token (it must be predicted).
    """
    encoded = ChatTemplateMasker(tokenizer).encode(messages)
    # Same tokens as the template's own tokenization: the mask is laid over the real input.
    assert encoded.input_ids == template_ids(tokenizer, messages)
    decoded = [
        tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for run in masked_runs(encoded.input_ids, encoded.loss_mask)
    ]
    expected = [
        (m["content"].strip() if trims else m["content"]) + end_of_turn
        for m in messages
        if m["role"] == "assistant"
    ]
    assert len(decoded) == len(expected)
    for got, want in zip(decoded, expected, strict=True):
        extra = got[: len(got) - len(want)]
        assert got.endswith(want) and (extra == "" or extra.isspace()), (got, want)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_llama3_masks_cover_exactly_assistant_text_and_eot(llama3_tokenizer, name):
    check_masks(llama3_tokenizer, CONVERSATIONS[name], "<|eot_id|>", trims=True)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_masks_cover_exactly_assistant_text_and_im_end(smollm2_tokenizer, name):
    check_masks(smollm2_tokenizer, CONVERSATIONS[name], "<|im_end|>", trims=False)


def test_smollm2_default_system_prompt_stays_unmasked(smollm2_tokenizer):
    messages = CONVERSATIONS["multi_turn_no_system"]
    masker = ChatTemplateMasker(smollm2_tokenizer)
    text, spans = masker.assistant_spans(messages)
    default_prompt = text.find("You are a helpful AI assistant named SmolLM")
    assert default_prompt != -1, "the SmolLM2 template should add its default system prompt"
    assert all(start > default_prompt for start, _ in spans)
    encoded = masker.encode(messages)
    first_masked = encoded.loss_mask.index(1)
    header = smollm2_tokenizer.decode(encoded.input_ids[:first_masked])
    assert header.endswith("<|im_start|>assistant\n")
    # Nothing after the last <|im_end|> is masked (ChatML's trailing newline is scaffolding).
    last_masked = len(encoded.loss_mask) - 1 - encoded.loss_mask[::-1].index(1)
    assert smollm2_tokenizer.convert_ids_to_tokens(encoded.input_ids[last_masked]) == "<|im_end|>"


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_gemma_masks_cover_exactly_model_text_and_end_of_turn(gemma_tokenizer, name):
    messages = [m for m in CONVERSATIONS[name] if m["role"] != "system"]
    check_masks(gemma_tokenizer, messages, "<end_of_turn>", trims=True)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_non_prefix_stable_template_falls_back_to_search(think_tokenizer, name):
    messages = [m for m in CONVERSATIONS[name] if m["role"] != "system"]
    check_masks(think_tokenizer, messages, "<|im_end|>", trims=False)
    encoded = ChatTemplateMasker(think_tokenizer).encode(messages)
    text = think_tokenizer.decode(
        [t for t, m in zip(encoded.input_ids, encoded.loss_mask, strict=True) if m]
    )
    assert "<think>" not in text


def test_cut_encoding_equals_full_encoding_cut(smollm2_tokenizer):
    """Long texts are tokenized only up to a prefix: the first tokens must not change."""
    words = [f"word{i % 97} {'é' * (i % 3)}, (x={i})." for i in range(800)]
    messages = [
        {"role": "user", "content": " ".join(words[:200])},
        {"role": "assistant", "content": "\n".join(words[200:500])},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "  ".join(words[500:])},
    ]
    masker = ChatTemplateMasker(smollm2_tokenizer)
    whole = masker.encode(messages)
    assert len(whole.input_ids) > 3000
    for limit in (16, 100, 700, 2000, len(whole.input_ids), len(whole.input_ids) + 5):
        cut = masker.encode(messages, max_tokens=limit)
        assert cut.truncated == (len(whole.input_ids) > limit)
        assert cut.input_ids == whole.input_ids[:limit]
        assert cut.loss_mask == whole.loss_mask[:limit]


def test_mask_from_spans_overlap_rules():
    offsets = [(0, 3), (3, 5), (5, 5), (5, 9), (9, 12)]
    assert mask_from_spans(offsets, [(4, 9)]) == [0, 1, 1, 1, 0]
    assert mask_from_spans(offsets, []) == [0, 0, 0, 0, 0]


def test_limit_turns_keeps_answered_turns_only():
    messages = CONVERSATIONS["multi_turn_with_system"] + [{"role": "user", "content": "?"}]
    assert limit_turns(messages, None) == CONVERSATIONS["multi_turn_with_system"]
    assert limit_turns(messages, 1) == CONVERSATIONS["multi_turn_with_system"][:3]
    assert limit_turns([{"role": "user", "content": "hi"}], None) == []


# ---------------------------------------------------------------- tokenize_corpus end to end
@pytest.fixture
def llama3_target(tmp_path: Path, llama3_tokenizer) -> Path:
    target = tmp_path / "target"
    llama3_tokenizer.save_pretrained(target)
    # The model's embedding table is padded beyond the tokenizer: token_freq follows the larger.
    (target / "config.json").write_text(json.dumps({"vocab_size": len(llama3_tokenizer) + 12}))
    return target


def write_corpus(path: Path, count: int) -> list[dict]:
    records = []
    for index in range(count):
        answer = " ".join(["the quick brown fox"] * (1 + index % 7))
        records.append(
            {
                "id": f"test-{index:04d}",
                "source": "test",
                "messages": [
                    {"role": "user", "content": f"Question number {index}?"},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "More?"},
                    {"role": "assistant", "content": "No more."},
                ],
            }
        )
    question = {"role": "user", "content": "Why? " * 60}
    records.append(
        {
            "id": "test-long-question",
            "source": "test",
            "messages": [question, {"role": "assistant", "content": "Because."}],
        }
    )
    records.append({"id": "test-unanswered", "source": "test", "messages": [question]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    write_corpus(path, 40)
    return path


def run_tokenize(out: Path, corpus: Path, target: Path, **settings) -> tuple[dict, pa.Table, dict]:
    summary = tokenize_corpus(
        corpus,
        target,
        out / "samples.parquet",
        out / "token_freq.safetensors",
        out / "summary.json",
        # The demo's settings, but long enough that no sample here is cut unless a test says so.
        tokenize_settings(**{"max_length": 2048, **settings}),
        trust_remote_code=demo_config()["target"]["trust_remote_code"],
    )
    table = pq.read_table(out / "samples.parquet")
    freq = load_file(str(out / "token_freq.safetensors"))
    return summary, table, freq


def test_tokenize_corpus_writes_contract_files(tmp_path, corpus, llama3_target, llama3_tokenizer):
    summary, table, freq = run_tokenize(
        tmp_path / "out", corpus, llama3_target, split=split_settings(val_fraction=0.3)
    )
    assert table.column_names == ["id", "input_ids", "loss_mask", "num_tokens", "num_masked"]
    assert table.schema.field("input_ids").type.value_type == pa.int32()
    assert table.schema.field("loss_mask").type.value_type == pa.int8()
    assert (
        table.schema.field("num_tokens").type == table.schema.field("num_masked").type == pa.int32()
    )
    assert summary["samples"] == table.num_rows == 41
    assert summary["skipped_no_assistant"] == 1
    rows = table.to_pylist()
    for row in rows:
        assert row["num_tokens"] == len(row["input_ids"]) == len(row["loss_mask"])
        assert row["num_masked"] == sum(row["loss_mask"])
    # token_freq: int64 [vocab], counts over masked tokens of train samples only.
    counts = freq["token_freq"]
    assert counts.dtype.name == "int64"
    assert counts.shape == (len(llama3_tokenizer) + 12,)
    expected = [0] * counts.shape[0]
    train = [r for r in rows if assign_split(r["id"], 0, 0.3, 0.0) == "train"]
    assert 0 < len(train) < len(rows)
    for row in train:
        for token, bit in zip(row["input_ids"], row["loss_mask"], strict=True):
            expected[token] += bit
    assert counts.tolist() == expected
    assert summary["train_masked_tokens"] == sum(expected)


def test_tokenize_truncates_long_samples(tmp_path, corpus, llama3_target):
    _, full, _ = run_tokenize(tmp_path / "full", corpus, llama3_target, max_length=4096)
    limit = 40
    summary, short, _ = run_tokenize(tmp_path / "short", corpus, llama3_target, max_length=limit)
    long_rows = sum(1 for n in full["num_tokens"].to_pylist() if n > limit)
    assert long_rows > 0
    assert summary["truncated"] == long_rows
    # The long question fills the whole budget: no assistant token survives, so it is skipped.
    assert summary["skipped_no_masked_tokens"] == 1
    assert "test-long-question" not in short["id"].to_pylist()
    assert max(short["num_tokens"].to_pylist()) <= limit
    by_id = {r["id"]: r for r in full.to_pylist()}
    for row in short.to_pylist():
        whole = by_id[row["id"]]
        assert row["input_ids"] == whole["input_ids"][: row["num_tokens"]]
        assert row["loss_mask"] == whole["loss_mask"][: row["num_tokens"]]


def test_tokenize_drops_long_samples(tmp_path, corpus, llama3_target):
    _, full, _ = run_tokenize(tmp_path / "full", corpus, llama3_target, max_length=4096)
    lengths = full["num_tokens"].to_pylist()
    limit = sorted(lengths)[len(lengths) // 2]
    summary, kept, _ = run_tokenize(
        tmp_path / "drop", corpus, llama3_target, max_length=limit, long_samples="drop"
    )
    assert summary["dropped_long"] == sum(1 for n in lengths if n > limit) > 0
    assert kept.num_rows == sum(1 for n in lengths if n <= limit)
    assert kept["num_tokens"].to_pylist() == [n for n in lengths if n <= limit]


def test_tokenize_fails_clearly_when_nothing_is_left(tmp_path, corpus, llama3_target):
    # So short that only the user's question fits: no sample has an assistant token.
    with pytest.raises(ValueError, match="no conversation produced a sample"):
        run_tokenize(tmp_path / "tiny", corpus, llama3_target, max_length=8)


def test_tokenize_counts_conversations_the_template_refuses(tmp_path, corpus, gemma_tokenizer):
    target = tmp_path / "gemma"
    gemma_tokenizer.save_pretrained(target)
    records = corpus.read_text().splitlines()
    refused = json.loads(records[0])
    refused["messages"].insert(0, {"role": "system", "content": "Be brief."})
    corpus.write_text("\n".join([json.dumps(refused), *records[1:]]) + "\n")
    summary, table, _ = run_tokenize(tmp_path / "out", corpus, target)
    assert summary["skipped_template_error"] == 1
    assert refused["id"] not in table["id"].to_pylist()
    assert summary["samples"] == table.num_rows == 40


def test_tokenize_settings_reject_unknown_policy():
    with pytest.raises(ValueError, match="long_samples = 'cut'"):
        tokenize_settings(long_samples="cut")
