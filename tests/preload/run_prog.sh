#!/bin/sh
# run_prog.sh PROG MODE PRELOAD SGM_SMI — one case of the preload's tests
# (tests/preload/CMakeLists.txt), over the driver double (LD_LIBRARY_PATH set
# by CTest). The device has FAKE_CUDA_TOTAL_MEM = 64 MiB; every program asks
# for 1.5x that. MODE:
#   plain      no preload: the program must stop with the driver's OUT_OF_MEMORY (exit 2)
#   preload    under the preload: exit 0 (every byte intact, sgm-smi showed the process
#              interposed with fallback bytes), and its report says fallbacks happened
#              and nothing is left: no live fallback block, no accounted driver byte
#   fork       preload + TEST_FORK=1 (prog_direct): the child passes through until cuInit
#   quota      SGM_VRAM_LIMIT=16M: fallback starts at the budget, not at the device's end
#   quota_off  SGM_VRAM_LIMIT=16M, SGM_PRELOAD_FALLBACK=off: OUT_OF_MEMORY at block 4
#   old, new   a 11.8 / 14.0 driver: everything passes through (OOM), one warning
#   count      TEST_COUNT pairs with and without the preload: at most 2 driver calls
#              added per allocation+free pair
# Sanitizer builds: the sanitizer runtime must come first in LD_PRELOAD (ASan
# refuses to start otherwise), so its path, as the preload's ldd shows it, is
# put in front.
set -u
prog=$1 mode=$2 preload=$3 smi=$4
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
export SGM_NODE_DIR="$tmp" SGM_NODE_PERIOD_MS=20 SGM_PRELOAD_REPORT="$tmp/report" TEST_SGM_SMI="$smi"
export FAKE_CUDA_TOTAL_MEM=67108864 SGM_VERBOSE=0
rt=$(ldd "$preload" | awk '/lib[at]san\.so/ {print $3; exit}')
pre="$preload"
[ -n "$rt" ] && pre="$rt:$preload"

fail() { echo "FAIL ($mode): $*"; [ -f "$tmp/out" ] && cat "$tmp/out"; [ -f "$tmp/report" ] && cat "$tmp/report"; exit 1; }
run() { # run EXPECTED_RC [VAR=VALUE...]: the program under env, output to $tmp/out
  want=$1; shift
  env "$@" "$prog" >"$tmp/out" 2>&1
  rc=$?
  [ "$rc" = "$want" ] || fail "exit $rc, expected $want"
  cat "$tmp/out"
}
field() { tr ' ' '\n' <"$tmp/report" | sed -n "s/^$1=\([0-9]*\)$/\1/p" | tail -n 1; }

case "$mode" in
plain) run 2 TEST_EXPECT_PRELOAD=0
       grep -q "^OOM at block" "$tmp/out" || fail "no OOM line" ;;
preload|fork)
  extra=""
  [ "$mode" = fork ] && extra="TEST_FORK=1"
  run 0 TEST_EXPECT_PRELOAD=1 LD_PRELOAD="$pre" $extra
  [ "$(field fallbacks)" -gt 0 ] 2>/dev/null || fail "no fallback reported"
  [ "$(field live_fallbacks)" = 0 ] || fail "fallback blocks left"
  [ "$(field live_driver_bytes)" = 0 ] || fail "accounted driver bytes left"
  [ "$mode" = fork ] && { grep -q "^fork:" "$tmp/out" || fail "fork case did not run"; }
  echo "report: $(tail -n 1 "$tmp/report")" ;;
quota)
  run 0 TEST_EXPECT_PRELOAD=1 LD_PRELOAD="$pre" SGM_VRAM_LIMIT=16M
  # 24 blocks of 4 MiB, 16 MiB of budget: 4 in VRAM, 20 fall back.
  [ "$(field fallbacks)" = 20 ] || fail "expected 20 fallbacks under a 16 MiB budget" ;;
quota_off)
  run 2 LD_PRELOAD="$pre" SGM_VRAM_LIMIT=16M SGM_PRELOAD_FALLBACK=off
  grep -q "^OOM at block 4 " "$tmp/out" || fail "the quota did not stop block 4"
  grep -q "SGM_PRELOAD_FALLBACK=off" "$tmp/out" || fail "no message naming SGM_PRELOAD_FALLBACK=off"
  [ "$(field fallbacks)" = 0 ] || fail "fallbacks with SGM_PRELOAD_FALLBACK=off" ;;
old|new)
  v=11080; [ "$mode" = new ] && v=14000
  run 2 LD_PRELOAD="$pre" FAKE_CUDA_DRIVER_VERSION=$v
  [ "$(grep -c "outside the range" "$tmp/out")" = 1 ] || fail "expected exactly one version warning"
  [ "$(field mode)" = 2 ] || fail "the preload did not pass through" ;;
count)
  k=1000
  run 0 TEST_COUNT=$k
  plain=$(sed -n 's/^driver_calls_per_pair=\([0-9.]*\).*/\1/p' "$tmp/out")
  run 0 TEST_COUNT=$k LD_PRELOAD="$pre"
  pre_calls=$(sed -n 's/^driver_calls_per_pair=\([0-9.]*\).*/\1/p' "$tmp/out")
  echo "driver calls per cuMemAlloc+cuMemFree pair: without the preload $plain, with it $pre_calls"
  awk -v a="$plain" -v b="$pre_calls" 'BEGIN { exit !(b - a <= 2.0) }' ||
    fail "the preload adds $pre_calls - $plain driver calls per pair (at most 2)" ;;
*) fail "unknown mode" ;;
esac
exit 0
