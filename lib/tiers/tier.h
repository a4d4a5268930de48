/*
 * tier.h — what every tier provides, and the chunk pool they share.
 *
 * A tier pool holds chunks of memory taken from the backend (VRAM chunks,
 * pinned host chunks) and carves them with the sub-allocator. The
 * sub-allocator's offset space is the device address space itself: each chunk
 * is added as a range at its device address, so a block's offset *is* the
 * pointer handed out. A map of the pool's blocks (sharded, written under the
 * pool lock, read with no lock and no shared write) finds a pointer's block on
 * free; a pointer that is not the start of a live block is refused.
 *
 * Growth mode: chunks are taken on demand, geometrically growing from
 * growth_chunk_bytes; a block larger than the next chunk gets a chunk of its
 * own; committed bytes never exceed the budget. A chunk the device refuses for
 * lack of memory is retried at halved sizes down to what the block needs
 * before the allocation fails (and falls back a tier). Reserve mode: one chunk of the
 * whole budget is taken at create and kept until destroy.
 *
 * Expandable growth (DESIGN.md §8, issue 17): with params.vmm in growth mode
 * and a backend with a virtual-memory API, the pool reserves one range of
 * device addresses for the whole budget at create and the sub-allocator
 * carves that one range: blocks never fragment across chunks. Memory is
 * mapped behind it granule by granule when a block first touches a granule,
 * and unmapped when no block of the sub-allocator touches it any more (a
 * block reaches the sub-allocator only once the work of its stream is seen
 * complete, or its own stream returned it and is then waited for before any
 * unmap, so no queued work uses an unmapped granule), with hysteresis:
 * when a block needs new granules and the free mapped ones pass a slack
 * (TIER_VMM_SLACK_*; down to it, the tops of the two piles of blocks
 * first), on trim, on idle trim (no
 * allocation for the idle delay) and under budget pressure. Before mapping, cached blocks that could cover the new granules are
 * reclaimed. committed = mapped bytes. The range covers the device's memory
 * (params.vmm_range_bytes), so a budget raised later still fits it. Without VMM (device, backend, option,
 * budget below a granule) the pool grows in chunks as below.
 *
 * Reserve mode on the virtual-memory API (issue 17): the same range, twice
 * the budget at least, but the budget's granules are taken from the backend
 * at create as a pool (vmm_pool_*); a granule a block touches is mapped from
 * the pool, and free mapped granules are unmapped back into the pool (never
 * to the driver) only when the pool runs out. committed_bytes counts the
 * mapped granules as in growth mode; the stats report the pool. Without VMM
 * reserve mode takes one chunk of the budget.
 *
 * Stream-ordered caches (DESIGN.md §8 "Streams"). A block the user frees on a
 * stream stays allocated in the sub-allocator and is cached for that stream:
 * first in the freeing thread's magazine (small stacks per size class, no
 * shared lock), then in the stream's bag under the pool lock. An allocation on
 * a stream takes its own stream's cached blocks with no driver call; another
 * stream gets them only through an event recorded on the owner and waited on
 * by the taker on the device (a transfer: one record and one wait per owner
 * stream, covering every block it holds; refused while either stream
 * captures a CUDA graph), and the sub-allocator gets them back (for every stream)
 * only once a fence event recorded on the owner has been *seen* complete — or
 * at once, with no event, when the owner's own allocation would otherwise need
 * new memory (it may reuse them for any size: its work runs in order); the
 * owner then *owes*, and others are ordered after it (pool/owe.c).
 * A synchronous backend has one stream for everything and no events.
 * "used" counts blocks handed out to the user; cached blocks are counted in
 * cached_bytes (and committed), not in used.
 *
 * Threading: one lock per pool (rank = the tier's) for the sub-allocator, the
 * chunks and the bags; a magazine per thread, changed by its owner thread in
 * sections that take no lock, and by reclaimers under the pool lock once they
 * stopped its owner (pool/pool.h, tier_mag_enter); the live-block map is
 * changed under the pool lock and read lock-free (a block's tag word, compared
 * and swapped, decides who frees it). Order: magazine registry -> pool lock ->
 * magazine. The pool lock is
 * never held across a backend call: growing reserves the bytes under the lock
 * (committed_bytes += chunk, so concurrent growers cannot overshoot the
 * budget), drops it, calls the backend, and retakes it to add the range.
 */
#ifndef SGM_TIER_H
#define SGM_TIER_H

#include "backend/backend.h"
#include "internal.h"

