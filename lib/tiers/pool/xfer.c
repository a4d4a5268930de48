/*
 * xfer.c — transfers: another stream's cached blocks handed to the taker
 * through a device-side wait, without returning them to the sub-allocator.
 *
 * Job: choose which of the owners' blocks the taker gets (what it asked for,
 * plus the classes and large sizes it took recently), record an event on
 * each owner (or reuse its fence), make the taker wait on it, and move the
 * blocks into the taker's open bag; refused while either stream captures.
 *
 * Locks: the pool lock to choose and move; dropped for the event record and
 * the stream wait (the owner stream's busy flag holds its fence meanwhile).
 *
 * Calls: the backend's event and stream-wait operations, stream.c (streams,
 * bag lists, events, jobs), bag.c (merge); a fence it leaves covers its
 * owner's returns so far (owe.c).
 */
#include "tiers/pool/pool.h"

/* Does g hold a block w takes (any block when w is NULL)? */
static bool tier_bag_fits(const tier_bag *g, const tier_want *w) {
  if (!w || g->n == 0) return g->n != 0;
  if (w->cls >= 0 && g->cls[w->cls]) return true;
  uint64_t lo = w->cls >= 0 ? tier_class_bytes(w->cls) : w->need;
  for (const tier_block *b = g->large; b; b = b->next)
    if (tier_large_serves(b->bytes, lo)) return true;
  return false;
}

/* Move the blocks of src that w takes (all when w is NULL) into dst: those
 * serving the request, and every block of w's other sizes; how many. */
static size_t tier_bag_move_fits(tier_bag *src, tier_bag *dst, const tier_want *w) {
  size_t n = 0;
  if (!w) {
    n = src->n;
    sgm__pool_bag_merge(dst, src);
    return n;
  }
  for (tier_block *b; (b = sgm__pool_bag_take(src, w->cls, w->need)) != NULL; n++) sgm__pool_bag_push(dst, b);
  for (uint64_t bits = w->also_cls; bits; bits &= bits - 1)
    for (int c = __builtin_ctzll(bits); src->cls[c]; n++) sgm__pool_bag_push(dst, sgm__pool_bag_take(src, c, 0));
  for (int i = 0; i < TIER_RECENT_LARGE; i++)
    for (tier_block *b; w->also_large[i] && (b = sgm__pool_bag_take(src, -1, w->also_large[i])) != NULL; n++)
      sgm__pool_bag_push(dst, b);
  return n;
}

/* What a transfer to taker moves (written to *out, returned): w, and the
 * sizes the taker took from its own caches in its current and last period
 * (sgm__pool_stream_note_locked); a taker with no record, or w NULL (everything),
 * as it is. Starts the taker's next period. Pool lock held. */
const tier_want *sgm__pool_want_recent_locked(sgm_tier_pool *p, const sgm_stream_ref *taker,
                                              const tier_want *w, tier_want *out) {
  tier_stream *t = sgm__pool_stream_find_locked(p, taker->key);
  if (!w || !t) return w;
  *out = *w;
  out->also_cls = t->recent_cls[0] | t->recent_cls[1];
  for (int i = 0; i < TIER_RECENT_LARGE; i++) {
    const tier_recent_large *r = &t->recent_large[i];
    out->also_large[i] = r->need && t->period - r->period <= 1 ? r->need : 0;
  }
  t->recent_cls[1] = t->recent_cls[0];
  t->recent_cls[0] = 0;
  t->period++;
  return out;
}

/*
 * Hand other streams' cached blocks that serve the taker's request (w) to
 * taker, ordered on the device after the owner's work; the host never waits.
 * An owner holding none of them is left alone (no driver call). Per owner s:
 *  - FENCE_WAIT: fitting blocks sealed under s's fence (an event recorded on
 *    s after their frees, while s did not capture: the idle tick, an
 *    allocation that did not fit, sgm_trim, or an earlier transfer) need only
 *    the taker's side: stream_wait_event, the taker's capture check and one
 *    wait (2 calls, whatever the streams' flags). The fence stays while it
 *    covers blocks s still holds.
 *  - SEAL: else the backend orders the streams (stream_transfer_fence, 1 to 4
 *    calls, docs/streams.md "Why two calls"); when that recorded an event
 *    after s's work, the event becomes s's fence over every block s holds, so
 *    the blocks the taker does not take now cross later in 2 calls, and s
 *    keeps reusing them with none.
 *  - TRANSFER: s's fence is being recorded or queried by another thread: the
 *    fitting blocks cross with stream_transfer and the event is pooled again.
 */
