"""Training settings (the config's ``train:`` section), checked once at start."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

OPTIMIZERS = ("adamw", "muon")
SCHEDULERS = ("cosine", "linear", "none")
ATTN_IMPLS = ("auto", "packed_sdpa", "sdpa", "eager", "simple_flex_attention")
LOSS_IMPLS = ("auto", "eager", "fused")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "fp32")
ORDERS = ("global", "by_shard")
VARIANTS = ("eagle3", "eagle3.1")
# Settings that change what is logged or kept, never the trained weights.
_BOOKKEEPING = frozenset({"eval_every", "checkpoint_every", "keep_checkpoints", "log_every"})


@dataclass(frozen=True)
class TrainSettings:
    num_layers: int
    ttt_steps: int
    ttt_step_loss_decay: float
    # A speculators loss name (kl_div, rkl, jsd, ce, tv, nla, lk_hybrid) or a JSON weight dict.
    loss: str
    loss_implementation: str
    epochs: int
    max_steps: int | None
    tokens_per_batch: int
    optimizer: str
    lr: float
    weight_decay: float
    scheduler: str
    warmup_steps: int
    grad_clip: float
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int
    log_every: int
    seed: int
    device: str
    attn_impl: str
    # auto: bf16 autocast on GPUs, fp32 on the CPU; bf16 / fp32 force one everywhere
    precision: str
    # CPU threads for torch (0: leave torch's default).
    threads: int
    # global: all shards shuffled together each epoch; by_shard: one shard after another
    # (the streamed mode's order, draftflow/train/captures.py)
    order: str
    # eagle3: one RMSNorm over the concatenated aux states; eagle3.1: one per aux layer
    variant: str

    def __post_init__(self) -> None:
        choices = {
            "optimizer": OPTIMIZERS,
            "scheduler": SCHEDULERS,
            "attn_impl": ATTN_IMPLS,
            "loss_implementation": LOSS_IMPLS,
            "device": DEVICES,
            "precision": PRECISIONS,
            "order": ORDERS,
            "variant": VARIANTS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"train.{name} {getattr(self, name)!r} is not one of {allowed}")
        positive = ("num_layers", "ttt_steps", "epochs", "tokens_per_batch", "eval_every")
        positive += ("checkpoint_every", "keep_checkpoints", "log_every")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        # speculators names the losses; fail at start, not after the data is loaded.
        from speculators.losses import resolve_loss_config

        try:
            resolve_loss_config(self.loss, "eager")
        except ValueError as error:
            raise ValueError(f"train.loss {self.loss!r}: {error}") from None
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"train.max_steps must be >= 1 or null, got {self.max_steps}")

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """Hash of the settings that shape the weights: a checkpoint from others is not resumed."""
        shaping = {k: v for k, v in self.to_dict().items() if k not in _BOOKKEEPING}
        return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()
