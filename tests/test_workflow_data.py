"""The data stages through real snakemake: a dry-run of the demo DAG and a tiny real run."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
from workflow_support import (
    TINY_CORPUS,
    copy_workflow,
    link_target,
    run_snakemake,
    tiny_config,
    write_config,
    write_tiny_corpus,
)

from draftflow.config import load_config

pytestmark = pytest.mark.workflow

# The demo's run (make demo): its overlay over the schema's defaults.
DEMO = ("--configfile", "config/demo.yaml")


def test_dry_run_of_the_demo_dag_includes_the_data_stages(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    out = run_snakemake(workdir, *DEMO, "-n", "--quiet", "rules")
    jobs = set((out.stdout + out.stderr).split())
    # The demo regenerates answers with the target, so tokenize reads regenerate's output.
    assert {"ingest", "regenerate", "prepare_target", "tokenize", "split", "shard"} <= jobs


def test_dry_run_of_the_demo_bench_runs_every_engine_in_one_job(tmp_path):
    """The plain target and every k of the demo's config: one job runs all engines side by side
    on both prompt sets, holding the whole machine on the CPU build so no other job runs while
    they are timed; two tables."""
    workdir = copy_workflow(tmp_path / "wf")
    ks = load_config(workdir / "config" / "demo.yaml")["bench"]["num_speculative_tokens"]
    out = run_snakemake(workdir, *DEMO, "-n", "-p", "--cores", "3").stdout
    (job,) = re.findall(r"rule bench_engines:\n(.*?)\n\n", out, re.S)
    outputs = re.search(r"output: (.*)", job).group(1).split(", ")
    assert len(ks) >= 2 and outputs == [f"results/bench/engines/k{k}.json" for k in [0, *ks]]
    assert "results/bench/prompts/mtbench.jsonl" in job
    assert "results/bench/prompts/humaneval.jsonl" in job
    assert re.search(r"threads: 3\b", job), job
    assert len(re.findall(r"rule bench_table:\n", out)) == 2


def data_config() -> dict:
    """The tiny config with 30 conversations, truncation at 96 tokens and two train shards."""
    config = tiny_config()
    config["tokenize"].update(max_length=96, long_samples="truncate", max_turns=None)
    config["split"].update(seed=0, val_fraction=0.3, test_fraction=0.0)
    config["extract"]["num_shards"] = {"train": 2, "val": 1}
    return config


def test_ingest_tokenize_split_shard_run_for_real(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    workdir = copy_workflow(tmp_path / "wf")
    link_target(workdir, smollm2_dir)
    write_tiny_corpus(workdir / TINY_CORPUS, count=30)
    config = data_config()
    write_config(workdir, config)

    target = "results/shard/manifest.json"
    run_snakemake(workdir, "--cores", "2", target)

    results = workdir / "results"
    manifest = json.loads((results / "shard" / "manifest.json").read_text())
    split_summary = json.loads((results / "split" / "summary.json").read_text())
    tokenize_summary = json.loads((results / "tokenize" / "summary.json").read_text())
    assert tokenize_summary["samples"] == 30
    assert tokenize_summary["truncated"] > 0
    for split, shards in (("train", 2), ("val", 1)):
        entry = manifest["splits"][split]
        assert entry["num_shards"] == shards
        assert entry["samples"] == split_summary["splits"][split]["samples"] > 0
        for index, shard in enumerate(entry["shards"]):
            path = results / "shard" / split / f"shard-{index:05d}.parquet"
            table = pq.read_table(path)
            assert table.num_rows == shard["samples"]
            assert max(table["num_tokens"].to_pylist()) <= 96

    # The masks that reach the shards are the assistant's words, each followed by <|im_end|>.
    tokenizer = AutoTokenizer.from_pretrained(workdir / "resources" / "target")
    conversations = {
        record["id"]: record
        for record in map(
            json.loads, (results / "corpus" / "ingested.jsonl").read_text().splitlines()
        )
    }
    for row in pq.read_table(results / "tokenize" / "samples.parquet").to_pylist():
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        text = tokenizer.decode(masked, clean_up_tokenization_spaces=False)
        messages = conversations[row["id"]]["messages"]
        expected = "".join(
            m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"
        )
        if row["num_tokens"] < 96:
            assert text == expected
        else:  # truncated: a prefix of the assistant text survives
            assert expected.startswith(text) and text

    # Complete: nothing reruns. A split setting reruns tokenize (train counts), split and shard.
    assert "Nothing to be done" in run_snakemake(workdir, "-n", target).stdout
    config["split"]["val_fraction"] = 0.4
    write_config(workdir, config)
    plan = run_snakemake(workdir, target, "-n", "--quiet", "rules").stdout
    assert {"tokenize", "split", "shard"} <= set(plan.split())
    assert "ingest" not in plan.split()
