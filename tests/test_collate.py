"""The training batch: ``collate`` against the plain construction it replaces."""

from __future__ import annotations

import pytest
import torch
from capture_stores import StoreShape, write_store

from draftflow.train.captures import CaptureSet, SampleRef, collate

LAYER_IDS = [2, 5, 7, 9]
AUX_IDS = [2, 5, 7]
HIDDEN = 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> CaptureSet:
    out = tmp_path_factory.mktemp("collate") / "shard-00000"
    generator = torch.Generator().manual_seed(0)
    samples = []
    for n, length in enumerate([5, 9, 4, 7]):
        ids = torch.randint(0, 100, (length,), generator=generator, dtype=torch.int32)
        mask = torch.randint(0, 2, (length,), generator=generator, dtype=torch.int8)
        states = torch.randn(length, len(LAYER_IDS), HIDDEN, generator=generator)
        samples.append(
            {"id": f"s{n}", "input_ids": ids, "loss_mask": mask, "hidden_states": states.bfloat16()}
        )
    shape = StoreShape(LAYER_IDS, AUX_IDS, HIDDEN)
    write_store(out, samples, shape, {"backend": "synthetic"}, chunk_samples=2)
    return CaptureSet([out])


def reference(shards: CaptureSet, refs: list[SampleRef], tokens: int, dtype, pad: bool) -> dict:
    """Shift each sample with speculators' function, gather layers, concatenate, pad."""
    from speculators.models.eagle3 import shift_batch

    parts, used = [], 0
    for ref in refs:
        raw = shards.read(ref)
        states = raw["hidden_states"]
        n = states.shape[0]
        sample = shift_batch(
            {
                "input_ids": raw["input_ids"].long(),
                "hidden_states": states[:, [0, 1, 2]].flatten(1),
                "verifier_last_hidden_states": states[:, 3],
                "loss_mask": raw["loss_mask"].bool(),
                "lengths": torch.tensor([n]),
                "position_ids": torch.arange(n),
            }
        )
        keep = min(int(sample["lengths"][0]), tokens - used)
        if keep <= 0:
            break
        parts.append({k: v[:keep] for k, v in sample.items() if k != "lengths"})
        used += keep
    batch = {k: torch.cat([p[k] for p in parts]).unsqueeze(0) for k in parts[0]}
    batch["document_ids"] = torch.cat(
        [torch.full((p["input_ids"].shape[0],), d) for d, p in enumerate(parts)]
    ).unsqueeze(0)
    for key in ("hidden_states", "verifier_last_hidden_states"):
        batch[key] = batch[key].to(dtype)
    if pad and used < tokens:
        for key, value in batch.items():
            filler = value.new_full(
                (1, tokens - used, *value.shape[2:]), -1 if key == "document_ids" else 0
            )
            batch[key] = torch.cat([value, filler], dim=1)
    return batch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "pad"), [(30, False), (30, True), (14, True), (11, False)])
def test_collate_matches_the_plain_construction(shards, dtype, tokens, pad):
    refs = shards.samples
    got = collate(shards, refs, tokens, dtype, pad=pad)
    want = reference(shards, refs, tokens, dtype, pad)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key
    # Packed sequences never exceed the step's token budget.
    assert got["input_ids"].shape[1] == (tokens if pad else min(tokens, 4 + 8 + 3 + 6))
