from snakemake.utils import min_version

min_version("9.20")


configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/rerun.smk"
include: "rules/regenerate.smk"
include: "rules/data.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/export.smk"
include: "rules/evaluate.smk"
include: "rules/card.smk"


localrules:
    all,
    gather_hidden_states,


rule all:
    default_target: True
    input:
        every_output(),


check_earlier_inputs(workflow.rules)
