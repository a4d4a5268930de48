/*
 * reclaim.c — the reclaim passes: cached memory back where an allocation
 * can use it, in the order DESIGN.md §8 sets, and a stream's own cache
 * returned for its own use (issue 26).
 *
 * Job: run a reclaim for a taker (TRANSFER: other streams' caches by a
 * device-side wait, xfer.c; QUERY: what the device is seen done with; WAIT:
 * everything, bag.c's fences), settle the granules after it, return the
 * bags at once on a synchronous backend, and hand a stream's own cached
 * blocks (its bags and the calling thread's magazine blocks of it) straight
 * back to the sub-allocator with no event, remembering the memory it now
 * owes (owe.c).
 *
 * Locks: the pool lock for the bags, the stream list and the owe state;
 * magazines stopped under it (pool.h); driver calls (records, queries, waits) are
 * made by bag.c and xfer.c with it dropped.
 *
 * Calls: bag.c (fences, releasing bags), xfer.c (transfers), mag.c
 * (draining and finding magazines), chunk.c (blocks back to the
 * sub-allocator), vmm.c (settle), stream.c.
 */
#include "tiers/pool/pool.h"

static size_t tier_reclaim_want(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode,
                                const tier_want *w);

/* s returned block b: remember its range while s owes (past
 * TIER_OWED_RANGES_MAX, or out of memory: everything counts as owed). */
static void tier_owed_note(tier_stream *s, const tier_block *b) {
  if (s->owed_all) return;
  if (s->n_owed == s->cap_owed) {
    uint32_t cap = s->cap_owed ? s->cap_owed * 2 : 64;
    tier_range *n = cap <= TIER_OWED_RANGES_MAX ? realloc(s->owed, cap * sizeof *n) : NULL;
    if (!n) {
      s->owed_all = true;
      return;
    }
    s->owed = n;
    s->cap_owed = cap;
  }
  sgm_devptr ptr = tier_ptr_of(b);
  s->owed[s->n_owed++] = (tier_range){ptr, ptr + b->bytes};
}

/* The calling thread's blocks of stream s in its magazine m go back to the
 * sub-allocator, remembered as owed (pool lock held: no reclaimer takes m
 * meanwhile): its stash of large blocks, and with slots its class blocks.
 * How many. */
static size_t tier_mag_return_locked(sgm_tier_pool *p, tier_mag *m, tier_stream *s, bool slots) {
  uint64_t key = s->ref.key;
  size_t n = 0;
  uint64_t bytes = 0;
  unsigned kept = 0;
  for (unsigned i = 0; i < m->n_stash; i++) {
    tier_block *b = m->stash[i];
    if (b->key != key) {
      m->stash[kept++] = b;
      continue;
    }
    bytes += b->bytes;
    m->stash_bytes -= b->bytes;
    n++;
    tier_owed_note(s, b);
    sgm__pool_release_block_locked(p, b);
  }
  __atomic_store_n(&m->n_stash, (uint8_t)kept, __ATOMIC_RELAXED);
  for (int c = 0; slots && c < TIER_N_CLASSES; c++) {
    unsigned w = 0;
    for (unsigned i = 0; i < m->n[c]; i++) {
      tier_block *b = m->slot[c][i];
      if (b->key != key) {
        m->slot[c][w++] = b;
        continue;
      }
      bytes += b->bytes;
      n++;
      tier_owed_note(s, b);
      sgm__pool_release_block_locked(p, b);
    }
    m->n[c] = (uint8_t)w;
  }
  __atomic_store_n(&m->cached_bytes, m->cached_bytes - bytes, __ATOMIC_RELAXED);
  return n;
}

/* Remember every block of bag g as owed by s (nothing to walk once
 * everything counts as owed). */
static void tier_bag_note(tier_stream *s, const tier_bag *g) {
  for (int c = -1; c < TIER_N_CLASSES && !s->owed_all; c++)
    for (const tier_block *b = c < 0 ? g->large : g->cls[c]; b && !s->owed_all; b = b->next)
      tier_owed_note(s, b);
}

