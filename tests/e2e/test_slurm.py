"""The tiny pipeline through profiles/slurm on a real SLURM cluster (CI: one node on localhost,
installed and started by .ci/slurm.sh): every rule but the local ones is a SLURM job, extraction
replicas are separate jobs, the results equal a local run's, and a cancelled job resumes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

import tiny
from workflow import REPO, STAGES, copy_workflow, differences, dry_run, snakemake, tiny_config, write_config

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

# Written by .ci/slurm.sh when it cannot install the SLURM packages: the skip reason.
UNAVAILABLE = Path("/tmp/eaglepipe-slurm-unavailable")
PROFILE = REPO / "profiles" / "slurm"
REPLICAS = 2
# Long enough for a cancellation to land between the first checkpoint and the last step.
TRAIN = {"max_steps": 300, "checkpoint_every": 10, "eval_every": 100}
# The plugin waits 40 s before its first status check (sensible on a busy cluster); tiny jobs
# take seconds. The local and the SLURM runs have the same thread cap (workflow.snakemake's
# --max-threads 1: the CI node has 2 CPUs, the rules ask up to 4), as floating-point results
# depend on the thread count.
SLURM = ("--workflow-profile", str(PROFILE), "--slurm-init-seconds-before-status-checks", "2")
ALL_JOBS = Counter(STAGES) + Counter({"extract_hidden_states": REPLICAS - 1})
LOCAL = {"gather_hidden_states", "all"}  # the Snakefile's localrules
SLURM_JOBS = Counter({rule: n for rule, n in ALL_JOBS.items() if rule not in LOCAL})
# per Snakemake run: one that hangs (a job state the plugin does not recognise) fails the test
TIMEOUT = 900


def require_slurm() -> None:
    """Skip (saying why) only when SLURM is not installed; an installed but dead cluster fails."""
    if shutil.which("sbatch") is None:
        why = UNAVAILABLE.read_text().strip() if UNAVAILABLE.exists() else "sbatch is not on PATH"
        pytest.skip(f"SLURM is not installed ({why}); as root, `bash .ci/slurm.sh` installs and "
                    "starts a one-node cluster")
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    assert "UP" in ping.stdout, ("SLURM is installed but its controller does not answer "
                                 f"(start it with `bash .ci/slurm.sh`): {ping.stdout}{ping.stderr}")


def run_id(output: str) -> str:
    """The plugin's id of a Snakemake run: the SLURM job name of all its jobs."""
    return re.search(r"SLURM run ID: (\S+)", output).group(1)


def sacct(run: str) -> list[dict[str, str]]:
    """SLURM's accounting records of the jobs of one run (rule and wildcards are in the comment)."""
    fields = ["JobIDRaw", "JobName", "Comment", "State", "Partition", "AllocCPUS", "AllocTRES"]
    out = subprocess.run(["sacct", "-X", "--parsable2", "--noheader", "--starttime", "now-2days",
                          "--name", run, f"--format={','.join(fields)}"],
                         capture_output=True, text=True, check=True).stdout
    rows = [dict(zip(fields, line.split("|"))) for line in out.splitlines()]
    for row in rows:
        row["rule"], row["wildcards"] = re.fullmatch(r"rule_(\w+?)_wildcards_(.*)", row["Comment"]).groups()
    return rows


def wait_for_accounting(run: str, jobs: int) -> list[dict[str, str]]:
    """slurmdbd stores a finished job's record shortly after slurmctld reports it."""
    for _ in range(30):
        rows = sacct(run)
        if len(rows) >= jobs and all(r["State"] not in ("PENDING", "RUNNING") for r in rows):
            return rows
        time.sleep(1)
    return rows


def workspace(ws: Path, data: Path) -> Path:
    copy_workflow(ws)
    cfg = tiny_config(data / "target", data / "chats.jsonl")
    cfg["extract"]["replicas"] = REPLICAS
    cfg["train"].update(TRAIN)
    write_config(ws, cfg)
    return ws


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Target and chats shared by all workspaces: the target's path is recorded in the shards."""
    data = tmp_path_factory.mktemp("data")
    tiny.make_llama(data / "target")
    tiny.make_chats(data / "chats.jsonl", n=24)
    return data


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """(local workspace, SLURM workspace, SLURM run's output): one config run both ways at once
    (the SLURM run mostly waits for the scheduler)."""
    require_slurm()
    local = workspace(tmp_path_factory.mktemp("local"), data)
    cluster = workspace(tmp_path_factory.mktemp("slurm"), data)
    with ThreadPoolExecutor(1) as pool:
        local_run = pool.submit(snakemake, local)
        p = snakemake(cluster, *SLURM, timeout=TIMEOUT)
        local_run.result()
    return local, cluster, p.stdout + p.stderr


def test_dry_run_shows_the_plan(tmp_path, data):
    """`snakemake -n` with the profile lists the jobs with the profile's resources; it needs no
    cluster and submits nothing."""
    ws = workspace(tmp_path, data)
    jobs, _, _ = dry_run(ws, *SLURM)
    assert jobs == ALL_JOBS
    p = snakemake(ws, "-n", *SLURM)
    extraction = [block for block in p.stdout.split("\n\n") if "rule extract_hidden_states:" in block]
    assert len(extraction) == REPLICAS
    assert all("runtime=1440" in block and "mem_mb_per_cpu=12000" in block for block in extraction)
    assert not (ws / ".snakemake" / "slurm_logs").exists()


