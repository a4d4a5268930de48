/*
 * placement.c — movable buffers, eviction and migration: the only code that
 * touches two tiers (DESIGN.md §3).
 *
 * A buffer's data lives in exactly one tier: a block of the VRAM or shared
 * pool (b->dptr), or an extent of the spill file (b->ext; none yet for a
 * buffer created straight on disk and never written: it reads as zeros).
 *
 * Eviction policies (include/sgm/policy.h, policies/): each resident tier
 * (VRAM, shared) has a priority layer running the policy the config names
 * (SGM_POLICY, or SGM_POLICY_VRAM / SGM_POLICY_SHARED): one instance per
 * priority level, victims from the lowest level that has one.
 *
 *     pol[VRAM]    MINIMUM [lru] LOW [lru] NORMAL [lru] HIGH [lru] MAXIMUM [lru]
 *     pol[SHARED]  the same with its own policy; victims go to disk
 *
 * Invariant: a buffer is an item of pol[b->tier] (b->listed) exactly when it
 * is RELEASED and resident; acquired and BUSY buffers are not, so they are
 * never victims. A victim with GPU work pending (its release event not
 * complete) is skipped: taken out with PIN, put back with RESTORE once the
 * search is over. The policy's per-buffer state lives inline after the buffer
 * struct (pl->state_offset), sized for the larger of the two policies.
 *
 * Pins: taking a listed buffer out for use, a copy or a move is on_remove(PIN);
 * the instance keeps its state until the pin ends with on_access (used),
 * on_insert(RESTORE) (back unused in the same instance) or on_remove(DROP)
 * (destroyed, or back in another tier or priority level). b->pinned and
 * b->pin_tier say which instance holds a pin; b->item.priority is the level
 * that holds or pins the item, b->priority the one the user set.
 *
 * Record and admit (the optional members of ABI 2): every acquire is
 * recorded, before anything moves, with each tier's policy that counts
 * (pl->any_record keeps the check to one branch for those that do not). When
 * VRAM is full and a newcomer — a buffer being created there, or promoted by
 * an acquire or a prefetch — needs room, each victim is offered to the VRAM
 * policy's admit before it leaves; a refusal stops the eviction and the
 * newcomer lands one tier down (placement_alloc_for returns SGM__ERR_BUDGET,
 * and its callers already fall back: create to shared memory, acquire to use
 * in shared memory, prefetch to staying put). Plain allocations and demotions
 * never ask. A request that could not fit even with every released buffer
 * gone evicts nothing (placement_could_fit).
 *
 * Fresh buffers: a buffer that entered its tier without being used (created
 * there, prefetched into it, demoted into it) is fresh. Its first acquire is
 * the reference that brought it in, not a hit: it leaves the policy with DROP
 * and comes back as new. Host reads and writes of a fresh buffer keep it fresh
 * (an upload is not a use); of any other buffer they count as a use.
 *
 * States: RELEASED (listed, or on disk), ACQUIRED, BUSY (one thread owns it
 * while moving or copying; others wait on pl->cond). Only the owner of a BUSY
 * buffer touches its data fields.
 *
 * Locking: pl->lock (rank SGM_LOCK_BUFFERS) guards states, the policies, the
 * prefetch queue and the counters; it is the lock the policy contract calls
 * "the tier lock". It is never held across a copy, disk I/O or a pool call: a
 * mover marks the buffer BUSY, drops the lock, moves, retakes it. The one
 * exception is the event query while choosing victims: a non-blocking driver
 * call, made under the lock so a chosen victim is known to be idle.
 *
 * Threads: a prefetch worker per context, started on the first prefetch.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "builtin.h"
#include "internal.h"
#include "tiers/disk.h"
#include "tiers/tier.h"

#define N_RESIDENT 2 /* VRAM and shared: the tiers with policies */
/* Debug builds walk every policy and buffer on each victim search while this
 * few buffers are listed, and on every 256th search above: the walk is O(n). */
#define PLACEMENT_CHECK_ALWAYS 256
#define PLACEMENT_CHECK_EVERY 256

typedef enum buf_state { BUF_RELEASED, BUF_ACQUIRED, BUF_BUSY } buf_state;

struct sgm_buffer {
  sgm_context *ctx;          /* owner */
  uint64_t size;             /* bytes asked for */
  sgm_tier tier;             /* where the data is now */
  sgm_devptr dptr;           /* block address in VRAM / shared; 0 on disk */
  sgm_disk_extent ext;       /* on disk: the extent; bytes == 0: never written (zeros) */
  buf_state state;           /* see the module comment */
  int priority;              /* sgm_priority the user set */
  void *event;               /* GPU work queued before release; NULL = none pending */
  bool prefetch_queued;      /* in pl's prefetch queue */
  bool listed;               /* an item of pl->pol[tier] now */
  bool pinned;               /* pl->pol[pin_tier] holds a pin on it (on_remove PIN) */
  bool fresh;                /* entered its tier unused: its first acquire is no hit */
  sgm_tier pin_tier;         /* the tier whose policy holds the pin, when pinned */
  sgm_policy_item item;      /* what policies see; item.priority = the level holding it */
  sgm_buffer *skip_next;     /* victim search: candidates skipped (GPU work pending) */
  sgm_buffer *pf_prev, *pf_next;   /* prefetch queue links */
  sgm_buffer *all_prev, *all_next; /* every live buffer of the context */
  /* then, at pl->state_offset: pl->state_bytes of policy state (item.state) */
};

