/*
 * alloc.c — the user's path: allocate and free on a stream, record a stream,
 * and sgm's own allocations.
 *
 * Job: serve an allocation from the thread's magazine, then the stream's bag,
 * then a carve from the sub-allocator (the stream's own cached blocks given
 * back to it first when the carve would need new memory, owe.c; growing the
 * pool; ordered after streams that owe), then other streams' caches
 * (transfer, then query); put a free in the magazine, a large one in the
 * thread's stash (or a deferred free when sgm_record_stream named other
 * streams); answer ownership and the
 * fallback path's "is this tier full" hint.
 *
 * Locks: a warm alloc or free takes no lock: its own magazine's section
 * (pool.h, no atomic read-modify-write) and, on free, a lock-free lookup in
 * the live map plus one compare-and-swap on the block's record; carving and
 * bag work take the pool lock, never across a backend call.
 *
 * Calls: map.c, stream.c, owe.c (a carve ordered after streams that owe),
 * vmm.c (mapping the granules of a carve), chunk.c (growth), bag.c, mag.c,
 * reclaim.c (caches back before growing; a stream's own cache returned).
 */
#include "tiers/pool/pool.h"

/* tier_carve's answer when its block could not be ordered after a stream
 * that owes and captures a graph: the block stays carved in *out (LIVE, not
 * handed out), so that the next carve lands elsewhere (tier_carve_apart). */
#define TIER_CARVE_ASIDE (-101)
/* Blocks set aside so at most, then the carve gives up (SGM__ERR_BUDGET). */
#define TIER_CARVE_ASIDE_MAX 4
/* tier_carve's answer when, asked to give cached blocks back first, it found
 * one of them that serves the request: *out is that block, still CACHED. */
#define TIER_CARVE_CACHED (-102)

static tier_block *tier_bag_take_locked(sgm_tier_pool *p, tier_mag *m, int cls, uint64_t need,
                                        const sgm_stream_ref *ref);

/* give_back: a large block (sgm__tier_alloc_on) whose stream's bags may
 * serve it: in the carve's own lock section, a cached block of the stream
 * that fits (TIER_CARVE_CACHED), else cached blocks go back to the
 * sub-allocator first: on a synchronous backend every bag, else the
 * stream's own. */
