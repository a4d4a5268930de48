/*
 * map.c — the pool's live map: which record a device address belongs to.
 *
 * Job: keep the pool's address span (which pointers it may own), find a
 * block's record from its pointer on every free and
 * sgm_record_stream (lock-free), insert and unlink records as the
 * sub-allocator carves and takes back blocks, keep records type-stable
 * (spare lists) so that a reader holding a stale pointer reads a record, and
 * keep each thread's records on slabs of their own (lineages, pool.h).
 *
 * Locks: writers (insert, remove, replace, slabs, lineages, spare lists) hold
 * the pool lock; readers hold nothing and write no shared line: a record is
 * acted on only by a compare-and-swap of its tag.
 *
 * Calls: libc only (calloc for slot arrays, aligned_alloc for slabs,
 * sched_yield while a writer moves keys).
 */
#include "tiers/pool/pool.h"

/* ---- records and their lineages (pool.h, tier_lineage) ---- */

/* A lineage for a new magazine (pool lock held): a dead thread's, whole,
 * else a new one; 0 (the pool's) when out of host memory. */
uint32_t sgm__pool_lineage_take_locked(sgm_tier_pool *p) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  for (size_t i = 1; i < p->n_lin; i++)
    if (!p->lin[i].held) {
      p->lin[i].held = true;
      return (uint32_t)i;
    }
  if (p->n_lin == p->cap_lin) {
    size_t cap = 2 * p->cap_lin; /* at least 4 from the pool's create */
    tier_lineage *l = realloc(p->lin, cap * sizeof *l);
    if (!l) return 0;
    p->lin = l;
    p->cap_lin = cap;
  }
  p->lin[p->n_lin] = (tier_lineage){.held = true};
  return (uint32_t)p->n_lin++;
}

/* tier_record_new_locked past the lineage's spare records: with lend,
 * another lineage's spare record past the TIER_SPARE_KEEP it keeps, else one
 * cut from the lineage's slab or a new one (pool lock held); NULL when out
 * of host memory. */
tier_block *sgm__pool_record_cut_locked(sgm_tier_pool *p, uint32_t lin, bool lend) {
  sgm_assert_internal(sgm__lock_held(&p->lock) && lin < p->n_lin);
  for (size_t i = 0; lend && i < p->n_lin; i++) {
    tier_lineage *o = &p->lin[i];
    if (o->n_spare > TIER_SPARE_KEEP) {
      tier_block *b = o->spare;
      o->spare = b->next;
      o->n_spare--;
      return b;
    }
  }
  tier_slab_cursor *cur = &p->lin[lin].cur;
  if (!cur->slab || cur->used == TIER_SLAB_RECORDS) {
    if (!p->slab_batch || p->slab_batch_used == TIER_SLAB_BATCH) {
      char *batch = aligned_alloc(TIER_SLAB_BYTES, (size_t)TIER_SLAB_BYTES * TIER_SLAB_BATCH);
      if (!batch) return NULL;
      p->slab_batch = batch;
      p->slab_batch_used = 0;
    }
    tier_slab *s = (tier_slab *)(void *)(p->slab_batch + (size_t)TIER_SLAB_BYTES * p->slab_batch_used);
    memset(s, 0, TIER_SLAB_BYTES);
    s->batch_head = p->slab_batch_used++ == 0;
    s->next = p->slabs;
    s->lin = lin;
    p->slabs = s;
    cur->slab = s;
    p->n_slabs++;
    cur->used = 0;
  }
  return &cur->slab->rec[cur->used++];
}

/* Keep a record that may have been in the map for its lineage's next carve
 * (pool lock held); its tag goes to 0, so no reader matches it. */
void sgm__pool_spare_put_locked(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  __atomic_store_n(&b->tag, 0, __ATOMIC_RELEASE);
  tier_lineage *l = &p->lin[tier_slab_of(b)->lin];
  b->next = l->spare;
  l->spare = b;
  l->n_spare++;
}

static void tier_map_replace(sgm_tier_pool *p, tier_block *b, tier_block *nb);

