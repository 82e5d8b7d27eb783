"""The settings of every vLLM engine a stage starts (regenerate, extract, bench), in one place.

Read from the validated config (config/schema.yaml fills every default): the devices come from
the top-level ``engine`` section, the rest from the stage's own section. Nothing here has a
default of its own, so a value missing from the config is an error, not a silent fallback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

STAGES = ("regenerate", "extract", "bench")
DEVICES = ("gpu", "cpu")

Device = Literal["gpu", "cpu"]

# The keys of the extract: section that its engine takes (engine_settings below reads them);
# the rest are the capture's own (draftflow.capture.extract.ExtractSettings) or shape the DAG.
EXTRACT_ENGINE_KEYS = frozenset(
    {
        "max_num_batched_tokens",
        "max_num_seqs",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "reserved_cpus",
        "engine_args",
    }
)


@dataclass(frozen=True)
class EngineSettings:
    """One stage's vLLM engine: devices, context, batch, memory and extra arguments."""

    # engine.device: "gpu" runs every engine on tensor_parallel_size GPUs, "cpu" on vLLM's CPU build.
    device: Device
    tensor_parallel_size: int
    # Resolved: bench.dtype, else target.dtype (regenerate and extract: target.dtype).
    dtype: str
    max_model_len: int
    # None where the stage has no such key (vLLM's own default applies).
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float
    # Exact KV-cache bytes; wins over gpu_memory_utilization (None = use the share).
    kv_cache_memory_bytes: int | None
    # CPU build: cores vLLM keeps for its scheduler (None = vLLM's choice).
    reserved_cpus: int | None
    # Further vllm.LLM(...) keyword arguments (a copy of the config's).
    engine_args: dict[str, Any]

    @property
    def gpus(self) -> int:
        """GPUs one engine of this stage takes (0 on the CPU)."""
        return self.tensor_parallel_size if self.device == "gpu" else 0


def engine_settings(config: Mapping[str, Any], stage: str) -> EngineSettings:
    """The engine settings of ``stage`` ("regenerate", "extract" or "bench") from a validated
    config (draftflow.config.load_config, or Snakemake's ``config`` after validation)."""
    if stage not in STAGES:
        raise ValueError(f"engine stage {stage!r}: allowed are {', '.join(STAGES)}")
    engine = config["engine"]
    if engine["device"] not in DEVICES:
        raise ValueError(f"engine.device {engine['device']!r}: allowed are {', '.join(DEVICES)}")
    target_dtype = config["target"]["dtype"]
    max_length = config["tokenize"]["max_length"]
    if stage == "regenerate":
        section = config["corpus"]["regenerate"]
        dtype = target_dtype
        # null: as long as the longest training sample (prompt plus answer).
        max_model_len = section["max_model_len"] or max_length
        max_num_seqs = None
        max_num_batched_tokens = None
        engine_args: Mapping[str, Any] = {}
    elif stage == "extract":
        section = config["extract"]
        dtype = target_dtype
        # The capture engine prefills whole samples, at most tokenize.max_length tokens each.
        max_model_len = max_length
        max_num_seqs = section["max_num_seqs"]
        max_num_batched_tokens = section["max_num_batched_tokens"]
        engine_args = section["engine_args"]
    else:
        section = config["bench"]
        dtype = section["dtype"] or target_dtype
        max_model_len = section["max_model_len"]
        max_num_seqs = section["max_num_seqs"]
        max_num_batched_tokens = None
        engine_args = section["engine_args"]
    return EngineSettings(
        device=engine["device"],
        tensor_parallel_size=int(engine["tensor_parallel_size"]),
        dtype=dtype,
        max_model_len=int(max_model_len),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=float(section["gpu_memory_utilization"]),
        kv_cache_memory_bytes=section["kv_cache_memory_bytes"],
        reserved_cpus=section["reserved_cpus"],
        engine_args=dict(engine_args),
    )
