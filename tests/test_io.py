"""Directories published whole: the old one stays until the new one is complete."""

from __future__ import annotations

import pytest

from draftflow.io import publish_dir, staged_dir


def test_publish_dir_replaces_the_old_directory(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    work = tmp_path / "out.partial"
    work.mkdir()
    (work / "new.txt").write_text("new")
    assert publish_dir(work, final) == final
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert not work.exists()


def test_staged_dir_publishes_on_success_and_leaves_nothing_on_error(tmp_path):
    final = tmp_path / "sub" / "out"
    with staged_dir(final) as tmp:
        (tmp / "a.txt").write_text("a")
    assert (final / "a.txt").read_text() == "a"
    with pytest.raises(RuntimeError), staged_dir(final) as tmp:
        (tmp / "b.txt").write_text("b")
        raise RuntimeError("killed")
    assert sorted(p.name for p in final.iterdir()) == ["a.txt"]
    assert sorted(p.name for p in final.parent.iterdir()) == ["out"]
