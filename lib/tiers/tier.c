/*
 * tier.c — the chunk pool every tier is built on, and its stream-ordered
 * caches (see tier.h for the model).
 *
 * Every block carved from the sub-allocator has a tier_block record in the
 * pool's live map: LIVE while the user (or sgm) holds it, CACHED while it sits
 * in a magazine, a stream's bag or the deferred list. A cached block belongs
 * to one stream (its key): work queued on that stream may still use it.
 *
 *   user free on S --> thread magazine [class][slot]   (no shared lock)
 *                          | full: half moves down
 *                          v
 *                      bag of S: open --seal--> sealed (+ fence event on S)
 *                          |                    |   | fence seen complete
 *   transfer to T <--------+ (record on S =     |   v
 *   (T's open bag,            seal; wait on T)  | sub-allocator (anyone)
 *    what T asked for) <------------------------+ (wait on T)
 *
 * Invariants (checked by sgm__tier_check):
 *  - committed_bytes <= budget_bytes (unless the budget was lowered below what
 *    was committed, see sgm__tier_set_budget), committed_bytes >= the sum of the
 *    live chunks' sizes (it also counts chunks being taken right now);
 *  - every chunk is one range of the sub-allocator, at its device address;
 *  - held_bytes and n_blocks equal the sub-allocator's used bytes and blocks,
 *    and the live map holds n_blocks records;
 *  - a stream's sealed bag is non-empty only while it has a fence (or one is
 *    being recorded): blocks reach the sub-allocator only through a fence seen
 *    complete, a host wait, or a synchronous backend;
 *  - a fence or deferred event has one owner at a time (the busy flag), so it
 *    is queried, recycled or destroyed by one thread only.
 *
 * Threading: see tier.h for the locks and their order. The user's alloc and
 * free on a warm magazine take only the magazine's spin lock (its own
 * thread's, so uncontended) and, on free, a lock-free lookup in the live map
 * and one compare-and-swap on the block's own record;
 * counters go to the magazine and reach the pool in batches (at once when one
 * thread uses the pool, so single-threaded stats are exact).
 */
#include "tiers/tier.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Dedicated chunks are rounded to 64 KiB, the smallest page the GPU maps. */
#define TIER_DEDICATED_GRANULE (UINT64_C(64) << 10)
/* A caller that keeps losing the chunk it just grew to other threads gives up
 * after this many rounds rather than spin forever. */
#define TIER_MAX_GROW_ROUNDS 16

/* Size classes: 256, 512, 768, 1024, then four per power of two up to 1 MiB
 * (at most 25% rounding). 1 MiB is where PyTorch's allocator stops treating
 * blocks as small; larger blocks are cached at their exact size. */
#define TIER_CLASS_MAX_BYTES (UINT64_C(1) << 20)
#define TIER_N_CLASSES 44
_Static_assert(TIER_N_CLASSES <= 64, "a stream's recent classes are one 64-bit mask");
/* Magazine slots per class, and the bytes one class may hold per thread
 * (so big classes get fewer slots: at most 4 MiB cached per class per thread). */
#define TIER_MAG_SLOTS 16
#define TIER_MAG_CLASS_BYTES (UINT64_C(4) << 20)
/* A magazine's counters reach the pool when this many bytes are pending,
 * which bounds the error of used_bytes while several threads run. */
#define TIER_MAG_FLUSH_BYTES (UINT64_C(1) << 20)
/* Magazines per thread (pools a thread uses at once: two tiers of a context or two). */
#define TIER_TLS_SLOTS 4
/* Live-map shards: 64 keeps two threads' frees on different locks nearly always. */
#define TIER_SHARDS 64
#define TIER_SHARD_BUCKETS_MIN 64
/* A large cached block is reused for a request when it is at most this much
 * bigger (1/8: the same slack a size class allows at most). */
#define TIER_LARGE_SLACK_SHIFT 3

/* Expandable growth: free mapped granules are unmapped at once when they pass
 * this many granules and 1/32 of what is committed (3.1 %): a block freed and
 * allocated again around a granule boundary does not map and unmap each time.
 * Measured on the idealloc traces (sgm-alloc-replay, docs/benchmarks.md):
 * 1/64 commits at most 1.057 x the peak live bytes, 1/32 the same, 1/16 and
 * 1/8 up to 1.110; mapping calls fall as the slack grows. */
#define TIER_VMM_SLACK_GRANULES 4u
/* Budgets below this many granules (64 MiB with 2 MiB granules) grow in
 * chunks: a block is rounded to whole granules in committed bytes, which on a
 * small budget is a large share (an 8 MiB budget holding two 1 MiB blocks and
 * a 6 MiB one would need 10 MiB of granules). */
#define TIER_VMM_MIN_GRANULES 32u
#define TIER_VMM_SLACK_SHIFT 5

/* A block record's tag: its address (a multiple of SGM_DEVICE_ALIGN) and
 * these flags in the low bits. TIER_OWN: taken by sgm__tier_alloc for sgm
 * itself, so user frees refuse it. TIER_BUSY: sgm_record_stream is changing
 * the record's stream list; a free waits for it. */
enum { TIER_LIVE = 1, TIER_CACHED = 2, TIER_OWN = 4, TIER_BUSY = 8 };
#define TIER_TAG_STATE UINT64_C(3)
#define TIER_TAG_FLAGS (SGM_DEVICE_ALIGN - UINT64_C(1))

/* Expandable growth: one granule of the reserved range. */
typedef struct tier_granule {
  uint32_t refs;               /* blocks of the sub-allocator (live or cached) touching it */
  uint8_t mapped;              /* memory is mapped behind it */
  uint8_t busy;                /* a thread maps or unmaps it now, without the pool lock */
  uint32_t phys;               /* reserve mode's pool: the pool granule mapped here (mapped or busy) */
  uint64_t free_seen_ms;       /* idle trim: when first seen mapped and untouched; UINT64_MAX = not */
} tier_granule;

/* One block of the sub-allocator, known to the live map. */
typedef struct tier_block {
  sgm_devptr ptr;              /* its address (the sub-allocator offset) */
  uint64_t bytes;              /* its size in the sub-allocator */
  uint64_t asked;              /* the size handed out, rounded to SGM_DEVICE_ALIGN (counted in used) */
  uint64_t key;                /* the stream it belongs to (allocated or freed on) */
  void *handle;                /* that stream's handle, to record events on it */
  uint64_t tag;                /* ptr | TIER_LIVE or TIER_CACHED | TIER_OWN | TIER_BUSY, 0 while
                                  spare (atomic: the live map's lock-free readers validate by it) */
  int cls;                     /* its size class, -1 when its size is no class's */
  sgm_stream_ref *rec;         /* streams named by sgm_record_stream (malloc'd), NULL if none */
  size_t n_rec;                /* entries in rec */
  struct tier_block *hnext;    /* chain in the live map (atomic: read without a lock) */
  struct tier_block *next;     /* in a cache list, or the pool's spare records */
} __attribute__((aligned(64))) tier_block;

/* Records start on their own cache line: the compare-and-swap of a free must
 * not pull in a line holding another thread's record. */
static tier_block *tier_block_new(void) {
  tier_block *b = aligned_alloc(64, sizeof(tier_block));
  if (b) memset(b, 0, sizeof *b);
  return b;
}

/* A bucket array of the live map; replaced arrays are kept until the pool
 * goes, since a reader may still be walking one. */
typedef struct tier_table {
  size_t mask;                 /* buckets - 1 (a power of two, minus one) */
  struct tier_table *retired;  /* the array this one replaced */
  tier_block *b[];             /* chains by address hash (atomic) */
} tier_table;

/* A shard of the live map, alone on its cache line. Written only under the
 * pool lock, read without any lock: frees look their block up without
 * writing a line another thread reads (issue 10: two threads freeing through
 * shard spin locks ran at 0.68x the pairs per second of one). */
typedef struct tier_shard {
  unsigned seq;                /* odd while a record is unlinked or the table rebuilt (atomic) */
  tier_table *table;           /* NULL until the first insert (atomic) */
  size_t n;                    /* records in the shard (atomic: read by the check) */
  uint64_t n_writes;           /* inserts, unlinks and rebuilds so far (atomic: read by tests) */
} __attribute__((aligned(64))) tier_shard;

/* Cached blocks of one stream, by class. */
typedef struct tier_bag {
  tier_block *cls[TIER_N_CLASSES]; /* LIFO lists of blocks of each class */
  tier_block *large;           /* blocks of no class */
  uint64_t bytes;              /* their sizes, summed */
  size_t n;                    /* blocks in the bag */
} tier_bag;

/* Large sizes a stream remembers having taken from its caches, and the
 * record of one (recent sizes, issue 10). */
#define TIER_RECENT_LARGE 4
typedef struct tier_recent_large {
  uint64_t need;               /* bytes asked, aligned; 0: empty */
  uint64_t period;             /* the stream's period when last taken */
} tier_recent_large;

/* One stream's bags (kept until the pool goes: a handful per program). */
typedef struct tier_stream {
  sgm_stream_ref ref;          /* the stream (key, handle of its last free) */
  tier_bag open;               /* freed since the last fence was recorded */
  tier_bag sealed;             /* freed before `fence` was recorded */
  void *fence;                 /* pooled event covering sealed, NULL when none */
  bool busy;                   /* a thread records or queries fence without the lock */
  struct tier_stream *next;    /* the pool's list */
  /* (xfer, issue 10) */
  void *crossed_fence;         /* the fence a transfer to crossed_to recorded or waited on */
  uint64_t crossed_to;         /* that taker's key: its next transfer under it takes all */
  /* (recent sizes, issue 10) */
  uint64_t recent_cls[2];      /* bit c: class c taken from this stream's bags, this period / the last */
  tier_recent_large recent_large[TIER_RECENT_LARGE]; /* large sizes taken so, with their periods */
  uint64_t period;             /* transfers this stream has taken from others (ages the above) */
} tier_stream;

/* A free that waits for streams named by sgm_record_stream. */
typedef struct tier_deferred {
  tier_block *b;               /* the block (CACHED, key = the stream it was freed on) */
  void **events;               /* one per recorded stream, recorded at the free */
  size_t n_events;             /* entries in events */
  bool busy;                   /* a thread queries them without the lock */
  struct tier_deferred *next;  /* the pool's list */
} tier_deferred;

/* One thread's cache for one pool. */
typedef struct tier_mag {
  int lock;                    /* spin lock: the owner thread, or a reclaimer under the pool lock */
  sgm_tier_pool *pool;         /* NULL once the pool is destroyed (registry lock) */
  uint64_t pool_id;            /* the pool's id, for the thread's lookup */
  struct tier_mag *prev, *next; /* the pool's list (registry and pool lock) */
  uint64_t cached_bytes;       /* bytes in the slots (atomic: read by stats) */
  int64_t d_used;              /* used bytes not yet added to the pool (atomic) */
  int64_t d_live;              /* live blocks not yet added to the pool (atomic) */
  uint64_t n_allocs;           /* allocations served by this thread, not yet added (atomic) */
  uint64_t n_frees;            /* frees by this thread, not yet added (atomic) */
  uint8_t n[TIER_N_CLASSES];   /* slots used per class */
  tier_block *slot[TIER_N_CLASSES][TIER_MAG_SLOTS]; /* cached blocks, newest last */
} tier_mag;

struct sgm_tier_pool {
  sgm_tier_head head;         /* first: what tier.h's inline checks read (room_bytes) */
  sgm_lock lock;              /* guards everything below but the params, atomics and shards */
  sgm_tier_params p;          /* set at create, read-only after (but the budget, under the lock) */
  uint64_t id;                /* unique for the process's life: magazines find their pool by it */
  sgm_suballoc *sa;           /* carves the chunks; offsets are device addresses */
  sgm_chunk *chunks;          /* live chunks, in the order they were taken */
  size_t n_chunks;            /* entries used in chunks */
  size_t cap_chunks;          /* entries allocated in chunks */
  unsigned n_geometric;       /* growth chunks taken so far: the next is initial << this */
  uint64_t committed_bytes;   /* chunk bytes taken or being taken from the backend */
  uint64_t held_bytes;        /* bytes of blocks in the sub-allocator (live and cached), plus
                                 external_bytes */
  uint64_t external_bytes;    /* bytes charged by sgm__tier_charge (managed blocks placed in
                                 this tier), also counted in committed_bytes and held_bytes */
  uint64_t n_blocks;          /* blocks in the sub-allocator */
  uint64_t used_bytes;        /* handed-out bytes, but what magazines still hold back (atomic) */
  int64_t n_live;             /* handed-out blocks, the same way (atomic) */
  uint64_t peak_used_bytes;   /* highest used_bytes seen (atomic) */
  uint64_t n_allocs;          /* blocks handed out, the same way (atomic) */
  uint64_t n_frees;           /* blocks freed, the same way (atomic) */
  uint64_t n_failed;          /* allocations this pool could not serve (atomic) */
  bool budget_lowered;        /* set_budget went below committed: committed may exceed it */
  unsigned n_growing;         /* chunks being taken from the backend right now */
  unsigned n_releasing;       /* chunks detached and being returned right now (still committed) */
  pthread_cond_t grown;       /* broadcast when a chunk taking finishes or a release ends */
  tier_stream *streams;       /* streams with bags */
  uint64_t bag_bytes;         /* bytes in bags and deferred frees */
  size_t n_bagged;            /* blocks in bags and deferred frees (atomic: read as a hint) */
  tier_deferred *deferred;    /* frees waiting for recorded streams */
  void **events;              /* pooled events, not recorded by anyone now */
  size_t n_events, cap_events; /* entries used / allocated */
  tier_mag *mags;             /* magazines of threads using the pool */
  size_t n_mags;              /* entries in mags (atomic: read on the hot path) */
  /* expandable growth (issue 17); vmm_range NULL = chunks */
  void *vmm_range;            /* the backend's reserved range */
  sgm_devptr vmm_base;        /* its first address (the sub-allocator's one range) */
  uint64_t vmm_bytes;         /* its bytes */
  unsigned vmm_shift;         /* log2 of the granule */
  sgm_devptr span_lo;         /* lowest address ever given to the sub-allocator (atomic; UINT64_MAX: none) */
  sgm_devptr span_hi;         /* past the highest one (atomic): sgm__tier_may_own's span, never shrinks */
  tier_granule *gran;         /* one per granule of the range */
  uint64_t vmm_free_mapped;   /* granules mapped, not busy, touched by no block (atomic read) */
  tier_block *spare;          /* records out of the map, reused by carves: a record once
                                 in the map is freed only with the pool (lock-free readers) */
  /* reserve mode on the virtual-memory API (issue 17); vmm_pool NULL = none */
  void *vmm_pool;             /* the backend's pool of the budget's granules, taken at create */
  uint32_t *pool_free;        /* pool granules mapped nowhere (a stack) */
  size_t n_pool;              /* granules in the pool */
  size_t n_pool_free;         /* entries used in pool_free */
  tier_shard shards[TIER_SHARDS]; /* the live map */
};

/* ---- small helpers ---- */

static inline void tier_spin_lock(int *l) {
  while (__atomic_exchange_n(l, 1, __ATOMIC_ACQUIRE)) {
    while (__atomic_load_n(l, __ATOMIC_RELAXED)) sched_yield();
  }
}

static inline void tier_spin_unlock(int *l) { __atomic_store_n(l, 0, __ATOMIC_RELEASE); }

