"""docs/benchmarks.md and README.md's demo table are generated from docs/results/*.json.

Besides comparing the pages with what tools/benchmarks_doc.py writes, the figure rows are read
back from the Markdown as a user sees them and each printed value is compared with the value at
the path its row names, in the file its row links; and every relative link in README.md,
CHANGELOG.md and docs/*.md must resolve to a file or folder in the repository.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import benchmarks_doc  # noqa: E402

PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
FIGURE_PAGES = [REPO / "README.md", REPO / "docs" / "benchmarks.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
RESULTS_LINK = re.compile(r"\]\(([^)]*results/[^)]+\.json)\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
TOKEN = re.compile(r"\byes\b|\bno\b|\d[\d,]*(?:\.\d+)?")


def test_pages_match_the_data() -> None:
    assert benchmarks_doc.main(["--check"]) == 0, "run `python tools/benchmarks_doc.py`"


def test_check_mode_catches_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "benchmarks.md"
    stale.write_text("# Benchmarks\n\n| old | 0.94× |\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# x\n\n{benchmarks_doc.README_BEGIN}\nold\n{benchmarks_doc.README_END}\n\nend\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(benchmarks_doc, "BENCHMARKS", stale)
    monkeypatch.setattr(benchmarks_doc, "README", readme)
    monkeypatch.setattr(benchmarks_doc, "REPO", tmp_path)
    assert benchmarks_doc.main(["--check"]) == 1
    assert benchmarks_doc.main([]) == 0
    assert benchmarks_doc.main(["--check"]) == 0
    assert readme.read_text(encoding="utf-8").endswith("\n\nend\n")


def _figure_rows(text: str, base: Path) -> list[tuple[str, Path, list[str], list[str]]]:
    """(row text, JSON file, value paths, printed tokens) of every table row citing a result;
    links resolve against ``base``, the page's folder."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        link = RESULTS_LINK.search(cells[-1])
        if not link:
            continue
        target = (base / link.group(1)).resolve()
        after_date = cells[-1].split(":", 1)[1] if ":" in cells[-1] else cells[-1]
        paths = benchmarks_doc.expand_paths(CODE_SPAN.findall(after_date))
        values = " ".join(CODE_SPAN.sub("", cell) for cell in cells[1:-1])
        rows.append((line, target, paths, TOKEN.findall(values)))
    return rows


def _matches(printed: str, actual: object) -> bool:
    if printed in ("yes", "no"):
        return str(actual) in (("True", "true") if printed == "yes" else ("False", "false"))
    number = float(printed.replace(",", ""))
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(number - float(actual)) <= 0.5 * 10**-decimals + 1e-9


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=lambda page: page.name)
def test_every_figure_matches_its_json(page: Path) -> None:
    rows = _figure_rows(page.read_text(encoding="utf-8"), page.parent)
    assert len(rows) >= 4, f"{page.name} shows no figure rows"
    for line, target, paths, printed in rows:
        assert target.is_file(), f"{line}: {target} does not exist"
        assert target.parent == REPO / "docs" / "results", line
        assert len(paths) == len(printed), f"{line}: {len(printed)} figures for {len(paths)} paths"
        data = json.loads(target.read_text(encoding="utf-8"))
        for path, token in zip(paths, printed, strict=True):
            actual = benchmarks_doc.resolve(data, path)
            assert _matches(token, actual), (
                f"{line}: printed {token}, {target.name} {path} = {actual}"
            )


def test_a_wrong_figure_is_caught() -> None:
    """The read-back itself can fail: a row whose printed value differs from its JSON."""
    page = benchmarks_doc.BENCHMARKS
    text = page.read_text(encoding="utf-8")
    needle = "results[mode=hooks-v2].ratio_to_plain"  # the 0.24 headline row, one on the page
    line = next(row[0] for row in _figure_rows(text, page.parent) if needle in row[0])
    printed = re.search(r"\| (\d\.\d+)× \|", line).group(1)
    wrong = text.replace(line, line.replace(f"| {printed}× |", "| 0.94× |"))
    (row,) = [row for row in _figure_rows(wrong, page.parent) if needle in row[0]]
    assert row[3] == ["0.94"]
    data = json.loads(row[1].read_text(encoding="utf-8"))
    assert not _matches(row[3][0], benchmarks_doc.resolve(data, row[2][0]))


def test_every_source_names_machine_date_and_command() -> None:
    rows = [
        *benchmarks_doc.DEMO_ROWS,
        *(row for section in benchmarks_doc.SECTIONS for row in section.rows),
    ]
    for source in {row.source for row in rows}:
        data = benchmarks_doc.load(source)
        assert data.get("machine") and data.get("date"), source
        assert data.get("command") or data.get("commands"), source


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return [first or second for first, second in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = unquote(target.split("#", 1)[0])
        if not (page.parent / path).exists():
            broken.append(target)
    assert broken == [], f"{page.relative_to(REPO)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_named_result_files_exist(page: Path) -> None:
    """A measured claim names its file in docs/results/, in a link or in code: it must exist."""
    named = re.findall(r"docs/results/([\w.-]+\.(?:json|png))", page.read_text(encoding="utf-8"))
    missing = sorted({name for name in named if not (REPO / "docs" / "results" / name).is_file()})
    assert missing == [], f"{page.relative_to(REPO)} names missing results {missing}"
