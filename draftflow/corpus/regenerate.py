"""Regenerate: re-answer every assistant turn with the target itself (vLLM).

A draft learns to predict the target, so it should be trained on the target's own answers,
not on the answers of whatever model wrote the corpus. Turn k is answered conditioned on the
*regenerated* history: the user turns of the original, each followed by the target's own earlier
answers. Conversations are batched turn by turn (all first turns of a batch in one engine call,
then all second turns, ...).

Tool use: the target writes its own tool calls (parsed out of its text in the syntax its template
teaches, ``draftflow.corpus.toolcalls``); the recorded tool results are kept, never invented, so
a conversation goes on past a tool call only while the target calls the same functions with the
same arguments as the original did. When it calls something else (or nothing, or calls a tool
where the original answered), its turn is kept and the conversation ends there. Text that looks
like a tool call but cannot be read as one stays text, counted in the summary. Reasoning
(``<think>`` blocks) is stored as ``reasoning_content``; ``enable_thinking`` is passed to the
chat template when set.

Crash safety: each finished batch is appended to a progress file (JSONL, flushed and fsynced);
a restart with the same inputs and settings skips every conversation already there. The
progress file starts with a fingerprint of input, model and settings; a different fingerprint
means a stale file, which is discarded.

Outcomes per conversation:
- ``regenerated``: every planned assistant turn answered;
- ``shortened``: a later turn's prompt no longer fits the context, the target's answer was
  empty, or its tool calls left the recorded ones; the conversation ends after the last good
  answer (kept);
- ``prompt_too_long`` / ``empty_answer``: the same for the first turn (dropped);
- ``no_assistant_turn``: nothing to answer (dropped; ingest never writes such conversations).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from draftflow.corpus.formats import Conversation, Message
from draftflow.corpus.toolcalls import (
    TOOL_CALL_PARSERS,
    ParsedAnswer,
    arguments_encoding,
    detect_parser,
    parse_tool_calls,
    same_calls,
    split_reasoning,
    template_message,
)
from draftflow.engine_settings import EngineSettings
from draftflow.io import atomic_path, atomic_write_json, sha256_file

log = logging.getLogger(__name__)

REGENERATED = "regenerated"
SHORTENED = "shortened"
PROMPT_TOO_LONG = "prompt_too_long"
EMPTY_ANSWER = "empty_answer"
NO_ASSISTANT_TURN = "no_assistant_turn"
KEPT_OUTCOMES = (REGENERATED, SHORTENED)
DROP_OUTCOMES = (PROMPT_TOO_LONG, EMPTY_ANSWER, NO_ASSISTANT_TURN)
OUTCOMES = KEPT_OUTCOMES + DROP_OUTCOMES
PROGRESS_FORMAT = "draftflow-regenerate-progress/1"
# RegenerateSettings of the engine, not of the answers: kept out of the fingerprint (but for
# max_model_len, which fingerprint() takes on its own).
ENGINE_SETTINGS = (
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "reserved_cpus",
)
# Not a config key: the engine runs without CUDA graphs (faster start; corpus.regenerate has no
# engine_args to say otherwise).
ENFORCE_EAGER = True
# Per-conversation counters of tool use and reasoning, summed in the summary.
TOOL_STATS = ("tool_calls", "unparsed_tool_calls", "tool_calls_diverged", "reasoning_turns")


@dataclass(frozen=True)
class RegenerateSettings:
    temperature: float
    top_p: float
    max_tokens: int
    max_turns: int | None
    batch_size: int
    seed: int
    # the chat template's reasoning switch (Qwen3's enable_thinking); None: not passed
    enable_thinking: bool | None
    # tool-call syntax of the target's answers; auto: from its chat template
    tool_call_parser: str
    # the engine's (make_engine)
    max_model_len: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    reserved_cpus: int | None

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser {self.tool_call_parser!r}: allowed {list(TOOL_CALL_PARSERS)}"
            )

    def template_kwargs(self) -> dict[str, bool]:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


# ------------------------------------------------------------------ engine
def regenerate_engine_kwargs(
    model_dir: str | os.PathLike[str],
    engine: EngineSettings,
    *,
    seed: int,
    trust_remote_code: bool,
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of the regenerate engine (``make_engine``; the engine plan
    prints them)."""
    from draftflow.engine import engine_kwargs

    return engine_kwargs(
        model_dir,
        max_model_len=engine.max_model_len,
        kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        tensor_parallel_size=engine.tensor_parallel_size,
        seed=seed,
        trust_remote_code=trust_remote_code,
        enforce_eager=ENFORCE_EAGER,
        extra=engine.engine_args,
    )


