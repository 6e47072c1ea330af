# The card reports what the run measured, so it is written after evaluation (and serving); its own
# file, included after rules/evaluate.smk, so that it can name those rules' outputs.
rule model_card:
    input:
        draft=rules.export_draft.output.record,
        summary=rules.train_draft.output.summary,
        stats=rules.prepare_data.output.stats,
        offline=rules.evaluate_offline.output[0],
        serving=(
            rules.benchmark_serving.output.serving
            if config["benchmark_serving"]["enabled"]
            else []
        ),
        earlier=inputs_before(
            rules.export_draft,
            rules.train_draft,
            rules.prepare_data,
            rules.evaluate_offline,
            *[rules.benchmark_serving] * bool(config["benchmark_serving"]["enabled"]),
        ),
    output:
        "results/{run}/draft/README.md",
    log:
        "results/{run}/logs/model_card.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        draft_config=lambda wc, input: os.path.join(
            os.path.dirname(input.draft), "config.json"
        ),
        serving=lambda wc, input: f"--serving {input.serving}" if input.serving else "",
        settings=get_setting_flags("model_card"),
        code=code_digest("model_card"),
    shell:
        f"{STAGE}.model_card "
        "--draft-config {params.draft_config} --summary {input.summary} "
        "--data-stats {input.stats} --offline {input.offline} {params.serving} "
        "{params.settings} --out {output} > {log} 2>&1"
