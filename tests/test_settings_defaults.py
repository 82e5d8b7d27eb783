"""config/schema.yaml is the one source of defaults: every key has one there, no settings
dataclass has a default of its own, and every one is built from its config section the same way
(draftflow.config.from_section). The CPU demo (config/demo.yaml) is an overlay over the schema's
defaults that gives the same config the demo always ran with."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from draftflow import engine
from draftflow.bench import engine as bench_engine
from draftflow.bench.prompts import load_prompts, select_subset
from draftflow.bench.settings import BenchSettings
from draftflow.bench.stats import intervals
from draftflow.capture.backends import (
    CaptureEngineSettings,
    capture_engine_env,
    capture_engine_kwargs,
)
from draftflow.capture.extract import ExtractSettings, VerifySettings, extract_settings
from draftflow.capture.section import EXTRACT_DAG_KEYS
from draftflow.config import BASE_CONFIG, DEMO_CONFIG, from_section, load_config
from draftflow.corpus.ingest import Source
from draftflow.corpus.regenerate import RegenerateSettings, make_engine
from draftflow.data.split import SplitSettings
from draftflow.data.tokenize import TokenizeSettings
from draftflow.engine_settings import EXTRACT_ENGINE_KEYS, EngineSettings, engine_settings
from draftflow.report.summary import Bootstrap
from draftflow.train.settings import TrainSettings

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "config" / "schema.yaml"

# Each settings class, its section (a dotted path; [] an array's items) and the fields it takes
# from elsewhere (another section, or the rule), by field name -> schema key or None.
SETTINGS = [
    (TrainSettings, "train", {}),
    (RegenerateSettings, "corpus.regenerate", {}),
    (
        ExtractSettings,
        "extract",
        # engine: engine_settings(config, "extract"), from engine: and EXTRACT_ENGINE_KEYS.
        {"trust_remote_code": "target.trust_remote_code", "engine": "engine"},
    ),
    (VerifySettings, "extract.verify", {}),
    (
        TokenizeSettings,
        "tokenize",
        {"split": "split", "enable_thinking": "corpus.regenerate.enable_thinking"},
    ),
    (SplitSettings, "split", {}),
    (Source, "corpus.sources[]", {}),
    (
        Bootstrap,
        None,
        {
            "samples": "bench.bootstrap_samples",
            "confidence": "bench.confidence",
            "seed": "bench.seed",
        },
    ),
    (BenchSettings, None, {}),
    (EngineSettings, None, {}),
    # Built from ExtractSettings (capture_engine): its fields are the extract job's.
    (CaptureEngineSettings, None, {}),
]

# The builders of engines and of what a config sets: every argument required (none defaults).
BUILDERS = [
    engine.engine_env,
    engine.engine_kwargs,
    bench_engine.engine_kwargs,
    make_engine,
    capture_engine_env,
    capture_engine_kwargs,
    intervals,
    load_prompts,
    select_subset,
]

# Parameters of draftflow's functions that are named like a config key and have a default, but
# are no config value: (file, function, parameter) -> what they are.
NOT_CONFIG_VALUES = {
    ("capture/backends/hf.py", "load_target", "num_layers"): "layers to load (verify's cut)",
    ("capture/backends/hf.py", "HFBackend.__init__", "num_layers"): "the same, for the backend",
    ("capture/decoder_search.py", "find_decoder", "num_layers"): "the text config's layer count",
    ("capture/extract.py", "run_extract", "backend"): "a started backend to reuse, not its name",
    ("capture/store.py", "CaptureReader.hidden_states", "dtype"): "the dtype a reader asks for",
    ("corpus/ingest.py", "_snippet", "limit"): "characters of a record quoted in a message",
    ("corpus/sources.py", "_snippet", "limit"): "characters of a record quoted in a message",
    ("data/masks.py", "ChatTemplateMasker.encode", "max_tokens"): "a cut its caller passes",
    ("plan/target_shape.py", "_get", "default"): "a config.json lookup's fallback",
    ("train/optim.py", "build_optimizers", "device"): "a torch device",
}
# Still to do: tools/gpu_example_data.py (a GPU lane file) calls prepare_target without them.

# Keys the user must give: they have no default a run could use.
NO_DEFAULT = {"target", "corpus", "corpus.sources", "corpus.sources[].name"}
NO_DEFAULT |= {"corpus.sources[].path", "bench.datasets[].name", "bench.datasets[].kind"}
NO_DEFAULT |= {"bench.datasets[].path"}

# The demo's merged config before config/demo.yaml became an overlay (config/config.yaml, the
# base of every run then), less the GPU switches that moved to the engine: section.
DEMO_BEFORE = {
    "corpus.max_conversations": 384,
    "corpus.regenerate.max_model_len": 448,
    "corpus.regenerate.max_tokens": 192,
    "corpus.regenerate.batch_size": 128,
    "corpus.regenerate.gpu_memory_utilization": 0.1,
    "corpus.regenerate.kv_cache_memory_bytes": 1 << 30,
    "corpus.regenerate.reserved_cpus": 0,
    "tokenize.max_length": 448,
    "extract.max_num_batched_tokens": 2048,
    "extract.max_num_seqs": 64,
    "extract.gpu_memory_utilization": 0.1,
    "extract.kv_cache_memory_bytes": 1 << 28,
    "extract.reserved_cpus": 0,
    "extract.deterministic": True,
    "vocab.draft_vocab_size": 4096,
    "train.tokens_per_batch": 1024,
    "train.optimizer": "muon",
    "train.epochs": 3,
    "train.threads": 2,
    "bench.dtype": "float32",
    "bench.max_model_len": 2048,
    "bench.max_num_seqs": 1,
    "bench.max_tokens": 128,
    "bench.repeats": 1,
    "bench.num_speculative_tokens": [1, 2],
    "bench.gpu_memory_utilization": 0.05,
    "bench.kv_cache_memory_bytes": 201326592,
    "bench.reserved_cpus": 0,
    "resources.train_gpus": 0,
    "resources.mem_mb": {"default": 4000, "extract": 8000, "train": 8000, "bench": 14000},
}


def schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


def schema_keys(node: dict, prefix: str = "") -> dict[str, dict]:
    """Every key of the schema, dotted ([] marks an array's items), with its spec."""
    keys = {}
    for name, spec in node.get("properties", {}).items():
        key = f"{prefix}{name}"
        keys[key] = spec
        keys.update(schema_keys(spec, f"{key}."))
        if "items" in spec and spec["items"].get("type") == "object":
            keys.update(schema_keys(spec["items"], f"{key}[]."))
    return keys


def schema_node(key: str) -> dict:
    node = schema()
    for part in key.split("."):
        items = part.endswith("[]")
        node = node["properties"][part.removesuffix("[]")]
        if items:
            node = node["items"]
    return node


def dotted(config: dict, key: str):
    for part in key.split("."):
        config = config[part]
    return config


@pytest.mark.parametrize("settings", [entry[0] for entry in SETTINGS])
def test_no_settings_field_has_a_default(settings):
    defaults = [
        field.name
        for field in dataclasses.fields(settings)
        if field.default is not dataclasses.MISSING
        or field.default_factory is not dataclasses.MISSING
    ]
    assert defaults == [], f"{settings.__name__} defaults {defaults}: the schema holds them"


def test_every_schema_key_has_a_default():
    keys = schema_keys(schema())
    missing = {key for key, spec in keys.items() if "default" not in spec}
    assert sorted(missing - NO_DEFAULT) == []
    # The listed ones exist (a renamed key would leave a stale entry here).
    assert set(keys) >= NO_DEFAULT


@pytest.mark.parametrize(("settings", "section", "elsewhere"), SETTINGS)
def test_every_field_is_a_schema_key(settings, section, elsewhere):
    if section is None:
        return
    keys = set(schema_node(section)["properties"])
    for field in dataclasses.fields(settings):
        key = elsewhere.get(field.name) or f"{section}.{field.name}"
        parent, _, name = key.rpartition(".")
        assert name in schema_node(parent)["properties"] if parent else True, key
    fields = {f.name for f in dataclasses.fields(settings)} - set(elsewhere)
    # Keys read by the rules rather than by the stage's code, or by the stage's engine
    # (draftflow.engine_settings).
    elsewhere_read = {
        "extract": EXTRACT_DAG_KEYS | EXTRACT_ENGINE_KEYS,
        "corpus.regenerate": {"enabled"},
    }
    assert keys - elsewhere_read.get(section, set()) == fields


def test_the_demo_builds_every_settings_class():
    config = load_config(DEMO_CONFIG)
    regenerate = {k: v for k, v in config["corpus"]["regenerate"].items() if k != "enabled"}
    extract = extract_settings(config)
    assert extract.verify == VerifySettings(**config["extract"]["verify"])
    assert extract.engine == engine_settings(config, "extract")
    assert (extract.engine.device, extract.engine.tensor_parallel_size) == ("cpu", 1)
    from_section(TrainSettings, config["train"], "train")
    from_section(RegenerateSettings, regenerate, "corpus.regenerate")
    for source in config["corpus"]["sources"]:
        from_section(Source, source, "corpus.sources")


def test_the_merged_demo_keeps_its_cpu_values():
    """config/demo.yaml over the schema's (GPU) defaults: the values the demo ran with."""
    config = load_config(DEMO_CONFIG)
    assert config["engine"] == {"device": "cpu", "tensor_parallel_size": 1}
    for key, value in DEMO_BEFORE.items():
        assert dotted(config, key) == value, key


def test_schema_defaults_are_for_gpu_runs():
    """A config that names only a target and a corpus gets GPU settings, not the demo's."""
    defaults = {key: spec.get("default") for key, spec in schema_keys(schema()).items()}
    assert defaults["engine.device"] == "gpu"
    for stage in ("corpus.regenerate", "extract", "bench"):
        assert defaults[f"{stage}.gpu_memory_utilization"] == 0.9, stage
        assert defaults[f"{stage}.kv_cache_memory_bytes"] is None, stage
        assert defaults[f"{stage}.reserved_cpus"] is None, stage
    assert defaults["bench.dtype"] is None  # the target's own dtype
    assert defaults["corpus.regenerate.max_model_len"] is None  # tokenize.max_length


def test_the_template_sets_no_value_the_schema_defaults():
    assert yaml.safe_load(BASE_CONFIG.read_text()) == {}


def test_the_template_alone_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"target\.path, corpus\.sources.*config/demo\.yaml"):
        load_config()


