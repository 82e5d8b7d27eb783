"""Packed training batches streamed from capture-store shards.

Nothing is loaded up front: the shard indexes give every sample's length, batches are planned
from lengths alone, and a batch reads only its samples' rows through the shards' memory maps.
Each shard's sha256s are checked (``CaptureReader.verify``) the first time one of its samples is
read. The plan is a pure function of (seed, epoch), so step n always sees the same batch: a
resumed run just starts at its step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from draftflow.capture.quant import dequantize
from draftflow.capture.store import SCALES_NAME, CaptureReader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRef:
    shard: int
    index: int
    num_tokens: int


class CaptureSet:
    """All samples of a list of shard directories, with their layer layout checked."""

    def __init__(self, shard_dirs: list[str | os.PathLike[str]]) -> None:
        if not shard_dirs:
            raise ValueError("no capture shards given")
        self.readers = [CaptureReader(d, verify=False) for d in shard_dirs]
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
        # A sample needs two tokens: the first has no previous hidden state after the shift.
        self.samples = [
            SampleRef(s, i, n)
            for s, reader in enumerate(self.readers)
            for i, n in enumerate(reader.num_tokens)
            if n >= 2
        ]
        if not self.samples:
            raise ValueError(f"shards {[str(d) for d in shard_dirs]} hold no sample of >= 2 tokens")

    @property
    def manifest(self) -> dict:
        return self.readers[0].manifest

    def read(self, ref: SampleRef) -> dict[str, torch.Tensor]:
        if ref.shard not in self._verified:
            self.readers[ref.shard].verify()
            self._verified.add(ref.shard)
        return self.readers[ref.shard].get(ref.index)


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


class TrainPlan:
    """Which packed batches each step uses, over all epochs, for one data-parallel rank.

    Every step consumes ``world_size`` batches (one per rank); an epoch's leftover batches
    (fewer than ``world_size``) are skipped so ranks stay in lock step.
    """

    def __init__(
        self,
        shards: CaptureSet,
        tokens_per_batch: int,
        epochs: int,
        seed: int,
        world_size: int = 1,
        max_steps: int | None = None,
    ) -> None:
        self.shards = shards
        self.tokens_per_batch = tokens_per_batch
        self.seed = seed
        self.world_size = world_size
        self._epochs: list[list[list[int]]] = []
        for epoch in range(epochs):
            order = epoch_order(len(shards.samples), seed, epoch)
            self._epochs.append(pack(shards.samples, order, tokens_per_batch))
        self.steps_per_epoch = [len(b) // world_size for b in self._epochs]
        if not any(self.steps_per_epoch):
            raise ValueError(
                f"{len(shards.samples)} train samples make fewer packed batches than the "
                f"{world_size} data-parallel ranks"
            )
        planned = sum(self.steps_per_epoch)
        self.total_steps = planned if max_steps is None else max_steps
        # max_steps beyond the planned epochs keeps cycling through further epochs.
        extra = epochs
        while sum(self.steps_per_epoch) < self.total_steps:
            order = epoch_order(len(shards.samples), seed, extra)
            self._epochs.append(pack(shards.samples, order, tokens_per_batch))
            self.steps_per_epoch.append(len(self._epochs[-1]) // world_size)
            extra += 1

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global step."""
        for epoch, count in enumerate(self.steps_per_epoch):
            if step < count:
                return epoch, step
            step -= count
        raise IndexError(f"step beyond the plan of {self.total_steps} steps")

    def batch(self, step: int, rank: int = 0) -> list[SampleRef]:
        epoch, within = self.position(step)
        indices = self._epochs[epoch][within * self.world_size + rank]
        return [self.shards.samples[i] for i in indices]


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
    separate steps made four more copies and starved two GPUs (docs/benchmarks.md).
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
