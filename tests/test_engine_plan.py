"""The engine plan (draftflow.plan): target shapes from real config.json files, every shipped
example merged as Snakemake merges it and planned against its real target, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from draftflow.config import load_config
from draftflow.plan.__main__ import main
from draftflow.plan.checks import check_config
from draftflow.plan.engines import GIB, plan_engines
from draftflow.plan.target_shape import read_target_shape

REPO = Path(__file__).resolve().parents[1]
TARGETS = REPO / "tests" / "data" / "targets"
H100 = 80 * GIB
# What torch reports for an H200 (141 GB).
H200 = int(139.8 * GIB)

# Every shipped config, as its header says to run it: config files in merge order, the real
# target's config.json, and the GPU memory of the machine it names (H100 unless it names one).
EXAMPLES = {
    "kimi-k2.5-8gpu": (["config/examples/kimi-k2.5-8gpu.yaml"], "kimi-k2.5", H200),
    "llama3.1-8b-8gpu": (["config/examples/llama3.1-8b-8gpu.yaml"], "llama-3.1-8b", H100),
    "slurm-cluster": (["config/examples/slurm-cluster.yaml"], "llama-3.1-8b", H100),
    # The demo's target is SmolLM2-135M-Instruct, prepared from a GGUF file.
    "smollm2-gpu": (["config/examples/smollm2-gpu.yaml"], "smollm2-135m", H100),
    "demo": (["config/demo.yaml"], "smollm2-135m", H100),
    "tool-calling-cpu": (
        ["config/demo.yaml", "config/examples/tool-calling-cpu.yaml"],
        "smollm2-135m",
        H100,
    ),
}


def shape(name: str):
    return read_target_shape(TARGETS / name / "config.json")


def merged(files: list[str], tmp_path: Path | None = None, overlay: dict | None = None) -> dict:
    paths = [REPO / f for f in files]
    if overlay is not None:
        assert tmp_path is not None
        extra = tmp_path / "overlay.yaml"
        extra.write_text(yaml.safe_dump(overlay), encoding="utf-8")
        paths.append(extra)
    return load_config(*paths)


def test_every_shipped_config_is_covered():
    shipped = {p.stem for p in (REPO / "config" / "examples").glob("*.yaml")}
    assert shipped | {"demo"} == set(EXAMPLES)


def test_llama_3_1_8b_shape_and_estimates():
    llama = shape("llama-3.1-8b")
    assert (llama.num_layers, llama.hidden_size, llama.num_kv_heads, llama.vocab_size) == (
        32,
        4096,
        8,
        128256,
    )
    assert llama.head_dim == 128 and llama.mla_latent is None
    # By hand: embeddings and the untied lm_head, then per layer q, k, v, o, the gated MLP and
    # two norms, then the final norm.
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    parameters = 2 * 128256 * 4096 + 32 * layer + 4096
    assert llama.parameters == parameters == 8_030_261_248
    assert llama.weight_bytes("bfloat16") == 2 * parameters  # 16.06 GB
    assert round(llama.weight_bytes("bfloat16") / 1e9, 2) == 16.06
    # 2 (K and V) x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB a token.
    assert llama.kv_bytes_per_token("bfloat16", 1) == 128 * 1024
    assert llama.kv_bytes_per_token("fp8", 1) == 64 * 1024
    # Tensor parallel 8: one KV head per GPU; 16: the heads are replicated, still one per GPU.
    assert llama.kv_bytes_per_token("bfloat16", 8) == 16 * 1024
    assert llama.kv_bytes_per_token("bfloat16", 16) == 16 * 1024


def test_kimi_k2_5_shape_through_its_text_config():
    kimi = shape("kimi-k2.5")
    assert kimi.multimodal
    assert (kimi.num_layers, kimi.hidden_size, kimi.vocab_size) == (61, 7168, 163840)
    assert kimi.mla_latent == 512 + 64
    # MLA: one latent per layer, the same on every tensor parallel rank.
    assert kimi.kv_bytes_per_token("bfloat16", 1) == 576 * 61 * 2 == 70272
    assert kimi.kv_bytes_per_token("bfloat16", 8) == 70272
    # 1 dense layer + 60 MoE layers of 384 routed experts and one shared: about 1.03T.
    routed = 60 * 384 * 3 * 7168 * 2048
    assert kimi.quantized_parameters == routed  # INT4 g32: only the routed experts
    assert 1.02e12 < kimi.parameters < 1.04e12
    # The released checkpoint's safetensors take 554.27 GiB (64 files, its ~0.9 GiB vision
    # tower included); the estimate of the language model: int4 experts with a bf16 scale per
    # 32 weights, everything else bf16.
    assert abs(kimi.weight_bytes("bfloat16") / GIB - 554.27) < 0.01 * 554.27


@pytest.mark.parametrize(
    "name, parameters",
    [
        # Published counts: SmolLM2-135M 134,515,008 (tied), Qwen2.5-7B 7.61B (q/k/v biases),
        # Qwen3-8B 8.2B, Qwen3-30B-A3B 30.5B (128 experts, no shared one).
        ("smollm2-135m", 134_515_008),
        ("qwen2.5-7b", 7.61e9),
        ("qwen3-8b", 8.19e9),
        ("qwen3-30b-a3b", 30.5e9),
    ],
)
def test_other_real_targets(name, parameters):
    target = shape(name)
    assert abs(target.parameters - parameters) / parameters < 0.005
    assert target.kv_bytes_per_token("bfloat16", 1) == (
        2 * target.num_layers * target.num_kv_heads * target.head_dim * 2
    )


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_shipped_config_passes_checks_and_plan(example):
    files, target, device_memory = EXAMPLES[example]
    config = merged(files)
    target_shape = shape(target)
    check_config(config, target_shape)
    plan = plan_engines(config, target_shape, device_memory)
    assert plan.problems == ()
    stages = [engine.stage for engine in plan.engines]
    regenerate = int(config["corpus"]["regenerate"]["enabled"])
    assert stages.count("regenerate") == regenerate
    assert stages.count("extract") == 2  # train and val
    assert sum(len(e.jobs) for e in plan.engines if e.stage == "extract") == sum(
        config["extract"]["num_shards"].values()
    )
    assert stages.count("bench") == 1 + len(config["bench"]["num_speculative_tokens"])
    tp = config["engine"]["tensor_parallel_size"]
    for engine in plan.engines:
        assert engine.tensor_parallel_size == tp
        assert engine.kwargs.get("tensor_parallel_size", 1) == tp
        if engine.device == "gpu":
            assert engine.memory_bytes_per_device <= device_memory
            assert engine.kv_tokens >= engine.max_model_len


def test_kimi_plan_per_gpu():
    config = merged(EXAMPLES["kimi-k2.5-8gpu"][0])
    kimi = shape("kimi-k2.5")
    plan = plan_engines(config, kimi, H200)
    extract = next(e for e in plan.engines if e.stage == "extract")
    # ~594 GB of INT4 weights over 8 GPUs; the KV cache is what 0.92 of an H200 leaves.
    assert extract.weight_bytes_per_device == -(-kimi.weight_bytes("bfloat16") // 8)
    assert 70e9 < extract.weight_bytes_per_device < 78e9
    budget = int(config["extract"]["gpu_memory_utilization"] * H200)
    assert extract.memory_bytes_per_device == budget
    assert extract.kv_bytes_per_token == 70272
    assert extract.max_model_len == config["tokenize"]["max_length"] + 1


def test_llama_side_by_side_bench_of_six_engines_on_one_h100_is_refused(tmp_path):
    # Six copies of a 16 GB target at 0.14 of an 80 GiB GPU each: no room for the weights.
    config = merged(
        EXAMPLES["llama3.1-8b-8gpu"][0],
        tmp_path,
        {"bench": {"gpu_memory_utilization": 0.14, "schedule": "side_by_side"}},
    )
    plan = plan_engines(config, shape("llama-3.1-8b"), H100)
    text = "\n".join(plan.problems)
    assert "bench.gpu_memory_utilization 0.14" in text
    assert "side by side" in text and "bench.schedule: one_at_a_time" in text


def test_weights_over_the_device_are_refused(tmp_path):
    config = merged(
        EXAMPLES["kimi-k2.5-8gpu"][0], tmp_path, {"engine": {"tensor_parallel_size": 4}}
    )
    plan = plan_engines(config, shape("kimi-k2.5"), H100)
    assert any(
        "above the device's 80.0 GiB" in p and "engine.tensor_parallel_size >= " in p
        for p in plan.problems
    )


def test_kv_cache_bytes_below_one_sequence_are_refused_by_the_plan(tmp_path):
    config = merged(
        EXAMPLES["llama3.1-8b-8gpu"][0],
        tmp_path,
        {"tokenize": {"max_length": 32768}, "extract": {"kv_cache_memory_bytes": 3 << 30}},
    )
    plan = plan_engines(config, shape("llama-3.1-8b"), H100)
    assert any(
        p.startswith("extract train")
        and "extract.kv_cache_memory_bytes 3221225472" in p
        and "tokenize.max_length 32769-token sequence" in p
        for p in plan.problems
    )


def test_plan_command_prints_every_engine(capsys):
    status = main(
        [
            "--configfile",
            str(REPO / "config/examples/kimi-k2.5-8gpu.yaml"),
            "--target-config",
            str(TARGETS / "kimi-k2.5" / "config.json"),
            "--device-memory-gib",
            "139.8",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    for name in ("regenerate:", "extract train (8 jobs):", "extract val (1 jobs):", "bench k=5:"):
        assert name in out
    assert "tensor_parallel_size=8" in out and "every engine fits" in out
    # docs/storage.md quotes this size.
    assert "training checkpoints: 2 x 10.2 GiB" in out


def test_plan_command_refuses_with_status_1(capsys):
    status = main(
        [
            "--configfile",
            str(REPO / "config/examples/kimi-k2.5-8gpu.yaml"),
            "--target-config",
            str(TARGETS / "kimi-k2.5" / "config.json"),
            "--device-memory-gib",
            "40",
        ]
    )
    assert status == 1
    assert "REFUSED" in capsys.readouterr().out


def test_quantization_ignore_lists():
    from draftflow.plan.target_shape import read_quantization

    # Kimi-K2.5's compressed-tensors list: names and re: patterns.
    kimi = read_quantization(yaml.safe_load((TARGETS / "kimi-k2.5" / "config.json").read_text()))
    assert kimi.bytes_per_parameter == 4 / 8 + 2 / 32
    assert kimi.quantizes("model.layers.1.mlp.experts.7.down_proj")
    assert not kimi.quantizes("model.layers.0.mlp.gate_proj")
    assert not kimi.quantizes("model.layers.1.mlp.shared_experts.up_proj")
    assert not kimi.quantizes("model.layers.1.self_attn.kv_b_proj")
    assert not kimi.quantizes("lm_head")
    # gpt-oss's mxfp4 list: globs over module prefixes.
    mxfp4 = read_quantization(
        {
            "quantization_config": {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens"],
            }
        }
    )
    assert not mxfp4.quantizes("model.layers.3.self_attn.q_proj")
    assert mxfp4.quantizes("model.layers.3.mlp.experts.0.gate_proj")
    with pytest.raises(ValueError, match="some_future_scheme"):
        read_quantization({"quantization_config": {"quant_method": "some_future_scheme"}})


def test_streamed_mode_captures_the_train_shards_every_epoch(tmp_path):
    config = merged(EXAMPLES["kimi-k2.5-8gpu"][0], tmp_path, {"extract": {"mode": "streamed"}})
    plan = plan_engines(config, shape("kimi-k2.5"), H200)
    train = next(e for e in plan.engines if e.name.startswith("extract train"))
    shards, epochs = config["extract"]["num_shards"]["train"], config["train"]["epochs"]
    assert len(train.jobs) == shards * epochs
    assert train.jobs[-1] == f"extract_stream link-{shards * epochs - 1:05d}"
    kept = merged(
        EXAMPLES["kimi-k2.5-8gpu"][0],
        tmp_path,
        {"extract": {"mode": "streamed", "keep_first_epoch": True}},
    )
    plan = plan_engines(kept, shape("kimi-k2.5"), H200)
    train = next(e for e in plan.engines if e.name.startswith("extract train"))
    assert len(train.jobs) == shards
