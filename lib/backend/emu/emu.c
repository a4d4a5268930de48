/*
 * emu.c — the emulated device (SGM_BACKEND=emu).
 *
 * "VRAM" is host memory of a fixed size (SGM_EMU_VRAM): each device allocation
 * is its own anonymous mapping, committed by the OS only when touched, and the
 * device's free memory is the fixed size minus what is allocated. The rest of
 * sgm never dereferences these addresses except through copy(), as on a real
 * GPU. Pinned host memory is real: mapped as the CUDA backend maps it
 * (sgm__host_map_pinnable: NUMA node preferred, MADV_DONTFORK) and page-locked
 * with mlock, so the shared tier's commit cost and RLIMIT_MEMLOCK behaviour
 * are the real ones. Its device address is its
 * host address (unified addressing).
 *
 * Fault injection for tests: with emu_fail_at = N > 0, the Nth fallible call
 * (open counts as the first) fails as the driver would.
 *
 * Events: complete when recorded (all work is synchronous); each is a small
 * heap token so that leaks are visible.
 *
 * A named device (SGM_EMU_DEVICE) is shared by every process that opens it:
 * its size is the one its first process set, and each device allocation is
 * taken from the capacity the node registry counts across them all, so "the
 * device is full because of others" happens here as on a GPU.
 *
 * Managed memory (see "Managed memory" in backend.h and emu_managed_* below):
 * every managed range is one memfd under one stable address, each page placed
 * on the device or the host (counted against the device's size when on the
 * device); a move changes where its pages are counted and never copies, so a
 * host write racing it is kept, as CUDA Unified Memory keeps it (issue 29).
 *
 * Expandable VRAM (vmm_*): a range is a PROT_NONE reservation of address
 * space; mapping a granule maps fresh anonymous read-write memory over it
 * (MAP_FIXED), unmapping puts PROT_NONE back and gives the pages to the OS, so
 * committed bytes cost what they cost on a GPU and a stray access to an
 * unmapped granule faults. Granules count against the device's size like
 * device_alloc memory; a map that would pass it is SGM_ERR_NOMEM.
 *
 * Reserve mode's pool (vmm_pool_*): one memfd of the budget's granules, taken
 * (counted against the device) at create; a pool granule is mapped with
 * MAP_SHARED | MAP_FIXED at its memfd offset and put back to PROT_NONE on
 * unmap, so its bytes survive an unmap and a wrong index shows as wrong bytes.
 *
 * Threading: counters are updated under one mutex; copies run unlocked (but
 * the moves of managed pages, done under the mutex: a test device).
 */
#include <errno.h>
#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "backend/backend.h"
#include "internal.h"

/* Page granularity of the OS mappings behind every emulated allocation. */
#define EMU_PAGE 4096u

struct sgm_backend {
  sgm_lock mu;                 /* guards everything below (rank SGM_LOCK_BACKEND) */
  uint64_t total_bytes;        /* the emulated device's memory size */
  uint64_t fail_at;            /* fail the call with this number; 0 = never */
  int verbose;                 /* log level from the config */
  bool has_managed;            /* SGM_EMU_MANAGED: Unified Memory is offered */
  sgm_backend_counters c;      /* live bytes and call count */
  struct emu_event *events;    /* live event tokens (freed by close) */
  char name[SGM_NAME_MAX];     /* SGM_EMU_DEVICE: a device shared by processes; "" = private */
  struct sgm_node *node;       /* the registry sharing its capacity (node_attach); NULL = private */
  struct emu_managed *managed; /* live managed ranges (freed by close) */
  struct emu_range *ranges;    /* reserved VMM ranges (freed by close) */
};

/* Expandable VRAM: the granule of emulated VMM ranges, 2 MiB like a GPU's
 * (cuMemGetAllocationGranularity on every NVIDIA GPU since Pascal). */
#define EMU_VMM_GRANULE (UINT64_C(2) << 20)

/* A reserved VMM range. */
typedef struct emu_range {
  uint64_t base;               /* first address (granule aligned) */
  uint64_t bytes;              /* reserved bytes (a multiple of the granule) */
  void *map_base;              /* the reservation as mmap returned it (for munmap) */
  uint64_t map_bytes;          /* its length */
  uint8_t *mapped;             /* one byte per granule: 1 = the first of a vmm_map mapping,
                                  3 = a later granule of one, 2 = a pool granule */
  uint32_t *pidx;              /* per granule: the pool granule mapped there (state 2); NULL until
                                  a pool maps into the range */
  struct emu_pool *pool;       /* the pool mapped into it (state 2 granules), NULL none yet */
  struct emu_range *next;      /* the backend's list */
} emu_range;

/* Reserve mode's pool of physical granules (vmm_pool_*): one memfd of n
 * granules, so that a granule mapped again shows what was written to it and a
 * wrong pool index shows as wrong bytes. */
typedef struct emu_pool {
  int fd;                      /* the memfd holding the granules */
  uint64_t n;                  /* granules */
  uint8_t *used;               /* one byte per granule: 1 = mapped in some range now */
} emu_pool;

static void emu_vmm_close_ranges(sgm_backend *be);

/* An event token: see "Events" below. */
typedef struct emu_event {
  void *stream;                /* the stream it was recorded on (never dereferenced) */
  struct emu_event *prev;      /* neighbours in the backend's list of live events */
  struct emu_event *next;
} emu_event;

/* Count one fallible call; true when the fault knob says this one fails. */
static bool emu_inject(sgm_backend *be) {
  sgm__lock_take(&be->mu);
  uint64_t n = ++be->c.n_calls;
  sgm__lock_drop(&be->mu);
  return be->fail_at != 0 && n == be->fail_at;
}

static void emu_managed_close(sgm_backend *be);

static int emu_open(const sgm_config *cfg, sgm_backend **out) {
  sgm__lock_assert_none_held();
  *out = NULL;
  /* open() is call number 1 for the fault knob. */
  if (cfg->emu_fail_at == 1)
    return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure of call 1 (open)");
  if (cfg->emu_vram_bytes < SGM_DEVICE_ALIGN)
    return sgm__error_set(SGM_ERR_INVALID,
                          "emulated device: SGM_EMU_VRAM=%llu bytes is too small (at least %u)",
                          (unsigned long long)cfg->emu_vram_bytes, SGM_DEVICE_ALIGN);
  sgm_backend *be = calloc(1, sizeof *be);
  if (!be) return sgm__error_set(SGM_ERR_NOMEM, "emulated device: out of host memory");
  sgm__lock_init(&be->mu, SGM_LOCK_BACKEND);
  be->total_bytes = cfg->emu_vram_bytes;
  be->fail_at = cfg->emu_fail_at;
  be->verbose = cfg->verbose;
  be->has_managed = cfg->emu_managed != 0;
  be->c.n_calls = 1;
  snprintf(be->name, sizeof be->name, "%s", cfg->emu_device);
  *out = be;
  return SGM_OK;
}

