/*
 * test_managed.c — SGM_POINTERS=managed on the emulated device (issue 14).
 *
 * The emulated device counts device-placed and host-placed managed pages
 * apart under one address (a move changes the count, never the bytes), so
 * these tests see every move:
 *  - a host thread writing its block while sgm moves it keeps every write
 *    (issue 29: a copy-then-remap move lost them);
 *  - a pointer's bytes survive any sequence of demotions, promotions, hints,
 *    frees and new allocations, byte for byte (random, the seed printed);
 *  - the VRAM budget is never exceeded by device-placed bytes, and what the
 *    device holds equals what sgm charged to the VRAM budget (a move of the
 *    wrong length shows here);
 *  - a new block that needs VRAM demotes a colder managed block instead of
 *    landing in shared memory; a hot hint changes which one;
 *  - after a big free, the shared-placed blocks with the highest priority
 *    come back first;
 *  - managed mode is refused with a message that says why where the device
 *    has no Unified Memory, and auto falls back to fixed pointers;
 *  - blocks under SGM_MANAGED_MOVABLE_BYTES and fixed contexts never move;
 *  - a failure of any device call on the way leaves every invariant and no leak.
 *
 * On the CUDA backend over the driver test double (skipped when the double
 * is not on LD_LIBRARY_PATH):
 *  - placement is advice + prefetch with the driver's location structs: a
 *    VRAM block prefers the device, a shared one prefers host memory and is
 *    accessed-by the device; the driver never evicts on its own;
 *  - a move is ordered after the caller's work on its stream;
 *  - no concurrent managed access, or a driver before 12.2, refuses managed
 *    mode with the reason (the 12.0 case runs as its own ctest, since the
 *    driver is loaded once per process).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "internal.h"
#include "placement/placement.h"
#include "test_util.h"
#include "tiers/tier.h"

#define MiB (UINT64_C(1) << 20)

static sgm_context *make_ctx_policy(const char *vram_limit, const char *pointers, const char *policy) {
  sgm_test_clean_env();
  if (policy) setenv("SGM_POLICY_VRAM", policy, 1);
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", vram_limit, 1);
  setenv("SGM_SHARED_LIMIT", "256MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1); /* no idle thread: promotions only where the test says */
  setenv("SGM_POINTERS", pointers, 1);
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fail_msg("create: %s", sgm_last_error());
  return ctx;
}

static sgm_context *make_ctx(const char *vram_limit, const char *pointers) {
  return make_ctx_policy(vram_limit, pointers, NULL);
}

/* The invariants after every step: the budget holds device-placed bytes, the
 * device holds exactly what sgm charged, the placement lists are whole. */
static void check_invariants(sgm_context *ctx) {
  sgm_backend_counters c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  uint64_t charged_vram = sgm__tier_charged(sgm__context_tier(ctx, SGM_TIER_VRAM));
  uint64_t charged_shared = sgm__tier_charged(sgm__context_tier(ctx, SGM_TIER_SHARED));
  assert_true(c.managed_device_bytes + st.tier[SGM_TIER_VRAM].committed_bytes - charged_vram <=
              st.tier[SGM_TIER_VRAM].budget_bytes);
  assert_true(st.tier[SGM_TIER_VRAM].committed_bytes <= st.tier[SGM_TIER_VRAM].budget_bytes);
  /* Cached movable ranges are committed, not used. */
  for (int t = 0; t < 2; t++)
    assert_true(st.tier[t].used_bytes + st.tier[t].cached_bytes <= st.tier[t].committed_bytes);
  assert_int_equal(c.managed_device_bytes, charged_vram);
  assert_int_equal(c.managed_host_bytes, charged_shared);
  char why[256];
  if (sgm__placement_check(ctx, why, sizeof why) != SGM_OK) fail_msg("placement: %s", why);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_SHARED)));
}

/* The pattern: one 64-bit word per 8 bytes (fast under the sanitizers),
 * different for every block (seed) and offset. */
static uint64_t pattern(uint64_t seed, uint64_t word) {
  uint64_t x = (seed + 1) * 0x9e3779b97f4a7c15ull ^ (word + 1) * 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 31);
}

static void fill(uint8_t *p, uint64_t n, uint64_t seed) {
  for (uint64_t w = 0; w < n / 8; w++) {
    uint64_t v = pattern(seed, w);
    memcpy(p + 8 * w, &v, 8);
  }
  for (uint64_t i = n / 8 * 8; i < n; i++) p[i] = (uint8_t)pattern(seed, i);
}

/* Unified Memory: the host reads the pointer itself, wherever its pages are. */
static void verify(const uint8_t *p, uint64_t n, uint64_t seed) {
  for (uint64_t w = 0; w < n / 8; w++) {
    uint64_t v = pattern(seed, w), got;
    memcpy(&got, p + 8 * w, 8);
    if (got != v)
      fail_msg("bytes %llu..%llu of a %llu-byte block (seed %llu) changed",
               (unsigned long long)(8 * w), (unsigned long long)(8 * w + 7), (unsigned long long)n,
               (unsigned long long)seed);
  }
  for (uint64_t i = n / 8 * 8; i < n; i++)
    if (p[i] != (uint8_t)pattern(seed, i))
      fail_msg("byte %llu of a %llu-byte block (seed %llu) changed", (unsigned long long)i,
               (unsigned long long)n, (unsigned long long)seed);
}

/* Bytes survive every move; device bytes stay within the budget. */
static void test_bytes_survive_random_moves(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("test_managed random moves", 14);
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  sgm_context *ctx = make_ctx("24MiB", "managed");
  enum { N = 8 };
  uint8_t *p[N] = {0};
  uint64_t size[N] = {0}, tag[N] = {0};
  for (int step = 0; step < 160; step++) {
    int i = (int)sgm_test_rng_range(&r, 0, N - 1);
    int op = (int)sgm_test_rng_range(&r, 0, 5);
    if (!p[i]) op = 0;
    switch (op) {
    case 0: /* (re)allocate: odd sizes, so the last page is partly used */
      if (p[i]) {
        verify(p[i], size[i], tag[i]);
        assert_int_equal(sgm_free_ex(ctx, p[i], NULL), SGM_OK);
      }
      size[i] = sgm_test_rng_range(&r, 2 * MiB, 4 * MiB + 12345);
      tag[i] = sgm_test_rng_next(&r);
      p[i] = sgm_alloc(ctx, size[i], NULL);
      if (!p[i]) fail_msg("alloc %llu: %s", (unsigned long long)size[i], sgm_last_error());
      fill(p[i], size[i], tag[i]);
      break;
    case 1:
      assert_int_equal(sgm_prefetch(ctx, p[i], size[i], SGM_TIER_SHARED, NULL), SGM_OK);
      assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_SHARED);
      break;
    case 2: {
      sgm_status s = sgm_prefetch(ctx, p[i], size[i], SGM_TIER_VRAM, NULL);
      if (s == SGM_OK) assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_VRAM);
      else assert_int_equal(s, SGM_ERR_NOMEM);
      break;
    }
    case 3:
      assert_int_equal(sgm_advise(ctx, p[i], (sgm_priority)sgm_test_rng_range(&r, 0, 4),
                                  SGM_HINT_HOT), SGM_OK);
      break;
    case 4:
      assert_int_equal(sgm_advise(ctx, p[i], SGM_PRIORITY_NORMAL, SGM_HINT_COLD), SGM_OK);
      assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_SHARED);
      break;
    case 5:
      assert_int_equal(sgm_trim(ctx), SGM_OK); /* promotes into the room it finds */
      break;
    }
    verify(p[i], size[i], tag[i]);
    check_invariants(ctx);
  }
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_true(st.n_managed_demotions > 0 && st.n_managed_promotions > 0);
  for (int i = 0; i < N; i++) {
    verify(p[i], size[i], tag[i]);
    sgm_free(ctx, p[i], NULL);
  }
  check_invariants(ctx);
  assert_int_equal(sgm_trim(ctx), SGM_OK); /* the cached ranges go back */
  sgm_backend_counters c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.n_managed_live, 0);
  sgm_context_destroy(ctx);
}

/* A new block demotes the least recently used managed block (same priority)
 * instead of landing in shared memory; a hot hint makes another the victim. */
static void run_victim_order(bool hint_first) {
  sgm_context *ctx = make_ctx("12MiB", "managed");
  uint8_t *a = sgm_alloc(ctx, 4 * MiB, NULL);
  uint8_t *b = sgm_alloc(ctx, 4 * MiB, NULL);
  uint8_t *c = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(a);
  assert_non_null(b);
  assert_non_null(c);
  fill(a, 4 * MiB, 1);
  assert_int_equal(sgm_pointer_tier(ctx, a), SGM_TIER_VRAM);
  assert_int_equal(sgm_pointer_tier(ctx, c), SGM_TIER_VRAM);
  if (hint_first) assert_int_equal(sgm_advise(ctx, a, SGM_PRIORITY_NORMAL, SGM_HINT_HOT), SGM_OK);
  uint8_t *d = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(d);
  assert_int_equal(sgm_pointer_tier(ctx, d), SGM_TIER_VRAM); /* not a fallback */
  assert_int_equal(sgm_pointer_tier(ctx, a), hint_first ? SGM_TIER_VRAM : SGM_TIER_SHARED);
  assert_int_equal(sgm_pointer_tier(ctx, b), hint_first ? SGM_TIER_SHARED : SGM_TIER_VRAM);
  verify(a, 4 * MiB, 1);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_fallbacks, 0);
  assert_int_equal(st.n_managed_demotions, 1);
  assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, 12 * MiB);
  assert_int_equal(st.tier[SGM_TIER_SHARED].used_bytes, 4 * MiB);
  assert_int_equal(st.n_managed_live, 4);
  check_invariants(ctx);
  sgm_free(ctx, a, NULL);
  sgm_free(ctx, b, NULL);
  sgm_free(ctx, c, NULL);
  sgm_free(ctx, d, NULL);
  sgm_context_destroy(ctx);
}

