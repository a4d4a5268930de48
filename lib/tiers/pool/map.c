/*
 * map.c — the pool's live map: which record a device address belongs to.
 *
 * Job: keep the pool's address span (which pointers it may own), find a
 * block's record from its pointer on every free and
 * sgm_record_stream (lock-free), insert and unlink records as the
 * sub-allocator carves and takes back blocks, and keep records type-stable
 * (spare list) so that a reader holding a stale pointer reads a record.
 *
 * Locks: writers (insert, remove, spare list) hold the pool lock; readers hold
 * nothing and write no shared line: a record is acted on only by a
 * compare-and-swap of its tag.
 *
 * Calls: libc only (calloc for bucket arrays, sched_yield while a writer
 * moves a chain).
 */
#include "tiers/pool/pool.h"

/* A new record, cut from the newest slab or a new one (pool lock held); NULL
 * when out of host memory. Records start on their own cache line: the
 * compare-and-swap of a free must not pull in a line holding another
 * thread's record. */
tier_block *sgm__pool_block_new(sgm_tier_pool *p) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  if (!p->slabs || p->slab_used == TIER_SLAB_RECORDS) {
    tier_slab *s = aligned_alloc(64, TIER_SLAB_BYTES);
    if (!s) return NULL;
    memset(s, 0, TIER_SLAB_BYTES);
    s->next = p->slabs;
    p->slabs = s;
    p->slab_used = 0;
  }
  return &p->slabs->rec[p->slab_used++];
}
/* ---- the live map ----
 *
 * Writers (insert, remove) hold the pool lock. Readers hold nothing and
 * write nothing shared: they walk a shard's chain with atomic loads and act
 * on a record only through a compare-and-swap of its tag, which holds the
 * record's address, so a record that was recycled for another block while a
 * reader looked at it never matches. Records are type-stable: once in the
 * map, a record goes to the pool's spare list, never to free(), until the
 * pool is destroyed, so a reader holding a stale pointer reads a record,
 * never freed memory. A walk that found nothing is believed only if the
 * shard's sequence number did not move meanwhile (a record unlinked or the
 * table rebuilt could have hidden the rest of the chain).
 */

/* Walks longer than this (only a walk misled by concurrent writers gets
 * near it) start over. */
#define TIER_MAP_MAX_WALK 4096

/* The record whose tag names ptr, NULL when there is none (lock-free). */
tier_block *sgm__pool_map_lookup(sgm_tier_pool *p, sgm_devptr ptr) {
  uint64_t h = tier_hash(ptr);
  tier_shard *s = tier_shard_of(p, h);
  for (unsigned spins = 0;; spins++) {
    if (spins > 64) sched_yield();
    unsigned seq = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
    if (seq & 1u) continue;
    tier_table *t = __atomic_load_n(&s->table, __ATOMIC_ACQUIRE);
    if (!t) return NULL;
    tier_block *b = __atomic_load_n(&t->b[(h >> 6) & t->mask], __ATOMIC_ACQUIRE);
    for (unsigned k = 0; b && k < TIER_MAP_MAX_WALK; k++) {
      if (tier_ptr_of(b) == ptr) return b;
      b = __atomic_load_n(&b->hnext, __ATOMIC_ACQUIRE);
    }
    /* Every load above is an acquire, so this one cannot move before them. */
    if (!b && __atomic_load_n(&s->seq, __ATOMIC_RELAXED) == seq) return NULL;
  }
}

/* A seqlock without fences (TSan has none): the writer's stores between
 * begin and end are releases, so a reader that sees one also sees the odd
 * sequence number. */
static void tier_shard_write_begin(tier_shard *s) { __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED); }

static void tier_shard_write_end(tier_shard *s) { __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE); }

/* Insert b, its tag already set (pool lock held); false when out of memory. */
bool sgm__pool_map_insert(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  uint64_t h = tier_hash(tier_ptr_of(b));
  tier_shard *s = tier_shard_of(p, h);
  tier_table *t = s->table;
  if (!t || s->n >= 2 * (t->mask + 1)) {
    size_t nb = t ? 2 * (t->mask + 1) : TIER_SHARD_BUCKETS_MIN;
    tier_table *nt = calloc(1, sizeof *nt + nb * sizeof nt->b[0]);
    if (!nt && !t) return false;
    if (nt) {
      nt->mask = nb - 1;
      nt->retired = t;
      /* Relinking moves records between chains under readers' feet: they
       * see the sequence number move and walk again. */
      tier_shard_write_begin(s);
      for (size_t i = 0; t && i <= t->mask; i++) {
        for (tier_block *x = t->b[i], *next; x; x = next) {
          next = x->hnext;
          size_t k = (tier_hash(tier_ptr_of(x)) >> 6) & nt->mask;
          __atomic_store_n(&x->hnext, nt->b[k], __ATOMIC_RELEASE);
          nt->b[k] = x;
        }
      }
      __atomic_store_n(&s->table, nt, __ATOMIC_RELEASE);
      tier_shard_write_end(s);
      t = nt;
    }
  }
  /* Prepending hides nothing from a reader: no sequence step. */
  tier_block **head = &t->b[(h >> 6) & t->mask];
  __atomic_store_n(&b->hnext, *head, __ATOMIC_RELAXED);
  __atomic_store_n(head, b, __ATOMIC_RELEASE);
  __atomic_store_n(&s->n, s->n + 1, __ATOMIC_RELAXED);
  __atomic_store_n(&s->n_writes, s->n_writes + 1, __ATOMIC_RELAXED);
  return true;
}

/* Unlink b (pool lock held); the caller makes it spare. */
void sgm__pool_map_remove(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  /* The address from the tag (the record's first line), not from ptr. */
  uint64_t h = tier_hash(tier_ptr_of(b));
  tier_shard *s = tier_shard_of(p, h);
  tier_table *t = s->table;
  tier_shard_write_begin(s);
  for (tier_block **pp = &t->b[(h >> 6) & t->mask]; *pp; pp = &(*pp)->hnext) {
    if (*pp == b) {
      __atomic_store_n(pp, b->hnext, __ATOMIC_RELEASE);
      __atomic_store_n(&s->n, s->n - 1, __ATOMIC_RELAXED);
      __atomic_store_n(&s->n_writes, s->n_writes + 1, __ATOMIC_RELAXED);
      break;
    }
  }
  tier_shard_write_end(s);
}

/* A record for a carve: a spare one, else NULL (pool lock held). */
tier_block *sgm__pool_spare_take_locked(sgm_tier_pool *p) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  tier_block *b = p->spare;
  if (b) p->spare = b->next;
  return b;
}

/* Keep a record that may have been in the map for the next carve (pool
 * lock held); its tag goes to 0, so no reader matches it. */
void sgm__pool_spare_put_locked(sgm_tier_pool *p, tier_block *b) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  __atomic_store_n(&b->tag, 0, __ATOMIC_RELEASE);
  b->next = p->spare;
  p->spare = b;
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