struct sgm_placement {
  sgm_lock lock;                       /* guards everything below */
  pthread_cond_t cond;                 /* broadcast when a buffer stops being BUSY */
  sgm__prio_layer *pol[N_RESIDENT];    /* each resident tier's policy, one instance per priority */
  size_t state_offset;                 /* where policy state starts in a buffer's allocation */
  size_t state_bytes;                  /* its size: the larger of the two policies' state_bytes */
  uint64_t next_id;                    /* the last sgm_policy_item.id handed out (atomic) */
  bool record[N_RESIDENT];             /* the tier's policy has a record member */
  bool any_record;                     /* either has: acquire records */
  uint64_t n_listed[N_RESIDENT];       /* buffers listed per tier (read without the lock) */
  uint64_t n_searches;                 /* victim searches, to pace debug checks */
  uint64_t (*clock_ns)(void *user);    /* the policies' clock (monotonic ns; tests inject) */
  void *clock_user;                    /* its argument */
  sgm_buffer *all;                     /* every live buffer */
  sgm_disk *disk;                      /* the spill tier, NULL when off */
  uint64_t bytes_in[SGM_TIER_COUNT];   /* migrated into each tier */
  uint64_t bytes_out[SGM_TIER_COUNT];  /* migrated out of each tier */
  uint64_t n_evictions[SGM_TIER_COUNT]; /* buffers moved out to make room */
  uint64_t n_disk_live;                /* buffers on disk (with or without extent) */
  uint64_t disk_used_bytes;            /* their sizes */
  pthread_t worker;                    /* prefetch worker */
  bool worker_started;                 /* the worker runs */
  bool stop;                           /* asks the worker to end */
  pthread_cond_t work_cond;            /* wakes the worker */
  sgm_buffer *pf_head, *pf_tail;       /* prefetch queue, oldest at the head */
};

/* Test hooks; their declarations belong in internal.h under placement.c. */

static sgm_buffer *buf_of(sgm_policy_item *it) {
  return (sgm_buffer *)(void *)((char *)it - offsetof(sgm_buffer, item));
}

/* A mover (the owner of a BUSY buffer) changes its tier without the lock;
 * sgm_buffer_tier reads it, under the lock but while the move goes on. The
 * one field so shared: atomic on both sides (relaxed: a moving buffer's tier
 * is either, and the lock orders everything else). */
static void buf_set_tier(sgm_buffer *b, sgm_tier t) { __atomic_store_n(&b->tier, t, __ATOMIC_RELAXED); }

/* ---- policies (pl->lock held) ---- */

static void listed_add(struct sgm_placement *pl, sgm_tier t, int64_t d) {
  __atomic_store_n(&pl->n_listed[t], pl->n_listed[t] + (uint64_t)d, __ATOMIC_RELAXED);
}

/* Take a listed b out of its tier's policy. PIN keeps the instance's state
 * for b until the pin ends (pol_put or pol_unpin). */
static void pol_take(struct sgm_placement *pl, sgm_buffer *b, sgm_policy_remove why) {
  if (!b->listed) return;
  sgm_assert_internal(b->tier < N_RESIDENT && !b->pinned);
  sgm__prio_remove(pl->pol[b->tier], &b->item, why);
  b->listed = false;
  listed_add(pl, b->tier, -1);
  if (why == SGM_POLICY_REMOVE_PIN) {
    b->pinned = true;
    b->pin_tier = b->tier;
  }
}

/* A buffer about to be used (acquired, read or written): a fresh one's first
 * use ends its membership, any other is pinned. */
static void pol_take_for_use(struct sgm_placement *pl, sgm_buffer *b) {
  pol_take(pl, b, b->fresh ? SGM_POLICY_REMOVE_DROP : SGM_POLICY_REMOVE_PIN);
}

/* End b's pin for good (b destroyed, or left the resident tiers). */
static void pol_unpin(struct sgm_placement *pl, sgm_buffer *b) {
  if (!b->pinned) return;
  sgm__prio_remove(pl->pol[b->pin_tier], &b->item, SGM_POLICY_REMOVE_DROP);
  b->pinned = false;
}

/* b (RELEASED, resident) enters its tier's policy: back from a pin in the same
 * instance (used: a hit; else restored), or new there. */
static void pol_put(struct sgm_placement *pl, sgm_buffer *b, bool used) {
  sgm_assert_internal(b->state == BUF_RELEASED && b->tier < N_RESIDENT && !b->listed);
  sgm__prio_layer *l = pl->pol[b->tier];
  bool back = false;
  if (b->pinned) {
    back = b->pin_tier == b->tier && b->item.priority == b->priority;
    if (!back) sgm__prio_remove(pl->pol[b->pin_tier], &b->item, SGM_POLICY_REMOVE_DROP);
    b->pinned = false;
  }
  if (back && used) {
    sgm__prio_access(l, &b->item);
  } else if (back) {
    sgm__prio_insert(l, &b->item, SGM_POLICY_INSERT_RESTORE);
  } else {
    b->item.priority = b->priority;
    sgm__prio_insert(l, &b->item, SGM_POLICY_INSERT_NEW);
    b->fresh = !used;
  }
  b->listed = true;
  listed_add(pl, b->tier, +1);
}

/* b is being acquired: a use, for the policies that count uses (record). */
static void pol_record(struct sgm_placement *pl, const sgm_buffer *b) {
  if (!pl->any_record) return;
  for (int t = 0; t < N_RESIDENT; t++)
    if (pl->record[t]) sgm__prio_record(pl->pol[t], b->priority, b->item.id);
}

static void pf_remove(struct sgm_placement *pl, sgm_buffer *b) {
  if (b->pf_prev) b->pf_prev->pf_next = b->pf_next;
  else pl->pf_head = b->pf_next;
  if (b->pf_next) b->pf_next->pf_prev = b->pf_prev;
  else pl->pf_tail = b->pf_prev;
  b->pf_prev = b->pf_next = NULL;
  b->prefetch_queued = false;
}

/* What a taker is about to do with a buffer. */
typedef enum take_kind {
  TAKE_USE,  /* acquire, host read or write: a use (see pol_take_for_use) */
  TAKE_MOVE, /* explicit eviction: pinned, back unused if it does not move */
  TAKE_FREE  /* destroy: out of every policy */
} take_kind;

/* Wait until b is not BUSY, then take it: out of its policy, BUSY. Returns the
 * state it had (RELEASED or ACQUIRED). A queued prefetch is cancelled: the
 * caller is about to do the work itself. */
static buf_state buf_take_locked(struct sgm_placement *pl, sgm_buffer *b, take_kind k) {
  while (b->state == BUF_BUSY) pthread_cond_wait(&pl->cond, &pl->lock.mu);
  buf_state was = b->state;
  if (k == TAKE_USE) pol_take_for_use(pl, b);
  else pol_take(pl, b, k == TAKE_FREE ? SGM_POLICY_REMOVE_DROP : SGM_POLICY_REMOVE_PIN);
  if (k == TAKE_FREE) pol_unpin(pl, b);
  if (b->prefetch_queued) pf_remove(pl, b);
  b->state = BUF_BUSY;
  return was;
}