static void test_lru_block_is_demoted_for_a_new_one(void **state) {
  (void)state;
  run_victim_order(false);
}

static void test_hot_hint_changes_the_victim(void **state) {
  (void)state;
  run_victim_order(true);
}

/* A lower priority leaves VRAM first, whatever the recency. */
static void test_low_priority_leaves_first(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("8MiB", "managed");
  void *lo = sgm_alloc(ctx, 4 * MiB, NULL);
  void *hi = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_int_equal(sgm_advise(ctx, hi, SGM_PRIORITY_HIGH, SGM_HINT_NONE), SGM_OK);
  assert_int_equal(sgm_advise(ctx, lo, SGM_PRIORITY_LOW, SGM_HINT_HOT), SGM_OK); /* most recent */
  void *n = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_int_equal(sgm_pointer_tier(ctx, lo), SGM_TIER_SHARED);
  assert_int_equal(sgm_pointer_tier(ctx, hi), SGM_TIER_VRAM);
  assert_int_equal(sgm_pointer_tier(ctx, n), SGM_TIER_VRAM);
  check_invariants(ctx);
  sgm_free(ctx, lo, NULL);
  sgm_free(ctx, hi, NULL);
  sgm_free(ctx, n, NULL);
  sgm_context_destroy(ctx);
}

/* After a free, the shared-placed block with the highest priority comes back
 * first (the room holds one), though it was the least recently placed. */
static void test_highest_priority_comes_back_first(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("16MiB", "managed");
  void *h = sgm_alloc(ctx, 4 * MiB, NULL);
  void *m = sgm_alloc(ctx, 4 * MiB, NULL);
  void *l = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_int_equal(sgm_advise(ctx, h, SGM_PRIORITY_HIGH, SGM_HINT_NONE), SGM_OK);
  assert_int_equal(sgm_advise(ctx, m, SGM_PRIORITY_NORMAL, SGM_HINT_NONE), SGM_OK);
  assert_int_equal(sgm_advise(ctx, l, SGM_PRIORITY_LOW, SGM_HINT_NONE), SGM_OK);
  for (void **p = (void *[]){h, m, l, NULL}; *p; p++)
    assert_int_equal(sgm_prefetch(ctx, *p, 4 * MiB, SGM_TIER_SHARED, NULL), SGM_OK);
  void *z = sgm_alloc(ctx, 4 * MiB, NULL);
  void *y = sgm_alloc(ctx, 12 * MiB, NULL);
  assert_int_equal(sgm_pointer_tier(ctx, z), SGM_TIER_VRAM);
  assert_int_equal(sgm_pointer_tier(ctx, y), SGM_TIER_VRAM);
  assert_int_equal(sgm_pointer_tier(ctx, h), SGM_TIER_SHARED);
  sgm_free(ctx, z, NULL); /* room for one */
  assert_int_equal(sgm_pointer_tier(ctx, h), SGM_TIER_VRAM);
  assert_int_equal(sgm_pointer_tier(ctx, m), SGM_TIER_SHARED);
  assert_int_equal(sgm_pointer_tier(ctx, l), SGM_TIER_SHARED);
  check_invariants(ctx);
  sgm_free(ctx, y, NULL); /* room for the rest */
  assert_int_equal(sgm_pointer_tier(ctx, m), SGM_TIER_VRAM);
  assert_int_equal(sgm_pointer_tier(ctx, l), SGM_TIER_VRAM);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_promotions, 3);
  assert_int_equal(st.managed_promoted_bytes, 12 * MiB);
  check_invariants(ctx);
  sgm_free(ctx, h, NULL);
  sgm_free(ctx, m, NULL);
  sgm_free(ctx, l, NULL);
  sgm_context_destroy(ctx);
}

/* A cold block stays in shared memory when room appears; a hot hint brings it back. */
static void test_cold_block_stays_down(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("16MiB", "managed");
  void *a = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_int_equal(sgm_advise(ctx, a, SGM_PRIORITY_MAXIMUM, SGM_HINT_COLD), SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, a), SGM_TIER_SHARED);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, a), SGM_TIER_SHARED);
  assert_int_equal(sgm_advise(ctx, a, SGM_PRIORITY_MAXIMUM, SGM_HINT_HOT), SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, a), SGM_TIER_VRAM);
  check_invariants(ctx);
  sgm_free(ctx, a, NULL);
  sgm_context_destroy(ctx);
}

/* Small blocks and fixed contexts never move; bad arguments are refused. */
static void test_what_does_not_move(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("16MiB", "managed");
  void *small = sgm_alloc(ctx, SGM_MANAGED_MOVABLE_BYTES - 1, NULL);
  assert_non_null(small);
  assert_int_equal(sgm_pointer_tier(ctx, small), SGM_TIER_VRAM);
  assert_int_equal(sgm_prefetch(ctx, small, 1, SGM_TIER_SHARED, NULL), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "not inside one live managed block"));
  void *big = sgm_alloc(ctx, 3 * MiB, NULL);
  assert_int_equal(sgm_prefetch(ctx, (char *)big + MiB, 2 * MiB + 1, SGM_TIER_SHARED, NULL),
                   SGM_ERR_INVALID); /* past the block's end */
  assert_int_equal(sgm_prefetch(ctx, (char *)big + MiB, MiB, SGM_TIER_SHARED, NULL), SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, big), SGM_TIER_SHARED); /* pages move whole: the block */
  assert_int_equal(sgm_prefetch(ctx, big, 1, SGM_TIER_DISK, NULL), SGM_ERR_INVALID);
  assert_int_equal(sgm_advise(ctx, big, (sgm_priority)7, SGM_HINT_NONE), SGM_ERR_INVALID);
  assert_int_equal(sgm_record_stream(ctx, big, NULL), SGM_OK);
  assert_int_equal(sgm_free_ex(ctx, big, NULL), SGM_OK);
  assert_int_equal(sgm_free_ex(ctx, big, NULL), SGM_ERR_INVALID); /* twice */
  assert_int_equal(sgm_pointer_tier(ctx, big), SGM_TIER_NONE);
  sgm_free(ctx, small, NULL);
  check_invariants(ctx);
  sgm_context_destroy(ctx);

  ctx = make_ctx("16MiB", "fixed");
  big = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_int_equal(sgm_advise(ctx, big, SGM_PRIORITY_LOW, SGM_HINT_COLD), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "fixed"));
  sgm_backend_counters c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.n_managed_live, 0);
  sgm_free(ctx, big, NULL);
  sgm_context_destroy(ctx);
}

/* Without Unified Memory: managed is refused with the reason; auto runs fixed. */
static void test_refused_or_downgraded(void **state) {
  (void)state;
  sgm_test_clean_env();
  setenv("SGM_EMU_MANAGED", "off", 1);
  setenv("SGM_POINTERS", "managed", 1);
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_ERR_UNSUPPORTED);
  assert_null(ctx);
  assert_non_null(strstr(sgm_last_error(), "SGM_POINTERS=managed is not possible here"));
  assert_non_null(strstr(sgm_last_error(), "concurrent managed access"));
  setenv("SGM_POINTERS", "auto", 1);
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  void *p = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(p);
  assert_int_equal(sgm_prefetch(ctx, p, 1, SGM_TIER_SHARED, NULL), SGM_ERR_INVALID);
  sgm_free(ctx, p, NULL);
  sgm_context_destroy(ctx);
  setenv("SGM_POINTERS", "bogus", 1);
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "SGM_POINTERS"));
  sgm_test_clean_env();
}

/* ---- the cache of freed movable ranges ---- */

static uint64_t live_ranges(sgm_context *ctx) {
  sgm_backend_counters c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  return c.n_managed_live;
}

/* A freed movable range is handed out again (same address, no driver call)
 * to a request of its size or up to 1/8 less, placed where it was; the bytes
 * of the new block are the user's to write (no zeroing promised, none
 * relied on); a request that would waste more gets a range of its own. */
