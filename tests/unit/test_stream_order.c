/*
 * test_stream_order.c — the stream-ordered free rule on SGM_BACKEND=cuda
 * against the driver test double (tests/support/fake_cuda), whose events stay
 * pending until the test completes them: a block freed on stream A is
 * reusable at once by work on A with no driver call, and by work on B only
 * ordered after A's work (an event on A that B waits for on the device); the
 * NULL stream and per-thread streams are streams like the others; concurrent
 * reclaims own each event once; sgm_record_stream delays reuse; the
 * context's driver-call count agrees with the double's.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_fixture.h"
#include "internal.h"
#include "tiers/tier.h"
#include "test_util.h"

#define MiB (UINT64_C(1) << 20)

static sgm_fake_control fc;
static void *fake_lib;

/* A real driver has no control API: this suite is for the double only. */
static int load_fake(void **state) {
  (void)state;
  fake_lib = sgm_fake_load(&fc);
  return fake_lib ? 0 : -1;
}

static int unload_fake(void **state) {
  (void)state;
  if (fake_lib) dlclose(fake_lib);
  return 0;
}

/* Driver entry points the test calls itself, to put its own work on streams
 * (the names the double exports: cuda.h's macros add the _v2). */
typedef int (*event_create_fn)(void **ev, unsigned flags);
typedef int (*event_record_fn)(void *ev, void *stream);
typedef int (*event_query_fn)(void *ev);
typedef int (*event_destroy_fn)(void *ev);
#define CUDA_SUCCESS_ 0
#define CUDA_ERROR_NOT_READY_ 600

/* A VRAM budget of `limit` reserved as one range, no fallback. */
static sgm_context *make_ctx_limit(const char *limit) {
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_VRAM_LIMIT", limit, 1);
  setenv("SGM_ALLOW_GROWTH", "off", 1);
  setenv("SGM_SHARED_FALLBACK", "off", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1); /* no background reclaim: the tests count calls */
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fprintf(stderr, "create: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  return ctx;
}

/* A 4 MiB VRAM budget: one block fills it. */
static sgm_context *make_ctx(void) { return make_ctx_limit("4MiB"); }

static uint64_t driver_calls(void) {
  fake_cuda_stats fs;
  fc.fake_cuda_get_stats(&fs);
  return fs.calls;
}

/* An event of the test's own recorded on stream, under device 0's primary
 * context (pushed for the call): with query, has all work queued there so far
 * completed (the double's worker first runs what can run; held work stays)?
 * Without, the record is the test's own work on the stream (held while the
 * stream is held), standing for a kernel the user queued. */
static bool record_on(void *stream, bool query) {
#define LOOKUP(type, name) type name##_ = (type)dlsym(fake_lib, #name); assert_non_null(name##_)
  LOOKUP(event_create_fn, cuEventCreate);
  LOOKUP(event_record_fn, cuEventRecord);
  LOOKUP(event_query_fn, cuEventQuery);
  LOOKUP(event_destroy_fn, cuEventDestroy_v2);
#undef LOOKUP
  void *ev = NULL;
  sgm_fake_ctx_push(fake_lib);
  assert_int_equal(cuEventCreate_(&ev, 2 /* CU_EVENT_DISABLE_TIMING */), CUDA_SUCCESS_);
  assert_int_equal(cuEventRecord_(ev, stream), CUDA_SUCCESS_);
  int q = CUDA_SUCCESS_;
  if (query) {
    fc.fake_cuda_settle();
    q = cuEventQuery_(ev);
    assert_true(q == CUDA_SUCCESS_ || q == CUDA_ERROR_NOT_READY_);
  }
  assert_int_equal(cuEventDestroy_v2_(ev), CUDA_SUCCESS_); /* recorded work goes on */
  sgm_fake_ctx_pop(fake_lib);
  return q == CUDA_SUCCESS_;
}

static bool stream_done(void *stream) { return record_on(stream, true); }
static void put_work(void *stream) { (void)record_on(stream, false); }

/* A CU_STREAM_NON_BLOCKING stream (the legacy stream does not order it), or
 * with destroy, s destroyed. */
static void *non_blocking_stream(bool destroy, void *s) {
  if (!destroy) return sgm_fake_non_blocking_stream(fake_lib);
  sgm_fake_stream_destroy(fake_lib, s);
  return s;
}

static void finish_ctx(sgm_context *ctx) {
  fc.fake_cuda_hold_events(0);
  fc.fake_cuda_complete_events();
  sgm_context_destroy(ctx);
  fake_cuda_stats fs;
  fc.fake_cuda_get_stats(&fs);
  assert_int_equal(fs.events, 0);
  assert_int_equal(fc.fake_cuda_live_allocations(), 0);
}

/* Invariants: a block freed on stream A while A's work is pending is taken
 * back by A at once; stream B gets it only ordered after A's work (work B
 * queues after the allocation does not complete before A's); a pending block
 * is not live: freeing it again is a double free, sgm_pointer_tier says NONE. */
static void test_two_streams(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  fc.fake_cuda_hold_stream(a, 1);
  void *p = sgm_alloc(ctx, 4 * MiB, a);
  assert_non_null(p);
  assert_int_equal(sgm_free_ex(ctx, p, a), SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, p), SGM_TIER_NONE);
  assert_int_equal(sgm_free_ex(ctx, p, a), SGM_ERR_INVALID); /* double free while pending */

  void *again = sgm_alloc(ctx, 4 * MiB, a); /* A may reuse at once */
  assert_ptr_equal(again, p);
  assert_int_equal(sgm_free_ex(ctx, again, a), SGM_OK);
  assert_false(stream_done(a));

  void *q = sgm_alloc(ctx, 4 * MiB, b); /* B gets it behind A's work */
  assert_ptr_equal(q, p);
  assert_false(stream_done(b));
  fc.fake_cuda_complete_stream(a);
  assert_true(stream_done(b));
  fc.fake_cuda_hold_stream(a, 0);
  assert_int_equal(sgm_free_ex(ctx, q, b), SGM_OK);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.n_bad_frees, 1);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
}

