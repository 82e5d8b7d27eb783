"""Config sections -> settings dataclasses, all built one way.

config/schema.yaml is the one source of defaults: ``validate_config()`` (rules/common.smk, and
``load_config()`` for code run outside Snakemake) fills every one, so a rule indexes the config
directly and a settings class takes its section as it is. Settings classes have no defaults of
their own (tests/test_settings_defaults.py).
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
# What the Snakefile loads first (a template that sets nothing the schema defaults).
BASE_CONFIG = REPO / "config" / "config.yaml"
# The CPU demo: an overlay (make demo runs snakemake --configfile config/demo.yaml).
DEMO_CONFIG = REPO / "config" / "demo.yaml"

PathLike = str | os.PathLike[str]


def load_config(*files: PathLike, base: PathLike = BASE_CONFIG) -> dict[str, Any]:
    """The config a run sees: config/schema.yaml's defaults <- ``base`` (config/config.yaml)
    <- ``files`` in order, merged as Snakemake merges ``--configfile`` (mappings key by key,
    anything else replaced whole), then validated. For drivers and tests that run stages
    outside Snakemake; ``base``: a workflow copy's own config/config.yaml."""
    from snakemake.common.configfile import load_configfile

    config: dict[str, Any] = {}
    for path in (base, *files):
        merge_config(config, load_configfile(str(path)))
    return validate_config(config)


def merge_config(config: dict[str, Any], overlay: Mapping[str, Any]) -> None:
    """``overlay`` into ``config`` in place, as Snakemake merges its config files."""
    from snakemake.utils import update_config

    update_config(config, overlay)


def validate_config(config: dict[str, Any]) -> dict[str, Any]:
    """Check ``config`` against config/schema.yaml and fill every default, in place.

    A config without a target (config/config.yaml alone) is refused first with the fix: the
    schema's defaults hold for everything but the target, the corpus and its sources.
    """
    from snakemake.utils import validate

    missing = missing_run_keys(config)
    if missing:
        raise ValueError(
            f"the config does not set {', '.join(missing)}: config/config.yaml is a template "
            "that leaves them to you. Pass your own settings with --configfile my.yaml "
            "(config/README.md describes every key), or run the CPU demo with "
            "--configfile config/demo.yaml (make demo)."
        )
    validate(config, str(SCHEMA))
    return config


def missing_run_keys(config: Mapping[str, Any]) -> list[str]:
    """Keys without a usable schema default that the config leaves unset."""
    target = config.get("target") or {}
    missing = []
    source = target.get("source", "hf")
    if source == "gguf" and not target.get("gguf"):
        missing.append("target.gguf")
    elif source == "hf" and not target.get("path"):
        missing.append("target.path")
    if not (config.get("corpus") or {}).get("sources"):
        missing.append("corpus.sources")
    return missing
