/*
 * migrate_disk.c — a buffer's data on disk: the spill and the read back of
 * its chunks (one extent per SGM_DISK_CHUNK), the one-hop moves between VRAM
 * and disk, and host reads and writes of a disk-resident buffer. migrate.c
 * decides which hop a demotion or a promotion takes; this file does the disk
 * side of it.
 *
 * The one-hop moves go through the disk tier's pinned staging slots,
 * pipelined there (sgm__disk_write_staged / sgm__disk_read_staged): the
 * device copy of one 4 MiB piece overlaps the file I/O of the others. The
 * staging region is the backend's pinned host memory, lent to the disk tier
 * by the first transfer that needs it (migrate_disk_stage_lend).
 *
 * Invariant: every chunk of a disk-resident buffer has an extent or, never
 * written since the buffer was created on disk, a reservation in the disk
 * tier's budget (sgm__disk_reserve); a failed store, load or write leaves the
 * buffer's extents (and so its contents) as they were.
 *
 * Threading: the caller owns the buffer (BUSY) and holds no sgm lock; the
 * disk I/O, the device copies (sgm__migrate_order_copy, ordered after the
 * release's GPU work) and the pool call here run unlocked. Calls: the disk
 * tier (tiers/disk.c, which takes its own lock), the VRAM pool, and the
 * backend's host_alloc for the staging region.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

static uint64_t migrate_disk_n_chunks(const sgm_buffer *b) {
  return (b->size + SGM_DISK_CHUNK - 1) / SGM_DISK_CHUNK;
}

static uint64_t migrate_disk_chunk_len(const sgm_buffer *b, uint64_t i) {
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
  uint64_t n = migrate_disk_n_chunks(b), unwritten = 0;
  for (uint64_t i = 0; i < n; i++)
    if (!b->ext || b->ext[i].bytes == 0) unwritten += sgm__align_up(migrate_disk_chunk_len(b, i), 4096);
  if (unwritten) sgm__disk_unreserve(sgm__parts_pl(ctx)->disk, unwritten);
  migrate_disk_free_all(sgm__parts_pl(ctx)->disk, b->ext, n);
  b->ext = NULL;
}

/* Write b->size bytes of host memory src as a new set of extents (*out,
 * malloc'd). On failure nothing stays allocated. */
int sgm__migrate_disk_store(sgm_context *ctx, const sgm_buffer *b, const void *src, sgm_disk_extent **out) {
  *out = NULL;
  uint64_t n = migrate_disk_n_chunks(b);
  sgm_disk_extent *ext = calloc((size_t)n, sizeof *ext);
  if (!ext) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
  for (uint64_t i = 0; i < n; i++) {
    int rc = sgm__disk_write(sgm__parts_pl(ctx)->disk, (const char *)src + i * SGM_DISK_CHUNK,
                             migrate_disk_chunk_len(b, i), &ext[i]);
    if (rc != SGM_OK) {
      migrate_disk_free_all(sgm__parts_pl(ctx)->disk, ext, i);
      return rc;
    }
  }
  *out = ext;
  return SGM_OK;
}

/* Read chunk i of a disk-resident b into dst (zeros if never written). */
static int migrate_disk_load_chunk(sgm_context *ctx, const sgm_buffer *b, uint64_t i, void *dst) {
  if (!b->ext || b->ext[i].bytes == 0) {
    memset(dst, 0, (size_t)migrate_disk_chunk_len(b, i));
    return SGM_OK;
  }
  return sgm__disk_read(sgm__parts_pl(ctx)->disk, &b->ext[i], dst);
}

/* Read a disk-resident buffer's bytes into host memory dst (zeros if never written). */
int sgm__migrate_disk_load(sgm_context *ctx, const sgm_buffer *b, void *dst) {
  for (uint64_t i = 0, n = migrate_disk_n_chunks(b); i < n; i++) {
    int rc = migrate_disk_load_chunk(ctx, b, i, (char *)dst + i * SGM_DISK_CHUNK);
    if (rc != SGM_OK) return rc;
  }
  return SGM_OK;
}

static int migrate_disk_no_stage(const sgm_buffer *b) {
  return sgm__error_set(SGM_ERR_NOMEM, "out of host memory staging a %llu-byte buffer",
                        (unsigned long long)b->size);
}

_Static_assert(SGM_DISK_CHUNK <= SGM_DISK_BOUNCE_BYTES, "a chunk is staged in one bounce buffer");

/* Lend the disk tier its pinned staging region (SGM_DISK_STAGE_BYTES,
 * DMA straight from it), allocated through the backend by the first transfer
 * that needs it; without it the tier stages through pageable memory. */
static void migrate_disk_stage_lend(sgm_context *ctx) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  bool tried = false;
  if (__atomic_load_n(&pl->disk_bounce_tried, __ATOMIC_ACQUIRE) ||
      !__atomic_compare_exchange_n(&pl->disk_bounce_tried, &tried, true, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE))
    return;
  void *host = NULL;
  sgm_devptr dev = 0;
  if (sgm__parts_bops(ctx)->host_alloc(sgm__parts_be(ctx), SGM_DISK_STAGE_BYTES, -1, &host, &dev) == SGM_OK) {
    __atomic_store_n(&pl->disk_bounce, host, __ATOMIC_RELEASE);
    sgm__disk_lend_bounce(pl->disk, host);
  } else {
    sgm__log(sgm__parts_cfg(ctx)->verbose, 2, "no pinned staging buffer for the disk tier (%s): transfers "
             "stage through pageable memory", sgm_last_error());
  }
}

/* One staging piece of SGM_DISK_BOUNCE_BYTES from the disk tier. */
static void *migrate_disk_stage_get(sgm_context *ctx) {
  migrate_disk_stage_lend(ctx);
  return sgm__disk_stage_get(sgm__parts_pl(ctx)->disk);
}

