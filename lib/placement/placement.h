/*
 * placement.h — what the placement files share, and nothing else sees:
 *
 *   placement.c       the placement state: create, destroy, stats, invariant walk
 *   buffer.c          the public sgm_buffer_* API
 *   buffer_state.c    the buffer states: taking a buffer and giving it back
 *   residency.c       DESIGN.md §3 in one file: the victim search, and where
 *                     an allocation or a buffer lands
 *   residency_host.c  the policy host: listing, pins, fresh buffers
 *   migrate.c         moving a buffer's data between tiers (demote, promote)
 *   migrate_order.c   the copy discipline: copies after the release's GPU work
 *   migrate_disk.c    a buffer's chunks on disk, the one-hop VRAM <-> disk moves
 *   prefetch.c        the prefetch queue and its worker
 *   managed.c         SGM_POINTERS=managed: movable framework blocks
 *   managed_queue.c   the managed moves handed to the prefetch worker (copy stream)
 *
 * A buffer's data lives in exactly one tier: a block of the VRAM or shared
 * pool (b->dptr), or extents of the spill file (b->ext, one per
 * SGM_DISK_CHUNK of the buffer, so a partial write rewrites only the chunks
 * it touches; none yet for a buffer created straight on disk and never
 * written: it reads as zeros).
 *
 * States: RELEASED (listed, or on disk), ACQUIRED, BUSY (one thread owns it
 * while moving or copying; others wait until it is not). Only the owner of a
 * BUSY buffer touches its data fields (tier, dptr, ext, event).
 *
 * Locking (the order is residency.c's top comment; ranks in internal.h):
 *  - b->state, one atomic word per buffer, says who owns b: a thread takes b
 *    by one compare-and-swap from RELEASED or ACQUIRED to BUSY (buffer_state.c,
 *    sgm__buffer_claim) and gives it back by one store; a thread that finds b
 *    BUSY sleeps on that word alone (a futex), so only b's owner wakes it;
 *  - pl->res[t] (ranks SGM_LOCK_RES_VRAM, SGM_LOCK_RES_SHARED), one per
 *    resident tier, guards that tier's policy instance, its items (listed,
 *    pinned, item, fresh of the buffers listed or pinned there) and
 *    n_listed[t]; it is the lock the policy contract calls "the tier lock".
 *    A released resident buffer is listed in its tier, so taking it (the
 *    compare-and-swap) and unlisting it happen under that tier's lock, and so
 *    do listing it and giving it back: under pl->res[t] a listed buffer is
 *    never BUSY, and the victim search owns what it picks;
 *  - pl->pf_lock (SGM_LOCK_PREFETCH) guards the prefetch queue;
 *  - pl->lock (SGM_LOCK_BUFFERS) guards the list of every buffer and the
 *    graveyard; the buffer calls take it only to create and destroy, the
 *    managed blocks only to create and give back a Unified Memory range;
 *  - pl->mlock (SGM_LOCK_MANAGED) guards the managed blocks' map, counters,
 *    fields (priority, touch, cold, ...) and the cache of freed ranges
 *    (managed.c): a steady-state alloc + free pair of a cached range takes
 *    it alone (the reused range's policy listing is deferred), never pl->lock;
 *  - the migration counters and n_disk_live are atomics.
 * No sgm lock is held across a copy, disk I/O, a pool call or a blocking
 * driver call: a mover takes the buffer BUSY, moves it with no lock held, and
 * gives it back. The one exception is the event query while choosing victims:
 * a non-blocking driver call, made under pl->res[t] so a chosen victim is
 * known to be idle.
 */
#ifndef SGM_PLACEMENT_H
#define SGM_PLACEMENT_H

#include "backend/backend.h"
#include "builtin.h"
#include "internal.h"
#include "sgm/policy.h"
#include "tiers/disk.h"

/* The parts the context hands down to placement (issue 31). The context
 * fills them at create, before any other thread sees it, and embeds this
 * struct as its first member (context.c asserts so), so that the placement
 * files read the backend, the tiers, the options and their own state from
 * this, their layer's, definition instead of calling up into context.c.
 * Written below the context only by placement.c (pl, at create and destroy)
 * and managed.c (managed, at create); read without a lock after create. */
typedef struct sgm_context_parts {
  const sgm_config *cfg;                       /* the context's configuration (never written after create) */
  const struct sgm_backend_ops *bops;          /* the backend's vtable (tests may put a spy in front) */
  struct sgm_backend *be;                      /* the opened device */
  struct sgm_tier_pool *tiers[SGM_TIER_COUNT]; /* VRAM and shared pools; NULL for disk (placement's) */
  const uint64_t *budget;                      /* [SGM_TIER_COUNT]: each tier's budget as resolved at
                                                  create (later changes: sgm__context_budgets) */
  struct sgm_placement *pl;                    /* buffers, residency lists, disk tier, prefetch */
  bool managed;                                /* SGM_POINTERS resolved to managed (managed.c) */
  unsigned fork_generation;                    /* sgm__fork_watch() at create (prim/fork.c) */
  long owner_pid;                              /* the process that created it (messages only) */
} sgm_context_parts;

