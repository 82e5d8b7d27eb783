"""The EAGLE-3 draft: speculators' ``Eagle3DraftModel`` built the way speculators' trainer builds it.

Decoder layer shape comes from the target's config (speculators' ``create_transformer_layer_config``:
a Llama layer with the target's hidden size, heads and rope); embeddings, lm_head (restricted to
the draft vocabulary through ``t2d``) and the final norm come from the target's weights. The
aux layer ids are the capture store's, so vLLM feeds the draft the same layers at inference.
"""

from __future__ import annotations

import logging
import os

import torch

from draftflow.capture.layers import text_config
from draftflow.io import read_json

log = logging.getLogger(__name__)


def resolve_attn_impl(attn_impl: str, device: torch.device) -> str:
    """Flex attention needs a compiled kernel to be fast: GPUs only. SDPA on the CPU."""
    if attn_impl != "auto":
        return attn_impl
    return "simple_flex_attention" if device.type == "cuda" else "sdpa"


def build_draft_model(
    target_dir: str | os.PathLike[str],
    aux_layer_ids: list[int],
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    *,
    num_layers: int,
    ttt_steps: int,
    attn_impl: str,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """A fresh draft (decoder weights from the seeded RNG, the rest from the target)."""
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
    # speculators' eagle3 defaults (norm_before_residual, norm_before_fc, norm_output on).
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=target_dir,
        target_layer_ids=list(aux_layer_ids),
        draft_vocab_size=int(d2t.shape[0]),
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        ttt_steps=ttt_steps,
        draft_attn_impl=attn_impl,
        trust_remote_code=trust_remote_code,
    )


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights training changes (the rest is rebuilt from the target and the vocab)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
