"""Training through a disk budget with 2 processes (torchrun, DDP over gloo on CPU, as rule
train_draft launches train.gpus > 1), stage by stage without Snakemake: the shards on disk stay
within the budget plus the one being written, every sample is trained as often as by the same run
without the budget, the same order gives the same draft, kill -9 of rank 0 or of every process of
torchrun leaves no extractor behind, and a run killed so (both, one after the other) resumes, with
2 processes and then with 1, to the draft of the same run without the budget."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import tiny
from tiny_stages import metrics_rows, weights
from workflow import descendants

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_EVERY, BATCH_TOKENS = 24, 4, 64  # 20 shards, 18 rows a pass: 2 processes train 2.7 passes
KILLED_AT, SECOND_KILL = 8, 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tokenized samples, their hidden states extracted without a budget and with one of the eval
    shards and 10 of the 20 train shards, a vocab mapping of the whole vocabulary."""
    root = tmp_path_factory.mktemp("budget-ddp")
    target = tiny.make_llama(root / "target")
    train, evl = root / "train.jsonl", root / "eval.jsonl"
    tiny.make_tokenized(train, 40, 400, seed=1, prefix="t")
    tiny.make_tokenized(evl, 4, 400, seed=2, prefix="e")
    extract = ["--train", str(train), "--eval", str(evl), "--model", str(target), "--device", "cpu",
               "--batch-size", "2"]
    plain = extraction(root / "plain", extract)
    splits = json.loads(plain.read_text())["splits"]
    biggest = max(r["bytes"] for r in splits["train"]["shards"])
    budget = splits["eval"]["bytes"] + 10 * biggest
    budgeted = extraction(root / "budgeted", extract, "--disk-budget-gib", str(budget / 2**30))
    assert all(r["deferred"] for r in json.loads(budgeted.read_text())["splits"]["train"]["shards"])
    vocab = root / "vocab_mapping.safetensors"
    save_file({"d2t": torch.zeros(400, dtype=torch.long), "t2d": torch.ones(400, dtype=torch.bool)}, str(vocab))
    return SimpleNamespace(root=root, target=target, extract=extract, plain=plain, budgeted=budgeted, vocab=vocab,
                           budget=budget, biggest=biggest)


def extraction(out: Path, extract: list[str], *flags: str) -> Path:
    """The manifest of the extraction stage run over ``extract``'s data into ``out``."""
    from eaglepipe import extract_hidden_states
    from eaglepipe.gather_manifest import gather

    part = out / "parts" / "replica-0-of-1.json"
    extract_hidden_states.main([*extract, "--shard-dir", str(out / "shards"), "--out", str(part), *flags])
    gather([part], out / "manifest.json")
    return out / "manifest.json"


def budgeted_copy(data, dest: Path) -> Path:
    """A run's own copy of the budgeted extraction (its eval shards; its train shards are made by
    the training's extractor, beside them)."""
    shutil.copytree(data.budgeted.parent, dest)
    return dest / "manifest.json"


def command(data, manifest: Path, out: Path, nproc: int, shuffle: str = "0") -> list[str]:
    """train_draft as rule train_draft runs it: under torchrun for more than one process, with the
    extraction stage as its --producer where the manifest defers the train shards."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    producer = shlex.join([sys.executable, "-m", "eaglepipe.extract_hidden_states", *data.extract, "--shard-dir",
                           str(manifest.parent / "shards"), "--replica", "0", "--replicas", "1"])
    flags = {"max-steps": STEPS, "eval-every": CHECKPOINT_EVERY, "checkpoint-every": CHECKPOINT_EVERY,
             "batch-tokens": BATCH_TOKENS, "warmup-steps": 1, "lr": 3e-3, "ttt-steps": 3, "seed": 0,
             "shuffle-buffer-gib": shuffle}
    return (launcher if nproc > 1 else [sys.executable]) + [
        "-m", "eaglepipe.train_draft", "--manifest", str(manifest), "--vocab", str(data.vocab), "--model",
        str(data.target), "--out-dir", str(out), *[x for k, v in flags.items() for x in (f"--{k}", str(v))],
        "--producer", f"exec {producer}"]


ENV = dict(os.environ, PYTHONPATH=str(REPO / "scripts"), OMP_NUM_THREADS="1")


def train(cmd: list[str]) -> str:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        log = proc.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:  # torchrun starts its ranks in sessions of their own
            os.kill(pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, log[-6000:]
    return log


def role(pid: int) -> str:
    """'launcher', 'rank N' or 'producer of rank N': what a process under torchrun is."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"eaglepipe.extract_hidden_states" in cmdline:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        return f"producer of {role(parent)}"
    if b"torch.distributed.run" in cmdline:
        return "launcher"
    environ = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
    return f"rank {environ[b'RANK'].decode()}"


