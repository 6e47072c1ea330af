"""Training under torchrun with 2 processes (DDP over gloo on CPU), and resume on another world size."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_stages import make_run, train_argv
from workflow import alive, children

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tiny_llama, tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("ddp"), tiny_llama)


def train(args, nproc):
    env = dict(os.environ, PYTHONPATH=str(REPO / "scripts"), OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + ["-m", "eaglepipe.train_draft", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def test_two_processes_train_checkpoint_once_and_resume_on_one(run, tmp_path):
    out = tmp_path / "train"
    flags = dict(max_steps=6, checkpoint_every=2, eval_every=2)
    log = train(train_argv(run, out, **flags), nproc=2)
    assert log.count("world size 2") == 2  # each rank names its device, then only rank 0 logs
    assert log.count("eval at step 2:") == 1 and log.count("train: 100%") == 1
    assert {"step-0000004", "step-0000006"} <= {p.name for p in (out / "checkpoints").glob("step-*")}
    saves = [l for l in log.splitlines() if "INFO eaglepipe.train_draft: checkpoint " in l]
    assert len(saves) == 3, saves  # steps 2, 4, 6: written once, by rank 0, not once per rank
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
    assert len(steps) == len(set(steps))  # one metrics row per step, not one per rank

    # as if the 2-process job died after step 4: resume it with one process
    shutil.rmtree(out / "checkpoints" / "step-0000006")
    (out / "summary.json").unlink()
    log = train(train_argv(run, out, **flags), nproc=1)
    assert "resuming from" in log and "saved with world size 2, now 1" in log, log[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["last"] == "checkpoints/step-0000006"


def test_each_rank_packing_its_rows_in_a_worker_process_trains_the_same_weights(run, tmp_path):
    from safetensors.torch import load_file
    import torch

    weights = {}
    for loader in ("thread", "process"):
        out = tmp_path / loader
        log = train(train_argv(run, out, max_steps=4, checkpoint_every=4, eval_every=4, row_loader=loader), nproc=2)
        assert "world size 2" in log and ("worker process" in log) == (loader == "process")
        weights[loader] = load_file(str(out / "checkpoints" / "step-0000004" / "model.safetensors"))
    a, b = weights["thread"], weights["process"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.e2e  # torchrun, killed, and its rerun: ~45 s
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_ranks_die_with_a_killed_torchrun_and_the_rerun_resumes(run, tmp_path):
    out = tmp_path / "train"
    args = train_argv(run, out, max_steps=100, checkpoint_every=5, eval_every=100)
    env = dict(os.environ, PYTHONPATH=str(REPO / "scripts"), OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 "-m", "eaglepipe.train_draft", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while not list((out / "checkpoints").glob("step-*")):  # training, past its first checkpoint
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        ranks = set(children(launcher.pid))
        assert len(ranks) == 2
        launcher.kill()  # kill -9 of torchrun alone
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(alive(r) for r in ranks), "a rank outlived its torchrun"
    finally:
        launcher.kill()
        for r in filter(alive, ranks):
            os.kill(r, signal.SIGKILL)
    assert not (out / "summary.json").exists()  # killed before the end
    log = train(args, nproc=2)  # the lock is free: the rerun resumes
    assert "resuming from" in log, log[-2000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 100
