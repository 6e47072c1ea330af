# One job per replica loads the target once and writes all shards of its slice of the batches.
# The job declares only a small part-manifest; the shards go to an undeclared directory, written
# atomically, so a crash costs one model load, not the work done (Snakemake deletes declared
# outputs of failed jobs, which would throw finished shards away).
rule extract_hidden_states:
    input:
        train=RUN + "/data/train.jsonl",
        eval=RUN + "/data/eval.jsonl",
        model=target_input(),
    output:
        part=RUN + "/hidden_states/parts/replica-{i}-of-{r}.json",
    log:
        RUN + "/logs/extract_hidden_states.replica-{i}-of-{r}.log",
    benchmark:
        RUN + "/benchmarks/extract_hidden_states.replica-{i}-of-{r}.tsv"
    wildcard_constraints:
        i=r"\d+",
        r=r"\d+",
    params:
        model=config["target"]["model"],
        revision=revision_flag(),
        trust=trust_flag(),
        backend=config["extract"]["backend"],
        device=config["extract"]["device"],
        tp=config["extract"]["tensor_parallel_size"],
        layer_ids=layer_ids_arg(),
        batch_size=config["extract"]["batch_size"],
        storage=config["extract"]["storage_dtype"],
        dtype=config["target"]["dtype"],
        max_model_len=config["extract"]["max_model_len"],
        gpu_util=config["extract"]["gpu_memory_utilization"],
        eager="--enforce-eager" if config["extract"]["enforce_eager"] else "",
        shard_dir=RUN + "/hidden_states/shards",
        code=code_digest("extract"),
    threads: 4
    resources:
        gpu=extract_gpus(),
    conda:
        "../envs/vllm.yaml" if config["extract"]["backend"] == "vllm" else "../envs/eaglepipe.yaml"
    shell:
        "{PY} eaglepipe.extract_hidden_states --train {input.train} --eval {input.eval} "
        "--model {params.model} {params.revision} {params.trust} --backend {params.backend} "
        "--device {params.device} --tensor-parallel-size {params.tp} --layer-ids {params.layer_ids} "
        "--batch-size {params.batch_size} --storage-dtype {params.storage} --dtype {params.dtype} "
        "--max-model-len {params.max_model_len} --gpu-memory-utilization {params.gpu_util} "
        "{params.eager} --shard-dir {params.shard_dir} --replica {wildcards.i} "
        "--replicas {wildcards.r} --out {output.part} > {log} 2>&1"


rule gather_hidden_states:
    input:
        replica_parts(),
    output:
        manifest=RUN + "/hidden_states/manifest.json",
    log:
        RUN + "/logs/gather_hidden_states.log",
    params:
        code=code_digest("gather"),
    conda:
        "../envs/eaglepipe.yaml"
    shell:
        "{PY} eaglepipe.gather_manifest --out {output.manifest} {input} > {log} 2>&1"
