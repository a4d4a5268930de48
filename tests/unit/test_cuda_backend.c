/*
 * test_cuda_backend.c — the CUDA backend (lib/backend/cuda) against the driver
 * test double (tests/support/fake_cuda, a file named libcuda.so.1 that
 * tests/cuda.cmake puts first on LD_LIBRARY_PATH).
 *
 * Invariants checked:
 *  - open/close retain and release the primary context and the copy stream;
 *    nothing is left in the driver.
 *  - bytes survive H2D, D2D and D2H copies through device and pinned host
 *    memory, on the backend's stream and on a caller's stream.
 *  - every driver call failing in turn (Nth-call loop, two CUresults) gives a
 *    negative status with the CUDA error name in the message (or, for calls
 *    whose failure can only be logged, success), and leaves nothing in the
 *    driver but at most the one object whose release failed.
 *  - events follow their stream: pending while the stream's work is held,
 *    complete after; a wait returns once completed.
 *  - SGM_BACKEND=auto picks cuda when a device answers, emu when none does;
 *    no device, a bad ordinal, a failing cuInit, a driver too old and a
 *    missing libcuda.so.1 are SGM_ERR_BACKEND with a message that says what to
 *    do (SGM_BACKEND=emu).
 *  - the GPU's NUMA node from a PCI bus id (hwloc, on a synthetic topology).
 *  - the backend's count of driver calls equals the double's own count.
 *
 * Modes (argv[1]): none = the suite; --missing-driver and --old-driver run
 * the one case that needs a process where the driver failed to load.
 * Built without the CUDA headers, the suite skips (exit 77).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_internal.h"
#include "internal.h"
#include "test_util.h"

#if defined(SGM_HAVE_CUDA_HEADERS) && SGM_HAVE_CUDA_HEADERS
#include <cuda.h>

#include "fake_cuda.h"

/* The double's control API, looked up with dlsym. */
static struct {
#define FAKE_MEMBER(ret, name, params) ret(*name) params;
  FAKE_CUDA_CONTROL(FAKE_MEMBER)
#undef FAKE_MEMBER
} fc;

static void *fake_lib;

/* Load the double the way sgm will find it and look up its control API. */
static int load_fake(void **state) {
  (void)state;
  fake_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!fake_lib) {
    fprintf(stderr, "cannot load the driver test double libcuda.so.1: %s (is its folder on "
            "LD_LIBRARY_PATH?)\n", dlerror());
    return -1;
  }
#define FAKE_LOOKUP(ret, name, params)                                                        \
  *(void **)&fc.name = dlsym(fake_lib, #name);                                                 \
  if (!fc.name) {                                                                              \
    fprintf(stderr, "libcuda.so.1 on LD_LIBRARY_PATH is not the test double (no %s)\n", #name); \
    return -1;                                                                                 \
  }
  FAKE_CUDA_CONTROL(FAKE_LOOKUP)
#undef FAKE_LOOKUP
  return 0;
}

static int unload_fake(void **state) {
  (void)state;
  if (fake_lib) dlclose(fake_lib);
  return 0;
}

static void clean_fake_env(void) {
  unsetenv("FAKE_CUDA_DEVICE_COUNT");
  unsetenv("FAKE_CUDA_TOTAL_MEM");
  unsetenv("FAKE_CUDA_INIT_RESULT");
  unsetenv("FAKE_CUDA_CAN_MAP_HOST");
}

/* Every test starts from a clean environment and an idle double. */
static int setup(void **state) {
  (void)state;
  sgm_test_clean_env();
  clean_fake_env();
  fc.fake_cuda_reset();
  return 0;
}

/* ... and must leave nothing behind in the driver. */
static void assert_driver_idle(void) {
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  assert_int_equal(st.device_allocs, 0);
  assert_int_equal(st.host_registrations, 0);
  assert_int_equal(st.streams, 0);
  assert_int_equal(st.events, 0);
  assert_int_equal(st.ctx_retains, 0);
  assert_int_equal(fc.fake_cuda_live_allocations(), 0);
}

static int teardown(void **state) {
  (void)state;
  assert_driver_idle();
  return 0;
}

static void config_for(sgm_config *cfg, sgm_backend_kind kind) {
  sgm_config_init(cfg);
  assert_string_equal(cfg->error, "");
  cfg->backend = kind;
  cfg->verbose = 0;
}

static const sgm_backend_ops *open_cuda(sgm_backend **be) {
  sgm_config cfg;
  config_for(&cfg, SGM_BACKEND_CUDA);
  const sgm_backend_ops *ops = NULL;
  int rc = sgm__backend_open(&cfg, &ops, be);
  if (rc != SGM_OK) fail_msg("opening the CUDA backend failed: %s", sgm_last_error());
  assert_non_null(ops);
  assert_string_equal(ops->name, "cuda");
  return ops;
}

static void assert_error_mentions(const char *needle) {
  if (!strstr(sgm_last_error(), needle))
    fail_msg("error message \"%s\" does not mention \"%s\"", sgm_last_error(), needle);
}

static void fill_pattern(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(seed + i * 131u + (i >> 8));
}

/* ---- open, close, memory info ---- */

static void test_open_close(void **state) {
  (void)state;
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  assert_int_equal(st.ctx_retains, 1); /* the primary context */
  assert_int_equal(st.streams, 1);     /* the copy stream */
  sgm_backend_counters c;
  ops->counters(be, &c);
  assert_int_equal(c.n_device_live + c.n_host_live + c.n_events_live, 0);
  /* Every op takes the event members: the lead's tiers call them blindly. */
  assert_non_null(ops->event_record);
  assert_non_null(ops->event_query);
  assert_non_null(ops->event_wait);
  assert_non_null(ops->event_destroy);
  ops->close(be);
}

static void test_mem_info(void **state) {
  (void)state;
  setenv("FAKE_CUDA_TOTAL_MEM", "256MiB", 1);
  /* The context's own reservation is not free (the double charges 32 MiB,
   * total/8, on a device this small). */
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  uint64_t f = 0, t = 0;
  assert_int_equal(ops->mem_info(be, &f, &t), SGM_OK);
  assert_int_equal(t, 256 * SGM_MiB);
  assert_int_equal(f, 224 * SGM_MiB);
  sgm_devptr d = 0;
  assert_int_equal(ops->device_alloc(be, SGM_MiB, &d), SGM_OK);
  assert_int_equal(ops->mem_info(be, &f, &t), SGM_OK);
  assert_int_equal(f, 223 * SGM_MiB);
  /* More than the device has: NOMEM, with the driver's error name. */
  sgm_devptr big = 1;
  assert_int_equal(ops->device_alloc(be, 512 * SGM_MiB, &big), SGM_ERR_NOMEM);
  assert_int_equal(big, 0);
  assert_error_mentions("CUDA_ERROR_OUT_OF_MEMORY");
  assert_error_mentions("cuMemAlloc");
  ops->device_free(be, d, SGM_MiB);
  ops->close(be);
}

/* ---- copies ---- */

static void test_device_round_trip(void **state) {
  (void)state;
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  const size_t n = SGM_MiB + 13;
  unsigned char *src = malloc(n), *dst = malloc(n);
  assert_non_null(src);
  assert_non_null(dst);
  fill_pattern(src, n, 7);
  memset(dst, 0, n);
  sgm_devptr a = 0, b = 0;
  assert_int_equal(ops->device_alloc(be, n, &a), SGM_OK);
  assert_int_equal(ops->device_alloc(be, n, &b), SGM_OK);
  assert_int_equal(a % SGM_DEVICE_ALIGN, 0);
  sgm_backend_counters c;
  ops->counters(be, &c);
  assert_int_equal(c.n_device_live, 2);
  assert_int_equal(c.device_live_bytes, 2 * n);
  void *stream = fc.fake_cuda_stream_create();
  assert_int_equal(ops->copy(be, SGM_COPY_HOST_TO_DEVICE, a, (uintptr_t)src, n, NULL), SGM_OK);
  assert_int_equal(ops->copy(be, SGM_COPY_DEVICE_TO_DEVICE, b, a, n, stream), SGM_OK);
  assert_int_equal(ops->copy(be, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)dst, b, n, stream), SGM_OK);
  assert_memory_equal(src, dst, n);
  /* A copy past the end of an allocation is the driver's INVALID_VALUE. */
  assert_int_equal(ops->copy(be, SGM_COPY_HOST_TO_DEVICE, a + 16, (uintptr_t)src, n, NULL),
                   SGM_ERR_INVALID);
  assert_error_mentions("CUDA_ERROR_INVALID_VALUE");
  /* A stream that does not exist: the caller's fault. */
  assert_int_equal(ops->copy(be, SGM_COPY_HOST_TO_DEVICE, a, (uintptr_t)src, 64, (void *)0x5678),
                   SGM_ERR_INVALID);
  assert_error_mentions("CUDA_ERROR_INVALID_HANDLE");
  ops->device_free(be, a, n);
  ops->device_free(be, b, n);
  ops->counters(be, &c);
  assert_int_equal(c.n_device_live, 0);
  assert_int_equal(c.device_live_bytes, 0);
  fc.fake_cuda_stream_destroy(stream);
  ops->close(be);
  free(src);
  free(dst);
}

