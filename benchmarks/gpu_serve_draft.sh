#!/usr/bin/env bash
# Serving benchmark of an exported draft on the lent GPU machine: vLLM with the draft vs the target
# alone (eaglepipe.benchmark_serving). vLLM 0.26.0 must be installed first into $SITE
# (`pip install --target`; /tmp/site by default).
#
#   bash benchmarks/gpu_serve_draft.sh TARGET_DIR DRAFT_DIR PROMPTS_JSONL [K_LIST] [NUM_PROMPTS] [MAX_TOKENS]
#
# K_LIST defaults to 1,2,3,4,5, NUM_PROMPTS to 64, MAX_TOKENS to 256; the parity samples are those of
# the draft's own speculative_tokens (PARITY_K), which must be in K_LIST.
# Env: TP (tensor parallel size, default 1), TRUST_REMOTE_CODE=1 (Kimi), CONCURRENCY (1,4,16,64),
# MIN_SECONDS (10), MIN_OUTPUT_TOKENS (2000), PARITY_K, SITE, OUT (default ./out).
# Writes $OUT/serving.json, $OUT/parity_samples.jsonl and $OUT/serving.log; prints the summary lines
# (or the log tail on failure).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,10p' "$0"; exit 2; }
TARGET=$1 DRAFT=$2 PROMPTS=$3
K_LIST=${4:-1,2,3,4,5}
# K of the export: speculators format (Llama-layer drafts) or the MLA draft's plain config (mla_draft.py)
PARITY_K=${PARITY_K:-$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] if "speculators_config" in c else c["eaglepipe"]["num_speculative_tokens"])' "$DRAFT/config.json")}
NUM_PROMPTS=${5:-64}
MAX_TOKENS=${6:-256}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-$PWD/out}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"

export PYTHONPATH="$SITE:$REPO/scripts${PYTHONPATH:+:$PYTHONPATH}"
# vLLM's environment defaults: set by the stages themselves (scripts/eaglepipe/vllm_env.py)
export HF_HUB_OFFLINE=1
trust=()
[ "${TRUST_REMOTE_CODE:-0}" = 1 ] && trust=(--trust-remote-code)

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/serving.log" 2>&1 || true
rc=0
python3 -m eaglepipe.benchmark_serving --model "$TARGET" "${trust[@]}" --draft "$DRAFT" \
  --prompts "$PROMPTS" --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --k "$K_LIST" \
  --concurrency "${CONCURRENCY:-1,4,16,64}" --min-seconds "${MIN_SECONDS:-10}" \
  --min-output-tokens "${MIN_OUTPUT_TOKENS:-2000}" --parity-k "$PARITY_K" \
  --tensor-parallel-size "${TP:-1}" --out "$OUT/serving.json" --parity-samples "$OUT/parity_samples.jsonl" \
  >> "$OUT/serving.log" 2>&1 || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "benchmark_serving failed (exit $rc); last lines of $OUT/serving.log:"
  tail -n 60 "$OUT/serving.log"
  exit "$rc"
fi
grep '^benchmark_serving:' "$OUT/serving.log"
