// node.cc — bodies of the node registry's costs (bench_node, sgm-bench's
// node.* figures), each beside its reference:
//  - sgm_alloc + sgm_free pairs (a ring of 64 live blocks, 256 B .. 64 KiB)
//    on an emulated device named by SGM_EMU_DEVICE, registry on (joined, its
//    ticker publishing every SGM_NODE_PERIOD_MS) against registry off;
//  - one join + leave of a registry another context holds open, timed as
//    sgm_context_create + sgm_context_destroy with the registry on, against
//    the file-system floor of a layout-3 join and leave (create a 1 KiB
//    record, fallocate, write, lock, map, rename; unlink, unmap, close);
//  - the time from a SIGKILL to the removal of the dead process's record by
//    a live context's ticker, against the ticker's period (it stops counting
//    at once: its lock dies with it);
//  - `sgm-smi --json` (fork + exec) with 64 processes in the registry,
//    against fork + exec of /bin/true.
// Public API only: contexts join and leave, include/sgm/node.h reads the
// registries. They live in one private folder under /dev/shm (tmpfs, as the
// default registry), removed at exit.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <sgm/node.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bodies.h"

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

// The environment of a context on emulated device `device` (key
// "emu-<device>") in NodeDir(), registry on or off; Unset undoes it.
void SetNodeEnv(bool registry, const char *device) {
  setenv("SGM_BACKEND", "emu", 1);
  setenv("SGM_NODE_DIR", NodeDir().c_str(), 1);
  setenv("SGM_EMU_DEVICE", device, 1);
  setenv("SGM_NODE", registry ? "on" : "off", 1);
}
void UnsetNodeEnv() {
  unsetenv("SGM_EMU_DEVICE");
  unsetenv("SGM_NODE");
}

sgm_context *CreateOrDie() {
  sgm_context *c = nullptr;
  if (sgm_context_create(nullptr, &c) != SGM_OK) {
    std::fprintf(stderr, "node bench: %s\n", sgm_last_error());
    std::exit(1);
  }
  return c;
}

// The registry file of emulated device `device`.
std::string RegistryPath(const char *device) { return NodeDir() + "/sgm-node-emu-" + device; }

// Processes in the device's registry: with alive_only, those whose owner's
// liveness lock is held (what sgm-smi shows); without, also dead processes
// until someone reclaims their slots. 0 when it cannot be read.
size_t Procs(const char *device, bool alive_only) {
  sgm_node_device dev{};
  dev.struct_size = sizeof dev;
  if (sgm_node_read(RegistryPath(device).c_str(), alive_only ? 0 : SGM_NODE_READ_DEAD, &dev, nullptr, 0) !=
      SGM_OK)
    return 0;
  return dev.n_processes;
}

// Is this process in the device's registry (a live slot with our pid)?
bool Registered(const char *device) {
  sgm_node_process procs[64];
  procs[0].struct_size = sizeof procs[0];
  sgm_node_device dev{};
  dev.struct_size = sizeof dev;
  if (sgm_node_read(RegistryPath(device).c_str(), 0, &dev, procs, 64) != SGM_OK) return false;
  for (size_t i = 0; i < dev.n_processes && i < 64; i++)
    if (procs[i].pid == getpid()) return true;
  return false;
}

sgm_context *NodeContext(bool registry, const char *device) {
  SetNodeEnv(registry, device);
  sgm_context *c = CreateOrDie();
  UnsetNodeEnv();
  if (registry != Registered(device)) {
    std::fprintf(stderr, "node bench: the registry is not %s\n", registry ? "on" : "off");
    std::exit(1);
  }
  return c;
}

// A child that joins device's registry (a context of its own), says so on
// the pipe, and waits to be killed.
pid_t JoinedChild(const char *device) {
  int p[2];
  if (pipe(p) != 0) std::exit(1);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    SetNodeEnv(true, device);
    setenv("SGM_VERBOSE", "0", 1);
    sgm_context *c = nullptr;
    char ok = sgm_context_create(nullptr, &c) == SGM_OK && Registered(device) ? 1 : 0;
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
  sgm_context *holder = NodeContext(true, "join");
  SetNodeEnv(true, "join");
  for (auto _ : state) sgm_context_destroy(CreateOrDie());
  UnsetNodeEnv();
  sgm_context_destroy(holder);
}

void BM_NodeOpenMap(benchmark::State &state) {
  // The file-system floor of a layout-3 join and leave (issue 28): create a
  // record of its size in the same folder, allocate its space, write it,
  // lock it, map it, rename it into place; then unlink, unmap and close.
  sgm_context *holder = NodeContext(true, "join");
  std::string tmp = NodeDir() + "/floor.tmp", name = NodeDir() + "/floor";
  constexpr size_t kRecord = 1024;
  unsigned char rec[kRecord] = {1};
  for (auto _ : state) {
    int fd = open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      state.SkipWithError("cannot create a file in the registry folder");
      break;
    }
    struct flock fl = {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_len = 1;
    fcntl(fd, F_OFD_SETLK, &fl);
    posix_fallocate(fd, 0, kRecord);
    benchmark::DoNotOptimize(pwrite(fd, rec, kRecord, 0));
    void *m = mmap(nullptr, kRecord, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    benchmark::DoNotOptimize(rename(tmp.c_str(), name.c_str()));
    unlink(name.c_str());
    if (m != MAP_FAILED) munmap(m, kRecord);
    close(fd);
  }
  sgm_context_destroy(holder);
}

double NodeReclaimMs(int rounds) {
  setenv("SGM_NODE_PERIOD_MS", "50", 1);
  sgm_context *ctx = NodeContext(true, "reclaim");
  unsetenv("SGM_NODE_PERIOD_MS");
  double sum = 0;
  for (int i = 0; i < rounds; i++) {
    pid_t pid = JoinedChild("reclaim");
    uint64_t t0 = NowNs();
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    // Polled every 100 us: the figure is the ticker's, within 0.1 ms.
    while (Procs("reclaim", false) > 1) usleep(100);
    sum += static_cast<double>(NowNs() - t0) / 1e6;
  }
  sgm_context_destroy(ctx);
  return sum / rounds;
}

double NodeSmiJsonMs(int processes, int rounds, bool reference) {
  const char *smi = SmiPath();
  if (!reference && !smi) return 0;
  std::vector<pid_t> kids;
  for (int i = 0; i < processes; i++) kids.push_back(JoinedChild("smi"));
  double sum = 0;
  if (Procs("smi", true) == static_cast<size_t>(processes)) {
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
