"""regenerate: turn-by-turn answers from the real target (vLLM CPU), drops, and resuming."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from config_support import demo_engine_settings, make_engine_arguments, regenerate_settings

from draftflow.corpus.regenerate import (
    PROGRESS_FORMAT,
    RegenerateSettings,
    _Dialogue,
    answer_parser,
    load_progress,
    make_engine,
    planned_messages,
    read_answer,
    regenerate,
)
from draftflow.corpus.toolcalls import ParsedAnswer

MAX_MODEL_LEN = 256
# The demo's settings (config/demo.yaml) but for these.
SETTINGS = regenerate_settings(temperature=0.0, max_tokens=8, batch_size=2, max_turns=None)


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
    for tensor_parallel_size in (1, 2):
        engine = demo_engine_settings(
            "regenerate",
            max_model_len=64,
            reserved_cpus=None,  # the environment restored above is vLLM's default's
            tensor_parallel_size=tensor_parallel_size,
        )
        make_engine(tmp_path, engine, **make_engine_arguments())
    assert "tensor_parallel_size" not in seen[0]
    assert seen[1]["tensor_parallel_size"] == 2


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path):
    settings = demo_engine_settings(
        "regenerate",
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=64 << 20,  # ~2800 tokens of SmolLM2 KV cache: plenty here
        reserved_cpus=None,
    )
    engine = make_engine(smollm2_dir, settings, **make_engine_arguments())
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
        max_model_len=MAX_MODEL_LEN,  # the llm fixture's context
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
    settings = regenerate_settings(temperature=0.0, max_tokens=8, batch_size=4, max_turns=1)
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
    from draftflow.config import load_config

    workdir = tmp_path / "work"
    # The prepared target, copied: the copies are newer than the checkout's code (a cache from
    # an older checkout would look out of date to Snakemake's code trigger, there being no
    # metadata here, and prepare_target would rerun). Hard links touched to the same end
    # changed the shared cache's times under every workflow that links it (tiny_pipeline).
    shutil.copytree(smollm2_dir, workdir / "resources" / "target", copy_function=shutil.copy)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    config = load_config(repo_root / "config" / "demo.yaml")
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


# ------------------------------------------------------------------ tool use and reasoning

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def weather_call(city: str, call_id: str = "call_1") -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": city}},
    }


TOOL_CONVERSATION = {
    "id": "test-tools",
    "source": "test",
    "tools": [WEATHER_TOOL],
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [weather_call("Paris")]},
        {"role": "tool", "content": '{"temp_c": 18}', "tool_call_id": "call_1"},
        {"role": "assistant", "content": "OLD: 18 degrees."},
        {"role": "user", "content": "And in Rome?"},
        {"role": "assistant", "content": "OLD: no idea."},
    ],
}


def dialogue(conversation: dict = TOOL_CONVERSATION) -> _Dialogue:
    return _Dialogue(conversation, planned_messages(conversation["messages"], None))


def test_matching_tool_calls_keep_the_recorded_results() -> None:
    talk = dialogue()
    prompt = talk.next_prompt()
    assert prompt == TOOL_CONVERSATION["messages"][:1]
    # the target calls the same function with the same arguments (no id: ids are the record's)
    same = weather_call("Paris")
    del same["id"]
    talk.accept(prompt, ParsedAnswer(content="", tool_calls=[same]))
    prompt = talk.next_prompt()
    assert prompt[1]["tool_calls"] == [weather_call("Paris")]
    assert prompt[2] == TOOL_CONVERSATION["messages"][2]  # the recorded result, verbatim
    talk.accept(prompt, ParsedAnswer(content="Mild.", reasoning="It said 18."))
    assert talk.history[-1] == {"role": "assistant", "content": "Mild.", "reasoning_content": "It said 18."}  # fmt: skip
    prompt = talk.next_prompt()
    assert prompt[-1] == {"role": "user", "content": "And in Rome?"}
    talk.accept(prompt, ParsedAnswer(content="Warm."))
    assert talk.next_prompt() is None
    result = talk.result()
    assert result["outcome"] == "regenerated"
    assert (result["tool_calls"], result["tool_calls_diverged"], result["reasoning_turns"]) == (1, 0, 1)  # fmt: skip
    assert result["conversation"]["tools"] == [WEATHER_TOOL]


@pytest.mark.parametrize(
    "answer",
    [
        ParsedAnswer(content="", tool_calls=[weather_call("Lyon")]),  # other arguments
        ParsedAnswer(content="I cannot check the weather."),  # no call at all
        ParsedAnswer(content="<tool_call>{broken", unparsed=True),  # unreadable: text
    ],
)
def test_diverging_tool_calls_end_the_conversation_without_inventing_results(answer) -> None:
    talk = dialogue()
    prompt = talk.next_prompt()
    talk.accept(prompt, answer)
    assert talk.next_prompt() is None
    result = talk.result()
    assert result["outcome"] == "shortened"
    assert result["tool_calls_diverged"] == 1
    assert result["unparsed_tool_calls"] == int(answer.unparsed)
    messages = result["conversation"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]  # no recorded result follows


def test_a_result_after_a_text_call_is_not_kept_after_a_text_answer() -> None:
    text_call = {
        "id": "test-text-call",
        "source": "test",
        "messages": [
            {"role": "user", "content": "Population of Oslo?"},
            {"role": "assistant", "content": '[get_population(city="Oslo")]'},
            {"role": "tool", "content": "709000"},
            {"role": "assistant", "content": "About 709,000."},
        ],
    }
    talk = dialogue(text_call)
    talk.accept(talk.next_prompt(), ParsedAnswer(content="I do not know."))
    assert talk.next_prompt() is None
    assert talk.result()["tool_calls_diverged"] == 1
    assert [m["role"] for m in talk.result()["conversation"]["messages"]] == ["user", "assistant"]


def test_read_answer_splits_reasoning_and_tool_calls() -> None:
    text = '<think>\nNeed weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'  # fmt: skip
    parsed = read_answer(text, "hermes")
    assert parsed.reasoning == "Need weather."
    assert parsed.content == ""
    assert [c["function"] for c in parsed.tool_calls] == [weather_call("Oslo")["function"]]
    assert read_answer("Plain.", "none") == ParsedAnswer(content="Plain.")


@pytest.mark.vllm
def test_tool_conversation_regenerated_turn_by_turn(llm, tmp_path: Path) -> None:
    """SmolLM2's own template renders no tools: the target answers in text, so the recorded
    tool result is not used and the conversation ends after the target's first turn."""
    summary = regenerate(
        [TOOL_CONVERSATION],
        llm,
        SETTINGS,
        output=tmp_path / "out.jsonl",
        summary=tmp_path / "summary.json",
        progress=tmp_path / "progress.jsonl",
        run_fingerprint="tools",
        max_model_len=MAX_MODEL_LEN,
    )
    [out] = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    source = TOOL_CONVERSATION["messages"]
    assert out["messages"][0] == source[0]
    assert out["messages"][1] == {"role": "assistant", "content": greedy(llm, source[:1])}
    assert len(out["messages"]) == 2
    assert out["tools"] == [WEATHER_TOOL]
    assert summary["tool_calls_diverged"] == 1
    assert summary["outcomes"]["shortened"] == 1


