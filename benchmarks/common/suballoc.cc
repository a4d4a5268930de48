// suballoc.cc — bodies of the sub-allocator benchmarks (bench_suballoc): the
// offset-based sub-allocator (lib/suballoc.c) through its public face, the
// virtual block (include/sgm/vblock.h).
//
// 1. Churn: 10,000 live blocks, sizes log-uniform 256 B .. 16 MiB, alignment
//    256; each iteration frees one random live block and allocates a new one
//    (one "pair"). The same sizes and victims go through jemalloc's
//    mallocx/dallocx (MALLOCX_ALIGN(256)) as the reference; jemalloc's memory
//    is never touched (an untouched 16 MiB block costs no page faults), so
//    both measure bookkeeping only.
// 2. MiniMalloc replay (traces/README.md): each buffer of
//    minimalloc/{A..K}.1048576.csv allocs at `lower` and frees at `upper`;
//    events sorted by time, frees first at equal times; alignment 1.
//    Fragmentation = the smallest arena in which the whole replay succeeds
//    (binary search over the capacity) / peak live bytes. The timed loop
//    replays at that capacity and reports ns per event; jemalloc replays the
//    same events as the reference.
#include <jemalloc/jemalloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "bodies.h"

extern "C" {
#include "sgm/vblock.h"
}

namespace sgm_bench {

namespace {

inline uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }

// ---------------------------------------------------------------------------
// Churn.

constexpr size_t kLive = 10000;    // live blocks in the steady state
constexpr uint64_t kAlign = 256;   // device block alignment
constexpr int kSizeSteps = 4096;   // log-uniform size table: 256 steps per power of two
constexpr double kMinSize = 256.0, kMaxSize = 16.0 * 1024 * 1024;

// The largest size of a churn: state.range(0) (kMaxSize, or 1 MiB for the
// second mix).
double ChurnMax(const benchmark::State &state) { return static_cast<double>(state.range(0)); }

// The workload is generated as it runs (a precomputed pattern would either
// evict the allocator's metadata from the caches or, if short, repeat and
// turn every pair into "free a block, allocate the same size again").
struct Workload {
  std::vector<uint64_t> size_table;  // kSizeSteps sizes, log-uniform kMinSize..kMaxSize
  uint64_t capacity_bytes;           // 2 x the expected live bytes (kLive x mean size)
  uint64_t rng = 0x5EED5EED12345ull; // xorshift64 state

  explicit Workload(double max_size = kMaxSize) : size_table(kSizeSteps) {
    for (int i = 0; i < kSizeSteps; i++)
      size_table[i] = static_cast<uint64_t>(
          std::exp(std::log(kMinSize) + (i + 0.5) / kSizeSteps * (std::log(max_size) - std::log(kMinSize))));
    double mean = 0;
    for (uint64_t x : size_table) mean += static_cast<double>(AlignUp(x, kAlign));
    mean /= kSizeSteps;
    capacity_bytes = AlignUp(static_cast<uint64_t>(2.0 * kLive * mean), kAlign);
  }
  // One pair: the live slot to free and the size to allocate in its place.
  inline void Next(uint32_t *victim, uint64_t *size) {
    uint64_t x = rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rng = x;
    *victim = static_cast<uint32_t>(((x >> 32) * kLive) >> 32);
    *size = size_table[x & (kSizeSteps - 1)];
  }
};

}  // namespace

void BM_ChurnSuballoc(benchmark::State &state) {
  Workload wl(ChurnMax(state));
  sgm_vblock *vb = nullptr;
  if (sgm_vblock_create(0, wl.capacity_bytes, kAlign, &vb) != SGM_OK) {
    state.SkipWithError(sgm_last_error());
    return;
  }
  std::vector<uint64_t> live(kLive);
  uint64_t size;
  uint32_t v;
  for (size_t i = 0; i < kLive; i++) {
    wl.Next(&v, &size);
    if (sgm_vblock_alloc(vb, size, 0, &live[i]) != SGM_OK) std::abort();
  }
  // Warm up into the steady state (the free-block population settles).
  for (size_t i = 0; i < 20 * kLive; i++) {
    wl.Next(&v, &size);
    sgm_vblock_free(vb, live[v]);
    if (sgm_vblock_alloc(vb, size, 0, &live[v]) != SGM_OK) std::abort();
  }
  bool ok = true;
  for (auto _ : state) {
    wl.Next(&v, &size);
    sgm_vblock_free(vb, live[v]);
    ok &= sgm_vblock_alloc(vb, size, 0, &live[v]) == SGM_OK;
  }
  if (!ok) state.SkipWithError("an allocation failed: capacity too small");
  sgm_vblock_stats st;
  sgm_vblock_get_stats(vb, &st);
  state.counters["pairs"] = static_cast<double>(state.iterations());
  state.counters["live"] = static_cast<double>(st.n_allocations);
  state.counters["free_blocks"] = static_cast<double>(st.n_free_ranges);
  state.counters["used_GiB"] = static_cast<double>(st.used_bytes) / (1 << 30);
  state.counters["capacity_GiB"] = static_cast<double>(st.size_bytes) / (1 << 30);
  state.counters["largest_free_MiB"] = static_cast<double>(st.largest_free_bytes) / (1 << 20);
  sgm_vblock_destroy(vb);
}

