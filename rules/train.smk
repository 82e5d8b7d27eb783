# stage: vocab + train. The draft vocabulary from train token counts, then the EAGLE-3 draft
# trained on the capture stores (docs/design.md, docs/training.md). Checkpoints and the metrics
# history live in results/train/checkpoints/ and are deliberately not an output: Snakemake deletes
# the outputs of a failed job, and a killed training job must find them to resume (and rebuild
# metrics.jsonl). A finished job leaves checkpoints/COMPLETE there: a rerun trains from scratch.


rule vocab:
    input:
        token_freq=rules.tokenize.output.token_freq,
    output:
        vocab=str(RESULTS / "vocab" / "vocab.safetensors"),
        summary=str(RESULTS / "vocab" / "summary.json"),
    log:
        "logs/vocab.log",
    benchmark:
        "benchmarks/vocab.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    resources:
        mem_mb=mem_mb("vocab"),
    params:
        code=stage_code("vocab"),
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
    script:
        "../scripts/vocab.py"


rule train:
    input:
        train=extract_dirs("train"),
        val=extract_dirs("val"),
        vocab=rules.vocab.output.vocab,
        target=target_info(),
    output:
        draft=directory(draft_dir()),
        metrics=str(RESULTS / "train" / "metrics.jsonl"),
    log:
        "logs/train.log",
    benchmark:
        "benchmarks/train.tsv"
    conda:
        "../envs/draftflow.yaml"
    threads: train_threads()
    resources:
        mem_mb=mem_mb("train"),
        gpu=train_gpus(),
    params:
        code=stage_code("train"),
        checkpoint_dir=str(RESULTS / "train" / "checkpoints"),
        train=config["train"],
        trust_remote_code=config["target"]["trust_remote_code"],
    script:
        "../scripts/train.py"
