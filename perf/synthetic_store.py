"""A synthetic capture store for the training benchmarks: random values, real formats.

Random hidden states of the target's capture layout, written with the capture stage's
``CaptureWriter`` (so the train loop reads them as it reads real shards), and a draft vocabulary
made by the vocab stage from random token counts. Throughput does not depend on the values.
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_synthetic_store(
    root: Path,
    target: str | Path,
    *,
    train_samples: int,
    val_samples: int,
    length: int,
    draft_vocab: int,
    dtype: torch.dtype = torch.float32,
    chunk_samples: int = 64,  # samples per chunk, as the extract stage's default chunks them
    seed: int = 0,
    store_dtype: str = "bfloat16",
) -> dict[str, list[str]]:
    """``root/{train,val}/shard-00000`` and ``root/vocab.safetensors``; returns the shard dirs."""
    from safetensors.torch import save_file

    from draftflow.capture.layers import capture_layers
    from draftflow.capture.store import CaptureWriter
    from draftflow.io import read_json
    from draftflow.train.vocab import write_vocab

    layers = capture_layers(target, None)  # no config: EAGLE-3's own aux layers
    vocab_size = int(read_json(Path(target) / "config.json")["vocab_size"])
    generator = torch.Generator().manual_seed(seed)
    dirs: dict[str, list[str]] = {}
    for split, count in (("train", train_samples), ("val", val_samples)):
        out = root / split / "shard-00000"
        writer = CaptureWriter(
            out,
            layer_ids=layers.layer_ids,
            aux_layer_ids=layers.aux_layer_ids,
            hidden_size=layers.hidden_size,
            meta={"backend": "synthetic"},
            chunk_samples=chunk_samples,
            store_dtype=store_dtype,
        )
        for n in range(count):
            ids = torch.randint(0, vocab_size, (length,), generator=generator, dtype=torch.int32)
            states = torch.randn(
                length, len(layers.layer_ids), layers.hidden_size, generator=generator
            )
            writer.add(f"{split}{n}", ids, torch.ones(length, dtype=torch.int8), states.to(dtype))
        writer.close()
        dirs[split] = [str(out)]
    freq = torch.randint(0, 1000, (vocab_size,), generator=generator, dtype=torch.int64)
    save_file({"token_freq": freq}, str(root / "token_freq.safetensors"))
    write_vocab(
        root / "token_freq.safetensors",
        root / "vocab.safetensors",
        root / "vocab.json",
        draft_vocab,
    )
    return dirs
