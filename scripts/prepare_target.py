"""Rule prepare_target: the target as a bf16 HF checkpoint under resources/target."""

from pathlib import Path

from draftflow.target.prepare import prepare_configured_target
from draftflow.workflow.script import setup_logging

setup_logging(snakemake)
prepare_configured_target(Path(snakemake.output.config).parent, snakemake.params.target)
