/*
 * test_model.c — the model-based random test in CI (tests/model/model.h says
 * what it checks): random sequences of every public call on 1, 2 and 4
 * threads on the emulated device with a disk tier in a temporary folder, with
 * fixed pointers and again with managed pointers that sgm moves (issue 29),
 * checked byte for byte, for overlap and for each tier's used bytes against a
 * shadow model.
 *
 * Frees of acquired buffers' device pointers are among the foreign frees
 * (issue 12, defect 2: sgm_free must refuse them; fixed, so always on).
 *
 * SGM_MODEL_SEED sets the seed (printed either way), SGM_MODEL_OPS the
 * operations per thread (default 3000, 1000 with managed pointers: seconds
 * under ASan and TSan),
 * SGM_MODEL_ONLY a glob of the tests to run.
 * A failure names the thread, the operation number and the seed; rerun with
 * SGM_MODEL_SEED=<seed> to replay it (exactly so with one thread).
 */
#include <fnmatch.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "model.h"
#include "test_util.h"

static uint64_t model_seed = 20261201;
static uint64_t model_ops = 3000;
/* Managed runs move and rewrite blocks of 2-4 MiB byte by byte: a third of the
 * operations keeps them to seconds under ASan and TSan. */
static uint64_t model_managed_ops = 1000;

static void run_model_ex(int n_threads, uint64_t idle_trim_ms, bool managed) {
  char dir[] = "/tmp/sgm-model-XXXXXX";
  assert_non_null(mkdtemp(dir));
  model_params p = {.seed = model_seed, .n_ops = managed ? model_managed_ops : model_ops,
                    .n_threads = n_threads,
                    .spill_dir = dir, .idle_trim_ms = idle_trim_ms,
                    .free_buffer_pointers = true, .managed = managed};
  model_result r;
  char err[MODEL_ERR_MAX] = "";
  int rc = model_run(&p, &r, err, sizeof err);
  printf("# model%s: %d thread(s), seed %llu: %llu ops, %llu checkpoints, %llu refused for room, "
         "%llu I/O, buffers found in vram/shared/disk %llu/%llu/%llu, %llu device writes, "
         "%llu movable allocations, %llu rewrites through pointers\n",
         managed ? " (managed pointers)" : "", n_threads, (unsigned long long)model_seed,
         (unsigned long long)r.n_ops,
         (unsigned long long)r.n_checkpoints, (unsigned long long)r.n_nomem,
         (unsigned long long)r.n_io, (unsigned long long)r.n_tier_seen[0],
         (unsigned long long)r.n_tier_seen[1], (unsigned long long)r.n_tier_seen[2],
         (unsigned long long)r.n_device_writes, (unsigned long long)r.n_movable,
         (unsigned long long)r.n_alloc_writes);
  /* The spill file is O_TMPFILE: the folder must be empty again. */
  int gone = rmdir(dir);
  if (rc != 0) fail_msg("%s (replay: SGM_MODEL_SEED=%llu)", err, (unsigned long long)model_seed);
  assert_int_equal(gone, 0);
  /* The run must have reached every tier, else it checked less than it claims. */
  assert_true(r.n_tier_seen[SGM_TIER_VRAM] > 0);
  assert_true(r.n_tier_seen[SGM_TIER_SHARED] > 0);
  assert_true(r.n_tier_seen[SGM_TIER_DISK] > 0);
  if (managed) assert_true(r.n_movable > 0 && r.n_alloc_writes > 0);
}

static void run_model(int n_threads, uint64_t idle_trim_ms) { run_model_ex(n_threads, idle_trim_ms, false); }

/* Invariant: alone, every call sequence keeps every byte, no overlap, and the
 * tiers' used bytes equal the model's at every checkpoint. */
static void test_model_one_thread(void **state) {
  (void)state;
  run_model(1, 0);
}

/* The same with two threads sharing the context, idle trim running. */
static void test_model_two_threads_idle_trim(void **state) {
  (void)state;
  run_model(2, 1);
}

/* The same with four threads sharing the context. */
static void test_model_four_threads(void **state) {
  (void)state;
  run_model(4, 0);
}

/* The same three configurations with SGM_POINTERS=managed (issue 29): movable
 * blocks move between VRAM and shared memory while their owners rewrite them
 * through their pointers; every byte must survive every move. */
static void test_model_managed_one_thread(void **state) {
  (void)state;
  run_model_ex(1, 0, true);
}

static void test_model_managed_two_threads_idle_trim(void **state) {
  (void)state;
  run_model_ex(2, 1, true);
}

static void test_model_managed_four_threads(void **state) {
  (void)state;
  run_model_ex(4, 0, true);
}

int main(void) {
  const char *s = getenv("SGM_MODEL_SEED");
  if (s && *s) model_seed = strtoull(s, NULL, 0);
  const char *n = getenv("SGM_MODEL_OPS");
  if (n && *n) model_ops = model_managed_ops = strtoull(n, NULL, 0);
  printf("# test_model: seed %llu, %llu operations per thread, %llu with managed pointers "
         "(SGM_MODEL_SEED, SGM_MODEL_OPS)\n",
         (unsigned long long)model_seed, (unsigned long long)model_ops,
         (unsigned long long)model_managed_ops);
  /* SGM_MODEL_ONLY=test_model_managed_four_threads (a glob) runs one
   * configuration: the 20-seed runs under the sanitizers (docs/testing.md).
   * Read before sgm_test_clean_env unsets every SGM_* variable. */
  char only[128] = "";
  const char *o = getenv("SGM_MODEL_ONLY");
  if (o) snprintf(only, sizeof only, "%s", o);
  sgm_test_clean_env();
  struct CMUnitTest tests[] = {
      cmocka_unit_test(test_model_one_thread),
      cmocka_unit_test(test_model_two_threads_idle_trim),
      cmocka_unit_test(test_model_four_threads),
      cmocka_unit_test(test_model_managed_one_thread),
      cmocka_unit_test(test_model_managed_two_threads_idle_trim),
      cmocka_unit_test(test_model_managed_four_threads),
  };
  size_t n_tests = sizeof tests / sizeof tests[0], kept = 0;
  for (size_t i = 0; i < n_tests; i++)
    if (!only[0] || fnmatch(only, tests[i].name, 0) == 0) tests[kept++] = tests[i];
  return _cmocka_run_group_tests("test_model", tests, kept, NULL, NULL);
}