static inline const sgm_context_parts *sgm__parts(const sgm_context *ctx) {
  return (const sgm_context_parts *)(const void *)ctx;
}
static inline sgm_context_parts *sgm__parts_w(sgm_context *ctx) { return (sgm_context_parts *)(void *)ctx; }
static inline const sgm_config *sgm__parts_cfg(const sgm_context *ctx) { return sgm__parts(ctx)->cfg; }
static inline const struct sgm_backend_ops *sgm__parts_bops(const sgm_context *ctx) { return sgm__parts(ctx)->bops; }
static inline struct sgm_backend *sgm__parts_be(const sgm_context *ctx) { return sgm__parts(ctx)->be; }
static inline struct sgm_tier_pool *sgm__parts_tier(const sgm_context *ctx, sgm_tier t) {
  return sgm__parts(ctx)->tiers[t];
}
static inline uint64_t sgm__parts_budget(const sgm_context *ctx, sgm_tier t) { return sgm__parts(ctx)->budget[t]; }
static inline struct sgm_placement *sgm__parts_pl(const sgm_context *ctx) { return sgm__parts(ctx)->pl; }
static inline bool sgm__parts_managed(const sgm_context *ctx) { return sgm__parts(ctx)->managed; }
/* The context's fork check (sgm__context_forked / _fork_error, from its parts). */
static inline bool sgm__parts_forked(const sgm_context *ctx) {
  return sgm__fork_stale(sgm__parts(ctx)->fork_generation);
}
static inline int sgm__parts_fork_error(const sgm_context *ctx, const char *fn) {
  return sgm__fork_error(sgm__parts(ctx)->owner_pid, fn);
}

#define SGM_N_RESIDENT 2 /* VRAM and shared: the tiers with policies */
/* A disk-resident buffer is stored as extents of this many bytes (the last
 * shorter): a write of 1 MiB into a 64 MiB buffer reads and rewrites 4 MiB,
 * not 64, and stages no more than that in RAM; 4 MiB is also the bounce
 * size of the disk tier and keeps a spill's direct I/O in requests of that
 * size (docs/disk.md). */
#define SGM_DISK_CHUNK (UINT64_C(4) << 20)
/* Buckets of the managed blocks' address map: a power of two; a framework
 * holds hundreds to a few thousand blocks of 2 MiB and more. */
#define SGM_MANAGED_BUCKETS 1024
/* A managed counter written under pl->mlock and read without it (managed.c, managed_queue.c). */
#define MANAGED_BUMP(x, d) __atomic_store_n(&(x), (x) + (d), __ATOMIC_RELAXED)

typedef enum sgm_buf_state { SGM_BUF_RELEASED, SGM_BUF_ACQUIRED, SGM_BUF_BUSY } sgm_buf_state;

/* b->magic: a live buffer, and one sgm_buffer_destroy has finished with
 * (debug builds keep the latter's memory a while to recognise it: see
 * sgm__buffer_check). Behind ctx and size: malloc keeps its free-list links
 * in a freed block's first 16 bytes. */
#define SGM_BUFFER_LIVE 0x5B0FFE21u
#define SGM_BUFFER_DEAD 0xDEADB0F5u

