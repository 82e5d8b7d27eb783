"""Capture on targets of each model family (tests/families.py: random weights, no hub), on the
real vLLM CPU build against transformers fp32, with the extract job's verification thresholds.

One engine per family: dense Qwen3, Qwen3-MoE, DeepSeek-V3 (MLA + MoE), GPT-OSS (its layers take
the states before the positions) and the Kimi-K2.5
wrapper (its DeepSeek-V3 text model, text only). Llava's vLLM class imports torchvision, which
the CPU stack does not install: there the test asserts the one clear error a user gets, and the
GPU lane (tests/gpu/test_gpu_families.py) captures it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from capture_stores import StoreShape, write_store
from config_support import capture_engine_settings, demo_capture_layers

from draftflow.capture.backends import CaptureEngineSettings, make_backend
from draftflow.capture.decoder_search import DecoderNotFoundError, find_decoder
from draftflow.capture.extract import VerifySettings
from draftflow.capture.layers import default_aux_layers
from draftflow.capture.verify import cosine_summary, token_cosines
from draftflow.config import DEMO_CONFIG, from_section, load_config
from draftflow.engine import EngineStartError, is_multimodal_wrapper

# The extract job's verification (extract.verify defaults): what a shard must pass.
# The demo's verification thresholds (config/demo.yaml, extract.verify).
THRESHOLDS = from_section(
    VerifySettings, load_config(DEMO_CONFIG)["extract"]["verify"], "extract.verify"
)
LENGTHS = [7, 300, 40, 130, 64]
# Chunked prefill (prompts longer than 128 tokens) and more prompts than sequences.
ENGINE = capture_engine_settings(
    320,
    max_num_batched_tokens=128,
    max_num_seqs=4,
    kv_cache_memory_bytes=32 << 20,
    # vLLM picks its scheduler cores, no bit-for-bit repeats (the demo: 0 cores, deterministic)
    reserved_cpus=None,
    deterministic=False,
)
# transformers fp32: the reference each capture is held against.
HF_REFERENCE = capture_engine_settings(64, hf_dtype="float32")
CPU_FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "gpt_oss"]
MLA_FAMILIES = {"deepseek_v3", "kimi_k25"}
VLLM_CLASSES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k25": "KimiK25ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
}


def cpu_build_chunks_prefill(family: str, engine: CaptureEngineSettings = ENGINE) -> bool:
    """Whether vLLM's CPU build prefills long prompts in chunks for this family.

    An MLA target gets chunked prefill only from the AMX MLA kernel; with the reference
    kernel (a CPU without AMX tiles, or ``attention_config.backend: CPU_MLA``) vLLM turns
    chunked prefill off and prefills each prompt in one forward (vllm/platforms/cpu.py).
    """
    if family not in MLA_FAMILIES:
        return True
    backend = engine.engine_args.get("attention_config", {}).get("backend")
    return backend != "CPU_MLA" and torch.cpu._is_amx_tile_supported()


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 49_000, (n,), generator=generator).tolist() for n in lengths]


def assert_verifies(captured, reference, layer_ids) -> dict:
    """The extract job's check: per layer, mean and 1st-percentile token cosine."""
    assert [c.shape for c in captured] == [r.shape for r in reference]
    cosines = torch.cat([token_cosines(c, r) for c, r in zip(captured, reference, strict=True)])
    summary = cosine_summary(cosines, layer_ids)
    for layer, values in summary.items():
        assert values["mean"] >= THRESHOLDS.min_mean_cosine, (layer, values)
        assert values["p01"] >= THRESHOLDS.min_p01_cosine, (layer, values)
    return summary