static void test_host_alloc_round_trip(void **state) {
  (void)state;
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  const size_t n = 3 * 4096 + 1;
  void *h = NULL;
  sgm_devptr hd = 0, d = 0;
  assert_int_equal(ops->host_alloc(be, n, -1, &h, &hd), SGM_OK);
  assert_non_null(h);
  assert_int_not_equal(hd, 0);
  sgm_backend_counters c;
  ops->counters(be, &c);
  assert_int_equal(c.n_host_live, 1);
  assert_true(c.host_live_bytes >= n);
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  assert_int_equal(st.host_registrations, 1);

  unsigned char *buf = malloc(n), *back = malloc(n);
  assert_non_null(buf);
  assert_non_null(back);
  fill_pattern(h, n, 3); /* the CPU writes the pinned memory directly */
  assert_int_equal(ops->device_alloc(be, n, &d), SGM_OK);
  /* The device reads it through its device address ... */
  assert_int_equal(ops->copy(be, SGM_COPY_DEVICE_TO_DEVICE, d, hd, n, NULL), SGM_OK);
  assert_int_equal(ops->copy(be, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)back, d, n, NULL), SGM_OK);
  assert_memory_equal(h, back, n);
  /* ... and writes it: the CPU sees the bytes. */
  fill_pattern(buf, n, 99);
  assert_int_equal(ops->copy(be, SGM_COPY_HOST_TO_DEVICE, hd, (uintptr_t)buf, n, NULL), SGM_OK);
  assert_memory_equal(h, buf, n);

  ops->device_free(be, d, n);
  ops->host_free(be, h, n);
  ops->counters(be, &c);
  assert_int_equal(c.n_host_live, 0);
  assert_int_equal(c.host_live_bytes, 0);
  ops->close(be);
  free(buf);
  free(back);
}

static void test_host_alloc_unsupported(void **state) {
  (void)state;
  setenv("FAKE_CUDA_CAN_MAP_HOST", "0", 1);
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  void *h = (void *)1;
  sgm_devptr hd = 1;
  assert_int_equal(ops->host_alloc(be, 4096, -1, &h, &hd), SGM_ERR_UNSUPPORTED);
  assert_null(h);
  assert_int_equal(hd, 0);
  ops->close(be);
}

/* close() returns what the caller leaked, to the driver too. */
static void test_close_frees_leaks(void **state) {
  (void)state;
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  sgm_devptr d = 0;
  void *h = NULL, *ev = NULL;
  sgm_devptr hd = 0;
  assert_int_equal(ops->device_alloc(be, 4096, &d), SGM_OK);
  assert_int_equal(ops->host_alloc(be, 4096, -1, &h, &hd), SGM_OK);
  assert_int_equal(ops->event_record(be, NULL, &ev), SGM_OK);
  ops->close(be); /* the teardown checks the driver is idle */
}

/* ---- every driver call failing in turn ---- */

/* Entry points whose failure sgm can only log (the operation still succeeds
 * from the caller's point of view). */
static bool fault_is_log_only(const char *call) {
  static const char *const calls[] = {"cuCtxPopCurrent", "cuMemFree", "cuMemHostUnregister",
                                      "cuEventDestroy", "cuStreamDestroy",
                                      "cuDevicePrimaryCtxRelease", "cuMemRelease", "cuMemUnmap",
                                      /* restoring the capture mode after a memory call */
                                      "cuThreadExchangeStreamCaptureMode"};
  for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++)
    if (strcmp(call, calls[i]) == 0) return true;
  return false;
}

typedef struct scenario {
  bool fault_in_release; /* the fault fired inside a free/destroy/close */
} scenario;

static bool fault_fired(void) {
  fake_cuda_stats st;
  fc.fake_cuda_get_stats(&st);
  return st.fault_hit != 0;
}

/* Run a release call and note whether the fault fired inside it. */
#define RELEASE(sc, call)                       \
  do {                                          \
    bool before_ = fault_fired();               \
    call;                                       \
    if (!before_ && fault_fired()) (sc)->fault_in_release = true; \
  } while (0)

/* One use of every backend operation; stops at the first failure, releasing
 * what it holds. Returns that failure's status, or SGM_OK. */
static int run_scenario(scenario *sc) {
  enum { N = 64 * 1024, H = 8192 };
  static unsigned char src[N], dst[N];
  fill_pattern(src, N, 11);
  memset(dst, 0, N);
  sc->fault_in_release = false;
  sgm_config cfg;
  config_for(&cfg, SGM_BACKEND_CUDA);
  const sgm_backend_ops *ops = NULL;
  sgm_backend *be = NULL;
  int rc = sgm__backend_open(&cfg, &ops, &be);
  if (rc != SGM_OK) {
    assert_null(be);
    assert_null(ops);
    return rc;
  }
  void *stream = fc.fake_cuda_stream_create();
  sgm_devptr a = 0, hd = 0, vbase = 0;
  void *h = NULL, *ev = NULL, *range = NULL;
  uint64_t f, t, g = 0;
  /* Two neighbouring runs (one group) and one apart. */
  sgm_vmm_run runs[3] = {{0, 0}, {0, 0}, {0, 0}};
  size_t mapped = 0;
  if ((rc = ops->mem_info(be, &f, &t)) != SGM_OK) goto out;
  if ((rc = ops->device_alloc(be, N, &a)) != SGM_OK) goto out;
  if ((rc = ops->copy(be, SGM_COPY_HOST_TO_DEVICE, a, (uintptr_t)src, N, NULL)) != SGM_OK) goto out;
  if ((rc = ops->copy(be, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)dst, a, N, stream)) != SGM_OK) goto out;
  assert_memory_equal(src, dst, N);
  if ((rc = ops->host_alloc(be, H, -1, &h, &hd)) != SGM_OK) goto out;
  if ((rc = ops->copy(be, SGM_COPY_DEVICE_TO_DEVICE, hd, a, H, stream)) != SGM_OK) goto out;
  assert_memory_equal(h, src, H);
  if ((rc = ops->event_record(be, stream, &ev)) != SGM_OK) goto out;
  /* The record completes later (the double runs streams on a worker, as a
   * GPU does): wait for it, then it reads as complete. */
  if ((rc = ops->event_wait(be, ev)) != SGM_OK) goto out;
  rc = ops->event_query(be, ev);
  if (rc < 0) goto out;
  assert_int_equal(rc, 1);
  if ((rc = ops->vmm_granularity(be, &g)) != SGM_OK) goto out;
  if ((rc = ops->vmm_reserve(be, 4 * g, &range, &vbase)) != SGM_OK) goto out;
  runs[0] = (sgm_vmm_run){0, g};
  runs[1] = (sgm_vmm_run){g, g};
  runs[2] = (sgm_vmm_run){3 * g, g};
  if ((rc = ops->vmm_map_runs(be, range, runs, 3, &mapped)) != SGM_OK) goto out;
  rc = SGM_OK;
