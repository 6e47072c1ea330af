#!/usr/bin/env bash
# Issue 17 on one lent H200: drafts trained on the data's answers vs the target's own
# (regenerate_responses), all evaluated on the fixed MT-Bench set (evaluate.prompts), SmolLM2-135M,
# 4,000 ShareGPT conversations, the single-GPU preset's training budget (1,000 x 8,192 tokens).
# The runs of the pipeline at once on the one GPU (each vLLM engine takes 10 % of its memory), then
# the serving speedup of chosen drafts with the GPU to themselves, since a speedup measured beside
# other jobs means nothing (AL does not depend on it). Runs at once save little device time:
# regeneration was no faster side by side than alone (benchmarks/README.md, fifteenth session).
#
#   bash benchmarks/gpu_regenerate_table.sh start [--no-setup]   after gpu_pipeline.sh's wheel parts
#       are in /tmp/stage: setup, the target, then the four runs detached (results/regen-table/*.log);
#       with MLA=1 also benchmarks/gpu_check_mla_draft.sh (issue 21) beside them; THEN="cmd" runs
#       after the runs, in the same detached chain, logging to results/regen-table/then.log, its $OUT
#       results/regen-table/then-out (copied back by status) (e.g.
#       THEN="bash benchmarks/gpu_compare_trainers.sh run-of regen17-t06-all": no idle gap between
#       device calls can lose it); BESIDE="cmd" starts once the target is built, beside the runs, logging
#       to results/regen-table/beside.log (e.g. BESIDE="bash benchmarks/gpu_long_context.sh _chain": its
#       own target build would contend for Snakemake's lock); THEN waits for it too (its timings need
#       the GPU alone). A comparison whose WORK is a folder of results/regen-table (e.g. BESIDE's
#       "WORK=$PWD/results/regen-table/cmp bash benchmarks/gpu_compare_trainers.sh run-of long1k", for its
#       AL only: beside other jobs its ms/step mean nothing) comes back as far as it got (compare.json).
#   bash benchmarks/gpu_regenerate_table.sh serve RUN...   detached: benchmark_serving alone on the GPU
#       for each run's draft (K 2-4, concurrency 1 and 4), one after the other.
#   bash benchmarks/gpu_regenerate_table.sh _serve_best RUN...   (in THEN) the run with the highest offline AL
#       as served on the MT-Bench set, served alone: vLLM's defaults, K 3 and 4, concurrency 1.
#   bash benchmarks/gpu_regenerate_table.sh _dflash RUN   (in THEN) a DFlash draft trained on RUN's shards
#       (benchmarks/dflash_probe.py: one layer, block 8, the preset's Muon and 1,000 x 8,192 tokens), served
#       alone at K 3 and 7, then RUN's EAGLE-3 draft at K 3 on the same machine; concurrency 1, 80 prompts.
#   bash benchmarks/gpu_regenerate_table.sh _spread RUN [REPEATS]   (in THEN, or detached by hand) RUN's draft
#       served REPEATS rounds (default 2) of one engine per setting in SPREAD (default "small default":
#       the pipeline's memory settings, vLLM's default; also seqs8, noasync, v1), K=3, concurrency 1:
#       status prints benchmarks/serving_spread.py's table.
#   bash benchmarks/gpu_regenerate_table.sh status [WAIT_S]   waits up to WAIT_S s while anything runs,
#       prints progress and the table (benchmarks/regenerate_table.py), copies results to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PRESET=config/presets/smollm2-h200.yaml
W=results/regen-table
mkdir -p "$W"
# vLLM's environment defaults: set by the stages themselves (scripts/eaglepipe/vllm_env.py)
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
# RUNS="..." picks runs (e.g. RUNS="regen17-t06-all regen17-t06-all-loops regen17-t06-all-trim
# regen17-t06-all-x2 regen17-t06-all-x4 regen17-t06-all-x2-steps2k regen17-t06-all-x4-l2-steps2k": the target's
# loops kept, trimmed, two or four answer sets per conversation, two sets trained for 2,000 steps, four sets
# for a two-layer draft trained for 2,000 steps; the same with one layer: regen17-t06-all-x4-steps2k)
RUNS=${RUNS:-"regen17-data regen17-greedy-first regen17-t06-first regen17-t06-all"}
# SERVING=0: each run stops at its offline estimate on the MT-Bench set as served (within 1.2 % of
# vLLM's online AL in the sixth session), saving its ~4 min of serving when device time is short
BENCHMARK_SERVING='benchmark_serving={"enabled": true, "k": [3], "concurrency": [1], "num_prompts": 80}'
TARGETS=(offline serving)
if [ "${SERVING:-1}" = 0 ]; then
  BENCHMARK_SERVING='benchmark_serving={"enabled": false}'
  TARGETS=(offline)
