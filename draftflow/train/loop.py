"""The training loop: speculators' EAGLE-3 model and losses, our data, checkpoints and logging.

Read top to bottom: setup (devices, data, model, optimizer, resume), then one loop of
step -> log -> evaluate -> checkpoint, then export. docs/training.md says why this is our own
small loop rather than speculators' ``Trainer``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tqdm import tqdm

from draftflow.io import read_json
from draftflow.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from draftflow.train.data import ShardSet, TrainPlan, collate, val_batches
from draftflow.train.export import export_draft
from draftflow.train.metrics import MetricsLog, StepMetrics, summarize
from draftflow.train.model import build_draft_model, resolve_attn_impl, trainable_state
from draftflow.train.settings import TrainSettings
from draftflow.train.vocab import read_vocab

log = logging.getLogger(__name__)


@dataclass
class TrainJob:
    """Everything one training run reads and writes (JSON-able: torchrun workers get it as a file)."""

    target_dir: str
    vocab_path: str
    train_shards: list[str]
    val_shards: list[str]
    draft_dir: str
    metrics_path: str
    checkpoint_dir: str
    settings: TrainSettings = field(default_factory=TrainSettings)
    trust_remote_code: bool = False

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "settings": self.settings.to_dict()}, indent=2)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> TrainJob:
        data = read_json(path)
        data["settings"] = TrainSettings.from_config(data["settings"])
        return cls(**data)


# ------------------------------------------------------------------ setup helpers
@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_placement(device: str) -> Placement:
    """Start torch.distributed when torchrun launched us; pick this process's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but torch sees no CUDA device")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        chosen = torch.device("cuda", local_rank)
    else:
        chosen = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Placement(dist.get_rank() if world_size > 1 else 0, world_size, chosen)


def lr_factor(step: int, settings: TrainSettings, total_steps: int) -> float:
    """Linear warm-up, then cosine or linear decay to zero (or constant)."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.scheduler == "none":
        return 1.0
    progress = (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps)
    progress = min(1.0, progress)
    if settings.scheduler == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def loss_implementation(settings: TrainSettings) -> str:
    """auto = eager: speculators' fused (Triton) losses need Triton and crash under torch.compile
    on torch 2.11 (two kernels share one autotune list), and eager measured within 3 % of them."""
    return "eager" if settings.loss_implementation == "auto" else settings.loss_implementation


def build_optimizers(model: torch.nn.Module, settings: TrainSettings) -> list:
    """speculators' optimizer choice (AdamW, or Muon for matrices + AdamW for the rest)."""
    from speculators.train.optimizers import build_optimizers as speculators_optimizers

    options = SimpleNamespace(
        optimizer=settings.optimizer,
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        muon_lr=settings.lr,
        muon_momentum=0.95,
        muon_weight_decay=settings.weight_decay,
        muon_ns_steps=5,
        muon_adjust_lr_fn="match_rms_adamw",
    )
    return speculators_optimizers(model, options)


def reduce_sum(metrics: dict[str, torch.Tensor], placement: Placement) -> dict[str, float]:
    """Sum speculators' counted metrics (``*_sum`` / ``*_total``) over ranks; to floats."""
    keys = sorted(metrics)
    stacked = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
    if placement.world_size > 1:
        dist.all_reduce(stacked)
    return dict(zip(keys, stacked.tolist(), strict=True))


def autocast(device: torch.device):
    # bf16 autocast on GPUs (speculators' default); exact fp32 on the CPU.
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------ evaluation
def counted_keys(ttt_steps: int) -> list[str]:
    """Every counted metric speculators' forward returns (a rank without val batches sends zeros)."""
    names = ["loss"] + [
        f"{m}_{k}" for k in range(ttt_steps) for m in ("loss", "full_acc", "cond_acc")
    ]
    return [f"{name}_{part}" for name in names for part in ("sum", "total")]


@torch.no_grad()
def evaluate(model, shards: ShardSet, job: TrainJob, placement: Placement, call_kwargs) -> dict:
    """Counted metrics over the whole val set (each rank its share, summed over ranks)."""
    settings = job.settings
    model.eval()
    totals = dict.fromkeys(counted_keys(settings.ttt_steps), 0.0)
    batches = val_batches(shards, settings.tokens_per_batch, placement.rank, placement.world_size)
    for refs in batches:
        batch = collate(
            shards, refs, settings.tokens_per_batch, hidden_dtype(placement), pad_batches(placement)
        )
        with autocast(placement.device):
            _, _, metrics = model(**to_device(batch, placement), **call_kwargs)
        for key in totals:
            totals[key] += float(metrics[key])
    model.train()
    if placement.world_size > 1:
        device_totals = {k: torch.tensor(v, device=placement.device) for k, v in totals.items()}
        totals = reduce_sum(device_totals, placement)
    return totals


