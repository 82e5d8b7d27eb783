"""Settings dataclasses default to what config/schema.yaml says (the schema fills the config), and
every one is built from its config section the same way (draftflow.config.from_section)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from draftflow.capture.extract import ExtractSettings, VerifySettings
from draftflow.config import from_section, load_config
from draftflow.corpus.ingest import Source
from draftflow.corpus.regenerate import RegenerateSettings
from draftflow.data.split import SplitSettings
from draftflow.data.tokenize import TokenizeSettings
from draftflow.report.summary import Bootstrap
from draftflow.train.settings import TrainSettings

SCHEMA = Path(__file__).resolve().parents[1] / "config" / "schema.yaml"

# Each settings class, its section (a dotted path; [] an array's items) and the fields it takes
# from elsewhere (another section, or the rule), by field name -> schema key or None.
SETTINGS = [
    (TrainSettings, "train", {}),
    (RegenerateSettings, "corpus.regenerate", {}),
    (ExtractSettings, "extract", {"trust_remote_code": "target.trust_remote_code"}),
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
]


def schema_node(key: str) -> dict:
    node = yaml.safe_load(SCHEMA.read_text())
    for part in key.split("."):
        items = part.endswith("[]")
        node = node["properties"][part.removesuffix("[]")]
        if items:
            node = node["items"]
    return node


def schema_default(key: str):
    section, _, name = key.rpartition(".")
    spec = schema_node(section)["properties"][name]
    return spec.get("default", dataclasses.MISSING)


def dataclass_default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def schema_key(section: str | None, elsewhere: dict, name: str) -> str:
    return elsewhere.get(name) or f"{section}.{name}"


@pytest.mark.parametrize(("settings", "section", "elsewhere"), SETTINGS)
def test_every_field_is_a_schema_key_with_the_same_default(settings, section, elsewhere):
    for field in dataclasses.fields(settings):
        default = dataclass_default(field)
        if dataclasses.is_dataclass(default):
            continue  # a section of its own, checked on its own
        key = schema_key(section, elsewhere, field.name)
        assert schema_default(key) == default, key


@pytest.mark.parametrize(("settings", "section", "elsewhere"), SETTINGS)
def test_every_schema_key_is_a_field(settings, section, elsewhere):
    if section is None:
        return
    keys = set(schema_node(section)["properties"])
    fields = {f.name for f in dataclasses.fields(settings)} - set(elsewhere)
    # Keys read by the rules rather than by the stage's code.
    rules_only = {"extract": {"num_shards"}, "corpus.regenerate": {"enabled"}}
    assert keys - rules_only.get(section, set()) == fields


def test_the_default_config_builds_every_settings_class():
    config = load_config()
    extract = {k: v for k, v in config["extract"].items() if k != "num_shards"}
    regenerate = {k: v for k, v in config["corpus"]["regenerate"].items() if k != "enabled"}
    assert from_section(ExtractSettings, extract, "extract").verify == VerifySettings(
        **config["extract"]["verify"]
    )
    from_section(TrainSettings, config["train"], "train")
    from_section(RegenerateSettings, regenerate, "corpus.regenerate")
    for source in config["corpus"]["sources"]:
        from_section(Source, source, "corpus.sources")


def test_an_unknown_key_is_named():
    with pytest.raises(ValueError, match=r"unknown extract.verify settings \['fractoin'\]"):
        from_section(ExtractSettings, {"verify": {"fractoin": 0.5}}, "extract")


def test_overlays_merge_as_snakemake_merges_configfiles(tmp_path):
    """Nested sections merge key by key; a list or a value is replaced whole."""
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(
        "corpus:\n  max_conversations: 7\n  regenerate:\n    max_tokens: 5\n"
        "bench:\n  num_speculative_tokens: [4]\n"
    )
    base = load_config()
    from draftflow.config import REPO as PACKAGE_REPO

    merged = load_config(PACKAGE_REPO / "config" / "config.yaml", overlay)
    assert merged["corpus"]["max_conversations"] == 7
    assert merged["corpus"]["regenerate"]["max_tokens"] == 5
    assert merged["corpus"]["regenerate"]["enabled"] == base["corpus"]["regenerate"]["enabled"]
    assert merged["corpus"]["sources"] == base["corpus"]["sources"]
    assert merged["bench"]["num_speculative_tokens"] == [4]
