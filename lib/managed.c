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
 * most MANAGED_PROMOTE_INLINE_BYTES; the idle thread does the rest.
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
 * Threading: the address map and the counters are guarded by pl->lock; a
 * block's state and listing follow the placement rules (placement.h: its
 * state word, its tier's residency lock); a move marks the block BUSY and
 * runs without locks. A block freed while it moves waits for the
 * move (sgm__buffer_take_locked).
 */
#include <stdio.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

/* A free promotes at most this much inline: a bounded delay for the freeing
 * thread (about 3 ms at PCIe 4 speed); the idle thread moves the rest. */
#define MANAGED_PROMOTE_INLINE_BYTES (UINT64_C(64) << 20)

static size_t managed_bucket(uint64_t d) {
  uint64_t k = d >> 16; /* ranges are page-aligned */
  k ^= k >> 29;
  k *= 0xbf58476d1ce4e5b9ull;
  k ^= k >> 32;
  return (size_t)(k & (SGM_MANAGED_BUCKETS - 1));
}

/* The live managed block starting at d (pl->lock held); NULL if none. */
static sgm_buffer *managed_find_locked(struct sgm_placement *pl, uint64_t d) {
  for (sgm_buffer *b = pl->mhash[managed_bucket(d)]; b; b = b->mnext)
    if (b->dptr == d) return b;
  return NULL;
}

/* The live managed block whose range holds [p, p + n) (pl->lock held). */
static sgm_buffer *managed_find_range_locked(struct sgm_placement *pl, uint64_t p, uint64_t n) {
  sgm_buffer *b = managed_find_locked(pl, p);
  if (!b) {
    for (sgm_buffer *x = pl->all; x; x = x->all_next)
      if (x->managed && p >= x->dptr && p - x->dptr < x->size) b = x;
  }
  return b && n <= b->size - (p - b->dptr) ? b : NULL;
}

int sgm__managed_open(sgm_context *ctx) {
  sgm__context_set_managed(ctx, false);
  if (sgm__context_cfg(ctx)->pointers == SGM_POINTERS_FIXED) return SGM_OK;
  int rc = sgm__context_bops(ctx)->managed_support
               ? sgm__context_bops(ctx)->managed_support(sgm__context_be(ctx))
               : sgm__error_set(SGM_ERR_UNSUPPORTED, "the %s backend of this build has no Unified "
                                "Memory support", sgm__context_bops(ctx)->name);
  if (rc == SGM_OK) {
    sgm__context_set_managed(ctx, true);
    return SGM_OK;
  }
  if (sgm__context_cfg(ctx)->pointers == SGM_POINTERS_MANAGED)
    return sgm__error_set(SGM_ERR_UNSUPPORTED, "SGM_POINTERS=managed is not possible here: %s. Use "
                          "SGM_POINTERS=fixed, or auto to fall back to fixed pointers", sgm_last_error());
  sgm__log(sgm__context_cfg(ctx)->verbose, 1, "SGM_POINTERS=auto: pointers are fixed (Unified Memory is not "
           "available: %s)", sgm_last_error());
  sgm__error_clear();
  return SGM_OK;
}

/* Charge size bytes to VRAM (demoting colder blocks, cand = b), else to shared memory. */
static int managed_charge_where(sgm_context *ctx, sgm_buffer *b, sgm_tier *where) {
  *where = SGM_TIER_VRAM;
  int rc = sgm__residency_charge_for(ctx, SGM_TIER_VRAM, b->size, b);
  if (rc != SGM__ERR_BUDGET && rc != SGM_ERR_NOMEM) return rc;
  if (!sgm__context_cfg(ctx)->shared_fallback) {
    sgm__tier_explain_budget(sgm__context_tier(ctx, SGM_TIER_VRAM), b->size);
    return sgm__error_set(SGM_ERR_NOMEM, "%s; shared GPU memory fallback is off (SGM_SHARED_FALLBACK=on "
                          "lets full VRAM spill into pinned host memory)", sgm_last_error());
  }
  *where = SGM_TIER_SHARED;
  rc = sgm__residency_charge_for(ctx, SGM_TIER_SHARED, b->size, NULL);
  if (rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM)
    return sgm__residency_both_full(ctx, b->size, rc == SGM__ERR_BUDGET, "sgm_alloc", "");
  return rc;
}

