# Only when the config asks the pipeline to build the target, and only into the recipe's own
# directory (config_check.target_errors refuses any other target.model): a model directory the
# user supplies is never the output of a rule, so no rule writes, moves or deletes it.
if config["target"]["build"]:

    rule build_target:
        output:
            directory(BUILT_TARGETS[config["target"]["build"]]),
        log:
            "results/logs/build_target.log",
        benchmark:
            "results/benchmarks/build_target.tsv"
        conda:
            "../envs/eaglepipe.yaml"
        threads: 2
        params:
            recipe=config["target"]["build"],
            code=code_digest("build_target"),
        shell:
            f"{STAGE}.build_target "
            "--recipe {params.recipe} --out {output} > {log} 2>&1"


# the rules whose answers prepare_data reads
REGENERATION_RULES = list(
    dict.fromkeys(
        [rules.regenerate_responses] * bool(config["regenerate"]["enabled"])
        + [EVAL_PROMPTS_RULE] * bool(config["evaluate"]["prompts"])
    )
)


rule prepare_data:
    input:
        # the target's regenerated answers when regenerate.enabled; the fixed evaluation set's
        # when evaluate.prompts names one (else the eval split is drawn from the data)
        data=REGENERATED if config["regenerate"]["enabled"] else get_data_input(),
        eval_data=REGENERATED_EVAL if config["evaluate"]["prompts"] else [],
        model=get_target_input(),
        chat_template=get_chat_template_input(),
        earlier=inputs_before(*REGENERATION_RULES),
    output:
        train="results/{run}/data/train.jsonl",
        eval="results/{run}/data/eval.jsonl",
        stats=report(
            "results/{run}/data/stats.json",
            category="1. Data",
            caption="../report/data_stats.rst",
        ),
        token_freq="results/{run}/data/token_freq.safetensors",
    log:
        "results/{run}/logs/prepare_data.log",
    benchmark:
        "results/{run}/benchmarks/prepare_data.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: 2
    params:
        data=get_prepare_data_source,
        model=get_target_arg,
        settings=get_setting_flags("prepare_data", "data"),
        template_sha256=get_chat_template_sha256(),
        outdir=lambda wc, output: os.path.dirname(output.train),
        code=code_digest("prepare_data"),
    shell:
        f"{STAGE}.prepare_data "
        "{params.data} --model {params.model} --out-dir {params.outdir} "
        "{params.settings} > {log} 2>&1"


rule vocab_mapping:
    input:
        token_freq="results/{run}/data/token_freq.safetensors",
        earlier=inputs_before(rules.prepare_data),
    output:
        "results/{run}/data/vocab_mapping.safetensors",
    log:
        "results/{run}/logs/vocab_mapping.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        settings=get_setting_flags("vocab_mapping"),
        code=code_digest("vocab_mapping"),
    shell:
        f"{STAGE}.vocab_mapping "
        "--token-freq {input.token_freq} {params.settings} --out {output} > {log} 2>&1"
