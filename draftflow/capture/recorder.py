"""Files the hidden states of each forward pass into one file per request, off the forward's path.

Used inside a vLLM worker by ``draftflow.capture.worker_extension``. Per forward:

1. ``begin()`` takes a free *slot* (a staging buffer ``[max_tokens, layers, hidden]`` on the
   model's device and a host buffer; on the CPU they are one buffer) and registers the
   forward's new requests with their prompt lengths;
2. the hooks write each captured layer straight into the slot (``keep``, ``keep_positions``);
3. ``end(layout)`` queues the slot: on a GPU the staging buffer is copied into page-locked host
   memory on a side stream, ordered after the forward by a CUDA event, so the forward never
   waits for the copy; filing threads (two on a GPU) then write each request's rows into that
   request's file (``RequestFile``: bf16 rows, or for an fp8 store e4m3 rows and their scales,
   quantized on the device before the copy, on the CPU by the filing thread) at their
   positions' offsets with ``pwrite``
   (no memory map per request; the write releases the GIL, so the threads run side by side)
   and give the slot back. Each request has one filing thread, so its forwards
   are filed in order. A request's file is written as ``<key>.partial`` and renamed to
   ``<key>.bin`` the moment its last position is filed, so the driver can take each request
   while the engine still works on others.

The engine only waits when every slot is still in flight (counted as ``slot_wait_s``;
``filing_s`` is the filing threads' busy time, summed). Rows are filed by position, so chunked
prefill (a prompt over several forwards) and preemption (a recomputed prompt overwrites its
rows, counted as ``overwritten_tokens``) give one row per position; positions at or past the
prompt's length (a step scheduled after the prompt, as async scheduling can) are dropped and
counted. ``drain()`` waits for the threads and returns what was filed since the last drain.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftflow.capture.quant import (
    BF16,
    SCALE_DTYPE,
    Quantized,
    is_scaled,
    quantize_fp8,
    quantize_fp8_pieces,
    torch_dtype,
)

STATE_DTYPE = torch.bfloat16
DEFAULT_SLOTS = 4
# A GPU's forwards outrun one thread's writes; on the CPU the engine needs the cores.
FILING_THREADS = {"cuda": 2}
# Tokens quantized at once on a GPU: bounds the float32 copy (1024 x 4 x 7168 x 4 B = 117 MiB).
QUANTIZE_PIECE_ROWS = 1024


@dataclass(frozen=True)
class RequestFile:
    """The layout of one request's file: ``[T, layers, hidden]`` rows in the store dtype, then
    (fp8 only) float32 scales ``[T, layers]`` from an 8-byte boundary. Written by the recorder,
    mapped by the driver (``map_request_file``)."""

    length: int
    num_columns: int
    hidden_size: int
    store_dtype: str = BF16

    @property
    def row_bytes(self) -> int:
        return self.num_columns * self.hidden_size * torch_dtype(self.store_dtype).itemsize

    @property
    def scale_row_bytes(self) -> int:
        return self.num_columns * SCALE_DTYPE.itemsize

    @property
    def scales_offset(self) -> int:
        return -(-self.length * self.row_bytes // 8) * 8

    @property
    def size(self) -> int:
        if not is_scaled(self.store_dtype):
            return self.length * self.row_bytes
        return self.scales_offset + self.length * self.scale_row_bytes


def map_request_file(path: str, layout: RequestFile) -> torch.Tensor | Quantized:
    """A finished request's file as tensors (memory-mapped, no copy), then unlinked."""
    raw = torch.from_file(path, shared=False, size=layout.size, dtype=torch.uint8)
    os.unlink(path)  # the mapping keeps the data until the tensors are gone
    shape = (layout.length, layout.num_columns, layout.hidden_size)
    values = raw[: layout.length * layout.row_bytes].view(torch_dtype(layout.store_dtype))
    if not is_scaled(layout.store_dtype):
        return values.view(shape)
    scales = raw[layout.scales_offset : layout.size].view(SCALE_DTYPE)
    return Quantized(values.view(shape), scales.view(shape[:2]))


@dataclass
class _Slot:
    stage: torch.Tensor  # [max_tokens, layers, hidden] on the model's device
    stage_positions: torch.Tensor  # [max_tokens] int64 on the model's device
    host: torch.Tensor  # = stage on the CPU; page-locked host memory on a GPU
    host_positions: torch.Tensor
    host_scales: torch.Tensor | None = None  # fp8 on a GPU: host holds e4m3, these its scales
    ready: Any = None  # CUDA event: the forward's writes are done
    copied: Any = None  # CUDA event: the host copy is done