/* Cached block b (out of every cache list), taken by a thread of lineage
 * lin: its record when that lineage's, else a record of lineage lin now
 * holding the same (the map finds it from now on, the old record goes back
 * to its own lineage). Pool lock held. Out of host memory, b stays as it
 * is: correct, only not kept apart. */
tier_block *sgm__pool_record_own_locked(sgm_tier_pool *p, tier_block *b, uint32_t lin) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  if (tier_slab_of(b)->lin == lin) return b;
  tier_block *nb = tier_record_new_locked(p, lin, false);
  if (!nb) return b;
  if (sgm_unlikely(((uintptr_t)nb & ~TIER_SLOT_REC) != 0)) { /* past what a slot holds */
    sgm__pool_spare_put_locked(p, nb);
    return b;
  }
  nb->next = NULL;
  nb->bytes = b->bytes;
  nb->sized = b->sized;
  nb->key = b->key;
  nb->handle = b->handle;
  nb->node = b->node;
  nb->rec = b->rec;
  __atomic_store_n(&nb->tag, tier_tag_of(b), __ATOMIC_RELEASE);
  tier_map_replace(p, b, nb);
  b->rec = NULL;
  b->sized = 0;
  sgm__pool_spare_put_locked(p, b);
  return nb;
}

/* ---- the live map ----
 *
 * Per shard, an array of one-word slots (record address, 16 bits of the
 * key's hash, distance from home: tier_slot), open addressing with linear
 * probing, at most half full: at 3/4 an insert probed about eight slots and
 * a removal shifted runs of four, 176 instructions in insert and remove per
 * large pair of alloc.churn.10k against 119 at 1/2 (issue 26). A lookup
 * reads slots until one's hash bits match, then that record's tag: a
 * chained table walked through the records (the chain link lived in each
 * record) touched 1.5-2 records per free, each a cache miss once 10,000
 * blocks are live (issue 26: the walk's loads were 37% of the churn pair's
 * time under perf). Slots held the address and the record side by side
 * (16 bytes) until the slot's load and the record's were each about a
 * seventh of the churn pair's time: one word per slot halves what the map
 * keeps in cache.
 *
 * Writers (insert, remove) hold the pool lock. Readers hold nothing and
 * write nothing shared: they probe with atomic loads and act on a record only
 * through a compare-and-swap of its tag, which holds the record's address, so
 * a record recycled for another block while a reader looked at it, or one
 * whose hash bits match by chance, never matches. Records are type-stable:
 * once in the map, a record goes to the pool's spare list, never to free(),
 * until the pool is destroyed, so a reader holding a stale pointer reads a
 * record, never freed memory. A probe that found nothing is believed only if
 * the shard's sequence number did not move meanwhile (removing a key shifts
 * the keys after it back, and a rebuild moves every key).
 */

/* Start loading the slot where ptr's insert will probe first, and answer
 * ptr's hash, which the insert then takes (sgm__pool_map_insert): a carve
 * issues this as soon as the sub-allocator names the block's address, so
 * that the load (the insert's cache miss) overlaps the rest of the carve.
 * Lock-free, and nothing waits for it. Issued at the top of sgm_free for the
 * lookup, 60 instructions before it, the same prefetch showed no gain that
 * this machine's noise let us measure, for 27 instructions more per pair. */
uint64_t sgm__pool_map_prefetch(sgm_tier_pool *p, sgm_devptr ptr, uint64_t bytes) {
  tier_block **big = tier_big_slot(p, ptr, bytes);
  if (big) {
    __builtin_prefetch(big, 1);
    return 0;
  }
  uint64_t h = tier_hash(ptr);
  tier_shard *s = tier_shard_of(p, h);
  size_t mask = __atomic_load_n(&s->mask, __ATOMIC_ACQUIRE);
  tier_table *t = __atomic_load_n(&s->table, __ATOMIC_ACQUIRE);
  if (t) __builtin_prefetch(&t->s[(h >> 6) & mask]);
  return h;
}

