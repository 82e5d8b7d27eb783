"""The runs of trained tokens in a loss mask (tests/test_masks*.py)."""

from __future__ import annotations


def masked_runs(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The maximal runs of ``input_ids`` whose mask bit is set, in order."""
    runs: list[list[int]] = []
    previous = 0
    for token, bit in zip(input_ids, loss_mask, strict=True):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token)
        previous = bit
    return runs