/* Give b back in state `to`: a RELEASED resident buffer re-enters its policy
 * (used: the taker used it); one left on disk loses any pin. */
static void buf_finish(struct sgm_placement *pl, sgm_buffer *b, buf_state to, bool used) {
  sgm__lock_take(&pl->lock);
  b->state = to;
  if (to == BUF_RELEASED) {
    if (b->tier < N_RESIDENT) pol_put(pl, b, used);
    else pol_unpin(pl, b);
  }
  pthread_cond_broadcast(&pl->cond);
  sgm__lock_drop(&pl->lock);
}

/* Walk the policies and every buffer (pl->lock held): SGM_OK or
 * SGM_ERR_CORRUPT with the first broken invariant in why. O(n). */
static int placement_check_locked(struct sgm_placement *pl, char *why, size_t len) {
  uint64_t n[N_RESIDENT] = {0}, bytes[N_RESIDENT] = {0};
  for (sgm_buffer *b = pl->all; b; b = b->all_next) {
    if (b->state == BUF_BUSY) { /* its mover owns tier and data: only the flags are ours */
      if (b->listed) {
        snprintf(why, len, "buffer %llu is BUSY and listed", (unsigned long long)b->item.id);
        return SGM_ERR_CORRUPT;
      }
      continue;
    }
    bool want = b->state == BUF_RELEASED && b->tier < N_RESIDENT;
    if (b->listed != want) {
      snprintf(why, len, "buffer %llu (state %d, tier %d) is %slisted",
               (unsigned long long)b->item.id, (int)b->state, (int)b->tier, b->listed ? "" : "not ");
      return SGM_ERR_CORRUPT;
    }
    if (b->listed && b->pinned) {
      snprintf(why, len, "buffer %llu is both listed and pinned", (unsigned long long)b->item.id);
      return SGM_ERR_CORRUPT;
    }
    if (b->listed && b->item.priority != b->priority) {
      snprintf(why, len, "buffer %llu is listed at priority %d, set to %d",
               (unsigned long long)b->item.id, b->item.priority, b->priority);
      return SGM_ERR_CORRUPT;
    }
    if (b->listed) {
      n[b->tier]++;
      bytes[b->tier] += b->size;
    }
  }
  for (int t = 0; t < N_RESIDENT; t++) {
    int rc = sgm__prio_check(pl->pol[t], why, len);
    if (rc != SGM_OK) return rc;
    uint64_t r = sgm__prio_reclaimable(pl->pol[t]);
    if (r != bytes[t] || n[t] != pl->n_listed[t]) {
      snprintf(why, len, "%s: the policy holds %llu reclaimable bytes, the %llu listed buffers "
               "%llu (counter: %llu listed)", sgm_tier_name((sgm_tier)t), (unsigned long long)r,
               (unsigned long long)n[t], (unsigned long long)bytes[t],
               (unsigned long long)pl->n_listed[t]);
      return SGM_ERR_CORRUPT;
    }
  }
  return SGM_OK;
}

static bool placement_valid_locked(struct sgm_placement *pl) {
  char why[256];
  if (placement_check_locked(pl, why, sizeof why) == SGM_OK) return true;
  fprintf(stderr, "sgm: placement check: %s\n", why);
  return false;
}

/* ---- data movement (caller owns b: BUSY) ---- */

static void *shared_host(sgm_context *ctx, sgm_devptr d) {
  return sgm__shared_host_ptr(ctx->tiers[SGM_TIER_SHARED], d);
}

static int copy(sgm_context *ctx, sgm_copy_kind kind, uint64_t dst, uint64_t src, uint64_t n) {
  return ctx->bops->copy(ctx->be, kind, dst, src, n, NULL);
}

static void count_move(struct sgm_placement *pl, sgm_tier from, sgm_tier to, uint64_t n, bool evict) {
  sgm__lock_take(&pl->lock);
  pl->bytes_out[from] += n;
  pl->bytes_in[to] += n;
  if (evict) pl->n_evictions[from]++;
  if (to == SGM_TIER_DISK) {
    pl->n_disk_live++;
    pl->disk_used_bytes += n;
  }
  if (from == SGM_TIER_DISK) {
    pl->n_disk_live--;
    pl->disk_used_bytes -= n;
  }
  sgm__lock_drop(&pl->lock);
}

/* Read a disk-resident buffer's bytes into host memory dst (zeros if never written). */
static int disk_load(sgm_context *ctx, const sgm_buffer *b, void *dst) {
  if (b->ext.bytes == 0) {
    memset(dst, 0, b->size);
    return SGM_OK;
  }
  return sgm__disk_read(ctx->pl->disk, &b->ext, dst);
}

static int demote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict);

/* Pick a victim in resident tier t for a request of `want` bytes: the
 * policy's choice, skipping buffers with GPU work pending. cand: the newcomer
 * the room is for (VRAM only), whose admission the policy is asked before the
 * victim leaves; NULL = no question. Returns the victim BUSY, or NULL when
 * every listed buffer is busy on the GPU, none is listed, or the policy
 * refused the newcomer (*refused set; the victim stays listed). */
static sgm_buffer *pick_victim(sgm_context *ctx, sgm_tier t, uint64_t want, const sgm_buffer *cand,
                               bool *refused) {
  struct sgm_placement *pl = ctx->pl;
  sgm_buffer *v = NULL, *skipped = NULL;
  sgm__lock_take(&pl->lock);
  uint64_t listed = pl->n_listed[0] + pl->n_listed[1];
  if (SGM_EXPENSIVE_CHECKS &&
      (listed <= PLACEMENT_CHECK_ALWAYS || pl->n_searches % PLACEMENT_CHECK_EVERY == 0))
    sgm_assert_expensive(placement_valid_locked(pl));
  pl->n_searches++;
  sgm_policy_item *it;
  while (!v && (it = sgm__prio_next_victim(pl->pol[t], want)) != NULL) {
    sgm_buffer *b = buf_of(it);
    sgm_assert(b->listed && b->state == BUF_RELEASED && b->tier == t);
    if (b->event) {
      if (ctx->bops->event_query(ctx->be, b->event) != 1) {
        pol_take(pl, b, SGM_POLICY_REMOVE_PIN); /* out of the way while the search goes on */
        b->skip_next = skipped;
        skipped = b;
        continue;
      }
      ctx->bops->event_destroy(ctx->be, b->event);
      b->event = NULL;
    }
    if (cand) {
      /* Read under the lock: priority is the one field of cand another
       * thread (set_priority) may write. */
      sgm_policy_item c = {.id = cand->item.id, .size_bytes = cand->size,
                           .priority = cand->priority, .state = NULL};
      if (!sgm__prio_admit(pl->pol[t], &c, it)) {
        *refused = true;
        break;
      }
    }
    pol_take(pl, b, SGM_POLICY_REMOVE_EVICT);
    v = b;
  }
  /* Last skipped first: each goes back to the eviction end, so the original
   * order is kept there. */
  while (skipped) {
    sgm_buffer *b = skipped;
    skipped = b->skip_next;
    b->skip_next = NULL;
    pol_put(pl, b, false);
  }
  if (v) v->state = BUF_BUSY;
  sgm__lock_drop(&pl->lock);
  return v;
}

