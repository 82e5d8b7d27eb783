"""How much acceptance length will more data buy: a forecast from the points already measured.

The model: at k speculative tokens the acceptance length τ can never exceed k + 1, and the gap
left, k + 1 − τ, shrinks as a power of the train tokens t (a straight line in log-log space):

    log(k + 1 − τ) = log c − β · log t

It is fitted by least squares on the measured points (at least three), each prompt set and k on
its own; the interval is the ordinary least-squares prediction interval in log space (Student's
t with n − 2 degrees of freedom), so it is honest about how few points it rests on: with three
points it is wide, and every added size narrows it. The GPU seconds of each stage are fitted as
a straight line in t (the stages' fixed costs, engine starts among them, are the intercept).

``check`` fits on all points but the largest and predicts the largest, which was measured: the
test of the method that docs/results/forecast-check.json records. ``plan`` forecasts a run
before it trains: its train tokens from the disk plan (results/extract/plan.json, ``make plan
CURVE=...``), and says on what the forecast rests (the measured sizes, their configs, how far
past the largest it reaches): a curve measured with another target or corpus says nothing about
this run's.

    python -m draftflow.forecast predict --curve docs/results/quality-curve-4.json \\
        docs/results/quality-curve-5.json --tokens 6e6 --k 3
    python -m draftflow.forecast check --curve ... --out docs/results/forecast-check.json
    python -m draftflow.forecast plan --curve ... --extract-plan results/extract/plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def student_t_quantile(probability: float, dof: int) -> float:
    """The ``probability`` quantile of Student's t (probability > 0.5), by bisection on its CDF
    (the density integrated with Simpson's rule; scipy is not in the stack for one number)."""
    if dof < 1 or not 0.5 < probability < 1:
        raise ValueError(f"need dof >= 1 and 0.5 < probability < 1, got {dof}, {probability}")
    norm = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))

    def density(x: np.ndarray) -> np.ndarray:
        return norm * (1 + x * x / dof) ** (-(dof + 1) / 2)

    def cdf(x: float) -> float:
        grid = np.linspace(0.0, x, 4001)
        values = density(grid)
        step = grid[1] - grid[0]
        simpson = values[0] + values[-1] + 4 * values[1:-1:2].sum() + 2 * values[2:-1:2].sum()
        return 0.5 + float(simpson) * step / 3

    low, high = 0.0, 1.0
    while cdf(high) < probability:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return (low + high) / 2


@dataclasses.dataclass(frozen=True)
class CurvePoint:
    """One measured size: train tokens, τ per (prompt set, k), GPU seconds per stage."""

    train_tokens: int
    tau: dict[tuple[str, int], float]
    gpu_seconds: dict[str, float]
    source: str
    # the config the point was measured with (the collect file's ``config``)
    config: str


@dataclasses.dataclass(frozen=True)
class PowerLawFit:
    """``log(ceiling − y) = intercept + slope · log t``, with what the interval needs."""

    ceiling: float
    intercept: float
    slope: float
    residual_sd: float
    n: int
    mean_log_t: float
    sxx: float

    def predict(self, tokens: float, confidence: float) -> tuple[float, float, float]:
        """τ at ``tokens`` with its prediction interval (low, high)."""
        x = math.log(tokens)
        centre = self.intercept + self.slope * x
        spread = self.residual_sd * math.sqrt(
            1 + 1 / self.n + (x - self.mean_log_t) ** 2 / self.sxx
        )
        half = student_t_quantile(0.5 + confidence / 2, self.n - 2) * spread
        # a larger gap means a lower τ, so the interval's ends swap
        return (
            self.ceiling - math.exp(centre),
            self.ceiling - math.exp(centre + half),
            self.ceiling - math.exp(centre - half),
        )

    def tokens_for(self, tau: float) -> float | None:
        """Train tokens at which the fitted curve reaches ``tau`` (None: never, on this fit)."""
        if not tau < self.ceiling or self.slope >= 0:
            return None
        return math.exp((math.log(self.ceiling - tau) - self.intercept) / self.slope)


def fit_power_law(tokens: Sequence[float], tau: Sequence[float], ceiling: float) -> PowerLawFit:
    if len(tokens) < 3:
        raise ValueError(f"a forecast needs at least 3 measured sizes, got {len(tokens)}")
    if any(value >= ceiling for value in tau):
        raise ValueError(f"an acceptance length in {list(tau)} reaches its ceiling {ceiling}")
    x = np.log(np.asarray(tokens, dtype=float))
    y = np.log(ceiling - np.asarray(tau, dtype=float))
    slope, intercept = np.polyfit(x, y, 1)
    residuals = y - (intercept + slope * x)
    n = len(x)
    return PowerLawFit(
        ceiling=ceiling,
        intercept=float(intercept),
        slope=float(slope),
        residual_sd=float(math.sqrt(float(residuals @ residuals) / (n - 2))) if n > 2 else 0.0,
        n=n,
        mean_log_t=float(x.mean()),
        sxx=float(((x - x.mean()) ** 2).sum()),
    )


