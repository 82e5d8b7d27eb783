# stage: report. Summary table, markdown summary and figures from the bench CSVs and the
# training log; `snakemake --report` collects the figures with their captions.


rule report:
    input:
        bench=bench_csvs(),
        units=bench_unit_csvs(),
        train_metrics=str(RESULTS / "train" / "metrics.jsonl"),
        draft=draft_dir(),
        target=target_info(),
        extract=report_extract_dirs(),
    output:
        summary=report(
            str(RESULTS / "summary.csv"),
            caption="../docs/report/summary.rst",
            category="Summary",
        ),
        markdown=report(
            str(RESULTS / "summary.md"),
            caption="../docs/report/summary_md.rst",
            category="Summary",
        ),
        acceptance_length=report(
            str(RESULTS / "plots" / "acceptance_length.png"),
            caption="../docs/report/acceptance_length.rst",
            category="Speculative decoding",
        ),
        acceptance_per_pos=report(
            str(RESULTS / "plots" / "acceptance_per_position.png"),
            caption="../docs/report/acceptance_per_position.rst",
            category="Speculative decoding",
        ),
        speedup=report(
            str(RESULTS / "plots" / "speedup.png"),
            caption="../docs/report/speedup.rst",
            category="Speculative decoding",
        ),
        train_loss=report(
            str(RESULTS / "plots" / "train_loss.png"),
            caption="../docs/report/train_loss.rst",
            category="Training",
        ),
        train_accuracy=report(
            str(RESULTS / "plots" / "train_accuracy.png"),
            caption="../docs/report/train_accuracy.rst",
            category="Training",
        ),
    log:
        "logs/report.log",
    benchmark:
        "benchmarks/report.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    resources:
        mem_mb=mem_mb("default"),
    params:
        bootstrap=bench_bootstrap(),
        schedule=BENCH_SCHEDULE,
        code=stage_code("report"),
    script:
        "../scripts/report.py"