static void emu_close(sgm_backend *be) {
  sgm__lock_assert_none_held();
  if (!be) return;
  if (be->c.n_device_live || be->c.n_host_live || be->c.n_events_live || be->c.n_managed_live)
    sgm__log(be->verbose, 1,
             "emulated device closed with %llu device, %llu host and %llu managed allocations and "
             "%llu events live",
             (unsigned long long)be->c.n_device_live, (unsigned long long)be->c.n_host_live,
             (unsigned long long)be->c.n_managed_live, (unsigned long long)be->c.n_events_live);
  emu_vmm_close_ranges(be);
  while (be->events) {
    emu_event *ev = be->events;
    be->events = ev->next;
    free(ev);
  }
  emu_managed_close(be);
  sgm__lock_destroy(&be->mu);
  free(be);
}

static int emu_mem_info(sgm_backend *be, uint64_t *free_bytes, uint64_t *total_bytes) {
  sgm__lock_assert_none_held();
  *free_bytes = 0;
  *total_bytes = 0;
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (mem_info)");
  if (be->node) {
    /* Shared: free is what every attached process left. */
    uint64_t used = 0;
    int rc = sgm__node_device_used(be->node, &used);
    if (rc != SGM_OK) return rc;
    *free_bytes = used < be->total_bytes ? be->total_bytes - used : 0;
    *total_bytes = be->total_bytes;
    return SGM_OK;
  }
  sgm__lock_take(&be->mu);
  *free_bytes = be->total_bytes - be->c.device_live_bytes - be->c.managed_device_bytes;
  *total_bytes = be->total_bytes;
  sgm__lock_drop(&be->mu);
  return SGM_OK;
}

/* Device memory not taken by allocations nor by managed pages placed there. */
static uint64_t emu_device_free_locked(const sgm_backend *be) {
  return be->total_bytes - be->c.device_live_bytes - be->c.managed_device_bytes;
}

static uint64_t emu_accounted(uint64_t bytes) { return sgm__align_up(bytes, SGM_DEVICE_ALIGN); }

static int emu_device_alloc(sgm_backend *be, uint64_t bytes, sgm_devptr *out) {
  sgm__lock_assert_none_held();
  *out = 0;
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (device_alloc)");
  if (bytes == 0) return sgm__error_set(SGM_ERR_INVALID, "emulated device: device_alloc of 0 bytes");
  uint64_t acc = emu_accounted(bytes);
  uint64_t free_now = 0;
  bool fits;
  if (be->node) {
    /* Shared device: the registry holds every process's bytes. */
    int rc = sgm__node_device_reserve(be->node, acc, be->total_bytes, &free_now);
    if (rc != SGM_OK && rc != SGM_ERR_NOMEM) return rc;
    fits = rc == SGM_OK;
    if (fits) {
      sgm__lock_take(&be->mu);
      be->c.device_live_bytes += acc;
      be->c.n_device_live++;
      sgm__lock_drop(&be->mu);
    }
  } else {
    sgm__lock_take(&be->mu);
    fits = acc <= emu_device_free_locked(be);
    if (fits) {
      be->c.device_live_bytes += acc;
      be->c.n_device_live++;
    }
    free_now = emu_device_free_locked(be);
    sgm__lock_drop(&be->mu);
  }
  if (!fits) {
    char a[32], f[32];
    return sgm__error_set(SGM_ERR_NOMEM, "emulated device%s%s: out of memory allocating %s (%s free%s)",
                          be->node ? " " : "", be->name, sgm__fmt_bytes(acc, a, sizeof a),
                          sgm__fmt_bytes(free_now, f, sizeof f),
                          be->node ? " after every process sharing it" : "");
  }
  /* MAP_NORESERVE: like VRAM reserved but untouched, it costs no RAM until used. */
  void *p = mmap(NULL, sgm__align_up(bytes, EMU_PAGE), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    sgm__lock_take(&be->mu);
    be->c.device_live_bytes -= acc;
    be->c.n_device_live--;
    sgm__lock_drop(&be->mu);
    if (be->node) sgm__node_device_release(be->node, acc);
    return sgm__error_set(SGM_ERR_NOMEM, "emulated device: mmap of %llu bytes failed: %s",
                          (unsigned long long)bytes, strerror(e));
  }
  *out = (sgm_devptr)(uintptr_t)p;
  return SGM_OK;
}

static void emu_device_free(sgm_backend *be, sgm_devptr ptr, uint64_t bytes) {
  sgm__lock_assert_none_held();
  if (!ptr) return;
  munmap((void *)(uintptr_t)ptr, sgm__align_up(bytes, EMU_PAGE));
  sgm__lock_take(&be->mu);
  sgm_assert(be->c.n_device_live > 0 && be->c.device_live_bytes >= emu_accounted(bytes));
  be->c.device_live_bytes -= emu_accounted(bytes);
  be->c.n_device_live--;
  sgm__lock_drop(&be->mu);
  if (be->node) sgm__node_device_release(be->node, emu_accounted(bytes));
}

static int emu_host_alloc(sgm_backend *be, uint64_t bytes, int numa_node, void **host_out,
                          sgm_devptr *dev_out) {
  sgm__lock_assert_none_held();
  *host_out = NULL;
  *dev_out = 0;
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (host_alloc)");
  if (bytes == 0) return sgm__error_set(SGM_ERR_INVALID, "emulated device: host_alloc of 0 bytes");
  size_t len = sgm__align_up(bytes, EMU_PAGE);
  /* "The device's node": an emulated device sits next to the calling CPU. */
  if (numa_node < 0 && numa_available() >= 0) {
    int cpu = sched_getcpu();
    numa_node = cpu >= 0 ? numa_node_of_cpu(cpu) : -1;
  }
  /* Placed (by preference) before mlock faults the pages in. */
  void *p = NULL;
  int rc = sgm__host_map_pinnable(len, numa_node, &p);
  if (rc != SGM_OK) return rc;
  if (mlock(p, len) != 0) {
    int e = errno;
    munmap(p, len);
    struct rlimit rl = {0, 0};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    char a[32], l[32];
    return sgm__error_set(
        SGM_ERR_NOMEM,
        "cannot page-lock %s of host memory: %s; RLIMIT_MEMLOCK is %s "
        "(raise it with `ulimit -l unlimited`, a memlock line in /etc/security/limits.conf, "
        "or docker run --ulimit memlock=-1)",
        sgm__fmt_bytes(len, a, sizeof a), strerror(e),
        rl.rlim_cur == RLIM_INFINITY ? "unlimited" : sgm__fmt_bytes(rl.rlim_cur, l, sizeof l));
  }
  sgm__lock_take(&be->mu);
  be->c.host_live_bytes += len;
  be->c.n_host_live++;
  sgm__lock_drop(&be->mu);
  *host_out = p;
  *dev_out = (sgm_devptr)(uintptr_t)p;
  return SGM_OK;
}

