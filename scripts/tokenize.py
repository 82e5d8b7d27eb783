"""Rule tokenize: conversations -> token samples with loss masks (draftflow.data.tokenize)."""

from draftflow.workflow.script import setup_logging, target_dir

log = setup_logging(snakemake)


from draftflow.config import from_section  # noqa: E402
from draftflow.data.tokenize import TokenizeSettings, tokenize_corpus  # noqa: E402

params = snakemake.params
settings = from_section(
    TokenizeSettings,
    params.tokenize,
    "tokenize",
    enable_thinking=params.enable_thinking,
    split=params.split,
)
tokenize_corpus(
    corpus_path=snakemake.input.corpus,
    target_dir=target_dir(snakemake),
    samples_path=snakemake.output.samples,
    token_freq_path=snakemake.output.token_freq,
    summary_path=snakemake.output.summary,
    settings=settings,
    trust_remote_code=params.trust_remote_code,
)
