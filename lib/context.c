/*
 * context.c — sgm_context: resolving the configuration into budgets, opening
 * the backend, building the tiers, and the allocation entry points.
 *
 * Invariants: a context exists only fully built (create either succeeds or
 * leaves nothing behind); budgets are fixed at create.
 * Threading: every entry point is safe from any thread; the tiers lock
 * themselves, the context's own counters are atomics.
 *
 * Layer (lib/LAYERS): context, the top. Its layout is context.h's and its
 * accessors are context_state.c's, one floor down, so that the services it
 * calls (share.c's registry, capture.c's pools, stats.c) read the context
 * without calling back up; capture.c frees a released pool's blocks through
 * the sgm_free_ex this file registers at create. Calls down: those, the
 * placement entry points, the tiers, the backend, options and admin.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "backend/backend.h"
#include "context.h"
#include "internal.h"
#include "placement/placement.h"
#include "tiers/disk.h"
#include "tiers/tier.h"

/* The shared pool's floor, as Windows: max(RAM / 2, 64 MiB). */
#define CONTEXT_SHARED_MIN_BYTES (UINT64_C(64) << 20)
/* VRAM growth chunks stop doubling at 1 GiB: past that, doubling would commit
 * far more than the workload asked for, for little saving in driver calls. */
#define CONTEXT_VRAM_MAX_CHUNK (UINT64_C(1) << 30)
/* Shared chunks stop at 64 MiB: pinning is paid up front (the pages are
 * faulted in and locked), so a big chunk costs latency on the allocation that
 * takes it and keeps RAM locked that nobody uses yet. */
#define CONTEXT_SHARED_MAX_CHUNK (UINT64_C(64) << 20)
/* The idle thread looks four times per delay, so a chunk goes back between
 * one and 1.25 delays after it was last used; never more often than 10 ms. */
#define CONTEXT_IDLE_TICKS_PER_DELAY 4
#define CONTEXT_IDLE_MIN_PERIOD_MS 10

static uint64_t context_monotonic_ms(void *user) {
  (void)user;
  return sgm__clock_monotonic_ns() / 1000000u;
}

void sgm__context_set_clock(sgm_context *ctx, uint64_t (*clock_ms)(void *user), void *user) {
  sgm__lock_take(&ctx->lock);
  ctx->clock_ms = clock_ms ? clock_ms : context_monotonic_ms;
  ctx->clock_user = clock_ms ? user : NULL;
  sgm__lock_drop(&ctx->lock);
}

uint64_t sgm__context_idle_tick(sgm_context *ctx) {
  uint64_t now = sgm__context_now_ms(ctx);
  uint64_t returned = 0;
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    if (!ctx->parts.tiers[t]) continue;
    /* Cached blocks whose streams' work has completed go back to the pool,
     * so that wholly free chunks can be seen and returned. */
    if (sgm__tier_has_cached(ctx->parts.tiers[t])) sgm__tier_reclaim(ctx->parts.tiers[t], NULL, SGM_RECLAIM_QUERY);
    returned += sgm__tier_idle_trim(ctx->parts.tiers[t], now, ctx->cfg.idle_trim_ms);
  }
  /* Disk blocks kept for reuse and the pinned staging, unused for the delay. */
  returned += sgm__placement_idle_trim(ctx, now, ctx->cfg.idle_trim_ms);
  /* Managed blocks in shared memory take the VRAM room that has appeared;
   * cached movable ranges unused for the idle delay go back. */
  if (ctx->parts.managed) {
    returned += sgm__managed_cache_idle(ctx, now, ctx->cfg.idle_trim_ms);
    sgm__managed_promote(ctx, UINT64_MAX);
  }
  if (returned) {
    char b[32];
    sgm__log(ctx->cfg.verbose, 3, "idle trim returned %s", sgm__fmt_bytes(returned, b, sizeof b));
  }
  return returned;
}

static void *context_idle_main(void *arg) {
  sgm_context *ctx = arg;
  uint64_t period = ctx->cfg.idle_trim_ms / CONTEXT_IDLE_TICKS_PER_DELAY;
  if (period < CONTEXT_IDLE_MIN_PERIOD_MS) period = CONTEXT_IDLE_MIN_PERIOD_MS;
  sgm__lock_take(&ctx->idle_mu);
  while (!ctx->idle_stop) {
    struct timespec until = sgm__clock_deadline(period);
    int rc = 0;
    while (!ctx->idle_stop && rc != ETIMEDOUT)
      rc = pthread_cond_timedwait(&ctx->idle_cond, &ctx->idle_mu.mu, &until);
    if (ctx->idle_stop) break;
    sgm__lock_drop(&ctx->idle_mu);
    sgm__context_idle_tick(ctx);
    sgm__lock_take(&ctx->idle_mu);
  }
  sgm__lock_drop(&ctx->idle_mu);
  return NULL;
}

