rule evaluate_offline:
    input:
        draft=RUN + "/draft/model.safetensors",
        manifest=RUN + "/hidden_states/manifest.json",
        model=target_input(),
    output:
        report(
            RUN + "/eval/offline.json",
            category="4. Evaluation",
            caption="../report/offline_eval.rst",
        ),
    log:
        RUN + "/logs/evaluate_offline.log",
    params:
        model=config["target"]["model"],
        trust=trust_flag(),
        draft=RUN + "/draft",
        k=config["evaluate"]["k"] or config["train"]["ttt_steps"],
        code=code_digest("evaluate"),
    threads: 2
    conda:
        "../envs/eaglepipe.yaml"
    shell:
        "{PY} eaglepipe.evaluate --draft {params.draft} --manifest {input.manifest} "
        "--split eval --model {params.model} {params.trust} --k {params.k} "
        "--out {output} > {log} 2>&1"


rule plot_report:
    input:
        metrics=RUN + "/train/metrics.jsonl",
        stats=RUN + "/data/stats.json",
        manifest=RUN + "/hidden_states/manifest.json",
        offline=RUN + "/eval/offline.json",
    output:
        training=report(
            RUN + "/report/training.svg",
            category="3. Training",
            caption="../report/training.rst",
        ),
        data=report(
            RUN + "/report/data_stats.svg",
            category="1. Data",
            caption="../report/data_stats.rst",
        ),
    log:
        RUN + "/logs/plot_report.log",
    params:
        code=code_digest("plots"),
    conda:
        "../envs/eaglepipe.yaml"
    shell:
        "{PY} eaglepipe.plots --metrics {input.metrics} --stats {input.stats} "
        "--manifest {input.manifest} --offline {input.offline} "
        "--training-out {output.training} --data-out {output.data} > {log} 2>&1"


rule benchmark_serving:
    input:
        draft=RUN + "/draft/config.json",
        eval=RUN + "/data/eval.jsonl",
        offline=RUN + "/eval/offline.json",
    output:
        report(
            RUN + "/eval/serving.json", category="4. Evaluation", caption="../report/serving.rst"
        ),
    log:
        RUN + "/logs/benchmark_serving.log",
    params:
        model=config["target"]["model"],
        trust=trust_flag(),
        draft=RUN + "/draft",
        k=num_speculative_tokens(),
        tp=config["extract"]["tensor_parallel_size"],
        n=config["benchmark_serving"]["num_prompts"],
        max_tokens=config["benchmark_serving"]["max_tokens"],
        code=code_digest("benchmark_serving"),
    resources:
        gpu=config["extract"]["tensor_parallel_size"],
    conda:
        "../envs/vllm.yaml"
    shell:
        "{PY} eaglepipe.benchmark_serving --model {params.model} {params.trust} "
        "--draft {params.draft} --prompts {input.eval} --num-prompts {params.n} "
        "--max-tokens {params.max_tokens} --k {params.k} --tensor-parallel-size {params.tp} "
        "--out {output} > {log} 2>&1"