struct sgm_buffer {
  sgm_context *ctx;          /* owner */
  uint64_t size;             /* bytes asked for */
  uint32_t magic;            /* SGM_BUFFER_LIVE, SGM_BUFFER_DEAD once destroyed */
  sgm_tier tier;             /* where the data is now (see sgm__buffer_set_tier) */
  sgm_devptr dptr;           /* block address in VRAM / shared; 0 on disk */
  sgm_disk_extent *ext;      /* on disk: one extent per SGM_DISK_CHUNK of data (bytes 0: that
                                chunk never written, zeros); NULL: none (zeros) or not on disk */
  uint32_t state;            /* sgm_buf_state | SGM_BUF_WAITERS | generation: sgm__buffer_state */
  int priority;              /* sgm_priority the user set (atomic: sgm_buffer_set_priority) */
  void *event;               /* GPU work queued before release; NULL = none pending */
  void *event_stream;        /* the stream event was recorded on (the release's) */
  bool prefetch_queued;      /* in pl's prefetch queue (written under pl->pf_lock; atomic) */
  bool listed;               /* an item of pl->pol[tier] now */
  bool pinned;               /* pl->pol[pin_tier] holds a pin on it (on_remove PIN) */
  bool fresh;                /* entered its tier unused: its first acquire is no hit */
  sgm_tier pin_tier;         /* the tier whose policy holds the pin, when pinned */
  uint8_t listed_in;         /* the tier whose policy lists it now, SGM_N_RESIDENT when none
                                (atomic: hints.c reads a parent's under the child's tier lock) */
  sgm_policy_item item;      /* what policies see; item.priority = the level holding it */
  /* Residency hints (hints.c): the parent (prefix) buffer the application
   * named and the children naming this one (siblings linked). Written under
   * both residency locks, read under either. item.hint and
   * item.will_use_distance: written under both, or by the owner under its
   * tier's lock (a use ends them: sgm__residency_put). */
  sgm_buffer *hparent, *hchild, *hsib_prev, *hsib_next;
  sgm_buffer *skip_next;     /* victim search: candidates skipped (GPU work pending) */
  sgm_buffer *pf_prev, *pf_next;   /* prefetch queue links */
  sgm_buffer *all_prev, *all_next; /* every live buffer of the context */
  bool managed;              /* a movable framework block (managed.c): never acquired, never on
                                disk; dptr is its Unified Memory range, size its bytes */
  void *mstream;             /* managed: the stream its moves are ordered on (the last named) */
  uint64_t touch;            /* managed: pl->managed_clock at its allocation or last hot hint or
                                prefetch to VRAM; 0 after a cold hint */
  bool cold;                 /* managed: a cold hint sent it to shared memory; not promoted on its
                                own until a hot hint or a prefetch to VRAM */
  sgm_buffer *mnext;         /* managed: the next block in its bucket of pl->mhash */
  uint64_t mwant;            /* managed: the page-rounded bytes asked for (size - mwant: slack of
                                a cached range reused for a smaller request) */
  bool mrecorded;            /* managed: sgm_record_stream named a stream: its free gives the range
                                back to the driver (which waits for every stream) instead of caching */
  bool mcached;              /* managed: in the cache of freed ranges (pl->mlock): still in the map
                                and the list of all buffers, BUSY, not live */
  bool mpending;             /* managed: live, its policy listing deferred (pl->mpending): BUSY,
                                owned by that list (pl->mlock) until sgm__managed_flush lists it */
  sgm_buffer *mc_prev, *mc_next; /* managed, cached or pending: links of that list */
  sgm_stream_ref mref;       /* managed, cached: the stream it was freed on */
  uint64_t mcached_ms;       /* managed, cached: the context clock at the first idle tick that saw
                                it cached (0: none yet) */
  bool mqueued;              /* managed: a move of it waits in pl's move queue (managed_queue.c;
                                pl->mlock), its target's budget charged */
  sgm_tier mq_to;            /* managed, queued: the tier that move takes it to */
  void *mq_event;            /* managed, queued: recorded on its stream when queued; the copy
                                stream waits for it on the device before the move */
  sgm_buffer *mq_prev, *mq_next; /* managed, queued: links of the move queue, oldest first */
  /* then, at pl->state_offset: pl->state_bytes of policy state (item.state) */
};

/* Work a lower placement layer asks of a higher one (issue 31): the prefetch
 * worker and the managed blocks sit above the state word, the moves and the
 * decisions that need them, a move that needs room asks the decisions
 * (which demote by calling the moves), and the managed move queue sits below
 * the moves it runs (a move drops its block's queued one), so those ask
 * through these pointers, which placement.c fills at create with the named
 * functions (unchanged) — never a call up. Read-only after create. */
typedef struct sgm_placement_asks {
  void (*prefetch_cancel)(struct sgm_placement *pl, sgm_buffer *b); /* sgm__prefetch_cancel */
  int (*prefetch_wake)(sgm_context *ctx);                           /* sgm__prefetch_wake */
  uint64_t (*managed_promote)(sgm_context *ctx, uint64_t inline_bytes); /* sgm__managed_promote */
  void (*managed_flush)(sgm_context *ctx);                          /* sgm__managed_flush */
  uint64_t (*managed_cache_drop)(sgm_context *ctx, sgm_tier t, uint64_t want); /* sgm__managed_cache_drop */
  /* residency.c: room in tier t for a move (a victim search that may demote) */
  int (*residency_alloc_for)(sgm_context *ctx, sgm_tier t, uint64_t size, const sgm_buffer *cand,
                             uint64_t *out);                    /* sgm__residency_alloc_for */
  int (*residency_charge_for)(sgm_context *ctx, sgm_tier t, uint64_t size,
                              const sgm_buffer *cand);          /* sgm__residency_charge_for */
  bool (*valid)(struct sgm_placement *pl); /* sgm__placement_valid: the invariant walk (debug) */
  /* migrate.c, for the managed move queue's runs (managed_queue.c, the floor
   * below the moves: a move drops its block's queued one) */
  int (*managed_move)(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict,
                      void *stream);                            /* sgm__migrate_managed_on */
} sgm_placement_asks;