static inline uint64_t tier_hash(sgm_devptr ptr) {
  uint64_t k = ptr >> 8;
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

static inline tier_shard *tier_shard_of(sgm_tier_pool *p, uint64_t h) {
  return &p->shards[h & (TIER_SHARDS - 1)];
}

/* Class of an aligned request (rounding up); -1 above the largest class. */
static inline int tier_class(uint64_t need) {
  if (need <= 1024) return (int)((need >> 8) - 1);
  if (need > TIER_CLASS_MAX_BYTES) return -1;
  int lg = 63 - __builtin_clzll(need - 1); /* need in (2^lg, 2^(lg+1)] */
  uint64_t step = UINT64_C(1) << (lg - 2);
  int sub = (int)((need - 1 - (UINT64_C(1) << lg)) >> (lg - 2)); /* 0..3 */
  (void)step;
  return 4 + (lg - 10) * 4 + sub;
}

static inline uint64_t tier_class_bytes(int cls) {
  if (cls < 4) return (uint64_t)(cls + 1) << 8;
  int lg = 10 + (cls - 4) / 4;
  int sub = (cls - 4) % 4;
  return (UINT64_C(1) << lg) + ((uint64_t)(sub + 1) << (lg - 2));
}

/* Class of a block of exactly bytes, -1 when bytes is no class's size. */
static inline int tier_class_exact(uint64_t bytes) {
  int c = tier_class(bytes);
  return c >= 0 && tier_class_bytes(c) == bytes ? c : -1;
}

static inline unsigned tier_mag_cap(int cls) {
  uint64_t n = TIER_MAG_CLASS_BYTES / tier_class_bytes(cls);
  return n > TIER_MAG_SLOTS ? TIER_MAG_SLOTS : n < 2 ? 2 : (unsigned)n;
}

/* Keep room_bytes = budget - held (0 when over) for the lock-free check. */
static void tier_update_room_locked(sgm_tier_pool *p) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  uint64_t room = p->p.budget_bytes > p->held_bytes ? p->p.budget_bytes - p->held_bytes : 0;
  __atomic_store_n(&p->head.room_bytes, room, __ATOMIC_RELAXED);
}

/* Count bytes handed out (or back, negative) at the pool level. */
static void tier_count_used(sgm_tier_pool *p, int64_t d_used, int64_t d_live, uint64_t allocs,
                            uint64_t frees) {
  uint64_t used = __atomic_add_fetch(&p->used_bytes, (uint64_t)d_used, __ATOMIC_RELAXED);
  if (d_live) __atomic_add_fetch(&p->n_live, d_live, __ATOMIC_RELAXED);
  if (allocs) __atomic_add_fetch(&p->n_allocs, allocs, __ATOMIC_RELAXED);
  if (frees) __atomic_add_fetch(&p->n_frees, frees, __ATOMIC_RELAXED);
  if (d_used > 0) {
    uint64_t peak = __atomic_load_n(&p->peak_used_bytes, __ATOMIC_RELAXED);
    while (used > peak &&
           !__atomic_compare_exchange_n(&p->peak_used_bytes, &peak, used, true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
  }
}

/* ---- the live map ----
 *
 * Writers (insert, remove) hold the pool lock. Readers hold nothing and
 * write nothing shared: they walk a shard's chain with atomic loads and act
 * on a record only through a compare-and-swap of its tag, which holds the
 * record's address, so a record that was recycled for another block while a
 * reader looked at it never matches. Records are type-stable: once in the
 * map, a record goes to the pool's spare list, never to free(), until the
 * pool is destroyed, so a reader holding a stale pointer reads a record,
 * never freed memory. A walk that found nothing is believed only if the
 * shard's sequence number did not move meanwhile (a record unlinked or the
 * table rebuilt could have hidden the rest of the chain).
 */

static inline uint64_t tier_tag_of(const tier_block *b) {
  return __atomic_load_n(&b->tag, __ATOMIC_ACQUIRE);
}

/* Walks longer than this (only a walk misled by concurrent writers gets
 * near it) start over. */
#define TIER_MAP_MAX_WALK 4096

/* The record whose tag names ptr, NULL when there is none (lock-free). */
static tier_block *tier_map_lookup(sgm_tier_pool *p, sgm_devptr ptr) {
  uint64_t h = tier_hash(ptr);
  tier_shard *s = tier_shard_of(p, h);
  for (unsigned spins = 0;; spins++) {
    if (spins > 64) sched_yield();
    unsigned seq = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
    if (seq & 1u) continue;
    tier_table *t = __atomic_load_n(&s->table, __ATOMIC_ACQUIRE);
    if (!t) return NULL;
    tier_block *b = __atomic_load_n(&t->b[(h >> 6) & t->mask], __ATOMIC_ACQUIRE);
    for (unsigned k = 0; b && k < TIER_MAP_MAX_WALK; k++) {
      if ((tier_tag_of(b) & ~TIER_TAG_FLAGS) == ptr) return b;
      b = __atomic_load_n(&b->hnext, __ATOMIC_ACQUIRE);
    }
    /* Every load above is an acquire, so this one cannot move before them. */
    if (!b && __atomic_load_n(&s->seq, __ATOMIC_RELAXED) == seq) return NULL;
  }
}

/* A seqlock without fences (TSan has none): the writer's stores between
 * begin and end are releases, so a reader that sees one also sees the odd
 * sequence number. */
static void tier_shard_write_begin(tier_shard *s) { __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED); }

static void tier_shard_write_end(tier_shard *s) { __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE); }

/* Insert b, its tag already set (pool lock held); false when out of memory. */
static bool tier_map_insert(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  uint64_t h = tier_hash(b->ptr);
  tier_shard *s = tier_shard_of(p, h);
  tier_table *t = s->table;
  if (!t || s->n >= 2 * (t->mask + 1)) {
    size_t nb = t ? 2 * (t->mask + 1) : TIER_SHARD_BUCKETS_MIN;
    tier_table *nt = calloc(1, sizeof *nt + nb * sizeof nt->b[0]);
    if (!nt && !t) return false;
    if (nt) {
      nt->mask = nb - 1;
      nt->retired = t;
      /* Relinking moves records between chains under readers' feet: they
       * see the sequence number move and walk again. */
      tier_shard_write_begin(s);
      for (size_t i = 0; t && i <= t->mask; i++) {
        for (tier_block *x = t->b[i], *next; x; x = next) {
          next = x->hnext;
          size_t k = (tier_hash(x->ptr) >> 6) & nt->mask;
          __atomic_store_n(&x->hnext, nt->b[k], __ATOMIC_RELEASE);
          nt->b[k] = x;
        }
      }
      __atomic_store_n(&s->table, nt, __ATOMIC_RELEASE);
      tier_shard_write_end(s);
      t = nt;
    }
  }
  /* Prepending hides nothing from a reader: no sequence step. */
  tier_block **head = &t->b[(h >> 6) & t->mask];
  __atomic_store_n(&b->hnext, *head, __ATOMIC_RELAXED);
  __atomic_store_n(head, b, __ATOMIC_RELEASE);
  __atomic_store_n(&s->n, s->n + 1, __ATOMIC_RELAXED);
  __atomic_store_n(&s->n_writes, s->n_writes + 1, __ATOMIC_RELAXED);
  return true;
}

/* Unlink b (pool lock held); the caller makes it spare. */
static void tier_map_remove(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  uint64_t h = tier_hash(b->ptr);
  tier_shard *s = tier_shard_of(p, h);
  tier_table *t = s->table;
  tier_shard_write_begin(s);
  for (tier_block **pp = &t->b[(h >> 6) & t->mask]; *pp; pp = &(*pp)->hnext) {
    if (*pp == b) {
      __atomic_store_n(pp, b->hnext, __ATOMIC_RELEASE);
      __atomic_store_n(&s->n, s->n - 1, __ATOMIC_RELAXED);
      __atomic_store_n(&s->n_writes, s->n_writes + 1, __ATOMIC_RELAXED);
      break;
    }
  }
  tier_shard_write_end(s);
}

/* A record for a carve: a spare one, else NULL (pool lock held). */
static tier_block *tier_spare_take_locked(sgm_tier_pool *p) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  tier_block *b = p->spare;
  if (b) p->spare = b->next;
  return b;
}

/* Keep a record that may have been in the map for the next carve (pool
 * lock held); its tag goes to 0, so no reader matches it. */
static void tier_spare_put_locked(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  __atomic_store_n(&b->tag, 0, __ATOMIC_RELEASE);
  b->next = p->spare;
  p->spare = b;
}

/* Move ptr's block from LIVE to CACHED; NULL when ptr is no live block
 * (with own: one sgm took for itself; without: one the user holds). */