static int context_start_idle_thread(sgm_context *ctx) {
  sgm__clock_cond_init(&ctx->idle_cond);
  sgm__lock_init(&ctx->idle_mu, SGM_LOCK_IDLE);
  if (ctx->cfg.idle_trim_ms == 0) return SGM_OK;
  int e = pthread_create(&ctx->idle_thread, NULL, context_idle_main, ctx);
  if (e != 0)
    return sgm__error_set(SGM_ERR_NOMEM, "cannot start the idle-trim thread: %s (set "
                          "SGM_IDLE_TRIM_MS=0 to run without it)", strerror(e));
  ctx->idle_running = true;
  return SGM_OK;
}

static void context_stop_idle_thread(sgm_context *ctx) {
  if (ctx->idle_running) {
    sgm__lock_take(&ctx->idle_mu);
    ctx->idle_stop = true;
    pthread_cond_signal(&ctx->idle_cond);
    sgm__lock_drop(&ctx->idle_mu);
    pthread_join(ctx->idle_thread, NULL);
    ctx->idle_running = false;
  }
  pthread_cond_destroy(&ctx->idle_cond);
  sgm__lock_destroy(&ctx->idle_mu);
}

/* ------------------------------------------------------------------------ */
/* Budgets. Each resolves at create (the VRAM one also when a framework sets a
 * memory fraction) and must hold at least one block: a budget below
 * SGM_DEVICE_ALIGN (256 bytes, the granule of every allocation) can never
 * hand anything out, so it is a mistake in the setting that made it so, and
 * the message names that setting. The floor is one block and not more on
 * purpose: sgm-replay simulates caches of a few KiB. */

/* VRAM budget = device total × fraction, capped by SGM_VRAM_LIMIT and by
 * CUDA_DEVICE_MEMORY_LIMIT; aligned down to the device alignment. *out = 0
 * and SGM_ERR_INVALID naming the setting that brought it below one block. */
static int context_vram_budget(const sgm_context *ctx, double fraction, const char *fraction_name,
                               uint64_t *out) {
  *out = 0;
  uint64_t total = ctx->device_total_bytes;
  /* In long double, so total = 2^64 - 1 cannot overflow the conversion back. */
  long double want = (long double)total * (long double)fraction;
  uint64_t b = want >= (long double)total ? total : (uint64_t)want;
  const char *why = fraction_name;
  uint64_t cap = sgm__size_resolve(ctx->cfg.vram_limit, total, UINT64_MAX);
  if (cap < b) {
    b = cap;
    why = "SGM_VRAM_LIMIT";
  }
  uint64_t admin = sgm__admin_vram_cap(sgm__admin_current(), (uint32_t)geteuid(), true, total);
  if (admin < b) {
    b = admin;
    why = "the admin policy's vram_cap";
  }
  if (ctx->cuda_memory_limit_bytes && ctx->cuda_memory_limit_bytes < b) {
    b = ctx->cuda_memory_limit_bytes;
    why = ctx->cuda_memory_limit_name;
  }
  b &= ~(uint64_t)(SGM_DEVICE_ALIGN - 1);
  if (b < SGM_DEVICE_ALIGN) {
    char t[32];
    return sgm__error_set(SGM_ERR_INVALID,
                          "the VRAM budget resolves to 0 bytes because of %s (device memory %s, "
                          "fraction %g, SGM_VRAM_LIMIT %s, %s %llu bytes): a "
                          "budget must hold at least one %d-byte block; raise %s",
                          why, sgm__fmt_bytes(total, t, sizeof t), fraction,
                          ctx->cfg.vram_limit.bytes || ctx->cfg.vram_limit.fraction ? "set" : "none",
                          ctx->cuda_memory_limit_name[0] ? ctx->cuda_memory_limit_name
                                                         : "CUDA_DEVICE_MEMORY_LIMIT",
                          (unsigned long long)ctx->cuda_memory_limit_bytes, SGM_DEVICE_ALIGN, why);
  }
  *out = b;
  return SGM_OK;
}

/* The locked-memory limit left to this process: RLIMIT_MEMLOCK minus what it
 * has locked (VmLck); UINT64_MAX when unlimited or when it may lock past it
 * (CAP_IPC_LOCK, bit 14 of CapEff). */
