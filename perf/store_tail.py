"""The capture store's tail: time from the last ``add()`` to the return of ``close()``.

One chunk of ``--samples`` samples of ``--tokens`` tokens, ``--layers`` × ``--hidden`` states,
handed to a ``CaptureWriter`` at a steady pace (``--arrival-gbps`` of states, as an engine hands
them over; 0 = all at once), in two modes:

- ``buffered``: no ``expect()``: the chunk is written and hashed once its last sample is added;
- ``streamed``: the lengths announced with ``expect()`` first (as the extract stage does): each
  sample is written and hashed as it is added.

The tail is what a capture pays after its engine has finished. The host's sha256 and write
rates are measured too (the tail of ``buffered`` is about a chunk at the slower of the two).

    PYTHONPATH=$PWD python perf/store_tail.py --out docs/results/store-tail.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODES = ("buffered", "streamed")


def make_samples(args: argparse.Namespace) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (args.tokens, args.layers, args.hidden)
    return [torch.randn(shape, generator=generator).bfloat16() for _ in range(args.samples)]


def host_rates(root: Path, nbytes: int = 256 << 20) -> dict:
    """sha256 and write() throughput of this host, in GB/s."""
    block = os.urandom(1 << 20) * (nbytes >> 20)
    began = time.perf_counter()
    hashlib.sha256(block).hexdigest()
    hashed = time.perf_counter() - began
    path = root / "rate.bin"
    began = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(block)
    written = time.perf_counter() - began
    path.unlink()
    return {
        "sha256_gbps": round(nbytes / hashed / 1e9, 2),
        "write_gbps": round(nbytes / written / 1e9, 2),
    }


def one_run(mode: str, samples: list[torch.Tensor], args: argparse.Namespace, out: Path) -> dict:
    from draftflow.capture.store import CaptureWriter

    shutil.rmtree(out, ignore_errors=True)
    layer_ids = list(range(1, args.layers + 1))
    writer = CaptureWriter(
        out,
        layer_ids=layer_ids,
        aux_layer_ids=layer_ids[:-1],
        hidden_size=args.hidden,
        meta={"bench": "store_tail"},
        chunk_samples=args.samples,
        store_dtype=args.store_dtype,
    )
    ids = [f"s{i}" for i in range(len(samples))]
    if mode == "streamed":
        writer.expect((sample_id, args.tokens) for sample_id in ids)
    input_ids = torch.zeros(args.tokens, dtype=torch.int32)
    loss_mask = torch.ones(args.tokens, dtype=torch.int8)
    interval = samples[0].numel() * 2 / (args.arrival_gbps * 1e9) if args.arrival_gbps else 0.0
    began = time.perf_counter()
    last_add = began
    for index, (sample_id, states) in enumerate(zip(ids, samples, strict=True)):
        # A steady pace, as an engine hands samples over: sample i is due at i * interval.
        delay = began + index * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        last_add = time.perf_counter()
        writer.add(sample_id, input_ids, loss_mask, states)
    added = time.perf_counter()
    writer.close()
    closed = time.perf_counter()
    return {
        "tail_s": round(closed - last_add, 4),
        "last_add_s": round(added - last_add, 4),
        "close_s": round(closed - added, 4),
        "total_s": round(closed - began, 4),
        "chunk_bytes": sum(p.stat().st_size for p in out.glob("chunk-*")),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--store-dtype", default="bfloat16")
    parser.add_argument("--arrival-gbps", type=float, default=0.5, help="0: all at once")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", type=Path, help="where the stores go (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="JSON file the results are written to")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    root = Path(tempfile.mkdtemp(prefix="store-tail-", dir=args.root))
    try:
        samples = make_samples(args)
        result: dict = {
            "samples": args.samples,
            "tokens": args.tokens,
            "layers": args.layers,
            "hidden": args.hidden,
            "store_dtype": args.store_dtype,
            "arrival_gbps": args.arrival_gbps,
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), **host_rates(root)},
            "modes": {},
        }
        for mode in args.modes:
            runs = [one_run(mode, samples, args, root / mode) for _ in range(args.repeats)]
            tails = [run["tail_s"] for run in runs]
            result["modes"][mode] = {
                "median_tail_s": round(statistics.median(tails), 4),
                "min_tail_s": min(tails),
                "runs": runs,
            }
            print(
                json.dumps({"mode": mode, "median_tail_s": result["modes"][mode]["median_tail_s"]})
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
