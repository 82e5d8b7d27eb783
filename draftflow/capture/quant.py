"""Store dtypes of the capture store: bf16 as captured, or fp8 (e4m3) with a scale per token and layer.

fp8 keeps 3 mantissa bits, so each row (one token, one layer) gets its own float32 scale,
``amax / 448``: the row's largest magnitude maps to e4m3's largest finite value and nothing
saturates, however large a token's activations are (massive activations on a few tokens would
otherwise set the range of every other token). Subnormals reach down to 2**-9, so values below
``amax * 2**-9 / 448`` of their row round to zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

BF16 = "bfloat16"
FP8 = "float8_e4m3fn"
STORE_DTYPES = (BF16, FP8)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SCALE_DTYPE = torch.float32


def torch_dtype(store_dtype: str) -> torch.dtype:
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype {store_dtype!r} is not one of {list(STORE_DTYPES)}")
    return getattr(torch, store_dtype)


def is_scaled(store_dtype: str) -> bool:
    return store_dtype == FP8


def state_bytes_per_token(num_layers: int, hidden_size: int, store_dtype: str) -> int:
    """Bytes of ``hidden_states`` (and ``hidden_scales``) one token takes in a chunk."""
    element = torch_dtype(store_dtype).itemsize
    scales = num_layers * SCALE_DTYPE.itemsize if is_scaled(store_dtype) else 0
    return num_layers * hidden_size * element + scales


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, L, H]`` → (e4m3 ``[T, L, H]``, float32 scales ``[T, L]``), on the states' device."""
    # |x| and max are exact in the input dtype: no float32 copy is needed for the scales.
    amax = states.abs().amax(dim=-1).to(torch.float32)
    # An all-zero row keeps scale 1 (any scale gives zeros; 1 avoids dividing by zero).
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # One float32 copy (never the caller's tensor), scaled in place; a reciprocal multiply
    # costs a third of a division here.
    scaled = states.to(torch.float32, copy=True).mul_((1.0 / scales).unsqueeze(-1))
    # amax / scale can land a rounding step above 448; e4m3fn has no inf, so clamp, never NaN.
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


class Quantized(NamedTuple):
    """States already quantized where they were captured (the hooks backend's worker, on the
    device where there is one): e4m3 ``values [T, L, H]`` and float32 ``scales [T, L]``."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def quantize_fp8_pieces(
    states: torch.Tensor, piece_rows: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """``quantize_fp8`` over ``piece_rows`` tokens at a time: (rows, values, scales) per piece.

    Rows are quantized independently, so the pieces hold the same bits as one call; taken one at
    a time they bound the float32 copy to ``piece_rows`` tokens (a forward's states on a GPU,
    beside vLLM's KV cache).
    """
    for first in range(0, states.shape[0], piece_rows):
        rows = slice(first, min(first + piece_rows, states.shape[0]))
        yield (rows, *quantize_fp8(states[rows]))


def dequantize(
    states: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Stored states (``[..., H]``) and their scales (``[...]`` or None for bf16) → ``dtype``."""
    if scales is None:
        return states.to(dtype)
    return (states.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)).to(dtype)