/* ---- the page map of large blocks ----
 *
 * In the reserved range (expandable growth, reserve mode) a block of at least
 * TIER_BIG_BYTES is found by its address: slot (ptr - vmm_base) >>
 * TIER_BIG_SHIFT holds its record. Two such blocks cannot start in the same
 * TIER_BIG_BYTES (the first would overlap the second), so a slot holds at most
 * one, and a live block's slot holds it from its carve to its release: a
 * lookup needs no sequence number. Writers hold the pool lock; readers load
 * the slot and compare the record's tag, as in the hashed map. The slots are
 * zeroed pages until a block lands there (calloc), 8 bytes per MiB of the
 * range.
 *
 * The hashed map kept every block: a large pair of alloc.churn.10k probed it
 * three times (the free's lookup, the release's removal with its shift of the
 * run after the slot, the carve's insert), 261 of its 1,414 instructions
 * (callgrind, issue 26). A lookup probes the hashed map first, then the page
 * map: looked up first, the page map's test (a bit per slot) cost every
 * small block's free, the common one, 17 instructions (alloc.pair.1t's ring:
 * 520 a pair against 503 before the page map; 512 this way round), and the
 * mixed churn missed the cache more (cachegrind: 8.46 read misses a pair
 * against 8.01).
 */

/* sgm__pool_map_lookup in the page map: tier_big_slot's test, less its
 * size check, and the slot's bit before the slot. Not inlined:
 * the free of a small block builds no frame for it. */
__attribute__((noinline)) static tier_block *tier_map_lookup_big(sgm_tier_pool *p, sgm_devptr ptr) {
  uint64_t i = (ptr - p->vmm_base) >> TIER_BIG_SHIFT;
  if (i < p->n_big_slots && (__atomic_load_n(&p->big_bits[i >> 6], __ATOMIC_ACQUIRE) >> (i & 63) & 1)) {
    tier_block *b = __atomic_load_n(&p->big[i], __ATOMIC_ACQUIRE);
    if (b && tier_ptr_of(b) == ptr) return b;
  }
  return NULL;
}

/* One probe of ptr's shard for its record (hash h): the record, NULL when
 * the probe found nothing while the shard's sequence number stood still,
 * TIER_PROBE_AGAIN when a writer moved keys meanwhile. */
#define TIER_PROBE_AGAIN ((tier_block *)(uintptr_t)1)
static inline tier_block *tier_map_probe(tier_shard *s, sgm_devptr ptr, uint64_t h) {
  unsigned seq = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
  if (seq & 1u) return TIER_PROBE_AGAIN;
  /* The mask before the table: tables only grow and a rebuild stores the
   * mask after its table, so the mask read is never larger than the
   * table's. */
  size_t mask = __atomic_load_n(&s->mask, __ATOMIC_ACQUIRE);
  tier_table *t = __atomic_load_n(&s->table, __ATOMIC_ACQUIRE);
  if (!t) return NULL;
  uint64_t fp = tier_slot_fp(h);
  for (size_t i = (h >> 6) & mask, k = 0; k <= mask; i = (i + 1) & mask, k++) {
    tier_slot v = __atomic_load_n(&t->s[i], __ATOMIC_ACQUIRE);
    if (v == 0) break;
    if (tier_slot_fp(v) != fp) continue;
    tier_block *b = tier_slot_rec(v);
    if (tier_ptr_of(b) == ptr) return b;
  }
  /* Every load above is an acquire, so this one cannot move before them. */
  return __atomic_load_n(&s->seq, __ATOMIC_RELAXED) == seq ? NULL : TIER_PROBE_AGAIN;
}

/* Probes after one that a writer disturbed. Not inlined: the lookup's one
 * probe keeps its registers for itself. With the retry loop around the
 * inlined probe the compiler kept an address per shard field and spilled:
 * 510 instructions per pair of alloc.pair.1t's ring against 484, and about 35
 * fewer per pair of alloc.churn.10k (callgrind, issue 26). */
__attribute__((noinline)) static tier_block *tier_map_probe_again(tier_shard *s, sgm_devptr ptr, uint64_t h) {
  tier_block *b;
  for (unsigned spins = 0; (b = tier_map_probe(s, ptr, h)) == TIER_PROBE_AGAIN; spins++)
    if (spins > 64) sched_yield();
  return b;
}

