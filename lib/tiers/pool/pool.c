/*
 * pool.c — a tier pool's life and its reports: create, destroy, stats and
 * the whole-pool invariant check.
 *
 * Job: create a pool (growth, expandable growth or reserve mode), destroy it
 * (wait for streams' work, detach every thread's magazine, return every chunk
 * and granule), sum the counters for stats, walk the pool in sgm__tier_check.
 *
 * Locks: the magazine registry then the pool lock at destroy; the pool lock
 * for stats and the check (the live map's shards are read atomically).
 *
 * Calls: map.c, owe.c (the final wait for what streams returned), vmm.c
 * (setup, teardown, check), chunk.c (reserve mode's chunk), mag.c (detach
 * magazines), reclaim.c (the final WAIT reclaim).
 */
#include "tiers/pool/pool.h"

static uint64_t tier_next_pool_id;
/* ---- create / destroy ---- */

/* The message when reserve mode cannot take the budget at create. */
static int tier_reserve_failed(const sgm_tier_params *params, int rc) {
  char b[32];
  return sgm__error_set(rc, "cannot reserve the %s budget of %s at create (growth mode off): %s; "
                        "lower SGM_VRAM_LIMIT / SGM_VRAM_FRACTION or set SGM_ALLOW_GROWTH=1",
                        sgm_tier_name(params->tier),
                        sgm__fmt_bytes(params->budget_bytes, b, sizeof b), sgm_last_error());
}

int sgm__tier_create(const sgm_tier_params *params, sgm_tier_pool **out) {
  *out = NULL;
  sgm_tier_pool *p = aligned_alloc(64, sgm__align_up(sizeof *p, 64));
  if (!p) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating the %s tier",
                                sgm_tier_name(params->tier));
  memset(p, 0, sizeof *p);
  /* Lineage 0, the pool's own records (pool.h, tier_lineage). */
  p->lin = calloc(4, sizeof *p->lin);
  if (!p->lin) {
    free(p);
    return sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating the %s tier", sgm_tier_name(params->tier));
  }
  p->cap_lin = 4;
  p->n_lin = 1;
  p->lin[0].held = true;
  p->p = *params;
  p->id = __atomic_add_fetch(&tier_next_pool_id, 1, __ATOMIC_RELAXED);
  sgm__fence_setup(); /* before any magazine of the pool: their owners read the mode */
  p->mag_flush_bytes = (int64_t)tier_mag_flush_bytes(params->budget_bytes);
  p->head.room_bytes = params->budget_bytes;
  p->head.span_lo = UINT64_MAX;
  p->idle_since_ms = UINT64_MAX;
  pthread_cond_init(&p->grown, NULL);
  sgm__lock_init(&p->lock, SGM_LOCK_TIER_VRAM + (int)params->tier);
  int rc = sgm__suballoc_create_unindexed(SGM_DEVICE_ALIGN, &p->sa);
  if (rc != SGM_OK) goto out_free;
  if (params->growth && params->budget_bytes > 0) sgm__pool_vmm_setup(p);
  /* Reserve mode: the budget's physical memory as a pool of granules mapped
   * where blocks land (a device with the virtual-memory API), else one
   * contiguous chunk. */
  if (!params->growth && params->budget_bytes > 0 && sgm__pool_vmm_setup(p)) {
    rc = sgm__pool_vmm_pool_setup(p);
    if (rc != SGM_OK) {
      rc = tier_reserve_failed(params, rc);
      sgm__pool_vmm_teardown(p);
      goto out_sa;
    }
  } else if (!params->growth && params->budget_bytes > 0) {
    /* Reserve mode: the whole budget as one contiguous range, so that any
     * block up to the budget fits. */
    sgm_chunk c = {0};
    rc = params->ops->chunk_alloc(p, params->budget_bytes, &c);
    if (rc != SGM_OK) {
      rc = tier_reserve_failed(params, rc);
      goto out_sa;
    }
    sgm__lock_take(&p->lock);
    rc = sgm__pool_add_chunk_locked(p, &c);
    if (rc == SGM_OK) p->committed_bytes = c.bytes;
    sgm__lock_drop(&p->lock);
    if (rc != SGM_OK) {
      params->ops->chunk_free(p, &c);
      goto out_sa;
    }
  }
  *out = p;
  return SGM_OK;

out_sa:
  sgm__suballoc_destroy(p->sa);
