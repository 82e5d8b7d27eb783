"""The extract stage: capture one shard's hidden states into a verified capture store.

Flow: read the shard's samples → resume whatever complete chunks a killed run left behind →
capture the rest chunk by chunk (each engine call is exactly one chunk of samples, so a resumed run
sends the engine the same batches as an uninterrupted one) → close the store → recompute a few
samples with transformers and compare → move the finished store into place.

The store is written under ``.<name>.partial`` beside the output: Snakemake deletes a job's
declared output before rerunning it, which would throw a killed run's chunks away.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftflow.capture.backends import (
    CaptureBackend,
    CaptureEngineSettings,
    capture_stream,
    installed_vllm_version,
    make_backend,
    resolve_backend,
)
from draftflow.capture.layers import capture_layers
from draftflow.capture.plan import check_free_space, plan_store
from draftflow.capture.section import extract_section
from draftflow.capture.store import CaptureWriter, update_manifest
from draftflow.capture.verify import CaptureVerificationError, verify_shard
from draftflow.config import from_section
from draftflow.data.samples import read_samples
from draftflow.engine_settings import EngineSettings
from draftflow.io import publish_dir, read_json, sha256_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifySettings:
    fraction: float
    min_mean_cosine: float
    min_p01_cosine: float
    # Reference compute dtype of the hf recomputation.
    dtype: str
    # Check only the captured layers up to this id, with the target cut to its first layers
    # (None = all layers, the whole target loaded).
    max_layer: int | None


@dataclass(frozen=True)
class ExtractSettings:
    """An extract job's settings (``draftflow.capture.section.extract_section``): the ``extract:``
    section's capture keys and the extract stage's vLLM engine."""

    backend: str
    aux_layers: list[int] | None
    # CPU threads of the job (the rule's threads:)
    threads: int
    model_runner: str
    # Same shard, same bytes (docs/capture.md, "Determinism").
    deterministic: bool
    chunk_samples: int
    store_dtype: str
    # Free space kept beyond what the store will write (docs/capture.md, "Disk plan").
    disk_margin_mb: int
    hf_dtype: str
    # from the target: section
    trust_remote_code: bool
    verify: VerifySettings
    # engine_settings(config, "extract"): devices, batch, memory and engine_args, the same
    # path as regenerate's and bench's engines.
    engine: EngineSettings

    @property
    def device(self) -> str:
        """The torch device of the hf backend and the verification reference."""
        return "cuda" if self.engine.device == "gpu" else "cpu"

    def capture_engine(self, max_model_len: int) -> CaptureEngineSettings:
        """The capture backend's settings for samples of up to ``max_model_len`` - 1 tokens."""
        engine = self.engine
        return CaptureEngineSettings(
            max_model_len=max_model_len,
            tp_size=engine.tensor_parallel_size,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_num_seqs=engine.max_num_seqs,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
            reserved_cpus=engine.reserved_cpus,
            model_runner=self.model_runner,
            engine_args=dict(engine.engine_args),
            deterministic=self.deterministic,
            trust_remote_code=self.trust_remote_code,
            hf_dtype=self.hf_dtype,
            device=self.device,
            store_dtype=self.store_dtype,
        )


def extract_settings(config: Mapping[str, Any]) -> ExtractSettings:
    """An extract job's settings from a validated config, as the extract rules build them
    (their ``params.extract`` is ``extract_section(config)``)."""
    return from_section(ExtractSettings, extract_section(config), "extract")


def model_revision(model_dir: str | os.PathLike[str]) -> str:
    """The prepared target's content hash (``draftflow_target.json``), else one computed here."""
    from draftflow.target.prepare import TARGET_INFO, checkpoint_revision

    info = Path(model_dir) / TARGET_INFO
    if info.is_file():
        revision = read_json(info).get("revision")
        if revision:
            return str(revision)
    return checkpoint_revision(model_dir)


