#!/usr/bin/env bash
# dry_run.sh BUILD_DIR — the ctest gpu_dry_run (issue 24): the GPU check's C
# steps (run.sh with GPU_CHECK_ONLY=c: the API suites, the demos, bench_cuda,
# sgm-bench's GPU figures, the VMM granule) from a bundle of BUILD_DIR, on the
# driver test double sized as the device the check is lent: an H200, about
# 139 GiB of GPU memory (FAKE_CUDA_TOTAL_MEM). A sizing mistake (a step asking
# for more than the GPU or the host gives at those sizes) fails here.
#
# The double keeps its VMM mappings in a list (linear lookups): at the
# H200's 2 MiB granule the demo's reserve half (~66k granules) costs it most
# of the step's 30 s in its own bookkeeping, so the demo runs in a second
# pass at 64 MiB granules (FAKE_CUDA_VMM_GRANULE): H200 sizes, 32x fewer
# handles; every other C step runs at 2 MiB (the API suites assume small
# granules). What 66k cuMemCreate cost on the driver is the demo step's time
# on the GPU.
#
# Host RAM is this machine's: the shared cap (half of RAM) is smaller here
# than on the H200's 128 GiB, so a step whose shared memory fits here fits
# there. Prints run.sh's summary and every step's seconds; fails when a step
# fails or the C steps take more than their share of the 4-minute script
# (GPU_DRY_RUN_BUDGET_S, default 150: docs/cuda.md, "The GPU check's time
# budget"). Skips (77) where a real GPU answers: run.sh itself is the check.
set -euo pipefail
BUILD=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DOUBLE=$BUILD/tests/support/fake_cuda
[ -e "$DOUBLE/libcuda.so.1" ] || { echo "gpu_dry_run: no driver double in $DOUBLE; skipped"; exit 77; }
if (cd "$HERE" && env -u LD_LIBRARY_PATH timeout 30 python3 probe.py >/dev/null 2>&1); then
  echo "gpu_dry_run: a GPU answers here: run tests/gpu/run.sh instead; skipped"
  exit 77
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
bash "$HERE/bundle.sh" --from "$BUILD" "$TMP/bundle" >/dev/null
t0=$(date +%s)
rc=0
# pass GRANULE OUT ENV...: run.sh's C steps on the double at H200 size.
pass() {
  local gran=$1 out=$2
  shift 2
  (cd "$TMP" && env LD_LIBRARY_PATH="$DOUBLE" GPU_CHECK_ALLOW_DOUBLE=1 FAKE_CUDA_TOTAL_MEM=139GiB \
     FAKE_CUDA_VMM_GRANULE="$gran" OUT="$TMP/$out" "$@" timeout 300 bash "$TMP/bundle/run.sh")
}
# Every C step but the demo at the H200's 2 MiB granule; the demo (whose
# reserve half is ~66k granules) at 64 MiB granules.
pass 2097152 out GPU_CHECK_ONLY=c GPU_CHECK_SKIP=step_demo || rc=$?
pass 67108864 out-demo GPU_CHECK_ONLY=step_demo || rc=$?
dt=$(($(date +%s) - t0))
budget=${GPU_DRY_RUN_BUDGET_S:-150}
if [ "$rc" -ne 0 ]; then
  echo "gpu_dry_run: run.sh's C steps on the double at H200 size exited $rc (logs above)"
  for f in "$TMP"/out*/*.log; do
    grep -q 'FAIL\|error\|Error' "$f" 2>/dev/null && { echo "--- $f"; tail -n 15 "$f"; }
  done
  exit 1
fi
if [ "$dt" -gt "$budget" ]; then
  echo "gpu_dry_run: the C steps took ${dt}s, past their ${budget}s share of the 4 minutes"
  exit 1
fi
echo "gpu_dry_run: the C steps passed on the double at H200 size in ${dt}s (share: ${budget}s)"
