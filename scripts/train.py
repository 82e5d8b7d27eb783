"""Rule train: capture shards + draft vocabulary -> a trained EAGLE-3 draft in speculators format.

With ``resources: gpu`` > 1 the job re-launches itself as torchrun workers (data parallel).
"""

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
    train_shards=list(snakemake.input.train),
    val_shards=list(snakemake.input.val),
    draft_dir=snakemake.output.draft,
    metrics_path=snakemake.output.metrics,
    checkpoint_dir=snakemake.params.checkpoint_dir,
    settings=settings,
    trust_remote_code=snakemake.params.trust_remote_code,
)
gpus = int(snakemake.resources.gpu)
with gpu_lease(gpus):  # 0 GPUs on CPU runs: a no-op
    launch(job, gpus)
log.info("train done: draft in %s", job.draft_dir)
