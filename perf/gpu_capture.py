"""Capture throughput against plain vLLM prefill, same engine settings, same run.

For one model shape, each mode runs in a fresh process (its own engine, all GPU memory given
back) over the same random-token prompts, after a warm-up call:

- ``plain``: ``vllm.LLM.generate(max_tokens=1)`` with the capture engines' arguments
  (``capture_engine_kwargs``: eager, no prefix caching) and no capture;
- ``hooks-v1``, ``hooks-v2``: the hooks backend under the V1 runner / Model Runner V2, through
  the extract stage's own capture loop into a capture store (``CaptureWriter``), store closed
  (manifest and checksums written) inside the timed interval;
- ``native``: vLLM's ``extract_hidden_states`` through the same loop and store;
- ``hf``: transformers (needs real weights: random ones are built and saved first).

vLLM modes load random weights (``load_format: dummy``) from a config.json of the shape:
``llama8b`` is Llama-3.1-8B's (32 layers, hidden 4096, vocab 128256), ``smollm2``
SmolLM2-135M-Instruct's. The extract job's hf verification is not part of the timing.
``--deterministic`` runs every mode as ``extract.deterministic: true`` does (vLLM's
batch-invariant kernels, ``VLLM_BATCH_INVARIANT=1``; each engine call's requests all in before
its first step): its price is the ratio to a run without it (docs/capture.md, "Determinism").
``--store-dtype float8_e4m3fn`` writes the capture modes' stores as ``extract.store_dtype``
does (fp8 with a scale per token and layer; the hooks modes quantize in the worker, on a GPU
before the copy to the host, native and hf on the store's writer threads).
Each capture mode also reports ``repeats_same_bytes``: how many chunks every repeat wrote with
the same bytes (the stores' manifests), the determinism result itself.

    python perf/gpu_capture.py --root /tmp/gcap --model llama8b --prompts 256 --length 1024 \\
        --modes plain hooks-v1 hooks-v2 native --out docs/results/gpu-capture.json
    python perf/gpu_capture.py --root /tmp/gcap --model llama8b --prompts 256 --length 1024 \
        --modes plain hooks-v1 --deterministic --out docs/results/gpu-capture-deterministic.json

Results: docs/results/gpu-capture*.json; the current figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
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
    "llama8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
}
MODES = ("plain", "hooks-v1", "hooks-v2", "native", "hf")
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def write_config(shape: str, out: Path, weights: bool) -> None:
    """config.json of the shape (and random bf16 weights when ``weights``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], torch_dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    if not weights:
        config.save_pretrained(str(out))
        return
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))


