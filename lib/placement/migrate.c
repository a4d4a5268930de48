/*
 * migrate.c — moving a buffer's data between tiers: demote (VRAM -> shared ->
 * disk; VRAM straight to disk in one hop when disk is the target, or when
 * shared memory is full of what cannot move), promote (back up into a block
 * residency.c found; disk -> VRAM in one hop), managed blocks (their pages
 * move, their address stays), and host reads and writes wherever the data
 * lives. This file picks the hop and keeps the counters; the disk side of a
 * hop is migrate_disk.c's, and every copy follows the release's GPU work
 * through migrate_order.c (DESIGN.md §8).
 *
 * Invariant: a move either completes (data in the new tier, the old storage
 * freed, the migration counted) or leaves the buffer as it was.
 *
 * Spilling from shared memory to disk is the one migration the host does
 * itself: it waits for the release's work first (sgm__migrate_order_use).
 *
 * Threading: the caller owns the buffer (BUSY) and holds no lock; the copies,
 * disk I/O and pool calls here run unlocked. The counters are atomics;
 * pl->mlock is taken only for the managed blocks' counters. Calls:
 * the tier pools, migrate_disk.c, migrate_order.c, the managed move queue
 * below (managed_queue.c: a move ends its block's queued one) and the
 * backend's managed-memory advice and prefetch; room one tier down for a
 * demotion is asked of residency.c above through pl->ask.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

static void *migrate_shared_host(sgm_context *ctx, sgm_devptr d) {
  return sgm__shared_host_ptr(sgm__parts_tier(ctx, SGM_TIER_SHARED), d);
}

/* Not a stream: the host itself uses the data (sgm__migrate_order_use waits). */
#define MIGRATE_HOST ((void *)(uintptr_t)UINTPTR_MAX)

static void migrate_free_block(sgm_context *ctx, sgm_tier t, sgm_devptr d) {
  uint64_t sz;
  sgm__tier_free(sgm__parts_tier(ctx, t), d, &sz);
}

/* Atomics, no lock: movers in different tiers count without meeting. */
static void migrate_count(struct sgm_placement *pl, sgm_tier from, sgm_tier to, uint64_t n, bool evict) {
  __atomic_add_fetch(&pl->bytes_out[from], n, __ATOMIC_RELAXED);
  __atomic_add_fetch(&pl->bytes_in[to], n, __ATOMIC_RELAXED);
  if (evict) __atomic_add_fetch(&pl->n_evictions[from], 1, __ATOMIC_RELAXED);
  if (to == SGM_TIER_DISK) __atomic_add_fetch(&pl->n_disk_live, 1, __ATOMIC_RELAXED);
  if (from == SGM_TIER_DISK) __atomic_sub_fetch(&pl->n_disk_live, 1, __ATOMIC_RELAXED);
}

/* ---- managed blocks: the pages move, the address stays ---- */

int sgm__migrate_managed_place(sgm_context *ctx, sgm_devptr d, uint64_t n, sgm_tier to, void *stream) {
  const sgm_backend_ops *o = sgm__parts_bops(ctx);
  /* Advice first, so that the driver keeps the pages where sgm put them
   * (and maps host-placed ones for the device: no fault per access). */
  int rc = o->managed_advise(sgm__parts_be(ctx), d, n, to == SGM_TIER_VRAM ? SGM_ADVISE_PREFER_DEVICE
                                                                 : SGM_ADVISE_PREFER_HOST);
  if (rc == SGM_OK && to == SGM_TIER_SHARED) rc = o->managed_advise(sgm__parts_be(ctx), d, n, SGM_ADVISE_ACCESSED_BY);
  if (rc == SGM_OK) rc = o->managed_prefetch(sgm__parts_be(ctx), d, n, to, stream);
  return rc;
}

/* The stream a managed block's move runs on: the one its caller named last.
 * NULL there is the legacy default stream (PyTorch's default stream), which
 * the backend must be told by name: a NULL stream to managed_prefetch is
 * sgm's own copy stream, ordered after nothing, so a move could run while
 * the caller's default-stream work still used the pages (issue 24). A
 * per-thread default stream is named from the mover's thread by the legacy
 * stream too, which follows the earlier work of every blocking stream. */
static void *migrate_managed_stream(const sgm_buffer *b) {
  void *s = b->mstream;
  return !s || s == SGM_STREAM_PER_THREAD ? SGM_STREAM_LEGACY : s;
}

int sgm__migrate_managed(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict) {
  return sgm__migrate_managed_on(ctx, b, to, evict, migrate_managed_stream(b));
}

int sgm__migrate_managed_on(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict, void *stream) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm_tier from = b->tier;
  sgm_assert(b->managed && from < SGM_N_RESIDENT && to < SGM_N_RESIDENT && from != to);
  sgm__managed_queue_drop(ctx, b); /* this move supersedes a queued one */
  int rc = sgm__migrate_managed_place(ctx, b->dptr, b->size, to, stream);
  if (rc != SGM_OK) {
    /* Advice may have changed; put it back so the pages stay where counted. */
    if (sgm__migrate_managed_place(ctx, b->dptr, b->size, from, stream) != SGM_OK)
      sgm__log(sgm__parts_cfg(ctx)->verbose, 1, "a managed block's advice could not be restored after a "
               "failed move: %s", sgm_last_error());
    return rc;
  }
  sgm__tier_uncharge(sgm__parts_tier(ctx, from), b->size);
  sgm__buffer_set_tier(b, to);
  migrate_count(pl, from, to, b->size, evict);
  int up = to < from ? 0 : 1;
  sgm__lock_take(&pl->mlock);
  pl->n_managed_in[from]--;
  pl->n_managed_in[to]++;
  pl->mslack_in[from] -= b->size - b->mwant;
  pl->mslack_in[to] += b->size - b->mwant;
  pl->n_managed_moves[up]++;
  pl->managed_moved_bytes[up] += b->size;
  pl->mq_moved_bytes[sgm__managed_queue_on_worker()] += b->size;
  sgm__lock_drop(&pl->mlock);
  return SGM_OK;
}

