/*
 * test_api.c — black-box checks of the public API (include/sgm.h only). Runs
 * on whatever SGM_BACKEND the environment names: emu by default, and again on
 * cuda against the driver test double. Device pointers are never dereferenced.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "sgm.h"

#define MiB (UINT64_C(1) << 20)

/* The backend under test, as ctest set it; restored after env-changing tests. */
static char backend_env[32] = "emu";

static void reset_env(void) {
  static const char *const vars[] = {"SGM_VRAM_LIMIT", "SGM_VRAM_FRACTION", "SGM_ALLOW_GROWTH",
                                     "SGM_SHARED_LIMIT", "SGM_POLICY", "SGM_EMU_VRAM",
                                     "SGM_GROWTH_CHUNK", "SGM_EMU_FAIL_AT", "SGM_DEVICE",
                                     "TF_FORCE_GPU_ALLOW_GROWTH", "CUDA_DEVICE_MEMORY_LIMIT",
                                     "SGM_SHARED_FALLBACK", "SGM_IDLE_TRIM_MS"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
  setenv("SGM_BACKEND", backend_env, 1);
  setenv("SGM_VERBOSE", "0", 1);
  setenv("SGM_EMU_VRAM", "256MiB", 1);
}

static sgm_context *create_or_fail(void) {
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fprintf(stderr, "sgm_context_create: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  return ctx;
}

/* Invariant: every status has a distinct constant name; tiers have names;
 * the run-time version is the header's (this test links the library it
 * was built with). */
static void test_names(void **state) {
  (void)state;
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", SGM_VERSION_MAJOR, SGM_VERSION_MINOR, SGM_VERSION_PATCH);
  assert_string_equal(sgm_version(), want);
  assert_string_equal(sgm_status_string(SGM_OK), "SGM_OK");
  assert_string_equal(sgm_status_string(SGM_ERR_NOMEM), "SGM_ERR_NOMEM");
  assert_string_equal(sgm_status_string(SGM_ERR_UNSUPPORTED), "SGM_ERR_UNSUPPORTED");
  assert_string_equal(sgm_status_string((sgm_status)-99), "SGM_ERR_UNKNOWN");
  for (int a = SGM_ERR_UNSUPPORTED; a <= SGM_OK; a++)
    for (int b = a + 1; b <= SGM_OK; b++)
      assert_string_not_equal(sgm_status_string((sgm_status)a), sgm_status_string((sgm_status)b));
  assert_string_equal(sgm_tier_name(SGM_TIER_VRAM), "vram");
  assert_string_equal(sgm_tier_name(SGM_TIER_SHARED), "shared");
  assert_string_equal(sgm_tier_name(SGM_TIER_NONE), "none");
}

/* Invariant: sgm_option_name lists distinct SGM_* names, the well-known ones
 * among them, and ends with NULL (bindings validate option names with it). */
static void test_option_names(void **state) {
  (void)state;
  size_t n = 0;
  int seen_backend = 0, seen_vram_limit = 0;
  for (const char *name; (name = sgm_option_name(n)) != NULL; n++) {
    assert_true(strncmp(name, "SGM_", 4) == 0);
    for (size_t j = 0; j < n; j++) assert_string_not_equal(name, sgm_option_name(j));
    seen_backend |= strcmp(name, "SGM_BACKEND") == 0;
    seen_vram_limit |= strcmp(name, "SGM_VRAM_LIMIT") == 0;
  }
  assert_true(n > 10);
  assert_true(seen_backend && seen_vram_limit);
  assert_null(sgm_option_name(n + 1000));
}

/* Invariant: alloc hands out distinct, 256-aligned VRAM pointers that free
 * returns; stats follow; NULL and 0 are handled as documented. */
static void test_alloc_free(void **state) {
  (void)state;
  reset_env();
  sgm_context *ctx = create_or_fail();
  void *p[100];
  for (int i = 0; i < 100; i++) {
    p[i] = sgm_alloc(ctx, (size_t)(i + 1) * 1000, NULL);
    assert_non_null(p[i]);
    assert_int_equal((uintptr_t)p[i] % 256, 0);
    assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_VRAM);
    for (int j = 0; j < i; j++) assert_ptr_not_equal(p[i], p[j]);
  }
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.tier[SGM_TIER_VRAM].n_live, 100);
  assert_true(st.tier[SGM_TIER_VRAM].used_bytes >= 5050 * 1000);
  assert_true(st.tier[SGM_TIER_VRAM].committed_bytes >= st.tier[SGM_TIER_VRAM].used_bytes);
  assert_true(st.tier[SGM_TIER_VRAM].budget_bytes > 0);
  assert_true(st.tier[SGM_TIER_SHARED].budget_bytes >= 64 * MiB);
  assert_true(st.device_total_bytes > 0);
  assert_true(st.physical_ram_bytes > 0);
  for (int i = 0; i < 100; i++) assert_int_equal(sgm_free_ex(ctx, p[i], NULL), SGM_OK);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.tier[SGM_TIER_VRAM].n_live, 0);
  assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, 0);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.tier[SGM_TIER_VRAM].committed_bytes, 0);

  assert_null(sgm_alloc(ctx, 0, NULL));
  assert_non_null(strstr(sgm_last_error(), "size is 0"));
  assert_null(sgm_alloc(NULL, 10, NULL));
  assert_null(sgm_alloc(ctx, SIZE_MAX, NULL));
  sgm_free(ctx, NULL, NULL);
  sgm_free(NULL, NULL, NULL);
  sgm_context_destroy(ctx);
  sgm_context_destroy(NULL);
}

