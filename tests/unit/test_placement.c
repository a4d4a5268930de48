/*
 * test_placement.c — placement's own suite (lib/placement.c, buffer.c,
 * residency.c, migrate.c, prefetch.c), white-box through lib/placement.h:
 * the allocation rules of DESIGN.md §3 in one function, the one "both
 * budgets are full" message, the per-buffer state word (a waiter sleeps on
 * its own buffer and wakes for nothing else), sgm_buffer_release on a
 * buffer another thread is moving (race-free under TSan), and the
 * configuration record that set_vram_fraction no longer rewrites.
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "placement.h"
#include "test_util.h"

#define MiB (UINT64_C(1) << 20)

/* 8 MiB of VRAM, 16 MiB of shared memory, no spill directory. */
static sgm_context *make_ctx(const char *fallback) {
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "8MiB", 1);
  setenv("SGM_SHARED_LIMIT", "16MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);
  if (fallback) setenv("SGM_SHARED_FALLBACK", fallback, 1);
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fail_msg("create: %s", sgm_last_error());
  return ctx;
}

static void check_placement(sgm_context *ctx) {
  char why[256];
  if (sgm__placement_check(ctx, why, sizeof why) != SGM_OK) fail_msg("placement: %s", why);
}

/* Invariant (rules 1-3): sgm__residency_alloc puts a block in VRAM while it
 * fits, then in shared memory, and says which; when both are full it fails
 * with *out 0, *where NONE and one message naming both budgets. */
static void test_alloc_rules(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(NULL);
  uint64_t d[24];
  sgm_tier where[24];
  int n = 0, n_vram = 0, n_shared = 0;
  for (; n < 24; n++) {
    int rc = sgm__residency_alloc(ctx, MiB, NULL, &d[n], &where[n]);
    if (rc != SGM_OK) {
      assert_int_equal(rc, SGM_ERR_NOMEM);
      assert_int_equal(d[n], 0);
      assert_int_equal(where[n], SGM_TIER_NONE);
      break;
    }
    assert_int_equal(sgm_pointer_tier(ctx, (void *)(uintptr_t)d[n]), where[n]);
    if (where[n] == SGM_TIER_VRAM) {
      assert_int_equal(n_shared, 0); /* VRAM first: nothing went to shared before it filled */
      n_vram++;
    } else {
      assert_int_equal(where[n], SGM_TIER_SHARED);
      n_shared++;
    }
  }
  assert_int_equal(n_vram, 8);
  assert_int_equal(n_shared, 16);
  assert_int_equal(n, 24);
  uint64_t extra = 1;
  sgm_tier w = SGM_TIER_VRAM;
  assert_int_equal(sgm__residency_alloc(ctx, MiB, NULL, &extra, &w), SGM_ERR_NOMEM);
  assert_int_equal(extra, 0);
  assert_int_equal(w, SGM_TIER_NONE);
  const char *msg = sgm_last_error();
  assert_non_null(strstr(msg, "sgm_alloc: VRAM and shared GPU memory are both full"));
  assert_non_null(strstr(msg, "SGM_VRAM_LIMIT"));
  assert_non_null(strstr(msg, "SGM_SHARED_LIMIT"));
  for (int i = 0; i < n; i++) assert_int_equal(sgm_free_ex(ctx, (void *)(uintptr_t)d[i], NULL), SGM_OK);
  sgm_context_destroy(ctx);
}

/* Invariant (rule 3 off): with the fallback off a full VRAM fails the
 * allocation and says how to turn the fallback on; nothing lands in shared. */
static void test_alloc_without_fallback(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("off");
  uint64_t d[8];
  sgm_tier w;
  for (int i = 0; i < 8; i++) {
    assert_int_equal(sgm__residency_alloc(ctx, MiB, NULL, &d[i], &w), SGM_OK);
    assert_int_equal(w, SGM_TIER_VRAM);
  }
  uint64_t x = 1;
  assert_int_equal(sgm__residency_alloc(ctx, MiB, NULL, &x, &w), SGM_ERR_NOMEM);
  assert_int_equal(x, 0);
  assert_int_equal(w, SGM_TIER_NONE);
  assert_non_null(strstr(sgm_last_error(), "SGM_SHARED_FALLBACK=on"));
  for (int i = 0; i < 8; i++) assert_int_equal(sgm_free_ex(ctx, (void *)(uintptr_t)d[i], NULL), SGM_OK);
  sgm_context_destroy(ctx);
}