def kill_after_checkpoint(cmd: list[str], out: Path, victims: set[str], at: int = KILLED_AT) -> dict[str, list[int]]:
    """Start ``cmd``; once its checkpoint of step ``at`` is on disk, kill -9 its processes of the
    roles ``victims`` at once and wait for the launcher. Its processes by role at the kill."""
    with open(f"{out}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / f"step-{at:07d}").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, Path(f"{out}.log").read_text()[-3000:]
        time.sleep(0.01)
    roles: dict[str, list[int]] = {}
    for pid in [proc.pid, *descendants(proc.pid)]:
        roles.setdefault(role(pid), []).append(pid)
    for name in victims:
        for pid in roles[name]:
            os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) != 0
    return roles


def survivors(root: Path) -> list[str]:
    """The processes (`ps`) still running on this test's files, a few seconds at most after a kill:
    an extractor dies with the trainer that started it."""
    deadline = time.monotonic() + 5
    while True:
        ps = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True, check=True).stdout
        found = [line for line in ps.splitlines() if str(root) in line and line.split()[1][0] != "Z"]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def keep_checkpoints_up_to(out: Path, step: int) -> None:
    """As if the run had been killed right after checkpoint ``step``."""
    for ckpt in (out / "checkpoints").glob("step-*"):
        if int(ckpt.name.removeprefix("step-")) > step:
            shutil.rmtree(ckpt)


def reference_counts(data, segments: list[tuple[int, int]], window: int) -> Counter:
    """How often the run without the budget trains each train sample: every rank's rows replayed
    from the start through ``segments`` of (world size, steps)."""
    from eaglepipe.packed_data import PackedRows
    from eaglepipe.shard_manifest import load_manifest

    manifest = load_manifest(data.plain)
    sample = {r["batch"]: r["indices"] for r in json.loads(data.budgeted.read_text())["splits"]["train"]["shards"]}
    batch = [r["batch"] for r in manifest["splits"]["train"]["shards"]]
    counts, position = Counter(), (0, 0)
    for world, steps in segments:
        for rank in range(world):
            rows = PackedRows(manifest, "train", BATCH_TOKENS, seed=0, shuffle=True, rank=rank, world_size=world,
                              shuffle_window=window)
            rows.materialize = lambda row: row  # the rows' samples, not their tensors
            for end, row in rows.stream(*position, steps=steps):
                counts.update(sample[batch[si]][b] for si, b, _ in row)
        position = end
    return counts


def trained_counts(out: Path) -> Counter:
    """How often the training counted each sample trained (its last checkpoint)."""
    state = torch.load(out / "checkpoints" / "latest" / "trainer_state.pt", weights_only=True)
    return Counter({i: int(c) for i, c in enumerate(state["budget"]["counts"].tolist()) if c})


def assert_same_training(out: Path, reference: Path) -> None:
    """The same draft and curve (but for the throughput)."""
    got, want = weights(out, STEPS), weights(reference, STEPS)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)

    def curve(o):
        return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in metrics_rows(o)]

    assert curve(out) == curve(reference)


