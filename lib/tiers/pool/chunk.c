/*
 * chunk.c — chunks: what the pool takes from the backend and gives back,
 * and the sub-allocator side of every block.
 *
 * Job: take chunks (geometric growth, dedicated chunks for large blocks,
 * halving on device refusals), add them to the sub-allocator, detach and
 * return wholly free ones (for budget.c's trims), give freed blocks back to
 * the sub-allocator, explain a full budget, and list the chunks.
 *
 * Locks: the pool lock for the sub-allocator, the chunk list and the byte
 * counts; never held across a chunk_alloc / chunk_free (the bytes are
 * reserved in committed_bytes first, n_growing / n_releasing mark the call).
 *
 * Calls: the tier's chunk ops (backend), the sub-allocator, map.c (forget a
 * record, the address span), vmm.c (granule references), owe.c (streams
 * that owe are waited for before chunks go back).
 */
#include "tiers/pool/pool.h"

/* ---- the sub-allocator side (pool lock held) ---- */

/* Give a cached block back to the sub-allocator and forget it. */

void sgm__pool_release_block_locked(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  /* The node's neighbours, which the sub-allocator reads to coalesce, load
   * while the map and the granules are updated (a large free prefetched the
   * node itself). Only the record's first line: the address comes from the
   * tag, and the second line is written only when streams were recorded. */
  sgm__suballoc_prefetch_neighbours(b->node);
  sgm_devptr ptr = tier_ptr_of(b);
  sgm__pool_map_remove(p, b);
  if (p->vmm_range) sgm__pool_vmm_unref_locked(p, ptr, b->bytes);
  uint64_t sz = 0;
  int rc = sgm__suballoc_free_node(p->sa, b->node, &sz);
  sgm_assert_internal(rc == SGM_OK && sz == b->bytes);
  (void)rc;
  p->held_bytes -= b->bytes;
  p->n_blocks--;
  if (tier_recorded(b)) {
    free(b->rec);
    b->rec = NULL;
  }
  b->sized = 0;
  sgm__pool_spare_put_locked(p, b);
}

int sgm__pool_add_chunk_locked(sgm_tier_pool *p, const sgm_chunk *c) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  if (p->n_chunks == p->cap_chunks) {
    size_t cap = p->cap_chunks ? p->cap_chunks * 2 : 8;
    sgm_chunk *n = realloc(p->chunks, cap * sizeof *n);
    if (!n) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for chunk metadata");
    p->chunks = n;
    p->cap_chunks = cap;
  }
  int rc = sgm__suballoc_add_range(p->sa, c->base, c->bytes);
  if (rc != SGM_OK) return rc;
  sgm__pool_span_add(p, c->base, c->bytes);
  p->chunks[p->n_chunks] = *c;
  p->chunks[p->n_chunks].free_seen_ms = UINT64_MAX;
  p->n_chunks++;
  return SGM_OK;
}
/* ---- growth ---- */

/* Size of the next chunk for a block of need bytes (already aligned); 0 when
 * the budget has no room for it. Sets *dedicated. */
uint64_t sgm__pool_next_chunk_locked(sgm_tier_pool *p, uint64_t need, bool *dedicated) {
  if (p->committed_bytes >= p->p.budget_bytes) return 0;
  uint64_t remaining = p->p.budget_bytes - p->committed_bytes;
  uint64_t initial = p->p.growth_chunk_bytes;
  uint64_t max = p->p.max_chunk_bytes > initial ? p->p.max_chunk_bytes : initial;
  uint64_t geo = p->n_geometric >= 40 ? max : initial << p->n_geometric;
  if (geo > max) geo = max;
  *dedicated = need > geo;
  uint64_t size = *dedicated ? sgm__align_up(need, TIER_DEDICATED_GRANULE) : geo;
  if (size > remaining) size = remaining & ~(uint64_t)(SGM_DEVICE_ALIGN - 1);
  return size >= need ? size : 0;
}

/* Detach wholly free chunks (growth mode) into *out (malloc'd); returns count.
 * With idle_ms != UINT64_MAX only chunks seen free since now_ms - idle_ms go;
 * the others that are free are stamped as seen free now. */
size_t sgm__pool_detach_free_locked(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms,
                                    sgm_chunk **out) {
  *out = NULL;
  if (!p->p.growth) return 0;
  size_t n_free = 0;
  for (size_t i = 0; i < p->n_chunks; i++) {
    sgm_chunk *c = &p->chunks[i];
    if (!sgm__suballoc_range_is_free(p->sa, c->base)) {
      c->free_seen_ms = UINT64_MAX;
      continue;
    }
    if (idle_ms != UINT64_MAX) {
      if (c->free_seen_ms == UINT64_MAX || c->free_seen_ms > now_ms) {
        c->free_seen_ms = now_ms;
        continue;
      }
      if (now_ms - c->free_seen_ms < idle_ms) continue;
    }
    n_free++;
  }
  if (n_free == 0) return 0;
  sgm_chunk *list = malloc(n_free * sizeof *list);
  if (!list) return 0; /* trimming is best effort: keep the chunks */
  size_t k = 0, w = 0;
  for (size_t i = 0; i < p->n_chunks; i++) {
    sgm_chunk c = p->chunks[i];
    bool due = idle_ms == UINT64_MAX ||
               (c.free_seen_ms != UINT64_MAX && now_ms - c.free_seen_ms >= idle_ms);
    if (due && k < n_free && sgm__suballoc_try_remove_range(p->sa, c.base)) {
      list[k++] = c;
      if (!c.dedicated && p->n_geometric > 0) p->n_geometric--;
    } else {
      p->chunks[w++] = c;
    }
  }
  p->n_chunks = w;
  p->n_releasing += (unsigned)k; /* committed until sgm__pool_release_chunks drops them */
  *out = list;
  return k;
}

