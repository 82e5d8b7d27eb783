rule prepare_target:
    output:
        config=str(RESOURCES / "target" / "config.json"),
        info=target_info(),
    log:
        "logs/prepare_target.log",
    benchmark:
        "benchmarks/prepare_target.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: 2
    resources:
        mem_mb=mem_mb("prepare_target"),
    params:
        target=config["target"],
        code=stage_code("prepare_target"),
    script:
        "../scripts/prepare_target.py"
