"""Draft vocabulary: speculators' d2t / t2d format, deterministic ties, coverage."""

from __future__ import annotations

import json

import pytest
import torch
from config_support import demo_config
from safetensors.torch import load_file, save_file

from draftflow.train.vocab import (
    build_vocab_mapping,
    draft_to_target_ids,
    read_vocab,
    write_vocab,
)


def _expected_ids(freq: torch.Tensor, k: int) -> list[int]:
    """Independent reference: rank by (-count, id), keep k, draft ids in ascending target order."""
    ranked = sorted(range(len(freq)), key=lambda t: (-int(freq[t]), t))
    return sorted(ranked[:k])


def test_most_frequent_tokens_with_ties_broken_by_id():
    freq = torch.tensor([5, 0, 9, 5, 5, 1, 9, 0], dtype=torch.int64)
    d2t, t2d = build_vocab_mapping(freq, 4)
    # 9, 9 (ids 2, 6), then three 5s tie: ids 0 and 3 win over 4.
    assert draft_to_target_ids(d2t).tolist() == [0, 2, 3, 6]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.tolist() == [True, False, True, True, False, False, True, False]


def test_offsets_decode_to_the_selected_tokens_on_random_counts():
    generator = torch.Generator().manual_seed(0)
    freq = torch.randint(0, 20, (5000,), generator=generator, dtype=torch.int64)
    d2t, t2d = build_vocab_mapping(freq, 700)
    ids = draft_to_target_ids(d2t)
    assert ids.tolist() == _expected_ids(freq, 700)
    # target_id = draft_id + d2t[draft_id]; t2d marks exactly those ids.
    assert torch.equal(torch.nonzero(t2d).flatten(), ids)
    assert int(t2d.sum()) == d2t.shape[0] == 700


def test_unseen_tokens_fill_up_from_the_lowest_ids():
    freq = torch.zeros(50, dtype=torch.int64)
    freq[[40, 7, 30]] = torch.tensor([3, 2, 1])
    d2t, _ = build_vocab_mapping(freq, 6)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 7, 30, 40]


@pytest.mark.parametrize("size", [1, 51])
def test_bad_draft_vocab_size_is_named(size):
    with pytest.raises(ValueError, match=rf"draft_vocab_size {size} must be in \[2, 50\]"):
        build_vocab_mapping(torch.ones(50, dtype=torch.int64), size)


def test_write_vocab_files_and_coverage(tmp_path):
    freq = torch.tensor([10, 0, 30, 5, 55], dtype=torch.int64)
    save_file({"token_freq": freq}, str(tmp_path / "token_freq.safetensors"))
    summary = write_vocab(
        tmp_path / "token_freq.safetensors",
        tmp_path / "vocab.safetensors",
        tmp_path / "summary.json",
        2,
    )
    tensors = load_file(str(tmp_path / "vocab.safetensors"))
    assert set(tensors) == {"d2t", "t2d"}
    assert draft_to_target_ids(tensors["d2t"]).tolist() == [2, 4]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["masked_train_tokens"] == 100
    assert summary["covered_masked_tokens"] == 85
    assert summary["coverage"] == pytest.approx(0.85)
    assert summary["distinct_masked_tokens"] == 4
    d2t, t2d = read_vocab(tmp_path / "vocab.safetensors")
    assert torch.equal(d2t, tensors["d2t"]) and torch.equal(t2d, tensors["t2d"])


def test_draft_lm_head_rows_are_the_targets_rows_for_the_draft_vocab(smollm2_dir):
    """speculators reads our mapping as intended: lm_head row i = target row d2t-decoded i."""
    from draftflow.train.model import build_draft_model

    target = load_file(str(smollm2_dir / "model.safetensors"))
    embed = target["model.embed_tokens.weight"]
    generator = torch.Generator().manual_seed(1)
    freq = torch.randint(0, 1000, (embed.shape[0],), generator=generator, dtype=torch.int64)
    d2t, t2d = build_vocab_mapping(freq, 256)
    model = build_draft_model(
        smollm2_dir,
        [2, 15, 27],
        d2t,
        t2d,
        num_layers=1,
        ttt_steps=3,
        attn_impl="sdpa",
        variant="eagle3",
        trust_remote_code=demo_config()["target"]["trust_remote_code"],
    )
    rows = embed[draft_to_target_ids(d2t)]  # SmolLM2 ties lm_head to the embeddings
    assert torch.equal(model.lm_head.weight.to(rows.dtype), rows)
    assert torch.equal(model.verifier_lm_head.weight.to(rows.dtype), rows)
    assert torch.equal(model.d2t, d2t) and torch.equal(model.t2d, t2d)