def make_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(10, vocab - 10, (count, length), generator=generator).tolist()


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this process: warm up, then time ``--repeats`` passes."""
    import torch

    from draftflow.capture.backends import (
        CaptureEngineSettings,
        capture_engine_env,
        capture_engine_kwargs,
        make_backend,
    )
    from draftflow.capture.extract import _capture_all
    from draftflow.capture.layers import capture_layers
    from draftflow.capture.quant import state_bytes_per_token
    from draftflow.capture.store import CaptureWriter
    from draftflow.engine import shutdown_engine, start_engine

    model_dir = Path(args.root) / (args.model + ("-weights" if args.mode == "hf" else ""))
    layers = capture_layers(model_dir, None)  # no config: EAGLE-3's own aux layers
    prompts = make_prompts(args.prompts, args.length, SHAPES[args.model]["vocab_size"])
    runner = {"hooks-v1": "v1", "hooks-v2": "v2"}.get(args.mode, "default")
    settings = CaptureEngineSettings(
        max_model_len=args.length + 1,
        tp_size=1,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        reserved_cpus=None,
        trust_remote_code=False,
        model_runner=runner,
        engine_args={"load_format": "dummy"} if args.mode != "hf" else {},
        hf_dtype="bfloat16",
        # hf may ask torch for CUDA; a vLLM mode must not before its engine starts
        device="cuda" if args.mode != "hf" or torch.cuda.is_available() else "cpu",
        deterministic=args.deterministic,
        store_dtype=args.store_dtype,
    )
    started = time.perf_counter()
    hf_batch_prompts = None
    setup: dict = {}  # what the capture backend's workers report (plain has none)
    if args.mode == "plain":
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        env = capture_engine_env(settings, settings.model_runner)
        llm = start_engine(capture_engine_kwargs(model_dir, settings), env)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

        def run(batch: list[list[int]], out: Path | None) -> dict:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
            return {}

        close = lambda: shutdown_engine(llm)  # noqa: E731
    else:
        backend = make_backend(args.mode.split("-")[0], model_dir, layers.layer_ids, settings)

        def run(batch: list[list[int]], out: Path | None) -> dict:
            if out is None:  # warm-up
                backend.capture(batch)
                return {}
            shutil.rmtree(out, ignore_errors=True)
            writer = CaptureWriter(
                out,
                layer_ids=layers.layer_ids,
                aux_layer_ids=layers.aux_layer_ids,
                hidden_size=layers.hidden_size,
                meta={"bench": args.mode},
                chunk_samples=args.chunk_samples,
                write_threads=args.write_threads,
                store_dtype=args.store_dtype,
            )
            ids = [f"p{i}" for i in range(len(batch))]
            masks = [[1] * len(p) for p in batch]
            began = time.perf_counter()
            _capture_all(writer, backend, 0, ids, batch, masks, args.call_samples)
            captured = time.perf_counter() - began
            writer.close()
            return {
                "capture_loop_s": round(captured, 3),
                "store_close_s": round(time.perf_counter() - began - captured, 3),
                "bytes_written": sum(f.stat().st_size for f in out.iterdir()),
                "backend_stats": getattr(backend, "last_stats", {}),
            }

        if args.mode == "hf" and args.hf_batch_prompts is not None:
            backend.max_batch_prompts = args.hf_batch_prompts  # 1: one prompt a forward
        close = backend.close
        setup = getattr(backend, "setup", {})
        hf_batch_prompts = getattr(backend, "max_batch_prompts", None)
    startup = time.perf_counter() - started
    run(prompts[: min(8, len(prompts))], None)
    on_gpu = torch.cuda.is_available()
    runs = []
    for repeat in range(args.repeats):
        began = time.perf_counter()
        detail = run(prompts, Path(args.root) / f"store-{args.mode}-{repeat}")
        seconds = time.perf_counter() - began
        runs.append(
            {
                "seconds": round(seconds, 3),
                "tokens_per_s": round(args.prompts * args.length / seconds),
                **detail,
            }
        )
    close()
    stores = [Path(args.root) / f"store-{args.mode}-{repeat}" for repeat in range(args.repeats)]
    same_bytes = compare_stores(stores) if args.mode != "plain" else None
    for store in stores:
        shutil.rmtree(store, ignore_errors=True)
    return {
        "model": args.model,
        "mode": args.mode,
        "deterministic": args.deterministic,
        "runner": setup.get("runner", runner),
        "prompts": args.prompts,
        "length": args.length,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "chunk_samples": args.chunk_samples,
        "store_dtype": args.store_dtype,
        "call_samples": args.call_samples,
        "hf_batch_prompts": hf_batch_prompts,
        "layer_ids": layers.layer_ids,
        "bytes_per_token": state_bytes_per_token(
            len(layers.layer_ids), layers.hidden_size, args.store_dtype
        ),
        "startup_s": round(startup, 1),
        "runs": runs,
        "best_tokens_per_s": max(r["tokens_per_s"] for r in runs),
        "repeats_same_bytes": same_bytes,
        "gpu": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "torch": torch.__version__,
        "vllm": _vllm_version(),
    }


def compare_stores(stores: list[Path]) -> dict | None:
    """How many chunks every repeat wrote with the same bytes (the manifests' sha256s)."""
    from draftflow.capture.store import MANIFEST_NAME

    if len(stores) < 2:
        return None
    files = [json.loads((store / MANIFEST_NAME).read_text())["files"] for store in stores]
    chunks = [name for name in files[0] if name.startswith("chunk")]
    same = sum(all(f.get(name) == files[0][name] for f in files[1:]) for name in chunks)
    return {"chunks": len(chunks), "identical_in_every_repeat": same}


def _vllm_version() -> str | None:
    from draftflow.engine import installed_vllm_version

    return installed_vllm_version()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:4]))
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child process
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--kv-cache-bytes", type=int, help="exact KV cache (a CPU smoke run)")
    parser.add_argument("--chunk-samples", type=int, default=8, help="samples per store chunk")
    parser.add_argument("--call-samples", type=int, default=256, help="samples per engine call")
    parser.add_argument("--write-threads", type=int, default=4)
    parser.add_argument("--store-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    parser.add_argument(
        "--hf-batch-prompts", type=int, help="hf mode: prompts per forward (1: one at a time)"
    )
    parser.add_argument(
        "--deterministic", action="store_true", help="as extract.deterministic: true does"
    )
    parser.add_argument("--out", type=Path, help="JSON file the results are written to")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.mode:  # a child: one mode, one JSON line
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return
    args.root.mkdir(parents=True, exist_ok=True)
    write_config(args.model, args.root / args.model, weights=False)
    if "hf" in args.modes:
        write_config(args.model, args.root / f"{args.model}-weights", weights=True)
    results = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    for mode in args.modes:
        command = [sys.executable, __file__, *(argv or sys.argv[1:]), "--mode", mode]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            results.append({"model": args.model, "mode": mode, "error": done.returncode})
            continue
        result = json.loads(lines[-1][len("RESULT ") :])
        results.append(result)
        keys = ("model", "mode", "deterministic", "best_tokens_per_s", "repeats_same_bytes")
        print(json.dumps({k: result[k] for k in keys}))
    plain = next((r for r in results if r.get("mode") == "plain" and "error" not in r), None)
    if plain:
        for result in results:
            if "best_tokens_per_s" in result:
                ratio = result["best_tokens_per_s"] / plain["best_tokens_per_s"]
                result["ratio_to_plain"] = round(ratio, 3)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        existing = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.write_text(json.dumps(existing + results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
