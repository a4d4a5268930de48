/*
 * vmm.c — expandable growth on one reserved range (issue 17): map memory
 * behind the sub-allocator's range, in mappings of whole granules.
 *
 * Job: reserve the range at create (and in reserve mode take the budget's
 * granules as a pool), map the granules a carved block first touches (in
 * mappings of up to TIER_VMM_MAP_MAX_GRANULES neighbours, one backend call
 * each, unmapped whole), count each granule's references and each mapping's
 * granules in use, unmap free mappings when they pass the slack, on trim and
 * on idle trim, and check the granule invariants.
 *
 * Locks: the pool lock for the granule table and the counts; a granule's busy
 * flag owns it while a thread maps or unmaps it without the lock (driver
 * calls are never made under it); waiters sleep on the pool's `grown`
 * condition.
 *
 * Calls: the backend's virtual-memory operations (vmm_*), map.c (the
 * address span), owe.c (streams that owe are waited for before unmapping).
 */
#include "tiers/pool/pool.h"

/* ---- expandable growth on one reserved range (issue 17) ---- */

static inline uint64_t tier_vmm_granule(const sgm_tier_pool *p) { return UINT64_C(1) << p->vmm_shift; }

/* Granule g is mapped or not: its flag and its bit (pool lock held). */
static inline void tier_vmm_set_mapped(sgm_tier_pool *p, size_t g, bool on) {
  p->gran[g].mapped = on;
  if (on) p->vmm_bits[g >> 6] |= UINT64_C(1) << (g & 63);
  else p->vmm_bits[g >> 6] &= ~(UINT64_C(1) << (g & 63));
}

/* Word w of the mapped bits inverted, limited to granules [g0, g1]: a bit
 * set for each of them in the word with no memory mapped. */
static inline uint64_t tier_vmm_unmapped_word(const sgm_tier_pool *p, size_t w, size_t g0, size_t g1) {
  uint64_t x = ~p->vmm_bits[w];
  if (w == g0 >> 6) x &= ~UINT64_C(0) << (g0 & 63);
  if (w == g1 >> 6) x &= ~UINT64_C(0) >> (63 - (g1 & 63));
  return x;
}

/* Granules of [g0, g1] with no memory mapped (pool lock held): a word of
 * bits at a time, not a look at each granule's record (the split's end hook
 * asks twice per carve). Mapped granules, the common case, cost nothing: the
 * count steps over unmapped bits only (the x86-64 baseline has no popcount
 * instruction). */
static inline size_t tier_vmm_count_unmapped(const sgm_tier_pool *p, size_t g0, size_t g1) {
  size_t n = 0;
  for (size_t w = g0 >> 6; w <= g1 >> 6; w++)
    for (uint64_t x = tier_vmm_unmapped_word(p, w, g0, g1); x; x &= x - 1) n++;
  return n;
}

/* Every granule of [g0, g1] has memory mapped (pool lock held): a word of
 * bits at a time, stopping at the first that lacks one. */
static inline bool tier_vmm_all_mapped(const sgm_tier_pool *p, size_t g0, size_t g1) {
  for (size_t w = g0 >> 6; w <= g1 >> 6; w++)
    if (tier_vmm_unmapped_word(p, w, g0, g1)) return false;
  return true;
}

/* Free mapped granules past which they are unmapped before more are
 * mapped: the slack (committed / 32, at least TIER_VMM_SLACK_GRANULES), or,
 * when more, those that keep committed within the peak (TIER_VMM_PEAK_SHIFT:
 * the highest held bytes since free granules were last all unmapped, plus
 * 1/64). While committed is within the peak, no free granule goes. */
static inline uint64_t tier_vmm_slack(const sgm_tier_pool *p) {
  uint64_t committed = p->committed_bytes >> p->vmm_shift;
  uint64_t slack = committed >> TIER_VMM_SLACK_SHIFT;
  if (slack < TIER_VMM_SLACK_GRANULES) slack = TIER_VMM_SLACK_GRANULES;
  uint64_t peak = (p->vmm_held_peak + (p->vmm_held_peak >> TIER_VMM_PEAK_SHIFT)) >> p->vmm_shift;
  uint64_t in_use = committed - p->vmm_free_mapped;
  uint64_t room = peak > in_use ? peak - in_use : 0;
  return room > slack ? room : slack;
}

/* Granules per page: committed / 2^TIER_VMM_PAGE_SHIFT granules, rounded
 * down to a power of two, from 1 to TIER_VMM_PAGE_MAX_GRANULES; 1 (no
 * pages) in reserve mode, whose granules come from the pool one by one. */
static inline size_t tier_vmm_page(const sgm_tier_pool *p) {
  if (p->vmm_pool) return 1;
  uint64_t want = (p->committed_bytes >> p->vmm_shift) >> TIER_VMM_PAGE_SHIFT;
  size_t page = 1;
  while (page * 2 <= want && page * 2 <= TIER_VMM_PAGE_MAX_GRANULES) page *= 2;
  return page;
}

/* Granule g has no memory and nobody maps or unmaps it: a map may claim it. */
static inline bool tier_vmm_claimable_locked(const sgm_tier_pool *p, size_t g) {
  return !p->gran[g].mapped && !p->gran[g].busy;
}

/* The sub-allocator splits a free block: cut the new block from the end
 * whose granules need less mapping; the same: the default (pool lock held). */
static int tier_vmm_end_hook(void *arg, uint64_t low, uint64_t high, uint64_t size) {
  const sgm_tier_pool *p = arg;
  size_t l0, l1, h0, h1;
  tier_vmm_span(p, low, size, &l0, &l1);
  tier_vmm_span(p, high, size, &h0, &h1);
  /* The whole free block mapped (a busy program's steady state): both ends
   * alike, one look instead of two counts. */
  if (tier_vmm_all_mapped(p, l0, h1)) return 0;
  size_t a = tier_vmm_count_unmapped(p, l0, l1), b = tier_vmm_count_unmapped(p, h0, h1);
  return a < b ? -1 : a > b ? 1 : 0;
}

