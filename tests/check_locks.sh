#!/usr/bin/env bash
# Invariant (issue 11 item 4): every mutex in lib/ is under the ranked lock
# witness (lib/prim/lock.c). A mutex is an sgm_lock (taken with
# sgm__lock_take), so no file in lib/ but prim/lock.c (and the
# SGM_LOCK_INITIALIZER macro in internal.h) locks or statically initialises a
# pthread mutex itself; a file that takes a pthread mutex another way (a
# process-shared robust mutex with trylock/timedlock, as node.c's layout 2
# had) reports it to the witness (sgm__lock_witness_note). Prints each offending line; exits 1 on any.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bad=0
raw=$(grep -rnE 'pthread_mutex_lock\(|PTHREAD_MUTEX_INITIALIZER|pthread_rwlock_|pthread_spin_' lib \
  --include='*.c' --include='*.h' | grep -vE '^lib/prim/lock\.c:|^lib/internal\.h:[0-9]+:#define SGM_LOCK_INITIALIZER' || true)
if [ -n "$raw" ]; then
  echo "a mutex outside the lock witness (make it an sgm_lock with a rank in lib/internal.h):"
  echo "$raw"
  bad=1
fi
for f in $(grep -rlE 'pthread_mutex_(trylock|timedlock)\(' lib --include='*.c' | grep -v '^lib/prim/lock\.c$' || true); do
  if ! grep -q 'sgm__lock_witness_note(' "$f"; then
    echo "$f takes a pthread mutex without telling the witness (sgm__lock_witness_enter/_note/_leave)"
    bad=1
  fi
done
[ "$bad" -eq 0 ] && echo "every mutex in lib/ is under the lock witness"
exit "$bad"
