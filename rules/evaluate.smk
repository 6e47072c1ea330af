rule evaluate_offline:
    input:
        draft=rules.export_draft.output.record,
        manifest=rules.gather_hidden_states.output.manifest,
        model=get_target_input(),
        earlier=inputs_before(rules.export_draft, rules.gather_hidden_states),
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
        model=get_target_arg,
        draft=lambda wc, input: os.path.dirname(input.draft),
        k=config["evaluate"]["k"] or config["train"]["ttt_steps"],
        settings=get_setting_flags("evaluate", "offline"),
        code=code_digest("evaluate"),
    shell:
        f"{STAGE}.evaluate "
        "--draft {params.draft} --manifest {input.manifest} "
        "--split eval --model {params.model} --k {params.k} "
        "{params.settings} --out {output} > {log} 2>&1"


rule plot_report:
    input:
        metrics=rules.train_draft.output.metrics,
        stats=rules.prepare_data.output.stats,
        manifest=rules.gather_hidden_states.output.manifest,
        offline=rules.evaluate_offline.output[0],
        earlier=inputs_before(
            rules.train_draft,
            rules.prepare_data,
            rules.gather_hidden_states,
            rules.evaluate_offline,
        ),
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
        draft=rules.export_draft.output.record,
        eval=rules.prepare_data.output.eval,
        offline=rules.evaluate_offline.output[0],
        model=get_target_input(),
        earlier=inputs_before(
            rules.export_draft, rules.prepare_data, rules.evaluate_offline
        ),
    output:
        serving=report(
            "results/{run}/eval/serving.json",
            category="4. Evaluation",
            caption="../report/serving.rst",
        ),
        samples="results/{run}/eval/parity/eval.jsonl",
        no_train="results/{run}/eval/parity/train.jsonl",
    log:
        "results/{run}/logs/benchmark_serving.log",
    benchmark:
        "results/{run}/benchmarks/benchmark_serving.tsv"
    conda:
        "../envs/vllm.yaml"
    resources:
        gpu=config["extract"]["tensor_parallel_size"],
    params:
        model=get_target_arg,
        serve_model=config["target"]["deploy_name"] or config["target"]["model"],
        draft=lambda wc, input: os.path.dirname(input.draft),
        parity_k=lambda wc: get_parity_k(),
        settings=get_setting_flags(
            "benchmark_serving", overrides={"benchmark_serving.k": get_serving_ks()}
        ),
        code=code_digest("benchmark_serving"),
    shell:
        # the parity set is all held out: the extraction's train split is this empty file
        ": > {output.no_train} && "
        f"{VLLM_ENV} {STAGE}.benchmark_serving "
        "--model {params.model} --serve-model {params.serve_model:q} --draft {params.draft} "
        "--prompts {input.eval} --parity-k {params.parity_k} {params.settings} "
        "--out {output.serving} --parity-samples {output.samples} > {log} 2>&1"


# The target's hidden states on the exact sequences vLLM served in the parity window: the
# extraction rule itself, on the parity samples, with its own shard directory (eval/parity/shards).
use rule extract_hidden_states as extract_parity_hidden_states with:
    input:
        train=rules.benchmark_serving.output.no_train,
        eval=rules.benchmark_serving.output.samples,
        model=get_target_input(),
        earlier=inputs_before(rules.benchmark_serving),
    output:
        part="results/{run}/eval/parity/parts/replica-{i}-of-{r}.json",
    log:
        "results/{run}/logs/extract_parity_hidden_states.replica-{i}-of-{r}.log",
    benchmark:
        "results/{run}/benchmarks/extract_parity_hidden_states.replica-{i}-of-{r}.tsv"


rule evaluate_parity:
    input:
        draft=rules.export_draft.output.record,
        # one replica's part manifest covers the whole (small) parity set
        manifest=expand(
            rules.extract_parity_hidden_states.output.part,
            i=0,
            r=1,
            allow_missing=True,
        ),
        serving=rules.benchmark_serving.output.serving,
        model=get_target_input(),
        earlier=inputs_before(
            rules.export_draft,
            rules.extract_parity_hidden_states,
            rules.benchmark_serving,
        ),
    output:
        report(
            "results/{run}/eval/parity.json",
            category="4. Evaluation",
            caption="../report/parity.rst",
        ),
    log:
        "results/{run}/logs/evaluate_parity.log",
    conda:
        "../envs/eaglepipe.yaml"
    threads: 2
    params:
        model=get_target_arg,
        draft=lambda wc, input: os.path.dirname(input.draft),
        k=lambda wc: get_parity_k(),
        settings=get_setting_flags("evaluate", "parity"),
        code=code_digest("evaluate"),
    shell:
        f"{STAGE}.evaluate "
        "--draft {params.draft} --manifest {input.manifest} "
        "--split eval --model {params.model} --k {params.k} "
        "--parity {input.serving} {params.settings} --out {output} > {log} 2>&1"


rule plot_serving:
    input:
        serving=rules.benchmark_serving.output.serving,
        earlier=inputs_before(rules.benchmark_serving),
    output:
        report(
            "results/{run}/report/serving.svg",
            category="4. Evaluation",
            caption="../report/serving_plot.rst",
        ),
    log:
        "results/{run}/logs/plot_serving.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        code=code_digest("plots"),
    shell:
        f"{STAGE}.plots "
        "--serving {input.serving} --serving-out {output} > {log} 2>&1"