/* No page map of large blocks (map.c): its slots and bits freed, every
 * block in the hashed map (n_big_slots 0 is what lookups test). */
static void tier_big_drop(sgm_tier_pool *p) {
  free(p->big);
  free(p->big_bits);
  p->big = NULL;
  p->big_bits = NULL;
  p->n_big_slots = 0;
}

/* The most that may be mapped: the budget, and in reserve mode also the pool. */
uint64_t sgm__pool_vmm_cap_locked(const sgm_tier_pool *p) {
  if (!p->vmm_pool) return p->p.budget_bytes;
  /* The pool: the budget rounded down to whole granules. */
  uint64_t pool = (uint64_t)p->n_pool << p->vmm_shift;
  return pool < p->p.budget_bytes ? pool : p->p.budget_bytes;
}

static void tier_vmm_free_mapped_add_locked(sgm_tier_pool *p, int64_t d) {
  __atomic_store_n(&p->vmm_free_mapped, p->vmm_free_mapped + (uint64_t)d, __ATOMIC_RELAXED);
}

/* Granule g gains a block. When it is mapped (and nobody maps or unmaps it
 * now) and was touched by none, its mapping has one more granule in use; a
 * mapping that had none is no longer free. */
static inline void tier_vmm_ref_locked(sgm_tier_pool *p, size_t g) {
  tier_granule *x = &p->gran[g];
  if (x->refs++ == 0 && x->mapped && !x->busy) {
    tier_granule *h = &p->gran[x->head];
    if (h->used++ == 0) tier_vmm_free_mapped_add_locked(p, -(int64_t)h->len);
  }
}

/* Granule g loses a block; a mapping none of whose granules is touched any
 * more is free (counted in vmm_free_mapped, whole). */
static inline void tier_vmm_unref_one_locked(sgm_tier_pool *p, size_t g) {
  tier_granule *x = &p->gran[g];
  sgm_assert_internal(x->refs > 0);
  if (--x->refs == 0 && x->mapped && !x->busy) {
    tier_granule *h = &p->gran[x->head];
    sgm_assert_internal(h->used > 0);
    if (--h->used == 0) tier_vmm_free_mapped_add_locked(p, (int64_t)h->len);
  }
}

/* The claimed granules [g, e) are mapped now, as one mapping: record it,
 * and count it free when no block touches it (one that claimed them failed
 * meanwhile). */
static void tier_vmm_mapped_locked(sgm_tier_pool *p, size_t g, size_t e) {
  sgm_assert_internal(e > g && e - g <= TIER_VMM_MAP_MAX_GRANULES);
  uint8_t used = 0;
  for (size_t k = g; k < e; k++) {
    p->gran[k].busy = 0;
    tier_vmm_set_mapped(p, k, true);
    p->gran[k].head = (uint32_t)g;
    used += p->gran[k].refs > 0;
  }
  p->gran[g].len = (uint8_t)(e - g);
  p->gran[g].used = used;
  if (used == 0) tier_vmm_free_mapped_add_locked(p, (int64_t)(e - g));
}

/* A block left the sub-allocator: its granules lose a reference. */
void sgm__pool_vmm_unref_locked(sgm_tier_pool *p, uint64_t off, uint64_t bytes) {
  size_t g0, g1;
  tier_vmm_span(p, off, bytes, &g0, &g1);
  for (size_t g = g0; g <= g1; g++) tier_vmm_unref_one_locked(p, g);
}

/* A carve's first look at the granules of its block [off, off + bytes): when
 * every one is mapped and nobody maps or unmaps it (a busy program's steady
 * state), reference them and answer true: the block is backed, and
 * sgm__pool_vmm_back_locked has nothing to do. Else take no reference, set
 * *unmapped to the bytes with no memory behind them now, and answer false.
 * One walk of the granules in the common case, where a count of the unmapped
 * ones and then back_locked's references walked them twice (issue 26). */
bool sgm__pool_vmm_ref_backed_locked(sgm_tier_pool *p, uint64_t off, uint64_t bytes, uint64_t *unmapped) {
  size_t g0, g1;
  tier_vmm_span(p, off, bytes, &g0, &g1);
  for (size_t g = g0; g <= g1; g++) {
    if (sgm_likely(p->gran[g].mapped && !p->gran[g].busy)) {
      tier_vmm_ref_locked(p, g);
      continue;
    }
    while (g-- > g0) tier_vmm_unref_one_locked(p, g);
    *unmapped = (uint64_t)tier_vmm_count_unmapped(p, g0, g1) << p->vmm_shift;
    return false;
  }
  *unmapped = 0;
  return true;
}

/* Runs of granules [g, e) that one backend call maps or unmaps together, at
 * most this many: the CUDA backend enters the context and relaxes the
 * capture mode once per call, three driver calls that a call per run paid
 * each time (issue 26). */
#define TIER_VMM_BATCH 16

typedef struct tier_run {
  size_t g, e; /* granules [g, e) */
} tier_run;

/* The backend's form of n runs (byte offsets in the range), counted as
 * n map or unmap calls as a call per run would be. */
static void tier_vmm_backend_runs(sgm_tier_pool *p, const tier_run *runs, size_t n,
                                  sgm_vmm_run *out) {
  sgm_assert_internal(n <= TIER_VMM_BATCH);
  for (size_t i = 0; i < n; i++) {
    out[i].offset = (uint64_t)runs[i].g << p->vmm_shift;
    out[i].bytes = (uint64_t)(runs[i].e - runs[i].g) << p->vmm_shift;
  }
  __atomic_fetch_add(&p->vmm_calls, n, __ATOMIC_RELAXED);
}