struct sgm_placement {
  sgm_placement_asks ask;     /* work asked of the layers above (filled at create) */
  sgm_lock lock;                       /* the buffer list, graveyard (placement.h top) */
  sgm_lock mlock;                      /* the managed map, counters and cache (managed.c) */
  sgm_lock res[SGM_N_RESIDENT];        /* per resident tier: pol[t], n_listed[t], its items */
  sgm_lock pf_lock;                    /* the prefetch queue, stop, work_cond */
  uint64_t n_busy_wakeups;             /* waits for a BUSY buffer that woke (atomic; tests) */
  sgm__prio_layer *pol[SGM_N_RESIDENT]; /* each resident tier's policy, one instance per priority */
  size_t state_offset;                 /* where policy state starts in a buffer's allocation */
  size_t state_bytes;                  /* its size: the larger of the two policies' state_bytes */
  uint64_t next_id;                    /* the last sgm_policy_item.id handed out (atomic) */
  bool record[SGM_N_RESIDENT];         /* the tier's policy has a record member */
  bool any_record;                     /* either has: acquire records */
  uint64_t n_listed[SGM_N_RESIDENT];   /* buffers listed per tier (read without the lock) */
  uint64_t n_searches;                 /* victim searches, to pace debug checks (atomic) */
  uint64_t (*clock_ns)(void *user);    /* the policies' clock (monotonic ns; tests inject) */
  void *clock_user;                    /* its argument */
  sgm_buffer *all;                     /* every live buffer */
  uint64_t n_buffers;                  /* live buffers (atomic: sgm_free reads it unlocked) */
  sgm_buffer *graveyard[16];           /* debug builds: destroyed buffers kept, poisoned */
  unsigned n_graveyard;                /* the next graveyard slot (round robin) */
  sgm_disk *disk;                      /* the spill tier, NULL when off */
  void *disk_bounce;                   /* (atomic) pinned staging lent to disk, allocated on first
                                          use, given back by sgm_trim */
  bool disk_bounce_tried;              /* (atomic) its allocation was attempted */
  uint64_t disk_seen_ops;              /* idle trim: the disk's activity count when last looked at */
  uint64_t disk_seen_ms;               /* idle trim: since when it has not moved; UINT64_MAX = not
                                          looked at since the last trim (both atomic) */
  uint64_t bytes_in[SGM_TIER_COUNT];   /* migrated into each tier (atomic) */
  uint64_t bytes_out[SGM_TIER_COUNT];  /* migrated out of each tier (atomic) */
  uint64_t n_evictions[SGM_TIER_COUNT]; /* buffers moved out to make room (atomic) */
  uint64_t n_disk_live;                /* buffers on disk (with or without extents; atomic); their
                                          budget is the disk tier's (sgm__disk_reserve) */
  pthread_t worker;                    /* prefetch worker */
  bool worker_started;                 /* the worker runs */
  bool stop;                           /* asks the worker to end */
  pthread_cond_t work_cond;            /* wakes the worker */
  bool mq_wake;                        /* managed moves were queued since the worker last looked
                                          (pl->pf_lock) */
  sgm_buffer *pf_head, *pf_tail;       /* prefetch queue, oldest at the head */
  sgm_buffer *mhash[SGM_MANAGED_BUCKETS]; /* managed blocks by address (managed.c) */
  uint64_t n_managed;                  /* live managed blocks (written under mlock; atomic: sgm_free
                                          reads it unlocked) */
  uint64_t n_managed_in[SGM_N_RESIDENT]; /* live managed blocks placed in each tier */
  uint64_t managed_clock;              /* ticks at every managed allocation, hint and prefetch */
  uint64_t n_managed_moves[2];         /* managed blocks promoted [0] and demoted [1] */
  uint64_t managed_moved_bytes[2];     /* their bytes, the same way */
  /* The cache of freed movable ranges (managed.c): each a whole sgm_buffer,
   * BUSY, in no policy, still in the map and pl->all (b->mcached), linked by
   * mc_prev/mc_next. */
  sgm_buffer *mcache[SGM_N_RESIDENT];  /* cached ranges by where they are placed, newest first */
  uint64_t mcache_bytes[SGM_N_RESIDENT]; /* their bytes: charged to the tier, committed, not used */
  uint64_t mrelease_bytes[SGM_N_RESIDENT]; /* ranges taken out of the cache and being given back
                                          to the driver: still charged until then, not used */
  uint64_t n_mcache;                   /* cached ranges in both tiers (written under mlock; read
                                          unlocked: atomic) */
  /* Live blocks reused from the cache whose policy listing is deferred
   * (managed.c, "pending"): BUSY, linked by mc_prev/mc_next, oldest first. */
  sgm_buffer *mpending_head, *mpending_tail; /* the oldest and the newest */
  uint64_t n_mpending;                 /* how many (written under mlock; read unlocked: atomic) */
  uint64_t n_mcache_hits;              /* movable allocations served from the cache */
  uint64_t n_mcache_released;          /* cached ranges given back to the driver */
  uint64_t mslack_in[SGM_N_RESIDENT];  /* live movable blocks' bytes beyond their page-rounded requests,
                                          by the tier they are placed in: charged there, committed,
                                          not used */
  /* The managed move queue (managed_queue.c; pl->mlock): moves the free,
   * trim and hint paths hand to the worker (prefetch.c's thread). */
  sgm_buffer *mq_head, *mq_tail;       /* queued blocks, oldest first */
  uint64_t n_mq;                       /* how many (written under mlock; read unlocked: atomic) */
  uint64_t mq_bytes;                   /* their bytes (charged to their targets already) */
  uint64_t n_mq_running;               /* queued moves taken off the queue and running now */
  pthread_cond_t mq_cond;              /* with pl->mlock: a queued move ended (done or cancelled) */
  uint64_t n_mq_queued;                /* moves queued since create */
  uint64_t n_mq_done;                  /* of those, done */
  uint64_t n_mq_cancelled;             /* of those, dropped (freed, superseded, failed, destroy) */
  uint64_t mq_moved_bytes[2];          /* managed bytes moved [0] on the calling threads, [1] by the
                                          worker */
};

