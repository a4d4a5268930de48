// cuda.cc — bodies of the GPU benchmarks (bench_cuda): copies through sgm
// against the driver's own cuMemcpy on pinned memory, a kernel reading VRAM
// and shared memory, and per-call costs against cuMemAlloc+cuMemFree. What
// each measures, how the driver is loaded and how sizes are capped: the
// comment at the top of bench_cuda.cc. The facade at the end (bodies.h) opens
// the device once and exposes the bodies to bench_cuda and sgm-bench; built
// without cuda.h, every body skips with that reason.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "sgm.h"

#include <unistd.h>

#include "bodies.h"

#if defined(__has_include)
// benchmarks/CMakeLists.txt adds SGM_CUDA_INCLUDE_DIR when CMake found the toolkit.
#if __has_include(<cuda.h>)
#include <cuda.h>
#define BENCH_CUDA_HEADERS 1
#endif
#endif

#if defined(BENCH_CUDA_HEADERS) && CUDA_VERSION >= 12000


#include <dlfcn.h>
#include <unistd.h>

namespace sgm_bench {

namespace {

// ---- the driver table ----

// X(name, params): base name as cuGetProcAddress takes it, and the parameter
// list of its signature at CUDA ABI 12.0 (every one returns CUresult). Required:
// without them nothing can be measured. The names are macros in cuda.h
// (cuMemAlloc -> cuMemAlloc_v2); they are only ever stringified or pasted, which
// does not expand them.
#define BENCH_CU_REQUIRED(X)                                                    \
  X(cuGetErrorName, (CUresult, const char **))                                  \
  X(cuInit, (unsigned int))                                                     \
  X(cuDeviceGetCount, (int *))                                                  \
  X(cuDeviceGet, (CUdevice *, int))                                             \
  X(cuDeviceGetName, (char *, int, CUdevice))                                   \
  X(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                          \
  X(cuDevicePrimaryCtxRelease, (CUdevice))                                      \
  X(cuCtxPushCurrent, (CUcontext))                                              \
  X(cuCtxPopCurrent, (CUcontext *))                                             \
  X(cuMemGetInfo, (size_t *, size_t *))                                         \
  X(cuMemAlloc, (CUdeviceptr *, size_t))                                        \
  X(cuMemFree, (CUdeviceptr))                                                   \
  X(cuMemHostRegister, (void *, size_t, unsigned int))                          \
  X(cuMemHostUnregister, (void *))                                              \
  X(cuMemcpyHtoDAsync, (CUdeviceptr, const void *, size_t, CUstream))           \
  X(cuMemcpyDtoHAsync, (void *, CUdeviceptr, size_t, CUstream))                 \
  X(cuStreamCreate, (CUstream *, unsigned int))                                 \
  X(cuStreamDestroy, (CUstream))                                                \
  X(cuStreamSynchronize, (CUstream))

// Optional: pinned allocation for the copy reference (else the reference uses
// registered memory, as sgm does), and what the kernel benchmarks need.
#define BENCH_CU_OPTIONAL(X)                                                    \
  X(cuDeviceGetAttribute, (int *, CUdevice_attribute, CUdevice))                \
  X(cuMemHostAlloc, (void **, size_t, unsigned int))                            \
  X(cuMemFreeHost, (void *))                                                    \
  X(cuModuleLoadData, (CUmodule *, const void *))                               \
  X(cuModuleUnload, (CUmodule))                                                 \
  X(cuModuleGetFunction, (CUfunction *, CUmodule, const char *))                \
  X(cuLaunchKernel, (CUfunction, unsigned int, unsigned int, unsigned int,      \
                     unsigned int, unsigned int, unsigned int, unsigned int,    \
                     CUstream, void **, void **))                               \
  X(cuEventCreate, (CUevent *, unsigned int))                                   \
  X(cuEventRecord, (CUevent, CUstream))                                         \
  X(cuEventSynchronize, (CUevent))                                              \
  X(cuEventElapsedTime, (float *, CUevent, CUevent))                            \
  X(cuEventDestroy, (CUevent))

// The newest CUDA ABI asked for: the signatures above are those of 12.0.
constexpr int kAbiVersion = 12000;
constexpr size_t kMiB = size_t{1} << 20;

struct Driver {
#define BENCH_CU_MEMBER(name, params) CUresult(*pfn_##name) params = nullptr;
  BENCH_CU_REQUIRED(BENCH_CU_MEMBER)
  BENCH_CU_OPTIONAL(BENCH_CU_MEMBER)
#undef BENCH_CU_MEMBER
  int driver_version = 0;   // cuDriverGetVersion: 1000 * major + 10 * minor
  CUdevice dev = 0;         // the device sgm opens too (SGM_DEVICE)
  int ordinal = 0;          // its ordinal
  CUcontext ctx = nullptr;  // its primary context, current on the benchmark thread
  char name[128] = "";      // the device's name
  size_t free_bytes = 0;    // cuMemGetInfo at start
  size_t total_bytes = 0;   // cuMemGetInfo at start
  unsigned grid = 0;        // blocks of the sum kernel: enough to fill every SM
};
Driver g_cu;  // filled once by OpenDevice(), before any benchmark runs

#define CU(name) (g_cu.pfn_##name)

// Outcome of each benchmark, by name, for the summary lines.
struct Outcome {
  double bytes = 0;    // bytes moved or read in the timed part
  double seconds = 0;  // timed seconds
  double calls = 0;    // timed calls (copies, pairs, transfers)
  double driver_calls = -1;  // driver calls per timed call; -1 = not counted (the reference on a real driver)
  std::string error;   // why it failed; "" when it ran
};
std::map<std::string, Outcome> g_outcomes;
int g_failures = 0;     // errors seen: failed benchmarks, failed frees
std::string g_pinned_kind = "cuMemHostAlloc";  // how the copy reference's pinned buffer is made

std::string CuErrorName(CUresult r) {
  const char *name = nullptr;
  if (CU(cuGetErrorName) && CU(cuGetErrorName)(r, &name) == CUDA_SUCCESS && name) return name;
  return "CUresult " + std::to_string(static_cast<int>(r));
}

// Record a failure of benchmark `key` and skip the rest of it.
void Fail(benchmark::State &state, const std::string &key, const std::string &why) {
  std::fprintf(stderr, "bench_cuda: %s: %s\n", key.c_str(), why.c_str());
  g_outcomes[key].error = why;
  g_failures++;
  state.SkipWithError(why.c_str());
}

// True when r is CUDA_SUCCESS; otherwise the benchmark fails naming the call.
bool CuOk(benchmark::State &state, const std::string &key, CUresult r, const char *call) {
  if (r == CUDA_SUCCESS) return true;
  Fail(state, key, std::string(call) + " failed: " + CuErrorName(r));
  return false;
}

// A failed free or destroy cannot skip anything any more: say so on stderr.
void LogIfFailed(CUresult r, const char *call) {
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "bench_cuda: %s failed: %s\n", call, CuErrorName(r).c_str());
    g_failures++;
  }
}

// ---- loading and opening ----

// Load libcuda.so.1 and resolve the table; "" on success, else why not.
std::string LoadDriver() {
  dlerror();
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *e = dlerror();
    return std::string("libcuda.so.1 could not be loaded (") + (e ? e : "no reason given") +
           "): no NVIDIA driver here";
  }
  using GetVersionFn = CUresult (*)(int *);
  using Gpa2Fn = CUresult (*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
  using Gpa1Fn = CUresult (*)(const char *, void **, int, cuuint64_t);
  auto get_version = reinterpret_cast<GetVersionFn>(dlsym(lib, "cuDriverGetVersion"));
  auto gpa2 = reinterpret_cast<Gpa2Fn>(dlsym(lib, "cuGetProcAddress_v2"));
  auto gpa1 = reinterpret_cast<Gpa1Fn>(dlsym(lib, "cuGetProcAddress"));
  int version = 0;
  if (!get_version || get_version(&version) != CUDA_SUCCESS || (!gpa2 && !gpa1))
    return "libcuda.so.1 has no cuDriverGetVersion/cuGetProcAddress (a driver older than CUDA 11.3?)";
  g_cu.driver_version = version;
  if (version < 11030)  // no cuGetProcAddress before 11.3; sgm refuses such drivers too
    return "the driver's API version " + std::to_string(version / 1000) + "." +
           std::to_string(version % 1000 / 10) + " is older than 11.3";
  // Asking a driver for a newer ABI than its own is an error.
  const int abi = std::min(version, kAbiVersion);
  auto resolve = [&](const char *sym) -> void * {
    void *p = nullptr;
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SUCCESS;
    CUresult r = gpa2 ? gpa2(sym, &p, abi, CU_GET_PROC_ADDRESS_DEFAULT, &found)
                      : gpa1(sym, &p, abi, CU_GET_PROC_ADDRESS_DEFAULT);
    return r == CUDA_SUCCESS && found == CU_GET_PROC_ADDRESS_SUCCESS ? p : nullptr;
  };
#define BENCH_CU_RESOLVE_REQUIRED(name, params)                                                \
  g_cu.pfn_##name = reinterpret_cast<decltype(g_cu.pfn_##name)>(resolve(#name));               \
  if (!g_cu.pfn_##name)                                                                        \
    return "libcuda.so.1 (driver API " + std::to_string(version / 1000) + "." +                \
           std::to_string(version % 1000 / 10) + ") has no entry point " #name;
#define BENCH_CU_RESOLVE_OPTIONAL(name, params) \
  g_cu.pfn_##name = reinterpret_cast<decltype(g_cu.pfn_##name)>(resolve(#name));
  BENCH_CU_REQUIRED(BENCH_CU_RESOLVE_REQUIRED)
  BENCH_CU_OPTIONAL(BENCH_CU_RESOLVE_OPTIONAL)
#undef BENCH_CU_RESOLVE_REQUIRED
#undef BENCH_CU_RESOLVE_OPTIONAL
  return "";
}

// Load the driver, open device `ordinal`, make its primary context current on
// this thread and read its free memory; "" on success, else why not. *broken:
// the failure came after the driver reported the device (a real error, not
// "no GPU here").
std::string OpenDevice(int ordinal, bool *broken) {
  *broken = false;
  std::string why = LoadDriver();
  if (!why.empty()) return why;
  CUresult r = CU(cuInit)(0);
  if (r != CUDA_SUCCESS) return "cuInit failed: " + CuErrorName(r) + " (no usable NVIDIA GPU)";
  int count = 0;
  r = CU(cuDeviceGetCount)(&count);
  if (r != CUDA_SUCCESS) return "cuDeviceGetCount failed: " + CuErrorName(r);
  if (count == 0) return "the driver reports no CUDA device";
  if (ordinal >= count)
    return "SGM_DEVICE=" + std::to_string(ordinal) + " but the driver reports " +
           std::to_string(count) + " device(s)";
  g_cu.ordinal = ordinal;
  *broken = true;
  if ((r = CU(cuDeviceGet)(&g_cu.dev, ordinal)) != CUDA_SUCCESS)
    return "cuDeviceGet failed: " + CuErrorName(r);
  if ((r = CU(cuDeviceGetName)(g_cu.name, sizeof g_cu.name, g_cu.dev)) != CUDA_SUCCESS)
    return "cuDeviceGetName failed: " + CuErrorName(r);
  if ((r = CU(cuDevicePrimaryCtxRetain)(&g_cu.ctx, g_cu.dev)) != CUDA_SUCCESS)
    return "cuDevicePrimaryCtxRetain failed: " + CuErrorName(r);
  if ((r = CU(cuCtxPushCurrent)(g_cu.ctx)) != CUDA_SUCCESS) {
    LogIfFailed(CU(cuDevicePrimaryCtxRelease)(g_cu.dev), "cuDevicePrimaryCtxRelease");
    g_cu.ctx = nullptr;
    return "cuCtxPushCurrent failed: " + CuErrorName(r);
  }
  if ((r = CU(cuMemGetInfo)(&g_cu.free_bytes, &g_cu.total_bytes)) != CUDA_SUCCESS)
    return "cuMemGetInfo failed: " + CuErrorName(r);
  // 256 threads a block (the kernel's fixed block size); as many blocks as the
  // SMs hold at once, so every SM streams. 1024 when the attributes are missing.
  int n_sm = 0, threads_per_sm = 0;
  g_cu.grid = 1024;
  if (CU(cuDeviceGetAttribute) &&
      CU(cuDeviceGetAttribute)(&n_sm, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, g_cu.dev) == CUDA_SUCCESS &&
      CU(cuDeviceGetAttribute)(&threads_per_sm, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
                               g_cu.dev) == CUDA_SUCCESS &&
      n_sm > 0 && threads_per_sm >= 256)
    g_cu.grid = static_cast<unsigned>(n_sm) * static_cast<unsigned>(threads_per_sm / 256);
  *broken = false;
  return "";
}

void CloseDevice() {
  if (!g_cu.ctx) return;
  CUcontext popped = nullptr;
  LogIfFailed(CU(cuCtxPopCurrent)(&popped), "cuCtxPopCurrent");
  LogIfFailed(CU(cuDevicePrimaryCtxRelease)(g_cu.dev), "cuDevicePrimaryCtxRelease");
  g_cu.ctx = nullptr;
}

// ---- owners of driver and sgm objects (freed on every exit path) ----

struct DeviceMem {
  CUdeviceptr p = 0;
  ~DeviceMem() {
    if (p) LogIfFailed(CU(cuMemFree)(p), "cuMemFree");
  }
};

// Pinned, device-mapped host memory: cuMemHostAlloc where the driver has it,
// else page-aligned memory registered as sgm's shared tier does.
struct PinnedMem {
  void *p = nullptr;
  bool registered = false;  // true: aligned_alloc + cuMemHostRegister
  static bool HasHostAlloc() { return CU(cuMemHostAlloc) && CU(cuMemFreeHost); }
  CUresult Alloc(size_t n) {
    if (HasHostAlloc())
      return CU(cuMemHostAlloc)(&p, n, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    void *h = std::aligned_alloc(4096, n);
    if (!h) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = CU(cuMemHostRegister)(h, n, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
    if (r != CUDA_SUCCESS) {
      std::free(h);
      return r;
    }
    p = h;
    registered = true;
    return CUDA_SUCCESS;
  }
  ~PinnedMem() {
    if (!p) return;
    if (!registered) {
      LogIfFailed(CU(cuMemFreeHost)(p), "cuMemFreeHost");
      return;
    }
    CUresult r = CU(cuMemHostUnregister)(p);
    LogIfFailed(r, "cuMemHostUnregister");
    if (r == CUDA_SUCCESS) std::free(p);  // else the driver may still use it: leak it
  }
};

struct Stream {
  CUstream s = nullptr;
  ~Stream() {
    if (s) LogIfFailed(CU(cuStreamDestroy)(s), "cuStreamDestroy");
  }
};

struct Event {
  CUevent e = nullptr;
  ~Event() {
    if (e) LogIfFailed(CU(cuEventDestroy)(e), "cuEventDestroy");
  }
};

struct Module {
  CUmodule m = nullptr;
  ~Module() {
    if (m) LogIfFailed(CU(cuModuleUnload)(m), "cuModuleUnload");
  }
};

struct SgmContext {
  sgm_context *c = nullptr;
  ~SgmContext() { sgm_context_destroy(c); }
};

struct SgmBuffer {
  sgm_buffer *b = nullptr;
  ~SgmBuffer() { sgm_buffer_destroy(b); }
};

struct SgmAlloc {
  sgm_context *c = nullptr;
  void *p = nullptr;
  ~SgmAlloc() {
    if (p && sgm_free_ex(c, p, nullptr) != SGM_OK) {
      std::fprintf(stderr, "bench_cuda: sgm_free failed: %s\n", sgm_last_error());
      g_failures++;
    }
  }
};

// An sgm context on the CUDA backend, device g_cu.ordinal; the rest from the
// environment. No idle trim: chunks stay committed between iterations, so the
// timed part is the copy, not the driver's allocator.
bool MakeSgmContext(benchmark::State &state, const std::string &key, sgm_config &cfg,
                    SgmContext &out) {
  cfg.backend = SGM_BACKEND_CUDA;
  cfg.device = g_cu.ordinal;
  cfg.allow_growth = 1;
  cfg.idle_trim_ms = 0;
  if (sgm_context_create(&cfg, &out.c) != SGM_OK) {
    Fail(state, key, std::string("sgm_context_create failed: ") + sgm_last_error());
    return false;
  }
  return true;
}

// The test pattern: word i of a buffer. Every word differs from its neighbours
// so a misplaced or missing block changes the sum.
inline uint32_t Pattern(uint64_t i) { return static_cast<uint32_t>(i) * 2654435761u + 0x9e3779b9u; }

// Fill `words` with the pattern; returns the sum of the words mod 2^32.
uint32_t FillPattern(std::vector<uint32_t> &words) {
  uint32_t sum = 0;
  for (size_t i = 0; i < words.size(); i++) sum += (words[i] = Pattern(i));
  return sum;
}

double Seconds(std::chrono::steady_clock::time_point t0, std::chrono::steady_clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

void RecordRun(benchmark::State &state, const std::string &key, size_t bytes, double seconds) {
  const double moved = static_cast<double>(bytes) * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(moved));
  state.counters["GB/s"] = seconds > 0 ? moved / seconds / 1e9 : 0;
  const double calls = static_cast<double>(state.iterations());
  if (calls > 0) state.counters["ms_per_call"] = seconds / calls * 1e3;
  Outcome &o = g_outcomes[key];
  if (!o.error.empty()) return;
  o.bytes = moved;
  o.seconds = seconds;
  o.calls = calls;
}

enum Dir { kHostToDevice, kDeviceToHost };

// ---- (a) copies through sgm ----

// One iteration = one timed move of the buffer in direction `dir` (promotion by
// sgm_buffer_acquire, or demotion by sgm_buffer_evict to the shared tier), and
// the untimed move back.
void BM_SgmCopy(benchmark::State &state, std::string key, Dir dir, size_t bytes) {
  sgm_config cfg;
  sgm_config_init(&cfg);
  SgmContext ctx;
  if (!MakeSgmContext(state, key, cfg, ctx)) return;
  SgmBuffer buf;
  if (sgm_buffer_create(ctx.c, bytes, &buf.b) != SGM_OK) {
    Fail(state, key, std::string("sgm_buffer_create failed: ") + sgm_last_error());
    return;
  }
  std::vector<uint32_t> host(bytes / 4);
  FillPattern(host);
  if (sgm_buffer_write(buf.b, 0, host.data(), bytes) != SGM_OK) {
    Fail(state, key, std::string("sgm_buffer_write failed: ") + sgm_last_error());
    return;
  }
  // Each step checks where the buffer ended up: a move that "succeeds" into the
  // wrong tier would make the figure meaningless.
  auto demote = [&]() -> bool {
    if (sgm_buffer_evict(buf.b, SGM_TIER_SHARED) != SGM_OK) {
      Fail(state, key, std::string("sgm_buffer_evict failed: ") + sgm_last_error());
      return false;
    }
    if (sgm_buffer_tier(buf.b) != SGM_TIER_SHARED) {
      Fail(state, key, std::string("after sgm_buffer_evict the buffer is in ") +
                           sgm_tier_name(sgm_buffer_tier(buf.b)) + ", not shared");
      return false;
    }
    return true;
  };
  auto promote = [&]() -> bool {
    void *d = nullptr;
    if (sgm_buffer_acquire(buf.b, nullptr, &d) != SGM_OK) {
      Fail(state, key, std::string("sgm_buffer_acquire failed: ") + sgm_last_error());
      return false;
    }
    const sgm_tier t = sgm_buffer_tier(buf.b);
    if (sgm_buffer_release(buf.b, nullptr) != SGM_OK) {
      Fail(state, key, std::string("sgm_buffer_release failed: ") + sgm_last_error());
      return false;
    }
    if (t != SGM_TIER_VRAM) {
      Fail(state, key, std::string("sgm_buffer_acquire left the buffer in ") + sgm_tier_name(t) +
                           ", not vram");
      return false;
    }
    return true;
  };
  if (sgm_buffer_tier(buf.b) != SGM_TIER_VRAM) {
    Fail(state, key, std::string("a new buffer was placed in ") +
                         sgm_tier_name(sgm_buffer_tier(buf.b)) + ", not vram");
    return;
  }
  // Warm-up: both tiers commit their chunks once, outside the timing.
  if (!demote() || !promote()) return;

  double timed = 0;
  for (auto _ : state) {
    bool ok;
    if (dir == kHostToDevice) {
      ok = demote();
      if (!ok) break;
      const auto t0 = std::chrono::steady_clock::now();
      void *d = nullptr;
      const sgm_status s = sgm_buffer_acquire(buf.b, nullptr, &d);
      const auto t1 = std::chrono::steady_clock::now();
      if (s != SGM_OK) {
        Fail(state, key, std::string("sgm_buffer_acquire failed: ") + sgm_last_error());
        break;
      }
      const sgm_tier t = sgm_buffer_tier(buf.b);
      if (sgm_buffer_release(buf.b, nullptr) != SGM_OK) {
        Fail(state, key, std::string("sgm_buffer_release failed: ") + sgm_last_error());
        break;
      }
      if (t != SGM_TIER_VRAM) {
        Fail(state, key, std::string("sgm_buffer_acquire left the buffer in ") + sgm_tier_name(t) +
                             ", not vram");
        break;
      }
      state.SetIterationTime(Seconds(t0, t1));
      timed += Seconds(t0, t1);
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      ok = demote();
      const auto t1 = std::chrono::steady_clock::now();
      if (!ok) break;
      state.SetIterationTime(Seconds(t0, t1));
      timed += Seconds(t0, t1);
      if (!promote()) break;
    }
  }
  if (!g_outcomes[key].error.empty()) return;
  // The data survived the round trips.
  std::vector<uint32_t> back(bytes / 4);
  if (sgm_buffer_read(buf.b, 0, back.data(), bytes) != SGM_OK) {
    Fail(state, key, std::string("sgm_buffer_read failed: ") + sgm_last_error());
    return;
  }
  if (std::memcmp(back.data(), host.data(), bytes) != 0) {
    Fail(state, key, "the buffer's contents changed across evict/acquire round trips");
    return;
  }
  sgm_stats st;
  if (sgm_get_stats(ctx.c, &st) == SGM_OK && state.iterations() > 0) {
    // Bytes sgm moved per iteration (timed and untimed directions): ~2 x size.
    const double moved = static_cast<double>(st.tier[SGM_TIER_VRAM].bytes_in + st.tier[SGM_TIER_VRAM].bytes_out);
    state.counters["moved_MiB_per_iter"] =
        moved / static_cast<double>(kMiB) / static_cast<double>(state.iterations() + 1);
  }
  RecordRun(state, key, bytes, timed);
}

// ---- (a) the reference: cuMemcpy between pinned host memory and cuMemAlloc ----

void BM_DirectCopy(benchmark::State &state, std::string key, Dir dir, size_t bytes) {
  PinnedMem host;
  if (!CuOk(state, key, host.Alloc(bytes), PinnedMem::HasHostAlloc() ? "cuMemHostAlloc" : "cuMemHostRegister"))
    return;
  std::memset(host.p, 0x5a, bytes);
  DeviceMem dev;
  if (!CuOk(state, key, CU(cuMemAlloc)(&dev.p, bytes), "cuMemAlloc")) return;
  Stream stream;
  if (!CuOk(state, key, CU(cuStreamCreate)(&stream.s, CU_STREAM_NON_BLOCKING), "cuStreamCreate"))
    return;
  auto copy = [&]() -> CUresult {
    CUresult r = dir == kHostToDevice ? CU(cuMemcpyHtoDAsync)(dev.p, host.p, bytes, stream.s)
                                      : CU(cuMemcpyDtoHAsync)(host.p, dev.p, bytes, stream.s);
    return r != CUDA_SUCCESS ? r : CU(cuStreamSynchronize)(stream.s);
  };
  const char *call = dir == kHostToDevice ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
  if (!CuOk(state, key, copy(), call)) return;  // warm-up: first-touch costs untimed
  double timed = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const CUresult r = copy();
    const auto t1 = std::chrono::steady_clock::now();
    if (!CuOk(state, key, r, call)) break;
    state.SetIterationTime(Seconds(t0, t1));
    timed += Seconds(t0, t1);
  }
  if (g_outcomes[key].error.empty()) RecordRun(state, key, bytes, timed);
}

// ---- (b) a kernel reading VRAM vs shared memory ----

// sgm_bench_sum, generated once with `nvcc -ptx -arch=compute_75 -O3` (CUDA
// 13.0) from the .cu below, comments dropped and the header lowered to PTX ISA
// 6.0 / sm_50 (the instructions are all older; checked with ptxas for sm_75 and
// sm_90) so that drivers from CUDA 9 on can JIT it. The build never runs nvcc.
//
//   extern "C" __global__ void __launch_bounds__(256)
//   sgm_bench_sum(const uint4 *p, unsigned long long n_vec, unsigned int *out) {
//     const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
//     unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
//     unsigned int acc = 0;
//     for (; i + 3 * stride < n_vec; i += 4 * stride) {  /* 4 independent loads in flight */
//       uint4 a = p[i], b = p[i + stride];
//       uint4 c = p[i + 2 * stride], d = p[i + 3 * stride];
//       acc += (a.x + a.y + a.z + a.w) + (b.x + b.y + b.z + b.w) +
//              (c.x + c.y + c.z + c.w) + (d.x + d.y + d.z + d.w);
//     }
//     for (; i < n_vec; i += stride) {
//       uint4 a = p[i];
//       acc += a.x + a.y + a.z + a.w;
//     }
//     for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
//     __shared__ unsigned int warp_sums[8];
//     if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
//     __syncthreads();
//     if (threadIdx.x == 0) {
//       unsigned int s = 0;
//       for (int w = 0; w < 8; w++) s += warp_sums[w];
//       out[blockIdx.x] = s;
//     }
//   }
//
// Plain ld.global (no __ldg / .nc): the shared tier is host memory, and the
// read-only path buys nothing for a single streaming pass.
constexpr const char kSumPtx[] = R"PTX(.version 6.0
.target sm_50
.address_size 64
.visible .entry sgm_bench_sum(
	.param .u64 sgm_bench_sum_param_0,
	.param .u64 sgm_bench_sum_param_1,
	.param .u64 sgm_bench_sum_param_2
)
.maxntid 256, 1, 1
{
	.reg .pred 	%p<12>;
	.reg .b32 	%r<114>;
	.reg .b64 	%rd<37>;
	.shared .align 4 .b8 _ZZ13sgm_bench_sumE9warp_sums[32];
	ld.param.u64 	%rd17, [sgm_bench_sum_param_0];
	ld.param.u64 	%rd15, [sgm_bench_sum_param_1];
	ld.param.u64 	%rd16, [sgm_bench_sum_param_2];
	cvta.to.global.u64 	%rd1, %rd17;
	mov.u32 	%r10, %nctaid.x;
	mov.u32 	%r11, %ntid.x;
	mul.wide.u32 	%rd2, %r10, %r11;
	mov.u32 	%r12, %ctaid.x;
	cvt.u64.u32 	%rd3, %r12;
	mul.wide.u32 	%rd18, %r12, %r11;
	mov.u32 	%r1, %tid.x;
	cvt.u64.u32 	%rd19, %r1;
	add.s64 	%rd35, %rd18, %rd19;
	mul.lo.s64 	%rd5, %rd2, 3;
	add.s64 	%rd20, %rd35, %rd5;
	setp.ge.u64 	%p1, %rd20, %rd15;
	mov.u32 	%r113, 0;
	@%p1 bra 	$L__BB0_3;
	shl.b64 	%rd21, %rd35, 4;
	add.s64 	%rd34, %rd1, %rd21;
	shl.b64 	%rd7, %rd2, 4;
	mov.u32 	%r113, 0;
$L__BB0_2:
	ld.global.v4.u32 	{%r16, %r17, %r18, %r19}, [%rd34];
	add.s64 	%rd23, %rd34, %rd7;
	ld.global.v4.u32 	{%r24, %r25, %r26, %r27}, [%rd23];
	add.s64 	%rd24, %rd23, %rd7;
	ld.global.v4.u32 	{%r32, %r33, %r34, %r35}, [%rd24];
	add.s64 	%rd25, %rd24, %rd7;
	add.s64 	%rd34, %rd25, %rd7;
	ld.global.v4.u32 	{%r40, %r41, %r42, %r43}, [%rd25];
	add.s32 	%r48, %r17, %r113;
	add.s32 	%r49, %r48, %r16;
	add.s32 	%r50, %r49, %r18;
	add.s32 	%r51, %r50, %r19;
	add.s32 	%r52, %r51, %r25;
	add.s32 	%r53, %r52, %r24;
	add.s32 	%r54, %r53, %r26;
	add.s32 	%r55, %r54, %r27;
	add.s32 	%r56, %r55, %r33;
	add.s32 	%r57, %r56, %r32;
	add.s32 	%r58, %r57, %r34;
	add.s32 	%r59, %r58, %r35;
	add.s32 	%r60, %r59, %r41;
	add.s32 	%r61, %r60, %r40;
	add.s32 	%r62, %r61, %r42;
	add.s32 	%r113, %r62, %r43;
	shl.b64 	%rd26, %rd2, 2;
	add.s64 	%rd35, %rd26, %rd35;
	add.s64 	%rd27, %rd35, %rd5;
	setp.lt.u64 	%p2, %rd27, %rd15;
	@%p2 bra 	$L__BB0_2;
$L__BB0_3:
	setp.ge.u64 	%p3, %rd35, %rd15;
	@%p3 bra 	$L__BB0_5;
$L__BB0_4:
	shl.b64 	%rd28, %rd35, 4;
	add.s64 	%rd29, %rd1, %rd28;
	ld.global.v4.u32 	{%r63, %r64, %r65, %r66}, [%rd29];
	add.s32 	%r71, %r64, %r113;
	add.s32 	%r72, %r71, %r63;
	add.s32 	%r73, %r72, %r65;
	add.s32 	%r113, %r73, %r66;
	add.s64 	%rd35, %rd35, %rd2;
	setp.lt.u64 	%p4, %rd35, %rd15;
	@%p4 bra 	$L__BB0_4;
$L__BB0_5:
	mov.u32 	%r74, 2;
	mov.u32 	%r75, 31;
	mov.u32 	%r76, 16;
	mov.u32 	%r77, -1;
	shfl.sync.down.b32 	%r78|%p5, %r113, %r76, %r75, %r77;
	add.s32 	%r79, %r78, %r113;
	mov.u32 	%r80, 8;
	shfl.sync.down.b32 	%r81|%p6, %r79, %r80, %r75, %r77;
	add.s32 	%r82, %r81, %r79;
	mov.u32 	%r83, 4;
	shfl.sync.down.b32 	%r84|%p7, %r82, %r83, %r75, %r77;
	add.s32 	%r85, %r84, %r82;
	shfl.sync.down.b32 	%r86|%p8, %r85, %r74, %r75, %r77;
	add.s32 	%r87, %r86, %r85;
	mov.u32 	%r88, 1;
	shfl.sync.down.b32 	%r89|%p9, %r87, %r88, %r75, %r77;
	add.s32 	%r8, %r89, %r87;
	and.b32  	%r90, %r1, 31;
	setp.ne.s32 	%p10, %r90, 0;
	@%p10 bra 	$L__BB0_7;
	shr.u32 	%r91, %r1, 3;
	and.b32  	%r92, %r91, 536870908;
	mov.u32 	%r93, _ZZ13sgm_bench_sumE9warp_sums;
	add.s32 	%r94, %r93, %r92;
	st.shared.u32 	[%r94], %r8;
$L__BB0_7:
	bar.sync 	0;
	setp.ne.s32 	%p11, %r1, 0;
	@%p11 bra 	$L__BB0_9;
	ld.shared.u32 	%r95, [_ZZ13sgm_bench_sumE9warp_sums];
	ld.shared.u32 	%r96, [_ZZ13sgm_bench_sumE9warp_sums+4];
	add.s32 	%r97, %r96, %r95;
	ld.shared.u32 	%r98, [_ZZ13sgm_bench_sumE9warp_sums+8];
	add.s32 	%r99, %r98, %r97;
	ld.shared.u32 	%r100, [_ZZ13sgm_bench_sumE9warp_sums+12];
	add.s32 	%r101, %r100, %r99;
	ld.shared.u32 	%r102, [_ZZ13sgm_bench_sumE9warp_sums+16];
	add.s32 	%r103, %r102, %r101;
	ld.shared.u32 	%r104, [_ZZ13sgm_bench_sumE9warp_sums+20];
	add.s32 	%r105, %r104, %r103;
	ld.shared.u32 	%r106, [_ZZ13sgm_bench_sumE9warp_sums+24];
	add.s32 	%r107, %r106, %r105;
	ld.shared.u32 	%r108, [_ZZ13sgm_bench_sumE9warp_sums+28];
	add.s32 	%r109, %r108, %r107;
	cvta.to.global.u64 	%rd30, %rd16;
	shl.b64 	%rd31, %rd3, 2;
	add.s64 	%rd32, %rd30, %rd31;
	st.global.u32 	[%rd32], %r109;
$L__BB0_9:
	ret;
}
)PTX";
constexpr unsigned kSumBlock = 256;  // the kernel's block size (__launch_bounds__, 8 warp sums)

// Why the kernel benchmarks cannot run on this driver; "" when they can.
std::string KernelUnavailable() {
  const char *missing = !CU(cuModuleLoadData)      ? "cuModuleLoadData"
                        : !CU(cuModuleGetFunction) ? "cuModuleGetFunction"
                        : !CU(cuModuleUnload)      ? "cuModuleUnload"
                        : !CU(cuLaunchKernel)      ? "cuLaunchKernel"
                        : !CU(cuEventCreate)       ? "cuEventCreate"
                        : !CU(cuEventRecord)       ? "cuEventRecord"
                        : !CU(cuEventSynchronize)  ? "cuEventSynchronize"
                        : !CU(cuEventElapsedTime)  ? "cuEventElapsedTime"
                        : !CU(cuEventDestroy)      ? "cuEventDestroy"
                                                   : nullptr;
  return missing ? std::string("the driver has no ") + missing : std::string();
}

enum Where { kVram, kShared };

// One iteration = one launch of the sum kernel over `bytes` of an sgm_alloc
// pointer, timed with events on the stream. The pointer is in VRAM (kVram), or
// in the shared tier (kShared): the context's VRAM limit is 1.5 x bytes, a first
// allocation of `bytes` fills VRAM, and the second one falls back.
void BM_KernelRead(benchmark::State &state, std::string key, Where where, size_t bytes) {
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.vram_limit.bytes = bytes + bytes / 2;
  cfg.vram_limit.fraction = 0;
  cfg.shared_fallback = 1;
  SgmContext ctx;
  if (!MakeSgmContext(state, key, cfg, ctx)) return;
  SgmAlloc first{ctx.c, sgm_alloc(ctx.c, bytes, nullptr)};
  if (!first.p) {
    Fail(state, key, std::string("sgm_alloc failed: ") + sgm_last_error());
    return;
  }
  SgmAlloc second{ctx.c, nullptr};
  if (where == kShared) {
    second.p = sgm_alloc(ctx.c, bytes, nullptr);
    if (!second.p) {
      Fail(state, key, std::string("sgm_alloc (the fallback) failed: ") + sgm_last_error());
      return;
    }
  }
  void *target = where == kVram ? first.p : second.p;
  const sgm_tier want = where == kVram ? SGM_TIER_VRAM : SGM_TIER_SHARED;
  const sgm_tier got = sgm_pointer_tier(ctx.c, target);
  if (got != want) {
    Fail(state, key, std::string("the allocation is in ") + sgm_tier_name(got) + ", not " +
                         sgm_tier_name(want));
    return;
  }
  const CUdeviceptr dptr = reinterpret_cast<uintptr_t>(target);

  Stream stream;
  if (!CuOk(state, key, CU(cuStreamCreate)(&stream.s, CU_STREAM_NON_BLOCKING), "cuStreamCreate"))
    return;
  // The pattern goes in through the device pointer in both cases: for the
  // shared tier it is host memory mapped for the device, a valid copy target.
  std::vector<uint32_t> words(bytes / 4);
  const uint32_t expect = FillPattern(words);
  if (!CuOk(state, key, CU(cuMemcpyHtoDAsync)(dptr, words.data(), bytes, stream.s), "cuMemcpyHtoDAsync") ||
      !CuOk(state, key, CU(cuStreamSynchronize)(stream.s), "cuStreamSynchronize"))
    return;

  Module mod;
  CUfunction fn = nullptr;
  if (!CuOk(state, key, CU(cuModuleLoadData)(&mod.m, kSumPtx), "cuModuleLoadData (JIT of the PTX)") ||
      !CuOk(state, key, CU(cuModuleGetFunction)(&fn, mod.m, "sgm_bench_sum"), "cuModuleGetFunction"))
    return;
  DeviceMem partial;
  const unsigned grid = g_cu.grid;
  if (!CuOk(state, key, CU(cuMemAlloc)(&partial.p, grid * sizeof(uint32_t)), "cuMemAlloc"))
    return;
  Event start, stop;
  if (!CuOk(state, key, CU(cuEventCreate)(&start.e, CU_EVENT_DEFAULT), "cuEventCreate") ||
      !CuOk(state, key, CU(cuEventCreate)(&stop.e, CU_EVENT_DEFAULT), "cuEventCreate"))
    return;

  CUdeviceptr p_arg = dptr, out_arg = partial.p;
  unsigned long long n_vec = bytes / 16;
  void *args[] = {&p_arg, &n_vec, &out_arg};
  auto launch = [&]() -> CUresult {
    return CU(cuLaunchKernel)(fn, grid, 1, 1, kSumBlock, 1, 1, 0, stream.s, args, nullptr);
  };
  // The kernel's answer against the pattern's sum (mod 2^32).
  auto check = [&]() -> bool {
    std::vector<uint32_t> sums(grid);
    if (!CuOk(state, key, CU(cuMemcpyDtoHAsync)(sums.data(), partial.p, grid * sizeof(uint32_t), stream.s),
              "cuMemcpyDtoHAsync") ||
        !CuOk(state, key, CU(cuStreamSynchronize)(stream.s), "cuStreamSynchronize"))
      return false;
    uint32_t got_sum = 0;
    for (uint32_t s : sums) got_sum += s;
    if (got_sum != expect) {
      char msg[160];
      std::snprintf(msg, sizeof msg, "the kernel's sum 0x%08x differs from the sum written 0x%08x",
                    got_sum, expect);
      Fail(state, key, msg);
      return false;
    }
    return true;
  };
  // Warm-up (JIT, first touch of the mapping) and a first check, untimed.
  if (!CuOk(state, key, launch(), "cuLaunchKernel") ||
      !CuOk(state, key, CU(cuStreamSynchronize)(stream.s), "cuStreamSynchronize") || !check())
    return;

  double timed = 0;
  for (auto _ : state) {
    float ms = 0;
    if (!CuOk(state, key, CU(cuEventRecord)(start.e, stream.s), "cuEventRecord") ||
        !CuOk(state, key, launch(), "cuLaunchKernel") ||
        !CuOk(state, key, CU(cuEventRecord)(stop.e, stream.s), "cuEventRecord") ||
        !CuOk(state, key, CU(cuEventSynchronize)(stop.e), "cuEventSynchronize") ||
        !CuOk(state, key, CU(cuEventElapsedTime)(&ms, start.e, stop.e), "cuEventElapsedTime"))
      break;
    state.SetIterationTime(ms / 1e3);
    timed += ms / 1e3;
  }
  if (!g_outcomes[key].error.empty() || !check()) return;
  sgm_stats st;
  if (sgm_get_stats(ctx.c, &st) == SGM_OK) state.counters["fallbacks"] = static_cast<double>(st.n_fallbacks);
  RecordRun(state, key, bytes, timed);
}

// ---- (c) per call: the stream-ordered allocation path ----

// The driver double's counter (fake_cuda_get_stats, first field: all calls),
// found in the libcuda.so.1 already loaded; UINT64_MAX on a real driver.
uint64_t DriverCalls() {
  struct FakeStats {
    uint64_t calls;
    uint64_t rest[32];
  };
  using GetStatsFn = void (*)(FakeStats *);
  static GetStatsFn get = [] {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return lib ? reinterpret_cast<GetStatsFn>(dlsym(lib, "fake_cuda_get_stats")) : nullptr;
  }();
  if (!get) return UINT64_MAX;
  FakeStats st{};
  get(&st);
  return st.calls;
}

// The driver calls sgm's backend made for ctx so far (sgm_stats.driver_calls:
// counted by sgm itself, so on a real driver too).
uint64_t SgmDriverCalls(sgm_context *ctx) {
  sgm_stats st;
  return sgm_get_stats(ctx, &st) == SGM_OK ? st.driver_calls : UINT64_MAX;
}

// ctx: the context whose calls are counted (sgm's own count, from
// calls_before = SgmDriverCalls(ctx)); nullptr: the driver's calls, counted on
// the driver double only (calls_before = DriverCalls()).
void RecordCalls(benchmark::State &state, const std::string &key, double seconds,
                 uint64_t calls_before, sgm_context *ctx = nullptr) {
  const double n = static_cast<double>(state.iterations());
  Outcome &o = g_outcomes[key];
  if (!o.error.empty() || n <= 0) return;
  o.seconds = seconds;
  o.calls = n;
  const uint64_t after = ctx ? SgmDriverCalls(ctx) : DriverCalls();
  if (after != UINT64_MAX && calls_before != UINT64_MAX)
    o.driver_calls = static_cast<double>(after - calls_before) / n;
  state.counters["ns_per_call"] = seconds / n * 1e9;
  state.counters["driver_calls_per_call"] = o.driver_calls;
}

// A context whose VRAM budget is `limit_bytes` (0: the default), reserved at
// create, with no fallback: every figure is of the VRAM pool's own path.
bool MakePoolContext(benchmark::State &state, const std::string &key, uint64_t limit_bytes,
                     SgmContext &out) {
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = SGM_BACKEND_CUDA;
  cfg.device = g_cu.ordinal;
  cfg.idle_trim_ms = 0;
  cfg.shared_fallback = 0;
  if (limit_bytes) {
    cfg.vram_limit.bytes = limit_bytes;
    cfg.allow_growth = 0;
  }
  if (sgm_context_create(&cfg, &out.c) != SGM_OK) {
    Fail(state, key, std::string("sgm_context_create failed: ") + sgm_last_error());
    return false;
  }
  return true;
}

enum PairStream { kNullStream, kPerThreadStream, kCreatedStream };

// One iteration = sgm_alloc + sgm_free of 1 MiB on one stream (the block comes
// back from the stream's cache every time).
void BM_SgmPair(benchmark::State &state, std::string key, PairStream which) {
  Stream created;
  if (which == kCreatedStream &&
      !CuOk(state, key, CU(cuStreamCreate)(&created.s, CU_STREAM_DEFAULT), "cuStreamCreate"))
    return;
  void *stream = which == kNullStream        ? nullptr
                 : which == kPerThreadStream ? reinterpret_cast<void *>(CU_STREAM_PER_THREAD)
                                             : reinterpret_cast<void *>(created.s);
  SgmContext ctx;
  if (!MakePoolContext(state, key, 0, ctx)) return;
  void *warm = sgm_alloc(ctx.c, kMiB, stream);
  if (!warm) {
    Fail(state, key, std::string("sgm_alloc failed: ") + sgm_last_error());
    return;
  }
  sgm_free(ctx.c, warm, stream);
  const uint64_t before = SgmDriverCalls(ctx.c);
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    void *p = sgm_alloc(ctx.c, kMiB, stream);
    benchmark::DoNotOptimize(p);
    sgm_free(ctx.c, p, stream);
  }
  const auto t1 = std::chrono::steady_clock::now();
  RecordCalls(state, key, Seconds(t0, t1), before, ctx.c);
  // The created stream goes after the context: sgm_context_destroy waits for
  // the work of every stream it cached blocks for.
  sgm_context_destroy(ctx.c);
  ctx.c = nullptr;
}

// The reference: the driver's own allocator, one cuMemAlloc + cuMemFree.
void BM_DriverPair(benchmark::State &state, std::string key) {
  const uint64_t before = DriverCalls();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    CUdeviceptr p = 0;
    if (!CuOk(state, key, CU(cuMemAlloc)(&p, kMiB), "cuMemAlloc")) break;
    if (!CuOk(state, key, CU(cuMemFree)(p), "cuMemFree")) break;
  }
  const auto t1 = std::chrono::steady_clock::now();
  RecordCalls(state, key, Seconds(t0, t1), before);
}

