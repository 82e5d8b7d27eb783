"""Every vLLM engine a run will start, with its arguments, devices and GPU memory per device.

From a validated config and the target's shape (``target_shape``), without a GPU and without
vLLM running: regenerate (when on), one engine per extract job (train and val shards), and the
bench engines (the plain target, k = 0, and one per ``num_speculative_tokens``). Their
``vllm.LLM`` arguments are built by the same functions the stages call
(``draftflow.engine.engine_kwargs``, ``capture_engine_kwargs``, ``draftflow.bench.engine``).

Memory per device of a GPU engine (vLLM's accounting): the weights over the tensor parallel
ranks, the KV cache (``kv_cache_memory_bytes``, or what ``gpu_memory_utilization`` of the device
leaves after the weights and the rest) and ``ENGINE_OVERHEAD_BYTES`` for the rest (CUDA context,
the activations of the profiling forward, NCCL buffers, CUDA graphs). A bench engine with a
draft also holds the draft's weights and its layers' KV cache; the draft is estimated from
``train.num_layers``, the target's hidden size, heads and MLP width, ``vocab.draft_vocab_size``
and the number of aux layers (speculators' EAGLE-3 decoder layers, fc over the aux states, a
draft-vocabulary lm_head and an embedding counted in full).

``plan_engines`` refuses, naming keys, values and a fix, what cannot run: weights over the
device memory, a KV cache that cannot hold one ``max_model_len`` sequence, engines whose memory
exceeds the device, and side-by-side bench engines that do not fit one device together.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from draftflow.engine_settings import EngineSettings, engine_settings
from draftflow.plan.target_shape import TargetShape, dtype_bytes

GIB = 1 << 30
# An H100's memory; an H200 (141 GB) is --device-memory-gib 139.8, what torch reports.
DEFAULT_DEVICE_MEMORY_BYTES = 80 * GIB
# Per device, beside the weights and the KV cache: the CUDA context (~0.5 GiB), the activations
# of vLLM's profiling forward (max_num_batched_tokens tokens), NCCL buffers and CUDA graphs.
ENGINE_OVERHEAD_BYTES = 2 * GIB
# Where the prepared target lives (rules/common.smk: resources/target).
MODEL_DIR = "resources/target"
DRAFT_DIR = "results/train/draft"
# EAGLE-3's default aux layers (2, L // 2, L - 3) are three.
DEFAULT_AUX_LAYERS = 3

# The config keys behind each stage's engine, for messages.
STAGE_SECTION = {"regenerate": "corpus.regenerate", "extract": "extract", "bench": "bench"}
CONTEXT_KEY = {
    "regenerate": "corpus.regenerate.max_model_len (null: tokenize.max_length)",
    "extract": "tokenize.max_length",
    "bench": "bench.max_model_len",
}


class EnginePlanError(ValueError):
    """A config whose engines cannot run on the devices; the message lists every problem."""


@dataclass(frozen=True)
class PlannedEngine:
    """One engine configuration (``jobs`` names every job that starts it)."""

    stage: str
    name: str
    jobs: tuple[str, ...]
    kwargs: dict[str, Any]
    device: str
    tensor_parallel_size: int
    dtype: str
    max_model_len: int
    weight_bytes_per_device: int
    kv_bytes_per_token: int
    # None on the CPU build when only a share of RAM is given (its size is not known here).
    kv_cache_bytes: int | None
    overhead_bytes: int
    gpu_memory_utilization: float
    problems: tuple[str, ...] = field(default=())

    @property
    def memory_bytes_per_device(self) -> int | None:
        if self.kv_cache_bytes is None:
            return None
        return self.weight_bytes_per_device + max(0, self.kv_cache_bytes) + self.overhead_bytes

    @property
    def kv_tokens(self) -> int | None:
        if self.kv_cache_bytes is None:
            return None
        return max(0, self.kv_cache_bytes) // self.kv_bytes_per_token


@dataclass(frozen=True)
class EnginePlan:
    engines: tuple[PlannedEngine, ...]
    device_memory_bytes: int
    bench_schedule: str
    problems: tuple[str, ...]


def kv_cache_dtype(settings: EngineSettings) -> str:
    """The KV cache's dtype: engine_args' kv_cache_dtype (fp8*), else the engine's dtype."""
    kv_dtype = str(settings.engine_args.get("kv_cache_dtype", "auto"))
    return "fp8" if kv_dtype.startswith("fp8") else settings.dtype


