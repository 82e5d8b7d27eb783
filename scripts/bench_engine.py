"""Rule bench_engine: one vLLM engine (the plain target for k = 0, else the EAGLE-3 draft with
k speculative tokens) over every prompt set; its raw result as JSON.

The engine runs in a child process (draftflow.bench.engine), so no vLLM engine starts in this one.
"""

from draftflow.bench.prompts import read_prompts
from draftflow.bench.run import engine_request, request_settings, run_engine
from draftflow.workflow.gpu import gpu_lease
from draftflow.workflow.script import setup_logging, target_dir

log = setup_logging(snakemake)
settings = snakemake.params.bench
k = int(snakemake.wildcards.k)
request = engine_request(
    target=str(target_dir(snakemake)),
    draft=snakemake.input.draft,
    k=k,
    prompt_sets={
        name: read_prompts(path)
        for name, path in zip(snakemake.params.datasets, snakemake.input.prompts, strict=True)
    },
    **request_settings(
        settings,
        dtype=snakemake.params.dtype,
        trust_remote_code=snakemake.params.trust_remote_code,
        # The job's GPUs (extract.tp_size when use_gpu is on): the target is sharded over them.
        tensor_parallel_size=max(1, int(snakemake.resources.gpu)),
    ),
)
# The engine runs in a child process: it inherits the leased CUDA_VISIBLE_DEVICES.
with gpu_lease(snakemake.resources.gpu):  # 0 GPUs on CPU runs: a no-op
    result = run_engine(request, k, snakemake.output[0], settings.get("reserved_cpus"))
for run in result["runs"]:
    log.info("k=%d run %d %s: %.1f tokens/s", k, run["run"], run["dataset"], run["tokens_per_s"])
