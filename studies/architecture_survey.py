"""Which decoder architectures the hooks backend captures: one small random-weight target each,
hooks (vLLM) against hf (transformers fp32), scored as the extract job's verification scores.

Each architecture is a transformers config (hidden 128, 8 layers, random weights, SmolLM2's
tokenizer), saved and captured with chunked prefill (prompts of 7-300 tokens, 128 batched
tokens). A target passes when every captured layer's mean token cosine is at least
``extract.verify.min_mean_cosine`` and its 1st percentile at least ``min_p01_cosine``; an
engine that cannot start is recorded with its root cause. The families the tests build
(tests/families.py) are not repeated here: this is the wider net.

Usage (docs/capture.md, "Model families"; results in docs/results/architecture-survey.json)::

    PYTHONPATH=$PWD .venv/bin/python studies/architecture_survey.py --work /tmp/survey \\
        --tokenizer .test-cache/smollm2 --out docs/results/architecture-survey.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

COMMON = {
    "vocab_size": 49152,
    "num_hidden_layers": 8,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# architecture -> (transformers config class, model class, settings beyond COMMON)
ARCHITECTURES = {
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"intermediate_size": 256, "head_dim": 32, "sliding_window": 64}),
    "gpt_oss_4x2": ("GptOssConfig", "GptOssForCausalLM", {"intermediate_size": 128, "head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"intermediate_size": 256, "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0, "attention_multiplier": 0.015625}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"intermediate_size": 256}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"intermediate_size": 256, "head_dim": 32}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"intermediate_size": 256}),
}  # fmt: skip
LENGTHS = [7, 300, 40, 130]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_target(name: str, out: Path, tokenizer: Path) -> Path:
    import torch
    import transformers

    config_class, model_class, settings = ARCHITECTURES[name]
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**COMMON, **settings)
        model = getattr(transformers, model_class)(config)
        model.to(torch.bfloat16).save_pretrained(str(out))
        for file in TOKENIZER_FILES:
            if (tokenizer / file).exists():
                shutil.copy(tokenizer / file, out / file)
    return out


def survey_one(name: str, work: Path, tokenizer: Path) -> dict:
    from dataclasses import replace

    import torch

    from draftflow.capture.backends import make_backend
    from draftflow.capture.extract import VerifySettings, extract_settings
    from draftflow.capture.layers import capture_layers
    from draftflow.capture.verify import cosine_failures, cosine_summary, token_cosines
    from draftflow.config import DEMO_CONFIG, from_section, load_config

    target = build_target(name, work / name, tokenizer)
    architecture = json.loads((target / "config.json").read_text())["architectures"][0]
    demo = load_config(DEMO_CONFIG)
    layers = capture_layers(target, demo["extract"]["aux_layers"])
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 49_000, (n,), generator=generator).tolist() for n in LENGTHS]
    # The demo's capture engine, small enough that prompts are chunked; vLLM's choice of cores.
    engine = replace(
        extract_settings(demo).capture_engine(320),
        max_num_batched_tokens=128,
        max_num_seqs=4,
        kv_cache_memory_bytes=32 << 20,
        reserved_cpus=None,
        deterministic=False,
    )
    row: dict = {"name": name, "architecture": architecture, "layer_ids": layers.layer_ids}
    began = time.monotonic()
    try:
        backend = make_backend("hooks", target, layers.layer_ids, engine)
        try:
            captured = backend.capture(prompts)
            row["max_forwards_per_request"] = backend.last_stats["max_forwards_per_request"]
        finally:
            backend.close()
    except Exception as error:  # the engine's root cause is in the message (draftflow.engine)
        row.update(passed=False, error=f"{type(error).__name__}: {error}"[:2000])
        return row
    reference = make_backend("hf", target, layers.layer_ids, replace(engine, hf_dtype="float32"))
    try:
        expected = reference.capture(prompts)
    finally:
        reference.close()
    cosines = torch.cat([token_cosines(c, r) for c, r in zip(captured, expected, strict=True)])
    summary = cosine_summary(cosines, layers.layer_ids)
    # The demo's verification thresholds (config/demo.yaml, extract.verify).
    thresholds = from_section(VerifySettings, demo["extract"]["verify"], "extract.verify")
    row["per_layer"] = summary
    row["failures"] = cosine_failures(
        summary, thresholds.min_mean_cosine, thresholds.min_p01_cosine
    )
    row["passed"] = not row["failures"]
    row["seconds"] = round(time.monotonic() - began, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="where the targets are built")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a prepared SmolLM2 target")
    parser.add_argument("--only", nargs="+", choices=sorted(ARCHITECTURES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    import transformers
    import vllm

    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only or ARCHITECTURES:
        row = survey_one(name, args.work, args.tokenizer)
        rows.append(row)
        print("survey:", name, "passed" if row["passed"] else "FAILED", flush=True)
    result = {
        "command": "studies/architecture_survey.py (docs/capture.md, 'Model families')",
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prompt_lengths": LENGTHS,
        "architectures": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