/* sgm__pool_map_lookup in the hashed map. */
static inline tier_block *tier_map_lookup_hashed(sgm_tier_pool *p, sgm_devptr ptr) {
  uint64_t h = tier_hash(ptr);
  tier_shard *s = tier_shard_of(p, h);
  tier_block *b = tier_map_probe(s, ptr, h);
  return sgm_likely(b != TIER_PROBE_AGAIN) ? b : tier_map_probe_again(s, ptr, h);
}

/* The record whose tag names ptr, NULL when there is none (lock-free): a
 * block is in one of the two maps, from its carve to its release. */
tier_block *sgm__pool_map_lookup(sgm_tier_pool *p, sgm_devptr ptr) {
  tier_block *b = tier_map_lookup_hashed(p, ptr);
  if (b) return b;
  return tier_map_lookup_big(p, ptr);
}

/* Set or clear page-map slot i's bit (pool lock held: the only writers). */
static void tier_big_bit(sgm_tier_pool *p, size_t i, bool on) {
  uint64_t *w = &p->big_bits[i >> 6], bit = UINT64_C(1) << (i & 63);
  __atomic_store_n(w, on ? *w | bit : *w & ~bit, __ATOMIC_RELEASE);
}

/* A seqlock without fences (TSan has none): the writer's stores between
 * begin and end are releases, so a reader that sees one also sees the odd
 * sequence number. */
static void tier_shard_write_begin(tier_shard *s) { __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED); }

static void tier_shard_write_end(tier_shard *s) { __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE); }

/* The slot word for record b, its key's hash h, d slots from home. */
static tier_slot tier_slot_make(uint64_t h, const tier_block *b, size_t d) {
  return tier_slot_fp(h) << TIER_SLOT_FP_SHIFT | (uint64_t)(uintptr_t)b |
         (d < TIER_SLOT_DIST ? d : TIER_SLOT_DIST);
}

/* Put b, its key's hash h, in the first empty slot of its probe (t private,
 * or the pool lock held). The slot keeps its distance from home
 * (TIER_SLOT_DIST, saturating), so that a removal moves keys back without
 * hashing them again. */
static void tier_table_put(tier_table *t, uint64_t h, tier_block *b) {
  size_t i = (h >> 6) & t->mask, d = 0;
  for (; t->s[i]; i = (i + 1) & t->mask) d++;
  __atomic_store_n(&t->s[i], tier_slot_make(h, b, d), __ATOMIC_RELEASE);
}

/* How far the key in slot i of t sits from its home slot (past what the slot
 * holds: from its record's address). */
static size_t tier_slot_dist(const tier_table *t, size_t i) {
  tier_slot v = t->s[i];
  if ((v & TIER_SLOT_DIST) != TIER_SLOT_DIST) return v & TIER_SLOT_DIST;
  size_t home = (tier_hash(tier_ptr_of(tier_slot_rec(v))) >> 6) & t->mask;
  return (i - home) & t->mask;
}

/* sgm__pool_map_insert and sgm__pool_map_remove in the hashed map. Not
 * inlined: a page-map write builds no frame for the probe. */
__attribute__((noinline)) static bool tier_map_insert_hashed(sgm_tier_pool *p, tier_block *b, uint64_t h) {
  sgm_assert_internal(h == tier_hash(tier_ptr_of(b)));
  tier_shard *s = tier_shard_of(p, h);
  tier_table *t = s->table;
  if (!t || 2 * (s->n + 1) > (t->mask + 1)) {
    size_t nb = t ? 2 * (t->mask + 1) : TIER_SHARD_SLOTS_MIN;
    tier_table *nt = calloc(1, sizeof *nt + nb * sizeof nt->s[0]);
    if (!nt && (!t || s->n + 1 > t->mask)) return false; /* a full table keeps one slot empty */
    if (nt) {
      nt->mask = nb - 1;
      nt->retired = t;
      for (size_t i = 0; t && i <= t->mask; i++)
        if (t->s[i]) {
          tier_block *x = tier_slot_rec(t->s[i]);
          tier_table_put(nt, tier_hash(tier_ptr_of(x)), x);
        }
      /* Readers of the old array see the sequence number move and look again. */
      tier_shard_write_begin(s);
      __atomic_store_n(&s->table, nt, __ATOMIC_RELEASE);
      __atomic_store_n(&s->mask, nt->mask, __ATOMIC_RELEASE);
      tier_shard_write_end(s);
      t = nt;
    }
  }
  /* Filling an empty slot hides nothing from a reader: no sequence step. */
  tier_table_put(t, h, b);
  __atomic_store_n(&s->n, s->n + 1, __ATOMIC_RELAXED);
  __atomic_store_n(&s->n_writes, s->n_writes + 1, __ATOMIC_RELAXED);
  return true;
}

