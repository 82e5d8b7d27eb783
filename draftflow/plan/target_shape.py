"""A target's shape from its config.json alone: layers, heads, weight bytes, KV bytes per token.

config.json is read as JSON (transformers only where it leaves keys out, below), and a multimodal
wrapper (Kimi-K2.5, Llava, Mistral3, Gemma 3, Llama 4, Qwen3-VL) is read through its
``text_config`` (vLLM runs every draftflow engine text only, so a vision tower takes no memory).
Parameters are counted module by module the way the HF modeling code lays them out (embeddings,
attention, MLA with DeepSeek-V3.2's indexer, or Gated DeltaNet, dense MLP, routed and shared
experts with DeepSeek's ``first_k_dense_replace``, Llama 4's interleaving or ERNIE-4.5's
``moe_layer_*`` range, norms, an untied lm_head); a quantized checkpoint (``quantization_config``:
compressed-tensors, fp8, mxfp4, or a ``bits``/``group_size`` method) stores the modules it
quantizes in fewer bytes, with its ``ignore`` list honoured.

KV cache, per token and device: ``2 x layers x KV heads on the device x head_dim`` elements, the
KV heads split over tensor parallel ranks (replicated where there are fewer heads than ranks);
MLA (DeepSeek-V2/V3, Kimi-K2) caches one latent of ``kv_lora_rank + qk_rope_head_dim`` per
layer, which vLLM's MLA backends keep whole on every rank (it is not split over heads); DeepSeek
sparse attention (DeepSeek-V3.2, ``index_head_dim``) adds its indexer's keys, in fp8 with a 4-byte
scale per 128 whatever the KV dtype, also whole on every rank.

Layers differ in what they cache (``layer_types``, transformers' names): ``full_attention`` every
token; ``sliding_attention`` (gpt-oss, Gemma 2/3, Mistral) and ``chunked_attention`` (Llama 4) the
``sliding_window`` / ``attention_chunk_size`` tokens behind the position, plus what vLLM has in
flight (it frees behind the window only as tokens settle, and reserves per request
``window - 1 + max_num_batched_tokens x concurrent batches``, at most the sequence: with
draftflow's token budgets above its contexts, the whole sequence); ``linear_attention``
(Qwen3-Next's Gated DeltaNet) a fixed state per sequence. ``kv_bytes_per_token`` counts windowed
layers as full; ``kv_bytes_per_sequence`` is one sequence's need, its windows bounded where the
tokens in flight are given.

A config.json that leaves keys to its transformers config class (Gemma 3's ``vocab_size``, its
sliding pattern, Llama 4's chunked layers) is completed from that class where transformers is
installed (imported only then); an SSM hybrid, linear attention other than Gated DeltaNet
(MiniMax's ``attn_type_list`` zeros, Kimi-Linear's ``linear_attn_config``) or an MoE key not known
here raises, naming the key, instead of giving a wrong number.
"""

from __future__ import annotations

