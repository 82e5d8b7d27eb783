"""Tool calls and reasoning in conversations: their normal form, and reading them out of text.

The normal form is what Hugging Face chat templates expect (transformers' chat-template docs):

- a tool call: ``{"type": "function", "function": {"name": str, "arguments": dict}}``, plus
  ``"id"`` when the source gave one (arguments are stored as an object; most templates
  ``tojson`` them, and a string would be quoted twice. Templates that concatenate them as text,
  DeepSeek-V3's ``'```json\n' + arguments``, get the JSON string instead: the encoding a template
  wants is found once by rendering a probe call both ways, see :func:`arguments_encoding`);
- a tool (function schema) of a conversation's ``tools`` list:
  ``{"type": "function", "function": {"name": str, ...}}``;
- reasoning: an assistant message's ``reasoning_content`` string.

Functions here raise ``ValueError`` with a short reason; ``formats`` turns it into a bad record.
Parsing generated text never raises: what cannot be read stays plain text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Tool-call syntaxes a target may write, by template family.
HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen, Hermes, ChatML)
LLAMA3_JSON = "llama3_json"  # the whole answer is {"name": ..., "parameters": {...}} (Llama 3.1+)
TOOL_CALL_PARSERS = ("auto", HERMES, LLAMA3_JSON, "none")

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"\A\s*<tool_response>(.*)</tool_response>\s*\Z", re.DOTALL)


def _parsed(raw: Any, what: str) -> Any:
    """``raw``, or the JSON it holds when it is a string (``what`` names it in the error)."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{what} {'are' if what.endswith('s') else 'is'} not JSON ({error.msg})"
        ) from None


def _json_object(raw: Any, what: str) -> dict[str, Any]:
    """``raw`` (or the JSON string of it) as a dict, else a ValueError naming ``what``."""
    raw = _parsed(raw, what)
    if not isinstance(raw, dict):
        verb = "are" if what.endswith("s") else "is"
        raise ValueError(f"{what} {verb} a {type(raw).__name__}, not an object")
    return raw


def _arguments(raw: Any) -> dict[str, Any]:
    if raw is None or raw == "":
        return {}
    return _json_object(raw, "arguments")


def normalise_tool_call(raw: Any) -> dict[str, Any]:
    """One tool call in normal form, from the OpenAI shape or the flat ``{name, arguments}`` one
    (ShareGPT ``function_call`` turns, Hermes ``<tool_call>`` blocks; ``parameters`` is Llama's
    spelling of ``arguments``)."""
    raw = _json_object(raw, "tool call")
    function = raw.get("function", raw)
    if not isinstance(function, dict):
        raise ValueError(f"tool call 'function' is a {type(function).__name__}, not an object")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError("tool call has no function name")
    arguments = function.get("arguments", function.get("parameters"))
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": name, "arguments": _arguments(arguments)},
    }
    call_id = raw.get("id")
    if call_id is not None:
        if not isinstance(call_id, str | int) or isinstance(call_id, bool):
            raise ValueError(f"tool call id is a {type(call_id).__name__}")
        call["id"] = str(call_id)
    return call


def normalise_tool_calls(raw: Any) -> list[dict[str, Any]]:
    """An OpenAI ``tool_calls`` list; each bad call is named by its index (``[2]: ...``)."""
    if not isinstance(raw, list):
        raise ValueError(f"is a {type(raw).__name__}, not a list")
    if not raw:
        raise ValueError("is an empty list")
    calls = []
    for index, call in enumerate(raw):
        try:
            calls.append(normalise_tool_call(call))
        except ValueError as error:
            raise ValueError(f"[{index}]: {error}") from None
    return calls


def normalise_function_call_value(raw: Any) -> list[dict[str, Any]]:
    """LLaMA-Factory's ``function_call`` turn value: one call or a list, as JSON or parsed."""
    raw = _parsed(raw, "tool calls")
    return normalise_tool_calls(raw if isinstance(raw, list) else [raw])


def normalise_tools(raw: Any) -> list[dict[str, Any]]:
    """A conversation's function schemas (a JSON string of a list, as LLaMA-Factory writes it,
    or a list; flat ``{name, description, parameters}`` entries are wrapped)."""
    if isinstance(raw, str):
        if not raw.strip():
            return []
        raw = _parsed(raw, "tools")
    if not isinstance(raw, list):
        raise ValueError(f"tools are a {type(raw).__name__}, not a list")
    tools = []
    for number, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{number}] is a {type(tool).__name__}, not an object")
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{number}] has no function name")
        tools.append({"type": "function", "function": function})
    return tools