/* Unmap granules [g, e) of the range: their memory goes back to the driver
 * (growth) or stays in the pool (reserve mode). No lock held. */
static void tier_vmm_unmap_run(sgm_tier_pool *p, size_t g, size_t e) {
  uint64_t off = (uint64_t)g << p->vmm_shift, bytes = (uint64_t)(e - g) << p->vmm_shift;
  __atomic_fetch_add(&p->vmm_calls, 1, __ATOMIC_RELAXED);
  if (p->vmm_pool) p->p.bops->vmm_pool_unmap(p->p.be, p->vmm_range, off, bytes);
  else p->p.bops->vmm_unmap(p->p.be, p->vmm_range, off, bytes);
}

/* Unmap n runs, in one backend call where the backend has one (growth mode). */
static void tier_vmm_unmap_runs(sgm_tier_pool *p, const tier_run *runs, size_t n) {
  if (p->vmm_pool || !p->p.bops->vmm_unmap_runs) {
    for (size_t i = 0; i < n; i++) tier_vmm_unmap_run(p, runs[i].g, runs[i].e);
    return;
  }
  sgm_vmm_run r[TIER_VMM_BATCH];
  tier_vmm_backend_runs(p, runs, n, r);
  p->p.bops->vmm_unmap_runs(p->p.be, p->vmm_range, r, n);
}

/* Map the claimed granules [g, e) (busy 2; their pool granules in phys):
 * the backend's call, in pieces of at most 64 granules in reserve mode. */
static int tier_vmm_map_run(sgm_tier_pool *p, size_t g, size_t e) {
  __atomic_fetch_add(&p->vmm_calls, 1, __ATOMIC_RELAXED);
  if (!p->vmm_pool)
    return p->p.bops->vmm_map(p->p.be, p->vmm_range, (uint64_t)g << p->vmm_shift,
                              (uint64_t)(e - g) << p->vmm_shift);
  uint32_t idx[64];
  for (size_t a = g; a < e;) {
    size_t n = e - a < 64 ? e - a : 64;
    for (size_t k = 0; k < n; k++) idx[k] = p->gran[a + k].phys;
    int rc = p->p.bops->vmm_pool_map(p->p.be, p->vmm_range, (uint64_t)a << p->vmm_shift,
                                     p->vmm_pool, idx, n);
    if (rc != SGM_OK) {
      if (a > g) tier_vmm_unmap_run(p, g, a); /* all or nothing, as vmm_map */
      return rc;
    }
    a += n;
  }
  return SGM_OK;
}

/* Map n claimed runs in order, in one backend call where the backend has
 * one (growth mode); stops at the first failure: *done runs are mapped. */
static int tier_vmm_map_runs(sgm_tier_pool *p, const tier_run *runs, size_t n, size_t *done) {
  *done = 0;
  if (p->vmm_pool || !p->p.bops->vmm_map_runs) {
    for (size_t i = 0; i < n; i++) {
      int rc = tier_vmm_map_run(p, runs[i].g, runs[i].e);
      if (rc != SGM_OK) return rc;
      *done = i + 1;
    }
    return SGM_OK;
  }
  sgm_vmm_run r[TIER_VMM_BATCH];
  tier_vmm_backend_runs(p, runs, n, r);
  return p->p.bops->vmm_map_runs(p->p.be, p->vmm_range, r, n, done);
}

static uint64_t tier_vmm_unmap_excess(sgm_tier_pool *p, uint64_t keep);

/* Unmap the n runs the caller claimed (busy, under the lock; no longer
 * counted free): the lock is dropped across the backend call and held again
 * on return. Bytes unmapped. */
static uint64_t tier_vmm_unmap_claimed_locked(sgm_tier_pool *p, const tier_run *runs, size_t n) {
  sgm__lock_drop(&p->lock);
  tier_vmm_unmap_runs(p, runs, n);
  sgm__lock_take(&p->lock);
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; i++) {
    for (size_t k = runs[i].g; k < runs[i].e; k++) {
      tier_vmm_set_mapped(p, k, false);
      p->gran[k].busy = 0;
      if (p->vmm_pool) p->pool_free[p->n_pool_free++] = p->gran[k].phys; /* back to the pool */
    }
    bytes += (uint64_t)(runs[i].e - runs[i].g) << p->vmm_shift;
  }
  p->committed_bytes -= bytes;
  pthread_cond_broadcast(&p->grown);
  return bytes;
}

/*
 * Unmap every free mapped granule (no block touches it, nobody maps or
 * unmaps it): on trim, on idle trim (the pool idle, measured from its last
 * allocation: sgm__tier_idle_trim) and under budget pressure. Up to
 * TIER_VMM_BATCH runs of neighbours per backend call, the lock dropped
 * across it; a block carved meanwhile onto a granule being unmapped waits
 * for it (busy) and maps it again. Bytes unmapped.
 */
uint64_t sgm__pool_vmm_unmap_free(sgm_tier_pool *p) {
  uint64_t done = tier_vmm_unmap_excess(p, 0);
  /* No free granule left mapped (none under a stream's pending work): the
   * peak starts again from what is held now. */
  sgm__lock_take(&p->lock);
  if (p->vmm_free_mapped == 0) p->vmm_held_peak = p->held_bytes;
  sgm__lock_drop(&p->lock);
  return done;
}

/* One past the highest mapped granule below e (0: none), a word of bits at a
 * time: the unmapped middle of the range is most of it. */
