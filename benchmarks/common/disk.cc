// disk.cc — bodies of the disk tier benchmarks (bench_disk, sgm-bench),
// through the public API only (issue 11): spill write and read-back bandwidth
// of sgm buffers moved to SGM_TIER_DISK by sgm_buffer_evict and back to VRAM
// by sgm_buffer_acquire (checksum written and verified, staging through the
// pinned bounce buffer included), against raw sequential pwrite / pread of
// the same bytes in the same extent sizes, on the same file system.
//
// 64 MiB of random data per iteration as buffers of range(0) MiB (one extent
// each), on the emulated device (its VRAM is host memory, so the figure is the
// disk tier's, not a PCIe link's). range(1): 1 direct, 0 buffered. sgm picks
// its I/O mode itself (direct where the file system takes O_DIRECT, else
// buffered) and the public API cannot choose it: an sgm body asked for the
// other mode skips. The raw reference in either mode:
//  - direct:   raw pwrite/pread on an O_DIRECT file;
//  - buffered: raw buffered pwrite of all 64 MiB, one sync_file_range and one
//    POSIX_FADV_DONTNEED at the end; reads: pread then DONTNEED, so every
//    iteration reads from the device, never from the page cache.
// A write iteration's buffers come back to VRAM untimed. Their extents are
// freed, and the disk tier keeps their blocks for the next spill of the same
// size (docs/disk.md), so every timed sgm write after the first overwrites
// blocks the file holds; the raw reference likewise overwrites the range it
// wrote before (it punched it between iterations while sgm punched every
// freed extent: overwriting is ~25% faster than allocating here).
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "bodies.h"

namespace sgm_bench {

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kTotal = kDiskBytesPerIteration;  // data moved per iteration

std::string g_dir = "/tmp";
bool g_direct = false;           // the folder's file system takes O_DIRECT (sgm then uses it)
unsigned char *g_src = nullptr;  // kTotal bytes of random data, page-aligned
unsigned char *g_dst = nullptr;  // kTotal bytes, page-aligned
// "write/8MiB/direct" -> {bytes, seconds} summed over every timed iteration.
std::map<std::string, std::pair<double, double>> g_sgm, g_raw;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Key(const char *op, int64_t ext_mib, bool direct) {
  return std::string(op) + "/" + std::to_string(ext_mib) + "MiB/" + (direct ? "direct" : "buffered");
}

void Record(std::map<std::string, std::pair<double, double>> &m, const std::string &k, double s) {
  m[k].first += static_cast<double>(kTotal);
  m[k].second += s;
}
// An emulated device with room for every buffer in VRAM, and the disk tier in
// --dir with room for all of them twice over.
struct Spill {
  sgm_context *ctx = nullptr;
  std::vector<sgm_buffer *> bufs;
  uint64_t ext = 0;

  ~Spill() {
    for (sgm_buffer *b : bufs) sgm_buffer_destroy(b);
    sgm_context_destroy(ctx);
  }

  // Buffers of ext bytes filled with g_src, resident in VRAM; false (the
  // state skipped with sgm's message) when anything fails.
  bool Open(benchmark::State &state, uint64_t extent, bool direct) {
    ext = extent;
    if (direct != g_direct) {
      state.SkipWithError(g_direct ? "sgm uses O_DIRECT on this file system; the public API cannot "
                                     "ask for buffered I/O"
                                   : "this file system does not take O_DIRECT");
      return false;
    }
    sgm_config cfg;
    sgm_config_init(&cfg);
    cfg.backend = SGM_BACKEND_EMU;
    cfg.emu_vram_bytes = 4 * kTotal;
    cfg.idle_trim_ms = 0;
    std::snprintf(cfg.spill_dir, sizeof cfg.spill_dir, "%s", g_dir.c_str());
    cfg.spill_limit.bytes = 4 * kTotal;
    if (sgm_context_create(&cfg, &ctx) != SGM_OK) return Fail(state);
    for (uint64_t off = 0; off < kTotal; off += ext) {
      sgm_buffer *b = nullptr;
      if (sgm_buffer_create(ctx, ext, &b) != SGM_OK) return Fail(state);
      bufs.push_back(b);
      if (sgm_buffer_write(b, 0, g_src + off, ext) != SGM_OK) return Fail(state);
    }
    return true;
  }

