"""A target's shape from its config.json alone: layers, heads, weight bytes, KV bytes per token.

No transformers import: config.json is read as JSON, and a multimodal wrapper (Kimi-K2.5, Llava,
Mistral3) is read through its ``text_config`` (vLLM runs every draftflow engine text only, so a
vision tower takes no memory). Parameters are counted module by module the way the HF modeling
code lays them out (embeddings, attention or MLA, dense MLP, routed and shared experts with
DeepSeek's ``first_k_dense_replace``, norms, an untied lm_head); a quantized checkpoint
(``quantization_config``: compressed-tensors, fp8, mxfp4, or a ``bits``/``group_size`` method) stores the
modules it quantizes in fewer bytes, with its ``ignore`` list honoured.

KV cache, per token and device: ``2 x layers x KV heads on the device x head_dim`` elements, the
KV heads split over tensor parallel ranks (replicated where there are fewer heads than ranks);
MLA (DeepSeek-V2/V3, Kimi-K2) caches one latent of ``kv_lora_rank + qk_rope_head_dim`` per
layer, which vLLM's MLA backends keep whole on every rank (it is not split over heads).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bytes per element of the dtypes a config names (weights, engines, KV cache).
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r}: known are {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint stores the modules it quantizes: bytes per parameter (scales included)
    and the modules it leaves alone (compressed-tensors' ``ignore``: names or ``re:`` patterns)."""

    method: str
    bytes_per_parameter: float
    ignore: tuple[str, ...]
    # Embeddings are never quantized; lm_head only where the method says so.
    quantizes_lm_head: bool

    def quantizes(self, module: str) -> bool:
        if module == "lm_head" and not self.quantizes_lm_head:
            return False
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            # A name, a name's last parts, or a glob ("model.layers.*.self_attn"), module or
            # any module below it.
            elif any(
                fnmatch.fnmatchcase(module, f"{lead}{entry}{tail}")
                for lead in ("", "*.")
                for tail in ("", ".*")
            ):
                return False
        return True


def read_quantization(config: Mapping[str, Any]) -> Quantization | None:
    """The checkpoint's weight quantization, or None where its weights are in its dtype.

    An unknown method raises: an estimate in the unquantized dtype would be off several fold.
    """
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", ""))
    if method == "compressed-tensors":
        groups = list((quant.get("config_groups") or {}).values())
        weights = [group.get("weights") or {} for group in groups]
        if not weights or any("num_bits" not in w for w in weights):
            raise ValueError(f"compressed-tensors quantization_config without num_bits: {quant}")
        bits = max(int(w["num_bits"]) for w in weights)
        group_size = min(int(w.get("group_size") or 0) for w in weights)
        # One bf16 scale per group (group strategy); per channel it is negligible.
        scale = 2 / group_size if group_size else 0.0
        ignore = tuple(str(entry) for entry in quant.get("ignore") or ())
        return Quantization(method, bits / 8 + scale, ignore, quantizes_lm_head=True)
    if method == "fp8":
        # Block-wise fp8 (DeepSeek-V3): one byte a weight, a float32 scale per 128 x 128 block.
        block = quant.get("weight_block_size") or [128, 128]
        ignore = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or ()
        return Quantization(
            method, 1 + 4 / (int(block[0]) * int(block[1])), tuple(ignore), quantizes_lm_head=False
        )
    if method == "mxfp4":  # gpt-oss: 4-bit experts, one 8-bit scale per 32 weights
        ignore = tuple(quant.get("modules_to_not_convert") or ())
        return Quantization(method, 4 / 8 + 1 / 32, ignore, quantizes_lm_head=False)
    if "bits" in quant:  # awq, gptq and the like: packed ints plus fp16 scales and zeros
        group_size = int(quant.get("group_size") or 128)
        ignore = tuple(quant.get("modules_to_not_convert") or ())
        return Quantization(
            method, int(quant["bits"]) / 8 + 4 / group_size, ignore, quantizes_lm_head=False
        )
    raise ValueError(
        f"quantization_config quant_method {method!r}: the weight bytes of this method are not "
        "known here (known: compressed-tensors, fp8, mxfp4, and methods with bits/group_size)"
    )


