/*
 * test_first_contact.c — issue 24's defects ("first contact": what a real GPU
 * would still break on day one), each as a case on SGM_BACKEND=cuda against
 * the driver test double, which runs a "kernel" (fake_cuda_kernel: a read or
 * write of a device range queued on a stream for a while) and counts an
 * unmap under queued work (vmm_unmaps_in_use) where a GPU would fault.
 *
 *  - defect 2: sgm_buffer_destroy with the release's work still pending, in
 *    VRAM and in shared memory: the block is reused by no other stream and
 *    unmapped by no trim until that work is done;
 *  - defect 4: a managed block's move (demotion) is ordered after work the
 *    caller queued on the legacy NULL stream;
 *  - defect 5: reserve mode commits no more than the VRAM budget;
 *  - defect 1 (the fence wait): a trim whose wait for a fence fails keeps
 *    that stream's blocks (nothing unmapped under its work).
 *
 * Defect 1's queries and defect 3 are cases of test_capture.c and
 * test_cuda_backend.c. Held
 * work is released by the test (fake_cuda_pause), never waited for by sleeping.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#include "fake_fixture.h"
#include "internal.h"
#include "test_util.h"
#include "tiers/tier.h"

#define MiB (UINT64_C(1) << 20)

static sgm_fake_control fc;
static void *fake_lib;
/* The driver calls the test makes itself, as an application would. */
static struct {
  CUresult (*event_create)(CUevent *, unsigned);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_query)(CUevent);
  CUresult (*event_destroy)(CUevent);
  CUresult (*begin)(CUstream, CUstreamCaptureMode);
  CUresult (*end)(CUstream, CUgraph *);
  CUresult (*graph_destroy)(CUgraph);
} drv;

static int load_fake(void **state) {
  (void)state;
  fake_lib = sgm_fake_load(&fc);
  if (!fake_lib) return -1;
  *(void **)&drv.event_create = sgm_fake_need(fake_lib, "cuEventCreate");
  *(void **)&drv.event_record = sgm_fake_need(fake_lib, "cuEventRecord");
  *(void **)&drv.event_query = sgm_fake_need(fake_lib, "cuEventQuery");
  *(void **)&drv.event_destroy = sgm_fake_need(fake_lib, "cuEventDestroy_v2");
  *(void **)&drv.begin = sgm_fake_need(fake_lib, "cuStreamBeginCapture_v2");
  *(void **)&drv.end = sgm_fake_need(fake_lib, "cuStreamEndCapture");
  *(void **)&drv.graph_destroy = sgm_fake_need(fake_lib, "cuGraphDestroy");
  return drv.event_create && drv.event_record && drv.event_query && drv.event_destroy &&
                 drv.begin && drv.end && drv.graph_destroy
             ? 0
             : -1;
}

/* Record an event on stream and query it once (the work queued there so far
 * done: true). */
