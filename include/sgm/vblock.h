/*
 * sgm/vblock.h — virtual blocks: sgm's offset allocator over a range of
 * offsets that the caller owns (like VMA's VmaVirtualBlock).
 *
 * A virtual block hands out [offset, offset + size) pieces of one range the
 * caller names at create; it never touches memory, so the range may stand
 * for anything: KV-cache pages of a pool, an arena inside one big device
 * allocation, a GPU heap, a file. It is the allocator sgm's own tiers use
 * (exact best fit, free in O(1), neighbours coalesce at once; docs/vblock.md).
 *
 * Not thread-safe: one virtual block is used by one thread at a time (the
 * caller locks around it if it shares one). Different blocks are independent.
 * Errors return sgm_status with a message in sgm_last_error(); out-parameters
 * are written on every path (0 / NULL on failure). C11 and C++17 clean.
 */
#ifndef SGM_VBLOCK_H
#define SGM_VBLOCK_H

#include <sgm.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A virtual block; opaque. */
typedef struct sgm_vblock sgm_vblock;

/* What sgm_vblock_get_stats reports. Grows only at the end. */
typedef struct sgm_vblock_stats {
  uint64_t size_bytes;         /* the range's size, as created */
  uint64_t used_bytes;         /* bytes in live allocations, rounding and alignment padding included */
  uint64_t n_allocations;      /* live allocations */
  uint64_t n_free_ranges;      /* free fragments (holes between allocations, and the ends) */
  uint64_t largest_free_bytes; /* the biggest free fragment: an upper bound on what the next alloc gets */
} sgm_vblock_stats;

/*
 * Create a virtual block over [offset, offset + size_bytes). granule_bytes (a
 * power of two; 0 means 1) is the unit of every allocation: sizes round up to
 * it and offsets are multiples of it; offset and size_bytes must be
 * multiples of it and the range must not wrap around 2^64. *out is the new
 * block, NULL on failure (SGM_ERR_INVALID for bad arguments, SGM_ERR_NOMEM).
 * The caller owns the block and destroys it with sgm_vblock_destroy.
 */
SGM_API sgm_status sgm_vblock_create(uint64_t offset, uint64_t size_bytes, uint64_t granule_bytes,
                                     sgm_vblock **out);

/*
 * Allocate size_bytes (> 0) at an offset that is a multiple of
 * alignment_bytes (a power of two; 0 means the granule). *offset_out is the
 * allocation's offset, 0 on failure. SGM_ERR_NOMEM when no free fragment
 * fits (the message gives the largest one), SGM_ERR_INVALID for bad
 * arguments. An alignment above the granule costs up to alignment - granule
 * bytes of padding, counted in used_bytes and returned by sgm_vblock_free.
 */
SGM_API sgm_status sgm_vblock_alloc(sgm_vblock *vb, uint64_t size_bytes, uint64_t alignment_bytes,
                                    uint64_t *offset_out);

/*
 * Free the allocation that sgm_vblock_alloc returned at offset. SGM_ERR_INVALID
 * (nothing changes) when no live allocation starts there: a double free or
 * an offset this block did not hand out. vb NULL: SGM_ERR_INVALID.
 */
SGM_API sgm_status sgm_vblock_free(sgm_vblock *vb, uint64_t offset);

/* Free every allocation at once; the block is as created. SGM_ERR_NOMEM (the
 * block unchanged) if the host is out of memory for fresh metadata. */
SGM_API sgm_status sgm_vblock_clear(sgm_vblock *vb);

/* The block's figures. O(1). *out zeroed when vb is NULL. */
SGM_API void sgm_vblock_get_stats(const sgm_vblock *vb, sgm_vblock_stats *out);

/* Destroy the block; live allocations simply cease to exist. NULL: no-op. */
SGM_API void sgm_vblock_destroy(sgm_vblock *vb);

#ifdef __cplusplus
}
#endif

#endif /* SGM_VBLOCK_H */