import fnmatch
import json
import math
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
    # Layers by what they cache (layer_types): every token, at most attention_window tokens of a
    # sequence (sliding or chunked), or a fixed state of linear_state_elements per sequence.
    full_attention_layers: int = -1
    windowed_layers: int = 0
    attention_window: int | None = None
    linear_attention_layers: int = 0
    linear_state_elements: int = 0
    # DeepSeek sparse attention: the indexer's key cache, bytes per token and attention layer.
    index_key_bytes: int = 0

    def __post_init__(self) -> None:
        if self.full_attention_layers < 0:  # built without layer kinds: every layer full
            object.__setattr__(self, "full_attention_layers", self.num_layers)

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of the weights an engine in ``dtype`` loads (quantized modules as stored)."""
        plain = (self.parameters - self.quantized_parameters) * dtype_bytes(dtype)
        if self.quantization is None:
            return plain
        return plain + round(self.quantized_parameters * self.quantization.bytes_per_parameter)

    def kv_heads_per_device(self, tensor_parallel_size: int) -> int:
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def _layer_token_elements(self, tensor_parallel_size: int) -> int:
        """KV elements one token takes in one attention layer on one device."""
        if self.mla_latent is not None:
            return self.mla_latent
        return 2 * self.kv_heads_per_device(tensor_parallel_size) * self.head_dim

    def _layer_token_bytes(self, kv_dtype: str, tensor_parallel_size: int) -> int:
        """Cache bytes one token takes in one attention layer on one device."""
        elements = self._layer_token_elements(tensor_parallel_size)
        return elements * dtype_bytes(kv_dtype) + self.index_key_bytes

    def kv_bytes_per_token(
        self,
        kv_dtype: str,
        tensor_parallel_size: int,
        context: int | None = None,
        in_flight_tokens: int | None = None,
    ) -> int:
        """KV-cache bytes one token takes on each device of a ``tensor_parallel_size`` engine.

        Without ``context``: every attention layer, windowed ones counted as full (linear
        attention's states are per sequence, not per token). With ``context``: the mean over one
        ``context``-token sequence (``kv_bytes_per_sequence`` / ``context``)."""
        if context is not None:
            sequence = self.kv_bytes_per_sequence(
                kv_dtype, context, tensor_parallel_size, in_flight_tokens
            )
            return math.ceil(sequence / context)
        layers = self.full_attention_layers + self.windowed_layers
        return layers * self._layer_token_bytes(kv_dtype, tensor_parallel_size)

    def kv_bytes_per_sequence(
        self,
        kv_dtype: str,
        tokens: int,
        tensor_parallel_size: int,
        in_flight_tokens: int | None = None,
    ) -> int:
        """KV-cache bytes one ``tokens``-long sequence takes on each device: full layers hold
        every token, linear layers their state, windowed layers what vLLM reserves for a
        request, ``window - 1 + in_flight_tokens`` (vLLM's max_num_batched_tokens x concurrent
        batches) at most ``tokens``; every token where ``in_flight_tokens`` is not given."""
        windowed = tokens
        if self.attention_window and in_flight_tokens is not None:
            windowed = min(tokens, self.attention_window - 1 + in_flight_tokens)
        per_layer_token = self._layer_token_bytes(kv_dtype, tensor_parallel_size)
        attention = per_layer_token * (
            self.full_attention_layers * tokens + self.windowed_layers * windowed
        )
        # vLLM keeps linear-attention states in the model's dtype (16 bits or more), not fp8;
        # their heads split over the tensor parallel ranks.
        state = math.ceil(self.linear_state_elements / tensor_parallel_size)
        states = self.linear_attention_layers * state * max(2, dtype_bytes(kv_dtype))
        return attention + states


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's settings (multimodal wrappers nest them; InternVL as llm_config)."""
    return (
        config.get("text_config")
        or config.get("language_config")
        or config.get("llm_config")
        or config
    )


def _get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


# What every decoder's config.json (or its transformers config class) gives.
REQUIRED_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
# Keys whose layers differ in what they cache, where config.json may leave layer_types to the
# transformers config class (Qwen3-Next, Llama 4, Gemma 3).
_LAYER_PATTERN_KEYS = ("full_attention_interval", "attention_chunk_size", "linear_num_value_heads")
# State-space hybrids (Jamba, Nemotron-H, Falcon-H1, Zamba): their mamba layers are not
# estimated here.
_SSM_KEYS = (
    "layers_block_type",
    "hybrid_override_pattern",
    "attn_layer_period",
    "mamba_d_state",
    "ssm_state_size",
    "mamba_d_ssm",
)
# Linear attention other than Gated DeltaNet, named by keys of its own (Kimi-Linear's KDA layers,
# MiniMax-Text-01's lightning attention where attn_type_list holds a 0): its weights and state are
# not estimated here, and counting its layers as full attention would overstate the KV cache.
_OTHER_LINEAR_KEYS = ("linear_attn_config",)
FULL, SLIDING, CHUNKED, LINEAR = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "linear_attention",
)
LAYER_KINDS = (FULL, SLIDING, CHUNKED, LINEAR)


def _has_layer_pattern(text: Mapping[str, Any]) -> bool:
    """Whether the layers may differ in attention without config.json listing them."""
    if text.get("layer_types"):
        return False
    sliding = text.get("sliding_window") and text.get("use_sliding_window") is not False
    return bool(sliding) or any(text.get(key) for key in _LAYER_PATTERN_KEYS)


