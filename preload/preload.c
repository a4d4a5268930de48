/*
 * preload.c — libsgm-preload.so: Windows' sysmem fallback for unmodified CUDA
 * programs (docs/preload.md; DESIGN.md §9 "The preload layer").
 *
 * Loaded with LD_PRELOAD (or /etc/ld.so.preload), it sits in front of the
 * CUDA driver and is a client of libsgm's public API only (sgm.h: a context
 * per device, sgm_alloc_shared, sgm_free, sgm_interpose_vram). It catches the
 * three ways a program reaches the driver:
 *
 *   direct link     the exported names below (cuMemAlloc_v2, cuMemAllocAsync_ptsz, ...)
 *                   come first in the global scope;
 *   dlsym           dlsym (exported under both glibc versions, GLIBC_2.2.5 and
 *                   GLIBC_2.34) swaps a pointer that is a real hooked function
 *                   for its hook; dlvsym@@GLIBC_2.34 likewise;
 *   cuGetProcAddress  (v1 11.3 ABI and v2 12.0 ABI) calls the real one and swaps
 *                   the returned pointer the same way.
 *
 * Every swap is BY POINTER: at init each hook row (base name, ABI version,
 * per-thread-default-stream flag) asks the real cuGetProcAddress, and the
 * driver's export, which function implements it; a pointer found in that map
 * is replaced by the hook with exactly that ABI and stream flag. Anything
 * else (unknown names, cuGetExportTable, newer ABIs) passes through untouched.
 * Only names matching cu[A-Z] are looked at (not cudnn*, cublas*).
 *
 * What the hooks do: the program's allocations stay the driver's; each is
 * accounted (a pointer table here, sgm_interpose_vram for the node
 * registry). When the process's VRAM budget (sgm's: fair share, SGM_VRAM_LIMIT,
 * CUDA_DEVICE_MEMORY_LIMIT) would be passed, or the driver answers
 * OUT_OF_MEMORY, the request is served from sgm's shared tier
 * (sgm_alloc_shared, ordered on the caller's stream) — except inside a
 * stream capture and with SGM_PRELOAD_FALLBACK=off, where the program sees
 * OUT_OF_MEMORY (quotas only, HAMi's behaviour).
 *
 * Safety rules (each has a test in tests/preload/):
 *  - a NULL real entry is never called (the hook answers CUDA_ERROR_NOT_SUPPORTED);
 *  - fork: the child's hooks pass through until it calls cuInit itself;
 *  - init: lazy (pthread_once) from the first hook or dlsym, safe before
 *    cuInit, from constructors and from several threads; a thread-local
 *    guard makes dlsym pass through while the preload or libsgm loads the
 *    driver (libsgm's own lookups are recognised by caller address too);
 *  - a driver outside the checked range (CUDA 12.x, 13.x) makes every hook
 *    pass through, with one warning.
 *
 * Threading: the pointer tables are striped by address (PRE_STRIPES mutexes);
 * per-device state is created once under pre_dev_mu; counters are atomics.
 * Calls: the real driver (through the pointers resolved at init) and libsgm.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>
#include <sgm.h>

#define PRE_API __attribute__((visibility("default")))
/* The driver versions whose ABIs the hook table was checked against
 * (cudaTypedefs.h of CUDA 13.0; 12.x changed only cuGetProcAddress among the
 * hooked functions). Outside: pass through, warn once. */
#define PRE_DRIVER_MIN 12000
#define PRE_DRIVER_MAX 13999
#define PRE_MAX_DEVICES 16
/* Lock stripes of the pointer tables: enough that threads allocating at
 * once rarely meet, few enough to stay small. */
#define PRE_STRIPES 64
/* The cached VRAM budget is re-read from sgm every this many allocations
 * (and whenever a request would pass it): fair shares move slowly. */
#define PRE_BUDGET_REFRESH 256

/* ------------------------------------------------------------------------ */
/* The real dlsym and dlvsym. */

typedef void *(*pre_dlsym_fn)(void *, const char *);
typedef void *(*pre_dlvsym_fn)(void *, const char *, const char *);
/* The compat version of libc's dlvsym: we export only dlvsym@@GLIBC_2.34, so
 * this reference binds to libc's, never to ours. */
extern void *pre_libc_dlvsym(void *, const char *, const char *);
__asm__(".symver pre_libc_dlvsym, dlvsym@GLIBC_2.2.5");

/* The dlsym path runs before a sanitizer runtime has finished starting (ASan
 * and TSan resolve their interceptors with dlsym from their own init): no
 * instrumentation there. */
#define PRE_EARLY __attribute__((no_sanitize("address", "thread", "undefined")))

static pre_dlsym_fn pre_real_dlsym_p;
static pre_dlvsym_fn pre_real_dlvsym_p;
static _Thread_local int pre_guard; /* > 0: inside the preload or libsgm loading the driver */

PRE_EARLY static pre_dlsym_fn pre_real_dlsym(void) {
  pre_dlsym_fn f = __atomic_load_n(&pre_real_dlsym_p, __ATOMIC_ACQUIRE);
  if (!f) {
    f = (pre_dlsym_fn)pre_libc_dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!f) f = (pre_dlsym_fn)pre_libc_dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&pre_real_dlsym_p, f, __ATOMIC_RELEASE);
  }
  return f;
}

PRE_EARLY static pre_dlvsym_fn pre_real_dlvsym(void) {
  pre_dlvsym_fn f = __atomic_load_n(&pre_real_dlvsym_p, __ATOMIC_ACQUIRE);
  if (!f) {
    f = (pre_dlvsym_fn)pre_libc_dlvsym(RTLD_NEXT, "dlvsym", "GLIBC_2.34");
    if (!f) f = (pre_dlvsym_fn)pre_libc_dlvsym;
    __atomic_store_n(&pre_real_dlvsym_p, f, __ATOMIC_RELEASE);
  }
  return f;
}

/* ------------------------------------------------------------------------ */
/* Messages: stderr, prefixed, each kind once per process. */

