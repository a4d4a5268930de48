/*
 * test_migrate.c — migrations ordered on the device (issue 10 item 2), on
 * SGM_BACKEND=cuda against the asynchronous driver double: work queued on a
 * stream completes later, and a held event record keeps everything queued
 * after it on its stream pending until the test releases it.
 *
 * Each case queues "the caller's kernel" on stream A behind a held record:
 * a copy that writes pattern Y into the buffer (the double's device memory is
 * host memory), then releases the buffer on A. sgm's copy of the buffer's data
 * (read, write, evict, acquire, prefetch) must come after that kernel:
 *  - read returns Y, never the stale X;
 *  - write's bytes land after the kernel's (the buffer ends as written);
 *  - an eviction moves Y (it neither refuses nor copies X);
 *  - acquire on A of a buffer in shared memory promotes Y into VRAM, and the
 *    old shared block stays allocated until that copy is done;
 *  - a prefetch promotes Y, not X.
 * sgm's call blocks until the kernel completes, so it runs on a helper thread
 * (or is the prefetch worker); the main thread waits without sleeping until
 * sgm's copy is queued behind the kernel (the double's pending work grows and
 * stays) or sgm finished without waiting (the defect), then lets the kernel run.
 *
 * Without the double's asynchronous model (fake_cuda_settle missing) the
 * suite skips.
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

#define MiB (UINT64_C(1) << 20)
#define N (256u * 1024u) /* buffer size: small, the patterns are what counts */

static sgm_fake_control fc;
static struct {
  CUresult (*event_create)(CUevent *, unsigned);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_destroy)(CUevent);
  CUresult (*htod_async)(CUdeviceptr, const void *, size_t, CUstream);
} drv;
static void *fake_lib;

static unsigned char pat_x[N], pat_y[N], pat_z[N];

static int load_fake(void **state) {
  (void)state;
  fake_lib = sgm_fake_load(&fc);
  if (!fake_lib) return -1;
  *(void **)&drv.event_create = sgm_fake_need(fake_lib, "cuEventCreate");
  *(void **)&drv.event_record = sgm_fake_need(fake_lib, "cuEventRecord");
  *(void **)&drv.event_destroy = sgm_fake_need(fake_lib, "cuEventDestroy_v2");
  *(void **)&drv.htod_async = sgm_fake_need(fake_lib, "cuMemcpyHtoDAsync_v2");
  memset(pat_x, 0x11, N);
  memset(pat_y, 0x22, N);
  memset(pat_z, 0x33, N);
  return drv.event_create && drv.event_record && drv.event_destroy && drv.htod_async ? 0 : -1;
}

static int unload_fake(void **state) {
  (void)state;
  if (fake_lib) dlclose(fake_lib);
  return 0;
}

typedef struct fixture {
  sgm_context *ctx;
  sgm_buffer *b;
  sgm_buffer *filler; /* in_shared: fills VRAM (acquired) so b is used in shared memory */
  void *a;      /* the caller's stream */
  CUevent hold; /* the test's held record on a */
  void *dptr;   /* where the kernel writes */
} fixture;

/* A context on the double (8 MiB of VRAM, growth), this thread's primary
 * context current (the test enqueues work itself), a buffer holding X. */
static void setup_fixture(fixture *f, bool in_shared) {
  memset(f, 0, sizeof *f);
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_VRAM_LIMIT", "8MiB", 1);
  assert_int_equal(sgm_context_create(NULL, &f->ctx), SGM_OK);
  sgm_fake_ctx_push(fake_lib);
  f->a = fc.fake_cuda_stream_create();
  assert_non_null(f->a);
  assert_int_equal(sgm_buffer_create(f->ctx, N, &f->b), SGM_OK);
  assert_int_equal(sgm_buffer_write(f->b, 0, pat_x, N), SGM_OK);
  if (in_shared) {
    assert_int_equal(sgm_buffer_evict(f->b, SGM_TIER_SHARED), SGM_OK);
    void *fp = NULL;
    assert_int_equal(sgm_buffer_create(f->ctx, 8 * MiB, &f->filler), SGM_OK);
    assert_int_equal(sgm_buffer_acquire(f->filler, f->a, &fp), SGM_OK);
    assert_int_equal(sgm_buffer_tier(f->filler), SGM_TIER_VRAM);
  }
  assert_int_equal(sgm_buffer_acquire(f->b, f->a, &f->dptr), SGM_OK);
  assert_int_equal(sgm_buffer_tier(f->b), in_shared ? SGM_TIER_SHARED : SGM_TIER_VRAM);
}

/* in_shared: make room in VRAM for b's promotion. */
static void drop_filler(fixture *f) {
  sgm_buffer_destroy(f->filler);
  f->filler = NULL;
}

