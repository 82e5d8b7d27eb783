"""Report stage on hand-made bench CSVs and training logs (no engine needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from config_support import demo_config

from draftflow.bench.schedule import bench_schedule
from draftflow.bench.tables import CSV_COLUMNS, UNIT_COLUMNS
from draftflow.report.build import (
    ReportPaths,
    build_report,
    data_size,
    describe_draft,
    target_name,
)
from draftflow.report.summary import (
    Bootstrap,
    best_k,
    step_cost,
    summarise,
    where_the_time_goes,
)
from draftflow.report.train_log import final_accuracy, last_step, read_train_log

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench_row(
    dataset, k, run, tokens_per_s, drafts=0, accepted_per_pos=(), identical=True, near_ties=0
):
    accepted = sum(accepted_per_pos)
    return {
        "dataset": dataset,
        "k": k,
        "run": run,
        "method": "eagle3" if k else "plain",
        "temperature": 0.0,
        "max_tokens": 64,
        "num_prompts": 4,
        "num_requests": 8,
        "prompt_tokens": 800,
        "output_tokens": 500,
        "elapsed_s": 500 / tokens_per_s,
        "tokens_per_s": tokens_per_s,
        "tpot_ms": 1000 / tokens_per_s,
        "requests_per_s": 8 * tokens_per_s / 500,
        "speedup": float("nan"),  # the summary recomputes it from pooled runs
        "num_drafts": drafts,
        "num_draft_tokens": k * drafts,
        "num_accepted_tokens": accepted,
        "accepted_per_pos": json.dumps(list(accepted_per_pos)),
        "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / (k * drafts) if drafts else float("nan"),
        "acceptance_per_pos": json.dumps([a / drafts for a in accepted_per_pos] if drafts else []),
        "outputs_identical": identical,
        "num_requests_differ": 0 if identical else 1,
        "first_difference": "none" if identical else "mtbench-81: turn 1, token 7",
        "num_near_ties": near_ties,
        "lossless": "identical" if identical else ("near-ties only" if near_ties else "differs"),
    }


@pytest.fixture
def bench_csv(tmp_path: Path) -> Path:
    rows = [
        bench_row("mtbench", 0, 0, 100.0),
        bench_row("mtbench", 0, 1, 100.0),
        # k=1: tau = 1 + 70/100 = 1.7 at 120 tokens/s
        bench_row("mtbench", 1, 0, 110.0, drafts=60, accepted_per_pos=[40]),
        bench_row("mtbench", 1, 1, 130.0, drafts=40, accepted_per_pos=[30]),
        # k=3: tau = 1 + (80+60+40)/100 = 2.8 at 150 tokens/s
        bench_row("mtbench", 3, 0, 150.0, drafts=100, accepted_per_pos=[80, 60, 40]),
        bench_row("mtbench", 3, 1, 150.0, drafts=100, accepted_per_pos=[80, 60, 40]),
    ]
    path = tmp_path / "mtbench.csv"
    frame = pd.DataFrame(rows)
    assert list(frame.columns) == CSV_COLUMNS
    frame.to_csv(path, index=False)
    return path


@pytest.fixture
def other_csv(tmp_path: Path) -> Path:
    rows = [
        bench_row("humaneval", 0, 0, 200.0),
        bench_row(
            "humaneval",
            2,
            0,
            180.0,
            drafts=50,
            accepted_per_pos=[20, 5],
            identical=False,
            near_ties=1,
        ),
    ]
    path = tmp_path / "humaneval.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_summary_pools_runs_and_computes_speedup(bench_csv: Path):
    summary = summarise(pd.read_csv(bench_csv))
    assert list(summary["k"]) == [0, 1, 3]
    k1 = summary[summary["k"] == 1].iloc[0]
    assert k1["acceptance_length"] == pytest.approx(1.7)  # pooled, not a mean of per-run ratios
    assert k1["acceptance_rate"] == pytest.approx(0.7)
    assert k1["tokens_per_s"] == pytest.approx(120.0)
    assert k1["speedup"] == pytest.approx(1.2)
    k3 = summary[summary["k"] == 3].iloc[0]
    assert k3["acceptance_length"] == pytest.approx(2.8)
    assert json.loads(k3["acceptance_per_pos"]) == pytest.approx([0.8, 0.6, 0.4])
    assert k3["speedup"] == pytest.approx(1.5)
    # 2.8 tokens per step at 1.5x the plain speed: one step costs 2.8 / 1.5 plain steps.
    assert k3["step_cost"] == pytest.approx(2.8 / 1.5)
    assert bool(k3["outputs_identical"]) is True
    plain = summary[summary["k"] == 0].iloc[0]
    assert plain["acceptance_length"] == 1.0 and plain["speedup"] == pytest.approx(1.0)
    assert math.isnan(plain["acceptance_rate"])


def test_step_cost_identity():
    # speed-up = tau / cost, whatever the numbers
    assert 2.5 / step_cost(100.0, 125.0, 2.5) == pytest.approx(1.25)
    assert math.isnan(step_cost(100.0, 0.0, 2.0))


def test_best_k_and_where_the_time_goes(bench_csv: Path, other_csv: Path):
    summary = summarise(pd.concat([pd.read_csv(bench_csv), pd.read_csv(other_csv)]))
    best = best_k(summary).set_index("dataset")
    assert best.loc["mtbench", "k"] == 3
    assert best.loc["humaneval", "k"] == 2
    assert not bool(best.loc["humaneval", "outputs_identical"])
    lines = where_the_time_goes(summary)
    text = "\n".join(lines)
    assert "at k=3 a speculative step costs 1.87 plain steps" in text
    assert "(0.29 per draft token)" in text
    assert "pays off" in text
    # humaneval k=2: tau 1.5 at 0.9x speed: the step costs 1.67 plain steps, more than tau.
    assert "at k=2 a speculative step costs 1.67 plain steps" in text
    assert "does not pay off" in text


def unit_rows(dataset, k, seconds, drafts=0, accepted=0):
    """One row per (unit, run) of ``seconds[unit][run]``, 100 output tokens each."""
    return [
        {
            "dataset": dataset,
            "k": k,
            "run": run,
            "unit": f"{dataset}-{unit}",
            "seconds": value,
            "output_tokens": 100,
            "decode_seconds": 0.9 * value,
            "decode_tokens": 99,
            "num_drafts": drafts,
            "num_accepted_tokens": accepted,
        }
        for unit, runs in enumerate(seconds)
        for run, value in enumerate(runs)
    ]


def paired_units(
    speedups: dict[int, float], noise: float, seed: int = 0, dataset: str = "mtbench"
) -> pd.DataFrame:
    """Six prompts of different lengths, two rounds: plain times, and each k's times divided by
    its speed-up, every time with ``noise`` (relative) of its own."""
    rng = np.random.default_rng(seed)
    lengths = np.array([[1.0], [2.0], [1.5], [3.0], [0.8], [2.5]])
    rows = unit_rows(dataset, 0, lengths * rng.normal(1, noise, (6, 2)))
    for k, speedup in speedups.items():
        seconds = lengths / speedup * rng.normal(1, noise, (6, 2))
        rows += unit_rows(dataset, k, seconds, drafts=60, accepted=30)
    frame = pd.DataFrame(rows)
    assert list(frame.columns) == UNIT_COLUMNS
    return frame


def test_units_give_every_figure_an_interval(bench_csv: Path):
    units = paired_units({1: 1.2, 3: 1.5}, noise=0.01)
    summary = summarise(
        pd.read_csv(bench_csv), units, Bootstrap(samples=500, confidence=0.95, seed=0)
    )
    for row in summary.itertuples():
        for name in ("tokens_per_s", "tpot_ms", "speedup", "acceptance_length"):
            assert getattr(row, f"{name}_low") <= getattr(row, name) <= getattr(row, f"{name}_high")
    k3 = summary[summary["k"] == 3].iloc[0]
    assert k3["speedup_low"] <= 1.5 <= k3["speedup_high"]
    assert k3["speedup_high"] - k3["speedup_low"] < 0.05
    assert k3["acceptance_length"] == pytest.approx(1.5)  # 30 accepted of 60 drafts per unit
    assert k3["num_units"] == 6 and k3["num_runs"] == 2
    best = best_k(summary).set_index("dataset")
    assert best.loc["mtbench", "k"] == 3 and bool(best.loc["mtbench", "named_best"])


@pytest.mark.parametrize("schedule", ["side_by_side", "one_at_a_time"])
def test_overlapping_intervals_are_reported_as_a_tie(
    bench_csv: Path, tmp_path: Path, run_dirs, schedule: str
):
    # k=1 and k=3 measured 1.20x and 1.22x with 10 % noise per time: no k can be named.
    units = paired_units({1: 1.20, 3: 1.22}, noise=0.10, seed=4)
    summary = summarise(
        pd.read_csv(bench_csv), units, Bootstrap(samples=500, confidence=0.95, seed=0)
    )
    best = best_k(summary).set_index("dataset")
    assert not bool(best.loc["mtbench", "named_best"])
    assert best.loc["mtbench", "tied"] == "1,3"
    units_csv = tmp_path / "units.csv"
    units.to_csv(units_csv, index=False)
    paths = report_paths(tmp_path / "results")
    build_report(
        [bench_csv],
        tmp_path / "absent.jsonl",
        run_dirs["target"],
        run_dirs["draft"],
        [],
        paths,
        unit_csvs=[units_csv],
        bootstrap=Bootstrap(samples=500, confidence=0.95, seed=1),
        schedule=schedule,
    )
    markdown = Path(paths.markdown).read_text()
    assert "| mtbench | 0 | tie: k=1, k=3 |" in markdown
    assert "95 % confidence intervals" in markdown and "500 resamples, seed 1" in markdown
    # Engines timed one after the other: the report says what its intervals leave out.
    said = "The engines ran one at a time (`bench.schedule`), not side by side" in markdown
    assert said == (schedule == "one_at_a_time")
    saved = pd.read_csv(paths.summary)
    assert {"speedup_low", "speedup_high", "tokens_per_s_low", "tpot_ms_high"} <= set(saved)
    assert len(saved) == 3  # tidy: one row per prompt set and k
    assert Path(paths.speedup).read_bytes()[:8] == PNG_SIGNATURE


def write_metrics(path: Path) -> None:
    records = [
        {"phase": "train", "step": 10, "loss": 5.0, "acc": [0.10, 0.05, 0.01]},
        {"phase": "train", "step": 20, "loss": 4.0, "acc": [0.20, 0.10, 0.05]},
        {"phase": "eval", "step": 20, "loss": 4.5, "acc_0": 0.15, "acc_1": 0.08, "acc_2": 0.03},
        {"step": 30, "train/loss": 3.5, "train/accuracy_pos0": 0.3},
        {"step": 30, "val_loss": 4.0, "val_acc_0": 0.25, "val_acc_1": 0.12, "val_acc_2": 0.06},
    ]
    text = "\n".join(json.dumps(r) for r in records) + '\n{"step": 40, "loss": 3.'  # cut short
    path.write_text(text)


def test_train_log_reads_common_spellings(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path)
    log = read_train_log(path)
    assert last_step(log) == 30
    losses = log[log["metric"] == "loss"].set_index(["phase", "step"])["value"]
    assert losses.to_dict() == {
        ("train", 10): 5.0,
        ("train", 20): 4.0,
        ("eval", 20): 4.5,
        ("train", 30): 3.5,
        ("eval", 30): 4.0,
    }
    assert final_accuracy(log) == ("eval", {0: 0.25, 1: 0.12, 2: 0.06})
    missing = read_train_log(tmp_path / "absent.jsonl")
    assert missing.empty and final_accuracy(missing) == (None, {})


def test_train_log_reads_draftflow_trainer_records(tmp_path: Path):
    """The records draftflow.train.metrics.summarize writes."""
    from draftflow.train.metrics import summarize

    counted = {"loss_0_sum": 2.0, "loss_0_total": 1.0, "loss_1_sum": 3.0, "loss_1_total": 1.0}
    for k, (full, cond) in enumerate([(0.8, 0.8), (0.6, 0.75)]):
        counted |= {f"full_acc_{k}_sum": full, f"full_acc_{k}_total": 1.0}
        counted |= {f"cond_acc_{k}_sum": cond, f"cond_acc_{k}_total": 1.0}
    path = tmp_path / "metrics.jsonl"
    records = [summarize("train", 5, counted, 2), summarize("val", 5, counted, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = read_train_log(path)
    assert final_accuracy(log) == ("eval", {0: 0.8, 1: 0.6})
    losses = log[log["metric"] == "loss"]
    assert sorted(losses["phase"]) == ["eval", "train"] and set(losses["value"]) == {5.0}
    cond = log[(log["metric"] == "cond_accuracy") & (log["phase"] == "eval")]
    assert dict(zip(cond["position"], cond["value"], strict=True)) == {0: 0.8, 1: 0.75}


@pytest.fixture
def run_dirs(tmp_path: Path) -> dict[str, Path]:
    target = tmp_path / "resources" / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 30,
                "hidden_size": 576,
                "vocab_size": 49152,
            }
        )
    )
    (target / "draftflow_target.json").write_text(json.dumps({"origin": "SmolLM2.gguf"}))
    draft = tmp_path / "train" / "draft"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "eagle3",
                "draft_vocab_size": 8192,
                "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
                "transformer_layer_config": {"num_hidden_layers": 1},
            }
        )
    )
    extract = []
    for split, samples, tokens in [("train", 30, 9000), ("train", 10, 3000), ("val", 2, 500)]:
        shard = tmp_path / "extract" / split / f"shard-{len(extract):05d}"
        shard.mkdir(parents=True)
        (shard / "manifest.json").write_text(
            json.dumps({"num_samples": samples, "num_tokens": tokens})
        )
        extract.append(shard)
    return {"target": target, "draft": draft, "extract": extract}


def report_paths(out: Path) -> ReportPaths:
    plots = out / "plots"
    return ReportPaths(
        summary=out / "summary.csv",
        markdown=out / "summary.md",
        acceptance_length=plots / "acceptance_length.png",
        acceptance_per_pos=plots / "acceptance_per_position.png",
        speedup=plots / "speedup.png",
        train_loss=plots / "train_loss.png",
        train_accuracy=plots / "train_accuracy.png",
    )


def test_build_report_writes_summary_and_plots(tmp_path, bench_csv, other_csv, run_dirs):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics)
    paths = report_paths(tmp_path / "results")
    build_report(
        [bench_csv, other_csv],
        metrics,
        run_dirs["target"],
        run_dirs["draft"],
        run_dirs["extract"],
        paths,
        Bootstrap(samples=500, confidence=0.95, seed=0),
        schedule=bench_schedule(demo_config()["bench"]),
    )
    summary = pd.read_csv(paths.summary)
    required = [
        "dataset",
        "k",
        "acceptance_length",
        "acceptance_rate",
        "tokens_per_s",
        "speedup",
        "outputs_identical",
    ]
    assert set(required) <= set(summary.columns)
    assert len(summary) == 5
    markdown = Path(paths.markdown).read_text()
    assert "LlamaForCausalLM (30 layers, hidden 576, vocab 49152), from `SmolLM2.gguf`" in markdown
    assert "- Target: SmolLM2: LlamaForCausalLM" in markdown
    assert "eagle3, 1 layer(s), draft vocab 8192, aux layers [2, 15, 27]" in markdown
    assert "train 40 samples / 12000 tokens, val 2 samples / 500 tokens" in markdown
    assert "Training steps: 30" in markdown
    assert "Validation accuracy per draft position (last step): pos 1: 0.250" in markdown
    assert "Acceptance length these accuracies predict: k=1: 1.25, k=2: 1.37, k=3: 1.43" in markdown
    assert "| mtbench | 0 | 3 | 2.80 | 1.50 | True |" in markdown
    # differing outputs are reported, with how many the plain target measured as near-ties
    assert "humaneval k=2: 1 request(s) (1 near-tie(s))" in markdown
    assert "## Where the time goes" in markdown
    for name in [
        "acceptance_length",
        "acceptance_per_pos",
        "speedup",
        "train_loss",
        "train_accuracy",
    ]:
        png = Path(getattr(paths, name))
        assert png.read_bytes()[:8] == PNG_SIGNATURE, name
        assert png.stat().st_size > 5000, name  # axes, lines and labels, not an empty canvas


def test_build_report_tolerates_missing_training_records(tmp_path, bench_csv, run_dirs):
    paths = report_paths(tmp_path / "results")
    build_report(
        [bench_csv],
        tmp_path / "absent.jsonl",
        run_dirs["target"],
        tmp_path / "no-draft",
        [],
        paths,
        Bootstrap(samples=500, confidence=0.95, seed=0),
        schedule=bench_schedule(demo_config()["bench"]),
    )
    markdown = Path(paths.markdown).read_text()
    assert "Training steps: unknown" in markdown
    assert "Draft: unknown (no config.json)" in markdown
    assert Path(paths.train_loss).read_bytes()[:8] == PNG_SIGNATURE


def test_target_is_named_by_its_model():
    assert target_name("gguf:/m/SmolLM2-135M-Instruct-Q8_0.gguf") == "SmolLM2-135M-Instruct-Q8_0"
    assert target_name("hf:/cache/models--x/snapshots/Qwen3-8B") == "Qwen3-8B"
    assert target_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert target_name("") == ""


def test_data_size_and_draft_description(run_dirs):
    assert data_size(run_dirs["extract"]) == {
        "train": {"samples": 40, "tokens": 12000},
        "val": {"samples": 2, "tokens": 500},
    }
    assert describe_draft(run_dirs["draft"]).startswith("eagle3, 1 layer(s)")


def test_sampled_runs_are_not_judged_lossless(tmp_path: Path):
    rows = [
        bench_row("chat", 0, 0, 100.0),
        bench_row("chat", 1, 0, 90.0, drafts=40, accepted_per_pos=[8]),
    ]
    for row in rows:
        row.update(temperature=0.8, outputs_identical=None, num_requests_differ=None)
        row["first_difference"] = "not checked (sampled)"
    path = tmp_path / "chat.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    summary = summarise(pd.read_csv(path))
    assert summary["outputs_identical"].isna().all()
    assert summary.loc[summary["k"] == 1, "acceptance_length"].iloc[0] == pytest.approx(1.2)
    assert summary["num_requests_differ"].isna().all()
    assert "temperature 0.8" in where_the_time_goes(summary)[0]


@pytest.mark.workflow
def test_report_rule_and_html_report(tmp_path: Path, repo_root: Path, bench_csv: Path, run_dirs):
    """The report rule through snakemake on finished upstream files, then `snakemake --report`.

    Only the report rule may run (`--allowed-rules report`), so no engine starts; the whole
    workflow's HTML report is the lead's end-to-end test, built with the same helper.
    """
    import shutil
    import subprocess
    import sys

    from draftflow.report.html import build_html_report

    work = tmp_path / "work"
    (work / "results" / "bench").mkdir(parents=True)
    for dataset in ("mtbench", "humaneval"):
        table = pd.read_csv(bench_csv).assign(dataset=dataset)
        table.to_csv(work / "results" / "bench" / f"{dataset}.csv", index=False)
        (work / "results" / "bench" / dataset).mkdir()
        units = paired_units({1: 1.2, 3: 1.5}, noise=0.02, dataset=dataset)
        units.to_csv(work / "results" / "bench" / dataset / "units.csv", index=False)
    (work / "resources").mkdir()
    shutil.copytree(run_dirs["target"], work / "resources" / "target")
    shutil.copytree(run_dirs["draft"], work / "results" / "train" / "draft")
    write_metrics(work / "results" / "train" / "metrics.jsonl")
    # The demo config decides how many train shards the report reads.
    from draftflow.config import load_config

    demo = load_config(repo_root / "config" / "demo.yaml")
    train_shards = int(demo["extract"]["num_shards"]["train"])
    for split, shard in [*(("train", i) for i in range(train_shards)), ("val", 0)]:
        shard_dir = work / "results" / "extract" / split / f"shard-{shard:05d}"
        shard_dir.mkdir(parents=True)
        (shard_dir / "manifest.json").write_text('{"num_samples": 5, "num_tokens": 100}')

    common = [
        "--snakefile",
        str(repo_root / "Snakefile"),
        "--configfile",
        str(repo_root / "config" / "demo.yaml"),
    ]
    only_report = ["--allowed-rules", "report", "--", "results/summary.csv"]
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", *common, "--cores", "1", *only_report],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = pd.read_csv(work / "results" / "summary.csv")
    assert sorted(summary["dataset"].unique()) == ["humaneval", "mtbench"]
    assert summary["speedup_low"].notna().all() and summary["speedup_high"].notna().all()
    expected = f"train {5 * train_shards} samples / {100 * train_shards} tokens"
    assert expected in (work / "results" / "summary.md").read_text()

    report = build_html_report(
        work,
        "results/report.html",
        snakefile=repo_root / "Snakefile",
        configfiles=[repo_root / "config" / "demo.yaml"],
        extra_args=only_report,
    )
    assert report.stat().st_size > 100_000  # the five figures are embedded