static void pre_warn_once(atomic_int *once, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void pre_warn_once(atomic_int *once, const char *fmt, ...) {
  if (once && atomic_exchange(once, 1)) return;
  va_list ap;
  va_start(ap, fmt);
  char buf[768];
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "libsgm-preload: %s\n", buf);
}

/* ------------------------------------------------------------------------ */
/* The hook table. */

/* Hook prototypes (definitions below), exported under the driver's names. */
#define PRE_HOOKS(X)                                                                                    \
  /* X(row id, base name, ABI version, per-thread, exported name) */                                   \
  X(INIT, cuInit, 2000, 0, cuInit)                                                                      \
  X(GPA1, cuGetProcAddress, 11030, 0, cuGetProcAddress)                                                 \
  X(GPA2, cuGetProcAddress, 12000, 0, cuGetProcAddress_v2)                                              \
  X(GETINFO, cuMemGetInfo, 3020, 0, cuMemGetInfo_v2)                                                    \
  X(ALLOC, cuMemAlloc, 3020, 0, cuMemAlloc_v2)                                                          \
  X(PITCH, cuMemAllocPitch, 3020, 0, cuMemAllocPitch_v2)                                                \
  X(FREE, cuMemFree, 3020, 0, cuMemFree_v2)                                                             \
  X(MANAGED, cuMemAllocManaged, 6000, 0, cuMemAllocManaged)                                             \
  X(ASYNC, cuMemAllocAsync, 11020, 0, cuMemAllocAsync)                                                  \
  X(ASYNC_PT, cuMemAllocAsync, 11020, 1, cuMemAllocAsync_ptsz)                                          \
  X(POOL, cuMemAllocFromPoolAsync, 11020, 0, cuMemAllocFromPoolAsync)                                   \
  X(POOL_PT, cuMemAllocFromPoolAsync, 11020, 1, cuMemAllocFromPoolAsync_ptsz)                           \
  X(FREEASYNC, cuMemFreeAsync, 11020, 0, cuMemFreeAsync)                                                \
  X(FREEASYNC_PT, cuMemFreeAsync, 11020, 1, cuMemFreeAsync_ptsz)                                        \
  X(CREATE, cuMemCreate, 10020, 0, cuMemCreate)                                                         \
  X(RELEASE, cuMemRelease, 10020, 0, cuMemRelease)                                                      \
  X(PTRATTR, cuPointerGetAttribute, 4000, 0, cuPointerGetAttribute)                                     \
  X(PTRATTRS, cuPointerGetAttributes, 7000, 0, cuPointerGetAttributes)                                  \
  X(IPC, cuIpcGetMemHandle, 4010, 0, cuIpcGetMemHandle)

/* Driver calls the preload makes itself (not hooked). */
#define PRE_USES(X)                                                                                     \
  X(cuDriverGetVersion, 2020) X(cuCtxGetDevice, 2000) X(cuCtxSynchronize, 2000)                         \
  X(cuStreamIsCapturing, 10000) X(cuCtxGetCurrent, 4000) X(cuDevicePrimaryCtxRetain, 7000)             \
  X(cuDevicePrimaryCtxRelease, 11000)

enum {
#define PRE_ID(id, base, abi, pt, exp) PRE_##id,
  PRE_HOOKS(PRE_ID)
#undef PRE_ID
  PRE_N_HOOKS
};

enum {
#define PRE_UID(name, abi) PRE_U_##name,
  PRE_USES(PRE_UID)
#undef PRE_UID
  PRE_N_USES
};

typedef struct pre_row {
  const char *base;     /* base name, as cuGetProcAddress is asked */
  int abi;              /* CUDA version of the signature the hook implements */
  int per_thread;       /* 1: the per-thread default stream variant */
  const char *exported; /* the driver's exported name of that ABI */
  void *hook;           /* ours */
  void *real;           /* the driver's (NULL: it has none: the hook never calls it) */
  void *real_gpa;       /* what cuGetProcAddress answered for (base, abi, flag), if different */
} pre_row;

/* Forward declarations of the hooks, with the driver's prototypes. */
PRE_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
PRE_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                              CUstream hStream);
PRE_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
#undef cuGetProcAddress
PRE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);

static pre_row pre_rows[PRE_N_HOOKS] = {
#define PRE_ROW(id, b, a, pt, exp) [PRE_##id] = {#b, a, pt, #exp, (void *)&exp, NULL, NULL},
    PRE_HOOKS(PRE_ROW)
#undef PRE_ROW
};

static struct {
  const char *name;
  int abi;
  void *fn;
} pre_uses[PRE_N_USES] = {
#define PRE_UROW(n, a) [PRE_U_##n] = {#n, a, NULL},
    PRE_USES(PRE_UROW)
#undef PRE_UROW
};

#define REAL(id, type) ((type)pre_rows[PRE_##id].real)
#define USE(name, type) ((type)pre_uses[PRE_U_##name].fn)

/* ------------------------------------------------------------------------ */
/* State. */

typedef enum { PRE_OFF = 0, PRE_ON = 1, PRE_PASS = 2 } pre_mode;

typedef struct pre_dev {
  sgm_context *ctx;          /* sgm's context on this device (NULL: not made, or failed) */
  bool tried;                /* creation was attempted (a failure is not retried) */
  atomic_uint_fast64_t used; /* the program's driver bytes on this device, as accounted */
  atomic_uint_fast64_t budget; /* the cached VRAM budget (0 = unknown) */
  atomic_uint_fast64_t n_allocs; /* allocations seen (budget refresh) */
} pre_dev;

