/*
 * suballoc.c — the offset-based sub-allocator with its metadata off-chunk.
 *
 * It carves an abstract offset space made of ranges its owner adds (a tier's
 * chunks, at their device addresses) and never touches the memory itself, so
 * it works on VRAM the CPU cannot address. Design note: docs/suballoc.md.
 *
 * Model. Each range is split into blocks that tile it exactly, in address
 * order, linked through prev/next (NULL at the range's ends, so a block never
 * reaches into another range even when two ranges touch). A block is free or
 * live. Live blocks are found by offset in a hash table (free() is O(1)),
 * or, in an unindexed allocator, not at all: its owner keeps each block's
 * node and frees by it (the tier pool, whose own live map finds the block).
 * Free blocks sit in 14,592 size bins with a two-level bitmap of the
 * non-empty ones: below 512 granules one bin per size, a LIFO list; above,
 * 256 bins per power of two, each a treap ordered by (size, offset).
 *
 * Placement is exact best fit — the smallest free block that fits; among
 * equal sizes the lowest offset (treap bins) or the most recently freed (list
 * bins) — and the new block goes to the end of that free block nearer an end
 * of its range (the low end on a tie): allocations pile up from both ends of
 * a range and the holes collect in the middle, which measured 0.12 lower
 * fragmentation than always carving from the bottom (docs/suballoc.md).
 *
 * Invariants (all checked by sgm__suballoc_check):
 *  - ranges are aligned, non-empty, disjoint, kept sorted by offset;
 *  - the blocks of a range tile it: contiguous, aligned offset and size > 0;
 *  - no two free blocks are neighbours (free coalesces at once);
 *  - a range's first block is the same node for the range's whole life (a
 *    split or merge keeps the lower node), so range->first never moves;
 *  - every free block is in bin(size) (list or treap) and nowhere else; a
 *    bin's bitmap bit is set iff the bin is non-empty; every live block is in
 *    the hash bucket of its offset and nowhere else (unindexed: the hash
 *    is empty);
 *  - used_bytes + free bytes == capacity_bytes; the counters match the walk.
 *
 * Cost: alloc and free are O(1) plus at most three bin operations: O(1) in a
 * list bin, O(log n) expected in a treap bin (which holds sizes within 0.4%
 * of each other, so in practice a handful of blocks). The hash table and the
 * node pool grow geometrically: a malloc on the hot path is amortised and
 * rare. add/remove_range are O(number of ranges) for the sorted array.
 *
 * Errors: a request that fits nowhere returns false without a message (the
 * owner knows the budgets and says why); a failed metadata malloc, a bad
 * argument or a free of a non-block set one through sgm__error_set.
 *
 * Threading: none. No locks: the owner serialises every call.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Bins: sizes below 2^(SL_BITS+1) granules get one bin each; above, each
 * power of two is cut into 2^SL_BITS bins. 256 (SL_BITS 8) measured fastest
 * for churn: 10,000-block churn took 86 ns/pair with 64 bins per power of
 * two, 75 with 128 and 66 with 256 (512: 63), because more blocks land in
 * O(1) list bins and the treaps shrink. The cost is 114 KiB of bin roots per
 * allocator, mostly untouched. */
#define SUBALLOC_SL_BITS 8
#define SUBALLOC_SL_COUNT (1u << SUBALLOC_SL_BITS)
#define SUBALLOC_N_BINS ((65u - SUBALLOC_SL_BITS) * SUBALLOC_SL_COUNT)
#define SUBALLOC_N_WORDS ((SUBALLOC_N_BINS + 63u) / 64u)
#define SUBALLOC_N_SUMMARY ((SUBALLOC_N_WORDS + 63u) / 64u)
/* Bins below this hold exactly one size each. */
#define SUBALLOC_N_EXACT_BINS (2u * SUBALLOC_SL_COUNT)
/* A slab of nodes is 16 KiB: one malloc feeds 255 splits, small enough that
 * an allocator with a few blocks (a trace replay) stays small. */
#define SUBALLOC_SLAB_NODES 255
/* The live-block hash starts with 64 buckets and doubles past load 1. */
#define SUBALLOC_MIN_BUCKET_BITS 6
/* Fixed treap seed: runs are reproducible; priorities only need to be
 * independent of the keys, not secret. */
#define SUBALLOC_RNG_SEED UINT64_C(0x9E3779B97F4A7C15)
/* A treap deeper than this is corrupt (expected depth is ~3 ln n). */
#define SUBALLOC_MAX_DEPTH 4096

/* The hot path is a handful of small functions, forced inline into alloc
 * and free so the compiler schedules them together without call overhead. */
#if defined(__GNUC__)
#define SUBALLOC_HOT static inline __attribute__((always_inline))
#else
#define SUBALLOC_HOT static inline
#endif

typedef enum suballoc_state {
  SUBALLOC_POOLED = 0x5A0, /* in the node pool, describes nothing */
  SUBALLOC_FREE = 0x5A1,   /* a free block, in its bin */
  SUBALLOC_LIVE = 0x5A2    /* a live block, in the hash table */
} suballoc_state;

typedef struct suballoc_range suballoc_range;
typedef struct sgm_suballoc_node suballoc_block;

/* One block of a range. 64 bytes: one cache line per node. */
struct sgm_suballoc_node {
  uint64_t offset;       /* bytes: start in the offset space (multiple of align) */
  uint64_t size;         /* bytes: length (multiple of align, > 0) */
  suballoc_block *prev;  /* lower neighbour in the same range; NULL at the range start */
  suballoc_block *next;  /* higher neighbour in the same range; NULL at the range end */
  suballoc_range *range; /* the range this block lies in */
  union {
    struct {
      suballoc_block *left;  /* free: treap child with smaller key / list: previous */
      suballoc_block *right; /* free: treap child with larger key / list: next */
    } tree;
    suballoc_block *hash_next; /* live: next block in the same hash bucket; pooled: next in pool */
  } u;
  uint32_t priority; /* treap heap priority: random, fixed per node */
  uint16_t state;    /* suballoc_state */
  uint16_t bin;      /* free: the bin it is in (saves recomputing it on removal) */
};

