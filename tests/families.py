"""Small random-weight targets of the model families draftflow captures, built from configs.

Each family is a transformers config (real classes, random weights, nothing from a hub) saved
with ``save_pretrained`` beside SmolLM2's tokenizer and chat template, so every stage can
tokenize, capture and train on it. Shapes are small, but keep what makes each family its own:

- ``qwen3``: dense Qwen3 (q/k norms);
- ``qwen3_moe``: Qwen3-MoE, every layer sparse (4 experts, 2 per token);
- ``deepseek_v3``: DeepSeek-V3, MLA attention with the released head sizes (``kv_lora_rank +
  qk_rope_head_dim`` = 576, the only latent size vLLM's CPU MLA kernel takes; ``qk_nope_head_dim``
  and ``v_head_dim`` 128, the only ones vLLM 0.33's MLA prefill takes on Hopper GPUs) and MoE
  after one dense layer, router bias (``topk_method: noaux_tc``);
- ``kimi_k25``: the Kimi-K2.5 wrapper (MoonViT vision tower, projector, the DeepSeek-V3 text
  model above), as the released checkpoint names it (``KimiK25ForConditionalGeneration``);
- ``llava``: a multimodal wrapper (LlavaForConditionalGeneration: CLIP vision tower, projector,
  Llama text model); its text model is captured, text only.
- ``gpt_oss``: GPT-OSS, whose decoder layers take ``(hidden_states, positions, residual)``, in
  that order, with attention sinks and sliding-window layers. Its two experts both serve every
  token: with random weights, bf16 routing near-ties would otherwise pick other experts than the
  fp32 reference on a few tokens (p01 cosine 0.955 with 4 experts, 2 per token), a trait of the
  test weights and not of capture.

Eight decoder layers: the default aux layers (2, L // 2, L - 3) must be distinct.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "llava", "gpt_oss")
# SmolLM2's vocabulary: its tokenizer is borrowed.
VOCAB_SIZE = 49152
NUM_LAYERS = 8
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def family_config(family: str):
    """The transformers config of one family's test target."""
    from transformers import (
        CLIPVisionConfig,
        DeepseekV3Config,
        GptOssConfig,
        LlamaConfig,
        LlavaConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = {
        "vocab_size": VOCAB_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family == "qwen3":
        return Qwen3Config(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            **common,
        )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            **common,
        )
    if family == "kimi_k25":
        from transformers import Kimi_K25Config, Kimi_K25VisionConfig

        vision = Kimi_K25VisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            pos_emb_height=8,
            pos_emb_width=8,
        )
        config = Kimi_K25Config(
            text_config=family_config("deepseek_v3").to_dict(),
            vision_config=vision.to_dict(),
            projection_hidden_size=64,
            image_token_id=VOCAB_SIZE - 1,
            video_token_id=VOCAB_SIZE - 2,
            vision_start_token_id=VOCAB_SIZE - 3,
            vision_end_token_id=VOCAB_SIZE - 4,
            tie_word_embeddings=False,
        )
        # The name vLLM registers (and the released checkpoint carries).
        config.architectures = ["KimiK25ForConditionalGeneration"]
        return config
    if family == "deepseek_v3":
        return DeepseekV3Config(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=64,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            topk_method="noaux_tc",
            tie_word_embeddings=False,
            **common,
        )
    if family == "llava":
        text = LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            **common,
        )
        vision = CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=16,
            projection_dim=64,
        )
        # The image token past the prompts' ids (tests draw ids below 49,000).
        return LlavaConfig(
            text_config=text,
            vision_config=vision,
            image_token_index=VOCAB_SIZE - 1,
            tie_word_embeddings=False,
        )
    if family == "gpt_oss":
        return GptOssConfig(
            hidden_size=128,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=2,
            num_experts_per_tok=2,
            sliding_window=64,
            tie_word_embeddings=False,
            **common,
        )
    raise ValueError(f"unknown family {family!r}: known are {', '.join(FAMILIES)}")


def family_model_class(family: str):
    from transformers import (
        DeepseekV3ForCausalLM,
        GptOssForCausalLM,
        LlavaForConditionalGeneration,
        Qwen3ForCausalLM,
        Qwen3MoeForCausalLM,
    )

    if family == "kimi_k25":
        from transformers import Kimi_K25ForConditionalGeneration

        return Kimi_K25ForConditionalGeneration
    return {
        "qwen3": Qwen3ForCausalLM,
        "qwen3_moe": Qwen3MoeForCausalLM,
        "deepseek_v3": DeepseekV3ForCausalLM,
        "llava": LlavaForConditionalGeneration,
        "gpt_oss": GptOssForCausalLM,
    }[family]


def build_family_target(family: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A bf16 checkpoint of ``family`` with random weights in ``out``, SmolLM2's tokenizer."""
    torch.manual_seed(seed)
    config = family_config(family)
    architectures = config.architectures
    model = family_model_class(family)(config)
    model.config.architectures = architectures or model.config.architectures
    model.to(torch.bfloat16).save_pretrained(str(out))
    if family == "kimi_k25":
        _as_released_kimi_k25(out, architectures)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def _as_released_kimi_k25(out: Path, architectures: list[str]) -> None:
    """Kimi-K2.5 as released: transformers 5 writes its decoder layers back as ``blocks`` (a
    vision-tower rename applied to the text model too), one projector norm under ``model.`` and
    its own class name; vLLM and transformers both read the released names
    (``language_model.model.layers``, ``mm_projector``, ``KimiK25ForConditionalGeneration``)."""
    import json

    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    renames = {
        "language_model.model.blocks.": "language_model.model.layers.",
        "model.mm_projector.": "mm_projector.",
    }
    weights = {}
    for name, tensor in load_file(str(path)).items():
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old) :]
        weights[name] = tensor
    save_file(weights, str(path), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = architectures
    (out / "config.json").write_text(json.dumps(config, indent=2))