static void emu_host_free(sgm_backend *be, void *host, uint64_t bytes) {
  sgm__lock_assert_none_held();
  if (!host) return;
  size_t len = sgm__align_up(bytes, EMU_PAGE);
  munlock(host, len);
  munmap(host, len);
  sgm__lock_take(&be->mu);
  sgm_assert(be->c.n_host_live > 0 && be->c.host_live_bytes >= len);
  be->c.host_live_bytes -= len;
  be->c.n_host_live--;
  sgm__lock_drop(&be->mu);
}

static int emu_copy(sgm_backend *be, sgm_copy_kind kind, uint64_t dst, uint64_t src, uint64_t n,
                    void *stream) {
  sgm__lock_assert_none_held();
  (void)stream; /* the emulated device completes every copy before returning */
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (copy)");
  if (kind > SGM_COPY_DEVICE_TO_DEVICE)
    return sgm__error_set(SGM_ERR_INVALID, "emulated device: bad copy kind %d", (int)kind);
  if (n == 0) return SGM_OK;
  if (!dst || !src) return sgm__error_set(SGM_ERR_INVALID, "emulated device: copy with a NULL address");
  memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  return SGM_OK;
}

/*
 * Events: every emulated copy is finished before copy() returns, so no work is
 * ever pending and an event is complete the moment it is recorded. The token
 * is still a real heap object so that a leaked event shows in n_events_live
 * (and to leak checkers).
 */

static int emu_event_record(sgm_backend *be, void *stream, void **event_out) {
  sgm__lock_assert_none_held();
  *event_out = NULL;
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (event_record)");
  emu_event *ev = malloc(sizeof *ev);
  if (!ev) return sgm__error_set(SGM_ERR_NOMEM, "emulated device: out of host memory recording an event");
  ev->stream = stream;
  ev->prev = NULL;
  sgm__lock_take(&be->mu);
  ev->next = be->events;
  if (be->events) be->events->prev = ev;
  be->events = ev;
  be->c.n_events_live++;
  sgm__lock_drop(&be->mu);
  *event_out = ev;
  return SGM_OK;
}

static int emu_event_query(sgm_backend *be, void *event) {
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (event_query)");
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "emulated device: event_query of a NULL event");
  return 1;
}

static int emu_event_wait(sgm_backend *be, void *event) {
  sgm__lock_assert_none_held();
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (event_wait)");
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "emulated device: event_wait on a NULL event");
  return SGM_OK;
}

static void emu_event_destroy(sgm_backend *be, void *event) {
  if (!event) return;
  emu_event *ev = event;
  sgm__lock_take(&be->mu);
  sgm_assert(be->c.n_events_live > 0);
  if (ev->prev) ev->prev->next = ev->next;
  else be->events = ev->next;
  if (ev->next) ev->next->prev = ev->prev;
  be->c.n_events_live--;
  sgm__lock_drop(&be->mu);
  free(ev);
}

/* Every stream is one here: work on any of them is finished before the call
 * that queued it returns, so nothing is ever ordered behind anything. */
static void emu_stream_ref(sgm_backend *be, void *stream, sgm_stream_ref *out) {
  sgm__lock_assert_none_held();
  (void)be;
  out->key = 0;
  out->handle = stream;
}

static int emu_event_create(sgm_backend *be, void **event_out) {
  sgm__lock_assert_none_held();
  return emu_event_record(be, NULL, event_out);
}

static int emu_event_record_on(sgm_backend *be, void *event, const sgm_stream_ref *stream) {
  sgm__lock_assert_none_held();
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (event_record_on)");
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "emulated device: event_record_on of a NULL event");
  ((emu_event *)event)->stream = stream->handle;
  return SGM_OK;
}

static int emu_stream_wait_event(sgm_backend *be, const sgm_stream_ref *stream, void *event) {
  sgm__lock_assert_none_held();
  (void)stream;
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (stream_wait_event)");
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "emulated device: stream_wait_event on a NULL event");
  return SGM_OK;
}

/* The managed move queue (issue 14): the emulated device's work is done when
 * a call returns, so the copy stream has nothing to wait for. */
static int emu_copy_stream_wait_event(sgm_backend *be, void *event) {
  sgm__lock_assert_none_held();
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (copy_stream_wait_event)");
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "emulated device: copy_stream_wait_event on a NULL event");
  return SGM_OK;
}

static int emu_stream_transfer(sgm_backend *be, void *event, const sgm_stream_ref *owner,
                               const sgm_stream_ref *taker) {
  sgm__lock_assert_none_held();
  (void)owner;
  (void)taker;
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (stream_transfer)");
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "emulated device: stream_transfer with a NULL event");
  return SGM_OK;
}

/*
 * Managed memory. A range is reserved as one mapping at a stable, page
 * aligned address, over one memfd store; each SGM_MANAGED_PAGE page has a
 * placement (device, host, or nowhere yet) that the backend counts, the
 * device-placed pages against the emulated device's size. Pages never
 * prefetched are placed nowhere (CUDA places a page on first touch; sgm
 * prefetches every block it hands out).
 *
 *   view   [dev][dev][host][host][dev]...   one address, what users touch
 *   store  [ 0 ][ 1 ][ 2  ][ 3  ][ 4 ]      the same bytes, wherever placed
 *
 * A move changes the placement of its pages (and what the device has free)
 * and touches neither the bytes nor the mapping: a host write that races a
 * move of its block lands in the only copy there is and is kept — Unified
 * Memory's promise. (Until issue 29 a move copied between two stores, then
 * re-mapped: a write between the copy and the re-map went to the old store
 * and was lost. Re-mapping the same pages in place keeps the writes too, but
 * an mmap over a range is a write of all of it to ThreadSanitizer, which
 * then reports the owner's concurrent accesses as races with the mover.)
 * Everything here runs under be->mu.
 */

