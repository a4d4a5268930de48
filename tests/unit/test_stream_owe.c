/*
 * test_stream_owe.c — memory a stream freed serves that stream's later
 * allocations of any size (issue 26, lib/tiers/pool/owe.c), on SGM_BACKEND=cuda
 * against the driver double in its lazy mode (work runs only while a host
 * thread waits for some: a fence is never seen complete by a query).
 *
 * Invariants checked:
 *  - one stream: blocks of several size classes freed on S, then other sizes
 *    on S whose total fits the freed bytes: committed VRAM does not grow and
 *    no event is recorded, queried, waited for or waited on;
 *  - two streams: memory S freed while S's kernel still writes it, handed
 *    back to the sub-allocator and then carved for T, reaches T only ordered
 *    after S's work (the double counts unordered work on one range:
 *    stream_races stays 0, and T's write lands last);
 *  - a trim or an idle trim after S returned memory with its kernel pending
 *    unmaps it only after that work (the double counts unmaps under queued
 *    work: vmm_unmaps_in_use stays 0), and does unmap it;
 *  - a carve that maps new granules takes S's bags back, not the calling
 *    thread's magazine: a block of a class freed on S before it is there
 *    afterwards, served again without the pool lock; when the budget is
 *    full, the magazine's blocks of S do go back and serve S's large block;
 *  - S owing and then capturing a graph: every capture stays valid, another
 *    stream is served from other memory while S captures (S's is set
 *    aside), and gets S's ordered after S once the capture ended;
 * and the pool's own check holds throughout.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_fixture.h"
#include "internal.h"
#include "test_util.h"
#include "tiers/pool/pool.h" /* vmm_held_peak */
#include "tiers/tier.h"

#define KiB (UINT64_C(1) << 10)
#define MiB (UINT64_C(1) << 20)

/* The double, loaded by the fixture's group setup (fake_fixture.h). */
#define fc sgm_fake_fc
#define fake_lib sgm_fake_lib

static fake_cuda_stats fake_stats(void) {
  fake_cuda_stats s;
  fc.fake_cuda_get_stats(&s);
  return s;
}

/* Every event call the double counts: records, queries, host waits, stream waits. */
static uint64_t event_calls(void) {
  return fc.fake_cuda_calls("cuEventRecord") + fc.fake_cuda_calls("cuEventQuery") +
         fc.fake_cuda_calls("cuEventSynchronize") + fc.fake_cuda_calls("cuStreamWaitEvent");
}

/* A kernel of the user's writing value over [p, p + n) on stream, queued
 * under device 0's primary context. */
static void kernel(void *stream, void *p, uint64_t n, int value) {
  sgm_fake_ctx_push(fake_lib);
  assert_int_equal(fc.fake_cuda_kernel(stream, p, n, value, 1), 0);
  sgm_fake_ctx_pop(fake_lib);
}

static uint64_t committed(sgm_context *ctx) {
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  return st.tier[SGM_TIER_VRAM].committed_bytes;
}

static bool overlaps(const void *a, uint64_t an, const void *b, uint64_t bn) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return x < y + bn && y < x + an;
}

/* A growth-mode context on the double with a VRAM budget of vram_limit, no
 * idle trim behind the test's back, the device lazy (the slowest legal one). */
static sgm_context *lazy_ctx_of(const char *vram_limit) {
  sgm_context *ctx = sgm_fake_sgm_context(vram_limit, false, "0");
  fc.fake_cuda_set_lazy(1);
  return ctx;
}

static sgm_context *lazy_ctx(void) { return lazy_ctx_of("512MiB"); }

static void finish(sgm_context *ctx, void **streams, size_t n) {
  fc.fake_cuda_set_lazy(0);
  fc.fake_cuda_settle();
  sgm_context_destroy(ctx);
  for (size_t i = 0; i < n; i++) sgm_fake_stream_destroy(fake_lib, streams[i]);
  assert_int_equal(fc.fake_cuda_live_allocations(), 0);
}

/* Allocate n blocks of size[i] on stream s into p[i] (each with a pending
 * kernel writing it when with_work), the pool's check after each; the bytes. */
