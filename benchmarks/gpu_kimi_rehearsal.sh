#!/usr/bin/env bash
# Issue 44's rehearsal on one lent GPU: the Kimi-K2.5 preset at Kimi's real widths through snakemake
# (benchmarks/kimi_rehearsal.yaml), then extraction against plain vLLM prefill on the same target.
#
#   bash benchmarks/gpu_pipeline.sh stage DIR     on an online machine: the wheel parts (as for
#       gpu_pipeline.sh); copy each to /tmp/stage on the device, one call each, back to back
#   bash benchmarks/gpu_kimi_rehearsal.sh start   on the device, from the repository root: copies
#       the checkout to RUN_DIR (default /tmp/kimi-rehearsal: a later call that carries the checkout
#       replaces it, and took a first attempt's results and processes with it), unpacks the wheels,
#       `setup.sh --gpu --no-venv`, and starts the chain there DETACHED (builds the target on the
#       GPU, never transferred: ~11 GB), logging to RUN_DIR/results/kimi_rehearsal.log
#   bash benchmarks/gpu_kimi_rehearsal.sh status [WAIT_S]   waits up to WAIT_S s for the chain to
#       end, prints its progress and copies the small results to $OUT (kimi_rehearsal.tgz)
# The chain's steps, each timed in results/kimi_rehearsal_steps.tsv: build (make_kimi_target.py),
# disk (write + fsync bandwidth of the shard disk), pipeline (snakemake), bench_extraction (plain
# vLLM prefill of the pipeline's own samples, same model and engine settings).
set -uo pipefail
cd "$(dirname "$0")/.."

CHAIN=kimi_rehearsal
RUN_DIR=${RUN_DIR:-/tmp/kimi-rehearsal}
MODEL=results/models/kimi-k2.5-width
RUN=kimi-rehearsal
BENCH=results/bench_extraction   # on the shard disk, as the pipeline's shards
source benchmarks/device_chain.sh  # STAGE, LOG, STEPS, PIDFILE; usage, step, chain_running, detach, wait_chain, install_staged

disk() {  # the shard disk's sequential write + fsync bandwidth, 4 GiB (what a shard write costs)
  dd if=/dev/zero of=results/disk_speed.bin bs=64M count=64 conv=fsync 2>&1 | tail -n 1
  rm -f results/disk_speed.bin
  df -h results /dev/shm
}

chain() {
  export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -n 2
  printf 'step\trc\tseconds\n' > "$STEPS"
  [ -f "$MODEL/config.json" ] || step build python3 benchmarks/make_kimi_target.py --out "$MODEL"
  step disk disk
  step pipeline python3 -m snakemake --cores all --resources gpu=1 \
    --configfile config/presets/kimi-k2.5.yaml benchmarks/kimi_rehearsal.yaml
  mkdir -p "$BENCH" && ln -sfn "$PWD/$MODEL" "$BENCH/model"
  # plain vLLM prefill of the tokens the pipeline's extraction read, with its engine settings (the
  # schema's max_model_len, gpu_memory_utilization and batch size, compiled): the ratio to the
  # manifest's throughput is capture's cost. BENCH_ROWS=plain,vllm-disk times ours here as well.
  step bench_extraction python3 benchmarks/bench_extraction.py --work "$BENCH" --data "results/$RUN/data" \
    --layer-ids 1,2,3,4 --max-model-len 8192 --gpu-util 0.9 --batch-size 64 --compiled \
    --rows "${BENCH_ROWS:-plain}" --json results/bench_extraction_kimi.json
  echo "CHAIN DONE"
}

start() {
  [ "$PWD" = "$RUN_DIR" ] || { rm -rf "$RUN_DIR" && cp -r . "$RUN_DIR"; }
  cd "$RUN_DIR" && mkdir -p results
  chain_running && return
  install_staged
  detach
  echo "started the chain (pid $(cat "$PIDFILE")), log $LOG"
}

status() {
  cd "$RUN_DIR"
  [ -f "$PIDFILE" ] || { echo "not started (no $PIDFILE)"; exit 1; }
  wait_chain "${1:-0}"
  cat "$LOG"; echo "--- steps"; cat "$STEPS" 2>/dev/null
  echo "--- snakemake"; grep -E "^\[|^rule |Finished job|Error|error" results/pipeline.log 2>/dev/null | tail -n 12
  echo "--- stage seconds"
  for f in results/$RUN/benchmarks/*.tsv; do
    [ -f "$f" ] && printf '%-40s %s\n' "$(basename "$f" .tsv)" "$(awk 'NR == 2 {print $1}' "$f")"
  done
  if [ -n "${OUT:-}" ]; then
    (cd results && tar -czf "$OUT/kimi_rehearsal.tgz" --ignore-failed-read kimi_rehearsal.log kimi_rehearsal_steps.tsv \
      setup.log build.log disk.log pipeline.log bench_extraction.log bench_extraction_kimi.json bench_extraction/bench.log \
      models/kimi-k2.5-width/config.json "$RUN"/logs "$RUN"/benchmarks "$RUN"/data/stats.json "$RUN"/regenerated/stats.json \
      "$RUN"/hidden_states/manifest.json "$RUN"/hidden_states/parts "$RUN"/train/summary.json "$RUN"/train/metrics.jsonl \
      "$RUN"/eval/*.json "$RUN"/eval/parity/parts "$RUN"/draft/config.json "$RUN"/draft/README.md \
      "$RUN"/draft/export.json "$RUN"/summary.json "$RUN"/regenerated/eval_prompts_stats.json "$RUN"/report/*.svg \
      2>/dev/null) || true
  fi
}

case "${1:-}" in
  start) start ;;
  chain) chain ;;
  status) shift; status "$@" ;;
  *) usage 2 ;;
esac