struct suballoc_range {
  uint64_t offset;       /* bytes: start of the range */
  uint64_t size;         /* bytes: length of the range */
  suballoc_block *first; /* the block at offset; the same node for the range's life */
};

/* A range without live blocks is one free block: free neighbours coalesce. */
static inline bool suballoc_range_empty(const suballoc_range *r) {
  return r->first->state == SUBALLOC_FREE && r->first->size == r->size;
}

_Static_assert(sizeof(suballoc_block) == 64, "a node is one cache line");
_Static_assert(SUBALLOC_N_BINS <= UINT16_MAX, "suballoc_block.bin holds a bin index");

typedef struct suballoc_slab suballoc_slab;
struct suballoc_slab {
  suballoc_block nodes[SUBALLOC_SLAB_NODES]; /* the nodes; first, so they are cache-line aligned */
  suballoc_slab *next;                       /* next slab of this allocator */
};

struct sgm_suballoc {
  uint64_t align_bytes;    /* bytes: granule of every offset and size (power of two) */
  unsigned align_shift;    /* log2(align_bytes) */
  uint64_t max_request;    /* bytes: the largest size that rounds up without overflow */
  uint64_t capacity_bytes; /* bytes: sum of the ranges' sizes */
  uint64_t used_bytes;     /* bytes: sum of the live blocks' sizes */
  uint64_t n_live;         /* live blocks */
  uint64_t n_free_blocks;  /* free blocks (all in the bins) */

  suballoc_range **ranges; /* the ranges, sorted by offset */
  size_t n_ranges;         /* entries used in ranges */
  size_t cap_ranges;       /* entries allocated in ranges */

  bool indexed;             /* live blocks are in the hash (false: the owner keeps their nodes) */
  int (*end_hook)(void *, uint64_t, uint64_t, uint64_t); /* the owner's say on which end a split cuts */
  void *end_arg;
  suballoc_block **buckets; /* live-block hash: chains through u.hash_next */
  unsigned bucket_bits;     /* log2(number of buckets) */
  unsigned bucket_shift;    /* 64 - bucket_bits: the hash's final shift */
  uint64_t grow_at;         /* live blocks past which the buckets double (load 1) */

  suballoc_block *pool;   /* unused nodes, chained through u.hash_next */
  suballoc_slab *slabs;   /* every slab, for destroy */
  uint64_t n_nodes;       /* nodes in all slabs (check: pooled + blocks) */
  uint64_t rng;           /* xorshift64 state for treap priorities, never 0 */
  int64_t fail_countdown; /* tests: metadata mallocs left before one fails; -1 = never */

  uint64_t bin_summary[SUBALLOC_N_SUMMARY];  /* bit w set iff bin_bits[w] != 0 */
  uint64_t bin_bits[SUBALLOC_N_WORDS];       /* bit b set iff bins[b] is non-empty */
  suballoc_block *bins[SUBALLOC_N_BINS];     /* each size bin: list head or treap root */
};

/* ------------------------------------------------------------------------ */
/* Size bins and their bitmap. */

/* Branch-free: with fl the top bit of g (at least SL_BITS), the bin is
 * (fl - SL_BITS) * SL_COUNT + the top SL_BITS+1 bits of g; below
 * 2 * SL_COUNT granules that is g itself (exact bins). */
static inline unsigned suballoc_bin(const sgm_suballoc *sa, uint64_t size) {
  uint64_t g = size >> sa->align_shift;
  unsigned shift = 63u - (unsigned)__builtin_clzll(g | SUBALLOC_SL_COUNT) - SUBALLOC_SL_BITS;
  return (shift << SUBALLOC_SL_BITS) + (unsigned)(g >> shift);
}

static inline void suballoc_bit_set(sgm_suballoc *sa, unsigned b) {
  sa->bin_bits[b >> 6] |= UINT64_C(1) << (b & 63);
  sa->bin_summary[b >> 12] |= UINT64_C(1) << ((b >> 6) & 63);
}

static inline void suballoc_bit_clear(sgm_suballoc *sa, unsigned b) {
  sa->bin_bits[b >> 6] &= ~(UINT64_C(1) << (b & 63));
  if (!sa->bin_bits[b >> 6]) sa->bin_summary[b >> 12] &= ~(UINT64_C(1) << ((b >> 6) & 63));
}

/* The first non-empty bin >= b, or SUBALLOC_N_BINS. O(1): one bitmap word,
 * then at most SUBALLOC_N_SUMMARY summary words. */
static inline unsigned suballoc_next_bin(const sgm_suballoc *sa, unsigned b) {
  if (b >= SUBALLOC_N_BINS) return SUBALLOC_N_BINS;
  unsigned w = b >> 6;
  uint64_t m = sa->bin_bits[w] & (~UINT64_C(0) << (b & 63));
  if (m) return (w << 6) + (unsigned)__builtin_ctzll(m);
  w++; /* the first bitmap word still to look at */
  for (unsigned sw = w >> 6; sw < SUBALLOC_N_SUMMARY; sw++) {
    uint64_t sm = sa->bin_summary[sw];
    if (sw == w >> 6) sm &= ~UINT64_C(0) << (w & 63);
    if (sm) {
      unsigned x = (sw << 6) + (unsigned)__builtin_ctzll(sm);
      return (x << 6) + (unsigned)__builtin_ctzll(sa->bin_bits[x]);
    }
  }
  return SUBALLOC_N_BINS;
}

/* ------------------------------------------------------------------------ */
/* Treaps: one per bin, in-order by (size, offset), max-heap by priority.
 * Split/merge formulations need no parent pointers, which keeps a node at 64
 * bytes. Keys are unique because offsets are. */

static inline bool suballoc_less(const suballoc_block *a, const suballoc_block *b) {
  return a->size < b->size || (a->size == b->size && a->offset < b->offset);
}

