/*
 * residency.c — where data lives: every rule of DESIGN.md §3 that decides a
 * tier, and the victim search that asks the eviction policies (hosted by
 * residency_host.c: listing, pins, fresh buffers) whom to move.
 *
 *   rule 1  an allocation or a new buffer goes to VRAM if it fits
 *           (sgm__residency_alloc, sgm__residency_place_buffer)
 *   rule 2  else released buffers in VRAM are demoted until it does, as far
 *           as the VRAM policy admits the newcomer (sgm__residency_alloc_for)
 *   rule 3  else it lands in shared memory; an allocation stops there
 *   rule 4  a buffer may be created straight on disk
 *   rule 5  acquire brings a buffer back up (sgm__residency_make_resident)
 *   rule 6  a victim with GPU work pending is skipped (residency_pick_victim)
 *
 * Only released resident buffers are listed in a policy (residency_host.c),
 * so acquired and BUSY buffers are never victims. A victim with GPU work
 * pending (its release event not complete) is skipped: taken out with PIN,
 * put back with RESTORE once the search is over.
 *
 * Admit (an optional member of ABI 2): when VRAM is full and a newcomer — a
 * buffer being created there, or promoted by an acquire or a prefetch — needs
 * room, each victim is offered to the VRAM policy's admit before it leaves; a
 * refusal stops the eviction and the newcomer lands one tier down
 * (sgm__residency_alloc_for returns SGM__ERR_BUDGET, and its callers fall
 * back: create to shared memory, acquire to use in shared memory, prefetch to
 * staying put). Plain allocations and demotions never ask. A request that
 * could not fit even with every released buffer gone evicts nothing
 * (residency_could_fit).
 *
 * Locks and their order (ranks in internal.h, checked by the witness in
 * debug builds, lib/prim/lock.c):
 *
 *     pl->lock  <  pl->mlock  <  pl->pf_lock  <  res[VRAM]  <  res[SHARED]  <  tier pools  <  backend
 *     (BUFFERS)    (PREFETCH)      (RES_VRAM)    (RES_SHARED)    (TIER_*)
 *
 * Each resident tier's residency has its own lock, pl->res[t]: the policy
 * instance of that tier, its items, n_listed[t]. The disk tier's is its own
 * lock inside tiers/disk.c (its budget, sgm__disk_reserve). Buffers in
 * different tiers are taken, used and given back under different locks, so
 * an acquire in VRAM never waits for a victim search in shared memory.
 * An operation that spans two tiers — a demotion, a promotion — never holds
 * both: the mover takes the buffer under its source tier's lock (the buffer
 * is then BUSY and unlisted, so no lock is needed to keep it), drops that
 * lock, allocates and copies in the destination with no residency lock held
 * (that allocation may itself take the destination's lock to pick victims),
 * and gives the buffer back under the destination tier's lock (a pin its old
 * tier's policy still holds ends first, under that tier's lock, and that lock
 * is dropped before the next is taken: sgm__buffer_finish). Two residency
 * locks are held together only by the invariant walk, in rank order (VRAM
 * before shared), with nothing that waits inside. A victim search holds the
 * lock of the tier it searches and nothing else but the non-blocking event
 * query of the backend.
 *
 * Threading: the victim search runs under pl->res[t] of the tier it searches
 * (and calls the policy host, residency_host.c, there); the allocation
 * functions take the residency locks (and the pools' locks) in turn, never
 * across a move. Calls: the tier pools (tiers/), the priority layer
 * (policy.c), migrate.c to demote and promote, managed.c's cache, and the
 * backend's event query and destroy.
 */
#include <stdio.h>
#include <string.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

/* Debug builds walk every policy and buffer on each victim search while this
 * few buffers are listed, and on every 256th search above: the walk is O(n). */
#define RESIDENCY_CHECK_ALWAYS 256
#define RESIDENCY_CHECK_EVERY 256

/* ---- the victim search ---- */

/* Pick a victim in resident tier t for a request of `want` bytes: the
 * policy's choice, skipping buffers with GPU work pending. cand: the newcomer
 * the room is for (VRAM only), whose admission the policy is asked before the
 * victim leaves; NULL = no question. Returns the victim BUSY, or NULL when
 * every listed buffer is busy on the GPU, none is listed, or the policy
 * refused the newcomer (*refused set; the victim stays listed). */
