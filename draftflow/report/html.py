"""Build Snakemake's self-contained HTML report once the workflow has run.

``snakemake --report`` reads the finished run's metadata and the ``report(...)`` outputs with
their captions; it needs the whole workflow to have run in ``workdir``. The end-to-end test
and ``make demo`` call it after the run.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

#: Figures the report rule declares; each must be embedded in the HTML report.
REPORT_FIGURES = (
    "acceptance_length.png",
    "acceptance_per_position.png",
    "speedup.png",
    "train_loss.png",
    "train_accuracy.png",
)


def build_html_report(
    workdir: str | Path,
    out: str | Path = "results/report.html",
    *,
    snakefile: str | Path | None = None,
    configfiles: Sequence[str | Path] = (),
    extra_args: Sequence[str] = (),
    timeout_s: float = 600,
) -> Path:
    """Run ``snakemake --report out`` in ``workdir``; return the report's path.

    Raises ``RuntimeError`` with snakemake's output when it fails or the file is missing, and
    when a declared figure is not in the report.
    """
    workdir = Path(workdir)
    command = [sys.executable, "-m", "snakemake", "--report", str(out)]
    if snakefile is not None:
        command += ["--snakefile", str(snakefile)]
    if configfiles:
        command += ["--configfile", *map(str, configfiles)]
    command += list(extra_args)
    completed = subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    report = workdir / out
    if completed.returncode != 0 or not report.exists():
        raise RuntimeError(
            f"snakemake --report failed (exit {completed.returncode}) in {workdir}:\n"
            f"{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}"
        )
    text = report.read_text(encoding="utf-8", errors="replace")
    missing = [name for name in REPORT_FIGURES if name not in text]
    if missing:
        raise RuntimeError(f"{report} lacks the figures {missing}")
    return report
