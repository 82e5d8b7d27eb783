"""Rule regenerate: re-answer the ingested conversations with the target (vLLM)."""

from draftflow.config import from_section
from draftflow.corpus.regenerate import (
    RegenerateSettings,
    fingerprint,
    make_engine,
    read_conversations,
    regenerate,
)
from draftflow.engine_settings import engine_settings
from draftflow.workflow.gpu import gpu_lease
from draftflow.workflow.script import setup_logging, target_dir

if __name__ == "__main__":  # vLLM starts its engine worker with spawn
    log = setup_logging(snakemake)
    model_dir = target_dir(snakemake)
    settings = from_section(RegenerateSettings, snakemake.params.settings, "corpus.regenerate")
    # The engine's devices, context and memory (max_model_len null = tokenize.max_length).
    engine = engine_settings(snakemake.config, "regenerate")
    max_model_len = engine.max_model_len
    conversations = read_conversations(snakemake.input.conversations)
    with gpu_lease(snakemake.resources.gpu):  # 0 GPUs on CPU runs: a no-op
        # engine.tensor_parallel_size: on GPUs the job's leased GPUs.
        llm = make_engine(
            model_dir,
            engine,
            seed=settings.seed,
            trust_remote_code=snakemake.params.trust_remote_code,
        )
        regenerate(
            conversations,
            llm,
            settings,
            output=snakemake.output.conversations,
            summary=snakemake.output.summary,
            progress=snakemake.params.progress,
            run_fingerprint=fingerprint(
                snakemake.input.conversations, model_dir, settings, max_model_len
            ),
            max_model_len=max_model_len,
        )
