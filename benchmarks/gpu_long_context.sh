#!/usr/bin/env bash
# Issue 19's long-context table on one H200: two SmolLM2-135M drafts trained on the same 4,000
# ShareGPT conversations (the data's answers, the preset's training budget), one on rows cut at
# data.max_length 1,024 and one at 8,000 (SmolLM2's context is 8,192 positions: the prompt plus
# extraction's one sampled token must fit), both scored by the offline estimator on the 8k run's
# eval split (conversations up to 8,000 tokens, too_long: truncate), AL by context bucket. The draft's attention is full (no sliding window): past the 1,024 positions it was
# trained on, the 1k draft meets rotary positions it never saw; the table shows what that costs.
#
#   bash benchmarks/gpu_long_context.sh start [--no-setup]   after gpu_pipeline.sh's wheel parts are
#       in /tmp/stage: setup, the target, both runs at once (vllm.kv_cache_gib 8 each), then the 1k
#       draft on the 8k eval split; detached, logs in results/long-context/
#   bash benchmarks/gpu_long_context.sh status [WAIT_S]   waits, prints the table, copies it to $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
PRESET=config/presets/smollm2-h200.yaml
W=results/long-context
BUCKETS="512 1024 2048 4096 8192"
mkdir -p "$W"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
COMMON=(
  'regenerate={"enabled": false}'
  'evaluate={"prompts": null, "context_buckets": [512, 1024, 2048, 4096, 8192]}'
  'extract={"enforce_eager": true, "gpu_memory_utilization": 0.1}'
  'vllm={"kv_cache_gib": 8}'
  'benchmark_serving={"enabled": false}'
)

run() {  # run NAME MAX_LENGTH MAX_MODEL_LEN
  python3 -m snakemake --cores 6 --nolock --configfile "$PRESET" --config "run_name=$1" "${COMMON[@]}" \
    "data={\"max_samples\": 4000, \"max_length\": $2}" "extract={\"max_model_len\": $3}" \
    -- "results/$1/eval/offline.json" > "$W/$1.log" 2>&1
}

chain() {
  python3 -m snakemake --cores all --configfile "$PRESET" -- results/models/SmolLM2-135M-Instruct || return 1
  run long1k 1024 2048 & local a=$!
  run long8k 8000 8192 & local b=$!  # vLLM refuses max_model_len past SmolLM2's 8,192 positions
  wait $a && wait $b || return 1
  # shellcheck disable=SC2086
  python3 -m eaglepipe.evaluate --draft results/long1k/draft --manifest results/long8k/hidden_states/manifest.json \
    --split eval --model results/models/SmolLM2-135M-Instruct --k 3 --context-buckets $BUCKETS \
    --out "$W/long1k_on_long8k.json"
}

table() {
  python3 - "$W/long1k_on_long8k.json" results/long8k/eval/offline.json <<'PY'
import json, sys
rows = [(name, json.load(open(path))) for name, path in zip(("trained at 1,024", "trained at 8,000"), sys.argv[1:])]
labels = list(rows[0][1]["strata"]["context"])
print("| draft (same 8k eval split, K=3) | overall | " + " | ".join(f"prefix {l}" for l in labels) + " |")
print("|" + " --- |" * (len(labels) + 2))
for name, r in rows:
    by = r["strata"]["context"]
    print(f"| {name} | {r['acceptance_length']:.3f} | " + " | ".join(
        f"{by[l]['acceptance_length']:.3f} ({by[l]['anchors']:,})" for l in labels) + " |")
PY
}

case "${1:-}" in
  start)
    if [ "${2:-}" != --no-setup ]; then
      [ -d /tmp/stage/wheels ] || cat /tmp/stage/bundle.tar.* | tar -xf - -C /tmp/stage
      bash setup.sh --gpu --no-venv --wheels /tmp/stage/wheels > "$W/setup.log" 2>&1 || { tail -n 30 "$W/setup.log"; exit 1; }
    fi
    export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
    rm -f "$W/chain.rc"
    setsid nohup bash -c 'bash "$0" _chain; echo $? > "'"$W"'/chain.rc"' "$0" > "$W/chain.log" 2>&1 < /dev/null &
    echo "started (pid $!), logs in $W"
    ;;
  _chain) chain ;;
  status)
    t0=$SECONDS
    while [ ! -f "$W/chain.rc" ] && [ $((SECONDS - t0)) -lt "${2:-0}" ]; do sleep 10; done
    [ -f "$W/chain.rc" ] && echo "chain exit $(cat "$W/chain.rc")" || echo "running"
    for r in long1k long8k; do
      echo "--- $r: $(grep -E '^(rule|localrule) ' "$W/$r.log" 2>/dev/null | tail -n 1)"
      grep -E "Error|Exiting" "$W/$r.log" 2>/dev/null | tail -n 3
    done
    [ -f "$W/long1k_on_long8k.json" ] && table | tee "$W/table.md"
    [ -n "${OUT:-}" ] && tar -czf "$OUT/long_context.tgz" --ignore-failed-read "$W" results/long1k/eval \
      results/long8k/eval results/long1k/logs results/long8k/logs results/long8k/data/stats.json 2>/dev/null
    true
    ;;
  *) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 2 ;;
esac
