"""What a chat template leaves out of a conversation, found by rendering and counted.

Held-out shapes of tool-calling and reasoning corpora: a call SmolLM2's template does not render
although the text names its function, a DeepSeek-V3-style template that concatenates arguments
as text (``'```json\\n' + arguments``) and splits answers at ``</think>``, a template that fails
on one conversation with a TypeError, an answer quoting ``<think>...</think>`` mid-text under a
Qwen3-style template. The Qwen3 template runs twice: with its tags as single tokens (as Qwen's
tokenizer has them) and with SmolLM2's tokenizer unmodified, which splits every tag into
several tokens. Templates live in tests/data/templates/; tokenizers are built from the local
SmolLM2 checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mask_support import masked_runs

from draftflow.corpus.toolcalls import ARGUMENTS_AS_OBJECT, ARGUMENTS_AS_STRING
from draftflow.data.masks import ChatTemplateMasker
from draftflow.data.split import SplitSettings
from draftflow.data.tokenize import TokenizeSettings, tokenize_corpus

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN3_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
DEEPSEEK_SPECIALS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def calculator_call(expression: str, call_id: str = "call_1") -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": expression}},
    }


# The function's name is in the turn's text: a name search would call the call rendered.
NAMED_CALL = [
    {"role": "user", "content": "What is 17 * 23?"},
    {
        "role": "assistant",
        "content": "I will use the calculator.",
        "tool_calls": [calculator_call("17 * 23")],
    },
    {"role": "tool", "content": "391", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "17 * 23 = 391."},
]
THINK_QUOTE = "Write it as <think>your notes</think> in the prompt."
# The quoting answer last (Qwen3 writes an empty think block before it) and before a later turn.
THINK_IN_ANSWER = [
    {"role": "user", "content": "How do I mark hidden notes for the model?"},
    {"role": "assistant", "content": THINK_QUOTE},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "You are welcome."},
]
THINK_IN_LAST_ANSWER = THINK_IN_ANSWER[:2]


def tokenizer_with(smollm2_dir: Path, template: str, added=(), special=(), bos=None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    if added:
        tokenizer.add_tokens(list(added))
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    if bos:
        tokenizer.bos_token = bos
    return tokenizer


@pytest.fixture(scope="module")
def qwen3_tags_whole(smollm2_dir: Path):
    return tokenizer_with(smollm2_dir, "qwen3.jinja", added=QWEN3_TOKENS)


@pytest.fixture(scope="module")
def qwen3_tags_split(smollm2_dir: Path):
    """The tags as an unmodified tokenizer reads them: several tokens each."""
    tokenizer = tokenizer_with(smollm2_dir, "qwen3.jinja")
    assert len(tokenizer("</think>", add_special_tokens=False)["input_ids"]) > 1
    assert len(tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]) > 1
    return tokenizer


@pytest.fixture(scope="module")
def deepseek(smollm2_dir: Path):
    return tokenizer_with(
        smollm2_dir, "deepseek_v3.jinja", special=DEEPSEEK_SPECIALS, bos="<｜begin▁of▁sentence｜>"
    )


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path):
    return tokenizer_with(smollm2_dir, "smollm2.jinja")


def masked_texts(tokenizer, messages, tools=None) -> list[str]:
    """The masked runs of a conversation, decoded (the mask lies over the template's tokens)."""
    masker = ChatTemplateMasker(tokenizer)
    encoded = masker.encode(messages, tools=tools)
    reference = tokenizer.apply_chat_template(
        masker.template_messages(messages), tools=tools, tokenize=True
    )
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert encoded.input_ids == list(reference)
    runs = masked_runs(encoded.input_ids, encoded.loss_mask)
    return [tokenizer.decode(run, skip_special_tokens=False).strip() for run in runs]


# ------------------------------------------------------------------ unrendered calls


def test_a_call_named_in_the_text_but_not_rendered_is_detected(smollm2, qwen3_tags_split):
    encoded = ChatTemplateMasker(smollm2).encode(NAMED_CALL, tools=[CALCULATOR_TOOL])
    assert encoded.unrendered_tool_calls == 1
    # a template that renders it (tags split into several tokens): not counted, and trained
    encoded = ChatTemplateMasker(qwen3_tags_split).encode(NAMED_CALL, tools=[CALCULATOR_TOOL])
    assert encoded.unrendered_tool_calls == 0
    assert masked_texts(qwen3_tags_split, NAMED_CALL, [CALCULATOR_TOOL])[0] == (
        "I will use the calculator.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>'
    )


def test_one_unrendered_call_of_a_parallel_turn_is_detected(smollm2_dir, qwen3_tags_whole):
    """Of two calls, a template that renders the first only: the turn is counted."""
    tokenizer = tokenizer_with(smollm2_dir, "qwen3.jinja", added=QWEN3_TOKENS)
    first_only = tokenizer.chat_template.replace(
        "{%- for tool_call in message.tool_calls %}",
        "{%- for tool_call in message.tool_calls[:1] %}",
    )
    assert first_only != tokenizer.chat_template
    tokenizer.chat_template = first_only
    messages = [
        NAMED_CALL[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [calculator_call("17 * 23", "a"), calculator_call("17 * 24", "b")],
        },
        {"role": "tool", "content": "391", "tool_call_id": "a"},
        {"role": "tool", "content": "408", "tool_call_id": "b"},
        {"role": "assistant", "content": "391 and 408."},
    ]
    assert ChatTemplateMasker(tokenizer).encode(messages).unrendered_tool_calls == 1
    assert ChatTemplateMasker(qwen3_tags_whole).encode(messages).unrendered_tool_calls == 0


# ------------------------------------------------------------------ argument encoding


def test_argument_encoding_follows_the_template(deepseek, qwen3_tags_whole, smollm2):
    assert ChatTemplateMasker(qwen3_tags_whole).arguments_as == ARGUMENTS_AS_OBJECT
    assert ChatTemplateMasker(deepseek).arguments_as == ARGUMENTS_AS_STRING
    assert ChatTemplateMasker(smollm2).arguments_as == ARGUMENTS_AS_OBJECT  # renders no calls
    # Given a dict, the DeepSeek-V3-style template fails the way issue 39 saw it.
    with pytest.raises(TypeError, match="can only concatenate str"):
        deepseek.apply_chat_template(NAMED_CALL, tokenize=False)
    got = masked_texts(deepseek, NAMED_CALL, [CALCULATOR_TOOL])
    assert got == [
        "I will use the calculator.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'calculator\n```json\n{"expression": "17 * 23"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "17 * 23 = 391.<｜end▁of▁sentence｜>",
    ]
    assert "391<" not in "".join(got)  # the tool result is not trained


def test_regenerate_prompts_use_the_templates_argument_encoding(deepseek, qwen3_tags_whole):
    from draftflow.corpus.regenerate import template_arguments_as
    from draftflow.corpus.toolcalls import template_message

    assert template_arguments_as(qwen3_tags_whole, {}) == ARGUMENTS_AS_OBJECT
    arguments_as = template_arguments_as(deepseek, {})
    assert arguments_as == ARGUMENTS_AS_STRING
    prompt = deepseek.apply_chat_template(
        [template_message(m, arguments_as) for m in NAMED_CALL[:3]],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert '```json\n{"expression": "17 * 23"}\n```' in prompt


def test_a_template_carrying_state_across_turns_gets_each_turn(deepseek):
    """DeepSeek-V3's template writes a second call turn without its header and text (its
    ``is_first`` flag is never reset): each turn's span stops where the turn does, and the
    dropped text is counted."""
    messages = [
        {"role": "user", "content": "17 * 23, then add 9?"},
        {
            "role": "assistant",
            "content": "Multiplying.",
            "tool_calls": [calculator_call("17 * 23")],
        },
        {"role": "tool", "content": "391", "tool_call_id": "call_1"},
        {
            "role": "assistant",
            "content": "Adding.",
            "tool_calls": [calculator_call("391 + 9", "call_2")],
        },
        {"role": "tool", "content": "400", "tool_call_id": "call_2"},
        {"role": "assistant", "content": "400.", "reasoning_content": "391 + 9 = 400."},
    ]
    call = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
    end = "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    assert masked_texts(deepseek, messages, [CALCULATOR_TOOL]) == [
        f'Multiplying.<｜tool▁calls▁begin｜>{call}{{"expression": "17 * 23"}}{end}',
        f'{call}{{"expression": "391 + 9"}}{end}',
        "400.<｜end▁of▁sentence｜>",
    ]
    encoded = ChatTemplateMasker(deepseek).encode(messages, tools=[CALCULATOR_TOOL])
    assert encoded.unrendered_answers == 1  # "Adding."
    assert encoded.unrendered_reasoning == 1  # the template renders no reasoning
    assert encoded.unrendered_tool_calls == 0


# ------------------------------------------------------------------ <think> inside an answer


@pytest.mark.parametrize("tokenizer_name", ["qwen3_tags_whole", "qwen3_tags_split"])
def test_an_answer_quoting_think_tags_is_trained_whole(tokenizer_name, request):
    tokenizer = request.getfixturevalue(tokenizer_name)
    assert masked_texts(tokenizer, THINK_IN_ANSWER) == [
        THINK_QUOTE + "<|im_end|>",
        "You are welcome.<|im_end|>",
    ]
    # As the last turn the template writes its empty think block first (scaffolding, unmasked).
    assert masked_texts(tokenizer, THINK_IN_LAST_ANSWER) == [THINK_QUOTE + "<|im_end|>"]
    encoded = ChatTemplateMasker(tokenizer).encode(THINK_IN_LAST_ANSWER)
    assert encoded.unrendered_answers == 0 and encoded.unrendered_think_answers == 0


def test_a_template_that_cuts_answers_at_think_is_counted(deepseek):
    encoded = ChatTemplateMasker(deepseek).encode(THINK_IN_ANSWER)
    assert encoded.unrendered_answers == 1 and encoded.unrendered_think_answers == 1


# ------------------------------------------------------------------ tokenize_corpus


def tokenize(tmp_path: Path, tokenizer, name: str, records: list[dict]) -> tuple[dict, list]:
    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    target = tmp_path / name
    tokenizer.save_pretrained(target)
    summary = tokenize_corpus(
        corpus,
        target,
        tmp_path / f"{name}.parquet",
        tmp_path / f"{name}.safetensors",
        tmp_path / f"{name}.json",
        TokenizeSettings(  # every field named: the settings classes have no defaults
            max_length=1024,
            long_samples="truncate",
            max_turns=None,
            split=SplitSettings(seed=0, val_fraction=0.0, test_fraction=0.0),
            enable_thinking=None,
        ),
        trust_remote_code=False,  # a tokenizer saved here: no code of its own
    )
    assert json.loads((tmp_path / f"{name}.json").read_text()) == summary
    return summary, pq.read_table(tmp_path / f"{name}.parquet").column("id").to_pylist()


BROKEN_NAME = {
    "id": "name-is-a-number",
    "source": "t",
    "messages": [
        NAMED_CALL[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": 7, "arguments": {"expression": "1"}}}
            ],
        },
        NAMED_CALL[2],
        NAMED_CALL[3],
    ],
}