static void test_cache_reuses_a_freed_range(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("24MiB", "managed");
  uint8_t *a = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(a);
  fill(a, 4 * MiB, 1);
  sgm_free(ctx, a, NULL);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.managed_cached_bytes, 4 * MiB);
  assert_int_equal(st.tier[SGM_TIER_VRAM].cached_bytes, 4 * MiB);
  assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, 0);
  assert_int_equal(st.n_managed_live, 0);
  assert_int_equal(sgm_pointer_tier(ctx, a), SGM_TIER_NONE); /* not live while cached */
  assert_int_equal(sgm_free_ex(ctx, a, NULL), SGM_ERR_INVALID); /* a double free is still one */
  check_invariants(ctx);
  sgm_backend_counters before;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &before);
  uint8_t *b = sgm_alloc(ctx, 4 * MiB - 12345, NULL); /* within 1/8: reused, slack counted */
  assert_ptr_equal(b, a);
  sgm_backend_counters after;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &after);
  assert_int_equal(after.n_calls, before.n_calls); /* no driver call */
  assert_int_equal(sgm_pointer_tier(ctx, b), SGM_TIER_VRAM);
  fill(b, 4 * MiB - 12345, 2);
  verify(b, 4 * MiB - 12345, 2);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_cache_hits, 1);
  assert_int_equal(st.managed_cached_bytes, 0);
  assert_int_equal(st.managed_slack_bytes, 0); /* 4 MiB - 12345 rounds up to 4 MiB */
  assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, 4 * MiB);
  sgm_free(ctx, b, NULL);
  uint8_t *c = sgm_alloc(ctx, 4 * MiB - 256 * 1024, NULL); /* 1/16 less: reused, 256 KiB slack */
  assert_ptr_equal(c, a);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.managed_slack_bytes, 256 * 1024);
  /* The slack is committed, not used: used is the request rounded to pages. */
  assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, 4 * MiB - 256 * 1024);
  assert_int_equal(st.tier[SGM_TIER_VRAM].committed_bytes, 4 * MiB);
  sgm_free(ctx, c, NULL);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.managed_slack_bytes, 0);
  uint8_t *d = sgm_alloc(ctx, 2 * MiB, NULL); /* half: a range of its own */
  assert_non_null(d);
  assert_ptr_not_equal(d, a);
  assert_int_equal(live_ranges(ctx), 2);
  check_invariants(ctx);
  sgm_free(ctx, d, NULL);
  /* Shared-placed ranges are cached there and reused for shared placements. */
  uint8_t *e = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_ptr_equal(e, a);
  assert_int_equal(sgm_prefetch(ctx, e, 4 * MiB, SGM_TIER_SHARED, NULL), SGM_OK);
  fill(e, 4 * MiB, 3);
  sgm_free(ctx, e, NULL);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.tier[SGM_TIER_SHARED].cached_bytes, 4 * MiB);
  check_invariants(ctx);
  sgm_context_destroy(ctx); /* gives every cached range back (ASan and the counters' leak check) */
}

/* A steady-state pair of a cached movable range takes no placement lock
 * (pl->lock, shared by every buffer and block of the context): the cache
 * and the managed map have a lock of their own, and a cached range stays in
 * the map and the list of all buffers, so neither is relinked. Counted with
 * the lock's take counter; the ranges are reused (same pointers, cache hits)
 * and their bytes stay the caller's. */
static void test_steady_pair_takes_no_placement_lock(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("48MiB", "managed");
  struct sgm_placement *pl = sgm__context_pl(ctx);
  enum { RING = 4, PAIRS = 64 };
  uint8_t *ring[RING];
  for (int i = 0; i < RING; i++) {
    ring[i] = sgm_alloc(ctx, 4 * MiB, NULL);
    assert_non_null(ring[i]);
  }
  sgm_free(ctx, ring[0], NULL); /* warm: one range cached */
  ring[0] = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(ring[0]);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  uint64_t hits = st.n_managed_cache_hits;
  uint64_t takes = sgm__lock_takes(&pl->lock);
  for (int k = 0; k < PAIRS; k++) {
    uint8_t *was = ring[k % RING];
    sgm_free(ctx, was, NULL);
    ring[k % RING] = sgm_alloc(ctx, 4 * MiB, NULL);
    assert_ptr_equal(ring[k % RING], was); /* the range it just freed */
    fill(ring[k % RING], 64 * 1024, (uint8_t)k);
  }
  assert_int_equal(sgm__lock_takes(&pl->lock), takes);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_cache_hits, hits + PAIRS);
  assert_int_equal(st.n_managed_live, RING);
  for (int k = PAIRS - RING; k < PAIRS; k++) verify(ring[k % RING], 64 * 1024, (uint8_t)k);
  check_invariants(ctx);
  for (int i = 0; i < RING; i++) sgm_free(ctx, ring[i], NULL);
  check_invariants(ctx);
  sgm_context_destroy(ctx);
}

/* A reused range's policy listing may wait (pending), but never past a victim
 * search: the block the policy would pick is still the one demoted when a new
 * one needs room, even if it just came from the cache (here the only one at
 * normal priority), and its bytes move with it. */
static void test_reused_block_is_still_a_victim(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("16MiB", "managed");
  uint8_t *a = sgm_alloc(ctx, 4 * MiB, NULL);
  uint8_t *b = sgm_alloc(ctx, 4 * MiB, NULL);
  uint8_t *c = sgm_alloc(ctx, 4 * MiB, NULL);
  uint8_t *d = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_true(a && b && c && d);
  uint8_t *high[] = {b, c, d};
  for (int i = 0; i < 3; i++)
    assert_int_equal(sgm_advise(ctx, high[i], SGM_PRIORITY_HIGH, SGM_HINT_NONE), SGM_OK);
  sgm_free(ctx, a, NULL);
  uint8_t *a2 = sgm_alloc(ctx, 4 * MiB, NULL); /* the cached range: its listing deferred */
  assert_ptr_equal(a2, a);
  fill(a2, 4 * MiB, 7);
  uint8_t *e = sgm_alloc(ctx, 4 * MiB, NULL); /* VRAM is full: the normal-priority a2 makes room */
  assert_non_null(e);
  assert_int_equal(sgm_pointer_tier(ctx, a2), SGM_TIER_SHARED);
  for (int i = 0; i < 3; i++) assert_int_equal(sgm_pointer_tier(ctx, high[i]), SGM_TIER_VRAM);
  assert_int_equal(sgm_pointer_tier(ctx, e), SGM_TIER_VRAM);
  verify(a2, 4 * MiB, 7);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_demotions, 1);
  assert_int_equal(st.n_fallbacks, 0);
  check_invariants(ctx);
  sgm_free(ctx, a2, NULL);
  for (int i = 0; i < 3; i++) sgm_free(ctx, high[i], NULL);
  sgm_free(ctx, e, NULL);
  check_invariants(ctx);
  sgm_context_destroy(ctx);
}

/* Threads pairing allocations and frees of cached ranges, hinting and
 * prefetching their own blocks while the others' allocations demote and
 * their frees promote: the managed lock, the deferred listings and the
 * residency locks together keep every invariant, and the bytes of each
 * thread's anchor block (written before the threads start, never written
 * during: the emulated device moves pages by copying, so a write racing a
 * move could be lost there, not on a GPU) survive every move. TSan runs it. */
typedef struct race_job {
  sgm_context *ctx; /* shared */
  uint64_t seed;    /* this thread's random stream */
  uint8_t *anchor;  /* this thread's block, verified after the join */
} race_job;

static void *race_main(void *arg) {
  race_job *j = arg;
  sgm_test_rng r;
  sgm_test_rng_init(&r, j->seed);
  enum { RING = 3 };
  uint8_t *ring[RING] = {0};
  for (int step = 0; step < 150; step++) {
    int i = (int)sgm_test_rng_range(&r, 0, RING - 1);
    switch (sgm_test_rng_range(&r, 0, 5)) {
    case 0:
    case 1:
    case 2: /* a pair of movable blocks: most are cache hits */
      sgm_free(j->ctx, ring[i], NULL);
      ring[i] = sgm_alloc(j->ctx, 2 * MiB + (size_t)sgm_test_rng_range(&r, 0, 3) * 64 * 1024, NULL);
      break;
    case 3:
      sgm_advise(j->ctx, sgm_test_rng_range(&r, 0, 1) ? j->anchor : ring[i] ? ring[i] : j->anchor,
                 (sgm_priority)sgm_test_rng_range(&r, 0, 4),
                 (sgm_hint)sgm_test_rng_range(&r, SGM_HINT_NONE, SGM_HINT_COLD));
      break;
    default:
      sgm_prefetch(j->ctx, j->anchor, 2 * MiB, sgm_test_rng_range(&r, 0, 1) ? SGM_TIER_VRAM : SGM_TIER_SHARED,
                   NULL);
      break;
    }
  }
  for (int i = 0; i < RING; i++) sgm_free(j->ctx, ring[i], NULL);
  return NULL;
}

static void test_threads_pair_and_move(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("test_managed threads", 1414);
  sgm_context *ctx = make_ctx("12MiB", "managed");
  enum { T = 3 };
  race_job job[T];
  pthread_t th[T];
  for (int t = 0; t < T; t++) {
    job[t] = (race_job){.ctx = ctx, .seed = seed * 31 + (uint64_t)t + 1, .anchor = sgm_alloc(ctx, 2 * MiB, NULL)};
    assert_non_null(job[t].anchor);
    fill(job[t].anchor, 2 * MiB, 100 + (uint64_t)t);
  }
  for (int t = 0; t < T; t++) assert_int_equal(pthread_create(&th[t], NULL, race_main, &job[t]), 0);
  for (int t = 0; t < T; t++) assert_int_equal(pthread_join(th[t], NULL), 0);
  for (int t = 0; t < T; t++) verify(job[t].anchor, 2 * MiB, 100 + (uint64_t)t);
  check_invariants(ctx);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_live, T);
  /* How many pairs hit the cache depends on how the threads interleave (the
   * cache goes back before every demotion and promotion): printed, not
   * asserted; test_cache_reuses_a_freed_range checks the hit itself. */
  printf("# %llu cache hits, %llu demotions, %llu promotions\n", (unsigned long long)st.n_managed_cache_hits,
         (unsigned long long)st.n_managed_demotions, (unsigned long long)st.n_managed_promotions);
  for (int t = 0; t < T; t++) sgm_free(ctx, job[t].anchor, NULL);
  check_invariants(ctx);
  sgm_context_destroy(ctx);
}

