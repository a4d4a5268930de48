/*
 * pool.h — inside the tier pool: the records, caches and counters its files
 * share (the .c files of lib/tiers/pool). The tiers see only tiers/tier.h.
 *
 * Every block carved from the sub-allocator has a tier_block record in the
 * pool's live map: LIVE while the user (or sgm) holds it, CACHED while it sits
 * in a magazine, a stream's bag or the deferred list. A cached block belongs
 * to one stream (its key): work queued on that stream may still use it.
 *
 *   user free on S --> thread magazine [class][slot]   (no shared lock)
 *                          | full: half moves down       |
 *                          v                             |
 *                      bag of S: open --seal--> sealed (+ fence event on S)
 *                          |    |               |   | fence seen complete
 *   transfer to T <--------+    |  (record on S |   v
 *   (T's open bag,              |  = seal; wait | sub-allocator (anyone)
 *    what T asked for) <--------|--- on T) -----+      ^
 *                               |                      | S owes (owe.c)
 *        S's carve needs new memory: S's bags and this thread's blocks of S
 *        go straight back, no event ----------------------+
 *
 * While S owes, a carve for T != S records an event on S (once per batch of
 * returns) and makes T wait on it on the device; sgm's own carves and every
 * unmap or chunk release wait on the host first; an event on S seen complete
 * ends the debt.
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
 *    complete, a host wait, a synchronous backend, or their own stream's
 *    return (owe.c), after which that stream owes;
 *  - n_owing is the number of streams that owe (owe_done < owe_seq), 0 on a
 *    synchronous backend; a stream's fence_seq, owe_ev_seq and owe_done never
 *    pass its owe_seq; takers are remembered only for a recorded owe_ev;
 *  - while a stream owes, no memory of the sub-allocator is handed to another
 *    stream unordered after it, to sgm itself before a host wait, or back to
 *    the driver (unmapped, chunk released) before a host wait (owe.c);
 *  - a fence or deferred event has one owner at a time (the busy flag), so it
 *    is queried, recycled or destroyed by one thread only.
 *
 * Threading: see tier.h for the locks and their order. The user's alloc and
 * free on a warm magazine take no lock (the magazine's section, pool.h:
 * tier_mag_enter) and, on free, a lock-free lookup in the live map
 * and one compare-and-swap on the block's own record;
 * counters go to the magazine and reach the pool in batches (at once when one
 * thread uses the pool, so single-threaded stats are exact).
 *
 * Files, one job each (mimalloc keeps segment.c, page.c, free.c, alloc.c apart
 * the same way), bottom to top: each calls only files above it in this list
 * (issue 31; the layer check fails on a circle among them):
 *   map.c     the live map (pointer -> record) and the address span
 *   stream.c  streams, bag lists, pooled events
 *   owe.c     what a stream owes after returning its cache without an event
 *   vmm.c     expandable growth on one reserved range
 *   chunk.c   chunks and the sub-allocator side of a block
 *   bag.c     stream bags and the fence pass
 *   mag.c     magazines: per-thread caches
 *   xfer.c    transfers of cached blocks between streams
 *   reclaim.c the reclaim passes, and a stream's own cache returned
 *   budget.c  trims, the idle trim, budget changes, charges
 *   alloc.c   the user's path: alloc/free on a stream, record_stream, sgm's own blocks
 *   pool.c    create, destroy, stats, the invariant check
 * Cross-file functions are sgm__pool_<file's job>_<verb>; helpers every file
 * needs are static inline below.
 */
