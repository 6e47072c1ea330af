# protected(): a delivered draft is never overwritten by a stray rerun; delete it on purpose.
rule export_draft:
    input:
        summary=rules.train_draft.output.summary,
        earlier=inputs_before(rules.train_draft),
    output:
        config=protected("results/{run}/draft/config.json"),
        weights=protected("results/{run}/draft/model.safetensors"),
    log:
        "results/{run}/logs/export_draft.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        verifier=get_verifier_name(),
        k=get_num_speculative_tokens(),
        settings=get_setting_flags("export_draft"),
        outdir=lambda wc, output: os.path.dirname(output.config),
        code=code_digest("export_draft"),
    shell:
        f"{STAGE}.export_draft "
        "--summary {input.summary} --verifier-name '{params.verifier}' "
        "--num-speculative-tokens {params.k} {params.settings} "
        "--out-dir {params.outdir} > {log} 2>&1"
