"""Ingest: raw chat files -> one clean, deduplicated, deterministic conversation file.

For every record of every source, in order:

1. parse (formats.parse_record); a *bad record* (invalid JSON, bad UTF-8, missing field,
   wrong type, unknown role, non-string content, a tool call or tool list that cannot be read)
   goes to the rejects file with file, line and index, or stops the run when ``on_bad_record``
   is ``fail``;
2. clean (formats.clean_messages: empty turns and leading assistant turns removed), then drop
   ``empty`` (no turn left) and ``one_sided`` (no user or no assistant turn) conversations, and
   those whose tool results do not answer a call (formats.tool_result_problem):
   ``tool_result_without_call`` (a result with no assistant call right before it, or more
   results than calls) and ``tool_call_id_unmatched`` (a ``tool_call_id`` naming none of them);
3. drop ``duplicate`` (same normalised messages as an earlier conversation, any source) and
   ``duplicate_id`` (a source id seen before in the same source with other content);
4. keep the ``max_conversations`` with the lowest subset_rank(seed, id); the others are
   dropped as ``not_in_subset``.

The output is sorted by id. Every record read is counted exactly once: read == kept + dropped.
``kept_as_text`` counts what was read but kept as text: ``unparsed_tool_call_blocks``, assistant
turns holding a ``<tool_call>`` block that is not a JSON call.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from draftflow.config import from_section
from draftflow.corpus.formats import (
    BAD_RECORD_REASONS,
    FORMATS,
    TOOL_CALL_ID_UNMATCHED,
    TOOL_RESULT_WITHOUT_CALL,
    BadRecord,
    clean_messages,
    content_hash,
    conversation_id,
    parse_record,
    subset_rank,
    tool_result_problem,
)
from draftflow.corpus.sources import iter_records
from draftflow.io import atomic_path, atomic_write_json
from draftflow.resources import resolve_path

log = logging.getLogger(__name__)

EMPTY = "empty"
ONE_SIDED = "one_sided"
DUPLICATE = "duplicate"
DUPLICATE_ID = "duplicate_id"
NOT_IN_SUBSET = "not_in_subset"
FILTER_REASONS = (
    EMPTY,
    ONE_SIDED,
    TOOL_RESULT_WITHOUT_CALL,
    TOOL_CALL_ID_UNMATCHED,
    DUPLICATE,
    DUPLICATE_ID,
    NOT_IN_SUBSET,
)
UNPARSED_TOOL_CALL_BLOCKS = "unparsed_tool_call_blocks"
KEPT_AS_TEXT = (UNPARSED_TOOL_CALL_BLOCKS,)
DROP_REASONS = BAD_RECORD_REASONS + FILTER_REASONS
ON_BAD_RECORD = ("skip", "fail")


class IngestError(RuntimeError):
    """A bad record under ``on_bad_record: fail``; the message names file, line and reason."""


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    format: str

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(
                f"corpus source {self.name!r}: format {self.format!r} is not one of {', '.join(FORMATS)}"
            )


@dataclass
class SourceCounts:
    file: str
    format: str
    read: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    layouts: Counter[str] = field(default_factory=Counter)
    kept_as_text: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "format": self.format,
            "layouts_seen": dict(sorted(self.layouts.items())),
            "read": self.read,
            "kept": self.kept,
            "dropped": {reason: self.dropped[reason] for reason in DROP_REASONS},
            "dropped_total": sum(self.dropped.values()),
            "kept_as_text": {what: self.kept_as_text[what] for what in KEPT_AS_TEXT},
        }


@dataclass(order=True)
class _Spilled:
    """A kept conversation's place in the spill file (conversations stay on disk, not in RAM)."""

    rank: int
    id: str
    source: str = field(compare=False)
    offset: int = field(compare=False)
    length: int = field(compare=False)