@dataclass
class _Queued:
    slot: _Slot
    num_tokens: int
    layout: list[tuple[str, int]]
    unfiled: int  # filing threads still to go over this forward; the last frees the slot


@dataclass
class _Request:
    """One request's file: its states are written in place, position by position."""

    layout: RequestFile
    path: Path  # the open file; renamed to ``final`` when complete
    final: Path
    fd: int | None  # open for writing until the request is complete
    filled: torch.Tensor  # bool [length]
    filer: int  # the one filing thread that writes this request, so its forwards keep order
    forwards: int = 0

    @property
    def length(self) -> int:
        return self.layout.length

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @property
    def missing(self) -> int:
        return int((~self.filled).sum())


@dataclass
class _Stats:
    forwards: int = 0
    tokens: int = 0
    overwritten_tokens: int = 0
    beyond_prompt_tokens: int = 0
    slot_wait_s: float = 0.0
    filing_s: float = 0.0
    # Per forward, in order: (file key, tokens) of each request in batch order. Which prompts
    # share a forward changes the bf16 bits of their states on the CPU (docs/capture.md,
    # "Determinism"), so a call's schedule is kept for comparison.
    schedule: list[list[tuple[str, int]]] = field(default_factory=list)


class StateRecorder:
    """States of ``num_columns`` captured layers of width ``hidden_size``, filed per request."""

    def __init__(
        self,
        *,
        num_columns: int,
        hidden_size: int,
        max_tokens: int,
        device: torch.device,
        out_dir: str | os.PathLike[str],
        num_slots: int = DEFAULT_SLOTS,
        filing_threads: int | None = None,
        store_dtype: str,  # extract.store_dtype
    ) -> None:
        torch_dtype(store_dtype)  # an unknown dtype fails here
        self.store_dtype = store_dtype
        self._scaled = is_scaled(store_dtype)
        self.num_columns = int(num_columns)
        self.hidden_size = int(hidden_size)
        self.max_tokens = int(max_tokens)
        self.device = torch.device(device)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._slots = [self._make_slot() for _ in range(num_slots)]
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for slot in self._slots:
            self._free.put(slot)
        self._requests: dict[str, _Request] = {}
        self._next_index = 0
        self._stats = _Stats()
        self._error: BaseException | None = None
        # Guards _requests (begin() adds, the filing threads read) and the counters.
        self._lock = threading.Lock()
        count = (
            FILING_THREADS.get(self.device.type, 1) if filing_threads is None else filing_threads
        )
        self._queues: list[queue.Queue[_Queued | None]] = [
            queue.Queue() for _ in range(max(1, count))
        ]
        self._threads = [
            threading.Thread(
                target=self._file_forever, args=(filer,), name=f"draftflow-filing-{filer}"
            )
            for filer in range(len(self._queues))
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        self.current: _Slot | None = None
        self._current_tokens = 0

    def _make_slot(self) -> _Slot:
        shape = (self.max_tokens, self.num_columns, self.hidden_size)
        stage = torch.empty(shape, dtype=STATE_DTYPE, device=self.device)
        stage_positions = torch.empty(self.max_tokens, dtype=torch.int64, device=self.device)
        if not self._cuda:
            return _Slot(stage, stage_positions, stage, stage_positions)
        # fp8 crosses to the host quantized: half the bytes to copy, pin and file.
        host_dtype = torch_dtype(self.store_dtype) if self._scaled else STATE_DTYPE
        host = torch.empty(shape, dtype=host_dtype, pin_memory=True)
        host_positions = torch.empty(self.max_tokens, dtype=torch.int64, pin_memory=True)
        host_scales = (
            torch.empty(shape[:2], dtype=SCALE_DTYPE, pin_memory=True) if self._scaled else None
        )
        return _Slot(
            stage,
            stage_positions,
            host,
            host_positions,
            host_scales,
            ready=torch.cuda.Event(),
            copied=torch.cuda.Event(),
        )

    # ------------------------------------------------------------ the forward's side
    def begin(self, num_tokens: int, new_requests: dict[str, tuple[int, str | None]]) -> None:
        """Take a slot for a forward of ``num_tokens``; register requests seen for the first time.

        ``new_requests``: request id -> (prompt length, file key or None for a numbered one).
        """
        self._raise_thread_error()
        if num_tokens > self.max_tokens:
            raise RuntimeError(
                f"a forward of {num_tokens} tokens exceeds the capture buffer of {self.max_tokens}"
            )
        with self._lock:
            for req_id, (length, key) in new_requests.items():
                if req_id not in self._requests:
                    self._requests[req_id] = self._open_request(length, key)
        waited = time.perf_counter()
        slot = self._free.get()
        self._stats.slot_wait_s += time.perf_counter() - waited
        self.current, self._current_tokens = slot, int(num_tokens)

    def keep(self, column: int, hidden_states: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Write ``hidden_states + residual`` of this forward's tokens into the slot's column."""
        n = self._current_tokens
        out = self.current.stage[:n, column]
        # Sum into the slot now: the layer's fused add-norm updates its inputs in place.
        if residual is None:
            out.copy_(hidden_states[:n])
        else:
            torch.add(hidden_states[:n], residual[:n], out=out)

    def keep_positions(self, positions: torch.Tensor) -> None:
        n = self._current_tokens
        self.current.stage_positions[:n].copy_(positions[:n])

    def mark_ready(self) -> None:
        """After the forward's last capture: the copy waits for everything enqueued so far."""
        if self._cuda:
            self.current.ready.record()

    def end(self, layout: list[tuple[str, int]]) -> None:
        """Queue the forward's slot for filing (``layout``: request id, tokens, in batch order)."""
        slot, n = self.current, self._current_tokens
        self.current = None
        if sum(count for _, count in layout) != n:
            self._free.put(slot)
            raise RuntimeError(
                f"batch layout covers {sum(c for _, c in layout)} tokens, the forward had {n}"
            )
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(slot.ready)
                if self._scaled:
                    # Each piece's temporaries are freed to this stream, after its copies.
                    for rows, values, scales in quantize_fp8_pieces(
                        slot.stage[:n], QUANTIZE_PIECE_ROWS
                    ):
                        slot.host[rows].copy_(values, non_blocking=True)
                        slot.host_scales[rows].copy_(scales, non_blocking=True)
                else:
                    slot.host[:n].copy_(slot.stage[:n], non_blocking=True)
                slot.host_positions[:n].copy_(slot.stage_positions[:n], non_blocking=True)
                slot.copied.record(self._copy_stream)
        with self._lock:
            self._stats.schedule.append([(self._key(req_id), count) for req_id, count in layout])
        item = _Queued(slot, n, list(layout), unfiled=len(self._queues))
        for filing in self._queues:
            filing.put(item)

    def abort(self) -> None:
        """The forward failed or did not run: give its slot back unfiled."""
        if self.current is not None:
            self._free.put(self.current)
            self.current = None

    def _key(self, req_id: str) -> str:
        """The request's file key (engine ids differ between calls), else the id itself."""
        request = self._requests.get(req_id)
        return request.final.stem if request is not None else req_id

    # ------------------------------------------------------------ the filing threads
    def _open_request(self, length: int, key: str | None) -> _Request:
        if length < 1:
            raise RuntimeError(f"a request with a prompt of {length} tokens cannot be captured")
        index, self._next_index = self._next_index, self._next_index + 1
        key = key or f"request-{index:06d}"
        path, final = self.out_dir / f"{key}.partial", self.out_dir / f"{key}.bin"
        layout = RequestFile(length, self.num_columns, self.hidden_size, self.store_dtype)
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.ftruncate(fd, layout.size)
        filled = torch.zeros(length, dtype=torch.bool)
        return _Request(layout, path, final, fd, filled, filer=index % len(self._queues))

    @torch.inference_mode()  # requests are opened inside the forward: inference tensors
    def _file_forever(self, filer: int) -> None:
        filing = self._queues[filer]
        while True:
            item = filing.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    began = time.perf_counter()
                    self._file(item, filer)
                    with self._lock:
                        self._stats.filing_s += time.perf_counter() - began
            except BaseException as error:  # surfaced to the engine at its next begin()/drain()
                self._error = error
            finally:
                if item is not None and self._last_filer(item):
                    self._free.put(item.slot)
                filing.task_done()

    def _last_filer(self, item: _Queued) -> bool:
        with self._lock:
            item.unfiled -= 1
            if item.unfiled:
                return False
            self._stats.forwards += 1
            self._stats.tokens += item.num_tokens
            return True

    def _file(self, item: _Queued, filer: int) -> None:
        """Write this filing thread's requests of one forward into their files."""
        slot, n = item.slot, item.num_tokens
        if self._cuda:
            slot.copied.synchronize()
        states, positions = slot.host[:n], slot.host_positions[:n]
        scales = slot.host_scales[:n] if slot.host_scales is not None else None
        start, beyond, overwritten = 0, 0, 0
        for req_id, count in item.layout:
            rows, where = states[start : start + count], positions[start : start + count]
            row_scales = scales[start : start + count] if scales is not None else None
            start += count
            with self._lock:
                request = self._requests.get(req_id)
            if request is None:
                raise RuntimeError(f"request {req_id!r} was never scheduled as a new request")
            if request.filer != filer:
                continue
            inside = where < request.length
            if not bool(inside.all()):
                beyond += int((~inside).sum())
                rows, where = rows[inside], where[inside]
                row_scales = row_scales[inside] if row_scales is not None else None
            if where.numel() == 0:
                continue
            if request.fd is None:
                raise RuntimeError(f"request {req_id!r} got prompt states after it was complete")
            if self._scaled and row_scales is None:  # on the CPU: quantized here, per request
                rows, row_scales = quantize_fp8(rows)
            file = request.layout
            for first, run in _position_runs(where):
                _write_rows(request.fd, rows[run], first * file.row_bytes)
                if row_scales is not None:
                    offset = file.scales_offset + first * file.scale_row_bytes
                    _write_rows(request.fd, row_scales[run], offset)
            overwritten += int(request.filled[where].sum())
            request.filled[where] = True
            request.forwards += 1
            if bool(request.filled.all()):
                request.close()
                os.replace(request.path, request.final)  # publish the complete file
                request.path = request.final
        with self._lock:
            self._stats.beyond_prompt_tokens += beyond
            self._stats.overwritten_tokens += overwritten

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"filing captured states failed: {error!r}") from error

    # ------------------------------------------------------------ the driver's side
    def drain(self) -> dict:
        """Wait until every queued forward is filed; return the requests and counters, then reset.

        ``requests``: engine request id -> ``{"file", "length", "missing", "forwards"}``.
        """
        for filing in self._queues:
            filing.join()
        self._raise_thread_error()
        with self._lock:
            requests, self._requests = self._requests, {}
        stats = self._stats
        self._stats = _Stats()
        for request in requests.values():
            request.close()
        return {
            "requests": {
                req_id: {
                    "file": str(r.path),
                    "length": r.length,
                    "missing": r.missing,
                    "forwards": r.forwards,
                }
                for req_id, r in requests.items()
            },
            "stats": {
                "forwards": stats.forwards,
                "tokens": stats.tokens,
                "requests": len(requests),
                "overwritten_tokens": stats.overwritten_tokens,
                "beyond_prompt_tokens": stats.beyond_prompt_tokens,
                "max_forwards_per_request": max((r.forwards for r in requests.values()), default=0),
                "slot_wait_s": round(stats.slot_wait_s, 4),
                "filing_s": round(stats.filing_s, 4),
                "schedule": stats.schedule,
            },
        }

    def discard(self) -> None:
        """Forget every open request and delete its file (a reset between calls)."""
        for filing in self._queues:
            filing.join()
        with self._lock:
            requests, self._requests = self._requests, {}
        for request in requests.values():
            request.close()
            request.path.unlink(missing_ok=True)
        # Published but never taken by the driver, or left unfinished by a drained call.
        for leftover in [*self.out_dir.glob("*.bin"), *self.out_dir.glob("*.partial")]:
            leftover.unlink()
        self._stats = _Stats()
        self._error = None

    def close(self) -> None:
        self.discard()
        for filing in self._queues:
            filing.put(None)
        for thread in self._threads:
            thread.join(timeout=10)


def _position_runs(where: torch.Tensor) -> list[tuple[int, slice]]:
    """Split positions into runs of consecutive ones: (first position, slice of ``where``)."""
    if where.numel() == 1 or bool((where.diff() == 1).all()):
        return [(int(where[0]), slice(0, where.numel()))]  # the usual case: one range
    breaks = (torch.nonzero(where.diff() != 1).flatten() + 1).tolist()
    bounds = [0, *breaks, where.numel()]
    return [(int(where[a]), slice(a, b)) for a, b in itertools.pairwise(bounds)]


def _write_rows(fd: int, rows: torch.Tensor, offset: int) -> None:
    """Write contiguous rows at ``offset`` (``pwrite`` may write less than asked: loop)."""
    view = memoryview(rows.contiguous().view(-1).view(torch.uint8).numpy())
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
