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