size_t sgm__pool_reclaim_transfer(sgm_tier_pool *p, const sgm_stream_ref *taker,
                                  const tier_want *w) {
  size_t n_done = 0;
  sgm__lock_take(&p->lock);
  size_t n_jobs = 0;
  for (tier_stream *s = p->streams; s; s = s->next)
    n_jobs += s->ref.key != taker->key && (tier_bag_fits(&s->open, w) || tier_bag_fits(&s->sealed, w));
  tier_job *jobs = sgm__pool_jobs_alloc_locked(p, n_jobs);
  if (!jobs) return 0;
  tier_want recent;
  w = sgm__pool_want_recent_locked(p, taker, w, &recent);
  size_t k = 0;
  for (tier_stream *s = p->streams; s && k < n_jobs; s = s->next) {
    if (s->ref.key == taker->key) continue;
    bool fit_open = tier_bag_fits(&s->open, w), fit_sealed = tier_bag_fits(&s->sealed, w);
    if (!fit_open && !fit_sealed) continue;
    tier_job *j = &jobs[k++];
    j->s = s;
    j->ref = s->ref;
    j->want = w;
    if (s->busy) {
      j->kind = TIER_JOB_TRANSFER;
      tier_bag_move_fits(&s->open, &j->bag, w);
      tier_bag_move_fits(&s->sealed, &j->bag, w);
    } else if (fit_sealed && s->fence) {
      j->kind = TIER_JOB_FENCE_WAIT;
      j->ev = s->fence;
      s->busy = true;
      /* A taker back under the fence it crossed under before is in a burst:
       * it takes the rest, so that the burst costs the owner's side once and
       * this taker's side twice, not once per size (docs/streams.md). */
      if (s->crossed_fence == s->fence && s->crossed_to == taker->key) j->want = NULL;
      tier_bag_move_fits(&s->sealed, &j->bag, j->want);
    } else {
      /* Everything freed on s so far: the record comes after all of it. */
      j->kind = TIER_JOB_SEAL;
      j->seq = s->owe_seq; /* a fence recorded now covers s's returns so far (owe.c) */
      s->busy = true;
      sgm__pool_bag_merge(&j->bag, &s->open);
    }
  }
  sgm__lock_drop(&p->lock);

  const sgm_backend_ops *ops = p->p.bops;
  for (size_t i = 0; i < k; i++) {
    tier_job *j = &jobs[i];
    if (j->kind == TIER_JOB_FENCE_WAIT) {
      j->done = ops->stream_wait_event(p->p.be, taker, j->ev) == SGM_OK;
      if (!j->done)
        sgm__log(p->p.verbose, 2, "%s: cannot order a stream after another's fence (%s); their "
                 "cached blocks stay apart", sgm_tier_name(p->p.tier), sgm_last_error());
      continue;
    }
    j->ev = sgm__pool_event_get(p);
    bool fenced = false;
    if (j->ev && j->kind == TIER_JOB_SEAL && ops->stream_transfer_fence)
      j->done = ops->stream_transfer_fence(p->p.be, j->ev, &j->ref, taker, &fenced) == SGM_OK;
    else
      j->done = j->ev && ops->stream_transfer(p->p.be, j->ev, &j->ref, taker) == SGM_OK;
    if (!j->done)
      sgm__log(p->p.verbose, 2, "%s: cannot order a stream after another (%s); their cached "
               "blocks stay apart", sgm_tier_name(p->p.tier), sgm_last_error());
    /* Not kept as a fence: the wait captured the recording, the event may be
     * recorded again. */
    if (!fenced && j->ev) {
      sgm__pool_event_put(p, j->ev);
      j->ev = NULL;
    }
  }

  sgm__lock_take(&p->lock);
  tier_stream *t = sgm__pool_stream_get_locked(p, taker);
  for (size_t i = 0; i < k; i++) {
    tier_job *j = &jobs[i];
    tier_stream *s = j->s;
    bool moved = j->done && t;
    if (j->kind == TIER_JOB_TRANSFER) {
      sgm__pool_bag_merge(moved ? &t->open : &s->open, &j->bag);
      n_done += moved ? j->bag.n : 0;
    } else if (j->kind == TIER_JOB_FENCE_WAIT || j->ev) {
      /* The fence (s's, or the one just recorded) covers what s holds sealed. */
      s->busy = false;
      if (j->kind == TIER_JOB_SEAL) {
        if (s->fence) sgm__pool_event_put_locked(p, s->fence);
        s->fence = j->ev;
        s->fence_seq = j->seq;
        s->crossed_fence = NULL;
      }
      sgm__pool_bag_merge(&s->sealed, &j->bag);
      if (moved) {
        n_done += tier_bag_move_fits(&s->sealed, &t->open, j->want);
        s->crossed_fence = s->fence;
        s->crossed_to = taker->key;
      }
      if (!s->sealed.n) {
        sgm__pool_event_put_locked(p, s->fence);
        s->fence = NULL;
        s->crossed_fence = NULL;
      }
    } else {
      /* Nothing recorded on s: what the taker does not take stays open. */
      s->busy = false;
      if (moved) n_done += tier_bag_move_fits(&j->bag, &t->open, j->want);
      sgm__pool_bag_merge(&s->open, &j->bag);
    }
  }
  sgm__lock_drop(&p->lock);
  free(jobs);
  return n_done;
}
