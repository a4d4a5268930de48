/*
 * fake_cuda.c — a TEST DOUBLE of the CUDA driver, NOT a driver.
 *
 * Built as a file named libcuda.so.1 in its own build folder
 * (build/<preset>/tests/support/fake_cuda/), so that a test which puts that
 * folder first on LD_LIBRARY_PATH makes sgm's CUDA backend dlopen this instead
 * of NVIDIA's driver. It implements, on host memory, exactly the driver entry
 * points sgm uses, with the checks a real driver makes where sgm could get them
 * wrong (a current context, live handles, addresses inside allocations, the
 * ABI version asked of cuGetProcAddress), and fault injection. It exists so the
 * loading, error and stream-order code of the backend runs on every commit on
 * machines with no GPU. Never install it, never ship it.
 *
 * The model:
 *  - FAKE_CUDA_DEVICE_COUNT devices (default 1; 0 = cuInit succeeds, no device),
 *    each with FAKE_CUDA_TOTAL_MEM bytes (default: SGM_EMU_VRAM when set, so the
 *    same suites see the same device size on both backends, else 1 GiB).
 *    Both are read at every cuInit, so one test process can change them.
 *  - Device memory is anonymous host memory (MAP_NORESERVE); the device address
 *    is the host address. Copies are memmove, done when enqueued.
 *  - Host registrations are bookkeeping only (nothing is page-locked); the
 *    device pointer of registered memory is its host address.
 *  - Streams only order events: an event is complete when recorded, unless
 *    events are held (globally or on its stream); it then stays pending until
 *    the test completes it. cuEventSynchronize and cuStreamSynchronize block
 *    until then (another thread must complete it).
 *  - Fault injection: every entry point except cuGetProcAddress,
 *    cuDriverGetVersion and the error-string calls is a counted call. The Nth
 *    counted call fails with a chosen CUresult, once: from the environment
 *    (FAKE_CUDA_FAIL_AT=N, FAKE_CUDA_FAIL_RESULT=CUDA_ERROR_x or a number,
 *    counted from load) or from fake_cuda_set_fail_at() (counted from then).
 *    FAKE_CUDA_INIT_RESULT makes every cuInit fail with that result.
 *  - FAKE_CUDA_DRIVER_VERSION (default 12080) is what cuDriverGetVersion says.
 *
 * The control API (fake_cuda.h) has the prefix fake_cuda_.
 *
 * Threading: one mutex guards all state; a condition variable wakes threads
 * blocked on pending events. The context stack is per thread, as in CUDA.
 */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <cuda.h>

#include "fake_cuda.h"

#define FAKE_API __attribute__((visibility("default")))

#define FAKE_MAX_DEVICES 8
#define FAKE_CTX_STACK 32
#define FAKE_DEFAULT_MEM (UINT64_C(1) << 30)
#define FAKE_DEFAULT_DRIVER_VERSION 12080
#define FAKE_PAGE 4096u
#define FAKE_OBJ_MAGIC 0x46414b45u /* "FAKE" */

struct CUctx_st {
  int device;  /* ordinal */
  int retains; /* cuDevicePrimaryCtxRetain count not yet released */
};

struct CUstream_st {
  uint32_t magic;           /* FAKE_OBJ_MAGIC while live */
  int test_owned;           /* made by fake_cuda_stream_create, not counted as sgm's */
  int held;                 /* events recorded here stay pending */
  uint64_t n_pending;       /* pending events recorded here */
  struct CUevent_st *blocker; /* pending event this stream waits for (cuStreamWaitEvent), or NULL */
  struct CUstream_st *next; /* list of live streams */
};

struct CUevent_st {
  uint32_t magic;           /* FAKE_OBJ_MAGIC while live */
  struct CUstream_st *stream; /* where it was last recorded (NULL: none, or destroyed) */
  int pending;              /* recorded and not yet completed */
  int blocked;              /* pending only because its stream waits for a blocker */
  struct CUevent_st *next;  /* list of live events */
};

typedef struct fake_dalloc {
  uintptr_t base;           /* device (= host) address */
  size_t size;              /* bytes asked for */
  size_t mapped;            /* bytes mapped (page-rounded) */
  uint64_t accounted;       /* bytes charged to the device (rounded to 256) */
  int device;               /* which device's memory */
  struct fake_dalloc *next;
} fake_dalloc;

