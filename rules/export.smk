# protected(): a delivered draft is never overwritten by a stray rerun; delete it on purpose.
rule export_draft:
    input:
        summary=RUN + "/train/summary.json",
    output:
        config=protected(RUN + "/draft/config.json"),
        weights=protected(RUN + "/draft/model.safetensors"),
        card=protected(RUN + "/draft/README.md"),
    log:
        RUN + "/logs/export_draft.log",
    params:
        which=config["export"]["which"],
        verifier=config["target"]["deploy_name"] or config["target"]["model"],
        k=num_speculative_tokens(),
        drop="--drop-embedding" if config["export"]["drop_embedding"] else "--keep-embedding",
        outdir=RUN + "/draft",
        code=code_digest("export"),
    conda:
        "../envs/eaglepipe.yaml"
    shell:
        "{PY} eaglepipe.export_draft --summary {input.summary} --which {params.which} "
        "--verifier-name '{params.verifier}' --num-speculative-tokens {params.k} {params.drop} "
        "--out-dir {params.outdir} > {log} 2>&1"