/* Invariant (the defect "memory in use handed to another stream"): blocks
 * freed on A while A's work is pending never reach another stream unordered,
 * also after A itself reclaimed under pressure. Two 4 MiB blocks in 8 MiB,
 * both freed on held A; A takes one back; B's allocation of the other must
 * leave B's later work waiting for A's. */
static void test_pending_memory_not_handed_out(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx_limit("8MiB");
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *x = sgm_alloc(ctx, 4 * MiB, a), *y = sgm_alloc(ctx, 4 * MiB, a);
  assert_non_null(x);
  assert_non_null(y);
  fc.fake_cuda_hold_stream(a, 1);
  put_work(a); /* A's kernels, still running when the blocks are freed */
  assert_int_equal(sgm_free_ex(ctx, x, a), SGM_OK);
  assert_int_equal(sgm_free_ex(ctx, y, a), SGM_OK);
  void *ra = sgm_alloc(ctx, 4 * MiB, a);
  assert_true(ra == x || ra == y);
  void *rb = sgm_alloc(ctx, 4 * MiB, b);
  assert_true(rb == x || rb == y);
  assert_ptr_not_equal(ra, rb);
  assert_false(stream_done(b)); /* B's work waits for A's */
  fc.fake_cuda_complete_stream(a);
  assert_true(stream_done(b));
  fc.fake_cuda_hold_stream(a, 0);
  sgm_free(ctx, ra, a);
  sgm_free(ctx, rb, b);
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
}

/* Invariant: steady-state alloc+free pairs on one stream make no driver call:
 * on a created stream, the legacy NULL stream and a per-thread stream. */
static void test_same_stream_reuse_no_driver_calls(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx_limit("64MiB");
  void *created = fc.fake_cuda_stream_create();
  void *streams[] = {created, NULL, (void *)(uintptr_t)0x2 /* CU_STREAM_PER_THREAD */};
  fc.fake_cuda_hold_events(1); /* the streams stay busy */
  for (size_t s = 0; s < 3; s++) {
    void *first = sgm_alloc(ctx, 1 * MiB, streams[s]);
    assert_non_null(first);
    sgm_free(ctx, first, streams[s]);
    uint64_t before = driver_calls();
    for (int i = 0; i < 100; i++) {
      void *p = sgm_alloc(ctx, 1 * MiB, streams[s]);
      assert_ptr_equal(p, first); /* reused at once on its own stream */
      assert_int_equal(sgm_free_ex(ctx, p, streams[s]), SGM_OK);
    }
    assert_int_equal(driver_calls() - before, 0);
  }
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(created);
}

/* Invariant: the context's own count of driver calls (sgm_stats.driver_calls,
 * "driver_calls" in the stats JSON) is the double's count over the context's
 * life: create, growth, pairs on three streams, transfers, a trim. */
static void test_stats_count_driver_calls(void **state) {
  (void)state;
  fc.fake_cuda_reset(); /* the double counts from here; the context from create */
  sgm_context *ctx = make_ctx_limit("8MiB");
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *streams[] = {a, b, NULL, (void *)(uintptr_t)0x2 /* CU_STREAM_PER_THREAD */};
  for (int i = 0; i < 40; i++) {
    void *s = streams[i % 4];
    void *p = sgm_alloc(ctx, (i % 3 + 1) * MiB, s);
    assert_non_null(p);
    assert_int_equal(sgm_free_ex(ctx, p, s), SGM_OK);
  }
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_true(st.driver_calls > 0);
  assert_int_equal(st.driver_calls, driver_calls());
  char *json = NULL, want[64];
  assert_int_equal(sgm_stats_json(ctx, &json), SGM_OK);
  snprintf(want, sizeof want, "\"driver_calls\":%llu,", (unsigned long long)st.driver_calls);
  if (!strstr(json, want)) fail_msg("no %s in %s", want, json);
  sgm_string_free(json);
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
}

/* Invariant: taking another stream's cached blocks costs at most two driver
 * calls between blocking streams, once for all the blocks that stream holds:
 * one capture probe of the legacy stream (which answers for every blocking
 * stream) and one event recorded on the legacy stream, which the driver
 * orders after the owner's work and before the taker's. */
static void test_cross_stream_transfer_calls(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx_limit("8MiB");
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  fc.fake_cuda_hold_events(1);
  for (int round = 0; round < 3; round++) {
    void *owner = round % 2 ? b : a, *taker = round % 2 ? a : b;
    void *x = sgm_alloc(ctx, 4 * MiB, owner), *y = sgm_alloc(ctx, 4 * MiB, owner);
    assert_non_null(x);
    assert_non_null(y);
    sgm_free(ctx, x, owner);
    sgm_free(ctx, y, owner);
    uint64_t before = driver_calls();
    void *p = sgm_alloc(ctx, 4 * MiB, taker), *q = sgm_alloc(ctx, 4 * MiB, taker);
    assert_non_null(p);
    assert_non_null(q);
    uint64_t calls = driver_calls() - before;
    /* cuStreamIsCapturing(CU_STREAM_LEGACY) and cuEventRecord on the legacy
     * stream; round 0 also creates the pooled event (cuCtxGetCurrent first:
     * an event belongs to the context current then, issue 24) and learns both
     * streams' flags (cuStreamGetFlags, once per stream). */
    if (round > 0) assert_int_equal(calls, 2);
    else assert_true(calls <= 6);
    assert_int_equal(fc.fake_cuda_calls("cuEventCreate") > 0, 1);
    sgm_free(ctx, p, taker);
    sgm_free(ctx, q, taker);
  }
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
}

