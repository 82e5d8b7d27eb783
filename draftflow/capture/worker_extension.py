"""Worker extension of the hooks backend: mixed into each vLLM worker (``worker_extension_cls``).

The driver calls its ``draftflow_*`` methods through ``LLM.collective_rpc``. Per forward pass,
pre-hooks on the decoder layers write the residual stream entering each aux layer, and a
pre-hook on the final norm the norm's input (id L), straight into a staging slot of
``draftflow.capture.recorder.StateRecorder``; token positions come from the layers' own
``positions`` argument. The wrapped ``execute_model`` reads *that* forward's scheduler output
(new requests and their prompt lengths, the token count) and, from the runner's adapter
(``adapters/v1_runner.py``, ``adapters/v2_runner.py``), the order of requests in the flattened
batch; the recorder files every request's rows by position into its own file off the forward's
path. With async scheduling (two batches in flight on GPUs) each forward is still mapped with
its own scheduler output.
"""

from __future__ import annotations

from typing import Any

from draftflow.capture.adapters import decoder as model_parts
from draftflow.capture.adapters import select_runner_adapter
from draftflow.capture.recorder import StateRecorder

# SamplingParams.extra_args key naming a request's capture file (the prompt's place in its call).
FILE_KEY = "draftflow_capture_key"


def new_request_lengths(scheduler_output: Any) -> dict[str, tuple[int, str | None]]:
    """(prompt length, file key) of each request the worker sees for the first time."""
    lengths = {}
    for request in scheduler_output.scheduled_new_reqs:
        tokens = request.prompt_token_ids
        if tokens is None:  # Model Runner V2 may carry the prompt as prefill tokens only
            tokens = getattr(request, "prefill_token_ids", None)
        if tokens is None:
            raise RuntimeError(
                f"request {request.req_id}: no prompt token ids (prompt embeddings cannot be "
                "captured by the hooks backend)"
            )
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        lengths[request.req_id] = (len(tokens), extra.get(FILE_KEY))
    return lengths


class HiddenStateCaptureExtension:
    """Methods mixed into vLLM's Worker; ``self`` is the worker."""

    def draftflow_capture_setup(self, layer_ids: list[int], out_dir: str, store_dtype: str) -> dict:
        tp_rank, pp_size = model_parts.parallel_ranks()
        if pp_size != 1:
            raise RuntimeError("the hooks backend does not support pipeline parallelism")
        runner = self.model_runner
        self._df_adapter = select_runner_adapter(runner)
        self._df_layer_ids = [int(i) for i in layer_ids]
        self._df_scheduler_output: Any = None
        self._df_layout: list[tuple[str, int]] | None = None
        self._df_capturing = False  # on for the hooks between begin() and end()
        # After the all-reduce every tensor-parallel rank holds the full hidden states:
        # rank 0 alone captures and writes.
        self._df_active = tp_rank == 0
        if not self._df_active:
            return {"tp_rank": tp_rank, "active": False}

        layers, norm = model_parts.decoder(runner)
        num_layers = len(layers)
        if self._df_layer_ids[-1] != num_layers or any(
            not 0 <= i < num_layers for i in self._df_layer_ids[:-1]
        ):
            raise RuntimeError(
                f"layer ids {self._df_layer_ids} do not fit a model of {num_layers} layers"
            )
        reference = next(norm.parameters())
        hidden_size = int(reference.shape[-1])
        max_tokens = int(self.vllm_config.scheduler_config.max_num_batched_tokens)
        self._df_recorder = StateRecorder(
            num_columns=len(self._df_layer_ids),
            hidden_size=hidden_size,
            max_tokens=max_tokens,
            device=reference.device,
            out_dir=out_dir,
            store_dtype=store_dtype,
        )
        layers[0].register_forward_pre_hook(self._df_positions_hook, with_kwargs=True)
        for column, layer_id in enumerate(self._df_layer_ids[:-1]):
            layers[layer_id].register_forward_pre_hook(
                self._df_layer_hook(column), with_kwargs=True
            )
        norm.register_forward_pre_hook(self._df_norm_hook, with_kwargs=True)
        model_parts.wrap_execute_model(runner, self._df_before_forward, self._df_after_forward)
        return {
            "tp_rank": tp_rank,
            "active": True,
            "num_layers": num_layers,
            "runner": self._df_adapter.name,
            "device": str(reference.device),
            "hidden_size": hidden_size,
            "max_tokens": max_tokens,
            "store_dtype": store_dtype,
        }

    # -------------------------------------------------------------- per forward
    def _df_before_forward(self, scheduler_output: Any) -> None:
        self._df_layout = None
        if not self._df_active:
            return
        num_tokens = int(scheduler_output.total_num_scheduled_tokens)
        if num_tokens == 0:
            return
        self._df_recorder.begin(num_tokens, new_request_lengths(scheduler_output))
        self._df_scheduler_output = scheduler_output
        self._df_capturing = True

    def _df_positions_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        if not self._df_capturing:  # warm-up and profiling runs happen outside execute_model
            return
        positions, _, _ = model_parts.layer_inputs(module, args, kwargs)
        self._df_recorder.keep_positions(positions)
        self._df_layout = self._df_adapter.layout_in_forward(
            self.model_runner, self._df_scheduler_output
        )

    def _df_layer_hook(self, column: int):
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            if self._df_capturing:
                _, hidden_states, residual = model_parts.layer_inputs(module, args, kwargs)
                self._df_recorder.keep(column, hidden_states, residual)

        return hook

    def _df_norm_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._df_capturing:
            hidden_states, residual = model_parts.norm_inputs(args, kwargs)
            self._df_recorder.keep(len(self._df_layer_ids) - 1, hidden_states, residual)
            self._df_recorder.mark_ready()

    def _df_after_forward(self, scheduler_output: Any, failed: bool) -> None:
        if not self._df_capturing:
            return
        self._df_capturing = False
        layout = self._df_layout or self._df_adapter.layout_after_forward(
            self.model_runner, scheduler_output
        )
        if failed or layout is None:  # failed, or the step ran no forward
            self._df_recorder.abort()
            return
        self._df_recorder.end(layout)

    # -------------------------------------------------------------- driver calls
    def draftflow_capture_reset(self) -> None:
        if self._df_active:
            self._df_recorder.discard()

    def draftflow_capture_fetch(self) -> dict | None:
        """Wait until every forward is filed; return each request's file and the counters.

        ``requests``: engine request id -> file, length, missing positions, forwards. Counters:
        ``overwritten_tokens`` > 0 means a request was recomputed (e.g. after preemption),
        ``max_forwards_per_request`` > 1 means chunked prefill. None on inactive ranks.
        """
        if not self._df_active:
            return None
        return self._df_recorder.drain()

    def draftflow_capture_close(self) -> None:
        if self._df_active:
            self._df_recorder.close()
