"""Files the hidden states of each forward pass into one file per request, off the forward's path.

Used inside a vLLM worker by ``draftflow.capture.worker_extension``. Per forward:

1. ``begin()`` takes a free *slot* (a staging buffer ``[max_tokens, layers, hidden]`` on the
   model's device and a host buffer; on the CPU they are one buffer) and registers the
   forward's new requests with their prompt lengths;
2. the hooks write each captured layer straight into the slot (``keep``, ``keep_positions``);
3. ``end(layout)`` queues the slot: on a GPU the staging buffer is copied into page-locked host
   memory on a side stream, ordered after the forward by a CUDA event, so the forward never
   waits for the copy; a filing thread then copies each request's rows into that request's
   file (a memory-mapped ``[T, layers, hidden]`` bf16 file, one per request) by position and
   gives the slot back. A request's file is written as ``<key>.partial`` and renamed to
   ``<key>.bin`` the moment its last position is filed, so the driver can take each request
   while the engine still works on others.

The engine only waits when every slot is still in flight (counted as ``slot_wait_s``). Rows
are filed by position, so chunked prefill (a prompt over several forwards) and preemption (a
recomputed prompt overwrites its rows, counted as ``overwritten_tokens``) give one row per
position; positions at or past the prompt's length (a step scheduled after the prompt, as async
scheduling can) are dropped and counted. ``drain()`` waits for the thread and returns what was
filed since the last drain.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STATE_DTYPE = torch.bfloat16
DEFAULT_SLOTS = 3


@dataclass
class _Slot:
    index: int
    stage: torch.Tensor  # [max_tokens, layers, hidden] on the model's device
    stage_positions: torch.Tensor  # [max_tokens] int64 on the model's device
    host: torch.Tensor  # = stage on the CPU; page-locked host memory on a GPU
    host_positions: torch.Tensor
    ready: Any = None  # CUDA event: the forward's writes are done
    copied: Any = None  # CUDA event: the host copy is done


@dataclass
class _Queued:
    slot: _Slot
    num_tokens: int
    layout: list[tuple[str, int]]


@dataclass
class _Request:
    """One request's file: its states are written in place, position by position."""

    index: int
    length: int
    path: Path  # the open file; renamed to ``final`` when complete
    final: Path
    states: torch.Tensor | None  # memory map of the file while the request is open
    filled: torch.Tensor  # bool [length]
    forwards: int = 0

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
    ) -> None:
        self.num_columns = int(num_columns)
        self.hidden_size = int(hidden_size)
        self.max_tokens = int(max_tokens)
        self.device = torch.device(device)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._slots = [self._make_slot(i) for i in range(num_slots)]
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for slot in self._slots:
            self._free.put(slot)
        self._queue: queue.Queue[_Queued | None] = queue.Queue()
        self._requests: dict[str, _Request] = {}
        self._next_index = 0
        self._stats = _Stats()
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # guards _requests between begin() and the thread
        self._thread = threading.Thread(target=self._file_forever, name="draftflow-filing")
        self._thread.daemon = True
        self._thread.start()
        self.current: _Slot | None = None
        self._current_tokens = 0

    def _make_slot(self, index: int) -> _Slot:
        shape = (self.max_tokens, self.num_columns, self.hidden_size)
        stage = torch.empty(shape, dtype=STATE_DTYPE, device=self.device)
        stage_positions = torch.empty(self.max_tokens, dtype=torch.int64, device=self.device)
        if not self._cuda:
            return _Slot(index, stage, stage_positions, stage, stage_positions)
        host = torch.empty(shape, dtype=STATE_DTYPE, pin_memory=True)
        host_positions = torch.empty(self.max_tokens, dtype=torch.int64, pin_memory=True)
        return _Slot(
            index,
            stage,
            stage_positions,
            host,
            host_positions,
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
                slot.host[:n].copy_(slot.stage[:n], non_blocking=True)
                slot.host_positions[:n].copy_(slot.stage_positions[:n], non_blocking=True)
                slot.copied.record(self._copy_stream)
        self._queue.put(_Queued(slot, n, list(layout)))

    def abort(self) -> None:
        """The forward failed or did not run: give its slot back unfiled."""
        if self.current is not None:
            self._free.put(self.current)
            self.current = None

    # ------------------------------------------------------------ the filing thread
    def _open_request(self, length: int, key: str | None) -> _Request:
        if length < 1:
            raise RuntimeError(f"a request with a prompt of {length} tokens cannot be captured")
        index, self._next_index = self._next_index, self._next_index + 1
        key = key or f"request-{index:06d}"
        path, final = self.out_dir / f"{key}.partial", self.out_dir / f"{key}.bin"
        numel = length * self.num_columns * self.hidden_size
        with open(path, "wb") as handle:
            handle.truncate(numel * STATE_DTYPE.itemsize)
        states = torch.from_file(str(path), shared=True, size=numel, dtype=STATE_DTYPE)
        states = states.view(length, self.num_columns, self.hidden_size)
        return _Request(index, length, path, final, states, torch.zeros(length, dtype=torch.bool))

    @torch.inference_mode()  # requests are opened inside the forward: inference tensors
    def _file_forever(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    began = time.perf_counter()
                    self._file(item)
                    self._stats.filing_s += time.perf_counter() - began
            except BaseException as error:  # surfaced to the engine at its next begin()/drain()
                self._error = error
            finally:
                if item is not None:
                    self._free.put(item.slot)
                self._queue.task_done()

    def _file(self, item: _Queued) -> None:
        slot, n = item.slot, item.num_tokens
        if self._cuda:
            slot.copied.synchronize()
        states, positions = slot.host[:n], slot.host_positions[:n]
        start = 0
        for req_id, count in item.layout:
            rows, where = states[start : start + count], positions[start : start + count]
            start += count
            with self._lock:
                request = self._requests.get(req_id)
            if request is None:
                raise RuntimeError(f"request {req_id!r} was never scheduled as a new request")
            inside = where < request.length
            if not bool(inside.all()):
                self._stats.beyond_prompt_tokens += int((~inside).sum())
                rows, where = rows[inside], where[inside]
            if where.numel() == 0:
                continue
            if request.states is None:
                raise RuntimeError(f"request {req_id!r} got prompt states after it was complete")
            first, last = int(where[0]), int(where[-1])
            if last - first + 1 == where.numel() and bool((where.diff() == 1).all()):
                request.states[first : last + 1].copy_(rows)  # the usual case: one range
                seen = request.filled[first : last + 1]
                self._stats.overwritten_tokens += int(seen.sum())
                seen.fill_(True)
            else:
                request.states.index_copy_(0, where, rows)
                self._stats.overwritten_tokens += int(request.filled[where].sum())
                request.filled[where] = True
            request.forwards += 1
            if bool(request.filled.all()):
                request.states = None  # unmap, then publish the complete file
                os.replace(request.path, request.final)
                request.path = request.final
        self._stats.forwards += 1
        self._stats.tokens += n

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"filing captured states failed: {error!r}") from error

    # ------------------------------------------------------------ the driver's side
    def drain(self) -> dict:
        """Wait until every queued forward is filed; return the requests and counters, then reset.

        ``requests``: engine request id -> ``{"file", "length", "missing", "forwards"}``.
        """
        self._queue.join()
        self._raise_thread_error()
        with self._lock:
            requests, self._requests = self._requests, {}
        stats = self._stats
        self._stats = _Stats()
        for request in requests.values():
            request.states = None
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
            },
        }

    def discard(self) -> None:
        """Forget every open request and delete its file (a reset between calls)."""
        self._queue.join()
        with self._lock:
            requests, self._requests = self._requests, {}
        for request in requests.values():
            request.states = None
            request.path.unlink(missing_ok=True)
        for leftover in self.out_dir.glob("*.bin"):  # published but never taken by the driver
            leftover.unlink()
        self._stats = _Stats()
        self._error = None

    def close(self) -> None:
        self.discard()
        self._queue.put(None)
        self._thread.join(timeout=10)