/* The slot of t that holds b, whose key's hash is h (pool lock held). */
static inline size_t tier_slot_of(const tier_table *t, uint64_t h, const tier_block *b) {
  size_t i = (h >> 6) & t->mask;
  while (tier_slot_rec(t->s[i]) != b) {
    sgm_assert_internal(t->s[i] != 0);
    i = (i + 1) & t->mask;
  }
  return i;
}

/* The keys after b's slot in the run move back over the gap (no
 * tombstones), each to the nearest slot its probe reaches. */
__attribute__((noinline)) static void tier_map_remove_hashed(sgm_tier_pool *p, tier_block *b) {
  uint64_t h = tier_hash(tier_ptr_of(b));
  tier_shard *s = tier_shard_of(p, h);
  tier_table *t = s->table;
  size_t mask = t->mask, i = tier_slot_of(t, h, b);
  tier_shard_write_begin(s);
  for (size_t j = (i + 1) & mask; t->s[j]; j = (j + 1) & mask) {
    /* The key at j may fill the gap at i when its home is not in (i, j],
     * that is when it sits at least j - i slots from home. */
    size_t d = tier_slot_dist(t, j), gap = (j - i) & mask;
    if (d < gap) continue;
    d -= gap;
    __atomic_store_n(&t->s[i], (t->s[j] & ~TIER_SLOT_DIST) | (d < TIER_SLOT_DIST ? d : TIER_SLOT_DIST),
                     __ATOMIC_RELEASE);
    i = j;
  }
  __atomic_store_n(&t->s[i], 0, __ATOMIC_RELEASE);
  __atomic_store_n(&s->n, s->n - 1, __ATOMIC_RELAXED);
  __atomic_store_n(&s->n_writes, s->n_writes + 1, __ATOMIC_RELAXED);
  tier_shard_write_end(s);
}

/* Insert b, its tag and bytes already set (pool lock held); h is its
 * address's hash from sgm__pool_map_prefetch (unused in the page map). False
 * when out of memory. */
bool sgm__pool_map_insert(sgm_tier_pool *p, tier_block *b, uint64_t h) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  /* A record the slot word cannot hold (above 2^48): refused as host memory
   * sgm cannot use. */
  if (sgm_unlikely(((uintptr_t)b & ~TIER_SLOT_REC) != 0)) return false;
  tier_block **big = tier_big_slot(p, tier_ptr_of(b), b->bytes);
  if (!big) return tier_map_insert_hashed(p, b, h);
  sgm_assert_internal(*big == NULL);
  __atomic_store_n(big, b, __ATOMIC_RELEASE);
  tier_big_bit(p, (size_t)(big - p->big), true);
  p->n_big++;
  __atomic_store_n(&p->big_writes, p->big_writes + 1, __ATOMIC_RELAXED);
  return true;
}

/* Remove b (pool lock held); the caller makes it spare. */
void sgm__pool_map_remove(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  /* The address from the tag (the record's line), not from a caller's ptr. */
  tier_block **big = tier_big_slot(p, tier_ptr_of(b), b->bytes);
  if (!big) {
    tier_map_remove_hashed(p, b);
    return;
  }
  sgm_assert_internal(*big == b);
  tier_big_bit(p, (size_t)(big - p->big), false);
  __atomic_store_n(big, NULL, __ATOMIC_RELEASE);
  p->n_big--;
  __atomic_store_n(&p->big_writes, p->big_writes + 1, __ATOMIC_RELAXED);
}

