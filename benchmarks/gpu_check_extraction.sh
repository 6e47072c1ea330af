#!/usr/bin/env bash
# GPU check of the extraction stage (run on the H200 after vLLM 0.26.0 was installed with
# `pip install --target /tmp/site`), from the repository root:
#   bash benchmarks/gpu_check_extraction.sh
# For a random Llama (8 layers, hidden 1024) and a random DeepseekV3 (MLA + MoE, 4 layers) it
# runs OUR CLI (python -m eaglepipe.extract_hidden_states) with --backend vllm and with
# --backend hf --device cuda on the same tokenized data, ids including N = num_hidden_layers,
# compares the shards (benchmarks/compare_shards.py), and reruns the vLLM extraction to check
# that every shard is reused. Logs and JSON go to $OUT (4 files); a summary goes to stdout.
# ~2-3 minutes (two eager vLLM starts of ~30 s).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
# vLLM's environment defaults: set by the stages themselves (scripts/eaglepipe/vllm_env.py)
export PYTHONPATH="$REPO/scripts:${PYTHONPATH:-/tmp/site}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
O=${OUT:-/tmp/out}
W=${WORK:-/tmp/gpu_check_extraction}
mkdir -p "$O" "$W"
status=0

step() {  # step LOG TIMEOUT_S cmd...
  local log=$1 lim=$2; shift 2
  local t0; t0=$(date +%s)
  echo "### $*" >> "$log"
  timeout "$lim" "$@" >> "$log" 2>&1
  local rc=$?
  echo "== rc=$rc $(( $(date +%s) - t0 ))s: ${*:1:4} ..."
  [ $rc -eq 0 ] || status=1
  return $rc
}

extract() {  # extract MODEL IDS BACKEND DIR LOG
  step "$5" 300 python3 -m eaglepipe.extract_hidden_states --train "$W/data/train.jsonl" \
    --eval "$W/data/eval.jsonl" --model "$1" --backend "$3" --device cuda --tensor-parallel-size 1 \
    --layer-ids "$2" --batch-size 16 --storage-dtype model --dtype bfloat16 --max-model-len 4096 \
    --gpu-memory-utilization 0.8 --enforce-eager --shard-dir "$4/shards" --replica 0 --replicas 1 \
    --out "$4/part.json"
}

# lengths 1..1500 cover chunked prefill (vLLM's default token budget per step is smaller)
[ -f "$W/data/train.jsonl" ] || python3 benchmarks/make_random_target.py --data-out "$W/data" \
  --n 48 --n-eval 8 --len 1-1500

for spec in "llama 1,2,4,8 0.03" "dsv3 1,2,3,4 0.08"; do
  set -- $spec
  arch=$1 ids=$2 tol=$3 log="$O/$1.log"
  : > "$log"
  echo "---- $arch (layer ids $ids, tolerance $tol)"
  [ -d "$W/$arch/model" ] || step "$log" 120 python3 benchmarks/make_random_target.py --arch "$arch" \
    --out "$W/$arch/model"
  extract "$W/$arch/model" "$ids" vllm "$W/$arch/vllm" "$log"
  extract "$W/$arch/model" "$ids" hf "$W/$arch/hf" "$log"
  step "$log" 120 python3 benchmarks/compare_shards.py "$W/$arch/vllm/part.json" "$W/$arch/hf/part.json" \
    --tol "$tol" --json "$O/${arch}_compare.json"
  extract "$W/$arch/model" "$ids" vllm "$W/$arch/vllm" "$log"   # rerun: everything reused
  if ls -a "$W/$arch/vllm/shards" | grep -q staging; then
    echo "staging directory left behind in $W/$arch/vllm/shards"; status=1
  fi
  grep -E "layer ids|bytes/token|backend loaded|reused|skipped|tok/s, shards|^ +[0-9]+ +[0-9.e+-]+ |rel err|COMPARE|Error|error" \
    "$log" | grep -v "^ *File " | sed 's/.*\r//' | tail -24
done
echo "GPU_CHECK_EXTRACTION $([ $status -eq 0 ] && echo OK || echo FAIL)"
exit $status
