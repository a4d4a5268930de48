/*
 * mag.c — magazines: each thread's small per-class stacks of cached blocks
 * for each pool it uses, so that a steady alloc/free takes no shared lock.
 *
 * Job: make a thread's magazine on first use (thread-local slots, a registry
 * of every magazine), drain it into its streams' bags, settle its stash (the
 * large blocks it freed) at its next large carve, flush its pending
 * counters, hand everything back when the thread exits or the pool goes,
 * and say whether the pool caches anything (sgm__tier_has_cached).
 *
 * Locks: the magazine registry (rank SGM_LOCK_TIER_MAGS) before the pool lock
 * before a magazine; the owner thread changes its own in sections that take
 * no lock (pool.h, tier_mag_enter), a reclaimer under the pool lock once it
 * stopped the owner (sgm__pool_mags_stop_locked: one membarrier for all).
 *
 * Calls: bag.c (a drained block goes to its stream's bag), libc and pthread
 * (thread-local key for the exit hook). reclaim.c returns the calling
 * thread's blocks of a stream (sgm__pool_mag_find, under the pool lock).
 */
#include "tiers/pool/pool.h"

/* ---- magazines ---- */

/* The registry of every thread's magazines (rank SGM_LOCK_TIER_MAGS, taken
 * before a pool's lock): a magazine's pool link and the pools' lists. */
static sgm_lock tier_registry_mu = SGM_LOCK_INITIALIZER(SGM_LOCK_TIER_MAGS);
static pthread_once_t tier_tls_once = PTHREAD_ONCE_INIT;
static pthread_key_t tier_tls_key;
static _Thread_local struct {
  uint64_t pool_id;  /* the pool the magazine is for (0: empty slot) */
  tier_mag *mag;     /* this thread's magazine for it */
} tier_tls[TIER_TLS_SLOTS];

/* m's stash is empty now: its blocks went elsewhere (pool lock held; m the
 * caller's, or stopped). */
static void tier_stash_clear(tier_mag *m) {
  __atomic_store_n(&m->cached_bytes, m->cached_bytes - m->stash_bytes, __ATOMIC_RELAXED);
  __atomic_store_n(&m->n_stash, 0, __ATOMIC_RELAXED);
  m->stash_bytes = 0;
}

/* Move every block of m's stash into its stream's bag, oldest first, as its
 * free would have (pool lock held; m the caller's, or stopped). */
static void tier_stash_bag_locked(sgm_tier_pool *p, tier_mag *m) {
  for (unsigned i = 0; i < m->n_stash; i++) sgm__pool_bag_add_locked(p, m->stash[i]);
  tier_stash_clear(m);
}

/* Move every block of m into its stream's bag (pool lock held; m the caller's,
 * or stopped: sgm__pool_mags_stop_locked). */
void sgm__pool_mag_drain_locked(sgm_tier_pool *p, tier_mag *m) {
  tier_stash_bag_locked(p, m);
  for (int c = 0; c < TIER_N_CLASSES; c++) {
    for (unsigned i = 0; i < m->n[c]; i++) sgm__pool_bag_add_locked(p, m->slot[c][i]);
    m->n[c] = 0;
  }
  __atomic_store_n(&m->cached_bytes, 0, __ATOMIC_RELAXED);
}

/*
 * The large carve of m's thread for a block of need bytes on stream ref
 * empties m's stash (pool lock held: m, the caller's, is its own). The answer
 * and the blocks' places are those the carve would reach had each block
 * gone to its stream's bag at its free: the smallest of ref's blocks that
 * serves need (a bag take), NULL when none. When the bags are empty on a
 * synchronous backend, the stash is all a bag take would see and every
 * bagged block would go back to the sub-allocator (bag.c): the blocks go
 * there straight, without a bag, or to their bags when one serves need
 * (a bag take leaves the others bagged). Otherwise they go to their bags,
 * and the carve goes on as for any bagged block.
 */
