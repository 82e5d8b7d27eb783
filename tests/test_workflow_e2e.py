"""The whole workflow on tests/configs/tiny.yaml: bench and report outputs of one real run.

The ``tiny_pipeline`` fixture (conftest.py) runs ``snakemake --cores 2`` to ``rule all`` once
per session: ingest, tokenize, split, shard, extract (vLLM hooks), vocab, training of a
1-layer draft on the tiny corpus, the benchmark (plain target and k = 1, 2 in float32 on
prompts from the training conversations) and the report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from draftflow.report.html import REPORT_FIGURES, build_html_report

pytestmark = [pytest.mark.workflow, pytest.mark.vllm]

SUMMARY_COLUMNS = [
    "dataset",
    "k",
    "acceptance_length",
    "acceptance_rate",
    "tokens_per_s",
    "speedup",
    "outputs_identical",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def summary(tiny_pipeline: Path) -> pd.DataFrame:
    return pd.read_csv(tiny_pipeline / "results" / "summary.csv")


def test_summary_has_every_k_with_every_cell_filled(summary: pd.DataFrame) -> None:
    assert set(SUMMARY_COLUMNS) <= set(summary.columns), list(summary.columns)
    assert set(summary["dataset"]) == {"tiny"}
    assert sorted(summary["k"]) == [0, 1, 2]
    speculative = summary[summary["k"] > 0]
    for column in SUMMARY_COLUMNS:
        assert speculative[column].notna().all(), speculative[column]
    for column in ("acceptance_length", "acceptance_rate", "tokens_per_s", "speedup"):
        assert all(math.isfinite(value) for value in speculative[column]), speculative[column]
    assert (speculative["tokens_per_s"] > 0).all()
    assert ((speculative["acceptance_rate"] >= 0) & (speculative["acceptance_rate"] <= 1)).all()
    # The plain target is its own baseline.
    plain = summary[summary["k"] == 0].iloc[0]
    assert plain["acceptance_length"] == 1.0
    assert plain["speedup"] == pytest.approx(1.0)


def test_every_figure_carries_its_interval(tiny_pipeline: Path, summary: pd.DataFrame) -> None:
    units = pd.read_csv(tiny_pipeline / "results" / "bench" / "tiny" / "units.csv")
    # Two rounds, every engine on the same units in each (the pairing of the speed-up).
    assert sorted(units["run"].unique()) == [0, 1]
    cells = {k: sorted(zip(g["run"], g["unit"], strict=True)) for k, g in units.groupby("k")}
    assert cells[0] == cells[1] == cells[2]
    for row in summary.itertuples():
        for name in ("tokens_per_s", "tpot_ms", "speedup", "acceptance_length"):
            low, point, high = (getattr(row, f"{name}{end}") for end in ("_low", "", "_high"))
            assert low <= point <= high, (row.k, name)
    plain = summary[summary["k"] == 0].iloc[0]
    assert plain["speedup_low"] == pytest.approx(1.0) == plain["speedup_high"]
    markdown = (tiny_pipeline / "results" / "summary.md").read_text()
    assert "95 % confidence intervals" in markdown


def test_the_trained_draft_gets_tokens_accepted(summary: pd.DataFrame) -> None:
    # The draft over-fitted the tiny corpus and the prompts come from it: drafts are accepted.
    for row in summary[summary["k"] > 0].itertuples():
        assert 1.0 < row.acceptance_length <= 1 + row.k, row
        # acceptance length = 1 + k * acceptance rate (every draft proposes k tokens)
        assert row.acceptance_length == pytest.approx(1 + row.k * row.acceptance_rate)


def test_speculative_outputs_equal_the_plain_targets(tiny_pipeline: Path, summary) -> None:
    # Greedy in float32: speculative decoding is lossless, token by token.
    assert summary["outputs_identical"].astype(str).str.lower().eq("true").all(), summary
    # The same, read from the generated tokens themselves: every k gives the plain target's.
    records = [
        json.loads(line)
        for line in (tiny_pipeline / "results" / "bench" / "tiny" / "outputs.jsonl")
        .read_text()
        .splitlines()
    ]
    tokens: dict[int, dict[str, list[list[int]]]] = {}
    for record in records:
        tokens.setdefault(record["k"], {})[record["id"]] = [
            turn["token_ids"] for turn in record["turns"]
        ]
    assert sorted(tokens) == [0, 1, 2]
    prompts = (tiny_pipeline / "tiny_prompts.jsonl").read_text().splitlines()
    assert len(tokens[0]) == len(prompts)
    assert all(turn for turns in tokens[0].values() for turn in turns), "empty generations"
    for k in (1, 2):
        assert tokens[k] == tokens[0], f"k={k} differs from the plain target"


def test_the_plots_are_pngs(tiny_pipeline: Path) -> None:
    for name in REPORT_FIGURES:
        path = tiny_pipeline / "results" / "plots" / name
        assert path.read_bytes()[:8] == PNG_MAGIC, path
        assert path.stat().st_size > 1000, path


def test_snakemake_report_contains_the_plots(tiny_pipeline: Path, tmp_path: Path) -> None:
    report = build_html_report(tiny_pipeline, tmp_path / "report.html")
    text = report.read_text(encoding="utf-8", errors="replace")
    assert report.stat().st_size > 10_000
    for name in REPORT_FIGURES:
        assert name in text, name