static sgm_buffer *residency_pick_victim(sgm_context *ctx, sgm_tier t, uint64_t want,
                                         const sgm_buffer *cand, bool *refused) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm_buffer *v = NULL, *skipped = NULL;
  uint64_t listed = __atomic_load_n(&pl->n_listed[0], __ATOMIC_RELAXED) +
                    __atomic_load_n(&pl->n_listed[1], __ATOMIC_RELAXED);
  uint64_t search = __atomic_fetch_add(&pl->n_searches, 1, __ATOMIC_RELAXED);
  /* The walk takes every placement lock itself: before this search's. */
  if (SGM_EXPENSIVE_CHECKS && (listed <= RESIDENCY_CHECK_ALWAYS || search % RESIDENCY_CHECK_EVERY == 0))
    sgm_assert_expensive(pl->ask.valid(pl));
  sgm_lock *lock = sgm__residency_lock(pl, t);
  sgm__lock_take(lock);
  sgm_policy_item *it;
  while (!v && (it = sgm__prio_next_victim(pl->pol[t], want)) != NULL) {
    sgm_buffer *b = sgm__buffer_of(it);
    sgm_assert(b->listed && sgm__buffer_state(b) == SGM_BUF_RELEASED && b->tier == t);
    if (b->managed && t != SGM_TIER_VRAM) {
      /* A managed block never leaves shared memory for disk. */
      sgm__residency_take(pl, b, SGM_POLICY_REMOVE_PIN);
      b->skip_next = skipped;
      skipped = b;
      continue;
    }
    if (b->event) {
      if (sgm__parts_bops(ctx)->event_query(sgm__parts_be(ctx), b->event) != 1) {
        sgm__residency_take(pl, b, SGM_POLICY_REMOVE_PIN); /* out of the way while the search goes on */
        b->skip_next = skipped;
        skipped = b;
        continue;
      }
      sgm__parts_bops(ctx)->event_destroy(sgm__parts_be(ctx), b->event);
      b->event = NULL;
    }
    if (cand) {
      /* Atomic: priority is the one field of cand another thread
       * (set_priority) may write. */
      sgm_policy_item c = {.id = cand->item.id, .size_bytes = cand->size,
                           .priority = __atomic_load_n(&cand->priority, __ATOMIC_RELAXED), .state = NULL};
      if (!sgm__prio_admit(pl->pol[t], &c, it)) {
        *refused = true;
        break;
      }
    }
    sgm__residency_take(pl, b, SGM_POLICY_REMOVE_EVICT);
    v = b;
  }
  /* Last skipped first: each goes back to the eviction end, so the original
   * order is kept there. */
  while (skipped) {
    sgm_buffer *b = skipped;
    skipped = b->skip_next;
    b->skip_next = NULL;
    sgm__residency_put(pl, b, false);
  }
  /* Listed, so RELEASED with nobody waiting; ours under the lock: taken. */
  if (v)
    __atomic_store_n(&v->state,
                     ((__atomic_load_n(&v->state, __ATOMIC_RELAXED) & SGM_BUF_GEN_MASK) + SGM_BUF_GEN_ONE) |
                         SGM_BUF_BUSY,
                     __ATOMIC_SEQ_CST);
  sgm__lock_drop(lock);
  return v;
}

/* Could size bytes ever fit in tier t if every released buffer there left?
 * No when the request exceeds the budget, or the room left plus everything
 * evictable (each buffer counted with the most its rounding can add) falls
 * short: evicting would then move buffers for nothing. A hint read under two
 * locks in turn (the pool's, then pl->res[t]); a race only decides which tier
 * the request lands in. */
static bool residency_could_fit(sgm_context *ctx, sgm_tier t, uint64_t size) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm_tier_stats ts;
  sgm__tier_stats(sgm__parts_tier(ctx, t), &ts);
  uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
  if (need > ts.budget_bytes) return false;
  sgm__lock_take(sgm__residency_lock(pl, t));
  uint64_t movable = sgm__prio_reclaimable(pl->pol[t]) + pl->n_listed[t] * (SGM_DEVICE_ALIGN - 1);
  sgm__lock_drop(sgm__residency_lock(pl, t));
  /* Managed blocks placed here hold budget too (charged, not carved). */
  uint64_t used = ts.used_bytes + sgm__tier_charged(sgm__parts_tier(ctx, t));
  uint64_t room = ts.budget_bytes > used ? ts.budget_bytes - used : 0;
  return need <= room || need - room <= movable;
}

static bool residency_full(int rc) { return rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM; }

/* One try in tier t. With a stream the block is the user's
 * (sgm__tier_alloc_on: the stream's cache and other streams' cached memory
 * come first), else sgm's own. */
