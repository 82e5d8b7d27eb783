"""Rule stream_plan: the train shard files -> results/stream/train/plan/ (every shard's sample
lengths, which plan the streamed chain's steps before any capture)."""

from draftflow.train.stream import write_stream_plan
from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)
plan = write_stream_plan(list(snakemake.input.shards), snakemake.output[0])
log.info(
    "stream plan: %d train shards, %d samples, %d tokens",
    len(plan["lengths"]),
    plan["num_samples"],
    plan["num_tokens"],
)
