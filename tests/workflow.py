"""Drive the real Snakemake CLI on a copy of the workflow (so tests may edit its code)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = ["Snakefile", "rules", "scripts", "config", "report", "envs"]
# the jobs of a whole run of tests/configs/tiny.yaml
STAGES = {"prepare_data", "vocab_mapping", "extract_hidden_states", "gather_hidden_states",
          "train_draft", "export_draft", "evaluate_offline", "model_card", "plot_report", "all"}


def copy_workflow(dest: Path) -> Path:
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / part)
    return dest


def tiny_config(target: Path, chats: Path, name: str = "tiny") -> dict:
    """tests/configs/<name>.yaml with its target and chats at the given paths."""
    cfg = yaml.safe_load((REPO / "tests" / "configs" / f"{name}.yaml").read_text())
    cfg["target"]["model"], cfg["data"]["path"] = str(target), str(chats)
    return cfg


def write_config(ws: Path, cfg: dict) -> None:
    (ws / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def finished_config(target: Path, chats: Path, **train) -> dict:
    """The finished tiny run's settings (finish_tiny_run), ``train`` on top: tests/configs/tiny.yaml
    with two samples a shard and short rows (a dozen shards, a few of them in flight at a time under
    tests/e2e/test_disk_budget.py's budget), each shard's samples shuffled alone (shuffle_buffer_gib
    0, so the budget keeps the order), trained long enough to be killed between checkpoints
    (tests/e2e/test_faults.py)."""
    cfg = tiny_config(target, chats)
    cfg["extract"].update(batch_size=2)
    cfg["train"].update(max_steps=30, eval_every=10, checkpoint_every=5, batch_tokens=128, shuffle_buffer_gib=0,
                        **train)
    return cfg


# On the caller's PYTHONPATH only: every stage interpreter that sees it records its module.
SITECUSTOMIZE = """
import atexit, os, sys
def _record():
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    with open(os.path.join(os.path.dirname(__file__), "stages.txt"), "a") as f:
        f.write((spec.name if spec else "?") + "\\n")
atexit.register(_record)
"""


def tree_digest(root: Path) -> dict[str, list]:
    """Every file's mode and content digest under ``root``, and its own mode (as JSON stores it)."""
    return {str(f.relative_to(root)): [f.stat().st_mode, hashlib.sha256(f.read_bytes()).hexdigest()]
            for f in sorted(root.rglob("*")) if f.is_file()} | {"/": [root.stat().st_mode, ""]}


@dataclass
class FinishedRun:
    """A finished tiny run, shared by the modules that start from one (copy ``ws`` before changing it)."""
    ws: Path
    target: Path  # the user's model directory, outside the workspace
    chats: Path
    target_before: dict  # tree_digest(target) before the run
    callers_stages: set[str]  # the stage modules that saw the caller's PYTHONPATH


def finish_tiny_run(root: Path) -> FinishedRun:
    """The whole workflow run once on finished_config in ``root``/ws, as `snakemake -F`, started with a
    PYTHONPATH of the caller's own (as `pip install --target DIR` users have). The plan before the run,
    the target's files before it and the stages that saw that PYTHONPATH are recorded in ``root``."""
    import tiny

    (root / "ws").mkdir()
    ws = copy_workflow(root / "ws")
    target = tiny.make_llama(root / "users-model")
    chats = tiny.make_chats(ws / "chats.jsonl", n=24)
    write_config(ws, finished_config(target, chats))
    jobs, reasons, _ = dry_run(ws)
    assert set(jobs) == STAGES, jobs
    assert set(reasons["output files have to be generated"]) == STAGES - {"all"}
    (root / "target_before.json").write_text(json.dumps(tree_digest(target)))
    callers = root / "callers_site"
    callers.mkdir()
    (callers / "sitecustomize.py").write_text(SITECUSTOMIZE)
    snakemake(ws, "-F", pythonpath=str(callers))  # -F: a forced rerun, for the user's model directory
    (root / "callers_stages.txt").write_text((callers / "stages.txt").read_text())
    (root / "DONE").touch()
    return load_finished_run(root)


def load_finished_run(root: Path) -> FinishedRun:
    return FinishedRun(root / "ws", root / "users-model", root / "ws" / "chats.jsonl",
                       json.loads((root / "target_before.json").read_text()),
                       set((root / "callers_stages.txt").read_text().split()))


def _command(ws: Path, args, pythonpath: str | None) -> tuple[list[str], dict]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # --max-threads 1: the suite runs one pytest-xdist worker per core (pyproject.toml), so a job's
    # second torch thread only contends with the other worker's (measured: test_tiny_run and
    # test_faults together 264 s with two, 241 s with one); floating-point results depend on the
    # thread count, and every run here, reference or faulted, has the same one
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ws / "Snakefile"), "--directory", str(ws),
           "--workflow-profile", "none", "--cores", "2", "--max-threads", "1", *args]
    return cmd, env