static inline size_t tier_vmm_mapped_below(const sgm_tier_pool *p, size_t e) {
  while (e > 0) {
    size_t w = (e - 1) >> 6;
    uint64_t x = p->vmm_bits[w] & (~UINT64_C(0) >> (63 - ((e - 1) & 63)));
    if (x) return (w << 6) + 64 - (size_t)__builtin_clzll(x);
    e = w << 6;
  }
  return 0;
}

/* The lowest mapped granule from g on (n, the range's granules: none). */
static inline size_t tier_vmm_mapped_from(const sgm_tier_pool *p, size_t g, size_t n) {
  while (g < n) {
    size_t w = g >> 6;
    uint64_t x = p->vmm_bits[w] & (~UINT64_C(0) << (g & 63));
    if (x) {
      size_t g1 = (w << 6) + (size_t)__builtin_ctzll(x);
      return g1 < n ? g1 : n;
    }
    g = (w + 1) << 6;
  }
  return n;
}

/* The head of the highest free mapping met walking down from granule e
 * (SIZE_MAX: none). */
static size_t tier_vmm_free_below_locked(const sgm_tier_pool *p, size_t e) {
  while ((e = tier_vmm_mapped_below(p, e)) > 0) {
    const tier_granule *x = &p->gran[e - 1];
    if (x->busy) {
      e--;
      continue;
    }
    if (p->gran[x->head].used == 0) return x->head;
    e = x->head;
  }
  return SIZE_MAX;
}

/* The head of the lowest free mapping met walking up from granule g whose
 * head is at least `floor` (mappings that start below it belong to the walk
 * down); SIZE_MAX: none. */
static size_t tier_vmm_free_above_locked(const sgm_tier_pool *p, size_t g, size_t floor) {
  size_t n = (size_t)(p->vmm_bytes >> p->vmm_shift);
  while ((g = tier_vmm_mapped_from(p, g, n)) < n) {
    const tier_granule *x = &p->gran[g];
    if (x->busy) {
      g++;
      continue;
    }
    const tier_granule *h = &p->gran[x->head];
    if (x->head >= floor && h->used == 0) return x->head;
    g = x->head + h->len;
  }
  return SIZE_MAX;
}

/* Add the mapping [g, e) to runs[] (n used): onto the walk's last run
 * (*last; SIZE_MAX: none yet) when it touches it at either end, else as a
 * new run that becomes the walk's last. */
static inline void tier_runs_add(tier_run *runs, size_t *n, size_t *last, size_t g, size_t e) {
  if (*last != SIZE_MAX && runs[*last].e == g) {
    runs[*last].e = e;
  } else if (*last != SIZE_MAX && runs[*last].g == e) {
    runs[*last].g = g;
  } else {
    *last = *n;
    runs[(*n)++] = (tier_run){g, e};
  }
}

/*
 * Unmap free mappings until at most `keep` granules stay mapped free (all of
 * them for keep 0: trims, budget pressure), the tops of the two piles first.
 * The sub-allocator cuts each block from the end of its free block nearer an
 * end of the range (lib/suballoc.c), so blocks pile up from both ends and a
 * granule at distance d from its nearer end is touched again only when that
 * pile is d high again: the free mappings farthest from their nearer end are
 * the ones a program that grows again reaches last (malloc trims the top of
 * its heap for the same reason). So two walks start at the middle of the
 * range, one down and one up, and the free mapping farther from its end goes
 * first (the upper one on a tie: the sub-allocator cuts from the low end on
 * one). Unmapping from the top of the range down instead (until issue 26's
 * second pass) took the upper pile from its base, which its next blocks
 * mapped again: pangu_2.6B's second pass made 847 driver calls that way
 * against 127, both down to the bound (docs/vmm.md). A mapping goes whole
 * (the last one may take the count below `keep`); free neighbours taken one
 * after the other on one side go as one run, up to TIER_VMM_BATCH runs per
 * backend call. Bytes unmapped.
 */
static uint64_t tier_vmm_unmap_excess(sgm_tier_pool *p, uint64_t keep) {
  if (!sgm__pool_owed_settle(p)) return 0; /* no unmap under a stream's pending work (owe.c) */
  uint64_t done = 0;
  tier_run runs[TIER_VMM_BATCH];
  size_t n = 0;
  size_t ng = (size_t)(p->vmm_bytes >> p->vmm_shift), mid = ng / 2;
  size_t down = mid, up = mid; /* the walks: next below `down`, next from `up` on */
  size_t run_down = SIZE_MAX, run_up = SIZE_MAX; /* each walk's last run in runs[] */
  sgm__lock_take(&p->lock);
  /* Each walk's next free mapping, looked for again only when it was taken
   * or the lock was dropped (a trim takes them all: no walk starts over). */
  size_t a = tier_vmm_free_below_locked(p, down), b = tier_vmm_free_above_locked(p, up, mid);
  while (p->vmm_free_mapped > keep && (a != SIZE_MAX || b != SIZE_MAX)) {
    bool take_up = a == SIZE_MAX || (b != SIZE_MAX && ng - (b + p->gran[b].len) >= a);
    size_t g = take_up ? b : a, e = g + p->gran[g].len;
    for (size_t k = g; k < e; k++) p->gran[k].busy = 1;
    tier_vmm_free_mapped_add_locked(p, -(int64_t)(e - g));
    if (take_up) {
      up = e;
      tier_runs_add(runs, &n, &run_up, g, e);
      b = tier_vmm_free_above_locked(p, up, mid);
    } else {
      down = g;
      tier_runs_add(runs, &n, &run_down, g, e);
      a = tier_vmm_free_below_locked(p, down);
    }
    if (n == TIER_VMM_BATCH) {
      done += tier_vmm_unmap_claimed_locked(p, runs, n);
      n = 0;
      run_down = run_up = SIZE_MAX;
      a = tier_vmm_free_below_locked(p, down);
      b = tier_vmm_free_above_locked(p, up, mid);
    }
  }
  if (n) done += tier_vmm_unmap_claimed_locked(p, runs, n);
  sgm__lock_drop(&p->lock);
  return done;
}