def test_every_job_ran_on_slurm(runs):
    _, cluster, output = runs
    rows = wait_for_accounting(run_id(output), sum(SLURM_JOBS.values()))
    assert Counter(r["rule"] for r in rows) == SLURM_JOBS, rows
    assert {r["State"] for r in rows} == {"COMPLETED"}, rows
    # one job per replica, each its own slice; CPU stages on the cpu partition, no GPU asked for
    assert sorted(r["wildcards"] for r in rows if r["rule"] == "extract_hidden_states") == [
        f"tiny_{i}_{REPLICAS}" for i in range(REPLICAS)]
    assert {r["Partition"] for r in rows} == {"cpu"}
    assert not [r for r in rows if "gres/gpu" in r["AllocTRES"]], rows
    # gather_hidden_states and all ran on the submitting host
    for rule in LOCAL:
        assert f"localrule {rule}:" in output
    # each job's log and benchmark landed in the workflow's results
    run = cluster / "results" / "tiny"
    for rule in SLURM_JOBS:
        assert [log for log in run.glob(f"logs/{rule}*.log") if log.stat().st_size], rule
    for i in range(REPLICAS):
        bench = run / "benchmarks" / f"extract_hidden_states.replica-{i}-of-{REPLICAS}.tsv"
        assert bench.read_text().startswith("s\t")
    assert (run / "benchmarks" / "train_draft.tsv").read_text().startswith("s\t")


def test_slurm_outputs_equal_a_local_run(runs):
    """Shards (the manifest's checksums), draft tensors, metrics and offline evaluation."""
    local, cluster, _ = runs
    assert not (found := differences(cluster / "results/tiny", local / "results/tiny")), "\n".join(found)


def test_gpu_extraction_asks_the_gpu_partition_for_tp_gpus(runs, tmp_path):
    """A vLLM config: each replica's sbatch asks the GPU partition for TP GPUs. The CI cluster
    has no GPUs, so sbatch (after parsing the options) refuses, and the plugin shows its call."""
    _, cluster, _ = runs
    ws = tmp_path / "ws"
    shutil.copytree(cluster, ws, symlinks=True)
    cfg = yaml.safe_load((ws / "config/config.yaml").read_text())
    cfg["extract"].update(backend="vllm", tensor_parallel_size=8)
    write_config(ws, cfg)
    p = snakemake(ws, *SLURM, f"results/tiny/hidden_states/parts/replica-0-of-{REPLICAS}.json", check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    call = re.search(r"sbatch call:\s+(sbatch .*)", out).group(1)
    for option in ("-p gpu", "--nodes=1", "--gpus=8", "--cpus-per-gpu=8", "--mem-per-cpu 12000", "-t 1440"):
        assert f" {option} " in call, (option, call)
    assert "Invalid generic resource (gres) specification" in out


def test_cancelled_training_job_resumes(runs, tmp_path):
    """scancel the training job after its first checkpoint: the run fails naming the job and its
    SLURM log; the rerun redoes nothing upstream, resumes from the checkpoint and trains what an
    uninterrupted run does (the stages after training under SLURM: test_every_job_ran_on_slurm)."""
    local, cluster, _ = runs
    ws = tmp_path / "ws"
    shutil.copytree(cluster, ws, symlinks=True)
    train = ws / "results/tiny/train"
    shutil.rmtree(train)
    target = "results/tiny/train/summary.json"
    prefix = f"eaglepipe-cancel-{os.getpid()}"
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(snakemake, ws, *SLURM, "--slurm-jobname-prefix", prefix, target,
                          check=False, timeout=TIMEOUT)
        while not list(train.glob("checkpoints/step-*/COMPLETE")) and not run.done():
            time.sleep(0.1)
        queue = subprocess.run(["squeue", "-h", "-o", "%i|%j|%k"], capture_output=True, text=True,
                               check=True).stdout
        jobs = [job for job, name, comment in (line.split("|") for line in queue.splitlines())
                if name.startswith(prefix) and comment.startswith("rule_train_draft")]
        assert len(jobs) == 1, f"no running training job to cancel: {queue}"
        job = jobs[0]
        subprocess.run(["scancel", job], check=True)
        p = run.result()
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    slurm_log = ws / ".snakemake/slurm_logs/rule_train_draft/tiny" / f"{job}.log"
    assert f"SLURM-job '{job}' failed, SLURM status is: 'CANCELLED'" in out, out[-3000:]
    assert str(slurm_log) in out and slurm_log.exists(), out[-3000:]
    assert [r["State"].split()[0] for r in wait_for_accounting(run_id(out), 1)] == ["CANCELLED"]
    # the job's undeclared checkpoint directory survives its failure; training did not finish
    kept = sorted(train.glob("checkpoints/step-*/COMPLETE"))
    assert kept and not (train / "summary.json").exists()

    p = snakemake(ws, *SLURM, target, timeout=TIMEOUT)
    rerun = wait_for_accounting(run_id(p.stdout + p.stderr), 1)
    assert Counter(r["rule"] for r in rerun) == {"train_draft": 1}, rerun
    log = (ws / "results/tiny/logs/train_draft.log").read_text()
    resumed = re.search(r"resuming from \S+step-(\d+) at step (\d+)", log)
    assert resumed, log[-2000:]
    assert f"step-{resumed.group(1)}" == kept[-1].parent.name
    assert 0 < int(resumed.group(2)) < TRAIN["max_steps"]
    assert not (found := differences(ws / "results/tiny", local / "results/tiny", ("train", "hidden_states"))), (
        "\n".join(found))