def _class_defaults(text: Mapping[str, Any]) -> dict[str, Any]:
    """The keys transformers' config class of ``text``'s model_type fills in (defaults and
    derived ones such as layer_types); {} without transformers or for a type it lacks."""
    try:
        from transformers import CONFIG_MAPPING
        from transformers.utils import logging as hf_logging
    except ImportError:
        return {}
    model_type = str(text.get("model_type"))
    if model_type not in CONFIG_MAPPING:
        return {}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its rope validation warns about released configs
    try:
        return CONFIG_MAPPING[model_type](**text).to_dict()
    except (TypeError, ValueError, KeyError):
        return {}
    finally:
        hf_logging.set_verbosity(verbosity)


def complete_text_config(text: Mapping[str, Any]) -> Mapping[str, Any]:
    """``text`` with the keys its transformers config class adds where config.json leaves out a
    required key or the per-layer attention pattern (config.json's own values win)."""
    if all(key in text for key in REQUIRED_KEYS) and not _has_layer_pattern(text):
        return text
    return {**_class_defaults(text), **text}


def layer_kinds(text: Mapping[str, Any]) -> tuple[str, ...]:
    """What each layer caches (``layer_types``, else the pattern keys that imply it)."""
    count = int(text["num_hidden_layers"])
    for key in _SSM_KEYS:
        if text.get(key):
            raise ValueError(
                f"config.json {key}: a state-space (mamba) hybrid, whose layers' weights and "
                "cache are not estimated here"
            )
    for key in _OTHER_LINEAR_KEYS:
        if text.get(key):
            raise ValueError(
                f"config.json {key}: linear attention other than Gated DeltaNet (Qwen3-Next), "
                "whose weights and state are not estimated here"
            )
    attention_types = text.get("attn_type_list")
    if attention_types and any(int(kind) != 1 for kind in attention_types):
        # MiniMax: 1 is softmax attention, 0 lightning (linear) attention.
        raise ValueError(
            f"config.json attn_type_list has {sum(int(k) != 1 for k in attention_types)} layers "
            "of lightning (linear) attention (0): their weights and state are not estimated here"
        )
    given = text.get("layer_types")
    if given:
        kinds = tuple(str(kind) for kind in given)
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        if len(kinds) != count or unknown:
            raise ValueError(
                f"config.json layer_types: {len(kinds)} entries for num_hidden_layers {count}, "
                f"kinds {unknown or 'known'} (known: {', '.join(LAYER_KINDS)})"
            )
        return kinds
    if text.get("full_attention_interval"):  # Qwen3-Next: linear, linear, linear, full
        every = int(text["full_attention_interval"])
        return tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(count))
    if text.get("attention_chunk_size"):  # Llama 4: RoPE layers chunked, every 4th NoPE full
        rope = text.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(count)]
        return tuple(CHUNKED if rope[i] else FULL for i in range(count))
    if text.get("sliding_window") and text.get("use_sliding_window") is not False:
        pattern = int(_get(text, "sliding_window_pattern", "_sliding_window_pattern", default=0))
        if pattern:  # Gemma: pattern - 1 sliding layers, then a full one
            return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(count))
        return (SLIDING,) * count  # Mistral: every layer
    return (FULL,) * count


def _attention_window(text: Mapping[str, Any], kinds: tuple[str, ...]) -> int | None:
    if SLIDING in kinds and CHUNKED in kinds:
        raise ValueError("config.json layer_types: sliding and chunked layers together")
    key = "sliding_window" if SLIDING in kinds else "attention_chunk_size"
    if SLIDING not in kinds and CHUNKED not in kinds:
        return None
    if not text.get(key):
        raise ValueError(f"config.json layer_types has windowed layers but no {key}")
    return int(text[key])