static int tier_carve(sgm_tier_pool *p, tier_mag *m, uint64_t need, uint64_t asked,
                      const sgm_stream_ref *ref, bool give_back, tier_block **out) {
  *out = NULL;
  /* A full budget is answered without the lock: this is the first step of
   * every fallback allocation. A free racing with this read may leave room a
   * moment later; the block then lands one tier down, as it would have a
   * moment earlier. */
  if (!give_back && need > __atomic_load_n(&p->head.room_bytes, __ATOMIC_RELAXED)) return SGM__ERR_BUDGET;
  bool trimmed = false, reclaimed = false, returned = false;
  sgm__lock_take(&p->lock);
  if (give_back) {
    /* The large blocks this thread freed since its last large carve (its
     * stash) first, then a cached block of the stream that serves the
     * request, under the same lock (a large block: no magazine slots). */
    tier_block *c = m && ref ? sgm__pool_stash_settle_locked(p, m, need, ref) : NULL;
    if (!c && ref && p->n_bagged) c = tier_bag_take_locked(p, m, -1, need, ref);
    if (c) {
      sgm__lock_drop(&p->lock);
      *out = c;
      return TIER_CARVE_CACHED;
    }
    if (!p->p.bops->synchronous) sgm__pool_owed_return_locked(p, ref, false);
    else if (p->n_bagged) sgm__pool_bags_release_all_locked(p);
  }
  for (int round = 0; round < TIER_MAX_GROW_ROUNDS; round++) {
    uint64_t off = 0, got = 0;
    sgm_suballoc_node *node = NULL;
    /* Blocks never pass the budget, also when a lowered budget left more
     * committed than it allows. The stream's own cached blocks go back
     * first when they hold the room (owe.c). */
    if (need > p->p.budget_bytes - (p->held_bytes < p->p.budget_bytes ? p->held_bytes : p->p.budget_bytes)) {
      if (!returned && (returned = true, sgm__pool_owed_return_locked(p, ref, true))) {
        round--;
        continue;
      }
      break;
    }
    if (sgm__suballoc_try_alloc_node(p->sa, need, &off, &got, &node)) {
      /* The map slot the block goes in is on its way while the rest is
       * decided (issue 26: the insert's load missed the cache); the insert
       * takes the hash this computed. */
      uint64_t hash = sgm__pool_map_prefetch(p, off, got);
      tier_vmm_prefetch(p, off, got);
      uint64_t unmapped = 0;
      bool backed = p->vmm_range && sgm__pool_vmm_ref_backed_locked(p, off, got, &unmapped);
      if (unmapped && !returned) {
        /* New granules would be mapped: the stream's own cached blocks go
         * back to the sub-allocator first (no event: its later work runs
         * after its earlier work, owe.c), they coalesce, and the block is
         * placed again. Not the thread's magazine blocks, as on the
         * emulated device below (reclaim.c, sgm__pool_owed_return_locked). */
        returned = true;
        uint64_t sz;
        sgm__suballoc_free_node(p->sa, node, &sz);
        sgm__pool_owed_return_locked(p, ref, false); /* none: the same place again, next step below */
        round--;
        continue;
      }
      if (unmapped && !reclaimed && p->bag_bytes >= unmapped) {
        /* Expandable growth maps memory only when cached blocks the device
         * is done with could not cover it: give the streams' bags back (they
         * coalesce) and place the block again. Not the threads' magazines:
         * emptying them here, about once every 400 pairs, made every thread
         * carve under the pool lock again (a quarter of all pairs; two
         * threads ran at 0.16x the pairs/s of one, issue 10). A magazine
         * holds at most TIER_MAG_CLASS_BYTES per class and goes back at
         * sgm_trim, at thread exit, and when the budget is full. */
        uint64_t sz;
        sgm__suballoc_free_node(p->sa, node, &sz);
        reclaimed = true;
        sgm__lock_drop(&p->lock);
        sgm__pool_reclaim_some(p, false, SGM_RECLAIM_QUERY);
        sgm__lock_take(&p->lock);
        round--;
        continue;
      }
      /* A record of this thread's lineage (pool.h, tier_lineage): a spare
       * one, else a new one. Lock-free readers may still be reading a
       * spare's tag: it is written atomically. */
      tier_mag *mine = m ? m : sgm__pool_mag_find(p);
      tier_block *b = tier_record_new_locked(p, mine ? mine->lin : 0, true);
      if (b) {
        b->node = node;
        b->bytes = got;
        b->sized = asked | (uint64_t)(tier_class_exact(got) + 1);
        b->key = ref ? ref->key : 0;
        b->handle = ref ? ref->handle : NULL;
        b->rec = NULL;
        b->next = NULL;
        __atomic_store_n(&b->tag, off | TIER_LIVE | (ref ? 0 : TIER_OWN), __ATOMIC_RELEASE);
      }
      if (!b || !sgm__pool_map_insert(p, b, hash)) {
        uint64_t sz;
        if (backed) sgm__pool_vmm_unref_locked(p, off, got);
        sgm__suballoc_free_node(p->sa, node, &sz);
        if (b) sgm__pool_spare_put_locked(p, b);
        sgm__lock_drop(&p->lock);
        if (give_back) sgm__pool_vmm_settle(p);
        return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for block metadata");
      }
      p->held_bytes += got;
      p->n_blocks++;
      tier_update_room_locked(p);
      /* Granules with no memory yet (or another thread's attention) are
       * mapped (or waited for) now; a backed block only moves the peak. */
      if (backed) tier_vmm_held_grew(p);
      int vrc = p->vmm_range && !backed ? sgm__pool_vmm_back_locked(p, off, got) : SGM_OK;
      if (vrc != SGM_OK) {
        sgm__pool_release_block_locked(p, b); /* frees b and drops its granule references */
        tier_update_room_locked(p);
        sgm__lock_drop(&p->lock);
        sgm__pool_vmm_settle(p);
        return vrc;
      }
      /* Streams that owe (owe.c): this block may lie where their work is
       * still pending. The taker is ordered after them on the device, sgm
       * itself waits on the host. */
      bool order = __atomic_load_n(&p->n_owing, __ATOMIC_RELAXED) &&
                   sgm__pool_owed_needs_locked(p, ref, off, off + got);
      /* Granules that blocks given back left free and this one did not take
       * go when committed is over the cap: decided here, under the lock, so
       * that a busy program's carve takes the lock once. */
      bool settle = reclaimed || (give_back && sgm__pool_vmm_pressure_locked(p));
      sgm__lock_drop(&p->lock);
      if (settle) sgm__pool_vmm_settle(p);
      if (order && (vrc = sgm__pool_owed_order(p, ref, off, off + got)) != SGM_OK) {
        /* A stream that owes this memory captures a graph: the block is set
         * aside and placed again elsewhere (tier_carve_apart). */
        if (vrc == SGM_ERR_BUSY) {
          *out = b;
          return TIER_CARVE_ASIDE;
        }
        sgm__lock_take(&p->lock);
        sgm__pool_release_block_locked(p, b);
        tier_update_room_locked(p);
        sgm__lock_drop(&p->lock);
        return vrc;
      }
      *out = b;
      return SGM_OK;
    }
    /* No room in the sub-allocator: the stream's own cached blocks first. */
    if (!returned && (returned = true, sgm__pool_owed_return_locked(p, ref, true))) {
      round--;
      continue;
    }
    /* One reserved range holds the whole budget: nothing to grow. */
    if (!p->p.growth || p->vmm_range) break;
    bool dedicated = false;
    uint64_t chunk = sgm__pool_next_chunk_locked(p, need, &dedicated);
    if (chunk == 0 && (p->n_growing > 0 || p->n_releasing > 0)) {
      /* The budget is held by chunks other threads are taking right now (one
       * of them may have room for this block) or giving back (a trim: their
       * bytes are committed until the backend has them). Wait, look again. */
      pthread_cond_wait(&p->grown, &p->lock.mu);
      round--;
      continue;
    }
    if (chunk == 0) {
      if (trimmed) break;
      /* No room in the budget for a new chunk: free chunks may be what holds
       * it (fragmentation across chunks); give them back and try once more. */
      trimmed = true;
      sgm_chunk *list;
      size_t n = sgm__pool_detach_free_locked(p, 0, UINT64_MAX, &list);
      if (n == 0) break;
      sgm__lock_drop(&p->lock);
      sgm__pool_release_chunks(p, list, n);
      sgm__lock_take(&p->lock);
      continue;
    }
    p->committed_bytes += chunk;
    if (!dedicated) p->n_geometric++;
    p->n_growing++;
    sgm__lock_drop(&p->lock);
    sgm_chunk c = {0};
    int rc = sgm__pool_take_chunk(p, chunk, need, &c);
    if (rc == SGM_OK) c.dedicated = dedicated;
    sgm__lock_take(&p->lock);
    p->n_growing--;
    pthread_cond_broadcast(&p->grown);
    if (rc == SGM_OK && c.bytes < chunk) {
      /* Got a smaller chunk: give back the budget reserved for the rest, and
       * do not let the geometric series climb while the device is short. */
      p->committed_bytes -= chunk - c.bytes;
      if (!dedicated && p->n_geometric > 0) p->n_geometric--;
      chunk = c.bytes;
    }
    if (rc == SGM_OK) {
      rc = sgm__pool_add_chunk_locked(p, &c);
      if (rc != SGM_OK) {
        p->committed_bytes -= chunk;
        if (!dedicated && p->n_geometric > 0) p->n_geometric--;
        sgm__lock_drop(&p->lock);
        p->p.ops->chunk_free(p, &c);
        return rc;
      }
      continue;
    }
    p->committed_bytes -= chunk;
    if (!dedicated && p->n_geometric > 0) p->n_geometric--;
    /* The message names the budget; the status stays the backend's. */
    if (rc == SGM_ERR_NOMEM) tier_backend_nomem_locked(p, need);
    sgm__lock_drop(&p->lock);
    return rc;
  }
  /* The budget is full. The message is composed only if the caller needs it
   * (sgm__tier_explain_budget): on the fallback path it does not, and
   * formatting it would cost more than the fallback allocation itself. */
  sgm__lock_drop(&p->lock);
  if (give_back) sgm__pool_vmm_settle(p);
  return SGM__ERR_BUDGET;
}