/* Cached ranges hold budget (committed, not used) and go back before anything
 * moves or falls back: the budget is never exceeded counting them, and a new
 * block that needs their room gets it without a demotion or a fallback. */
static void test_cache_yields_before_anything_moves(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("12MiB", "managed");
  void *p[3];
  for (int i = 0; i < 3; i++) p[i] = sgm_alloc(ctx, 4 * MiB, NULL);
  void *keep = sgm_alloc(ctx, 4 * MiB, NULL); /* VRAM full: p[0] demoted */
  assert_int_equal(sgm_pointer_tier(ctx, p[0]), SGM_TIER_SHARED);
  sgm_free(ctx, keep, NULL); /* VRAM room: p[0] comes back, so nothing is cached in VRAM */
  assert_int_equal(sgm_pointer_tier(ctx, p[0]), SGM_TIER_VRAM);
  for (int i = 0; i < 3; i++) sgm_free(ctx, p[i], NULL);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.tier[SGM_TIER_VRAM].cached_bytes, 12 * MiB);
  check_invariants(ctx);
  uint64_t demotions = st.n_managed_demotions;
  /* 8 MiB fits no cached range: two of them go back, none moves. */
  void *big = sgm_alloc(ctx, 8 * MiB, NULL);
  assert_int_equal(sgm_pointer_tier(ctx, big), SGM_TIER_VRAM);
  check_invariants(ctx);
  /* A fixed block (under 2 MiB) takes the last cached range's room. */
  void *small = sgm_alloc(ctx, MiB, NULL);
  assert_int_equal(sgm_pointer_tier(ctx, small), SGM_TIER_VRAM);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_fallbacks, 0);
  assert_int_equal(st.n_managed_demotions, demotions);
  assert_int_equal(st.managed_cached_bytes, 0);
  assert_int_equal(live_ranges(ctx), 1);
  check_invariants(ctx);
  sgm_free(ctx, big, NULL);
  sgm_free(ctx, small, NULL);
  sgm_context_destroy(ctx);
}

static uint64_t test_clock_ms;
static uint64_t test_clock(void *user) {
  (void)user;
  return __atomic_load_n(&test_clock_ms, __ATOMIC_RELAXED);
}

/* sgm_trim, the idle tick (once SGM_IDLE_TRIM_MS passed) and a lowered budget
 * give cached ranges back to the driver. */
static void test_cache_goes_back_to_the_driver(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("24MiB", "managed");
  void *a = sgm_alloc(ctx, 4 * MiB, NULL);
  sgm_free(ctx, a, NULL);
  assert_int_equal(live_ranges(ctx), 1);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  assert_int_equal(live_ranges(ctx), 0);
  check_invariants(ctx);
  sgm_context_destroy(ctx);

  sgm_test_clean_env(); /* again, with an idle delay (make_ctx sets none) */
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "32MiB", 1);
  setenv("SGM_SHARED_LIMIT", "256MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "1000", 1);
  setenv("SGM_POINTERS", "managed", 1);
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  __atomic_store_n(&test_clock_ms, 5000, __ATOMIC_RELAXED);
  sgm__context_set_clock(ctx, test_clock, NULL);
  a = sgm_alloc(ctx, 4 * MiB, NULL);
  void *b = sgm_alloc(ctx, 8 * MiB, NULL);
  sgm_free(ctx, a, NULL);
  sgm__context_idle_tick(ctx); /* a seen cached at 5000 */
  __atomic_store_n(&test_clock_ms, 5600, __ATOMIC_RELAXED);
  sgm_free(ctx, b, NULL);
  sgm__context_idle_tick(ctx); /* b at 5600 */
  __atomic_store_n(&test_clock_ms, 5999, __ATOMIC_RELAXED);
  sgm__context_idle_tick(ctx); /* neither idle for 1000 ms yet */
  assert_int_equal(live_ranges(ctx), 2);
  __atomic_store_n(&test_clock_ms, 6000, __ATOMIC_RELAXED);
  sgm__context_idle_tick(ctx); /* a is */
  assert_int_equal(live_ranges(ctx), 1);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.managed_cached_bytes, 8 * MiB);
  /* A budget lowered under the cached range: it goes back. */
  assert_int_equal(sgm__context_set_vram_fraction(ctx, 4.0 / 64), SGM_OK);
  assert_int_equal(live_ranges(ctx), 0);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_true(st.tier[SGM_TIER_VRAM].committed_bytes <= st.tier[SGM_TIER_VRAM].budget_bytes);
  check_invariants(ctx);
  sgm_context_destroy(ctx);
  sgm_test_clean_env();
}

/* The spy of test_released_range_is_not_used: the real backend, and what
 * sgm_get_stats said while a cached range was being given back. */
static const sgm_backend_ops *spy_real;
static sgm_context *spy_ctx;
static uint64_t spy_used[2], spy_calls;

static void spy_managed_free(sgm_backend *be, sgm_devptr d, uint64_t bytes) {
  sgm_stats st;
  assert_int_equal(sgm_get_stats(spy_ctx, &st), SGM_OK);
  for (int t = 0; t < 2; t++) spy_used[t] += st.tier[t].used_bytes;
  spy_calls++;
  spy_real->managed_free(be, d, bytes);
}

/*
 * A cached range on its way back to the driver (sgm_trim here; the idle
 * trim's thread the same way) is used by nobody: sgm_get_stats read while
 * the driver frees it reports no used bytes. It once took the range's charge,
 * still held, for used bytes (charged minus cached): the model test saw
 * "everything freed, yet tier shared holds 3407872 bytes in 0 objects" when
 * its idle thread released the cache as the test read the stats.
 */
static void test_released_range_is_not_used(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("24MiB", "managed");
  void *a = sgm_alloc(ctx, 4 * MiB, NULL);
  void *b = sgm_alloc(ctx, 40 * MiB, NULL); /* past the VRAM budget: shared memory */
  assert_int_equal(sgm_pointer_tier(ctx, b), SGM_TIER_SHARED);
  sgm_free(ctx, a, NULL);
  sgm_free(ctx, b, NULL);
  uint64_t cached = live_ranges(ctx); /* cached ranges, still the driver's */
  assert_true(cached >= 1);
  static sgm_backend_ops spy;
  spy_real = sgm__context_bops(ctx);
  spy = *spy_real;
  spy.managed_free = spy_managed_free;
  spy_ctx = ctx;
  spy_used[0] = spy_used[1] = spy_calls = 0;
  sgm__context_set_bops(ctx, &spy);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm__context_set_bops(ctx, spy_real);
  assert_int_equal(spy_calls, cached);
  assert_int_equal(spy_used[SGM_TIER_VRAM], 0);
  assert_int_equal(spy_used[SGM_TIER_SHARED], 0);
  assert_int_equal(live_ranges(ctx), 0);
  check_invariants(ctx);
  sgm_context_destroy(ctx);
}

/* A test policy: lru, but the oldest block (the lowest id) comes back first. */
static bool oldest_first(sgm_policy *p, const sgm_policy_item *a, const sgm_policy_item *b) {
  (void)p;
  assert_null(a->state); /* sgm's copies */
  assert_int_equal(a->priority, b->priority); /* only asked within a level */
  return a->id < b->id;
}

/* Which shared-placed block comes back into the room a free leaves is the
 * VRAM policy's promote_before when it has one (ABI 3), else the most
 * recently allocated or used; a higher priority comes first either way. */
static void run_promotion_order(const char *policy, int expect_back) {
  sgm_context *ctx = make_ctx_policy("12MiB", "managed", policy);
  void *p[3];
  for (int i = 0; i < 3; i++) p[i] = sgm_alloc(ctx, 4 * MiB, NULL);
  for (int i = 0; i < 3; i++)
    assert_int_equal(sgm_prefetch(ctx, p[i], 4 * MiB, SGM_TIER_SHARED, NULL), SGM_OK);
  void *z = sgm_alloc(ctx, 4 * MiB, NULL);
  void *y = sgm_alloc(ctx, 8 * MiB, NULL);
  assert_int_equal(sgm_pointer_tier(ctx, y), SGM_TIER_VRAM);
  sgm_free(ctx, z, NULL); /* room for one */
  for (int i = 0; i < 3; i++)
    assert_int_equal(sgm_pointer_tier(ctx, p[i]), i == expect_back ? SGM_TIER_VRAM : SGM_TIER_SHARED);
  /* A higher priority still comes back first, whatever the policy says. */
  int low = expect_back == 2 ? 0 : 2; /* in shared memory, and not the order's next */
  assert_int_equal(sgm_advise(ctx, p[low], SGM_PRIORITY_HIGH, SGM_HINT_NONE), SGM_OK);
  assert_int_equal(sgm_prefetch(ctx, p[expect_back], 4 * MiB, SGM_TIER_SHARED, NULL), SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, p[low]), SGM_TIER_SHARED);
  assert_int_equal(sgm_trim(ctx), SGM_OK); /* room for one: the high-priority block */
  assert_int_equal(sgm_pointer_tier(ctx, p[low]), SGM_TIER_VRAM);
  check_invariants(ctx);
  for (int i = 0; i < 3; i++) sgm_free(ctx, p[i], NULL);
  sgm_free(ctx, y, NULL);
  sgm_context_destroy(ctx);
}

