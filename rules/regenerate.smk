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


REGENERATED = "results/{run}/regenerated/chats.jsonl"
REGENERATED_EVAL = "results/{run}/regenerated/eval_prompts.jsonl"
# The fixed evaluation set's answers: what the serving benchmark's target says to the same prompts
# (regenerate.* values given instead of the config's).
EVAL_PROMPTS_SAMPLING = {
    "regenerate.turns": "first",
    "regenerate.temperature": 0,
    "regenerate.top_p": 1,
    "regenerate.max_new_tokens": config["benchmark_serving"]["max_tokens"],
    "regenerate.on_truncated": "keep",
    "regenerate.on_loop": "keep",
    "regenerate.answers_per_conversation": 1,
    "regenerate.loop_retries": 0,
}
EVAL_PROMPTS_SOURCE = (
    config["evaluate"]["prompts"]
    if config["evaluate"]["prompts"]
    and not config["evaluate"]["prompts"].startswith("package:")
    else []
)
# regenerate.modes as the CLI takes them: data.chat_template_kwargs under each mode's own
REGENERATE_MODES = [
    {
        **m,
        "chat_template_kwargs": {
            **config["data"]["chat_template_kwargs"],
            **m["chat_template_kwargs"],
        },
    }
    for m in config["regenerate"]["modes"]
]
REGENERATE_GPUS = (
    config["extract"]["tensor_parallel_size"]
    if config["regenerate"]["backend"] == "vllm"
    else int(config["regenerate"]["device"] == "cuda")
)
# The parameters both rules share. How a job uses the machine is not among the params: the rules
# pass the group "engine" as a resource, which no Snakemake rerun trigger looks at, so changing it
# reruns nothing (as params it would rerun training and all after it); the parts' keys leave it
# out too.
REGENERATE_PARAMS = dict(
    model=get_target_arg,
    max_prompt_len=config["data"]["max_length"],
    template_sha256=get_chat_template_sha256(),
    parts=lambda wc, output: os.path.splitext(output.chats)[0] + "-parts",
    code=code_digest("regenerate_responses"),
)
REGENERATE_SHELL = (
    f"{VLLM_ENV} {STAGE}.regenerate_responses "
    "--data {params.data} --out {output.chats} --stats {output.stats} --parts-dir {params.parts} "
    "--model {params.model} --max-samples {params.max_samples} --max-prompt-len {params.max_prompt_len} "
    "{params.settings} {resources.engine} > {log} 2>&1"
)


rule regenerate_responses:
    input:
        data=get_data_input(),
        model=get_target_input(),
        chat_template=get_chat_template_input(),
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
        gpu=REGENERATE_GPUS,
        engine=get_setting_flags("regenerate_responses", "engine"),
    params:
        **REGENERATE_PARAMS,
        data=config["data"]["path"],
        max_samples=config["data"]["max_samples"] or 0,
        settings=get_setting_flags(
            "regenerate_responses",
            "answers",
            overrides={"regenerate.modes": REGENERATE_MODES},
        ),
    shell:
        REGENERATE_SHELL


rule regenerate_eval_prompts:
    input:
        data=EVAL_PROMPTS_SOURCE,
        model=get_target_input(),
        chat_template=get_chat_template_input(),
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
        gpu=REGENERATE_GPUS,
        engine=get_setting_flags("regenerate_responses", "engine"),
    params:
        **REGENERATE_PARAMS,
        data=config["evaluate"]["prompts"],
        max_samples=0,
        settings=get_setting_flags(
            "regenerate_responses",
            "answers",
            overrides={"regenerate.modes": REGENERATE_MODES, **EVAL_PROMPTS_SAMPLING},
        ),
    shell:
        REGENERATE_SHELL
