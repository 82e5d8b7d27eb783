"""Atomic file and directory writes and checksums shared by every stage."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it into place only on success.

    Readers never see a half-written file: the rename is atomic on POSIX file systems.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    # mkstemp creates 0600 files; give the final file the permissions a plain open() would.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def publish_dir(work: str | os.PathLike[str], final: str | os.PathLike[str]) -> Path:
    """Move the finished directory ``work`` to ``final``, replacing whatever was there.

    ``work`` sits beside ``final`` (same file system), so the rename is atomic: readers see the
    old directory or the new one, never one half written.
    """
    final = Path(final)
    if final.exists():
        shutil.rmtree(final)
    os.replace(work, final)
    return final


@contextlib.contextmanager
def staged_dir(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a hidden temporary directory beside ``final``; publish it there only on success.

    On an error the temporary directory is removed and ``final`` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        publish_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def sha256_file(path: str | os.PathLike[str], block_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(block_size):
            digest.update(block)
    return digest.hexdigest()
