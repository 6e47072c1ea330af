# The card reports what the run measured, so it is written after evaluation (and serving); its own
# file, included after rules/evaluate.smk, so that it can name those rules' outputs. It also lists
# every target load of the run (the run's summary, summary.json), read from the outputs of the
# stages that start the target: all of them outputs the run makes before the card anyway.
SERVING = config["benchmark_serving"]["enabled"]
REGENERATION_STATS = ["results/{run}/regenerated/stats.json"] * bool(
    config["regenerate"]["enabled"]
) + ["results/{run}/regenerated/eval_prompts_stats.json"] * bool(
    config["evaluate"]["prompts"]
)
PARITY_PART = expand(
    rules.extract_parity_hidden_states.output.part, i=0, r=1, allow_missing=True
)


rule model_card:
    input:
        draft=rules.export_draft.output.record,
        summary=rules.train_draft.output.summary,
        stats=rules.prepare_data.output.stats,
        offline=rules.evaluate_offline.output[0],
        serving=rules.benchmark_serving.output.serving if SERVING else [],
        regenerated=REGENERATION_STATS,
        manifest=rules.gather_hidden_states.output.manifest,
        parity=PARITY_PART if SERVING else [],
        parity_gate=rules.evaluate_parity.output[0] if SERVING else [],
        earlier=inputs_before(
            rules.export_draft,
            rules.train_draft,
            rules.prepare_data,
            rules.evaluate_offline,
            rules.gather_hidden_states,
            *REGENERATION_RULES,
            *[
                rules.benchmark_serving,
                rules.extract_parity_hidden_states,
                rules.evaluate_parity,
            ]
            * SERVING,
        ),
    output:
        card="results/{run}/draft/README.md",
        summary="results/{run}/summary.json",
    log:
        "results/{run}/logs/model_card.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        draft_config=lambda wc, input: os.path.join(
            os.path.dirname(input.draft), "config.json"
        ),
        serving=lambda wc, input: f"--serving {input.serving}" if input.serving else "",
        regenerated=lambda wc, input: (
            f"--regeneration-stats {input.regenerated}" if input.regenerated else ""
        ),
        parity=lambda wc, input: (
            f"--parity-manifest {input.parity} --parity {input.parity_gate}"
            if input.parity
            else ""
        ),
        settings=get_setting_flags("model_card"),
        code=code_digest("model_card"),
    shell:
        f"{STAGE}.model_card "
        "--draft-config {params.draft_config} --summary {input.summary} "
        "--data-stats {input.stats} --offline {input.offline} {params.serving} "
        "{params.regenerated} --manifest {input.manifest} {params.parity} "
        "{params.settings} --out {output.card} --run-summary {output.summary} > {log} 2>&1"