# Gated DeltaNet (Qwen3-Next, Qwen3.5): the keys its linear-attention layers are sized by.
_LINEAR_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _linear_dims(text: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    missing = [key for key in _LINEAR_KEYS if text.get(key) is None]
    if missing:
        raise ValueError(
            f"config.json layer_types has linear_attention layers without {missing}: only "
            "Gated DeltaNet (Qwen3-Next) linear attention is estimated here"
        )
    key_heads, value_heads, key_dim, value_dim, kernel = (int(text[k]) for k in _LINEAR_KEYS)
    return key_heads, value_heads, key_dim, value_dim, kernel


def linear_state_elements(text: Mapping[str, Any]) -> int:
    """One linear-attention layer's state per sequence: the causal conv's last kernel - 1 inputs
    (q, k and v) and the recurrent state (key_dim x value_dim per value head)."""
    key_heads, value_heads, key_dim, value_dim, kernel = _linear_dims(text)
    conv = (2 * key_heads * key_dim + value_heads * value_dim) * (kernel - 1)
    return conv + value_heads * key_dim * value_dim


def _linear_attention_modules(text: Mapping[str, Any], layer: int) -> list[tuple[str, int]]:
    hidden = int(text["hidden_size"])
    key_heads, value_heads, key_dim, value_dim, kernel = _linear_dims(text)
    keys, values = key_heads * key_dim, value_heads * value_dim
    prefix = f"model.layers.{layer}.linear_attn"
    return [
        (f"{prefix}.in_proj_qkvz", hidden * (2 * keys + 2 * values)),
        (f"{prefix}.in_proj_ba", hidden * 2 * value_heads),
        (f"{prefix}.conv1d", (2 * keys + values) * kernel),
        (f"{prefix}.dt_bias", value_heads),
        (f"{prefix}.A_log", value_heads),
        (f"{prefix}.norm", value_dim),
        (f"{prefix}.out_proj", values * hidden),
    ]


def _indexer_modules(text: Mapping[str, Any], prefix: str, q_in: int) -> list[tuple[str, int]]:
    """DeepSeek sparse attention's indexer (DeepSeek-V3.2): its queries from the q LoRA, one
    key head, a LayerNorm on it and a weight per index head; [] without index_head_dim."""
    if not text.get("index_head_dim"):
        return []
    head_dim, heads = int(text["index_head_dim"]), int(text["index_n_heads"])
    hidden = int(text["hidden_size"])
    return [
        (f"{prefix}.indexer.wq_b", q_in * heads * head_dim),
        (f"{prefix}.indexer.wk", hidden * head_dim),
        (f"{prefix}.indexer.k_norm", 2 * head_dim),
        (f"{prefix}.indexer.weights_proj", hidden * heads),
    ]


def index_key_bytes(text: Mapping[str, Any]) -> int:
    """Bytes per token and layer of the indexer's key cache: vLLM's DeepseekV32IndexerCache keeps
    index_head_dim fp8 values and a float32 scale per 128 of them; 0 without an indexer."""
    if not text.get("index_head_dim"):
        return 0
    head_dim = int(text["index_head_dim"])
    return head_dim + head_dim // 128 * 4


# Qwen2's model types, the VL ones' language models included.
_QWEN2_BIAS_TYPES = (
    "qwen2",
    "qwen2_moe",
    "qwen2_vl",
    "qwen2_vl_text",
    "qwen2_5_vl",
    "qwen2_5_vl_text",
)


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
            *_indexer_modules(text, prefix, int(q_lora or hidden)),
        ]
    kv_heads = int(_get(text, "num_key_value_heads", default=heads))
    head_dim = int(_get(text, "head_dim", default=hidden // heads))
    # Qwen2 (and the Qwen2-VL / Qwen2.5-VL language models) has q/k/v biases without saying so
    # in its config; attention_bias (ERNIE-4.5: use_bias) adds o_proj's too.
    qwen2 = text.get("model_type") in _QWEN2_BIAS_TYPES
    given_bias = bool(text.get("attention_bias")) or bool(text.get("use_bias"))
    bias = given_bias or qwen2
    out_bias = hidden if given_bias else 0
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    return [
        (f"{prefix}.q_proj", hidden * q_out + (q_out if bias else 0)),
        (f"{prefix}.k_proj", hidden * kv_out + (kv_out if bias else 0)),
        (f"{prefix}.v_proj", hidden * kv_out + (kv_out if bias else 0)),
        (f"{prefix}.o_proj", q_out * hidden + out_bias),
    ]


def _gated_mlp(prefix: str, hidden: int, intermediate: int) -> list[tuple[str, int]]:
    return [
        (f"{prefix}.gate_proj", hidden * intermediate),
        (f"{prefix}.up_proj", hidden * intermediate),
        (f"{prefix}.down_proj", intermediate * hidden),
    ]


# Keys naming experts that _mlp_modules reads or that do not change the weights (top-k).
_KNOWN_EXPERT_KEYS = frozenset(
    {
        "n_routed_experts",
        "num_experts",
        "num_local_experts",
        "n_shared_experts",
        "num_shared_experts",
        "num_experts_per_tok",
        "experts_per_token",
        "shared_expert_intermediate_size",
        "moe_num_experts",
        "moe_num_shared_experts",
    }
)


def check_expert_keys(text: Mapping[str, Any]) -> None:
    """Raise on an MoE key not read here: its experts would be left out of the weights."""
    for key, value in text.items():
        if "expert" not in key or key in _KNOWN_EXPERT_KEYS:
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            raise ValueError(
                f"config.json {key} {value}: an MoE layout not known here (known: "
                f"{', '.join(sorted(_KNOWN_EXPERT_KEYS))}), so its weights cannot be estimated"
            )


def _is_moe_layer(text: Mapping[str, Any], layer: int) -> bool:
    """Qwen-MoE's decoder_sparse_step and mlp_only_layers, Llama 4's moe_layers or
    interleave_moe_layer_step (every step-th layer, from the step - 1-th)."""
    if text.get("moe_layers") is not None:
        return layer in text["moe_layers"]
    step = int(_get(text, "interleave_moe_layer_step", "decoder_sparse_step", default=1))
    return layer not in (text.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def _ernie_moe_layer(text: Mapping[str, Any], layer: int) -> bool:
    """ERNIE-4.5: every moe_layer_interval-th layer from moe_layer_start_index through
    moe_layer_end_index (-1 or absent: the last); absent keys take Ernie4_5_MoeConfig's
    defaults (from layer 1, every layer)."""
    start = int(_get(text, "moe_layer_start_index", default=1))
    interval = int(_get(text, "moe_layer_interval", default=1))
    end = int(_get(text, "moe_layer_end_index", default=-1))
    end = int(text["num_hidden_layers"]) - 1 if end == -1 else end
    return (layer + 1) % interval == 0 and start <= layer <= end


def _ernie_mlp_modules(text: Mapping[str, Any], layer: int) -> list[tuple[str, int]]:
    hidden = int(text["hidden_size"])
    prefix = f"model.layers.{layer}.mlp"
    experts = text["moe_num_experts"]
    if not isinstance(experts, int) or isinstance(experts, bool):
        # ERNIE-4.5-VL: separate text and vision experts, each list entry a modality's.
        raise ValueError(
            f"config.json moe_num_experts {experts!r}: experts per modality (ERNIE-4.5-VL) are "
            "not estimated here, only one int (ERNIE-4.5's text models)"
        )
    if text.get("moe_intermediate_size") is None:
        raise ValueError("config.json has moe_num_experts but no moe_intermediate_size")
    if not _ernie_moe_layer(text, layer):
        return _gated_mlp(prefix, hidden, int(text["intermediate_size"]))
    expert_size = int(text["moe_intermediate_size"])
    modules = _expert_modules(prefix, experts, hidden, expert_size)
    shared = int(text.get("moe_num_shared_experts") or 0)
    if shared:  # one MLP of moe_intermediate_size x moe_num_shared_experts
        modules += _gated_mlp(f"{prefix}.shared_experts", hidden, expert_size * shared)
    # The router, with the aux-free score-correction bias (moe_statics).
    bias = experts if text.get("moe_use_aux_free") else 0
    return [*modules, (f"{prefix}.gate", experts * hidden + bias)]


def _mlp_modules(text: Mapping[str, Any], layer: int) -> list[tuple[str, int]]:
    hidden = int(text["hidden_size"])
    # Llama 4: intermediate_size is an expert's, intermediate_size_mlp the dense layers'.
    dense = int(_get(text, "intermediate_size_mlp", "intermediate_size"))
    prefix = f"model.layers.{layer}.mlp"
    if text.get("moe_num_experts"):  # ERNIE-4.5
        return _ernie_mlp_modules(text, layer)
    if text.get("n_routed_experts"):  # DeepSeek-V2/V3, Kimi-K2, GLM-4.5
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
    if experts:  # Qwen-MoE, Mixtral, gpt-oss, Llama 4
        if not _is_moe_layer(text, layer):
            return _gated_mlp(prefix, hidden, dense)
        expert_size = int(_get(text, "moe_intermediate_size", "intermediate_size"))
        modules = _expert_modules(prefix, experts, hidden, expert_size)
        shared = int(text.get("shared_expert_intermediate_size") or 0)
        shared_count = int(_get(text, "n_shared_experts", "num_shared_experts", default=0))
        if text.get("model_type") == "llama4_text":  # one shared expert, no key says so
            shared_count = max(shared_count, 1)
        shared = shared or shared_count * expert_size
        if shared:
            modules += _gated_mlp(f"{prefix}.shared_expert", hidden, shared)
            if text.get("shared_expert_intermediate_size"):  # Qwen's sigmoid gate on it
                modules.append((f"{prefix}.shared_expert_gate", hidden))
        return [*modules, (f"{prefix}.gate", experts * hidden)]
    if text.get("model_type") in _PLAIN_MLP_TYPES:
        return [
            (f"{prefix}.up_proj", hidden * dense),
            (f"{prefix}.down_proj", dense * hidden),
        ]
    return _gated_mlp(prefix, hidden, dense)


# Dense MLPs without a gate (up, activation, down): Nemotron's squared ReLU, StarCoder2's GELU.
_PLAIN_MLP_TYPES = ("nemotron", "starcoder2")


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
    check_expert_keys(text)
    kinds = layer_kinds(text)
    modules = [("model.embed_tokens", vocab * hidden)]
    for layer, kind in enumerate(kinds):
        if kind == LINEAR:
            modules += _linear_attention_modules(text, layer)
        else:
            modules += _attention_modules(text, layer)
        modules += _mlp_modules(text, layer)
        modules.append((f"model.layers.{layer}.input_layernorm", hidden))
        modules.append((f"model.layers.{layer}.post_attention_layernorm", hidden))
    modules.append(("model.norm", hidden))
    if not tied:
        modules.append(("lm_head", vocab * hidden))
    return modules


# Modules no quantization touches: embeddings, norms, MoE routers (vLLM builds them unquantized)
# and the small parameters of linear attention.
_NOT_LINEAR = re.compile(r"(embed_tokens|norm|layernorm|\.gate|conv1d|dt_bias|A_log)$")


def _tied(config: Mapping[str, Any], text: Mapping[str, Any], completed: Mapping[str, Any]) -> bool:
    """tie_word_embeddings: the language model's, the wrapper's, then its config class's."""
    for source in (text, config, completed):
        if source.get("tie_word_embeddings") is not None:
            return bool(source["tie_word_embeddings"])
    return False


def target_shape(config: Mapping[str, Any]) -> TargetShape:
    """The shape of the target whose config.json is ``config``."""
    given = text_config(config)
    text = complete_text_config(given)
    missing = [key for key in REQUIRED_KEYS if key not in text]
    if missing:
        raise ValueError(
            f"config.json has no {missing} (model_type {given.get('model_type')!r}; transformers "
            "does not fill them in): not a decoder's config"
        )
    tied = _tied(config, given, text)
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
    kinds = layer_kinds(text)
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
        full_attention_layers=kinds.count(FULL),
        windowed_layers=kinds.count(SLIDING) + kinds.count(CHUNKED),
        attention_window=_attention_window(text, kinds),
        linear_attention_layers=kinds.count(LINEAR),
        linear_state_elements=linear_state_elements(text) if LINEAR in kinds else 0,
        index_key_bytes=index_key_bytes(text) if mla is not None else 0,
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
