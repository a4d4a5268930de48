/*
 * test_capture_pool.c — capture pools through the public API (issue 24
 * defect 7, issue 25): memory a captured graph uses is never reused by
 * others, trimmed or unmapped until its pool is released. Runs on emu and,
 * as cuda_api_test_capture_pool, on the CUDA backend over the driver double.
 * The idle trim is the real one (SGM_IDLE_TRIM_MS=40, the idle thread), so
 * the tests sleep a few idle periods; a control block outside any pool shows
 * that the period did trim.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "sgm.h"

#define MiB (UINT64_C(1) << 20)
#define IDLE_MS 40
/* Streams as opaque handles: the emulated device orders nothing, the double
 * creates nothing for a handle it never saw, so only the legacy stream and
 * the per-thread one are used where the backend must accept them. */
#define STREAM_A NULL
#define STREAM_B ((void *)0x2) /* CU_STREAM_PER_THREAD */

static char backend_env[32] = "emu";

static sgm_context *make_ctx(void) {
  setenv("SGM_BACKEND", backend_env, 1);
  setenv("SGM_VERBOSE", "0", 1);
  setenv("SGM_EMU_VRAM", "256MiB", 1);
  setenv("SGM_ALLOW_GROWTH", "1", 1);
  setenv("SGM_IDLE_TRIM_MS", "40", 1);
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fprintf(stderr, "sgm_context_create: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  return ctx;
}

static sgm_tier_stats vram(sgm_context *ctx) {
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  return st.tier[SGM_TIER_VRAM];
}

/* Several idle periods: the idle thread ticks every IDLE_MS / 4 and returns
 * what it saw free for IDLE_MS. */
static void idle_periods(int n) {
  struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)n * IDLE_MS * 1000000L};
  while (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  nanosleep(&ts, NULL);
}

/* Invariant (defect 7): a pool's freed blocks stay committed and used through
 * idle trim periods and sgm_trim, while a freed block outside the pool is
 * returned in the same periods; the release gives them back. */
static void test_pool_survives_idle_trim(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  const uint64_t pool = 7;
  assert_int_equal(sgm_capture_pool_begin(ctx, STREAM_A, pool), SGM_OK);
  void *tmp = sgm_alloc(ctx, 24 * MiB, STREAM_A);  /* a capture's temporary */
  void *keep = sgm_alloc(ctx, 8 * MiB, STREAM_A);  /* its output */
  assert_non_null(tmp);
  assert_non_null(keep);
  sgm_free(ctx, tmp, STREAM_A); /* freed inside the capture */
  assert_int_equal(sgm_capture_pool_end(ctx, pool), SGM_OK);
  void *other = sgm_alloc(ctx, 24 * MiB, STREAM_A); /* after the capture: not the pool's */
  assert_non_null(other);
  assert_ptr_not_equal(other, tmp); /* never handed to another allocation */
  sgm_free(ctx, other, STREAM_A);

  sgm_capture_pool_stats ps;
  assert_int_equal(sgm_capture_pool_info(ctx, pool, &ps), SGM_OK);
  assert_int_equal(ps.parked_bytes, 24 * MiB);
  assert_int_equal(ps.live_bytes, 8 * MiB);
  uint64_t committed = vram(ctx).committed_bytes;
  assert_true(committed >= 56 * MiB);

  idle_periods(8);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  idle_periods(4);
  sgm_tier_stats v = vram(ctx);
  /* The control block went back; the pool's 32 MiB are still used. */
  assert_true(v.committed_bytes < committed);
  assert_true(v.committed_bytes >= 32 * MiB);
  assert_int_equal(v.used_bytes, 32 * MiB);
  assert_int_equal(sgm_pointer_tier(ctx, tmp), SGM_TIER_VRAM);

  /* A second capture into the same pool (PyTorch: pool=g1.pool()) takes the
   * parked temporary back. */
  assert_int_equal(sgm_capture_pool_begin(ctx, STREAM_A, pool), SGM_OK);
  void *again = sgm_alloc(ctx, 24 * MiB, STREAM_A);
  assert_ptr_equal(again, tmp);
  sgm_free(ctx, again, STREAM_A);
  assert_int_equal(sgm_capture_pool_end(ctx, pool), SGM_OK);

  /* Two begins (two graphs sharing the pool): the first release keeps it. */
  assert_int_equal(sgm_capture_pool_release(ctx, pool), SGM_OK);
  assert_int_equal(sgm_capture_pool_info(ctx, pool, &ps), SGM_OK);
  assert_int_equal(ps.parked_bytes, 24 * MiB);
  assert_int_equal(vram(ctx).used_bytes, 32 * MiB);
  /* The last release: the parked block is freed, the live one becomes ordinary. */
  assert_int_equal(sgm_capture_pool_release(ctx, pool), SGM_OK);
  assert_int_equal(sgm_capture_pool_info(ctx, pool, &ps), SGM_ERR_INVALID);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  v = vram(ctx);
  assert_int_equal(v.used_bytes, 8 * MiB);
  assert_true(v.committed_bytes < 32 * MiB);
  sgm_free(ctx, keep, STREAM_A);
  assert_int_equal(vram(ctx).used_bytes, 0);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  assert_int_equal(vram(ctx).committed_bytes, 0);
  sgm_context_destroy(ctx);
}

