/*
 * alloc_main.c — sgm-alloc-replay: replay allocation streams (MiniMalloc-format
 * CSVs such as ../shared/traces/idealloc, or any trace sgm-replay reads)
 * through sgm_alloc / sgm_free on the emulated device and print, per trace:
 *
 *   - growth mode: peak committed VRAM / peak live bytes, committed left once
 *     every block is freed (before sgm_trim) and after sgm_trim;
 *   - reserve mode: the smallest budget that serves the stream with no
 *     fallback / peak live bytes (doubling, then bisection);
 *   - ns per allocator event in growth mode (best of MAIN_TIMED_RUNS), beside
 *     glibc malloc/free replaying the same stream in the same run.
 *
 *   sgm-alloc-replay [--vmm auto|off] [--no-reserve] TRACE|DIR...
 *   sgm-alloc-replay --granule [--backend emu|cuda]
 *
 * --granule measures what committing and returning one granule costs
 * through the public API (sgm_alloc + sgm_free + sgm_trim of one granule per
 * round): with one reserved range (map + unmap of a granule) and with chunks
 * (device_alloc + device_free: cuMemAlloc/cuMemFree on CUDA), beside
 * mmap + munmap of the same size in the same run.
 *
 * A DIR stands for its *.csv files in name order. Exit status: 0 done, 1 a
 * trace could not be read or replayed, 2 bad usage. docs/benchmarks.md has
 * the figures.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

#include "replay.h"
#include "sgm.h"

/* Timed runs per trace and allocator; the fastest is reported (the others
 * measure the machine's noise). */
#define MAIN_TIMED_RUNS 3
#define MAIN_MAX_TRACES 256

static const char USAGE[] =
    "usage: sgm-alloc-replay [--vmm auto|off] [--no-reserve] TRACE|DIR...\n"
    "       sgm-alloc-replay --granule [--backend emu|cuda]\n"
    "\n"
    "Replays each trace's allocation stream through sgm_alloc/sgm_free on the emulated\n"
    "device: growth-mode peak committed / peak live, the smallest reserved budget with\n"
    "no fallback / peak live, and ns per event beside glibc malloc/free.\n"
    "  TRACE|DIR     a trace (MiniMalloc CSV id,lower,upper,size, or any sgm-replay format),\n"
    "                or a folder: its *.csv files\n"
    "  --vmm MODE    the device's virtual-memory API when it has one (auto, default):\n"
    "                growth on one reserved range, reserve as a pool of granules; or\n"
    "                never (off): growth in chunks, reserve as one contiguous chunk\n"
    "  --no-reserve  skip the reserve-mode search\n"
    "  --granule     instead: the cost of mapping and unmapping one granule through the\n"
    "                public API, beside chunks and mmap/munmap (--backend emu|cuda)\n";

/* Granules of --granule's one large mapping (TIER_VMM_MAP_MAX_GRANULES). */
#define MAIN_BIG_GRANULES 32u
/* Rounds of the --granule measurement. */
#define MAIN_GRANULE_ROUNDS 2000

/* ns per mmap + munmap of bytes, read-write anonymous (the emulated device's
 * own calls for a granule or a chunk), untouched. */
static double main_mmap_ns(size_t bytes, unsigned n);

static double main_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ns per event of glibc malloc/free over the same stream (the reference). */
static double main_malloc_ns(const replay_trace *t) {
  void **ptr = calloc(t->n_blocks ? t->n_blocks : 1, sizeof *ptr);
  if (!ptr) return 0;
  uint64_t n = 0;
  double t0 = main_now();
  for (size_t i = 0; i < t->n_ev; i++) {
    uint32_t e = t->ev[i], b = REPLAY_EV_ID(e);
    if (e & REPLAY_EV_FREE) {
      free(ptr[b]);
      ptr[b] = NULL;
      n++;
    } else if (!ptr[b]) {
      ptr[b] = malloc((size_t)t->size[b]);
      n++;
    }
  }
  double s = main_now() - t0;
  for (uint32_t b = 0; b < t->n_blocks; b++) free(ptr[b]);
  free(ptr);
  return n ? s * 1e9 / (double)n : 0;
}

static double main_mmap_ns(size_t bytes, unsigned n) {
  double t0 = main_now();
  for (unsigned i = 0; i < n; i++) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return 0;
    munmap(p, bytes);
  }
  return n ? (main_now() - t0) * 1e9 / n : 0;
}