def fit_seconds(tokens: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """A stage's GPU seconds as ``fixed + per_token · t`` (least squares, per_token >= 0)."""
    per_token, fixed = np.polyfit(np.asarray(tokens, float), np.asarray(seconds, float), 1)
    if per_token < 0:  # noise on a stage that does not grow: its mean is the better forecast
        return float(np.mean(seconds)), 0.0
    return float(fixed), float(per_token)


def stage_of(job: str) -> str:
    """A job's stage: ``extract/train/shard-00001`` -> ``extract``."""
    return job.split("/", 1)[0]


def read_curve(paths: Iterable[str | Path]) -> list[CurvePoint]:
    """The points of studies/quality_curve.py's ``collect`` files, smallest first."""
    points = []
    for path in paths:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        for point in document["points"]:
            tau = {
                (prompt_set, int(row["k"])): float(row["acceptance_length"])
                for prompt_set, rows in point.get("bench", {}).items()
                for row in rows
            }
            seconds: dict[str, float] = {}
            for job, value in point.get("gpu_seconds", {}).items():
                seconds[stage_of(job)] = seconds.get(stage_of(job), 0.0) + float(value)
            points.append(
                CurvePoint(
                    int(point["train_tokens"]), tau, seconds, str(path), str(document["config"])
                )
            )
    sizes = [point.train_tokens for point in points]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"two points of the same train tokens in {list(map(str, paths))}")
    return sorted(points, key=lambda point: point.train_tokens)


def forecast(
    points: Sequence[CurvePoint], tokens: float, confidence: float, goal: float | None = None
) -> dict[str, Any]:
    """τ per prompt set and k, and GPU seconds per stage, at ``tokens`` train tokens."""
    series = sorted(set.intersection(*(set(point.tau) for point in points)))
    taus = []
    for prompt_set, k in series:
        fit = fit_power_law(
            [point.train_tokens for point in points],
            [point.tau[prompt_set, k] for point in points],
            ceiling=k + 1,
        )
        centre, low, high = fit.predict(tokens, confidence)
        row = {
            "prompt_set": prompt_set,
            "k": k,
            "tau": round(centre, 4),
            "low": round(low, 4),
            "high": round(high, 4),
            "gap_exponent": round(-fit.slope, 4),
        }
        if goal is not None:
            needed = fit.tokens_for(goal)
            row["tokens_for_goal"] = None if needed is None else round(needed)
        taus.append(row)
    stages = sorted(set.intersection(*(set(point.gpu_seconds) for point in points)))
    seconds = {}
    for stage in stages:
        fixed, per_token = fit_seconds(
            [point.train_tokens for point in points],
            [point.gpu_seconds[stage] for point in points],
        )
        seconds[stage] = round(fixed + per_token * tokens, 1)
    return {
        "train_tokens": round(tokens),
        "confidence": confidence,
        "fitted_on": [point.train_tokens for point in points],
        "tau": taus,
        "gpu_seconds": seconds,
        "gpu_minutes": round(sum(seconds.values()) / 60, 1),
    }


def check(points: Sequence[CurvePoint], confidence: float) -> dict[str, Any]:
    """Fit on every point but the largest; compare the forecast with the largest's τ."""
    if len(points) < 4:
        raise ValueError(f"checking needs 3 points to fit and 1 to predict, got {len(points)}")
    *fitted, held_out = points
    result = forecast(fitted, held_out.train_tokens, confidence)
    for row in result["tau"]:
        measured = held_out.tau[row["prompt_set"], row["k"]]
        row["measured"] = round(measured, 4)
        row["error"] = round(row["tau"] - measured, 4)
        row["inside"] = row["low"] <= measured <= row["high"]
    result["measured_gpu_seconds"] = {
        stage: round(held_out.gpu_seconds[stage], 1) for stage in result["gpu_seconds"]
    }
    return result


# Past this many times the largest measured size a forecast is a guess, whatever its interval.
FAR_BEYOND = 4.0


