/*
 * test_gpu_path.c — the user's allocation path through the stream-ordered
 * caches of the tier pool (lib/tiers/pool), on the emulated device (synchronous: every stream is one):
 * what is counted where (used vs cached), size classes, magazines of other
 * threads reclaimed before anything falls back, exact counters after threads
 * exit, and sgm_record_stream's contract. The same rules on an asynchronous
 * device are checked against the driver double in test_stream_order.c.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test_util.h"
#include "tiers/tier.h"

#define MiB (UINT64_C(1) << 20)

static sgm_context *make_ctx(const char *vram, const char *shared) {
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "emu", 1);
  setenv("SGM_EMU_VRAM", "256MiB", 1);
  setenv("SGM_VRAM_LIMIT", vram, 1);
  setenv("SGM_SHARED_LIMIT", shared, 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1); /* nothing reclaims behind the test's back */
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fprintf(stderr, "create: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  return ctx;
}

static sgm_tier_stats vram(sgm_context *ctx) {
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  return st.tier[SGM_TIER_VRAM];
}

/* Invariants: a freed block leaves used_bytes and n_live at once and shows in
 * cached_bytes; the next allocation of its size class on the stream gets it
 * back; sgm_trim returns cached memory and then the wholly free chunk. */
static void test_cached_is_not_used(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("64MiB", "64MiB");
  void *p = sgm_alloc(ctx, 1100, NULL); /* class 1280 */
  assert_non_null(p);
  assert_int_equal((uintptr_t)p % 256, 0);
  sgm_tier_stats s = vram(ctx);
  assert_int_equal(s.used_bytes, 1280);
  assert_int_equal(s.n_live, 1);
  assert_int_equal(s.cached_bytes, 0);
  sgm_free(ctx, p, NULL);
  s = vram(ctx);
  assert_int_equal(s.used_bytes, 0);
  assert_int_equal(s.n_live, 0);
  assert_int_equal(s.cached_bytes, 1280);
  assert_int_equal(sgm_pointer_tier(ctx, p), SGM_TIER_NONE);
  assert_int_equal(sgm_free_ex(ctx, p, NULL), SGM_ERR_INVALID); /* cached is not live */
  void *q = sgm_alloc(ctx, 1200, NULL); /* same class: the cached block */
  assert_ptr_equal(q, p);
  assert_int_equal(vram(ctx).used_bytes, 1280);
  sgm_free(ctx, q, NULL);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  s = vram(ctx);
  assert_int_equal(s.cached_bytes, 0);
  assert_int_equal(s.committed_bytes, 0);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  sgm_context_destroy(ctx);
}

/* Invariant: every size from 1 byte to 2 MiB gets a 256-aligned block of at
 * least its size, counted in used as its 256-rounded size. */
static void test_size_classes(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("256MiB", "64MiB");
  sgm_test_rng r;
  uint64_t seed = sgm_test_seed("gpu_path.classes", 7);
  sgm_test_rng_init(&r, seed);
  enum { N = 400 };
  void *p[N];
  uint64_t used = 0;
  for (int i = 0; i < N; i++) {
    uint64_t size = sgm_test_rng_log_range(&r, 1, 2 * MiB);
    p[i] = sgm_alloc(ctx, size, NULL);
    assert_non_null(p[i]);
    assert_int_equal((uintptr_t)p[i] % 256, 0);
    used += (size + 255) & ~UINT64_C(255);
    assert_int_equal(vram(ctx).used_bytes, used);
  }
  for (int i = 0; i < N; i++) sgm_free(ctx, p[i], NULL);
  assert_int_equal(vram(ctx).used_bytes, 0);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  sgm_context_destroy(ctx);
}

typedef struct holder {
  sgm_context *ctx;
  pthread_barrier_t *freed;   /* the thread has freed its blocks (still cached in its magazine) */
  pthread_barrier_t *done;    /* the main thread has checked: the thread may exit */
} holder;

static void *hold_cached(void *arg) {
  holder *h = arg;
  void *p[8];
  for (int i = 0; i < 8; i++) p[i] = sgm_alloc(h->ctx, 1 * MiB, NULL);
  for (int i = 0; i < 8; i++) sgm_free(h->ctx, p[i], NULL);
  pthread_barrier_wait(h->freed);
  pthread_barrier_wait(h->done);
  return NULL;
}

/* Invariant: blocks cached in another (live) thread's magazine are reclaimed
 * before an allocation falls back to shared memory: with 8 MiB of VRAM all
 * cached by thread T as 1 MiB blocks, a 4 MiB allocation still lands in VRAM. */
