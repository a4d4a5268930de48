#!/usr/bin/env bash
# bundle_check.sh BUILD_DIR — the ctest gpu_bundle: packs BUILD_DIR with
# bundle.sh into a temporary folder (which checks the 64 MiB limit and that
# every library resolves from the folder or the base system), then runs the
# bundle's run.sh with no GPU and expects exit 77 within 30 seconds and
# nothing packed that is a driver. Where a GPU answers, run.sh would run the
# whole check: the test skips (77) and says so.
set -euo pipefail
BUILD=$1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if (cd "$HERE" && env -u LD_LIBRARY_PATH timeout 30 python3 probe.py >/dev/null 2>&1); then
  echo "gpu_bundle: a GPU answers here: run the full check with tests/gpu/run.sh instead; skipped"
  exit 77
fi
bash "$HERE/bundle.sh" --from "$BUILD" "$TMP/bundle"
bytes=$(du -sb "$TMP/bundle" | cut -f1)
echo "gpu_bundle: bundle is $bytes bytes ($((bytes / 1024 / 1024)) MiB of 64)"
for need in run.sh lib/libsgm.so py/probe.py py/pytorch_allocator.py py/cupy_allocator.py \
            py/graph_capture.py py/two_stream_stress.py py/torch_steps.py py/gpu_common.py py/managed_oversub.py py/sgm/__init__.py py/sgm/torch.py bin/bench_cuda bin/sgm-bench bin/sgm-demo; do
  [ -e "$TMP/bundle/$need" ] || { echo "gpu_bundle: $need missing from the bundle"; exit 1; }
done
ls "$TMP/bundle"/bin/api_* >/dev/null || { echo "gpu_bundle: no API suite packed"; exit 1; }
t0=$(date +%s)
rc=0
(cd "$TMP" && env -u LD_LIBRARY_PATH OUT="$TMP/out" timeout 60 bash "$TMP/bundle/run.sh") || rc=$?
dt=$(($(date +%s) - t0))
if [ "$rc" -ne 77 ]; then
  echo "gpu_bundle: run.sh without a GPU exited $rc, not 77"
  exit 1
fi
if [ "$dt" -gt 30 ]; then
  echo "gpu_bundle: run.sh took ${dt}s to find there is no GPU (must be seconds)"
  exit 1
fi
[ -s "$TMP/out/probe.log" ] || { echo "gpu_bundle: run.sh wrote no probe.log into \$OUT"; exit 1; }
echo "gpu_bundle: run.sh exited 77 in ${dt}s: $(tail -n 1 "$TMP/out/probe.log")"