def snakemake(ws: Path, *args: str, check: bool = True, timeout: int = 1500,
              pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """Run Snakemake in ``ws``; ``pythonpath``: the caller's PYTHONPATH (none by default: the
    rules put the workflow copy's scripts/ first, so the checkout's own is never needed)."""
    cmd, env = _command(ws, args, pythonpath)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and p.returncode != 0:
        logs = "\n".join(f"--- {f}\n{f.read_text()[-3000:]}" for f in sorted(ws.glob("results/**/logs/*.log")))
        raise AssertionError(f"snakemake {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n"
                             f"{p.stderr[-4000:]}\n{logs}")
    return p


def dry_run(ws: Path, *args: str) -> tuple[dict[str, int], dict[str, set[str]], str]:
    """(pending jobs by rule, reason -> rules, raw output) of `snakemake -n`."""
    p = snakemake(ws, "-n", "--quiet", "rules", *args)
    out = p.stdout + p.stderr
    jobs: dict[str, int] = {}
    m = re.search(r"Job stats:\n.*?\n-+\s+-+\n(.*?)\ntotal", out, re.S)
    if m:
        for line in m.group(1).splitlines():
            name, count = line.split()
            jobs[name] = int(count)
    reasons: dict[str, set[str]] = {}
    r = re.search(r"Reasons:\n(.*?)(?:\nThis was a dry-run|\Z)", out, re.S)
    if r:
        current = None
        for line in r.group(1).splitlines():
            if line.strip().startswith("(check"):
                continue
            if not line.startswith("    "):
                current = None
            elif not line.startswith("        "):
                current = line.strip().rstrip(":")
            elif current and line.startswith("        "):
                reasons[current] = {x.strip() for x in line.split(",") if x.strip()}
    return jobs, reasons, out


# the stages that start the target as an engine (vLLM, or transformers with the hf backends), by module
LOADING_STAGES = ("regenerate_responses", "extract_hidden_states", "benchmark_serving")


def planned_target_loads(out: str) -> list[tuple[str, str]]:
    """(rule, what) of every target load the jobs of a `snakemake -n -p` would make: one per job of a
    loading stage, and benchmark_serving's one per engine (the target alone, then one per timed K)."""
    loads = []
    for rule, command in re.findall(r"\nrule (\w+):.*?\nShell command: (.*?)\n", out, re.S):
        module = re.search(r"eaglepipe\.(\w+) ", command)
        if not module or module.group(1) not in LOADING_STAGES:
            continue
        if module.group(1) != "benchmark_serving":
            loads.append((rule, "eval prompts + chats" if "--eval-data" in command else ""))
            continue
        words = shlex.split(command.split("exec python -m ")[1])
        loads += [(rule, "target alone")] + [(rule, f"K={k}") for k in words[words.index("--k") + 1].split(",")]
    return loads


def refused(ws: Path, *args: str) -> str:
    """The output of a `snakemake -n` that must fail."""
    p = snakemake(ws, "-n", *args, check=False)
    assert p.returncode != 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def summary(ws: Path, *args: str) -> dict[str, dict]:
    """`snakemake --summary` rows by output file."""
    p = snakemake(ws, "--summary", *args)
    lines = [l for l in p.stdout.splitlines() if "\t" in l]
    header = lines[0].split("\t")
    return {row[0]: dict(zip(header, row)) for row in (l.split("\t") for l in lines[1:])}


def start_snakemake(ws: Path, *args: str) -> subprocess.Popen:
    """Snakemake in the background (output in ``ws/snakemake.out``), to be faulted while it runs."""
    cmd, env = _command(ws, args, None)
    with open(ws / "snakemake.out", "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Snakemake starts jobs from several threads: all are looked at)."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:  # the process ended after its parent listed it
        return found
    for task in tasks:
        try:
            found += map(int, (task / "children").read_text().split())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie left for a reaper (a container's init may never reap)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    return [p for child in children(pid) for p in (child, *descendants(child))]


def wait_until(found, proc: subprocess.Popen, what: str, timeout: float = 600, poll: float = 0.05):
    """Call ``found()`` until it returns something true, and return that; fail if Snakemake ends
    first or ``timeout`` seconds pass. ``what`` says what was awaited."""
    deadline = time.monotonic() + timeout
    while not (result := found()):
        if proc.poll() is not None:
            raise AssertionError(f"snakemake ended (rc {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(poll)
    return result


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Wait until ``log`` holds ``text`` (the stage reached the moment to fault it)."""
    wait_until(lambda: log.is_file() and text in log.read_text(errors="replace"), proc,
               f"{log} showed {text!r}", timeout)


def stage_pid(proc: subprocess.Popen, module: str) -> int | None:
    """The job process running ``python -m eaglepipe.<module>`` under this Snakemake, if any."""
    for pid in descendants(proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if f"eaglepipe.{module}".encode() in cmdline:
            return pid
    return None


def kill_stage(proc: subprocess.Popen, module: str) -> int:
    """kill -9 the job process running ``python -m eaglepipe.<module>`` under this Snakemake."""
    pid = stage_pid(proc, module)
    if pid is None:
        raise AssertionError(f"no eaglepipe.{module} process under snakemake {proc.pid}")
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_stage_once_started(proc: subprocess.Popen, module: str, timeout: float = 600) -> int:
    """kill -9 the ``eaglepipe.<module>`` job as soon as it is running (Snakemake has removed its
    outputs by then; the stage itself is still importing)."""
    pid = wait_until(lambda: stage_pid(proc, module), proc, f"eaglepipe.{module} started", timeout, poll=0.02)
    os.kill(pid, signal.SIGKILL)
    return pid


TIMING = ("tokens_per_s",)  # the only metrics that differ between two runs of the same settings


COMPARED = ("draft", "train", "eval", "hidden_states")


def differences(run: Path, reference: Path, parts: tuple[str, ...] = COMPARED) -> list[str]:
    """What differs between two runs' results (of ``parts``: draft tensors, metrics rows but their
    timing, offline evaluation, the shards listed in the manifest); empty when they are the same."""
    import json

    import torch
    from safetensors.torch import load_file

    found = []
    if "draft" in parts:
        name = "draft/model.safetensors"
        if not (run / name).is_file():
            return [f"{name} is missing"]
        got, want = load_file(run / name), load_file(reference / name)
        found += [f"{name}: tensor {k}" for k in sorted(set(got) | set(want))
                  if k not in got or k not in want or not torch.equal(got[k], want[k])]

    def rows(r: Path) -> list[dict]:
        lines = (r / "train/metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]

    if "train" in parts and (got := rows(run)) != (want := rows(reference)):
        first = next((a for a, b in zip(got, want) if a != b), None)
        found.append(f"train/metrics.jsonl: {len(got)} rows vs {len(want)}, not the same; first differing row {first}")
    for part, name, key in (("eval", "eval/offline.json", None), ("hidden_states", "hidden_states/manifest.json", "splits")):
        if part not in parts:
            continue
        a, b = (json.loads((r / name).read_text()) for r in (run, reference))
        if (a if key is None else a[key]) != (b if key is None else b[key]):
            found.append(name)
    return found