def test_tokenize_skips_and_names_what_a_template_cannot_render(
    tmp_path: Path, deepseek, smollm2, qwen3_tags_split
) -> None:
    records = [
        {"id": "named-call", "source": "t", "messages": NAMED_CALL, "tools": [CALCULATOR_TOOL]},
        {"id": "think-quote", "source": "t", "messages": THINK_IN_ANSWER},
        BROKEN_NAME,  # the DeepSeek-V3-style template raises TypeError on it
        {"id": "plain", "source": "t", "messages": THINK_IN_ANSWER[2:]},
    ]
    # DeepSeek-V3 style: string arguments, the TypeError conversation skipped by id, the answer
    # it would cut at </think> skipped and counted; the stage goes on.
    summary, ids = tokenize(tmp_path, deepseek, "deepseek", records)
    assert ids == ["named-call", "plain"]
    assert summary["tool_call_arguments_as"] == "string"
    assert summary["skipped_template_error"] == 1
    assert [e["id"] for e in summary["template_errors"]] == ["name-is-a-number"]
    assert summary["template_errors"][0]["error"].startswith("TypeError: can only concatenate")
    assert summary["skipped_answer_cut_at_think_tag"] == 1
    assert summary["skipped_tool_calls_not_rendered"] == 0

    # SmolLM2: no call is rendered, though one turn's text names it: both skipped, counted.
    summary, ids = tokenize(tmp_path, smollm2, "smollm2", records)
    assert ids == ["think-quote", "plain"]
    assert summary["skipped_tool_calls_not_rendered"] == 2
    assert summary["skipped_answer_cut_at_think_tag"] == 0

    # Qwen3 style, tags split into several tokens: everything renders; the quote is whole.
    summary, ids = tokenize(tmp_path, qwen3_tags_split, "qwen3", records)
    assert summary["skipped_template_error"] == 0 and summary["template_errors"] == []
    assert summary["skipped_tool_calls_not_rendered"] == 0
    assert summary["skipped_answer_cut_at_think_tag"] == 0
    assert ids == ["named-call", "think-quote", "name-is-a-number", "plain"]