typedef struct sgm_tier_pool sgm_tier_pool; /* opaque: defined in pool/pool.h */

/* A pool's first member: what the inline check below reads without a call. */
typedef struct sgm_tier_head {
  uint64_t room_bytes;        /* budget - held, read without the lock (atomic; written under it) */
  sgm_devptr span_lo;         /* lowest address ever given to the sub-allocator (atomic; UINT64_MAX: none) */
  sgm_devptr span_hi;         /* past the highest one (atomic): sgm__tier_may_own's span, never shrinks */
} sgm_tier_head;

typedef struct sgm_chunk {
  sgm_devptr base; /* device address of the first byte; the range's offset */
  void *host;      /* host address of the first byte (shared tier), NULL for VRAM */
  uint64_t bytes;  /* size of the chunk */
  bool dedicated;  /* taken for one block larger than a growth chunk */
  uint64_t free_seen_ms; /* idle trim: clock time it was first seen wholly free; UINT64_MAX = in use */
} sgm_chunk;

/* How a tier gets memory from the backend; called without the pool lock. */
typedef struct sgm_chunk_ops {
  int (*chunk_alloc)(sgm_tier_pool *p, uint64_t bytes, sgm_chunk *out);
  void (*chunk_free)(sgm_tier_pool *p, const sgm_chunk *c);
} sgm_chunk_ops;

/* What a tier pool is created with. */
typedef struct sgm_tier_params {
  sgm_tier tier;               /* which tier this pool is */
  const sgm_chunk_ops *ops;    /* chunk source */
  const sgm_backend_ops *bops; /* the backend the chunk source calls */
  sgm_backend *be;             /* the opened device */
  uint64_t budget_bytes;       /* committed never exceeds this */
  bool growth;                 /* true: grow on demand; false: reserve the budget now */
  uint64_t growth_chunk_bytes; /* the first chunk in growth mode */
  uint64_t max_chunk_bytes;    /* growth chunks stop doubling here */
  const char *limit_hint;      /* the variables that raise this budget, for messages */
  int verbose;                 /* log level */
  bool vmm;                    /* growth on one reserved range when the backend can (issue 17) */
  uint64_t vmm_range_bytes;    /* that range: the most the budget may become (device memory;
                                  fair shares move budgets); below the budget = the budget */
} sgm_tier_params;

/* How far sgm__tier_reclaim goes to give cached blocks back. */
typedef enum sgm_reclaim_mode {
  SGM_RECLAIM_QUERY = 0,    /* fence every stream's cache; return what the driver says is done */
  SGM_RECLAIM_TRANSFER = 1, /* hand other streams' caches to the taker (device-side wait) */
  SGM_RECLAIM_WAIT = 2      /* wait on the host for every stream's work, return everything */
} sgm_reclaim_mode;

/* lib/tiers/pool (one job a file: see pool/pool.h) */

/* Create a pool; in reserve mode this takes the whole budget (as a pool of
 * granules on the virtual-memory API, else as one chunk). */
int sgm__tier_create(const sgm_tier_params *params, sgm_tier_pool **out);
/* Wait for pending work, return every chunk to the backend and free the pool. NULL is a no-op. */
void sgm__tier_destroy(sgm_tier_pool *p);
/* The parameters the pool was created with (read-only; the budget may have changed since). */
const sgm_tier_params *sgm__tier_params(const sgm_tier_pool *p);
/* Returned by sgm__tier_alloc when the budget is full; no message is set. */
#define SGM__ERR_BUDGET (-100)
/* Allocate size bytes (aligned to SGM_DEVICE_ALIGN) from the sub-allocator, for
 * sgm itself (buffers, migrations): no cache is used; while a stream owes
 * (gave its cache back with its work pending, pool/owe.c) the host waits for
 * that work first. *out = 0 on failure, and
 * then: SGM__ERR_BUDGET (no message: call sgm__tier_explain_budget when one is
 * needed), or a status with a message (the backend failed to give a chunk). */
int sgm__tier_alloc(sgm_tier_pool *p, uint64_t size, sgm_devptr *out);
/* Allocate for the user on stream: the stream's cache first (no driver call),
 * then the sub-allocator (the stream's own cache given back to it first when
 * new memory would be needed or a large block is placed, no driver call; the
 * block ordered on the device after other streams that gave theirs back,
 * pool/owe.c), then cached blocks of other streams (TRANSFER to this stream,
 * then QUERY). Errors as sgm__tier_alloc. */
int sgm__tier_alloc_on(sgm_tier_pool *p, uint64_t size, const sgm_stream_ref *stream,
                       sgm_devptr *out);