#ifndef SGM_TIERS_POOL_H
#define SGM_TIERS_POOL_H

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
 * (so big classes get fewer slots: at most 4 MiB cached per class per thread).
 * 64 (jemalloc's thread caches hold up to 200 small blocks per bin): a
 * magazine's fill level per class walks up and down with the frees and
 * allocations of that class, and it spills to or refills from the stream's
 * bag (under the pool lock) when it reaches either end, which more slots
 * make rarer. Measured on the 10,000-block churn (cachegrind, per pair):
 * 16 slots 1,023 instructions, 32 999, 64 988; 256 B-1 MiB: 32 slots 661,
 * 64 653. */
#define TIER_MAG_SLOTS 64
#define TIER_MAG_CLASS_BYTES (UINT64_C(4) << 20)
/* A magazine's counters reach the pool when its pending bytes pass the
 * pool's flush bound (tier_mag_flush_bytes), which bounds the error of the
 * peak while several threads run: 1/64 of the budget, from 1 MiB to 64 MiB.
 * A fixed 1 MiB made a thread whose live bytes swing by a few MiB (the
 * alloc.scaling.2t ring, 256 B-1 MiB) flush at 3.1% of its counts, 0.2% at
 * 4 MiB and never past 16 MiB, each flush an atomic add on the pool's shared
 * counters, which two threads then passed back and forth: the ring's pairs/s
 * on one shared context was 0.75-0.79x that of two contexts (medians of 10
 * and 12 alternated rounds), 0.79-0.84x with 4-64 MiB (issue 26). Past 4 GiB
 * of budget (a GPU's) the bound is 64 MiB, under 1.6% of it per thread; the
 * emulated device's default 1 GiB gets 16 MiB; small pools (tests, the
 * shared tier of a small host) keep 1 MiB. */
#define TIER_MAG_FLUSH_MIN (UINT64_C(1) << 20)
#define TIER_MAG_FLUSH_MAX (UINT64_C(64) << 20)
#define TIER_MAG_FLUSH_SHIFT 6
static inline uint64_t tier_mag_flush_bytes(uint64_t budget_bytes) {
  uint64_t b = budget_bytes >> TIER_MAG_FLUSH_SHIFT;
  return b < TIER_MAG_FLUSH_MIN ? TIER_MAG_FLUSH_MIN : b > TIER_MAG_FLUSH_MAX ? TIER_MAG_FLUSH_MAX : b;
}
/* A thread's stash (tier_mag): the large blocks (past TIER_CLASS_MAX_BYTES)
 * it freed since its last large allocation, at most this many and at most
 * the pool's flush bound in bytes (tier_mag_flush_bytes: 1/64 of the
 * budget, 1-64 MiB); a larger block goes to its stream's bag at once. They
 * go back to the sub-allocator (or to their bags) in the lock section of the
 * thread's next large carve, so that a large free takes no pool lock. A
 * large pair of alloc.churn.10k took the lock twice, once to bag the freed
 * block and once to carve, which gave the bagged block back: 1,579
 * instructions per pair of large blocks only, 1,442 with the stash; 921 and
 * 897 per pair of the mixed churn (callgrind, issue 26). */
#define TIER_STASH_SLOTS 4
/* Magazines per thread (pools a thread uses at once: two tiers of a context or two). */
#define TIER_TLS_SLOTS 4
/* Live-map shards: each its own slot array and sequence number, so that a
 * rebuild moves a 16th of the keys and a removal disturbs a 16th of the
 * lookups. 64 until the page map took the large blocks: then each shard's
 * line was read once in 64 frees and missed the cache every time
 * (cachegrind, alloc.churn.10k with the page map looked up first: 9.27 read
 * misses per pair with 64 shards, 8.46 with 16, against 8.59 before the
 * page map; issue 26). */
#define TIER_SHARDS 16
#define TIER_SHARD_SLOTS_MIN 16
/* The page map of large blocks (map.c): in the reserved range, a block of at
 * least TIER_BIG_BYTES is found by its address, one slot per TIER_BIG_BYTES
 * of the range (two such blocks cannot start in the same slot's bytes). */
#define TIER_BIG_SHIFT 20
#define TIER_BIG_BYTES (UINT64_C(1) << TIER_BIG_SHIFT)
/* Streams remembered as ordered after an owing stream's event (issue 26):
 * a taker past these waits again (correct, 2 more calls). */
#define TIER_OWE_TAKERS 4
/* Address ranges a stream remembers having returned while it owes (owe.c):
 * past this many it stops remembering and every block counts as owed. */
#define TIER_OWED_RANGES_MAX 4096

/* [lo, hi) of device addresses. */
typedef struct tier_range {
  sgm_devptr lo, hi;
} tier_range;
/* A large cached block is reused for a request when it is at most this much
 * bigger (1/8: the same slack a size class allows at most). */
#define TIER_LARGE_SLACK_SHIFT 3
/* Does a cached block of `bytes` serve a request of `lo` bytes (a class's
 * size, or a large request's)? At least lo, at most the slack above it. */
static inline bool tier_large_serves(uint64_t bytes, uint64_t lo) {
  return bytes >= lo && bytes <= lo + (lo >> TIER_LARGE_SLACK_SHIFT);
}

/* Budgets below this many granules (64 MiB with 2 MiB granules) grow in
 * chunks: a block is rounded to whole granules in committed bytes, which on a
 * small budget is a large share (an 8 MiB budget holding two 1 MiB blocks and
 * a 6 MiB one would need 10 MiB of granules). */
#define TIER_VMM_MIN_GRANULES 32u
/* Expandable growth: when a block needs new granules mapped and the free
 * mapped ones pass this many granules and 1/32 of what is committed (3.1 %),
 * they are unmapped first, down to that and no further, those farthest from
 * the range's ends first (vmm.c, tier_vmm_unmap_excess; trims, the idle trim
 * and budget pressure return the rest). Measured on the
 * idealloc traces (sgm-alloc-replay, docs/benchmarks.md): 1/64 commits at
 * most 1.057 x the peak live bytes, 1/32 the same, 1/16 and 1/8 up to
 * 1.110; mapping calls fall as the slack grows. */
#define TIER_VMM_SLACK_GRANULES 4u
#define TIER_VMM_SLACK_SHIFT 5
/* ... unless the new mapping keeps committed within the peak: the highest
 * held bytes since free granules were last all unmapped (a trim, the idle
 * trim, budget pressure) plus 1/64. A busy program whose working set falls
 * and rises again keeps the mappings of its peak instead of unmapping them in
 * the trough and mapping them back. Measured on the idealloc traces, CUDA
 * over the double (docs/benchmarks-history.md, issue 26): pangu_2.6B's second
 * pass made 0.0575 driver calls per event before, 0.0163 with 1/64, with the
 * worst committed / peak live 1.081 (emulated device); 1/32 and 1/16 gave
 * 0.0182 and 0.0161 with committed up to 1.092 and 1.114. */
#define TIER_VMM_PEAK_SHIFT 6
/* Expandable growth maps the granules a block needs as mappings of at most
 * this many granules (64 MiB with 2 MiB granules): four driver calls on
 * CUDA however many granules (cuMemCreate, cuMemMap, cuMemRelease,
 * cuMemSetAccess; neighbouring mappings made together share the last)
 * where mapping granule by granule took four per granule. A mapping is unmapped whole (cuMemUnmap takes no part of
 * one), so while a block touches any of its granules all of it stays
 * committed: the cap bounds that. Measured on the idealloc traces, emulated
 * device, two passes (docs/benchmarks-history.md, issue 26): 16 granules
 * made 1.3-2.4x the mapping calls of 32; 64 and no cap took the worst peak
 * committed / peak live from 1.050 to 1.089 and 1.124; a partly covered edge
 * granule as a mapping of its own made 1.3-3.8x the calls for at most 0.014
 * less committed. */
#define TIER_VMM_MAP_MAX_GRANULES 32u
/* Pages: a block that maps granules also maps the unmapped neighbours of its
 * edge granules within their aligned page (the blocks placed next to it then
 * map nothing), the page committed / 64 granules rounded down to a power of
 * two, at most 8 granules (16 MiB; PyTorch's expandable segments map 20 MiB
 * pages for large blocks). At most a page per edge of the growing region is
 * mapped ahead: about 3% of committed. Measured on the idealloc traces
 * (docs/benchmarks-history.md, issue 26): first-pass calls per MiB of peak
 * fell by up to 2.2x (resnet50: 1.25 to 0.57), the worst emulated-device
 * peak committed / peak live rose from 1.086 to 1.094; committed / 32 gave
 * 1.116, committed / 128 up to 1.3x the calls of / 64. */
#define TIER_VMM_PAGE_MAX_GRANULES 8u
#define TIER_VMM_PAGE_SHIFT 6


/* A block record's tag: its address (a multiple of SGM_DEVICE_ALIGN) and
 * these flags in the low bits. TIER_OWN: taken by sgm__tier_alloc for sgm
 * itself, so user frees refuse it. TIER_BUSY: sgm_record_stream is changing
 * the record's stream list; a free waits for it. */
enum { TIER_LIVE = 1, TIER_CACHED = 2, TIER_OWN = 4, TIER_BUSY = 8 };
#define TIER_TAG_STATE UINT64_C(3)
#define TIER_TAG_FLAGS (SGM_DEVICE_ALIGN - UINT64_C(1))

/* Expandable growth: one granule of the reserved range. Granules are mapped
 * in mappings of one or more neighbours (one backend vmm_map each, unmapped
 * whole: larger pages for large blocks, issue 26); a mapping's first granule
 * (its head) keeps its length and how many of its granules blocks touch. */
typedef struct tier_granule {
  uint32_t refs;               /* blocks of the sub-allocator (live or cached) touching it */
  uint32_t head;               /* mapped: the first granule of its mapping */
  uint32_t phys;               /* reserve mode's pool: the pool granule mapped here (mapped or busy) */
  uint8_t mapped;              /* memory is mapped behind it */
  uint8_t busy;                /* a thread maps or unmaps it now, without the pool lock */
  uint8_t len;                 /* on a mapped head: granules in the mapping */
  uint8_t used;                /* on a mapped head, not busy: its granules with refs > 0 */
} tier_granule;
/* 16 bytes: a block's granules and their mappings' heads share fewer lines
 * (24 bytes before; the churn of large blocks missed on them, issue 26). */
_Static_assert(sizeof(tier_granule) == 16, "a granule's record is 16 bytes");
_Static_assert(TIER_VMM_MAP_MAX_GRANULES <= UINT8_MAX, "tier_granule.len holds a mapping's granules");

/* Streams sgm_record_stream named for a block (malloc'd). */
typedef struct tier_rec {
  size_t n;                    /* entries in ref */
  sgm_stream_ref ref[];
} tier_rec;

/* One block of the sub-allocator, known to the live map: one cache line,
 * all a free, a reuse and a release read or write (the lookup validates
 * the tag; the free reads the size asked, its class and whether streams
 * were recorded, and writes the stream; the caches link next; the release
 * reads the sub-allocator's node). The address is the tag's (tier_ptr_of).
 * With the sub-allocator's node kept here, the 10,000-block churn pair
 * (256 B-16 MiB) went from 2.99 to 1.94 misses of a 1 MiB cache
 * (cachegrind) against a record whose free and release touched two lines and
 * a sub-allocator that hashed its blocks; with the live map's keys in its
 * table (no chain through the records) the record is one line. Records
 * are cut from slabs, each thread's from its own (tier_lineage), so
 * that two threads' records seldom sit on neighbouring lines: packed in
 * shared slabs they slowed both threads (the prefetcher fetches lines in
 * pairs; alloc.scaling.2t median 1.37 against 1.62 with a pair of lines per
 * record, 1.65 with a slab per thread), and a pair of lines per record
 * slowed the single-threaded churn (256 B-1 MiB: 1.24-1.95x the
 * sub-allocator against 1.27-1.33). */
#define TIER_RECORD_ALIGN 64
typedef struct tier_block {
  uint64_t tag;                /* ptr | TIER_LIVE or TIER_CACHED | TIER_OWN | TIER_BUSY, 0 while
                                  spare (atomic: the live map's lock-free readers validate by it) */
  struct tier_block *next;     /* in a cache list, or the pool's spare records */
  uint64_t bytes;              /* its size in the sub-allocator */
  uint64_t sized;              /* the size handed out, rounded to SGM_DEVICE_ALIGN (counted in
                                  used), with its class and TIER_SIZED_REC in the low bits:
                                  tier_asked, tier_cls, tier_recorded */
  uint64_t key;                /* the stream it belongs to (allocated or freed on) */
  void *handle;                /* that stream's handle, to record events on it */
  sgm_suballoc_node *node;     /* its node in the sub-allocator, which frees by it */
  tier_rec *rec;               /* streams named by sgm_record_stream, NULL if none */
} __attribute__((aligned(TIER_RECORD_ALIGN))) tier_block;
_Static_assert(sizeof(tier_block) == 64, "a record is one cache line");

/* Records are cut from slabs of 8 KiB, TIER_SLAB_RECORDS after a header of
 * one record's size, rather than one allocation each with malloc's header
 * and alignment between them. A slab is aligned to its size, so that a
 * record finds its slab (and its lineage) by its address, and slabs are
 * allocated TIER_SLAB_BATCH at a time, side by side: allocated one by one,
 * aligned, they lay 16 KiB apart and their records fell in half the cache's
 * sets (cachegrind, the 10,000-block churn: 0.36 misses of a 2 MiB cache per
 * pair against 0.08 with slabs aligned to a record; in batches 0.10; 256 B-1
 * MiB with a 1 MiB cache: 0.44, 0.38 and 0.26). Page-aligned slabs, one by
 * one, had done the same before (0.46 to 1.04 misses of a 1 MiB cache). */
#define TIER_SLAB_BYTES 8192u
#define TIER_SLAB_RECORDS ((TIER_SLAB_BYTES - TIER_RECORD_ALIGN) / sizeof(tier_block))
#define TIER_SLAB_BATCH 8u
typedef struct tier_slab {
  struct tier_slab *next;      /* the pool's slabs */
  uint32_t lin;                /* the lineage whose records these are (pool->lin[lin]) */
  uint32_t batch_head;         /* the first of its batch: what the pool frees */
  char pad[TIER_RECORD_ALIGN - sizeof(struct tier_slab *) - 2 * sizeof(uint32_t)];
  tier_block rec[];            /* TIER_SLAB_RECORDS of them */
} tier_slab;
/* Where a lineage's next record is cut. Used under the pool lock. */
typedef struct tier_slab_cursor {
  tier_slab *slab;             /* NULL until the first record */
  size_t used;                 /* records cut from it */
} tier_slab_cursor;
/*
 * Lineages (issue 26, alloc.scaling.2t): the records one thread at a time
 * uses. A thread's magazine holds one lineage for as long as the thread
 * lives; its carves cut records from the lineage's slabs or reuse its spare
 * records, a released record goes back to the lineage of its slab, and a
 * cached block the thread takes from a bag (another thread's free, a dead
 * thread's drained magazine) gets a record of the thread's lineage in place
 * of the one it had (sgm__pool_record_own_locked). So two threads' records
 * seldom share a page: the hardware prefetchers fetch a line's neighbours
 * (in pairs, and streams within a page), and a thread writing its records
 * (the free's compare-and-swap, the allocation's stream) while another
 * thread's prefetches took them first paid a transfer between the cores.
 * Records mixed that way as the benchmark's threads came and went: two
 * threads on one context ran 1.09-1.50x the pairs/s of one, with lineages
 * 1.56-1.67 (sgm-bench alternated runs; two contexts, one per thread, ran
 * 1.9-2.0x on the C ring driver). A dead thread's
 * lineage waits for the next magazine, which takes it whole: lineages number
 * at most the threads alive at once, plus lineage 0 (the pool's: carves by
 * threads without a magazine), so records stay bounded however many threads
 * come and go. A lineage keeps TIER_SPARE_KEEP spare records for itself; a
 * carve whose lineage has none left takes one of another lineage's spare
 * records past that many before it cuts a new one (the record stays on its
 * slab and goes back to that lineage when released): a live thread that
 * released many blocks does not keep their records from the others.
 */
typedef struct tier_lineage {
  tier_slab_cursor cur;        /* where its next record is cut */
  tier_block *spare;           /* its records out of the map (tag 0), reused by its carves: a
                                  record once in the map is freed only with the pool
                                  (lock-free readers) */
  size_t n_spare;              /* records in spare */
  bool held;                   /* a live magazine holds it (lineage 0: always) */
} tier_lineage;
/* Spare records a lineage keeps from other lineages' carves: a slab's worth. */
#define TIER_SPARE_KEEP TIER_SLAB_RECORDS
/* The slab holding record b (by its address: slabs are aligned to their size). */
static inline tier_slab *tier_slab_of(const tier_block *b) {
  return (tier_slab *)(uintptr_t)((uintptr_t)b & ~(uintptr_t)(TIER_SLAB_BYTES - 1));
}
_Static_assert(offsetof(tier_slab, rec) == TIER_RECORD_ALIGN, "records start on a cache line of their own");

/* tier_block.sized: the low bits of an aligned size hold the block's class
 * plus one (0: no class) and whether rec is set. */
#define TIER_SIZED_CLS UINT64_C(0x7f)
#define TIER_SIZED_REC UINT64_C(0x80)
_Static_assert(TIER_N_CLASSES < TIER_SIZED_CLS && (TIER_SIZED_CLS | TIER_SIZED_REC) < SGM_DEVICE_ALIGN,
               "a block's class and record flag fit below its aligned size");

static inline uint64_t tier_asked(const tier_block *b) {
  return b->sized & ~(TIER_SIZED_CLS | TIER_SIZED_REC);
}
static inline int tier_cls(const tier_block *b) { return (int)(b->sized & TIER_SIZED_CLS) - 1; }
static inline bool tier_recorded(const tier_block *b) { return (b->sized & TIER_SIZED_REC) != 0; }
static inline void tier_set_asked(tier_block *b, uint64_t asked) {
  b->sized = asked | (b->sized & (TIER_SIZED_CLS | TIER_SIZED_REC));
}


/* A slot of the live map, one word (atomic; 0: empty): its record's address
 * (TIER_SLOT_REC: records are TIER_RECORD_ALIGN-aligned and lie below
 * 2^48), 16 bits of its key's hash above it (a lookup reads a record only
 * when they match) and the slot's distance from its home below it
 * (TIER_SLOT_DIST: that far or farther). Half the bytes of an address and a
 * record pointer side by side, so that more of the map stays in cache: its
 * slot's load is a lookup's first cache miss (issue 26). */
typedef uint64_t tier_slot;
#define TIER_SLOT_DIST UINT64_C(0x3f)
#define TIER_SLOT_REC UINT64_C(0x0000ffffffffffc0)
#define TIER_SLOT_FP_SHIFT 48
_Static_assert(TIER_RECORD_ALIGN == TIER_SLOT_DIST + 1, "a record's alignment leaves the distance's bits free");
static inline tier_block *tier_slot_rec(tier_slot v) { return (tier_block *)(uintptr_t)(v & TIER_SLOT_REC); }
/* The hash bits a slot keeps (h: the key's tier_hash). */
static inline uint64_t tier_slot_fp(uint64_t h) { return h >> TIER_SLOT_FP_SHIFT; }
/* A slot array of the live map (open addressing, linear probing); replaced
 * arrays are kept until the pool goes, since a reader may still be reading
 * one. */
typedef struct tier_table {
  size_t mask;                 /* slots - 1 (a power of two, minus one) */
  struct tier_table *retired;  /* the array this one replaced */
  tier_slot s[];
} tier_table;

/* A shard of the live map, alone on its cache line. Written only under the
 * pool lock, read without any lock: frees look their block up without
 * writing a line another thread reads (issue 10: two threads freeing through
 * shard spin locks ran at 0.68x the pairs per second of one). */
typedef struct tier_shard {
  unsigned seq;                /* odd while a slot is emptied or the table rebuilt (atomic) */
  tier_table *table;           /* NULL until the first insert (atomic) */
  size_t mask;                 /* table->mask, stored after table (atomic): a lookup reads the
                                  shard's line, not also the table's first (each a miss once
                                  10,000 blocks are live: cachegrind, issue 26) */
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
  /* (what the stream owes, issue 26: owe.c) */
  uint64_t fence_seq;          /* owe_seq when fence was recorded (it covers returns up to it) */
  uint64_t owe_seq;            /* times its own cached blocks went straight back to the
                                  sub-allocator with its work maybe pending on them */
  uint64_t owe_done;           /* owe_seq covered by an event seen complete or waited for: the
                                  stream owes while owe_done < owe_seq */
  void *owe_ev;                /* event recorded on the stream for others to wait on, NULL none */
  uint64_t owe_ev_seq;         /* owe_seq when owe_ev was recorded */
  uint64_t owe_takers[TIER_OWE_TAKERS]; /* streams ordered after owe_ev on the device */
  unsigned n_owe_takers;       /* entries used in owe_takers */
  tier_range *owed;            /* the blocks it returned while it owes (malloc'd), NULL none */
  uint32_t n_owed, cap_owed;   /* entries used / allocated in owed */
  bool owed_all;               /* it returned more than it remembers: all memory counts as owed */
  bool owe_busy;               /* a thread records or waits on owe_ev without the lock */
  bool capturing;              /* a record on it was refused (it captures a graph): no
                                  returns until a record on it succeeds again */
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
  int busy;                    /* the owner is in a section (tier_mag_enter; atomic) */
  int stop;                    /* a reclaimer holds the magazine: owners wait (atomic) */
  sgm_tier_pool *pool;         /* NULL once the pool is destroyed (registry lock) */
  uint64_t pool_id;            /* the pool's id, for the thread's lookup */
  struct tier_mag *prev, *next; /* the pool's list (registry and pool lock) */
  uint64_t cached_bytes;       /* bytes in the slots and the stash (atomic: read by stats) */
  int64_t d_used;              /* used bytes not yet added to the pool (atomic) */
  int64_t peak_room;           /* the pool's peak less its used bytes at this magazine's last
                                  flush: pending use past it may be a new peak (atomic) */
  uint64_t peak_epoch;         /* the pool's used_epoch then (atomic) */
  uint64_t n_allocs;           /* allocations served by this thread, not yet added (atomic) */
  uint64_t n_frees;            /* frees by this thread, not yet added (atomic) */
  uint32_t lin;                /* its lineage: pool->lin[lin] (0: none to itself; pool lock) */
  uint8_t n[TIER_N_CLASSES];   /* slots used per class */
  uint8_t n_stash;             /* large blocks in stash[] (atomic: the owner reads it unlocked) */
  uint64_t stash_bytes;        /* their bytes */
  tier_block *stash[TIER_STASH_SLOTS]; /* large blocks this thread freed, CACHED, oldest first */
  tier_block *slot[TIER_N_CLASSES][TIER_MAG_SLOTS]; /* cached blocks, newest last */
} tier_mag;

struct sgm_tier_pool {
  sgm_tier_head head;         /* first: what tier.h's inline checks read (room_bytes) */
  sgm_lock lock;              /* guards everything below but the params, atomics and shards */
  sgm_tier_params p;          /* set at create, read-only after (but the budget, under the lock) */
  uint64_t id;                /* unique for the process's life: magazines find their pool by it */
  int64_t mag_flush_bytes;    /* a magazine's pending bytes flush past this (tier_mag_flush_bytes of
                                 the budget at create; read-only after) */
  uint64_t used_epoch;        /* bumped by every count of handed-out bytes that no magazine made
                                 (sgm's own blocks, threads without one): a magazine's peak_room
                                 is stale when it moved (atomic; on a line written rarely) */
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
  char budget_why[400];       /* why the budget is what it is, when not limit_hint's options
                                 ("" = theirs): a fair share of a shared device (issue 28) */
  unsigned n_growing;         /* chunks being taken from the backend right now */
  unsigned n_releasing;       /* chunks detached and being returned right now (still committed) */
  pthread_cond_t grown;       /* broadcast when a chunk taking finishes or a release ends */
  tier_stream *streams;       /* streams with bags */
  size_t n_owing;             /* streams that owe (owe.c; atomic: read as a hint by carves) */
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
  tier_granule *gran;         /* one per granule of the range */
  uint64_t *vmm_bits;         /* gran[g].mapped as one bit per granule, 64 to a word: a
                                 block's unmapped granules counted a word at a time */
  uint64_t vmm_held_peak;     /* highest held_bytes since free granules were last all unmapped */
  uint64_t vmm_free_mapped;   /* granules mapped, not busy, touched by no block (atomic read) */
  uint64_t vmm_calls;         /* backend map / unmap calls so far (atomic) */
  tier_block **big;           /* the page map of large blocks (map.c): the record of the block of
                                 at least TIER_BIG_BYTES that starts in each TIER_BIG_BYTES of the
                                 range (atomic), NULL without a range or host memory for it */
  uint64_t *big_bits;         /* big[i] != NULL as one bit per slot, 64 to a word (atomic): what a
                                 lookup reads before the slot (a few KiB, where the slots are 8
                                 bytes per MiB) */
  size_t n_big_slots;         /* slots in big */
  size_t n_big;               /* records in big */
  uint64_t big_writes;        /* inserts and removals in big (atomic: read by the stats) */
  uint64_t idle_allocs;       /* idle trim: allocations counted at the last idle call */
  uint64_t idle_since_ms;     /* idle trim: when that count last changed; UINT64_MAX = never seen */
  struct tier_slab *slabs;    /* where records come from, freed with the pool */
  size_t n_slabs;             /* slabs in that list */
  char *slab_batch;           /* the batch the next slabs come from (NULL: none) */
  size_t slab_batch_used;     /* slabs taken from it */
  tier_lineage *lin;          /* the lineages (map.c): 0 the pool's, the others one thread's each */
  size_t n_lin;               /* entries used in lin */
  size_t cap_lin;             /* entries allocated in lin */
  /* reserve mode on the virtual-memory API (issue 17); vmm_pool NULL = none */
  void *vmm_pool;             /* the backend's pool of the budget's granules, taken at create */
  uint32_t *pool_free;        /* pool granules mapped nowhere (a stack) */
  size_t n_pool;              /* granules in the pool */
  size_t n_pool_free;         /* entries used in pool_free */
  tier_shard shards[TIER_SHARDS]; /* the live map */
};
/* ---- small helpers ---- */

/*
 * A magazine's sections. Its owner thread changes it without the pool lock
 * inside tier_mag_enter / tier_mag_leave, and under the pool lock with no
 * more (no reclaimer runs then). Another thread (a reclaimer, holding the
 * pool lock) takes it with sgm__pool_mags_stop_locked: it sets stop, runs
 * the heavy fence, and waits until busy is clear; sgm__pool_mags_go_locked
 * gives it back. The owner sets busy, then reads stop: with the reclaimer's
 * membarrier between its store of stop and its load of busy, one of the two
 * sees the other's flag (internal.h), so the owner's path has no atomic
 * read-modify-write. It had a spin lock, an exchange per allocation and per
 * free: with a plain store in its place (unsafe, measured as the bound) the
 * 10,000-block churn ran at 1.48x the sub-allocator alone against 1.65x
 * (medians of 8 alternated rounds; docs/benchmarks-history.md, issue 26).
 * Without membarrier the owner's store is a sequentially consistent
 * exchange, as costly as the spin lock was.
 */
static inline void tier_mag_enter(tier_mag *m) {
  for (;;) {
    if (__atomic_load_n(&sgm__fence_asym, __ATOMIC_RELAXED)) {
      __atomic_store_n(&m->busy, 1, __ATOMIC_RELAXED);
      __atomic_signal_fence(__ATOMIC_SEQ_CST);
    } else {
      (void)__atomic_exchange_n(&m->busy, 1, __ATOMIC_SEQ_CST);
    }
    if (!__atomic_load_n(&m->stop, __ATOMIC_SEQ_CST)) return;
    __atomic_store_n(&m->busy, 0, __ATOMIC_RELEASE);
    while (__atomic_load_n(&m->stop, __ATOMIC_ACQUIRE)) sched_yield();
  }
}

static inline void tier_mag_leave(tier_mag *m) { __atomic_store_n(&m->busy, 0, __ATOMIC_RELEASE); }

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

/* The page map's slot for a block of bytes at ptr, NULL when such a block is
 * not in the page map (too small, outside the range, or no page map:
 * n_big_slots 0). The page map is set before the pool is shared and goes
 * with it. */
static inline tier_block **tier_big_slot(const sgm_tier_pool *p, sgm_devptr ptr, uint64_t bytes) {
  uint64_t i = (ptr - p->vmm_base) >> TIER_BIG_SHIFT;
  return bytes >= TIER_BIG_BYTES && i < p->n_big_slots ? &p->big[i] : NULL;
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

/* tier_class_bytes and tier_mag_cap as constant expressions, for the table below. */
#define TIER_CLASS_BYTES_C(c)                                                                  \
  ((c) < 4 ? (UINT64_C(1) + (c)) << 8                                                         \
           : (UINT64_C(1) << (10 + ((c) - 4) / 4)) + ((UINT64_C(1) + ((c) - 4) % 4) << (8 + ((c) - 4) / 4)))
#define TIER_MAG_CAP_C(c)                                                                      \
  (TIER_MAG_CLASS_BYTES / TIER_CLASS_BYTES_C(c) > TIER_MAG_SLOTS ? TIER_MAG_SLOTS               \
   : TIER_MAG_CLASS_BYTES / TIER_CLASS_BYTES_C(c) < 2            ? 2                            \
                                                                 : TIER_MAG_CLASS_BYTES / TIER_CLASS_BYTES_C(c))
#define TIER_MAG_CAP_U8(c) ((uint8_t)(TIER_MAG_CAP_C(c)))
#define TIER_MAG_CAP_4(c) TIER_MAG_CAP_U8(c), TIER_MAG_CAP_U8(c + 1), TIER_MAG_CAP_U8(c + 2), TIER_MAG_CAP_U8(c + 3)
/* Slots a magazine fills per class: TIER_MAG_SLOTS, fewer where that many
 * blocks would pass TIER_MAG_CLASS_BYTES (a table: every free reads it). */
static const uint8_t tier_mag_caps[TIER_N_CLASSES] = {
    TIER_MAG_CAP_4(0),  TIER_MAG_CAP_4(4),  TIER_MAG_CAP_4(8),  TIER_MAG_CAP_4(12),
    TIER_MAG_CAP_4(16), TIER_MAG_CAP_4(20), TIER_MAG_CAP_4(24), TIER_MAG_CAP_4(28),
    TIER_MAG_CAP_4(32), TIER_MAG_CAP_4(36), TIER_MAG_CAP_4(40)};
_Static_assert(TIER_N_CLASSES == 44, "tier_mag_caps lists every class");
static inline unsigned tier_mag_cap(int cls) { return tier_mag_caps[cls]; }

/* Keep room_bytes = budget - held (0 when over) for the lock-free check. */
static inline void tier_update_room_locked(sgm_tier_pool *p) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  uint64_t room = p->p.budget_bytes > p->held_bytes ? p->p.budget_bytes - p->held_bytes : 0;
  __atomic_store_n(&p->head.room_bytes, room, __ATOMIC_RELAXED);
}

/* Count bytes handed out (or back, negative) at the pool level. */
static inline void tier_count_used(sgm_tier_pool *p, int64_t d_used, int64_t d_live, uint64_t allocs,
                                   uint64_t frees) {
  uint64_t used = __atomic_add_fetch(&p->used_bytes, (uint64_t)d_used, __ATOMIC_RELAXED);
  if (d_live) __atomic_add_fetch(&p->n_live, d_live, __ATOMIC_RELAXED);
  if (allocs) __atomic_add_fetch(&p->n_allocs, allocs, __ATOMIC_RELAXED);
  if (frees) __atomic_add_fetch(&p->n_frees, frees, __ATOMIC_RELAXED);
  if (d_used > 0) {
    uint64_t peak = __atomic_load_n(&p->peak_used_bytes, __ATOMIC_RELAXED);
    /* Signed: while several threads count, the pool's share may dip below 0
     * for a moment (a free counted before the allocation it undoes). */
    while ((int64_t)used > (int64_t)peak &&
           !__atomic_compare_exchange_n(&p->peak_used_bytes, &peak, used, true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
  }
}
/* tier_count_used for a count no magazine made: handed-out bytes then move
 * the pool's used_epoch (the magazines' peak_room is stale). */
static inline void tier_count_direct(sgm_tier_pool *p, int64_t d_used, int64_t d_live, uint64_t allocs,
                                     uint64_t frees) {
  tier_count_used(p, d_used, d_live, allocs, frees);
  if (d_used > 0) __atomic_add_fetch(&p->used_epoch, 1, __ATOMIC_RELAXED);
}
static inline uint64_t tier_tag_of(const tier_block *b) {
  return __atomic_load_n(&b->tag, __ATOMIC_ACQUIRE);
}
/* The address a record's tag names (0 while spare): from the first line. */
static inline sgm_devptr tier_ptr_of(const tier_block *b) { return tier_tag_of(b) & ~TIER_TAG_FLAGS; }
/* Set a block's state, keeping its address and owner (LIVE when handed out,
 * CACHED when taken back; the caller holds the block alone). */
static inline void tier_block_set_state(tier_block *b, int state) {
  uint64_t tag = __atomic_load_n(&b->tag, __ATOMIC_RELAXED);
  __atomic_store_n(&b->tag, (tag & ~TIER_TAG_STATE) | (uint64_t)state, __ATOMIC_RELEASE);
}
/* What a transfer is for: blocks that serve one request (sgm__pool_bag_take's
 * rule: class cls, or for cls < 0 at least need bytes and at most 1/8 more).
 * NULL: every block. */
typedef struct tier_want {
  int cls;                     /* size class of the request, < 0 for a large one */
  uint64_t need;               /* bytes asked, aligned (large requests) */
  uint64_t also_cls;           /* moved too, not asked for: bit c = every block of class c */
  uint64_t also_large[TIER_RECENT_LARGE]; /* moved too: large blocks fitting these sizes; 0 = none */
} tier_want;
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
  uint64_t seq;                /* SEAL, FENCE: the stream's owe_seq the fence covers (owe.c) */
  bool refused;                /* SEAL: the record was refused with SGM_ERR_BUSY (a capture) */
  const tier_want *want;       /* transfers: which blocks the taker takes (NULL: all) */
} tier_job;

/* Reserve mode's pool: committed_bytes counts the granules mapped (as in
 * growth mode), the pool holds the budget whatever is mapped; what users see
 * as committed is the pool (tier_committed). */
static inline uint64_t tier_committed(const sgm_tier_pool *p) {
  return p->vmm_pool ? ((uint64_t)p->n_pool << p->vmm_shift) + p->external_bytes : p->committed_bytes;
}

/* A stream owes while returns it made are not covered by an event seen
 * complete (owe.c, issue 26). */
static inline bool tier_owes(const tier_stream *s) { return s->owe_done < s->owe_seq; }

/* The message for a chunk the backend would not give. */
static inline int tier_backend_nomem_locked(sgm_tier_pool *p, uint64_t size) {
  char a[32], b[32], u[32], c[32];
  __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
  const char *name = sgm_tier_name(p->p.tier);
  /* VRAM refused within the budget: the device is full because of others. */
  bool vram = p->p.tier == SGM_TIER_VRAM;
  return sgm__error_set(SGM_ERR_NOMEM,
                          "%s: cannot allocate %s: the device gave no new chunk (%s)%s; "
                          "budget %s, holding %s in %llu blocks, committed %s",
                          name, sgm__fmt_bytes(size, a, sizeof a), sgm_last_error(),
                          vram ? ": the device is full, its memory held by other processes, sgm's "
                                 "or not (sgm-smi shows them), though this process is within its "
                                 "budget" : "",
                          sgm__fmt_bytes(p->p.budget_bytes, b, sizeof b),
                          sgm__fmt_bytes(p->held_bytes, u, sizeof u), (unsigned long long)p->n_blocks,
                          sgm__fmt_bytes(tier_committed(p), c, sizeof c));
}

/* Count one alloc or free of asked bytes (d_used > 0: alloc) on the
 * magazine. Used bytes reach the pool in batches, or at once when the thread
 * is the pool's only one (so that peak_used_bytes is exact then); the other
 * counters are summed by sgm__tier_stats. Owner thread only. */
static inline void tier_mag_count(sgm_tier_pool *p, tier_mag *m, int64_t d_used) {
  bool alloc = d_used > 0;
  int64_t du = __atomic_load_n(&m->d_used, __ATOMIC_RELAXED) + d_used;
  uint64_t *n = alloc ? &m->n_allocs : &m->n_frees;
  __atomic_store_n(n, __atomic_load_n(n, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
  /* Flushed when past the bound, and when an allocation takes the pending
   * use past the room below the peak that the last flush left: for one
   * thread the peak stays exact. Not at every count: the atomic add on the
   * pool's shared line was two of the churn pair's slowest instructions
   * (issue 26), and reading the pool's use at every count instead missed the
   * cache whenever another thread had flushed (alloc.scaling.2t). Counts no
   * magazine made (sgm's own blocks) move the pool's used_epoch, which makes
   * the room stale; other magazines' flushes do not (each would make every
   * other magazine flush at its next allocation): the peak may then lag by
   * what magazines hold back, as the bound allows. sgm__tier_stats adds what
   * magazines hold back. */
  if (du >= p->mag_flush_bytes || du <= -p->mag_flush_bytes ||
      (alloc && (du > __atomic_load_n(&m->peak_room, __ATOMIC_RELAXED) ||
                 __atomic_load_n(&p->used_epoch, __ATOMIC_RELAXED) !=
                     __atomic_load_n(&m->peak_epoch, __ATOMIC_RELAXED)))) {
    __atomic_store_n(&m->peak_epoch, __atomic_load_n(&p->used_epoch, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    tier_count_used(p, du, 0, 0, 0);
    du = 0;
    int64_t room = (int64_t)__atomic_load_n(&p->peak_used_bytes, __ATOMIC_RELAXED) -
                   (int64_t)__atomic_load_n(&p->used_bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&m->peak_room, room > 0 ? room : 0, __ATOMIC_RELAXED);
  }
  __atomic_store_n(&m->d_used, du, __ATOMIC_RELAXED);
}

/* First and last granule a block [off, off + bytes) touches (vmm.c). */
static inline void tier_vmm_span(const sgm_tier_pool *p, uint64_t off, uint64_t bytes, size_t *g0,
                                 size_t *g1) {
  *g0 = (size_t)((off - p->vmm_base) >> p->vmm_shift);
  *g1 = (size_t)((off - p->vmm_base + bytes - 1) >> p->vmm_shift);
}

/* Held bytes grew (a carve, pool lock held): the peak that the unmapping
 * slack measures from follows (vmm.c, tier_vmm_slack). */
static inline void tier_vmm_held_grew(sgm_tier_pool *p) {
  if (p->held_bytes > p->vmm_held_peak) p->vmm_held_peak = p->held_bytes;
}

/* Start loading the granule records of a block [off, off + bytes) that a
 * carve is about to reference or a release to dereference (vmm.c), while the
 * rest of the carve or the allocation before the release runs: under perf,
 * the first load of a granule's record and of its mapping's head were the
 * misses of sgm__pool_vmm_back_locked and sgm__pool_vmm_unref_locked, 6% of
 * the 10,000-block churn's time (issue 26). Its first and last granules'
 * lines (a block of a few granules spans one or two); nothing waits for it. */
static inline void tier_vmm_prefetch(const sgm_tier_pool *p, uint64_t off, uint64_t bytes) {
  if (!p->vmm_range) return;
  size_t g0, g1;
  tier_vmm_span(p, off, bytes, &g0, &g1);
  __builtin_prefetch(&p->gran[g0], 1);
  __builtin_prefetch(&p->gran[g1], 1);
}

/* Cross-file functions, by file, bottom to top: a file calls only the files
 * listed above it (docs/architecture.md; tests/check_layers.py holds lib/ to
 * it: a circle among these files fails the layer check). */

/* map.c */
uint32_t sgm__pool_lineage_take_locked(sgm_tier_pool *p);
tier_block *sgm__pool_record_cut_locked(sgm_tier_pool *p, uint32_t lin, bool lend);
tier_block *sgm__pool_record_own_locked(sgm_tier_pool *p, tier_block *b, uint32_t lin);
tier_block *sgm__pool_map_busy_live(sgm_tier_pool *p, sgm_devptr ptr);
bool sgm__pool_map_insert(sgm_tier_pool *p, tier_block *b, uint64_t h);
tier_block *sgm__pool_map_lookup(sgm_tier_pool *p, sgm_devptr ptr);
uint64_t sgm__pool_map_prefetch(sgm_tier_pool *p, sgm_devptr ptr, uint64_t bytes);
void sgm__pool_map_remove(sgm_tier_pool *p, tier_block *b);
tier_block *sgm__pool_map_take_live(sgm_tier_pool *p, sgm_devptr ptr, bool own);
void sgm__pool_map_unbusy(tier_block *b);
void sgm__pool_spare_put_locked(sgm_tier_pool *p, tier_block *b);
/* A record for a carve or a swap (map.c) by lineage lin: one of its spare
 * records, else (lend) another lineage's spare record past what that one
 * keeps, else one cut from its slab or a new one (pool lock held); NULL when
 * out of host memory. A swap lends none: it is there to give a block a
 * record of lineage lin. Its tag is 0 or another block's old one: the
 * caller stores the new tag atomically (lock-free readers may still read
 * it). The spare one inline: a large pair of the churn takes one. */
static inline tier_block *tier_record_new_locked(sgm_tier_pool *p, uint32_t lin, bool lend) {
  tier_lineage *l = &p->lin[lin];
  tier_block *b = l->spare;
  if (sgm_unlikely(!b)) return sgm__pool_record_cut_locked(p, lin, lend);
  l->spare = b->next;
  l->n_spare--;
  return b;
}
void sgm__pool_span_add(sgm_tier_pool *p, sgm_devptr base, uint64_t bytes);

/* stream.c */
void sgm__pool_bag_push(tier_bag *g, tier_block *b);
tier_block *sgm__pool_bag_take(tier_bag *g, int cls, uint64_t need);
void sgm__pool_bagged_add_locked(sgm_tier_pool *p, int64_t n, int64_t bytes);
void *sgm__pool_event_get(sgm_tier_pool *p);
void sgm__pool_event_put(sgm_tier_pool *p, void *ev);
void sgm__pool_event_put_locked(sgm_tier_pool *p, void *ev);
tier_job *sgm__pool_jobs_alloc_locked(sgm_tier_pool *p, size_t n_jobs);
tier_stream *sgm__pool_stream_find_locked(sgm_tier_pool *p, uint64_t key);
tier_stream *sgm__pool_stream_get_locked(sgm_tier_pool *p, const sgm_stream_ref *ref);
void sgm__pool_stream_note_locked(tier_stream *s, int cls, uint64_t need);

/* owe.c */
bool sgm__pool_owed_needs_locked(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_devptr lo,
                                 sgm_devptr hi);
int sgm__pool_owed_order(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_devptr lo, sgm_devptr hi);
void sgm__pool_owed_seen_locked(sgm_tier_pool *p, tier_stream *s, uint64_t seq);
bool sgm__pool_owed_settle(sgm_tier_pool *p);
void sgm__pool_owed_recorded_locked(tier_stream *s, int rc);

/* vmm.c */
int sgm__pool_vmm_back_locked(sgm_tier_pool *p, uint64_t off, uint64_t bytes);
uint64_t sgm__pool_vmm_cap_locked(const sgm_tier_pool *p);
bool sgm__pool_vmm_check_locked(sgm_tier_pool *p, const sgm_suballoc_stats *st);
int sgm__pool_vmm_pool_setup(sgm_tier_pool *p);
void sgm__pool_vmm_settle(sgm_tier_pool *p);
/* Committed is over the cap with free mapped granules: sgm__pool_vmm_settle
 * would unmap them (pool lock held). */
bool sgm__pool_vmm_pressure_locked(const sgm_tier_pool *p);
bool sgm__pool_vmm_ref_backed_locked(sgm_tier_pool *p, uint64_t off, uint64_t bytes, uint64_t *unmapped);
bool sgm__pool_vmm_setup(sgm_tier_pool *p);
void sgm__pool_vmm_teardown(sgm_tier_pool *p);
uint64_t sgm__pool_vmm_unmap_free(sgm_tier_pool *p);
void sgm__pool_vmm_unref_locked(sgm_tier_pool *p, uint64_t off, uint64_t bytes);

/* chunk.c */
int sgm__pool_add_chunk_locked(sgm_tier_pool *p, const sgm_chunk *c);
size_t sgm__pool_detach_free_locked(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms,
                                    sgm_chunk **out);
uint64_t sgm__pool_next_chunk_locked(sgm_tier_pool *p, uint64_t need, bool *dedicated);
void sgm__pool_release_block_locked(sgm_tier_pool *p, tier_block *b);
uint64_t sgm__pool_release_chunks(sgm_tier_pool *p, sgm_chunk *list, size_t n);
int sgm__pool_take_chunk(sgm_tier_pool *p, uint64_t bytes, uint64_t need, sgm_chunk *out);

/* bag.c */
void sgm__pool_bag_add_locked(sgm_tier_pool *p, tier_block *b);
void sgm__pool_bag_merge(tier_bag *dst, tier_bag *src);
void sgm__pool_bag_release_locked(sgm_tier_pool *p, tier_bag *g);
size_t sgm__pool_bags_release_all_locked(sgm_tier_pool *p);
size_t sgm__pool_reclaim_fences(sgm_tier_pool *p, sgm_reclaim_mode mode);

/* mag.c */
void sgm__pool_mag_detach_all(sgm_tier_pool *p);
void sgm__pool_mag_drain_locked(sgm_tier_pool *p, tier_mag *m);
void sgm__pool_mags_stop_locked(sgm_tier_pool *p, tier_mag *only);
void sgm__pool_mags_go_locked(sgm_tier_pool *p, tier_mag *only);
tier_block *sgm__pool_stash_settle_locked(sgm_tier_pool *p, tier_mag *m, uint64_t need,
                                          const sgm_stream_ref *ref);
tier_mag *sgm__pool_mag_find(sgm_tier_pool *p);
tier_mag *sgm__pool_mag_get(sgm_tier_pool *p);

/* xfer.c */
size_t sgm__pool_reclaim_transfer(sgm_tier_pool *p, const sgm_stream_ref *taker,
                                  const tier_want *w);
const tier_want *sgm__pool_want_recent_locked(sgm_tier_pool *p, const sgm_stream_ref *taker,
                                              const tier_want *w, tier_want *out);

/* reclaim.c */
bool sgm__pool_owed_return_locked(sgm_tier_pool *p, const sgm_stream_ref *ref, bool mags);
size_t sgm__pool_reclaim_ex(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode);
size_t sgm__pool_reclaim_settle(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode,
                                const tier_want *w);
size_t sgm__pool_reclaim_some(sgm_tier_pool *p, bool mags, sgm_reclaim_mode mode);

/* budget.c: sgm__tier_trim, _idle_trim, _set_budget(_why), _charge, _uncharge,
 * _charged (tier.h). alloc.c: the user's path (tier.h). pool.c: create,
 * destroy, stats, the check (tier.h). */

#endif /* SGM_TIERS_POOL_H */
