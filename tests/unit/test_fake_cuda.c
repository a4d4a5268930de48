/*
 * test_fake_cuda.c — the conformance suite of the CUDA driver test double
 * (tests/support/fake_cuda): one test per rule of the CUDA 13.0 driver the
 * double enforces, each named for its rule. The suite links the double and
 * calls it through the cu* API directly; tests hold or pause work with the
 * double's control API and release it, they never sleep for it.
 *
 * Built without the CUDA toolkit's headers, the suite skips (exit 77).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"

#if defined(SGM_HAVE_CUDA_HEADERS) && SGM_HAVE_CUDA_HEADERS
#include <cuda.h>

#include "fake_cuda.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define PAGE ((size_t)4096)

static CUcontext ctx0;
static fake_cuda_stats base; /* live counts when the test began */

#define CU_OK(call) assert_int_equal((call), CUDA_SUCCESS)

static void clean_env(void) {
  const char *vars[] = {"FAKE_CUDA_DEVICE_COUNT", "FAKE_CUDA_TOTAL_MEM", "FAKE_CUDA_DELAY_US",
                        "FAKE_CUDA_LAZY", "FAKE_CUDA_OTHER_USED", "FAKE_CUDA_CTX_OVERHEAD",
                        "FAKE_CUDA_HOST_REGISTER_SUPPORTED", "FAKE_CUDA_HOST_REGISTER_RESULT",
                        "FAKE_CUDA_PINNED_LIMIT", "FAKE_CUDA_DRIVER_VERSION", "SGM_EMU_VRAM",
                        "FAKE_CUDA_CONCURRENT_MANAGED", "FAKE_CUDA_VMM_SUPPORTED",
                        "FAKE_CUDA_VMM_GRANULE"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

/* Every test: a clean double, device 0's primary context current. */
static int setup(void **state) {
  (void)state;
  clean_env();
  fake_cuda_reset();
  if (cuInit(0) != CUDA_SUCCESS) return -1;
  fake_cuda_get_stats(&base);
  if (cuDevicePrimaryCtxRetain(&ctx0, 0) != CUDA_SUCCESS) return -1;
  return cuCtxPushCurrent(ctx0) == CUDA_SUCCESS ? 0 : -1;
}

/* ... and leaves nothing behind in it (measured from what the test began
 * with, so one failing test does not fail all that follow). */
static int teardown(void **state) {
  (void)state;
  fake_cuda_reset();
  CUcontext popped = NULL;
  cuCtxPopCurrent(&popped);
  cuDevicePrimaryCtxRelease(0);
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
#define LEFT(f) (unsigned long long)(st.f - base.f)
  if (st.device_allocs != base.device_allocs || st.host_registrations != base.host_registrations ||
      st.managed_allocs != base.managed_allocs ||
      st.streams != base.streams || st.events != base.events ||
      st.ctx_retains != base.ctx_retains || st.pending_ops != base.pending_ops ||
      st.graphs != base.graphs || st.captures_active != base.captures_active ||
      st.vmm_allocations != base.vmm_allocations || st.vmm_reservations != base.vmm_reservations ||
      st.vmm_mappings != base.vmm_mappings) {
    fprintf(stderr, "left behind: %llu allocs, %llu registrations, %llu streams, %llu events, "
            "%llu retains, %llu ops, %llu graphs, %llu captures\n",
            LEFT(device_allocs), LEFT(host_registrations), LEFT(streams), LEFT(events),
            LEFT(ctx_retains), LEFT(pending_ops), LEFT(graphs), LEFT(captures_active));
    return -1;
  }
#undef LEFT
  return 0;
}

static CUdeviceptr dev_alloc(size_t n) {
  CUdeviceptr d = 0;
  CU_OK(cuMemAlloc(&d, n));
  return d;
}

/* Page-aligned host memory registered with the driver (pinned). */
static unsigned char *pinned_alloc(size_t n) {
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(p != MAP_FAILED);
  CU_OK(cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE));
  return p;
}

static void pinned_free(unsigned char *p, size_t n) {
  CU_OK(cuMemHostUnregister(p));
  munmap(p, n);
}

static CUstream stream_new(unsigned flags) {
  CUstream s = NULL;
  CU_OK(cuStreamCreate(&s, flags));
  return s;
}

static CUevent event_new(void) {
  CUevent e = NULL;
  CU_OK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  return e;
}

/* ---- asynchrony and stream order ---- */

static void test_record_behind_pending_copy_is_not_complete(void **state) {
  (void)state;
  CUdeviceptr a = dev_alloc(64 * KiB), b = dev_alloc(64 * KiB);
  CUstream s = stream_new(0);
  CUevent e = event_new();
  fake_cuda_pause(1); /* the device runs nothing */
  CU_OK(cuMemsetD8Async(a, 0x5a, 64 * KiB, s));
  CU_OK(cuMemcpyDtoDAsync(b, a, 64 * KiB, s));
  CU_OK(cuEventRecord(e, s));
  assert_int_equal(cuEventQuery(e), CUDA_ERROR_NOT_READY);
  assert_int_equal(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
  assert_int_equal(((unsigned char *)(uintptr_t)b)[100], 0); /* not copied yet */
  fake_cuda_pause(0);
  CU_OK(cuEventSynchronize(e));
  CU_OK(cuEventQuery(e));
  assert_int_equal(((unsigned char *)(uintptr_t)b)[100], 0x5a);
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(a));
  CU_OK(cuMemFree(b));
}

static void test_copies_complete_later_in_stream_order(void **state) {
  (void)state;
  const size_t n = 256 * KiB;
  unsigned char *in = pinned_alloc(n), *out = pinned_alloc(n);
  for (size_t i = 0; i < n; i++) in[i] = (unsigned char)(i * 7 + 1);
  CUdeviceptr a = dev_alloc(n), b = dev_alloc(n);
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING);
  fake_cuda_pause(1);
  CU_OK(cuMemcpyHtoDAsync(a, in, n, s));
  CU_OK(cuMemcpyDtoDAsync(b, a, n, s));
  CU_OK(cuMemcpyDtoHAsync(out, b, n, s));
  assert_int_equal(out[1], 0); /* registered memory: the calls returned at once */
  fake_cuda_pause(0);
  CU_OK(cuStreamSynchronize(s));
  /* In any other order out would hold zeros. */
  assert_memory_equal(in, out, n);
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(a));
  CU_OK(cuMemFree(b));
  pinned_free(in, n);
  pinned_free(out, n);
}

static void test_pageable_source_is_staged_at_enqueue(void **state) {
  (void)state;
  unsigned char *src = malloc(4096);
  assert_non_null(src);
  memset(src, 0x11, 4096);
  CUdeviceptr d = dev_alloc(4096);
  CUstream s = stream_new(0);
  fake_cuda_pause(1);
  CU_OK(cuMemcpyHtoDAsync(d, src, 4096, s));
  memset(src, 0x22, 4096); /* the caller may reuse pageable memory at once */
  fake_cuda_pause(0);
  CU_OK(cuStreamSynchronize(s));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[4000], 0x11);
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(d));
  free(src);
}

static void test_pageable_destination_is_written_before_return(void **state) {
  (void)state;
  unsigned char *dst = calloc(1, 8192);
  assert_non_null(dst);
  CUdeviceptr d = dev_alloc(8192);
  CUstream s = stream_new(0);
  fake_cuda_set_delay_us(2000); /* slow device: the call must still wait */
  CU_OK(cuMemsetD8Async(d, 0x33, 8192, s));
  CU_OK(cuMemcpyDtoHAsync(dst, d, 8192, s));
  assert_int_equal(dst[8191], 0x33);
  fake_cuda_set_delay_us(0);
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(d));
  free(dst);
}

static void test_stream_wait_event_orders_later_work(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s1 = stream_new(CU_STREAM_NON_BLOCKING), s2 = stream_new(CU_STREAM_NON_BLOCKING);
  CUevent e = event_new();
  fake_cuda_hold_stream(s1, 1); /* s1's record stays pending */
  CU_OK(cuEventRecord(e, s1));
  CU_OK(cuStreamWaitEvent(s2, e, 0));
  CU_OK(cuMemsetD8Async(d, 0x44, 4096, s2));
  fake_cuda_settle();
  assert_int_equal(cuStreamQuery(s2), CUDA_ERROR_NOT_READY);
  assert_int_equal(((unsigned char *)(uintptr_t)d)[0], 0);
  fake_cuda_complete_stream(s1);
  CU_OK(cuStreamSynchronize(s2));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[0], 0x44);
  fake_cuda_hold_stream(s1, 0);
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s1));
  CU_OK(cuStreamDestroy(s2));
  CU_OK(cuMemFree(d));
}

static void test_stream_wait_event_takes_the_record_at_call_time(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s1 = stream_new(CU_STREAM_NON_BLOCKING), s2 = stream_new(CU_STREAM_NON_BLOCKING);
  CUstream s3 = stream_new(CU_STREAM_NON_BLOCKING);
  CUevent e = event_new();
  fake_cuda_hold_stream(s1, 1);
  CU_OK(cuEventRecord(e, s1));
  CU_OK(cuStreamWaitEvent(s2, e, 0));
  CU_OK(cuEventRecord(e, s3)); /* a later record does not release s2 */
  CU_OK(cuMemsetD8Async(d, 0x45, 4096, s2));
  CU_OK(cuEventSynchronize(e));
  fake_cuda_settle();
  assert_int_equal(cuStreamQuery(s2), CUDA_ERROR_NOT_READY);
  fake_cuda_complete_stream(s1);
  CU_OK(cuStreamSynchronize(s2));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[9], 0x45);
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s1));
  CU_OK(cuStreamDestroy(s2));
  CU_OK(cuStreamDestroy(s3));
  CU_OK(cuMemFree(d));
}

/* ---- default streams ---- */

static void test_legacy_stream_waits_for_blocking_streams(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s = stream_new(0); /* blocking */
  CUevent e = event_new();
  fake_cuda_hold_stream(s, 1);
  CU_OK(cuEventRecord(e, s));
  CU_OK(cuMemsetD8Async(d, 0x55, 4096, NULL));
  fake_cuda_settle();
  assert_int_equal(cuStreamQuery(NULL), CUDA_ERROR_NOT_READY);
  assert_int_equal(cuStreamQuery(CU_STREAM_LEGACY), CUDA_ERROR_NOT_READY);
  fake_cuda_complete_stream(s);
  CU_OK(cuStreamSynchronize(CU_STREAM_LEGACY));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[1], 0x55);
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(d));
}

static void test_blocking_stream_waits_for_legacy_stream(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s = stream_new(0);
  CUevent e = event_new();
  fake_cuda_hold_events(1);
  CU_OK(cuEventRecord(e, NULL)); /* held on the legacy stream */
  fake_cuda_hold_events(0);
  CU_OK(cuMemsetD8Async(d, 0x56, 4096, s));
  fake_cuda_settle();
  assert_int_equal(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
  fake_cuda_complete_events();
  CU_OK(cuStreamSynchronize(s));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[2], 0x56);
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(d));
}

static void test_non_blocking_stream_does_not_sync_with_legacy(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream nb = stream_new(CU_STREAM_NON_BLOCKING);
  CUevent e = event_new();
  fake_cuda_hold_stream(nb, 1);
  CU_OK(cuEventRecord(e, nb));
  CU_OK(cuMemsetD8Async(d, 0x57, 4096, NULL)); /* does not wait for nb */
  CU_OK(cuStreamSynchronize(NULL));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[3], 0x57);
  assert_int_equal(cuEventQuery(e), CUDA_ERROR_NOT_READY);
  fake_cuda_hold_events(1);
  CU_OK(cuEventRecord(e, NULL));
  fake_cuda_hold_events(0);
  CU_OK(cuMemsetD8Async(d, 0x58, 4096, nb)); /* nor does nb wait for the legacy stream */
  fake_cuda_complete_stream(nb);
  CU_OK(cuStreamSynchronize(nb));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[3], 0x58);
  assert_int_equal(cuEventQuery(e), CUDA_ERROR_NOT_READY);
  fake_cuda_complete_events();
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(nb));
  CU_OK(cuMemFree(d));
}