// The sizes of a burst round (pair 3): 2 MiB (exact), 1 MiB, 768 KiB; 3.75
// of the 4 MiB budget, so that a round takes the other stream's whole cache.
constexpr size_t kBurstSizes[3] = {2 * kMiB, kMiB, 768 * 1024};

// One burst round on stream s: the three sizes allocated, then freed.
bool BurstRound(benchmark::State &state, const std::string &key, sgm_context *ctx, void *s) {
  void *p[3];
  for (int i = 0; i < 3; i++)
    if (!(p[i] = sgm_alloc(ctx, kBurstSizes[i], s))) {
      Fail(state, key, std::string("sgm_alloc failed: ") + sgm_last_error());
      return false;
    }
  for (void *q : p) sgm_free(ctx, q, s);
  return true;
}

// One iteration = one allocation that takes the only block from the other
// stream's cache (ordered on the device), and its free. pair: 0 = a created
// stream and the NULL stream, 1 = two created streams, 2 = two non-blocking
// streams (PyTorch's side streams: the 4-call case, docs/streams.md); 3 = a
// burst round on two non-blocking streams in turn: one takes blocks of three
// sizes from the other's cache and frees them (docs/streams.md "Why two
// calls" item 6: 4 calls per round once each stream has had a round).
void BM_Transfer(benchmark::State &state, std::string key, int pair) {
  Stream a, b;
  const unsigned flags = pair >= 2 ? CU_STREAM_NON_BLOCKING : CU_STREAM_DEFAULT;
  if (!CuOk(state, key, CU(cuStreamCreate)(&a.s, flags), "cuStreamCreate")) return;
  if (pair && !CuOk(state, key, CU(cuStreamCreate)(&b.s, flags), "cuStreamCreate")) return;
  SgmContext ctx;
  if (!MakePoolContext(state, key, 4 * kMiB, ctx)) return;
  void *streams[2] = {a.s, b.s};
  uint64_t k = 0;
  if (pair == 3) {
    // Warm: two rounds each, so each stream has taken the three sizes once.
    for (int r = 0; r < 4; r++)
      if (!BurstRound(state, key, ctx.c, streams[k++ & 1])) return;
  }
  for (void *s : pair == 3 ? std::vector<void *>{} : std::vector<void *>{a.s, b.s}) {
    // warm: the event pool, each stream's flags
    void *p = sgm_alloc(ctx.c, 4 * kMiB, s);
    if (!p) {
      Fail(state, key, std::string("sgm_alloc failed: ") + sgm_last_error());
      return;
    }
    sgm_free(ctx.c, p, s);
  }
  const uint64_t before = SgmDriverCalls(ctx.c);
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    void *s = streams[k++ & 1];
    if (pair == 3) {
      if (!BurstRound(state, key, ctx.c, s)) break;
      continue;
    }
    void *p = sgm_alloc(ctx.c, 4 * kMiB, s);
    if (!p) {
      Fail(state, key, std::string("sgm_alloc failed: ") + sgm_last_error());
      break;
    }
    sgm_free(ctx.c, p, s);
  }
  const auto t1 = std::chrono::steady_clock::now();
  RecordCalls(state, key, Seconds(t0, t1), before, ctx.c);
  sgm_context_destroy(ctx.c);
  ctx.c = nullptr;
}