static void test_policy_orders_promotions(void **state) {
  (void)state;
  run_promotion_order(NULL, 2); /* the most recently allocated */
  static sgm_policy_ops ops;
  if (!sgm_policy_find("lru-oldest-up")) {
    ops = *sgm_policy_find("lru");
    ops.name = "lru-oldest-up";
    ops.promote_before = oldest_first;
    assert_int_equal(sgm_policy_register(&ops), SGM_OK);
  }
  run_promotion_order("lru-oldest-up", 0);
  sgm_test_clean_env();
}

/* Every device call on the way of a managed allocation and its moves may
 * fail: each run ends whole, with nothing leaked. */
/* One run of the fault test: allocate, move and free three blocks with the
 * fail_at-th device call failing (0 = none); returns the device calls made. */
static uint64_t run_with_failure(int fail_at) {
  char at[16];
  snprintf(at, sizeof at, "%d", fail_at);
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "4MiB", 1);
  setenv("SGM_SHARED_LIMIT", "64MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);
  setenv("SGM_POINTERS", "managed", 1);
  setenv("SGM_EMU_FAIL_AT", at, 1);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) return 0;
  void *p[3];
  for (int i = 0; i < 3; i++) {
    p[i] = sgm_alloc(ctx, 2 * MiB, NULL);
    if (p[i]) fill(p[i], 2 * MiB, (uint64_t)i);
  }
  for (int i = 0; i < 3; i++) {
    if (!p[i]) continue;
    (void)sgm_prefetch(ctx, p[i], 2 * MiB, SGM_TIER_VRAM, NULL);
    (void)sgm_advise(ctx, p[i], SGM_PRIORITY_LOW, SGM_HINT_COLD);
    verify(p[i], 2 * MiB, (uint64_t)i);
    check_invariants(ctx);
  }
  for (int i = 0; i < 3; i++) sgm_free(ctx, p[i], NULL);
  check_invariants(ctx);
  (void)sgm_trim(ctx); /* the cached ranges go back */
  sgm_backend_counters c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.n_managed_live, 0);
  assert_int_equal(c.managed_device_bytes + c.managed_host_bytes, 0);
  sgm_context_destroy(ctx);
  return c.n_calls;
}

/* Every device call on the way of a managed allocation and its moves may
 * fail, in turn: each run ends whole, with nothing leaked. */
static void test_every_failure_leaves_things_whole(void **state) {
  (void)state;
  uint64_t n_calls = run_with_failure(0);
  assert_true(n_calls > 10);
  for (int n = 2; n <= (int)n_calls; n++) run_with_failure(n);
  sgm_test_clean_env();
}

/* ---- the copy-stream worker: moves past the inline bound are queued ---- */

/* A managed block's bytes as sgm counts them (whole 64 KiB pages). */
static uint64_t pages_of(uint64_t n) { return (n + SGM_MANAGED_PAGE - 1) / SGM_MANAGED_PAGE * SGM_MANAGED_PAGE; }

/* The free path's bound: a free moves at most 8 MiB on the freeing thread
 * (here the 4 MiB block with the highest priority); the two larger blocks
 * waiting in shared memory are queued, their room charged at once, and the
 * worker brings them up with their bytes whole (seeded patterns). */
static void test_free_queues_moves_past_the_bound(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("test_managed queued promotions", 1414);
  sgm_context *ctx = make_ctx("48MiB", "managed");
  const uint64_t size[3] = {4 * MiB + 4321, 16 * MiB, 12 * MiB + 77};
  uint8_t *p[3];
  for (int i = 0; i < 3; i++) {
    p[i] = sgm_alloc(ctx, size[i], NULL);
    assert_non_null(p[i]);
    fill(p[i], size[i], seed + (uint64_t)i);
    assert_int_equal(sgm_prefetch(ctx, p[i], size[i], SGM_TIER_SHARED, NULL), SGM_OK);
  }
  assert_int_equal(sgm_advise(ctx, p[0], SGM_PRIORITY_HIGH, SGM_HINT_NONE), SGM_OK);
  void *f = sgm_alloc(ctx, 48 * MiB, NULL);
  assert_int_equal(sgm_pointer_tier(ctx, f), SGM_TIER_VRAM);
  sgm_stats a, b;
  assert_int_equal(sgm_get_stats(ctx, &a), SGM_OK);
  sgm_free(ctx, f, NULL);
  assert_int_equal(sgm_get_stats(ctx, &b), SGM_OK);
  /* Moved on this thread: the first block only, within the bound. */
  assert_int_equal(b.managed_inline_moved_bytes - a.managed_inline_moved_bytes, pages_of(size[0]));
  assert_true(b.managed_inline_moved_bytes - a.managed_inline_moved_bytes <= 8 * MiB);
  assert_int_equal(sgm_pointer_tier(ctx, p[0]), SGM_TIER_VRAM);
  assert_int_equal(b.n_managed_moves_queued - a.n_managed_moves_queued, 2);
  /* Their room is charged while they wait (or already moved). */
  assert_int_equal(sgm__tier_charged(sgm__context_tier(ctx, SGM_TIER_VRAM)),
                   pages_of(size[0]) + pages_of(size[1]) + pages_of(size[2]));
  sgm__managed_queue_wait(ctx, true);
  assert_int_equal(sgm_get_stats(ctx, &b), SGM_OK);
  assert_int_equal(b.n_managed_moves_done - a.n_managed_moves_done, 2);
  assert_int_equal(b.managed_worker_moved_bytes - a.managed_worker_moved_bytes,
                   pages_of(size[1]) + pages_of(size[2]));
  assert_int_equal(b.managed_queued_bytes, 0);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_VRAM);
    verify(p[i], size[i], seed + (uint64_t)i);
  }
  check_invariants(ctx);
  for (int i = 0; i < 3; i++) sgm_free(ctx, p[i], NULL);
  sgm_context_destroy(ctx);
}

/* A cold hint on a block over the bound queues its demotion (the caller
 * moves nothing); once done, the worker gives its room to the block waiting
 * in shared memory. */
static void test_cold_hint_queues_a_large_demotion(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("test_managed queued demotion", 1415);
  sgm_context *ctx = make_ctx("32MiB", "managed");
  uint8_t *w = sgm_alloc(ctx, 12 * MiB, NULL);
  fill(w, 12 * MiB, seed);
  assert_int_equal(sgm_prefetch(ctx, w, 12 * MiB, SGM_TIER_SHARED, NULL), SGM_OK);
  uint8_t *big = sgm_alloc(ctx, 16 * MiB, NULL), *other = sgm_alloc(ctx, 16 * MiB, NULL);
  fill(big, 16 * MiB, seed + 1);
  assert_int_equal(sgm_pointer_tier(ctx, big), SGM_TIER_VRAM);
  assert_int_equal(sgm_pointer_tier(ctx, other), SGM_TIER_VRAM);
  sgm_stats a, b;
  assert_int_equal(sgm_get_stats(ctx, &a), SGM_OK);
  assert_int_equal(sgm_advise(ctx, big, SGM_PRIORITY_NORMAL, SGM_HINT_COLD), SGM_OK);
  assert_int_equal(sgm_get_stats(ctx, &b), SGM_OK);
  assert_int_equal(b.managed_inline_moved_bytes, a.managed_inline_moved_bytes);
  assert_int_equal(b.n_managed_moves_queued - a.n_managed_moves_queued, 1);
  sgm__managed_queue_wait(ctx, true);
  assert_int_equal(sgm_pointer_tier(ctx, big), SGM_TIER_SHARED);
  assert_int_equal(sgm_pointer_tier(ctx, w), SGM_TIER_VRAM);
  assert_int_equal(sgm_get_stats(ctx, &b), SGM_OK);
  assert_int_equal(b.managed_worker_moved_bytes - a.managed_worker_moved_bytes, 28 * MiB);
  verify(big, 16 * MiB, seed + 1);
  verify(w, 12 * MiB, seed);
  check_invariants(ctx);
  sgm_free(ctx, w, NULL);
  sgm_free(ctx, big, NULL);
  sgm_free(ctx, other, NULL);
  sgm_context_destroy(ctx);
}

/* One word of every 4 KiB and the last word: a page moved to a wrong offset
 * shows (cheap enough to run after every step under the sanitizers). */
static void verify_sparse(const uint8_t *p, uint64_t n, uint64_t seed) {
  for (uint64_t w = 0; w < n / 8; w += 512) {
    uint64_t v = pattern(seed, w), got;
    memcpy(&got, p + 8 * w, 8);
    if (got != v) fail_msg("bytes %llu..%llu of a %llu-byte block (seed %llu) changed", (unsigned long long)(8 * w),
                           (unsigned long long)(8 * w + 7), (unsigned long long)n, (unsigned long long)seed);
  }
  if (n >= 8) {
    uint64_t w = n / 8 - 1, v = pattern(seed, w), got;
    memcpy(&got, p + 8 * w, 8);
    if (got != v) fail_msg("the last word of a %llu-byte block (seed %llu) changed", (unsigned long long)n,
                           (unsigned long long)seed);
  }
}

/* Bytes survive any sequence with the worker moving blocks meanwhile (the
 * test reads them while it runs; it writes only when nothing is queued, as
 * the emulated device copies between its stores): random, seed printed;
 * every byte checked every 10 steps, a word per 4 KiB after each. */