out:
  if (range) {
    if (mapped) RELEASE(sc, ops->vmm_unmap_runs(be, range, runs, mapped));
    RELEASE(sc, ops->vmm_free(be, range));
  }
  RELEASE(sc, ops->event_destroy(be, ev));
  RELEASE(sc, ops->host_free(be, h, H));
  RELEASE(sc, ops->device_free(be, a, N));
  sgm_backend_counters c;
  ops->counters(be, &c);
  /* The backend forgets what it freed, even when the driver failed to. */
  assert_int_equal(c.n_device_live + c.n_host_live + c.n_events_live, 0);
  assert_int_equal(c.device_live_bytes + c.host_live_bytes, 0);
  RELEASE(sc, ops->close(be));
  fc.fake_cuda_stream_destroy(stream);
  return rc;
}

static uint64_t stats_live_sum(const fake_cuda_stats *s) {
  return s->device_allocs + s->host_registrations + s->streams + s->events + s->ctx_retains +
         s->vmm_reservations + s->vmm_allocations + s->vmm_mappings;
}

/* Driver objects a failed call may leave behind without sgm being able to
 * undo it: the one a failed release holds; for a failed cuMemUnmap the
 * mapping, its memory and the range it lies in (the driver frees no range
 * that still holds a mapping); the memory of a handle whose cuMemRelease
 * failed (its mapping is unmapped later, the memory stays). Each is logged. */
static uint64_t fault_may_leave(const scenario *sc, const char *call) {
  if (strcmp(call, "cuMemUnmap") == 0) return 3;
  if (strcmp(call, "cuMemRelease") == 0) return 1;
  return sc->fault_in_release ? 1 : 0;
}

static void fault_loop(CUresult result, const char *result_name) {
  fake_cuda_stats base;
  fc.fake_cuda_get_stats(&base);
  uint64_t n_failed = 0;
  for (uint64_t n = 1;; n++) {
    if (n > 500) fail_msg("the fault loop does not end: more than 500 driver calls per run");
    fc.fake_cuda_set_fail_at(n, (int)result);
    scenario sc;
    int rc = run_scenario(&sc);
    fake_cuda_stats st;
    fc.fake_cuda_get_stats(&st);
    const char *call = fc.fake_cuda_fault_call();
    if (!st.fault_hit) {
      assert_int_equal(rc, SGM_OK);
      printf("# %s: %llu driver calls per run, %llu failures reported\n", result_name,
             (unsigned long long)(n - 1), (unsigned long long)n_failed);
      break;
    }
    if (rc == SGM_OK) {
      /* Only failures sgm cannot report may go unreported: inside a release
       * (free, destroy, close), or of the pop that ends a call. */
      if (!sc.fault_in_release && !fault_is_log_only(call))
        fail_msg("call %llu (%s) failed with %s but the scenario succeeded",
                 (unsigned long long)n, call, result_name);
    } else {
      n_failed++;
      assert_true(rc < 0);
      if (!strstr(sgm_last_error(), result_name))
        fail_msg("call %llu (%s) failed: message \"%s\" lacks %s", (unsigned long long)n, call,
                 sgm_last_error(), result_name);
      if (!strstr(sgm_last_error(), call))
        fail_msg("call %llu (%s) failed: message \"%s\" does not name the call",
                 (unsigned long long)n, call, sgm_last_error());
      if (result == CUDA_ERROR_OUT_OF_MEMORY && strcmp(call, "cuMemAlloc") == 0)
        assert_int_equal(rc, SGM_ERR_NOMEM);
      if (result != CUDA_ERROR_OUT_OF_MEMORY) assert_int_equal(rc, SGM_ERR_BACKEND);
      if (strcmp(call, "cuInit") == 0 || strcmp(call, "cuDeviceGetCount") == 0) {
        assert_int_equal(rc, SGM_ERR_BACKEND);
        assert_error_mentions("SGM_BACKEND=emu");
      }
    }
    /* Nothing left in the driver, but the one object whose release failed. */
    uint64_t before = stats_live_sum(&base), after = stats_live_sum(&st);
    if (after != before) {
      if (after > before + fault_may_leave(&sc, call))
        fail_msg("call %llu (%s) failing with %s left %llu driver objects behind "
                 "(%llu device, %llu host, %llu streams, %llu events, %llu context retains)",
                 (unsigned long long)n, call, result_name,
                 (unsigned long long)(after - before), (unsigned long long)st.device_allocs,
                 (unsigned long long)st.host_registrations, (unsigned long long)st.streams,
                 (unsigned long long)st.events, (unsigned long long)st.ctx_retains);
    }
    base = st;
  }
  assert_true(n_failed > 10);
  fc.fake_cuda_reset();
}

static void test_every_call_fails_oom(void **state) {
  (void)state;
  fault_loop(CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY");
}

static void test_every_call_fails_illegal_address(void **state) {
  (void)state;
  fault_loop(CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS");
}

/* The fault loops accept a leaked object where a release failed; this one
 * exists so the teardown's idle check does not see it. */
static int teardown_after_faults(void **state) {
  (void)state;
  return 0;
}

/* ---- events and streams ---- */

typedef struct waiter {
  const sgm_backend_ops *ops;
  sgm_backend *be;
  void *event;
  int rc; /* event_wait's result */
} waiter;

static void *wait_thread(void *arg) {
  waiter *w = arg;
  w->rc = w->ops->event_wait(w->be, w->event);
  return NULL;
}

static void test_events_two_streams(void **state) {
  (void)state;
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  void *s1 = fc.fake_cuda_stream_create(), *s2 = fc.fake_cuda_stream_create();
  fc.fake_cuda_hold_stream(s1, 1); /* work on s1 is "still running" */
  void *e1 = NULL, *e2 = NULL;
  assert_int_equal(ops->event_record(be, s1, &e1), SGM_OK);
  assert_int_equal(ops->event_record(be, s2, &e2), SGM_OK);
  assert_int_equal(ops->event_query(be, e1), 0);
  fc.fake_cuda_settle(); /* s2's record is not held: it completes once the device runs it */
  assert_int_equal(ops->event_query(be, e1), 0);
  assert_int_equal(ops->event_query(be, e2), 1);
  sgm_backend_counters c;
  ops->counters(be, &c);
  assert_int_equal(c.n_events_live, 2);
  fc.fake_cuda_complete_stream(s1);
  assert_int_equal(ops->event_query(be, e1), 1);
  assert_int_equal(ops->event_wait(be, e1), SGM_OK);

  /* Held globally, on the legacy default stream (NULL): a waiter returns once
   * the work completes. */
  fc.fake_cuda_hold_events(1);
  void *e3 = NULL;
  assert_int_equal(ops->event_record(be, NULL, &e3), SGM_OK);
  assert_int_equal(ops->event_query(be, e3), 0);
  waiter w = {ops, be, e3, -100};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, wait_thread, &w), 0);
  fc.fake_cuda_complete_events();
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_int_equal(w.rc, SGM_OK);
  assert_int_equal(ops->event_query(be, e3), 1);
  fc.fake_cuda_hold_events(0);

  /* A stream that does not exist is the caller's mistake. */
  void *bad = (void *)1;
  assert_int_equal(ops->event_record(be, (void *)0x7777, &bad), SGM_ERR_INVALID);
  assert_null(bad);
  assert_error_mentions("CUDA_ERROR_INVALID_HANDLE");
  assert_error_mentions("cuEventRecord");

  ops->event_destroy(be, e1);
  ops->event_destroy(be, e2);
  ops->event_destroy(be, e3);
  ops->event_destroy(be, NULL);
  ops->counters(be, &c);
  assert_int_equal(c.n_events_live, 0);
  fc.fake_cuda_stream_destroy(s1);
  fc.fake_cuda_stream_destroy(s2);
  ops->close(be);
}

/* A pending event may be destroyed: the token goes, nothing leaks. */
static void test_destroy_pending_event(void **state) {
  (void)state;
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  fc.fake_cuda_hold_events(1);
  void *e = NULL;
  assert_int_equal(ops->event_record(be, NULL, &e), SGM_OK);
  assert_int_equal(ops->event_query(be, e), 0);
  ops->event_destroy(be, e);
  fc.fake_cuda_hold_events(0);
  ops->close(be);
}

