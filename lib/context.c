/*
 * context.c — sgm_context: resolving the configuration into budgets, opening
 * the backend, building the tiers, and the allocation entry points.
 *
 * Invariants: a context exists only fully built (create either succeeds or
 * leaves nothing behind); budgets are fixed at create.
 * Threading: every entry point is safe from any thread; the tiers lock
 * themselves, the context's own counters are atomics.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "internal.h"
#include "tiers/tier.h"

/* The shared pool's floor, as Windows: max(RAM / 2, 64 MiB). */
#define CONTEXT_SHARED_MIN_BYTES (UINT64_C(64) << 20)

/* VRAM budget = device total × fraction, capped by SGM_VRAM_LIMIT and by
 * CUDA_DEVICE_MEMORY_LIMIT; aligned down to the device alignment. */
static uint64_t context_vram_budget(const sgm_context *ctx) {
  uint64_t total = ctx->device_total_bytes;
  uint64_t b = (uint64_t)((double)total * ctx->cfg.vram_fraction);
  if (b > total) b = total;
  uint64_t cap = sgm__size_resolve(ctx->cfg.vram_limit, total, UINT64_MAX);
  if (cap < b) b = cap;
  if (ctx->cuda_memory_limit_bytes && ctx->cuda_memory_limit_bytes < b)
    b = ctx->cuda_memory_limit_bytes;
  return b & ~(uint64_t)(SGM_DEVICE_ALIGN - 1);
}

static uint64_t context_shared_budget(const sgm_context *ctx) {
  uint64_t ram = ctx->physical_ram_bytes;
  uint64_t dflt = ram / 2 > CONTEXT_SHARED_MIN_BYTES ? ram / 2 : CONTEXT_SHARED_MIN_BYTES;
  return sgm__size_resolve(ctx->cfg.shared_limit, ram, dflt);
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
  if (cfg_in->error[0])
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "%s", cfg_in->error);
  int rc = sgm__options_validate(cfg_in);
  if (rc != SGM_OK) return (sgm_status)rc;

  sgm_context *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating a context");
  ctx->cfg = *cfg_in;
  sgm__options_tf_growth(ctx->cfg.verbose, &ctx->cfg.allow_growth);
  rc = sgm__options_cuda_memory_limit(ctx->cfg.device, &ctx->cuda_memory_limit_bytes);
  if (rc != SGM_OK) goto out_free;

  rc = sgm__backend_open(&ctx->cfg, &ctx->bops, &ctx->be);
  if (rc != SGM_OK) goto out_free;
  uint64_t free_bytes = 0;
  rc = ctx->bops->mem_info(ctx->be, &free_bytes, &ctx->device_total_bytes);
  if (rc != SGM_OK) goto out_close;
  ctx->physical_ram_bytes = sgm__host_physical_ram("");

  ctx->budget_bytes[SGM_TIER_VRAM] = context_vram_budget(ctx);
  ctx->budget_bytes[SGM_TIER_SHARED] = context_shared_budget(ctx);
  ctx->budget_bytes[SGM_TIER_DISK] = 0; /* the disk tier comes with the spill issue */

  sgm_tier_params vp = {
      .tier = SGM_TIER_VRAM,
      .ops = &sgm__vram_chunk_ops,
      .bops = ctx->bops,
      .be = ctx->be,
      .budget_bytes = ctx->budget_bytes[SGM_TIER_VRAM],
      .growth = ctx->cfg.allow_growth != 0,
      .growth_chunk_bytes = ctx->cfg.growth_chunk_bytes,
      .verbose = ctx->cfg.verbose,
  };
  rc = sgm__tier_create(&vp, &ctx->tiers[SGM_TIER_VRAM]);
  if (rc != SGM_OK) goto out_close;

  char v[32], t[32], s[32];
  sgm__log(ctx->cfg.verbose, 2, "context on %s device %d: VRAM budget %s of %s (%s), shared budget %s",
           ctx->bops->name, ctx->cfg.device,
           sgm__fmt_bytes(ctx->budget_bytes[SGM_TIER_VRAM], v, sizeof v),
           sgm__fmt_bytes(ctx->device_total_bytes, t, sizeof t),
           ctx->cfg.allow_growth ? "growth mode" : "reserved",
           sgm__fmt_bytes(ctx->budget_bytes[SGM_TIER_SHARED], s, sizeof s));
  sgm__error_clear();
  *out = ctx;
  return SGM_OK;

