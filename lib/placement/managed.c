/*
 * managed.c — SGM_POINTERS=managed: framework pointers that move.
 *
 * In managed mode a block of SGM_MANAGED_MOVABLE_BYTES or more from sgm_alloc
 * is its own Unified Memory range (backend managed_alloc), so no other block
 * shares its pages and it can move on its own. Smaller blocks are carved from
 * the fixed pools as in fixed mode: they share pages (and chunks) with their
 * neighbours, so they are placed once and never move (docs/managed.md).
 *
 * A movable block is an sgm_buffer with b->managed set: it joins the
 * placement's list and the residency policy of the tier it is placed in, in
 * state RELEASED (a framework never acquires: the GPU may use it at any time,
 * which Unified Memory allows while its pages move). So the VRAM policy picks
 * colder managed blocks and released buffers alike as victims when VRAM is
 * full (residency.c, rule 2), and a managed victim is demoted in place
 * (migrate.c: advice + prefetch, same address) instead of copied.
 *
 * Budgets: a block's bytes are charged to the tier it is placed in
 * (sgm__tier_charge), so device-placed bytes count against the VRAM budget
 * beside the fixed pool's chunks, and sgm never asks the driver to place more
 * on the card than the budget: the driver never evicts on its own.
 *
 * Promotion: when VRAM room appears (a managed block in VRAM freed, sgm_trim,
 * the idle tick, a hint), the shared-placed blocks with the highest priority,
 * then the most recently touched, come back first, as long as they fit in the
 * room that is free (no demotion for a promotion). The free path promotes at
 * most MANAGED_INLINE_BYTES; the idle thread does the rest.
 *
 * The cache of freed ranges: a free keeps the block's range (and its charge:
 * committed but not used, as free chunk memory in fixed mode) in the cache of
 * the tier it is placed in, tagged with the free's stream. The next movable
 * request of the same page-rounded size, or up to 1/8 less (the slack is
 * counted), placed in that tier gets it back with no driver call: at once on
 * the same stream, on another after a device-side wait (the transfer rule of
 * docs/streams.md). Cached ranges go back to the driver on sgm_trim, on the
 * idle tick once older than SGM_IDLE_TRIM_MS, when a budget is lowered under
 * them, and before anything is demoted, promoted into, or falls back for room
 * (residency.c calls sgm__managed_cache_drop first). A block that
 * sgm_record_stream named another stream for is never cached: cuMemFree
 * waits for every stream.
 *
 * Threading: the address map, the counters, the blocks' managed fields and
 * the cache are guarded by pl->mlock, the managed lock; pl->lock (the list
 * of every buffer) is taken only when a range is created or given back. A
 * cached range stays in the map (b->mcached: not live) and in pl->all, so a
 * steady-state alloc + free pair of a cached range takes pl->mlock only: a
 * reused range's listing in its tier's policy is deferred (pl->mpending, BUSY,
 * owned by that list) and the free that takes it back never meets the
 * residency lock; sgm__managed_flush lists the pending blocks, oldest first,
 * before any victim search, promotion or new range. A block's
 * state and listing follow the placement rules (placement.h: its state word,
 * its tier's residency lock); a move marks the block BUSY and runs without
 * locks. A block freed while it moves waits for the move
 * (sgm__buffer_wait_busy), then looks it up again.
 */
#include <stdio.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

/* A free or a cold hint moves at most this much on the calling thread (about
 * 0.4 ms at PCIe 4 speed); the worker moves the rest on the copy stream
 * (managed_queue.c). A cold hint's demotion of a larger block is queued. */
#define MANAGED_INLINE_BYTES (UINT64_C(8) << 20)
/* At most this many reused blocks wait for their policy listing (pending):
 * then all are listed at once. A framework's steady state frees most of its
 * blocks within a few dozen allocations, so most never meet the policy lock. */
#define MANAGED_PENDING_MAX 64


static size_t managed_bucket(uint64_t d) {
  uint64_t k = d >> 16; /* ranges are page-aligned */
  k ^= k >> 29;
  k *= 0xbf58476d1ce4e5b9ull;
  k ^= k >> 32;
  return (size_t)(k & (SGM_MANAGED_BUCKETS - 1));
}

/* The managed block starting at d, live or cached (pl->mlock held); NULL if none. */
static sgm_buffer *managed_find_locked(struct sgm_placement *pl, uint64_t d) {
  for (sgm_buffer *b = pl->mhash[managed_bucket(d)]; b; b = b->mnext)
    if (b->dptr == d) return b;
  return NULL;
}

/* The live managed block starting at d (pl->mlock held); NULL if none. */
static sgm_buffer *managed_live_locked(struct sgm_placement *pl, uint64_t d) {
  sgm_buffer *b = managed_find_locked(pl, d);
  return b && !b->mcached ? b : NULL;
}