/* The caller's kernel: on stream a, behind a held record, write Y into the
 * buffer; then release the buffer on a. Nothing of it has run yet. */
static void queue_kernel_and_release(fixture *f) {
  fc.fake_cuda_hold_stream(f->a, 1);
  assert_int_equal(drv.event_create(&f->hold, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
  assert_int_equal(drv.event_record(f->hold, (CUstream)f->a), CUDA_SUCCESS);
  assert_int_equal(drv.htod_async((CUdeviceptr)(uintptr_t)f->dptr, pat_y, N, (CUstream)f->a),
                   CUDA_SUCCESS);
  assert_int_equal(sgm_buffer_release(f->b, f->a), SGM_OK);
}

static void teardown_fixture(fixture *f) {
  fc.fake_cuda_hold_stream(f->a, 0);
  fc.fake_cuda_complete_events();
  sgm_buffer_destroy(f->b);
  sgm_context_destroy(f->ctx);
  assert_int_equal(drv.event_destroy(f->hold), CUDA_SUCCESS);
  fc.fake_cuda_stream_destroy(f->a);
  sgm_fake_ctx_pop(fake_lib);
  fc.fake_cuda_reset();
}

/* sgm's call on a helper thread. */
typedef struct job {
  fixture *f;
  int what;          /* JOB_* */
  unsigned char out[N];
  void *dptr;        /* acquire: the pointer */
  int rc;            /* the call's status */
  int done;          /* set (atomic) when the call returned */
} job;
enum { JOB_READ, JOB_WRITE, JOB_ACQUIRE, JOB_EVICT };

static void *job_main(void *arg) {
  job *j = arg;
  switch (j->what) {
    case JOB_READ: j->rc = sgm_buffer_read(j->f->b, 0, j->out, N); break;
    case JOB_WRITE: j->rc = sgm_buffer_write(j->f->b, 0, pat_z, N); break;
    case JOB_EVICT: j->rc = sgm_buffer_evict(j->f->b, SGM_TIER_SHARED); break;
    default: j->rc = sgm_buffer_acquire(j->f->b, j->f->a, &j->dptr); break;
  }
  __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

static uint64_t pending_ops(void) {
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  return st.pending_ops;
}

/* Wait, without sleeping, until sgm's copy is either blocked behind the held
 * kernel (more work pending than base once the worker ran all it could) or
 * sgm is done (done(arg): its call returned or the buffer moved without
 * waiting). Returns whether it was done: it must not be, its copy comes after
 * the kernel. */
static bool wait_blocked_or_done(uint64_t base, bool (*done)(void *), void *arg) {
  for (;;) {
    fc.fake_cuda_settle();
    if (done(arg)) return true;
    if (pending_ops() > base) return false;
    sched_yield();
  }
}

static bool job_done(void *arg) { return __atomic_load_n(&((job *)arg)->done, __ATOMIC_ACQUIRE) != 0; }

/* Run the job until its copy is blocked (or it returned), then let the kernel
 * run and join. Returns whether the job returned before the kernel ran. */
static bool run_job(job *j) {
  uint64_t base = pending_ops();
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, job_main, j), 0);
  bool early = wait_blocked_or_done(base, job_done, j);
  fc.fake_cuda_hold_stream(j->f->a, 0);
  fc.fake_cuda_complete_stream(j->f->a);
  assert_int_equal(pthread_join(t, NULL), 0);
  fc.fake_cuda_settle();
  return early;
}

/* The start every job case shares: the fixture (buffer in VRAM), the
 * caller's kernel queued and the buffer released behind it, and a job of
 * sgm's call `what` on it (static: the job holds a buffer-sized array). */
static job *job_after_release_work(fixture *f, int what) {
  static job j;
  setup_fixture(f, false);
  queue_kernel_and_release(f);
  memset(&j, 0, sizeof j);
  j.f = f;
  j.what = what;
  return &j;
}

/* Invariant: sgm_buffer_read returns the bytes the work queued before the
 * release wrote (Y), never the stale X, and so returns only after that work. */
static void test_read_after_release_work(void **state) {
  (void)state;
  fixture f;
  job *j = job_after_release_work(&f, JOB_READ);
  bool early = run_job(j);
  assert_int_equal(j->rc, SGM_OK);
  if (memcmp(j->out, pat_y, N) != 0) fail_msg("read returned stale bytes (the kernel's came later)");
  assert_false(early);
  teardown_fixture(&f);
}

/* Invariant: sgm_buffer_write lands after the work queued before the release:
 * the buffer holds what was written (Z), not the kernel's Y over it. */
static void test_write_after_release_work(void **state) {
  (void)state;
  fixture f;
  job *j = job_after_release_work(&f, JOB_WRITE);
  assert_false(run_job(j));
  assert_int_equal(j->rc, SGM_OK);
  unsigned char back[N];
  assert_int_equal(sgm_buffer_read(f.b, 0, back, N), SGM_OK);
  if (memcmp(back, pat_z, N) != 0) fail_msg("the kernel queued before release overwrote the write");
  teardown_fixture(&f);
}

/* Invariant: evicting a buffer whose release work is pending moves the bytes
 * that work wrote (Y): the demotion's copy follows it, neither refusing
 * (SGM_ERR_BUSY) nor copying stale bytes. */
static void test_evict_after_release_work(void **state) {
  (void)state;
  fixture f;
  job *j = job_after_release_work(&f, JOB_EVICT);
  bool early = run_job(j);
  if (j->rc != SGM_OK) fail_msg("evict with the release's work pending: %s", sgm_status_string((sgm_status)j->rc));
  assert_int_equal(sgm_buffer_tier(f.b), SGM_TIER_SHARED);
  unsigned char back[N];
  assert_int_equal(sgm_buffer_read(f.b, 0, back, N), SGM_OK);
  if (memcmp(back, pat_y, N) != 0) fail_msg("the eviction moved stale bytes");
  assert_false(early);
  teardown_fixture(&f);
}

/* Invariants: acquire on A of a buffer in shared memory promotes the bytes the
 * kernel wrote there (Y) into VRAM; the old shared block is not freed while
 * that copy is pending (the shared tier still holds it when the copy has been
 * issued and the kernel has not run). */
static void test_acquire_promotes_after_release_work(void **state) {
  (void)state;
  fixture f;
  setup_fixture(&f, true);
  queue_kernel_and_release(&f);
  drop_filler(&f);
  static job j;
  memset(&j, 0, sizeof j);
  j.f = &f;
  j.what = JOB_ACQUIRE;
  uint64_t base = pending_ops();
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, job_main, &j), 0);
  bool early = wait_blocked_or_done(base, job_done, &j);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(f.ctx, &st), SGM_OK);
  uint64_t shared_used = st.tier[SGM_TIER_SHARED].used_bytes;
  fc.fake_cuda_hold_stream(f.a, 0);
  fc.fake_cuda_complete_stream(f.a);
  assert_int_equal(pthread_join(t, NULL), 0);
  fc.fake_cuda_settle();
  assert_int_equal(j.rc, SGM_OK);
  assert_int_equal(sgm_buffer_tier(f.b), SGM_TIER_VRAM);
  if (memcmp(j.dptr, pat_y, N) != 0) fail_msg("acquire promoted stale bytes");
  assert_false(early);
  assert_true(shared_used >= N); /* the source block outlived its pending copy */
  assert_int_equal(sgm_buffer_release(f.b, f.a), SGM_OK);
  teardown_fixture(&f);
}