/* Invariant: a scope covers the thread that began it on its stream only; a
 * parked block is taken again only on the stream it was freed on, and one
 * that sgm_record_stream named is never taken again before the release. */
static void test_scope_stream_and_record(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  const uint64_t pool = 9;
  assert_int_equal(sgm_capture_pool_begin(ctx, STREAM_A, pool), SGM_OK);
  void *a = sgm_alloc(ctx, 4 * MiB, STREAM_A);
  void *b = sgm_alloc(ctx, 4 * MiB, STREAM_B); /* another stream: not under the pool */
  sgm_capture_pool_stats ps;
  assert_int_equal(sgm_capture_pool_info(ctx, pool, &ps), SGM_OK);
  assert_int_equal(ps.n_live, 1);
  sgm_free(ctx, b, STREAM_B);
  assert_int_equal(sgm_record_stream(ctx, a, STREAM_B), SGM_OK);
  sgm_free(ctx, a, STREAM_A);
  /* Freed after a record_stream: parked, but never reused by the pool. */
  void *c = sgm_alloc(ctx, 4 * MiB, STREAM_A);
  assert_ptr_not_equal(c, a);
  assert_int_equal(sgm_record_stream(ctx, a, STREAM_B), SGM_ERR_INVALID); /* a was freed */
  sgm_free(ctx, c, STREAM_A);
  /* A parked block freed again is a double free: refused, counted. */
  assert_int_equal(sgm_free_ex(ctx, c, STREAM_A), SGM_ERR_INVALID);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_bad_frees, 1);
  /* Size rule: a parked block serves at most 1/8 more than asked. */
  void *d = sgm_alloc(ctx, 2 * MiB, STREAM_A);
  assert_ptr_not_equal(d, c);
  sgm_free(ctx, d, STREAM_A);
  assert_int_equal(sgm_capture_pool_info(ctx, pool, &ps), SGM_OK);
  assert_int_equal(ps.n_parked, 3);
  assert_int_equal(ps.parked_bytes, 10 * MiB);
  assert_int_equal(sgm_capture_pool_end(ctx, pool), SGM_OK);
  assert_int_equal(sgm_capture_pool_end(ctx, pool), SGM_ERR_INVALID); /* no scope left */
  assert_int_equal(sgm_capture_pool_release(ctx, pool), SGM_OK);
  assert_int_equal(sgm_capture_pool_release(ctx, pool), SGM_ERR_INVALID);
  assert_int_equal(vram(ctx).used_bytes, 0);
  assert_int_equal(sgm_capture_pool_begin(ctx, STREAM_A, 0), SGM_ERR_INVALID);
  assert_int_equal(sgm_capture_pool_begin(NULL, STREAM_A, 1), SGM_ERR_INVALID);
  sgm_context_destroy(ctx);
}

typedef struct {
  sgm_context *ctx;
  void *p;
} other_thread_arg;

