"""``python -m draftflow.plan``: the engine plan of a config, without a GPU or vLLM running.

    python -m draftflow.plan --configfile config/examples/kimi-k2.5-8gpu.yaml \\
        --target-config tests/data/targets/kimi-k2.5/config.json [--device-memory-gib 80]

The config files merge as Snakemake merges ``--configfile`` (schema defaults <- config/config.yaml
<- the files, ``draftflow.config.load_config``); the start checks run first
(``draftflow.plan.checks``). ``--target-config`` defaults to ``target.path``'s config.json where
that is a local checkpoint. Exit status 1 where a check or the plan refuses the config.
"""

from __future__ import annotations

import argparse
import sys

from draftflow.plan.checkpoints import format_checkpoint_plan, plan_checkpoints
from draftflow.plan.engines import GIB, check_engine_plan, format_engine_plan, plan_engines


def main(argv: list[str] | None = None) -> int:
    from draftflow.config import load_config
    from draftflow.plan.checks import ConfigCheckError, check_config, local_target_config
    from draftflow.plan.target_shape import read_target_shape, target_shape

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configfile", nargs="+", required=True, help="config files, merged in order"
    )
    parser.add_argument(
        "--target-config",
        help="the target's config.json (default: target.path's, where it is a local checkpoint)",
    )
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        default=80,
        help="memory of one GPU in GiB (default 80: an H100; torch reports 139.8 for an H200)",
    )
    args = parser.parse_args(argv)
    config = load_config(*args.configfile)
    if args.target_config:
        source, found = args.target_config, None
    else:
        source, found = "target.path's config.json", local_target_config(config)
        if found is None:
            parser.error(
                "target.path is no local checkpoint with a config.json (a hub id, or a gguf "
                "target): give the target's config.json with --target-config"
            )
    try:
        shape = read_target_shape(args.target_config) if found is None else target_shape(found)
    except (ValueError, KeyError, TypeError) as error:
        # An architecture or quantization the shape is not estimated for: say which key, and
        # what a run does without the plan (its start checks skip the checks on the shape).
        print(
            f"{source}: {error}\nno engine plan for this target. A run still starts: its start "
            "checks skip the ones that need the shape; size the KV caches by hand with "
            "extract.kv_cache_memory_bytes and bench.kv_cache_memory_bytes (config/README.md)",
            file=sys.stderr,
        )
        return 1
    try:
        notes = check_config(config, shape)
    except ConfigCheckError as error:
        print(error, file=sys.stderr)
        return 1
    plan = plan_engines(config, shape, int(args.device_memory_gib * GIB))
    print(format_engine_plan(plan, shape))
    print(format_checkpoint_plan(plan_checkpoints(config, shape)))
    for note in notes:
        print(f"note: {note}")
    try:
        check_engine_plan(plan)
    except ValueError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