SUBALLOC_HOT void suballoc_treap_insert(suballoc_block **root, suballoc_block *x) {
  suballoc_block **link = root;
  while (*link && (*link)->priority >= x->priority)
    link = suballoc_less(x, *link) ? &(*link)->u.tree.left : &(*link)->u.tree.right;
  /* x takes this place; the subtree that was here splits around x's key. */
  suballoc_block *t = *link;
  suballoc_block **l = &x->u.tree.left, **r = &x->u.tree.right;
  while (t) {
    if (suballoc_less(t, x)) {
      *l = t;
      l = &t->u.tree.right;
      t = t->u.tree.right;
    } else {
      *r = t;
      r = &t->u.tree.left;
      t = t->u.tree.left;
    }
  }
  *l = NULL;
  *r = NULL;
  *link = x;
}

/* Replace the node *link points at by the merge of its subtrees (every key
 * on the left < every key on the right). */
SUBALLOC_HOT void suballoc_treap_unlink(suballoc_block **link) {
  suballoc_block *x = *link;
  suballoc_block *l = x->u.tree.left, *r = x->u.tree.right;
  while (l && r) {
    if (l->priority > r->priority) {
      *link = l;
      link = &l->u.tree.right;
      l = l->u.tree.right;
    } else {
      *link = r;
      link = &r->u.tree.left;
      r = r->u.tree.left;
    }
  }
  *link = l ? l : r;
}

SUBALLOC_HOT void suballoc_treap_remove(suballoc_block **root, suballoc_block *x) {
  suballoc_block **link = root;
  while (*link != x) {
    sgm_assert_internal(*link != NULL); /* x must be in this treap */
    link = suballoc_less(x, *link) ? &(*link)->u.tree.left : &(*link)->u.tree.right;
  }
  suballoc_treap_unlink(link);
}

static bool suballoc_treap_contains(const suballoc_block *t, const suballoc_block *x) {
  while (t && t != x) t = suballoc_less(x, t) ? t->u.tree.left : t->u.tree.right;
  return t == x;
}

/* Bins below 2 * SL_COUNT granules hold one size each, so they need no order by
 * size: they are LIFO lists (u.tree.left = previous, u.tree.right = next),
 * O(1) for everything. Churn leaves most of its free blocks there (slivers
 * cut off by best fit), where treaps were the hot spot. */
static inline bool suballoc_bin_is_list(unsigned bin) { return bin < SUBALLOC_N_EXACT_BINS; }

static bool suballoc_bin_contains(const sgm_suballoc *sa, unsigned bin, const suballoc_block *b) {
  if (!suballoc_bin_is_list(bin)) return suballoc_treap_contains(sa->bins[bin], b);
  return b->u.tree.left ? b->u.tree.left->u.tree.right == b : sa->bins[bin] == b;
}

SUBALLOC_HOT void suballoc_bin_insert(sgm_suballoc *sa, suballoc_block *b) {
  unsigned bin = suballoc_bin(sa, b->size);
  b->bin = (uint16_t)bin;
  suballoc_block *head = sa->bins[bin];
  if (!head) suballoc_bit_set(sa, bin);
  if (suballoc_bin_is_list(bin)) {
    b->u.tree.left = NULL;
    b->u.tree.right = head;
    if (head) head->u.tree.left = b;
    sa->bins[bin] = b;
  } else {
    suballoc_treap_insert(&sa->bins[bin], b);
  }
  b->state = SUBALLOC_FREE;
  sa->n_free_blocks++;
}

SUBALLOC_HOT void suballoc_bin_remove(sgm_suballoc *sa, suballoc_block *b) {
  unsigned bin = b->bin;
  sgm_assert_internal(b->state == SUBALLOC_FREE && bin == suballoc_bin(sa, b->size));
  sgm_assert_expensive(suballoc_bin_contains(sa, bin, b));
  if (suballoc_bin_is_list(bin)) {
    suballoc_block *prev = b->u.tree.left, *next = b->u.tree.right;
    if (prev)
      prev->u.tree.right = next;
    else
      sa->bins[bin] = next;
    if (next) next->u.tree.left = prev;
  } else {
    suballoc_treap_remove(&sa->bins[bin], b);
  }
  if (!sa->bins[bin]) suballoc_bit_clear(sa, bin);
  sa->n_free_blocks--;
}

/* Exact best fit: the smallest free block of at least size bytes, ties to the
 * lowest offset (in a list bin: the most recently freed). Bins below
 * bin(size) hold only smaller blocks and bins above only larger ones, so only
 * bin(size) needs a search. Returns the link that points at the block (a bin
 * root or a treap child slot), so taking it out needs no second descent, and
 * its bin in *bin_out; NULL when nothing fits. */
SUBALLOC_HOT suballoc_block **suballoc_find(sgm_suballoc *sa, uint64_t size, unsigned *bin_out) {
  unsigned bin = suballoc_bin(sa, size);
  *bin_out = bin;
  suballoc_block **best = NULL;
  if (suballoc_bin_is_list(bin)) {
    if (sa->bins[bin]) return &sa->bins[bin];
  } else {
    for (suballoc_block **link = &sa->bins[bin]; *link;) {
      if ((*link)->size >= size) {
        best = link;
        link = &(*link)->u.tree.left;
      } else {
        link = &(*link)->u.tree.right;
      }
    }
    if (best) return best;
  }
  bin = suballoc_next_bin(sa, bin + 1);
  if (bin == SUBALLOC_N_BINS) return NULL;
  *bin_out = bin;
  best = &sa->bins[bin];
  if (!suballoc_bin_is_list(bin))
    while ((*best)->u.tree.left) best = &(*best)->u.tree.left;
  return best;
}

/* Take out of its bin the block *link points at (link from suballoc_find). */
SUBALLOC_HOT void suballoc_bin_unlink(sgm_suballoc *sa, unsigned bin, suballoc_block **link) {
  suballoc_block *b = *link;
  sgm_assert_internal(b->state == SUBALLOC_FREE && b->bin == bin);
  if (suballoc_bin_is_list(bin)) {
    /* suballoc_find returns a list's head. */
    suballoc_block *next = b->u.tree.right;
    sgm_assert_internal(link == &sa->bins[bin]);
    *link = next;
    if (next) next->u.tree.left = NULL;
  } else {
    suballoc_treap_unlink(link);
  }
  if (!sa->bins[bin]) suballoc_bit_clear(sa, bin);
  sa->n_free_blocks--;
}

/* ------------------------------------------------------------------------ */
/* Live-block hash table, keyed by offset (Fibonacci hashing). */

