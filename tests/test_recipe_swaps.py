"""studies/recipe_swaps.py: the draft trained again with one setting changed, through the train
rule's own code, on the tiny workflow's data."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from study_support import load_study


@pytest.fixture(scope="module")
def swaps():
    return load_study("recipe_swaps")


def test_a_swap_names_one_setting(swaps):
    assert swaps.parse_swap("train.optimizer=muon") == ("train", "optimizer", "muon")
    assert swaps.parse_swap("train.epochs=6") == ("train", "epochs", 6)
    assert swaps.parse_swap("vocab.draft_vocab_size=64") == ("vocab", "draft_vocab_size", 64)
    for wrong in ("epochs=6", "train.epochs", "bench.k=3", "vocab.other=1"):
        with pytest.raises(ValueError):
            swaps.parse_swap(wrong)


def test_a_variant_may_change_several_settings_together(swaps):
    text = "train.epochs=20,train.tokens_per_batch=8192,vocab.draft_vocab_size=64"
    assert swaps.parse_variant(text) == [
        ("train", "epochs", 20),
        ("train", "tokens_per_batch", 8192),
        ("vocab", "draft_vocab_size", 64),
    ]
    assert swaps.swap_name(text) == (
        "train.epochs-20_train.tokens_per_batch-8192_vocab.draft_vocab_size-64"
    )
    for wrong in ("train.epochs=6,train.epochs=7", "train.epochs=6,bench.k=3"):
        with pytest.raises(ValueError):
            swaps.parse_variant(wrong)


def test_each_swap_trains_with_its_setting(swaps, tiny_pipeline, tmp_path):
    """Fewer steps stop there; a smaller draft vocabulary gives a draft with that many outputs;
    the baseline is the workdir's own training; a second call reads what the first trained."""
    out = tmp_path / "swaps"
    # The tiny workflow's merged config is its own config/config.yaml: no --configfile on top.
    argv = ["run", "--workdir", str(tiny_pipeline), "--out", str(out), "--configfiles"]
    argv += ["--swap", "train.max_steps=3", "--swap", "vocab.draft_vocab_size=64"]
    argv += ["--swap", "train.max_steps=2,vocab.draft_vocab_size=32"]
    swaps.main(argv)
    summary = json.loads((out / "summary.json").read_text())
    baseline = summary["baseline"]
    assert baseline["train"]["max_steps"] == 30 and baseline["vocab"]["draft_vocab_size"] == 2048
    assert summary["swaps"]["train.max_steps=3"]["val"]["step"] == 3
    assert baseline["val"]["step"] > 3
    draft = out / "vocab.draft_vocab_size-64" / "draft"
    assert json.loads((draft / "config.json").read_text())["draft_vocab_size"] == 64
    with safe_open(str(draft / "model.safetensors"), "pt") as weights:
        assert weights.get_tensor("d2t").shape == (64,)
    both = summary["swaps"]["train.max_steps=2,vocab.draft_vocab_size=32"]
    assert both["val"]["step"] == 2
    draft = out / "train.max_steps-2_vocab.draft_vocab_size-32" / "draft"
    assert json.loads((draft / "config.json").read_text())["draft_vocab_size"] == 32
    done = out / "train.max_steps-3" / "done.json"
    before = done.stat().st_mtime_ns
    swaps.main(argv)
    assert done.stat().st_mtime_ns == before


def test_a_variant_is_benched_as_the_workdir_benches_its_draft(swaps, tiny_pipeline, tmp_path):
    """``--bench-ks``: the variant's draft through draftflow's bench in the CPU build of vLLM,
    with the workdir's prompts and settings, its τ in the summary beside the workdir's own."""
    out = tmp_path / "swaps"
    swaps.main(
        ["run", "--workdir", str(tiny_pipeline), "--out", str(out), "--configfiles",
         "--swap", "train.max_steps=3", "--bench-ks", "1"]
    )  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    variant = summary["swaps"]["train.max_steps=3"]["bench"]
    baseline = summary["baseline"]["bench"]
    assert sorted(variant) == sorted(baseline) and variant
    for name, rows in variant.items():
        assert rows  # a row per repeat of the bench
        for row in rows:
            assert row["k"] == 1 and row["num_drafts"] > 0
            assert 1.0 <= row["acceptance_length"] <= 2.0
            assert row["lossless"] in ("identical", "near-ties only")
        assert (out / "train.max_steps-3" / "bench" / f"{name}.csv").exists()


def test_the_workdirs_config_starts_from_the_snakefiles_own(swaps, repo_root):
    """The workdir's config is merged as its Snakemake run merged it: config/config.yaml first,
    then the --configfile files, over the schema's defaults."""
    from workdir_study import workdir_config, workdir_files

    example = "config/examples/smollm2-gpu.yaml"
    assert workdir_files((example, "curve.yaml")) == ["config/config.yaml", example, "curve.yaml"]
    assert workdir_files(("config/config.yaml", example)) == ["config/config.yaml", example]
    config = workdir_config(repo_root, (example,))
    assert config["train"]["optimizer"] == "muon"
    assert config["bench"]["repeats"] == 1
    assert config["corpus"]["max_conversations"] == 2560  # the example's own
    assert swaps.CONFIG_FILES == ("config/demo.yaml",)
    demo = workdir_config(repo_root, swaps.CONFIG_FILES)
    assert demo["engine"]["device"] == "cpu"