def test_family_targets_are_what_they_claim(family_targets):
    """Architecture names vLLM registers, aux layers from the text config (wrappers nest it)."""
    import json

    for family, vllm_class in VLLM_CLASSES.items():
        target = family_targets(family)
        config = json.loads((target / "config.json").read_text())
        assert config["architectures"] == [vllm_class]
        layers = demo_capture_layers(target)
        assert layers.aux_layer_ids == default_aux_layers(8) == [2, 4, 5]
        assert layers.hidden_size == 128
        assert is_multimodal_wrapper(target) == (family in ("kimi_k25", "llava"))
    deepseek = json.loads((family_targets("deepseek_v3") / "config.json").read_text())
    assert deepseek["kv_lora_rank"] + deepseek["qk_rope_head_dim"] == 576
    assert deepseek["topk_method"] == "noaux_tc"


@pytest.mark.parametrize("family", list(VLLM_CLASSES))
def test_hf_backend_finds_the_text_decoder(family, family_targets):
    """transformers: the decoder of a causal LM and of a wrapper's language model."""
    target = family_targets(family)
    layers = demo_capture_layers(target)
    backend = make_backend("hf", target, layers.layer_ids, HF_REFERENCE)
    try:
        (states,) = backend.capture(make_prompts([20], seed=1))
        assert states.shape == (20, 4, 128)
        assert backend.num_layers == 8
    finally:
        backend.close()


def test_hf_backend_reads_a_wrapper_whose_config_class_vllm_replaced(family_targets):
    """vLLM 0.24 registers its own Kimi-K2.5 config class with ``AutoConfig`` once an engine has
    read such a target (seen on the GPU lane, where the hf reference then found no model class):
    the hf backend reads the checkpoint with transformers' own class instead."""
    from transformers import AutoConfig, Kimi_K25Config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    class KimiK25Config(Kimi_K25Config):  # a class of vLLM's name, unknown to the auto models
        model_type = "kimi_k25"

    target = family_targets("kimi_k25")
    layers = demo_capture_layers(target)
    AutoConfig.register("kimi_k25", KimiK25Config, exist_ok=True)
    try:
        assert type(AutoConfig.from_pretrained(str(target))) is KimiK25Config
        backend = make_backend("hf", target, layers.layer_ids, HF_REFERENCE)
        try:
            (states,) = backend.capture(make_prompts([20], seed=1))
        finally:
            backend.close()
    finally:
        CONFIG_MAPPING._extra_content.pop("kimi_k25", None)
    assert states.shape == (20, 4, 128)


class _Block(torch.nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(count))
        self.norm = torch.nn.LayerNorm(4)


