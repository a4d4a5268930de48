/*
 * test_context.c — the context and the VRAM tier on the emulated device,
 * white-box: budgets, growth vs reserve commit, trim, stats, bad frees, the
 * Nth-backend-call failure loop and a thread stress with data checks.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "internal.h"
#include "test_util.h"
#include "tiers/tier.h"

#define MiB (UINT64_C(1) << 20)

/* These suites are about the VRAM tier alone: no spill into shared memory. */
static void clean_env(void) {
  sgm_test_clean_env();
  setenv("SGM_SHARED_FALLBACK", "off", 1);
}

static sgm_context *make_ctx(const char *vram, const char *growth) {
  clean_env();
  setenv("SGM_EMU_VRAM", vram, 1);
  setenv("SGM_ALLOW_GROWTH", growth, 1);
  sgm_config cfg;
  sgm_config_init(&cfg);
  assert_string_equal(cfg.error, "");
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(&cfg, &ctx);
  if (rc != SGM_OK) fprintf(stderr, "create: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  assert_non_null(ctx);
  return ctx;
}

static sgm_backend_counters backend_counters(sgm_context *ctx) {
  sgm_backend_counters c;
  ctx->bops->counters(ctx->be, &c);
  return c;
}

static sgm_tier_stats vram_stats(sgm_context *ctx) {
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  return st.tier[SGM_TIER_VRAM];
}

/* Invariant: the VRAM budget is device total × fraction, capped by
 * SGM_VRAM_LIMIT (bytes or %) and CUDA_DEVICE_MEMORY_LIMIT. */
static void test_budget_resolution(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("1GiB", "1");
  assert_int_equal(vram_stats(ctx).budget_bytes, (uint64_t)(0.95 * (double)(1024 * MiB)) & ~255ull);
  sgm_context_destroy(ctx);

  clean_env();
  setenv("SGM_EMU_VRAM", "1GiB", 1);
  setenv("SGM_VRAM_LIMIT", "100MiB", 1);
  sgm_context *c2 = NULL;
  assert_int_equal(sgm_context_create(NULL, &c2), SGM_OK);
  assert_int_equal(vram_stats(c2).budget_bytes, 100 * MiB);
  sgm_context_destroy(c2);

  setenv("SGM_VRAM_LIMIT", "25%", 1);
  assert_int_equal(sgm_context_create(NULL, &c2), SGM_OK);
  assert_int_equal(vram_stats(c2).budget_bytes, 256 * MiB);
  sgm_context_destroy(c2);

  setenv("CUDA_DEVICE_MEMORY_LIMIT", "64m", 1);
  assert_int_equal(sgm_context_create(NULL, &c2), SGM_OK);
  assert_int_equal(vram_stats(c2).budget_bytes, 64 * MiB);
  sgm_context_destroy(c2);

  setenv("CUDA_DEVICE_MEMORY_LIMIT", "lots", 1);
  assert_int_equal(sgm_context_create(NULL, &c2), SGM_ERR_INVALID);
  assert_null(c2);
  assert_non_null(strstr(sgm_last_error(), "CUDA_DEVICE_MEMORY_LIMIT"));
}

/* Invariant: growth mode commits nothing at create and grows geometrically
 * (2, 4, 8 MiB ...); reserve mode commits the whole budget at create as one
 * chunk, so one block of the whole budget fits. */
static void test_growth_vs_reserve(void **state) {
  (void)state;
  sgm_context *g = make_ctx("256MiB", "1");
  assert_int_equal(vram_stats(g).committed_bytes, 0);
  assert_int_equal(backend_counters(g).device_live_bytes, 0);
  void *a = sgm_alloc(g, 1000, NULL);
  assert_non_null(a);
  assert_int_equal((uintptr_t)a % 256, 0);
  assert_int_equal(vram_stats(g).committed_bytes, 2 * MiB);
  void *b = sgm_alloc(g, 2 * MiB, NULL); /* does not fit the rest of chunk 1 */
  assert_non_null(b);
  assert_int_equal(vram_stats(g).committed_bytes, 2 * MiB + 4 * MiB);
  void *big = sgm_alloc(g, 50 * MiB, NULL); /* larger than the next chunk: its own */
  assert_non_null(big);
  sgm_tier_stats s = vram_stats(g);
  assert_int_equal(s.n_chunks, 3);
  assert_int_equal(s.committed_bytes, 6 * MiB + 50 * MiB);
  assert_int_equal(backend_counters(g).device_live_bytes, s.committed_bytes);
  assert_true(sgm__tier_check(g->tiers[SGM_TIER_VRAM]));
  sgm_free(g, a, NULL);
  sgm_free(g, b, NULL);
  sgm_free(g, big, NULL);
  sgm_context_destroy(g);

  sgm_context *r = make_ctx("256MiB", "0");
  s = vram_stats(r);
  assert_int_equal(s.committed_bytes, s.budget_bytes);
  assert_int_equal(s.n_chunks, 1);
  assert_int_equal(backend_counters(r).device_live_bytes, s.budget_bytes);
  void *all = sgm_alloc(r, s.budget_bytes, NULL);
  assert_non_null(all);
  assert_null(sgm_alloc(r, 1, NULL));
  assert_int_equal(sgm_free_ex(r, all, NULL), SGM_OK);
  sgm_context_destroy(r);
}

/* Invariant: TF_FORCE_GPU_ALLOW_GROWTH=false overrides SGM_ALLOW_GROWTH=1
 * (TensorFlow's semantics: it wins over the configuration). */
static void test_tf_override(void **state) {
  (void)state;
  clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_ALLOW_GROWTH", "1", 1);
  setenv("TF_FORCE_GPU_ALLOW_GROWTH", "false", 1);
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  sgm_tier_stats s = vram_stats(ctx);
  assert_int_equal(s.committed_bytes, s.budget_bytes);
  assert_int_equal(sgm_context_config(ctx)->allow_growth, 0);
  sgm_context_destroy(ctx);
  unsetenv("TF_FORCE_GPU_ALLOW_GROWTH");
}

/* Invariant: trim returns every wholly free chunk in growth mode (committed
 * and the backend's live bytes drop to what live blocks need) and keeps the
 * reservation in reserve mode. */
static void test_trim(void **state) {
  (void)state;
  sgm_context *g = make_ctx("512MiB", "1");
  void *p[64];
  for (int i = 0; i < 64; i++) assert_non_null(p[i] = sgm_alloc(g, (size_t)(i + 1) * 100000, NULL));
  uint64_t before = vram_stats(g).committed_bytes;
  assert_true(before > 0);
  for (int i = 0; i < 63; i++) sgm_free(g, p[i], NULL);
  assert_int_equal(sgm_trim(g), SGM_OK);
  sgm_tier_stats s = vram_stats(g);
  assert_true(s.committed_bytes < before);
  assert_true(s.n_chunks >= 1);
  assert_int_equal(backend_counters(g).device_live_bytes, s.committed_bytes);
  sgm_free(g, p[63], NULL);
  assert_int_equal(sgm_trim(g), SGM_OK);
  s = vram_stats(g);
  assert_int_equal(s.committed_bytes, 0);
  assert_int_equal(s.n_chunks, 0);
  assert_int_equal(backend_counters(g).device_live_bytes, 0);
  /* It grows again after a full trim. */
  void *q = sgm_alloc(g, 4096, NULL);
  assert_non_null(q);
  sgm_free(g, q, NULL);
  sgm_context_destroy(g);

  sgm_context *r = make_ctx("64MiB", "0");
  uint64_t budget = vram_stats(r).budget_bytes;
  assert_int_equal(sgm_trim(r), SGM_OK);
  assert_int_equal(vram_stats(r).committed_bytes, budget);
  sgm_context_destroy(r);
}

/* Invariant: in growth mode, when free chunks hold the budget hostage
 * (fragmented across chunks), an allocation that needs one big chunk gets it
 * by returning the free chunks first. */
static void test_growth_reclaims_free_chunks(void **state) {
  (void)state;
  clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_FRACTION", "1", 1);
  sgm_context *g = NULL;
  assert_int_equal(sgm_context_create(NULL, &g), SGM_OK);
  void *small[32];
  int n = 0;
  while (n < 32 && (small[n] = sgm_alloc(g, 1 * MiB, NULL)) != NULL) n++;
  assert_true(n >= 16);
  for (int i = 0; i < n; i++) sgm_free(g, small[i], NULL);
  void *big = sgm_alloc(g, 48 * MiB, NULL);
  assert_non_null(big);
  assert_true(sgm__tier_check(g->tiers[SGM_TIER_VRAM]));
  sgm_free(g, big, NULL);
  sgm_context_destroy(g);
}

/* Invariant: stats add up: used = sum of 256-rounded sizes of live blocks,
 * n_live counts them, peak is the maximum used seen, allocs/frees count calls. */
static void test_stats_consistency(void **state) {
  (void)state;
  sgm_test_rng r;
  sgm_test_rng_init(&r, sgm_test_seed("context.stats", 42));
  sgm_context *ctx = make_ctx("256MiB", "1");
  enum { N = 500 };
  void *p[N] = {0};
  uint64_t sz[N] = {0}, used = 0, peak = 0, live = 0, allocs = 0, frees = 0;
  for (int step = 0; step < 4000; step++) {
    int i = (int)sgm_test_rng_range(&r, 0, N - 1);
    if (p[i]) {
      sgm_free(ctx, p[i], NULL);
      used -= sz[i];
      live--;
      frees++;
      p[i] = NULL;
    } else {
      uint64_t s = sgm_test_rng_log_range(&r, 1, 256 * 1024);
      p[i] = sgm_alloc(ctx, s, NULL);
      assert_non_null(p[i]);
      assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_VRAM);
      sz[i] = (s + 255) & ~255ull;
      used += sz[i];
      live++;
      allocs++;
      if (used > peak) peak = used;
    }
    sgm_tier_stats s = vram_stats(ctx);
    assert_int_equal(s.used_bytes, used);
    assert_int_equal(s.n_live, live);
    assert_int_equal(s.peak_used_bytes, peak);
    assert_int_equal(s.n_allocs, allocs);
    assert_int_equal(s.n_frees, frees);
    assert_true(s.committed_bytes >= s.used_bytes);
  }
  assert_true(sgm__tier_check(ctx->tiers[SGM_TIER_VRAM]));
  char *json = NULL;
  assert_int_equal(sgm_stats_json(ctx, &json), SGM_OK);
  char expect[64];
  snprintf(expect, sizeof expect, "\"used_bytes\":%llu", (unsigned long long)used);
  assert_non_null(strstr(json, expect));
  sgm_string_free(json);
  for (int i = 0; i < N; i++) sgm_free(ctx, p[i], NULL);
  sgm_context_destroy(ctx);
}