/* tier_carve, placing the block again elsewhere when it lands on memory a
 * capturing stream owes (up to TIER_CARVE_ASIDE_MAX times; then the
 * allocation takes the paths a full budget takes: transfer, query,
 * fallback). The blocks set aside go back to the sub-allocator. Inlined into
 * its callers: a large carve passed through four frames, each saving and
 * restoring its registers (28 of a large pair's instructions, issue 26). */
__attribute__((always_inline)) static inline int tier_carve_apart(sgm_tier_pool *p, tier_mag *m, uint64_t need,
                                                                   uint64_t asked, const sgm_stream_ref *ref,
                                                                   bool give_back, tier_block **out) {
  tier_block *aside[TIER_CARVE_ASIDE_MAX + 1];
  size_t n = 0;
  int rc = tier_carve(p, m, need, asked, ref, give_back, out);
  while (rc == TIER_CARVE_ASIDE) {
    aside[n++] = *out;
    *out = NULL;
    rc = n <= TIER_CARVE_ASIDE_MAX ? tier_carve(p, m, need, asked, ref, false, out) : SGM__ERR_BUDGET;
  }
  if (n) {
    sgm__lock_take(&p->lock);
    for (size_t i = 0; i < n; i++) sgm__pool_release_block_locked(p, aside[i]);
    tier_update_room_locked(p);
    sgm__lock_drop(&p->lock);
  }
  return rc;
}

