// bench_node.cc — the node registry's costs (issue 13's targets), each with
// its reference in the same run:
//
//  - BM_AllocFreePair/registry:{0,1}: sgm_alloc + sgm_free pairs (a ring of
//    live blocks, sizes 256 B .. 64 KiB) on an emulated device named by
//    SGM_EMU_DEVICE, with the registry off (SGM_NODE=off: the reference) and
//    on (a joined context, its ticker publishing at the default period,
//    SGM_NODE_PERIOD_MS=50, or at 1 ms: registry:2). Run with
//    --benchmark_enable_random_interleaving so that the machine's load
//    falls on both alike. Target: on <= 1.05x off.
//  - BM_JoinLeave: one sgm__node_join + sgm__node_leave on a registry held
//    open by another member (warm), and on none (cold: the file is created
//    and removed each time). Target <= 1 ms.
//  - BM_ReclaimDeadProcess: a forked process joins and is SIGKILLed; the
//    time from the kill until a live context's ticker (default period,
//    50 ms) has reclaimed its slot, polled by a reader. Target <= 1 s.
//  - BM_SmiJson64: `sgm-smi --json` (fork + exec, the whole command) with 64
//    processes in the registry. Target <= 50 ms. BM_SmiTrue is the same
//    fork + exec of /bin/true, the cost of starting any command.
//
// The registry lives in a private folder under /dev/shm (SGM_NODE_DIR).
#include <benchmark/benchmark.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern "C" {
#include "internal.h"
}
#include "sgm.h"

namespace {

std::string &Dir() {
  static std::string d = [] {
    char t[] = "/dev/shm/sgm-bench-node-XXXXXX"; // tmpfs, as the default registry
    if (!mkdtemp(t)) std::exit(1);
    return std::string(t);
  }();
  return d;
}

sgm_context *MakeContext(bool registry, const char *device, bool fast_ticks) {
  setenv("SGM_BACKEND", "emu", 1);
  setenv("SGM_VERBOSE", "0", 1);
  setenv("SGM_NODE_DIR", Dir().c_str(), 1);
  setenv("SGM_EMU_DEVICE", device, 1);
  setenv("SGM_NODE", registry ? "on" : "off", 1);
  if (fast_ticks) setenv("SGM_NODE_PERIOD_MS", "1", 1);
  sgm_context *c = nullptr;
  if (sgm_context_create(nullptr, &c) != SGM_OK) {
    std::fprintf(stderr, "bench_node: %s\n", sgm_last_error());
    std::exit(1);
  }
  unsetenv("SGM_NODE_PERIOD_MS");
  if (registry != (sgm__share_node(c) != nullptr)) {
    std::fprintf(stderr, "bench_node: the registry is not %s\n", registry ? "on" : "off");
    std::exit(1);
  }
  return c;
}

void BM_AllocFreePair(benchmark::State &state) {
  bool registry = state.range(0) != 0;
  sgm_context *ctx = MakeContext(registry, registry ? "bench-on" : "bench-off", state.range(0) == 2);
  constexpr int kRing = 64;
  std::vector<size_t> sizes(4096);
  uint64_t s = 0x9e3779b97f4a7c15u;
  for (auto &x : sizes) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x = 256u << (s % 9); // 256 B .. 64 KiB
  }
  void *ring[kRing];
  for (int i = 0; i < kRing; i++) ring[i] = sgm_alloc(ctx, sizes[i], nullptr);
  size_t k = 0;
  for (auto _ : state) {
    int slot = static_cast<int>(k % kRing);
    sgm_free(ctx, ring[slot], nullptr);
    ring[slot] = sgm_alloc(ctx, sizes[(k + kRing) % sizes.size()], nullptr);
    benchmark::DoNotOptimize(ring[slot]);
    k++;
  }
  for (int i = 0; i < kRing; i++) sgm_free(ctx, ring[i], nullptr);
  state.counters["registry"] = static_cast<double>(state.range(0));
  sgm_context_destroy(ctx);
}
BENCHMARK(BM_AllocFreePair)->ArgName("registry")->Arg(0)->Arg(1)->Arg(2)->Repetitions(8)
    ->ReportAggregatesOnly(true);

sgm_node_params Params(const char *key, const char *name) {
  sgm_node_params p{};
  p.dir = Dir().c_str();
  p.key = key;
  p.name = name;
  p.device_total_bytes = 1u << 30;
  p.shared_cap_bytes = 1u << 30;
  return p;
}

void BM_JoinLeave(benchmark::State &state) {
  bool warm = state.range(0) != 0;
  sgm_node_params p = Params("emu-join", "bench");
  sgm_node *holder = nullptr;
  if (warm && sgm__node_join(&p, &holder) != SGM_OK) std::exit(1);
  for (auto _ : state) {
    sgm_node *n = nullptr;
    if (sgm__node_join(&p, &n) != SGM_OK) {
      state.SkipWithError("join failed");
      break;
    }
    sgm__node_leave(n);
  }
  sgm__node_leave(holder);
  state.counters["warm"] = warm ? 1 : 0;
}
BENCHMARK(BM_JoinLeave)->ArgName("warm")->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond);

