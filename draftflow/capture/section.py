"""The extract rules' ``params.extract``: what an extract job's ``ExtractSettings`` is built from.

Apart from draftflow.config so that the stages which read only that (tokenize, split, train)
do not take draftflow.engine_settings into their code digest (rules/common.smk, stage_code), and
free of torch, since rules/common.smk calls it while Snakemake parses the workflow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from draftflow.engine_settings import EXTRACT_ENGINE_KEYS, engine_settings

# Keys of extract: that shape the DAG (rules/common.smk, rules/stream.smk), not a capture job:
# changing them reruns no stored capture.
EXTRACT_DAG_KEYS = frozenset({"num_shards", "mode", "window", "keep_first_epoch"})


def extract_section(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extract:`` section's capture keys (not ``EXTRACT_DAG_KEYS``, not the engine's),
    the extract stage's engine (``engine_settings(config, "extract")``, as a mapping: the same
    path as regenerate's and bench's engines) and the target's ``trust_remote_code``."""
    skipped = EXTRACT_DAG_KEYS | EXTRACT_ENGINE_KEYS
    return {
        **{key: value for key, value in config["extract"].items() if key not in skipped},
        "engine": dataclasses.asdict(engine_settings(config, "extract")),
        "trust_remote_code": config["target"]["trust_remote_code"],
    }
