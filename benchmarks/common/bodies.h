// bodies.h — the benchmark bodies every benchmark front end shares: the
// bench_* binaries (Google Benchmark's own command line, one area each) and
// sgm-bench (every figure beside its reference, one table). A body is a plain
// Google Benchmark function; a front end registers it with its own arguments,
// repetitions and times. Nothing here registers anything by itself.
//
// Each body measures one side of a figure: sgm, or the reference it is judged
// against (jemalloc, memcpy, mmap+mlock, raw O_DIRECT I/O), on the same sizes
// and pattern, so a front end can run the two back to back in one process.
//
// Threading: the bodies run on Google Benchmark's threads; the shared state
// below (contexts, the disk buffers, the MiniMalloc traces) is set up before
// the runs and torn down after them, on the main thread.
#ifndef SGM_BENCH_BODIES_H
#define SGM_BENCH_BODIES_H

#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "sgm.h"

namespace sgm_bench {

// Sizes log-uniform in [lo, hi) from a xorshift64 seeded with seed: the
// spread of a framework's tensor sizes.
std::vector<size_t> LogUniformSizes(size_t n, double lo, double hi, uint64_t seed);

// ---- public path (bench_alloc) -------------------------------------------
// sgm_alloc + sgm_free pairs on a warmed context from the environment
// (growth mode), a ring of 64 live blocks per thread, 256 B .. 1 MiB; and
// jemalloc's mallocx/dallocx of the same sizes at the same alignment.
void BM_SgmAllocFree(benchmark::State &state);
void BM_JemallocPair(benchmark::State &state);
// The context BM_SgmAllocFree shares between its runs and threads.
void AllocContextDestroy();

// ---- capture pools (CUDA graphs) -------------------------------------------
// An emulated device with 4096 live 64 KiB blocks. BM_PoolPair(mode): the
// blocks belong to a capture pool; kPoolNone: no pool at all (the
// reference of kPoolOutside: ring pairs of 256 B .. 1 MiB); kPoolOutside: the
// pool exists, pairs outside its scope; kPoolInside: 64 KiB pairs inside its
// scope (a capture reusing its parked temporary; reference:
// BM_PoolPairPlain64K, the same pairs with no pool).
enum PoolPairMode { kPoolNone = 0, kPoolOutside = 1, kPoolInside = 2 };
void BM_PoolPair(benchmark::State &state);
void BM_PoolPairPlain64K(benchmark::State &state);

// ---- shared GPU memory (bench_shared) --------------------------------------
// Pairs 256 B .. 256 KiB with VRAM free (the VRAM path), with VRAM full (every
// block falls back to shared memory) and through jemalloc.
void BM_VramPath(benchmark::State &state);
void BM_FallbackPath(benchmark::State &state);
void BM_JemallocPath(benchmark::State &state);
// range(0) bytes: the allocation that commits a fresh shared chunk, and
// mmap + mlock of the same size.
void BM_SharedCommit(benchmark::State &state);
void BM_MmapMlock(benchmark::State &state);

// ---- movable buffers (bench_buffers) ---------------------------------------
// range(0) bytes demoted VRAM -> shared and promoted back; memcpy both ways.
void BM_DemotePromote(benchmark::State &state);
void BM_MemcpyTwoWays(benchmark::State &state);
void BM_AcquireReleaseVram(benchmark::State &state);
void BM_AcquireVram(benchmark::State &state);

// ---- managed pointers (bench_managed) --------------------------------------
// A 64 MiB managed block demoted to shared memory and promoted back per
// iteration (reference: BM_MemcpyTwoWays of 64 MiB); alloc+free pairs of
// range(0) bytes with SGM_POINTERS=fixed and =managed.
void BM_ManagedDemotePromote64MiB(benchmark::State &state);
void BM_PairFixed(benchmark::State &state);
void BM_PairManaged(benchmark::State &state);

// ---- sub-allocator (bench_suballoc) ----------------------------------------
// Churn of 10,000 live blocks through the virtual block, through jemalloc
// and through sgm_alloc/sgm_free (alloc.churn.10k), on the same sizes and
// victims: 256 B .. range(0) bytes (16 MiB, or 1 MiB for the second mix).
// BM_ChurnSgm on the emulated device, BM_ChurnSgmCuda on the CUDA backend.
void BM_ChurnSuballoc(benchmark::State &state);
void BM_ChurnJemalloc(benchmark::State &state);
void BM_ChurnSgm(benchmark::State &state);
void BM_ChurnSgmCuda(benchmark::State &state);

// One MiniMalloc trace (traces/README.md), as an alloc/free replay.
struct MiniEvent {
  uint64_t time;  // logical time
  int kind;       // 0 = free (sorts first at equal time), 1 = alloc
  uint32_t id;    // buffer id (index into MiniTrace::sizes)
};
struct MiniTrace {
  std::string name;              // "A" .. "K"
  std::vector<MiniEvent> events; // sorted replay order
  std::vector<uint64_t> sizes;   // bytes, by buffer index
  uint64_t peak_bytes = 0;       // peak live bytes
  uint64_t total_bytes = 0;      // sum of all sizes: a capacity that always works
  double fragmentation = 0;      // min capacity / peak (MiniMeasure)
  uint64_t min_capacity = 0;     // bytes: the smallest capacity found (MiniMeasure)
  double ns_per_event = 0;       // sub-allocator replay time per event (last run)
};
// Every DIR/minimalloc/{A..K}.1048576.csv that exists, loaded (a file that is
// there but unreadable is reported on stderr and left out).
std::vector<MiniTrace> MiniLoadAll(const std::string &dir);
// Fill fragmentation and min_capacity: the smallest arena in which the online
// replay succeeds (binary search), over the peak live bytes.
void MiniMeasure(MiniTrace *t);
// One replay of the whole trace per iteration at t->min_capacity; sets the
// counter "ns/event" (and t->ns_per_event).
void BM_ReplaySuballoc(benchmark::State &state, MiniTrace *t);
void BM_ReplayJemalloc(benchmark::State &state, const MiniTrace *t);

// ---- disk spill tier (bench_disk) ------------------------------------------
// DiskSetup allocates the 64 MiB source and destination, picks the folder and
// finds whether its file system takes O_DIRECT (sgm then uses it); the bodies
// take range(0) = extent (buffer) MiB, range(1) = 1 direct / 0 buffered and
// report manual time (Google Benchmark's UseManualTime). The sgm bodies use
// the public API only (sgm_buffer_evict to SGM_TIER_DISK, sgm_buffer_acquire
// back) and skip when range(1) is not the mode sgm uses there.
constexpr uint64_t kDiskBytesPerIteration = 64ull << 20;
bool DiskSetup(const std::string &dir);
void DiskTeardown();
const std::string &DiskDir();
void BM_SgmWrite(benchmark::State &state);
void BM_RawWrite(benchmark::State &state);
void BM_SgmRead(benchmark::State &state);
void BM_RawRead(benchmark::State &state);
void BM_Xxh3(benchmark::State &state);
// true when DiskSetup's folder takes O_DIRECT: sgm's I/O mode there.
bool DiskDirect();
// Bytes and timed seconds summed per "write/8MiB/direct" key, sgm and raw,
// for bench_disk's ratio table.
struct DiskTotals {
  std::string key;  // "write/8MiB/direct"
  double sgm_bytes, sgm_seconds, raw_bytes, raw_seconds;  // sums over timed iterations
};
std::vector<DiskTotals> DiskSummary();
// Which I/O mode sgm uses in DiskSetup's folder, in words.
std::string DiskDescribe();

// ---- a real GPU (bench_cuda) -----------------------------------------------
// The device sgm would open (SGM_DEVICE), opened once: libcuda.so.1 loaded
// through cuGetProcAddress, the primary context current on the calling
// thread. Without a usable device (or built without cuda.h) usable is false
// and why says what is missing; broken: the device answered, then failed.
struct CudaSetup {
  bool usable = false;             // a device is open and has room
  bool broken = false;             // a real error, not "no GPU here"
  std::string why;                 // !usable: why not
  std::string device;              // the device's name
  int driver_version = 0;          // cuDriverGetVersion: 1000 * major + 10 * minor
  std::string description;         // one line: device, memory, driver, caps
  size_t cap_bytes = 0;            // no benchmark holds more than this on the device
  std::vector<size_t> copy_sizes;  // 64 and 256 MiB, capped (distinct)
  size_t kernel_bytes = 0;         // 256 MiB, capped
  std::string kernel_off;          // "" or why the kernel benchmarks cannot run (the driver double)
};
const CudaSetup &CudaOpen();
void CudaClose();
int CudaFailures();  // failed driver or sgm calls seen by the bodies
// About `total` bytes per benchmark, within [lo, hi] iterations: the GPU
// bodies run fixed iteration counts (no estimation rounds redoing the setup).
int64_t CudaIters(size_t bytes, size_t total, int64_t lo, int64_t hi);
// key: the name the outcome is kept under (CudaGBps, CudaRatio, CudaPerCall).
// One iteration = one timed copy of `bytes`: sgm promoting (h2d) or demoting a
// buffer, or cuMemcpy{HtoD,DtoH}Async + synchronise on pinned memory. Counter
// "GB/s" (and "ms_per_call").
void BM_CudaSgmCopy(benchmark::State &state, std::string key, bool h2d, size_t bytes);
void BM_CudaDirectCopy(benchmark::State &state, std::string key, bool h2d, size_t bytes);
// A kernel summing `bytes` of an sgm_alloc pointer in VRAM or, shared, one
// that fell back to shared memory. Counter "GB/s".
void BM_CudaKernelRead(benchmark::State &state, std::string key, bool shared, size_t bytes);
// Per call: sgm_alloc+sgm_free of 1 MiB on a stream, cuMemAlloc+cuMemFree,
// a cross-stream transfer. Counters "ns_per_call", "driver_calls_per_call".
enum CudaPairStream { kCudaNullStream, kCudaPerThreadStream, kCudaCreatedStream };
void BM_CudaSgmPair(benchmark::State &state, std::string key, CudaPairStream which);
void BM_CudaDriverPair(benchmark::State &state, std::string key);
void BM_CudaTransfer(benchmark::State &state, std::string key, int pair);
// A created non-blocking stream on the device CudaOpen opened (PyTorch's side
// streams are such), or nullptr and *why; CudaStreamDelete destroys it.
void *CudaStreamNew(std::string *why);
void CudaStreamDelete(void *stream);
// On the driver double: when fences complete, the two extremes: lazy = 0, as
// soon as the worker can (no simulated delay); lazy = 1, only while a host
// thread waits for the device (fake_cuda_set_lazy). false on a real driver,
// where nothing is set.
bool CudaFenceMode(int lazy);
// bench_cuda's summary lines, from the outcomes kept under each key.
std::string CudaGBps(const std::string &key);
std::string CudaRatio(const std::string &num, const std::string &den, const char *fmt);
std::string CudaPerCall(const std::string &key);

// ---- the node registry (bench_node, node.cc) --------------------------------
// The private registry folder (under /dev/shm; removed at exit).
const std::string &NodeDir();
// range(0) = 0: sgm_alloc + sgm_free pairs with the registry off; 1: on.
void BM_NodeAllocFree(benchmark::State &state);
// One join + leave of a registry another member holds open; and the floor:
// a 1 KiB record file created, allocated, written, locked, mapped, renamed,
// then unlinked, unmapped and closed in the same folder.
void BM_NodeJoinLeave(benchmark::State &state);
void BM_NodeOpenMap(benchmark::State &state);
// Mean ms from SIGKILL of a joined process to its slot's reclaim by a live
// context's ticker (SGM_NODE_PERIOD_MS = 50), over rounds kills.
double NodeReclaimMs(int rounds);
// Mean ms of `sgm-smi --json` (reference: /bin/true), fork + exec, with
// processes joined; 0 when sgm-smi is not found.
double NodeSmiJsonMs(int processes, int rounds, bool reference);
// sgm-smi next to this program, else in the build tree; NULL when neither.
const char *SmiPath();

}  // namespace sgm_bench

#endif  // SGM_BENCH_BODIES_H
