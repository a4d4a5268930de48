/*
 * bag.c — stream bags and fences: the stream-ordered cache below the
 * magazines, and the reclaim that returns it to the sub-allocator.
 *
 * Job: keep each stream's cached blocks by class (open bag, sealed bag with
 * its fence event), pool the events, and in a reclaim pass drain the
 * magazines, seal and fence every stream's bags, and return what the device
 * is seen done with (QUERY) or everything (WAIT); TRANSFER hands over to
 * xfer.c.
 *
 * Locks: the pool lock for the bags, the stream list and the event pool; a
 * stream's or deferred free's busy flag owns its event while the lock is
 * dropped for a driver call (event record, query, wait), which is never made
 * under the lock. Magazine spin locks are taken under the pool lock.
 *
 * Calls: the backend's event and stream operations, mag.c (drain), chunk.c
 * (release blocks), xfer.c (transfers), vmm.c (settle after a reclaim),
 * owe.c (a fence seen complete ends what its stream owes up to it).
 */
#include "tiers/pool/pool.h"

/* ---- bags ---- */

void sgm__pool_bag_push(tier_bag *g, tier_block *b) {
  tier_block **head = b->cls >= 0 ? &g->cls[b->cls] : &g->large;
  b->next = *head;
  *head = b;
  g->bytes += b->bytes;
  g->n++;
}

/* A block of class cls (or, for cls < 0, of at least need bytes and at most
 * 1/8 more) from the bag; NULL when none. */
tier_block *sgm__pool_bag_take(tier_bag *g, int cls, uint64_t need) {
  if (g->n == 0) return NULL;
  tier_block *b = NULL;
  if (cls >= 0 && g->cls[cls]) {
    b = g->cls[cls];
    g->cls[cls] = b->next;
  } else {
    uint64_t lo = cls >= 0 ? tier_class_bytes(cls) : need;
    uint64_t hi = lo + (lo >> TIER_LARGE_SLACK_SHIFT);
    tier_block **best = NULL;
    for (tier_block **pp = &g->large; *pp; pp = &(*pp)->next) {
      uint64_t sz = (*pp)->bytes;
      if (sz >= lo && sz <= hi && (!best || sz < (*best)->bytes)) best = pp;
    }
    if (!best) return NULL;
    b = *best;
    *best = b->next;
  }
  g->bytes -= b->bytes;
  g->n--;
  b->next = NULL;
  return b;
}

/* Empty the bag, handing each block to `to`: into dst (a merge), or back to
 * the sub-allocator (p, pool lock held). */
static void tier_bag_drain(tier_bag *g, tier_bag *dst, sgm_tier_pool *p) {
  for (int c = -1; c < TIER_N_CLASSES; c++) {
    tier_block **sh = c < 0 ? &g->large : &g->cls[c];
    while (*sh) {
      tier_block *b = *sh;
      *sh = b->next;
      if (dst) sgm__pool_bag_push(dst, b);
      else sgm__pool_release_block_locked(p, b);
    }
  }
  g->bytes = 0;
  g->n = 0;
}

/* Move every block of src into dst. */
void sgm__pool_bag_merge(tier_bag *dst, tier_bag *src) { tier_bag_drain(src, dst, NULL); }

/* Every block of g back to the sub-allocator (pool lock held). */
void sgm__pool_bag_release_locked(sgm_tier_pool *p, tier_bag *g) { tier_bag_drain(g, NULL, p); }

tier_stream *sgm__pool_stream_find_locked(sgm_tier_pool *p, uint64_t key) {
  for (tier_stream *s = p->streams; s; s = s->next)
    if (s->ref.key == key) return s;
  return NULL;
}

/* The stream's record, made when missing; NULL when out of memory. */
tier_stream *sgm__pool_stream_get_locked(sgm_tier_pool *p, const sgm_stream_ref *ref) {
  tier_stream *s = sgm__pool_stream_find_locked(p, ref->key);
  if (s) return s;
  s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->ref = *ref;
  s->next = p->streams;
  p->streams = s;
  return s;
}

/* Recent sizes (issue 10): s took a block of class cls (a large one of need
 * bytes for cls < 0) from its own caches (pool lock held). Not counted on
 * the magazine's path, which makes no shared write: a class served there
 * is one s holds itself. A transfer to s takes the owner's blocks of the
 * sizes s took in this period and the last (sgm__pool_want_recent_locked), so a
 * burst of sizes crosses at once; the periods age sizes s no longer uses. */
void sgm__pool_stream_note_locked(tier_stream *s, int cls, uint64_t need) {
  if (cls >= 0) {
    s->recent_cls[0] |= UINT64_C(1) << cls;
    return;
  }
  tier_recent_large *slot = &s->recent_large[0];
  for (int i = 0; i < TIER_RECENT_LARGE; i++) {
    tier_recent_large *r = &s->recent_large[i];
    if (r->need == need) {
      slot = r;
      break;
    }
    if (r->need == 0 || r->period < slot->period) slot = r; /* empty, else the oldest */
  }
  slot->need = need;
  slot->period = s->period;
}

