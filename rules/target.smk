rule prepare_target:
    output:
        config=str(RESOURCES / "target" / "config.json"),
        info=str(RESOURCES / "target" / "draftflow_target.json"),
    log:
        "logs/prepare_target.log",
    benchmark:
        "benchmarks/prepare_target.tsv"
    params:
        target=config["target"],
        out_dir=target_dir(),
        code=stage_code("prepare_target"),
    threads: 2
    resources:
        mem_mb=mem_mb("prepare_target"),
    script:
        "../scripts/prepare_target.py"