static tier_block *tier_map_take_live(sgm_tier_pool *p, sgm_devptr ptr, bool own) {
  uint64_t flags = own ? TIER_OWN : 0;
  for (unsigned spins = 0;; spins++) {
    tier_block *b = tier_map_lookup(p, ptr);
    if (!b) return NULL;
    uint64_t want = ptr | TIER_LIVE | flags;
    uint64_t tag = want;
    if (__atomic_compare_exchange_n(&b->tag, &tag, ptr | TIER_CACHED | flags, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return b;
    if ((tag & ~TIER_TAG_FLAGS) != ptr) continue; /* recycled meanwhile: look again */
    if (tag != (want | TIER_BUSY)) return NULL;  /* cached (freed twice), or the other owner's */
    if (spins > 64) sched_yield();                /* sgm_record_stream holds it a moment */
  }
}

/* Mark ptr's user-held block BUSY for sgm_record_stream; NULL when ptr is no
 * live user block. The caller ends with tier_map_unbusy. */
static tier_block *tier_map_busy_live(sgm_tier_pool *p, sgm_devptr ptr) {
  for (unsigned spins = 0;; spins++) {
    tier_block *b = tier_map_lookup(p, ptr);
    if (!b) return NULL;
    uint64_t tag = ptr | TIER_LIVE;
    if (__atomic_compare_exchange_n(&b->tag, &tag, ptr | TIER_LIVE | TIER_BUSY, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return b;
    if ((tag & ~TIER_TAG_FLAGS) != ptr) continue;
    if (tag != (ptr | TIER_LIVE | TIER_BUSY)) return NULL;
    if (spins > 64) sched_yield();
  }
}

static void tier_map_unbusy(tier_block *b) { __atomic_fetch_and(&b->tag, ~(uint64_t)TIER_BUSY, __ATOMIC_RELEASE); }

/* Set a block's state, keeping its address and owner (LIVE when handed out,
 * CACHED when taken back; the caller holds the block alone). */
static inline void tier_block_set_state(tier_block *b, int state) {
  uint64_t tag = __atomic_load_n(&b->tag, __ATOMIC_RELAXED);
  __atomic_store_n(&b->tag, (tag & ~TIER_TAG_STATE) | (uint64_t)state, __ATOMIC_RELEASE);
}

/* ---- the sub-allocator side (pool lock held) ---- */

/* Give a cached block back to the sub-allocator and forget it. */
static void tier_vmm_unref_locked(sgm_tier_pool *p, uint64_t off, uint64_t bytes);
static int tier_backend_nomem_locked(sgm_tier_pool *p, uint64_t size);
static size_t tier_reclaim_ex(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode);
/* What a transfer is for: blocks that serve one request (tier_bag_take's
 * rule: class cls, or for cls < 0 at least need bytes and at most 1/8 more).
 * NULL: every block. */
typedef struct tier_want {
  int cls;                     /* size class of the request, < 0 for a large one */
  uint64_t need;               /* bytes asked, aligned (large requests) */
  uint64_t also_cls;           /* moved too, not asked for: bit c = every block of class c */
  uint64_t also_large[TIER_RECENT_LARGE]; /* moved too: large blocks fitting these sizes; 0 = none */
} tier_want;
static size_t tier_reclaim_settle(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode,
                                  const tier_want *w);
static size_t tier_reclaim_want(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode,
                                const tier_want *w);
static size_t tier_reclaim_some(sgm_tier_pool *p, bool mags, sgm_reclaim_mode mode);

static void tier_release_block_locked(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  tier_map_remove(p, b);
  if (p->vmm_range) tier_vmm_unref_locked(p, b->ptr, b->bytes);
  uint64_t sz = 0;
  int rc = sgm__suballoc_free(p->sa, b->ptr, &sz);
  sgm_assert_internal(rc == SGM_OK && sz == b->bytes);
  (void)rc;
  p->held_bytes -= b->bytes;
  p->n_blocks--;
  free(b->rec);
  b->rec = NULL;
  b->n_rec = 0;
  tier_spare_put_locked(p, b);
}

/* Widen the pool's address span to cover [base, base + bytes) (pool lock held,
 * or the pool not yet shared). Stored before any block of it is handed out. */
static void tier_span_add(sgm_tier_pool *p, sgm_devptr base, uint64_t bytes) {
  if (base < __atomic_load_n(&p->span_lo, __ATOMIC_RELAXED))
    __atomic_store_n(&p->span_lo, base, __ATOMIC_RELAXED);
  if (base + bytes > __atomic_load_n(&p->span_hi, __ATOMIC_RELAXED))
    __atomic_store_n(&p->span_hi, base + bytes, __ATOMIC_RELAXED);
}

bool sgm__tier_may_own(const sgm_tier_pool *p, sgm_devptr ptr) {
  return ptr >= __atomic_load_n(&p->span_lo, __ATOMIC_RELAXED) &&
         ptr < __atomic_load_n(&p->span_hi, __ATOMIC_RELAXED);
}

static int tier_add_chunk_locked(sgm_tier_pool *p, const sgm_chunk *c) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  if (p->n_chunks == p->cap_chunks) {
    size_t cap = p->cap_chunks ? p->cap_chunks * 2 : 8;
    sgm_chunk *n = realloc(p->chunks, cap * sizeof *n);
    if (!n) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for chunk metadata");
    p->chunks = n;
    p->cap_chunks = cap;
  }
  int rc = sgm__suballoc_add_range(p->sa, c->base, c->bytes);
  if (rc != SGM_OK) return rc;
  tier_span_add(p, c->base, c->bytes);
  p->chunks[p->n_chunks] = *c;
  p->chunks[p->n_chunks].free_seen_ms = UINT64_MAX;
  p->n_chunks++;
  return SGM_OK;
}

/* ---- bags ---- */

static void tier_bag_push(tier_bag *g, tier_block *b) {
  tier_block **head = b->cls >= 0 ? &g->cls[b->cls] : &g->large;
  b->next = *head;
  *head = b;
  g->bytes += b->bytes;
  g->n++;
}

/* A block of class cls (or, for cls < 0, of at least need bytes and at most
 * 1/8 more) from the bag; NULL when none. */
static tier_block *tier_bag_take(tier_bag *g, int cls, uint64_t need) {
  if (g->n == 0) return NULL;
  tier_block *b = NULL;
  if (cls >= 0 && g->cls[cls]) {
    b = g->cls[cls];
    g->cls[cls] = b->next;
  } else {
    uint64_t lo = cls >= 0 ? tier_class_bytes(cls) : need;
    uint64_t hi = lo + (lo >> TIER_LARGE_SLACK_SHIFT);
    tier_block **best = NULL;
    for (tier_block **pp = &g->large; *pp; pp = &(*pp)->next) {
      uint64_t sz = (*pp)->bytes;
      if (sz >= lo && sz <= hi && (!best || sz < (*best)->bytes)) best = pp;
    }
    if (!best) return NULL;
    b = *best;
    *best = b->next;
  }
  g->bytes -= b->bytes;
  g->n--;
  b->next = NULL;
  return b;
}

/* Empty the bag, handing each block to `to`: into dst (a merge), or back to
 * the sub-allocator (p, pool lock held). */
static void tier_bag_drain(tier_bag *g, tier_bag *dst, sgm_tier_pool *p) {
  for (int c = -1; c < TIER_N_CLASSES; c++) {
    tier_block **sh = c < 0 ? &g->large : &g->cls[c];
    while (*sh) {
      tier_block *b = *sh;
      *sh = b->next;
      if (dst) tier_bag_push(dst, b);
      else tier_release_block_locked(p, b);
    }
  }
  g->bytes = 0;
  g->n = 0;
}

/* Move every block of src into dst. */
static void tier_bag_merge(tier_bag *dst, tier_bag *src) { tier_bag_drain(src, dst, NULL); }

static void tier_bag_release_locked(sgm_tier_pool *p, tier_bag *g) { tier_bag_drain(g, NULL, p); }

static tier_stream *tier_stream_find_locked(sgm_tier_pool *p, uint64_t key) {
  for (tier_stream *s = p->streams; s; s = s->next)
    if (s->ref.key == key) return s;
  return NULL;
}

/* The stream's record, made when missing; NULL when out of memory. */
static tier_stream *tier_stream_get_locked(sgm_tier_pool *p, const sgm_stream_ref *ref) {
  tier_stream *s = tier_stream_find_locked(p, ref->key);
  if (s) return s;
  s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->ref = *ref;
  s->next = p->streams;
  p->streams = s;
  return s;
}

/* Recent sizes (issue 10): s took a block of class cls (a large one of need
 * bytes for cls < 0) from its own caches (pool lock held). Not counted on
 * the magazine's path, which makes no shared write: a class served there
 * is one s holds itself. A transfer to s takes the owner's blocks of the
 * sizes s took in this period and the last (tier_want_recent_locked), so a
 * burst of sizes crosses at once; the periods age sizes s no longer uses. */
static void tier_stream_note_locked(tier_stream *s, int cls, uint64_t need) {
  if (cls >= 0) {
    s->recent_cls[0] |= UINT64_C(1) << cls;
    return;
  }
  tier_recent_large *slot = &s->recent_large[0];
  for (int i = 0; i < TIER_RECENT_LARGE; i++) {
    tier_recent_large *r = &s->recent_large[i];
    if (r->need == need) {
      slot = r;
      break;
    }
    if (r->need == 0 || r->period < slot->period) slot = r; /* empty, else the oldest */
  }
  slot->need = need;
  slot->period = s->period;
}

static void tier_bagged_add_locked(sgm_tier_pool *p, int64_t n, int64_t bytes) {
  /* Atomic: read without the lock as a hint before large carves. */
  __atomic_store_n(&p->bag_bytes, p->bag_bytes + (uint64_t)bytes, __ATOMIC_RELAXED);
  __atomic_store_n(&p->n_bagged, p->n_bagged + (size_t)n, __ATOMIC_RELAXED);
}

/* Cache b (CACHED, key and handle set) in its stream's open bag; a block whose
 * stream record cannot be made goes back to the sub-allocator only when no
 * work can use it (synchronous backend), else it stays cached on the deferred
 * path of the next reclaim (kept live in the map: leaked until destroy). */
static void tier_bag_add_locked(sgm_tier_pool *p, tier_block *b) {
  sgm_stream_ref ref = {b->key, b->handle};
  tier_stream *s = tier_stream_get_locked(p, &ref);
  if (!s) {
    if (p->p.bops->synchronous) {
      tier_release_block_locked(p, b);
      tier_update_room_locked(p);
    } else {
      sgm__log(p->p.verbose, 1, "%s: out of host memory caching a freed block; it stays "
               "allocated until the context is destroyed", sgm_tier_name(p->p.tier));
    }
    return;
  }
  s->ref.handle = b->handle;
  tier_bag_push(&s->open, b);
  tier_bagged_add_locked(p, 1, (int64_t)b->bytes);
}

/* Synchronous backend: nothing is pending on the device, so every bagged
 * block goes back to the sub-allocator (pool lock held). Returns how many. */
static size_t tier_release_bags_locked(sgm_tier_pool *p) {
  size_t n = 0;
  for (tier_stream *s = p->streams; s; s = s->next) {
    n += s->open.n + s->sealed.n;
    tier_bagged_add_locked(p, -(int64_t)(s->open.n + s->sealed.n),
                           -(int64_t)(s->open.bytes + s->sealed.bytes));
    tier_bag_release_locked(p, &s->open);
    tier_bag_release_locked(p, &s->sealed);
  }
  tier_update_room_locked(p);
  return n;
}

/* ---- pooled events ---- */

static void *tier_event_get(sgm_tier_pool *p) {
  void *ev = NULL;
  sgm__lock_take(&p->lock);
  if (p->n_events) ev = p->events[--p->n_events];
  sgm__lock_drop(&p->lock);
  if (!ev && p->p.bops->event_create(p->p.be, &ev) != SGM_OK) return NULL;
  return ev;
}

static void tier_event_put_locked(sgm_tier_pool *p, void *ev) {
  if (!ev) return;
  if (p->n_events == p->cap_events) {
    size_t cap = p->cap_events ? p->cap_events * 2 : 8;
    void **n = realloc(p->events, cap * sizeof *n);
    if (!n) {
      /* Cannot pool it: it is not in use by anyone, destroying it is safe. */
      sgm__lock_drop(&p->lock);
      p->p.bops->event_destroy(p->p.be, ev);
      sgm__lock_take(&p->lock);
      return;
    }
    p->events = n;
    p->cap_events = cap;
  }
  p->events[p->n_events++] = ev;
}

static void tier_event_put(sgm_tier_pool *p, void *ev) {
  sgm__lock_take(&p->lock);
  tier_event_put_locked(p, ev);
  sgm__lock_drop(&p->lock);
}

/* ---- magazines ---- */

/* The registry of every thread's magazines (rank SGM_LOCK_TIER_MAGS, taken
 * before a pool's lock): a magazine's pool link and the pools' lists. */
static sgm_lock tier_registry_mu = SGM_LOCK_INITIALIZER(SGM_LOCK_TIER_MAGS);
static pthread_once_t tier_tls_once = PTHREAD_ONCE_INIT;
static pthread_key_t tier_tls_key;
static uint64_t tier_next_pool_id;
static _Thread_local struct {
  uint64_t pool_id;  /* the pool the magazine is for (0: empty slot) */
  tier_mag *mag;     /* this thread's magazine for it */
} tier_tls[TIER_TLS_SLOTS];

/* Move every block of m into its stream's bag (pool and magazine lock held). */
static void tier_mag_drain_locked(sgm_tier_pool *p, tier_mag *m) {
  for (int c = 0; c < TIER_N_CLASSES; c++) {
    for (unsigned i = 0; i < m->n[c]; i++) tier_bag_add_locked(p, m->slot[c][i]);
    m->n[c] = 0;
  }
  __atomic_store_n(&m->cached_bytes, 0, __ATOMIC_RELAXED);
}

/* Add m's pending counters to the pool and zero them (owner thread, or pool lock + m's lock). */
static void tier_mag_flush_counts(sgm_tier_pool *p, tier_mag *m) {
  int64_t du = __atomic_load_n(&m->d_used, __ATOMIC_RELAXED);
  int64_t dl = __atomic_load_n(&m->d_live, __ATOMIC_RELAXED);
  uint64_t na = __atomic_load_n(&m->n_allocs, __ATOMIC_RELAXED);
  uint64_t nf = __atomic_load_n(&m->n_frees, __ATOMIC_RELAXED);
  __atomic_store_n(&m->d_used, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&m->d_live, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&m->n_allocs, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&m->n_frees, 0, __ATOMIC_RELAXED);
  tier_count_used(p, du, dl, na, nf);
}

/* Unhook m from its pool (if alive), its blocks to the bags; registry lock held. */
static void tier_mag_detach_registered(tier_mag *m) {
  sgm_tier_pool *p = m->pool;
  if (!p) return;
  sgm__lock_take(&p->lock);
  tier_spin_lock(&m->lock);
  tier_mag_drain_locked(p, m);
  tier_mag_flush_counts(p, m);
  tier_spin_unlock(&m->lock);
  if (m->prev) m->prev->next = m->next;
  else p->mags = m->next;
  if (m->next) m->next->prev = m->prev;
  __atomic_store_n(&p->n_mags, p->n_mags - 1, __ATOMIC_RELAXED);
  __atomic_store_n(&m->pool, NULL, __ATOMIC_RELAXED);
  sgm__lock_drop(&p->lock);
}

static void tier_mag_free(tier_mag *m) {
  sgm__lock_take(&tier_registry_mu);
  tier_mag_detach_registered(m);
  sgm__lock_drop(&tier_registry_mu);
  free(m);
}

/* Thread exit: every magazine of the thread goes back to its pool. */
static void tier_tls_exit(void *unused) {
  (void)unused;
  for (int i = 0; i < TIER_TLS_SLOTS; i++) {
    if (tier_tls[i].mag) tier_mag_free(tier_tls[i].mag);
    tier_tls[i].mag = NULL;
    tier_tls[i].pool_id = 0;
  }
}

static void tier_tls_init(void) { pthread_key_create(&tier_tls_key, tier_tls_exit); }

/* The calling thread's magazine for p, made on first use; NULL when out of memory. */
static tier_mag *tier_mag_slow(sgm_tier_pool *p) {
  pthread_once(&tier_tls_once, tier_tls_init);
  int slot = -1;
  for (int i = 0; i < TIER_TLS_SLOTS && slot < 0; i++)
    if (!tier_tls[i].mag || !__atomic_load_n(&tier_tls[i].mag->pool, __ATOMIC_RELAXED)) slot = i;
  if (slot < 0) slot = (int)(p->id % TIER_TLS_SLOTS);
  if (tier_tls[slot].mag) {
    tier_mag_free(tier_tls[slot].mag);
    tier_tls[slot].mag = NULL;
    tier_tls[slot].pool_id = 0;
  }
  /* Its own cache lines: two threads' magazines never share one. */
  tier_mag *m = aligned_alloc(64, sgm__align_up(sizeof *m, 64));
  if (m) memset(m, 0, sizeof *m);
  if (!m) return NULL;
  m->pool = p;
  m->pool_id = p->id;
  pthread_setspecific(tier_tls_key, (void *)1); /* so that tier_tls_exit runs */
  sgm__lock_take(&tier_registry_mu);
  sgm__lock_take(&p->lock);
  m->next = p->mags;
  if (p->mags) p->mags->prev = m;
  p->mags = m;
  __atomic_store_n(&p->n_mags, p->n_mags + 1, __ATOMIC_RELAXED);
  sgm__lock_drop(&p->lock);
  sgm__lock_drop(&tier_registry_mu);
  tier_tls[slot].pool_id = p->id;
  tier_tls[slot].mag = m;
  return m;
}

static inline tier_mag *tier_mag_get(sgm_tier_pool *p) {
  for (int i = 0; i < TIER_TLS_SLOTS; i++)
    if (tier_tls[i].pool_id == p->id) return tier_tls[i].mag;
  return tier_mag_slow(p);
}

/* Count one alloc or free of asked bytes (d_used > 0: alloc) on the
 * magazine. Used bytes reach the pool in batches, or at once when the thread
 * is the pool's only one (so that peak_used_bytes is exact then); the other
 * counters are summed by sgm__tier_stats. Owner thread only. */
static inline void tier_mag_count(sgm_tier_pool *p, tier_mag *m, int64_t d_used) {
  bool alloc = d_used > 0;
  int64_t du = __atomic_load_n(&m->d_used, __ATOMIC_RELAXED) + d_used;
  __atomic_store_n(&m->d_live, __atomic_load_n(&m->d_live, __ATOMIC_RELAXED) + (alloc ? 1 : -1),
                   __ATOMIC_RELAXED);
  uint64_t *n = alloc ? &m->n_allocs : &m->n_frees;
  __atomic_store_n(n, __atomic_load_n(n, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
  if (__atomic_load_n(&p->n_mags, __ATOMIC_RELAXED) <= 1 ||
      du >= (int64_t)TIER_MAG_FLUSH_BYTES || du <= -(int64_t)TIER_MAG_FLUSH_BYTES) {
    tier_count_used(p, du, 0, 0, 0);
    du = 0;
  }
  __atomic_store_n(&m->d_used, du, __ATOMIC_RELAXED);
}

/* ---- expandable growth on one reserved range (issue 17) ---- */

static inline uint64_t tier_vmm_granule(const sgm_tier_pool *p) { return UINT64_C(1) << p->vmm_shift; }

/* First and last granule a block [off, off + bytes) touches. */
static inline void tier_vmm_span(const sgm_tier_pool *p, uint64_t off, uint64_t bytes, size_t *g0,
                                 size_t *g1) {
  *g0 = (size_t)((off - p->vmm_base) >> p->vmm_shift);
  *g1 = (size_t)((off - p->vmm_base + bytes - 1) >> p->vmm_shift);
}

/* Free mapped granules past which they are unmapped at once. */
static inline uint64_t tier_vmm_slack(const sgm_tier_pool *p) {
  uint64_t committed = __atomic_load_n(&p->committed_bytes, __ATOMIC_RELAXED) >> p->vmm_shift;
  uint64_t rel = committed >> TIER_VMM_SLACK_SHIFT;
  return rel > TIER_VMM_SLACK_GRANULES ? rel : TIER_VMM_SLACK_GRANULES;
}

/* Reserve mode's pool: committed_bytes counts the granules mapped (as in
 * growth mode), the pool holds the budget whatever is mapped; what users see
 * as committed is the pool (tier_committed). */
static inline uint64_t tier_committed(const sgm_tier_pool *p) {
  return p->vmm_pool ? ((uint64_t)p->n_pool << p->vmm_shift) + p->external_bytes : p->committed_bytes;
}

/* The most that may be mapped: the budget, and in reserve mode also the pool. */
static inline uint64_t tier_vmm_cap_locked(const sgm_tier_pool *p) {
  if (!p->vmm_pool) return p->p.budget_bytes;
  /* The pool: the budget rounded up to whole granules, so that a block of
   * the whole budget fits as it did in one chunk. */
  uint64_t pool = (uint64_t)p->n_pool << p->vmm_shift;
  uint64_t budget = sgm__align_up(p->p.budget_bytes, tier_vmm_granule(p));
  return pool < budget ? pool : budget;
}

static void tier_vmm_free_mapped_add_locked(sgm_tier_pool *p, int64_t d) {
  __atomic_store_n(&p->vmm_free_mapped, p->vmm_free_mapped + (uint64_t)d, __ATOMIC_RELAXED);
}

/* A block left the sub-allocator: its granules lose a reference. */
static void tier_vmm_unref_locked(sgm_tier_pool *p, uint64_t off, uint64_t bytes) {
  size_t g0, g1;
  tier_vmm_span(p, off, bytes, &g0, &g1);
  for (size_t g = g0; g <= g1; g++) {
    tier_granule *x = &p->gran[g];
    sgm_assert_internal(x->refs > 0);
    if (--x->refs == 0 && x->mapped && !x->busy) tier_vmm_free_mapped_add_locked(p, 1);
  }
}

/* Bytes of [off, off + bytes) with no memory mapped behind them now. */
static uint64_t tier_vmm_unmapped_locked(const sgm_tier_pool *p, uint64_t off, uint64_t bytes) {
  size_t g0, g1, n = 0;
  tier_vmm_span(p, off, bytes, &g0, &g1);
  for (size_t g = g0; g <= g1; g++) n += !p->gran[g].mapped;
  return (uint64_t)n << p->vmm_shift;
}

/* Unmap granules [g, e) of the range: their memory goes back to the driver
 * (growth) or stays in the pool (reserve mode). No lock held. */
static void tier_vmm_unmap_run(sgm_tier_pool *p, size_t g, size_t e) {
  uint64_t off = (uint64_t)g << p->vmm_shift, bytes = (uint64_t)(e - g) << p->vmm_shift;
  if (p->vmm_pool) p->p.bops->vmm_pool_unmap(p->p.be, p->vmm_range, off, bytes);
  else p->p.bops->vmm_unmap(p->p.be, p->vmm_range, off, bytes);
}

/* Map the claimed granules [g, e) (busy 2; their pool granules in phys):
 * the backend's call, in pieces of at most 64 granules in reserve mode. */
static int tier_vmm_map_run(sgm_tier_pool *p, size_t g, size_t e) {
  if (!p->vmm_pool)
    return p->p.bops->vmm_map(p->p.be, p->vmm_range, (uint64_t)g << p->vmm_shift,
                              (uint64_t)(e - g) << p->vmm_shift);
  uint32_t idx[64];
  for (size_t a = g; a < e;) {
    size_t n = e - a < 64 ? e - a : 64;
    for (size_t k = 0; k < n; k++) idx[k] = p->gran[a + k].phys;
    int rc = p->p.bops->vmm_pool_map(p->p.be, p->vmm_range, (uint64_t)a << p->vmm_shift,
                                     p->vmm_pool, idx, n);
    if (rc != SGM_OK) {
      if (a > g) tier_vmm_unmap_run(p, g, a); /* all or nothing, as vmm_map */
      return rc;
    }
    a += n;
  }
  return SGM_OK;
}

/*
 * Unmap free mapped granules (no block touches them, nobody maps or unmaps
 * them): all of them, or with idle_ms != UINT64_MAX only those seen free since
 * now_ms - idle_ms (the others are stamped). One run of neighbours per backend
 * call, the lock dropped across it; a block carved meanwhile onto a granule
 * being unmapped waits for it (busy) and maps it again. Bytes unmapped.
 */
static uint64_t tier_vmm_unmap_free(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms) {
  uint64_t done = 0, gb = tier_vmm_granule(p);
  size_t n = (size_t)(p->vmm_bytes >> p->vmm_shift);
  sgm__lock_take(&p->lock);
  for (size_t g = 0; g < n;) {
    tier_granule *x = &p->gran[g];
    bool free_now = x->mapped && !x->busy && x->refs == 0;
    if (free_now && idle_ms != UINT64_MAX) {
      if (x->free_seen_ms == UINT64_MAX || x->free_seen_ms > now_ms) x->free_seen_ms = now_ms;
      free_now = now_ms - x->free_seen_ms >= idle_ms;
    }
    if (!free_now) {
      g++;
      continue;
    }
    size_t e = g;
    while (e < n && p->gran[e].mapped && !p->gran[e].busy && p->gran[e].refs == 0 &&
           (idle_ms == UINT64_MAX ||
            (p->gran[e].free_seen_ms != UINT64_MAX && p->gran[e].free_seen_ms <= now_ms &&
             now_ms - p->gran[e].free_seen_ms >= idle_ms))) {
      p->gran[e].busy = 1;
      e++;
    }
    tier_vmm_free_mapped_add_locked(p, -(int64_t)(e - g));
    sgm__lock_drop(&p->lock);
    tier_vmm_unmap_run(p, g, e);
    sgm__lock_take(&p->lock);
    for (size_t k = g; k < e; k++) {
      p->gran[k].mapped = 0;
      p->gran[k].busy = 0;
      p->gran[k].free_seen_ms = UINT64_MAX;
      if (p->vmm_pool) p->pool_free[p->n_pool_free++] = p->gran[k].phys; /* back to the pool */
    }
    p->committed_bytes -= (uint64_t)(e - g) * gb;
    done += (uint64_t)(e - g) * gb;
    pthread_cond_broadcast(&p->grown);
    g = e;
  }
  sgm__lock_drop(&p->lock);
  return done;
}

/*
 * After blocks went back to the sub-allocator: unmap the free granules at all
 * while committed is over a budget that was lowered (fair shares of the node
 * registry: another process waits for that memory), and, when `eager` (the
 * slow paths: reclaim, a failed carve), when they are more than the slack.
 * A plain free leaves them mapped: the next block that needs new granules
 * unmaps them first (tier_vmm_back_locked), so committed is as bounded at
 * every mapping as if they had gone at once, and a block freed and allocated
 * again (a demotion and its promotion) finds its memory still there instead
 * of faulting in fresh pages; trims and the idle trim return the rest. The
 * free-granule count is read first without the lock, as a hint.
 */
static void tier_vmm_settle(sgm_tier_pool *p, bool eager) {
  if (!p->vmm_range || __atomic_load_n(&p->vmm_free_mapped, __ATOMIC_RELAXED) == 0) return;
  /* committed and the budget change under the lock (plain writes there). */
  sgm__lock_take(&p->lock);
  uint64_t free_mapped = p->vmm_free_mapped;
  /* Reserve mode's pool: free granules stay mapped until the pool is empty
   * (tier_vmm_back_locked): unmapping them returns nothing to anyone. */
  bool go = (eager && !p->vmm_pool && free_mapped > tier_vmm_slack(p)) ||
            (p->committed_bytes > tier_vmm_cap_locked(p) && free_mapped > 0);
  sgm__lock_drop(&p->lock);
  if (go) tier_vmm_unmap_free(p, 0, UINT64_MAX);
}

/*
 * Give the new block [off, off + bytes) memory: reference its granules, map
 * those that have none (runs of neighbours, one backend call each, the lock
 * dropped across it) and wait for those another thread maps or unmaps now.
 * Mapping never takes committed past the budget: free granules are unmapped
 * once to make room, else SGM__ERR_BUDGET. On failure the references stay:
 * the caller gives the block back (tier_release_block_locked drops them).
 */
static int tier_vmm_back_locked(sgm_tier_pool *p, uint64_t off, uint64_t bytes) {
  size_t g0, g1;
  tier_vmm_span(p, off, bytes, &g0, &g1);
  uint64_t gb = tier_vmm_granule(p);
  for (size_t g = g0; g <= g1; g++) {
    tier_granule *x = &p->gran[g];
    if (x->refs++ == 0 && x->mapped && !x->busy) tier_vmm_free_mapped_add_locked(p, -1);
    x->free_seen_ms = UINT64_MAX;
  }
  bool unmapped_for_room = false;
  for (;;) {
    /* Claim every granule of the block that has no memory and nobody's
     * attention (busy), so that no other thread maps it too. */
    uint64_t want = 0;
    bool others = false;
    for (size_t g = g0; g <= g1; g++) {
      want += !p->gran[g].mapped && !p->gran[g].busy ? gb : 0;
      others |= p->gran[g].busy;
    }
    if (want == 0 && !others) return SGM_OK;
    if (want == 0) {
      /* Another thread maps or unmaps one of them: wait, look again. */
      pthread_cond_wait(&p->grown, &p->lock.mu);
      continue;
    }
    /* Free granules past the slack go before new ones are mapped (frees
     * left them mapped: tier_vmm_settle), and all of them when the budget
     * has no room for the new ones. */
    uint64_t cap = tier_vmm_cap_locked(p);
    bool no_room = p->committed_bytes > cap || want > cap - p->committed_bytes;
    bool past_slack = !p->vmm_pool && p->vmm_free_mapped > tier_vmm_slack(p);
    if (no_room || (!unmapped_for_room && past_slack)) {
      if (unmapped_for_room || p->vmm_free_mapped == 0) return SGM__ERR_BUDGET;
      unmapped_for_room = true;
      sgm__lock_drop(&p->lock);
      tier_vmm_unmap_free(p, 0, UINT64_MAX);
      sgm__lock_take(&p->lock);
      continue;
    }
    size_t lo = g1 + 1, hi = g0;
    for (size_t g = g0; g <= g1; g++)
      if (!p->gran[g].mapped && !p->gran[g].busy) {
        p->gran[g].busy = 2; /* 2: claimed by this call */
        /* The room check above left a pool granule for each. */
        if (p->vmm_pool) p->gran[g].phys = p->pool_free[--p->n_pool_free];
        if (lo > g) lo = g;
        hi = g;
      }
    p->committed_bytes += want;
    sgm__lock_drop(&p->lock);
    /* One backend call per run of claimed neighbours. Claimed granules are
     * this thread's alone, so reading their state unlocked is safe. */
    int rc = SGM_OK;
    for (size_t g = lo; g <= hi;) {
      if (p->gran[g].busy != 2) {
        g++;
        continue;
      }
      size_t e = g;
      while (e <= hi && p->gran[e].busy == 2) e++;
      int r = rc == SGM_OK ? tier_vmm_map_run(p, g, e) : rc;
      sgm__lock_take(&p->lock);
      for (size_t k = g; k < e; k++) {
        p->gran[k].busy = 0;
        p->gran[k].mapped = r == SGM_OK;
        if (r != SGM_OK && p->vmm_pool) p->pool_free[p->n_pool_free++] = p->gran[k].phys;
      }
      if (r != SGM_OK) p->committed_bytes -= (uint64_t)(e - g) * gb;
      sgm__lock_drop(&p->lock);
      if (r != SGM_OK && rc == SGM_OK) rc = r;
      g = e;
    }
    sgm__lock_take(&p->lock);
    pthread_cond_broadcast(&p->grown);
    if (rc != SGM_OK) {
      if (rc == SGM_ERR_NOMEM) tier_backend_nomem_locked(p, bytes);
      return rc;
    }
  }
}

/*
 * At create: reserve one range for the budget when the backend has a
 * virtual-memory API and the option allows it; the choice and its reason go
 * to the log at SGM_VERBOSE >= 2. Growth mode maps granules on demand; reserve
 * mode (growth off) also takes the budget's granules now, as a pool
 * (tier_vmm_pool_setup). false: grow in chunks, or reserve one chunk.
 */
static bool tier_vmm_setup(sgm_tier_pool *p) {
  const sgm_tier_params *tp = &p->p;
  const char *name = sgm_tier_name(tp->tier);
  char why[256] = "";
  uint64_t g = 0;
  if (!tp->vmm) {
    snprintf(why, sizeof why, "SGM_VRAM_VMM is off");
  } else if (!tp->growth && !tp->bops->vmm_pool_create) {
    snprintf(why, sizeof why, "the %s backend cannot keep a pool of physical granules",
             tp->bops->name);
  } else if (!tp->bops->vmm_granularity) {
    snprintf(why, sizeof why, "the %s backend has no virtual-memory API", tp->bops->name);
  } else if (tp->bops->vmm_granularity(tp->be, &g) != SGM_OK) {
    snprintf(why, sizeof why, "asking for the granularity failed: %s", sgm_last_error());
  } else if (g == 0) {
    snprintf(why, sizeof why, "the device does not support virtual memory management");
  } else if ((g & (g - 1)) || g < SGM_DEVICE_ALIGN || g > (UINT64_C(1) << 40)) {
    snprintf(why, sizeof why, "the granularity %llu is not a power of two from %u bytes",
             (unsigned long long)g, SGM_DEVICE_ALIGN);
  } else if (tp->budget_bytes / g < TIER_VMM_MIN_GRANULES) {
    snprintf(why, sizeof why, "the budget is below %u granules of %llu bytes",
             TIER_VMM_MIN_GRANULES, (unsigned long long)g);
  }
  /* Address space for the largest budget the pool may be given later (fair
   * shares of the node registry raise and lower it): reserving is cheap. */
  uint64_t want = tp->vmm_range_bytes > tp->budget_bytes ? tp->vmm_range_bytes : tp->budget_bytes;
  /* Reserve mode: blocks land anywhere in twice the budget's addresses, so
   * that fragmentation of the addresses never decides the budget (only the
   * granules blocks touch count). */
  if (!tp->growth && want / 2 < tp->budget_bytes) want = tp->budget_bytes * 2;
  uint64_t bytes = why[0] ? 0 : sgm__align_up(want, g);
  tier_granule *gran = NULL;
  void *range = NULL;
  sgm_devptr base = 0;
  if (!why[0]) {
    gran = malloc((size_t)(bytes / g) * sizeof *gran);
    if (!gran) snprintf(why, sizeof why, "out of host memory for the granule table");
  }
  if (!why[0] && tp->bops->vmm_reserve(tp->be, bytes, &range, &base) != SGM_OK)
    snprintf(why, sizeof why, "reserving the range failed: %s", sgm_last_error());
  if (!why[0] && sgm__suballoc_add_range(p->sa, base, bytes) != SGM_OK) {
    snprintf(why, sizeof why, "%s", sgm_last_error());
    tp->bops->vmm_free(tp->be, range);
  }
  char a[32], b[32];
  if (why[0]) {
    free(gran);
    sgm__log(tp->verbose, 2, tp->growth ? "%s: growth in chunks (%s)"
                                        : "%s: the budget reserved as one contiguous chunk (%s)",
             name, why);
    return false;
  }
  for (size_t i = 0; i < bytes / g; i++)
    gran[i] = (tier_granule){.refs = 0, .mapped = 0, .busy = 0, .phys = 0,
                             .free_seen_ms = UINT64_MAX};
  p->gran = gran;
  p->vmm_range = range;
  p->vmm_base = base;
  p->vmm_bytes = bytes;
  tier_span_add(p, base, bytes);
  p->vmm_shift = (unsigned)__builtin_ctzll(g);
  if (tp->growth)
    sgm__log(tp->verbose, 2, "%s: growth on one reserved range of %s, mapped in %s granules on "
             "demand (virtual-memory API)", name, sgm__fmt_bytes(bytes, a, sizeof a),
             sgm__fmt_bytes(g, b, sizeof b));
  return true;
}

/*
 * Reserve mode on the range tier_vmm_setup reserved: take the budget's
 * granules from the driver now (whole granules: the budget rounded up, so
 * that a block of the whole budget fits, or down when the device has no room
 * for that), as the pool that mapped granules
 * come from and go back to. Fails as reserving the budget as a chunk fails
 * (the caller's message).
 */
static int tier_vmm_pool_setup(sgm_tier_pool *p) {
  const sgm_tier_params *tp = &p->p;
  uint64_t n = sgm__align_up(tp->budget_bytes, tier_vmm_granule(p)) >> p->vmm_shift;
  if (n > UINT32_MAX)
    return sgm__error_set(SGM_ERR_INVALID, "a budget of %llu granules is more than a pool holds",
                          (unsigned long long)n);
  p->pool_free = malloc((size_t)n * sizeof *p->pool_free);
  if (!p->pool_free) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for the pool table");
  int rc = tp->bops->vmm_pool_create(tp->be, n, &p->vmm_pool);
  /* A budget of the whole device may have no room for its last partial
   * granule: the whole granules then (a block of the whole budget no longer
   * fits, every other does). */
  uint64_t floor_n = tp->budget_bytes >> p->vmm_shift;
  if (rc == SGM_ERR_NOMEM && floor_n < n && floor_n > 0) {
    n = floor_n;
    rc = tp->bops->vmm_pool_create(tp->be, n, &p->vmm_pool);
  }
  if (rc != SGM_OK) {
    free(p->pool_free);
    p->pool_free = NULL;
    return rc;
  }
  /* Popped from the end: low granules first (any order would do). */
  for (size_t i = 0; i < n; i++) p->pool_free[i] = (uint32_t)(n - 1 - i);
  p->n_pool = p->n_pool_free = (size_t)n;
  char a[32], b[32], c[32];
  sgm__log(tp->verbose, 2, "%s: reserved on the virtual-memory API: %s taken at create as %llu "
           "granules of %s, mapped where blocks land in a range of %s (a granule no block "
           "touches goes back to the pool, not to the driver)",
           sgm_tier_name(tp->tier), sgm__fmt_bytes(n << p->vmm_shift, a, sizeof a),
           (unsigned long long)n, sgm__fmt_bytes(tier_vmm_granule(p), b, sizeof b),
           sgm__fmt_bytes(p->vmm_bytes, c, sizeof c));
  return SGM_OK;
}

/* At destroy: unmap what is still mapped and release the range. */
static void tier_vmm_teardown(sgm_tier_pool *p) {
  if (!p->vmm_range) return;
  size_t n = (size_t)(p->vmm_bytes >> p->vmm_shift);
  for (size_t g = 0; g < n;) {
    if (!p->gran[g].mapped) {
      g++;
      continue;
    }
    size_t e = g;
    while (e < n && p->gran[e].mapped) e++;
    tier_vmm_unmap_run(p, g, e);
    g = e;
  }
  if (p->vmm_pool) p->p.bops->vmm_pool_free(p->p.be, p->vmm_pool); /* every handle back */
  p->vmm_pool = NULL;
  free(p->pool_free);
  p->p.bops->vmm_free(p->p.be, p->vmm_range);
  free(p->gran);
  p->vmm_range = NULL;
}

void sgm__tier_vmm_info(sgm_tier_pool *p, uint64_t *granule_bytes, uint64_t *reserved_bytes) {
  *granule_bytes = p->vmm_range ? tier_vmm_granule(p) : 0;
  *reserved_bytes = p->vmm_range ? p->vmm_bytes : 0;
}

bool sgm__tier_vmm_pooled(const sgm_tier_pool *p) { return p->vmm_pool != NULL; }

/* ---- create / destroy ---- */

/* The message when reserve mode cannot take the budget at create. */
static int tier_reserve_failed(const sgm_tier_params *params, int rc) {
  char b[32];
  return sgm__error_set(rc, "cannot reserve the %s budget of %s at create (growth mode off): %s; "
                        "lower SGM_VRAM_LIMIT / SGM_VRAM_FRACTION or set SGM_ALLOW_GROWTH=1",
                        sgm_tier_name(params->tier),
                        sgm__fmt_bytes(params->budget_bytes, b, sizeof b), sgm_last_error());
}

int sgm__tier_create(const sgm_tier_params *params, sgm_tier_pool **out) {
  *out = NULL;
  sgm_tier_pool *p = aligned_alloc(64, sgm__align_up(sizeof *p, 64));
  if (!p) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating the %s tier",
                                sgm_tier_name(params->tier));
  memset(p, 0, sizeof *p);
  p->p = *params;
  p->id = __atomic_add_fetch(&tier_next_pool_id, 1, __ATOMIC_RELAXED);
  p->head.room_bytes = params->budget_bytes;
  p->span_lo = UINT64_MAX;
  pthread_cond_init(&p->grown, NULL);
  sgm__lock_init(&p->lock, SGM_LOCK_TIER_VRAM + (int)params->tier);
  int rc = sgm__suballoc_create(SGM_DEVICE_ALIGN, &p->sa);
  if (rc != SGM_OK) goto out_free;
  if (params->growth && params->budget_bytes > 0) tier_vmm_setup(p);
  /* Reserve mode: the budget's physical memory as a pool of granules mapped
   * where blocks land (a device with the virtual-memory API), else one
   * contiguous chunk. */
  if (!params->growth && params->budget_bytes > 0 && tier_vmm_setup(p)) {
    rc = tier_vmm_pool_setup(p);
    if (rc != SGM_OK) {
      rc = tier_reserve_failed(params, rc);
      tier_vmm_teardown(p);
      goto out_sa;
    }
  } else if (!params->growth && params->budget_bytes > 0) {
    /* Reserve mode: the whole budget as one contiguous range, so that any
     * block up to the budget fits. */
    sgm_chunk c = {0};
    rc = params->ops->chunk_alloc(p, params->budget_bytes, &c);
    if (rc != SGM_OK) {
      rc = tier_reserve_failed(params, rc);
      goto out_sa;
    }
    sgm__lock_take(&p->lock);
    rc = tier_add_chunk_locked(p, &c);
    if (rc == SGM_OK) p->committed_bytes = c.bytes;
    sgm__lock_drop(&p->lock);
    if (rc != SGM_OK) {
      params->ops->chunk_free(p, &c);
      goto out_sa;
    }
  }
  *out = p;
  return SGM_OK;

out_sa:
  sgm__suballoc_destroy(p->sa);
out_free:
  pthread_cond_destroy(&p->grown);
  sgm__lock_destroy(&p->lock);
  free(p);
  return rc;
}

void sgm__tier_destroy(sgm_tier_pool *p) {
  if (!p) return;
  /* Threads' magazines: their blocks go to the bags; the threads free the
   * magazines themselves (they find them detached). */
  sgm__lock_take(&tier_registry_mu);
  while (p->mags) tier_mag_detach_registered(p->mags);
  sgm__lock_drop(&tier_registry_mu);
  sgm__tier_reclaim(p, NULL, SGM_RECLAIM_WAIT);
  /* Blocks sgm itself still holds (none when the context is clean). */
  for (size_t i = 0; i < TIER_SHARDS; i++) {
    tier_table *t = p->shards[i].table;
    for (size_t k = 0; t && k <= t->mask; k++) {
      for (tier_block *b = t->b[k], *next; b; b = next) {
        next = b->hnext;
        free(b->rec);
        free(b);
      }
    }
    while (t) {
      tier_table *r = t->retired;
      free(t);
      t = r;
    }
  }
  for (tier_block *b = p->spare, *next; b; b = next) {
    next = b->next;
    free(b);
  }
  for (tier_stream *s = p->streams, *next; s; s = next) {
    next = s->next;
    free(s);
  }
  for (size_t i = 0; i < p->n_events; i++) p->p.bops->event_destroy(p->p.be, p->events[i]);
  free(p->events);
  for (size_t i = 0; i < p->n_chunks; i++) p->p.ops->chunk_free(p, &p->chunks[i]);
  free(p->chunks);
  tier_vmm_teardown(p);
  sgm__suballoc_destroy(p->sa);
  pthread_cond_destroy(&p->grown);
  sgm__lock_destroy(&p->lock);
  free(p);
}

const sgm_tier_params *sgm__tier_params(const sgm_tier_pool *p) { return &p->p; }

/* ---- growth ---- */

/* Size of the next chunk for a block of need bytes (already aligned); 0 when
 * the budget has no room for it. Sets *dedicated. */
static uint64_t tier_next_chunk_locked(sgm_tier_pool *p, uint64_t need, bool *dedicated) {
  if (p->committed_bytes >= p->p.budget_bytes) return 0;
  uint64_t remaining = p->p.budget_bytes - p->committed_bytes;
  uint64_t initial = p->p.growth_chunk_bytes;
  uint64_t max = p->p.max_chunk_bytes > initial ? p->p.max_chunk_bytes : initial;
  uint64_t geo = p->n_geometric >= 40 ? max : initial << p->n_geometric;
  if (geo > max) geo = max;
  *dedicated = need > geo;
  uint64_t size = *dedicated ? sgm__align_up(need, TIER_DEDICATED_GRANULE) : geo;
  if (size > remaining) size = remaining & ~(uint64_t)(SGM_DEVICE_ALIGN - 1);
  return size >= need ? size : 0;
}

/* Detach wholly free chunks (growth mode) into *out (malloc'd); returns count.
 * With idle_ms != UINT64_MAX only chunks seen free since now_ms - idle_ms go;
 * the others that are free are stamped as seen free now. */
static size_t tier_detach_free_locked(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms,
                                      sgm_chunk **out) {
  *out = NULL;
  if (!p->p.growth) return 0;
  size_t n_free = 0;
  for (size_t i = 0; i < p->n_chunks; i++) {
    sgm_chunk *c = &p->chunks[i];
    if (!sgm__suballoc_range_is_free(p->sa, c->base)) {
      c->free_seen_ms = UINT64_MAX;
      continue;
    }
    if (idle_ms != UINT64_MAX) {
      if (c->free_seen_ms == UINT64_MAX || c->free_seen_ms > now_ms) {
        c->free_seen_ms = now_ms;
        continue;
      }
      if (now_ms - c->free_seen_ms < idle_ms) continue;
    }
    n_free++;
  }
  if (n_free == 0) return 0;
  sgm_chunk *list = malloc(n_free * sizeof *list);
  if (!list) return 0; /* trimming is best effort: keep the chunks */
  size_t k = 0, w = 0;
  for (size_t i = 0; i < p->n_chunks; i++) {
    sgm_chunk c = p->chunks[i];
    bool due = idle_ms == UINT64_MAX ||
               (c.free_seen_ms != UINT64_MAX && now_ms - c.free_seen_ms >= idle_ms);
    if (due && k < n_free && sgm__suballoc_try_remove_range(p->sa, c.base)) {
      list[k++] = c;
      if (!c.dedicated && p->n_geometric > 0) p->n_geometric--;
    } else {
      p->chunks[w++] = c;
    }
  }
  p->n_chunks = w;
  p->n_releasing += (unsigned)k; /* committed until tier_release_chunks drops them */
  *out = list;
  return k;
}

/* Give detached chunks back to the backend (lock not held); bytes returned. */
static uint64_t tier_release_chunks(sgm_tier_pool *p, sgm_chunk *list, size_t n) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; i++) {
    p->p.ops->chunk_free(p, &list[i]);
    bytes += list[i].bytes;
  }
  free(list);
  if (n) {
    sgm__lock_take(&p->lock);
    p->committed_bytes -= bytes;
    p->n_releasing -= (unsigned)n;
    /* Growers that found the budget held by these chunks look again. */
    pthread_cond_broadcast(&p->grown);
    sgm__lock_drop(&p->lock);
  }
  return bytes;
}

/* Take a chunk of `bytes` for a block of `need` bytes from the backend (pool
 * lock not held). When the driver refuses it for lack of memory (other
 * processes use the GPU too, or the budget is larger than the card's free
 * memory), the chunk is retried at half the size, rounded up to the 64 KiB
 * granule, down to the smallest chunk the block fits in: only a request the
 * device cannot hold even alone is an out-of-memory (and may then fall back
 * one tier down). out->bytes is the size taken. */
static int tier_take_chunk(sgm_tier_pool *p, uint64_t bytes, uint64_t need, sgm_chunk *out) {
  uint64_t floor = sgm__align_up(need, TIER_DEDICATED_GRANULE);
  if (floor > bytes) floor = bytes;
  for (;;) {
    int rc = p->p.ops->chunk_alloc(p, bytes, out);
    if (rc != SGM_ERR_NOMEM || bytes <= floor) return rc;
    uint64_t half = sgm__align_up(bytes / 2, TIER_DEDICATED_GRANULE);
    char a[32], b[32];
    sgm__log(p->p.verbose, 2, "%s: the device refused a %s chunk (%s); retrying with %s",
             sgm_tier_name(p->p.tier), sgm__fmt_bytes(bytes, a, sizeof a), sgm_last_error(),
             sgm__fmt_bytes(half > floor ? half : floor, b, sizeof b));
    bytes = half > floor ? half : floor;
  }
}

/* The message for a chunk the backend would not give. */
static int tier_backend_nomem_locked(sgm_tier_pool *p, uint64_t size) {
  char a[32], b[32], u[32], c[32];
  __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
  const char *name = sgm_tier_name(p->p.tier);
  return sgm__error_set(SGM_ERR_NOMEM,
                          "%s: cannot allocate %s: the device gave no new chunk (%s); "
                          "budget %s, holding %s in %llu blocks, committed %s",
                          name, sgm__fmt_bytes(size, a, sizeof a), sgm_last_error(),
                          sgm__fmt_bytes(p->p.budget_bytes, b, sizeof b),
                          sgm__fmt_bytes(p->held_bytes, u, sizeof u), (unsigned long long)p->n_blocks,
                          sgm__fmt_bytes(tier_committed(p), c, sizeof c));
}

int sgm__tier_explain_budget(sgm_tier_pool *p, uint64_t size) {
  char a[32], b[32], u[32], c[32], l[32], k[32];
  sgm__lock_take(&p->lock);
  sgm_suballoc_stats st;
  sgm__suballoc_stats(p->sa, &st);
  const char *name = sgm_tier_name(p->p.tier);
  uint64_t cached = p->bag_bytes;
  for (tier_mag *m = p->mags; m; m = m->next) cached += __atomic_load_n(&m->cached_bytes, __ATOMIC_RELAXED);
  uint64_t in_use = p->held_bytes > cached ? p->held_bytes - cached : 0;
  sgm__error_set(SGM_ERR_NOMEM,
                        "%s budget exhausted: cannot allocate %s; budget %s, in use %s in %llu "
                        "blocks (and %s cached for streams whose work is still pending), "
                        "committed %s, largest free block %s (free memory, or raise %s)",
                        name, sgm__fmt_bytes(size, a, sizeof a),
                        sgm__fmt_bytes(p->p.budget_bytes, b, sizeof b),
                        sgm__fmt_bytes(in_use, u, sizeof u), (unsigned long long)p->n_blocks,
                        sgm__fmt_bytes(cached, k, sizeof k),
                        sgm__fmt_bytes(tier_committed(p), c, sizeof c),
                        sgm__fmt_bytes(st.largest_free_bytes, l, sizeof l), p->p.limit_hint);
  sgm__lock_drop(&p->lock);
  return SGM_ERR_NOMEM;
}

/* Carve a block of need bytes (aligned) from the sub-allocator, growing when
 * allowed; its record is made LIVE with asked bytes on stream ref. Takes and
 * drops the pool lock. *out = NULL on failure (SGM__ERR_BUDGET: no message). */
static int tier_carve(sgm_tier_pool *p, uint64_t need, uint64_t asked, const sgm_stream_ref *ref,
                      tier_block **out) {
  *out = NULL;
  /* A full budget is answered without the lock: this is the first step of
   * every fallback allocation. A free racing with this read may leave room a
   * moment later; the block then lands one tier down, as it would have a
   * moment earlier. */
  if (need > __atomic_load_n(&p->head.room_bytes, __ATOMIC_RELAXED)) return SGM__ERR_BUDGET;
  bool trimmed = false, reclaimed = false;
  sgm__lock_take(&p->lock);
  for (int round = 0; round < TIER_MAX_GROW_ROUNDS; round++) {
    uint64_t off = 0, got = 0;
    /* Blocks never pass the budget, also when a lowered budget left more
     * committed than it allows. */
    if (need > p->p.budget_bytes - (p->held_bytes < p->p.budget_bytes ? p->held_bytes : p->p.budget_bytes))
      break;
    if (sgm__suballoc_try_alloc(p->sa, need, &off, &got)) {
      uint64_t unmapped = p->vmm_range ? tier_vmm_unmapped_locked(p, off, got) : 0;
      if (unmapped && !reclaimed && p->bag_bytes >= unmapped) {
        /* Expandable growth maps memory only when cached blocks the device
         * is done with could not cover it: give the streams' bags back (they
         * coalesce) and place the block again. Not the threads' magazines:
         * emptying them here, about once every 400 pairs, made every thread
         * carve under the pool lock again (a quarter of all pairs; two
         * threads ran at 0.16x the pairs/s of one, issue 10). A magazine
         * holds at most TIER_MAG_CLASS_BYTES per class and goes back at
         * sgm_trim, at thread exit, and when the budget is full. */
        uint64_t sz;
        sgm__suballoc_free(p->sa, off, &sz);
        reclaimed = true;
        sgm__lock_drop(&p->lock);
        tier_reclaim_some(p, false, SGM_RECLAIM_QUERY);
        sgm__lock_take(&p->lock);
        round--;
        continue;
      }
      /* A spare record, else a new one (only while the pool holds more
       * blocks than ever before). Lock-free readers may still be reading a
       * spare's tag and chain link: those two are written atomically. */
      tier_block *b = tier_spare_take_locked(p);
      if (!b) b = tier_block_new();
      if (b) {
        b->ptr = off;
        b->bytes = got;
        b->asked = asked;
        b->key = ref ? ref->key : 0;
        b->handle = ref ? ref->handle : NULL;
        b->cls = tier_class_exact(got);
        b->rec = NULL;
        b->n_rec = 0;
        b->next = NULL;
        __atomic_store_n(&b->tag, off | TIER_LIVE | (ref ? 0 : TIER_OWN), __ATOMIC_RELEASE);
      }
      if (!b || !tier_map_insert(p, b)) {
        uint64_t sz;
        sgm__suballoc_free(p->sa, off, &sz);
        if (b) tier_spare_put_locked(p, b);
        sgm__lock_drop(&p->lock);
        return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for block metadata");
      }
      p->held_bytes += got;
      p->n_blocks++;
      tier_update_room_locked(p);
      int vrc = p->vmm_range ? tier_vmm_back_locked(p, off, got) : SGM_OK;
      if (vrc != SGM_OK) {
        tier_release_block_locked(p, b); /* frees b and drops its granule references */
        tier_update_room_locked(p);
        sgm__lock_drop(&p->lock);
        tier_vmm_settle(p, true);
        return vrc;
      }
      sgm__lock_drop(&p->lock);
      if (reclaimed) tier_vmm_settle(p, true);
      *out = b;
      return SGM_OK;
    }
    /* One reserved range holds the whole budget: nothing to grow. */
    if (!p->p.growth || p->vmm_range) break;
    bool dedicated = false;
    uint64_t chunk = tier_next_chunk_locked(p, need, &dedicated);
    if (chunk == 0 && (p->n_growing > 0 || p->n_releasing > 0)) {
      /* The budget is held by chunks other threads are taking right now (one
       * of them may have room for this block) or giving back (a trim: their
       * bytes are committed until the backend has them). Wait, look again. */
      pthread_cond_wait(&p->grown, &p->lock.mu);
      round--;
      continue;
    }
    if (chunk == 0) {
      if (trimmed) break;
      /* No room in the budget for a new chunk: free chunks may be what holds
       * it (fragmentation across chunks); give them back and try once more. */
      trimmed = true;
      sgm_chunk *list;
      size_t n = tier_detach_free_locked(p, 0, UINT64_MAX, &list);
      if (n == 0) break;
      sgm__lock_drop(&p->lock);
      tier_release_chunks(p, list, n);
      sgm__lock_take(&p->lock);
      continue;
    }
    p->committed_bytes += chunk;
    if (!dedicated) p->n_geometric++;
    p->n_growing++;
    sgm__lock_drop(&p->lock);
    sgm_chunk c = {0};
    int rc = tier_take_chunk(p, chunk, need, &c);
    if (rc == SGM_OK) c.dedicated = dedicated;
    sgm__lock_take(&p->lock);
    p->n_growing--;
    pthread_cond_broadcast(&p->grown);
    if (rc == SGM_OK && c.bytes < chunk) {
      /* Got a smaller chunk: give back the budget reserved for the rest, and
       * do not let the geometric series climb while the device is short. */
      p->committed_bytes -= chunk - c.bytes;
      if (!dedicated && p->n_geometric > 0) p->n_geometric--;
      chunk = c.bytes;
    }
    if (rc == SGM_OK) {
      rc = tier_add_chunk_locked(p, &c);
      if (rc != SGM_OK) {
        p->committed_bytes -= chunk;
        if (!dedicated && p->n_geometric > 0) p->n_geometric--;
        sgm__lock_drop(&p->lock);
        p->p.ops->chunk_free(p, &c);
        return rc;
      }
      continue;
    }
    p->committed_bytes -= chunk;
    if (!dedicated && p->n_geometric > 0) p->n_geometric--;
    /* The message names the budget; the status stays the backend's. */
    if (rc == SGM_ERR_NOMEM) tier_backend_nomem_locked(p, need);
    sgm__lock_drop(&p->lock);
    return rc;
  }
  /* The budget is full. The message is composed only if the caller needs it
   * (sgm__tier_explain_budget): on the fallback path it does not, and
   * formatting it would cost more than the fallback allocation itself. */
  sgm__lock_drop(&p->lock);
  return SGM__ERR_BUDGET;
}

int sgm__tier_alloc(sgm_tier_pool *p, uint64_t size, sgm_devptr *out) {
  *out = 0;
  if (size == 0) return sgm__error_set(SGM_ERR_INVALID, "allocation of 0 bytes");
  if (size > UINT64_MAX - SGM_DEVICE_ALIGN)
    return sgm__error_set(SGM_ERR_INVALID, "allocation of %llu bytes overflows",
                          (unsigned long long)size);
  uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
  tier_block *b = NULL;
  int rc = tier_carve(p, need, need, NULL, &b);
  /* Memory the device has finished with comes back before anyone is demoted. */
  if ((rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM) && sgm__tier_has_cached(p) &&
      sgm__tier_reclaim(p, NULL, SGM_RECLAIM_QUERY))
    rc = tier_carve(p, need, need, NULL, &b);
  if (rc != SGM_OK) {
    __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
    return rc;
  }
  tier_count_used(p, (int64_t)need, 1, 1, 0);
  *out = b->ptr;
  return SGM_OK;
}

/* ---- the user's path ---- */

/* Hand a cached block out on stream ref (its state becomes LIVE). */
static inline sgm_devptr tier_hand_out(sgm_tier_pool *p, tier_mag *m, tier_block *b, uint64_t asked,
                                       const sgm_stream_ref *ref) {
  b->asked = asked;
  b->key = ref->key;
  b->handle = ref->handle;
  tier_block_set_state(b, TIER_LIVE);
  if (m) tier_mag_count(p, m, (int64_t)asked);
  else tier_count_used(p, (int64_t)asked, 1, 1, 0);
  return b->ptr;
}

/* A cached block of class cls (or exact size need for cls < 0) for stream ref:
 * the magazine, then the stream's bags (refilling the magazine). NULL when none. */
static tier_block *tier_take_cached(sgm_tier_pool *p, tier_mag *m, int cls, uint64_t need,
                                    const sgm_stream_ref *ref) {
  if (m && cls >= 0) {
    tier_spin_lock(&m->lock);
    unsigned n = m->n[cls];
    for (unsigned i = n; i-- > 0;) {
      tier_block *b = m->slot[cls][i];
      if (b->key != ref->key) continue;
      m->slot[cls][i] = m->slot[cls][n - 1];
      m->n[cls] = (uint8_t)(n - 1);
      __atomic_store_n(&m->cached_bytes, m->cached_bytes - b->bytes, __ATOMIC_RELAXED);
      tier_spin_unlock(&m->lock);
      return b;
    }
    tier_spin_unlock(&m->lock);
  }
  if (__atomic_load_n(&p->n_bagged, __ATOMIC_RELAXED) == 0) return NULL;
  sgm__lock_take(&p->lock);
  tier_stream *s = tier_stream_find_locked(p, ref->key);
  tier_block *b = NULL;
  if (s) {
    b = tier_bag_take(&s->open, cls, need);
    if (!b) b = tier_bag_take(&s->sealed, cls, need);
    if (b) {
      tier_bagged_add_locked(p, -1, -(int64_t)b->bytes);
      tier_stream_note_locked(s, cls, need);
    }
    /* Refill half the magazine from the open bag: the next allocations of
     * this class on this stream then take no lock. */
    if (b && m && cls >= 0) {
      unsigned want = tier_mag_cap(cls) / 2;
      tier_spin_lock(&m->lock);
      while (m->n[cls] < want && s->open.cls[cls]) {
        tier_block *x = tier_bag_take(&s->open, cls, 0);
        tier_bagged_add_locked(p, -1, -(int64_t)x->bytes);
        m->slot[cls][m->n[cls]++] = x;
        __atomic_store_n(&m->cached_bytes, m->cached_bytes + x->bytes, __ATOMIC_RELAXED);
      }
      tier_spin_unlock(&m->lock);
    }
  }
  sgm__lock_drop(&p->lock);
  return b;
}

/*
 * Placement of large blocks (issue 17, reserve mode): a cached block is a
 * hole the sub-allocator cannot see, so a block carved while the bags hold
 * memory goes elsewhere, the holes never coalesce with their free
 * neighbours, and the range fragments: on the idealloc traces the smallest
 * reserve budget was up to 1.67 x the peak live bytes, against 1.20 for the
 * bare sub-allocator. On a synchronous backend (the emulated device) nothing
 * is pending, so before a large block that no cached block fits is carved,
 * the bags go back to the sub-allocator (they coalesce); the threads'
 * magazines (small blocks) stay with their owners. Not on other backends:
 * there it would cost driver calls (a fence to record or query) on every
 * such allocation and take the blocks from the device-side transfer to other
 * streams, which comes first (DESIGN.md §8). Reserve mode on the
 * virtual-memory API (the budget a pool of granules in a range of twice its
 * size) does not depend on this: addresses no longer decide the budget, only
 * the granules blocks touch; as one chunk on CUDA the fragmentation stays
 * (docs/vmm.md).
 */
/* sgm__tier_has_cached, asked by the allocating thread whose magazine is m:
 * when m is the pool's only magazine, its own counter answers without the
 * pool lock. This is the second step of every fallback allocation (the
 * budget is full; is there cached memory to reclaim first?), which took the
 * lock each time to walk one empty magazine. A thread that registers a
 * magazine racing with this read makes it answer as a moment earlier. */
static bool tier_has_cached_for(sgm_tier_pool *p, tier_mag *m) {
  if (__atomic_load_n(&p->n_bagged, __ATOMIC_RELAXED)) return true;
  size_t n_mags = __atomic_load_n(&p->n_mags, __ATOMIC_RELAXED);
  if (n_mags == 0) return false;
  if (n_mags == 1 && m && __atomic_load_n(&m->pool, __ATOMIC_RELAXED) == p)
    return __atomic_load_n(&m->cached_bytes, __ATOMIC_RELAXED) != 0;
  return sgm__tier_has_cached(p);
}

/* sgm__tier_full_for calls made by this thread, any pool (tests): a
 * thread-local count, so that the fallback path writes no shared line for it. */
static _Thread_local uint64_t tier_full_checks;

bool sgm__tier_full_for(sgm_tier_pool *p, uint64_t size) {
  tier_full_checks++;
  if (size == 0 || size > UINT64_MAX - TIER_CLASS_MAX_BYTES) return false; /* alloc_on says why */
  uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
  int cls = tier_class(need);
  uint64_t block = cls >= 0 ? tier_class_bytes(cls) : need;
  if (block <= __atomic_load_n(&p->head.room_bytes, __ATOMIC_RELAXED)) return false;
  if (tier_has_cached_for(p, tier_mag_get(p))) return false;
  __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED); /* as sgm__tier_alloc_on counts it */
  return true;
}

int sgm__tier_alloc_on(sgm_tier_pool *p, uint64_t size, const sgm_stream_ref *ref, sgm_devptr *out) {
  *out = 0;
  if (sgm_unlikely(size == 0)) return sgm__error_set(SGM_ERR_INVALID, "allocation of 0 bytes");
  if (sgm_unlikely(size > UINT64_MAX - TIER_CLASS_MAX_BYTES))
    return sgm__error_set(SGM_ERR_INVALID, "allocation of %llu bytes overflows",
                          (unsigned long long)size);
  uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
  int cls = tier_class(need);
  uint64_t block = cls >= 0 ? tier_class_bytes(cls) : need;
  tier_mag *m = tier_mag_get(p);
  tier_block *b = tier_take_cached(p, m, cls, need, ref);
  if (sgm_likely(b != NULL)) {
    *out = tier_hand_out(p, m, b, need, ref);
    return SGM_OK;
  }
  /* A large block the caches could not serve is placed in the sub-allocator
   * only after the cached blocks the device is done with went back there. */
  bool placed_after_reclaim = cls < 0 && p->p.bops->synchronous &&
                              __atomic_load_n(&p->bag_bytes, __ATOMIC_RELAXED) != 0;
  if (placed_after_reclaim) tier_reclaim_some(p, false, SGM_RECLAIM_QUERY);
  int rc = tier_carve(p, block, need, ref, &b);
  /* Granules the returned blocks left free and the new one did not take. */
  if (placed_after_reclaim) tier_vmm_settle(p, true);
  /* Reclaiming cached memory comes before anything moves or falls back:
   * first other streams' caches through a device-side wait (one or two calls, no
   * host wait), then what the device has finished with (fences queried). */
  static const sgm_reclaim_mode order[] = {SGM_RECLAIM_TRANSFER, SGM_RECLAIM_QUERY};
  const tier_want want = {.cls = cls, .need = need};
  for (int k = 0; rc != SGM_OK && k < 2; k++) {
    if (rc != SGM__ERR_BUDGET && rc != SGM_ERR_NOMEM) break;
    if (!tier_has_cached_for(p, m)) break;
    if (tier_reclaim_settle(p, ref, order[k], &want) == 0) continue;
    b = tier_take_cached(p, m, cls, need, ref);
    if (b) {
      *out = tier_hand_out(p, m, b, need, ref);
      return SGM_OK;
    }
    rc = tier_carve(p, block, need, ref, &b);
  }
  /* Counted per attempt, as sgm__tier_alloc counts: a request retried after
   * demotions may count more than once. */
  if (rc != SGM_OK) {
    __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
    return rc;
  }
  /* Fresh from the sub-allocator: counted as handed out (state is LIVE). */
  if (m) tier_mag_count(p, m, (int64_t)need);
  else tier_count_used(p, (int64_t)need, 1, 1, 0);
  *out = b->ptr;
  return SGM_OK;
}

int sgm__tier_free(sgm_tier_pool *p, sgm_devptr ptr, uint64_t *size_out) {
  *size_out = 0;
  tier_block *b = tier_map_take_live(p, ptr, true);
  /* Not ours: say so without a message; the caller tries the next tier and
   * composes the message only if no tier owns the pointer. */
  if (!b) return SGM_ERR_INVALID;
  uint64_t asked = b->asked;
  sgm__lock_take(&p->lock);
  tier_release_block_locked(p, b);
  tier_update_room_locked(p);
  sgm__lock_drop(&p->lock);
  tier_vmm_settle(p, false);
  tier_count_used(p, -(int64_t)asked, -1, 0, 1);
  *size_out = asked;
  return SGM_OK;
}

/* A free of a block named by sgm_record_stream: an event on every recorded
 * stream, and the block waits in the deferred list until all have completed. */
static int tier_free_recorded(sgm_tier_pool *p, tier_block *b) {
  tier_deferred *d = calloc(1, sizeof *d);
  void **evs = calloc(b->n_rec, sizeof *evs);
  int rc = SGM_OK;
  if (!d || !evs) {
    rc = sgm__error_set(SGM_ERR_NOMEM, "out of host memory freeing a block used by other streams");
    goto out_fail;
  }
  for (size_t i = 0; i < b->n_rec; i++) {
    void *ev = tier_event_get(p);
    if (!ev) {
      rc = SGM_ERR_BACKEND; /* the backend's message says why */
      goto out_fail;
    }
    evs[d->n_events++] = ev;
    rc = p->p.bops->event_record_on(p->p.be, ev, &b->rec[i]);
    if (rc != SGM_OK) goto out_fail;
  }
  d->b = b;
  d->events = evs;
  free(b->rec);
  b->rec = NULL;
  b->n_rec = 0;
  sgm__lock_take(&p->lock);
  d->next = p->deferred;
  p->deferred = d;
  tier_bagged_add_locked(p, 1, (int64_t)b->bytes);
  sgm__lock_drop(&p->lock);
  return SGM_OK;

out_fail:
  /* Without the events nobody can tell when the other streams are done with
   * the block: it stays live (the caller's free failed). */
  if (d) for (size_t i = 0; i < d->n_events; i++) tier_event_put(p, evs[i]);
  free(evs);
  free(d);
  tier_block_set_state(b, TIER_LIVE);
  return rc;
}

int sgm__tier_free_on(sgm_tier_pool *p, sgm_devptr ptr, const sgm_stream_ref *ref) {
  tier_block *b = tier_map_take_live(p, ptr, false);
  if (sgm_unlikely(!b)) return SGM_ERR_INVALID;
  uint64_t asked = b->asked;
  b->key = ref->key;
  b->handle = ref->handle;
  tier_mag *m = tier_mag_get(p);
  if (sgm_unlikely(b->rec != NULL)) {
    if (p->p.bops->synchronous) {
      free(b->rec);
      b->rec = NULL;
      b->n_rec = 0;
    } else {
      int rc = tier_free_recorded(p, b);
      if (rc != SGM_OK) return rc;
      if (m) tier_mag_count(p, m, -(int64_t)asked);
      else tier_count_used(p, -(int64_t)asked, -1, 0, 1);
      return SGM_OK;
    }
  }
  if (sgm_likely(m && b->cls >= 0)) {
    int c = b->cls;
    unsigned cap = tier_mag_cap(c);
    tier_block *spill[TIER_MAG_SLOTS];
    unsigned n_spill = 0;
    tier_spin_lock(&m->lock);
    if (m->n[c] >= cap) {
      /* Full: the older half goes down to the bags (under the pool lock,
       * taken after this lock is dropped). */
      n_spill = cap / 2;
      memcpy(spill, m->slot[c], n_spill * sizeof *spill);
      memmove(m->slot[c], m->slot[c] + n_spill, (m->n[c] - n_spill) * sizeof *spill);
      m->n[c] = (uint8_t)(m->n[c] - n_spill);
      uint64_t spilled = 0;
      for (unsigned i = 0; i < n_spill; i++) spilled += spill[i]->bytes;
      __atomic_store_n(&m->cached_bytes, m->cached_bytes - spilled, __ATOMIC_RELAXED);
    }
    m->slot[c][m->n[c]++] = b;
    __atomic_store_n(&m->cached_bytes, m->cached_bytes + b->bytes, __ATOMIC_RELAXED);
    tier_spin_unlock(&m->lock);
    if (n_spill) {
      sgm__lock_take(&p->lock);
      for (unsigned i = 0; i < n_spill; i++) tier_bag_add_locked(p, spill[i]);
      sgm__lock_drop(&p->lock);
    }
  } else {
    sgm__lock_take(&p->lock);
    tier_bag_add_locked(p, b);
    sgm__lock_drop(&p->lock);
  }
  if (m) tier_mag_count(p, m, -(int64_t)asked);
  else tier_count_used(p, -(int64_t)asked, -1, 0, 1);
  return SGM_OK;
}

int sgm__tier_record_stream(sgm_tier_pool *p, sgm_devptr ptr, const sgm_stream_ref *ref) {
  /* BUSY keeps a concurrent free (a caller's race) from reading the list
   * while it is rewritten. */
  tier_block *b = tier_map_busy_live(p, ptr);
  if (!b) return SGM_ERR_INVALID;
  int rc = SGM_OK;
  if (ref->key != b->key) {
    bool known = false;
    for (size_t i = 0; i < b->n_rec && !known; i++) known = b->rec[i].key == ref->key;
    if (!known) {
      sgm_stream_ref *n = realloc(b->rec, (b->n_rec + 1) * sizeof *n);
      if (!n) {
        rc = SGM_ERR_NOMEM;
      } else {
        n[b->n_rec++] = *ref;
        b->rec = n;
      }
    }
  }
  tier_map_unbusy(b);
  if (rc == SGM_ERR_NOMEM)
    return sgm__error_set(SGM_ERR_NOMEM, "sgm_record_stream: out of host memory");
  return rc;
}

bool sgm__tier_has_cached(sgm_tier_pool *p) {
  if (__atomic_load_n(&p->n_bagged, __ATOMIC_RELAXED)) return true;
  if (!__atomic_load_n(&p->n_mags, __ATOMIC_RELAXED)) return false;
  bool any = false;
  sgm__lock_take(&p->lock);
  for (tier_mag *m = p->mags; m && !any; m = m->next)
    any = __atomic_load_n(&m->cached_bytes, __ATOMIC_RELAXED) != 0;
  sgm__lock_drop(&p->lock);
  return any;
}

/* Is ptr a LIVE block of p (with own_only: one sgm took for itself)? */
static bool tier_owns_live(sgm_tier_pool *p, sgm_devptr ptr, bool own_only) {
  tier_block *b = tier_map_lookup(p, ptr);
  if (!b) return false;
  uint64_t tag = tier_tag_of(b);
  return (tag & ~TIER_TAG_FLAGS) == ptr && (tag & TIER_TAG_STATE) == TIER_LIVE &&
         (!own_only || (tag & TIER_OWN));
}

bool sgm__tier_owns(sgm_tier_pool *p, sgm_devptr ptr) { return tier_owns_live(p, ptr, false); }

bool sgm__tier_owns_own(sgm_tier_pool *p, sgm_devptr ptr) { return tier_owns_live(p, ptr, true); }

/* ---- reclaim ---- */

enum { TIER_JOB_SEAL, TIER_JOB_FENCE, TIER_JOB_DEFERRED, TIER_JOB_TRANSFER, TIER_JOB_FENCE_WAIT };

/* Work a reclaim does without the pool lock on one stream or deferred free. */
typedef struct tier_job {
  int kind;                    /* TIER_JOB_* */
  tier_stream *s;              /* the stream (SEAL, FENCE, TRANSFER, FENCE_WAIT) */
  tier_deferred *d;            /* the deferred free (DEFERRED) */
  sgm_stream_ref ref;          /* the stream, copied under the lock */
  void *ev;                    /* the event recorded or queried */
  int done;                    /* 1: the work before the event has completed; 0: not (yet); <0: error */
  tier_bag bag;                /* TRANSFER, FENCE_WAIT, SEAL: the blocks moving to the taker */
  const tier_want *want;       /* transfers: which blocks the taker takes (NULL: all) */
} tier_job;

/* Did the work before ev complete? Query, or in WAIT mode wait (a failed wait
 * counts as done: at destroy the driver has nothing more to say about it). */
static int tier_event_done(sgm_tier_pool *p, void *ev, sgm_reclaim_mode mode) {
  if (mode == SGM_RECLAIM_WAIT) {
    if (p->p.bops->event_wait(p->p.be, ev) != SGM_OK)
      sgm__log(p->p.verbose, 1, "%s: waiting for a stream's work failed (%s); its cached blocks "
               "are returned anyway", sgm_tier_name(p->p.tier), sgm_last_error());
    return 1;
  }
  int q = p->p.bops->event_query(p->p.be, ev);
  if (q < 0)
    sgm__log(p->p.verbose, 1, "%s: querying a stream's fence failed (%s); its cached blocks stay "
             "with the stream", sgm_tier_name(p->p.tier), sgm_last_error());
  return q;
}

/* The job array of a reclaim pass, counted under p->lock: zeroed room for
 * n_jobs, or NULL with the lock dropped (nothing to do, or out of memory:
 * the pass is skipped, and the caches stay for the next one). */
static tier_job *tier_jobs_alloc_locked(sgm_tier_pool *p, size_t n_jobs) {
  tier_job *jobs = n_jobs ? calloc(n_jobs, sizeof *jobs) : NULL;
  if (!jobs) sgm__lock_drop(&p->lock);
  return jobs;
}

/* Seal and fence every stream's cache, and return to the sub-allocator what
 * the device has finished with (QUERY) or everything (WAIT). */
static size_t tier_reclaim_fences(sgm_tier_pool *p, sgm_reclaim_mode mode) {
  size_t n_done = 0;
  sgm__lock_take(&p->lock);
  size_t n_jobs = 0;
  for (tier_stream *s = p->streams; s; s = s->next) n_jobs += !s->busy && (s->fence || s->open.n);
  for (tier_deferred *d = p->deferred; d; d = d->next) n_jobs += !d->busy;
  tier_job *jobs = tier_jobs_alloc_locked(p, n_jobs);
  if (!jobs) return 0;
  size_t k = 0;
  for (tier_stream *s = p->streams; s; s = s->next) {
    if (s->busy || (!s->fence && !s->open.n)) continue;
    s->busy = true;
    jobs[k].s = s;
    jobs[k].ref = s->ref;
    if (s->fence) {
      jobs[k].kind = TIER_JOB_FENCE;
      jobs[k].ev = s->fence;
    } else {
      /* Everything freed on s so far is covered by an event recorded now. */
      jobs[k].kind = TIER_JOB_SEAL;
      tier_bag_merge(&s->sealed, &s->open);
    }
    k++;
  }
  for (tier_deferred *d = p->deferred; d; d = d->next) {
    if (d->busy) continue;
    d->busy = true;
    jobs[k].kind = TIER_JOB_DEFERRED;
    jobs[k].d = d;
    k++;
  }
  sgm__lock_drop(&p->lock);

  for (size_t i = 0; i < n_jobs; i++) {
    tier_job *j = &jobs[i];
    if (j->kind == TIER_JOB_SEAL) {
      j->ev = tier_event_get(p);
      int rrc = j->ev ? p->p.bops->event_record_on(p->p.be, j->ev, &j->ref) : SGM_ERR_BACKEND;
      if (rrc != SGM_OK) {
        /* A capturing stream (BUSY) keeps its cache until the capture ends. */
        sgm__log(p->p.verbose, rrc == SGM_ERR_BUSY ? 3 : 1, "%s: cannot fence a stream's cache "
                 "(%s); it stays with the stream", sgm_tier_name(p->p.tier), sgm_last_error());
        j->done = -1;
        continue;
      }
      j->done = tier_event_done(p, j->ev, mode);
    } else if (j->kind == TIER_JOB_FENCE) {
      j->done = tier_event_done(p, j->ev, mode);
    } else {
      j->done = 1;
      for (size_t e = 0; e < j->d->n_events && j->done == 1; e++)
        j->done = tier_event_done(p, j->d->events[e], mode);
    }
  }

  sgm__lock_take(&p->lock);
  for (size_t i = 0; i < n_jobs; i++) {
    tier_job *j = &jobs[i];
    if (j->kind == TIER_JOB_DEFERRED) {
      tier_deferred *d = j->d;
      d->busy = false;
      if (j->done != 1) continue;
      for (tier_deferred **pp = &p->deferred; *pp; pp = &(*pp)->next)
        if (*pp == d) {
          *pp = d->next;
          break;
        }
      for (size_t e = 0; e < d->n_events; e++) tier_event_put_locked(p, d->events[e]);
      tier_bagged_add_locked(p, -1, -(int64_t)d->b->bytes);
      /* The recorded streams are done; the stream it was freed on may not be. */
      tier_bag_add_locked(p, d->b);
      free(d->events);
      free(d);
      n_done++;
      continue;
    }
    tier_stream *s = j->s;
    s->busy = false;
    if (j->kind == TIER_JOB_SEAL) {
      if (j->done < 0) {
        tier_bag_merge(&s->open, &s->sealed);
        if (j->ev) tier_event_put_locked(p, j->ev);
        continue;
      }
      s->fence = j->ev;
      s->crossed_fence = NULL;
    }
    if (j->done == 1) {
      n_done += s->sealed.n;
      tier_bagged_add_locked(p, -(int64_t)s->sealed.n, -(int64_t)s->sealed.bytes);
      tier_bag_release_locked(p, &s->sealed);
      tier_event_put_locked(p, s->fence);
      s->fence = NULL;
    }
  }
  tier_update_room_locked(p);
  sgm__lock_drop(&p->lock);
  free(jobs);
  return n_done;
}


/* Does g hold a block w takes (any block when w is NULL)? */
static bool tier_bag_fits(const tier_bag *g, const tier_want *w) {
  if (!w || g->n == 0) return g->n != 0;
  if (w->cls >= 0 && g->cls[w->cls]) return true;
  uint64_t lo = w->cls >= 0 ? tier_class_bytes(w->cls) : w->need;
  uint64_t hi = lo + (lo >> TIER_LARGE_SLACK_SHIFT);
  for (const tier_block *b = g->large; b; b = b->next)
    if (b->bytes >= lo && b->bytes <= hi) return true;
  return false;
}

/* Move the blocks of src that w takes (all when w is NULL) into dst: those
 * serving the request, and every block of w's other sizes; how many. */
static size_t tier_bag_move_fits(tier_bag *src, tier_bag *dst, const tier_want *w) {
  size_t n = 0;
  if (!w) {
    n = src->n;
    tier_bag_merge(dst, src);
    return n;
  }
  for (tier_block *b; (b = tier_bag_take(src, w->cls, w->need)) != NULL; n++) tier_bag_push(dst, b);
  for (uint64_t bits = w->also_cls; bits; bits &= bits - 1)
    for (int c = __builtin_ctzll(bits); src->cls[c]; n++) tier_bag_push(dst, tier_bag_take(src, c, 0));
  for (int i = 0; i < TIER_RECENT_LARGE; i++)
    for (tier_block *b; w->also_large[i] && (b = tier_bag_take(src, -1, w->also_large[i])) != NULL; n++)
      tier_bag_push(dst, b);
  return n;
}

/* What a transfer to taker moves (written to *out, returned): w, and the
 * sizes the taker took from its own caches in its current and last period
 * (tier_stream_note_locked); a taker with no record, or w NULL (everything),
 * as it is. Starts the taker's next period. Pool lock held. */
static const tier_want *tier_want_recent_locked(sgm_tier_pool *p, const sgm_stream_ref *taker,
                                                const tier_want *w, tier_want *out) {
  tier_stream *t = tier_stream_find_locked(p, taker->key);
  if (!w || !t) return w;
  *out = *w;
  out->also_cls = t->recent_cls[0] | t->recent_cls[1];
  for (int i = 0; i < TIER_RECENT_LARGE; i++) {
    const tier_recent_large *r = &t->recent_large[i];
    out->also_large[i] = r->need && t->period - r->period <= 1 ? r->need : 0;
  }
  t->recent_cls[1] = t->recent_cls[0];
  t->recent_cls[0] = 0;
  t->period++;
  return out;
}

/*
 * Hand other streams' cached blocks that serve the taker's request (w) to
 * taker, ordered on the device after the owner's work; the host never waits.
 * An owner holding none of them is left alone (no driver call). Per owner s:
 *  - FENCE_WAIT: fitting blocks sealed under s's fence (an event recorded on
 *    s after their frees, while s did not capture: the idle tick, an
 *    allocation that did not fit, sgm_trim, or an earlier transfer) need only
 *    the taker's side: stream_wait_event, the taker's capture check and one
 *    wait (2 calls, whatever the streams' flags). The fence stays while it
 *    covers blocks s still holds.
 *  - SEAL: else the backend orders the streams (stream_transfer_fence, 1 to 4
 *    calls, docs/streams.md "Why two calls"); when that recorded an event
 *    after s's work, the event becomes s's fence over every block s holds, so
 *    the blocks the taker does not take now cross later in 2 calls, and s
 *    keeps reusing them with none.
 *  - TRANSFER: s's fence is being recorded or queried by another thread: the
 *    fitting blocks cross with stream_transfer and the event is pooled again.
 */
static size_t tier_reclaim_transfer(sgm_tier_pool *p, const sgm_stream_ref *taker,
                                    const tier_want *w) {
  size_t n_done = 0;
  sgm__lock_take(&p->lock);
  size_t n_jobs = 0;
  for (tier_stream *s = p->streams; s; s = s->next)
    n_jobs += s->ref.key != taker->key && (tier_bag_fits(&s->open, w) || tier_bag_fits(&s->sealed, w));
  tier_job *jobs = tier_jobs_alloc_locked(p, n_jobs);
  if (!jobs) return 0;
  tier_want recent;
  w = tier_want_recent_locked(p, taker, w, &recent);
  size_t k = 0;
  for (tier_stream *s = p->streams; s && k < n_jobs; s = s->next) {
    if (s->ref.key == taker->key) continue;
    bool fit_open = tier_bag_fits(&s->open, w), fit_sealed = tier_bag_fits(&s->sealed, w);
    if (!fit_open && !fit_sealed) continue;
    tier_job *j = &jobs[k++];
    j->s = s;
    j->ref = s->ref;
    j->want = w;
    if (s->busy) {
      j->kind = TIER_JOB_TRANSFER;
      tier_bag_move_fits(&s->open, &j->bag, w);
      tier_bag_move_fits(&s->sealed, &j->bag, w);
    } else if (fit_sealed && s->fence) {
      j->kind = TIER_JOB_FENCE_WAIT;
      j->ev = s->fence;
      s->busy = true;
      /* A taker back under the fence it crossed under before is in a burst:
       * it takes the rest, so that the burst costs the owner's side once and
       * this taker's side twice, not once per size (docs/streams.md). */
      if (s->crossed_fence == s->fence && s->crossed_to == taker->key) j->want = NULL;
      tier_bag_move_fits(&s->sealed, &j->bag, j->want);
    } else {
      /* Everything freed on s so far: the record comes after all of it. */
      j->kind = TIER_JOB_SEAL;
      s->busy = true;
      tier_bag_merge(&j->bag, &s->open);
    }
  }
  sgm__lock_drop(&p->lock);

  const sgm_backend_ops *ops = p->p.bops;
  for (size_t i = 0; i < k; i++) {
    tier_job *j = &jobs[i];
    if (j->kind == TIER_JOB_FENCE_WAIT) {
      j->done = ops->stream_wait_event(p->p.be, taker, j->ev) == SGM_OK;
      if (!j->done)
        sgm__log(p->p.verbose, 2, "%s: cannot order a stream after another's fence (%s); their "
                 "cached blocks stay apart", sgm_tier_name(p->p.tier), sgm_last_error());
      continue;
    }
    j->ev = tier_event_get(p);
    bool fenced = false;
    if (j->ev && j->kind == TIER_JOB_SEAL && ops->stream_transfer_fence)
      j->done = ops->stream_transfer_fence(p->p.be, j->ev, &j->ref, taker, &fenced) == SGM_OK;
    else
      j->done = j->ev && ops->stream_transfer(p->p.be, j->ev, &j->ref, taker) == SGM_OK;
    if (!j->done)
      sgm__log(p->p.verbose, 2, "%s: cannot order a stream after another (%s); their cached "
               "blocks stay apart", sgm_tier_name(p->p.tier), sgm_last_error());
    /* Not kept as a fence: the wait captured the recording, the event may be
     * recorded again. */
    if (!fenced && j->ev) {
      tier_event_put(p, j->ev);
      j->ev = NULL;
    }
  }

  sgm__lock_take(&p->lock);
  tier_stream *t = tier_stream_get_locked(p, taker);
  for (size_t i = 0; i < k; i++) {
    tier_job *j = &jobs[i];
    tier_stream *s = j->s;
    bool moved = j->done && t;
    if (j->kind == TIER_JOB_TRANSFER) {
      tier_bag_merge(moved ? &t->open : &s->open, &j->bag);
      n_done += moved ? j->bag.n : 0;
    } else if (j->kind == TIER_JOB_FENCE_WAIT || j->ev) {
      /* The fence (s's, or the one just recorded) covers what s holds sealed. */
      s->busy = false;
      if (j->kind == TIER_JOB_SEAL) {
        if (s->fence) tier_event_put_locked(p, s->fence);
        s->fence = j->ev;
        s->crossed_fence = NULL;
      }
      tier_bag_merge(&s->sealed, &j->bag);
      if (moved) {
        n_done += tier_bag_move_fits(&s->sealed, &t->open, j->want);
        s->crossed_fence = s->fence;
        s->crossed_to = taker->key;
      }
      if (!s->sealed.n) {
        tier_event_put_locked(p, s->fence);
        s->fence = NULL;
        s->crossed_fence = NULL;
      }
    } else {
      /* Nothing recorded on s: what the taker does not take stays open. */
      s->busy = false;
      if (moved) n_done += tier_bag_move_fits(&j->bag, &t->open, j->want);
      tier_bag_merge(&s->open, &j->bag);
    }
  }
  sgm__lock_drop(&p->lock);
  free(jobs);
  return n_done;
}

size_t sgm__tier_reclaim(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode) {
  return tier_reclaim_settle(p, taker, mode, NULL);
}

/* sgm__tier_reclaim whose transfer takes only the blocks w serves (NULL: all). */
static size_t tier_reclaim_settle(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode,
                                  const tier_want *w) {
  size_t n = tier_reclaim_want(p, taker, mode, w);
  tier_vmm_settle(p, true);
  return n;
}

/* sgm__tier_reclaim without unmapping the granules it frees (the carve that
 * calls it is about to place a block there). */
static size_t tier_reclaim_ex(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode) {
  return tier_reclaim_want(p, taker, mode, NULL);
}

/* tier_reclaim_ex whose transfer takes only the blocks w serves (NULL: all). */
static size_t tier_reclaim_want(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode,
                                const tier_want *w) {
  if (mode == SGM_RECLAIM_TRANSFER) {
    /* A synchronous backend gave every cached block back in the drain. */
    size_t n = tier_reclaim_some(p, true, mode);
    return p->p.bops->synchronous || !taker ? n : tier_reclaim_transfer(p, taker, w);
  }
  return tier_reclaim_some(p, true, mode);
}

/* With mags, drain every thread's magazine into its stream's bag; then give
 * back what the device is done with (mode QUERY or WAIT; TRANSFER stops
 * after the drain, where a synchronous backend has given everything back). */
static size_t tier_reclaim_some(sgm_tier_pool *p, bool mags, sgm_reclaim_mode mode) {
  size_t n_done = 0;
  sgm__lock_take(&p->lock);
  for (tier_mag *m = mags ? p->mags : NULL; m; m = m->next) {
    tier_spin_lock(&m->lock);
    tier_mag_drain_locked(p, m);
    tier_spin_unlock(&m->lock);
  }
  if (p->p.bops->synchronous) {
    n_done = tier_release_bags_locked(p);
    sgm__lock_drop(&p->lock);
    return n_done;
  }
  sgm__lock_drop(&p->lock);
  if (mode == SGM_RECLAIM_TRANSFER) return 0;
  n_done += tier_reclaim_fences(p, mode);
  if (mode == SGM_RECLAIM_WAIT) {
    /* The first round sealed what was open; the second waits for the fences
     * of streams that already had one. */
    n_done += tier_reclaim_fences(p, mode);
    n_done += tier_reclaim_fences(p, mode);
  }
  return n_done;
}

/* ---- trimming and budget ---- */

uint64_t sgm__tier_trim(sgm_tier_pool *p) {
  if (sgm__tier_has_cached(p)) tier_reclaim_ex(p, NULL, SGM_RECLAIM_WAIT);
  /* Reserve mode's pool keeps its granules: a trim returns nothing. */
  if (p->vmm_pool) return 0;
  if (p->vmm_range) return tier_vmm_unmap_free(p, 0, UINT64_MAX);
  sgm_chunk *list;
  sgm__lock_take(&p->lock);
  size_t n = tier_detach_free_locked(p, 0, UINT64_MAX, &list);
  sgm__lock_drop(&p->lock);
  return n ? tier_release_chunks(p, list, n) : 0;
}

uint64_t sgm__tier_idle_trim(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms) {
  if (idle_ms == 0 || idle_ms == UINT64_MAX || p->vmm_pool) return 0;
  if (p->vmm_range) return tier_vmm_unmap_free(p, now_ms, idle_ms);
  sgm_chunk *list;
  sgm__lock_take(&p->lock);
  size_t n = tier_detach_free_locked(p, now_ms, idle_ms, &list);
  sgm__lock_drop(&p->lock);
  return n ? tier_release_chunks(p, list, n) : 0;
}

void sgm__tier_set_budget(sgm_tier_pool *p, uint64_t budget_bytes) {
  sgm__lock_take(&p->lock);
  p->p.budget_bytes = budget_bytes;
  tier_update_room_locked(p);
  bool over = p->committed_bytes > budget_bytes;
  if (over) p->budget_lowered = true;
  sgm__lock_drop(&p->lock);
  /* Reserve mode's pool: mapping stops at the new budget and free granules
   * are unmapped; the pool itself stays taken until destroy (not built: its
   * granules past the budget going back to the driver). */
  if (over && p->vmm_pool) tier_vmm_unmap_free(p, 0, UINT64_MAX);
  else if (over) sgm__tier_trim(p);
}

size_t sgm__tier_chunks(sgm_tier_pool *p, sgm_chunk *out, size_t max) {
  sgm__lock_take(&p->lock);
  size_t n = p->n_chunks;
  for (size_t i = 0; i < n && i < max; i++) out[i] = p->chunks[i];
  sgm__lock_drop(&p->lock);
  return n;
}

bool sgm__tier_chunk_of(sgm_tier_pool *p, sgm_devptr ptr, sgm_chunk *out) {
  bool found = false;
  sgm__lock_take(&p->lock);
  for (size_t i = 0; i < p->n_chunks && !found; i++) {
    const sgm_chunk *c = &p->chunks[i];
    if (ptr >= c->base && ptr - c->base < c->bytes) {
      *out = *c;
      found = true;
    }
  }
  sgm__lock_drop(&p->lock);
  return found;
}

/* ---- bytes placed outside the pool (managed blocks) ---- */

int sgm__tier_charge(sgm_tier_pool *p, uint64_t bytes) {
  bool trimmed = false;
  sgm__lock_take(&p->lock);
  for (;;) {
    /* Chunks being taken are committed already: no overshoot past them. */
    bool fits = p->committed_bytes <= p->p.budget_bytes && bytes <= p->p.budget_bytes - p->committed_bytes;
    if (fits) {
      p->committed_bytes += bytes;
      p->held_bytes += bytes;
      p->external_bytes += bytes;
      tier_update_room_locked(p);
      sgm__lock_drop(&p->lock);
      return SGM_OK;
    }
    if (trimmed) break;
    trimmed = true;
    /* Cached blocks and wholly free chunks hold budget nobody uses: give them
     * back and look once more. */
    sgm__lock_drop(&p->lock);
    if (sgm__tier_has_cached(p)) sgm__tier_reclaim(p, NULL, SGM_RECLAIM_QUERY);
    if (p->vmm_range) tier_vmm_unmap_free(p, 0, UINT64_MAX); /* free granules hold it too */
    sgm_chunk *list;
    sgm__lock_take(&p->lock);
    size_t n = tier_detach_free_locked(p, 0, UINT64_MAX, &list);
    sgm__lock_drop(&p->lock);
    if (n) tier_release_chunks(p, list, n);
    sgm__lock_take(&p->lock);
  }
  sgm__lock_drop(&p->lock);
  return SGM__ERR_BUDGET;
}

void sgm__tier_uncharge(sgm_tier_pool *p, uint64_t bytes) {
  sgm__lock_take(&p->lock);
  sgm_assert(p->external_bytes >= bytes);
  p->committed_bytes -= bytes;
  p->held_bytes -= bytes;
  p->external_bytes -= bytes;
  tier_update_room_locked(p);
  pthread_cond_broadcast(&p->grown);
  sgm__lock_drop(&p->lock);
}

uint64_t sgm__tier_charged(sgm_tier_pool *p) {
  sgm__lock_take(&p->lock);
  uint64_t n = p->external_bytes;
  sgm__lock_drop(&p->lock);
  return n;
}

/* ---- stats and checks ---- */

uint64_t sgm__tier_lock_takes(const sgm_tier_pool *p) { return sgm__lock_takes(&p->lock); }

uint64_t sgm__tier_full_checks(void) { return tier_full_checks; }

uint64_t sgm__tier_map_writes(const sgm_tier_pool *p) {
  uint64_t n = 0;
  for (size_t i = 0; i < TIER_SHARDS; i++) n += __atomic_load_n(&p->shards[i].n_writes, __ATOMIC_RELAXED);
  return n;
}

void sgm__tier_stats(sgm_tier_pool *p, sgm_tier_stats *out) {
  memset(out, 0, sizeof *out);
  sgm__lock_take(&p->lock);
  out->budget_bytes = p->p.budget_bytes;
  out->committed_bytes = tier_committed(p);
  out->n_chunks = p->n_chunks + p->n_releasing; /* committed counts those being returned */
  /* Expandable growth: every granule is its own allocation of the driver's
   * (reserve mode: every granule of the pool). */
  if (p->vmm_range) out->n_chunks = (tier_committed(p) - p->external_bytes) >> p->vmm_shift;
  int64_t used = (int64_t)__atomic_load_n(&p->used_bytes, __ATOMIC_RELAXED);
  int64_t live = __atomic_load_n(&p->n_live, __ATOMIC_RELAXED);
  uint64_t allocs = __atomic_load_n(&p->n_allocs, __ATOMIC_RELAXED);
  uint64_t frees = __atomic_load_n(&p->n_frees, __ATOMIC_RELAXED);
  uint64_t cached = p->bag_bytes;
  for (tier_mag *m = p->mags; m; m = m->next) {
    used += __atomic_load_n(&m->d_used, __ATOMIC_RELAXED);
    live += __atomic_load_n(&m->d_live, __ATOMIC_RELAXED);
    allocs += __atomic_load_n(&m->n_allocs, __ATOMIC_RELAXED);
    frees += __atomic_load_n(&m->n_frees, __ATOMIC_RELAXED);
    cached += __atomic_load_n(&m->cached_bytes, __ATOMIC_RELAXED);
  }
  sgm__lock_drop(&p->lock);
  /* Counts of several threads are summed unordered: clamp a transient minus. */
  out->used_bytes = used > 0 ? (uint64_t)used : 0;
  out->n_live = live > 0 ? (uint64_t)live : 0;
  uint64_t peak = __atomic_load_n(&p->peak_used_bytes, __ATOMIC_RELAXED);
  out->peak_used_bytes = peak > out->used_bytes ? peak : out->used_bytes;
  out->n_allocs = allocs;
  out->n_frees = frees;
  out->n_failed = __atomic_load_n(&p->n_failed, __ATOMIC_RELAXED);
  out->cached_bytes = cached;
}

/* Expandable growth: the one range is the sub-allocator's only range;
 * committed is the granules mapped or being mapped or unmapped; every
 * granule's references are the blocks (live or cached) touching it; the free
 * mapped count matches. */
static bool tier_vmm_check_locked(sgm_tier_pool *p, const sgm_suballoc_stats *st) {
  const char *name = sgm_tier_name(p->p.tier);
  size_t n = (size_t)(p->vmm_bytes >> p->vmm_shift);
  if (st->capacity_bytes != p->vmm_bytes || st->n_ranges != 1 || p->n_chunks != 0)
    return !sgm__error_set(SGM_ERR_CORRUPT, "%s: the reserved range of %llu bytes is not the "
                           "sub-allocator's only range (%llu bytes in %llu ranges, %zu chunks)",
                           name, (unsigned long long)p->vmm_bytes,
                           (unsigned long long)st->capacity_bytes, (unsigned long long)st->n_ranges,
                           p->n_chunks);
  uint32_t *refs = calloc(n, sizeof *refs);
  if (!refs) return true; /* a check that cannot run finds nothing wrong */
  for (size_t i = 0; i < TIER_SHARDS; i++) {
    const tier_table *t = p->shards[i].table; /* writers hold the pool lock: stable */
    for (size_t k = 0; t && k <= t->mask; k++)
      for (tier_block *b = t->b[k]; b; b = b->hnext) {
        size_t g0, g1;
        tier_vmm_span(p, b->ptr, b->bytes, &g0, &g1);
        for (size_t g = g0; g <= g1 && g < n; g++) refs[g]++;
      }
  }
  uint64_t committed = 0, free_mapped = 0;
  bool ok = true;
  for (size_t g = 0; g < n && ok; g++) {
    const tier_granule *x = &p->gran[g];
    committed += x->mapped || x->busy ? UINT64_C(1) << p->vmm_shift : 0;
    free_mapped += x->mapped && !x->busy && x->refs == 0;
    if (x->refs != refs[g])
      ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: granule %zu has %u references, blocks touch it "
                           "%u times", name, g, x->refs, refs[g]);
    else if (x->refs && !x->mapped && !x->busy)
      ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: granule %zu is touched by %u blocks and not "
                           "mapped", name, g, x->refs);
  }
  free(refs);
  /* Reserve mode's pool: every pool granule is mapped (or being mapped or
   * unmapped) or free, never both. */
  if (ok && p->vmm_pool && p->n_pool_free + (committed >> p->vmm_shift) != p->n_pool)
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: pool of %zu granules, %zu free and %llu mapped",
                         name, p->n_pool, p->n_pool_free,
                         (unsigned long long)(committed >> p->vmm_shift));
  /* Managed blocks charged to the pool (sgm__tier_charge) are committed too. */
  if (ok && (committed != p->committed_bytes - p->external_bytes ||
             free_mapped != p->vmm_free_mapped))
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: committed %llu, granules mapped %llu; %llu free "
                         "mapped granules counted, %llu found", name,
                         (unsigned long long)p->committed_bytes, (unsigned long long)committed,
                         (unsigned long long)p->vmm_free_mapped, (unsigned long long)free_mapped);
  return ok;
}