/* --granule: one line per path, all from this run. */
static int main_granule(int backend) {
  char err[REPLAY_ERR_MAX];
  double vmm_ns = 0, chunk_ns = 0, big_ns = 0;
  uint64_t g = 0, g_off = 0, g_big = 0;
  if (replay_alloc_granule_cost(backend, 1, 1, MAIN_GRANULE_ROUNDS, &vmm_ns, &g, err, sizeof err) ||
      replay_alloc_granule_cost(backend, 1, MAIN_BIG_GRANULES, MAIN_GRANULE_ROUNDS, &big_ns, &g_big,
                                err, sizeof err) ||
      replay_alloc_granule_cost(backend, 0, 1, MAIN_GRANULE_ROUNDS, &chunk_ns, &g_off, err,
                                sizeof err)) {
    fprintf(stderr, "sgm-alloc-replay: --granule: %s\n", err);
    return 1;
  }
  size_t bytes = g ? (size_t)g : (size_t)2 << 20;
  double ref = main_mmap_ns(bytes, MAIN_GRANULE_ROUNDS);
  const char *be = backend == SGM_BACKEND_CUDA ? "cuda" : "emu";
  if (g) {
    printf("granule %s: %zu bytes; map+unmap through sgm (alloc+free+trim): %.0f ns\n", be, bytes,
           vmm_ns);
    /* One mapping of many granules (issue 26): what one cuMemCreate of
     * 64 MiB costs against as many granules mapped one by one. */
    printf("granule %s: one mapping of %u granules (%zu bytes) through sgm: %.0f ns, %.0f ns per "
           "granule (%.2f x the single granule's)\n", be, MAIN_BIG_GRANULES,
           bytes * MAIN_BIG_GRANULES, big_ns, big_ns / MAIN_BIG_GRANULES,
           vmm_ns > 0 ? big_ns / MAIN_BIG_GRANULES / vmm_ns : 0);
  } else
    printf("granule %s: the device has no virtual-memory API: no map/unmap figure\n", be);
  printf("granule %s: chunk of %zu bytes through sgm (alloc+free+trim; %s): %.0f ns\n", be, bytes,
         backend == SGM_BACKEND_CUDA ? "cuMemAlloc+cuMemFree" : "mmap+munmap", chunk_ns);
  printf("granule %s: reference mmap+munmap of %zu bytes: %.0f ns\n", be, bytes, ref);
  return 0;
}

static int main_cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Append path, or a folder's *.csv files in name order. */
static int main_collect(const char *path, char **list, size_t *n) {
  struct stat st;
  if (stat(path, &st) != 0) {
    fprintf(stderr, "sgm-alloc-replay: %s: no such file or folder\n", path);
    return -1;
  }
  if (!S_ISDIR(st.st_mode)) {
    if (*n < MAIN_MAX_TRACES) list[(*n)++] = strdup(path);
    return 0;
  }
  DIR *d = opendir(path);
  if (!d) return -1;
  size_t first = *n;
  struct dirent *e;
  while ((e = readdir(d)) && *n < MAIN_MAX_TRACES) {
    size_t len = strlen(e->d_name);
    if (len < 5 || strcmp(e->d_name + len - 4, ".csv") != 0) continue;
    char *p = malloc(strlen(path) + len + 2);
    if (!p) break;
    sprintf(p, "%s/%s", path, e->d_name);
    list[(*n)++] = p;
  }
  closedir(d);
  qsort(list + first, *n - first, sizeof *list, main_cmp_str);
  return 0;
}

