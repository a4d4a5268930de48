// bench_stream.cc — the stream-ordered allocation path on the CUDA backend
// (issue 10's measured targets): driver calls and time per steady-state
// sgm_alloc+sgm_free pair on a created stream, the legacy NULL stream and a
// per-thread default stream; calls per cross-stream transfer, and per round
// of two streams with their own sizes or a burst of sizes; and the pair
// with 10,000 frees pending on another stream against none.
//
// Run it against the driver test double to count calls (the double's
// fake_cuda_get_stats is looked up with dlsym; its events are held, so every
// stream stays busy and nothing completes behind the benchmark's back):
//   LD_LIBRARY_PATH=build/release/tests/support/fake_cuda build/release/benchmarks/bench_stream
// On a real GPU the same binary reports times only (calls_per_pair is -1).
// Without a CUDA backend (no driver, no headers) it prints one "skipping" line
// and exits 0.
#include <benchmark/benchmark.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sgm.h"

namespace {

// The double's counters, as its header fake_cuda.h lays them out (only the
// leading field is read).
struct FakeStats {
  uint64_t calls;
  uint64_t rest[32];
};
using GetStatsFn = void (*)(FakeStats *);
using HoldEventsFn = void (*)(int);
using CompleteEventsFn = void (*)();
using StreamCreateFn = void *(*)();
using CallsOfFn = uint64_t (*)(const char *);

struct Driver {
  GetStatsFn get_stats = nullptr;       // the double's counters; null on a real driver
  HoldEventsFn hold_events = nullptr;   // keep every recorded event pending
  CompleteEventsFn complete_events = nullptr;  // release the held ones (before destroy waits)
  StreamCreateFn stream_create = nullptr;
  CallsOfFn calls_of = nullptr;         // the double's per-entry-point counter
};

Driver &Drv() {
  static Driver d = [] {
    Driver x;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      x.get_stats = reinterpret_cast<GetStatsFn>(dlsym(lib, "fake_cuda_get_stats"));
      x.hold_events = reinterpret_cast<HoldEventsFn>(dlsym(lib, "fake_cuda_hold_events"));
      x.complete_events = reinterpret_cast<CompleteEventsFn>(dlsym(lib, "fake_cuda_complete_events"));
      x.stream_create = reinterpret_cast<StreamCreateFn>(dlsym(lib, "fake_cuda_stream_create"));
      x.calls_of = reinterpret_cast<CallsOfFn>(dlsym(lib, "fake_cuda_calls"));
    }
    return x;
  }();
  return d;
}

uint64_t Calls() {
  if (!Drv().get_stats) return 0;
  FakeStats s{};
  Drv().get_stats(&s);
  return s.calls;
}

sgm_context *MakeContext(const char *vram_limit, bool growth) {
  setenv("SGM_BACKEND", "cuda", 1);
  setenv("SGM_VRAM_LIMIT", vram_limit, 1);
  setenv("SGM_ALLOW_GROWTH", growth ? "on" : "off", 1);
  setenv("SGM_SHARED_FALLBACK", "off", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);
  sgm_context *ctx = nullptr;
  if (sgm_context_create(nullptr, &ctx) != SGM_OK) return nullptr;
  return ctx;
}

// A stream for the benchmark: the double's own, or a real one made through
// the driver (cuStreamCreate via cuGetProcAddress is not worth the code here:
// on a real GPU the NULL and per-thread cases stand for it).
void *MakeStream() { return Drv().stream_create ? Drv().stream_create() : nullptr; }

