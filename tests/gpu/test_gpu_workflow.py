"""The tiny workflow (tests/configs/tiny.yaml) on a GPU through Snakemake: regenerate, extract
(hooks, ``engine.device: gpu``), train and bench (speculative decoding, lossless check) all run
their engines and steps on the GPU, as a user's ``snakemake --resources gpu=1`` would.

Set ``DRAFTFLOW_GPU_KEEP=DIR`` to keep the finished workdir (its draft feeds perf/gpu_spec_decode.py).
"""

from __future__ import annotations

import csv
import json
import os
import shutil

from workflow_support import prepare_tiny_workdir, read_config, run_snakemake, write_config


def test_tiny_workflow_on_the_gpu(tmp_path, smollm2_dir):
    workdir = prepare_tiny_workdir(tmp_path / "workflow", smollm2_dir)
    config = read_config(workdir)
    config["corpus"]["regenerate"].update(enabled=True, max_tokens=64)
    config["engine"]["device"] = "gpu"
    config["extract"]["gpu_memory_utilization"] = 0.2
    config["extract"].pop("kv_cache_memory_bytes", None)
    config["resources"]["train_gpus"] = 1
    # The three bench engines (k = 0, 1, 2) are alive at once: 0.2 of the GPU each, sized by
    # profiling the free memory, so they start in turn (tests/configs/tiny.yaml: together).
    config["bench"].update(gpu_memory_utilization=0.2, kv_cache_memory_bytes=None, starts="in_turn")
    write_config(workdir, config)
    run_snakemake(workdir, "--cores", "8", "--resources", "gpu=1", timeout=1500)

    manifest = json.loads((workdir / "results/extract/train/shard-00000/manifest.json").read_text())
    assert manifest["backend"] == "hooks" and manifest["verification"]["passed"]
    log = (workdir / "logs/extract/train/shard-00000.log").read_text()
    assert "cuda" in log, "the extract job did not capture on the GPU"
    with open(workdir / "results/summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    # Greedy outputs equal the plain target's, or depart only at near-ties the plain target
    # measured itself (GPU kernels round float32 differently in the verify pass).
    tables = [
        row
        for path in (workdir / "results/bench").glob("*.csv")
        for row in csv.DictReader(path.open())
    ]
    assert tables and all(row["lossless"] in ("identical", "near-ties only") for row in tables)
    drafted = [row for row in rows if int(row["k"]) > 0]
    assert drafted and all(float(row["acceptance_length"]) > 1.0 for row in drafted)
    # The bench's statistics: every figure within its interval, paired over the same units.
    for row in rows:
        for name in ("tokens_per_s", "tpot_ms", "speedup", "acceptance_length"):
            low, point, high = (float(row[f"{name}{end}"]) for end in ("_low", "", "_high"))
            assert low <= point <= high, (row["k"], name)
    print("GPU tiny workflow:", rows)
    keep = os.environ.get("DRAFTFLOW_GPU_KEEP")
    if keep:
        shutil.copytree(workdir, keep, symlinks=False, dirs_exist_ok=True)
