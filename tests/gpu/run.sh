#!/usr/bin/env bash
# tests/gpu/run.sh — GPU validation of sgm on a machine with an NVIDIA GPU.
#
# Without a GPU (no nvidia-smi, nvidia-smi fails, or no /dev/nvidia0) it exits
# 77 ("skipped") at once. Otherwise, within 8 minutes in all, it:
#   1. configures and builds sgm (Release, tests and benchmarks on) in
#      build/gpu-validation (override: GPU_VALIDATION_BUILD_DIR);
#   2. runs the regular test suites (emulated device and the driver test
#      double) as a sanity check of the build;
#   3. opens the real device through libsgm.so (python3 ctypes smoke test);
#   4. runs every black-box API suite (build/.../tests/api_*) with
#      SGM_BACKEND=cuda on the real device (the real libcuda.so.1, no double);
#   5. runs examples/pytorch_allocator.py and examples/cupy_allocator.py, when
#      present, with SGM_VRAM_LIMIT=$VRAM_LIMIT (the examples make their work
#      1.5x that limit) and the built libsgm.so as their argument;
#   6. runs the bandwidth benchmarks build/.../benchmarks/bench_cuda*, when
#      present (90 s each at most); their "bench_cuda: ..." result lines (GB/s
#      and ratios, docs/cuda.md) are repeated in the SUMMARY;
# and prints a SUMMARY block. Exit status: 0 when no step failed, 1 otherwise,
# 77 without a GPU. No network is needed.
#
# Usage: tests/gpu/run.sh            (from anywhere; needs cmake, a C/C++
#                                     compiler, the CUDA headers, python3)
# Env:   GPU_VALIDATION_BUILD_DIR  build folder (default <repo>/build/gpu-validation)
#        GPU_VALIDATION_VRAM_LIMIT VRAM limit in bytes for the framework examples
#                           (default 1 GiB: small enough to spill quickly)
#        GPU_VALIDATION_JOBS       build parallelism (default: nproc)
set -u
set -o pipefail

# ---- no GPU: skip at once ----
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu validation: skipped: nvidia-smi not found (no NVIDIA driver)"
  exit 77
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu validation: skipped: nvidia-smi fails (no usable NVIDIA GPU)"
  exit 77
fi
if [ ! -e /dev/nvidia0 ]; then
  echo "gpu validation: skipped: /dev/nvidia0 does not exist"
  exit 77
fi

TOTAL_BUDGET_S=470          # 8 minutes, less 10 s for the summary
START_S=$(date +%s)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${GPU_VALIDATION_BUILD_DIR:-$REPO/build/gpu-validation}
JOBS=${GPU_VALIDATION_JOBS:-$(nproc 2>/dev/null || echo 4)}
VRAM_LIMIT=${GPU_VALIDATION_VRAM_LIMIT:-1073741824}
LOG_DIR=$BUILD/gpu-validation-logs

STEP_NAMES=()
STEP_RESULTS=()
STEP_SECONDS=()
STEP_NOTES=()
RESULT_LINES=()  # benchmark figures repeated in the SUMMARY

remaining_s() {
  local left=$((TOTAL_BUDGET_S - ($(date +%s) - START_S)))
  [ "$left" -lt 0 ] && left=0
  echo "$left"
}

record() { # name result seconds note
  STEP_NAMES+=("$1")
  STEP_RESULTS+=("$2")
  STEP_SECONDS+=("$3")
  STEP_NOTES+=("$4")
  printf '== %-40s %s (%ss) %s\n' "$1" "$2" "$3" "$4"
}

# run_step NAME MAX_SECONDS CMD... : runs CMD under `timeout` (capped by what
# is left of the 8 minutes), logs to $LOG_DIR/NAME.log, records PASS/FAIL.
run_step() {
  local name=$1 max=$2
  shift 2
  local left
  left=$(remaining_s)
  if [ "$left" -lt 5 ]; then
    record "$name" SKIP 0 "no time left in the 8-minute budget"
    return 1
  fi
  [ "$max" -gt "$left" ] && max=$left
  local log="$LOG_DIR/${name//[^A-Za-z0-9_.-]/_}.log"
  local t0 rc
  t0=$(date +%s)
  echo "-- $name (timeout ${max}s, log $log)"
  timeout --kill-after=5 "$max" "$@" >"$log" 2>&1
  rc=$?
  local dt=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    record "$name" PASS "$dt" ""
  elif [ "$rc" -eq 77 ]; then
    record "$name" SKIP "$dt" "the step skipped itself (exit 77)"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    record "$name" FAIL "$dt" "timed out after ${max}s"
    tail -n 20 "$log" | sed 's/^/   | /'
  else
    record "$name" FAIL "$dt" "exit $rc"
    tail -n 20 "$log" | sed 's/^/   | /'
  fi
  return "$rc"
}

