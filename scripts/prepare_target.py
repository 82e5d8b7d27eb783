"""Rule prepare_target: the target as a bf16 HF checkpoint under resources/target."""

from pathlib import Path

from draftflow.target.prepare import prepare_target
from draftflow.workflow.script import setup_logging

setup_logging(snakemake)
target = snakemake.params.target
prepare_target(
    Path(snakemake.output.config).parent,
    source=target["source"],
    gguf=target.get("gguf"),
    path=target.get("path"),
    dtype=target.get("dtype", "bfloat16"),
    trust_remote_code=target.get("trust_remote_code", False),
    chat_template=target.get("chat_template"),
)