static inline size_t suballoc_hash(const sgm_suballoc *sa, uint64_t offset) {
  return (size_t)((offset * UINT64_C(0x9E3779B97F4A7C15)) >> sa->bucket_shift);
}

static suballoc_block *suballoc_lookup(const sgm_suballoc *sa, uint64_t offset) {
  suballoc_block *b = sa->buckets[suballoc_hash(sa, offset)];
  while (b && b->offset != offset) b = b->u.hash_next;
  return b;
}

/* True when the test hook says this metadata malloc must fail. Only slow
 * paths (pool refill, hash growth, add_range) ask. */
static bool suballoc_inject_fail(sgm_suballoc *sa) {
  if (sgm_likely(sa->fail_countdown < 0)) return false;
  return sa->fail_countdown-- == 0;
}

/* Double the bucket array; on malloc failure keep the old one (longer chains
 * are slower, never wrong) and retry only at twice the load, not on every
 * allocation. */
static void suballoc_hash_grow(sgm_suballoc *sa) {
  unsigned bits = sa->bucket_bits + 1;
  suballoc_block **nb = suballoc_inject_fail(sa) ? NULL : calloc((size_t)1 << bits, sizeof *nb);
  if (!nb) {
    sa->grow_at = sa->grow_at > UINT64_MAX / 2 ? UINT64_MAX : sa->grow_at * 2;
    return;
  }
  suballoc_block **old = sa->buckets;
  size_t n_old = (size_t)1 << sa->bucket_bits;
  sa->buckets = nb;
  sa->bucket_bits = bits;
  sa->bucket_shift = 64 - bits;
  sa->grow_at = (uint64_t)1 << bits;
  for (size_t i = 0; i < n_old; i++) {
    for (suballoc_block *b = old[i], *nx; b; b = nx) {
      nx = b->u.hash_next;
      size_t h = suballoc_hash(sa, b->offset);
      b->u.hash_next = nb[h];
      nb[h] = b;
    }
  }
  free(old);
}

static void suballoc_hash_insert(sgm_suballoc *sa, suballoc_block *b) {
  size_t h = suballoc_hash(sa, b->offset);
  b->u.hash_next = sa->buckets[h];
  sa->buckets[h] = b;
  b->state = SUBALLOC_LIVE;
}

/* The link that points at the live block starting at offset (a bucket or a
 * chain's hash_next), or NULL: free() unlinks through it without a second walk. */
SUBALLOC_HOT suballoc_block **suballoc_lookup_link(sgm_suballoc *sa, uint64_t offset) {
  suballoc_block **link = &sa->buckets[suballoc_hash(sa, offset)];
  while (*link && (*link)->offset != offset) link = &(*link)->u.hash_next;
  return *link ? link : NULL;
}

/* ------------------------------------------------------------------------ */
/* Node pool: slabs from malloc, recycled through a free list, so the hot path
 * only mallocs when every node is in use. */

static bool suballoc_pool_refill(sgm_suballoc *sa) {
  /* Cache-line aligned so that touching a node costs one line, not two. */
  suballoc_slab *s =
      suballoc_inject_fail(sa) ? NULL : aligned_alloc(64, (size_t)sgm__align_up(sizeof *s, 64));
  if (!s) {
    sgm__error_set(SGM_ERR_NOMEM, "sub-allocator: out of host memory for block metadata");
    return false;
  }
  s->next = sa->slabs;
  sa->slabs = s;
  sa->n_nodes += SUBALLOC_SLAB_NODES;
  for (int i = SUBALLOC_SLAB_NODES - 1; i >= 0; i--) {
    suballoc_block *b = &s->nodes[i];
    uint64_t x = sa->rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    sa->rng = x;
    b->priority = (uint32_t)(x >> 32);
    b->state = SUBALLOC_POOLED;
    b->u.hash_next = sa->pool;
    sa->pool = b;
  }
  return true;
}

/* A node from the pool; the caller made sure the pool is not empty. */
static inline suballoc_block *suballoc_node_take(sgm_suballoc *sa) {
  suballoc_block *b = sa->pool;
  sgm_assert_internal(b != NULL && b->state == SUBALLOC_POOLED);
  sa->pool = b->u.hash_next;
  return b;
}

static inline void suballoc_node_give(sgm_suballoc *sa, suballoc_block *b) {
  b->state = SUBALLOC_POOLED;
  b->u.hash_next = sa->pool;
  sa->pool = b;
}

/* ------------------------------------------------------------------------ */
/* Ranges: a sorted array, searched by bisection. */