static struct {
  pthread_once_t once;
  atomic_int mode;          /* pre_mode */
  void *libcuda;            /* our handle on the driver */
  int driver_version;       /* cuDriverGetVersion */
  bool fallback;            /* SGM_PRELOAD_FALLBACK (default on) */
  pthread_mutex_t dev_mu;   /* creates devs[i].ctx */
  pre_dev devs[PRE_MAX_DEVICES];
  Dl_info self;             /* this library (dladdr) */
  void *sgm_base;           /* libsgm.so's load address (its dlsym calls pass through) */
  /* counters for the report (SGM_PRELOAD_REPORT) */
  atomic_uint_fast64_t n_allocs, n_fallbacks, fallback_bytes, n_fallback_live, n_quota_refusals;
  atomic_uint_fast64_t n_swaps; /* pointers swapped for hooks by dlsym / cuGetProcAddress */
  atomic_int warned_version, warned_ctx, warned_attr, warned_ipc, warned_quota, warned_nofb;
} P = {.once = PTHREAD_ONCE_INIT, .dev_mu = PTHREAD_MUTEX_INITIALIZER};

/* ------------------------------------------------------------------------ */
/* Pointer tables: address (or VMM handle) -> what it is. */

typedef enum { PRE_K_DRIVER = 0, PRE_K_FALLBACK = 1, PRE_K_MANAGED = 2, PRE_K_VMM = 3 } pre_kind;

typedef struct pre_entry {
  uint64_t key;            /* device address, or VMM handle */
  uint64_t bytes;          /* size asked for */
  int device;              /* ordinal */
  pre_kind kind;
  struct pre_entry *next;  /* chain in its bucket */
} pre_entry;

#define PRE_BUCKETS 4096u /* per table; chains stay short for thousands of live blocks */
typedef struct pre_table {
  pthread_mutex_t mu[PRE_STRIPES];
  pre_entry *bucket[PRE_BUCKETS];
} pre_table;

static pre_table pre_ptrs, pre_handles;

static unsigned pre_hash(uint64_t k) {
  k ^= k >> 33;
  k *= UINT64_C(0xff51afd7ed558ccd);
  k ^= k >> 33;
  return (unsigned)(k % PRE_BUCKETS);
}

static void pre_table_init(pre_table *t) {
  for (int i = 0; i < PRE_STRIPES; i++) pthread_mutex_init(&t->mu[i], NULL);
}

/* Insert; false when out of host memory (the caller undoes the allocation). */
static bool pre_table_put(pre_table *t, uint64_t key, uint64_t bytes, int device, pre_kind kind) {
  pre_entry *e = malloc(sizeof *e);
  if (!e) return false;
  unsigned h = pre_hash(key);
  *e = (pre_entry){key, bytes, device, kind, NULL};
  pthread_mutex_lock(&t->mu[h % PRE_STRIPES]);
  e->next = t->bucket[h];
  t->bucket[h] = e;
  pthread_mutex_unlock(&t->mu[h % PRE_STRIPES]);
  return true;
}

/* Remove and return (free with free()); NULL when unknown. */
static pre_entry *pre_table_take(pre_table *t, uint64_t key) {
  unsigned h = pre_hash(key);
  pthread_mutex_lock(&t->mu[h % PRE_STRIPES]);
  pre_entry *e = NULL;
  for (pre_entry **pp = &t->bucket[h]; *pp; pp = &(*pp)->next)
    if ((*pp)->key == key) {
      e = *pp;
      *pp = e->next;
      break;
    }
  pthread_mutex_unlock(&t->mu[h % PRE_STRIPES]);
  return e;
}

static void pre_table_back(pre_table *t, pre_entry *e) {
  unsigned h = pre_hash(e->key);
  pthread_mutex_lock(&t->mu[h % PRE_STRIPES]);
  e->next = t->bucket[h];
  t->bucket[h] = e;
  pthread_mutex_unlock(&t->mu[h % PRE_STRIPES]);
}

/* Fallback blocks by range (pointer attributes and IPC take interior
 * pointers): a small array, searched only while fallback blocks live. */
static struct {
  pthread_mutex_t mu;
  uint64_t (*r)[2]; /* [base, end) */
  size_t n, cap;
} pre_fb = {.mu = PTHREAD_MUTEX_INITIALIZER};

static bool pre_fb_add(uint64_t base, uint64_t bytes) {
  pthread_mutex_lock(&pre_fb.mu);
  bool ok = true;
  if (pre_fb.n == pre_fb.cap) {
    size_t cap = pre_fb.cap ? pre_fb.cap * 2 : 64;
    void *r = realloc(pre_fb.r, cap * sizeof *pre_fb.r);
    if (!r) ok = false;
    else {
      pre_fb.r = r;
      pre_fb.cap = cap;
    }
  }
  if (ok) {
    pre_fb.r[pre_fb.n][0] = base;
    pre_fb.r[pre_fb.n][1] = base + bytes;
    pre_fb.n++;
    atomic_fetch_add(&P.n_fallback_live, 1);
  }
  pthread_mutex_unlock(&pre_fb.mu);
  return ok;
}

static void pre_fb_remove(uint64_t base) {
  pthread_mutex_lock(&pre_fb.mu);
  for (size_t i = 0; i < pre_fb.n; i++)
    if (pre_fb.r[i][0] == base) {
      pre_fb.r[i][0] = pre_fb.r[pre_fb.n - 1][0];
      pre_fb.r[i][1] = pre_fb.r[pre_fb.n - 1][1];
      pre_fb.n--;
      atomic_fetch_sub(&P.n_fallback_live, 1);
      break;
    }
  pthread_mutex_unlock(&pre_fb.mu);
}

static bool pre_fb_contains(uint64_t p) {
  if (atomic_load_explicit(&P.n_fallback_live, memory_order_relaxed) == 0) return false;
  pthread_mutex_lock(&pre_fb.mu);
  bool in = false;
  for (size_t i = 0; i < pre_fb.n && !in; i++) in = p >= pre_fb.r[i][0] && p < pre_fb.r[i][1];
  pthread_mutex_unlock(&pre_fb.mu);
  return in;
}

/* ------------------------------------------------------------------------ */
/* Init. */

static bool pre_env_off(const char *name) {
  const char *v = getenv(name);
  return v && (!strcmp(v, "0") || !strcasecmp(v, "off") || !strcasecmp(v, "false") || !strcasecmp(v, "no"));
}