int main(int argc, char **argv) {
  int vmm = -1, backend = SGM_BACKEND_EMU;
  bool reserve = true, granule = false;
  char *paths[MAIN_MAX_TRACES];
  size_t n_paths = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      fputs(USAGE, stdout);
      return 0;
    } else if (!strcmp(argv[i], "--vmm") && i + 1 < argc) {
      const char *m = argv[++i];
      if (!strcmp(m, "auto")) vmm = 1;
      else if (!strcmp(m, "off")) vmm = 0;
      else {
        fprintf(stderr, "sgm-alloc-replay: --vmm takes auto or off, not \"%s\"\n%s", m, USAGE);
        return 2;
      }
    } else if (!strcmp(argv[i], "--no-reserve")) {
      reserve = false;
    } else if (!strcmp(argv[i], "--granule")) {
      granule = true;
    } else if (!strcmp(argv[i], "--backend") && i + 1 < argc) {
      const char *b = argv[++i];
      if (!strcmp(b, "emu")) backend = SGM_BACKEND_EMU;
      else if (!strcmp(b, "cuda")) backend = SGM_BACKEND_CUDA;
      else {
        fprintf(stderr, "sgm-alloc-replay: --backend takes emu or cuda, not \"%s\"\n%s", b, USAGE);
        return 2;
      }
    } else if (argv[i][0] == '-') {
      fprintf(stderr, "sgm-alloc-replay: unknown option %s\n%s", argv[i], USAGE);
      return 2;
    } else if (main_collect(argv[i], paths, &n_paths) != 0) {
      return 1;
    }
  }
  if (granule) return main_granule(backend);
  if (n_paths == 0) {
    fputs(USAGE, stderr);
    return 2;
  }
  int status = 0;
  double sum_growth = 0, max_growth = 0, max_reserve = 0, sum_reserve = 0;
  size_t n_done = 0;
  printf("%-14s %8s %10s %6s %9s %9s %9s %8s %8s %8s %8s\n", "trace", "events", "peak_live",
         "vram", "growth", "idle", "trimmed", "reserve", "ns/ev", "malloc", "runs");
  for (size_t k = 0; k < n_paths; k++) {
    char err[REPLAY_ERR_MAX];
    replay_trace t;
    const char *name = strrchr(paths[k], '/') ? strrchr(paths[k], '/') + 1 : paths[k];
    if (replay_trace_load(paths[k], 0, &t, err, sizeof err) != 0) {
      fprintf(stderr, "sgm-alloc-replay: %s\n", err);
      status = 1;
      continue;
    }
    replay_alloc_params gp = {.growth = true, .sample = true, .vmm = vmm};
    replay_alloc_result g, r;
    double live = (double)t.peak_live_bytes;
    if (replay_alloc(&t, &gp, &g, err, sizeof err) != 0 || !g.served) {
      fprintf(stderr, "sgm-alloc-replay: %s: growth mode: %s\n", name,
              g.served ? err : "an allocation did not land in VRAM");
      status = 1;
      replay_trace_free(&t);
      continue;
    }
    /* Timing: no stats reads in the loop; best of a few fresh contexts. */
    double best = 0, ref = 0;
    gp.sample = false;
    for (int i = 0; i < MAIN_TIMED_RUNS; i++) {
      if (replay_alloc(&t, &gp, &r, err, sizeof err) != 0) break;
      double ns = r.events ? r.seconds * 1e9 / (double)r.events : 0;
      if (i == 0 || ns < best) best = ns;
      double m = main_malloc_ns(&t);
      if (i == 0 || m < ref) ref = m;
    }
    uint64_t budget = 0;
    unsigned runs = 0;
    if (reserve && replay_alloc_min_budget(&t, vmm, &budget, &runs, err, sizeof err) != 0) {
      fprintf(stderr, "sgm-alloc-replay: %s: reserve mode: %s\n", name, err);
      status = 1;
    }
    double gr = (double)g.peak_committed_bytes / live, rr = (double)budget / live;
    printf("%-14s %8llu %9.1fM %6s %9.3f %8.1fM %8.1fM %8.3f %8.1f %8.1f %8u\n", name,
           (unsigned long long)g.events, live / 1048576.0, g.vmm ? "vmm" : "chunks", gr,
           (double)g.idle_committed_bytes / 1048576.0,
           (double)g.trimmed_committed_bytes / 1048576.0, rr, best, ref, runs);
    sum_growth += gr;
    sum_reserve += rr;
    if (gr > max_growth) max_growth = gr;
    if (rr > max_reserve) max_reserve = rr;
    n_done++;
    replay_trace_free(&t);
  }
  if (n_done)
    printf("growth peak committed / peak live: mean %.3f max %.3f; reserve smallest budget / "
           "peak live: mean %.3f max %.3f (%zu traces)\n",
           sum_growth / (double)n_done, max_growth, sum_reserve / (double)n_done, max_reserve,
           n_done);
  for (size_t k = 0; k < n_paths; k++) free(paths[k]);
  return status;
}
