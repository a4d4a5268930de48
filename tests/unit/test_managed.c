/*
 * test_managed.c — SGM_POINTERS=managed on the emulated device (issue 14).
 *
 * The emulated device keeps device-placed and host-placed managed pages in
 * two different stores under one address, so these tests see real moves:
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
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "internal.h"
#include "placement.h"
#include "test_util.h"
#include "tiers/tier.h"

#define MiB (UINT64_C(1) << 20)

static sgm_context *make_ctx(const char *vram_limit, const char *pointers) {
  sgm_test_clean_env();
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

/* The invariants after every step: the budget holds device-placed bytes, the
 * device holds exactly what sgm charged, the placement lists are whole. */
static void check_invariants(sgm_context *ctx) {
  sgm_backend_counters c;
  ctx->bops->counters(ctx->be, &c);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  uint64_t charged_vram = sgm__tier_charged(ctx->tiers[SGM_TIER_VRAM]);
  uint64_t charged_shared = sgm__tier_charged(ctx->tiers[SGM_TIER_SHARED]);
  assert_true(c.managed_device_bytes + st.tier[SGM_TIER_VRAM].committed_bytes - charged_vram <=
              st.tier[SGM_TIER_VRAM].budget_bytes);
  assert_true(st.tier[SGM_TIER_VRAM].committed_bytes <= st.tier[SGM_TIER_VRAM].budget_bytes);
  assert_int_equal(c.managed_device_bytes, charged_vram);
  assert_int_equal(c.managed_host_bytes, charged_shared);
  char why[256];
  if (sgm__placement_check(ctx, why, sizeof why) != SGM_OK) fail_msg("placement: %s", why);
  assert_true(sgm__tier_check(ctx->tiers[SGM_TIER_VRAM]));
  assert_true(sgm__tier_check(ctx->tiers[SGM_TIER_SHARED]));
}

static uint8_t pattern(uint64_t seed, uint64_t i) {
  uint64_t x = (seed + 1) * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull;
  return (uint8_t)(x >> 56);
}

static void fill(uint8_t *p, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n; i++) p[i] = pattern(seed, i);
}

/* Unified Memory: the host reads the pointer itself, wherever its pages are. */
static void verify(const uint8_t *p, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n; i++)
    if (p[i] != pattern(seed, i))
      fail_msg("byte %llu of a %llu-byte block (seed %llu) is 0x%02x, wrote 0x%02x",
               (unsigned long long)i, (unsigned long long)n, (unsigned long long)seed, p[i],
               pattern(seed, i));
}

/* Bytes survive every move; device bytes stay within the budget. */
static void test_bytes_survive_random_moves(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("test_managed random moves", 14);
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  sgm_context *ctx = make_ctx("24MiB", "managed");
  enum { N = 12 };
  uint8_t *p[N] = {0};
  uint64_t size[N] = {0}, tag[N] = {0};
  for (int step = 0; step < 400; step++) {
    int i = (int)sgm_test_rng_range(&r, 0, N - 1);
    int op = (int)sgm_test_rng_range(&r, 0, 5);
    if (!p[i]) op = 0;
    switch (op) {
    case 0: /* (re)allocate: odd sizes, so the last page is partly used */
      if (p[i]) {
        verify(p[i], size[i], tag[i]);
        assert_int_equal(sgm_free_ex(ctx, p[i], NULL), SGM_OK);
      }
      size[i] = sgm_test_rng_range(&r, 2 * MiB, 7 * MiB + 12345);
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
  sgm_backend_counters c;
  ctx->bops->counters(ctx->be, &c);
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
  ctx->bops->counters(ctx->be, &c);
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

/* Every device call on the way of a managed allocation and its moves may
 * fail: each run ends whole, with nothing leaked. */
static void test_every_failure_leaves_things_whole(void **state) {
  (void)state;
  for (int n = 2; n < 80; n++) {
    char at[16];
    snprintf(at, sizeof at, "%d", n);
    sgm_test_clean_env();
    setenv("SGM_EMU_VRAM", "64MiB", 1);
    setenv("SGM_VRAM_LIMIT", "8MiB", 1);
    setenv("SGM_SHARED_LIMIT", "64MiB", 1);
    setenv("SGM_IDLE_TRIM_MS", "0", 1);
    setenv("SGM_POINTERS", "managed", 1);
    setenv("SGM_EMU_FAIL_AT", at, 1);
    sgm_context *ctx = NULL;
    if (sgm_context_create(NULL, &ctx) != SGM_OK) continue;
    void *p[3];
    for (int i = 0; i < 3; i++) {
      p[i] = sgm_alloc(ctx, 4 * MiB, NULL);
      if (p[i]) fill(p[i], 4 * MiB, (uint64_t)i);
    }
    for (int i = 0; i < 3; i++) {
      if (!p[i]) continue;
      (void)sgm_prefetch(ctx, p[i], 4 * MiB, SGM_TIER_VRAM, NULL);
      (void)sgm_advise(ctx, p[i], SGM_PRIORITY_LOW, SGM_HINT_COLD);
      verify(p[i], 4 * MiB, (uint64_t)i);
      check_invariants(ctx);
    }
    for (int i = 0; i < 3; i++) sgm_free(ctx, p[i], NULL);
    check_invariants(ctx);
    sgm_backend_counters c;
    ctx->bops->counters(ctx->be, &c);
    assert_int_equal(c.n_managed_live, 0);
    assert_int_equal(c.managed_device_bytes + c.managed_host_bytes, 0);
    sgm_context_destroy(ctx);
  }
  sgm_test_clean_env();
}

int main(void) {
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
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