class _Wrapper(torch.nn.Module):
    """A wrapper nesting its text model where no known path looks, beside a vision encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = _Block(2)
        self.text_stack = torch.nn.Module()
        self.text_stack.decoder = _Block(3)


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25"])
def test_verification_up_to_a_layer_loads_only_the_layers_below(family, family_targets, tmp_path):
    """extract.verify.max_layer: the low layers checked against the target cut to its first
    layers (what a target too large for one device gets, e.g. config/examples/kimi-k2.5-8gpu)."""
    from draftflow.capture.backends.hf import HFBackend
    from draftflow.capture.verify import verify_shard

    target = family_targets(family)
    layers = demo_capture_layers(target)
    prompts = make_prompts([20, 33, 9], seed=2)
    full = make_backend("hf", target, layers.layer_ids, HF_REFERENCE)
    try:
        states = full.capture(prompts)
    finally:
        full.close()
    low = layers.aux_layer_ids[0]
    cut = HFBackend(target, [low], HF_REFERENCE, num_layers=low)
    try:
        # A prefix of the decoder, with the full model's states at its top.
        assert cut.num_layers == low < full.num_layers
        (top,) = cut.capture(prompts[:1])
        assert torch.allclose(top[:, 0], states[0][:, 0], atol=1e-5)
    finally:
        cut.close()

    def store(name: str, flip_column: int | None) -> str:
        samples = []
        for i, (ids, sample) in enumerate(zip(prompts, states, strict=True)):
            sample = sample.clone()
            if flip_column is not None:
                sample[:, flip_column] = -sample[:, flip_column]
            samples.append(
                {
                    "id": f"s{i}",
                    "input_ids": torch.tensor(ids),
                    "loss_mask": torch.ones(len(ids)),
                    "hidden_states": sample,
                }
            )
        shape = StoreShape(layers.layer_ids, layers.aux_layer_ids, layers.hidden_size)
        write_store(tmp_path / name, samples, shape, {"test": name}, chunk_samples=2)
        return str(tmp_path / name)

    check = {
        "fraction": 1.0,
        "min_mean_cosine": THRESHOLDS.min_mean_cosine,
        "min_p01_cosine": THRESHOLDS.min_p01_cosine,
        "settings": HF_REFERENCE,
        "max_layer": low,
    }
    passed = verify_shard(store("right", None), target, **check)
    assert passed["passed"] and list(passed["per_layer"]) == [str(low)]
    assert passed["reference"] == f"hf float32, first {low} layers"
    # A wrong row at a checked layer fails; the layers above max_layer are not looked at.
    failed = verify_shard(store("wrong-low", 0), target, **check)
    assert not failed["passed"] and failed["failures"][0].startswith(f"layer {low}: mean")
    assert verify_shard(store("wrong-high", len(layers.layer_ids) - 1), target, **check)["passed"]
    with pytest.raises(ValueError, match="below every captured layer"):
        verify_shard(store("any", None), target, **{**check, "max_layer": low - 1})


def test_decoder_search_falls_back_to_structure_and_names_what_it_tried():
    found = find_decoder(_Wrapper(), num_layers=3)
    assert found.path == "text_stack.decoder" and found.num_layers == 3
    with pytest.raises(DecoderNotFoundError, match=r"several: vision \(2 layers\)"):
        find_decoder(_Wrapper())
    empty = torch.nn.Module()
    empty.model = torch.nn.Linear(2, 2)
    with pytest.raises(DecoderNotFoundError) as raised:
        find_decoder(empty)
    message = str(raised.value)
    assert message.startswith("Module: no text decoder found")
    assert "model: Linear" in message and "language_model.model" in message
    with pytest.raises(DecoderNotFoundError, match=r"has 3 layers, the text config says 61"):
        find_decoder(_Block(3), num_layers=61)


# The reference MLA kernel, which a CPU without AMX tiles runs: chunked prefill off.
REFERENCE_MLA = replace(ENGINE, engine_args={"attention_config": {"backend": "CPU_MLA"}})
# vLLM's Transformers backend (what runs an architecture vLLM has no class of its own for): the
# decoder layers are transformers', called with a batch of one and ``position_ids``.
TRANSFORMERS_BACKEND = replace(ENGINE, engine_args={"model_impl": "transformers"})


class _LlamaLayer(torch.nn.Module):
    def forward(self, positions, hidden_states, residual):  # vLLM's usual layer
        return hidden_states, residual


class _GptOssLayer(torch.nn.Module):
    def forward(self, hidden_states, positions, residual):  # vLLM's GPT-OSS TransformerBlock
        return hidden_states, residual


class _GraniteLayer(torch.nn.Module):
    def forward(self, positions, hidden_states):  # no residual stream passed along
        return hidden_states


class _TransformersLayer(torch.nn.Module):
    """A transformers decoder layer, as vLLM's Transformers backend calls it."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        return hidden_states


class _WrappedLayer(torch.nn.Module):
    def forward(self, *args, **kwargs):
        return args