static bool record_done(void *stream) {
  CUevent ev = NULL;
  assert_int_equal(drv.event_create(&ev, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
  assert_int_equal(drv.event_record(ev, (CUstream)stream), CUDA_SUCCESS);
  CUresult q = drv.event_query(ev);
  assert_true(q == CUDA_SUCCESS || q == CUDA_ERROR_NOT_READY);
  assert_int_equal(drv.event_destroy(ev), CUDA_SUCCESS);
  return q == CUDA_SUCCESS;
}

static int unload_fake(void **state) {
  (void)state;
  if (fake_lib) dlclose(fake_lib);
  return 0;
}

/* A CUDA context on device 0 with a VRAM budget, growth on, no idle thread
 * (nothing trims behind the test's back), shared fallback as asked. */
static sgm_context *make_ctx(const char *vram_limit, bool fallback) {
  return sgm_fake_sgm_context(vram_limit, fallback, "0");
}

static void destroy_ctx(sgm_context *ctx) {
  sgm_context_destroy(ctx);
  assert_int_equal(fc.fake_cuda_live_allocations(), 0);
}

static uint64_t unmaps_in_use(void) {
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  return st.vmm_unmaps_in_use;
}

static void *trim_main(void *arg) {
  sgm_trim(arg);
  return NULL;
}

/* Invariants (defect 2): a buffer released on stream s while a kernel queued
 * there still writes it, then destroyed: (1) work another stream o queues on
 * an allocation made then that got the same block (it may, through a
 * device-side wait) is ordered after that kernel; (2) sgm_trim unmaps
 * nothing the kernel uses (vmm_unmaps_in_use stays 0: it waits for it). In
 * VRAM (shared = false) and in shared memory (the block is pinned host
 * memory the kernel reaches over the bus). */
static void destroy_with_pending_release(bool shared) {
  sgm_context *ctx = make_ctx("4MiB", shared);
  sgm_fake_ctx_push(fake_lib);
  void *s = sgm_fake_non_blocking_stream(fake_lib), *o = sgm_fake_non_blocking_stream(fake_lib);
  sgm_buffer *filler = NULL, *b = NULL;
  void *fd = NULL, *d = NULL;
  if (shared) { /* VRAM full of an acquired buffer: b lives in shared memory */
    assert_int_equal(sgm_buffer_create(ctx, 4 * MiB, &filler), SGM_OK);
    assert_int_equal(sgm_buffer_acquire(filler, s, &fd), SGM_OK);
  }
  assert_int_equal(sgm_buffer_create(ctx, 4 * MiB, &b), SGM_OK);
  assert_int_equal(sgm_buffer_acquire(b, s, &d), SGM_OK);
  assert_int_equal(sgm_buffer_tier(b), shared ? SGM_TIER_SHARED : SGM_TIER_VRAM);
  uint64_t unmaps = unmaps_in_use();
  fc.fake_cuda_hold_stream(s, 1);
  assert_false(record_done(s)); /* held: the kernel behind it stays pending */
  assert_int_equal(fc.fake_cuda_kernel(s, d, 4 * MiB, 0x5a, 0), 0);
  assert_int_equal(sgm_buffer_release(b, s), SGM_OK);
  sgm_buffer_destroy(b);
  void *p = sgm_alloc(ctx, 4 * MiB, o);
  fc.fake_cuda_settle();
  bool overlaps = p && (char *)p < (char *)d + 4 * MiB && (char *)d < (char *)p + 4 * MiB;
  if (overlaps && record_done(o))
    fail_msg("%s: stream o's work on the destroyed buffer's block ran before the kernel queued "
             "before its release", shared ? "shared" : "VRAM");
  if (p) sgm_free(ctx, p, o);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, trim_main, ctx), 0);
  fc.fake_cuda_hold_stream(s, 0); /* records the trim makes from now on are not held */
  fc.fake_cuda_complete_stream(s);
  assert_int_equal(pthread_join(t, NULL), 0);
  fc.fake_cuda_settle();
  assert_int_equal(unmaps_in_use() - unmaps, 0);
  if (filler) {
    assert_int_equal(sgm_buffer_release(filler, s), SGM_OK);
    sgm_buffer_destroy(filler);
  }
  fc.fake_cuda_settle();
  sgm_fake_stream_destroy(fake_lib, s);
  sgm_fake_stream_destroy(fake_lib, o);
  destroy_ctx(ctx);
  sgm_fake_ctx_pop(fake_lib);
}

static void test_destroy_honours_the_pending_release_in_vram(void **state) {
  (void)state;
  destroy_with_pending_release(false);
}

static void test_destroy_honours_the_pending_release_in_shared(void **state) {
  (void)state;
  destroy_with_pending_release(true);
}

/* Invariant: a block sgm took for a buffer and cached, stream-ordered, when
 * the buffer was destroyed with its release's work pending, is the user's
 * once an allocation on that stream gets it again: sgm_free frees it, and
 * no buffer claims it. Sizes of a magazine class (256 KiB) and a large
 * block (3 MiB: the thread's stash, then a carve's cached take). The
 * cached block kept the mark of sgm's own (TIER_OWN) when handed to the
 * user, and the user's free was refused as a free of a block the caller
 * does not own. */
