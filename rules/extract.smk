# stage: extract. One job per shard: the target's hidden states at the aux layers and the final
# pre-norm output, captured in vLLM (or transformers) into a capture store, then spot-checked
# against transformers (docs/design.md, docs/capture.md). plan_extract (not part of `all`; run by
# `make plan`) writes the disk plan every extract job also logs and checks before it starts.


rule plan_extract:
    input:
        shard_manifest=shard_manifest(),
        target=target_info(),
    output:
        str(RESULTS / "extract" / "plan.json"),
    log:
        "logs/extract/plan.log",
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    params:
        code=stage_code("plan_extract"),
        extract=extract_settings(),
        window=stream_window(),
    script:
        "../scripts/plan_extract.py"


rule extract:
    input:
        shard=str(RESULTS / "shard" / "{split}" / "{shard}.parquet"),
        # For the plan of every shard in the log only: ancient, so a new manifest (more
        # shards) reruns no extract job whose own shard is unchanged.
        shard_manifest=ancient(shard_manifest()),
        target=target_info(),
    output:
        directory(str(RESULTS / "extract" / "{split}" / "{shard}")),
    log:
        "logs/extract/{split}/{shard}.log",
    benchmark:
        "benchmarks/extract/{split}/{shard}.tsv"
    wildcard_constraints:
        split="train|val",
        shard=r"shard-\d{5}",
    conda:
        "../envs/draftflow.yaml"
    threads: config["extract"]["threads"]
    resources:
        mem_mb=mem_mb("extract"),
        gpu=extract_gpus(),
    params:
        code=stage_code("extract"),
        extract=extract_settings(),
    script:
        "../scripts/extract.py"
