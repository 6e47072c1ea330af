# What the device chains share (gpu_kimi_rehearsal.sh, gpu_data_curve.sh): sourced from the
# repository root, never run. Each chain sets STAGE (where the wheel parts were copied), STEPS (its
# steps TSV) and PIDFILE before calling these.

step() {  # step NAME cmd...: timed, logged to results/NAME.log; the chain goes on after a failure
  local name=$1 t0=$SECONDS rc; shift
  echo "== $name start $(date -u +%T)"
  "$@" > "results/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$STEPS"
  echo "== $name rc=$rc $((SECONDS - t0)) s"
  return $rc
}

chain_running() {  # true (and says so) while the chain PIDFILE names is alive
  [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null && echo "already running (pid $(cat "$PIDFILE"))"
}

install_staged() {  # unpack the staged wheel parts and `setup.sh --gpu --no-venv` from them, once a machine
  [ -f results/.setup-done ] && return
  [ -d "$STAGE/wheels" ] || cat "$STAGE"/bundle.tar.* | tar -xf - -C "$STAGE"
  local t0=$SECONDS
  bash setup.sh --gpu --no-venv --wheels "$STAGE/wheels" > results/setup.log 2>&1 \
    || { tail -n 30 results/setup.log; echo "setup FAILED"; exit 1; }
  echo "setup $((SECONDS - t0)) s" | tee -a results/setup.log && touch results/.setup-done
}
