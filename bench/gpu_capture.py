"""The ``hf`` capture backend on a GPU: prompt tokens/s and bytes/s written to a capture store.

The models are random-weight stand-ins built on the device (no weights can be fetched there):
``smollm2`` is SmolLM2-135M-Instruct's architecture (its config.json values), ``llama1b`` a
Llama-shaped model of about 1.2B parameters. Prompts are random token ids. Each model is
saved as a bf16 HF checkpoint, opened with ``make_backend("hf", ..., device="cuda")``, warmed
up on 4 prompts, then timed twice over ``--prompts`` prompts: captured states are moved to the
host and written with ``ShardWriter`` (the capture stage's store), closing the shard included.

    python bench/gpu_capture.py --root /tmp/gcap --prompts 128 --length 1024

Results go to docs/benchmarks.md, section "GPU capture".
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

CONFIGS = {
    "smollm2": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
    },
    "llama1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_hidden_layers": 16,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
}


def build_model(name: str, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**CONFIGS[name])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()


def measure(name: str, root: Path, prompts: int, length: int, repeats: int) -> dict:
    import torch

    from draftflow.capture.backends import EngineSettings, make_backend
    from draftflow.capture.layers import capture_layers
    from draftflow.capture.store import ShardWriter

    model_dir = root / name
    build_model(name, model_dir)
    layers = capture_layers(model_dir)
    settings = EngineSettings(max_model_len=length + 1, hf_dtype="bfloat16", device="cuda")
    started = time.perf_counter()
    backend = make_backend("hf", model_dir, layers.layer_ids, settings)
    startup = time.perf_counter() - started
    vocab = CONFIGS[name]["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, vocab, (prompts, length), generator=generator).tolist()
    backend.capture(batch[:4])  # warm-up
    torch.cuda.synchronize()
    runs = []
    for repeat in range(repeats):
        out = root / f"{name}-store-{repeat}"
        shutil.rmtree(out, ignore_errors=True)
        began = time.perf_counter()
        writer = ShardWriter(
            out,
            layer_ids=layers.layer_ids,
            aux_layer_ids=layers.aux_layer_ids,
            hidden_size=layers.hidden_size,
            meta={"backend": "hf", "bench": name},
        )
        states = backend.capture(batch)
        captured = time.perf_counter() - began
        for n, (ids, hidden) in enumerate(zip(batch, states, strict=True)):
            writer.add(
                f"p{n}",
                torch.tensor(ids, dtype=torch.int32),
                torch.ones(len(ids), dtype=torch.int8),
                hidden.to(torch.bfloat16),
            )
        writer.close()
        seconds = time.perf_counter() - began
        written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        runs.append(
            {
                "seconds": round(seconds, 3),
                "capture_only_s": round(captured, 3),
                "tokens_per_s": round(prompts * length / seconds),
                "capture_only_tokens_per_s": round(prompts * length / captured),
                "mb_per_s_written": round(written / seconds / 1e6, 1),
                "bytes_written": written,
            }
        )
    backend.close()
    params = sum(int(v.numel()) for v in _weights(model_dir).values())
    return {
        "model": name,
        "params": params,
        "layer_ids": layers.layer_ids,
        "prompts": prompts,
        "length": length,
        "startup_s": round(startup, 1),
        "bytes_per_token": len(layers.layer_ids) * layers.hidden_size * 2,
        "runs": runs,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in model_dir.glob("*.safetensors"):
        out.update(load_file(str(file)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["smollm2", "llama1b"])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        result = measure(name, args.root, args.prompts, args.length, args.repeats)
        print("RESULT " + json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as handle:
                handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
