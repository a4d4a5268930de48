/*
 * cuda.c — the CUDA backend (SGM_BACKEND=cuda): an NVIDIA GPU through the
 * driver API, loaded at run time.
 *
 * Loading. libsgm.so never links libcuda: it is loaded into processes
 * (PyTorch, CuPy, plain CUDA programs) that bring their own CUDA runtime, and
 * it must load on machines with no driver at all. The first open() dlopens
 * "libcuda.so.1", dlsyms only cuDriverGetVersion and cuGetProcAddress, and
 * resolves every other entry point through cuGetProcAddress for one CUDA ABI
 * version (min(driver, 12.0)) into one table, listed once below
 * (CUDA_ENTRY_POINTS). That table is the process's only mutable global; it is
 * filled once (pthread_once) and never unloaded. A failed load is permanent
 * for the process and every open() reports it.
 *
 * Context. The backend uses the device's primary context
 * (cuDevicePrimaryCtxRetain), the one the runtime API and so every framework
 * uses, so memory is shared with them. sgm is called from threads that may have
 * no current context (or another one): every driver call runs between
 * cuda_enter()/cuda_leave(), which push the primary context when it is not
 * already current and pop it after. A thread on which the primary context was
 * found current is remembered (thread-local), so the event calls of a
 * cross-stream transfer, which name their event and stream, make no
 * cuCtxGetCurrent; the memory is forgotten, and the context looked up again,
 * when such a call fails with a context or handle error (the thread switched
 * contexts behind sgm's back) or the backend is closed. Calls charged to the
 * current context (allocations, frees, pins, VMM, memory info, event
 * creation, copies) never trust that memory: they ask the driver each time
 * (cuda_enter_as, issue 24). A
 * thread with no current context at all is given the primary one and keeps it,
 * as the CUDA runtime does on a thread's first call.
 *
 * Streams. CU_STREAM_PER_THREAD names the calling thread's default stream:
 * stream_ref() gives each thread its own key for it (a serial number, tagged
 * so that it never equals a stream pointer), so per-thread streams of two
 * threads never alias in sgm's caches.
 *
 * Memory. Device memory: cuMemAlloc. Pinned host memory: an anonymous mapping
 * bound with libnuma to the requested node (else the GPU's own node, found from
 * its PCI bus id with hwloc), then cuMemHostRegister(DEVICEMAP | PORTABLE) and
 * cuMemHostGetDevicePointer. Every live allocation and event is in a table so
 * that free() can check it and close() can return what was leaked.
 *
 * Managed memory (SGM_POINTERS=managed): cuMemAllocManaged, and cuMemAdvise /
 * cuMemPrefetchAsync in their CUmemLocation forms, resolved apart from the
 * table above for CUDA 12.2 (CUDA_MANAGED_ABI: 13.0 made the location form
 * cuMemPrefetchAsync's default, so asking by version gets the same
 * signature from 12.2 and 13.x drivers). A driver without them, or a device
 * without CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, has no managed mode:
 * managed_support() says which. A prefetch runs on the caller's stream and,
 * as a copy, is complete when managed_prefetch() returns.
 *
 * Copies run on the caller's stream (never while it captures a graph), or on
 * a non-blocking stream the backend owns when the caller passes NULL, and are
 * synchronised before copy() returns, as the contract asks.
 *
 * Errors: every CUresult becomes an sgm_status (out of memory -> NOMEM, a bad
 * handle or value the caller passed -> INVALID, anything else -> BACKEND) and a
 * message with the operation, the driver call, the CUDA error name and string.
 *
 * Threading: the driver is thread-safe; the backend's own state (counters, the
 * table of live objects) is under one lock of rank SGM_LOCK_BACKEND, never held
 * across a driver call. The call counter is an atomic, and recording, waiting on
 * and querying an existing event take no lock.
 *
 * Built without the CUDA toolkit's headers, this file is a backend whose open()
 * says so and how to use the emulated device.
 */
#include <dlfcn.h>
#include <errno.h>
#include <numa.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_internal.h"
#include "internal.h"

#if defined(SGM_HAVE_CUDA_HEADERS) && SGM_HAVE_CUDA_HEADERS
#include <cuda.h>
#if CUDA_VERSION >= 12000
#define CUDA_BACKEND_BUILT 1
#endif
#endif

#ifdef CUDA_BACKEND_BUILT
#include <cudaTypedefs.h>

/* Sizes pass between uint64_t and size_t unchecked. */
_Static_assert(sizeof(size_t) == sizeof(uint64_t), "sgm's CUDA backend needs a 64-bit size_t");

/* The driver's soname; tests put their test double of the same name first on
 * LD_LIBRARY_PATH. */
#define CUDA_DRIVER_LIBRARY "libcuda.so.1"

/* The newest CUDA ABI we ask entry points for. Every entry point below has had
 * the signature of its PFN typedef since this version or earlier. */
#define CUDA_ABI_VERSION 12000
/* cuGetProcAddress appeared in CUDA 11.3: older drivers cannot be used. */
#define CUDA_MIN_DRIVER_VERSION 11030

#define CUDA_HINT "set SGM_BACKEND=emu to use the emulated device instead"

/*
 * Every driver entry point the backend uses: X(name, abi), where name is the
 * base name cuGetProcAddress takes and abi the CUDA version whose signature the
 * PFN_<name>_v<abi> typedef of cudaTypedefs.h describes. The error-string
 * calls come first so that later resolve failures can be named.
 */
#define CUDA_ENTRY_POINTS(X)           \
  X(cuGetErrorName, 6000)              \
  X(cuGetErrorString, 6000)            \
  X(cuInit, 2000)                      \
  X(cuDeviceGetCount, 2000)            \
  X(cuDeviceGet, 2000)                 \
  X(cuDeviceGetAttribute, 2000)        \
  X(cuDeviceGetName, 2000)             \
  X(cuDeviceGetPCIBusId, 4010)         \
  X(cuDeviceTotalMem, 3020)            \
  X(cuDevicePrimaryCtxRetain, 7000)    \
  X(cuDevicePrimaryCtxRelease, 11000)  \
  X(cuCtxGetCurrent, 4000)             \
  X(cuCtxPushCurrent, 4000)            \
  X(cuCtxPopCurrent, 4000)             \
  X(cuMemGetInfo, 3020)                \
  X(cuMemAlloc, 3020)                  \
  X(cuMemFree, 3020)                   \
  X(cuMemHostRegister, 6050)           \
  X(cuMemHostUnregister, 4000)         \
  X(cuMemHostGetDevicePointer, 3020)   \
  X(cuMemcpyHtoDAsync, 3020)           \
  X(cuMemcpyDtoHAsync, 3020)           \
  X(cuMemcpyDtoDAsync, 3020)           \
  X(cuStreamCreate, 2000)              \
  X(cuStreamDestroy, 4000)             \
  X(cuStreamSynchronize, 2000)         \
  X(cuEventCreate, 2000)               \
  X(cuEventRecord, 2000)               \
  X(cuEventQuery, 2000)                \
  X(cuEventSynchronize, 2000)          \
  X(cuEventDestroy, 4000)              \
  X(cuStreamWaitEvent, 3020)           \
  X(cuStreamIsCapturing, 10000)        \
  X(cuThreadExchangeStreamCaptureMode, 10010) \
  X(cuStreamGetFlags, 5050)             \
  X(cuMemGetAllocationGranularity, 10020)      \
  X(cuMemAddressReserve, 10020)                \
  X(cuMemAddressFree, 10020)                   \
  X(cuMemCreate, 10020)                        \
  X(cuMemRelease, 10020)                       \
  X(cuMemMap, 10020)                           \
  X(cuMemUnmap, 10020)                         \
  X(cuMemSetAccess, 10020)                      \
  X(cuDeviceGetUuid, 11040)

/* The CUDA version whose signatures the managed entry points are asked for:
 * 12.2 introduced the CUmemLocation forms of cuMemAdvise and
 * cuMemPrefetchAsync (PFN_..._v12020). */
#define CUDA_MANAGED_ABI 12020

typedef struct cuda_table {
#define CUDA_MEMBER(name, abi) PFN_##name##_v##abi pfn_##name;
  CUDA_ENTRY_POINTS(CUDA_MEMBER)
#undef CUDA_MEMBER
} cuda_table;

/* The loaded driver: the one mutable global of libsgm, written once. */
static struct cuda_driver {
  void *lib;              /* dlopen handle of libcuda.so.1; never closed */
  int status;             /* SGM_OK, or why loading failed (permanent) */
  char error[640];        /* the message of a failed load */
  int driver_version;     /* cuDriverGetVersion: 1000 * major + 10 * minor */
  int abi_version;        /* the cudaVersion entry points were resolved for */
  cuda_table fn;          /* every entry point, resolved */
  PFN_cuMemAllocManaged_v6000 pfn_cuMemAllocManaged;   /* NULL: not offered */
  PFN_cuMemAdvise_v12020 pfn_cuMemAdvise;              /* NULL: driver older than 12.2 */
  PFN_cuMemPrefetchAsync_v12020 pfn_cuMemPrefetchAsync; /* NULL: driver older than 12.2 */
  char no_managed[160];   /* why the managed entry points are missing; "" = present */
} cuda_drv;
static pthread_once_t cuda_drv_once = PTHREAD_ONCE_INIT;

/*
 * Call a driver entry point: CU(cuMemAlloc)(&p, n). The one place every driver
 * call goes through, so it counts them: it names the variable `be` (the
 * backend the call is made for, in scope at every call) and bumps its
 * driver-call counter (sgm_stats.driver_calls, docs/stats.md) before the call.
 * CU_MANAGED reaches the optional managed entry points the same way. The
 * error-string calls, which only look up a table, go through CU_TEXT and are
 * not counted (the driver test double does not count them either).
 */
#define CU(name) (cuda_count_driver(be), cuda_drv.fn.pfn_##name)
#define CU_MANAGED(name) (cuda_count_driver(be), cuda_drv.pfn_##name)
#define CU_TEXT(name) (cuda_drv.fn.pfn_##name)
static void cuda_count_driver(sgm_backend *be);

static void cuda_load_fail(const char *fmt, ...) SGM_PRINTF(1, 2);
static void cuda_load_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cuda_drv.error, sizeof cuda_drv.error, fmt, ap);
  va_end(ap);
  cuda_drv.status = SGM_ERR_BACKEND;
}

