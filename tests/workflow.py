"""Drive the real Snakemake CLI on a copy of the workflow (so tests may edit its code)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = ["Snakefile", "rules", "scripts", "config", "report", "envs"]


def copy_workflow(dest: Path) -> Path:
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / part)
    return dest


def write_config(ws: Path, cfg: dict) -> None:
    (ws / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def snakemake(ws: Path, *args: str, check: bool = True, timeout: int = 1500,
              pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """Run Snakemake in ``ws``; ``pythonpath``: the caller's PYTHONPATH (none by default: the
    rules put the workflow copy's scripts/ first, so the checkout's own is never needed)."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ws / "Snakefile"), "--directory", str(ws),
           "--workflow-profile", "none", "--cores", "2", *args]
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


def summary(ws: Path, *args: str) -> dict[str, dict]:
    """`snakemake --summary` rows by output file."""
    p = snakemake(ws, "--summary", *args)
    lines = [l for l in p.stdout.splitlines() if "\t" in l]
    header = lines[0].split("\t")
    return {row[0]: dict(zip(header, row)) for row in (l.split("\t") for l in lines[1:])}
