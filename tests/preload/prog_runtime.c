/*
 * prog_runtime.c — a program that reaches the driver the way the CUDA runtime
 * does: dlopen("libcuda.so.1"), dlsym of cuGetProcAddress_v2 only, and every
 * other entry point through cuGetProcAddress, asked for several CUDA versions
 * and both default-stream flags (prog_common.h says what it checks).
 * Under the preload (TEST_EXPECT_PRELOAD=1) it also checks that the hooked
 * entries it got are the preload's, one per ABI and stream flag: the legacy
 * and per-thread cuMemAllocAsync differ, and unhooked ones are the driver's.
 */
#include "prog_common.h"

typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
static gpa_fn gpa;

static void *get(const char *name, int version, cuuint64_t flags) {
  void *p = NULL;
  CUdriverProcAddressQueryResult st;
  PROG_CHECK(gpa(name, &p, version, flags, &st));
  if (!p || st != CU_GET_PROC_ADDRESS_SUCCESS) PROG_FAIL("cuGetProcAddress(%s, %d) found nothing", name, version);
  return p;
}

static int from_preload(void *p) {
  Dl_info i;
  return dladdr(p, &i) && i.dli_fname && strstr(i.dli_fname, "libsgm-preload") != NULL;
}

int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) PROG_FAIL("dlopen libcuda.so.1: %s", dlerror());
  gpa = (gpa_fn)dlsym(h, "cuGetProcAddress_v2");
  if (!gpa) PROG_FAIL("no cuGetProcAddress_v2");
  const cuuint64_t legacy = CU_GET_PROC_ADDRESS_LEGACY_STREAM, pt = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  CUresult (*init)(unsigned) = (CUresult(*)(unsigned))get("cuInit", 12000, legacy);
  CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))get("cuDevicePrimaryCtxRetain", 12000, legacy);
  CUresult (*release)(CUdevice) = (CUresult(*)(CUdevice))get("cuDevicePrimaryCtxRelease", 12000, legacy);
  CUresult (*setcur)(CUcontext) = (CUresult(*)(CUcontext))get("cuCtxSetCurrent", 12000, legacy);
  /* the allocation entries at three versions and both flags: each must work */
  CUresult (*alloc12)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))get("cuMemAlloc", 12000, legacy);
  CUresult (*alloc13)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))get("cuMemAlloc", 13000, pt);
  CUresult (*free_)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))get("cuMemFree", 12080, legacy);
  CUresult (*htod)(CUdeviceptr, const void *, size_t) = (CUresult(*)(CUdeviceptr, const void *, size_t))get("cuMemcpyHtoD", 12000, legacy);
  CUresult (*dtoh)(void *, CUdeviceptr, size_t) = (CUresult(*)(void *, CUdeviceptr, size_t))get("cuMemcpyDtoH", 12000, legacy);
  CUresult (*info)(size_t *, size_t *) = (CUresult(*)(size_t *, size_t *))get("cuMemGetInfo", 11000, legacy);
  void *async_legacy = get("cuMemAllocAsync", 12000, legacy), *async_pt = get("cuMemAllocAsync", 12000, pt);
  void *gpa_again = get("cuGetProcAddress", 12000, legacy);
  void *sync_ = get("cuStreamSynchronize", 12000, legacy);
  if (prog_expect_preload()) {
    if (!from_preload(alloc12) || !from_preload(alloc13) || !from_preload(free_) || !from_preload(info) ||
        !from_preload(async_legacy) || !from_preload(async_pt) || !from_preload(gpa_again))
      PROG_FAIL("cuGetProcAddress handed out a driver function the preload hooks");
    if (async_legacy == async_pt) PROG_FAIL("legacy and per-thread cuMemAllocAsync got the same hook");
    if (from_preload(sync_) || from_preload(htod)) PROG_FAIL("an unhooked entry was swapped");
  }
  PROG_CHECK(init(0));
  CUcontext ctx;
  PROG_CHECK(retain(&ctx, 0));
  PROG_CHECK(setcur(ctx));
  size_t fr = 0, tot = 0;
  PROG_CHECK(info(&fr, &tot));
  size_t n = prog_n_blocks();
  CUdeviceptr d[PROG_MAX_BLOCKS];
  unsigned char *buf = malloc(PROG_BLOCK);
  if (!buf) PROG_FAIL("no host memory");
  for (size_t i = 0; i < n; i++) {
    CUresult r = (i % 2 ? alloc13 : alloc12)(&d[i], PROG_BLOCK);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) prog_oom("cuMemAlloc", i);
    PROG_CHECK(r);
    prog_fill(buf, PROG_BLOCK, i);
    PROG_CHECK(htod(d[i], buf, PROG_BLOCK));
  }
  prog_check_smi();
  prog_read_back(n, d, buf, dtoh, free_);
  prog_check_no_leak();
  free(buf);
  PROG_CHECK(setcur(NULL));
  PROG_CHECK(release(0));
  printf("runtime-style: %zu blocks of %zu bytes (device total %zu) intact\n", n, PROG_BLOCK, tot);
  return 0;
}
