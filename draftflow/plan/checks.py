"""Cross-key checks at the workflow's start, before any job runs (rules/common.smk).

Each refusal names the keys, their values and a fix; every problem of a config is reported at
once. What needs the target's shape (KV bytes per token, heads, parameter count) comes from the
target's own config.json where it is there at start: ``target.source: hf`` with ``target.path``
a local checkpoint. A gguf target (the demo) or a hub id has none before ``prepare_target`` runs:
those checks are skipped and ``check_config`` says so in its notes (``python -m draftflow.plan``
prints them, and takes a config.json with ``--target-config``).

Device memory is not known at start (no config key holds it), so what depends on it (weights
plus KV cache against a device) is the engine plan's (``draftflow.plan.engines``); here a KV
cache given in bytes must hold one sequence, whatever the device.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftflow.engine_settings import STAGES, EngineSettings, engine_settings
from draftflow.plan.engines import CONTEXT_KEY, STAGE_SECTION, kv_cache_dtype
from draftflow.plan.target_shape import TargetShape, target_shape

# Room a regenerated turn's prompt needs beside its answer (a first prompt that does not fit
# drops the conversation: with less than this nearly every one would be dropped).
MIN_PROMPT_TOKENS = 64
# A KV cache below this on a GPU is a CPU-sized one left from a CPU config (the demo's 256 MiB
# to 1 GiB): a GPU engine would hold a handful of sequences.
CPU_SIZED_CACHE_BYTES = 1 << 30
# Above this a float32 bench copy of the target is refused: twice the bf16 memory, for a
# strictness (float32 greedy ties) that only a small target can afford.
LARGE_TARGET_PARAMETERS = 3_000_000_000


class ConfigCheckError(ValueError):
    """A config whose keys contradict each other; the message lists every problem and its fix."""


def local_target_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The target's config.json where it is readable before the workflow runs, else None."""
    target = config["target"]
    if target["source"] != "hf" or not target.get("path"):
        return None
    path = Path(target["path"]) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _regenerate_problems(config: Mapping[str, Any], settings: EngineSettings) -> list[str]:
    regenerate = config["corpus"]["regenerate"]
    if not regenerate["enabled"]:
        return []
    max_tokens = int(regenerate["max_tokens"])
    need = max_tokens + MIN_PROMPT_TOKENS
    if settings.max_model_len >= need:
        return []
    given = regenerate["max_model_len"]
    source = (
        f"corpus.regenerate.max_model_len {given}"
        if given is not None
        else f"corpus.regenerate.max_model_len null (tokenize.max_length "
        f"{config['tokenize']['max_length']})"
    )
    return [
        f"{source} cannot hold a prompt plus corpus.regenerate.max_tokens {max_tokens} answer "
        f"tokens: the engine's context is prompt plus answer. Fix: corpus.regenerate."
        f"max_model_len >= {need} (e.g. {max(2 * max_tokens, need)}), or fewer "
        "corpus.regenerate.max_tokens"
    ]


def _context_problems(
    config: Mapping[str, Any], settings: dict[str, EngineSettings], shape: TargetShape | None
) -> list[str]:
    problems = []
    max_length = int(config["tokenize"]["max_length"])
    # The capture engine's context is the longest sample plus one (draftflow/capture/extract.py).
    extract_context = settings["extract"].max_model_len + 1
    if extract_context < max_length + 1:
        problems.append(
            f"tokenize.max_length {max_length}: samples that long do not fit the extract "
            f"engine's context {extract_context}. Fix: tokenize.max_length <= "
            f"{extract_context - 1}"
        )
    bench = config["bench"]
    if int(bench["max_model_len"]) <= int(bench["max_tokens"]):
        problems.append(
            f"bench.max_model_len {bench['max_model_len']} cannot hold a prompt plus "
            f"bench.max_tokens {bench['max_tokens']}. Fix: bench.max_model_len >= "
            f"{int(bench['max_tokens']) + 1024}, or fewer bench.max_tokens"
        )
    longest = shape.max_position_embeddings if shape else None
    if longest:
        for stage in STAGES:
            if stage == "regenerate" and not config["corpus"]["regenerate"]["enabled"]:
                continue
            context = settings[stage].max_model_len + (1 if stage == "extract" else 0)
            if context > int(longest):
                problems.append(
                    f"{CONTEXT_KEY[stage]} {settings[stage].max_model_len}: the {stage} engine's "
                    f"context {context} is longer than the target's max_position_embeddings "
                    f"{longest} (config.json), which vLLM refuses. Fix: at most {longest}"
                    + (" - 1" if stage == "extract" else "")
                )
    return problems