def test_layer_inputs_follow_each_layer_s_own_parameter_names():
    """The hooks read (positions, hidden_states, residual) by name: GPT-OSS's layers take the
    states first; positional or keyword, residual or none; a transformers layer under vLLM's
    Transformers backend; M-RoPE positions keep one row."""
    from draftflow.capture.adapters.decoder import layer_inputs

    positions, states, residual = torch.arange(5), torch.randn(5, 8), torch.randn(5, 8)
    for layer, args, kwargs in [
        (_LlamaLayer(), (positions, states, residual), {}),
        (_LlamaLayer(), (positions,), {"hidden_states": states, "residual": residual}),
        (_GptOssLayer(), (states, positions, residual), {}),
        (_WrappedLayer(), (positions, states, residual), {}),
    ]:
        got = layer_inputs(layer, args, kwargs)
        assert got[0] is positions and got[1] is states and got[2] is residual, type(layer)
    got = layer_inputs(_GraniteLayer(), (positions, states), {})
    assert got[0] is positions and got[1] is states and got[2] is None
    # A batch of one: positions [1, T], states [1, T, H], the residual added inside the layer.
    got = layer_inputs(_TransformersLayer(), (states[None],), {"position_ids": positions[None]})
    assert torch.equal(got[0], positions) and torch.equal(got[1], states) and got[2] is None
    mrope = torch.stack([positions] * 3)
    assert torch.equal(layer_inputs(_LlamaLayer(), (mrope, states, None), {})[0], positions)
    # States where positions belong (a layer whose names the wrapper hides): refused, not filed.
    with pytest.raises(RuntimeError, match="not called with integer positions"):
        layer_inputs(_WrappedLayer(), (states, positions, residual), {})


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("family", "engine"),
    [(family, ENGINE) for family in CPU_FAMILIES]
    + [("deepseek_v3", REFERENCE_MLA), ("qwen3", TRANSFORMERS_BACKEND)],
    ids=[*CPU_FAMILIES, "deepseek_v3-reference-mla", "qwen3-transformers-backend"],
)
def test_hooks_capture_matches_hf(family, engine, family_targets):
    target = family_targets(family)
    layer_ids = demo_capture_layers(target).layer_ids
    prompts = make_prompts(LENGTHS, seed=0)
    backend = make_backend("hooks", target, layer_ids, engine)
    try:
        captured = backend.capture(prompts)
        stats = backend.last_stats
    finally:
        backend.close()
    chunked = stats["max_forwards_per_request"] > 1
    assert chunked == cpu_build_chunks_prefill(family, engine), stats
    reference = make_backend(
        "hf", target, layer_ids, replace(HF_REFERENCE, max_model_len=ENGINE.max_model_len)
    )
    try:
        summary = assert_verifies(captured, reference.capture(prompts), layer_ids)
    finally:
        reference.close()
    print(family, "hooks vs hf fp32:", summary)


@pytest.mark.vllm
@pytest.mark.parametrize("family", CPU_FAMILIES)
def test_native_capture_matches_hf(family, family_targets):
    """vLLM's extractor (the CPU-safe connector) on each class that hands out aux states."""
    target = family_targets(family)
    layer_ids = demo_capture_layers(target).layer_ids
    prompts = make_prompts(LENGTHS, seed=4)
    backend = make_backend("native", target, layer_ids, ENGINE)
    try:
        captured = backend.capture(prompts)
    finally:
        backend.close()
    reference = make_backend(
        "hf", target, layer_ids, replace(HF_REFERENCE, max_model_len=ENGINE.max_model_len)
    )
    try:
        summary = assert_verifies(captured, reference.capture(prompts), layer_ids)
    finally:
        reference.close()
    print(family, "native vs hf fp32:", summary)


@pytest.mark.vllm
def test_llava_on_the_cpu_build_fails_with_one_clear_error(family_targets):
    """vLLM's Llava (like its other vision wrappers but Kimi-K2.5) imports torchvision."""
    target = family_targets("llava")
    with pytest.raises(EngineStartError) as raised:
        make_backend("hooks", target, demo_capture_layers(target).layer_ids, ENGINE)
    message = str(raised.value).split(" (the engine's log")[0]
    print(message)
    assert "LlavaForConditionalGeneration" in message
    assert "CPU build" in message
    assert "torchvision" in message
    assert "extract.backend hf" in message


