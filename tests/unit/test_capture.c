/*
 * test_capture.c — sgm under CUDA graph capture (issue 10 item 3), on
 * SGM_BACKEND=cuda against the driver test double, which models capture as
 * the driver does: in the default GLOBAL mode, a memory call (cuMemAlloc,
 * cuMemHostRegister, ...) made while a capture goes on invalidates it;
 * querying or waiting on an event last recorded into a capture fails
 * (CUDA_ERROR_CAPTURED_EVENT), also after the capture ended. A capture
 * that was invalidated fails at cuStreamEndCapture
 * (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED): that is what each case checks last.
 *
 * What sgm guarantees (docs/frameworks.md, "CUDA graphs"):
 *  - allocating while a stream captures, also when the pool must grow from
 *    the driver (VRAM chunk, pinned shared chunk), leaves the capture valid;
 *  - a block freed on a capturing stream is reused by that stream inside the
 *    capture (graph order), by other streams only after the capture ended;
 *  - events recorded during a capture (a free, a buffer release) are never
 *    queried while it goes on.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#include "fake_fixture.h"
#include "internal.h"
#include "test_util.h"

#define MiB (UINT64_C(1) << 20)

static sgm_fake_control fc;
/* The driver calls the test makes itself, as an application would. */
static struct {
  CUresult (*begin)(CUstream, CUstreamCaptureMode);
  CUresult (*end)(CUstream, CUgraph *);
} drv;
static void *fake_lib;

static int load_fake(void **state) {
  (void)state;
  fake_lib = sgm_fake_load(&fc);
  if (!fake_lib) return -1;
  *(void **)&drv.begin = sgm_fake_need(fake_lib, "cuStreamBeginCapture_v2");
  *(void **)&drv.end = sgm_fake_need(fake_lib, "cuStreamEndCapture");
  return drv.begin && drv.end ? 0 : -1; /* no capture model */
}

static int unload_fake(void **state) {
  (void)state;
  if (fake_lib) dlclose(fake_lib);
  return 0;
}

/* A CUDA context on device 0 with a VRAM budget of vram_limit in growth mode
 * (chunks come from the driver when the pool grows), and the primary context
 * current on this thread so that the test can begin captures. */
static sgm_context *make_ctx(const char *vram_limit, bool fallback) {
  sgm_context *ctx = sgm_fake_sgm_context(vram_limit, fallback, NULL);
  sgm_fake_ctx_push(fake_lib);
  return ctx;
}

static void destroy_ctx(sgm_context *ctx) {
  sgm_context_destroy(ctx);
  sgm_fake_ctx_pop(fake_lib);
  assert_int_equal(fc.fake_cuda_live_allocations(), 0);
}

static void end_capture_valid(void *stream) {
  CUgraph g = NULL;
  CUresult r = drv.end((CUstream)stream, &g);
  if (r != CUDA_SUCCESS)
    fail_msg("the capture was invalidated by sgm (cuStreamEndCapture returned %d)", (int)r);
  assert_non_null(g);
}

/* Invariant: allocations during a GLOBAL-mode capture that make the VRAM pool
 * grow (cuMemAlloc) and then spill into a new pinned chunk (cuMemHostRegister)
 * succeed and leave the capture valid. */
