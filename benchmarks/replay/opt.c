/*
 * opt.c — Belady's OPT for a trace, by simulation (no sgm, no buffers).
 *
 * The model is the one sgm's buffers live by, so that hit ratios compare:
 *  - VRAM is a cache of capacity_bytes; a block is charged its size rounded up
 *    to 256 bytes (as sgm's tiers round);
 *  - an access is a hit when the block is cached at that moment; the first
 *    access to a block is a miss (sgm creates it then);
 *  - a block larger than the whole capacity is never cached (sgm: it stays in
 *    shared memory, and nothing is evicted for it): every access misses;
 *  - on a miss with no room, two variants:
 *      REPLAY_OPT_BYPASS ("opt"): if the accessed block's next use is no
 *        nearer than that of every cached block, it is not cached (bypass: sgm
 *        serves it from shared memory, as a policy's admit may decide);
 *        otherwise evict the cached block whose next use is furthest away,
 *        blocks never used again first, until it fits;
 *      REPLAY_OPT_ADMIT ("opt-admit"): the accessed block always enters
 *        (demand fetching, as sgm before admission existed): evict by
 *        furthest next use until it fits;
 *  - a free removes the block from the cache without a demotion.
 *
 * For equal sizes both are Belady's MIN in their model: ADMIT is optimal among
 * caches that take every missed block in, BYPASS among caches that may refuse
 * it (at a miss, of the cached blocks and the new one, the one used furthest
 * in the future is the one not to keep). BYPASS is an upper bound on every
 * sgm policy, admission policies included; ADMIT only on those that admit
 * everything, and a W-TinyLFU may beat it. BYPASS >= ADMIT always. For unequal
 * sizes both are heuristics ("Belady-size": furthest next use until it fits;
 * BYPASS also declines a block whose next use is the furthest of all), NOT
 * optimal (optimal variable-size caching is NP-hard): a policy may beat them
 * there, and the gap is only indicative.
 *
 * Cost: O(n log n). next[i] (the position of the next access to the block
 * accessed at i) comes from one backwards pass; the cache is a binary max-heap
 * of (next use, block) entries. A hit does not update the heap in place: it
 * pushes a new entry and the old one goes stale; a popped entry whose block is
 * no longer cached, or whose next use is not the block's current one, is
 * dropped (lazy deletion). At most one entry is pushed per access.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "replay.h"

/* Next use of a block never accessed again: after every position. */
#define OPT_NEVER UINT32_MAX

/* Heap entry: next use in the high half, block in the low half, so that the
 * greatest key is the furthest next use (ties: the higher block id). */
static inline uint64_t opt_key(uint32_t next, uint32_t block) {
  return (uint64_t)next << 32 | block;
}

typedef struct opt_heap {
  uint64_t *a; /* keys; a[0] is the greatest */
  size_t n;    /* entries used */
} opt_heap;

static void heap_push(opt_heap *h, uint64_t k) {
  size_t i = h->n++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (h->a[p] >= k) break;
    h->a[i] = h->a[p];
    i = p;
  }
  h->a[i] = k;
}

static uint64_t heap_pop(opt_heap *h);

/* The greatest live key (cached block, current next use), stale entries on
 * top dropped on the way; the heap must hold a live entry. */
static uint64_t heap_top_live(opt_heap *h, const uint8_t *state, const uint32_t *cur) {
  for (;;) {
    uint64_t k = h->a[0];
    uint32_t v = (uint32_t)k, vnext = (uint32_t)(k >> 32);
    if ((state[v] & 1) && cur[v] == vnext) return k;
    heap_pop(h);
  }
}

static uint64_t heap_pop(opt_heap *h) {
  uint64_t top = h->a[0], k = h->a[--h->n];
  size_t i = 0, n = h->n;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= n) break;
    if (c + 1 < n && h->a[c + 1] > h->a[c]) c++;
    if (h->a[c] <= k) break;
    h->a[i] = h->a[c];
    i = c;
  }
  if (n) h->a[i] = k;
  return top;
}

static double opt_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int replay_opt(const replay_trace *t, uint64_t capacity_bytes, replay_result *out, char *err,
               size_t err_len) {
  return replay_opt_ex(t, capacity_bytes, REPLAY_OPT_BYPASS, out, err, err_len);
}

