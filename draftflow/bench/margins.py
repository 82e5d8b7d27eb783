"""Near-ties: the plain target's own margin where a greedy speculative output departs from it.

The verify pass (k + 1 tokens at once) rounds differently from a plain decode step. In bf16, and
on GPUs in float32 too (their kernels do not keep float32's last bits), greedy decoding then
flips where the target's two best tokens are nearly tied: numerics, not a wrong verification. A
verification defect picks a token the target ranks far below its best.

After the timed rounds, the plain target measures every first difference once more
(``measure``, run in a plain engine's process): the conversation as the bench gave it (the
target's chat template, the plain engine's earlier answers, the generation prompt), then the
plain engine's tokens up to the difference, one step with the top ``TOP_LOGPROBS`` log-probs.
The gap between the plain engine's token and the speculative engine's token there, in logits
(log-probs differ by the same), says which it is; ``bench.tie_margin`` draws the line.
"""

from __future__ import annotations

from typing import Any

from draftflow.bench.lossless import first_difference

# Log-probs asked for at a difference: a speculative token outside them is far from a tie.
TOP_LOGPROBS = 20
KEY_FIELDS = ("dataset", "id", "turn", "position", "plain_token", "speculative_token")


def difference_key(item: dict[str, Any]) -> tuple:
    return tuple(item[field] for field in KEY_FIELDS)


def tokens_at(
    want: list[list[int]], got: list[list[int]], turn: int, position: int
) -> tuple[int, int] | None:
    """The plain and the speculative token where two outputs first differ, or None where one
    output only stops earlier (no token of its own there to measure)."""
    if turn >= min(len(want), len(got)) or position >= min(len(want[turn]), len(got[turn])):
        return None
    return want[turn][position], got[turn][position]


def find_differences(runs_by_k: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every distinct token difference of a speculative run from the plain target's first run
    of its prompt set (a request whose output only stops earlier has none to measure), with
    what the plain engine needs to rebuild that position: its earlier answers, its tokens up to
    the difference and the prompt's length as it saw it."""
    plain = {run["dataset"]: run for run in runs_by_k.get(0, []) if run["run"] == 0}
    found: dict[tuple, dict[str, Any]] = {}
    for k, runs in sorted(runs_by_k.items()):
        if k == 0:
            continue
        for run in runs:
            reference = plain[run["dataset"]]["responses"]
            for request_id, turns in sorted(run["responses"].items()):
                want = [response["token_ids"] for response in reference[request_id]]
                got = [response["token_ids"] for response in turns]
                where = first_difference(want, got)
                if where is None:
                    continue
                turn, position = where
                tokens = tokens_at(want, got, turn, position)
                if tokens is None:
                    continue
                item = {
                    "dataset": run["dataset"],
                    "id": request_id,
                    "turn": turn,
                    "position": position,
                    "plain_token": tokens[0],
                    "speculative_token": tokens[1],
                    "answers": [response["text"] for response in reference[request_id][:turn]],
                    "prefix": want[turn][:position],
                    "prompt_tokens": reference[request_id][turn]["prompt_tokens"],
                }
                found.setdefault(difference_key(item), item)
    return list(found.values())


def measure(llm: Any, prompt: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
    """One difference measured by the plain target in ``llm`` (a vLLM engine)."""
    from vllm import SamplingParams

    messages = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    for turn, answer in enumerate(item["answers"]):
        messages += [
            {"role": "user", "content": prompt["turns"][turn]},
            {"role": "assistant", "content": answer},
        ]
    messages.append({"role": "user", "content": prompt["turns"][item["turn"]]})
    context = list(
        llm.get_tokenizer().apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP_LOGPROBS)
    output = llm.generate(
        [{"prompt_token_ids": context + list(item["prefix"])}], params, use_tqdm=False
    )[0]
    logprobs = {int(token): entry.logprob for token, entry in output.outputs[0].logprobs[0].items()}
    plain, speculative = item["plain_token"], item["speculative_token"]
    measured = {field: item[field] for field in KEY_FIELDS}
    measured["context_matches"] = len(context) == int(item["prompt_tokens"])
    measured["best_token"] = max(logprobs, key=logprobs.get)
    if plain in logprobs and speculative in logprobs:
        measured["logit_gap"] = logprobs[plain] - logprobs[speculative]
    else:
        # One of them is outside the top log-probs: the gap is at least the top's spread.
        measured["logit_gap"] = None
        measured["logit_gap_at_least"] = max(logprobs.values()) - min(logprobs.values())
    return measured


def is_near_tie(margin: dict[str, Any] | None, tie_margin: float) -> bool:
    """A difference is a near-tie where the plain target rebuilt the same context and put its
    two tokens within ``tie_margin`` logits of each other."""
    return (
        margin is not None
        and margin["context_matches"]
        and margin["logit_gap"] is not None
        and abs(margin["logit_gap"]) <= tie_margin
    )


def count_near_ties(
    dataset: str,
    differences: list[Any],
    reference: dict[str, list[list[int]]],
    candidate: dict[str, list[list[int]]],
    margins: list[dict[str, Any]],
    tie_margin: float,
) -> int:
    """How many of a run's differences (``draftflow.bench.lossless.Difference``) are measured
    near-ties."""
    by_key = {difference_key(margin): margin for margin in margins}
    count = 0
    for difference in differences:
        turn, position = difference.turn, difference.position
        tokens = tokens_at(
            reference[difference.request_id], candidate[difference.request_id], turn, position
        )
        if tokens is None:
            continue  # nothing was measured
        key = (dataset, difference.request_id, turn, position, *tokens)
        count += is_near_tie(by_key.get(key), tie_margin)
    return count


def verdict(differ: int, near_ties: int) -> str:
    """The lossless check's word for a run."""
    if differ == 0:
        return "identical"
    return "near-ties only" if near_ties == differ else "differs"
