"""What the CPU can do natively, where draftflow picks a faster path when it cannot."""

from __future__ import annotations

import functools

import torch


@functools.cache  # asked per engine start and per training step; the CPU does not change
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX). Elsewhere oneDNN
    emulates them: a Muon orthogonalization 35x and a vLLM prefill 8x slower than in float32
    (measured on an AMD EPYC with AVX2 only, docs/results/cpu-bf16-emulated.json)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