typedef struct pt_arg {
  CUevent e;    /* to record on the thread's per-thread stream */
  int hold;     /* hold that record */
  CUresult sync; /* cuStreamQuery(CU_STREAM_PER_THREAD) after settling */
} pt_arg;

static void *per_thread_main(void *arg) {
  pt_arg *a = arg;
  if (cuCtxPushCurrent(ctx0) != CUDA_SUCCESS) return NULL;
  if (a->hold) fake_cuda_hold_events(1);
  cuEventRecord(a->e, CU_STREAM_PER_THREAD);
  if (a->hold) fake_cuda_hold_events(0);
  fake_cuda_settle();
  a->sync = cuStreamQuery(CU_STREAM_PER_THREAD);
  CUcontext c;
  cuCtxPopCurrent(&c);
  return NULL;
}

static void test_per_thread_stream_is_distinct_per_thread(void **state) {
  (void)state;
  pt_arg held = {event_new(), 1, CUDA_ERROR_UNKNOWN}, free_ = {event_new(), 0, CUDA_ERROR_UNKNOWN};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, per_thread_main, &held), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(held.sync, CUDA_ERROR_NOT_READY);
  /* Another thread's per-thread stream is not held behind the first one's. */
  assert_int_equal(pthread_create(&t, NULL, per_thread_main, &free_), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(free_.sync, CUDA_SUCCESS);
  /* But it is blocking: the legacy stream waits for it. */
  CUdeviceptr d = dev_alloc(4096);
  CU_OK(cuMemsetD8Async(d, 0x59, 4096, NULL));
  fake_cuda_settle();
  assert_int_equal(cuStreamQuery(NULL), CUDA_ERROR_NOT_READY);
  fake_cuda_complete_events();
  CU_OK(cuStreamSynchronize(NULL));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[4], 0x59);
  CU_OK(cuEventDestroy(held.e));
  CU_OK(cuEventDestroy(free_.e));
  CU_OK(cuMemFree(d));
}

