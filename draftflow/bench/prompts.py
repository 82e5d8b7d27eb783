"""Benchmark prompt sets: read MT-bench, HumanEval or a user's chat JSONL into one form.

Normalised record (one JSON object a line in ``results/bench/prompts/{dataset}.jsonl``)::

    {"id": "mtbench-81", "dataset": "mtbench", "system": null, "turns": ["...", "..."]}

``turns`` are the user messages in order; the benchmark lets the target answer each one and
feeds its own answer back before the next turn. A system message, when the source has one,
goes in ``system``. Assistant messages in a source are dropped: the model writes its own.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from draftflow.io import atomic_path
from draftflow.resources import resolve_path

#: Prompt-set kinds ``bench.datasets[].kind`` accepts.
KINDS = ("mtbench", "humaneval", "chat")
#: Subset orders ``bench.datasets[].order`` accepts.
ORDERS = ("file", "hash")

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one "
    "Python code block.\n\n```python\n{prompt}```"
)


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({error.msg})") from error
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(record)}")
            yield record


def _mtbench(records: Iterable[dict[str, Any]], dataset: str) -> Iterator[dict[str, Any]]:
    for record in records:
        yield {
            "id": f"{dataset}-{record['question_id']}",
            "dataset": dataset,
            "category": record.get("category"),
            "system": None,
            "turns": [str(turn) for turn in record["turns"]],
        }


def _humaneval(records: Iterable[dict[str, Any]], dataset: str) -> Iterator[dict[str, Any]]:
    for record in records:
        task = str(record["task_id"]).replace("/", "-")
        yield {
            "id": f"{dataset}-{task}",
            "dataset": dataset,
            "category": "code",
            "system": None,
            "turns": [HUMANEVAL_INSTRUCTION.format(prompt=record["prompt"])],
        }


def _chat(
    records: Iterable[dict[str, Any]], dataset: str, source: Path
) -> Iterator[dict[str, Any]]:
    """``{"id", "turns": [str, ...]}`` or OpenAI ``{"id"?, "messages": [{role, content}]}``."""
    for index, record in enumerate(records):
        record_id = str(record.get("id", index))
        system = None
        if "turns" in record:
            turns = [str(turn) for turn in record["turns"]]
            system = record.get("system")
        elif "messages" in record:
            turns = []
            for message in record["messages"]:
                role = message.get("role")
                if role == "user":
                    turns.append(str(message["content"]))
                elif role == "system" and not turns:
                    system = str(message["content"])
                elif role not in ("assistant", "system"):
                    raise ValueError(
                        f"{source}: record {record_id!r} has message role {role!r}; "
                        "allowed: system, user, assistant"
                    )
        else:
            raise ValueError(
                f"{source}: record {record_id!r} has neither 'turns' nor 'messages' "
                f"(keys: {sorted(record)})"
            )
        if not turns:
            raise ValueError(f"{source}: record {record_id!r} has no user turn")
        yield {
            "id": f"{dataset}-{record_id}",
            "dataset": dataset,
            "category": record.get("category"),
            "system": system,
            "turns": turns,
        }


def _hash_rank(prompt_id: str, seed: int) -> str:
    return hashlib.sha1(f"{seed}:{prompt_id}".encode()).hexdigest()


def select_subset(
    prompts: list[dict[str, Any]], limit: int | None, order: str, seed: int
) -> list[dict[str, Any]]:
    """Deterministic subset of ``limit`` prompts (a bench.datasets entry's limit, order, seed).

    ``file``: the first ``limit`` in file order. ``hash``: the ``limit`` prompts whose
    sha1(seed:id) ranks lowest, kept in file order, so growing ``limit`` only adds prompts.
    """
    if order not in ORDERS:
        raise ValueError(f"subset order {order!r} is not one of {ORDERS}")
    if limit is None or limit >= len(prompts):
        return list(prompts)
    if limit < 1:
        raise ValueError(f"limit must be >= 1 or null, got {limit}")
    if order == "file":
        return list(prompts[:limit])
    chosen = set(sorted((_hash_rank(p["id"], seed), p["id"]) for p in prompts)[:limit])
    return [p for p in prompts if (_hash_rank(p["id"], seed), p["id"]) in chosen]


def load_prompts(
    kind: str,
    path: str,
    dataset: str,
    *,
    limit: int | None,
    order: str,
    seed: int,
    max_turns: int | None,
) -> list[dict[str, Any]]:
    """Read a prompt set of ``kind`` from ``path`` (plain or ``pkg:``) and normalise it; its
    bench.datasets entry's limit, order and seed, and bench.max_turns (no defaults here)."""
    source = resolve_path(path)
    records = _read_jsonl(source)
    if kind == "mtbench":
        prompts = list(_mtbench(records, dataset))
    elif kind == "humaneval":
        prompts = list(_humaneval(records, dataset))
    elif kind == "chat":
        prompts = list(_chat(records, dataset, source))
    else:
        raise ValueError(f"prompt set kind {kind!r} is not one of {KINDS}")
    if not prompts:
        raise ValueError(f"{source}: no prompts found")
    ids = [p["id"] for p in prompts]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{source}: prompt id {duplicate!r} occurs more than once")
    if max_turns is not None:
        for prompt in prompts:
            prompt["turns"] = prompt["turns"][:max_turns]
    return select_subset(prompts, limit, order, seed)


def write_prompts(prompts: list[dict[str, Any]], out: str | Path) -> None:
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for prompt in prompts:
            handle.write(json.dumps(prompt, ensure_ascii=False) + "\n")


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    return list(_read_jsonl(Path(path)))
