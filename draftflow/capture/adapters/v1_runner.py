"""vLLM's V1 model runner (``vllm.v1.worker.gpu_model_runner``, and the CPU runner that subclasses
it), vLLM 0.16 - 0.33: the batch layout of one forward.

Tokens are laid out request after request in ``runner.input_batch.req_ids`` order,
``scheduler_output.num_scheduled_tokens[req_id]`` each (``execute_model`` builds its inputs so).
``input_batch`` is brought up to date at the start of ``execute_model``, so the layout is read
while the forward runs (from the first layer's hook). Differences across the range: 0.32
appends ``-<8 hex>`` to the caller's request id (the backend matches ids with and without it).
On GPUs vLLM 0.22+ picks Model Runner V2 for some models (``v2_runner.py``) and 0.29+ for every
model; V1 is deprecated but still built in 0.33, where ``VLLM_USE_V2_MODEL_RUNNER=0`` selects it
(``extract.model_runner: v1``). The CPU build runs V1 only (V2 needs Triton).
"""

from __future__ import annotations

from typing import Any


class V1RunnerAdapter:
    """V1 model runner: it has a persistent ``input_batch``."""

    name = "v1"

    @staticmethod
    def matches(runner: Any) -> bool:
        return hasattr(runner, "input_batch")

    @staticmethod
    def layout_in_forward(runner: Any, scheduler_output: Any) -> list[tuple[str, int]] | None:
        """(request id, tokens in this forward) in the order of the flattened token batch."""
        scheduled = scheduler_output.num_scheduled_tokens
        return [(req_id, int(scheduled[req_id])) for req_id in runner.input_batch.req_ids]

    @staticmethod
    def layout_after_forward(runner: Any, scheduler_output: Any) -> list[tuple[str, int]] | None:
        return None
