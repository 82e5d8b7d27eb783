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
from draftflow.train.model import (
    build_draft_model,
    resolve_attn_impl,
    trainable_state,
    use_sync_free_accuracy,
)
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


def build_optimizers(
    model: torch.nn.Module, settings: TrainSettings, device: torch.device | None = None
) -> list:
    """speculators' optimizer choice (AdamW, or Muon for matrices + AdamW for the rest).

    On GPUs AdamW is the same optimizer with ``fused=True``: one kernel over all parameters
    instead of the foreach path's dozen passes over 1.2 GB of fp32 state for an 8B-shaped draft.
    The CPU keeps speculators' default implementation (bit-identical to earlier runs).
    """
    from speculators.train.optimizers import build_optimizers as speculators_optimizers

    if settings.optimizer == "adamw" and device is not None and device.type == "cuda":
        return [
            torch.optim.AdamW(
                model.named_parameters(),
                lr=settings.lr,
                weight_decay=settings.weight_decay,
                fused=True,
            )
        ]

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


def flush_interval(settings: TrainSettings, placement: Placement) -> int:
    """Steps between reads of the train metrics (see :class:`PendingSteps`)."""
    return settings.log_every if placement.device.type == "cuda" else 1


def reduce_sum(metrics: dict[str, torch.Tensor], placement: Placement) -> dict[str, float]:
    """Sum speculators' counted metrics (``*_sum`` / ``*_total``) over ranks; to floats."""
    keys = sorted(metrics)
    stacked = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
    if placement.world_size > 1:
        dist.all_reduce(stacked)
    return dict(zip(keys, stacked.tolist(), strict=True))


class PendingSteps:
    """Train steps whose metrics still sit on the device, turned into records at a flush.

    Reading a metric to the host waits for the GPU to finish the step. Doing that every step
    kept the CPU from queueing the next step's kernels while the GPU worked; on GPUs the loop
    flushes every ``log_every`` steps instead (one host sync and one all-reduce for all of
    them), on the CPU every step (nothing runs ahead there). Step times come from CUDA events
    recorded after each step (read at the flush, no wait), on the CPU from the wall clock.
    """

    def __init__(self, placement: Placement, ttt_steps: int) -> None:
        self.placement = placement
        self.ttt_steps = ttt_steps
        self.keys: list[str] | None = None
        self.counted: list[torch.Tensor] = []
        self.grad_norms: list[torch.Tensor] = []
        self.steps: list[tuple[int, int, float]] = []
        self.ends: list = []
        self.restart()

    def _now(self):
        if self.placement.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def restart(self) -> None:
        """Time the next step from now (after validation or a checkpoint, which are not steps)."""
        self.start = self._now()

    def add(
        self,
        step: int,
        epoch: int,
        lr: float,
        metrics: dict[str, torch.Tensor],
        grad_norm: torch.Tensor,
    ) -> None:
        keys = sorted(metrics)
        if self.keys is None:
            self.keys = keys
        elif keys != self.keys:
            raise RuntimeError(f"step {step} returned metrics {keys}, earlier steps {self.keys}")
        self.counted.append(torch.stack([metrics[k].detach().float().reshape(()) for k in keys]))
        self.grad_norms.append(grad_norm.detach().float().reshape(()))
        self.steps.append((step, epoch, lr))
        self.ends.append(self._now())

    def _seconds(self) -> list[float]:
        seconds, previous = [], self.start
        for end in self.ends:
            if isinstance(end, float):
                seconds.append(end - previous)
            else:
                end.synchronize()
                seconds.append(previous.elapsed_time(end) / 1000)
            previous = end
        self.start = previous
        return seconds

    def flush(self) -> list[StepMetrics]:
        """Records of the pending steps (the next step is timed from the last one's end)."""
        if not self.steps:
            return []
        assert self.keys is not None
        counted = torch.stack(self.counted)
        if self.placement.world_size > 1:
            dist.all_reduce(counted)
        # One transfer (one wait for the device) for everything.
        values = torch.cat([counted.flatten(), torch.stack(self.grad_norms)]).tolist()
        width = len(self.keys)
        records = []
        timed = zip(self.steps, self._seconds(), strict=True)
        for n, ((step, epoch, lr), seconds) in enumerate(timed):
            row = dict(zip(self.keys, values[n * width : (n + 1) * width], strict=True))
            record: StepMetrics = summarize("train", step, row, self.ttt_steps)
            record.update(
                epoch=epoch,
                lr=lr,
                grad_norm=values[len(self.steps) * width + n],
                tokens=int(row["tokens_sum"]),
                tokens_per_s=row["tokens_sum"] / seconds,
            )
            records.append(record)
        self.counted, self.grad_norms, self.steps, self.ends = [], [], [], []
        return records


