"""The bench stage's settings (the ``bench:`` section), typed like every other stage's.

Built from the validated config only (config/schema.yaml fills every default): sampling, timed
rounds and the engines' schedule here, the engine itself from ``draftflow.engine_settings``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from draftflow.engine_settings import EngineSettings, engine_settings


@dataclass(frozen=True)
class BenchSettings:
    temperature: float
    top_p: float
    max_tokens: int
    # Engine seed and per-request sampling seeds.
    seed: int
    # Timed rounds; in each, every prompt goes to every engine in turn.
    repeats: int
    warmup_tokens: int
    # bench.schedule (auto, side_by_side, one_at_a_time) and bench.starts (in_turn, together).
    schedule: str
    starts: str
    # Greedy differences within this many logits are near-ties (0: not measured).
    tie_margin: float
    # From the target: section.
    trust_remote_code: bool
    engine: EngineSettings


def bench_settings(config: Mapping[str, Any]) -> BenchSettings:
    """The bench settings of a validated config (draftflow.config.load_config, or Snakemake's)."""
    bench = config["bench"]
    return BenchSettings(
        temperature=bench["temperature"],
        top_p=bench["top_p"],
        max_tokens=bench["max_tokens"],
        seed=bench["seed"],
        repeats=bench["repeats"],
        warmup_tokens=bench["warmup_tokens"],
        schedule=bench["schedule"],
        starts=bench["starts"],
        tie_margin=bench["tie_margin"],
        trust_remote_code=config["target"]["trust_remote_code"],
        engine=engine_settings(config, "bench"),
    )