int sgm__tier_alloc(sgm_tier_pool *p, uint64_t size, sgm_devptr *out) {
  *out = 0;
  if (size == 0) return sgm__error_set(SGM_ERR_INVALID, "allocation of 0 bytes");
  if (size > UINT64_MAX - SGM_DEVICE_ALIGN)
    return sgm__error_set(SGM_ERR_INVALID, "allocation of %llu bytes overflows",
                          (unsigned long long)size);
  uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
  tier_block *b = NULL;
  int rc = tier_carve_apart(p, NULL, need, need, NULL, false, &b);
  /* Memory the device has finished with comes back before anyone is demoted. */
  if ((rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM) && sgm__tier_has_cached(p) &&
      sgm__tier_reclaim(p, NULL, SGM_RECLAIM_QUERY))
    rc = tier_carve_apart(p, NULL, need, need, NULL, false, &b);
  if (rc != SGM_OK) {
    __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
    return rc;
  }
  tier_count_direct(p, (int64_t)need, 1, 1, 0);
  *out = tier_ptr_of(b);
  return SGM_OK;
}

/* ---- the user's path ---- */

/* Hand a cached block out to the user on stream ref: LIVE, and the user's,
 * also when sgm had taken it for itself (a buffer destroyed while its
 * release's work was pending caches its block on that stream): the mark of
 * sgm's own (TIER_OWN) stayed, and the user's free of the block was refused
 * (test_a_destroyed_buffers_block_is_the_users_once_reused). */
static inline sgm_devptr tier_hand_out(sgm_tier_pool *p, tier_mag *m, tier_block *b, uint64_t asked,
                                       const sgm_stream_ref *ref) {
  tier_set_asked(b, asked);
  b->key = ref->key;
  b->handle = ref->handle;
  /* The address from the tag: the record's second line stays cold. */
  sgm_devptr ptr = tier_ptr_of(b);
  __atomic_store_n(&b->tag, ptr | TIER_LIVE, __ATOMIC_RELEASE);
  if (m) tier_mag_count(p, m, (int64_t)asked);
  else tier_count_direct(p, (int64_t)asked, 1, 1, 0);
  return ptr;
}

/* The newest block of class cls in magazine m that belongs to ref's stream,
 * NULL when none. */
static inline tier_block *tier_mag_pop(tier_mag *m, int cls, const sgm_stream_ref *ref) {
  tier_mag_enter(m);
  unsigned n = m->n[cls];
  for (unsigned i = n; i-- > 0;) {
    tier_block *b = m->slot[cls][i];
    if (b->key != ref->key) continue;
    m->slot[cls][i] = m->slot[cls][n - 1];
    m->n[cls] = (uint8_t)(n - 1);
    __atomic_store_n(&m->cached_bytes, m->cached_bytes - b->bytes, __ATOMIC_RELAXED);
    tier_mag_leave(m);
    return b;
  }
  tier_mag_leave(m);
  return NULL;
}

/* tier_take_cached past the magazine: the stream's bags (refilling the
 * magazine). Not inlined, so that a magazine hit builds no frame for it. */
__attribute__((noinline)) static tier_block *tier_take_bagged(sgm_tier_pool *p, tier_mag *m, int cls,
                                                              uint64_t need, const sgm_stream_ref *ref) {
  if (__atomic_load_n(&p->n_bagged, __ATOMIC_RELAXED) == 0) return NULL;
  sgm__lock_take(&p->lock);
  tier_block *b = tier_bag_take_locked(p, m, cls, need, ref);
  sgm__lock_drop(&p->lock);
  return b;
}