mkdir -p "$LOG_DIR" || { echo "cannot create $LOG_DIR"; exit 1; }
echo "gpu validation of sgm in $REPO"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
  sed 's/^/   GPU /'

# ---- 1. configure and build ----
# The build keeps going past a broken target, and the checks below run on
# whatever was built: one broken unit test must not hide the GPU results (the
# build step still counts as FAIL).
BUILD_OK=0
LIBSGM=""
if run_step configure 90 cmake -S "$REPO" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
     -DSGM_BUILD_TESTS=ON -DSGM_BUILD_BENCHMARKS=ON -DSGM_BUILD_EXAMPLES=ON; then
  KEEP_GOING=(-- -k)
  [ -f "$BUILD/build.ninja" ] && KEEP_GOING=(-- -k 0)
  run_step build 240 cmake --build "$BUILD" -j "$JOBS" "${KEEP_GOING[@]}"
  LIBSGM=$(find "$BUILD/lib" -maxdepth 1 -name 'libsgm.so*' -type f 2>/dev/null | head -n 1)
  if [ -n "$LIBSGM" ]; then
    BUILD_OK=1
  fi
fi

if [ "$BUILD_OK" -eq 1 ]; then
  # ---- 2. the regular suites (emulated device, driver test double) ----
  run_step ctest-emu-and-double 120 ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" \
    -LE gpu

  # ---- 3. smoke: libsgm.so opens the real device ----
  if [ -n "$LIBSGM" ] && command -v python3 >/dev/null 2>&1; then
    run_step smoke-real-device 60 env SGM_BACKEND=cuda SGM_VERBOSE=2 LIBSGM_PATH="$LIBSGM" \
      python3 - <<'PY'
import ctypes, os, sys
lib = ctypes.CDLL(os.environ["LIBSGM_PATH"])
lib.sgm_last_error.restype = ctypes.c_char_p
lib.sgm_alloc.restype = ctypes.c_void_p
lib.sgm_alloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
lib.sgm_free.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
lib.sgm_pointer_tier.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.sgm_context_destroy.argtypes = [ctypes.c_void_p]
lib.sgm_stats_json.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
lib.sgm_string_free.argtypes = [ctypes.c_void_p]
ctx = ctypes.c_void_p()
rc = lib.sgm_context_create(None, ctypes.byref(ctx))
if rc != 0:
    sys.exit("sgm_context_create on the real device failed: %d %s" % (rc, lib.sgm_last_error().decode()))
p = lib.sgm_alloc(ctx, 64 << 20, None)
if not p:
    sys.exit("sgm_alloc(64 MiB) failed: " + lib.sgm_last_error().decode())
tier = lib.sgm_pointer_tier(ctx, p)
print("64 MiB allocation at 0x%x in tier %d" % (p, tier))
js = ctypes.c_void_p()
if lib.sgm_stats_json(ctx, ctypes.byref(js)) == 0 and js.value:
    print(ctypes.cast(js, ctypes.c_char_p).value.decode()[:2000])
    lib.sgm_string_free(js)
lib.sgm_free(ctx, p, None)
lib.sgm_context_destroy(ctx)
if tier != 0:
    sys.exit("a small allocation on an idle GPU should be in VRAM (tier 0), got %d" % tier)