@dataclass(frozen=True)
class TargetShape:
    """What the engine plan needs to know of a target."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    # MLA: kv_lora_rank + qk_rope_head_dim (the cached latent per layer); None: standard KV.
    mla_latent: int | None
    # Every parameter of the language model, and the part stored quantized.
    parameters: int
    quantized_parameters: int
    quantization: Quantization | None
    # A vision or audio tower around the language model (vLLM runs it text only).
    multimodal: bool
    # The longest context vLLM accepts for it (None: stretched by a rope scaling, not known here).
    max_position_embeddings: int | None

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of the weights an engine in ``dtype`` loads (quantized modules as stored)."""
        plain = (self.parameters - self.quantized_parameters) * dtype_bytes(dtype)
        if self.quantization is None:
            return plain
        return plain + round(self.quantized_parameters * self.quantization.bytes_per_parameter)

    def kv_heads_per_device(self, tensor_parallel_size: int) -> int:
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def kv_bytes_per_token(self, kv_dtype: str, tensor_parallel_size: int = 1) -> int:
        """KV-cache bytes one token takes on each device of a ``tensor_parallel_size`` engine."""
        if self.mla_latent is not None:
            elements = self.num_layers * self.mla_latent
        else:
            heads = self.kv_heads_per_device(tensor_parallel_size)
            elements = 2 * self.num_layers * heads * self.head_dim
        return elements * dtype_bytes(kv_dtype)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's settings (multimodal wrappers nest them)."""
    return config.get("text_config") or config.get("language_config") or config


