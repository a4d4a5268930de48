// bench_suballoc.cc — the offset-based sub-allocator (lib/suballoc.c), through
// its public face, the virtual block (include/sgm/vblock.h).
//
// 1. Churn: 10,000 live blocks, sizes log-uniform 256 B .. 16 MiB (and .. 1 MiB), alignment
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
//    same events as the reference. A last line sums up: fragmentation per
//    trace, its geometric mean and maximum, mean ns per event.
//
// Usage: bench_suballoc [--traces=DIR] [Google Benchmark flags]. DIR defaults
// to SGM_TRACES_DEFAULT; without it the trace benchmarks are skipped. The
// bodies live in common/suballoc.cc (sgm-bench runs them too).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bodies.h"

#ifndef SGM_TRACES_DEFAULT
#define SGM_TRACES_DEFAULT "../shared/traces"
#endif

using namespace sgm_bench;

BENCHMARK(BM_ChurnSuballoc)->Arg(16 << 20)->Arg(1 << 20)->Repetitions(5)->ReportAggregatesOnly(true)->MinTime(0.3);
BENCHMARK(BM_ChurnJemalloc)->Arg(16 << 20)->Arg(1 << 20)->Repetitions(5)->ReportAggregatesOnly(true)->MinTime(0.3);
BENCHMARK(BM_ChurnSgm)->Arg(16 << 20)->Arg(1 << 20)->Repetitions(5)->ReportAggregatesOnly(true)->MinTime(0.3);

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

  static std::vector<MiniTrace> traces = MiniLoadAll(dir);
  if (traces.empty())
    std::printf("bench_suballoc: no MiniMalloc traces under %s/minimalloc: skipping the trace "
                "benchmarks (pass --traces=DIR)\n", dir.c_str());
  for (MiniTrace &t : traces) {
    MiniMeasure(&t);
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
    double log_sum = 0, worst = 0, ns_sum = 0;
    std::string per;
    char buf[64];
    for (const MiniTrace &t : traces) {
      ns_sum += t.ns_per_event;
      log_sum += std::log(t.fragmentation);
      worst = std::max(worst, t.fragmentation);
      std::snprintf(buf, sizeof buf, " %s=%.3f", t.name.c_str(), t.fragmentation);
      per += buf;
    }
    std::printf("minimalloc fragmentation (best fit, toward the nearer range end, align 1):%s "
                "geomean=%.3f max=%.3f over %zu traces; replay %.1f ns/event (mean; 0 = not run)\n",
                per.c_str(), std::exp(log_sum / static_cast<double>(traces.size())), worst,
                traces.size(), ns_sum / static_cast<double>(traces.size()));
  }
  return 0;
}