/* Index of the first range whose offset is >= offset (n_ranges if none). */
static size_t suballoc_range_lower(const sgm_suballoc *sa, uint64_t offset) {
  size_t lo = 0, hi = sa->n_ranges;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (sa->ranges[mid]->offset < offset)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static suballoc_range *suballoc_range_find(const sgm_suballoc *sa, uint64_t offset) {
  size_t i = suballoc_range_lower(sa, offset);
  return i < sa->n_ranges && sa->ranges[i]->offset == offset ? sa->ranges[i] : NULL;
}

/* ------------------------------------------------------------------------ */
/* The interface. */

static int suballoc_create(uint64_t align_bytes, bool indexed, sgm_suballoc **out) {
  sgm_assert(out != NULL);
  *out = NULL;
  if (!sgm__is_pow2(align_bytes))
    return sgm__error_set(SGM_ERR_INVALID,
                          "sub-allocator: alignment %llu is not a power of two",
                          (unsigned long long)align_bytes);
  sgm_suballoc *sa = calloc(1, sizeof *sa);
  if (!sa) goto out_nomem;
  sa->indexed = indexed;
  sa->align_bytes = align_bytes;
  sa->align_shift = (unsigned)__builtin_ctzll(align_bytes);
  sa->max_request = UINT64_MAX - (align_bytes - 1);
  sa->bucket_bits = SUBALLOC_MIN_BUCKET_BITS;
  sa->bucket_shift = 64 - SUBALLOC_MIN_BUCKET_BITS;
  sa->grow_at = (uint64_t)1 << SUBALLOC_MIN_BUCKET_BITS;
  sa->buckets = calloc((size_t)1 << sa->bucket_bits, sizeof *sa->buckets);
  if (!sa->buckets) goto out_free_sa;
  sa->rng = SUBALLOC_RNG_SEED;
  sa->fail_countdown = -1;
  *out = sa;
  return SGM_OK;

out_free_sa:
  free(sa);
out_nomem:
  return sgm__error_set(SGM_ERR_NOMEM, "sub-allocator: out of host memory creating it");
}

int sgm__suballoc_create(uint64_t align_bytes, sgm_suballoc **out) {
  return suballoc_create(align_bytes, true, out);
}

int sgm__suballoc_create_unindexed(uint64_t align_bytes, sgm_suballoc **out) {
  return suballoc_create(align_bytes, false, out);
}

void sgm__suballoc_destroy(sgm_suballoc *sa) {
  if (!sa) return;
  for (size_t i = 0; i < sa->n_ranges; i++) free(sa->ranges[i]);
  free(sa->ranges);
  for (suballoc_slab *s = sa->slabs, *nx; s; s = nx) {
    nx = s->next;
    free(s);
  }
  free(sa->buckets);
  free(sa);
}

int sgm__suballoc_add_range(sgm_suballoc *sa, uint64_t offset, uint64_t size) {
  sgm_assert(sa != NULL);
  uint64_t a = sa->align_bytes;
  if (size == 0 || offset % a || size % a || offset > UINT64_MAX - size)
    return sgm__error_set(SGM_ERR_INVALID,
                          "sub-allocator: bad range [%llu, +%llu): it must be non-empty, "
                          "aligned to %llu and not wrap around",
                          (unsigned long long)offset, (unsigned long long)size,
                          (unsigned long long)a);
  size_t i = suballoc_range_lower(sa, offset);
  const suballoc_range *below = i > 0 ? sa->ranges[i - 1] : NULL;
  const suballoc_range *above = i < sa->n_ranges ? sa->ranges[i] : NULL;
  if ((below && below->offset + below->size > offset) || (above && above->offset < offset + size))
    return sgm__error_set(SGM_ERR_INVALID,
                          "sub-allocator: range [%llu, +%llu) overlaps the range at %llu",
                          (unsigned long long)offset, (unsigned long long)size,
                          (unsigned long long)(below && below->offset + below->size > offset
                                                   ? below->offset
                                                   : above->offset));
  /* Take every resource first so that a failure leaves nothing changed. */
  if (sa->n_ranges == sa->cap_ranges) {
    size_t cap = sa->cap_ranges ? sa->cap_ranges * 2 : 8;
    suballoc_range **nr = suballoc_inject_fail(sa) ? NULL : realloc(sa->ranges, cap * sizeof *nr);
    if (!nr) goto out_nomem;
    sa->ranges = nr;
    sa->cap_ranges = cap;
  }
  if (!sa->pool && !suballoc_pool_refill(sa)) goto out_nomem;
  suballoc_range *r = suballoc_inject_fail(sa) ? NULL : malloc(sizeof *r);
  if (!r) goto out_nomem;

  suballoc_block *b = suballoc_node_take(sa);
  b->offset = offset;
  b->size = size;
  b->prev = b->next = NULL;
  b->range = r;
  r->offset = offset;
  r->size = size;
  r->first = b;
  memmove(&sa->ranges[i + 1], &sa->ranges[i], (sa->n_ranges - i) * sizeof *sa->ranges);
  sa->ranges[i] = r;
  sa->n_ranges++;
  sa->capacity_bytes += size;
  suballoc_bin_insert(sa, b);
  return SGM_OK;

out_nomem:
  return sgm__error_set(SGM_ERR_NOMEM, "sub-allocator: out of host memory adding a range");
}

bool sgm__suballoc_range_is_free(const sgm_suballoc *sa, uint64_t offset) {
  sgm_assert(sa != NULL);
  const suballoc_range *r = suballoc_range_find(sa, offset);
  return r && suballoc_range_empty(r);
}

bool sgm__suballoc_try_remove_range(sgm_suballoc *sa, uint64_t offset) {
  sgm_assert(sa != NULL);
  size_t i = suballoc_range_lower(sa, offset);
  if (i == sa->n_ranges || sa->ranges[i]->offset != offset) {
    sgm__error_set(SGM_ERR_INVALID, "sub-allocator: no range starts at %llu",
                   (unsigned long long)offset);
    return false;
  }
  suballoc_range *r = sa->ranges[i];
  if (!suballoc_range_empty(r)) {
    sgm__error_set(SGM_ERR_BUSY, "sub-allocator: the range at %llu still holds live blocks",
                   (unsigned long long)offset);
    return false;
  }
  /* No live block and free neighbours coalesce: the range is one free block. */
  suballoc_block *b = r->first;
  sgm_assert_internal(b->state == SUBALLOC_FREE && b->size == r->size && !b->next);
  suballoc_bin_remove(sa, b);
  suballoc_node_give(sa, b);
  memmove(&sa->ranges[i], &sa->ranges[i + 1], (sa->n_ranges - i - 1) * sizeof *sa->ranges);
  sa->n_ranges--;
  sa->capacity_bytes -= r->size;
  free(r);
  return true;
}

bool sgm__suballoc_try_alloc_node(sgm_suballoc *sa, uint64_t size, uint64_t *offset_out,
                                  uint64_t *size_out, suballoc_block **node_out) {
  sgm_assert(sa != NULL && offset_out != NULL && size_out != NULL && node_out != NULL);
  *offset_out = 0;
  *size_out = 0;
  *node_out = NULL;
  /* Size 0 gets one granule, like malloc(0): a unique offset that free() takes. */
  if (size == 0) size = 1;
  if (sgm_unlikely(size > sa->max_request)) return false;
  uint64_t want = sgm__align_up(size, sa->align_bytes);
  unsigned bin;
  suballoc_block **link = suballoc_find(sa, want, &bin);
  if (!link) return false;
  suballoc_block *f = *link;
  sgm_assert_internal(f->state == SUBALLOC_FREE && f->size >= want);

  suballoc_block *live;
  if (f->size == want) {
    suballoc_bin_unlink(sa, bin, link);
    live = f;
  } else {
    /* A split needs a node: take it before changing anything. */
    if (sgm_unlikely(!sa->pool) && !suballoc_pool_refill(sa)) return false;
    suballoc_block *n = suballoc_node_take(sa);
    const suballoc_range *r = f->range;
    uint64_t gap_low = f->offset - r->offset;
    uint64_t gap_high = r->offset + r->size - (f->offset + f->size);
    suballoc_bin_unlink(sa, bin, link);
    n->range = f->range;
    n->prev = f;
    n->next = f->next;
    if (f->next) f->next->prev = n;
    f->next = n;
    /* Cut from the end nearer an end of the range (placement policy, see the
     * top of the file); the lower part keeps f, so range->first never moves. */
    bool low = gap_low <= gap_high;
    if (sa->end_hook) {
      int pref = sa->end_hook(sa->end_arg, f->offset, f->offset + f->size - want, want);
      if (pref) low = pref < 0;
    }
    if (low) {
      n->offset = f->offset + want;
      n->size = f->size - want;
      f->size = want;
      suballoc_bin_insert(sa, n);
      live = f;
    } else {
      n->offset = f->offset + f->size - want;
      n->size = want;
      f->size -= want;
      suballoc_bin_insert(sa, f);
      live = n;
    }
  }
  if (sa->indexed) {
    suballoc_hash_insert(sa, live);
  } else {
    live->state = SUBALLOC_LIVE;
    live->u.hash_next = NULL;
  }
  sa->n_live++;
  sa->used_bytes += want;
  if (sgm_unlikely(sa->indexed && sa->n_live > sa->grow_at)) suballoc_hash_grow(sa);
  sgm_assert_internal(live->offset % sa->align_bytes == 0 && live->size == want);
  sgm_assert_internal(!live->prev || live->prev->offset + live->prev->size == live->offset);
  sgm_assert_internal(!live->next || live->offset + live->size == live->next->offset);
  *offset_out = live->offset;
  *size_out = want;
  *node_out = live;
  return true;
}

bool sgm__suballoc_try_alloc(sgm_suballoc *sa, uint64_t size, uint64_t *offset_out,
                             uint64_t *size_out) {
  suballoc_block *node;
  return sgm__suballoc_try_alloc_node(sa, size, offset_out, size_out, &node);
}

/* Free live block b, already out of the hash (or never in it): coalesce with
 * free neighbours and bin the result. */
SUBALLOC_HOT uint64_t suballoc_release(sgm_suballoc *sa, suballoc_block *b) {
  sgm_assert_internal(b->state == SUBALLOC_LIVE);
  uint64_t size = b->size;
  sa->n_live--;
  sa->used_bytes -= size;

  suballoc_block *nx = b->next;
  if (nx && nx->state == SUBALLOC_FREE) {
    sgm_assert_internal(b->offset + b->size == nx->offset);
    suballoc_bin_remove(sa, nx);
    b->size += nx->size;
    b->next = nx->next;
    if (nx->next) nx->next->prev = b;
    suballoc_node_give(sa, nx);
  }
  suballoc_block *pv = b->prev;
  if (pv && pv->state == SUBALLOC_FREE) {
    sgm_assert_internal(pv->offset + pv->size == b->offset);
    /* Merge into the lower node, which keeps range->first stable. */
    suballoc_bin_remove(sa, pv);
    pv->size += b->size;
    pv->next = b->next;
    if (b->next) b->next->prev = pv;
    suballoc_node_give(sa, b);
    b = pv;
  }
  suballoc_bin_insert(sa, b);
  return size;
}

int sgm__suballoc_free(sgm_suballoc *sa, uint64_t offset, uint64_t *size_out) {
  sgm_assert(sa != NULL && size_out != NULL);
  *size_out = 0;
  if (sgm_unlikely(!sa->indexed))
    return sgm__error_set(SGM_ERR_INVALID, "sub-allocator: offset %llu freed by offset in an "
                          "allocator without an offset index (free it by its node)",
                          (unsigned long long)offset);
  suballoc_block **link = suballoc_lookup_link(sa, offset);
  if (sgm_unlikely(!link))
    return sgm__error_set(SGM_ERR_INVALID,
                          "sub-allocator: no live block starts at offset %llu "
                          "(double free, or not an offset this allocator handed out)",
                          (unsigned long long)offset);
  suballoc_block *b = *link;
  *link = b->u.hash_next;
  *size_out = suballoc_release(sa, b);
  return SGM_OK;
}

void sgm__suballoc_prefetch_neighbours(const suballoc_block *node) {
  if (node->prev) __builtin_prefetch(node->prev, 1);
  if (node->next) __builtin_prefetch(node->next, 1);
}

int sgm__suballoc_free_node(sgm_suballoc *sa, suballoc_block *node, uint64_t *size_out) {
  sgm_assert(sa != NULL && node != NULL && size_out != NULL);
  *size_out = 0;
  if (sgm_unlikely(node->state != SUBALLOC_LIVE))
    return sgm__error_set(SGM_ERR_INVALID, "sub-allocator: the block at offset %llu is not live "
                          "(freed twice, or a node this allocator did not hand out)",
                          (unsigned long long)node->offset);
  if (sa->indexed) {
    suballoc_block **link = suballoc_lookup_link(sa, node->offset);
    sgm_assert_internal(link && *link == node);
    *link = node->u.hash_next;
  }
  *size_out = suballoc_release(sa, node);
  return SGM_OK;
}

bool sgm__suballoc_node_is(const suballoc_block *node, uint64_t offset, uint64_t size) {
  return node && node->state == SUBALLOC_LIVE && node->offset == offset && node->size == size;
}

void sgm__suballoc_set_end_hook(sgm_suballoc *sa, int (*hook)(void *, uint64_t, uint64_t, uint64_t),
                                void *arg) {
  sa->end_hook = hook;
  sa->end_arg = arg;
}

void sgm__suballoc_inject_nomem(sgm_suballoc *sa, int64_t n) {
  sgm_assert(sa != NULL);
  sa->fail_countdown = n < 0 ? -1 : n;
}

uint64_t sgm__suballoc_block_size(const sgm_suballoc *sa, uint64_t offset) {
  sgm_assert(sa != NULL);
  const suballoc_block *b = sa->indexed ? suballoc_lookup(sa, offset) : NULL;
  return b ? b->size : 0;
}

void sgm__suballoc_stats(const sgm_suballoc *sa, sgm_suballoc_stats *out) {
  sgm_assert(sa != NULL && out != NULL);
  memset(out, 0, sizeof *out);
  out->capacity_bytes = sa->capacity_bytes;
  out->used_bytes = sa->used_bytes;
  out->n_live = sa->n_live;
  out->n_free_blocks = sa->n_free_blocks;
  out->n_ranges = sa->n_ranges;
  unsigned sw = SUBALLOC_N_SUMMARY;
  while (sw > 0 && !sa->bin_summary[sw - 1]) sw--;
  if (sw > 0) {
    unsigned w = ((sw - 1) << 6) + 63u - (unsigned)__builtin_clzll(sa->bin_summary[sw - 1]);
    unsigned bin = (w << 6) + 63u - (unsigned)__builtin_clzll(sa->bin_bits[w]);
    const suballoc_block *t = sa->bins[bin];
    while (!suballoc_bin_is_list(bin) && t->u.tree.right) t = t->u.tree.right;
    out->largest_free_bytes = t->size;
  }
}

/* ------------------------------------------------------------------------ */
/* sgm__suballoc_check: every invariant, O(n). The range walk counts the free
 * blocks; the bin walk checks that every binned node is a distinct free block
 * linked into a range (its neighbours point back at it); equal counts then
 * make the two sets the same. */

typedef struct suballoc_walk {
  uint64_t n_nodes;           /* binned nodes visited so far, all bins */
  const suballoc_block *last; /* previous node in order within the bin */
} suballoc_walk;

/* One binned node: free, in the right bin, linked into its range. */
static bool suballoc_check_binned(const sgm_suballoc *sa, unsigned bin, const suballoc_block *t) {
  if (t->state != SUBALLOC_FREE)
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bin %u holds a non-free block at %llu",
                           bin, (unsigned long long)t->offset);
  if (suballoc_bin(sa, t->size) != bin || t->bin != bin)
    return !sgm__error_set(SGM_ERR_CORRUPT,
                           "sub-allocator: free block at %llu of %llu bytes is in bin %u, not %u",
                           (unsigned long long)t->offset, (unsigned long long)t->size, bin,
                           suballoc_bin(sa, t->size));
  bool linked = (t->prev ? t->prev->next == t : t->range && t->range->first == t) &&
                (!t->next || t->next->prev == t);
  if (!linked)
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: free block at %llu in bin %u is not "
                           "linked into a range", (unsigned long long)t->offset, bin);
  return true;
}

