// bench_alloc.cc — the public path: sgm_alloc + sgm_free pairs on a warmed
// context (emulated device, growth mode), 1 and 2 threads, with jemalloc's
// mallocx/dallocx of the same sizes and alignment measured in the same run.
//
// Each iteration frees the oldest of a ring of live blocks and allocates a
// new one, so the allocator works on a populated heap, not an empty one.
#include <benchmark/benchmark.h>
#include <jemalloc/jemalloc.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sgm.h"

namespace {

constexpr int kRing = 64;      // live blocks per thread
constexpr int kSizes = 4096;   // precomputed sizes, cycled

std::vector<size_t> MakeSizes(uint64_t seed) {
  // Log-uniform 256 B .. 1 MiB: the spread of a framework's tensor sizes.
  std::vector<size_t> v(kSizes);
  uint64_t s = seed;
  for (auto &x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    double u = static_cast<double>(s >> 11) / 9007199254740992.0;
    x = static_cast<size_t>(std::exp(std::log(256.0) + u * (std::log(1048576.0) - std::log(256.0))));
  }
  return v;
}

sgm_context *Context() {
  static sgm_context *ctx = [] {
    sgm_context *c = nullptr;
    if (sgm_context_create(nullptr, &c) != SGM_OK) {
      std::fprintf(stderr, "bench_alloc: %s\n", sgm_last_error());
      std::exit(1);
    }
    return c;
  }();
  return ctx;
}

template <typename Alloc, typename Free>
void RunPairs(benchmark::State &state, Alloc alloc, Free release) {
  std::vector<size_t> sizes = MakeSizes(0x1234 + state.thread_index());
  void *ring[kRing];
  for (int i = 0; i < kRing; i++) ring[i] = alloc(sizes[i]);
  size_t k = 0;
  for (auto _ : state) {
    int slot = static_cast<int>(k % kRing);
    release(ring[slot], sizes[(k) % kSizes]);
    void *p = alloc(sizes[(k + kRing) % kSizes]);
    benchmark::DoNotOptimize(p);
    ring[slot] = p;
    k++;
  }
  for (int i = 0; i < kRing; i++) release(ring[i], 0);
  state.counters["pairs/s"] = benchmark::Counter(static_cast<double>(k), benchmark::Counter::kIsRate);
}

void BM_SgmAllocFree(benchmark::State &state) {
  sgm_context *ctx = Context();
  RunPairs(
      state, [ctx](size_t n) { return sgm_alloc(ctx, n, nullptr); },
      [ctx](void *p, size_t) { sgm_free(ctx, p, nullptr); });
  if (state.thread_index() == 0) {
    sgm_stats st;
    sgm_get_stats(ctx, &st);
    state.counters["committed_MiB"] = static_cast<double>(st.tier[SGM_TIER_VRAM].committed_bytes) / 1048576.0;
    state.counters["failed"] = static_cast<double>(st.tier[SGM_TIER_VRAM].n_failed);
  }
}

void BM_JemallocPair(benchmark::State &state) {
  RunPairs(
      state, [](size_t n) { return mallocx(n, MALLOCX_ALIGN(256)); },
      [](void *p, size_t) {
        if (p) dallocx(p, 0);
      });
}

BENCHMARK(BM_SgmAllocFree)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_JemallocPair)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace

int main(int argc, char **argv) {
  setenv("SGM_BACKEND", "emu", 0);
  setenv("SGM_VERBOSE", "0", 0);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  sgm_context_destroy(Context());
  return 0;
}