bool sgm__pool_vmm_pressure_locked(const sgm_tier_pool *p) {
  /* Reserve mode's pool: free granules stay mapped until the pool is empty
   * (sgm__pool_vmm_back_locked): unmapping them returns nothing to anyone. */
  return p->vmm_range && p->vmm_free_mapped > 0 && p->committed_bytes > sgm__pool_vmm_cap_locked(p);
}

/*
 * After blocks went back to the sub-allocator: unmap the free granules at all
 * while committed is over a budget that was lowered (fair shares of the node
 * registry: another process waits for that memory). Nothing else: a busy
 * program keeps its free granules mapped (hysteresis, issue 26); the next
 * block that needs new granules unmaps those past the slack first
 * (sgm__pool_vmm_back_locked), so committed is as bounded at every mapping,
 * and trims and the idle trim return the rest. The free-granule count is
 * read first without the lock, as a hint.
 */
void sgm__pool_vmm_settle(sgm_tier_pool *p) {
  if (!p->vmm_range || __atomic_load_n(&p->vmm_free_mapped, __ATOMIC_RELAXED) == 0) return;
  /* committed and the budget change under the lock (plain writes there). */
  sgm__lock_take(&p->lock);
  bool pressure = sgm__pool_vmm_pressure_locked(p);
  sgm__lock_drop(&p->lock);
  if (pressure) sgm__pool_vmm_unmap_free(p);
}

/*
 * Give the new block [off, off + bytes) memory: reference its granules, map
 * those that have none (runs of neighbours, one backend call each, the lock
 * dropped across it) and wait for those another thread maps or unmaps now.
 * Mapping never takes committed past the budget: free granules are unmapped
 * once to make room, else SGM__ERR_BUDGET. On failure the references stay:
 * the caller gives the block back (sgm__pool_release_block_locked drops them).
 */
int sgm__pool_vmm_back_locked(sgm_tier_pool *p, uint64_t off, uint64_t bytes) {
  size_t g0, g1;
  tier_vmm_span(p, off, bytes, &g0, &g1);
  uint64_t gb = tier_vmm_granule(p);
  /* Every granule mapped and nobody's attention (a busy program, hysteresis):
   * the references are all there is to do. */
  bool backed = true;
  tier_vmm_held_grew(p);
  for (size_t g = g0; g <= g1; g++) {
    tier_vmm_ref_locked(p, g);
    backed &= p->gran[g].mapped && !p->gran[g].busy;
  }
  if (backed) return SGM_OK;
  bool unmapped_for_room = false, unmapped_excess = false;
  for (;;) {
    /* Claim every granule of the block that has no memory and nobody's
     * attention (busy), so that no other thread maps it too. */
    uint64_t want = 0;
    bool others = false;
    for (size_t g = g0; g <= g1; g++) {
      want += tier_vmm_claimable_locked(p, g) ? gb : 0;
      others |= p->gran[g].busy;
    }
    if (want == 0 && !others) return SGM_OK;
    if (want == 0) {
      /* Another thread maps or unmaps one of them: wait, look again. */
      pthread_cond_wait(&p->grown, &p->lock.mu);
      continue;
    }
    /* Free granules past the slack go before new ones are mapped (frees
     * left them mapped: sgm__pool_vmm_settle), and all of them when the budget
     * has no room for the new ones. */
    uint64_t cap = sgm__pool_vmm_cap_locked(p);
    bool no_room = p->committed_bytes > cap || want > cap - p->committed_bytes;
    uint64_t slack = tier_vmm_slack(p);
    bool past_slack = !p->vmm_pool && !unmapped_for_room && p->vmm_free_mapped > slack;
    if (no_room) {
      if (unmapped_for_room || p->vmm_free_mapped == 0) return SGM__ERR_BUDGET;
      unmapped_for_room = true;
      sgm__lock_drop(&p->lock);
      sgm__pool_vmm_unmap_free(p);
      sgm__lock_take(&p->lock);
      continue;
    }
    if (past_slack && !unmapped_excess) {
      /* Down to the bound only, the tops of the piles first: the mapping
       * trades granules the program reaches last for the ones it needs now.
       * Going down to half the bound (a hysteresis, so that the next
       * unmapping would wait) unmapped granules near the piles' bases too,
       * which the program mapped again as it grew: 427 driver calls on
       * pangu_2.6B's second pass against 127 (docs/vmm.md). */
      unmapped_excess = true;
      sgm__lock_drop(&p->lock);
      tier_vmm_unmap_excess(p, slack);
      sgm__lock_take(&p->lock);
      continue;
    }
    /* Pages (issue 26): the unmapped neighbours of the block's first and
     * last granules within their aligned page are mapped with them while the
     * budget has room, so that the blocks the sub-allocator places next to
     * this one map nothing. */
    size_t a0 = g0, a1 = g1;
    size_t page = tier_vmm_page(p);
    if (page > 1) {
      size_t n_gran = (size_t)(p->vmm_bytes >> p->vmm_shift);
      size_t lo_page = g0 & ~(page - 1), hi_page = g1 | (page - 1);
      if (hi_page >= n_gran) hi_page = n_gran - 1;
      uint64_t extra = 0, room = cap - p->committed_bytes - want;
      if (tier_vmm_claimable_locked(p, g0))
        while (a0 > lo_page && tier_vmm_claimable_locked(p, a0 - 1) && extra + gb <= room) {
          a0--;
          extra += gb;
        }
      if (tier_vmm_claimable_locked(p, g1))
        while (a1 < hi_page && tier_vmm_claimable_locked(p, a1 + 1) && extra + gb <= room) {
          a1++;
          extra += gb;
        }
      want += extra;
    }
    size_t lo = a1 + 1, hi = a0;
    for (size_t g = a0; g <= a1; g++)
      if (tier_vmm_claimable_locked(p, g)) {
        p->gran[g].busy = 2; /* 2: claimed by this call */
        /* The room check above left a pool granule for each. */
        if (p->vmm_pool) p->gran[g].phys = p->pool_free[--p->n_pool_free];
        if (lo > g) lo = g;
        hi = g;
      }
    p->committed_bytes += want;
    sgm__lock_drop(&p->lock);
    /* One mapping per run (growth: up to TIER_VMM_MAP_MAX_GRANULES claimed
     * neighbours; reserve mode: a run of pool granules, each its own
     * mapping), up to TIER_VMM_BATCH runs per backend call. Claimed granules
     * are this thread's alone, so reading their state unlocked is safe. */
    int rc = SGM_OK;
    for (size_t g = lo; g <= hi;) {
      tier_run runs[TIER_VMM_BATCH];
      size_t n = 0, done = 0;
      while (g <= hi && n < TIER_VMM_BATCH) {
        if (p->gran[g].busy != 2) {
          g++;
          continue;
        }
        size_t e = g;
        while (e <= hi && p->gran[e].busy == 2) e++;
        if (!p->vmm_pool && e - g > TIER_VMM_MAP_MAX_GRANULES) e = g + TIER_VMM_MAP_MAX_GRANULES;
        runs[n++] = (tier_run){g, e};
        g = e;
      }
      int r = rc == SGM_OK && n ? tier_vmm_map_runs(p, runs, n, &done) : rc;
      sgm__lock_take(&p->lock);
      for (size_t i = 0; i < n; i++) {
        size_t a = runs[i].g, e = runs[i].e;
        if (i < done && p->vmm_pool) {
          for (size_t k = a; k < e; k++) tier_vmm_mapped_locked(p, k, k + 1);
        } else if (i < done) {
          tier_vmm_mapped_locked(p, a, e);
        } else { /* failed, or not tried after a failure */
          for (size_t k = a; k < e; k++) {
            p->gran[k].busy = 0;
            tier_vmm_set_mapped(p, k, false);
            if (p->vmm_pool) p->pool_free[p->n_pool_free++] = p->gran[k].phys;
          }
          p->committed_bytes -= (uint64_t)(e - a) * gb;
        }
      }
      sgm__lock_drop(&p->lock);
      if (r != SGM_OK && rc == SGM_OK) rc = r;
    }
    sgm__lock_take(&p->lock);
    pthread_cond_broadcast(&p->grown);
    if (rc != SGM_OK) {
      if (rc == SGM_ERR_NOMEM) tier_backend_nomem_locked(p, bytes);
      return rc;
    }
  }
}