/* The emulated device's events: complete at once, tokens counted. */
static void test_emu_events(void **state) {
  (void)state;
  sgm_config cfg;
  config_for(&cfg, SGM_BACKEND_EMU);
  const sgm_backend_ops *ops = NULL;
  sgm_backend *be = NULL;
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_OK);
  assert_string_equal(ops->name, "emu");
  void *e = NULL, *leak = NULL;
  assert_int_equal(ops->event_record(be, (void *)0x1234, &e), SGM_OK);
  assert_int_equal(ops->event_record(be, NULL, &leak), SGM_OK);
  assert_int_equal(ops->event_query(be, e), 1);
  assert_int_equal(ops->event_wait(be, e), SGM_OK);
  sgm_backend_counters c;
  ops->counters(be, &c);
  assert_int_equal(c.n_events_live, 2);
  ops->event_destroy(be, e);
  ops->counters(be, &c);
  assert_int_equal(c.n_events_live, 1);
  ops->close(be); /* frees the leaked token: the sanitizer builds check */
}

/* ---- choosing the backend, and the failures of open ---- */

static void test_auto_selection(void **state) {
  (void)state;
  sgm_config cfg;
  const sgm_backend_ops *ops = NULL;
  sgm_backend *be = NULL;

  setenv("FAKE_CUDA_DEVICE_COUNT", "0", 1);
  config_for(&cfg, SGM_BACKEND_AUTO);
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_OK);
  assert_string_equal(ops->name, "emu");
  assert_string_equal(sgm_last_error(), ""); /* the fallback left no stale error */
  ops->close(be);

  setenv("FAKE_CUDA_DEVICE_COUNT", "1", 1);
  config_for(&cfg, SGM_BACKEND_AUTO);
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_OK);
  assert_string_equal(ops->name, "cuda");
  ops->close(be);

  /* cuInit failing (no usable GPU) also falls back. */
  setenv("FAKE_CUDA_INIT_RESULT", "CUDA_ERROR_NO_DEVICE", 1);
  config_for(&cfg, SGM_BACKEND_AUTO);
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_OK);
  assert_string_equal(ops->name, "emu");
  ops->close(be);
}

static void test_open_failures(void **state) {
  (void)state;
  sgm_config cfg;
  const sgm_backend_ops *ops = (void *)1;
  sgm_backend *be = (void *)1;

  setenv("FAKE_CUDA_DEVICE_COUNT", "0", 1);
  config_for(&cfg, SGM_BACKEND_CUDA);
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_ERR_BACKEND);
  assert_null(ops);
  assert_null(be);
  assert_error_mentions("no CUDA device");
  assert_error_mentions("SGM_BACKEND=emu");

  setenv("FAKE_CUDA_DEVICE_COUNT", "2", 1);
  config_for(&cfg, SGM_BACKEND_CUDA);
  cfg.device = 1; /* exists */
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_OK);
  ops->close(be);
  cfg.device = 2;
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_ERR_BACKEND);
  assert_error_mentions("out of range");
  assert_error_mentions("SGM_BACKEND=emu");

  setenv("FAKE_CUDA_INIT_RESULT", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 1);
  config_for(&cfg, SGM_BACKEND_CUDA);
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_ERR_BACKEND);
  assert_error_mentions("cuInit");
  assert_error_mentions("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH");
  assert_error_mentions("SGM_BACKEND=emu");
}

/* Two threads working at once on one backend (the TSan build checks it). */
typedef struct worker {
  const sgm_backend_ops *ops;
  sgm_backend *be;
  int fails; /* operations that did not do what they should */
} worker;

static void *worker_thread(void *arg) {
  worker *w = arg;
  unsigned char in[4096], out[4096];
  for (int i = 0; i < 200; i++) {
    fill_pattern(in, sizeof in, (unsigned)i);
    sgm_devptr d = 0;
    void *ev = NULL;
    if (w->ops->device_alloc(w->be, sizeof in, &d) != SGM_OK) {
      w->fails++;
      continue;
    }
    if (w->ops->copy(w->be, SGM_COPY_HOST_TO_DEVICE, d, (uintptr_t)in, sizeof in, NULL) != SGM_OK ||
        w->ops->copy(w->be, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)out, d, sizeof out, NULL) != SGM_OK ||
        memcmp(in, out, sizeof in) != 0)
      w->fails++;
    if (w->ops->event_record(w->be, NULL, &ev) != SGM_OK || w->ops->event_wait(w->be, ev) != SGM_OK ||
        w->ops->event_query(w->be, ev) != 1)
      w->fails++;
    w->ops->event_destroy(w->be, ev);
    w->ops->device_free(w->be, d, sizeof in);
  }
  return NULL;
}

static void test_threads(void **state) {
  (void)state;
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  worker w[3] = {{ops, be, 0}, {ops, be, 0}, {ops, be, 0}};
  pthread_t th[3];
  for (int i = 0; i < 3; i++) assert_int_equal(pthread_create(&th[i], NULL, worker_thread, &w[i]), 0);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(pthread_join(th[i], NULL), 0);
    assert_int_equal(w[i].fails, 0);
  }
  sgm_backend_counters c;
  ops->counters(be, &c);
  assert_int_equal(c.n_device_live + c.n_events_live, 0);
  ops->close(be);
}

/* ---- the backend's count of driver calls (sgm_stats.driver_calls) ---- */

/* Invariant: the backend counts every driver call it makes, failed ones
 * included, and nothing else: its n_driver_calls equals the double's own count
 * of counted calls (every entry point but the error-string ones) over a
 * workload that touches every kind of call: open, memory info, device, pinned
 * host, managed and virtual memory, copies on its own stream and a caller's,
 * events recorded, queried, waited on and pooled, cross-stream transfers, two
 * threads at once, and one injected failure whose message asks for the
 * error's name and string (not counted on either side). */
