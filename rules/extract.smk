# One job per replica loads the target once and writes all shards of its slice of the batches.
# The job declares only a small part-manifest; the shards go to an undeclared directory, written
# atomically, so a crash costs one model load, not the work done (Snakemake deletes declared
# outputs of failed jobs, which would throw finished shards away).
rule extract_hidden_states:
    input:
        train=rules.prepare_data.output.train,
        eval=rules.prepare_data.output.eval,
        model=get_target_input(),
        earlier=inputs_before(rules.prepare_data),
    output:
        part="results/{run}/hidden_states/parts/replica-{i}-of-{r}.json",
    log:
        "results/{run}/logs/extract_hidden_states.replica-{i}-of-{r}.log",
    benchmark:
        "results/{run}/benchmarks/extract_hidden_states.replica-{i}-of-{r}.tsv"
    conda:
        "../envs/vllm.yaml"
        if config["extract"]["backend"] == "vllm"
        else "../envs/eaglepipe.yaml"
    threads: 4
    resources:
        gpu=get_extract_gpus(),
        # where vLLM's files wait changes no shard (RESULT_NEUTRAL in extract_hidden_states.py): a
        # resource, which no rerun trigger looks at, so moving it reruns nothing
        staging=get_setting_flags("extract_hidden_states", "staging"),
    params:
        model=get_target_arg,
        settings=get_setting_flags("extract_hidden_states", "shards"),
        shard_dir=lambda wc, output: os.path.join(
            os.path.dirname(os.path.dirname(output.part)), "shards"
        ),
        code=code_digest("extract_hidden_states"),
    shell:
        f"{VLLM_ENV} {STAGE}.extract_hidden_states "
        "--train {input.train} --eval {input.eval} --model {params.model} {params.settings} "
        "{resources.staging} --shard-dir {params.shard_dir} --replica {wildcards.i} "
        "--replicas {wildcards.r} --out {output.part} > {log} 2>&1"


rule gather_hidden_states:
    input:
        parts=get_replica_parts,
        earlier=inputs_before(rules.extract_hidden_states),
    output:
        manifest="results/{run}/hidden_states/manifest.json",
    log:
        "results/{run}/logs/gather_hidden_states.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        code=code_digest("gather_manifest"),
    shell:
        f"{STAGE}.gather_manifest " "--out {output.manifest} {input.parts} > {log} 2>&1"