/* b (RELEASED or cached BUSY, placed in tier t, charged there) becomes a live
 * movable block for a request of want page-rounded bytes on stream: listed in
 * its tier's policy, the address map and the live list (pl->lock held). */
static void managed_list_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_tier t, uint64_t want,
                                void *stream) {
  b->magic = SGM_BUFFER_LIVE;
  b->mwant = want;
  b->priority = SGM_PRIORITY_NORMAL;
  b->item.size_bytes = b->size;
  b->item.priority = SGM_PRIORITY_NORMAL;
  b->item.state = pl->state_bytes ? (char *)b + pl->state_offset : NULL;
  b->item.id = __atomic_add_fetch(&pl->next_id, 1, __ATOMIC_RELAXED);
  b->managed = true;
  b->mstream = stream;
  b->cold = false;
  b->mrecorded = false;
  b->tier = t;
  sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false); /* listed in tier t's policy, under its lock */
  b->all_prev = NULL;
  b->all_next = pl->all;
  if (pl->all) pl->all->all_prev = b;
  pl->all = b;
  size_t k = managed_bucket(b->dptr);
  b->mnext = pl->mhash[k];
  pl->mhash[k] = b;
  b->touch = ++pl->managed_clock;
  pl->n_managed_in[t]++;
  pl->mslack_bytes += b->size - want;
  __atomic_add_fetch(&pl->n_managed, 1, __ATOMIC_RELAXED);
}

/* The cached range of tier t that best fits want page-rounded bytes for the
 * stream ref (the smallest of want .. want + want / 8, the stream's own first),
 * out of the cache, ordered for ref and listed as a live block for stream;
 * NULL when none (or the only fit cannot be ordered now: a capture). No lock
 * held. */
static sgm_buffer *managed_cache_take(sgm_context *ctx, sgm_tier t, uint64_t want,
                                      const sgm_stream_ref *ref, void *stream) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  if (__atomic_load_n(&pl->n_mcache, __ATOMIC_RELAXED) == 0) return NULL;
  uint64_t most = want + want / 8;
  sgm_buffer *best = NULL;
  sgm__lock_take(&pl->lock);
  for (sgm_buffer *c = pl->mcache[t]; c; c = c->all_next) {
    if (c->size < want || c->size > most) continue;
    bool mine = c->mref.key == ref->key, best_mine = best && best->mref.key == ref->key;
    if (!best || (mine && !best_mine) || (mine == best_mine && c->size < best->size)) best = c;
  }
  if (best) {
    if (best->all_prev) best->all_prev->all_next = best->all_next;
    else pl->mcache[t] = best->all_next;
    if (best->all_next) best->all_next->all_prev = best->all_prev;
    best->all_prev = best->all_next = NULL;
    pl->mcache_bytes[t] -= best->size;
    __atomic_sub_fetch(&pl->n_mcache, 1, __ATOMIC_RELAXED);
    pl->n_mcache_hits++;
  }
  bool ordered = best && (best->mref.key == ref->key || sgm__context_bops(ctx)->synchronous);
  if (ordered) managed_list_locked(pl, best, t, want, stream); /* one lock for the whole reuse */
  sgm__lock_drop(&pl->lock);
  if (!best || ordered) return best;
  /* Freed on another stream: its work there may still use the range. */
  void *ev = NULL;
  int rc = sgm__context_bops(ctx)->event_create(sgm__context_be(ctx), &ev);
  if (rc == SGM_OK) rc = sgm__context_bops(ctx)->stream_transfer(sgm__context_be(ctx), ev, &best->mref, ref);
  sgm__context_bops(ctx)->event_destroy(sgm__context_be(ctx), ev);
  sgm__lock_take(&pl->lock);
  if (rc == SGM_OK) {
    managed_list_locked(pl, best, t, want, stream);
    sgm__lock_drop(&pl->lock);
    return best;
  }
  sgm__error_clear();
  pl->n_mcache_hits--; /* back, newest first: it stays with its stream */
  best->all_next = pl->mcache[t];
  if (best->all_next) best->all_next->all_prev = best;
  pl->mcache[t] = best;
  pl->mcache_bytes[t] += best->size;
  __atomic_add_fetch(&pl->n_mcache, 1, __ATOMIC_RELAXED);
  sgm__lock_drop(&pl->lock);
  return NULL;
}

