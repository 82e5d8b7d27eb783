"""Rule train_export (streamed mode): the last link's checkpoint -> the draft and metrics.jsonl,
the files rule train writes in the stored mode."""

from draftflow.config import from_section
from draftflow.train.job import TrainJob
from draftflow.train.links import export_chain
from draftflow.train.settings import TrainSettings
from draftflow.train.stream import read_stream_plan
from draftflow.workflow.script import setup_logging, target_dir

log = setup_logging(snakemake)
job = TrainJob(
    target_dir=str(target_dir(snakemake)),
    vocab_path=snakemake.input.vocab,
    train_shards=read_stream_plan(snakemake.input.plan)["shards"],
    val_shards=list(snakemake.input.val),
    draft_dir=snakemake.output.draft,
    metrics_path=snakemake.output.metrics,
    checkpoint_dir=snakemake.params.checkpoint_dir,
    settings=from_section(TrainSettings, snakemake.params.train, "train"),
    trust_remote_code=snakemake.params.trust_remote_code,
    stream_plan=snakemake.input.plan,
)
export_chain(job, snakemake.input.last)
log.info("train done: draft in %s", job.draft_dir)