// A CU_STREAM_NON_BLOCKING stream of device 0's primary context, made through
// the double's driver entry points (as PyTorch makes its side streams);
// nullptr on a real driver or when any call fails.
void *MakeNonBlockingStream() {
  if (!Drv().get_stats) return nullptr;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return nullptr;
  using CreateFn = int (*)(void **, unsigned);
  using RetainFn = int (*)(void **, int);
  using PushFn = int (*)(void *);
  using PopFn = int (*)(void **);
  using ReleaseFn = int (*)(int);
  auto create = reinterpret_cast<CreateFn>(dlsym(lib, "cuStreamCreate"));
  auto retain = reinterpret_cast<RetainFn>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
  auto push = reinterpret_cast<PushFn>(dlsym(lib, "cuCtxPushCurrent_v2"));
  auto pop = reinterpret_cast<PopFn>(dlsym(lib, "cuCtxPopCurrent_v2"));
  auto release = reinterpret_cast<ReleaseFn>(dlsym(lib, "cuDevicePrimaryCtxRelease_v2"));
  void *s = nullptr, *pctx = nullptr, *popped = nullptr;
  if (create && retain && push && pop && release && retain(&pctx, 0) == 0) {
    if (push(pctx) == 0) {
      if (create(&s, 1 /* CU_STREAM_NON_BLOCKING */) != 0) s = nullptr;
      pop(&popped);
    }
    release(0);
  }
  dlclose(lib);  // the benchmark's own handle; the library stays loaded by sgm
  return s;
}

void ReportCalls(benchmark::State &state, uint64_t calls, double units) {
  state.counters["calls_per_pair"] =
      Drv().get_stats ? static_cast<double>(calls) / units : -1.0;
}

// Steady-state pairs on one stream: the block comes back from the stream's
// cache every time.
void PairsOn(benchmark::State &state, void *stream) {
  sgm_context *ctx = MakeContext("256MiB", true);
  if (!ctx) {
    state.SkipWithError(sgm_last_error());
    return;
  }
  if (Drv().hold_events) Drv().hold_events(1);
  void *warm = sgm_alloc(ctx, 1 << 20, stream);
  sgm_free(ctx, warm, stream);
  uint64_t before = Calls();
  for (auto _ : state) {
    void *p = sgm_alloc(ctx, 1 << 20, stream);
    benchmark::DoNotOptimize(p);
    sgm_free(ctx, p, stream);
  }
  ReportCalls(state, Calls() - before, static_cast<double>(state.iterations()));
  if (Drv().hold_events) Drv().hold_events(0);
  // Held records stay held until released: sgm_context_destroy waits for them.
  if (Drv().complete_events) Drv().complete_events();
  sgm_context_destroy(ctx);
}

void BM_PairCreatedStream(benchmark::State &state) {
  void *s = MakeStream();
  if (!s && !Drv().get_stats) {
    state.SkipWithError("no created stream on a real driver in this benchmark");
    return;
  }
  PairsOn(state, s);
}

void BM_PairNullStream(benchmark::State &state) { PairsOn(state, nullptr); }

void BM_PairPerThreadStream(benchmark::State &state) {
  PairsOn(state, reinterpret_cast<void *>(static_cast<uintptr_t>(0x2)));  // CU_STREAM_PER_THREAD
}

// The entry points a transfer may call, counted one by one (the double's
// per-entry counter) beside the total.
const char *const kTransferCalls[] = {"cuStreamIsCapturing", "cuEventRecord", "cuStreamWaitEvent",
                                      "cuStreamGetFlags"};
constexpr size_t kNTransferCalls = sizeof kTransferCalls / sizeof kTransferCalls[0];

void CountEach(uint64_t *out) {
  for (size_t i = 0; i < kNTransferCalls; i++)
    out[i] = Drv().calls_of ? Drv().calls_of(kTransferCalls[i]) : 0;
}