/* Could size bytes ever fit in tier t if every released buffer there left?
 * No when the request exceeds the budget, or the room left plus everything
 * evictable (each buffer counted with the most its rounding can add) falls
 * short: evicting would then move buffers for nothing. A hint read under two
 * locks in turn; a race only decides which tier the request lands in. */
static bool placement_could_fit(sgm_context *ctx, sgm_tier t, uint64_t size) {
  struct sgm_placement *pl = ctx->pl;
  sgm_tier_stats ts;
  sgm__tier_stats(ctx->tiers[t], &ts);
  uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
  if (need > ts.budget_bytes) return false;
  sgm__lock_take(&pl->lock);
  uint64_t movable = sgm__prio_reclaimable(pl->pol[t]) + pl->n_listed[t] * (SGM_DEVICE_ALIGN - 1);
  sgm__lock_drop(&pl->lock);
  uint64_t room = ts.budget_bytes > ts.used_bytes ? ts.budget_bytes - ts.used_bytes : 0;
  return need <= room || need - room <= movable;
}

/* Allocate size bytes in resident tier t, evicting released buffers while it
 * does not fit. cand: the buffer the block is for when it is a newcomer the
 * VRAM policy may refuse (create, promote into VRAM); NULL for plain
 * allocations and demotions, which always evict. The tier's status when the
 * request does not fit: nothing (more) to evict, it never could fit, or the
 * newcomer was refused — SGM__ERR_BUDGET for a full budget. */
static int placement_alloc_for(sgm_context *ctx, sgm_tier t, uint64_t size, const sgm_buffer *cand,
                               uint64_t *out) {
  bool checked = false;
  for (;;) {
    int rc = sgm__tier_alloc(ctx->tiers[t], size, out);
    if (rc != SGM__ERR_BUDGET && rc != SGM_ERR_NOMEM) return rc;
    if (__atomic_load_n(&ctx->pl->n_listed[t], __ATOMIC_RELAXED) == 0) return rc;
    if (!checked) {
      checked = true;
      if (!placement_could_fit(ctx, t, size)) return rc;
    }
    bool refused = false;
    sgm_buffer *v = pick_victim(ctx, t, size, t == SGM_TIER_VRAM ? cand : NULL, &refused);
    if (!v) return rc;
    int drc = demote(ctx, v, (sgm_tier)(t + 1), true);
    buf_finish(ctx->pl, v, BUF_RELEASED, false);
    if (drc != SGM_OK) return drc;
  }
}

int sgm__placement_alloc(sgm_context *ctx, sgm_tier t, uint64_t size, uint64_t *out) {
  return placement_alloc_for(ctx, t, size, NULL, out);
}

/* Spill a VRAM-resident b (BUSY) to disk through a host staging copy. */
static int vram_to_disk(sgm_context *ctx, sgm_buffer *b) {
  void *stage = malloc(b->size);
  if (!stage)
    return sgm__error_set(SGM_ERR_NOMEM, "out of host memory staging %llu bytes for disk",
                          (unsigned long long)b->size);
  int rc = copy(ctx, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)stage, b->dptr, b->size);
  sgm_disk_extent ext;
  if (rc == SGM_OK) rc = sgm__disk_write(ctx->pl->disk, stage, b->size, &ext);
  free(stage);
  if (rc != SGM_OK) return rc;
  uint64_t sz;
  sgm__tier_free(ctx->tiers[SGM_TIER_VRAM], b->dptr, &sz);
  b->dptr = 0;
  b->ext = ext;
  buf_set_tier(b, SGM_TIER_DISK);
  return SGM_OK;
}

/* Move b (BUSY) one or more tiers down to `to`. On failure b is unchanged. */
static int demote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict) {
  struct sgm_placement *pl = ctx->pl;
  while (b->tier < to) {
    sgm_tier from = b->tier;
    sgm_tier next = (sgm_tier)(from + 1);
    if (next == SGM_TIER_DISK) {
      if (!pl->disk)
        return sgm__error_set(SGM_ERR_NOMEM, "no disk tier to spill to: set SGM_SPILL_DIR to a "
                              "directory (and SGM_SPILL_LIMIT) to let buffers spill to disk");
      void *host = shared_host(ctx, b->dptr);
      sgm_disk_extent ext;
      int rc = sgm__disk_write(pl->disk, host, b->size, &ext);
      if (rc != SGM_OK) return rc; /* the data stays in shared memory */
      uint64_t sz;
      sgm__tier_free(ctx->tiers[SGM_TIER_SHARED], b->dptr, &sz);
      b->dptr = 0;
      b->ext = ext;
    } else {
      sgm_devptr dst = 0;
      int rc = sgm__placement_alloc(ctx, next, b->size, &dst);
      if ((rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM) && pl->disk) {
        /* Shared memory is full of what cannot move: skip it, straight to disk. */
        rc = vram_to_disk(ctx, b);
        if (rc != SGM_OK) return rc;
        count_move(pl, from, SGM_TIER_DISK, b->size, evict);
        continue;
      }
      if (rc == SGM__ERR_BUDGET) rc = sgm__tier_explain_budget(ctx->tiers[next], b->size);
      if (rc != SGM_OK) return rc;
      rc = copy(ctx, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)shared_host(ctx, dst), b->dptr, b->size);
      if (rc != SGM_OK) {
        uint64_t sz;
        sgm__tier_free(ctx->tiers[next], dst, &sz);
        return rc;
      }
      uint64_t sz;
      sgm__tier_free(ctx->tiers[from], b->dptr, &sz);
      b->dptr = dst;
    }
    buf_set_tier(b, next);
    count_move(pl, from, next, b->size, evict);
  }
  return SGM_OK;
}