  bool Fail(benchmark::State &state) {
    state.SkipWithError(sgm_last_error());
    return false;
  }

  bool ToDisk(benchmark::State &state) {
    for (sgm_buffer *b : bufs)
      if (sgm_buffer_evict(b, SGM_TIER_DISK) != SGM_OK || sgm_buffer_tier(b) != SGM_TIER_DISK)
        return Fail(state);
    return true;
  }

  // acquire (disk -> VRAM, checksum verified); release unless keep.
  bool ToVram(benchmark::State &state, bool release) {
    for (sgm_buffer *b : bufs) {
      void *d = nullptr;
      if (sgm_buffer_acquire(b, nullptr, &d) != SGM_OK) return Fail(state);
      if (release && sgm_buffer_release(b, nullptr) != SGM_OK) return Fail(state);
    }
    return true;
  }

  bool Release(benchmark::State &state) {
    for (sgm_buffer *b : bufs)
      if (sgm_buffer_release(b, nullptr) != SGM_OK) return Fail(state);
    return true;
  }

  // The bytes survived every round trip.
  void Check(benchmark::State &state) {
    std::memset(g_dst, 0, kTotal);
    for (size_t i = 0; i < bufs.size(); i++)
      if (sgm_buffer_read(bufs[i], 0, g_dst + i * ext, ext) != SGM_OK) {
        Fail(state);
        return;
      }
    if (std::memcmp(g_dst, g_src, kTotal) != 0) state.SkipWithError("read back wrong bytes");
  }
};

int OpenRaw(bool direct, benchmark::State &state) {
  int fd = open(g_dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | (direct ? O_DIRECT : 0), 0600);
  if (fd < 0) state.SkipWithError("cannot open a raw O_TMPFILE file in --dir");
  return fd;
}

bool WriteAll(int fd, const unsigned char *p, uint64_t n, uint64_t off) {
  while (n) {
    ssize_t w = pwrite(fd, p, n, static_cast<off_t>(off));
    if (w <= 0) return false;
    p += w, n -= static_cast<uint64_t>(w), off += static_cast<uint64_t>(w);
  }
  return true;
}

bool ReadAll(int fd, unsigned char *p, uint64_t n, uint64_t off) {
  while (n) {
    ssize_t r = pread(fd, p, n, static_cast<off_t>(off));
    if (r <= 0) return false;
    p += r, n -= static_cast<uint64_t>(r), off += static_cast<uint64_t>(r);
  }
  return true;
}

}  // namespace

// Timed: every buffer evicted VRAM -> disk.
void BM_SgmWrite(benchmark::State &state) {
  Spill s;
  if (!s.Open(state, static_cast<uint64_t>(state.range(0)) * kMiB, state.range(1) != 0)) return;
  for (auto _ : state) {
    double t0 = Now();
    if (!s.ToDisk(state)) return;
    double t = Now() - t0;
    state.SetIterationTime(t);
    Record(g_sgm, Key("write", state.range(0), state.range(1) != 0), t);
    if (!s.ToVram(state, true)) return;
  }
  s.Check(state);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
}

// Timed: every disk-resident buffer acquired (disk -> VRAM, verified).
void BM_SgmRead(benchmark::State &state) {
  Spill s;
  if (!s.Open(state, static_cast<uint64_t>(state.range(0)) * kMiB, state.range(1) != 0)) return;
  for (auto _ : state) {
    if (!s.ToDisk(state)) return;
    double t0 = Now();
    if (!s.ToVram(state, false)) return;
    double t = Now() - t0;
    state.SetIterationTime(t);
    Record(g_sgm, Key("read", state.range(0), state.range(1) != 0), t);
    if (!s.Release(state)) return;
  }
  s.Check(state);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
}