def test_a_user_config_gets_the_schema_defaults(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "target: {path: /models/m}\ncorpus: {sources: [{name: c, path: /data/c.jsonl}]}\n"
    )
    config = load_config(mine)
    assert config["extract"]["gpu_memory_utilization"] == 0.9
    assert config["extract"]["kv_cache_memory_bytes"] is None
    assert config["bench"]["datasets"][0]["name"] == "mtbench"
    assert config["bench"]["datasets"][0]["limit"] is None  # the items' defaults filled too
    assert config["engine"] == {"device": "gpu", "tensor_parallel_size": 1}


def test_an_unknown_key_is_named():
    with pytest.raises(ValueError, match=r"unknown extract.verify settings \['fractoin'\]"):
        from_section(ExtractSettings, {"verify": {"fractoin": 0.5}}, "extract")


def test_files_merge_as_snakemake_merges_configfiles(tmp_path):
    """Nested sections merge key by key; a list or a value is replaced whole."""
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(
        "corpus:\n  max_conversations: 7\n  regenerate:\n    max_tokens: 5\n"
        "bench:\n  num_speculative_tokens: [4]\n"
    )
    base = load_config(DEMO_CONFIG)
    merged = load_config(DEMO_CONFIG, overlay)
    assert merged["corpus"]["max_conversations"] == 7
    assert merged["corpus"]["regenerate"]["max_tokens"] == 5
    assert merged["corpus"]["regenerate"]["enabled"] == base["corpus"]["regenerate"]["enabled"]
    assert merged["corpus"]["sources"] == base["corpus"]["sources"]
    assert merged["bench"]["num_speculative_tokens"] == [4]