out_free:
  pthread_cond_destroy(&p->grown);
  sgm__lock_destroy(&p->lock);
  free(p->lin);
  free(p);
  return rc;
}

void sgm__tier_destroy(sgm_tier_pool *p) {
  if (!p) return;
  /* Threads' magazines: their blocks go to the bags; the threads free the
   * magazines themselves (they find them detached). */
  sgm__pool_mag_detach_all(p);
  sgm__tier_reclaim(p, NULL, SGM_RECLAIM_WAIT);
  sgm__pool_owed_settle(p); /* what streams returned to the sub-allocator (owe.c) */
  /* Blocks sgm itself still holds (none when the context is clean). */
  for (size_t i = 0; i < TIER_SHARDS; i++) {
    tier_table *t = p->shards[i].table;
    for (size_t k = 0; t && k <= t->mask; k++)
      if (t->s[k]) free(tier_slot_rec(t->s[k])->rec);
    while (t) {
      tier_table *r = t->retired;
      free(t);
      t = r;
    }
  }
  for (size_t i = 0; i < p->n_big_slots; i++)
    if (p->big[i]) free(p->big[i]->rec);
  /* A batch's slabs were taken first to last and the list is newest first:
   * its head, which frees the whole batch, comes after its other slabs. */
  for (tier_slab *s = p->slabs, *next; s; s = next) {
    next = s->next;
    if (s->batch_head) free(s);
  }
  for (tier_stream *s = p->streams, *next; s; s = next) {
    next = s->next;
    if (s->owe_ev) p->p.bops->event_destroy(p->p.be, s->owe_ev);
    free(s->owed);
    free(s);
  }
  for (size_t i = 0; i < p->n_events; i++) p->p.bops->event_destroy(p->p.be, p->events[i]);
  free(p->events);
  for (size_t i = 0; i < p->n_chunks; i++) p->p.ops->chunk_free(p, &p->chunks[i]);
  free(p->chunks);
  sgm__pool_vmm_teardown(p);
  sgm__suballoc_destroy(p->sa);
  pthread_cond_destroy(&p->grown);
  sgm__lock_destroy(&p->lock);
  free(p->lin);
  free(p);
}

const sgm_tier_params *sgm__tier_params(const sgm_tier_pool *p) { return &p->p; }

/* ---- stats and checks ---- */

uint64_t sgm__tier_lock_takes(const sgm_tier_pool *p) { return sgm__lock_takes(&p->lock); }

uint64_t sgm__tier_map_writes(const sgm_tier_pool *p) {
  uint64_t n = 0;
  for (size_t i = 0; i < TIER_SHARDS; i++) n += __atomic_load_n(&p->shards[i].n_writes, __ATOMIC_RELAXED);
  n += __atomic_load_n(&p->big_writes, __ATOMIC_RELAXED);
  return n;
}

void sgm__tier_stats(sgm_tier_pool *p, sgm_tier_stats *out) {
  memset(out, 0, sizeof *out);
  sgm__lock_take(&p->lock);
  out->budget_bytes = p->p.budget_bytes;
  out->committed_bytes = tier_committed(p);
  out->n_chunks = p->n_chunks + p->n_releasing; /* committed counts those being returned */
  /* Expandable growth: every granule is its own allocation of the driver's
   * (reserve mode: every granule of the pool). */
  if (p->vmm_range) out->n_chunks = (tier_committed(p) - p->external_bytes) >> p->vmm_shift;
  int64_t used = (int64_t)__atomic_load_n(&p->used_bytes, __ATOMIC_RELAXED);
  int64_t live = __atomic_load_n(&p->n_live, __ATOMIC_RELAXED);
  uint64_t allocs = __atomic_load_n(&p->n_allocs, __ATOMIC_RELAXED);
  uint64_t frees = __atomic_load_n(&p->n_frees, __ATOMIC_RELAXED);
  uint64_t cached = p->bag_bytes;
  for (tier_mag *m = p->mags; m; m = m->next) {
    used += __atomic_load_n(&m->d_used, __ATOMIC_RELAXED);
    uint64_t na = __atomic_load_n(&m->n_allocs, __ATOMIC_RELAXED);
    uint64_t nf = __atomic_load_n(&m->n_frees, __ATOMIC_RELAXED);
    live += (int64_t)(na - nf); /* a magazine's live blocks: its allocations less its frees */
    allocs += na;
    frees += nf;
    cached += __atomic_load_n(&m->cached_bytes, __ATOMIC_RELAXED);
  }
  sgm__lock_drop(&p->lock);
  /* Counts of several threads are summed unordered: clamp a transient minus. */
  out->used_bytes = used > 0 ? (uint64_t)used : 0;
  out->n_live = live > 0 ? (uint64_t)live : 0;
  uint64_t peak = __atomic_load_n(&p->peak_used_bytes, __ATOMIC_RELAXED);
  out->peak_used_bytes = peak > out->used_bytes ? peak : out->used_bytes;
  out->n_allocs = allocs;
  out->n_frees = frees;
  out->n_failed = __atomic_load_n(&p->n_failed, __ATOMIC_RELAXED);
  out->cached_bytes = cached;
}