tier_block *sgm__pool_stash_settle_locked(sgm_tier_pool *p, tier_mag *m, uint64_t need,
                                          const sgm_stream_ref *ref) {
  unsigned n = m->n_stash;
  tier_block *fit = NULL;
  if (n == 0 || !p->p.bops->synchronous || p->n_bagged) {
    if (n) tier_stash_bag_locked(p, m);
    return NULL;
  }
  for (unsigned i = n; i-- > 0;) {
    tier_block *b = m->stash[i];
    if (b->key == ref->key && tier_large_serves(b->bytes, need) && (!fit || b->bytes < fit->bytes)) fit = b;
  }
  for (unsigned i = 0; i < n; i++) {
    tier_block *b = m->stash[i];
    if (b == fit) continue;
    if (fit) sgm__pool_bag_add_locked(p, b);
    else sgm__pool_release_block_locked(p, b);
  }
  tier_stash_clear(m);
  if (fit) {
    tier_stream *s = sgm__pool_stream_find_locked(p, ref->key);
    if (s) sgm__pool_stream_note_locked(s, -1, need);
  } else {
    tier_update_room_locked(p);
  }
  return fit;
}

/* The magazines a reclaimer takes: `only`, or every magazine of p for NULL;
 * never the calling thread's own (its owner is here, out of any section).
 * The first of them from m (m NULL: none). */
static tier_mag *tier_mags_next(tier_mag *m, tier_mag *only, const tier_mag *mine) {
  for (; m; m = only ? NULL : m->next)
    if (m != mine) return m;
  return NULL;
}

/* Take magazines from their owners (pool lock held; pool.h, tier_mag_enter):
 * `only`, or every magazine of p for NULL, but the caller's own. One heavy
 * fence for all of them; owners that enter afterwards wait until
 * sgm__pool_mags_go_locked. */
void sgm__pool_mags_stop_locked(sgm_tier_pool *p, tier_mag *only) {
  const tier_mag *mine = sgm__pool_mag_find(p);
  tier_mag *first = tier_mags_next(only ? only : p->mags, only, mine);
  if (!first) return;
  for (tier_mag *m = first; m; m = tier_mags_next(only ? NULL : m->next, only, mine))
    __atomic_store_n(&m->stop, 1, __ATOMIC_SEQ_CST);
  sgm__fence_heavy();
  for (tier_mag *m = first; m; m = tier_mags_next(only ? NULL : m->next, only, mine))
    while (__atomic_load_n(&m->busy, __ATOMIC_SEQ_CST)) sched_yield();
}

/* Give back what sgm__pool_mags_stop_locked took (pool lock held). */
void sgm__pool_mags_go_locked(sgm_tier_pool *p, tier_mag *only) {
  const tier_mag *mine = sgm__pool_mag_find(p);
  for (tier_mag *m = tier_mags_next(only ? only : p->mags, only, mine); m;
       m = tier_mags_next(only ? NULL : m->next, only, mine))
    __atomic_store_n(&m->stop, 0, __ATOMIC_RELEASE);
}

/* Add m's pending counters to the pool and zero them (owner thread, or pool
 * lock held and m stopped). */
static void tier_mag_flush_counts(sgm_tier_pool *p, tier_mag *m) {
  int64_t du = __atomic_load_n(&m->d_used, __ATOMIC_RELAXED);
  uint64_t na = __atomic_load_n(&m->n_allocs, __ATOMIC_RELAXED);
  uint64_t nf = __atomic_load_n(&m->n_frees, __ATOMIC_RELAXED);
  int64_t dl = (int64_t)(na - nf); /* the live blocks it changed: one counter less per pair */
  __atomic_store_n(&m->d_used, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&m->peak_room, 0, __ATOMIC_RELAXED); /* its next allocation looks at the peak */
  __atomic_store_n(&m->n_allocs, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&m->n_frees, 0, __ATOMIC_RELAXED);
  tier_count_used(p, du, dl, na, nf);
}

/* Unhook m from its pool (if alive), its blocks to the bags; registry lock held. */
static void tier_mag_detach_registered(tier_mag *m) {
  sgm_tier_pool *p = m->pool;
  if (!p) return;
  sgm__lock_take(&p->lock);
  sgm__pool_mags_stop_locked(p, m);
  sgm__pool_mag_drain_locked(p, m);
  tier_mag_flush_counts(p, m);
  sgm__pool_mags_go_locked(p, m);
  if (m->prev) m->prev->next = m->next;
  else p->mags = m->next;
  if (m->next) m->next->prev = m->prev;
  /* Its lineage waits, whole, for the next magazine (pool.h, tier_lineage). */
  if (m->lin) p->lin[m->lin].held = false;
  m->lin = 0;
  __atomic_store_n(&p->n_mags, p->n_mags - 1, __ATOMIC_RELAXED);
  __atomic_store_n(&m->pool, NULL, __ATOMIC_RELAXED);
  sgm__lock_drop(&p->lock);
}

