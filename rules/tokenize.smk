# stage: tokenize -> split -> shard (token samples with loss masks, docs/design.md)


rule tokenize:
    input:
        corpus=corpus_for_tokenize(),
        target=target_info(),
    output:
        samples=str(RESULTS / "tokenize" / "samples.parquet"),
        token_freq=str(RESULTS / "tokenize" / "token_freq.safetensors"),
        summary=str(RESULTS / "tokenize" / "summary.json"),
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
        # token_freq counts the train split's tokens only: split's settings say which those are
        split=config["split"],
    script:
        "../scripts/tokenize.py"


rule split:
    input:
        samples=rules.tokenize.output.samples,
    output:
        train=str(RESULTS / "split" / "train.parquet"),
        val=str(RESULTS / "split" / "val.parquet"),
        test=str(RESULTS / "split" / "test.parquet"),
        summary=str(RESULTS / "split" / "summary.json"),
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
        split=config["split"],
    script:
        "../scripts/split.py"


rule shard:
    input:
        train=rules.split.output.train,
        val=rules.split.output.val,
    output:
        train=shard_parquets("train"),
        val=shard_parquets("val"),
        manifest=shard_manifest(),
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
