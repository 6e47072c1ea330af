# Checkpoints live in an undeclared directory beside the declared summary, so a killed job resumes
# from its last complete checkpoint instead of starting over, and a job rerun over a finished
# training of the same settings, data and code (an identical manifest rebuilt, --forcerun) takes its
# outputs from the finished checkpoints without a step. To retrain from scratch, delete results/RUN/train.
#
# Under a disk budget (extract.disk_budget_gib, docs/disk-budget.md) this one job also runs the
# extractor that makes the train shards while training reads and deletes them: train_draft starts
# it as its child (--producer, below). One job rather than a second rule or a group: the pair must
# run at the same time, on one node, beside one shard directory, and die together; a rule of its
# own would be a job Snakemake orders by files (it would wait for the training or run before it),
# and a group's members are still such jobs. The DAG and `snakemake -n` stay the same with or
# without a budget; the job reserves the extractor's GPUs beside its own, and under SLURM the pair
# runs in this one job on one node. With extract.replicas > 1 the replicas make the eval shards
# (and list their train batches); the train shards are made by this one extractor.
rule train_draft:
    input:
        unpack(get_budget_inputs),
        manifest=rules.gather_hidden_states.output.manifest,
        vocab=rules.vocab_mapping.output[0],
        model=get_target_input(),
        earlier=inputs_before(rules.gather_hidden_states, rules.vocab_mapping),
    output:
        summary="results/{run}/train/summary.json",
        metrics="results/{run}/train/metrics.jsonl",
    log:
        "results/{run}/logs/train_draft.log",
    benchmark:
        "results/{run}/benchmarks/train_draft.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: 2
    resources:
        gpu=config["train"]["gpus"]
        + (
            get_extract_gpus()
            if config["extract"]["disk_budget_gib"] is not None
            else 0
        ),
        # the extractor's command under a disk budget: what it makes is checked against the
        # manifest's settings, so (like where vLLM's files wait) it is a resource, no rerun trigger
        producer=get_budget_producer,
    params:
        model=get_target_arg,
        settings=get_setting_flags("train_draft"),
        launcher=(
            f"torchrun --standalone --nproc-per-node {config['train']['gpus']} -m"
            if config["train"]["gpus"] > 1
            else "python -m"
        ),
        outdir=lambda wc, output: os.path.dirname(output.summary),
        code=code_digest("train_draft"),
    shell:
        f"{STAGE_ENV} exec {{params.launcher}} eaglepipe.train_draft "
        "--manifest {input.manifest} --vocab {input.vocab} --model {params.model} "
        "--out-dir {params.outdir} {params.settings} {resources.producer} > {log} 2>&1"