/* The live managed block whose range holds [p, p + n) (pl->mlock held): by
 * its start, else a walk of the map (a pointer inside a block). */
static sgm_buffer *managed_find_range_locked(struct sgm_placement *pl, uint64_t p, uint64_t n) {
  sgm_buffer *b = managed_live_locked(pl, p);
  for (size_t k = 0; !b && k < SGM_MANAGED_BUCKETS; k++)
    for (sgm_buffer *x = pl->mhash[k]; x; x = x->mnext)
      if (!x->mcached && p >= x->dptr && p - x->dptr < x->size) b = x;
  return b && n <= b->size - (p - b->dptr) ? b : NULL;
}

/* Out of the address map (pl->mlock held). */
static void managed_unmap_locked(struct sgm_placement *pl, sgm_buffer *b) {
  sgm_buffer **pp = &pl->mhash[managed_bucket(b->dptr)];
  while (*pp != b) pp = &(*pp)->mnext;
  *pp = b->mnext;
  b->mnext = NULL;
}

/* Out of the list of every buffer (takes pl->lock; b BUSY, out of the map). */
static void managed_unlist_all(struct sgm_placement *pl, sgm_buffer *b) {
  sgm__lock_take(&pl->lock);
  if (b->all_prev) b->all_prev->all_next = b->all_next;
  else pl->all = b->all_next;
  if (b->all_next) b->all_next->all_prev = b->all_prev;
  b->all_prev = b->all_next = NULL;
  sgm__lock_drop(&pl->lock);
}

/* b (BUSY, freed) enters tier t's cache, newest first (pl->mlock held). */
static void managed_cache_push_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_tier t) {
  b->mcached = true;
  b->mc_prev = NULL;
  b->mc_next = pl->mcache[t];
  if (b->mc_next) b->mc_next->mc_prev = b;
  pl->mcache[t] = b;
  pl->mcache_bytes[t] += b->size;
  MANAGED_BUMP(pl->n_mcache, 1);
}

/* Cached b leaves tier t's cache list (pl->mlock held); b->mcached stays set
 * until it is live again (managed_enliven_locked) or given back. */
static void managed_cache_unlink_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_tier t) {
  if (b->mc_prev) b->mc_prev->mc_next = b->mc_next;
  else pl->mcache[t] = b->mc_next;
  if (b->mc_next) b->mc_next->mc_prev = b->mc_prev;
  b->mc_prev = b->mc_next = NULL;
  pl->mcache_bytes[t] -= b->size;
  MANAGED_BUMP(pl->n_mcache, -1);
}

/* List the pending blocks in their tiers' policies, oldest first, with ids
 * handed out in one step (pl->mlock held; each residency lock ranks after). */
static void managed_flush_locked(struct sgm_placement *pl) {
  if (!pl->mpending_head) return;
  uint64_t id = __atomic_fetch_add(&pl->next_id, pl->n_mpending, __ATOMIC_RELAXED);
  while (pl->mpending_head) {
    sgm_buffer *b = pl->mpending_head;
    pl->mpending_head = b->mc_next;
    b->mc_prev = b->mc_next = NULL;
    b->mpending = false;
    b->item.id = ++id;
    sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false);
  }
  pl->mpending_tail = NULL;
  __atomic_store_n(&pl->n_mpending, 0, __ATOMIC_RELAXED);
}

void sgm__managed_flush(sgm_context *ctx) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (__atomic_load_n(&pl->n_mpending, __ATOMIC_RELAXED) == 0) return;
  sgm__lock_take(&pl->mlock);
  managed_flush_locked(pl);
  sgm__lock_drop(&pl->mlock);
}

int sgm__managed_open(sgm_context *ctx) {
  sgm__parts_w(ctx)->managed = false;
  if (sgm__parts_cfg(ctx)->pointers == SGM_POINTERS_FIXED) return SGM_OK;
  int rc = sgm__parts_bops(ctx)->managed_support
               ? sgm__parts_bops(ctx)->managed_support(sgm__parts_be(ctx))
               : sgm__error_set(SGM_ERR_UNSUPPORTED, "the %s backend of this build has no Unified "
                                "Memory support", sgm__parts_bops(ctx)->name);
  if (rc == SGM_OK) {
    sgm__parts_w(ctx)->managed = true;
    return SGM_OK;
  }
  if (sgm__parts_cfg(ctx)->pointers == SGM_POINTERS_MANAGED)
    return sgm__error_set(SGM_ERR_UNSUPPORTED, "SGM_POINTERS=managed is not possible here: %s. Use "
                          "SGM_POINTERS=fixed, or auto to fall back to fixed pointers", sgm_last_error());
  sgm__log(sgm__parts_cfg(ctx)->verbose, 1, "SGM_POINTERS=auto: pointers are fixed (Unified Memory is not "
           "available: %s)", sgm_last_error());
  sgm__error_clear();
  return SGM_OK;
}

