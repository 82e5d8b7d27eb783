"""The draft's attention on the CPU: SDPA one packed sample at a time.

A training step packs several samples into one row, and speculators' forward gives SDPA a dense
boolean mask over the whole row (each token sees the earlier tokens of its own sample, and
after the first TTT step its own position in every later block of keys). Dense SDPA computes
every query against every key of the row and throws most of it away. ``packed_sdpa`` cuts the
row into the spans that attend only among themselves, read from the mask itself, and runs SDPA
on each span with its slice of the mask: the same attention, a fraction of the work (about the
packed samples' count times less). A mask that does not split into such spans (none of
draftflow's) falls back to one dense call, so the result never depends on the split.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

# The name under which the function is registered with transformers (train.attn_impl).
PACKED_SDPA = "packed_sdpa"


def attention_spans(mask: torch.Tensor) -> list[tuple[int, int]] | None:
    """Contiguous query spans ``[start, end)`` whose allowed keys, in every block of
    ``T`` keys of ``mask`` (``[T, blocks * T]``, True = attend), lie in the same span; None
    where the mask does not split so (or a query has no key at all)."""
    length = mask.shape[0]
    if mask.shape[1] % length:
        return None
    allowed = mask.reshape(length, mask.shape[1] // length, length).any(dim=1)
    if not bool(allowed.any(dim=1).all()):
        return None
    positions = torch.arange(length, device=mask.device)
    first = allowed.int().argmax(dim=1)
    last = length - 1 - allowed.flip(1).int().argmax(dim=1)
    # A run of queries that see only themselves (padding) is one span, not one span each.
    alone = (first == positions) & (last == positions)
    after_alone = torch.cat([alone.new_zeros(1), alone[:-1]])
    starts = (first == positions) & ~(alone & after_alone)
    starts[0] = True
    bounds = torch.cat([positions[starts], positions.new_tensor([length])])
    span_of = torch.cumsum(starts.int(), dim=0) - 1
    if not bool(((first >= bounds[span_of]) & (last < bounds[span_of + 1])).all()):
        return None
    edges = bounds.tolist()
    return list(pairwise(edges))


def packed_sdpa(
    module: torch.nn.Module,  # transformers' attention interface passes the layer
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``[1, heads, T, dim]``, ``key``/``value``
    ``[1, kv_heads, blocks * T, dim]``, a boolean ``attention_mask`` ``[1, 1, T, blocks * T]``;
    returns ``[1, T, heads, dim]``."""
    gqa = query.shape[1] != key.shape[1]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor | None):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=m, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )

    spans = None
    if (
        attention_mask is not None
        and attention_mask.dtype == torch.bool
        and query.shape[0] == attention_mask.shape[0] == attention_mask.shape[1] == 1
    ):
        with torch.no_grad():
            spans = attention_spans(attention_mask[0, 0])
    if spans is None or len(spans) == 1:
        output = sdpa(query, key, value, attention_mask)
        return output.transpose(1, 2).contiguous(), None
    length = query.shape[2]
    blocks = key.shape[2] // length
    outputs = []
    for start, end in spans:
        columns = torch.cat(
            [
                torch.arange(block * length + start, block * length + end, device=key.device)
                for block in range(blocks)
            ]
        )
        mask = attention_mask[:, :, start:end].index_select(-1, columns)
        outputs.append(
            sdpa(
                query[:, :, start:end],
                key.index_select(2, columns),
                value.index_select(2, columns),
                mask,
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def register_packed_sdpa() -> None:
    """Make ``packed_sdpa`` a draft attention implementation transformers can look up."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa)