def split_reasoning(text: str, generated: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a text that opens with a ``<think>...</think>`` block.

    ``generated``: the text is the target's output, whose opening tag may be missing (some
    templates write ``<think>`` into the generation prompt, so the answer starts inside it).
    """
    if "</think>" not in text:
        return None, text
    head, answer = text.split("</think>", 1)
    stripped = head.lstrip()
    if not stripped.startswith("<think>") and ("<think>" in head or not generated):
        return None, text  # a think tag inside an answer is the answer's own text
    reasoning = stripped.removeprefix("<think>")
    return reasoning.strip("\n"), answer.lstrip("\n")


def strip_tool_response(text: str) -> str:
    """A tool result without Hermes' ``<tool_response>`` wrapper (templates add their own)."""
    match = _TOOL_RESPONSE.match(text)
    return match.group(1).strip("\n") if match else text


@dataclass
class ParsedAnswer:
    """An answer read as the target wrote it: text, tool calls, and reasoning."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None
    # True when the text looked like a tool call but could not be read as one (kept as text)
    unparsed: bool = False


def detect_parser(chat_template: str) -> str:
    """The tool-call syntax a chat template teaches its model, or "none"."""
    if "<tool_call>" in chat_template:
        return HERMES
    if '"parameters": ' in chat_template and "<|eot_id|>" in chat_template:
        return LLAMA3_JSON
    return "none"


def parse_tool_calls(text: str, parser: str) -> ParsedAnswer:
    """Tool calls out of generated text in the given syntax; text that is not one stays text."""
    if parser == HERMES:
        return _parse_hermes(text)
    if parser == LLAMA3_JSON:
        return _parse_llama3_json(text)
    if parser == "none":
        return ParsedAnswer(content=text)
    raise ValueError(f"unknown tool-call parser {parser!r}; allowed: {TOOL_CALL_PARSERS}")


def _parse_hermes(text: str) -> ParsedAnswer:
    if "<tool_call>" not in text:
        return ParsedAnswer(content=text)
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            calls.append(normalise_tool_call(block.strip()))
        except ValueError:
            return ParsedAnswer(content=text, unparsed=True)
    remainder = _HERMES_BLOCK.sub("", text)
    if "<tool_call>" in remainder or not calls:  # an unclosed block: cut off by max_tokens
        return ParsedAnswer(content=text, unparsed=True)
    return ParsedAnswer(content=remainder.strip(), tool_calls=calls)


def _parse_llama3_json(text: str) -> ParsedAnswer:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedAnswer(content=text)
    try:
        call = normalise_tool_call(body)
    except ValueError:
        return ParsedAnswer(content=text, unparsed=True)
    return ParsedAnswer(content="", tool_calls=[call])


def same_calls(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> bool:
    """Same functions with the same arguments, in the same order (ids do not matter)."""
    return [c["function"] for c in first] == [c["function"] for c in second]


ARGUMENTS_AS_OBJECT = "object"
ARGUMENTS_AS_STRING = "string"
# The probe's arguments as a template that renders them as JSON writes them (tojson, or the
# string verbatim); a string a template quoted again has ``\"`` and does not match.
_PROBE_ARGUMENTS = {"draftflow_probe": "probe value"}
_PROBE_RENDERED = re.compile(r'(?<!\\)"draftflow_probe"\s*:\s*"probe value"')


def arguments_encoding(render: Callable[[list[dict[str, Any]]], str]) -> str:
    """How a chat template wants tool-call arguments: ``"object"`` or ``"string"`` (JSON).

    ``render`` renders template-form messages. A probe conversation with one call is rendered
    both ways; the first way that renders the arguments as JSON wins (an object first: the
    Hugging Face convention). A template that renders neither (no tool support) gets objects.
    """
    call = {"id": "probe_1", "type": "function"}
    call["function"] = {"name": "probe_function", "arguments": _PROBE_ARGUMENTS}
    probe = [
        {"role": "user", "content": "probe question"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "probe result", "tool_call_id": "probe_1"},
        {"role": "assistant", "content": "probe answer"},
    ]
    for encoding in (ARGUMENTS_AS_OBJECT, ARGUMENTS_AS_STRING):
        try:
            text = render([template_message(m, encoding) for m in probe])
        except Exception:  # a template may fail in any way on the wrong encoding
            continue
        if _PROBE_RENDERED.search(text):
            return encoding
    return ARGUMENTS_AS_OBJECT


def template_message(
    message: Mapping[str, Any], arguments_as: str = ARGUMENTS_AS_OBJECT
) -> dict[str, Any]:
    """The message as templates read it: only the fields it has (Llama 3.1 tests
    ``'tool_calls' in message``), content always a string, arguments encoded as ``arguments_as``.

    An assistant answer holding ``</think>`` without reasoning gets an explicit empty
    ``reasoning_content``: Qwen3-style templates otherwise split the answer at that tag and drop
    the text before it.
    """
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    for key in ("tool_calls", "reasoning_content", "tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    if arguments_as == ARGUMENTS_AS_STRING and "tool_calls" in out:
        out["tool_calls"] = [_with_string_arguments(call) for call in out["tool_calls"]]
    if out["role"] == "assistant" and "</think>" in out["content"]:
        out.setdefault("reasoning_content", "")
    return out


def _with_string_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {**call, "function": {**function, "arguments": arguments}}