void BM_ChurnJemalloc(benchmark::State &state) {
  Workload wl(ChurnMax(state));
  const int flags = MALLOCX_ALIGN(kAlign);
  std::vector<void *> live(kLive);
  uint64_t size;
  uint32_t v;
  for (size_t i = 0; i < kLive; i++) {
    wl.Next(&v, &size);
    live[i] = mallocx(size, flags);
  }
  for (size_t i = 0; i < 20 * kLive; i++) {
    wl.Next(&v, &size);
    dallocx(live[v], flags);
    live[v] = mallocx(size, flags);
  }
  bool ok = true;
  for (auto _ : state) {
    wl.Next(&v, &size);
    dallocx(live[v], flags);
    live[v] = mallocx(size, flags);
    ok &= live[v] != nullptr;
  }
  if (!ok) state.SkipWithError("mallocx failed");
  state.counters["pairs"] = static_cast<double>(state.iterations());
  for (void *x : live) dallocx(x, flags);
}

namespace {

// The public pair on the same sizes and victims: a device (the emulated one,
// or CUDA: a GPU, or the driver double where libcuda.so.1 is the double)
// whose VRAM budget is the sub-allocator's capacity above (growth mode,
// defaults otherwise, as a user's context), no fallback to shared memory, so
// that a pair that cannot be served shows as a failure instead of a cheaper
// tier.
void ChurnSgm(benchmark::State &state, sgm_backend_kind backend) {
  Workload wl(ChurnMax(state));
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = backend;
  cfg.verbose = 0;
  cfg.vram_limit.bytes = wl.capacity_bytes;
  cfg.vram_limit.fraction = 0;
  cfg.emu_vram_bytes = wl.capacity_bytes;
  cfg.shared_fallback = 0;
  sgm_context *ctx = nullptr;
  if (sgm_context_create(&cfg, &ctx) != SGM_OK) {
    state.SkipWithError((std::string("sgm_context_create failed: ") + sgm_last_error()).c_str());
    return;
  }
  std::vector<void *> live(kLive);
  uint64_t size;
  uint32_t v;
  bool ok = true;
  for (size_t i = 0; i < kLive; i++) {
    wl.Next(&v, &size);
    ok &= (live[i] = sgm_alloc(ctx, size, nullptr)) != nullptr;
  }
  for (size_t i = 0; i < 20 * kLive; i++) {
    wl.Next(&v, &size);
    sgm_free(ctx, live[v], nullptr);
    ok &= (live[v] = sgm_alloc(ctx, size, nullptr)) != nullptr;
  }
  sgm_stats before;
  sgm_get_stats(ctx, &before);
  for (auto _ : state) {
    wl.Next(&v, &size);
    sgm_free(ctx, live[v], nullptr);
    live[v] = sgm_alloc(ctx, size, nullptr);
    ok &= live[v] != nullptr;
  }
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  if (!ok) state.SkipWithError((std::string("an allocation failed: ") + sgm_last_error()).c_str());
  const sgm_tier_stats &vr = st.tier[SGM_TIER_VRAM];
  double pairs = static_cast<double>(state.iterations());
  state.counters["pairs"] = pairs;
  // Mapping work in the timed pairs (the emulated device's driver calls stand
  // for cuMemMap / cuMemUnmap): what hysteresis must keep near 0.
  state.counters["map_calls_per_pair"] =
      pairs > 0 ? static_cast<double>(st.vram_map_calls - before.vram_map_calls) / pairs : 0;
  state.counters["committed_over_used"] =
      vr.used_bytes ? static_cast<double>(vr.committed_bytes) / static_cast<double>(vr.used_bytes) : 0;
  for (void *x : live) sgm_free(ctx, x, nullptr);
  sgm_context_destroy(ctx);
}

}  // namespace

void BM_ChurnSgm(benchmark::State &state) { ChurnSgm(state, SGM_BACKEND_EMU); }
void BM_ChurnSgmCuda(benchmark::State &state) { ChurnSgm(state, SGM_BACKEND_CUDA); }

// ---------------------------------------------------------------------------
// MiniMalloc replay.

