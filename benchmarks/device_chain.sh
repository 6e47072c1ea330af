# What the device chains share (gpu_kimi_rehearsal.sh, gpu_data_curve.sh): sourced from the
# repository root, never run. Each chain sets CHAIN (its name) first; its files are derived here.

STAGE=${STAGE_DIR:-/tmp/stage}   # where the wheel parts (and brought-back pieces) were copied
LOG=results/$CHAIN.log           # the detached chain's output
STEPS=results/${CHAIN}_steps.tsv # each step's rc and seconds
PIDFILE=results/$CHAIN.pid

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-0}"; }  # the header

step() {  # step NAME cmd...: timed, logged to results/NAME.log; the chain goes on after a failure
  local name=$1 t0=$SECONDS rc; shift
  echo "== $name start $(date -u +%T)"
  "$@" > "results/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$STEPS"
  echo "== $name rc=$rc $((SECONDS - t0)) s"
  return $rc
}

chain_alive() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

chain_running() {  # true (and says so) while the chain is alive
  chain_alive && echo "already running (pid $(cat "$PIDFILE"))"
}

detach() {  # detach ARGS...: this checkout's (RUN_DIR's) chain script, `chain ARGS...`, in a session of its own
  setsid nohup bash "benchmarks/$(basename "$0")" chain "$@" >> "$LOG" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
}

wait_chain() {  # wait_chain WAIT_S: waits up to WAIT_S s while the chain runs, then says RUNNING or ENDED
  local t0=$SECONDS
  while chain_alive && [ $((SECONDS - t0)) -lt "$1" ]; do sleep 5; done
  chain_alive && echo "RUNNING after $((SECONDS - t0)) s of waiting" || echo ENDED
}

install_staged() {  # unpack the staged wheel parts and `setup.sh --gpu --no-venv` from them, once a machine
  [ -f results/.setup-done ] && return
  [ -d "$STAGE/wheels" ] || cat "$STAGE"/bundle.tar.* | tar -xf - -C "$STAGE"
  local t0=$SECONDS
  bash setup.sh --gpu --no-venv --wheels "$STAGE/wheels" > results/setup.log 2>&1 \
    || { tail -n 30 results/setup.log; echo "setup FAILED"; exit 1; }
  echo "setup $((SECONDS - t0)) s" | tee -a results/setup.log && touch results/.setup-done
}