def test_kimi_k25_example_validates_against_the_schema(repo_root):
    """config/examples/kimi-k2.5-8gpu.yaml as Snakemake reads it (merged over the schema's
    defaults and config/config.yaml)."""
    config = load_config(repo_root / "config/examples/kimi-k2.5-8gpu.yaml")
    assert config["target"]["trust_remote_code"] is True  # its tiktoken tokenizer is remote code
    extract = config["extract"]
    engine = config["engine"]
    assert engine["device"] == "gpu"
    assert engine["tensor_parallel_size"] == 8 == config["resources"]["train_gpus"]
    # Kimi-K2.5's text model has 61 layers: the ids are vLLM's EAGLE-3 default for it.
    assert extract["aux_layers"] == default_aux_layers(61)


def test_start_errors_of_unsupported_classes_say_what_to_do():
    """vLLM's own words for a class without EAGLE-3 support, and a missing torchvision."""
    from draftflow.engine import start_hint

    eagle3 = start_hint(
        "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs "
        "was requested"
    )
    assert "SupportsEagle3" in eagle3 and "extract.backend hooks or hf" in eagle3
    assert "cannot benchmark" in eagle3
    vision = start_hint("ModuleNotFoundError: No module named 'torchvision'")
    assert "torchvision" in vision and "extract.backend hf" in vision
    processor = start_hint("OSError: Can't load image processor for 'resources/target'.")
    assert "preprocessor_config.json" in processor and "bench" in processor
    assert start_hint("ValueError: something else") == ""
    # vLLM 0.24's words on the GPU lane for the GPT-OSS family's bf16 experts
    gpt_oss = start_hint("KeyError: 'layers.0.mlp.experts.w2_weight'")
    assert "mxfp4" in gpt_oss and "bf16" in gpt_oss


@pytest.mark.vllm
def test_a_class_vllm_could_not_inspect_is_imported_again_for_its_error():
    """vLLM's registry says only "failed to be inspected" where the class's module does not
    import (the GPU lane's Llava): the module is imported again for the real error. On this
    stack vLLM's Llava module really fails so, for want of torchvision."""
    from draftflow.engine import inspection_failure

    cause = (
        "1 validation error for ModelConfig\n  Value error, Model architectures "
        "['LlavaForConditionalGeneration'] failed to be inspected. Please check the logs"
    )
    assert inspection_failure(cause) == "ModuleNotFoundError: No module named 'torchvision'"
    assert inspection_failure(cause.replace("Llava", "Qwen3").replace("Conditional", "")) == ""
    assert inspection_failure("ValueError: something else") == ""


def test_native_refuses_mla_targets_where_vllm_s_extractor_fails(family_targets):
    """vLLM 0.24's extractor failed at the first forward of every MLA target on the GPU lane;
    the 0.32 CPU build captures them (test_native_capture_matches_hf)."""
    from draftflow.capture.backends.native import native_refusal

    deepseek, kimi, qwen3 = (family_targets(f) for f in ("deepseek_v3", "kimi_k25", "qwen3"))
    refusal = native_refusal(deepseek, "0.24.0", cpu_build=False)
    assert "DeepseekV3ForCausalLM" in refusal and "MLA" in refusal
    assert "vLLM >= 0.32" in refusal and "extract.backend hooks" in refusal
    assert "KimiK25ForConditionalGeneration" in native_refusal(kimi, "0.24.0", cpu_build=False)
    assert native_refusal(deepseek, "0.32.0", cpu_build=False) == ""
    assert native_refusal(deepseek, "0.24.0", cpu_build=True) == ""
    assert native_refusal(qwen3, "0.24.0", cpu_build=False) == ""
    assert "needs vLLM >= 0.22" in native_refusal(qwen3, "0.16.0", cpu_build=True)


