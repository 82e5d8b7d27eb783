"""The report stage: ``summary.csv``, ``summary.md`` and the figures, from files on disk.

Inputs are the bench CSVs and units tables, the trainer's ``metrics.jsonl``, the exported draft and the target
checkpoint directories, and the capture stores' manifests (for the training data size). Any
of the descriptive inputs may lack fields; the summary then says "unknown" instead of failing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from draftflow.bench.schedule import ONE_AT_A_TIME
from draftflow.io import atomic_path, atomic_write_text
from draftflow.report import plots
from draftflow.report.summary import (
    WITH_INTERVALS,
    Bootstrap,
    best_k,
    read_bench_tables,
    summarise,
    where_the_time_goes,
)
from draftflow.report.train_log import final_accuracy, last_step, read_train_log


@dataclass(frozen=True)
class ReportPaths:
    """Where the report stage writes (the rule's outputs)."""

    summary: str | Path
    markdown: str | Path
    acceptance_length: str | Path
    acceptance_per_pos: str | Path
    speedup: str | Path
    train_loss: str | Path
    train_accuracy: str | Path


def _ties(row: Any) -> str:
    """How many of a configuration's differences the plain target measured as near-ties."""
    ties = getattr(row, "num_near_ties", None)
    return "" if ties is None or pd.isna(ties) else f" ({int(ties)} near-tie(s))"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def describe_target(target_dir: str | Path) -> str:
    target_dir = Path(target_dir)
    config = _read_json(target_dir / "config.json")
    info = _read_json(target_dir / "draftflow_target.json")
    origin = info.get("origin") or info.get("source")
    arch = ", ".join(config.get("architectures", [])) or "unknown architecture"
    shape = (
        f"{config.get('num_hidden_layers', '?')} layers, hidden {config.get('hidden_size', '?')}, "
        f"vocab {config.get('vocab_size', '?')}"
    )
    described = f"{arch} ({shape})" + (f", from `{origin}`" if origin else "")
    name = target_name(info.get("origin") or config.get("_name_or_path") or "")
    return f"{name}: {described}" if name else described


def target_name(origin: str) -> str:
    """The model's name from where the target came from: a GGUF file's stem, a checkpoint's
    folder or hub id (``gguf:/m/SmolLM2-135M-Instruct-Q8_0.gguf`` -> ``SmolLM2-135M-Instruct-Q8_0``)."""
    kind, _, rest = origin.partition(":")
    path = rest if kind in ("gguf", "hf") and rest else origin
    path = path.rstrip("/")
    if not path:
        return ""
    return Path(path).stem if path.endswith(".gguf") else Path(path).name


def describe_draft(draft_dir: str | Path) -> str:
    config = _read_json(Path(draft_dir) / "config.json")
    if not config:
        return "unknown (no config.json)"
    layer = config.get("transformer_layer_config", {})
    return (
        f"{config.get('speculators_model_type', 'unknown type')}, "
        f"{layer.get('num_hidden_layers', '?')} layer(s), "
        f"draft vocab {config.get('draft_vocab_size', '?')}, "
        f"aux layers {config.get('eagle_aux_hidden_state_layer_ids', '?')}"
    )


def data_size(extract_dirs: Iterable[str | Path]) -> dict[str, dict[str, int]]:
    """Samples and tokens per split, summed over the capture stores' manifests."""
    sizes: dict[str, dict[str, int]] = {}
    for directory in extract_dirs:
        directory = Path(directory)
        manifest = _read_json(directory / "manifest.json")
        split = directory.parent.name
        entry = sizes.setdefault(split, {"samples": 0, "tokens": 0})
        entry["samples"] += int(manifest.get("num_samples", 0))
        entry["tokens"] += int(manifest.get("num_tokens", 0))
    return sizes


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _fmt_bounded(row: Any, name: str, digits: int = 2) -> str:
    """``point [low, high]``, or the point alone where no interval was measured."""
    point, low, high = (getattr(row, f) for f in (name, f"{name}_low", f"{name}_high"))
    if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in (low, high)):
        return _fmt(point, digits)
    return f"{_fmt(point, digits)} [{_fmt(low, digits)}, {_fmt(high, digits)}]"


def _best_cell(row: Any) -> str:
    if row.named_best:
        return str(row.k)
    tied = ", ".join(f"k={k}" for k in str(row.tied).split(","))
    return f"tie: {tied}"


