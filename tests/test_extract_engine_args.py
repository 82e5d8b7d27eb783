"""The extract stage's vLLM engine comes from ``engine_settings(config, "extract")``, as
regenerate's and bench's do: the engine plan's extract arguments are the ones an extract job
passes (rules/common.smk's params -> scripts/extract.py -> run_extract), and both are the
arguments the extract keys always gave, for every shipped config and the workflow tests' one."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from draftflow.capture.backends import CaptureEngineSettings, capture_engine_kwargs
from draftflow.capture.extract import ExtractSettings
from draftflow.capture.section import EXTRACT_DAG_KEYS, extract_section
from draftflow.config import from_section, load_config
from draftflow.engine import text_only_kwargs
from draftflow.engine_settings import EXTRACT_ENGINE_KEYS, engine_settings
from draftflow.plan.engines import MODEL_DIR, plan_engines
from draftflow.plan.target_shape import read_target_shape

REPO = Path(__file__).resolve().parents[1]
TARGETS = REPO / "tests" / "data" / "targets"

# Config files in merge order and the target whose shape the plan reads.
CONFIGS = {
    "demo": (["config/demo.yaml"], "smollm2-135m"),
    "tiny": (["config/demo.yaml", "tests/configs/tiny.yaml"], "smollm2-135m"),
    "kimi-k2.5-8gpu": (["config/examples/kimi-k2.5-8gpu.yaml"], "kimi-k2.5"),
    "llama3.1-8b-8gpu": (["config/examples/llama3.1-8b-8gpu.yaml"], "llama-3.1-8b"),
    "llama3.1-8b-one-gpu": (
        [
            "config/examples/llama3.1-8b-8gpu.yaml",
            "config/examples/overlays/llama3.1-8b-one-gpu.yaml",
        ],
        "llama-3.1-8b",
    ),
    "slurm-cluster": (["config/examples/slurm-cluster.yaml"], "llama-3.1-8b"),
    "smollm2-gpu": (["config/examples/smollm2-gpu.yaml"], "smollm2-135m"),
    "tool-calling-cpu": (
        ["config/demo.yaml", "config/examples/tool-calling-cpu.yaml"],
        "smollm2-135m",
    ),
}
# Every engine key away from its default: tensor parallel GPUs, an exact KV cache, reserved
# cores and further engine arguments.
OVERLAY = {
    "engine": {"device": "gpu", "tensor_parallel_size": 2},
    "extract": {
        "kv_cache_memory_bytes": 1 << 30,
        "reserved_cpus": 1,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 4096,
        "engine_args": {"block_size": 32, "kv_cache_dtype": "fp8"},
        "model_runner": "v2",
    },
}


def test_every_shipped_config_is_covered():
    shipped = {p.stem for p in (REPO / "config" / "examples").glob("*.yaml")}
    shipped |= {p.stem for p in (REPO / "config" / "examples" / "overlays").glob("*.yaml")}
    assert shipped | {"demo", "tiny"} == set(CONFIGS)


def merged(name: str, tmp_path: Path, overlay: dict | None) -> dict[str, Any]:
    files = [REPO / f for f in CONFIGS[name][0]]
    if overlay is not None:
        extra = tmp_path / "overlay.yaml"
        extra.write_text(yaml.safe_dump(overlay), encoding="utf-8")
        files.append(extra)
    return load_config(*files)


def job_settings(config: dict[str, Any]) -> ExtractSettings:
    """An extract job's settings: the rule's params.extract (rules/common.smk, extract_settings),
    handed over as Snakemake pickles params, read by scripts/extract.py."""
    params = copy.deepcopy(extract_section(config))
    return from_section(ExtractSettings, params, "extract")


def expected_kwargs(config: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """The capture engine's vllm.LLM arguments, spelled out from the config's keys."""
    extract, engine = config["extract"], config["engine"]
    kwargs: dict[str, Any] = {
        "model": MODEL_DIR,
        "max_model_len": max_model_len,
        "enforce_eager": True,
        "trust_remote_code": config["target"]["trust_remote_code"],
        "seed": 0,
    }
    if extract["kv_cache_memory_bytes"] is not None:
        kwargs["kv_cache_memory_bytes"] = extract["kv_cache_memory_bytes"]
    kwargs["gpu_memory_utilization"] = extract["gpu_memory_utilization"]
    if engine["tensor_parallel_size"] > 1:
        kwargs["tensor_parallel_size"] = engine["tensor_parallel_size"]
    return {
        **kwargs,
        **text_only_kwargs(MODEL_DIR),
        "enable_prefix_caching": False,
        "max_num_batched_tokens": extract["max_num_batched_tokens"],
        "max_num_seqs": extract["max_num_seqs"],
        "skip_tokenizer_init": True,
        **extract["engine_args"],
    }


def expected_backend(config: dict[str, Any], max_model_len: int) -> CaptureEngineSettings:
    """The capture backend's settings (its engine's environment too), from the config's keys."""
    extract, engine = config["extract"], config["engine"]
    return CaptureEngineSettings(
        max_model_len=max_model_len,
        tp_size=engine["tensor_parallel_size"],
        max_num_batched_tokens=extract["max_num_batched_tokens"],
        max_num_seqs=extract["max_num_seqs"],
        gpu_memory_utilization=extract["gpu_memory_utilization"],
        kv_cache_memory_bytes=extract["kv_cache_memory_bytes"],
        reserved_cpus=extract["reserved_cpus"],
        trust_remote_code=config["target"]["trust_remote_code"],
        model_runner=extract["model_runner"],
        deterministic=extract["deterministic"],
        engine_args=extract["engine_args"],
        store_dtype=extract["store_dtype"],
        hf_dtype=extract["hf_dtype"],
        device="cuda" if engine["device"] == "gpu" else "cpu",
    )


