#!/usr/bin/env bash
# Every benchmark builds against the installed public headers only (issue 11,
# "done when"): install this build into a prefix inside it, then configure and
# build benchmarks/ on its own against that prefix (find_package(sgm)). A
# benchmark that includes an internal header (lib/*.h) or calls an sgm__
# function fails here: neither is installed. The prefix and the build folder
# keep their paths from run to run, so ccache (when installed) serves the
# compiles after the first.
# Usage: check_bench_installed.sh <build dir> <source dir> [cmake]
set -euo pipefail
build=$(realpath "$1")
src=$(realpath "$2")
cmake_bin=${3:-cmake}
work="$build/bench-installed"
rm -rf "$work/prefix"
"$cmake_bin" --install "$build" --prefix "$work/prefix" >/dev/null
launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(dirname "$src")}
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
"$cmake_bin" -S "$src/benchmarks" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" "${launcher[@]}" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; echo "benchmarks/ does not configure against the installed sgm"; exit 1; }
"$cmake_bin" --build "$work/build" -j2 >"$work/build.log" 2>&1 ||
  { tail -40 "$work/build.log"; echo "benchmarks/ does not build against the installed sgm"; exit 1; }
# Nothing of the source tree's lib/ or include/ on any compile line.
if grep -rqs -e "-I$src/lib" -e "-I$src/include" -e "-isystem $src/include" "$work/build" --include=flags.make; then
  echo "a benchmark compiles with the source tree's headers, not the installed ones"; exit 1
fi
n=$(find "$work/build" -maxdepth 1 -type f -name 'bench_*' -perm -u+x | wc -l)
[ "$n" -ge 7 ] || { echo "only $n benchmarks built"; exit 1; }
# The node registry's benchmark and sgm-bench's node.* figures too: they read
# the registry through the public reader (include/sgm/node.h).
[ -x "$work/build/bench_node" ] || { echo "bench_node was not built against the installed sgm"; exit 1; }
grep -q "node.smi_json.64" "$work/build/sgm-bench/sgm-bench" ||
  { echo "sgm-bench was built without its node.* figures"; exit 1; }
echo "install_bench_build: $n benchmarks and sgm-replay built against $work/prefix"
