// bench_suballoc.cc — the offset-based sub-allocator (lib/suballoc.c).
//
// 1. Churn: 10,000 live blocks, sizes log-uniform 256 B .. 16 MiB, alignment
//    256; each iteration frees one random live block and allocates a new one
//    (one "pair"). The same sizes and victims go through jemalloc's
//    mallocx/dallocx (MALLOCX_ALIGN(256)) in the same run as the reference;
//    jemalloc's memory is never touched (an untouched 16 MiB block costs no
//    page faults), so both measure bookkeeping only.
// 2. MiniMalloc replay (traces/README.md): each buffer of
//    minimalloc/{A..K}.1048576.csv allocs at `lower` and frees at `upper`;
//    events sorted by time, frees first at equal times; alignment 1.
//    Fragmentation = the smallest arena in which the whole replay succeeds
//    (binary search over the capacity) / peak live bytes. The timed loop
//    replays at that capacity and reports ns per event; jemalloc replays the
//    same events as the reference.
//
// Usage: bench_suballoc [--traces=DIR] [Google Benchmark flags]. DIR defaults
// to SGM_TRACES_DEFAULT; without it the trace benchmarks are skipped.
#include <benchmark/benchmark.h>
#include <jemalloc/jemalloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

extern "C" {
#include "internal.h"
}

#ifndef SGM_TRACES_DEFAULT
#define SGM_TRACES_DEFAULT "../shared/traces"
#endif