/* Invariant: double free and foreign pointers are refused, not crashes. */
static void test_bad_free(void **state) {
  (void)state;
  reset_env();
  sgm_context *ctx = create_or_fail();
  void *p = sgm_alloc(ctx, 1 << 20, NULL);
  assert_non_null(p);
  assert_int_equal(sgm_free_ex(ctx, p, NULL), SGM_OK);
  assert_int_equal(sgm_free_ex(ctx, p, NULL), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "not a live allocation"));
  int x;
  assert_int_equal(sgm_free_ex(ctx, &x, NULL), SGM_ERR_INVALID);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.n_bad_frees, 2);
  sgm_context_destroy(ctx);
}

/* Invariant: a full budget gives NULL + SGM_ERR_NOMEM-style message naming
 * the budget and the use; freeing makes room again. */
static void test_budget_exhaustion(void **state) {
  (void)state;
  reset_env();
  setenv("SGM_VRAM_LIMIT", "32MiB", 1);
  setenv("SGM_SHARED_FALLBACK", "off", 1);
  sgm_context *ctx = create_or_fail();
  void *p[64];
  int n = 0;
  while (n < 64 && (p[n] = sgm_alloc(ctx, 1 * MiB, NULL)) != NULL) n++;
  assert_true(n >= 24 && n <= 32);
  assert_non_null(strstr(sgm_last_error(), "budget 32.00 MiB"));
  sgm_free(ctx, p[0], NULL);
  p[0] = sgm_alloc(ctx, 1 * MiB, NULL);
  assert_non_null(p[0]);
  for (int i = 0; i < n; i++) sgm_free(ctx, p[i], NULL);
  sgm_context_destroy(ctx);
}

/* Invariant: a bad environment value makes create fail with SGM_ERR_INVALID
 * and a message naming the variable and the value; out stays NULL. */
static void test_bad_env(void **state) {
  (void)state;
  reset_env();
  setenv("SGM_VRAM_LIMIT", "12 parsecs", 1);
  sgm_context *ctx = (sgm_context *)&ctx;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_ERR_INVALID);
  assert_null(ctx);
  assert_non_null(strstr(sgm_last_error(), "SGM_VRAM_LIMIT"));
  assert_non_null(strstr(sgm_last_error(), "12 parsecs"));
  reset_env();
  setenv("SGM_VRAM_FRACTION", "1.5", 1);
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "SGM_VRAM_FRACTION"));
  reset_env();
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.vram_fraction = -1; /* a bad value set in code */
  assert_int_equal(sgm_context_create(&cfg, &ctx), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "vram_fraction"));
  assert_int_equal(sgm_context_create(NULL, NULL), SGM_ERR_INVALID);
}

/* Invariant: code wins over the environment (precedence default < env < code). */
static void test_code_overrides_env(void **state) {
  (void)state;
  reset_env();
  setenv("SGM_VRAM_LIMIT", "16MiB", 1);
  sgm_config cfg;
  sgm_config_init(&cfg);
  assert_int_equal(cfg.vram_limit.bytes, 16 * MiB);
  cfg.vram_limit.bytes = 8 * MiB;
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(&cfg, &ctx), SGM_OK);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.tier[SGM_TIER_VRAM].budget_bytes, 8 * MiB);
  sgm_context_destroy(ctx);
}

