"""The capture store: one directory of safetensors chunks per shard (docs/design.md).

Layout of a shard directory:

- ``chunk-NNNNN.safetensors``: ``hidden_states`` ``[T, L, H]`` in the store dtype (bf16, or fp8
  e4m3 with ``hidden_scales`` float32 ``[T, L]`` beside it: ``draftflow/capture/quant.py``),
  ``input_ids`` int32 ``[T]``, ``loss_mask`` int8 ``[T]``; T = the tokens of the chunk's samples
  concatenated in sample order. The file holds the tensors in that order (states first), as laid
  out by ``draftflow/capture/chunk_file.py``.
  The chunk's safetensors metadata (one key, ``draftflow``, a JSON string) lists its samples and
  rows, so a restarted job can rebuild the index from the chunks alone.
- ``index.json``: ``{"samples": [{"id", "chunk", "start", "end"}, ...]}``.
- ``manifest.json``: sizes, layer ids, provenance and the sha256 of every other file.

Chunk k always holds samples ``[k * chunk_samples, (k + 1) * chunk_samples)`` of the input order,
so a run that was killed and resumed writes the same bytes as one that was not. Chunks are
written on their own threads while the caller goes on adding samples (on a GPU the store must
keep up with prefill: about 1.4 GB/s of states for an 8B-shaped target); each chunk's sha256 is
taken from the bytes as they are written. A caller that knows the samples' lengths up front
(``expect()``, as the extract stage does) has each sample written as soon as it is added, so
closing the store waits for the last sample only, not for the last chunk.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from draftflow.capture.chunk_file import SCALES_NAME, ChunkLayout, ChunkStream
from draftflow.capture.quant import (
    BF16,
    SCALE_DTYPE,
    Quantized,
    dequantize,
    is_scaled,
    torch_dtype,
)
from draftflow.io import atomic_write_json, read_json, sha256_file

log = logging.getLogger(__name__)

# /2: the streamed layout of draftflow/capture/chunk_file.py (states first, small tensors last).
CHUNK_FORMAT = "draftflow-capture-chunk/2"
INDEX_NAME = "index.json"
MANIFEST_NAME = "manifest.json"
_CHUNK_RE = re.compile(r"^chunk-(\d{5})\.safetensors$")


class CorruptCaptureError(RuntimeError):
    """A shard directory whose files do not match its manifest (or that has none)."""


def chunk_name(index: int) -> str:
    return f"chunk-{index:05d}.safetensors"


def _canonical_json(obj: Any) -> str:
    # Sorted keys and fixed separators: chunk headers must be byte-identical across runs.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


class CaptureWriter:
    """Append captured samples in input order; resumable after a kill.

    ``meta`` (model path, model_revision, vllm_version, backend, ...) goes into the manifest and,
    as a fingerprint, into every chunk: chunks written under different settings are discarded on
    resume instead of being mixed in. It must therefore be deterministic (no timestamps).
    ``write_threads``: chunks that have all their samples and may still be writing, besides
    the one being filled; ``add()`` waits for the oldest when there would be more.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        layer_ids: list[int],
        aux_layer_ids: list[int],
        hidden_size: int,
        meta: dict,
        # extract.chunk_samples and extract.store_dtype: the job's, no defaults here.
        chunk_samples: int,
        store_dtype: str,
        write_threads: int = 2,
    ) -> None:
        if chunk_samples < 1:
            raise ValueError(f"chunk_samples must be >= 1, got {chunk_samples}")
        if list(layer_ids[: len(aux_layer_ids)]) != list(aux_layer_ids):
            raise ValueError(
                f"layer_ids {layer_ids} must start with aux_layer_ids {aux_layer_ids} "
                "(aux layers first, then the final pre-norm layer)"
            )
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = [int(i) for i in layer_ids]
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self.hidden_size = int(hidden_size)
        self.meta = dict(meta)
        self.chunk_samples = int(chunk_samples)
        torch_dtype(store_dtype)  # an unknown dtype fails here, before any chunk is kept
        self.store_dtype = store_dtype
        self._identity = {
            "format": CHUNK_FORMAT,
            "layer_ids": self.layer_ids,
            "hidden_size": self.hidden_size,
            "chunk_samples": self.chunk_samples,
            "meta": _canonical_json(self.meta),
            "store_dtype": self.store_dtype,
        }
        # Per written chunk: its sample entries [(id, start, end)], in chunk order.
        self._chunks: list[list[tuple[str, int, int]]] = []
        self._seen: set[str] = set()
        self._buffer: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._closed = False
        # With expect(): the samples announced, the count added so far and the chunk being
        # filled (its file is written as its samples come).
        self._expected: list[tuple[str, int]] | None = None
        self._added = 0
        self._open: ChunkStream | None = None
        # Chunks with all their samples still being written, oldest first (at most
        # write_threads of them besides the open one), and the sha256 of every chunk written.
        self._max_pending = max(1, write_threads)
        self._pending: list[ChunkStream] = []
        self._digests: dict[str, str] = {}
        self._recover()

    # ------------------------------------------------------------------ resume
    def _recover(self) -> None:
        """Keep the longest run chunk-00000, chunk-00001, ... of complete, matching chunks."""
        for stale in (INDEX_NAME, MANIFEST_NAME):
            # A finished shard is rebuilt from its chunks; its old index/manifest must not
            # outlive a changed chunk set.
            (self.out_dir / stale).unlink(missing_ok=True)
        for tmp in self.out_dir.glob(".*.tmp"):
            tmp.unlink()
        existing = sorted(p for p in self.out_dir.iterdir() if _CHUNK_RE.match(p.name))
        keep = True
        for expected_index, path in enumerate(existing):
            entries = self._read_chunk_entries(path) if keep else None
            complete = entries is not None and len(entries) == self.chunk_samples
            if keep and complete and path.name == chunk_name(expected_index):
                self._chunks.append(entries)
                self._seen.update(sample_id for sample_id, _, _ in entries)
                continue
            # A gap, a short (last) chunk or a foreign chunk ends the kept prefix: its
            # samples are captured again, which rewrites the same bytes.
            keep = False
            log.info("capture store %s: discarding %s on resume", self.out_dir, path.name)
            path.unlink()
        if self._chunks:
            log.info(
                "capture store %s: resuming after %d complete chunk(s), %d sample(s)",
                self.out_dir,
                len(self._chunks),
                len(self._seen),
            )

    def _read_chunk_entries(self, path: Path) -> list[tuple[str, int, int]] | None:
        try:
            with safe_open(path, framework="pt") as handle:
                header = json.loads((handle.metadata() or {}).get("draftflow", "null"))
        except Exception as error:  # a truncated or foreign file: recapture it
            log.warning("capture store: unreadable chunk %s (%s)", path, error)
            return None
        if not isinstance(header, dict):
            return None
        identity = {key: header.get(key) for key in self._identity}
        if identity != self._identity:
            return None
        return [(str(s), int(a), int(b)) for s, a, b in header["samples"]]

    def done_ids(self) -> set[str]:
        """Samples already in complete chunks: the caller skips them on resume."""
        return {sample_id for chunk in self._chunks for sample_id, _, _ in chunk}

    def resume_position(self, sample_ids: Iterable[str]) -> int:
        """Check that the kept chunks are a prefix of ``sample_ids``; return its length.

        A resumed job must see the same input order, or the deterministic chunk boundaries
        would no longer hold.
        """
        done = [sample_id for chunk in self._chunks for sample_id, _, _ in chunk]
        head = list(sample_ids)[: len(done)]
        if head != done:
            raise ValueError(
                f"capture store {self.out_dir}: the complete chunks hold {len(done)} samples "
                "that are not the start of this input (input order changed?); "
                "delete the directory to start over"
            )
        return len(done)

    # ------------------------------------------------------------------ writing
    def expect(self, samples: Iterable[tuple[str, int]]) -> None:
        """Declare every sample still to come, as (id, token count) in ``add()`` order.

        With the lengths known, each chunk's file is laid out before its samples arrive and
        every sample is written as soon as it is added, so ``close()`` is left with the last
        sample only. Without it, a chunk is written once it is full. Call it before ``add()``.
        """
        if self._closed or self._added:
            raise RuntimeError("CaptureWriter.expect() must come before the first add()")
        if self._expected is not None:
            raise RuntimeError("CaptureWriter.expect() called twice")
        expected = [(str(sample_id), int(length)) for sample_id, length in samples]
        for sample_id, length in expected:
            if length < 1:
                raise ValueError(f"expected sample {sample_id!r} has {length} tokens")
        again = sorted(self._seen & {sample_id for sample_id, _ in expected})
        if again or len({sample_id for sample_id, _ in expected}) != len(expected):
            raise ValueError(f"expected samples repeat or are already stored: {again[:5]}")
        self._expected = expected

    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden_states: torch.Tensor | Quantized,
    ) -> None:
        """Hand over one sample (int32 [T], int8 [T], float [T, L, H]), in input order.

        An fp8 store also takes states already quantized (``Quantized``, as the hooks backend's
        worker hands them over) and writes them as they are.
        It is written on the chunk's thread: at once after ``expect()``, else when its chunk is
        full. Blocks only while ``write_threads`` finished chunks are still being written.
        """
        if self._closed:
            raise RuntimeError("CaptureWriter.add() after close()")
        if sample_id in self._seen:
            raise ValueError(f"sample {sample_id!r} is already in the store {self.out_dir}")
        input_ids = torch.as_tensor(input_ids)
        loss_mask = torch.as_tensor(loss_mask)
        num_tokens = int(input_ids.shape[0]) if input_ids.dim() == 1 else -1
        expected = (num_tokens, len(self.layer_ids), self.hidden_size)
        if num_tokens < 1 or tuple(loss_mask.shape) != (num_tokens,):
            raise ValueError(
                f"sample {sample_id!r}: input_ids {tuple(input_ids.shape)} and loss_mask "
                f"{tuple(loss_mask.shape)} must be 1-D of the same non-zero length"
            )
        if tuple(hidden_states.shape) != expected:
            raise ValueError(
                f"sample {sample_id!r}: hidden_states shape {tuple(hidden_states.shape)}, "
                f"expected [T, L, H] = {list(expected)}"
            )
        if isinstance(hidden_states, Quantized):
            if not is_scaled(self.store_dtype) or hidden_states.values.dtype != torch_dtype(
                self.store_dtype
            ):
                raise ValueError(
                    f"sample {sample_id!r}: states quantized to {hidden_states.values.dtype} "
                    f"for a {self.store_dtype} store"
                )
            if tuple(hidden_states.scales.shape) != expected[:2]:
                raise ValueError(
                    f"sample {sample_id!r}: scales shape {tuple(hidden_states.scales.shape)}, "
                    f"expected [T, L] = {list(expected[:2])}"
                )
        if self._expected is not None:
            self._check_expected(sample_id, num_tokens)
        self._seen.add(sample_id)
        self._added += 1
        if isinstance(hidden_states, Quantized):  # written as they are
            states = Quantized(hidden_states.values.cpu(), hidden_states.scales.cpu())
        elif is_scaled(self.store_dtype):  # quantized on the chunk's writer thread
            states = hidden_states.detach().cpu()
        else:  # the captured tensor, usually a memory map: no copy
            states = hidden_states.detach().to(torch.bfloat16).cpu()
        sample = (
            sample_id,
            input_ids.to(torch.int32).cpu(),
            loss_mask.to(torch.int8).cpu(),
            states,
        )
        try:
            self._write(sample)
        except BaseException:
            self._abandon()
            raise

    def _write(self, sample: tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        if self._expected is None:
            self._buffer.append(sample)
            if len(self._buffer) == self.chunk_samples:
                self._flush()
            return
        if self._open is None:
            first = self._added - 1
            planned = self._expected[first : first + self.chunk_samples]
            self._open = self._open_chunk(planned)
        _, ids, mask, states = sample
        self._open.put(states, ids, mask)
        if self._open.complete:
            self._hand_over(self._open)
            self._open = None

    def _abandon(self) -> None:
        """A chunk's write failed: let every other chunk's writer end before the error goes up
        (each removes its temporary file, or publishes its complete chunk for a resume)."""
        self._closed = True
        self._abort_open()
        for stream in self._pending:
            stream.settle()
        self._pending.clear()

    def _check_expected(self, sample_id: str, num_tokens: int) -> None:
        assert self._expected is not None
        position = self._added
        if position >= len(self._expected):
            raise ValueError(
                f"sample {sample_id!r} is one more than the {len(self._expected)} expected"
            )
        want_id, want_tokens = self._expected[position]
        if (sample_id, num_tokens) != (want_id, want_tokens):
            raise ValueError(
                f"sample {position} of this run is {sample_id!r} with {num_tokens} tokens; "
                f"expect() announced {want_id!r} with {want_tokens} tokens"
            )

    def _open_chunk(self, samples: list[tuple[str, int]]) -> ChunkStream:
        """Start the next chunk's file from its samples' ids and token counts."""
        entries: list[tuple[str, int, int]] = []
        row = 0
        for sample_id, length in samples:
            entries.append((sample_id, row, row + length))
            row += length
        header = {
            **self._identity,
            "chunk_index": len(self._chunks) + len(self._pending),
            "samples": [list(entry) for entry in entries],
        }
        layout = ChunkLayout(
            entries=tuple(entries),
            num_layers=len(self.layer_ids),
            hidden_size=self.hidden_size,
            store_dtype=self.store_dtype,
            # One metadata key only: its JSON is canonical, so the header's bytes are too.
            metadata={"draftflow": _canonical_json(header)},
        )
        return ChunkStream(self.out_dir / chunk_name(header["chunk_index"]), layout)

    def _flush(self) -> None:
        """Write the buffered samples (added without ``expect()``) as the next chunk."""
        if not self._buffer:
            return
        stream = self._open_chunk(
            [(sample_id, int(ids.shape[0])) for sample_id, ids, _, _ in self._buffer]
        )
        for _, ids, mask, states in self._buffer:
            stream.put(states, ids, mask)
        self._buffer = []
        self._hand_over(stream)

    def _hand_over(self, stream: ChunkStream) -> None:
        """A chunk has all its samples: let it finish on its thread; keep a bounded number."""
        self._pending.append(stream)
        while len(self._pending) > self._max_pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        stream = self._pending.pop(0)
        self._digests[stream.final.name] = stream.result()  # a failed write raises here
        self._chunks.append(list(stream.layout.entries))

    def wait_written(self) -> None:
        """Block until every chunk with all its samples is on disk; raise the first error after
        every one of them has finished (no writer thread outlives a failed call)."""
        first_error: BaseException | None = None
        while self._pending:
            try:
                self._finish_oldest()
            except BaseException as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _abort_open(self) -> None:
        open_stream, self._open = self._open, None
        if open_stream is not None:
            open_stream.abort()

    def close(self) -> dict:
        """Write the last (short) chunk, then index.json and manifest.json; return the manifest."""
        if self._closed:
            raise RuntimeError("CaptureWriter.close() called twice")
        self._closed = True
        cut_short = self._expected is not None and self._added != len(self._expected)
        try:
            if not cut_short:
                self._flush()
            self.wait_written()  # chunks with all their samples are kept, cut short or not
        finally:
            self._abort_open()
        if cut_short:
            raise ValueError(
                f"capture store {self.out_dir}: close() after {self._added} of the "
                f"{len(self._expected or [])} samples announced by expect(); the complete "
                "chunks are kept for a resumed run"
            )
        samples = []
        num_tokens = 0
        for index, entries in enumerate(self._chunks):
            for sample_id, start, end in entries:
                samples.append(
                    {"id": sample_id, "chunk": chunk_name(index), "start": start, "end": end}
                )
                num_tokens += end - start
        atomic_write_json(self.out_dir / INDEX_NAME, {"samples": samples})
        files = {
            name: self._digests.get(name) for name in map(chunk_name, range(len(self._chunks)))
        }
        # Chunks kept from a killed run were not written here: hash those from disk.
        files = {n: digest or sha256_file(self.out_dir / n) for n, digest in files.items()}
        files[INDEX_NAME] = sha256_file(self.out_dir / INDEX_NAME)
        manifest = {
            **self.meta,
            "num_samples": len(samples),
            "num_tokens": num_tokens,
            "num_chunks": len(self._chunks),
            "chunk_samples": self.chunk_samples,
            "layer_ids": self.layer_ids,
            "aux_layer_ids": self.aux_layer_ids,
            "hidden_size": self.hidden_size,
            "dtype": self.store_dtype,
            **({"scales": scales_description()} if is_scaled(self.store_dtype) else {}),
            "files": files,
            "complete": True,
        }
        atomic_write_json(self.out_dir / MANIFEST_NAME, manifest)
        return manifest


def scales_description() -> dict:
    """What an fp8 manifest says about its scales (they live in every chunk)."""
    return {
        "tensor": SCALES_NAME,
        "dtype": str(SCALE_DTYPE).removeprefix("torch."),
        "shape": "[T, L]",
        "per": "token and layer",
        "value": "amax of the row / 448 (e4m3's largest finite value): no value saturates",
        "dequantize": "hidden_states.float() * hidden_scales[..., None]",
    }


def update_manifest(shard_dir: str | os.PathLike[str], fields: dict) -> dict:
    """Add fields (e.g. verification results) to a finished shard's manifest; return it."""
    path = Path(shard_dir) / MANIFEST_NAME
    manifest = read_json(path)
    reserved = {"files", "complete", "num_samples", "num_tokens", "layer_ids"} & set(fields)
    if reserved:
        raise ValueError(f"update_manifest may not change {sorted(reserved)}")
    manifest.update(fields)
    atomic_write_json(path, manifest)
    return manifest


class CaptureReader:
    """Random access to a finished shard; tensors are read through memory maps, slice by slice."""

    def __init__(self, shard_dir: str | os.PathLike[str], verify: bool = True) -> None:
        self.shard_dir = Path(shard_dir)
        manifest_path = self.shard_dir / MANIFEST_NAME
        if not manifest_path.is_file():
            raise CorruptCaptureError(f"{manifest_path} is missing: the shard is incomplete")
        self.manifest: dict = read_json(manifest_path)
        if not self.manifest.get("complete"):
            raise CorruptCaptureError(f"{manifest_path} does not say complete: true")
        if verify:
            self.verify()
        index = read_json(self.shard_dir / INDEX_NAME)["samples"]
        self._index: list[dict] = index
        self.sample_ids: list[str] = [entry["id"] for entry in index]
        self.num_tokens: list[int] = [entry["end"] - entry["start"] for entry in index]
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.store_dtype: str = self.manifest.get("dtype", BF16)
        self._handles: dict[str, Any] = {}

    def verify(self) -> None:
        """Raise CorruptCaptureError naming the first file whose sha256 differs from the manifest."""
        for name, expected in sorted(self.manifest["files"].items()):
            path = self.shard_dir / name
            if not path.is_file():
                raise CorruptCaptureError(f"{path} is listed in the manifest but missing")
            actual = sha256_file(path)
            if actual != expected:
                raise CorruptCaptureError(
                    f"{path} is corrupt: sha256 {actual} != {expected} in {MANIFEST_NAME}"
                )

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _handle(self, name: str) -> Any:
        # Handles are opened lazily (and dropped on pickling) so DataLoader workers open their own.
        if name not in self._handles:
            self._handles[name] = safe_open(self.shard_dir / name, framework="pt")
        return self._handles[name]

    def get(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i as stored: ``input_ids`` int32 [T], ``loss_mask`` int8 [T], ``hidden_states``
        [T, L, H] in the store dtype and, in fp8 stores, ``hidden_scales`` float32 [T, L]."""
        entry = self._index[i]
        handle = self._handle(entry["chunk"])
        rows = slice(entry["start"], entry["end"])
        names = ["input_ids", "loss_mask", "hidden_states"]
        if is_scaled(self.store_dtype):
            names.append(SCALES_NAME)
        return {name: handle.get_slice(name)[rows] for name in names}

    def hidden_states(self, i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Sample i's states ``[T, L, H]`` in ``dtype``, dequantized where the store is fp8."""
        sample = self.get(i)
        return dequantize(sample["hidden_states"], sample.get(SCALES_NAME), dtype)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def close(self) -> None:
        self._handles.clear()
