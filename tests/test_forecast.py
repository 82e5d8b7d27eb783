"""The τ forecast (draftflow/forecast.py): its statistics, and its check on the measured curve."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from draftflow import forecast

REPO = Path(__file__).resolve().parents[1]
MUON_CURVE = [
    REPO / "docs/results/quality-curve-4.json",
    REPO / "docs/results/quality-curve-5.json",
]


@pytest.mark.parametrize(
    ("probability", "dof", "expected"),
    [(0.95, 1, 6.3138), (0.975, 1, 12.7062), (0.95, 2, 2.9200), (0.975, 10, 2.2281)],
)
def test_student_t_quantiles_match_the_tables(probability, dof, expected):
    assert forecast.student_t_quantile(probability, dof) == pytest.approx(expected, abs=1e-3)


def test_an_exact_power_law_is_recovered_and_inverted():
    tokens = [1e5, 2e5, 4e5, 8e5]
    tau = [4 - 3.0 * t**-0.1 for t in tokens]
    fit = forecast.fit_power_law(tokens, tau, ceiling=4)
    assert fit.slope == pytest.approx(-0.1)
    centre, low, high = fit.predict(6.4e6, confidence=0.9)
    assert centre == pytest.approx(4 - 3.0 * 6.4e6**-0.1)
    assert low == pytest.approx(centre) and high == pytest.approx(centre)
    assert fit.tokens_for(centre) == pytest.approx(6.4e6, rel=1e-6)
    assert fit.tokens_for(4.5) is None


def test_the_interval_widens_away_from_the_data_and_with_noise():
    tokens = [1e5, 2e5, 4e5, 8e5]
    noisy = [1.50, 1.80, 1.95, 2.20]
    fit = forecast.fit_power_law(tokens, noisy, ceiling=4)
    near = fit.predict(1e6, 0.9)
    far = fit.predict(1e8, 0.9)
    assert near[1] < near[0] < near[2]
    assert far[2] - far[1] > near[2] - near[1]


def test_too_few_points_or_a_tau_at_its_ceiling_is_refused():
    with pytest.raises(ValueError, match="at least 3"):
        forecast.fit_power_law([1e5, 2e5], [1.5, 1.6], ceiling=4)
    with pytest.raises(ValueError, match="ceiling"):
        forecast.fit_power_law([1e5, 2e5, 4e5], [1.5, 1.6, 4.0], ceiling=4)


def test_fitted_on_the_smaller_sizes_it_brackets_the_largest_measured_one(tmp_path):
    """The honest check: the 2M-token point was not fitted; its τ must fall in the interval."""
    out = tmp_path / "check.json"
    assert forecast.main(["check", "--curve", *map(str, MUON_CURVE), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["fitted_on"] == [250803, 503121, 1015088]
    rows = {(row["prompt_set"], row["k"]): row for row in result["tau"]}
    assert set(rows) == {("mtbench", 3), ("humaneval", 3)}
    for row in rows.values():
        assert row["inside"], row
        assert abs(row["error"]) < 0.15, row
        assert row["measured"] == pytest.approx(
            {"mtbench": 2.1553, "humaneval": 2.2384}[row["prompt_set"]], abs=1e-3
        )
    # GPU time: every stage forecast, in the measured point's order of magnitude
    for stage, seconds in result["gpu_seconds"].items():
        measured = result["measured_gpu_seconds"][stage]
        assert 0.5 * measured < seconds < 2 * measured, (stage, seconds, measured)


def test_the_recorded_check_is_what_the_tool_computes_now():
    """docs/results/forecast-check.json, which docs cite, is reproduced from the curve files."""
    recorded = json.loads((REPO / "docs/results/forecast-check.json").read_text())
    now = forecast.check(forecast.read_curve(MUON_CURVE), recorded["confidence"])
    assert [row["tau"] for row in recorded["tau"]] == [row["tau"] for row in now["tau"]]
    assert [row["low"] for row in recorded["tau"]] == [row["low"] for row in now["tau"]]
    assert all(math.isfinite(row["high"]) for row in now["tau"])


def _disk_plan(tmp_path, train_tokens, val_tokens=500):
    """A disk plan as plan_extract writes it for make plan (two train shards and a val one)."""
    from draftflow.capture.layers import CaptureLayers
    from draftflow.capture.plan import plan_extract

    layers = CaptureLayers(num_hidden_layers=30, hidden_size=576, aux_layer_ids=[2, 15, 27])
    split_tokens = {"train": [train_tokens // 2, train_tokens - train_tokens // 2]}
    split_tokens["val"] = [val_tokens]
    manifest = {
        "splits": {
            split: {
                "shards": [
                    {"name": f"shard-{i:05d}", "path": f"{split}-{i}.parquet", "samples": 9}
                    | {"tokens": n}
                    for i, n in enumerate(counts)
                ]
            }
            for split, counts in split_tokens.items()
        }
    }
    return plan_extract(manifest, layers, "bfloat16", 8, tmp_path, 0, window=None)


def test_make_plan_forecasts_the_run_and_says_what_it_rests_on(tmp_path, capsys):
    """``forecast plan``: the run's train tokens from its disk plan (val shards not counted),
    the same numbers as predict at those tokens, the measured sizes and configs it rests on,
    and a warning where it reaches far past the largest measured size."""
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(_disk_plan(tmp_path, 3_000_000)))
    out = tmp_path / "forecast.json"
    curve = [str(path) for path in MUON_CURVE]
    argv = ["plan", "--curve", *curve, "--extract-plan", str(plan_path), "--out", str(out)]
    assert forecast.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["train_tokens"] == 3_000_000
    direct = forecast.forecast(forecast.read_curve(MUON_CURVE), 3_000_000, 0.9)
    assert result["tau"] == direct["tau"]
    assert result["rests_on"]["sizes"] == [250803, 503121, 1015088, 2034472]
    assert result["rests_on"]["configs"] == ["config/examples/smollm2-gpu.yaml"]
    assert result["rests_on"]["reach"] == pytest.approx(3_000_000 / 2034472, abs=0.01)
    assert result["rests_on"]["warning"] is None
    printed = capsys.readouterr().out
    assert "rests on 4 measured sizes" in printed and "smollm2-gpu.yaml" in printed

    plan_path.write_text(json.dumps(_disk_plan(tmp_path, 20_000_000)))
    assert forecast.main(["plan", "--curve", *curve, "--extract-plan", str(plan_path)]) == 0
    assert "warning: 9.8x the largest measured size" in capsys.readouterr().out


def test_a_disk_plan_without_train_shards_is_refused(tmp_path):
    plan = _disk_plan(tmp_path, 1000)
    plan["shards"] = [s for s in plan["shards"] if "/train/" not in s["output"]]
    with pytest.raises(ValueError, match="no train shard"):
        forecast.planned_train_tokens(plan)
