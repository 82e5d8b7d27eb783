"""draftflow.train.attention: SDPA one packed sample at a time equals SDPA over the packed step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftflow.train.attention import attention_spans, packed_sdpa

LENGTH = 256
SCALE = 0.125


def speculators_mask(document_ids: torch.Tensor, ttt_step: int) -> torch.Tensor:
    """The dense boolean mask speculators' forward gives SDPA at ``ttt_step`` (0-based)."""
    from speculators.models.eagle3.attention import (
        create_combined_mask_mod,
        extend_dense_mask_for_draft_tokens,
    )
    from torch.nn.attention.flex_attention import create_mask

    length = document_ids.shape[0]
    mask_mod = create_combined_mask_mod(document_ids, length)
    mask = create_mask(mask_mod, None, None, length, length, device="cpu")
    for _ in range(ttt_step):
        mask = extend_dense_mask_for_draft_tokens(mask, length)
    return mask


def packed_documents(lengths: list[int], total: int = LENGTH) -> torch.Tensor:
    """Document ids of samples of ``lengths`` packed into ``total`` positions, -1 = padding."""
    ids = [torch.full((n,), i) for i, n in enumerate(lengths)]
    return torch.cat([*ids, torch.full((total - sum(lengths),), -1)])


def attend(function, mask: torch.Tensor, seed: int = 0):
    """Output and input gradients of ``function`` on random query/key/value (GQA, 6 / 2 heads)."""
    generator = torch.Generator().manual_seed(seed)
    keys = mask.shape[-1]
    inputs = [
        torch.randn(1, 6, LENGTH, 16, generator=generator),
        torch.randn(1, 2, keys, 16, generator=generator),
        torch.randn(1, 2, keys, 16, generator=generator),
    ]
    for tensor in inputs:
        tensor.requires_grad_(True)
    output = function(*inputs, mask)
    (output * torch.linspace(-1, 1, output.numel()).reshape(output.shape)).sum().backward()
    return output.detach(), [tensor.grad for tensor in inputs]


def dense(query, key, value, mask):
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=SCALE, enable_gqa=True
    )
    return output.transpose(1, 2)


def packed(query, key, value, mask):
    return packed_sdpa(None, query, key, value, mask, scaling=SCALE)[0]


@pytest.mark.parametrize("ttt_step", [0, 1, 2])
def test_packed_attention_equals_dense_on_speculators_masks(ttt_step):
    """Output and gradients within float32 rounding, at every TTT step's mask (the later
    steps' keys: the row's own position in each earlier step's block)."""
    documents = packed_documents([70, 1, 90, 60])  # 35 padding positions at the end
    mask = speculators_mask(documents, ttt_step)
    spans = attention_spans(mask[0, 0])
    # One span per sample and one for the padding run; a one-token sample sees only itself, as
    # padding does, and shares a span with the next sample's first token.
    assert spans == [(0, 70), (70, 161), (161, 221), (221, 256)]
    expected, expected_grads = attend(dense, mask)
    output, grads = attend(packed, mask)
    assert output.shape == (1, LENGTH, 6, 16)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)


def test_a_mask_that_does_not_split_is_attended_whole():
    """A query that sees into the sample before its own: no spans, one dense call, the same
    attention; one sample alone is one span (one dense call too)."""
    mask = speculators_mask(packed_documents([100, 120]), 1)
    mask[0, 0, 150, 50] = True
    assert attention_spans(mask[0, 0]) is None
    for case in (mask, speculators_mask(packed_documents([LENGTH]), 2)):
        expected, expected_grads = attend(dense, case)
        output, grads = attend(packed, case)
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)
    assert attention_spans(speculators_mask(packed_documents([LENGTH]), 2)[0, 0]) == [(0, LENGTH)]
    # A query with no key at all (no mask speculators builds has one) is left to SDPA whole.
    empty = speculators_mask(packed_documents([100, 120]), 0)
    empty[0, 0, 10] = False
    assert attention_spans(empty[0, 0]) is None