typedef struct fake_hreg {
  uintptr_t base;           /* registered host range start */
  size_t size;              /* its length */
  unsigned flags;           /* CU_MEMHOSTREGISTER_* */
  struct fake_hreg *next;
} fake_hreg;

static struct {
  pthread_mutex_t mu;       /* guards everything here */
  pthread_cond_t cv;        /* signalled when pending events complete */
  int initialized;          /* cuInit succeeded */
  int device_count;         /* from FAKE_CUDA_DEVICE_COUNT at the last cuInit */
  uint64_t total_mem;       /* per device, from FAKE_CUDA_TOTAL_MEM at the last cuInit */
  uint64_t used_mem[FAKE_MAX_DEVICES]; /* accounted bytes allocated per device */
  struct CUctx_st ctx[FAKE_MAX_DEVICES]; /* the primary contexts */
  uint64_t calls;           /* counted calls */
  uint64_t fail_at;         /* fail this counted call; 0 = never */
  CUresult fail_result;     /* with this result */
  int fault_hit;            /* the armed fault fired */
  const char *fault_call;   /* the entry point it fired in */
  int hold_all;             /* every event recorded stays pending */
  uint64_t n_pending;       /* pending events in all */
  fake_dalloc *dallocs;     /* live device allocations */
  fake_hreg *hregs;         /* live host registrations */
  struct CUstream_st *streams; /* live streams */
  struct CUevent_st *events;   /* live events */
  struct CUstream_st legacy;   /* stream 0 (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) */
} F = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .cv = PTHREAD_COND_INITIALIZER,
    .fail_result = CUDA_ERROR_UNKNOWN,
    .fault_call = "",
    .legacy = {.magic = FAKE_OBJ_MAGIC},
};

static _Thread_local struct CUctx_st *tls_ctx[FAKE_CTX_STACK];
static _Thread_local int tls_depth;

/* ---- error names ---- */

#define FAKE_ERRORS(X)                                                               \
  X(CUDA_SUCCESS, "no error")                                                        \
  X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                    \
  X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                       \
  X(CUDA_ERROR_NOT_INITIALIZED, "initialization error")                              \
  X(CUDA_ERROR_DEINITIALIZED, "driver shutting down")                                \
  X(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")                      \
  X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                             \
  X(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")                            \
  X(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed")                         \
  X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")                            \
  X(CUDA_ERROR_NOT_FOUND, "named symbol not found")                                  \
  X(CUDA_ERROR_NOT_READY, "device not ready")                                        \
  X(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered")          \
  X(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")                          \
  X(CUDA_ERROR_ECC_UNCORRECTABLE, "uncorrectable ECC error encountered")             \
  X(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "part or all of the requested memory range is already mapped") \
  X(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory region") \
  X(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS") \
  X(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")                             \
  X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")                             \
  X(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "system has unsupported display driver / cuda driver combination") \
  X(CUDA_ERROR_UNKNOWN, "unknown error")

static const struct {
  CUresult r;
  const char *name;
  const char *str;
} fake_errors[] = {
#define FAKE_ERROR_ROW(e, s) {e, #e, s},
    FAKE_ERRORS(FAKE_ERROR_ROW)
#undef FAKE_ERROR_ROW
};

/* A CUresult from "CUDA_ERROR_OUT_OF_MEMORY" or "2"; dflt when unparsable. */
static CUresult fake_parse_result(const char *s, CUresult dflt) {
  if (!s || !*s) return dflt;
  for (size_t i = 0; i < sizeof fake_errors / sizeof fake_errors[0]; i++)
    if (strcmp(s, fake_errors[i].name) == 0) return fake_errors[i].r;
  char *end = NULL;
  long v = strtol(s, &end, 0);
  return end && *end == '\0' && end != s ? (CUresult)v : dflt;
}

/* Bytes from "1073741824", "512MiB", "4G"; dflt when unset or unparsable. */
static uint64_t fake_parse_size(const char *s, uint64_t dflt) {
  if (!s || !*s) return dflt;
  char *end = NULL;
  double v = strtod(s, &end);
  if (end == s || v < 0) return dflt;
  uint64_t mul = 1;
  switch (*end) {
    case 'k': case 'K': mul = UINT64_C(1) << 10; end++; break;
    case 'm': case 'M': mul = UINT64_C(1) << 20; end++; break;
    case 'g': case 'G': mul = UINT64_C(1) << 30; end++; break;
    case 't': case 'T': mul = UINT64_C(1) << 40; end++; break;
    default: break;
  }
  if (mul > 1 && (strcmp(end, "iB") == 0 || strcmp(end, "B") == 0)) end += strlen(end);
  if (*end != '\0') return dflt;
  return (uint64_t)(v * (double)mul);
}

