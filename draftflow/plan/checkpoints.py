"""Disk of the training's resumable checkpoints, from the target's shape and the train section.

A checkpoint (``draftflow.train.checkpoint.save_checkpoint``) holds the draft's trainable weights
and their optimizer state, both fp32 whatever ``train.precision`` is; the embedding and lm_head
are frozen (speculators builds them from the target and the vocab) and not saved. The newest
``train.keep_checkpoints`` stay under results/train/checkpoints/ beside the captures; in the
streamed mode every link writes one, so they count towards the window's peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from draftflow.plan.engines import aux_layer_count, draft_matrix_parameters, size_text
from draftflow.plan.target_shape import TargetShape

CHECKPOINT_DIR = "results/train/checkpoints"
FP32_BYTES = 4
# Optimizer state per parameter, in fp32 values: AdamW keeps two moments, Muon one momentum
# (speculators routes the layers' matrices to Muon and every vector to AdamW).
ADAMW_STATES = 2
MUON_STATES = 1


@dataclass(frozen=True)
class CheckpointPlan:
    """The training checkpoints' disk: ``kept`` checkpoints of ``bytes_each``."""

    matrix_parameters: int
    vector_parameters: int
    optimizer: str
    bytes_each: int
    kept: int

    @property
    def total_bytes(self) -> int:
        return self.bytes_each * self.kept


def vector_parameters(hidden: int, num_layers: int, aux: int) -> int:
    """The draft's trainable norms: three per layer (input, hidden, post-attention), the final
    one, and the aux states' (one over their concatenation for eagle3, one per aux layer for
    eagle3.1: the same count)."""
    return num_layers * 3 * hidden + hidden + aux * hidden


def plan_checkpoints(config: Mapping[str, Any], shape: TargetShape) -> CheckpointPlan:
    train = config["train"]
    num_layers = int(train["num_layers"])
    aux = aux_layer_count(config)
    matrices = draft_matrix_parameters(shape, num_layers, aux)
    vectors = vector_parameters(shape.hidden_size, num_layers, aux)
    matrix_states = MUON_STATES if train["optimizer"] == "muon" else ADAMW_STATES
    bytes_each = FP32_BYTES * (matrices * (1 + matrix_states) + vectors * (1 + ADAMW_STATES))
    return CheckpointPlan(
        matrix_parameters=matrices,
        vector_parameters=vectors,
        optimizer=str(train["optimizer"]),
        bytes_each=bytes_each,
        kept=int(train["keep_checkpoints"]),
    )


def format_checkpoint_plan(plan: CheckpointPlan) -> str:
    trainable = (plan.matrix_parameters + plan.vector_parameters) / 1e6
    return (
        f"training checkpoints: {plan.kept} x {size_text(plan.bytes_each)} = "
        f"{size_text(plan.total_bytes)} under {CHECKPOINT_DIR}/ (train.keep_checkpoints; "
        f"{trainable:.1f}M trainable parameters in fp32 with {plan.optimizer}'s state), on the "
        "disk beside the captures"
    )