static uint64_t alloc_all(sgm_context *ctx, void *s, const uint64_t *size, size_t n, void **p,
                          bool with_work) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; i++) {
    p[i] = sgm_alloc(ctx, size[i], s);
    assert_non_null(p[i]);
    if (with_work) kernel(s, p[i], size[i], (int)i);
    bytes += size[i];
    assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  }
  return bytes;
}

/* Invariant: one stream reuses what it freed for other sizes with no event
 * and no growth, whatever the device has finished. */
static void test_one_stream_reuses_freed_memory_for_other_sizes(void **state) {
  (void)state;
  sgm_context *ctx = lazy_ctx();
  sgm_tier_pool *vp = sgm__context_tier(ctx, SGM_TIER_VRAM);
  void *s = sgm_fake_non_blocking_stream(fake_lib);
  /* Several classes and large sizes: 48 MiB and a little in all. */
  static const uint64_t first[] = {3 * MiB,   5 * MiB,  12 * MiB, 768 * KiB, 512 * KiB,
                                   256 * KiB, 96 * KiB, 8 * MiB,  20 * MiB,  1 * MiB};
  enum { N1 = sizeof first / sizeof first[0] };
  void *p[N1];
  uint64_t freed = alloc_all(ctx, s, first, N1, p, true);
  for (size_t i = 0; i < N1; i++) assert_int_equal(sgm_free_ex(ctx, p[i], s), SGM_OK);
  uint64_t c0 = committed(ctx), e0 = event_calls();
  /* Other sizes (no class or large size of the first set), 3/4 of the bytes. */
  static const uint64_t second[] = {7 * MiB, 9 * MiB,  6 * MiB,  2560 * KiB, 640 * KiB,
                                    384 * KiB, 48 * KiB, 11 * MiB, 160 * KiB};
  enum { N2 = sizeof second / sizeof second[0] };
  void *q[N2];
  uint64_t asked = alloc_all(ctx, s, second, N2, q, false);
  assert_true(asked <= freed * 3 / 4);
  printf("# freed %llu MiB, asked %llu MiB: committed %llu -> %llu MiB, event calls %llu\n",
         (unsigned long long)(freed >> 20), (unsigned long long)(asked >> 20),
         (unsigned long long)(c0 >> 20), (unsigned long long)(committed(ctx) >> 20),
         (unsigned long long)(event_calls() - e0));
  assert_true(committed(ctx) <= c0);
  assert_int_equal(event_calls(), e0);
  for (size_t i = 0; i < N2; i++) assert_int_equal(sgm_free_ex(ctx, q[i], s), SGM_OK);
  assert_true(sgm__tier_check(vp));
  finish(ctx, &s, 1);
  assert_int_equal(fake_stats().vmm_unmaps_in_use, 0);
}

/* S frees two 4 MiB blocks its kernels still write, then allocates 1 MiB:
 * the carve needs a new granule, so S's blocks go back to the sub-allocator
 * (S owes) and the 1 MiB lands in the first (*a); the second's granules are
 * then free, its kernel pending. pin[2] are live blocks (freed by the caller)
 * that make the sub-allocator's best fit place the 1 MiB, and later 2 MiB,
 * in the hole the blocks left (docs/suballoc.md: blocks pile up from both
 * ends of the range). */
static void s_owes(sgm_context *ctx, void *s, void **a, void **b, void *pin[2]) {
  void *a2;
  *a = sgm_alloc(ctx, 4 * MiB, s);      /* the range's bottom */
  pin[0] = sgm_alloc(ctx, 4 * MiB, s);  /* its top */
  a2 = sgm_alloc(ctx, 4 * MiB, s);      /* above *a */
  pin[1] = sgm_alloc(ctx, 4 * MiB, s);  /* above a2 */
  assert_non_null(*a);
  assert_non_null(a2);
  assert_non_null(pin[0]);
  assert_non_null(pin[1]);
  kernel(s, *a, 4 * MiB, 1);
  kernel(s, a2, 4 * MiB, 1);
  assert_int_equal(sgm_free_ex(ctx, *a, s), SGM_OK);
  assert_int_equal(sgm_free_ex(ctx, a2, s), SGM_OK);
  uint64_t c0 = committed(ctx);
  *b = sgm_alloc(ctx, 1 * MiB, s);
  assert_non_null(*b);
  assert_true(overlaps(*a, 4 * MiB, *b, 1 * MiB)); /* reused by S at once */
  assert_int_equal(committed(ctx), c0);
}