out_close:
  ctx->bops->close(ctx->be);
out_free:
  free(ctx);
  return (sgm_status)rc;
}

SGM_API void sgm_context_destroy(sgm_context *ctx) {
  if (!ctx) return;
  for (int t = SGM_TIER_COUNT - 1; t >= 0; t--) sgm__tier_destroy(ctx->tiers[t]);
  ctx->bops->close(ctx->be);
  free(ctx);
}

SGM_API const sgm_config *sgm_context_config(const sgm_context *ctx) {
  return ctx ? &ctx->cfg : NULL;
}

SGM_API const char *sgm_context_backend(const sgm_context *ctx) {
  return ctx ? ctx->bops->name : "none";
}

SGM_API void *sgm_alloc(sgm_context *ctx, size_t size, void *stream) {
  (void)stream; /* stream-ordered reuse comes with the CUDA backend */
  if (sgm_unlikely(!ctx)) {
    sgm__error_set(SGM_ERR_INVALID, "sgm_alloc: context is NULL");
    return NULL;
  }
  if (sgm_unlikely(size == 0)) {
    sgm__error_set(SGM_ERR_INVALID, "sgm_alloc: size is 0 (ask for at least one byte)");
    return NULL;
  }
  sgm_devptr d = 0;
  if (sgm__tier_alloc(ctx->tiers[SGM_TIER_VRAM], size, &d) != SGM_OK) return NULL;
  return (void *)(uintptr_t)d;
}

SGM_API sgm_status sgm_free_ex(sgm_context *ctx, void *ptr, void *stream) {
  (void)stream;
  if (!ptr) return SGM_OK;
  if (sgm_unlikely(!ctx)) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_free: context is NULL");
  uint64_t size = 0;
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    if (!ctx->tiers[t]) continue;
    if (sgm__tier_free(ctx->tiers[t], (sgm_devptr)(uintptr_t)ptr, &size) == SGM_OK) return SGM_OK;
  }
  __atomic_fetch_add(&ctx->n_bad_frees, 1, __ATOMIC_RELAXED);
  sgm__error_set(SGM_ERR_INVALID,
                 "sgm_free: %p is not a live allocation of this context (freed twice, or not "
                 "from sgm_alloc); nothing was freed",
                 ptr);
  sgm__log(ctx->cfg.verbose, 1, "%s", sgm_last_error());
  return SGM_ERR_INVALID;
}

SGM_API void sgm_free(sgm_context *ctx, void *ptr, void *stream) {
  (void)sgm_free_ex(ctx, ptr, stream);
}

SGM_API sgm_tier sgm_pointer_tier(sgm_context *ctx, const void *ptr) {
  if (!ctx || !ptr) return SGM_TIER_NONE;
  for (int t = 0; t < SGM_TIER_COUNT; t++)
    if (ctx->tiers[t] && sgm__tier_owns(ctx->tiers[t], (sgm_devptr)(uintptr_t)ptr)) return (sgm_tier)t;
  return SGM_TIER_NONE;
}

SGM_API sgm_status sgm_trim(sgm_context *ctx) {
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_trim: context is NULL");
  uint64_t returned = 0;
  for (int t = 0; t < SGM_TIER_COUNT; t++)
    if (ctx->tiers[t]) returned += sgm__tier_trim(ctx->tiers[t]);
  char b[32];
  sgm__log(ctx->cfg.verbose, 3, "trim returned %s", sgm__fmt_bytes(returned, b, sizeof b));
  return SGM_OK;
}