static uint64_t context_memlock_left(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return UINT64_MAX;
  FILE *f = fopen("/proc/self/status", "re");
  uint64_t locked = 0;
  unsigned long long cap = 0;
  if (f) {
    char line[256];
    while (fgets(line, sizeof line, f)) {
      unsigned long long v;
      if (sscanf(line, "VmLck: %llu kB", &v) == 1) locked = (uint64_t)v * 1024u;
      else if (sscanf(line, "CapEff: %llx", &v) == 1) cap = v;
    }
    fclose(f);
  }
  if (cap & (1ull << 14)) return UINT64_MAX; /* CAP_IPC_LOCK: the limit does not apply */
  return (uint64_t)rl.rlim_cur > locked ? (uint64_t)rl.rlim_cur - locked : 0;
}

/* Shared budget = SGM_SHARED_LIMIT (bytes or % of RAM), else max(RAM / 2,
 * 64 MiB). The shared tier's rule is also its ceiling (issue 29: a limit of
 * all of RAM let one process pin all of it): an explicit limit above
 * max(RAM / 2, 64 MiB) (when RAM is known) is clamped to it with a warning,
 * as Windows caps shared GPU memory at half of RAM. */
static int context_shared_budget(const sgm_context *ctx, uint64_t *out, char *why, size_t why_len) {
  if (why_len) why[0] = '\0';
  uint64_t ram = ctx->physical_ram_bytes;
  uint64_t dflt = ram / 2 > CONTEXT_SHARED_MIN_BYTES ? ram / 2 : CONTEXT_SHARED_MIN_BYTES;
  uint64_t b = sgm__size_resolve(ctx->cfg.shared_limit, ram, dflt);
  char l[32], r[32], c[32];
  if (ram && b > dflt && (ctx->cfg.shared_limit.bytes || ctx->cfg.shared_limit.fraction)) {
    sgm__log(ctx->cfg.verbose, 1, "SGM_SHARED_LIMIT (%s) is more than the shared tier may pin "
             "(half of the physical RAM of %s, at least 64 MiB): the shared budget is clamped to %s",
             sgm__fmt_bytes(b, l, sizeof l), sgm__fmt_bytes(ram, r, sizeof r),
             sgm__fmt_bytes(dflt, c, sizeof c));
    b = dflt;
  }
  /* Issue 28 item 10: under a small `ulimit -l` (8 MiB by default for users),
   * the shared tier keeps within it (what does not fit goes to disk or
   * fails with a message) instead of failing at the first pin. */
  uint64_t memlock = ctx->parts.bops->pins_with_mlock ? context_memlock_left() : UINT64_MAX;
  if (memlock < b) {
    char m[32];
    uint64_t clamped = memlock > SGM_DEVICE_ALIGN ? memlock : SGM_DEVICE_ALIGN;
    sgm__log(ctx->cfg.verbose, 1, "the locked-memory limit (ulimit -l) leaves %s to pin: the shared "
             "GPU memory budget is %s instead of %s (raise it: ulimit -l unlimited, a memlock line "
             "in /etc/security/limits.d, or docker run --ulimit memlock=-1; docs/admin.md)",
             sgm__fmt_bytes(memlock, m, sizeof m), sgm__fmt_bytes(clamped, l, sizeof l),
             sgm__fmt_bytes(b, r, sizeof r));
    snprintf(why, why_len, "bounded by the locked-memory limit: RLIMIT_MEMLOCK (ulimit -l) leaves %s to "
             "pin; raise it (ulimit -l unlimited, a memlock line in /etc/security/limits.d, or docker "
             "run --ulimit memlock=-1)", m);
    b = clamped;
  }
  *out = b & ~(uint64_t)(SGM_DEVICE_ALIGN - 1);
  if (*out < SGM_DEVICE_ALIGN)
    return sgm__error_set(SGM_ERR_INVALID, "SGM_SHARED_LIMIT resolves to %llu bytes (physical RAM "
                          "%s): a budget must hold at least one %d-byte block; raise "
                          "SGM_SHARED_LIMIT", (unsigned long long)b,
                          sgm__fmt_bytes(ram, r, sizeof r), SGM_DEVICE_ALIGN);
  return SGM_OK;
}