/* Charge size bytes to VRAM (demoting colder blocks, cand = b), else to shared memory. */
static int managed_charge_where(sgm_context *ctx, sgm_buffer *b, sgm_tier *where) {
  *where = SGM_TIER_VRAM;
  int rc = sgm__residency_charge_for(ctx, SGM_TIER_VRAM, b->size, b);
  if (rc != SGM__ERR_BUDGET && rc != SGM_ERR_NOMEM) return rc;
  if (!sgm__parts_cfg(ctx)->shared_fallback) {
    sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_VRAM), b->size);
    return sgm__error_set(SGM_ERR_NOMEM, "%s; shared GPU memory fallback is off (SGM_SHARED_FALLBACK=on "
                          "lets full VRAM spill into pinned host memory)", sgm_last_error());
  }
  *where = SGM_TIER_SHARED;
  rc = sgm__residency_charge_for(ctx, SGM_TIER_SHARED, b->size, NULL);
  if (rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM)
    return sgm__residency_both_full(ctx, b->size, rc == SGM__ERR_BUDGET, "sgm_alloc", "");
  return rc;
}

/* b (new and RELEASED, or cached BUSY; placed in tier t, charged there, in
 * the map) becomes a live movable block for a request of want page-rounded
 * bytes on stream: its fields, the counters, and a listing in its tier's
 * policy, under that tier's residency lock (pl->mlock held, ranked before);
 * defer (a cached one): the listing waits in the pending list, b BUSY. */
static void managed_enliven_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_tier t, uint64_t want,
                                   void *stream, bool defer) {
  b->magic = SGM_BUFFER_LIVE;
  b->mwant = want;
  b->priority = SGM_PRIORITY_NORMAL;
  b->item.size_bytes = b->size;
  b->item.priority = SGM_PRIORITY_NORMAL;
  b->item.state = pl->state_bytes ? (char *)b + pl->state_offset : NULL;
  b->managed = true;
  b->mcached = false;
  b->mstream = stream;
  b->cold = false;
  b->mrecorded = false;
  b->tier = t;
  b->touch = ++pl->managed_clock;
  pl->n_managed_in[t]++;
  pl->mslack_in[t] += b->size - want;
  MANAGED_BUMP(pl->n_managed, 1);
  if (!defer) {
    b->item.id = __atomic_add_fetch(&pl->next_id, 1, __ATOMIC_RELAXED);
    sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false); /* listed in tier t's policy, under its lock */
    return;
  }
  b->mpending = true;
  b->mc_next = NULL;
  b->mc_prev = pl->mpending_tail;
  if (pl->mpending_tail) pl->mpending_tail->mc_next = b;
  else pl->mpending_head = b;
  pl->mpending_tail = b;
  MANAGED_BUMP(pl->n_mpending, 1);
  if (pl->n_mpending > MANAGED_PENDING_MAX) managed_flush_locked(pl);
}

/* The cached range of tier t that best fits want page-rounded bytes for the
 * stream ref (the smallest of want .. want + want / 8, the stream's own first),
 * out of the cache, ordered for ref and live for stream; NULL when none (or
 * the only fit cannot be ordered now: a capture). No lock held; takes
 * pl->mlock only (the range stays in the map and pl->all). */
static sgm_buffer *managed_cache_take(sgm_context *ctx, sgm_tier t, uint64_t want,
                                      const sgm_stream_ref *ref, void *stream) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (__atomic_load_n(&pl->n_mcache, __ATOMIC_RELAXED) == 0) return NULL;
  uint64_t most = want + want / 8;
  sgm_buffer *best = NULL;
  sgm__lock_take(&pl->mlock);
  for (sgm_buffer *c = pl->mcache[t]; c; c = c->mc_next) {
    if (c->size < want || c->size > most) continue;
    bool mine = c->mref.key == ref->key, best_mine = best && best->mref.key == ref->key;
    if (!best || (mine && !best_mine) || (mine == best_mine && c->size < best->size)) best = c;
  }
  if (best) {
    managed_cache_unlink_locked(pl, best, t);
    pl->n_mcache_hits++;
  }
  bool ordered = best && (best->mref.key == ref->key || sgm__parts_bops(ctx)->synchronous);
  if (ordered) managed_enliven_locked(pl, best, t, want, stream, true); /* one lock for the whole reuse */
  sgm__lock_drop(&pl->mlock);
  if (!best || ordered) return best;
  /* Freed on another stream: its work there may still use the range. */
  void *ev = NULL;
  int rc = sgm__parts_bops(ctx)->event_create(sgm__parts_be(ctx), &ev);
  if (rc == SGM_OK) rc = sgm__parts_bops(ctx)->stream_transfer(sgm__parts_be(ctx), ev, &best->mref, ref);
  sgm__parts_bops(ctx)->event_destroy(sgm__parts_be(ctx), ev);
  sgm__lock_take(&pl->mlock);
  if (rc == SGM_OK) {
    managed_enliven_locked(pl, best, t, want, stream, true);
    sgm__lock_drop(&pl->mlock);
    return best;
  }
  sgm__error_clear();
  pl->n_mcache_hits--; /* back, newest first: it stays with its stream */
  managed_cache_push_locked(pl, best, t);
  sgm__lock_drop(&pl->mlock);
  return NULL;
}

