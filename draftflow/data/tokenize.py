"""Conversations JSONL -> token samples with loss masks, train token frequencies, a summary."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from draftflow.data.masks import ChatTemplateMasker, Message
from draftflow.data.samples import sample_writer, samples_table
from draftflow.data.split import SplitSettings
from draftflow.io import atomic_path, atomic_write_json

log = logging.getLogger(__name__)

LONG_SAMPLE_POLICIES = ("truncate", "drop")
ROW_GROUP_SIZE = 1024
# Conversations the template failed on, listed by id and error in the summary (all are counted).
TEMPLATE_ERRORS_LISTED = 50


@dataclass(frozen=True)
class TokenizeSettings:
    max_length: int
    long_samples: str
    max_turns: int | None
    # token_freq counts the train split's tokens only
    split: SplitSettings
    # the template's reasoning switch the answers were generated with (None: not passed)
    enable_thinking: bool | None

    def template_kwargs(self) -> dict[str, bool]:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}

    def __post_init__(self) -> None:
        if self.long_samples not in LONG_SAMPLE_POLICIES:
            raise ValueError(
                f"tokenize.long_samples = {self.long_samples!r}: allowed {list(LONG_SAMPLE_POLICIES)}"
            )
        if self.max_length < 1:
            raise ValueError(f"tokenize.max_length = {self.max_length!r}: must be positive")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"tokenize.max_turns = {self.max_turns!r}: must be >= 1 or null")


def load_target_tokenizer(target_dir: str | os.PathLike[str], trust_remote_code: bool):
    """The target's own tokenizer and chat template, from the local checkpoint only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(target_dir), trust_remote_code=trust_remote_code, local_files_only=True
    )


def target_vocab_size(target_dir: str | os.PathLike[str], tokenizer) -> int:
    """The larger of len(tokenizer) and the model's embedding rows (models often pad the latter)."""
    sizes = [len(tokenizer)]
    config_path = Path(target_dir) / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        for section in (config, config.get("text_config") or {}):
            if isinstance(section.get("vocab_size"), int):
                sizes.append(section["vocab_size"])
    return max(sizes)


def masked_token_counts(
    input_ids: Sequence[int], loss_mask: Sequence[int], vocab_size: int
) -> np.ndarray:
    """How often each token id is masked (trained on) in one sample: int64 [vocab_size], the
    unit of token_freq (the vocab stage's input)."""
    masked_ids = np.asarray(input_ids, dtype=np.int64)[np.asarray(loss_mask, dtype=bool)]
    if masked_ids.size and masked_ids.max() >= vocab_size:
        raise ValueError(
            f"token id {int(masked_ids.max())} is outside the target vocabulary of {vocab_size}"
        )
    return np.bincount(masked_ids, minlength=vocab_size)


def limit_turns(messages: Sequence[Message], max_turns: int | None) -> list[Message]:
    """Keep messages up to the ``max_turns``-th assistant reply; drop any unanswered tail.

    A trailing user message without a reply costs tokens and teaches the draft nothing.
    """
    kept: list[Message] = []
    answered = 0
    last_assistant = -1
    for message in messages:
        kept.append(message)
        if message["role"] == "assistant":
            answered += 1
            last_assistant = len(kept) - 1
            if max_turns is not None and answered >= max_turns:
                break
    return kept[: last_assistant + 1]


def read_conversations(path: str | os.PathLike[str]) -> Iterator[dict]:
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "id" not in record or "messages" not in record:
                raise ValueError(f"{path}:{line_number}: record lacks 'id' or 'messages'")
            yield record


