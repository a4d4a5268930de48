/*
 * migrate.c — moving a buffer's data between tiers: demote (VRAM -> shared ->
 * disk; VRAM straight to disk in one hop when disk is the target, or when
 * shared memory is full of what cannot move), promote (back up into a block
 * residency.c found; disk -> VRAM in one hop), and host reads and writes
 * wherever the data lives. The one-hop moves go through the disk tier's
 * pinned staging slots, pipelined there (sgm__disk_write_staged /
 * sgm__disk_read_staged): the device copy of one 4 MiB piece overlaps the
 * file I/O of the others.
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
 * disk I/O and pool calls here run unlocked. The counters are atomics;
 * pl->mlock is taken only for the managed blocks' counters.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

static void *migrate_shared_host(sgm_context *ctx, sgm_devptr d) {
  return sgm__shared_host_ptr(sgm__context_tier(ctx, SGM_TIER_SHARED), d);
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
  if (sgm__context_bops(ctx)->event_query(sgm__context_be(ctx), b->event) == 1) {
    sgm__context_bops(ctx)->event_destroy(sgm__context_be(ctx), b->event);
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
  int rc = sgm__context_bops(ctx)->copy(sgm__context_be(ctx), kind, dst, src, n, stream);
  if (rc == SGM_OK && stream) {
    /* The copy followed the release's work on its stream and is complete. */
    sgm__context_bops(ctx)->event_destroy(sgm__context_be(ctx), b->event);
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
    int rc = sgm__context_bops(ctx)->event_wait(sgm__context_be(ctx), *event);
    if (rc != SGM_OK) return rc;
  }
  sgm__context_bops(ctx)->event_destroy(sgm__context_be(ctx), *event);
  *event = NULL;
  return SGM_OK;
}

static void migrate_free_block(sgm_context *ctx, sgm_tier t, sgm_devptr d) {
  uint64_t sz;
  sgm__tier_free(sgm__context_tier(ctx, t), d, &sz);
}

/* Atomics, no lock: movers in different tiers count without meeting. */
static void migrate_count(struct sgm_placement *pl, sgm_tier from, sgm_tier to, uint64_t n, bool evict) {
  __atomic_add_fetch(&pl->bytes_out[from], n, __ATOMIC_RELAXED);
  __atomic_add_fetch(&pl->bytes_in[to], n, __ATOMIC_RELAXED);
  if (evict) __atomic_add_fetch(&pl->n_evictions[from], 1, __ATOMIC_RELAXED);
  if (to == SGM_TIER_DISK) __atomic_add_fetch(&pl->n_disk_live, 1, __ATOMIC_RELAXED);
  if (from == SGM_TIER_DISK) __atomic_sub_fetch(&pl->n_disk_live, 1, __ATOMIC_RELAXED);
}

/* ---- a disk-resident buffer: one extent per SGM_DISK_CHUNK ---- */

static uint64_t migrate_n_chunks(const sgm_buffer *b) {
  return (b->size + SGM_DISK_CHUNK - 1) / SGM_DISK_CHUNK;
}

static uint64_t migrate_chunk_len(const sgm_buffer *b, uint64_t i) {
  uint64_t start = i * SGM_DISK_CHUNK;
  return b->size - start < SGM_DISK_CHUNK ? b->size - start : SGM_DISK_CHUNK;
}

static void migrate_disk_free_all(sgm_disk *disk, sgm_disk_extent *ext, uint64_t n) {
  if (!ext) return;
  for (uint64_t i = 0; i < n; i++)
    if (ext[i].bytes) sgm__disk_free(disk, &ext[i]);
  free(ext);
}

/* Invariant: every chunk of a disk-resident buffer has an extent or, never
 * written since the buffer was created on disk, a reservation in the disk
 * tier's budget (sgm__disk_reserve). */
void sgm__migrate_disk_drop(sgm_context *ctx, sgm_buffer *b) {
  uint64_t n = migrate_n_chunks(b), unwritten = 0;
  for (uint64_t i = 0; i < n; i++)
    if (!b->ext || b->ext[i].bytes == 0) unwritten += sgm__align_up(migrate_chunk_len(b, i), 4096);
  if (unwritten) sgm__disk_unreserve(sgm__context_pl(ctx)->disk, unwritten);
  migrate_disk_free_all(sgm__context_pl(ctx)->disk, b->ext, n);
  b->ext = NULL;
}

/* Write b->size bytes of host memory src as a new set of extents (*out,
 * malloc'd). On failure nothing stays allocated. */