def ingest(
    sources: Iterable[Source | Mapping[str, Any]],
    output: str | os.PathLike[str],
    rejects: str | os.PathLike[str],
    summary: str | os.PathLike[str],
    *,
    max_conversations: int | None,
    seed: int,
    on_bad_record: str,
) -> dict[str, Any]:
    """Run the ingest stage; write output, rejects and summary; return the summary.

    ``sources``: the config's ``corpus.sources`` entries; the rest its ``corpus:`` keys."""
    if on_bad_record not in ON_BAD_RECORD:
        raise ValueError(
            f"on_bad_record {on_bad_record!r} is not one of {', '.join(ON_BAD_RECORD)}"
        )
    if max_conversations is not None and max_conversations < 1:
        raise ValueError(f"max_conversations must be >= 1 or null, got {max_conversations!r}")
    source_list = [
        s if isinstance(s, Source) else from_section(Source, s, "corpus.sources") for s in sources
    ]
    names = [s.name for s in source_list]
    if len(set(names)) != len(names):
        raise ValueError(f"corpus source names must be unique, got {names}")

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    counts: dict[str, SourceCounts] = {}
    fd, spill_name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".spill", dir=output.parent)
    try:
        with os.fdopen(fd, "w+b") as spill, atomic_path(rejects) as rejects_tmp:
            with open(rejects_tmp, "w", encoding="utf-8") as rejects_file:
                kept = _read_sources(source_list, counts, spill, rejects_file, seed, on_bad_record)
            selected = _select_subset(kept, max_conversations, counts)
            _write_sorted(selected, spill, output)
    finally:
        Path(spill_name).unlink(missing_ok=True)

    result = _summary(counts, max_conversations, seed, on_bad_record)
    atomic_write_json(summary, result)
    totals = result["totals"]
    log.info(
        "ingest: read %d, kept %d, dropped %s",
        totals["read"],
        totals["kept"],
        {reason: n for reason, n in totals["dropped"].items() if n},
    )
    return result


def _read_sources(
    sources: list[Source],
    counts: dict[str, SourceCounts],
    spill: Any,
    rejects_file: Any,
    seed: int,
    on_bad_record: str,
) -> list[_Spilled]:
    seen_content: set[str] = set()
    seen_ids: set[str] = set()
    kept: list[_Spilled] = []
    for source in sources:
        path = resolve_path(source.path)
        if not path.is_file():
            raise FileNotFoundError(f"corpus source {source.name!r}: {path} is not a file")
        tally = counts[source.name] = SourceCounts(file=str(path), format=source.format)
        log.info("ingest: reading source %r from %s", source.name, path)
        with tqdm(
            total=path.stat().st_size, unit="B", unit_scale=True, desc=source.name, mininterval=5
        ) as bar:

            def advance(position: int, bar: tqdm = bar) -> None:
                bar.update(position - bar.n)

            for record in iter_records(path, on_progress=advance):
                tally.read += 1
                try:
                    if record.error is not None:
                        raise BadRecord(*record.error)
                    source_id, layout, messages, tools = parse_record(record.value, source.format)
                except BadRecord as bad:
                    snippet = record.snippet or _snippet(record.value)
                    _reject(rejects_file, source, path, record.line, record.index, bad, snippet)
                    if on_bad_record == "fail":
                        raise IngestError(
                            f"{path}:{record.line}: bad record (index {record.index}) in source "
                            f"{source.name!r}: {bad.reason}: {bad.detail}"
                        ) from None
                    tally.dropped[bad.reason] += 1
                    continue
                tally.layouts[layout] += 1
                tally.kept_as_text[UNPARSED_TOOL_CALL_BLOCKS] += sum(
                    1
                    for m in messages
                    if m["role"] == "assistant" and "<tool_call>" in m["content"]
                )
                reason, conversation = _judge(
                    source.name, source_id, messages, tools, seen_content, seen_ids
                )
                if reason is not None:
                    tally.dropped[reason] += 1
                    continue
                line = (json.dumps(conversation, ensure_ascii=False) + "\n").encode("utf-8")
                kept.append(
                    _Spilled(
                        rank=subset_rank(seed, conversation["id"]),
                        id=conversation["id"],
                        source=source.name,
                        offset=spill.tell(),
                        length=len(line),
                    )
                )
                spill.write(line)
        log.info(
            "ingest: source %r: read %d, usable %d, dropped %s",
            source.name,
            tally.read,
            tally.read - sum(tally.dropped.values()),
            dict(tally.dropped),
        )
        if tally.kept_as_text[UNPARSED_TOOL_CALL_BLOCKS]:
            log.warning(
                "ingest: source %r: %d assistant turns hold a <tool_call> block that is not a "
                "JSON call; kept as text",
                source.name,
                tally.kept_as_text[UNPARSED_TOOL_CALL_BLOCKS],
            )
    return kept


