// bench_shared.cc — the shared GPU memory tier (issue 3), each figure beside
// its reference in the same run:
//  - Fallback path: sgm_alloc + sgm_free pairs when the VRAM budget is full,
//    so every block lands in shared memory; against the VRAM path (the same
//    pairs with VRAM free) and jemalloc's mallocx/dallocx of the same sizes.
//  - Commit cost: the allocation that pins a fresh shared chunk against doing
//    mmap + mlock of the same size directly.
// The bodies live in common/alloc.cc (sgm-bench runs them too).
#include "bodies.h"

using namespace sgm_bench;

BENCHMARK(BM_VramPath);
BENCHMARK(BM_FallbackPath);
BENCHMARK(BM_JemallocPath);
BENCHMARK(BM_SharedCommit)->Arg(2 << 20)->Arg(64 << 20)->UseRealTime();
BENCHMARK(BM_MmapMlock)->Arg(2 << 20)->Arg(64 << 20)->UseRealTime();

BENCHMARK_MAIN();
