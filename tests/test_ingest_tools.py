"""ingest of tool use and reasoning: OpenAI tool calls, ShareGPT function-call variants, bad shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow.corpus.formats import BadRecord, content_hash, parse_record
from draftflow.corpus.ingest import ingest
from draftflow.corpus.toolcalls import parse_tool_calls, split_reasoning

DATA = Path(__file__).parent / "data" / "corpus"
# 12 records: 7 usable (tool calls, parallel calls, reasoning, legacy function_call), 5 bad
TOOLS_OPENAI = DATA / "tools_openai.jsonl"
# 6 records: LLaMA-Factory, Hermes and ToolACE styles, a broken Hermes block; 2 bad
TOOLS_SHAREGPT = DATA / "tools_sharegpt.json"


def run(tmp_path: Path, *sources: tuple[str, Path]) -> tuple[dict[str, dict], list[dict], dict]:
    out = tmp_path / "out"
    summary = ingest(
        [{"name": name, "path": str(path), "format": "auto"} for name, path in sources],
        out / "ingested.jsonl",
        out / "rejects.jsonl",
        out / "summary.json",
        max_conversations=None,
        seed=0,
        on_bad_record="skip",
    )
    lines = (out / "ingested.jsonl").read_text().splitlines()
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    by_first_user = {}
    for conversation in map(json.loads, lines):
        first_user = next(m for m in conversation["messages"] if m["role"] == "user")
        by_first_user[first_user["content"]] = conversation
    return by_first_user, rejects, summary


def call(name: str, arguments: dict, call_id: str | None = None) -> dict:
    normal = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return normal if call_id is None else {**normal, "id": call_id}


def test_openai_tool_calls_results_and_tools_are_kept(tmp_path: Path) -> None:
    got, _, summary = run(tmp_path, ("oa", TOOLS_OPENAI))
    weather = got["What is the weather in Paris?"]
    assert weather["messages"] == [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        # content null -> "", the call in the normal form templates expect
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"}, "call_1")]},
        {"role": "tool", "content": '{"temp_c": 18, "sky": "cloudy"}', "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is 18 °C and cloudy in Paris."},
    ]  # fmt: skip
    assert [t["function"]["name"] for t in weather["tools"]] == ["get_weather"]

    parallel = got["What time is it in Tokyo and in Lima?"]["messages"]
    assert [m["role"] for m in parallel] == [
        "user", "assistant", "tool", "tool", "assistant", "user", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert parallel[1]["content"] == "Let me check both."
    assert [c["id"] for c in parallel[1]["tool_calls"]] == ["call_a", "call_b"]
    assert [m.get("tool_call_id") for m in parallel[2:4]] == ["call_a", "call_b"]

    # arguments given as a JSON string (the OpenAI wire format) become an object; `reasoning`
    # is read like `reasoning_content`; a tool message keeps its function name
    books = got["Find two books by Ursula K. Le Guin."]["messages"]
    assert books[1]["tool_calls"] == [
        call("search_books", {"author": "Ursula K. Le Guin", "limit": 2}, "call_9")
    ]
    assert books[1]["reasoning_content"].startswith("The user wants two titles")
    assert books[2]["name"] == "search_books"

    legacy = got["Weather in Oslo, please."]["messages"]
    assert legacy[1]["tool_calls"] == [call("get_weather", {"city": "Oslo"})]
    assert legacy[2] == {"role": "tool", "content": '{"temp_c": 3, "sky": "snow"}', "name": "get_weather"}  # fmt: skip
    assert summary["sources"]["oa"]["kept"] == 7


def test_reasoning_is_kept_from_fields_and_think_tags(tmp_path: Path) -> None:
    got, _, _ = run(tmp_path, ("oa", TOOLS_OPENAI))
    assert got["Is 91 a prime number?"]["messages"][1] == {
        "role": "assistant",
        "content": "No. 91 = 7 × 13.",
        "reasoning_content": "91 = 7 * 13, so it has divisors other than 1 and itself.",
    }
    assert got["What is 17 + 25?"]["messages"][1] == {
        "role": "assistant",
        "content": "17 + 25 = 42.",
        "reasoning_content": "17 + 25: 17 + 20 = 37, plus 5 is 42.",
    }
    assert got["Name a primary colour."]["messages"][1] == {"role": "assistant", "content": "Red."}


def test_sharegpt_function_call_variants(tmp_path: Path) -> None:
    got, _, _ = run(tmp_path, ("sg", TOOLS_SHAREGPT))
    # LLaMA-Factory (glaive, ToolACE conversions): system and tools beside the turns
    tip = got["What tip should I leave on a $50 bill at 15%?"]
    assert tip["messages"] == [
        {"role": "system", "content": "You are a helpful assistant with access to functions."},
        {"role": "user", "content": "What tip should I leave on a $50 bill at 15%?"},
        {"role": "assistant", "content": "", "tool_calls": [call("calculate_tip", {"bill": 50, "percent": 15})]},
        {"role": "tool", "content": '{"tip": 7.5}'},
        {"role": "assistant", "content": "Leave a tip of $7.50."},
    ]  # fmt: skip
    assert tip["tools"][0]["function"]["name"] == "calculate_tip"
    assert tip["tools"][0]["type"] == "function"  # flat schemas are wrapped

    # Hermes: <tool_call> blocks become calls, <tool_response> wrappers go
    stock = got["What is Apple's stock price?"]["messages"]
    assert stock[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("get_stock_price", {"symbol": "AAPL"})],
    }
    assert stock[3] == {
        "role": "tool",
        "content": '{"name": "get_stock_price", "content": {"price": 190.1}}',
    }
    # ToolACE's Python-style calls are the model's text: kept verbatim
    oslo = got["How many people live in Oslo?"]["messages"]
    assert oslo[2] == {"role": "assistant", "content": '[get_population(city="Oslo")]'}
    assert oslo[3]["role"] == "tool"
    # a block that is not a JSON call stays text
    broken = got["Price of MSFT?"]["messages"][1]
    assert broken == {"role": "assistant", "content": "<tool_call>\nget_stock_price MSFT\n</tool_call>"}  # fmt: skip


def test_bad_tool_shapes_are_rejected_with_file_line_and_reason(tmp_path: Path) -> None:
    _, rejects, summary = run(tmp_path, ("oa", TOOLS_OPENAI), ("sg", TOOLS_SHAREGPT))
    found = {(r["source"], r["line"], r["reason"]) for r in rejects}
    assert found == {
        ("oa", 8, "bad_tool_call"),  # arguments are not JSON
        ("oa", 9, "non_string_content"),  # a tool result that is null
        ("oa", 10, "bad_tool_call"),  # tool calls on a user message
        ("oa", 11, "bad_tool_call"),  # a call without a function name
        ("oa", 12, "non_string_content"),  # content null and no tool call
        ("sg", 6, "bad_tool_call"),  # a function_call turn that is not JSON
        ("sg", 7, "unknown_role"),
    }
    assert {r["file"] for r in rejects if r["source"] == "sg"} == {str(TOOLS_SHAREGPT)}
    assert all(r["detail"] for r in rejects)
    assert summary["totals"]["dropped"]["bad_tool_call"] == 4
    assert summary["totals"]["kept"] == 7 + 4


def test_tool_fields_take_part_in_the_content_hash() -> None:
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    calling = [plain[0], {**plain[1], "tool_calls": [call("f", {})]}]
    assert content_hash(plain) != content_hash(calling)
    assert content_hash(calling) != content_hash(calling, [{"type": "function", "function": {"name": "f"}}])  # fmt: skip


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "non_string_content"),
        ({"messages": [], "tools": {"name": "f"}}, "bad_tool_call"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [1]}]}, "bad_tool_call"),
        ({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 1}]}, "non_string_content"),
    ],
)  # fmt: skip
def test_bad_tool_fields(record: dict, reason: str) -> None:
    with pytest.raises(BadRecord) as error:
        parse_record(record, "openai")
    assert error.value.reason == reason


def test_reasoning_split_only_when_the_block_opens_the_text() -> None:
    assert split_reasoning("<think>\nr\n</think>\n\na") == ("r", "a")
    assert split_reasoning("a <think>x</think> b") == (None, "a <think>x</think> b")
    assert split_reasoning("r</think>a") == (None, "r</think>a")
    # generated text may start inside the block the generation prompt opened
    assert split_reasoning("r\n</think>\n\na", generated=True) == ("r", "a")


def test_hermes_and_llama_tool_call_parsing() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    parsed = parse_tool_calls(text, "hermes")
    assert (parsed.content, parsed.tool_calls, parsed.unparsed) == ("Sure.", [call("f", {"x": 1})], False)  # fmt: skip
    cut = parse_tool_calls('<tool_call>\n{"name": "f", "argu', "hermes")
    assert (cut.content, cut.tool_calls, cut.unparsed) == ('<tool_call>\n{"name": "f", "argu', [], True)  # fmt: skip
    assert parse_tool_calls("no call here", "hermes").unparsed is False
    llama = parse_tool_calls('{"name": "f", "parameters": {"x": 1}}', "llama3_json")
    assert (llama.content, llama.tool_calls) == ("", [call("f", {"x": 1})])
    assert parse_tool_calls("{not json", "llama3_json").unparsed is True
    assert parse_tool_calls("Plain answer.", "llama3_json").tool_calls == []


# ------------------------------------------------------------------ issue 39: held-out shapes

CALC = {"type": "function", "function": {"name": "calculator", "arguments": {"expr": "2+2"}}}


def _openai(*messages: dict) -> dict:
    return {"messages": list(messages)}


USER = {"role": "user", "content": "What is 2+2?"}
ANSWER = {"role": "assistant", "content": "It is 4."}


def test_tool_results_are_checked_against_the_calls(tmp_path: Path) -> None:
    records = [
        # a good round: kept
        _openai(
            USER,
            {"role": "assistant", "content": None, "tool_calls": [{**CALC, "id": "call_1"}]},
            {"role": "tool", "content": "4", "tool_call_id": "call_1"},
            ANSWER,
        ),
        # tool_call_id naming no call
        _openai(
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": None, "tool_calls": [{**CALC, "id": "call_1"}]},
            {"role": "tool", "content": "6", "tool_call_id": "call_9"},
            {"role": "assistant", "content": "It is 6."},
        ),
        # a tool result before any call: user -> tool -> assistant
        _openai(
            {"role": "user", "content": "And 4+4?"},
            {"role": "tool", "content": "8"},
            {"role": "assistant", "content": "It is 8."},
        ),
        # two results for one call
        _openai(
            {"role": "user", "content": "And 5+5?"},
            {"role": "assistant", "content": "", "tool_calls": [CALC]},
            {"role": "tool", "content": "10"},
            {"role": "tool", "content": "10"},
            {"role": "assistant", "content": "It is 10."},
        ),
        # a tool_call_id after a turn that called in its text only
        _openai(
            {"role": "user", "content": "And 6+6?"},
            {"role": "assistant", "content": "calculator(6+6)"},
            {"role": "tool", "content": "12", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "It is 12."},
        ),
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    got, rejects, summary = run(tmp_path, ("oa", path))
    assert list(got) == ["What is 2+2?"]
    assert not rejects
    dropped = summary["totals"]["dropped"]
    assert dropped["tool_call_id_unmatched"] == 2
    assert dropped["tool_result_without_call"] == 2
    assert summary["totals"]["kept"] + summary["totals"]["dropped_total"] == len(records)


@pytest.mark.parametrize(
    ("tool_calls", "detail"),
    [
        (CALC, "messages[1].tool_calls is a dict, not a list"),
        (json.dumps([CALC]), "messages[1].tool_calls is a str, not a list"),
        (
            [CALC, CALC, {"type": "function", "function": {"arguments": {}}}],
            "messages[1].tool_calls[2]: tool call has no function name",
        ),
        (
            [CALC, {"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
            "messages[1].tool_calls[1]: arguments are not JSON",
        ),
    ],
)
def test_tool_calls_must_be_a_list_and_bad_calls_are_named_by_index(
    tmp_path: Path, tool_calls, detail: str
) -> None:
    record = _openai(USER, {"role": "assistant", "content": "", "tool_calls": tool_calls}, ANSWER)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    _, rejects, summary = run(tmp_path, ("oa", path))
    assert summary["totals"]["dropped"]["bad_tool_call"] == 1
    assert [r["reason"] for r in rejects] == ["bad_tool_call"]
    assert rejects[0]["detail"].startswith(detail), rejects[0]["detail"]


def test_unparsed_hermes_blocks_are_counted(tmp_path: Path) -> None:
    records = [
        {"conversations": [
            {"from": "human", "value": f"Price of {symbol}?"},
            {"from": "gpt", "value": f"<tool_call>\nget_stock_price {symbol}\n</tool_call>"},
        ]}
        for symbol in ("MSFT", "IBM", "SAP")
    ] + [
        {"conversations": [
            {"from": "human", "value": "Price of AAPL?"},
            {"from": "gpt", "value": '<tool_call>\n{"name": "p", "arguments": {}}\n</tool_call>'},
        ]}
    ]  # fmt: skip
    path = tmp_path / "hermes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    got, _, summary = run(tmp_path, ("sg", path))
    assert len(got) == 4
    assert summary["totals"]["kept_as_text"] == {"unparsed_tool_call_blocks": 3}
    assert summary["sources"]["sg"]["kept_as_text"] == {"unparsed_tool_call_blocks": 3}
    assert got["Price of AAPL?"]["messages"][1]["tool_calls"][0]["function"]["name"] == "p"
