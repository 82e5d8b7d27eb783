"""vLLM 0.16 - 0.32, V1 model runner (GPUModelRunner and the CPUModelRunner that subclasses it).

Everything the hooks backend needs from vLLM's internals is here and nowhere else:

- the runner: ``worker.model_runner``; its model: ``runner.get_model()`` (unwraps CUDA graphs);
- the decoder: ``model.model.layers`` (a ModuleList of layers called as
  ``layer(positions, hidden_states, residual) -> (hidden_states, residual)``) and ``model.model.norm``
  called as ``norm(hidden_states, residual)`` (fused add + RMSNorm): Llama, Mistral, Qwen2/3 and the
  other Llama-shaped decoders;
- the batch layout of one forward: tokens are laid out request after request in
  ``runner.input_batch.req_ids`` order, ``scheduler_output.num_scheduled_tokens[req_id]`` each
  (``GPUModelRunner.execute_model`` builds its inputs exactly so);
- ``runner.execute_model(scheduler_output, ...)`` runs the forward. Since 0.11.1 it returns None
  and ``sample_tokens()`` finishes the step; we only wrap ``execute_model`` and pass its result
  through, so the two-phase protocol is untouched.

Differences known between the ends of the range: 0.32 appends ``-<8 hex>`` to the request id the
caller gave (the backend matches ids with and without it); the layer and norm calls and the batch
layout are the same (the platform notes measured the same hooks on 0.16). On GPUs, vLLM 0.22+
defaults to Model Runner V2 for some models (no ``input_batch``): the backend turns it off with
``VLLM_USE_V2_MODEL_RUNNER=0``; 0.33 removes V1, so this adapter stops there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from packaging.version import Version


class V1RunnerAdapter:
    """vLLM V1 model runner (vLLM 0.16 - 0.32)."""

    VERSIONS = ">=0.16, <0.33"
    MIN = Version("0.16")
    MAX_EXCLUSIVE = Version("0.33")
    # Environment for the engine: keep the V1 runner where V2 would be the default.
    ENGINE_ENV: ClassVar[dict[str, str]] = {"VLLM_USE_V2_MODEL_RUNNER": "0"}

    @classmethod
    def kv_cache_env(cls, vllm_version: str, kv_cache_memory_bytes: int) -> dict[str, str]:
        """Environment that sizes the KV cache where ``kv_cache_memory_bytes`` is ignored.

        vLLM's CPU worker before 0.17 takes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (whole
        GiB) and otherwise claims half the machine's RAM, whatever the engine arguments say.
        """
        version = Version(Version(vllm_version).base_version)
        if version >= Version("0.17") or "VLLM_CPU_KVCACHE_SPACE" in os.environ:
            return {}
        gib = max(1, -(-kv_cache_memory_bytes // (1 << 30)))
        return {"VLLM_CPU_KVCACHE_SPACE": str(gib)}

    @classmethod
    def supports(cls, vllm_version: str) -> bool:
        version = Version(Version(vllm_version).base_version)
        return cls.MIN <= version < cls.MAX_EXCLUSIVE

    @staticmethod
    def model_runner(worker: Any) -> Any:
        runner = worker.model_runner
        if not hasattr(runner, "input_batch"):
            raise RuntimeError(
                f"model runner {type(runner).__qualname__} has no input_batch: this is not the "
                "V1 model runner the hooks backend supports (set VLLM_USE_V2_MODEL_RUNNER=0, or "
                "use extract.backend native / hf)"
            )
        return runner

    @staticmethod
    def decoder(runner: Any) -> tuple[torch.nn.ModuleList, torch.nn.Module]:
        """The decoder layers and the final norm of the runner's model."""
        model = runner.get_model()
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        norm = getattr(inner, "norm", None)
        if not isinstance(layers, torch.nn.ModuleList) or not isinstance(norm, torch.nn.Module):
            raise RuntimeError(
                f"{type(model).__qualname__}: the hooks backend needs a Llama-shaped decoder "
                "(model.model.layers and model.model.norm); use extract.backend hf or native"
            )
        return layers, norm

    @staticmethod
    def layer_inputs(
        args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(positions, hidden_states, residual) of a decoder-layer call."""
        names = ("positions", "hidden_states", "residual")
        values = list(args[:3]) + [kwargs.get(name) for name in names[len(args[:3]) :]]
        positions, hidden_states, residual = values
        if not isinstance(positions, torch.Tensor) or not isinstance(hidden_states, torch.Tensor):
            raise RuntimeError(
                "decoder layer not called as layer(positions, hidden_states, residual): "
                "this model is not supported by the hooks backend"
            )
        return positions, hidden_states, residual

    @staticmethod
    def norm_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden_states, residual) of the final norm's call."""
        hidden_states = args[0] if args else kwargs["x"]
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        return hidden_states, residual

    @staticmethod
    def batch_layout(runner: Any, scheduler_output: Any) -> list[tuple[str, int]]:
        """(request id, tokens in this forward) in the order of the flattened token batch."""
        scheduled = scheduler_output.num_scheduled_tokens
        return [(req_id, int(scheduled[req_id])) for req_id in runner.input_batch.req_ids]

    @staticmethod
    def wrap_execute_model(
        runner: Any, before: Callable[[Any], None], after: Callable[[bool], None]
    ) -> None:
        """Call ``before(scheduler_output)`` and ``after(failed)`` around each forward."""
        original = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            before(scheduler_output)
            try:
                result = original(scheduler_output, *args, **kwargs)
            except BaseException:
                after(True)  # drop this step's states; vLLM's own error propagates
                raise
            after(False)
            return result

        runner.execute_model = execute_model

    @staticmethod
    def parallel_ranks() -> tuple[int, int]:
        """(tensor-parallel rank, pipeline-parallel size) of this worker."""
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), get_pp_group().world_size
