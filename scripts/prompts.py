"""Rule prompts: one prompt set normalised to results/bench/prompts/{dataset}.jsonl."""

from draftflow.bench.prompts import load_prompts, write_prompts
from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)
entry = snakemake.params.dataset
prompts = load_prompts(
    kind=entry["kind"],
    path=entry["path"],
    dataset=entry["name"],
    limit=entry["limit"],
    order=entry["order"],
    seed=entry["seed"],
    max_turns=snakemake.params.max_turns,
)
write_prompts(prompts, snakemake.output[0])
log.info(
    "%s: %d prompts, %d turns", entry["name"], len(prompts), sum(len(p["turns"]) for p in prompts)
)
