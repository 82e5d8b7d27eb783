"""Rule bench: plain target vs. the EAGLE-3 draft at each k on one prompt set.

Each engine runs in its own child process (draftflow.bench.engine), so no vLLM engine
starts in this one.
"""

from pathlib import Path

from draftflow.bench.prompts import read_prompts
from draftflow.bench.run import run_benchmark
from draftflow.workflow.gpu import gpu_lease
from draftflow.workflow.script import setup_logging

log = setup_logging(snakemake)
settings = snakemake.params.bench
# The engines run in child processes: they inherit the leased CUDA_VISIBLE_DEVICES.
with gpu_lease(snakemake.resources.gpu):  # 0 GPUs on CPU runs: a no-op
    table = run_benchmark(
        dataset=snakemake.wildcards.dataset,
        prompts=read_prompts(snakemake.input.prompts),
        target=str(Path(snakemake.input.target).parent),
        draft=snakemake.input.draft,
        ks=list(settings["num_speculative_tokens"]),
        out_csv=snakemake.output.csv,
        out_outputs=snakemake.output.outputs,
        temperature=settings.get("temperature", 0.0),
        top_p=settings.get("top_p", 1.0),
        max_tokens=settings["max_tokens"],
        seed=settings.get("seed", 0),
        repeats=settings.get("repeats", 1),
        warmup_tokens=settings.get("warmup_tokens", 16),
        reserved_cpus=settings.get("reserved_cpus"),
        engine={
            "max_model_len": settings["max_model_len"],
            "max_num_seqs": settings["max_num_seqs"],
            "gpu_memory_utilization": settings.get("gpu_memory_utilization"),
            "kv_cache_memory_bytes": settings.get("kv_cache_memory_bytes"),
            "dtype": snakemake.params.dtype,
            "seed": settings.get("seed", 0),
            "trust_remote_code": snakemake.params.trust_remote_code,
            "extra": settings.get("engine_args") or {},
        },
    )
log.info("\n%s", table[["k", "run", "tokens_per_s", "acceptance_length", "speedup"]])
