# The target answers chats with one engine load per rule, both running eaglepipe.regenerate_responses:
#   regenerate_responses      the training chats (regenerate.enabled; off in the CPU embedded
#                             default, which must stay fast; on in GPU presets), by regenerate.*;
#   regenerate_eval_prompts   the fixed evaluation prompts (evaluate.prompts, e.g. MT-Bench):
#                             greedy, first turn, benchmark_serving.max_tokens answer tokens, every
#                             answer kept, so the set is the same whatever the training data and
#                             its text is what the serving benchmark's target says.
# Finished parts go to an undeclared directory beside the output, each written atomically and
# keyed by content hash, so a crash or a rerun after an unrelated change costs only the parts not
# yet written.


def regenerate_params(data, max_samples, sampling):
    """Every parameter of one regeneration job; `sampling` holds the answer settings."""
    rg = config["regenerate"]
    return dict(
        data=data,
        model=target_arg,
        revision=revision_flag(),
        trust=trust_flag(),
        max_samples=max_samples,
        backend=rg["backend"],
        device=rg["device"],
        dtype=config["target"]["dtype"],
        tp=config["extract"]["tensor_parallel_size"],
        max_model_len=config["extract"]["max_model_len"],
        gpu_util=config["extract"]["gpu_memory_utilization"],
        eager="--enforce-eager" if config["extract"]["enforce_eager"] else "",
        seed=rg["seed"],
        modes=regenerate_modes(),
        template=regenerate_template_flag(),
        template_sha256=chat_template_sha256(),
        loop_ngram=rg["loop_ngram"],
        loop_share=rg["loop_min_distinct_share"],
        batch_size=rg["batch_size"],
        parts=lambda wc, output: os.path.splitext(output.chats)[0] + "-parts",
        code=code_digest("regenerate_responses"),
        **sampling,
    )


REGENERATE_SHELL = (
    f"{VLLM_ENV} {STAGE}.regenerate_responses "
    "--data {params.data} --out {output.chats} --stats {output.stats} --parts-dir {params.parts} "
    "--model {params.model} {params.revision} {params.trust} --backend {params.backend} "
    "--device {params.device} --dtype {params.dtype} --tensor-parallel-size {params.tp} "
    "--max-model-len {params.max_model_len} --gpu-memory-utilization {params.gpu_util} {params.eager} "
    "--max-samples {params.max_samples} --turns {params.turns} --temperature {params.temperature} "
    "--top-p {params.top_p} --max-new-tokens {params.max_new_tokens} --seed {params.seed} "
    "--modes {params.modes:q} {params.template} --on-truncated {params.on_truncated} --on-loop {params.on_loop} "
    "--loop-ngram {params.loop_ngram} --loop-min-distinct-share {params.loop_share} "
    "--batch-size {params.batch_size} > {log} 2>&1"
)


rule regenerate_responses:
    input:
        data=data_input(),
        model=target_input(),
        chat_template=chat_template_input(),
    output:
        chats=REGENERATED,
        stats=report(
            "results/{run}/regenerated/stats.json",
            category="1. Data",
            caption="../report/regenerate_stats.rst",
        ),
    log:
        "results/{run}/logs/regenerate_responses.log",
    benchmark:
        "results/{run}/benchmarks/regenerate_responses.tsv"
    conda:
        "../envs/vllm.yaml"
        if config["regenerate"]["backend"] == "vllm"
        else "../envs/eaglepipe.yaml"
    threads: 4
    resources:
        gpu=regenerate_gpus(),
    params:
        **regenerate_params(
            config["data"]["path"],
            config["data"]["max_samples"] or 0,
            {k: config["regenerate"][k] for k in REGENERATE_SAMPLING},
        ),
    shell:
        REGENERATE_SHELL


rule regenerate_eval_prompts:
    input:
        data=eval_prompts_source_input(),
        model=target_input(),
        chat_template=chat_template_input(),
    output:
        chats=REGENERATED_EVAL,
        stats=report(
            "results/{run}/regenerated/eval_prompts_stats.json",
            category="4. Evaluation",
            caption="../report/regenerate_stats.rst",
        ),
    log:
        "results/{run}/logs/regenerate_eval_prompts.log",
    benchmark:
        "results/{run}/benchmarks/regenerate_eval_prompts.tsv"
    conda:
        "../envs/vllm.yaml"
        if config["regenerate"]["backend"] == "vllm"
        else "../envs/eaglepipe.yaml"
    threads: 4
    resources:
        gpu=regenerate_gpus(),
    params:
        **regenerate_params(config["evaluate"]["prompts"], 0, EVAL_PROMPTS_SAMPLING),
    shell:
        REGENERATE_SHELL
