/*
 * capture.c — capture pools (DESIGN.md §9): memory a framework allocates
 * while it has a stream or a thread "under a pool" (PyTorch's
 * begin/end-allocate-to-pool around a CUDA graph capture, or
 * torch.cuda.use_mem_pool) belongs to that pool until the framework releases
 * the pool. A captured graph replays with the addresses it captured, so:
 *  - a block of the pool freed by the framework is *parked*: it stays live in
 *    its tier (so no trim, idle trim or pressure ever returns or unmaps it),
 *    and only a later allocation under the same pool, on the same stream, may
 *    take it again (the order of a graph's replay is the order of its capture);
 *  - a parked block that sgm_record_stream named is never taken again by the
 *    pool (another stream may still use it): it waits for the release;
 *  - releasing the pool frees its parked blocks through sgm_free_ex on the
 *    stream they were freed on (the tier's stream-ordered cache and recorded
 *    streams then apply as for any free); its blocks still live stop
 *    belonging to it and are freed later like any allocation.
 *
 * Scopes: begin(stream, pool) puts allocations by the calling thread on that
 * stream under the pool (SGM_CAPTURE_ANY_STREAM: on every stream; PyTorch
 * 2.3+ passes a filter sgm cannot call, so its hook scopes by thread, see
 * hooks.c); end(pool) ends every scope of the pool, of any thread; a pool
 * exists from its first begin until its release (begin again on a pool not
 * yet released adds a scope and a reference to it: PyTorch shares one pool
 * between graphs, and each graph releases it once); the last release frees.
 *
 * Layering (lib/LAYERS: context-services, below context.c): called by
 * context.c's sgm_alloc / sgm_free_ex / sgm_record_stream and by the public
 * sgm_capture_pool_* calls below; frees parked blocks through the free the
 * context registered at create (sgm_free_ex: c->free_ex, never a call up),
 * only without its own lock; reads the context through context_state.c and
 * context.h. The tiers know nothing of pools.
 *
 * Threading: one lock (SGM_LOCK_CAPTURE, a leaf: nothing is called while it
 * is held) guards scopes, pools and the member map. A pool indexes its
 * reusable parked blocks, so an allocation under a pool looks at those only.
 * Without pools sgm_alloc and sgm_free pay one relaxed load of n_pools;
 * while pools exist, outside any scope, sgm_alloc also reads n_scopes and
 * sgm_free one filter word, both without the lock.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "context.h"
#include "internal.h"

enum { CAPTURE_LIVE = 1, CAPTURE_PARKED = 2 };
/* 65,536 filter bits (8 KiB): with 4096 members 6 % of other frees look up. */
#define CAPTURE_FILTER_WORDS 1024

/* A block allocated under a pool. */
typedef struct capture_member {
  uint64_t ptr;      /* its address; 0 = empty slot of the map */
  uint64_t bytes;    /* the size it was allocated with (what a reuse may ask at most) */
  uint64_t pool;     /* the pool it belongs to */
  void *stream;      /* allocated on (LIVE) or freed on (PARKED) */
  uint8_t state;     /* CAPTURE_LIVE or CAPTURE_PARKED */
  uint8_t recorded;  /* sgm_record_stream named it: never reused by the pool */
} capture_member;

typedef struct capture_scope {
  uint64_t pool;
  pthread_t thread;  /* the thread that began it */
  void *stream;      /* its stream, or SGM_CAPTURE_ANY_STREAM */
} capture_scope;

typedef struct capture_pool {
  uint64_t id;
  uint64_t refs;                     /* begins not yet matched by a release */
  uint64_t live_bytes, parked_bytes; /* members' bytes by state */
  uint64_t n_live, n_parked;
  uint64_t *reuse;                   /* addresses of its parked members a later
                                        allocation may take (not recorded ones) */
  size_t n_reuse, cap_reuse;
} capture_pool;