// "123.4 ns per call, 0 driver calls" for a (c) figure.
std::string PerCall(const std::string &key) {
  auto it = g_outcomes.find(key);
  if (it == g_outcomes.end()) return "not run";
  if (!it->second.error.empty()) return "error (" + it->second.error + ")";
  if (it->second.calls <= 0) return "not run";
  char s[96];
  if (it->second.driver_calls >= 0)
    std::snprintf(s, sizeof s, "%.1f ns per call, %.2f driver calls per call",
                  it->second.seconds / it->second.calls * 1e9, it->second.driver_calls);
  else
    std::snprintf(s, sizeof s, "%.1f ns per call, driver calls n/a",
                  it->second.seconds / it->second.calls * 1e9);
  return s;
}

// ---- registration and the summary ----

// Scale a wanted size to what the card and the machine can give: at most
// `cap`, in whole MiB; 0 when not even 1 MiB fits.
size_t Scaled(size_t want, size_t cap) { return std::min(want, cap) / kMiB * kMiB; }

// Fixed iteration counts (no estimation rounds, which would redo the setup):
// about `total` bytes per benchmark, within [lo, hi] iterations.
int64_t Iters(size_t bytes, size_t total, int64_t lo, int64_t hi) {
  return std::clamp<int64_t>(static_cast<int64_t>(total / bytes), lo, hi);
}