static void test_driver_calls_counted(void **state) {
  (void)state;
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  sgm_backend_counters c;
  ops->counters(be, &c);
  assert_true(c.n_driver_calls > 0); /* open's calls */
  assert_int_equal(c.n_driver_calls, fc.fake_cuda_calls(NULL));

  uint64_t free_b = 0, total_b = 0;
  assert_int_equal(ops->mem_info(be, &free_b, &total_b), SGM_OK);
  unsigned char in[8192], out[8192];
  fill_pattern(in, sizeof in, 11);
  void *ts = fc.fake_cuda_stream_create();
  sgm_devptr d = 0, m = 0, hd = 0;
  void *h = NULL;
  assert_int_equal(ops->device_alloc(be, sizeof in, &d), SGM_OK);
  assert_int_equal(ops->host_alloc(be, sizeof in, -1, &h, &hd), SGM_OK);
  memcpy(h, in, sizeof in);
  assert_int_equal(ops->copy(be, SGM_COPY_DEVICE_TO_DEVICE, d, hd, sizeof in, ts), SGM_OK);
  assert_int_equal(ops->copy(be, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)out, d, sizeof out, NULL), SGM_OK);
  assert_memory_equal(in, out, sizeof in);
  const bool managed = ops->managed_support(be) == SGM_OK; /* not with a CUDA 11.8 driver */
  if (managed) {
    assert_int_equal(ops->managed_alloc(be, sizeof in, &m), SGM_OK);
    assert_int_equal(ops->managed_advise(be, m, sizeof in, SGM_ADVISE_PREFER_DEVICE), SGM_OK);
    assert_int_equal(ops->managed_prefetch(be, m, sizeof in, SGM_TIER_VRAM, ts), SGM_OK);
  }

  void *ev = NULL, *pooled = NULL;
  assert_int_equal(ops->event_record(be, ts, &ev), SGM_OK);
  assert_int_equal(ops->event_wait(be, ev), SGM_OK);
  assert_int_equal(ops->event_query(be, ev), 1);
  ops->event_destroy(be, ev);
  sgm_stream_ref own, legacy, per_thread;
  ops->stream_ref(be, ts, &own);
  ops->stream_ref(be, NULL, &legacy);
  ops->stream_ref(be, CU_STREAM_PER_THREAD, &per_thread);
  /* The NULL stream is the legacy stream as sgm__stream_ref answers it inline. */
  assert_int_equal(legacy.key, 0);
  assert_null(legacy.handle);
  assert_int_equal(ops->event_create(be, &pooled), SGM_OK);
  assert_int_equal(ops->event_record_on(be, pooled, &own), SGM_OK);
  assert_int_equal(ops->stream_wait_event(be, &per_thread, pooled), SGM_OK);
  assert_int_equal(ops->stream_transfer(be, pooled, &own, &per_thread), SGM_OK);
  assert_int_equal(ops->stream_transfer(be, pooled, &legacy, &own), SGM_OK);

  uint64_t g = 0;
  void *range = NULL;
  sgm_devptr base = 0;
  assert_int_equal(ops->vmm_granularity(be, &g), SGM_OK);
  assert_true(g > 0);
  assert_int_equal(ops->vmm_reserve(be, 4 * g, &range, &base), SGM_OK);
  /* One mapping per vmm_map (issue 26): one cuMemCreate for two granules;
   * two neighbouring mappings unmap in one vmm_unmap, one cuMemUnmap each. */
  uint64_t creates = fc.fake_cuda_calls("cuMemCreate"), unmaps = fc.fake_cuda_calls("cuMemUnmap");
  assert_int_equal(ops->vmm_map(be, range, g, 2 * g), SGM_OK);
  assert_int_equal(ops->vmm_map(be, range, 0, g), SGM_OK);
  assert_int_equal(fc.fake_cuda_calls("cuMemCreate") - creates, 2);
  ops->vmm_unmap(be, range, 0, 3 * g);
  assert_int_equal(fc.fake_cuda_calls("cuMemUnmap") - unmaps, 2);
  assert_int_equal(ops->vmm_map(be, range, 2 * g, 2 * g), SGM_OK);
  ops->vmm_unmap(be, range, 2 * g, 2 * g);
  /* Several runs in one call (issue 26): a mapping each, but the context is
   * looked up and the capture mode relaxed and restored once for all of
   * them: 3 calls, where a call per run took 3 per run; neighbouring runs
   * get access in one cuMemSetAccess. The same frame for the unmap of
   * several runs. */
  const char *frame[] = {"cuCtxGetCurrent", "cuThreadExchangeStreamCaptureMode"};
  uint64_t fr[2];
  for (int i = 0; i < 2; i++) fr[i] = fc.fake_cuda_calls(frame[i]);
  creates = fc.fake_cuda_calls("cuMemCreate");
  uint64_t access = fc.fake_cuda_calls("cuMemSetAccess");
  sgm_vmm_run runs[3] = {{0, g}, {g, g}, {3 * g, g}};
  size_t done = 0;
  assert_int_equal(ops->vmm_map_runs(be, range, runs, 3, &done), SGM_OK);
  assert_int_equal(done, 3);
  assert_int_equal(fc.fake_cuda_calls("cuMemCreate") - creates, 3);
  assert_int_equal(fc.fake_cuda_calls("cuMemSetAccess") - access, 2); /* one per neighbours */
  assert_int_equal(fc.fake_cuda_calls(frame[0]) - fr[0], 1);
  assert_int_equal(fc.fake_cuda_calls(frame[1]) - fr[1], 2);
  ops->counters(be, &c);
  assert_int_equal(c.vmm_mapped_bytes, 3 * g);
  for (int i = 0; i < 2; i++) fr[i] = fc.fake_cuda_calls(frame[i]);
  unmaps = fc.fake_cuda_calls("cuMemUnmap");
  ops->vmm_unmap_runs(be, range, runs, 3);
  assert_int_equal(fc.fake_cuda_calls("cuMemUnmap") - unmaps, 3);
  assert_int_equal(fc.fake_cuda_calls(frame[0]) - fr[0], 1);
  assert_int_equal(fc.fake_cuda_calls(frame[1]) - fr[1], 2);
  ops->counters(be, &c);
  assert_int_equal(c.vmm_mapped_bytes, 0);
  assert_int_equal(ops->vmm_map(be, range, 2 * g, 2 * g), SGM_OK);
  ops->vmm_free(be, range); /* unmaps the mapping left */

  worker w[2] = {{ops, be, 0}, {ops, be, 0}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, worker_thread, &w[i]), 0);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(pthread_join(th[i], NULL), 0);
    assert_int_equal(w[i].fails, 0);
  }

  ops->counters(be, &c);
  assert_int_equal(c.n_driver_calls, fc.fake_cuda_calls(NULL));
  assert_true(c.n_driver_calls > 2 * 200 * 7); /* the workers' calls alone */
  /* A failed call counts too; the message's error-string calls do not.
   * (Arming a fault restarts the double's count: compare from there.) */
  uint64_t before = c.n_driver_calls;
  fc.fake_cuda_set_fail_at(2, CUDA_ERROR_OUT_OF_MEMORY);
  sgm_devptr d2 = 0;
  assert_int_equal(ops->device_alloc(be, sizeof in, &d2), SGM_ERR_NOMEM);
  assert_error_mentions("CUDA_ERROR_OUT_OF_MEMORY");
  assert_true(fc.fake_cuda_calls("cuGetErrorName") > 0);

  ops->event_destroy(be, pooled);
  if (managed) ops->managed_free(be, m, sizeof in);
  ops->host_free(be, h, sizeof in);
  ops->device_free(be, d, sizeof in);
  ops->counters(be, &c);
  assert_int_equal(c.n_driver_calls - before, fc.fake_cuda_calls(NULL));
  ops->close(be);
  fc.fake_cuda_stream_destroy(ts);
}

/* vmm_map_runs of the three runs with the nth driver call from now failing
 * with result: it returns want_rc, mentions call, reports want_done runs
 * mapped, and the backend has want_mapped bytes mapped. */
static void map_runs_failing(const sgm_backend_ops *ops, sgm_backend *be, void *range,
                             const sgm_vmm_run runs[3], uint64_t nth, int result, int want_rc,
                             size_t want_done, const char *call, uint64_t want_mapped) {
  size_t done = 9;
  fc.fake_cuda_set_fail_at(nth, result);
  assert_int_equal(ops->vmm_map_runs(be, range, runs, 3, &done), want_rc);
  assert_int_equal(done, want_done);
  assert_error_mentions(call);
  sgm_backend_counters c;
  ops->counters(be, &c);
  assert_int_equal(c.vmm_mapped_bytes, want_mapped);
}

/* Invariant: vmm_map_runs maps its runs in order and stops at the first
 * that fails; neighbouring runs are granted access with one cuMemSetAccess
 * and stand or fall together: the groups before the failure stay mapped,
 * each run whole, and *n_done counts their runs; the failed group is
 * unmapped again; the ones after are not tried. A run that is not
 * granule-aligned is refused before any driver call. */
static void test_vmm_runs_stop_at_a_failure(void **state) {
  (void)state;
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  sgm_backend_counters c;
  uint64_t g = 0;
  void *range = NULL;
  sgm_devptr base = 0;
  assert_int_equal(ops->vmm_granularity(be, &g), SGM_OK);
  assert_int_equal(ops->vmm_reserve(be, 4 * g, &range, &base), SGM_OK);
  /* Two groups: runs 0 and 1 are neighbours, run 2 stands alone. */
  sgm_vmm_run runs[3] = {{0, g}, {g, g}, {3 * g, g}};
  /* The second group's cuMemCreate fails: the 10th call (context, relax,
   * then cuMemCreate, cuMemMap, cuMemRelease per run of the first group and
   * its one cuMemSetAccess). */
  uint64_t access = fc.fake_cuda_calls("cuMemSetAccess");
  map_runs_failing(ops, be, range, runs, 10, CUDA_ERROR_OUT_OF_MEMORY, SGM_ERR_NOMEM, 2,
                   "cuMemCreate", 2 * g);
  assert_int_equal(fc.fake_cuda_calls("cuMemSetAccess") - access, 1);
  ops->vmm_unmap_runs(be, range, runs, 2);
  /* The first group's cuMemSetAccess fails (the 9th call): both of its runs
   * are unmapped again, nothing is mapped. */
  uint64_t unmaps = fc.fake_cuda_calls("cuMemUnmap");
  map_runs_failing(ops, be, range, runs, 9, CUDA_ERROR_INVALID_VALUE, SGM_ERR_BACKEND, 0,
                   "cuMemSetAccess", 0);
  assert_int_equal(fc.fake_cuda_calls("cuMemUnmap") - unmaps, 2);
  /* A run that is not granule-aligned: refused before any driver call. */
  sgm_vmm_run bad[2] = {{0, g}, {g + 1, g}};
  size_t done = 9;
  uint64_t all = fc.fake_cuda_calls(NULL);
  assert_int_equal(ops->vmm_map_runs(be, range, bad, 2, &done), SGM_ERR_INVALID);
  assert_int_equal(done, 0);
  assert_int_equal(fc.fake_cuda_calls(NULL), all);
  ops->vmm_free(be, range);
  ops->counters(be, &c);
  assert_int_equal(c.vmm_mapped_bytes, 0);
  ops->close(be);
}