/* Invariant: freeing twice or freeing a pointer sgm did not hand out (also an
 * interior pointer) is refused with SGM_ERR_INVALID, counted, and changes
 * nothing; freeing NULL is a no-op. */
static void test_bad_frees(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("64MiB", "1");
  char *a = sgm_alloc(ctx, 4096, NULL);
  char *b = sgm_alloc(ctx, 4096, NULL);
  assert_non_null(a);
  assert_non_null(b);
  int local = 0;
  assert_int_equal(sgm_free_ex(ctx, NULL, NULL), SGM_OK);
  assert_int_equal(sgm_free_ex(ctx, a, NULL), SGM_OK);
  sgm_tier_stats before = vram_stats(ctx);
  assert_int_equal(sgm_free_ex(ctx, a, NULL), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "not a live allocation"));
  assert_int_equal(sgm_free_ex(ctx, &local, NULL), SGM_ERR_INVALID);
  assert_int_equal(sgm_free_ex(ctx, b + 256, NULL), SGM_ERR_INVALID);
  sgm_free(ctx, b + 1, NULL);
  sgm_tier_stats after = vram_stats(ctx);
  assert_int_equal(after.used_bytes, before.used_bytes);
  assert_int_equal(after.n_live, 1);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.n_bad_frees, 4);
  assert_int_equal(sgm_pointer_tier(ctx, a), SGM_TIER_NONE);
  assert_int_equal(sgm_pointer_tier(ctx, b), SGM_TIER_VRAM);
  assert_true(sgm__tier_check(ctx->tiers[SGM_TIER_VRAM]));
  sgm_free(ctx, b, NULL);
  sgm_context_destroy(ctx);
}

