"""Loss masks from any chat template: 1 on what the target writes in its turns.

The target writes its assistant turns: their text, their tool calls, their reasoning where the
template renders it, and the end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``, ...). Role
headers, system and user text, tool results and whitespace after the end-of-turn marker stay
unmasked.

The template is treated as a black box. For each assistant message the conversation is rendered
again with that message replaced by a *sentinel* (an assistant message holding only a marker
string): what the two renderings share before and after the turn is template scaffolding, what
differs is the message as the template renders it (a tool call's fixed syntax included, since
it differs from the sentinel's). The span starts where the assistant header (the generation
prompt) ends and runs to the end-of-turn marker. A think block the template writes for every
turn, reasoning or not (Qwen3's empty ``<think>\n\n</think>``), is shared with the sentinel and
left unmasked; a think block holding the message's reasoning is masked. Templates that refuse
the sentinel fall back to rendering prefixes of the conversation (prefix-stable templates:
ChatML, Llama 3, Gemma, ...). Character spans are then mapped to tokens through the fast
tokenizer's offsets.

What a template leaves out is found by rendering, not by searching names: a tool call is
unrendered when removing it leaves the rendering unchanged, and an answer is unrendered when its
text is not in its span (a template that splits answers at ``</think>``, one that writes only the
call of a turn that also has text). Tool-call arguments go to the template as objects or as JSON
strings, whichever it renders (``toolcalls.arguments_encoding``, probed once per template).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from draftflow.corpus.toolcalls import arguments_encoding, template_message

Message = dict[str, Any]

# A message body no real conversation holds; its first and last characters are rare, so the
# renderings with and without it share no characters by accident at the turn's edges.
SENTINEL = "\u27e6draftflow-sentinel\u27e7"


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
    # assistant turns whose tool calls the template does not render (their mask lacks them)
    unrendered_tool_calls: int = 0
    # assistant turns whose text is not in their span (the template dropped or cut it), and
    # those of them whose text holds ``</think>`` (a template splitting answers at that tag)
    unrendered_answers: int = 0
    unrendered_think_answers: int = 0
    # assistant turns whose reasoning the template does not render (Qwen3 drops it before the
    # last user turn, DeepSeek-V3 always): not trained, counted
    unrendered_reasoning: int = 0


class ChatTemplateMasker:
    """Renders conversations with a tokenizer's chat template and marks the target's tokens.

    ``template_kwargs`` go to every rendering (e.g. ``enable_thinking``: the generation prompt,
    and so where a turn starts, follows the switch the answers were generated with).
    """

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> None:
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
        self.template_kwargs = dict(template_kwargs or {})
        # "object" or "string": what this template renders tool-call arguments from
        self.arguments_as = arguments_encoding(
            lambda probe: tokenizer.apply_chat_template(
                probe, tokenize=False, **self.template_kwargs
            )
        )

    def template_messages(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        return [template_message(m, self.arguments_as) for m in messages]

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            self.template_messages(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def assistant_spans(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """Return the rendered text and the character span of every assistant turn in it."""
        full = self.render(messages, tools=tools)
        spans: list[tuple[int, int]] = []
        cursor = 0
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:
                span = self._span_by_sentinel(messages, index, full, cursor, tools)
            except Exception:
                span = None  # the template refuses the sentinel turn: try prefixes
            by_prefix = self._span_by_prefix(messages, index, full, tools)
            if span is None:
                span = by_prefix
            elif by_prefix is not None:
                # Both over-reach in their own way: the prefix span takes a think block the
                # template writes for the last turn only; the sentinel span takes what follows
                # the turn when the template carries state across turns (DeepSeek-V3's call
                # turns render differently after the sentinel). The turn is what both hold.
                overlap = (max(span[0], by_prefix[0]), min(span[1], by_prefix[1]))
                span = overlap if overlap[0] < overlap[1] else span
            if span is None or span[0] < cursor:
                raise ChatTemplateError(
                    f"assistant message {index} not found in the rendered conversation: "
                    f"{str(message.get('content'))[:80]!r}"
                )
            spans.append(span)
            cursor = span[1]
        return full, spans

    def unrendered_tool_calls(
        self,
        full: str,
        messages: Sequence[Message],
        spans: Sequence[tuple[int, int]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> int:
        """Assistant turns with a tool call the template does not render.

        A call is rendered when the conversation rendered without it differs from ``full``. A
        template that refuses the conversation without it (a turn left empty) is judged by its
        span: the call's name and each of its argument values must be in it.
        """
        turns = [(i, m) for i, m in enumerate(messages) if m["role"] == "assistant"]
        unrendered = 0
        for (index, message), (start, end) in zip(turns, spans, strict=True):
            calls = message.get("tool_calls") or []
            for n, call in enumerate(calls):
                without = {**message, "tool_calls": [*calls[:n], *calls[n + 1 :]]}
                try:
                    missing = (
                        self.render(
                            [*messages[:index], without, *messages[index + 1 :]], tools=tools
                        )
                        == full
                    )
                except Exception:  # the template refuses the turn without it: read the span
                    missing = not _call_in_text(call, full[start:end])
                if missing:
                    unrendered += 1
                    break
        return unrendered

    def unrendered_reasoning(
        self, full: str, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None
    ) -> int:
        """Assistant turns with reasoning that renders the same without it."""
        unrendered = 0
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or not message.get("reasoning_content"):
                continue
            without = {k: v for k, v in message.items() if k != "reasoning_content"}
            try:
                rendered = self.render(
                    [*messages[:index], without, *messages[index + 1 :]], tools=tools
                )
            except Exception:  # the template refuses the turn without it: it renders it
                continue
            unrendered += rendered == full
        return unrendered

    def unrendered_answers(
        self, full: str, messages: Sequence[Message], spans: Sequence[tuple[int, int]]
    ) -> list[Message]:
        """Assistant messages whose text (stripped: templates trim) is not in their span."""
        turns = [m for m in messages if m["role"] == "assistant"]
        return [
            message
            for message, (start, end) in zip(turns, spans, strict=True)
            if (message.get("content") or "").strip() not in full[start:end]
        ]

    def _span_by_sentinel(
        self,
        messages: Sequence[Message],
        index: int,
        full: str,
        cursor: int,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> tuple[int, int] | None:
        sentinel_turn = {"role": "assistant", "content": SENTINEL}
        replaced = self.render(
            [*messages[:index], sentinel_turn, *messages[index + 1 :]], tools=tools
        )
        at = replaced.find(SENTINEL)
        if at == -1:
            return None
        after = at + len(SENTINEL)
        prefix = _common_prefix(full, replaced, limit=at)
        suffix = _common_suffix(
            full, replaced, limit=min(len(full) - prefix, len(replaced) - after)
        )
        end = len(full) - suffix
        if prefix == at:  # everything before the sentinel is shared: scaffolding, unmasked
            start = prefix
        else:
            # The turn shares only the start of the sentinel's scaffolding (``<think>\n`` of a
            # think block holding reasoning): that is the target's text; start at the header.
            start = self._header_end(messages, index, full, cursor, prefix, tools)
        # The end-of-turn marker: what the template writes after the sentinel as the last turn.
        alone = self.render([*messages[:index], sentinel_turn], tools=tools)
        end_of_turn = alone[alone.rfind(SENTINEL) + len(SENTINEL) :].rstrip()
        if end_of_turn and full.startswith(end_of_turn, end):
            end += len(end_of_turn)
        return start, end

    def _header_end(
        self,
        messages: Sequence[Message],
        index: int,
        full: str,
        cursor: int,
        limit: int,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> int:
        """End of the last assistant header in ``full[cursor:limit]``; ``limit`` if none."""
        if index == 0:  # transformers refuses to render an empty conversation
            return limit
        previous = self.render(messages[:index], tools=tools)
        headers = [self.render(messages[:index], add_generation_prompt=True, tools=tools)]
        headers[0] = headers[0][len(previous) :] if headers[0].startswith(previous) else ""
        # Without the template switches: Qwen3's header loses the think block enable_thinking
        # false adds, which turns that render their reasoning do not have.
        plain = self.tokenizer.apply_chat_template(
            self.template_messages(messages[:index]),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        bare = self.tokenizer.apply_chat_template(
            self.template_messages(messages[:index]),
            tools=list(tools) if tools else None,
            tokenize=False,
        )
        if plain.startswith(bare):
            headers.append(plain[len(bare) :])
        ends = [
            found + len(header)
            for header in headers
            if header and (found := full.rfind(header, cursor, limit)) != -1
        ]
        return max(ends, default=limit)

    def _span_by_prefix(
        self,
        messages: Sequence[Message],
        index: int,
        full: str,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> tuple[int, int] | None:
        """The turn as the difference of two prefix renderings (prefix-stable templates)."""
        if index == 0:
            return None
        before = self.render(messages[:index], add_generation_prompt=True, tools=tools)
        upto = self.render(messages[: index + 1], tools=tools)
        if not (upto.startswith(before) and full.startswith(upto)):
            return None
        # Trailing whitespace after the marker (ChatML's "\n") is scaffolding, not model output.
        return len(before), len(before) + len(upto[len(before) :].rstrip())

    def encode(
        self,
        messages: Sequence[Message],
        max_tokens: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> MaskedTokens:
        """Tokenize the rendered conversation; mask the tokens that overlap assistant spans.

        With ``max_tokens`` the result is cut to that many tokens (``truncated`` says whether it
        was). Long conversations are then tokenized only as far as needed: a prefix of the text,
        doubled until it yields ``max_tokens`` plus a margin, gives the same first tokens.
        """
        full, spans = self.assistant_spans(messages, tools)
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
        unrendered = self.unrendered_answers(full, messages, spans)
        return MaskedTokens(
            input_ids=input_ids,
            loss_mask=loss_mask,
            truncated=truncated,
            unrendered_tool_calls=self.unrendered_tool_calls(full, messages, spans, tools),
            unrendered_answers=len(unrendered),
            unrendered_think_answers=sum(1 for m in unrendered if "</think>" in m["content"]),
            unrendered_reasoning=self.unrendered_reasoning(full, messages, tools),
        )

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


def _call_in_text(call: Mapping[str, Any], text: str) -> bool:
    """The call's name and every argument value (as text) appear in ``text``."""
    function = call["function"]
    arguments = function.get("arguments")
    values = arguments.values() if isinstance(arguments, dict) else ()
    return function["name"] in text and all(
        (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)) in text for v in values
    )


def _common_prefix(first: str, second: str, limit: int) -> int:
    """Length of the common prefix of two strings, at most ``limit``."""
    n = 0
    limit = min(limit, len(first), len(second))
    while n < limit and first[n] == second[n]:
        n += 1
    return n


def _common_suffix(first: str, second: str, limit: int) -> int:
    """Length of the common suffix of two strings, at most ``limit``."""
    n = 0
    limit = min(limit, len(first), len(second))
    while n < limit and first[-1 - n] == second[-1 - n]:
        n += 1
    return n