def hidden_dtype(placement: Placement) -> torch.dtype:
    # The store holds bf16; the CPU model trains in fp32.
    return torch.bfloat16 if placement.device.type == "cuda" else torch.float32


def pad_batches(placement: Placement) -> bool:
    # Fixed shapes for torch.compile on GPUs; on the CPU padding would only cost time.
    return placement.device.type == "cuda"


def train_batches(
    plan: TrainPlan,
    shards: ShardSet,
    start: int,
    end: int,
    settings: TrainSettings,
    placement: Placement,
) -> Iterator[dict[str, torch.Tensor]]:
    """The batches of steps ``start .. end - 1``, in order, on the training device.

    On GPUs the next step's batch is read, packed, pinned and copied to the GPU on a side stream
    in a background thread while the current step runs. Done inline, the reads and the copy
    (about 270 MB a step for an 8B-shaped target) left the GPU idle between steps.
    """

    def make(step: int) -> dict[str, torch.Tensor]:
        return collate(
            shards,
            plan.batch(step, placement.rank),
            settings.tokens_per_batch,
            hidden_dtype(placement),
            pad_batches(placement),
        )

    if placement.device.type != "cuda":
        for step in range(start, end):
            yield make(step)
        return
    copy_stream = torch.cuda.Stream(placement.device)

    def make_on_device(step: int) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        pinned = {k: v.pin_memory() for k, v in make(step).items()}
        with torch.cuda.stream(copy_stream):
            batch = {k: v.to(placement.device, non_blocking=True) for k, v in pinned.items()}
            ready = torch.cuda.Event()
            ready.record(copy_stream)
        return batch, ready

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches") as pool:
        pending = pool.submit(make_on_device, start) if start < end else None
        for step in range(start, end):
            batch, ready = pending.result()
            compute = torch.cuda.current_stream(placement.device)
            compute.wait_event(ready)
            for value in batch.values():
                # Memory made on the copy stream: keep it alive until the step's kernels finish.
                value.record_stream(compute)
            pending = pool.submit(make_on_device, step + 1) if step + 1 < end else None
            yield batch


def to_device(batch: dict[str, torch.Tensor], placement: Placement) -> dict[str, torch.Tensor]:
    return {k: v.to(placement.device, non_blocking=True) for k, v in batch.items()}