def test_a_class_vllm_cannot_inspect_names_the_missing_module(monkeypatch):
    """The GPU lane's words when vLLM's registry lacked a module: the cause comes back only as
    pydantic's summary, so the hint looks for what the registry imports."""
    import importlib.util

    from draftflow.engine import start_hint

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "mistral_common" else found(name, *args),
    )
    cause = (
        "1 validation error for ModelConfig\n  Value error, Model architectures "
        "['LlavaForConditionalGeneration'] failed to be inspected. Please check the logs for "
        "more details. [type=value_error]"
    )
    hint = start_hint(cause)
    assert "mistral_common" in hint and "envs/gpu-lane.txt" in hint
    assert "compressed-tensors" not in hint  # installed here: not named


def test_a_checkpoint_transformers_cannot_run_as_text_is_named(tmp_path):
    from transformers import CLIPVisionConfig

    from draftflow.capture.backends.hf import load_target

    vision = CLIPVisionConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    vision.save_pretrained(str(tmp_path))
    with pytest.raises(RuntimeError) as raised:
        load_target(tmp_path, torch.float32, trust_remote_code=False)
    message = str(raised.value)
    assert "CLIPVisionConfig" in message
    assert "AutoModelForCausalLM or AutoModelForImageTextToText" in message


def test_the_root_cause_of_a_failed_inspection_is_the_registry_import_error():
    """Lines as vLLM 0.24 printed them on the GPU lane for a Llava target without
    mistral_common: the driver's exception is pydantic's summary, the cause is in the log."""
    from draftflow.engine import root_cause

    log = [
        "ERROR 12-01 19:37:27 [registry.py:975] Error in inspecting model architecture "
        "'LlavaForConditionalGeneration'",
        "ERROR 12-01 19:37:27 [registry.py:975] subprocess.CalledProcessError: Command "
        "'['python3', '-m', 'vllm.model_executor.models.registry']' returned non-zero exit "
        "status 1.",
        "ERROR 12-01 19:37:27 [registry.py:975] RuntimeError: Error raised in subprocess:",
        "ERROR 12-01 19:37:27 [registry.py:975]     from mistral_common.protocol.instruct.chunk "
        "import ImageChunk, TextChunk",
        "ERROR 12-01 19:37:27 [registry.py:975] ModuleNotFoundError: No module named "
        "'mistral_common'",
        "ERROR 12-01 19:37:27 [registry.py:975] ",
    ]
    summary = (
        "1 validation error for ModelConfig\n  Value error, Model architectures "
        "['LlavaForConditionalGeneration'] failed to be inspected. Please check the logs for "
        "more details. [type=value_error]\n    For further information visit "
        "https://errors.pydantic.dev/2.13/v/value_error"
    )
    cause = root_cause([*log, summary])
    assert cause == "ModuleNotFoundError: No module named 'mistral_common'"


def test_the_root_cause_of_a_failed_start_is_the_worker_exception_not_a_source_line():
    """Lines as vLLM 0.32's CPU build printed them when the KV cache did not fit: the worker's
    ValueError is the cause; the tracebacks' source lines ("raise RuntimeError(") are not."""
    from draftflow.engine import root_cause

    prefix = "(Worker pid=10236) ERROR 12-02 08:04:50 [multiproc_executor.py:1063] "
    cause = (
        "ValueError: Available memory on node 0 (7.65/9.71 GiB) on kv cache allocation is "
        "less than requested memory for kv (-0.12/0.97 GiB). Reduce CPU memory used by other "
        "processes."
    )
    log = [
        prefix + "WorkerProc hit an exception.",
        prefix + "Traceback (most recent call last):",
        prefix + '  File "vllm/v1/worker/cpu_worker.py", line 241, in determine_available_memory',
        prefix + "    raise ValueError(",
        prefix + cause,
        "Exception: WorkerProc initialization failed due to an exception in a background "
        "process. See stack trace for root cause.",
        '  File "vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup',
        "    raise RuntimeError(",
    ]
    summary = "Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    assert root_cause([*log, summary]) == cause