SGM_API sgm_status sgm_context_create(const sgm_config *cfg_in, sgm_context **out) {
  sgm__error_clear();
  if (!out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_context_create: out is NULL");
  *out = NULL;
  sgm_config local;
  if (!cfg_in) {
    sgm_config_init(&local);
    cfg_in = &local;
  }
  /* cfg->error is read bounded, by validate: a program may hand a struct
   * whose error field it never terminated. */
  int rc = sgm__options_validate(cfg_in);
  if (rc != SGM_OK) return (sgm_status)rc;

  sgm_context *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating a context");
  ctx->cfg = *cfg_in;
  ctx->parts.cfg = &ctx->cfg; /* handed down to placement (placement.h) */
  ctx->parts.budget = ctx->budget_bytes;
  /* The admin's policy wins over the environment and the program's code. */
  rc = sgm__admin_apply(sgm__admin_current(), &ctx->cfg);
  if (rc != SGM_OK) {
    free(ctx);
    return (sgm_status)rc;
  }
  /* First: the node registry's first tick (before the tiers) reads the clock. */
  sgm__lock_init(&ctx->lock, SGM_LOCK_CONTEXT);
  ctx->clock_ms = context_monotonic_ms;
  ctx->parts.fork_generation = sgm__fork_watch();
  ctx->parts.owner_pid = getpid();
  ctx->vram_fraction = ctx->cfg.vram_fraction;
  ctx->capture = sgm__capture_create(sgm_free_ex); /* a released pool frees its parked blocks */
  if (!ctx->capture) {
    rc = sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating a context");
    goto out_free;
  }
  sgm__options_tf_growth(ctx->cfg.verbose, &ctx->cfg.allow_growth);
  rc = sgm__options_cuda_memory_limit_ex(ctx->cfg.device, &ctx->cuda_memory_limit_bytes,
                                         ctx->cuda_memory_limit_name, sizeof ctx->cuda_memory_limit_name);
  if (rc != SGM_OK) goto out_free;

  rc = sgm__backend_open(&ctx->cfg, &ctx->parts.bops, &ctx->parts.be);
  if (rc != SGM_OK) goto out_free;
  uint64_t free_bytes = 0;
  rc = ctx->parts.bops->mem_info(ctx->parts.be, &free_bytes, &ctx->device_total_bytes);
  if (rc != SGM_OK) goto out_close;
  rc = sgm__managed_open(ctx);
  if (rc != SGM_OK) goto out_close;
  ctx->physical_ram_bytes = sgm__host_physical_ram("");

  rc = context_vram_budget(ctx, ctx->vram_fraction, "SGM_VRAM_FRACTION",
                           &ctx->budget_bytes[SGM_TIER_VRAM]);
  char shared_why[256] = "";
  if (rc == SGM_OK) rc = context_shared_budget(ctx, &ctx->budget_bytes[SGM_TIER_SHARED], shared_why,
                                               sizeof shared_why);
  if (rc != SGM_OK) goto out_close;
  /* The disk tier's budget is resolved by placement when it opens the spill
   * file (SGM_SPILL_LIMIT against the free space there); 0 = no disk tier. */
  ctx->budget_bytes[SGM_TIER_DISK] = 0;
  /* The node registry: the tiers start with this process's fair part. */
  uint64_t start_budget[2];
  rc = sgm__share_join(ctx, &start_budget[SGM_TIER_VRAM], &start_budget[SGM_TIER_SHARED]);
  if (rc != SGM_OK) goto out_share;

  sgm_tier_params vp = {
      .tier = SGM_TIER_VRAM,
      .ops = &sgm__vram_chunk_ops,
      .bops = ctx->parts.bops,
      .be = ctx->parts.be,
      .budget_bytes = ctx->share ? start_budget[SGM_TIER_VRAM] : ctx->budget_bytes[SGM_TIER_VRAM],
      .growth = ctx->cfg.allow_growth != 0,
      .growth_chunk_bytes = ctx->cfg.growth_chunk_bytes,
      .verbose = ctx->cfg.verbose,
      .vmm = ctx->cfg.vram_vmm != 0,
      /* Address space for the largest budget the pool may get later (fair
       * shares, sgm_context_set_vram_fraction): the device's memory. */
      .vmm_range_bytes = ctx->device_total_bytes,
  };
  vp.max_chunk_bytes = CONTEXT_VRAM_MAX_CHUNK;
  if (ctx->parts.managed && !vp.growth) {
    /* Managed blocks share the VRAM budget with the pool's chunks: a pool
     * that reserved the whole budget would leave them none. */
    sgm__log(ctx->cfg.verbose, 2, "SGM_POINTERS=managed: VRAM grows on demand (the budget is shared "
             "with managed blocks, so it is not reserved at create)");
    vp.growth = true;
  }
  vp.limit_hint = "SGM_VRAM_LIMIT / SGM_VRAM_FRACTION";
  rc = sgm__tier_create(&vp, &ctx->parts.tiers[SGM_TIER_VRAM]);
  if (rc != SGM_OK) goto out_close;

  /* Shared GPU memory: always lazily committed, whatever the VRAM mode. */
  sgm_tier_params sp = vp;
  sp.tier = SGM_TIER_SHARED;
  sp.ops = &sgm__shared_chunk_ops;
  sp.budget_bytes = ctx->share ? start_budget[SGM_TIER_SHARED] : ctx->budget_bytes[SGM_TIER_SHARED];
  sp.growth = true;
  sp.vmm = false; /* pinned host memory has no reserved-range path */
  sp.vmm_range_bytes = 0;
  sp.growth_chunk_bytes = ctx->cfg.shared_chunk_bytes;
  sp.max_chunk_bytes = CONTEXT_SHARED_MAX_CHUNK;
  sp.limit_hint = "SGM_SHARED_LIMIT";
  rc = sgm__tier_create(&sp, &ctx->parts.tiers[SGM_TIER_SHARED]);
  if (rc != SGM_OK) goto out_tiers;
  if (shared_why[0]) /* the budget-exhausted message then names the limit, not SGM_SHARED_LIMIT */
    sgm__tier_set_budget_why(ctx->parts.tiers[SGM_TIER_SHARED], sp.budget_bytes, shared_why);

  rc = sgm__placement_create(ctx);
  if (rc != SGM_OK) goto out_tiers;

  rc = context_start_idle_thread(ctx);
  if (rc != SGM_OK) goto out_lock;
  rc = sgm__share_start(ctx);
  if (rc != SGM_OK) goto out_lock;

  char v[32], t[32], s[32];
  sgm__log(ctx->cfg.verbose, 2, "context on %s device %d: VRAM budget %s of %s (%s), shared budget %s",
           ctx->parts.bops->name, ctx->cfg.device,
           sgm__fmt_bytes(ctx->budget_bytes[SGM_TIER_VRAM], v, sizeof v),
           sgm__fmt_bytes(ctx->device_total_bytes, t, sizeof t),
           ctx->cfg.allow_growth ? "growth mode" : "reserved",
           sgm__fmt_bytes(ctx->budget_bytes[SGM_TIER_SHARED], s, sizeof s));
  sgm__error_clear();
  *out = ctx;
  return SGM_OK;

out_lock:
  sgm__share_stop(ctx);
  context_stop_idle_thread(ctx);
  sgm__placement_destroy(ctx);
out_tiers:
  for (int k = SGM_TIER_COUNT - 1; k >= 0; k--) sgm__tier_destroy(ctx->parts.tiers[k]);
out_share:
  sgm__share_leave(ctx);
out_close:
  ctx->parts.bops->close(ctx->parts.be);
out_free:
  sgm__capture_destroy(ctx->capture);
  sgm__lock_destroy(&ctx->lock);
  free(ctx);
  return (sgm_status)rc;
}

/* The child's destroy of a context inherited through fork(): the parent's
 * threads are not here to join, its locks may be held forever, its device
 * memory and pinned chunks are not the child's to free and its spill extents
 * must not be punched. Only the child's descriptor of the spill file is
 * closed (a process-local act); the rest of the copy is left to the child's
 * exit or exec, which is the only safe way to give it back. */
static void context_destroy_forked(sgm_context *ctx) {
  struct sgm_disk *d = ctx->parts.pl ? sgm__placement_disk(ctx) : NULL;
  if (d) close(sgm__disk_fd(d));
}

SGM_API void sgm_context_destroy(sgm_context *ctx) {
  if (!ctx) return;
  if (sgm__context_forked(ctx)) {
    context_destroy_forked(ctx);
    return;
  }
  sgm__share_stop(ctx);
  context_stop_idle_thread(ctx);
  sgm__capture_release_all(ctx); /* parked blocks are the pools', not leaks of the user's */
  sgm__capture_destroy(ctx->capture);
  sgm__lock_destroy(&ctx->lock);
  sgm__placement_destroy(ctx);
  for (int t = SGM_TIER_COUNT - 1; t >= 0; t--) sgm__tier_destroy(ctx->parts.tiers[t]);
  sgm__share_leave(ctx);
  ctx->parts.bops->close(ctx->parts.be);
  free(ctx);
}

SGM_API const sgm_config *sgm_context_config(const sgm_context *ctx) {
  return ctx ? &ctx->cfg : NULL;
}

/* Rule 3 of the placement rules (decided in residency.c): VRAM was full, so
 * the block at ptr landed in shared GPU memory. Counted, announced once at
 * SGM_VERBOSE >= 1, and reported to the callback every time. */
static void *context_fallback(sgm_context *ctx, sgm_devptr d, size_t size) {
  void *ptr = (void *)(uintptr_t)d;
  uint64_t n = __atomic_fetch_add(&ctx->n_fallbacks, 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&ctx->fallback_bytes, (uint64_t)size, __ATOMIC_RELAXED);
  if (n == 0 && ctx->cfg.verbose >= 1) {
    char a[32];
    sgm__tier_explain_budget(ctx->parts.tiers[SGM_TIER_VRAM], size);
    sgm__log(ctx->cfg.verbose, 1, "VRAM budget full: allocations now spill into shared GPU memory "
             "(first: %s; %s). Set SGM_SHARED_FALLBACK=off to fail instead",
             sgm__fmt_bytes(size, a, sizeof a), sgm_last_error());
  }
  /* A fallback is budget-relevant: this process's demand grew past its
   * share (no-op when untracked; never on the VRAM path). */
  sgm__share_poke(ctx);
  /* Without a callback (the common case) no lock is taken. */
  if (__atomic_load_n(&ctx->fallback_fn, __ATOMIC_ACQUIRE)) {
    sgm__lock_take(&ctx->lock);
    sgm_fallback_fn fn = ctx->fallback_fn;
    void *user = ctx->fallback_user;
    sgm__lock_drop(&ctx->lock);
    if (fn) fn(user, ptr, size);
  }
  sgm__error_clear();
  return ptr;
}

SGM_API sgm_status sgm_set_fallback_callback(sgm_context *ctx, sgm_fallback_fn fn, void *user) {
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_set_fallback_callback: context is NULL");
  if (sgm__context_forked(ctx))
    return (sgm_status)sgm__context_fork_error(ctx, "sgm_set_fallback_callback");
  sgm__lock_take(&ctx->lock);
  ctx->fallback_user = fn ? user : NULL;
  __atomic_store_n(&ctx->fallback_fn, fn, __ATOMIC_RELEASE);
  sgm__lock_drop(&ctx->lock);
  return SGM_OK;
}

int sgm__context_set_vram_fraction(sgm_context *ctx, double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0))
    return sgm__error_set(SGM_ERR_INVALID, "memory fraction %g is outside (0, 1]", fraction);
  if (sgm__context_forked(ctx)) return sgm__context_fork_error(ctx, "set_memory_fraction");
  sgm__lock_take(&ctx->lock);
  uint64_t budget = 0;
  int rc = context_vram_budget(ctx, fraction, "the memory fraction", &budget);
  if (rc == SGM_OK) {
    ctx->vram_fraction = fraction; /* not cfg: sgm_context_config hands cfg out */
    ctx->budget_bytes[SGM_TIER_VRAM] = budget;
  }
  sgm__lock_drop(&ctx->lock);
  if (rc != SGM_OK) return rc; /* the budget stays as it was */
  sgm__tier_set_budget(ctx->parts.tiers[SGM_TIER_VRAM], budget);
  if (ctx->parts.managed) sgm__managed_cache_fit(ctx, SGM_TIER_VRAM); /* cached ranges over it go back */
  return SGM_OK;
}

