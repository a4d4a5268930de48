/*
 * fake_fixture.h — the CUDA driver test double (tests/support/fake_cuda) as
 * the cmocka suites that run sgm on it load and use it: its control API
 * looked up once, device 0's primary context made current for the test's own
 * driver calls, and the suite's main() that skips (exit 77) where
 * libcuda.so.1 on LD_LIBRARY_PATH is not the double. One copy of what
 * test_capture.c, test_stream_order.c and test_migrate.c each did.
 */
#ifndef SGM_FAKE_FIXTURE_H
#define SGM_FAKE_FIXTURE_H

#include <stdbool.h>
#include <stddef.h>

#include "sgm.h"

#include "fake_cuda.h"
#include "test_util.h"

/* The double's control functions (fake_cuda.h), looked up with dlsym. */
typedef struct sgm_fake_control {
#define SGM_FAKE_MEMBER(ret, name, params) ret(*name) params;
  FAKE_CUDA_CONTROL(SGM_FAKE_MEMBER)
#undef SGM_FAKE_MEMBER
} sgm_fake_control;

/* dlopen libcuda.so.1 as sgm will find it, fill *fc with the double's
 * control API and reset the double. The handle (for sgm_fake_need), or NULL
 * after saying on stderr what is missing. Call from the group setup. */
void *sgm_fake_load(sgm_fake_control *fc);

/* A suite's double in one place: sgm_fake_group_setup loads it into these
 * (sgm_fake_load), sgm_fake_group_teardown closes it; cmocka group fixtures
 * for sgm_fake_run_suite. */
extern sgm_fake_control sgm_fake_fc;
extern void *sgm_fake_lib;
int sgm_fake_group_setup(void **state);
int sgm_fake_group_teardown(void **state);

/* dlsym(lib, name); NULL after saying on stderr that the double lacks it. */
void *sgm_fake_need(void *lib, const char *name);

/* Retain device 0's primary context and make it current on this thread, as
 * an application does before queueing its own work (captures, events,
 * copies); sgm_fake_ctx_pop pops and releases it. Both assert success. */
void sgm_fake_ctx_push(void *lib);
void sgm_fake_ctx_pop(void *lib);

/* A CU_STREAM_NON_BLOCKING stream of device 0's primary context (the legacy
 * stream does not order it: PyTorch's side streams), made and destroyed
 * through the double's cuStreamCreate/cuStreamDestroy. Both assert success. */
void *sgm_fake_non_blocking_stream(void *lib);
void sgm_fake_stream_destroy(void *lib, void *stream);

/* An sgm context on the double (SGM_BACKEND=cuda, device 0) from a clean
 * environment: VRAM budget vram_limit in growth mode, shared fallback on or
 * off, and SGM_IDLE_TRIM_MS set to idle_trim_ms unless it is NULL (the
 * default then). Fails the test, naming sgm's error, when create fails. */
sgm_context *sgm_fake_sgm_context(const char *vram_limit, bool fallback, const char *idle_trim_ms);

/* The suite's main(): 77 (skipped, with a line naming the suite) when
 * libcuda.so.1 cannot be loaded or has no `needed` (a control function only
 * the double has), else the cmocka group `suite` with setup and teardown. */
int sgm_fake_run_suite(const char *suite, const char *needed, const struct CMUnitTest *tests,
                       size_t n, CMFixtureFunction setup, CMFixtureFunction teardown);

#endif /* SGM_FAKE_FIXTURE_H */
