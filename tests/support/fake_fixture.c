/*
 * fake_fixture.c — the driver test double as the suites load it (see
 * fake_fixture.h). The driver entry points it calls are reached by the
 * names the double exports (cuda.h's macros add the _v2), with the types
 * written out, so that it builds without cuda.h.
 */
#include "fake_fixture.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

sgm_fake_control sgm_fake_fc;
void *sgm_fake_lib;

int sgm_fake_group_setup(void **state) {
  (void)state;
  sgm_fake_lib = sgm_fake_load(&sgm_fake_fc);
  return sgm_fake_lib ? 0 : -1;
}

int sgm_fake_group_teardown(void **state) {
  (void)state;
  if (sgm_fake_lib) dlclose(sgm_fake_lib);
  sgm_fake_lib = NULL;
  return 0;
}

void *sgm_fake_need(void *lib, const char *name) {
  void *p = dlsym(lib, name);
  if (!p) fprintf(stderr, "libcuda.so.1 is not the driver test double, or an old one: no %s\n", name);
  return p;
}

void *sgm_fake_load(sgm_fake_control *fc) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "cannot load libcuda.so.1: %s\n", dlerror());
    return NULL;
  }
  int missing = 0;
#define SGM_FAKE_LOOKUP(ret, name, params) missing |= !(*(void **)&fc->name = sgm_fake_need(lib, #name));
  FAKE_CUDA_CONTROL(SGM_FAKE_LOOKUP)
#undef SGM_FAKE_LOOKUP
  if (missing) {
    dlclose(lib);
    return NULL;
  }
  fc->fake_cuda_reset();
  return lib;
}

typedef int (*sgm_fake_device_get_fn)(int *dev, int ordinal);
typedef int (*sgm_fake_retain_fn)(void **ctx, int dev);
typedef int (*sgm_fake_release_fn)(int dev);
typedef int (*sgm_fake_push_fn)(void *ctx);
typedef int (*sgm_fake_pop_fn)(void **ctx);

static int fake_device0(void *lib) {
  sgm_fake_device_get_fn get = (sgm_fake_device_get_fn)sgm_fake_need(lib, "cuDeviceGet");
  assert_non_null(get);
  int dev = -1;
  assert_int_equal(get(&dev, 0), 0);
  return dev;
}

void sgm_fake_ctx_push(void *lib) {
  sgm_fake_retain_fn retain = (sgm_fake_retain_fn)sgm_fake_need(lib, "cuDevicePrimaryCtxRetain");
  sgm_fake_push_fn push = (sgm_fake_push_fn)sgm_fake_need(lib, "cuCtxPushCurrent_v2");
  assert_true(retain && push);
  void *ctx = NULL;
  assert_int_equal(retain(&ctx, fake_device0(lib)), 0);
  assert_int_equal(push(ctx), 0);
}

void sgm_fake_ctx_pop(void *lib) {
  sgm_fake_pop_fn pop = (sgm_fake_pop_fn)sgm_fake_need(lib, "cuCtxPopCurrent_v2");
  sgm_fake_release_fn release = (sgm_fake_release_fn)sgm_fake_need(lib, "cuDevicePrimaryCtxRelease_v2");
  assert_true(pop && release);
  void *ctx = NULL;
  assert_int_equal(pop(&ctx), 0);
  assert_int_equal(release(fake_device0(lib)), 0);
}

typedef int (*sgm_fake_stream_create_fn)(void **s, unsigned flags);
typedef int (*sgm_fake_stream_destroy_fn)(void *s);

sgm_context *sgm_fake_sgm_context(const char *vram_limit, bool fallback, const char *idle_trim_ms) {
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_VRAM_LIMIT", vram_limit, 1);
  setenv("SGM_ALLOW_GROWTH", "on", 1);
  setenv("SGM_SHARED_FALLBACK", fallback ? "on" : "off", 1);
  if (idle_trim_ms) setenv("SGM_IDLE_TRIM_MS", idle_trim_ms, 1);
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fail_msg("sgm_context_create on the double: %s", sgm_last_error());
  return ctx;
}

void *sgm_fake_non_blocking_stream(void *lib) {
  sgm_fake_stream_create_fn create = (sgm_fake_stream_create_fn)sgm_fake_need(lib, "cuStreamCreate");
  assert_non_null(create);
  void *s = NULL;
  sgm_fake_ctx_push(lib);
  assert_int_equal(create(&s, 1 /* CU_STREAM_NON_BLOCKING */), 0);
  sgm_fake_ctx_pop(lib);
  return s;
}

void sgm_fake_stream_destroy(void *lib, void *stream) {
  sgm_fake_stream_destroy_fn destroy =
      (sgm_fake_stream_destroy_fn)sgm_fake_need(lib, "cuStreamDestroy_v2");
  assert_non_null(destroy);
  sgm_fake_ctx_push(lib);
  assert_int_equal(destroy(stream), 0);
  sgm_fake_ctx_pop(lib);
}

int sgm_fake_run_suite(const char *suite, const char *needed, const struct CMUnitTest *tests,
                       size_t n, CMFixtureFunction setup, CMFixtureFunction teardown) {
  void *probe = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!probe || !dlsym(probe, needed)) {
    printf("# %s: the driver test double (with %s) is not on LD_LIBRARY_PATH: skipped\n", suite,
           needed);
    if (probe) dlclose(probe);
    return 77;
  }
  dlclose(probe);
  return _cmocka_run_group_tests(suite, tests, n, setup, teardown);
}
