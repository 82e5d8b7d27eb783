# stage: bench. Prompt sets are normalised once, then each is run through the plain target and
# one vLLM engine per num_speculative_tokens with the trained EAGLE-3 draft.


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
        max_turns=config["bench"].get("max_turns"),
        code=stage_code("prompts"),
    script:
        "../scripts/prompts.py"


rule bench:
    input:
        prompts=str(RESULTS / "bench" / "prompts" / "{dataset}.jsonl"),
        draft=bench_draft_dir(),
        target=target_info(),
    output:
        csv=str(RESULTS / "bench" / "{dataset}.csv"),
        outputs=str(RESULTS / "bench" / "{dataset}" / "outputs.jsonl"),
    log:
        "logs/bench/{dataset}.log",
    benchmark:
        "benchmarks/bench/{dataset}.tsv"
    wildcard_constraints:
        dataset=bench_dataset_pattern(),
    conda:
        "../envs/draftflow.yaml"
    threads: bench_threads()
    resources:
        mem_mb=mem_mb("bench"),
        gpu=vllm_gpus(),
    params:
        bench=bench_settings(),
        dtype=bench_dtype(),
        trust_remote_code=config["target"].get("trust_remote_code", False),
        code=stage_code("bench"),
    script:
        "../scripts/bench.py"
