"""Training as a chain of links (extract.mode: streamed): each link's data, resume and record.

A link trains the steps of one (epoch, shard) of the by_shard plan (``TrainPlan.span``), reading
that shard's capture only; it resumes from the checkpoint the previous link saved at its last
step (or from its own, if it was killed) and saves one at its own last step. The checkpoints
and the metrics history live in the checkpoint directory, which is no rule's output, as in the
stored mode (``checkpoint.py``). The final ``train`` job exports the draft from the last
link's checkpoint (:func:`export_chain`).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from draftflow.io import atomic_write_text, read_json, sha256_file
from draftflow.train.captures import CaptureSet, ShardLengths
from draftflow.train.checkpoint import (
    COMPLETE,
    load_checkpoint,
    mark_complete,
    metrics_history,
    step_dir_name,
)
from draftflow.train.distributed import Placement
from draftflow.train.job import TrainJob
from draftflow.train.stream import Link, link_chain, read_stream_plan, write_marker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkData:
    """A link's place in the chain, the planned lengths of every shard, and its one capture."""

    link: Link
    planned: ShardLengths
    captures: CaptureSet
    digest: str


def link_data(job: TrainJob) -> LinkData:
    """The link of ``job`` and its data, with its capture checked against the plan."""
    assert job.link is not None and job.stream_plan is not None
    plan = read_stream_plan(job.stream_plan)
    lengths = plan["lengths"]
    settings = job.settings
    link = link_chain(len(lengths), settings.epochs, settings.seed)[job.link]
    if len(job.train_shards) != 1:
        raise ValueError(f"link {job.link} takes one capture, got {job.train_shards}")
    captures = CaptureSet(job.train_shards, shard_ids=[link.shard])
    if captures.lengths[0] != lengths[link.shard]:
        raise ValueError(
            f"{job.train_shards[0]} holds samples of {captures.lengths[0][:8]}... tokens, but the "
            f"stream plan {job.stream_plan} planned shard {link.shard} with "
            f"{lengths[link.shard][:8]}...: the capture is not of the planned shard"
        )
    return LinkData(link, ShardLengths(lengths), captures, plan["digest"])


def _step_dirs(root: Path) -> dict[int, Path]:
    found = {}
    for path in root.glob("step-*"):
        if (path / "state.json").is_file():
            found[int(path.name.removeprefix("step-"))] = path
    return found


def resume_link(
    job: TrainJob,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    identity: dict,
    placement: Placement,
    start: int,
    end: int,
) -> int:
    """Load the newest checkpoint of steps ``start .. end`` saved under ``identity``; its step.

    The first link starts from scratch when none is there (checkpoints of other settings or
    data, or of a chain that finished, are removed). A later link needs one: the previous
    link's, at ``start``. Checkpoints after ``end`` belong to a chain being redone from here
    and are removed, so that keeping the newest checkpoints never drops this link's.
    """
    root = Path(job.checkpoint_dir)
    finished = (root / COMPLETE).is_file()
    found = {
        step: path
        for step, path in _step_dirs(root).items()
        if start <= step <= end
        and all(read_json(path / "state.json").get(k) == v for k, v in identity.items())
    }
    later = [path for step, path in _step_dirs(root).items() if step > end]
    if placement.world_size > 1:  # every rank decides before rank 0 removes anything
        dist.barrier()
    if start == 0 and (finished or not found):
        if placement.is_main and root.exists():
            if finished or _step_dirs(root):
                log.warning("link %d: discarding checkpoints in %s; training from scratch", 0, root)
            shutil.rmtree(root)
        if placement.world_size > 1:
            dist.barrier()
        return 0
    if not found:
        raise RuntimeError(
            f"link {job.link} starts at step {start}, but {root} holds no checkpoint of steps "
            f"{start}..{end} saved under these settings and data: the previous link's checkpoint "
            "is gone. Rerun the chain from its first link (snakemake --forcerun train_link)."
        )
    if placement.is_main:
        for path in later:
            log.warning("link %d: removing %s, a checkpoint after this link", job.link, path)
            shutil.rmtree(path)
        # The previous chain's end: this one is not finished until its export.
        (root / COMPLETE).unlink(missing_ok=True)
    if placement.world_size > 1:
        dist.barrier()
    step = max(found)
    state = load_checkpoint(found[step], model, optimizers)
    log.info("link %d: resumed from %s (step %d)", job.link, found[step], state["step"])
    return int(state["step"])


def finish_link(job: TrainJob, data: LinkData, start: int, end: int, placement: Placement) -> dict:
    """The link's marker: its steps and the digest of the weights it ends with."""
    checkpoint = Path(job.checkpoint_dir) / step_dir_name(end) / "model.safetensors"
    record = {
        "link": data.link.index,
        "epoch": data.link.epoch,
        "shard": data.link.shard,
        "start": start,
        "end": end,
        "steps": end - start,
        "weights_sha256": sha256_file(checkpoint) if checkpoint.is_file() else None,
        "world_size": placement.world_size,
        "device": placement.device.type,
        "stream_plan": data.digest,
    }
    assert job.marker_path is not None
    write_marker(job.marker_path, record)
    return record


def export_chain(job: TrainJob, last_marker: str) -> dict:
    """The draft and metrics.jsonl from the last link's checkpoint (the streamed ``train`` job):
    the same files the stored mode's training job writes at its end."""
    from draftflow.train.export import export_draft
    from draftflow.train.metrics import last_val, read_metrics
    from draftflow.train.model import draft_for_job, resolve_attn_impl
    from draftflow.train.optim import build_optimizers

    settings = job.settings
    marker = read_json(last_marker)
    root = Path(job.checkpoint_dir)
    checkpoint = root / step_dir_name(marker["end"])
    if sha256_file(checkpoint / "model.safetensors") != marker["weights_sha256"]:
        raise RuntimeError(
            f"{checkpoint} is not the checkpoint the last link ({last_marker}) saved: rerun it"
        )
    torch.manual_seed(settings.seed)
    val_shards = CaptureSet(job.val_shards)
    attn_impl = resolve_attn_impl(settings.attn_impl, torch.device("cpu"))
    model = draft_for_job(job, val_shards.aux_layer_ids, attn_impl)
    load_checkpoint(checkpoint, model, build_optimizers(model, settings, torch.device("cpu")))
    history = metrics_history(root)
    records = read_metrics(history)
    plan = read_stream_plan(job.stream_plan) if job.stream_plan else None
    summary = {
        "steps": marker["end"],
        "epochs": marker["epoch"] + 1,
        "train_samples": plan["num_samples"] if plan else None,
        "train_tokens": plan["num_tokens"] if plan else None,
        "val_samples": len(val_shards.samples),
        "val": last_val(history),
        "world_size": marker["world_size"],
        "device": marker["device"],
        "links": marker["link"] + 1,
    }
    export_draft(model, job, summary)
    atomic_write_text(job.metrics_path, history.read_text())
    mark_complete(root, marker["end"])
    log.info(
        "exported the draft of %d links, %d steps, %d records",
        marker["link"] + 1,
        marker["end"],
        len(records),
    )
    return summary