static void test_a_destroyed_buffers_block_is_the_users_once_reused(void **state) {
  (void)state;
  const uint64_t sizes[] = {256 << 10, 3 * MiB};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    sgm_context *ctx = make_ctx("64MiB", false);
    sgm_fake_ctx_push(fake_lib);
    void *s = sgm_fake_non_blocking_stream(fake_lib);
    sgm_buffer *b = NULL;
    void *d = NULL;
    assert_int_equal(sgm_buffer_create(ctx, sizes[k], &b), SGM_OK);
    assert_int_equal(sgm_buffer_acquire(b, s, &d), SGM_OK);
    fc.fake_cuda_hold_stream(s, 1);
    assert_false(record_done(s)); /* held: the kernel behind it stays pending */
    assert_int_equal(fc.fake_cuda_kernel(s, d, sizes[k], 0x5a, 0), 0);
    assert_int_equal(sgm_buffer_release(b, s), SGM_OK);
    sgm_buffer_destroy(b);
    void *p = sgm_alloc(ctx, sizes[k], s);
    assert_ptr_equal(p, d); /* the stream's own cached block, at once */
    sgm_stats st;
    assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
    uint64_t bad = st.n_bad_frees;
    assert_int_equal(sgm_free_ex(ctx, p, s), SGM_OK);
    assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
    assert_int_equal(st.n_bad_frees, bad);
    assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, 0);
    fc.fake_cuda_hold_stream(s, 0);
    fc.fake_cuda_complete_stream(s);
    fc.fake_cuda_settle();
    assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
    sgm_fake_stream_destroy(fake_lib, s);
    destroy_ctx(ctx);
    sgm_fake_ctx_pop(fake_lib);
  }
}

typedef struct demote_job {
  sgm_context *ctx;
  void *p;     /* the managed block */
  int rc;      /* sgm_prefetch's answer */
  int done;    /* set (atomic) once it returned */
} demote_job;

static void *demote_main(void *arg) {
  demote_job *j = arg;
  j->rc = sgm_prefetch(j->ctx, j->p, 0, SGM_TIER_SHARED, NULL);
  __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* Invariant (defect 4): a managed block allocated on the legacy NULL stream
 * (PyTorch's default stream) is demoted only after the work the caller
 * queued there: while a kernel on the NULL stream is pending (behind a held
 * record), the demotion's prefetch, once queued, moves no page (it waits
 * behind the kernel), and sgm_prefetch does not return before it ran. */
static void test_managed_move_of_a_null_stream_block_follows_its_work(void **state) {
  (void)state;
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_VRAM_LIMIT", "32MiB", 1);
  setenv("SGM_SHARED_LIMIT", "64MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);
  setenv("SGM_POINTERS", "managed", 1);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) fail_msg("create: %s", sgm_last_error());
  sgm_fake_ctx_push(fake_lib);
  void *p = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(p);
  assert_int_equal(sgm_pointer_tier(ctx, p), SGM_TIER_VRAM);
  fc.fake_cuda_hold_events(1);
  assert_false(record_done(NULL)); /* held: the kernel behind it stays pending */
  fc.fake_cuda_hold_events(0);
  assert_int_equal(fc.fake_cuda_kernel(NULL, p, 4 * MiB, 0x3c, 0), 0);
  uint64_t prefetches = fc.fake_cuda_calls("cuMemPrefetchAsync");
  uint64_t syncs = fc.fake_cuda_calls("cuStreamSynchronize");
  demote_job j = {ctx, p, -1, 0};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, demote_main, &j), 0);
  /* Until the move's prefetch is queued (the synchronize after it began),
   * or sgm_prefetch returned: then everything that may run has run. */
  while (!__atomic_load_n(&j.done, __ATOMIC_ACQUIRE) &&
         !(fc.fake_cuda_calls("cuMemPrefetchAsync") > prefetches &&
           fc.fake_cuda_calls("cuStreamSynchronize") > syncs))
    sched_yield();
  fc.fake_cuda_settle();
  int at = fc.fake_cuda_managed_page(p, NULL, NULL);
  bool early = __atomic_load_n(&j.done, __ATOMIC_ACQUIRE) != 0;
  fc.fake_cuda_complete_events();
  assert_int_equal(pthread_join(t, NULL), 0);
  if (at == 2 || early)
    fail_msg("the block's pages were demoted while the kernel queued on the NULL stream still "
             "used them (pages at %d, sgm_prefetch %s)", at, early ? "returned" : "waiting");
  assert_int_equal(j.rc, SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, p), SGM_TIER_SHARED);
  assert_int_equal(((volatile unsigned char *)p)[4096], 0x3c);
  sgm_free(ctx, p, NULL);
  sgm_context_destroy(ctx);
  sgm_fake_ctx_pop(fake_lib);
  assert_int_equal(fc.fake_cuda_live_allocations(), 0);
}