def _cache_problems(
    config: Mapping[str, Any], settings: dict[str, EngineSettings], shape: TargetShape | None
) -> list[str]:
    problems = []
    for stage in STAGES:
        if stage == "regenerate" and not config["corpus"]["regenerate"]["enabled"]:
            continue
        engine = settings[stage]
        given = engine.kv_cache_memory_bytes
        if given is None:
            continue
        section = STAGE_SECTION[stage]
        if engine.device == "gpu" and given < CPU_SIZED_CACHE_BYTES:
            problems.append(
                f"{section}.kv_cache_memory_bytes {given} ({given / (1 << 20):.0f} MiB) on a GPU "
                f"run (engine.device gpu) is a CPU-sized KV cache (below "
                f"{CPU_SIZED_CACHE_BYTES >> 30} GiB). Fix: {section}.kv_cache_memory_bytes: "
                f"null (the {section}.gpu_memory_utilization share of the GPU sizes it), or "
                "engine.device: cpu for a CPU run"
            )
            continue
        if shape is None:
            continue
        context = engine.max_model_len + (1 if stage == "extract" else 0)
        tp = engine.tensor_parallel_size
        # One sequence's need: linear-attention layers hold a state, not tokens; windowed layers
        # every token (vLLM reserves the window plus the tokens in flight).
        need = shape.kv_bytes_per_sequence(kv_cache_dtype(engine), context, tp)
        per_token = shape.kv_bytes_per_token(kv_cache_dtype(engine), tp, context)
        if given < need:
            problems.append(
                f"{section}.kv_cache_memory_bytes {given} holds {given // per_token} tokens of "
                f"{per_token} bytes ({shape.model_type}, tensor_parallel_size {tp}), less than "
                f"one {CONTEXT_KEY[stage]} {context}-token sequence ({need} bytes). Fix: "
                f"{section}.kv_cache_memory_bytes >= {need}, or a shorter context"
            )
    return problems


def _target_problems(
    config: Mapping[str, Any], settings: dict[str, EngineSettings], shape: TargetShape
) -> list[str]:
    problems = []
    bench = settings["bench"]
    if bench.dtype == "float32" and shape.parameters > LARGE_TARGET_PARAMETERS:
        problems.append(
            f"bench.dtype float32 for a target of {shape.parameters / 1e9:.1f}B parameters: a "
            f"float32 copy of every bench engine's weights ({shape.parameters * 4 / 1e9:.0f} GB) "
            f"for a target above {LARGE_TARGET_PARAMETERS / 1e9:.0f}B. Fix: bench.dtype: null "
            f"(target.dtype {config['target']['dtype']}) or bfloat16"
        )
    tp = int(config["engine"]["tensor_parallel_size"])
    heads, kv_heads = shape.num_attention_heads, shape.num_kv_heads
    if heads % tp:
        divisors = [n for n in range(1, heads + 1) if heads % n == 0 and n <= 16]
        problems.append(
            f"engine.tensor_parallel_size {tp} does not divide the target's {heads} attention "
            f"heads (config.json num_attention_heads), which vLLM requires. Fix: "
            f"engine.tensor_parallel_size one of {divisors}"
        )
    elif shape.mla_latent is None and (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
        problems.append(
            f"engine.tensor_parallel_size {tp} and the target's {kv_heads} KV heads "
            f"(num_key_value_heads): vLLM splits them evenly or replicates them, so one must "
            f"divide the other. Fix: engine.tensor_parallel_size dividing {kv_heads}, or a "
            f"multiple of it dividing {heads}"
        )
    return problems


def check_config(config: Mapping[str, Any], shape: TargetShape | None = None) -> list[str]:
    """Raise ConfigCheckError with every cross-key problem of a validated config; return notes
    on the checks skipped for want of the target's config.json (``shape`` None)."""
    settings = {stage: engine_settings(config, stage) for stage in STAGES}
    problems = _regenerate_problems(config, settings["regenerate"])
    problems += _context_problems(config, settings, shape)
    problems += _cache_problems(config, settings, shape)
    notes = []
    if shape is not None:
        problems += _target_problems(config, settings, shape)
    else:
        notes.append(
            f"target.source {config['target']['source']}, target.path "
            f"{config['target'].get('path')!r}: no config.json before prepare_target runs, so "
            "the checks that need the target's shape were skipped (KV cache bytes against one "
            "sequence, tensor parallel size against the heads, a float32 bench of a large "
            "target); python -m draftflow.plan --target-config CONFIG.json runs them"
        )
    if problems:
        raise ConfigCheckError(
            "the config's keys contradict each other:\n" + "\n".join(f"- {p}" for p in problems)
        )
    return notes


def check_workflow_config(config: Mapping[str, Any]) -> list[str]:
    """The start checks of rules/common.smk: with the target's config.json where it is local.

    A config.json whose shape cannot be read here (an architecture or quantization this module
    does not know) does not stop the run: its checks are skipped, and the notes say why."""
    found = local_target_config(config)
    if found is None:
        return check_config(config, None)
    try:
        shape = target_shape(found)
    except (ValueError, KeyError, TypeError) as error:
        notes = check_config(config, None)
        return [f"{config['target']['path']}/config.json: {error}", *notes]
    return check_config(config, shape)