std::string GBps(const std::string &key) {
  auto it = g_outcomes.find(key);
  if (it == g_outcomes.end()) return "not run";
  if (!it->second.error.empty()) return "error (" + it->second.error + ")";
  if (it->second.seconds <= 0) return "not run";
  char s[64];
  std::snprintf(s, sizeof s, "%.2f GB/s (%.3f ms per call)", it->second.bytes / it->second.seconds / 1e9,
                it->second.calls > 0 ? it->second.seconds / it->second.calls * 1e3 : 0.0);
  return s;
}

std::string Ratio(const std::string &num, const std::string &den, const char *fmt) {
  auto a = g_outcomes.find(num), b = g_outcomes.find(den);
  if (a == g_outcomes.end() || b == g_outcomes.end() || !a->second.error.empty() ||
      !b->second.error.empty() || a->second.seconds <= 0 || b->second.seconds <= 0)
    return "n/a";
  const double ra = a->second.bytes / a->second.seconds, rb = b->second.bytes / b->second.seconds;
  char s[32];
  std::snprintf(s, sizeof s, fmt, ra / rb);
  return s;
}

}  // namespace

const CudaSetup &CudaOpen() {
  static CudaSetup s;
  static bool done = false;
  if (done) return s;
  done = true;
  sgm_config cfg;
  sgm_config_init(&cfg);
  if (cfg.error[0]) {
    s.broken = true;
    s.why = cfg.error;
    return s;
  }
  s.why = OpenDevice(cfg.device, &s.broken);
  if (!s.why.empty()) {
    CloseDevice();
    return s;
  }
  // One benchmark holds at most one buffer of a size on the device at a time
  // (sgm's contexts give everything back when destroyed); keep 256 MiB for the
  // driver, other processes and the partial sums, and as much again in reserve.
  const size_t headroom = 256 * kMiB;
  size_t cap = g_cu.free_bytes > headroom ? (g_cu.free_bytes - headroom) / 2 : 0;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) cap = std::min(cap, static_cast<size_t>(pages) * static_cast<size_t>(page) / 8);
  if (const char *m = std::getenv("BENCH_CUDA_MAX_MIB")) {
    const long long mib = std::atoll(m);
    if (mib > 0) cap = std::min(cap, static_cast<size_t>(mib) * kMiB);
  }
  s.cap_bytes = cap;
  for (size_t want : {64 * kMiB, 256 * kMiB}) {
    const size_t b = Scaled(want, cap);
    if (b && std::find(s.copy_sizes.begin(), s.copy_sizes.end(), b) == s.copy_sizes.end())
      s.copy_sizes.push_back(b);
  }
  s.kernel_bytes = Scaled(256 * kMiB, cap);
  if (s.copy_sizes.empty() || !s.kernel_bytes) {
    s.why = "too little free memory (" + std::to_string(g_cu.free_bytes / kMiB) + " MiB free on the device)";
    s.copy_sizes.clear();
    CloseDevice();
    return s;
  }
  if (!PinnedMem::HasHostAlloc()) g_pinned_kind = "cuMemHostRegister (the driver has no cuMemHostAlloc)";
  s.kernel_off = KernelUnavailable();
  s.usable = true;
  s.device = g_cu.name;
  s.driver_version = g_cu.driver_version;
  char b[512];
  std::snprintf(b, sizeof b,
                "device %d: %s, %zu MiB free of %zu MiB, driver API %d.%d, sizes capped at %zu MiB, "
                "pinned reference memory from %s",
                g_cu.ordinal, g_cu.name, g_cu.free_bytes / kMiB, g_cu.total_bytes / kMiB,
                g_cu.driver_version / 1000, g_cu.driver_version % 1000 / 10, cap / kMiB, g_pinned_kind.c_str());
  s.description = b;
  return s;
}

