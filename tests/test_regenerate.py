"""regenerate: turn-by-turn answers from the real target (vLLM CPU), drops, and resuming."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftflow.corpus.regenerate import (
    PROGRESS_FORMAT,
    RegenerateSettings,
    load_progress,
    make_engine,
    planned_messages,
    regenerate,
)

MAX_MODEL_LEN = 256
SETTINGS = RegenerateSettings(temperature=0.0, max_tokens=8, batch_size=2)


def conversation(conversation_id: str, *messages: tuple[str, str]) -> dict:
    return {
        "id": conversation_id,
        "source": "test",
        "messages": [{"role": role, "content": content} for role, content in messages],
    }


# Sorted by id like ingest's output; with batch_size 2 the batches are [a, b] and [c, d].
CONVERSATIONS = [
    conversation(
        "test-a",
        ("user", "Hi! Who are you?"),
        ("assistant", "OLD ANSWER 1"),
        ("user", "What is 2+2?"),
        ("assistant", "OLD ANSWER 2"),
        ("user", "A last question nobody answered."),
    ),
    conversation(
        "test-b",
        ("system", "Answer in French."),
        ("user", "Name a colour."),
        ("assistant", "OLD ANSWER"),
    ),
    # its first prompt alone is longer than the context: dropped
    conversation("test-c", ("user", "word " * (MAX_MODEL_LEN + 10)), ("assistant", "OLD")),
    conversation("test-d", ("user", "Say a number."), ("assistant", "OLD")),
]


def test_make_engine_shards_the_target_over_the_jobs_gpus(monkeypatch, tmp_path: Path):
    import vllm

    from draftflow.workflow.cpu_threads import cpu_engine_env

    for key in cpu_engine_env(None):  # make_engine sets them: put them back afterwards
        monkeypatch.setenv(key, os.environ.get(key, "unset"))
        if os.environ[key] == "unset":
            monkeypatch.delenv(key)
    seen: list[dict] = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: seen.append(kwargs))
    make_engine(tmp_path, max_model_len=64, gpu_memory_utilization=0.1)
    make_engine(tmp_path, max_model_len=64, gpu_memory_utilization=0.1, tensor_parallel_size=2)
    assert "tensor_parallel_size" not in seen[0]
    assert seen[1]["tensor_parallel_size"] == 2


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path):
    engine = make_engine(
        smollm2_dir,
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=64 << 20,  # ~2800 tokens of SmolLM2 KV cache: plenty here
    )
    yield engine
    # Stop the engine process now, while pytest's log capture is still open.
    engine.llm_engine.engine_core.shutdown()


def run(llm, tmp_path: Path, settings: RegenerateSettings = SETTINGS, **kwargs) -> dict:
    return regenerate(
        CONVERSATIONS,
        llm,
        settings,
        output=tmp_path / "regenerated.jsonl",
        summary=tmp_path / "regenerated.summary.json",
        progress=tmp_path / "regenerated.progress.jsonl",
        run_fingerprint=kwargs.pop("run_fingerprint", "fp-1"),
        **kwargs,
    )


def read_output(tmp_path: Path) -> dict[str, dict]:
    lines = (tmp_path / "regenerated.jsonl").read_text().splitlines()
    return {c["id"]: c for c in map(json.loads, lines)}


def greedy(llm, messages: list[dict], max_tokens: int = 8) -> str:
    """The target's greedy answer to a history, computed independently of the stage."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    [output] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return output.outputs[0].text


# ------------------------------------------------------------------ without an engine


def test_planned_messages_stop_at_the_last_answer_to_regenerate() -> None:
    messages = CONVERSATIONS[0]["messages"]
    assert [m["content"] for m in planned_messages(messages, None)] == [
        "Hi! Who are you?",
        "OLD ANSWER 1",
        "What is 2+2?",
        "OLD ANSWER 2",
    ]
    assert [m["content"] for m in planned_messages(messages, 1)] == [
        "Hi! Who are you?",
        "OLD ANSWER 1",
    ]
    assert planned_messages([{"role": "user", "content": "q"}], None) == []


def test_torn_progress_line_is_cut_and_stale_file_removed(tmp_path: Path) -> None:
    progress = tmp_path / "p.jsonl"
    header = json.dumps({"format": PROGRESS_FORMAT, "fingerprint": "fp"})
    entry = json.dumps({"id": "x", "outcome": "regenerated"})
    progress.write_text(f"{header}\n{entry}\n" + '{"id": "y", "outc')
    assert list(load_progress(progress, "fp")) == ["x"]
    assert progress.read_text() == f"{header}\n{entry}\n"
    assert load_progress(progress, "other settings") == {}
    assert not progress.exists()


# ------------------------------------------------------------------ the real engine