static void cuda_load(void) {
  dlerror();
  void *lib = dlopen(CUDA_DRIVER_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *why = dlerror();
    cuda_load_fail("the NVIDIA driver library %s could not be loaded (%s); is the NVIDIA driver "
                   "installed and visible in this container? " CUDA_HINT,
                   CUDA_DRIVER_LIBRARY, why ? why : "no reason given");
    return;
  }
  PFN_cuDriverGetVersion_v2020 get_version =
      (PFN_cuDriverGetVersion_v2020)dlsym(lib, "cuDriverGetVersion");
  /* Exported as cuGetProcAddress_v2 since 12.0 (the header's cuGetProcAddress
   * is a macro for it); 11.3 to 11.8 export only the 4-argument original. */
  PFN_cuGetProcAddress_v12000 gpa2 = (PFN_cuGetProcAddress_v12000)dlsym(lib, "cuGetProcAddress_v2");
  PFN_cuGetProcAddress_v11030 gpa1 = (PFN_cuGetProcAddress_v11030)dlsym(lib, "cuGetProcAddress");
  int version = 0;
  if (!get_version || get_version(&version) != CUDA_SUCCESS || (!gpa2 && !gpa1) ||
      version < CUDA_MIN_DRIVER_VERSION) {
    cuda_load_fail("the NVIDIA driver library %s is too old or not a CUDA driver (driver API "
                   "version %d.%d; sgm needs %d.%d or newer); update the driver, or " CUDA_HINT,
                   CUDA_DRIVER_LIBRARY, version / 1000, version % 1000 / 10,
                   CUDA_MIN_DRIVER_VERSION / 1000, CUDA_MIN_DRIVER_VERSION % 1000 / 10);
    return;
  }
  /* Asking for a newer version than the driver's is an error
   * (CUDA_ERROR_INVALID_VALUE); the PFN signatures hold for both. */
  int abi = version < CUDA_ABI_VERSION ? version : CUDA_ABI_VERSION;
  cuda_table fn;
  memset(&fn, 0, sizeof fn);
#define CUDA_RESOLVE(name, abi_min)                                                              \
  do {                                                                                           \
    void *p = NULL;                                                                              \
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SUCCESS;                          \
    CUresult r = gpa2 ? gpa2(#name, &p, abi, CU_GET_PROC_ADDRESS_DEFAULT, &found)                \
                      : gpa1(#name, &p, abi, CU_GET_PROC_ADDRESS_DEFAULT);                       \
    if (r != CUDA_SUCCESS || !p || found != CU_GET_PROC_ADDRESS_SUCCESS) {                       \
      cuda_load_fail("the NVIDIA driver library %s (driver API %d.%d) has no entry point %s "     \
                     "for CUDA %d.%d (cuGetProcAddress returned %d, status %d); update the "     \
                     "driver, or " CUDA_HINT,                                                    \
                     CUDA_DRIVER_LIBRARY, version / 1000, version % 1000 / 10, #name, abi / 1000, \
                     abi % 1000 / 10, (int)r, (int)found);                                       \
      return;                                                                                    \
    }                                                                                            \
    fn.pfn_##name = (PFN_##name##_v##abi_min)p;                                                  \
  } while (0);
  CUDA_ENTRY_POINTS(CUDA_RESOLVE)
#undef CUDA_RESOLVE
  /* Optional: without them only managed mode is unavailable. */
  void *mp[3] = {NULL, NULL, NULL};
  static const char *const mnames[3] = {"cuMemAllocManaged", "cuMemAdvise", "cuMemPrefetchAsync"};
  for (int i = 0; i < 3 && version >= CUDA_MANAGED_ABI; i++) {
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SUCCESS;
    int want = i == 0 ? abi : CUDA_MANAGED_ABI;
    CUresult r = gpa2 ? gpa2(mnames[i], &mp[i], want, CU_GET_PROC_ADDRESS_DEFAULT, &found)
                      : gpa1(mnames[i], &mp[i], want, CU_GET_PROC_ADDRESS_DEFAULT);
    if (r != CUDA_SUCCESS || found != CU_GET_PROC_ADDRESS_SUCCESS) mp[i] = NULL;
    if (!mp[i] && !cuda_drv.no_managed[0])
      snprintf(cuda_drv.no_managed, sizeof cuda_drv.no_managed, "the driver has no %s for CUDA "
               "%d.%d", mnames[i], want / 1000, want % 1000 / 10);
  }
  if (version < CUDA_MANAGED_ABI)
    snprintf(cuda_drv.no_managed, sizeof cuda_drv.no_managed, "driver API %d.%d predates the "
             "CUmemLocation forms of cuMemAdvise and cuMemPrefetchAsync (CUDA 12.2)",
             version / 1000, version % 1000 / 10);
  cuda_drv.pfn_cuMemAllocManaged = (PFN_cuMemAllocManaged_v6000)mp[0];
  cuda_drv.pfn_cuMemAdvise = (PFN_cuMemAdvise_v12020)mp[1];
  cuda_drv.pfn_cuMemPrefetchAsync = (PFN_cuMemPrefetchAsync_v12020)mp[2];
  cuda_drv.lib = lib;
  cuda_drv.driver_version = version;
  cuda_drv.abi_version = abi;
  cuda_drv.fn = fn;
  cuda_drv.status = SGM_OK;
}

/* ---- errors ---- */

typedef enum cuda_blame {
  CUDA_BLAME_DRIVER = 0, /* a bad value is the driver's or sgm's problem: BACKEND */
  CUDA_BLAME_CALLER = 1  /* the call carried the caller's stream/pointer: bad ones are INVALID */
} cuda_blame;

/* Turn r (not CUDA_SUCCESS) into a status and this thread's message. */
static int cuda_fail(CUresult r, const char *op, const char *call, cuda_blame blame) {
  const char *name = NULL, *str = NULL;
  char num[32];
  if (CU_TEXT(cuGetErrorName)(r, &name) != CUDA_SUCCESS || !name) {
    snprintf(num, sizeof num, "CUresult %d", (int)r);
    name = num;
  }
  if (CU_TEXT(cuGetErrorString)(r, &str) != CUDA_SUCCESS || !str) str = "no description";
  int status = SGM_ERR_BACKEND;
  if (r == CUDA_ERROR_OUT_OF_MEMORY) status = SGM_ERR_NOMEM;
  else if (blame == CUDA_BLAME_CALLER && (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_HANDLE))
    status = SGM_ERR_INVALID;
  return sgm__error_set(status, "CUDA: %s: %s failed: %s (%s)", op, call, name, str);
}

/* ---- the opened device ---- */

typedef enum cuda_obj_kind {
  CUDA_OBJ_DEVICE = 0, /* cuMemAlloc memory; key = device address */
  CUDA_OBJ_HOST = 1,   /* registered host mapping; key = host address */
  CUDA_OBJ_EVENT = 2,  /* CUevent; key = the handle */
  CUDA_OBJ_STREAM = 3, /* a created stream seen by a transfer; key = the handle, bytes = its flags */
  CUDA_OBJ_MANAGED = 4 /* cuMemAllocManaged memory; key = its address */
} cuda_obj_kind;

typedef struct cuda_obj {
  uint64_t key;          /* address or handle, as above */
  uint64_t bytes;        /* device bytes asked for, host mapping length; events: the CUstream
                            event_record used, or CUDA_EVENT_POOLED */
  int kind;              /* cuda_obj_kind */
  struct cuda_obj *next; /* next in the hash chain */
  uint8_t *at;           /* managed: where each SGM_MANAGED_PAGE of it was last prefetched
                            (CUDA_AT_*), for the counters; NULL for other kinds */
} cuda_obj;

/* cuda_obj.at: a managed page not prefetched yet (the driver populates it on
 * first touch, wherever that is), placed on the device, placed in host memory. */
enum { CUDA_AT_NONE = 0, CUDA_AT_DEVICE = 1, CUDA_AT_HOST = 2 };

struct sgm_backend {
  sgm_lock lock;              /* guards c and the object table */
  int ordinal;                /* device ordinal (cfg->device) */
  CUdevice dev;               /* the driver's handle of that device */
  CUcontext ctx;              /* its primary context, retained until close */
  CUstream copy_stream;       /* non-blocking stream for copies the caller gave no stream for */
  int numa_node;              /* the GPU's NUMA node, -1 when unknown */
  int can_map_host;           /* CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY */
  int can_register_host;      /* CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED */
  char no_managed[512];       /* why managed mode is unavailable; "" = it is (set at open) */
  char no_host_tier[256];     /* why pinned host memory is unavailable; "" = it is (under lock) */
  int verbose;                /* log level from the config */
  char pci_bus_id[32];        /* "0000:65:00.0" */
  char name[128];             /* the device's name, for messages */
  uint64_t gen;               /* this open's generation, for the thread-local context cache */
  sgm_backend_counters c;     /* live objects and call count */
  cuda_obj **buckets;         /* live-object hash table (chained) */
  size_t n_buckets;           /* a power of two */
  size_t n_objs;              /* entries in the table */
  struct cuda_vrange *vranges; /* reserved VMM ranges not yet freed (under lock) */
  /* the device's UUID, asked once (cuda_device_uuid) */
  uint8_t uuid[16];           /* the driver's answer, valid once uuid_known */
  int uuid_known;             /* 1 once uuid is set (atomic: release after uuid is written) */
};

/* cuda_obj.bytes of an event from event_create: recorded only by
 * event_record_on, which never records into a capture, so queries of it need
 * no capture check. */
#define CUDA_EVENT_POOLED UINT64_MAX

/* Room for the first objects; the table doubles when it holds two per bucket. */
#define CUDA_OBJ_BUCKETS_MIN 64u

static size_t cuda_obj_hash(uint64_t key, size_t n_buckets) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdull;
  key ^= key >> 33;
  return (size_t)key & (n_buckets - 1);
}

/* Add an object; false when the table cannot grow or get a node (no memory). */
static bool cuda_obj_add_locked(sgm_backend *be, uint64_t key, uint64_t bytes, int kind) {
  sgm_assert_internal(sgm__lock_held(&be->lock));
  if (be->n_objs >= 2 * be->n_buckets) {
    size_t nb = be->n_buckets * 2;
    cuda_obj **b = calloc(nb, sizeof *b);
    if (b) {
      for (size_t i = 0; i < be->n_buckets; i++) {
        for (cuda_obj *o = be->buckets[i], *next; o; o = next) {
          next = o->next;
          size_t h = cuda_obj_hash(o->key, nb);
          o->next = b[h];
          b[h] = o;
        }
      }
      free(be->buckets);
      be->buckets = b;
      be->n_buckets = nb;
    } /* else: keep the longer chains; correctness does not depend on it */
  }
  cuda_obj *o = malloc(sizeof *o);
  if (!o) return false;
  o->key = key;
  o->bytes = bytes;
  o->kind = kind;
  o->at = NULL;
  if (kind == CUDA_OBJ_MANAGED && !(o->at = calloc(bytes / SGM_MANAGED_PAGE + 1, 1))) {
    free(o);
    return false;
  }
  size_t h = cuda_obj_hash(key, be->n_buckets);
  o->next = be->buckets[h];
  be->buckets[h] = o;
  be->n_objs++;
  return true;
}

/* Remove the object (key, kind); false when there is none. *bytes_out: its size. */
static bool cuda_obj_remove_locked(sgm_backend *be, uint64_t key, int kind, uint64_t *bytes_out) {
  sgm_assert_internal(sgm__lock_held(&be->lock));
  for (cuda_obj **pp = &be->buckets[cuda_obj_hash(key, be->n_buckets)]; *pp; pp = &(*pp)->next) {
    cuda_obj *o = *pp;
    if (o->key == key && o->kind == kind) {
      *pp = o->next;
      if (bytes_out) *bytes_out = o->bytes;
      for (uint64_t i = 0; o->at && i < o->bytes / SGM_MANAGED_PAGE; i++) {
        if (o->at[i] == CUDA_AT_DEVICE) be->c.managed_device_bytes -= SGM_MANAGED_PAGE;
        if (o->at[i] == CUDA_AT_HOST) be->c.managed_host_bytes -= SGM_MANAGED_PAGE;
      }
      free(o->at);
      free(o);
      be->n_objs--;
      return true;
    }
  }
  return false;
}

/* The stream event_record recorded an event on (*pooled: it came from
 * event_create instead, and is never recorded into a capture); false when
 * event is not live. */
static bool cuda_event_stream(sgm_backend *be, void *event, CUstream *stream, bool *pooled) {
  uint64_t key = (uint64_t)(uintptr_t)event;
  bool found = false;
  *stream = NULL;
  *pooled = false;
  sgm__lock_take(&be->lock);
  for (cuda_obj *o = be->buckets[cuda_obj_hash(key, be->n_buckets)]; o; o = o->next) {
    if (o->key == key && o->kind == CUDA_OBJ_EVENT) {
      *pooled = o->bytes == CUDA_EVENT_POOLED;
      if (!*pooled) *stream = (CUstream)(uintptr_t)o->bytes;
      found = true;
      break;
    }
  }
  sgm__lock_drop(&be->lock);
  return found;
}

static void cuda_count_call(sgm_backend *be) {
  __atomic_fetch_add(&be->c.n_calls, 1, __ATOMIC_RELAXED);
}

/* One driver call made for be (CU): relaxed, as only totals are read. */
static void cuda_count_driver(sgm_backend *be) {
  __atomic_fetch_add(&be->c.n_driver_calls, 1, __ATOMIC_RELAXED);
}

/* The primary context this thread was last seen to have current (NULL: not
 * known), and the backend generation that saw it: a context handle can be
 * reused by a later open, the generation cannot. */
static _Thread_local CUcontext cuda_tls_ctx;
static _Thread_local uint64_t cuda_tls_gen;
/* Generations of opened backends (0 = none). */
static uint64_t cuda_next_gen;

/* This thread's serial number for its per-thread default stream (0 = not yet
 * given), from a process-wide counter. */
static _Thread_local uint64_t cuda_tls_serial;
static uint64_t cuda_next_serial;

/* Make the primary context current for the calling thread (unless it already
 * is); *pushed says whether cuda_leave must pop it. cached: trust this
 * thread's memory that it is current (no cuCtxGetCurrent) — only for calls
 * that name the handles they act on (events, created streams), which a
 * context switched behind sgm's back cannot misdirect silently: such a call
 * fails with a context or handle error and is retried after a fresh look
 * (cuda_context_error). Every call charged to the current context
 * (allocations, frees, pins, VMM, memory info, event creation, copies, the
 * legacy stream) looks each time: an application that made another device's
 * context current (cudaSetDevice) since must not get device-0 memory charged
 * to device 1 (issue 24). */
static int cuda_enter_as(sgm_backend *be, const char *op, bool *pushed, bool cached) {
  *pushed = false;
  if (cached && cuda_tls_ctx == be->ctx && cuda_tls_gen == be->gen) return SGM_OK;
  CUcontext cur = NULL;
  CUresult r = CU(cuCtxGetCurrent)(&cur);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuCtxGetCurrent", CUDA_BLAME_DRIVER);
  if (cur == be->ctx || cur == NULL) {
    /* A thread with no current context keeps the primary one, as the CUDA
     * runtime does on a thread's first call: no push and pop per call. */
    if (cur == NULL) {
      r = CU(cuCtxPushCurrent)(be->ctx);
      if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuCtxPushCurrent", CUDA_BLAME_DRIVER);
    }
    cuda_tls_ctx = be->ctx;
    cuda_tls_gen = be->gen;
    return SGM_OK;
  }
  /* Another context is current: the cache is stale. */
  cuda_tls_ctx = NULL;
  cuda_tls_gen = 0;
  r = CU(cuCtxPushCurrent)(be->ctx);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuCtxPushCurrent", CUDA_BLAME_DRIVER);
  *pushed = true;
  return SGM_OK;
}

static int cuda_enter(sgm_backend *be, const char *op, bool *pushed) {
  return cuda_enter_as(be, op, pushed, false);
}

static int cuda_enter_cached(sgm_backend *be, const char *op, bool *pushed) {
  return cuda_enter_as(be, op, pushed, true);
}

/* Undo cuda_enter. A failure leaves the context on this thread's stack, which
 * cannot be repaired from here: it is logged, the operation's result stands. */
static void cuda_leave(sgm_backend *be, bool pushed, const char *op) {
  if (!pushed) return;
  CUcontext popped = NULL;
  CUresult r = CU(cuCtxPopCurrent)(&popped);
  if (r != CUDA_SUCCESS || popped != be->ctx) {
    const char *name = NULL;
    if (CU_TEXT(cuGetErrorName)(r, &name) != CUDA_SUCCESS || !name) name = "unknown CUresult";
    sgm__log(be->verbose, 1, "CUDA: %s: cuCtxPopCurrent failed (%s); this thread's current "
             "context may be wrong", op, r != CUDA_SUCCESS ? name : "popped another context");
  }
}

/* Log a driver failure in a function that cannot fail (frees, destroys). */
static void cuda_log_failure(sgm_backend *be, CUresult r, const char *op, const char *call) {
  const char *name = NULL;
  if (CU_TEXT(cuGetErrorName)(r, &name) != CUDA_SUCCESS || !name) name = "unknown CUresult";
  sgm__log(be->verbose, 1, "CUDA: %s: %s failed (%s); the memory may stay allocated", op, call,
           name);
}

/*
 * Graph capture. A thread's potentially unsafe calls would fail and
 * invalidate a capture in the default GLOBAL mode, whichever thread captures
 * (cuThreadExchangeStreamCaptureMode in cuda.h): the memory calls
 * (cuMemAlloc, cuMemFree, cuMemHostRegister/Unregister, the VMM calls) and,
 * as the programming guide and PyTorch's allocator (which skips its event
 * queries while any capture is under way) tell, the queries and waits
 * (cuEventQuery, cuEventSynchronize, cuStreamSynchronize). sgm makes those
 * from the capturing thread (a reclaim when an allocation misses its cache),
 * from its idle thread and from the managed copy-stream worker, so every one
 * runs in RELAXED mode, as PyTorch's allocator does around cudaMalloc: 2 more
 * driver calls (cuThreadExchangeStreamCaptureMode there and back) per query
 * or wait, which capture safety is worth (issue 24). Events recorded on a
 * capturing stream are graph nodes: they are never queried or waited on
 * while that stream captures (cuda_capturing).
 */
/* Switch the calling thread to RELAXED; *prev is the mode to restore. */
static CUresult cuda_relax(sgm_backend *be, CUstreamCaptureMode *prev) {
  *prev = CU_STREAM_CAPTURE_MODE_RELAXED;
  return CU(cuThreadExchangeStreamCaptureMode)(prev);
}

/* Restore the mode cuda_relax replaced. A failure cannot be undone from here
 * (the memory call is done): logged, like a failed context pop. */
static void cuda_unrelax(sgm_backend *be, CUstreamCaptureMode prev, const char *op) {
  if (prev == CU_STREAM_CAPTURE_MODE_RELAXED) return;
  CUresult r = CU(cuThreadExchangeStreamCaptureMode)(&prev);
  if (r != CUDA_SUCCESS)
    sgm__log(be->verbose, 1, "CUDA: %s: restoring the thread's capture mode failed; it stays "
             "relaxed", op);
}

/* Relax for a call that must be made anyway (a free, a query, a wait): a
 * failure is logged and the call made in the thread's own mode. Returns the
 * mode for cuda_unrelax. */
static CUstreamCaptureMode cuda_relax_or_log(sgm_backend *be, const char *op) {
  CUstreamCaptureMode prev;
  CUresult r = cuda_relax(be, &prev);
  if (r == CUDA_SUCCESS) return prev;
  cuda_log_failure(be, r, op, "cuThreadExchangeStreamCaptureMode");
  return CU_STREAM_CAPTURE_MODE_RELAXED;
}

/*
 * The frame of a memory call: the primary context entered and the thread in
 * relaxed capture mode, restored in reverse. Every allocation, free, pin, unpin
 * and virtual-memory call runs in one; this is their one copy of it.
 */
typedef struct cuda_frame {
  bool pushed;              /* cuda_enter pushed the context: cuda_frame_close pops it */
  CUstreamCaptureMode mode; /* the mode cuda_relax replaced; RELAXED once restored */
} cuda_frame;

/* Open a frame for a call that may fail: entering or relaxing failed is the
 * operation's failure (status returned, message set, nothing to close). */
static int cuda_frame_open(sgm_backend *be, const char *op, cuda_frame *f) {
  int rc = cuda_enter(be, op, &f->pushed);
  if (rc != SGM_OK) return rc;
  CUresult r = cuda_relax(be, &f->mode);
  if (r == CUDA_SUCCESS) return SGM_OK;
  rc = cuda_fail(r, op, "cuThreadExchangeStreamCaptureMode", CUDA_BLAME_DRIVER);
  cuda_leave(be, f->pushed, op);
  return rc;
}

/* Open a frame for a call that must be made (a free, an unmap): false when the
 * context cannot be entered (logged with `after`, what that leaves behind); a
 * failure to relax is logged and the call made anyway. */
static bool cuda_frame_open_must(sgm_backend *be, const char *op, const char *after,
                                 cuda_frame *f) {
  /* A failed context lookup is tried once more: the call must be made. */
  if (cuda_enter(be, op, &f->pushed) != SGM_OK && cuda_enter(be, op, &f->pushed) != SGM_OK) {
    sgm__log(be->verbose, 1, "CUDA: %s: %s%s", op, sgm_last_error(), after);
    return false;
  }
  f->mode = cuda_relax_or_log(be, op);
  return true;
}

static void cuda_frame_close(sgm_backend *be, cuda_frame *f, const char *op) {
  cuda_unrelax(be, f->mode, op);
  cuda_leave(be, f->pushed, op);
}

/* 1 when `stream` captures now (or the driver says the legacy stream is
 * implicitly part of another thread's capture): work recorded there is not
 * work that completes, and asking about it would invalidate the capture.
 * 0 when not; a negative status (message set) when the driver fails. */
static int cuda_capturing(sgm_backend *be, CUstream stream, const char *op) {
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  CUresult r = CU(cuStreamIsCapturing)(stream, &st);
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return 1;
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuStreamIsCapturing", CUDA_BLAME_CALLER);
  return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* The event was last recorded into a capture that has ended: it stands for
 * graph nodes, never for work that completes, and the driver refuses to
 * query it (CUDA_ERROR_CAPTURED_EVENT). What sgm asks it — has the work
 * queued before the free or release finished? — is answered by recording it
 * again on the same stream now, after the stream's real work, and asking
 * (wait: waiting for) that record. */
static CUresult cuda_rerecord_captured(sgm_backend *be, void *event, CUstream stream, bool wait) {
  CUresult r = CU(cuEventRecord)((CUevent)event, stream);
  if (r != CUDA_SUCCESS) return r;
  return wait ? CU(cuEventSynchronize)((CUevent)event) : CU(cuEventQuery)((CUevent)event);
}

/* Query (wait: wait for) event, recorded on `stream`, in RELAXED capture mode
 * (see "Graph capture"); the context is entered. */
static CUresult cuda_event_ask(sgm_backend *be, void *event, CUstream stream, bool wait,
                               const char *op) {
  CUstreamCaptureMode prev = cuda_relax_or_log(be, op);
  CUresult r = wait ? CU(cuEventSynchronize)((CUevent)event) : CU(cuEventQuery)((CUevent)event);
  if (r == CUDA_ERROR_CAPTURED_EVENT) r = cuda_rerecord_captured(be, event, stream, wait);
  cuda_unrelax(be, prev, op);
  return r;
}

static int cuda_managed_probe(sgm_backend *be);

static int cuda_open(const sgm_config *cfg, sgm_backend **out) {
  sgm__lock_assert_none_held();
  *out = NULL;
  pthread_once(&cuda_drv_once, cuda_load);
  if (cuda_drv.status != SGM_OK) return sgm__error_set(cuda_drv.status, "%s", cuda_drv.error);

  /* The backend first: the driver calls below are counted in it. */
  sgm_backend *be = calloc(1, sizeof *be);
  cuda_obj **buckets = calloc(CUDA_OBJ_BUCKETS_MIN, sizeof *buckets);
  if (!be || !buckets) {
    free(be);
    free(buckets);
    return sgm__error_set(SGM_ERR_NOMEM, "CUDA: out of host memory opening the device");
  }
  sgm__lock_init(&be->lock, SGM_LOCK_BACKEND);
  be->buckets = buckets;
  be->n_buckets = CUDA_OBJ_BUCKETS_MIN;
  be->ordinal = cfg->device;
  be->verbose = cfg->verbose;
  be->numa_node = -1;
  be->gen = __atomic_add_fetch(&cuda_next_gen, 1, __ATOMIC_RELAXED);
  int rc = SGM_OK;
  bool pushed = false;

  const char *op = "opening the device";
  CUresult r = CU(cuInit)(0);
  if (r != CUDA_SUCCESS) {
    cuda_fail(r, op, "cuInit", CUDA_BLAME_DRIVER);
    rc = sgm__error_set(SGM_ERR_BACKEND, "%s; the CUDA driver could not be initialised (no "
                        "usable NVIDIA GPU, or a driver/kernel module mismatch); " CUDA_HINT,
                        sgm_last_error());
    goto out_free;
  }
  int count = 0;
  r = CU(cuDeviceGetCount)(&count);
  if (r != CUDA_SUCCESS) {
    cuda_fail(r, op, "cuDeviceGetCount", CUDA_BLAME_DRIVER);
    rc = sgm__error_set(SGM_ERR_BACKEND, "%s; " CUDA_HINT, sgm_last_error());
    goto out_free;
  }
  if (count == 0) {
    rc = sgm__error_set(SGM_ERR_BACKEND, "CUDA: no CUDA device found (the driver loaded but "
                        "reports 0 devices; check CUDA_VISIBLE_DEVICES); " CUDA_HINT);
    goto out_free;
  }
  if (cfg->device < 0 || cfg->device >= count) {
    rc = sgm__error_set(SGM_ERR_BACKEND, "CUDA: SGM_DEVICE=%d is out of range: the driver "
                        "reports %d CUDA device%s (0 to %d); choose another device, or " CUDA_HINT,
                        cfg->device, count, count == 1 ? "" : "s", count - 1);
    goto out_free;
  }

  r = CU(cuDeviceGet)(&be->dev, cfg->device);
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuDeviceGet", CUDA_BLAME_DRIVER);
    goto out_free;
  }
  r = CU(cuDeviceGetName)(be->name, (int)sizeof be->name, be->dev);
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuDeviceGetName", CUDA_BLAME_DRIVER);
    goto out_free;
  }
  r = CU(cuDeviceGetPCIBusId)(be->pci_bus_id, (int)sizeof be->pci_bus_id, be->dev);
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuDeviceGetPCIBusId", CUDA_BLAME_DRIVER);
    goto out_free;
  }
  r = CU(cuDeviceGetAttribute)(&be->can_map_host, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, be->dev);
  if (r == CUDA_SUCCESS)
    r = CU(cuDeviceGetAttribute)(&be->can_register_host,
                                 CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, be->dev);
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuDeviceGetAttribute", CUDA_BLAME_DRIVER);
    goto out_free;
  }
  /* Known at open: every host_alloc then says why, without a driver call. */
  if (!be->can_map_host)
    snprintf(be->no_host_tier, sizeof be->no_host_tier, "cannot map host memory into its address "
             "space (CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY is 0)");
  else if (!be->can_register_host)
    snprintf(be->no_host_tier, sizeof be->no_host_tier, "does not support registering host "
             "memory (CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED is 0)");
  rc = cuda_managed_probe(be);
  if (rc != SGM_OK) goto out_free;
  r = CU(cuDevicePrimaryCtxRetain)(&be->ctx, be->dev);
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuDevicePrimaryCtxRetain", CUDA_BLAME_DRIVER);
    goto out_free;
  }
  rc = cuda_enter(be, op, &pushed);
  if (rc != SGM_OK) goto out_release;
  r = CU(cuStreamCreate)(&be->copy_stream, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuStreamCreate", CUDA_BLAME_DRIVER);
    goto out_leave;
  }
  cuda_leave(be, pushed, op);

  be->numa_node = sgm__cuda_numa_node(be->pci_bus_id);
  be->c.n_calls = 1; /* open is call 1, as on the emulated device */
  sgm__log(be->verbose, 2, "CUDA device %d: %s, PCI %s, NUMA node %d, driver %d.%d", be->ordinal,
           be->name, be->pci_bus_id, be->numa_node, cuda_drv.driver_version / 1000,
           cuda_drv.driver_version % 1000 / 10);
  *out = be;
  return SGM_OK;

