"""Stream the records of a corpus file: JSONL or a JSON array, each optionally gzipped.

Files are never loaded whole: JSONL is read line by line, a JSON array element by element
(``json.JSONDecoder.raw_decode`` over a sliding buffer), so the 125 MB ShareGPT dump costs a few
MB of memory. Every record carries where it came from (1-based line, 0-based index) so a bad
one can be found in the file.

Bytes that are not UTF-8 are decoded with ``surrogateescape``: reading goes on, and the record
holding them is reported as ``bad_utf8`` instead of failing the whole file.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from draftflow.corpus.formats import BAD_UTF8, INVALID_JSON

READ_CHUNK_CHARS = 1 << 20
# surrogateescape maps each undecodable byte to one of these code points
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class RawRecord:
    """One record of a file: its parsed value, or why it could not be parsed."""

    line: int  # 1-based line where the record starts
    index: int  # 0-based position among the file's records (array element / non-blank line)
    value: Any = None
    error: tuple[str, str] | None = None  # (reason, detail)
    snippet: str = ""  # start of the raw text, for the rejects file (set on errors only)


def _snippet(text: str, limit: int = 200) -> str:
    return text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")


class _ByteCounter:
    """Report how far into the (compressed) file reading has got, for the progress bar."""

    def __init__(self, raw: IO[bytes], on_progress: Callable[[int], None] | None) -> None:
        self.raw = raw
        self.on_progress = on_progress

    def tick(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.raw.tell())


def _open_binary(path: Path) -> tuple[IO[bytes], IO[bytes]]:
    """(stream of decompressed bytes, the underlying file for progress)."""
    raw = open(path, "rb")  # noqa: SIM115 - closed by iter_records
    if path.name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    return raw, raw


def _first_char(stream: IO[bytes]) -> str:
    """First non-blank character of the file, without consuming it ('' if none is buffered)."""
    head = stream.peek(64) if isinstance(stream, io.BufferedReader | gzip.GzipFile) else b""
    stripped = head.lstrip(b" \t\r\n\xef\xbb\xbf")  # blanks and a UTF-8 byte-order mark
    return chr(stripped[0]) if stripped else ""


def iter_records(
    path: str | os.PathLike[str], on_progress: Callable[[int], None] | None = None
) -> Iterator[RawRecord]:
    """Yield every record of a JSONL or JSON-array file (``.gz`` allowed).

    The layout is decided by the first non-blank character: ``[`` means a JSON array.
    ``on_progress`` receives the number of (compressed) bytes read so far.
    """
    path = Path(path)
    stream, raw = _open_binary(path)
    counter = _ByteCounter(raw, on_progress)
    try:
        if _first_char(stream) == "[":
            yield from _iter_array(stream, counter)
        else:
            yield from _iter_jsonl(stream, counter)
        counter.tick()
    finally:
        stream.close()
        raw.close()


def _iter_jsonl(stream: IO[bytes], counter: _ByteCounter) -> Iterator[RawRecord]:
    index = 0
    for line_number, raw_line in enumerate(stream, start=1):
        text = raw_line.decode("utf-8", "surrogateescape")
        if line_number == 1:
            text = text.removeprefix("\ufeff")
        if not text.strip():
            continue
        if line_number % 1000 == 0:
            counter.tick()
        if _ESCAPED_BYTE.search(text):
            yield RawRecord(
                line_number, index, error=(BAD_UTF8, "invalid UTF-8 bytes"), snippet=_snippet(text)
            )
        else:
            try:
                yield RawRecord(line_number, index, value=json.loads(text))
            except json.JSONDecodeError as error:
                yield RawRecord(
                    line_number, index, error=(INVALID_JSON, str(error)), snippet=_snippet(text)
                )
        index += 1


class _ArrayReader:
    """A sliding text buffer over a JSON array with the line number of its read position."""

    json_decoder = json.JSONDecoder()

    def __init__(self, stream: IO[bytes], counter: _ByteCounter) -> None:
        self.stream = stream
        self.counter = counter
        self.decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.buffer = ""
        self.pos = 0
        self.line = 1  # line number at self.pos
        self.eof = False

    def fill(self, at_least: int = 0) -> bool:
        """Read at least one more chunk of text; False at the end of the file."""
        if self.eof:
            return False
        if self.pos > READ_CHUNK_CHARS:  # drop text already consumed
            self.buffer = self.buffer[self.pos :]
            self.pos = 0
        data = self.stream.read(max(at_least, READ_CHUNK_CHARS))
        self.counter.tick()
        if not data:
            self.buffer += self.decoder.decode(b"", final=True)
            self.eof = True
            return False
        self.buffer += self.decoder.decode(data)
        return True

    def advance(self, new_pos: int) -> None:
        self.line += self.buffer.count("\n", self.pos, new_pos)
        self.pos = new_pos

    def skip_blank(self) -> str:
        """Move past whitespace; return the next character ('' at the end of the file)."""
        while True:
            while self.pos < len(self.buffer) and self.buffer[self.pos] in _WHITESPACE:
                self.advance(self.pos + 1)
            if self.pos < len(self.buffer):
                return self.buffer[self.pos]
            if not self.fill():
                return ""


def _iter_array(stream: IO[bytes], counter: _ByteCounter) -> Iterator[RawRecord]:
    reader = _ArrayReader(stream, counter)
    reader.fill()
    reader.buffer = reader.buffer.removeprefix("\ufeff")
    reader.skip_blank()
    reader.advance(reader.pos + 1)  # the "[" iter_records saw
    index = 0
    while True:
        char = reader.skip_blank()
        if char == "]":
            reader.advance(reader.pos + 1)
            trailing = reader.skip_blank()
            if trailing:
                yield RawRecord(
                    reader.line,
                    index,
                    error=(INVALID_JSON, "data after the closing ']'"),
                    snippet=_snippet(reader.buffer[reader.pos :]),
                )
            return
        if index > 0 and char == ",":
            reader.advance(reader.pos + 1)
            char = reader.skip_blank()
        elif index > 0 and char != "":
            yield _array_error(reader, index, f"expected ',' or ']' between elements, got {char!r}")
            return
        if char == "":
            yield _array_error(reader, index, "the file ends inside the array (no closing ']')")
            return
        record = _decode_element(reader, index)
        yield record
        if record.error is not None and record.error[0] == INVALID_JSON:
            return  # the rest of the array cannot be located reliably
        index += 1


def _array_error(reader: _ArrayReader, index: int, detail: str) -> RawRecord:
    return RawRecord(
        reader.line,
        index,
        error=(INVALID_JSON, f"{detail}; rest of the file skipped"),
        snippet=_snippet(reader.buffer[reader.pos :]),
    )


def _decode_element(reader: _ArrayReader, index: int) -> RawRecord:
    """Decode the element at the reader's position, reading more text until it is complete."""
    while True:
        start = reader.pos
        try:
            value, end = reader.json_decoder.raw_decode(reader.buffer, start)
        except json.JSONDecodeError as error:
            # Maybe only cut short by the buffer's end: read more (doubling) and try again.
            if reader.fill(at_least=len(reader.buffer)):
                continue
            return _array_error(reader, index, f"invalid JSON element ({error.msg})")
        # A number or literal touching the buffer's end might continue in the next chunk.
        if end == len(reader.buffer) and reader.fill():
            continue
        text = reader.buffer[start:end]
        line = reader.line
        reader.advance(end)
        if _ESCAPED_BYTE.search(text):
            return RawRecord(
                line, index, error=(BAD_UTF8, "invalid UTF-8 bytes"), snippet=_snippet(text)
            )
        return RawRecord(line, index, value=value)
