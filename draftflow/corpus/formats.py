"""Record layouts of chat corpora (ShareGPT, OpenAI messages) and their normalisation.

A parsed record becomes a list of messages in the conversation schema of docs/design.md:
``{"role": "system|user|assistant|tool", "content": str}``, assistant messages optionally with
``tool_calls`` and ``reasoning_content``, tool messages optionally with ``tool_call_id`` and
``name``, plus the conversation's ``tools`` (function schemas). Anything that cannot be read that
way raises :class:`BadRecord` with a reason from :data:`BAD_RECORD_REASONS`.

Tool use is read in these layouts:

- OpenAI messages: assistant ``tool_calls`` (``content`` may then be null), the legacy
  ``function_call``, ``tool`` (and legacy ``function``) messages, a record-level ``tools`` list;
- ShareGPT with LLaMA-Factory's function-call turns (its glaive and ToolACE conversions):
  ``from: function_call`` (a JSON call or list of calls) and ``from: observation`` (the result),
  record-level ``system`` and ``tools`` (a JSON string or a list);
- ShareGPT in Hermes' style (hermes-function-calling, ToolACE): ``from: tool`` results, and
  ``<tool_call>{json}</tool_call>`` blocks in ``gpt`` turns, read as tool calls (a block that is
  not a JSON call leaves the turn as text); ``<tool_response>`` wrappers are removed.

Reasoning is kept from ``reasoning_content`` (or ``reasoning``) fields, or from a
``<think>...</think>`` block opening an assistant's text, and stored as ``reasoning_content``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, NotRequired, TypedDict

from draftflow.corpus.toolcalls import (
    normalise_function_call_value,
    normalise_tool_calls,
    normalise_tools,
    parse_tool_calls,
    split_reasoning,
    strip_tool_response,
)

FORMATS = ("auto", "sharegpt", "openai")
Format = Literal["auto", "sharegpt", "openai"]

# Role spellings seen in ShareGPT dumps and OpenAI-style files, mapped to the four we keep.
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",  # OpenAI's legacy function-result role
    "observation": "tool",  # LLaMA-Factory
}
# ShareGPT turns that are an assistant's tool call, their value the call itself (LLaMA-Factory).
FUNCTION_CALL_ROLES = ("function_call",)

# Reasons a record is *bad* (written to the rejects file; `on_bad_record: fail` stops on them).
INVALID_JSON = "invalid_json"
BAD_UTF8 = "bad_utf8"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
BAD_TOOL_CALL = "bad_tool_call"
BAD_RECORD_REASONS = (
    INVALID_JSON,
    BAD_UTF8,
    MISSING_FIELD,
    WRONG_TYPE,
    UNKNOWN_ROLE,
    NON_STRING_CONTENT,
    BAD_TOOL_CALL,
)


class Message(TypedDict):
    role: str
    content: str
    tool_calls: NotRequired[list[dict[str, Any]]]
    reasoning_content: NotRequired[str]
    tool_call_id: NotRequired[str]
    name: NotRequired[str]


class Conversation(TypedDict):
    id: str
    source: str
    messages: list[Message]
    tools: NotRequired[list[dict[str, Any]]]


class BadRecord(Exception):
    """A record that cannot be read as a conversation; ``reason`` is one of BAD_RECORD_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def detect_format(record: dict[str, Any]) -> Literal["sharegpt", "openai"]:
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        return "openai"
    raise BadRecord(
        MISSING_FIELD,
        f"neither 'conversations' (ShareGPT) nor 'messages' (OpenAI) in a record with keys "
        f"{sorted(record)[:10]}",
    )


# Field names per layout: (list field, role field, content field).
_FIELDS = {
    "sharegpt": ("conversations", "from", "value"),
    "openai": ("messages", "role", "content"),
}