/*
 * At create: reserve one range for the budget when the backend has a
 * virtual-memory API and the option allows it; the choice and its reason go
 * to the log at SGM_VERBOSE >= 2. Growth mode maps granules on demand; reserve
 * mode (growth off) also takes the budget's granules now, as a pool
 * (sgm__pool_vmm_pool_setup). false: grow in chunks, or reserve one chunk.
 */
bool sgm__pool_vmm_setup(sgm_tier_pool *p) {
  const sgm_tier_params *tp = &p->p;
  const char *name = sgm_tier_name(tp->tier);
  char why[256] = "";
  uint64_t g = 0;
  if (!tp->vmm) {
    snprintf(why, sizeof why, "SGM_VRAM_VMM is off");
  } else if (!tp->growth && !tp->bops->vmm_pool_create) {
    snprintf(why, sizeof why, "the %s backend cannot keep a pool of physical granules",
             tp->bops->name);
  } else if (!tp->bops->vmm_granularity) {
    snprintf(why, sizeof why, "the %s backend has no virtual-memory API", tp->bops->name);
  } else if (tp->bops->vmm_granularity(tp->be, &g) != SGM_OK) {
    snprintf(why, sizeof why, "asking for the granularity failed: %s", sgm_last_error());
  } else if (g == 0) {
    snprintf(why, sizeof why, "the device does not support virtual memory management");
  } else if ((g & (g - 1)) || g < SGM_DEVICE_ALIGN || g > (UINT64_C(1) << 40)) {
    snprintf(why, sizeof why, "the granularity %llu is not a power of two from %u bytes",
             (unsigned long long)g, SGM_DEVICE_ALIGN);
  } else if (tp->budget_bytes / g < TIER_VMM_MIN_GRANULES) {
    snprintf(why, sizeof why, "the budget is below %u granules of %llu bytes",
             TIER_VMM_MIN_GRANULES, (unsigned long long)g);
  }
  /* Address space for the largest budget the pool may be given later (fair
   * shares of the node registry raise and lower it): reserving is cheap. */
  uint64_t want = tp->vmm_range_bytes > tp->budget_bytes ? tp->vmm_range_bytes : tp->budget_bytes;
  /* Reserve mode: blocks land anywhere in twice the budget's addresses, so
   * that fragmentation of the addresses never decides the budget (only the
   * granules blocks touch count). */
  if (!tp->growth && want / 2 < tp->budget_bytes) want = tp->budget_bytes * 2;
  uint64_t bytes = why[0] ? 0 : sgm__align_up(want, g);
  tier_granule *gran = NULL;
  uint64_t *bits = NULL;
  void *range = NULL;
  sgm_devptr base = 0;
  if (!why[0] && bytes / g > UINT32_MAX) {
    snprintf(why, sizeof why, "the range would hold more than %u granules", UINT32_MAX);
  } else if (!why[0]) {
    gran = malloc((size_t)(bytes / g) * sizeof *gran);
    bits = calloc((size_t)(bytes / g + 63) / 64, sizeof *bits);
    if (!gran || !bits) snprintf(why, sizeof why, "out of host memory for the granule table");
  }
  if (!why[0] && tp->bops->vmm_reserve(tp->be, bytes, &range, &base) != SGM_OK)
    snprintf(why, sizeof why, "reserving the range failed: %s", sgm_last_error());
  if (!why[0] && sgm__suballoc_add_range(p->sa, base, bytes) != SGM_OK) {
    snprintf(why, sizeof why, "%s", sgm_last_error());
    tp->bops->vmm_free(tp->be, range);
  }
  char a[32], b[32];
  if (why[0]) {
    free(gran);
    free(bits);
    sgm__log(tp->verbose, 2, tp->growth ? "%s: growth in chunks (%s)"
                                        : "%s: the budget reserved as one contiguous chunk (%s)",
             name, why);
    return false;
  }
  for (size_t i = 0; i < bytes / g; i++) gran[i] = (tier_granule){0};
  if (tp->growth) sgm__suballoc_set_end_hook(p->sa, tier_vmm_end_hook, p);
  p->gran = gran;
  p->vmm_bits = bits;
  /* The page map of large blocks (map.c); without host memory for it every
   * block goes in the hashed map. */
  p->n_big_slots = (size_t)((bytes + TIER_BIG_BYTES - 1) >> TIER_BIG_SHIFT);
  p->big = calloc(p->n_big_slots, sizeof *p->big);
  p->big_bits = calloc((p->n_big_slots + 63) / 64, sizeof *p->big_bits);
  if (!p->big || !p->big_bits) tier_big_drop(p);
  p->vmm_range = range;
  p->vmm_base = base;
  p->vmm_bytes = bytes;
  sgm__pool_span_add(p, base, bytes);
  p->vmm_shift = (unsigned)__builtin_ctzll(g);
  if (tp->growth)
    sgm__log(tp->verbose, 2, "%s: growth on one reserved range of %s, mapped in %s granules on "
             "demand (virtual-memory API)", name, sgm__fmt_bytes(bytes, a, sizeof a),
             sgm__fmt_bytes(g, b, sizeof b));
  return true;
}