static void pre_fork_child(void) {
  /* The parent's contexts and pointers are not the child's: pass through
   * until the child initialises CUDA itself (cuInit). */
  atomic_store(&P.mode, PRE_PASS);
  for (int i = 0; i < PRE_MAX_DEVICES; i++) {
    P.devs[i].ctx = NULL; /* left to the child's exit: sgm refuses inherited contexts */
    P.devs[i].tried = false;
    atomic_store(&P.devs[i].used, 0);
    atomic_store(&P.devs[i].budget, 0);
  }
  pthread_mutex_init(&P.dev_mu, NULL);
}

typedef CUresult (*pre_gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static void pre_init(void) {
  pre_guard++;
  pre_table_init(&pre_ptrs);
  pre_table_init(&pre_handles);
  P.fallback = !pre_env_off("SGM_PRELOAD_FALLBACK");
  dladdr((void *)&pre_init, &P.self);
  Dl_info si;
  if (dladdr((void *)&sgm_alloc_shared, &si)) P.sgm_base = si.dli_fbase;
  P.libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!P.libcuda) {
    atomic_store(&P.mode, PRE_PASS);
    pre_guard--;
    return;
  }
  pre_dlsym_fn rd = pre_real_dlsym();
  for (int i = 0; i < PRE_N_HOOKS; i++) pre_rows[i].real = rd(P.libcuda, pre_rows[i].exported);
  for (int i = 0; i < PRE_N_USES; i++) pre_uses[i].fn = rd(P.libcuda, pre_uses[i].name);
  pre_gpa2_fn gpa = REAL(GPA2, pre_gpa2_fn);
  /* By pointer: what the driver's cuGetProcAddress hands out for each row. */
  for (int i = 0; gpa && i < PRE_N_HOOKS; i++) {
    void *p = NULL;
    cuuint64_t fl = pre_rows[i].per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                           : CU_GET_PROC_ADDRESS_LEGACY_STREAM;
    CUdriverProcAddressQueryResult st;
    if (gpa(pre_rows[i].base, &p, pre_rows[i].abi, fl, &st) == CUDA_SUCCESS && p) {
      if (!pre_rows[i].real) pre_rows[i].real = p; /* ptsz variants the driver does not export */
      else if (p != pre_rows[i].real) pre_rows[i].real_gpa = p;
    }
  }
  for (int i = 0; gpa && i < PRE_N_USES; i++)
    if (!pre_uses[i].fn) {
      void *p = NULL;
      CUdriverProcAddressQueryResult st;
      if (gpa(pre_uses[i].name, &p, pre_uses[i].abi, 0, &st) == CUDA_SUCCESS) pre_uses[i].fn = p;
    }
  int v = 0;
  if (USE(cuDriverGetVersion, CUresult(*)(int *)) &&
      USE(cuDriverGetVersion, CUresult(*)(int *))(&v) == CUDA_SUCCESS)
    P.driver_version = v;
  if (v < PRE_DRIVER_MIN || v > PRE_DRIVER_MAX) {
    pre_warn_once(&P.warned_version, "driver version %d.%d is outside the range this preload's hook "
                  "table was checked against (CUDA %d.x to %d.x): every call passes through "
                  "unaccounted and without fallback (docs/preload.md)",
                  v / 1000, (v % 1000) / 10, PRE_DRIVER_MIN / 1000, PRE_DRIVER_MAX / 1000);
    atomic_store(&P.mode, PRE_PASS);
  } else if (!USE(cuCtxGetDevice, void *)) {
    pre_warn_once(&P.warned_version, "the driver has no cuCtxGetDevice: every call passes through");
    atomic_store(&P.mode, PRE_PASS);
  } else {
    atomic_store(&P.mode, PRE_ON);
  }
  pthread_atfork(NULL, NULL, pre_fork_child);
  pre_guard--;
}

/* Initialised; PRE_PASS also for a call libsgm makes while the preload is
 * inside it on this thread (a driver that does not bind its own references
 * could hand libsgm a hook: it must reach the driver, not the preload again). */
static pre_mode pre_ready(void) {
  pthread_once(&P.once, pre_init);
  if (pre_guard) return PRE_PASS;
  return (pre_mode)atomic_load_explicit(&P.mode, memory_order_acquire);
}

/* The device's state with its sgm context made (NULL: none; pass through). */
static pre_dev *pre_device(int ord) {
  if (ord < 0 || ord >= PRE_MAX_DEVICES) return NULL;
  pre_dev *d = &P.devs[ord];
  if (__atomic_load_n(&d->ctx, __ATOMIC_ACQUIRE)) return d;
  pthread_mutex_lock(&P.dev_mu);
  if (!d->tried) {
    d->tried = true;
    sgm_config cfg;
    sgm_config_init(&cfg);
    cfg.device = ord;
    sgm_context *c = NULL;
    pre_guard++;
    sgm_status s = cfg.error[0] ? SGM_ERR_INVALID : sgm_context_create(&cfg, &c);
    pre_guard--;
    if (s != SGM_OK) {
      pre_warn_once(&P.warned_ctx, "cannot open sgm on device %d: %s: this device runs without "
                    "accounting or fallback", ord, cfg.error[0] ? cfg.error : sgm_last_error());
    } else {
      sgm_interpose_vram(c, 0); /* marks the process interposed in the registry */
      sgm_stats st;
      if (sgm_get_stats(c, &st) == SGM_OK) atomic_store(&d->budget, st.tier[SGM_TIER_VRAM].budget_bytes);
      __atomic_store_n(&d->ctx, c, __ATOMIC_RELEASE);
    }
  }
  pthread_mutex_unlock(&P.dev_mu);
  return __atomic_load_n(&d->ctx, __ATOMIC_ACQUIRE) ? d : NULL;
}

