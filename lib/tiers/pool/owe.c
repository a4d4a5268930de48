/*
 * owe.c — what a stream owes (issue 26): its own cached blocks handed
 * straight back to the sub-allocator, with no event, and the order every
 * other user of that memory then needs.
 *
 * Job: work queued on one stream runs in order, so memory freed on stream S
 * may serve any later allocation on S, of any size, with no event (the rule
 * of PyTorch's caching allocator). When S's allocation misses its caches and
 * its carve would need new memory (no room in the sub-allocator or the
 * budget, or granules not mapped yet), or the request is a large block
 * (placed after the caches return, as on the emulated device: alloc.c), S's
 * own cached blocks (its open and sealed bags and the calling thread's
 * stash of large blocks of S; its magazine's class blocks of S too when the
 * budget or the sub-allocator has no room, not when the carve would only map
 * granules) go back to the sub-allocator, where they coalesce, and the
 * carve is tried again: no event recorded, no query, no wait
 * (sgm__pool_owed_return_locked, in reclaim.c). The
 * sub-allocator's free memory may then have S's work pending on it: S
 * *owes*. Until an event recorded on S after those returns is seen complete
 * (a fence queried or waited for by bag.c, or a host wait here):
 *  - a carve for another stream T is ordered after S on the device before
 *    the block is handed out, when the block lies on memory S returned: one
 *    event recorded on S (only when S returned blocks since the last one)
 *    and stream_wait_event(T, it); T is remembered, so its later carves cost
 *    nothing until S returns blocks again;
 *  - sgm's own carves (no stream) and everything that gives memory back to
 *    the driver (unmapping granules, releasing chunks, trim, idle trim,
 *    budget lowering, destroy) wait on the host first (sgm__pool_owed_settle);
 *  - only memory the stream returned counts (the ranges of its returned
 *    blocks, up to TIER_OWED_RANGES_MAX of them, else all memory): a block
 *    elsewhere needs no order and no wait;
 *  - a stream sgm saw capturing a graph (a record on it refused with
 *    SGM_ERR_BUSY) returns nothing until a record on it succeeds again; while
 *    an owing stream captures, a block of another stream that lands on its
 *    memory is set aside and placed again (alloc.c, tier_carve_apart; after
 *    TIER_CARVE_ASIDE_MAX tries the paths of a full budget), and nothing is
 *    unmapped.
 * A synchronous backend has nothing pending: it returns every bag already
 * (bag.c) and never owes.
 *
 * Locks: the pool lock for the streams' owe state and n_owing; a stream's
 * owe_busy flag owns its owe_ev while the lock is dropped for the record and
 * the wait (driver calls are never made under it); others wait on `grown`.
 * The calling thread's magazine is changed under the pool lock (its own).
 *
 * Calls: the backend's event_record_on, stream_wait_event and event_wait;
 * stream.c (streams, pooled events). The returns themselves are reclaim.c's
 * (sgm__pool_owed_return_locked), which calls down into bags, magazines and
 * chunks.
 */
#include "tiers/pool/pool.h"

/* Is taker ordered after s's event that covers every return s made? */
static bool tier_owe_covered(const tier_stream *s, uint64_t taker) {
  if (!s->owe_ev || s->owe_ev_seq != s->owe_seq) return false;
  for (unsigned i = 0; i < s->n_owe_takers; i++)
    if (s->owe_takers[i] == taker) return true;
  return false;
}

/* May memory [lo, hi) carry work of s pending from its returns? */
static bool tier_owed_overlaps(const tier_stream *s, sgm_devptr lo, sgm_devptr hi) {
  if (s->owed_all) return true;
  for (uint32_t i = 0; i < s->n_owed; i++)
    if (s->owed[i].lo < hi && lo < s->owed[i].hi) return true;
  return false;
}

/* A stream taker must still be ordered after before it uses [lo, hi)
 * (taker NULL: sgm itself, which waits on the host); NULL when none. Pool
 * lock held. */
static tier_stream *tier_owed_next_locked(sgm_tier_pool *p, const sgm_stream_ref *taker,
                                          sgm_devptr lo, sgm_devptr hi) {
  if (!p->n_owing) return NULL;
  for (tier_stream *s = p->streams; s; s = s->next) {
    if (!tier_owes(s)) continue;
    /* The taker's own stream, or one it is already ordered after, first:
     * they need no order whatever the ranges say, and the ranges are a
     * linear scan of up to TIER_OWED_RANGES_MAX (a stream's carves after its
     * own returns scanned them all: 3.5% of the CUDA churn run's samples, issue 26). */
    if (taker && (s->ref.key == taker->key || tier_owe_covered(s, taker->key))) continue;
    if (tier_owed_overlaps(s, lo, hi)) return s;
  }
  return NULL;
}

bool sgm__pool_owed_needs_locked(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_devptr lo,
                                 sgm_devptr hi) {
  return tier_owed_next_locked(p, taker, lo, hi) != NULL;
}

