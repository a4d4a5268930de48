/*
 * test_hooks.c — the framework hooks (lib/hooks.c): one lazily created
 * context per device, thread-safe first use, and failures that always reach
 * stderr as one line (PyTorch does not check for NULL).
 *
 * Runs on the emulated device with a small SGM_EMU_VRAM; every test starts
 * from a clean environment and an empty hook table, and empties it again.
 * stderr is captured into a temporary file around the calls that must (or
 * must not) print.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"
/* After cmocka (through test_util.h). */
#include "internal.h"

#define MiB ((size_t)1 << 20)

/* The emulated device's size in these tests: small, so contexts are cheap. */
#define EMU_VRAM_BYTES (64 * MiB)

static int setup(void **state) {
  (void)state;
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  sgm__hooks_reset_for_tests();
  return 0;
}

static int teardown(void **state) {
  (void)state;
  sgm__hooks_reset_for_tests();
  sgm_test_clean_env();
  return 0;
}

/* ---- stderr capture ---- */

typedef struct capture {
  FILE *file;   /* where fd 2 points while capturing */
  int saved_fd; /* the real stderr */
} capture;

static void capture_begin(capture *c) {
  fflush(stderr);
  c->file = tmpfile();
  assert_non_null(c->file);
  c->saved_fd = dup(STDERR_FILENO);
  assert_true(c->saved_fd >= 0);
  assert_true(dup2(fileno(c->file), STDERR_FILENO) >= 0);
}

/* Stop capturing; buf gets what was written (NUL-terminated). Returns the number of lines. */
static int capture_end(capture *c, char *buf, size_t len) {
  fflush(stderr);
  assert_true(dup2(c->saved_fd, STDERR_FILENO) >= 0);
  close(c->saved_fd);
  rewind(c->file);
  size_t n = fread(buf, 1, len - 1, c->file);
  buf[n] = '\0';
  fclose(c->file);
  int lines = 0;
  for (size_t i = 0; i < n; i++) lines += buf[i] == '\n';
  /* Echo it, so a failing run shows what the hooks said. */
  if (n) fprintf(stderr, "[captured] %s", buf);
  return lines;
}

static sgm_stats stats_of(sgm_context *ctx) {
  sgm_stats st;
  assert_non_null(ctx);
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  return st;
}

/* ---- concurrent first use ---- */

enum { N_THREADS = 8, N_ROUNDS = 10 };

typedef struct worker {
  pthread_barrier_t *barrier; /* releases all threads together */
  size_t size;                /* bytes to ask for */
  void *ptr;                  /* what sgm_torch_malloc returned */
} worker;

static void *worker_main(void *arg) {
  worker *w = arg;
  pthread_barrier_wait(w->barrier);
  w->ptr = sgm_torch_malloc(w->size, 0, NULL);
  return NULL;
}

/* Invariant: threads racing on the first sgm_torch_malloc of a device create
 * exactly one context; every thread gets a distinct pointer of it, and all
 * free back without a bad free. Repeated over several rounds (the table is
 * reset in between) to give the race more chances. */
