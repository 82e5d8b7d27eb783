"""What the GPU capture tests share: their prompts, their engine shape and their check."""

from __future__ import annotations

from typing import Any

import torch

from draftflow.capture.backends import EngineSettings
from draftflow.capture.verify import cosine_summary, token_cosines


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 49_000, (n,), generator=generator).tolist() for n in lengths]


def gpu_engine(max_model_len: int, model_runner: str = "default", **changes: Any) -> EngineSettings:
    """A small KV cache and token budget, so that requests are chunked and preempted."""
    values = {
        "max_model_len": max_model_len,
        "max_num_batched_tokens": 128,
        "max_num_seqs": 4,
        "model_runner": model_runner,
        "device": "cuda",
        **changes,
    }
    return EngineSettings(**values)


def assert_cosines_at_least(
    captured, reference, layer_ids, min_mean: float, min_p01: float
) -> dict[str, Any]:
    """Every layer's token cosines against the reference: mean and 1st percentile bounded."""
    assert [c.shape for c in captured] == [r.shape for r in reference]
    cosines = torch.cat(
        [token_cosines(c.cpu(), r.cpu()) for c, r in zip(captured, reference, strict=True)]
    )
    summary = cosine_summary(cosines, layer_ids)
    for layer, values in summary.items():
        assert values["mean"] >= min_mean, (layer, values)
        assert values["p01"] >= min_p01, (layer, values)
    return summary