struct sgm_capture {
  sgm_capture_head head;     /* first: n_pools, the fast path's only read (sgm__capture_active) */
  sgm_lock lock;
  capture_pool *pools;       /* n_pools of them */
  size_t cap_pools;
  capture_scope *scopes;
  size_t n_scopes, cap_scopes; /* n_scopes: written under the lock, read without it (atomic) */
  capture_member *map;       /* open addressing by address, linear probing; mask + 1 slots */
  size_t mask, n_members;
  /* A Bloom-style filter of members' addresses (one bit each, atomic words):
   * a free whose bit is clear is no member's and takes no lock. Bits are set
   * under the lock when a block joins a pool and cleared only when no member
   * is left, so a member's bit is never clear while it is a member. */
  uint64_t filter[CAPTURE_FILTER_WORDS];
  /* Last, off the hot fields' lines: sgm_free_ex, registered at create,
   * through which a released pool frees its parked blocks (never called up). */
  sgm_status (*free_ex)(sgm_context *ctx, void *ptr, void *stream);
};

/* NULL and CU_STREAM_LEGACY (0x1) both name the legacy stream. */
static bool capture_same_stream(void *a, void *b) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  if (x == 0) x = 1;
  if (y == 0) y = 1;
  return x == y;
}

static size_t capture_hash(const sgm_capture *c, uint64_t ptr) {
  return (size_t)((ptr >> 8) * UINT64_C(0x9E3779B97F4A7C15) >> 20) & c->mask;
}

static size_t capture_filter_bit(uint64_t ptr) {
  return (size_t)((ptr >> 8) * UINT64_C(0x9E3779B97F4A7C15) >> 48); /* 16 bits */
}

/* False when ptr is certainly no member (no lock); true when it may be. */
static bool capture_maybe_member(sgm_capture *c, uint64_t ptr) {
  size_t bit = capture_filter_bit(ptr);
  return (__atomic_load_n(&c->filter[bit / 64], __ATOMIC_RELAXED) >> (bit % 64)) & 1;
}

/* The member slot of ptr, or NULL. Lock held. */
static capture_member *capture_find(sgm_capture *c, uint64_t ptr) {
  if (!c->map) return NULL;
  for (size_t i = capture_hash(c, ptr);; i = (i + 1) & c->mask) {
    if (c->map[i].ptr == ptr) return &c->map[i];
    if (c->map[i].ptr == 0) return NULL;
  }
}

/* Remove a member by backward shift (no tombstones). Lock held. */
static void capture_erase(sgm_capture *c, capture_member *m) {
  size_t i = (size_t)(m - c->map);
  for (size_t j = (i + 1) & c->mask;; j = (j + 1) & c->mask) {
    if (c->map[j].ptr == 0) break;
    size_t h = capture_hash(c, c->map[j].ptr);
    /* j's entry may move to i when its home is not in (i, j]. */
    bool stays = (i <= j) ? (h > i && h <= j) : (h > i || h <= j);
    if (stays) continue;
    c->map[i] = c->map[j];
    i = j;
  }
  memset(&c->map[i], 0, sizeof c->map[i]);
  c->n_members--;
}

static bool capture_insert(sgm_capture *c, const capture_member *m) {
  if ((c->n_members + 1) * 2 > (c->map ? c->mask + 1 : 0)) {
    size_t slots = c->map ? (c->mask + 1) * 2 : 256;
    capture_member *old = c->map;
    size_t old_slots = old ? c->mask + 1 : 0;
    capture_member *nm = calloc(slots, sizeof *nm);
    if (!nm) return false;
    c->map = nm;
    c->mask = slots - 1;
    c->n_members = 0;
    for (size_t i = 0; i < old_slots; i++)
      if (old[i].ptr) (void)capture_insert(c, &old[i]);
    free(old);
  }
  size_t i = capture_hash(c, m->ptr);
  while (c->map[i].ptr) i = (i + 1) & c->mask;
  c->map[i] = *m;
  c->n_members++;
  return true;
}