static void test_alloc_growing_during_capture(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("4MiB", true);
  void *s = fc.fake_cuda_stream_create();
  assert_int_equal(drv.begin((CUstream)s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  void *v = sgm_alloc(ctx, 2 * MiB, s);
  if (!v) fail_msg("alloc during capture failed: %s", sgm_last_error());
  assert_int_equal(sgm_pointer_tier(ctx, v), SGM_TIER_VRAM);
  void *h = sgm_alloc(ctx, 4 * MiB, s); /* past the VRAM budget: a new pinned chunk */
  if (!h) fail_msg("fallback alloc during capture failed: %s", sgm_last_error());
  assert_int_equal(sgm_pointer_tier(ctx, h), SGM_TIER_SHARED);
  end_capture_valid(s);
  sgm_free(ctx, h, s);
  sgm_free(ctx, v, s);
  fc.fake_cuda_stream_destroy(s);
  destroy_ctx(ctx);
}

/* Invariant: a block freed on a capturing stream S is reused by S inside the
 * capture, refused to stream B while the capture goes on (its event is a
 * graph node: never queried, so the capture stays valid), and reusable by B
 * once the capture ended. */
static void test_free_during_capture_deferred(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("4MiB", false);
  void *s = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *p = sgm_alloc(ctx, 4 * MiB, s);
  assert_non_null(p);
  assert_int_equal(drv.begin((CUstream)s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  assert_int_equal(sgm_free_ex(ctx, p, s), SGM_OK);
  assert_null(sgm_alloc(ctx, 4 * MiB, b)); /* B: not while S captures */
  void *again = sgm_alloc(ctx, 4 * MiB, s); /* S itself: graph order holds */
  assert_ptr_equal(again, p);
  assert_int_equal(sgm_free_ex(ctx, again, s), SGM_OK);
  assert_null(sgm_alloc(ctx, 4 * MiB, b));
  assert_int_equal(sgm_trim(ctx), SGM_OK); /* trim reclaims too: no query either */
  end_capture_valid(s);
  /* The capture ended: B may have the block once S's real work queued before
   * the free is done (the event is recorded again after it; the double runs
   * it on its worker). */
  void *q = sgm_alloc(ctx, 4 * MiB, b);
  if (!q) {
    fc.fake_cuda_settle();
    q = sgm_alloc(ctx, 4 * MiB, b);
  }
  assert_ptr_equal(q, p);
  sgm_free(ctx, q, b);
  fc.fake_cuda_stream_destroy(b);
  fc.fake_cuda_stream_destroy(s);
  destroy_ctx(ctx);
}

/* Invariant: releasing a buffer on a capturing stream records its event into
 * the capture without querying it; eviction (which asks whether the GPU work
 * before the release is done) says BUSY while the capture goes on and moves
 * the buffer once it ended. */
static void test_buffer_release_during_capture(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("8MiB", true);
  void *s = fc.fake_cuda_stream_create();
  sgm_buffer *buf = NULL;
  assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &buf), SGM_OK);
  void *dptr = NULL;
  assert_int_equal(sgm_buffer_acquire(buf, s, &dptr), SGM_OK);
  assert_int_equal(drv.begin((CUstream)s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  assert_int_equal(sgm_buffer_release(buf, s), SGM_OK);
  assert_int_equal(sgm_buffer_evict(buf, SGM_TIER_SHARED), SGM_ERR_BUSY);
  end_capture_valid(s);
  sgm_status rc = sgm_buffer_evict(buf, SGM_TIER_SHARED);
  if (rc == SGM_ERR_BUSY) { /* the event, recorded again after the capture, runs on the worker */
    fc.fake_cuda_settle();
    rc = sgm_buffer_evict(buf, SGM_TIER_SHARED);
  }
  assert_int_equal(rc, SGM_OK);
  assert_int_equal(sgm_buffer_tier(buf), SGM_TIER_SHARED);
  sgm_buffer_destroy(buf);
  fc.fake_cuda_stream_destroy(s);
  destroy_ctx(ctx);
}

/* Invariant (the legacy stream during another stream's capture): while a
 * blocking stream captures, any work on the legacy stream would invalidate
 * that capture (STREAM_CAPTURE_IMPLICIT). Blocks cached on the legacy stream
 * then stay there: an allocation on a third stream does not take them, and
 * neither it nor sgm_trim records anything on the legacy stream; the capture
 * stays valid, and the blocks move once it ended. */
static void test_legacy_cache_during_other_capture(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("4MiB", false);
  void *c = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *p = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(p);
  sgm_free(ctx, p, NULL);
  assert_int_equal(drv.begin((CUstream)c, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  assert_null(sgm_alloc(ctx, 4 * MiB, b)); /* not while c captures */
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  end_capture_valid(c);
  void *q = sgm_alloc(ctx, 4 * MiB, b);
  assert_ptr_equal(q, p);
  sgm_free(ctx, q, b);
  fc.fake_cuda_stream_destroy(b);
  fc.fake_cuda_stream_destroy(c);
  destroy_ctx(ctx);
}

/* Invariant: blocks sealed under a fence on stream a do not cross to a
 * stream b that captures: b is asked first, nothing waits on the fence from
 * b (the wait would enter the user's graph), and a's fence, recorded before,
 * is never a captured event. The capture stays valid; once it ended the
 * blocks cross with the taker's check and one wait. */
static void test_fenced_transfer_to_capturing_stream(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("4MiB", false);
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *p = sgm_alloc(ctx, 4 * MiB, a);
  assert_non_null(p);
  fc.fake_cuda_hold_events(1); /* a's fence stays pending: nothing returns to the pool */
  sgm_free(ctx, p, a);
  sgm__context_idle_tick(ctx); /* the fence: recorded on a, which does not capture */
  uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");
  assert_int_equal(drv.begin((CUstream)b, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  assert_null(sgm_alloc(ctx, 4 * MiB, b)); /* not while b captures */
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 0);
  end_capture_valid(b);
  void *q = sgm_alloc(ctx, 4 * MiB, b);
  assert_ptr_equal(q, p);
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 1);
  sgm_free(ctx, q, b);
  fc.fake_cuda_hold_events(0);
  fc.fake_cuda_complete_events();
  fc.fake_cuda_stream_destroy(b);
  fc.fake_cuda_stream_destroy(a);
  destroy_ctx(ctx);
}

/* Invariants (seal on transfer, non-blocking streams, docs/streams.md "Why
 * two calls"): while the owner a captures, a transfer records nothing on it
 * and nothing waits; while the taker b captures, a's fence may be recorded
 * (a does not capture: the record is outside any capture) but b waits on
 * nothing; both captures stay valid. Once they ended, the block crosses
 * under that fence with b's two calls, nothing recorded. */
static void test_seal_on_transfer_during_capture(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("4MiB", false);
  void *a = sgm_fake_non_blocking_stream(fake_lib), *b = sgm_fake_non_blocking_stream(fake_lib);
  void *x = sgm_alloc(ctx, 2 * MiB, a), *y = sgm_alloc(ctx, MiB, a);
  assert_true(x && y);
  fc.fake_cuda_hold_events(1); /* fences stay pending: nothing returns to the pool */
  sgm_free(ctx, x, a);
  sgm_free(ctx, y, a);
  uint64_t records = fc.fake_cuda_calls("cuEventRecord");
  uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");

  assert_int_equal(drv.begin((CUstream)a, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  assert_null(sgm_alloc(ctx, 2 * MiB, b)); /* not while the owner captures */
  assert_int_equal(fc.fake_cuda_calls("cuEventRecord") - records, 0);
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 0);
  end_capture_valid(a);

  assert_int_equal(drv.begin((CUstream)b, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  assert_null(sgm_alloc(ctx, 2 * MiB, b)); /* not while the taker captures */
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 0);
  end_capture_valid(b);
  records = fc.fake_cuda_calls("cuEventRecord");

  uint64_t calls = fc.fake_cuda_calls(NULL);
  void *p = sgm_alloc(ctx, 2 * MiB, b);
  assert_ptr_equal(p, x);
  assert_int_equal(fc.fake_cuda_calls(NULL) - calls, 2);
  assert_int_equal(fc.fake_cuda_calls("cuEventRecord") - records, 0);
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 1);
  sgm_free(ctx, p, b);
  fc.fake_cuda_hold_events(0);
  fc.fake_cuda_complete_events();
  destroy_ctx(ctx);
  sgm_fake_stream_destroy(fake_lib, a);
  sgm_fake_stream_destroy(fake_lib, b);
}

/* ==== issue 24 (first contact): sgm's own queries during a GLOBAL capture ==== */

/* Invariant (defect 1a): an allocation on a capturing stream that misses its
 * cache, so that the pool reclaims another stream's cached blocks (their
 * fence, on a stream that does not capture, queried from the capturing
 * thread) before it can grow, succeeds and leaves the GLOBAL capture valid. */
static void test_reclaim_query_on_the_capturing_thread(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("16MiB", false);
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *p = sgm_alloc(ctx, 8 * MiB, a), *q = sgm_alloc(ctx, 4 * MiB, a);
  assert_true(p && q);
  fc.fake_cuda_hold_stream(a, 1); /* a's fence stays pending: queried, never done */
  sgm_free(ctx, p, a);             /* cached for a */
  sgm__context_idle_tick(ctx);     /* sealed under a fence recorded on a */
  uint64_t queries = fc.fake_cuda_calls("cuEventQuery");
  assert_int_equal(drv.begin((CUstream)b, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  /* 12 MiB committed of 16: the pool must reclaim a's 8 MiB, which are not
   * free yet: the allocation fails with NOMEM (a clear message), not a
   * broken capture. */
  assert_null(sgm_alloc(ctx, 8 * MiB, b));
  assert_non_null(strstr(sgm_last_error(), "budget exhausted"));
  end_capture_valid(b);
  /* The path under test was taken: a's fence was queried. */
  assert_true(fc.fake_cuda_calls("cuEventQuery") > queries);
  fc.fake_cuda_complete_stream(a);
  fc.fake_cuda_hold_stream(a, 0);
  void *r = sgm_alloc(ctx, 8 * MiB, b); /* and once a's work is done, it gets them */
  assert_ptr_equal(r, p);
  sgm_free(ctx, r, b);
  sgm_free(ctx, q, a);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
  destroy_ctx(ctx);
}

static void *idle_tick_main(void *arg) {
  sgm__context_idle_tick(arg);
  return NULL;
}

/* Invariant (defect 1b): the idle thread's tick (fences cached blocks and
 * queries them, in the thread's default GLOBAL mode) while the application
 * captures in GLOBAL mode on another thread leaves the capture valid. */
static void test_idle_tick_during_another_threads_capture(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("8MiB", false);
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *p = sgm_alloc(ctx, 4 * MiB, a);
  assert_non_null(p);
  sgm_free(ctx, p, a);
  uint64_t queries = fc.fake_cuda_calls("cuEventQuery");
  assert_int_equal(drv.begin((CUstream)b, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  for (int tick = 0; tick < 2; tick++) { /* seal and fence, then query */
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, idle_tick_main, ctx), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
  }
  end_capture_valid(b);
  assert_true(fc.fake_cuda_calls("cuEventQuery") > queries);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
  destroy_ctx(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_alloc_growing_during_capture),
      cmocka_unit_test(test_free_during_capture_deferred),
      cmocka_unit_test(test_buffer_release_during_capture),
      cmocka_unit_test(test_legacy_cache_during_other_capture),
      cmocka_unit_test(test_fenced_transfer_to_capturing_stream),
      cmocka_unit_test(test_seal_on_transfer_during_capture),
      cmocka_unit_test(test_reclaim_query_on_the_capturing_thread),
      cmocka_unit_test(test_idle_tick_during_another_threads_capture),
  };
  return sgm_fake_run_suite("capture", "fake_cuda_hold_events", tests, sizeof tests / sizeof tests[0],
                            load_fake, unload_fake);
}