/* The calling thread's device's state, NULL when there is none. */
static pre_dev *pre_current(int *ord) {
  CUdevice dev = -1;
  if (USE(cuCtxGetDevice, CUresult(*)(CUdevice *))(&dev) != CUDA_SUCCESS) return NULL;
  *ord = (int)dev;
  return pre_device((int)dev);
}

/* The VRAM budget (0: unknown, no limit applied), re-read from sgm when
 * asked or every PRE_BUDGET_REFRESH calls. */
static uint64_t pre_budget(pre_dev *d, bool refresh) {
  uint64_t n = atomic_fetch_add_explicit(&d->n_allocs, 1, memory_order_relaxed);
  if (refresh || n % PRE_BUDGET_REFRESH == 0) {
    sgm_stats st;
    if (sgm_get_stats(d->ctx, &st) == SGM_OK) atomic_store(&d->budget, st.tier[SGM_TIER_VRAM].budget_bytes);
  }
  return atomic_load_explicit(&d->budget, memory_order_relaxed);
}

static void pre_account(pre_dev *d, int64_t delta) {
  if (delta >= 0) atomic_fetch_add_explicit(&d->used, (uint64_t)delta, memory_order_relaxed);
  else atomic_fetch_sub_explicit(&d->used, (uint64_t)-delta, memory_order_relaxed);
  sgm_interpose_vram(d->ctx, delta);
}

/* ------------------------------------------------------------------------ */
/* Allocation. */

typedef enum { PRE_A_SYNC, PRE_A_ASYNC, PRE_A_POOL, PRE_A_PITCH } pre_akind;

/* The stream sgm is handed: the per-thread variants' NULL is the per-thread stream. */
static CUstream pre_stream(CUstream s, bool per_thread) { return !s && per_thread ? CU_STREAM_PER_THREAD : s; }

static CUresult pre_call_real(int row, pre_akind k, CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h,
                              unsigned esz, size_t bytes, CUmemoryPool pool, CUstream s) {
  void *f = pre_rows[row].real;
  if (!f) return CUDA_ERROR_NOT_SUPPORTED; /* never call a NULL entry */
  switch (k) {
  case PRE_A_SYNC: return ((CUresult(*)(CUdeviceptr *, size_t))f)(dptr, bytes);
  case PRE_A_ASYNC: return ((CUresult(*)(CUdeviceptr *, size_t, CUstream))f)(dptr, bytes, s);
  case PRE_A_POOL:
    return ((CUresult(*)(CUdeviceptr *, size_t, CUmemoryPool, CUstream))f)(dptr, bytes, pool, s);
  case PRE_A_PITCH:
    return ((CUresult(*)(CUdeviceptr *, size_t *, size_t, size_t, unsigned))f)(dptr, pitch, w, h, esz);
  }
  return CUDA_ERROR_INVALID_VALUE;
}

/* The heart: account the driver's allocation, or serve it from shared GPU
 * memory when the budget or the device is full. */
