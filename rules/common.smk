# Shared glue: config validation, paths, and every input function the rules call by name.
import re
from pathlib import Path

from draftflow.capture.section import extract_section
from draftflow.config import validate_config

# Fills every default from config/schema.yaml; refuses a config without a target or corpus.
validate_config(config)

# Cross-key checks before any job runs; each refusal names the keys, values and a fix.
from draftflow.plan.checks import check_workflow_config

check_workflow_config(config)

from draftflow.bench.schedule import bench_schedule
from draftflow.engine_settings import engine_settings

# At start, not when the bench job runs hours later: engines that cannot share the memory.
BENCH_SCHEDULE = bench_schedule(config["bench"])


RESULTS = Path("results")
RESOURCES = Path("resources")
SPLITS_EXTRACTED = ["train", "val"]


# ---------------------------------------------------------------- target
def target_info():
    """The prepared target's description, written last: depend on it to depend on the target."""
    return str(RESOURCES / "target" / "draftflow_target.json")


# ---------------------------------------------------------------- corpus
def corpus_for_tokenize():
    """Regenerated conversations when regeneration is on, else the ingested ones."""
    if config["corpus"]["regenerate"]["enabled"]:
        return str(RESULTS / "corpus" / "regenerated.jsonl")
    return str(RESULTS / "corpus" / "ingested.jsonl")


def corpus_source_files():
    """The raw corpus files (pkg: references resolved), so that editing one reruns ingest."""
    from draftflow.resources import resolve_path

    return [str(resolve_path(source["path"])) for source in config["corpus"]["sources"]]


def tokenize_enable_thinking():
    """The reasoning switch the regenerated answers were made with (None without regenerate)."""
    section = config["corpus"]["regenerate"]
    return section["enable_thinking"] if section["enabled"] else None


def regenerate_settings():
    """The corpus.regenerate section (defaults from the schema), minus the on/off switch."""
    section = dict(config["corpus"]["regenerate"])
    del section["enabled"]
    # null means tokenize.max_length: the engine gets the resolved length.
    section["max_model_len"] = engine_settings(config, "regenerate").max_model_len
    return section


# ---------------------------------------------------------------- shards
def num_shards(split):
    return config["extract"]["num_shards"][split]


def shard_names(split):
    return [f"shard-{index:05d}" for index in range(num_shards(split))]


def shard_parquets(split):
    return [str(RESULTS / "shard" / split / f"{name}.parquet") for name in shard_names(split)]


def shard_manifest():
    """Samples and tokens of every shard (the shard rule writes it with the shards)."""
    return str(RESULTS / "shard" / "manifest.json")


def extract_dirs(split):
    return [str(RESULTS / "extract" / split / name) for name in shard_names(split)]


def streamed_mode():
    """extract.mode streamed: train captures are temporary, training a chain of links
    (rules/stream.smk); val is captured once, as in the stored mode."""
    return config["extract"]["mode"] == "streamed"


def stream_window():
    """Train captures on disk at once (the disk plan's peak); None where every train capture
    is kept (the stored mode, or extract.keep_first_epoch)."""
    if streamed_mode() and not config["extract"]["keep_first_epoch"]:
        return config["extract"]["window"]
    return None


# ---------------------------------------------------------------- resources
def mem_mb(stage):
    table = config["resources"]["mem_mb"]
    return table[stage] if stage in table else table["default"]


def extract_gpus():
    """GPUs of an extract job: engine.tensor_parallel_size on GPUs, none on the CPU build."""
    return engine_settings(config, "extract").gpus


def vllm_gpus():
    """GPUs of a job that starts vLLM engines besides extract (regenerate, bench): the same
    engine section decides, so one vLLM build serves every stage."""
    return engine_settings(config, "bench").gpus


def train_gpus():
    """GPUs of the train job; more than one runs data parallel under torchrun."""
    return config["resources"]["train_gpus"]


def train_threads():
    return config["train"]["threads"] or 2


def extract_settings():
    """Every extract setting a capture job uses (num_shards shapes the DAG, not a job): the
    capture keys, the extract stage's engine (draftflow.engine_settings, as regenerate's and
    bench's) and the target's trust_remote_code; changing one reruns the captures."""
    return extract_section(config)


