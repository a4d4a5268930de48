// alloc.cc — bodies of the public allocation path (bench_alloc) and of the
// shared GPU memory tier (bench_shared), each beside its reference:
//  - sgm_alloc + sgm_free pairs on a warmed context, 1 and 2 threads, against
//    jemalloc's mallocx/dallocx of the same sizes and alignment. Each
//    iteration frees the oldest of a ring of live blocks and allocates a new
//    one, so the allocator works on a populated heap, not an empty one.
//  - The fallback path (VRAM budget full: every block lands in shared memory)
//    against the VRAM path and jemalloc.
//  - Commit cost: the allocation that pins a fresh shared chunk (mmap, NUMA
//    bind, mlock through the backend, then carving) against mmap + mlock.
//  - Capture pools (CUDA graphs): pairs while a graph's pool holds 4096
//    blocks, outside its scope and inside it, against the same pairs and
//    live blocks with no pool.
#include <jemalloc/jemalloc.h>
#include <sys/mman.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "bodies.h"

namespace sgm_bench {

std::vector<size_t> LogUniformSizes(size_t n, double lo, double hi, uint64_t seed) {
  std::vector<size_t> v(n);
  uint64_t s = seed;
  for (auto &x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    double u = static_cast<double>(s >> 11) / 9007199254740992.0;
    x = static_cast<size_t>(std::exp(std::log(lo) + u * (std::log(hi) - std::log(lo))));
  }
  return v;
}

namespace {

constexpr int kRing = 64;      // live blocks per thread
constexpr int kSizes = 4096;   // precomputed sizes, cycled

template <typename Alloc, typename Free>
int64_t RunPairs(benchmark::State &state, const std::vector<size_t> &sizes, Alloc alloc,
                 Free release) {
  void *ring[kRing];
  for (int i = 0; i < kRing; i++) ring[i] = alloc(sizes[i]);
  // One untimed pass over every size first, so that the timed pairs find the
  // pools committed: a short run must not measure the first commits.
  for (int w = 0; w < kSizes; w++) {
    release(ring[w % kRing]);
    ring[w % kRing] = alloc(sizes[(w + kRing) % kSizes]);
  }
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
  return static_cast<int64_t>(k);
}

std::mutex g_alloc_mu;               // guards g_alloc_ctx's creation
sgm_context *g_alloc_ctx = nullptr;  // BM_SgmAllocFree's context, from the environment

// The shared context, created on first use; nullptr (and *why) when it
// cannot be (say SGM_BACKEND=cuda without a GPU).
sgm_context *AllocContext(std::string *why) {
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  if (!g_alloc_ctx && sgm_context_create(nullptr, &g_alloc_ctx) != SGM_OK) {
    *why = std::string("sgm_context_create failed: ") + sgm_last_error();
    g_alloc_ctx = nullptr;
  }
  return g_alloc_ctx;
}

// 256 B .. 1 MiB per thread (seeded by the thread), for the public path.
std::vector<size_t> PairSizes(int thread) {
  return LogUniformSizes(kSizes, 256.0, 1048576.0, 0x1234 + static_cast<uint64_t>(thread));
}

// 256 B .. 256 KiB: small enough that the shared pool's first chunks hold the
// ring, as a steady fallback workload's would.
const std::vector<size_t> &SharedSizes() {
  static const std::vector<size_t> v = LogUniformSizes(kSizes, 256.0, 262144.0, 0x9e3779b97f4a7c15ull);
  return v;
}

// An emulated device with a VRAM budget of vram_limit bytes; nullptr after
// skipping the benchmark when it cannot be made (say RLIMIT_MEMLOCK too low).
sgm_context *EmuContext(benchmark::State &state, uint64_t vram_limit) {
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = SGM_BACKEND_EMU;
  cfg.verbose = 0;
  cfg.vram_limit.bytes = vram_limit;
  cfg.vram_limit.fraction = 0;
  sgm_context *c = nullptr;
  if (sgm_context_create(&cfg, &c) != SGM_OK) {
    state.SkipWithError((std::string("sgm_context_create failed: ") + sgm_last_error()).c_str());
    return nullptr;
  }
  return c;
}

int64_t SgmPairs(benchmark::State &state, sgm_context *ctx, const std::vector<size_t> &sizes) {
  return RunPairs(
      state, sizes, [ctx](size_t n) { return sgm_alloc(ctx, n, nullptr); },
      [ctx](void *p) { sgm_free(ctx, p, nullptr); });
}

int64_t JemallocPairs(benchmark::State &state, const std::vector<size_t> &sizes) {
  return RunPairs(
      state, sizes, [](size_t n) { return mallocx(n, MALLOCX_ALIGN(256)); },
      [](void *p) {
        if (p) dallocx(p, 0);
      });
}

}  // namespace

void AllocContextDestroy() {
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  sgm_context_destroy(g_alloc_ctx);
  g_alloc_ctx = nullptr;
}

void BM_SgmAllocFree(benchmark::State &state) {
  std::string why;
  sgm_context *ctx = AllocContext(&why);
  if (!ctx) {
    state.SkipWithError(why.c_str());
    return;
  }
  int64_t k = SgmPairs(state, ctx, PairSizes(state.thread_index()));
  state.counters["pairs/s"] = benchmark::Counter(static_cast<double>(k), benchmark::Counter::kIsRate);
  if (state.thread_index() == 0) {
    sgm_stats st;
    sgm_get_stats(ctx, &st);
    state.counters["committed_MiB"] = static_cast<double>(st.tier[SGM_TIER_VRAM].committed_bytes) / 1048576.0;
    state.counters["failed"] = static_cast<double>(st.tier[SGM_TIER_VRAM].n_failed);
  }
}

void BM_JemallocPair(benchmark::State &state) {
  int64_t k = JemallocPairs(state, PairSizes(state.thread_index()));
  state.counters["pairs/s"] = benchmark::Counter(static_cast<double>(k), benchmark::Counter::kIsRate);
}

void BM_PoolPair(benchmark::State &state) {
  const int mode = static_cast<int>(state.range(0));  // PoolPairMode
  const uint64_t pool = 1;
  constexpr int kLive = 4096;
  sgm_context *ctx = EmuContext(state, 4ull << 30);
  if (!ctx) return;
  std::vector<void *> live(kLive);
  if (mode != kPoolNone) sgm_capture_pool_begin(ctx, nullptr, pool);
  for (auto &p : live) p = sgm_alloc(ctx, 65536, nullptr);  // the graph's blocks (or plain ones)
  if (mode == kPoolOutside) sgm_capture_pool_end(ctx, pool);
  if (mode == kPoolInside) {
    // A capture: the same 64 KiB temporary again and again, parked and taken back.
    static const std::vector<size_t> one(kSizes, 65536);
    SgmPairs(state, ctx, one);
    sgm_capture_pool_end(ctx, pool);
  } else {
    SgmPairs(state, ctx, PairSizes(0));
  }
  for (void *p : live) sgm_free(ctx, p, nullptr);
  if (mode != kPoolNone) sgm_capture_pool_release(ctx, pool);
  sgm_context_destroy(ctx);
}

void BM_PoolPairPlain64K(benchmark::State &state) {
  constexpr int kLive = 4096;
  sgm_context *ctx = EmuContext(state, 4ull << 30);
  if (!ctx) return;
  std::vector<void *> live(kLive);
  for (auto &p : live) p = sgm_alloc(ctx, 65536, nullptr);
  static const std::vector<size_t> one(kSizes, 65536);
  SgmPairs(state, ctx, one);
  for (void *p : live) sgm_free(ctx, p, nullptr);
  sgm_context_destroy(ctx);
}

void BM_VramPath(benchmark::State &state) {
  sgm_context *ctx = EmuContext(state, 256ull << 20);
  if (!ctx) return;
  SgmPairs(state, ctx, SharedSizes());
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  state.counters["fallbacks"] = static_cast<double>(st.n_fallbacks);
  sgm_context_destroy(ctx);
}

void BM_FallbackPath(benchmark::State &state) {
  // A 2 MiB VRAM budget filled by one block: every pair goes to shared memory.
  sgm_context *ctx = EmuContext(state, 2ull << 20);
  if (!ctx) return;
  void *fill = sgm_alloc(ctx, 2ull << 20, nullptr);
  if (!fill || sgm_pointer_tier(ctx, fill) != SGM_TIER_VRAM) {
    state.SkipWithError("could not fill VRAM");
    sgm_free(ctx, fill, nullptr);
    sgm_context_destroy(ctx);
    return;
  }
  SgmPairs(state, ctx, SharedSizes());
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  state.counters["fallbacks"] = static_cast<double>(st.n_fallbacks);
  state.counters["shared_committed_MiB"] =
      static_cast<double>(st.tier[SGM_TIER_SHARED].committed_bytes) / 1048576.0;
  sgm_free(ctx, fill, nullptr);
  sgm_context_destroy(ctx);
}

void BM_JemallocPath(benchmark::State &state) { JemallocPairs(state, SharedSizes()); }

// One iteration = the allocation that commits a fresh shared chunk of
// state.range(0) bytes; freeing it and trimming it back is not timed.
void BM_SharedCommit(benchmark::State &state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  sgm_context *ctx = EmuContext(state, 2ull << 20);
  if (!ctx) return;
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
      if (p != MAP_FAILED) munmap(p, bytes);
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

}  // namespace sgm_bench
