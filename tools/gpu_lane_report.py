"""The GPU lane's outcome as docs/results JSON: tests passed per family x runner x backend.

Reads the pytest logs (``-v``) that ``tools/gpu_lane_033.sh tests`` packs into lane-logs.tar.gz,
and optionally perf/gpu_capture.py's JSON, and writes one record:

    python tools/gpu_lane_report.py --logs lane-logs.tar.gz --perf gpu-capture-033.json \\
        --device "NVIDIA H200" --command "..." --out docs/results/gpu-lane-033-DATE.json
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import re
import tarfile
from pathlib import Path

OUTCOME = re.compile(r"^(tests/gpu/\S+::(\w+)(?:\[([^\]]*)\])?) (PASSED|FAILED|SKIPPED|ERROR)")
VERSIONS = re.compile(r"^(torch|vllm) (\S+)", re.M)
# The tests print each comparison as "<label> vs hf fp32: {layer: {mean, p01, min}}".
AGREEMENT = re.compile(r"^(.+?) vs hf fp32: (\{.*)$", re.M)
# A failure's section in pytest's report: "____ test_name[params] ____", then "E   ..." lines.
SECTION = re.compile(r"^_{3,} (\S+) _{3,}$", re.M)


def read_logs(archive: Path) -> dict[str, str]:
    with tarfile.open(archive) as tar:
        return {
            Path(m.name).name: tar.extractfile(m).read().decode("utf-8", "replace")
            for m in tar.getmembers()
            if m.isfile()
        }


def first_braces(text: str) -> str:
    """The first balanced {...} of ``text`` (further values may follow it on the line)."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return text[: i + 1]
    return text


def agreement(logs: dict[str, str]) -> list[dict]:
    """Each printed comparison with hf fp32: its label and its lowest layer's mean and p01."""
    found = []
    for text in logs.values():
        for label, stats in AGREEMENT.findall(text):
            layers = ast.literal_eval(first_braces(stats))
            found.append(
                {
                    "comparison": label.strip(),
                    "lowest_layer_mean": round(min(v["mean"] for v in layers.values()), 6),
                    "lowest_layer_p01": round(min(v["p01"] for v in layers.values()), 6),
                }
            )
    return found


def failure_reasons(logs: dict[str, str]) -> dict[str, str]:
    """Each failed test's name (as in its section title) -> the last "E " line of its section."""
    reasons = {}
    for text in logs.values():
        titles = list(SECTION.finditer(text))
        for i, title in enumerate(titles):
            end = titles[i + 1].start() if i + 1 < len(titles) else len(text)
            errors = [
                ln[1:].strip() for ln in text[title.end() : end].splitlines() if ln.startswith("E ")
            ]
            if errors:
                reasons[title.group(1)] = errors[-1][:600]
    return reasons


def outcome_rows(logs: dict[str, str]) -> list[dict]:
    """One row per test: its node id, the family / runner / backend it covers, its outcome."""
    rows = {}
    for name, text in logs.items():
        if not name.endswith(".log"):
            continue
        for line in text.splitlines():
            match = OUTCOME.match(line.strip())
            if not match:
                continue
            node, test, params, outcome = match.groups()
            parts = params.split("-") if params else []
            backend = "native" if "native" in test else "hooks" if "hooks" in test else "engine"
            family = next((p for p in parts if p not in ("v1", "v2", "default")), "smollm2")
            runner = next((p for p in parts if p in ("v1", "v2", "default")), "default")
            rows[node] = {
                "test": node,
                "family": family,
                "runner": runner,
                "backend": backend,
                "outcome": outcome.lower(),
            }
    reasons = failure_reasons(logs)
    for row in rows.values():
        reason = reasons.get(row["test"].split("::")[-1])
        if row["outcome"] in ("failed", "error") and reason:
            row["reason"] = reason
    return sorted(rows.values(), key=lambda r: r["test"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logs", type=Path, nargs="+", required=True)
    parser.add_argument("--perf", type=Path)
    parser.add_argument("--device", required=True)
    parser.add_argument("--command", action="append", default=[])
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logs: dict[str, str] = {}
    for archive in args.logs:
        logs.update(read_logs(archive))
    perf = json.loads(args.perf.read_text()) if args.perf else None
    # perf/gpu_capture.py writes a list of runs; a record of ours keeps them under "results".
    results = (perf if isinstance(perf, list) else perf.get("results", [])) if perf else []
    versions = dict(VERSIONS.findall(logs.get("smoke.log", "")))
    if results and not versions:  # the smoke test ran in an earlier call: perf names them
        versions = {name: results[0][name] for name in ("torch", "vllm") if name in results[0]}
    rows = outcome_rows(logs)
    record = {
        "device": args.device,
        "date": args.date,
        "versions": versions,
        "commands": args.command,
        "passed": sum(r["outcome"] == "passed" for r in rows),
        "failed": sum(r["outcome"] in ("failed", "error") for r in rows),
        "skipped": sum(r["outcome"] == "skipped" for r in rows),
        "tests": rows,
        "agreement_with_hf": agreement(logs),
    }
    if perf:
        record["capture_ratio_to_plain"] = {
            r["mode"]: r.get("ratio_to_plain") for r in results if isinstance(r, dict)
        }
        record["capture"] = perf
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("tests", "capture")}))


if __name__ == "__main__":
    main()