out_leave:
  cuda_leave(be, pushed, op);
out_release:
  r = CU(cuDevicePrimaryCtxRelease)(be->dev);
  if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuDevicePrimaryCtxRelease");
out_free:
  sgm__lock_destroy(&be->lock);
  free(be->buckets);
  free(be);
  return rc;
}

static void cuda_vmm_close(sgm_backend *be, bool entered);

static void cuda_close(sgm_backend *be) {
  sgm__lock_assert_none_held();
  if (!be) return;
  const char *op = "closing the device";
  bool pushed = false;
  bool entered = cuda_enter(be, op, &pushed) == SGM_OK || cuda_enter(be, op, &pushed) == SGM_OK;
  if (be->c.n_device_live || be->c.n_host_live || be->c.n_events_live)
    sgm__log(be->verbose, 1,
             "CUDA device %d closed with %llu device allocations, %llu pinned host allocations "
             "and %llu events live; freeing them", be->ordinal,
             (unsigned long long)be->c.n_device_live, (unsigned long long)be->c.n_host_live,
             (unsigned long long)be->c.n_events_live);
  /* No other thread may use the backend now: walk the table without the lock. */
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  if (entered && cuda_relax(be, &mode) != CUDA_SUCCESS) mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  cuda_vmm_close(be, entered);
  for (size_t i = 0; i < be->n_buckets; i++) {
    for (cuda_obj *o = be->buckets[i], *next; o; o = next) {
      next = o->next;
      CUresult r = CUDA_SUCCESS;
      if (entered) {
        if (o->kind == CUDA_OBJ_DEVICE || o->kind == CUDA_OBJ_MANAGED) {
          r = CU(cuMemFree)((CUdeviceptr)o->key);
          if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuMemFree");
        } else if (o->kind == CUDA_OBJ_HOST) {
          r = CU(cuMemHostUnregister)((void *)(uintptr_t)o->key);
          if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuMemHostUnregister");
        } else if (o->kind == CUDA_OBJ_EVENT) {
          r = CU(cuEventDestroy)((CUevent)(uintptr_t)o->key);
          if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuEventDestroy");
        }
      }
      /* Unmap only what the driver no longer has pinned: a mapping it still
       * pins is leaked rather than left to the driver dangling. */
      if (o->kind == CUDA_OBJ_HOST && entered && r == CUDA_SUCCESS)
        munmap((void *)(uintptr_t)o->key, o->bytes);
      free(o->at);
      free(o);
    }
  }
  cuda_unrelax(be, mode, op);
  if (entered) {
    CUresult r = CU(cuStreamDestroy)(be->copy_stream);
    if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuStreamDestroy");
    cuda_leave(be, pushed, op);
  }
  CUresult r = CU(cuDevicePrimaryCtxRelease)(be->dev);
  if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuDevicePrimaryCtxRelease");
  sgm__lock_destroy(&be->lock);
  free(be->buckets);
  free(be);
}

/* The opening of an op that enters the context at once: no sgm lock held
 * (backend.h's rule), the call counted, the context entered (*pushed for
 * cuda_leave). */
static int cuda_op_enter(sgm_backend *be, const char *op, bool *pushed) {
  sgm__lock_assert_none_held();
  cuda_count_call(be);
  return cuda_enter(be, op, pushed);
}

static int cuda_mem_info(sgm_backend *be, uint64_t *free_bytes, uint64_t *total_bytes) {
  *free_bytes = 0;
  *total_bytes = 0;
  const char *op = "reading device memory info";
  bool pushed;
  int rc = cuda_op_enter(be, op, &pushed);
  if (rc != SGM_OK) return rc;
  size_t f = 0, t = 0;
  CUresult r = CU(cuMemGetInfo)(&f, &t);
  cuda_leave(be, pushed, op);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuMemGetInfo", CUDA_BLAME_DRIVER);
  *free_bytes = f;
  *total_bytes = t;
  return SGM_OK;
}

/* Allocate bytes of device memory (kind CUDA_OBJ_DEVICE: cuMemAlloc) or
 * managed memory (CUDA_OBJ_MANAGED: cuMemAllocManaged), both freed by
 * cuMemFree, in a frame of its own, and remember it with its kind's counters;
 * without room to remember it, give it back and fail with NOMEM. The one home
 * of both allocation paths. No sgm lock held. */
static int cuda_alloc_tracked(sgm_backend *be, int kind, uint64_t bytes, const char *op,
                              sgm_devptr *out) {
  cuda_frame f;
  int rc = cuda_frame_open(be, op, &f);
  if (rc != SGM_OK) return rc;
  CUdeviceptr p = 0;
  bool device = kind == CUDA_OBJ_DEVICE;
  CUresult r = device ? CU(cuMemAlloc)(&p, (size_t)bytes)
                      : CU_MANAGED(cuMemAllocManaged)(&p, (size_t)bytes, CU_MEM_ATTACH_GLOBAL);
  if (r != CUDA_SUCCESS) {
    cuda_frame_close(be, &f, op);
    return cuda_fail(r, op, device ? "cuMemAlloc" : "cuMemAllocManaged", CUDA_BLAME_DRIVER);
  }
  sgm__lock_take(&be->lock);
  bool added = cuda_obj_add_locked(be, (uint64_t)p, bytes, kind);
  if (added && device) {
    be->c.device_live_bytes += bytes;
    be->c.n_device_live++;
  } else if (added) {
    be->c.n_managed_live++;
  }
  sgm__lock_drop(&be->lock);
  if (!added) r = CU(cuMemFree)(p);
  cuda_frame_close(be, &f, op);
  if (added) {
    *out = (sgm_devptr)p;
    return SGM_OK;
  }
  if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuMemFree");
  return sgm__error_set(SGM_ERR_NOMEM, "CUDA: %s: out of host memory for bookkeeping", op);
}

