#!/usr/bin/env bash
# tests/gpu/bundle.sh — pack sgm's GPU check into a relocatable folder that
# runs on a machine with only the NVIDIA driver, CUDA, Python, PyTorch and
# CuPy: no compiler, no CMake, no Debian package.
#
#   tests/gpu/bundle.sh OUTDIR              configure + build a Release tree in
#                                           build/gpu-bundle (CUDA headers from
#                                           /usr/local/cuda/include), then pack
#   tests/gpu/bundle.sh --from BUILD OUTDIR pack an existing build tree (the
#                                           ctest gpu_bundle uses the tree it
#                                           belongs to)
#
# OUTDIR (created, must not exist or be empty) receives:
#   run.sh                 the check (tests/gpu/run.sh): exits 77 where no GPU
#                          answers, else runs every step in <= 4 minutes
#   bin/                   the black-box API suites (api_*), the example
#                          programs (sgm-demo, sgm-fallback), bench_cuda, sgm-bench,
#                          sgm-alloc-replay (granule map/unmap cost); stripped
#   lib/                   libsgm.so and every shared library the binaries need
#                          that is not in a base system (hwloc, numa, xxhash,
#                          cmocka, Google Benchmark and their own dependencies)
#   py/                    the Python examples, the GPU scripts of tests/gpu/ and
#                          the sgm package (py/sgm) they import
#   MANIFEST               what was packed, from which commit, sizes
# run.sh puts lib/ on LD_LIBRARY_PATH. The driver test double (a file named
# libcuda.so.1) is never packed: the check must reach the real driver.
#
# The folder is checked before this script succeeds: at most 64 MiB (the
# device tool's carry limit), and with lib/ on the library path every library
# of every binary resolves from the folder or from the base system (glibc,
# libstdc++, libgcc_s; `ldd`).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MAX_BYTES=$((64 * 1024 * 1024))
# What any Linux base image has (glibc and the C++ runtime PyTorch needs too).
BASE_LIBS='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s)\.so'

die() { echo "bundle.sh: $*" >&2; exit 1; }

FROM=""
if [ "${1:-}" = "--from" ]; then
  [ $# -eq 3 ] || die "usage: bundle.sh [--from BUILD_DIR] OUTDIR"
  FROM=$(cd "$2" && pwd) || die "no build folder $2"
  shift 2
fi
[ $# -eq 1 ] || die "usage: bundle.sh [--from BUILD_DIR] OUTDIR"
OUTDIR=$1
if [ -e "$OUTDIR" ] && [ -n "$(ls -A "$OUTDIR" 2>/dev/null)" ]; then
  die "$OUTDIR exists and is not empty: give a new folder"
fi
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

# ---- build ----
if [ -z "$FROM" ]; then
  FROM=$REPO/build/gpu-bundle
  CUDA_INC=${CUDA_INCLUDE_DIR:-/usr/local/cuda/include}
  [ -f "$CUDA_INC/cuda.h" ] || die "no cuda.h in $CUDA_INC: the CUDA backend would be built without CUDA (set CUDA_INCLUDE_DIR)"
  echo "bundle.sh: configuring a Release build in $FROM"
  cmake -S "$REPO" -B "$FROM" -DCMAKE_BUILD_TYPE=Release -DSGM_BUILD_TESTS=ON \
    -DSGM_BUILD_BENCHMARKS=ON -DSGM_BUILD_EXAMPLES=ON -DSGM_CUDA_INCLUDE_DIR="$CUDA_INC" >/dev/null
  targets=(sgm sgm-preload sgm-demo sgm-fallback bench_cuda sgm-bench sgm-alloc-replay)
  for src in "$REPO"/tests/api/test_*.c; do
    n=$(basename "$src" .c)
    targets+=("api_$n")
  done
  echo "bundle.sh: building ${targets[*]}"
  cmake --build "$FROM" -j "$(nproc 2>/dev/null || echo 2)" --target "${targets[@]}" >/dev/null
fi

# ---- collect ----
mkdir -p "$OUTDIR/bin" "$OUTDIR/lib" "$OUTDIR/py"
LIBSGM=$(find "$FROM/lib" -maxdepth 1 -name 'libsgm.so.*' -type f | sort | tail -n 1)
[ -n "$LIBSGM" ] || LIBSGM=$(find "$FROM/lib" -maxdepth 1 -name 'libsgm.so' -type f | head -n 1)
[ -n "$LIBSGM" ] || die "no libsgm.so in $FROM/lib: build it first"
grep -q cuGetProcAddress "$LIBSGM" ||
  die "$LIBSGM has no CUDA backend (built without the CUDA headers?)"

bins=()
while IFS= read -r f; do bins+=("$f"); done < <(find "$FROM/tests" -maxdepth 1 -type f -executable -name 'api_*' | sort)
for f in "$FROM/examples/sgm-demo" "$FROM/examples/sgm-fallback" "$FROM/benchmarks/bench_cuda" \
         "$FROM/benchmarks/sgm-bench/sgm-bench" "$FROM/benchmarks/replay/sgm-alloc-replay"; do
  [ -x "$f" ] && bins+=("$f")
done
[ "${#bins[@]}" -gt 0 ] || die "no binary found in $FROM (tests/api_*, examples, benchmarks)"
for b in "${bins[@]}"; do
  n=$(basename "$b")
  case "$n" in api_* | sgm-demo | sgm-fallback | bench_cuda | sgm-bench | sgm-alloc-replay) ;; *) die "unexpected binary $n" ;; esac
  cp "$b" "$OUTDIR/bin/$n"
