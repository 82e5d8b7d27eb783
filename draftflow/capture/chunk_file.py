"""One capture-store chunk file, written sample by sample as the samples arrive.

A chunk's layout follows from its samples' token counts alone, so the header can be written
before any state has arrived. The tensors lie in the order the data comes in:

    hidden_states [T, L, H] | hidden_scales float32 [T, L] (fp8 only) | input_ids int32 [T] | loss_mask int8 [T]

Each sample's ``hidden_states`` rows are written (and hashed) as soon as the sample is handed
over; the small tensors (scales, ids, masks) are kept until the last sample and written after it.
When the last sample arrives, only its own rows and those small tensors remain to be written.
safetensors readers sort the tensors by their offsets and ask only that they cover the data
without gaps, so this order is a valid safetensors file (``safe_open``, ``load_file``).

The bytes are a pure function of the samples and the metadata: the header is canonical JSON and
the data is written in a fixed order, so a resumed capture rewrites a chunk byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftflow.capture.quant import SCALE_DTYPE, Quantized, is_scaled, quantize_fp8, torch_dtype
from draftflow.io import DiskFullError, explain_disk_full

SCALES_NAME = "hidden_scales"
# safetensors' names of the dtypes a chunk holds.
_DTYPE_CODES = {
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.int8: "I8",
}


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class ChunkLayout:
    """Where every tensor of one chunk lies, from its samples' (id, start row, end row)."""

    entries: tuple[tuple[str, int, int], ...]
    num_layers: int
    hidden_size: int
    store_dtype: str
    metadata: dict[str, str]

    @property
    def num_tokens(self) -> int:
        return self.entries[-1][2] if self.entries else 0

    def slots(self) -> list[TensorSlot]:
        """The tensors in file order: the streamed states first, then what is kept until the end."""
        tokens, layers = self.num_tokens, self.num_layers
        tensors: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            ("hidden_states", torch_dtype(self.store_dtype), (tokens, layers, self.hidden_size))
        ]
        if is_scaled(self.store_dtype):
            tensors.append((SCALES_NAME, SCALE_DTYPE, (tokens, layers)))
        tensors += [("input_ids", torch.int32, (tokens,)), ("loss_mask", torch.int8, (tokens,))]
        slots, offset = [], 0
        for name, dtype, shape in tensors:
            nbytes = dtype.itemsize
            for size in shape:
                nbytes *= size
            slots.append(TensorSlot(name, dtype, shape, offset, offset + nbytes))
            offset += nbytes
        return slots

    def header(self) -> bytes:
        """The file's first bytes: the header's length (u64 little-endian), then its JSON."""
        header: dict[str, Any] = {"__metadata__": self.metadata}
        for slot in self.slots():
            header[slot.name] = {
                "dtype": _DTYPE_CODES[slot.dtype],
                "shape": list(slot.shape),
                "data_offsets": [slot.start, slot.end],
            }
        encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        # safetensors pads its header with spaces to 8 bytes: the data starts aligned.
        encoded += b" " * (-len(encoded) % 8)
        return len(encoded).to_bytes(8, "little") + encoded

    def file_bytes(self) -> int:
        """The whole file's size: header and every tensor."""
        return len(self.header()) + self.slots()[-1].end


