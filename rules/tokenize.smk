# stage: tokenize -> split -> shard (token samples with loss masks, docs/design.md)


rule tokenize:
    input:
        corpus=corpus_for_tokenize(),
        target=target_info(),
    output:
        samples="results/tokenize/samples.parquet",
        token_freq="results/tokenize/token_freq.safetensors",
        summary="results/tokenize/summary.json",
    log:
        "logs/tokenize.log",
    benchmark:
        "benchmarks/tokenize.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    resources:
        mem_mb=mem_mb("tokenize"),
    params:
        code=stage_code("tokenize"),
        trust_remote_code=config["target"]["trust_remote_code"],
        tokenize=config["tokenize"],
        # the generation prompt, and so where a turn's mask starts, follows this switch
        enable_thinking=tokenize_enable_thinking(),
        # token_freq counts train samples only, so the split settings belong here too
        split=config["split"],
    script:
        "../scripts/tokenize.py"


rule split:
    input:
        samples=rules.tokenize.output.samples,
    output:
        train="results/split/train.parquet",
        val="results/split/val.parquet",
        test="results/split/test.parquet",
        summary="results/split/summary.json",
    log:
        "logs/split.log",
    benchmark:
        "benchmarks/split.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    resources:
        mem_mb=mem_mb("split"),
    params:
        code=stage_code("split"),
        seed=config["split"]["seed"],
        val_fraction=config["split"]["val_fraction"],
        test_fraction=config["split"]["test_fraction"],
    script:
        "../scripts/split.py"


rule shard:
    input:
        train=rules.split.output.train,
        val=rules.split.output.val,
    output:
        train=shard_parquets("train"),
        val=shard_parquets("val"),
        manifest="results/shard/manifest.json",
    log:
        "logs/shard.log",
    benchmark:
        "benchmarks/shard.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    resources:
        mem_mb=mem_mb("shard"),
    params:
        code=stage_code("shard"),
        num_shards={split: num_shards(split) for split in SPLITS_EXTRACTED},
    script:
        "../scripts/shard.py"
