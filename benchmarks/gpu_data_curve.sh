#!/usr/bin/env bash
# Issue 45's data-scale curve on one lent GPU: SmolLM2-135M's draft trained on 2,000, 6,000 and all
# 17,672 records of the ShareGPT package, regenerated ONCE by the target (one answer set), each size
# through a disk budget below its shards and served at concurrency 1, K=3 on the 80 MT-Bench
# prompts (config/presets/smollm2-h200.yaml + benchmarks/data_curve.yaml; the device time and why
# it takes two sessions: benchmarks/README.md#data-scale-curve-issue-45).
#
#   bash benchmarks/gpu_pipeline.sh stage DIR     on an online machine: the wheel parts (as for
#       gpu_pipeline.sh); copy each to /tmp/stage on the device, one call each, back to back
#   bash benchmarks/gpu_data_curve.sh start [regen | curve] [SIZE...]   on the device, from the
#       repository root: copies the checkout to RUN_DIR (default /tmp/data-curve; its results/ are
#       kept, so a second start goes on from them), sets up from the wheels once and starts the chain
#       there DETACHED, logging to RUN_DIR/results/data_curve.log. The chain: build the target,
#       regenerate all records once (the full run's regenerate_responses job alone, with the
#       preset's engine settings), pack its parts for bringing back, then each SIZE (default: 2000
#       6000 all, in that order) through snakemake; the smaller runs get the full run's parts and
#       the eval shards of the size before (benchmarks/data_curve.py seed), so they generate nothing
#       and extract no eval shard. `start regen` stops after the pack; `start curve [SIZE...]`
#       starts from parts brought back (regen.tgz.* in STAGE_DIR, default /tmp/stage) instead of
#       regenerating, and runs the sizes given. The size `new` runs only when named: every record and
#       CURVE_NEW_TURNS (17,672) user turns the target writes itself (regenerate.new_user_turns),
#       the issue's point beyond the data; its steps make CURVE_PASSES (1.5) passes over its own train
#       tokens, counted once its data is prepared (data_curve.py steps). OMIT_FROM="RULE..." before `start`
#       (a session short of device time): each size's run leaves out those rules and what follows
#       them (Snakemake's --omit-from): extract_parity_hidden_states, ~75 s less a size, serves the
#       draft without the parity replay and its card; benchmark_serving stops at the offline figures
#   bash benchmarks/gpu_data_curve.sh status [WAIT_S]   waits up to WAIT_S s for the chain to end,
#       prints its progress and the curve so far, and copies to $OUT: data_curve.tgz (the small
#       results), data_curve.md and .svg (the curve) and the regenerated parts once packed, regen.tgz.NN
#       (pieces of at most 15 MiB, only while they fit what a call brings back; NO_PACK=1 leaves
#       them out once saved)
#   bash benchmarks/gpu_data_curve.sh args SIZE    the snakemake --config words of a size (any host)
# Each step is timed in RUN_DIR/results/data_curve_steps.tsv; a size's Snakemake output is in
# results/size-RUN.log. If a size's extraction or training fails under the disk budget, that size and
# the later ones run without the budget (the step size-RUN-nobudget), so the curve still comes back,
# every size in one regime.
set -uo pipefail
cd "$(dirname "$0")/.."