static long fake_env_long(const char *name, long dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end = NULL;
  long v = strtol(s, &end, 0);
  return end && *end == '\0' ? v : dflt;
}

__attribute__((constructor)) static void fake_load(void) {
  pthread_mutex_lock(&F.mu);
  F.fail_at = (uint64_t)fake_env_long("FAKE_CUDA_FAIL_AT", 0);
  F.fail_result = fake_parse_result(getenv("FAKE_CUDA_FAIL_RESULT"), CUDA_ERROR_UNKNOWN);
  pthread_mutex_unlock(&F.mu);
}

/* Count a call; the armed fault's result when this is the one to fail. */
static CUresult fake_count(const char *fn) {
  pthread_mutex_lock(&F.mu);
  uint64_t n = ++F.calls;
  CUresult r = CUDA_SUCCESS;
  if (F.fail_at != 0 && n == F.fail_at && !F.fault_hit) {
    F.fault_hit = 1;
    F.fault_call = fn;
    r = F.fail_result;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

#define FAKE_COUNT(fn)                 \
  do {                                 \
    CUresult fr_ = fake_count(fn);     \
    if (fr_ != CUDA_SUCCESS) return fr_; \
  } while (0)

/* Checks below run under F.mu. */
static CUresult fake_need_init_locked(void) {
  return F.initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* The thread's current context, which must be a retained primary context. */
static CUresult fake_need_ctx_locked(struct CUctx_st **out) {
  if (!F.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (tls_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  struct CUctx_st *c = tls_ctx[tls_depth - 1];
  if (c->retains <= 0) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  if (out) *out = c;
  return CUDA_SUCCESS;
}

static struct CUstream_st *fake_stream_locked(CUstream s) {
  if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return &F.legacy;
  for (struct CUstream_st *x = F.streams; x; x = x->next)
    if (x == s) return x;
  return NULL;
}

static struct CUevent_st *fake_event_locked(CUevent e) {
  for (struct CUevent_st *x = F.events; x; x = x->next)
    if (x == e) return x;
  return NULL;
}

/* True when [addr, addr + n) is device-addressable: inside one allocation or
 * one registered (device-mapped) host range. */
static bool fake_device_range_locked(uintptr_t addr, size_t n) {
  for (fake_dalloc *a = F.dallocs; a; a = a->next)
    if (addr >= a->base && n <= a->size && addr - a->base <= a->size - n) return true;
  for (fake_hreg *h = F.hregs; h; h = h->next)
    if ((h->flags & CU_MEMHOSTREGISTER_DEVICEMAP) && addr >= h->base && n <= h->size &&
        addr - h->base <= h->size - n)
      return true;
  return false;
}

static void fake_complete_locked(struct CUevent_st *e);

/* e completed: streams that waited for it run on, and the events recorded on
 * them behind the wait complete (unless held themselves). */
static void fake_unblock_locked(struct CUevent_st *e) {
  struct CUstream_st *st = &F.legacy;
  for (struct CUstream_st *next = F.streams; st; st = next, next = next ? next->next : NULL) {
    if (st->blocker != e) continue;
    st->blocker = NULL;
    for (struct CUevent_st *ev = F.events; ev; ev = ev->next)
      if (ev->stream == st && ev->blocked) fake_complete_locked(ev);
  }
}

static void fake_complete_locked(struct CUevent_st *e) {
  if (!e->pending) return;
  e->pending = 0;
  e->blocked = 0;
  F.n_pending--;
  if (e->stream) e->stream->n_pending--;
  fake_unblock_locked(e);
}

/* ---- the entry points sgm uses ---- */

FAKE_API CUresult cuGetErrorName(CUresult error, const char **pStr) {
  for (size_t i = 0; i < sizeof fake_errors / sizeof fake_errors[0]; i++)
    if (fake_errors[i].r == error) {
      *pStr = fake_errors[i].name;
      return CUDA_SUCCESS;
    }
  *pStr = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult cuGetErrorString(CUresult error, const char **pStr) {
  for (size_t i = 0; i < sizeof fake_errors / sizeof fake_errors[0]; i++)
    if (fake_errors[i].r == error) {
      *pStr = fake_errors[i].str;
      return CUDA_SUCCESS;
    }
  *pStr = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult cuDriverGetVersion(int *driverVersion) {
  if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
  *driverVersion = (int)fake_env_long("FAKE_CUDA_DRIVER_VERSION", FAKE_DEFAULT_DRIVER_VERSION);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuInit(unsigned int Flags) {
  FAKE_COUNT("cuInit");
  if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  CUresult forced = fake_parse_result(getenv("FAKE_CUDA_INIT_RESULT"), CUDA_SUCCESS);
  if (forced != CUDA_SUCCESS) return forced;
  long n = fake_env_long("FAKE_CUDA_DEVICE_COUNT", 1);
  if (n < 0) n = 0;
  if (n > FAKE_MAX_DEVICES) n = FAKE_MAX_DEVICES;
  uint64_t total = fake_parse_size(getenv("FAKE_CUDA_TOTAL_MEM"),
                                   fake_parse_size(getenv("SGM_EMU_VRAM"), FAKE_DEFAULT_MEM));
  pthread_mutex_lock(&F.mu);
  F.initialized = 1;
  F.device_count = (int)n;
  F.total_mem = total;
  for (int d = 0; d < FAKE_MAX_DEVICES; d++) F.ctx[d].device = d;
  pthread_mutex_unlock(&F.mu);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetCount(int *count) {
  FAKE_COUNT("cuDeviceGetCount");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_init_locked();
  if (r == CUDA_SUCCESS) {
    if (count) *count = F.device_count;
    else r = CUDA_ERROR_INVALID_VALUE;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

static CUresult fake_need_device_locked(CUdevice dev) {
  CUresult r = fake_need_init_locked();
  if (r != CUDA_SUCCESS) return r;
  return dev >= 0 && dev < F.device_count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

FAKE_API CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  FAKE_COUNT("cuDeviceGet");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(ordinal);
  if (r == CUDA_SUCCESS) *device = ordinal;
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
  FAKE_COUNT("cuDeviceGetAttribute");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  if (!pi) return CUDA_ERROR_INVALID_VALUE;
  switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
      *pi = (int)fake_env_long("FAKE_CUDA_CAN_MAP_HOST", 1);
      break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *pi = 1; break;
    default: *pi = 0; break;
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  FAKE_COUNT("cuDeviceGetName");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  snprintf(name, (size_t)len, "sgm fake CUDA device %d (test double)", dev);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
  FAKE_COUNT("cuDeviceGetPCIBusId");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  if (!pciBusId || len < 13) return CUDA_ERROR_INVALID_VALUE;
  const char *fixed = dev == 0 ? getenv("FAKE_CUDA_PCI_BUS_ID") : NULL;
  if (fixed && *fixed) snprintf(pciBusId, (size_t)len, "%s", fixed);
  else snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", 0xf0 + dev);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
  FAKE_COUNT("cuDeviceTotalMem");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  if (r == CUDA_SUCCESS) *bytes = (size_t)F.total_mem;
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  FAKE_COUNT("cuDevicePrimaryCtxRetain");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  if (r == CUDA_SUCCESS) {
    F.ctx[dev].retains++;
    *pctx = &F.ctx[dev];
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
  FAKE_COUNT("cuDevicePrimaryCtxRelease");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  if (r == CUDA_SUCCESS) {
    if (F.ctx[dev].retains > 0) F.ctx[dev].retains--;
    else r = CUDA_ERROR_INVALID_CONTEXT;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuCtxGetCurrent(CUcontext *pctx) {
  FAKE_COUNT("cuCtxGetCurrent");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_init_locked();
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  *pctx = tls_depth ? tls_ctx[tls_depth - 1] : NULL;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxPushCurrent(CUcontext ctx) {
  FAKE_COUNT("cuCtxPushCurrent");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_init_locked();
  if (r == CUDA_SUCCESS) {
    bool known = false;
    for (int d = 0; d < FAKE_MAX_DEVICES; d++) known |= ctx == &F.ctx[d];
    if (!known || ctx->retains <= 0) r = CUDA_ERROR_INVALID_CONTEXT;
    else if (tls_depth == FAKE_CTX_STACK) r = CUDA_ERROR_INVALID_VALUE;
  }
  pthread_mutex_unlock(&F.mu);
  if (r == CUDA_SUCCESS) tls_ctx[tls_depth++] = ctx;
  return r;
}

FAKE_API CUresult cuCtxPopCurrent(CUcontext *pctx) {
  FAKE_COUNT("cuCtxPopCurrent");
  if (tls_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  CUcontext c = tls_ctx[--tls_depth];
  if (pctx) *pctx = c;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemGetInfo(size_t *free, size_t *total) {
  FAKE_COUNT("cuMemGetInfo");
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) {
    uint64_t used = F.used_mem[c->device];
    *free = (size_t)(used < F.total_mem ? F.total_mem - used : 0);
    *total = (size_t)F.total_mem;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
  FAKE_COUNT("cuMemAlloc");
  if (!dptr) return CUDA_ERROR_INVALID_VALUE;
  *dptr = 0;
  if (bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  uint64_t acc = ((uint64_t)bytesize + 255) & ~(uint64_t)255;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS && (acc > F.total_mem || F.used_mem[c->device] > F.total_mem - acc))
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) F.used_mem[c->device] += acc;
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  size_t mapped = (bytesize + FAKE_PAGE - 1) & ~(size_t)(FAKE_PAGE - 1);
  void *p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  fake_dalloc *a = p == MAP_FAILED ? NULL : malloc(sizeof *a);
  pthread_mutex_lock(&F.mu);
  if (!a) {
    F.used_mem[c->device] -= acc;
    r = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    *a = (fake_dalloc){(uintptr_t)p, bytesize, mapped, acc, c->device, F.dallocs};
    F.dallocs = a;
    *dptr = (CUdeviceptr)(uintptr_t)p;
  }
  pthread_mutex_unlock(&F.mu);
  if (!a && p != MAP_FAILED) munmap(p, mapped);
  return r;
}

FAKE_API CUresult cuMemFree(CUdeviceptr dptr) {
  FAKE_COUNT("cuMemFree");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  fake_dalloc *found = NULL;
  if (r == CUDA_SUCCESS) {
    for (fake_dalloc **pp = &F.dallocs; *pp; pp = &(*pp)->next)
      if ((*pp)->base == (uintptr_t)dptr) {
        found = *pp;
        *pp = found->next;
        F.used_mem[found->device] -= found->accounted;
        break;
      }
    if (!found) r = CUDA_ERROR_INVALID_VALUE;
  }
  pthread_mutex_unlock(&F.mu);
  if (found) {
    munmap((void *)found->base, found->mapped);
    free(found);
  }
  return r;
}

FAKE_API CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags) {
  FAKE_COUNT("cuMemHostRegister");
  const unsigned known = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                         CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY;
  if (!p || bytesize == 0 || (Flags & ~known)) return CUDA_ERROR_INVALID_VALUE;
  fake_hreg *h = malloc(sizeof *h);
  if (!h) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t base = (uintptr_t)p;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  for (fake_hreg *x = F.hregs; r == CUDA_SUCCESS && x; x = x->next)
    if (base < x->base + x->size && x->base < base + bytesize)
      r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  if (r == CUDA_SUCCESS) {
    *h = (fake_hreg){base, bytesize, Flags, F.hregs};
    F.hregs = h;
    h = NULL;
  }
  pthread_mutex_unlock(&F.mu);
  free(h);
  return r;
}

FAKE_API CUresult cuMemHostUnregister(void *p) {
  FAKE_COUNT("cuMemHostUnregister");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  fake_hreg *found = NULL;
  if (r == CUDA_SUCCESS) {
    for (fake_hreg **pp = &F.hregs; *pp; pp = &(*pp)->next)
      if ((*pp)->base == (uintptr_t)p) {
        found = *pp;
        *pp = found->next;
        break;
      }
    if (!found) r = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  }
  pthread_mutex_unlock(&F.mu);
  free(found);
  return r;
}

FAKE_API CUresult cuMemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
  FAKE_COUNT("cuMemHostGetDevicePointer");
  if (!pdptr || Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  *pdptr = 0;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  if (r == CUDA_SUCCESS) {
    r = CUDA_ERROR_INVALID_VALUE;
    for (fake_hreg *x = F.hregs; x; x = x->next)
      if ((x->flags & CU_MEMHOSTREGISTER_DEVICEMAP) && (uintptr_t)p >= x->base &&
          (uintptr_t)p < x->base + x->size) {
        *pdptr = (CUdeviceptr)(uintptr_t)p;
        r = CUDA_SUCCESS;
      }
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* A copy: check the context, the stream and every device range, then move. */
static CUresult fake_copy(uintptr_t dst, bool dst_dev, uintptr_t src, bool src_dev, size_t n,
                          CUstream s) {
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  if (r == CUDA_SUCCESS && !fake_stream_locked(s)) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && n > 0 &&
      (!dst || !src || (dst_dev && !fake_device_range_locked(dst, n)) ||
       (src_dev && !fake_device_range_locked(src, n))))
    r = CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_unlock(&F.mu);
  if (r == CUDA_SUCCESS && n > 0) memmove((void *)dst, (const void *)src, n);
  return r;
}

FAKE_API CUresult cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                    CUstream hStream) {
  FAKE_COUNT("cuMemcpyHtoDAsync");
  return fake_copy((uintptr_t)dstDevice, true, (uintptr_t)srcHost, false, ByteCount, hStream);
}

FAKE_API CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                    CUstream hStream) {
  FAKE_COUNT("cuMemcpyDtoHAsync");
  return fake_copy((uintptr_t)dstHost, false, (uintptr_t)srcDevice, true, ByteCount, hStream);
}

FAKE_API CUresult cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                    CUstream hStream) {
  FAKE_COUNT("cuMemcpyDtoDAsync");
  return fake_copy((uintptr_t)dstDevice, true, (uintptr_t)srcDevice, true, ByteCount, hStream);
}

static struct CUstream_st *fake_new_stream_locked(int test_owned) {
  struct CUstream_st *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->magic = FAKE_OBJ_MAGIC;
  s->test_owned = test_owned;
  s->next = F.streams;
  F.streams = s;
  return s;
}

static void fake_drop_stream_locked(struct CUstream_st *s) {
  for (struct CUstream_st **pp = &F.streams; *pp; pp = &(*pp)->next)
    if (*pp == s) {
      *pp = s->next;
      break;
    }
  /* Its pending events stay pending (the work "goes on") but forget it. */
  for (struct CUevent_st *e = F.events; e; e = e->next)
    if (e->stream == s) e->stream = NULL;
  s->magic = 0;
  free(s);
}

FAKE_API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
  FAKE_COUNT("cuStreamCreate");
  if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
  *phStream = NULL;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  if (r == CUDA_SUCCESS) {
    struct CUstream_st *s = fake_new_stream_locked(0);
    if (s) *phStream = s;
    else r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuStreamDestroy(CUstream hStream) {
  FAKE_COUNT("cuStreamDestroy");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  struct CUstream_st *s = r == CUDA_SUCCESS ? fake_stream_locked(hStream) : NULL;
  if (r == CUDA_SUCCESS && (!s || s == &F.legacy)) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) fake_drop_stream_locked(s);
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuStreamSynchronize(CUstream hStream) {
  FAKE_COUNT("cuStreamSynchronize");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  struct CUstream_st *s = r == CUDA_SUCCESS ? fake_stream_locked(hStream) : NULL;
  if (r == CUDA_SUCCESS && !s) r = CUDA_ERROR_INVALID_HANDLE;
  /* Re-find the stream after each wake-up: it may be destroyed meanwhile. */
  while (r == CUDA_SUCCESS && s && s->n_pending > 0) {
    pthread_cond_wait(&F.cv, &F.mu);
    s = fake_stream_locked(hStream);
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  FAKE_COUNT("cuEventCreate");
  const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (!phEvent || (Flags & ~known)) return CUDA_ERROR_INVALID_VALUE;
  *phEvent = NULL;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  if (r == CUDA_SUCCESS) {
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (e) {
      e->magic = FAKE_OBJ_MAGIC;
      e->next = F.events;
      F.events = e;
      *phEvent = e;
    } else {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
  FAKE_COUNT("cuEventRecord");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  struct CUevent_st *e = r == CUDA_SUCCESS ? fake_event_locked(hEvent) : NULL;
  struct CUstream_st *s = r == CUDA_SUCCESS ? fake_stream_locked(hStream) : NULL;
  if (r == CUDA_SUCCESS && (!e || !s)) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) {
    fake_complete_locked(e); /* re-recording replaces the earlier capture */
    e->stream = s;
    bool behind_wait = s->blocker && s->blocker->pending;
    if (F.hold_all || s->held || behind_wait) {
      e->pending = 1;
      e->blocked = !(F.hold_all || s->held);
      s->n_pending++;
      F.n_pending++;
    }
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* Work queued on hStream after this waits for hEvent's recording: events
 * recorded there stay pending until it completes. One wait per stream is
 * modelled (a newer wait replaces an older one). */
FAKE_API CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  FAKE_COUNT("cuStreamWaitEvent");
  if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  struct CUevent_st *e = r == CUDA_SUCCESS ? fake_event_locked(hEvent) : NULL;
  struct CUstream_st *s = r == CUDA_SUCCESS ? fake_stream_locked(hStream) : NULL;
  if (r == CUDA_SUCCESS && (!e || !s)) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && e->pending && e->stream != s) s->blocker = e;
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuEventQuery(CUevent hEvent) {
  FAKE_COUNT("cuEventQuery");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  struct CUevent_st *e = r == CUDA_SUCCESS ? fake_event_locked(hEvent) : NULL;
  if (r == CUDA_SUCCESS && !e) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && e->pending) r = CUDA_ERROR_NOT_READY;
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuEventSynchronize(CUevent hEvent) {
  FAKE_COUNT("cuEventSynchronize");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  struct CUevent_st *e = r == CUDA_SUCCESS ? fake_event_locked(hEvent) : NULL;
  if (r == CUDA_SUCCESS && !e) r = CUDA_ERROR_INVALID_HANDLE;
  while (r == CUDA_SUCCESS && e && e->pending) {
    pthread_cond_wait(&F.cv, &F.mu);
    e = fake_event_locked(hEvent); /* destroyed meanwhile: nothing left to wait for */
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuEventDestroy(CUevent hEvent) {
  FAKE_COUNT("cuEventDestroy");
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  struct CUevent_st *e = r == CUDA_SUCCESS ? fake_event_locked(hEvent) : NULL;
  if (r == CUDA_SUCCESS && !e) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) {
    /* Pending work is only modelled by events: dropping the event drops it. */
    fake_complete_locked(e);
    for (struct CUevent_st **pp = &F.events; *pp; pp = &(*pp)->next)
      if (*pp == e) {
        *pp = e->next;
        break;
      }
    e->magic = 0;
    free(e);
    pthread_cond_broadcast(&F.cv);
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* ---- cuGetProcAddress: base name -> the function above ---- */

/* X(name, abi): the CUDA version of the signature implemented; older ABIs are
 * not implemented, so asking for them answers VERSION_NOT_SUFFICIENT. */
#define FAKE_ENTRY_POINTS(X)                                                             \
  X(cuGetErrorName, 6000) X(cuGetErrorString, 6000) X(cuDriverGetVersion, 2020)          \
  X(cuInit, 2000) X(cuDeviceGetCount, 2000) X(cuDeviceGet, 2000)                         \
  X(cuDeviceGetAttribute, 2000) X(cuDeviceGetName, 2000) X(cuDeviceGetPCIBusId, 4010)    \
  X(cuDeviceTotalMem, 3020) X(cuDevicePrimaryCtxRetain, 7000)                            \
  X(cuDevicePrimaryCtxRelease, 11000) X(cuCtxGetCurrent, 4000) X(cuCtxPushCurrent, 4000) \
  X(cuCtxPopCurrent, 4000) X(cuMemGetInfo, 3020) X(cuMemAlloc, 3020) X(cuMemFree, 3020)  \
  X(cuMemHostRegister, 6050) X(cuMemHostUnregister, 4000)                                \
  X(cuMemHostGetDevicePointer, 3020) X(cuMemcpyHtoDAsync, 3020)                          \
  X(cuMemcpyDtoHAsync, 3020) X(cuMemcpyDtoDAsync, 3020) X(cuStreamCreate, 2000)          \
  X(cuStreamDestroy, 4000) X(cuStreamSynchronize, 2000) X(cuEventCreate, 2000)           \
  X(cuEventRecord, 2000) X(cuEventQuery, 2000) X(cuEventSynchronize, 2000)               \
  X(cuEventDestroy, 4000) X(cuStreamWaitEvent, 3020)

static const struct {
  const char *name; /* base name, as cuGetProcAddress is asked */
  void *fn;         /* this double's implementation */
  int abi;          /* CUDA version of its signature */
} fake_entries[] = {
/* #name is not macro-expanded ("cuMemAlloc"); &name is (cuMemAlloc_v2). */
#define FAKE_ENTRY_ROW(name, abi) {#name, (void *)&name, abi},
    FAKE_ENTRY_POINTS(FAKE_ENTRY_ROW)
#undef FAKE_ENTRY_ROW
};

FAKE_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus) {
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  *pfn = NULL;
  if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  int driver = 0;
  cuDriverGetVersion(&driver);
  if (cudaVersion > driver) return CUDA_ERROR_INVALID_VALUE; /* as the real driver */
  if (flags > (CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
    return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof fake_entries / sizeof fake_entries[0]; i++) {
    if (strcmp(symbol, fake_entries[i].name) != 0) continue;
    if (cudaVersion < fake_entries[i].abi) {
      if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      return CUDA_SUCCESS;
    }
    *pfn = fake_entries[i].fn;
    if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
  }
  return CUDA_SUCCESS; /* unknown (e.g. a versioned name like "cuMemAlloc_v2"): pfn NULL */
}

/* The CUDA 11.3 to 11.8 form, without the status. */
#undef cuGetProcAddress
FAKE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
FAKE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}

/* ---- control API (fake_cuda.h) ---- */

FAKE_API void fake_cuda_reset(void) {
  pthread_mutex_lock(&F.mu);
  F.calls = 0;
  F.fail_at = 0;
  F.fault_hit = 0;
  F.fault_call = "";
  F.hold_all = 0;
  for (struct CUstream_st *s = F.streams; s; s = s->next) s->held = 0;
  F.legacy.held = 0;
  for (struct CUevent_st *e = F.events; e; e = e->next) fake_complete_locked(e);
  pthread_cond_broadcast(&F.cv);
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_set_fail_at(uint64_t n, int result) {
  pthread_mutex_lock(&F.mu);
  F.calls = 0;
  F.fail_at = n;
  F.fail_result = (CUresult)result;
  F.fault_hit = 0;
  F.fault_call = "";
  pthread_mutex_unlock(&F.mu);
}

FAKE_API const char *fake_cuda_fault_call(void) {
  pthread_mutex_lock(&F.mu);
  const char *s = F.fault_call;
  pthread_mutex_unlock(&F.mu);
  return s;
}

FAKE_API void fake_cuda_get_stats(fake_cuda_stats *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&F.mu);
  out->calls = F.calls;
  for (fake_dalloc *a = F.dallocs; a; a = a->next) {
    out->device_allocs++;
    out->device_bytes += a->accounted;
  }
  for (fake_hreg *h = F.hregs; h; h = h->next) out->host_registrations++;
  for (struct CUstream_st *s = F.streams; s; s = s->next) out->streams += !s->test_owned;
  for (struct CUevent_st *e = F.events; e; e = e->next) out->events++;
  out->pending_events = F.n_pending;
  for (int d = 0; d < FAKE_MAX_DEVICES; d++) out->ctx_retains += (uint64_t)F.ctx[d].retains;
  out->fault_hit = (uint64_t)F.fault_hit;
  pthread_mutex_unlock(&F.mu);
}

FAKE_API uint64_t fake_cuda_live_allocations(void) {
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  return st.device_allocs + st.host_registrations;
}

FAKE_API void fake_cuda_hold_events(int on) {
  pthread_mutex_lock(&F.mu);
  F.hold_all = on != 0;
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_complete_events(void) {
  pthread_mutex_lock(&F.mu);
  for (struct CUevent_st *e = F.events; e; e = e->next) fake_complete_locked(e);
  pthread_cond_broadcast(&F.cv);
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void *fake_cuda_stream_create(void) {
  pthread_mutex_lock(&F.mu);
  void *s = fake_new_stream_locked(1);
  pthread_mutex_unlock(&F.mu);
  return s;
}

FAKE_API void fake_cuda_stream_destroy(void *stream) {
  pthread_mutex_lock(&F.mu);
  struct CUstream_st *s = fake_stream_locked(stream);
  if (s && s != &F.legacy) fake_drop_stream_locked(s);
  pthread_cond_broadcast(&F.cv);
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_hold_stream(void *stream, int on) {
  pthread_mutex_lock(&F.mu);
  struct CUstream_st *s = fake_stream_locked(stream);
  if (s) s->held = on != 0;
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_complete_stream(void *stream) {
  pthread_mutex_lock(&F.mu);
  struct CUstream_st *s = fake_stream_locked(stream);
  for (struct CUevent_st *e = F.events; s && e; e = e->next)
    if (e->stream == s) fake_complete_locked(e);
  pthread_cond_broadcast(&F.cv);
  pthread_mutex_unlock(&F.mu);
}
