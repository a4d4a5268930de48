/*
 * migrate.c — moving a buffer's data between tiers: demote (VRAM -> shared ->
 * disk, or VRAM straight to disk when shared memory is full of what cannot
 * move), promote (back up into a block residency.c found), and host reads and
 * writes wherever the data lives.
 *
 * Invariant: a move either completes (data in the new tier, the old storage
 * freed, the migration counted) or leaves the buffer as it was.
 *
 * Ordering (DESIGN.md §8): every copy of a buffer's data runs after the GPU
 * work queued before its release. While that work is pending (b->event not
 * complete) the copy runs on the release's own stream (migrate_copy), so the
 * device orders it, and the host waits only for the copy's completion, which
 * the backend's copy contract gives before the source block is freed,
 * reused or unpinned. Once the copy is done the release event is complete
 * too and is dropped. A released buffer on the legacy stream, or on a
 * per-thread default stream (whose handle names another stream on the
 * mover's thread), is copied on the legacy stream, which follows the earlier
 * work of every blocking stream. Spilling from shared memory to disk is the
 * one migration the host does itself: it waits for the release's work first.
 * An explicit eviction therefore proceeds with the release's work pending
 * (victim searches still prefer buffers whose work is done).
 * Threading: the caller owns the buffer (BUSY) and holds no lock; the copies,
 * disk I/O and pool calls here run unlocked. pl->lock is taken only to count.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

static void *migrate_shared_host(sgm_context *ctx, sgm_devptr d) {
  return sgm__shared_host_ptr(ctx->tiers[SGM_TIER_SHARED], d);
}

/* Not a stream: the host itself uses the data (sgm__migrate_order_use waits). */
#define MIGRATE_HOST ((void *)(uintptr_t)UINTPTR_MAX)

/* True when work queued on stream a before now is ordered before work queued
 * on b afterwards by stream order alone (the same stream). */
static bool migrate_same_stream(void *a, void *b) {
  if (!a) a = SGM_STREAM_LEGACY;
  if (!b) b = SGM_STREAM_LEGACY;
  return a == b;
}

/* Drop b's release event if its work has completed; else say which stream a
 * copy of b's data must run on to follow that work (see the file comment). */
static void *migrate_order_stream(sgm_context *ctx, sgm_buffer *b) {
  if (!b->event) return NULL;
  if (ctx->bops->event_query(ctx->be, b->event) == 1) {
    ctx->bops->event_destroy(ctx->be, b->event);
    b->event = NULL;
    return NULL;
  }
  void *s = b->event_stream;
  return !s || s == SGM_STREAM_PER_THREAD ? SGM_STREAM_LEGACY : s;
}

/* Copy n bytes of b's data (from or to it), after the work queued before its
 * release; complete when this returns. */
static int migrate_copy(sgm_context *ctx, sgm_buffer *b, sgm_copy_kind kind, uint64_t dst,
                        uint64_t src, uint64_t n) {
  void *stream = migrate_order_stream(ctx, b);
  int rc = ctx->bops->copy(ctx->be, kind, dst, src, n, stream);
  if (rc == SGM_OK && stream) {
    /* The copy followed the release's work on its stream and is complete. */
    ctx->bops->event_destroy(ctx->be, b->event);
    b->event = NULL;
  }
  return rc;
}

int sgm__migrate_order_use(sgm_context *ctx, void **event, void *event_stream, void *stream) {
  if (!*event) return SGM_OK;
  if (!migrate_same_stream(event_stream, stream)) {
    /* Another stream: its work must see the release's work done. Until the
     * backend can make one stream wait for another's event on the device,
     * the host waits (only here: a pending release and a stream change). */
    int rc = ctx->bops->event_wait(ctx->be, *event);
    if (rc != SGM_OK) return rc;
  }
  ctx->bops->event_destroy(ctx->be, *event);
  *event = NULL;
  return SGM_OK;
}

static void migrate_free_block(sgm_context *ctx, sgm_tier t, sgm_devptr d) {
  uint64_t sz;
  sgm__tier_free(ctx->tiers[t], d, &sz);
}

static void migrate_count(struct sgm_placement *pl, sgm_tier from, sgm_tier to, uint64_t n, bool evict) {
  sgm__lock_take(&pl->lock);
  pl->bytes_out[from] += n;
  pl->bytes_in[to] += n;
  if (evict) pl->n_evictions[from]++;
  if (to == SGM_TIER_DISK) {
    pl->n_disk_live++;
    pl->disk_used_bytes += n;
  }
  if (from == SGM_TIER_DISK) {
    pl->n_disk_live--;
    pl->disk_used_bytes -= n;
  }
  sgm__lock_drop(&pl->lock);
}

/* Read a disk-resident buffer's bytes into host memory dst (zeros if never written). */
static int migrate_disk_load(sgm_context *ctx, const sgm_buffer *b, void *dst) {
  if (b->ext.bytes == 0) {
    memset(dst, 0, b->size);
    return SGM_OK;
  }
  return sgm__disk_read(ctx->pl->disk, &b->ext, dst);
}