SGM_API const char *sgm_context_backend(const sgm_context *ctx) {
  return ctx ? ctx->parts.bops->name : "none";
}

static void *context_alloc(sgm_context *ctx, size_t size, void *stream) {
  sgm_devptr d = 0;
  sgm_tier where;
  if (ctx->parts.managed && size >= SGM_MANAGED_MOVABLE_BYTES) {
    if (sgm__managed_alloc(ctx, size, stream, &d, &where) != SGM_OK) return NULL;
  } else if (sgm_unlikely(sgm__residency_alloc(ctx, size, stream, &d, &where) != SGM_OK)) {
    return NULL;
  }
  if (sgm_likely(where == SGM_TIER_VRAM)) return (void *)(uintptr_t)d;
  return context_fallback(ctx, d, size);
}

/* sgm_alloc while capture pools exist: under a pool's scope, a block the pool
 * parked on this stream is taken again, else a new one joins the pool. */
static void *context_alloc_pooled(sgm_context *ctx, size_t size, void *stream) {
  uint64_t pool = 0;
  void *p = sgm__capture_scope_reuse(ctx->capture, size, stream, &pool);
  if (p) return p;
  if (!pool) return context_alloc(ctx, size, stream);
  p = context_alloc(ctx, size, stream);
  if (p) sgm__capture_adopt(ctx->capture, pool, p, size, stream);
  return p;
}

