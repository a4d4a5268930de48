/*
 * bag.c — stream bags and fences: the stream-ordered cache below the
 * magazines, and the fence pass that returns it to the sub-allocator.
 *
 * Job: cache a freed block in its stream's open bag, give bags back to the
 * sub-allocator, and in a fence pass (sgm__pool_reclaim_fences, run by
 * reclaim.c) seal and fence every stream's bags and return what the device
 * is seen done with (QUERY) or everything (WAIT), with the deferred frees of
 * sgm_record_stream.
 *
 * Locks: the pool lock for the bags, the stream list and the event pool; a
 * stream's or deferred free's busy flag owns its event while the lock is
 * dropped for a driver call (event record, query, wait), which is never made
 * under the lock. Magazines are stopped under the pool lock (pool.h).
 *
 * Calls: the backend's event and stream operations, stream.c (streams, bag
 * lists, pooled events), chunk.c (release blocks), owe.c (a fence seen
 * complete ends what its stream owes up to it).
 */
#include "tiers/pool/pool.h"

/* ---- bags ---- */

/* Empty the bag, handing each block to `to`: into dst (a merge), or back to
 * the sub-allocator (p, pool lock held). */
static void tier_bag_drain(tier_bag *g, tier_bag *dst, sgm_tier_pool *p) {
  /* The walk stops at the bag's last block: a bag of one or two blocks, the
   * common case, does not visit all TIER_N_CLASSES lists (on a synchronous
   * backend every pair drains its stream's bags: the full walk was ~100 of
   * the churn pair's ~1,200 instructions). */
  size_t left = g->n;
  for (int c = -1; left && c < TIER_N_CLASSES; c++) {
    tier_block **sh = c < 0 ? &g->large : &g->cls[c];
    while (*sh) {
      tier_block *b = *sh;
      *sh = b->next;
      left--;
      if (dst) sgm__pool_bag_push(dst, b);
      else sgm__pool_release_block_locked(p, b);
    }
  }
  sgm_assert_internal(left == 0 && !g->large);
  g->bytes = 0;
  g->n = 0;
}

/* Move every block of src into dst. */
void sgm__pool_bag_merge(tier_bag *dst, tier_bag *src) { tier_bag_drain(src, dst, NULL); }

/* Every block of g back to the sub-allocator (pool lock held). */
void sgm__pool_bag_release_locked(sgm_tier_pool *p, tier_bag *g) { tier_bag_drain(g, NULL, p); }

/* Cache b (CACHED, key and handle set) in its stream's open bag; a block whose
 * stream record cannot be made goes back to the sub-allocator only when no
 * work can use it (synchronous backend), else it stays cached on the deferred
 * path of the next reclaim (kept live in the map: leaked until destroy). */
void sgm__pool_bag_add_locked(sgm_tier_pool *p, tier_block *b) {
  sgm_stream_ref ref = {b->key, b->handle};
  tier_stream *s = sgm__pool_stream_get_locked(p, &ref);
  if (!s) {
    if (p->p.bops->synchronous) {
      sgm__pool_release_block_locked(p, b);
      tier_update_room_locked(p);
    } else {
      sgm__log(p->p.verbose, 1, "%s: out of host memory caching a freed block; it stays "
               "allocated until the context is destroyed", sgm_tier_name(p->p.tier));
    }
    return;
  }
  s->ref.handle = b->handle;
  sgm__pool_bag_push(&s->open, b);
  sgm__pool_bagged_add_locked(p, 1, (int64_t)b->bytes);
}

/* Synchronous backend: nothing is pending on the device, so every bagged
 * block goes back to the sub-allocator (pool lock held). Returns how many. */
size_t sgm__pool_bags_release_all_locked(sgm_tier_pool *p) {
  size_t n = 0;
  for (tier_stream *s = p->streams; s; s = s->next) {
    n += s->open.n + s->sealed.n;
    sgm__pool_bagged_add_locked(p, -(int64_t)(s->open.n + s->sealed.n),
                                -(int64_t)(s->open.bytes + s->sealed.bytes));
    sgm__pool_bag_release_locked(p, &s->open);
    sgm__pool_bag_release_locked(p, &s->sealed);
  }
  tier_update_room_locked(p);
  return n;
}

/* ---- the fence pass ---- */

/* Did the work before ev complete? Query, or in WAIT mode wait. A failed
 * wait is not done (issue 24): the driver did not say the work is over (the
 * stream captures a graph, the context failed), so the blocks stay with
 * their stream rather than return to the pool where a trim would unmap them
 * under that work. */
static int tier_event_done(sgm_tier_pool *p, void *ev, sgm_reclaim_mode mode) {
  if (mode == SGM_RECLAIM_WAIT) {
    int rc = p->p.bops->event_wait(p->p.be, ev);
    if (rc == SGM_OK) return 1;
    sgm__log(p->p.verbose, rc == SGM_ERR_BUSY ? 3 : 1, "%s: waiting for a stream's work failed "
             "(%s); its cached blocks stay with the stream", sgm_tier_name(p->p.tier),
             sgm_last_error());
    return rc;
  }
  int q = p->p.bops->event_query(p->p.be, ev);
  if (q < 0)
    sgm__log(p->p.verbose, 1, "%s: querying a stream's fence failed (%s); its cached blocks stay "
             "with the stream", sgm_tier_name(p->p.tier), sgm_last_error());
  return q;
}

