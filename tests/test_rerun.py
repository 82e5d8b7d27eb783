"""What reruns after a change: config keys and draftflow code, on the real workflow.

A copy of the finished tiny pipeline (``tiny_pipeline``: every stage, up to the report) is
changed one thing at a time (one config key, or one ``draftflow`` module) and
``snakemake --summary`` says which rules Snakemake would run and which of them changed
themselves. The table ``CHANGES`` is the specification.

The first part tests ``draftflow.workflow.digest`` itself on a small fake package.
"""

from __future__ import annotations

import copy
import os
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from workflow_support import REPO, clone_workdir, read_config, run_snakemake, write_config

from draftflow.workflow.digest import code_digest, module_closure, script_modules


# ---------------------------------------------------------------- code digests
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def fake_package(tmp_path: Path) -> Path:
    _write(
        tmp_path,
        {
            "draftflow/__init__.py": "",
            "draftflow/io.py": "import json\n",
            "draftflow/data/__init__.py": "",
            # relative import of a sibling module, and a from-import naming a submodule
            "draftflow/data/split.py": "from . import hashing\nfrom draftflow import io\n",
            "draftflow/data/hashing.py": "import hashlib\n",
            # lazy import inside a function, and a module named only in a string
            "draftflow/capture/__init__.py": "",
            "draftflow/capture/extract.py": """
                def run():
                    from draftflow.data.split import assign  # noqa
                    return "draftflow.capture.worker.Hooks"
                """,
            "draftflow/capture/worker.py": "from ..io import read_json\n",
            "draftflow/report/__init__.py": "",
            "draftflow/report/plots.py": "import matplotlib\n",
        },
    )
    return tmp_path


def test_closure_follows_every_kind_of_import(fake_package: Path) -> None:
    closure = module_closure(["draftflow.capture.extract"], root=fake_package)
    assert sorted(closure) == [
        "draftflow",
        "draftflow.capture",
        "draftflow.capture.extract",
        "draftflow.capture.worker",
        "draftflow.data",
        "draftflow.data.hashing",
        "draftflow.data.split",
        "draftflow.io",
    ]


def test_digest_changes_exactly_with_the_code_a_stage_runs(fake_package: Path) -> None:
    before = code_digest(["draftflow.capture.extract"], root=fake_package)
    assert before == code_digest(["draftflow.capture.extract"], root=fake_package)
    assert len(before) == 64

    # A module nobody imports: same digest.
    (fake_package / "draftflow/report/plots.py").write_text("import numpy\n")
    assert code_digest(["draftflow.capture.extract"], root=fake_package) == before

    # A module two imports away: new digest.
    hashing = fake_package / "draftflow/data/hashing.py"
    hashing.write_text("import hashlib  # faster\n")
    os.utime(hashing, ns=(1, 1))  # the parse cache is keyed by mtime; the digest is not
    assert code_digest(["draftflow.capture.extract"], root=fake_package) != before


def test_unknown_stage_module_is_a_clear_error(fake_package: Path) -> None:
    with pytest.raises(ValueError, match=r"draftflow\.data\.nope.*no source file"):
        code_digest(["draftflow.data.nope"], root=fake_package)
    with pytest.raises(ValueError, match="not inside the draftflow package"):
        code_digest(["json"], root=fake_package)


# ---------------------------------------------------------------- rules wire their code digest
def _rule_blocks() -> Iterator[tuple[str, str]]:
    for smk in sorted((REPO / "rules").glob("*.smk")):
        for match in re.finditer(
            r"^rule (\w+):\n(.*?)(?=^\S|\Z)", smk.read_text(), re.MULTILINE | re.DOTALL
        ):
            yield match.group(1), match.group(2)


RULES_WITH_SCRIPTS = [
    (name, body) for name, body in _rule_blocks() if re.search(r"^\s+script:", body, re.M)
]


