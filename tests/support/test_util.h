/*
 * test_util.h — helpers shared by the cmocka suites: a seeded random
 * generator (the seed is printed so a failure can be replayed) and
 * environment scrubbing so every test starts from a known configuration.
 */
#ifndef SGM_TEST_UTIL_H
#define SGM_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka.h needs the headers above first. */
#include <cmocka.h>

typedef struct sgm_test_rng {
  uint64_t s; /* xorshift64* state, never 0 */
} sgm_test_rng;

/* The suite's seed: SGM_TEST_SEED if set, else fallback; printed to stdout. */
uint64_t sgm_test_seed(const char *suite, uint64_t fallback);
void sgm_test_rng_init(sgm_test_rng *r, uint64_t seed);
uint64_t sgm_test_rng_next(sgm_test_rng *r);
/* Uniform in [lo, hi]. */
uint64_t sgm_test_rng_range(sgm_test_rng *r, uint64_t lo, uint64_t hi);
/* Log-uniform in [lo, hi] (both > 0). */
uint64_t sgm_test_rng_log_range(sgm_test_rng *r, uint64_t lo, uint64_t hi);

/* Unset every SGM_* variable and the foreign ones sgm reads, then set
 * SGM_BACKEND=emu, SGM_VERBOSE=0 and SGM_NODE=off. */
void sgm_test_clean_env(void);

/* Fork; the child runs child(arg), which must end the process (_exit, or an
 * abort for a death test), with its stderr going into out (the parent reads
 * all of it: NUL-terminated, cut to len - 1 bytes). Returns the child's wait
 * status. */
int sgm_test_fork_capture(void (*child)(void *arg), void *arg, char *out, size_t len);
/* The death test's check: the status says SIGABRT and out holds needle
 * (fails the test with out shown otherwise). */
void sgm_test_assert_aborted(int status, const char *out, const char *needle);

#endif
