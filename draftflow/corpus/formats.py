"""Record layouts of chat corpora (ShareGPT, OpenAI messages) and their normalisation.

A parsed record becomes a list of ``{"role": "system|user|assistant", "content": str}`` messages
(the conversation schema in docs/design.md). Anything that cannot be read that way raises
:class:`BadRecord` with a reason from :data:`BAD_RECORD_REASONS`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, TypedDict

FORMATS = ("auto", "sharegpt", "openai")
Format = Literal["auto", "sharegpt", "openai"]

# Role spellings seen in ShareGPT dumps and OpenAI-style files, mapped to the three we keep.
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
}

# Reasons a record is *bad* (written to the rejects file; `on_bad_record: fail` stops on them).
INVALID_JSON = "invalid_json"
BAD_UTF8 = "bad_utf8"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
BAD_RECORD_REASONS = (
    INVALID_JSON,
    BAD_UTF8,
    MISSING_FIELD,
    WRONG_TYPE,
    UNKNOWN_ROLE,
    NON_STRING_CONTENT,
)


class Message(TypedDict):
    role: str
    content: str


class Conversation(TypedDict):
    id: str
    source: str
    messages: list[Message]


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


def parse_record(record: Any, fmt: Format) -> tuple[str | None, str, list[Message]]:
    """Return (the source's own id or None, the detected layout, normalised messages).

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
        role = ROLE_ALIASES.get(raw_role.strip().lower())
        if role is None:
            raise BadRecord(
                UNKNOWN_ROLE,
                f"{where}.{role_field} = {raw_role[:40]!r}; known: {', '.join(sorted(ROLE_ALIASES))}",
            )
        content = turn[content_field]
        if not isinstance(content, str):
            raise BadRecord(
                NON_STRING_CONTENT,
                f"{where}.{content_field} is a {type(content).__name__}, not a string",
            )
        if not is_encodable(content):
            raise BadRecord(
                BAD_UTF8, f"{where}.{content_field} has a lone surrogate (\\ud800-\\udfff)"
            )
        messages.append({"role": role, "content": content})

    source_id = record.get("id")
    if source_id is not None and (
        isinstance(source_id, bool) or not isinstance(source_id, str | int)
    ):
        raise BadRecord(
            WRONG_TYPE, f"'id' is a {type(source_id).__name__}, not a string or integer"
        )
    if isinstance(source_id, str) and not is_encodable(source_id):
        raise BadRecord(BAD_UTF8, "'id' has a lone surrogate")
    return (None if source_id is None else str(source_id)), layout, messages


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
    has many, from split conversations). Content is otherwise kept verbatim.
    """
    kept = [message for message in messages if message["content"].strip()]
    first_user = next((i for i, m in enumerate(kept) if m["role"] == "user"), len(kept))
    return [m for i, m in enumerate(kept) if i >= first_user or m["role"] != "assistant"]


def content_hash(messages: list[Message]) -> str:
    """sha1 of the normalised messages: equal conversations hash equal whatever their source."""
    canonical = json.dumps(
        [[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":")
    )
    return hashlib.sha1(canonical.encode("utf-8")).hexdigest()


def conversation_id(source: str, source_id: str | None, messages: list[Message]) -> str:
    """Stable id: the source name plus a hash of the source's own id, else of the content."""
    digest = (
        hashlib.sha1(source_id.encode("utf-8")).hexdigest()
        if source_id is not None
        else content_hash(messages)
    )
    return f"{source}-{digest[:16]}"


def subset_rank(seed: int, conversation_id: str) -> int:
    """Rank of a conversation in the deterministic subset: lowest ranks are kept first.

    A pure function of (seed, id), so a larger subset is always a superset of a smaller one.
    """
    digest = hashlib.sha256(f"subset:{seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")