def _count_lines(path: str | os.PathLike[str]) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def tokenize_corpus(
    corpus_path: str | os.PathLike[str],
    target_dir: str | os.PathLike[str],
    samples_path: str | os.PathLike[str],
    token_freq_path: str | os.PathLike[str],
    summary_path: str | os.PathLike[str],
    settings: TokenizeSettings,
    *,
    trust_remote_code: bool,
) -> dict:
    """Tokenize every conversation; write samples, train token counts and a summary
    (``trust_remote_code``: target.trust_remote_code)."""
    tokenizer = load_target_tokenizer(target_dir, trust_remote_code)
    masker = ChatTemplateMasker(tokenizer, settings.template_kwargs())
    vocab_size = target_vocab_size(target_dir, tokenizer)
    token_freq = np.zeros(vocab_size, dtype=np.int64)
    counts: Counter[str] = Counter()
    template_errors: list[dict[str, str]] = []
    pending: tuple[list, list, list] = ([], [], [])

    def flush(writer) -> None:
        if pending[0]:
            writer.write_table(samples_table(*pending), row_group_size=ROW_GROUP_SIZE)
            for column in pending:
                column.clear()

    total = _count_lines(corpus_path)
    with sample_writer(samples_path) as writer:
        for record in tqdm(
            read_conversations(corpus_path), total=total, desc="tokenize", mininterval=5
        ):
            counts["conversations"] += 1
            messages = limit_turns(record["messages"], settings.max_turns)
            if not any(m["role"] == "assistant" for m in messages):
                counts["skipped_no_assistant"] += 1
                continue
            try:
                encoded = masker.encode(
                    messages, max_tokens=settings.max_length, tools=record.get("tools")
                )
            except Exception as error:
                # A template may refuse a role order (raise_exception), or fail on a value it
                # did not expect (TypeError, ...): skip the conversation, name it, go on.
                counts["skipped_template_error"] += 1
                reason = f"{type(error).__name__}: {error}"
                if len(template_errors) < TEMPLATE_ERRORS_LISTED:
                    template_errors.append({"id": record["id"], "error": reason[:300]})
                log.warning("skipping %s: the chat template failed: %s", record["id"], reason)
                continue
            if encoded.unrendered_tool_calls:
                # The template drops the calls: the turn's mask would teach an empty answer.
                counts["skipped_tool_calls_not_rendered"] += 1
                continue
            if encoded.unrendered_think_answers:
                # The template cuts an answer at its own "</think>" text: its beginning would
                # be lost from the trained text, silently.
                counts["skipped_answer_cut_at_think_tag"] += 1
                continue
            # Turns whose text the template leaves out (Llama 3.1 writes only the call of a
            # turn that also has text): trained as the template renders them, counted.
            counts["answer_text_not_rendered_turns"] += encoded.unrendered_answers
            counts["reasoning_not_rendered_turns"] += encoded.unrendered_reasoning
            if encoded.truncated:
                if settings.long_samples == "drop":
                    counts["dropped_long"] += 1
                    continue
                counts["truncated"] += 1
            input_ids, loss_mask = encoded.input_ids, encoded.loss_mask
            if not any(loss_mask):
                counts["skipped_no_masked_tokens"] += 1
                continue
            counts["samples"] += 1
            counts["tool_call_turns"] += sum(1 for m in messages if m.get("tool_calls"))
            counts["tokens"] += len(input_ids)
            counts["masked_tokens"] += sum(loss_mask)
            if settings.split.assign(record["id"]) == "train":
                try:
                    token_freq += masked_token_counts(input_ids, loss_mask, vocab_size)
                except ValueError as error:
                    raise ValueError(f"{record['id']}: {error}") from None
            pending[0].append(record["id"])
            pending[1].append(input_ids)
            pending[2].append(loss_mask)
            if len(pending[0]) >= ROW_GROUP_SIZE:
                flush(writer)
        flush(writer)

    if counts["skipped_tool_calls_not_rendered"]:
        log.warning(
            "%d conversations skipped: the target's chat template does not render their tool "
            "calls (give target.chat_template a template that does)",
            counts["skipped_tool_calls_not_rendered"],
        )
    if counts["skipped_answer_cut_at_think_tag"]:
        log.warning(
            "%d conversations skipped: the target's chat template cuts an answer at the "
            "</think> it quotes, so its beginning would be lost",
            counts["skipped_answer_cut_at_think_tag"],
        )
    if counts["samples"] == 0:
        raise ValueError(
            f"{corpus_path}: no conversation produced a sample with assistant tokens "
            f"({dict(counts)}); check the corpus and tokenize settings"
        )
    with atomic_path(token_freq_path) as tmp:
        save_file({"token_freq": token_freq}, str(tmp))

    summary = {
        "settings": asdict(settings),
        "target": str(target_dir),
        "vocab_size": vocab_size,
        "train_masked_tokens": int(token_freq.sum()),
        **{
            key: counts[key]
            for key in (
                "conversations",
                "samples",
                "tokens",
                "masked_tokens",
                "truncated",
                "dropped_long",
                "skipped_no_assistant",
                "skipped_no_masked_tokens",
                "skipped_template_error",
                "skipped_tool_calls_not_rendered",
                "skipped_answer_cut_at_think_tag",
                "answer_text_not_rendered_turns",
                "reasoning_not_rendered_turns",
                "tool_call_turns",
            )
        },
        "tool_call_arguments_as": masker.arguments_as,
        "template_errors": template_errors,
    }
    atomic_write_json(summary_path, summary)
    log.info("tokenize summary: %s", summary)
    return summary
