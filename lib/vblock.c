/*
 * vblock.c — the public virtual block (include/sgm/vblock.h): a thin wrapper
 * over the sub-allocator (suballoc.c) with one range, argument checks, and
 * per-allocation alignment.
 *
 * Alignment above the granule: the sub-allocator aligns every block to its
 * granule only, so an allocation asking more takes size + alignment -
 * granule bytes and hands out the first aligned offset inside. When that
 * offset is not the block's start, a small open-addressing table maps it back
 * (`moved`), so that free() takes the offset the caller got; a second entry
 * marks the block's start, which the caller never got and may not free.
 * Allocations at the granule's alignment (the common case) never touch it.
 *
 * Invariants: `moved` holds pairs: (aligned offset -> its block, !is_start)
 * and (block start, is_start), both for one live allocation.
 * Threading: none (the header says so); the caller serialises.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "sgm/vblock.h"

/* The moved-offset table starts with 16 slots and doubles past 1/2 full. */
#define VBLOCK_MOVED_MIN_SLOTS 16

typedef struct vblock_slot {
  uint64_t key;   /* an offset; VBLOCK_EMPTY = free slot */
  uint64_t block; /* the sub-allocator block the offset lies in */
  bool is_start;  /* key is that block's start, not an offset handed out */
} vblock_slot;

#define VBLOCK_EMPTY UINT64_MAX /* no allocation starts there: an aligned offset < 2^64 - 1 */

struct sgm_vblock {
  sgm_suballoc *sa;      /* the allocator over the one range */
  uint64_t offset;       /* the range's start */
  uint64_t size_bytes;   /* the range's size */
  uint64_t granule;      /* the sub-allocator's alignment, bytes */
  vblock_slot *moved;    /* aligned offset -> block start, for offsets not at a block start */
  size_t n_slots;        /* moved's size: 0 or a power of two */
  size_t n_moved;        /* used slots */
};

static size_t vblock_hash(uint64_t key, size_t n_slots) {
  return (size_t)((key * UINT64_C(0x9E3779B97F4A7C15)) >> 32) & (n_slots - 1);
}

static vblock_slot *vblock_find(const sgm_vblock *vb, uint64_t key) {
  if (!vb->n_slots || key == VBLOCK_EMPTY) return NULL;
  for (size_t i = vblock_hash(key, vb->n_slots);; i = (i + 1) & (vb->n_slots - 1)) {
    if (vb->moved[i].key == key) return &vb->moved[i];
    if (vb->moved[i].key == VBLOCK_EMPTY) return NULL;
  }
}

static void vblock_put(vblock_slot *slots, size_t n_slots, vblock_slot s) {
  size_t i = vblock_hash(s.key, n_slots);
  while (slots[i].key != VBLOCK_EMPTY) i = (i + 1) & (n_slots - 1);
  slots[i] = s;
}

/* Room for two more entries; false when out of host memory (nothing changed). */
static bool vblock_reserve(sgm_vblock *vb) {
  if (vb->n_slots && (vb->n_moved + 2) * 2 <= vb->n_slots) return true;
  size_t n = vb->n_slots ? vb->n_slots * 2 : VBLOCK_MOVED_MIN_SLOTS;
  vblock_slot *s = malloc(n * sizeof *s);
  if (!s) return false;
  for (size_t i = 0; i < n; i++) s[i].key = VBLOCK_EMPTY;
  for (size_t i = 0; i < vb->n_slots; i++)
    if (vb->moved[i].key != VBLOCK_EMPTY) vblock_put(s, n, vb->moved[i]);
  free(vb->moved);
  vb->moved = s;
  vb->n_slots = n;
  return true;
}

/* Remove the slot at e, re-placing the run after it (linear probing). */
static void vblock_erase(sgm_vblock *vb, vblock_slot *e) {
  size_t i = (size_t)(e - vb->moved);
  vb->moved[i].key = VBLOCK_EMPTY;
  vb->n_moved--;
  for (size_t j = (i + 1) & (vb->n_slots - 1); vb->moved[j].key != VBLOCK_EMPTY;
       j = (j + 1) & (vb->n_slots - 1)) {
    vblock_slot s = vb->moved[j];
    vb->moved[j].key = VBLOCK_EMPTY;
    vblock_put(vb->moved, vb->n_slots, s);
  }
}

/* A fresh sub-allocator over vb's range. */
static int vblock_fresh(const sgm_vblock *vb, sgm_suballoc **out) {
  int rc = sgm__suballoc_create(vb->granule, out);
  if (rc != SGM_OK) return rc;
  rc = sgm__suballoc_add_range(*out, vb->offset, vb->size_bytes);
  if (rc != SGM_OK) {
    sgm__suballoc_destroy(*out);
    *out = NULL;
  }
  return rc;
}

