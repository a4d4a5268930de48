// figures.cc — every figure sgm-bench measures, one registration each (see
// figure.h). The bodies are common/'s, shared with the bench_* binaries; the
// targets are the ones the issues set (docs/benchmarks.md quotes them).
//
// Figures that need inputs say so by skipping: the trace figures when their
// files are missing under --traces, the disk figures when the spill folder's
// file system refuses O_DIRECT.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>

#include <dirent.h>

#include "bodies.h"
#include "figure.h"

extern "C" {
#include "replay.h"
}

namespace sgm_bench {

namespace {

// A reference that is a number by construction, not a measurement: the calls
// another allocator or a hand-written program makes.
Measure Calls(double n) {
  return [n](const RunContext &, std::string *) { return n; };
}

// ---- sub-allocator ----

SGM_BENCH_FIGURE({"suballoc.churn", "sub-allocator free+alloc pair, 10,000 live blocks, 256 B-16 MiB, align 256",
                  "ns", "jemalloc mallocx/dallocx, same sizes and victims", Better::kLower,
                  Target::Value(kAtMost, 90), kQuick, GbTime("churn/suballoc", BM_ChurnSuballoc, {16 << 20}),
                  GbTime("churn/jemalloc", BM_ChurnJemalloc, {16 << 20})});
SGM_BENCH_FIGURE({"suballoc.churn.1MiB", "sub-allocator free+alloc pair, 10,000 live blocks, 256 B-1 MiB, align 256",
                  "ns", "jemalloc mallocx/dallocx, same sizes and victims", Better::kLower, Target::None(), kQuick,
                  GbTime("churn/suballoc/1MiB", BM_ChurnSuballoc, {1 << 20}),
                  GbTime("churn/jemalloc/1MiB", BM_ChurnJemalloc, {1 << 20})});

// The public pair where users live (issue 26): 10,000 live blocks, the same
// sizes and victims as suballoc.churn, against the sub-allocator alone doing
// that work. The public path may add bookkeeping, not another allocator's
// worth: at most 1.5x. jemalloc's figure on the same pairs is suballoc.churn's
// reference, in the same run.
SGM_BENCH_FIGURE({"alloc.churn.10k", "sgm_alloc+sgm_free pair, 10,000 live blocks, 256 B-16 MiB (emulated device)",
                  "ns", "the sub-allocator alone (suballoc.churn), same sizes and victims", Better::kLower,
                  Target::Ratio(kAtMost, 1.5), kQuick, GbTime("churn/sgm", BM_ChurnSgm, {16 << 20}),
                  GbTime("churn/suballoc", BM_ChurnSuballoc, {16 << 20})});
SGM_BENCH_FIGURE({"alloc.churn.10k.1MiB", "sgm_alloc+sgm_free pair, 10,000 live blocks, 256 B-1 MiB (emulated device)",
                  "ns", "the sub-allocator alone (suballoc.churn.1MiB), same sizes and victims", Better::kLower,
                  Target::Ratio(kAtMost, 1.5), kQuick, GbTime("churn/sgm/1MiB", BM_ChurnSgm, {1 << 20}),
                  GbTime("churn/suballoc/1MiB", BM_ChurnSuballoc, {1 << 20})});
// Mapping calls per pair in that churn (the emulated device's mmap/munmap of
// granules, standing for cuMemMap/cuMemUnmap): hysteresis keeps them near 0.
SGM_BENCH_FIGURE({"alloc.churn.10k.map_calls", "VRAM map/unmap calls per pair in alloc.churn.10k (sgm_stats.vram_map_calls)",
                  kCountUnit, "PyTorch's caching allocator once warm: 0", Better::kLower,
                  Target::Value(kAtMost, 0.01), kQuick,
                  GbMeasure({"churn/sgm/calls", BM_ChurnSgm, {16 << 20}, 1, false, "map_calls_per_pair", 1, 0}),
                  Calls(0), 1});

// The MiniMalloc traces under a folder, loaded and measured once per folder.
struct MiniSet {
  std::vector<MiniTrace> traces;  // the ones found
};
MiniSet *Minis(const RunContext &rc, std::string *skip) {
  static std::map<std::string, std::unique_ptr<MiniSet>> cache;
  auto &slot = cache[rc.traces_dir];
  if (!slot) {
    slot.reset(new MiniSet);
    slot->traces = MiniLoadAll(rc.traces_dir);
    for (MiniTrace &t : slot->traces) MiniMeasure(&t);
  }
  if (slot->traces.empty()) {
    *skip = "no MiniMalloc traces (minimalloc/{A..K}.1048576.csv) under " + rc.traces_dir +
            " (--traces DIR)";
    return nullptr;
  }
  return slot.get();
}

double MiniGeomean(const RunContext &rc, std::string *skip) {
  MiniSet *m = Minis(rc, skip);
  if (!m) return 0;
  double s = 0;
  for (const MiniTrace &t : m->traces) s += std::log(t.fragmentation);
  return std::exp(s / static_cast<double>(m->traces.size()));
}

double MiniWorst(const RunContext &rc, std::string *skip) {
  MiniSet *m = Minis(rc, skip);
  if (!m) return 0;
  double w = 0;
  for (const MiniTrace &t : m->traces) w = std::max(w, t.fragmentation);
  return w;
}

// The ideal arena is the peak live bytes itself: fragmentation 1.
double Ideal(const RunContext &rc, std::string *skip) { return Minis(rc, skip) ? 1.0 : 0; }

SGM_BENCH_FIGURE({"suballoc.minimalloc.frag", "MiniMalloc traces: smallest arena / peak live bytes, geometric mean",
                  "x", "the peak live bytes (fragmentation 1)", Better::kLower,
                  Target::Value(kAtMost, 1.45), kQuick, MiniGeomean, Ideal, 1, "traces"});
SGM_BENCH_FIGURE({"suballoc.minimalloc.frag_max", "MiniMalloc traces: smallest arena / peak live bytes, worst trace",
                  "x", "the peak live bytes (fragmentation 1)", Better::kLower,
                  Target::Value(kAtMost, 2.0), kFullOnly, MiniWorst, Ideal, 1, "traces"});

// Mean ns per event over the traces, one Google Benchmark run per trace.
Measure MiniReplay(bool sgm) {
  return [sgm](const RunContext &rc, std::string *skip) {
    MiniSet *m = Minis(rc, skip);
    if (!m) return 0.0;
    double sum = 0;
    for (MiniTrace &t : m->traces) {
      MiniTrace *tp = &t;
      Body b = sgm ? Body([tp](benchmark::State &s) { BM_ReplaySuballoc(s, tp); })
                   : Body([tp](benchmark::State &s) { BM_ReplayJemalloc(s, tp); });
      sum += RunGb({"minimalloc/" + t.name, b, {}, 1, false, "ns/event", 1, 0.05}, rc, skip);
      if (!skip->empty()) return 0.0;
    }
    return sum / static_cast<double>(m->traces.size());
  };
}

SGM_BENCH_FIGURE({"suballoc.minimalloc.replay", "MiniMalloc traces replayed through the sub-allocator, mean time per event",
                  "ns", "jemalloc replaying the same events", Better::kLower, Target::None(), kQuick,
                  MiniReplay(true), MiniReplay(false), 0, "traces"});

// ---- public path ----

SGM_BENCH_FIGURE({"alloc.pair.1t", "sgm_alloc+sgm_free pair, 1 thread, ring of 64 blocks, 256 B-1 MiB", "ns",
                  "jemalloc mallocx/dallocx, same sizes", Better::kLower, Target::Value(kAtMost, 80), kQuick,
                  GbTime("alloc/sgm", BM_SgmAllocFree), GbTime("alloc/jemalloc", BM_JemallocPair)});

// Pairs per second with 2 threads over with 1: how the path scales.
Measure Scaling(const std::string &label, Body b) {
  return [label, b](const RunContext &rc, std::string *skip) {
    double two = RunGb({label + "/2", b, {}, 2, false, "pairs/s", 1, 0}, rc, skip);
    if (!skip->empty()) return 0.0;
    double one = RunGb({label + "/1", b, {}, 1, false, "pairs/s", 1, 0}, rc, skip);
    return skip->empty() && one > 0 ? two / one : 0.0;
  };
}

SGM_BENCH_FIGURE({"alloc.scaling.2t", "sgm_alloc+sgm_free pairs/s, 2 threads over 1 thread", "x",
                  "jemalloc's 2-thread over 1-thread pairs/s", Better::kHigher, Target::Value(kAtLeast, 1.6),
                  kQuick, Scaling("alloc/sgm", BM_SgmAllocFree), Scaling("alloc/jemalloc", BM_JemallocPair)});

// Capture pools (issue 25): what a CUDA graph's pool costs other allocations
// (one lock and a lookup per free while it exists), and a capture's own pairs.
SGM_BENCH_FIGURE({"alloc.pair.pool_exists", "pair outside a capture pool that holds 4096 blocks, 256 B-1 MiB",
                  "ns", "the same pairs and live blocks with no pool", Better::kLower,
                  Target::Ratio(kAtMost, 1.4), kQuick, GbTime("pool/outside", BM_PoolPair, {kPoolOutside}),
                  GbTime("pool/none", BM_PoolPair, {kPoolNone})});
SGM_BENCH_FIGURE({"alloc.pair.in_pool", "64 KiB pair inside a capture pool's scope (its parked block taken back)",
                  "ns", "the same pairs with no pool", Better::kLower, Target::Ratio(kAtMost, 1.1), kQuick,
                  GbTime("pool/inside", BM_PoolPair, {kPoolInside}),
                  GbTime("pool/plain64k", BM_PoolPairPlain64K)});

// ---- shared GPU memory ----

SGM_BENCH_FIGURE({"shared.fallback", "pair that falls back to shared memory (VRAM full), 256 B-256 KiB", "ns",
                  "the same pairs on the VRAM path", Better::kLower, Target::Ratio(kAtMost, 1.3), kQuick,
                  GbTime("shared/fallback", BM_FallbackPath), GbTime("shared/vram", BM_VramPath)});

Measure CommitUs(const std::string &label, Body b, int64_t bytes) {
  return GbMeasure({label, std::move(b), {bytes}, 1, false, "", 1e-3, 0});
}

SGM_BENCH_FIGURE({"shared.commit.2MiB", "commit a fresh 2 MiB shared chunk (mmap, NUMA bind, mlock, carve)", "us",
                  "mmap+mlock of 2 MiB", Better::kLower, Target::Ratio(kAtMost, 1.1), kQuick,
                  CommitUs("commit/sgm/2MiB", BM_SharedCommit, 2 << 20),
                  CommitUs("commit/mmap/2MiB", BM_MmapMlock, 2 << 20)});
SGM_BENCH_FIGURE({"shared.commit.64MiB", "commit a fresh 64 MiB shared chunk", "us", "mmap+mlock of 64 MiB",
                  Better::kLower, Target::Ratio(kAtMost, 1.1), kFullOnly,
                  CommitUs("commit/sgm/64MiB", BM_SharedCommit, 64 << 20),
                  CommitUs("commit/mmap/64MiB", BM_MmapMlock, 64 << 20)});

// ---- movable buffers ----

#define SGM_BENCH_DEMOTE(mib, mode)                                                                       \
  SGM_BENCH_FIGURE({"buffers.demote_promote." #mib "MiB",                                                 \
                    "demote VRAM->shared + promote back, " #mib " MiB buffer", "GB/s",                   \
                    "memcpy both ways, same bytes", Better::kHigher, Target::Ratio(kAtLeast, 0.9), mode, \
                    GbBandwidth("buffers/sgm/" #mib, BM_DemotePromote, {int64_t{mib} << 20}),           \
                    GbBandwidth("buffers/memcpy/" #mib, BM_MemcpyTwoWays, {int64_t{mib} << 20})})
SGM_BENCH_DEMOTE(1, kQuick);
SGM_BENCH_DEMOTE(16, kFullOnly);
SGM_BENCH_DEMOTE(64, kFullOnly);

// ---- managed pointers (SGM_POINTERS=managed) ----

SGM_BENCH_FIGURE({"managed.demote_promote.64MiB", "managed 64 MiB block demoted to shared memory and promoted back "
                  "(sgm_prefetch both ways)", "GB/s", "memcpy both ways, same bytes", Better::kHigher,
                  Target::Ratio(kAtLeast, 0.9), kQuick,
                  GbBandwidth("managed/sgm/64", BM_ManagedDemotePromote64MiB, {}),
                  GbBandwidth("managed/memcpy/64", BM_MemcpyTwoWays, {int64_t{64} << 20})});
SGM_BENCH_FIGURE({"managed.pair.64KiB", "sgm_alloc+sgm_free pair of 64 KiB with SGM_POINTERS=managed", "ns",
                  "the same pairs with SGM_POINTERS=fixed", Better::kLower, Target::Ratio(kAtMost, 1.2),
                  kFullOnly, GbTime("managed/pair/64KiB", BM_PairManaged, {64 << 10}),
                  GbTime("fixed/pair/64KiB", BM_PairFixed, {64 << 10})});
SGM_BENCH_FIGURE({"managed.pair.4MiB", "sgm_alloc+sgm_free pair of a movable 4 MiB block (SGM_POINTERS=managed)",
                  "ns", "the same pairs with SGM_POINTERS=fixed", Better::kLower, Target::Ratio(kAtMost, 1.2),
                  kFullOnly, GbTime("managed/pair/4MiB", BM_PairManaged, {4 << 20}),
                  GbTime("fixed/pair/4MiB", BM_PairFixed, {4 << 20})});

// ---- disk spill tier ----

// The disk bodies' buffers, set up once, in the folder of the first run.
void DiskReady(const RunContext &rc) {
  static bool ready = false;
  if (!ready) ready = DiskSetup(rc.spill_dir);
}

Measure Disk(const std::string &label, void (*body)(benchmark::State &), int64_t ext_mib) {
  Gb g{label, body, {ext_mib, 1}, 1, true, "bytes_per_second", 1e-9, 0.1};
  return [g](const RunContext &rc, std::string *skip) {
    DiskReady(rc);
    return RunGb(g, rc, skip);
  };
}

#define SGM_BENCH_DISK(op, Op, ext, mode)                                                                  \
  SGM_BENCH_FIGURE({"disk." #op "." #ext "MiB", "spill " #op " of 64 MiB in " #ext " MiB extents, O_DIRECT" \
                    ", checksummed", "GB/s", "raw O_DIRECT p" #op " of the same extents, same folder",     \
                    Better::kHigher, Target::Ratio(kAtLeast, 0.8), mode,                                  \
                    Disk("disk/sgm/" #op "/" #ext, BM_Sgm##Op, ext),                                      \
                    Disk("disk/raw/" #op "/" #ext, BM_Raw##Op, ext), 0, "o_direct"})
SGM_BENCH_DISK(write, Write, 8, kQuick);
SGM_BENCH_DISK(read, Read, 8, kQuick);
SGM_BENCH_DISK(write, Write, 1, kFullOnly);
SGM_BENCH_DISK(read, Read, 1, kFullOnly);
SGM_BENCH_DISK(write, Write, 64, kFullOnly);
SGM_BENCH_DISK(read, Read, 64, kFullOnly);

// ---- eviction policies on the Mooncake trace ----

// The trace, OPT's hit ratio and each policy's, per folder, computed once:
// hit ratios do not vary between runs.
struct Mooncake {
  replay_trace trace{};          // the loaded trace
  uint64_t vram_bytes = 0;       // 10% of its distinct blocks
  double opt_pct = 0;            // Belady's OPT (with bypass), percent
  std::map<std::string, double> policy_pct;  // each policy's hit ratio, percent
  std::string error;             // why it cannot be used
};
Mooncake *LoadMooncake(const RunContext &rc, std::string *skip) {
  static std::map<std::string, std::unique_ptr<Mooncake>> cache;
  auto &slot = cache[rc.traces_dir];
  if (!slot) {
    slot.reset(new Mooncake);
    std::string path = rc.traces_dir + "/mooncake/conversation_trace.jsonl";
    char err[REPLAY_ERR_MAX] = "";
    replay_result opt{};
    if (!std::ifstream(path)) {
      slot->error = "no Mooncake trace at " + path + " (--traces DIR)";
    } else if (replay_trace_load(path.c_str(), 0, &slot->trace, err, sizeof err) != 0 ||
               slot->trace.n_blocks == 0) {
      slot->error = std::string("the Mooncake trace cannot be used: ") + err;
    } else {
      uint64_t blocks = std::max<uint64_t>(1, slot->trace.n_blocks / 10);
      slot->vram_bytes = blocks * slot->trace.uniform_bytes;
      if (replay_opt(&slot->trace, slot->vram_bytes, &opt, err, sizeof err) != 0)
        slot->error = std::string("OPT failed: ") + err;
      else
        slot->opt_pct = 100 * replay_hit_ratio(&opt);
    }
  }
  if (!slot->error.empty()) {
    *skip = slot->error;
    return nullptr;
  }
  return slot.get();
}

double PolicyPct(Mooncake *m, const std::string &policy, std::string *skip) {
  auto it = m->policy_pct.find(policy);
  if (it != m->policy_pct.end()) return it->second;
  replay_sgm_params p{};
  p.policy = policy.c_str();
  p.vram_bytes = m->vram_bytes;
  replay_result r{};
  char err[REPLAY_ERR_MAX] = "";
  if (replay_sgm(&m->trace, &p, &r, err, sizeof err) != 0) {
    *skip = "replay of " + policy + " failed: " + err;
    return 0;
  }
  return m->policy_pct[policy] = 100 * replay_hit_ratio(&r);
}

double Opt(const RunContext &rc, std::string *skip) {
  Mooncake *m = LoadMooncake(rc, skip);
  return m ? m->opt_pct : 0;
}

double Lru(const RunContext &rc, std::string *skip) {
  Mooncake *m = LoadMooncake(rc, skip);
  return m ? PolicyPct(m, "lru", skip) : 0;
}

double Best(const RunContext &rc, std::string *skip) {
  Mooncake *m = LoadMooncake(rc, skip);
  if (!m) return 0;
  double best = 0;
  for (const char *const *n = replay_policy_names(); *n; n++) {
    best = std::max(best, PolicyPct(m, *n, skip));
    if (!skip->empty()) return 0;
  }
  return best;
}

SGM_BENCH_FIGURE({"replay.mooncake.lru", "Mooncake trace, VRAM = 10% of its blocks: LRU's hit ratio", "%",
                  "Belady's OPT, same trace and capacity", Better::kHigher, Target::None(), kQuick, Lru, Opt,
                  1, "traces"});
SGM_BENCH_FIGURE({"replay.mooncake.best", "Mooncake trace, VRAM = 10% of its blocks: the best policy's hit ratio",
                  "%", "Belady's OPT, same trace and capacity", Better::kHigher, Target::Value(kAtLeast, 30),
                  kFullOnly, Best, Opt, 1, "traces"});

// ---- allocation streams: committed VRAM against live bytes (docs/vmm.md) ----

// The idealloc traces (MiniMalloc CSVs of framework tensor lifetimes) replayed
// once per folder (every idealloc/*.csv) through sgm_alloc/sgm_free, as
// sgm-alloc-replay does: in growth mode peak committed VRAM / peak live bytes,
// in reserve mode the smallest budget that serves the stream with no
// fallback / peak live bytes, per trace.
struct StreamSet {
  std::vector<double> growth;   // one ratio per trace found
  std::vector<double> reserve;  // the same traces, reserve mode
};
StreamSet *Streams(const RunContext &rc, std::string *skip) {
  static std::map<std::string, std::unique_ptr<StreamSet>> cache;
  auto &slot = cache[rc.traces_dir];
  if (!slot) {
    slot.reset(new StreamSet);
    std::vector<std::string> paths;  // every *.csv of the folder, in name order
    if (DIR *d = opendir((rc.traces_dir + "/idealloc").c_str())) {
      while (const dirent *e = readdir(d)) {
        std::string n = e->d_name;
        if (n.size() > 4 && n.compare(n.size() - 4, 4, ".csv") == 0)
          paths.push_back(rc.traces_dir + "/idealloc/" + n);
      }
      closedir(d);
    }
    std::sort(paths.begin(), paths.end());
    for (const std::string &path : paths) {
      replay_trace t;
      char err[256];
      if (replay_trace_load(path.c_str(), 0, &t, err, sizeof err) != 0) {
        *skip = std::string("cannot read ") + path + ": " + err;
        slot.reset();
        return nullptr;
      }
      replay_alloc_params gp = {};
      gp.growth = true;
      gp.sample = true;
      gp.vmm = -1;
      replay_alloc_result r = {};
      int rc_replay = replay_alloc(&t, &gp, &r, err, sizeof err);
      uint64_t live = t.peak_live_bytes, budget = 0;
      unsigned runs = 0;
      bool served = rc_replay == 0 && r.served;
      if (served) rc_replay = replay_alloc_min_budget(&t, -1, &budget, &runs, err, sizeof err);
      replay_trace_free(&t);
      if (rc_replay != 0 || !served || live == 0) {
        *skip = std::string("replaying ") + path + " failed: " +
                (rc_replay != 0 ? err : "an allocation fell back to shared memory");
        slot.reset();
        return nullptr;
      }
      slot->growth.push_back(static_cast<double>(r.peak_committed_bytes) / static_cast<double>(live));
      slot->reserve.push_back(static_cast<double>(budget) / static_cast<double>(live));
    }
  }
  if (slot->growth.empty()) {
    *skip = "no idealloc traces (idealloc/*.csv) under " + rc.traces_dir + " (--traces DIR)";
    return nullptr;
  }
  return slot.get();
}

// The mean and the worst of one of a StreamSet's series (growth or reserve).
double SeriesMean(const RunContext &rc, std::string *skip, std::vector<double> StreamSet::*series) {
  StreamSet *m = Streams(rc, skip);
  if (!m) return 0;
  double s = 0;
  for (double g : m->*series) s += g;
  return s / static_cast<double>((m->*series).size());
}

double SeriesWorst(const RunContext &rc, std::string *skip, std::vector<double> StreamSet::*series) {
  StreamSet *m = Streams(rc, skip);
  if (!m) return 0;
  double w = 0;
  for (double g : m->*series) w = std::max(w, g);
  return w;
}

double StreamMean(const RunContext &rc, std::string *skip) { return SeriesMean(rc, skip, &StreamSet::growth); }
double StreamWorst(const RunContext &rc, std::string *skip) { return SeriesWorst(rc, skip, &StreamSet::growth); }
double ReserveMean(const RunContext &rc, std::string *skip) { return SeriesMean(rc, skip, &StreamSet::reserve); }
double ReserveWorst(const RunContext &rc, std::string *skip) { return SeriesWorst(rc, skip, &StreamSet::reserve); }

// Committing exactly the live bytes is the ideal: ratio 1.
double StreamIdeal(const RunContext &rc, std::string *skip) { return Streams(rc, skip) ? 1.0 : 0; }

SGM_BENCH_FIGURE({"alloc.stream.growth", "idealloc traces through sgm_alloc/sgm_free, growth mode: peak committed / peak live, mean",
                  "x", "the peak live bytes (committed = live)", Better::kLower,
                  Target::Value(kAtMost, 1.05), kFullOnly, StreamMean, StreamIdeal, 1, "traces"});
SGM_BENCH_FIGURE({"alloc.stream.growth_max", "idealloc traces through sgm_alloc/sgm_free, growth mode: peak committed / peak live, worst trace",
                  "x", "the peak live bytes (committed = live)", Better::kLower,
                  Target::Value(kAtMost, 1.10), kFullOnly, StreamWorst, StreamIdeal, 1, "traces"});
// Reserve mode: the whole budget is one range from the start, so only
// fragmentation inside it separates the smallest budget from the live bytes.
SGM_BENCH_FIGURE({"alloc.stream.reserve", "idealloc traces through sgm_alloc/sgm_free, reserve mode: smallest budget with no fallback / peak live, mean",
                  "x", "the peak live bytes (budget = live)", Better::kLower,
                  Target::Value(kAtMost, 1.10), kFullOnly, ReserveMean, StreamIdeal, 1, "traces"});
SGM_BENCH_FIGURE({"alloc.stream.reserve_max", "idealloc traces through sgm_alloc/sgm_free, reserve mode: smallest budget with no fallback / peak live, worst trace",
                  "x", "the peak live bytes (budget = live)", Better::kLower,
                  Target::Value(kAtMost, 1.10), kFullOnly, ReserveWorst, StreamIdeal, 1, "traces"});

// ---- allocation streams on the CUDA backend: driver calls (issue 26) ----

// Every idealloc trace under the folder (none when it is absent: those are
// skipped, saying so once) and the synthetic transformer stream (always),
// each replayed twice in one growth-mode context on one created stream:
// on the CUDA backend (the driver double, or a GPU) at both extremes of when
// fences complete (the double's lazy mode and no delay; a real driver is
// measured as it runs), and on the emulated device. Worst case of each.
struct TraceCalls {
  double first_per_mib = 0;       // driver calls in the first pass per MiB of peak live bytes
  double first_no_cache = 0;      // the same trace's events per MiB: one call per alloc and free
  double second_per_event = 0;    // driver calls per event in the second pass
  double cuda_committed = 0;      // peak committed / peak live on CUDA
  double emu_committed = 0;       // the same on the emulated device
  std::string error;              // why it cannot run here
};

bool TraceDetail() { return std::getenv("SGM_BENCH_TRACE_DETAIL") != nullptr; }

// One replay of t (two passes); false and *why on failure.
bool ReplayTwice(const replay_trace &t, bool cuda, void *stream, replay_alloc_result *r, std::string *why) {
  replay_alloc_params p = {};
  p.growth = true;
  p.sample = true;
  p.vmm = -1;
  p.cuda = cuda;
  p.stream = stream;
  p.passes = 2;
  p.vram_bytes = replay_alloc_growth_budget(&t);
  char err[REPLAY_ERR_MAX] = "";
  if (replay_alloc(&t, &p, r, err, sizeof err) != 0) {
    *why = err;
    return false;
  }
  if (!r->served) {
    *why = "an allocation failed or fell back to shared memory";
    return false;
  }
  return true;
}

TraceCalls *Traces(const RunContext &rc, std::string *skip) {
  static std::map<std::string, std::unique_ptr<TraceCalls>> cache;
  auto &slot = cache[rc.traces_dir];
  if (!slot) {
    slot.reset(new TraceCalls);
    TraceCalls &tc = *slot;
    std::string why;
    void *stream = CudaStreamNew(&why);
    if (!stream) {
      tc.error = "the CUDA backend is needed (a GPU, or the driver double: LD_LIBRARY_PATH="
                 "build/release/tests/support/fake_cuda FAKE_CUDA_TOTAL_MEM=64G): " + why;
    }
    std::vector<std::string> paths;  // "" = the synthetic stream
    if (DIR *d = opendir((rc.traces_dir + "/idealloc").c_str())) {
      while (const dirent *e = readdir(d)) {
        std::string n = e->d_name;
        if (n.size() > 4 && n.compare(n.size() - 4, 4, ".csv") == 0) paths.push_back(rc.traces_dir + "/idealloc/" + n);
      }
      closedir(d);
    } else {
      std::fprintf(stderr, "sgm-bench: trace.*: no idealloc traces under %s (--traces DIR): the "
                   "synthetic stream only\n", rc.traces_dir.c_str());
    }
    std::sort(paths.begin(), paths.end());
    paths.push_back("");
    for (const std::string &path : paths) {
      if (!tc.error.empty()) break;
      replay_trace t;
      char err[REPLAY_ERR_MAX] = "";
      int rc_load = path.empty() ? replay_trace_transformer(&t, 4, 0x26, err, sizeof err)
                                 : replay_trace_load(path.c_str(), 0, &t, err, sizeof err);
      std::string name = path.empty() ? "synthetic transformer" : path.substr(path.rfind('/') + 1);
      if (rc_load != 0) {
        tc.error = "cannot read " + name + ": " + err;
        break;
      }
      const double peak_mib = static_cast<double>(t.peak_live_bytes) / 1048576.0;
      replay_alloc_result emu = {};
      if (!ReplayTwice(t, false, nullptr, &emu, &why)) {
        tc.error = "replaying " + name + " on the emulated device: " + why;
        replay_trace_free(&t);
        break;
      }
      const double emu_c = static_cast<double>(emu.peak_committed_bytes) / static_cast<double>(t.peak_live_bytes);
      tc.emu_committed = std::max(tc.emu_committed, emu_c);
      tc.first_no_cache = std::max(tc.first_no_cache, static_cast<double>(emu.pass[0].events) / peak_mib);
      // Both extremes of fence timing where they can be set (the double);
      // once, as it comes, on a real driver.
      const int modes = CudaFenceMode(0) ? 2 : 1;
      for (int lazy = 0; lazy < modes && tc.error.empty(); lazy++) {
        if (modes == 2) CudaFenceMode(lazy);
        replay_alloc_result r = {};
        if (!ReplayTwice(t, true, stream, &r, &why)) {
          tc.error = "replaying " + name + " on CUDA: " + why;
          break;
        }
        const double first = static_cast<double>(r.pass[0].driver_calls) / peak_mib;
        const double second = r.pass[1].events ? static_cast<double>(r.pass[1].driver_calls) /
                                                     static_cast<double>(r.pass[1].events) : 0;
        const double cuda_c = static_cast<double>(r.peak_committed_bytes) / static_cast<double>(t.peak_live_bytes);
        tc.first_per_mib = std::max(tc.first_per_mib, first);
        tc.second_per_event = std::max(tc.second_per_event, second);
        tc.cuda_committed = std::max(tc.cuda_committed, cuda_c);
        if (TraceDetail())
          std::fprintf(stderr, "trace %-22s fences %-5s peak %8.1f MiB  events %6llu  first %7.3f calls/MiB "
                       "(%llu calls, %llu maps)  second %.4f calls/event (%llu calls, %llu maps)  "
                       "committed/peak cuda %.3f emu %.3f (emu maps %llu + %llu)\n",
                       name.c_str(), modes == 1 ? "real" : lazy ? "lazy" : "eager", peak_mib,
                       static_cast<unsigned long long>(r.pass[0].events), first,
                       static_cast<unsigned long long>(r.pass[0].driver_calls),
                       static_cast<unsigned long long>(r.pass[0].map_calls), second,
                       static_cast<unsigned long long>(r.pass[1].driver_calls),
                       static_cast<unsigned long long>(r.pass[1].map_calls), cuda_c, emu_c,
                       static_cast<unsigned long long>(emu.pass[0].map_calls),
                       static_cast<unsigned long long>(emu.pass[1].map_calls));
      }
      if (modes == 2) CudaFenceMode(0);
      replay_trace_free(&t);
    }
    CudaStreamDelete(stream);
  }
  if (!slot->error.empty()) {
    *skip = slot->error;
    return nullptr;
  }
  return slot.get();
}

Measure TraceField(double TraceCalls::*field) {
  return [field](const RunContext &rc, std::string *skip) {
    TraceCalls *t = Traces(rc, skip);
    return t ? t->*field : 0.0;
  };
}

SGM_BENCH_FIGURE({"trace.calls.first", "idealloc traces and a synthetic transformer stream on CUDA, one created "
                  "stream, growth mode: driver calls per MiB of peak live bytes, first pass, worst trace and fence timing",
                  kCountUnit, "an allocator without a cache: one call per alloc and per free (events per MiB)",
                  Better::kLower, Target::Value(kAtMost, 1), kFullOnly, TraceField(&TraceCalls::first_per_mib),
                  TraceField(&TraceCalls::first_no_cache), 1, "gpu"});
SGM_BENCH_FIGURE({"trace.calls.second", "the same replays: driver calls per alloc/free event in the second pass "
                  "(the context warm), worst trace and fence timing",
                  kCountUnit, "PyTorch's caching allocator once warm: 0", Better::kLower,
                  Target::Value(kAtMost, 0.01), kFullOnly, TraceField(&TraceCalls::second_per_event), Calls(0), 1,
                  "gpu"});
SGM_BENCH_FIGURE({"trace.committed", "the same replays: peak committed / peak live bytes on CUDA, worst trace and "
                  "fence timing", "x", "the same on the emulated device (the two paths must agree within 2%)",
                  Better::kLower, Target::Ratio(kAtMost, 1.02), kFullOnly, TraceField(&TraceCalls::cuda_committed),
                  TraceField(&TraceCalls::emu_committed), 1, "gpu"});

// ---- a real GPU (skipped, with the reason, where there is none) ----

// The device, opened once; "" when it can run bodies needing `bytes` on it.
std::string GpuReady(size_t bytes) {
  const CudaSetup &d = CudaOpen();
  if (!d.usable) return std::string(d.broken ? "the CUDA device failed: " : "no CUDA device: ") + d.why;
  if (bytes > d.cap_bytes)
    return "the device has room for " + std::to_string(d.cap_bytes >> 20) + " MiB per buffer, not " +
           std::to_string(bytes >> 20) + " MiB";
  return "";
}

// The churn of alloc.churn.10k on the CUDA backend (a GPU, or the driver
// double where libcuda.so.1 is the double; skipped where there is neither),
// where users live: on CUDA a carve that mapped new granules also emptied
// the thread's magazine, and this churn ran at 2.51x the sub-allocator
// (254-265 ns a pair) against 1.47 with the magazine kept (issue 26); the
// emulated device's figures could not see it.
Measure CudaChurn() {
  Measure churn = GbTime("churn/sgm/cuda", BM_ChurnSgmCuda, {16 << 20});
  return [churn](const RunContext &rc, std::string *skip) {
    *skip = GpuReady(0);
    return skip->empty() ? churn(rc, skip) : 0.0;
  };
}
SGM_BENCH_FIGURE({"alloc.churn.10k.cuda", "sgm_alloc+sgm_free pair, 10,000 live blocks, 256 B-16 MiB (CUDA backend)",
                  "ns", "the sub-allocator alone (suballoc.churn), same sizes and victims", Better::kLower,
                  Target::Ratio(kAtMost, 1.5), kQuick, CudaChurn(),
                  GbTime("churn/suballoc", BM_ChurnSuballoc, {16 << 20}), 0, "gpu"});

// A GPU body run through Google Benchmark with a fixed iteration count (the
// bodies set up a context or a buffer per run: no estimation rounds).
Measure Gpu(const std::string &key, size_t bytes, int64_t full_iters, int64_t quick_iters,
            const std::string &counter, std::function<void(benchmark::State &, std::string)> body) {
  return [=](const RunContext &rc, std::string *skip) {
    *skip = GpuReady(bytes);
    if (!skip->empty()) return 0.0;
    Body b = [key, body](benchmark::State &s) { body(s, key); };
    return RunGb({key, b, {}, 1, true, counter, 1, 0, rc.quick ? quick_iters : full_iters}, rc, skip);
  };
}

Measure GpuCopy(bool sgm, bool h2d, size_t mib) {
  const size_t bytes = mib << 20;
  const std::string key = std::string(h2d ? "gpu/h2d/" : "gpu/d2h/") + (sgm ? "sgm/" : "cuMemcpy/") + std::to_string(mib);
  const int64_t full = CudaIters(bytes, 2048ull << 20, 5, 50), quick = CudaIters(bytes, 512ull << 20, 3, 10);
  return Gpu(key, bytes, full, quick, "GB/s", [=](benchmark::State &s, std::string k) {
    if (sgm)
      BM_CudaSgmCopy(s, std::move(k), h2d, bytes);
    else
      BM_CudaDirectCopy(s, std::move(k), h2d, bytes);
  });
}

#define SGM_BENCH_GPU_COPY(dir, h2d, verb, mib, mode)                                                           \
  SGM_BENCH_FIGURE({"gpu.copy." #dir "." #mib "MiB", "sgm " verb " of a " #mib " MiB buffer on the GPU", "GB/s", \
                    "cuMemcpy" #dir "Async + synchronise on pinned memory, same bytes", Better::kHigher,       \
                    Target::Ratio(kAtLeast, 0.9), mode, GpuCopy(true, h2d, mib), GpuCopy(false, h2d, mib), 0, \
                    "gpu"})
SGM_BENCH_GPU_COPY(h2d, true, "promote (shared -> VRAM)", 64, kQuick);
SGM_BENCH_GPU_COPY(d2h, false, "demote (VRAM -> shared)", 64, kQuick);
SGM_BENCH_GPU_COPY(h2d, true, "promote (shared -> VRAM)", 256, kFullOnly);
SGM_BENCH_GPU_COPY(d2h, false, "demote (VRAM -> shared)", 256, kFullOnly);

Measure GpuKernel(bool shared) {
  const size_t bytes = 256ull << 20;
  const std::string key = std::string("gpu/kernel/") + (shared ? "shared" : "vram");
  const int64_t full = CudaIters(bytes, 8192ull << 20, 10, 100), quick = CudaIters(bytes, 1024ull << 20, 3, 10);
  Measure m = Gpu(key, bytes, full, quick, "GB/s", [=](benchmark::State &s, std::string k) {
    BM_CudaKernelRead(s, std::move(k), shared, bytes);
  });
  return [m](const RunContext &rc, std::string *skip) {
    const CudaSetup &d = CudaOpen();
    if (d.usable && !d.kernel_off.empty()) {
      *skip = "kernel figures need cuModuleLoadData, cuLaunchKernel and CUDA events: " + d.kernel_off;
      return 0.0;
    }
    return m(rc, skip);
  };
}

SGM_BENCH_FIGURE({"gpu.kernel.shared", "a kernel summing 256 MiB of shared memory (sgm's fallback tier) over the bus",
                  "GB/s", "the same kernel over 256 MiB of VRAM", Better::kHigher, Target::None(), kQuick,
                  GpuKernel(true), GpuKernel(false), 0, "gpu"});

Measure GpuPair(int which) {
  const std::string key = "gpu/pair/" + std::to_string(which);
  return Gpu(key, 1 << 20, 200000, 20000, "ns_per_call", [which](benchmark::State &s, std::string k) {
    BM_CudaSgmPair(s, std::move(k), static_cast<CudaPairStream>(which));
  });
}
Measure GpuDriverPair() {
  return Gpu("gpu/pair/driver", 1 << 20, 2000, 200, "ns_per_call",
             [](benchmark::State &s, std::string k) { BM_CudaDriverPair(s, std::move(k)); });
}

#define SGM_BENCH_GPU_PAIR(name, which, what)                                                                     \
  SGM_BENCH_FIGURE({"gpu.pair." #name, "sgm_alloc+sgm_free of 1 MiB on " what ", steady state", "ns",        \
                    "cuMemAlloc+cuMemFree of 1 MiB", Better::kLower, Target::None(), kQuick, GpuPair(which),     \
                    GpuDriverPair(), 0, "gpu"})
SGM_BENCH_GPU_PAIR(null_stream, kCudaNullStream, "the legacy NULL stream");
SGM_BENCH_GPU_PAIR(per_thread_stream, kCudaPerThreadStream, "the per-thread default stream");
SGM_BENCH_GPU_PAIR(created_stream, kCudaCreatedStream, "a created stream");

// ---- driver calls (sgm's own count, sgm_stats.driver_calls) ----

Measure GpuPairCalls(int which) {
  const std::string key = "gpu/calls/pair/" + std::to_string(which);
  return Gpu(key, 1 << 20, 2000, 200, "driver_calls_per_call", [which](benchmark::State &s, std::string k) {
    BM_CudaSgmPair(s, std::move(k), static_cast<CudaPairStream>(which));
  });
}

#define SGM_BENCH_GPU_PAIR_CALLS(name, which, what)                                                      \
  SGM_BENCH_FIGURE({"gpu.calls.pair." #name,                                                              \
                    "driver calls per steady-state sgm_alloc+sgm_free of 1 MiB on " what, kCountUnit, \
                    "PyTorch's caching allocator: 0 per steady-state pair", Better::kLower,               \
                    Target::Value(kAtMost, 0), kQuick, GpuPairCalls(which), Calls(0), 1, "gpu"})
SGM_BENCH_GPU_PAIR_CALLS(null_stream, kCudaNullStream, "the legacy NULL stream");
SGM_BENCH_GPU_PAIR_CALLS(per_thread_stream, kCudaPerThreadStream, "the per-thread default stream");
SGM_BENCH_GPU_PAIR_CALLS(created_stream, kCudaCreatedStream, "a created stream");

// pair: BM_CudaTransfer's (1 = two created blocking streams, 2 = two non-blocking,
// 3 = burst rounds of three sizes on two non-blocking streams).
Measure GpuTransferCalls(int pair) {
  const std::string key = "gpu/calls/transfer/" + std::to_string(pair);
  return Gpu(key, 4 << 20, 2000, 200, "driver_calls_per_call",
             [pair](benchmark::State &s, std::string k) { BM_CudaTransfer(s, std::move(k), pair); });
}

SGM_BENCH_FIGURE({"gpu.calls.transfer",
                  "driver calls per cross-stream transfer: a block freed on one created (blocking) stream taken by another",
                  kCountUnit, "cuEventRecord + cuStreamWaitEvent, a hand-written hand-off: 2", Better::kLower,
                  Target::Value(kAtMost, 2), kQuick, GpuTransferCalls(1), Calls(2), 1, "gpu"});
// No target: a block freed on a non-blocking stream since its last fence and
// taken by another stream needs both streams asked about capture, a record
// and a wait, 4 calls at the least (docs/streams.md, "Why two calls"); the
// reference is the hand-off that asks nothing.
SGM_BENCH_FIGURE({"gpu.calls.transfer.non_blocking",
                  "driver calls per cross-stream transfer: a block freed on one non-blocking stream taken by another",
                  kCountUnit, "cuEventRecord + cuStreamWaitEvent, a hand-written hand-off without capture checks: 2",
                  Better::kLower, Target::None(), kQuick, GpuTransferCalls(2), Calls(2), 1, "gpu"});
// A burst: each round one non-blocking stream takes blocks of three sizes
// from the other's cache. The first transfer of a round moves all three (the
// sizes the taker took in its last rounds, docs/streams.md "Why two calls"
// item 6): the non-blocking transfer's 4 calls per round, not 4 + 2.
SGM_BENCH_FIGURE({"gpu.calls.transfer.burst",
                  "driver calls per round: one non-blocking stream takes blocks of 3 sizes from another's cache",
                  kCountUnit, "cuEventRecord + cuStreamWaitEvent, a hand-written hand-off of the 3 blocks: 2",
                  Better::kLower, Target::Value(kAtMost, 4), kQuick, GpuTransferCalls(3), Calls(2), 1, "gpu"});

}  // namespace

}  // namespace sgm_bench