// One block fills the budget; allocations alternate between two streams, so
// every one after the first takes the block from the other stream's cache.
// range(0): 0 = a created (blocking) stream and the legacy NULL stream,
// 1 = two created blocking streams, 2 = two non-blocking streams (PyTorch's side
// streams; no fence: the 4-call path, docs/streams.md "Why two calls").
void BM_CrossStreamTransfer(benchmark::State &state) {
  sgm_context *ctx = MakeContext("4MiB", false);
  bool nb = state.range(0) == 2;
  void *a = nb ? MakeNonBlockingStream() : MakeStream();
  void *b = nb ? MakeNonBlockingStream() : state.range(0) ? MakeStream() : nullptr;
  if (!ctx || !a || (state.range(0) && !b)) {
    state.SkipWithError(ctx ? "needs the driver double's streams" : sgm_last_error());
    if (ctx) sgm_context_destroy(ctx);
    return;
  }
  // Nothing is held: the double's queues would grow without end. The blocks
  // still move only by transfer (sgm never asks whether A is done first).
  void *streams[2] = {a, b};
  void *warm = sgm_alloc(ctx, 4 << 20, a);
  sgm_free(ctx, warm, a);
  warm = sgm_alloc(ctx, 4 << 20, b);  // the first transfer also creates the pooled event
  sgm_free(ctx, warm, b);
  uint64_t before = Calls();
  uint64_t each_before[kNTransferCalls], each_after[kNTransferCalls];
  CountEach(each_before);
  uint64_t k = 0;
  for (auto _ : state) {
    void *s = streams[k++ & 1];
    void *p = sgm_alloc(ctx, 4 << 20, s);
    if (!p) {
      state.SkipWithError(sgm_last_error());
      break;
    }
    sgm_free(ctx, p, s);
  }
  double n = static_cast<double>(state.iterations());
  ReportCalls(state, Calls() - before, n);
  CountEach(each_after);
  if (Drv().calls_of)
    for (size_t i = 0; i < kNTransferCalls; i++)
      state.counters[kTransferCalls[i]] = static_cast<double>(each_after[i] - each_before[i]) / n;
  sgm_context_destroy(ctx);
}

// Driver calls per round (rounds = iterations), beside the transfer calls one
// by one; -1 on a real driver.
void ReportRounds(benchmark::State &state, uint64_t before, const uint64_t *each_before) {
  double n = static_cast<double>(state.iterations());
  state.counters["calls_per_round"] = Drv().get_stats ? static_cast<double>(Calls() - before) / n : -1.0;
  uint64_t each_after[kNTransferCalls];
  CountEach(each_after);
  if (Drv().calls_of)
    for (size_t i = 0; i < kNTransferCalls; i++)
      state.counters[kTransferCalls[i]] = static_cast<double>(each_after[i] - each_before[i]) / n;
}

// The three sizes of the rounds below: 2 MiB (exact: only a 2 MiB request
// takes it), 1 MiB and 768 KiB (size classes); 3.75 of a 4 MiB budget.
constexpr size_t kRoundSizes[3] = {2u << 20, 1u << 20, 768u << 10};

// Each stream with its own sizes, the budget full: per round a side stream
// (non-blocking) takes a 2 MiB block and frees it, then the main stream
// takes 1 MiB and 768 KiB and frees them; all three started in the main
// stream's cache. range(0): 0 = the main stream is the legacy NULL stream,
// 1 = both non-blocking. Moving every cached block at each transfer made the
// caches swap streams twice per round (2 transfers, 4 calls each); moving
// what the request takes leaves each stream its own (0 calls per round).
void BM_CrossStreamOwnSizes(benchmark::State &state) {
  sgm_context *ctx = MakeContext("4MiB", false);
  void *side = MakeNonBlockingStream();
  void *main_s = state.range(0) ? MakeNonBlockingStream() : nullptr;
  if (!ctx || !side || (state.range(0) && !main_s)) {
    state.SkipWithError(ctx ? "needs the driver double's streams" : sgm_last_error());
    if (ctx) sgm_context_destroy(ctx);
    return;
  }
  void *blk[3];
  for (int i = 0; i < 3; i++) blk[i] = sgm_alloc(ctx, kRoundSizes[i], main_s);
  for (void *b : blk) sgm_free(ctx, b, main_s);
  auto round = [&]() {
    void *p = sgm_alloc(ctx, kRoundSizes[0], side);
    if (!p) return false;
    sgm_free(ctx, p, side);
    void *a = sgm_alloc(ctx, kRoundSizes[1], main_s), *b = sgm_alloc(ctx, kRoundSizes[2], main_s);
    if (!a || !b) return false;
    sgm_free(ctx, a, main_s);
    sgm_free(ctx, b, main_s);
    return true;
  };
  round();  // the first transfer, the streams' flags, the event pool
  uint64_t before = Calls(), each_before[kNTransferCalls];
  CountEach(each_before);
  for (auto _ : state)
    if (!round()) {
      state.SkipWithError(sgm_last_error());
      break;
    }
  ReportRounds(state, before, each_before);
  sgm_context_destroy(ctx);
}