static void *other_thread(void *arg) {
  other_thread_arg *a = arg;
  a->p = sgm_alloc(a->ctx, 1 * MiB, STREAM_A);
  return NULL;
}

/* Invariant: another thread's allocations, even on the pool's stream, do not
 * join a scope it did not begin; a context destroyed with pools frees their
 * parked blocks (no leak reported, nothing left used). */
static void test_other_thread_and_destroy(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  assert_int_equal(sgm_capture_pool_begin(ctx, SGM_CAPTURE_ANY_STREAM, 3), SGM_OK);
  other_thread_arg arg = {ctx, NULL};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, other_thread, &arg), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  void *mine = sgm_alloc(ctx, 1 * MiB, STREAM_B);
  sgm_capture_pool_stats ps;
  assert_int_equal(sgm_capture_pool_info(ctx, 0, &ps), SGM_OK);
  assert_int_equal(ps.n_pools, 1);
  assert_int_equal(ps.n_live, 1);
  sgm_free(ctx, arg.p, STREAM_A);
  sgm_free(ctx, mine, STREAM_B);
  assert_int_equal(vram(ctx).used_bytes, 1 * MiB); /* mine, parked */
  sgm_context_destroy(ctx);
}

typedef struct {
  sgm_context *ctx;
  uint64_t pool;
  unsigned seed;
  int bad;
} worker_arg;

static void *pool_worker(void *arg) {
  worker_arg *w = arg;
  void *live[8] = {0};
  size_t size[8] = {0};
  if (sgm_capture_pool_begin(w->ctx, SGM_CAPTURE_ANY_STREAM, w->pool) != SGM_OK) w->bad++;
  for (int i = 0; i < 400; i++) {
    int k = (int)(rand_r(&w->seed) % 8);
    if (live[k]) {
      sgm_free(w->ctx, live[k], STREAM_A);
      live[k] = NULL;
    } else {
      size[k] = (size_t)(1 + rand_r(&w->seed) % 4) * (256 << 10);
      live[k] = sgm_alloc(w->ctx, size[k], STREAM_A);
      if (!live[k]) w->bad++;
    }
  }
  if (sgm_capture_pool_end(w->ctx, w->pool) != SGM_OK) w->bad++;
  for (int k = 0; k < 8; k++) sgm_free(w->ctx, live[k], STREAM_A);
  if (sgm_capture_pool_release(w->ctx, w->pool) != SGM_OK) w->bad++;
  return NULL;
}

/* Invariant: threads feeding their own pools at once while another trims
 * leave nothing used once every pool is released (seeded; TSan runs it). */
static void test_threads(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  enum { N = 4 };
  pthread_t t[N];
  worker_arg w[N];
  unsigned seed = (unsigned)time(NULL);
  printf("# test_threads seed %u\n", seed);
  for (int i = 0; i < N; i++) {
    w[i] = (worker_arg){ctx, (uint64_t)(100 + i), seed + (unsigned)i, 0};
    assert_int_equal(pthread_create(&t[i], NULL, pool_worker, &w[i]), 0);
  }
  for (int r = 0; r < 20; r++) assert_int_equal(sgm_trim(ctx), SGM_OK);
  for (int i = 0; i < N; i++) {
    assert_int_equal(pthread_join(t[i], NULL), 0);
    assert_int_equal(w[i].bad, 0);
  }
  sgm_capture_pool_stats ps;
  assert_int_equal(sgm_capture_pool_info(ctx, 0, &ps), SGM_OK);
  assert_int_equal(ps.n_pools, 0);
  assert_int_equal(vram(ctx).used_bytes, 0);
  sgm_context_destroy(ctx);
}

int main(void) {
  const char *b = getenv("SGM_BACKEND");
  if (b && *b) snprintf(backend_env, sizeof backend_env, "%s", b);
  printf("# capture pool suite on SGM_BACKEND=%s\n", backend_env);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pool_survives_idle_trim),
      cmocka_unit_test(test_scope_stream_and_record),
      cmocka_unit_test(test_other_thread_and_destroy),
      cmocka_unit_test(test_threads),
  };
  return cmocka_run_group_tests_name("capture_pool", tests, NULL, NULL);
}