static void test_other_threads_cache_reclaimed_before_fallback(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("8MiB", "64MiB");
  pthread_barrier_t freed, done;
  pthread_barrier_init(&freed, NULL, 2);
  pthread_barrier_init(&done, NULL, 2);
  holder h = {ctx, &freed, &done};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, hold_cached, &h), 0);
  pthread_barrier_wait(&freed);
  assert_int_equal(vram(ctx).cached_bytes, 8 * MiB);
  void *big = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(big);
  assert_int_equal(sgm_pointer_tier(ctx, big), SGM_TIER_VRAM);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.n_fallbacks, 0);
  pthread_barrier_wait(&done);
  assert_int_equal(pthread_join(th, NULL), 0);
  sgm_free(ctx, big, NULL);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  pthread_barrier_destroy(&freed);
  pthread_barrier_destroy(&done);
  sgm_context_destroy(ctx);
}

typedef struct churner {
  sgm_context *ctx;
  uint64_t seed;               /* this thread's sizes */
  int pairs;                   /* alloc+free pairs to make */
  int failures;                /* calls that failed (cmocka asserts only on the main thread) */
  pthread_barrier_t *checked;  /* both threads are done; main checks before they exit */
} churner;

static void *churn(void *arg) {
  churner *c = arg;
  sgm_test_rng r;
  sgm_test_rng_init(&r, c->seed);
  enum { RING = 32 };
  void *ring[RING] = {0};
  for (int i = 0; i < c->pairs; i++) {
    int k = i % RING;
    if (ring[k] && sgm_free_ex(c->ctx, ring[k], NULL) != SGM_OK) c->failures++;
    ring[k] = sgm_alloc(c->ctx, sgm_test_rng_log_range(&r, 1, 512 * 1024), NULL);
    if (!ring[k]) c->failures++;
  }
  for (int k = 0; k < RING; k++) sgm_free(c->ctx, ring[k], NULL);
  pthread_barrier_wait(c->checked);
  pthread_barrier_wait(c->checked);
  return NULL;
}

/* Invariants: two threads allocating and freeing on one context leave exact
 * counters once they stop — while they are still alive (their magazines
 * summed) and after they exit (their magazines handed back): nothing used,
 * nothing live, as many frees as allocations; the pool stays consistent. */
static void test_two_threads_exact_counters(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("256MiB", "64MiB");
  uint64_t seed = sgm_test_seed("gpu_path.threads", 11);
  enum { PAIRS = 20000 };
  pthread_barrier_t checked;
  pthread_barrier_init(&checked, NULL, 3);
  churner c[2] = {{ctx, seed, PAIRS, 0, &checked}, {ctx, seed + 1, PAIRS, 0, &checked}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, churn, &c[i]), 0);
  pthread_barrier_wait(&checked);
  assert_int_equal(c[0].failures + c[1].failures, 0);
  for (int pass = 0; pass < 2; pass++) {
    sgm_tier_stats s = vram(ctx);
    assert_int_equal(s.used_bytes, 0);
    assert_int_equal(s.n_live, 0);
    assert_int_equal(s.n_allocs, 2 * PAIRS);
    assert_int_equal(s.n_frees, 2 * PAIRS);
    assert_true(s.peak_used_bytes > 0);
    assert_true(s.committed_bytes >= s.cached_bytes);
    assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
    if (pass == 0) {
      pthread_barrier_wait(&checked);
      for (int i = 0; i < 2; i++) assert_int_equal(pthread_join(th[i], NULL), 0);
    }
  }
  pthread_barrier_destroy(&checked);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  assert_int_equal(vram(ctx).committed_bytes, 0);
  sgm_context_destroy(ctx);
}

/* Invariants of sgm_record_stream's contract: a live pointer is accepted
 * (also its own stream, also twice); a freed or foreign one is SGM_ERR_INVALID
 * with a message; NULL context is refused. On a synchronous device the free
 * that follows is an ordinary free. */
static void test_record_stream_contract(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("64MiB", "64MiB");
  void *other = (void *)(uintptr_t)0x1000; /* a stream handle the emulated device never reads */
  void *p = sgm_alloc(ctx, 4096, NULL);
  assert_non_null(p);
  assert_int_equal(sgm_record_stream(ctx, p, other), SGM_OK);
  assert_int_equal(sgm_record_stream(ctx, p, other), SGM_OK);
  assert_int_equal(sgm_record_stream(ctx, p, NULL), SGM_OK);
  assert_int_equal(sgm_free_ex(ctx, p, NULL), SGM_OK);
  assert_int_equal(sgm_record_stream(ctx, p, other), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "not a live allocation"));
  int local = 0;
  assert_int_equal(sgm_record_stream(ctx, &local, other), SGM_ERR_INVALID);
  assert_int_equal(sgm_record_stream(NULL, p, other), SGM_ERR_INVALID);
  void *q = sgm_alloc(ctx, 4096, NULL);
  assert_ptr_equal(q, p);
  sgm_free(ctx, q, NULL);
  sgm_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cached_is_not_used),
      cmocka_unit_test(test_size_classes),
      cmocka_unit_test(test_other_threads_cache_reclaimed_before_fallback),
      cmocka_unit_test(test_two_threads_exact_counters),
      cmocka_unit_test(test_record_stream_contract),
  };
  return cmocka_run_group_tests_name("gpu_path", tests, NULL, NULL);
}