/* Forget ptr, memory of that kind cuda_alloc_tracked gave out (bytes: its
 * size as remembered), and cuMemFree it in a frame of its own. A free cannot
 * fail: a pointer this backend did not allocate, or a failing driver, is
 * logged (`what`: the backend op, for the message). */
static void cuda_free_tracked(sgm_backend *be, int kind, sgm_devptr ptr, uint64_t bytes,
                              const char *op, const char *what) {
  uint64_t known = 0;
  sgm__lock_take(&be->lock);
  bool found = cuda_obj_remove_locked(be, ptr, kind, &known);
  if (found && kind == CUDA_OBJ_DEVICE) {
    be->c.device_live_bytes -= known;
    be->c.n_device_live--;
  } else if (found) {
    be->c.n_managed_live--;
  }
  sgm__lock_drop(&be->lock);
  sgm_assert(found && known == bytes);
  if (!found) {
    sgm__log(be->verbose, 1, "CUDA: %s of 0x%llx, which this backend did not allocate; ignored",
             what, (unsigned long long)ptr);
    return;
  }
  cuda_frame f;
  if (!cuda_frame_open_must(be, op, "", &f)) return;
  CUresult r = CU(cuMemFree)((CUdeviceptr)ptr);
  cuda_frame_close(be, &f, op);
  if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuMemFree");
}

static int cuda_managed_support(sgm_backend *be);

/* device_alloc and managed_alloc: the op's checks, then cuda_alloc_tracked.
 * A managed range is whole pages (SGM_MANAGED_PAGE). */
static int cuda_alloc_op(sgm_backend *be, int kind, uint64_t bytes, sgm_devptr *out) {
  sgm__lock_assert_none_held();
  *out = 0;
  cuda_count_call(be);
  bool device = kind == CUDA_OBJ_DEVICE;
  if (bytes == 0)
    return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s of 0 bytes", device ? "device_alloc" : "managed_alloc");
  if (!device) {
    if (be->no_managed[0]) return cuda_managed_support(be);
    bytes = sgm__align_up(bytes, SGM_MANAGED_PAGE);
  }
  char op[64], b[32];
  snprintf(op, sizeof op, "allocating %s of %s memory", sgm__fmt_bytes(bytes, b, sizeof b),
           device ? "device" : "managed");
  return cuda_alloc_tracked(be, kind, bytes, op, out);
}

static int cuda_device_alloc(sgm_backend *be, uint64_t bytes, sgm_devptr *out) {
  return cuda_alloc_op(be, CUDA_OBJ_DEVICE, bytes, out);
}

/* device_free and managed_free: cuda_free_tracked of the op's range. */
static void cuda_free_op(sgm_backend *be, int kind, sgm_devptr ptr, uint64_t bytes) {
  sgm__lock_assert_none_held();
  if (!ptr) return;
  if (kind == CUDA_OBJ_DEVICE)
    cuda_free_tracked(be, kind, ptr, bytes, "freeing device memory", "device_free");
  else
    cuda_free_tracked(be, kind, ptr, sgm__align_up(bytes, SGM_MANAGED_PAGE), "freeing managed memory",
                      "managed_free");
}

static void cuda_device_free(sgm_backend *be, sgm_devptr ptr, uint64_t bytes) {
  cuda_free_op(be, CUDA_OBJ_DEVICE, ptr, bytes);
}

/* The message for a device without pinned host memory: what the device or
 * driver refused, and what that means for the user. */
static int cuda_no_host_tier_error(const sgm_backend *be, const char *why) {
  return sgm__error_set(SGM_ERR_UNSUPPORTED,
                        "CUDA: device %d (%s) %s, so sgm has no shared GPU memory tier on it: "
                        "allocations past the VRAM budget fail instead of spilling to pinned host "
                        "memory (lower the VRAM use, or run where the driver may register host "
                        "memory: not under a hypervisor, container or confidential-computing mode "
                        "that forbids it)", be->ordinal, be->name, why);
}

/* True (message set) when the shared tier is known to be unavailable. */
static bool cuda_host_tier_unavailable(sgm_backend *be) {
  char why[sizeof be->no_host_tier];
  sgm__lock_take(&be->lock);
  memcpy(why, be->no_host_tier, sizeof why);
  sgm__lock_drop(&be->lock);
  if (!why[0]) return false;
  cuda_no_host_tier_error(be, why);
  return true;
}

/* cuMemHostRegister said NOT_SUPPORTED or NOT_PERMITTED: that will not change
 * for this process, so it is remembered and every later host_alloc fails at
 * once with the same message. */
static int cuda_host_register_refused(sgm_backend *be, CUresult r) {
  const char *name = NULL;
  if (CU_TEXT(cuGetErrorName)(r, &name) != CUDA_SUCCESS || !name) name = "unknown CUresult";
  sgm__lock_take(&be->lock);
  snprintf(be->no_host_tier, sizeof be->no_host_tier, "refused to register host memory "
           "(cuMemHostRegister: %s: %s)", name,
           r == CUDA_ERROR_NOT_PERMITTED ? "not permitted here" : "not supported on this system");
  char why[sizeof be->no_host_tier];
  memcpy(why, be->no_host_tier, sizeof why);
  sgm__lock_drop(&be->lock);
  sgm__log(be->verbose, 1, "CUDA: device %d: %s; the shared GPU memory tier is off", be->ordinal,
           why);
  return cuda_no_host_tier_error(be, why);
}

static int cuda_host_alloc(sgm_backend *be, uint64_t bytes, int numa_node, void **host_out,
                           sgm_devptr *dev_out) {
  sgm__lock_assert_none_held();
  *host_out = NULL;
  *dev_out = 0;
  cuda_count_call(be);
  if (bytes == 0) return sgm__error_set(SGM_ERR_INVALID, "CUDA: host_alloc of 0 bytes");
  if (cuda_host_tier_unavailable(be)) return SGM_ERR_UNSUPPORTED;
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  if (bytes > SIZE_MAX - page) return sgm__error_set(SGM_ERR_NOMEM, "CUDA: host_alloc size too large");
  size_t len = (size_t)sgm__align_up(bytes, page);
  char op[64];
  char b[32];
  snprintf(op, sizeof op, "pinning %s of host memory", sgm__fmt_bytes(len, b, sizeof b));
  /* The caller's node, else the GPU's own: preferred, not bound. */
  void *p = NULL;
  int rc = sgm__host_map_pinnable(len, numa_node >= 0 ? numa_node : be->numa_node, &p);
  if (rc != SGM_OK) return rc;
  cuda_frame f;
  rc = cuda_frame_open(be, op, &f);
  if (rc != SGM_OK) goto out_unmap;
  CUresult r = CU(cuMemHostRegister)(p, len, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE);
  if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_NOT_PERMITTED) {
    rc = cuda_host_register_refused(be, r);
    goto out_close;
  }
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuMemHostRegister", CUDA_BLAME_DRIVER);
    goto out_close;
  }
  CUdeviceptr d = 0;
  r = CU(cuMemHostGetDevicePointer)(&d, p, 0);
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuMemHostGetDevicePointer", CUDA_BLAME_DRIVER);
    goto out_unregister;
  }
  sgm__lock_take(&be->lock);
  bool added = cuda_obj_add_locked(be, (uint64_t)(uintptr_t)p, len, CUDA_OBJ_HOST);
  if (added) {
    be->c.host_live_bytes += len;
    be->c.n_host_live++;
  }
  sgm__lock_drop(&be->lock);
  if (!added) {
    rc = sgm__error_set(SGM_ERR_NOMEM, "CUDA: %s: out of host memory for bookkeeping", op);
    goto out_unregister;
  }
  cuda_frame_close(be, &f, op);
  *host_out = p;
  *dev_out = (sgm_devptr)d;
  return SGM_OK;

out_unregister:
  r = CU(cuMemHostUnregister)(p);
  if (r != CUDA_SUCCESS) {
    /* Still pinned by the driver: unmapping it would leave the driver a
     * dangling registration; leak the mapping instead. */
    cuda_log_failure(be, r, op, "cuMemHostUnregister");
    cuda_frame_close(be, &f, op);
    return rc;
  }
out_close:
  cuda_frame_close(be, &f, op);
out_unmap:
  munmap(p, len);
  return rc;
}

static void cuda_host_free(sgm_backend *be, void *host, uint64_t bytes) {
  sgm__lock_assert_none_held();
  if (!host) return;
  const char *op = "unpinning host memory";
  uint64_t len = 0;
  sgm__lock_take(&be->lock);
  bool found = cuda_obj_remove_locked(be, (uint64_t)(uintptr_t)host, CUDA_OBJ_HOST, &len);
  if (found) {
    be->c.host_live_bytes -= len;
    be->c.n_host_live--;
  }
  sgm__lock_drop(&be->lock);
  sgm_assert(found && len == sgm__align_up(bytes, (uint64_t)sysconf(_SC_PAGESIZE)));
  if (!found) {
    sgm__log(be->verbose, 1, "CUDA: host_free of %p, which this backend did not allocate; ignored",
             host);
    return;
  }
  cuda_frame f;
  if (!cuda_frame_open_must(be, op, "; the memory stays pinned", &f)) return;
  CUresult r = CU(cuMemHostUnregister)(host);
  cuda_frame_close(be, &f, op);
  if (r != CUDA_SUCCESS) {
    cuda_log_failure(be, r, op, "cuMemHostUnregister");
    return; /* never unmap what the driver may still have pinned */
  }
  munmap(host, len);
}

/*
 * Work queued on a stream and complete when the call returns (copy,
 * managed_prefetch): the stream is the caller's, or the backend's own copy
 * stream for NULL. cuda_sync_begin enters the context and refuses a caller's
 * stream that captures a graph (the work would be captured instead of run;
 * `which` names the stream, `what` the work, in that message); *s is the
 * stream to use. cuda_sync_end takes the queueing call's result, waits for
 * the stream and leaves the context.
 */
static int cuda_sync_begin(sgm_backend *be, void *stream, const char *op, const char *which,
                           const char *what, CUstream *s, bool *pushed) {
  *s = stream ? (CUstream)stream : be->copy_stream;
  int rc = cuda_enter(be, op, pushed);
  if (rc != SGM_OK) return rc;
  /* Only the caller's stream can be capturing (sgm's own never is). */
  if (!stream || (rc = cuda_capturing(be, *s, op)) == 0) return SGM_OK;
  cuda_leave(be, *pushed, op);
  if (rc < 0) return rc;
  return sgm__error_set(SGM_ERR_BUSY, "CUDA: %s: %s is capturing a CUDA graph, so the %s would "
                        "be captured instead of run; end the capture first", op, which, what);
}

static int cuda_sync_end(sgm_backend *be, CUresult r, const char *call, CUstream s, bool pushed,
                         const char *op) {
  int rc = SGM_OK;
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, call, CUDA_BLAME_CALLER);
  } else {
    /* A synchronize is potentially unsafe during a capture: RELAXED mode, as
     * for the event calls ("Graph capture"). */
    CUstreamCaptureMode prev = cuda_relax_or_log(be, op);
    r = CU(cuStreamSynchronize)(s);
    cuda_unrelax(be, prev, op);
    if (r != CUDA_SUCCESS) rc = cuda_fail(r, op, "cuStreamSynchronize", CUDA_BLAME_CALLER);
  }
  cuda_leave(be, pushed, op);
  return rc;
}

static int cuda_copy(sgm_backend *be, sgm_copy_kind kind, uint64_t dst, uint64_t src, uint64_t n,
                     void *stream) {
  sgm__lock_assert_none_held();
  cuda_count_call(be);
  if (kind > SGM_COPY_DEVICE_TO_DEVICE)
    return sgm__error_set(SGM_ERR_INVALID, "CUDA: bad copy kind %d", (int)kind);
  if (n == 0) return SGM_OK;
  if (!dst || !src) return sgm__error_set(SGM_ERR_INVALID, "CUDA: copy with a NULL address");
  static const char *const ops[] = {"copying host to device", "copying device to host",
                                    "copying device to device"};
  const char *op = ops[kind];
  CUstream s;
  bool pushed;
  int rc = cuda_sync_begin(be, stream, op, "the stream the buffer was last used on", "copy", &s,
                           &pushed);
  if (rc != SGM_OK) return rc;
  CUresult r;
  const char *call;
  switch (kind) {
    case SGM_COPY_HOST_TO_DEVICE:
      call = "cuMemcpyHtoDAsync";
      r = CU(cuMemcpyHtoDAsync)((CUdeviceptr)dst, (const void *)(uintptr_t)src, (size_t)n, s);
      break;
    case SGM_COPY_DEVICE_TO_HOST:
      call = "cuMemcpyDtoHAsync";
      r = CU(cuMemcpyDtoHAsync)((void *)(uintptr_t)dst, (CUdeviceptr)src, (size_t)n, s);
      break;
    default:
      call = "cuMemcpyDtoDAsync";
      r = CU(cuMemcpyDtoDAsync)((CUdeviceptr)dst, (CUdeviceptr)src, (size_t)n, s);
      break;
  }
  return cuda_sync_end(be, r, call, s, pushed, op);
}

static void cuda_counters(sgm_backend *be, sgm_backend_counters *out) {
  sgm__lock_assert_none_held();
  sgm__lock_take(&be->lock);
  uint64_t n_device_live = be->c.n_device_live, n_host_live = be->c.n_host_live;
  out->device_live_bytes = be->c.device_live_bytes;
  out->host_live_bytes = be->c.host_live_bytes;
  out->n_events_live = be->c.n_events_live;
  out->n_managed_live = be->c.n_managed_live;
  out->managed_device_bytes = be->c.managed_device_bytes;
  out->managed_host_bytes = be->c.managed_host_bytes;
  sgm__lock_drop(&be->lock);
  out->n_device_live = n_device_live;
  out->n_host_live = n_host_live;
  out->n_calls = __atomic_load_n(&be->c.n_calls, __ATOMIC_RELAXED);
  out->n_driver_calls = __atomic_load_n(&be->c.n_driver_calls, __ATOMIC_RELAXED);
  sgm__lock_take(&be->lock);
  out->vmm_mapped_bytes = be->c.vmm_mapped_bytes;
  out->n_vmm_ranges = be->c.n_vmm_ranges;
  out->n_vmm_pool_granules = be->c.n_vmm_pool_granules;
  sgm__lock_drop(&be->lock);
}