static void test_concurrent_first_use_creates_one_context(void **state) {
  (void)state;
  /* Reserve mode: the budget is taken at create, so the allocations test the
   * hooks' creation race, not the VRAM tier's concurrent growth. */
  setenv("SGM_ALLOW_GROWTH", "off", 1);
  for (int round = 0; round < N_ROUNDS; round++) {
    sgm__hooks_reset_for_tests();
    pthread_barrier_t barrier;
    assert_int_equal(pthread_barrier_init(&barrier, NULL, N_THREADS), 0);
    worker w[N_THREADS];
    pthread_t tid[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) {
      w[i] = (worker){.barrier = &barrier, .size = MiB + (size_t)i * 4096, .ptr = NULL};
      assert_int_equal(pthread_create(&tid[i], NULL, worker_main, &w[i]), 0);
    }
    for (int i = 0; i < N_THREADS; i++) assert_int_equal(pthread_join(tid[i], NULL), 0);
    pthread_barrier_destroy(&barrier);

    assert_int_equal(sgm__hooks_n_created(), 1);
    sgm_context *ctx = sgm_hook_context(0);
    assert_int_equal(sgm__hooks_n_created(), 1);
    for (int i = 0; i < N_THREADS; i++) {
      assert_non_null(w[i].ptr);
      assert_int_equal(sgm_pointer_tier(ctx, w[i].ptr), SGM_TIER_VRAM);
      for (int j = 0; j < i; j++) assert_ptr_not_equal(w[i].ptr, w[j].ptr);
    }
    assert_int_equal(stats_of(ctx).tier[SGM_TIER_VRAM].n_live, N_THREADS);
    for (int i = 0; i < N_THREADS; i++) sgm_torch_free(w[i].ptr, w[i].size, 0, NULL);
    sgm_stats st = stats_of(ctx);
    assert_int_equal(st.n_bad_frees, 0);
    assert_int_equal(st.tier[SGM_TIER_VRAM].n_live, 0);
    assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, 0);
  }
}

/* ---- one context per device ---- */

/* Invariant: each device ordinal gets its own context, created once and
 * returned again on later calls, opened with cfg.device = that ordinal; a
 * pointer from one device's hooks belongs to that device's context only;
 * ordinals outside 0..63 get NULL and one logged line each. */
static void test_one_context_per_device(void **state) {
  (void)state;
  sgm_context *c0 = sgm_hook_context(0);
  sgm_context *c1 = sgm_hook_context(1);
  sgm_context *c63 = sgm_hook_context(63);
  assert_non_null(c0);
  assert_non_null(c1);
  assert_non_null(c63);
  assert_ptr_not_equal(c0, c1);
  assert_ptr_not_equal(c1, c63);
  assert_ptr_equal(sgm_hook_context(0), c0);
  assert_ptr_equal(sgm_hook_context(1), c1);
  assert_int_equal(sgm__hooks_n_created(), 3);
  assert_int_equal(sgm_context_config(c0)->device, 0);
  assert_int_equal(sgm_context_config(c1)->device, 1);
  assert_int_equal(sgm_context_config(c63)->device, 63);

  void *p = sgm_torch_malloc(4096, 1, NULL);
  assert_non_null(p);
  assert_int_equal(sgm_pointer_tier(c1, p), SGM_TIER_VRAM);
  assert_int_equal(sgm_pointer_tier(c0, p), SGM_TIER_NONE);
  sgm_torch_free(p, 4096, 1, NULL);
  assert_int_equal(stats_of(c1).tier[SGM_TIER_VRAM].n_live, 0);
  assert_int_equal(stats_of(c1).n_bad_frees, 0);

  char out[4096];
  capture c;
  capture_begin(&c);
  sgm_context *bad_hi = sgm_hook_context(64);
  sgm_context *bad_lo = sgm_hook_context(-1);
  void *bad_p = sgm_torch_malloc(4096, 64, NULL);
  int lines = capture_end(&c, out, sizeof out);
  assert_null(bad_hi);
  assert_null(bad_lo);
  assert_null(bad_p);
  assert_int_equal(lines, 3);
  assert_non_null(strstr(out, "sgm_hook_context(device 64)"));
  assert_non_null(strstr(out, "sgm_hook_context(device -1)"));
  assert_non_null(strstr(out, "sgm_torch_malloc(4096, device 64)"));
  assert_non_null(strstr(out, "out of range"));
  assert_int_equal(sgm__hooks_n_created(), 3);
}

/* ---- failures reach the user ---- */

/* Invariant: a bad SGM_* value makes sgm_torch_malloc return NULL and print
 * one line naming the variable and the value, on every call (each retries);
 * no context is created; once the environment is fixed the hooks recover. */