def aux_layer_count(config: Mapping[str, Any]) -> int:
    """How many target layers the draft reads: extract.aux_layers, else EAGLE-3's default."""
    return len(config["extract"]["aux_layers"] or ()) or DEFAULT_AUX_LAYERS


def draft_matrix_parameters(shape: TargetShape, num_layers: int, aux: int) -> int:
    """Parameters of the draft's weight matrices that training changes: its layers and the fc
    projection of the aux states (an estimate from above)."""
    hidden, heads, kv_heads = shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads
    head_dim = shape.head_dim
    # The first layer's attention reads the embedding and the fused aux state side by side (2H).
    attention = 2 * hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * shape.intermediate_size
    fc = aux * hidden * hidden
    return num_layers * (attention + mlp) + fc


def draft_parameters(shape: TargetShape, num_layers: int, draft_vocab: int, aux: int) -> int:
    """Parameters of speculators' EAGLE-3 draft for this target (an estimate from above): the
    matrices, the lm_head over the draft vocabulary and the target's embedding."""
    hidden = shape.hidden_size
    matrices = draft_matrix_parameters(shape, num_layers, aux)
    return matrices + draft_vocab * hidden + shape.vocab_size * hidden


def draft_kv_bytes_per_token(shape: TargetShape, num_layers: int, kv_dtype: str, tp: int) -> int:
    """The draft's layers are Llama layers with the target's KV heads and head size."""
    heads = max(1, shape.num_kv_heads // tp)
    return 2 * num_layers * heads * shape.head_dim * dtype_bytes(kv_dtype)


def _stage_kwargs(config: Mapping[str, Any], stage: str, settings: EngineSettings, k: int) -> dict:
    """The ``vllm.LLM`` arguments the stage's job passes, built as the job builds them."""
    trust = bool(config["target"]["trust_remote_code"])
    if stage == "regenerate":
        from draftflow.corpus.regenerate import regenerate_engine_kwargs

        seed = int(config["corpus"]["regenerate"]["seed"])
        return regenerate_engine_kwargs(MODEL_DIR, settings, seed=seed, trust_remote_code=trust)
    if stage == "extract":
        # scripts/extract.py's settings (their engine: ``settings``); the engine's context: the
        # longest sample, at most tokenize.max_length tokens, plus one.
        from draftflow.capture.backends import capture_engine_kwargs
        from draftflow.capture.extract import extract_settings

        extract = extract_settings(config)
        return capture_engine_kwargs(MODEL_DIR, extract.capture_engine(settings.max_model_len + 1))
    # draftflow.bench.run.engine_request's engines.
    from draftflow.bench.engine import engine_kwargs as bench_kwargs
    from draftflow.bench.run import engine_arguments
    from draftflow.bench.settings import bench_settings

    return bench_kwargs(
        MODEL_DIR, DRAFT_DIR if k else None, k, **engine_arguments(bench_settings(config))
    )


def plan_engine(
    config: Mapping[str, Any],
    shape: TargetShape,
    stage: str,
    name: str,
    jobs: tuple[str, ...],
    device_memory_bytes: int,
    k: int = 0,
) -> PlannedEngine:
    """One engine of ``stage`` (bench: ``k`` draft tokens, 0 = the plain target)."""
    settings = engine_settings(config, stage)
    tp = settings.tensor_parallel_size
    kv_dtype = kv_cache_dtype(settings)
    max_model_len = settings.max_model_len + (1 if stage == "extract" else 0)
    weights = shape.weight_bytes(settings.dtype)
    # The mean over one max_model_len sequence: linear-attention layers (Qwen3-Next) hold a
    # state per sequence, not per token.
    per_token = shape.kv_bytes_per_token(kv_dtype, tp, context=max_model_len)
    if k:
        draft_layers = int(config["train"]["num_layers"])
        aux = aux_layer_count(config)
        draft = draft_parameters(shape, draft_layers, int(config["vocab"]["draft_vocab_size"]), aux)
        weights += draft * dtype_bytes(settings.dtype)
        per_token += draft_kv_bytes_per_token(shape, draft_layers, kv_dtype, tp)
    weights_per_device = math.ceil(weights / tp)
    gpu = settings.device == "gpu"
    overhead = ENGINE_OVERHEAD_BYTES if gpu else 0
    if settings.kv_cache_memory_bytes is not None:
        kv_cache = int(settings.kv_cache_memory_bytes)
    elif gpu:
        budget = int(settings.gpu_memory_utilization * device_memory_bytes)
        kv_cache = budget - weights_per_device - overhead
    else:
        kv_cache = None
    engine = PlannedEngine(
        stage=stage,
        name=name,
        jobs=jobs,
        kwargs=_stage_kwargs(config, stage, settings, k),
        device=settings.device,
        tensor_parallel_size=tp,
        dtype=settings.dtype,
        max_model_len=max_model_len,
        weight_bytes_per_device=weights_per_device,
        kv_bytes_per_token=per_token,
        kv_cache_bytes=kv_cache,
        overhead_bytes=overhead,
        gpu_memory_utilization=settings.gpu_memory_utilization,
    )
    problems = engine_problems(engine, settings, device_memory_bytes)
    return dataclasses.replace(engine, problems=tuple(problems))


def engine_problems(
    engine: PlannedEngine, settings: EngineSettings, device_memory_bytes: int
) -> list[str]:
    """Why ``engine`` cannot start or cannot hold one sequence; [] where it can."""
    section = STAGE_SECTION[engine.stage]
    where = f"{engine.name} ({engine.tensor_parallel_size} GPU(s), engine.tensor_parallel_size)"
    problems = []
    gpu = engine.device == "gpu"
    one_sequence = engine.max_model_len * engine.kv_bytes_per_token
    device = size_text(device_memory_bytes)
    if gpu and engine.weight_bytes_per_device > device_memory_bytes:
        need_tp = math.ceil(
            engine.weight_bytes_per_device
            * engine.tensor_parallel_size
            / (0.9 * device_memory_bytes)
        )
        problems.append(
            f"{where}: the weights take {size_text(engine.weight_bytes_per_device)} per device in "
            f"{engine.dtype}, above the device's {device}. Fix: engine.tensor_parallel_size "
            f">= {need_tp} (a divisor of the attention heads), a quantized checkpoint, or a "
            "device with more memory (--device-memory-gib)"
        )
        return problems
    if engine.kv_cache_bytes is None:
        return problems
    if engine.kv_cache_bytes < one_sequence:
        if settings.kv_cache_memory_bytes is not None:
            problems.append(
                f"{where}: {section}.kv_cache_memory_bytes {settings.kv_cache_memory_bytes} "
                f"({size_text(settings.kv_cache_memory_bytes)}) holds "
                f"{max(0, engine.kv_cache_bytes) // engine.kv_bytes_per_token} tokens of "
                f"{engine.kv_bytes_per_token} bytes, less than one {CONTEXT_KEY[engine.stage]} "
                f"{engine.max_model_len}-token sequence ({one_sequence} bytes). Fix: "
                f"{section}.kv_cache_memory_bytes >= {one_sequence}, or null on GPUs (the "
                f"{section}.gpu_memory_utilization share sizes it)"
            )
        else:
            need = engine.weight_bytes_per_device + engine.overhead_bytes + one_sequence
            share = need / device_memory_bytes
            problems.append(
                f"{where}: {section}.gpu_memory_utilization {engine.gpu_memory_utilization} of "
                f"the device's {device} leaves {size_text(engine.kv_cache_bytes)} for the KV "
                f"cache after {size_text(engine.weight_bytes_per_device)} of weights and "
                f"{size_text(engine.overhead_bytes)} of overhead, less than one "
                f"{CONTEXT_KEY[engine.stage]} {engine.max_model_len}-token sequence "
                f"({size_text(one_sequence)}). Fix: {section}.gpu_memory_utilization >= "
                f"{math.ceil(share * 100) / 100:.2f}"
                + (" (above 1: raise engine.tensor_parallel_size)" if share > 1 else "")
                + ", a shorter context, or more tensor parallel GPUs"
            )
    total = engine.memory_bytes_per_device
    if gpu and total is not None and total > device_memory_bytes:
        problems.append(
            f"{where}: weights {size_text(engine.weight_bytes_per_device)} + KV cache "
            f"{size_text(engine.kv_cache_bytes)} ({section}.kv_cache_memory_bytes "
            f"{settings.kv_cache_memory_bytes}) + overhead {size_text(engine.overhead_bytes)} = "
            f"{size_text(total)} per device, above the device's {device}. Fix: a smaller "
            f"{section}.kv_cache_memory_bytes, or null to size it from "
            f"{section}.gpu_memory_utilization"
        )
    return problems


def extract_jobs(config: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """The capture jobs per split: one per shard; with extract.mode streamed (and not
    extract.keep_first_epoch), the train shards are captured again every epoch, one job per
    link of rules/stream.smk."""
    shards = config["extract"]["num_shards"]
    train = tuple(f"extract train/shard-{index:05d}" for index in range(int(shards["train"])))
    extract = config["extract"]
    if extract.get("mode") == "streamed" and not extract.get("keep_first_epoch"):
        links = int(shards["train"]) * int(config["train"]["epochs"])
        train = tuple(f"extract_stream link-{index:05d}" for index in range(links))
    val = tuple(f"extract val/shard-{index:05d}" for index in range(int(shards["val"])))
    return {"train": train, "val": val}


def plan_engines(
    config: Mapping[str, Any],
    shape: TargetShape,
    device_memory_bytes: int = DEFAULT_DEVICE_MEMORY_BYTES,
) -> EnginePlan:
    """Every engine of the run, in the order the stages start them."""
    from draftflow.bench.schedule import bench_schedule

    engines: list[PlannedEngine] = []
    if config["corpus"]["regenerate"]["enabled"]:
        engines.append(
            plan_engine(
                config, shape, "regenerate", "regenerate", ("regenerate",), device_memory_bytes
            )
        )
    for split, jobs in extract_jobs(config).items():
        engines.append(
            plan_engine(
                config,
                shape,
                "extract",
                f"extract {split} ({len(jobs)} jobs)",
                jobs,
                device_memory_bytes,
            )
        )
    ks = [0, *(int(k) for k in config["bench"]["num_speculative_tokens"])]
    bench = [
        plan_engine(
            config, shape, "bench", f"bench k={k}", (f"bench k={k}",), device_memory_bytes, k
        )
        for k in ks
    ]
    engines += bench
    schedule = bench_schedule(config["bench"])
    problems = [problem for engine in engines for problem in engine.problems]
    problems += side_by_side_problems(config, bench, schedule, device_memory_bytes)
    return EnginePlan(tuple(engines), device_memory_bytes, schedule, tuple(problems))


def side_by_side_problems(
    config: Mapping[str, Any],
    bench: list[PlannedEngine],
    schedule: str,
    device_memory_bytes: int,
) -> list[str]:
    """Bench engines alive at once share their GPUs: their memory together must fit one."""
    from draftflow.bench.schedule import SIDE_BY_SIDE

    sizes = [engine.memory_bytes_per_device for engine in bench]
    if schedule != SIDE_BY_SIDE or bench[0].device != "gpu" or len(bench) < 2:
        return []
    known = [size for size in sizes if size is not None]
    if len(known) < len(sizes) or sum(known) <= device_memory_bytes:
        return []
    ks = ", ".join(name.split("=")[1] for engine in bench for name in engine.jobs)
    return [
        f"bench: the {len(bench)} engines (k = {ks}) run side by side on the same "
        f"{bench[0].tensor_parallel_size} GPU(s) (bench.schedule {config['bench']['schedule']}): "
        f"{size_text(sum(known))} per device together ({' + '.join(size_text(s) for s in known)}), "
        f"above the device's {size_text(device_memory_bytes)}, each with its own copy of the "
        f"weights ({size_text(bench[0].weight_bytes_per_device)}). Fix: bench.schedule: "
        "one_at_a_time (with bench.gpu_memory_utilization 0.9), fewer "
        "bench.num_speculative_tokens, or more engine.tensor_parallel_size"
    ]


def check_engine_plan(plan: EnginePlan) -> None:
    if plan.problems:
        raise EnginePlanError(
            "the engines of this config cannot run:\n" + "\n".join(f"- {p}" for p in plan.problems)
        )


def size_text(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _kwargs_text(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in kwargs.items())


def format_engine_plan(plan: EnginePlan, shape: TargetShape) -> str:
    """The plan as lines: the target, then each engine with its arguments and memory."""
    quant = shape.quantization
    lines = [
        f"engine plan: target {shape.model_type}, {shape.num_layers} layers, hidden "
        f"{shape.hidden_size}, {shape.num_attention_heads} attention heads, "
        + (
            f"MLA latent {shape.mla_latent} per layer"
            if shape.mla_latent is not None
            else f"{shape.num_kv_heads} KV heads of {shape.head_dim}"
        )
        + f", vocab {shape.vocab_size}, {shape.parameters / 1e9:.2f}B parameters"
        + (
            f" ({shape.quantized_parameters / 1e9:.2f}B stored {quant.method} at "
            f"{quant.bytes_per_parameter:.4f} bytes each)"
            if quant
            else ""
        )
        + (", text only (vision tower not built)" if shape.multimodal else ""),
        f"device memory {size_text(plan.device_memory_bytes)}; overhead per device "
        f"{size_text(ENGINE_OVERHEAD_BYTES)} (CUDA context, activations, NCCL, graphs); bench "
        f"schedule {plan.bench_schedule}",
    ]
    for engine in plan.engines:
        devices = (
            f"{engine.tensor_parallel_size} GPU(s)" if engine.device == "gpu" else "the CPU build"
        )
        lines.append(
            f"{engine.name}: {devices}, tensor_parallel_size {engine.tensor_parallel_size}, "
            f"dtype {engine.dtype}, context {engine.max_model_len}"
        )
        if len(engine.jobs) > 1:
            lines.append(f"  jobs: {engine.jobs[0]} .. {engine.jobs[-1]}")
        lines.append(f"  vllm.LLM({_kwargs_text(engine.kwargs)})")
        if shape.multimodal and not {"language_model_only", "limit_mm_per_prompt"} & set(
            engine.kwargs
        ):
            # draftflow.engine.text_only_kwargs reads the prepared checkpoint when it starts.
            lines.append(
                "  + text only: language_model_only=True, or limit_mm_per_prompt={'image': 0} "
                "where the installed vLLM lacks it"
            )
        one = engine.max_model_len * engine.kv_bytes_per_token
        if engine.kv_cache_bytes is None:
            kv = f"KV cache: {engine.gpu_memory_utilization} of RAM (size not known here)"
        else:
            kv = (
                f"KV cache {size_text(max(0, engine.kv_cache_bytes))} "
                f"({engine.kv_tokens} tokens of {engine.kv_bytes_per_token} bytes)"
            )
        per = "per GPU" if engine.device == "gpu" else "in RAM"
        total = engine.memory_bytes_per_device
        lines.append(
            f"  {per}: weights {size_text(engine.weight_bytes_per_device)} + {kv} + overhead "
            f"{size_text(engine.overhead_bytes)}"
            + (f" = {size_text(total)}" if total is not None else "")
            + f"; one {engine.max_model_len}-token sequence needs {size_text(one)}"
            + (" [CANNOT RUN]" if engine.problems else "")
        )
    if plan.problems:
        lines.append("REFUSED:")
        lines += [f"- {problem}" for problem in plan.problems]
    else:
        lines.append("every engine fits")
    return "\n".join(lines)
