# Checkpoints live in an undeclared directory beside the declared summary, so a killed job resumes
# from its last complete checkpoint instead of starting over, and a job rerun over a finished
# training of the same settings, data and code (an identical manifest rebuilt, --forcerun) takes its
# outputs from the finished checkpoints without a step. To retrain from scratch, delete results/RUN/train.
rule train_draft:
    input:
        manifest=rules.gather_hidden_states.output.manifest,
        vocab=rules.vocab_mapping.output[0],
        model=target_input(),
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
        model=target_arg,
        trust=trust_flag(),
        ttt=config["train"]["ttt_steps"],
        decay=config["train"]["ttt_step_loss_decay"],
        optimizer=f"--optimizer {config['train']['optimizer']}"
        + (
            f" --muon-weight-decay {config['train']['muon_weight_decay']}"
            if config["train"]["muon_weight_decay"] is not None
            else ""
        ),
        lm_head=config["train"]["lm_head"],
        lr=config["train"]["lr"],
        wd=config["train"]["weight_decay"],
        warmup=config["train"]["warmup_steps"],
        steps=config["train"]["max_steps"],
        batch_tokens=config["train"]["batch_tokens"],
        shuffle_buffer=config["train"]["shuffle_buffer_gib"],
        eval_every=config["train"]["eval_every"],
        ckpt_every=config["train"]["checkpoint_every"],
        loss=config["train"]["loss"],
        seed=config["train"]["seed"],
        buckets=config["evaluate"]["context_buckets"],
        select_by=config["evaluate"]["select_by"],
        draft=f"--draft-architecture {config['draft']['architecture']} --draft-layers {config['draft']['layers']}"
        + (
            f" --draft-mlp-width {config['draft']['mlp_width']}"
            if config["draft"]["mlp_width"]
            else ""
        ),
        launcher=(
            f"torchrun --standalone --nproc-per-node {config['train']['gpus']} -m"
            if config["train"]["gpus"] > 1
            else "python -m"
        ),
        outdir=lambda wc, output: os.path.dirname(output.summary),
        code=code_digest("train_draft"),
    shell:
        f"{STAGE_ENV} exec {{params.launcher}} eaglepipe.train_draft "
        "--manifest {input.manifest} --vocab {input.vocab} --model {params.model} {params.trust} "
        "--out-dir {params.outdir} --ttt-steps {params.ttt} --ttt-step-loss-decay {params.decay} "
        "{params.optimizer} --lm-head {params.lm_head} --lr {params.lr} --weight-decay {params.wd} "
        "--warmup-steps {params.warmup} "
        "--max-steps {params.steps} --batch-tokens {params.batch_tokens} --shuffle-buffer-gib {params.shuffle_buffer} "
        "--eval-every {params.eval_every} --checkpoint-every {params.ckpt_every} "
        "--loss {params.loss} --seed {params.seed} {params.draft} "
        "--context-buckets {params.buckets} --select-by {params.select_by:q} > {log} 2>&1"
