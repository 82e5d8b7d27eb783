"""Draft training at real size on GPUs: our loop vs speculators' own step, same model and shape.

An EAGLE-3 draft (1 decoder layer) for a Llama-3.1-8B-shaped target: hidden 4096, intermediate
14336, 32 heads, 8 KV heads, 32 layers, vocab 128256, draft vocab 32000, 3 aux layers,
2048-token samples packed 8192 tokens per step, ttt_steps 3, bf16 autocast, AdamW, eager KL loss.
Everything is synthetic: the target's embedding, lm_head and final norm are random tensors of the
right shape, the hidden states in the capture store are random (written with the capture stage's
``CaptureWriter``), and the draft vocabulary comes from random token counts.

Three sub-commands (results: docs/results/gpu-train-speculators.json, gpu-train-fp8.json)::

    python perf/gpu_train_step.py prepare --root /tmp/gts
    python perf/gpu_train_step.py ours --root /tmp/gts            # draftflow.train.loop.train
    torchrun --nproc-per-node 2 perf/gpu_train_step.py ours --root /tmp/gts   # its DDP path
    python perf/gpu_train_step.py speculators --root /tmp/gts     # speculators' trainer step

``ours`` runs the project's whole training path (shard reading, packing, collate, the train
step, metrics) and reports the median of its logged per-step tokens/s. ``speculators`` runs the
step of speculators' ``Trainer`` (autocast forward, backward, clip, AdamW step; metrics synced
only at the end) on batches already resident on the GPU, so its figure has no data-loading cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from synthetic_store import write_synthetic_store  # perf/, beside this script

TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "vocab_size": 128256,
}
BF16_DENSE_PEAK = 989e12  # H200 SXM datasheet, dense bf16


def prepare(
    root: Path, samples: int, length: int, draft_vocab: int, store_dtype: str = "bfloat16"
) -> None:
    import torch
    from safetensors.torch import save_file

    from draftflow.io import atomic_write_json

    generator = torch.Generator().manual_seed(0)
    target = root / "target"
    target.mkdir(parents=True, exist_ok=True)
    atomic_write_json(target / "config.json", TARGET_CONFIG)
    vocab, hidden = TARGET_CONFIG["vocab_size"], TARGET_CONFIG["hidden_size"]
    weights = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator) * 0.02,
        "lm_head.weight": torch.randn(vocab, hidden, generator=generator) * 0.02,
        "model.norm.weight": torch.ones(hidden),
    }
    save_file(
        {k: v.to(torch.bfloat16) for k, v in weights.items()}, str(target / "model.safetensors")
    )
    write_synthetic_store(
        root,
        target,
        train_samples=samples,
        val_samples=4,
        length=length,
        draft_vocab=draft_vocab,
        dtype=torch.bfloat16,
        chunk_samples=8,
        store_dtype=store_dtype,
    )
    print(
        json.dumps(
            {
                "prepared": str(root),
                "train_samples": samples,
                "length": length,
                "store_dtype": store_dtype,
            }
        )
    )


def flop_count(model, ttt_steps: int, sample_length: int) -> dict:
    """Training FLOPs per packed token, from the model's linear layers and the attention.

    Linear y = xW (n = in * out weights): forward 2n; backward 2n for the input gradient and 2n
    more for a trainable weight. So 6n for a trainable layer, 4n for a frozen one that still
    passes gradients back (none here), 2n for the no-grad target head. ``fc`` runs once per
    token, the decoder layer and the draft head once per TTT step, the target's head once.
    Attention per TTT step k: each query scores its causal keys inside its document, on average
    (L + 1) / 2, plus k keys of the earlier TTT steps; QK^T and PV cost 4 * q_dim flops per key
    forward, backward twice that. Norms, RoPE, the loss and the optimizer are not counted.
    """
    import torch

    per_token = 0.0
    parts: dict[str, float] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        n = module.in_features * module.out_features
        trainable = module.weight.requires_grad
        if name.startswith("verifier_lm_head"):
            flops = 2 * n
        elif name.startswith("fc"):
            flops = (6 if trainable else 2) * n
        else:
            flops = ttt_steps * (6 if trainable else 4) * n
        parts[name] = {"weights": n, "trainable": trainable, "flops_per_token": flops}
        per_token += flops
    layer = model.layers[0].self_attn
    q_dim = layer.q_proj.out_features
    avg_keys = (sample_length - 1 + 1) / 2
    attention = sum(3 * 4 * q_dim * (avg_keys + k) for k in range(ttt_steps))
    per_token += attention
    return {"flops_per_token": per_token, "attention_flops_per_token": attention, "linears": parts}


def make_job(root: Path, args: argparse.Namespace, tag: str = "run"):
    from draftflow.config import DEMO_CONFIG, from_section, load_config
    from draftflow.train.job import TrainJob
    from draftflow.train.settings import TrainSettings

    # The demo's train section (config/demo.yaml) with this measurement's settings.
    config = load_config(DEMO_CONFIG)
    settings = from_section(
        TrainSettings,
        {
            **config["train"],
            "num_layers": 1,
            "ttt_steps": args.ttt_steps,
            "tokens_per_batch": args.tokens_per_batch,
            "max_steps": args.steps,
            "eval_every": 10**9,
            "checkpoint_every": 10**9,
            "log_every": 10,
            "warmup_steps": 2,
            "optimizer": "adamw",
            "loss_implementation": "eager",
            "device": "cuda",
        },
        "train",
    )
    tag = f"{tag}-{int(os.environ.get('WORLD_SIZE', '1'))}"
    return TrainJob(
        target_dir=str(root / "target"),
        vocab_path=str(root / "vocab.safetensors"),
        train_shards=[str(root / "train" / "shard-00000")],
        val_shards=[str(root / "val" / "shard-00000")],
        draft_dir=str(root / tag / "draft"),
        metrics_path=str(root / tag / "metrics.jsonl"),
        checkpoint_dir=str(root / tag / "checkpoints"),
        settings=settings,
        trust_remote_code=config["target"]["trust_remote_code"],
    )


def run_ours(root: Path, args: argparse.Namespace) -> dict | None:
    import torch

    from draftflow.io import read_json
    from draftflow.train.loop import train
    from draftflow.train.metrics import read_metrics

    job = make_job(root, args)
    torch.cuda.reset_peak_memory_stats()
    train(job)
    peak = torch.cuda.max_memory_allocated() / 2**30
    rank = int(os.environ.get("RANK", "0"))
    print(json.dumps({"rank": rank, "peak_gib": round(peak, 2)}), flush=True)
    if rank != 0:
        return None
    steps = [r for r in read_metrics(job.metrics_path) if r["kind"] == "train"]
    # Each step's time: CUDA events recorded after consecutive steps (the loop reads them, and
    # its metrics, every log_every steps, so steps run back to back as in a real run).
    timed = steps[args.warmup :]
    rates = [r["tokens_per_s"] for r in timed]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    return {
        "impl": "draftflow.train.loop",
        "store_dtype": read_json(root / "train" / "shard-00000" / "manifest.json")["dtype"],
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "timed_steps": len(timed),
        "tokens_per_step_all_ranks": timed[-1]["tokens"],
        "tokens_per_s_overall": sum(r["tokens"] for r in timed) / seconds,
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "peak_gib_rank0": round(peak, 2),
        "first_step_s": round(steps[0]["tokens"] / steps[0]["tokens_per_s"], 1),
        "final_loss": timed[-1]["loss"],
    }


def run_speculators(root: Path, args: argparse.Namespace) -> dict:
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.train.optimizers import build_optimizers

    from draftflow.train.captures import CaptureSet, TrainPlan, collate
    from draftflow.train.model import build_draft_model
    from draftflow.train.vocab import read_vocab

    job = make_job(root, args)
    settings = job.settings
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    shards = CaptureSet(job.train_shards)
    d2t, t2d = read_vocab(job.vocab_path)
    # speculators' Eagle3DraftModel.from_training_args, the call its trainer's CLI makes.
    model = build_draft_model(
        job.target_dir,
        shards.aux_layer_ids,
        d2t,
        t2d,
        num_layers=1,
        ttt_steps=settings.ttt_steps,
        attn_impl="simple_flex_attention",
        variant=settings.variant,
        trust_remote_code=job.trust_remote_code,
    ).to(device)
    # speculators' own builder (foreach AdamW), as its trainer calls it.
    options = {"optimizer": "adamw", "lr": settings.lr, "weight_decay": settings.weight_decay}
    optimizers = build_optimizers(model, argparse.Namespace(**options))
    call_kwargs = {
        "ttt_steps": settings.ttt_steps,
        "ttt_step_loss_decay": 1.0,
        "loss_config": resolve_loss_config("kl_div", args.loss_impl),
    }
    # One epoch, seed 0, one rank, no step limit: only its first batches are kept resident.
    plan = TrainPlan(shards, settings.tokens_per_batch, 1, 0, 1, None, settings.order)
    resident = [
        {
            k: v.to(device)
            for k, v in collate(
                shards, plan.batch(i), settings.tokens_per_batch, torch.bfloat16, True
            ).items()
        }
        for i in range(min(4, plan.total_steps))
    ]
    tokens = [int((b["document_ids"] >= 0).sum()) for b in resident]
    torch.cuda.reset_peak_memory_stats()
    events = []
    first = None
    for step in range(args.steps):
        batch = resident[step % len(resident)]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        wall = time.perf_counter()
        begin.record()
        # speculators.train.trainer.Trainer's step, minus its logging.
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss, _metrics = model(**batch, **call_kwargs)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
        end.record()
        events.append((begin, end, tokens[step % len(resident)]))
        if step == 0:
            torch.cuda.synchronize()
            first = time.perf_counter() - wall
        if step == args.warmup - 1:
            torch.cuda.synchronize()
            window = time.perf_counter()
    torch.cuda.synchronize()
    window = time.perf_counter() - window
    timed = events[args.warmup :]
    rates = [n / (b.elapsed_time(e) / 1000) for b, e, n in timed]
    return {
        "impl": f"speculators step ({args.loss_impl} loss), batches resident on the GPU",
        "world_size": 1,
        "timed_steps": len(timed),
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "tokens_per_s_overall": sum(n for _, _, n in timed) / window,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "first_step_s": round(first, 1),
        "final_loss": float(loss),
        **{
            k: v
            for k, v in flop_count(model, settings.ttt_steps, args.sample_length).items()
            if k != "linears"
        },
        "linears": flop_count(model, settings.ttt_steps, args.sample_length)["linears"],
    }


def run_profile(root: Path, args: argparse.Namespace, out: Path) -> dict:
    """torch.profiler over ``--profile-steps`` steps of our loop, after ``--warmup`` steps.

    The profiler advances at each optimizer step (a global post-step hook), so validation and
    compilation before the window stay out. Writes the kernel table and a gzipped Chrome trace to
    ``out`` and returns the share of the window the GPU spent in kernels.
    """
    import gzip

    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    from draftflow.train.loop import train

    out = out / f"rank{os.environ.get('RANK', '0')}"
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    profiler = profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=args.warmup - 2, warmup=2, active=args.profile_steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
    )
    profiler.start()
    handle = register_optimizer_step_post_hook(lambda *_: profiler.step())
    try:
        train(make_job(root, args, tag="profile"))
    finally:
        handle.remove()
        profiler.stop()
    table = profiler.key_averages().table(sort_by="self_device_time_total", row_limit=60)
    (out / "profile_table.txt").write_text(table)
    try:
        summary = trace_summary(json.loads(trace.read_text()))
    except (KeyError, ValueError) as error:  # a trace without kernels: keep the table
        summary = {"trace_summary_error": repr(error)}
    with gzip.open(out / "trace.json.gz", "wt") as handle_gz:
        handle_gz.write(trace.read_text())
    trace.unlink()
    print(table[:6000], flush=True)
    return {"impl": "profile of draftflow.train.loop", **summary}


def trace_summary(trace: dict) -> dict:
    """GPU kernel time, idle time and the main kernel groups in a Chrome trace's steps."""
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    begin = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy, reach = 0.0, begin
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = max(e["ts"], reach), e["ts"] + e["dur"]
        if stop > start:
            busy += stop - start
            reach = stop
    groups: dict[str, float] = {}
    patterns = (
        ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
        ("flex_attention", ("flex", "attention")),
        ("adamw", ("adam",)),
        ("triton (fused by inductor)", ("triton",)),
        ("elementwise / reduce (eager)", ("elementwise", "reduce", "vectorized", "unrolled")),
    )
    for e in kernels:
        name = e["name"].lower()
        group = next((g for g, keys in patterns if any(k in name for k in keys)), "other")
        groups[group] = groups.get(group, 0.0) + e["dur"]
    n = max(1, len(steps))
    return {
        "profiled_steps": len(steps),
        "window_ms_per_step": (end - begin) / 1e3 / n,
        "kernel_busy_ms_per_step": busy / 1e3 / n,
        "gpu_idle_share": 1 - busy / (end - begin),
        "kernels_per_step": len(kernels) / n,
        "copy_ms_per_step": sum(e["dur"] for e in copies) / 1e3 / n,
        "kernel_ms_per_step_by_group": {g: round(t / 1e3 / n, 2) for g, t in groups.items()},
    }


