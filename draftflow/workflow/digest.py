"""Code digests: rerun a stage when the ``draftflow`` code it runs changes.

Snakemake's ``code`` rerun trigger covers a rule's own script, not the package modules that
script imports. ``code_digest`` hashes the source of a stage's entry modules plus every
``draftflow`` module they import, directly or not; passed as ``params: code=...`` it makes
Snakemake rerun exactly the stages whose code changed.

Imports are found by parsing the files with ``ast`` (nothing is imported), so computing the
digests costs milliseconds at DAG-build time and never pulls in torch or vLLM.
"""

from __future__ import annotations

import ast
import hashlib
import re
from functools import cache
from pathlib import Path

PACKAGE = "draftflow"
# A dotted name in a string, e.g. vLLM's worker_extension_cls="draftflow.capture.worker.Hooks":
# code that runs although no import statement names it.
DOTTED_NAME = re.compile(rf"^{PACKAGE}(\.[A-Za-z_][A-Za-z0-9_]*)+$")
# The directory that contains the draftflow package (this file is draftflow/workflow/digest.py).
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def module_file(module: str, root: Path = SOURCE_ROOT) -> Path | None:
    """Source file of a draftflow module or package, or None when there is none."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _parents(module: str) -> list[str]:
    """Packages Python runs before a module: ``a.b.c`` → ``a``, ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


@cache
def _imports_of(path: Path, module: str, mtime_ns: int) -> tuple[str, ...]:
    """Names of the draftflow modules (or module attributes) a file imports, anywhere in it.

    Imports inside functions count: a lazy import still runs that module's code.
    ``mtime_ns`` is only part of the cache key, so an edited file is parsed again.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _package_of(module, path)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # Relative import: climb (level - 1) packages up from the file's own package.
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, node.module] if node.module else base_parts)
            else:
                base = node.module or ""
            found.append(base)
            # `from draftflow.x import y` may name a submodule y: try it as one.
            found.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and DOTTED_NAME.match(node.value)
        ):
            found.extend([node.value, node.value.rpartition(".")[0]])
    return tuple(name for name in found if name == PACKAGE or name.startswith(PACKAGE + "."))


def module_closure(entry_modules: list[str], root: Path = SOURCE_ROOT) -> dict[str, Path]:
    """Every draftflow module the entry modules run, mapped to its source file."""
    files: dict[str, Path] = {}
    pending: list[str] = []
    for module in entry_modules:
        if not (module == PACKAGE or module.startswith(PACKAGE + ".")):
            raise ValueError(f"stage module {module!r} is not inside the {PACKAGE} package")
        if module_file(module, root) is None:
            raise ValueError(
                f"stage module {module!r} has no source file under {root / PACKAGE} "
                f"(expected {module.replace('.', '/')}.py or …/__init__.py)"
            )
        pending.append(module)
    while pending:
        module = pending.pop()
        if module in files:
            continue
        path = module_file(module, root)
        if path is None:
            # `from draftflow.x import name` where name is a function, not a module.
            continue
        files[module] = path
        pending.extend(_parents(module))
        pending.extend(_imports_of(path, module, path.stat().st_mtime_ns))
    return files


def code_digest(stage_modules: list[str], root: Path = SOURCE_ROOT) -> str:
    """sha256 over the sources of ``stage_modules`` and their draftflow-internal imports."""
    digest = hashlib.sha256()
    closure = module_closure(stage_modules, root)
    for module in sorted(closure):
        # Module name and length framing: a rename or moved bytes change the digest too.
        source = closure[module].read_bytes()
        digest.update(f"{module}\0{len(source)}\0".encode())
        digest.update(source)
    return digest.hexdigest()


def script_modules(script: str | Path, root: Path = SOURCE_ROOT) -> list[str]:
    """The draftflow modules a rule script imports directly: a stage's entry modules."""
    path = Path(script)
    if not path.is_file():
        raise ValueError(f"rule script {str(path)!r} does not exist")
    imported = _imports_of(path.resolve(), "__main__", path.stat().st_mtime_ns)
    return sorted({name for name in imported if module_file(name, root) is not None})