/* cuEventCreate (no timing: such events are cheaper to record and to query)
 * and its bookkeeping entry, tagged with the stream event_record will record
 * it on or CUDA_EVENT_POOLED. The one home of both create steps; the caller
 * has entered the context. */
static int cuda_event_new(sgm_backend *be, uint64_t tag, const char *op, CUevent *out) {
  *out = NULL;
  CUevent ev = NULL;
  CUresult r = CU(cuEventCreate)(&ev, CU_EVENT_DISABLE_TIMING);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuEventCreate", CUDA_BLAME_DRIVER);
  sgm__lock_take(&be->lock);
  bool added = cuda_obj_add_locked(be, (uint64_t)(uintptr_t)ev, tag, CUDA_OBJ_EVENT);
  if (added) be->c.n_events_live++;
  sgm__lock_drop(&be->lock);
  if (!added) {
    r = CU(cuEventDestroy)(ev);
    if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuEventDestroy");
    return sgm__error_set(SGM_ERR_NOMEM, "CUDA: %s: out of host memory for bookkeeping", op);
  }
  *out = ev;
  return SGM_OK;
}

/* Undo cuda_event_new (its event was never handed out). */
static void cuda_event_drop_new(sgm_backend *be, CUevent ev, const char *op) {
  sgm__lock_take(&be->lock);
  if (cuda_obj_remove_locked(be, (uint64_t)(uintptr_t)ev, CUDA_OBJ_EVENT, NULL))
    be->c.n_events_live--;
  sgm__lock_drop(&be->lock);
  CUresult r = CU(cuEventDestroy)(ev);
  if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuEventDestroy");
}

static int cuda_event_record(sgm_backend *be, void *stream, void **event_out) {
  *event_out = NULL;
  const char *op = "recording an event";
  bool pushed;
  int rc = cuda_op_enter(be, op, &pushed);
  if (rc != SGM_OK) return rc;
  CUevent ev = NULL;
  rc = cuda_event_new(be, (uint64_t)(uintptr_t)stream, op, &ev);
  if (rc != SGM_OK) goto out_leave;
  CUresult r = CU(cuEventRecord)(ev, (CUstream)stream);
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuEventRecord", CUDA_BLAME_CALLER);
    cuda_event_drop_new(be, ev, op);
    goto out_leave;
  }
  *event_out = ev;
out_leave:
  cuda_leave(be, pushed, op);
  return rc;
}

/* The start of event_query and event_wait (what: "event_query of", "event_wait
 * on"): find the stream the event was recorded on, enter the context and ask
 * whether that stream captures a graph now (an event recorded into a capture
 * that goes on stands for work that runs only when the graph is launched). A
 * negative status: failed, nothing to undo; 1: it captures (context left
 * again); 0: go on, entered (*pushed for cuda_leave), *stream the record's. */
static int cuda_event_begin(sgm_backend *be, void *event, const char *op, const char *what,
                            CUstream *stream, bool *pushed) {
  cuda_count_call(be);
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s a NULL event", what);
  bool pooled = false;
  if (!cuda_event_stream(be, event, stream, &pooled))
    return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s %p, which this backend did not record", what,
                          event);
  int rc = cuda_enter_cached(be, op, pushed);
  if (rc != SGM_OK) return rc;
  rc = pooled ? 0 : cuda_capturing(be, *stream, op);
  if (rc != 0) cuda_leave(be, *pushed, op);
  return rc;
}

static int cuda_event_query(sgm_backend *be, void *event) {
  const char *op = "querying an event";
  CUstream stream = NULL;
  bool pushed = false;
  int rc = cuda_event_begin(be, event, op, "event_query of", &stream, &pushed);
  if (rc != 0) return rc < 0 ? rc : 0; /* capturing: not complete before the capture ends */
  CUresult r = cuda_event_ask(be, event, stream, false, op);
  cuda_leave(be, pushed, op);
  if (r == CUDA_SUCCESS) return 1;
  if (r == CUDA_ERROR_NOT_READY) return 0;
  return cuda_fail(r, op, "cuEventQuery", CUDA_BLAME_CALLER);
}

static int cuda_event_wait(sgm_backend *be, void *event) {
  sgm__lock_assert_none_held();
  const char *op = "waiting for an event";
  CUstream stream = NULL;
  bool pushed = false;
  int rc = cuda_event_begin(be, event, op, "event_wait on", &stream, &pushed);
  if (rc < 0) return rc;
  if (rc > 0)
    return sgm__error_set(SGM_ERR_BUSY, "CUDA: %s: the event's stream is capturing a CUDA graph; "
                          "its work runs when the graph is launched, so it cannot be waited for "
                          "now (end the capture first)", op);
  CUresult r = cuda_event_ask(be, event, stream, true, op);
  cuda_leave(be, pushed, op);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuEventSynchronize", CUDA_BLAME_CALLER);
  return SGM_OK;
}

static void cuda_event_destroy(sgm_backend *be, void *event) {
  if (!event) return;
  const char *op = "destroying an event";
  sgm__lock_take(&be->lock);
  bool found = cuda_obj_remove_locked(be, (uint64_t)(uintptr_t)event, CUDA_OBJ_EVENT, NULL);
  if (found) be->c.n_events_live--;
  sgm__lock_drop(&be->lock);
  sgm_assert(found);
  if (!found) {
    sgm__log(be->verbose, 1, "CUDA: event_destroy of %p, which this backend did not record; "
             "ignored", event);
    return;
  }
  bool pushed = false;
  /* A failed enter (a context lookup that failed once) is tried again; the
   * handle names the event, so the driver destroys it without our context
   * current if it still can. */
  bool entered = cuda_enter_cached(be, op, &pushed) == SGM_OK || cuda_enter(be, op, &pushed) == SGM_OK;
  if (!entered) sgm__log(be->verbose, 2, "CUDA: %s: %s; destroying it anyway", op, sgm_last_error());
  CUresult r = CU(cuEventDestroy)((CUevent)event);
  if (entered) cuda_leave(be, pushed, op);
  if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuEventDestroy");
}

/* Per-thread default streams get keys (serial << 3) | 2: never 0 (legacy),
 * never a pointer (those are 8-aligned). */
#define CUDA_PER_THREAD_KEY(serial) (((serial) << 3) | UINT64_C(2))

static uint64_t cuda_thread_key(void) {
  if (cuda_tls_serial == 0)
    cuda_tls_serial = __atomic_add_fetch(&cuda_next_serial, 1, __ATOMIC_RELAXED);
  return CUDA_PER_THREAD_KEY(cuda_tls_serial);
}

static void cuda_stream_ref(sgm_backend *be, void *stream, sgm_stream_ref *out) {
  sgm__lock_assert_none_held();
  (void)be;
  out->handle = stream;
  if (stream == NULL || (CUstream)stream == CU_STREAM_LEGACY) out->key = 0;
  else if ((CUstream)stream == CU_STREAM_PER_THREAD) out->key = cuda_thread_key();
  else out->key = (uint64_t)(uintptr_t)stream;
}

/* The handle that names ref's stream from this thread (see the contract: a
 * per-thread stream of another thread is reached through the legacy stream). */
static CUstream cuda_stream_handle(const sgm_stream_ref *ref) {
  if ((CUstream)ref->handle == CU_STREAM_PER_THREAD && ref->key != cuda_thread_key()) return NULL;
  return (CUstream)ref->handle;
}

/* A call that failed because this thread's current context may not be what
 * the cache says (a context error, or a handle of sgm's context refused
 * because another context is current, e.g. the legacy stream resolved in
 * it): forget the cache so that the next enter looks again. */
static bool cuda_context_error(CUresult r) {
  if (r != CUDA_ERROR_INVALID_CONTEXT && r != CUDA_ERROR_CONTEXT_IS_DESTROYED &&
      r != CUDA_ERROR_INVALID_HANDLE)
    return false;
  cuda_tls_ctx = NULL;
  cuda_tls_gen = 0;
  return true;
}

static int cuda_event_create(sgm_backend *be, void **event_out) {
  *event_out = NULL;
  const char *op = "creating an event";
  bool pushed;
  int rc = cuda_op_enter(be, op, &pushed);
  if (rc != SGM_OK) return rc;
  CUevent ev = NULL;
  rc = cuda_event_new(be, CUDA_EVENT_POOLED, op, &ev);
  if (rc == SGM_OK) *event_out = ev;
  cuda_leave(be, pushed, op);
  return rc;
}

/* Refuse (SGM_ERR_BUSY) to record on or wait from a stream that captures a
 * CUDA graph: the record would be a graph node, not work that completes, and
 * a wait would pull the other stream into the capture (or break it). */
static int cuda_refuse_capturing(sgm_backend *be, CUstream s, const char *op) {
  int rc = cuda_capturing(be, s, op);
  if (rc <= 0) return rc;
  return sgm__error_set(SGM_ERR_BUSY, "CUDA: %s: the stream is capturing a CUDA graph; memory "
                        "does not cross streams during a capture", op);
}

/* cuEventRecord(event, s) or cuStreamWaitEvent(s, event): refused on a
 * capturing stream, retried once after a context error. */
static int cuda_stream_event_call(sgm_backend *be, void *event, const sgm_stream_ref *stream,
                                  bool wait) {
  cuda_count_call(be);
  const char *op = wait ? "ordering a stream after an event" : "recording a pooled event";
  const char *call = wait ? "cuStreamWaitEvent" : "cuEventRecord";
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s: NULL event", op);
  CUstream s = cuda_stream_handle(stream);
  for (int attempt = 0;; attempt++) {
    bool pushed;
    int rc = cuda_enter_cached(be, op, &pushed);
    if (rc != SGM_OK) return rc;
    /* The legacy stream never captures, but it is unusable while a blocking
     * stream captures (work on it would invalidate that capture): asking it
     * answers STREAM_CAPTURE_IMPLICIT then, without harm (cuda_capturing). */
    rc = cuda_refuse_capturing(be, s, op);
    if (rc != SGM_OK) {
      cuda_leave(be, pushed, op);
      return rc;
    }
    CUresult r = wait ? CU(cuStreamWaitEvent)(s, (CUevent)event, 0)
                      : CU(cuEventRecord)((CUevent)event, s);
    cuda_leave(be, pushed, op);
    if (r == CUDA_SUCCESS) return SGM_OK;
    if (attempt == 0 && cuda_context_error(r)) continue;
    return cuda_fail(r, op, call, CUDA_BLAME_CALLER);
  }
}

/* A pooled event was recorded on s: event_query and event_wait look up the
 * stream it was recorded on. */
static void cuda_event_recorded_on(sgm_backend *be, void *event, CUstream s) {
  uint64_t key = (uint64_t)(uintptr_t)event;
  sgm__lock_take(&be->lock);
  for (cuda_obj *o = be->buckets[cuda_obj_hash(key, be->n_buckets)]; o; o = o->next)
    if (o->key == key && o->kind == CUDA_OBJ_EVENT) o->bytes = (uint64_t)(uintptr_t)s;
  sgm__lock_drop(&be->lock);
}

static int cuda_event_record_on(sgm_backend *be, void *event, const sgm_stream_ref *stream) {
  sgm__lock_assert_none_held();
  int rc = cuda_stream_event_call(be, event, stream, false);
  if (rc != SGM_OK) return rc;
  cuda_event_recorded_on(be, event, cuda_stream_handle(stream));
  return SGM_OK;
}

static int cuda_stream_wait_event(sgm_backend *be, const sgm_stream_ref *stream, void *event) {
  sgm__lock_assert_none_held();
  return cuda_stream_event_call(be, event, stream, true);
}

/* The managed move queue (issue 14): the backend's own copy stream waits on
 * the device for event (never captures: no capture check). */
static int cuda_copy_stream_wait_event(sgm_backend *be, void *event) {
  sgm__lock_assert_none_held();
  cuda_count_call(be);
  const char *op = "ordering sgm's copy stream after an event";
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s: NULL event", op);
  bool pushed;
  int rc = cuda_enter_cached(be, op, &pushed);
  if (rc != SGM_OK) return rc;
  CUresult r = CU(cuStreamWaitEvent)(be->copy_stream, (CUevent)event, 0);
  if (r != CUDA_SUCCESS) rc = cuda_fail(r, op, "cuStreamWaitEvent", CUDA_BLAME_CALLER);
  cuda_leave(be, pushed, op);
  return rc;
}

/*
 * Cross-stream transfers (stream_transfer): order all work queued on `taker`
 * from now on after all work queued on `owner` so far, with as few driver
 * calls as capture safety allows (docs/streams.md, "Why two calls").
 *
 * The legacy stream orders itself with every blocking stream (legacy work
 * waits for all earlier blocking work, blocking work for all earlier legacy
 * work; per-thread default streams are blocking). So when both streams are
 * blocking, one question covers capture safety for both and for the legacy
 * stream: cuStreamIsCapturing(CU_STREAM_LEGACY) answers
 * STREAM_CAPTURE_IMPLICIT exactly while some blocking stream of the context
 * captures (and invalidates nothing). Then:
 *   - owner or taker is the legacy stream: the driver already orders them
 *     (1 call);
 *   - else one event recorded on the legacy stream sits after the owner's
 *     work and before the taker's (2 calls). It also orders the other
 *     blocking streams once: a device-side point, never a host wait.
 * A non-blocking stream is ordered only by an event: the owner is asked
 * (the legacy stream by the probe above) and cuEventRecord on it, then the
 * taker is asked and cuStreamWaitEvent on it (4 calls). In that order the
 * record is done, outside any capture, before the taker's side can refuse:
 * stream_transfer_fence hands it to the caller as the owner's fence (as it
 * does the legacy record of the 2-call case), so later transfers of the
 * owner's blocks it covers take the taker's two calls only.
 */

/* Is created stream s blocking? Learned once per handle (cuStreamGetFlags)
 * and kept until close (docs/streams.md, "Limits": a reused handle). */
static int cuda_stream_blocking(sgm_backend *be, CUstream s, const char *op, bool *blocking) {
  uint64_t key = (uint64_t)(uintptr_t)s;
  bool known = false;
  unsigned flags = 0;
  sgm__lock_take(&be->lock);
  for (cuda_obj *o = be->buckets[cuda_obj_hash(key, be->n_buckets)]; o && !known; o = o->next)
    if (o->key == key && o->kind == CUDA_OBJ_STREAM) {
      known = true;
      flags = (unsigned)o->bytes;
    }
  sgm__lock_drop(&be->lock);
  if (!known) {
    CUresult r = CU(cuStreamGetFlags)(s, &flags);
    if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuStreamGetFlags", CUDA_BLAME_CALLER);
    sgm__lock_take(&be->lock);
    /* Without room to remember it the answer is still right: asked again next time. */
    (void)cuda_obj_add_locked(be, key, flags, CUDA_OBJ_STREAM);
    sgm__lock_drop(&be->lock);
  }
  *blocking = !(flags & CU_STREAM_NON_BLOCKING);
  return SGM_OK;
}

