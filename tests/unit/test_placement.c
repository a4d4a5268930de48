/*
 * test_placement.c — placement's own suite (lib/placement/placement.c, buffer*.c,
 * residency*.c, migrate*.c, prefetch.c), white-box through lib/placement/placement.h:
 * the allocation rules of DESIGN.md §3 in one function, the one "both
 * budgets are full" message, the per-buffer state word (a waiter sleeps on
 * its own buffer and wakes for nothing else), sgm_buffer_release on a
 * buffer another thread is moving (race-free under TSan), the
 * configuration record that set_vram_fraction no longer rewrites, the
 * per-tier residency locks (buffers in one tier proceed while another
 * tier's lock is held) and random operations over every tier from several
 * threads.
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "placement/placement.h"
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

/* ---- per-tier residency locks (issue 11) ---- */

static char spill_dir[64];

/* make_ctx's budgets with a spill directory of 256 MiB. */
static sgm_context *make_spill_ctx(void) {
  snprintf(spill_dir, sizeof spill_dir, "/tmp/sgm_placement_XXXXXX");
  if (!mkdtemp(spill_dir)) fail_msg("mkdtemp failed");
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "8MiB", 1);
  setenv("SGM_SHARED_LIMIT", "16MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);
  setenv("SGM_SPILL_DIR", spill_dir, 1);
  setenv("SGM_SPILL_LIMIT", "256MiB", 1);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) fail_msg("create: %s", sgm_last_error());
  return ctx;
}

static void destroy_spill_ctx(sgm_context *ctx) {
  sgm_context_destroy(ctx);
  rmdir(spill_dir);
}

typedef struct tier_worker {
  sgm_context *ctx;   /* its context */
  sgm_buffer *b;      /* a buffer resident in the tier whose lock is free */
  sgm_buffer *d;      /* a buffer on disk */
  bool acquire;       /* b is in VRAM: acquire and release it, create one there */
  sgm_tier evict_to;  /* SGM_TIER_NONE, or where b goes last */
  int failures;       /* calls that did not return SGM_OK */
} tier_worker;

static void *tier_worker_main(void *arg) {
  tier_worker *w = arg;
  unsigned char in[4096], out[4096];
  for (int i = 0; i < 50; i++) {
    memset(in, i, sizeof in);
    w->failures += sgm_buffer_write(w->b, 0, in, sizeof in) != SGM_OK;
    w->failures += sgm_buffer_read(w->b, 0, out, sizeof out) != SGM_OK;
    w->failures += memcmp(in, out, sizeof in) != 0;
    w->failures += sgm_buffer_set_priority(w->b, (sgm_priority)(i % 5)) != SGM_OK;
    w->failures += sgm_buffer_write(w->d, 0, in, sizeof in) != SGM_OK;
    w->failures += sgm_buffer_read(w->d, 0, out, sizeof out) != SGM_OK;
    if (w->acquire) {
      void *p = NULL;
      w->failures += sgm_buffer_acquire(w->b, NULL, &p) != SGM_OK || !p;
      w->failures += sgm_buffer_release(w->b, NULL) != SGM_OK;
      sgm_buffer *n = NULL;
      w->failures += sgm_buffer_create(w->ctx, 64 * 1024, &n) != SGM_OK;
      w->failures += sgm_buffer_tier(n) != SGM_TIER_VRAM;
      sgm_buffer_destroy(n);
    }
  }
  if (w->evict_to != SGM_TIER_NONE) w->failures += sgm_buffer_evict(w->b, w->evict_to) != SGM_OK;
  return NULL;
}

/* Run a worker on b (and the disk buffer d) while this thread holds the
 * residency lock of tier `held`: it must finish (a join that never returns
 * is the failure, which ctest's timeout reports) with every call SGM_OK. */
static void run_beside_held_lock(sgm_context *ctx, sgm_tier held, tier_worker *w) {
  struct sgm_placement *pl = sgm__context_pl(ctx);
  pthread_t t;
  sgm__lock_take(sgm__residency_lock(pl, held));
  assert_int_equal(pthread_create(&t, NULL, tier_worker_main, w), 0);
  pthread_join(t, NULL);
  sgm__lock_drop(sgm__residency_lock(pl, held));
  assert_int_equal(w->failures, 0);
}

/* Invariant: buffers in different tiers do not serialise on one lock. While
 * a thread holds the shared tier's residency lock (as a victim search there
 * does), another thread acquires, releases, writes, reads and reprioritises a
 * VRAM buffer, creates and destroys VRAM buffers, and reads and writes a
 * disk buffer; while one holds the VRAM tier's, another does the same to a
 * shared-memory buffer and spills it to disk. Neither waits: no timing, the
 * worker simply finishes while the lock is held. */