def _raw(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy where it is contiguous."""
    return memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())


class _OrderedHasher:
    """sha256 of buffers in the order given, on its own thread: hashing runs along the writes
    (both release the GIL), so a sample costs the slower of the two, not their sum."""

    _END = None

    def __init__(self, name: str) -> None:
        self._digest = hashlib.sha256()
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (block := self._queue.get()) is not self._END:
            if self._error is None:
                try:
                    self._digest.update(block)
                except BaseException as error:  # re-raised by hexdigest()
                    self._error = error

    def update(self, block: memoryview) -> None:
        self._queue.put(block)

    def hexdigest(self) -> str:
        self._queue.put(self._END)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()


# What the writer thread takes per sample: its states as handed over, its ids and its mask.
_Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ChunkStream:
    """Writes one chunk file on its own thread while its samples are handed over in order.

    The file is written under a temporary name beside ``final`` and renamed into place once
    complete. ``put()`` never blocks on disk; ``result()`` waits for the file and returns its
    sha256, or raises the writer thread's error; ``error()`` reports one early.
    """

    _ABORT = None

    def __init__(self, final: Path, layout: ChunkLayout) -> None:
        self.final = Path(final)
        self.layout = layout
        self._queue: queue.SimpleQueue[_Sample | None] = queue.SimpleQueue()
        self._put = 0
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        # mkstemp creates 0600 files; the chunk gets the permissions a plain open() would. The
        # umask is read here, on the caller's thread, as draftflow.io.atomic_path does.
        umask = os.umask(0)
        os.umask(umask)
        self._mode = 0o666 & ~umask
        self._thread = threading.Thread(
            target=self._run, name=f"capture-store-{self.final.stem}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ driver side
    @property
    def complete(self) -> bool:
        """Every sample of the layout has been handed over."""
        return self._put == len(self.layout.entries)

    def put(
        self,
        hidden_states: torch.Tensor | Quantized,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
    ) -> None:
        """Hand over the next sample (CPU tensors); raise the writer's error if it failed."""
        if self.complete:
            raise RuntimeError(f"{self.final.name}: all {self._put} samples were handed over")
        self._raise_error()
        self._queue.put((hidden_states, input_ids, loss_mask))
        self._put += 1

    def error(self) -> BaseException | None:
        return self._error

    def _raise_error(self) -> None:
        if isinstance(self._error, DiskFullError):
            raise self._error  # it names the file and the space already
        if self._error is not None:
            raise RuntimeError(f"writing {self.final.name} failed: {self._error}") from self._error

    def result(self) -> str:
        """Wait until the chunk is renamed into place; return its sha256."""
        if not self.complete:
            raise RuntimeError(
                f"{self.final.name}: {self._put} of {len(self.layout.entries)} samples handed over"
            )
        self._done.wait()
        self._raise_error()
        if self._digest is None:
            raise RuntimeError(f"{self.final.name} was aborted")
        return self._digest

    def abort(self) -> None:
        """Stop writing and remove the temporary file (the chunk is not published)."""
        self._queue.put(self._ABORT)
        self._done.wait()

    def settle(self) -> None:
        """Wait until the writer thread has ended, whatever its outcome (no error raised)."""
        self._done.wait()

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        tmp: Path | None = None
        try:
            size = self.layout.file_bytes()
            with explain_disk_full(self.final, None, size):
                fd, tmp_name = tempfile.mkstemp(
                    prefix=f".{self.final.name}.", suffix=".tmp", dir=self.final.parent
                )
            tmp = Path(tmp_name)
            with explain_disk_full(self.final, tmp, size), os.fdopen(fd, "wb") as handle:
                os.fchmod(handle.fileno(), self._mode)
                digest = self._write(handle)
            if digest is None:  # aborted
                return
            os.replace(tmp, self.final)
            tmp = None
            self._digest = digest
        except BaseException as error:
            self._error = error
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            self._done.set()

    def _write(self, handle: Any) -> str | None:
        """Write the file in order, hashing as it goes; its sha256, or None when aborted."""
        hasher = _OrderedHasher(f"capture-hash-{self.final.stem}")
        try:
            written = self._write_blocks(handle, hasher)
        finally:
            digest = hasher.hexdigest()  # waits for the hasher thread, error or not
        return digest if written else None

    def _write_blocks(self, handle: Any, hasher: _OrderedHasher) -> bool:
        layout = self.layout

        def emit(block: memoryview) -> None:
            hasher.update(block)  # the queue keeps the block alive until it is hashed
            handle.write(block)

        emit(memoryview(layout.header()))
        scaled = is_scaled(layout.store_dtype)
        scales, ids, masks = [], [], []
        for sample_id, start, end in layout.entries:
            item = self._queue.get()
            if item is self._ABORT:
                return False
            states, input_ids, loss_mask = item
            expected = (end - start, layout.num_layers, layout.hidden_size)
            if tuple(states.shape) != expected:
                raise ValueError(
                    f"{self.final.name}: sample {sample_id!r} has states {tuple(states.shape)}, "
                    f"the layout expects {list(expected)}"
                )
            if isinstance(states, Quantized):  # quantized where it was captured
                states, sample_scales = states
                scales.append(sample_scales)
            elif scaled:
                states, sample_scales = quantize_fp8(states)
                scales.append(sample_scales)
            emit(_raw(states.to(torch_dtype(layout.store_dtype))))
            ids.append(input_ids.to(torch.int32))
            masks.append(loss_mask.to(torch.int8))
        for pieces in (scales, ids, masks):
            if pieces:
                emit(_raw(torch.cat(pieces)))
        return True