def _judge(
    source: str,
    source_id: str | None,
    messages: list[Any],
    tools: list[dict[str, Any]],
    seen_content: set[str],
    seen_ids: set[str],
) -> tuple[str | None, dict[str, Any]]:
    """(drop reason or None, the conversation); records what it has seen for later duplicates."""
    messages = clean_messages(messages)
    if not messages:
        return EMPTY, {}
    roles = {message["role"] for message in messages}
    if "user" not in roles or "assistant" not in roles:
        return ONE_SIDED, {}
    problem = tool_result_problem(messages)
    if problem is not None:
        return problem, {}
    digest = content_hash(messages, tools)
    if digest in seen_content:
        return DUPLICATE, {}
    conv_id = conversation_id(source, source_id, messages, tools)
    if conv_id in seen_ids:
        return DUPLICATE_ID, {}
    seen_content.add(digest)
    seen_ids.add(conv_id)
    conversation = {"id": conv_id, "source": source, "messages": messages}
    if tools:
        conversation["tools"] = tools
    return None, conversation


def _select_subset(
    kept: list[_Spilled], max_conversations: int | None, counts: dict[str, SourceCounts]
) -> list[_Spilled]:
    if max_conversations is not None and len(kept) > max_conversations:
        selected = heapq.nsmallest(max_conversations, kept)
        chosen = {entry.id for entry in selected}
        for entry in kept:
            if entry.id not in chosen:
                counts[entry.source].dropped[NOT_IN_SUBSET] += 1
    else:
        selected = kept
    for entry in selected:
        counts[entry.source].kept += 1
    return sorted(selected, key=lambda entry: entry.id)


def _write_sorted(selected: list[_Spilled], spill: Any, output: Path) -> None:
    with atomic_path(output) as tmp, open(tmp, "wb") as handle:
        for entry in selected:
            spill.seek(entry.offset)
            handle.write(spill.read(entry.length))


def _reject(
    rejects_file: Any,
    source: Source,
    path: Path,
    line: int,
    index: int,
    bad: BadRecord,
    snippet: str,
) -> None:
    entry = {
        "source": source.name,
        "file": str(path),
        "line": line,
        "index": index,
        "reason": bad.reason,
        "detail": bad.detail,
        "snippet": snippet,
    }
    rejects_file.write(json.dumps(entry, ensure_ascii=False) + "\n")


def _snippet(value: Any, limit: int = 200) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text[:limit]


def _summary(
    counts: dict[str, SourceCounts], max_conversations: int | None, seed: int, on_bad_record: str
) -> dict[str, Any]:
    per_source = {name: tally.as_dict() for name, tally in counts.items()}
    dropped = {reason: sum(t.dropped[reason] for t in counts.values()) for reason in DROP_REASONS}
    totals = {
        "read": sum(t.read for t in counts.values()),
        "kept": sum(t.kept for t in counts.values()),
        "dropped": dropped,
        "dropped_total": sum(dropped.values()),
        "kept_as_text": {w: sum(t.kept_as_text[w] for t in counts.values()) for w in KEPT_AS_TEXT},
    }
    for name, tally in per_source.items():
        # The promise the summary makes: every record read is either kept or dropped once.
        assert tally["read"] == tally["kept"] + tally["dropped_total"], (name, tally)
    return {
        "sources": per_source,
        "totals": totals,
        "bad_record_reasons": list(BAD_RECORD_REASONS),
        "filter_reasons": list(FILTER_REASONS),
        "settings": {
            "max_conversations": max_conversations,
            "seed": seed,
            "on_bad_record": on_bad_record,
        },
    }
