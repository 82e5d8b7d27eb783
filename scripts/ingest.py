"""Rule ingest: raw chat files -> results/corpus/ingested.jsonl (+ rejects, summary)."""

from draftflow.corpus.ingest import ingest
from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)
ingest(
    snakemake.params.sources,
    snakemake.output.conversations,
    snakemake.output.rejects,
    snakemake.output.summary,
    max_conversations=snakemake.params.max_conversations,
    seed=snakemake.params.seed,
    on_bad_record=snakemake.params.on_bad_record,
)
