#!/usr/bin/env bash
# The README's two commands are the project's contract: the second (the test
# command) must appear verbatim in .ci/run, and both must be single lines
# that install what they need with apt-get.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mapfile -t cmds < <(awk '/^```sh$/{f=1;next} /^```$/{f=0} f' "$root/README.md" | head -n 2)
[ "${#cmds[@]}" -eq 2 ] || { echo "README: expected two one-line commands at the top"; exit 1; }
for c in "${cmds[@]}"; do
  case "$c" in "apt-get update && apt-get install -y "*) ;; *) echo "README command does not start by installing: $c"; exit 1;; esac
done
grep -qxF -- "${cmds[1]}" "$root/.ci/run" || { echo ".ci/run does not run the README's test command verbatim"; exit 1; }
echo "README commands and .ci/run agree"