/* An event recorded on s when its owe_seq was seq has completed (seen by a
 * query or a wait): the returns up to seq are owed no more. Pool lock held. */
void sgm__pool_owed_seen_locked(sgm_tier_pool *p, tier_stream *s, uint64_t seq) {
  if (seq <= s->owe_done) return;
  bool owed = tier_owes(s);
  s->owe_done = seq;
  if (owed && !tier_owes(s)) {
    __atomic_store_n(&p->n_owing, p->n_owing - 1, __ATOMIC_RELAXED);
    s->n_owe_takers = 0;
    s->n_owed = 0; /* the memory has no pending work of s any more */
    s->owed_all = false;
  }
}

/* A record on s answered rc: SGM_ERR_BUSY says s captures a graph (no
 * returns until a record succeeds again). Pool lock held. */
void sgm__pool_owed_recorded_locked(tier_stream *s, int rc) {
  if (rc == SGM_OK) s->capturing = false;
  else if (rc == SGM_ERR_BUSY) s->capturing = true;
}

/*
 * Order taker after the streams that owe and whose returned blocks overlap
 * [lo, hi) (taker NULL: wait on the host for them, then they owe nothing):
 * per such stream s, an event recorded on s
 * when s returned blocks since its last one, then stream_wait_event(taker)
 * on it, or event_wait. A capturing taker (its wait refused) waits on the
 * host instead. SGM_OK, or the failure (SGM_ERR_BUSY: s captures a graph;
 * nothing the returns made may be handed to others until it ends). Takes
 * and drops the pool lock; driver calls without it.
 */
int sgm__pool_owed_order(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_devptr lo, sgm_devptr hi) {
  const sgm_backend_ops *ops = p->p.bops;
  int rc = SGM_OK;
  sgm__lock_take(&p->lock);
  for (tier_stream *s; rc == SGM_OK && (s = tier_owed_next_locked(p, taker, lo, hi)) != NULL;) {
    if (s->owe_busy) {
      pthread_cond_wait(&p->grown, &p->lock.mu);
      continue;
    }
    s->owe_busy = true;
    uint64_t seq = s->owe_seq;
    bool record = !s->owe_ev || s->owe_ev_seq != seq;
    void *ev = s->owe_ev;
    sgm_stream_ref owner = s->ref;
    sgm__lock_drop(&p->lock);
    if (!ev) ev = sgm__pool_event_get(p);
    int rrc = ev ? SGM_OK : SGM_ERR_BACKEND;
    if (ev && record) rrc = ops->event_record_on(p->p.be, ev, &owner);
    rc = rrc;
    bool host = !taker;
    if (rc == SGM_OK && taker) {
      rc = ops->stream_wait_event(p->p.be, taker, ev);
      if (rc == SGM_ERR_BUSY) { /* the taker captures: the host waits for it instead */
        host = true;
        rc = SGM_OK;
      }
    }
    if (rc == SGM_OK && host) rc = ops->event_wait(p->p.be, ev);
    sgm__lock_take(&p->lock);
    s->owe_busy = false;
    pthread_cond_broadcast(&p->grown);
    if (ev && !s->owe_ev) {
      s->owe_ev = ev; /* kept for the stream's life (destroyed with the pool) */
      s->owe_ev_seq = 0;
    }
    if (record) sgm__pool_owed_recorded_locked(s, rrc);
    if (record && rrc == SGM_OK) {
      s->owe_ev_seq = seq;
      s->n_owe_takers = 0;
    }
    if (rc != SGM_OK) break;
    if (host) {
      sgm__pool_owed_seen_locked(p, s, seq);
    } else if (s->owe_ev_seq == seq) {
      if (s->n_owe_takers == TIER_OWE_TAKERS) {
        memmove(s->owe_takers, s->owe_takers + 1, (TIER_OWE_TAKERS - 1) * sizeof *s->owe_takers);
        s->n_owe_takers--;
      }
      s->owe_takers[s->n_owe_takers++] = taker->key;
    }
  }
  sgm__lock_drop(&p->lock);
  if (rc != SGM_OK)
    sgm__log(p->p.verbose, rc == SGM_ERR_BUSY ? 3 : 1, "%s: cannot order %s after a stream's "
             "returned cache (%s); that memory is not handed out yet", sgm_tier_name(p->p.tier),
             taker ? "a stream" : "sgm's own use", sgm_last_error());
  return rc;
}

/*
 * Before memory goes back to the driver, or to sgm itself: no stream owes.
 * One relaxed load when none does; else a host wait on each owing stream
 * (sgm__pool_owed_order). false when a stream's work cannot be waited for
 * now (it captures a graph): the caller gives nothing back.
 */
bool sgm__pool_owed_settle(sgm_tier_pool *p) {
  if (!__atomic_load_n(&p->n_owing, __ATOMIC_RELAXED)) return true;
  return sgm__pool_owed_order(p, NULL, 0, UINT64_MAX) == SGM_OK;
}