static int residency_try(sgm_context *ctx, sgm_tier t, uint64_t size, const sgm_stream_ref *stream,
                         uint64_t *out) {
  /* out NULL: a managed block's charge (its pages live outside the pool). */
  return !out ? sgm__tier_charge(sgm__parts_tier(ctx, t), size)
         : stream ? sgm__tier_alloc_on(sgm__parts_tier(ctx, t), size, stream, out)
                  : sgm__tier_alloc(sgm__parts_tier(ctx, t), size, out);
}

/* Rules 1 and 2 in tier t after a first try that answered rc: while the
 * tier is full, demote released buffers (the policy's victims, never cand)
 * and try again. */
static int residency_making_room_after(sgm_context *ctx, sgm_tier t, uint64_t size,
                                       const sgm_buffer *cand, const sgm_stream_ref *stream,
                                       uint64_t *out, int rc) {
  bool checked = false;
  for (;; rc = residency_try(ctx, t, size, stream, out)) {
    if (!residency_full(rc)) return rc;
    /* Cached movable ranges are free memory: they go before anyone moves. */
    if (sgm__parts_pl(ctx)->ask.managed_cache_drop(ctx, t, size)) continue;
    sgm__parts_pl(ctx)->ask.managed_flush(ctx); /* reused blocks whose listing waits: victims too */
    if (__atomic_load_n(&sgm__parts_pl(ctx)->n_listed[t], __ATOMIC_RELAXED) == 0) return rc;
    if (!checked) {
      checked = true;
      if (!residency_could_fit(ctx, t, size)) return rc;
    }
    bool refused = false;
    sgm_buffer *v = residency_pick_victim(ctx, t, size, t == SGM_TIER_VRAM ? cand : NULL, &refused);
    if (!v) return rc;
    int drc = sgm__migrate_demote(ctx, v, (sgm_tier)(t + 1), true);
    sgm__buffer_finish(sgm__parts_pl(ctx), v, SGM_BUF_RELEASED, false);
    if (drc != SGM_OK) {
      /* A failed demotion (a full or failing spill file system, a copy that
       * failed) must never fail a request that fits without it: the victim
       * stays where it was, and the request is answered as if nothing more
       * could be evicted, so callers fall back (rule 3) or use the buffer
       * where it is (rule 5). */
      sgm__log(sgm__parts_cfg(ctx)->verbose, 2, "making room in %s: a demotion failed (%s); not evicting "
               "further", sgm_tier_name(t), sgm_last_error());
      return rc;
    }
  }
}

/* Rules 1 and 2 in tier t: allocate, and while the tier is full make room. */
static int residency_alloc_making_room(sgm_context *ctx, sgm_tier t, uint64_t size,
                                       const sgm_buffer *cand, const sgm_stream_ref *stream,
                                       uint64_t *out) {
  return residency_making_room_after(ctx, t, size, cand, stream, out,
                                     residency_try(ctx, t, size, stream, out));
}

/* WDDM's TrimToBudget: while tier t uses more than its (lowered) budget,
 * demote released buffers (the policy's victims, cascading) one tier down.
 * Allocations cannot move; they stay, and new ones fall back. Returns the
 * number of buffers moved. No lock held; may block on copies. */
uint64_t sgm__residency_trim_to_budget(sgm_context *ctx, sgm_tier t) {
  uint64_t moved = 0;
  for (;;) {
    sgm_tier_stats ts;
    sgm__tier_stats(sgm__parts_tier(ctx, t), &ts);
    if (ts.used_bytes <= ts.budget_bytes) break;
    sgm__parts_pl(ctx)->ask.managed_flush(ctx);
    if (__atomic_load_n(&sgm__parts_pl(ctx)->n_listed[t], __ATOMIC_RELAXED) == 0) break;
    bool refused = false;
    sgm_buffer *v = residency_pick_victim(ctx, t, ts.used_bytes - ts.budget_bytes, NULL, &refused);
    if (!v) break;
    int drc = sgm__migrate_demote(ctx, v, (sgm_tier)(t + 1), true);
    sgm__buffer_finish(sgm__parts_pl(ctx), v, SGM_BUF_RELEASED, false);
    if (drc != SGM_OK) {
      sgm__log(sgm__parts_cfg(ctx)->verbose, 2, "trimming %s to its budget: a demotion failed (%s)",
               sgm_tier_name(t), sgm_last_error());
      break;
    }
    moved++;
  }
  return moved;
}

int sgm__residency_alloc_for(sgm_context *ctx, sgm_tier t, uint64_t size, const sgm_buffer *cand,
                             uint64_t *out) {
  return residency_alloc_making_room(ctx, t, size, cand, NULL, out);
}

