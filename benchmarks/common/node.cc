// node.cc — bodies of the node registry's costs (bench_node, sgm-bench's
// node.* figures), each beside its reference:
//  - sgm_alloc + sgm_free pairs (a ring of 64 live blocks, 256 B .. 64 KiB)
//    on an emulated device named by SGM_EMU_DEVICE, registry on (joined, its
//    ticker publishing every SGM_NODE_PERIOD_MS) against registry off;
//  - one join + leave of a registry another member holds open, against
//    open + mmap + touch every page + munmap + close of the same file (the
//    floor of any mapping that is read);
//  - the time from a SIGKILL to the reclaim of the dead process's slot by a
//    live context's ticker, against the ticker's period;
//  - `sgm-smi --json` (fork + exec) with 64 processes in the registry,
//    against fork + exec of /bin/true.
// The registries live in one private folder under /dev/shm (tmpfs, as the
// default registry), removed at exit.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bodies.h"

extern "C" {
#include "internal.h"
}

namespace sgm_bench {

namespace {

std::string MakeDir() {
  char t[] = "/dev/shm/sgm-bench-node-XXXXXX";
  if (!mkdtemp(t)) {
    std::perror("mkdtemp");
    std::exit(1);
  }
  std::string d(t);
  static std::string keep;
  keep = d;
  std::atexit([] { std::system(("rm -rf '" + keep + "'").c_str()); });
  return d;
}

uint64_t NowNs() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<uint64_t>(t.tv_sec) * 1000000000u + static_cast<uint64_t>(t.tv_nsec);
}

sgm_context *NodeContext(bool registry, const char *device) {
  setenv("SGM_BACKEND", "emu", 1);
  setenv("SGM_NODE_DIR", NodeDir().c_str(), 1);
  setenv("SGM_EMU_DEVICE", device, 1);
  setenv("SGM_NODE", registry ? "on" : "off", 1);
  sgm_context *c = nullptr;
  if (sgm_context_create(nullptr, &c) != SGM_OK) {
    std::fprintf(stderr, "node bench: %s\n", sgm_last_error());
    std::exit(1);
  }
  unsetenv("SGM_EMU_DEVICE");
  unsetenv("SGM_NODE");
  if (registry != (sgm__share_node(c) != nullptr)) {
    std::fprintf(stderr, "node bench: the registry is not %s\n", registry ? "on" : "off");
    std::exit(1);
  }
  return c;
}

sgm_node_params Params(const char *key, const char *name) {
  sgm_node_params p{};
  p.dir = NodeDir().c_str();
  p.key = key;
  p.name = name;
  p.device_total_bytes = 1u << 30;
  p.shared_cap_bytes = 1u << 30;
  return p;
}

// A child that joins, says so on the pipe, and waits to be killed.
pid_t JoinedChild(const char *key) {
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
  char ok = 0;
  if (read(p[0], &ok, 1) != 1 || !ok) {
    std::fprintf(stderr, "node bench: a child could not join\n");
    std::exit(1);
  }
  close(p[0]);
  return pid;
}

// Slots marked live in the registry; with alive_only, only those whose
// owner's liveness lock is held (what sgm-smi shows). Without it, a dead
// process counts until someone reclaims its slot.
size_t LiveProcs(const char *key, bool alive_only) {
  char path[PATH_MAX];
  sgm__node_path(NodeDir().c_str(), key, path, sizeof path);
  int fd;
  unsigned char *mem;
  size_t len;
  char why[256];
  if (sgm__node_map(path, false, false, &fd, &mem, &len, why, sizeof why) != SGM_OK) return 0;
  static sgm_node_view v;
  size_t live = 0;
  if (sgm__node_parse(mem, len, &v, why, sizeof why) == SGM_OK)
    for (size_t i = 0; i < v.n_procs; i++) live += !alive_only || sgm__node_slot_alive(fd, v.procs[i].slot);
  munmap(mem, len);
  close(fd);
  return live;
}

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

}  // namespace

const std::string &NodeDir() {
  static std::string d = MakeDir();
  return d;
}