def uses_bf16(device: torch.device, precision: str) -> bool:
    """train.precision: auto = bf16 autocast on GPUs (speculators' default), fp32 on the CPU."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast(device: torch.device, precision: str = "auto"):
    # bf16 matmuls with fp32 weights and optimizer state; on CPUs with AMX a bf16 GEMM of the
    # draft's shape ran 4-7x faster than in fp32 (docs/benchmarks.md, "Training").
    if uses_bf16(device, precision):
        return torch.autocast(device.type, dtype=torch.bfloat16)
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
    keys = counted_keys(settings.ttt_steps)
    # Summed on the device in float64 (what adding Python floats did): one host sync at the end.
    sums = torch.zeros(len(keys), dtype=torch.float64, device=placement.device)
    batches = val_batches(shards, settings.tokens_per_batch, placement.rank, placement.world_size)
    for refs in batches:
        batch = collate(
            shards,
            refs,
            settings.tokens_per_batch,
            hidden_dtype(placement, settings.precision),
            pad_batches(placement),
        )
        with autocast(placement.device, settings.precision):
            _, _, metrics = model(**to_device(batch, placement), **call_kwargs)
        sums += torch.stack([metrics[key].detach().reshape(()).double() for key in keys])
    totals = dict(zip(keys, sums.tolist(), strict=True))
    model.train()
    if placement.world_size > 1:
        device_totals = {k: torch.tensor(v, device=placement.device) for k, v in totals.items()}
        totals = reduce_sum(device_totals, placement)
    return totals


def hidden_dtype(placement: Placement, precision: str = "auto") -> torch.dtype:
    # The store holds bf16; a model trained in fp32 gets fp32 inputs.
    return torch.bfloat16 if uses_bf16(placement.device, precision) else torch.float32


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
            hidden_dtype(placement, settings.precision),
            pad=pad_batches(placement),
            pin=placement.device.type == "cuda",
        )

    if placement.device.type != "cuda":
        for step in range(start, end):
            yield make(step)
        return
    copy_stream = torch.cuda.Stream(placement.device)

    def make_on_device(step: int) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        pinned = {k: v if v.is_pinned() else v.pin_memory() for k, v in make(step).items()}
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
    use_sync_free_accuracy()
    optimizers = build_optimizers(model, settings, placement.device)

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
    pending = PendingSteps(placement, settings.ttt_steps)
    flush_every = flush_interval(settings, placement)
    for step in progress:
        factor = lr_factor(step, settings, plan.total_steps)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * factor
        batch = next(batches)
        with autocast(placement.device, settings.precision):
            _, loss, metrics = model(**batch, **call_kwargs)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), settings.grad_clip)
        for optimizer in optimizers:
            optimizer.step()
        metrics["tokens_sum"] = (batch["document_ids"] >= 0).sum().float()
        done = step + 1
        pending.add(done, plan.position(step)[0], settings.lr * factor, metrics, grad_norm)
        evaluate_now = done % settings.eval_every == 0 or done == end
        checkpoint_now = done % settings.checkpoint_every == 0 and done < end
        if not (done % flush_every == 0 or evaluate_now or checkpoint_now or done == end):
            continue
        records = pending.flush()
        for record in records:
            metrics_log.write(record)
        record = records[-1]
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
        if evaluate_now:
            last_val = validate(done)
        if checkpoint_now:
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
        if evaluate_now or checkpoint_now:
            pending.restart()
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