PY
  else
    record smoke-real-device SKIP 0 "libsgm.so or python3 missing"
  fi

  # ---- 4. the API suites on the real device ----
  mapfile -t API_SUITES < <(find "$BUILD/tests" -maxdepth 1 -type f -executable -name 'api_*' 2>/dev/null | sort)
  if [ "${#API_SUITES[@]}" -eq 0 ]; then
    record api-suites-cuda SKIP 0 "no API suite was built (tests/api/ is empty)"
  else
    for suite in "${API_SUITES[@]}"; do
      run_step "cuda-$(basename "$suite")" 120 env SGM_BACKEND=cuda SGM_VERBOSE=0 "$suite"
    done
  fi

  # ---- 5. framework examples, 1.5x the VRAM limit ----
  for ex in pytorch_allocator cupy_allocator; do
    script="$REPO/examples/$ex.py"
    if [ ! -f "$script" ]; then
      record "example-$ex" SKIP 0 "examples/$ex.py does not exist yet"
      continue
    fi
    # The examples size their work at 1.5x SGM_VRAM_LIMIT and take libsgm.so as argv[1].
    run_step "example-$ex" 120 env SGM_BACKEND=cuda SGM_VERBOSE=1 \
      SGM_VRAM_LIMIT="$VRAM_LIMIT" python3 "$script" "$LIBSGM"
    # An example that skipped itself (no PyTorch / CuPy / GPU) exits 0: say SKIP.
    last=$((${#STEP_RESULTS[@]} - 1))
    if [ "${STEP_RESULTS[$last]}" = PASS ] &&
       grep -q 'skipping' "$LOG_DIR/example-$ex.log" 2>/dev/null; then
      STEP_RESULTS[last]=SKIP
      STEP_NOTES[last]="$(grep -m1 'skipping' "$LOG_DIR/example-$ex.log")"
    fi
  done

  # ---- 6. bandwidth benchmarks ----
  mapfile -t BENCHES < <(find "$BUILD/benchmarks" -maxdepth 2 -type f -executable -name 'bench_cuda*' 2>/dev/null | sort)
  if [ "${#BENCHES[@]}" -eq 0 ]; then
    record bench-cuda SKIP 0 "no benchmarks/bench_cuda* binary was built"
  else
    for b in "${BENCHES[@]}"; do
      name=$(basename "$b")
      log="$LOG_DIR/bench-$name.log"
      # Fixed iteration counts keep bench_cuda near 30 s on a current GPU; the
      # 90 s cap (and what is left of the 8 minutes) bounds it anyway.
      run_step "bench-$name" 90 env SGM_BACKEND=cuda SGM_VERBOSE=0 "$b" --benchmark_color=false
      # Benchmarks report numbers: show them in the run's output, not only the log.
      tail -n 30 "$log" 2>/dev/null | sed 's/^/   | /'
      # A binary that skipped itself (no CUDA headers at build time, no usable
      # device) exits 0: say SKIP, with its reason.
      last=$((${#STEP_RESULTS[@]} - 1))
      if [ "${STEP_RESULTS[$last]}" = PASS ] && grep -q 'skipping' "$log" 2>/dev/null; then
        STEP_RESULTS[last]=SKIP
        STEP_NOTES[last]="$(grep -m1 'skipping' "$log")"
      fi
      # The result lines: "<binary>: <pair>: ... GB/s ... | ratio".
      while IFS= read -r line; do
        RESULT_LINES+=("$line")
      done < <(grep -E "^${name}: (H2D|D2H|kernel read|device)" "$log" 2>/dev/null)
    done
  fi
else
  record tests SKIP 0 "libsgm.so was not built: nothing to run"
fi

# ---- summary ----
n_fail=0
n_pass=0
n_skip=0
echo
echo "==================== SUMMARY: sgm GPU validation ===================="
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
  sed 's/^/GPU: /'
echo "build: $BUILD   logs: $LOG_DIR"
for i in "${!STEP_NAMES[@]}"; do
  printf '%-5s %-42s %5ss  %s\n' "${STEP_RESULTS[$i]}" "${STEP_NAMES[$i]}" "${STEP_SECONDS[$i]}" \
    "${STEP_NOTES[$i]}"
  case "${STEP_RESULTS[$i]}" in
    PASS) n_pass=$((n_pass + 1)) ;;
    FAIL) n_fail=$((n_fail + 1)) ;;
    *) n_skip=$((n_skip + 1)) ;;
  esac
done
if [ "${#RESULT_LINES[@]}" -gt 0 ]; then
  echo "bandwidth (GB/s = 10^9 B/s; sgm/direct: sgm's copy over cuMemcpy on pinned memory;"
  echo "           shared/VRAM: a kernel reading the shared tier over one reading VRAM):"
  printf '  %s\n' "${RESULT_LINES[@]}"
fi
echo "total: $n_pass passed, $n_fail failed, $n_skip skipped in $(($(date +%s) - START_S))s"
echo "======================================================================"
[ "$n_fail" -eq 0 ] && exit 0
exit 1