void BM_RawWrite(benchmark::State &state) {
  const uint64_t ext = static_cast<uint64_t>(state.range(0)) * kMiB;
  const bool direct = state.range(1) != 0;
  int fd = OpenRaw(direct, state);
  if (fd < 0) return;
  for (auto _ : state) {
    double t0 = Now();
    for (uint64_t off = 0; off < kTotal; off += ext)
      if (!WriteAll(fd, g_src + off, ext, off)) {
        state.SkipWithError("raw pwrite failed");
        close(fd);
        return;
      }
    if (!direct) {
      sync_file_range(fd, 0, static_cast<off_t>(kTotal), SYNC_FILE_RANGE_WAIT_BEFORE |
                      SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      posix_fadvise(fd, 0, static_cast<off_t>(kTotal), POSIX_FADV_DONTNEED);
    }
    double s = Now() - t0;
    state.SetIterationTime(s);
    Record(g_raw, Key("write", state.range(0), state.range(1) != 0), s);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
  close(fd);
}

void BM_RawRead(benchmark::State &state) {
  const uint64_t ext = static_cast<uint64_t>(state.range(0)) * kMiB;
  const bool direct = state.range(1) != 0;
  int fd = OpenRaw(direct, state);
  if (fd < 0) return;
  if (!WriteAll(fd, g_src, kTotal, 0)) {
    state.SkipWithError("raw pwrite failed");
    close(fd);
    return;
  }
  fdatasync(fd);
  posix_fadvise(fd, 0, static_cast<off_t>(kTotal), POSIX_FADV_DONTNEED);
  for (auto _ : state) {
    double t0 = Now();
    for (uint64_t off = 0; off < kTotal; off += ext)
      if (!ReadAll(fd, g_dst + off, ext, off)) {
        state.SkipWithError("raw pread failed");
        close(fd);
        return;
      }
    if (!direct) posix_fadvise(fd, 0, static_cast<off_t>(kTotal), POSIX_FADV_DONTNEED);
    double s = Now() - t0;
    state.SetIterationTime(s);
    Record(g_raw, Key("read", state.range(0), state.range(1) != 0), s);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
  close(fd);
}

// The checksum alone: what XXH3 costs per byte on this CPU (sgm checksums
// every spilled extent on write and verifies it on read).
void BM_Xxh3(benchmark::State &state) {
  for (auto _ : state) benchmark::DoNotOptimize(XXH3_64bits(g_src, kTotal));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
}

bool DiskSetup(const std::string &dir) {
  g_dir = dir;
  g_src = static_cast<unsigned char *>(std::aligned_alloc(4096, kTotal));
  g_dst = static_cast<unsigned char *>(std::aligned_alloc(4096, kTotal));
  if (!g_src || !g_dst) {
    DiskTeardown();
    return false;
  }
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (uint64_t i = 0; i < kTotal; i += 8) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    std::memcpy(g_src + i, &s, 8);
  }
  std::memset(g_dst, 0, kTotal);
  int probe = open(g_dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | O_DIRECT, 0600);
  g_direct = probe >= 0;
  if (probe >= 0) close(probe);
  g_sgm.clear();
  g_raw.clear();
  return true;
}

void DiskTeardown() {
  std::free(g_src);
  std::free(g_dst);
  g_src = g_dst = nullptr;
}

const std::string &DiskDir() { return g_dir; }

bool DiskDirect() { return g_direct; }

std::string DiskDescribe() {
  return std::string("I/O mode sgm uses there: ") + (g_direct ? "direct (O_DIRECT)" : "buffered");
}

std::vector<DiskTotals> DiskSummary() {
  std::vector<DiskTotals> v;
  for (const auto &kv : g_sgm) {
    auto r = g_raw.find(kv.first);
    if (r == g_raw.end()) continue;
    v.push_back({kv.first, kv.second.first, kv.second.second, r->second.first, r->second.second});
  }
  return v;
}

}  // namespace sgm_bench