static int migrate_no_stage(const sgm_buffer *b) {
  return sgm__error_set(SGM_ERR_NOMEM, "out of host memory staging a %llu-byte buffer",
                        (unsigned long long)b->size);
}

/* Spill a VRAM-resident b to disk through a host staging copy. */
static int migrate_vram_to_disk(sgm_context *ctx, sgm_buffer *b) {
  void *stage = malloc(b->size);
  if (!stage) return migrate_no_stage(b);
  int rc = migrate_copy(ctx, b, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)stage, b->dptr, b->size);
  sgm_disk_extent ext;
  if (rc == SGM_OK) rc = sgm__disk_write(ctx->pl->disk, stage, b->size, &ext);
  free(stage);
  if (rc != SGM_OK) return rc;
  migrate_free_block(ctx, SGM_TIER_VRAM, b->dptr);
  b->dptr = 0;
  b->ext = ext;
  sgm__buffer_set_tier(b, SGM_TIER_DISK);
  return SGM_OK;
}

int sgm__migrate_demote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict) {
  struct sgm_placement *pl = ctx->pl;
  while (b->tier < to) {
    sgm_tier from = b->tier;
    sgm_tier next = (sgm_tier)(from + 1);
    if (next == SGM_TIER_DISK) {
      if (!pl->disk)
        return sgm__error_set(SGM_ERR_NOMEM, "no disk tier to spill to: set SGM_SPILL_DIR to a "
                              "directory (and SGM_SPILL_LIMIT) to let buffers spill to disk");
      /* The host reads the block: it waits for the release's work itself. */
      int rc = sgm__migrate_order_use(ctx, &b->event, b->event_stream, MIGRATE_HOST);
      if (rc != SGM_OK) return rc;
      sgm_disk_extent ext;
      rc = sgm__disk_write(pl->disk, migrate_shared_host(ctx, b->dptr), b->size, &ext);
      if (rc != SGM_OK) return rc; /* the data stays in shared memory */
      migrate_free_block(ctx, SGM_TIER_SHARED, b->dptr);
      b->dptr = 0;
      b->ext = ext;
    } else {
      sgm_devptr dst = 0;
      int rc = sgm__residency_alloc_for(ctx, next, b->size, NULL, &dst);
      if ((rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM) && pl->disk) {
        /* Shared memory is full of what cannot move: skip it, straight to disk. */
        rc = migrate_vram_to_disk(ctx, b);
        if (rc != SGM_OK) return rc;
        migrate_count(pl, from, SGM_TIER_DISK, b->size, evict);
        continue;
      }
      if (rc == SGM__ERR_BUDGET) rc = sgm__tier_explain_budget(ctx->tiers[next], b->size);
      if (rc != SGM_OK) return rc;
      rc = migrate_copy(ctx, b, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)migrate_shared_host(ctx, dst),
                        b->dptr, b->size);
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
  if (from == SGM_TIER_DISK) {
    void *host = to == SGM_TIER_SHARED ? migrate_shared_host(ctx, dst) : malloc(b->size);
    rc = host ? migrate_disk_load(ctx, b, host) : migrate_no_stage(b);
    if (rc == SGM_OK && to == SGM_TIER_VRAM)
      rc = migrate_copy(ctx, b, SGM_COPY_HOST_TO_DEVICE, dst, (uintptr_t)host, b->size);
    if (to == SGM_TIER_VRAM) free(host);
    if (rc == SGM_OK && b->ext.bytes) sgm__disk_free(ctx->pl->disk, &b->ext);
  } else {
    rc = migrate_copy(ctx, b, SGM_COPY_HOST_TO_DEVICE, dst,
                      (uintptr_t)migrate_shared_host(ctx, b->dptr), b->size);
    if (rc == SGM_OK) migrate_free_block(ctx, from, b->dptr);
  }
  if (rc != SGM_OK) {
    migrate_free_block(ctx, to, dst);
    return rc;
  }
  b->dptr = dst;
  b->ext = (sgm_disk_extent){0};
  sgm__buffer_set_tier(b, to);
  migrate_count(ctx->pl, from, to, b->size, false);
  return SGM_OK;
}

int sgm__migrate_host_io(sgm_context *ctx, sgm_buffer *b, size_t offset, void *host, size_t n,
                         bool write) {
  if (b->tier != SGM_TIER_DISK)
    return write ? migrate_copy(ctx, b, SGM_COPY_HOST_TO_DEVICE, b->dptr + offset, (uintptr_t)host, n)
                 : migrate_copy(ctx, b, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)host, b->dptr + offset, n);
  struct sgm_placement *pl = ctx->pl;
  void *img = malloc(b->size);
  int rc = img ? migrate_disk_load(ctx, b, img) : migrate_no_stage(b);
  if (rc == SGM_OK && !write) memcpy(host, (char *)img + offset, n);
  if (rc == SGM_OK && write) {
    memcpy((char *)img + offset, host, n);
    sgm_disk_extent ext;
    rc = sgm__disk_write(pl->disk, img, b->size, &ext);
    if (rc == SGM_OK) {
      if (b->ext.bytes) sgm__disk_free(pl->disk, &b->ext);
      b->ext = ext;
    }
  }
  free(img);
  return rc;
}
