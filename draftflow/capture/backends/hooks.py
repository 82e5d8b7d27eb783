"""vLLM backend with forward hooks (``draftflow.capture.worker_extension``), vLLM 0.16 - 0.32.

Prefill only: each prompt is sent as token ids with ``max_tokens=1``; the worker extension keeps
the states of every prompt token, keyed by request id and position, and writes them to a
safetensors file per call (tensors inside a ``collective_rpc`` reply would come back as lists).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from draftflow.capture.adapters import select_adapter
from draftflow.capture.backends import EngineSettings, installed_vllm_version
from draftflow.workflow.cpu_threads import apply_cpu_engine_env

log = logging.getLogger(__name__)

EXTENSION = "draftflow.capture.worker_extension.HiddenStateCaptureExtension"


def vllm_engine_kwargs(settings: EngineSettings) -> dict:
    """LLM(...) arguments every capture engine shares."""
    kwargs = {
        "enforce_eager": True,  # forward hooks and torch.compile don't mix
        "enable_prefix_caching": False,  # a cached prefix skips the forward: states never appear
        "max_model_len": settings.max_model_len,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "max_num_seqs": settings.max_num_seqs,
        "tensor_parallel_size": settings.tp_size,
        "trust_remote_code": settings.trust_remote_code,
        "seed": settings.seed,
        "skip_tokenizer_init": True,  # prompts arrive as token ids
    }
    if settings.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    clash = {"enforce_eager", "enable_prefix_caching", "worker_extension_cls"} & set(
        settings.engine_args
    )
    if clash:
        raise ValueError(f"extract.engine_args may not set {sorted(clash)}: capture needs them")
    return {**kwargs, **settings.engine_args}


def match_request_ids(internal_ids: list[str], external_ids: list[str]) -> dict[str, str]:
    """Map the ids the worker saw to the ids the caller gave.

    vLLM 0.32 appends ``-<8 hex>`` to the caller's request id inside the engine; older versions
    use the id as given.
    """
    externals = set(external_ids)
    mapping = {}
    for internal in internal_ids:
        external = internal if internal in externals else internal.rpartition("-")[0]
        if external not in externals:
            raise RuntimeError(
                f"captured request {internal!r} matches none of this call's requests"
            )
        if external in mapping.values():
            raise RuntimeError(f"request {external!r} was captured under two engine ids")
        mapping[internal] = external
    return mapping


class HooksBackend:
    name = "hooks"

    def __init__(
        self, model_dir: str | os.PathLike[str], layer_ids: list[int], settings: EngineSettings
    ) -> None:
        self.vllm_version = installed_vllm_version()
        adapter = select_adapter(self.vllm_version)
        os.environ.update(adapter.ENGINE_ENV)
        if settings.kv_cache_memory_bytes is not None:
            os.environ.update(
                adapter.kv_cache_env(self.vllm_version, settings.kv_cache_memory_bytes)
            )
        apply_cpu_engine_env(settings.reserved_cpus)
        from vllm import LLM

        self.layer_ids = list(layer_ids)
        self.llm = LLM(
            model=str(model_dir), worker_extension_cls=EXTENSION, **vllm_engine_kwargs(settings)
        )
        replies = self.llm.collective_rpc("draftflow_capture_setup", args=(self.layer_ids,))
        log.info("hooks installed: %s", replies)
        self._tmp = tempfile.TemporaryDirectory(prefix="draftflow-capture-")
        self._calls = 0
        self.last_stats: dict = {}

    def capture(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.collective_rpc("draftflow_capture_reset")
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in token_ids]
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        external_ids = [output.request_id for output in outputs]

        self._calls += 1
        path = str(Path(self._tmp.name) / f"capture-{self._calls:06d}.safetensors")
        replies = [r for r in self.llm.collective_rpc("draftflow_capture_fetch", args=(path,)) if r]
        if len(replies) != 1:
            raise RuntimeError(f"expected one capturing worker (tp rank 0), got {len(replies)}")
        reply = replies[0]
        self.last_stats = reply["stats"]
        if reply["incomplete"]:
            raise RuntimeError(
                f"capture incomplete (request id: missing positions) {reply['incomplete']}"
            )
        mapping = match_request_ids(list(reply["names"]), external_ids)
        by_external = {mapping[internal]: name for internal, name in reply["names"].items()}
        results = []
        with safe_open(path, framework="pt") as handle:
            for external, ids in zip(external_ids, token_ids, strict=True):
                if external not in by_external:
                    raise RuntimeError(f"request {external} produced no captured states")
                states = handle.get_tensor(by_external[external])
                if states.shape[0] != len(ids):
                    raise RuntimeError(
                        f"request {external}: captured {states.shape[0]} positions for a prompt "
                        f"of {len(ids)} tokens"
                    )
                results.append(states)
        os.unlink(path)
        return results

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            del llm, engine
            if callable(shutdown):
                shutdown()
        self._tmp.cleanup()
