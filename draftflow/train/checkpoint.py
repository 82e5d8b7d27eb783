"""Resumable training checkpoints without pickle: safetensors for tensors, JSON for the rest.

``checkpoints/step-NNNNNNNN/`` holds
- ``model.safetensors``: the trainable weights (fp32, exact);
- ``optimizer.safetensors``: every tensor of every optimizer's state, keyed
  ``opt{i}/{param index}/{name}``, plus the RNG states (``rng/...``);
- ``state.json``: step, the settings fingerprint, and the optimizers' non-tensor state
  (param groups, scalar state) — enough to rebuild ``optimizer.state_dict()`` exactly.

A checkpoint is written to a hidden temporary directory and renamed into place, then
``latest.json`` is replaced atomically: a kill at any moment leaves the previous checkpoint valid.

Beside them, ``metrics.jsonl`` is the metrics log's history (see ``metrics.MetricsLog``), and
``COMPLETE`` is written when a run has exported its draft. A run that finds ``COMPLETE`` is not
resuming a killed job: its predecessor finished, so Snakemake reruns it on purpose (``--forcerun``,
changed inputs or code), and it trains from scratch.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from draftflow.io import atomic_write_json, read_json, staged_dir
from draftflow.train.distributed import Placement
from draftflow.train.job import TrainJob

log = logging.getLogger(__name__)

LATEST = "latest.json"
METRICS_HISTORY = "metrics.jsonl"
COMPLETE = "COMPLETE"


def metrics_history(checkpoint_dir: str | os.PathLike[str]) -> Path:
    return Path(checkpoint_dir) / METRICS_HISTORY


def mark_complete(checkpoint_dir: str | os.PathLike[str], step: int) -> None:
    """Record that the run finished (written after the export; read by :func:`resume`)."""
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(checkpoint_dir) / COMPLETE, {"step": step})


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def flatten_optimizer(index: int, state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split ``optimizer.state_dict()`` into tensors and a JSON-able remainder."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, entries in state_dict["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"opt{index}/{param_id}/{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(param_id), {})[name] = value
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}
        for group in state_dict["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalar_state": scalars}


def unflatten_optimizer(index: int, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Inverse of :func:`flatten_optimizer` (``load_state_dict`` moves state to each param)."""
    state: dict[int, dict[str, Any]] = {}
    prefix = f"opt{index}/"
    for key, value in tensors.items():
        if key.startswith(prefix):
            _, param_id, name = key.split("/", 2)
            state.setdefault(int(param_id), {})[name] = value
    for param_id, entries in meta["scalar_state"].items():
        state.setdefault(int(param_id), {}).update(entries)
    groups = []
    for group in meta["param_groups"]:
        group = dict(group)
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    return {"state": state, "param_groups": groups}


def rng_tensors() -> dict[str, torch.Tensor]:
    states = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            states[f"rng/cuda{i}"] = state
    return states


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["rng/cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng/cuda")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizers: list[torch.optim.Optimizer],
    state: dict,
    keep: int,
) -> Path:
    """Write checkpoint ``step`` atomically and keep the newest ``keep`` of them."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    model_tensors = {k: v.detach().cpu().contiguous() for k, v in model_state.items()}
    opt_tensors = rng_tensors()
    opt_meta = []
    for index, optimizer in enumerate(optimizers):
        tensors, meta = flatten_optimizer(index, optimizer.state_dict())
        opt_tensors.update(tensors)
        opt_meta.append(meta)
    size = sum(
        t.numel() * t.element_size() for t in [*model_tensors.values(), *opt_tensors.values()]
    )
    with staged_dir(final, size=size) as tmp:
        save_file(model_tensors, str(tmp / "model.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        atomic_write_json(tmp / "state.json", {**state, "step": step, "optimizers": opt_meta})
    atomic_write_json(root / LATEST, {"step": step, "dir": final.name})
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / read_json(pointer)["dir"]
    return path if (path / "state.json").is_file() else None


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
) -> dict:
    """Restore weights, optimizer state and RNG; return state.json."""
    path = Path(path)
    state = read_json(path / "state.json")
    weights = load_file(str(path / "model.safetensors"))
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    if set(weights) != trainable:
        raise ValueError(
            f"checkpoint {path} holds weights {sorted(set(weights) ^ trainable)} that do not "
            "match the model's trainable ones"
        )
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    tensors = load_file(str(path / "optimizer.safetensors"))
    for index, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(unflatten_optimizer(index, tensors, state["optimizers"][index]))
    restore_rng(tensors)
    return state


def shard_digest(shard_dir: str) -> str:
    """The sha256 of a shard's index: changes whenever its samples do."""
    return read_json(Path(shard_dir) / "manifest.json")["files"]["index.json"]


def resume(job: TrainJob, model, optimizers, identity: dict, placement: Placement) -> int:
    """Load the newest checkpoint written under the same settings and data; return its step.

    Checkpoints of a run that finished (``COMPLETE``) or of other settings or data are removed,
    and training starts from step 0.
    """
    root = Path(job.checkpoint_dir)
    discard = None
    path = latest_checkpoint(root)
    if (root / COMPLETE).is_file():
        discard = (
            "the previous run of this job finished (COMPLETE), so this is a forced or changed "
            "rerun, not a resume"
        )
    elif path is not None:
        state = read_json(path / "state.json")
        mismatched = [k for k in identity if state.get(k) != identity[k]]
        if mismatched:
            discard = f"{mismatched} changed"
    if placement.world_size > 1:  # every rank decides before rank 0 removes anything
        dist.barrier()
    if discard is not None:
        if placement.is_main:
            log.warning("discarding checkpoints in %s: %s; training from scratch", root, discard)
            shutil.rmtree(root)
        if placement.world_size > 1:
            dist.barrier()
        return 0
    if path is None:
        return 0
    state = load_checkpoint(path, model, optimizers)
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])