/* tier_take_bagged's work, the pool lock held. */
static tier_block *tier_bag_take_locked(sgm_tier_pool *p, tier_mag *m, int cls, uint64_t need,
                                        const sgm_stream_ref *ref) {
  tier_stream *s = sgm__pool_stream_find_locked(p, ref->key);
  tier_block *b = NULL;
  if (s) {
    b = sgm__pool_bag_take(&s->open, cls, need);
    if (!b) b = sgm__pool_bag_take(&s->sealed, cls, need);
    if (b) {
      /* Another thread may have cached it: its record joins this thread's
       * lineage (pool.h, tier_lineage), as the refills' below do. */
      if (m) b = sgm__pool_record_own_locked(p, b, m->lin);
      sgm__pool_bagged_add_locked(p, -1, -(int64_t)b->bytes);
      sgm__pool_stream_note_locked(s, cls, need);
    }
    /* Refill half the magazine from the open bag: the next allocations of
     * this class on this stream then take no lock (m is the caller's: under
     * the pool lock no reclaimer takes it). */
    if (b && m && cls >= 0) {
      unsigned want = tier_mag_cap(cls) / 2;
      while (m->n[cls] < want && s->open.cls[cls]) {
        tier_block *x = sgm__pool_record_own_locked(p, sgm__pool_bag_take(&s->open, cls, 0), m->lin);
        sgm__pool_bagged_add_locked(p, -1, -(int64_t)x->bytes);
        m->slot[cls][m->n[cls]++] = x;
        __atomic_store_n(&m->cached_bytes, m->cached_bytes + x->bytes, __ATOMIC_RELAXED);
      }
    }
  }
  return b;
}

/* A cached block of class cls (or exact size need for cls < 0) for stream ref:
 * the magazine, then the stream's bags (refilling the magazine). NULL when none. */
static inline tier_block *tier_take_cached(sgm_tier_pool *p, tier_mag *m, int cls, uint64_t need,
                                           const sgm_stream_ref *ref) {
  tier_block *b = m && cls >= 0 ? tier_mag_pop(m, cls, ref) : NULL;
  return b ? b : tier_take_bagged(p, m, cls, need, ref);
}

/*
 * Placement of large blocks (issue 17, reserve mode): a cached block is a
 * hole the sub-allocator cannot see, so a block carved while the bags hold
 * memory goes elsewhere, the holes never coalesce with their free
 * neighbours, and the range fragments: on the idealloc traces the smallest
 * reserve budget was up to 1.67 x the peak live bytes, against 1.20 for the
 * bare sub-allocator. On a synchronous backend (the emulated device) nothing
 * is pending, so before a large block that no cached block fits is carved,
 * the bags go back to the sub-allocator (they coalesce); the threads'
 * magazines (small blocks) stay with their owners. Not on other backends:
 * there it would cost driver calls (a fence to record or query) on every
 * such allocation and take the blocks from the device-side transfer to other
 * streams, which comes first (DESIGN.md §8). Reserve mode on the
 * virtual-memory API (the budget a pool of granules in a range of twice its
 * size) does not depend on this: addresses no longer decide the budget, only
 * the granules blocks touch; as one chunk on CUDA the fragmentation stays
 * (docs/vmm.md).
 */
/* sgm__tier_has_cached, asked by the allocating thread whose magazine is m:
 * when m is the pool's only magazine, its own counter answers without the
 * pool lock. This is the second step of every fallback allocation (the
 * budget is full; is there cached memory to reclaim first?), which took the
 * lock each time to walk one empty magazine. A thread that registers a
 * magazine racing with this read makes it answer as a moment earlier. */
static bool tier_has_cached_for(sgm_tier_pool *p, tier_mag *m) {
  if (__atomic_load_n(&p->n_bagged, __ATOMIC_RELAXED)) return true;
  size_t n_mags = __atomic_load_n(&p->n_mags, __ATOMIC_RELAXED);
  if (n_mags == 0) return false;
  if (n_mags == 1 && m && __atomic_load_n(&m->pool, __ATOMIC_RELAXED) == p)
    return __atomic_load_n(&m->cached_bytes, __ATOMIC_RELAXED) != 0;
  return sgm__tier_has_cached(p);
}

/* sgm__tier_full_for calls made by this thread, any pool (tests): a
 * thread-local count, so that the fallback path writes no shared line for it. */
static _Thread_local uint64_t tier_full_checks;

bool sgm__tier_full_for(sgm_tier_pool *p, uint64_t size) {
  tier_full_checks++;
  if (size == 0 || size > UINT64_MAX - TIER_CLASS_MAX_BYTES) return false; /* alloc_on says why */
  uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
  int cls = tier_class(need);
  uint64_t block = cls >= 0 ? tier_class_bytes(cls) : need;
  if (block <= __atomic_load_n(&p->head.room_bytes, __ATOMIC_RELAXED)) return false;
  if (tier_has_cached_for(p, sgm__pool_mag_get(p))) return false;
  __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED); /* as sgm__tier_alloc_on counts it */
  return true;
}

/* sgm__tier_alloc_on past a magazine that had no block: the stream's bags,
 * the sub-allocator, other streams' caches. Not inlined: a magazine hit
 * builds no frame for all this. */