static capture_pool *capture_pool_find(sgm_capture *c, uint64_t id) {
  size_t n = __atomic_load_n(&c->head.n_pools, __ATOMIC_RELAXED);
  for (size_t i = 0; i < n; i++)
    if (c->pools[i].id == id) return &c->pools[i];
  return NULL;
}

static void capture_count(sgm_capture *c, const capture_member *m, int sign) {
  capture_pool *p = capture_pool_find(c, m->pool);
  if (!p) return;
  uint64_t *bytes = m->state == CAPTURE_LIVE ? &p->live_bytes : &p->parked_bytes;
  uint64_t *n = m->state == CAPTURE_LIVE ? &p->n_live : &p->n_parked;
  *bytes += sign > 0 ? m->bytes : (uint64_t)0 - m->bytes;
  *n += sign > 0 ? 1 : (uint64_t)0 - 1;
}

/* Room for one more element in an array of n (growing *cap by doubling);
 * false when out of host memory. Lock held. */
static bool capture_room(void **arr, size_t *cap, size_t n, size_t elem) {
  if (n < *cap) return true;
  size_t grown = *cap ? *cap * 2 : 4;
  void *p = realloc(*arr, grown * elem);
  if (!p) return false;
  *arr = p;
  *cap = grown;
  return true;
}

/* End every scope of a pool; how many there were. Lock held. */
static size_t capture_end_scopes(sgm_capture *c, uint64_t pool_id) {
  size_t kept = 0, before = c->n_scopes;
  for (size_t i = 0; i < c->n_scopes; i++)
    if (c->scopes[i].pool != pool_id) c->scopes[kept++] = c->scopes[i];
  __atomic_store_n(&c->n_scopes, kept, __ATOMIC_RELAXED);
  return before - kept;
}

/* ---- called by context.c ---- */

sgm_capture *sgm__capture_create(sgm_status (*free_ex)(sgm_context *ctx, void *ptr, void *stream)) {
  sgm_capture *c = calloc(1, sizeof *c);
  if (c) sgm__lock_init(&c->lock, SGM_LOCK_CAPTURE);
  if (c) c->free_ex = free_ex;
  return c;
}

void sgm__capture_destroy(sgm_capture *c) {
  if (!c) return;
  sgm__lock_destroy(&c->lock);
  for (size_t i = 0; i < c->head.n_pools; i++) free(c->pools[i].reuse);
  free(c->map);
  free(c->pools);
  free(c->scopes);
  free(c);
}

/* The pool the calling thread allocates into on stream, 0 = none (lock held). */
static uint64_t capture_scope_locked(const sgm_capture *c, void *stream) {
  pthread_t self = pthread_self();
  /* The latest scope wins (a pool begun inside another's scope). */
  for (size_t i = c->n_scopes; i-- > 0;) {
    const capture_scope *s = &c->scopes[i];
    if (!pthread_equal(s->thread, self)) continue;
    if (s->stream != SGM_CAPTURE_ANY_STREAM && !capture_same_stream(s->stream, stream)) continue;
    return s->pool;
  }
  return 0;
}

/* The smallest block of at least size (at most 1/8 more) that pool parked
 * when freed on stream, now live again; NULL when there is none (lock held). */
static void *capture_reuse_locked(sgm_capture *c, uint64_t pool, size_t size, void *stream) {
  capture_member *best = NULL;
  size_t best_at = 0;
  capture_pool *rec = capture_pool_find(c, pool);
  for (size_t i = 0; rec && i < rec->n_reuse; i++) {
    capture_member *m = capture_find(c, rec->reuse[i]);
    if (!m || m->state != CAPTURE_PARKED) continue;
    if (m->bytes < size || m->bytes - size > (size >> 3)) continue; /* the tier's 1/8 slack */
    if (!capture_same_stream(m->stream, stream)) continue;
    if (!best || m->bytes < best->bytes) {
      best = m;
      best_at = i;
    }
  }
  if (!best) return NULL;
  rec->reuse[best_at] = rec->reuse[--rec->n_reuse];
  capture_count(c, best, -1);
  best->state = CAPTURE_LIVE;
  capture_count(c, best, +1);
  return (void *)(uintptr_t)best->ptr;
}

