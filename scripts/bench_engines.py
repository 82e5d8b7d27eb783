"""Rule bench_engines: every engine (the plain target, k = 0, and the EAGLE-3 draft at each k)
over every prompt set, side by side and interleaved unit by unit, or one at a time
(bench.schedule, draftflow.bench.schedule); each one's raw result as JSON.

The engines run in a child process (draftflow.bench.engine), so no vLLM engine starts in this one.
"""

from draftflow.bench.prompts import read_prompts
from draftflow.bench.run import engine_request, run_engines
from draftflow.bench.settings import bench_settings
from draftflow.workflow.gpu import gpu_lease
from draftflow.workflow.script import setup_logging, target_dir

log = setup_logging(snakemake)
# The rule's params.bench is the same settings, for Snakemake's rerun trigger.
settings = bench_settings(snakemake.config)
ks = [int(k) for k in snakemake.params.ks]
request = engine_request(
    target=str(target_dir(snakemake)),
    draft=snakemake.input.draft,
    ks=ks,
    prompt_sets={
        name: read_prompts(path)
        for name, path in zip(snakemake.params.datasets, snakemake.input.prompts, strict=True)
    },
    # engine.tensor_parallel_size GPUs per engine: on GPUs the job's leased GPUs.
    settings=settings,
)
# The engines run in a child process: it inherits the leased CUDA_VISIBLE_DEVICES.
with gpu_lease(snakemake.resources.gpu):  # 0 GPUs on CPU runs: a no-op
    results = run_engines(request, dict(zip(ks, snakemake.output, strict=True)))
for k, result in results.items():
    for run in result["runs"]:
        log.info(
            "k=%d run %d %s: %.1f tokens/s", k, run["run"], run["dataset"], run["tokens_per_s"]
        )