# ------------------------------------------------------------------ the run
def train(job: TrainJob) -> dict | None:
    """Train (resuming from a matching checkpoint) and export; rank 0 returns the summary."""
    settings = job.settings
    placement = init_placement(settings.device)
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)

    train_shards = ShardSet(job.train_shards)
    val_shards = ShardSet(job.val_shards)
    d2t, t2d = read_vocab(job.vocab_path)
    attn_impl = resolve_attn_impl(settings.attn_impl, placement.device)
    model = build_draft_model(
        job.target_dir,
        train_shards.aux_layer_ids,
        d2t,
        t2d,
        num_layers=settings.num_layers,
        ttt_steps=settings.ttt_steps,
        attn_impl=attn_impl,
        trust_remote_code=job.trust_remote_code,
    ).to(placement.device)
    raw_model = model
    optimizers = build_optimizers(model, settings)

    from speculators.losses import resolve_loss_config

    call_kwargs = {
        "ttt_steps": settings.ttt_steps,
        "ttt_step_loss_decay": settings.ttt_step_loss_decay,
        "loss_config": resolve_loss_config(settings.loss, loss_implementation(settings)),
    }
    plan = TrainPlan(
        train_shards,
        settings.tokens_per_batch,
        settings.epochs,
        settings.seed,
        placement.world_size,
        settings.max_steps,
    )
    identity = {
        "fingerprint": settings.fingerprint(),
        "world_size": placement.world_size,
        "train_shards": [shard_digest(d) for d in job.train_shards],
    }
    start = resume(job, model, optimizers, identity, placement)

    metrics_log = MetricsLog(job.metrics_path, enabled=placement.is_main, keep_before=start)
    if placement.world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[placement.device.index] if placement.device.type == "cuda" else None,
            # The only buffers (d2t, t2d) never change.
            broadcast_buffers=False,
        )
    if placement.is_main:
        log.info(
            "training %d steps from step %d on %s x%d (attention %s, loss %s/%s); "
            "%d train samples in %d shard(s), %d val samples",
            plan.total_steps,
            start,
            placement.device,
            placement.world_size,
            attn_impl,
            settings.loss,
            loss_implementation(settings),
            len(train_shards.samples),
            len(job.train_shards),
            len(val_shards.samples),
        )

    def validate(step: int) -> dict:
        # The bare model: validation needs no gradient sync, and ranks may see unequal batches.
        counted = evaluate(raw_model, val_shards, job, placement, call_kwargs)
        record = summarize("val", step, counted, settings.ttt_steps)
        metrics_log.write(record)
        if placement.is_main:
            acc = " ".join(f"{a:.3f}" for a in record["full_acc"])
            log.info("step %d val loss %.4f acc %s", step, record["loss"], acc)
        return record

    if start == 0:
        validate(0)
    model.train()
    end = plan.total_steps
    progress = tqdm(
        range(start, end),
        desc="train",
        mininterval=5,
        disable=not placement.is_main,
        initial=start,
        total=end,
    )
    last_val: dict | None = None
    batches = train_batches(plan, train_shards, start, end, settings, placement)
    for step in progress:
        started = time.perf_counter()
        factor = lr_factor(step, settings, plan.total_steps)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * factor
        batch = next(batches)
        with autocast(placement.device):
            _, loss, metrics = model(**batch, **call_kwargs)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), settings.grad_clip)
        for optimizer in optimizers:
            optimizer.step()
        metrics["tokens_sum"] = (batch["document_ids"] >= 0).sum().float()
        counted = reduce_sum(metrics, placement)
        seconds = time.perf_counter() - started
        record: StepMetrics = summarize("train", step + 1, counted, settings.ttt_steps)
        record.update(
            epoch=plan.position(step)[0],
            lr=settings.lr * factor,
            grad_norm=float(grad_norm),
            tokens=int(counted["tokens_sum"]),
            tokens_per_s=counted["tokens_sum"] / seconds,
        )
        metrics_log.write(record)
        done = step + 1
        if placement.is_main and (done % settings.log_every == 0 or done == end):
            log.info(
                "step %d/%d loss %.4f acc %s lr %.2e %.0f tok/s",
                done,
                end,
                record["loss"],
                " ".join(f"{a:.3f}" for a in record["full_acc"]),
                record["lr"],
                record["tokens_per_s"],
            )
        if done % settings.eval_every == 0 or done == end:
            last_val = validate(done)
        if done % settings.checkpoint_every == 0 and done < end:
            if placement.is_main:
                save_checkpoint(
                    job.checkpoint_dir,
                    done,
                    trainable_state(raw_model),
                    optimizers,
                    {**identity, "epoch": plan.position(step)[0]},
                    settings.keep_checkpoints,
                )
            if placement.world_size > 1:
                dist.barrier()
    progress.close()
    batches.close()

    summary = None
    if placement.is_main:
        summary = {
            "steps": plan.total_steps,
            "epochs": plan.position(end - 1)[0] + 1,
            "train_samples": len(train_shards.samples),
            "train_tokens": sum(r.num_tokens for r in train_shards.samples),
            "val_samples": len(val_shards.samples),
            "val": last_val,
            "world_size": placement.world_size,
            "device": placement.device.type,
        }
        export_draft(raw_model, job, summary)
    if placement.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def shard_digest(shard_dir: str) -> str:
    """The sha256 of a shard's index: changes whenever its samples do."""
    return read_json(Path(shard_dir) / "manifest.json")["files"]["index.json"]


def resume(job: TrainJob, model, optimizers, identity: dict, placement: Placement) -> int:
    """Load the newest checkpoint written under the same settings and data; return its step."""
    path = latest_checkpoint(job.checkpoint_dir)
    if path is None:
        return 0
    state = read_json(path / "state.json")
    mismatched = [k for k in identity if state.get(k) != identity[k]]
    if mismatched:
        if placement.is_main:
            log.warning("discarding checkpoints in %s: %s changed", job.checkpoint_dir, mismatched)
            shutil.rmtree(job.checkpoint_dir)
        if placement.world_size > 1:
            dist.barrier()
        return 0
    load_checkpoint(path, model, optimizers)
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])