def planned_train_tokens(extract_plan: dict[str, Any]) -> int:
    """A run's train tokens from its disk plan (``plan_extract``'s results/extract/plan.json):
    the train shards' tokens, what a curve point's ``train_tokens`` counts."""
    train = [
        shard for shard in extract_plan["shards"] if Path(shard["output"]).parent.name == "train"
    ]
    if not train:
        raise ValueError("the disk plan has no train shard")
    return sum(int(shard["num_tokens"]) for shard in train)


def basis(points: Sequence[CurvePoint], tokens: float) -> dict[str, Any]:
    """On what a forecast at ``tokens`` rests: the measured sizes, where they were recorded and
    with which configs, and how far past the largest measured size it reaches."""
    largest = max(point.train_tokens for point in points)
    reach = tokens / largest
    warning = None
    if reach > FAR_BEYOND:
        warning = (
            f"{reach:.1f}x the largest measured size: past {FAR_BEYOND:g}x a forecast is a guess; "
            "measure a larger size first"
        )
    return {
        "sizes": [point.train_tokens for point in points],
        "files": sorted({point.source for point in points}),
        "configs": sorted({point.config for point in points}),
        "reach": round(reach, 2),
        "warning": warning,
    }


def plan_forecast(
    points: Sequence[CurvePoint],
    extract_plan: dict[str, Any],
    confidence: float,
    goal: float | None = None,
) -> dict[str, Any]:
    """The forecast of the run that ``extract_plan`` plans, with what it rests on."""
    tokens = planned_train_tokens(extract_plan)
    result = forecast(points, tokens, confidence, goal)
    result["rests_on"] = basis(points, tokens)
    return result


def _table(result: dict[str, Any]) -> str:
    level = round(100 * result["confidence"])
    lines = [
        f"forecast at {result['train_tokens']:,} train tokens "
        f"(fitted on {', '.join(f'{t:,}' for t in result['fitted_on'])}; {level} % intervals)"
    ]
    for row in result["tau"]:
        line = f"  {row['prompt_set']:<12} k={row['k']}: tau {row['tau']:.2f} [{row['low']:.2f}, {row['high']:.2f}]"
        if "measured" in row:
            line += f"  measured {row['measured']:.2f} ({'inside' if row['inside'] else 'OUTSIDE'})"
        if row.get("tokens_for_goal"):
            line += f"  goal reached at ~{row['tokens_for_goal']:,} tokens"
        lines.append(line)
    stages = ", ".join(f"{stage} {value:.0f} s" for stage, value in result["gpu_seconds"].items())
    lines.append(f"  GPU time: {result['gpu_minutes']} min ({stages})")
    rests_on = result.get("rests_on")
    if rests_on:
        lines.append(
            f"  rests on {len(rests_on['sizes'])} measured sizes "
            f"({', '.join(f'{t:,}' for t in rests_on['sizes'])} train tokens) measured with "
            f"{', '.join(rests_on['configs'])}: it holds for that target and corpus, not for "
            "another (measure three sizes of yours with studies/quality_curve.py)"
        )
        if rests_on["warning"]:
            lines.append(f"  warning: {rests_on['warning']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m draftflow.forecast", description=__doc__.split("\n")[0]
    )
    parser.add_argument("mode", choices=["predict", "check", "plan"])
    parser.add_argument(
        "--curve", nargs="+", required=True, help="studies/quality_curve.py collect files"
    )
    parser.add_argument("--tokens", type=float, help="train tokens to forecast (predict)")
    parser.add_argument(
        "--extract-plan", help="a run's disk plan, results/extract/plan.json (plan: its tokens)"
    )
    parser.add_argument(
        "--k", type=int, nargs="*", help="only these k (default: every k measured at every size)"
    )
    parser.add_argument(
        "--goal", type=float, help="an acceptance length: the train tokens that reach it"
    )
    parser.add_argument("--confidence", type=float, default=0.9)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    points = read_curve(args.curve)
    if args.mode == "predict":
        if args.tokens is None:
            parser.error("predict needs --tokens")
        result = forecast(points, args.tokens, args.confidence, args.goal)
        result["rests_on"] = basis(points, args.tokens)
    elif args.mode == "plan":
        if args.extract_plan is None:
            parser.error("plan needs --extract-plan (results/extract/plan.json, make plan)")
        from draftflow.io import read_json

        result = plan_forecast(points, read_json(args.extract_plan), args.confidence, args.goal)
    else:
        result = check(points, args.confidence)
    if args.k:
        result["tau"] = [row for row in result["tau"] if row["k"] in args.k]
    result["curve"] = [str(path) for path in args.curve]
    result["command"] = "python -m draftflow.forecast " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    print(_table(result))
    if args.out:
        from draftflow.io import atomic_write_json

        atomic_write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