@pytest.mark.parametrize("overlay", [None, OVERLAY], ids=["as-shipped", "every-engine-key"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_plans_extract_engine_is_the_jobs(name, overlay, tmp_path):
    config = merged(name, tmp_path, overlay)
    settings = job_settings(config)
    assert settings.engine == engine_settings(config, "extract")
    # The longest sample a shard holds is tokenize.max_length tokens: the plan's context.
    context = config["tokenize"]["max_length"] + 1
    job = capture_engine_kwargs(MODEL_DIR, settings.capture_engine(context))
    plan = plan_engines(config, read_target_shape(TARGETS / CONFIGS[name][1] / "config.json"))
    extract = [engine for engine in plan.engines if engine.stage == "extract"]
    assert len(extract) == 2  # train and val
    for engine in extract:
        assert engine.kwargs == job
        assert engine.max_model_len == context
        assert engine.tensor_parallel_size == config["engine"]["tensor_parallel_size"]
    assert job == expected_kwargs(config, context)
    # Shorter shards: the job's context follows its longest sample, nothing else changes.
    assert settings.capture_engine(65) == expected_backend(config, 65)
    assert capture_engine_kwargs(MODEL_DIR, settings.capture_engine(65)) == {
        **job,
        "max_model_len": 65,
    }


def changed(value: Any) -> Any:
    """A different value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, dict):
        return {**value, "block_size": 32}
    if isinstance(value, str):
        return f"{value}-other"
    return [1] if value is None else None


def test_extract_engine_keys_are_the_ones_engine_settings_reads():
    """EXTRACT_ENGINE_KEYS (which extract_section leaves to the engine) is exactly what
    engine_settings takes from the extract: section: no key is lost or read twice."""
    config = load_config(REPO / "config" / "demo.yaml")
    base = engine_settings(config, "extract")
    read = set()
    for key, value in config["extract"].items():
        other = copy.deepcopy(config)
        other["extract"][key] = changed(value)
        if engine_settings(other, "extract") != base:
            read.add(key)
    assert read == EXTRACT_ENGINE_KEYS
    captured = set(extract_section(config)) - {"engine", "trust_remote_code"}
    assert captured == set(config["extract"]) - EXTRACT_DAG_KEYS - EXTRACT_ENGINE_KEYS
    assert not any(f.name in EXTRACT_ENGINE_KEYS for f in dataclasses.fields(ExtractSettings))