static void test_ptsz_entry_points_take_null_as_the_per_thread_stream(void **state) {
  (void)state;
  CUresult (*sync_ptsz)(CUstream) = NULL, (*sync_legacy)(CUstream) = NULL;
  CUdriverProcAddressQueryResult st;
  CU_OK(cuGetProcAddress("cuStreamSynchronize", (void **)&sync_ptsz, 12000,
                         CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
  assert_int_equal(st, CU_GET_PROC_ADDRESS_SUCCESS);
  CU_OK(cuGetProcAddress("cuStreamSynchronize", (void **)&sync_legacy, 12000,
                         CU_GET_PROC_ADDRESS_LEGACY_STREAM, &st));
  assert_ptr_not_equal((void *)sync_ptsz, (void *)sync_legacy);
  /* Hold the per-thread stream of this thread: NULL through _ptsz is it. */
  CUevent e = event_new();
  fake_cuda_hold_events(1);
  CU_OK(cuEventRecord(e, CU_STREAM_PER_THREAD));
  fake_cuda_hold_events(0);
  CUresult (*query_ptsz)(CUstream) = NULL;
  CU_OK(cuGetProcAddress("cuStreamQuery", (void **)&query_ptsz, 12000,
                         CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
  assert_int_equal(query_ptsz(NULL), CUDA_ERROR_NOT_READY);
  fake_cuda_complete_events();
  CU_OK(sync_ptsz(NULL));
  CU_OK(query_ptsz(NULL));
  CU_OK(cuEventDestroy(e));
}

/* ---- events and streams: lifetimes and handles ---- */

static void test_destroying_a_pending_event_does_not_complete_its_work(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s = stream_new(0);
  CUevent e = event_new();
  fake_cuda_pause(1);
  CU_OK(cuMemsetD8Async(d, 0x61, 4096, s));
  CU_OK(cuEventRecord(e, s));
  CU_OK(cuEventDestroy(e));
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  assert_int_equal(st.events, 0);
  assert_int_equal(st.pending_ops, 2); /* the work goes on */
  assert_int_equal(((unsigned char *)(uintptr_t)d)[5], 0);
  fake_cuda_pause(0);
  CU_OK(cuStreamSynchronize(s));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[5], 0x61);
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(d));
}

static void test_destroying_an_event_twice_is_an_invalid_handle_and_counted(void **state) {
  (void)state;
  CUevent e = event_new();
  CU_OK(cuEventDestroy(e));
  assert_int_equal(cuEventDestroy(e), CUDA_ERROR_INVALID_HANDLE);
  assert_int_equal(cuEventQuery(e), CUDA_ERROR_INVALID_HANDLE);
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  assert_int_equal(st.bad_event_destroys, 1);
  assert_true(st.bad_handles >= 2);
}

static void test_destroying_a_stream_with_pending_work_lets_it_finish(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s = stream_new(0);
  fake_cuda_pause(1);
  CU_OK(cuMemsetD8Async(d, 0x62, 4096, s));
  CU_OK(cuStreamDestroy(s)); /* returns at once */
  assert_int_equal(cuStreamQuery(s), CUDA_ERROR_INVALID_HANDLE);
  fake_cuda_pause(0);
  CU_OK(cuCtxSynchronize());
  assert_int_equal(((unsigned char *)(uintptr_t)d)[6], 0x62);
  CU_OK(cuMemFree(d));
}

static void test_event_and_stream_of_different_contexts_are_refused(void **state) {
  (void)state;
  setenv("FAKE_CUDA_DEVICE_COUNT", "2", 1);
  CU_OK(cuInit(0));
  CUcontext ctx1 = NULL;
  CU_OK(cuDevicePrimaryCtxRetain(&ctx1, 1));
  CUstream s0 = stream_new(0); /* of device 0 */
  CU_OK(cuCtxPushCurrent(ctx1));
  CUevent e1 = event_new(); /* of device 1 */
  assert_int_equal(cuEventRecord(e1, s0), CUDA_ERROR_INVALID_HANDLE);
  CUdeviceptr d1 = dev_alloc(4096);
  assert_int_equal(cuMemsetD8Async(d1, 1, 4096, s0), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(cuEventRecord(e1, NULL)); /* device 1's own legacy stream */
  CU_OK(cuEventSynchronize(e1));
  CU_OK(cuMemFree(d1));
  CUcontext c;
  CU_OK(cuCtxPopCurrent(&c));
  assert_int_equal(cuEventRecord(e1, s0), CUDA_ERROR_INVALID_HANDLE); /* s0's context is current */
  /* Waiting on another context's event is allowed. */
  CU_OK(cuStreamWaitEvent(s0, e1, 0));
  CU_OK(cuStreamSynchronize(s0));
  CU_OK(cuEventDestroy(e1));
  CU_OK(cuStreamDestroy(s0));
  CU_OK(cuDevicePrimaryCtxRelease(1));
}

/* ---- memory ---- */

static void test_free_waits_for_queued_work_on_the_range(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4 * MiB);
  CUstream s = stream_new(0);
  fake_cuda_set_delay_us(5000);
  CU_OK(cuMemsetD8Async(d, 0x63, 4 * MiB, s));
  CU_OK(cuMemFree(d)); /* unmapping under the memset would crash */
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  assert_int_equal(st.pending_ops, 0);
  fake_cuda_set_delay_us(0);
  CU_OK(cuStreamDestroy(s));
}

static void test_mem_get_info_counts_context_and_other_processes(void **state) {
  (void)state;
  setenv("FAKE_CUDA_TOTAL_MEM", "8GiB", 1);
  CU_OK(cuInit(0));
  size_t free_b = 0, total = 0;
  CU_OK(cuMemGetInfo(&free_b, &total));
  assert_int_equal(total, 8192 * MiB);
  assert_int_equal(free_b, (8192 - 300) * MiB); /* the context's own reservation */
  fake_cuda_set_other_used(2048 * MiB);
  CU_OK(cuMemGetInfo(&free_b, &total));
  assert_int_equal(free_b, (8192 - 300 - 2048) * MiB);
  CUdeviceptr d = 0;
  assert_int_equal(cuMemAlloc(&d, free_b + 256), CUDA_ERROR_OUT_OF_MEMORY);
  CU_OK(cuMemAlloc(&d, 64 * MiB));
  CU_OK(cuMemGetInfo(&free_b, &total));
  assert_int_equal(free_b, (8192 - 300 - 2048 - 64) * MiB);
  CU_OK(cuMemFree(d));
}

/* ---- host registration ---- */

static void test_host_registration_of_unmapped_pages_fails(void **state) {
  (void)state;
  unsigned char *p = mmap(NULL, 3 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(p != MAP_FAILED);
  assert_int_equal(munmap(p + PAGE, PAGE), 0); /* a hole in the middle */
  assert_int_equal(cuMemHostRegister(p, 3 * PAGE, 0), CUDA_ERROR_INVALID_VALUE);
  CU_OK(cuMemHostRegister(p, PAGE, 0));
  CU_OK(cuMemHostUnregister(p));
  assert_int_equal(cuMemHostUnregister(p), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  munmap(p, PAGE);
  munmap(p + 2 * PAGE, PAGE);
}

static void test_unaligned_registrations_sharing_a_page_collide(void **state) {
  (void)state;
  unsigned char *p = mmap(NULL, 2 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(p != MAP_FAILED);
  CU_OK(cuMemHostRegister(p + 16, 100, 0)); /* unaligned: the driver pins the whole page */
  assert_int_equal(cuMemHostRegister(p + 512, 100, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  assert_int_equal(cuMemHostRegister(p + PAGE - 8, 16, 0),
                   CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  CU_OK(cuMemHostRegister(p + PAGE + 8, 100, 0)); /* the next page is free */
  CU_OK(cuMemHostUnregister(p + 16));
  CU_OK(cuMemHostUnregister(p + PAGE + 8));
  munmap(p, 2 * PAGE);
}

static void test_host_registration_failures_as_the_driver_reports_them(void **state) {
  (void)state;
  unsigned char *p = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(p != MAP_FAILED);
  assert_int_equal(cuMemHostRegister(NULL, PAGE, 0), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemHostRegister(p, 0, 0), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemHostRegister(p, PAGE, 0x100), CUDA_ERROR_INVALID_VALUE);
  const CUresult forced[] = {CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NOT_PERMITTED,
                             CUDA_ERROR_NOT_SUPPORTED};
  for (size_t i = 0; i < 3; i++) {
    fake_cuda_set_host_register_result(forced[i]);
    assert_int_equal(cuMemHostRegister(p, PAGE, 0), forced[i]);
  }
  fake_cuda_set_host_register_result(CUDA_SUCCESS);
  setenv("FAKE_CUDA_HOST_REGISTER_SUPPORTED", "0", 1);
  int attr = -1;
  CU_OK(cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, 0));
  assert_int_equal(attr, 0);
  assert_int_equal(cuMemHostRegister(p, PAGE, 0), CUDA_ERROR_NOT_SUPPORTED);
  unsetenv("FAKE_CUDA_HOST_REGISTER_SUPPORTED");
  CU_OK(cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, 0));
  assert_int_equal(attr, 1);
  setenv("FAKE_CUDA_PINNED_LIMIT", "2048", 1); /* less than the page it must pin */
  assert_int_equal(cuMemHostRegister(p, 100, 0), CUDA_ERROR_OUT_OF_MEMORY);
  unsetenv("FAKE_CUDA_PINNED_LIMIT");
  CU_OK(cuMemHostRegister(p, PAGE, 0));
  CU_OK(cuMemHostUnregister(p));
  munmap(p, PAGE);
}

/* ---- faults ---- */

static void test_an_injected_fault_fires_once(void **state) {
  (void)state;
  fake_cuda_set_fail_at(2, CUDA_ERROR_OUT_OF_MEMORY);
  CUdeviceptr a = 0, b = 0, c = 0;
  CU_OK(cuMemAlloc(&a, 4096));
  assert_int_equal(cuMemAlloc(&b, 4096), CUDA_ERROR_OUT_OF_MEMORY);
  assert_string_equal(fake_cuda_fault_call(), "cuMemAlloc");
  CU_OK(cuMemAlloc(&c, 4096));
  CU_OK(cuMemFree(a));
  CU_OK(cuMemFree(c));
}

static void test_a_sticky_error_fails_every_later_call_of_the_context(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s = stream_new(0);
  fake_cuda_set_sticky_at(2, CUDA_ERROR_ILLEGAL_ADDRESS);
  CU_OK(cuMemsetD8Async(d, 1, 4096, s));
  assert_int_equal(cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS); /* the fault */
  CUdeviceptr e = 0;
  assert_int_equal(cuMemAlloc(&e, 4096), CUDA_ERROR_ILLEGAL_ADDRESS);
  assert_int_equal(cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
  assert_int_equal(cuMemFree(d), CUDA_ERROR_ILLEGAL_ADDRESS);
  int n = 0;
  CU_OK(cuDeviceGetCount(&n)); /* no context needed: unaffected */
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  assert_int_equal(st.sticky_result, CUDA_ERROR_ILLEGAL_ADDRESS);
  /* Only destroying the context clears it (see the next test); the control
   * call stands in for that here so the objects can be released. */
  fake_cuda_set_sticky(CUDA_SUCCESS);
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(d));
}

static void test_releasing_the_primary_context_to_zero_clears_a_sticky_error(void **state) {
  (void)state;
  fake_cuda_set_sticky(CUDA_ERROR_ILLEGAL_ADDRESS);
  CUdeviceptr d = 0;
  assert_int_equal(cuMemAlloc(&d, 4096), CUDA_ERROR_ILLEGAL_ADDRESS);
  CUcontext c;
  CU_OK(cuCtxPopCurrent(&c));
  CU_OK(cuDevicePrimaryCtxRelease(0)); /* destroyed */
  CU_OK(cuDevicePrimaryCtxRetain(&ctx0, 0));
  CU_OK(cuCtxPushCurrent(ctx0));
  CU_OK(cuMemAlloc(&d, 4096));
  CU_OK(cuMemFree(d));
}

/* ---- stream capture ---- */

static void test_captured_work_is_not_executed_and_ends_in_a_graph(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING);
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CUstreamCaptureStatus cs;
  cuuint64_t id = 0;
  CU_OK(cuStreamIsCapturing(s, &cs));
  assert_int_equal(cs, CU_STREAM_CAPTURE_STATUS_ACTIVE);
  CU_OK(cuStreamGetCaptureInfo(s, &cs, &id, NULL, NULL, NULL, NULL));
  assert_true(id != 0);
  CU_OK(cuMemsetD8Async(d, 0x71, 4096, s));
  assert_int_equal(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
                   CUDA_ERROR_ILLEGAL_STATE);
  CUgraph g = NULL;
  CU_OK(cuStreamEndCapture(s, &g));
  assert_non_null(g);
  CU_OK(cuStreamSynchronize(s));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[0], 0);
  CU_OK(cuStreamIsCapturing(s, &cs));
  assert_int_equal(cs, CU_STREAM_CAPTURE_STATUS_NONE);
  CUgraph none = (CUgraph)1;
  assert_int_equal(cuStreamEndCapture(s, &none), CUDA_ERROR_ILLEGAL_STATE);
  assert_null(none);
  CU_OK(cuGraphDestroy(g));
  assert_int_equal(cuStreamBeginCapture(NULL, CU_STREAM_CAPTURE_MODE_GLOBAL),
                   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); /* never the legacy stream */
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(d));
}

static void test_unsafe_calls_during_global_capture_invalidate_it(void **state) {
  (void)state;
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING);
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CUdeviceptr d = 0;
  assert_int_equal(cuMemAlloc(&d, 4096), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  CUstreamCaptureStatus cs;
  CU_OK(cuStreamIsCapturing(s, &cs));
  assert_int_equal(cs, CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  assert_int_equal(cuMemsetD8Async(0, 0, 0, s), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CUgraph g = (CUgraph)1;
  assert_int_equal(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  assert_null(g);
  CU_OK(cuMemAlloc(&d, 4096)); /* no capture any more */
  CU_OK(cuMemFree(d));
  CU_OK(cuStreamDestroy(s));
}

typedef struct capture_arg {
  CUstream s;                /* stream to capture on */
  CUstreamCaptureMode mode;  /* mode to begin with */
  pthread_mutex_t mu;        /* guards step */
  pthread_cond_t cv;         /* signals step changes */
  int step;                  /* 1: capture begun; 2: main is done; 3: ended */
  CUresult end;              /* cuStreamEndCapture's answer */
} capture_arg;

static void capture_step(capture_arg *a, int step) {
  pthread_mutex_lock(&a->mu);
  a->step = step;
  pthread_cond_broadcast(&a->cv);
  pthread_mutex_unlock(&a->mu);
}

static void capture_wait(capture_arg *a, int step) {
  pthread_mutex_lock(&a->mu);
  while (a->step < step) pthread_cond_wait(&a->cv, &a->mu);
  pthread_mutex_unlock(&a->mu);
}

static void *capture_main(void *arg) {
  capture_arg *a = arg;
  cuCtxPushCurrent(ctx0);
  cuStreamBeginCapture(a->s, a->mode);
  capture_step(a, 1);
  capture_wait(a, 2);
  CUgraph g = NULL;
  a->end = cuStreamEndCapture(a->s, &g);
  if (g) cuGraphDestroy(g);
  CUcontext c;
  cuCtxPopCurrent(&c);
  return NULL;
}

static CUresult alloc_free(void) {
  CUdeviceptr d = 0;
  CUresult r = cuMemAlloc(&d, 4096);
  if (r == CUDA_SUCCESS) cuMemFree(d);
  return r;
}

static void test_thread_capture_modes_decide_who_may_make_unsafe_calls(void **state) {
  (void)state;
  for (int round = 0; round < 3; round++) {
    /* Another thread captures: GLOBAL (round 0, 1) or THREAD_LOCAL (round 2). */
    capture_arg a = {.s = stream_new(CU_STREAM_NON_BLOCKING),
                     .mode = round < 2 ? CU_STREAM_CAPTURE_MODE_GLOBAL
                                       : CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                     .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, capture_main, &a), 0);
    capture_wait(&a, 1);
    CUresult expect_end = CUDA_SUCCESS;
    if (round == 0) {
      /* This thread in GLOBAL mode: the other thread's GLOBAL capture forbids it. */
      assert_int_equal(alloc_free(), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
      expect_end = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    } else {
      /* THREAD_LOCAL ignores other threads' captures; GLOBAL ignores
       * THREAD_LOCAL captures of others. */
      CUstreamCaptureMode m = round == 1 ? CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
                                         : CU_STREAM_CAPTURE_MODE_GLOBAL;
      CU_OK(cuThreadExchangeStreamCaptureMode(&m));
      CU_OK(alloc_free());
      CU_OK(cuThreadExchangeStreamCaptureMode(&m));
      assert_int_equal(m, round == 1 ? CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
                                     : CU_STREAM_CAPTURE_MODE_GLOBAL);
    }
    capture_step(&a, 2);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(a.end, expect_end);
    CU_OK(cuStreamDestroy(a.s));
  }
}

static void test_relaxed_capture_allows_unsafe_calls(void **state) {
  (void)state;
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING);
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
  CU_OK(alloc_free());
  CUgraph g = NULL;
  CU_OK(cuStreamEndCapture(s, &g));
  CU_OK(cuGraphDestroy(g));
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  assert_int_equal(alloc_free(), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); /* its own capture */
  assert_int_equal(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CU_OK(cuStreamDestroy(s));
}

static void test_synchronizing_a_capturing_stream_is_illegal(void **state) {
  (void)state;
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING);
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
  assert_int_equal(cuStreamSynchronize(s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  CUgraph g = NULL;
  assert_int_equal(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
  assert_int_equal(cuStreamQuery(s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  assert_int_equal(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CU_OK(cuStreamDestroy(s));
}

static void test_an_event_recorded_in_capture_cannot_be_queried(void **state) {
  (void)state;
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING);
  CUevent e = event_new();
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CU_OK(cuEventRecord(e, s));
  assert_int_equal(cuEventQuery(e), CUDA_ERROR_CAPTURED_EVENT);
  assert_int_equal(cuEventSynchronize(e), CUDA_ERROR_CAPTURED_EVENT);
  CUgraph g = NULL;
  CU_OK(cuStreamEndCapture(s, &g));
  CU_OK(cuGraphDestroy(g));
  assert_int_equal(cuEventQuery(e), CUDA_ERROR_CAPTURED_EVENT); /* last recorded in capture */
  CU_OK(cuEventRecord(e, s));
  CU_OK(cuEventSynchronize(e));
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s));
}

static void test_legacy_stream_use_during_blocking_capture_is_implicit(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s = stream_new(0); /* blocking */
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
  CUstreamCaptureStatus cs;
  assert_int_equal(cuStreamIsCapturing(NULL, &cs), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  CU_OK(cuStreamIsCapturing(s, &cs));
  assert_int_equal(cs, CU_STREAM_CAPTURE_STATUS_ACTIVE); /* a query does not invalidate */
  assert_int_equal(cuMemsetD8Async(d, 1, 4096, NULL), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  CU_OK(cuStreamIsCapturing(s, &cs));
  assert_int_equal(cs, CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  CUgraph g = NULL;
  assert_int_equal(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  /* A non-blocking capture leaves the legacy stream usable. */
  CUstream nb = stream_new(CU_STREAM_NON_BLOCKING);
  CU_OK(cuStreamBeginCapture(nb, CU_STREAM_CAPTURE_MODE_RELAXED));
  CU_OK(cuMemsetD8Async(d, 2, 4096, NULL));
  CU_OK(cuStreamSynchronize(NULL));
  CU_OK(cuStreamEndCapture(nb, &g));
  CU_OK(cuGraphDestroy(g));
  CU_OK(cuStreamDestroy(nb));
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(d));
}

static void test_capture_ends_on_its_thread_and_stream_with_forks_joined(void **state) {
  (void)state;
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING), s2 = stream_new(CU_STREAM_NON_BLOCKING);
  CUevent fork = event_new(), join = event_new();
  CUdeviceptr d = dev_alloc(4096);
  CUgraph g = NULL;
  /* A fork never joined back. */
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CU_OK(cuEventRecord(fork, s));
  CU_OK(cuStreamWaitEvent(s2, fork, 0)); /* s2 joins the capture */
  CUstreamCaptureStatus cs;
  CU_OK(cuStreamIsCapturing(s2, &cs));
  assert_int_equal(cs, CU_STREAM_CAPTURE_STATUS_ACTIVE);
  CU_OK(cuMemsetD8Async(d, 1, 4096, s2));
  assert_int_equal(cuStreamEndCapture(s2, &g), CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
  assert_int_equal(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
  CU_OK(cuStreamIsCapturing(s2, &cs));
  assert_int_equal(cs, CU_STREAM_CAPTURE_STATUS_NONE);
  /* Joined back: fine. */
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CU_OK(cuEventRecord(fork, s));
  CU_OK(cuStreamWaitEvent(s2, fork, 0));
  CU_OK(cuMemsetD8Async(d, 1, 4096, s2));
  CU_OK(cuEventRecord(join, s2));
  CU_OK(cuStreamWaitEvent(s, join, 0));
  CU_OK(cuStreamEndCapture(s, &g));
  CU_OK(cuGraphDestroy(g));
  /* Waiting in a capture on work recorded outside it crosses the boundary. */
  CU_OK(cuEventRecord(join, s2));
  CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  assert_int_equal(cuStreamWaitEvent(s, join, 0), CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
  assert_int_equal(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  /* A GLOBAL capture ends only on the thread that began it. */
  capture_arg a = {.s = s, .mode = CU_STREAM_CAPTURE_MODE_GLOBAL,
                   .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, capture_main, &a), 0);
  capture_wait(&a, 1);
  assert_int_equal(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
  capture_step(&a, 2);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(a.end, CUDA_SUCCESS);
  CU_OK(cuEventDestroy(fork));
  CU_OK(cuEventDestroy(join));
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuStreamDestroy(s2));
  CU_OK(cuMemFree(d));
}

/* ---- managed memory ---- */

static CUmemLocation loc(CUmemLocationType type, int id) {
  CUmemLocation l;
  memset(&l, 0, sizeof l);
  l.type = type;
  l.id = id;
  return l;
}

static void test_managed_memory_is_placed_only_by_a_prefetch(void **state) {
  (void)state;
  CUdeviceptr m = 0;
  assert_int_equal(cuMemAllocManaged(&m, 0, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemAllocManaged(&m, 4096, 7), CUDA_ERROR_INVALID_VALUE);
  CU_OK(cuMemAllocManaged(&m, 3 * PAGE, CU_MEM_ATTACH_GLOBAL));
  assert_int_equal(fake_cuda_managed_page((void *)(uintptr_t)m, NULL, NULL), 0); /* nowhere yet */
  size_t free0 = 0, free1 = 0, total = 0;
  CU_OK(cuMemGetInfo(&free0, &total));
  CU_OK(cuMemPrefetchAsync(m, 3 * PAGE, loc(CU_MEM_LOCATION_TYPE_DEVICE, 0), 0, NULL));
  CU_OK(cuCtxSynchronize());
  assert_int_equal(fake_cuda_managed_page((void *)(uintptr_t)(m + 2 * PAGE), NULL, NULL), 1);
  CU_OK(cuMemGetInfo(&free1, &total));
  assert_int_equal(free0 - free1, 3 * PAGE); /* device-placed pages are device memory */
  CU_OK(cuMemFree(m));
  CU_OK(cuMemGetInfo(&free1, &total));
  assert_int_equal(free1, free0);
}

/* A prefetch is stream work: the pages move after what was queued before it. */
static void test_managed_prefetch_runs_in_stream_order(void **state) {
  (void)state;
  CUdeviceptr m = 0;
  CU_OK(cuMemAllocManaged(&m, 16 * PAGE, CU_MEM_ATTACH_GLOBAL));
  CUstream s = stream_new(0);
  CUevent e = event_new();
  fake_cuda_hold_stream(s, 1);
  CU_OK(cuEventRecord(e, s)); /* held: stands for a kernel still running */
  CU_OK(cuMemPrefetchAsync(m, 16 * PAGE, loc(CU_MEM_LOCATION_TYPE_HOST, 0), 0, s));
  fake_cuda_settle();
  assert_int_equal(fake_cuda_managed_page((void *)(uintptr_t)m, NULL, NULL), 0);
  fake_cuda_complete_stream(s);
  fake_cuda_hold_stream(s, 0);
  assert_int_equal(fake_cuda_managed_page((void *)(uintptr_t)m, NULL, NULL), 2);
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  assert_int_equal(st.managed_host_bytes - base.managed_host_bytes, 16 * PAGE);
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(m));
}

/* Advice widens to whole host pages and checks its location as documented. */
static void test_managed_advice_is_page_granular_and_checks_locations(void **state) {
  (void)state;
  CUdeviceptr m = 0;
  CU_OK(cuMemAllocManaged(&m, 4 * PAGE, CU_MEM_ATTACH_GLOBAL));
  CU_OK(cuMemAdvise(m + PAGE + 100, 1, CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                    loc(CU_MEM_LOCATION_TYPE_HOST_NUMA, 0)));
  int pref = 0, acc = 0;
  fake_cuda_managed_page((void *)(uintptr_t)(m + PAGE), &pref, &acc);
  assert_int_equal(pref, CU_MEM_LOCATION_TYPE_HOST_NUMA);
  fake_cuda_managed_page((void *)(uintptr_t)m, &pref, &acc);
  assert_int_equal(pref, -1); /* the page before is untouched */
  fake_cuda_managed_page((void *)(uintptr_t)(m + 2 * PAGE), &pref, &acc);
  assert_int_equal(pref, -1);
  CU_OK(cuMemAdvise(m, 4 * PAGE, CU_MEM_ADVISE_SET_ACCESSED_BY, loc(CU_MEM_LOCATION_TYPE_DEVICE, 0)));
  fake_cuda_managed_page((void *)(uintptr_t)(m + 3 * PAGE), &pref, &acc);
  assert_int_equal(acc, 1);
  assert_int_equal(cuMemAdvise(m, PAGE, CU_MEM_ADVISE_SET_ACCESSED_BY,
                               loc(CU_MEM_LOCATION_TYPE_HOST_NUMA, 0)), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemAdvise(m, PAGE, CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                               loc(CU_MEM_LOCATION_TYPE_HOST_NUMA, -1)), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemAdvise(m, PAGE, CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                               loc(CU_MEM_LOCATION_TYPE_DEVICE, 5)), CUDA_ERROR_INVALID_DEVICE);
  assert_int_equal(cuMemAdvise(m + 3 * PAGE, 2 * PAGE, CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                               loc(CU_MEM_LOCATION_TYPE_HOST, 0)), CUDA_ERROR_INVALID_VALUE);
  CUdeviceptr d = dev_alloc(PAGE); /* not managed memory */
  assert_int_equal(cuMemAdvise(d, PAGE, CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                               loc(CU_MEM_LOCATION_TYPE_HOST, 0)), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemPrefetchAsync(d, PAGE, loc(CU_MEM_LOCATION_TYPE_HOST, 0), 0, NULL),
                   CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemPrefetchAsync(m, PAGE, loc(CU_MEM_LOCATION_TYPE_HOST, 0), 1, NULL),
                   CUDA_ERROR_INVALID_VALUE); /* flags must be 0 */
  CU_OK(cuMemFree(d));
  CU_OK(cuMemFree(m));
}

/* Past the device's free memory the driver evicts other managed pages on its
 * own (what sgm must never cause): the double does it too, and counts it. */
static void test_managed_prefetch_past_free_memory_evicts_and_counts(void **state) {
  (void)state;
  setenv("FAKE_CUDA_TOTAL_MEM", "64MiB", 1); /* 8 MiB context reservation: 56 MiB free */
  CU_OK(cuInit(0));
  CUdeviceptr a = 0, b = 0;
  CU_OK(cuMemAllocManaged(&a, 40 * MiB, CU_MEM_ATTACH_GLOBAL));
  CU_OK(cuMemAllocManaged(&b, 40 * MiB, CU_MEM_ATTACH_GLOBAL));
  CU_OK(cuMemPrefetchAsync(a, 40 * MiB, loc(CU_MEM_LOCATION_TYPE_DEVICE, 0), 0, NULL));
  CU_OK(cuMemPrefetchAsync(b, 40 * MiB, loc(CU_MEM_LOCATION_TYPE_DEVICE, 0), 0, NULL));
  CU_OK(cuCtxSynchronize());
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  assert_int_equal(st.managed_evicted_bytes - base.managed_evicted_bytes, 24 * MiB);
  assert_int_equal(st.managed_device_bytes - base.managed_device_bytes, 56 * MiB);
  assert_int_equal(fake_cuda_managed_page((void *)(uintptr_t)b, NULL, NULL), 1);
  CU_OK(cuMemFree(a));
  CU_OK(cuMemFree(b));
}

/* Without concurrent managed access no page goes to the device. */
static void test_managed_device_needs_concurrent_access(void **state) {
  (void)state;
  setenv("FAKE_CUDA_CONCURRENT_MANAGED", "0", 1);
  int v = 1;
  CU_OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, 0));
  assert_int_equal(v, 0);
  CUdeviceptr m = 0;
  CU_OK(cuMemAllocManaged(&m, PAGE, CU_MEM_ATTACH_GLOBAL));
  assert_int_equal(cuMemPrefetchAsync(m, PAGE, loc(CU_MEM_LOCATION_TYPE_DEVICE, 0), 0, NULL),
                   CUDA_ERROR_INVALID_DEVICE);
  CU_OK(cuMemFree(m));
}

/* By version: the CUdevice forms below 12.2, the CUmemLocation forms from 12.2. */
static void test_managed_entry_points_by_version(void **state) {
  (void)state;
  void *fn = NULL;
  CUdriverProcAddressQueryResult st;
  CU_OK(cuGetProcAddress("cuMemPrefetchAsync", &fn, 12020, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  assert_ptr_equal(fn, (void *)&cuMemPrefetchAsync_v2);
  CU_OK(cuGetProcAddress("cuMemAdvise", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  assert_ptr_equal(fn, (void *)&cuMemAdvise_v2);
  CU_OK(cuGetProcAddress("cuMemPrefetchAsync", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  assert_non_null(fn);
  assert_ptr_not_equal(fn, (void *)&cuMemPrefetchAsync_v2);
  /* The old form still works, with a device ordinal. */
  CUdeviceptr m = 0;
  CU_OK(cuMemAllocManaged(&m, PAGE, CU_MEM_ATTACH_GLOBAL));
  CU_OK(((CUresult(*)(CUdeviceptr, size_t, CUdevice, CUstream))fn)(m, PAGE, 0, NULL));
  CU_OK(cuCtxSynchronize());
  assert_int_equal(fake_cuda_managed_page((void *)(uintptr_t)m, NULL, NULL), 1);
  CU_OK(cuMemFree(m));
  setenv("FAKE_CUDA_DRIVER_VERSION", "12000", 1);
  assert_int_equal(cuGetProcAddress("cuMemAdvise", &fn, 12020, CU_GET_PROC_ADDRESS_DEFAULT, &st),
                   CUDA_ERROR_INVALID_VALUE);
}

/* ---- cuGetProcAddress, version, counters, priorities ---- */

static void test_get_proc_address_answers_by_version_and_flags(void **state) {
  (void)state;
  void *fn = NULL;
  CUdriverProcAddressQueryResult st;
  CU_OK(cuGetProcAddress("cuMemAlloc", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  assert_int_equal(st, CU_GET_PROC_ADDRESS_SUCCESS);
  assert_ptr_equal(fn, (void *)&cuMemAlloc_v2); /* the _v2 ABI from 3.2 */
  /* The 32-bit ABI before 3.2 is not implemented: not found, pfn NULL. */
  CU_OK(cuGetProcAddress("cuMemAlloc", &fn, 3000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  assert_null(fn);
  assert_int_equal(st, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  /* Older than the name: version not sufficient. */
  CU_OK(cuGetProcAddress("cuStreamBeginCapture", &fn, 9020, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  assert_null(fn);
  assert_int_equal(st, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
  /* One name, three ABIs. */
  void *v1 = NULL, *v2 = NULL, *v3 = NULL;
  CU_OK(cuGetProcAddress("cuStreamGetCaptureInfo", &v1, 11020, 0, &st));
  CU_OK(cuGetProcAddress("cuStreamGetCaptureInfo", &v2, 12000, 0, &st));
  CU_OK(cuGetProcAddress("cuStreamGetCaptureInfo", &v3, 13000, 0, &st));
  assert_non_null(v1);
  assert_ptr_not_equal(v1, v2);
  assert_ptr_not_equal(v2, v3);
  assert_ptr_equal(v3, (void *)&cuStreamGetCaptureInfo_v3);
  /* Versioned and unknown names are not base names. */
  CU_OK(cuGetProcAddress("cuMemAlloc_v2", &fn, 12000, 0, &st));
  assert_null(fn);
  assert_int_equal(st, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  /* Newer than the driver: an error. */
  assert_int_equal(cuGetProcAddress("cuMemAlloc", &fn, 13010, 0, &st), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuGetProcAddress("cuMemAlloc", &fn, 12000, 8, &st), CUDA_ERROR_INVALID_VALUE);
  /* Per-thread variants only where a stream is taken. */
  void *a = NULL, *b = NULL;
  CU_OK(cuGetProcAddress("cuMemAlloc", &a, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
  assert_ptr_equal(a, (void *)&cuMemAlloc_v2);
  CU_OK(cuGetProcAddress("cuEventRecord", &a, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
  CU_OK(cuGetProcAddress("cuEventRecord", &b, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &st));
  assert_ptr_not_equal(a, b);
  assert_ptr_equal(b, (void *)&cuEventRecord);
}

static void test_driver_version_is_13_0(void **state) {
  (void)state;
  int v = 0;
  CU_OK(cuDriverGetVersion(&v));
  assert_int_equal(v, 13000);
}

/* ---- virtual memory management (issue 17) ---- */

#define GRAN (2 * MiB)

static CUmemAllocationProp vmm_prop(void) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  return prop;
}

static CUmemGenericAllocationHandle vmm_create(size_t n) {
  CUmemAllocationProp prop = vmm_prop();
  CUmemGenericAllocationHandle h = 0;
  CU_OK(cuMemCreate(&h, n, &prop, 0));
  return h;
}

static void vmm_access(CUdeviceptr p, size_t n) {
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = 0;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_OK(cuMemSetAccess(p, n, &d, 1));
}

static size_t free_mem(void) {
  size_t f = 0, t = 0;
  CU_OK(cuMemGetInfo(&f, &t));
  return f;
}

/* Rule: sizes, addresses and reservations are granule multiples; a mapping's
 * offset is 0 and its size at most the allocation's; no second mapping over a
 * mapped address; the device answers the VMM attribute. */
static void test_vmm_calls_take_granule_multiples(void **state) {
  (void)state;
  int vmm = 0;
  CU_OK(cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
  assert_int_equal(vmm, 1);
  CUmemAllocationProp prop = vmm_prop();
  size_t g = 0;
  CU_OK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  assert_int_equal(g, GRAN);
  CUmemAllocationProp bad = prop;
  bad.location.type = CU_MEM_LOCATION_TYPE_HOST;
  assert_int_equal(cuMemGetAllocationGranularity(&g, &bad, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   CUDA_ERROR_INVALID_VALUE);
  CUdeviceptr base = 0;
  assert_int_equal(cuMemAddressReserve(&base, GRAN + 4096, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
  CU_OK(cuMemAddressReserve(&base, 4 * GRAN, 0, 0, 0));
  assert_int_equal(base % GRAN, 0);
  CUmemGenericAllocationHandle h = 0;
  assert_int_equal(cuMemCreate(&h, GRAN / 2, &prop, 0), CUDA_ERROR_INVALID_VALUE);
  h = vmm_create(GRAN);
  assert_int_equal(cuMemMap(base + 4096, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemMap(base, GRAN, GRAN, h, 0), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemMap(base, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* > allocation */
  assert_int_equal(cuMemMap(base + 4 * GRAN, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* outside */
  CU_OK(cuMemMap(base, GRAN, 0, h, 0));
  CUmemGenericAllocationHandle h2 = vmm_create(GRAN);
  assert_int_equal(cuMemMap(base, GRAN, 0, h2, 0), CUDA_ERROR_INVALID_VALUE); /* mapped there */
  CU_OK(cuMemRelease(h2));
  CU_OK(cuMemUnmap(base, GRAN));
  CU_OK(cuMemRelease(h));
  CU_OK(cuMemAddressFree(base, 4 * GRAN));
}

/* Rule: a new mapping has no access: the device may not touch it (a copy
 * fails) until cuMemSetAccess; every map needs its own, also after an unmap
 * of the same address. */
static void test_vmm_access_must_be_set_after_every_map(void **state) {
  (void)state;
  CUdeviceptr base = 0;
  CU_OK(cuMemAddressReserve(&base, 2 * GRAN, 0, 0, 0));
  CUstream s = stream_new(0);
  for (int round = 0; round < 2; round++) {
    CUmemGenericAllocationHandle h = vmm_create(GRAN);
    CU_OK(cuMemMap(base, GRAN, 0, h, 0));
    CU_OK(cuMemRelease(h)); /* the mapping keeps the memory */
    assert_int_equal(cuMemsetD8Async(base, 0x11, 4096, s), CUDA_ERROR_INVALID_VALUE);
    vmm_access(base, GRAN);
    CU_OK(cuMemsetD8Async(base, 0x11, 4096, s));
    CU_OK(cuStreamSynchronize(s));
    assert_int_equal(((unsigned char *)(uintptr_t)base)[4095], 0x11);
    /* Access over a range that is not whole mappings is refused. */
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    assert_int_equal(cuMemSetAccess(base, 2 * GRAN, &d, 1), CUDA_ERROR_INVALID_VALUE);
    CU_OK(cuMemUnmap(base, GRAN));
  }
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemAddressFree(base, 2 * GRAN));
}

/* Rule: cuMemSetAccess takes a fully mapped range of whole mappings, so one
 * call may cover several neighbouring mappings (cuda.h: "a fully mapped
 * address range containing all allocations"): both become readable and
 * writable. A range that takes part of a mapping is refused, and grants
 * nothing. */
static void test_vmm_access_over_neighbouring_mappings(void **state) {
  (void)state;
  CUdeviceptr base = 0;
  CU_OK(cuMemAddressReserve(&base, 4 * GRAN, 0, 0, 0));
  CUstream s = stream_new(0);
  CUmemGenericAllocationHandle big = vmm_create(2 * GRAN), a = vmm_create(GRAN);
  CU_OK(cuMemMap(base, 2 * GRAN, 0, big, 0));
  CU_OK(cuMemMap(base + 2 * GRAN, GRAN, 0, a, 0));
  CU_OK(cuMemRelease(big));
  CU_OK(cuMemRelease(a));
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  assert_int_equal(cuMemSetAccess(base + GRAN, 2 * GRAN, &d, 1), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemsetD8Async(base + 2 * GRAN, 0x22, 4096, s), CUDA_ERROR_INVALID_VALUE);
  vmm_access(base, 3 * GRAN); /* both mappings, one call */
  CU_OK(cuMemsetD8Async(base + GRAN, 0x22, 4096, s));
  CU_OK(cuMemsetD8Async(base + 2 * GRAN, 0x33, 4096, s));
  CU_OK(cuStreamSynchronize(s));
  assert_int_equal(((unsigned char *)(uintptr_t)(base + GRAN))[4095], 0x22);
  assert_int_equal(((unsigned char *)(uintptr_t)(base + 2 * GRAN))[4095], 0x33);
  CU_OK(cuMemUnmap(base, 3 * GRAN));
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemAddressFree(base, 4 * GRAN));
}

/* Rule: cuMemUnmap takes whole mappings (several neighbours at once are
 * fine), never part of one; cuMemAddressFree takes exactly a reservation with
 * nothing mapped in it. */
static void test_vmm_unmap_takes_whole_mappings(void **state) {
  (void)state;
  CUdeviceptr base = 0;
  CU_OK(cuMemAddressReserve(&base, 4 * GRAN, 0, 0, 0));
  CUmemGenericAllocationHandle big = vmm_create(2 * GRAN), a = vmm_create(GRAN), b = vmm_create(GRAN);
  CU_OK(cuMemMap(base, 2 * GRAN, 0, big, 0));
  CU_OK(cuMemMap(base + 2 * GRAN, GRAN, 0, a, 0));
  CU_OK(cuMemMap(base + 3 * GRAN, GRAN, 0, b, 0));
  assert_int_equal(cuMemUnmap(base, GRAN), CUDA_ERROR_INVALID_VALUE); /* half of big */
  assert_int_equal(cuMemUnmap(base + GRAN, 2 * GRAN), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemAddressFree(base, 4 * GRAN), CUDA_ERROR_INVALID_VALUE); /* mapped */
  CU_OK(cuMemUnmap(base + 2 * GRAN, 2 * GRAN)); /* a and b together */
  CU_OK(cuMemUnmap(base, 2 * GRAN));
  assert_int_equal(cuMemUnmap(base, 2 * GRAN), CUDA_ERROR_INVALID_VALUE); /* nothing mapped */
  CU_OK(cuMemRelease(big));
  CU_OK(cuMemRelease(a));
  CU_OK(cuMemRelease(b));
  assert_int_equal(cuMemRelease(b), CUDA_ERROR_INVALID_VALUE); /* released twice */
  assert_int_equal(cuMemAddressFree(base, 2 * GRAN), CUDA_ERROR_INVALID_VALUE); /* wrong size */
  CU_OK(cuMemAddressFree(base, 4 * GRAN)); /* teardown checks that nothing is left */
}

/* Rule: cuMemCreate charges the device at once; the memory is freed only
 * when its handle is released *and* its mapping unmapped, in either order. */
static void test_vmm_memory_lives_until_released_and_unmapped(void **state) {
  (void)state;
  size_t f0 = free_mem();
  CUdeviceptr base = 0;
  CU_OK(cuMemAddressReserve(&base, 2 * GRAN, 0, 0, 0));
  assert_int_equal(free_mem(), f0); /* address space only */
  CUmemGenericAllocationHandle h = vmm_create(GRAN), k = vmm_create(GRAN);
  assert_int_equal(free_mem(), f0 - 2 * GRAN);
  CU_OK(cuMemMap(base, GRAN, 0, h, 0));
  CU_OK(cuMemMap(base + GRAN, GRAN, 0, k, 0));
  CU_OK(cuMemRelease(h)); /* release first: still mapped, still charged */
  assert_int_equal(free_mem(), f0 - 2 * GRAN);
  CU_OK(cuMemUnmap(base, GRAN));
  assert_int_equal(free_mem(), f0 - GRAN);
  CU_OK(cuMemUnmap(base + GRAN, GRAN)); /* unmap first: the handle still holds it */
  assert_int_equal(free_mem(), f0 - GRAN);
  CU_OK(cuMemRelease(k));
  assert_int_equal(free_mem(), f0);
  CU_OK(cuMemAddressFree(base, 2 * GRAN));
}

/* Rule: cuMemUnmap does not wait for queued work: unmapping memory a queued
 * memset still writes is the caller's bug, counted (and the memset dropped,
 * where a GPU would fault). Unmapping after the work completed is not. */
static void test_vmm_unmap_under_queued_work_is_counted(void **state) {
  (void)state;
  fake_cuda_stats st0, st1;
  fake_cuda_get_stats(&st0);
  CUdeviceptr base = 0;
  CU_OK(cuMemAddressReserve(&base, GRAN, 0, 0, 0));
  CUstream s = stream_new(0);
  for (int pending = 0; pending < 2; pending++) {
    CUmemGenericAllocationHandle h = vmm_create(GRAN);
    CU_OK(cuMemMap(base, GRAN, 0, h, 0));
    CU_OK(cuMemRelease(h));
    vmm_access(base, GRAN);
    if (pending) fake_cuda_pause(1);
    CU_OK(cuMemsetD8Async(base, 0x22, GRAN, s));
    if (!pending) CU_OK(cuStreamSynchronize(s));
    CU_OK(cuMemUnmap(base, GRAN));
    fake_cuda_pause(0);
    CU_OK(cuStreamSynchronize(s));
    fake_cuda_get_stats(&st1);
    assert_int_equal(st1.vmm_unmaps_in_use - st0.vmm_unmaps_in_use, (uint64_t)pending);
  }
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemAddressFree(base, GRAN));
}

/* Rule: a device without the API (FAKE_CUDA_VMM_SUPPORTED=0) says so in the
 * attribute and refuses every VMM call with NOT_SUPPORTED. */
static void test_vmm_unsupported_device_refuses_the_calls(void **state) {
  (void)state;
  setenv("FAKE_CUDA_VMM_SUPPORTED", "0", 1);
  int vmm = 1;
  CU_OK(cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
  assert_int_equal(vmm, 0);
  CUdeviceptr base = 0;
  assert_int_equal(cuMemAddressReserve(&base, GRAN, 0, 0, 0), CUDA_ERROR_NOT_SUPPORTED);
  CUmemAllocationProp prop = vmm_prop();
  CUmemGenericAllocationHandle h = 0;
  assert_int_equal(cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
  unsetenv("FAKE_CUDA_VMM_SUPPORTED");
}

static void test_every_entry_point_counts_its_calls(void **state) {
  (void)state;
  assert_int_equal(fake_cuda_calls("cuMemAlloc"), 0);
  uint64_t before = fake_cuda_calls(NULL); /* setup's calls */
  CUdeviceptr d = dev_alloc(4096);
  size_t f, t;
  CU_OK(cuMemGetInfo(&f, &t));
  CU_OK(cuMemFree(d));
  assert_int_equal(fake_cuda_calls("cuMemAlloc"), 1);
  assert_int_equal(fake_cuda_calls("cuMemFree"), 1);
  assert_int_equal(fake_cuda_calls("cuMemGetInfo"), 1);
  assert_int_equal(fake_cuda_calls(NULL) - before, 3);
  assert_int_equal(fake_cuda_calls("cuNoSuchCall"), 0);
}

static void test_stream_priorities_are_clamped_to_the_range(void **state) {
  (void)state;
  int least = 1, greatest = 1;
  CU_OK(cuCtxGetStreamPriorityRange(&least, &greatest));
  assert_true(greatest < least);
  CUstream s = NULL;
  CU_OK(cuStreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, greatest - 10));
  int p = 0;
  unsigned flags = 0;
  CU_OK(cuStreamGetPriority(s, &p));
  CU_OK(cuStreamGetFlags(s, &flags));
  assert_int_equal(p, greatest);
  assert_int_equal(flags, CU_STREAM_NON_BLOCKING);
  CU_OK(cuStreamDestroy(s));
  assert_int_equal(cuStreamCreate(&s, 0x10), CUDA_ERROR_INVALID_VALUE);
}

/* Lazy mode: work runs only while someone waits, so a query right after a
 * record is NOT_READY every time. */
static void test_lazy_device_runs_work_only_while_waited_for(void **state) {
  (void)state;
  fake_cuda_set_lazy(1);
  CUstream s = stream_new(0);
  CUevent e = event_new();
  for (int i = 0; i < 50; i++) {
    CU_OK(cuEventRecord(e, s));
    assert_int_equal(cuEventQuery(e), CUDA_ERROR_NOT_READY);
    CU_OK(cuEventSynchronize(e));
    CU_OK(cuEventQuery(e));
  }
  fake_cuda_set_lazy(0);
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s));
}

/* After fork() only the forking thread exists: the child's queued work still
 * completes (its waiting thread runs it), on the child's own memory. */
static void test_a_fork_child_runs_its_own_work(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096);
  CUstream s = stream_new(0);
  CU_OK(cuMemsetD8Async(d, 0x21, 4096, s)); /* the parent's worker exists now */
  CU_OK(cuStreamSynchronize(s));
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int ok = cuMemsetD8Async(d, 0x22, 4096, s) == CUDA_SUCCESS &&
             cuStreamSynchronize(s) == CUDA_SUCCESS &&
             ((unsigned char *)(uintptr_t)d)[7] == 0x22;
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  assert_int_equal(((unsigned char *)(uintptr_t)d)[7], 0x21); /* the parent's memory */
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemFree(d));
}

/* cuDeviceGetUuid (v1 and v2 ABIs): a valid device and a non-NULL out, else
 * INVALID_DEVICE / INVALID_VALUE; each device its own UUID, stable between
 * calls; FAKE_CUDA_UUID (read at the call) names device 0's. */
static void test_device_uuid_needs_a_valid_device_and_an_out(void **state) {
  (void)state;
  CUuuid a, b;
  CU_OK(cuDeviceGetUuid(&a, 0));
  CU_OK(cuDeviceGetUuid(&b, 0));
  assert_memory_equal(a.bytes, b.bytes, 16);
  assert_int_equal(cuDeviceGetUuid(NULL, 0), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuDeviceGetUuid(&b, 1), CUDA_ERROR_INVALID_DEVICE);
  assert_int_equal(cuDeviceGetUuid(&b, -1), CUDA_ERROR_INVALID_DEVICE);
  setenv("FAKE_CUDA_UUID", "GPU-0123abcd-4567-89ef-0011-2233445566ff", 1);
  CU_OK(cuDeviceGetUuid(&b, 0));
  unsetenv("FAKE_CUDA_UUID");
  static const unsigned char want[16] = {0x01, 0x23, 0xab, 0xcd, 0x45, 0x67, 0x89, 0xef,
                                         0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0xff};
  assert_memory_equal(b.bytes, want, 16);
  void *v1 = NULL, *v2 = NULL;
  CUdriverProcAddressQueryResult st;
  CU_OK(cuGetProcAddress("cuDeviceGetUuid", &v1, 11030, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  assert_int_equal(st, CU_GET_PROC_ADDRESS_SUCCESS);
  CU_OK(cuGetProcAddress("cuDeviceGetUuid", &v2, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  assert_int_equal(st, CU_GET_PROC_ADDRESS_SUCCESS);
  assert_non_null(v1);
  assert_non_null(v2);
}

/* ======================================================================== */
/* Issue 27's entry points (the preload's test programs use them). */

static void test_ctx_set_current_replaces_the_top_of_the_stack(void **state) {
  (void)state;
  CUcontext cur = NULL;
  CU_OK(cuCtxSetCurrent(NULL)); /* pops setup's push */
  CU_OK(cuCtxGetCurrent(&cur));
  assert_null(cur);
  CU_OK(cuCtxSetCurrent(NULL)); /* empty stack: a no-op */
  assert_int_equal(cuCtxSetCurrent((CUcontext)(uintptr_t)0x1000), CUDA_ERROR_INVALID_CONTEXT);
  CU_OK(cuCtxSetCurrent(ctx0)); /* empty stack: pushed */
  CU_OK(cuCtxGetCurrent(&cur));
  assert_ptr_equal(cur, ctx0);
  CU_OK(cuCtxSetCurrent(ctx0)); /* replaces the top: still one deep (teardown pops it) */
  CUdevice dev = -1;
  CU_OK(cuCtxGetDevice(&dev));
  assert_int_equal(dev, 0);
}

static void test_sync_copies_return_with_the_data(void **state) {
  (void)state;
  fake_cuda_set_lazy(1); /* work runs only while someone waits: a sync copy must wait */
  fake_cuda_set_delay_us(2000);
  CUdeviceptr d = dev_alloc(64 * KiB);
  unsigned char src[4096], dst[4096];
  for (size_t i = 0; i < sizeof src; i++) src[i] = (unsigned char)(i * 7);
  CU_OK(cuMemcpyHtoD(d + 1000, src, sizeof src));
  memset(dst, 0, sizeof dst);
  CU_OK(cuMemcpyDtoH(dst, d + 1000, sizeof dst));
  assert_memory_equal(src, dst, sizeof src);
  assert_int_equal(cuMemcpyHtoD(d + 64 * KiB - 10, src, 100), CUDA_ERROR_INVALID_VALUE); /* past the end */
  CU_OK(cuMemFree(d));
}

static void test_stream_ordered_allocations_charge_the_device(void **state) {
  (void)state;
  CUstream s = NULL;
  CU_OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  size_t f0, t;
  CU_OK(cuMemGetInfo(&f0, &t));
  CUdeviceptr a = 0, b = 0, m = dev_alloc(4096);
  CU_OK(cuMemAllocAsync(&a, 1 * MiB, s));
  size_t f1;
  CU_OK(cuMemGetInfo(&f1, &t));
  assert_int_equal(f0 - f1, 1 * MiB + 4096);
  assert_int_equal(cuMemAllocAsync(&b, f1 + 1, s), CUDA_ERROR_OUT_OF_MEMORY);
  assert_int_equal(b, 0);
  assert_int_equal(cuMemAllocAsync(&b, 0, s), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemFreeAsync(m, s), CUDA_ERROR_INVALID_VALUE); /* not stream-ordered */
  /* The free follows the stream's queued work: the copy is done when it returns. */
  fake_cuda_set_delay_us(20000);
  unsigned char src[256] = {1};
  CU_OK(cuMemcpyHtoDAsync(a, src, sizeof src, s));
  CU_OK(cuMemFreeAsync(a, s));
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  assert_int_equal(st.pending_ops, base.pending_ops);
  assert_int_equal(cuMemFreeAsync(a, s), CUDA_ERROR_INVALID_VALUE); /* twice */
  size_t f2;
  CU_OK(cuMemGetInfo(&f2, &t));
  assert_int_equal(f0 - f2, 4096);
  CU_OK(cuMemFree(m));
  CU_OK(cuStreamDestroy(s));
}

static void test_pools_take_device_props_and_outlive_their_destroy(void **state) {
  (void)state;
  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_HOST;
  CUmemoryPool pool = NULL, dflt = NULL;
  assert_int_equal(cuMemPoolCreate(&pool, &props), CUDA_ERROR_INVALID_VALUE);
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 5; /* one device */
  assert_int_equal(cuMemPoolCreate(&pool, &props), CUDA_ERROR_INVALID_VALUE);
  props.location.id = 0;
  CU_OK(cuMemPoolCreate(&pool, &props));
  CUdeviceptr a = 0;
  CU_OK(cuMemAllocFromPoolAsync(&a, 8192, pool, NULL));
  CU_OK(cuMemPoolDestroy(pool)); /* returns at once; the pool lives while a does */
  CUdeviceptr b = 0;
  assert_int_equal(cuMemAllocFromPoolAsync(&b, 8192, pool, NULL), CUDA_ERROR_INVALID_VALUE);
  CU_OK(cuMemFree(a)); /* cuMemFree of a stream-ordered block: allowed; the pool goes */
  CU_OK(cuDeviceGetDefaultMemPool(&dflt, 0));
  assert_int_equal(cuMemPoolDestroy(dflt), CUDA_ERROR_INVALID_VALUE);
  /* per-thread variants through cuGetProcAddress differ from the legacy ones */
  void *legacy = NULL, *pt = NULL;
  CUdriverProcAddressQueryResult q;
  CU_OK(cuGetProcAddress("cuMemAllocAsync", &legacy, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &q));
  CU_OK(cuGetProcAddress("cuMemAllocAsync", &pt, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &q));
  assert_non_null(legacy);
  assert_non_null(pt);
  assert_ptr_not_equal(legacy, pt);
  CU_OK(cuGetProcAddress("cuMemAllocAsync", &legacy, 11010, 0, &q)); /* before 11.2 */
  assert_null(legacy);
  assert_int_equal(q, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
}

static void test_pointer_attributes_and_ipc_handles_know_the_memory(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(4096), a = 0;
  CU_OK(cuMemAllocAsync(&a, 4096, NULL));
  unsigned char *h = pinned_alloc(PAGE);
  unsigned type = 0;
  int ord = -1;
  CU_OK(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d + 100));
  assert_int_equal(type, CU_MEMORYTYPE_DEVICE);
  CU_OK(cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d));
  assert_int_equal(ord, 0);
  CU_OK(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)h));
  assert_int_equal(type, CU_MEMORYTYPE_HOST);
  assert_int_equal(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)&type),
                   CUDA_ERROR_INVALID_VALUE);
  CUipcMemHandle ih;
  CU_OK(cuIpcGetMemHandle(&ih, d));
  assert_int_equal(cuIpcGetMemHandle(&ih, a), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuIpcGetMemHandle(&ih, (CUdeviceptr)(uintptr_t)h), CUDA_ERROR_INVALID_VALUE);
  pinned_free(h, PAGE);
  CU_OK(cuMemFreeAsync(a, NULL));
  CU_OK(cuMemFree(d));
}
/* ======================== end of issue 27's block ======================== */
/* ==== issue 24 (first contact): capture-unsafe queries, the current
 * context, kernels ==== */

/* One potentially unsafe call of each kind the double classifies, made on
 * objects that take no part in the capture: which = 0 cuEventQuery, 1
 * cuEventSynchronize, 2 cuStreamQuery, 3 cuStreamSynchronize, 4 cuMemCreate,
 * 5 cuMemMap (of a handle made before), 6 cuMemUnmap (of a mapping made
 * before), 7 cuMemRelease. */
#define UNSAFE_KINDS 8
typedef struct unsafe_objs {
  CUstream other;                  /* a stream that does not capture */
  CUevent ev;                      /* recorded on it, outside any capture */
  CUdeviceptr base;                /* a reserved granule */
  CUmemGenericAllocationHandle h;  /* a handle for it */
  int mapped;                      /* base maps h */
} unsafe_objs;

static CUresult unsafe_call(unsafe_objs *o, int which) {
  CUmemAllocationProp prop = vmm_prop();
  CUmemGenericAllocationHandle h2 = 0;
  CUresult r;
  switch (which) {
    case 0: return cuEventQuery(o->ev);
    case 1: return cuEventSynchronize(o->ev);
    case 2: return cuStreamQuery(o->other);
    case 3: return cuStreamSynchronize(o->other);
    case 4:
      r = cuMemCreate(&h2, 2 * MiB, &prop, 0);
      if (r == CUDA_SUCCESS) cuMemRelease(h2);
      return r;
    case 5:
      r = cuMemMap(o->base, 2 * MiB, 0, o->h, 0);
      if (r == CUDA_SUCCESS) o->mapped = 1;
      return r;
    case 6:
      r = cuMemUnmap(o->base, 2 * MiB);
      if (r == CUDA_SUCCESS) o->mapped = 0;
      return r;
    default: {
      CUmemGenericAllocationHandle h = o->h;
      r = cuMemRelease(h);
      if (r == CUDA_SUCCESS) o->h = 0;
      return r;
    }
  }
}

static void unsafe_objs_make(unsafe_objs *o, int which) {
  memset(o, 0, sizeof *o);
  o->other = stream_new(CU_STREAM_NON_BLOCKING);
  o->ev = event_new();
  CU_OK(cuEventRecord(o->ev, o->other));
  CU_OK(cuMemAddressReserve(&o->base, 2 * MiB, 0, 0, 0));
  CUmemAllocationProp prop = vmm_prop();
  CU_OK(cuMemCreate(&o->h, 2 * MiB, &prop, 0));
  if (which == 6) {
    CU_OK(cuMemMap(o->base, 2 * MiB, 0, o->h, 0));
    o->mapped = 1;
  }
}

static void unsafe_objs_free(unsafe_objs *o) {
  if (o->mapped) CU_OK(cuMemUnmap(o->base, 2 * MiB));
  if (o->h) CU_OK(cuMemRelease(o->h));
  CU_OK(cuMemAddressFree(o->base, 2 * MiB));
  CU_OK(cuEventDestroy(o->ev));
  CU_OK(cuStreamDestroy(o->other));
}

/* Rule: during this thread's GLOBAL capture, each potentially unsafe call —
 * on an event, a stream or memory that takes no part in the capture — fails
 * with STREAM_CAPTURE_UNSUPPORTED and invalidates the capture, so
 * cuStreamEndCapture fails; in RELAXED mode (cuThreadExchangeStreamCaptureMode)
 * the same call succeeds and the capture ends in a graph. */
static void test_queries_syncs_and_vmm_calls_are_unsafe_in_a_global_capture(void **state) {
  (void)state;
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING);
  for (int which = 0; which < UNSAFE_KINDS; which++) {
    for (int relaxed = 0; relaxed < 2; relaxed++) {
      unsafe_objs o;
      unsafe_objs_make(&o, which);
      CU_OK(cuStreamSynchronize(o.other));
      CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
      CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
      if (relaxed) CU_OK(cuThreadExchangeStreamCaptureMode(&m));
      CUresult r = unsafe_call(&o, which);
      if (relaxed) CU_OK(cuThreadExchangeStreamCaptureMode(&m));
      CUgraph g = NULL;
      CUresult end = cuStreamEndCapture(s, &g);
      if (g) CU_OK(cuGraphDestroy(g));
      if (r != (relaxed ? CUDA_SUCCESS : CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) ||
          end != (relaxed ? CUDA_SUCCESS : CUDA_ERROR_STREAM_CAPTURE_INVALIDATED))
        fail_msg("unsafe call %d (relaxed %d): %d, end capture %d", which, relaxed, (int)r, (int)end);
      unsafe_objs_free(&o);
    }
  }
  CU_OK(cuStreamDestroy(s));
}

typedef struct unsafe_thread_arg {
  unsafe_objs *o;            /* objects to use */
  int which;                 /* unsafe_call's kind */
  CUstreamCaptureMode mode;  /* this thread's mode */
  CUresult r;                /* the call's answer */
} unsafe_thread_arg;

static void *unsafe_thread_main(void *arg) {
  unsafe_thread_arg *a = arg;
  cuCtxPushCurrent(ctx0);
  CUstreamCaptureMode m = a->mode;
  cuThreadExchangeStreamCaptureMode(&m);
  a->r = unsafe_call(a->o, a->which);
  CUcontext c;
  cuCtxPopCurrent(&c);
  return NULL;
}

/* Rule: another thread's GLOBAL capture forbids a GLOBAL-mode thread's event
 * query (what sgm's idle thread makes every tick) and invalidates that
 * capture; a THREAD_LOCAL or RELAXED thread is not restricted by it; a
 * THREAD_LOCAL capture restricts only its own thread. */
static void test_another_threads_global_capture_forbids_a_global_threads_query(void **state) {
  (void)state;
  static const struct {
    CUstreamCaptureMode capture, caller;
    CUresult r, end;
  } rows[] = {
      {CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_GLOBAL,
       CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED},
      {CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, CUDA_SUCCESS, CUDA_SUCCESS},
      {CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_RELAXED, CUDA_SUCCESS, CUDA_SUCCESS},
      {CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, CU_STREAM_CAPTURE_MODE_GLOBAL, CUDA_SUCCESS, CUDA_SUCCESS},
      {CU_STREAM_CAPTURE_MODE_RELAXED, CU_STREAM_CAPTURE_MODE_GLOBAL, CUDA_SUCCESS, CUDA_SUCCESS},
  };
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING);
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    unsafe_objs o;
    unsafe_objs_make(&o, 0);
    CU_OK(cuStreamSynchronize(o.other));
    CU_OK(cuStreamBeginCapture(s, rows[i].capture));
    unsafe_thread_arg a = {&o, 0, rows[i].caller, CUDA_ERROR_UNKNOWN};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, unsafe_thread_main, &a), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    CUgraph g = NULL;
    CUresult end = cuStreamEndCapture(s, &g);
    if (g) CU_OK(cuGraphDestroy(g));
    if (a.r != rows[i].r || end != rows[i].end)
      fail_msg("row %zu: query %d, end capture %d", i, (int)a.r, (int)end);
    unsafe_objs_free(&o);
  }
  CU_OK(cuStreamDestroy(s));
}

/* Rule: cuCtxSetCurrent replaces the top of the thread's stack (NULL pops
 * it) and every call is charged to the context current then: an allocation
 * made with device 1's context current takes device 1's memory, not device
 * 0's; push/pop nest over it. */
static void test_calls_are_charged_to_the_context_set_current(void **state) {
  (void)state;
  setenv("FAKE_CUDA_DEVICE_COUNT", "2", 1);
  setenv("FAKE_CUDA_TOTAL_MEM", "1GiB", 1);
  CU_OK(cuInit(0));
  CUcontext ctx1 = NULL, cur = NULL;
  CU_OK(cuDevicePrimaryCtxRetain(&ctx1, 1));
  size_t f0 = 0, f1 = 0, t = 0, f = 0;
  CU_OK(cuMemGetInfo(&f0, &t)); /* device 0 (setup pushed ctx0) */
  CU_OK(cuCtxSetCurrent(ctx1)); /* replaces ctx0 at the top */
  CU_OK(cuCtxGetCurrent(&cur));
  assert_ptr_equal(cur, ctx1);
  CU_OK(cuMemGetInfo(&f1, &t));
  CUdeviceptr d = dev_alloc(256 * MiB);
  CU_OK(cuMemGetInfo(&f, &t));
  assert_int_equal(f, f1 - 256 * MiB); /* device 1 paid */
  CU_OK(cuCtxPushCurrent(ctx0));
  CU_OK(cuMemGetInfo(&f, &t));
  assert_int_equal(f, f0); /* device 0 did not */
  CU_OK(cuCtxPopCurrent(&cur));
  assert_ptr_equal(cur, ctx0);
  CU_OK(cuCtxGetCurrent(&cur));
  assert_ptr_equal(cur, ctx1);
  CU_OK(cuMemFree(d));
  CU_OK(cuCtxSetCurrent(NULL)); /* pops ctx1: the stack is empty */
  CU_OK(cuCtxGetCurrent(&cur));
  assert_null(cur);
  assert_int_equal(cuMemGetInfo(&f, &t), CUDA_ERROR_INVALID_CONTEXT);
  CU_OK(cuCtxSetCurrent(NULL)); /* nothing to pop: no error */
  assert_int_equal(cuCtxSetCurrent((CUcontext)&f), CUDA_ERROR_INVALID_CONTEXT);
  CU_OK(cuCtxSetCurrent(ctx0)); /* an empty stack: pushed (teardown pops it) */
  CU_OK(cuDevicePrimaryCtxRelease(1));
}

/* Rule: a kernel is work of its stream: it runs for its device time, in
 * stream order, and writes its range at its end; a free waits for it, and a
 * block reused under it is overwritten when it ends (as on a GPU). */
static void test_a_kernel_writes_its_range_when_it_ends(void **state) {
  (void)state;
  CUdeviceptr d = dev_alloc(64 * KiB);
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING);
  CUevent e = event_new();
  unsigned char *host = pinned_alloc(64 * KiB);
  memset(host, 0x11, 64 * KiB);
  CU_OK(cuMemcpyHtoDAsync(d, host, 64 * KiB, s));
  CU_OK(cuStreamSynchronize(s));
  fake_cuda_pause(1);
  assert_int_equal(fake_cuda_kernel(s, (void *)(uintptr_t)d, 64 * KiB, 0x5a, 1000), 0);
  CU_OK(cuEventRecord(e, s));
  assert_int_equal(cuEventQuery(e), CUDA_ERROR_NOT_READY);
  /* "Reuse" of the range by the host while the kernel is pending... */
  memset((void *)(uintptr_t)d, 0x22, 64 * KiB);
  fake_cuda_pause(0);
  CU_OK(cuEventSynchronize(e));
  /* ... is overwritten when the kernel ends. */
  assert_int_equal(((unsigned char *)(uintptr_t)d)[123], 0x5a);
  /* A read kernel leaves the range as it was. */
  assert_int_equal(fake_cuda_kernel(s, (void *)(uintptr_t)d, 64 * KiB, -1, 100), 0);
  CU_OK(cuStreamSynchronize(s));
  assert_int_equal(((unsigned char *)(uintptr_t)d)[123], 0x5a);
  /* Not device memory, or bad arguments: refused. */
  unsigned char plain[256];
  assert_int_equal(fake_cuda_kernel(s, plain, sizeof plain, 0, 0), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(fake_cuda_kernel(s, (void *)(uintptr_t)d, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
  /* A free waits for a pending kernel. */
  fake_cuda_set_delay_us(2000);
  assert_int_equal(fake_cuda_kernel(s, (void *)(uintptr_t)d, 64 * KiB, 1, 3000), 0);
  CU_OK(cuMemFree(d));
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  assert_int_equal(st.pending_ops, 0);
  fake_cuda_set_delay_us(0);
  pinned_free(host, 64 * KiB);
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s));
}

/* Rule: cuMemUnmap of memory a pending kernel reads is counted
 * (vmm_unmaps_in_use), as for copies: on a GPU it faults. */
static void test_vmm_unmap_under_a_pending_kernel_is_counted(void **state) {
  (void)state;
  fake_cuda_stats st0, st1;
  fake_cuda_get_stats(&st0);
  CUdeviceptr base = 0;
  CU_OK(cuMemAddressReserve(&base, 2 * MiB, 0, 0, 0));
  CUmemAllocationProp prop = vmm_prop();
  CUmemGenericAllocationHandle h = 0;
  CU_OK(cuMemCreate(&h, 2 * MiB, &prop, 0));
  CU_OK(cuMemMap(base, 2 * MiB, 0, h, 0));
  CU_OK(cuMemRelease(h));
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = 0;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_OK(cuMemSetAccess(base, 2 * MiB, &acc, 1));
  CUstream s = stream_new(0);
  fake_cuda_pause(1);
  assert_int_equal(fake_cuda_kernel(s, (void *)(uintptr_t)base, 2 * MiB, -1, 100), 0);
  CU_OK(cuMemUnmap(base, 2 * MiB));
  fake_cuda_pause(0);
  CU_OK(cuStreamSynchronize(s));
  fake_cuda_get_stats(&st1);
  assert_int_equal(st1.vmm_unmaps_in_use - st0.vmm_unmaps_in_use, 1);
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuMemAddressFree(base, 2 * MiB));
}

/* Rule (issue 26): work queued on one stream over memory that pending work
 * of another stream writes (or reads, when the new work writes) runs
 * concurrently with it on a GPU unless it is ordered after it: counted
 * (stream_races). Ordered by a wait on an event recorded after the work, by
 * the legacy stream's implicit order, or by the other work being done: not
 * counted; two readers, or disjoint ranges: not counted. */
static void test_unordered_work_of_two_streams_on_one_range_is_counted(void **state) {
  (void)state;
  fake_cuda_stats st0, st;
  fake_cuda_get_stats(&st0);
  CUdeviceptr d = dev_alloc(64 * KiB);
  void *p = (void *)(uintptr_t)d, *half = (void *)(uintptr_t)(d + 32 * KiB);
  CUstream s = stream_new(CU_STREAM_NON_BLOCKING), t = stream_new(CU_STREAM_NON_BLOCKING);
  CUstream b1 = stream_new(0);
  CUevent e = event_new();
#define RACES() (fake_cuda_get_stats(&st), st.stream_races - st0.stream_races)
  fake_cuda_pause(1);
  /* S writes the range; T writes it with no order: a race. */
  assert_int_equal(fake_cuda_kernel(s, p, 64 * KiB, 1, 10), 0);
  assert_int_equal(fake_cuda_kernel(t, p, 32 * KiB, 2, 10), 0);
  assert_int_equal(RACES(), 1);
  /* T reads what S writes: a race too; a disjoint range is not. */
  assert_int_equal(fake_cuda_kernel(t, p, 16 * KiB, -1, 10), 0);
  assert_int_equal(RACES(), 2);
  fake_cuda_pause(0);
  CU_OK(cuCtxSynchronize());
  fake_cuda_pause(1);
  assert_int_equal(fake_cuda_kernel(s, p, 32 * KiB, 1, 10), 0);
  assert_int_equal(fake_cuda_kernel(t, half, 32 * KiB, 2, 10), 0);
  assert_int_equal(RACES(), 2);
  /* Ordered: T waits for an event recorded on S after S's work. */
  CU_OK(cuEventRecord(e, s));
  CU_OK(cuStreamWaitEvent(t, e, 0));
  assert_int_equal(fake_cuda_kernel(t, p, 64 * KiB, 3, 10), 0);
  assert_int_equal(RACES(), 2);
  /* Ordered transitively: a copy on T after its kernel, S's earlier work
   * waited for through T's queue. */
  CU_OK(cuMemsetD8Async(d, 4, 64 * KiB, t));
  assert_int_equal(RACES(), 2);
  /* S writing again with no order after T's pending writes: a race; a
   * wait on an event recorded BEFORE S's new work does not cover it. */
  assert_int_equal(fake_cuda_kernel(s, p, 64 * KiB, 5, 10), 0);
  assert_int_equal(RACES(), 3);
  CU_OK(cuStreamWaitEvent(t, e, 0));
  assert_int_equal(fake_cuda_kernel(t, p, 64 * KiB, 6, 10), 0);
  assert_int_equal(RACES(), 4);
  fake_cuda_pause(0);
  CU_OK(cuCtxSynchronize());
  /* Two readers never race. */
  fake_cuda_pause(1);
  assert_int_equal(fake_cuda_kernel(s, p, 64 * KiB, -1, 10), 0);
  assert_int_equal(fake_cuda_kernel(t, p, 64 * KiB, -1, 10), 0);
  assert_int_equal(RACES(), 4);
  /* The legacy stream orders blocking streams: a blocking stream's write
   * then the legacy stream's write is not a race. */
  assert_int_equal(fake_cuda_kernel(b1, p, 64 * KiB, 7, 10), 0);
  assert_int_equal(RACES(), 5); /* b1 writes what S and T still read: one count */
  assert_int_equal(fake_cuda_kernel(NULL, p, 64 * KiB, 8, 10), 0);
  assert_int_equal(RACES(), 6); /* ordered after b1, not after the non-blocking readers */
  fake_cuda_pause(0);
  CU_OK(cuCtxSynchronize());
  /* Work that is done is no longer pending: no race. */
  assert_int_equal(fake_cuda_kernel(s, p, 64 * KiB, 9, 10), 0);
  CU_OK(cuStreamSynchronize(s));
  assert_int_equal(fake_cuda_kernel(t, p, 64 * KiB, 10, 10), 0);
  CU_OK(cuStreamSynchronize(t));
  assert_int_equal(RACES(), 6);
#undef RACES
  CU_OK(cuEventDestroy(e));
  CU_OK(cuStreamDestroy(s));
  CU_OK(cuStreamDestroy(t));
  CU_OK(cuStreamDestroy(b1));
  CU_OK(cuMemFree(d));
}

int main(void) {
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
  const struct CMUnitTest tests[] = {
      T(test_record_behind_pending_copy_is_not_complete),
      T(test_copies_complete_later_in_stream_order),
      T(test_pageable_source_is_staged_at_enqueue),
      T(test_pageable_destination_is_written_before_return),
      T(test_stream_wait_event_orders_later_work),
      T(test_stream_wait_event_takes_the_record_at_call_time),
      T(test_legacy_stream_waits_for_blocking_streams),
      T(test_blocking_stream_waits_for_legacy_stream),
      T(test_non_blocking_stream_does_not_sync_with_legacy),
      T(test_per_thread_stream_is_distinct_per_thread),
      T(test_ptsz_entry_points_take_null_as_the_per_thread_stream),
      T(test_destroying_a_pending_event_does_not_complete_its_work),
      T(test_destroying_an_event_twice_is_an_invalid_handle_and_counted),
      T(test_destroying_a_stream_with_pending_work_lets_it_finish),
      T(test_event_and_stream_of_different_contexts_are_refused),
      T(test_free_waits_for_queued_work_on_the_range),
      T(test_mem_get_info_counts_context_and_other_processes),
      T(test_host_registration_of_unmapped_pages_fails),
      T(test_unaligned_registrations_sharing_a_page_collide),
      T(test_host_registration_failures_as_the_driver_reports_them),
      T(test_an_injected_fault_fires_once),
      T(test_a_sticky_error_fails_every_later_call_of_the_context),
      T(test_releasing_the_primary_context_to_zero_clears_a_sticky_error),
      T(test_captured_work_is_not_executed_and_ends_in_a_graph),
      T(test_unsafe_calls_during_global_capture_invalidate_it),
      T(test_thread_capture_modes_decide_who_may_make_unsafe_calls),
      T(test_relaxed_capture_allows_unsafe_calls),
      T(test_synchronizing_a_capturing_stream_is_illegal),
      T(test_an_event_recorded_in_capture_cannot_be_queried),
      T(test_legacy_stream_use_during_blocking_capture_is_implicit),
      T(test_capture_ends_on_its_thread_and_stream_with_forks_joined),
      T(test_get_proc_address_answers_by_version_and_flags),
      T(test_driver_version_is_13_0),
      T(test_every_entry_point_counts_its_calls),
      T(test_stream_priorities_are_clamped_to_the_range),
      T(test_lazy_device_runs_work_only_while_waited_for),
      T(test_a_fork_child_runs_its_own_work),
      T(test_managed_memory_is_placed_only_by_a_prefetch),
      T(test_managed_prefetch_runs_in_stream_order),
      T(test_managed_advice_is_page_granular_and_checks_locations),
      T(test_managed_prefetch_past_free_memory_evicts_and_counts),
      T(test_managed_device_needs_concurrent_access),
      T(test_managed_entry_points_by_version),
      T(test_vmm_calls_take_granule_multiples),
      T(test_vmm_access_must_be_set_after_every_map),
      T(test_vmm_access_over_neighbouring_mappings),
      T(test_vmm_unmap_takes_whole_mappings),
      T(test_vmm_memory_lives_until_released_and_unmapped),
      T(test_vmm_unmap_under_queued_work_is_counted),
      T(test_vmm_unsupported_device_refuses_the_calls),
      T(test_device_uuid_needs_a_valid_device_and_an_out),
      /* issue 27 */
      T(test_ctx_set_current_replaces_the_top_of_the_stack),
      T(test_sync_copies_return_with_the_data),
      T(test_stream_ordered_allocations_charge_the_device),
      T(test_pools_take_device_props_and_outlive_their_destroy),
      T(test_pointer_attributes_and_ipc_handles_know_the_memory),
      T(test_queries_syncs_and_vmm_calls_are_unsafe_in_a_global_capture),
      T(test_another_threads_global_capture_forbids_a_global_threads_query),
      T(test_calls_are_charged_to_the_context_set_current),
      T(test_a_kernel_writes_its_range_when_it_ends),
      T(test_vmm_unmap_under_a_pending_kernel_is_counted),
      T(test_unordered_work_of_two_streams_on_one_range_is_counted),
  };
#undef T
  return cmocka_run_group_tests_name("fake_cuda", tests, NULL, NULL);
}

#else

int main(void) {
  printf("# fake_cuda: built without the CUDA headers: skipped\n");
  return 77;
}

#endif
