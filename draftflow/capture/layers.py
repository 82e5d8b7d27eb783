"""Which layers to capture, read from the target's config.json.

Layer id convention (docs/design.md): id k is the residual stream entering decoder layer k
(``hidden_states + residual``), equal to HF ``output_hidden_states[k]`` for k < L; id L is the
final output before the final norm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from draftflow.io import read_json


@dataclass(frozen=True)
class CaptureLayers:
    num_hidden_layers: int
    hidden_size: int
    aux_layer_ids: list[int]

    @property
    def layer_ids(self) -> list[int]:
        """Aux layers, then the final pre-norm output (id L)."""
        return [*self.aux_layer_ids, self.num_hidden_layers]


def default_aux_layers(num_hidden_layers: int) -> list[int]:
    """vLLM's (and the EAGLE repo's) EAGLE-3 default: (2, L // 2, L - 3)."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def text_config(config: dict) -> dict:
    # Multimodal checkpoints nest the language model's settings.
    return config.get("text_config") or config


def capture_layers(
    model_dir: str | os.PathLike[str], aux_layers: list[int] | None
) -> CaptureLayers:
    """Aux layer ids (extract.aux_layers; None: the vLLM default) checked against the model's
    layer count."""
    config = text_config(read_json(Path(model_dir) / "config.json"))
    try:
        num_layers = int(config["num_hidden_layers"])
        hidden_size = int(config["hidden_size"])
    except KeyError as missing:
        raise ValueError(
            f"{model_dir}/config.json has no {missing}: cannot tell layer count / hidden size"
        ) from None
    aux = default_aux_layers(num_layers) if aux_layers is None else [int(i) for i in aux_layers]
    bad = [i for i in aux if not 0 <= i < num_layers]
    if bad or len(set(aux)) != len(aux) or aux != sorted(aux):
        raise ValueError(
            f"extract.aux_layers {aux}: ids must be distinct, increasing and in [0, {num_layers}) "
            f"for a model with {num_layers} layers (the final pre-norm output, id {num_layers}, "
            "is always added)"
        )
    return CaptureLayers(num_layers, hidden_size, aux)
