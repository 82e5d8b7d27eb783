"""Rule train: capture shards + draft vocabulary -> a trained EAGLE-3 draft in speculators format.

With ``resources: gpu`` > 1 the job re-launches itself as torchrun workers (data parallel).
"""

from draftflow.train.cli import launch
from draftflow.train.job import rule_job
from draftflow.workflow.gpu import gpu_lease
from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)
job = rule_job(
    snakemake,
    train_shards=list(snakemake.input.train),
    draft_dir=snakemake.output.draft,
    metrics_path=snakemake.output.metrics,
)
gpus = int(snakemake.resources.gpu)
with gpu_lease(gpus):  # 0 GPUs on CPU runs: a no-op
    launch(job, gpus)
log.info("train done: draft in %s", job.draft_dir)
