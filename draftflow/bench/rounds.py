"""The benchmark's driver: every engine alive at once, each unit timed on every one in turn.

Each engine runs in its own process (``draftflow.bench.engine``), reached over two pipes. Each
prompt set is cut into units (``max_num_seqs`` conversations, one at batch 1); in every round
(``repeats``) each unit goes to every engine, in an order rotated from unit to unit and round to
round. A configuration's measurements of a unit thus lie seconds apart from the others', so a
slow phase of the machine hits them alike and cancels in their ratio
(``draftflow.bench.stats``). The engines' results come back in the shape the tables read
(``draftflow.bench.tables``): per k, one entry per (round, prompt set) under ``runs``, with its
units under ``units``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from draftflow.bench.counters import SpecCounters
from draftflow.io import atomic_write_json

log = logging.getLogger(__name__)

# One engine's measurement of one unit: (responses by prompt id, seconds, counters).
Measurement = tuple[dict[str, list[dict[str, Any]]], float, SpecCounters]


def timed_units(prompts: list[dict[str, Any]], max_num_seqs: int) -> list[list[dict[str, Any]]]:
    """The prompt set cut into the units every engine times in turn: ``max_num_seqs``
    conversations each (one at batch 1), so that one unit fills the engine's batch."""
    size = max(1, int(max_num_seqs))
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def unit_name(unit: list[dict[str, Any]]) -> str:
    first = unit[0]["id"]
    return first if len(unit) == 1 else f"{first}+{len(unit) - 1}"


def engine_order(ks: list[int], repeat: int, position: int) -> list[int]:
    """The order the engines run one unit in: rotated from unit to unit and round to round,
    so that each configuration comes right after another engine's unit equally often."""
    shift = (repeat + position) % len(ks)
    return ks[shift:] + ks[:shift]


