// bench_cuda.cc — bandwidth of sgm's tiers on a real NVIDIA GPU (issue 6, item 5),
// each figure beside its reference in the same run:
//  (a) Copies. A 64 MiB and a 256 MiB sgm_buffer moved VRAM -> shared memory
//      (sgm_buffer_evict: a device-to-host copy) and back (sgm_buffer_acquire: a
//      host-to-device promotion), against cuMemcpy{HtoD,DtoH}Async + stream
//      synchronise between a cuMemHostAlloc'ed pinned buffer and a cuMemAlloc'ed
//      device buffer of the same size. Ratio: sgm / direct (1.0 = no overhead).
//  (b) A kernel reading memory. A grid-stride sum of 32-bit words over a
//      256 MiB sgm_alloc pointer in VRAM, and over one that fell back to the
//      shared tier (host memory the GPU reads over PCIe / NVLink-C2C), timed
//      with CUDA events. Ratio: shared / VRAM, the "slows down instead of
//      failing" figure; the sums are checked against the bytes written.
//  (c) Per call (issue 10: "so that the first GPU run shows the real cost").
//      ns per steady-state sgm_alloc+sgm_free pair (1 MiB) on the legacy NULL
//      stream, the per-thread default stream and a created stream, beside
//      ns per cuMemAlloc+cuMemFree pair of the same size; ns per cross-stream
//      transfer (a 4 MiB budget that one block fills, allocations alternating
//      between a created stream and the NULL stream, between two created
//      streams, and between two non-blocking streams). Driver calls per sgm pair or transfer are sgm's own count
//      (sgm_stats.driver_calls), on a real driver too; those of the
//      cuMemAlloc+cuMemFree reference come from the driver test double's
//      counter when libcuda.so.1 is the double ("calls n/a" on a real driver).
// After the Google Benchmark table it prints one "bench_cuda: ..." line per
// pair with both bandwidths in GB/s (10^9 bytes/s), ms per call and the ratio,
// and one per (c) figure with ns per call; tests/gpu/run.sh copies those lines
// into its SUMMARY.
//
// Skipping. Without a usable GPU (libcuda.so.1 cannot be dlopen'ed, no
// cuGetProcAddress, cuInit fails, no device, too little free memory) it prints
// one "bench_cuda: skipping: <why>" line and exits 0; built without the CUDA
// headers it prints "built without CUDA headers: skipping". Kernel benchmarks
// need cuModuleLoadData/cuLaunchKernel/events: a driver without them (the test
// double in tests/support/fake_cuda) gets a "kernel benchmarks skipped" line and
// only part (a) runs. Exit status 1 only when, once the driver has reported the
// device, a CUDA call, an sgm call or a data check failed.
//
// Loading the driver. The binary never links libcuda: it mirrors sgm's own
// backend (lib/backend/cuda/cuda.c, docs/cuda.md) — dlopen("libcuda.so.1"),
// dlsym of cuDriverGetVersion and cuGetProcAddress_v2 (falling back to the
// 4-argument cuGetProcAddress of 11.3–11.8 drivers), then every other entry
// point through cuGetProcAddress for CUDA ABI min(driver, 12.0). Not plain dlsym
// of versioned names ("cuMemAlloc_v2"): cuGetProcAddress is the driver's own
// answer to "which version of this symbol has the signature of CUDA X", so the
// hand-written signatures below hold for any driver from 11.3 on, and it is how
// the test double exports its entry points (by base name only). The signatures
// are written out here rather than taken from cudaTypedefs.h so the file needs
// cuda.h alone. The driver's primary context is retained and made current on
// the benchmark thread (push/pop rather than cuCtxSetCurrent: the double has
// only the former), so sgm, which uses the same primary context, and the
// direct references share one context. Copies use the Async calls on a
// non-blocking stream plus cuStreamSynchronize — the calls sgm's backend makes.
//
// The bodies live in common/cuda.cc (sgm-bench runs them too; bodies.h).
//
// Sizes never exceed the card: cuMemGetInfo first, every size capped at
// (free - 256 MiB) / 2 and at RAM / 8, and at BENCH_CUDA_MAX_MIB when set (for
// quick runs, e.g. against the test double).
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "bodies.h"

using namespace sgm_bench;

namespace {

constexpr size_t kMiB = size_t{1} << 20;

std::string MiBName(size_t bytes) { return std::to_string(bytes / kMiB) + "MiB"; }

}  // namespace

