"""Loss masks of tool-using and reasoning conversations, for real chat templates.

The templates under tests/data/templates/ are written in the style of the models' own (Qwen3
with tools and <think>, Llama 3.1 with JSON tool calls, SmolLM2's ChatML); the tokenizer is
SmolLM2's, given the special tokens each family has. Every masked run is decoded and compared
with the text the target writes in that turn, spelled out by hand from the template.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from config_support import demo_config, split_settings, tokenize_settings
from mask_support import masked_runs

from draftflow.data.masks import ChatTemplateMasker
from draftflow.data.tokenize import tokenize_corpus

TEMPLATES = Path(__file__).parent / "data" / "templates"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def call(name: str, arguments: dict, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"})]},
    {"role": "tool", "content": '{"temp_c": 18}', "tool_call_id": "call_1"},
    {"role": "assistant", "content": "It is 18 °C in Paris."},
]
PARALLEL = [
    {"role": "user", "content": "Weather in Rome and Oslo?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [
            call("get_weather", {"city": "Rome"}, "a"),
            call("get_weather", {"city": "Oslo"}, "b"),
        ],
    },
    {"role": "tool", "content": "21 C", "tool_call_id": "a"},
    {"role": "tool", "content": "3 C", "tool_call_id": "b"},
    {"role": "assistant", "content": "Rome 21 °C, Oslo 3 °C."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]
# reasoning on both turns: Qwen3 renders it only after the last user query
REASONING_TWO_TURNS = [
    {"role": "user", "content": "Is 91 prime?"},
    {"role": "assistant", "content": "No, 7 × 13.", "reasoning_content": "91 = 7 * 13."},
    {"role": "user", "content": "Is 97 prime?"},
    {"role": "assistant", "content": "Yes.", "reasoning_content": "No divisor up to 9."},
]
# an agentic step: reasoning, a call, its result, more reasoning, the answer
AGENT_STEP = [
    {"role": "user", "content": "Weather in Lima?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the weather tool.",
        "tool_calls": [call("get_weather", {"city": "Lima"})],
    },
    {"role": "tool", "content": "19 C", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "19 °C in Lima.", "reasoning_content": "The tool said 19."},
]

QWEN3_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
QWEN3_TOOL_HEADER_END = "</tool_call><|im_end|>\n"
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def load(smollm2_dir: Path, template: str, added: list[str], special: list[str]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    tokenizer.add_tokens(added)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


@pytest.fixture(scope="module")
def qwen3(smollm2_dir: Path):
    return load(smollm2_dir, "qwen3.jinja", QWEN3_TOKENS, [])


@pytest.fixture(scope="module")
def llama31(smollm2_dir: Path):
    tokenizer = load(smollm2_dir, "llama3.1.jinja", [], LLAMA_SPECIALS)
    tokenizer.bos_token = "<|begin_of_text|>"
    return tokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path):
    return load(smollm2_dir, "smollm2.jinja", [], [])


def masked_texts(tokenizer, messages, tools=None, **template_kwargs) -> list[str]:
    masker = ChatTemplateMasker(tokenizer, template_kwargs)
    encoded = masker.encode(messages, tools=tools)
    # the mask lies over the template's own tokenization
    reference = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, **template_kwargs
    )
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert encoded.input_ids == list(reference)
    runs = masked_runs(encoded.input_ids, encoded.loss_mask)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def assert_runs(got: list[str], want: list[str]) -> None:
    """Equal, but a run may start with whitespace BPE merged from the header (it is predicted)."""
    assert len(got) == len(want), (got, want)
    for text, expected in zip(got, want, strict=True):
        extra = text[: len(text) - len(expected)]
        assert text.endswith(expected) and (extra == "" or extra.isspace()), (text, expected)


def test_smollm2_template_file_is_the_tokenizers_own(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    own = config.get("chat_template") or (smollm2_dir / "chat_template.jinja").read_text()
    assert (TEMPLATES / "smollm2.jinja").read_text() == own


# ------------------------------------------------------------------ Qwen3


def test_qwen3_tool_calls_masked_tool_results_not(qwen3) -> None:
    got = masked_texts(qwen3, WEATHER, tools=[WEATHER_TOOL])
    assert_runs(
        got,
        [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            # the empty think block the template writes on the last turn is scaffolding
            "It is 18 °C in Paris.<|im_end|>",
        ],
    )
    assert not any("temp_c" in text or "# Tools" in text for text in got)


def test_qwen3_parallel_calls_and_later_turns(qwen3) -> None:
    got = masked_texts(qwen3, PARALLEL, tools=[WEATHER_TOOL])
    assert_runs(
        got,
        [
            "Checking both.\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            "<|im_end|>",
            "Rome 21 °C, Oslo 3 °C.<|im_end|>",
            "You are welcome.<|im_end|>",
        ],
    )


def test_qwen3_reasoning_masked_where_the_template_renders_it(qwen3) -> None:
    got = masked_texts(qwen3, REASONING_TWO_TURNS)
    assert_runs(
        got,
        [
            "No, 7 × 13.<|im_end|>",  # before the last user query: the template drops it
            "<think>\nNo divisor up to 9.\n</think>\n\nYes.<|im_end|>",
        ],
    )
    got = masked_texts(qwen3, AGENT_STEP, tools=[WEATHER_TOOL])
    assert_runs(
        got,
        [
            "<think>\nI need the weather tool.\n</think>\n\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
            "<|im_end|>",
            "<think>\nThe tool said 19.\n</think>\n\n19 °C in Lima.<|im_end|>",
        ],
    )


def test_qwen3_thinking_off_starts_after_the_prefilled_think_block(qwen3) -> None:
    messages = [WEATHER[1], {"role": "assistant", "content": "Sunny."}]
    assert_runs(masked_texts(qwen3, messages, enable_thinking=False), ["Sunny.<|im_end|>"])
    # a turn with reasoning still gets it masked whatever the switch
    assert_runs(
        masked_texts(qwen3, REASONING_TWO_TURNS[2:], enable_thinking=False),
        ["<think>\nNo divisor up to 9.\n</think>\n\nYes.<|im_end|>"],
    )


# ------------------------------------------------------------------ Llama 3.1


def test_llama31_json_tool_call_masked(llama31) -> None:
    got = masked_texts(llama31, WEATHER, tools=[WEATHER_TOOL])
    assert_runs(
        got,
        [
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
            "It is 18 °C in Paris.<|eot_id|>",
        ],
    )


def test_llama31_refuses_parallel_calls(llama31) -> None:
    with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
        ChatTemplateMasker(llama31).encode(PARALLEL, tools=[WEATHER_TOOL])


# ------------------------------------------------------------------ SmolLM2 (ChatML, no tools)


def test_smollm2_drops_tool_calls_and_reasoning(smollm2) -> None:
    masker = ChatTemplateMasker(smollm2)
    encoded = masker.encode(WEATHER, tools=[WEATHER_TOOL])
    assert encoded.unrendered_tool_calls == 1
    assert_runs(
        masked_texts(smollm2, WEATHER, tools=[WEATHER_TOOL]),
        ["<|im_end|>", "It is 18 °C in Paris.<|im_end|>"],
    )
    # reasoning is not rendered by this template, so it is not in the mask either
    assert_runs(
        masked_texts(smollm2, REASONING_TWO_TURNS), ["No, 7 × 13.<|im_end|>", "Yes.<|im_end|>"]
    )


# ------------------------------------------------------------------ tokenize_corpus


def test_tokenize_passes_tools_and_skips_turns_a_template_drops(
    tmp_path: Path, qwen3, smollm2
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    records = [
        {"id": "weather", "source": "t", "messages": WEATHER, "tools": [WEATHER_TOOL]},
        {"id": "reasoning", "source": "t", "messages": REASONING_TWO_TURNS},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    for name, tokenizer in (("qwen3", qwen3), ("smollm2", smollm2)):
        target = tmp_path / name
        tokenizer.save_pretrained(target)
        summary = tokenize_corpus(
            corpus,
            target,
            tmp_path / f"{name}.parquet",
            tmp_path / f"{name}.safetensors",
            tmp_path / f"{name}.json",
            tokenize_settings(max_length=1024, split=split_settings(val_fraction=0.0)),
            trust_remote_code=demo_config()["target"]["trust_remote_code"],
        )
        if name == "qwen3":
            assert summary["samples"] == 2
            assert summary["tool_call_turns"] == 1
            assert summary["skipped_tool_calls_not_rendered"] == 0
        else:
            assert summary["samples"] == 1
            assert summary["skipped_tool_calls_not_rendered"] == 1
