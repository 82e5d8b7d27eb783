"""Check captured states against the transformers reference (per-layer token cosines).

bf16 capture differs from an fp32 reference by a few bf16 steps, and single tokens on deep layers
can drop well below the mean (measured down to 0.977 on vLLM 0.16): a shard is judged by the mean
and the 1st percentile of token cosines per layer, not by its worst token. fp8 stores are compared after dequantization (what training reads), so
the check covers the quantization error too.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from draftflow.capture.backends import CaptureEngineSettings
from draftflow.capture.store import CaptureReader

log = logging.getLogger(__name__)


class CaptureVerificationError(RuntimeError):
    """Captured states disagree with the reference beyond the configured thresholds."""


def token_cosines(captured: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Cosine of each token's state, ``[T, L]``, computed in fp32."""
    if captured.shape != reference.shape:
        raise ValueError(f"shape {tuple(captured.shape)} != reference {tuple(reference.shape)}")
    return torch.nn.functional.cosine_similarity(captured.float(), reference.float(), dim=-1)


def cosine_summary(cosines: torch.Tensor, layer_ids: list[int]) -> dict[str, dict[str, float]]:
    """Per layer id: mean, 1st percentile and minimum of ``cosines [tokens, L]``."""
    summary = {}
    for column, layer_id in enumerate(layer_ids):
        values = cosines[:, column].contiguous()
        # kthvalue, not quantile: quantile refuses inputs over 16M elements.
        rank = max(1, math.ceil(0.01 * values.numel()))
        summary[str(layer_id)] = {
            "mean": float(values.mean()),
            "p01": float(values.kthvalue(rank).values),
            "min": float(values.min()),
        }
    return summary


def below(value: float, threshold: float) -> str:
    """``value`` with the fewest decimals (5 or more) that still show it below ``threshold``: a
    float32 capture can miss a threshold of 1.0 by less than 0.000005."""
    for decimals in range(5, 17):
        text = f"{value:.{decimals}f}"
        if float(text) < threshold:
            return text
    return repr(value)


def cosine_failures(
    per_layer: dict[str, dict[str, float]], min_mean_cosine: float, min_p01_cosine: float
) -> list[str]:
    """Each layer whose mean or 1st-percentile token cosine is below its threshold, as a line."""
    return [
        f"layer {layer}: {stat} cosine {below(values[stat], threshold)} < {threshold}"
        for layer, values in per_layer.items()
        for stat, threshold in (("mean", min_mean_cosine), ("p01", min_p01_cosine))
        if values[stat] < threshold
    ]


def pick_samples(num_samples: int, fraction: float) -> list[int]:
    """Deterministic, evenly spread sample indices: ``fraction`` of them, at least one."""
    if num_samples == 0:
        return []
    count = min(num_samples, max(1, math.ceil(fraction * num_samples)))
    return sorted({round(i * (num_samples - 1) / max(1, count - 1)) for i in range(count)})


def verified_layers(layer_ids: list[int], max_layer: int | None) -> tuple[list[int], list[int]]:
    """(store columns, layer ids) the verification compares: all, or those up to ``max_layer``."""
    if max_layer is None:
        return list(range(len(layer_ids))), list(layer_ids)
    kept = [(column, i) for column, i in enumerate(layer_ids) if i <= max_layer]
    if not kept:
        raise ValueError(
            f"extract.verify.max_layer {max_layer} is below every captured layer {layer_ids}"
        )
    return [column for column, _ in kept], [i for _, i in kept]


def verify_shard(
    shard_dir: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    *,
    fraction: float,
    min_mean_cosine: float,
    min_p01_cosine: float,
    settings: CaptureEngineSettings,
    max_layer: int | None,
) -> dict:
    """Recompute some samples with the hf backend and compare; returns the results (+ passed).

    ``max_layer``: compare only the captured layers up to that id, against the target cut to
    its first layers (a target too large to load whole still gets its low layers checked).
    """
    from draftflow.capture.backends.hf import HFBackend

    reader = CaptureReader(shard_dir)
    columns, layer_ids = verified_layers(reader.layer_ids, max_layer)
    num_layers = layer_ids[-1] if max_layer is not None else None
    reference_name = f"hf {settings.hf_dtype}" + (
        f", first {num_layers} layers" if num_layers is not None else ""
    )
    indices = pick_samples(len(reader), fraction)
    if not indices:  # an empty shard: nothing to compare
        return {
            "reference": reference_name,
            "samples": [],
            "num_tokens": 0,
            "per_layer": {},
            "failures": [],
            "passed": True,
        }
    reference_backend = HFBackend(model_dir, layer_ids, settings, num_layers=num_layers)
    cosines = []
    try:
        for index in indices:
            input_ids = reader.get(index)["input_ids"]
            (reference,) = reference_backend.capture([input_ids.tolist()])
            captured = reader.hidden_states(index)[:, columns]
            cosines.append(token_cosines(captured, reference))
    finally:
        reference_backend.close()
    per_layer = cosine_summary(torch.cat(cosines), layer_ids)
    failures = cosine_failures(per_layer, min_mean_cosine, min_p01_cosine)
    result = {
        "reference": reference_name,
        "store_dtype": reader.store_dtype,
        "samples": [reader.sample_ids[i] for i in indices],
        "num_tokens": int(sum(c.shape[0] for c in cosines)),
        "per_layer": per_layer,
        "min_mean_cosine": min_mean_cosine,
        "min_p01_cosine": min_p01_cosine,
        "failures": failures,
        "passed": not failures,
    }
    log.info(
        "verification of %s on %d sample(s), %d tokens: %s",
        shard_dir,
        len(indices),
        result["num_tokens"],
        "passed" if result["passed"] else "FAILED",
    )
    for layer, values in per_layer.items():
        log.info(
            "  layer %s: mean %.5f p01 %.5f min %.5f",
            layer,
            values["mean"],
            values["p01"],
            values["min"],
        )
    return result
