/*
 * prim/fork.c — fork(). A child has one thread, copies of the parent's
 * structures (possibly mid-update under a lock another thread held), the
 * parent's spill file description and no usable device: nothing it does
 * through an inherited context may touch them. A pthread_atfork child handler
 * bumps the fork generation; every public entry compares it with the one its
 * context was created in: one relaxed load on the hot path, no getpid().
 * Moved here from context.c (issue 31) so that the placement files, below the
 * context, check it without calling up.
 * Threading: any thread; the generation is atomic. Calls: error.c.
 */
#include <pthread.h>

#include "internal.h"

unsigned sgm__fork_generation;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_atfork_child(void) { __atomic_add_fetch(&sgm__fork_generation, 1, __ATOMIC_RELAXED); }

static void fork_register(void) { pthread_atfork(NULL, NULL, fork_atfork_child); }

unsigned sgm__fork_watch(void) {
  pthread_once(&fork_once, fork_register);
  return __atomic_load_n(&sgm__fork_generation, __ATOMIC_RELAXED);
}

int sgm__fork_error(long owner_pid, const char *fn) {
  return sgm__error_set(SGM_ERR_UNSUPPORTED,
                        "%s: this context was created by process %ld before fork(); a child "
                        "cannot use it (its memory, device and spill file belong to the parent). "
                        "Create a new context in the child",
                        fn, owner_pid);
}