/* ---- separate processes: a driver that did not load ---- */

static void test_missing_driver(void **state) {
  (void)state;
  void *real = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (real) {
    dlclose(real);
    skip(); /* a driver is installed system-wide: it cannot be missing here */
  }
  sgm_test_clean_env();
  sgm_config cfg;
  config_for(&cfg, SGM_BACKEND_CUDA);
  const sgm_backend_ops *ops = NULL;
  sgm_backend *be = NULL;
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_ERR_BACKEND);
  assert_null(be);
  assert_error_mentions("libcuda.so.1");
  assert_error_mentions("NVIDIA driver");
  assert_error_mentions("SGM_BACKEND=emu");
  /* auto falls back to the emulated device. */
  config_for(&cfg, SGM_BACKEND_AUTO);
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_OK);
  assert_string_equal(ops->name, "emu");
  ops->close(be);
}

static void test_old_driver(void **state) {
  (void)state;
  sgm_test_clean_env();
  setenv("FAKE_CUDA_DRIVER_VERSION", "11020", 1); /* before cuGetProcAddress existed */
  sgm_config cfg;
  config_for(&cfg, SGM_BACKEND_CUDA);
  const sgm_backend_ops *ops = NULL;
  sgm_backend *be = NULL;
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_ERR_BACKEND);
  assert_error_mentions("too old");
  assert_error_mentions("11.2");
  assert_error_mentions("SGM_BACKEND=emu");
  /* The failure is remembered: the next open says the same. */
  unsetenv("FAKE_CUDA_DRIVER_VERSION");
  assert_int_equal(sgm__backend_open(&cfg, &ops, &be), SGM_ERR_BACKEND);
  assert_error_mentions("too old");
}

#endif /* SGM_HAVE_CUDA_HEADERS */

/* ---- the GPU's NUMA node (hwloc; needs no CUDA headers) ---- */

/* Two packages: package 0 with node 0 and a GPU on bus 17; package 1 with
 * nodes 1 and 2 (sub-NUMA clustering) and a GPU on bus 41; a third device
 * hangs off the machine itself. */
static const char topology_xml[] =
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    "<!DOCTYPE topology SYSTEM \"hwloc2.dtd\">\n"
    "<topology version=\"2.0\">\n"
    " <object type=\"Machine\" os_index=\"0\" cpuset=\"0x0000000f\" complete_cpuset=\"0x0000000f\""
    " allowed_cpuset=\"0x0000000f\" nodeset=\"0x00000007\" complete_nodeset=\"0x00000007\""
    " allowed_nodeset=\"0x00000007\" gp_index=\"1\">\n"
    "  <object type=\"Package\" os_index=\"0\" cpuset=\"0x00000003\" complete_cpuset=\"0x00000003\""
    " nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"2\">\n"
    "   <object type=\"NUMANode\" os_index=\"0\" cpuset=\"0x00000003\" complete_cpuset=\"0x00000003\""
    " nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"3\" local_memory=\"1073741824\"/>\n"
    "   <object type=\"PU\" os_index=\"0\" cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\""
    " nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"4\"/>\n"
    "   <object type=\"PU\" os_index=\"1\" cpuset=\"0x00000002\" complete_cpuset=\"0x00000002\""
    " nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"5\"/>\n"
    "   <object type=\"Bridge\" gp_index=\"20\" bridge_type=\"0-1\" depth=\"0\" bridge_pci=\"0000:[17-17]\">\n"
    "    <object type=\"PCIDev\" gp_index=\"21\" pci_busid=\"0000:17:00.0\""
    " pci_type=\"0302 [10de:2330] [10de:16c1] a1\"/>\n"
    "   </object>\n"
    "  </object>\n"
    "  <object type=\"Package\" os_index=\"1\" cpuset=\"0x0000000c\" complete_cpuset=\"0x0000000c\""
    " nodeset=\"0x00000006\" complete_nodeset=\"0x00000006\" gp_index=\"6\">\n"
    "   <object type=\"NUMANode\" os_index=\"1\" cpuset=\"0x0000000c\" complete_cpuset=\"0x0000000c\""
    " nodeset=\"0x00000002\" complete_nodeset=\"0x00000002\" gp_index=\"7\" local_memory=\"1073741824\"/>\n"
    "   <object type=\"NUMANode\" os_index=\"2\" cpuset=\"0x0000000c\" complete_cpuset=\"0x0000000c\""
    " nodeset=\"0x00000004\" complete_nodeset=\"0x00000004\" gp_index=\"8\" local_memory=\"1073741824\"/>\n"
    "   <object type=\"PU\" os_index=\"2\" cpuset=\"0x00000004\" complete_cpuset=\"0x00000004\""
    " nodeset=\"0x00000006\" complete_nodeset=\"0x00000006\" gp_index=\"9\"/>\n"
    "   <object type=\"PU\" os_index=\"3\" cpuset=\"0x00000008\" complete_cpuset=\"0x00000008\""
    " nodeset=\"0x00000006\" complete_nodeset=\"0x00000006\" gp_index=\"10\"/>\n"
    "   <object type=\"Bridge\" gp_index=\"22\" bridge_type=\"0-1\" depth=\"0\" bridge_pci=\"0000:[41-41]\">\n"
    "    <object type=\"PCIDev\" gp_index=\"23\" pci_busid=\"0000:41:00.0\""
    " pci_type=\"0302 [10de:2330] [10de:16c1] a1\"/>\n"
    "   </object>\n"
    "  </object>\n"
    "  <object type=\"Bridge\" gp_index=\"24\" bridge_type=\"0-1\" depth=\"0\" bridge_pci=\"0000:[00-00]\">\n"
    "   <object type=\"PCIDev\" gp_index=\"25\" pci_busid=\"0000:00:05.0\""
    " pci_type=\"0302 [10de:2330] [10de:16c1] a1\"/>\n"
    "  </object>\n"
    " </object>\n"
    "</topology>\n";

static void test_numa_node_from_pci(void **state) {
  (void)state;
  hwloc_topology_t topo;
  assert_int_equal(hwloc_topology_init(&topo), 0);
  assert_int_equal(hwloc_topology_set_xmlbuffer(topo, topology_xml, (int)sizeof topology_xml), 0);
  assert_int_equal(hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_ALL), 0);
  assert_int_equal(hwloc_topology_load(topo), 0);
  assert_int_equal(sgm__cuda_numa_node_in(topo, "0000:17:00.0"), 0);
  assert_int_equal(sgm__cuda_numa_node_in(topo, "0000:41:00.0"), 1); /* first node of the package */
  assert_int_equal(sgm__cuda_numa_node_in(topo, "41:00.0"), 1);      /* domain optional */
  assert_int_equal(sgm__cuda_numa_node_in(topo, "0000:00:05.0"), -1); /* no local node */
  assert_int_equal(sgm__cuda_numa_node_in(topo, "0000:99:00.0"), -1); /* no such device */
  assert_int_equal(sgm__cuda_numa_node_in(topo, ""), -1);
  assert_int_equal(sgm__cuda_numa_node_in(topo, NULL), -1);
  assert_int_equal(sgm__cuda_numa_node_in(NULL, "0000:17:00.0"), -1);
  hwloc_topology_destroy(topo);
  /* This machine: a bus id nothing sits at is unknown, not an error. */
  assert_int_equal(sgm__cuda_numa_node("ffff:ff:1f.7"), -1);
  assert_int_equal(sgm__cuda_numa_node(NULL), -1);
}