static void test_bytes_survive_queued_moves(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("test_managed queued moves", 1416);
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  sgm_context *ctx = make_ctx("32MiB", "managed");
  enum { N = 5 };
  uint8_t *p[N] = {0};
  uint64_t size[N] = {0}, tag[N] = {0};
  for (int step = 0; step < 60; step++) {
    int i = (int)sgm_test_rng_range(&r, 0, N - 1);
    int op = (int)sgm_test_rng_range(&r, 0, 5);
    if (!p[i]) op = 0;
    switch (op) {
    case 0:
      if (p[i]) assert_int_equal(sgm_free_ex(ctx, p[i], NULL), SGM_OK); /* may cancel its queued move */
      size[i] = sgm_test_rng_range(&r, 2 * MiB, 20 * MiB + 999);
      tag[i] = sgm_test_rng_next(&r);
      p[i] = sgm_alloc(ctx, size[i], NULL);
      if (!p[i]) fail_msg("alloc %llu: %s", (unsigned long long)size[i], sgm_last_error());
      sgm__managed_queue_wait(ctx, true);
      fill(p[i], size[i], tag[i]);
      break;
    case 1:
      assert_int_equal(sgm_prefetch(ctx, p[i], size[i], SGM_TIER_SHARED, NULL), SGM_OK);
      assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_SHARED);
      break;
    case 2: {
      sgm_status s = sgm_prefetch(ctx, p[i], size[i], SGM_TIER_VRAM, NULL);
      if (s != SGM_OK) assert_int_equal(s, SGM_ERR_NOMEM);
      break;
    }
    case 3:
      assert_int_equal(sgm_advise(ctx, p[i], (sgm_priority)sgm_test_rng_range(&r, 0, 4), SGM_HINT_HOT), SGM_OK);
      break;
    case 4:
      assert_int_equal(sgm_advise(ctx, p[i], SGM_PRIORITY_NORMAL, SGM_HINT_COLD), SGM_OK);
      break;
    case 5:
      assert_int_equal(sgm_trim(ctx), SGM_OK); /* runs what is queued */
      assert_int_equal(sgm_pointer_tier(ctx, p[i]) == SGM_TIER_NONE, false);
      break;
    }
    verify_sparse(p[i], size[i], tag[i]);
    if (step % 10 == 9) {
      sgm__managed_queue_wait(ctx, true);
      check_invariants(ctx);
      for (int k = 0; k < N; k++)
        if (p[k]) verify(p[k], size[k], tag[k]);
    }
  }
  sgm_stats st;
  sgm__managed_queue_wait(ctx, true);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  printf("# queued moves: %llu done, %llu cancelled of %llu\n", (unsigned long long)st.n_managed_moves_done,
         (unsigned long long)st.n_managed_moves_cancelled, (unsigned long long)st.n_managed_moves_queued);
  assert_true(st.n_managed_moves_queued > 0);
  assert_int_equal(st.n_managed_moves_queued, st.n_managed_moves_done + st.n_managed_moves_cancelled);
  assert_int_equal(st.managed_queued_bytes, 0);
  for (int i = 0; i < N; i++) {
    verify(p[i], size[i], tag[i]);
    sgm_free(ctx, p[i], NULL);
  }
  check_invariants(ctx);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm_backend_counters c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.n_managed_live, 0);
  sgm_context_destroy(ctx);
}

/* One run of the queue's fault test: a 9 MiB block waiting in shared memory
 * whose promotion a free queues, with the fail_at-th device call failing
 * (0 = none; the worker's calls included: the test makes none while it
 * runs, so the count is the same every run). Returns the calls made. */
static uint64_t run_queue_with_failure(int fail_at, uint64_t *calls_before_free) {
  char at[16];
  snprintf(at, sizeof at, "%d", fail_at);
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "12MiB", 1);
  setenv("SGM_SHARED_LIMIT", "64MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);
  setenv("SGM_POINTERS", "managed", 1);
  setenv("SGM_EMU_FAIL_AT", at, 1);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) return 0;
  uint8_t *a = sgm_alloc(ctx, 9 * MiB, NULL);
  if (a) {
    fill(a, 9 * MiB, 41);
    (void)sgm_prefetch(ctx, a, 9 * MiB, SGM_TIER_SHARED, NULL);
  }
  void *f = sgm_alloc(ctx, 12 * MiB, NULL);
  sgm_backend_counters c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  *calls_before_free = c.n_calls;
  sgm_free(ctx, f, NULL); /* a's promotion is queued (or refused on the way) */
  sgm__managed_queue_wait(ctx, true);
  if (a) verify(a, 9 * MiB, 41);
  check_invariants(ctx);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_moves_queued, st.n_managed_moves_done + st.n_managed_moves_cancelled);
  assert_int_equal(st.managed_queued_bytes, 0);
  sgm_free(ctx, a, NULL);
  (void)sgm_trim(ctx);
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.n_managed_live, 0);
  assert_int_equal(c.n_events_live, 0);
  if (fail_at == 0) assert_int_equal(st.n_managed_moves_done, 1);
  sgm_context_destroy(ctx);
  return c.n_calls;
}

/* Every device call from the free on (queuing the move, the copy stream's
 * wait, the worker's advice and prefetch, the frees) may fail, in turn: each
 * run ends whole, the move done or dropped with its room given back, nothing
 * leaked (the calls before the free are test_every_failure_leaves_things_whole's). */
static void test_queue_failures_leave_things_whole(void **state) {
  (void)state;
  uint64_t before = 0, unused = 0;
  uint64_t n_calls = run_queue_with_failure(0, &before);
  assert_true(n_calls > before + 4);
  for (uint64_t n = before + 1; n <= n_calls; n++) run_queue_with_failure((int)n, &unused);
  sgm_test_clean_env();
}

/* ---- on the CUDA backend over the driver test double ---- */

#if defined(__has_include)
#if __has_include(<cuda.h>)
#define HAVE_CUDA_H 1
#endif
#endif

#ifdef HAVE_CUDA_H
#include <cuda.h>

#include "fake_cuda.h"

static struct {
#define FAKE_MEMBER(ret, name, params) ret(*name) params;
  FAKE_CUDA_CONTROL(FAKE_MEMBER)
#undef FAKE_MEMBER
} fc;
static bool have_double;
static void *fake_lib;

/* The double's driver version is below 12.2: managed mode cannot run. */
static bool old_driver(void) {
  const char *v = getenv("FAKE_CUDA_DRIVER_VERSION");
  return v && atoi(v) < 12020;
}

static void load_double(void) {
  fake_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  have_double = fake_lib != NULL;
#define FAKE_LOOKUP(ret, name, params)                   \
  if (fake_lib) {                                        \
    *(void **)&fc.name = dlsym(fake_lib, #name);         \
    if (!fc.name) have_double = false;                   \
  }
  FAKE_CUDA_CONTROL(FAKE_LOOKUP)
#undef FAKE_LOOKUP
  if (!have_double) printf("# managed: the driver test double is not on LD_LIBRARY_PATH: its cases skip\n");
}

static sgm_context *make_cuda_ctx_vram(const char *pointers, const char *vram_limit) {
  sgm_test_clean_env();
  unsetenv("FAKE_CUDA_CONCURRENT_MANAGED");
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("FAKE_CUDA_TOTAL_MEM", "256MiB", 1);
  setenv("SGM_VRAM_LIMIT", vram_limit, 1);
  setenv("SGM_SHARED_LIMIT", "64MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);
  setenv("SGM_POINTERS", pointers, 1);
  fc.fake_cuda_reset();
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) fail_msg("create: %s", sgm_last_error());
  return ctx;
}

static sgm_context *make_cuda_ctx(const char *pointers) { return make_cuda_ctx_vram(pointers, "16MiB"); }

static int page_at(const void *p, int *preferred, int *accessed_by) {
  return fc.fake_cuda_managed_page(p, preferred, accessed_by);
}

static void assert_driver_never_evicted(void) {
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  assert_int_equal(st.managed_evicted_bytes, 0);
}

/* The CUDA backend counts managed pages where sgm placed them: what it
 * charged to each budget (cached ranges included). */
static void assert_counted_as_charged(sgm_context *ctx, uint64_t device, uint64_t host) {
  sgm_backend_counters c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.managed_device_bytes, device);
  assert_int_equal(c.managed_host_bytes, host);
  assert_int_equal(c.managed_device_bytes, sgm__tier_charged(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  assert_int_equal(c.managed_host_bytes, sgm__tier_charged(sgm__context_tier(ctx, SGM_TIER_SHARED)));
}

/* Placement is advice + prefetch; the demoted block keeps its bytes. */
static void test_double_places_with_advice_and_prefetch(void **state) {
  (void)state;
  if (!have_double || old_driver()) skip();
  sgm_context *ctx = make_cuda_ctx("managed");
  uint8_t *a = sgm_alloc(ctx, 8 * MiB, NULL);
  assert_non_null(a);
  fill(a, 8 * MiB, 7); /* Unified Memory: the double's pages are the host's */
  int pref = 0, acc = 0;
  assert_int_equal(page_at(a, &pref, &acc), 1);
  assert_int_equal(pref, CU_MEM_LOCATION_TYPE_DEVICE);
  uint8_t *b = sgm_alloc(ctx, 8 * MiB, NULL);
  uint8_t *c = sgm_alloc(ctx, 8 * MiB, NULL); /* VRAM full: a (LRU) goes to shared memory */
  assert_non_null(b);
  assert_non_null(c);
  assert_int_equal(sgm_pointer_tier(ctx, a), SGM_TIER_SHARED);
  assert_int_equal(page_at(a + 8 * MiB - 1, &pref, &acc), 2);
  assert_true(pref == CU_MEM_LOCATION_TYPE_HOST || pref == CU_MEM_LOCATION_TYPE_HOST_NUMA);
  assert_int_equal(acc, 1); /* the device maps it: no fault per access */
  assert_int_equal(page_at(c, &pref, &acc), 1);
  verify(a, 8 * MiB, 7);
  assert_driver_never_evicted();
  assert_counted_as_charged(ctx, 16 * MiB, 8 * MiB);
  sgm_free(ctx, b, NULL); /* room: a comes back */
  assert_int_equal(sgm_pointer_tier(ctx, a), SGM_TIER_VRAM);
  assert_int_equal(page_at(a, &pref, &acc), 1);
  assert_int_equal(pref, CU_MEM_LOCATION_TYPE_DEVICE);
  verify(a, 8 * MiB, 7);
  assert_driver_never_evicted();
  assert_counted_as_charged(ctx, 16 * MiB, 0); /* b's cached range gave a its room */
  sgm_free(ctx, a, NULL);
  sgm_free(ctx, c, NULL);
  sgm_context_destroy(ctx);
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  assert_int_equal(st.managed_allocs, 0);
}

typedef struct prefetch_job {
  sgm_context *ctx;
  void *p;
  void *stream;
  sgm_status rc;
} prefetch_job;

static void *prefetch_main(void *arg) {
  prefetch_job *j = arg;
  j->rc = sgm_prefetch(j->ctx, j->p, 4 * MiB, SGM_TIER_SHARED, j->stream);
  return NULL;
}

/* A move waits, on the device, for the work queued before it on its stream. */
static void test_double_moves_after_the_callers_work(void **state) {
  (void)state;
  if (!have_double || old_driver()) skip();
  sgm_context *ctx = make_cuda_ctx("managed");
  void *s = fc.fake_cuda_stream_create();
  void *p = sgm_alloc(ctx, 4 * MiB, s);
  assert_non_null(p);
  assert_int_equal(page_at(p, NULL, NULL), 1);
  fc.fake_cuda_hold_stream(s, 1);
  void *ev = NULL; /* stands for a kernel on s still using p */
  assert_int_equal(sgm__context_bops(ctx)->event_record(sgm__context_be(ctx), s, &ev), SGM_OK);
  uint64_t before = fc.fake_cuda_calls("cuMemPrefetchAsync");
  prefetch_job j = {ctx, p, s, SGM_ERR_BACKEND};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, prefetch_main, &j), 0);
  while (fc.fake_cuda_calls("cuMemPrefetchAsync") == before) sched_yield(); /* queued, not slept */
  fc.fake_cuda_settle();
  assert_int_equal(page_at(p, NULL, NULL), 1); /* still on the device: the work is not done */
  fc.fake_cuda_complete_stream(s);
  pthread_join(t, NULL);
  fc.fake_cuda_hold_stream(s, 0);
  assert_int_equal(j.rc, SGM_OK);
  assert_int_equal(page_at(p, NULL, NULL), 2);
  assert_int_equal(sgm_pointer_tier(ctx, p), SGM_TIER_SHARED);
  sgm__context_bops(ctx)->event_destroy(sgm__context_be(ctx), ev);
  sgm_free(ctx, p, s);
  sgm_context_destroy(ctx);
  fc.fake_cuda_stream_destroy(s);
}

