# protected(): a delivered draft is never overwritten by a stray rerun; delete it on purpose.
rule export_draft:
    input:
        summary="results/{run}/train/summary.json",
    output:
        config=protected("results/{run}/draft/config.json"),
        weights=protected("results/{run}/draft/model.safetensors"),
    log:
        "results/{run}/logs/export_draft.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        which=config["export"]["which"],
        verifier=verifier_name(),
        k=num_speculative_tokens(),
        drop=(
            "--drop-embedding"
            if config["export"]["drop_embedding"]
            else "--keep-embedding"
        ),
        outdir=lambda wc, output: os.path.dirname(output.config),
        code=code_digest("export_draft"),
    shell:
        f"{STAGE}.export_draft "
        "--summary {input.summary} --which {params.which} "
        "--verifier-name '{params.verifier}' --num-speculative-tokens {params.k} {params.drop} "
        "--out-dir {params.outdir} > {log} 2>&1"


# The card reports what the run measured, so it is written after evaluation (and serving).
rule model_card:
    input:
        config="results/{run}/draft/config.json",
        summary="results/{run}/train/summary.json",
        stats="results/{run}/data/stats.json",
        offline="results/{run}/eval/offline.json",
        serving=(
            "results/{run}/eval/serving.json"
            if config["benchmark_serving"]["enabled"]
            else []
        ),
    output:
        protected("results/{run}/draft/README.md"),
    log:
        "results/{run}/logs/model_card.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        which=config["export"]["which"],
        serving=lambda wc, input: f"--serving {input.serving}" if input.serving else "",
        tp=config["extract"]["tensor_parallel_size"],
        trust=trust_flag(),
        code=code_digest("model_card"),
    shell:
        f"{STAGE}.model_card "
        "--draft-config {input.config} --summary {input.summary} --which {params.which} "
        "--data-stats {input.stats} --offline {input.offline} {params.serving} "
        "--tensor-parallel-size {params.tp} {params.trust} --out {output} > {log} 2>&1"
