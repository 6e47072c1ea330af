# The declared output is the export record; the draft beside it (config.json, model.safetensors,
# read-only) is the stage's to write, not Snakemake's: Snakemake 9.27.1 removes a job's outputs
# before it runs the job (jobs.py remove_existing_output; protected() turns a non-root rerun away
# by write permission, not root), so a declared draft was deleted before the stage could keep it.
# The stage keeps a delivered draft that is this export byte for byte, and leaves any other one as
# it is and stops: a delivered draft is never overwritten; delete it on purpose. While the record
# is missing (removed when the job starts or fails), the export and everything after it are pending.
rule export_draft:
    input:
        summary=rules.train_draft.output.summary,
        earlier=inputs_before(rules.train_draft),
    output:
        record="results/{run}/draft/export.json",
    log:
        "results/{run}/logs/export_draft.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        verifier=get_verifier_name(),
        k=get_num_speculative_tokens(),
        settings=get_setting_flags("export_draft"),
        outdir=lambda wc, output: os.path.dirname(output.record),
        code=code_digest("export_draft"),
    shell:
        f"{STAGE}.export_draft "
        "--summary {input.summary} --verifier-name '{params.verifier}' "
        "--num-speculative-tokens {params.k} {params.settings} "
        "--out-dir {params.outdir} > {log} 2>&1"
