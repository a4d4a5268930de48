/*
 * host.c — the host machine as sgm sees it: physical RAM and the memory limit
 * of the process's cgroup, which together size the shared tier
 * (max(physical RAM / 2, 64 MiB), DESIGN.md §4).
 *
 * Machine RAM is the larger of hwloc's machine total and the kernel's count
 * (sysconf), see sgm__host_machine_ram. The cgroup limit is read
 * from files only, under a root prefix so tests can fake /proc and /sys whole:
 *  - cgroup v2: "0::<path>" in <root>/proc/self/cgroup; the limit is the smallest
 *    memory.max of <root>/sys/fs/cgroup/<path> and its ancestors ("max" = none).
 *  - cgroup v1: "<n>:<...,>memory<,...>:<path>"; the same walk over
 *    memory.limit_in_bytes under <root>/sys/fs/cgroup/memory, where values of
 *    2^62 and above (the kernel's PAGE_COUNTER_MAX rounded to pages) mean none.
 *    A v1 memory line wins over a "0::" line: on hybrid systems the memory
 *    controller is on v1.
 *  - When <path>'s directory does not exist (a container that sees the host's
 *    path but has its own cgroup mounted at the mount root), the mount root's
 *    own file is read instead.
 * Unreadable or malformed files count as "no limit there": a cgroup we cannot
 * read must not stop a context, and the machine's RAM still bounds the result.
 *
 * Pinnable mappings (sgm__host_map_pinnable): the one place both backends get
 * the anonymous memory they page-lock for the shared tier. Two rules live here:
 *  - NUMA placement is preferred, never strict: MPOL_PREFERRED asks for the
 *    node and falls back to others when it is full, where numa_tonode_memory's
 *    MPOL_BIND would make a full node the OOM killer's business instead of a
 *    clean allocation failure (two-socket hosts, small nodes).
 *  - MADV_DONTFORK: a child of fork() does not inherit pinned, device-mapped
 *    chunks (the driver's mapping is not valid there, and copy-on-write of
 *    pinned pages would break the parent's DMA target).
 *
 * Threading: one cached value (hwloc's machine total, probed once under
 * pthread_once); every other call reads the files afresh.
 */
#include <ctype.h>
#include <errno.h>
#include <hwloc.h>
#include <numa.h>
#include <numaif.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* cgroup v1 writes PAGE_COUNTER_MAX (about 2^63) for "no limit"; anything this
 * large is no real limit on any machine. */
#define HOST_V1_UNLIMITED (UINT64_C(1) << 62)

/* Room for a root prefix, the mount and the cgroup path. */
#define HOST_PATH_MAX 4096

/* hwloc's machine total, probed once per process: loading a topology costs
 * milliseconds (it dlopens hwloc's plugins), and contexts are created and
 * destroyed in loops (every sgm_context_create asks). */
static pthread_once_t host_hwloc_once = PTHREAD_ONCE_INIT;
static uint64_t host_hwloc_total;  /* 0: hwloc could not tell */
static unsigned host_hwloc_loads;  /* topologies loaded (tests: at most one) */

static void host_hwloc_probe(void) {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return;
  /* Only the memory of the machine is wanted: skip caches, I/O and the like
   * (types that cannot be filtered are silently kept). */
  hwloc_topology_set_all_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_NONE);
  __atomic_add_fetch(&host_hwloc_loads, 1, __ATOMIC_RELAXED);
  if (hwloc_topology_load(topo) == 0) {
    hwloc_obj_t root = hwloc_get_root_obj(topo);
    if (root) host_hwloc_total = root->total_memory;
  }
  hwloc_topology_destroy(topo);
}

unsigned sgm__host_n_topology_loads(void) { return __atomic_load_n(&host_hwloc_loads, __ATOMIC_RELAXED); }

uint64_t sgm__host_machine_ram(void) {
  pthread_once(&host_hwloc_once, host_hwloc_probe);
  uint64_t total = host_hwloc_total;
  /* The kernel's count (MemTotal) is the authority on how much RAM there is:
   * on some virtual machines hwloc's per-node sums cover only part of it (seen
   * here: 4.4 GB of 24 GB). Take the larger; the cgroup limit, not this,
   * expresses restrictions on the process. */
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  uint64_t kernel = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
  return kernel > total ? kernel : total;
}

static bool host_is_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Read one limit file: true with *limit set when it holds a number; "max" and
 * values at or above v1's "unlimited" give 0 (none). */
static bool host_read_limit(const char *path, uint64_t *limit) {
  FILE *f = fopen(path, "re");
  if (!f) return false;
  char buf[64];
  bool ok = fgets(buf, sizeof buf, f) != NULL;
  fclose(f);
  if (!ok) return false;
  char *p = buf;
  while (isspace((unsigned char)*p)) p++;
  if (strncmp(p, "max", 3) == 0 && (p[3] == '\0' || isspace((unsigned char)p[3]))) {
    *limit = 0;
    return true;
  }
  if (!isdigit((unsigned char)*p)) return false;
  errno = 0;
  char *end;
  unsigned long long v = strtoull(p, &end, 10);
  if (errno == ERANGE) v = ~0ull; /* beyond 2^64: certainly no limit */
  else if (*end && !isspace((unsigned char)*end)) return false;
  *limit = v >= HOST_V1_UNLIMITED ? 0 : (uint64_t)v;
  return true;
}