int sgm__managed_alloc(sgm_context *ctx, size_t size, void *stream, uint64_t *out, sgm_tier *where) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  *out = 0;
  *where = SGM_TIER_NONE;
  if (size > UINT64_MAX - SGM_MANAGED_PAGE)
    return sgm__error_set(SGM_ERR_NOMEM, "sgm_alloc: %zu bytes is more than any device holds", size);
  uint64_t want = sgm__align_up(size, SGM_MANAGED_PAGE);
  sgm_stream_ref ref;
  sgm__context_bops(ctx)->stream_ref(sgm__context_be(ctx), stream, &ref);
  sgm_tier t = SGM_TIER_VRAM;
  sgm_buffer *b = managed_cache_take(ctx, SGM_TIER_VRAM, want, &ref, stream); /* placed, charged */
  if (b) goto out_done;
  b = calloc(1, pl->state_offset + pl->state_bytes);
  if (!b) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for a managed block");
  b->ctx = ctx;
  b->size = want;
  int rc = managed_charge_where(ctx, b, &t);
  if (rc != SGM_OK) goto out_free;
  if (t == SGM_TIER_SHARED) {
    sgm_buffer *c = managed_cache_take(ctx, SGM_TIER_SHARED, want, &ref, stream);
    if (c) {
      sgm__tier_uncharge(sgm__context_tier(ctx, t), b->size); /* c holds its own charge */
      free(b);
      b = c;
      goto out_done;
    }
  }
  rc = sgm__context_bops(ctx)->managed_alloc(sgm__context_be(ctx), b->size, &b->dptr);
  if (rc != SGM_OK) goto out_charge;
  rc = sgm__migrate_managed_place(ctx, b->dptr, b->size, t, stream);
  if (rc != SGM_OK) goto out_range;
  b->tier = t;
  sgm__lock_take(&pl->lock);
  managed_list_locked(pl, b, t, want, stream);
  sgm__lock_drop(&pl->lock);
out_done:
  *out = b->dptr;
  *where = t; /* b may move once listed: not b->tier */
  return SGM_OK;

out_range:
  sgm__context_bops(ctx)->managed_free(sgm__context_be(ctx), b->dptr, b->size);
out_charge:
  sgm__tier_uncharge(sgm__context_tier(ctx, t), b->size);
out_free:
  free(b);
  return rc;
}

int sgm__managed_free(sgm_context *ctx, uint64_t d, void *stream) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  if (__atomic_load_n(&pl->n_managed, __ATOMIC_RELAXED) == 0) return SGM_ERR_INVALID;
  sgm_stream_ref ref;
  sgm__context_bops(ctx)->stream_ref(sgm__context_be(ctx), stream, &ref);
  sgm__lock_take(&pl->lock);
  sgm_buffer *b = managed_find_locked(pl, d);
  if (!b) {
    sgm__lock_drop(&pl->lock);
    return SGM_ERR_INVALID;
  }
  sgm__buffer_take_locked(pl, b, SGM_TAKE_FREE); /* waits for a move in flight */
  sgm_buffer **pp = &pl->mhash[managed_bucket(d)];
  while (*pp != b) pp = &(*pp)->mnext;
  *pp = b->mnext;
  b->mnext = NULL;
  if (b->all_prev) b->all_prev->all_next = b->all_next;
  else pl->all = b->all_next;
  if (b->all_next) b->all_next->all_prev = b->all_prev;
  b->all_prev = b->all_next = NULL;
  pl->n_managed_in[b->tier]--;
  pl->mslack_bytes -= b->size - b->mwant;
  __atomic_sub_fetch(&pl->n_managed, 1, __ATOMIC_RELAXED);
  sgm_tier was = b->tier;
  bool waiting = pl->n_managed_in[SGM_TIER_SHARED] != 0; /* blocks that may want the room */
  bool cache = !b->mrecorded && !b->event;
  if (cache) { /* stays BUSY, charged where it is placed */
    b->mref = ref;
    b->mcached_ms = 0; /* the next idle tick stamps it */
    b->all_next = pl->mcache[was];
    if (b->all_next) b->all_next->all_prev = b;
    pl->mcache[was] = b;
    pl->mcache_bytes[was] += b->size;
    __atomic_add_fetch(&pl->n_mcache, 1, __ATOMIC_RELAXED);
  }
  sgm__lock_drop(&pl->lock);
  if (!cache) {
    sgm__buffer_free_storage(ctx, b);
    free(b);
  }
  /* Room (the cache gives its ranges to promotions: sgm__managed_promote). */
  if (was == SGM_TIER_VRAM && waiting) sgm__managed_promote(ctx, MANAGED_PROMOTE_INLINE_BYTES);
  return SGM_OK;
}

