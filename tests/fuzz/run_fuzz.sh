#!/usr/bin/env bash
# The bounded fuzzing stage of tests/run_all.sh: builds every fuzz target with
# clang's libFuzzer, ASan and UBSan into build/fuzz and fuzzes each for
# SGM_FUZZ_SECONDS (default 25) from a copy of its committed seed corpus.
# A crash, a sanitizer report or a broken invariant fails the stage; the
# input that did it is saved as build/fuzz/crashes/<target>/crash-<sha1> and
# its path printed (rerun it with build/fuzz/tests/<target> <file>; add it to
# tests/fuzz/corpus/<target>/ once the defect is fixed).
# Skips (exit 0, says why) when clang or its libFuzzer runtime is missing.
# Usage: tests/fuzz/run_fuzz.sh [target...]
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
secs=${SGM_FUZZ_SECONDS:-25}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_options fuzz_trace_csv fuzz_trace_minimalloc fuzz_trace_mooncake fuzz_node fuzz_replay_args)

cc=${SGM_FUZZ_CC:-clang}
cxx=${SGM_FUZZ_CXX:-clang++}
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' \
  >"$probe/p.c"
if ! command -v "$cc" >/dev/null || ! command -v "$cxx" >/dev/null ||
   ! "$cc" -fsanitize=fuzzer,address "$probe/p.c" -o "$probe/p" 2>/dev/null; then
  echo "=== sgm fuzzing: skipped: $cc with libFuzzer not found (apt-get install clang libclang-rt-14-dev) ==="
  exit 0
fi

build=$root/build/fuzz
echo "=== sgm fuzzing: ${targets[*]}, ${secs} s each ==="
CC=$cc CXX=$cxx cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Debug -DSGM_DEBUG_LEVEL=3 \
  -DSGM_FUZZ=ON "-DSGM_SANITIZE=address;undefined;fuzzer-no-link" \
  -DSGM_BUILD_BENCHMARKS=OFF -DSGM_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" --target "${targets[@]}"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export SGM_BACKEND=emu SGM_VERBOSE=0
failed=()
for t in "${targets[@]}"; do
  name=${t#fuzz_}
  seeds=$root/tests/fuzz/corpus/$name
  work=$build/corpus/$name
  crashes=$build/crashes/$t
  mkdir -p "$work" "$crashes"
  cp -f "$seeds"/* "$work"/
  dict=()
  [ -f "$root/tests/fuzz/$name.dict" ] && dict=("-dict=$root/tests/fuzz/$name.dict")
  [ "$name" = options ] && dict=("-dict=$root/tests/fuzz/options.dict")
  log=$build/$t.log
  echo "--- $t: fuzzing for ${secs} s (log: $log)"
  # A crash, a leak or a timeout stops the run and saves the input.
  if ! "$build/tests/$t" "$work" "${dict[@]}" -max_total_time="$secs" -max_len=4096 \
        -timeout=20 -rss_limit_mb=4096 -artifact_prefix="$crashes/" -print_final_stats=1 \
        >"$log" 2>&1; then
    echo "!!! $t found a failure; input(s):"
    ls -1 "$crashes"/* 2>/dev/null | sed 's/^/    /' || true
    grep -E "invariant broken|ERROR: |runtime error|SUMMARY" "$log" | head -5 | sed 's/^/    /' || true
    failed+=("$t")
  else
    grep -E "stat::number_of_executed_units|stat::new_units_added" "$log" | tr '\n' ' ' | sed 's/^/    /'
    echo
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== sgm fuzzing: FAILED: ${failed[*]} ==="
  exit 1
fi
echo "=== sgm fuzzing: no crash in ${targets[*]} ==="
