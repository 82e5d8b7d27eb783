"""prepare_target: the demo GGUF becomes a checkpoint transformers and vLLM read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from config_support import demo_target

from draftflow.target.prepare import TARGET_INFO, checkpoint_revision, prepare_configured_target


def test_dequantized_checkpoint_shape_comes_from_its_config(smollm2_dir: Path) -> None:
    info = json.loads((smollm2_dir / TARGET_INFO).read_text())
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert info["num_hidden_layers"] == config["num_hidden_layers"]
    assert info["hidden_size"] == config["hidden_size"]
    assert info["revision"] == checkpoint_revision(smollm2_dir)


def test_tokenizer_config_reads_on_transformers_4(smollm2_dir: Path) -> None:
    # vLLM 0.16 runs on transformers 4.x, which knows no `TokenizersBackend` class.
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>assistant" in config["chat_template"]


def test_dequantized_model_answers_greedily(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])
    assert "Paris" in answer


def test_hf_source_links_a_local_checkpoint(smollm2_dir: Path, tmp_path: Path) -> None:
    info = prepare_configured_target(
        tmp_path / "target", demo_target(source="hf", path=str(smollm2_dir))
    )
    linked = tmp_path / "target" / "model.safetensors"
    assert linked.is_symlink()
    assert linked.resolve() == (smollm2_dir / "model.safetensors").resolve()
    assert info["revision"] == checkpoint_revision(smollm2_dir)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "gguf", "gguf": None}, "target.gguf is empty"),
        ({"source": "hf", "path": None}, "target.path is empty"),
        ({"source": "onnx"}, "must be one of 'gguf', 'hf'"),
        ({"source": "gguf", "gguf": "pkg:no_such_package_xyz/m.gguf"}, "not installed"),
    ],
)
def test_bad_target_settings_are_named(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        prepare_configured_target(tmp_path / "target", demo_target(**kwargs))