__attribute__((noinline)) static int tier_alloc_on_slow(sgm_tier_pool *p, tier_mag *m, uint64_t size,
                                                        const sgm_stream_ref *ref, sgm_devptr *out) {
  if (sgm_unlikely(size == 0)) return sgm__error_set(SGM_ERR_INVALID, "allocation of 0 bytes");
  if (sgm_unlikely(size > UINT64_MAX - TIER_CLASS_MAX_BYTES))
    return sgm__error_set(SGM_ERR_INVALID, "allocation of %llu bytes overflows",
                          (unsigned long long)size);
  uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
  int cls = tier_class(need);
  uint64_t block = cls >= 0 ? tier_class_bytes(cls) : need;
  bool placed_after_reclaim = cls < 0 && (__atomic_load_n(&p->bag_bytes, __ATOMIC_RELAXED) != 0 ||
                                          (m && __atomic_load_n(&m->n_stash, __ATOMIC_RELAXED) != 0));
  /* A large block that the bags may serve: the carve looks there first. */
  tier_block *b = placed_after_reclaim ? NULL : tier_take_bagged(p, m, cls, need, ref);
  if (sgm_likely(b != NULL)) {
    *out = tier_hand_out(p, m, b, need, ref);
    return SGM_OK;
  }
  /* A large block the caches could not serve is placed in the sub-allocator
   * only after cached blocks went back there, where they coalesce: on a
   * synchronous backend every bag (the device is done with all of them); on
   * others the stream's own cached blocks, with no event (owe.c: its later
   * work runs after its earlier work). Measured on the idealloc traces over
   * the driver double (issue 26): without the latter, CUDA committed up to
   * 1.114 x the peak live bytes where the emulated device committed 1.008;
   * with it the two agree within 1.1 % (docs/streams.md). Both happen in the
   * carve's lock section (one lock take, not two), which also settles the
   * granules they left free (sgm__pool_vmm_settle). */
  int rc = tier_carve_apart(p, m, block, need, ref, placed_after_reclaim, &b);
  if (rc == TIER_CARVE_CACHED) {
    *out = tier_hand_out(p, m, b, need, ref);
    return SGM_OK;
  }
  /* Reclaiming cached memory comes before anything moves or falls back:
   * first other streams' caches through a device-side wait (one or two calls, no
   * host wait), then what the device has finished with (fences queried). */
  static const sgm_reclaim_mode order[] = {SGM_RECLAIM_TRANSFER, SGM_RECLAIM_QUERY};
  const tier_want want = {.cls = cls, .need = need};
  for (int k = 0; rc != SGM_OK && k < 2; k++) {
    if (rc != SGM__ERR_BUDGET && rc != SGM_ERR_NOMEM) break;
    if (!tier_has_cached_for(p, m)) break;
    if (sgm__pool_reclaim_settle(p, ref, order[k], &want) == 0) continue;
    b = tier_take_cached(p, m, cls, need, ref);
    if (b) {
      *out = tier_hand_out(p, m, b, need, ref);
      return SGM_OK;
    }
    rc = tier_carve_apart(p, m, block, need, ref, false, &b);
  }
  /* Counted per attempt, as sgm__tier_alloc counts: a request retried after
   * demotions may count more than once. */
  if (rc != SGM_OK) {
    __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
    return rc;
  }
  /* Fresh from the sub-allocator: counted as handed out (state is LIVE). */
  if (m) tier_mag_count(p, m, (int64_t)need);
  else tier_count_direct(p, (int64_t)need, 1, 1, 0);
  *out = tier_ptr_of(b);
  return SGM_OK;
}

int sgm__tier_alloc_on(sgm_tier_pool *p, uint64_t size, const sgm_stream_ref *ref, sgm_devptr *out) {
  *out = 0;
  tier_mag *m = sgm__pool_mag_get(p);
  /* The magazine first, inline: a class size (which also rules out 0 and
   * overflowing sizes, left to the slow path's messages). */
  if (sgm_likely(m && size - 1 < TIER_CLASS_MAX_BYTES)) {
    uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
    int cls = tier_class(need);
    tier_block *b = tier_mag_pop(m, cls, ref);
    if (b) {
      *out = tier_hand_out(p, m, b, need, ref);
      return SGM_OK;
    }
  }
  return tier_alloc_on_slow(p, m, size, ref, out);
}

int sgm__tier_free(sgm_tier_pool *p, sgm_devptr ptr, uint64_t *size_out) {
  *size_out = 0;
  tier_block *b = sgm__pool_map_take_live(p, ptr, true);
  /* Not ours: say so without a message; the caller tries the next tier and
   * composes the message only if no tier owns the pointer. */
  if (!b) return SGM_ERR_INVALID;
  uint64_t asked = tier_asked(b);
  sgm__lock_take(&p->lock);
  sgm__pool_release_block_locked(p, b);
  tier_update_room_locked(p);
  sgm__lock_drop(&p->lock);
  sgm__pool_vmm_settle(p);
  tier_count_used(p, -(int64_t)asked, -1, 0, 1);
  *size_out = asked;
  return SGM_OK;
}

