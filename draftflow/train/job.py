"""One training run's inputs and outputs, as the train script hands them to every worker."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from draftflow.config import from_section
from draftflow.io import read_json
from draftflow.train.settings import TrainSettings
from draftflow.workflow.script import target_dir


@dataclass
class TrainJob:
    """Everything one training run reads and writes (JSON-able: torchrun workers get it as a file)."""

    target_dir: str
    vocab_path: str
    train_shards: list[str]
    val_shards: list[str]
    draft_dir: str
    metrics_path: str
    checkpoint_dir: str
    settings: TrainSettings
    # target.trust_remote_code
    trust_remote_code: bool
    # Streamed mode (rules/stream.smk): this job is link ``link`` of the chain; ``train_shards``
    # is that link's one capture and ``stream_plan`` the stream plan's directory (every train
    # shard's sample lengths); ``marker_path`` the link's output.
    link: int | None = None
    stream_plan: str | None = None
    marker_path: str | None = None

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "settings": self.settings.to_dict()}, indent=2)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> TrainJob:
        data = read_json(path)
        data["settings"] = from_section(TrainSettings, data["settings"], "train")
        return cls(**data)


def rule_job(snakemake: Any, **fields: Any) -> TrainJob:
    """The job of a training rule's script (train, train_link, train_export): what every such
    rule reads from its inputs and params, plus the rule's own ``fields``. ``train.threads: 0``
    takes the rule's threads."""
    settings = from_section(TrainSettings, snakemake.params.train, "train")
    if settings.threads == 0:
        settings = dataclasses.replace(settings, threads=snakemake.threads)
    return TrainJob(
        target_dir=str(target_dir(snakemake)),
        vocab_path=snakemake.input.vocab,
        val_shards=list(snakemake.input.val),
        checkpoint_dir=snakemake.params.checkpoint_dir,
        settings=settings,
        trust_remote_code=snakemake.params.trust_remote_code,
        **fields,
    )