/* Invariant: a CU_STREAM_NON_BLOCKING stream is not ordered by the legacy
 * stream, so blocks cross between it and the legacy stream only through an
 * event recorded on the owner and waited for by the taker (each stream asked
 * whether it captures first): the taker's later work waits for the owner's. */
static void test_non_blocking_transfer_ordered(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *nb = non_blocking_stream(false, NULL);
  void *warm = sgm_alloc(ctx, 4 * MiB, NULL);
  sgm_free(ctx, warm, NULL);
  warm = sgm_alloc(ctx, 4 * MiB, nb); /* learns nb's flags, warms the event pool */
  assert_non_null(warm);
  fc.fake_cuda_hold_stream(nb, 1);
  put_work(nb);
  sgm_free(ctx, warm, nb);
  uint64_t before = driver_calls();
  uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");
  void *p = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_ptr_equal(p, warm);
  assert_int_equal(driver_calls() - before, 4);
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 1);
  assert_false(stream_done(NULL)); /* the legacy stream waits for nb's work */
  fc.fake_cuda_complete_stream(nb);
  fc.fake_cuda_hold_stream(nb, 0);
  assert_true(stream_done(NULL));
  sgm_free(ctx, p, NULL);
  finish_ctx(ctx);
  non_blocking_stream(true, nb);
}

/* Invariant: blocks a fence covers (an event recorded on their stream after
 * their frees, here by the idle tick) cross to another stream, whatever the
 * streams' flags, in two driver calls: the taker's capture check and its
 * cuStreamWaitEvent on that fence, nothing recorded. The taker's later work
 * still waits for the owner's work queued before the free. */
static void test_fenced_transfer_two_calls_ordered(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *nb = non_blocking_stream(false, NULL), *taker = non_blocking_stream(false, NULL);
  for (int round = 0; round < 2; round++) {
    void *owner = round ? taker : nb, *to = round ? nb : taker;
    void *p = sgm_alloc(ctx, 4 * MiB, owner); /* round 0: learns the flags, warms the pool */
    assert_non_null(p);
    fc.fake_cuda_hold_stream(owner, 1);
    put_work(owner);
    sgm_free(ctx, p, owner);
    sgm__context_idle_tick(ctx); /* seals owner's cache under a fence (not complete: held) */
    uint64_t before = driver_calls();
    uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");
    uint64_t records = fc.fake_cuda_calls("cuEventRecord");
    void *q = sgm_alloc(ctx, 4 * MiB, to);
    assert_ptr_equal(q, p);
    assert_int_equal(driver_calls() - before, 2);
    assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 1);
    assert_int_equal(fc.fake_cuda_calls("cuEventRecord") - records, 0);
    assert_false(stream_done(to)); /* the taker waits for the owner's work */
    fc.fake_cuda_complete_stream(owner);
    fc.fake_cuda_hold_stream(owner, 0);
    assert_true(stream_done(to));
    sgm_free(ctx, q, to);
  }
  finish_ctx(ctx);
  non_blocking_stream(true, nb);
  non_blocking_stream(true, taker);
}

/* Driver calls since `before`, less the one-time ones (cuStreamGetFlags: a
 * stream's flags learned once; cuEventCreate: the event pool growing, each
 * after a cuCtxGetCurrent, as an event belongs to the context current then). */
typedef struct call_mark {
  uint64_t all, flags, creates, records, waits;
} call_mark;

static call_mark mark_calls(void) {
  return (call_mark){driver_calls(), fc.fake_cuda_calls("cuStreamGetFlags"),
                     fc.fake_cuda_calls("cuEventCreate"), fc.fake_cuda_calls("cuEventRecord"),
                     fc.fake_cuda_calls("cuStreamWaitEvent")};
}

static void assert_calls_since(call_mark m, uint64_t calls, uint64_t records, uint64_t waits) {
  call_mark now = mark_calls();
  assert_int_equal(now.all - m.all - (now.flags - m.flags) - 2 * (now.creates - m.creates), calls);
  assert_int_equal(now.records - m.records, records);
  assert_int_equal(now.waits - m.waits, waits);
}

/* The owner's held work completes and is released: the taker's work queued
 * after its allocation had not completed before, and has now (it was
 * ordered after the owner's work on the device). */
static void release_owner_ordered(void *owner, void *taker) {
  assert_false(stream_done(taker));
  fc.fake_cuda_complete_stream(owner);
  fc.fake_cuda_hold_stream(owner, 0);
  assert_true(stream_done(taker));
}

/* 2 MiB (large: only a 2 MiB request takes it), 1 MiB and 768 KiB (size
 * classes): 3.75 of the 4 MiB budget, allocated on a into blk. */
static void alloc_three(sgm_context *ctx, void *a, void *blk[3]) {
  const uint64_t sizes[3] = {2 * MiB, MiB, 768 << 10};
  for (int i = 0; i < 3; i++) assert_non_null(blk[i] = sgm_alloc(ctx, sizes[i], a));
}

/* blk freed on a after work of a's own that stays pending (a held). */
static void free_three_held(sgm_context *ctx, void *a, void *blk[3]) {
  fc.fake_cuda_hold_stream(a, 1);
  put_work(a);
  for (int i = 0; i < 3; i++) sgm_free(ctx, blk[i], a);
}

/* Invariants (seal on transfer, non-blocking streams): a transfer that must
 * record on the owner (4 calls) makes that record the owner's fence over
 * every block the owner holds, and moves only the blocks that serve the
 * taker's request; the owner's other blocks then cross in 2 calls (the
 * taker's check and one wait, nothing recorded), and the owner reuses them
 * with none. A block the owner frees after that fence never crosses under
 * it: its transfer records again, after the owner's later work. Each time
 * the taker's later work waits for the owner's work queued before the free. */