def summary(paths: list[Path]) -> None:
    """One table of the JSON lines ``--out`` wrote: tokens/s, ratio to speculators, MFU."""
    results = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line]
    reference = next(r for r in results if r["impl"].startswith("speculators"))
    flops = reference["flops_per_token"]
    base = reference["tokens_per_s_overall"]
    print("| run | GPUs | tokens/s overall | median | min-max | vs speculators | peak GiB | MFU |")
    for r in results:
        if "tokens_per_s_overall" not in r:
            continue
        rate = r["tokens_per_s_overall"]
        gpus = r.get("world_size", 1)
        mfu = rate * flops / (gpus * BF16_DENSE_PEAK)
        peak = r.get("peak_gib", r.get("peak_gib_rank0"))
        print(
            f"| {r['impl']} | {gpus} | {rate:,.0f} | {r['tokens_per_s_median']:,.0f} | "
            f"{r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f} | "
            f"{rate / base:.3f} | {peak} | {100 * mfu:.1f} % |"
        )


def allreduce(numel: int, repeats: int = 10) -> dict:
    """NCCL all-reduce of one fp32 tensor the size of the draft's gradients (torchrun workers)."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    grads = torch.randn(numel, device="cuda")
    for _ in range(3):
        dist.all_reduce(grads)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(grads)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - began) / repeats
    world = dist.get_world_size()
    dist.destroy_process_group()
    # NCCL's "bus bandwidth": what each GPU sends and receives in a ring all-reduce.
    bus = 2 * (world - 1) / world * numel * 4 / seconds
    return {"impl": "nccl all_reduce", "numel": numel, "ms": seconds * 1e3, "bus_gb_s": bus / 1e9}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what", choices=["prepare", "ours", "speculators", "profile", "allreduce", "summary"]
    )
    parser.add_argument("--root", type=Path)
    parser.add_argument("results", nargs="*", type=Path, help="summary: --out files")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--sample-length", type=int, default=2048)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--tokens-per-batch", type=int, default=8192)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--loss-impl", default="eager", choices=["eager", "fused"])
    parser.add_argument("--numel", type=int, default=293_666_816, help="allreduce: fp32 values")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--profile-dir", type=Path, default=Path("profile"))
    parser.add_argument("--out", type=Path, help="append the result as one JSON line")
    parser.add_argument(
        "--store-dtype",
        default="bfloat16",
        choices=["bfloat16", "float8_e4m3fn"],
        help="prepare: the capture store's dtype (fp8 is dequantized where the batch is built)",
    )
    args = parser.parse_args(argv)
    if args.what == "summary":
        summary(args.results)
        return
    if args.root is None:
        parser.error(f"{args.what} needs --root")
    if args.what == "prepare":
        prepare(args.root, args.samples, args.sample_length, args.draft_vocab, args.store_dtype)
        return
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.what == "allreduce":
        result = allreduce(args.numel)
        if os.environ.get("RANK", "0") != "0":
            return
    elif args.what == "ours":
        result = run_ours(args.root, args)
    elif args.what == "profile":
        result = run_profile(args.root, args, args.profile_dir)
    else:
        result = run_speculators(args.root, args)
    if result is None:
        return
    import torch

    result["machine"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    result["torch"] = torch.__version__
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "linears"}), flush=True)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