done
# libsgm.so under its file name, plus the names binaries and scripts ask for.
cp "$LIBSGM" "$OUTDIR/lib/"
# Issue 27: libsgm-preload.so beside libsgm.so (it finds it through $ORIGIN),
# and the unmodified nvcc-built program of the preload step (bin/preload-nvcc;
# only where this machine has nvcc: preload_nvcc.sh says so on the GPU).
PRELOAD_SO=$FROM/preload/libsgm-preload.so
[ -f "$PRELOAD_SO" ] || die "no $PRELOAD_SO: build the sgm-preload target"
cp "$PRELOAD_SO" "$OUTDIR/lib/"
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
if [ -x "$NVCC" ]; then
  "$NVCC" -O2 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
    -gencode arch=compute_90,code=compute_90 -o "$OUTDIR/bin/preload-nvcc" "$REPO/tests/gpu/preload_nvcc.cu" ||
    die "nvcc could not build tests/gpu/preload_nvcc.cu"
fi
soname=$(objdump -p "$LIBSGM" | awk '/SONAME/ {print $2}')
for name in "$soname" libsgm.so; do
  [ -n "$name" ] && [ "$name" != "$(basename "$LIBSGM")" ] && ln -sf "$(basename "$LIBSGM")" "$OUTDIR/lib/$name"
done

# Every non-base library, transitively, from what ldd resolves here.
copy_deps() { # file
  ldd "$1" 2>/dev/null | while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    case "$name" in libsgm.so*) continue ;; esac
    if [[ "$name" =~ $BASE_LIBS ]]; then continue; fi
    [ "$name" = libcuda.so.1 ] && continue # never the driver (or its double)
    [ -f "$path" ] || { echo "bundle.sh: $1 needs $name, which is not found" >&2; exit 1; }
    if [ ! -e "$OUTDIR/lib/$name" ]; then
      cp -L "$path" "$OUTDIR/lib/$name"
      copy_deps "$path"
    fi
  done
}
for f in "$OUTDIR"/bin/* "$LIBSGM" "$OUTDIR/lib/libsgm-preload.so"; do copy_deps "$f"; done

for f in "$REPO"/examples/*.py "$REPO"/tests/gpu/*.py; do cp "$f" "$OUTDIR/py/"; done
# The sgm package next to the scripts (Python puts a script's folder on sys.path).
mkdir -p "$OUTDIR/py/sgm"
cp "$REPO"/python/sgm/*.py "$OUTDIR/py/sgm/"
cp "$REPO/tests/gpu/run.sh" "$OUTDIR/run.sh"
cp "$REPO/tests/gpu/preload_nvcc.sh" "$OUTDIR/preload_nvcc.sh"
chmod +x "$OUTDIR/run.sh"
strip --strip-unneeded "$OUTDIR"/bin/* "$OUTDIR"/lib/*.so* 2>/dev/null || true
if [ -n "$(find "$OUTDIR" -name 'libcuda.so*')" ]; then die "a libcuda.so was packed: never ship the driver or its double"; fi

# ---- check ----
bytes=$(du -sb "$OUTDIR" | cut -f1)
[ "$bytes" -le "$MAX_BYTES" ] || die "$OUTDIR is $bytes bytes, over the 64 MiB a device lease carries"
bad=0
for f in "$OUTDIR"/bin/* "$OUTDIR"/lib/*.so*; do
  out=$(LD_LIBRARY_PATH="$OUTDIR/lib" ldd "$f" 2>&1) || true
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [ "$name" = libcuda.so.1 ] && continue
    if [ "$path" = "not" ]; then
      echo "bundle.sh: $(basename "$f"): $name not found" >&2; bad=1
    elif [[ "$path" != "$OUTDIR/lib/"* ]] && ! [[ "$name" =~ $BASE_LIBS ]]; then
      echo "bundle.sh: $(basename "$f"): $name resolves outside the bundle ($path)" >&2; bad=1
    fi
  done <<<"$out"
done
[ "$bad" -eq 0 ] || die "library resolution check failed"

{
  echo "sgm GPU check bundle"
  echo "commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "built from: $FROM"
  echo "size: $bytes bytes"
  (cd "$OUTDIR" && find . -type f -o -type l | sort | sed 's/^\.\///')
} >"$OUTDIR/MANIFEST"
echo "bundle.sh: $OUTDIR: $((bytes / 1024)) KiB, ${#bins[@]} binaries, $(ls "$OUTDIR/lib" | wc -l) libraries; every library resolves"
