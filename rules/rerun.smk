# The rerun machinery: what makes Snakemake rerun every job whose result a changed or remade input
# invalidates, also when a job failed or was killed half-way (the fix for stale results).
from snakemake.io import is_flagged, strip_wildcard_constraints


def inputs_before(*producers):
    """Input function, named ``earlier`` in the rules that read other rules' outputs: what the
    jobs of ``producers`` read, and (through their own ``earlier``) what every job before them read.

    Snakemake reruns a job whose output exists only when one of its inputs is newer than that output
    (or its params, code, ... changed), and rebuilds a missing intermediate file only for a job that
    has to run (snakemake 9.27.1, dag.py ``update_needrun``). A job that fails or is killed after its
    inputs were remade has lost its outputs, so a request for one later file (``snakemake
    results/RUN/eval/offline.json``) saw only old or missing inputs and said "Nothing to be done"
    over a result of the old ones. Among the earlier inputs the remade file is newer than the
    requested one: the request reruns, and Snakemake rebuilds the missing files on the way (the
    default target requests them as well, every_output). The producers' side outputs that nothing
    after them reads (data/stats.json) are not among them, so editing one still reruns only its
    readers.
    """

    def earlier(wildcards):
        found = {}
        for producer in producers:
            for item in producer.input:
                files = (
                    item(wildcards)
                    if callable(item)
                    else (
                        expand(item, **dict(wildcards.items())) if "{" in item else item
                    )
                )
                if isinstance(files, dict):  # unpack(): named inputs
                    files = [
                        f
                        for v in files.values()
                        for f in ([v] if isinstance(v, str) else v)
                    ]
                for f in [files] if isinstance(files, str) else files:
                    found.setdefault(str(f), f)
        return list(found.values())

    earlier.producers = {producer.rule.name for producer in producers}
    return earlier


def check_earlier_inputs(all_rules):
    """Stops the workflow as it loads when a rule reads another rule's output without naming that rule
    in its ``earlier`` input (inputs_before): without it a request for one file after a failed job
    can call a stale result up to date, and no run shows it until that happens. Inputs given by a
    function are known only per job and are not checked; an ancient input never reruns its reader;
    a producer that reads no files has nothing for ``earlier`` to add."""
    producer_of = {
        strip_wildcard_constraints(f): producer.name
        for producer in all_rules
        if producer.input
        for f in producer.output
    }
    # rules without outputs (all) only request files, and never call anything up to date
    for reader in (r for r in all_rules if r.output):
        read = {
            producer_of[str(f)]
            for f in reader.input
            if not callable(f)
            and str(f) in producer_of
            and not is_flagged(f, "ancient")
        }
        named = getattr(reader.input.get("earlier"), "producers", set())
        if read - named:
            # lineno counts lines of the Python Snakemake compiled the file to
            line = workflow.linemaps.get(reader.snakefile, {}).get(
                reader.lineno, reader.lineno
            )
            raise WorkflowError(
                f"{reader.snakefile}:{line}: rule {reader.name} reads the output of "
                f"{', '.join(sorted(read - named))} but its input `earlier` does not name "
                f"{'it' if len(read - named) == 1 else 'them'}: add "
                f"earlier=inputs_before({', '.join(f'rules.{r}' for r in sorted(read | named))})"
            )


def every_output():
    """The deliverables and every intermediate output, all requested by ``rule all``.

    Snakemake rebuilds a missing intermediate file only when a job that reads it has to run
    (snakemake 9.27.1, dag.py ``update_needrun``: the missing-output check is made for target jobs,
    other jobs are reached through the needrun ones). A job killed after a setting changed has
    lost its outputs (Snakemake removes them when the job starts and when it fails), while the
    deliverables made with the old settings are still there and their own rules unchanged: a
    rerun said "Nothing to be done" over them. As targets, the missing files rerun their job and
    everything after it.
    """
    run = config["run_name"]
    intermediate = get_replica_part_files(run)
    producers = [
        rules.prepare_data,
        rules.vocab_mapping,
        rules.gather_hidden_states,
        rules.train_draft,
    ]
    if config["regenerate"]["enabled"]:
        producers.append(rules.regenerate_responses)
    if config["benchmark_serving"]["enabled"]:
        producers += [rules.benchmark_serving, rules.extract_parity_hidden_states]
    for r in producers:
        # the parity set is extracted by one replica (rule evaluate_parity)
        intermediate += expand(r.output, run=run, i=0, r=1)
    return final_outputs() + intermediate


def final_outputs():
    out = [
        "draft/export.json",
        "draft/README.md",
        "summary.json",
        "eval/offline.json",
        "report/training.svg",
        "report/data_stats.svg",
    ]
    if config["benchmark_serving"]["enabled"]:
        out += ["eval/serving.json", "eval/parity.json", "report/serving.svg"]
    return expand("results/{run}/{path}", run=config["run_name"], path=out)