static void test_bad_env_is_logged(void **state) {
  (void)state;
  setenv("SGM_VRAM_LIMIT", "lots", 1);
  char out[4096];
  capture c;
  capture_begin(&c);
  void *p = sgm_torch_malloc(MiB, 0, NULL);
  int lines = capture_end(&c, out, sizeof out);
  assert_null(p);
  assert_int_equal(lines, 1);
  assert_non_null(strstr(out, "sgm_torch_malloc(1048576, device 0): "));
  assert_non_null(strstr(out, "SGM_VRAM_LIMIT"));
  assert_non_null(strstr(out, "lots"));
  assert_int_equal(sgm__hooks_n_created(), 0);

  capture_begin(&c);
  p = sgm_torch_malloc(MiB, 0, NULL);
  lines = capture_end(&c, out, sizeof out);
  assert_null(p);
  assert_int_equal(lines, 1);
  assert_non_null(strstr(out, "SGM_VRAM_LIMIT"));

  unsetenv("SGM_VRAM_LIMIT");
  p = sgm_torch_malloc(MiB, 0, NULL);
  assert_non_null(p);
  assert_int_equal(sgm__hooks_n_created(), 1);
  sgm_torch_free(p, MiB, 0, NULL);
}

/* Invariant: an allocation that fits nowhere (VRAM budget 1 MiB, fallback to
 * shared memory off, 2 MiB asked) returns NULL and prints exactly one line
 * that names the call and gives a reason, even with SGM_VERBOSE=0. */
static void test_alloc_failure_is_logged(void **state) {
  (void)state;
  setenv("SGM_VRAM_LIMIT", "1MiB", 1);
  setenv("SGM_SHARED_FALLBACK", "off", 1);
  setenv("SGM_VERBOSE", "0", 1);
  char out[4096];
  capture c;
  capture_begin(&c);
  void *p = sgm_torch_malloc(2 * MiB, 0, NULL);
  int lines = capture_end(&c, out, sizeof out);
  assert_null(p);
  assert_int_equal(lines, 1);
  const char *head = "sgm_torch_malloc(2097152, device 0): ";
  const char *at = strstr(out, head);
  assert_non_null(at);
  assert_true(strlen(at + strlen(head)) > 1); /* a reason, not just the newline */
  assert_int_equal(sgm__hooks_n_created(), 1);
  sgm_stats st = stats_of(sgm_hook_context(0));
  assert_int_equal(st.tier[SGM_TIER_VRAM].n_live, 0);
  assert_int_equal(st.tier[SGM_TIER_SHARED].n_live, 0);
}

/* Invariant: size 0 gives NULL silently (as PyTorch's own allocator does for
 * empty tensors) and creates no context; freeing NULL does nothing; freeing a
 * pointer on a device that has no context frees nothing and prints one line. */
static void test_size_zero_and_free_edges(void **state) {
  (void)state;
  char out[4096];
  capture c;
  capture_begin(&c);
  void *p = sgm_torch_malloc(0, 0, NULL);
  sgm_torch_free(NULL, 0, 0, NULL);
  int lines = capture_end(&c, out, sizeof out);
  assert_null(p);
  assert_int_equal(lines, 0);
  assert_int_equal(sgm__hooks_n_created(), 0);

  int x = 0;
  capture_begin(&c);
  sgm_torch_free(&x, sizeof x, 0, NULL);
  sgm_torch_free(&x, sizeof x, 99, NULL);
  lines = capture_end(&c, out, sizeof out);
  assert_int_equal(lines, 2);
  assert_non_null(strstr(out, "no sgm context exists for device 0"));
  assert_non_null(strstr(out, "out of range"));
  assert_int_equal(sgm__hooks_n_created(), 0);
}

/* ---- optional hooks ---- */

/* Invariant: sgm_torch_record_stream accepts a live pointer of a hook context
 * silently, and reports one line for a freed or foreign pointer (nothing is
 * recorded then). */