bool sgm__managed_record_stream(sgm_context *ctx, uint64_t d) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  if (__atomic_load_n(&pl->n_managed, __ATOMIC_RELAXED) == 0) return false;
  sgm__lock_take(&pl->lock);
  sgm_buffer *b = managed_find_locked(pl, d);
  if (b) b->mrecorded = true;
  sgm__lock_drop(&pl->lock);
  return b != NULL;
}

/* Give cached ranges back to the driver, oldest first: of tier t (or both,
 * t = SGM_TIER_COUNT) until at least want bytes went, only those an idle
 * tick stamped before `before_ms` (UINT64_MAX: any). Bytes given back. No
 * lock held. */
static uint64_t managed_cache_release(sgm_context *ctx, int t, uint64_t want, uint64_t before_ms) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  if (__atomic_load_n(&pl->n_mcache, __ATOMIC_RELAXED) == 0) return 0;
  sgm_buffer *out = NULL;
  uint64_t bytes = 0;
  sgm__lock_take(&pl->lock);
  for (int k = 0; k < SGM_N_RESIDENT && bytes < want; k++) {
    if (t != SGM_TIER_COUNT && k != t) continue;
    sgm_buffer *c = pl->mcache[k];
    while (c && c->all_next) c = c->all_next; /* the oldest */
    while (c && bytes < want) {
      sgm_buffer *prev = c->all_prev;
      if (before_ms == UINT64_MAX || (c->mcached_ms && c->mcached_ms < before_ms)) {
        if (prev) prev->all_next = c->all_next;
        else pl->mcache[k] = c->all_next;
        if (c->all_next) c->all_next->all_prev = prev;
        pl->mcache_bytes[k] -= c->size;
        __atomic_sub_fetch(&pl->n_mcache, 1, __ATOMIC_RELAXED);
        pl->n_mcache_released++;
        bytes += c->size;
        c->all_next = out;
        out = c;
      }
      c = prev;
    }
  }
  sgm__lock_drop(&pl->lock);
  while (out) {
    sgm_buffer *c = out;
    out = c->all_next;
    sgm__buffer_free_storage(ctx, c); /* the driver's free waits for the range's work */
    free(c);
  }
  return bytes;
}

uint64_t sgm__managed_cache_drop(sgm_context *ctx, sgm_tier t, uint64_t want) {
  return managed_cache_release(ctx, t, want, UINT64_MAX);
}

uint64_t sgm__managed_cache_idle(sgm_context *ctx, uint64_t now_ms, uint64_t idle_ms) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  if (__atomic_load_n(&pl->n_mcache, __ATOMIC_RELAXED) == 0) return 0;
  /* A free reads no clock: the first tick that sees a range stamps it (the
   * context clock's 0 is "not stamped": a stamp is at least 1). */
  sgm__lock_take(&pl->lock);
  for (int k = 0; k < SGM_N_RESIDENT; k++)
    for (sgm_buffer *c = pl->mcache[k]; c; c = c->all_next)
      if (!c->mcached_ms) c->mcached_ms = now_ms ? now_ms : 1;
  sgm__lock_drop(&pl->lock);
  uint64_t before = now_ms >= idle_ms ? now_ms - idle_ms + 1 : 0;
  return managed_cache_release(ctx, SGM_TIER_COUNT, UINT64_MAX, before);
}

uint64_t sgm__managed_cache_fit(sgm_context *ctx, sgm_tier t) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  if (!pl || __atomic_load_n(&pl->n_mcache, __ATOMIC_RELAXED) == 0) return 0;
  sgm_tier_stats ts;
  sgm__tier_stats(sgm__context_tier(ctx, t), &ts);
  if (ts.committed_bytes <= ts.budget_bytes) return 0;
  return managed_cache_release(ctx, t, ts.committed_bytes - ts.budget_bytes, UINT64_MAX);
}

sgm_tier sgm__managed_tier(sgm_context *ctx, uint64_t d) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  if (__atomic_load_n(&pl->n_managed, __ATOMIC_RELAXED) == 0) return SGM_TIER_NONE;
  sgm__lock_take(&pl->lock);
  sgm_buffer *b = managed_find_locked(pl, d);
  sgm_tier t = b ? __atomic_load_n(&b->tier, __ATOMIC_RELAXED) : SGM_TIER_NONE;
  sgm__lock_drop(&pl->lock);
  return t;
}

