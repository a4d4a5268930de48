#!/usr/bin/env bash
# check_demo_plot.sh SGM_DEMO — the ctest example_demo_plot: `sgm-demo --plot
# out.png` writes its record (out.csv, docs/record-format.md: the header, then
# rows of this process) and a 1200x800 PNG drawn by python3 -m sgm.plot
# ($SGM_PYTHON; the package found next to the sources, as in a build tree).
# Without --plot's interpreter it must say so and fail, never pretend.
set -euo pipefail
demo=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "example_demo_plot: $*"; exit 1; }
"$demo" --plot "$tmp/demo.png" >"$tmp/log" 2>&1 || { cat "$tmp/log"; fail "sgm-demo --plot failed"; }
grep -q "sgm.plot: wrote $tmp/demo.png (1200x800)" "$tmp/log" || { cat "$tmp/log"; fail "no plot line"; }
header='time_s,device,pid,name,vram_used,vram_budget,shared_used,shared_budget,disk_used,vram_peak,fallbacks,evictions,device_total,shared_cap'
[ "$(head -n 1 "$tmp/demo.csv")" = "$header" ] || fail "demo.csv does not start with the header"
rows=$(($(wc -l <"$tmp/demo.csv") - 1))
[ "$rows" -ge 100 ] || fail "demo.csv has only $rows samples"
awk -F, 'NR > 1 && (NF != 14 || $4 != "sgm-demo" || $11 < prev11) { bad = 1 } NR > 1 { prev11 = $11 }
         END { exit bad }' "$tmp/demo.csv" || fail "a row of demo.csv is malformed or a count went down"
[ "$(head -c 8 "$tmp/demo.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "demo.png is not a PNG"
# A missing interpreter, or one without matplotlib, is reported before the run.
rc=0
SGM_PYTHON=/nonexistent/python3 "$demo" --plot "$tmp/again.png" >"$tmp/log2" 2>&1 || rc=$?
[ "$rc" -eq 2 ] || fail "--plot without python3 exited $rc, not 2"
grep -q "cannot run /nonexistent/python3" "$tmp/log2" || { cat "$tmp/log2"; fail "no message for a missing python3"; }
printf '#!/bin/sh\nexec %s -c "import sys; sys.exit(1)"\n' "${SGM_PYTHON:-python3}" >"$tmp/nompl"
chmod +x "$tmp/nompl"
rc=0
SGM_PYTHON=$tmp/nompl "$demo" --plot "$tmp/again.png" >"$tmp/log3" 2>&1 || rc=$?
[ "$rc" -eq 2 ] || fail "--plot with a python3 that cannot import matplotlib exited $rc, not 2"
grep -q "cannot import matplotlib (apt-get install python3-matplotlib" "$tmp/log3" || { cat "$tmp/log3"; fail "no message for a missing matplotlib"; }
echo "example_demo_plot: $rows samples, demo.png $(stat -c %s "$tmp/demo.png") bytes"
