#!/usr/bin/env bash
# Issue 21 on the lent GPU: an MLA draft (draft.architecture mla) for a random-weight DeepseekV3
# target (MLA + MoE, 4 layers, hidden 1024: make_random_target.py --arch dsv3) goes through our
# CLIs on the GPU (hf extraction, train_draft with flex attention, export_draft); then
# eaglepipe.benchmark_serving has vLLM 0.26.0 load the export (its "Resolved architecture" lines are
# kept: Eagle3DeepseekV3ForCausalLM, vLLM's alias of Eagle3DeepseekV2ForCausalLM, is expected for
# the draft) and serve with it at concurrency 1, and eaglepipe.evaluate --parity replays the sequences of that window offline and compares the
# per-position acceptance with vLLM's counters (the pipeline's evaluate_parity). With random
# weights AL is not the point; loading and agreement are.
#
#   bash benchmarks/gpu_check_mla_draft.sh
#
# Needs vLLM 0.26.0 and speculators 0.9.0 importable: from $SITE (default /tmp/site, filled with
# `pip install --target`) or an environment set up by `gpu_pipeline.sh start`.
# Env: WORK (default /tmp/mla), OUT (default /tmp/out), STEPS (train steps, default 300), K (3),
# GPU_UTIL (the serving engine's share of GPU memory, default 0.9; lower it to share the GPU).
# Every step is skipped when its output exists: a call cut at its time limit continues when repeated.
# Results in $OUT: summary.txt (steps, resolved architectures, vLLM vs offline acceptance),
# serving.json, parity.json, logs.tar.gz.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
W=${WORK:-/tmp/mla}
O=${OUT:-/tmp/out}
K=${K:-3}
STEPS=${STEPS:-300}
mkdir -p "$W" "$O"
export PYTHONPATH="${SITE:-/tmp/site}:$REPO/scripts${PYTHONPATH:+:$PYTHONPATH}"
# vLLM's environment defaults: set by the stages themselves (scripts/eaglepipe/vllm_env.py)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

finish() {
  cp "$W/summary.txt" "$W/serving.json" "$W/parity.json" "$O/" 2>/dev/null
  (cd "$W" && tar -czf "$O/logs.tar.gz" $(ls *.log train/metrics.jsonl draft/config.json 2>/dev/null))
  exit "$1"
}

step() {  # step NAME OUTPUT cmd...: skipped when OUTPUT exists; logs to $W/NAME.log; stops on failure
  local name=$1 output=$2 t0 rc; shift 2
  [ -e "$output" ] && { echo "== $name: done before" | tee -a "$W/summary.txt"; return 0; }
  t0=$(date +%s)
  "$@" > "$W/$name.log" 2>&1
  rc=$?
  echo "== $name: rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$W/summary.txt"
  [ $rc -eq 0 ] || { tail -n 40 "$W/$name.log"; finish 1; }
}

extract() {  # extract NAME TRAIN_JSONL EVAL_JSONL DIR: our hf extraction on the GPU, then the manifest
  step "$1" "$4/parts/replica-0-of-1.json" python3 -m eaglepipe.extract_hidden_states --train "$2" --eval "$3" \
    --model "$W/target" --backend hf --device cuda --batch-size 32 --dtype bfloat16 \
    --shard-dir "$4/shards" --out "$4/parts/replica-0-of-1.json"
  step "$1_gather" "$4/manifest.json" python3 -m eaglepipe.gather_manifest --out "$4/manifest.json" \
    "$4/parts/replica-0-of-1.json"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$W/summary.txt" 2>&1
step target "$W/target/config.json" python3 benchmarks/make_random_target.py --arch dsv3 --out "$W/target" \
  --data-out "$W/data" --n 512 --n-eval 32 --len 128-512
step token_freq "$W/data/token_freq.safetensors" python3 benchmarks/mla_draft_check.py token-freq \
  --data "$W/data/train.jsonl" --target-vocab 32000 --out "$W/data/token_freq.safetensors"
step vocab "$W/data/vocab_mapping.safetensors" python3 -m eaglepipe.vocab_mapping \
  --token-freq "$W/data/token_freq.safetensors" --draft-vocab-size 8192 --out "$W/data/vocab_mapping.safetensors"
extract extract "$W/data/train.jsonl" "$W/data/eval.jsonl" "$W/hs"
step train "$W/train/summary.json" python3 -m eaglepipe.train_draft --manifest "$W/hs/manifest.json" \
  --vocab "$W/data/vocab_mapping.safetensors" --model "$W/target" --out-dir "$W/train" \
  --draft-architecture mla --ttt-steps "$K" --lr 0.001 --warmup-steps 20 --max-steps "$STEPS" \
  --batch-tokens 8192 --eval-every 100 --checkpoint-every 100
step export "$W/draft/config.json" python3 -m eaglepipe.export_draft --summary "$W/train/summary.json" \
  --verifier-name "$W/target" --num-speculative-tokens "$K" --out-dir "$W/draft"
python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print("exported:", c["architectures"], c["eaglepipe"])' \
  "$W/draft/config.json" | tee -a "$W/summary.txt"
step prompts "$W/data/prompts.jsonl" python3 benchmarks/mla_draft_check.py prompts --data "$W/data/eval.jsonl" \
  --prompt-len 32 --out "$W/data/prompts.jsonl"
: > "$W/no_train.jsonl"  # the parity set is all held out, as in the pipeline's benchmark_serving rule
step serve "$W/serving.json" python3 -m eaglepipe.benchmark_serving --model "$W/target" --draft "$W/draft" \
  --prompts "$W/data/prompts.jsonl" --num-prompts 32 --max-tokens 128 --concurrency 1 --k "$K" \
  --min-seconds 5 --min-output-tokens 1000 --parity-k "$K" --parity-min-requests 16 \
  --gpu-memory-utilization "${GPU_UTIL:-0.9}" --out "$W/serving.json" --parity-samples "$W/parity_samples.jsonl"
grep -h "Resolved architecture\|^benchmark_serving:" "$W/serve.log" | tee -a "$W/summary.txt"
# offline replay of the tokens vLLM served: their hidden states, then our estimator against vLLM's counters
extract extract_parity "$W/no_train.jsonl" "$W/parity_samples.jsonl" "$W/hs_parity"
step parity "$W/parity.json" python3 -m eaglepipe.evaluate --draft "$W/draft" --manifest "$W/hs_parity/manifest.json" \
  --split eval --model "$W/target" --k "$K" --parity "$W/serving.json" --out "$W/parity.json"
tail -n 5 "$W/parity.log" | tee -a "$W/summary.txt"
finish 0
