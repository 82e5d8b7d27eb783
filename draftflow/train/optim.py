"""The optimizers and the learning-rate schedule."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from draftflow.hardware import cpu_has_native_bf16
from draftflow.train.settings import TrainSettings


def lr_factor(step: int, settings: TrainSettings, total_steps: int) -> float:
    """Linear warm-up, then cosine or linear decay to zero (or constant)."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.scheduler == "none":
        return 1.0
    progress = (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps)
    progress = min(1.0, progress)
    if settings.scheduler == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# torch's own orthogonalization, kept before build_optimizers may replace it in its module.
TORCH_ORTHOGONALIZE = torch.optim._muon._zeropower_via_newtonschulz


def orthogonalize_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalization (torch/optim/_muon.py) in float32: the
    same iteration, without the bf16 cast that CPUs lacking bf16 emulate slowly."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    matrix = grad.float().T if tall else grad.float()
    matrix = matrix / matrix.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = matrix @ matrix.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        matrix = torch.addmm(matrix, update, matrix, beta=a)
    return matrix.T if tall else matrix


def build_optimizers(
    model: torch.nn.Module, settings: TrainSettings, device: torch.device | None = None
) -> list:
    """speculators' optimizer choice (AdamW, or Muon for matrices + AdamW for the rest).

    On GPUs AdamW is the same optimizer with ``fused=True``: one kernel over all parameters
    instead of the foreach path's dozen passes over 1.2 GB of fp32 state for an 8B-shaped draft.
    The CPU keeps speculators' default implementation (bit-identical to earlier runs).
    """
    from speculators.train.optimizers import build_optimizers as speculators_optimizers

    if settings.optimizer == "adamw" and device is not None and device.type == "cuda":
        return [
            torch.optim.AdamW(
                model.named_parameters(),
                lr=settings.lr,
                weight_decay=settings.weight_decay,
                fused=True,
            )
        ]

    options = SimpleNamespace(
        optimizer=settings.optimizer,
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        muon_lr=settings.lr,
        muon_momentum=0.95,
        muon_weight_decay=settings.weight_decay,
        muon_ns_steps=5,
        muon_adjust_lr_fn="match_rms_adamw",
    )
    on_cpu = device is None or device.type == "cpu"
    if settings.optimizer == "muon" and on_cpu and not cpu_has_native_bf16():
        import torch.optim._muon as muon

        # torch's Muon looks its orthogonalization up in its module at every step.
        muon._zeropower_via_newtonschulz = orthogonalize_fp32
    return speculators_optimizers(model, options)