@pytest.mark.vllm
def test_regenerate_answers_turn_by_turn_on_regenerated_history(llm, tmp_path: Path) -> None:
    summary = run(llm, tmp_path)
    out = read_output(tmp_path)
    assert sorted(out) == ["test-a", "test-b", "test-d"]

    a = out["test-a"]["messages"]
    assert [m["role"] for m in a] == ["user", "assistant", "user", "assistant"]
    assert [a[0]["content"], a[2]["content"]] == ["Hi! Who are you?", "What is 2+2?"]
    assert not any(m["content"].startswith("OLD") for m in a)
    # turn 1 answers the user; turn 2 is conditioned on the *regenerated* turn 1
    assert a[1]["content"] == greedy(llm, a[:1])
    assert a[3]["content"] == greedy(llm, a[:3])
    assert out["test-b"]["messages"][0] == {"role": "system", "content": "Answer in French."}
    assert out["test-b"]["source"] == "test"

    assert summary["conversations_in"] == 4
    assert summary["kept"] == 3
    assert summary["dropped"] == {"prompt_too_long": 1, "empty_answer": 0, "no_assistant_turn": 0}
    assert summary["answers_generated"] == 4
    assert 0 < summary["generated_tokens"] <= 4 * 8
    assert summary["resumed"] == 0
    assert json.loads((tmp_path / "regenerated.summary.json").read_text()) == summary
    assert not (tmp_path / "regenerated.progress.jsonl").exists()


@pytest.mark.vllm
def test_max_turns_limits_the_regenerated_turns(llm, tmp_path: Path) -> None:
    settings = RegenerateSettings(temperature=0.0, max_tokens=8, batch_size=4, max_turns=1)
    run(llm, tmp_path, settings=settings)
    assert [m["role"] for m in read_output(tmp_path)["test-a"]["messages"]] == ["user", "assistant"]


@pytest.mark.vllm
def test_resume_after_crash_skips_finished_conversations(llm, tmp_path: Path) -> None:
    class Crash(Exception):
        pass

    def crash_after_first_batch(number: int) -> None:
        if number == 1:
            raise Crash

    with pytest.raises(Crash):
        run(llm, tmp_path, after_batch=crash_after_first_batch)
    progress = tmp_path / "regenerated.progress.jsonl"
    lines = [json.loads(line) for line in progress.read_text().splitlines()]
    assert lines[0] == {"format": PROGRESS_FORMAT, "fingerprint": "fp-1"}
    assert [entry["id"] for entry in lines[1:]] == ["test-a", "test-b"]
    assert not (tmp_path / "regenerated.jsonl").exists()

    # Mark test-a's saved answer: if the restart redid test-a, the mark would vanish.
    lines[1]["conversation"]["messages"][1]["content"] = "SAVED BEFORE THE CRASH"
    progress.write_text("".join(json.dumps(line) + "\n" for line in lines))

    summary = run(llm, tmp_path)
    out = read_output(tmp_path)
    assert summary["resumed"] == 2
    assert out["test-a"]["messages"][1]["content"] == "SAVED BEFORE THE CRASH"
    assert sorted(out) == ["test-a", "test-b", "test-d"]
    assert summary["dropped"]["prompt_too_long"] == 1

    # A changed fingerprint (other input or settings) ignores the old progress.
    progress.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run(llm, tmp_path, run_fingerprint="fp-2")
    assert summary["resumed"] == 0
    assert read_output(tmp_path)["test-a"]["messages"][1]["content"] != "SAVED BEFORE THE CRASH"


# ------------------------------------------------------------------ the real rule


@pytest.mark.vllm
@pytest.mark.workflow
def test_regenerate_rule_runs_in_snakemake(
    tmp_path: Path, repo_root: Path, smollm2_dir: Path
) -> None:
    import yaml

    workdir = tmp_path / "work"
    # The prepared target, hard-linked (cheap, and the cache is safe if Snakemake replaces it).
    shutil.copytree(smollm2_dir, workdir / "resources" / "target", copy_function=os.link)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    config = yaml.safe_load((repo_root / "config" / "config.yaml").read_text())
    config["corpus"].update(sources=[{"name": "tiny", "path": str(corpus)}], max_conversations=None)
    config["corpus"]["regenerate"].update(
        enabled=True,
        max_tokens=8,
        max_model_len=MAX_MODEL_LEN,
        batch_size=2,
        kv_cache_memory_bytes=64 << 20,
    )
    config_path = tmp_path / "config.yaml"
    config_path.write_text(json.dumps(config))
    command = [
        str(Path(sys.executable).parent / "snakemake"),
        "--snakefile", str(repo_root / "Snakefile"),
        "--directory", str(workdir),
        "--configfile", str(config_path),
        "--cores", "2",
        "results/corpus/regenerated.jsonl",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "prepare_target" not in result.stderr  # the prepared target was used as it is
    lines = (workdir / "results/corpus/regenerated.jsonl").read_text().splitlines()
    regenerated = [json.loads(line) for line in lines]
    # ingest gives ids of its own; the long conversation is dropped by regenerate
    assert len(regenerated) == 3
    assert not any(m["content"].startswith("OLD") for c in regenerated for m in c["messages"])
    summary = json.loads((workdir / "results/corpus/regenerated.summary.json").read_text())
    assert summary["dropped"]["prompt_too_long"] == 1
    assert not (workdir / "results/corpus/regenerated.progress.jsonl").exists()
    assert "regenerate: kept 3 of 4" in (workdir / "logs/regenerate.log").read_text()
