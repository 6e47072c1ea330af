# Off by default (the CPU embedded default stays fast); on in GPU presets. One job loads the target
# once and regenerates the training chats and the fixed evaluation prompts. Finished parts go to
# an undeclared directory, each written atomically and keyed by content hash, so a crash or a
# rerun after an unrelated change costs only the parts not yet written.
rule regenerate_responses:
    input:
        data=data_input(),
        model=target_input(),
        chat_template=chat_template_input(),
    output:
        chats=REGENERATED,
        eval_prompts="results/{run}/regenerated/eval_prompts.jsonl",
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
        data=config["data"]["path"],
        eval_prompts=config["regenerate"]["eval_prompts"],
        model=target_arg,
        revision=revision_flag(),
        trust=trust_flag(),
        max_samples=config["data"]["max_samples"] or 0,
        backend=config["regenerate"]["backend"],
        device=config["regenerate"]["device"],
        dtype=config["target"]["dtype"],
        tp=config["extract"]["tensor_parallel_size"],
        max_model_len=config["extract"]["max_model_len"],
        gpu_util=config["extract"]["gpu_memory_utilization"],
        eager="--enforce-eager" if config["extract"]["enforce_eager"] else "",
        turns=config["regenerate"]["turns"],
        temperature=config["regenerate"]["temperature"],
        top_p=config["regenerate"]["top_p"],
        max_new_tokens=config["regenerate"]["max_new_tokens"],
        seed=config["regenerate"]["seed"],
        modes=regenerate_modes(),
        template=regenerate_template_flag(),
        template_sha256=chat_template_sha256(),
        on_truncated=config["regenerate"]["on_truncated"],
        on_loop=config["regenerate"]["on_loop"],
        loop_ngram=config["regenerate"]["loop_ngram"],
        loop_share=config["regenerate"]["loop_min_distinct_share"],
        batch_size=config["regenerate"]["batch_size"],
        parts=lambda wc, output: os.path.join(os.path.dirname(output.chats), "parts"),
        code=code_digest("regenerate_responses"),
    shell:
        f"{VLLM_ENV} {STAGE}.regenerate_responses "
        "--data {params.data} --out {output.chats} --eval-prompts {params.eval_prompts} "
        "--eval-out {output.eval_prompts} --stats {output.stats} --parts-dir {params.parts} "
        "--model {params.model} {params.revision} {params.trust} --backend {params.backend} "
        "--device {params.device} --dtype {params.dtype} --tensor-parallel-size {params.tp} "
        "--max-model-len {params.max_model_len} --gpu-memory-utilization {params.gpu_util} {params.eager} "
        "--max-samples {params.max_samples} --turns {params.turns} --temperature {params.temperature} "
        "--top-p {params.top_p} --max-new-tokens {params.max_new_tokens} --seed {params.seed} "
        "--modes {params.modes:q} {params.template} --on-truncated {params.on_truncated} --on-loop {params.on_loop} "
        "--loop-ngram {params.loop_ngram} --loop-min-distinct-share {params.loop_share} "
        "--batch-size {params.batch_size} > {log} 2>&1"