// A burst: per round one of two non-blocking streams (alternating) takes
// blocks of all three sizes and frees them, so each round takes the other
// stream's whole cache. The first transfer of a round (4 calls: the owner's
// check and record, the taker's check and wait) moves the block asked for
// and the owner's blocks of the sizes the taker took from its own caches in
// its last two periods (docs/streams.md "Why two calls" item 6): all three
// once each stream has had one round as taker, so 4 calls per round in the
// steady state. A taker with no such record (its first burst) moves the rest
// at its next request under the same fence: 4 + 2 = 6 calls, worst case.
void BM_CrossStreamBurst(benchmark::State &state) {
  sgm_context *ctx = MakeContext("4MiB", false);
  void *streams[2] = {MakeNonBlockingStream(), MakeNonBlockingStream()};
  if (!ctx || !streams[0] || !streams[1]) {
    state.SkipWithError(ctx ? "needs the driver double's streams" : sgm_last_error());
    if (ctx) sgm_context_destroy(ctx);
    return;
  }
  uint64_t k = 0;
  auto round = [&]() {
    void *s = streams[k++ & 1], *blk[3];
    for (int i = 0; i < 3; i++)
      if (!(blk[i] = sgm_alloc(ctx, kRoundSizes[i], s))) return false;
    for (void *b : blk) sgm_free(ctx, b, s);
    return true;
  };
  round();
  round();  // the first transfer, the streams' flags, the event pool
  uint64_t before = Calls(), each_before[kNTransferCalls];
  CountEach(each_before);
  for (auto _ : state)
    if (!round()) {
      state.SkipWithError(sgm_last_error());
      break;
    }
  ReportRounds(state, before, each_before);
  sgm_context_destroy(ctx);
}

// Pairs on stream B while range(0) blocks freed on stream A are pending (A's
// work is held, so none of them could go back to the pool). The ratio of the
// two rows is the "free with N pending" figure.
void BM_PairWithPending(benchmark::State &state) {
  sgm_context *ctx = MakeContext("1GiB", true);
  void *a = MakeStream(), *b = MakeStream();
  if (!ctx || !a || !b) {
    state.SkipWithError(ctx ? "needs the driver double's streams" : sgm_last_error());
    if (ctx) sgm_context_destroy(ctx);
    return;
  }
  if (Drv().hold_events) Drv().hold_events(1);
  std::vector<void *> pending(static_cast<size_t>(state.range(0)));
  for (auto &p : pending) p = sgm_alloc(ctx, 4096, a);
  for (auto p : pending) sgm_free(ctx, p, a);
  void *warm = sgm_alloc(ctx, 4096, b);
  sgm_free(ctx, warm, b);
  uint64_t before = Calls();
  for (auto _ : state) {
    void *p = sgm_alloc(ctx, 4096, b);
    benchmark::DoNotOptimize(p);
    sgm_free(ctx, p, b);
  }
  ReportCalls(state, Calls() - before, static_cast<double>(state.iterations()));
  if (Drv().hold_events) Drv().hold_events(0);
  // Held records stay held until released: sgm_context_destroy waits for them.
  if (Drv().complete_events) Drv().complete_events();
  sgm_context_destroy(ctx);
}

BENCHMARK(BM_PairCreatedStream);
BENCHMARK(BM_PairNullStream);
BENCHMARK(BM_PairPerThreadStream);
BENCHMARK(BM_CrossStreamTransfer)->Arg(0)->Arg(1)->Arg(2);
BENCHMARK(BM_CrossStreamOwnSizes)->Arg(0)->Arg(1);
BENCHMARK(BM_CrossStreamBurst);
BENCHMARK(BM_PairWithPending)->Arg(0)->Arg(10000);

}  // namespace

int main(int argc, char **argv) {
  setenv("SGM_BACKEND", "cuda", 1);
  sgm_context *probe = MakeContext("64MiB", true);
  if (!probe) {
    std::printf("bench_stream: skipping: %s\n", sgm_last_error());
    return 0;
  }
  sgm_context_destroy(probe);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