/* The argument checks of sgm_alloc and sgm_alloc_shared (fn names the call
 * in the message): true when the call may go on. */
static bool context_alloc_args(sgm_context *ctx, size_t size, const char *fn) {
  if (sgm_unlikely(!ctx)) {
    sgm__error_set(SGM_ERR_INVALID, "%s: context is NULL", fn);
    return false;
  }
  if (sgm__context_forked(ctx)) {
    sgm__context_fork_error(ctx, fn);
    return false;
  }
  if (sgm_unlikely(size == 0)) {
    sgm__error_set(SGM_ERR_INVALID, "%s: size is 0 (ask for at least one byte)", fn);
    return false;
  }
  return true;
}

SGM_API void *sgm_alloc(sgm_context *ctx, size_t size, void *stream) {
  if (!context_alloc_args(ctx, size, "sgm_alloc")) return NULL;
  /* Capture pools (capture.c): one relaxed load when there are none. */
  if (sgm_unlikely(sgm__capture_active(ctx->capture))) return context_alloc_pooled(ctx, size, stream);
  return context_alloc(ctx, size, stream);
}

SGM_API void *sgm_alloc_shared(sgm_context *ctx, size_t size, void *stream) {
  if (!context_alloc_args(ctx, size, "sgm_alloc_shared")) return NULL;
  sgm_devptr d = 0;
  if (sgm__residency_alloc_shared(ctx, size, stream, &d) != SGM_OK) return NULL;
  return context_fallback(ctx, d, size);
}