#if defined(SGM_HAVE_CUDA_HEADERS) && SGM_HAVE_CUDA_HEADERS
/* The node registry is keyed by the GPU's UUID, as nvidia-smi -L prints it:
 * the double's UUID reaches the segment's name and header with the PCI bus
 * id beside it, and sgm-smi (TEST_SGM_SMI) shows both. A registry an older
 * sgm left under the old key (gpu-<PCI bus id>, version 1) is another file:
 * left alone, never joined, and reported by sgm-smi as an older version.
 * The driver is asked for the UUID once per context create. */
static void test_node_key_is_the_device_uuid(void **state) {
  (void)state;
  char dir[64] = "/tmp/sgm-cuda-node-XXXXXX";
  assert_non_null(mkdtemp(dir));
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_NODE", "on", 1);
  setenv("SGM_NODE_DIR", dir, 1);
  setenv("FAKE_CUDA_UUID", "GPU-0123abcd-4567-89ef-0011-2233445566ff", 1);
  setenv("FAKE_CUDA_PCI_BUS_ID", "0000:65:00.0", 1);
  /* The old sgm's segment: version 1, keyed by the bus id. */
  unsigned char old[512 + 256];
  memset(old, 0, sizeof old);
  memcpy(old, "SGMNODE", 8);
  uint32_t geo[4] = {1, 512, 256, 1}; /* version, header bytes, slot bytes, slots */
  memcpy(old + 8, geo, sizeof geo);
  snprintf((char *)old + 64, 64, "gpu-0000:65:00.0");
  char old_path[256], path[256];
  snprintf(old_path, sizeof old_path, "%s/sgm-node-gpu-0000_65_00.0", dir);
  FILE *f = fopen(old_path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(old, 1, sizeof old, f), sizeof old);
  fclose(f);
  assert_int_equal(chmod(old_path, 0600), 0);

  sgm_context *ctx = NULL;
  uint64_t uuid_calls = fc.fake_cuda_calls("cuDeviceGetUuid");
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  /* Asked once: the registry key and the segment header share the answer. */
  assert_int_equal(fc.fake_cuda_calls("cuDeviceGetUuid") - uuid_calls, 1);
  sgm_node *n = sgm__share_node(ctx);
  assert_non_null(n); /* tracked */
  snprintf(path, sizeof path, "%s/sgm-node-GPU-0123abcd-4567-89ef-0011-2233445566ff@", dir);
  assert_int_equal(strncmp(sgm__node_file(n), path, strlen(path)), 0); /* our record */
  char rec[300];
  snprintf(rec, sizeof rec, "%s", sgm__node_file(n));
  path[strlen(path) - 1] = '\0'; /* the registry's name */
  sgm_node_view *v = malloc(sizeof *v);
  assert_non_null(v);
  assert_int_equal(sgm__node_view(n, v), SGM_OK);
  assert_string_equal(v->key, "GPU-0123abcd-4567-89ef-0011-2233445566ff");
  assert_string_equal(v->uuid_text, "0123abcd-4567-89ef-0011-2233445566ff");
  assert_string_equal(v->pci_bus_id, "0000:65:00.0");
  assert_int_equal(v->n_procs, 1);
  free(v);

  const char *smi = getenv("TEST_SGM_SMI");
  assert_non_null(smi);
  char cmd[512], out[8192];
  snprintf(cmd, sizeof cmd, "'%s' --json --dir '%s' 2>&1", smi, dir);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t got = fread(out, 1, sizeof out - 1, p);
  out[got] = '\0';
  int st = pclose(p);
  print_message("%s", out);
  assert_int_equal(WEXITSTATUS(st), 2); /* the old registry is unreadable to this sgm */
  assert_non_null(strstr(out, "\"key\": \"GPU-0123abcd-4567-89ef-0011-2233445566ff\", \"outside_sgm_bytes\": "));
  assert_non_null(strstr(out, "\"uuid\": \"GPU-0123abcd-4567-89ef-0011-2233445566ff\", \"pci_bus_id\": "
                              "\"0000:65:00.0\", \"version\": 3"));
  assert_non_null(strstr(out, "sgm-node-gpu-0000_65_00.0\", \"error\": \"layout 1, written by an older sgm"));
  sgm_context_destroy(ctx);

  /* The old file is as it was; ours went with its last process. */
  unsigned char again[sizeof old];
  f = fopen(old_path, "rb");
  assert_non_null(f);
  assert_int_equal(fread(again, 1, sizeof again, f), sizeof again);
  fclose(f);
  assert_memory_equal(again, old, sizeof old);
  assert_int_equal(access(rec, F_OK), -1);
  unlink(old_path);
  rmdir(dir);
  unsetenv("FAKE_CUDA_UUID");
  unsetenv("FAKE_CUDA_PCI_BUS_ID");
}
#endif

/* ==== issue 24 (first contact): capture modes, the current context ==== */

/* The driver calls the test makes itself, as an application would. */
static void *need_sym(const char *name) {
  void *f = dlsym(fake_lib, name);
  if (!f) fail_msg("the double has no %s", name);
  return f;
}

typedef struct capture_side {
  const sgm_backend_ops *ops; /* the backend */
  sgm_backend *be;
  void *stream;               /* a test stream that does not capture */
  int rc_record, rc_query, rc_wait, rc_copy; /* the backend's answers */
} capture_side;

/* What sgm does from the capturing thread (a reclaim's query), from its idle
 * thread (a fence queried every tick) and from the managed copy-stream worker
 * (a copy and its stream synchronize): record an event on a stream that does
 * not capture, query it, wait for it, copy on sgm's own copy stream. */
static void capture_side_run(capture_side *c) {
  void *ev = NULL;
  unsigned char in[4096], out[4096];
  fill_pattern(in, sizeof in, 3);
  sgm_devptr d = 0;
  c->rc_record = c->ops->event_record(c->be, c->stream, &ev);
  c->rc_query = ev ? c->ops->event_query(c->be, ev) : -1;
  c->rc_wait = ev ? c->ops->event_wait(c->be, ev) : -1;
  c->rc_copy = c->ops->device_alloc(c->be, sizeof in, &d);
  if (c->rc_copy == SGM_OK)
    c->rc_copy = c->ops->copy(c->be, SGM_COPY_HOST_TO_DEVICE, d, (uintptr_t)in, sizeof in, NULL);
  if (c->rc_copy == SGM_OK)
    c->rc_copy = c->ops->copy(c->be, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)out, d, sizeof out, NULL);
  if (c->rc_copy == SGM_OK && memcmp(in, out, sizeof in) != 0) c->rc_copy = -100;
  if (d) c->ops->device_free(c->be, d, sizeof in);
  if (ev) c->ops->event_destroy(c->be, ev);
}

static void *capture_side_main(void *arg) {
  capture_side_run(arg);
  return NULL;
}

/* Invariant (issue 24, defect 1): sgm's event queries and waits and its copy
 * stream's synchronize, made while the application captures a CUDA graph in
 * the default GLOBAL mode — from the capturing thread itself or from another
 * thread in GLOBAL mode (sgm's idle thread, the managed worker) — succeed and
 * leave the capture valid: cuStreamEndCapture gives a graph. */
