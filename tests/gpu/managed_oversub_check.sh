#!/usr/bin/env bash
# managed_oversub_check.sh — ctest gpu_managed_oversub_dry_run: the GPU check's
# managed-mode step (managed_oversub.py) sizes its job right without a GPU or
# PyTorch: on an 80 GiB card and a 2 GiB one the managed memory it would ask
# for is 1.5x the limit and never more than what is free, and a card with too
# little free memory is refused with a message instead of being run.
#   managed_oversub_check.sh PYTHON
set -u
PY=${1:-python3}
S=$(dirname "${BASH_SOURCE[0]}")/managed_oversub.py
fail() { echo "managed_oversub_check: $*"; exit 1; }
for free in 85899345920 2147483648; do
  out=$("$PY" "$S" --dry-run --free-bytes "$free") || fail "dry run with $free bytes free failed: $out"
  echo "$out"
  echo "$out" | grep -q "(1.5x)" || fail "no 1.5x plan for $free bytes free"
done
out=$("$PY" "$S" --dry-run 2>&1) || fail "dry run with the default size failed: $out"
out=$("$PY" "$S" --dry-run --free-bytes 100000000 2>&1) && fail "100 MB free was not refused: $out"
echo "$out" | grep -q "leave no room" || fail "refusal without its reason: $out"
echo "managed_oversub_check: sizes checked"
