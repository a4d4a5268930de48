#!/usr/bin/env bash
# Build and run the whole test suite in the three configurations sgm is held
# to: release, debug with ASan+UBSan, and TSan. Exits non-zero on the first
# configuration that fails. Usage: tests/run_all.sh [preset...]
set -euo pipefail
cd "$(dirname "$0")/.."
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(release asan tsan)
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
echo "=== sgm tests: all configurations passed (${presets[*]}) ==="