static CUresult pre_alloc(int row, pre_akind k, CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h,
                          unsigned esz, size_t bytes, CUmemoryPool pool, CUstream s) {
  if (pre_ready() != PRE_ON || !dptr) return pre_call_real(row, k, dptr, pitch, w, h, esz, bytes, pool, s);
  if (!pre_rows[row].real) return CUDA_ERROR_NOT_SUPPORTED;
  int ord = -1;
  pre_dev *d = pre_current(&ord);
  if (!d) return pre_call_real(row, k, dptr, pitch, w, h, esz, bytes, pool, s);
  atomic_fetch_add_explicit(&P.n_allocs, 1, memory_order_relaxed);
  size_t want = bytes;
  if (k == PRE_A_PITCH) {
    /* pitch rounded as the driver does (to 512 bytes), for the budget check only */
    size_t pr = (w + 511) & ~(size_t)511;
    want = pr * h;
  }
  uint64_t used = atomic_load_explicit(&d->used, memory_order_relaxed);
  uint64_t budget = pre_budget(d, false);
  if (budget && used + want > budget) budget = pre_budget(d, true); /* fresh before refusing */
  bool over = budget && used + want > budget;
  CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
  if (over && !P.fallback) {
    atomic_fetch_add(&P.n_quota_refusals, 1);
    pre_warn_once(&P.warned_quota, "device %d: a %zu-byte allocation would pass this process's VRAM "
                  "budget (%llu bytes in use; SGM_VRAM_LIMIT, CUDA_DEVICE_MEMORY_LIMIT, fair share) and "
                  "SGM_PRELOAD_FALLBACK=off: answered CUDA_ERROR_OUT_OF_MEMORY",
                  ord, want, (unsigned long long)used);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (!over) {
    r = pre_call_real(row, k, dptr, pitch, w, h, esz, bytes, pool, s);
    if (r == CUDA_SUCCESS) {
      size_t got = k == PRE_A_PITCH ? *pitch * h : bytes;
      if (!pre_table_put(&pre_ptrs, *dptr, got, ord, PRE_K_DRIVER)) {
        pre_warn_once(&P.warned_ctx, "out of host memory for the pointer table: one allocation unaccounted");
        return r;
      }
      pre_account(d, (int64_t)got);
      return r;
    }
    if (r != CUDA_ERROR_OUT_OF_MEMORY || !P.fallback) return r;
  }
  /* Fallback. Never inside a capture: the graph would hold host memory it
   * cannot own; the program sees the driver's answer. */
  bool per_thread = pre_rows[row].per_thread != 0;
  CUstream ss = k == PRE_A_ASYNC || k == PRE_A_POOL ? pre_stream(s, per_thread) : NULL;
  if (k == PRE_A_ASYNC || k == PRE_A_POOL) {
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult (*isc)(CUstream, CUstreamCaptureStatus *) = USE(cuStreamIsCapturing, CUresult(*)(CUstream, CUstreamCaptureStatus *));
    if (!isc || isc(ss, &cs) != CUDA_SUCCESS || cs != CU_STREAM_CAPTURE_STATUS_NONE) return r;
  }
  size_t fb_bytes = want;
  pre_guard++;
  void *p = sgm_alloc_shared(d->ctx, fb_bytes, (void *)ss);
  pre_guard--;
  if (!p) {
    pre_warn_once(&P.warned_nofb, "device %d: %zu bytes did not fit in VRAM and shared GPU memory "
                  "could not serve them either: %s", ord, fb_bytes, sgm_last_error());
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (!pre_table_put(&pre_ptrs, (uint64_t)(uintptr_t)p, fb_bytes, ord, PRE_K_FALLBACK) ||
      !pre_fb_add((uint64_t)(uintptr_t)p, fb_bytes)) {
    pre_entry *e = pre_table_take(&pre_ptrs, (uint64_t)(uintptr_t)p);
    free(e);
    sgm_free(d->ctx, p, (void *)ss);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  atomic_fetch_add(&P.n_fallbacks, 1);
  atomic_fetch_add(&P.fallback_bytes, fb_bytes);
  *dptr = (CUdeviceptr)(uintptr_t)p;
  if (k == PRE_A_PITCH) *pitch = (w + 511) & ~(size_t)511;
  return CUDA_SUCCESS;
}

/* A free: an accounted block's bytes come back; a fallback block goes back
 * to sgm, after the work the program queued (sync: the whole context, as
 * cuMemFree synchronises; async: ordered on the stream). */
static CUresult pre_free(int row, CUdeviceptr p, bool async, CUstream s) {
  void *f = pre_rows[row].real;
  pre_entry *e = pre_ready() == PRE_ON && p ? pre_table_take(&pre_ptrs, p) : NULL;
  if (e && e->kind == PRE_K_FALLBACK) {
    pre_dev *d = &P.devs[e->device];
    CUstream ss = async ? pre_stream(s, pre_rows[row].per_thread != 0) : NULL;
    if (!async) {
      CUresult (*sync)(void) = USE(cuCtxSynchronize, CUresult(*)(void));
      CUresult r = sync ? sync() : CUDA_ERROR_NOT_SUPPORTED;
      if (r != CUDA_SUCCESS) {
        pre_table_back(&pre_ptrs, e);
        return r;
      }
    }
    pre_fb_remove(p);
    pre_guard++;
    sgm_status st = sgm_free_ex(d->ctx, (void *)(uintptr_t)p, (void *)ss);
    pre_guard--;
    free(e);
    return st == SGM_OK ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  }
  if (!f) {
    if (e) pre_table_back(&pre_ptrs, e);
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  CUresult r = async ? ((CUresult(*)(CUdeviceptr, CUstream))f)(p, s) : ((CUresult(*)(CUdeviceptr))f)(p);
  if (e) {
    if (r == CUDA_SUCCESS) {
      pre_account(&P.devs[e->device], -(int64_t)e->bytes);
      free(e);
    } else {
      pre_table_back(&pre_ptrs, e);
    }
  }
  return r;
}

/* ------------------------------------------------------------------------ */
/* The hooks (exported under the driver's names). */

PRE_API CUresult cuInit(unsigned int Flags) {
  pre_ready();
  CUresult (*f)(unsigned) = REAL(INIT, CUresult(*)(unsigned));
  if (!f) return CUDA_ERROR_NOT_SUPPORTED;
  CUresult r = f(Flags);
  /* A fork child that initialises CUDA itself gets the hooks back. */
  if (r == CUDA_SUCCESS && atomic_load(&P.mode) == PRE_PASS && P.driver_version >= PRE_DRIVER_MIN &&
      P.driver_version <= PRE_DRIVER_MAX && USE(cuCtxGetDevice, void *))
    atomic_store(&P.mode, PRE_ON);
  return r;
}

PRE_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
  return pre_alloc(PRE_ALLOC, PRE_A_SYNC, dptr, NULL, 0, 0, 0, bytesize, NULL, NULL);
}

PRE_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                    unsigned int ElementSizeBytes) {
  if (!pPitch) return pre_call_real(PRE_PITCH, PRE_A_PITCH, dptr, pPitch, WidthInBytes, Height,
                                    ElementSizeBytes, 0, NULL, NULL);
  return pre_alloc(PRE_PITCH, PRE_A_PITCH, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, 0, NULL, NULL);
}

PRE_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
  return pre_alloc(PRE_ASYNC, PRE_A_ASYNC, dptr, NULL, 0, 0, 0, bytesize, NULL, hStream);
}

PRE_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
  return pre_alloc(PRE_ASYNC_PT, PRE_A_ASYNC, dptr, NULL, 0, 0, 0, bytesize, NULL, hStream);
}

PRE_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                         CUstream hStream) {
  return pre_alloc(PRE_POOL, PRE_A_POOL, dptr, NULL, 0, 0, 0, bytesize, pool, hStream);
}

PRE_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                              CUstream hStream) {
  return pre_alloc(PRE_POOL_PT, PRE_A_POOL, dptr, NULL, 0, 0, 0, bytesize, pool, hStream);
}

PRE_API CUresult cuMemFree_v2(CUdeviceptr dptr) { return pre_free(PRE_FREE, dptr, false, NULL); }
PRE_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
  return pre_free(PRE_FREEASYNC, dptr, true, hStream);
}
PRE_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
  return pre_free(PRE_FREEASYNC_PT, dptr, true, hStream);
}

/* Managed memory: accounted, never a fallback (the driver pages it itself). */
PRE_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
  CUresult (*f)(CUdeviceptr *, size_t, unsigned) = REAL(MANAGED, CUresult(*)(CUdeviceptr *, size_t, unsigned));
  pre_mode m = pre_ready();
  if (!f) return CUDA_ERROR_NOT_SUPPORTED;
  CUresult r = f(dptr, bytesize, flags);
  int ord = -1;
  pre_dev *d = r == CUDA_SUCCESS && m == PRE_ON ? pre_current(&ord) : NULL;
  if (d && pre_table_put(&pre_ptrs, *dptr, bytesize, ord, PRE_K_MANAGED)) pre_account(d, (int64_t)bytesize);
  return r;
}

