/*
 * vram.c — the dedicated-memory tier: chunks of device memory from the
 * backend, carved by the shared chunk pool (lib/tiers/pool).
 *
 * Invariant: every chunk is one backend device allocation, freed exactly once.
 * Threading: called by the pool without its lock held.
 */
#include "tiers/tier.h"

static int vram_chunk_alloc(sgm_tier_pool *p, uint64_t bytes, sgm_chunk *out) {
  *out = (sgm_chunk){0};
  sgm_devptr d = 0;
  int rc = sgm__tier_params(p)->bops->device_alloc(sgm__tier_params(p)->be, bytes, &d);
  if (rc != SGM_OK) return rc;
  if (d % SGM_DEVICE_ALIGN != 0) {
    /* The pool's blocks are aligned relative to the chunk start; a backend that
     * broke its alignment promise would break cudaMalloc's for our users. */
    sgm__tier_params(p)->bops->device_free(sgm__tier_params(p)->be, d, bytes);
    return sgm__error_set(SGM_ERR_BACKEND, "the %s backend returned device memory aligned to less "
                          "than %u bytes", sgm__tier_params(p)->bops->name, SGM_DEVICE_ALIGN);
  }
  out->base = d;
  out->bytes = bytes;
  return SGM_OK;
}

static void vram_chunk_free(sgm_tier_pool *p, const sgm_chunk *c) {
  const sgm_tier_params *tp = sgm__tier_params(p);
  tp->bops->device_free(tp->be, c->base, c->bytes);
}

const sgm_chunk_ops sgm__vram_chunk_ops = {
    .chunk_alloc = vram_chunk_alloc,
    .chunk_free = vram_chunk_free,
};
