"""Rule shard: train/val samples -> token-balanced shards, one extract job each."""

from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)

from draftflow.data.shard import shard_splits  # noqa: E402

output = snakemake.output
manifest = shard_splits(
    inputs={"train": snakemake.input.train, "val": snakemake.input.val},
    outputs={"train": list(output.train), "val": list(output.val)},
    manifest_path=output.manifest,
)
for split, entry in manifest["splits"].items():
    log.info(
        "%s: %d shards, max/min tokens %.3f",
        split,
        entry["num_shards"],
        entry["max_min_token_ratio"],
    )