/*
 * Reserve mode on the range sgm__pool_vmm_setup reserved: take the budget's
 * granules from the driver now (whole granules: the budget rounded down, so
 * that nothing is committed past it; a block of the whole budget fits only
 * when the budget is a whole number of granules), as the pool that mapped granules
 * come from and go back to. Fails as reserving the budget as a chunk fails
 * (the caller's message).
 */
int sgm__pool_vmm_pool_setup(sgm_tier_pool *p) {
  const sgm_tier_params *tp = &p->p;
  /* Whole granules within the budget: the budget is rounded down, never the
   * commitment up (committed <= budget, issue 24; sgm__pool_vmm_setup keeps
   * budgets of few granules off this path). */
  uint64_t n = tp->budget_bytes >> p->vmm_shift;
  if (n > UINT32_MAX)
    return sgm__error_set(SGM_ERR_INVALID, "a budget of %llu granules is more than a pool holds",
                          (unsigned long long)n);
  p->pool_free = malloc((size_t)n * sizeof *p->pool_free);
  if (!p->pool_free) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for the pool table");
  int rc = tp->bops->vmm_pool_create(tp->be, n, &p->vmm_pool);
  if (rc != SGM_OK) {
    free(p->pool_free);
    p->pool_free = NULL;
    return rc;
  }
  /* Popped from the end: low granules first (any order would do). */
  for (size_t i = 0; i < n; i++) p->pool_free[i] = (uint32_t)(n - 1 - i);
  p->n_pool = p->n_pool_free = (size_t)n;
  char a[32], b[32], c[32];
  sgm__log(tp->verbose, 2, "%s: reserved on the virtual-memory API: %s taken at create as %llu "
           "granules of %s, mapped where blocks land in a range of %s (a granule no block "
           "touches goes back to the pool, not to the driver)",
           sgm_tier_name(tp->tier), sgm__fmt_bytes(n << p->vmm_shift, a, sizeof a),
           (unsigned long long)n, sgm__fmt_bytes(tier_vmm_granule(p), b, sizeof b),
           sgm__fmt_bytes(p->vmm_bytes, c, sizeof c));
  return SGM_OK;
}

/* At destroy: unmap what is still mapped and release the range. */
void sgm__pool_vmm_teardown(sgm_tier_pool *p) {
  if (!p->vmm_range) return;
  sgm__pool_owed_settle(p); /* no unmap under a stream's pending work (owe.c) */
  size_t n = (size_t)(p->vmm_bytes >> p->vmm_shift);
  for (size_t g = 0; g < n;) {
    if (!p->gran[g].mapped) {
      g++;
      continue;
    }
    size_t e = g;
    while (e < n && p->gran[e].mapped) e++;
    tier_vmm_unmap_run(p, g, e);
    g = e;
  }
  if (p->vmm_pool) p->p.bops->vmm_pool_free(p->p.be, p->vmm_pool); /* every handle back */
  p->vmm_pool = NULL;
  free(p->pool_free);
  p->p.bops->vmm_free(p->p.be, p->vmm_range);
  free(p->gran);
  free(p->vmm_bits);
  tier_big_drop(p);
  p->gran = NULL;
  p->vmm_bits = NULL;
  p->vmm_range = NULL;
}

