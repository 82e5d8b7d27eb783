# draftflow: raw chat corpus -> EAGLE-3 draft for vLLM -> benchmark report.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "docs/workflow.rst"


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/corpus.smk"
include: "rules/tokenize.smk"
include: "rules/extract.smk"
include: "rules/train.smk"


# extract.mode streamed: temporary captures and a chain of training links (docs/storage.md).
if streamed_mode():

    include: "rules/stream.smk"


include: "rules/bench.smk"
include: "rules/report.smk"


rule all:
    input:
        get_final_output(),
