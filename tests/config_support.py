"""Settings built the way the workflow builds them: from the CPU demo's merged config
(config/demo.yaml over config/schema.yaml's defaults, draftflow.config.load_config), with a
test's own changes. The settings classes have no defaults, so a test names what it changes."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from typing import Any

from draftflow.bench.settings import BenchSettings, bench_settings
from draftflow.capture import extract as capture_extract
from draftflow.capture.backends import CaptureEngineSettings
from draftflow.capture.extract import ExtractSettings, VerifySettings
from draftflow.capture.layers import CaptureLayers, capture_layers
from draftflow.config import DEMO_CONFIG, from_section, load_config
from draftflow.corpus.regenerate import ENFORCE_EAGER, RegenerateSettings
from draftflow.data.split import SplitSettings
from draftflow.data.tokenize import TokenizeSettings
from draftflow.engine import engine_env, engine_kwargs
from draftflow.engine_settings import EngineSettings, engine_settings
from draftflow.train.settings import TrainSettings

# The vLLM 0.16 lane's venv has no Snakemake (whose loader load_config uses): the main venv
# writes the merged demo config to this file first (Makefile, test-vllm016).
MERGED_DEMO_ENV = "DRAFTFLOW_MERGED_DEMO_CONFIG"


@functools.cache
def _demo_config() -> dict[str, Any]:
    merged = os.environ.get(MERGED_DEMO_ENV)
    if merged:
        with open(merged, encoding="utf-8") as file:
            return json.load(file)
    return load_config(DEMO_CONFIG)


def demo_config() -> dict[str, Any]:
    """The demo's merged, validated config (a copy a test may change)."""
    return copy.deepcopy(_demo_config())


def demo_target(**changes: Any) -> dict[str, Any]:
    """The demo's target section (SmolLM2's GGUF) with ``changes``, for prepare_configured_target."""
    return {**_demo_config()["target"], **changes}


def extract_settings(**changes: Any) -> ExtractSettings:
    """The demo's extract settings, built as the extract rules build them; ``verify`` takes a
    mapping of VerifySettings changes."""
    settings = capture_extract.extract_settings(_demo_config())
    if "verify" in changes and not isinstance(changes["verify"], VerifySettings):
        changes["verify"] = dataclasses.replace(settings.verify, **changes["verify"])
    return dataclasses.replace(settings, **changes)


def capture_engine_settings(max_model_len: int, **changes: Any) -> CaptureEngineSettings:
    """The demo's capture engine (an extract job's, ExtractSettings.capture_engine) for samples of
    up to ``max_model_len`` - 1 tokens, with ``changes``. The demo runs on the CPU (device "cpu");
    its engine is deterministic, with hf_dtype bfloat16, reserved_cpus 0 and a 256 MiB KV cache."""
    settings = capture_extract.extract_settings(_demo_config()).capture_engine(max_model_len)
    return dataclasses.replace(settings, **changes)


def demo_capture_layers(model_dir: str | os.PathLike[str]) -> CaptureLayers:
    """The layers the demo's extract jobs capture of ``model_dir`` (its extract.aux_layers)."""
    return capture_layers(model_dir, _demo_config()["extract"]["aux_layers"])


def verify_settings(**changes: Any) -> VerifySettings:
    return from_section(
        VerifySettings, {**_demo_config()["extract"]["verify"], **changes}, "extract.verify"
    )


def train_settings(**changes: Any) -> TrainSettings:
    return from_section(TrainSettings, {**_demo_config()["train"], **changes}, "train")


def split_settings(**changes: Any) -> SplitSettings:
    return from_section(SplitSettings, {**_demo_config()["split"], **changes}, "split")


def tokenize_settings(**changes: Any) -> TokenizeSettings:
    """The demo's tokenize settings, with its split and the regenerate reasoning switch."""
    config = _demo_config()
    given = {
        "split": split_settings(),
        "enable_thinking": config["corpus"]["regenerate"]["enable_thinking"],
    }
    return from_section(TokenizeSettings, {**config["tokenize"], **given, **changes}, "tokenize")


def regenerate_settings(**changes: Any) -> RegenerateSettings:
    section = {k: v for k, v in _demo_config()["corpus"]["regenerate"].items() if k != "enabled"}
    return from_section(RegenerateSettings, {**section, **changes}, "corpus.regenerate")


def demo_bench_settings(engine: dict[str, Any] | None = None, **changes: Any) -> BenchSettings:
    """The demo's bench settings; ``engine``: changes to its EngineSettings."""
    settings = bench_settings(_demo_config())
    return dataclasses.replace(
        settings, engine=dataclasses.replace(settings.engine, **(engine or {})), **changes
    )


def demo_engine_settings(stage: str, **changes: Any) -> EngineSettings:
    """The demo's engine of ``stage`` (regenerate, extract, bench) with ``changes``."""
    return dataclasses.replace(engine_settings(_demo_config(), stage), **changes)


def demo_engine_env(stage: str, **changes: Any) -> dict[str, str]:
    """``draftflow.engine.engine_env`` for the demo's ``stage`` engine, with ``changes`` to its
    arguments: the stage's settings (extract: also extract.model_runner and deterministic;
    regenerate and bench have no such keys) and the demo's device (cpu) as the platform."""
    config = _demo_config()
    engine = engine_settings(config, stage)
    capture = config["extract"] if stage == "extract" else None
    arguments = {
        "reserved_cpus": engine.reserved_cpus,
        "model_runner": capture["model_runner"] if capture else "default",
        "kv_cache_memory_bytes": engine.kv_cache_memory_bytes,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "cpu": engine.device == "cpu",
        "deterministic": capture["deterministic"] if capture else False,
    }
    return engine_env(**{**arguments, **changes})


def demo_engine_kwargs(model: str | os.PathLike[str], **changes: Any) -> dict[str, Any]:
    """``draftflow.engine.engine_kwargs`` for the demo's regenerate engine (the plain one:
    draftflow.corpus.regenerate.make_engine's arguments) of ``model``, with ``changes``."""
    config = _demo_config()
    engine = engine_settings(config, "regenerate")
    arguments = {
        "max_model_len": engine.max_model_len,
        "kv_cache_memory_bytes": engine.kv_cache_memory_bytes,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "seed": config["corpus"]["regenerate"]["seed"],
        "trust_remote_code": config["target"]["trust_remote_code"],
        "enforce_eager": ENFORCE_EAGER,
        "extra": engine.engine_args,
    }
    return engine_kwargs(model, **{**arguments, **changes})


def make_engine_arguments() -> dict[str, Any]:
    """draftflow.corpus.regenerate.make_engine's arguments beside the engine, the demo's."""
    config = _demo_config()
    return {
        "seed": config["corpus"]["regenerate"]["seed"],
        "trust_remote_code": config["target"]["trust_remote_code"],
    }