/* Move b (BUSY) up into resident tier `to`, evicting released buffers there
 * (in VRAM, as far as its policy admits b). On failure b is unchanged (a
 * checksum mismatch leaves it on disk). */
static int promote(sgm_context *ctx, sgm_buffer *b, sgm_tier to) {
  sgm_devptr dst = 0;
  int rc = placement_alloc_for(ctx, to, b->size, b, &dst);
  if (rc != SGM_OK) return rc;
  sgm_tier from = b->tier;
  if (from == SGM_TIER_DISK) {
    void *host = to == SGM_TIER_SHARED ? shared_host(ctx, dst) : malloc(b->size);
    rc = host ? disk_load(ctx, b, host)
              : sgm__error_set(SGM_ERR_NOMEM, "out of host memory staging %llu bytes from disk",
                               (unsigned long long)b->size);
    if (rc == SGM_OK && to == SGM_TIER_VRAM)
      rc = copy(ctx, SGM_COPY_HOST_TO_DEVICE, dst, (uintptr_t)host, b->size);
    if (to == SGM_TIER_VRAM) free(host);
    if (rc == SGM_OK && b->ext.bytes) sgm__disk_free(ctx->pl->disk, &b->ext);
  } else {
    rc = copy(ctx, SGM_COPY_HOST_TO_DEVICE, dst, (uintptr_t)shared_host(ctx, b->dptr), b->size);
    if (rc == SGM_OK) {
      uint64_t sz;
      sgm__tier_free(ctx->tiers[from], b->dptr, &sz);
    }
  }
  if (rc != SGM_OK) {
    uint64_t sz;
    sgm__tier_free(ctx->tiers[to], dst, &sz);
    return rc;
  }
  b->dptr = dst;
  b->ext = (sgm_disk_extent){0};
  buf_set_tier(b, to);
  count_move(ctx->pl, from, to, b->size, false);
  return SGM_OK;
}

/* Make b (BUSY) resident: VRAM if it fits after evicting, else shared. */
static int make_resident(sgm_context *ctx, sgm_buffer *b) {
  if (b->tier == SGM_TIER_VRAM) return SGM_OK;
  int rc = promote(ctx, b, SGM_TIER_VRAM);
  if (rc == SGM_OK) return SGM_OK;
  if (rc != SGM__ERR_BUDGET && rc != SGM_ERR_NOMEM) return rc;
  if (b->tier == SGM_TIER_SHARED) return SGM_OK;
  rc = promote(ctx, b, SGM_TIER_SHARED);
  if (rc == SGM__ERR_BUDGET) {
    char vram[SGM_ERROR_MAX];
    sgm__tier_explain_budget(ctx->tiers[SGM_TIER_VRAM], b->size);
    snprintf(vram, sizeof vram, "%s", sgm_last_error());
    sgm__tier_explain_budget(ctx->tiers[SGM_TIER_SHARED], b->size);
    rc = sgm__error_set(SGM_ERR_NOMEM, "cannot make a %llu-byte buffer resident: everything "
                        "resident is acquired. VRAM: %s. Shared: %s",
                        (unsigned long long)b->size, vram, sgm_last_error());
  }
  return rc;
}

/* ---- prefetch worker ---- */

static void *prefetch_main(void *arg) {
  sgm_context *ctx = arg;
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  for (;;) {
    while (!pl->stop && !pl->pf_head) pthread_cond_wait(&pl->work_cond, &pl->lock.mu);
    if (pl->stop) break;
    sgm_buffer *b = pl->pf_head;
    pf_remove(pl, b);
    if (b->state != BUF_RELEASED) continue; /* acquired meanwhile: nothing to do */
    pol_take(pl, b, SGM_POLICY_REMOVE_PIN);
    b->state = BUF_BUSY;
    sgm__lock_drop(&pl->lock);
    int rc = make_resident(ctx, b);
    if (rc != SGM_OK)
      sgm__log(ctx->cfg.verbose, 2, "prefetch of a %llu-byte buffer failed: %s",
               (unsigned long long)b->size, sgm_last_error());
    sgm__lock_take(&pl->lock);
    b->state = BUF_RELEASED;
    if (b->tier < N_RESIDENT) pol_put(pl, b, false); /* a prefetch is no use: stays fresh */
    else pol_unpin(pl, b);
    pthread_cond_broadcast(&pl->cond);
  }
  sgm__lock_drop(&pl->lock);
  return NULL;
}

/* ---- lifecycle ---- */

