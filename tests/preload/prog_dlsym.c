/*
 * prog_dlsym.c — a program that resolves versioned names with dlsym on its
 * own handle of the driver (XLA's way: "cuMemAlloc_v2", "cuMemFree_v2", ...)
 * (prog_common.h says what it checks). It also asks for names the preload
 * must leave alone: a non-driver name with the cu prefix but no capital
 * ("cudnnCreate"-like) through RTLD_DEFAULT, and RTLD_NEXT from the program
 * itself, which must resolve relative to the program (not the preload).
 * Under the preload the cu* entries it gets must be the preload's hooks.
 */
#include "prog_common.h"

int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) PROG_FAIL("dlopen: %s", dlerror());
#define SYM(var, type, name)                                   \
  __typeof__(type) var = (__typeof__(type))dlsym(h, name);                           \
  if (!var) PROG_FAIL("dlsym %s: %s", name, dlerror());
  SYM(init, CUresult(*)(unsigned), "cuInit")
  SYM(retain, CUresult(*)(CUcontext *, CUdevice), "cuDevicePrimaryCtxRetain")
  SYM(release, CUresult(*)(CUdevice), "cuDevicePrimaryCtxRelease_v2")
  SYM(setcur, CUresult(*)(CUcontext), "cuCtxSetCurrent")
  SYM(alloc, CUresult(*)(CUdeviceptr *, size_t), "cuMemAlloc_v2")
  SYM(free_, CUresult(*)(CUdeviceptr), "cuMemFree_v2")
  SYM(htod, CUresult(*)(CUdeviceptr, const void *, size_t), "cuMemcpyHtoD_v2")
  SYM(dtoh, CUresult(*)(void *, CUdeviceptr, size_t), "cuMemcpyDtoH_v2")
  SYM(info, CUresult(*)(size_t *, size_t *), "cuMemGetInfo_v2")
#undef SYM
  if (prog_expect_preload()) {
    Dl_info di;
    if (!dladdr((void *)alloc, &di) || !strstr(di.dli_fname, "libsgm-preload"))
      PROG_FAIL("dlsym(libcuda, cuMemAlloc_v2) was not swapped for the hook");
  }
  /* RTLD_NEXT from the program: the next definition after the program, i.e.
   * libc's (a forwarding dlsym that lost the caller would still find it, so
   * also ask for a name only the program defines: none after it). */
  if (!dlsym(RTLD_NEXT, "malloc")) PROG_FAIL("dlsym(RTLD_NEXT, malloc) found nothing");
  if (dlsym(RTLD_NEXT, "main")) PROG_FAIL("dlsym(RTLD_NEXT, main) found the program's own main");
  /* A name only the preload defines lies after the program: found from the
   * program, not from the preload (a forwarder that lost the caller misses it). */
  if (prog_expect_preload() && !dlsym(RTLD_NEXT, "sgm_preload_dlvsym"))
    PROG_FAIL("dlsym(RTLD_NEXT) from the program resolved relative to the preload, not the program");
  if (dlsym(RTLD_DEFAULT, "cudnnNoSuchFunction")) PROG_FAIL("a cudnn name resolved");
  /* A hook whose driver entry does not exist (the double has no
   * cuMemAllocPitch_v2) answers NOT_SUPPORTED: a NULL entry is never called. */
  CUresult (*pitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned) =
      (CUresult(*)(CUdeviceptr *, size_t *, size_t, size_t, unsigned))dlsym(RTLD_DEFAULT, "cuMemAllocPitch_v2");
  if (prog_expect_preload()) {
    CUdeviceptr pp = 0;
    size_t pitch_bytes = 0;
    if (!pitch) PROG_FAIL("the preload does not export cuMemAllocPitch_v2");
    CUresult rp = pitch(&pp, &pitch_bytes, 1000, 10, 4);
    if (rp != CUDA_ERROR_NOT_SUPPORTED) PROG_FAIL("a hook without a driver entry answered %d", (int)rp);
  }
  PROG_CHECK(init(0));
  CUcontext ctx;
  PROG_CHECK(retain(&ctx, 0));
  PROG_CHECK(setcur(ctx));
  size_t fr = 0, tot = 0;
  PROG_CHECK(info(&fr, &tot));
  printf("cuMemGetInfo: free %zu total %zu\n", fr, tot);
  size_t n = prog_n_blocks();
  CUdeviceptr d[PROG_MAX_BLOCKS];
  unsigned char *buf = malloc(PROG_BLOCK);
  if (!buf) PROG_FAIL("no host memory");
  for (size_t i = 0; i < n; i++) {
    CUresult r = alloc(&d[i], PROG_BLOCK);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) prog_oom("cuMemAlloc_v2", i);
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
  printf("dlsym _v2: %zu blocks of %zu bytes intact\n", n, PROG_BLOCK);
  return 0;
}