static bool suballoc_check_treap(const sgm_suballoc *sa, unsigned bin, const suballoc_block *t,
                                 unsigned depth, suballoc_walk *w) {
  if (!t) return true;
  if (depth > SUBALLOC_MAX_DEPTH || w->n_nodes >= sa->n_free_blocks)
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bin %u: treap too deep, cyclic or "
                           "holding more than the %llu free blocks", bin,
                           (unsigned long long)sa->n_free_blocks);
  const suballoc_block *kids[2] = {t->u.tree.left, t->u.tree.right};
  for (int i = 0; i < 2; i++)
    if (kids[i] && kids[i]->priority > t->priority)
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bin %u: heap order broken at %llu",
                             bin, (unsigned long long)t->offset);
  if (!suballoc_check_treap(sa, bin, t->u.tree.left, depth + 1, w)) return false;
  w->n_nodes++;
  if (!suballoc_check_binned(sa, bin, t)) return false;
  /* Strictly increasing keys: sorted, and no node twice. */
  if (w->last && !suballoc_less(w->last, t))
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bin %u: treap out of order at %llu",
                           bin, (unsigned long long)t->offset);
  w->last = t;
  return suballoc_check_treap(sa, bin, t->u.tree.right, depth + 1, w);
}

static bool suballoc_check_list(const sgm_suballoc *sa, unsigned bin, suballoc_walk *w) {
  const suballoc_block *prev = NULL;
  for (const suballoc_block *t = sa->bins[bin]; t; prev = t, t = t->u.tree.right) {
    /* Backward links and the count bound rule out cycles and repeats. */
    if (w->n_nodes++ >= sa->n_free_blocks || t->u.tree.left != prev)
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bin %u: list broken or cyclic at "
                             "%llu", bin, (unsigned long long)t->offset);
    if (!suballoc_check_binned(sa, bin, t)) return false;
  }
  return true;
}

