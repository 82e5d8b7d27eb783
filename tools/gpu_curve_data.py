"""The data of studies/quality_curve.py, small enough to travel with the tree to a GPU machine
that has no data packages.

Writes into ``out`` what ``quality_curve.py run --data out`` points the curve's config at:

- ``sharegpt.json``: the raw ShareGPT records that config/examples/smollm2-gpu.yaml's ingest
  keeps at ``--conversations`` (its ``corpus.seed``), so a size of that many conversations
  ingests the same conversations under the same ids as from the package's whole file (a
  smaller size takes its own sample of these);
- ``mtbench.jsonl`` and ``HumanEval.jsonl.gz``: the curve's two prompt sets, whole.

    .venv/bin/python tools/gpu_curve_data.py .carry/curve-data --conversations 1280
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "studies"))

from gpu_example_data import kept_records  # noqa: E402
from quality_curve import BASE_CONFIG, DATA_FILES, overlay  # noqa: E402


def write_curve_data(out: Path, conversations: int) -> dict[str, int]:
    """Write the curve's data for sizes up to ``conversations`` into ``out``; returns the bytes
    of each file."""
    from draftflow.config import load_config
    from draftflow.resources import resolve_path

    example = load_config(REPO / BASE_CONFIG)
    (source,) = example["corpus"]["sources"]
    out.mkdir(parents=True, exist_ok=True)
    records = kept_records(source, conversations, int(example["corpus"]["seed"]))
    text = json.dumps(records, ensure_ascii=False)
    (out / DATA_FILES["sharegpt"]).write_text(text, encoding="utf-8")
    for dataset in overlay(conversations, per_shard=conversations)["bench"]["datasets"]:
        shutil.copy(resolve_path(dataset["path"]), out / DATA_FILES[dataset["name"]])
    return {path.name: path.stat().st_size for path in sorted(out.iterdir()) if path.is_file()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="e.g. .carry/curve-data (ignored by git)")
    parser.add_argument(
        "--conversations", type=int, required=True, help="the largest size the data serves"
    )
    args = parser.parse_args(argv)
    sizes = write_curve_data(args.out, args.conversations)
    json.dump({"files": sizes, "total_bytes": sum(sizes.values())}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