/* VMM: device-located physical memory is accounted; host locations pass
 * through untouched (a cuMemCreate hook must never refuse them). */
PRE_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                             unsigned long long flags) {
  CUresult (*f)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long) =
      REAL(CREATE, CUresult(*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long));
  pre_mode m = pre_ready();
  if (!f) return CUDA_ERROR_NOT_SUPPORTED;
  CUresult r = f(handle, size, prop, flags);
  if (r != CUDA_SUCCESS || m != PRE_ON || !prop || !handle || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return r;
  pre_dev *d = pre_device(prop->location.id);
  if (d && pre_table_put(&pre_handles, (uint64_t)*handle, size, prop->location.id, PRE_K_VMM))
    pre_account(d, (int64_t)size);
  return r;
}

PRE_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  CUresult (*f)(CUmemGenericAllocationHandle) = REAL(RELEASE, CUresult(*)(CUmemGenericAllocationHandle));
  pre_mode m = pre_ready();
  if (!f) return CUDA_ERROR_NOT_SUPPORTED;
  CUresult r = f(handle);
  if (r == CUDA_SUCCESS && m == PRE_ON) {
    pre_entry *e = pre_table_take(&pre_handles, (uint64_t)handle);
    if (e) {
      pre_account(&P.devs[e->device], -(int64_t)e->bytes);
      free(e);
    }
  }
  return r;
}

/*
 * cuMemGetInfo policy (docs/preload.md): a program sees its VRAM budget as
 * the device — total = min(driver total, budget), free = min(driver free,
 * budget - what it holds) — and never the fallback room, so frameworks that
 * size themselves from free memory (JAX preallocation, TF, llama.cpp's layer
 * fitting) plan for VRAM and only what does not fit spills.
 */
PRE_API CUresult cuMemGetInfo_v2(size_t *free_out, size_t *total_out) {
  CUresult (*f)(size_t *, size_t *) = REAL(GETINFO, CUresult(*)(size_t *, size_t *));
  pre_mode m = pre_ready();
  if (!f) return CUDA_ERROR_NOT_SUPPORTED;
  CUresult r = f(free_out, total_out);
  if (r != CUDA_SUCCESS || m != PRE_ON || !free_out || !total_out) return r;
  int ord = -1;
  pre_dev *d = pre_current(&ord);
  if (!d) return r;
  uint64_t budget = pre_budget(d, true), used = atomic_load(&d->used);
  uint64_t room = used < budget ? budget - used : 0;
  if (budget && *total_out > budget) *total_out = (size_t)budget;
  if (budget && *free_out > room) *free_out = (size_t)room;
  return r;
}

static CUresult pre_refuse_fallback(atomic_int *once, const char *what, CUdeviceptr p) {
  pre_warn_once(once, "%s on %p: that address is shared GPU memory the preload served when VRAM was full "
                "(pinned host RAM mapped for the device), which %s cannot describe; answered "
                "CUDA_ERROR_NOT_SUPPORTED. Run with SGM_PRELOAD_FALLBACK=off (or raise the VRAM budget) "
                "if the program needs it (docs/preload.md)", what, (void *)(uintptr_t)p, what);
  return CUDA_ERROR_NOT_SUPPORTED;
}

PRE_API CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  CUresult (*f)(void *, CUpointer_attribute, CUdeviceptr) =
      REAL(PTRATTR, CUresult(*)(void *, CUpointer_attribute, CUdeviceptr));
  if (pre_ready() == PRE_ON && pre_fb_contains(ptr))
    return pre_refuse_fallback(&P.warned_attr, "cuPointerGetAttribute", ptr);
  return f ? f(data, attribute, ptr) : CUDA_ERROR_NOT_SUPPORTED;
}

PRE_API CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                        CUdeviceptr ptr) {
  CUresult (*f)(unsigned, CUpointer_attribute *, void **, CUdeviceptr) =
      REAL(PTRATTRS, CUresult(*)(unsigned, CUpointer_attribute *, void **, CUdeviceptr));
  if (pre_ready() == PRE_ON && pre_fb_contains(ptr))
    return pre_refuse_fallback(&P.warned_attr, "cuPointerGetAttributes", ptr);
  return f ? f(numAttributes, attributes, data, ptr) : CUDA_ERROR_NOT_SUPPORTED;
}

PRE_API CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
  CUresult (*f)(CUipcMemHandle *, CUdeviceptr) = REAL(IPC, CUresult(*)(CUipcMemHandle *, CUdeviceptr));
  if (pre_ready() == PRE_ON && pre_fb_contains(dptr))
    return pre_refuse_fallback(&P.warned_ipc, "cuIpcGetMemHandle", dptr);
  return f ? f(pHandle, dptr) : CUDA_ERROR_NOT_SUPPORTED;
}

/* ------------------------------------------------------------------------ */
/* By pointer: a real hooked function -> its hook; anything else unchanged. */

static void *pre_swap(void *p) {
  if (!p || atomic_load_explicit(&P.mode, memory_order_acquire) == PRE_PASS) return p;
  for (int i = 0; i < PRE_N_HOOKS; i++)
    if (pre_rows[i].real && (p == pre_rows[i].real || p == pre_rows[i].real_gpa)) {
      atomic_fetch_add_explicit(&P.n_swaps, 1, memory_order_relaxed);
      return pre_rows[i].hook;
    }
  return p;
}

PRE_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                     CUdriverProcAddressQueryResult *symbolStatus) {
  pre_ready();
  pre_gpa2_fn f = REAL(GPA2, pre_gpa2_fn);
  if (!f) return CUDA_ERROR_NOT_SUPPORTED;
  CUresult r = f(symbol, pfn, cudaVersion, flags, symbolStatus);
  if (r == CUDA_SUCCESS && pfn) *pfn = pre_swap(*pfn);
  return r;
}

