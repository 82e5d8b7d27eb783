"""Settings dataclasses default to what config/schema.yaml says (the schema fills the config)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from draftflow.capture.extract import ExtractSettings
from draftflow.corpus.regenerate import RegenerateSettings
from draftflow.train.settings import TrainSettings

SCHEMA = Path(__file__).resolve().parents[1] / "config" / "schema.yaml"


def schema_defaults(section: str) -> dict:
    """Defaults of a config section, named by its dotted path (e.g. ``corpus.regenerate``)."""
    node = yaml.safe_load(SCHEMA.read_text())
    for key in section.split("."):
        node = node["properties"][key]
    properties = node["properties"]
    return {key: spec["default"] for key, spec in properties.items() if "default" in spec}


def dataclass_default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


@pytest.mark.parametrize(
    ("section", "settings"),
    [
        ("train", TrainSettings),
        ("corpus.regenerate", RegenerateSettings),
        ("extract", ExtractSettings),
    ],
)
def test_dataclass_defaults_are_the_schema_defaults(section, settings):
    defaults = schema_defaults(section)
    for field in dataclasses.fields(settings):
        if field.name in defaults:
            assert dataclass_default(field) == defaults[field.name], f"{section}.{field.name}"


def test_every_train_setting_is_in_the_schema():
    assert set(schema_defaults("train")) == {f.name for f in dataclasses.fields(TrainSettings)}
