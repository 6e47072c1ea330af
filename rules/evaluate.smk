rule evaluate_offline:
    input:
        draft="results/{run}/draft/model.safetensors",
        manifest="results/{run}/hidden_states/manifest.json",
        model=target_input(),
    output:
        report(
            "results/{run}/eval/offline.json",
            category="4. Evaluation",
            caption="../report/offline_eval.rst",
        ),
    log:
        "results/{run}/logs/evaluate_offline.log",
    conda:
        "../envs/eaglepipe.yaml"
    threads: 2
    params:
        model=target_arg,
        trust=trust_flag(),
        draft=lambda wc, input: os.path.dirname(input.draft),
        k=config["evaluate"]["k"] or config["train"]["ttt_steps"],
        code=code_digest("evaluate"),
    shell:
        f"{STAGE}.evaluate "
        "--draft {params.draft} --manifest {input.manifest} "
        "--split eval --model {params.model} {params.trust} --k {params.k} "
        "--out {output} > {log} 2>&1"


rule plot_report:
    input:
        metrics="results/{run}/train/metrics.jsonl",
        stats="results/{run}/data/stats.json",
        manifest="results/{run}/hidden_states/manifest.json",
        offline="results/{run}/eval/offline.json",
    output:
        training=report(
            "results/{run}/report/training.svg",
            category="3. Training",
            caption="../report/training.rst",
        ),
        data=report(
            "results/{run}/report/data_stats.svg",
            category="1. Data",
            caption="../report/data_stats.rst",
        ),
    log:
        "results/{run}/logs/plot_report.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        code=code_digest("plots"),
    shell:
        f"{STAGE}.plots "
        "--metrics {input.metrics} --stats {input.stats} "
        "--manifest {input.manifest} --offline {input.offline} "
        "--training-out {output.training} --data-out {output.data} > {log} 2>&1"


rule benchmark_serving:
    input:
        draft="results/{run}/draft/config.json",
        eval="results/{run}/data/eval.jsonl",
        offline="results/{run}/eval/offline.json",
        model=target_input(),
    output:
        report(
            "results/{run}/eval/serving.json",
            category="4. Evaluation",
            caption="../report/serving.rst",
        ),
    log:
        "results/{run}/logs/benchmark_serving.log",
    conda:
        "../envs/vllm.yaml"
    resources:
        gpu=config["extract"]["tensor_parallel_size"],
    params:
        model=target_arg,
        trust=trust_flag(),
        draft=lambda wc, input: os.path.dirname(input.draft),
        k=num_speculative_tokens(),
        tp=config["extract"]["tensor_parallel_size"],
        n=config["benchmark_serving"]["num_prompts"],
        max_tokens=config["benchmark_serving"]["max_tokens"],
        code=code_digest("benchmark_serving"),
    shell:
        f"{VLLM_ENV} {STAGE}.benchmark_serving "
        "--model {params.model} {params.trust} "
        "--draft {params.draft} --prompts {input.eval} --num-prompts {params.n} "
        "--max-tokens {params.max_tokens} --k {params.k} --tensor-parallel-size {params.tp} "
        "--out {output} > {log} 2>&1"