PRE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
  pre_ready();
  CUresult (*f)(const char *, void **, int, cuuint64_t) = REAL(GPA1, CUresult(*)(const char *, void **, int, cuuint64_t));
  if (!f) return CUDA_ERROR_NOT_SUPPORTED;
  CUresult r = f(symbol, pfn, cudaVersion, flags);
  if (r == CUDA_SUCCESS && pfn) *pfn = pre_swap(*pfn);
  return r;
}

/* ------------------------------------------------------------------------ */
/* dlsym and dlvsym. */

PRE_EARLY static bool pre_cu_name(const char *name) {
  return name && name[0] == 'c' && name[1] == 'u' && name[2] >= 'A' && name[2] <= 'Z';
}

/* Whether a lookup from `caller` must see the driver as it is: the preload
 * itself, libsgm (its CUDA backend loads the real driver), or a thread
 * inside either. */
static bool pre_caller_exempt(const void *caller) {
  if (pre_guard) return true;
  Dl_info ci;
  if (!dladdr(caller, &ci)) return false;
  return ci.dli_fbase == P.self.dli_fbase || (P.sgm_base && ci.dli_fbase == P.sgm_base);
}

/* The hooked resolution of a cu* name (the caller is not exempt). */
void *sgm_preload_dlsym_hooked(void *handle, const char *name);
__attribute__((visibility("hidden"))) void *sgm_preload_dlsym_hooked(void *handle, const char *name) {
  void *p = pre_real_dlsym()(handle, name);
  if (!p) return p;
  pre_ready();
  return pre_swap(p);
}

/* Route a dlsym call: the real dlsym (jumped to with the caller's return
 * address intact, so RTLD_NEXT stays relative to the caller) or ours. */
__attribute__((visibility("hidden"))) void *sgm_preload_dlsym_route(void *handle, const char *name,
                                                                     const void *caller);
PRE_EARLY __attribute__((visibility("hidden"))) void *sgm_preload_dlsym_route(void *handle, const char *name,
                                                                               const void *caller) {
  (void)handle;
  pre_dlsym_fn real = pre_real_dlsym();
  if (!pre_cu_name(name) || pre_caller_exempt(caller)) return (void *)real;
  return (void *)&sgm_preload_dlsym_hooked;
}

#if defined(__x86_64__)
/* dlsym: save the arguments, ask the router, restore, jump. The caller's
 * return address stays on the stack, so the real dlsym sees the real caller
 * (glibc resolves RTLD_NEXT from it). Exported as dlsym@GLIBC_2.2.5 and
 * dlsym@@GLIBC_2.34, the two versions programs are linked against. */
__asm__(".text\n"
        ".globl sgm_preload_dlsym_225\n.type sgm_preload_dlsym_225,@function\n"
        ".globl sgm_preload_dlsym_234\n.type sgm_preload_dlsym_234,@function\n"
        "sgm_preload_dlsym_225:\n"
        "sgm_preload_dlsym_234:\n"
        "  push %rdi\n"
        "  push %rsi\n"
        "  sub $8, %rsp\n"
        "  mov 24(%rsp), %rdx\n"
        "  call sgm_preload_dlsym_route\n"
        "  add $8, %rsp\n"
        "  pop %rsi\n"
        "  pop %rdi\n"
        "  jmp *%rax\n"
        ".size sgm_preload_dlsym_225, .-sgm_preload_dlsym_225\n"
        ".size sgm_preload_dlsym_234, .-sgm_preload_dlsym_234\n"
        ".symver sgm_preload_dlsym_225, dlsym@GLIBC_2.2.5\n"
        ".symver sgm_preload_dlsym_234, dlsym@@GLIBC_2.34\n");
#else
/* Other architectures: a C wrapper (RTLD_NEXT from the program then resolves
 * relative to this library, which is the next object after the program's
 * own in most cases; docs/preload.md). */
void *sgm_preload_dlsym_c(void *handle, const char *name);
void *sgm_preload_dlsym_c(void *handle, const char *name) {
  void *f = sgm_preload_dlsym_route(handle, name, __builtin_return_address(0));
  return ((pre_dlsym_fn)f)(handle, name);
}
__asm__(".symver sgm_preload_dlsym_c, dlsym@GLIBC_2.17\n");
#endif

/* dlvsym@@GLIBC_2.34: the driver has no versioned cu* names, but a loader
 * may ask with a version anyway. */
void *sgm_preload_dlvsym(void *handle, const char *name, const char *version);
PRE_EARLY __attribute__((visibility("default"))) void *sgm_preload_dlvsym(void *handle, const char *name,
                                                                           const char *version) {
  void *p = pre_real_dlvsym()(handle, name, version);
  if (!p || !pre_cu_name(name) || pre_caller_exempt(__builtin_return_address(0))) return p;
  pre_ready();
  return pre_swap(p);
}
__asm__(".symver sgm_preload_dlvsym, dlvsym@@GLIBC_2.34");

/* ------------------------------------------------------------------------ */
/* SGM_PRELOAD_REPORT=path: at exit, one line of counters (tests, benchmarks). */

__attribute__((destructor)) static void pre_report(void) {
  const char *path = getenv("SGM_PRELOAD_REPORT");
  if (!path || !*path) return;
  uint64_t used = 0;
  for (int i = 0; i < PRE_MAX_DEVICES; i++) used += atomic_load(&P.devs[i].used);
  FILE *f = fopen(path, "a");
  if (!f) return;
  fprintf(f, "mode=%d allocs=%llu fallbacks=%llu fallback_bytes=%llu live_fallbacks=%llu "
          "live_driver_bytes=%llu quota_refusals=%llu swaps=%llu\n",
          atomic_load(&P.mode), (unsigned long long)atomic_load(&P.n_allocs),
          (unsigned long long)atomic_load(&P.n_fallbacks), (unsigned long long)atomic_load(&P.fallback_bytes),
          (unsigned long long)atomic_load(&P.n_fallback_live), (unsigned long long)used,
          (unsigned long long)atomic_load(&P.n_quota_refusals), (unsigned long long)atomic_load(&P.n_swaps));
  fclose(f);
}