/* A free of a block named by sgm_record_stream: an event on every recorded
 * stream, and the block waits in the deferred list until all have completed. */
static int tier_free_recorded(sgm_tier_pool *p, tier_block *b) {
  tier_deferred *d = calloc(1, sizeof *d);
  void **evs = calloc(b->rec->n, sizeof *evs);
  int rc = SGM_OK;
  if (!d || !evs) {
    rc = sgm__error_set(SGM_ERR_NOMEM, "out of host memory freeing a block used by other streams");
    goto out_fail;
  }
  for (size_t i = 0; i < b->rec->n; i++) {
    void *ev = sgm__pool_event_get(p);
    if (!ev) {
      rc = SGM_ERR_BACKEND; /* the backend's message says why */
      goto out_fail;
    }
    evs[d->n_events++] = ev;
    rc = p->p.bops->event_record_on(p->p.be, ev, &b->rec->ref[i]);
    if (rc != SGM_OK) goto out_fail;
  }
  d->b = b;
  d->events = evs;
  free(b->rec);
  b->rec = NULL;
  b->sized &= ~TIER_SIZED_REC;
  sgm__lock_take(&p->lock);
  d->next = p->deferred;
  p->deferred = d;
  sgm__pool_bagged_add_locked(p, 1, (int64_t)b->bytes);
  sgm__lock_drop(&p->lock);
  return SGM_OK;

out_fail:
  /* Without the events nobody can tell when the other streams are done with
   * the block: it stays live (the caller's free failed). */
  if (d) for (size_t i = 0; i < d->n_events; i++) sgm__pool_event_put(p, evs[i]);
  free(evs);
  free(d);
  tier_block_set_state(b, TIER_LIVE);
  return rc;
}

/* The stream-ordered free of a user's block (own false) or of one sgm took
 * for itself (own true: a buffer destroyed with its release's work pending).
 * Inlined into both: sgm_free's path pays no extra call for the second use. */
__attribute__((always_inline)) static inline int tier_free_on_as(sgm_tier_pool *p, sgm_devptr ptr,
                                                                 const sgm_stream_ref *ref, bool own) {
  tier_block *b = sgm__pool_map_take_live(p, ptr, own);
  if (sgm_unlikely(!b)) return SGM_ERR_INVALID;
  uint64_t asked = tier_asked(b);
  b->key = ref->key;
  b->handle = ref->handle;
  tier_mag *m = sgm__pool_mag_get(p);
  if (sgm_unlikely(tier_recorded(b))) {
    if (p->p.bops->synchronous) {
      free(b->rec);
      b->rec = NULL;
      b->sized &= ~TIER_SIZED_REC;
    } else {
      int rc = tier_free_recorded(p, b);
      if (rc != SGM_OK) return rc;
      if (m) tier_mag_count(p, m, -(int64_t)asked);
      else tier_count_used(p, -(int64_t)asked, -1, 0, 1);
      return SGM_OK;
    }
  }
  int c = tier_cls(b);
  if (sgm_likely(m && c >= 0)) {
    unsigned cap = tier_mag_cap(c);
    tier_block *spill[TIER_MAG_SLOTS];
    unsigned n_spill = 0;
    tier_mag_enter(m);
    if (m->n[c] >= cap) {
      /* Full: the older half goes down to the bags (under the pool lock,
       * taken after this lock is dropped). */
      n_spill = cap / 2;
      memcpy(spill, m->slot[c], n_spill * sizeof *spill);
      memmove(m->slot[c], m->slot[c] + n_spill, (m->n[c] - n_spill) * sizeof *spill);
      m->n[c] = (uint8_t)(m->n[c] - n_spill);
      uint64_t spilled = 0;
      for (unsigned i = 0; i < n_spill; i++) spilled += spill[i]->bytes;
      __atomic_store_n(&m->cached_bytes, m->cached_bytes - spilled, __ATOMIC_RELAXED);
    }
    m->slot[c][m->n[c]++] = b;
    __atomic_store_n(&m->cached_bytes, m->cached_bytes + b->bytes, __ATOMIC_RELAXED);
    tier_mag_leave(m);
    if (n_spill) {
      sgm__lock_take(&p->lock);
      for (unsigned i = 0; i < n_spill; i++) sgm__pool_bag_add_locked(p, spill[i]);
      sgm__lock_drop(&p->lock);
    }
  } else {
    /* A large block goes back to the sub-allocator at the thread's next
     * large allocation: its node's line and its granules' are on their way
     * by then. Not a class block's: the magazine keeps it, and the prefetch
     * only took cache. It waits in the thread's stash (no pool lock); the
     * oldest stashed blocks go to their bags when the stash would pass its
     * bounds, and a block past them goes there itself. */
    __builtin_prefetch(b->node, 1);
    tier_vmm_prefetch(p, tier_ptr_of(b), b->bytes);
    tier_block *spill[TIER_STASH_SLOTS + 1];
    unsigned n_spill = 0;
    if (m && b->bytes <= (uint64_t)p->mag_flush_bytes) {
      tier_mag_enter(m);
      unsigned n = m->n_stash;
      uint64_t bytes = m->stash_bytes + b->bytes, spilled = 0;
      while (n == TIER_STASH_SLOTS || bytes > (uint64_t)p->mag_flush_bytes) {
        tier_block *old = m->stash[0];
        spill[n_spill++] = old;
        spilled += old->bytes;
        bytes -= old->bytes;
        memmove(m->stash, m->stash + 1, --n * sizeof m->stash[0]);
      }
      m->stash[n++] = b;
      m->stash_bytes = bytes;
      __atomic_store_n(&m->n_stash, (uint8_t)n, __ATOMIC_RELAXED);
      __atomic_store_n(&m->cached_bytes, m->cached_bytes + b->bytes - spilled, __ATOMIC_RELAXED);
      tier_mag_leave(m);
    } else {
      spill[n_spill++] = b;
    }
    if (n_spill) {
      sgm__lock_take(&p->lock);
      for (unsigned i = 0; i < n_spill; i++) sgm__pool_bag_add_locked(p, spill[i]);
      sgm__lock_drop(&p->lock);
    }
  }
  if (m) tier_mag_count(p, m, -(int64_t)asked);
  else tier_count_used(p, -(int64_t)asked, -1, 0, 1);
  return SGM_OK;
}