/* A range freed on stream s1 is reused on s1 at once (no ordering call) and
 * on s2 only ordered after s1's work (a device-side wait, no host wait):
 * s2's later work on it waits for s1's kernel. sgm_trim gives the ranges
 * back (the double's live managed allocations). */
static void test_double_cache_orders_other_streams(void **state) {
  (void)state;
  if (!have_double || old_driver()) skip();
  sgm_context *ctx = make_cuda_ctx("managed");
  void *s1 = fc.fake_cuda_stream_create(), *s2 = fc.fake_cuda_stream_create();
  void *p = sgm_alloc(ctx, 4 * MiB, s1);
  assert_non_null(p);
  fc.fake_cuda_hold_stream(s1, 1);
  void *ev = NULL; /* stands for a kernel on s1 still using p */
  assert_int_equal(sgm__context_bops(ctx)->event_record(sgm__context_be(ctx), s1, &ev), SGM_OK);
  sgm_free(ctx, p, s1);
  uint64_t records = fc.fake_cuda_calls("cuEventRecord") + fc.fake_cuda_calls("cuEventRecordWithFlags");
  uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");
  void *q = sgm_alloc(ctx, 4 * MiB, s1); /* same stream: at once, nothing ordered */
  assert_ptr_equal(q, p);
  assert_int_equal(fc.fake_cuda_calls("cuEventRecord") + fc.fake_cuda_calls("cuEventRecordWithFlags"),
                   records);
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent"), waits);
  sgm_free(ctx, q, s1);
  void *r = sgm_alloc(ctx, 4 * MiB, s2); /* another stream: ordered after s1's work */
  assert_ptr_equal(r, p);
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  assert_int_equal(st.managed_allocs, 1);
  /* Work on s2 now (a move of r) waits on the device for s1's kernel. */
  uint64_t before = fc.fake_cuda_calls("cuMemPrefetchAsync");
  prefetch_job j = {ctx, r, s2, SGM_ERR_BACKEND};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, prefetch_main, &j), 0);
  while (fc.fake_cuda_calls("cuMemPrefetchAsync") == before) sched_yield(); /* queued, not slept */
  fc.fake_cuda_settle();
  assert_int_equal(page_at(r, NULL, NULL), 1); /* still on the device: s1's work is not done */
  fc.fake_cuda_complete_stream(s1);
  pthread_join(t, NULL);
  fc.fake_cuda_hold_stream(s1, 0);
  assert_int_equal(j.rc, SGM_OK);
  assert_int_equal(page_at(r, NULL, NULL), 2);
  sgm__context_bops(ctx)->event_destroy(sgm__context_be(ctx), ev);
  sgm_free(ctx, r, s2);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  fc.fake_cuda_get_stats(&st);
  assert_int_equal(st.managed_allocs, 0);
  sgm_context_destroy(ctx);
  fc.fake_cuda_stream_destroy(s1);
  fc.fake_cuda_stream_destroy(s2);
}

/* A move the free queued runs on sgm's copy stream after the caller's work:
 * the copy stream waits on the device for an event recorded on the block's
 * stream when the move was queued, so the pages stay in host memory until
 * the caller's kernel is done; the freeing thread moved nothing. */
static void test_double_queued_move_waits_for_the_callers_work(void **state) {
  (void)state;
  if (!have_double || old_driver()) skip();
  sgm_context *ctx = make_cuda_ctx("managed");
  void *s = fc.fake_cuda_stream_create();
  uint8_t *a = sgm_alloc(ctx, 12 * MiB, s);
  assert_non_null(a);
  fill(a, 12 * MiB, 21);
  assert_int_equal(sgm_prefetch(ctx, a, 12 * MiB, SGM_TIER_SHARED, s), SGM_OK);
  void *f = sgm_alloc(ctx, 16 * MiB, s);
  assert_int_equal(sgm_pointer_tier(ctx, f), SGM_TIER_VRAM);
  fc.fake_cuda_hold_stream(s, 1);
  void *ev = NULL; /* stands for a kernel on s still using a */
  assert_int_equal(sgm__context_bops(ctx)->event_record(sgm__context_be(ctx), s, &ev), SGM_OK);
  uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");
  uint64_t before = fc.fake_cuda_calls("cuMemPrefetchAsync");
  sgm_stats st0, st;
  assert_int_equal(sgm_get_stats(ctx, &st0), SGM_OK);
  sgm_free(ctx, f, s); /* room: a's promotion is queued */
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_moves_queued - st0.n_managed_moves_queued, 1);
  assert_int_equal(st.managed_inline_moved_bytes, st0.managed_inline_moved_bytes);
  while (fc.fake_cuda_calls("cuMemPrefetchAsync") == before) sched_yield(); /* issued, not slept */
  fc.fake_cuda_settle();
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent"), waits + 1); /* the copy stream's wait */
  assert_int_equal(page_at(a, NULL, NULL), 2); /* still in host memory: s's work is not done */
  fc.fake_cuda_complete_stream(s);
  sgm__managed_queue_wait(ctx, true);
  fc.fake_cuda_hold_stream(s, 0);
  assert_int_equal(page_at(a, NULL, NULL), 1);
  assert_int_equal(sgm_pointer_tier(ctx, a), SGM_TIER_VRAM);
  verify(a, 12 * MiB, 21);
  assert_driver_never_evicted();
  assert_counted_as_charged(ctx, 12 * MiB, 0);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.managed_worker_moved_bytes - st0.managed_worker_moved_bytes, 12 * MiB);
  sgm__context_bops(ctx)->event_destroy(sgm__context_be(ctx), ev);
  sgm_free(ctx, a, s);
  sgm_context_destroy(ctx);
  fc.fake_cuda_stream_destroy(s);
}

static void *destroy_main(void *arg) {
  sgm_context_destroy(arg);
  return NULL;
}

/* While the worker's first move waits for the caller's kernel: a block
 * freed with its move still queued drops the move (its room given back), a
 * block whose move runs is freed after it; a destroy with a move queued
 * stops the worker after the running one and drops the rest, leaking
 * nothing. */