static void free_all(sgm_context *ctx, void *s, void **p, size_t n) {
  for (size_t i = 0; i < n; i++) assert_int_equal(sgm_free_ex(ctx, p[i], s), SGM_OK);
}

/* Invariant: a carve that must map new granules gives the stream's bags back
 * (they coalesce) but leaves the calling thread's magazine alone, as the
 * emulated device's path does: a 64 KiB block freed on S is still cached
 * after S's large carve that maps, and the next 64 KiB allocation on S takes
 * it back with no pool lock. Returning the magazine there emptied every
 * class of a single-threaded churn about once every 120 carves, and each
 * class's next allocation carved under the lock (17% of the pairs of a
 * 64-block ring of 256 B-1 MiB took the slow path; 1.35-1.56e7 pairs/s against
 * 2.0-2.2e7 with the magazine kept, issue 26). */
static void test_a_carve_that_maps_keeps_the_threads_magazine(void **state) {
  (void)state;
  sgm_context *ctx = lazy_ctx();
  sgm_tier_pool *vp = sgm__context_tier(ctx, SGM_TIER_VRAM);
  void *s = sgm_fake_non_blocking_stream(fake_lib);
  void *small = sgm_alloc(ctx, 64 * KiB, s);
  assert_non_null(small);
  kernel(s, small, 64 * KiB, 1);
  assert_int_equal(sgm_free_ex(ctx, small, s), SGM_OK);
  uint64_t c0 = committed(ctx);
  void *big = sgm_alloc(ctx, 64 * MiB, s); /* past what is mapped: the carve maps */
  assert_non_null(big);
  assert_true(committed(ctx) > c0);
  uint64_t takes = sgm__lock_takes(&vp->lock);
  void *again = sgm_alloc(ctx, 64 * KiB, s);
  printf("# 64 KiB block %p, after the mapping carve %p, pool lock taken %llu times\n", small, again,
         (unsigned long long)(sgm__lock_takes(&vp->lock) - takes));
  assert_ptr_equal(again, small);
  assert_int_equal(sgm__lock_takes(&vp->lock), takes);
  assert_true(sgm__tier_check(vp));
  void *sp[] = {again, big};
  free_all(ctx, s, sp, 2);
  finish(ctx, &s, 1);
}

/* Invariant: the magazine is kept only while the carve could map: with the
 * budget full, S's class blocks in the calling thread's magazine go back to
 * the sub-allocator (they coalesce) and serve S's larger block there, with
 * no fallback to turn to (14 MiB of a 16 MiB budget while the magazine holds
 * 4 MiB). */
static void test_a_full_budget_takes_the_threads_magazine_back(void **state) {
  (void)state;
  sgm_context *ctx = lazy_ctx_of("16MiB");
  sgm_tier_pool *vp = sgm__context_tier(ctx, SGM_TIER_VRAM);
  void *s = sgm_fake_non_blocking_stream(fake_lib);
  enum { N = 48 }; /* 12 MiB of 256 KiB blocks: at most 4 MiB of them fit a magazine's class */
  void *p[N];
  for (int i = 0; i < N; i++) {
    p[i] = sgm_alloc(ctx, 256 * KiB, s);
    assert_non_null(p[i]);
    kernel(s, p[i], 256 * KiB, i);
  }
  for (int i = 0; i < N; i++) assert_int_equal(sgm_free_ex(ctx, p[i], s), SGM_OK);
  void *big = sgm_alloc(ctx, 14 * MiB, s);
  printf("# 14 MiB after 48 x 256 KiB freed on the stream: %p (%s)\n", big,
         big ? "served" : sgm_last_error());
  assert_non_null(big);
  assert_true(sgm__tier_check(vp));
  free_all(ctx, s, &big, 1);
  finish(ctx, &s, 1);
}

/* Invariant: memory S returned with its work pending reaches another stream
 * only ordered after that work (no race the double can see), and T's later
 * carves while S owes nothing new cost no driver call. */
