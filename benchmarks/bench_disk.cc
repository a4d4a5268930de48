// bench_disk.cc — the disk tier (issue 4): spill write and read-back
// bandwidth through sgm__disk_write / sgm__disk_read (checksum included)
// against raw sequential pwrite / pread of the same bytes in the same extent
// sizes, on the same file system, in the same run.
//
// 64 MiB of random data per iteration, in extents of 1, 8 and 64 MiB, in
// both I/O modes, each with its own fair reference:
//  - direct:   sgm in DIRECT mode vs raw pwrite/pread on an O_DIRECT file;
//  - buffered: sgm in BUFFERED mode (page cache, write-back and DONTNEED per
//    extent) vs raw buffered pwrite of all 64 MiB, one sync_file_range and one
//    POSIX_FADV_DONTNEED at the end (the cheapest way to get the same bytes to
//    disk and out of the cache); reads: pread then DONTNEED, so every
//    iteration reads from the device, never from the page cache.
// Between write iterations the extents are freed (sgm: holes punched; raw:
// the same range punched), so every write allocates blocks afresh.
// "cached_MiB" counts the spill file's pages left in the page cache (mincore).
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
  for (int direct = 1; direct >= 0; direct--)
    for (int ext : {1, 8, 64}) {
      // sgm and raw side by side, so drift on a noisy machine hits both.
      benchmark::RegisterBenchmark("BM_SgmWrite", BM_SgmWrite)->Args({ext, direct})
          ->UseManualTime();
      benchmark::RegisterBenchmark("BM_RawWrite", BM_RawWrite)->Args({ext, direct})
          ->UseManualTime();
      benchmark::RegisterBenchmark("BM_SgmRead", BM_SgmRead)->Args({ext, direct})
          ->UseManualTime();
      benchmark::RegisterBenchmark("BM_RawRead", BM_RawRead)->Args({ext, direct})
          ->UseManualTime();
    }
  benchmark::RegisterBenchmark("BM_SgmWriteUnaligned", BM_SgmWriteUnaligned)->Arg(8)
      ->UseManualTime();
  benchmark::RegisterBenchmark("BM_SgmReadUnaligned", BM_SgmReadUnaligned)->Arg(8)
      ->UseManualTime();
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
  std::printf("bench_disk: reads never hit the page cache: direct = O_DIRECT for sgm and raw; "
              "buffered = page cache + POSIX_FADV_DONTNEED after each read for both\n");

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