static void test_double_freed_or_destroyed_while_queued(void **state) {
  (void)state;
  if (!have_double || old_driver()) skip();
  sgm_context *ctx = make_cuda_ctx_vram("managed", "48MiB");
  void *s = fc.fake_cuda_stream_create();
  uint8_t *p[4];
  for (int i = 0; i < 4; i++) {
    p[i] = sgm_alloc(ctx, 12 * MiB, s);
    assert_non_null(p[i]);
    fill(p[i], 12 * MiB, 30 + (uint64_t)i);
    assert_int_equal(sgm_prefetch(ctx, p[i], 12 * MiB, SGM_TIER_SHARED, s), SGM_OK);
  }
  /* The order they come back in: p[0] first (it runs), then p[1], p[2], p[3]. */
  for (int i = 0; i < 4; i++)
    assert_int_equal(sgm_advise(ctx, p[i], (sgm_priority)(SGM_PRIORITY_MAXIMUM - i), SGM_HINT_NONE), SGM_OK);
  void *f = sgm_alloc(ctx, 48 * MiB, s);
  assert_int_equal(sgm_pointer_tier(ctx, f), SGM_TIER_VRAM);
  fc.fake_cuda_hold_stream(s, 1);
  void *ev = NULL;
  assert_int_equal(sgm__context_bops(ctx)->event_record(sgm__context_be(ctx), s, &ev), SGM_OK);
  uint64_t before = fc.fake_cuda_calls("cuMemPrefetchAsync");
  sgm_free(ctx, f, s);
  while (fc.fake_cuda_calls("cuMemPrefetchAsync") == before) sched_yield(); /* p[0]'s move runs */
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_moves_queued, 4);
  assert_int_equal(st.managed_queued_bytes, 36 * MiB);
  assert_int_equal(sgm__tier_charged(sgm__context_tier(ctx, SGM_TIER_VRAM)), 48 * MiB);
  /* Freed while queued: its move is dropped and its room given back. */
  assert_int_equal(sgm_free_ex(ctx, p[1], s), SGM_OK);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_moves_cancelled, 1);
  assert_int_equal(st.managed_queued_bytes, 24 * MiB);
  assert_int_equal(sgm__tier_charged(sgm__context_tier(ctx, SGM_TIER_VRAM)), 36 * MiB);
  /* A prefetch of a queued block supersedes its queued move. */
  assert_int_equal(sgm_prefetch(ctx, p[2], 12 * MiB, SGM_TIER_SHARED, s), SGM_OK);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_managed_moves_cancelled, 2);
  assert_int_equal(sgm__tier_charged(sgm__context_tier(ctx, SGM_TIER_VRAM)), 24 * MiB);
  verify(p[2], 12 * MiB, 32);
  verify(p[3], 12 * MiB, 33);
  assert_int_equal(st.managed_queued_bytes, 12 * MiB); /* p[3]'s */
  /* Destroy with p[3]'s move queued, p[0]'s running: the destroy waits for
   * the worker, which stops after p[0]. */
  sgm__context_bops(ctx)->event_destroy(sgm__context_be(ctx), ev); /* the kernel's work stays held */
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, destroy_main, ctx), 0);
  while (!__atomic_load_n(&sgm__context_pl(ctx)->stop, __ATOMIC_RELAXED)) sched_yield();
  fc.fake_cuda_complete_stream(s);
  pthread_join(t, NULL);
  fc.fake_cuda_hold_stream(s, 0);
  sgm_test_clean_env();
  fake_cuda_stats fs;
  fc.fake_cuda_get_stats(&fs);
  assert_int_equal(fs.managed_allocs, 0);
  assert_int_equal(fs.managed_evicted_bytes, 0);
  assert_int_equal(fs.events, 0); /* the queued moves' events went back */
  fc.fake_cuda_stream_destroy(s);
}

/* No concurrent managed access (or a driver before 12.2): refused, with why. */
static void test_double_refuses_without_unified_memory(void **state) {
  (void)state;
  if (!have_double) skip();
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_POINTERS", "managed", 1);
  if (!old_driver()) setenv("FAKE_CUDA_CONCURRENT_MANAGED", "0", 1);
  fc.fake_cuda_reset();
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_ERR_UNSUPPORTED);
  assert_non_null(strstr(sgm_last_error(), "SGM_POINTERS=managed is not possible here"));
  assert_non_null(strstr(sgm_last_error(), old_driver() ? "predates the CUmemLocation forms"
                                                        : "CONCURRENT_MANAGED_ACCESS is 0"));
  setenv("SGM_POINTERS", "auto", 1);
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  void *p = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(p);
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  assert_int_equal(st.managed_allocs, 0); /* fixed pointers */
  sgm_free(ctx, p, NULL);
  sgm_context_destroy(ctx);
  unsetenv("FAKE_CUDA_CONCURRENT_MANAGED");
  sgm_test_clean_env();
}

#define DOUBLE_TESTS                                               \
  cmocka_unit_test(test_double_places_with_advice_and_prefetch),  \
  cmocka_unit_test(test_double_moves_after_the_callers_work),     \
  cmocka_unit_test(test_double_cache_orders_other_streams),       \
  cmocka_unit_test(test_double_queued_move_waits_for_the_callers_work), \
  cmocka_unit_test(test_double_freed_or_destroyed_while_queued),  \
  cmocka_unit_test(test_double_refuses_without_unified_memory),
#else
static void load_double(void) { printf("# managed: built without cuda.h: the double's cases skip\n"); }
#define DOUBLE_TESTS
#endif

/* Invariant (issue 29): a host thread rewriting its managed block while sgm
 * moves that block between VRAM and shared memory keeps every write, as
 * Unified Memory does: after each full rewrite with a new value, every byte
 * holds it. The moves run on this thread, as fast as they go, for as long as
 * the writer writes (no sleeps: the writer's rounds bound the test). */
typedef struct mover_writer {
  unsigned char *p;      /* the block */
  size_t n;              /* its bytes */
  int rounds;            /* full rewrites to make */
  int bad_round;         /* first round that found a lost write, -1 = none */
  size_t bad_at;         /* where */
  int done;              /* set by the writer at the end (atomic) */
} mover_writer;

static void *writer_main(void *arg) {
  mover_writer *w = arg;
  for (int r = 1; r <= w->rounds && w->bad_round < 0; r++) {
    memset(w->p, r & 0xFF, w->n);
    for (size_t i = 0; i < w->n; i += 512) {
      if (w->p[i] != (unsigned char)(r & 0xFF)) {
        w->bad_round = r;
        w->bad_at = i;
        break;
      }
    }
  }
  __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

static void test_host_writes_survive_moves(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("64MiB", "managed");
  mover_writer w = {.n = 8 * MiB, .rounds = 200, .bad_round = -1};
  w.p = sgm_alloc(ctx, w.n, NULL);
  assert_non_null(w.p);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, writer_main, &w), 0);
  uint64_t moves = 0;
  while (!__atomic_load_n(&w.done, __ATOMIC_ACQUIRE)) {
    sgm_tier to = moves++ % 2 ? SGM_TIER_VRAM : SGM_TIER_SHARED;
    assert_int_equal(sgm_prefetch(ctx, w.p, w.n, to, NULL), SGM_OK);
  }
  pthread_join(th, NULL);
  print_message("# %llu moves while the writer made %d rewrites of %zu bytes\n",
                (unsigned long long)moves, w.rounds, w.n);
  if (w.bad_round >= 0)
    fail_msg("round %d: byte %zu lost its write during a move", w.bad_round, w.bad_at);
  for (size_t i = 0; i < w.n; i++)
    if (w.p[i] != (unsigned char)(w.rounds & 0xFF)) fail_msg("byte %zu lost the last write", i);
  check_invariants(ctx);
  sgm_free(ctx, w.p, NULL);
  sgm_context_destroy(ctx);
}

int main(void) {
  load_double();
#ifdef HAVE_CUDA_H
  /* ctest's run on an older driver double (unit_test_managed_driver_12_0):
   * only the double's cases depend on the driver version; the emulated
   * device's ran in unit_test_managed (twice their time under TSan for
   * nothing). */
  if (getenv("FAKE_CUDA_DRIVER_VERSION")) {
    const struct CMUnitTest double_only[] = {DOUBLE_TESTS};
    return cmocka_run_group_tests(double_only, NULL, NULL);
  }
#endif
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bytes_survive_random_moves),
      cmocka_unit_test(test_lru_block_is_demoted_for_a_new_one),
      cmocka_unit_test(test_hot_hint_changes_the_victim),
      cmocka_unit_test(test_low_priority_leaves_first),
      cmocka_unit_test(test_highest_priority_comes_back_first),
      cmocka_unit_test(test_cold_block_stays_down),
      cmocka_unit_test(test_what_does_not_move),
      cmocka_unit_test(test_refused_or_downgraded),
      cmocka_unit_test(test_every_failure_leaves_things_whole),
      cmocka_unit_test(test_cache_reuses_a_freed_range),
      cmocka_unit_test(test_steady_pair_takes_no_placement_lock),
      cmocka_unit_test(test_reused_block_is_still_a_victim),
      cmocka_unit_test(test_threads_pair_and_move),
      cmocka_unit_test(test_cache_yields_before_anything_moves),
      cmocka_unit_test(test_cache_goes_back_to_the_driver),
      cmocka_unit_test(test_released_range_is_not_used),
      cmocka_unit_test(test_policy_orders_promotions),
      cmocka_unit_test(test_free_queues_moves_past_the_bound),
      cmocka_unit_test(test_cold_hint_queues_a_large_demotion),
      cmocka_unit_test(test_bytes_survive_queued_moves),
      cmocka_unit_test(test_host_writes_survive_moves),
      cmocka_unit_test(test_queue_failures_leave_things_whole),
      DOUBLE_TESTS
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
