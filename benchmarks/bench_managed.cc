// bench_managed.cc — managed pointers (SGM_POINTERS=managed, issue 14) on the
// emulated device, each figure beside its reference in the same run:
//  - Moves: a 64 MiB managed block demoted to shared memory and promoted back
//    against memcpy of the same bytes both ways between two warm buffers.
//    Target: >= 0.9x memcpy.
//  - Alloc + free pairs in managed mode against fixed mode, for blocks under
//    2 MiB and for movable 4 MiB blocks (reused from the cache of freed
//    ranges). Target: <= 1.2x fixed.
// The bodies live in common/managed.cc (sgm-bench runs them too).
#include "bodies.h"

using namespace sgm_bench;

BENCHMARK(BM_ManagedDemotePromote64MiB)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemcpyTwoWays)->Arg(64 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_PairFixed)->Arg(64 << 10)->Arg(4 << 20);
BENCHMARK(BM_PairManaged)->Arg(64 << 10)->Arg(4 << 20);

BENCHMARK_MAIN();
