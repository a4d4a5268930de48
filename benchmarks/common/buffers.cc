// buffers.cc — bodies of the movable-buffer benchmarks (bench_buffers), each
// beside its reference:
//  - Demote / promote bandwidth: a released buffer moved VRAM -> shared
//    (sgm_buffer_evict) and back (sgm_buffer_acquire), against a plain memcpy
//    of the same bytes between two host buffers (on the emulated device both
//    tiers are host memory, so memcpy is the ceiling).
//  - Acquire latency of a VRAM-resident buffer (acquire + release pair, and
//    acquire alone with the release untimed).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bodies.h"

namespace sgm_bench {

namespace {

sgm_context *MakeContext() {
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = SGM_BACKEND_EMU;
  cfg.verbose = 0;
  cfg.idle_trim_ms = 0;
  cfg.emu_vram_bytes = 2ull << 30;
  sgm_context *c = nullptr;
  if (sgm_context_create(&cfg, &c) != SGM_OK) {
    std::fprintf(stderr, "sgm benchmarks: %s\n", sgm_last_error());
    std::exit(1);
  }
  return c;
}

}  // namespace

// One iteration = demote to shared + promote back to VRAM: 2 x bytes moved.
void BM_DemotePromote(benchmark::State &state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  sgm_context *ctx = MakeContext();
  sgm_buffer *b = nullptr;
  if (sgm_buffer_create(ctx, bytes, &b) != SGM_OK) {
    state.SkipWithError(sgm_last_error());
    return;
  }
  std::vector<unsigned char> init(bytes, 0x5a);
  sgm_buffer_write(b, 0, init.data(), bytes);
  for (auto _ : state) {
    if (sgm_buffer_evict(b, SGM_TIER_SHARED) != SGM_OK) {
      state.SkipWithError(sgm_last_error());
      break;
    }
    void *d = nullptr;
    if (sgm_buffer_acquire(b, nullptr, &d) != SGM_OK || sgm_buffer_tier(b) != SGM_TIER_VRAM) {
      state.SkipWithError("promotion did not reach VRAM");
      break;
    }
    sgm_buffer_release(b, nullptr);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * static_cast<int64_t>(bytes));
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  state.counters["evictions"] = static_cast<double>(st.tier[SGM_TIER_VRAM].bytes_out) / static_cast<double>(bytes);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

// The reference: memcpy there and back between two host buffers.
void BM_MemcpyTwoWays(benchmark::State &state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<unsigned char> a(bytes, 0x5a), b(bytes, 0);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::ClobberMemory();
    std::memcpy(a.data(), b.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * static_cast<int64_t>(bytes));
}

void BM_AcquireReleaseVram(benchmark::State &state) {
  sgm_context *ctx = MakeContext();
  sgm_buffer *b = nullptr;
  sgm_buffer_create(ctx, 1 << 20, &b);
  void *d = nullptr;
  for (auto _ : state) {
    sgm_buffer_acquire(b, nullptr, &d);
    benchmark::DoNotOptimize(d);
    sgm_buffer_release(b, nullptr);
  }
  if (sgm_buffer_tier(b) != SGM_TIER_VRAM) state.SkipWithError("buffer left VRAM");
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

// Acquire alone: 64 resident buffers acquired in a batch, released untimed.
void BM_AcquireVram(benchmark::State &state) {
  sgm_context *ctx = MakeContext();
  constexpr int kN = 64;
  sgm_buffer *b[kN];
  for (auto &x : b) sgm_buffer_create(ctx, 1 << 16, &x);
  void *d = nullptr;
  int64_t n = 0;
  for (auto _ : state) {
    for (auto *x : b) {
      sgm_buffer_acquire(x, nullptr, &d);
      benchmark::DoNotOptimize(d);
    }
    n += kN;
    state.PauseTiming();
    for (auto *x : b) sgm_buffer_release(x, nullptr);
    state.ResumeTiming();
  }
  state.counters["ns_per_acquire"] = benchmark::Counter(
      static_cast<double>(n), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  for (auto *x : b) sgm_buffer_destroy(x);
  sgm_context_destroy(ctx);
}

}  // namespace sgm_bench