static bool cuda_is_legacy(CUstream s) { return s == NULL || s == CU_STREAM_LEGACY; }

/* One attempt of a transfer under the entered context; *r_out: the last
 * driver result, for the caller's retry after a context error; *fenced: ev
 * was recorded after all of o's work queued so far (stream_transfer_fence). */
static int cuda_transfer_once(sgm_backend *be, CUevent ev, CUstream o, CUstream t, const char *op,
                              CUresult *r_out, bool *fenced) {
  *r_out = CUDA_SUCCESS;
  *fenced = false;
  bool ob = true, tb = true;
  int rc = SGM_OK;
  if (!cuda_is_legacy(o) && o != CU_STREAM_PER_THREAD) rc = cuda_stream_blocking(be, o, op, &ob);
  if (rc == SGM_OK && !cuda_is_legacy(t) && t != CU_STREAM_PER_THREAD)
    rc = cuda_stream_blocking(be, t, op, &tb);
  if (rc != SGM_OK) return rc;
  CUresult r;
  if (ob && tb) {
    if ((rc = cuda_refuse_capturing(be, CU_STREAM_LEGACY, op)) != SGM_OK) return rc;
    if (cuda_is_legacy(o) || cuda_is_legacy(t)) return SGM_OK;
    r = *r_out = CU(cuEventRecord)(ev, CU_STREAM_LEGACY);
    if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuEventRecord", CUDA_BLAME_CALLER);
    cuda_event_recorded_on(be, ev, CU_STREAM_LEGACY);
    *fenced = true;
    return SGM_OK;
  }
  if ((rc = cuda_refuse_capturing(be, o, op)) != SGM_OK) return rc;
  r = *r_out = CU(cuEventRecord)(ev, o);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuEventRecord", CUDA_BLAME_CALLER);
  cuda_event_recorded_on(be, ev, o);
  *fenced = true;
  if (t != o && (rc = cuda_refuse_capturing(be, t, op)) != SGM_OK) return rc;
  r = *r_out = CU(cuStreamWaitEvent)(t, ev, 0);
  return r == CUDA_SUCCESS ? SGM_OK : cuda_fail(r, op, "cuStreamWaitEvent", CUDA_BLAME_CALLER);
}

static int cuda_stream_transfer_fence(sgm_backend *be, void *event, const sgm_stream_ref *owner,
                                      const sgm_stream_ref *taker, bool *fenced) {
  sgm__lock_assert_none_held();
  cuda_count_call(be);
  *fenced = false;
  const char *op = "ordering a stream after another";
  if (!event) return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s: NULL event", op);
  CUstream o = cuda_stream_handle(owner), t = cuda_stream_handle(taker);
  for (int attempt = 0;; attempt++) {
    bool pushed;
    int rc = cuda_enter_cached(be, op, &pushed);
    if (rc != SGM_OK) return rc;
    CUresult r;
    bool rec = false;
    rc = cuda_transfer_once(be, (CUevent)event, o, t, op, &r, &rec);
    cuda_leave(be, pushed, op);
    /* A record of an earlier attempt still stands after o's work. */
    *fenced = *fenced || rec;
    if (rc == SGM_OK || attempt > 0 || !cuda_context_error(r)) return rc;
  }
}

static int cuda_stream_transfer(sgm_backend *be, void *event, const sgm_stream_ref *owner,
                                const sgm_stream_ref *taker) {
  sgm__lock_assert_none_held();
  bool fenced;
  return cuda_stream_transfer_fence(be, event, owner, taker, &fenced);
}

/* ---- managed memory (see "Managed memory" in backend.h) ---- */

/* Count the pages of [ptr, ptr + n) as placed at `at` (CUDA_AT_*) after a
 * prefetch there: the counters say where sgm put managed pages (pages the
 * GPU or the host touched first without a prefetch are not counted). */
static void cuda_managed_count(sgm_backend *be, sgm_devptr ptr, uint64_t n, uint8_t at) {
  sgm__lock_take(&be->lock);
  cuda_obj *m = NULL;
  for (cuda_obj *o = be->buckets[cuda_obj_hash(ptr, be->n_buckets)]; o && !m; o = o->next)
    if (o->key == ptr && o->kind == CUDA_OBJ_MANAGED) m = o;
  for (size_t i = 0; !m && i < be->n_buckets; i++) /* inside a range: rare */
    for (cuda_obj *o = be->buckets[i]; o && !m; o = o->next)
      if (o->kind == CUDA_OBJ_MANAGED && ptr >= o->key && ptr - o->key < o->bytes) m = o;
  if (m && n) {
    uint64_t first = (ptr - m->key) / SGM_MANAGED_PAGE;
    uint64_t end = m->bytes - (ptr - m->key) < n ? m->bytes : ptr - m->key + n;
    uint64_t last = (end - 1) / SGM_MANAGED_PAGE;
    for (uint64_t i = first; i <= last; i++) {
      if (m->at[i] == CUDA_AT_DEVICE) be->c.managed_device_bytes -= SGM_MANAGED_PAGE;
      if (m->at[i] == CUDA_AT_HOST) be->c.managed_host_bytes -= SGM_MANAGED_PAGE;
      m->at[i] = at;
      if (at == CUDA_AT_DEVICE) be->c.managed_device_bytes += SGM_MANAGED_PAGE;
      else be->c.managed_host_bytes += SGM_MANAGED_PAGE;
    }
  }
  sgm__lock_drop(&be->lock);
}

/* At open: can this device and driver run managed mode? be->no_managed says
 * why not. A failed attribute query fails the open (as the others do). */
static int cuda_managed_probe(sgm_backend *be) {
  if (cuda_drv.no_managed[0]) {
    snprintf(be->no_managed, sizeof be->no_managed, "%s", cuda_drv.no_managed);
    return SGM_OK;
  }
  int concurrent = 0;
  CUresult r = CU(cuDeviceGetAttribute)(&concurrent, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
                                        be->dev);
  if (r != CUDA_SUCCESS)
    return cuda_fail(r, "opening the device", "cuDeviceGetAttribute", CUDA_BLAME_DRIVER);
  if (!concurrent)
    snprintf(be->no_managed, sizeof be->no_managed, "device %d (%s) has no concurrent managed "
             "access (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0: a GPU before Pascal, "
             "Windows/WSL, or a virtualised GPU without it)", be->ordinal, be->name);
  return SGM_OK;
}

static int cuda_managed_support(sgm_backend *be) {
  sgm__lock_assert_none_held();
  if (!be->no_managed[0]) return SGM_OK;
  return sgm__error_set(SGM_ERR_UNSUPPORTED, "CUDA: %s", be->no_managed);
}

static int cuda_managed_alloc(sgm_backend *be, uint64_t bytes, sgm_devptr *out) {
  return cuda_alloc_op(be, CUDA_OBJ_MANAGED, bytes, out);
}

static void cuda_managed_free(sgm_backend *be, sgm_devptr ptr, uint64_t bytes) {
  cuda_free_op(be, CUDA_OBJ_MANAGED, ptr, bytes);
}

/* Where host-placed managed pages go: the GPU's NUMA node when known
 * (HOST_NUMA), else host memory wherever the kernel puts it. */
static CUmemLocation cuda_managed_host(const sgm_backend *be) {
  CUmemLocation l;
  memset(&l, 0, sizeof l);
  l.type = be->numa_node >= 0 ? CU_MEM_LOCATION_TYPE_HOST_NUMA : CU_MEM_LOCATION_TYPE_HOST;
  l.id = be->numa_node >= 0 ? be->numa_node : 0;
  return l;
}

static CUmemLocation cuda_managed_device(const sgm_backend *be) {
  CUmemLocation l;
  memset(&l, 0, sizeof l);
  l.type = CU_MEM_LOCATION_TYPE_DEVICE;
  l.id = (int)be->dev;
  return l;
}

static int cuda_managed_advise(sgm_backend *be, sgm_devptr ptr, uint64_t n, sgm_managed_advice advice) {
  sgm__lock_assert_none_held();
  cuda_count_call(be);
  if (be->no_managed[0]) return cuda_managed_support(be);
  CUmem_advise a;
  CUmemLocation l = cuda_managed_device(be);
  switch (advice) {
    case SGM_ADVISE_PREFER_DEVICE: a = CU_MEM_ADVISE_SET_PREFERRED_LOCATION; break;
    case SGM_ADVISE_PREFER_HOST:
      a = CU_MEM_ADVISE_SET_PREFERRED_LOCATION;
      l = cuda_managed_host(be);
      break;
    case SGM_ADVISE_ACCESSED_BY: a = CU_MEM_ADVISE_SET_ACCESSED_BY; break;
    case SGM_ADVISE_UNSET_ACCESSED_BY: a = CU_MEM_ADVISE_UNSET_ACCESSED_BY; break;
    default: return sgm__error_set(SGM_ERR_INVALID, "CUDA: bad managed advice %d", (int)advice);
  }
  const char *op = "advising managed memory";
  bool pushed;
  int rc = cuda_enter(be, op, &pushed);
  if (rc != SGM_OK) return rc;
  CUresult r = CU_MANAGED(cuMemAdvise)((CUdeviceptr)ptr, (size_t)n, a, l);
  if (r != CUDA_SUCCESS) rc = cuda_fail(r, op, "cuMemAdvise", CUDA_BLAME_CALLER);
  cuda_leave(be, pushed, op);
  return rc;
}

static int cuda_managed_prefetch(sgm_backend *be, sgm_devptr ptr, uint64_t n, sgm_tier to,
                                 void *stream) {
  sgm__lock_assert_none_held();
  cuda_count_call(be);
  if (be->no_managed[0]) return cuda_managed_support(be);
  if (to != SGM_TIER_VRAM && to != SGM_TIER_SHARED)
    return sgm__error_set(SGM_ERR_INVALID, "CUDA: prefetch to tier %d (only VRAM or shared memory "
                          "hold managed pages)", (int)to);
  const char *op = to == SGM_TIER_VRAM ? "prefetching managed memory to the device"
                                       : "prefetching managed memory to host memory";
  CUstream s;
  bool pushed;
  int rc = cuda_sync_begin(be, stream, op, "the stream", "prefetch", &s, &pushed);
  if (rc != SGM_OK) return rc;
  CUmemLocation l = to == SGM_TIER_VRAM ? cuda_managed_device(be) : cuda_managed_host(be);
  CUresult r = CU_MANAGED(cuMemPrefetchAsync)((CUdeviceptr)ptr, (size_t)n, l, 0, s);
  /* Complete on return, as a copy: sgm counts the pages where they are. */
  rc = cuda_sync_end(be, r, "cuMemPrefetchAsync", s, pushed, op);
  if (rc == SGM_OK) cuda_managed_count(be, ptr, n, to == SGM_TIER_VRAM ? CUDA_AT_DEVICE : CUDA_AT_HOST);
  return rc;
}

/* ---- The device's identity in the node registry (issue 13): its UUID
 * names one GPU (or one MIG slice) on a machine whatever CUDA_VISIBLE_DEVICES
 * does to the ordinals, and is what nvidia-smi -L prints, so the registry's
 * key is GPU-<UUID>. cuDeviceGetUuid needs no context. ---- */
static int cuda_device_uuid(sgm_backend *be, uint8_t out[16]) {
  sgm__lock_assert_none_held();
  /* Asked once per open: the registry key and the segment header both need
   * it at context create (a failure is not kept: the next call asks again). */
  if (__atomic_load_n(&be->uuid_known, __ATOMIC_ACQUIRE)) {
    memcpy(out, be->uuid, 16);
    return SGM_OK;
  }
  memset(out, 0, 16);
  CUuuid u;
  CUresult r = CU(cuDeviceGetUuid)(&u, be->dev);
  if (r != CUDA_SUCCESS) return cuda_fail(r, "reading the device's UUID", "cuDeviceGetUuid", CUDA_BLAME_DRIVER);
  memcpy(out, u.bytes, 16);
  sgm__lock_take(&be->lock);
  if (!be->uuid_known) {
    memcpy(be->uuid, u.bytes, 16);
    __atomic_store_n(&be->uuid_known, 1, __ATOMIC_RELEASE);
  }
  sgm__lock_drop(&be->lock);
  return SGM_OK;
}

static void cuda_device_pci_bus_id(sgm_backend *be, char *out, size_t len) {
  sgm__lock_assert_none_held();
  snprintf(out, len, "%s", be->pci_bus_id);
}

static void cuda_device_key(sgm_backend *be, char *out, size_t len) {
  sgm__lock_assert_none_held();
  uint8_t u[16];
  if (len) out[0] = '\0';
  if (cuda_device_uuid(be, u) != SGM_OK) {
    /* Without its UUID the device cannot be named the same in every
     * process: this one runs untracked rather than under a guessed key. */
    sgm__log(be->verbose, 1, "node registry: %s; this process runs untracked (budgets as if "
             "alone, invisible to sgm-smi)", sgm_last_error());
    sgm__error_clear();
    return;
  }
  char text[SGM_NODE_UUID_TEXT];
  sgm__node_uuid_format(u, text, sizeof text);
  snprintf(out, len, "GPU-%s", text);
}

/* ---- expandable VRAM: the virtual-memory API (issue 17) ----
 *
 * A range is one cuMemAddressReserve. vmm_map maps its run as ONE physical
 * allocation (cuMemCreate + cuMemMap of the whole run: four calls however
 * large, issue 26), releases the handle at once (the driver frees the memory
 * when the handle is released *and* the mapping unmapped, in either order),
 * then grants the device read-write access with one cuMemSetAccess (one for
 * neighbouring runs mapped together: vmm_map_runs). cuMemUnmap
 * takes whole mappings only (cuda.h: it "cannot unmap a sub-range of an
 * address range mapped by cuMemCreate / cuMemMap"), so vmm_unmap is given
 * runs of whole mappings and unmaps each with one cuMemUnmap, which then
 * frees its memory; the per-granule state byte tells where mappings start, so
 * no handle table is needed. Every call runs in the primary context, in
 * relaxed capture mode like the other memory calls. */

