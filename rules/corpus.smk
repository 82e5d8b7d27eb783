# stage: corpus (ingest, then optionally regenerate the answers with the target)


rule ingest:
    input:
        sources=corpus_source_files(),
    output:
        conversations=str(RESULTS / "corpus" / "ingested.jsonl"),
        rejects=str(RESULTS / "corpus" / "rejects.jsonl"),
        summary=str(RESULTS / "corpus" / "ingest_summary.json"),
    log:
        "logs/ingest.log",
    benchmark:
        "benchmarks/ingest.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    resources:
        mem_mb=mem_mb("ingest"),
    params:
        sources=config["corpus"]["sources"],
        max_conversations=config["corpus"]["max_conversations"],
        seed=config["corpus"]["seed"],
        on_bad_record=config["corpus"]["on_bad_record"],
        code=stage_code("ingest"),
    script:
        "../scripts/ingest.py"


rule regenerate:
    input:
        conversations=str(RESULTS / "corpus" / "ingested.jsonl"),
        target=target_info(),
    output:
        conversations=str(RESULTS / "corpus" / "regenerated.jsonl"),
        summary=str(RESULTS / "corpus" / "regenerated.summary.json"),
    log:
        "logs/regenerate.log",
    benchmark:
        "benchmarks/regenerate.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: 2
    resources:
        mem_mb=mem_mb("regenerate"),
        gpu=vllm_gpus(),
    params:
        settings=regenerate_settings(),
        trust_remote_code=config["target"]["trust_remote_code"],
        # not an output: Snakemake would delete it before a rerun, and it is what makes resuming work
        progress=str(RESULTS / "corpus" / "regenerated.progress.jsonl"),
        code=stage_code("regenerate"),
    script:
        "../scripts/regenerate.py"
