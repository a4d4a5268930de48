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

int sgm__managed_alloc(sgm_context *ctx, size_t size, void *stream, uint64_t *out, sgm_tier *where) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  *out = 0;
  *where = SGM_TIER_NONE;
  if (size > UINT64_MAX - SGM_MANAGED_PAGE)
    return sgm__error_set(SGM_ERR_NOMEM, "sgm_alloc: %zu bytes is more than any device holds", size);
  sgm_buffer *b = calloc(1, pl->state_offset + pl->state_bytes);
  if (!b) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for a managed block");
  b->ctx = ctx;
  b->size = sgm__align_up(size, SGM_MANAGED_PAGE);
  b->magic = SGM_BUFFER_LIVE;
  b->priority = SGM_PRIORITY_NORMAL;
  b->item.size_bytes = b->size;
  b->item.priority = SGM_PRIORITY_NORMAL;
  b->item.state = pl->state_bytes ? (char *)b + pl->state_offset : NULL;
  b->item.id = __atomic_add_fetch(&pl->next_id, 1, __ATOMIC_RELAXED);
  b->managed = true;
  b->mstream = stream;
  sgm_tier t = SGM_TIER_NONE;
  int rc = sgm__context_bops(ctx)->managed_alloc(sgm__context_be(ctx), b->size, &b->dptr);
  if (rc != SGM_OK) goto out_free;
  rc = managed_charge_where(ctx, b, &t);
  if (rc != SGM_OK) goto out_range;
  rc = sgm__migrate_managed_place(ctx, b->dptr, b->size, t, stream);
  if (rc != SGM_OK) goto out_charge;
  b->tier = t;
  sgm__lock_take(&pl->lock);
  sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false); /* listed in tier t's policy, under its lock */
  b->all_next = pl->all;
  if (pl->all) pl->all->all_prev = b;
  pl->all = b;
  size_t k = managed_bucket(b->dptr);
  b->mnext = pl->mhash[k];
  pl->mhash[k] = b;
  b->touch = ++pl->managed_clock;
  pl->n_managed_in[t]++;
  __atomic_add_fetch(&pl->n_managed, 1, __ATOMIC_RELAXED);
  sgm__lock_drop(&pl->lock);
  *out = b->dptr;
  *where = t;
  return SGM_OK;

out_charge:
  sgm__tier_uncharge(sgm__context_tier(ctx, t), b->size);
out_range:
  sgm__context_bops(ctx)->managed_free(sgm__context_be(ctx), b->dptr, b->size);
out_free:
  free(b);
  return rc;
}

int sgm__managed_free(sgm_context *ctx, uint64_t d) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  if (__atomic_load_n(&pl->n_managed, __ATOMIC_RELAXED) == 0) return SGM_ERR_INVALID;
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
  if (b->all_prev) b->all_prev->all_next = b->all_next;
  else pl->all = b->all_next;
  if (b->all_next) b->all_next->all_prev = b->all_prev;
  pl->n_managed_in[b->tier]--;
  __atomic_sub_fetch(&pl->n_managed, 1, __ATOMIC_RELAXED);
  sgm_tier was = b->tier;
  sgm__lock_drop(&pl->lock);
  sgm__buffer_free_storage(ctx, b);
  free(b);
  if (was == SGM_TIER_VRAM) sgm__managed_promote(ctx, MANAGED_PROMOTE_INLINE_BYTES);
  return SGM_OK;
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

/* The shared-placed block to promote first (pl->lock held): the highest
 * priority, then the most recently touched. NULL when none is idle. */
static sgm_buffer *managed_best_shared_locked(struct sgm_placement *pl) {
  sgm_buffer *best = NULL;
  if (pl->n_managed_in[SGM_TIER_SHARED] == 0) return NULL;
  for (sgm_buffer *b = pl->all; b; b = b->all_next) {
    if (!b->managed || b->tier != SGM_TIER_SHARED || b->cold ||
        sgm__buffer_state(b) != SGM_BUF_RELEASED)
      continue;
    if (!best || b->priority > best->priority ||
        (b->priority == best->priority && b->touch > best->touch))
      best = b;
  }
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
  sgm__lock_drop(&pl->lock);
  for (int t = 0; t < SGM_N_RESIDENT; t++) {
    if (!sgm__context_tier(ctx, t)) continue;
    st->tier[t].used_bytes += sgm__tier_charged(sgm__context_tier(ctx, t));
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