/* b->state is a word of its own: the state in the low bits, SGM_BUF_WAITERS
 * while a thread sleeps until this buffer stops being BUSY, and above them a
 * generation that every take (a change to BUSY, or straight to ACQUIRED)
 * advances. The generation makes "b is still as I saw it" one comparison: a
 * thread reads the word, then b->tier, and its compare-and-swap from that
 * word succeeds only if nobody took b in between (so the tier it read, which
 * only an owner changes, is b's tier). A thread that waits sleeps on this
 * word, so only a change of this buffer wakes it. */
#define SGM_BUF_STATE_MASK 3u
#define SGM_BUF_WAITERS 4u
#define SGM_BUF_GEN_ONE 8u
#define SGM_BUF_GEN_MASK (~(SGM_BUF_GEN_ONE - 1u))

static inline sgm_buf_state sgm__buffer_state(const sgm_buffer *b) {
  return (sgm_buf_state)(__atomic_load_n(&b->state, __ATOMIC_ACQUIRE) & SGM_BUF_STATE_MASK);
}

/* Set b's state (the caller owns b, or holds the lock of the tier that lists
 * it) and wake the threads waiting for it. Waiters set SGM_BUF_WAITERS
 * concurrently, so the change is a compare-and-swap that keeps the
 * generation. The wake may reach the word after a woken thread destroyed b:
 * a futex wake of memory freed (or reused) is harmless (it fails or wakes a
 * sleeper that looks again), the pattern glibc's own mutexes rely on. */