static bool suballoc_check_range(const sgm_suballoc *sa, const suballoc_range *r,
                                 uint64_t *n_live, uint64_t *n_free, uint64_t *used,
                                 uint64_t *free_bytes) {
  uint64_t a = sa->align_bytes, end = r->offset + r->size, pos = r->offset, live_here = 0;
  uint64_t max_blocks = sa->n_live + sa->n_free_blocks;
  const suballoc_block *prev = NULL;
  uint64_t n = 0;
  for (const suballoc_block *b = r->first; b; prev = b, b = b->next) {
    if (++n > max_blocks)
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: range %llu: block list too long or "
                             "cyclic", (unsigned long long)r->offset);
    if (b->prev != prev || b->range != r)
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: range %llu: bad links at block %llu",
                             (unsigned long long)r->offset, (unsigned long long)b->offset);
    if (b->offset != pos || b->size == 0 || b->size > end - pos)
      return !sgm__error_set(SGM_ERR_CORRUPT,
                             "sub-allocator: range [%llu, %llu): block [%llu, +%llu) does not "
                             "follow at %llu inside the range",
                             (unsigned long long)r->offset, (unsigned long long)end,
                             (unsigned long long)b->offset, (unsigned long long)b->size,
                             (unsigned long long)pos);
    if (b->offset % a || b->size % a)
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: block [%llu, +%llu) not aligned to "
                             "%llu", (unsigned long long)b->offset, (unsigned long long)b->size,
                             (unsigned long long)a);
    if (b->state == SUBALLOC_FREE) {
      if (prev && prev->state == SUBALLOC_FREE)
        return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: free blocks at %llu and %llu are "
                               "neighbours, not coalesced", (unsigned long long)prev->offset,
                               (unsigned long long)b->offset);
      (*n_free)++;
      *free_bytes += b->size;
    } else if (b->state == SUBALLOC_LIVE) {
      if (sa->indexed && suballoc_lookup(sa, b->offset) != b)
        return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: live block at %llu is not in the "
                               "hash table", (unsigned long long)b->offset);
      (*n_live)++;
      live_here++;
      *used += b->size;
    } else {
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: block at %llu has bad state %#x",
                             (unsigned long long)b->offset, (unsigned)b->state);
    }
    pos += b->size;
  }
  if (pos != end)
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: range [%llu, %llu): blocks stop at %llu",
                           (unsigned long long)r->offset, (unsigned long long)end,
                           (unsigned long long)pos);
  if ((live_here == 0) != suballoc_range_empty(r))
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: range %llu holds %llu live blocks but "
                           "is%s one free block", (unsigned long long)r->offset,
                           (unsigned long long)live_here, suballoc_range_empty(r) ? "" : " not");
  return true;
}