SGM_API sgm_status sgm_vblock_create(uint64_t offset, uint64_t size_bytes, uint64_t granule_bytes,
                                     sgm_vblock **out) {
  if (!out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_vblock_create: out is NULL");
  *out = NULL;
  uint64_t g = granule_bytes ? granule_bytes : 1;
  if (!sgm__is_pow2(g))
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_vblock_create: granule %llu is not a "
                                      "power of two", (unsigned long long)granule_bytes);
  if (size_bytes == 0 || offset % g || size_bytes % g || offset > UINT64_MAX - size_bytes)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_vblock_create: the range [%llu, +%llu) "
                                      "must be non-empty, a multiple of the granule %llu at both "
                                      "ends, and not wrap around", (unsigned long long)offset,
                                      (unsigned long long)size_bytes, (unsigned long long)g);
  sgm_vblock *vb = calloc(1, sizeof *vb);
  if (!vb) return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "sgm_vblock_create: out of host memory");
  vb->offset = offset;
  vb->size_bytes = size_bytes;
  vb->granule = g;
  int rc = vblock_fresh(vb, &vb->sa);
  if (rc != SGM_OK) {
    free(vb);
    return (sgm_status)rc;
  }
  *out = vb;
  return SGM_OK;
}

SGM_API sgm_status sgm_vblock_alloc(sgm_vblock *vb, uint64_t size_bytes, uint64_t alignment_bytes,
                                    uint64_t *offset_out) {
  if (!offset_out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_vblock_alloc: offset_out is NULL");
  *offset_out = 0;
  if (!vb) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_vblock_alloc: block is NULL");
  uint64_t a = alignment_bytes ? alignment_bytes : vb->granule;
  if (size_bytes == 0 || !sgm__is_pow2(a))
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_vblock_alloc: size %llu must be > 0 and "
                                      "alignment %llu a power of two", (unsigned long long)size_bytes,
                                      (unsigned long long)alignment_bytes);
  uint64_t pad = a > vb->granule ? a - vb->granule : 0;
  uint64_t block = 0, got = 0;
  bool ok = size_bytes <= vb->size_bytes && pad <= vb->size_bytes - size_bytes;
  if (ok && pad && !vblock_reserve(vb))
    return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "sgm_vblock_alloc: out of host memory");
  if (ok) ok = sgm__suballoc_try_alloc(vb->sa, size_bytes + pad, &block, &got);
  if (!ok) {
    sgm_suballoc_stats st;
    sgm__suballoc_stats(vb->sa, &st);
    return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "sgm_vblock_alloc: no free range holds %llu "
                                      "bytes aligned to %llu (largest free: %llu of %llu bytes)",
                                      (unsigned long long)size_bytes, (unsigned long long)a,
                                      (unsigned long long)st.largest_free_bytes,
                                      (unsigned long long)vb->size_bytes);
  }
  uint64_t at = sgm__align_up(block, a);
  if (at != block) {
    vblock_put(vb->moved, vb->n_slots, (vblock_slot){.key = at, .block = block, .is_start = false});
    vblock_put(vb->moved, vb->n_slots, (vblock_slot){.key = block, .block = block, .is_start = true});
    vb->n_moved += 2;
  }
  *offset_out = at;
  return SGM_OK;
}

SGM_API sgm_status sgm_vblock_free(sgm_vblock *vb, uint64_t offset) {
  if (!vb) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_vblock_free: block is NULL");
  vblock_slot *e = vblock_find(vb, offset);
  uint64_t block = e ? e->block : offset, sz;
  int rc = e && e->is_start ? SGM_ERR_INVALID : sgm__suballoc_free(vb->sa, block, &sz);
  if (rc != SGM_OK)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_vblock_free: no live allocation starts at "
                                      "offset %llu (freed twice, or not from this block)",
                                      (unsigned long long)offset);
  if (e) {
    vblock_erase(vb, e);
    vblock_erase(vb, vblock_find(vb, block));
  }
  return SGM_OK;
}

SGM_API sgm_status sgm_vblock_clear(sgm_vblock *vb) {
  if (!vb) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_vblock_clear: block is NULL");
  sgm_suballoc *sa;
  int rc = vblock_fresh(vb, &sa);
  if (rc != SGM_OK) return (sgm_status)rc;
  sgm__suballoc_destroy(vb->sa);
  vb->sa = sa;
  for (size_t i = 0; i < vb->n_slots; i++) vb->moved[i].key = VBLOCK_EMPTY;
  vb->n_moved = 0;
  return SGM_OK;
}

SGM_API void sgm_vblock_get_stats(const sgm_vblock *vb, sgm_vblock_stats *out) {
  if (!out) return;
  memset(out, 0, sizeof *out);
  if (!vb) return;
  sgm_suballoc_stats st;
  sgm__suballoc_stats(vb->sa, &st);
  out->size_bytes = vb->size_bytes;
  out->used_bytes = st.used_bytes;
  out->n_allocations = st.n_live;
  out->n_free_ranges = st.n_free_blocks;
  out->largest_free_bytes = st.largest_free_bytes;
}

SGM_API void sgm_vblock_destroy(sgm_vblock *vb) {
  if (!vb) return;
  sgm__suballoc_destroy(vb->sa);
  free(vb->moved);
  free(vb);
}
