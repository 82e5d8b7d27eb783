"""The disk plan of the extract stage: what each shard's capture store will take, before capture.

Computed from the shard stage's manifest (``results/shard/manifest.json``: samples and tokens per
shard), the captured layers, the hidden size and the store dtype. Tensor bytes are exact: a chunk holds, per token, the states of every captured layer in the
store dtype (plus one float32 scale per layer in fp8 stores), an int32 token id and an int8 loss
mask (``draftflow/capture/store.py``). Safetensors headers, ``index.json`` and ``manifest.json``
grow with the samples and chunks; they are estimated from above (``overhead_bytes``).

In the streamed mode (extract.mode: streamed, ``window`` set) the train stores are temporary
and at most ``window`` of them are on disk at once: the plan's peak (``peak_bytes``, what
``fits`` is judged on) is then the ``window`` largest train stores plus the val stores, instead
of the whole store (``total_bytes``).

``python -m draftflow.capture.plan results/extract/plan.json`` prints a plan written by the
``plan_extract`` rule (``make plan``).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from draftflow.capture.layers import CaptureLayers
from draftflow.capture.quant import state_bytes_per_token
from draftflow.io import read_json

# input_ids int32 + loss_mask int8, per token.
TOKEN_BYTES = 4 + 1
# Upper bounds, measured on SmolLM2 stores with a 100-character model path: a chunk header is
# ~600 bytes plus its sample list, index.json ~90 bytes per sample, the manifest ~1 KB plus 90
# bytes per chunk and the verification results.
_PER_SAMPLE_OVERHEAD = 256
_PER_CHUNK_OVERHEAD = 4096
_PER_SHARD_OVERHEAD = 65536


class InsufficientSpaceError(RuntimeError):
    """The results directory's file system has less free space than the job will write."""


@dataclass(frozen=True)
class ShardPlan:
    output: str
    input: str
    num_samples: int
    num_tokens: int
    tensor_bytes: int
    overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.tensor_bytes + self.overhead_bytes


def bytes_per_token(layers: CaptureLayers, store_dtype: str) -> int:
    """Exact chunk tensor bytes of one token."""
    return (
        state_bytes_per_token(len(layers.layer_ids), layers.hidden_size, store_dtype) + TOKEN_BYTES
    )


def overhead_bytes(num_samples: int, chunk_samples: int) -> int:
    """Upper bound of a store's bytes that are not tensors."""
    chunks = math.ceil(num_samples / chunk_samples)
    return num_samples * _PER_SAMPLE_OVERHEAD + chunks * _PER_CHUNK_OVERHEAD + _PER_SHARD_OVERHEAD


def plan_store(
    num_tokens: int, num_samples: int, layers: CaptureLayers, store_dtype: str, chunk_samples: int
) -> tuple[int, int]:
    """(tensor bytes, overhead bytes) of a store of ``num_samples`` samples, ``num_tokens`` tokens."""
    return (
        num_tokens * bytes_per_token(layers, store_dtype),
        overhead_bytes(num_samples, chunk_samples),
    )


def plan_extract(
    shard_manifest: dict,
    layers: CaptureLayers,
    store_dtype: str,
    chunk_samples: int,
    results_dir: str | os.PathLike[str],
    margin_bytes: int,
    window: int | None,
) -> dict:
    """The plan of every extract job, from the shard stage's manifest; ``window``: the
    streamed mode's train captures on disk at once (extract.window; None: the stored mode)."""
    plans = []
    results_dir = Path(results_dir)
    for split, entry in sorted(shard_manifest["splits"].items()):
        for shard in entry["shards"]:
            samples, tokens = int(shard["samples"]), int(shard["tokens"])
            tensor, overhead = plan_store(tokens, samples, layers, store_dtype, chunk_samples)
            output = str(results_dir / "extract" / split / shard["name"])
            plans.append(ShardPlan(output, shard["path"], samples, tokens, tensor, overhead))
    total = sum(p.total_bytes for p in plans)
    peak = total if window is None else window_peak(plans, window)
    free = free_bytes(results_dir)
    return {
        "mode": "stored" if window is None else "streamed",
        "window": window,
        "store_dtype": store_dtype,
        "layer_ids": layers.layer_ids,
        "hidden_size": layers.hidden_size,
        "bytes_per_token": bytes_per_token(layers, store_dtype),
        "chunk_samples": chunk_samples,
        "shards": [{**asdict(p), "total_bytes": p.total_bytes} for p in plans],
        "num_tokens": sum(p.num_tokens for p in plans),
        "tensor_bytes": sum(p.tensor_bytes for p in plans),
        "total_bytes": total,
        "peak_bytes": peak,
        "margin_bytes": margin_bytes,
        "results_dir": str(results_dir),
        "free_bytes": free,
        "fits": free >= peak + margin_bytes,
    }