def _get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _attention_modules(text: Mapping[str, Any], layer: int) -> list[tuple[str, int]]:
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    prefix = f"model.layers.{layer}.self_attn"
    if text.get("kv_lora_rank"):
        kv_lora = int(text["kv_lora_rank"])
        rope = int(text["qk_rope_head_dim"])
        nope = int(text["qk_nope_head_dim"])
        v_dim = int(text["v_head_dim"])
        q_lora = text.get("q_lora_rank")
        if q_lora:
            q = [
                (f"{prefix}.q_a_proj", hidden * int(q_lora)),
                (f"{prefix}.q_a_layernorm", int(q_lora)),
                (f"{prefix}.q_b_proj", int(q_lora) * heads * (nope + rope)),
            ]
        else:
            q = [(f"{prefix}.q_proj", hidden * heads * (nope + rope))]
        return [
            *q,
            (f"{prefix}.kv_a_proj_with_mqa", hidden * (kv_lora + rope)),
            (f"{prefix}.kv_a_layernorm", kv_lora),
            (f"{prefix}.kv_b_proj", kv_lora * heads * (nope + v_dim)),
            (f"{prefix}.o_proj", heads * v_dim * hidden),
        ]
    kv_heads = int(_get(text, "num_key_value_heads", default=heads))
    head_dim = int(_get(text, "head_dim", default=hidden // heads))
    # Qwen2 has q/k/v biases without saying so in its config.
    bias = bool(text.get("attention_bias")) or text.get("model_type") in ("qwen2", "qwen2_moe")
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    return [
        (f"{prefix}.q_proj", hidden * q_out + (q_out if bias else 0)),
        (f"{prefix}.k_proj", hidden * kv_out + (kv_out if bias else 0)),
        (f"{prefix}.v_proj", hidden * kv_out + (kv_out if bias else 0)),
        (f"{prefix}.o_proj", q_out * hidden),
    ]


def _gated_mlp(prefix: str, hidden: int, intermediate: int) -> list[tuple[str, int]]:
    return [
        (f"{prefix}.gate_proj", hidden * intermediate),
        (f"{prefix}.up_proj", hidden * intermediate),
        (f"{prefix}.down_proj", intermediate * hidden),
    ]


def _mlp_modules(text: Mapping[str, Any], layer: int) -> list[tuple[str, int]]:
    hidden = int(text["hidden_size"])
    dense = int(text["intermediate_size"])
    prefix = f"model.layers.{layer}.mlp"
    if text.get("n_routed_experts"):  # DeepSeek-V2/V3, Kimi-K2
        first_dense = int(text.get("first_k_dense_replace") or 0)
        frequency = int(text.get("moe_layer_freq") or 1)
        if layer < first_dense or layer % frequency:
            return _gated_mlp(prefix, hidden, dense)
        experts = int(text["n_routed_experts"])
        expert_size = int(text["moe_intermediate_size"])
        shared = int(text.get("n_shared_experts") or 0)
        modules = _expert_modules(prefix, experts, hidden, expert_size)
        if shared:
            modules += _gated_mlp(f"{prefix}.shared_experts", hidden, expert_size * shared)
        # The router, with DeepSeek-V3's score-correction bias.
        bias = experts if text.get("topk_method") == "noaux_tc" else 0
        return [*modules, (f"{prefix}.gate", experts * hidden + bias)]
    experts = int(_get(text, "num_experts", "num_local_experts", default=0))
    if experts:  # Qwen-MoE, Mixtral
        step = int(text.get("decoder_sparse_step") or 1)
        if layer in (text.get("mlp_only_layers") or []) or (layer + 1) % step:
            return _gated_mlp(prefix, hidden, dense)
        expert_size = int(_get(text, "moe_intermediate_size", default=dense))
        modules = _expert_modules(prefix, experts, hidden, expert_size)
        shared = int(text.get("shared_expert_intermediate_size") or 0)
        if shared:
            modules += _gated_mlp(f"{prefix}.shared_expert", hidden, shared)
            modules.append((f"{prefix}.shared_expert_gate", hidden))
        return [*modules, (f"{prefix}.gate", experts * hidden)]
    return _gated_mlp(prefix, hidden, dense)


def _expert_modules(
    prefix: str, experts: int, hidden: int, expert_size: int
) -> list[tuple[str, int]]:
    # Named after expert 0; the count covers every expert.
    return [
        (name.replace(f"{prefix}.e0", f"{prefix}.experts.0"), size * experts)
        for name, size in _gated_mlp(f"{prefix}.e0", hidden, expert_size)
    ]


def language_model_modules(text: Mapping[str, Any], tied: bool) -> list[tuple[str, int]]:
    """(module name, parameters) of the language model, HF names (``model.layers.N....``)."""
    hidden = int(text["hidden_size"])
    vocab = int(text["vocab_size"])
    modules = [("model.embed_tokens", vocab * hidden)]
    for layer in range(int(text["num_hidden_layers"])):
        modules += _attention_modules(text, layer)
        modules += _mlp_modules(text, layer)
        modules.append((f"model.layers.{layer}.input_layernorm", hidden))
        modules.append((f"model.layers.{layer}.post_attention_layernorm", hidden))
    modules.append(("model.norm", hidden))
    if not tied:
        modules.append(("lm_head", vocab * hidden))
    return modules


# Modules no quantization touches: embeddings, norms, and MoE routers (vLLM builds them unquantized).
_NOT_LINEAR = re.compile(r"(embed_tokens|norm|layernorm|\.gate)$")


def target_shape(config: Mapping[str, Any]) -> TargetShape:
    """The shape of the target whose config.json is ``config``."""
    text = text_config(config)
    missing = [
        key
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
        if key not in text
    ]
    if missing:
        raise ValueError(f"config.json has no {missing}: not a decoder's config")
    tied = bool(_get(text, "tie_word_embeddings", default=config.get("tie_word_embeddings", False)))
    quantization = read_quantization(text) or read_quantization(config)
    modules = language_model_modules(text, tied)
    parameters = sum(size for _, size in modules)
    quantized = 0
    if quantization is not None:
        quantized = sum(
            size
            for name, size in modules
            if not _NOT_LINEAR.search(name) and quantization.quantizes(name)
        )
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    mla = (
        int(text["kv_lora_rank"]) + int(text["qk_rope_head_dim"])
        if text.get("kv_lora_rank")
        else None
    )
    return TargetShape(
        model_type=str(config.get("model_type") or text.get("model_type") or "unknown"),
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(_get(text, "num_key_value_heads", default=heads)),
        head_dim=int(_get(text, "head_dim", default=hidden // heads)),
        intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
        vocab_size=int(text["vocab_size"]),
        mla_latent=mla,
        parameters=parameters,
        quantized_parameters=quantized,
        quantization=quantization,
        multimodal=any(key in config for key in ("vision_config", "audio_config")),
        max_position_embeddings=_context_limit(text),
    )


def _context_limit(text: Mapping[str, Any]) -> int | None:
    """The longest context vLLM accepts: max_position_embeddings, unless a rope scaling (yarn,
    dynamic, linear, longrope) stretches it by a factor vLLM applies its own way (None: unknown)."""
    longest = text.get("max_position_embeddings")
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if longest is None or (rope.get("factor") and kind not in ("default", "llama3")):
        return None
    return int(longest)


def read_target_shape(path: str | os.PathLike[str]) -> TargetShape:
    """The shape from a config.json file, or from a checkpoint directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return target_shape(json.loads(path.read_text(encoding="utf-8")))
