// bench_node.cc — the node registry's costs (issue 13's targets), each with
// its reference in the same run (bodies in common/node.cc, which sgm-bench's
// node.* figures measure too):
//
//  - BM_NodeAllocFree/registry:{0,1}: sgm_alloc + sgm_free pairs on an
//    emulated device named by SGM_EMU_DEVICE with the registry off (the
//    reference) and on (joined; its ticker publishing every
//    SGM_NODE_PERIOD_MS, default 50 ms; set it in the environment to try
//    others). Run with --benchmark_enable_random_interleaving so the
//    machine's load falls on both alike. Target: on <= 1.05x off.
//  - BM_NodeJoinLeave beside BM_NodeOpenMap (a 1 KiB record file's creation
//    and removal in the registry folder: the floor of a join and a leave).
//    Target <= 1 ms.
//  - BM_NodeReclaim: SIGKILL of a joined process to its slot's reclaim by a
//    live context's ticker (50 ms period), mean of 10. Target <= 1 s.
//  - BM_SmiJson64 beside BM_True: `sgm-smi --json` with 64 processes joined,
//    and /bin/true, fork + exec each. Target <= 50 ms.
#include <benchmark/benchmark.h>

#include "bodies.h"

namespace {

using namespace sgm_bench;

BENCHMARK(BM_NodeAllocFree)->ArgName("registry")->Arg(0)->Arg(1)->Repetitions(8)->ReportAggregatesOnly(true);
BENCHMARK(BM_NodeJoinLeave)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_NodeOpenMap)->Unit(benchmark::kMicrosecond);

void BM_NodeReclaim(benchmark::State &state) {
  for (auto _ : state) state.SetIterationTime(NodeReclaimMs(1) / 1000.0);
}
BENCHMARK(BM_NodeReclaim)->UseManualTime()->Iterations(10)->Unit(benchmark::kMillisecond);

void BM_SmiJson64(benchmark::State &state) {
  if (!SmiPath()) {
    state.SkipWithError("sgm-smi not found");
    return;
  }
  for (auto _ : state) state.SetIterationTime(NodeSmiJsonMs(64, 1, false) / 1000.0);
}
BENCHMARK(BM_SmiJson64)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);

void BM_True(benchmark::State &state) {
  for (auto _ : state) state.SetIterationTime(NodeSmiJsonMs(0, 1, true) / 1000.0);
}
BENCHMARK(BM_True)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
