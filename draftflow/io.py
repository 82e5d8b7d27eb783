"""Atomic file and directory writes and checksums shared by every stage."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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


# safetensors' dtype names, and the order it lays tensors out in: larger alignment first.
_SAFETENSORS_DTYPES = {
    "torch.float32": ("F32", 4),
    "torch.bfloat16": ("BF16", 2),
    "torch.float16": ("F16", 2),
    "torch.int64": ("I64", 8),
    "torch.int32": ("I32", 4),
    "torch.int16": ("I16", 2),
    "torch.int8": ("I8", 1),
    "torch.uint8": ("U8", 1),
    "torch.bool": ("BOOL", 1),
    "torch.float8_e4m3fn": ("F8_E4M3", 1),
}


def write_safetensors(
    path: str | os.PathLike[str], tensors: dict[str, list[Any]], metadata: dict[str, str]
) -> str:
    """Write a safetensors file whose tensor ``name`` is ``torch.cat(pieces)``; return its sha256.

    The same bytes as ``safetensors.torch.save_file`` of the concatenated tensors, but the
    pieces are streamed to the file (no concatenated copy) and hashed on the way, so the file
    is never read back for its checksum. Pieces must be CPU tensors of one dtype.
    """
    import torch

    layout = []
    for name, pieces in tensors.items():
        dtype = pieces[0].dtype
        code, size = _SAFETENSORS_DTYPES[str(dtype)]
        if any(p.dtype != dtype or p.shape[1:] != pieces[0].shape[1:] for p in pieces):
            raise ValueError(f"safetensors {name}: pieces differ in dtype or trailing shape")
        shape = [sum(int(p.shape[0]) for p in pieces), *map(int, pieces[0].shape[1:])]
        layout.append((-size, name, code, shape, pieces))
    layout.sort(key=lambda entry: entry[:2])
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for _, name, code, shape, pieces in layout:
        nbytes = sum(p.numel() * p.element_size() for p in pieces)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    digest = hashlib.sha256()
    # Hash on a second thread while this one writes (both release the GIL): a chunk costs the
    # slower of the two, not their sum. One worker keeps the updates in file order.
    with open(path, "wb") as handle, ThreadPoolExecutor(1) as hasher:
        for block in (len(encoded).to_bytes(8, "little"), encoded):
            handle.write(block)
            digest.update(block)
        hashed = []
        for _, _, _, _, pieces in layout:
            for piece in pieces:
                raw = piece.detach().contiguous().view(-1).view(torch.uint8).numpy()
                view = memoryview(raw)
                hashed.append(hasher.submit(digest.update, view))
                handle.write(view)
        for update in hashed:
            update.result()
    return digest.hexdigest()
