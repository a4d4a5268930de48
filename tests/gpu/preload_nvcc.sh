#!/usr/bin/env bash
# preload_nvcc.sh — the GPU check's nvcc-built program (preload_nvcc.cu, packed
# as bin/preload-nvcc) under libsgm-preload.so at 1.5x a VRAM limit, timed
# against the same blocks as cudaMallocManaged oversubscription (issue 27).
#   preload_nvcc.sh BUNDLE LIMIT_BYTES [--dry-run FREE_BYTES]
# Prints "key: preload P s (F fallbacks), um U s; um/preload X". Exit 0 when
# both runs checked their bytes and the preload reported fallbacks.
set -u
B=$1 LIMIT=$2
PROG=$B/bin/preload-nvcc PRE=$B/lib/libsgm-preload.so
[ -x "$PROG" ] || { echo "preload_nvcc: $PROG missing (nvcc not found when the bundle was packed?)"; exit 1; }
[ -f "$PRE" ] || { echo "preload_nvcc: $PRE missing"; exit 1; }
if [ "${3:-}" = "--dry-run" ]; then
  "$PROG" --dry-run "$LIMIT" "$4" || { echo "preload_nvcc: the plan does not fit"; exit 1; }
  echo "dry run: would run LD_PRELOAD=$PRE SGM_VRAM_LIMIT=$LIMIT $PROG fixed $LIMIT; $PROG um $LIMIT"
  exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
t_of() { sed -n 's/^time: //p' "$1" | tail -n 1; }
LD_PRELOAD=$PRE SGM_VRAM_LIMIT=$LIMIT SGM_PRELOAD_REPORT=$tmp/report "$PROG" fixed "$LIMIT" >"$tmp/pre" 2>&1
rc=$?; cat "$tmp/pre"; [ $rc -eq 0 ] || { echo "preload_nvcc: the program under the preload exited $rc"; exit 1; }
"$PROG" um "$LIMIT" >"$tmp/um" 2>&1
rc=$?; cat "$tmp/um"; [ $rc -eq 0 ] || { echo "preload_nvcc: the Unified Memory reference exited $rc"; exit 1; }
fb=$(tr ' ' '\n' <"$tmp/report" | sed -n 's/^fallbacks=//p' | tail -n 1)
[ "${fb:-0}" -gt 0 ] || { echo "preload_nvcc: no fallback reported: the program was not interposed"; exit 1; }
p=$(t_of "$tmp/pre") u=$(t_of "$tmp/um")
echo "key: preload $p s ($fb fallbacks), um $u s; um/preload $(awk -v a="$u" -v b="$p" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')"