uint64_t NowNs() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<uint64_t>(t.tv_sec) * 1000000000u + static_cast<uint64_t>(t.tv_nsec);
}

// A child that joins, says so on the pipe, and waits to be killed.
pid_t JoinedChild(const char *key, int *ready_fd) {
  int p[2];
  if (pipe(p) != 0) std::exit(1);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    sgm_node_params params = Params(key, "child");
    sgm_node *n = nullptr;
    char ok = sgm__node_join(&params, &n) == SGM_OK ? 1 : 0;
    if (write(p[1], &ok, 1) != 1) _exit(2);
    for (;;) pause();
  }
  close(p[1]);
  *ready_fd = p[0];
  return pid;
}

size_t LiveProcs(const char *key) {
  char path[512];
  sgm__node_path(Dir().c_str(), key, path, sizeof path);
  int fd;
  unsigned char *mem;
  size_t len;
  char why[256];
  if (sgm__node_map(path, false, false, &fd, &mem, &len, why, sizeof why) != SGM_OK) return 0;
  static sgm_node_view v;
  size_t live = 0;
  if (sgm__node_parse(mem, len, &v, why, sizeof why) == SGM_OK) live = v.n_procs;
  munmap(mem, len);
  close(fd);
  return live;
}

void BM_ReclaimDeadProcess(benchmark::State &state) {
  // A live context with the default ticker period reclaims.
  setenv("SGM_BACKEND", "emu", 1);
  setenv("SGM_VERBOSE", "0", 1);
  setenv("SGM_NODE_DIR", Dir().c_str(), 1);
  setenv("SGM_EMU_DEVICE", "reclaim", 1);
  setenv("SGM_NODE", "on", 1);
  sgm_context *ctx = nullptr;
  if (sgm_context_create(nullptr, &ctx) != SGM_OK) std::exit(1);
  double worst = 0;
  for (auto _ : state) {
    int fd;
    pid_t pid = JoinedChild("emu-reclaim", &fd);
    char ok = 0;
    if (read(fd, &ok, 1) != 1 || !ok) std::exit(1);
    close(fd);
    uint64_t t0 = NowNs();
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    // Reader polls every 100 us: the figure is the ticker's, within 0.1 ms.
    while (LiveProcs("emu-reclaim") > 1) usleep(100);
    double ms = static_cast<double>(NowNs() - t0) / 1e6;
    if (ms > worst) worst = ms;
    state.SetIterationTime(ms / 1000.0);
  }
  state.counters["worst_ms"] = worst;
  sgm_context_destroy(ctx);
}
BENCHMARK(BM_ReclaimDeadProcess)->UseManualTime()->Iterations(10)->Unit(benchmark::kMillisecond);

double RunCommandMs(const char *path, const char *const *argv) {
  uint64_t t0 = NowNs();
  pid_t pid = fork();
  if (pid == 0) {
    int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    execv(path, const_cast<char *const *>(argv));
    _exit(127);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return static_cast<double>(NowNs() - t0) / 1e6;
}

void BM_SmiJson64(benchmark::State &state) {
  std::vector<pid_t> kids;
  for (int i = 0; i < 64; i++) {
    int fd;
    kids.push_back(JoinedChild("emu-smi64", &fd));
    char ok = 0;
    if (read(fd, &ok, 1) != 1 || !ok) std::exit(1);
    close(fd);
  }
  if (LiveProcs("emu-smi64") != 64) {
    state.SkipWithError("64 processes did not join");
    return;
  }
  std::string dir = Dir();
  const char *argv[] = {SGM_SMI_PATH, "--json", "--dir", dir.c_str(), nullptr};
  for (auto _ : state) state.SetIterationTime(RunCommandMs(SGM_SMI_PATH, argv) / 1000.0);
  for (pid_t p : kids) {
    kill(p, SIGKILL);
    waitpid(p, nullptr, 0);
  }
  state.counters["processes"] = 64;
}
BENCHMARK(BM_SmiJson64)->UseManualTime()->Iterations(20)->Unit(benchmark::kMillisecond);

void BM_SmiTrue(benchmark::State &state) {
  const char *argv[] = {"/bin/true", nullptr};
  for (auto _ : state) state.SetIterationTime(RunCommandMs("/bin/true", argv) / 1000.0);
}
BENCHMARK(BM_SmiTrue)->UseManualTime()->Iterations(20)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char **argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::string cmd = "rm -rf '" + Dir() + "'";
  return std::system(cmd.c_str()) == 0 ? 0 : 1;
}