class EngineProcess:
    """One engine's process and its two pipes (commands in, replies out)."""

    def __init__(self, k: int, request_path: Path, env: dict[str, str]) -> None:
        self.k = k
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()
        command = [
            sys.executable,
            "-m",
            "draftflow.bench.engine",
            str(request_path),
            str(commands_read),
            str(replies_write),
        ]
        sys.stderr.flush()
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=sys.stderr,
            stderr=sys.stderr,
            pass_fds=(commands_read, replies_write),
        )
        # The child holds its own ends now.
        os.close(commands_read)
        os.close(replies_write)
        self.commands = open(self._commands, "w", encoding="utf-8")  # noqa: SIM115
        self.replies = open(self._replies, encoding="utf-8")  # noqa: SIM115

    def _receive(self) -> dict[str, Any]:
        """The engine's next reply; its own error (an engine that could not start names the
        root cause, ``draftflow.engine``) raised here, in the job's exception."""
        line = self.replies.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"benchmark engine k={self.k} failed with exit code {code}")
        message = json.loads(line)
        if "error" in message:
            code = self.process.wait()
            raise RuntimeError(
                f"benchmark engine k={self.k} failed (exit code {code}): {message['error']}"
            )
        return message

    def wait_ready(self) -> None:
        if not self._receive().get("ready"):
            raise RuntimeError(f"benchmark engine k={self.k} did not report ready")
        log.info("engine k=%d ready", self.k)

    def measure(self, dataset: str, unit: list[dict[str, Any]]) -> Measurement:
        self.commands.write(json.dumps({"dataset": dataset, "prompts": [p["id"] for p in unit]}))
        self.commands.write("\n")
        self.commands.flush()
        reply = self._receive()
        c = reply["counters"]
        counters = SpecCounters(
            c["num_drafts"],
            c["num_draft_tokens"],
            c["num_accepted_tokens"],
            tuple(c["accepted_per_pos"]),
        )
        return reply["responses"], float(reply["elapsed_s"]), counters

    def margins(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The plain target's margin at each difference (``draftflow.bench.margins``)."""
        self.commands.write(json.dumps({"margins": items}) + "\n")
        self.commands.flush()
        return self._receive()["margins"]

    def close(self) -> None:
        """Ask the engine to stop; end its process if it doesn't within a minute."""
        try:
            self.commands.write(json.dumps({"stop": True}) + "\n")
            self.commands.flush()
            self.commands.close()
        except (BrokenPipeError, ValueError):
            pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            self.process.wait()
        self.replies.close()
        log.info("stopped engine k=%d", self.k)


@contextmanager
def engine_processes(
    requests: dict[int, dict[str, Any]],
    workdir: Path,
    env: dict[str, str],
    together: bool = False,
) -> Iterator[dict[int, EngineProcess]]:
    """Start every engine, one after the other (each waits until the last is ready, so starts
    don't compete for the cores) or all at once (``together``), and stop them all at the end."""
    with ExitStack() as stack:
        engines = {}
        for k, request in sorted(requests.items()):
            path = workdir / f"k{k}.request.json"
            atomic_write_json(path, request)
            log.info("starting engine k=%d", k)
            engine = EngineProcess(k, path, env)
            stack.callback(engine.close)
            if not together:
                engine.wait_ready()
            engines[k] = engine
        if together:
            for engine in engines.values():
                engine.wait_ready()
        yield engines


def run_rounds(
    engines: dict[int, EngineProcess],
    prompt_sets: dict[str, list[dict[str, Any]]],
    repeats: int,
    max_num_seqs: int,
) -> dict[int, list[dict[str, Any]]]:
    """Every round: every unit of every prompt set on every engine in turn. Returns per k the
    runs (one per round and prompt set)."""
    ks = sorted(engines)
    runs: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
    for repeat in range(repeats):
        for dataset, prompts in prompt_sets.items():
            units = timed_units(prompts, max_num_seqs)
            measured: dict[int, list[Measurement]] = {k: [] for k in ks}
            for position, unit in enumerate(units):
                for k in engine_order(ks, repeat, position):
                    measured[k].append(engines[k].measure(dataset, unit))
            for k in ks:
                runs[k].append(run_entry(repeat, dataset, units, measured[k]))
                log.info(
                    "round %d, %s, k=%d: %.1f output tokens/s",
                    repeat,
                    dataset,
                    k,
                    runs[k][-1]["tokens_per_s"],
                )
    return runs


def run_stats(responses: dict[str, list[dict[str, Any]]], elapsed: float) -> dict[str, Any]:
    """A run's totals: requests, tokens, seconds, throughput, mean time per output token."""
    flat = [r for turns in responses.values() for r in turns]
    output_tokens = sum(len(r["token_ids"]) for r in flat)
    # Time per output token: per response, decode time over the tokens after the first.
    per_token = [
        r["decode_s"] / (len(r["token_ids"]) - 1)
        for r in flat
        if r["decode_s"] is not None and len(r["token_ids"]) > 1
    ]
    return {
        "num_prompts": len(responses),
        "num_requests": len(flat),
        "prompt_tokens": sum(r["prompt_tokens"] for r in flat),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": output_tokens / elapsed if elapsed > 0 else float("nan"),
        "requests_per_s": len(flat) / elapsed if elapsed > 0 else float("nan"),
        "tpot_ms": 1000.0 * sum(per_token) / len(per_token) if per_token else float("nan"),
    }


def unit_record(name: str, measurement: Measurement) -> dict[str, Any]:
    """One engine's measurement of one unit: the additive quantities the statistics resample
    (``draftflow.bench.stats``)."""
    responses, elapsed, counters = measurement
    flat = [r for turns in responses.values() for r in turns]
    timed = [r for r in flat if r["decode_s"] is not None and len(r["token_ids"]) > 1]
    return {
        "unit": name,
        "seconds": elapsed,
        "output_tokens": sum(len(r["token_ids"]) for r in flat),
        "decode_seconds": sum(r["decode_s"] for r in timed),
        "decode_tokens": sum(len(r["token_ids"]) - 1 for r in timed),
        "num_drafts": counters.num_drafts,
        "num_accepted_tokens": counters.num_accepted_tokens,
    }


def run_entry(
    repeat: int, dataset: str, units: list[list[dict[str, Any]]], measured: list[Measurement]
) -> dict[str, Any]:
    """One engine's pass over one prompt set in one round: totals, counters, every unit and
    every response."""
    responses = {pid: turns for found, _, _ in measured for pid, turns in found.items()}
    total = sum((counters for _, _, counters in measured), start=SpecCounters())
    return {
        "run": repeat,
        "dataset": dataset,
        **run_stats(responses, sum(elapsed for _, elapsed, _ in measured)),
        "num_drafts": total.num_drafts,
        "num_draft_tokens": total.num_draft_tokens,
        "num_accepted_tokens": total.num_accepted_tokens,
        "accepted_per_pos": list(total.accepted_per_pos),
        "units": [
            unit_record(unit_name(unit), measurement)
            for unit, measurement in zip(units, measured, strict=True)
        ],
        "responses": responses,
    }