def parse_record(
    record: Any, fmt: Format
) -> tuple[str | None, str, list[Message], list[dict[str, Any]]]:
    """Return (the source's own id or None, the detected layout, normalised messages, tools).

    Raises BadRecord for a wrong layout; does not judge the conversation (see clean_messages).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown corpus format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if not isinstance(record, dict):
        raise BadRecord(WRONG_TYPE, f"record is a JSON {type(record).__name__}, not an object")
    layout = detect_format(record) if fmt == "auto" else fmt
    list_field, role_field, content_field = _FIELDS[layout]
    if list_field not in record:
        raise BadRecord(MISSING_FIELD, f"no {list_field!r} field ({layout} format)")
    turns = record[list_field]
    if not isinstance(turns, list):
        raise BadRecord(WRONG_TYPE, f"{list_field!r} is a {type(turns).__name__}, not a list")

    messages: list[Message] = []
    system = record.get("system") if layout == "sharegpt" else None
    if system is not None:  # LLaMA-Factory keeps the system prompt beside the turns
        if not isinstance(system, str):
            raise BadRecord(NON_STRING_CONTENT, f"'system' is a {type(system).__name__}")
        messages.append({"role": "system", "content": _text(system, "system")})
    for number, turn in enumerate(turns):
        where = f"{list_field}[{number}]"
        if not isinstance(turn, dict):
            raise BadRecord(WRONG_TYPE, f"{where} is a {type(turn).__name__}, not an object")
        for field in (role_field, content_field):
            if field not in turn:
                raise BadRecord(MISSING_FIELD, f"{where} has no {field!r}")
        raw_role = turn[role_field]
        if not isinstance(raw_role, str):
            raise BadRecord(WRONG_TYPE, f"{where}.{role_field} is a {type(raw_role).__name__}")
        if layout == "sharegpt":
            messages.append(_sharegpt_message(turn, raw_role.strip().lower(), where))
        else:
            messages.append(_openai_message(turn, raw_role.strip().lower(), where))

    tools: list[dict[str, Any]] = []
    if record.get("tools") is not None:
        try:
            tools = normalise_tools(record["tools"])
        except ValueError as error:
            raise BadRecord(BAD_TOOL_CALL, f"'tools': {error}") from None
        _check_encodable(json.dumps(tools, ensure_ascii=False), "tools")

    source_id = record.get("id")
    if source_id is not None and (
        isinstance(source_id, bool) or not isinstance(source_id, str | int)
    ):
        raise BadRecord(
            WRONG_TYPE, f"'id' is a {type(source_id).__name__}, not a string or integer"
        )
    if isinstance(source_id, str) and not is_encodable(source_id):
        raise BadRecord(BAD_UTF8, "'id' has a lone surrogate")
    return (None if source_id is None else str(source_id)), layout, messages, tools


def _role(raw_role: str, where: str) -> str:
    role = ROLE_ALIASES.get(raw_role)
    if role is None:
        known = sorted([*ROLE_ALIASES, *FUNCTION_CALL_ROLES])
        raise BadRecord(UNKNOWN_ROLE, f"{where} = {raw_role[:40]!r}; known: {', '.join(known)}")
    return role


def _text(content: Any, where: str) -> str:
    if not isinstance(content, str):
        raise BadRecord(NON_STRING_CONTENT, f"{where} is a {type(content).__name__}, not a string")
    _check_encodable(content, where)
    return content


def _check_encodable(text: str, where: str) -> None:
    if not is_encodable(text):
        raise BadRecord(BAD_UTF8, f"{where} has a lone surrogate (\\ud800-\\udfff)")


def _tool_calls(raw: Any, where: str, function_call_turn: bool = False) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` (a list, nothing else), or a ShareGPT ``function_call`` turn's value
    (one call or a list, as JSON text or parsed); a bad call is named by its index."""
    try:
        calls = (
            normalise_function_call_value(raw) if function_call_turn else normalise_tool_calls(raw)
        )
    except ValueError as error:
        detail = str(error)
        separator = "" if detail.startswith("[") else ": " if function_call_turn else " "
        raise BadRecord(BAD_TOOL_CALL, f"{where}{separator}{detail}") from None
    _check_encodable(json.dumps(calls, ensure_ascii=False), where)
    return calls


def _with_reasoning(message: Message, reasoning: Any, where: str) -> Message:
    """Reasoning from a field, else from a ``<think>`` block opening the text."""
    if reasoning is None:
        reasoning, message["content"] = split_reasoning(message["content"])
    if reasoning is not None:
        message["reasoning_content"] = _text(reasoning, where)
    return message