int sgm__managed_alloc(sgm_context *ctx, size_t size, void *stream, uint64_t *out, sgm_tier *where) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  *out = 0;
  *where = SGM_TIER_NONE;
  if (size > UINT64_MAX - SGM_MANAGED_PAGE)
    return sgm__error_set(SGM_ERR_NOMEM, "sgm_alloc: %zu bytes is more than any device holds", size);
  uint64_t want = sgm__align_up(size, SGM_MANAGED_PAGE);
  sgm_stream_ref ref;
  sgm__parts_bops(ctx)->stream_ref(sgm__parts_be(ctx), stream, &ref);
  sgm_tier t = SGM_TIER_VRAM;
  sgm_buffer *b = managed_cache_take(ctx, SGM_TIER_VRAM, want, &ref, stream); /* placed, charged */
  if (b) goto out_done;
  b = calloc(1, pl->state_offset + pl->state_bytes);
  if (!b) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for a managed block");
  b->ctx = ctx;
  b->size = want;
  b->listed_in = SGM_N_RESIDENT;
  int rc = managed_charge_where(ctx, b, &t);
  if (rc != SGM_OK) goto out_free;
  if (t == SGM_TIER_SHARED) {
    sgm_buffer *c = managed_cache_take(ctx, SGM_TIER_SHARED, want, &ref, stream);
    if (c) {
      sgm__tier_uncharge(sgm__parts_tier(ctx, t), b->size); /* c holds its own charge */
      free(b);
      b = c;
      goto out_done;
    }
  }
  rc = sgm__parts_bops(ctx)->managed_alloc(sgm__parts_be(ctx), b->size, &b->dptr);
  if (rc != SGM_OK) goto out_charge;
  rc = sgm__migrate_managed_place(ctx, b->dptr, b->size, t, stream);
  if (rc != SGM_OK) goto out_range;
  b->tier = t;
  sgm__lock_take(&pl->lock); /* a new range: into the list of every buffer and the map */
  b->all_prev = NULL;
  b->all_next = pl->all;
  if (pl->all) pl->all->all_prev = b;
  pl->all = b;
  sgm__lock_take(&pl->mlock);
  size_t k = managed_bucket(b->dptr);
  b->mnext = pl->mhash[k];
  pl->mhash[k] = b;
  managed_flush_locked(pl); /* the policy sees blocks in the order they came */
  managed_enliven_locked(pl, b, t, want, stream, false);
  sgm__lock_drop(&pl->mlock);
  sgm__lock_drop(&pl->lock);
out_done:
  *out = b->dptr;
  *where = t; /* b may move once listed: not b->tier */
  return SGM_OK;

out_range:
  sgm__parts_bops(ctx)->managed_free(sgm__parts_be(ctx), b->dptr, b->size);
out_charge:
  sgm__tier_uncharge(sgm__parts_tier(ctx, t), b->size);
out_free:
  free(b);
  return rc;
}

int sgm__managed_free(sgm_context *ctx, uint64_t d, void *stream) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (__atomic_load_n(&pl->n_managed, __ATOMIC_RELAXED) == 0) return SGM_ERR_INVALID;
  sgm_stream_ref ref;
  sgm__parts_bops(ctx)->stream_ref(sgm__parts_be(ctx), stream, &ref);
  sgm__lock_take(&pl->mlock);
  sgm_buffer *b;
  for (;;) {
    b = managed_live_locked(pl, d);
    if (!b) {
      sgm__lock_drop(&pl->mlock);
      return SGM_ERR_INVALID;
    }
    if (sgm__managed_try_take_locked(pl, b, SGM_TAKE_FREE) != SGM_BUF_BUSY) break;
    sgm__buffer_wait_busy(pl, b, &pl->mlock); /* a move in flight; then look again */
  }
  sgm_mq_undo undo; /* a queued move of it ends here */
  sgm__managed_queue_cancel_locked(pl, b, &undo);
  pl->n_managed_in[b->tier]--;
  pl->mslack_in[b->tier] -= b->size - b->mwant;
  MANAGED_BUMP(pl->n_managed, -1);
  sgm_tier was = b->tier;
  bool waiting = pl->n_managed_in[SGM_TIER_SHARED] != 0; /* blocks that may want the room */
  bool cache = !b->mrecorded && !b->event;
  if (cache) { /* stays BUSY, charged where it is placed, in the map and pl->all */
    b->mref = ref;
    b->mcached_ms = 0; /* the next idle tick stamps it */
    managed_cache_push_locked(pl, b, was);
  } else {
    managed_unmap_locked(pl, b);
  }
  sgm__lock_drop(&pl->mlock);
  sgm__managed_queue_undo(ctx, &undo);
  if (!cache) {
    managed_unlist_all(pl, b);
    sgm__buffer_free_storage(ctx, b);
    free(b);
  }
  /* Room (the cache gives its ranges to promotions: sgm__managed_promote). */
  if (was == SGM_TIER_VRAM && waiting) sgm__managed_promote(ctx, MANAGED_INLINE_BYTES);
  return SGM_OK;
}

