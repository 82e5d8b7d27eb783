"""The engine plan on targets it was not written for: real config.json files of six released
checkpoints (tests/data/targets/README.md) whose shapes differ from the shipped examples' (MXFP4
experts and sliding windows, a multimodal wrapper leaving keys to transformers, Llama 4's
interleaved experts and chunked attention, Mixtral, block-wise FP8 MLA, linear attention), each
planned with a config written from config/README.md alone (tests/configs/unseen/). No vLLM,
no GPU."""

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
        ({"moe_num_experts": 64}, "moe_num_experts"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"layer_types": ["mamba"] * 4}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 4}, "linear_num_key_heads"),
        ({"layer_types": ["sliding_attention"] * 4}, "sliding_window"),
    ],
)
def test_what_cannot_be_estimated_is_refused_by_key(extra, key):
    with pytest.raises(ValueError, match=key):
        target_shape(_llama(**extra))


def test_mistral_sliding_window_on_every_layer_without_transformers(monkeypatch):
    monkeypatch.setattr(ts, "_class_defaults", lambda text: {})
    mistral = target_shape(_llama(model_type="mistral", sliding_window=32))
    assert (mistral.full_attention_layers, mistral.windowed_layers) == (0, 4)
    assert mistral.kv_bytes_per_sequence("bfloat16", 100, 1, 16) == 4 * (31 + 16) * 2 * 2 * 16 * 2
