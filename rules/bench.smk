# stage: bench. Prompt sets are normalised once; one job runs every engine side by side (the
# plain target, k = 0, and one per num_speculative_tokens with the trained EAGLE-3 draft),
# interleaved prompt by prompt so that their times pair up; then each prompt set's CSV and
# units are tabulated from all engines' results.


rule prompts:
    output:
        str(RESULTS / "bench" / "prompts" / "{dataset}.jsonl"),
    log:
        "logs/bench/prompts/{dataset}.log",
    benchmark:
        "benchmarks/bench/prompts/{dataset}.tsv"
    wildcard_constraints:
        dataset=bench_dataset_pattern(),
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    resources:
        mem_mb=mem_mb("default"),
    params:
        dataset=bench_dataset,
        max_turns=config["bench"]["max_turns"],
        code=stage_code("prompts"),
    script:
        "../scripts/prompts.py"


rule bench_engines:
    input:
        prompts=bench_prompt_files(),
        draft=draft_dir(),
        target=target_info(),
    output:
        bench_engine_results(),
    log:
        "logs/bench/engines.log",
    benchmark:
        "benchmarks/bench/engines.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: bench_threads()
    resources:
        mem_mb=mem_mb("bench"),
        gpu=vllm_gpus(),
    params:
        bench=bench_engine_settings(),
        ks=bench_ks(),
        datasets=bench_dataset_names(),
        code=stage_code("bench_engines"),
    script:
        "../scripts/bench_engines.py"


rule bench_table:
    input:
        engines=bench_engine_results(),
    output:
        csv=str(RESULTS / "bench" / "{dataset}.csv"),
        outputs=str(RESULTS / "bench" / "{dataset}" / "outputs.jsonl"),
        units=str(RESULTS / "bench" / "{dataset}" / "units.csv"),
    log:
        "logs/bench/{dataset}.log",
    benchmark:
        "benchmarks/bench/{dataset}.tsv"
    wildcard_constraints:
        dataset=bench_dataset_pattern(),
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    resources:
        mem_mb=mem_mb("default"),
    params:
        code=stage_code("bench_table"),
    script:
        "../scripts/bench_table.py"