/* Seal and fence every stream's cache, and return to the sub-allocator what
 * the device has finished with (QUERY) or everything (WAIT). */
size_t sgm__pool_reclaim_fences(sgm_tier_pool *p, sgm_reclaim_mode mode) {
  size_t n_done = 0;
  sgm__lock_take(&p->lock);
  size_t n_jobs = 0;
  for (tier_stream *s = p->streams; s; s = s->next) n_jobs += !s->busy && (s->fence || s->open.n);
  for (tier_deferred *d = p->deferred; d; d = d->next) n_jobs += !d->busy;
  tier_job *jobs = sgm__pool_jobs_alloc_locked(p, n_jobs);
  if (!jobs) return 0;
  size_t k = 0;
  for (tier_stream *s = p->streams; s; s = s->next) {
    if (s->busy || (!s->fence && !s->open.n)) continue;
    s->busy = true;
    jobs[k].s = s;
    jobs[k].ref = s->ref;
    if (s->fence) {
      jobs[k].kind = TIER_JOB_FENCE;
      jobs[k].ev = s->fence;
      jobs[k].seq = s->fence_seq;
    } else {
      /* Everything freed on s so far is covered by an event recorded now,
       * and everything s returned so far (owe.c). */
      jobs[k].kind = TIER_JOB_SEAL;
      jobs[k].seq = s->owe_seq;
      sgm__pool_bag_merge(&s->sealed, &s->open);
    }
    k++;
  }
  for (tier_deferred *d = p->deferred; d; d = d->next) {
    if (d->busy) continue;
    d->busy = true;
    jobs[k].kind = TIER_JOB_DEFERRED;
    jobs[k].d = d;
    k++;
  }
  sgm__lock_drop(&p->lock);

  for (size_t i = 0; i < n_jobs; i++) {
    tier_job *j = &jobs[i];
    if (j->kind == TIER_JOB_SEAL) {
      j->ev = sgm__pool_event_get(p);
      int rrc = j->ev ? p->p.bops->event_record_on(p->p.be, j->ev, &j->ref) : SGM_ERR_BACKEND;
      if (rrc != SGM_OK) {
        /* A capturing stream (BUSY) keeps its cache until the capture ends. */
        sgm__log(p->p.verbose, rrc == SGM_ERR_BUSY ? 3 : 1, "%s: cannot fence a stream's cache "
                 "(%s); it stays with the stream", sgm_tier_name(p->p.tier), sgm_last_error());
        j->refused = rrc == SGM_ERR_BUSY;
        j->done = -1;
        continue;
      }
      j->done = tier_event_done(p, j->ev, mode);
    } else if (j->kind == TIER_JOB_FENCE) {
      j->done = tier_event_done(p, j->ev, mode);
    } else {
      j->done = 1;
      for (size_t e = 0; e < j->d->n_events && j->done == 1; e++)
        j->done = tier_event_done(p, j->d->events[e], mode);
    }
  }

  sgm__lock_take(&p->lock);
  for (size_t i = 0; i < n_jobs; i++) {
    tier_job *j = &jobs[i];
    if (j->kind == TIER_JOB_DEFERRED) {
      tier_deferred *d = j->d;
      d->busy = false;
      if (j->done != 1) continue;
      for (tier_deferred **pp = &p->deferred; *pp; pp = &(*pp)->next)
        if (*pp == d) {
          *pp = d->next;
          break;
        }
      for (size_t e = 0; e < d->n_events; e++) sgm__pool_event_put_locked(p, d->events[e]);
      sgm__pool_bagged_add_locked(p, -1, -(int64_t)d->b->bytes);
      /* The recorded streams are done; the stream it was freed on may not be. */
      sgm__pool_bag_add_locked(p, d->b);
      free(d->events);
      free(d);
      n_done++;
      continue;
    }
    tier_stream *s = j->s;
    s->busy = false;
    if (j->kind == TIER_JOB_SEAL) {
      if (j->done < 0) {
        if (j->refused) sgm__pool_owed_recorded_locked(s, SGM_ERR_BUSY);
        sgm__pool_bag_merge(&s->open, &s->sealed);
        if (j->ev) sgm__pool_event_put_locked(p, j->ev);
        continue;
      }
      sgm__pool_owed_recorded_locked(s, SGM_OK);
      s->fence = j->ev;
      s->fence_seq = j->seq;
      s->crossed_fence = NULL;
    }
    if (j->done == 1) {
      sgm__pool_owed_seen_locked(p, s, j->seq); /* the returns it covers are owed no more */
      n_done += s->sealed.n;
      sgm__pool_bagged_add_locked(p, -(int64_t)s->sealed.n, -(int64_t)s->sealed.bytes);
      sgm__pool_bag_release_locked(p, &s->sealed);
      sgm__pool_event_put_locked(p, s->fence);
      s->fence = NULL;
    }
  }
  tier_update_room_locked(p);
  sgm__lock_drop(&p->lock);
  free(jobs);
  return n_done;
}