namespace {

bool LoadMiniTrace(const std::string &path, const std::string &name, MiniTrace *t) {
  std::ifstream in(path);
  if (!in) return false;
  std::string line;
  std::getline(in, line);  // header: id,lower,upper,size
  t->name = name;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    unsigned long long id, lower, upper, size;
    if (std::sscanf(line.c_str(), "%llu,%llu,%llu,%llu", &id, &lower, &upper, &size) != 4) {
      std::fprintf(stderr, "sgm benchmarks: %s: bad line '%s'\n", path.c_str(), line.c_str());
      return false;
    }
    uint32_t idx = static_cast<uint32_t>(t->sizes.size());
    t->sizes.push_back(size);
    t->total_bytes += size;
    t->events.push_back({upper, 0, idx});
    t->events.push_back({lower, 1, idx});
  }
  // By time, frees before allocs; file order (buffer index) among equals.
  std::sort(t->events.begin(), t->events.end(), [](const MiniEvent &a, const MiniEvent &b) {
    if (a.time != b.time) return a.time < b.time;
    if (a.kind != b.kind) return a.kind < b.kind;
    return a.id < b.id;
  });
  uint64_t live = 0;
  for (const MiniEvent &e : t->events) {
    if (e.kind) {
      live += t->sizes[e.id];
      t->peak_bytes = std::max(t->peak_bytes, live);
    } else {
      live -= t->sizes[e.id];
    }
  }
  return !t->events.empty();
}

// Replay into a fresh allocator with one range [0, capacity); true when every
// allocation fits. offsets: scratch, one per buffer.
bool Replay(const MiniTrace &t, uint64_t capacity, std::vector<uint64_t> &offsets) {
  sgm_vblock *vb = nullptr;
  if (sgm_vblock_create(0, capacity, 1, &vb) != SGM_OK) std::abort();
  bool ok = true;
  for (const MiniEvent &e : t.events) {
    if (e.kind) {
      if (sgm_vblock_alloc(vb, t.sizes[e.id], 0, &offsets[e.id]) != SGM_OK) {
        ok = false;
        break;
      }
    } else if (sgm_vblock_free(vb, offsets[e.id]) != SGM_OK) {
      std::abort();
    }
  }
  sgm_vblock_destroy(vb);
  return ok;
}

}  // namespace

void MiniMeasure(MiniTrace *t) {
  std::vector<uint64_t> offsets(t->sizes.size());
  uint64_t lo = t->peak_bytes, hi = t->total_bytes;
  if (!Replay(*t, hi, offsets)) std::abort();
  while (lo < hi) {
    uint64_t mid = lo + (hi - lo) / 2;
    if (Replay(*t, mid, offsets))
      hi = mid;
    else
      lo = mid + 1;
  }
  t->min_capacity = lo;
  t->fragmentation = static_cast<double>(lo) / static_cast<double>(t->peak_bytes);
}

void BM_ReplaySuballoc(benchmark::State &state, MiniTrace *t) {
  // One allocator for every iteration: a replay frees everything it
  // allocates, so each one starts from the same single free block and the
  // timing holds the operations only, not create/destroy.
  std::vector<uint64_t> offsets(t->sizes.size());
  sgm_vblock *vb = nullptr;
  if (sgm_vblock_create(0, t->min_capacity, 1, &vb) != SGM_OK) {
    state.SkipWithError(sgm_last_error());
    return;
  }
  bool ok = true;
  auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    for (const MiniEvent &e : t->events) {
      if (e.kind)
        ok &= sgm_vblock_alloc(vb, t->sizes[e.id], 0, &offsets[e.id]) == SGM_OK;
      else
        sgm_vblock_free(vb, offsets[e.id]);
    }
  }
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  sgm_vblock_stats st;
  sgm_vblock_get_stats(vb, &st);
  if (!ok || st.n_allocations != 0 || st.n_free_ranges != 1)
    state.SkipWithError("the replay failed at its minimum capacity or left blocks behind");
  sgm_vblock_destroy(vb);
  double events = static_cast<double>(t->events.size());
  state.counters["frag"] = t->fragmentation;
  state.counters["events"] = events;
  t->ns_per_event = ns / (events * static_cast<double>(state.iterations()));
  state.counters["ns/event"] = t->ns_per_event;
  state.counters["peak_KiB"] = static_cast<double>(t->peak_bytes) / 1024;
}

void BM_ReplayJemalloc(benchmark::State &state, const MiniTrace *t) {
  std::vector<void *> ptrs(t->sizes.size());
  auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    for (const MiniEvent &e : t->events) {
      if (e.kind)
        ptrs[e.id] = mallocx(t->sizes[e.id], 0);
      else
        dallocx(ptrs[e.id], 0);
    }
    benchmark::ClobberMemory();
  }
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  double events = static_cast<double>(t->events.size());
  state.counters["events"] = events;
  state.counters["ns/event"] = ns / (events * static_cast<double>(state.iterations()));
}

std::vector<MiniTrace> MiniLoadAll(const std::string &dir) {
  std::vector<MiniTrace> traces;
  for (char c = 'A'; c <= 'K'; c++) {
    std::string name(1, c);
    std::string path = dir + "/minimalloc/" + name + ".1048576.csv";
    if (!std::ifstream(path)) continue;
    MiniTrace t;
    if (LoadMiniTrace(path, name, &t))
      traces.push_back(std::move(t));
    else
      std::fprintf(stderr, "sgm benchmarks: %s: no events; left out\n", path.c_str());
  }
  return traces;
}

}  // namespace sgm_bench
