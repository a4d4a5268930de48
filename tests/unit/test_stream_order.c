/*
 * test_stream_order.c — the stream-ordered free rule on SGM_BACKEND=cuda
 * against the driver test double (tests/support/fake_cuda), whose events stay
 * pending until the test completes them: a block freed on stream A is
 * reusable at once by work on A, and by work on B only after the event
 * recorded at the free has completed.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"
#include "internal.h"
#include "test_util.h"

#define MiB (UINT64_C(1) << 20)

#define FAKE_MEMBER(ret, name, params) ret(*name) params;
static struct {
  FAKE_CUDA_CONTROL(FAKE_MEMBER)
} fc;
static void *fake_lib;

static int load_fake(void **state) {
  (void)state;
  fake_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!fake_lib) return -1;
#define FAKE_LOOKUP(ret, name, params) *(void **)&fc.name = dlsym(fake_lib, #name);
  FAKE_CUDA_CONTROL(FAKE_LOOKUP)
  /* A real driver has no control API: this suite is for the double only. */
  if (!fc.fake_cuda_hold_events) return -1;
  fc.fake_cuda_reset();
  return 0;
}

static int unload_fake(void **state) {
  (void)state;
  if (fake_lib) dlclose(fake_lib);
  return 0;
}

/* A 4 MiB VRAM budget reserved as one range, no fallback: one block fills it. */
static sgm_context *make_ctx(void) {
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_VRAM_LIMIT", "4MiB", 1);
  setenv("SGM_ALLOW_GROWTH", "off", 1);
  setenv("SGM_SHARED_FALLBACK", "off", 1);
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fprintf(stderr, "create: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  return ctx;
}

/* Invariants: while the free's event is pending, stream B cannot get the block
 * (and fails rather than sharing it), stream A gets it back at once; once the
 * event completes, B gets it. A pending block is not live: freeing it again is
 * a double free, and sgm_pointer_tier says NONE. */
static void test_two_streams(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  fc.fake_cuda_hold_events(1);
  void *p = sgm_alloc(ctx, 4 * MiB, a);
  assert_non_null(p);
  assert_int_equal(sgm_free_ex(ctx, p, a), SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, p), SGM_TIER_NONE);
  assert_int_equal(sgm_free_ex(ctx, p, a), SGM_ERR_INVALID); /* double free while pending */

  assert_null(sgm_alloc(ctx, 4 * MiB, b)); /* B must wait for A's work */
  void *again = sgm_alloc(ctx, 4 * MiB, a); /* A may reuse at once */
  assert_ptr_equal(again, p);
  assert_int_equal(sgm_free_ex(ctx, again, a), SGM_OK);
  assert_null(sgm_alloc(ctx, 4 * MiB, b));

  fc.fake_cuda_complete_events();
  void *q = sgm_alloc(ctx, 4 * MiB, b);
  assert_ptr_equal(q, p);
  fc.fake_cuda_hold_events(0);
  assert_int_equal(sgm_free_ex(ctx, q, b), SGM_OK);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.n_bad_frees, 1);
  sgm_context_destroy(ctx);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
  assert_int_equal(fc.fake_cuda_live_allocations(), 0);
}

/* Invariant: trim and destroy never return a block whose free is still
 * pending on the device; destroy waits for the work, then frees everything
 * and leaves no event or allocation behind in the driver. */
static void test_trim_and_destroy_with_pending(void **state) {
  (void)state;
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_VRAM_LIMIT", "64MiB", 1);
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  void *s = fc.fake_cuda_stream_create();
  fc.fake_cuda_hold_events(1);
  void *p = sgm_alloc(ctx, 1 * MiB, s);
  assert_non_null(p);
  assert_int_equal(sgm_free_ex(ctx, p, s), SGM_OK);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_true(st.tier[SGM_TIER_VRAM].committed_bytes > 0); /* its chunk stays */
  fc.fake_cuda_complete_events();
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.tier[SGM_TIER_VRAM].committed_bytes, 0);
  /* Pending at destroy: complete it from here so destroy's wait returns. */
  fc.fake_cuda_hold_events(0);
  void *q = sgm_alloc(ctx, 1 * MiB, s);
  assert_int_equal(sgm_free_ex(ctx, q, s), SGM_OK);
  sgm_context_destroy(ctx);
  fc.fake_cuda_stream_destroy(s);
  fake_cuda_stats fs;
  fc.fake_cuda_get_stats(&fs);
  assert_int_equal(fs.events, 0);
  assert_int_equal(fs.pending_events, 0);
  assert_int_equal(fc.fake_cuda_live_allocations(), 0);
}

int main(void) {
  void *probe = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!probe || !dlsym(probe, "fake_cuda_hold_events")) {
    printf("# stream_order: the driver test double is not on LD_LIBRARY_PATH: skipped\n");
    if (probe) dlclose(probe);
    return 77;
  }
  dlclose(probe);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_streams),
      cmocka_unit_test(test_trim_and_destroy_with_pending),
  };
  return cmocka_run_group_tests_name("stream_order", tests, load_fake, unload_fake);
}