bool sgm__managed_record_stream(sgm_context *ctx, uint64_t d) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (__atomic_load_n(&pl->n_managed, __ATOMIC_RELAXED) == 0) return false;
  sgm__lock_take(&pl->mlock);
  sgm_buffer *b = managed_live_locked(pl, d);
  if (b) b->mrecorded = true;
  sgm__lock_drop(&pl->mlock);
  return b != NULL;
}

/* Give cached ranges back to the driver, oldest first: of tier t (or both,
 * t = SGM_TIER_COUNT) until at least want bytes went, only those an idle
 * tick stamped before `before_ms` (UINT64_MAX: any). Bytes given back. No
 * lock held. */
static uint64_t managed_cache_release(sgm_context *ctx, int t, uint64_t want, uint64_t before_ms) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (__atomic_load_n(&pl->n_mcache, __ATOMIC_RELAXED) == 0) return 0;
  sgm_buffer *out = NULL;
  uint64_t bytes = 0;
  sgm__lock_take(&pl->mlock);
  for (int k = 0; k < SGM_N_RESIDENT && bytes < want; k++) {
    if (t != SGM_TIER_COUNT && k != t) continue;
    sgm_buffer *c = pl->mcache[k];
    while (c && c->mc_next) c = c->mc_next; /* the oldest */
    while (c && bytes < want) {
      sgm_buffer *prev = c->mc_prev;
      if (before_ms == UINT64_MAX || (c->mcached_ms && c->mcached_ms < before_ms)) {
        managed_cache_unlink_locked(pl, c, (sgm_tier)k);
        pl->mrelease_bytes[c->tier] += c->size; /* charged until its storage is freed below */
        managed_unmap_locked(pl, c);
        pl->n_mcache_released++;
        bytes += c->size;
        c->mc_next = out;
        out = c;
      }
      c = prev;
    }
  }
  sgm__lock_drop(&pl->mlock);
  while (out) {
    sgm_buffer *c = out;
    out = c->mc_next;
    managed_unlist_all(pl, c);
    sgm_tier ct = c->tier; /* the tier its storage is charged to */
    sgm__buffer_free_storage(ctx, c); /* the driver's free waits for the range's work */
    sgm__lock_take(&pl->mlock);
    pl->mrelease_bytes[ct] -= c->size; /* uncharged now */
    sgm__lock_drop(&pl->mlock);
    free(c);
  }
  return bytes;
}

uint64_t sgm__managed_cache_drop(sgm_context *ctx, sgm_tier t, uint64_t want) {
  return managed_cache_release(ctx, t, want, UINT64_MAX);
}

uint64_t sgm__managed_cache_idle(sgm_context *ctx, uint64_t now_ms, uint64_t idle_ms) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (__atomic_load_n(&pl->n_mcache, __ATOMIC_RELAXED) == 0) return 0;
  /* A free reads no clock: the first tick that sees a range stamps it (the
   * context clock's 0 is "not stamped": a stamp is at least 1). */
  sgm__lock_take(&pl->mlock);
  for (int k = 0; k < SGM_N_RESIDENT; k++)
    for (sgm_buffer *c = pl->mcache[k]; c; c = c->mc_next)
      if (!c->mcached_ms) c->mcached_ms = now_ms ? now_ms : 1;
  sgm__lock_drop(&pl->mlock);
  uint64_t before = now_ms >= idle_ms ? now_ms - idle_ms + 1 : 0;
  return managed_cache_release(ctx, SGM_TIER_COUNT, UINT64_MAX, before);
}

uint64_t sgm__managed_cache_fit(sgm_context *ctx, sgm_tier t) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (!pl || __atomic_load_n(&pl->n_mcache, __ATOMIC_RELAXED) == 0) return 0;
  sgm_tier_stats ts;
  sgm__tier_stats(sgm__parts_tier(ctx, t), &ts);
  if (ts.committed_bytes <= ts.budget_bytes) return 0;
  return managed_cache_release(ctx, t, ts.committed_bytes - ts.budget_bytes, UINT64_MAX);
}

