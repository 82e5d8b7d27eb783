"""The engine plan on targets it was not written for: real config.json files of twelve released
checkpoints (tests/data/targets/README.md) whose shapes differ from the shipped examples' (MXFP4
experts and sliding windows, a multimodal wrapper leaving keys to transformers, Llama 4's
interleaved experts and chunked attention, Mixtral, block-wise FP8 MLA, linear attention; then
GLM-4.5's MoE, MLA without a q LoRA, mistral3 / Qwen2.5-VL / Qwen3-VL wrappers), each planned with
a config written from config/README.md alone (tests/configs/unseen/). No vLLM, no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow.config import load_config
from draftflow.plan import target_shape as ts
from draftflow.plan.__main__ import main
from draftflow.plan.checks import check_config
from draftflow.plan.engines import GIB, plan_engines
from draftflow.plan.target_shape import read_target_shape, target_shape

REPO = Path(__file__).resolve().parents[1]
TARGETS = REPO / "tests" / "data" / "targets"
UNSEEN = REPO / "tests" / "configs" / "unseen"
H100 = 80 * GIB
H200 = int(139.8 * GIB)

# Published size of each release: (parameters, bytes of its weights as an engine loads them).
# The bytes are parameters x 2 in bf16; gpt-oss-120b's is its MXFP4 checkpoint (~61 GiB, experts
# at 4.25 bits), DeepSeek-V3's about a byte a parameter (block-wise fp8, bf16 embeddings).
# The multimodal totals include a vision tower vLLM does not build text only (Gemma 3: 0.4B,
# Llama 4 Scout: 1.2B): within the tolerance.
KNOWN = {
    "gpt-oss-120b": (116.83e9, 61 * GIB),
    "gemma-3-27b-it": (27.4e9, 2 * 27.4e9),
    "llama-4-scout-17b-16e": (109e9, 2 * 109e9),
    "mixtral-8x7b": (46.7e9, 2 * 46.7e9),
    "deepseek-v3": (671e9, 671e9),
    "qwen3-next-80b-a3b": (80e9, 2 * 80e9),
    "gpt-oss-20b": (20.91e9, 12.8 * GIB),
    "glm-4.5-air": (106e9, 2 * 106e9),
    "deepseek-v2-lite-chat": (15.7e9, 2 * 15.7e9),
    "mistral-small-3.2-24b": (24.0e9, 2 * 24.0e9),
    "qwen2.5-vl-7b": (8.29e9, 2 * 8.29e9),
    "qwen3-vl-30b-a3b": (31.1e9, 2 * 31.1e9),
}
# The second set (tests/data/targets/README.md), checked closer: the language model's published
# parameters (for the VL wrappers, those of the text model it is built on: the published totals
# above add a vision tower vLLM does not build text only) and, by hand from each config.json, the
# KV bytes one token takes on one device of a tensor_parallel_size 1 engine in bf16:
# 2 (K and V) x layers x KV heads x head_dim x 2 bytes, or layers x MLA latent x 2 bytes.
LANGUAGE_MODEL = {
    # 20.91B (the gpt-oss model card); 24 layers of 8 KV heads of 64.
    "gpt-oss-20b": (20.91e9, 2 * 24 * 8 * 64 * 2),
    # 106B; 46 layers of 8 KV heads of 128 (96 query heads, head_dim given).
    "glm-4.5-air": (106e9, 2 * 46 * 8 * 128 * 2),
    # 15.7B; MLA without a q LoRA (q_lora_rank null): 27 latents of 512 + 64.
    "deepseek-v2-lite-chat": (15.7e9, 27 * (512 + 64) * 2),
    # Mistral-Small-24B's text model, 23.6B; 40 layers of 8 KV heads of 128.
    "mistral-small-3.2-24b": (23.6e9, 2 * 40 * 8 * 128 * 2),
    # Qwen2.5-7B's 7.61B; 28 layers of 4 KV heads of 128 (hidden 3584 / 28 heads).
    "qwen2.5-vl-7b": (7.61e9, 2 * 28 * 4 * 128 * 2),
    # Qwen3-30B-A3B's 30.5B; 48 layers of 4 KV heads of 128.
    "qwen3-vl-30b-a3b": (30.5e9, 2 * 48 * 4 * 128 * 2),
}
# The GPUs each unseen config is planned on.
DEVICE = {name: H100 for name in KNOWN} | {"deepseek-v3": H200}


def shape(name: str) -> ts.TargetShape:
    return read_target_shape(TARGETS / name / "config.json")


def test_every_unseen_target_has_a_config():
    assert {p.stem for p in UNSEEN.glob("*.yaml")} == set(KNOWN)
    assert all((TARGETS / name / "config.json").is_file() for name in KNOWN)


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_weights_within_ten_percent_of_the_release(name):
    parameters, weight_bytes = KNOWN[name]
    target = shape(name)
    assert abs(target.parameters - parameters) / parameters < 0.10
    assert abs(target.weight_bytes("bfloat16") - weight_bytes) / weight_bytes < 0.10


@pytest.mark.parametrize("name", sorted(LANGUAGE_MODEL))
def test_parameters_within_two_percent_and_kv_bytes_by_hand(name):
    parameters, kv_bytes = LANGUAGE_MODEL[name]
    target = shape(name)
    assert abs(target.parameters - parameters) / parameters < 0.02
    assert target.kv_bytes_per_token("bfloat16", 1) == kv_bytes


def test_deepseek_v2_lite_mla_without_q_lora_to_the_parameter():
    """The checkpoint's safetensors hold 15,706,484,224 parameters: q_proj in place of q_a/q_b
    (q_lora_rank null), 26 MoE layers of 64 experts and two shared ones after a dense one."""
    lite = shape("deepseek-v2-lite-chat")
    assert lite.parameters == 15_706_484_224
    assert lite.mla_latent == 512 + 64
    assert lite.max_position_embeddings is None  # yarn rope_parameters: vLLM's own stretch


def test_vl_wrappers_read_their_language_model():
    # Qwen2.5-VL's config is flat (no text_config) and its language model has Qwen2's q/k/v
    # biases: the same 7,615,616,512 parameters as Qwen2.5-7B's.
    flat = shape("qwen2.5-vl-7b")
    assert flat.multimodal and flat.parameters == shape("qwen2.5-7b").parameters
    # use_sliding_window false: a sliding_window of 32768 without windowed layers.
    assert (flat.full_attention_layers, flat.windowed_layers) == (28, 0)
    # Qwen3-VL-30B-A3B's text_config is Qwen3-30B-A3B's; tie_word_embeddings only at the top.
    nested = shape("qwen3-vl-30b-a3b")
    assert nested.parameters == shape("qwen3-30b-a3b").parameters
    assert nested.max_position_embeddings == 262144  # mrope: no stretch factor
    mistral = shape("mistral-small-3.2-24b")
    assert mistral.multimodal and mistral.vocab_size == 131072 and mistral.windowed_layers == 0


def test_internvl_llm_config_and_plain_mlps():
    # InternVL nests its language model as llm_config.
    qwen = json.loads((TARGETS / "qwen2.5-7b" / "config.json").read_text())
    wrapped = {"model_type": "internvl_chat", "llm_config": qwen, "vision_config": {}}
    internvl = target_shape(wrapped)
    assert internvl.multimodal and internvl.parameters == shape("qwen2.5-7b").parameters
    # Nemotron's and StarCoder2's MLPs have no gate: up and down only.
    gated = target_shape(_llama()).parameters
    for model_type in ("nemotron", "starcoder2"):
        plain = target_shape(_llama(model_type=model_type)).parameters
        assert gated - plain == 4 * 64 * 128


def test_gpt_oss_20b_and_glm_4_5_air():
    gpt = shape("gpt-oss-20b")
    assert gpt.quantized_parameters == 24 * 32 * 3 * 2880 * 2880  # MXFP4 experts
    assert (gpt.full_attention_layers, gpt.windowed_layers, gpt.attention_window) == (12, 12, 128)
    glm = shape("glm-4.5-air")
    # first_k_dense_replace 1: one dense layer, then 45 of 128 experts and a shared one.
    layer = 128 * 3 * 4096 * 1408 + 3 * 4096 * 1408 + 128 * 4096
    assert glm.parameters > 45 * layer
    # Split over four ranks: 2 of the 8 KV heads each.
    assert glm.kv_bytes_per_token("bfloat16", 4) == 2 * 46 * 2 * 128 * 2


# ERNIE-4.5-21B-A3B's keys as its config.json gives them (baidu/ERNIE-4.5-21B-A3B-PT, the ones
# that shape the weights): its experts are named moe_num_experts / moe_num_shared_experts.
ERNIE_4_5_21B_A3B = {
    "model_type": "ernie4_5_moe",
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "moe_k": 6,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": 27,
    "moe_layer_interval": 1,
    "vocab_size": 103424,
    "tie_word_embeddings": True,
    "use_bias": False,
}


def test_ernie_4_5_moe_keys():
    ernie = target_shape(ERNIE_4_5_21B_A3B)
    # 21.8B: layer 0 dense, layers 1-27 of 64 experts and a shared MLP of 2 x 1536, tied.
    assert abs(ernie.parameters - 21.8e9) / 21.8e9 < 0.01
    moe = 64 * 3 * 2560 * 1536 + 3 * 2560 * 2 * 1536 + 64 * 2560
    attention = 2 * 2560 * 2560 + 2 * 2560 * 512
    assert ernie.parameters == (
        103424 * 2560 + 28 * (attention + 2 * 2560) + 3 * 2560 * 12288 + 27 * moe + 2560
    )
    assert ernie.kv_bytes_per_token("bfloat16", 1) == 2 * 28 * 4 * 128 * 2
    # Without the range keys: Ernie4_5_MoeConfig's defaults (from layer 1 to the last).
    defaults = {k: v for k, v in ERNIE_4_5_21B_A3B.items() if not k.startswith("moe_layer_")}
    assert target_shape(defaults).parameters == ernie.parameters
    # ERNIE-4.5-VL's experts per modality are refused by key, not miscounted.
    with pytest.raises(ValueError, match="moe_num_experts"):
        target_shape({**ERNIE_4_5_21B_A3B, "moe_num_experts": [64, 64]})


def test_gpt_oss_mxfp4_experts_and_sliding_window():
    gpt = shape("gpt-oss-120b")
    # 36 layers of 128 experts (gate, up, down of 2880 x 2880) stored in MXFP4, the rest bf16.
    assert gpt.quantization.method == "mxfp4"
    assert gpt.quantized_parameters == 36 * 128 * 3 * 2880 * 2880
    assert (gpt.full_attention_layers, gpt.windowed_layers, gpt.attention_window) == (18, 18, 128)
    # Per layer and token: K and V of 8 heads of 64 in bf16 = 2 KiB.
    layer_token = 2 * 8 * 64 * 2
    assert gpt.kv_bytes_per_token("bfloat16", 1) == 36 * layer_token  # windows counted as full
    # One 8192-token sequence with 2048 tokens in flight: the full layers hold it all, vLLM
    # reserves 127 + 2048 tokens of the sliding ones; with the extract engine's budget (16384
    # tokens, two batches) every token, as without in_flight_tokens.
    assert gpt.kv_bytes_per_sequence("bfloat16", 8192, 1, 2048) == layer_token * (
        18 * 8192 + 18 * (127 + 2048)
    )
    assert gpt.kv_bytes_per_sequence("bfloat16", 4097, 1, 2 * 16384) == 36 * 4097 * layer_token
    assert gpt.kv_bytes_per_sequence("bfloat16", 4097, 1) == 36 * 4097 * layer_token
    assert gpt.kv_bytes_per_token("bfloat16", 1, 8192, 2048) < gpt.kv_bytes_per_token("bfloat16", 1)


def test_gemma_3_keys_left_to_its_config_class():
    gemma = shape("gemma-3-27b-it")
    # Its text_config has no vocab_size, tie_word_embeddings or sliding pattern: Gemma3TextConfig's
    # 262208, tied, and five sliding layers (window 1024) before each full one.
    assert gemma.multimodal and gemma.vocab_size == 262208
    assert gemma.head_dim == 128  # explicit, not hidden 5376 / 32 heads
    assert (gemma.full_attention_layers, gemma.windowed_layers) == (10, 52)
    assert gemma.attention_window == 1024
    layer_token = 2 * 16 * 128 * 2
    assert gemma.kv_bytes_per_sequence("bfloat16", 4096, 1, 512) == layer_token * (
        10 * 4096 + 52 * (1023 + 512)
    )


def test_llama_4_scout_shared_expert_and_chunked_layers():
    scout = shape("llama-4-scout-17b-16e")
    layer = (
        2 * 5120 * 5120
        + 2 * 5120 * 1024  # q, o and k, v
        + 16 * 3 * 5120 * 8192  # routed experts
        + 3 * 5120 * 8192  # the shared expert
        + 16 * 5120  # router
        + 2 * 5120  # norms
    )
    assert scout.parameters == 2 * 202048 * 5120 + 48 * layer + 5120
    # Every 4th layer global (NoPE), the others chunked by attention_chunk_size 8192.
    assert (scout.full_attention_layers, scout.windowed_layers) == (12, 36)
    assert scout.attention_window == 8192
    assert scout.max_position_embeddings == 10485760  # llama3 rope scaling: vLLM takes it as is


def test_deepseek_v3_block_fp8():
    deepseek = shape("deepseek-v3")
    assert deepseek.quantization.method == "fp8"
    # A float32 scale per 128 x 128 block; embeddings, lm_head, norms and routers stay bf16.
    assert deepseek.quantization.bytes_per_parameter == 1 + 4 / (128 * 128)
    assert 0.99 < deepseek.quantized_parameters / (deepseek.parameters - 2 * 129280 * 7168) < 1
    assert deepseek.kv_bytes_per_token("bfloat16", 8) == 61 * (512 + 64) * 2


def test_deepseek_v3_2_sparse_attention_indexer():
    """DeepSeek-V3.2 is DeepSeek-V3's shape plus an indexer per layer (its config.json's
    index_n_heads 64, index_head_dim 128): 64 x 128 queries from the 1536 q LoRA, one key head of
    128 with a LayerNorm, 64 head weights; vLLM caches its keys in fp8 with a float32 scale per
    128 (132 bytes a token and layer) beside the MLA latent, on every rank."""
    config = json.loads((TARGETS / "deepseek-v3" / "config.json").read_text())
    v32 = {
        **config,
        "model_type": "deepseek_v32",
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
    }
    sparse, dense = target_shape(v32), shape("deepseek-v3")
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert sparse.parameters == dense.parameters + 61 * indexer
    assert sparse.index_key_bytes == 128 + 4
    assert sparse.kv_bytes_per_token("bfloat16", 8) == 61 * ((512 + 64) * 2 + 132)
    assert sparse.kv_bytes_per_token("fp8", 8) == 61 * ((512 + 64) + 132)
    assert dense.index_key_bytes == 0


def test_qwen3_next_linear_attention():
    qwen = shape("qwen3-next-80b-a3b")
    # full_attention_interval 4: three Gated DeltaNet layers, then one full attention layer.
    assert (qwen.full_attention_layers, qwen.linear_attention_layers) == (12, 36)
    # Per token only the full layers: 2 KV heads of 256.
    assert qwen.kv_bytes_per_token("bfloat16", 1) == 12 * 2 * 2 * 256 * 2
    # Per sequence each linear layer keeps its conv inputs (3 of them) and a recurrent state of
    # 32 value heads x 128 x 128.
    state = (2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128
    assert qwen.linear_state_elements == state
    tokens = 1000
    assert qwen.kv_bytes_per_sequence("bfloat16", tokens, 1) == (
        tokens * qwen.kv_bytes_per_token("bfloat16", 1) + 36 * state * 2
    )
    assert qwen.kv_bytes_per_token("bfloat16", 1, tokens) > qwen.kv_bytes_per_token("bfloat16", 1)


def test_qwen3_next_engines_count_each_sequence_state():
    """The plan's bytes per token are the mean over one context-long sequence, so a cache that
    holds one sequence by them holds its linear-attention states too."""
    config = load_config(UNSEEN / "qwen3-next-80b-a3b.yaml")
    qwen = shape("qwen3-next-80b-a3b")
    plain = [
        engine
        for engine in plan_engines(config, qwen, H100).engines
        if "speculative_config" not in engine.kwargs  # a draft adds its own layers
    ]
    assert {engine.stage for engine in plain} >= {"extract", "bench"}
    for engine in plain:
        tp, context = engine.tensor_parallel_size, engine.max_model_len
        assert engine.kv_bytes_per_token == qwen.kv_bytes_per_token(engine.dtype, tp, context)
        sequence = qwen.kv_bytes_per_sequence(engine.dtype, context, tp)
        assert context * engine.kv_bytes_per_token >= sequence
        assert engine.kv_bytes_per_token > qwen.kv_bytes_per_token(engine.dtype, tp)


def test_mixtral():
    mixtral = shape("mixtral-8x7b")
    assert (mixtral.full_attention_layers, mixtral.windowed_layers) == (32, 0)  # window null
    assert mixtral.kv_bytes_per_token("bfloat16", 2) == 32 * 2 * 4 * 128 * 2


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_unseen_config_passes_checks_and_plan(name):
    config = load_config(UNSEEN / f"{name}.yaml")
    target = shape(name)
    check_config(config, target)
    plan = plan_engines(config, target, DEVICE[name])
    assert plan.problems == ()
    for engine in plan.engines:
        assert engine.memory_bytes_per_device <= DEVICE[name]
        assert engine.kv_tokens >= engine.max_model_len


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_unseen_plan_command(name, capsys):
    status = main(
        [
            "--configfile",
            str(UNSEEN / f"{name}.yaml"),
            "--target-config",
            str(TARGETS / name / "config.json"),
            "--device-memory-gib",
            str(DEVICE[name] / GIB),
        ]
    )
    assert status == 0, capsys.readouterr()
    assert "every engine fits" in capsys.readouterr().out


def test_layer_pattern_rules_match_transformers():
    """Without transformers the pattern keys give the layer_types its config classes derive."""
    for name in ("qwen3-next-80b-a3b", "llama-4-scout-17b-16e"):
        text = ts.text_config(json.loads((TARGETS / name / "config.json").read_text()))
        derived = ts.complete_text_config(text)["layer_types"]
        assert ts.layer_kinds(text) == tuple(derived)


def test_without_transformers_a_missing_key_is_named(monkeypatch):
    monkeypatch.setattr(ts, "_class_defaults", lambda text: {})
    with pytest.raises(ValueError, match=r"no \['vocab_size'\].*gemma3_text"):
        shape("gemma-3-27b-it")


def _llama(**extra) -> dict:
    base = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    return {**base, **extra}


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"layers_block_type": ["mamba", "attention"] * 2}, "layers_block_type"),
        ({"hybrid_override_pattern": "M*M*"}, "hybrid_override_pattern"),
        ({"expert_layer_period": 2}, "expert_layer_period"),  # Jamba's
        ({"moe_num_experts": 64}, "moe_intermediate_size"),  # ERNIE's, without expert size
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"layer_types": ["mamba"] * 4}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 4}, "linear_num_key_heads"),
        ({"layer_types": ["sliding_attention"] * 4}, "sliding_window"),
        # MiniMax-Text-01's lightning attention (0), Kimi-Linear's KDA layers.
        ({"attn_type_list": [0, 1, 0, 1]}, "attn_type_list"),
        ({"linear_attn_config": {"kda_layers": [1, 2, 3]}}, "linear_attn_config"),
    ],
)
def test_what_cannot_be_estimated_is_refused_by_key(extra, key):
    with pytest.raises(ValueError, match=key):
        target_shape(_llama(**extra))


def test_minimax_softmax_attention_everywhere_is_planned():
    """attn_type_list of ones (MiniMax-M2): every layer softmax attention, planned as such."""
    minimax = target_shape(_llama(model_type="minimax_m2", attn_type_list=[1] * 4))
    assert minimax.full_attention_layers == 4


def test_plan_command_names_the_key_it_cannot_estimate(tmp_path, capsys):
    target = tmp_path / "config.json"
    target.write_text(json.dumps(_llama(attn_type_list=[0, 1, 0, 1])))
    status = main(
        ["--configfile", str(UNSEEN / "gpt-oss-20b.yaml"), "--target-config", str(target)]
    )
    err = capsys.readouterr().err
    assert status == 1
    assert "attn_type_list" in err and "kv_cache_memory_bytes" in err


def test_mistral_sliding_window_on_every_layer_without_transformers(monkeypatch):
    monkeypatch.setattr(ts, "_class_defaults", lambda text: {})
    mistral = target_shape(_llama(model_type="mistral", sliding_window=32))
    assert (mistral.full_attention_layers, mistral.windowed_layers) == (0, 4)
    assert mistral.kv_bytes_per_sequence("bfloat16", 100, 1, 16) == 4 * (31 + 16) * 2 * 2 * 16 * 2