void CudaClose() { CloseDevice(); }
int CudaFailures() { return g_failures; }
int64_t CudaIters(size_t bytes, size_t total, int64_t lo, int64_t hi) { return Iters(bytes, total, lo, hi); }

void BM_CudaSgmCopy(benchmark::State &state, std::string key, bool h2d, size_t bytes) {
  BM_SgmCopy(state, std::move(key), h2d ? kHostToDevice : kDeviceToHost, bytes);
}
void BM_CudaDirectCopy(benchmark::State &state, std::string key, bool h2d, size_t bytes) {
  BM_DirectCopy(state, std::move(key), h2d ? kHostToDevice : kDeviceToHost, bytes);
}
void BM_CudaKernelRead(benchmark::State &state, std::string key, bool shared, size_t bytes) {
  BM_KernelRead(state, std::move(key), shared ? kShared : kVram, bytes);
}
void BM_CudaSgmPair(benchmark::State &state, std::string key, CudaPairStream which) {
  BM_SgmPair(state, std::move(key),
             which == kCudaNullStream ? kNullStream : which == kCudaPerThreadStream ? kPerThreadStream : kCreatedStream);
}
void BM_CudaDriverPair(benchmark::State &state, std::string key) { BM_DriverPair(state, std::move(key)); }
void BM_CudaTransfer(benchmark::State &state, std::string key, int pair) {
  BM_Transfer(state, std::move(key), pair);
}
std::string CudaGBps(const std::string &key) { return GBps(key); }
std::string CudaRatio(const std::string &num, const std::string &den, const char *fmt) { return Ratio(num, den, fmt); }
std::string CudaPerCall(const std::string &key) { return PerCall(key); }