static void test_seal_on_transfer_non_blocking(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *a = non_blocking_stream(false, NULL), *b = non_blocking_stream(false, NULL);
  void *c = non_blocking_stream(false, NULL);
  /* 2 MiB (large: only a 2 MiB request takes it), 1 MiB and 768 KiB (size
   * classes): 3.75 of the 4 MiB budget, so that each request of b below
   * fits only in a's cache. */
  void *x = sgm_alloc(ctx, 2 * MiB, a), *y = sgm_alloc(ctx, MiB, a), *z = sgm_alloc(ctx, 768 << 10, a);
  assert_true(x && y && z);
  fc.fake_cuda_hold_stream(a, 1);
  put_work(a);
  sgm_free(ctx, x, a);
  sgm_free(ctx, y, a);
  sgm_free(ctx, z, a);

  call_mark m = mark_calls();
  void *p = sgm_alloc(ctx, 2 * MiB, b);
  assert_ptr_equal(p, x);
  assert_calls_since(m, 4, 1, 1); /* a's check and record, b's check and wait */
  assert_false(stream_done(b));
  /* y was sealed under that record: another taker c needs its own side only. */
  m = mark_calls();
  void *q = sgm_alloc(ctx, MiB, c);
  assert_ptr_equal(q, y);
  assert_calls_since(m, 2, 0, 1);
  assert_false(stream_done(c));
  fc.fake_cuda_complete_stream(a); /* a's work and its fence complete; a stays held */
  assert_true(stream_done(b));
  assert_true(stream_done(c));

  /* a reuses z, sealed under the (now complete) fence, with no call; its
   * later work is held; freed again, z is not covered by that fence. */
  m = mark_calls();
  void *r = sgm_alloc(ctx, 768 << 10, a);
  assert_ptr_equal(r, z);
  assert_calls_since(m, 0, 0, 0);
  put_work(a);
  sgm_free(ctx, r, a);
  m = mark_calls();
  void *w = sgm_alloc(ctx, 768 << 10, b);
  assert_ptr_equal(w, z);
  assert_calls_since(m, 4, 1, 1); /* recorded again, after a's later work */
  assert_false(stream_done(b));
  fc.fake_cuda_complete_stream(a);
  fc.fake_cuda_hold_stream(a, 0);
  assert_true(stream_done(b));

  sgm_free(ctx, p, b);
  sgm_free(ctx, q, c);
  sgm_free(ctx, w, b);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  finish_ctx(ctx);
  non_blocking_stream(true, a);
  non_blocking_stream(true, b);
  non_blocking_stream(true, c);
}

/* Invariant: between two blocking streams the transfer's record on the
 * legacy stream (which the driver puts after the owner's work) becomes the
 * owner's fence too: a non-blocking stream then takes the owner's other
 * blocks in 2 calls, and its later work waits for the owner's. */
static void test_seal_on_transfer_blocking_fence(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *c = non_blocking_stream(false, NULL);
  /* z stays live: the 4 MiB budget is full but for 256 KiB. */
  void *x = sgm_alloc(ctx, 2 * MiB, a), *y = sgm_alloc(ctx, MiB, a), *z = sgm_alloc(ctx, 768 << 10, a);
  assert_true(x && y && z);
  fc.fake_cuda_hold_stream(a, 1);
  put_work(a);
  sgm_free(ctx, x, a);
  sgm_free(ctx, y, a);
  call_mark m = mark_calls();
  void *p = sgm_alloc(ctx, 2 * MiB, b);
  assert_ptr_equal(p, x);
  assert_calls_since(m, 2, 1, 0); /* the legacy probe and the record there */
  m = mark_calls();
  void *q = sgm_alloc(ctx, MiB, c);
  assert_ptr_equal(q, y);
  assert_calls_since(m, 2, 0, 1); /* c's check and its wait on that record */
  assert_false(stream_done(c));
  fc.fake_cuda_complete_stream(a);
  fc.fake_cuda_hold_stream(a, 0);
  assert_true(stream_done(c));
  sgm_free(ctx, p, b);
  sgm_free(ctx, q, c);
  sgm_free(ctx, z, a);
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
  non_blocking_stream(true, c);
}

/* Invariant (a burst): a taker that comes back to an owner under the fence
 * its previous transfer crossed under takes all the blocks it covers (2
 * calls), so a burst of sizes costs the owner's side once and the taker's
 * side twice, not once per size; ordered after the owner's work. */
static void test_seal_on_transfer_burst(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *a = non_blocking_stream(false, NULL), *b = non_blocking_stream(false, NULL), *blk[3];
  alloc_three(ctx, a, blk);
  free_three_held(ctx, a, blk);
  void *x = blk[0], *y = blk[1], *z = blk[2];
  call_mark m = mark_calls();
  void *p = sgm_alloc(ctx, 2 * MiB, b);
  assert_ptr_equal(p, x);
  assert_calls_since(m, 4, 1, 1);
  m = mark_calls();
  void *q = sgm_alloc(ctx, MiB, b);
  assert_ptr_equal(q, y);
  assert_calls_since(m, 2, 0, 1);
  m = mark_calls();
  void *r = sgm_alloc(ctx, 768 << 10, b); /* z came with y: b's own cache */
  assert_ptr_equal(r, z);
  assert_calls_since(m, 0, 0, 0);
  release_owner_ordered(a, b);
  sgm_free(ctx, p, b);
  sgm_free(ctx, q, b);
  sgm_free(ctx, r, b);
  finish_ctx(ctx);
  non_blocking_stream(true, a);
  non_blocking_stream(true, b);
}

