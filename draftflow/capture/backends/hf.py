"""transformers backend: ``output_hidden_states``, the numerical reference and the vLLM-free fallback.

HF ``hidden_states[k]`` (k < L) is the residual stream entering layer k: the aux ids map directly.
In transformers 5.x ``hidden_states[L]`` is taken *after* the final norm, so the final pre-norm
state (id L) comes from a pre-hook on the decoder's ``norm``.

The model is loaded as a causal LM, or as an image-text-to-text model for multimodal wrappers
(``load_target``); the text decoder is found by ``draftflow.capture.decoder_search`` and run on
its own, text only (the vision tower is never called).

Batching: prompts are sorted by length (longest first) and packed into forwards of at most
``max_batch_prompts`` prompts and ``max_batch_tokens`` padded tokens (rows x longest prompt).
Rows are right-padded with an attention mask and explicit ``position_ids`` 0..T-1, so each
prompt's real tokens see exactly what they would see alone (causal attention never looks right);
results are sliced back to each prompt's length and returned in the caller's order. In fp32 this
matches one prompt at a time to cosine >= 0.99999 per token (only kernel choice differs).
``max_batch_tokens <= 0`` or ``max_batch_prompts <= 1`` forces the unpadded one-at-a-time path,
which is also taken for a batch of one and for attention implementations that cannot take a
padded batch (e.g. transformers' paged attention, or a remote-code model without a mask input).
"""

from __future__ import annotations

import inspect
import os

import torch

from draftflow.capture.backends import CaptureEngineSettings
from draftflow.capture.decoder_search import find_decoder

HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Attention implementations that honour a 2D padding mask on a right-padded batch.
PADDED_BATCH_ATTENTION = {
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
}


def load_target(
    model_dir: str | os.PathLike[str],
    dtype: torch.dtype,
    trust_remote_code: bool,
    num_layers: int | None = None,
):
    """The target as transformers builds it: a causal LM, else (multimodal wrappers such as
    Llava, Mistral3, Qwen-VL) an image-text-to-text model; the error names both tried.

    ``num_layers`` keeps only the first decoder layers (``truncated_config``): the rest of the
    checkpoint is never read, so a target too large for one device can still be checked below.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    autos = (AutoModelForCausalLM, AutoModelForImageTextToText)
    remote = getattr(config, "auto_map", None) or {}
    if not remote and not any(type(config) in auto._model_mapping for auto in autos):
        config = own_config(config, model_dir) or config
    if num_layers is not None:
        truncated_config(config, num_layers)
    tried = []
    for auto in autos:
        if type(config) in auto._model_mapping or auto.__name__ in remote:
            return auto.from_pretrained(
                str(model_dir), config=config, dtype=dtype, trust_remote_code=trust_remote_code
            )
        tried.append(auto.__name__)
    raise RuntimeError(
        f"{model_dir}: transformers has no model class for {type(config).__name__} "
        f"(architectures {getattr(config, 'architectures', None)}) in {' or '.join(tried)}; "
        "the hf backend and the extract job's verification need one"
    )


def own_config(config, model_dir: str | os.PathLike[str]):
    """The checkpoint's config as transformers' own class for its ``model_type``, where another
    class was registered over it (vLLM registers its own config classes, e.g. Kimi-K2.5's, with
    ``AutoConfig`` once an engine has read the target in this process); None where transformers
    has no class of its own or the registered one is it."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    name = CONFIG_MAPPING_NAMES.get(getattr(config, "model_type", None) or "")
    own = getattr(transformers, name, None) if name else None
    if own is None or own is type(config):
        return None
    return own.from_pretrained(str(model_dir))


def truncated_config(config, num_layers: int) -> None:
    """Cut the text model of ``config`` to its first ``num_layers`` decoder layers, in place.

    The residual stream entering layer k depends on layers below k only, so a truncated model
    gives the full model's states there. Per-layer lists (``layer_types``) are cut alike.
    """
    text = config.get_text_config()
    total = int(text.num_hidden_layers)
    if not 0 < num_layers <= total:
        raise ValueError(f"cannot keep {num_layers} of the target's {total} decoder layers")
    for name, value in list(vars(text).items()):
        if isinstance(value, list) and len(value) == total and name != "architectures":
            setattr(text, name, value[:num_layers])
    text.num_hidden_layers = num_layers