static void test_queries_and_syncs_keep_a_global_capture_valid(void **state) {
  (void)state;
  CUresult (*begin)(CUstream, CUstreamCaptureMode) = need_sym("cuStreamBeginCapture_v2");
  CUresult (*end)(CUstream, CUgraph *) = need_sym("cuStreamEndCapture");
  CUresult (*graph_destroy)(CUgraph) = need_sym("cuGraphDestroy");
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  uint64_t f = 0, t = 0;
  assert_int_equal(ops->mem_info(be, &f, &t), SGM_OK); /* the primary context is current here */
  void *cap = fc.fake_cuda_stream_create(), *other = fc.fake_cuda_stream_create();
  for (int other_thread = 0; other_thread < 2; other_thread++) {
    assert_int_equal(begin((CUstream)cap, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
    capture_side c = {ops, be, other, -1, -1, -1, -1};
    if (other_thread) {
      pthread_t th;
      assert_int_equal(pthread_create(&th, NULL, capture_side_main, &c), 0);
      assert_int_equal(pthread_join(th, NULL), 0);
    } else {
      capture_side_run(&c);
    }
    CUgraph g = NULL;
    CUresult r = end((CUstream)cap, &g);
    if (g) graph_destroy(g);
    if (c.rc_record != SGM_OK || c.rc_query < 0 || c.rc_wait != SGM_OK || c.rc_copy != SGM_OK ||
        r != CUDA_SUCCESS)
      fail_msg("%s thread: record %d, query %d, wait %d, copy %d, end capture %d (%s)",
               other_thread ? "another" : "the capturing", c.rc_record, c.rc_query, c.rc_wait,
               c.rc_copy, (int)r, sgm_last_error());
  }
  fc.fake_cuda_stream_destroy(cap);
  fc.fake_cuda_stream_destroy(other);
  ops->close(be);
}

/* Invariant (issue 24, defect 3): a device allocation is charged to sgm's
 * device whatever context the application made current since sgm last ran on
 * this thread (cuCtxSetCurrent / cudaSetDevice to device 1): device 1's free
 * memory does not move, device 0's does; the application's context is
 * current again afterwards; event calls on sgm's streams still work. */
static void test_a_context_switched_behind_sgm_is_seen(void **state) {
  (void)state;
  setenv("FAKE_CUDA_DEVICE_COUNT", "2", 1);
  setenv("FAKE_CUDA_TOTAL_MEM", "2GiB", 1);
  CUresult (*retain)(CUcontext *, CUdevice) = need_sym("cuDevicePrimaryCtxRetain");
  CUresult (*release)(CUdevice) = need_sym("cuDevicePrimaryCtxRelease_v2");
  CUresult (*set_current)(CUcontext) = need_sym("cuCtxSetCurrent");
  CUresult (*get_current)(CUcontext *) = need_sym("cuCtxGetCurrent");
  CUresult (*push)(CUcontext) = need_sym("cuCtxPushCurrent_v2");
  CUresult (*pop)(CUcontext *) = need_sym("cuCtxPopCurrent_v2");
  CUresult (*get_info)(size_t *, size_t *) = need_sym("cuMemGetInfo_v2");
  sgm_backend *be = NULL;
  const sgm_backend_ops *ops = open_cuda(&be);
  uint64_t f = 0, t = 0;
  assert_int_equal(ops->mem_info(be, &f, &t), SGM_OK); /* sgm's context current, remembered */
  CUcontext ctx0 = NULL, ctx1 = NULL, cur = NULL;
  assert_int_equal(get_current(&ctx0), CUDA_SUCCESS);
  assert_non_null(ctx0);
  assert_int_equal(retain(&ctx1, 1), CUDA_SUCCESS);
  assert_int_equal(set_current(ctx1), CUDA_SUCCESS); /* the application: cudaSetDevice(1) */
  size_t f1_before = 0, f0_before = 0, tt = 0, f1_after = 0, f0_after = 0;
  assert_int_equal(get_info(&f1_before, &tt), CUDA_SUCCESS);
  assert_int_equal(push(ctx0), CUDA_SUCCESS);
  assert_int_equal(get_info(&f0_before, &tt), CUDA_SUCCESS);
  assert_int_equal(pop(&cur), CUDA_SUCCESS);
  sgm_devptr d = 0;
  assert_int_equal(ops->device_alloc(be, 256 * SGM_MiB, &d), SGM_OK);
  assert_int_equal(get_current(&cur), CUDA_SUCCESS);
  assert_ptr_equal(cur, ctx1); /* sgm popped what it pushed */
  assert_int_equal(get_info(&f1_after, &tt), CUDA_SUCCESS);
  assert_int_equal(push(ctx0), CUDA_SUCCESS);
  assert_int_equal(get_info(&f0_after, &tt), CUDA_SUCCESS);
  assert_int_equal(pop(&cur), CUDA_SUCCESS);
  if (f1_after != f1_before || f0_before - f0_after < 256 * SGM_MiB)
    fail_msg("256 MiB on device 0 moved device 1's free by %lld MiB and device 0's by %lld MiB",
             ((long long)f1_after - (long long)f1_before) / (1 << 20),
             ((long long)f0_after - (long long)f0_before) / (1 << 20));
  /* Event calls on sgm's own streams after the switch. */
  void *ev = NULL, *pooled = NULL;
  assert_int_equal(ops->event_record(be, NULL, &ev), SGM_OK);
  assert_int_equal(ops->event_wait(be, ev), SGM_OK);
  ops->event_destroy(be, ev);
  assert_int_equal(ops->event_create(be, &pooled), SGM_OK);
  sgm_stream_ref legacy;
  ops->stream_ref(be, NULL, &legacy);
  assert_int_equal(ops->event_record_on(be, pooled, &legacy), SGM_OK);
  assert_int_equal(ops->event_wait(be, pooled), SGM_OK);
  ops->event_destroy(be, pooled);
  ops->device_free(be, d, 256 * SGM_MiB);
  assert_int_equal(set_current(ctx0), CUDA_SUCCESS);
  assert_int_equal(release(1), CUDA_SUCCESS);
  ops->close(be);
  unsetenv("FAKE_CUDA_DEVICE_COUNT");
  unsetenv("FAKE_CUDA_TOTAL_MEM");
}

int main(int argc, char **argv) {
  const struct CMUnitTest numa[] = {cmocka_unit_test(test_numa_node_from_pci)};
#if defined(SGM_HAVE_CUDA_HEADERS) && SGM_HAVE_CUDA_HEADERS
  if (argc > 1 && strcmp(argv[1], "--missing-driver") == 0) {
    const struct CMUnitTest t[] = {cmocka_unit_test(test_missing_driver)};
    return cmocka_run_group_tests_name("cuda_backend_missing_driver", t, NULL, NULL);
  }
  if (argc > 1 && strcmp(argv[1], "--old-driver") == 0) {
    const struct CMUnitTest t[] = {cmocka_unit_test(test_old_driver)};
    return cmocka_run_group_tests_name("cuda_backend_old_driver", t, NULL, NULL);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_open_close, setup, teardown),
      cmocka_unit_test_setup_teardown(test_vmm_runs_stop_at_a_failure, setup, teardown),
      cmocka_unit_test_setup_teardown(test_mem_info, setup, teardown),
      cmocka_unit_test_setup_teardown(test_device_round_trip, setup, teardown),
      cmocka_unit_test_setup_teardown(test_host_alloc_round_trip, setup, teardown),
      cmocka_unit_test_setup_teardown(test_host_alloc_unsupported, setup, teardown),
      cmocka_unit_test_setup_teardown(test_close_frees_leaks, setup, teardown),
      cmocka_unit_test_setup_teardown(test_events_two_streams, setup, teardown),
      cmocka_unit_test_setup_teardown(test_destroy_pending_event, setup, teardown),
      cmocka_unit_test_setup_teardown(test_emu_events, setup, teardown),
      cmocka_unit_test_setup_teardown(test_auto_selection, setup, teardown),
      cmocka_unit_test_setup_teardown(test_open_failures, setup, teardown),
      cmocka_unit_test_setup_teardown(test_threads, setup, teardown),
      cmocka_unit_test_setup_teardown(test_node_key_is_the_device_uuid, setup, teardown),
      cmocka_unit_test_setup_teardown(test_driver_calls_counted, setup, teardown),
      cmocka_unit_test_setup_teardown(test_queries_and_syncs_keep_a_global_capture_valid, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_a_context_switched_behind_sgm_is_seen, setup, teardown),
      /* Last: a failed release may leave one object in the double for good. */
      cmocka_unit_test_setup_teardown(test_every_call_fails_oom, setup, teardown_after_faults),
      cmocka_unit_test_setup_teardown(test_every_call_fails_illegal_address, setup,
                                      teardown_after_faults),
  };
  int failed = cmocka_run_group_tests_name("cuda_backend_numa", numa, NULL, NULL);
  failed += cmocka_run_group_tests_name("cuda_backend", tests, load_fake, unload_fake);
  return failed;
#else
  (void)argv;
  if (argc > 1) return 77; /* the driver cases need the CUDA headers */
  /* No CUDA headers: only the topology part can run. */
  return cmocka_run_group_tests_name("cuda_backend_numa", numa, NULL, NULL);
#endif
}
