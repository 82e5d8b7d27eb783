"""Draft vocabulary: the most frequent target tokens over masked train tokens.

The mapping is speculators' own (``speculators.train.vocab_mapping``), so the draft trains and
loads in vLLM exactly like one made by speculators' data pipeline:

- ``d2t`` int64 ``[draft_vocab]``: offsets, ``target_id = draft_id + d2t[draft_id]``;
  draft ids are the selected target ids in ascending order.
- ``t2d`` bool ``[vocab]``: True where a target token is in the draft vocabulary.

Selection ranks tokens by count, ties by token id (lower first); if fewer distinct tokens were
seen than ``draft_vocab_size``, the lowest unseen ids fill the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftflow.io import atomic_path, atomic_write_json

TOKEN_FREQ_KEY = "token_freq"


def read_token_freq(path: str | os.PathLike[str]) -> torch.Tensor:
    """int64 ``[vocab]`` counts written by the tokenize stage."""
    tensors = load_file(str(path))
    if TOKEN_FREQ_KEY not in tensors:
        raise KeyError(f"{path} has no {TOKEN_FREQ_KEY!r} tensor (found {sorted(tensors)})")
    freq = tensors[TOKEN_FREQ_KEY]
    if freq.dim() != 1 or freq.dtype != torch.int64:
        raise ValueError(
            f"{path}: token_freq must be int64 [vocab], got {freq.dtype} {list(freq.shape)}"
        )
    return freq


def build_vocab_mapping(
    token_freq: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(d2t, t2d)`` for the ``draft_vocab_size`` most frequent tokens (speculators' rule)."""
    # Imported here: speculators' training package pulls in heavy optional modules.
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    vocab_size = int(token_freq.shape[0])
    if not 2 <= draft_vocab_size <= vocab_size:
        raise ValueError(
            f"vocab.draft_vocab_size {draft_vocab_size} must be in [2, {vocab_size}] "
            f"(the target's vocabulary size)"
        )
    # speculators counts with a Counter, which only holds tokens that occur: pass the same.
    seen = torch.nonzero(token_freq > 0).flatten()
    counts = dict(zip(seen.tolist(), token_freq[seen].tolist(), strict=True))
    d2t, t2d = build_vocab_mappings_from_distribution(counts, draft_vocab_size, vocab_size)
    return d2t.to(torch.int64), t2d.to(torch.bool)


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target token id of every draft id."""
    return torch.arange(d2t.shape[0], dtype=torch.int64) + d2t


def vocab_summary(token_freq: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> dict:
    """Sizes and how much of the masked train tokens the draft vocabulary covers."""
    total = int(token_freq.sum())
    covered = int(token_freq[t2d].sum())
    return {
        "target_vocab_size": int(t2d.shape[0]),
        "draft_vocab_size": int(d2t.shape[0]),
        "distinct_masked_tokens": int((token_freq > 0).sum()),
        "masked_train_tokens": total,
        "covered_masked_tokens": covered,
        "coverage": covered / total if total else 0.0,
    }


def write_vocab(
    token_freq_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    summary_path: str | os.PathLike[str],
    draft_vocab_size: int,
) -> dict:
    """The vocab stage: token_freq.safetensors -> vocab.safetensors (d2t, t2d) + summary JSON."""
    token_freq = read_token_freq(token_freq_path)
    d2t, t2d = build_vocab_mapping(token_freq, draft_vocab_size)
    with atomic_path(out_path) as tmp:
        save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp))
    summary = {"token_freq": str(token_freq_path), **vocab_summary(token_freq, d2t, t2d)}
    atomic_write_json(summary_path, summary)
    return summary


def read_vocab(path: str | os.PathLike[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` from a vocab.safetensors, checked for consistency."""
    tensors = load_file(str(Path(path)))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if int(t2d.sum()) != d2t.shape[0]:
        raise ValueError(f"{path}: t2d selects {int(t2d.sum())} tokens but d2t has {d2t.shape[0]}")
    return d2t, t2d
