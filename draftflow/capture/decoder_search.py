"""Find the text decoder (its layers and final norm) inside a model, vLLM's or transformers'.

Causal LMs keep it at ``model`` (``model.layers``, ``model.norm``); multimodal wrappers nest the
language model: vLLM's Llava, Mistral3, Qwen-VL and Kimi-K2.5 at ``language_model.model``,
transformers 5 at ``model.language_model``. The known paths are tried in order; where none has
the shape, every submodule with a ``layers`` ModuleList and a ``norm`` is a candidate (one
whose layer count is the text config's wins), and the error names each path and class tried.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Attribute paths from the top-level model to the module holding ``layers`` and ``norm``.
DECODER_PATHS = (
    "model",
    "language_model.model",
    "model.language_model",
    "language_model",
    "model.model",
    "",
)


class DecoderNotFoundError(RuntimeError):
    """The model has no module with decoder layers and a final norm where one was looked for."""


@dataclass(frozen=True)
class Decoder:
    module: torch.nn.Module
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    path: str

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _at(model: torch.nn.Module, path: str) -> object | None:
    node: object | None = model
    for name in path.split(".") if path else ():
        node = getattr(node, name, None)
    return node


def _as_decoder(node: object, path: str) -> Decoder | None:
    if not isinstance(node, torch.nn.Module):
        return None
    layers = getattr(node, "layers", None)
    norm = getattr(node, "norm", None)
    if (
        isinstance(layers, torch.nn.ModuleList)
        and len(layers)
        and isinstance(norm, torch.nn.Module)
    ):
        return Decoder(node, layers, norm, path)
    return None


def find_decoder(model: torch.nn.Module, num_layers: int | None = None) -> Decoder:
    """The decoder of ``model``: at a known path, else the one structural candidate.

    ``num_layers`` (the text config's layer count) picks among several candidates and must match
    the one found.
    """
    tried = []
    found = None
    for path in DECODER_PATHS:
        node = _at(model, path)
        found = _as_decoder(node, path)
        if found is not None:
            break
        if node is not None:
            tried.append(f"{path or '(the model)'}: {type(node).__name__}")
    if found is None:
        candidates = [
            decoder
            for name, module in model.named_modules()
            if (decoder := _as_decoder(module, name)) is not None
        ]
        if num_layers is not None and len(candidates) > 1:
            candidates = [c for c in candidates if c.num_layers == num_layers]
        if len(candidates) == 1:
            found = candidates[0]
        else:
            what = (
                "several: " + ", ".join(f"{c.path} ({c.num_layers} layers)" for c in candidates)
                if candidates
                else "none"
            )
            raise DecoderNotFoundError(
                f"{type(model).__name__}: no text decoder found (a module with a 'layers' "
                f"ModuleList and a final 'norm'). Tried {'; '.join(tried) or 'no path existed'}"
                f" (paths {', '.join(p or '(the model)' for p in DECODER_PATHS)}); "
                f"submodules of that shape: {what}"
            )
    if num_layers is not None and found.num_layers != num_layers:
        raise DecoderNotFoundError(
            f"{type(model).__name__}: the decoder at {found.path or '(the model)'} "
            f"({type(found.module).__name__}) has {found.num_layers} layers, the text config "
            f"says {num_layers}"
        )
    return found