def _openai_message(turn: dict[str, Any], raw_role: str, where: str) -> Message:
    role = _role(raw_role, f"{where}.role")
    content = turn["content"]
    calls = turn.get("tool_calls")
    if calls == []:  # OpenAI dumps write an empty list for "no calls"
        calls = None
    if calls is None and turn.get("function_call") is not None:
        calls = [turn["function_call"]]
    if calls is not None and role != "assistant":
        raise BadRecord(BAD_TOOL_CALL, f"{where}: tool calls on a {role!r} message")
    if content is None and calls is not None:  # a turn that only calls tools
        content = ""
    message: Message = {"role": role, "content": _text(content, f"{where}.content")}
    if calls is not None:
        message["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if role == "assistant":
        reasoning = turn.get("reasoning_content", turn.get("reasoning"))
        return _with_reasoning(message, reasoning, f"{where}.reasoning_content")
    if role == "tool":
        for field in ("tool_call_id", "name"):
            if turn.get(field) is not None:
                message[field] = _text(turn[field], f"{where}.{field}")
    return message


def _sharegpt_message(turn: dict[str, Any], raw_role: str, where: str) -> Message:
    value = turn["value"]
    if raw_role in FUNCTION_CALL_ROLES:
        if not isinstance(value, str | dict | list):
            raise BadRecord(BAD_TOOL_CALL, f"{where}.value is a {type(value).__name__}")
        calls = _tool_calls(value, where, function_call_turn=True)
        return {"role": "assistant", "content": "", "tool_calls": calls}
    role = _role(raw_role, f"{where}.from")
    message: Message = {"role": role, "content": _text(value, f"{where}.value")}
    if role == "tool":
        message["content"] = strip_tool_response(message["content"])
    elif role == "assistant":
        message = _with_reasoning(message, None, f"{where}.value")
        parsed = parse_tool_calls(message["content"], "hermes")
        if parsed.tool_calls:
            message["content"] = parsed.content
            message["tool_calls"] = parsed.tool_calls
    return message


# Why a conversation's tool results do not answer its calls (ingest drops such conversations:
# a result without its call renders as a second user turn, and an answer reading it is
# trained on data the conversation does not show).
TOOL_RESULT_WITHOUT_CALL = "tool_result_without_call"
TOOL_CALL_ID_UNMATCHED = "tool_call_id_unmatched"


def tool_result_problem(messages: list[Message]) -> str | None:
    """None when every tool result answers an assistant turn right before it; else the reason.

    The turn may call in its text (ToolACE's ``[f(x=1)]``, kept as text); where it has
    structured calls, there are no more results than calls, and a ``tool_call_id`` names one of
    them (where the calls carry ids). A ``tool_call_id`` after a turn without calls names none.
    """
    caller: Message | None = None
    results = 0
    for message in messages:
        if message["role"] != "tool":
            caller = message if message["role"] == "assistant" else None
            results = 0
            continue
        if caller is None:
            return TOOL_RESULT_WITHOUT_CALL
        calls = caller.get("tool_calls") or []
        results += 1
        if calls and results > len(calls):
            return TOOL_RESULT_WITHOUT_CALL
        call_id = message.get("tool_call_id")
        ids = {call["id"] for call in calls if "id" in call}
        if call_id and (not calls or (ids and call_id not in ids)):
            return TOOL_CALL_ID_UNMATCHED
    return None


def is_encodable(text: str) -> bool:
    """False for text holding surrogates: undecodable bytes (read with surrogateescape) or lone
    ``\\udXXX`` escapes. Such text cannot be written back as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def clean_messages(messages: list[Message]) -> list[Message]:
    """Drop turns that carry nothing and assistant turns before the first user turn.

    Empty (whitespace-only) turns teach the draft nothing and break role alternation in chat
    templates; a leading assistant turn answers a question the corpus does not show (ShareGPT
    has many, from split conversations). An assistant turn with tool calls or reasoning is not
    empty, nor is a tool result (an empty result still answers its call). Content is otherwise
    kept verbatim.
    """
    kept = [message for message in messages if _carries_something(message)]
    first_user = next((i for i, m in enumerate(kept) if m["role"] == "user"), len(kept))
    return [m for i, m in enumerate(kept) if i >= first_user or m["role"] != "assistant"]


def _carries_something(message: Message) -> bool:
    return bool(
        message["content"].strip()
        or message.get("tool_calls")
        or message.get("reasoning_content", "").strip()
        or message["role"] == "tool"
    )


def content_hash(messages: list[Message], tools: list[dict[str, Any]] | None = None) -> str:
    """sha1 of the normalised messages: equal conversations hash equal whatever their source.

    Plain messages hash as [role, content] (so the ids of plain corpora stay as they were); the
    fields of tool use and reasoning, and the tools, are added only where present.
    """
    rows: list[Any] = []
    for m in messages:
        extra = {key: value for key, value in m.items() if key not in ("role", "content")}
        rows.append([m["role"], m["content"], extra] if extra else [m["role"], m["content"]])
    if tools:
        rows.append(["tools", tools])
    canonical = json.dumps(rows, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha1(canonical.encode("utf-8")).hexdigest()


def conversation_id(
    source: str,
    source_id: str | None,
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Stable id: the source name plus a hash of the source's own id, else of the content."""
    digest = (
        hashlib.sha1(source_id.encode("utf-8")).hexdigest()
        if source_id is not None
        else content_hash(messages, tools)
    )
    return f"{source}-{digest[:16]}"


def subset_rank(seed: int, conversation_id: str) -> int:
    """Rank of a conversation in the deterministic subset: lowest ranks are kept first.

    A pure function of (seed, id), so a larger subset is always a superset of a smaller one.
    """
    digest = hashlib.sha256(f"subset:{seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")