uint64_t sgm__capture_lock_takes(const sgm_capture *c) { return sgm__lock_takes(&c->lock); }

void *sgm__capture_scope_reuse(sgm_capture *c, size_t size, void *stream, uint64_t *pool) {
  *pool = 0;
  /* Between captures (a graph's pool lives on, no scope is open) allocating
   * costs this one load. A scope begun by another thread meanwhile is not
   * this thread's: missing it is what the lock would answer too. */
  if (__atomic_load_n(&c->n_scopes, __ATOMIC_RELAXED) == 0) return NULL;
  /* The scope and the reuse under one lock: a pair inside a scope took the
   * capture lock three times (the scope, the reuse, the park), and its
   * lock round trips were most of what it cost over a pair without a pool
   * (alloc.pair.in_pool). */
  sgm__lock_take(&c->lock);
  void *p = NULL;
  *pool = capture_scope_locked(c, stream);
  if (*pool) p = capture_reuse_locked(c, *pool, size, stream);
  sgm__lock_drop(&c->lock);
  return p;
}

void sgm__capture_adopt(sgm_capture *c, uint64_t pool, void *ptr, size_t size, void *stream) {
  capture_member m = {.ptr = (uint64_t)(uintptr_t)ptr, .bytes = size, .pool = pool,
                      .stream = stream, .state = CAPTURE_LIVE};
  bool lost = false;
  sgm__lock_take(&c->lock);
  /* Released between the scope check and now: the block is an ordinary one. */
  if (capture_pool_find(c, pool)) {
    if (capture_insert(c, &m)) {
      capture_count(c, &m, +1);
      size_t bit = capture_filter_bit(m.ptr);
      __atomic_fetch_or(&c->filter[bit / 64], UINT64_C(1) << (bit % 64), __ATOMIC_RELAXED);
    } else {
      lost = true;
    }
  }
  sgm__lock_drop(&c->lock);
  if (lost)
    sgm__log(1, 1, "capture pool %llu: out of host memory recording %p (%zu bytes); the block is "
             "an ordinary allocation and may be reused once freed",
             (unsigned long long)pool, ptr, size);
}

int sgm__capture_park(sgm_capture *c, uint64_t ptr, void *stream) {
  if (!capture_maybe_member(c, ptr)) return 0;
  int rc = 0;
  sgm__lock_take(&c->lock);
  capture_member *m = capture_find(c, ptr);
  if (m && m->state == CAPTURE_LIVE) {
    capture_count(c, m, -1);
    m->state = CAPTURE_PARKED;
    m->stream = stream;
    capture_count(c, m, +1);
    /* Reusable unless another stream may still use it; without room in the
     * index it simply waits for the release. */
    capture_pool *p = capture_pool_find(c, m->pool);
    if (p && !m->recorded && capture_room((void **)&p->reuse, &p->cap_reuse, p->n_reuse, sizeof *p->reuse))
      p->reuse[p->n_reuse++] = ptr;
    rc = 1;
  } else if (m) {
    rc = -1; /* parked already: a double free */
  }
  sgm__lock_drop(&c->lock);
  return rc;
}

bool sgm__capture_parked(sgm_capture *c, uint64_t ptr) {
  if (!capture_maybe_member(c, ptr)) return false;
  sgm__lock_take(&c->lock);
  capture_member *m = capture_find(c, ptr);
  bool parked = m && m->state == CAPTURE_PARKED;
  sgm__lock_drop(&c->lock);
  return parked;
}

