#!/usr/bin/env bash
# Build and run the whole test suite in the three configurations sgm is held
# to: release, debug with ASan+UBSan, and TSan, then fuzz each fuzz target for
# a bounded time (tests/fuzz/run_fuzz.sh: SGM_FUZZ_SECONDS each, default 20;
# skipped with a notice where clang's libFuzzer is missing). Exits non-zero on
# the first configuration that fails. Usage: tests/run_all.sh [preset...|fuzz]
set -euo pipefail
cd "$(dirname "$0")/.."
presets=()
fuzz=0
[ $# -gt 0 ] || set -- release asan tsan fuzz
for a in "$@"; do
  if [ "$a" = fuzz ]; then fuzz=1; else presets+=("$a"); fi
done
jobs=$(nproc 2>/dev/null || echo 2)
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
for p in "${presets[@]}"; do
  echo "=== sgm tests: $p ==="
  cmake --preset "$p" >/dev/null
  cmake --build --preset "$p" -j "$jobs"
  ctest --preset "$p" -j "$jobs"
done
if [ "$fuzz" = 1 ]; then
  SGM_FUZZ_SECONDS=${SGM_FUZZ_SECONDS:-20} tests/fuzz/run_fuzz.sh
fi
echo "=== sgm tests: all configurations passed (${presets[*]}$([ "$fuzz" = 1 ] && echo ' fuzz')) ==="