SGM_API sgm_status sgm_interpose_vram(sgm_context *ctx, int64_t delta_bytes) {
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_interpose_vram: context is NULL");
  if (sgm__context_forked(ctx)) return sgm__context_fork_error(ctx, "sgm_interpose_vram");
  __atomic_store_n(&ctx->interposed, true, __ATOMIC_RELAXED);
  if (delta_bytes >= 0) {
    uint64_t now = __atomic_add_fetch(&ctx->interposed_vram_bytes, (uint64_t)delta_bytes, __ATOMIC_RELAXED);
    uint64_t peak = __atomic_load_n(&ctx->interposed_vram_peak, __ATOMIC_RELAXED);
    while (now > peak && !__atomic_compare_exchange_n(&ctx->interposed_vram_peak, &peak, now, true,
                                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return SGM_OK;
  }
  uint64_t take = (uint64_t)0 - (uint64_t)delta_bytes;
  uint64_t cur = __atomic_load_n(&ctx->interposed_vram_bytes, __ATOMIC_RELAXED);
  do {
    if (take > cur)
      return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_interpose_vram: giving back %llu bytes "
                                        "but only %llu are accounted; nothing changed",
                                        (unsigned long long)take, (unsigned long long)cur);
  } while (!__atomic_compare_exchange_n(&ctx->interposed_vram_bytes, &cur, cur - take, true,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  return SGM_OK;
}

/* sgm_free of a pointer an acquired buffer handed out: the block is the
 * buffer's, not an allocation; freeing it would let sgm_alloc hand it out
 * again under the buffer's data. */
static sgm_status context_buffer_free(sgm_context *ctx, void *ptr) {
  __atomic_fetch_add(&ctx->n_bad_frees, 1, __ATOMIC_RELAXED);
  sgm__error_set(SGM_ERR_INVALID, "sgm_free: %p is the memory of an sgm_buffer, not an "
                 "allocation; nothing was freed (release the buffer with sgm_buffer_release, "
                 "free it with sgm_buffer_destroy)", ptr);
  sgm__log(ctx->cfg.verbose, 1, "%s", sgm_last_error());
  return SGM_ERR_INVALID;
}

static sgm_status context_bad_free(sgm_context *ctx, void *ptr) {
  __atomic_fetch_add(&ctx->n_bad_frees, 1, __ATOMIC_RELAXED);
  sgm__error_set(SGM_ERR_INVALID,
                 "sgm_free: %p is not a live allocation of this context (freed twice, or not "
                 "from sgm_alloc); nothing was freed",
                 ptr);
  sgm__log(ctx->cfg.verbose, 1, "%s", sgm_last_error());
  return SGM_ERR_INVALID;
}

SGM_API sgm_status sgm_free_ex(sgm_context *ctx, void *ptr, void *stream) {
  if (!ptr) return SGM_OK;
  if (sgm_unlikely(!ctx)) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_free: context is NULL");
  if (sgm__context_forked(ctx)) return (sgm_status)sgm__context_fork_error(ctx, "sgm_free");
  sgm_devptr d = (sgm_devptr)(uintptr_t)ptr;
  /* A capture pool's block is parked in its pool, live in its tier. */
  if (sgm_unlikely(sgm__capture_active(ctx->capture))) {
    int parked = sgm__capture_park(ctx->capture, d, stream);
    if (parked > 0) return SGM_OK;
    if (parked < 0) return context_bad_free(ctx, ptr);
  }
  /* Stream-ordered free (the rule RMM and PyTorch follow): work already queued
   * on `stream` may still use the block, so it is cached for that stream —
   * reusable by its later work at once, with no driver call — and reaches
   * other streams only through a device-side wait (lib/tiers/pool/xfer.c). */
  if (ctx->parts.managed && sgm__managed_free(ctx, d, stream) == SGM_OK) return SGM_OK;
  sgm_stream_ref ref;
  sgm__stream_ref(ctx->parts.bops, ctx->parts.be, stream, &ref);
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    /* A fallback block's free skips the VRAM lookup by address alone. */
    if (!ctx->parts.tiers[t] || !sgm__tier_may_own(ctx->parts.tiers[t], d)) continue;
    int rc = sgm__tier_free_on(ctx->parts.tiers[t], d, &ref);
    if (sgm_likely(rc == SGM_OK)) return SGM_OK;
    if (rc != SGM_ERR_INVALID) {
      /* An event for a stream named by sgm_record_stream could not be
       * recorded: nobody could tell when the block is idle. Keep it. */
      sgm__log(ctx->cfg.verbose, 1, "sgm_free: %s; the block stays allocated", sgm_last_error());
      return (sgm_status)rc;
    }
  }
  /* The tiers refuse sgm's own blocks (a buffer's storage): only the message
   * differs, so the check costs nothing on the good path. */
  if (sgm__placement_owns_block(ctx, d)) return context_buffer_free(ctx, ptr);
  return context_bad_free(ctx, ptr);
}

SGM_API sgm_status sgm_record_stream(sgm_context *ctx, void *ptr, void *stream) {
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_record_stream: context is NULL");
  if (sgm_unlikely(sgm__capture_active(ctx->capture))) {
    /* A parked block is not the user's: naming a stream for it is a use after free. */
    if (sgm__capture_parked(ctx->capture, (sgm_devptr)(uintptr_t)ptr))
      return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_record_stream: %p was freed "
                                        "(it waits in its capture pool)", ptr);
    sgm__capture_recorded(ctx->capture, (sgm_devptr)(uintptr_t)ptr);
  }
  sgm_stream_ref ref;
  sgm__stream_ref(ctx->parts.bops, ctx->parts.be, stream, &ref);
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    if (!ctx->parts.tiers[t]) continue;
    int rc = sgm__tier_record_stream(ctx->parts.tiers[t], (sgm_devptr)(uintptr_t)ptr, &ref);
    if (rc != SGM_ERR_INVALID) return (sgm_status)rc;
  }
  /* A managed block so named is not cached at its free: the driver's free
   * waits for all work using it. */
  if (ctx->parts.managed && sgm__managed_record_stream(ctx, (sgm_devptr)(uintptr_t)ptr)) return SGM_OK;
  return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_record_stream: %p is not a live "
                                    "allocation of this context (from sgm_alloc, not yet freed)",
                                    ptr);
}

