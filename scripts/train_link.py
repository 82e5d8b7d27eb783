"""Rule train_link: one link of the streamed chain: the steps of one (epoch, shard), from the
previous link's checkpoint to its own, on that shard's temporary capture."""

from draftflow.train.cli import launch
from draftflow.train.job import rule_job
from draftflow.workflow.gpu import gpu_lease
from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)
job = rule_job(
    snakemake,
    train_shards=[snakemake.input.capture],
    # The chain's draft and metrics.jsonl are written by rule train_export.
    draft_dir="",
    metrics_path="",
    link=int(snakemake.wildcards.link),
    stream_plan=snakemake.input.plan,
    marker_path=snakemake.output.marker,
)
gpus = int(snakemake.resources.gpu)
with gpu_lease(gpus):  # 0 GPUs on CPU runs: a no-op
    launch(job, gpus)
log.info("link %s done", snakemake.wildcards.link)