static int migrate_disk_store(sgm_context *ctx, const sgm_buffer *b, const void *src,
                              sgm_disk_extent **out) {
  *out = NULL;
  uint64_t n = migrate_n_chunks(b);
  sgm_disk_extent *ext = calloc((size_t)n, sizeof *ext);
  if (!ext) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
  for (uint64_t i = 0; i < n; i++) {
    int rc = sgm__disk_write(sgm__context_pl(ctx)->disk, (const char *)src + i * SGM_DISK_CHUNK,
                             migrate_chunk_len(b, i), &ext[i]);
    if (rc != SGM_OK) {
      migrate_disk_free_all(sgm__context_pl(ctx)->disk, ext, i);
      return rc;
    }
  }
  *out = ext;
  return SGM_OK;
}

/* Read chunk i of a disk-resident b into dst (zeros if never written). */
static int migrate_disk_load_chunk(sgm_context *ctx, const sgm_buffer *b, uint64_t i, void *dst) {
  if (!b->ext || b->ext[i].bytes == 0) {
    memset(dst, 0, (size_t)migrate_chunk_len(b, i));
    return SGM_OK;
  }
  return sgm__disk_read(sgm__context_pl(ctx)->disk, &b->ext[i], dst);
}

/* Read a disk-resident buffer's bytes into host memory dst (zeros if never written). */
static int migrate_disk_load(sgm_context *ctx, const sgm_buffer *b, void *dst) {
  for (uint64_t i = 0, n = migrate_n_chunks(b); i < n; i++) {
    int rc = migrate_disk_load_chunk(ctx, b, i, (char *)dst + i * SGM_DISK_CHUNK);
    if (rc != SGM_OK) return rc;
  }
  return SGM_OK;
}

static int migrate_no_stage(const sgm_buffer *b) {
  return sgm__error_set(SGM_ERR_NOMEM, "out of host memory staging a %llu-byte buffer",
                        (unsigned long long)b->size);
}

_Static_assert(SGM_DISK_CHUNK <= SGM_DISK_BOUNCE_BYTES, "a chunk is staged in one bounce buffer");

/* Lend the disk tier its pinned staging region (SGM_DISK_STAGE_BYTES,
 * DMA straight from it), allocated through the backend by the first transfer
 * that needs it; without it the tier stages through pageable memory. */
static void migrate_stage_lend(sgm_context *ctx) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  bool tried = false;
  if (__atomic_load_n(&pl->disk_bounce_tried, __ATOMIC_ACQUIRE) ||
      !__atomic_compare_exchange_n(&pl->disk_bounce_tried, &tried, true, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE))
    return;
  void *host = NULL;
  sgm_devptr dev = 0;
  if (sgm__context_bops(ctx)->host_alloc(sgm__context_be(ctx), SGM_DISK_STAGE_BYTES, -1, &host, &dev) == SGM_OK) {
    __atomic_store_n(&pl->disk_bounce, host, __ATOMIC_RELEASE);
    sgm__disk_lend_bounce(pl->disk, host);
  } else {
    sgm__log(sgm__context_cfg(ctx)->verbose, 2, "no pinned staging buffer for the disk tier (%s): transfers "
             "stage through pageable memory", sgm_last_error());
  }
}

/* One staging piece of SGM_DISK_BOUNCE_BYTES from the disk tier. */
static void *migrate_stage_get(sgm_context *ctx) {
  migrate_stage_lend(ctx);
  return sgm__disk_stage_get(sgm__context_pl(ctx)->disk);
}

_Static_assert(SGM_DISK_CHUNK <= SGM_DISK_BOUNCE_BYTES, "a chunk is staged in one piece");

/* The device side of a staged disk transfer: chunk i of b's data at dev. */
typedef struct migrate_staged {
  sgm_context *ctx; /* the context */
  sgm_buffer *b;    /* the buffer being moved (BUSY: ours) */
  sgm_devptr dev;   /* its device block */
} migrate_staged;

/* Fill a staging slot with chunk i of the VRAM block (eviction). */
static int migrate_fill_from_device(void *user, uint64_t i, void *slot, uint64_t len) {
  migrate_staged *a = user;
  return migrate_copy(a->ctx, a->b, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)slot,
                      a->dev + i * SGM_DISK_CHUNK, len);
}

/* Drain a staging slot into chunk i of the VRAM block (promotion). */
static int migrate_drain_to_device(void *user, uint64_t i, void *slot, uint64_t len) {
  migrate_staged *a = user;
  return migrate_copy(a->ctx, a->b, SGM_COPY_HOST_TO_DEVICE, a->dev + i * SGM_DISK_CHUNK,
                      (uintptr_t)slot, len);
}

/* Spill a VRAM-resident b to disk in one hop: each chunk is copied into a
 * staging slot and written from there while the next chunk is copied (the
 * disk tier pipelines them). On failure b stays in VRAM, untouched. */
