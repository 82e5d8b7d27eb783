"""Rule train_link: one link of the streamed chain: the steps of one (epoch, shard), from the
previous link's checkpoint to its own, on that shard's temporary capture."""

import dataclasses

from draftflow.config import from_section
from draftflow.train.cli import launch
from draftflow.train.job import TrainJob
from draftflow.train.settings import TrainSettings
from draftflow.workflow.gpu import gpu_lease
from draftflow.workflow.script import setup_logging, target_dir

log = setup_logging(snakemake)
settings = from_section(TrainSettings, snakemake.params.train, "train")
if settings.threads == 0:
    settings = dataclasses.replace(settings, threads=snakemake.threads)
job = TrainJob(
    target_dir=str(target_dir(snakemake)),
    vocab_path=snakemake.input.vocab,
    train_shards=[snakemake.input.capture],
    val_shards=list(snakemake.input.val),
    # The chain's draft and metrics.jsonl are written by rule train_export.
    draft_dir="",
    metrics_path="",
    checkpoint_dir=snakemake.params.checkpoint_dir,
    settings=settings,
    trust_remote_code=snakemake.params.trust_remote_code,
    link=int(snakemake.wildcards.link),
    stream_plan=snakemake.input.plan,
    marker_path=snakemake.output.marker,
)
gpus = int(snakemake.resources.gpu)
with gpu_lease(gpus):  # 0 GPUs on CPU runs: a no-op
    launch(job, gpus)
log.info("link %s done", snakemake.wildcards.link)
