// bench_shared.cc — the shared GPU memory tier (issue 3), each figure beside
// its reference in the same run:
//  - Fallback path: sgm_alloc + sgm_free pairs when the VRAM budget is full,
//    so every block lands in shared memory; against the VRAM path (the same
//    pairs with VRAM free) and jemalloc's mallocx/dallocx of the same sizes.
//  - Commit cost: the allocation that pins a fresh shared chunk (mmap, NUMA
//    bind, mlock through the backend, then carving) against doing mmap + mlock
//    of the same size directly.
#include <benchmark/benchmark.h>
#include <jemalloc/jemalloc.h>
#include <sys/mman.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sgm.h"

namespace {

constexpr int kRing = 64;
constexpr int kSizes = 4096;

std::vector<size_t> MakeSizes() {
  // Log-uniform 256 B .. 256 KiB: small enough that the shared pool's first
  // chunks hold the ring, as a steady fallback workload's would.
  std::vector<size_t> v(kSizes);
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (auto &x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    double u = static_cast<double>(s >> 11) / 9007199254740992.0;
    x = static_cast<size_t>(std::exp(std::log(256.0) + u * (std::log(262144.0) - std::log(256.0))));
  }
  return v;
}

sgm_context *MakeContext(uint64_t vram_limit) {
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = SGM_BACKEND_EMU;
  cfg.verbose = 0;
  cfg.vram_limit.bytes = vram_limit;
  cfg.vram_limit.fraction = 0;
  sgm_context *c = nullptr;
  if (sgm_context_create(&cfg, &c) != SGM_OK) {
    std::fprintf(stderr, "bench_shared: %s\n", sgm_last_error());
    std::exit(1);
  }
  return c;
}

template <typename Alloc, typename Free>
void RunPairs(benchmark::State &state, Alloc alloc, Free release) {
  static const std::vector<size_t> sizes = MakeSizes();
  void *ring[kRing];
  for (int i = 0; i < kRing; i++) ring[i] = alloc(sizes[i]);
  size_t k = 0;
  for (auto _ : state) {
    int slot = static_cast<int>(k % kRing);
    release(ring[slot]);
    void *p = alloc(sizes[(k + kRing) % kSizes]);
    benchmark::DoNotOptimize(p);
    ring[slot] = p;
    k++;
  }
  for (int i = 0; i < kRing; i++) release(ring[i]);
}

void BM_VramPath(benchmark::State &state) {
  sgm_context *ctx = MakeContext(256ull << 20);
  RunPairs(
      state, [ctx](size_t n) { return sgm_alloc(ctx, n, nullptr); },
      [ctx](void *p) { sgm_free(ctx, p, nullptr); });
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  state.counters["fallbacks"] = static_cast<double>(st.n_fallbacks);
  sgm_context_destroy(ctx);
}

void BM_FallbackPath(benchmark::State &state) {
  // A 2 MiB VRAM budget filled by one block: every pair goes to shared memory.
  sgm_context *ctx = MakeContext(2ull << 20);
  void *fill = sgm_alloc(ctx, 2ull << 20, nullptr);
  if (!fill || sgm_pointer_tier(ctx, fill) != SGM_TIER_VRAM) {
    state.SkipWithError("could not fill VRAM");
    return;
  }
  RunPairs(
      state, [ctx](size_t n) { return sgm_alloc(ctx, n, nullptr); },
      [ctx](void *p) { sgm_free(ctx, p, nullptr); });
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  state.counters["fallbacks"] = static_cast<double>(st.n_fallbacks);
  state.counters["shared_committed_MiB"] =
      static_cast<double>(st.tier[SGM_TIER_SHARED].committed_bytes) / 1048576.0;
  sgm_free(ctx, fill, nullptr);
  sgm_context_destroy(ctx);
}

void BM_JemallocPath(benchmark::State &state) {
  RunPairs(
      state, [](size_t n) { return mallocx(n, MALLOCX_ALIGN(256)); },
      [](void *p) {
        if (p) dallocx(p, 0);
      });
}

// One iteration = the allocation that commits a fresh shared chunk of
// state.range(0) bytes; freeing it and trimming it back is not timed.
void BM_SharedCommit(benchmark::State &state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  sgm_context *ctx = MakeContext(2ull << 20);
  void *fill = sgm_alloc(ctx, 2ull << 20, nullptr);
  for (auto _ : state) {
    void *p = sgm_alloc(ctx, bytes, nullptr);
    benchmark::DoNotOptimize(p);
    state.PauseTiming();
    if (!p || sgm_pointer_tier(ctx, p) != SGM_TIER_SHARED) {
      state.SkipWithError(sgm_last_error());
      break;
    }
    sgm_free(ctx, p, nullptr);
    sgm_trim(ctx);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  sgm_free(ctx, fill, nullptr);
  sgm_context_destroy(ctx);
}

void BM_MmapMlock(benchmark::State &state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED || mlock(p, bytes) != 0) {
      state.SkipWithError("mmap/mlock failed");
      break;
    }
    benchmark::DoNotOptimize(p);
    state.PauseTiming();
    munlock(p, bytes);
    munmap(p, bytes);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

BENCHMARK(BM_VramPath);
BENCHMARK(BM_FallbackPath);
BENCHMARK(BM_JemallocPath);
BENCHMARK(BM_SharedCommit)->Arg(2 << 20)->Arg(64 << 20)->UseRealTime();
BENCHMARK(BM_MmapMlock)->Arg(2 << 20)->Arg(64 << 20)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