static void test_tiers_do_not_serialise(void **state) {
  (void)state;
  sgm_context *ctx = make_spill_ctx();
  sgm_buffer *v, *s, *d;
  assert_int_equal(sgm_buffer_create(ctx, MiB, &v), SGM_OK);
  assert_int_equal(sgm_buffer_create(ctx, MiB, &s), SGM_OK);
  assert_int_equal(sgm_buffer_create(ctx, MiB, &d), SGM_OK);
  assert_int_equal(sgm_buffer_evict(s, SGM_TIER_SHARED), SGM_OK);
  assert_int_equal(sgm_buffer_evict(d, SGM_TIER_DISK), SGM_OK);
  assert_int_equal(sgm_buffer_tier(v), SGM_TIER_VRAM);
  assert_int_equal(sgm_buffer_tier(s), SGM_TIER_SHARED);
  assert_int_equal(sgm_buffer_tier(d), SGM_TIER_DISK);

  tier_worker in_vram = {.ctx = ctx, .b = v, .d = d, .acquire = true, .evict_to = SGM_TIER_NONE};
  run_beside_held_lock(ctx, SGM_TIER_SHARED, &in_vram);
  tier_worker in_shared = {.ctx = ctx, .b = s, .d = d, .acquire = false, .evict_to = SGM_TIER_DISK};
  run_beside_held_lock(ctx, SGM_TIER_VRAM, &in_shared);
  assert_int_equal(sgm_buffer_tier(s), SGM_TIER_DISK);

  check_placement(ctx);
  sgm_buffer_destroy(v);
  sgm_buffer_destroy(s);
  sgm_buffer_destroy(d);
  destroy_spill_ctx(ctx);
}

/* ---- random operations over every tier from several threads ---- */

#define STRESS_THREADS 4
#define STRESS_OWN 5    /* buffers each thread owns (their contents are checked) */
#define STRESS_COMMON 4 /* buffers every thread uses (acquire may find them taken) */
#define STRESS_OPS 150

typedef struct stress_thread {
  sgm_context *ctx;                    /* the context */
  sgm_buffer **common;                 /* STRESS_COMMON buffers all threads share */
  sgm_buffer *own[STRESS_OWN];         /* this thread's buffers */
  uint32_t stamp[STRESS_OWN];          /* what the first word of own[i] holds */
  uint64_t seed;                       /* its generator's seed */
  int failures;                        /* calls that went wrong */
  char why[160];                       /* the first of them */
} stress_thread;

static void stress_fail(stress_thread *t, const char *what) {
  if (!t->failures++) snprintf(t->why, sizeof t->why, "%s: %s", what, sgm_last_error());
}

static void *stress_main(void *arg) {
  stress_thread *t = arg;
  sgm_test_rng r;
  sgm_test_rng_init(&r, t->seed);
  for (int op = 0; op < STRESS_OPS; op++) {
    int i = (int)sgm_test_rng_range(&r, 0, STRESS_OWN - 1);
    sgm_buffer *b = t->own[i];
    sgm_buffer *c = t->common[sgm_test_rng_range(&r, 0, STRESS_COMMON - 1)];
    uint32_t word = 0;
    void *p = NULL;
    switch (sgm_test_rng_range(&r, 0, 8)) {
    case 0: /* write a new stamp */
      t->stamp[i] = (uint32_t)sgm_test_rng_next(&r);
      if (sgm_buffer_write(b, 0, &t->stamp[i], sizeof word) != SGM_OK) stress_fail(t, "write");
      break;
    case 1: /* its stamp survives wherever it went */
      if (sgm_buffer_read(b, 0, &word, sizeof word) != SGM_OK) stress_fail(t, "read");
      else if (word != t->stamp[i]) stress_fail(t, "read: wrong contents");
      break;
    case 2: /* use it on the device */
      if (sgm_buffer_acquire(b, NULL, &p) != SGM_OK || !p) stress_fail(t, "acquire");
      else if (sgm_buffer_release(b, NULL) != SGM_OK) stress_fail(t, "release");
      break;
    case 3:
      if (sgm_buffer_evict(b, sgm_test_rng_range(&r, 0, 1) ? SGM_TIER_DISK : SGM_TIER_SHARED) != SGM_OK)
        stress_fail(t, "evict");
      break;
    case 4:
      if (sgm_buffer_prefetch(b, NULL) != SGM_OK) stress_fail(t, "prefetch");
      break;
    case 5:
      if (sgm_buffer_set_priority(b, (sgm_priority)sgm_test_rng_range(&r, 0, 4)) != SGM_OK)
        stress_fail(t, "set_priority");
      break;
    case 6: { /* a common buffer: another thread may hold it acquired */
      sgm_status rc = sgm_buffer_acquire(c, NULL, &p);
      if (rc == SGM_OK && sgm_buffer_release(c, NULL) != SGM_OK) stress_fail(t, "release common");
      if (rc != SGM_OK && rc != SGM_ERR_BUSY) stress_fail(t, "acquire common");
      break;
    }
    case 7: /* evicting a common buffer may find it acquired */
      if (sgm_buffer_evict(c, SGM_TIER_DISK) == SGM_ERR_INVALID) stress_fail(t, "evict common");
      (void)sgm_buffer_set_priority(c, (sgm_priority)sgm_test_rng_range(&r, 0, 4));
      break;
    default: { /* destroy and create again, written */
      sgm_buffer_destroy(b);
      t->own[i] = NULL;
      if (sgm_buffer_create(t->ctx, sgm_test_rng_range(&r, 4096, 2 * MiB), &t->own[i]) != SGM_OK) {
        stress_fail(t, "create");
        return NULL;
      }
      t->stamp[i] = (uint32_t)sgm_test_rng_next(&r);
      if (sgm_buffer_write(t->own[i], 0, &t->stamp[i], sizeof word) != SGM_OK) stress_fail(t, "write new");
      break;
    }
    }
  }
  return NULL;
}

