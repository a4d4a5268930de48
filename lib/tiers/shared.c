/*
 * shared.c — the shared GPU memory tier: page-locked host RAM that the device
 * addresses over the bus, taken in chunks through the backend and carved by
 * the chunk pool (lib/tiers/pool). The pool always runs in growth mode here: nothing is
 * pinned at create, chunks are pinned as allocations need them (committed
 * lazily, as Windows commits shared memory), and wholly free chunks go back on
 * sgm_trim and after the idle delay.
 *
 * Placement: host_alloc is asked for "the device's own NUMA node" (the GPU's,
 * found by the backend from its PCI bus id; for the emulated device the
 * calling CPU's), so the bus traffic does not cross a socket.
 *
 * Invariant: each chunk is one backend host allocation, freed exactly once;
 * its device address is the pool offset, its host address is kept beside it.
 * Threading: chunk functions are called by the pool without its lock held;
 * sgm__shared_host_ptr asks the pool (sgm__tier_chunk_of), which locks.
 */
#include "tiers/tier.h"

static int shared_chunk_alloc(sgm_tier_pool *p, uint64_t bytes, sgm_chunk *out) {
  *out = (sgm_chunk){0};
  void *host = NULL;
  sgm_devptr d = 0;
  const sgm_tier_params *tp = sgm__tier_params(p);
  int rc = tp->bops->host_alloc(tp->be, bytes, -1, &host, &d);
  if (rc != SGM_OK) return rc;
  if (d % SGM_DEVICE_ALIGN != 0) {
    tp->bops->host_free(tp->be, host, bytes);
    return sgm__error_set(SGM_ERR_BACKEND, "the %s backend mapped pinned memory at a device address "
                          "aligned to less than %u bytes", tp->bops->name, SGM_DEVICE_ALIGN);
  }
  out->base = d;
  out->host = host;
  out->bytes = bytes;
  return SGM_OK;
}

static void shared_chunk_free(sgm_tier_pool *p, const sgm_chunk *c) {
  const sgm_tier_params *tp = sgm__tier_params(p);
  tp->bops->host_free(tp->be, c->host, c->bytes);
}

const sgm_chunk_ops sgm__shared_chunk_ops = {
    .chunk_alloc = shared_chunk_alloc,
    .chunk_free = shared_chunk_free,
};

void *sgm__shared_host_ptr(sgm_tier_pool *p, sgm_devptr ptr) {
  sgm_chunk c;
  if (!sgm__tier_chunk_of(p, ptr, &c)) return NULL;
  return (char *)c.host + (ptr - c.base);
}
