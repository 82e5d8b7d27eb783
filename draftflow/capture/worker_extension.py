"""Worker extension of the hooks backend: mixed into each vLLM worker (``worker_extension_cls``).

The driver calls its ``draftflow_*`` methods through ``LLM.collective_rpc``. Per forward pass it
records the residual stream entering each aux layer (pre-hooks on decoder layers) and the input of
the final norm (id L), and splits the flattened token batch into requests using the scheduler
output of *that* forward, read inside the wrapped ``execute_model``; token positions come from the
layers' own ``positions`` argument. Per request, states are accumulated by position, so chunked
prefill (one prompt over several forwards) and preemption (a recomputed prompt: later states
overwrite earlier ones) both give one row per position.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file

from draftflow.capture.adapters import select_adapter


@dataclass
class _Step:
    """What the hooks saw during one forward pass."""

    scheduler_output: Any
    layout: list[tuple[str, int]] | None = None
    positions: torch.Tensor | None = None
    states: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Pieces:
    positions: list[torch.Tensor] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)


class HiddenStateCaptureExtension:
    """Methods mixed into vLLM's Worker; ``self`` is the worker."""

    def draftflow_capture_setup(self, layer_ids: list[int]) -> dict:
        import vllm

        adapter = select_adapter(vllm.__version__)
        tp_rank, pp_size = adapter.parallel_ranks()
        if pp_size != 1:
            raise RuntimeError("the hooks backend does not support pipeline parallelism")
        self._df_adapter = adapter
        self._df_layer_ids = [int(i) for i in layer_ids]
        self._df_step: _Step | None = None
        self._df_pieces: dict[str, _Pieces] = {}
        self._df_stats = {"forwards": 0, "tokens": 0}
        # After the all-reduce every tensor-parallel rank holds the full hidden states:
        # rank 0 alone captures and writes.
        self._df_active = tp_rank == 0
        if not self._df_active:
            return {"tp_rank": tp_rank, "active": False}

        runner = adapter.model_runner(self)
        layers, norm = adapter.decoder(runner)
        num_layers = len(layers)
        if self._df_layer_ids[-1] != num_layers or any(
            not 0 <= i < num_layers for i in self._df_layer_ids[:-1]
        ):
            raise RuntimeError(
                f"layer ids {self._df_layer_ids} do not fit a model of {num_layers} layers"
            )
        layers[0].register_forward_pre_hook(self._df_positions_hook, with_kwargs=True)
        for layer_id in self._df_layer_ids[:-1]:
            layers[layer_id].register_forward_pre_hook(
                self._df_layer_hook(layer_id), with_kwargs=True
            )
        norm.register_forward_pre_hook(self._df_norm_hook, with_kwargs=True)
        adapter.wrap_execute_model(runner, self._df_before_forward, self._df_after_forward)
        return {"tp_rank": tp_rank, "active": True, "num_layers": num_layers}

    # -------------------------------------------------------------- per forward
    def _df_before_forward(self, scheduler_output: Any) -> None:
        self._df_step = _Step(scheduler_output)

    def _df_positions_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        step = self._df_step
        if step is None:  # warm-up and profiling runs happen outside execute_model
            return
        positions, _, _ = self._df_adapter.layer_inputs(args, kwargs)
        step.layout = self._df_adapter.batch_layout(self.model_runner, step.scheduler_output)
        num_tokens = sum(count for _, count in step.layout)
        # copy=True: on the CPU .to() would return a view of the runner's persistent buffer,
        # which the next step overwrites.
        step.positions = positions[:num_tokens].to("cpu", torch.int64, copy=True)

    def _df_layer_hook(self, layer_id: int):
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            if self._df_step is None:
                return
            _, hidden_states, residual = self._df_adapter.layer_inputs(args, kwargs)
            self._df_keep(layer_id, hidden_states, residual)

        return hook

    def _df_norm_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._df_step is None:
            return
        hidden_states, residual = self._df_adapter.norm_inputs(args, kwargs)
        self._df_keep(self._df_layer_ids[-1], hidden_states, residual)

    def _df_keep(
        self, layer_id: int, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        # The layer's fused add-norm updates its inputs in place: take a copy now.
        stream = hidden_states.clone() if residual is None else hidden_states + residual
        self._df_step.states[layer_id] = stream

    def _df_after_forward(self, failed: bool) -> None:
        step, self._df_step = self._df_step, None
        if failed or step is None or step.layout is None:  # failed, or no forward ran
            return
        missing = [i for i in self._df_layer_ids if i not in step.states]
        if missing:
            raise RuntimeError(f"capture hooks did not fire for layer ids {missing}")
        num_tokens = int(step.positions.shape[0])
        stacked = torch.stack([step.states[i][:num_tokens] for i in self._df_layer_ids], dim=1)
        stacked = stacked.to("cpu", torch.bfloat16)
        start = 0
        for req_id, count in step.layout:
            pieces = self._df_pieces.setdefault(req_id, _Pieces())
            pieces.positions.append(step.positions[start : start + count])
            pieces.states.append(stacked[start : start + count])
            start += count
        self._df_stats["forwards"] += 1
        self._df_stats["tokens"] += num_tokens

    # -------------------------------------------------------------- driver calls
    def draftflow_capture_reset(self) -> None:
        self._df_pieces = {}
        self._df_stats = {"forwards": 0, "tokens": 0}

    def draftflow_capture_fetch(self, path: str) -> dict | None:
        """Write every request's states to ``path`` (safetensors) and forget them.

        Returns the request ids, the tensor name of each, incomplete requests and counters
        (``overwritten_tokens`` > 0 means a request was recomputed, e.g. after preemption;
        ``max_forwards_per_request`` > 1 means chunked prefill). None on inactive ranks.
        """
        if not self._df_active:
            return None
        tensors: dict[str, torch.Tensor] = {}
        names: dict[str, str] = {}
        incomplete: dict[str, int] = {}
        overwritten = 0
        max_forwards = 0
        for index, (req_id, pieces) in enumerate(self._df_pieces.items()):
            positions = torch.cat(pieces.positions)
            length = int(positions.max()) + 1
            states = torch.empty((length, *pieces.states[0].shape[1:]), dtype=torch.bfloat16)
            filled = torch.zeros(length, dtype=torch.bool)
            for piece_positions, piece_states in zip(pieces.positions, pieces.states, strict=True):
                overwritten += int(filled[piece_positions].sum())
                states[piece_positions] = piece_states
                filled[piece_positions] = True
            if not bool(filled.all()):
                incomplete[req_id] = int((~filled).sum())
            name = f"request_{index}"
            tensors[name] = states
            names[req_id] = name
            max_forwards = max(max_forwards, len(pieces.positions))
        stats = {
            **self._df_stats,
            "requests": len(names),
            "overwritten_tokens": overwritten,
            "max_forwards_per_request": max_forwards,
        }
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save_file(tensors, path, metadata={"names": json.dumps(names)})
        self.draftflow_capture_reset()
        return {"path": path, "names": names, "incomplete": incomplete, "stats": stats}