fi
COMMON=(
  'data={"max_samples": 4000}'
  'evaluate={"prompts": "package:mtbench"}'
  'extract={"enforce_eager": true, "gpu_memory_utilization": 0.1}'
  'vllm={"kv_cache_gib": 8}'
  "$BENCHMARK_SERVING"
)
regenerate_of() {  # the whole regenerate mapping of a run: Snakemake merges --config into the preset's
  # (which answers twice), so a run of one answer set says so; suffixes that change only the draft or
  # its training (-l2, -steps2k: draft_of, training_of) regenerate as the run they extend
  local base=${1%-steps2k}
  base=${base%-l2}
  [ "$base" != "$1" ] && { regenerate_of "$base"; return; }
  case $1 in
    regen17-data) echo '{"enabled": false, "backend": "vllm"}' ;;
    regen17-greedy-first) echo '{"enabled": true, "backend": "vllm", "temperature": 0, "turns": "first", "answers_per_conversation": 1}' ;;
    regen17-t06-first) echo '{"enabled": true, "backend": "vllm", "temperature": 0.6, "top_p": 0.95, "turns": "first", "answers_per_conversation": 1}' ;;
    regen17-t06-all) echo '{"enabled": true, "backend": "vllm", "temperature": 0.6, "top_p": 0.95, "turns": "all", "answers_per_conversation": 1}' ;;
    # the target's loops kept: greedy serving loops too (18 of the 80 MT-Bench answers)
    regen17-t06-all-loops) echo '{"enabled": true, "backend": "vllm", "temperature": 0.6, "top_p": 0.95, "turns": "all", "on_loop": "keep", "answers_per_conversation": 1}' ;;
    # the target's loops trimmed to their longest prefix that is not a loop (the conversation goes on)
    regen17-t06-all-trim) echo '{"enabled": true, "backend": "vllm", "temperature": 0.6, "top_p": 0.95, "turns": "all", "on_loop": "trim", "answers_per_conversation": 1}' ;;
    # two answer sets per conversation: twice the target's text from the same 4,000 prompts
    regen17-t06-all-x2) echo '{"enabled": true, "backend": "vllm", "temperature": 0.6, "top_p": 0.95, "turns": "all", "answers_per_conversation": 2}' ;;
    # four answer sets: does more of the target's text keep moving AL, as two sets did over one?
    regen17-t06-all-x4) echo '{"enabled": true, "backend": "vllm", "temperature": 0.6, "top_p": 0.95, "turns": "all", "answers_per_conversation": 4}' ;;
    # a looping answer asked again (new seeds) up to twice before it is dropped: its prompt and later turns kept
    regen17-t06-all-retry2) echo '{"enabled": true, "backend": "vllm", "temperature": 0.6, "top_p": 0.95, "turns": "all", "loop_retries": 2, "answers_per_conversation": 1}' ;;
    *) echo "unknown run $1" >&2; return 1 ;;
  esac
}

training_of() {  # the run's train mapping over the preset's (1,000 x 8,192 tokens unless it says otherwise):
  # -steps2k trains twice as long (two answer sets made 3.5 passes over their shards in 1,000 steps)
  case $1 in
    *-steps2k) echo '{"max_steps": 2000}' ;;
    *) echo '{}' ;;
  esac
}

