// preload_nvcc.cu — the GPU check's unmodified nvcc-built program for
// libsgm-preload.so (issue 27; tests/gpu/preload_check.sh runs it). It knows
// nothing of sgm: cudaMalloc (the runtime reaches the driver through
// cuGetProcAddress), a kernel pass over every block, a checksum read back.
//
//   preload-nvcc fixed LIMIT_BYTES   blocks of 1.5x LIMIT with cudaMalloc (run it under
//                                    LD_PRELOAD=libsgm-preload.so SGM_VRAM_LIMIT=LIMIT)
//   preload-nvcc um LIMIT_BYTES      the reference: the same blocks with cudaMallocManaged
//                                    while a cudaMalloc filler holds all free memory but
//                                    LIMIT (+ headroom): the driver must page
//   preload-nvcc --dry-run LIMIT FREE   the sizes only
// Prints "time: S" (seconds of the kernel passes) and "checked: N blocks".
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <chrono>
#include <cuda_runtime.h>

static const int kBlocks = 12;  // 12 x LIMIT/8 = 1.5x LIMIT
static const int kRounds = 4;
static const size_t kHeadroom = size_t(512) << 20;

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                   \
      std::exit(e_ == cudaErrorMemoryAllocation ? 2 : 1);                              \
    }                                                                                  \
  } while (0)

__global__ void pass(int *x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = x[i] * 3 + 1;
}

__global__ void init(int *x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = int(i % 1024);
}

int main(int argc, char **argv) {
  if (argc >= 4 && !std::strcmp(argv[1], "--dry-run")) {
    size_t limit = std::strtoull(argv[2], 0, 0), fr = std::strtoull(argv[3], 0, 0);
    size_t per = limit / 8 / (2u << 20) * (2u << 20);
    std::printf("dry run: limit %zu MiB, %d blocks of %zu MiB = %zu MiB (1.5x), um filler %zu MiB\n",
                limit >> 20, kBlocks, per >> 20, (per * kBlocks) >> 20,
                fr > limit + kHeadroom ? (fr - limit - kHeadroom) >> 20 : 0);
    return per * kBlocks <= fr && per > 0 ? 0 : 1;
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: preload-nvcc fixed|um LIMIT_BYTES | --dry-run LIMIT FREE\n");
    return 64;
  }
  bool um = !std::strcmp(argv[1], "um");
  size_t limit = std::strtoull(argv[2], 0, 0);
  size_t per = limit / 8 / (2u << 20) * (2u << 20), n = per / sizeof(int);
  void *filler = 0;
  if (um) {
    size_t fr = 0, tot = 0;
    CK(cudaMemGetInfo(&fr, &tot));
    if (fr > limit + kHeadroom) CK(cudaMalloc(&filler, fr - limit - kHeadroom));
  }
  std::vector<int *> b(kBlocks);
  for (int i = 0; i < kBlocks; i++) {
    if (um) CK(cudaMallocManaged((void **)&b[i], per));
    else CK(cudaMalloc((void **)&b[i], per));
    init<<<256, 256>>>(b[i], n);
  }
  CK(cudaDeviceSynchronize());
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < kRounds; r++)
    for (int i = 0; i < kBlocks; i++) pass<<<256, 256>>>(b[i], n);
  CK(cudaDeviceSynchronize());
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // every block's first 4096 values against the CPU's
  std::vector<int> h(4096);
  for (int i = 0; i < kBlocks; i++) {
    CK(cudaMemcpy(h.data(), b[i], h.size() * sizeof(int), cudaMemcpyDefault));
    for (size_t j = 0; j < h.size(); j++) {
      int v = int(j % 1024);
      for (int r = 0; r < kRounds; r++) v = int(unsigned(v) * 3u + 1u);
      if (h[j] != v) {
        std::fprintf(stderr, "block %d value %zu: %d, expected %d\n", i, j, h[j], v);
        return 1;
      }
    }
    CK(cudaFree(b[i]));
  }
  if (filler) CK(cudaFree(filler));
  std::printf("checked: %d blocks of %zu MiB\ntime: %.3f\n", kBlocks, per >> 20, dt);
  return 0;
}