# ---------------------------------------------------------------- bench and report
def bench_dataset_names():
    return [entry["name"] for entry in config["bench"]["datasets"]]


def bench_dataset_pattern():
    """Wildcard constraint: only configured prompt-set names (keeps bench paths unambiguous)."""
    return "|".join(re.escape(name) for name in bench_dataset_names())


def bench_dataset(wildcards):
    """The config entry of one prompt set (kind, path, limit, order, seed)."""
    for entry in config["bench"]["datasets"]:
        if entry["name"] == wildcards.dataset:
            return entry
    raise ValueError(
        f"bench dataset {wildcards.dataset!r} is not configured; known: {bench_dataset_names()}"
    )


def bench_engine_settings():
    """Every bench setting an engine uses (engine section and dtype resolved), so that changing
    one reruns the engines. The list of k is left out: adding a k runs only the new engine."""
    from dataclasses import asdict

    from draftflow.bench.settings import bench_settings

    return asdict(bench_settings(config))


def bench_ks():
    """Engines to run: the plain target (k = 0), then each num_speculative_tokens."""
    # The schema keeps them distinct and >= 1.
    return [0, *(int(k) for k in config["bench"]["num_speculative_tokens"])]


def bench_engine_result(k):
    return str(RESULTS / "bench" / "engines" / f"k{k}.json")


def bench_engine_results():
    return [bench_engine_result(k) for k in bench_ks()]


def bench_prompt_files():
    """Every prompt set, in config order (the engine job runs them all)."""
    return [str(RESULTS / "bench" / "prompts" / f"{name}.jsonl") for name in bench_dataset_names()]


def bench_threads():
    """Cores of a bench engine job. null: on the CPU build all of the run's cores, so that no
    other job shares the machine while an engine is timed (and vLLM's CPU worker binds to every
    core it may use); with GPUs 2, so that engines for different k run side by side."""
    threads = config["bench"]["threads"]
    if threads is not None:
        return int(threads)
    if vllm_gpus() == 0 and workflow.cores:
        return int(workflow.cores)
    return 2


def draft_dir():
    """The trained draft (speculators format), exported by train."""
    return str(RESULTS / "train" / "draft")


def bench_csvs():
    return [str(RESULTS / "bench" / f"{name}.csv") for name in bench_dataset_names()]


def bench_unit_csvs():
    return [str(RESULTS / "bench" / name / "units.csv") for name in bench_dataset_names()]


def bench_bootstrap():
    """How the report draws its confidence intervals (draftflow.report.summary.Bootstrap)."""
    bench = config["bench"]
    return {
        "samples": bench["bootstrap_samples"],
        "confidence": bench["confidence"],
        "seed": bench["seed"],
    }


def report_extract_dirs():
    """Capture stores of the training data (their manifests give the data size); in the
    streamed mode the stream plan stands for the train stores (its manifest has their totals)."""
    if streamed_mode():
        return [str(RESULTS / "stream" / "train" / "plan")] + extract_dirs("val")
    return extract_dirs("train") + extract_dirs("val")


def report_outputs():
    return [str(RESULTS / "summary.csv"), str(RESULTS / "summary.md")]


# ---------------------------------------------------------------- final output
def get_final_output():
    """The report: it depends on every stage before it."""
    return report_outputs()


# ---- workflow engineering
from draftflow.workflow.digest import code_digest, script_modules


def stage_modules(stage):
    """Entry modules of a stage: the draftflow modules scripts/<stage>.py imports (read, not run)."""
    script = Path(workflow.basedir) / "scripts" / f"{stage}.py"
    return script_modules(script, root=Path(workflow.basedir))


def stage_code(stage):
    """Digest of the draftflow code a stage runs (sha256 of the modules, see digest.py).

    `params: code=stage_code("<stage>")` reruns the stage when any of that code changes;
    Snakemake's own code trigger sees only the rule's script.
    """
    return code_digest(stage_modules(stage), root=Path(workflow.basedir))
