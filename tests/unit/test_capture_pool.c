/*
 * test_capture_pool.c — capture pools (lib/capture.c) from the inside: what
 * a pair inside a pool's scope costs in capture-lock round trips. The pools'
 * behaviour (scopes, parking, reuse, release) is checked through the public
 * API in tests/api/test_capture_pool.c.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "internal.h"
#include "sgm.h"
#include "test_util.h"

enum { RING = 16, PAIRS = 1000, BLOCK = 64 << 10 };

/*
 * Invariant: inside a pool's scope, an allocation that takes back a block
 * the pool parked takes the capture lock once (the scope and the reuse in
 * one section), and the free that parks a member once: a pair, twice. The
 * scope and the reuse each took it once before, and the lock's round trips
 * were most of what such a pair cost over one without a pool
 * (alloc.pair.in_pool). Every pair is served by a parked block: the ring's
 * addresses never leave the pool's members.
 */
static void test_a_pooled_pair_takes_the_capture_lock_twice(void **state) {
  (void)state;
  sgm_test_clean_env(); /* no SGM_* variable of the caller's reaches the config */
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = SGM_BACKEND_EMU;
  cfg.emu_vram_bytes = 512ull << 20;
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(&cfg, &ctx), SGM_OK);
  sgm_capture *c = sgm__context_capture(ctx);
  assert_int_equal(sgm_capture_pool_begin(ctx, NULL, 7), SGM_OK);
  void *ring[RING];
  for (int i = 0; i < RING; i++) assert_non_null(ring[i] = sgm_alloc(ctx, BLOCK, NULL));
  void *members[RING];
  for (int i = 0; i < RING; i++) members[i] = ring[i];
  uint64_t before = sgm__capture_lock_takes(c);
  for (int k = 0; k < PAIRS; k++) {
    sgm_free(ctx, ring[k % RING], NULL);
    assert_non_null(ring[k % RING] = sgm_alloc(ctx, BLOCK, NULL));
    bool member = false;
    for (int i = 0; i < RING; i++) member |= ring[k % RING] == members[i];
    assert_true(member); /* taken back from the pool, not a new block */
  }
  uint64_t takes = sgm__capture_lock_takes(c) - before;
  printf("# capture-lock takes in %d pooled pairs: %llu\n", PAIRS, (unsigned long long)takes);
  assert_int_equal(takes, 2 * PAIRS);
  assert_int_equal(sgm_capture_pool_end(ctx, 7), SGM_OK);
  for (int i = 0; i < RING; i++) sgm_free(ctx, ring[i], NULL);
  assert_int_equal(sgm_capture_pool_release(ctx, 7), SGM_OK);
  sgm_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_a_pooled_pair_takes_the_capture_lock_twice),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
