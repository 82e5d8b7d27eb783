"""Where a training process runs: its rank, its device, and sums over ranks."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from draftflow.hardware import cpu_has_native_bf16


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_placement(device: str) -> Placement:
    """Start torch.distributed when torchrun launched us; pick this process's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but torch sees no CUDA device")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        chosen = torch.device("cuda", local_rank)
    else:
        chosen = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Placement(dist.get_rank() if world_size > 1 else 0, world_size, chosen)


def reduce_sum(metrics: dict[str, torch.Tensor], placement: Placement) -> dict[str, float]:
    """Sum speculators' counted metrics (``*_sum`` / ``*_total``) over ranks; to floats."""
    keys = sorted(metrics)
    stacked = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
    if placement.world_size > 1:
        dist.all_reduce(stacked)
    return dict(zip(keys, stacked.tolist(), strict=True))


def uses_bf16(device: torch.device, precision: str) -> bool:
    """train.precision: auto = bf16 autocast on GPUs (speculators' default) and on CPUs with
    native bf16 (AMX), fp32 on other CPUs (they emulate bf16: a GEMM of the draft's shape 90x slower than fp32)."""
    if precision != "auto":
        return precision == "bf16"
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())


def autocast(device: torch.device, precision: str):
    # bf16 matmuls with fp32 weights and optimizer state; on CPUs with AMX a bf16 GEMM of the
    # draft's shape ran several times faster than in fp32.
    if uses_bf16(device, precision):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