static void test_other_stream_ordered_after_returned_memory(void **state) {
  (void)state;
  sgm_context *ctx = lazy_ctx();
  sgm_tier_pool *vp = sgm__context_tier(ctx, SGM_TIER_VRAM);
  void *st[2] = {sgm_fake_non_blocking_stream(fake_lib), sgm_fake_non_blocking_stream(fake_lib)};
  void *s = st[0], *t = st[1];
  fake_cuda_stats f0 = fake_stats();
  void *a, *b, *pin[2];
  s_owes(ctx, s, &a, &b, pin);
  void *c = sgm_alloc(ctx, 2 * MiB, t); /* the rest of S's block */
  assert_non_null(c);
  assert_true(overlaps(a, 4 * MiB, c, 2 * MiB));
  kernel(t, c, 2 * MiB, 2);
  assert_int_equal(fake_stats().stream_races, f0.stream_races);
  uint64_t calls = fake_stats().calls;
  void *d = sgm_alloc(ctx, 256 * KiB, t); /* T is ordered after S already */
  assert_non_null(d);
  assert_int_equal(fake_stats().calls, calls);
  assert_true(sgm__tier_check(vp));
  fc.fake_cuda_settle(); /* lazy: runs everything, in the order the streams allow */
  assert_int_equal(((unsigned char *)c)[12345], 2); /* T's write after S's */
  void *sp[] = {b, pin[0], pin[1]}, *tp[] = {c, d};
  free_all(ctx, s, sp, 3);
  free_all(ctx, t, tp, 2);
  finish(ctx, st, 2);
  assert_int_equal(fake_stats().stream_races, f0.stream_races);
}

/* After S returned memory with its kernel pending (s_owes), a trim (idle:
 * the idle trim, which unmaps without a reclaim first; else sgm_trim) waits
 * for that work before it unmaps, and unmaps the free granules. */
static void trim_after_return(bool idle) {
  sgm_context *ctx = lazy_ctx();
  sgm_tier_pool *vp = sgm__context_tier(ctx, SGM_TIER_VRAM);
  void *s = sgm_fake_non_blocking_stream(fake_lib);
  fake_cuda_stats f0 = fake_stats();
  void *a, *b, *pin[2];
  s_owes(ctx, s, &a, &b, pin);
  uint64_t c0 = committed(ctx);
  if (idle) {
    sgm__tier_idle_trim(vp, 10, 1);
    sgm__tier_idle_trim(vp, 20, 1);
  } else {
    assert_int_equal(sgm_trim(ctx), SGM_OK);
  }
  assert_int_equal(fake_stats().vmm_unmaps_in_use, f0.vmm_unmaps_in_use);
  assert_true(committed(ctx) <= c0 - 4 * MiB); /* the second block's granules went back */
  assert_true(sgm__tier_check(vp));
  void *sp[] = {b, pin[0], pin[1]};
  free_all(ctx, s, sp, 3);
  finish(ctx, &s, 1);
  assert_int_equal(fake_stats().vmm_unmaps_in_use, f0.vmm_unmaps_in_use);
}

/* Invariant: sgm_trim after S returned memory with its kernel pending unmaps
 * only after that work. */
static void test_trim_after_return_waits_for_the_work(void **state) {
  (void)state;
  trim_after_return(false);
}

/* Invariant: the idle trim likewise. */
static void test_idle_trim_after_return_waits_for_the_work(void **state) {
  (void)state;
  trim_after_return(true);
}

typedef int (*begin_capture_fn)(void *stream, int mode);
typedef int (*end_capture_fn)(void *stream, void **graph);
typedef int (*graph_destroy_fn)(void *graph);

/* Invariant: a stream that owes and then captures a graph (sgm cannot record
 * on it, nor learn that before it tries) keeps every capture valid; while
 * it captures, another stream is served from memory it did not return (the
 * block that landed on its memory is set aside and placed again); once the
 * capture ended, the other stream gets that memory ordered after it (no race). */
