"""Rule extract: one shard's hidden states -> results/extract/{split}/{shard}/ (a capture store)."""

# vLLM starts its workers with spawn, which re-imports this file: everything stays under the guard.
if __name__ == "__main__":
    import os
    import sys
    from pathlib import Path

    from draftflow.capture.extract import ExtractSettings, run_extract
    from draftflow.capture.layers import capture_layers
    from draftflow.capture.plan import format_plan, plan_extract
    from draftflow.config import from_section
    from draftflow.io import read_json
    from draftflow.workflow.gpu import gpu_lease
    from draftflow.workflow.script import setup_logging, target_dir

    log = setup_logging(snakemake)
    if snakemake.log:
        # vLLM's engine and worker processes write to the inherited stdout/stderr descriptors:
        # point those at the log too, not only Python's sys.stderr.
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), 1)
        os.dup2(sys.stderr.fileno(), 2)
    settings = from_section(ExtractSettings, snakemake.params.extract, "extract")
    # Every extract job logs the plan of all of them (the first job to run shows it first).
    output = Path(snakemake.output[0])
    plan = plan_extract(
        read_json(snakemake.input.shard_manifest),
        capture_layers(target_dir(snakemake), settings.aux_layers),
        settings.store_dtype,
        settings.chunk_samples,
        output.parents[2],  # results/extract/{split}/{shard} or results/stream/link-{i}/capture
        settings.disk_margin_mb << 20,
        # extract_stream (rules/stream.smk): the streamed mode's window.
        window=snakemake.params.get("window"),
    )
    log.info("%s", format_plan(plan))
    with gpu_lease(snakemake.resources.gpu):  # 0 GPUs on CPU runs: a no-op
        manifest = run_extract(
            snakemake.input.shard,
            target_dir(snakemake),
            snakemake.output[0],
            settings,
        )
    log.info(
        "extract done: %d samples, %d tokens, verification %s",
        manifest["num_samples"],
        manifest["num_tokens"],
        "passed" if manifest["verification"]["passed"] else "failed",
    )