/* Record nb takes b's place in the map, in b's slot (pool lock held): the
 * same key, so no key moves and no sequence step. A reader that loaded b
 * before finds its tag changed (0 once spare) and does not match it: b's
 * block is cached, so no free may take it anyway. */
static void tier_map_replace(sgm_tier_pool *p, tier_block *b, tier_block *nb) {
  tier_block **big = tier_big_slot(p, tier_ptr_of(b), b->bytes);
  if (big) {
    sgm_assert_internal(*big == b);
    __atomic_store_n(big, nb, __ATOMIC_RELEASE);
    __atomic_store_n(&p->big_writes, p->big_writes + 1, __ATOMIC_RELAXED);
    return;
  }
  uint64_t h = tier_hash(tier_ptr_of(b));
  tier_shard *s = tier_shard_of(p, h);
  tier_table *t = s->table;
  size_t i = tier_slot_of(t, h, b);
  __atomic_store_n(&t->s[i], (t->s[i] & ~TIER_SLOT_REC) | (uint64_t)(uintptr_t)nb, __ATOMIC_RELEASE);
  __atomic_store_n(&s->n_writes, s->n_writes + 1, __ATOMIC_RELAXED);
}

/* Move ptr's block from LIVE to CACHED; NULL when ptr is no live block
 * (with own: one sgm took for itself; without: one the user holds). */
tier_block *sgm__pool_map_take_live(sgm_tier_pool *p, sgm_devptr ptr, bool own) {
  uint64_t flags = own ? TIER_OWN : 0;
  for (unsigned spins = 0;; spins++) {
    tier_block *b = sgm__pool_map_lookup(p, ptr);
    if (!b) return NULL;
    uint64_t want = ptr | TIER_LIVE | flags;
    uint64_t tag = want;
    if (__atomic_compare_exchange_n(&b->tag, &tag, ptr | TIER_CACHED | flags, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return b;
    if ((tag & ~TIER_TAG_FLAGS) != ptr) continue; /* recycled meanwhile: look again */
    if (tag != (want | TIER_BUSY)) return NULL;  /* cached (freed twice), or the other owner's */
    if (spins > 64) sched_yield();                /* sgm_record_stream holds it a moment */
  }
}

/* Mark ptr's user-held block BUSY for sgm_record_stream; NULL when ptr is no
 * live user block. The caller ends with sgm__pool_map_unbusy. */
tier_block *sgm__pool_map_busy_live(sgm_tier_pool *p, sgm_devptr ptr) {
  for (unsigned spins = 0;; spins++) {
    tier_block *b = sgm__pool_map_lookup(p, ptr);
    if (!b) return NULL;
    uint64_t tag = ptr | TIER_LIVE;
    if (__atomic_compare_exchange_n(&b->tag, &tag, ptr | TIER_LIVE | TIER_BUSY, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return b;
    if ((tag & ~TIER_TAG_FLAGS) != ptr) continue;
    if (tag != (ptr | TIER_LIVE | TIER_BUSY)) return NULL;
    if (spins > 64) sched_yield();
  }
}

void sgm__pool_map_unbusy(tier_block *b) { __atomic_fetch_and(&b->tag, ~(uint64_t)TIER_BUSY, __ATOMIC_RELEASE); }

/* Widen the pool's address span to cover [base, base + bytes) (pool lock held,
 * or the pool not yet shared). Stored before any block of it is handed out. */
void sgm__pool_span_add(sgm_tier_pool *p, sgm_devptr base, uint64_t bytes) {
  if (base < __atomic_load_n(&p->head.span_lo, __ATOMIC_RELAXED))
    __atomic_store_n(&p->head.span_lo, base, __ATOMIC_RELAXED);
  if (base + bytes > __atomic_load_n(&p->head.span_hi, __ATOMIC_RELAXED))
    __atomic_store_n(&p->head.span_hi, base + bytes, __ATOMIC_RELAXED);
}