/* Invariant: under random operations of four threads on buffers in every
 * tier (each thread its own buffers plus four all of them use), with VRAM and
 * shared memory too small for all of them so victim searches, demotions,
 * spills and prefetches cross tiers, every call succeeds (or finds a common
 * buffer acquired), every buffer keeps the bytes written last, the placement
 * invariant holds at the end, and no tier holds more than its budget. Run
 * under TSan, it shows the tier locks and state words race-free. Prints its
 * seed (SGM_TEST_SEED replays). */
static void test_random_ops_over_tiers(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("test_random_ops_over_tiers", 0x5e1175);
  sgm_context *ctx = make_spill_ctx();
  sgm_buffer *common[STRESS_COMMON];
  for (int i = 0; i < STRESS_COMMON; i++)
    assert_int_equal(sgm_buffer_create(ctx, MiB, &common[i]), SGM_OK);
  stress_thread th[STRESS_THREADS];
  memset(th, 0, sizeof th);
  for (int k = 0; k < STRESS_THREADS; k++) {
    th[k].ctx = ctx;
    th[k].common = common;
    th[k].seed = seed + (uint64_t)k * 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < STRESS_OWN; i++) {
      assert_int_equal(sgm_buffer_create(ctx, MiB + (uint64_t)i * 4096, &th[k].own[i]), SGM_OK);
      th[k].stamp[i] = (uint32_t)(k * 100 + i + 1);
      assert_int_equal(sgm_buffer_write(th[k].own[i], 0, &th[k].stamp[i], 4), SGM_OK);
    }
  }
  pthread_t tid[STRESS_THREADS];
  for (int k = 0; k < STRESS_THREADS; k++) assert_int_equal(pthread_create(&tid[k], NULL, stress_main, &th[k]), 0);
  for (int k = 0; k < STRESS_THREADS; k++) pthread_join(tid[k], NULL);
  for (int k = 0; k < STRESS_THREADS; k++)
    if (th[k].failures) fail_msg("thread %d (seed %llu): %d failures, first: %s", k,
                                 (unsigned long long)th[k].seed, th[k].failures, th[k].why);
  check_placement(ctx);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  /* It crossed tiers: victims left VRAM, buffers went to disk and came back. */
  assert_true(st.tier[SGM_TIER_VRAM].n_evictions > 0);
  assert_true(st.tier[SGM_TIER_DISK].bytes_in > 0 && st.tier[SGM_TIER_DISK].bytes_out > 0);
  for (int t = 0; t < SGM_TIER_COUNT; t++)
    if (st.tier[t].used_bytes > st.tier[t].budget_bytes)
      fail_msg("%s holds %llu bytes over its budget of %llu", sgm_tier_name((sgm_tier)t),
               (unsigned long long)st.tier[t].used_bytes, (unsigned long long)st.tier[t].budget_bytes);
  for (int k = 0; k < STRESS_THREADS; k++)
    for (int i = 0; i < STRESS_OWN; i++) {
      uint32_t word = 0;
      assert_int_equal(sgm_buffer_read(th[k].own[i], 0, &word, sizeof word), SGM_OK);
      assert_int_equal(word, th[k].stamp[i]);
      sgm_buffer_destroy(th[k].own[i]);
    }
  for (int i = 0; i < STRESS_COMMON; i++) sgm_buffer_destroy(common[i]);
  destroy_spill_ctx(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_alloc_rules),
      cmocka_unit_test(test_alloc_without_fallback),
      cmocka_unit_test(test_buffer_both_full_message),
      cmocka_unit_test(test_waiter_wakes_only_for_its_buffer),
      cmocka_unit_test(test_release_while_moved),
      cmocka_unit_test(test_config_record_is_stable),
      cmocka_unit_test(test_tiers_do_not_serialise),
      cmocka_unit_test(test_random_ops_over_tiers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