/* The fallback path's first step, without the pool lock: true when
 * sgm__tier_alloc_on(p, size) would answer SGM__ERR_BUDGET at once, because
 * the budget leaves no room for its block and the pool holds no cached block
 * to reclaim (counted as a failed attempt, as alloc_on counts it). A hint: a
 * free racing with it may leave room a moment later, and the block then lands
 * one tier down, as it would have a moment earlier. */
bool sgm__tier_full_for(sgm_tier_pool *p, uint64_t size);
/* Does the budget leave room for a block of size bytes, whatever its size
 * class rounds it to (+25% at most, after SGM_DEVICE_ALIGN)? Inline, one
 * load: the allocation path asks it before sgm__tier_full_for, so that with
 * room it pays nothing for the fallback's fast path. false says nothing
 * (ask sgm__tier_full_for); true, like it, is a hint. */
static inline bool sgm__tier_room_for(const sgm_tier_pool *p, uint64_t size) {
  uint64_t room = __atomic_load_n(&((const sgm_tier_head *)(const void *)p)->room_bytes, __ATOMIC_RELAXED);
  uint64_t bound = size + SGM_DEVICE_ALIGN; /* no overflow: size < room */
  return size < room && bound + (bound >> 2) <= room;
}
/* sgm__tier_full_for calls the calling thread has made so far, on any pool
 * (tests: the path with room makes none). */
uint64_t sgm__tier_full_checks(void);
/* Set the thread's message for a full budget: the budget, the use, the largest
 * free block and the variables that raise it; returns SGM_ERR_NOMEM. */
int sgm__tier_explain_budget(sgm_tier_pool *p, uint64_t size);
/* Free a block now, for everyone (sgm's own blocks: no device work uses them);
 * SGM_ERR_INVALID (nothing changed, no message set) when ptr is not a live
 * block of this pool. *size_out: its size as counted in used. */
int sgm__tier_free(sgm_tier_pool *p, sgm_devptr ptr, uint64_t *size_out);
/* The user's stream-ordered free: ptr is cached for `stream` (reusable by its
 * work at once, by others through an event). Blocks named by
 * sgm__tier_record_stream wait for those streams first. SGM_ERR_INVALID (no
 * message) when ptr is not a live block; another status with a message when
 * an event for a recorded stream could not be recorded (the block stays live). */
int sgm__tier_free_on(sgm_tier_pool *p, sgm_devptr ptr, const sgm_stream_ref *stream);
/* sgm__tier_free_on for a block sgm took for itself (sgm__tier_alloc): a
 * buffer destroyed while the work queued before its release may still use
 * its block (issue 24). Same results. */
int sgm__tier_free_own_on(sgm_tier_pool *p, sgm_devptr ptr, const sgm_stream_ref *stream);
/* Declare that work on `stream` uses the live block ptr: its free then waits
 * for that work too. SGM_ERR_INVALID (no message) when ptr is not a live
 * block; SGM_ERR_NOMEM with a message when out of host memory. */
int sgm__tier_record_stream(sgm_tier_pool *p, sgm_devptr ptr, const sgm_stream_ref *stream);
/* Give cached blocks back (see sgm_reclaim_mode); taker is the stream that
 * receives other streams' blocks in TRANSFER mode (NULL otherwise). Returns the
 * number of blocks returned to the sub-allocator or transferred. Takes the
 * pool lock (and the magazines'); calls the driver (event record, query,
 * stream wait) and in WAIT mode blocks until every stream's work is done:
 * call it with no residency or placement lock held. No status: a block whose
 * work is not known to be done stays cached. */
size_t sgm__tier_reclaim(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode);
/* True when the pool may hold cached blocks (a hint, read without the lock). */
bool sgm__tier_has_cached(sgm_tier_pool *p);
/* False when ptr lies outside every range the pool was ever given (read
 * without a lock): then it is surely not the pool's; true means "look it up".
 * A pointer the caller got from this pool is always inside. */
static inline bool sgm__tier_may_own(const sgm_tier_pool *p, sgm_devptr ptr) {
  const sgm_tier_head *h = (const sgm_tier_head *)p;
  return ptr >= __atomic_load_n(&h->span_lo, __ATOMIC_RELAXED) &&
         ptr < __atomic_load_n(&h->span_hi, __ATOMIC_RELAXED);
}
/* True when ptr is the start of a live (handed out) block of this pool. */
bool sgm__tier_owns(sgm_tier_pool *p, sgm_devptr ptr);
/* True when ptr is the start of a live block sgm took for itself with
 * sgm__tier_alloc (a buffer's storage): the user's sgm__tier_free_on and
 * sgm__tier_record_stream refuse those as not theirs. */