enum { EMU_AT_DEVICE = 0, EMU_AT_HOST = 1, EMU_AT_NONE = 2 };
/* Advice bits per page. */
#define EMU_ADV_PREFER_DEVICE 1u
#define EMU_ADV_PREFER_HOST 2u
#define EMU_ADV_ACCESSED_BY 4u

typedef struct emu_managed {
  uintptr_t base;           /* the stable address users see */
  uint64_t len;             /* bytes, a multiple of SGM_MANAGED_PAGE */
  int fd;                   /* the store (memfd) every page of the range lives in */
  uint8_t *at;              /* per page: EMU_AT_DEVICE / _HOST / _NONE */
  uint8_t *advice;          /* per page: EMU_ADV_* bits */
  struct emu_managed *next; /* the backend's list of live ranges */
} emu_managed;

static void emu_managed_destroy(emu_managed *m) {
  if (m->fd >= 0) close(m->fd);
  if (m->base) munmap((void *)m->base, m->len);
  free(m->at);
  free(m->advice);
  free(m);
}

/* Bytes of m's pages at where. */
static uint64_t emu_managed_count(const emu_managed *m, int where) {
  uint64_t n = 0;
  for (uint64_t i = 0; i < m->len / SGM_MANAGED_PAGE; i++) n += m->at[i] == where;
  return n * SGM_MANAGED_PAGE;
}

static void emu_managed_close(sgm_backend *be) {
  while (be->managed) {
    emu_managed *m = be->managed;
    be->managed = m->next;
    emu_managed_destroy(m);
  }
}

/* The live range holding [ptr, ptr + n) (be->mu held); NULL if none holds it whole. */
static emu_managed *emu_managed_find_locked(sgm_backend *be, uint64_t ptr, uint64_t n) {
  for (emu_managed *m = be->managed; m; m = m->next)
    if (ptr >= m->base && ptr - m->base < m->len) return n <= m->len - (ptr - m->base) ? m : NULL;
  return NULL;
}

static int emu_managed_support(sgm_backend *be) {
  sgm__lock_assert_none_held();
  if (be->has_managed) return SGM_OK;
  return sgm__error_set(SGM_ERR_UNSUPPORTED, "the emulated device has no concurrent managed access "
                        "(SGM_EMU_MANAGED=off), as a GPU before Pascal or a driver without Unified "
                        "Memory");
}

static int emu_managed_alloc(sgm_backend *be, uint64_t bytes, sgm_devptr *out) {
  sgm__lock_assert_none_held();
  *out = 0;
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (managed_alloc)");
  if (bytes == 0) return sgm__error_set(SGM_ERR_INVALID, "emulated device: managed_alloc of 0 bytes");
  uint64_t len = sgm__align_up(bytes, SGM_MANAGED_PAGE);
  uint64_t pages = len / SGM_MANAGED_PAGE;
  emu_managed *m = calloc(1, sizeof *m);
  if (!m) return sgm__error_set(SGM_ERR_NOMEM, "emulated device: out of host memory");
  m->len = len;
  m->fd = -1;
  m->at = malloc(pages);
  m->advice = calloc(pages, 1);
  const char *what = "out of host memory";
  int e = ENOMEM;
  if (!m->at || !m->advice) goto out_fail;
  memset(m->at, EMU_AT_NONE, pages);
  what = "memfd_create";
  m->fd = memfd_create("sgm-emu-managed", MFD_CLOEXEC);
  if (m->fd < 0) goto out_errno;
  what = "ftruncate";
  if (ftruncate(m->fd, (off_t)len) != 0) goto out_errno;
  what = "mmap";
  /* Reserve len + a page, keep the aligned part, map the store there. */
  char *r = mmap(NULL, len + SGM_MANAGED_PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) goto out_errno;
  uintptr_t base = sgm__align_up((uintptr_t)r, SGM_MANAGED_PAGE);
  if (base > (uintptr_t)r) munmap(r, base - (uintptr_t)r);
  uintptr_t end = (uintptr_t)r + len + SGM_MANAGED_PAGE;
  if (end > base + len) munmap((void *)(base + len), end - (base + len));
  if (mmap((void *)base, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, m->fd, 0) ==
      MAP_FAILED) {
    e = errno;
    munmap((void *)base, len);
    goto out_fail;
  }
  m->base = base;
  sgm__lock_take(&be->mu);
  m->next = be->managed;
  be->managed = m;
  be->c.n_managed_live++;
  sgm__lock_drop(&be->mu);
  *out = base;
  return SGM_OK;

out_errno:
  e = errno;
out_fail:
  emu_managed_destroy(m);
  return sgm__error_set(SGM_ERR_NOMEM, "emulated device: managed_alloc of %llu bytes: %s failed: %s",
                        (unsigned long long)bytes, what, strerror(e));
}

static void emu_managed_free(sgm_backend *be, sgm_devptr ptr, uint64_t bytes) {
  sgm__lock_assert_none_held();
  if (!ptr) return;
  sgm__lock_take(&be->mu);
  emu_managed **pp = &be->managed;
  while (*pp && (*pp)->base != ptr) pp = &(*pp)->next;
  emu_managed *m = *pp;
  sgm_assert(m && m->len == sgm__align_up(bytes, SGM_MANAGED_PAGE));
  if (m) {
    *pp = m->next;
    be->c.n_managed_live--;
    be->c.managed_device_bytes -= emu_managed_count(m, EMU_AT_DEVICE);
    be->c.managed_host_bytes -= emu_managed_count(m, EMU_AT_HOST);
  }
  sgm__lock_drop(&be->mu);
  if (m) emu_managed_destroy(m);
}

static int emu_managed_advise(sgm_backend *be, sgm_devptr ptr, uint64_t n, sgm_managed_advice advice) {
  sgm__lock_assert_none_held();
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (managed_advise)");
  if (advice > SGM_ADVISE_UNSET_ACCESSED_BY)
    return sgm__error_set(SGM_ERR_INVALID, "emulated device: bad advice %d", (int)advice);
  sgm__lock_take(&be->mu);
  emu_managed *m = emu_managed_find_locked(be, ptr, n);
  if (!m || n == 0) {
    sgm__lock_drop(&be->mu);
    return sgm__error_set(SGM_ERR_INVALID, "emulated device: advice on [0x%llx, +%llu), which is "
                          "not inside one managed range", (unsigned long long)ptr,
                          (unsigned long long)n);
  }
  uint64_t p0 = (ptr - m->base) / SGM_MANAGED_PAGE;
  uint64_t p1 = sgm__align_up(ptr - m->base + n, SGM_MANAGED_PAGE) / SGM_MANAGED_PAGE;
  for (uint64_t i = p0; i < p1; i++) {
    uint8_t *a = &m->advice[i];
    switch (advice) {
    case SGM_ADVISE_PREFER_DEVICE: *a = (uint8_t)((*a & ~EMU_ADV_PREFER_HOST) | EMU_ADV_PREFER_DEVICE); break;
    case SGM_ADVISE_PREFER_HOST: *a = (uint8_t)((*a & ~EMU_ADV_PREFER_DEVICE) | EMU_ADV_PREFER_HOST); break;
    case SGM_ADVISE_ACCESSED_BY: *a |= EMU_ADV_ACCESSED_BY; break;
    case SGM_ADVISE_UNSET_ACCESSED_BY: *a &= (uint8_t)~EMU_ADV_ACCESSED_BY; break;
    }
  }
  sgm__lock_drop(&be->mu);
  return SGM_OK;
}