@pytest.mark.parametrize(
    ("rule", "body"), RULES_WITH_SCRIPTS, ids=[name for name, _ in RULES_WITH_SCRIPTS]
)
def test_rule_params_carry_the_digest_of_its_scripts_code(rule: str, body: str) -> None:
    script = re.search(r'script:\s*\n\s*"\.\./scripts/(\w+)\.py"', body).group(1)
    if not script_modules(REPO / "scripts" / f"{script}.py"):
        pytest.skip(f"scripts/{script}.py imports no draftflow module")
    stage = re.search(r'code=stage_code\("(\w+)"\)', body)
    assert stage is not None, f'rule {rule} needs `code=stage_code("{script}"),` in its params'
    # stage_code("x") digests what scripts/x.py imports: it must be this rule's own script.
    assert stage.group(1) == script


# ---------------------------------------------------------------- reruns on the real workflow
@dataclass(frozen=True)
class Change:
    """One edit and its expected consequence on the finished tiny workflow."""

    name: str
    # ("config", "section.key", new value) or ("code", "draftflow/x/y.py", None)
    kind: str
    where: str
    value: Any = None
    # rules whose own params or code changed (or whose outputs are new)
    triggered: frozenset[str] = field(default_factory=frozenset)
    # every rule Snakemake would run: the triggered ones and everything downstream of them
    reruns: frozenset[str] = field(default_factory=frozenset)


def _rules(*names: str) -> frozenset[str]:
    return frozenset(names)


# Downstream chains of the DAG (tokenize also feeds vocab; prompts feeds bench_engines).
REPORT = ("bench_engines", "bench_table", "report")
TRAIN = ("train", *REPORT)
EXTRACT = ("extract", *TRAIN)
DATA = ("tokenize", "split", "shard", "vocab", *EXTRACT)
CHANGES = [
    # corpus: ingest's subset ranking
    Change("corpus.seed", "config", "corpus.seed", 2, _rules("ingest"), _rules("ingest", *DATA)),
    # tokenizer; also the extract engine's context (engine_settings(config, "extract"), in the
    # extract rule's params)
    Change(
        "tokenize.max_length",
        "config",
        "tokenize.max_length",
        96,
        _rules("tokenize", "extract"),
        _rules(*DATA),
    ),
    # tokenize counts train-only token frequencies, so it reads the split settings too
    Change(
        "split.val_fraction",
        "config",
        "split.val_fraction",
        0.3,
        _rules("tokenize", "split"),
        _rules(*DATA),
    ),
    Change(
        "extract.num_shards.train",
        "config",
        "extract.num_shards.train",
        2,
        # train and report read every train store: their input lists gain the new shard's
        _rules("shard", "train", "report"),
        _rules("shard", *EXTRACT),
    ),
    # a layer id of the capture
    Change(
        "extract.aux_layers",
        "config",
        "extract.aux_layers",
        [2, 14, 26],
        _rules("extract"),
        _rules(*EXTRACT),
    ),
    Change(
        "vocab.draft_vocab_size",
        "config",
        "vocab.draft_vocab_size",
        1024,
        _rules("vocab"),
        _rules("vocab", *TRAIN),
    ),
    Change("train.lr", "config", "train.lr", 1.0e-3, _rules("train"), _rules(*TRAIN)),
    Change(
        "bench.max_tokens",
        "config",
        "bench.max_tokens",
        16,
        _rules("bench_engines"),
        _rules(*REPORT),
    ),
    # One more k: every engine runs again (times pair only between engines measured side by
    # side), then the tables.
    Change(
        "bench.num_speculative_tokens",
        "config",
        "bench.num_speculative_tokens",
        [1, 2, 3],
        _rules("bench_engines", "bench_table"),
        _rules(*REPORT),
    ),
    Change(
        "bench.max_turns",
        "config",
        "bench.max_turns",
        1,
        _rules("prompts"),
        _rules("prompts", *REPORT),
    ),
    Change(
        "code:draftflow/data/shard.py",
        "code",
        "draftflow/data/shard.py",
        None,
        _rules("shard"),
        _rules("shard", *EXTRACT),
    ),
    Change(
        "code:draftflow/data/split.py",
        "code",
        "draftflow/data/split.py",
        None,
        # assign_split is used by tokenize (train-only counts) and split
        _rules("tokenize", "split"),
        _rules(*DATA),
    ),
    Change(
        "code:draftflow/capture/verify.py",
        "code",
        "draftflow/capture/verify.py",
        None,
        _rules("extract"),
        _rules(*EXTRACT),
    ),
    Change(
        "code:draftflow/train/loop.py",
        "code",
        "draftflow/train/loop.py",
        None,
        _rules("train"),
        _rules(*TRAIN),
    ),
    Change(
        "code:draftflow/bench/lossless.py",
        "code",
        "draftflow/bench/lossless.py",
        None,
        # The greedy check runs on the engines' results, and in the engines' job, which
        # measures the plain target's margin at each difference (draftflow/bench/margins.py).
        _rules("bench_engines", "bench_table"),
        _rules(*REPORT),
    ),
    Change(
        "code:draftflow/report/plots.py",
        "code",
        "draftflow/report/plots.py",
        None,
        _rules("report"),
        _rules("report"),
    ),
    # A module no stage imports (the test helper behind `snakemake --report`): nothing reruns.
    Change("code:draftflow/report/html.py", "code", "draftflow/report/html.py", None),
]