def partial_dir(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.partial")


def run_extract(
    shard_path: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    settings: ExtractSettings,
    backend: CaptureBackend | None = None,
) -> dict:
    """Capture, verify and publish one shard; returns its manifest.

    ``backend``: an already started backend to use (and leave open), e.g. one engine shared by
    several shards in a benchmark or a test session; by default one is started and closed here.
    """
    shard_path, out_dir = Path(shard_path), Path(out_dir)
    table = read_samples(shard_path)
    ids: list[str] = table.column("id").to_pylist()
    input_ids: list[list[int]] = table.column("input_ids").to_pylist()
    loss_masks: list[list[int]] = table.column("loss_mask").to_pylist()
    layers = capture_layers(model_dir, settings.aux_layers)
    backend_name = backend.name if backend is not None else resolve_backend(settings.backend)
    if backend is not None:
        vllm_version = backend.vllm_version
    else:
        vllm_version = installed_vllm_version() if backend_name != "hf" else None
    meta = {
        "model": str(model_dir),
        "model_revision": model_revision(model_dir),
        "backend": backend_name,
        "vllm_version": vllm_version,
        "input": shard_path.name,
        "input_sha256": sha256_file(shard_path),
    }
    # One spare position: vLLM wants room for the one token it samples.
    engine = settings.capture_engine(max((len(ids_) for ids_ in input_ids), default=1) + 1)
    work = partial_dir(out_dir)
    writer = CaptureWriter(
        work,
        layer_ids=layers.layer_ids,
        aux_layer_ids=layers.aux_layer_ids,
        hidden_size=layers.hidden_size,
        meta=meta,
        chunk_samples=settings.chunk_samples,
        store_dtype=settings.store_dtype,
    )
    start = writer.resume_position(ids)
    # The chunks kept from a killed run are on disk already: only the rest is still to write.
    tensor_bytes, overhead = plan_store(
        sum(len(x) for x in input_ids[start:]),
        len(ids) - start,
        layers,
        settings.store_dtype,
        settings.chunk_samples,
    )
    free = check_free_space(
        work, tensor_bytes + overhead, settings.disk_margin_mb << 20, f"extract {shard_path}"
    )
    log.info(
        "extract %s: will write %d bytes (%d of tensors, %s store), %d bytes free",
        shard_path,
        tensor_bytes + overhead,
        tensor_bytes,
        settings.store_dtype,
        free,
    )
    log.info(
        "extract %s: %d samples, %d tokens, layers %s, backend %s; %d already captured",
        shard_path,
        len(ids),
        sum(map(len, input_ids)),
        layers.layer_ids,
        backend_name,
        start,
    )
    if start < len(ids):
        own_backend = backend is None
        if own_backend:
            backend = make_backend(backend_name, model_dir, layers.layer_ids, engine)
        try:
            _capture_all(writer, backend, start, ids, input_ids, loss_masks, settings.chunk_samples)
        finally:
            if own_backend:
                backend.close()
    manifest = writer.close()

    verify = settings.verify
    results = verify_shard(
        work,
        model_dir,
        fraction=verify.fraction,
        min_mean_cosine=verify.min_mean_cosine,
        min_p01_cosine=verify.min_p01_cosine,
        max_layer=verify.max_layer,
        # The job's own settings in the reference dtype: the hf backend reads only hf_dtype,
        # device and trust_remote_code of them.
        settings=replace(engine, hf_dtype=verify.dtype),
    )
    manifest = update_manifest(work, {"verification": results})
    if not results["passed"]:
        raise CaptureVerificationError(
            f"extract {shard_path}: captured states disagree with the hf reference "
            f"({'; '.join(results['failures'])}); the store is kept in {work} for inspection. "
            "Thresholds: extract.verify.min_mean_cosine / min_p01_cosine"
        )
    publish_dir(work, out_dir)
    return manifest


def _capture_all(
    writer: CaptureWriter,
    backend: CaptureBackend,
    start: int,
    ids: list[str],
    input_ids: list[list[int]],
    loss_masks: list[list[int]],
    chunk_samples: int,
) -> None:
    """One engine call per chunk; samples go to the store as the backend hands them over (the
    store writes each one into its chunk's file on its own threads while the engine goes on:
    announced up front, every chunk's layout is known before its samples arrive)."""
    writer.expect((ids[i], len(input_ids[i])) for i in range(start, len(ids)))
    total_tokens = sum(len(x) for x in input_ids[start:])
    progress = tqdm(total=len(ids) - start, desc="extract", unit="sample", mininterval=5)
    began, done_tokens = time.monotonic(), 0
    try:
        # start is a chunk boundary: the store keeps only complete chunks.
        for first in range(start, len(ids), chunk_samples):
            batch = range(first, min(first + chunk_samples, len(ids)))
            states = capture_stream(backend, [input_ids[i] for i in batch])
            for i, sample_states in zip(batch, states, strict=True):
                writer.add(
                    ids[i],
                    torch.tensor(input_ids[i], dtype=torch.int32),
                    torch.tensor(loss_masks[i], dtype=torch.int8),
                    sample_states,
                )
                done_tokens += len(input_ids[i])
                progress.update(1)
            rate = done_tokens / max(time.monotonic() - began, 1e-9)
            progress.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
            log.info(
                "captured %d/%d samples, %d/%d tokens, %.0f tokens/s",
                batch.stop,
                len(ids),
                done_tokens,
                total_tokens,
                rate,
            )
    finally:
        progress.close()