typedef struct cuda_vrange {
  CUdeviceptr base;            /* first address */
  uint64_t bytes;              /* reserved bytes */
  uint64_t granule;            /* the granule it was reserved with */
  uint8_t *mapped;             /* one byte per granule: 1 = the first of a vmm_map mapping,
                                  3 = a later granule of one, 2 = a pool granule mapped
                                  (under be->lock) */
  uint32_t *pidx;              /* per granule: the pool granule mapped there (state 2); NULL until
                                  a pool maps into the range */
  struct cuda_vpool *pool;     /* the pool mapped into it (state 2), NULL none yet */
  struct cuda_vrange *next;    /* the backend's list (under be->lock) */
} cuda_vrange;

/* Reserve mode's pool: one kept cuMemCreate handle per granule. */
typedef struct cuda_vpool {
  CUmemGenericAllocationHandle *h; /* the handles, released at vmm_pool_free */
  uint64_t n;                  /* granules */
  uint64_t granule;            /* their size */
  uint8_t *used;               /* one byte per granule: 1 = mapped in a range now (under be->lock) */
} cuda_vpool;

static CUmemAllocationProp cuda_vmm_prop(const sgm_backend *be) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = be->dev;
  return prop;
}

static int cuda_vmm_granularity(sgm_backend *be, uint64_t *bytes_out) {
  sgm__lock_assert_none_held();
  *bytes_out = 0;
  cuda_count_call(be);
  const char *op = "asking for virtual memory management";
  int supported = 0;
  CUresult r = CU(cuDeviceGetAttribute)(&supported,
                                        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                        be->dev);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuDeviceGetAttribute", CUDA_BLAME_DRIVER);
  if (!supported) return SGM_OK;
  bool pushed;
  int rc = cuda_enter(be, op, &pushed);
  if (rc != SGM_OK) return rc;
  CUmemAllocationProp prop = cuda_vmm_prop(be);
  size_t g = 0;
  r = CU(cuMemGetAllocationGranularity)(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  cuda_leave(be, pushed, op);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuMemGetAllocationGranularity", CUDA_BLAME_DRIVER);
  *bytes_out = g;
  return SGM_OK;
}

static int cuda_vmm_reserve(sgm_backend *be, uint64_t bytes, void **range_out, sgm_devptr *base_out) {
  sgm__lock_assert_none_held();
  *range_out = NULL;
  *base_out = 0;
  cuda_count_call(be);
  char op[80], b[32];
  snprintf(op, sizeof op, "reserving %s of device addresses", sgm__fmt_bytes(bytes, b, sizeof b));
  uint64_t g = 0;
  int rc = cuda_vmm_granularity(be, &g);
  if (rc != SGM_OK) return rc;
  if (g == 0 || bytes == 0 || bytes % g)
    return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s: not a positive multiple of the granule "
                          "(%llu bytes), or the device has no virtual memory management", op,
                          (unsigned long long)g);
  cuda_vrange *v = calloc(1, sizeof *v);
  uint8_t *mapped = calloc((size_t)(bytes / g), 1);
  if (!v || !mapped) {
    free(v);
    free(mapped);
    return sgm__error_set(SGM_ERR_NOMEM, "CUDA: %s: out of host memory", op);
  }
  cuda_frame f;
  rc = cuda_frame_open(be, op, &f);
  if (rc != SGM_OK) goto out_free;
  CUdeviceptr base = 0;
  CUresult r = CU(cuMemAddressReserve)(&base, (size_t)bytes, (size_t)g, 0, 0);
  cuda_frame_close(be, &f, op);
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuMemAddressReserve", CUDA_BLAME_DRIVER);
    goto out_free;
  }
  *v = (cuda_vrange){.base = base, .bytes = bytes, .granule = g, .mapped = mapped};
  sgm__lock_take(&be->lock);
  v->next = be->vranges;
  be->vranges = v;
  be->c.n_vmm_ranges++;
  sgm__lock_drop(&be->lock);
  *range_out = v;
  *base_out = (sgm_devptr)base;
  return SGM_OK;

out_free:
  free(v);
  free(mapped);
  return rc;
}

/* Is [offset, offset + bytes) a non-empty run of whole granules inside v?
 * Its granules are [*g0, *g1) when it is (both 0 when not). */
static bool cuda_vrange_run(const cuda_vrange *v, uint64_t offset, uint64_t bytes, uint64_t *g0,
                            uint64_t *g1) {
  bool ok = v && bytes && offset % v->granule == 0 && bytes % v->granule == 0 &&
            offset <= v->bytes && bytes <= v->bytes - offset;
  *g0 = ok ? offset / v->granule : 0;
  *g1 = ok ? (offset + bytes) / v->granule : 0;
  return ok;
}

/* Granule state bytes (cuda_vrange.mapped). */
enum { CUDA_VG_NONE = 0, CUDA_VG_HEAD = 1, CUDA_VG_POOL = 2, CUDA_VG_TAIL = 3 };

/* Granules of the mapping that starts at granule g: 1 for a pool granule,
 * else the head and its tail granules (state as read by the caller). */
static uint64_t cuda_vmm_mapping_len(const uint8_t *mapped, uint64_t g, uint64_t n) {
  uint64_t e = g + 1;
  if (mapped[g] == CUDA_VG_HEAD)
    while (e < n && mapped[e] == CUDA_VG_TAIL) e++;
  return e - g;
}

/* Unmap granules [g0, g1) of v, whole mappings as the state bytes `was`
 * (v->mapped) tell them, one cuMemUnmap each (context entered, relaxed).
 * The caller owns those granules: nobody changes their bytes meanwhile, so
 * they are read without be->lock. */
static void cuda_vmm_unmap_run(sgm_backend *be, cuda_vrange *v, const uint8_t *was, uint64_t g0,
                               uint64_t g1, const char *op) {
  for (uint64_t g = g0; g < g1;) {
    uint64_t n = cuda_vmm_mapping_len(was, g, g1);
    CUresult r = CU(cuMemUnmap)(v->base + g * v->granule, (size_t)(n * v->granule));
    if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuMemUnmap");
    g += n;
  }
}

/* Let the device read and write [p, +bytes), mapped just now (cuMemSetAccess). */
static CUresult cuda_vmm_set_access(sgm_backend *be, CUdeviceptr p, uint64_t bytes) {
  CUmemAccessDesc desc;
  memset(&desc, 0, sizeof desc);
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = be->dev;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return CU(cuMemSetAccess)(p, (size_t)bytes, &desc, 1);
}

/* Map one run [offset, +bytes) of v as one mapping, in the caller's frame
 * (context entered, relaxed), without access yet (cuda_vmm_map_group grants
 * it): all or nothing. */
static int cuda_vmm_map_one(sgm_backend *be, cuda_vrange *v, uint64_t offset, uint64_t bytes,
                            const CUmemAllocationProp *prop, const char *op) {
  CUmemGenericAllocationHandle h = 0;
  CUresult r = CU(cuMemCreate)(&h, (size_t)bytes, prop, 0);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuMemCreate", CUDA_BLAME_DRIVER);
  r = CU(cuMemMap)(v->base + offset, (size_t)bytes, 0, h, 0);
  /* The mapping keeps the memory; the handle is not needed any more. */
  CUresult rr = CU(cuMemRelease)(h);
  if (r != CUDA_SUCCESS) return cuda_fail(r, op, "cuMemMap", CUDA_BLAME_DRIVER);
  if (rr != CUDA_SUCCESS) cuda_log_failure(be, rr, op, "cuMemRelease");
  return SGM_OK;
}

/* Map runs [0, n) of v, each next to the one before, as a mapping each, and
 * grant the device access to all of them with one cuMemSetAccess (the range
 * may hold several whole mappings, cuda.h: "a fully mapped address range
 * containing all allocations"; PyTorch's expandable segments grant a run of
 * handles at once too). All or nothing: on failure every run of the group is
 * unmapped again. In the caller's frame. */
static int cuda_vmm_map_group(sgm_backend *be, cuda_vrange *v, const sgm_vmm_run *runs, size_t n,
                              const CUmemAllocationProp *prop, const char *op) {
  size_t mapped = 0;
  int rc = SGM_OK;
  for (; mapped < n && rc == SGM_OK; mapped++) {
    rc = cuda_vmm_map_one(be, v, runs[mapped].offset, runs[mapped].bytes, prop, op);
    if (rc != SGM_OK) break;
  }
  if (rc == SGM_OK) {
    uint64_t bytes = runs[n - 1].offset + runs[n - 1].bytes - runs[0].offset;
    CUresult r = cuda_vmm_set_access(be, v->base + runs[0].offset, bytes);
    if (r != CUDA_SUCCESS) rc = cuda_fail(r, op, "cuMemSetAccess", CUDA_BLAME_DRIVER);
  }
  if (rc != SGM_OK) {
    for (size_t i = 0; i < mapped; i++) { /* all or nothing */
      CUresult ru = CU(cuMemUnmap)(v->base + runs[i].offset, (size_t)runs[i].bytes);
      if (ru != CUDA_SUCCESS) cuda_log_failure(be, ru, op, "cuMemUnmap");
    }
    return rc;
  }
  sgm__lock_take(&be->lock);
  for (size_t i = 0; i < n; i++) {
    uint64_t g0 = runs[i].offset / v->granule, g1 = (runs[i].offset + runs[i].bytes) / v->granule;
    v->mapped[g0] = CUDA_VG_HEAD;
    if (g1 - g0 > 1) memset(v->mapped + g0 + 1, CUDA_VG_TAIL, (size_t)(g1 - g0 - 1));
    be->c.device_live_bytes += runs[i].bytes;
    be->c.vmm_mapped_bytes += runs[i].bytes;
  }
  sgm__lock_drop(&be->lock);
  return SGM_OK;
}

/* Map each run as one mapping, in order, in one frame: the context entered
 * and the capture mode relaxed once for all of them (three driver calls
 * that mapping run by run paid per run), and neighbouring runs granted
 * access together. Stops at the first failure: the runs of the group that
 * failed are unmapped again (*n_done counts the groups before it). */
static int cuda_vmm_map_runs(sgm_backend *be, void *range, const sgm_vmm_run *runs, size_t n,
                             size_t *n_done) {
  sgm__lock_assert_none_held();
  cuda_count_call(be);
  *n_done = 0;
  cuda_vrange *v = range;
  uint64_t total = 0, g0, g1;
  for (size_t i = 0; i < n; i++) total += runs[i].bytes;
  char op[96], b[32];
  snprintf(op, sizeof op, "mapping %s of device memory", sgm__fmt_bytes(total, b, sizeof b));
  for (size_t i = 0; i < n; i++)
    if (!cuda_vrange_run(v, runs[i].offset, runs[i].bytes, &g0, &g1))
      return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s: [%llu, +%llu) is not a granule-aligned "
                            "run of the range", op, (unsigned long long)runs[i].offset,
                            (unsigned long long)runs[i].bytes);
  cuda_frame f;
  int rc = cuda_frame_open(be, op, &f);
  if (rc != SGM_OK) return rc;
  CUmemAllocationProp prop = cuda_vmm_prop(be);
  for (size_t i = 0; i < n && rc == SGM_OK;) {
    size_t j = i + 1;
    while (j < n && runs[j].offset == runs[j - 1].offset + runs[j - 1].bytes) j++;
    rc = cuda_vmm_map_group(be, v, runs + i, j - i, &prop, op);
    if (rc == SGM_OK) *n_done = j;
    i = j;
  }
  cuda_frame_close(be, &f, op);
  return rc;
}

static int cuda_vmm_map(sgm_backend *be, void *range, uint64_t offset, uint64_t bytes) {
  sgm_vmm_run run = {offset, bytes};
  size_t done;
  return cuda_vmm_map_runs(be, range, &run, 1, &done);
}

/* Is [g0, g1) of v whole mappings in `state` (CUDA_VG_HEAD: vmm_map's, each
 * a head and its tail; CUDA_VG_POOL: pool granules)? be->lock held. */
static bool cuda_vmm_whole_locked(const cuda_vrange *v, uint64_t g0, uint64_t g1, uint8_t state) {
  uint64_t n = v->bytes / v->granule;
  if (state == CUDA_VG_POOL) {
    for (uint64_t g = g0; g < g1; g++)
      if (v->mapped[g] != CUDA_VG_POOL || !v->pool) return false;
    return true;
  }
  if (v->mapped[g0] != CUDA_VG_HEAD || (g1 < n && v->mapped[g1] == CUDA_VG_TAIL)) return false;
  for (uint64_t g = g0 + 1; g < g1; g++)
    if (v->mapped[g] != CUDA_VG_HEAD && v->mapped[g] != CUDA_VG_TAIL) return false;
  return true;
}

/* Unmap the runs of v, each whole mappings that must all be in `state`
 * (CUDA_VG_HEAD: vmm_map's own memory, CUDA_VG_POOL: pool granules of
 * vmm_pool_map): checked under be->lock with the counters (own memory leaves
 * device_live_bytes too), then one cuMemUnmap per mapping with no lock held
 * and one frame for all the runs (the caller owns these granules: nobody else
 * maps or unmaps them meanwhile), then marked unmapped (a pool granule goes
 * back to its pool, whose handle keeps the memory). A run that is not one is
 * a broken contract: asserted, logged (what: the state's name) and skipped. */
static void cuda_vmm_unmap_state(sgm_backend *be, cuda_vrange *v, const sgm_vmm_run *runs,
                                 size_t n, uint8_t state, const char *op, const char *what) {
  bool small[64], *ok = n <= 64 ? small : malloc(n * sizeof *ok);
  if (!ok) { /* out of host memory for the flags: one run at a time */
    for (size_t i = 0; i < n; i++) cuda_vmm_unmap_state(be, v, &runs[i], 1, state, op, what);
    return;
  }
  size_t n_ok = 0;
  uint64_t g0, g1;
  sgm__lock_take(&be->lock);
  for (size_t i = 0; i < n; i++) {
    ok[i] = cuda_vrange_run(v, runs[i].offset, runs[i].bytes, &g0, &g1) &&
            cuda_vmm_whole_locked(v, g0, g1, state);
    if (!ok[i]) continue;
    n_ok++;
    if (state == CUDA_VG_HEAD) be->c.device_live_bytes -= runs[i].bytes;
    be->c.vmm_mapped_bytes -= runs[i].bytes;
  }
  sgm__lock_drop(&be->lock);
  for (size_t i = 0; i < n; i++) {
    sgm_assert(ok[i]);
    if (!ok[i])
      sgm__log(be->verbose, 1, "CUDA: %s: [%llu, +%llu) is not a run of whole %s mappings; ignored",
               op, (unsigned long long)runs[i].offset, (unsigned long long)runs[i].bytes, what);
  }
  cuda_frame f;
  if (n_ok && cuda_frame_open_must(be, op, "", &f)) {
    for (size_t i = 0; i < n; i++) {
      if (!ok[i]) continue;
      cuda_vrange_run(v, runs[i].offset, runs[i].bytes, &g0, &g1);
      cuda_vmm_unmap_run(be, v, v->mapped, g0, g1, op);
    }
    cuda_frame_close(be, &f, op);
  }
  sgm__lock_take(&be->lock);
  for (size_t i = 0; i < n; i++) {
    if (!ok[i]) continue;
    cuda_vrange_run(v, runs[i].offset, runs[i].bytes, &g0, &g1);
    for (uint64_t g = g0; g < g1; g++) {
      v->mapped[g] = CUDA_VG_NONE;
      if (state == CUDA_VG_POOL) v->pool->used[v->pidx[g]] = 0;
    }
  }
  sgm__lock_drop(&be->lock);
  if (ok != small) free(ok);
}

