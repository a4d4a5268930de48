#!/usr/bin/env bash
# Issue 28 item 10: a non-root user under the stock 8 MiB `ulimit -l` runs the
# README's demo and it succeeds: sgm keeps the shared tier within the
# locked-memory limit and says so in one line, instead of `demo FAILED`.
# Runs the demo as nobody (setpriv) under prlimit; needs root for that (CI
# runs as root): exit 77 (skipped) otherwise, saying so.
# Usage: check_demo_memlock.sh <sgm-demo>
set -euo pipefail
demo=$(realpath "$1")
if [ "$(id -u)" != 0 ] || ! command -v setpriv >/dev/null || ! command -v prlimit >/dev/null; then
  echo "check_demo_memlock: skipped: needs root, setpriv and prlimit to run the demo as another user"
  exit 77
fi
dir=$(mktemp -d /tmp/sgm-memlock-XXXXXX)
trap 'rm -rf "$dir"' EXIT
chmod 777 "$dir"
cd "$dir"
set +e
out=$(SGM_VERBOSE=1 SGM_BACKEND=emu SGM_SPILL_DIR="$dir" setpriv --reuid=65534 --regid=65534 --clear-groups \
      prlimit --memlock=8388608:8388608 "$demo" 2>&1)
rc=$?
set -e
grep -E "locked-memory limit|demo done|demo FAILED|skipped" <<<"$out" | head -5 || true
[ "$rc" = 0 ] || { echo "check_demo_memlock: the demo exited $rc under ulimit -l 8 MiB"; exit 1; }
grep -q "the locked-memory limit (ulimit -l) leaves" <<<"$out" ||
  { echo "check_demo_memlock: no line explaining the locked-memory limit"; exit 1; }
grep -q "demo done" <<<"$out" || { echo "check_demo_memlock: the demo did not finish"; exit 1; }
echo "check_demo_memlock: the demo succeeds under ulimit -l 8 MiB and says why the shared tier is small"