namespace {

// ---------------------------------------------------------------------------
// Churn.

constexpr size_t kLive = 10000;          // live blocks in the steady state
constexpr size_t kPattern = size_t{1} << 16;  // precomputed sizes/victims, cycled
constexpr uint64_t kAlign = 256;         // device block alignment
constexpr double kMinSize = 256.0, kMaxSize = 16.0 * 1024 * 1024;

struct Pattern {
  std::vector<uint64_t> sizes;    // log-uniform kMinSize..kMaxSize
  std::vector<uint32_t> victims;  // uniform in [0, kLive)
  uint64_t capacity_bytes;        // 2 x the worst kLive-window sum: never fails
};

uint64_t XorShift(uint64_t &s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

const Pattern &ChurnPattern() {
  static const Pattern p = [] {
    Pattern q;
    uint64_t s = 0x5EED5EED12345ull;
    q.sizes.resize(kPattern);
    q.victims.resize(kPattern);
    for (auto &x : q.sizes) {
      double u = static_cast<double>(XorShift(s) >> 11) / 9007199254740992.0;
      x = static_cast<uint64_t>(std::exp(std::log(kMinSize) + u * (std::log(kMaxSize) - std::log(kMinSize))));
    }
    for (auto &v : q.victims) v = static_cast<uint32_t>(XorShift(s) % kLive);
    // Live bytes never exceed the kLive largest sizes; twice that always fits.
    std::vector<uint64_t> sorted = q.sizes;
    std::sort(sorted.begin(), sorted.end(), std::greater<uint64_t>());
    uint64_t top = 0;
    for (size_t i = 0; i < kLive; i++) top += sgm__align_up(sorted[i], kAlign);
    q.capacity_bytes = sgm__align_up(2 * top, kAlign);
    return q;
  }();
  return p;
}

void BM_ChurnSuballoc(benchmark::State &state) {
  const Pattern &p = ChurnPattern();
  sgm_suballoc *sa = nullptr;
  if (sgm__suballoc_create(kAlign, &sa) != SGM_OK ||
      sgm__suballoc_add_range(sa, 0, p.capacity_bytes) != SGM_OK) {
    state.SkipWithError(sgm_last_error());
    return;
  }
  std::vector<uint64_t> live(kLive);
  uint64_t got = 0;
  size_t k = 0;
  for (size_t i = 0; i < kLive; i++, k++)
    if (!sgm__suballoc_try_alloc(sa, p.sizes[k % kPattern], &live[i], &got)) std::abort();
  // Warm up into the steady state (the free-block population settles).
  for (size_t i = 0; i < 20 * kLive; i++, k++) {
    uint32_t v = p.victims[k % kPattern];
    sgm__suballoc_free(sa, live[v], &got);
    if (!sgm__suballoc_try_alloc(sa, p.sizes[k % kPattern], &live[v], &got)) std::abort();
  }
  bool ok = true;
  for (auto _ : state) {
    size_t j = k++ & (kPattern - 1);
    uint32_t v = p.victims[j];
    sgm__suballoc_free(sa, live[v], &got);
    ok &= sgm__suballoc_try_alloc(sa, p.sizes[j], &live[v], &got);
  }
  if (!ok) state.SkipWithError("an allocation failed: capacity too small");
  sgm_suballoc_stats st;
  sgm__suballoc_stats(sa, &st);
  state.counters["pairs"] = static_cast<double>(state.iterations());
  state.counters["live"] = static_cast<double>(st.n_live);
  state.counters["free_blocks"] = static_cast<double>(st.n_free_blocks);
  state.counters["used_GiB"] = static_cast<double>(st.used_bytes) / (1 << 30);
  if (!sgm__suballoc_check(sa)) state.SkipWithError(sgm_last_error());
  sgm__suballoc_destroy(sa);
}

void BM_ChurnJemalloc(benchmark::State &state) {
  const Pattern &p = ChurnPattern();
  const int flags = MALLOCX_ALIGN(kAlign);
  std::vector<void *> live(kLive);
  size_t k = 0;
  for (size_t i = 0; i < kLive; i++, k++) live[i] = mallocx(p.sizes[k % kPattern], flags);
  for (size_t i = 0; i < 20 * kLive; i++, k++) {
    uint32_t v = p.victims[k % kPattern];
    dallocx(live[v], flags);
    live[v] = mallocx(p.sizes[k % kPattern], flags);
  }
  bool ok = true;
  for (auto _ : state) {
    size_t j = k++ & (kPattern - 1);
    uint32_t v = p.victims[j];
    dallocx(live[v], flags);
    live[v] = mallocx(p.sizes[j], flags);
    ok &= live[v] != nullptr;
  }
  if (!ok) state.SkipWithError("mallocx failed");
  state.counters["pairs"] = static_cast<double>(state.iterations());
  for (void *x : live) dallocx(x, flags);
}

// ---------------------------------------------------------------------------
// MiniMalloc replay.

struct Event {
  uint64_t time;  // logical time
  int kind;       // 0 = free (sorts first at equal time), 1 = alloc
  uint32_t id;    // buffer id (index into Trace::sizes)
};

struct Trace {
  std::string name;            // "A" .. "K"
  std::vector<Event> events;   // sorted replay order
  std::vector<uint64_t> sizes; // bytes, by buffer index
  uint64_t peak_bytes = 0;     // peak live bytes
  uint64_t total_bytes = 0;    // sum of all sizes: a capacity that always works
  double fragmentation = 0;    // min capacity / peak (filled at start)
  uint64_t min_capacity = 0;   // bytes: the smallest capacity found
};

bool LoadTrace(const std::string &path, const std::string &name, Trace *t) {
  std::ifstream in(path);
  if (!in) return false;
  std::string line;
  std::getline(in, line);  // header: id,lower,upper,size
  t->name = name;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    unsigned long long id, lower, upper, size;
    if (std::sscanf(line.c_str(), "%llu,%llu,%llu,%llu", &id, &lower, &upper, &size) != 4) {
      std::fprintf(stderr, "bench_suballoc: %s: bad line '%s'\n", path.c_str(), line.c_str());
      return false;
    }
    uint32_t idx = static_cast<uint32_t>(t->sizes.size());
    t->sizes.push_back(size);
    t->total_bytes += size;
    t->events.push_back({upper, 0, idx});
    t->events.push_back({lower, 1, idx});
  }
  // By time, frees before allocs; file order (buffer index) among equals.
  std::sort(t->events.begin(), t->events.end(), [](const Event &a, const Event &b) {
    if (a.time != b.time) return a.time < b.time;
    if (a.kind != b.kind) return a.kind < b.kind;
    return a.id < b.id;
  });
  uint64_t live = 0;
  for (const Event &e : t->events) {
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
bool Replay(const Trace &t, uint64_t capacity, std::vector<uint64_t> &offsets) {
  sgm_suballoc *sa = nullptr;
  if (sgm__suballoc_create(1, &sa) != SGM_OK) std::abort();
  if (sgm__suballoc_add_range(sa, 0, capacity) != SGM_OK) std::abort();
  bool ok = true;
  uint64_t got;
  for (const Event &e : t.events) {
    if (e.kind) {
      if (!sgm__suballoc_try_alloc(sa, t.sizes[e.id], &offsets[e.id], &got)) {
        ok = false;
        break;
      }
    } else if (sgm__suballoc_free(sa, offsets[e.id], &got) != SGM_OK) {
      std::abort();
    }
  }
  sgm__suballoc_destroy(sa);
  return ok;
}

void Measure(Trace *t) {
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

void BM_ReplaySuballoc(benchmark::State &state, const Trace *t) {
  std::vector<uint64_t> offsets(t->sizes.size());
  auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    bool ok = Replay(*t, t->min_capacity, offsets);
    benchmark::DoNotOptimize(ok);
  }
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  double events = static_cast<double>(t->events.size());
  state.counters["frag"] = t->fragmentation;
  state.counters["events"] = events;
  state.counters["ns/event"] = ns / (events * static_cast<double>(state.iterations()));
  state.counters["peak_KiB"] = static_cast<double>(t->peak_bytes) / 1024;
}

void BM_ReplayJemalloc(benchmark::State &state, const Trace *t) {
  std::vector<void *> ptrs(t->sizes.size());
  auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    for (const Event &e : t->events) {
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

}  // namespace

BENCHMARK(BM_ChurnSuballoc)->Repetitions(5)->ReportAggregatesOnly(true)->MinTime(0.3);
BENCHMARK(BM_ChurnJemalloc)->Repetitions(5)->ReportAggregatesOnly(true)->MinTime(0.3);

int main(int argc, char **argv) {
  std::string dir = SGM_TRACES_DEFAULT;
  // Take --traces=DIR out before Google Benchmark sees the flags.
  int w = 1;
  for (int i = 1; i < argc; i++) {
    if (std::strncmp(argv[i], "--traces=", 9) == 0)
      dir = argv[i] + 9;
    else
      argv[w++] = argv[i];
  }
  argc = w;
  argv[argc] = nullptr;

  static std::vector<Trace> traces;
  for (char c = 'A'; c <= 'K'; c++) {
    std::string name(1, c);
    Trace t;
    if (LoadTrace(dir + "/minimalloc/" + name + ".1048576.csv", name, &t)) traces.push_back(std::move(t));
  }
  if (traces.empty())
    std::printf("bench_suballoc: no MiniMalloc traces under %s/minimalloc: skipping the trace "
                "benchmarks (pass --traces=DIR)\n", dir.c_str());
  for (Trace &t : traces) {
    Measure(&t);
    benchmark::RegisterBenchmark(("BM_ReplaySuballoc/" + t.name).c_str(), BM_ReplaySuballoc, &t)
        ->MinTime(0.05);
    benchmark::RegisterBenchmark(("BM_ReplayJemalloc/" + t.name).c_str(), BM_ReplayJemalloc, &t)
        ->MinTime(0.05);
  }

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  if (!traces.empty()) {
    double log_sum = 0, worst = 0;
    std::string per;
    char buf[64];
    for (const Trace &t : traces) {
      log_sum += std::log(t.fragmentation);
      worst = std::max(worst, t.fragmentation);
      std::snprintf(buf, sizeof buf, " %s=%.3f", t.name.c_str(), t.fragmentation);
      per += buf;
    }
    std::printf("minimalloc fragmentation (best fit, toward the nearer range end, align 1):%s "
                "geomean=%.3f max=%.3f over %zu traces\n",
                per.c_str(), std::exp(log_sum / static_cast<double>(traces.size())), worst,
                traces.size());
  }
  return 0;
}