bool sgm__tier_owns_own(sgm_tier_pool *p, sgm_devptr ptr);
/* Return cached blocks (waiting on the host for their streams' work) and then
 * wholly free chunks to the backend (growth mode only); bytes returned. */
uint64_t sgm__tier_trim(sgm_tier_pool *p);
/* Change the budget; when it drops below what is committed, free chunks are
 * returned at once and further growth waits until use falls below it. */
void sgm__tier_set_budget(sgm_tier_pool *p, uint64_t budget_bytes);
/* The same, with why the budget is what it is for the budget-exhausted
 * message (NULL or "": the options in limit_hint). */
void sgm__tier_set_budget_why(sgm_tier_pool *p, uint64_t budget_bytes, const char *why);
/* Idle trim (growth mode): return chunks seen wholly free for at least
 * idle_ms, judged by now_ms from the context's clock; bytes returned. A chunk
 * is first "seen free" by one call and returned by a later one, so calls
 * should come every idle_ms / 4 or so. Expandable growth: every free granule,
 * once the pool has made no allocation for idle_ms (counted from the first
 * call that saw the pool's allocation count stop moving). */
uint64_t sgm__tier_idle_trim(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms);
/* Copy up to max live chunks into out (oldest first); returns how many there are. */
size_t sgm__tier_chunks(sgm_tier_pool *p, sgm_chunk *out, size_t max);
/* The chunk holding device address ptr (copied into *out); false when none. */
bool sgm__tier_chunk_of(sgm_tier_pool *p, sgm_devptr ptr, sgm_chunk *out);
/* Counters (the migration fields are left 0 here). */
void sgm__tier_stats(sgm_tier_pool *p, sgm_tier_stats *out);
/* How often the pool lock was taken so far (tests: the steady-state alloc/free
 * path on a thread's magazine takes it rarely, issue 10). */
uint64_t sgm__tier_lock_takes(const sgm_tier_pool *p);
/* How often the live map's shared lines were written so far (records
 * inserted or unlinked, under the pool lock): tests check that a free, which
 * looks its block up there, writes nothing another thread reads (issue 10). */
uint64_t sgm__tier_map_writes(const sgm_tier_pool *p);
/* Expandable growth: the granule size when the pool grows on one reserved
 * range (0 when it grows in chunks or reserves), and the range's bytes. */
void sgm__tier_vmm_info(sgm_tier_pool *p, uint64_t *granule_bytes, uint64_t *reserved_bytes);
/* Expandable growth: backend calls that mapped or unmapped granules so far
 * (any thread, no lock: an atomic counter). */
uint64_t sgm__tier_vmm_calls(const sgm_tier_pool *p);
/* Expandable growth: bytes of the mappings no block touches (what a trim
 * would unmap now; a mapping is unmapped whole, issue 26). */
uint64_t sgm__tier_vmm_free_mapped(const sgm_tier_pool *p);
/* Reserve mode on the virtual-memory API: the budget was taken at create as a
 * pool of granules, mapped into the range where blocks land (issue 17). */
bool sgm__tier_vmm_pooled(const sgm_tier_pool *p);
/* Walk the pool and check every invariant; false with a message on the first broken one. */
bool sgm__tier_check(sgm_tier_pool *p);

/* Managed blocks (lib/placement/managed.c) live outside the pool but count against its
 * budget by where they are placed. Charge bytes (committed and held, never
 * past the budget: cached blocks and free chunks are given back first) or
 * SGM__ERR_BUDGET (no message); uncharge gives them back. Any thread. */
int sgm__tier_charge(sgm_tier_pool *p, uint64_t bytes);
void sgm__tier_uncharge(sgm_tier_pool *p, uint64_t bytes);
/* Bytes charged now. */
uint64_t sgm__tier_charged(sgm_tier_pool *p);

/* vram.c: the chunk source of the VRAM tier (device memory from the backend). */
extern const sgm_chunk_ops sgm__vram_chunk_ops;
/* shared.c: the chunk source of the shared tier (pinned, device-mapped host memory). */
extern const sgm_chunk_ops sgm__shared_chunk_ops;
/* Host address of a device address inside a live shared chunk; NULL if none. */
void *sgm__shared_host_ptr(sgm_tier_pool *p, sgm_devptr ptr);

#endif /* SGM_TIER_H */