class HFBackend:
    name = "hf"
    vllm_version = None
    # Padded tokens (rows x longest row) per forward: output_hidden_states keeps every layer's
    # state of the whole batch, so this bounds the activation memory as one long prompt would.
    max_batch_tokens: int = 16384
    max_batch_prompts: int = 64

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        layer_ids: list[int],
        settings: CaptureEngineSettings,
        *,
        max_batch_tokens: int | None = None,
        max_batch_prompts: int | None = None,
        num_layers: int | None = None,
    ) -> None:
        """``num_layers``: load only the first decoder layers (``layer_ids`` must end there)."""
        if settings.hf_dtype not in HF_DTYPES:
            raise ValueError(f"hf dtype {settings.hf_dtype!r}: allowed are {', '.join(HF_DTYPES)}")
        self.layer_ids = list(layer_ids)
        self.device = torch.device(settings.device)
        if max_batch_tokens is not None:
            self.max_batch_tokens = max_batch_tokens
        if max_batch_prompts is not None:
            self.max_batch_prompts = max_batch_prompts
        model = load_target(
            model_dir, HF_DTYPES[settings.hf_dtype], settings.trust_remote_code, num_layers
        )
        text_config = model.config.get_text_config()
        found = find_decoder(model, getattr(text_config, "num_hidden_layers", None))
        self.decoder = found.module.to(self.device).eval()
        norm = found.norm
        del model  # the LM head (and a wrapper's vision tower) are not needed
        self.num_layers = len(self.decoder.layers)
        if self.layer_ids[-1] != self.num_layers:
            raise ValueError(
                f"layer ids {self.layer_ids} must end with the layer count {self.num_layers}"
            )
        self.can_pad = self._takes_padded_batch()
        self._pre_norm: torch.Tensor | None = None
        norm.register_forward_pre_hook(self._keep_pre_norm)

    def _takes_padded_batch(self) -> bool:
        """Whether a right-padded batch with a mask gives each row its unpadded result."""
        attention = getattr(self.decoder.config, "_attn_implementation", None)
        if attention not in PADDED_BATCH_ATTENTION:
            return False
        parameters = inspect.signature(self.decoder.forward).parameters
        return {"attention_mask", "position_ids"} <= parameters.keys()

    def _keep_pre_norm(self, module: torch.nn.Module, args: tuple) -> None:
        self._pre_norm = args[0]

    def batches(self, lengths: list[int]) -> list[list[int]]:
        """Prompt indices per forward: longest first (a too-large budget fails on the first)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        if not self.can_pad or self.max_batch_tokens <= 0 or self.max_batch_prompts <= 1:
            return [[i] for i in order]
        groups: list[list[int]] = []
        for index in order:
            group = groups[-1] if groups else None
            # Longest first: the group's first prompt sets its padded width.
            if (
                group is not None
                and len(group) < self.max_batch_prompts
                and (len(group) + 1) * lengths[group[0]] <= self.max_batch_tokens
            ):
                group.append(index)
            else:
                groups.append([index])
        return groups

    def _forward(self, input_ids: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        """States ``[B, T, len(layer_ids), H]`` of one forward, on the device."""
        output = self.decoder(
            input_ids=input_ids, output_hidden_states=True, use_cache=False, **inputs
        )
        hidden = output.hidden_states
        layers = [hidden[i] for i in self.layer_ids[:-1]] + [self._pre_norm]
        self._pre_norm = None
        return torch.stack(layers, dim=2)

    @torch.inference_mode()
    def capture(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        lengths = [len(ids) for ids in token_ids]
        results: list[torch.Tensor | None] = [None] * len(token_ids)
        for group in self.batches(lengths):
            if len(group) == 1:  # no padding: the exact one-at-a-time reference
                (index,) = group
                input_ids = torch.tensor([list(token_ids[index])], device=self.device)
                results[index] = self._forward(input_ids)[0].cpu()
                continue
            width = lengths[group[0]]
            input_ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for row, index in enumerate(group):
                input_ids[row, : lengths[index]] = torch.tensor(token_ids[index])
                mask[row, : lengths[index]] = 1
            # Explicit positions 0..T-1 per row: right padding must not shift real tokens.
            positions = torch.arange(width).expand(len(group), -1)
            states = self._forward(
                input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
            )
            for row, index in enumerate(group):
                # copy=True: a CPU view would keep the whole padded batch alive.
                results[index] = states[row, : lengths[index]].to("cpu", copy=True)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self.decoder = None
