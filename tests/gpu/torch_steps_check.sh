#!/usr/bin/env bash
# torch_steps_check.sh — ctest gpu_torch_steps_dry_run: the GPU check's
# PyTorch steps (two_stream_stress.py and torch_steps.py's graph-idle,
# mempool-oom, stats-patch) run here against the tests' stand-in torch
# (tests/python/standin) on the emulated device, each to its "key:" line, so
# a step broken in its own logic fails here rather than on the lent GPU.
#   torch_steps_check.sh PYTHON LIBSGM
set -u
PY=${1:-python3}
LIB=${2:?libsgm.so}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
export GPU_CHECK_STANDIN=$REPO/tests/python/standin
export PYTHONPATH=$REPO/python${PYTHONPATH:+:$PYTHONPATH}
export SGM_BACKEND=emu SGM_EMU_VRAM=1GiB SGM_VERBOSE=0 SGM_NODE=off PYTHONDONTWRITEBYTECODE=1
fail=0
run() { # name env... -- cmd...
  local name=$1 out rc
  shift
  out=$(cd "$HERE" && env "$@" 2>&1)
  rc=$?
  if [ "$rc" -eq 0 ] && echo "$out" | grep -q '^key:'; then
    echo "$name: PASS: $(echo "$out" | grep '^key:' | tail -n 1)"
  else
    echo "$name: FAIL (exit $rc):"
    echo "$out" | tail -n 15
    fail=1
  fi
}
run two-streams STRESS_ROUNDS=40 SGM_VRAM_LIMIT=512MiB "$PY" two_stream_stress.py "$LIB"
run torch-graph-idle SGM_IDLE_TRIM_MS=40 "$PY" torch_steps.py "$LIB" graph-idle
run torch-mempool-oom STANDIN_TORCH_VRAM=$((64 << 20)) GPU_CHECK_VRAM_LIMIT=$((64 << 20)) \
  "$PY" torch_steps.py "$LIB" mempool-oom
run torch-stats-patch "$PY" torch_steps.py "$LIB" stats-patch
exit $fail
