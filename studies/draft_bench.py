"""A draft benched the way a finished workdir's bench stage benches its own: the workdir's
prompt sets (``results/bench/prompts``), target and ``bench:`` settings, draftflow's bench
(``draftflow.bench.suite.run_benchmark``). Shared by the studies that train other drafts on a
workdir's data (``speculators_side.py``, ``recipe_swaps.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TARGET = Path("resources/target")


def bench_draft(
    workdir: Path, config: dict[str, Any], draft: str | Path, ks: list[int], out_dir: Path
) -> list[str]:
    """``draft`` against the workdir's plain target at each of ``ks``, tables in ``out_dir`` as
    in the workdir's ``results/bench/``; the prompt sets' names."""
    from draftflow.bench.prompts import read_prompts
    from draftflow.bench.run import request_settings
    from draftflow.bench.suite import run_benchmark

    bench = config["bench"]
    prompts = workdir / "results" / "bench" / "prompts"
    names = [dataset["name"] for dataset in bench["datasets"]]
    run_benchmark(
        prompt_sets={name: read_prompts(prompts / f"{name}.jsonl") for name in names},
        target=str(workdir / TARGET),
        draft=str(draft),
        ks=ks,
        out_dir=out_dir,
        reserved_cpus=bench["reserved_cpus"],
        **request_settings(
            bench,
            dtype=bench["dtype"] or config["target"]["dtype"],
            trust_remote_code=config["target"]["trust_remote_code"],
        ),
    )
    return names
