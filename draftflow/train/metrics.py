"""Named training metrics from speculators' counted ones, and the metrics.jsonl log.

speculators' ``Eagle3DraftModel.forward`` returns, per TTT step k, sums and totals:
``loss_{k}``, ``full_acc_{k}`` (share of masked positions whose draft tokens 0..k all match
the target's argmax) and ``cond_acc_{k}`` (step k correct among positions whose steps < k
were). Summing sums and totals over batches and ranks, then dividing, gives exact averages.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

StepMetrics = dict[str, Any]


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
    """Append-only JSONL; a resumed run first drops the records after its checkpoint."""

    def __init__(self, path: str | os.PathLike[str], enabled: bool, keep_before: int) -> None:
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if keep_before > 0 and self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip() and json.loads(line)["step"] <= keep_before:
                    kept.append(line)
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: StepMetrics) -> None:
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record, sort_keys=True) + "\n")


def read_metrics(path: str | os.PathLike[str]) -> list[StepMetrics]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