def test_load_config_equals_snakemakes_own_config(tmp_path):
    """The merged config of load_config is the one Snakemake's jobs see (same files, same
    order): the workflow's own ``config`` after a dry run, in a copy of the workflow."""
    from workflow_support import copy_workflow, snakemake_command

    workdir = copy_workflow(tmp_path / "workflow")
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("corpus:\n  regenerate:\n    max_tokens: 5\nbench:\n  repeats: 2\n")
    seen = tmp_path / "config.json"
    (workdir / "dump.smk").write_text(
        'include: "Snakefile"\n\n'
        "import json\n\n"
        f'with open("{seen}", "w") as out:\n'
        "    json.dump(config, out)\n"
    )
    subprocess.run(
        [
            *snakemake_command(),
            "-n",
            "--snakefile",
            "dump.smk",
            "--configfile",
            str(DEMO_CONFIG),
            str(overlay),
            "--cores",
            "1",
            "-q",
        ],
        check=True,
        capture_output=True,
        cwd=workdir,
    )
    expected = load_config(DEMO_CONFIG, overlay, base=workdir / "config" / "config.yaml")
    assert json.loads(seen.read_text()) == json.loads(json.dumps(expected))


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda builder: builder.__qualname__)
def test_no_builder_has_a_default(builder):
    parameters = inspect.signature(builder).parameters.values()
    defaults = [p.name for p in parameters if p.default is not inspect.Parameter.empty]
    assert defaults == [], f"{builder.__module__}.{builder.__qualname__} defaults {defaults}"


def defaulted_parameters(tree: ast.Module) -> set[tuple[str, str]]:
    """(qualified function name, parameter) of every parameter with a default in ``tree``."""
    found = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                positional = args.posonlyargs + args.args
                with_defaults = positional[len(positional) - len(args.defaults) :]
                with_defaults += [
                    arg
                    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                    if default is not None
                ]
                found.update((f"{prefix}{child.name}", arg.arg) for arg in with_defaults)
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def test_no_function_defaults_a_config_value():
    """No function of draftflow restates a config value as a keyword default: a parameter named
    like a schema key has none, but for the listed ones, which are no config value."""
    names = {
        key.rpartition(".")[2].removesuffix("[]")
        for key, spec in schema_keys(schema()).items()
        if "properties" not in spec
    }
    package = REPO / "draftflow"
    found = set()
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = str(path.relative_to(package))
        found |= {
            (where, function, name)
            for function, name in defaulted_parameters(tree)
            if name in names
        }
    assert sorted(found - set(NOT_CONFIG_VALUES)) == []
    # The lists name only what is there (a fixed or renamed one leaves a stale entry).
    assert sorted(set(NOT_CONFIG_VALUES) - found) == []
