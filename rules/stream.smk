# stage: streamed extract + train (extract.mode: streamed; the Snakefile includes this file then).
# Training runs as a chain of links i = epoch * S + position over the S train shards
# (draftflow/train/stream.py): link i trains the steps of one (epoch, shard) of the by_shard plan.
# Each link's capture is a temp() output that Snakemake deletes once the link has trained on it;
# the capture of link i takes the marker of link i - window as an input, so the DAG itself keeps
# at most extract.window train captures on disk. Val is captured once by rule extract. The
# checkpoints and metrics history live in results/train/checkpoints/ (no rule's output, as in
# the stored mode): a killed link resumes from them; rule train_export exports the last link's
# checkpoint (docs/design.md, docs/storage.md). With extract.keep_first_epoch every link trains
# on the stored capture of its shard (rule extract) instead: captured once, kept.
from snakemake.logging import logger

from draftflow.train.stream import link_chain, link_name, stream_settings

STREAM = stream_settings(config)
if config["train"]["order"] != "by_shard":
    logger.info("extract.mode streamed: training in train.order by_shard (one shard after another)")
    config["train"]["order"] = "by_shard"
STREAM_LINKS = link_chain(num_shards("train"), config["train"]["epochs"], config["train"]["seed"])
STREAM_DIR = RESULTS / "stream"


def stream_link(wildcards):
    return STREAM_LINKS[int(wildcards.link)]


def stream_capture(index):
    return str(STREAM_DIR / link_name(index) / "capture")


def stream_marker(index):
    return str(STREAM_DIR / link_name(index) / "done.json")


def stream_shard(wildcards):
    """The shard file link i captures."""
    return shard_parquets("train")[stream_link(wildcards).shard]


def link_capture(wildcards):
    """The capture link i trains on: its own temporary one, or with extract.keep_first_epoch
    the stored capture of its shard (rule extract), made once and kept for every epoch."""
    link = stream_link(wildcards)
    if config["extract"]["keep_first_epoch"]:
        return extract_dirs("train")[link.shard]
    return stream_capture(link.index)


def stream_window_marker(wildcards):
    """The window: link i's capture waits for the training of link i - window."""
    index = int(wildcards.link) - STREAM["window"]
    return [stream_marker(index)] if index >= 0 else []


def stream_previous_marker(wildcards):
    index = int(wildcards.link) - 1
    return [stream_marker(index)] if index >= 0 else []


rule stream_plan:
    input:
        shards=shard_parquets("train"),
    output:
        directory(str(STREAM_DIR / "train" / "plan")),
    log:
        "logs/stream/plan.log",
    conda:
        "../envs/draftflow.yaml"
    threads: 1
    params:
        code=stage_code("stream_plan"),
    script:
        "../scripts/stream_plan.py"


rule extract_stream:
    input:
        shard=stream_shard,
        shard_manifest=ancient(shard_manifest()),
        target=target_info(),
        window=stream_window_marker,
    output:
        temp(directory(str(STREAM_DIR / "link-{link}" / "capture"))),
    log:
        "logs/stream/link-{link}/extract.log",
    benchmark:
        "benchmarks/stream/link-{link}/extract.tsv"
    wildcard_constraints:
        link=r"\d{5}",
    conda:
        "../envs/draftflow.yaml"
    threads: config["extract"]["threads"]
    resources:
        mem_mb=mem_mb("extract"),
        gpu=extract_gpus(),
    params:
        code=stage_code("extract"),
        extract=extract_settings(),
        window=STREAM["window"],
    script:
        "../scripts/extract.py"


rule train_link:
    input:
        capture=link_capture,
        previous=stream_previous_marker,
        plan=rules.stream_plan.output[0],
        val=extract_dirs("val"),
        vocab=rules.vocab.output.vocab,
        target=target_info(),
    output:
        marker=str(STREAM_DIR / "link-{link}" / "done.json"),
    log:
        "logs/stream/link-{link}/train.log",
    benchmark:
        "benchmarks/stream/link-{link}/train.tsv"
    wildcard_constraints:
        link=r"\d{5}",
    conda:
        "../envs/draftflow.yaml"
    threads: train_threads()
    resources:
        mem_mb=mem_mb("train"),
        gpu=train_gpus(),
    params:
        code=stage_code("train_link"),
        checkpoint_dir=str(RESULTS / "train" / "checkpoints"),
        train=config["train"],
        trust_remote_code=config["target"]["trust_remote_code"],
    script:
        "../scripts/train_link.py"


# The draft and metrics.jsonl from the last link's checkpoint: the files rule train (rules/train.smk)
# writes in the stored mode, so bench and report are the same in both modes.
ruleorder: train_export > train


rule train_export:
    input:
        last=stream_marker(len(STREAM_LINKS) - 1),
        plan=rules.stream_plan.output[0],
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
    threads: 1
    resources:
        mem_mb=mem_mb("train"),
    params:
        code=stage_code("train_export"),
        checkpoint_dir=str(RESULTS / "train" / "checkpoints"),
        train=config["train"],
        trust_remote_code=config["target"]["trust_remote_code"],
    script:
        "../scripts/train_export.py"