def _set_key(config: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(config)
    *sections, key = dotted.split(".")
    node = changed
    for section in sections:
        node = node[section]
    assert key in node, f"{dotted} is not in the tiny config"
    assert node[key] != value, f"{dotted} is already {value!r}: not a change"
    node[key] = value
    return changed


@dataclass
class TinyWorkflow:
    """A copy of the finished tiny pipeline; its config/config.yaml is what the tests edit."""

    root: Path
    config: dict[str, Any]

    def snakemake(self, *args: str, config: dict[str, Any] | None = None) -> str:
        write_config(self.root, config or self.config)
        try:
            result = run_snakemake(self.root, *args, "--cores", "2")
        finally:
            write_config(self.root, self.config)
        return result.stdout + result.stderr

    def plan(self, config: dict[str, Any] | None = None) -> tuple[set[str], set[str]]:
        """(rules Snakemake would run for `rule all`, rules whose own params or code changed)."""
        return parse_summary(self.snakemake("--summary", config=config))


def parse_summary(output: str) -> tuple[set[str], set[str]]:
    """Rules with pending updates, and rules whose own params/code changed, from ``--summary``.

    The summary judges every output file on its own, while a dry-run names only the first reason
    of a job (a job whose input is being remade never reports that its params changed too).
    """
    lines = output[output.index("output_file\tdate\trule") :].splitlines()[1:]
    would_run: set[str] = set()
    triggered: set[str] = set()
    for line in lines:
        fields = line.split("\t")
        if len(fields) != 6:
            continue
        _, _, rule, _, status, plan = fields
        if plan != "no update":
            would_run.add(rule)
        if status.endswith("changed"):
            triggered.add(rule)
    return would_run, triggered


@pytest.fixture(scope="module")
def tiny_workflow(tmp_path_factory: pytest.TempPathFactory, tiny_pipeline: Path) -> TinyWorkflow:
    """A ``cp -a`` copy of the session's finished tiny pipeline (edits stay in the copy)."""
    root = clone_workdir(tiny_pipeline, tmp_path_factory.mktemp("rerun") / "workflow")
    return TinyWorkflow(root, read_config(root))


@pytest.mark.workflow
def test_a_finished_run_has_nothing_to_do(tiny_workflow: TinyWorkflow) -> None:
    assert tiny_workflow.plan() == (set(), set())
    assert "Nothing to be done" in tiny_workflow.snakemake()


@pytest.mark.workflow
@pytest.mark.parametrize("change", CHANGES, ids=[change.name for change in CHANGES])
def test_one_change_reruns_exactly_its_stages(tiny_workflow: TinyWorkflow, change: Change) -> None:
    if change.kind == "config":
        config = _set_key(tiny_workflow.config, change.where, change.value)
        assert tiny_workflow.plan(config) == (set(change.reruns), set(change.triggered))
    else:
        module = tiny_workflow.root / change.where
        original = module.read_bytes()
        stat = module.stat()
        try:
            module.write_bytes(original + b"\n# an edit that changes the module's bytes\n")
            assert tiny_workflow.plan() == (set(change.reruns), set(change.triggered))
        finally:
            module.write_bytes(original)
            os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # Undone, the change leaves nothing to do.
    assert tiny_workflow.plan() == (set(), set())