CHAIN=data_curve
RUN_DIR=${RUN_DIR:-/tmp/data-curve}
# (CURVE_PRESET, CURVE_OVERLAY and CURVE_SIZES replace them only for the CPU rehearsal of the chain,
# tests/e2e/test_data_curve_chain.py)
PRESET=${CURVE_PRESET:-config/presets/smollm2-h200.yaml}
OVERLAY=${CURVE_OVERLAY:-benchmarks/data_curve.yaml}
FULL=curve-all            # the overlay's run_name: every record; its regeneration is the one made
# size:train.max_steps (~1.5 passes; benchmarks/data_curve.yaml says how); "all" is the overlay's own
read -r -a SIZES <<< "${CURVE_SIZES:-2000:110 6000:320 all}"
NEW_TURNS=${CURVE_NEW_TURNS:-17672}  # the size "new": as many written user turns as records
PASSES=${CURVE_PASSES:-1.5}
ROW_TOKENS=${CURVE_ROW_TOKENS:-7900}  # a row's tokens: 8,192 filled ~96 % (benchmarks/data_curve.yaml's table)
PACK=results/regen-pack   # the full run's regenerated parts, packed to be brought back
PIECE_MB=15               # $OUT brings back files of at most 16 MiB, 64 MiB and 8 files in all
RETURN_MB=48              # the most of them one status call returns (beside the results)
source benchmarks/device_chain.sh  # STAGE, LOG, STEPS, PIDFILE; usage, step, chain_running, detach, wait_chain, install_staged
SNAKEMAKE=(python3 -m snakemake --cores all --resources gpu=1 --rerun-incomplete --configfile "$PRESET" "$OVERLAY")

run_of() { [ "$1" = all ] && echo "$FULL" || echo "curve-$1"; }

size_args() {  # the --config words of a size, one a line (the size "new": its steps come later)
  local spec
  if [ "$1" = new ]; then
    echo "run_name=$(run_of new)"
    echo "regenerate={\"new_user_turns\": {\"count\": $NEW_TURNS}}"
    return 0
  fi
  for spec in "${SIZES[@]}"; do
    [ "${spec%%:*}" = "$1" ] || continue
    [ "$1" = all ] && return 0
    echo "run_name=$(run_of "$1")"
    echo "data={\"max_samples\": $1}"
    echo "train={\"max_steps\": ${spec#*:}}"
    return 0
  done
  echo "no size '$1' (sizes: ${SIZES[*]%%:*} new)" >&2
  return 1
}

regenerate() {
  # The full run's regeneration alone on the GPU, with the preset's engine settings (vLLM sizes its
  # cache by profiling 0.9 of the GPU, as when regeneration's throughput was recorded). How an engine
  # uses the GPU reruns nothing (rules/regenerate.smk), so the size runs take these outputs as they are.
  "${SNAKEMAKE[@]}" --config 'extract={"disk_budget_gib": null, "gpu_memory_utilization": 0.9}' \
    'vllm={"kv_cache_gib": null}' -- "results/$FULL/regenerated/chats.jsonl"
}

pack() {
  rm -rf "$PACK" && mkdir -p "$PACK"
  tar -C "results/$FULL/regenerated" -czf - chats-parts eval_prompts-parts \
    | split -b "${PIECE_MB}M" -d -a 2 - "$PACK/regen.tgz." || return 1
  du -cb "$PACK"/regen.tgz.* | tail -n 1
}

unpack() {
  mkdir -p "results/$FULL/regenerated" && cat "$STAGE"/regen.tgz.* | tar -xzf - -C "results/$FULL/regenerated"
  ls "results/$FULL/regenerated/chats-parts" | wc -l
}

snakemake_size() {  # snakemake_size SIZE [--config words...]: one size's run, through serving
  local size=$1 run config=(); shift
  run=$(run_of "$size")
  mapfile -t config < <(size_args "$size")
  config+=("$@")
  if [ "$run" != "$FULL" ]; then
    local records=$size  # "new" reads every record, as the full run did
    [ "$size" != new ] || records=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["read"])' \
      "results/$FULL/regenerated/stats.json") || return 1
    python3 benchmarks/data_curve.py seed --source "results/$FULL" --records "$records" --dest "results/$run" \
      ${SHARDS_FROM:+--shards-from "results/$SHARDS_FROM"} || return 1
  elif [ -n "${SHARDS_FROM:-}" ]; then
    python3 benchmarks/data_curve.py seed --dest "results/$run" --shards-from "results/$SHARDS_FROM" || return 1
  fi
  if [ "$size" = new ]; then  # its data first: its steps follow from its train tokens
    "${SNAKEMAKE[@]}" --config "${config[@]}" -- "results/$run/data/stats.json" || return 1
    local steps
    steps=$(python3 benchmarks/data_curve.py steps "results/$run" --passes "$PASSES" --row-tokens "$ROW_TOKENS") \
      || return 1
    config+=("train={\"max_steps\": $steps}")
  fi
  local omit=()
  [ -z "${OMIT_FROM:-}" ] || omit=(--omit-from $OMIT_FROM)  # word-split: rule names
  # --keep-going: a failed parity check (run after serving) still leaves the card and the plots
  "${SNAKEMAKE[@]}" --keep-going "${omit[@]}" ${config[@]:+--config "${config[@]}"}
}