/* Place pages [p0, p1) of m at `to` (EMU_AT_DEVICE / _HOST), a run of
 * neighbours placed alike at a time (see "Managed memory" above: nothing is
 * copied or re-mapped, no write is lost; be->mu held). */
static int emu_managed_move_locked(sgm_backend *be, emu_managed *m, uint64_t p0, uint64_t p1, int to) {
  uint64_t i = p0;
  bool moved = false;
  while (i < p1) {
    if (m->at[i] == to) {
      i++;
      continue;
    }
    uint64_t j = i + 1;
    while (j < p1 && m->at[j] != to && m->at[j] == m->at[i]) j++;
    uint64_t len = (j - i) * SGM_MANAGED_PAGE;
    for (uint64_t k = i; k < j; k++) {
      if (m->at[k] == EMU_AT_DEVICE) be->c.managed_device_bytes -= SGM_MANAGED_PAGE;
      if (m->at[k] == EMU_AT_HOST) be->c.managed_host_bytes -= SGM_MANAGED_PAGE;
      m->at[k] = (uint8_t)to;
    }
    if (to == EMU_AT_DEVICE) be->c.managed_device_bytes += len;
    else be->c.managed_host_bytes += len;
    moved = true;
    i = j;
  }
  if (moved) be->c.n_managed_moves++;
  return SGM_OK;
}

static int emu_managed_prefetch(sgm_backend *be, sgm_devptr ptr, uint64_t n, sgm_tier to, void *stream) {
  sgm__lock_assert_none_held();
  (void)stream; /* done before returning, like every emulated copy */
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (managed_prefetch)");
  if (to != SGM_TIER_VRAM && to != SGM_TIER_SHARED)
    return sgm__error_set(SGM_ERR_INVALID, "emulated device: prefetch to tier %d (only VRAM or shared "
                          "memory hold managed pages)", (int)to);
  sgm__lock_take(&be->mu);
  emu_managed *m = emu_managed_find_locked(be, ptr, n);
  int rc = SGM_OK;
  if (!m || n == 0) {
    rc = sgm__error_set(SGM_ERR_INVALID, "emulated device: prefetch of [0x%llx, +%llu), which is "
                        "not inside one managed range", (unsigned long long)ptr, (unsigned long long)n);
    goto out;
  }
  uint64_t p0 = (ptr - m->base) / SGM_MANAGED_PAGE;
  uint64_t p1 = sgm__align_up(ptr - m->base + n, SGM_MANAGED_PAGE) / SGM_MANAGED_PAGE;
  int dst = to == SGM_TIER_VRAM ? EMU_AT_DEVICE : EMU_AT_HOST;
  if (dst == EMU_AT_DEVICE) {
    uint64_t need = 0;
    for (uint64_t i = p0; i < p1; i++) need += m->at[i] != EMU_AT_DEVICE ? SGM_MANAGED_PAGE : 0;
    if (need > emu_device_free_locked(be)) {
      char a[32], f[32];
      rc = sgm__error_set(SGM_ERR_NOMEM, "emulated device: prefetching %s of managed memory to the "
                          "device would oversubscribe it (%s free); the driver would evict pages on "
                          "its own, which sgm must never make it do",
                          sgm__fmt_bytes(need, a, sizeof a),
                          sgm__fmt_bytes(emu_device_free_locked(be), f, sizeof f));
      goto out;
    }
  }
  rc = emu_managed_move_locked(be, m, p0, p1, dst);
out:
  sgm__lock_drop(&be->mu);
  return rc;
}

static void emu_counters(sgm_backend *be, sgm_backend_counters *out) {
  sgm__lock_assert_none_held();
  sgm__lock_take(&be->mu);
  *out = be->c;
  sgm__lock_drop(&be->mu);
}

/* ---- The node registry: a named emulated device is shared by processes. ---- */
static void emu_device_key(sgm_backend *be, char *out, size_t len) {
  sgm__lock_assert_none_held();
  if (be->name[0]) snprintf(out, len, "emu-%s", be->name);
  else if (len) out[0] = '\0';
}

static void emu_node_attach(sgm_backend *be, struct sgm_node *node) {
  sgm__lock_assert_none_held();
  sgm_assert(be->c.n_device_live == 0);
  uint64_t total = sgm__node_device_total(node);
  if (total != be->total_bytes)
    sgm__log(be->verbose, 2, "emulated device %s: %llu bytes, as its first process set (this "
             "one asked for %llu with SGM_EMU_VRAM)", be->name, (unsigned long long)total,
             (unsigned long long)be->total_bytes);
  be->total_bytes = total;
  be->node = node;
}

/* ---- The device's identity (issue 13): a UUID derived from its name, so
 * every process that opens SGM_EMU_DEVICE=NAME sees the same one; a private
 * (unnamed) device is named EMU_DEFAULT_NAME for this. No PCI bus id. ---- */
#define EMU_DEFAULT_NAME "sgm-emulated-device"

static int emu_device_uuid(sgm_backend *be, uint8_t out[16]) {
  sgm__lock_assert_none_held();
  sgm__node_uuid_derive(be->name[0] ? be->name : EMU_DEFAULT_NAME, out);
  return SGM_OK;
}

static void emu_device_pci_bus_id(sgm_backend *be, char *out, size_t len) {
  sgm__lock_assert_none_held();
  (void)be;
  if (len) out[0] = '\0';
}

/* ---- expandable VRAM (issue 17) ---- */

static int emu_vmm_granularity(sgm_backend *be, uint64_t *bytes_out) {
  sgm__lock_assert_none_held();
  (void)be;
  *bytes_out = EMU_VMM_GRANULE;
  return SGM_OK;
}