/* Give detached chunks back to the backend (lock not held); bytes returned. */
uint64_t sgm__pool_release_chunks(sgm_tier_pool *p, sgm_chunk *list, size_t n) {
  /* Streams that owe (owe.c) are waited for first; when one cannot be (it
   * captures), the driver's free waits for the work on the chunk itself. */
  if (n) sgm__pool_owed_settle(p);
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; i++) {
    p->p.ops->chunk_free(p, &list[i]);
    bytes += list[i].bytes;
  }
  free(list);
  if (n) {
    sgm__lock_take(&p->lock);
    p->committed_bytes -= bytes;
    p->n_releasing -= (unsigned)n;
    /* Growers that found the budget held by these chunks look again. */
    pthread_cond_broadcast(&p->grown);
    sgm__lock_drop(&p->lock);
  }
  return bytes;
}

/* Take a chunk of `bytes` for a block of `need` bytes from the backend (pool
 * lock not held). When the driver refuses it for lack of memory (other
 * processes use the GPU too, or the budget is larger than the card's free
 * memory), the chunk is retried at half the size, rounded up to the 64 KiB
 * granule, down to the smallest chunk the block fits in: only a request the
 * device cannot hold even alone is an out-of-memory (and may then fall back
 * one tier down). out->bytes is the size taken. */
int sgm__pool_take_chunk(sgm_tier_pool *p, uint64_t bytes, uint64_t need, sgm_chunk *out) {
  uint64_t floor = sgm__align_up(need, TIER_DEDICATED_GRANULE);
  if (floor > bytes) floor = bytes;
  for (;;) {
    int rc = p->p.ops->chunk_alloc(p, bytes, out);
    if (rc != SGM_ERR_NOMEM || bytes <= floor) return rc;
    uint64_t half = sgm__align_up(bytes / 2, TIER_DEDICATED_GRANULE);
    char a[32], b[32];
    sgm__log(p->p.verbose, 2, "%s: the device refused a %s chunk (%s); retrying with %s",
             sgm_tier_name(p->p.tier), sgm__fmt_bytes(bytes, a, sizeof a), sgm_last_error(),
             sgm__fmt_bytes(half > floor ? half : floor, b, sizeof b));
    bytes = half > floor ? half : floor;
  }
}

int sgm__tier_explain_budget(sgm_tier_pool *p, uint64_t size) {
  char a[32], b[32], u[32], c[32], l[32], k[32];
  sgm__lock_take(&p->lock);
  sgm_suballoc_stats st;
  sgm__suballoc_stats(p->sa, &st);
  const char *name = sgm_tier_name(p->p.tier);
  uint64_t cached = p->bag_bytes;
  for (tier_mag *m = p->mags; m; m = m->next) cached += __atomic_load_n(&m->cached_bytes, __ATOMIC_RELAXED);
  uint64_t in_use = p->held_bytes > cached ? p->held_bytes - cached : 0;
  /* The sub-allocator may span more than the budget (a reserved range):
   * only the part of a free block inside the budget can be had. */
  uint64_t room = p->p.budget_bytes > p->held_bytes ? p->p.budget_bytes - p->held_bytes : 0;
  uint64_t largest = st.largest_free_bytes < room ? st.largest_free_bytes : room;
  char why[448];
  if (p->budget_why[0])
    snprintf(why, sizeof why, "the budget is %s", p->budget_why); /* another process's doing */
  else
    snprintf(why, sizeof why, "free memory, or raise %s", p->p.limit_hint);
  sgm__error_set(SGM_ERR_NOMEM,
                        "%s budget exhausted: cannot allocate %s; budget %s, in use %s in %llu "
                        "blocks (and %s cached for streams whose work is still pending), "
                        "committed %s, largest free block within the budget %s (%s)",
                        name, sgm__fmt_bytes(size, a, sizeof a),
                        sgm__fmt_bytes(p->p.budget_bytes, b, sizeof b),
                        sgm__fmt_bytes(in_use, u, sizeof u), (unsigned long long)p->n_blocks,
                        sgm__fmt_bytes(cached, k, sizeof k),
                        sgm__fmt_bytes(tier_committed(p), c, sizeof c),
                        sgm__fmt_bytes(largest, l, sizeof l), why);
  sgm__lock_drop(&p->lock);
  return SGM_ERR_NOMEM;
}

size_t sgm__tier_chunks(sgm_tier_pool *p, sgm_chunk *out, size_t max) {
  sgm__lock_take(&p->lock);
  size_t n = p->n_chunks;
  for (size_t i = 0; i < n && i < max; i++) out[i] = p->chunks[i];
  sgm__lock_drop(&p->lock);
  return n;
}

bool sgm__tier_chunk_of(sgm_tier_pool *p, sgm_devptr ptr, sgm_chunk *out) {
  bool found = false;
  sgm__lock_take(&p->lock);
  for (size_t i = 0; i < p->n_chunks && !found; i++) {
    const sgm_chunk *c = &p->chunks[i];
    if (ptr >= c->base && ptr - c->base < c->bytes) {
      *out = *c;
      found = true;
    }
  }
  sgm__lock_drop(&p->lock);
  return found;
}