void BM_NodeAllocFree(benchmark::State &state) {
  bool registry = state.range(0) != 0;
  sgm_context *ctx = NodeContext(registry, registry ? "bench-on" : "bench-off");
  constexpr int kRing = 64;
  std::vector<size_t> sizes = LogUniformSizes(4096, 256, 65536, 0x5eed);
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
  sgm_context_destroy(ctx);
}

void BM_NodeJoinLeave(benchmark::State &state) {
  sgm_node_params p = Params("emu-join", "bench");
  sgm_node *holder = nullptr;
  if (sgm__node_join(&p, &holder) != SGM_OK) {
    state.SkipWithError("join failed");
    return;
  }
  for (auto _ : state) {
    sgm_node *n = nullptr;
    if (sgm__node_join(&p, &n) != SGM_OK) {
      state.SkipWithError("join failed");
      break;
    }
    sgm__node_leave(n);
  }
  sgm__node_leave(holder);
}

void BM_NodeOpenMap(benchmark::State &state) {
  sgm_node_params p = Params("emu-join", "bench");
  sgm_node *holder = nullptr;
  if (sgm__node_join(&p, &holder) != SGM_OK) {
    state.SkipWithError("join failed");
    return;
  }
  const char *path = sgm__node_file(holder);
  for (auto _ : state) {
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    size_t len = 512 + 128 * 256;
    auto *m = static_cast<volatile unsigned char *>(
        mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    // Touch every page, as a join reads every slot: munmap then pays the
    // same TLB flush (a join's largest cost on a virtual machine).
    unsigned sum = 0;
    for (size_t off = 0; off < len; off += 4096) sum += m[off];
    benchmark::DoNotOptimize(sum);
    munmap(const_cast<unsigned char *>(m), len);
    close(fd);
  }
  sgm__node_leave(holder);
}

double NodeReclaimMs(int rounds) {
  setenv("SGM_NODE_PERIOD_MS", "50", 1);
  sgm_context *ctx = NodeContext(true, "reclaim");
  unsetenv("SGM_NODE_PERIOD_MS");
  double sum = 0;
  for (int i = 0; i < rounds; i++) {
    pid_t pid = JoinedChild("emu-reclaim");
    uint64_t t0 = NowNs();
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    // Polled every 100 us: the figure is the ticker's, within 0.1 ms.
    while (LiveProcs("emu-reclaim", false) > 1) usleep(100);
    sum += static_cast<double>(NowNs() - t0) / 1e6;
  }
  sgm_context_destroy(ctx);
  return sum / rounds;
}

double NodeSmiJsonMs(int processes, int rounds, bool reference) {
  const char *smi = SmiPath();
  if (!reference && !smi) return 0;
  std::vector<pid_t> kids;
  for (int i = 0; i < processes; i++) kids.push_back(JoinedChild("emu-smi"));
  double sum = 0;
  if (LiveProcs("emu-smi", true) == static_cast<size_t>(processes)) {
    std::string dir = NodeDir();
    const char *argv_smi[] = {smi, "--json", "--dir", dir.c_str(), nullptr};
    const char *argv_true[] = {"/bin/true", nullptr};
    for (int r = 0; r < rounds; r++)
      sum += reference ? RunCommandMs("/bin/true", argv_true) : RunCommandMs(smi, argv_smi);
  }
  for (pid_t p : kids) {
    kill(p, SIGKILL);
    waitpid(p, nullptr, 0);
  }
  return sum / rounds;
}

const char *SmiPath() {
  static std::string path = [] {
    // Installed: next to this program; built: where CMake put it.
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
      self[n] = '\0';
      std::string dir(self);
      dir = dir.substr(0, dir.rfind('/'));
      if (access((dir + "/sgm-smi").c_str(), X_OK) == 0) return dir + "/sgm-smi";
    }
    return std::string(access(SGM_SMI_BUILD_PATH, X_OK) == 0 ? SGM_SMI_BUILD_PATH : "");
  }();
  return path.empty() ? nullptr : path.c_str();
}

}  // namespace sgm_bench
