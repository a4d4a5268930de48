#!/usr/bin/env bash
# preload_dry_run.sh PYTHON PRELOAD_SO — ctest gpu_preload_dry_run: the GPU
# check's two preload steps (issue 27) plan right without a GPU: the PyTorch
# job (preload_torch.py) on an 80 GiB card and a 2 GiB one asks for 1.5x the
# limit and never more than is free, and names the preload it will load; the
# nvcc program (preload_nvcc.cu) compiles with the toolkit's nvcc (skipped
# without one) and sizes itself the same way.
set -u
PY=$1 PRE=$2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fail() { echo "preload_dry_run: $*"; exit 1; }
for free in 85899345920 2147483648; do
  out=$(cd "$HERE" && "$PY" preload_torch.py --dry-run --free-bytes "$free" "$PRE") || fail "torch plan for $free: $out"
  echo "$out"
  echo "$out" | grep -q "(1.5x)" || fail "no 1.5x plan for $free bytes free"
  echo "$out" | grep -q "LD_PRELOAD=$PRE" || fail "the preload run does not load $PRE"
done
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
if [ -x "$NVCC" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/b/bin" "$tmp/b/lib"
  "$NVCC" -O2 -o "$tmp/b/bin/preload-nvcc" "$HERE/preload_nvcc.cu" || fail "nvcc could not build preload_nvcc.cu"
  cp "$PRE" "$tmp/b/lib/libsgm-preload.so"
  out=$(bash "$HERE/preload_nvcc.sh" "$tmp/b" 1073741824 --dry-run 85899345920) || fail "nvcc plan: $out"
  echo "$out"
  echo "$out" | grep -q "(1.5x)" || fail "no 1.5x plan from the nvcc program"
else
  echo "preload_dry_run: no nvcc at $NVCC: the nvcc step's build is not checked here"
fi
echo "preload_dry_run: both steps planned"
