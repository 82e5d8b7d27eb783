"""The EAGLE-3 draft: speculators' ``Eagle3DraftModel`` built the way speculators' trainer builds it.

Decoder layer shape comes from the target's config (speculators' ``create_transformer_layer_config``:
a Llama layer with the target's hidden size, heads and rope); embeddings, lm_head (restricted to
the draft vocabulary through ``t2d``) and the final norm come from the target's weights. The
aux layer ids are the capture store's, so vLLM feeds the draft the same layers at inference.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from draftflow.capture.layers import text_config
from draftflow.io import read_json
from draftflow.train.attention import PACKED_SDPA, register_packed_sdpa
from draftflow.train.vocab import read_vocab

if TYPE_CHECKING:
    from draftflow.train.job import TrainJob

log = logging.getLogger(__name__)


def resolve_attn_impl(attn_impl: str, device: torch.device) -> str:
    """Flex attention needs a compiled kernel to be fast: GPUs only. On the CPU SDPA, one
    packed sample at a time (``draftflow.train.attention``)."""
    if attn_impl != "auto":
        return attn_impl
    return "simple_flex_attention" if device.type == "cuda" else PACKED_SDPA


def build_draft_model(
    target_dir: str | os.PathLike[str],
    aux_layer_ids: list[int],
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    *,
    num_layers: int,
    ttt_steps: int,
    attn_impl: str,
    variant: str,
    trust_remote_code: bool,
) -> torch.nn.Module:
    """A fresh draft (decoder weights from the seeded RNG, the rest from the target).

    ``variant`` eagle3 normalizes the concatenated aux states with one RMSNorm before the fc
    projection (``norm_before_fc``); eagle3.1 gives every aux layer its own RMSNorm
    (``fc_norm``, EAGLE 3.1). speculators keeps the two exclusive, and both export to a
    config.json vLLM's Eagle3 Llama reads.
    """
    if variant not in ("eagle3", "eagle3.1"):
        raise ValueError(f"draft variant {variant!r} is not one of ('eagle3', 'eagle3.1')")
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    target_dir = str(target_dir)
    config = text_config(read_json(os.path.join(target_dir, "config.json")))
    if t2d.shape[0] != int(config["vocab_size"]):
        raise ValueError(
            f"vocab t2d covers {t2d.shape[0]} tokens but the target {target_dir} has "
            f"vocab_size {config['vocab_size']}: the vocab was built for another target"
        )
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=target_dir,
        num_layers=num_layers,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=int(config.get("max_position_embeddings", 2048)),
        # Full attention everywhere: training windows are far shorter than any sliding window.
        full_attention_indices=list(range(num_layers)),
        trust_remote_code=trust_remote_code,
    )
    if attn_impl == PACKED_SDPA:
        register_packed_sdpa()
    # speculators' eagle3 defaults (norm_before_residual, norm_before_fc, norm_output on);
    # EAGLE 3.1 swaps the one norm over the concatenation for one norm per aux layer.
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=target_dir,
        target_layer_ids=list(aux_layer_ids),
        draft_vocab_size=int(d2t.shape[0]),
        norm_before_residual=True,
        norm_before_fc=variant == "eagle3",
        fc_norm=variant == "eagle3.1",
        norm_output=True,
        ttt_steps=ttt_steps,
        draft_attn_impl=attn_impl,
        trust_remote_code=trust_remote_code,
    )


def draft_for_job(job: TrainJob, aux_layer_ids: list[int], attn_impl: str) -> torch.nn.Module:
    """A fresh draft for a training job: its target, its vocab and its train settings."""
    d2t, t2d = read_vocab(job.vocab_path)
    settings = job.settings
    return build_draft_model(
        job.target_dir,
        aux_layer_ids,
        d2t,
        t2d,
        num_layers=settings.num_layers,
        ttt_steps=settings.ttt_steps,
        variant=settings.variant,
        attn_impl=attn_impl,
        trust_remote_code=job.trust_remote_code,
    )


def _accuracy_counts(
    pred_ids: torch.Tensor,
    target_ids: torch.Tensor,
    loss_mask: torch.Tensor | None,
    prev_correct: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """speculators' ``compute_accuracy_single_step`` without ``masked_select``.

    ``masked_select`` has a data-dependent size: under torch.compile it splits the forward's
    graph and waits for the GPU, once per TTT step. Counting through the mask gives the same
    integers (exact in float32 below 2**24) with no wait. Same contract: ``prev_correct`` is
    updated in place; returns (full_correct, full_total, cond_correct, cond_total).
    """
    correct = pred_ids == target_ids
    cond_total = torch.tensor(correct.numel(), dtype=torch.float, device=correct.device)
    if prev_correct is not None:
        cond_total = prev_correct.sum().float()
        correct = torch.logical_and(prev_correct, correct, out=prev_correct)
    if loss_mask is None:
        correct_sum = correct.float().sum()
        full_total = torch.tensor(correct.numel(), dtype=torch.float, device=correct.device)
    else:
        mask = loss_mask.to(torch.bool)
        correct_sum = torch.logical_and(correct, mask).float().sum()
        full_total = mask.sum().float()
    return correct_sum, full_total, correct_sum.clone(), cond_total


def use_sync_free_accuracy() -> None:
    """Make speculators' EAGLE-3 forward count accuracies with :func:`_accuracy_counts`.

    Call before the first forward (torch.compile reads the function when it traces).
    speculators 0.9.0's ``eagle3.metrics.compute_metrics`` looks the function up in its module.
    """
    import speculators.models.eagle3.metrics as eagle3_metrics

    eagle3_metrics.compute_accuracy_single_step = _accuracy_counts


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights training changes (the rest is rebuilt from the target and the vocab)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