/* Invariant: when the budget is full, sgm_alloc returns NULL with
 * SGM_ERR_NOMEM's message naming the budget and the amount in use. */
static void test_nomem_message(void **state) {
  (void)state;
  clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "16MiB", 1);
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  void *a = sgm_alloc(ctx, 10 * MiB, NULL);
  assert_non_null(a);
  assert_null(sgm_alloc(ctx, 10 * MiB, NULL));
  const char *m = sgm_last_error();
  assert_non_null(strstr(m, "budget 16.00 MiB"));
  assert_non_null(strstr(m, "in use 10.00 MiB"));
  assert_non_null(strstr(m, "SGM_VRAM_LIMIT"));
  assert_int_equal(vram_stats(ctx).n_failed, 1);
  sgm_free(ctx, a, NULL);
  sgm_context_destroy(ctx);
}

/* Invariant: whichever backend call fails (N = 1, 2, ...), every public call
 * returns a clean error with a message, the tier stays consistent, the
 * backend holds exactly the committed chunks (no leak), and the loop ends
 * with a run that hit no failure. */
static void test_backend_failure_loop(void **state) {
  (void)state;
  bool clean_run = false;
  for (uint64_t n = 1; n < 500 && !clean_run; n++) {
    clean_env();
    setenv("SGM_EMU_VRAM", "64MiB", 1);
    char v[32];
    snprintf(v, sizeof v, "%llu", (unsigned long long)n);
    setenv("SGM_EMU_FAIL_AT", v, 1);
    setenv("SGM_ALLOW_GROWTH", n % 2 ? "1" : "0", 1);
    sgm_context *ctx = NULL;
    sgm_status rc = sgm_context_create(NULL, &ctx);
    if (rc != SGM_OK) {
      assert_null(ctx);
      assert_true(strlen(sgm_last_error()) > 0);
      continue;
    }
    void *p[40] = {0};
    int failures = 0;
    for (int i = 0; i < 40; i++) {
      p[i] = sgm_alloc(ctx, (size_t)(i + 1) * 30 * 1024, NULL);
      if (!p[i]) {
        failures++;
        assert_true(strlen(sgm_last_error()) > 0);
      }
      sgm_tier_stats s = vram_stats(ctx);
      assert_int_equal(backend_counters(ctx).device_live_bytes, s.committed_bytes);
      if (i % 3 == 2) {
        sgm_free(ctx, p[i - 1], NULL);
        p[i - 1] = NULL;
      }
    }
    assert_int_equal(sgm_trim(ctx), SGM_OK);
    assert_true(sgm__tier_check(ctx->tiers[SGM_TIER_VRAM]));
    for (int i = 0; i < 40; i++) sgm_free(ctx, p[i], NULL);
    assert_int_equal(sgm_trim(ctx), SGM_OK);
    if (sgm_context_config(ctx)->allow_growth)
      assert_int_equal(backend_counters(ctx).device_live_bytes, 0);
    clean_run = backend_counters(ctx).n_calls < n;
    if (clean_run) assert_int_equal(failures, 0);
    sgm_context_destroy(ctx);
  }
  assert_true(clean_run);
}