void sgm__pool_bagged_add_locked(sgm_tier_pool *p, int64_t n, int64_t bytes) {
  /* Atomic: read without the lock as a hint before large carves. */
  __atomic_store_n(&p->bag_bytes, p->bag_bytes + (uint64_t)bytes, __ATOMIC_RELAXED);
  __atomic_store_n(&p->n_bagged, p->n_bagged + (size_t)n, __ATOMIC_RELAXED);
}

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
static size_t tier_release_bags_locked(sgm_tier_pool *p) {
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

/* ---- pooled events ---- */

void *sgm__pool_event_get(sgm_tier_pool *p) {
  void *ev = NULL;
  sgm__lock_take(&p->lock);
  if (p->n_events) ev = p->events[--p->n_events];
  sgm__lock_drop(&p->lock);
  if (!ev && p->p.bops->event_create(p->p.be, &ev) != SGM_OK) return NULL;
  return ev;
}

void sgm__pool_event_put_locked(sgm_tier_pool *p, void *ev) {
  if (!ev) return;
  if (p->n_events == p->cap_events) {
    size_t cap = p->cap_events ? p->cap_events * 2 : 8;
    void **n = realloc(p->events, cap * sizeof *n);
    if (!n) {
      /* Cannot pool it: it is not in use by anyone, destroying it is safe. */
      sgm__lock_drop(&p->lock);
      p->p.bops->event_destroy(p->p.be, ev);
      sgm__lock_take(&p->lock);
      return;
    }
    p->events = n;
    p->cap_events = cap;
  }
  p->events[p->n_events++] = ev;
}

void sgm__pool_event_put(sgm_tier_pool *p, void *ev) {
  sgm__lock_take(&p->lock);
  sgm__pool_event_put_locked(p, ev);
  sgm__lock_drop(&p->lock);
}

/* ---- reclaim ---- */


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

/* The job array of a reclaim pass, counted under p->lock: zeroed room for
 * n_jobs, or NULL with the lock dropped (nothing to do, or out of memory:
 * the pass is skipped, and the caches stay for the next one). */
tier_job *sgm__pool_jobs_alloc_locked(sgm_tier_pool *p, size_t n_jobs) {
  tier_job *jobs = n_jobs ? calloc(n_jobs, sizeof *jobs) : NULL;
  if (!jobs) sgm__lock_drop(&p->lock);
  return jobs;
}

/* Seal and fence every stream's cache, and return to the sub-allocator what
 * the device has finished with (QUERY) or everything (WAIT). */
static size_t tier_reclaim_fences(sgm_tier_pool *p, sgm_reclaim_mode mode) {
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


size_t sgm__tier_reclaim(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode) {
  return sgm__pool_reclaim_settle(p, taker, mode, NULL);
}

static size_t tier_reclaim_want(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode,
                                const tier_want *w);

/* sgm__tier_reclaim whose transfer takes only the blocks w serves (NULL: all). */
size_t sgm__pool_reclaim_settle(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode,
                                const tier_want *w) {
  size_t n = tier_reclaim_want(p, taker, mode, w);
  sgm__pool_vmm_settle(p);
  return n;
}

/* sgm__tier_reclaim without unmapping the granules it frees (the carve that
 * calls it is about to place a block there). */
size_t sgm__pool_reclaim_ex(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode) {
  return tier_reclaim_want(p, taker, mode, NULL);
}

/* sgm__pool_reclaim_ex whose transfer takes only the blocks w serves (NULL: all). */
static size_t tier_reclaim_want(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode,
                                const tier_want *w) {
  if (mode == SGM_RECLAIM_TRANSFER) {
    /* A synchronous backend gave every cached block back in the drain. */
    size_t n = sgm__pool_reclaim_some(p, true, mode);
    return p->p.bops->synchronous || !taker ? n : sgm__pool_reclaim_transfer(p, taker, w);
  }
  return sgm__pool_reclaim_some(p, true, mode);
}

/* With mags, drain every thread's magazine into its stream's bag; then give
 * back what the device is done with (mode QUERY or WAIT; TRANSFER stops
 * after the drain, where a synchronous backend has given everything back). */
size_t sgm__pool_reclaim_some(sgm_tier_pool *p, bool mags, sgm_reclaim_mode mode) {
  size_t n_done = 0;
  sgm__lock_take(&p->lock);
  for (tier_mag *m = mags ? p->mags : NULL; m; m = m->next) {
    tier_spin_lock(&m->lock);
    sgm__pool_mag_drain_locked(p, m);
    tier_spin_unlock(&m->lock);
  }
  if (p->p.bops->synchronous) {
    n_done = tier_release_bags_locked(p);
    sgm__lock_drop(&p->lock);
    return n_done;
  }
  sgm__lock_drop(&p->lock);
  if (mode == SGM_RECLAIM_TRANSFER) return 0;
  n_done += tier_reclaim_fences(p, mode);
  if (mode == SGM_RECLAIM_WAIT) {
    /* The first round sealed what was open; the second waits for the fences
     * of streams that already had one. */
    n_done += tier_reclaim_fences(p, mode);
    n_done += tier_reclaim_fences(p, mode);
  }
  return n_done;
}
