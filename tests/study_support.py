"""The scripts under studies/ as modules, for the tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

STUDIES = Path(__file__).resolve().parents[1] / "studies"
# The studies import their shared module (workdir_study) as ``python studies/x.py`` finds them.
if str(STUDIES) not in sys.path:
    sys.path.append(str(STUDIES))


def load_study(name: str) -> ModuleType:
    """``studies/<name>.py`` imported under ``name``."""
    spec = importlib.util.spec_from_file_location(name, STUDIES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
