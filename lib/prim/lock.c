/*
 * prim/lock.c — the ordered locks (a lock witness in the manner of jemalloc's)
 * and the futex word waits that let a thread sleep on one buffer's state.
 *
 * Invariants: with SGM_DEBUG >= 2 every thread keeps the ranks of the sgm
 * locks it holds and a lock may only be taken above every rank held; every
 * mutex in libsgm is an sgm_lock, so the witness sees them all, but one: the
 * process-shared robust mutex of a node segment (node.c), which is witnessed
 * through sgm__lock_witness_enter/_note/_leave. A condition variable waits
 * on the sgm_lock's mutex (pthread_cond_wait(&cond, &l->mu)): the lock is
 * held again when the wait returns, so the record stays straight; the waiter
 * holds nothing else that another thread needs to wake it. The one check
 * outside this file is tests/check_locks.sh: no pthread_mutex_lock in lib/
 * but here.
 * Threading: the witness is thread-local; nothing here is shared but the
 * locks and words the callers own.
 */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <linux/membarrier.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define LOCK_MAX_HELD 8
static _Thread_local int held_ranks[LOCK_MAX_HELD];
static _Thread_local const void *held_locks[LOCK_MAX_HELD]; /* an sgm_lock, or a witnessed mutex */
static _Thread_local int n_held;

void sgm__lock_witness_enter(int rank) {
  if (SGM_DEBUG >= 2) {
    for (int i = 0; i < n_held; i++) sgm_assert_internal(held_ranks[i] < rank);
  }
}

void sgm__lock_witness_note(const void *id, int rank) {
  if (SGM_DEBUG >= 2) {
    sgm_assert_internal(n_held < LOCK_MAX_HELD);
    held_ranks[n_held] = rank;
    held_locks[n_held] = id;
    n_held++;
  }
}

void sgm__lock_witness_leave(const void *id) {
  if (SGM_DEBUG >= 2) {
    int i = n_held - 1;
    while (i >= 0 && held_locks[i] != id) i--;
    sgm_assert_internal(i >= 0);
    for (; i + 1 < n_held; i++) {
      held_locks[i] = held_locks[i + 1];
      held_ranks[i] = held_ranks[i + 1];
    }
    n_held--;
  }
}

void sgm__lock_init(sgm_lock *l, int rank) {
  pthread_mutex_init(&l->mu, NULL);
  l->rank = rank;
  l->n_takes = 0;
}

void sgm__lock_destroy(sgm_lock *l) { pthread_mutex_destroy(&l->mu); }

void sgm__lock_take(sgm_lock *l) {
  sgm__lock_witness_enter(l->rank);
  pthread_mutex_lock(&l->mu);
  /* Under the lock, on its cache line: a plain increment made atomic for readers. */
  __atomic_store_n(&l->n_takes, l->n_takes + 1, __ATOMIC_RELAXED);
  sgm__lock_witness_note(l, l->rank);
}

uint64_t sgm__lock_takes(const sgm_lock *l) { return __atomic_load_n(&l->n_takes, __ATOMIC_RELAXED); }

void sgm__lock_drop(sgm_lock *l) {
  sgm__lock_witness_leave(l);
  pthread_mutex_unlock(&l->mu);
}

bool sgm__lock_held(const sgm_lock *l) {
  if (SGM_DEBUG < 2) return true;
  for (int i = 0; i < n_held; i++)
    if (held_locks[i] == (const void *)l) return true;
  return false;
}

/* The hooks lock may stay held: it is the outermost lock, held on purpose
 * while a context (and so the driver) is brought up. */
void sgm__lock_assert_none_held(void) {
  /* Below SGM_DEBUG 2 nothing is recorded: no thread-local read (a call into
   * the dynamic linker in a shared library) on every backend entry. */
  if (SGM_DEBUG < 2) return;
  for (int i = 0; i < n_held; i++) sgm_assert_internal(held_ranks[i] == SGM_LOCK_HOOKS);
}

/* Word waits (Linux futexes, private to the process): a sleeping thread costs
 * the waker one system call, and only a waker that saw the sleeper's flag
 * makes it, so the common path stays a plain atomic store. */
void sgm__word_wait(uint32_t *word, uint32_t expected) {
  /* EAGAIN (the word already changed) and EINTR both mean: look again. */
  (void)syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

void sgm__word_wake_all(uint32_t *word) {
  (void)syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Asymmetric fences (internal.h). Expedited private membarrier: an IPI to
 * each CPU running a thread of this process, no wait for a grace period
 * (Linux 4.14). Under a kernel or a sandbox (seccomp, valgrind) that refuses
 * it, the magazines' owners fall back to an exchange. */
bool sgm__fence_asym;
static pthread_once_t fence_once = PTHREAD_ONCE_INIT;

static void fence_init(void) {
  long cmds = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  if (cmds < 0 || !(cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED)) return;
  if (syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) != 0) return;
  __atomic_store_n(&sgm__fence_asym, true, __ATOMIC_RELEASE);
}

void sgm__fence_setup(void) { pthread_once(&fence_once, fence_init); }

/* Without membarrier nothing is added: both sides then use sequentially
 * consistent operations on their flags, which order themselves. */
void sgm__fence_heavy(void) {
  if (!__atomic_load_n(&sgm__fence_asym, __ATOMIC_RELAXED)) return;
  /* Registered, so it cannot be refused; a failure here would leave the
   * frequent sides unordered: no way on but to stop. */
  while (syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0) {
    if (errno != EINTR) sgm__assert_fail("membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed after "
                                         "registering", __FILE__, __LINE__);
  }
}
