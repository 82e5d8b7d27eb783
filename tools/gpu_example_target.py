"""A random-weight target of a real model's shape: its config.json, SmolLM2's tokenizer.

The shape is the released model's (``tests/data/targets/<name>/config.json``); the weights are
drawn as transformers initializes that class (normal, std ``initializer_range``, norms one),
on the GPU where there is one, and saved as bf16 safetensors shards. The tokenizer, its config
and chat template are SmolLM2's (``tests/families.py`` borrows them the same way), so every
stage can tokenize, generate and capture without the released checkpoint.

The model's vocabulary (128,256 for Llama-3.1) is larger than the tokenizer's (49,152 ids). The
``lm_head`` rows past the tokenizer's ids are zero: their logit is 0, below the largest of the
tokenizer's ids' random logits, so greedy decoding (regenerate and bench run at temperature 0)
only emits ids the tokenizer can decode. Inputs never hold such ids.

    python tools/gpu_example_target.py --config tests/data/targets/llama-3.1-8b/config.json \\
        --tokenizer .carry/example-data/tokenizer --out /tmp/target --device cuda

``--set num_hidden_layers=2`` (repeatable) overrides a config key: a small target of the same
family, for a check on a CPU. Used by tools/gpu_example_llama.sh.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from families import TOKENIZER_FILES  # noqa: E402  (tests/families.py: the borrowed files)


def built_marker(out: Path) -> Path:
    """Written last, beside the target (not in it: prepare_target links and hashes every file
    there): a target with it is finished."""
    return out.parent / f"{out.name}.built.json"


def tokenizer_ids(tokenizer_dir: Path) -> int:
    """Ids the borrowed tokenizer can decode (its vocabulary with the added tokens)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    )


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs; values read as JSON where they parse (numbers, booleans)."""
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set {pair!r}: expected key=value")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def build_random_target(
    config_json: Path,
    out: Path,
    tokenizer_dir: Path,
    *,
    device: str = "cuda",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    max_shard_size: str = "5GB",
) -> dict[str, Any]:
    """Write the target into ``out`` (replaced); returns what was built and how long it took."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    values = json.loads(config_json.read_text(encoding="utf-8"))
    values.update(overrides or {})
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    vocab = tokenizer_ids(tokenizer_dir)
    if vocab > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab} ids, the model's vocabulary {config.vocab_size}"
        )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_output_embeddings().weight[vocab:] = 0
    parameters = sum(p.numel() for p in model.parameters())
    drawn = time.perf_counter()
    built_marker(out).unlink(missing_ok=True)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    del model
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    saved = time.perf_counter()
    weights = sum(path.stat().st_size for path in out.glob("*.safetensors"))
    info = {
        "config": str(config_json),
        "overrides": overrides or {},
        "device": device,
        "seed": seed,
        "parameters": parameters,
        "weight_bytes": weights,
        "tokenizer_ids": vocab,
        "vocab_size": config.vocab_size,
        "draw_s": round(drawn - started, 2),
        "save_s": round(saved - drawn, 2),
    }
    built_marker(out).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the model's config.json")
    parser.add_argument("--tokenizer", type=Path, required=True, help="SmolLM2's tokenizer files")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    info = build_random_target(
        args.config,
        args.out,
        args.tokenizer,
        device=args.device,
        seed=args.seed,
        overrides=parse_overrides(args.set),
    )
    print(json.dumps(info))


if __name__ == "__main__":
    main()