draft_of() {  # the run's draft mapping over the preset's: -l2 (before any -steps2k) two decoder layers
  case ${1%-steps2k} in
    *-l2) echo '{"layers": 2}' ;;
    *) echo '{}' ;;
  esac
}

detach() {  # detach NAME cmd...: runs in its own session, log $W/NAME.log, exit code in $W/NAME.rc
  local name=$1; shift
  rm -f "$W/$name.rc"
  setsid nohup bash -c '"$@"; echo $? > "'"$W/$name.rc"'"' _ "$@" > "$W/$name.log" 2>&1 < /dev/null &
  echo $! > "$W/$name.pid"
  echo "started $name (pid $!)"
}

running() {
  local f
  for f in "$W"/*.pid; do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && echo "$(basename "$f" .pid)"; done
}

chain() {  # the target once, then the runs at once
  local run
  for run in $RUNS; do regenerate_of "$run" > /dev/null || return 1; done
  python3 -m snakemake --cores all --configfile "$PRESET" -- results/models/SmolLM2-135M-Instruct || return 1
  [ -n "${BESIDE:-}" ] && detach beside bash -c "$BESIDE"
  local pids=()
  for run in $RUNS; do
    python3 -m snakemake --cores 4 --nolock --configfile "$PRESET" --config "run_name=$run" "${COMMON[@]}" \
      "regenerate=$(regenerate_of "$run")" "train=$(training_of "$run")" "draft=$(draft_of "$run")" -- $(for t in "${TARGETS[@]}"; do echo "results/$run/eval/$t.json"; done) \
      > "$W/$run.log" 2>&1 &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}

bench() {  # bench RUN OUT PARITY FLAGS...: benchmark_serving for RUN's draft (or $DRAFT) on its 80 prompts,
  # results in $W/OUT, the parity samples in $W/PARITY; FLAGS: K, concurrency and engine settings
  local run=$1 out=$2 parity=$3; shift 3
  python3 -m eaglepipe.benchmark_serving --model results/models/SmolLM2-135M-Instruct \
    --serve-model HuggingFaceTB/SmolLM2-135M-Instruct --draft "${DRAFT:-results/$run/draft}" \
    --prompts "results/$run/data/eval.jsonl" --num-prompts 80 --max-tokens 256 --parity-k 3 "$@" \
    --out "$W/$out" --parity-samples "$W/$parity"
}

serve() {  # serve RUN...: each run's draft alone on the GPU
  local run
  for run in "$@"; do
    bench "$run" "serving_$run.json" "parity_$run.jsonl" --concurrency 1,4 --k 2,3,4 || return 1
  done
}

best_of() {  # best_of RUN...: the run whose offline AL as served (MT-Bench, K=3) is highest; it
  # was within 2.4 % of vLLM's online AL on every run served (benchmarks/README.md). A run without its
  # offline estimate (failed, or stopped to save device time) is left out, said on stderr, so the
  # others are still served (a missing one cost the fifteenth session its serving figure)
  python3 - "$@" <<'PY'
import json, os, sys
scored = {}
for run in sys.argv[1:]:
    path = f"results/{run}/eval/offline.json"
    if os.path.isfile(path):
        scored[run] = json.load(open(path))["as_served"]["acceptance_length"]
    else:
        print(f"best_of: {run} left out: no {path}", file=sys.stderr)
if not scored:
    sys.exit("best_of: no run has its offline estimate")
print(max(scored, key=scored.get))
PY
}

dflash() {  # dflash RUN: the one-forward drafter vLLM 0.26.0 serves, against RUN's EAGLE-3 draft. Block 8
  # (K up to 7; its layer is causal, so K=3 serves the block's first slots as trained); mask token 3
  # (<repo_name>: SmolLM2 has no free id, and speculators' fallback, id 2, is <|im_end|>); 1,024 anchors
  # a row of 8,192 tokens (speculators' 512 is for shorter rows). Served first: the EAGLE-3 figures
  # of this configuration are known from earlier sessions, on other machines
  local run=$1 draft=results/$1/dflash-draft
  # TORCHDYNAMO_DISABLE: speculators compiles DFlash's forward on CUDA (models/utils.py
  # conditional_torch_compile); the probe's sdpa path ran eager on CPU, and one layer needs no compiling
  TORCHDYNAMO_DISABLE=1 python3 benchmarks/dflash_probe.py --device cuda --manifest "results/$run/hidden_states/manifest.json" \
    --vocab "results/$run/data/vocab_mapping.safetensors" --model results/models/SmolLM2-135M-Instruct \
    --block-size 8 --mask-token-id 3 --optimizer muon --lr 3e-3 --weight-decay 0 --warmup-steps 50 \
    --max-steps 1000 --batch-tokens 8192 --max-anchors 1024 --eval-chunk 1024 --threads 8 \
    --save "$draft" --out "$W/dflash_probe_$run.json" || return 1
  DRAFT=$draft bench "$run" "serving_dflash_$run.json" "parity_dflash_$run.jsonl" --concurrency 1 --k 3,7 || return 1
  bench "$run" "serving_eagle3_$run.json" "parity_eagle3_$run.jsonl" --concurrency 1 --k 3
}

spread() {  # spread RUN [REPEATS]: its draft served (K=3, concurrency 1, 80 prompts) once per setting in
  # SPREAD (default "small default"), REPEATS rounds (default 2), so that the speedup's spread between
  # engines and a setting's effect come apart (benchmarks/serving_spread.py prints them); each file is
  # kept as it ends. Settings: small = the pipeline runs' memory (gpu_memory_utilization 0.1, an 8 GiB
  # KV cache); default = vLLM's (0.9); seqs8 / noasync = default plus engine arguments (max_num_seqs 8;
  # async_scheduling off); v1 = default on vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)
  local run=$1 i s
  for i in $(seq 1 "${2:-2}"); do
    for s in ${SPREAD:-small default}; do
      local flags=() runner=
      case $s in
        small) flags=(--gpu-memory-utilization 0.1 --kv-cache-gib 8) ;;
        default) ;;
        seqs8) flags=(--engine-args '{"max_num_seqs": 8}') ;;
        noasync) flags=(--engine-args '{"async_scheduling": false}') ;;
        # vLLM 0.26.0 runs SmolLM2 on its V2 model runner (vllm/config/vllm.py use_v2_model_runner); on the
        # V1 runner the same draft served at half the speedup (benchmarks/README.md)
        v1) runner=0 ;;
        *) echo "unknown spread setting $s" >&2; return 1 ;;
      esac
      (if [ -n "$runner" ]; then export VLLM_USE_V2_MODEL_RUNNER=$runner; fi
       bench "$run" "spread_${s}_$i.json" "spread_parity_${s}_$i.jsonl" --concurrency 1 --k 3 "${flags[@]}") || return 1
    done
  done
}

case "${1:-}" in
  start)
    shift
    if [ "${1:-}" != --no-setup ]; then
      [ -d /tmp/stage/wheels ] || cat /tmp/stage/bundle.tar.* | tar -xf - -C /tmp/stage
      bash setup.sh --gpu --no-venv --wheels /tmp/stage/wheels > "$W/setup.log" 2>&1 || { tail -n 30 "$W/setup.log"; exit 1; }
      tail -n 2 "$W/setup.log"
    fi
    export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
    detach chain bash "$0" _chain
    if [ "${MLA:-0}" = 1 ]; then
      detach mla env WORK=/tmp/mla OUT="$PWD/$W/mla" GPU_UTIL=0.1 bash benchmarks/gpu_check_mla_draft.sh
    fi
    ;;
  _chain)
    chain; rc=$?
    while [ -f "$W/beside.pid" ] && kill -0 "$(cat "$W/beside.pid")" 2>/dev/null; do sleep 10; done
    # THEN's own $OUT (the start call's is gone by then): status copies it back with the rest
    if [ -n "${THEN:-}" ]; then mkdir -p "$W/then-out" && OUT="$PWD/$W/then-out" bash -c "$THEN" > "$W/then.log" 2>&1 || rc=1; fi
    exit $rc
    ;;
  _serve) shift; serve "$@" ;;
  _serve_best)  # (in THEN) the best of the runs served alone, vLLM's defaults, K 3 and 4, concurrency 1
    shift
    run=$(best_of "$@") || exit 1
    echo "best by offline AL as served: $run"
    bench "$run" "serving_$run.json" "parity_$run.jsonl" --concurrency 1 --k 3,4
    ;;
  _spread) shift; spread "$@" ;;
  _dflash) shift; dflash "$1" ;;
  serve)
    shift
    export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
    detach serve bash "$0" _serve "$@"
    ;;
  status)
    wait_s=${2:-0} t0=$SECONDS
    while [ -n "$(running)" ] && [ $((SECONDS - t0)) -lt "$wait_s" ]; do sleep 10; done
    echo "running: $(running | tr '\n' ' ')"
    for f in "$W"/*.rc; do [ -f "$f" ] && echo "$(basename "$f" .rc) exit $(cat "$f")"; done
    for run in $RUNS; do
      echo "--- $run: $(grep -c 'Finished job' "$W/$run.log" 2>/dev/null) jobs done; last: $(grep -E '^(rule|localrule) ' "$W/$run.log" 2>/dev/null | tail -n 1)"
      grep -E "Error|error:|Exiting" "$W/$run.log" 2>/dev/null | tail -n 3
      for f in "results/$run"/benchmarks/*.tsv; do
        [ -f "$f" ] && printf '   %-32s %s s\n' "$(basename "$f" .tsv)" "$(awk 'NR == 2 {print $1}' "$f")"
      done
    done
    [ -f "$W/mla/summary.txt" ] && { echo "--- mla"; tail -n 12 "$W/mla/summary.txt"; }
    [ -f "$W/serve.log" ] && { echo "--- serve"; grep -E "^benchmark_serving:|speedup|Error" "$W/serve.log" | tail -n 8; }
    [ -f "$W/beside.log" ] && { echo "--- beside"; tail -n 5 "$W/beside.log"; }
    [ -f "$W/then.log" ] && { echo "--- then"; tail -n 12 "$W/then.log"; }
    spread_files=$(for f in $(ls -tr "$W"/spread_*_[0-9]*.json 2>/dev/null); do b=${f##*/spread_}; echo "${b%%_*}=$f"; done)
    [ -n "$spread_files" ] && python3 benchmarks/serving_spread.py $spread_files --json "$W/spread.json" | tee "$W/spread.md"
    # RUNS=" ": only BESIDE and THEN ran. The runs' own serving shared the GPU when they ran at once
    # (or beside the MLA check); a BESIDE job may have ended before it: say so in the note
    shared=; [ "$(echo $RUNS | wc -w)" -gt 1 ] || [ "${MLA:-0}" = 1 ] && shared=--shared-gpu
    [ -n "${RUNS// /}" ] && python3 benchmarks/regenerate_table.py $(for r in $RUNS; do echo "results/$r"; done) \
      $shared --serving "$W"/serving_*.json --json "$W/table.json" 2>&1 | tee "$W/table.md"
    if [ -n "${OUT:-}" ]; then
      cp "$W/table.md" "$W/table.json" "$W/spread.md" "$OUT/" 2>/dev/null
      tar -czf "$OUT/regen_table.tgz" --ignore-failed-read "$W"/*.log "$W"/*.json "$W/mla" "$W/then-out" \
        "$W"/*/compare.json "$W"/*/summary.txt \
        $(for r in $RUNS; do echo "results/$r/logs results/$r/benchmarks results/$r/regenerated/stats.json \
          results/$r/regenerated/eval_prompts_stats.json results/$r/data/stats.json results/$r/eval \
          results/$r/train/metrics.jsonl results/$r/train/summary.json results/$r/draft/config.json"; done) 2>/dev/null
      true
    fi
    ;;
  *) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 2 ;;
esac
