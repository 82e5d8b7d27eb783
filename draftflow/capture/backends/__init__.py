"""Capture backends behind one interface, chosen by ``extract.backend``.

- ``hooks``: vLLM with forward hooks in a worker extension (vLLM 0.16 - 0.32; V1 model runner
  and Model Runner V2);
- ``native``: vLLM's own ``extract_hidden_states`` speculative method + KV connector (vLLM >= 0.17);
- ``hf``: transformers ``output_hidden_states``: the numerical reference, and the fallback without
  vLLM;
- ``auto``: hooks where the installed vLLM supports it, else native, else hf when vLLM is missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from draftflow.capture.quant import Quantized
from draftflow.engine import installed_vllm_version

BACKENDS = ("auto", "hooks", "native", "hf")


class CaptureBackend(Protocol):
    name: str
    vllm_version: str | None

    def capture(self, token_ids: list[list[int]]) -> list[torch.Tensor | Quantized]:
        """States ``[T, len(layer_ids), H]`` (any float dtype, or ``Quantized`` for an fp8
        ``store_dtype``) for each prompt, in input order."""
        ...

    def close(self) -> None: ...


def capture_stream(
    backend: CaptureBackend, token_ids: list[list[int]]
) -> Iterator[torch.Tensor | Quantized]:
    """The backend's states in input order, streamed where it can (hooks), else one list."""
    stream = getattr(backend, "capture_iter", None)
    return stream(token_ids) if stream is not None else iter(backend.capture(token_ids))


@dataclass(frozen=True)
class CaptureEngineSettings:
    """Engine settings shared by the vLLM backends (the hf backend reads only hf_dtype, device
    and trust_remote_code).

    No defaults: the extract job builds them from the validated config
    (``ExtractSettings.capture_engine``, from ``engine_settings(config, "extract")``), tests from
    the demo's config (tests/config_support.py, ``capture_engine_settings``).
    """

    # Not a config key: one more than the longest sample a shard holds.
    max_model_len: int
    # engine.tensor_parallel_size
    tp_size: int
    # extract.max_num_batched_tokens, extract.max_num_seqs, extract.gpu_memory_utilization
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float
    # extract.kv_cache_memory_bytes: exact KV-cache size in bytes; overrides
    # gpu_memory_utilization (tests use it to force preemption).
    kv_cache_memory_bytes: int | None
    # extract.reserved_cpus. CPU build: cores vLLM keeps for its scheduler; the worker's thread
    # counts follow (draftflow.workflow.cpu_threads). None = vLLM's choice.
    reserved_cpus: int | None
    # target.trust_remote_code
    trust_remote_code: bool
    # extract.model_runner: "default" (vLLM's choice), "v1" or "v2" (draftflow.engine).
    model_runner: str
    # extract.deterministic: the same prompts give the same bits, call after call
    # (docs/capture.md, "Determinism").
    deterministic: bool
    # extract.engine_args: further vllm.LLM(...) arguments (e.g. block_size,
    # long_prefill_token_threshold).
    engine_args: dict
    # extract.store_dtype: the hooks backend hands fp8 states over quantized by its worker
    # (on the GPU before the copy to the host); the others hand over what they computed.
    store_dtype: str
    # hf backend: extract.hf_dtype, the compute dtype ("float32" for the reference,
    # "bfloat16"), and the torch device ("cuda" where engine.device is gpu, else "cpu").
    hf_dtype: str
    device: str


# The engines' seed, not a config key: capture samples one token a prompt and throws it away,
# so the seed changes no captured state.
CAPTURE_SEED = 0


def capture_engine_kwargs(
    model_dir: str | os.PathLike[str], settings: CaptureEngineSettings
) -> dict:
    """``vllm.LLM`` arguments every capture engine (hooks, native) shares."""
    from draftflow.engine import engine_kwargs

    clash = {"enforce_eager", "enable_prefix_caching", "worker_extension_cls"} & set(
        settings.engine_args
    )
    if clash:
        raise ValueError(f"extract.engine_args may not set {sorted(clash)}: capture needs them")
    return engine_kwargs(
        model_dir,
        max_model_len=settings.max_model_len,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tp_size,
        seed=CAPTURE_SEED,
        trust_remote_code=settings.trust_remote_code,
        enforce_eager=True,  # forward hooks and torch.compile don't mix
        extra={
            "enable_prefix_caching": False,  # a cached prefix skips the forward: no states
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "max_num_seqs": settings.max_num_seqs,
            "skip_tokenizer_init": True,  # prompts arrive as token ids
            **settings.engine_args,
        },
    )


def capture_engine_env(settings: CaptureEngineSettings, model_runner: str) -> dict[str, str]:
    """The environment every capture engine (hooks, native) starts with; ``model_runner``: the
    backend's (``settings.model_runner``, or the one native resolves it to)."""
    from draftflow.engine import engine_env, on_cpu_build

    return engine_env(
        reserved_cpus=settings.reserved_cpus,
        model_runner=model_runner,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        tensor_parallel_size=settings.tp_size,
        cpu=on_cpu_build(),
        deterministic=settings.deterministic,
    )


def resolve_backend(name: str, vllm_version: str | None = None) -> str:
    """The concrete backend for ``name`` (``auto`` picks from the installed vLLM)."""
    if name not in BACKENDS:
        raise ValueError(f"extract.backend {name!r}: allowed are {', '.join(BACKENDS)}")
    from draftflow.capture.adapters import HOOKS_VERSIONS, hooks_support
    from draftflow.capture.backends.native import NATIVE_MIN_VERSION, native_supports

    version = vllm_version if vllm_version is not None else installed_vllm_version()
    if name == "auto":
        if version is None:
            return "hf"
        if hooks_support(version):
            return "hooks"
        if native_supports(version):
            return "native"
        raise RuntimeError(
            f"extract.backend auto: vLLM {version} is supported by neither hooks "
            f"({HOOKS_VERSIONS}) nor native (>= {NATIVE_MIN_VERSION}); use backend hf"
        )
    if name in ("hooks", "native") and version is None:
        raise RuntimeError(
            f"extract.backend {name!r} needs vLLM, which is not installed; use backend hf"
        )
    return name


def make_backend(
    name: str,
    model_dir: str | os.PathLike[str],
    layer_ids: list[int],
    settings: CaptureEngineSettings,
) -> CaptureBackend:
    """Start the backend ``name`` (already resolved, not ``auto``)."""
    if name == "hooks":
        from draftflow.capture.backends.hooks import HooksBackend

        return HooksBackend(model_dir, layer_ids, settings)
    if name == "native":
        from draftflow.capture.backends.native import NativeBackend

        return NativeBackend(model_dir, layer_ids, settings)
    if name == "hf":
        from draftflow.capture.backends.hf import HFBackend

        return HFBackend(model_dir, layer_ids, settings)
    raise ValueError(f"capture backend {name!r}: allowed are hooks, native, hf")
