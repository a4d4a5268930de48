/*
 * opt.c — Belady's OPT for a trace, by simulation (no sgm, no buffers).
 *
 * The model is the one sgm's buffers live by, so that hit ratios compare:
 *  - VRAM is a cache of capacity_bytes; a block is charged its size rounded up
 *    to 256 bytes (as sgm's tiers round);
 *  - an access is a hit when the block is cached at that moment; the first
 *    access to a block is a miss (sgm creates it then);
 *  - the accessed block always enters the cache (acquire brings a buffer into
 *    VRAM; demand fetching, no bypass), unless it is larger than the whole
 *    capacity: then it stays below (sgm: shared memory) and it is a miss;
 *  - on a miss with no room: evict the cached block whose next use is furthest
 *    away, blocks never used again first, until the new block fits;
 *  - a free removes the block from the cache without a demotion.
 *
 * For equal sizes this is Belady's MIN, optimal among demand-fetching caches:
 * no online policy driven through acquire can have more hits. For unequal
 * sizes it is the usual "Belady-size" heuristic (furthest next use until it
 * fits), which is NOT optimal (optimal variable-size caching is NP-hard): a
 * policy may beat it there, and the gap is only indicative.
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
  memset(out, 0, sizeof *out);
  snprintf(out->policy, sizeof out->policy, "opt");
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