static void test_record_stream_hook(void **state) {
  (void)state;
  void *stream = (void *)(uintptr_t)0x1000; /* never read by the emulated device */
  void *p = sgm_torch_malloc(4096, 0, NULL);
  assert_non_null(p);
  char out[4096];
  capture c;
  capture_begin(&c);
  sgm_torch_record_stream(p, stream);
  sgm_torch_record_stream(NULL, stream);
  int lines = capture_end(&c, out, sizeof out);
  assert_int_equal(lines, 0);
  sgm_torch_free(p, 4096, 0, NULL);
  capture_begin(&c);
  sgm_torch_record_stream(p, stream);
  lines = capture_end(&c, out, sizeof out);
  assert_int_equal(lines, 1);
  assert_non_null(strstr(out, "no hook context holds this pointer live"));
}

/* Invariant: the pool hooks' failures (a device out of range, an end or a
 * release of a pool nobody began, a device count past the table) are one
 * stderr line each, naming the hook and the pool; their success is silent. */
static void test_pool_hooks_report(void **state) {
  (void)state;
  char out[4096];
  capture c;
  sgm_torch_pool_id graph = {3, 0};
  capture_begin(&c);
  sgm_torch_begin_allocate_to_pool(0, graph, NULL);
  void *p = sgm_torch_malloc(4096, 0, NULL);
  sgm_torch_free(p, 4096, 0, NULL);
  sgm_torch_end_allocate_to_pool(0, graph);
  sgm_torch_release_pool(0, graph);
  sgm_torch_init(8);
  int lines = capture_end(&c, out, sizeof out);
  assert_int_equal(lines, 0);
  capture_begin(&c);
  sgm_torch_begin_allocate_to_pool(99, graph, NULL);
  sgm_torch_end_allocate_to_pool(0, graph);
  sgm_torch_release_pool(0, (sgm_torch_pool_id){0, 4});
  sgm_torch_end_allocate_stream_to_pool(0, NULL);
  sgm_torch_init(65);
  lines = capture_end(&c, out, sizeof out);
  assert_int_equal(lines, 5);
  assert_non_null(strstr(out, "sgm_torch_begin_allocate_to_pool(device 99, pool {3, 0})"));
  assert_non_null(strstr(out, "sgm_torch_end_allocate_to_pool(device 0, pool {3, 0}): "
                              "sgm_capture_pool_end: pool 3 has no open scope"));
  assert_non_null(strstr(out, "sgm_torch_release_pool(device 0, pool {0, 4})"));
  assert_non_null(strstr(out, "sgm_torch_end_allocate_stream_to_pool(device 0"));
  assert_non_null(strstr(out, "sgm_torch_init(65 devices)"));
}

/* Invariant: sgm_torch_empty_cache trims every hook context: once everything
 * is freed, nothing stays committed in VRAM or shared memory, on each device
 * that has a context. */
static void test_empty_cache_trims_every_context(void **state) {
  (void)state;
  enum { N = 8 };
  void *p0[N], *p1[N];
  for (int i = 0; i < N; i++) {
    p0[i] = sgm_torch_malloc(3 * MiB, 0, NULL);
    p1[i] = sgm_torch_malloc(MiB, 1, NULL);
    assert_non_null(p0[i]);
    assert_non_null(p1[i]);
  }
  sgm_context *c0 = sgm_hook_context(0), *c1 = sgm_hook_context(1);
  assert_true(stats_of(c0).tier[SGM_TIER_VRAM].committed_bytes >= N * 3 * MiB);
  assert_true(stats_of(c1).tier[SGM_TIER_VRAM].committed_bytes >= N * MiB);
  for (int i = 0; i < N; i++) {
    sgm_torch_free(p0[i], 3 * MiB, 0, NULL);
    sgm_torch_free(p1[i], MiB, 1, NULL);
  }
  sgm_torch_empty_cache();
  sgm_context *ctxs[] = {c0, c1};
  for (int k = 0; k < 2; k++) {
    sgm_stats st = stats_of(ctxs[k]);
    assert_int_equal(st.n_bad_frees, 0);
    for (int t = SGM_TIER_VRAM; t <= SGM_TIER_SHARED; t++) {
      assert_int_equal(st.tier[t].used_bytes, 0);
      assert_int_equal(st.tier[t].committed_bytes, 0);
      assert_int_equal(st.tier[t].n_chunks, 0);
    }
  }
  sgm_torch_empty_cache(); /* nothing left to trim: still fine */
}

