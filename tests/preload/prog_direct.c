/*
 * prog_direct.c — a program linked against libcuda.so.1 (llama.cpp's way): it
 * calls cuMemAlloc (cuMemAlloc_v2 by cuda.h) and friends by name
 * (prog_common.h says what it checks). Also the preload's safety rules that
 * need a direct caller:
 *  - init order: a constructor calls cuMemAlloc before cuInit (the driver's
 *    NOT_INITIALIZED comes back, nothing crashes), and PROG_THREADS threads
 *    make their first hooked calls at once;
 *  - fork (TEST_FORK=1): a child's hooks pass through until it calls cuInit;
 *  - clear errors: cuPointerGetAttribute and cuIpcGetMemHandle on a fallback
 *    block answer NOT_SUPPORTED (and the driver's answer on its own blocks);
 *  - VMM: cuMemCreate/cuMemRelease of a device location accounted and given
 *    back, a host location answered by the driver itself;
 *  - TEST_COUNT=K: K alloc/free pairs that fit, counting the driver calls
 *    they make (the figure in docs/benchmarks.md).
 */
#include <pthread.h>
#include <sys/wait.h>

#include "prog_common.h"

#define PROG_THREADS 4

static CUresult ctor_result = CUDA_SUCCESS;
__attribute__((constructor)) static void prog_ctor(void) {
  CUdeviceptr p = 0;
  ctor_result = cuMemAlloc(&p, 4096);
}

static CUcontext ctx;

static void *prog_thread(void *arg) {
  (void)arg;
  if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return (void *)1;
  for (int i = 0; i < 50; i++) {
    CUdeviceptr p = 0;
    if (cuMemAlloc(&p, 65536) != CUDA_SUCCESS || cuMemFree(p) != CUDA_SUCCESS) return (void *)1;
  }
  return NULL;
}

static void prog_count(uint64_t k) {
  uint64_t (*calls)(const char *) = fake_cuda_calls;
  CUdeviceptr p = 0;
  PROG_CHECK(cuMemAlloc(&p, 1 << 20)); /* warm: the preload's one-off set-up happens here */
  PROG_CHECK(cuMemFree(p));
  uint64_t before = calls(NULL);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (uint64_t i = 0; i < k; i++) {
    PROG_CHECK(cuMemAlloc(&p, 1 << 20));
    PROG_CHECK(cuMemFree(p));
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  uint64_t after = calls(NULL);
  double ns = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)k;
  printf("driver_calls_per_pair=%.3f pairs=%llu ns_per_pair=%.0f (timing: not checked)\n",
         (double)(after - before) / (double)k, (unsigned long long)k, ns);
}

int main(void) {
  if (ctor_result != CUDA_ERROR_NOT_INITIALIZED)
    PROG_FAIL("cuMemAlloc before cuInit answered %d, not NOT_INITIALIZED", (int)ctor_result);
  PROG_CHECK(cuInit(0));
  PROG_CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
  PROG_CHECK(cuCtxSetCurrent(ctx));
  pthread_t t[PROG_THREADS];
  for (int i = 0; i < PROG_THREADS; i++) pthread_create(&t[i], NULL, prog_thread, NULL);
  for (int i = 0; i < PROG_THREADS; i++) {
    void *rv = NULL;
    pthread_join(t[i], &rv);
    if (rv) PROG_FAIL("thread %d failed", i);
  }
  /* VMM: a device-located handle is accounted and given back (the preload's
   * report must end with no accounted byte); a host-located request gets the
   * driver's own answer, never a refusal or a crash from the hook. */
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  size_t gran = 0;
  PROG_CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemGenericAllocationHandle hnd = 0;
  PROG_CHECK(cuMemCreate(&hnd, gran, &prop, 0));
  PROG_CHECK(cuMemRelease(hnd));
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
  CUresult rh = cuMemCreate(&hnd, gran, &prop, 0);
  if (rh != CUDA_ERROR_INVALID_VALUE) /* the double's answer for a host location */
    PROG_FAIL("cuMemCreate on a host location answered %d, not the driver's INVALID_VALUE", (int)rh);
  uint64_t k = prog_env_u64("TEST_COUNT", 0);
  if (k) {
    prog_count(k);
    return 0;
  }
  size_t n = prog_n_blocks();
  CUdeviceptr d[PROG_MAX_BLOCKS];
  unsigned char *buf = malloc(PROG_BLOCK);
  if (!buf) PROG_FAIL("no host memory");
  for (size_t i = 0; i < n; i++) {
    CUresult r = cuMemAlloc(&d[i], PROG_BLOCK);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) prog_oom("cuMemAlloc", i);
    PROG_CHECK(r);
    prog_fill(buf, PROG_BLOCK, i);
    PROG_CHECK(cuMemcpyHtoD(d[i], buf, PROG_BLOCK));
  }
  prog_check_smi();
  /* The first block is the driver's, the last a fallback (1.5x the device). */
  unsigned type = 0;
  PROG_CHECK(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d[0]));
  if (type != CU_MEMORYTYPE_DEVICE) PROG_FAIL("block 0 is not device memory (%u)", type);
  CUresult ra = cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d[n - 1] + 100);
  CUipcMemHandle ih;
  CUresult ri = cuIpcGetMemHandle(&ih, d[n - 1]);
  if (ra != CUDA_ERROR_NOT_SUPPORTED || ri != CUDA_ERROR_NOT_SUPPORTED)
    PROG_FAIL("a fallback block's attributes / IPC handle answered %d / %d, not NOT_SUPPORTED", (int)ra, (int)ri);
  if (prog_env_u64("TEST_FORK", 0)) {
    pid_t pid = fork();
    if (pid == 0) {
      /* Passing through: the driver (the double) describes the block itself. */
      CUresult c1 = cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d[n - 1]);
      cuInit(0); /* the child initialises CUDA itself: hooks again */
      CUresult c2 = cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d[n - 1]);
      _exit(c1 == CUDA_SUCCESS && c2 == CUDA_ERROR_NOT_SUPPORTED ? 0 : 10 + (int)c1 * 0 + (c2 == CUDA_SUCCESS));
    }
    int st = 0;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) PROG_FAIL("fork child: hooks did not pass through before "
                                                          "its cuInit and resume after (status %d)", st);
    printf("fork: the child's hooks passed through until its cuInit\n");
  }
  prog_read_back(n, d, buf, cuMemcpyDtoH, cuMemFree);
  prog_check_no_leak();
  free(buf);
  PROG_CHECK(cuDevicePrimaryCtxRelease(0));
  printf("direct link: %zu blocks of %zu bytes intact\n", n, PROG_BLOCK);
  return 0;
}