void *CudaStreamNew(std::string *why) {
  const CudaSetup &d = CudaOpen();
  if (!d.usable) {
    *why = d.why;
    return nullptr;
  }
  CUstream s = nullptr;
  CUresult r = CU(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) {
    *why = "cuStreamCreate failed: " + CuErrorName(r);
    return nullptr;
  }
  return reinterpret_cast<void *>(s);
}

void CudaStreamDelete(void *s) {
  if (s) LogIfFailed(CU(cuStreamDestroy)(reinterpret_cast<CUstream>(s)), "cuStreamDestroy");
}

bool CudaFenceMode(int lazy) {
  using SetIntFn = void (*)(int);
  using SetU64Fn = void (*)(uint64_t);
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  auto set_lazy = lib ? reinterpret_cast<SetIntFn>(dlsym(lib, "fake_cuda_set_lazy")) : nullptr;
  auto set_delay = lib ? reinterpret_cast<SetU64Fn>(dlsym(lib, "fake_cuda_set_delay_us")) : nullptr;
  if (!set_lazy || !set_delay) return false;
  set_delay(0);
  set_lazy(lazy);
  return true;
}

}  // namespace sgm_bench

#else  // no usable cuda.h: every entry point says so

namespace sgm_bench {

namespace {

const char *NoHeaders() {
#if !defined(BENCH_CUDA_HEADERS)
  return "built without CUDA headers";
#else
  return "built with CUDA headers older than 12.0 (as sgm's backend needs)";
#endif
}

void Off(benchmark::State &state) { state.SkipWithError(NoHeaders()); }

}  // namespace

const CudaSetup &CudaOpen() {
  static CudaSetup s;
  s.why = NoHeaders();
  return s;
}
void CudaClose() {}
int CudaFailures() { return 0; }
int64_t CudaIters(size_t, size_t, int64_t lo, int64_t) { return lo; }
void BM_CudaSgmCopy(benchmark::State &state, std::string, bool, size_t) { Off(state); }
void BM_CudaDirectCopy(benchmark::State &state, std::string, bool, size_t) { Off(state); }
void BM_CudaKernelRead(benchmark::State &state, std::string, bool, size_t) { Off(state); }
void BM_CudaSgmPair(benchmark::State &state, std::string, CudaPairStream) { Off(state); }
void BM_CudaDriverPair(benchmark::State &state, std::string) { Off(state); }
void BM_CudaTransfer(benchmark::State &state, std::string, int) { Off(state); }
void *CudaStreamNew(std::string *why) {
  *why = CudaOpen().why;
  return nullptr;
}
void CudaStreamDelete(void *) {}
bool CudaFenceMode(int) { return false; }
std::string CudaGBps(const std::string &) { return "not run"; }
std::string CudaRatio(const std::string &, const std::string &, const char *) { return "n/a"; }
std::string CudaPerCall(const std::string &) { return "not run"; }

}  // namespace sgm_bench

#endif  // BENCH_CUDA_HEADERS
