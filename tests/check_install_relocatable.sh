#!/usr/bin/env bash
# An installed sgm can be moved: install into a temporary prefix, move the
# whole tree elsewhere, and check that pkg-config and CMake's find_package
# both answer paths inside the new place (the headers and libraries there),
# never the prefix it was installed with.
# Usage: check_install_relocatable.sh <build dir> [cmake]
set -euo pipefail
build=$1
cmake_bin=${2:-cmake}
tmp=$(mktemp -d /tmp/sgm-reloc-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
"$cmake_bin" --install "$build" --prefix "$tmp/installed" >/dev/null
mv "$tmp/installed" "$tmp/moved"
moved=$(realpath "$tmp/moved")
fail() { echo "relocatable install: $*"; exit 1; }

# pkg-config: -I and -L must point into the moved tree and hold sgm.h / libsgm.
pc=$(find "$moved" -name sgm.pc -print -quit)
[ -n "$pc" ] || fail "no sgm.pc installed"
export PKG_CONFIG_PATH=$(dirname "$pc")
cflags=$(pkg-config --cflags sgm)
libs=$(pkg-config --libs sgm)
inc=$(realpath -m "${cflags#-I}")
inc=${inc%% *}
libdir=$(sed -n 's/^-L\([^ ]*\).*/\1/p' <<<"$libs")
libdir=$(realpath -m "$libdir")
case "$inc" in "$moved"/*) ;; *) fail "pkg-config --cflags says $cflags (not under $moved)";; esac
case "$libdir" in "$moved"/*) ;; *) fail "pkg-config --libs says $libs (not under $moved)";; esac
[ -f "$inc/sgm.h" ] || fail "no sgm.h in $inc"
ls "$libdir"/libsgm.* >/dev/null 2>&1 || fail "no libsgm in $libdir"
echo 'int main(void) { return 0; }' | cat "$inc/sgm.h" - >/dev/null
cc -fsyntax-only $cflags -x c - <<<'#include <sgm.h>
int main(void) { return sgm_status_string(SGM_OK) == 0; }' || fail "sgm.h does not compile with $cflags"

# CMake: the imported target's include directory and library file.
mkdir "$tmp/proj"
cat >"$tmp/proj/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.16)
project(reloc C)
find_package(sgm REQUIRED)
get_target_property(inc sgm::sgm INTERFACE_INCLUDE_DIRECTORIES)
get_target_property(cfgs sgm::sgm IMPORTED_CONFIGURATIONS)
list(GET cfgs 0 cfg)
get_target_property(loc sgm::sgm IMPORTED_LOCATION_${cfg})
file(WRITE "${CMAKE_BINARY_DIR}/answer.txt" "${inc}\n${loc}\n")
CM
"$cmake_bin" -S "$tmp/proj" -B "$tmp/proj/build" -DCMAKE_PREFIX_PATH="$moved" >/dev/null \
  || fail "find_package(sgm) failed in the moved tree"
mapfile -t answer <"$tmp/proj/build/answer.txt"
for p in "${answer[@]}"; do
  [ -e "$p" ] || fail "find_package answered $p, which does not exist"
  case "$(realpath "$p")" in "$moved"/*) ;; *) fail "find_package answered $p (not under $moved)";; esac
done
# The installed programs that link libsgm find the moved one (RUNPATH
# $ORIGIN/../lib), with no LD_LIBRARY_PATH (issue 28 item 11).
for prog in sgm-demo sgm-fallback; do
  exe="$moved/bin/$prog"
  [ -x "$exe" ] || fail "$prog is not installed in $moved/bin"
  got=$(env -u LD_LIBRARY_PATH ldd "$exe" | sed -n 's/.*libsgm\.so[^ ]* => \([^ ]*\).*/\1/p')
  [ -n "$got" ] || fail "$prog: ldd finds no libsgm (no RUNPATH?): $(ldd "$exe" | grep sgm)"
  case "$(realpath "$got")" in "$moved"/*) ;; *) fail "$prog loads $got (not under $moved)";; esac
done
# libsgm-preload.so (built with the CUDA headers) finds libsgm.so beside it ($ORIGIN).
pre=$(find "$moved" -name libsgm-preload.so -print -quit)
if [ -n "$pre" ]; then
  dep=$(env -u LD_LIBRARY_PATH ldd "$pre" | awk '/libsgm\.so/ {print $3; exit}')
  case "$(realpath -m "${dep:-none}")" in "$moved"/*) ;; *) fail "libsgm-preload.so resolves libsgm.so to ${dep:-nothing} (not under $moved)";; esac
fi
echo "relocatable install: pkg-config, find_package and the installed programs answer $moved${pre:+; libsgm-preload.so finds libsgm.so beside it}"
