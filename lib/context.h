/*
 * context.h — the layout of sgm_context, one floor below the file that builds
 * it (lib/LAYERS: context-state, under context.c), so that the accessors
 * (context_state.c) and the context's services (stats.c, share.c,
 * capture.c) read a context without calling up into context.c (issue 31).
 *
 * Who includes it: context.c (create, destroy, the allocation entry points),
 * context_state.c (the accessors internal.h
 * declares, which the services, hooks.c and the tests call), and stats.c and
 * capture.c for the fork check below. Placement and every lower floor read
 * the context through sgm_context_parts (placement.h), never this header:
 * the layer check fails on such an include. The struct stays opaque to
 * users (include/sgm.h).
 *
 * Locks: ctx->lock (rank SGM_LOCK_CONTEXT) guards the VRAM fraction and
 * budget after create, the idle-trim clock and the fallback callback;
 * ctx->idle_mu the idle thread's stop flag; the counters are atomics; the
 * rest is written only while the context is created, before another thread
 * sees it.
 */
#ifndef SGM_CONTEXT_H
#define SGM_CONTEXT_H

#include <stddef.h>

#include "internal.h"
#include "placement/placement.h"

/* The context. */
struct sgm_context {
  sgm_context_parts parts;                 /* first: what placement reads (placement.h): cfg,
                                              bops, be, tiers, budget, pl, managed */
  sgm_config cfg;                          /* as resolved at create (TF override applied); never
                                              written after create: sgm_context_config hands it out */
  double vram_fraction;                    /* the VRAM fraction in force (guarded by lock) */
  uint64_t device_total_bytes;             /* device memory as the backend reported at create */
  uint64_t physical_ram_bytes;             /* min(machine RAM, cgroup limit) at create */
  uint64_t cuda_memory_limit_bytes;        /* CUDA_DEVICE_MEMORY_LIMIT cap; 0 = none */
  char cuda_memory_limit_name[SGM_CUDA_LIMIT_NAME_MAX]; /* the variable that set it (_<device> or not) */
  uint64_t budget_bytes[SGM_TIER_COUNT];   /* each tier's budget, resolved at create */
  uint64_t n_bad_frees;                    /* frees refused: foreign pointer or double free */
  uint64_t n_fallbacks;                    /* allocations that wanted VRAM and got shared */
  uint64_t fallback_bytes;                 /* bytes of those */
  sgm_lock lock;                           /* guards the callback and the idle thread state */
  sgm_fallback_fn fallback_fn;             /* user's fallback callback, NULL = none */
  void *fallback_user;                     /* its argument */
  uint64_t (*clock_ms)(void *user);        /* the idle-trim clock (monotonic ms; tests inject) */
  void *clock_user;                        /* its argument */
  pthread_t idle_thread;                   /* runs sgm__context_idle_tick every idle_ms / 4 */
  pthread_cond_t idle_cond;                /* wakes the idle thread to stop */
  sgm_lock idle_mu;                        /* guards idle_stop for the condition variable */
  bool idle_running;                       /* the idle thread was started */
  bool idle_stop;                          /* asks the idle thread to end */
  struct sgm_share *share;                 /* share.c: the node registry and fair budgets; NULL = untracked */
  uint64_t interposed_vram_bytes;          /* device memory the program took from the driver itself,
                                              as an interposer reports it (sgm_interpose_vram; atomic) */
  uint64_t interposed_vram_peak;           /* the highest interposed_vram_bytes seen (atomic) */
  bool interposed;                         /* an interposer (libsgm-preload.so) drives this context */
  struct sgm_capture *capture;             /* capture.c: capture pools (made at create) */
};
/* placement.h reads the parts through the context's pointer: they come first. */
_Static_assert(offsetof(struct sgm_context, parts) == 0, "sgm_context_parts must be sgm_context's first member");

/* fork(): the generation and its message live in prim/fork.c; the context
 * keeps the one it was created in (parts.fork_generation). Inline: every
 * public entry asks, sgm_alloc and sgm_free included. */

/* True in a child of the process that created ctx: every public entry asks
 * (one relaxed load) and answers sgm__context_fork_error. */
static inline bool sgm__context_forked(const sgm_context *ctx) {
  return sgm__fork_stale(ctx->parts.fork_generation);
}
/* Set "fn: this context was created by process P before fork() ..." and
 * return SGM_ERR_UNSUPPORTED. */
static inline int sgm__context_fork_error(const sgm_context *ctx, const char *fn) {
  return sgm__fork_error(ctx->parts.owner_pid, fn);
}

#endif /* SGM_CONTEXT_H */