run_size() {
  local size=$1 run
  run=$(run_of "$size")
  if [ -z "${NO_BUDGET:-}" ]; then
    step "size-$run" snakemake_size "$size"
    if [ ! -f "results/$run/train/summary.json" ] \
       && grep -q -E "Error in rule (train_draft|extract_hidden_states):" "results/size-$run.log"; then
      echo "budget fallback: $run's extraction or training failed under extract.disk_budget_gib" \
        "(results/size-$run.log, results/$run/logs/); it and the later sizes run without the budget"
      NO_BUDGET=1
    fi
  fi
  if [ -n "${NO_BUDGET:-}" ] && [ ! -f "results/$run/train/summary.json" ]; then
    step "size-$run-nobudget" snakemake_size "$size" 'extract={"disk_budget_gib": null}'
    # without the budget every train shard stays: the finished run's go, to leave the next room
    rm -f "results/$run"/hidden_states/shards/train-*
  fi
  [ -f "results/$run/hidden_states/shards/eval-000000.safetensors" ] && SHARDS_FROM=$run
  return 0
}

curve_table() {
  local runs=() spec
  for spec in "${SIZES[@]}" new; do
    [ -d "results/$(run_of "${spec%%:*}")" ] && runs+=("results/$(run_of "${spec%%:*}")")
  done
  [ ${#runs[@]} -gt 0 ] || return 0
  python3 benchmarks/data_curve.py curve "${runs[@]}" --steps "$STEPS" --logs results \
    --json results/data_curve.json --md results/data_curve.md --svg results/data_curve.svg
}

chain() {
  local mode=$1 sizes=("${@:2}") spec
  export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
  mkdir -p results
  ! command -v nvidia-smi > /dev/null || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -n 2; df -h . /dev/shm | tail -n 2
  [ -f "$STEPS" ] || printf 'step\trc\tseconds\n' > "$STEPS"
  [ ${#sizes[@]} -gt 0 ] || for spec in "${SIZES[@]}"; do sizes+=("${spec%%:*}"); done
  local target
  target=$(python3 -c 'import sys, yaml; t = yaml.safe_load(open(sys.argv[1]))["target"]; print(t["model"] if t.get("build") else "")' "$PRESET")
  [ -z "$target" ] || step build "${SNAKEMAKE[@]}" -- "$target"
  local brought=0
  if compgen -G "$STAGE/regen.tgz.*" > /dev/null && [ ! -f "results/$FULL/regenerated/chats.jsonl" ]; then
    step unpack unpack && brought=1  # parts brought back from an earlier session: nothing to generate
  fi
  step regenerate regenerate || { echo "CHAIN FAILED at the regeneration"; return 1; }
  # packed once (again only after a new regeneration), unless the parts were brought in
  [ "$brought" = 1 ] || [ "$PACK/regen.tgz.00" -nt "results/$FULL/regenerated/chats.jsonl" ] || step pack pack
  if [ "$mode" != regen ]; then
    for size in "${sizes[@]}"; do
      run_size "$size"
      curve_table > /dev/null 2>&1
    done
  fi
  step curve curve_table
  echo "CHAIN DONE"
}

start() {
  local mode=all
  case "${1:-}" in regen|curve) mode=$1; shift ;; esac
  for size in "$@"; do size_args "$size" > /dev/null || exit 2; done
  if [ "$mode" = curve ] && ! compgen -G "$STAGE/regen.tgz.*" > /dev/null \
     && [ ! -f "$RUN_DIR/results/$FULL/regenerated/chats.jsonl" ]; then
    echo "start curve: no regen.tgz.* in $STAGE (the parts a regeneration's status brought back)"; exit 2
  fi
  if [ "$PWD" != "$RUN_DIR" ]; then  # the checkout, over an earlier one; its results/ stay
    mkdir -p "$RUN_DIR" && tar --exclude=./results --exclude=./.git --exclude=./.gpuwheels -cf - . | tar -xf - -C "$RUN_DIR"
  fi
  cd "$RUN_DIR" && mkdir -p results
  chain_running && return
  install_staged
  [ -z "$(ls -A .snakemake/locks 2>/dev/null)" ] || python3 -m snakemake --unlock --cores 1 --configfile "$PRESET" "$OVERLAY" > /dev/null 2>&1
  detach "$mode" "$@"
  echo "started the chain ($mode${*:+: $*}; pid $(cat "$PIDFILE")), log $RUN_DIR/$LOG"
}

status() {
  local run f
  cd "$RUN_DIR" 2>/dev/null || { echo "not started (no $RUN_DIR)"; exit 1; }
  [ -f "$PIDFILE" ] || [ -f "$STEPS" ] || { echo "not started (no $PIDFILE)"; exit 1; }
  wait_chain "${1:-0}"
  cat "$LOG"; echo "--- steps"; cat "$STEPS" 2>/dev/null
  f=$(ls -t results/size-*.log results/regenerate.log 2>/dev/null | head -n 1)
  [ -z "$f" ] || { echo "--- $f"; grep -E "^\[|rule |Finished job|Error|error|steps \(" "$f" | tail -n 12; }
  echo "--- curve so far"; curve_table 2>&1 | tail -n 30
  [ -n "${OUT:-}" ] || return 0
  local small=(data_curve.log data_curve_steps.tsv setup.log data_curve.json data_curve.md logs benchmarks)
  for f in results/*.log; do small+=("$(basename "$f")"); done
  for run in results/curve-*; do
    [ -d "$run" ] || continue
    run=${run#results/}
    small+=("$run"/logs "$run"/benchmarks "$run"/data/stats.json "$run"/regenerated/stats.json
            "$run"/regenerated/eval_prompts_stats.json "$run"/hidden_states/manifest.json "$run"/train/summary.json
            "$run"/train/metrics.jsonl "$run"/train/budget/extracted.jsonl "$run"/eval/offline.json
            "$run"/eval/serving.json "$run"/eval/parity.json "$run"/draft/config.json "$run"/draft/README.md
            "$run"/draft/export.json "$run"/summary.json "$run"/report)
  done
  (cd results && tar -czf "$OUT/data_curve.tgz" --ignore-failed-read "${small[@]}" 2>/dev/null) || true
  for f in results/data_curve.md results/data_curve.svg; do [ ! -f "$f" ] || cp "$f" "$OUT/"; done
  if compgen -G "$PACK/regen.tgz.*" > /dev/null && [ -z "${NO_PACK:-}" ]; then
    local mb n
    mb=$(( ($(cat "$PACK"/regen.tgz.* | wc -c) + 1048575) / 1048576 )); n=$(ls "$PACK"/regen.tgz.* | wc -l)
    if [ "$mb" -le "$RETURN_MB" ] && [ "$n" -le 5 ]; then
      cp "$PACK"/regen.tgz.* "$OUT/" && echo "--- regenerated parts returned: $n piece(s), $mb MiB (regen.tgz.*)"
    else
      echo "--- regenerated parts: $n piece(s), $mb MiB, more than a call returns ($RETURN_MB MiB): not returned"
    fi
  fi
}

case "${1:-}" in
  start) shift; start "$@" ;;
  chain) shift; chain "$@" ;;
  status) shift; status "$@" ;;
  args) shift; size_args "${1:?args needs a size}" ;;
  *) usage 2 ;;
esac
