/*
 * prog_async.c — a cudaMallocAsync-style program: stream-ordered allocation
 * from the device's default pool (cuMemAllocAsync) and from a pool it
 * creates (cuMemAllocFromPoolAsync), copies and frees ordered on its stream,
 * the per-thread variants through cuGetProcAddress (prog_common.h says what
 * it checks). Also: inside a stream capture, a request that does not fit must
 * get the driver's OUT_OF_MEMORY (no fallback into a graph).
 */
#include "prog_common.h"

typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);

int main(void) {
  PROG_CHECK(cuInit(0));
  CUcontext ctx;
  PROG_CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
  PROG_CHECK(cuCtxSetCurrent(ctx));
  CUstream s;
  PROG_CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  CUmemoryPool pool;
  PROG_CHECK(cuMemPoolCreate(&pool, &props));
  /* The per-thread default stream variants, as the runtime gets them. */
  void *pa = NULL, *pf = NULL;
  CUdriverProcAddressQueryResult st;
  PROG_CHECK(cuGetProcAddress("cuMemAllocAsync", &pa, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
  PROG_CHECK(cuGetProcAddress("cuMemFreeAsync", &pf, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
  if (!pa || !pf) PROG_FAIL("no per-thread cuMemAllocAsync / cuMemFreeAsync");
  alloc_async_fn alloc_pt = (alloc_async_fn)pa;
  free_async_fn free_pt = (free_async_fn)pf;

  size_t n = prog_n_blocks();
  CUdeviceptr d[PROG_MAX_BLOCKS];
  unsigned char *buf = malloc(PROG_BLOCK);
  if (!buf) PROG_FAIL("no host memory");
  for (size_t i = 0; i < n; i++) {
    CUresult r;
    const char *what;
    switch (i % 3) {
    case 0: r = cuMemAllocAsync(&d[i], PROG_BLOCK, s); what = "cuMemAllocAsync"; break;
    case 1: r = cuMemAllocFromPoolAsync(&d[i], PROG_BLOCK, pool, s); what = "cuMemAllocFromPoolAsync"; break;
    default: r = alloc_pt(&d[i], PROG_BLOCK, NULL); what = "cuMemAllocAsync_ptsz"; break;
    }
    if (r == CUDA_ERROR_OUT_OF_MEMORY) prog_oom(what, i);
    PROG_CHECK(r);
    prog_fill(buf, PROG_BLOCK, i);
    CUstream on = i % 3 == 2 ? CU_STREAM_PER_THREAD : s;
    PROG_CHECK(cuMemcpyHtoDAsync(d[i], buf, PROG_BLOCK, on)); /* pageable: staged at enqueue */
  }
  PROG_CHECK(cuStreamSynchronize(s));
  PROG_CHECK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
  prog_check_smi();
  if (prog_expect_preload()) {
    /* Device and budget full now: inside a capture the request must fail. */
    CUstream cs;
    PROG_CHECK(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));
    PROG_CHECK(cuStreamBeginCapture(cs, CU_STREAM_CAPTURE_MODE_RELAXED));
    CUdeviceptr x = 0;
    CUresult r = cuMemAllocAsync(&x, PROG_BLOCK * 4, cs);
    CUgraph g = NULL;
    cuStreamEndCapture(cs, &g);
    if (g) cuGraphDestroy(g);
    PROG_CHECK(cuStreamDestroy(cs));
    if (r != CUDA_ERROR_OUT_OF_MEMORY) PROG_FAIL("an allocation inside a capture answered %d, not the "
                                                 "driver's OUT_OF_MEMORY", (int)r);
    printf("capture: no fallback, the driver's OUT_OF_MEMORY\n");
  }
  for (size_t i = 0; i < n; i++) {
    memset(buf, 0, PROG_BLOCK);
    CUstream on = i % 3 == 2 ? CU_STREAM_PER_THREAD : s;
    PROG_CHECK(cuMemcpyDtoHAsync(buf, d[i], PROG_BLOCK, on)); /* pageable: returns when done */
    prog_verify(buf, PROG_BLOCK, i);
    PROG_CHECK(i % 3 == 2 ? free_pt(d[i], NULL) : cuMemFreeAsync(d[i], s));
  }
  PROG_CHECK(cuStreamSynchronize(s));
  PROG_CHECK(cuMemPoolDestroy(pool));
  prog_check_no_leak();
  free(buf);
  PROG_CHECK(cuStreamDestroy(s));
  PROG_CHECK(cuDevicePrimaryCtxRelease(0));
  printf("stream-ordered: %zu blocks of %zu bytes intact\n", n, PROG_BLOCK);
  return 0;
}
