rule build_target:
    output:
        directory(config["target"]["model"]),
    log:
        "results/logs/build_target.log",
    benchmark:
        "results/benchmarks/build_target.tsv"
    params:
        recipe=config["target"]["build"],
        code=code_digest("build_target"),
    threads: 2
    conda:
        "../envs/eaglepipe.yaml"
    shell:
        "{PY} eaglepipe.build_target --recipe {params.recipe} --out {output} > {log} 2>&1"


rule prepare_data:
    input:
        data=data_input(),
        model=target_input(),
    output:
        train=RUN + "/data/train.jsonl",
        eval=RUN + "/data/eval.jsonl",
        stats=report(
            RUN + "/data/stats.json", category="1. Data", caption="../report/data_stats.rst"
        ),
        token_freq=RUN + "/data/token_freq.safetensors",
    log:
        RUN + "/logs/prepare_data.log",
    benchmark:
        RUN + "/benchmarks/prepare_data.tsv"
    params:
        data=config["data"]["path"],
        model=config["target"]["model"],
        max_samples=config["data"]["max_samples"] or 0,
        max_length=config["data"]["max_length"],
        too_long=config["data"]["too_long"],
        eval_fraction=config["data"]["eval_fraction"],
        seed=config["data"]["seed"],
        trust=trust_flag(),
        revision=revision_flag(),
        outdir=RUN + "/data",
        code=code_digest("prepare_data"),
    threads: 2
    conda:
        "../envs/eaglepipe.yaml"
    shell:
        "{PY} eaglepipe.prepare_data --data {params.data} --model {params.model} {params.revision} "
        "{params.trust} --out-dir {params.outdir} --max-samples {params.max_samples} "
        "--max-length {params.max_length} --too-long {params.too_long} "
        "--eval-fraction {params.eval_fraction} --seed {params.seed} > {log} 2>&1"


rule vocab_mapping:
    input:
        token_freq=RUN + "/data/token_freq.safetensors",
    output:
        RUN + "/data/vocab_mapping.safetensors",
    log:
        RUN + "/logs/vocab_mapping.log",
    params:
        size=config["draft"]["vocab_size"],
        code=code_digest("vocab_mapping"),
    conda:
        "../envs/eaglepipe.yaml"
    shell:
        "{PY} eaglepipe.vocab_mapping --token-freq {input.token_freq} "
        "--draft-vocab-size {params.size} --out {output} > {log} 2>&1"