/* The device side of a staged disk transfer: chunk i of b's data at dev. */
typedef struct migrate_disk_staged {
  sgm_context *ctx; /* the context */
  sgm_buffer *b;    /* the buffer being moved (BUSY: ours) */
  sgm_devptr dev;   /* its device block */
} migrate_disk_staged;

/* Fill a staging slot with chunk i of the VRAM block (eviction). */
static int migrate_disk_fill_from_device(void *user, uint64_t i, void *slot, uint64_t len) {
  migrate_disk_staged *a = user;
  return sgm__migrate_order_copy(a->ctx, a->b, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)slot,
                                 a->dev + i * SGM_DISK_CHUNK, len);
}

/* Drain a staging slot into chunk i of the VRAM block (promotion). */
static int migrate_disk_drain_to_device(void *user, uint64_t i, void *slot, uint64_t len) {
  migrate_disk_staged *a = user;
  return sgm__migrate_order_copy(a->ctx, a->b, SGM_COPY_HOST_TO_DEVICE, a->dev + i * SGM_DISK_CHUNK,
                                 (uintptr_t)slot, len);
}

/* Spill a VRAM-resident b to disk in one hop: each chunk is copied into a
 * staging slot and written from there while the next chunk is copied (the
 * disk tier pipelines them). On failure b stays in VRAM, untouched. */
int sgm__migrate_disk_from_vram(sgm_context *ctx, sgm_buffer *b) {
  migrate_disk_stage_lend(ctx);
  sgm_disk_extent *ext = calloc((size_t)migrate_disk_n_chunks(b), sizeof *ext);
  if (!ext) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
  migrate_disk_staged a = {ctx, b, b->dptr};
  int rc = sgm__disk_write_staged(sgm__parts_pl(ctx)->disk, b->size, SGM_DISK_CHUNK,
                                  migrate_disk_fill_from_device, &a, ext);
  if (rc != SGM_OK) {
    free(ext);
    return rc;
  }
  /* Every copy completed before its piece was written: the block is free. */
  uint64_t freed;
  sgm__tier_free(sgm__parts_tier(ctx, SGM_TIER_VRAM), b->dptr, &freed);
  b->dptr = 0;
  b->ext = ext;
  sgm__buffer_set_tier(b, SGM_TIER_DISK);
  return SGM_OK;
}

/* Read a disk-resident b into the VRAM block dst in one hop, pipelined as
 * sgm__migrate_disk_from_vram (chunks never written arrive as zeros). */
int sgm__migrate_disk_to_vram(sgm_context *ctx, sgm_buffer *b, sgm_devptr dst) {
  migrate_disk_stage_lend(ctx);
  sgm_disk_extent *zeros = NULL;
  if (!b->ext && !(zeros = calloc((size_t)migrate_disk_n_chunks(b), sizeof *zeros)))
    return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
  migrate_disk_staged a = {ctx, b, dst};
  int rc = sgm__disk_read_staged(sgm__parts_pl(ctx)->disk, b->size, SGM_DISK_CHUNK,
                                 b->ext ? b->ext : zeros, migrate_disk_drain_to_device, &a);
  free(zeros);
  return rc;
}

/* A host write into a disk-resident b: each chunk it touches goes to a new
 * extent (a chunk it covers whole straight from src, unread — a lost chunk
 * is replaced; one it covers in part read, patched and written through
 * stage); only when all are written do they replace the old ones. */
static int migrate_disk_write(sgm_context *ctx, sgm_buffer *b, uint64_t offset, const char *src,
                              uint64_t n, char *stage) {
  sgm_disk *disk = sgm__parts_pl(ctx)->disk;
  uint64_t first = offset / SGM_DISK_CHUNK, last = (offset + n - 1) / SGM_DISK_CHUNK;
  uint64_t n_new = last - first + 1;
  sgm_disk_extent *fresh = calloc((size_t)n_new, sizeof *fresh);
  if (!fresh) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
  if (!b->ext) {
    b->ext = calloc((size_t)migrate_disk_n_chunks(b), sizeof *b->ext); /* all zeros so far */
    if (!b->ext) {
      free(fresh);
      return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extents");
    }
  }
  int rc = SGM_OK;
  for (uint64_t i = first; i <= last && rc == SGM_OK; i++) {
    uint64_t c0 = i * SGM_DISK_CHUNK, len = migrate_disk_chunk_len(b, i);
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

int sgm__migrate_disk_host_io(sgm_context *ctx, sgm_buffer *b, size_t offset, void *host, size_t n,
                              bool write) {
  /* One chunk of staging, the disk tier's, whatever the buffer's size. */
  char *stage = migrate_disk_stage_get(ctx);
  if (!stage) return migrate_disk_no_stage(b);
  int rc = SGM_OK;
  if (write) {
    rc = migrate_disk_write(ctx, b, offset, host, n, stage);
  } else {
    uint64_t first = offset / SGM_DISK_CHUNK, last = (offset + n - 1) / SGM_DISK_CHUNK;
    for (uint64_t i = first; i <= last && rc == SGM_OK; i++) {
      uint64_t c0 = i * SGM_DISK_CHUNK, len = migrate_disk_chunk_len(b, i);
      uint64_t lo = offset > c0 ? offset : c0;
      uint64_t hi = offset + n < c0 + len ? offset + n : c0 + len;
      rc = migrate_disk_load_chunk(ctx, b, i, stage);
      if (rc == SGM_OK) memcpy((char *)host + (lo - offset), stage + (lo - c0), (size_t)(hi - lo));
    }
  }
  sgm__disk_stage_put(sgm__parts_pl(ctx)->disk, stage);
  return rc;
}
