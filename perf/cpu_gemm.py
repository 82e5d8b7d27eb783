"""fp32 against bf16 matrix products on the CPU, at the demo draft's MLP shape.

Why ``train.precision: bf16`` pays on CPUs with AMX: the draft's GEMMs are its largest cost.
Prints GFLOP/s per dtype (median of ``--repeats`` timed products after a warm-up)::

    .venv/bin/python perf/cpu_gemm.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time


def gflops(m: int, k: int, n: int, dtype_name: str, repeats: int) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - began)
    return 2 * m * k * n / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 2048 packed tokens x hidden 576 -> intermediate 1536: the draft's MLP up-projection.
    parser.add_argument("--shape", type=int, nargs=3, default=[2048, 576, 1536])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    m, k, n = args.shape
    result = {
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "torch": torch.__version__,
        "threads": args.threads,
        "shape": args.shape,
        **{
            f"gflops_{d}": round(gflops(m, k, n, d, args.repeats), 1)
            for d in ("float32", "bfloat16")
        },
    }
    result["bf16_over_fp32"] = round(result["gflops_bfloat16"] / result["gflops_float32"], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