static void cuda_vmm_unmap_runs(sgm_backend *be, void *range, const sgm_vmm_run *runs, size_t n) {
  sgm__lock_assert_none_held();
  cuda_vmm_unmap_state(be, range, runs, n, CUDA_VG_HEAD, "unmapping device memory", "mapped");
}

static void cuda_vmm_unmap(sgm_backend *be, void *range, uint64_t offset, uint64_t bytes) {
  sgm_vmm_run run = {offset, bytes};
  cuda_vmm_unmap_runs(be, range, &run, 1);
}

/* Unmap what is left of v and free its addresses (context entered, relaxed);
 * v is already off the list. */
static void cuda_vmm_release(sgm_backend *be, cuda_vrange *v, const char *op) {
  uint64_t n = v->bytes / v->granule, left = 0, pooled = 0;
  for (uint64_t g = 0; g < n;) {
    if (!v->mapped[g]) {
      g++;
      continue;
    }
    uint64_t len = cuda_vmm_mapping_len(v->mapped, g, n);
    cuda_vmm_unmap_run(be, v, v->mapped, g, g + len, op);
    /* A pool granule's memory stays the pool's (its handle is kept). */
    if (v->mapped[g] == CUDA_VG_POOL) pooled += v->granule;
    else left += len * v->granule;
    sgm__lock_take(&be->lock);
    if (v->mapped[g] == CUDA_VG_POOL && v->pool) v->pool->used[v->pidx[g]] = 0;
    sgm__lock_drop(&be->lock);
    g += len;
  }
  CUresult r = CU(cuMemAddressFree)(v->base, (size_t)v->bytes);
  if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuMemAddressFree");
  if (left) {
    sgm__log(be->verbose, 1, "CUDA: %s: %llu bytes were still mapped", op,
             (unsigned long long)left);
    sgm__lock_take(&be->lock);
    be->c.device_live_bytes -= left;
    be->c.vmm_mapped_bytes -= left;
    sgm__lock_drop(&be->lock);
  }
  if (pooled) {
    sgm__lock_take(&be->lock);
    be->c.vmm_mapped_bytes -= pooled;
    sgm__lock_drop(&be->lock);
  }
  free(v->mapped);
  free(v->pidx);
  free(v);
}

static void cuda_vmm_free(sgm_backend *be, void *range) {
  sgm__lock_assert_none_held();
  cuda_vrange *v = range;
  if (!v) return;
  const char *op = "freeing reserved device addresses";
  sgm__lock_take(&be->lock);
  for (cuda_vrange **pp = &be->vranges; *pp; pp = &(*pp)->next)
    if (*pp == v) {
      *pp = v->next;
      break;
    }
  be->c.n_vmm_ranges--;
  sgm__lock_drop(&be->lock);
  cuda_frame f;
  if (!cuda_frame_open_must(be, op, "", &f)) {
    free(v->mapped);
    free(v->pidx);
    free(v);
    return;
  }
  cuda_vmm_release(be, v, op);
  cuda_frame_close(be, &f, op);
}

/* close(): ranges sgm did not free (context entered by the caller). */
static void cuda_vmm_close(sgm_backend *be, bool entered) {
  while (be->vranges) {
    cuda_vrange *v = be->vranges;
    be->vranges = v->next;
    be->c.n_vmm_ranges--;
    sgm__log(be->verbose, 1, "CUDA device %d closed with a reserved range of %llu bytes; freeing it",
             be->ordinal, (unsigned long long)v->bytes);
    if (entered) {
      cuda_vmm_release(be, v, "closing the device");
    } else {
      free(v->mapped);
      free(v->pidx);
      free(v);
    }
  }
}

/* ---- reserve mode's pool of granules (issue 17): the handles are kept ----
 * vmm_pool_create makes one cuMemCreate allocation per granule and keeps its
 * handle; vmm_pool_map cuMemMaps kept handles and grants access over the run
 * (cuMemSetAccess after every map, as the driver requires); vmm_pool_unmap is
 * cuMemUnmap alone, so the memory stays with its handle; vmm_pool_free
 * cuMemReleases every handle. */

static int cuda_vmm_pool_create(sgm_backend *be, uint64_t n_granules, void **pool_out) {
  sgm__lock_assert_none_held();
  *pool_out = NULL;
  cuda_count_call(be);
  char op[96];
  snprintf(op, sizeof op, "taking %llu granules of device memory for the reserved budget",
           (unsigned long long)n_granules);
  uint64_t g = 0;
  int rc = cuda_vmm_granularity(be, &g);
  if (rc != SGM_OK) return rc;
  if (g == 0 || n_granules == 0 || n_granules > UINT32_MAX)
    return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s: no virtual memory management, or not "
                          "1 to 2^32 - 1 granules", op);
  cuda_vpool *pl = calloc(1, sizeof *pl);
  CUmemGenericAllocationHandle *h = calloc((size_t)n_granules, sizeof *h);
  uint8_t *used = calloc((size_t)n_granules, 1);
  if (!pl || !h || !used) {
    rc = sgm__error_set(SGM_ERR_NOMEM, "CUDA: %s: out of host memory", op);
    goto out_free;
  }
  cuda_frame f;
  rc = cuda_frame_open(be, op, &f);
  if (rc != SGM_OK) goto out_free;
  CUmemAllocationProp prop = cuda_vmm_prop(be);
  uint64_t made = 0;
  CUresult r = CUDA_SUCCESS;
  for (; made < n_granules; made++) {
    r = CU(cuMemCreate)(&h[made], (size_t)g, &prop, 0);
    if (r != CUDA_SUCCESS) break;
  }
  if (r != CUDA_SUCCESS) {
    rc = cuda_fail(r, op, "cuMemCreate", CUDA_BLAME_DRIVER);
    for (uint64_t i = 0; i < made; i++) { /* all or nothing */
      CUresult rr = CU(cuMemRelease)(h[i]);
      if (rr != CUDA_SUCCESS) cuda_log_failure(be, rr, op, "cuMemRelease");
    }
  }
  cuda_frame_close(be, &f, op);
  if (rc != SGM_OK) goto out_free;
  *pl = (cuda_vpool){.h = h, .n = n_granules, .granule = g, .used = used};
  sgm__lock_take(&be->lock);
  be->c.device_live_bytes += n_granules * g;
  be->c.n_vmm_pool_granules += n_granules;
  sgm__lock_drop(&be->lock);
  *pool_out = pl;
  return SGM_OK;

out_free:
  free(pl);
  free(h);
  free(used);
  return rc;
}

static int cuda_vmm_pool_map(sgm_backend *be, void *range, uint64_t offset, void *pool,
                             const uint32_t *idx, uint64_t n) {
  sgm__lock_assert_none_held();
  cuda_count_call(be);
  cuda_vrange *v = range;
  cuda_vpool *pl = pool;
  char op[96];
  snprintf(op, sizeof op, "mapping %llu granules of the reserved budget", (unsigned long long)n);
  bool ok = v && pl && n > 0 && pl->granule == v->granule && (!v->pool || v->pool == pl) &&
            offset % v->granule == 0 && offset <= v->bytes && n <= (v->bytes - offset) / v->granule;
  uint64_t g0 = ok ? offset / v->granule : 0;
  sgm__lock_take(&be->lock);
  for (uint64_t k = 0; ok && k < n; k++) {
    ok = idx[k] < pl->n && !pl->used[idx[k]] && v->mapped[g0 + k] == 0;
    for (uint64_t j = 0; ok && j < k; j++) ok = idx[j] != idx[k];
  }
  if (ok && !v->pidx) {
    v->pidx = calloc((size_t)(v->bytes / v->granule), sizeof *v->pidx);
    ok = v->pidx != NULL;
  }
  if (ok) {
    /* Claimed under the lock: no other call maps these meanwhile. */
    v->pool = pl;
    for (uint64_t k = 0; k < n; k++) {
      v->mapped[g0 + k] = CUDA_VG_POOL;
      v->pidx[g0 + k] = idx[k];
      pl->used[idx[k]] = 1;
    }
  }
  sgm__lock_drop(&be->lock);
  if (!ok)
    return sgm__error_set(SGM_ERR_INVALID, "CUDA: %s: [%llu, +%llu granules) is not a run of "
                          "unmapped granules of the range, or a pool granule is out of the pool "
                          "or mapped already", op, (unsigned long long)offset,
                          (unsigned long long)n);
  cuda_frame f;
  int rc = cuda_frame_open(be, op, &f);
  uint64_t k = 0;
  const char *failed = NULL;
  CUresult r = CUDA_SUCCESS;
  if (rc == SGM_OK) {
    for (; k < n; k++) {
      r = CU(cuMemMap)(v->base + offset + k * v->granule, (size_t)v->granule, 0, pl->h[idx[k]], 0);
      if (r != CUDA_SUCCESS) {
        failed = "cuMemMap";
        break;
      }
    }
    if (!failed) {
      r = cuda_vmm_set_access(be, v->base + offset, n * v->granule);
      if (r != CUDA_SUCCESS) failed = "cuMemSetAccess";
    }
    if (failed) {
      rc = cuda_fail(r, op, failed, CUDA_BLAME_DRIVER);
      cuda_vmm_unmap_run(be, v, v->mapped, g0, g0 + k, op); /* all or nothing; the handles stay */
    }
    cuda_frame_close(be, &f, op);
  }
  sgm__lock_take(&be->lock);
  for (uint64_t j = 0; j < n; j++) {
    if (rc != SGM_OK) {
      v->mapped[g0 + j] = 0;
      pl->used[idx[j]] = 0;
    }
  }
  if (rc == SGM_OK) be->c.vmm_mapped_bytes += n * v->granule;
  sgm__lock_drop(&be->lock);
  return rc;
}

static void cuda_vmm_pool_unmap(sgm_backend *be, void *range, uint64_t offset, uint64_t bytes) {
  sgm__lock_assert_none_held();
  /* cuMemUnmap only: the pool's handles keep the memory. */
  sgm_vmm_run run = {offset, bytes};
  cuda_vmm_unmap_state(be, range, &run, 1, CUDA_VG_POOL, "unmapping granules of the reserved budget",
                       "pool-mapped");
}

static void cuda_vmm_pool_free(sgm_backend *be, void *pool) {
  sgm__lock_assert_none_held();
  cuda_vpool *pl = pool;
  if (!pl) return;
  const char *op = "releasing the reserved budget's device memory";
  uint64_t still = 0;
  sgm__lock_take(&be->lock);
  for (uint64_t i = 0; i < pl->n; i++) still += pl->used[i];
  for (cuda_vrange *v = be->vranges; v; v = v->next)
    if (v->pool == pl) v->pool = NULL;
  be->c.device_live_bytes -= pl->n * pl->granule;
  be->c.n_vmm_pool_granules -= pl->n;
  sgm__lock_drop(&be->lock);
  if (still)
    sgm__log(be->verbose, 1, "CUDA: %s: %llu granules still mapped (their memory goes when they "
             "are unmapped)", op, (unsigned long long)still);
  cuda_frame f;
  if (cuda_frame_open_must(be, op, "", &f)) {
    for (uint64_t i = 0; i < pl->n; i++) {
      CUresult r = CU(cuMemRelease)(pl->h[i]);
      if (r != CUDA_SUCCESS) cuda_log_failure(be, r, op, "cuMemRelease");
    }
    cuda_frame_close(be, &f, op);
  }
  free(pl->h);
  free(pl->used);
  free(pl);
}

const sgm_backend_ops sgm__backend_cuda_ops = {
    .name = "cuda",
    .open = cuda_open,
    .close = cuda_close,
    .mem_info = cuda_mem_info,
    .device_alloc = cuda_device_alloc,
    .device_free = cuda_device_free,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .copy = cuda_copy,
    .counters = cuda_counters,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_wait = cuda_event_wait,
    .event_destroy = cuda_event_destroy,
    .stream_ref = cuda_stream_ref,
    .event_create = cuda_event_create,
    .event_record_on = cuda_event_record_on,
    .stream_wait_event = cuda_stream_wait_event,
    .stream_transfer = cuda_stream_transfer,
    .device_key = cuda_device_key,
    .managed_support = cuda_managed_support,
    .managed_alloc = cuda_managed_alloc,
    .managed_free = cuda_managed_free,
    .managed_advise = cuda_managed_advise,
    .managed_prefetch = cuda_managed_prefetch,
    .vmm_granularity = cuda_vmm_granularity,
    .vmm_reserve = cuda_vmm_reserve,
    .vmm_map = cuda_vmm_map,
    .vmm_unmap = cuda_vmm_unmap,
    .vmm_map_runs = cuda_vmm_map_runs,
    .vmm_unmap_runs = cuda_vmm_unmap_runs,
    .vmm_free = cuda_vmm_free,
    .device_uuid = cuda_device_uuid,
    .device_pci_bus_id = cuda_device_pci_bus_id,
    .stream_transfer_fence = cuda_stream_transfer_fence,
    .vmm_pool_create = cuda_vmm_pool_create,
    .vmm_pool_map = cuda_vmm_pool_map,
    .vmm_pool_unmap = cuda_vmm_pool_unmap,
    .vmm_pool_free = cuda_vmm_pool_free,
    .copy_stream_wait_event = cuda_copy_stream_wait_event,
};

#else /* !CUDA_BACKEND_BUILT */

/* Without the toolkit's headers there is no CUDA backend, only this message. */
static int cuda_open(const sgm_config *cfg, sgm_backend **out) {
  (void)cfg;
  *out = NULL;
  return sgm__error_set(SGM_ERR_BACKEND,
                        "this build of sgm has no CUDA backend: it was built without the CUDA "
                        "toolkit's headers (cuda.h, CUDA 12.0 or newer; rebuild with them, e.g. "
                        "-DSGM_CUDA_INCLUDE_DIR=/usr/local/cuda/include); set SGM_BACKEND=emu to "
                        "use the emulated device");
}

const sgm_backend_ops sgm__backend_cuda_ops = {.name = "cuda", .open = cuda_open};

#endif /* CUDA_BACKEND_BUILT */