/* Detach every thread's magazine from p (destroy); registry lock not held. */
void sgm__pool_mag_detach_all(sgm_tier_pool *p) {
  sgm__lock_take(&tier_registry_mu);
  while (p->mags) tier_mag_detach_registered(p->mags);
  sgm__lock_drop(&tier_registry_mu);
}

static void tier_mag_free(tier_mag *m) {
  sgm__lock_take(&tier_registry_mu);
  tier_mag_detach_registered(m);
  sgm__lock_drop(&tier_registry_mu);
  free(m);
}

/* Thread exit: every magazine of the thread goes back to its pool. */
static void tier_tls_exit(void *unused) {
  (void)unused;
  for (int i = 0; i < TIER_TLS_SLOTS; i++) {
    if (tier_tls[i].mag) tier_mag_free(tier_tls[i].mag);
    tier_tls[i].mag = NULL;
    tier_tls[i].pool_id = 0;
  }
}

static void tier_tls_init(void) { pthread_key_create(&tier_tls_key, tier_tls_exit); }

/* The calling thread's magazine for p, made on first use; NULL when out of memory. */
/* Not inlined: the lookup's fast path stays a leaf with no frame to build. */
__attribute__((noinline)) static tier_mag *tier_mag_slow(sgm_tier_pool *p) {
  pthread_once(&tier_tls_once, tier_tls_init);
  int slot = -1;
  for (int i = 0; i < TIER_TLS_SLOTS && slot < 0; i++)
    if (!tier_tls[i].mag || !__atomic_load_n(&tier_tls[i].mag->pool, __ATOMIC_RELAXED)) slot = i;
  if (slot < 0) slot = (int)(p->id % TIER_TLS_SLOTS);
  if (tier_tls[slot].mag) {
    tier_mag_free(tier_tls[slot].mag);
    tier_tls[slot].mag = NULL;
    tier_tls[slot].pool_id = 0;
  }
  /* Its own cache lines: two threads' magazines never share one. */
  tier_mag *m = aligned_alloc(64, sgm__align_up(sizeof *m, 64));
  if (m) memset(m, 0, sizeof *m);
  if (!m) return NULL;
  m->pool = p;
  m->pool_id = p->id;
  pthread_setspecific(tier_tls_key, (void *)1); /* so that tier_tls_exit runs */
  sgm__lock_take(&tier_registry_mu);
  sgm__lock_take(&p->lock);
  m->lin = sgm__pool_lineage_take_locked(p);
  m->next = p->mags;
  if (p->mags) p->mags->prev = m;
  p->mags = m;
  __atomic_store_n(&p->n_mags, p->n_mags + 1, __ATOMIC_RELAXED);
  sgm__lock_drop(&p->lock);
  sgm__lock_drop(&tier_registry_mu);
  tier_tls[slot].pool_id = p->id;
  tier_tls[slot].mag = m;
  return m;
}

/* The calling thread's magazine for p, or NULL when it has none (never
 * made here: callable under the pool lock). */
tier_mag *sgm__pool_mag_find(sgm_tier_pool *p) {
  for (int i = 0; i < TIER_TLS_SLOTS; i++)
    if (tier_tls[i].pool_id == p->id && tier_tls[i].mag &&
        __atomic_load_n(&tier_tls[i].mag->pool, __ATOMIC_RELAXED) == p)
      return tier_tls[i].mag;
  return NULL;
}

tier_mag *sgm__pool_mag_get(sgm_tier_pool *p) {
  /* The slots' address once: each thread-local access in a shared library is
   * a call into the dynamic linker, and the compiler does not merge them. */
  __typeof__(tier_tls[0]) *t = tier_tls;
  for (int i = 0; i < TIER_TLS_SLOTS; i++)
    if (t[i].pool_id == p->id) return t[i].mag;
  return tier_mag_slow(p);
}

bool sgm__tier_has_cached(sgm_tier_pool *p) {
  if (__atomic_load_n(&p->n_bagged, __ATOMIC_RELAXED)) return true;
  if (!__atomic_load_n(&p->n_mags, __ATOMIC_RELAXED)) return false;
  bool any = false;
  sgm__lock_take(&p->lock);
  for (tier_mag *m = p->mags; m && !any; m = m->next)
    any = __atomic_load_n(&m->cached_bytes, __ATOMIC_RELAXED) != 0;
  sgm__lock_drop(&p->lock);
  return any;
}
