"""What the hooks backend needs from a vLLM model, whatever the runner: the decoder layers, the
final norm, their call conventions, and the execute_model wrapper.

- the model: ``runner.get_model()`` (unwraps CUDA-graph wrappers);
- the decoder: found by ``draftflow.capture.decoder_search.find_decoder``: ``model.model`` for
  causal LMs (Llama, Mistral, Qwen2/3, Qwen3-MoE, DeepSeek-V2/V3 with MLA and MoE),
  ``language_model.model`` for multimodal wrappers (Llava, Mistral3, Qwen2.5-VL/Qwen3-VL,
  Kimi-K2.5), else the one submodule with ``layers`` and ``norm``. Its layers take
  ``positions``, ``hidden_states`` and ``residual`` (by those names, in any order; residual may
  be absent; transformers layers under vLLM's Transformers backend take ``position_ids`` and a
  batch of one) and its norm ``norm(hidden_states, residual)`` (fused add + RMSNorm); M-RoPE
  models (Qwen-VL) pass positions as ``[3, T]``, whose rows agree for text-only prompts, so the
  first row is kept;
- ``runner.execute_model(scheduler_output, ...)`` runs the forward. Since 0.11.1 it returns None
  and ``sample_tokens()`` finishes the step; only ``execute_model`` is wrapped and its result is
  passed through, so the two-phase protocol is untouched.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch


def decoder(runner: Any) -> tuple[torch.nn.ModuleList, torch.nn.Module]:
    """The decoder layers and the final norm of the runner's model."""
    from draftflow.capture.decoder_search import DecoderNotFoundError, find_decoder

    model = runner.get_model()
    text_config = model_text_config(runner)
    expected = getattr(text_config, "num_hidden_layers", None)
    try:
        found = find_decoder(model, expected)
    except DecoderNotFoundError as error:
        raise RuntimeError(
            f"{error}; the hooks backend cannot capture it: use extract.backend hf"
        ) from None
    return found.layers, found.norm


def model_text_config(runner: Any) -> Any:
    """The text model's config of the runner's model (the config itself for causal LMs)."""
    config = getattr(getattr(runner, "model_config", None), "hf_config", None)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def layer_inputs(
    layer: torch.nn.Module, args: tuple, kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(positions ``[T]``, hidden_states ``[T, H]``, residual) of a decoder-layer call, by the
    layer's own parameter names: vLLM's layers take ``(positions, hidden_states, residual)``,
    GPT-OSS's ``(hidden_states, positions, residual)``, Granite's no residual; a transformers
    layer run by vLLM's Transformers backend ``(hidden_states [1, T, H], position_ids=[1, T])``
    with the residual added inside."""
    values = dict(zip(_parameter_names(type(layer)), args, strict=False))
    values.update(kwargs)
    positions = values.get("positions", values.get("position_ids"))
    hidden_states = values.get("hidden_states")
    if isinstance(positions, torch.Tensor):
        # M-RoPE ([3, T], Qwen-VL: the text rows are equal) and batches of one ([1, T]):
        # the first row is the text's positions.
        while positions.dim() > 1:
            positions = positions[0]
    if (
        not isinstance(positions, torch.Tensor)
        or positions.is_floating_point()
        or not isinstance(hidden_states, torch.Tensor)
    ):
        raise RuntimeError(
            f"{type(layer).__name__} is not called with integer positions and hidden_states "
            f"(its parameters: {', '.join(_parameter_names(type(layer)))}): this model is not "
            "supported by the hooks backend; use extract.backend hf"
        )
    return positions, _unbatched(hidden_states), _unbatched(values.get("residual"))


def _unbatched(states: torch.Tensor | None) -> torch.Tensor | None:
    """``[1, T, H]`` (a transformers model's batch of one) as ``[T, H]``."""
    if isinstance(states, torch.Tensor) and states.dim() == 3 and states.shape[0] == 1:
        return states[0]
    return states


@functools.cache
def _parameter_names(layer_class: type) -> tuple[str, ...]:
    """The names of a layer class's ``forward`` parameters after ``self``; vLLM's usual order
    where the signature does not name the states (a ``*args`` wrapper)."""
    parameters = list(inspect.signature(layer_class.forward).parameters.values())[1:]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in parameters if p.kind in positional)
    if "hidden_states" in names:
        return names
    return ("positions", "hidden_states", "residual")


def norm_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden_states, residual) of the final norm's call."""
    hidden_states = args[0] if args else kwargs.get("x", kwargs.get("hidden_states"))
    residual = args[1] if len(args) > 1 else kwargs.get("residual")
    return _unbatched(hidden_states), _unbatched(residual)


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