/* A managed victim leaves VRAM for shared memory (never for disk: its pages
 * are the user's pointer). */
static int migrate_managed_demote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict) {
  if (to != SGM_TIER_SHARED || b->tier != SGM_TIER_VRAM)
    return sgm__error_set(SGM_ERR_INVALID, "a managed block moves between VRAM and shared memory "
                          "only");
  int rc = sgm__parts_pl(ctx)->ask.residency_charge_for(ctx, SGM_TIER_SHARED, b->size, NULL);
  if (rc == SGM__ERR_BUDGET) return sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_SHARED), b->size);
  if (rc != SGM_OK) return rc;
  rc = sgm__migrate_managed(ctx, b, SGM_TIER_SHARED, evict);
  if (rc != SGM_OK) sgm__tier_uncharge(sgm__parts_tier(ctx, SGM_TIER_SHARED), b->size);
  return rc;
}

int sgm__migrate_demote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (b->managed) return migrate_managed_demote(ctx, b, to, evict);
  while (b->tier < to) {
    sgm_tier from = b->tier;
    sgm_tier next = (sgm_tier)(from + 1);
    if (from == SGM_TIER_VRAM && to == SGM_TIER_DISK && pl->disk) {
      /* One hop: no shared-memory block taken, copied into and freed. */
      int rc = sgm__migrate_disk_from_vram(ctx, b);
      if (rc != SGM_OK) return rc; /* the data stays in VRAM */
      migrate_count(pl, from, SGM_TIER_DISK, b->size, evict);
      break;
    }
    if (next == SGM_TIER_DISK) {
      if (!pl->disk)
        return sgm__error_set(SGM_ERR_NOMEM, "no disk tier to spill to: set SGM_SPILL_DIR to a "
                              "directory (and SGM_SPILL_LIMIT) to let buffers spill to disk");
      /* The host reads the block: it waits for the release's work itself. */
      int rc = sgm__migrate_order_use(ctx, &b->event, b->event_stream, MIGRATE_HOST);
      if (rc != SGM_OK) return rc;
      sgm_disk_extent *ext = NULL;
      rc = sgm__migrate_disk_store(ctx, b, migrate_shared_host(ctx, b->dptr), &ext);
      if (rc != SGM_OK) return rc; /* the data stays in shared memory */
      migrate_free_block(ctx, SGM_TIER_SHARED, b->dptr);
      b->dptr = 0;
      b->ext = ext;
    } else {
      sgm_devptr dst = 0;
      int rc = pl->ask.residency_alloc_for(ctx, next, b->size, NULL, &dst);
      if ((rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM) && pl->disk) {
        /* Shared memory is full of what cannot move: skip it, straight to disk. */
        rc = sgm__migrate_disk_from_vram(ctx, b);
        if (rc != SGM_OK) return rc;
        migrate_count(pl, from, SGM_TIER_DISK, b->size, evict);
        continue;
      }
      if (rc == SGM__ERR_BUDGET) rc = sgm__tier_explain_budget(sgm__parts_tier(ctx, next), b->size);
      if (rc != SGM_OK) return rc;
      rc = sgm__migrate_order_copy(ctx, b, SGM_COPY_DEVICE_TO_HOST,
                                   (uintptr_t)migrate_shared_host(ctx, dst), b->dptr, b->size);
      if (rc != SGM_OK) {
        migrate_free_block(ctx, next, dst);
        return rc;
      }
      migrate_free_block(ctx, from, b->dptr);
      b->dptr = dst;
    }
    sgm__buffer_set_tier(b, next);
    migrate_count(pl, from, next, b->size, evict);
  }
  return SGM_OK;
}

int sgm__migrate_promote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, sgm_devptr dst) {
  sgm_tier from = b->tier;
  int rc;
  if (from == SGM_TIER_DISK && to == SGM_TIER_SHARED) {
    rc = sgm__migrate_disk_load(ctx, b, migrate_shared_host(ctx, dst));
    if (rc == SGM_OK) sgm__migrate_disk_drop(ctx, b);
  } else if (from == SGM_TIER_DISK) {
    rc = sgm__migrate_disk_to_vram(ctx, b, dst);
    if (rc == SGM_OK) sgm__migrate_disk_drop(ctx, b);
  } else {
    rc = sgm__migrate_order_copy(ctx, b, SGM_COPY_HOST_TO_DEVICE, dst,
                                 (uintptr_t)migrate_shared_host(ctx, b->dptr), b->size);
    if (rc == SGM_OK) migrate_free_block(ctx, from, b->dptr);
  }
  if (rc != SGM_OK) {
    migrate_free_block(ctx, to, dst);
    return rc;
  }
  b->dptr = dst;
  sgm__buffer_set_tier(b, to);
  migrate_count(sgm__parts_pl(ctx), from, to, b->size, false);
  return SGM_OK;
}

int sgm__migrate_host_io(sgm_context *ctx, sgm_buffer *b, size_t offset, void *host, size_t n,
                         bool write) {
  if (b->tier == SGM_TIER_DISK) return sgm__migrate_disk_host_io(ctx, b, offset, host, n, write);
  return write ? sgm__migrate_order_copy(ctx, b, SGM_COPY_HOST_TO_DEVICE, b->dptr + offset, (uintptr_t)host, n)
               : sgm__migrate_order_copy(ctx, b, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)host, b->dptr + offset, n);
}
