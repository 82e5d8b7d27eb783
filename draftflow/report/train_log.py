"""Read the training stage's ``metrics.jsonl`` into one long table, tolerating missing fields.

The trainer writes one JSON object a line: training records (step, loss, per-position accuracy)
and evaluation records. The report needs only step, phase, loss and accuracy per draft position,
so this reader accepts the spellings trainers commonly use and ignores everything else:

- phase: ``phase``/``kind``/``split``/``type``/``mode`` (``eval``, ``val``, ``validation`` mean eval),
  or a ``val_``/``eval_`` prefix on the metric names;
- step: ``step``, ``global_step`` or ``iteration``;
- loss: ``loss`` (optionally prefixed ``train_``/``val_``/``eval_`` or ``train/`` ...);
- accuracy: a list under ``full_acc`` (draftflow's trainer: share of positions whose draft
  tokens 0..i all match the target), ``acc``/``accuracy``/``acc_per_pos``/``accuracy_per_pos``
  (index = draft position, 0-based) or scalar keys ending in a position number (``acc_0``,
  ``val/accuracy_pos1``); ``cond_acc`` (step i right given steps < i were) is kept as
  ``cond_accuracy``.

``full_acc`` is what vLLM's per-position acceptance measures, so 1 + sum(full_acc[:k]) predicts
the acceptance length at k.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

COLUMNS = ["step", "phase", "metric", "position", "value"]
EVAL_PHASES = {"eval", "val", "validation", "evaluation"}
_PREFIX = re.compile(r"^(train|val|eval|validation)[_/]")
_ACC_LISTS = {
    "full_acc": "accuracy",
    "acc": "accuracy",
    "accuracy": "accuracy",
    "acc_per_pos": "accuracy",
    "accuracy_per_pos": "accuracy",
    "accuracies": "accuracy",
    "cond_acc": "cond_accuracy",
}
_ACC_POS = re.compile(r"^(full_acc|cond_acc|acc|accuracy)[_/]?(?:pos|position)?[_/]?(\d+)$")


def _phase(record: dict[str, Any]) -> str:
    for key in ("phase", "kind", "split", "type", "mode"):
        value = record.get(key)
        if isinstance(value, str):
            return "eval" if value.lower() in EVAL_PHASES else "train"
    if any(k.startswith(("val_", "eval_", "val/", "eval/")) for k in record):
        return "eval"
    return "train"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def records_to_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Long table: one row per (step, phase, metric, position); loss has position -1."""
    rows: list[tuple[int, str, str, int, float]] = []
    for index, record in enumerate(records):
        step = record.get("step", record.get("global_step", record.get("iteration", index)))
        if _number(step) is None:
            continue
        phase = _phase(record)
        for key, value in record.items():
            name = _PREFIX.sub("", key)
            if name == "loss" and _number(value) is not None:
                rows.append((int(step), phase, "loss", -1, float(value)))
            elif name in _ACC_LISTS and isinstance(value, list):
                for position, item in enumerate(value):
                    if _number(item) is not None:
                        rows.append((int(step), phase, _ACC_LISTS[name], position, float(item)))
            elif (match := _ACC_POS.match(name)) and _number(value) is not None:
                metric = _ACC_LISTS[match.group(1)]
                rows.append((int(step), phase, metric, int(match.group(2)), float(value)))
    return pd.DataFrame(rows, columns=COLUMNS)


def read_train_log(path: str | Path) -> pd.DataFrame:
    """The long table for ``metrics.jsonl``; empty (with the columns) if the file is missing."""
    path = Path(path)
    if not path.exists():
        return pd.DataFrame(columns=COLUMNS)
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interrupted writer
            if isinstance(record, dict):
                records.append(record)
    return records_to_frame(records)


def final_accuracy(log: pd.DataFrame) -> tuple[str | None, dict[int, float]]:
    """(phase, accuracy per draft position) at the last eval step, else the last train step."""
    accuracy = log[log["metric"] == "accuracy"]
    for phase in ("eval", "train"):
        rows = accuracy[accuracy["phase"] == phase]
        if not rows.empty:
            last = rows[rows["step"] == rows["step"].max()]
            values = zip(last["position"], last["value"], strict=True)
            return phase, {int(p): float(v) for p, v in values}
    return None, {}


def last_step(log: pd.DataFrame) -> int | None:
    return None if log.empty else int(log["step"].max())
