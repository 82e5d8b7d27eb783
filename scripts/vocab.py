"""Rule vocab: train token frequencies -> the draft vocabulary (d2t, t2d) and its coverage."""

from draftflow.train.vocab import write_vocab
from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)
summary = write_vocab(
    snakemake.input.token_freq,
    snakemake.output.vocab,
    snakemake.output.summary,
    draft_vocab_size=int(snakemake.params.draft_vocab_size),
)
log.info(
    "draft vocabulary: %d of %d tokens, covering %.2f%% of %d masked train tokens",
    summary["draft_vocab_size"],
    summary["target_vocab_size"],
    100 * summary["coverage"],
    summary["masked_train_tokens"],
)
