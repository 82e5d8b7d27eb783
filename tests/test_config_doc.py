"""config/README.md is generated from config/schema.yaml and must agree with it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import config_doc  # noqa: E402

CONFIGS = sorted([REPO / "config" / "demo.yaml", *(REPO / "config" / "examples").glob("*.yaml")])
# The --configfile arguments a shipped file's own header gives for its run.
RUN_COMMAND = re.compile(r"snakemake --configfile ((?:\S+\.yaml ?)+)")


def test_every_schema_property_has_a_description() -> None:
    assert config_doc.undescribed_keys(config_doc.load_schema()) == []


def test_readme_matches_the_schema() -> None:
    expected = config_doc.render(config_doc.load_schema())
    assert config_doc.README.read_text(encoding="utf-8") == expected, (
        "config/README.md is stale: run `python tools/config_doc.py`"
    )


def test_check_mode_catches_a_stale_readme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "README.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(config_doc, "README", stale)
    assert config_doc.main(["--check"]) == 1
    assert config_doc.main([]) == 0
    assert config_doc.main(["--check"]) == 0


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda path: path.name)
def test_every_key_a_config_sets_is_documented(config_path: Path) -> None:
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    assert config_doc.unknown_config_keys(config, config_doc.load_schema()) == []


def _pkg_refs(node) -> list[str]:
    if isinstance(node, dict):
        return [ref for value in node.values() for ref in _pkg_refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _pkg_refs(value)]
    return [node] if isinstance(node, str) and node.startswith("pkg:") else []


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda path: path.name)
def test_every_packaged_file_a_config_names_exists(config_path: Path) -> None:
    """``pkg:`` references (data shipped in the demo's PyPI packages) resolve to real files."""
    from draftflow.resources import resolve_path

    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    refs = _pkg_refs(config)
    assert refs, "every config here uses at least one packaged data file"
    for ref in refs:
        assert resolve_path(ref).is_file(), ref


def test_the_template_sets_nothing_and_names_the_demo() -> None:
    template = REPO / "config" / "config.yaml"
    assert yaml.safe_load(template.read_text(encoding="utf-8")) == {}
    assert "config/demo.yaml" in template.read_text(encoding="utf-8")


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda path: path.name)
def test_every_shipped_run_validates_as_its_header_runs_it(config_path: Path) -> None:
    """The files of the run command in the file's own header, merged as Snakemake merges them
    over the schema's defaults and config/config.yaml: valid, with an engine for every stage."""
    from draftflow.config import load_config
    from draftflow.engine_settings import STAGES, engine_settings

    header = config_path.read_text(encoding="utf-8").split("\n\n")[0]
    (files,) = RUN_COMMAND.findall(header)
    files = files.split()
    assert str(config_path.relative_to(REPO)) == files[-1]
    config = load_config(*(REPO / name for name in files))
    for stage in STAGES:
        engine = engine_settings(config, stage)
        assert engine.device in ("gpu", "cpu") and engine.max_model_len >= 16, stage
    # The GPU examples run every engine on GPUs; the demo and its overlays on the CPU.
    expected = "cpu" if "config/demo.yaml" in files else "gpu"
    assert config["engine"]["device"] == expected
