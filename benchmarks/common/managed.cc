// managed.cc — bodies of the managed-pointer benchmarks (bench_managed;
// SGM_POINTERS=managed, issue 14) on the emulated device:
//  - Moves: a 64 MiB managed block demoted to shared memory and promoted back
//    (sgm_prefetch both ways: advice, then the emulated device copies the
//    pages between its two stores and re-maps them); the reference is
//    BM_MemcpyTwoWays of the same bytes (common/buffers.cc).
//  - Alloc + free pairs in managed mode against fixed mode, for blocks under
//    2 MiB (carved from the fixed pools in both modes) and for movable 4 MiB
//    blocks (a Unified Memory range each, reused from the cache of freed
//    ranges: no driver call once warm). Target (issue 14): <= 1.2x fixed.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bodies.h"

namespace sgm_bench {

namespace {

constexpr size_t kBlock = size_t{64} << 20;

sgm_context *MakeContext(sgm_pointer_mode mode) {
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = SGM_BACKEND_EMU;
  cfg.verbose = 0;
  cfg.pointers = mode;
  cfg.emu_vram_bytes = size_t{1} << 30;
  cfg.vram_limit.bytes = size_t{512} << 20;
  cfg.vram_limit.fraction = 0;
  cfg.idle_trim_ms = 0;
  sgm_context *c = nullptr;
  if (sgm_context_create(&cfg, &c) != SGM_OK) {
    std::fprintf(stderr, "sgm benchmarks: %s\n", sgm_last_error());
    std::exit(1);
  }
  return c;
}

}  // namespace

void BM_ManagedDemotePromote64MiB(benchmark::State &state) {
  sgm_context *ctx = MakeContext(SGM_POINTERS_MANAGED);
  void *p = sgm_alloc(ctx, kBlock, nullptr);
  if (!p) {
    state.SkipWithError(sgm_last_error());
    sgm_context_destroy(ctx);
    return;
  }
  std::memset(p, 0x5a, kBlock);
  // One round trip first: both stores hold their pages from then on.
  sgm_prefetch(ctx, p, kBlock, SGM_TIER_SHARED, nullptr);
  sgm_prefetch(ctx, p, kBlock, SGM_TIER_VRAM, nullptr);
  for (auto _ : state) {
    if (sgm_prefetch(ctx, p, kBlock, SGM_TIER_SHARED, nullptr) != SGM_OK ||
        sgm_prefetch(ctx, p, kBlock, SGM_TIER_VRAM, nullptr) != SGM_OK) {
      state.SkipWithError(sgm_last_error());
      break;
    }
  }
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * static_cast<int64_t>(kBlock));
  state.counters["demotions"] = static_cast<double>(st.n_managed_demotions);
  state.counters["promotions"] = static_cast<double>(st.n_managed_promotions);
  sgm_free(ctx, p, nullptr);
  sgm_context_destroy(ctx);
}

// Pairs: free the oldest of a ring of live blocks, allocate a new one.
void ManagedPairs(benchmark::State &state, sgm_pointer_mode mode, size_t size) {
  sgm_context *ctx = MakeContext(mode);
  constexpr int kRing = 16;
  void *ring[kRing];
  for (auto &r : ring) r = sgm_alloc(ctx, size, nullptr);
  size_t k = 0;
  for (auto _ : state) {
    int slot = static_cast<int>(k++ % kRing);
    sgm_free(ctx, ring[slot], nullptr);
    ring[slot] = sgm_alloc(ctx, size, nullptr);
    if (!ring[slot]) {
      state.SkipWithError(sgm_last_error());
      break;
    }
  }
  for (auto &r : ring) sgm_free(ctx, r, nullptr);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  state.counters["managed_live"] = static_cast<double>(st.n_managed_live);
  sgm_context_destroy(ctx);
}

void BM_PairFixed(benchmark::State &state) {
  ManagedPairs(state, SGM_POINTERS_FIXED, static_cast<size_t>(state.range(0)));
}
void BM_PairManaged(benchmark::State &state) {
  ManagedPairs(state, SGM_POINTERS_MANAGED, static_cast<size_t>(state.range(0)));
}

}  // namespace sgm_bench
