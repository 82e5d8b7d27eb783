"""The data stages through real snakemake: a dry-run of the demo DAG and a tiny real run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = REPO / ".venv" / "bin" / "snakemake"


def copy_workflow(dest: Path) -> Path:
    """The workflow's own files in a fresh directory, so runs never touch the repository."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "Snakefile", dest / "Snakefile")
    for folder in ("rules", "scripts", "config", "docs", "draftflow"):
        shutil.copytree(REPO / folder, dest / folder, dirs_exist_ok=True)
    return dest


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    result = subprocess.run(
        [str(SNAKEMAKE), "-s", str(workdir / "Snakefile"), "--directory", str(workdir), *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"snakemake {args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_dry_run_of_the_demo_dag_includes_the_data_stages(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    out = snakemake(workdir, "-n", "--quiet", "rules")
    jobs = set((out.stdout + out.stderr).split())
    # The demo regenerates answers with the target, so tokenize reads regenerate's output.
    assert {"ingest", "regenerate", "prepare_target", "tokenize", "split", "shard"} <= jobs


TINY_TOPICS = ["rivers", "prime numbers", "bread", "owls", "tides", "chess", "glass", "maps"]


def write_tiny_corpus(path: Path, count: int = 30) -> None:
    """ShareGPT-format conversations (what ingest reads), one or two turns each."""
    records = []
    for index in range(count):
        topic = TINY_TOPICS[index % len(TINY_TOPICS)]
        turns = [
            {"from": "human", "value": f"Tell me one fact about {topic} (#{index})."},
            {
                "from": "gpt",
                "value": f"Here is a fact about {topic}: it is interesting. " * (1 + index % 4),
            },
        ]
        if index % 2:
            turns += [
                {"from": "human", "value": "And another?"},
                {"from": "gpt", "value": f"Another fact: {topic} appear in many stories."},
            ]
        records.append({"id": f"tiny-{index}", "conversations": turns})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def tiny_config(workdir: Path, target: Path) -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"].update(source="hf", path=str(target), gguf=None)
    config["corpus"].update(
        sources=[{"name": "tiny", "path": str(workdir / "tiny.jsonl"), "format": "auto"}],
        max_conversations=None,
    )
    config["corpus"]["regenerate"]["enabled"] = False
    config["tokenize"].update(max_length=96, long_samples="truncate", max_turns=None)
    config["split"].update(seed=0, val_fraction=0.3, test_fraction=0.0)
    config["extract"]["num_shards"] = {"train": 2, "val": 1}
    return config


def test_ingest_tokenize_split_shard_run_for_real(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    workdir = copy_workflow(tmp_path / "wf")
    write_tiny_corpus(workdir / "tiny.jsonl")
    config = tiny_config(workdir, smollm2_dir)
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))

    target = "results/shard/manifest.json"
    snakemake(workdir, "--cores", "2", target)

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
    assert "Nothing to be done" in snakemake(workdir, "-n", target).stdout
    config["split"]["val_fraction"] = 0.4
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    plan = snakemake(workdir, target, "-n", "--quiet", "rules").stdout
    assert {"tokenize", "split", "shard"} <= set(plan.split())
    assert "ingest" not in plan.split()
