"""Rule prepare_target: the target as a bf16 HF checkpoint under resources/target."""

from pathlib import Path

from draftflow.target.prepare import prepare_target
from draftflow.workflow.script import setup_logging

setup_logging(snakemake)
target = snakemake.params.target
prepare_target(
    Path(snakemake.output.config).parent,
    source=target["source"],
    gguf=target["gguf"],
    path=target["path"],
    dtype=target["dtype"],
    trust_remote_code=target["trust_remote_code"],
    chat_template=target["chat_template"],
)