/* Thread stress: each thread allocates, writes a pattern it owns through the
 * backend, checks it later and frees; an overlap between two live blocks would
 * corrupt a pattern. Run under TSan in CI. */
typedef struct stress_arg {
  sgm_context *ctx; /* shared context */
  uint64_t seed;    /* this thread's seed */
  int failures;     /* pattern mismatches seen */
} stress_arg;

static void *stress_thread(void *vp) {
  stress_arg *a = vp;
  sgm_test_rng r;
  sgm_test_rng_init(&r, a->seed);
  enum { SLOTS = 32 };
  void *p[SLOTS] = {0};
  uint64_t sz[SLOTS] = {0};
  unsigned char buf[8192], back[8192];
  for (int step = 0; step < 3000; step++) {
    int i = (int)sgm_test_rng_range(&r, 0, SLOTS - 1);
    if (p[i]) {
      uint64_t n = sz[i] < sizeof back ? sz[i] : sizeof back;
      a->ctx->bops->copy(a->ctx->be, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)back, (uintptr_t)p[i], n, NULL);
      for (uint64_t k = 0; k < n; k++)
        if (back[k] != (unsigned char)((uintptr_t)p[i] >> 8 ^ k ^ a->seed)) {
          a->failures++;
          break;
        }
      sgm_free(a->ctx, p[i], NULL);
      p[i] = NULL;
    } else {
      sz[i] = sgm_test_rng_log_range(&r, 16, 64 * 1024);
      p[i] = sgm_alloc(a->ctx, sz[i], NULL);
      if (!p[i]) continue;
      uint64_t n = sz[i] < sizeof buf ? sz[i] : sizeof buf;
      for (uint64_t k = 0; k < n; k++) buf[k] = (unsigned char)((uintptr_t)p[i] >> 8 ^ k ^ a->seed);
      a->ctx->bops->copy(a->ctx->be, SGM_COPY_HOST_TO_DEVICE, (uintptr_t)p[i], (uintptr_t)buf, n, NULL);
    }
    if (step % 500 == 0) sgm_trim(a->ctx);
  }
  for (int i = 0; i < SLOTS; i++) sgm_free(a->ctx, p[i], NULL);
  return NULL;
}

