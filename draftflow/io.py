"""Atomic file and directory writes and checksums shared by every stage."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DiskFullError(OSError):
    """A write found its file system full (no bytes or no inodes left): what, where, how much."""


# The errors a full disk raises: no space, or the user's quota exhausted.
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full_errno(error: Exception) -> int | None:
    """ENOSPC/EDQUOT behind ``error``, or None; safetensors' Rust writer says it only in text."""
    if isinstance(error, OSError):
        return error.errno if error.errno in _FULL else None
    if type(error).__name__ == "SafetensorError":
        for code in _FULL:
            if f"(os error {code})" in str(error):
                return code
    return None


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def _bytes_so_far(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


@contextlib.contextmanager
def explain_disk_full(
    final: str | os.PathLike[str], work: Path | None = None, size: int | None = None
) -> Iterator[None]:
    """Re-raise a full disk's bare ``ENOSPC`` as a DiskFullError that says what to do.

    ``final`` is what was being written, ``work`` its temporary path (for the bytes it got) and
    ``size`` the bytes it needs where the writer knows them.
    """
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:
        code = _disk_full_errno(error)
        if code is None:
            raise
        final = Path(final)
        mount = _mount_point(final.parent)
        stats = os.statvfs(mount)
        written = _bytes_so_far(work) if work is not None else 0
        needs = f"it needs {size} bytes (data), " if size is not None else ""
        raise DiskFullError(
            code,
            f"no space left on the file system of {final} ({mount}): {needs}{written} were "
            f"written before it filled; {stats.f_bavail * stats.f_frsize} bytes and "
            f"{stats.f_favail} inodes are free there. Nothing partial is kept: free space and "
            "rerun, finished work is kept and not redone",
        ) from error


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str], size: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it into place only on success.

    Readers never see a half-written file: the rename is atomic on POSIX file systems. A full
    disk raises DiskFullError (``size``: the bytes the file needs, where the caller knows them).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        with explain_disk_full(final, None, size):
            fd, tmp_name = tempfile.mkstemp(
                prefix=f".{final.name}.", suffix=".tmp", dir=final.parent
            )
        os.close(fd)
        tmp = Path(tmp_name)
        # mkstemp creates 0600 files; give the final file the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with explain_disk_full(final, tmp, size):
            yield tmp
            os.replace(tmp, final)
    finally:
        if tmp is not None and tmp.exists():
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
def staged_dir(final: str | os.PathLike[str], size: int | None = None) -> Iterator[Path]:
    """Yield a hidden temporary directory beside ``final``; publish it there only on success.

    On an error the temporary directory is removed and ``final`` is left as it was; a full disk
    raises DiskFullError (``size``: the bytes the directory needs, where the caller knows them).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        with explain_disk_full(final, None, size):
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        with explain_disk_full(final, tmp, size):
            yield tmp
            publish_dir(tmp, final)
    finally:
        if tmp is not None and tmp.exists():
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
