/*
 * stream.c — the pool's streams and their bags as lists, and its pooled
 * events: the records every cache and reclaim file builds on.
 *
 * Job: find or make a stream's record, push and take blocks of a bag by
 * class, merge bags, keep the count of bagged bytes, note the sizes a stream
 * took (recent sizes, issue 10), pool events for fences and transfers, and
 * size a reclaim pass's job array.
 *
 * Locks: the pool lock for the stream list, the bagged counts and the event
 * pool (a bag owned by a job is the job's alone); an event is created or
 * destroyed with the lock dropped.
 *
 * Calls: the backend's event_create / event_destroy; libc.
 */
#include "tiers/pool/pool.h"

void sgm__pool_bag_push(tier_bag *g, tier_block *b) {
  int c = tier_cls(b);
  tier_block **head = c >= 0 ? &g->cls[c] : &g->large;
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
    tier_block **best = NULL;
    for (tier_block **pp = &g->large; *pp; pp = &(*pp)->next) {
      uint64_t sz = (*pp)->bytes;
      if (tier_large_serves(sz, lo) && (!best || sz < (*best)->bytes)) best = pp;
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

/* The job array of a reclaim pass, counted under p->lock: zeroed room for
 * n_jobs, or NULL with the lock dropped (nothing to do, or out of memory:
 * the pass is skipped, and the caches stay for the next one). */
tier_job *sgm__pool_jobs_alloc_locked(sgm_tier_pool *p, size_t n_jobs) {
  tier_job *jobs = n_jobs ? calloc(n_jobs, sizeof *jobs) : NULL;
  if (!jobs) sgm__lock_drop(&p->lock);
  return jobs;
}