/* Invariant: the JSON dump is one object holding every tier and the counters. */
static void test_stats_json(void **state) {
  (void)state;
  reset_env();
  sgm_context *ctx = create_or_fail();
  void *p = sgm_alloc(ctx, 12345, NULL);
  char *json = NULL;
  assert_int_equal(sgm_stats_json(ctx, &json), SGM_OK);
  assert_non_null(json);
  assert_int_equal(json[0], '{');
  assert_int_equal(json[strlen(json) - 1], '}');
  assert_non_null(strstr(json, "\"vram\":{\"budget_bytes\":"));
  assert_non_null(strstr(json, "\"shared\":{"));
  assert_non_null(strstr(json, "\"disk\":{"));
  assert_non_null(strstr(json, "\"used_bytes\":12544"));
  int depth = 0;
  for (const char *c = json; *c; c++) {
    depth += *c == '{';
    depth -= *c == '}';
    assert_true(depth >= 0);
  }
  assert_int_equal(depth, 0);
  sgm_string_free(json);
  assert_int_equal(sgm_stats_json(NULL, &json), SGM_ERR_INVALID);
  assert_null(json);
  sgm_free(ctx, p, NULL);
  sgm_context_destroy(ctx);
}

/* Invariant: past the VRAM budget, allocations land in shared GPU memory
 * (VRAM first), are counted as fallbacks, and free normally; with shared
 * memory full too, NULL with both budgets named. */
static void test_fallback(void **state) {
  (void)state;
  reset_env();
  setenv("SGM_VRAM_LIMIT", "8MiB", 1);
  setenv("SGM_SHARED_LIMIT", "16MiB", 1);
  sgm_context *ctx = create_or_fail();
  void *p[32];
  int n = 0, n_vram = 0, n_shared = 0;
  while (n < 32 && (p[n] = sgm_alloc(ctx, 1 * MiB, NULL)) != NULL) {
    sgm_tier t = sgm_pointer_tier(ctx, p[n]);
    if (t == SGM_TIER_VRAM) {
      assert_int_equal(n_shared, 0);
      n_vram++;
    } else {
      assert_int_equal(t, SGM_TIER_SHARED);
      n_shared++;
    }
    n++;
  }
  assert_int_equal(n_vram, 8);
  assert_int_equal(n_shared, 16);
  assert_non_null(strstr(sgm_last_error(), "SGM_SHARED_LIMIT"));
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.n_fallbacks, 16);
  assert_int_equal(st.fallback_bytes, 16 * MiB);
  assert_int_equal(st.tier[SGM_TIER_SHARED].used_bytes, 16 * MiB);
  for (int i = 0; i < n; i++) assert_int_equal(sgm_free_ex(ctx, p[i], NULL), SGM_OK);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.tier[SGM_TIER_SHARED].committed_bytes, 0);
  sgm_context_destroy(ctx);
}

/* Several threads share one context; counters balance at the end. */
static void *api_thread(void *vctx) {
  sgm_context *ctx = vctx;
  void *p[16] = {0};
  for (int i = 0; i < 4000; i++) {
    int k = (i * 7) % 16;
    if (p[k]) {
      sgm_free(ctx, p[k], NULL);
      p[k] = NULL;
    } else {
      p[k] = sgm_alloc(ctx, (size_t)(k + 1) * 4096, NULL);
    }
  }
  for (int k = 0; k < 16; k++) sgm_free(ctx, p[k], NULL);
  return NULL;
}

static void test_threads(void **state) {
  (void)state;
  reset_env();
  sgm_context *ctx = create_or_fail();
  pthread_t th[4];
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, api_thread, ctx);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.tier[SGM_TIER_VRAM].n_live, 0);
  assert_int_equal(st.tier[SGM_TIER_VRAM].n_allocs, st.tier[SGM_TIER_VRAM].n_frees);
  assert_int_equal(st.n_bad_frees, 0);
  sgm_context_destroy(ctx);
}

int main(void) {
  const char *b = getenv("SGM_BACKEND");
  if (b && *b) snprintf(backend_env, sizeof backend_env, "%s", b);
  printf("# api suite on SGM_BACKEND=%s\n", backend_env);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_names),         cmocka_unit_test(test_alloc_free),
      cmocka_unit_test(test_bad_free),      cmocka_unit_test(test_budget_exhaustion),
      cmocka_unit_test(test_bad_env),       cmocka_unit_test(test_code_overrides_env),
      cmocka_unit_test(test_stats_json),    cmocka_unit_test(test_threads),
      cmocka_unit_test(test_fallback),
      cmocka_unit_test(test_option_names),
  };
  return cmocka_run_group_tests_name("api", tests, NULL, NULL);
}