static int emu_vmm_reserve(sgm_backend *be, uint64_t bytes, void **range_out, sgm_devptr *base_out) {
  sgm__lock_assert_none_held();
  *range_out = NULL;
  *base_out = 0;
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (vmm_reserve)");
  if (bytes == 0 || bytes % EMU_VMM_GRANULE)
    return sgm__error_set(SGM_ERR_INVALID, "emulated device: vmm_reserve of %llu bytes, not a "
                          "positive multiple of the %llu-byte granule", (unsigned long long)bytes,
                          (unsigned long long)EMU_VMM_GRANULE);
  emu_range *r = calloc(1, sizeof *r);
  uint8_t *mapped = calloc(bytes / EMU_VMM_GRANULE, 1);
  /* One granule more, so that the range can start on a granule boundary. */
  uint64_t len = bytes + EMU_VMM_GRANULE;
  void *p = r && mapped ? mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                               -1, 0)
                        : MAP_FAILED;
  if (p == MAP_FAILED) {
    int e = errno;
    free(r);
    free(mapped);
    return sgm__error_set(SGM_ERR_NOMEM, "emulated device: cannot reserve %llu bytes of address "
                          "space: %s", (unsigned long long)bytes, r && mapped ? strerror(e)
                                                                            : "out of host memory");
  }
  r->map_base = p;
  r->map_bytes = len;
  r->base = sgm__align_up((uint64_t)(uintptr_t)p, EMU_VMM_GRANULE);
  r->bytes = bytes;
  r->mapped = mapped;
  sgm__lock_take(&be->mu);
  r->next = be->ranges;
  be->ranges = r;
  be->c.n_vmm_ranges++;
  sgm__lock_drop(&be->mu);
  *range_out = r;
  *base_out = r->base;
  return SGM_OK;
}

/* Put [offset, + bytes) of r back to PROT_NONE with no pages behind it. */
static void emu_vmm_unmap_pages(emu_range *r, uint64_t offset, uint64_t bytes) {
  void *want = (void *)(uintptr_t)(r->base + offset);
  void *p = mmap(want, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                 -1, 0);
  sgm_assert(p == want);
  (void)p;
}

/* Granule state bytes (emu_range.mapped). As on CUDA (cuMemUnmap takes
 * whole mappings), a vmm_map mapping is unmapped whole or not at all. */
enum { EMU_VG_NONE = 0, EMU_VG_HEAD = 1, EMU_VG_POOL = 2, EMU_VG_TAIL = 3 };

/* A granule-aligned run inside r whose granules are all `state`
 * (EMU_VG_NONE, EMU_VG_POOL), or for EMU_VG_HEAD whole vmm_map mappings:
 * it starts at a mapping's first granule and ends at one's last. */
static bool emu_vmm_run_is(const emu_range *r, uint64_t offset, uint64_t bytes, uint8_t state) {
  if (bytes == 0 || offset % EMU_VMM_GRANULE || bytes % EMU_VMM_GRANULE || offset > r->bytes ||
      bytes > r->bytes - offset)
    return false;
  uint64_t g0 = offset / EMU_VMM_GRANULE, g1 = (offset + bytes) / EMU_VMM_GRANULE;
  if (state == EMU_VG_HEAD) {
    if (r->mapped[g0] != EMU_VG_HEAD) return false;
    if (g1 < r->bytes / EMU_VMM_GRANULE && r->mapped[g1] == EMU_VG_TAIL) return false;
    for (uint64_t g = g0 + 1; g < g1; g++)
      if (r->mapped[g] != EMU_VG_HEAD && r->mapped[g] != EMU_VG_TAIL) return false;
    return true;
  }
  for (uint64_t g = g0; g < g1; g++)
    if (r->mapped[g] != state) return false;
  return true;
}