def make_engine(
    model_dir: str | os.PathLike[str],
    engine: EngineSettings,
    *,
    seed: int,
    trust_remote_code: bool,
) -> Any:
    """A vLLM engine for generation. Call it under ``if __name__ == "__main__":`` (spawn).

    ``engine``: the regenerate stage's (``engine_settings(config, "regenerate")``), built by
    ``draftflow.engine``: ``kv_cache_memory_bytes`` (exact) wins over
    ``gpu_memory_utilization``; ``reserved_cpus``: cores the CPU build keeps for its scheduler;
    ``tensor_parallel_size``: GPUs the engine shards the target over (the job's leased GPUs).
    The prepared checkpoint's dtype is ``engine.dtype`` already.
    """
    from draftflow.engine import engine_env, on_cpu_build, start_engine

    kwargs = regenerate_engine_kwargs(
        model_dir, engine, seed=seed, trust_remote_code=trust_remote_code
    )
    # corpus.regenerate has no model runner or determinism keys: vLLM's own choices.
    env = engine_env(
        reserved_cpus=engine.reserved_cpus,
        model_runner="default",
        kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        tensor_parallel_size=engine.tensor_parallel_size,
        cpu=on_cpu_build(),
        deterministic=False,
    )
    return start_engine(kwargs, env)


# ------------------------------------------------------------------ planning
def planned_messages(messages: Sequence[Message], max_turns: int | None) -> list[Message]:
    """The original up to its last assistant turn to regenerate (at most ``max_turns`` of them).

    User turns and tool results after the last regenerated answer are dropped: nothing would
    answer them. Messages keep all their fields (tool calls, tool_call_id, ...).
    """
    planned: list[Message] = []
    answered = 0
    last_answer_end = 0
    for message in messages:
        if max_turns is not None and answered >= max_turns:
            break
        planned.append(dict(message))  # type: ignore[arg-type]
        if message["role"] == "assistant":
            answered += 1
            last_answer_end = len(planned)
    return planned[:last_answer_end]