bool sgm__suballoc_check(const sgm_suballoc *sa) {
  sgm_assert(sa != NULL);
  if (!sgm__is_pow2(sa->align_bytes) || sa->align_bytes != UINT64_C(1) << sa->align_shift)
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bad alignment %llu",
                           (unsigned long long)sa->align_bytes);
  /* Ranges: sorted, disjoint, aligned; their blocks tile them. */
  uint64_t n_live = 0, n_free = 0, used = 0, free_bytes = 0, capacity = 0;
  for (size_t i = 0; i < sa->n_ranges; i++) {
    const suballoc_range *r = sa->ranges[i];
    if (r->size == 0 || r->offset % sa->align_bytes || r->size % sa->align_bytes ||
        r->offset > UINT64_MAX - r->size)
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bad range [%llu, +%llu)",
                             (unsigned long long)r->offset, (unsigned long long)r->size);
    if (i > 0 && sa->ranges[i - 1]->offset + sa->ranges[i - 1]->size > r->offset)
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: ranges at %llu and %llu overlap or "
                             "are out of order", (unsigned long long)sa->ranges[i - 1]->offset,
                             (unsigned long long)r->offset);
    capacity += r->size;
    if (!suballoc_check_range(sa, r, &n_live, &n_free, &used, &free_bytes)) return false;
  }
  if (capacity != sa->capacity_bytes || used != sa->used_bytes || n_live != sa->n_live ||
      n_free != sa->n_free_blocks || used + free_bytes != capacity)
    return !sgm__error_set(SGM_ERR_CORRUPT,
                           "sub-allocator: totals disagree: capacity %llu/%llu, used %llu/%llu, "
                           "free %llu, live %llu/%llu, free blocks %llu/%llu (walked/counted)",
                           (unsigned long long)capacity, (unsigned long long)sa->capacity_bytes,
                           (unsigned long long)used, (unsigned long long)sa->used_bytes,
                           (unsigned long long)free_bytes, (unsigned long long)n_live,
                           (unsigned long long)sa->n_live, (unsigned long long)n_free,
                           (unsigned long long)sa->n_free_blocks);
  /* Bins: bitmap matches the roots; lists and treaps well formed, binned
   * right, and together exactly the free blocks found above. */
  suballoc_walk w = {0, NULL};
  for (unsigned bin = 0; bin < SUBALLOC_N_BINS; bin++) {
    bool bit = (sa->bin_bits[bin >> 6] >> (bin & 63)) & 1;
    if (bit != (sa->bins[bin] != NULL))
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bitmap bit of bin %u is %d but the "
                             "bin is %s", bin, (int)bit, sa->bins[bin] ? "non-empty" : "empty");
    w.last = NULL;
    bool ok = suballoc_bin_is_list(bin) ? suballoc_check_list(sa, bin, &w)
                                        : suballoc_check_treap(sa, bin, sa->bins[bin], 0, &w);
    if (!ok) return false;
  }
  for (unsigned i = 0; i < SUBALLOC_N_WORDS; i++)
    if (((sa->bin_summary[i >> 6] >> (i & 63)) & 1) != (sa->bin_bits[i] != 0))
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bitmap summary bit %u is wrong", i);
  if (SUBALLOC_N_WORDS % 64 && sa->bin_summary[SUBALLOC_N_SUMMARY - 1] >> (SUBALLOC_N_WORDS % 64))
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bitmap summary has stray bits");
  if (w.n_nodes != sa->n_free_blocks)
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: bins hold %llu blocks, %llu are free",
                           (unsigned long long)w.n_nodes, (unsigned long long)sa->n_free_blocks);
  /* Hash: exactly the live blocks, each in its own bucket. */
  uint64_t in_hash = 0;
  size_t n_buckets = (size_t)1 << sa->bucket_bits;
  for (size_t h = 0; h < n_buckets; h++) {
    for (const suballoc_block *b = sa->buckets[h]; b; b = b->u.hash_next) {
      if (++in_hash > sa->n_live || b->state != SUBALLOC_LIVE || suballoc_hash(sa, b->offset) != h)
        return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: hash bucket %zu holds a wrong or "
                               "extra entry", h);
    }
  }
  /* Unindexed: the hash stays empty (the range walk counted the live blocks). */
  if (in_hash != (sa->indexed ? sa->n_live : 0))
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: hash holds %llu blocks, %llu are live",
                           (unsigned long long)in_hash, (unsigned long long)sa->n_live);
  /* Pool: every node is a block or pooled (a leak would show here). */
  uint64_t pooled = 0;
  for (const suballoc_block *b = sa->pool; b; b = b->u.hash_next) {
    if (++pooled > sa->n_nodes || b->state != SUBALLOC_POOLED)
      return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: node pool is corrupt");
  }
  if (pooled + sa->n_live + sa->n_free_blocks != sa->n_nodes)
    return !sgm__error_set(SGM_ERR_CORRUPT, "sub-allocator: %llu nodes, but %llu pooled + %llu "
                           "blocks", (unsigned long long)sa->n_nodes, (unsigned long long)pooled,
                           (unsigned long long)(sa->n_live + sa->n_free_blocks));
  return true;
}