bool sgm__tier_check(sgm_tier_pool *p) {
  bool ok = true;
  sgm__lock_take(&p->lock);
  uint64_t sum = 0;
  for (size_t i = 0; i < p->n_chunks; i++) sum += p->chunks[i].bytes;
  sgm_suballoc_stats st;
  sgm__suballoc_stats(p->sa, &st);
  size_t in_map = 0, bad_tags = 0;
  for (size_t i = 0; i < TIER_SHARDS; i++) {
    const tier_shard *sh = &p->shards[i];
    size_t walked = 0;
    for (size_t k = 0; sh->table && k <= sh->table->mask; k++)
      for (tier_block *b = sh->table->b[k]; b; b = b->hnext, walked++) {
        uint64_t tag = tier_tag_of(b), st_bits = tag & TIER_TAG_STATE;
        /* Every record names its own address, is LIVE or CACHED, and is the
         * one a lock-free lookup of its address finds. */
        bad_tags += (tag & ~TIER_TAG_FLAGS) != b->ptr || (st_bits != TIER_LIVE && st_bits != TIER_CACHED) ||
                    tier_map_lookup(p, b->ptr) != b;
      }
    in_map += sh->n;
    bad_tags += walked != sh->n;
  }
  uint64_t sealed_without_fence = 0;
  for (tier_stream *s = p->streams; s; s = s->next)
    if (s->sealed.n && !s->fence && !s->busy) sealed_without_fence++;
  if (!sgm__suballoc_check(p->sa)) {
    ok = false;
  } else if (p->committed_bytes > (p->vmm_pool ? tier_vmm_cap_locked(p) : p->p.budget_bytes) &&
             !p->budget_lowered) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: committed %llu > budget %llu",
                         sgm_tier_name(p->p.tier), (unsigned long long)p->committed_bytes,
                         (unsigned long long)p->p.budget_bytes);
  } else if (p->vmm_range && !tier_vmm_check_locked(p, &st)) {
    ok = false;
  } else if (!p->vmm_range && (sum > p->committed_bytes || st.capacity_bytes != sum ||
                               st.n_ranges != p->n_chunks)) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: chunks hold %llu bytes in %zu, sub-allocator %llu "
                         "in %llu, committed %llu", sgm_tier_name(p->p.tier),
                         (unsigned long long)sum, p->n_chunks,
                         (unsigned long long)st.capacity_bytes, (unsigned long long)st.n_ranges,
                         (unsigned long long)p->committed_bytes);
  } else if (st.used_bytes != p->held_bytes - p->external_bytes || st.n_live != p->n_blocks ||
             in_map != p->n_blocks) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: holding %llu bytes in %llu blocks (%zu mapped), "
                         "sub-allocator %llu/%llu",
                         sgm_tier_name(p->p.tier), (unsigned long long)p->held_bytes,
                         (unsigned long long)p->n_blocks, in_map, (unsigned long long)st.used_bytes,
                         (unsigned long long)st.n_live);
  } else if (bad_tags) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: %zu records of the live map have a wrong tag or "
                         "cannot be found by their address", sgm_tier_name(p->p.tier), bad_tags);
  } else if (sealed_without_fence) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: %llu streams hold sealed blocks without a fence",
                         sgm_tier_name(p->p.tier), (unsigned long long)sealed_without_fence);
  }
  sgm__lock_drop(&p->lock);
  return ok;
}
