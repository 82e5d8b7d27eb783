"""The training loop: speculators' EAGLE-3 model and losses, our data, checkpoints and logging.

``train()`` reads top to bottom: setup (devices, data, model, optimizer, resume), then one loop
of step -> log -> evaluate -> checkpoint, then export. The pieces live beside it: the run's
inputs (``job.py``), ranks and devices (``distributed.py``), optimizers and schedule
(``optim.py``), device batches (``batching.py``), metrics (``metrics.py``), checkpoints and
resume (``checkpoint.py``), the exported draft (``export.py``). docs/training.md says why this is our own
small loop rather than speculators' ``Trainer``.

A job of the streamed mode's chain (``job.link`` set, ``links.py``) runs the same loop over the
steps of its one (epoch, shard), from the previous link's checkpoint to its own, and exports
nothing: the chain's last checkpoint is exported by the ``train`` job.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from tqdm import tqdm

from draftflow.train.batching import (
    dequantize_on_host,
    hidden_dtype,
    pad_batches,
    to_device,
    train_batches,
)
from draftflow.train.captures import CaptureSet, TrainPlan, collate, val_batches
from draftflow.train.checkpoint import (
    mark_complete,
    metrics_history,
    resume,
    save_checkpoint,
    shard_digest,
)
from draftflow.train.distributed import Placement, autocast, init_placement, reduce_sum
from draftflow.train.export import export_draft
from draftflow.train.job import TrainJob
from draftflow.train.links import finish_link, link_data, resume_link
from draftflow.train.metrics import (
    MetricsLog,
    PendingSteps,
    counted_keys,
    flush_interval,
    summarize,
)
from draftflow.train.model import (
    draft_for_job,
    resolve_attn_impl,
    trainable_state,
    use_sync_free_accuracy,
)
from draftflow.train.optim import build_optimizers, lr_factor
from draftflow.train.settings import TrainSettings

log = logging.getLogger(__name__)


def loss_implementation(settings: TrainSettings) -> str:
    """auto = eager: speculators' fused (Triton) losses need Triton and crash under torch.compile
    on torch 2.11 (two kernels share one autotune list), and eager measured within 3 % of them."""
    return "eager" if settings.loss_implementation == "auto" else settings.loss_implementation


# ------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(model, shards: CaptureSet, job: TrainJob, placement: Placement, call_kwargs) -> dict:
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
            dequantize_states=dequantize_on_host(placement),
        )
        with autocast(placement.device, settings.precision):
            _, _, metrics = model(**to_device(batch, placement, settings.precision), **call_kwargs)
        sums += torch.stack([metrics[key].detach().reshape(()).double() for key in keys])
    totals = dict(zip(keys, sums.tolist(), strict=True))
    model.train()
    if placement.world_size > 1:
        device_totals = {k: torch.tensor(v, device=placement.device) for k, v in totals.items()}
        totals = reduce_sum(device_totals, placement)
    return totals


# ------------------------------------------------------------------ the run
def train(job: TrainJob) -> dict | None:
    """Train (resuming from a matching checkpoint) and export; rank 0 returns the summary
    (a link of the streamed chain: its marker record)."""
    settings = job.settings
    placement = init_placement(settings.device)
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)

    link = link_data(job) if job.link is not None else None
    if link is None:
        train_shards = CaptureSet(job.train_shards)
        planned = train_shards
        data_identity = [shard_digest(d) for d in job.train_shards]
    else:
        # Planned from every shard's lengths; only this link's shard is on disk.
        train_shards, planned, data_identity = link.captures, link.planned, link.digest
    val_shards = CaptureSet(job.val_shards)
    attn_impl = resolve_attn_impl(settings.attn_impl, placement.device)
    model = draft_for_job(job, train_shards.aux_layer_ids, attn_impl).to(placement.device)
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
        planned,
        settings.tokens_per_batch,
        settings.epochs,
        settings.seed,
        placement.world_size,
        settings.max_steps,
        settings.order,
    )
    identity = {
        "fingerprint": settings.fingerprint(),
        "world_size": placement.world_size,
        "train_shards": data_identity,
    }
    if link is None:
        start = resume(job, model, optimizers, identity, placement)
        end = plan.total_steps
        metrics_log = MetricsLog(
            job.metrics_path,
            enabled=placement.is_main,
            keep_before=start,
            history=metrics_history(job.checkpoint_dir),
        )
    else:
        first, end = plan.span(link.link.epoch, link.link.shard)
        start = resume_link(job, model, optimizers, identity, placement, first, end)
        # The links append to the history alone; the train job copies it out at the end.
        metrics_log = MetricsLog(
            metrics_history(job.checkpoint_dir), enabled=placement.is_main, keep_before=start
        )
    if placement.world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[placement.device.index] if placement.device.type == "cuda" else None,
            # The only buffers (d2t, t2d) never change.
            broadcast_buffers=False,
        )
    if placement.is_main:
        log.info(
            "training to step %d of %d from step %d on %s x%d (attention %s, loss %s/%s); "
            "%d train samples in %d shard(s), %d val samples",
            end,
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
        # A link validates and checkpoints at the steps the whole run would (by global step),
        # and checkpoints its own last step for the next link.
        evaluate_now = done % settings.eval_every == 0 or done == plan.total_steps
        checkpoint_now = done % settings.checkpoint_every == 0 and done < plan.total_steps
        checkpoint_now = checkpoint_now or (link is not None and done == end)
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
    if link is not None:
        if placement.is_main:
            summary = finish_link(job, link, start, end, placement)
        if placement.world_size > 1:
            dist.barrier()
            dist.destroy_process_group()
        return summary
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
        mark_complete(job.checkpoint_dir, plan.total_steps)
    if placement.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary
