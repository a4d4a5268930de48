// disk.cc — bodies of the disk tier benchmarks (bench_disk): spill write and
// read-back bandwidth through sgm__disk_write / sgm__disk_read (checksum
// included) against raw sequential pwrite / pread of the same bytes in the
// same extent sizes, on the same file system.
//
// 64 MiB of random data per iteration, in extents of range(0) MiB, in either
// I/O mode, each with its own fair reference:
//  - direct:   sgm in DIRECT mode vs raw pwrite/pread on an O_DIRECT file;
//  - buffered: sgm in BUFFERED mode (page cache, write-back and DONTNEED per
//    extent) vs raw buffered pwrite of all 64 MiB, one sync_file_range and one
//    POSIX_FADV_DONTNEED at the end (the cheapest way to get the same bytes to
//    disk and out of the cache); reads: pread then DONTNEED, so every
//    iteration reads from the device, never from the page cache.
// Between write iterations the extents are freed (sgm: holes punched; raw:
// the same range punched), so every write allocates blocks afresh.
// "cached_MiB" counts the spill file's pages left in the page cache (mincore).
#include <fcntl.h>
#include <mntent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "bodies.h"

extern "C" {
#include "internal.h"
#include "tiers/disk.h"
}

namespace sgm_bench {

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kTotal = kDiskBytesPerIteration;  // data moved per iteration

std::string g_dir = "/tmp";
unsigned char *g_src = nullptr;  // kTotal + 4096 bytes of random data, page-aligned
unsigned char *g_dst = nullptr;  // kTotal + 4096 bytes, page-aligned
// "write/8/direct" -> {bytes, seconds} summed over every timed iteration.
std::map<std::string, std::pair<double, double>> g_sgm, g_raw;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Key(const char *op, int64_t ext_mib, bool direct) {
  return std::string(op) + "/" + std::to_string(ext_mib) + "MiB/" +
         (direct ? "direct" : "buffered");
}

// Pages of fd's first bytes held in the page cache, in MiB.
double CachedMiB(int fd, uint64_t bytes) {
  void *m = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return -1;
  long page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> v(bytes / static_cast<uint64_t>(page) + 1);
  double n = 0;
  if (mincore(m, bytes, v.data()) == 0)
    for (unsigned char c : v) n += c & 1;
  munmap(m, bytes);
  return n * static_cast<double>(page) / static_cast<double>(kMiB);
}

sgm_disk *OpenSgm(bool direct, benchmark::State &state) {
  sgm_disk_open_opts o = {direct ? SGM_DISK_IO_DIRECT : SGM_DISK_IO_BUFFERED, false};
  sgm_size limit = {4 * kTotal, 0};
  sgm_disk *d = nullptr;
  if (sgm__disk_open_ex(g_dir.c_str(), limit, 0, &o, &d) != SGM_OK) {
    state.SkipWithError(sgm_last_error());
    return nullptr;
  }
  if (direct && sgm__disk_io_mode(d) != SGM_DISK_IO_DIRECT) {
    state.SkipWithError("this file system does not take O_DIRECT");
    sgm__disk_close(d);
    return nullptr;
  }
  return d;
}

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

void Record(std::map<std::string, std::pair<double, double>> &m, const std::string &k, double s) {
  m[k].first += static_cast<double>(kTotal);
  m[k].second += s;
}

}  // namespace

// Args: extent MiB, direct (1) or buffered (0).
void BM_SgmWrite(benchmark::State &state) {
  const uint64_t ext = static_cast<uint64_t>(state.range(0)) * kMiB;
  const bool direct = state.range(1) != 0;
  sgm_disk *d = OpenSgm(direct, state);
  if (!d) return;
  std::vector<sgm_disk_extent> e(kTotal / ext);
  for (auto _ : state) {
    double t0 = Now();
    for (size_t i = 0; i < e.size(); i++)
      if (sgm__disk_write(d, g_src + i * ext, ext, &e[i]) != SGM_OK) {
        state.SkipWithError(sgm_last_error());
        sgm__disk_close(d);
        return;
      }
    double s = Now() - t0;
    state.SetIterationTime(s);
    Record(g_sgm, Key("write", state.range(0), direct), s);
    for (auto &x : e) sgm__disk_free(d, &x);
  }
  for (size_t i = 0; i < e.size(); i++) sgm__disk_write(d, g_src + i * ext, ext, &e[i]);
  uint64_t end = 0;
  for (auto &x : e) end = std::max(end, x.offset + x.bytes);
  state.counters["cached_MiB"] = CachedMiB(sgm__disk_fd(d), end);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
  sgm__disk_close(d);
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
    Record(g_raw, Key("write", state.range(0), direct), s);
    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(kTotal));
  }
  WriteAll(fd, g_src, kTotal, 0);
  if (!direct) sync_file_range(fd, 0, static_cast<off_t>(kTotal), SYNC_FILE_RANGE_WAIT_BEFORE |
                               SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
  if (!direct) posix_fadvise(fd, 0, static_cast<off_t>(kTotal), POSIX_FADV_DONTNEED);
  state.counters["cached_MiB"] = CachedMiB(fd, kTotal);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
  close(fd);
}