/* Invariant (recent sizes): a transfer hands the taker, beside the blocks
 * that serve its request, the owner's blocks of the sizes the taker itself
 * took from its caches lately, and no others: a taker that used 1 MiB takes
 * the owner's 1 MiB block with its 2 MiB one (its next 1 MiB request makes no
 * call), and the owner keeps its 768 KiB block (reused with none); the
 * taker's later work waits for the owner's. */
static void test_transfer_takes_recent_sizes(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *a = non_blocking_stream(false, NULL), *b = non_blocking_stream(false, NULL);
  /* The budget nearly full: b's 1 MiB request crosses from a's cache; then
   * a takes it back the same way. */
  void *blk[3];
  alloc_three(ctx, a, blk);
  void *x = blk[0], *y = blk[1], *z = blk[2];
  sgm_free(ctx, y, a);
  assert_ptr_equal(sgm_alloc(ctx, MiB, b), y);
  sgm_free(ctx, y, b);
  assert_ptr_equal(sgm_alloc(ctx, MiB, a), y);
  free_three_held(ctx, a, blk);

  call_mark m = mark_calls();
  void *p = sgm_alloc(ctx, 2 * MiB, b);
  assert_ptr_equal(p, x);
  assert_calls_since(m, 4, 1, 1);
  m = mark_calls();
  void *q = sgm_alloc(ctx, MiB, b); /* came with x: b took 1 MiB lately */
  assert_ptr_equal(q, y);
  assert_calls_since(m, 0, 0, 0);
  m = mark_calls();
  void *r = sgm_alloc(ctx, 768 << 10, a); /* b never took 768 KiB: still a's */
  assert_ptr_equal(r, z);
  assert_calls_since(m, 0, 0, 0);
  release_owner_ordered(a, b);
  sgm_free(ctx, p, b);
  sgm_free(ctx, q, b);
  sgm_free(ctx, r, a);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  finish_ctx(ctx);
  non_blocking_stream(true, a);
  non_blocking_stream(true, b);
}

/* Invariant (a burst in the steady state): two non-blocking streams that in
 * turn take the same three sizes from each other's cache move all three at
 * the first transfer of a round once each has taken them before: 4 calls per
 * round (the owner's check and record, the taker's check and wait), and
 * each round's later work waits for the other stream's. */
static void test_burst_steady_state_four_calls(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *st[2] = {non_blocking_stream(false, NULL), non_blocking_stream(false, NULL)};
  for (int round = 0; round < 6; round++) {
    void *s = st[round & 1], *o = st[!(round & 1)], *blk[3];
    call_mark m = mark_calls();
    alloc_three(ctx, s, blk);
    /* Rounds 0-1 carve or cross by size (no sizes known yet); from round 3
     * on, each taker has taken all three sizes in its previous round. */
    if (round >= 3) assert_calls_since(m, 4, 1, 1);
    if (round >= 1) release_owner_ordered(o, s);
    free_three_held(ctx, s, blk);
  }
  fc.fake_cuda_complete_stream(st[1]); /* the last round's */
  fc.fake_cuda_hold_stream(st[1], 0);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  finish_ctx(ctx);
  non_blocking_stream(true, st[0]);
  non_blocking_stream(true, st[1]);
}

/* Invariant: a transfer asks nothing of an owner whose cached blocks cannot
 * serve the request (no driver call for it), and leaves those blocks with
 * their stream. */
static void test_transfer_skips_owner_without_fit(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *a = non_blocking_stream(false, NULL), *b = non_blocking_stream(false, NULL);
  void *x = sgm_alloc(ctx, 3 * MiB, a);
  assert_non_null(x);
  fc.fake_cuda_hold_stream(a, 1); /* a's work (and any fence on a) stays pending */
  put_work(a);
  sgm_free(ctx, x, a);
  uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");
  /* x (3 MiB) cannot serve 2 MiB and only 1 MiB is free: nothing crosses (a
   * fence may be recorded on a, to see whether x is done: it is not). */
  assert_null(sgm_alloc(ctx, 2 * MiB, b));
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 0);
  call_mark m = mark_calls();
  assert_ptr_equal(sgm_alloc(ctx, 3 * MiB, a), x); /* still a's, at once */
  assert_calls_since(m, 0, 0, 0);
  sgm_free(ctx, x, a);
  fc.fake_cuda_complete_stream(a);
  fc.fake_cuda_hold_stream(a, 0);
  finish_ctx(ctx);
  non_blocking_stream(true, a);
  non_blocking_stream(true, b);
}

/* Invariant: between two blocking streams the block moves with the legacy
 * stream's ordering (one record there), and the taker's later work still
 * waits for the owner's work queued before the free. */
static void test_blocking_transfer_ordered(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *p = sgm_alloc(ctx, 4 * MiB, a);
  assert_non_null(p);
  fc.fake_cuda_hold_stream(a, 1);
  put_work(a);
  sgm_free(ctx, p, a);
  uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");
  void *q = sgm_alloc(ctx, 4 * MiB, b);
  assert_ptr_equal(q, p);
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 0);
  assert_false(stream_done(b));
  fc.fake_cuda_complete_stream(a);
  fc.fake_cuda_hold_stream(a, 0);
  assert_true(stream_done(b));
  sgm_free(ctx, q, b);
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
}

typedef struct per_thread_arg {
  sgm_context *ctx;
  void *blocks[2];
} per_thread_arg;

static void *per_thread_alloc_free(void *arg) {
  per_thread_arg *t = arg;
  void *pt = (void *)(uintptr_t)0x2;
  t->blocks[0] = sgm_alloc(t->ctx, 4 * MiB, pt);
  t->blocks[1] = sgm_alloc(t->ctx, 4 * MiB, pt);
  sgm_free(t->ctx, t->blocks[0], pt);
  sgm_free(t->ctx, t->blocks[1], pt);
  return NULL;
}