int sgm__residency_charge_for(sgm_context *ctx, sgm_tier t, uint64_t size, const sgm_buffer *cand) {
  return residency_alloc_making_room(ctx, t, size, cand, NULL, NULL);
}

/* ---- where things land ---- */

int sgm__residency_both_full(sgm_context *ctx, uint64_t size, bool explain_shared, const char *what,
                             const char *tail) {
  char shared[SGM_ERROR_MAX];
  if (explain_shared) sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_SHARED), size);
  snprintf(shared, sizeof shared, "%s", sgm_last_error());
  sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_VRAM), size);
  return sgm__error_set(SGM_ERR_NOMEM, "%s: VRAM and shared GPU memory are both full. VRAM: %s. "
                        "Shared: %s%s", what, sgm_last_error(), shared, tail);
}

/* Allocate in tier t for work on stream: the tier's stream caches, its free
 * memory and the other streams' cached blocks first (sgm__tier_alloc_on,
 * which reclaims cached memory before anything moves); only then are released
 * buffers demoted to make room (rule 2). The block is the user's. */
static int residency_alloc_in(sgm_context *ctx, sgm_tier t, size_t size, const sgm_stream_ref *stream,
                              sgm_devptr *d) {
  return residency_alloc_making_room(ctx, t, size, NULL, stream, d);
}

int sgm__residency_alloc(sgm_context *ctx, size_t size, void *stream, uint64_t *out, sgm_tier *where) {
  *where = SGM_TIER_VRAM;
  sgm_stream_ref ref;
  sgm__stream_ref(sgm__parts_bops(ctx), sgm__parts_be(ctx), stream, &ref);
  /* VRAM full with nothing to reclaim or demote (no cached block, no
   * released buffer, no cached movable range): rules 1 and 2 cannot place the
   * block, and the steady-state fallback takes no VRAM lock to learn it. A
   * budget with room for the block (an inline look at one counter) answers
   * first, so a pair that does not fall back makes no call for this. */
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  bool full = !sgm__tier_room_for(sgm__parts_tier(ctx, SGM_TIER_VRAM), size) && /* room: no call */
              __atomic_load_n(&pl->n_listed[SGM_TIER_VRAM], __ATOMIC_RELAXED) == 0 &&
              __atomic_load_n(&pl->n_mcache, __ATOMIC_RELAXED) == 0 &&
              sgm__tier_full_for(sgm__parts_tier(ctx, SGM_TIER_VRAM), size);
  /* Rules 1 and 2: the first try calls the tier itself, so that a pair the
   * caches or the sub-allocator serve pays for no more frames than these. */
  int rc = full ? SGM__ERR_BUDGET : sgm__tier_alloc_on(sgm__parts_tier(ctx, SGM_TIER_VRAM), size, &ref, out);
  if (sgm_likely(rc == SGM_OK)) return rc;
  if (!full) rc = residency_making_room_after(ctx, SGM_TIER_VRAM, size, NULL, &ref, out, rc);
  if (rc == SGM_OK) return rc;
  *where = SGM_TIER_NONE;
  *out = 0;
  if (!residency_full(rc)) return rc;
  if (!sgm__parts_cfg(ctx)->shared_fallback) {
    if (rc == SGM__ERR_BUDGET) sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_VRAM), size);
    return sgm__error_set(SGM_ERR_NOMEM, "%s; shared GPU memory fallback is off (SGM_SHARED_FALLBACK=on "
                          "lets full VRAM spill into pinned host memory)", sgm_last_error());
  }
  /* Rule 3, the first try direct as in VRAM (the fallback path's every pair). */
  rc = sgm__tier_alloc_on(sgm__parts_tier(ctx, SGM_TIER_SHARED), size, &ref, out);
  if (rc != SGM_OK) rc = residency_making_room_after(ctx, SGM_TIER_SHARED, size, NULL, &ref, out, rc);
  if (rc == SGM_OK) {
    *where = SGM_TIER_SHARED;
    return rc;
  }
  *out = 0;
  if (!residency_full(rc)) return rc;
  return sgm__residency_both_full(ctx, size, rc == SGM__ERR_BUDGET, "sgm_alloc", "");
}

int sgm__residency_alloc_shared(sgm_context *ctx, size_t size, void *stream, uint64_t *out) {
  sgm_stream_ref ref;
  sgm__stream_ref(sgm__parts_bops(ctx), sgm__parts_be(ctx), stream, &ref);
  int rc = residency_alloc_in(ctx, SGM_TIER_SHARED, size, &ref, out); /* rule 3 only */
  if (rc == SGM_OK) return rc;
  *out = 0;
  if (!residency_full(rc)) return rc;
  if (rc == SGM__ERR_BUDGET) sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_SHARED), size);
  return sgm__error_set(SGM_ERR_NOMEM, "sgm_alloc_shared: shared GPU memory is full: %s", sgm_last_error());
}

