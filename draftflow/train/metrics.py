"""Named training metrics from speculators' counted ones, their collection, and metrics.jsonl.

speculators' ``Eagle3DraftModel.forward`` returns, per TTT step k, sums and totals:
``loss_{k}``, ``full_acc_{k}`` (share of masked positions whose draft tokens 0..k all match
the target's argmax) and ``cond_acc_{k}`` (step k correct among positions whose steps < k
were). Summing sums and totals over batches and ranks, then dividing, gives exact averages.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from draftflow.io import atomic_write_text, explain_disk_full
from draftflow.train.distributed import Placement
from draftflow.train.settings import TrainSettings

StepMetrics = dict[str, Any]

log = logging.getLogger(__name__)


def _ratio(counted: dict[str, float], name: str) -> float:
    total = counted.get(f"{name}_total", 0.0)
    return counted.get(f"{name}_sum", 0.0) / total if total else 0.0


def summarize(kind: str, step: int, counted: dict[str, float], ttt_steps: int) -> StepMetrics:
    """One metrics.jsonl record: ``kind`` is "train" (one step) or "val" (the whole val set)."""
    per_step_loss = [_ratio(counted, f"loss_{k}") for k in range(ttt_steps)]
    return {
        "kind": kind,
        "step": step,
        "loss": sum(per_step_loss),
        "loss_per_step": per_step_loss,
        "full_acc": [_ratio(counted, f"full_acc_{k}") for k in range(ttt_steps)],
        "cond_acc": [_ratio(counted, f"cond_acc_{k}") for k in range(ttt_steps)],
        "positions": counted.get("full_acc_0_total", 0.0),
    }


class MetricsLog:
    """Append-only JSONL, written twice: the job's declared ``path`` and a ``history`` copy.

    Snakemake deletes a failed job's declared outputs before it reruns it, so the resumed run
    rebuilds ``path`` from the history, which lives beside the checkpoints (not an output):
    the records up to the resumed checkpoint's step are kept, later ones (written after it,
    before the kill) dropped; the run appends from there.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        enabled: bool,
        keep_before: int,
        history: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.history = Path(history) if history is not None else None
        self.enabled = enabled
        if not enabled:
            return
        kept: list[str] = []
        if keep_before > 0:
            source = self.history if self.history and self.history.exists() else self.path
            if source.exists():
                for line in source.read_text().splitlines():
                    record = _parsed(line)
                    if record is not None and record["step"] <= keep_before:
                        kept.append(line)
            restored = sum(1 for line in kept if json.loads(line)["kind"] == "train")
            if restored != keep_before:
                log.warning(
                    "%s holds %d train records up to step %d: the curves miss the others",
                    source,
                    restored,
                    keep_before,
                )
        text = "".join(line + "\n" for line in kept)
        for target in self._targets():
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(target, text)

    def _targets(self) -> list[Path]:
        return [self.path] if self.history is None else [self.path, self.history]

    def write(self, record: StepMetrics) -> None:
        if self.enabled:
            line = json.dumps(record, sort_keys=True) + "\n"
            for target in self._targets():
                with explain_disk_full(target), target.open("a", encoding="utf-8") as handle:
                    handle.write(line)


def _parsed(line: str) -> StepMetrics | None:
    """A record, or None for a blank line or the torn last line of a job killed mid-write."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def read_metrics(path: str | os.PathLike[str]) -> list[StepMetrics]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def last_val(path: str | os.PathLike[str]) -> StepMetrics:
    """The metrics log's last validation record (the trained draft's)."""
    val = [record for record in read_metrics(path) if record["kind"] == "val"]
    if not val:
        raise ValueError(f"{path}: the training metrics hold no val record")
    return val[-1]


def counted_keys(ttt_steps: int) -> list[str]:
    """Every counted metric speculators' forward returns (a rank without val batches sends zeros)."""
    names = ["loss"] + [
        f"{m}_{k}" for k in range(ttt_steps) for m in ("loss", "full_acc", "cond_acc")
    ]
    return [f"{name}_{part}" for name in names for part in ("sum", "total")]


def flush_interval(settings: TrainSettings, placement: Placement) -> int:
    """Steps between reads of the train metrics (see :class:`PendingSteps`)."""
    return settings.log_every if placement.device.type == "cuda" else 1


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