def window_peak(plans: list[ShardPlan], window: int) -> int:
    """Bytes on disk at the streamed mode's peak: the ``window`` largest train stores (any
    ``window`` links may be captured at once) plus every val store (captured once, kept)."""
    train = sorted(
        (p.total_bytes for p in plans if Path(p.output).parent.name == "train"), reverse=True
    )
    val = sum(p.total_bytes for p in plans if Path(p.output).parent.name != "train")
    return sum(train[:window]) + val


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_plan(plan: dict) -> str:
    """The plan as lines for a log: one per shard, then the total against the free space."""
    lines = [
        f"extract disk plan: {plan['store_dtype']}, layers {plan['layer_ids']}, hidden "
        f"{plan['hidden_size']}: {plan['bytes_per_token']} bytes per token"
    ]
    for shard in plan["shards"]:
        lines.append(
            f"  {shard['output']}: {shard['num_samples']} samples, {shard['num_tokens']} tokens, "
            f"{_size(shard['total_bytes'])} ({shard['tensor_bytes']} tensor bytes)"
        )
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    if plan.get("mode") == "streamed":
        lines.append(
            f"  whole store (not kept): {plan['num_tokens']} tokens, "
            f"{_size(plan['total_bytes'])}; streamed, window {plan['window']}: at most "
            f"{plan['window']} train stores at once"
        )
        lines.append(
            f"  peak: {_size(plan['peak_bytes'])} ({plan['peak_bytes']} bytes) + margin "
            f"{_size(plan['margin_bytes'])}; free under {plan['results_dir']}: "
            f"{_size(plan['free_bytes'])}: {verdict}"
        )
        return "\n".join(lines)
    lines.append(
        f"  total: {plan['num_tokens']} tokens, {_size(plan['total_bytes'])} "
        f"({plan['tensor_bytes']} tensor bytes) + margin {_size(plan['margin_bytes'])}; "
        f"free under {plan['results_dir']}: {_size(plan['free_bytes'])}: {verdict}"
    )
    return "\n".join(lines)


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes (for an unprivileged writer) of the file system holding ``path``."""
    path = Path(path).absolute()
    while not path.exists():  # a directory not made yet lives on its nearest parent's fs
        path = path.parent
    return shutil.disk_usage(path).free


def check_free_space(
    directory: str | os.PathLike[str], need_bytes: int, margin_bytes: int, what: str
) -> int:
    """Raise InsufficientSpaceError unless ``need_bytes + margin_bytes`` are free; return free."""
    free = free_bytes(directory)
    if free < need_bytes + margin_bytes:
        raise InsufficientSpaceError(
            f"{what} will write {need_bytes} bytes ({_size(need_bytes)}) under {directory}, "
            f"which has {free} bytes ({_size(free)}) free; with the margin of {margin_bytes} "
            f"bytes (extract.disk_margin_mb) it needs {need_bytes + margin_bytes}. Free "
            "space, or use extract.store_dtype: float8_e4m3fn (half the bytes)"
        )
    return free


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="plan.json written by the plan_extract rule")
    args = parser.parse_args(argv)
    print(format_plan(read_json(args.plan)))


if __name__ == "__main__":
    main()
