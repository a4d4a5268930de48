// torch_abi.cc — sgm's PyTorch pool hooks called the way PyTorch calls them:
// the exported address cast to the C++ function type of
// torch/csrc/cuda/Module.cpp's setter (c10::cuda::MempoolId_t is a
// std::pair<unsigned long long, unsigned long long>, the filter a
// std::function) and wrapped in a std::function, as
// CUDAPluggableAllocator stores it. Checks that the arguments arrive where
// sgm's C signatures read them: the pool id from both halves of the pair, the
// stream of the 2.1-2.2 form, and that sgm never calls the filter.
// Runs on emu.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <utility>

#include "sgm.h"

namespace {
using MempoolId = std::pair<unsigned long long, unsigned long long>;
using Filter = std::function<bool(void *)>;  // std::function<bool(cudaStream_t)>
using BeginFn = void(int, MempoolId, Filter);
using EndFn = void(int, MempoolId);
using BeginStreamFn = void(int, void *, MempoolId);
using EndStreamFn = void(int, void *);

int failures = 0;
#define CHECK(c)                                                          \
  do {                                                                    \
    if (!(c)) {                                                           \
      std::fprintf(stderr, "torch_abi: %s:%d: %s\n", __FILE__, __LINE__, #c); \
      failures++;                                                         \
    }                                                                     \
  } while (0)

// Module.cpp: `reinterpret_cast<FuncType*>(func_ptr)` of the uint64 address.
template <typename F>
std::function<F> as_pytorch(void (*fn)()) {
  uint64_t func_ptr = reinterpret_cast<uint64_t>(fn);
  return std::function<F>(reinterpret_cast<F *>(func_ptr));
}
#define ADDR(f) reinterpret_cast<void (*)()>(&f)

sgm_capture_pool_stats info(sgm_context *ctx, uint64_t id, sgm_status *rc) {
  sgm_capture_pool_stats st;
  *rc = sgm_capture_pool_info(ctx, id, &st);
  return st;
}
}  // namespace

int main() {
  setenv("SGM_EMU_VRAM", "256MiB", 0);
  setenv("SGM_VERBOSE", "0", 0);
  auto begin = as_pytorch<BeginFn>(ADDR(sgm_torch_begin_allocate_to_pool));
  auto end = as_pytorch<EndFn>(ADDR(sgm_torch_end_allocate_to_pool));
  auto release = as_pytorch<EndFn>(ADDR(sgm_torch_release_pool));
  auto begin_stream = as_pytorch<BeginStreamFn>(ADDR(sgm_torch_begin_allocate_stream_to_pool));
  auto end_stream = as_pytorch<EndStreamFn>(ADDR(sgm_torch_end_allocate_stream_to_pool));
  sgm_context *ctx = sgm_hook_context(0);
  if (!ctx) {
    std::fprintf(stderr, "torch_abi: no hook context: %s\n", sgm_last_error());
    return 1;
  }
  const size_t MiB = size_t(1) << 20;
  sgm_status rc;

  // 2.3+: a graph pool {5, 0}; the filter must never be called.
  bool filter_called = false;
  begin(0, MempoolId{5, 0}, [&filter_called](void *) { return filter_called = true; });
  sgm_capture_pool_stats st = info(ctx, 5, &rc);
  CHECK(rc == SGM_OK && st.n_pools == 1);
  void *p = sgm_torch_malloc(MiB, 0, nullptr);
  sgm_torch_free(p, MiB, 0, nullptr);
  st = info(ctx, 5, &rc);
  CHECK(rc == SGM_OK && st.parked_bytes == MiB && st.n_parked == 1);
  end(0, MempoolId{5, 0});
  void *q = sgm_torch_malloc(MiB, 0, nullptr);  // after the end: not the pool's
  CHECK(q != p);
  sgm_torch_free(q, MiB, 0, nullptr);
  release(0, MempoolId{5, 0});
  info(ctx, 5, &rc);
  CHECK(rc == SGM_ERR_INVALID);
  CHECK(!filter_called);

  // A MemPool id {0, 7}: the second half, with the top bit.
  const uint64_t mem_pool = (uint64_t(1) << 63) | 7;
  begin(0, MempoolId{0, 7}, Filter());
  st = info(ctx, mem_pool, &rc);
  CHECK(rc == SGM_OK && st.n_pools == 1);
  end(0, MempoolId{0, 7});
  release(0, MempoolId{0, 7});
  info(ctx, mem_pool, &rc);
  CHECK(rc == SGM_ERR_INVALID);

  // 2.1-2.2: (device, stream, pool) and (device, stream).
  void *s = reinterpret_cast<void *>(uintptr_t(0x2));  // the per-thread stream
  begin_stream(0, s, MempoolId{9, 0});
  void *a = sgm_torch_malloc(MiB, 0, s);        // on the capture stream: the pool's
  void *b = sgm_torch_malloc(MiB, 0, nullptr);  // another stream: not
  st = info(ctx, 9, &rc);
  CHECK(rc == SGM_OK && st.n_live == 1 && st.live_bytes == MiB);
  end_stream(0, s);
  void *c = sgm_torch_malloc(MiB, 0, s);        // the scope ended
  st = info(ctx, 9, &rc);
  CHECK(rc == SGM_OK && st.n_live == 1);
  release(0, MempoolId{9, 0});
  sgm_torch_free(a, MiB, 0, s);
  sgm_torch_free(b, MiB, 0, nullptr);
  sgm_torch_free(c, MiB, 0, s);
  info(ctx, 0, &rc);
  CHECK(rc == SGM_OK);
  st = info(ctx, 0, &rc);
  CHECK(st.n_pools == 0);

  if (failures) return 1;
  std::printf("torch_abi: pool hooks called through PyTorch's C++ function types: OK\n");
  return 0;
}