/* Invariant: a buffer that fits nowhere fails with the same "both full"
 * message as sgm_alloc, plus what the disk tier would need; the buffers that
 * fit are intact and the placement invariants hold. */
static void test_buffer_both_full_message(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(NULL);
  sgm_buffer *b[24];
  int n = 0;
  for (; n < 24; n++) {
    assert_int_equal(sgm_buffer_create(ctx, MiB, &b[n]), SGM_OK);
    void *p;
    assert_int_equal(sgm_buffer_acquire(b[n], NULL, &p), SGM_OK); /* acquired: cannot move */
  }
  sgm_buffer *x = (sgm_buffer *)1;
  assert_int_equal(sgm_buffer_create(ctx, MiB, &x), SGM_ERR_NOMEM);
  assert_null(x);
  const char *msg = sgm_last_error();
  assert_non_null(strstr(msg, "sgm_buffer_create(1048576): VRAM and shared GPU memory are both full"));
  assert_non_null(strstr(msg, "Disk: off (set SGM_SPILL_DIR"));
  check_placement(ctx);
  for (int i = 0; i < n; i++) {
    assert_int_equal(sgm_buffer_release(b[i], NULL), SGM_OK);
    sgm_buffer_destroy(b[i]);
  }
  sgm_context_destroy(ctx);
}

typedef struct waiter {
  sgm_buffer *b;   /* the buffer it acquires */
  sgm_status rc;   /* what acquire returned */
  void *ptr;       /* the device pointer it got */
} waiter;

static void *waiter_main(void *arg) {
  waiter *w = arg;
  w->rc = sgm_buffer_acquire(w->b, NULL, &w->ptr);
  return NULL;
}

/* Spin (no sleep) until a thread has announced that it waits on b. */
static void wait_for_sleeper(sgm_buffer *b) {
  while (!(__atomic_load_n(&b->state, __ATOMIC_ACQUIRE) & SGM_BUF_WAITERS)) sched_yield();
}

/* Invariant: a thread waiting for a BUSY buffer sleeps on that buffer alone:
 * a thousand other buffers becoming idle wake it zero times; its own buffer
 * becoming idle wakes it, and its acquire then succeeds. */
static void test_waiter_wakes_only_for_its_buffer(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(NULL);
  struct sgm_placement *pl = sgm__context_pl(ctx);
  sgm_buffer *a, *other;
  assert_int_equal(sgm_buffer_create(ctx, MiB, &a), SGM_OK);
  assert_int_equal(sgm_buffer_create(ctx, MiB, &other), SGM_OK);
  sgm__lock_take(&pl->lock);
  assert_int_equal(sgm__buffer_take_locked(pl, a, SGM_TAKE_MOVE), SGM_BUF_RELEASED);
  sgm__lock_drop(&pl->lock);
  uint64_t woke0 = __atomic_load_n(&pl->n_busy_wakeups, __ATOMIC_RELAXED);
  waiter w = {.b = a, .rc = SGM_ERR_INVALID};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, waiter_main, &w), 0);
  wait_for_sleeper(a);
  for (int i = 0; i < 1000; i++) {
    sgm__lock_take(&pl->lock);
    sgm__buffer_take_locked(pl, other, SGM_TAKE_MOVE);
    sgm__lock_drop(&pl->lock);
    sgm__buffer_finish(pl, other, SGM_BUF_RELEASED, false);
  }
  /* The sleeper may have woken only if its own word changed: it has not. */
  assert_int_equal(__atomic_load_n(&pl->n_busy_wakeups, __ATOMIC_RELAXED), woke0);
  assert_int_equal(sgm__buffer_state(a), SGM_BUF_BUSY);
  sgm__buffer_finish(pl, a, SGM_BUF_RELEASED, false);
  pthread_join(t, NULL);
  assert_int_equal(w.rc, SGM_OK);
  assert_non_null(w.ptr);
  assert_true(__atomic_load_n(&pl->n_busy_wakeups, __ATOMIC_RELAXED) > woke0);
  assert_int_equal(sgm_buffer_release(a, NULL), SGM_OK);
  check_placement(ctx);
  sgm_buffer_destroy(a);
  sgm_buffer_destroy(other);
  sgm_context_destroy(ctx);
}