/* The smallest limit in file `name` of <mount><path> and its ancestors up to
 * <mount>; <mount>/<name> alone when <mount><path> does not exist. 0 = none. */
static uint64_t host_walk(const char *mount, const char *cg_path, const char *name) {
  char dir[HOST_PATH_MAX], file[HOST_PATH_MAX + 64];
  size_t mlen = strlen(mount);
  /* cg_path is absolute ("/a/b"); drop a trailing slash so the walk ends at "". */
  int n = snprintf(dir, sizeof dir, "%s%s", mount, cg_path);
  if (n < 0 || (size_t)n >= sizeof dir) return 0;
  size_t len = (size_t)n;
  while (len > mlen && dir[len - 1] == '/') dir[--len] = '\0';
  if (!host_is_dir(dir)) {
    len = mlen;
    dir[len] = '\0';
  }
  uint64_t best = 0;
  for (;;) {
    uint64_t v;
    snprintf(file, sizeof file, "%s/%s", dir, name);
    if (host_read_limit(file, &v) && v && (best == 0 || v < best)) best = v;
    if (len <= mlen) break;
    /* Up one level, never above the mount. */
    while (len > mlen && dir[len - 1] != '/') len--;
    while (len > mlen && dir[len - 1] == '/') len--;
    dir[len] = '\0';
  }
  return best;
}

/* True when the comma-separated controller list names "memory". */
static bool host_has_memory_controller(const char *list, size_t n) {
  const char *p = list, *end = list + n;
  while (p < end) {
    const char *c = memchr(p, ',', (size_t)(end - p));
    size_t len = c ? (size_t)(c - p) : (size_t)(end - p);
    if (len == 6 && memcmp(p, "memory", 6) == 0) return true;
    p += len + 1;
  }
  return false;
}

int sgm__host_cgroup_limit(const char *root, uint64_t *out) {
  if (out) *out = 0;
  if (!out) return sgm__error_set(SGM_ERR_INVALID, "sgm__host_cgroup_limit: out is NULL");
  if (!root) root = "";
  char path[HOST_PATH_MAX];
  int n = snprintf(path, sizeof path, "%s/proc/self/cgroup", root);
  if (n < 0 || (size_t)n >= sizeof path)
    return sgm__error_set(SGM_ERR_INVALID, "cgroup root \"%.64s...\" is too long", root);
  FILE *f = fopen(path, "re");
  if (!f) return SGM_OK; /* no cgroups here: no limit */
  char line[HOST_PATH_MAX], v1_path[HOST_PATH_MAX] = "", v2_path[HOST_PATH_MAX] = "";
  bool have_v1 = false, have_v2 = false;
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    /* hierarchy-id:controller-list:path; the path itself may contain ':'. */
    char *c1 = strchr(line, ':');
    char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c2 || c2[1] != '/') continue;
    const char *cg = c2 + 1;
    size_t ctl_len = (size_t)(c2 - (c1 + 1));
    if (!have_v1 && host_has_memory_controller(c1 + 1, ctl_len)) {
      snprintf(v1_path, sizeof v1_path, "%s", cg);
      have_v1 = true;
    } else if (!have_v2 && ctl_len == 0 && c1 - line == 1 && line[0] == '0') {
      snprintf(v2_path, sizeof v2_path, "%s", cg);
      have_v2 = true;
    }
  }
  fclose(f);
  char mount[HOST_PATH_MAX];
  if (have_v1) {
    snprintf(mount, sizeof mount, "%s/sys/fs/cgroup/memory", root);
    *out = host_walk(mount, v1_path, "memory.limit_in_bytes");
  } else if (have_v2) {
    snprintf(mount, sizeof mount, "%s/sys/fs/cgroup", root);
    *out = host_walk(mount, v2_path, "memory.max");
  }
  return SGM_OK;
}

uint64_t sgm__host_physical_ram(const char *root) {
  uint64_t machine = sgm__host_machine_ram(), limit = 0;
  if (sgm__host_cgroup_limit(root, &limit) != SGM_OK) limit = 0;
  if (limit && (machine == 0 || limit < machine)) return limit;
  return machine;
}

int sgm__host_map_pinnable(uint64_t bytes, int node, void **out) {
  *out = NULL;
  void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    char b[32];
    return sgm__error_set(SGM_ERR_NOMEM, "cannot map %s of host memory to pin: mmap failed: %s",
                          sgm__fmt_bytes(bytes, b, sizeof b), strerror(e));
  }
  if (madvise(p, (size_t)bytes, MADV_DONTFORK) != 0) {
    int e = errno;
    munmap(p, (size_t)bytes);
    return sgm__error_set(SGM_ERR_BACKEND, "cannot keep pinned host memory out of fork() children: "
                          "madvise(MADV_DONTFORK) failed: %s", strerror(e));
  }
  /* Before the pages are touched: pinning faults them in where the policy says.
   * A refused policy (no NUMA support, a cpuset without the node) only costs
   * locality, so it is not an error. */
  if (node >= 0 && numa_available() >= 0 && node <= numa_max_node()) {
    struct bitmask *mask = numa_allocate_nodemask();
    if (mask) {
      numa_bitmask_setbit(mask, (unsigned)node);
      (void)mbind(p, (unsigned long)bytes, MPOL_PREFERRED, mask->maskp, mask->size + 1, 0);
      numa_free_nodemask(mask);
    }
  }
  *out = p;
  return SGM_OK;
}
