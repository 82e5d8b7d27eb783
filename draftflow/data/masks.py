"""Loss masks from any chat template: 1 on assistant-written tokens and their end-of-turn marker.

The template is treated as a black box. For each assistant message we render the conversation
up to that message with and without it; the difference is the assistant's turn (content plus
end-of-turn marker, e.g. ``<|im_end|>`` or ``<|eot_id|>``). Character spans are then mapped to
tokens through the fast tokenizer's offsets. Role headers, system prompts a template adds by
itself and whitespace after the end-of-turn marker stay unmasked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, str]


class ChatTemplateError(ValueError):
    """The template's rendering does not contain a message where it should."""


# Tokens beyond a cut that must exist before the tokens up to a limit are trusted: only the last
# pre-tokenizer word before a cut can tokenize differently from the whole text.
CUT_MARGIN_TOKENS = 32
# First guess of characters per token when cutting long texts (English BPE averages about 4).
CUT_CHARS_PER_TOKEN = 8


@dataclass(frozen=True)
class MaskedTokens:
    input_ids: list[int]
    loss_mask: list[int]
    # True when the conversation had more tokens than the limit and was cut to it
    truncated: bool = False


class ChatTemplateMasker:
    """Renders conversations with a tokenizer's chat template and marks assistant tokens."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat_template; the target "
                "checkpoint must ship one (tokenizer_config.json or chat_template.jinja)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer; loss masks "
                "need character offsets (return_offsets_mapping), which only fast ones give"
            )
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def assistant_spans(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
        """Return the rendered text and the character span of every assistant turn in it."""
        full = self.render(messages)
        spans: list[tuple[int, int]] = []
        cursor = 0
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            span = self._span_by_prefix(messages, index, full)
            if span is None:
                span = self._span_by_search(messages, index, full, cursor)
            spans.append(span)
            cursor = span[1]
        return full, spans

    def _end_of_turn(self, messages: Sequence[Message], index: int) -> str:
        """The marker the template writes after this assistant message (``<|im_end|>``, ...)."""
        upto = self.render(messages[: index + 1])
        # The turn sits at the end of `upto`; search backwards so a header never matches.
        _, end = locate_content(upto, messages[index]["content"], len(upto), backwards=True)
        # Trailing whitespace after the marker (ChatML's "\n") is scaffolding, not model output.
        return upto[end:].rstrip()

    def _span_by_prefix(
        self, messages: Sequence[Message], index: int, full: str
    ) -> tuple[int, int] | None:
        """Exact span when rendering is prefix-stable (ChatML, Llama-3, Gemma, Mistral, ...)."""
        if index == 0:
            return None
        before = self.render(messages[:index], add_generation_prompt=True)
        upto = self.render(messages[: index + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            return None
        try:
            start, end = locate_content(upto, messages[index]["content"], len(before))
        except ChatTemplateError:
            return None
        end_of_turn = upto[end:].rstrip()
        return start, end + len(end_of_turn)

    def _span_by_search(
        self, messages: Sequence[Message], index: int, full: str, cursor: int
    ) -> tuple[int, int]:
        """Fallback for templates whose last turn renders differently (e.g. Qwen3's think block).

        Find the assistant header (what the generation prompt adds) after the previous turn,
        then the content after it, then this turn's end-of-turn marker.
        """
        header = ""
        if index:  # transformers refuses to render an empty conversation
            previous = self.render(messages[:index])
            header = self.render(messages[:index], add_generation_prompt=True)[len(previous) :]
        header_at = full.find(header, cursor) if header else -1
        search_from = cursor if header_at == -1 else header_at + len(header)
        start, end = locate_content(full, messages[index]["content"], search_from)
        end_of_turn = self._end_of_turn(messages, index)
        if end_of_turn and full.startswith(end_of_turn, end):
            end += len(end_of_turn)
        return start, end

    def encode(self, messages: Sequence[Message], max_tokens: int | None = None) -> MaskedTokens:
        """Tokenize the rendered conversation; mask the tokens that overlap assistant spans.

        With ``max_tokens`` the result is cut to that many tokens (``truncated`` says whether it
        was). Long conversations are then tokenized only as far as needed: a prefix of the text,
        doubled until it yields ``max_tokens`` plus a margin, gives the same first tokens.
        """
        full, spans = self.assistant_spans(messages)
        if max_tokens is not None:
            cut = max_tokens * CUT_CHARS_PER_TOKEN
            while cut < len(full):
                encoding = self._tokenize(full[:cut])
                if len(encoding["input_ids"]) > max_tokens + CUT_MARGIN_TOKENS:
                    break
                cut *= 2
            else:
                encoding = self._tokenize(full)
        else:
            encoding = self._tokenize(full)
        input_ids = list(encoding["input_ids"])
        loss_mask = mask_from_spans(encoding["offset_mapping"], spans)
        truncated = max_tokens is not None and len(input_ids) > max_tokens
        if truncated:
            input_ids, loss_mask = input_ids[:max_tokens], loss_mask[:max_tokens]
        return MaskedTokens(input_ids=input_ids, loss_mask=loss_mask, truncated=truncated)

    def _tokenize(self, text: str) -> Any:
        # add_special_tokens=False: the template writes BOS itself, as apply_chat_template does.
        return self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)


def mask_from_spans(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """1 for each token whose characters overlap a span.

    A token that straddles a span boundary (BPE may merge a header's newline into the first
    word) is kept: the draft has to predict it. Zero-width tokens count by their position.
    """
    mask = [0] * len(offsets)
    spans = sorted(spans)
    current = 0  # tokens and spans both advance left to right: one pass over each
    for token, (start, end) in enumerate(offsets):
        while current < len(spans) and spans[current][1] <= start:
            current += 1
        if current == len(spans):
            break
        span_start, span_end = spans[current]
        if end > start:
            inside = start < span_end and end > span_start
        else:
            inside = span_start <= start < span_end
        mask[token] = int(inside)
    return mask


def locate_content(
    text: str, content: str, position: int, backwards: bool = False
) -> tuple[int, int]:
    """Character span of a message's content in rendered text, searched from ``position``.

    Templates either copy the content verbatim (ChatML) or trim it (Llama-3), so try both.
    """
    for candidate in dict.fromkeys((content, content.strip())):
        start = text.rfind(candidate, 0, position) if backwards else text.find(candidate, position)
        if start != -1:
            return start, start + len(candidate)
    raise ChatTemplateError(
        f"message content not found in the rendered conversation (the chat template "
        f"rewrites it): {content[:80]!r}"
    )
