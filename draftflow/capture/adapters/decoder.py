"""What the hooks backend needs from a vLLM model, whatever the runner: the decoder layers, the
final norm, their call conventions, and the execute_model wrapper.

- the model: ``runner.get_model()`` (unwraps CUDA-graph wrappers);
- the decoder: ``model.model.layers`` (a ModuleList of layers called as
  ``layer(positions, hidden_states, residual) -> (hidden_states, residual)``) and
  ``model.model.norm`` called as ``norm(hidden_states, residual)`` (fused add + RMSNorm): Llama,
  Mistral, Qwen2/3 and the other Llama-shaped decoders;
- ``runner.execute_model(scheduler_output, ...)`` runs the forward. Since 0.11.1 it returns None
  and ``sample_tokens()`` finishes the step; only ``execute_model`` is wrapped and its result is
  passed through, so the two-phase protocol is untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


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


def norm_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden_states, residual) of the final norm's call."""
    hidden_states = args[0] if args else kwargs["x"]
    residual = args[1] if len(args) > 1 else kwargs.get("residual")
    return hidden_states, residual


def wrap_execute_model(
    runner: Any, before: Callable[[Any], None], after: Callable[[Any, bool], None]
) -> None:
    """Call ``before(scheduler_output)`` and ``after(scheduler_output, failed)`` around each
    forward; dummy runs (memory profiling, data-parallel padding) pass straight through."""
    original = runner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dummy_run"):
            return original(scheduler_output, *args, **kwargs)
        before(scheduler_output)
        try:
            result = original(scheduler_output, *args, **kwargs)
        except BaseException:
            after(scheduler_output, True)  # drop this step's states; vLLM's own error propagates
            raise
        after(scheduler_output, False)
        return result

    runner.execute_model = execute_model


def parallel_ranks() -> tuple[int, int]:
    """(tensor-parallel rank, pipeline-parallel size) of this worker."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), get_pp_group().world_size
