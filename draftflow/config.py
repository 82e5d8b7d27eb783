"""Config sections -> settings dataclasses, all built one way.

``validate()`` in rules/common.smk fills every default from config/schema.yaml, so a rule indexes
the config directly and a settings class takes its section as it is; its own defaults match the
schema's (tests/test_settings_defaults.py) for callers that build it without a config.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

Settings = TypeVar("Settings")


def from_section(
    cls: type[Settings], section: Mapping[str, Any], name: str, **given: Any
) -> Settings:
    """``cls`` from the config section ``name`` plus values ``given`` from elsewhere.

    A key that is no field of ``cls`` is an error (a typo would otherwise fall back to the
    default unnoticed); a nested settings class takes its sub-section as a mapping.
    """
    values = {**section, **given}
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {name} settings {unknown}; known: {sorted(known)}")
    types = typing.get_type_hints(cls)
    for key, value in values.items():
        nested = types[key]
        if dataclasses.is_dataclass(nested) and isinstance(value, Mapping):
            values[key] = from_section(nested, value, f"{name}.{key}")
    return cls(**values)


REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "config" / "schema.yaml"


def load_config(
    path: str | os.PathLike[str] = REPO / "config" / "config.yaml",
    *overlays: str | os.PathLike[str],
) -> dict[str, Any]:
    """A config file as the workflow sees it: ``overlays`` merged over it in order (as
    Snakemake merges several ``--configfile``), validated against config/schema.yaml, defaults
    filled (for the drivers that run stages outside Snakemake)."""
    import yaml
    from snakemake.utils import validate

    config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    for overlay in overlays:
        merge_config(config, yaml.safe_load(Path(overlay).read_text(encoding="utf-8")) or {})
    validate(config, str(SCHEMA))
    return config


def merge_config(config: dict[str, Any], overlay: Mapping[str, Any]) -> None:
    """``overlay`` into ``config`` in place: mappings merge key by key, anything else replaces."""
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(config.get(key), dict):
            merge_config(config[key], value)
        else:
            config[key] = value