/* Should shared-placed b come back before best (pl->lock and the VRAM residency lock held)? The higher
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

/* The shared-placed block to promote first (pl->lock held), as
 * managed_promote_before_locked orders them. NULL when none is idle. The VRAM
 * policy instance is asked under its residency lock (it ranks after
 * pl->lock). */
static sgm_buffer *managed_best_shared_locked(struct sgm_placement *pl) {
  sgm_buffer *best = NULL;
  if (pl->n_managed_in[SGM_TIER_SHARED] == 0) return NULL;
  sgm_lock *vram = sgm__residency_lock(pl, SGM_TIER_VRAM);
  sgm__lock_take(vram);
  for (sgm_buffer *b = pl->all; b; b = b->all_next) {
    if (!b->managed || b->tier != SGM_TIER_SHARED || b->cold ||
        sgm__buffer_state(b) != SGM_BUF_RELEASED)
      continue;
    if (!best || managed_promote_before_locked(pl, b, best)) best = b;
  }
  sgm__lock_drop(vram);
  return best;
}

uint64_t sgm__managed_promote(sgm_context *ctx, uint64_t max_bytes) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  uint64_t moved = 0;
  while (moved < max_bytes) {
    if (__atomic_load_n(&pl->n_managed, __ATOMIC_RELAXED) == 0) break;
    sgm__lock_take(&pl->lock);
    sgm_buffer *b = managed_best_shared_locked(pl);
    if (b) sgm__buffer_take_locked(pl, b, SGM_TAKE_MOVE);
    sgm__lock_drop(&pl->lock);
    if (!b) break;
    /* Only room that is free now: a promotion never demotes. */
    int rc = sgm__tier_charge(sgm__context_tier(ctx, SGM_TIER_VRAM), b->size);
    /* Cached ranges are free memory: a block waiting in shared memory comes first. */
    if (rc == SGM__ERR_BUDGET && sgm__managed_cache_drop(ctx, SGM_TIER_VRAM, b->size))
      rc = sgm__tier_charge(sgm__context_tier(ctx, SGM_TIER_VRAM), b->size);
    if (rc == SGM_OK) {
      rc = sgm__migrate_managed(ctx, b, SGM_TIER_VRAM, false);
      if (rc != SGM_OK) {
        sgm__tier_uncharge(sgm__context_tier(ctx, SGM_TIER_VRAM), b->size);
        sgm__log(sgm__context_cfg(ctx)->verbose, 2, "promoting a managed block failed: %s", sgm_last_error());
      }
    }
    sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false);
    if (rc != SGM_OK) break;
    moved += b->size;
  }
  return moved;
}

void sgm__managed_stats(sgm_context *ctx, sgm_stats *st) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  sgm__lock_take(&pl->lock);
  for (int t = 0; t < SGM_N_RESIDENT; t++) st->tier[t].n_live += pl->n_managed_in[t];
  st->n_managed_promotions = pl->n_managed_moves[0];
  st->n_managed_demotions = pl->n_managed_moves[1];
  st->managed_promoted_bytes = pl->managed_moved_bytes[0];
  st->managed_demoted_bytes = pl->managed_moved_bytes[1];
  st->n_managed_live = pl->n_managed;
  st->n_managed_cache_hits = pl->n_mcache_hits;
  st->managed_slack_bytes = pl->mslack_bytes;
  uint64_t cached[SGM_N_RESIDENT];
  for (int t = 0; t < SGM_N_RESIDENT; t++) {
    cached[t] = pl->mcache_bytes[t];
    st->managed_cached_bytes += cached[t];
    st->tier[t].cached_bytes += cached[t];
  }
  sgm__lock_drop(&pl->lock);
  for (int t = 0; t < SGM_N_RESIDENT; t++) {
    if (!sgm__context_tier(ctx, t)) continue;
    /* Charged while cached too, but not used (a race with a free only shifts
     * bytes between the two for this one reading). */
    uint64_t charged = sgm__tier_charged(sgm__context_tier(ctx, t));
    st->tier[t].used_bytes += charged > cached[t] ? charged - cached[t] : 0;
    if (st->tier[t].used_bytes > st->tier[t].peak_used_bytes)
      st->tier[t].peak_used_bytes = st->tier[t].used_bytes;
  }
}

/* ---- the public calls ---- */