void sgm__tier_vmm_info(sgm_tier_pool *p, uint64_t *granule_bytes, uint64_t *reserved_bytes) {
  *granule_bytes = p->vmm_range ? tier_vmm_granule(p) : 0;
  *reserved_bytes = p->vmm_range ? p->vmm_bytes : 0;
}

uint64_t sgm__tier_vmm_calls(const sgm_tier_pool *p) {
  return __atomic_load_n(&p->vmm_calls, __ATOMIC_RELAXED);
}

uint64_t sgm__tier_vmm_free_mapped(const sgm_tier_pool *p) {
  return p->vmm_range ? __atomic_load_n(&p->vmm_free_mapped, __ATOMIC_RELAXED) << p->vmm_shift : 0;
}

bool sgm__tier_vmm_pooled(const sgm_tier_pool *p) { return p->vmm_pool != NULL; }

/* sgm__pool_vmm_check_locked: count block b in refs, one per granule it
 * touches (n granules in the range). */
static void tier_vmm_count_refs(const sgm_tier_pool *p, const tier_block *b, uint32_t *refs, size_t n) {
  size_t g0, g1;
  tier_vmm_span(p, tier_ptr_of(b), b->bytes, &g0, &g1);
  for (size_t g = g0; g <= g1 && g < n; g++) refs[g]++;
}

/* Expandable growth: the one range is the sub-allocator's only range;
 * committed is the granules mapped or being mapped or unmapped; every
 * granule's references are the blocks (live or cached) touching it; the free
 * mapped count matches. */
bool sgm__pool_vmm_check_locked(sgm_tier_pool *p, const sgm_suballoc_stats *st) {
  const char *name = sgm_tier_name(p->p.tier);
  size_t n = (size_t)(p->vmm_bytes >> p->vmm_shift);
  if (st->capacity_bytes != p->vmm_bytes || st->n_ranges != 1 || p->n_chunks != 0)
    return !sgm__error_set(SGM_ERR_CORRUPT, "%s: the reserved range of %llu bytes is not the "
                           "sub-allocator's only range (%llu bytes in %llu ranges, %zu chunks)",
                           name, (unsigned long long)p->vmm_bytes,
                           (unsigned long long)st->capacity_bytes, (unsigned long long)st->n_ranges,
                           p->n_chunks);
  uint32_t *refs = calloc(n, sizeof *refs);
  if (!refs) return true; /* a check that cannot run finds nothing wrong */
  /* Both maps: writers hold the pool lock, so they are stable. */
  for (size_t i = 0; i < TIER_SHARDS; i++) {
    const tier_table *t = p->shards[i].table;
    for (size_t k = 0; t && k <= t->mask; k++)
      if (t->s[k]) tier_vmm_count_refs(p, tier_slot_rec(t->s[k]), refs, n);
  }
  for (size_t i = 0; i < p->n_big_slots; i++)
    if (p->big[i]) tier_vmm_count_refs(p, p->big[i], refs, n);
  uint64_t committed = 0, free_mapped = 0;
  bool ok = true;
  for (size_t g = 0; g < n && ok; g++) {
    const tier_granule *x = &p->gran[g];
    committed += x->mapped || x->busy ? UINT64_C(1) << p->vmm_shift : 0;
    if (x->mapped && !x->busy && x->head == g) {
      /* A mapping: its granules follow its head, its use count is right. */
      uint32_t used = 0;
      bool whole = x->len > 0 && g + x->len <= n;
      for (size_t k = g; whole && k < g + x->len; k++) {
        whole = p->gran[k].mapped && !p->gran[k].busy && p->gran[k].head == g;
        used += p->gran[k].refs > 0;
      }
      if (!whole || used != x->used)
        ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: the mapping at granule %zu of %u granules is "
                             "not whole, or %u of them are in use and %u counted", name, g,
                             (unsigned)x->len, used, (unsigned)x->used);
      free_mapped += used == 0 ? x->len : 0;
    } else if (x->mapped && !x->busy && (x->head > g || p->gran[x->head].head != x->head ||
                                         x->head + p->gran[x->head].len <= g)) {
      ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: granule %zu is mapped outside the mapping it names "
                           "(granule %u)", name, g, x->head);
    }
    if (!ok) break;
    if (!x->mapped != !(p->vmm_bits[g >> 6] & (UINT64_C(1) << (g & 63))))
      ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: granule %zu is %smapped and its bit says otherwise",
                           name, g, x->mapped ? "" : "not ");
    else if (x->refs != refs[g])
      ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: granule %zu has %u references, blocks touch it "
                           "%u times", name, g, x->refs, refs[g]);
    else if (x->refs && !x->mapped && !x->busy)
      ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: granule %zu is touched by %u blocks and not "
                           "mapped", name, g, x->refs);
  }
  free(refs);
  /* Reserve mode's pool: every pool granule is mapped (or being mapped or
   * unmapped) or free, never both. */
  if (ok && p->vmm_pool && p->n_pool_free + (committed >> p->vmm_shift) != p->n_pool)
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: pool of %zu granules, %zu free and %llu mapped",
                         name, p->n_pool, p->n_pool_free,
                         (unsigned long long)(committed >> p->vmm_shift));
  /* Managed blocks charged to the pool (sgm__tier_charge) are committed too. */
  if (ok && (committed != p->committed_bytes - p->external_bytes ||
             free_mapped != p->vmm_free_mapped))
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: committed %llu, granules mapped %llu; %llu free "
                         "mapped granules counted, %llu found", name,
                         (unsigned long long)p->committed_bytes, (unsigned long long)committed,
                         (unsigned long long)p->vmm_free_mapped, (unsigned long long)free_mapped);
  return ok;
}