int replay_opt_ex(const replay_trace *t, uint64_t capacity_bytes, replay_opt_variant variant,
                  replay_result *out, char *err, size_t err_len) {
  memset(out, 0, sizeof *out);
  snprintf(out->policy, sizeof out->policy, "%s", variant == REPLAY_OPT_ADMIT ? "opt-admit" : "opt");
  out->hint_queue = -1;
  if (t->n_ev >= OPT_NEVER) {
    snprintf(err, err_len, "OPT: %zu events is too many (at most %u)", t->n_ev, OPT_NEVER - 1);
    return -1;
  }
  size_t nb = t->n_blocks ? t->n_blocks : 1;
  uint32_t *next = malloc((t->n_ev ? t->n_ev : 1) * sizeof *next);
  uint32_t *cur = malloc(nb * sizeof *cur);        /* cached: its next use; else OPT_NEVER */
  uint8_t *state = calloc(nb, 1);                  /* bit 0 cached, bit 1 seen before */
  opt_heap h = {malloc((t->n_access ? t->n_access : 1) * sizeof *h.a), 0};
  int rc = -1;
  if (!next || !cur || !state || !h.a) {
    snprintf(err, err_len, "OPT: out of memory for %zu events", t->n_ev);
    goto out;
  }
  double t0 = opt_now();
  /* Backwards: cur[] doubles as "the next access seen so far". */
  for (size_t b = 0; b < nb; b++) cur[b] = OPT_NEVER;
  for (size_t i = t->n_ev; i-- > 0;) {
    uint32_t e = t->ev[i], b = REPLAY_EV_ID(e);
    if (e & REPLAY_EV_FREE) {
      cur[b] = OPT_NEVER;
    } else {
      next[i] = cur[b];
      cur[b] = (uint32_t)i;
    }
  }
  for (size_t b = 0; b < nb; b++) cur[b] = OPT_NEVER;

  enum { CACHED = 1, SEEN = 2 };
  uint64_t used = 0;
  for (size_t i = 0; i < t->n_ev; i++) {
    uint32_t e = t->ev[i], b = REPLAY_EV_ID(e);
    uint64_t sz = (t->size[b] + REPLAY_ALIGN - 1) / REPLAY_ALIGN * REPLAY_ALIGN;
    if (e & REPLAY_EV_FREE) {
      if (state[b] & CACHED) used -= sz;
      state[b] &= (uint8_t)~CACHED;
      continue;
    }
    out->accesses++;
    if (state[b] & CACHED) {
      out->hits++;
      cur[b] = next[i];
      heap_push(&h, opt_key(next[i], b));
      continue;
    }
    bool refetch = state[b] & SEEN;
    state[b] |= SEEN;
    if (sz > capacity_bytes) continue; /* never fits: stays below, as in sgm */
    if (variant == REPLAY_OPT_BYPASS && used + sz > capacity_bytes && h.n > 0 &&
        next[i] >= (uint32_t)(heap_top_live(&h, state, cur) >> 32)) {
      out->bypassed++;
      continue; /* used no sooner than anything cached: leave it below */
    }
    while (used + sz > capacity_bytes) {
      /* used > 0 here, so some cached block has a live entry; an empty heap
       * would be a bug in this file: say so rather than read past it. */
      if (h.n == 0) {
        snprintf(err, err_len, "OPT: internal error: %llu bytes cached but no entry in the heap",
                 (unsigned long long)used);
        goto out;
      }
      uint64_t k = heap_pop(&h);
      uint32_t v = (uint32_t)k, vnext = (uint32_t)(k >> 32);
      if (!(state[v] & CACHED) || cur[v] != vnext) continue; /* stale */
      uint64_t vsz = (t->size[v] + REPLAY_ALIGN - 1) / REPLAY_ALIGN * REPLAY_ALIGN;
      state[v] &= (uint8_t)~CACHED;
      used -= vsz;
      out->evictions++;
      out->bytes_demoted += t->size[v]; /* sgm counts bytes unrounded */
    }
    if (refetch) out->bytes_promoted += t->size[b];
    state[b] |= CACHED;
    cur[b] = next[i];
    used += sz;
    heap_push(&h, opt_key(next[i], b));
  }
  out->seconds = opt_now() - t0;
  /* As sgm would count them: demotions go VRAM -> shared, promotions back. */
  out->tier_out[0] = out->tier_in[1] = out->bytes_demoted;
  out->tier_in[0] = out->tier_out[1] = out->bytes_promoted;
  out->tier_evictions[0] = out->evictions;
  rc = 0;
out:
  free(next);
  free(cur);
  free(state);
  free(h.a);
  return rc;
}
