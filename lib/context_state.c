/*
 * context_state.c — reading a context: the accessors internal.h declares
 * under "context.c, context_state.c", which the context's services (stats.c,
 * share.c, capture.c), hooks.c and the tests call. Moved unchanged from
 * context.c (issue 31): they sit on the floor below it (lib/LAYERS:
 * context-state, with the layout in context.h), so the services read the
 * context without calling up into the file that builds it, and context.c
 * calls down into them.
 *
 * Invariant: the setters (share.c's registry state and the device total it
 * learns at join, placement's state, the managed mode; the tests' backend
 * spy) run while the context is created, before another thread sees it, or
 * (share.c's leave) while it is destroyed, after the other threads stopped.
 * Threading: what is fixed at create is read with no lock; the budgets, the
 * VRAM fraction and the clock under ctx->lock (rank SGM_LOCK_CONTEXT; no
 * other lock is taken under it here); the counters are relaxed atomic loads.
 * Calls: prim's locks, the VRAM pool's VMM figures and the backend's
 * driver-call count (sgm__context_counters).
 */
#include <string.h>

#include "backend/backend.h"
#include "context.h"
#include "internal.h"
#include "placement/placement.h"
#include "tiers/tier.h"

const sgm_config *sgm__context_cfg(const sgm_context *ctx) { return &ctx->cfg; }
const struct sgm_backend_ops *sgm__context_bops(const sgm_context *ctx) { return ctx->parts.bops; }
struct sgm_backend *sgm__context_be(const sgm_context *ctx) { return ctx->parts.be; }
struct sgm_tier_pool *sgm__context_tier(const sgm_context *ctx, sgm_tier t) { return ctx->parts.tiers[t]; }
uint64_t sgm__context_budget(const sgm_context *ctx, sgm_tier t) { return ctx->budget_bytes[t]; }
struct sgm_placement *sgm__context_pl(const sgm_context *ctx) { return ctx->parts.pl; }
void sgm__context_set_bops(sgm_context *ctx, const struct sgm_backend_ops *bops) { ctx->parts.bops = bops; }

void sgm__context_budgets(sgm_context *ctx, uint64_t *vram, uint64_t *shared) {
  sgm__lock_take(&ctx->lock);
  *vram = ctx->budget_bytes[SGM_TIER_VRAM];
  *shared = ctx->budget_bytes[SGM_TIER_SHARED];
  sgm__lock_drop(&ctx->lock);
}

double sgm__context_vram_fraction(sgm_context *ctx) {
  sgm__lock_take(&ctx->lock);
  double f = ctx->vram_fraction;
  sgm__lock_drop(&ctx->lock);
  return f;
}

uint64_t sgm__context_now_ms(sgm_context *ctx) {
  sgm__lock_take(&ctx->lock);
  uint64_t now = ctx->clock_ms(ctx->clock_user);
  sgm__lock_drop(&ctx->lock);
  return now;
}

uint64_t sgm__context_device_total(const sgm_context *ctx) { return ctx->device_total_bytes; }
void sgm__context_set_device_total(sgm_context *ctx, uint64_t bytes) { ctx->device_total_bytes = bytes; }
uint64_t sgm__context_physical_ram(const sgm_context *ctx) { return ctx->physical_ram_bytes; }
struct sgm_share *sgm__context_share(const sgm_context *ctx) { return ctx->share; }
void sgm__context_set_share(sgm_context *ctx, struct sgm_share *sh) { ctx->share = sh; }
bool sgm__context_managed(const sgm_context *ctx) { return ctx->parts.managed; }
struct sgm_capture *sgm__context_capture(const sgm_context *ctx) { return ctx->capture; }

void sgm__context_counters(const sgm_context *ctx, sgm_stats *out) {
  out->n_fallbacks = __atomic_load_n(&ctx->n_fallbacks, __ATOMIC_RELAXED);
  out->fallback_bytes = __atomic_load_n(&ctx->fallback_bytes, __ATOMIC_RELAXED);
  out->device_total_bytes = ctx->device_total_bytes;
  out->physical_ram_bytes = ctx->physical_ram_bytes;
  out->n_bad_frees = __atomic_load_n(&ctx->n_bad_frees, __ATOMIC_RELAXED);
  if (ctx->parts.tiers[SGM_TIER_VRAM])
  {
    sgm__tier_vmm_info(ctx->parts.tiers[SGM_TIER_VRAM], &out->vram_granule_bytes,
                       &out->vram_reserved_bytes);
    out->vram_map_calls = sgm__tier_vmm_calls(ctx->parts.tiers[SGM_TIER_VRAM]);
  }
  /* Driver calls (issue 16): the backend's own count; no driver call to read. */
  sgm_backend_counters bc;
  memset(&bc, 0, sizeof bc);
  ctx->parts.bops->counters(ctx->parts.be, &bc);
  out->driver_calls = bc.n_driver_calls;
}

bool sgm__context_interposed(sgm_context *ctx, uint64_t *vram_bytes, uint64_t *peak_bytes) {
  *vram_bytes = __atomic_load_n(&ctx->interposed_vram_bytes, __ATOMIC_RELAXED);
  *peak_bytes = __atomic_load_n(&ctx->interposed_vram_peak, __ATOMIC_RELAXED);
  return __atomic_load_n(&ctx->interposed, __ATOMIC_RELAXED);
}