void BM_SgmRead(benchmark::State &state) {
  const uint64_t ext = static_cast<uint64_t>(state.range(0)) * kMiB;
  const bool direct = state.range(1) != 0;
  sgm_disk *d = OpenSgm(direct, state);
  if (!d) return;
  std::vector<sgm_disk_extent> e(kTotal / ext);
  for (size_t i = 0; i < e.size(); i++)
    if (sgm__disk_write(d, g_src + i * ext, ext, &e[i]) != SGM_OK) {
      state.SkipWithError(sgm_last_error());
      sgm__disk_close(d);
      return;
    }
  for (auto _ : state) {
    double t0 = Now();
    for (size_t i = 0; i < e.size(); i++)
      if (sgm__disk_read(d, &e[i], g_dst + i * ext) != SGM_OK) {
        state.SkipWithError(sgm_last_error());
        sgm__disk_close(d);
        return;
      }
    double s = Now() - t0;
    state.SetIterationTime(s);
    Record(g_sgm, Key("read", state.range(0), direct), s);
  }
  if (std::memcmp(g_dst, g_src, kTotal) != 0) state.SkipWithError("read back wrong bytes");
  uint64_t end = 0;
  for (auto &x : e) end = std::max(end, x.offset + x.bytes);
  state.counters["cached_MiB"] = CachedMiB(sgm__disk_fd(d), end);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
  sgm__disk_close(d);
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
    Record(g_raw, Key("read", state.range(0), direct), s);
  }
  state.counters["cached_MiB"] = CachedMiB(fd, kTotal);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
  close(fd);
}

// The checksum alone: what XXH3 costs per byte on this CPU.
void BM_Xxh3(benchmark::State &state) {
  for (auto _ : state) benchmark::DoNotOptimize(XXH3_64bits(g_src, kTotal));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
}

// sgm from a buffer 1 byte off alignment: every byte goes through the bounce buffer.
void BM_SgmWriteUnaligned(benchmark::State &state) {
  const uint64_t ext = static_cast<uint64_t>(state.range(0)) * kMiB;
  sgm_disk *d = OpenSgm(true, state);
  if (!d) return;
  std::vector<sgm_disk_extent> e(kTotal / ext);
  for (auto _ : state) {
    double t0 = Now();
    for (size_t i = 0; i < e.size(); i++)
      if (sgm__disk_write(d, g_src + 1 + i * ext, ext, &e[i]) != SGM_OK) {
        state.SkipWithError(sgm_last_error());
        sgm__disk_close(d);
        return;
      }
    state.SetIterationTime(Now() - t0);
    for (auto &x : e) sgm__disk_free(d, &x);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
  sgm__disk_close(d);
}

void BM_SgmReadUnaligned(benchmark::State &state) {
  const uint64_t ext = static_cast<uint64_t>(state.range(0)) * kMiB;
  sgm_disk *d = OpenSgm(true, state);
  if (!d) return;
  std::vector<sgm_disk_extent> e(kTotal / ext);
  for (size_t i = 0; i < e.size(); i++) sgm__disk_write(d, g_src + i * ext, ext, &e[i]);
  for (auto _ : state) {
    double t0 = Now();
    for (size_t i = 0; i < e.size(); i++)
      if (sgm__disk_read(d, &e[i], g_dst + 1 + i * ext) != SGM_OK) {
        state.SkipWithError(sgm_last_error());
        sgm__disk_close(d);
        return;
      }
    state.SetIterationTime(Now() - t0);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kTotal));
  sgm__disk_close(d);
}

bool DiskSetup(const std::string &dir) {
  g_dir = dir;
  g_src = static_cast<unsigned char *>(std::aligned_alloc(4096, kTotal + 4096));
  g_dst = static_cast<unsigned char *>(std::aligned_alloc(4096, kTotal + 4096));
  if (!g_src || !g_dst) {
    DiskTeardown();
    return false;
  }
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (uint64_t i = 0; i < kTotal + 4096; i += 8) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    std::memcpy(g_src + i, &s, 8);
  }
  std::memset(g_dst, 0, kTotal + 4096);
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

std::string DiskDescribe() {
  sgm_disk *d = nullptr;
  sgm_size limit = {kTotal, 0};
  if (sgm__disk_open(g_dir.c_str(), limit, 0, &d) != SGM_OK) return std::string("unusable: ") + sgm_last_error();
  std::string s = std::string(sgm__disk_fs_name(d)) + ", default I/O mode " +
                  (sgm__disk_io_mode(d) == SGM_DISK_IO_DIRECT ? "direct" : "buffered");
  sgm__disk_close(d);
  return s;
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