SGM_API void sgm_free(sgm_context *ctx, void *ptr, void *stream) {
  (void)sgm_free_ex(ctx, ptr, stream);
}

SGM_API sgm_tier sgm_pointer_tier(sgm_context *ctx, const void *ptr) {
  if (!ctx || !ptr) return SGM_TIER_NONE;
  if (sgm__context_forked(ctx)) {
    sgm__context_fork_error(ctx, "sgm_pointer_tier");
    return SGM_TIER_NONE;
  }
  for (int t = 0; t < SGM_TIER_COUNT; t++)
    if (ctx->parts.tiers[t] && sgm__tier_owns(ctx->parts.tiers[t], (sgm_devptr)(uintptr_t)ptr)) return (sgm_tier)t;
  return ctx->parts.managed ? sgm__managed_tier(ctx, (sgm_devptr)(uintptr_t)ptr) : SGM_TIER_NONE;
}

SGM_API sgm_status sgm_trim(sgm_context *ctx) {
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_trim: context is NULL");
  if (sgm__context_forked(ctx)) return (sgm_status)sgm__context_fork_error(ctx, "sgm_trim");
  uint64_t returned = 0;
  for (int t = 0; t < SGM_TIER_COUNT; t++)
    if (ctx->parts.tiers[t]) returned += sgm__tier_trim(ctx->parts.tiers[t]);
  returned += sgm__placement_trim(ctx);
  if (ctx->parts.managed) {
    sgm__managed_queue_drain(ctx); /* queued moves run now, before the ranges go back */
    returned += sgm__managed_cache_drop(ctx, SGM_TIER_COUNT, UINT64_MAX);
    sgm__managed_promote(ctx, UINT64_MAX); /* into the room trimming left */
  }
  char b[32];
  sgm__log(ctx->cfg.verbose, 3, "trim returned %s", sgm__fmt_bytes(returned, b, sizeof b));
  return SGM_OK;
}
