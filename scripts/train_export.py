"""Rule train_export (streamed mode): the last link's checkpoint -> the draft and metrics.jsonl,
the files rule train writes in the stored mode."""

from draftflow.train.job import rule_job
from draftflow.train.links import export_chain
from draftflow.train.stream import read_stream_plan
from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)
job = rule_job(
    snakemake,
    train_shards=read_stream_plan(snakemake.input.plan)["shards"],
    draft_dir=snakemake.output.draft,
    metrics_path=snakemake.output.metrics,
    stream_plan=snakemake.input.plan,
)
export_chain(job, snakemake.input.last)
log.info("train done: draft in %s", job.draft_dir)
