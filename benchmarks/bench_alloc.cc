// bench_alloc.cc — the public path: sgm_alloc + sgm_free pairs on a warmed
// context (emulated device, growth mode), 1 and 2 threads, with jemalloc's
// mallocx/dallocx of the same sizes and alignment measured in the same run.
// The bodies live in common/alloc.cc (sgm-bench runs them too).
#include <cstdlib>

#include "bodies.h"

using namespace sgm_bench;

BENCHMARK(BM_SgmAllocFree)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_JemallocPair)->Threads(1)->Threads(2)->UseRealTime();

int main(int argc, char **argv) {
  setenv("SGM_BACKEND", "emu", 0);
  setenv("SGM_VERBOSE", "0", 0);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  AllocContextDestroy();
  return 0;
}