typedef struct mover {
  sgm_context *ctx; /* its context */
  sgm_buffer *b;    /* the buffer it keeps taking and giving back */
  int n;            /* how many times */
} mover;

static void *mover_main(void *arg) {
  mover *m = arg;
  struct sgm_placement *pl = sgm__context_pl(m->ctx);
  for (int i = 0; i < m->n; i++) {
    sgm__lock_take(&pl->lock);
    sgm__buffer_take_locked(pl, m->b, SGM_TAKE_MOVE);
    sgm__lock_drop(&pl->lock);
    sgm__buffer_finish(pl, m->b, SGM_BUF_RELEASED, false);
  }
  return NULL;
}

/* Invariant: sgm_buffer_release on a buffer that is not acquired reports
 * SGM_ERR_INVALID and changes nothing, even while another thread moves the
 * buffer (BUSY and back) — and reads the state without a data race (the
 * check that fails under TSan when release reads a plain field). */
static void test_release_while_moved(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(NULL);
  sgm_buffer *b;
  assert_int_equal(sgm_buffer_create(ctx, MiB, &b), SGM_OK);
  mover m = {.ctx = ctx, .b = b, .n = 2000};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, mover_main, &m), 0);
  for (int i = 0; i < 2000; i++) assert_int_equal(sgm_buffer_release(b, NULL), SGM_ERR_INVALID);
  pthread_join(t, NULL);
  assert_int_equal(sgm__buffer_state(b), SGM_BUF_RELEASED);
  check_placement(ctx);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

typedef struct reader {
  const sgm_config *cfg; /* the record sgm_context_config handed out */
  double sum;            /* what it read (kept, so the reads are not dropped) */
} reader;

static void *reader_main(void *arg) {
  reader *r = arg;
  for (int i = 0; i < 2000; i++) r->sum += r->cfg->vram_fraction;
  return NULL;
}

/* Invariant: the record sgm_context_config returns is the configuration at
 * create and never changes: changing the VRAM fraction changes the budget,
 * not the record, so another thread may read it meanwhile (TSan). */
static void test_config_record_is_stable(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(NULL);
  const sgm_config *cfg = sgm_context_config(ctx);
  double f0 = cfg->vram_fraction;
  reader r = {.cfg = cfg, .sum = 0};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, reader_main, &r), 0);
  for (int i = 0; i < 200; i++) assert_int_equal(sgm__context_set_vram_fraction(ctx, i % 2 ? 0.5 : 0.25), SGM_OK);
  pthread_join(t, NULL);
  assert_true(r.sum > 0);
  assert_true(cfg->vram_fraction == f0);
  assert_true(sgm_context_config(ctx) == cfg);
  /* The budget does follow: 1/16 of the 64 MiB device is under the 8 MiB cap. */
  assert_int_equal(sgm__context_set_vram_fraction(ctx, 1.0 / 16), SGM_OK);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.tier[SGM_TIER_VRAM].budget_bytes, 4 * MiB);
  assert_true(cfg->vram_fraction == f0);
  sgm_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_alloc_rules),
      cmocka_unit_test(test_alloc_without_fallback),
      cmocka_unit_test(test_buffer_both_full_message),
      cmocka_unit_test(test_waiter_wakes_only_for_its_buffer),
      cmocka_unit_test(test_release_while_moved),
      cmocka_unit_test(test_config_record_is_stable),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
