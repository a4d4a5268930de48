/*
 * test_buffers_api.c — movable buffers through the public API only, on
 * whatever SGM_BACKEND ctest names (emu, and cuda over the driver double):
 * a working set three times the VRAM budget moves through VRAM, shared
 * memory and the spill file and every byte reads back as written.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "sgm.h"

#define MiB (UINT64_C(1) << 20)

static char backend_env[32] = "emu";
static char spill[64];

static void fill(unsigned char *p, size_t n, unsigned seed) {
  unsigned x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

/* Invariant: with VRAM 4 MiB, shared 4 MiB and a spill directory, 12 MiB of
 * buffers all stay readable byte for byte through acquire/release cycles that
 * move them between all three tiers; acquired buffers are resident. */
static void test_three_tiers_round_trip(void **state) {
  (void)state;
  setenv("SGM_BACKEND", backend_env, 1);
  setenv("SGM_VERBOSE", "0", 1);
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "4MiB", 1);
  setenv("SGM_SHARED_LIMIT", "4MiB", 1);
  setenv("SGM_SPILL_DIR", spill, 1);
  setenv("SGM_SPILL_LIMIT", "64MiB", 1);
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fprintf(stderr, "create: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  enum { N = 24 };
  const size_t sz = 512 * 1024;
  sgm_buffer *b[N];
  unsigned char *want = malloc(sz), *got = malloc(sz);
  for (int i = 0; i < N; i++) {
    assert_int_equal(sgm_buffer_create(ctx, sz, &b[i]), SGM_OK);
    fill(want, sz, (unsigned)i);
    assert_int_equal(sgm_buffer_write(b[i], 0, want, sz), SGM_OK);
  }
  int seen[SGM_TIER_COUNT] = {0};
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < N; i++) {
      seen[sgm_buffer_tier(b[i])]++;
      void *d = NULL;
      rc = sgm_buffer_acquire(b[i], NULL, &d);
      if (rc != SGM_OK) fail_msg("acquire: %s", sgm_last_error());
      sgm_tier t = sgm_buffer_tier(b[i]);
      assert_true(t == SGM_TIER_VRAM || t == SGM_TIER_SHARED);
      seen[t]++;
      assert_non_null(d);
      assert_int_equal(sgm_buffer_release(b[i], NULL), SGM_OK);
    }
  }
  printf("# tiers seen at acquire: vram %d, shared %d, disk %d\n", seen[0], seen[1], seen[2]);
  /* A cyclic sweep finds each buffer on disk (VRAM victims pass through
   * shared memory on their way down), and acquire brings it to VRAM. */
  assert_true(seen[SGM_TIER_VRAM] > 0 && seen[SGM_TIER_DISK] > 0);
  for (int i = 0; i < N; i++) {
    fill(want, sz, (unsigned)i);
    assert_int_equal(sgm_buffer_read(b[i], 0, got, sz), SGM_OK);
    if (memcmp(want, got, sz) != 0) fail_msg("buffer %d differs", i);
  }
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_true(st.tier[SGM_TIER_DISK].bytes_in > 0);
  assert_true(st.tier[SGM_TIER_SHARED].bytes_in > 0 && st.tier[SGM_TIER_SHARED].bytes_out > 0);
  assert_true(st.tier[SGM_TIER_VRAM].n_evictions > 0);
  for (int i = 0; i < N; i++) sgm_buffer_destroy(b[i]);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  for (int t = 0; t < SGM_TIER_COUNT; t++) assert_int_equal(st.tier[t].n_live, 0);
  free(want);
  free(got);
  sgm_context_destroy(ctx);
}

int main(void) {
  const char *b = getenv("SGM_BACKEND");
  if (b && *b) snprintf(backend_env, sizeof backend_env, "%s", b);
  printf("# buffers api suite on SGM_BACKEND=%s\n", backend_env);
  snprintf(spill, sizeof spill, "/tmp/sgm_bufapi_XXXXXX");
  if (!mkdtemp(spill)) return 1;
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_three_tiers_round_trip)};
  int rc = cmocka_run_group_tests_name("buffers_api", tests, NULL, NULL);
  rmdir(spill);
  return rc;
}