int main(int argc, char **argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  const CudaSetup &dev = CudaOpen();
  if (!dev.usable) {
    std::printf("bench_cuda: %s: %s\n", dev.broken ? "error opening the device" : "skipping", dev.why.c_str());
    return dev.broken ? 1 : 0;
  }

  const std::vector<size_t> &copy_sizes = dev.copy_sizes;
  const size_t kernel_size = dev.kernel_bytes;
  std::printf("bench_cuda: %s\n", dev.description.c_str());
  std::fflush(stdout);

  struct Pair {
    std::string label, sgm_key, ref_key;
  };
  std::vector<Pair> copy_pairs;
  for (size_t s : copy_sizes) {
    const int64_t n = CudaIters(s, 2048 * kMiB, 5, 50);
    for (bool h2d : {true, false}) {
      const std::string sgm_key = std::string(h2d ? "copy_h2d/sgm_promote/" : "copy_d2h/sgm_demote/") + MiBName(s);
      const std::string ref_key =
          std::string(h2d ? "copy_h2d/cuMemcpyHtoD_pinned/" : "copy_d2h/cuMemcpyDtoH_pinned/") + MiBName(s);
      benchmark::RegisterBenchmark(sgm_key.c_str(), BM_CudaSgmCopy, sgm_key, h2d, s)
          ->UseManualTime()->Iterations(n)->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(ref_key.c_str(), BM_CudaDirectCopy, ref_key, h2d, s)
          ->UseManualTime()->Iterations(n)->Unit(benchmark::kMillisecond);
      copy_pairs.push_back({std::string(h2d ? "H2D " : "D2H ") + std::to_string(s / kMiB) + " MiB: sgm " +
                                (h2d ? "promote" : "demote"),
                            sgm_key, ref_key});
    }
  }
  const std::string &kernel_off = dev.kernel_off;
  const std::string vram_key = "kernel_read/vram/" + MiBName(kernel_size);
  const std::string shared_key = "kernel_read/shared/" + MiBName(kernel_size);
  if (kernel_off.empty()) {
    const int64_t n = CudaIters(kernel_size, 8192 * kMiB, 10, 100);
    benchmark::RegisterBenchmark(vram_key.c_str(), BM_CudaKernelRead, vram_key, false, kernel_size)
        ->UseManualTime()->Iterations(n)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(shared_key.c_str(), BM_CudaKernelRead, shared_key, true, kernel_size)
        ->UseManualTime()->Iterations(n)->Unit(benchmark::kMillisecond);
  } else {
    std::printf("bench_cuda: kernel benchmarks skipped: %s (cuModuleLoadData, cuLaunchKernel and "
                "CUDA events are needed)\n", kernel_off.c_str());
    std::fflush(stdout);
  }

  // (c) per call: fixed iteration counts, so a slow driver cannot stretch the run.
  const std::vector<std::pair<std::string, std::string>> call_lines = {
      {"pair 1 MiB, NULL stream: sgm_alloc+sgm_free", "call/sgm_pair/null"},
      {"pair 1 MiB, per-thread stream: sgm_alloc+sgm_free", "call/sgm_pair/per_thread"},
      {"pair 1 MiB, created stream: sgm_alloc+sgm_free", "call/sgm_pair/created"},
      {"pair 1 MiB: cuMemAlloc+cuMemFree (reference)", "call/driver_pair"},
      {"transfer, created <-> NULL stream", "call/transfer/created_null"},
      {"transfer, created <-> created stream", "call/transfer/created_created"},
      {"transfer, non-blocking <-> non-blocking stream", "call/transfer/nonblocking"}};
  benchmark::RegisterBenchmark("call/sgm_pair/null", BM_CudaSgmPair, std::string("call/sgm_pair/null"), kCudaNullStream)
      ->Iterations(200000);
  benchmark::RegisterBenchmark("call/sgm_pair/per_thread", BM_CudaSgmPair, std::string("call/sgm_pair/per_thread"),
                               kCudaPerThreadStream)->Iterations(200000);
  benchmark::RegisterBenchmark("call/sgm_pair/created", BM_CudaSgmPair, std::string("call/sgm_pair/created"),
                               kCudaCreatedStream)->Iterations(200000);
  benchmark::RegisterBenchmark("call/driver_pair", BM_CudaDriverPair, std::string("call/driver_pair"))
      ->Iterations(2000);
  benchmark::RegisterBenchmark("call/transfer/created_null", BM_CudaTransfer,
                               std::string("call/transfer/created_null"), 0)->Iterations(20000);
  benchmark::RegisterBenchmark("call/transfer/created_created", BM_CudaTransfer,
                               std::string("call/transfer/created_created"), 1)->Iterations(20000);
  benchmark::RegisterBenchmark("call/transfer/nonblocking", BM_CudaTransfer,
                               std::string("call/transfer/nonblocking"), 2)->Iterations(20000);

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::printf("\n");
  for (const Pair &p : copy_pairs)
    std::printf("bench_cuda: %s %s | direct %s pinned %s | sgm/direct %s\n", p.label.c_str(),
                CudaGBps(p.sgm_key).c_str(),
                p.ref_key.find("h2d") != std::string::npos ? "cuMemcpyHtoD" : "cuMemcpyDtoH",
                CudaGBps(p.ref_key).c_str(), CudaRatio(p.sgm_key, p.ref_key, "%.3f").c_str());
  if (kernel_off.empty())
    std::printf("bench_cuda: kernel read %zu MiB: VRAM %s | shared %s | shared/VRAM %s\n",
                kernel_size / kMiB, CudaGBps(vram_key).c_str(), CudaGBps(shared_key).c_str(),
                CudaRatio(shared_key, vram_key, "%.4f").c_str());
  else
    std::printf("bench_cuda: kernel read: skipped: %s\n", kernel_off.c_str());
  for (const auto &l : call_lines)
    std::printf("bench_cuda: %s: %s\n", l.first.c_str(), CudaPerCall(l.second).c_str());
  CudaClose();
  if (CudaFailures()) {
    std::printf("bench_cuda: %d failure(s), see above\n", CudaFailures());
    return 1;
  }
  return 0;
}