def assert_within_budget(data, out: Path, manifest: Path) -> dict:
    """The budget's record in the summary: the shards on disk stayed within the budget plus the one
    being written (measured by the extractor after each shard it wrote, killed jobs' included);
    the eval shards are kept, no train shard is left."""
    record = json.loads((out / "summary.json").read_text())["disk_budget"]
    assert 0 < record["peak_shard_bytes"] <= data.budget + data.biggest, record
    assert record["passes"] > 1 and record["shards_extracted"] > 20, record  # passes after the first re-extract
    shards = {p.name for p in (manifest.parent / "shards").glob("*.safetensors")}
    assert shards == {"eval-000000.safetensors", "eval-000001.safetensors"}
    return record


@pytest.fixture(scope="module")
def unbudgeted(data):
    """The run without the budget, 2 processes, each shard's samples shuffled alone."""
    out = data.root / "unbudgeted"
    train(command(data, data.plain, out, 2))
    return out


def test_two_processes_train_within_the_budget_as_without_it(data, unbudgeted, tmp_path):
    manifest = budgeted_copy(data, tmp_path / "hidden_states")
    out = tmp_path / "train"
    log = train(command(data, manifest, out, 2))
    assert "world size 2" in log
    record = assert_within_budget(data, out, manifest)
    assert record["order"] == "as without the budget"
    assert trained_counts(out) == reference_counts(data, [(2, STEPS)], window=1)
    assert record["samples_trained"] == sum(trained_counts(out).values())
    assert_same_training(out, unbudgeted)


def test_kills_of_rank_0_then_of_every_process_of_torchrun_then_a_rerun_with_one_process(data, tmp_path):
    """One budgeted run with a global shuffle (the budget holds a narrower window of shards for 2
    ranks' rows in flight than for 1), killed twice: kill -9 of rank 0, a rerun with 2 processes,
    kill -9 of every process, a rerun with 1 process that keeps the window of the checkpoint it
    resumes (its order). It trains as the same run without the budget on that window does."""
    manifest = budgeted_copy(data, tmp_path / "hidden_states")
    out = tmp_path / "train"
    roles = kill_after_checkpoint(command(data, manifest, out, 2, shuffle="global"), out, {"rank 0"})
    # one extractor for the shard directory, started by rank 0; it died with rank 0
    assert sorted(roles) == ["launcher", "producer of rank 0", "rank 0", "rank 1"]
    assert len(roles["producer of rank 0"]) == 1
    assert survivors(tmp_path) == []
    window = int(re.search(r"rows shuffle the samples of (\d+) shard", Path(f"{out}.log").read_text())[1])

    roles = kill_after_checkpoint(command(data, manifest, out, 2, shuffle="global"), out,
                                  {"launcher", "rank 0", "rank 1"}, at=SECOND_KILL)
    log = Path(f"{out}.log").read_text()
    assert "resuming from" in log and "saved with world size 2, now 2" in log, log[-3000:]
    assert len(roles["producer of rank 0"]) == 1
    assert survivors(tmp_path) == []
    keep_checkpoints_up_to(out, SECOND_KILL)
    log = train(command(data, manifest, out, 1, shuffle="global"))
    assert f"step-{SECOND_KILL:07d} at step {SECOND_KILL}" in log and "saved with world size 2, now 1" in log, log[-3000:]
    assert f"keeps its shuffle window of {window} shard(s)" in log, log[-3000:]
    record = assert_within_budget(data, out, manifest)
    assert record["shuffle_window_shards"] == window
    assert trained_counts(out) == reference_counts(data, [(2, SECOND_KILL), (1, STEPS - SECOND_KILL)], window)

    # without the budget, rows shuffled within the same window of shards (a buffer of that many)
    biggest_plain = max(r["bytes"] for r in json.loads(data.plain.read_text())["splits"]["train"]["shards"])
    buffer_gib = str((window + 0.5) * biggest_plain / 2**30)
    reference = tmp_path / "unbudgeted"
    kill_after_checkpoint(command(data, data.plain, reference, 2, shuffle=buffer_gib), reference,
                          {"launcher", "rank 0", "rank 1"}, at=SECOND_KILL)
    keep_checkpoints_up_to(reference, SECOND_KILL)
    train(command(data, data.plain, reference, 1, shuffle=buffer_gib))
    assert_same_training(out, reference)