int sgm__residency_place_buffer(sgm_context *ctx, sgm_buffer *b) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  int rc = sgm__residency_alloc_for(ctx, SGM_TIER_VRAM, b->size, b, &b->dptr);
  if (rc == SGM_OK) {
    b->tier = SGM_TIER_VRAM;
    return rc;
  }
  if (!residency_full(rc)) return rc;
  rc = sgm__residency_alloc_for(ctx, SGM_TIER_SHARED, b->size, NULL, &b->dptr);
  if (rc == SGM_OK) b->tier = SGM_TIER_SHARED;
  if (!residency_full(rc)) return rc;
  /* Rule 4: the disk tier keeps the budget; b's bytes are promised there
   * until its chunks are written. */
  bool fits = pl->disk && sgm__disk_reserve(pl->disk, b->size) == SGM_OK;
  if (fits) {
    __atomic_add_fetch(&pl->n_disk_live, 1, __ATOMIC_RELAXED);
    b->tier = SGM_TIER_DISK; /* rule 4: straight to disk; no extent until written */
    return SGM_OK;
  }
  char what[64];
  snprintf(what, sizeof what, "sgm_buffer_create(%llu)", (unsigned long long)b->size);
  return sgm__residency_both_full(ctx, b->size, true, what,
                                  pl->disk ? ". Disk: the spill limit is reached (raise SGM_SPILL_LIMIT)"
                                           : ". Disk: off (set SGM_SPILL_DIR to spill to disk)");
}

/* Promote b into resident tier `to` if a block there can be had (evicting,
 * as far as the VRAM policy admits b). */
static int residency_promote(sgm_context *ctx, sgm_buffer *b, sgm_tier to) {
  if (b->managed) {
    int rc = sgm__residency_charge_for(ctx, to, b->size, b);
    if (rc == SGM_OK) rc = sgm__migrate_managed(ctx, b, to, false);
    else return rc;
    if (rc != SGM_OK) sgm__tier_uncharge(sgm__parts_tier(ctx, to), b->size);
    return rc;
  }
  sgm_devptr dst = 0;
  int rc = sgm__residency_alloc_for(ctx, to, b->size, b, &dst);
  if (rc != SGM_OK) return rc;
  return sgm__migrate_promote(ctx, b, to, dst);
}

int sgm__residency_make_resident(sgm_context *ctx, sgm_buffer *b) {
  if (b->tier == SGM_TIER_VRAM) return SGM_OK;
  int rc = residency_promote(ctx, b, SGM_TIER_VRAM);
  if (rc == SGM_OK) return SGM_OK;
  if (!residency_full(rc)) return rc;
  /* SGM_ERR_NOMEM with a message: the driver gave no memory, whatever the
   * budget says; keep its words for the message below. */
  char vram_why[SGM_ERROR_MAX] = "";
  if (rc == SGM_ERR_NOMEM) snprintf(vram_why, sizeof vram_why, "%s", sgm_last_error());
  if (b->tier == SGM_TIER_SHARED) return SGM_OK;
  rc = residency_promote(ctx, b, SGM_TIER_SHARED);
  if (!residency_full(rc)) return rc;
  char shared_why[SGM_ERROR_MAX];
  if (rc == SGM__ERR_BUDGET) sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_SHARED), b->size);
  snprintf(shared_why, sizeof shared_why, "%s", sgm_last_error());
  if (!vram_why[0]) {
    sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_VRAM), b->size);
    snprintf(vram_why, sizeof vram_why, "%s", sgm_last_error());
  }
  /* "Everything resident is acquired" only when it is so: nothing released
   * is left in either resident tier to evict. */
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  bool none_listed = __atomic_load_n(&pl->n_listed[SGM_TIER_VRAM], __ATOMIC_RELAXED) == 0 &&
                     __atomic_load_n(&pl->n_listed[SGM_TIER_SHARED], __ATOMIC_RELAXED) == 0;
  return sgm__error_set(SGM_ERR_NOMEM, "cannot make a %llu-byte buffer resident%s. VRAM: %s. "
                        "Shared: %s", (unsigned long long)b->size,
                        none_listed ? " (no released buffer is left to evict)" : "", vram_why,
                        shared_why);
}
