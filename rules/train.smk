# Checkpoints live in an undeclared directory beside the declared summary, so a killed job resumes
# from its last complete checkpoint instead of starting over, and a job rerun over a finished
# training of the same settings, data and code (an identical manifest rebuilt, --forcerun) takes its
# outputs from the finished checkpoints without a step. To retrain from scratch, delete results/RUN/train.
rule train_draft:
    input:
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
        gpu=config["train"]["gpus"],
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
        "--out-dir {params.outdir} {params.settings} > {log} 2>&1"
