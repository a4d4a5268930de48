// figure.h — what sgm-bench measures: a *figure* is one number of sgm's
// (value) beside its reference measured in the same run (reference), their
// ratio value / reference, and a target on one of them. Adding a figure is
// one registration (figures.cc):
//
//   SGM_BENCH_FIGURE(
//       {"alloc.pair.1t", "sgm_alloc+sgm_free pair, 1 thread", "ns",
//        "jemalloc mallocx/dallocx, same sizes", Better::kLower,
//        Target::Value(kAtMost, 80), kQuick, GbTime(BM_SgmAllocFree), GbTime(BM_JemallocPair)});
//
// A figure whose unit is kCountUnit ("calls") counts something sgm should do
// rarely or never (driver calls): its value and reference may be 0, and its
// ratio is (value + 1) / (reference + 1), so that 0 beside 0 reads 1.
//
// Each repetition measures sgm then the reference, back to back, so a noisy
// machine hits both; value, reference and ratio are the medians over the
// repetitions (the ratio's median of the per-repetition ratios), and the
// spread is the relative half-range of those ratios (docs/sgm-bench.md).
#ifndef SGM_BENCH_FIGURE_H
#define SGM_BENCH_FIGURE_H

#include <benchmark/benchmark.h>

#include "report.h"  // kCountUnit, IsCount

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace sgm_bench {

enum class Better { kLower, kHigher };  // which way is good, for value and ratio alike
enum Bound { kAtMost, kAtLeast };

struct Target {
  enum Kind { kNone, kValue, kRatio };
  Kind kind = kNone;       // what the bound applies to
  Bound bound = kAtMost;   // <= or >=
  double limit = 0;        // the bound, in the value's unit (kValue) or as a ratio
  static Target None() { return {}; }
  static Target Value(Bound b, double x) { return {kValue, b, x}; }
  static Target Ratio(Bound b, double x) { return {kRatio, b, x}; }
};

// What a measure sees of the command line.
struct RunContext {
  bool quick = false;        // --quick
  double min_time_s = 0.5;   // Google Benchmark's minimum time per run
  std::string traces_dir;    // --traces (or the default)
  std::string spill_dir;     // --spill-dir
};

// One repetition of one side of a figure: its value, or "" / *skip set to why
// it cannot run here (no GPU, no trace, a file system without O_DIRECT).
using Measure = std::function<double(const RunContext &, std::string *skip)>;

enum Mode { kFullOnly = 0, kQuick = 1 };  // kQuick: part of --quick (and of full runs)

struct Figure {
  std::string name;        // stable key, "area.figure[.variant]": what --only and --compare match
  std::string what;        // one line: what is measured
  std::string unit;        // unit of value and reference ("ns", "GB/s", "%", "x")
  std::string reference;   // one line: what the reference is
  Better better;           // which way is good
  Target target;           // the bound the verdict checks
  Mode mode;               // kQuick or kFullOnly
  Measure sgm;             // sgm's side
  Measure ref;             // the reference side
  int repetitions = 0;     // 0: the run's default; 1 for figures that do not vary (counts, ratios of hits)
  std::string needs = {};  // "" | "traces" | "gpu" | "o_direct": what a skip depends on (--list, tests)
};

// Registration (static initialisers call it); figures are kept sorted by name.
bool RegisterFigure(Figure f);
#define SGM_BENCH_CAT2(a, b) a##b
#define SGM_BENCH_CAT(a, b) SGM_BENCH_CAT2(a, b)
#define SGM_BENCH_FIGURE(...) \
  static const bool SGM_BENCH_CAT(sgm_bench_figure_, __LINE__) = ::sgm_bench::RegisterFigure(__VA_ARGS__)
const std::vector<Figure> &Figures();

// ---- measures built from Google Benchmark bodies (common/bodies.h) ----

using Body = std::function<void(benchmark::State &)>;

struct Gb {
  std::string label;              // the name Google Benchmark gives the run
  Body body;                      // the body
  std::vector<int64_t> args;      // state.range(0..)
  int threads = 1;                // threads running the body
  bool manual_time = false;       // the body reports its own time (SetIterationTime)
  std::string counter;            // "": real ns per iteration; else this counter's value
  double scale = 1;               // the value is multiplied by it (1e-9: bytes/s -> GB/s)
  double max_min_time_s = 0;      // > 0: cap on the run's minimum time (bodies that move 64 MiB an iteration)
  int64_t iterations = 0;         // > 0: exactly this many iterations, no minimum time (GPU bodies)
};
// One Google Benchmark run of g with rc's minimum time; its value, or 0 and
// *skip = the body's error.
double RunGb(const Gb &g, const RunContext &rc, std::string *skip);
inline Measure GbMeasure(Gb g) {
  return [g](const RunContext &rc, std::string *skip) { return RunGb(g, rc, skip); };
}
// Real nanoseconds per iteration.
inline Measure GbTime(const std::string &label, Body b, std::vector<int64_t> args = {}) {
  return GbMeasure({label, std::move(b), std::move(args), 1, false, "", 1, 0});
}
// GB/s (10^9 bytes/s) from SetBytesProcessed.
inline Measure GbBandwidth(const std::string &label, Body b, std::vector<int64_t> args,
                           bool manual_time = false) {
  return GbMeasure({label, std::move(b), std::move(args), 1, manual_time, "bytes_per_second", 1e-9, 0});
}

}  // namespace sgm_bench

#endif  // SGM_BENCH_FIGURE_H