def render_markdown(
    summary: pd.DataFrame,
    train_log: pd.DataFrame,
    target: str,
    draft: str,
    sizes: dict[str, dict[str, int]],
    bootstrap: Bootstrap,
    schedule: str,
) -> str:
    lines = ["# draftflow summary", "", f"- Target: {target}", f"- Draft: {draft}"]
    if sizes:
        parts = [
            f"{split} {v['samples']} samples / {v['tokens']} tokens" for split, v in sizes.items()
        ]
        lines.append("- Training data: " + ", ".join(parts))
    else:
        lines.append("- Training data: unknown")
    steps = last_step(train_log)
    lines.append(f"- Training steps: {steps if steps is not None else 'unknown'}")
    phase, accuracy = final_accuracy(train_log)
    if accuracy:
        label = "Validation" if phase == "eval" else "Training (no eval records)"
        values = ", ".join(f"pos {p + 1}: {v:.3f}" for p, v in sorted(accuracy.items()))
        lines.append(f"- {label} accuracy per draft position (last step): {values}")
        # Position i's accuracy is the share of steps whose first i+1 draft tokens all match,
        # so the expected acceptance length at k is 1 + the sum of the first k accuracies.
        predicted = ", ".join(
            f"k={k}: {1 + sum(accuracy[p] for p in range(k)):.2f}"
            for k in range(1, len(accuracy) + 1)
            if all(p in accuracy for p in range(k))
        )
        lines.append(f"- Acceptance length these accuracies predict: {predicted}")
    else:
        lines.append("- Validation accuracy per draft position: unknown")

    level = f"{100 * bootstrap.confidence:g} %"
    measured = summary["speedup_low"].notna().any()
    lines += ["", "## Best k per prompt set", ""]
    if measured:
        lines += [
            f"Figures in brackets are {level} confidence intervals: a bootstrap over the timed "
            f"prompts and rounds ({bootstrap.samples} resamples, seed {bootstrap.seed}), each "
            "speed-up a ratio of times measured on the same prompts in the same rounds. A k is "
            "named best only where its speed-up interval lies above every other k's; otherwise "
            "the k whose intervals reach the leader's tie.",
            "",
        ]
        if schedule == ONE_AT_A_TIME:
            lines += [
                "The engines ran one at a time (`bench.schedule`), not side by side: a change "
                "in the machine's speed from one engine's turn to the next enters the speed-ups, "
                "and the intervals do not cover it.",
                "",
            ]
    best = best_k(summary)
    if best.empty:
        lines.append("No speculative run to compare.")
    else:
        lines += [
            "| prompt set | temperature | best k | acceptance length τ | speed-up | outputs identical |",
            "|---|---|---|---|---|---|",
        ]
        for row in best.itertuples():
            lines.append(
                f"| {row.dataset} | {row.temperature:g} | {_best_cell(row)} "
                f"| {_fmt_bounded(row, 'acceptance_length')} | {_fmt_bounded(row, 'speedup')} "
                f"| {_fmt(row.outputs_identical)} |"
            )

    lines += ["", "## All configurations", ""]
    columns = [
        "dataset",
        "k",
        "acceptance_length",
        "acceptance_rate",
        "tokens_per_s",
        "tpot_ms",
        "speedup",
        "outputs_identical",
        "num_requests_differ",
    ]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in summary.itertuples(index=False):
        cells = [
            _fmt_bounded(row, c) if c in WITH_INTERVALS else _fmt(getattr(row, c)) for c in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")

    differing = summary[pd.to_numeric(summary["num_requests_differ"], errors="coerce") > 0]
    if not differing.empty:
        lines += [
            "",
            "**Outputs differ from the plain target (greedy):** "
            + ", ".join(
                f"{r.dataset} k={r.k}: {r.num_requests_differ} request(s)" + _ties(r)
                for r in differing.itertuples()
            )
            + ". See the bench CSV's `first_difference` and `lossless` columns. The verify pass"
            " (k + 1 tokens at once) rounds differently from a plain decode step, so near-ties"
            " between two tokens can flip: in bf16, and on GPUs in float32 too (their kernels do"
            " not keep float32's last bits). The plain target measured its own margin at each"
            " difference (`bench.tie_margin`): a near-tie is a few hundredths of a logit, a"
            " defect picks a token the target ranks far below its best. On the CPU build"
            " `bench.dtype: float32` checks the algorithm strictly.",
        ]

    lines += ["", "## Where the time goes", ""]
    explained = where_the_time_goes(summary)
    lines += [
        "Cost of a speculative step in plain steps = (plain tokens/s ÷ speculative tokens/s) × τ; "
        "a draft pays off only where τ exceeds that cost.",
        "",
        *(explained or ["No speculative run measured."]),
    ]
    return "\n".join(lines) + "\n"


def build_report(
    bench_csvs: Iterable[str | Path],
    train_metrics: str | Path,
    target_dir: str | Path,
    draft_dir: str | Path,
    extract_dirs: Iterable[str | Path],
    out: ReportPaths,
    bootstrap: Bootstrap,
    unit_csvs: Iterable[str | Path] | None = None,
    *,
    schedule: str,
) -> pd.DataFrame:
    """Write every report output; return the summary table. ``unit_csvs`` (the bench units
    tables) give the figures their confidence intervals; ``schedule`` is how the bench's
    engines ran (``draftflow.bench.schedule.bench_schedule`` of the config's bench section)."""
    units = read_bench_tables(unit_csvs) if unit_csvs is not None else None
    summary = summarise(read_bench_tables(bench_csvs), units, bootstrap)
    train_log = read_train_log(train_metrics)
    with atomic_path(out.summary) as tmp:
        summary.to_csv(tmp, index=False)
    markdown = render_markdown(
        summary,
        train_log,
        describe_target(target_dir),
        describe_draft(draft_dir),
        data_size(extract_dirs),
        bootstrap,
        schedule,
    )
    atomic_write_text(out.markdown, markdown)
    plots.plot_acceptance_length(summary, out.acceptance_length)
    phase, accuracy = final_accuracy(train_log)
    plots.plot_acceptance_per_position(
        summary, out.acceptance_per_pos, accuracy if phase == "eval" else None
    )
    plots.plot_speedup(summary, out.speedup)
    plots.plot_training(train_log, out.train_loss, out.train_accuracy)
    return summary
