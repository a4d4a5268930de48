/*
 * tier.h — what every tier provides, and the chunk pool they share.
 *
 * A tier pool holds chunks of memory taken from the backend (VRAM chunks,
 * pinned host chunks) and carves them with the sub-allocator. The
 * sub-allocator's offset space is the device address space itself: each chunk
 * is added as a range at its device address, so a block's offset *is* the
 * pointer handed out, and freeing a pointer needs no lookup table (a pointer
 * that is not the start of a live block is refused by the sub-allocator).
 *
 * Growth mode: chunks are taken on demand, geometrically growing from
 * growth_chunk_bytes; a block larger than the next chunk gets a chunk of its
 * own; committed bytes never exceed the budget. A chunk the device refuses for
 * lack of memory is retried at halved sizes down to what the block needs
 * before the allocation fails (and falls back a tier). Reserve mode: one chunk of the
 * whole budget is taken at create and kept until destroy.
 *
 * Threading: one lock per pool (rank = the tier's). The lock is never held
 * across a backend call: growing reserves the bytes under the lock
 * (committed_bytes += chunk, so concurrent growers cannot overshoot the
 * budget), drops it, calls the backend, and retakes it to add the range.
 */
#ifndef SGM_TIER_H
#define SGM_TIER_H

#include "backend/backend.h"
#include "internal.h"

typedef struct sgm_tier_pool sgm_tier_pool;

/* A block freed on a stream whose work may still use it (stream-ordered free:
 * reusable by work on the same stream at once, by others after the event). */
typedef struct sgm_pending_free {
  sgm_devptr ptr; /* the block, still allocated in the sub-allocator */
  void *stream;   /* the stream it was freed on */
  void *event;    /* recorded on that stream at the free */
} sgm_pending_free;

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
} sgm_tier_params;

struct sgm_tier_pool {
  sgm_lock lock;              /* guards everything below but the params */
  sgm_tier_params p;          /* set at create, read-only after */
  sgm_suballoc *sa;           /* carves the chunks; offsets are device addresses */
  sgm_chunk *chunks;          /* live chunks, in the order they were taken */
  size_t n_chunks;            /* entries used in chunks */
  size_t cap_chunks;          /* entries allocated in chunks */
  unsigned n_geometric;       /* growth chunks taken so far: the next is initial << this */
  uint64_t committed_bytes;   /* chunk bytes taken or being taken from the backend */
  uint64_t used_bytes;        /* bytes of live blocks (rounded to the alignment) */
  uint64_t peak_used_bytes;   /* highest used_bytes */
  uint64_t n_live;            /* live blocks */
  uint64_t n_allocs;          /* blocks handed out since create */
  uint64_t n_frees;           /* blocks freed since create */
  uint64_t n_failed;          /* allocations this pool could not serve (atomic) */
  uint64_t room_bytes;        /* budget - used, read without the lock (atomic; written under it) */
  bool budget_lowered;        /* set_budget went below committed: committed may exceed it */
  sgm_pending_free *pending;  /* blocks freed on a stream, not yet reusable by others */
  size_t n_pending;           /* entries used in pending (read without the lock: atomic) */
  size_t cap_pending;         /* entries allocated */
  unsigned n_growing;         /* chunks being taken from the backend right now */
  pthread_cond_t grown;       /* broadcast when a chunk taking finishes */
};

/* tier.c */

/* Create a pool; in reserve mode this takes the whole budget as one chunk. */
int sgm__tier_create(const sgm_tier_params *params, sgm_tier_pool **out);
/* Return every chunk to the backend and free the pool. NULL is a no-op. */
void sgm__tier_destroy(sgm_tier_pool *p);
/* Returned by sgm__tier_alloc when the budget is full; no message is set. */
#define SGM__ERR_BUDGET (-100)
/* Allocate size bytes (aligned to SGM_DEVICE_ALIGN). *out = 0 on failure, and
 * then: SGM__ERR_BUDGET (no message: call sgm__tier_explain_budget when one is
 * needed), or a status with a message (the backend failed to give a chunk). */
int sgm__tier_alloc(sgm_tier_pool *p, uint64_t size, sgm_devptr *out);
/* Set the thread's message for a full budget: the budget, the use, the largest
 * free block and the variables that raise it; returns SGM_ERR_NOMEM. */
int sgm__tier_explain_budget(sgm_tier_pool *p, uint64_t size);
/* Free a block; SGM_ERR_INVALID (nothing changed, no message set) when ptr is
 * not a live block of this pool. *size_out: its size. */
int sgm__tier_free(sgm_tier_pool *p, sgm_devptr ptr, uint64_t *size_out);
/* Stream-ordered free: ptr becomes reusable once event completes (or at once
 * by work on stream). SGM_ERR_INVALID when ptr is not a live block or is
 * already pending (a double free). Takes ownership of event on success. */
int sgm__tier_free_deferred(sgm_tier_pool *p, sgm_devptr ptr, void *stream, void *event);
/* Free pending blocks that work on `stream` may reuse (same stream, or event
 * complete); with wait, wait for every event and free all. Returns how many. */
size_t sgm__tier_reclaim(sgm_tier_pool *p, void *stream, bool wait);
/* Pending frees now (a hint, read without the lock). */
size_t sgm__tier_n_pending(sgm_tier_pool *p);
/* True when ptr is the start of a live block of this pool. */
bool sgm__tier_owns(sgm_tier_pool *p, sgm_devptr ptr);
/* Return wholly free chunks to the backend (growth mode only); bytes returned. */
uint64_t sgm__tier_trim(sgm_tier_pool *p);
/* Change the budget; when it drops below what is committed, free chunks are
 * returned at once and further growth waits until use falls below it. */
void sgm__tier_set_budget(sgm_tier_pool *p, uint64_t budget_bytes);
/* Idle trim (growth mode): return chunks seen wholly free for at least
 * idle_ms, judged by now_ms from the context's clock; bytes returned. A chunk
 * is first "seen free" by one call and returned by a later one, so calls
 * should come every idle_ms / 4 or so. */
uint64_t sgm__tier_idle_trim(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms);
/* Counters (the migration fields are left 0 here). */
void sgm__tier_stats(sgm_tier_pool *p, sgm_tier_stats *out);
/* Walk the pool and check every invariant; false with a message on the first broken one. */
bool sgm__tier_check(sgm_tier_pool *p);

/* vram.c: the chunk source of the VRAM tier (device memory from the backend). */
extern const sgm_chunk_ops sgm__vram_chunk_ops;
/* shared.c: the chunk source of the shared tier (pinned, device-mapped host memory). */
extern const sgm_chunk_ops sgm__shared_chunk_ops;
/* Host address of a device address inside a live shared chunk; NULL if none. */
void *sgm__shared_host_ptr(sgm_tier_pool *p, sgm_devptr ptr);

#endif /* SGM_TIER_H */