static int migrate_vram_to_disk(sgm_context *ctx, sgm_buffer *b) {
  migrate_stage_lend(ctx);
  sgm_disk_extent *ext = calloc((size_t)migrate_n_chunks(b), sizeof *ext);
  if (!ext) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
  migrate_staged a = {ctx, b, b->dptr};
  int rc = sgm__disk_write_staged(sgm__context_pl(ctx)->disk, b->size, SGM_DISK_CHUNK,
                                  migrate_fill_from_device, &a, ext);
  if (rc != SGM_OK) {
    free(ext);
    return rc;
  }
  /* Every copy completed before its piece was written: the block is free. */
  migrate_free_block(ctx, SGM_TIER_VRAM, b->dptr);
  b->dptr = 0;
  b->ext = ext;
  sgm__buffer_set_tier(b, SGM_TIER_DISK);
  return SGM_OK;
}

/* Read a disk-resident b into the VRAM block dst in one hop, pipelined as
 * migrate_vram_to_disk (chunks never written arrive as zeros). */
static int migrate_disk_to_vram(sgm_context *ctx, sgm_buffer *b, sgm_devptr dst) {
  migrate_stage_lend(ctx);
  sgm_disk_extent *zeros = NULL;
  if (!b->ext && !(zeros = calloc((size_t)migrate_n_chunks(b), sizeof *zeros)))
    return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
  migrate_staged a = {ctx, b, dst};
  int rc = sgm__disk_read_staged(sgm__context_pl(ctx)->disk, b->size, SGM_DISK_CHUNK,
                                 b->ext ? b->ext : zeros, migrate_drain_to_device, &a);
  free(zeros);
  return rc;
}

/* ---- managed blocks: the pages move, the address stays ---- */

int sgm__migrate_managed_place(sgm_context *ctx, sgm_devptr d, uint64_t n, sgm_tier to, void *stream) {
  const sgm_backend_ops *o = sgm__context_bops(ctx);
  /* Advice first, so that the driver keeps the pages where sgm put them
   * (and maps host-placed ones for the device: no fault per access). */
  int rc = o->managed_advise(sgm__context_be(ctx), d, n, to == SGM_TIER_VRAM ? SGM_ADVISE_PREFER_DEVICE
                                                                 : SGM_ADVISE_PREFER_HOST);
  if (rc == SGM_OK && to == SGM_TIER_SHARED) rc = o->managed_advise(sgm__context_be(ctx), d, n, SGM_ADVISE_ACCESSED_BY);
  if (rc == SGM_OK) rc = o->managed_prefetch(sgm__context_be(ctx), d, n, to, stream);
  return rc;
}

int sgm__migrate_managed(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict) {
  return sgm__migrate_managed_on(ctx, b, to, evict, b->mstream);
}

int sgm__migrate_managed_on(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict, void *stream) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  sgm_tier from = b->tier;
  sgm_assert(b->managed && from < SGM_N_RESIDENT && to < SGM_N_RESIDENT && from != to);
  sgm__managed_queue_drop(ctx, b); /* this move supersedes a queued one */
  int rc = sgm__migrate_managed_place(ctx, b->dptr, b->size, to, stream);
  if (rc != SGM_OK) {
    /* Advice may have changed; put it back so the pages stay where counted. */
    if (sgm__migrate_managed_place(ctx, b->dptr, b->size, from, stream) != SGM_OK)
      sgm__log(sgm__context_cfg(ctx)->verbose, 1, "a managed block's advice could not be restored after a "
               "failed move: %s", sgm_last_error());
    return rc;
  }
  sgm__tier_uncharge(sgm__context_tier(ctx, from), b->size);
  sgm__buffer_set_tier(b, to);
  migrate_count(pl, from, to, b->size, evict);
  int up = to < from ? 0 : 1;
  sgm__lock_take(&pl->mlock);
  pl->n_managed_in[from]--;
  pl->n_managed_in[to]++;
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
  int rc = sgm__residency_charge_for(ctx, SGM_TIER_SHARED, b->size, NULL);
  if (rc == SGM__ERR_BUDGET) return sgm__tier_explain_budget(sgm__context_tier(ctx, SGM_TIER_SHARED), b->size);
  if (rc != SGM_OK) return rc;
  rc = sgm__migrate_managed(ctx, b, SGM_TIER_SHARED, evict);
  if (rc != SGM_OK) sgm__tier_uncharge(sgm__context_tier(ctx, SGM_TIER_SHARED), b->size);
  return rc;
}