void sgm__capture_recorded(sgm_capture *c, uint64_t ptr) {
  if (!capture_maybe_member(c, ptr)) return;
  sgm__lock_take(&c->lock);
  capture_member *m = capture_find(c, ptr);
  if (m) m->recorded = 1;
  sgm__lock_drop(&c->lock);
}

void sgm__capture_release_all(sgm_context *ctx) {
  sgm_capture *c = sgm__context_capture(ctx);
  while (__atomic_load_n(&c->head.n_pools, __ATOMIC_RELAXED)) {
    sgm__lock_take(&c->lock);
    uint64_t id = c->pools[0].id;
    capture_pool *p = capture_pool_find(c, id);
    if (p) p->refs = 1; /* the context goes: whatever still holds the pool */
    sgm__lock_drop(&c->lock);
    if (sgm_capture_pool_release(ctx, id) != SGM_OK) break; /* out of host memory: leave it */
  }
}

int sgm__capture_end_stream(sgm_capture *c, void *stream) {
  size_t kept = 0, before;
  pthread_t self = pthread_self();
  sgm__lock_take(&c->lock);
  before = c->n_scopes;
  for (size_t i = 0; i < c->n_scopes; i++) {
    const capture_scope *s = &c->scopes[i];
    bool ends = pthread_equal(s->thread, self) && s->stream != SGM_CAPTURE_ANY_STREAM &&
                capture_same_stream(s->stream, stream);
    if (!ends) c->scopes[kept++] = *s;
  }
  __atomic_store_n(&c->n_scopes, kept, __ATOMIC_RELAXED);
  sgm__lock_drop(&c->lock);
  if (kept == before)
    return sgm__error_set(SGM_ERR_INVALID, "no capture pool scope of this thread is open on "
                          "stream %p; nothing changed", stream);
  return SGM_OK;
}

/* ---- the public calls ---- */

SGM_API sgm_status sgm_capture_pool_begin(sgm_context *ctx, void *stream, uint64_t pool_id) {
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_capture_pool_begin: context is NULL");
  if (pool_id == 0)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_capture_pool_begin: pool id 0 is "
                                      "reserved (no pool); use any other value");
  if (sgm__context_forked(ctx)) return (sgm_status)sgm__context_fork_error(ctx, "sgm_capture_pool_begin");
  sgm_capture *c = sgm__context_capture(ctx);
  int rc = SGM_OK;
  sgm__lock_take(&c->lock);
  size_t n = c->head.n_pools;
  bool is_new = !capture_pool_find(c, pool_id);
  if ((is_new && !capture_room((void **)&c->pools, &c->cap_pools, n, sizeof *c->pools)) ||
      !capture_room((void **)&c->scopes, &c->cap_scopes, c->n_scopes, sizeof *c->scopes)) {
    rc = sgm__error_set(SGM_ERR_NOMEM, "sgm_capture_pool_begin: out of host memory");
    goto out;
  }
  if (is_new) c->pools[n] = (capture_pool){.id = pool_id};
  c->scopes[c->n_scopes] = (capture_scope){.pool = pool_id, .thread = pthread_self(), .stream = stream};
  __atomic_store_n(&c->n_scopes, c->n_scopes + 1, __ATOMIC_RELAXED);
  if (is_new) __atomic_store_n(&c->head.n_pools, n + 1, __ATOMIC_RELAXED);
  capture_pool_find(c, pool_id)->refs++;
out:
  sgm__lock_drop(&c->lock);
  return (sgm_status)rc;
}

SGM_API sgm_status sgm_capture_pool_end(sgm_context *ctx, uint64_t pool_id) {
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_capture_pool_end: context is NULL");
  if (sgm__context_forked(ctx)) return (sgm_status)sgm__context_fork_error(ctx, "sgm_capture_pool_end");
  sgm_capture *c = sgm__context_capture(ctx);
  sgm__lock_take(&c->lock);
  size_t ended = capture_end_scopes(c, pool_id);
  sgm__lock_drop(&c->lock);
  if (!ended)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_capture_pool_end: pool %llu has no "
                                      "open scope (never begun, or ended already); nothing changed",
                                      (unsigned long long)pool_id);
  return SGM_OK;
}

