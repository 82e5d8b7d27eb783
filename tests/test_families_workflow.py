"""A multimodal wrapper through the workflow: the Kimi-K2.5-shaped target (tests/families.py,
random weights) prepared as a checkpoint, tokenized with its chat template (SmolLM2's), its
text model captured by the hooks backend and verified against transformers, a draft trained on
it and exported. The bench stage is not run here (tests/test_workflow_e2e.py runs it on SmolLM2).
"""

from __future__ import annotations

import json

import pytest
from config_support import demo_target
from workflow_support import merge, prepare_tiny_workdir, read_config, run_snakemake, write_config

from draftflow.target.prepare import TARGET_INFO, prepare_configured_target


@pytest.mark.vllm
def test_kimi_k25_wrapper_runs_tokenize_extract_train_export(tmp_path, family_targets):
    prepared = tmp_path / "target"
    target = demo_target(source="hf", path=str(family_targets("kimi_k25")))
    info = prepare_configured_target(prepared, target)
    # The text model's shape, from the wrapper's text_config.
    assert (info["num_hidden_layers"], info["hidden_size"]) == (8, 128)
    assert (prepared / TARGET_INFO).exists()
    workdir = prepare_tiny_workdir(tmp_path / "workflow", prepared)
    short = {"train": {"max_steps": 10, "eval_every": 5, "checkpoint_every": 10, "log_every": 5}}
    write_config(workdir, merge(read_config(workdir), short))
    run_snakemake(workdir, "--cores", "2", "results/train/draft", timeout=900)

    manifest = json.loads((workdir / "results/extract/train/shard-00000/manifest.json").read_text())
    assert manifest["backend"] == "hooks" and manifest["verification"]["passed"]
    assert manifest["layer_ids"] == [2, 4, 5, 8]
    draft = json.loads((workdir / "results/train/draft/config.json").read_text())
    assert draft["speculators_model_type"] == "eagle3"
    assert draft["transformer_layer_config"]["hidden_size"] == 128, draft
    assert (workdir / "results/train/draft" / "model.safetensors").exists()