/* Invariant: CU_STREAM_PER_THREAD names a different stream on every thread:
 * blocks another thread freed on its per-thread stream reach this thread's
 * only through one ordered transfer (a record and a wait for both), never as
 * if they were this thread's own. */
static void test_per_thread_streams_do_not_alias(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx_limit("8MiB");
  void *pt = (void *)(uintptr_t)0x2;
  /* Two 4 MiB blocks cached on the NULL stream, and the event pool warm (one
   * transfer from a), so that the count below is the transfer's alone. */
  void *a = fc.fake_cuda_stream_create();
  void *x = sgm_alloc(ctx, 4 * MiB, a), *y = sgm_alloc(ctx, 4 * MiB, a);
  sgm_free(ctx, x, a);
  sgm_free(ctx, y, a);
  x = sgm_alloc(ctx, 4 * MiB, NULL);
  y = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(x);
  assert_non_null(y);
  sgm_free(ctx, x, NULL);
  sgm_free(ctx, y, NULL);
  fc.fake_cuda_hold_events(1);
  per_thread_arg t = {ctx, {NULL, NULL}};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, per_thread_alloc_free, &t), 0);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_non_null(t.blocks[0]);
  assert_non_null(t.blocks[1]);
  uint64_t before = driver_calls();
  uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");
  uint64_t probes = fc.fake_cuda_calls("cuStreamIsCapturing");
  void *p = sgm_alloc(ctx, 4 * MiB, pt), *q = sgm_alloc(ctx, 4 * MiB, pt);
  assert_non_null(p);
  assert_non_null(q);
  /* One transfer for both blocks: per-thread default streams are blocking,
   * so the driver orders this one after the legacy stream's work by itself;
   * the one call is the capture probe of the legacy stream. */
  assert_int_equal(driver_calls() - before, 1);
  assert_int_equal(fc.fake_cuda_calls("cuStreamIsCapturing") - probes, 1);
  assert_int_equal(fc.fake_cuda_calls("cuStreamWaitEvent") - waits, 0);
  sgm_free(ctx, p, pt);
  sgm_free(ctx, q, pt);
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(a);
}

typedef struct trim_arg {
  sgm_context *ctx;
  pthread_barrier_t *start; /* both threads reclaim at the same moment */
} trim_arg;

static void *trim_once(void *arg) {
  trim_arg *t = arg;
  pthread_barrier_wait(t->start);
  sgm__context_idle_tick(t->ctx); /* queries the fences */
  sgm_trim(t->ctx);               /* waits for them */
  return NULL;
}

/* Invariant (the defect "concurrent reclaim destroys the same event twice"):
 * each fence has one owner; two threads reclaiming at once after held work
 * completes never destroy or recycle an event twice (debug builds abort in the
 * backend on an unknown event; the double refuses it), and nothing leaks. */
static void test_concurrent_reclaim(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx_limit("256MiB");
  enum { N_STREAMS = 32, ROUNDS = 40 };
  void *s[N_STREAMS];
  for (int i = 0; i < N_STREAMS; i++) s[i] = fc.fake_cuda_stream_create();
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, 2);
  for (int r = 0; r < ROUNDS; r++) {
    fc.fake_cuda_hold_events(1);
    for (int i = 0; i < N_STREAMS; i++) {
      void *p = sgm_alloc(ctx, 2 * MiB, s[i]);
      assert_non_null(p);
      sgm_free(ctx, p, s[i]);
    }
    sgm__context_idle_tick(ctx); /* fences every stream's cache: all pending */
    fc.fake_cuda_hold_events(0);
    fc.fake_cuda_complete_events();
    trim_arg t = {ctx, &start};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, trim_once, &t), 0);
    trim_once(&t);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
    sgm_stats st;
    sgm_get_stats(ctx, &st);
    assert_int_equal(st.tier[SGM_TIER_VRAM].cached_bytes, 0);
    assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, 0);
  }
  pthread_barrier_destroy(&start);
  fake_cuda_stats fs;
  fc.fake_cuda_get_stats(&fs);
  assert_int_equal(fs.bad_event_destroys, 0);
  assert_int_equal(fs.bad_handles, 0);
  finish_ctx(ctx);
  for (int i = 0; i < N_STREAMS; i++) fc.fake_cuda_stream_destroy(s[i]);
}

/* The blocks two threads hold at once, to see that no byte is handed to both. */
enum { XFER_MAX_LIVE = 8 };
static pthread_mutex_t xfer_live_lock = PTHREAD_MUTEX_INITIALIZER;
static uintptr_t xfer_live[XFER_MAX_LIVE][2]; /* [start, end), 0 = free slot */
static int xfer_overlaps;                      /* under xfer_live_lock */

static void xfer_hold(void *p, size_t n, bool hold) {
  uintptr_t a = (uintptr_t)p, e = a + n;
  pthread_mutex_lock(&xfer_live_lock);
  int slot = -1;
  for (int i = 0; i < XFER_MAX_LIVE; i++) {
    if (!hold && xfer_live[i][0] == a) xfer_live[i][0] = xfer_live[i][1] = 0;
    if (hold && xfer_live[i][0] && a < xfer_live[i][1] && xfer_live[i][0] < e) xfer_overlaps++;
    if (hold && !xfer_live[i][0] && slot < 0) slot = i;
  }
  if (hold && slot >= 0) {
    xfer_live[slot][0] = a;
    xfer_live[slot][1] = e;
  }
  pthread_mutex_unlock(&xfer_live_lock);
}

typedef struct xfer_arg {
  sgm_context *ctx;
  void *stream;              /* this thread's non-blocking stream */
  int me;                    /* 0 or 1: whose turn is *turn */
  int *turn;                 /* which thread allocates next (atomic) */
  int got;                   /* allocations served */
} xfer_arg;