static uint64_t placement_monotonic_ns(void *user) {
  (void)user;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The policies' clock, read under pl->lock (the policy contract). */
static uint64_t placement_clock(void *user) {
  struct sgm_placement *pl = user;
  return pl->clock_ns(pl->clock_user);
}

/* The policy name tier t runs: its own setting, else SGM_POLICY. */
static const char *placement_policy_setting(const sgm_config *cfg, sgm_tier t, const char **var) {
  const char *own = t == SGM_TIER_VRAM ? cfg->policy_vram : cfg->policy_shared;
  if (own[0]) {
    *var = t == SGM_TIER_VRAM ? "SGM_POLICY_VRAM" : "SGM_POLICY_SHARED";
    return own;
  }
  *var = "SGM_POLICY";
  return cfg->policy;
}

static void placement_free(struct sgm_placement *pl) {
  for (int t = 0; t < N_RESIDENT; t++) sgm__prio_destroy(pl->pol[t]);
  if (pl->disk) sgm__disk_close(pl->disk);
  pthread_cond_destroy(&pl->cond);
  pthread_cond_destroy(&pl->work_cond);
  sgm__lock_destroy(&pl->lock);
  free(pl);
}

int sgm__placement_create(sgm_context *ctx) {
  struct sgm_placement *pl = calloc(1, sizeof *pl);
  if (!pl) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating the buffer lists");
  sgm__lock_init(&pl->lock, SGM_LOCK_BUFFERS);
  pthread_cond_init(&pl->cond, NULL);
  pthread_cond_init(&pl->work_cond, NULL);
  pl->clock_ns = placement_monotonic_ns;
  int rc = SGM_OK;
  size_t state_bytes = 0;
  for (int t = 0; t < N_RESIDENT && rc == SGM_OK; t++) {
    const char *var;
    const char *name = placement_policy_setting(&ctx->cfg, (sgm_tier)t, &var);
    const sgm_policy_ops *ops = sgm_policy_find(name);
    if (!ops) {
      rc = sgm__error_set(SGM_ERR_INVALID, "%s names policy \"%s\", which is not registered",
                          var, name);
      break;
    }
    sgm_policy_params params = {
        .abi_version = SGM_POLICY_ABI_VERSION,
        .tier = (sgm_tier)t,
        .capacity_bytes = ctx->budget_bytes[t],
        .clock_ns = placement_clock,
        .clock_user = pl,
    };
    rc = sgm__prio_create(ops, &params, &pl->pol[t]);
    if (rc != SGM_OK)
      rc = sgm__error_set(rc, "cannot create the %s policy \"%s\" for the %s tier (%s)", var, ops->name,
                          sgm_tier_name((sgm_tier)t), sgm_status_string((sgm_status)rc));
    if (ops->state_bytes > state_bytes) state_bytes = ops->state_bytes;
    pl->record[t] = ops->record != NULL;
    pl->any_record = pl->any_record || pl->record[t];
  }
  pl->state_offset = sgm__align_up(sizeof(sgm_buffer), 16);
  pl->state_bytes = sgm__align_up(state_bytes, 16);
  if (rc == SGM_OK && ctx->cfg.spill_dir[0])
    rc = sgm__disk_open(ctx->cfg.spill_dir, ctx->cfg.spill_limit, ctx->cfg.verbose, &pl->disk);
  if (rc != SGM_OK) {
    placement_free(pl);
    return rc;
  }
  ctx->pl = pl;
  return SGM_OK;
}

void sgm__placement_set_clock(sgm_context *ctx, uint64_t (*clock_ns)(void *user), void *user) {
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  pl->clock_ns = clock_ns ? clock_ns : placement_monotonic_ns;
  pl->clock_user = clock_ns ? user : NULL;
  sgm__lock_drop(&pl->lock);
}

int sgm__placement_check(sgm_context *ctx, char *why, size_t why_len) {
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  int rc = placement_check_locked(pl, why, why_len);
  sgm__lock_drop(&pl->lock);
  return rc;
}

const char *sgm__placement_policy_name(sgm_context *ctx, sgm_tier t) {
  if (t < 0 || t >= N_RESIDENT) return NULL;
  return sgm__prio_inner(ctx->pl->pol[t])->name;
}

static void buffer_free_storage(sgm_context *ctx, sgm_buffer *b) {
  uint64_t sz;
  if (b->tier == SGM_TIER_DISK) {
    if (b->ext.bytes) sgm__disk_free(ctx->pl->disk, &b->ext);
  } else {
    sgm__tier_free(ctx->tiers[b->tier], b->dptr, &sz);
  }
  if (b->event) ctx->bops->event_destroy(ctx->be, b->event);
}

void sgm__placement_destroy(sgm_context *ctx) {
  struct sgm_placement *pl = ctx->pl;
  if (!pl) return;
  if (pl->worker_started) {
    sgm__lock_take(&pl->lock);
    pl->stop = true;
    pthread_cond_signal(&pl->work_cond);
    sgm__lock_drop(&pl->lock);
    pthread_join(pl->worker, NULL);
  }
  /* The policies are destroyed after the buffers without being told about
   * them: the contract says destroy must not touch items. */
  while (pl->all) {
    sgm_buffer *b = pl->all;
    pl->all = b->all_next;
    buffer_free_storage(ctx, b);
    free(b);
  }
  placement_free(pl);
  ctx->pl = NULL;
}

void sgm__placement_stats(sgm_context *ctx, sgm_stats *st) {
  struct sgm_placement *pl = ctx->pl;
  if (pl->disk) sgm__disk_stats(pl->disk, &st->tier[SGM_TIER_DISK]);
  sgm__lock_take(&pl->lock);
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    st->tier[t].bytes_in = pl->bytes_in[t];
    st->tier[t].bytes_out = pl->bytes_out[t];
    st->tier[t].n_evictions = pl->n_evictions[t];
  }
  /* Buffers on disk without an extent yet hold no file space but are live. */
  st->tier[SGM_TIER_DISK].n_live = pl->n_disk_live;
  sgm__lock_drop(&pl->lock);
}

struct sgm_disk *sgm__placement_disk(sgm_context *ctx) { return ctx->pl->disk; }

bool sgm__buffer_disk_offset(sgm_buffer *b, uint64_t *offset) {
  struct sgm_placement *pl = b->ctx->pl;
  sgm__lock_take(&pl->lock);
  while (b->state == BUF_BUSY) pthread_cond_wait(&pl->cond, &pl->lock.mu); /* its mover owns ext */
  bool on = b->tier == SGM_TIER_DISK && b->ext.bytes != 0;
  *offset = on ? b->ext.offset : 0;
  sgm__lock_drop(&pl->lock);
  return on;
}

/* ---- public API ---- */

#define BUF_CHECK(b, what)                                                              \
  do {                                                                                  \
    if (!(b)) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, what ": buffer is NULL"); \
  } while (0)

