"""Packed training batches streamed from capture-store shards.

Nothing is loaded up front: the shard indexes give every sample's length, batches are planned
from lengths alone, and a batch reads only its samples' rows through the shards' memory maps.
Each shard's sha256s are checked (``CaptureReader.verify``) the first time one of its samples is
read. The plan is a pure function of (seed, epoch), so step n always sees the same batch: a
resumed run just starts at its step.

Two orders (train.order): ``global`` shuffles every sample of every shard together each epoch;
``by_shard`` visits the shards in a seeded order (``draftflow.train.stream.shard_order``) and
shuffles the samples within each, so the batches of one (epoch, shard) are a contiguous run of
steps that reads that shard alone: the unit a link of the streamed mode trains. The plan needs
only the samples' lengths (``ShardLengths``), so a link plans every step before the other
shards are captured.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftflow.capture.quant import dequantize
from draftflow.capture.store import SCALES_NAME, CaptureReader
from draftflow.train.settings import ORDERS
from draftflow.train.stream import shard_order

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRef:
    shard: int
    index: int
    num_tokens: int


def planned_samples(lengths: Sequence[Sequence[int]], shard_ids: Sequence[int]) -> list[SampleRef]:
    """The trainable samples of shards of these lengths (a sample needs two tokens: the first
    has no previous hidden state after the shift)."""
    return [
        SampleRef(shard, i, n)
        for shard, shard_lengths in zip(shard_ids, lengths, strict=True)
        for i, n in enumerate(shard_lengths)
        if n >= 2
    ]


class ShardLengths:
    """The samples of every train shard from their lengths alone (the stream plan's), for a
    plan made before the shards are captured."""

    def __init__(self, lengths: Sequence[Sequence[int]]) -> None:
        self.lengths = [list(shard) for shard in lengths]
        self.num_shards = len(self.lengths)
        self.samples = planned_samples(self.lengths, range(self.num_shards))


class CaptureSet:
    """All samples of a list of shard directories, with their layer layout checked.

    ``shard_ids``: the shards' numbers in the plan (default 0, 1, ...); a streamed link opens
    only its own shard, whose samples keep their shard's number.
    """

    def __init__(
        self,
        shard_dirs: list[str | os.PathLike[str]],
        shard_ids: Sequence[int] | None = None,
    ) -> None:
        if not shard_dirs:
            raise ValueError("no capture shards given")
        self.readers = [CaptureReader(d, verify=False) for d in shard_dirs]
        ids = list(range(len(shard_dirs))) if shard_ids is None else list(shard_ids)
        self._by_id = dict(zip(ids, self.readers, strict=True))
        self.num_shards = len(ids)
        self._verified: set[int] = set()
        first = self.readers[0].manifest
        for reader in self.readers[1:]:
            for key in ("layer_ids", "aux_layer_ids", "hidden_size"):
                if reader.manifest[key] != first[key]:
                    raise ValueError(
                        f"shard {reader.shard_dir} has {key}={reader.manifest[key]}, "
                        f"but {self.readers[0].shard_dir} has {first[key]}"
                    )
        self.layer_ids: list[int] = list(first["layer_ids"])
        self.aux_layer_ids: list[int] = list(first["aux_layer_ids"])
        self.hidden_size = int(first["hidden_size"])
        final = [i for i in self.layer_ids if i not in self.aux_layer_ids]
        if len(final) != 1 or self.layer_ids[-1] != final[0]:
            raise ValueError(
                f"layer_ids {self.layer_ids} must be the aux ids {self.aux_layer_ids} then the "
                "final pre-norm layer id"
            )
        # Positions of the aux layers and of the final pre-norm state in hidden_states' L axis.
        self.aux_positions = [self.layer_ids.index(i) for i in self.aux_layer_ids]
        self.final_position = len(self.layer_ids) - 1
        self.lengths = [list(reader.num_tokens) for reader in self.readers]
        self.samples = planned_samples(self.lengths, ids)
        if not self.samples:
            raise ValueError(f"shards {[str(d) for d in shard_dirs]} hold no sample of >= 2 tokens")

    @property
    def manifest(self) -> dict:
        return self.readers[0].manifest

    def read(self, ref: SampleRef) -> dict[str, torch.Tensor]:
        reader = self._by_id[ref.shard]
        if ref.shard not in self._verified:
            reader.verify()
            self._verified.add(ref.shard)
        return reader.get(ref.index)


def pack(samples: list[SampleRef], order: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Greedy packing in ``order``: a batch takes samples while their shifted lengths fit.

    A sample longer than a whole batch gets a batch of its own and is cut to fit.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index in order:
        length = samples[index].num_tokens - 1
        if current and used + length > tokens_per_batch:
            batches.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        batches.append(current)
    return batches


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def within_shard_order(num_samples: int, seed: int, epoch: int, shard: int) -> list[int]:
    """train.order by_shard: the order of one shard's samples in one epoch."""
    key = hashlib.sha256(f"{seed}:{epoch}:{shard}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key[:7], "little"))
    return torch.randperm(num_samples, generator=generator).tolist()


@dataclass(frozen=True)
class Segment:
    """A contiguous run of steps: one epoch (order global) or one (epoch, shard) (by_shard)."""

    epoch: int
    shard: int | None
    # Packed batches, as indices into the plan's samples.
    batches: list[list[int]]
    start: int
    steps: int

    @property
    def end(self) -> int:
        return self.start + self.steps


class TrainPlan:
    """Which packed batches each step uses, over all epochs, for one data-parallel rank.

    Every step consumes ``world_size`` batches (one per rank); a segment's leftover batches
    (fewer than ``world_size``) are skipped so ranks stay in lock step. ``shards``: a
    ``CaptureSet`` or ``ShardLengths`` (only the samples' lengths are read).
    """

    def __init__(
        self,
        shards: CaptureSet | ShardLengths,
        tokens_per_batch: int,
        epochs: int,
        seed: int,
        world_size: int,
        max_steps: int | None,
        order: str,
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"train.order {order!r} is not one of {ORDERS}")
        self.shards = shards
        self.samples = shards.samples
        self.num_shards = shards.num_shards
        self.tokens_per_batch = tokens_per_batch
        self.seed = seed
        self.world_size = world_size
        self.order = order
        self._members: dict[int, list[int]] = {}
        for index, ref in enumerate(self.samples):
            self._members.setdefault(ref.shard, []).append(index)
        self.segments: list[Segment] = []
        self._ends: list[int] = []
        self._epoch_starts: dict[int, int] = {}
        for epoch in range(epochs):
            self._plan_epoch(epoch)
        if not any(segment.steps for segment in self.segments):
            raise ValueError(
                f"{len(self.samples)} train samples make fewer packed batches than the "
                f"{world_size} data-parallel ranks"
            )
        planned = self.segments[-1].end
        self.total_steps = planned if max_steps is None else max_steps
        # max_steps beyond the planned epochs keeps cycling through further epochs.
        extra = epochs
        while self.segments[-1].end < self.total_steps:
            self._plan_epoch(extra)
            extra += 1

    def _plan_epoch(self, epoch: int) -> None:
        if self.order == "global":
            order = epoch_order(len(self.samples), self.seed, epoch)
            self._add_segment(epoch, None, pack(self.samples, order, self.tokens_per_batch))
            return
        for shard in shard_order(self.num_shards, self.seed, epoch):
            members = self._members.get(shard, [])
            order = within_shard_order(len(members), self.seed, epoch, shard)
            batches = pack(self.samples, [members[i] for i in order], self.tokens_per_batch)
            self._add_segment(epoch, shard, batches)

    def _add_segment(self, epoch: int, shard: int | None, batches: list[list[int]]) -> None:
        start = self.segments[-1].end if self.segments else 0
        steps = len(batches) // self.world_size
        self.segments.append(Segment(epoch, shard, batches, start, steps))
        self._ends.append(start + steps)
        self._epoch_starts.setdefault(epoch, start)

    @property
    def steps_per_epoch(self) -> list[int]:
        counts: dict[int, int] = {}
        for segment in self.segments:
            counts[segment.epoch] = counts.get(segment.epoch, 0) + segment.steps
        return [counts[epoch] for epoch in sorted(counts)]

    def segment(self, step: int) -> Segment:
        found = bisect.bisect_right(self._ends, step)
        if step < 0 or found == len(self.segments):
            raise IndexError(f"step beyond the plan of {self.total_steps} steps")
        return self.segments[found]

    def span(self, epoch: int, shard: int) -> tuple[int, int]:
        """Steps [start, end) of one (epoch, shard) of a by_shard plan: one streamed link."""
        for segment in self.segments:
            if (segment.epoch, segment.shard) == (epoch, shard):
                return segment.start, min(segment.end, self.total_steps)
        raise KeyError(f"no segment of shard {shard} in epoch {epoch} (order {self.order})")

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global step."""
        epoch = self.segment(step).epoch
        return epoch, step - self._epoch_starts[epoch]

    def batch(self, step: int, rank: int = 0) -> list[SampleRef]:
        segment = self.segment(step)
        indices = segment.batches[(step - segment.start) * self.world_size + rank]
        return [self.samples[i] for i in indices]


def val_batches(
    shards: CaptureSet, tokens_per_batch: int, rank: int = 0, world_size: int = 1
) -> list[list[SampleRef]]:
    """Validation batches in file order; rank r takes batches r, r + W, ..."""
    packed = pack(shards.samples, list(range(len(shards.samples))), tokens_per_batch)
    return [[shards.samples[i] for i in b] for b in packed[rank::world_size]]


def collate(
    shards: CaptureSet,
    refs: list[SampleRef],
    tokens_per_batch: int,
    hidden_dtype: torch.dtype,
    pad: bool = False,
    pin: bool = False,
    dequantize_states: bool = True,
) -> dict[str, torch.Tensor]:
    """One packed sequence ``[1, T, ...]`` in the layout ``Eagle3DraftModel.forward`` expects.

    Per sample, speculators' ``shift_batch`` pairs token t+1 with the hidden states of token t
    and the target's final state at t+1 (whose next-token distribution is the training target).
    ``pad`` fills the batch up to ``tokens_per_batch`` as speculators' collate does (document id
    -1, no loss): compiled GPU kernels then see one shape instead of recompiling per batch.
    ``pin`` allocates the hidden states in page-locked memory for an asynchronous GPU copy.

    fp8 stores are dequantized into the batch here, unless ``dequantize_states`` is false: then
    the batch keeps the fp8 states plus their scales (``*_scales``, half the bytes to copy to a
    GPU) and ``dequantize_batch`` turns it into the model's layout on the device.

    Hidden states (hundreds of MB a step for an 8B-shaped target) are copied once, from the
    store's rows straight into the batch: gathering, concatenating, padding and pinning as
    separate steps made four more copies and starved two GPUs.
    """
    from speculators.models.eagle3 import shift_batch

    parts: list[dict[str, torch.Tensor]] = []
    used = 0
    scaled: bool | None = None
    for ref in refs:
        raw = shards.read(ref)
        states = raw["hidden_states"]
        scales = raw.get(SCALES_NAME)
        if scaled is None:
            scaled = scales is not None
        elif scaled != (scales is not None):
            raise ValueError("a batch mixes fp8 and bf16 shards: extract them with one store_dtype")
        length = int(states.shape[0])
        # Views only: the layer selection happens in the copy below.
        sample = shift_batch(
            {
                "input_ids": raw["input_ids"].to(torch.long),
                "hidden_states": states,
                "verifier_last_hidden_states": states,
                "loss_mask": raw["loss_mask"].to(torch.bool),
                "lengths": torch.tensor([length], dtype=torch.long),
                "position_ids": torch.arange(length, dtype=torch.long),
            }
        )
        keep = min(int(sample["lengths"][0]), tokens_per_batch - used)
        if keep <= 0:
            break
        if scales is not None:
            # The same shift as the states: token t's aux states, token t+1's final state.
            sample["hidden_scales"] = scales[:-1]
            sample["verifier_last_scales"] = scales[1:]
        parts.append({k: v[:keep] for k, v in sample.items() if k != "lengths"})
        used += keep
    total = tokens_per_batch if pad else used
    aux, final = shards.aux_positions, shards.final_position
    width = int(parts[0]["hidden_states"].shape[-1])
    keep_fp8 = bool(scaled) and not dequantize_states
    dtype = parts[0]["hidden_states"].dtype if keep_fp8 else hidden_dtype
    hidden = torch.empty((1, total, len(aux) * width), dtype=dtype, pin_memory=pin)
    last = torch.empty((1, total, width), dtype=dtype, pin_memory=pin)
    if keep_fp8:
        hidden_scales = torch.zeros((1, total, len(aux)), dtype=torch.float32, pin_memory=pin)
        last_scales = torch.zeros((1, total), dtype=torch.float32, pin_memory=pin)
    offset = 0
    for part in parts:
        rows = slice(offset, offset + part["input_ids"].shape[0])
        for slot, layer in enumerate(aux):
            states = part["hidden_states"][:, layer]
            if scaled and not keep_fp8:
                states = dequantize(states, part["hidden_scales"][:, layer], hidden_dtype)
            hidden[0, rows, slot * width : (slot + 1) * width].copy_(states)
        states = part["verifier_last_hidden_states"][:, final]
        if scaled and not keep_fp8:
            states = dequantize(states, part["verifier_last_scales"][:, final], hidden_dtype)
        last[0, rows].copy_(states)
        if keep_fp8:
            hidden_scales[0, rows].copy_(part["hidden_scales"][:, aux])
            last_scales[0, rows].copy_(part["verifier_last_scales"][:, final])
        offset = rows.stop
    # Zero bytes are 0.0 in bf16, fp32 and e4m3 alike.
    hidden[0, used:].view(torch.uint8).zero_()
    last[0, used:].view(torch.uint8).zero_()
    small = ("input_ids", "loss_mask", "position_ids")
    batch = {key: torch.cat([p[key] for p in parts]).unsqueeze(0) for key in small}
    batch["document_ids"] = torch.cat(
        [torch.full((p["input_ids"].shape[0],), d, dtype=torch.long) for d, p in enumerate(parts)]
    ).unsqueeze(0)
    if total > used:
        for key, value in batch.items():
            fill = -1 if key == "document_ids" else 0
            filler = value.new_full((1, total - used), fill)
            batch[key] = torch.cat([value, filler], dim=1)
    batch["hidden_states"] = hidden
    batch["verifier_last_hidden_states"] = last
    if keep_fp8:
        batch["hidden_scales"] = hidden_scales
        batch["verifier_last_scales"] = last_scales
    return batch


def dequantize_batch(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A batch from ``collate(dequantize_states=False)`` in the model's layout, on its device.

    Batches without scales (bf16 stores, or already dequantized) are returned as they are.
    """
    if "hidden_scales" not in batch:
        return batch
    batch = dict(batch)
    hidden_scales = batch.pop("hidden_scales")
    last_scales = batch.pop("verifier_last_scales")
    hidden = batch["hidden_states"]
    num_aux = int(hidden_scales.shape[-1])
    # [1, T, A * H] → [1, T, A, H]: one scale per token and aux layer.
    per_layer = hidden.view(*hidden.shape[:-1], num_aux, hidden.shape[-1] // num_aux)
    batch["hidden_states"] = dequantize(per_layer, hidden_scales, dtype).flatten(-2)
    batch["verifier_last_hidden_states"] = dequantize(
        batch["verifier_last_hidden_states"], last_scales, dtype
    )
    return batch