bool sgm__tier_check(sgm_tier_pool *p) {
  bool ok = true;
  sgm__lock_take(&p->lock);
  uint64_t sum = 0;
  for (size_t i = 0; i < p->n_chunks; i++) sum += p->chunks[i].bytes;
  sgm_suballoc_stats st;
  sgm__suballoc_stats(p->sa, &st);
  size_t in_map = 0, bad_tags = 0;
  for (size_t i = 0; i < TIER_SHARDS; i++) {
    const tier_shard *sh = &p->shards[i];
    size_t walked = 0;
    for (size_t k = 0; sh->table && k <= sh->table->mask; k++) {
      tier_slot x = sh->table->s[k];
      if (!x) continue;
      walked++;
      tier_block *b = tier_slot_rec(x);
      uint64_t tag = tier_tag_of(b), st_bits = tag & TIER_TAG_STATE;
      /* Every slot holds a record that names an address whose hash bits
       * the slot keeps, is LIVE or CACHED, is the one a lock-free lookup of
       * its address finds, and keeps the sub-allocator's node of its block. */
      sgm_devptr ptr = tag & ~TIER_TAG_FLAGS;
      /* Its distance from home is the one the slot says (or farther when it
       * says TIER_SLOT_DIST). */
      uint64_t h = tier_hash(ptr);
      size_t home = (h >> 6) & sh->table->mask, d = (k - home) & sh->table->mask;
      uint64_t says = x & TIER_SLOT_DIST;
      bad_tags += says == TIER_SLOT_DIST ? d < TIER_SLOT_DIST : d != says;
      bad_tags += tier_slot_fp(x) != tier_slot_fp(h) || (st_bits != TIER_LIVE && st_bits != TIER_CACHED) ||
                  sgm__pool_map_lookup(p, ptr) != b || !sgm__suballoc_node_is(b->node, ptr, b->bytes);
    }
    in_map += sh->n;
    /* Every shard keeps an empty slot: probes end. */
    bad_tags += walked != sh->n || (sh->table && (sh->n > sh->table->mask || sh->mask != sh->table->mask));
  }
  /* The page map: a slot's bit says whether it holds a record; every record
   * in its block's slot, large enough, LIVE or CACHED, found by a lookup, its
   * node the sub-allocator's; none of them in the hashed map (they were
   * counted there if so: in_map would pass n_blocks). */
  size_t walked_big = 0;
  for (size_t i = 0; i < p->n_big_slots; i++) {
    tier_block *b = p->big[i];
    bad_tags += (bool)(p->big_bits[i >> 6] >> (i & 63) & 1) != (b != NULL);
    if (!b) continue;
    walked_big++;
    uint64_t tag = tier_tag_of(b), st_bits = tag & TIER_TAG_STATE;
    sgm_devptr ptr = tag & ~TIER_TAG_FLAGS;
    bad_tags += tier_big_slot(p, ptr, b->bytes) != &p->big[i] ||
                (st_bits != TIER_LIVE && st_bits != TIER_CACHED) || sgm__pool_map_lookup(p, ptr) != b ||
                !sgm__suballoc_node_is(b->node, ptr, b->bytes);
  }
  bad_tags += walked_big != p->n_big;
  in_map += p->n_big;
  /* Records (pool.h, tier_lineage): every one cut is in the map or spare in
   * the lineage of its slab, with tag 0; a lineage is held by one magazine at
   * most, lineage 0 by the pool. */
  size_t cut = 0, spare = 0, bad_lin = p->n_lin == 0 || !p->lin[0].held;
  for (const tier_slab *s = p->slabs; s; s = s->next) {
    bad_lin += s->lin >= p->n_lin;
    cut += s->lin < p->n_lin && p->lin[s->lin].cur.slab == s ? p->lin[s->lin].cur.used : TIER_SLAB_RECORDS;
  }
  for (size_t i = 0; i < p->n_lin; i++) {
    size_t n = 0;
    for (const tier_block *b = p->lin[i].spare; b; b = b->next, n++)
      bad_lin += tier_tag_of(b) != 0 || tier_slab_of(b)->lin != i;
    bad_lin += n != p->lin[i].n_spare;
    spare += n;
  }
  size_t held = 0;
  for (const tier_mag *m = p->mags; m; m = m->next) held += m->lin != 0 && m->lin < p->n_lin && p->lin[m->lin].held;
  for (size_t i = 1; i < p->n_lin; i++) held -= p->lin[i].held;
  bad_lin += held != 0 || cut != spare + in_map;
  uint64_t sealed_without_fence = 0, owing = 0, bad_owe = 0;
  for (tier_stream *s = p->streams; s; s = s->next) {
    if (s->sealed.n && !s->fence && !s->busy) sealed_without_fence++;
    /* What a stream owes (owe.c): counted in n_owing, never on a synchronous
     * backend; its events cover returns it made; takers only of an event. */
    owing += s->owe_done < s->owe_seq;
    bad_owe += s->owe_done > s->owe_seq || s->owe_ev_seq > s->owe_seq || s->fence_seq > s->owe_seq ||
               s->n_owe_takers > TIER_OWE_TAKERS || (s->n_owe_takers && !s->owe_ev) ||
               (p->p.bops->synchronous && s->owe_seq) ||
               ((s->n_owed || s->owed_all) && s->owe_done >= s->owe_seq);
  }
  if (!sgm__suballoc_check(p->sa)) {
    ok = false;
  } else if (p->committed_bytes > (p->vmm_pool ? sgm__pool_vmm_cap_locked(p) : p->p.budget_bytes) &&
             !p->budget_lowered) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: committed %llu > budget %llu",
                         sgm_tier_name(p->p.tier), (unsigned long long)p->committed_bytes,
                         (unsigned long long)p->p.budget_bytes);
  } else if (p->vmm_range && !sgm__pool_vmm_check_locked(p, &st)) {
    ok = false;
  } else if (!p->vmm_range && (sum > p->committed_bytes || st.capacity_bytes != sum ||
                               st.n_ranges != p->n_chunks)) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: chunks hold %llu bytes in %zu, sub-allocator %llu "
                         "in %llu, committed %llu", sgm_tier_name(p->p.tier),
                         (unsigned long long)sum, p->n_chunks,
                         (unsigned long long)st.capacity_bytes, (unsigned long long)st.n_ranges,
                         (unsigned long long)p->committed_bytes);
  } else if (st.used_bytes != p->held_bytes - p->external_bytes || st.n_live != p->n_blocks ||
             in_map != p->n_blocks) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: holding %llu bytes in %llu blocks (%zu mapped), "
                         "sub-allocator %llu/%llu",
                         sgm_tier_name(p->p.tier), (unsigned long long)p->held_bytes,
                         (unsigned long long)p->n_blocks, in_map, (unsigned long long)st.used_bytes,
                         (unsigned long long)st.n_live);
  } else if (bad_tags) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: %zu records of the live map have a wrong tag or "
                         "sub-allocator node, or cannot be found by their address",
                         sgm_tier_name(p->p.tier), bad_tags);
  } else if (bad_lin) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: records cut %zu, in the map %zu, spare %zu, or a "
                         "lineage held by no magazine or spare records in the wrong lineage",
                         sgm_tier_name(p->p.tier), cut, in_map, spare);
  } else if (sealed_without_fence) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: %llu streams hold sealed blocks without a fence",
                         sgm_tier_name(p->p.tier), (unsigned long long)sealed_without_fence);
  } else if (owing != p->n_owing || bad_owe) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: %llu streams owe, %zu counted; %llu streams with a "
                         "wrong owe state", sgm_tier_name(p->p.tier), (unsigned long long)owing,
                         p->n_owing, (unsigned long long)bad_owe);
  }
  sgm__lock_drop(&p->lock);
  return ok;
}