static uint64_t expected_budget(uint64_t total, double fraction) {
  return (uint64_t)((double)total * fraction) & ~(uint64_t)255;
}

/* Invariant: sgm_torch_set_memory_fraction sets the VRAM budget to
 * fraction × device memory (aligned down to 256 bytes): before the context
 * exists (it is created with that fraction, which wins over
 * SGM_VRAM_FRACTION) and after (lowered and raised again). A fraction outside
 * (0, 1] changes nothing, creates nothing and prints one line. */
static void test_set_memory_fraction(void **state) {
  (void)state;
  setenv("SGM_VRAM_FRACTION", "0.9", 1);
  sgm_torch_set_memory_fraction(0.5, 0);
  assert_int_equal(sgm__hooks_n_created(), 1);
  sgm_context *ctx = sgm_hook_context(0);
  sgm_stats st = stats_of(ctx);
  uint64_t total = st.device_total_bytes;
  assert_int_equal(total, EMU_VRAM_BYTES);
  assert_int_equal(st.tier[SGM_TIER_VRAM].budget_bytes, expected_budget(total, 0.5));

  sgm_torch_set_memory_fraction(0.25, 0);
  assert_int_equal(stats_of(ctx).tier[SGM_TIER_VRAM].budget_bytes, expected_budget(total, 0.25));
  sgm_torch_set_memory_fraction(0.7, 0);
  assert_int_equal(stats_of(ctx).tier[SGM_TIER_VRAM].budget_bytes, expected_budget(total, 0.7));
  assert_int_equal(sgm__hooks_n_created(), 1);

  char out[4096];
  capture c;
  capture_begin(&c);
  sgm_torch_set_memory_fraction(1.5, 0);
  sgm_torch_set_memory_fraction(0.0, 0);
  sgm_torch_set_memory_fraction(NAN, 0);
  sgm_torch_set_memory_fraction(2.0, 5); /* no context on device 5: none is created */
  int lines = capture_end(&c, out, sizeof out);
  assert_int_equal(lines, 4);
  assert_non_null(strstr(out, "sgm_torch_set_memory_fraction(1.5, device 0)"));
  assert_non_null(strstr(out, "(0, 1]"));
  assert_int_equal(stats_of(ctx).tier[SGM_TIER_VRAM].budget_bytes, expected_budget(total, 0.7));
  assert_int_equal(sgm__hooks_n_created(), 1);

  /* A fraction for a device without a context creates it with that budget. */
  sgm_torch_set_memory_fraction(0.125, 2);
  assert_int_equal(sgm__hooks_n_created(), 2);
  assert_int_equal(stats_of(sgm_hook_context(2)).tier[SGM_TIER_VRAM].budget_bytes,
                   expected_budget(total, 0.125));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_concurrent_first_use_creates_one_context, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_one_context_per_device, setup, teardown),
      cmocka_unit_test_setup_teardown(test_bad_env_is_logged, setup, teardown),
      cmocka_unit_test_setup_teardown(test_alloc_failure_is_logged, setup, teardown),
      cmocka_unit_test_setup_teardown(test_size_zero_and_free_edges, setup, teardown),
      cmocka_unit_test_setup_teardown(test_record_stream_hook, setup, teardown),
      cmocka_unit_test_setup_teardown(test_pool_hooks_report, setup, teardown),
      cmocka_unit_test_setup_teardown(test_empty_cache_trims_every_context, setup, teardown),
      cmocka_unit_test_setup_teardown(test_set_memory_fraction, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
