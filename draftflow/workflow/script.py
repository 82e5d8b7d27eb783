"""Common start of every rule script: log to the rule's log file, find the prepared target."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any


def setup_logging(snakemake: Any) -> logging.Logger:
    """Send stderr (and the logging module) to the rule's first log file.

    Snakemake's catalog convention: a script's first act is to redirect stderr to ``log[0]``,
    so tracebacks and progress bars end up in ``logs/`` where a user looks for them.
    """
    if snakemake.log:
        sys.stderr = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    return logging.getLogger(f"draftflow.{snakemake.rule}")


def target_dir(snakemake: Any) -> Path:
    """The prepared target's directory: rules depend on its description file (``input.target``,
    written last), which sits at the directory's top."""
    return Path(snakemake.input.target).parent