int sgm__migrate_demote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  if (b->managed) return migrate_managed_demote(ctx, b, to, evict);
  while (b->tier < to) {
    sgm_tier from = b->tier;
    sgm_tier next = (sgm_tier)(from + 1);
    if (from == SGM_TIER_VRAM && to == SGM_TIER_DISK && pl->disk) {
      /* One hop: no shared-memory block taken, copied into and freed. */
      int rc = migrate_vram_to_disk(ctx, b);
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
      rc = migrate_disk_store(ctx, b, migrate_shared_host(ctx, b->dptr), &ext);
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
      if (rc == SGM__ERR_BUDGET) rc = sgm__tier_explain_budget(sgm__context_tier(ctx, next), b->size);
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
  if (from == SGM_TIER_DISK && to == SGM_TIER_SHARED) {
    rc = migrate_disk_load(ctx, b, migrate_shared_host(ctx, dst));
    if (rc == SGM_OK) sgm__migrate_disk_drop(ctx, b);
  } else if (from == SGM_TIER_DISK) {
    rc = migrate_disk_to_vram(ctx, b, dst);
    if (rc == SGM_OK) sgm__migrate_disk_drop(ctx, b);
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
  sgm__buffer_set_tier(b, to);
  migrate_count(sgm__context_pl(ctx), from, to, b->size, false);
  return SGM_OK;
}

/* A host write into a disk-resident b: each chunk it touches goes to a new
 * extent (a chunk it covers whole straight from src, unread — a lost chunk
 * is replaced; one it covers in part read, patched and written through
 * stage); only when all are written do they replace the old ones. */
static int migrate_disk_write(sgm_context *ctx, sgm_buffer *b, uint64_t offset, const char *src,
                              uint64_t n, char *stage) {
  sgm_disk *disk = sgm__context_pl(ctx)->disk;
  uint64_t first = offset / SGM_DISK_CHUNK, last = (offset + n - 1) / SGM_DISK_CHUNK;
  uint64_t n_new = last - first + 1;
  sgm_disk_extent *fresh = calloc((size_t)n_new, sizeof *fresh);
  if (!fresh) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
  if (!b->ext) {
    b->ext = calloc((size_t)migrate_n_chunks(b), sizeof *b->ext); /* all zeros so far */
    if (!b->ext) {
      free(fresh);
      return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
    }
  }
  int rc = SGM_OK;
  for (uint64_t i = first; i <= last && rc == SGM_OK; i++) {
    uint64_t c0 = i * SGM_DISK_CHUNK, len = migrate_chunk_len(b, i);
    uint64_t lo = offset > c0 ? offset : c0;
    uint64_t hi = offset + n < c0 + len ? offset + n : c0 + len;
    const char *data = src + (lo - offset);
    if (lo != c0 || hi != c0 + len) {
      rc = migrate_disk_load_chunk(ctx, b, i, stage);
      if (rc != SGM_OK) break;
      memcpy(stage + (lo - c0), data, (size_t)(hi - lo));
      data = stage;
    }
    /* A chunk never written holds a reservation: its extent comes out of it. */
    rc = sgm__disk_write_ex(disk, data, len, b->ext[i].bytes == 0, &fresh[i - first]);
  }
  if (rc != SGM_OK) {
    for (uint64_t k = 0; k < n_new; k++)
      if (fresh[k].bytes) sgm__disk_free_ex(disk, &fresh[k], b->ext[first + k].bytes == 0);
    free(fresh);
    return rc; /* every old extent stays: the buffer holds its old contents */
  }
  for (uint64_t i = first; i <= last; i++) {
    if (b->ext[i].bytes) sgm__disk_free(disk, &b->ext[i]);
    b->ext[i] = fresh[i - first];
  }
  free(fresh);
  return SGM_OK;
}

int sgm__migrate_host_io(sgm_context *ctx, sgm_buffer *b, size_t offset, void *host, size_t n,
                         bool write) {
  if (b->tier != SGM_TIER_DISK)
    return write ? migrate_copy(ctx, b, SGM_COPY_HOST_TO_DEVICE, b->dptr + offset, (uintptr_t)host, n)
                 : migrate_copy(ctx, b, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)host, b->dptr + offset, n);
  /* One chunk of staging, the disk tier's, whatever the buffer's size. */
  char *stage = migrate_stage_get(ctx);
  if (!stage) return migrate_no_stage(b);
  int rc = SGM_OK;
  if (write) {
    rc = migrate_disk_write(ctx, b, offset, host, n, stage);
  } else {
    uint64_t first = offset / SGM_DISK_CHUNK, last = (offset + n - 1) / SGM_DISK_CHUNK;
    for (uint64_t i = first; i <= last && rc == SGM_OK; i++) {
      uint64_t c0 = i * SGM_DISK_CHUNK, len = migrate_chunk_len(b, i);
      uint64_t lo = offset > c0 ? offset : c0;
      uint64_t hi = offset + n < c0 + len ? offset + n : c0 + len;
      rc = migrate_disk_load_chunk(ctx, b, i, stage);
      if (rc == SGM_OK) memcpy((char *)host + (lo - offset), stage + (lo - c0), (size_t)(hi - lo));
    }
  }
  sgm__disk_stage_put(sgm__context_pl(ctx)->disk, stage);
  return rc;
}