static inline void sgm__buffer_set_state(sgm_buffer *b, sgm_buf_state s) {
  uint32_t old = __atomic_load_n(&b->state, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(&b->state, &old, (old & SGM_BUF_GEN_MASK) | (uint32_t)s, true,
                                      __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  if (sgm_unlikely(old & SGM_BUF_WAITERS)) sgm__word_wake_all(&b->state);
}

/* The lock of resident tier t's residency (t < SGM_N_RESIDENT). */
static inline sgm_lock *sgm__residency_lock(struct sgm_placement *pl, sgm_tier t) {
  return &pl->res[t];
}

/* ------------------------------------------------------------------------ */
/* hints.c — residency hints (sgm_will_use, sgm_buffer_done, sgm_buffer_set_parent). */

/* b is being destroyed (taken FREE, unlisted; no lock held): its parent and
 * children forget it. */
void sgm__hints_forget(struct sgm_placement *pl, sgm_buffer *b);

static inline sgm_buffer *sgm__buffer_of(sgm_policy_item *it) {
  return (sgm_buffer *)(void *)((char *)it - offsetof(sgm_buffer, item));
}

/* A mover (the owner of a BUSY buffer) changes its tier without a lock;
 * sgm_buffer_tier and the takers read it while the move goes on. Atomic on
 * both sides (relaxed: a moving buffer's tier is either; the state word's
 * generation tells a taker whether what it read still holds). */
static inline void sgm__buffer_set_tier(sgm_buffer *b, sgm_tier t) {
  __atomic_store_n(&b->tier, t, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------------ */
/* placement.c */

/* Walk the policies and every buffer (takes pl->lock and both residency
 * locks; call with none held): true when every invariant holds, else false
 * with the first broken one on stderr. O(n). */
bool sgm__placement_valid(struct sgm_placement *pl);

/* ------------------------------------------------------------------------ */
/* buffer_state.c — taking a buffer and giving it back (any thread). */

/* The check at every public buffer entry (inline: on every call's path;
 * here, at the state layer, so prefetch.c checks without calling up into
 * buffer.c): NULL, a destroyed buffer (debug
 * builds, where destroyed buffers stay recognisable for a while), a context
 * inherited through fork(). SGM_OK or the status with the message set. */
static inline int sgm__buffer_check(const sgm_buffer *b, const char *fn) {
  if (!b) return sgm__error_set(SGM_ERR_INVALID, "%s: buffer is NULL", fn);
  /* Every build looks (issue 29): a destroyed buffer's memory is kept a while
   * (the graveyard), so reading it is defined. The word shares its cache line
   * with b->ctx, which every call reads next: one predicted compare. */
  if (sgm_unlikely(b->magic != SGM_BUFFER_LIVE))
    return sgm__error_set(SGM_ERR_INVALID, "%s: %p is not a live buffer (%s)", fn, (const void *)b,
                          b->magic == SGM_BUFFER_DEAD ? "it was destroyed" : "not from sgm_buffer_create");
  if (sgm__parts_forked(b->ctx)) return sgm__parts_fork_error(b->ctx, fn);
  return SGM_OK;
}

/* What a taker is about to do with a buffer. */
typedef enum sgm_take_kind {
  SGM_TAKE_USE,  /* acquire, host read or write: a use (see sgm__residency_take_for_use) */
  SGM_TAKE_MOVE, /* explicit eviction: pinned, back unused if it does not move */
  SGM_TAKE_FREE  /* destroy: out of every policy */
} sgm_take_kind;

/* What sgm__buffer_claim may do besides taking b (flags, or'd). */
enum {
  SGM_CLAIM_WAIT = 1,      /* wait while b is BUSY (else return BUSY unclaimed) */
  SGM_CLAIM_PL_HELD = 2,   /* pl->lock is held: drop it while waiting */
  SGM_CLAIM_FAST_VRAM = 4, /* acquire: a VRAM buffer with nothing pending goes straight to ACQUIRED */
};

/* Take b if its state is in accept (a mask of 1u << state): one
 * compare-and-swap to BUSY (or, SGM_CLAIM_FAST_VRAM, to ACQUIRED) made under
 * the lock of b's tier when b is listed there, with the policy step of kind k
 * in the same critical section, so under that lock a listed buffer is never
 * BUSY; a FREE also ends b's pin, and a queued prefetch of b is cancelled.
 * Returns the state b had; b is the caller's iff that state is in accept
 * (*fast, if not NULL: it went straight to ACQUIRED). No residency lock held
 * on entry; pl->lock only with SGM_CLAIM_PL_HELD. Never fails otherwise. */
sgm_buf_state sgm__buffer_claim(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k, unsigned accept,
                                unsigned flags, bool *fast);
/* Wait until b is not BUSY, then take it: BUSY and owned by the caller, out
 * of its policy (a FREE also loses its pin), a queued prefetch cancelled.
 * Returns the state it had (RELEASED or ACQUIRED). No lock held (a
 * residency lock and the prefetch lock are taken inside). */
sgm_buf_state sgm__buffer_take(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k);
/* The same with pl->lock held (managed.c, tests); dropped while waiting. */
sgm_buf_state sgm__buffer_take_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k);
/* Take b as sgm__buffer_take does if it is not BUSY; else return SGM_BUF_BUSY
 * with b untouched (managed.c, under pl->mlock: it waits with
 * sgm__buffer_wait_busy and looks b up again). */
sgm_buf_state sgm__buffer_try_take(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k);
/* Sleep until b is no longer BUSY (or was not: return at once), dropping
 * `held` meanwhile and taking it again. */
void sgm__buffer_wait_busy(struct sgm_placement *pl, sgm_buffer *b, sgm_lock *held);
/* Give b (BUSY, owned by the caller; no residency lock held) back in state
 * `to`: a RELEASED resident buffer re-enters its policy (used: the taker
 * used it); one left on disk loses any pin. Wakes its waiters. Also
 * publishes a new buffer (state RELEASED from calloc, placed, not listed). */
void sgm__buffer_finish(struct sgm_placement *pl, sgm_buffer *b, sgm_buf_state to, bool used);
/* ------------------------------------------------------------------------ */
/* buffer.c */


/* Free b's storage in its tier and its pending event (b unlinked, no lock). */
void sgm__buffer_free_storage(sgm_context *ctx, sgm_buffer *b);

/* ------------------------------------------------------------------------ */
/* residency_host.c — the policy host (pl->res[t] held for the first four, t
 * the tier whose policy lists or pins b; _record takes the locks itself;
 * none fails or blocks). */

/* (A hint's parent, sgm_buffer_set_parent.) Under pl->res[t] (t = b's tier, where b is about to enter or be used in its
 * policy): item.parent = the parent's item when it is listed in that same
 * instance (tier and priority level), else NULL. */
void sgm__residency_resolve_parent(sgm_buffer *b, sgm_tier t);

/* Take a listed b out of its tier's policy; PIN keeps the instance's state
 * for b until the pin ends (sgm__residency_put or _unpin). No-op if unlisted. */
void sgm__residency_take(struct sgm_placement *pl, sgm_buffer *b, sgm_policy_remove why);
/* b is about to be used: a fresh one's first use ends its membership (DROP),
 * any other is pinned. */
void sgm__residency_take_for_use(struct sgm_placement *pl, sgm_buffer *b);
/* End b's pin for good (b destroyed, or left the resident tiers). */
void sgm__residency_unpin(struct sgm_placement *pl, sgm_buffer *b);
/* b (RELEASED, resident, unlisted) enters its tier's policy: back from a pin
 * in the same instance (used: a hit; else restored), or new there. */
void sgm__residency_put(struct sgm_placement *pl, sgm_buffer *b, bool used);
/* b is being acquired: a use, for the policies that count uses (record).
 * Inline: one branch on every acquire when neither policy counts. */
void sgm__residency_record_slow(struct sgm_placement *pl, const sgm_buffer *b);
static inline void sgm__residency_record(struct sgm_placement *pl, const sgm_buffer *b) {
  if (sgm_unlikely(pl->any_record)) sgm__residency_record_slow(pl, b);
}
/* ------------------------------------------------------------------------ */
/* residency.c — DESIGN.md §3: where an allocation or a buffer lands. */

/* Allocate size bytes in resident tier t (no lock held), evicting released
 * buffers while it does not fit (rule 2). cand: the newcomer the block is
 * for, which the VRAM policy may refuse (create, promote); NULL for plain
 * allocations and demotions. Returns the tier's status when nothing (more)
 * can be evicted, the request never could fit, or cand was refused:
 * SGM__ERR_BUDGET for a full budget. May call the driver and block. */
int sgm__residency_alloc_for(sgm_context *ctx, sgm_tier t, uint64_t size, const sgm_buffer *cand,
                             uint64_t *out);
/* Set the "both budgets are full" message (SGM_ERR_NOMEM, returned):
 * "<what>: VRAM and shared GPU memory are both full. VRAM: <why>. Shared:
 * <why><tail>". explain_shared false: this thread's current message already
 * says why shared memory failed. tail may be "". */
int sgm__residency_both_full(sgm_context *ctx, uint64_t size, bool explain_shared, const char *what,
                             const char *tail);
/* Where a new buffer lands (rules 1, 2, 4): VRAM, else shared, else straight
 * to disk. Sets b->tier and b->dptr (and counts a disk buffer). No lock held.
 * SGM_ERR_NOMEM with the budgets named when nothing fits. */
int sgm__residency_place_buffer(sgm_context *ctx, sgm_buffer *b);
/* Make b (BUSY, owned by the caller) resident (rule 5): VRAM if it fits after
 * evicting, else shared memory. On failure b is where it was. */
int sgm__residency_make_resident(sgm_context *ctx, sgm_buffer *b);

/* ------------------------------------------------------------------------ */
/* migrate.c — moving data (the caller owns b: BUSY; no lock held). */

/* Move b one or more tiers down to `to` (evict: counted as an eviction).
 * On failure b is unchanged. May block on copies and disk I/O. */
int sgm__migrate_demote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict);
/* Move b up into the block dst just allocated in resident tier `to`. On
 * failure b is unchanged and dst freed (a checksum mismatch leaves b on disk). */
int sgm__migrate_promote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, sgm_devptr dst);
/* Copy n bytes between host memory and b's data at offset, wherever it lives
 * (write: host -> buffer), after the GPU work queued before b's release.
 * A disk-resident buffer rewrites only the chunks
 * the write touches, each into a new extent: a failed write leaves every old
 * extent, i.e. all of the old contents. */
int sgm__migrate_host_io(sgm_context *ctx, sgm_buffer *b, size_t offset, void *host, size_t n,
                         bool write);

/* ------------------------------------------------------------------------ */
/* migrate_order.c — the copy discipline (the caller owns b: BUSY; no lock
 * held; these block until the copy or the wait is complete). */

/* Copy n bytes of b's data (kind: to or from it; dst and src are device
 * addresses or host pointers as the kind says) after the GPU work queued
 * before b's release: on the release's stream while that work is pending,
 * complete when this returns; b->event is dropped once it is known complete.
 * SGM_OK or the backend's status (b->event then stays). */
int sgm__migrate_order_copy(sgm_context *ctx, sgm_buffer *b, sgm_copy_kind kind, uint64_t dst,
                            uint64_t src, uint64_t n);
/* A buffer is about to be used on `stream` with *event (recorded on
 * event_stream at its release, NULL = none) maybe pending: make the release's
 * work come first for that stream, then destroy the event (*event = NULL).
 * On failure *event stays. Every copy orders itself (sgm__migrate_order_copy);
 * this is for a use that copies nothing (acquire of a buffer that does not
 * move) and for the host's own reads (spill from shared memory). */
int sgm__migrate_order_use(sgm_context *ctx, void **event, void *event_stream, void *stream);

/* ------------------------------------------------------------------------ */
/* migrate_disk.c — a buffer's chunks on disk (the caller owns b: BUSY; no
 * sgm lock held; disk I/O and copies block). b->size bytes are stored as
 * one extent per SGM_DISK_CHUNK. */

/* Give back b's spill extents and the reservation of its never-written
 * chunks (b->ext freed and NULL). Cannot fail. */
void sgm__migrate_disk_drop(sgm_context *ctx, sgm_buffer *b);
/* Write b->size bytes of host memory src as a new set of extents (*out,
 * malloc'd, the caller's; NULL on failure, when nothing stays allocated).
 * SGM_ERR_NOMEM (host memory) or the disk tier's status (budget, I/O). */
int sgm__migrate_disk_store(sgm_context *ctx, const sgm_buffer *b, const void *src, sgm_disk_extent **out);
/* Read disk-resident b's bytes into host memory dst (b->size bytes; chunks
 * never written read as zeros). b keeps its extents. The disk tier's status
 * on failure (a checksum mismatch, I/O), dst then partly written. */
int sgm__migrate_disk_load(sgm_context *ctx, const sgm_buffer *b, void *dst);
/* Spill VRAM-resident b to disk in one hop, pipelined through the disk
 * tier's staging slots: on success b is on disk (b->ext), its VRAM block
 * freed; on failure b stays in VRAM, untouched. Not counted (the caller). */
int sgm__migrate_disk_from_vram(sgm_context *ctx, sgm_buffer *b);
/* Read disk-resident b into the VRAM block dst in one hop (never-written
 * chunks arrive as zeros). b keeps its extents either way (the caller drops
 * them on success and frees dst on failure). */
int sgm__migrate_disk_to_vram(sgm_context *ctx, sgm_buffer *b, sgm_devptr dst);
/* sgm__migrate_host_io for a disk-resident b, through one staging chunk of
 * the disk tier. A write replaces the touched chunks' extents only when all
 * are written. SGM_ERR_NOMEM with no staging memory. */
int sgm__migrate_disk_host_io(sgm_context *ctx, sgm_buffer *b, size_t offset, void *host, size_t n,
                              bool write);

/* ------------------------------------------------------------------------ */
/* migrate.c, managed blocks */

/* Managed blocks (b->managed), the caller owning b (BUSY), no lock held:
 * place the pages of [d, d + n) in tier `to` (advice, then a prefetch on
 * stream). */
int sgm__migrate_managed_place(sgm_context *ctx, sgm_devptr d, uint64_t n, sgm_tier to, void *stream);
/* Move b to resident tier `to`, whose budget the caller has charged with
 * b->size: placed there, the charge of its old tier given back, counted.
 * On failure b is where it was and the caller keeps (and gives back) the
 * charge of `to`. */
int sgm__migrate_managed(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict);

/* The same on `stream` (NULL: the backend's own copy stream), for the move
 * queue's runs (managed_queue.c asks it through pl->ask.managed_move). */
int sgm__migrate_managed_on(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict, void *stream);

/* residency.c: charge size bytes to resident tier t's budget for a managed
 * block (sgm__tier_charge), demoting released buffers and colder managed
 * blocks while it does not fit (rule 2; cand as in sgm__residency_alloc_for). */
int sgm__residency_charge_for(sgm_context *ctx, sgm_tier t, uint64_t size, const sgm_buffer *cand);

/* ------------------------------------------------------------------------ */
/* prefetch.c */

/* Take b out of the prefetch queue if it is there: the caller (b's owner)
 * does the work itself. Takes pl->pf_lock. */
void sgm__prefetch_cancel(struct sgm_placement *pl, sgm_buffer *b);
/* Stop and join the worker if it runs (no lock held). */
void sgm__prefetch_stop(struct sgm_placement *pl);
/* The worker has managed moves to run (managed_queue.c): start it if it
 * does not run yet, and wake it. SGM_OK, or the status when it cannot start
 * (the caller then runs the move itself). No lock held, or pl->mlock. */
int sgm__prefetch_wake(sgm_context *ctx);

/* ------------------------------------------------------------------------ */
/* managed_queue.c — the managed move queue and its runs on the copy stream. */

/* Queue b's move to tier `to` (b BUSY, owned by the caller, who gives it back
 * after, then calls sgm__managed_queue_kick; `to`'s budget charged with
 * b->size, which the queue now holds): an event recorded on b's stream now,
 * waited for on the copy stream before the move. SGM_OK, or a status when it
 * cannot be queued (the caller keeps the charge and moves b itself). No lock
 * held. */
int sgm__managed_queue(sgm_context *ctx, sgm_buffer *b, sgm_tier to);
/* Wake the worker for what was queued (started on first use); where no
 * thread can start, run the queue on this thread. No lock held. */
void sgm__managed_queue_kick(sgm_context *ctx);
/* b (owned by the caller: a free, a move) leaves the queue if it is there,
 * its target's charge given back (pl->mlock held: the charge and the event
 * go back through *undo, given to sgm__managed_queue_undo once the lock is
 * dropped). */
typedef struct sgm_mq_undo {
  sgm_tier tier;  /* the charged target; SGM_TIER_NONE: nothing */
  uint64_t bytes; /* its charge */
  void *event;    /* the queued move's event (or NULL) */
} sgm_mq_undo;
void sgm__managed_queue_cancel_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_mq_undo *undo);
void sgm__managed_queue_undo(sgm_context *ctx, const sgm_mq_undo *undo);
/* The same for b's owner with no lock held: a queued move of b ends. */
void sgm__managed_queue_drop(sgm_context *ctx, sgm_buffer *b);
/* The worker runs the queued moves: until the queue is empty (false) or its
 * head is held by another thread (true: look again later). No lock held. */
bool sgm__managed_queue_work(sgm_context *ctx);
/* True on the worker's thread while it runs moves (their bytes are counted
 * apart: sgm_stats.managed_worker_moved_bytes). */
bool sgm__managed_queue_on_worker(void);
/* sgm__managed_queue_drain (internal.h): every queued move run on the
 * calling thread, then a wait for those the worker runs. */
/* Wait until no queued move runs (queued_too: and none is queued; tests).
 * No lock held. */
void sgm__managed_queue_wait(sgm_context *ctx, bool queued_too);
/* The queue's counters into *st. */
void sgm__managed_queue_stats(sgm_context *ctx, sgm_stats *st);
/* managed_queue.c: take live b for a move or a free (pl->mlock held): a pending
 * one from its list, another by its state word; SGM_BUF_BUSY when another
 * thread owns it (b untouched). */
sgm_buf_state sgm__managed_try_take_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k);
/* Drop every queued move, charges and events given back (destroy, after
 * the worker stopped). No lock held. */
void sgm__managed_queue_cancel_all(sgm_context *ctx);

#endif /* SGM_PLACEMENT_H */
