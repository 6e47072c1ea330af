#!/usr/bin/env bash
# The whole pipeline on one lent H200 (no internet; Python 3.12 with torch 2.11.0, transformers
# 5.17.0, torchvision/torchaudio and triton already installed), installed from a wheel directory
# the way an air-gapped host is:
#
#   bash benchmarks/gpu_pipeline.sh stage [DIR]   on an online machine, from the checkout: builds
#       the wheel directory DIR/wheels with `setup.sh --gpu --download-wheels` for Python 3.12
#       (leaving out what the image has), packs it as one tar split into DIR/part1..N of at most
#       PART_MB (55) MiB each (a device call carries 64 MiB, the working tree included), and prints
#       the device calls. DIR defaults to .gpuwheels (in .gitignore).
#   bash benchmarks/gpu_pipeline.sh start         on the device, from the repository root, once
#       every part is in /tmp/stage: unpacks, `setup.sh --gpu --no-venv --wheels`, then starts
#       `snakemake --cores all` on config/presets/smollm2-h200.yaml DETACHED (a call's 10-minute
#       limit must not cut it), logging to results/gpu_pipeline.log. `start --no-setup` starts it
#       in an environment set up otherwise (e.g. the wheels' requirements.txt installed --no-deps).
#       Arguments after `start [--no-setup]` go to snakemake (e.g. --config 'benchmark_serving=...').
#   bash benchmarks/gpu_pipeline.sh status [WAIT_S]   on the device: waits up to WAIT_S seconds
#       (default 0) for the run to end, then prints its progress (last log lines, per-stage times)
#       and copies the small results to $OUT. Calls back to back keep the machine held.
set -euo pipefail
cd "$(dirname "$0")/.."

PRESET=config/presets/smollm2-h200.yaml
RUN=smollm2-h200
STAGE=${STAGE_DIR:-/tmp/stage}  # where the earlier calls copied the parts
LOG=results/gpu_pipeline.log
PIDFILE=results/gpu_pipeline.pid
# what the H200 image already has (torch 2.11.0 and its CUDA libraries): not transferred
ON_IMAGE='torch torchvision torchaudio triton nvidia-* cuda-*'

stage() {
  local dir=${1:-.gpuwheels} part_mb=${PART_MB:-55} n=0
  bash setup.sh --gpu --download-wheels "$dir/wheels" --python-version 3.12 --exclude "$ON_IMAGE"
  rm -rf "$dir"/part* "$dir"/bundle.tar.*
  tar -C "$dir" -cf - wheels | split -b "${part_mb}M" -d -a 2 - "$dir/bundle.tar."
  for f in "$dir"/bundle.tar.*; do
    n=$((n + 1)); mkdir -p "$dir/part$n"; mv "$f" "$dir/part$n/"
  done
  echo "$(ls "$dir"/wheels/*.whl | wc -l) wheels, $(du -sm "$dir/wheels" | cut -f1) MiB, in $n parts:"
  du -m "$dir"/part*/bundle.tar.* | sed 's/^/  MiB /'
  echo "device calls, back to back (each carries one part; the working tree travels too):"
  for i in $(seq 1 "$n"); do
    local cmd="mkdir -p $STAGE && cp $dir/part$i/bundle.tar.* $STAGE/"
    [ "$i" -lt "$n" ] || cmd="$cmd && bash benchmarks/gpu_pipeline.sh start"
    echo "  $i/$n carry=[\"$dir/part$i\"]  command: $cmd"
  done
  echo "then, until it says FINISHED or FAILED: bash benchmarks/gpu_pipeline.sh status 540"
}

start() {
  if [ "${1:-}" = --no-setup ]; then
    shift
  else
    [ -d "$STAGE/wheels" ] || cat "$STAGE"/bundle.tar.* | tar -xf - -C "$STAGE"
    bash setup.sh --gpu --no-venv --wheels "$STAGE/wheels"
  fi
  mkdir -p results
  if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "already running (pid $(cat "$PIDFILE"))"; return
  fi
  # --resources gpu=1: one GPU, so the GPU jobs run one at a time. vLLM's environment defaults:
  # set by the stages themselves (scripts/eaglepipe/vllm_env.py)
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 \
    setsid nohup bash -c 'python3 -m snakemake --cores all --resources gpu=1 --configfile "$@"; echo "snakemake exit $?"' \
    _ "$PRESET" "$@" > "$LOG" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
  echo "started snakemake (pid $!), log $LOG"
}

status() {
  local wait_s=${1:-0} t0=$SECONDS
  [ -f "$PIDFILE" ] || { echo "not started (no $PIDFILE)"; exit 1; }
  while kill -0 "$(cat "$PIDFILE")" 2>/dev/null && [ $((SECONDS - t0)) -lt "$wait_s" ]; do sleep 10; done
  if kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "RUNNING after $((SECONDS - t0)) s of waiting"
  elif grep -q "^snakemake exit 0$" "$LOG"; then echo FINISHED; else echo FAILED; fi
  echo "--- $LOG (last 25 lines)"; tail -n 25 "$LOG"
  echo "--- seconds per stage (Snakemake benchmark files)"
  for f in results/benchmarks/*.tsv "results/$RUN"/benchmarks/*.tsv; do
    [ -f "$f" ] && printf '%-60s %s\n' "$(basename "$f" .tsv)" "$(awk 'NR == 2 {print $1}' "$f")"
  done
  echo "--- load vs work"
  grep -h -E "loaded in|^[^ ]* *time: |torch.compile takes|from the cache|Model loading took|init engine" \
    "results/$RUN"/logs/*.log 2>/dev/null | tail -n 20 || true
  if [ -n "${OUT:-}" ]; then
    tail -n 300 "$LOG" > "$OUT/gpu_pipeline.log"
    for f in eval/serving.json eval/offline.json eval/parity.json; do
      [ -f "results/$RUN/$f" ] && cp "results/$RUN/$f" "$OUT/$(basename "$f")"
    done
    tail -q -n 60 "results/$RUN"/logs/*.log > "$OUT/stage_logs_tail.txt" 2>/dev/null || true
    # everything small in one file ($OUT brings back 8 files at most): logs, stats, manifest,
    # curves, the draft's config and card, the report's plots, Snakemake's per-stage benchmarks
    (cd results && tar -czf "$OUT/results_small.tgz" --ignore-failed-read gpu_pipeline.log \
      benchmarks "$RUN"/logs "$RUN"/benchmarks "$RUN"/data/stats.json "$RUN"/hidden_states/manifest.json \
      "$RUN"/hidden_states/parts "$RUN"/train/summary.json "$RUN"/train/metrics.jsonl "$RUN"/eval/*.json \
      "$RUN"/draft/config.json "$RUN"/draft/README.md "$RUN"/report 2>/dev/null) || true
  fi
}

case "${1:-}" in
  stage) shift; stage "$@" ;;
  start) shift; start "$@" ;;
  status) shift; status "$@" ;;
  *) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 2 ;;
esac