static void test_thread_stress(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("context.threads", 7);
  sgm_context *ctx = make_ctx("256MiB", "1");
  enum { T = 4 };
  pthread_t th[T];
  stress_arg args[T];
  for (int t = 0; t < T; t++) {
    args[t] = (stress_arg){.ctx = ctx, .seed = seed + (uint64_t)t * 1000003u};
    assert_int_equal(pthread_create(&th[t], NULL, stress_thread, &args[t]), 0);
  }
  for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
  for (int t = 0; t < T; t++) assert_int_equal(args[t].failures, 0);
  sgm_tier_stats s = vram_stats(ctx);
  assert_int_equal(s.n_live, 0);
  assert_int_equal(s.used_bytes, 0);
  assert_true(sgm__tier_check(ctx->tiers[SGM_TIER_VRAM]));
  sgm_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_budget_resolution),
      cmocka_unit_test(test_growth_vs_reserve),
      cmocka_unit_test(test_tf_override),
      cmocka_unit_test(test_trim),
      cmocka_unit_test(test_growth_reclaims_free_chunks),
      cmocka_unit_test(test_stats_consistency),
      cmocka_unit_test(test_bad_frees),
      cmocka_unit_test(test_nomem_message),
      cmocka_unit_test(test_backend_failure_loop),
      cmocka_unit_test(test_thread_stress),
  };
  return cmocka_run_group_tests_name("context", tests, NULL, NULL);
}