SGM_API sgm_status sgm_buffer_create(sgm_context *ctx, size_t size, sgm_buffer **out) {
  if (!out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: out is NULL");
  *out = NULL;
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: context is NULL");
  if (size == 0)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: size is 0 (ask for at least one byte)");
  struct sgm_placement *pl = ctx->pl;
  sgm_buffer *b = calloc(1, pl->state_offset + pl->state_bytes);
  if (!b) return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "out of host memory for a buffer");
  b->ctx = ctx;
  b->size = size;
  b->priority = SGM_PRIORITY_NORMAL;
  b->item.size_bytes = size;
  b->item.priority = SGM_PRIORITY_NORMAL;
  b->item.state = pl->state_bytes ? (char *)b + pl->state_offset : NULL;
  /* The id first: the VRAM policy may be asked to admit b. */
  b->item.id = __atomic_add_fetch(&pl->next_id, 1, __ATOMIC_RELAXED);
  int rc = placement_alloc_for(ctx, SGM_TIER_VRAM, size, b, &b->dptr);
  if (rc == SGM_OK) {
    b->tier = SGM_TIER_VRAM;
  } else if (rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM) {
    rc = sgm__placement_alloc(ctx, SGM_TIER_SHARED, size, &b->dptr);
    if (rc == SGM_OK) b->tier = SGM_TIER_SHARED;
  }
  if (rc != SGM_OK && (rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM)) {
    sgm_tier_stats ds = {0};
    if (pl->disk) sgm__disk_stats(pl->disk, &ds);
    sgm__lock_take(&pl->lock);
    bool fits = pl->disk && ds.budget_bytes - pl->disk_used_bytes >= size &&
                pl->disk_used_bytes <= ds.budget_bytes;
    if (fits) {
      pl->n_disk_live++;
      pl->disk_used_bytes += size;
    }
    sgm__lock_drop(&pl->lock);
    if (fits) {
      b->tier = SGM_TIER_DISK; /* rule 4: straight to disk; no extent until written */
      rc = SGM_OK;
    } else {
      char vram[SGM_ERROR_MAX], shared[SGM_ERROR_MAX];
      sgm__tier_explain_budget(ctx->tiers[SGM_TIER_VRAM], size);
      snprintf(vram, sizeof vram, "%s", sgm_last_error());
      sgm__tier_explain_budget(ctx->tiers[SGM_TIER_SHARED], size);
      snprintf(shared, sizeof shared, "%s", sgm_last_error());
      rc = sgm__error_set(SGM_ERR_NOMEM, "sgm_buffer_create(%zu): nothing fits. VRAM: %s. Shared: "
                          "%s. Disk: %s", size, vram, shared,
                          pl->disk ? "the spill limit is reached (raise SGM_SPILL_LIMIT)"
                                   : "off (set SGM_SPILL_DIR to spill to disk)");
    }
  }
  if (rc != SGM_OK) {
    free(b);
    return (sgm_status)rc;
  }
  sgm__lock_take(&pl->lock);
  b->state = BUF_RELEASED;
  if (b->tier < N_RESIDENT) pol_put(pl, b, false); /* fresh: created, not yet used */
  b->all_next = pl->all;
  if (pl->all) pl->all->all_prev = b;
  pl->all = b;
  sgm__lock_drop(&pl->lock);
  *out = b;
  return SGM_OK;
}

SGM_API sgm_status sgm_buffer_acquire(sgm_buffer *b, void *stream, void **device_ptr) {
  (void)stream;
  if (!device_ptr) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_acquire: device_ptr is NULL");
  *device_ptr = NULL;
  BUF_CHECK(b, "sgm_buffer_acquire");
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  while (b->state == BUF_BUSY) pthread_cond_wait(&pl->cond, &pl->lock.mu);
  if (b->state == BUF_ACQUIRED) {
    sgm__lock_drop(&pl->lock);
    return (sgm_status)sgm__error_set(SGM_ERR_BUSY, "sgm_buffer_acquire: the buffer is already "
                                      "acquired (release it first)");
  }
  pol_record(pl, b);
  void *event = b->event;
  b->event = NULL;
  if (b->tier == SGM_TIER_VRAM) {
    /* Fast path: resident in VRAM already. */
    pol_take_for_use(pl, b);
    if (b->prefetch_queued) pf_remove(pl, b);
    b->state = BUF_ACQUIRED;
    sgm__lock_drop(&pl->lock);
    if (event) ctx->bops->event_destroy(ctx->be, event);
    *device_ptr = (void *)(uintptr_t)b->dptr;
    return SGM_OK;
  }
  buf_take_locked(pl, b, TAKE_USE);
  sgm__lock_drop(&pl->lock);
  if (event) ctx->bops->event_destroy(ctx->be, event);
  int rc = make_resident(ctx, b);
  buf_finish(pl, b, rc == SGM_OK ? BUF_ACQUIRED : BUF_RELEASED, false);
  if (rc != SGM_OK) return (sgm_status)rc;
  *device_ptr = (void *)(uintptr_t)b->dptr;
  return SGM_OK;
}

SGM_API sgm_status sgm_buffer_release(sgm_buffer *b, void *stream) {
  BUF_CHECK(b, "sgm_buffer_release");
  sgm_context *ctx = b->ctx;
  if (b->state != BUF_ACQUIRED)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_release: the buffer is not acquired");
  void *ev = NULL;
  int rc = ctx->bops->event_record(ctx->be, stream, &ev);
  if (rc != SGM_OK) return (sgm_status)rc; /* stays acquired: nothing may move it */
  if (ctx->bops->event_query(ctx->be, ev) == 1) {
    ctx->bops->event_destroy(ctx->be, ev);
    ev = NULL;
  }
  sgm__lock_take(&ctx->pl->lock);
  b->event = ev;
  b->state = BUF_RELEASED;
  pol_put(ctx->pl, b, true); /* acquired buffers are always resident */
  sgm__lock_drop(&ctx->pl->lock);
  return SGM_OK;
}

static int buffer_bounds(const sgm_buffer *b, size_t offset, const void *p, size_t n, const char *fn) {
  if (!b) return sgm__error_set(SGM_ERR_INVALID, "%s: buffer is NULL", fn);
  if (!p && n) return sgm__error_set(SGM_ERR_INVALID, "%s: host pointer is NULL", fn);
  if (offset > b->size || n > b->size - offset)
    return sgm__error_set(SGM_ERR_INVALID, "%s: offset %zu + %zu bytes is past the buffer's %llu bytes",
                          fn, offset, n, (unsigned long long)b->size);
  return SGM_OK;
}

