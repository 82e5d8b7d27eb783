"""Rule plan_extract: the shard manifest + the target -> results/extract/plan.json (the disk plan)."""

from pathlib import Path

from draftflow.capture.extract import ExtractSettings
from draftflow.capture.layers import capture_layers
from draftflow.capture.plan import format_plan, plan_extract
from draftflow.config import from_section
from draftflow.io import atomic_write_json, read_json
from draftflow.workflow.script import setup_logging, target_dir

log = setup_logging(snakemake)
settings = from_section(ExtractSettings, snakemake.params.extract, "extract")
plan = plan_extract(
    read_json(snakemake.input.shard_manifest),
    capture_layers(target_dir(snakemake), settings.aux_layers),
    settings.store_dtype,
    settings.chunk_samples,
    # results/extract/plan.json: the results directory is two levels up.
    Path(snakemake.output[0]).parents[1],
    settings.disk_margin_mb << 20,
    window=snakemake.params.window,
)
atomic_write_json(snakemake.output[0], plan)
log.info("%s", format_plan(plan))
print(format_plan(plan))
