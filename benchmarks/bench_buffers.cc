// bench_buffers.cc — movable buffers (issue 4), each beside its reference in
// the same run: demote/promote bandwidth against memcpy both ways, and the
// acquire latency of a VRAM-resident buffer. The bodies live in
// common/buffers.cc (sgm-bench runs them too).
#include "bodies.h"

using namespace sgm_bench;

BENCHMARK(BM_DemotePromote)->Arg(1 << 20)->Arg(16 << 20)->Arg(64 << 20);
BENCHMARK(BM_MemcpyTwoWays)->Arg(1 << 20)->Arg(16 << 20)->Arg(64 << 20);
BENCHMARK(BM_AcquireReleaseVram);
BENCHMARK(BM_AcquireVram);

BENCHMARK_MAIN();