SGM_API sgm_status sgm_capture_pool_release(sgm_context *ctx, uint64_t pool_id) {
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_capture_pool_release: context is NULL");
  if (sgm__context_forked(ctx)) return (sgm_status)sgm__context_fork_error(ctx, "sgm_capture_pool_release");
  sgm_capture *c = sgm__context_capture(ctx);
  capture_member *parked = NULL;
  size_t n_parked = 0;
  int rc = SGM_OK;
  sgm__lock_take(&c->lock);
  capture_pool *p = capture_pool_find(c, pool_id);
  if (!p) {
    rc = sgm__error_set(SGM_ERR_INVALID, "sgm_capture_pool_release: pool %llu does not exist "
                        "(never begun, or released already); nothing changed",
                        (unsigned long long)pool_id);
    goto out;
  }
  if (p->refs > 1) { /* another begin still holds it (graphs sharing a pool) */
    p->refs--;
    goto out;
  }
  if (p->n_parked && !(parked = malloc(p->n_parked * sizeof *parked))) {
    rc = sgm__error_set(SGM_ERR_NOMEM, "sgm_capture_pool_release: out of host memory; the pool "
                        "stays (try again)");
    goto out;
  }
  /* Its scopes end; its members leave the map (parked ones to be freed). */
  (void)capture_end_scopes(c, pool_id);
  for (size_t i = 0; c->map && i <= c->mask;) {
    capture_member *m = &c->map[i];
    if (m->ptr && m->pool == pool_id) {
      if (m->state == CAPTURE_PARKED) parked[n_parked++] = *m;
      capture_erase(c, m); /* may shift a later entry into slot i: look at it again */
      continue;
    }
    i++;
  }
  if (c->n_members == 0) /* nobody can hold a member's address now */
    for (size_t w = 0; w < CAPTURE_FILTER_WORDS; w++) __atomic_store_n(&c->filter[w], 0, __ATOMIC_RELAXED);
  size_t n = c->head.n_pools;
  free(p->reuse);
  *p = c->pools[n - 1];
  __atomic_store_n(&c->head.n_pools, n - 1, __ATOMIC_RELAXED);
out:
  sgm__lock_drop(&c->lock);
  for (size_t i = 0; i < n_parked; i++)
    (void)c->free_ex(ctx, (void *)(uintptr_t)parked[i].ptr, parked[i].stream);
  free(parked);
  return (sgm_status)rc;
}

SGM_API sgm_status sgm_capture_pool_info(sgm_context *ctx, uint64_t pool_id, sgm_capture_pool_stats *out) {
  if (out) memset(out, 0, sizeof *out);
  if (!ctx || !out)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_capture_pool_info: %s is NULL",
                                      ctx ? "out" : "context");
  sgm_capture *c = sgm__context_capture(ctx);
  int rc = SGM_OK;
  sgm__lock_take(&c->lock);
  size_t n = c->head.n_pools;
  bool found = pool_id == 0;
  for (size_t i = 0; i < n; i++) {
    if (pool_id && c->pools[i].id != pool_id) continue;
    found = true;
    out->n_pools++;
    out->live_bytes += c->pools[i].live_bytes;
    out->parked_bytes += c->pools[i].parked_bytes;
    out->n_live += c->pools[i].n_live;
    out->n_parked += c->pools[i].n_parked;
  }
  if (!found)
    rc = sgm__error_set(SGM_ERR_INVALID, "sgm_capture_pool_info: pool %llu does not exist",
                        (unsigned long long)pool_id);
  sgm__lock_drop(&c->lock);
  return (sgm_status)rc;
}