sgm_tier sgm__managed_tier(sgm_context *ctx, uint64_t d) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (__atomic_load_n(&pl->n_managed, __ATOMIC_RELAXED) == 0) return SGM_TIER_NONE;
  sgm__lock_take(&pl->mlock);
  sgm_buffer *b = managed_live_locked(pl, d);
  sgm_tier t = b ? __atomic_load_n(&b->tier, __ATOMIC_RELAXED) : SGM_TIER_NONE;
  sgm__lock_drop(&pl->mlock);
  return t;
}

/* Should shared-placed b come back before best (pl->mlock and the VRAM residency lock held)? The higher
 * priority first; within a level the VRAM policy's promote_before decides,
 * else the most recently touched. */
static bool managed_promote_before_locked(struct sgm_placement *pl, const sgm_buffer *b,
                                          const sgm_buffer *best) {
  if (b->priority != best->priority) return b->priority > best->priority;
  sgm_policy_item x = {.id = b->item.id, .size_bytes = b->size, .priority = b->priority, .state = NULL};
  sgm_policy_item y = {.id = best->item.id, .size_bytes = best->size, .priority = best->priority,
                       .state = NULL};
  int r = sgm__prio_promote_before(pl->pol[SGM_TIER_VRAM], &x, &y);
  return r < 0 ? b->touch > best->touch : r == 1;
}

/* The shared-placed block to promote first (pl->mlock held), as
 * managed_promote_before_locked orders them. NULL when none is idle. The VRAM
 * policy instance is asked under its residency lock (it ranks after
 * pl->mlock). */
static sgm_buffer *managed_best_shared_locked(struct sgm_placement *pl) {
  sgm_buffer *best = NULL;
  if (pl->n_managed_in[SGM_TIER_SHARED] == 0) return NULL;
  sgm_lock *vram = sgm__residency_lock(pl, SGM_TIER_VRAM);
  sgm__lock_take(vram);
  for (size_t k = 0; k < SGM_MANAGED_BUCKETS; k++)
    for (sgm_buffer *b = pl->mhash[k]; b; b = b->mnext) {
      /* A mover may be changing the tier of a BUSY one: atomic (placement.h). */
      if (b->mcached || b->mqueued || __atomic_load_n(&b->tier, __ATOMIC_RELAXED) != SGM_TIER_SHARED || b->cold ||
          sgm__buffer_state(b) != SGM_BUF_RELEASED)
        continue;
      if (!best || managed_promote_before_locked(pl, b, best)) best = b;
    }
  sgm__lock_drop(vram);
  return best;
}

uint64_t sgm__managed_promote(sgm_context *ctx, uint64_t inline_bytes) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  uint64_t moved = 0, here = 0;
  bool kick = false;
  for (;;) {
    if (__atomic_load_n(&pl->n_managed, __ATOMIC_RELAXED) == 0) break;
    sgm__lock_take(&pl->mlock);
    managed_flush_locked(pl); /* pending blocks are candidates too */
    sgm_buffer *b = managed_best_shared_locked(pl);
    /* Idle as seen under the lock; a mover that took it meanwhile wins. */
    bool lost = b && sgm__buffer_try_take(pl, b, SGM_TAKE_MOVE) == SGM_BUF_BUSY;
    sgm__lock_drop(&pl->mlock);
    if (!b) break;
    if (lost) continue;
    /* Only room that is free now: a promotion never demotes. */
    int rc = sgm__tier_charge(sgm__parts_tier(ctx, SGM_TIER_VRAM), b->size);
    /* Cached ranges are free memory: a block waiting in shared memory comes first. */
    if (rc == SGM__ERR_BUDGET && sgm__managed_cache_drop(ctx, SGM_TIER_VRAM, b->size))
      rc = sgm__tier_charge(sgm__parts_tier(ctx, SGM_TIER_VRAM), b->size);
    /* Past this thread's bound: the worker moves it, its room charged now. */
    bool queued = rc == SGM_OK && b->size > inline_bytes - here &&
                  sgm__managed_queue(ctx, b, SGM_TIER_VRAM) == SGM_OK;
    kick |= queued;
    if (rc == SGM_OK && !queued) {
      rc = sgm__migrate_managed(ctx, b, SGM_TIER_VRAM, false);
      if (rc == SGM_OK) here += b->size;
      if (rc != SGM_OK) {
        sgm__tier_uncharge(sgm__parts_tier(ctx, SGM_TIER_VRAM), b->size);
        sgm__log(sgm__parts_cfg(ctx)->verbose, 2, "promoting a managed block failed: %s", sgm_last_error());
      }
    }
    uint64_t size = b->size; /* once given back, b may be freed by its owner */
    sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false);
    if (rc != SGM_OK) break;
    moved += size;
  }
  if (kick) sgm__managed_queue_kick(ctx); /* once the blocks are given back */
  return moved;
}