/*
 * The allocating stream ref's own cached blocks straight back to the
 * sub-allocator (pool lock held, may be dropped and retaken to pool a
 * fence): its open bag, its sealed bag unless a thread records or queries
 * its fence now, the calling thread's stash blocks of ref, and with mags its
 * magazine's class blocks of ref. Not on a synchronous backend (nothing is
 * pending there: bag.c returns the bags), for sgm's own allocations (ref
 * NULL), or while ref was seen capturing. true when any block went back (ref
 * now owes).
 *
 * mags is for a carve that found no room (the budget's or the
 * sub-allocator's); a carve that would only map new granules, or a large
 * one placed after the caches, leaves the class blocks in the magazine, as
 * the emulated device's path does (alloc.c, tier_carve): emptying every
 * class of the thread's magazine there made a single-threaded 64-block ring
 * of 256 B-1 MiB take the slow path at 17% of its pairs (each class's next
 * allocation carved under the pool lock, and the carves soon needed new
 * granules again), 1.35-1.56e7 pairs/s against 2.0-2.2e7 with the magazine
 * kept, on the driver double. What it cost in memory, CUDA over the double
 * against the emulated device on the traces (committed / peak live): the
 * synthetic transformer 1.004 -> 1.024 (emu 1.010), resnet50 1.007 -> 1.030
 * (emu 1.027), pangu_2.6B 1.083 -> 1.089 (emu 1.087) and its second pass's
 * driver calls 0.0034 -> 0.0089 per event (issue 26; docs/streams.md).
 */
bool sgm__pool_owed_return_locked(sgm_tier_pool *p, const sgm_stream_ref *ref, bool mags) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  if (!ref || p->p.bops->synchronous) return false;
  tier_stream *s = sgm__pool_stream_find_locked(p, ref->key);
  tier_mag *m = sgm__pool_mag_find(p);
  bool in_mag = false;
  for (unsigned i = 0; m && i < m->n_stash && !in_mag; i++) in_mag = m->stash[i]->key == ref->key;
  for (int c = 0; m && mags && c < TIER_N_CLASSES && !in_mag; c++)
    for (unsigned i = 0; i < m->n[c] && !in_mag; i++) in_mag = m->slot[c][i]->key == ref->key;
  bool in_bags = s && (s->open.n || (!s->busy && s->sealed.n));
  if ((s && s->capturing) || (!in_mag && !in_bags)) return false;
  if (!s && !(s = sgm__pool_stream_get_locked(p, ref))) return false; /* no record: keep them */
  size_t n = in_mag ? tier_mag_return_locked(p, m, s, mags) : 0;
  size_t n_bag = s->open.n;
  uint64_t bag_bytes = s->open.bytes;
  tier_bag_note(s, &s->open);
  sgm__pool_bag_release_locked(p, &s->open);
  void *fence = NULL;
  if (!s->busy && s->sealed.n) {
    n_bag += s->sealed.n;
    bag_bytes += s->sealed.bytes;
    tier_bag_note(s, &s->sealed);
    sgm__pool_bag_release_locked(p, &s->sealed);
    /* The fence covers nothing now; pooled again below. */
    fence = s->fence;
    s->fence = NULL;
    s->crossed_fence = NULL;
  }
  sgm__pool_bagged_add_locked(p, -(int64_t)n_bag, -(int64_t)bag_bytes);
  n += n_bag;
  if (!tier_owes(s)) __atomic_store_n(&p->n_owing, p->n_owing + 1, __ATOMIC_RELAXED);
  s->owe_seq++;
  tier_update_room_locked(p);
  if (fence) sgm__pool_event_put_locked(p, fence);
  return n > 0;
}

size_t sgm__tier_reclaim(sgm_tier_pool *p, const sgm_stream_ref *taker, sgm_reclaim_mode mode) {
  return sgm__pool_reclaim_settle(p, taker, mode, NULL);
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

/* With mags, drain every thread's magazine into its stream's bag; then give
 * back what the device is done with (mode QUERY or WAIT; TRANSFER stops
 * after the drain, where a synchronous backend has given everything back). */
size_t sgm__pool_reclaim_some(sgm_tier_pool *p, bool mags, sgm_reclaim_mode mode) {
  size_t n_done = 0;
  sgm__lock_take(&p->lock);
  if (mags && p->mags) {
    sgm__pool_mags_stop_locked(p, NULL);
    for (tier_mag *m = p->mags; m; m = m->next) sgm__pool_mag_drain_locked(p, m);
    sgm__pool_mags_go_locked(p, NULL);
  }
  if (p->p.bops->synchronous) {
    n_done = sgm__pool_bags_release_all_locked(p);
    sgm__lock_drop(&p->lock);
    return n_done;
  }
  sgm__lock_drop(&p->lock);
  if (mode == SGM_RECLAIM_TRANSFER) return 0;
  n_done += sgm__pool_reclaim_fences(p, mode);
  if (mode == SGM_RECLAIM_WAIT) {
    /* The first round sealed what was open; the second waits for the fences
     * of streams that already had one. */
    n_done += sgm__pool_reclaim_fences(p, mode);
    n_done += sgm__pool_reclaim_fences(p, mode);
  }
  return n_done;
}
