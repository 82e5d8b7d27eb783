"""vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner``), written against vLLM 0.24 and
unchanged through 0.33 (tools/vllm_contract.py checks the names below per release): the batch
layout of one forward.

V2 has no persistent ``input_batch``: ``execute_model`` builds a fresh ``InputBatch`` per step
(requests sorted by scheduled tokens: decodes first, then prefills) and keeps it in
``runner.execute_model_state.input_batch`` until ``sample_tokens()`` consumes it. Its
``req_ids`` and ``num_scheduled_tokens`` (aligned arrays) are the order of the flattened token
batch, so the layout is read right after the forward, before ``sample_tokens()`` runs. V2 is
the GPU default for Llama, Qwen3 and DeepSeek-V2/V3 from vLLM 0.23 (0.22 for Qwen3) and for
every model from 0.29; ``VLLM_USE_V2_MODEL_RUNNER=0`` still selects V1 in 0.33. V2 needs Triton,
so the CPU build keeps V1.
"""

from __future__ import annotations

from typing import Any


class V2RunnerAdapter:
    """Model Runner V2: per-request state in ``req_states``, a fresh input batch per step."""

    name = "v2"

    @staticmethod
    def matches(runner: Any) -> bool:
        return hasattr(runner, "req_states") and not hasattr(runner, "input_batch")

    @staticmethod
    def layout_in_forward(runner: Any, scheduler_output: Any) -> list[tuple[str, int]] | None:
        return None

    @staticmethod
    def layout_after_forward(runner: Any, scheduler_output: Any) -> list[tuple[str, int]] | None:
        state = getattr(runner, "execute_model_state", None)
        batch = getattr(state, "input_batch", None)
        if batch is None:
            return None  # no forward ran (an empty step)
        counts = batch.num_scheduled_tokens
        return [(req_id, int(counts[i])) for i, req_id in enumerate(batch.req_ids)]