def request_seed(seed: int, conversation_id: str, turn: int) -> int:
    """Per-request sampling seed: the same answer whether or not the run was resumed."""
    digest = hashlib.sha256(f"{seed}:{conversation_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class _Dialogue:
    """One conversation being regenerated: the original plan and the history written so far."""

    conversation: Conversation
    plan: list[Message]
    history: list[Message] = field(default_factory=list)  # regenerated messages so far
    cursor: int = 0  # index into plan of the first message not yet in history
    answer_at: int = -1  # index into plan of the assistant turn being answered now
    answers: int = 0
    outcome: str | None = None
    generated_tokens: int = 0
    tool_calls: int = 0  # tool calls the target wrote
    unparsed_tool_calls: int = 0  # turns whose tool-call text could not be read
    diverged: bool = False  # the target's tool calls left the recorded ones
    reasoning_turns: int = 0

    def next_prompt(self) -> list[Message] | None:
        """History plus the original turns up to the next assistant turn; None when done."""
        if self.outcome is not None:
            return None
        for index in range(self.cursor, len(self.plan)):
            if self.plan[index]["role"] == "assistant":
                self.answer_at = index
                return [*self.history, *self.plan[self.cursor : index]]
        self.outcome = REGENERATED if self.answers else NO_ASSISTANT_TURN
        return None

    def accept(self, prompt: list[Message], answer: ParsedAnswer) -> None:
        """Add the target's turn; end the conversation if the recorded results no longer fit."""
        original = self.plan[self.answer_at]
        recorded = original.get("tool_calls") or []
        message: Message = {"role": "assistant", "content": answer.content}
        if answer.reasoning is not None:
            message["reasoning_content"] = answer.reasoning
            self.reasoning_turns += 1
        calls = answer.tool_calls
        after = self.answer_at + 1
        result_follows = after < len(self.plan) and self.plan[after]["role"] == "tool"
        # A recorded result after a text answer answers a call written as text (ToolACE's
        # Python-style calls): a text answer of the target cannot be checked against it.
        follows_record = same_calls(calls, recorded) and (bool(calls) or not result_follows)
        if calls:
            if follows_record:  # the recorded results answer these calls: keep their ids
                calls = [
                    {**call, "id": old["id"]} if "id" in old else call
                    for call, old in zip(calls, recorded, strict=True)
                ]
            message["tool_calls"] = calls
            self.tool_calls += len(calls)
        self.unparsed_tool_calls += int(answer.unparsed)
        self.history = [*prompt, message]
        self.cursor = self.answer_at + 1
        self.answers += 1
        later_turns = any(m["role"] == "assistant" for m in self.plan[self.cursor :])
        if not follows_record and later_turns:
            # The next recorded messages answer calls the target did not make (or miss the
            # results of calls it did make): continuing would invent what the tools said.
            self.diverged = True
            self.outcome = SHORTENED

    def stop(self, reason_first_turn: str) -> None:
        """No further answer: drop the conversation if it has none yet, else keep what exists."""
        self.outcome = reason_first_turn if self.answers == 0 else SHORTENED

    def result(self) -> dict[str, Any]:
        kept = self.outcome in KEPT_OUTCOMES
        conversation: dict[str, Any] = {
            "id": self.conversation["id"],
            "source": self.conversation["source"],
            "messages": self.history,
        }
        if self.conversation.get("tools"):
            conversation["tools"] = self.conversation["tools"]
        return {
            "id": self.conversation["id"],
            "outcome": self.outcome,
            "answers": self.answers,
            "generated_tokens": self.generated_tokens,
            "tool_calls": self.tool_calls,
            "unparsed_tool_calls": self.unparsed_tool_calls,
            "tool_calls_diverged": int(self.diverged),
            "reasoning_turns": self.reasoning_turns,
            "conversation": conversation if kept else None,
        }


def read_answer(text: str, parser: str) -> ParsedAnswer:
    """The target's generated text as reasoning, text and tool calls."""
    reasoning, rest = split_reasoning(text, generated=True)
    parsed = parse_tool_calls(rest, parser)
    parsed.reasoning = reasoning
    return parsed


def answer_parser(settings: RegenerateSettings, tokenizer: Any) -> str:
    if settings.tool_call_parser != "auto":
        return settings.tool_call_parser
    return detect_parser(getattr(tokenizer, "chat_template", None) or "")


_ARGUMENTS_AS: dict[tuple[str, str], str] = {}


def template_arguments_as(tokenizer: Any, template_kwargs: dict[str, Any]) -> str:
    """The tool-call argument encoding the chat template renders, probed once per template."""
    key = (getattr(tokenizer, "chat_template", None) or "", repr(sorted(template_kwargs.items())))
    if key not in _ARGUMENTS_AS:
        _ARGUMENTS_AS[key] = arguments_encoding(
            lambda probe: tokenizer.apply_chat_template(probe, tokenize=False, **template_kwargs)
        )
    return _ARGUMENTS_AS[key]


def regenerate_batch(
    conversations: Sequence[Conversation],
    llm: Any,
    settings: RegenerateSettings,
    max_model_len: int,
) -> list[dict[str, Any]]:
    """Regenerate one batch turn by turn; return one progress entry per conversation."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = llm.get_tokenizer()
    parser = answer_parser(settings, tokenizer)
    arguments_as = template_arguments_as(tokenizer, settings.template_kwargs())
    dialogues = [
        _Dialogue(conversation, planned_messages(conversation["messages"], settings.max_turns))
        for conversation in conversations
    ]
    while True:
        requests: list[tuple[_Dialogue, list[Message], list[int]]] = []
        for dialogue in dialogues:
            prompt = dialogue.next_prompt()
            if prompt is None:
                continue
            tools = dialogue.conversation.get("tools") or None
            text = tokenizer.apply_chat_template(
                [template_message(m, arguments_as) for m in prompt],
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **settings.template_kwargs(),
            )
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            if len(token_ids) >= max_model_len:  # not even one token of answer would fit
                dialogue.stop(PROMPT_TOO_LONG)
                continue
            requests.append((dialogue, prompt, token_ids))
        if not requests:
            break
        sampling = [
            SamplingParams(
                temperature=settings.temperature,
                top_p=settings.top_p,
                max_tokens=min(settings.max_tokens, max_model_len - len(token_ids)),
                seed=request_seed(settings.seed, dialogue.conversation["id"], dialogue.answers),
            )
            for dialogue, _, token_ids in requests
        ]
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=token_ids) for _, _, token_ids in requests],
            sampling_params=sampling,
            use_tqdm=False,
        )
        for (dialogue, prompt, _), output in zip(requests, outputs, strict=True):
            completion = output.outputs[0]
            dialogue.generated_tokens += len(completion.token_ids)
            answer = read_answer(completion.text, parser)
            if not (answer.content.strip() or answer.tool_calls):
                dialogue.stop(EMPTY_ANSWER)
                continue
            dialogue.accept(prompt, answer)
    return [dialogue.result() for dialogue in dialogues]


# ------------------------------------------------------------------ resume
def fingerprint(
    input_path: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    settings: RegenerateSettings,
    max_model_len: int,
) -> str:
    """What a progress file's entries depend on: input, model, settings and context length."""
    model_dir = Path(model_dir)
    model_files = {
        name: sha256_file(model_dir / name)
        for name in ("config.json", "draftflow_target.json", "tokenizer_config.json")
        if (model_dir / name).exists()
    }
    identity = {
        "input": sha256_file(input_path),
        "model": model_files,
        "settings": {k: v for k, v in asdict(settings).items() if k not in ENGINE_SETTINGS},
        "max_model_len": max_model_len,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def load_progress(path: str | os.PathLike[str], expected_fingerprint: str) -> dict[str, dict]:
    """Entries of a previous run with the same fingerprint, by conversation id.

    A torn last line (crash in mid-write) is ignored and cut off; a file from other inputs or
    settings is removed.
    """
    path = Path(path)
    if not path.exists():
        return {}
    entries: dict[str, dict] = {}
    good_bytes = 0
    with open(path, "rb") as handle:
        header_line = handle.readline()
        try:
            header = json.loads(header_line)
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("fingerprint") != expected_fingerprint:
            log.warning(
                "regenerate: %s was written for other inputs or settings; starting over", path
            )
            path.unlink()
            return {}
        good_bytes = len(header_line)
        for line in handle:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break
            if not line.endswith(b"\n"):
                break
            entries[entry["id"]] = entry
            good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        log.warning("regenerate: cutting a torn last line off %s", path)
        os.truncate(path, good_bytes)
    return entries


def _append_entries(handle: Any, entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())  # the batch survives a crash (or a killed job) from here on


def _batches(items: Sequence[Conversation], size: int) -> Iterator[Sequence[Conversation]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# ------------------------------------------------------------------ stage
def read_conversations(path: str | os.PathLike[str]) -> list[Conversation]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def regenerate(
    conversations: Sequence[Conversation],
    llm: Any,
    settings: RegenerateSettings,
    *,
    output: str | os.PathLike[str],
    summary: str | os.PathLike[str],
    progress: str | os.PathLike[str],
    run_fingerprint: str,
    max_model_len: int,
    after_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Regenerate every conversation, resuming from ``progress``; write output and summary.

    ``max_model_len``: the engine's context (``engine_settings(config, "regenerate")``), which
    bounds every prompt plus its answer. ``after_batch(n)`` is called after the n-th batch of this run is durable (tests use it to
    stop a run the way a crash would).
    """
    if settings.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {settings.batch_size}")
    ids = [conversation["id"] for conversation in conversations]
    if len(set(ids)) != len(ids):
        raise ValueError("conversation ids must be unique (run ingest first)")
    progress = Path(progress)
    progress.parent.mkdir(parents=True, exist_ok=True)

    done = load_progress(progress, run_fingerprint)
    wanted = set(ids)
    resumed = sum(1 for conversation_id in done if conversation_id in wanted)
    todo = [conversation for conversation in conversations if conversation["id"] not in done]
    log.info(
        "regenerate: %d conversations, %d already done (resumed), %d to do, batch %d",
        len(conversations),
        resumed,
        len(todo),
        settings.batch_size,
    )

    with open(progress, "a", encoding="utf-8") as handle:
        if handle.tell() == 0:
            header = {"format": PROGRESS_FORMAT, "fingerprint": run_fingerprint}
            _append_entries(handle, [header])
        with tqdm(total=len(todo), desc="regenerate", unit="conv", mininterval=5) as bar:
            for number, batch in enumerate(_batches(todo, settings.batch_size), start=1):
                entries = regenerate_batch(batch, llm, settings, max_model_len)
                _append_entries(handle, entries)
                done.update((entry["id"], entry) for entry in entries)
                bar.update(len(batch))
                if after_batch is not None:
                    after_batch(number)

    result = _write_outputs(conversations, done, output, settings, max_model_len)
    result["resumed"] = resumed
    atomic_write_json(summary, result)
    progress.unlink()  # the output now holds everything; a rerun starts fresh
    return result


def _write_outputs(
    conversations: Sequence[Conversation],
    done: dict[str, dict],
    output: str | os.PathLike[str],
    settings: RegenerateSettings,
    max_model_len: int,
) -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    answers = generated_tokens = 0
    tool_stats: Counter[str] = Counter()
    with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for conversation in conversations:  # input order: ingest's sorted order
            entry = done[conversation["id"]]
            outcomes[entry["outcome"]] += 1
            answers += entry["answers"]
            generated_tokens += entry["generated_tokens"]
            for key in TOOL_STATS:
                tool_stats[key] += entry.get(key, 0)
            if entry["outcome"] in KEPT_OUTCOMES:
                handle.write(json.dumps(entry["conversation"], ensure_ascii=False) + "\n")
    kept = sum(outcomes[outcome] for outcome in KEPT_OUTCOMES)
    result = {
        "conversations_in": len(conversations),
        "kept": kept,
        "dropped": {outcome: outcomes[outcome] for outcome in DROP_OUTCOMES},
        "outcomes": {outcome: outcomes[outcome] for outcome in OUTCOMES},
        "answers_generated": answers,
        "generated_tokens": generated_tokens,
        **{key: tool_stats[key] for key in TOOL_STATS},
        "max_model_len": max_model_len,
        "settings": asdict(settings),
    }
    log.info("regenerate: kept %d of %d; outcomes %s", kept, len(conversations), dict(outcomes))
    return result
