"""Rule split: samples -> train/val/test by a stable hash of the conversation id."""

from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)

from dataclasses import asdict  # noqa: E402

from draftflow.config import from_section  # noqa: E402
from draftflow.data.split import SplitSettings, split_samples  # noqa: E402

output = snakemake.output
summary = split_samples(
    samples_path=snakemake.input.samples,
    outputs={"train": output.train, "val": output.val, "test": output.test},
    summary_path=output.summary,
    **asdict(from_section(SplitSettings, snakemake.params.split, "split")),
)
log.info("split: %s", summary["splits"])