/* Threads take turns to allocate the one block the budget holds, and hand
 * the turn on before they free it: the other thread's transfer runs while
 * this one frees (the block is then still live, or cached and taken). */
static void *xfer_rounds(void *arg) {
  xfer_arg *x = arg;
  static const size_t sizes[] = {3 * MiB, 3 * MiB, 3 * MiB, 768 << 10};
  for (int i = 0; i < 200; i++) {
    while (__atomic_load_n(x->turn, __ATOMIC_ACQUIRE) != x->me) sched_yield();
    size_t n = sizes[i % 4];
    void *p = sgm_alloc(x->ctx, n, x->stream); /* NULL: the other thread still holds it */
    if (p) {
      x->got++;
      xfer_hold(p, n, true);
    }
    __atomic_store_n(x->turn, !x->me, __ATOMIC_RELEASE);
    if (p) {
      xfer_hold(p, n, false);
      sgm_free(x->ctx, p, x->stream);
    }
  }
  return NULL;
}

/* Invariant: two threads allocating on their own non-blocking streams under a
 * budget one block fills, one thread's transfer racing the other's free, never
 * hand a byte to both at once, never use an event twice, and leave the pool
 * consistent with nothing leaked. */
static void test_concurrent_transfers(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  int turn = 0;
  xfer_arg x[2] = {{ctx, non_blocking_stream(false, NULL), 0, &turn, 0},
                   {ctx, non_blocking_stream(false, NULL), 1, &turn, 0}};
  uint64_t waits = fc.fake_cuda_calls("cuStreamWaitEvent");
  fc.fake_cuda_hold_events(1); /* nothing completes: memory crosses only by transfer */
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, xfer_rounds, &x[1]), 0);
  xfer_rounds(&x[0]);
  assert_int_equal(pthread_join(th, NULL), 0);
  print_message("# %d + %d allocations served, %llu device-side waits\n", x[0].got, x[1].got,
                (unsigned long long)(fc.fake_cuda_calls("cuStreamWaitEvent") - waits));
  assert_int_equal(xfer_overlaps, 0);
  assert_true(x[0].got + x[1].got > 0);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  fake_cuda_stats fs;
  fc.fake_cuda_get_stats(&fs);
  assert_int_equal(fs.bad_event_destroys, 0);
  assert_int_equal(fs.bad_handles, 0);
  finish_ctx(ctx);
  non_blocking_stream(true, x[0].stream);
  non_blocking_stream(true, x[1].stream);
}

/* Invariant: after sgm_record_stream(p, B), freeing p on A does not let A
 * reuse p until B's work queued before the free has completed. */
static void test_record_stream_delays_reuse(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  void *a = fc.fake_cuda_stream_create(), *b = fc.fake_cuda_stream_create();
  void *p = sgm_alloc(ctx, 4 * MiB, a);
  assert_non_null(p);
  assert_int_equal(sgm_record_stream(ctx, p, b), SGM_OK);
  assert_int_equal(sgm_record_stream(ctx, p, a), SGM_OK); /* its own stream: nothing to do */
  fc.fake_cuda_hold_stream(b, 1);
  assert_int_equal(sgm_free_ex(ctx, p, a), SGM_OK);
  assert_null(sgm_alloc(ctx, 4 * MiB, a)); /* B may still use it */
  assert_int_equal(sgm_record_stream(ctx, p, b), SGM_ERR_INVALID); /* not live */
  fc.fake_cuda_complete_stream(b);
  fc.fake_cuda_hold_stream(b, 0);
  void *q = sgm_alloc(ctx, 4 * MiB, a);
  assert_ptr_equal(q, p);
  sgm_free(ctx, q, a);
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(b);
}

/* Invariant: cached memory is reclaimed before anyone's buffer is demoted:
 * with a released buffer in VRAM and a block freed on held stream A, an
 * allocation on A takes A's cached block and the buffer stays in VRAM. */
static void test_reclaim_before_demotion(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx_limit("8MiB");
  void *a = fc.fake_cuda_stream_create(), *c = fc.fake_cuda_stream_create();
  sgm_buffer *buf = NULL;
  assert_int_equal(sgm_buffer_create(ctx, 4 * MiB, &buf), SGM_OK);
  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(buf, c, &d), SGM_OK);
  assert_int_equal(sgm_buffer_release(buf, c), SGM_OK);
  fc.fake_cuda_settle(); /* c's work is done: the buffer is a valid victim */
  assert_int_equal(sgm_buffer_tier(buf), SGM_TIER_VRAM);
  void *p = sgm_alloc(ctx, 4 * MiB, a);
  assert_non_null(p);
  fc.fake_cuda_hold_stream(a, 1);
  sgm_free(ctx, p, a);
  void *q = sgm_alloc(ctx, 4 * MiB, a);
  assert_ptr_equal(q, p);
  assert_int_equal(sgm_buffer_tier(buf), SGM_TIER_VRAM);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.tier[SGM_TIER_VRAM].n_evictions, 0);
  fc.fake_cuda_hold_stream(a, 0);
  fc.fake_cuda_complete_stream(a);
  sgm_free(ctx, q, a);
  sgm_buffer_destroy(buf);
  finish_ctx(ctx);
  fc.fake_cuda_stream_destroy(a);
  fc.fake_cuda_stream_destroy(c);
}

/* Invariants: the idle tick never returns a block whose free is still pending
 * on the device (it only queries), and returns it once the work is done;
 * sgm_trim waits for the work and returns everything; destroy waits too, then
 * leaves no event or allocation behind in the driver. */