/* Invariant (defect 5): in reserve mode (growth off) on the virtual-memory
 * API, a VRAM budget that is not a whole number of granules commits no more
 * than the budget (tier.h's committed <= budget): the budget is rounded
 * down to granules, not the commitment up; the double's device memory taken
 * says the same; a block of all the granules still fits. */
static void test_reserve_mode_commits_within_the_budget(void **state) {
  (void)state;
  const uint64_t budget = 255013632; /* what SGM_VRAM_FRACTION gave on a 256 MiB device */
  char lim[32];
  snprintf(lim, sizeof lim, "%llu", (unsigned long long)budget);
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_VRAM_LIMIT", lim, 1);
  setenv("SGM_ALLOW_GROWTH", "off", 1);
  setenv("SGM_SHARED_FALLBACK", "off", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) fail_msg("create: %s", sgm_last_error());
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  fake_cuda_stats fs;
  fc.fake_cuda_get_stats(&fs);
  if (st.tier[SGM_TIER_VRAM].committed_bytes > budget || fs.vmm_bytes > budget)
    fail_msg("reserve mode committed %llu bytes (driver: %llu) against a budget of %llu",
             (unsigned long long)st.tier[SGM_TIER_VRAM].committed_bytes,
             (unsigned long long)fs.vmm_bytes, (unsigned long long)budget);
  assert_true(st.tier[SGM_TIER_VRAM].committed_bytes > budget - 2 * MiB); /* whole granules */
  void *p = sgm_alloc(ctx, (size_t)st.tier[SGM_TIER_VRAM].committed_bytes, NULL);
  assert_non_null(p);
  sgm_free(ctx, p, NULL);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  destroy_ctx(ctx);
}

/* Invariant (defect 1, the fence wait): a trim whose wait for a stream's
 * fence fails (here: the stream captures a graph, so the wait is refused)
 * keeps that stream's cached blocks: nothing is unmapped under the kernel
 * still queued before the fence (vmm_unmaps_in_use stays 0), and the
 * capture stays valid. */
static void test_a_failed_fence_wait_keeps_the_blocks(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("8MiB", false);
  sgm_fake_ctx_push(fake_lib);
  void *s = sgm_fake_non_blocking_stream(fake_lib);
  void *p = sgm_alloc(ctx, 4 * MiB, s);
  assert_non_null(p);
  uint64_t unmaps = unmaps_in_use();
  fc.fake_cuda_hold_stream(s, 1);
  assert_false(record_done(s)); /* held: the kernel behind it stays pending */
  assert_int_equal(fc.fake_cuda_kernel(s, p, 4 * MiB, 0x77, 0), 0);
  sgm_free(ctx, p, s);
  sgm__context_idle_tick(ctx); /* p sealed under a fence on s, behind the kernel */
  assert_int_equal(drv.begin((CUstream)s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  CUgraph g = NULL;
  CUresult r = drv.end((CUstream)s, &g);
  if (g) drv.graph_destroy(g);
  fc.fake_cuda_hold_stream(s, 0);
  fc.fake_cuda_complete_stream(s);
  if (unmaps_in_use() != unmaps)
    fail_msg("sgm_trim unmapped a block whose stream's work was pending (its fence wait failed)");
  assert_int_equal(r, CUDA_SUCCESS);
  assert_int_equal(sgm_trim(ctx), SGM_OK); /* now the work is done: it goes */
  assert_int_equal(unmaps_in_use(), unmaps);
  sgm_fake_stream_destroy(fake_lib, s);
  destroy_ctx(ctx);
  sgm_fake_ctx_pop(fake_lib);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_destroy_honours_the_pending_release_in_vram),
      cmocka_unit_test(test_destroy_honours_the_pending_release_in_shared),
      cmocka_unit_test(test_managed_move_of_a_null_stream_block_follows_its_work),
      cmocka_unit_test(test_reserve_mode_commits_within_the_budget),
      cmocka_unit_test(test_a_failed_fence_wait_keeps_the_blocks),
      cmocka_unit_test(test_a_destroyed_buffers_block_is_the_users_once_reused),
  };
  return sgm_fake_run_suite("first_contact", "fake_cuda_kernel", tests,
                            sizeof tests / sizeof tests[0], load_fake, unload_fake);
}