/* Copy between host memory and b's data. write: host → buffer. */
static int buffer_io(sgm_buffer *b, size_t offset, void *host, size_t n, bool write) {
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  if (n == 0) return SGM_OK;
  sgm__lock_take(&pl->lock);
  bool was_fresh = b->fresh;
  buf_state was = buf_take_locked(pl, b, TAKE_USE);
  sgm__lock_drop(&pl->lock);
  int rc = SGM_OK;
  if (b->tier == SGM_TIER_DISK) {
    void *img = malloc(b->size);
    rc = img ? disk_load(ctx, b, img)
             : sgm__error_set(SGM_ERR_NOMEM, "out of host memory staging a %llu-byte buffer",
                              (unsigned long long)b->size);
    if (rc == SGM_OK && !write) memcpy(host, (char *)img + offset, n);
    if (rc == SGM_OK && write) {
      memcpy((char *)img + offset, host, n);
      sgm_disk_extent ext;
      rc = sgm__disk_write(pl->disk, img, b->size, &ext);
      if (rc == SGM_OK) {
        if (b->ext.bytes) sgm__disk_free(pl->disk, &b->ext);
        b->ext = ext;
      }
    }
    free(img);
  } else if (write) {
    rc = copy(ctx, SGM_COPY_HOST_TO_DEVICE, b->dptr + offset, (uintptr_t)host, n);
  } else {
    rc = copy(ctx, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)host, b->dptr + offset, n);
  }
  buf_finish(pl, b, was, !was_fresh); /* an upload into a fresh buffer is no use */
  return rc;
}

SGM_API sgm_status sgm_buffer_write(sgm_buffer *b, size_t offset, const void *src, size_t n) {
  int rc = buffer_bounds(b, offset, src, n, "sgm_buffer_write");
  if (rc != SGM_OK) return (sgm_status)rc;
  return (sgm_status)buffer_io(b, offset, (void *)(uintptr_t)src, n, true);
}

SGM_API sgm_status sgm_buffer_read(sgm_buffer *b, size_t offset, void *dst, size_t n) {
  int rc = buffer_bounds(b, offset, dst, n, "sgm_buffer_read");
  if (rc != SGM_OK) return (sgm_status)rc;
  return (sgm_status)buffer_io(b, offset, dst, n, false);
}

SGM_API sgm_status sgm_buffer_evict(sgm_buffer *b, sgm_tier to) {
  BUF_CHECK(b, "sgm_buffer_evict");
  if (to != SGM_TIER_SHARED && to != SGM_TIER_DISK)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_evict: tier %d is not "
                                      "SGM_TIER_SHARED or SGM_TIER_DISK", (int)to);
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  while (b->state == BUF_BUSY) pthread_cond_wait(&pl->cond, &pl->lock.mu);
  if (b->state == BUF_ACQUIRED) {
    sgm__lock_drop(&pl->lock);
    return (sgm_status)sgm__error_set(SGM_ERR_BUSY, "sgm_buffer_evict: the buffer is acquired");
  }
  if (b->event && ctx->bops->event_query(ctx->be, b->event) != 1) {
    sgm__lock_drop(&pl->lock);
    return (sgm_status)sgm__error_set(SGM_ERR_BUSY, "sgm_buffer_evict: GPU work queued before "
                                      "release has not completed yet");
  }
  buf_take_locked(pl, b, TAKE_MOVE);
  sgm__lock_drop(&pl->lock);
  int rc = b->tier < to ? demote(ctx, b, to, false) : SGM_OK;
  buf_finish(pl, b, BUF_RELEASED, false);
  return (sgm_status)rc;
}

SGM_API sgm_status sgm_buffer_prefetch(sgm_buffer *b, void *stream) {
  (void)stream;
  BUF_CHECK(b, "sgm_buffer_prefetch");
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  int rc = SGM_OK;
  sgm__lock_take(&pl->lock);
  if (b->state == BUF_RELEASED && b->tier != SGM_TIER_VRAM && !b->prefetch_queued) {
    if (!pl->worker_started) {
      int e = pthread_create(&pl->worker, NULL, prefetch_main, ctx);
      if (e == 0) pl->worker_started = true;
      else rc = sgm__error_set(SGM_ERR_NOMEM, "cannot start the prefetch thread: %s", strerror(e));
    }
    if (rc == SGM_OK) {
      b->prefetch_queued = true;
      b->pf_prev = pl->pf_tail;
      b->pf_next = NULL;
      if (pl->pf_tail) pl->pf_tail->pf_next = b;
      else pl->pf_head = b;
      pl->pf_tail = b;
      pthread_cond_signal(&pl->work_cond);
    }
  }
  sgm__lock_drop(&pl->lock);
  return (sgm_status)rc;
}

SGM_API sgm_status sgm_buffer_set_priority(sgm_buffer *b, int priority) {
  BUF_CHECK(b, "sgm_buffer_set_priority");
  if (priority < SGM_PRIORITY_MINIMUM || priority > SGM_PRIORITY_MAXIMUM)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_set_priority: %d is not a "
                                      "priority (SGM_PRIORITY_MINIMUM 0 .. SGM_PRIORITY_MAXIMUM 4)",
                                      priority);
  struct sgm_placement *pl = b->ctx->pl;
  sgm__lock_take(&pl->lock);
  bool listed = b->listed, fresh = b->fresh;
  /* A listed buffer moves to its new level at once (as new there); a pinned
   * one when its pin ends (pol_put sees the levels differ). */
  pol_take(pl, b, SGM_POLICY_REMOVE_DROP);
  b->priority = priority;
  if (listed) {
    pol_put(pl, b, false);
    b->fresh = fresh;
  }
  sgm__lock_drop(&pl->lock);
  return SGM_OK;
}

SGM_API sgm_tier sgm_buffer_tier(const sgm_buffer *b) {
  if (!b) return SGM_TIER_NONE;
  struct sgm_placement *pl = b->ctx->pl;
  sgm__lock_take(&pl->lock);
  sgm_tier t = __atomic_load_n(&b->tier, __ATOMIC_RELAXED); /* see buf_set_tier */
  sgm__lock_drop(&pl->lock);
  return t;
}

SGM_API size_t sgm_buffer_size(const sgm_buffer *b) { return b ? (size_t)b->size : 0; }

SGM_API void sgm_buffer_destroy(sgm_buffer *b) {
  if (!b) return;
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  buf_take_locked(pl, b, TAKE_FREE);
  if (b->all_prev) b->all_prev->all_next = b->all_next;
  else pl->all = b->all_next;
  if (b->all_next) b->all_next->all_prev = b->all_prev;
  if (b->tier == SGM_TIER_DISK) {
    pl->n_disk_live--;
    pl->disk_used_bytes -= b->size;
  }
  sgm__lock_drop(&pl->lock);
  buffer_free_storage(ctx, b);
  free(b);
}
