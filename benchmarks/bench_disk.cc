// bench_disk.cc — the disk tier (issue 4), through the public API only
// (issue 11): spill write (sgm_buffer_evict to SGM_TIER_DISK) and read-back
// (sgm_buffer_acquire, checksum verified) bandwidth against raw sequential
// pwrite / pread of the same bytes in the same extent sizes, on the same file
// system, in the same I/O mode (the one sgm uses there: O_DIRECT where the
// file system takes it), in the same run. 64 MiB of random data per
// iteration, as buffers (extents) of 1, 8 and 64 MiB.
//
// Flags: --dir=DIR (default /tmp) picks the file system; the rest go to
// Google Benchmark. The ratio table sgm/raw is printed at the end. The bodies
// live in common/disk.cc (sgm-bench runs them too).
#include <cstdio>
#include <cstring>
#include <string>

#include "bodies.h"

using namespace sgm_bench;

namespace {

void Register() {
  const int direct = DiskDirect() ? 1 : 0;  // the mode sgm uses in that folder
  for (int ext : {1, 8, 64}) {
    // sgm and raw side by side, so drift on a noisy machine hits both.
    benchmark::RegisterBenchmark("BM_SgmWrite", BM_SgmWrite)->Args({ext, direct})->UseManualTime();
    benchmark::RegisterBenchmark("BM_RawWrite", BM_RawWrite)->Args({ext, direct})->UseManualTime();
    benchmark::RegisterBenchmark("BM_SgmRead", BM_SgmRead)->Args({ext, direct})->UseManualTime();
    benchmark::RegisterBenchmark("BM_RawRead", BM_RawRead)->Args({ext, direct})->UseManualTime();
  }
  benchmark::RegisterBenchmark("BM_Xxh3", BM_Xxh3);
}

}  // namespace

int main(int argc, char **argv) {
  std::string dir = "/tmp";
  int w = 1;
  for (int i = 1; i < argc; i++) {
    if (std::strncmp(argv[i], "--dir=", 6) == 0)
      dir = argv[i] + 6;
    else
      argv[w++] = argv[i];
  }
  argc = w;
  argv[argc] = nullptr;
  if (!DiskSetup(dir)) return 1;
  std::printf("bench_disk: --dir=%s on %s\n", dir.c_str(), DiskDescribe().c_str());
  std::printf("bench_disk: sgm through the public API (sgm_buffer_evict to the disk tier, "
              "sgm_buffer_acquire back) against raw I/O in the same mode; reads never hit the "
              "page cache\n");

  Register();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::printf("\n%-24s %12s %12s %7s\n", "sgm / raw", "sgm MB/s", "raw MB/s", "ratio");
  for (const DiskTotals &t : DiskSummary()) {
    if (t.sgm_seconds <= 0 || t.raw_seconds <= 0) continue;
    double a = t.sgm_bytes / t.sgm_seconds / 1e6;
    double b = t.raw_bytes / t.raw_seconds / 1e6;
    std::printf("%-24s %12.0f %12.0f %7.2f\n", t.key.c_str(), a, b, a / b);
  }
  DiskTeardown();
  return 0;
}