@pytest.mark.vllm
def test_tool_template_prompts_carry_tools_and_the_thinking_switch(
    llm, tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a Qwen3-style template (tests/data/templates/qwen3.jinja) the prompt lists the tools
    and ends in the think block enable_thinking false prefills; answers are read as Hermes.
    vLLM's tokenizer copies cannot take another template: the stage gets SmolLM2's own
    tokenizer with that template (the engine, whose weights answer, is the same)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    tokenizer.chat_template = (Path(__file__).parent / "data/templates/qwen3.jinja").read_text()
    monkeypatch.setattr(llm, "get_tokenizer", lambda: tokenizer)
    settings = regenerate_settings(
        temperature=0.0, max_tokens=8, batch_size=2, max_turns=None, enable_thinking=False
    )
    assert answer_parser(settings, tokenizer) == "hermes"
    summary = regenerate(
        [TOOL_CONVERSATION],
        llm,
        settings,
        output=tmp_path / "out.jsonl",
        summary=tmp_path / "summary.json",
        progress=tmp_path / "progress.jsonl",
        run_fingerprint="qwen3",
        max_model_len=MAX_MODEL_LEN,
    )
    [out] = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    prompt = tokenizer.apply_chat_template(
        out["messages"][:1],
        tools=[WEATHER_TOOL],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert '"name": "get_weather"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    [expected] = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )
    first = read_answer(expected.outputs[0].text, "hermes")
    assert out["messages"][0] == TOOL_CONVERSATION["messages"][0]
    assert out["messages"][1]["content"] == first.content
    assert out["messages"][1].get("tool_calls", []) == first.tool_calls
    assert summary["answers_generated"] >= 1
