"""Rule split: samples -> train/val/test by a stable hash of the conversation id."""

from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)

from draftflow.data.split import split_samples  # noqa: E402

output = snakemake.output
summary = split_samples(
    samples_path=snakemake.input.samples,
    outputs={"train": output.train, "val": output.val, "test": output.test},
    summary_path=output.summary,
    seed=snakemake.params.seed,
    val_fraction=snakemake.params.val_fraction,
    test_fraction=snakemake.params.test_fraction,
)
log.info("split: %s", summary["splits"])
