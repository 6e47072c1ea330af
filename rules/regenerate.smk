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
        engine=settings_flags("regenerate_responses", "engine"),
    params:
        **regenerate_params(
            config["data"]["path"],
            config["data"]["max_samples"] or 0,
            {},
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
        engine=settings_flags("regenerate_responses", "engine"),
    params:
        **regenerate_params(config["evaluate"]["prompts"], 0, EVAL_PROMPTS_SAMPLING),
    shell:
        REGENERATE_SHELL
