"""Rule bench_table: one prompt set's tidy CSV and per-request outputs from every engine's result."""

from draftflow.bench.tables import write_dataset_results
from draftflow.io import read_json
from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)
table = write_dataset_results(
    snakemake.wildcards.dataset,
    [read_json(path) for path in snakemake.input.engines],
    snakemake.output.csv,
    snakemake.output.outputs,
    snakemake.output.units,
)
log.info("\n%s", table[["k", "run", "tokens_per_s", "acceptance_length", "speedup"]])
