"""Report figures (matplotlib, Agg backend, PNG)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the workers
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import MaxNLocator

from draftflow.io import atomic_path


def _save(figure: plt.Figure, out: str | Path) -> None:
    figure.tight_layout()
    with atomic_path(out) as tmp:
        figure.savefig(tmp, format="png", dpi=120)
    plt.close(figure)


def _label(dataset: str, temperature: float) -> str:
    return dataset if temperature == 0 else f"{dataset} (T={temperature:g})"


def _error_bars(group: pd.DataFrame, name: str) -> list[list[float]] | None:
    """Distances from the point to the interval's bounds, for ``yerr`` (None if unmeasured)."""
    low, high = f"{name}_low", f"{name}_high"
    if low not in group or group[low].isna().any() or group[high].isna().any():
        return None
    return [
        list((group[name] - group[low]).clip(lower=0)),
        list((group[high] - group[name]).clip(lower=0)),
    ]


def plot_acceptance_length(summary: pd.DataFrame, out: str | Path) -> None:
    """Mean acceptance length τ against k (with its interval where measured), and the ideal
    τ = k + 1 for reference."""
    figure, axes = plt.subplots(figsize=(5, 3.5))
    spec = summary[summary["k"] > 0]
    for (dataset, temperature), group in spec.groupby(["dataset", "temperature"]):
        group = group.sort_values("k")
        axes.errorbar(
            group["k"],
            group["acceptance_length"],
            yerr=_error_bars(group, "acceptance_length"),
            marker="o",
            capsize=3,
            label=_label(dataset, temperature),
        )
    if not spec.empty:
        ks = sorted(spec["k"].unique())
        axes.plot(
            ks, [k + 1 for k in ks], linestyle=":", color="grey", label="every draft accepted"
        )
        axes.set_xticks(ks)
    axes.set_xlabel("speculative tokens per step (k)")
    axes.set_ylabel("mean acceptance length τ")
    axes.legend(fontsize="small")
    _save(figure, out)


def plot_acceptance_per_position(
    summary: pd.DataFrame, out: str | Path, train_accuracy: dict[int, float] | None = None
) -> None:
    """Share of drafts whose i-th token was accepted, one curve per (dataset, k).

    ``train_accuracy`` (position → accuracy on the training stage's validation data), when
    given, is drawn for comparison: it estimates the same share offline.
    """
    figure, axes = plt.subplots(figsize=(5, 3.5))
    for row in summary[summary["k"] > 0].itertuples():
        rates = json.loads(row.acceptance_per_pos) if row.acceptance_per_pos else []
        if rates:
            label = f"{_label(row.dataset, row.temperature)}, k={row.k}"
            axes.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    if train_accuracy:
        positions = sorted(train_accuracy)
        axes.plot(
            [p + 1 for p in positions],
            [train_accuracy[p] for p in positions],
            linestyle="--",
            color="black",
            marker="x",
            label="training validation",
        )
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance (share of drafts)")
    axes.set_ylim(0, 1)
    axes.legend(fontsize="small")
    _save(figure, out)


def plot_speedup(summary: pd.DataFrame, out: str | Path) -> None:
    """Speed-up over the plain target per k, bars grouped by prompt set, with the intervals
    as error bars where measured."""
    figure, axes = plt.subplots(figsize=(5, 3.5))
    spec = summary[summary["k"] > 0]
    groups = list(spec.groupby(["dataset", "temperature"]))
    ks = sorted(spec["k"].unique())
    width = 0.8 / max(len(ks), 1)
    for offset, k in enumerate(ks):
        rows = [group[group["k"] == k] for _, group in groups]
        values = [float(r["speedup"].iloc[0]) if not r.empty else 0.0 for r in rows]
        present = pd.concat([r for r in rows if not r.empty])
        bars = _error_bars(present, "speedup") if len(present) == len(rows) else None
        positions = [i + offset * width for i in range(len(groups))]
        axes.bar(positions, values, width=width, yerr=bars, capsize=3, label=f"k={k}")
    axes.axhline(1.0, color="grey", linestyle=":")
    axes.set_xticks([i + width * (len(ks) - 1) / 2 for i in range(len(groups))])
    axes.set_xticklabels([_label(*key) for key, _ in groups])
    axes.set_ylabel("speed-up over plain target")
    axes.legend(fontsize="small")
    _save(figure, out)


def plot_training(log: pd.DataFrame, loss_out: str | Path, accuracy_out: str | Path) -> None:
    """Training/eval loss and per-position accuracy against step (empty axes if no log)."""
    figure, axes = plt.subplots(figsize=(5, 3.5))
    for phase, group in log[log["metric"] == "loss"].groupby("phase"):
        group = group.sort_values("step")
        axes.plot(
            group["step"], group["value"], label=phase, marker="." if phase == "eval" else None
        )
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    else:
        axes.set_title("no loss records in metrics.jsonl")
    _save(figure, loss_out)

    figure, axes = plt.subplots(figsize=(5, 3.5))
    accuracy = log[log["metric"] == "accuracy"]
    for (phase, position), group in accuracy.groupby(["phase", "position"]):
        group = group.sort_values("step")
        style = "-" if phase == "train" else "--"
        axes.plot(group["step"], group["value"], style, label=f"{phase} pos {int(position) + 1}")
    axes.set_xlabel("step")
    axes.set_ylabel("draft-token accuracy")
    axes.set_ylim(0, 1)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    else:
        axes.set_title("no accuracy records in metrics.jsonl")
    _save(figure, accuracy_out)
