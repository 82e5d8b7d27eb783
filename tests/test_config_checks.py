"""The cross-key checks rules/common.smk runs at start (draftflow.plan.checks): each refusal names
the keys, the values and a fix; a target's config.json is read where it is local."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from draftflow.config import load_config
from draftflow.plan.checks import ConfigCheckError, check_config, check_workflow_config
from draftflow.plan.target_shape import read_target_shape

REPO = Path(__file__).resolve().parents[1]
TARGETS = REPO / "tests" / "data" / "targets"
LLAMA_EXAMPLE = REPO / "config" / "examples" / "llama3.1-8b-8gpu.yaml"
KIMI_EXAMPLE = REPO / "config" / "examples" / "kimi-k2.5-8gpu.yaml"


def merged(tmp_path: Path, *files: Path, overlay: dict | None = None) -> dict:
    paths = list(files)
    if overlay is not None:
        extra = tmp_path / "overlay.yaml"
        extra.write_text(yaml.safe_dump(overlay), encoding="utf-8")
        paths.append(extra)
    return load_config(*paths)


def refusal(config: dict, target: str | None) -> str:
    shape = read_target_shape(TARGETS / target / "config.json") if target else None
    with pytest.raises(ConfigCheckError) as error:
        check_config(config, shape)
    return str(error.value)


def test_a_cpu_sized_cache_on_a_gpu_run_is_refused(tmp_path):
    # The demo's KV cache (256 MiB) left under a GPU run.
    config = merged(
        tmp_path, LLAMA_EXAMPLE, overlay={"extract": {"kv_cache_memory_bytes": 268435456}}
    )
    message = refusal(config, "llama-3.1-8b")
    assert "extract.kv_cache_memory_bytes 268435456 (256 MiB) on a GPU run (engine.device gpu)" in (
        message
    )
    assert "Fix: extract.kv_cache_memory_bytes: null" in message


def test_the_demo_cache_on_the_cpu_is_accepted(tmp_path):
    config = merged(tmp_path, REPO / "config" / "demo.yaml")
    assert config["engine"]["device"] == "cpu"
    check_config(config, read_target_shape(TARGETS / "smollm2-135m" / "config.json"))


def test_a_regenerate_context_without_room_for_the_answer_is_refused(tmp_path):
    # The case: the demo's 448-token context under 2,048-token answers.
    config = merged(
        tmp_path, LLAMA_EXAMPLE, overlay={"corpus": {"regenerate": {"max_model_len": 448}}}
    )
    message = refusal(config, None)
    assert "corpus.regenerate.max_model_len 448" in message
    assert "corpus.regenerate.max_tokens 2048" in message
    assert "Fix: corpus.regenerate.max_model_len >= 2112" in message


def test_a_null_regenerate_context_follows_tokenize_max_length(tmp_path):
    config = merged(
        tmp_path,
        LLAMA_EXAMPLE,
        overlay={
            "tokenize": {"max_length": 1024},
            "corpus": {"regenerate": {"max_model_len": None}},
        },
    )
    message = refusal(config, None)
    assert "corpus.regenerate.max_model_len null (tokenize.max_length 1024)" in message


def test_tensor_parallel_size_must_divide_the_heads(tmp_path):
    config = merged(tmp_path, LLAMA_EXAMPLE, overlay={"engine": {"tensor_parallel_size": 3}})
    message = refusal(config, "llama-3.1-8b")
    assert "engine.tensor_parallel_size 3 does not divide the target's 32 attention heads" in (
        message
    )
    assert "[1, 2, 4, 8, 16]" in message


def test_tensor_parallel_size_against_kv_heads(tmp_path):
    # Qwen2.5-7B: 28 query heads, 4 KV heads. 7 GPUs divide the query heads, but 4 KV heads can
    # be neither split over 7 ranks nor replicated evenly; 4 GPUs take one KV head each.
    shape = read_target_shape(TARGETS / "qwen2.5-7b" / "config.json")
    config = merged(tmp_path, LLAMA_EXAMPLE, overlay={"engine": {"tensor_parallel_size": 7}})
    with pytest.raises(ConfigCheckError) as error:
        check_config(config, shape)
    assert "engine.tensor_parallel_size 7 and the target's 4 KV heads" in str(error.value)
    config = merged(tmp_path, LLAMA_EXAMPLE, overlay={"engine": {"tensor_parallel_size": 4}})
    check_config(config, shape)
    assert shape.kv_heads_per_device(4) == 1


def test_kv_cache_bytes_must_hold_one_sequence(tmp_path):
    # Kimi-K2.5's MLA: 70,272 bytes a token; 1 GiB holds 15,279 tokens, less than
    # the capture engine's 32,769 (the longest sample plus one).
    config = merged(
        tmp_path,
        KIMI_EXAMPLE,
        overlay={"tokenize": {"max_length": 32768}, "extract": {"kv_cache_memory_bytes": 1 << 30}},
    )
    message = refusal(config, "kimi-k2.5")
    assert "extract.kv_cache_memory_bytes 1073741824 holds 15279 tokens of 70272 bytes" in message
    assert "tokenize.max_length 32769-token sequence (2302743168 bytes)" in message


def test_a_float32_bench_of_a_large_target_is_refused(tmp_path):
    config = merged(tmp_path, KIMI_EXAMPLE, overlay={"bench": {"dtype": "float32"}})
    message = refusal(config, "kimi-k2.5")
    assert "bench.dtype float32 for a target of 1026.4B parameters" in message
    assert "Fix: bench.dtype: null (target.dtype bfloat16)" in message


def test_every_problem_is_reported_at_once(tmp_path):
    config = merged(
        tmp_path,
        LLAMA_EXAMPLE,
        overlay={
            "engine": {"tensor_parallel_size": 3},
            "bench": {"dtype": "float32", "kv_cache_memory_bytes": 201326592},
            "corpus": {"regenerate": {"max_model_len": 448}},
        },
    )
    message = refusal(config, "llama-3.1-8b")
    for key in (
        "corpus.regenerate.max_model_len 448",
        "bench.kv_cache_memory_bytes 201326592",
        "bench.dtype float32",
        "engine.tensor_parallel_size 3",
    ):
        assert key in message


def test_a_context_past_the_target_positions_is_refused(tmp_path):
    # Qwen3-8B: 40,960 positions and no rope scaling in its config.json.
    config = merged(tmp_path, LLAMA_EXAMPLE, overlay={"tokenize": {"max_length": 65536}})
    message = refusal(config, "qwen3-8b")
    assert "max_position_embeddings 40960" in message


def test_the_start_check_reads_a_local_target(tmp_path):
    target = tmp_path / "Meta-Llama-3.1-8B-Instruct"
    target.mkdir()
    shutil.copy(TARGETS / "llama-3.1-8b" / "config.json", target / "config.json")
    config = merged(
        tmp_path,
        LLAMA_EXAMPLE,
        overlay={"target": {"path": str(target)}, "engine": {"tensor_parallel_size": 3}},
    )
    with pytest.raises(ConfigCheckError, match="32 attention heads"):
        check_workflow_config(config)


def test_a_gguf_target_skips_the_shape_checks_and_says_so(tmp_path):
    config = merged(tmp_path, REPO / "config" / "demo.yaml")
    notes = check_workflow_config(config)
    assert len(notes) == 1 and "target.source gguf" in notes[0] and "skipped" in notes[0]


def test_a_target_shape_not_known_here_does_not_stop_the_run(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    config_json = json.loads((TARGETS / "llama-3.1-8b" / "config.json").read_text())
    config_json["quantization_config"] = {"quant_method": "some_future_scheme"}
    (target / "config.json").write_text(json.dumps(config_json), encoding="utf-8")
    config = merged(tmp_path, LLAMA_EXAMPLE, overlay={"target": {"path": str(target)}})
    notes = check_workflow_config(config)
    assert "quant_method 'some_future_scheme'" in notes[0] and "skipped" in notes[1]