static void test_trim_and_destroy_with_pending(void **state) {
  (void)state;
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_VRAM_LIMIT", "64MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  void *s = fc.fake_cuda_stream_create();
  fc.fake_cuda_hold_events(1);
  void *p = sgm_alloc(ctx, 1 * MiB, s);
  assert_non_null(p);
  assert_int_equal(sgm_free_ex(ctx, p, s), SGM_OK);
  sgm__context_idle_tick(ctx);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_true(st.tier[SGM_TIER_VRAM].committed_bytes > 0); /* its chunk stays */
  assert_true(st.tier[SGM_TIER_VRAM].cached_bytes > 0);
  assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, 0);
  fc.fake_cuda_hold_events(0);
  fc.fake_cuda_complete_events();
  sgm__context_idle_tick(ctx);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.tier[SGM_TIER_VRAM].committed_bytes, 0);
  assert_int_equal(st.tier[SGM_TIER_VRAM].cached_bytes, 0);
  /* Cached with work still queued: trim waits for it, then returns it. */
  void *q = sgm_alloc(ctx, 1 * MiB, s);
  assert_int_equal(sgm_free_ex(ctx, q, s), SGM_OK);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.tier[SGM_TIER_VRAM].committed_bytes, 0);
  q = sgm_alloc(ctx, 1 * MiB, s);
  assert_int_equal(sgm_free_ex(ctx, q, s), SGM_OK);
  sgm_context_destroy(ctx);
  fc.fake_cuda_stream_destroy(s);
  fake_cuda_stats fs;
  fc.fake_cuda_get_stats(&fs);
  assert_int_equal(fs.events, 0);
  assert_int_equal(fc.fake_cuda_live_allocations(), 0);
}

/* sgm_record_stream racing a free of the same block (a caller's race: the
 * answer may be either, but never a torn record): every call either recorded
 * the stream on the live block or was refused because the block was already
 * freed, and the pool's check holds (issue 10: frees look their block up
 * without a lock, so the record's stream list is guarded by its tag). */

typedef struct record_arg {
  sgm_context *ctx;            /* the shared context */
  void *volatile ptr;          /* the block both threads touch, NULL between rounds */
  pthread_barrier_t *bar;      /* start of each round, end of each round */
  int rounds;                  /* rounds to run */
  void *streams[2];            /* the other streams named (the block is freed on NULL) */
  int ok, refused;             /* record_stream's answers */
} record_arg;

static void *record_main(void *p) {
  record_arg *a = p;
  for (int k = 0; k < a->rounds; k++) {
    pthread_barrier_wait(a->bar);
    void *ptr = a->ptr;
    for (int j = 0; j < 8; j++) {
      sgm_status rc = sgm_record_stream(a->ctx, ptr, a->streams[j % 2]);
      if (rc == SGM_OK) a->ok++;
      else if (rc == SGM_ERR_INVALID) a->refused++;
      else fail_msg("sgm_record_stream: %d (%s)", rc, sgm_last_error());
    }
    pthread_barrier_wait(a->bar);
  }
  return NULL;
}

static void test_record_stream_races_free(void **state) {
  (void)state;
  enum { ROUNDS = 400 };
  sgm_context *ctx = make_ctx_limit("16MiB");
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, 2);
  record_arg a = {.ctx = ctx, .bar = &bar, .rounds = ROUNDS,
                  .streams = {fc.fake_cuda_stream_create(), fc.fake_cuda_stream_create()}};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, record_main, &a), 0);
  for (int k = 0; k < ROUNDS; k++) {
    a.ptr = sgm_alloc(ctx, 4096 + (size_t)(k % 7) * 256, NULL);
    assert_non_null(a.ptr);
    pthread_barrier_wait(&bar);
    if (k % 2) sched_yield(); /* let the recorder go first half the time */
    assert_int_equal(sgm_free_ex(ctx, a.ptr, NULL), SGM_OK);
    pthread_barrier_wait(&bar);
  }
  pthread_join(t, NULL);
  pthread_barrier_destroy(&bar);
  printf("# record_stream: %d recorded, %d refused (block already freed)\n", a.ok, a.refused);
  assert_int_equal(a.ok + a.refused, 8 * ROUNDS);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_VRAM)));
  sgm_context_destroy(ctx);
  fc.fake_cuda_stream_destroy(a.streams[0]);
  fc.fake_cuda_stream_destroy(a.streams[1]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_streams),
      cmocka_unit_test(test_pending_memory_not_handed_out),
      cmocka_unit_test(test_same_stream_reuse_no_driver_calls),
      cmocka_unit_test(test_cross_stream_transfer_calls),
      cmocka_unit_test(test_stats_count_driver_calls),
      cmocka_unit_test(test_fenced_transfer_two_calls_ordered),
      cmocka_unit_test(test_non_blocking_transfer_ordered),
      cmocka_unit_test(test_seal_on_transfer_non_blocking),
      cmocka_unit_test(test_transfer_skips_owner_without_fit),
      cmocka_unit_test(test_seal_on_transfer_burst),
      cmocka_unit_test(test_transfer_takes_recent_sizes),
      cmocka_unit_test(test_burst_steady_state_four_calls),
      cmocka_unit_test(test_seal_on_transfer_blocking_fence),
      cmocka_unit_test(test_blocking_transfer_ordered),
      cmocka_unit_test(test_per_thread_streams_do_not_alias),
      cmocka_unit_test(test_concurrent_reclaim),
      cmocka_unit_test(test_concurrent_transfers),
      cmocka_unit_test(test_record_stream_delays_reuse),
      cmocka_unit_test(test_record_stream_races_free),
      cmocka_unit_test(test_reclaim_before_demotion),
      cmocka_unit_test(test_trim_and_destroy_with_pending),
  };
  return sgm_fake_run_suite("stream_order", "fake_cuda_hold_events", tests,
                            sizeof tests / sizeof tests[0], load_fake, unload_fake);
}