static void test_owing_stream_that_captures(void **state) {
  (void)state;
  begin_capture_fn begin = (begin_capture_fn)sgm_fake_need(fake_lib, "cuStreamBeginCapture_v2");
  end_capture_fn end = (end_capture_fn)sgm_fake_need(fake_lib, "cuStreamEndCapture");
  graph_destroy_fn gdestroy = (graph_destroy_fn)sgm_fake_need(fake_lib, "cuGraphDestroy");
  assert_true(begin && end && gdestroy);
  sgm_context *ctx = lazy_ctx();
  sgm_tier_pool *vp = sgm__context_tier(ctx, SGM_TIER_VRAM);
  void *st[2] = {sgm_fake_non_blocking_stream(fake_lib), sgm_fake_non_blocking_stream(fake_lib)};
  void *s = st[0], *t = st[1];
  fake_cuda_stats f0 = fake_stats();
  void *a = sgm_alloc(ctx, 4 * MiB, s), *pin[2] = {sgm_alloc(ctx, 4 * MiB, s), NULL};
  void *a2 = sgm_alloc(ctx, 4 * MiB, s);
  pin[1] = sgm_alloc(ctx, 4 * MiB, s);
  assert_true(a && a2 && pin[0] && pin[1]);
  kernel(s, a, 4 * MiB, 1);
  kernel(s, a2, 4 * MiB, 1);
  assert_int_equal(sgm_free_ex(ctx, a, s), SGM_OK);
  assert_int_equal(sgm_free_ex(ctx, a2, s), SGM_OK);
  sgm_fake_ctx_push(fake_lib);
  assert_int_equal(begin(s, 0 /* GLOBAL */), 0);
  void *b = sgm_alloc(ctx, 1 * MiB, s); /* S's own cache, for another size: graph order */
  assert_non_null(b);
  assert_true(overlaps(a, 8 * MiB, b, 1 * MiB));
  void *c = sgm_alloc(ctx, 2 * MiB, t); /* placed elsewhere: S's memory set aside */
  assert_non_null(c);
  assert_false(overlaps(a, 8 * MiB, c, 2 * MiB));
  uint64_t peak = vp->vmm_held_peak;
  assert_true(peak > vp->held_bytes); /* four 4 MiB blocks were live */
  assert_int_equal(sgm_trim(ctx), SGM_OK); /* no query, no wait, no unmap under S's work */
  /* S's returned granules are still mapped, free: the peak has not ended
   * (growth keeps the mappings within it until a trim unmaps them all). */
  assert_true(sgm__tier_vmm_free_mapped(vp) > 0);
  assert_int_equal(vp->vmm_held_peak, peak);
  void *g = NULL;
  assert_int_equal(end(s, &g), 0); /* the capture stayed valid */
  assert_non_null(g);
  assert_int_equal(gdestroy(g), 0);
  sgm_fake_ctx_pop(fake_lib);
  assert_int_equal(sgm_free_ex(ctx, c, t), SGM_OK);
  c = sgm_alloc(ctx, 3 * MiB, t); /* S's memory (best fit), ordered after S now */
  assert_non_null(c);
  assert_true(overlaps(a, 8 * MiB, c, 3 * MiB));
  kernel(t, c, 3 * MiB, 2);
  assert_int_equal(fake_stats().stream_races, f0.stream_races);
  assert_int_equal(fake_stats().vmm_unmaps_in_use, f0.vmm_unmaps_in_use);
  assert_true(sgm__tier_check(vp));
  void *sp[] = {b, pin[0], pin[1]};
  free_all(ctx, s, sp, 3);
  free_all(ctx, t, &c, 1);
  finish(ctx, st, 2);
}

static int reset_fake(void **state) {
  (void)state;
  fc.fake_cuda_reset();
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_one_stream_reuses_freed_memory_for_other_sizes, reset_fake),
      cmocka_unit_test_setup(test_other_stream_ordered_after_returned_memory, reset_fake),
      cmocka_unit_test_setup(test_trim_after_return_waits_for_the_work, reset_fake),
      cmocka_unit_test_setup(test_idle_trim_after_return_waits_for_the_work, reset_fake),
      cmocka_unit_test_setup(test_owing_stream_that_captures, reset_fake),
      cmocka_unit_test_setup(test_a_carve_that_maps_keeps_the_threads_magazine, reset_fake),
      cmocka_unit_test_setup(test_a_full_budget_takes_the_threads_magazine_back, reset_fake),
  };
  return sgm_fake_run_suite("stream_owe", "fake_cuda_kernel", tests, sizeof tests / sizeof tests[0],
                            sgm_fake_group_setup, sgm_fake_group_teardown);
}