int sgm__tier_free_on(sgm_tier_pool *p, sgm_devptr ptr, const sgm_stream_ref *ref) {
  return tier_free_on_as(p, ptr, ref, false);
}

int sgm__tier_free_own_on(sgm_tier_pool *p, sgm_devptr ptr, const sgm_stream_ref *ref) {
  return tier_free_on_as(p, ptr, ref, true);
}

int sgm__tier_record_stream(sgm_tier_pool *p, sgm_devptr ptr, const sgm_stream_ref *ref) {
  /* BUSY keeps a concurrent free (a caller's race) from reading the list
   * while it is rewritten. */
  tier_block *b = sgm__pool_map_busy_live(p, ptr);
  if (!b) return SGM_ERR_INVALID;
  int rc = SGM_OK;
  if (ref->key != b->key) {
    bool known = false;
    size_t n = b->rec ? b->rec->n : 0;
    for (size_t i = 0; i < n && !known; i++) known = b->rec->ref[i].key == ref->key;
    if (!known) {
      tier_rec *r = realloc(b->rec, sizeof *r + (n + 1) * sizeof r->ref[0]);
      if (!r) {
        rc = SGM_ERR_NOMEM;
      } else {
        r->ref[n] = *ref;
        r->n = n + 1;
        b->rec = r;
        b->sized |= TIER_SIZED_REC;
      }
    }
  }
  sgm__pool_map_unbusy(b);
  if (rc == SGM_ERR_NOMEM)
    return sgm__error_set(SGM_ERR_NOMEM, "sgm_record_stream: out of host memory");
  return rc;
}

/* Is ptr a LIVE block of p (with own_only: one sgm took for itself)? */
static bool tier_owns_live(sgm_tier_pool *p, sgm_devptr ptr, bool own_only) {
  tier_block *b = sgm__pool_map_lookup(p, ptr);
  if (!b) return false;
  uint64_t tag = tier_tag_of(b);
  return (tag & ~TIER_TAG_FLAGS) == ptr && (tag & TIER_TAG_STATE) == TIER_LIVE &&
         (!own_only || (tag & TIER_OWN));
}

bool sgm__tier_owns(sgm_tier_pool *p, sgm_devptr ptr) { return tier_owns_live(p, ptr, false); }

bool sgm__tier_owns_own(sgm_tier_pool *p, sgm_devptr ptr) { return tier_owns_live(p, ptr, true); }

uint64_t sgm__tier_full_checks(void) { return tier_full_checks; }