void sgm__managed_stats(sgm_context *ctx, sgm_stats *st) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm__lock_take(&pl->mlock);
  for (int t = 0; t < SGM_N_RESIDENT; t++) st->tier[t].n_live += pl->n_managed_in[t];
  st->n_managed_promotions = pl->n_managed_moves[0];
  st->n_managed_demotions = pl->n_managed_moves[1];
  st->managed_promoted_bytes = pl->managed_moved_bytes[0];
  st->managed_demoted_bytes = pl->managed_moved_bytes[1];
  st->n_managed_live = pl->n_managed;
  st->n_managed_cache_hits = pl->n_mcache_hits;
  uint64_t cached[SGM_N_RESIDENT], releasing[SGM_N_RESIDENT], slack[SGM_N_RESIDENT];
  st->managed_slack_bytes = 0;
  for (int t = 0; t < SGM_N_RESIDENT; t++) {
    cached[t] = pl->mcache_bytes[t];
    releasing[t] = pl->mrelease_bytes[t];
    slack[t] = pl->mslack_in[t];
    st->managed_slack_bytes += slack[t];
    st->managed_cached_bytes += cached[t];
    st->tier[t].cached_bytes += cached[t];
  }
  sgm__lock_drop(&pl->mlock);
  for (int t = 0; t < SGM_N_RESIDENT; t++) {
    if (!sgm__parts_tier(ctx, t)) continue;
    /* Charged while cached too, and while a range taken out of the cache is
     * given back to the driver, but not used (a race with a free only shifts
     * bytes between the two for this one reading). The charge is read after
     * the snapshot under mlock, and a release uncharges before it leaves
     * releasing: a range on its way back is never counted as used (at worst,
     * for one reading, subtracted while already uncharged). */
    uint64_t charged = sgm__tier_charged(sgm__parts_tier(ctx, t));
    /* A reused range's slack is committed, not used, as a class block's
     * rounding in fixed mode (the random model's checkpoints found used
     * past the live requests by the slack: SGM_MODEL_SEED=20261204). */
    uint64_t idle = cached[t] + releasing[t] + slack[t];
    st->tier[t].used_bytes += charged > idle ? charged - idle : 0;
    if (st->tier[t].used_bytes > st->tier[t].peak_used_bytes)
      st->tier[t].peak_used_bytes = st->tier[t].used_bytes;
  }
  sgm__managed_queue_stats(ctx, st);
}

/* ---- the public calls ---- */

/* Take the managed block holding [p, p + n) for a move (SGM_OK, b BUSY and
 * owned by the caller) or say why not. */
static int managed_take(sgm_context *ctx, void *ptr, size_t n, const char *fn, sgm_buffer **out) {
  *out = NULL;
  if (!ctx) return sgm__error_set(SGM_ERR_INVALID, "%s: context is NULL", fn);
  if (sgm__parts_forked(ctx)) return sgm__parts_fork_error(ctx, fn);
  if (!sgm__parts_managed(ctx))
    return sgm__error_set(SGM_ERR_INVALID, "%s: the context's pointers are fixed (set "
                          "SGM_POINTERS=managed to get pointers sgm can move)", fn);
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm__lock_take(&pl->mlock);
  sgm_buffer *b;
  for (;;) {
    b = managed_find_range_locked(pl, (uint64_t)(uintptr_t)ptr, n);
    if (!b) {
      sgm__lock_drop(&pl->mlock);
      return sgm__error_set(SGM_ERR_INVALID, "%s: [%p, +%zu) is not inside one live managed block "
                            "(blocks under %zu bytes, and fixed pointers, never move)", fn, ptr, n,
                            SGM_MANAGED_MOVABLE_BYTES);
    }
    if (sgm__managed_try_take_locked(pl, b, SGM_TAKE_MOVE) != SGM_BUF_BUSY) break;
    sgm__buffer_wait_busy(pl, b, &pl->mlock); /* another move in flight; then look again */
  }
  sgm__lock_drop(&pl->mlock);
  *out = b;
  return SGM_OK;
}

/* b (taken) is wanted in VRAM (a use: the most recent) or, cold, out of it
 * until its user says otherwise; a plain prefetch to shared memory changes
 * neither. */
static void managed_mark(struct sgm_placement *pl, sgm_buffer *b, sgm_tier to, bool cold) {
  sgm__lock_take(&pl->mlock);
  if (to == SGM_TIER_VRAM) {
    b->cold = false;
    b->touch = ++pl->managed_clock;
  } else if (cold) {
    b->cold = true;
    b->touch = 0;
  }
  sgm__lock_drop(&pl->mlock);
}

/* Move b (taken) to tier `to`: to VRAM demoting colder blocks as the policy
 * allows, to shared memory as a demotion; a queued move of b gives way (the
 * caller's word is newer). A cold hint's demotion of a block over the inline
 * bound is queued (*queued: kick the worker once b is given back). */
