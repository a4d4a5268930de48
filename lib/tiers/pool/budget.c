/*
 * budget.c — trims, the idle trim, budget changes and charges: what gives
 * committed memory back, or takes budget for blocks placed outside the pool.
 *
 * Job: sgm_trim (every cached block back, then free granules or chunks to
 * the driver), the idle trim (measured from the pool's last allocation),
 * raising and lowering the budget (with the reason a shared device gives),
 * and charging and uncharging managed blocks against the budget.
 *
 * Locks: the pool lock for the byte counts and the budget; reclaims,
 * unmapping and chunk releases take and drop it themselves.
 *
 * Calls: reclaim.c, mag.c (is anything cached), chunk.c (free chunks),
 * vmm.c (free granules), owe.c (host waits before memory goes back).
 */
#include "tiers/pool/pool.h"

uint64_t sgm__tier_trim(sgm_tier_pool *p) {
  if (sgm__tier_has_cached(p)) sgm__pool_reclaim_ex(p, NULL, SGM_RECLAIM_WAIT);
  /* Reserve mode's pool keeps its granules: a trim returns nothing. */
  if (p->vmm_pool) return 0;
  if (p->vmm_range) return sgm__pool_vmm_unmap_free(p);
  sgm_chunk *list;
  sgm__lock_take(&p->lock);
  size_t n = sgm__pool_detach_free_locked(p, 0, UINT64_MAX, &list);
  sgm__lock_drop(&p->lock);
  return n ? sgm__pool_release_chunks(p, list, n) : 0;
}

uint64_t sgm__tier_idle_trim(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms) {
  if (idle_ms == 0 || idle_ms == UINT64_MAX || p->vmm_pool) return 0;
  if (p->vmm_range) {
    /* Expandable growth (issue 26): idle is measured from the pool's last
     * allocation, not per granule. A call that sees new allocations since
     * the last one starts the idle time over; free granules go only when a
     * whole idle_ms has passed without any. A busy program keeps its free
     * granules mapped (the bound at each mapping holds committed). */
    sgm__lock_take(&p->lock);
    uint64_t allocs = __atomic_load_n(&p->n_allocs, __ATOMIC_RELAXED);
    for (tier_mag *m = p->mags; m; m = m->next) allocs += __atomic_load_n(&m->n_allocs, __ATOMIC_RELAXED);
    bool busy = allocs != p->idle_allocs || p->idle_since_ms == UINT64_MAX || now_ms < p->idle_since_ms;
    if (busy) {
      p->idle_allocs = allocs;
      p->idle_since_ms = now_ms;
    }
    bool idle = !busy && now_ms - p->idle_since_ms >= idle_ms;
    sgm__lock_drop(&p->lock);
    return idle ? sgm__pool_vmm_unmap_free(p) : 0;
  }
  sgm_chunk *list;
  sgm__lock_take(&p->lock);
  size_t n = sgm__pool_detach_free_locked(p, now_ms, idle_ms, &list);
  sgm__lock_drop(&p->lock);
  return n ? sgm__pool_release_chunks(p, list, n) : 0;
}

void sgm__tier_set_budget(sgm_tier_pool *p, uint64_t budget_bytes) {
  sgm__tier_set_budget_why(p, budget_bytes, NULL);
}

void sgm__tier_set_budget_why(sgm_tier_pool *p, uint64_t budget_bytes, const char *why) {
  sgm__lock_take(&p->lock);
  snprintf(p->budget_why, sizeof p->budget_why, "%s", why ? why : "");
  p->p.budget_bytes = budget_bytes;
  tier_update_room_locked(p);
  bool over = p->committed_bytes > budget_bytes;
  if (over) p->budget_lowered = true;
  sgm__lock_drop(&p->lock);
  /* Reserve mode's pool: mapping stops at the new budget and free granules
   * are unmapped; the pool itself stays taken until destroy (not built: its
   * granules past the budget going back to the driver). */
  if (over && p->vmm_pool) sgm__pool_vmm_unmap_free(p);
  else if (over) sgm__tier_trim(p);
}

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
    if (p->vmm_range) sgm__pool_vmm_unmap_free(p); /* free granules hold it too */
    sgm_chunk *list;
    sgm__lock_take(&p->lock);
    size_t n = sgm__pool_detach_free_locked(p, 0, UINT64_MAX, &list);
    sgm__lock_drop(&p->lock);
    if (n) sgm__pool_release_chunks(p, list, n);
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