static bool moved_to_vram(void *arg) { return sgm_buffer_tier(arg) == SGM_TIER_VRAM; }

/* Invariant: a prefetch of a buffer released with work pending promotes the
 * bytes that work wrote (its copy waits for that work). */
static void test_prefetch_after_release_work(void **state) {
  (void)state;
  fixture f;
  setup_fixture(&f, true);
  queue_kernel_and_release(&f);
  drop_filler(&f);
  uint64_t base = pending_ops();
  assert_int_equal(sgm_buffer_prefetch(f.b, f.a), SGM_OK);
  assert_false(wait_blocked_or_done(base, moved_to_vram, f.b));
  fc.fake_cuda_hold_stream(f.a, 0);
  fc.fake_cuda_complete_stream(f.a);
  void *p = NULL;
  assert_int_equal(sgm_buffer_acquire(f.b, f.a, &p), SGM_OK); /* waits for the prefetch */
  fc.fake_cuda_settle();
  assert_int_equal(sgm_buffer_tier(f.b), SGM_TIER_VRAM);
  if (memcmp(p, pat_y, N) != 0) fail_msg("the prefetch promoted stale bytes");
  assert_int_equal(sgm_buffer_release(f.b, f.a), SGM_OK);
  teardown_fixture(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_read_after_release_work),
      cmocka_unit_test(test_write_after_release_work),
      cmocka_unit_test(test_evict_after_release_work),
      cmocka_unit_test(test_acquire_promotes_after_release_work),
      cmocka_unit_test(test_prefetch_after_release_work),
  };
  /* fake_cuda_settle: the double's asynchronous model. */
  return sgm_fake_run_suite("migrate", "fake_cuda_settle", tests, sizeof tests / sizeof tests[0],
                            load_fake, unload_fake);
}