static int managed_move(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool cold, bool *queued) {
  *queued = false;
  sgm__managed_queue_drop(ctx, b);
  if (b->tier == to) return SGM_OK;
  if (to == SGM_TIER_SHARED && cold && b->size > MANAGED_INLINE_BYTES) {
    int rc = sgm__residency_charge_for(ctx, SGM_TIER_SHARED, b->size, NULL);
    if (rc == SGM__ERR_BUDGET) return sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_SHARED), b->size);
    if (rc != SGM_OK) return rc;
    *queued = sgm__managed_queue(ctx, b, SGM_TIER_SHARED) == SGM_OK;
    if (*queued) return SGM_OK;
    sgm__error_clear(); /* not queued: moved here */
    rc = sgm__migrate_managed(ctx, b, SGM_TIER_SHARED, false);
    if (rc != SGM_OK) sgm__tier_uncharge(sgm__parts_tier(ctx, SGM_TIER_SHARED), b->size);
    return rc;
  }
  if (to == SGM_TIER_SHARED) return sgm__migrate_demote(ctx, b, SGM_TIER_SHARED, false);
  int rc = sgm__residency_charge_for(ctx, SGM_TIER_VRAM, b->size, b);
  if (rc == SGM__ERR_BUDGET) rc = sgm__tier_explain_budget(sgm__parts_tier(ctx, SGM_TIER_VRAM), b->size);
  if (rc != SGM_OK) return rc;
  rc = sgm__migrate_managed(ctx, b, SGM_TIER_VRAM, false);
  if (rc != SGM_OK) sgm__tier_uncharge(sgm__parts_tier(ctx, SGM_TIER_VRAM), b->size);
  return rc;
}

SGM_API sgm_status sgm_advise(sgm_context *ctx, void *ptr, sgm_priority priority, sgm_hint hint) {
  if ((int)priority < SGM_PRIORITY_MINIMUM || (int)priority > SGM_PRIORITY_MAXIMUM)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_advise: %d is not a priority "
                                      "(SGM_PRIORITY_MINIMUM 0 .. SGM_PRIORITY_MAXIMUM 4)", (int)priority);
  if ((int)hint < SGM_HINT_NONE || (int)hint > SGM_HINT_COLD)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_advise: %d is not a hint "
                                      "(SGM_HINT_NONE, SGM_HINT_HOT, SGM_HINT_COLD)", (int)hint);
  sgm_buffer *b;
  int rc = managed_take(ctx, ptr, 1, "sgm_advise", &b);
  if (rc != SGM_OK) return (sgm_status)rc;
  /* Set while BUSY (out of its policy): finish lists it at the new level. */
  sgm__lock_take(&sgm__parts_pl(ctx)->mlock);
  b->priority = priority;
  sgm__lock_drop(&sgm__parts_pl(ctx)->mlock);
  bool queued = false;
  if (hint != SGM_HINT_NONE) {
    sgm_tier to = hint == SGM_HINT_HOT ? SGM_TIER_VRAM : SGM_TIER_SHARED;
    managed_mark(sgm__parts_pl(ctx), b, to, hint == SGM_HINT_COLD);
    rc = managed_move(ctx, b, to, hint == SGM_HINT_COLD, &queued);
  }
  /* A hot block that could not come up stays where it is: still a use. */
  if (hint == SGM_HINT_HOT && rc == SGM_ERR_NOMEM) {
    sgm__error_clear();
    rc = SGM_OK;
  }
  sgm__buffer_finish(sgm__parts_pl(ctx), b, SGM_BUF_RELEASED, hint == SGM_HINT_HOT);
  /* Room a cold block left goes to the most valuable others (the worker
   * gives them the room of a queued demotion once it is done). */
  if (queued) sgm__managed_queue_kick(ctx);
  else if (rc == SGM_OK && hint == SGM_HINT_COLD) sgm__managed_promote(ctx, MANAGED_INLINE_BYTES);
  return (sgm_status)rc;
}

SGM_API sgm_status sgm_prefetch(sgm_context *ctx, void *ptr, size_t size, sgm_tier tier, void *stream) {
  if (tier != SGM_TIER_VRAM && tier != SGM_TIER_SHARED)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_prefetch: tier %d: a managed block "
                                      "lives in SGM_TIER_VRAM or SGM_TIER_SHARED", (int)tier);
  sgm_buffer *b;
  int rc = managed_take(ctx, ptr, size ? size : 1, "sgm_prefetch", &b);
  if (rc != SGM_OK) return (sgm_status)rc;
  b->mstream = stream; /* later moves are ordered after this caller's work too */
  managed_mark(sgm__parts_pl(ctx), b, tier, false);
  bool queued; /* never: no cold hint */
  rc = managed_move(ctx, b, tier, false, &queued);
  sgm__buffer_finish(sgm__parts_pl(ctx), b, SGM_BUF_RELEASED, tier == SGM_TIER_VRAM);
  return (sgm_status)rc;
}