static int emu_vmm_map(sgm_backend *be, void *range, uint64_t offset, uint64_t bytes) {
  sgm__lock_assert_none_held();
  emu_range *r = range;
  if (emu_inject(be)) return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (vmm_map)");
  /* A shared (named) device: the registry holds every process's bytes. */
  uint64_t free_now = 0;
  bool reserved = false;
  if (be->node && r) {
    int rc = sgm__node_device_reserve(be->node, bytes, be->total_bytes, &free_now);
    if (rc != SGM_OK && rc != SGM_ERR_NOMEM) return rc;
    reserved = rc == SGM_OK;
  }
  sgm__lock_take(&be->mu);
  bool ok = r && emu_vmm_run_is(r, offset, bytes, 0);
  bool fits = ok && (be->node ? reserved : bytes <= emu_device_free_locked(be));
  if (fits) {
    for (uint64_t g = offset / EMU_VMM_GRANULE; g < (offset + bytes) / EMU_VMM_GRANULE; g++)
      r->mapped[g] = g == offset / EMU_VMM_GRANULE ? EMU_VG_HEAD : EMU_VG_TAIL;
    be->c.device_live_bytes += bytes;
    be->c.vmm_mapped_bytes += bytes;
  }
  if (!be->node) free_now = emu_device_free_locked(be);
  sgm__lock_drop(&be->mu);
  if (reserved && !fits) sgm__node_device_release(be->node, bytes);
  if (!ok)
    return sgm__error_set(SGM_ERR_INVALID, "emulated device: vmm_map of [%llu, +%llu) is not a "
                          "run of unmapped granules of the range", (unsigned long long)offset,
                          (unsigned long long)bytes);
  if (!fits) {
    char a[32], f[32];
    return sgm__error_set(SGM_ERR_NOMEM, "emulated device: out of memory mapping %s (%s free)",
                          sgm__fmt_bytes(bytes, a, sizeof a), sgm__fmt_bytes(free_now, f, sizeof f));
  }
  void *want = (void *)(uintptr_t)(r->base + offset);
  void *p = mmap(want, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (p != want) {
    int e = errno;
    sgm__lock_take(&be->mu);
    for (uint64_t g = offset / EMU_VMM_GRANULE; g < (offset + bytes) / EMU_VMM_GRANULE; g++)
      r->mapped[g] = 0;
    be->c.device_live_bytes -= bytes;
    be->c.vmm_mapped_bytes -= bytes;
    sgm__lock_drop(&be->mu);
    if (be->node) sgm__node_device_release(be->node, bytes);
    return sgm__error_set(SGM_ERR_NOMEM, "emulated device: mapping %llu bytes failed: %s",
                          (unsigned long long)bytes, strerror(e));
  }
  return SGM_OK;
}

/* Unmap [offset, +bytes) of r, a run of granules that must all be in
 * `state` (r->mapped: 1 = vmm_map's own memory, 2 = pool granules): checked
 * and marked unmapped under be->mu with the counters (own memory leaves
 * device_live_bytes and the node's reservation too; a pool granule goes back
 * to its pool, whose memfd keeps the bytes), then the pages unmapped with no
 * lock held. A run that is not one is a broken contract: asserted, logged
 * (fn: the operation, what: the state's name) and ignored. */
static void emu_vmm_unmap_state(sgm_backend *be, emu_range *r, uint64_t offset, uint64_t bytes,
                                uint8_t state, const char *fn, const char *what) {
  sgm__lock_take(&be->mu);
  bool ok = r && emu_vmm_run_is(r, offset, bytes, state);
  if (ok) {
    for (uint64_t g = offset / EMU_VMM_GRANULE; g < (offset + bytes) / EMU_VMM_GRANULE; g++) {
      r->mapped[g] = 0;
      if (state == 2) r->pool->used[r->pidx[g]] = 0;
    }
    if (state == 1) be->c.device_live_bytes -= bytes;
    be->c.vmm_mapped_bytes -= bytes;
  }
  sgm__lock_drop(&be->mu);
  sgm_assert(ok);
  if (!ok) {
    sgm__log(be->verbose, 1, "emulated device: %s of [%llu, +%llu), not a run of %s granules; ignored",
             fn, (unsigned long long)offset, (unsigned long long)bytes, what);
    return;
  }
  emu_vmm_unmap_pages(r, offset, bytes);
  if (state == 1 && be->node) sgm__node_device_release(be->node, bytes);
}

static void emu_vmm_unmap(sgm_backend *be, void *range, uint64_t offset, uint64_t bytes) {
  sgm__lock_assert_none_held();
  emu_vmm_unmap_state(be, range, offset, bytes, 1, "vmm_unmap", "mapped");
}

/* Unlink r (lock held); returns the bytes it still had mapped (now uncounted). */
static uint64_t emu_vmm_detach_locked(sgm_backend *be, emu_range *r) {
  for (emu_range **pp = &be->ranges; *pp; pp = &(*pp)->next)
    if (*pp == r) {
      *pp = r->next;
      break;
    }
  uint64_t left = 0;
  for (uint64_t g = 0; g < r->bytes / EMU_VMM_GRANULE; g++) {
    left += r->mapped[g] == EMU_VG_HEAD || r->mapped[g] == EMU_VG_TAIL ? EMU_VMM_GRANULE : 0;
    if (r->mapped[g] == EMU_VG_POOL) {
      /* A pool granule: its memory stays the pool's (and counted there). */
      if (r->pool) r->pool->used[r->pidx[g]] = 0;
      be->c.vmm_mapped_bytes -= EMU_VMM_GRANULE;
    }
  }
  be->c.device_live_bytes -= left;
  be->c.vmm_mapped_bytes -= left;
  be->c.n_vmm_ranges--;
  return left;
}

static void emu_vmm_free(sgm_backend *be, void *range) {
  sgm__lock_assert_none_held();
  emu_range *r = range;
  if (!r) return;
  sgm__lock_take(&be->mu);
  uint64_t left = emu_vmm_detach_locked(be, r);
  sgm__lock_drop(&be->mu);
  if (left && be->node) sgm__node_device_release(be->node, left);
  if (left)
    sgm__log(be->verbose, 1, "emulated device: VMM range freed with %llu bytes still mapped",
             (unsigned long long)left);
  munmap(r->map_base, r->map_bytes);
  free(r->mapped);
  free(r->pidx);
  free(r);
}

static void emu_vmm_close_ranges(sgm_backend *be) {
  while (be->ranges) {
    emu_range *r = be->ranges;
    uint64_t left = emu_vmm_detach_locked(be, r);
    if (left && be->node) sgm__node_device_release(be->node, left);
    sgm__log(be->verbose, 1, "emulated device closed with a VMM range of %llu bytes reserved",
             (unsigned long long)r->bytes);
    munmap(r->map_base, r->map_bytes);
    free(r->mapped);
    free(r->pidx);
    free(r);
  }
}

/* ---- reserve mode's pool of granules (issue 17) ---- */

static int emu_vmm_pool_create(sgm_backend *be, uint64_t n_granules, void **pool_out) {
  sgm__lock_assert_none_held();
  *pool_out = NULL;
  if (emu_inject(be))
    return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (vmm_pool_create)");
  if (n_granules == 0 || n_granules > UINT32_MAX)
    return sgm__error_set(SGM_ERR_INVALID, "emulated device: vmm_pool_create of %llu granules",
                          (unsigned long long)n_granules);
  uint64_t bytes = n_granules * EMU_VMM_GRANULE;
  uint64_t free_now = 0;
  bool fits;
  if (be->node) {
    int rc = sgm__node_device_reserve(be->node, bytes, be->total_bytes, &free_now);
    if (rc != SGM_OK && rc != SGM_ERR_NOMEM) return rc;
    fits = rc == SGM_OK;
  } else {
    sgm__lock_take(&be->mu);
    free_now = emu_device_free_locked(be);
    fits = bytes <= free_now;
    if (fits) be->c.device_live_bytes += bytes; /* taken now: no other caller gets it */
    sgm__lock_drop(&be->mu);
  }
  if (!fits) {
    char a[32], f[32];
    return sgm__error_set(SGM_ERR_NOMEM, "emulated device: out of memory taking a pool of %s "
                          "(%s free)", sgm__fmt_bytes(bytes, a, sizeof a),
                          sgm__fmt_bytes(free_now, f, sizeof f));
  }
  int rc = SGM_OK;
  const char *what = NULL;
  int e = 0;
  emu_pool *pl = calloc(1, sizeof *pl);
  uint8_t *used = calloc((size_t)n_granules, 1);
  int fd = -1;
  if (!pl || !used) {
    what = "out of host memory";
  } else if ((fd = memfd_create("sgm-emu-vram-pool", MFD_CLOEXEC)) < 0) {
    e = errno;
    what = "memfd_create";
  } else if (ftruncate(fd, (off_t)bytes) != 0) {
    e = errno;
    what = "ftruncate";
  }
  if (what) {
    rc = sgm__error_set(SGM_ERR_NOMEM, "emulated device: cannot make a pool of %llu granules: "
                        "%s%s%s", (unsigned long long)n_granules, what, e ? ": " : "",
                        e ? strerror(e) : "");
    goto fail;
  }
  *pl = (emu_pool){.fd = fd, .n = n_granules, .used = used};
  sgm__lock_take(&be->mu);
  if (be->node) be->c.device_live_bytes += bytes;
  be->c.n_vmm_pool_granules += n_granules;
  sgm__lock_drop(&be->mu);
  *pool_out = pl;
  return SGM_OK;

fail:
  if (fd >= 0) close(fd);
  free(pl);
  free(used);
  if (be->node) {
    sgm__node_device_release(be->node, bytes);
  } else {
    sgm__lock_take(&be->mu);
    be->c.device_live_bytes -= bytes;
    sgm__lock_drop(&be->mu);
  }
  return rc;
}

static int emu_vmm_pool_map(sgm_backend *be, void *range, uint64_t offset, void *pool,
                            const uint32_t *idx, uint64_t n) {
  sgm__lock_assert_none_held();
  emu_range *r = range;
  emu_pool *pl = pool;
  if (emu_inject(be))
    return sgm__error_set(SGM_ERR_BACKEND, "emulated device: injected failure (vmm_pool_map)");
  uint64_t bytes = n * EMU_VMM_GRANULE;
  sgm__lock_take(&be->mu);
  bool ok = r && pl && n > 0 && (!r->pool || r->pool == pl) && emu_vmm_run_is(r, offset, bytes, 0);
  for (uint64_t k = 0; ok && k < n; k++) {
    ok = idx[k] < pl->n && !pl->used[idx[k]];
    for (uint64_t j = 0; ok && j < k; j++) ok = idx[j] != idx[k];
  }
  if (ok && !r->pidx) {
    r->pidx = calloc((size_t)(r->bytes / EMU_VMM_GRANULE), sizeof *r->pidx);
    ok = r->pidx != NULL;
  }
  if (ok) {
    /* Claimed under the lock: no other call maps these granules meanwhile. */
    r->pool = pl;
    uint64_t g0 = offset / EMU_VMM_GRANULE;
    for (uint64_t k = 0; k < n; k++) {
      r->mapped[g0 + k] = EMU_VG_POOL;
      r->pidx[g0 + k] = idx[k];
      pl->used[idx[k]] = 1;
    }
    be->c.vmm_mapped_bytes += bytes;
  }
  sgm__lock_drop(&be->mu);
  if (!ok)
    return sgm__error_set(SGM_ERR_INVALID, "emulated device: vmm_pool_map of %llu granules at "
                          "%llu: not a run of unmapped granules of the range, or pool granules "
                          "out of the pool or mapped already", (unsigned long long)n,
                          (unsigned long long)offset);
  for (uint64_t k = 0; k < n; k++) {
    void *want = (void *)(uintptr_t)(r->base + offset + k * EMU_VMM_GRANULE);
    void *p = mmap(want, EMU_VMM_GRANULE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, pl->fd,
                   (off_t)((uint64_t)idx[k] * EMU_VMM_GRANULE));
    if (p == want) continue;
    int e = errno;
    emu_vmm_unmap_pages(r, offset, bytes); /* all or nothing */
    sgm__lock_take(&be->mu);
    for (uint64_t j = 0; j < n; j++) {
      r->mapped[offset / EMU_VMM_GRANULE + j] = 0;
      pl->used[idx[j]] = 0;
    }
    be->c.vmm_mapped_bytes -= bytes;
    sgm__lock_drop(&be->mu);
    return sgm__error_set(SGM_ERR_NOMEM, "emulated device: mapping pool granule %u failed: %s",
                          (unsigned)idx[k], strerror(e));
  }
  return SGM_OK;
}

static void emu_vmm_pool_unmap(sgm_backend *be, void *range, uint64_t offset, uint64_t bytes) {
  sgm__lock_assert_none_held();
  emu_vmm_unmap_state(be, range, offset, bytes, 2, "vmm_pool_unmap", "pool-mapped");
}

static void emu_vmm_pool_free(sgm_backend *be, void *pool) {
  sgm__lock_assert_none_held();
  emu_pool *pl = pool;
  if (!pl) return;
  uint64_t bytes = pl->n * EMU_VMM_GRANULE, still = 0;
  sgm__lock_take(&be->mu);
  for (uint64_t i = 0; i < pl->n; i++) still += pl->used[i];
  for (emu_range *r = be->ranges; r; r = r->next)
    if (r->pool == pl) r->pool = NULL;
  be->c.device_live_bytes -= bytes;
  be->c.n_vmm_pool_granules -= pl->n;
  sgm__lock_drop(&be->mu);
  sgm_assert(still == 0);
  if (still)
    sgm__log(be->verbose, 1, "emulated device: pool freed with %llu granules still mapped",
             (unsigned long long)still);
  if (be->node) sgm__node_device_release(be->node, bytes);
  close(pl->fd);
  free(pl->used);
  free(pl);
}

const sgm_backend_ops sgm__backend_emu_ops = {
    .name = "emu",
    .synchronous = true,
    .pins_with_mlock = true,
    .open = emu_open,
    .close = emu_close,
    .mem_info = emu_mem_info,
    .device_alloc = emu_device_alloc,
    .device_free = emu_device_free,
    .host_alloc = emu_host_alloc,
    .host_free = emu_host_free,
    .copy = emu_copy,
    .counters = emu_counters,
    .event_record = emu_event_record,
    .event_query = emu_event_query,
    .event_wait = emu_event_wait,
    .event_destroy = emu_event_destroy,
    .stream_ref = emu_stream_ref,
    .event_create = emu_event_create,
    .event_record_on = emu_event_record_on,
    .stream_wait_event = emu_stream_wait_event,
    .stream_transfer = emu_stream_transfer,
    .device_key = emu_device_key,
    .node_attach = emu_node_attach,
    .managed_support = emu_managed_support,
    .managed_alloc = emu_managed_alloc,
    .managed_free = emu_managed_free,
    .managed_advise = emu_managed_advise,
    .managed_prefetch = emu_managed_prefetch,
    .vmm_granularity = emu_vmm_granularity,
    .vmm_reserve = emu_vmm_reserve,
    .vmm_map = emu_vmm_map,
    .vmm_unmap = emu_vmm_unmap,
    .vmm_free = emu_vmm_free,
    .device_uuid = emu_device_uuid,
    .device_pci_bus_id = emu_device_pci_bus_id,
    .vmm_pool_create = emu_vmm_pool_create,
    .vmm_pool_map = emu_vmm_pool_map,
    .vmm_pool_unmap = emu_vmm_pool_unmap,
    .vmm_pool_free = emu_vmm_pool_free,
    .copy_stream_wait_event = emu_copy_stream_wait_event,
};
