# The target answers chats, with ONE engine load per job, in eaglepipe.regenerate_responses:
#   regenerate_responses      the training chats (regenerate.enabled; off in the CPU embedded
#                             default, which must stay fast; on in GPU presets), by regenerate.*;
#                             with evaluate.prompts set, the same engine then also answers the
#                             fixed evaluation prompts (below): one target load for both sets;
#   regenerate_eval_prompts   the fixed evaluation prompts alone, when regeneration is off.
# The fixed evaluation set (evaluate.prompts, e.g. MT-Bench and HumanEval) is answered greedily, first turn only,
# with benchmark_serving.max_tokens answer tokens, every answer kept, so the set is the same whatever
# the training data and its text is what the serving benchmark's target says.
# Finished parts go to an undeclared directory beside each output, each written atomically and
# keyed by content hash (of its set's own settings), so a crash, a rerun after an unrelated change or
# a change of only the other set's sampling costs only the parts not yet written.


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
# one job answers both sets: the regeneration's, when it runs and a fixed evaluation set is named
EVAL_WITH_CHATS = bool(
    config["regenerate"]["enabled"] and config["evaluate"]["prompts"]
)
# the target writes user turns of its own (regenerate.new_user_turns) before answering the chats
NEW_USER_TURNS = config["regenerate"]["new_user_turns"]["count"] > 0
# looping answers stopped early (regenerate.loop_stop_every)
LOOP_STOP = config["regenerate"]["loop_stop_every"] > 0
# the chat files among the fixed evaluation sets (the packages' sets are no job input)
EVAL_PROMPTS_SOURCE = [p for p in EVAL_PROMPT_SETS if not p.startswith("package:")]
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
    "{params.settings} {resources.engine}"
)
LOG = " > {log} 2>&1"


# The eval set's outputs and flags, when regenerate_responses answers it too. Its sampling goes
# as the stage's --eval-<key> flags (settings.py's "eval" group, rendered from
# EVAL_PROMPTS_SAMPLING); its paths as --eval-data/--eval-out/--eval-stats/--eval-parts-dir.
EVAL_OUTPUTS = (
    dict(
        eval_chats=REGENERATED_EVAL,
        eval_stats=report(
            "results/{run}/regenerated/eval_prompts_stats.json",
            category="4. Evaluation",
            caption="../report/regenerate_stats.rst",
        ),
    )
    if EVAL_WITH_CHATS
    else {}
)
EVAL_SHELL = (
    " --eval-data {params.eval_data:q} --eval-out {output.eval_chats} "
    "--eval-stats {output.eval_stats} --eval-parts-dir {params.eval_parts} {params.eval_settings}"
    if EVAL_WITH_CHATS
    else ""
)


rule regenerate_responses:
    input:
        data=get_data_input(),
        eval_data=EVAL_PROMPTS_SOURCE if EVAL_WITH_CHATS else [],
        model=get_target_input(),
        chat_template=get_chat_template_input(),
    output:
        **EVAL_OUTPUTS,
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
            *(["new_user_turns"] if NEW_USER_TURNS else []),
            *(["loop_stop"] if LOOP_STOP else []),
            overrides={"regenerate.modes": REGENERATE_MODES},
        ),
        eval_data=EVAL_PROMPT_SETS if EVAL_WITH_CHATS else "",
        eval_parts=lambda wc, output: (
            os.path.splitext(output.eval_chats)[0] + "-parts"
            if EVAL_WITH_CHATS
            else ""
        ),
        eval_settings=(
            get_setting_flags(
                "regenerate_responses", "eval", overrides=EVAL_PROMPTS_SAMPLING
            )
            if EVAL_WITH_CHATS
            else ""
        ),
    shell:
        REGENERATE_SHELL + EVAL_SHELL + LOG


# The eval set alone (regeneration off): its sampling given as the stage's own flags.
if not EVAL_WITH_CHATS:

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
            data=EVAL_PROMPT_SETS,
            max_samples=0,
            settings=get_setting_flags(
                "regenerate_responses",
                "answers",
                overrides={
                    "regenerate.modes": REGENERATE_MODES,
                    **EVAL_PROMPTS_SAMPLING,
                },
            ),
        shell:
            # each sample records the set it came from (prompt_set)
            f"{REGENERATE_SHELL} --prompt-sets{LOG}"


# the rule whose job answers the fixed evaluation set
EVAL_PROMPTS_RULE = (
    rules.regenerate_responses if EVAL_WITH_CHATS else rules.regenerate_eval_prompts
)