/* Take the managed block holding [p, p + n) for a move (SGM_OK, b BUSY and
 * owned by the caller) or say why not. */
static int managed_take(sgm_context *ctx, void *ptr, size_t n, const char *fn, sgm_buffer **out) {
  *out = NULL;
  if (!ctx) return sgm__error_set(SGM_ERR_INVALID, "%s: context is NULL", fn);
  if (sgm__context_forked(ctx)) return sgm__context_fork_error(ctx, fn);
  if (!sgm__context_managed(ctx))
    return sgm__error_set(SGM_ERR_INVALID, "%s: the context's pointers are fixed (set "
                          "SGM_POINTERS=managed to get pointers sgm can move)", fn);
  struct sgm_placement *pl = sgm__context_pl(ctx);
  sgm__lock_take(&pl->lock);
  sgm_buffer *b = managed_find_range_locked(pl, (uint64_t)(uintptr_t)ptr, n);
  if (!b) {
    sgm__lock_drop(&pl->lock);
    return sgm__error_set(SGM_ERR_INVALID, "%s: [%p, +%zu) is not inside one live managed block "
                          "(blocks under %zu bytes, and fixed pointers, never move)", fn, ptr, n,
                          SGM_MANAGED_MOVABLE_BYTES);
  }
  sgm__buffer_take_locked(pl, b, SGM_TAKE_MOVE);
  sgm__lock_drop(&pl->lock);
  *out = b;
  return SGM_OK;
}

/* b (taken) is wanted in VRAM (a use: the most recent) or, cold, out of it
 * until its user says otherwise; a plain prefetch to shared memory changes
 * neither. */
static void managed_mark(struct sgm_placement *pl, sgm_buffer *b, sgm_tier to, bool cold) {
  sgm__lock_take(&pl->lock);
  if (to == SGM_TIER_VRAM) {
    b->cold = false;
    b->touch = ++pl->managed_clock;
  } else if (cold) {
    b->cold = true;
    b->touch = 0;
  }
  sgm__lock_drop(&pl->lock);
}

/* Move b (taken) to tier `to`: to VRAM demoting colder blocks as the policy
 * allows, to shared memory as a demotion. */
static int managed_move(sgm_context *ctx, sgm_buffer *b, sgm_tier to) {
  if (b->tier == to) return SGM_OK;
  if (to == SGM_TIER_SHARED) return sgm__migrate_demote(ctx, b, SGM_TIER_SHARED, false);
  int rc = sgm__residency_charge_for(ctx, SGM_TIER_VRAM, b->size, b);
  if (rc == SGM__ERR_BUDGET) rc = sgm__tier_explain_budget(sgm__context_tier(ctx, SGM_TIER_VRAM), b->size);
  if (rc != SGM_OK) return rc;
  rc = sgm__migrate_managed(ctx, b, SGM_TIER_VRAM, false);
  if (rc != SGM_OK) sgm__tier_uncharge(sgm__context_tier(ctx, SGM_TIER_VRAM), b->size);
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
  sgm__lock_take(&sgm__context_pl(ctx)->lock);
  b->priority = priority;
  sgm__lock_drop(&sgm__context_pl(ctx)->lock);
  if (hint != SGM_HINT_NONE) {
    sgm_tier to = hint == SGM_HINT_HOT ? SGM_TIER_VRAM : SGM_TIER_SHARED;
    managed_mark(sgm__context_pl(ctx), b, to, hint == SGM_HINT_COLD);
    rc = managed_move(ctx, b, to);
  }
  /* A hot block that could not come up stays where it is: still a use. */
  if (hint == SGM_HINT_HOT && rc == SGM_ERR_NOMEM) {
    sgm__error_clear();
    rc = SGM_OK;
  }
  sgm__buffer_finish(sgm__context_pl(ctx), b, SGM_BUF_RELEASED, hint == SGM_HINT_HOT);
  /* Room a cold block left goes to the most valuable others. */
  if (rc == SGM_OK && hint == SGM_HINT_COLD) sgm__managed_promote(ctx, MANAGED_PROMOTE_INLINE_BYTES);
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
  managed_mark(sgm__context_pl(ctx), b, tier, false);
  rc = managed_move(ctx, b, tier);
  sgm__buffer_finish(sgm__context_pl(ctx), b, SGM_BUF_RELEASED, tier == SGM_TIER_VRAM);
  return (sgm_status)rc;
}
