"""Export the trained draft in the speculators format that vLLM loads directly.

``draft/config.json`` (speculators' ``Eagle3SpeculatorConfig``, its ``speculators_config``
naming the verifier), ``draft/model.safetensors`` (bf16, written by speculators'
``save_pretrained``, which leaves out the verifier-only weights), ``draft/README.md`` (model
card) and ``draft/draftflow_train.json`` (settings, data, final val metrics, and the sha256 of
``config.json`` and ``model.safetensors`` under ``files``). The directory is built beside its
final place and renamed into it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from draftflow.io import atomic_write_json, atomic_write_text, sha256_file, staged_dir
from draftflow.train.job import TrainJob

log = logging.getLogger(__name__)

EXPORT_DTYPE = torch.bfloat16


def save_speculators_checkpoint(model: torch.nn.Module, out_dir: str | os.PathLike[str]) -> None:
    """``save_pretrained`` in bf16, with config.json's dtype saying so (as speculators does)."""
    from speculators.train.checkpointer import patch_config_dtype

    state = {
        k: v.detach().to("cpu", EXPORT_DTYPE) if v.is_floating_point() else v.detach().cpu()
        for k, v in model.state_dict().items()
    }
    model.save_pretrained(str(out_dir), state_dict=state)
    patch_config_dtype(Path(out_dir) / "config.json", EXPORT_DTYPE)


def model_card(job: TrainJob, summary: dict) -> str:
    val = summary.get("val") or {}
    acc = ", ".join(f"{a:.3f}" for a in val.get("full_acc", []))
    cond = ", ".join(f"{a:.3f}" for a in val.get("cond_acc", []))
    settings = job.settings
    return f"""# EAGLE-3 draft for `{job.target_dir}`

Trained by draftflow with speculators' `Eagle3DraftModel` ({settings.num_layers} decoder layer(s),
draft vocabulary from `{job.vocab_path}`).

| | |
|---|---|
| target (verifier) | `{job.target_dir}` |
| train data | {summary["train_samples"]} samples, {summary["train_tokens"]} tokens in {len(job.train_shards)} capture shard(s) |
| val data | {summary["val_samples"]} samples in {len(job.val_shards)} capture shard(s) |
| steps | {summary["steps"]} ({settings.tokens_per_batch} tokens per batch per rank, {summary["world_size"]} rank(s), {summary["device"]}) |
| TTT steps | {settings.ttt_steps}, loss `{settings.loss}` against the target's distribution |
| optimizer | {settings.optimizer}, lr {settings.lr}, {settings.scheduler} schedule, seed {settings.seed} |
| val loss | {val.get("loss", float("nan")):.4f} |
| val accuracy, draft tokens 1..k all right | {acc} |
| val accuracy, token k given 1..k-1 right | {cond} |

Use with vLLM:

```python
LLM(model="{job.target_dir}",
    speculative_config={{"method": "eagle3", "model": "<this directory>", "num_speculative_tokens": {settings.ttt_steps}}})
```
"""


def export_draft(model: torch.nn.Module, job: TrainJob, summary: dict) -> Path:
    final = Path(job.draft_dir)
    with staged_dir(final) as tmp:
        save_speculators_checkpoint(model, tmp)
        # The checkpoint's own checksums: two runs of the same job can be compared by these.
        files = {path.name: sha256_file(path) for path in sorted(tmp.iterdir()) if path.is_file()}
        atomic_write_text(tmp / "README.md", model_card(job, summary))
        atomic_write_json(
            tmp / "draftflow_train.json",
            {
                **summary,
                "settings": job.settings.to_dict(),
                "target": job.target_dir,
                "files": files,
            },
        )
    log.info("exported the draft to %s", final)
    return final
