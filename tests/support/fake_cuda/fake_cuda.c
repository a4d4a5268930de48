/*
 * fake_cuda.c — a TEST DOUBLE of the CUDA 13.0 driver, NOT a driver.
 *
 * Built as a file named libcuda.so.1 in its own build folder
 * (build/<preset>/tests/support/fake_cuda/), so that a test which puts that
 * folder first on LD_LIBRARY_PATH makes sgm's CUDA backend dlopen this instead
 * of NVIDIA's driver. It implements, on host memory, the driver entry points
 * sgm uses (and the stream, event and capture calls a stream-ordered allocator
 * needs), as strictly as the driver: a double kinder than the driver hides
 * the bugs it exists to find. Never install it, never ship it.
 *
 * The rules it enforces (each has a test in tests/unit/test_fake_cuda.c):
 *  - Devices: FAKE_CUDA_DEVICE_COUNT (default 1; 0 = cuInit succeeds, no
 *    device), each of FAKE_CUDA_TOTAL_MEM bytes (default SGM_EMU_VRAM, else
 *    1 GiB), read at every cuInit. cuDeviceGetUuid (v1 and v2 ABIs): a valid
 *    device and a non-NULL out, else INVALID_DEVICE / INVALID_VALUE; the UUID
 *    is FAKE_CUDA_UUID for device 0, else a fixed one ending in the ordinal. Driver version FAKE_CUDA_DRIVER_VERSION
 *    (default 13000 = CUDA 13.0). One primary context per device; a context
 *    must be current for every call that needs one.
 *  - Asynchrony: every stream has a FIFO queue executed by one worker thread,
 *    in stream order, FAKE_CUDA_DELAY_US (or fake_cuda_set_delay_us) of
 *    simulated device time per operation. Copies, memsets and event records
 *    complete LATER; an event is complete only once everything queued before
 *    it on its stream is. cuStreamSynchronize, cuEventSynchronize and
 *    cuCtxSynchronize wait for the work queued before the call.
 *    FAKE_CUDA_LAZY=1 (fake_cuda_set_lazy) makes the slowest legal device:
 *    work runs only while a host thread waits for some (a synchronize, a
 *    device-to-pageable copy, a free, fake_cuda_settle), so a query right
 *    after a record is NOT_READY every time, not just sometimes.
 *    As the driver does for pageable host memory: a host-to-device copy from
 *    unregistered memory is staged at enqueue; a device-to-host copy into
 *    unregistered memory returns only once it is done. Copies to or from
 *    registered host memory are fully asynchronous.
 *  - cuStreamWaitEvent: work queued on the stream after the call starts only
 *    once the event's latest record (at the time of the call) completed.
 *  - The legacy default stream (NULL, CU_STREAM_LEGACY), one per context,
 *    synchronises implicitly with every blocking stream of its context: its
 *    work waits for all earlier work of blocking streams, and their later work
 *    waits for its earlier work. CU_STREAM_NON_BLOCKING streams take no part.
 *    CU_STREAM_PER_THREAD (and NULL through the _ptsz entry points that
 *    cuGetProcAddress gives for CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
 *    is a distinct blocking stream per thread and context.
 *  - Events: cuEventDestroy on a pending event does not complete the work;
 *    destroying an event twice (or using a destroyed one) is
 *    CUDA_ERROR_INVALID_HANDLE and counted (stats: bad_event_destroys,
 *    bad_handles). Recording an event on a stream of another context is
 *    CUDA_ERROR_INVALID_HANDLE, as is enqueueing on a stream of a context
 *    that is not current. cuStreamDestroy with work pending returns at once;
 *    the work goes on.
 *  - Device memory: cuMemAlloc is anonymous host memory (device address = host
 *    address), charged rounded up to 256 bytes. cuMemGetInfo's free is total
 *    - the context's own reservation (FAKE_CUDA_CTX_OVERHEAD, default below)
 *    - other processes' memory (FAKE_CUDA_OTHER_USED / fake_cuda_set_other_used)
 *    - allocations; cuMemAlloc fails with OUT_OF_MEMORY past that free.
 *    cuMemFree and cuMemHostUnregister wait for queued work that touches the
 *    range (the driver synchronises on free; this double waits only for that).
 *  - Host registration: p != NULL, size > 0, known flags, the device's
 *    CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED (FAKE_CUDA_HOST_REGISTER_SUPPORTED,
 *    default 1; 0 = NOT_SUPPORTED). The driver pins whole pages: the range is
 *    widened to pages, every page must be mapped (else INVALID_VALUE) and no
 *    page may belong to another registration (HOST_MEMORY_ALREADY_REGISTERED),
 *    so two unaligned registrations sharing a page collide.
 *    FAKE_CUDA_PINNED_LIMIT caps the registered bytes (OUT_OF_MEMORY past it);
 *    FAKE_CUDA_HOST_REGISTER_RESULT / fake_cuda_set_host_register_result make
 *    every registration fail with a result (OUT_OF_MEMORY, NOT_PERMITTED,
 *    NOT_SUPPORTED...). Nothing is page-locked.
 *  - Faults: every entry point but cuGetProcAddress, cuDriverGetVersion and
 *    the error-string calls is a counted call. The Nth counted call fails with
 *    a chosen CUresult, once (FAKE_CUDA_FAIL_AT / FAKE_CUDA_FAIL_RESULT from
 *    load, fake_cuda_set_fail_at from then), or stickily
 *    (fake_cuda_set_sticky_at, fake_cuda_set_sticky): a sticky error such as
 *    CUDA_ERROR_ILLEGAL_ADDRESS poisons every retained primary context, whose
 *    every later call fails with it, as the driver does after a kernel fault,
 *    until the primary context is released to zero (destroyed).
 *    FAKE_CUDA_INIT_RESULT makes every cuInit fail with that result.
 *  - Stream capture: cuStreamBeginCapture (GLOBAL, THREAD_LOCAL, RELAXED; not
 *    on the legacy stream; not twice), cuStreamEndCapture (same thread unless
 *    RELAXED: else WRONG_THREAD; only on the origin stream: else UNMATCHED;
 *    forked streams must be joined back: else UNJOINED), cuStreamIsCapturing,
 *    cuStreamGetCaptureInfo (v1, v2, v3), cuThreadExchangeStreamCaptureMode.
 *    Captured work is not executed. Potentially unsafe calls fail with
 *    STREAM_CAPTURE_UNSUPPORTED and invalidate the captures that forbid them
 *    when the calling thread's mode (cuThreadExchangeStreamCaptureMode) says
 *    so: its own non-relaxed capture; in GLOBAL mode, also any other thread's
 *    GLOBAL capture; RELAXED: never. The unsafe calls (issue 24): cuMemAlloc,
 *    cuMemAllocManaged, cuMemFree, cuMemHostRegister, cuMemHostUnregister,
 *    cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap, cuCtxSynchronize,
 *    cuStreamSynchronize, cuStreamQuery, cuEventSynchronize, cuEventQuery (on
 *    any stream or event, not only capturing ones). cuda.h names only
 *    cudaMalloc as an example; the rest of the list is the CUDA programming
 *    guide's (synchronising or querying is illegal during a capture) and what
 *    PyTorch meets in practice (its allocator skips event queries while any
 *    capture is under way); docs/cuda.md, "Capture contract", says where the
 *    headers are silent. cuStreamSynchronize and
 *    cuStreamQuery on a capturing stream: UNSUPPORTED, capture invalidated.
 *    cuEventQuery/cuEventSynchronize on an event last recorded in a capture:
 *    CUDA_ERROR_CAPTURED_EVENT. Work on the legacy stream while a blocking
 *    stream of its context captures: STREAM_CAPTURE_IMPLICIT, capture
 *    invalidated. Waiting in a capture on an event recorded outside it:
 *    STREAM_CAPTURE_ISOLATION. Work on an invalidated capture:
 *    STREAM_CAPTURE_INVALIDATED, and cuStreamEndCapture returns that and a NULL
 *    graph. A graph is a token (node count); cuGraphDestroy frees it. Graphs
 *    are not instantiated or launched.
 *  - cuGetProcAddress (12.0+ signature with CUdriverProcAddressQueryResult, and
 *    the 11.3 one): by base name; asking for a version newer than the driver is
 *    INVALID_VALUE; older than the name's first release: status
 *    VERSION_NOT_SUFFICIENT; the newest implemented ABI not newer than asked is
 *    returned (cuStreamGetCaptureInfo v1/v2/v3, cuStreamBeginCapture v1/v2);
 *    ABIs older than the oldest implemented (e.g. the 32-bit cuMemAlloc before
 *    3.2) are not implemented: SYMBOL_NOT_FOUND. Per-thread default stream
 *    variants (_ptsz) for PER_THREAD_DEFAULT_STREAM. Versioned names
 *    ("cuMemAlloc_v2") are not base names: not found.
 *  - Managed memory (cuMemAllocManaged, cuMemAdvise, cuMemPrefetchAsync):
 *    flags CU_MEM_ATTACH_GLOBAL or _HOST, size > 0; no page placed until
 *    prefetched (as physical memory is populated on first touch). Advice
 *    and prefetches take a range inside one managed allocation (else
 *    INVALID_VALUE), widened to whole host pages; cuMemAdvise checks its
 *    CUmemLocation as the driver documents (preferred location: DEVICE with
 *    a valid ordinal, HOST, HOST_NUMA with id >= 0, HOST_NUMA_CURRENT;
 *    accessed-by: DEVICE or HOST only; a device needs concurrent managed
 *    access, else INVALID_DEVICE), cuMemPrefetchAsync likewise and flags 0.
 *    A prefetch is an operation of its stream: the pages move when it runs,
 *    after everything queued before it. Device-placed pages count as device
 *    memory in cuMemGetInfo; a prefetch that does not fit evicts other
 *    managed pages to host memory as the driver may, and counts them
 *    (stats: managed_evicted_bytes — what sgm must never make happen).
 *    CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is FAKE_CUDA_CONCURRENT_MANAGED
 *    (default 1). cuGetProcAddress answers "cuMemAdvise" and
 *    "cuMemPrefetchAsync" with the CUdevice forms below 12.2 and the
 *    CUmemLocation forms from 12.2 (13.0's default). cuMemFree frees managed
 *    ranges too, after the queued work that touches them.
 *  - Virtual memory management (issue 17): CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_
 *    MANAGEMENT_SUPPORTED is FAKE_CUDA_VMM_SUPPORTED (default 1; 0 = every
 *    VMM call is NOT_SUPPORTED). cuMemGetAllocationGranularity: a pinned
 *    device-located prop (else INVALID_VALUE) -> FAKE_CUDA_VMM_GRANULE (default
 *    2 MiB). cuMemAddressReserve: size a positive multiple of the granule,
 *    alignment 0 or a power of two, flags 0; address space only (PROT_NONE).
 *    cuMemAddressFree: exactly a reservation's (ptr, size), nothing mapped in
 *    it (else INVALID_VALUE). cuMemCreate: size a multiple of the granule,
 *    flags 0, charged to the device (OUT_OF_MEMORY past its free memory).
 *    cuMemMap: offset 0, flags 0, ptr and size granule multiples, size <= the
 *    allocation's, inside one reservation, over no existing mapping. The
 *    mapping starts with no access: copies touching it fail (INVALID_VALUE) until
 *    cuMemSetAccess, over whole mappings only, grants read-write to a valid
 *    device. cuMemUnmap: exactly whole mappings, no gap; it does not wait for
 *    queued work: each queued copy or memset touching the range is counted
 *    (stats.vmm_unmaps_in_use, must stay 0) and dropped (one already running
 *    is waited for), where a GPU would fault. cuMemRelease: a live handle, once; the memory is
 *    freed when the handle is released and its mapping unmapped (in either
 *    order, as the driver documents). One mapping per handle (aliasing one
 *    allocation at two addresses is not modelled: NOT_SUPPORTED).
 *  - Contexts (issue 24): cuCtxSetCurrent replaces the top of the thread's
 *    stack (NULL pops it), cuCtxPushCurrent/PopCurrent push and pop; every
 *    call is charged to the context current then: cuMemAlloc and cuMemGetInfo
 *    to its device, NULL to its legacy stream, cuEventCreate's event to it.
 *  - Kernels (issue 24): fake_cuda_kernel queues an operation that reads or
 *    writes a device range for a chosen device time; frees wait for it,
 *    cuMemUnmap counts it (vmm_unmaps_in_use) and a block reused under it is
 *    overwritten when it ends, as a GPU kernel would.
 *  - Streams race (issue 26): a copy, memset or kernel queued on one stream
 *    over memory that pending work of another stream writes (or reads, when
 *    the new work writes) must be ordered after that work (cuStreamWaitEvent
 *    on an event recorded after it, or the legacy stream's implicit order),
 *    else a GPU runs the two concurrently: each such operation is counted
 *    (stats.stream_races, must stay 0).
 *  - Every entry point counts its calls (fake_cuda_calls(name)).
 *
 * The control API (fake_cuda.h) has the prefix fake_cuda_; tests hold work
 * with it deterministically (held event records, a paused worker) instead of
 * sleeping.
 *
 * Threading: one mutex guards all state; one condition variable wakes waiters
 * (synchronize calls, control calls waiting for the worker to settle), another
 * wakes the worker. The worker runs an operation with the mutex dropped. The
 * context stack, the per-thread default streams and the capture mode are per
 * thread, as in CUDA. A fork child gets no worker thread: its waiting threads
 * (synchronize calls, settle) run the queued work themselves.
 */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cuda.h>

#include "fake_cuda.h"

#define FAKE_API __attribute__((visibility("default")))

#define FAKE_MAX_DEVICES 8
#define FAKE_CTX_STACK 32
#define FAKE_DEFAULT_MEM (UINT64_C(1) << 30)
/* CUDA 13.0, the driver sgm is checked against. */
#define FAKE_DEFAULT_DRIVER_VERSION 13000
#define FAKE_PAGE 4096u
#define FAKE_OBJ_MAGIC 0x46414b45u /* "FAKE" */
/* What a CUDA 12/13 primary context reserves for itself on a data-centre GPU
 * (module images with lazy loading, local memory, printf/heap buffers): about
 * 300 MiB is what nvidia-smi shows for an idle process that made a context.
 * Devices under 2.4 GiB (the small devices of the test suites) are charged
 * total/8 instead, so a 64 MiB test device still has 56 MiB to give. */
#define FAKE_CTX_OVERHEAD (UINT64_C(300) << 20)
#define FAKE_SMALL_DEVICE_DIVISOR 8
/* Destroyed event handles remembered to tell a double destroy from garbage. */
#define FAKE_DEAD_EVENTS 4096
/* cuCtxGetStreamPriorityRange of an H100: 0 (least) to -5 (greatest). */
#define FAKE_PRIORITY_LEAST 0
#define FAKE_PRIORITY_GREATEST (-5)

/* Every entry point, for the per-entry call counters (fake_cuda_calls). */
#define FAKE_CALLS(X)                                                                          \
  X(cuGetErrorName) X(cuGetErrorString) X(cuDriverGetVersion) X(cuGetProcAddress)              \
  X(cuInit) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetAttribute) X(cuDeviceGetName)      \
  X(cuDeviceGetPCIBusId) X(cuDeviceTotalMem) X(cuDevicePrimaryCtxRetain)                       \
  X(cuDevicePrimaryCtxRelease) X(cuCtxGetCurrent) X(cuCtxPushCurrent) X(cuCtxPopCurrent)       \
  X(cuCtxSetCurrent)                                                                           \
  X(cuCtxSynchronize) X(cuCtxGetStreamPriorityRange) X(cuMemGetInfo) X(cuMemAlloc)             \
  X(cuMemFree) X(cuMemHostRegister) X(cuMemHostUnregister) X(cuMemHostGetDevicePointer)        \
  X(cuMemcpyHtoDAsync) X(cuMemcpyDtoHAsync) X(cuMemcpyDtoDAsync) X(cuMemsetD8Async)            \
  X(cuStreamCreate) X(cuStreamCreateWithPriority) X(cuStreamDestroy) X(cuStreamSynchronize)    \
  X(cuStreamQuery) X(cuStreamWaitEvent) X(cuStreamGetPriority) X(cuStreamGetFlags)             \
  X(cuEventCreate) X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuEventDestroy)    \
  X(cuStreamBeginCapture) X(cuStreamEndCapture) X(cuStreamIsCapturing)                         \
  X(cuStreamGetCaptureInfo) X(cuThreadExchangeStreamCaptureMode) X(cuGraphDestroy)           \
  X(cuMemAllocManaged) X(cuMemAdvise) X(cuMemPrefetchAsync)                                   \
  X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate)  \
  X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)                                  \
  X(cuDeviceGetUuid)                                                                           \
  /* issue 27 (the preload's programs): */                                                     \
  X(cuMemcpyHtoD) X(cuMemcpyDtoH) X(cuMemAllocAsync) X(cuMemFreeAsync)      \
  X(cuMemAllocFromPoolAsync) X(cuMemPoolCreate) X(cuMemPoolDestroy) X(cuDeviceGetDefaultMemPool) \
  X(cuPointerGetAttribute) X(cuIpcGetMemHandle) X(cuCtxGetDevice)

enum {
#define FAKE_ID_ROW(name) FAKE_ID_##name,
  FAKE_CALLS(FAKE_ID_ROW)
#undef FAKE_ID_ROW
      FAKE_N_IDS
};

static const char *const fake_call_names[FAKE_N_IDS] = {
#define FAKE_NAME_ROW(name) #name,
    FAKE_CALLS(FAKE_NAME_ROW)
#undef FAKE_NAME_ROW
};

typedef enum fake_stream_kind {
  FAKE_STREAM_USER,       /* from cuStreamCreate*: counted as sgm's */
  FAKE_STREAM_TEST,       /* from fake_cuda_stream_create: the test's own */
  FAKE_STREAM_LEGACY,     /* a context's legacy default stream */
  FAKE_STREAM_PER_THREAD, /* a thread's per-thread default stream */
} fake_stream_kind;

typedef enum fake_op_kind {
  FAKE_OP_COPY,   /* memmove(dst, staged ? staged : src, n) */
  FAKE_OP_MEMSET, /* memset(dst, value, n) */
  FAKE_OP_RECORD, /* an event record: nothing to do but complete */
  FAKE_OP_WAIT,   /* a cuStreamWaitEvent / implicit-sync marker: only its deps */
  FAKE_OP_PREFETCH, /* move managed pages of [dst, dst + n) to value (FAKE_AT_*) */
  FAKE_OP_KERNEL, /* fake_cuda_kernel: run_us of device time on [dst, dst + n), then write
                     value there (write) or read it (issue 24) */
} fake_op_kind;

/* One queued operation. Operations are reference counted: the queue holds
 * one reference until done, every op depending on it one, an event's latest
 * record one, every waiter one. */
typedef struct fake_op {
  fake_op_kind kind;        /* what to do */
  uintptr_t dst;            /* destination address (COPY, MEMSET) */
  uintptr_t src;            /* source address (COPY) */
  size_t n;                 /* bytes (COPY, MEMSET) */
  unsigned char value;      /* byte (MEMSET) */
  void *staged;             /* malloc'd copy of a pageable source, or NULL */
  struct fake_op **deps;    /* ops that must be done before this one starts */
  int n_deps;               /* entries of deps */
  int held;                 /* a test holds it (event records under a hold) */
  int running;              /* the worker is executing it */
  int done;                 /* completed */
  int refs;                 /* references (see above) */
  uint64_t run_us;          /* KERNEL: its own device time */
  int write;                /* KERNEL: 1 writes value over the range, 0 reads it */
  uint64_t mark;            /* issue 26: F.race_epoch when the race check last visited it */
  struct CUstream_st *stream; /* queue it is in (valid until done) */
  struct fake_op *next;     /* next in its stream's queue */
} fake_op;

struct CUctx_st {
  int device;                 /* ordinal */
  int retains;                /* cuDevicePrimaryCtxRetain count not yet released */
  CUresult sticky;            /* a sticky error every call fails with; CUDA_SUCCESS: none */
  struct CUstream_st *legacy; /* its legacy default stream, made at first use */
};

struct CUgraph_st {
  uint32_t magic;           /* FAKE_OBJ_MAGIC while live */
  uint64_t nodes;           /* operations captured into it */
  struct CUgraph_st *next;  /* list of live graphs */
};

struct CUstream_st {
  uint32_t magic;           /* FAKE_OBJ_MAGIC while the handle is valid */
  fake_stream_kind kind;    /* who made it */
  struct CUctx_st *ctx;     /* its context */
  unsigned flags;           /* CU_STREAM_* */
  int priority;             /* as asked, clamped to the range */
  int destroyed;            /* handle destroyed; freed once its queue drains */
  int held;                 /* event records enqueued here are held */
  pthread_t owner;          /* the thread of a per-thread default stream */
  fake_op *head;            /* oldest op not done */
  fake_op *tail;            /* newest op not done (NULL: idle) */
  CUstreamCaptureStatus cap_status; /* NONE, ACTIVE or INVALIDATED */
  CUstreamCaptureMode cap_mode;     /* mode of the capture it takes part in */
  uint64_t cap_id;          /* that capture's id */
  int cap_origin;           /* the capture began on this stream */
  pthread_t cap_thread;     /* the thread that began the capture */
  uint64_t cap_nodes;       /* ops captured on this stream */
  uint64_t cap_joined;      /* cap_nodes when last joined back (forked streams) */
  struct CUgraph_st *cap_graph; /* the graph being captured */
  struct CUstream_st *next; /* list of all streams */
};

struct CUevent_st {
  uint32_t magic;           /* FAKE_OBJ_MAGIC while live */
  struct CUctx_st *ctx;     /* context it was created in */
  unsigned flags;           /* CU_EVENT_* */
  fake_op *last;            /* its latest record (a reference), NULL: none or captured */
  int captured;             /* latest record was captured */
  uint64_t cap_id;          /* the capture it was recorded in */
  struct CUstream_st *cap_stream; /* the stream it was recorded on in capture */
  uint64_t cap_seq;         /* that stream's cap_nodes at the record */
  struct CUevent_st *next;  /* list of live events */
};

typedef struct fake_dalloc {
  uintptr_t base;           /* device (= host) address */
  size_t size;              /* bytes asked for */
  size_t mapped;            /* bytes mapped (page-rounded) */
  uint64_t accounted;       /* bytes charged to the device (rounded to 256) */
  int device;               /* which device's memory */
  struct fake_dalloc *next; /* list of live allocations */
  struct CUmemPoolHandle_st *pool; /* the pool of a stream-ordered allocation; NULL: cuMemAlloc's */
} fake_dalloc;
/* Issue 27's block: one allocation of pool freed (under F.mu). */
static void fake_pool_unref_locked(struct CUmemPoolHandle_st *pool);

/* Where a managed page is (fake_managed.at). */
enum { FAKE_AT_NONE = 0, FAKE_AT_DEVICE = 1, FAKE_AT_HOST = 2 };

typedef struct fake_managed {
  uintptr_t base;           /* address (host = device, unified) */
  size_t size;              /* bytes asked for */
  size_t mapped;            /* bytes mapped (page-rounded) */
  int device;               /* the context's device (whose memory device-placed pages use) */
  uint8_t *at;              /* per FAKE_PAGE: FAKE_AT_* */
  int8_t *preferred;        /* per page: CUmemLocationType of the preferred location, -1 none */
  uint8_t *accessed_by;     /* per page: 1 = SET_ACCESSED_BY for the device or host */
  struct fake_managed *next; /* list of live managed allocations */
} fake_managed;
/* Virtual memory management: a reservation, a physical allocation, a mapping. */
typedef struct fake_vres {
  uintptr_t base;           /* first address (PROT_NONE until mapped) */
  size_t size;              /* bytes reserved */
  struct fake_vres *next;   /* list of live reservations */
} fake_vres;

typedef struct fake_vphys {
  uint64_t handle;          /* the CUmemGenericAllocationHandle value */
  size_t size;              /* bytes (charged to the device) */
  int device;               /* where it lives */
  int released;             /* cuMemRelease was called */
  int mapped;               /* a mapping uses it */
  struct fake_vphys *next;  /* list of live allocations */
  struct fake_vphys *prev;  /* the one before (O(1) removal: ~66k handles at H200 size) */
} fake_vphys;

typedef struct fake_vmap {
  uintptr_t base;           /* mapped address */
  size_t size;              /* bytes */
  fake_vphys *phys;         /* the memory behind it */
  int access;               /* cuMemSetAccess granted read-write */
  struct fake_vmap *next;   /* list of live mappings */
} fake_vmap;

typedef struct fake_hreg {
  uintptr_t base;           /* registered host range start, as given */
  size_t size;              /* its length, as given */
  uintptr_t page_lo;        /* first byte of its first page */
  uintptr_t page_hi;        /* end of its last page */
  unsigned flags;           /* CU_MEMHOSTREGISTER_* */
  struct fake_hreg *next;   /* list of live registrations */
} fake_hreg;

static struct {
  pthread_mutex_t mu;       /* guards everything here */
  pthread_cond_t cv;        /* ops completed / the worker settled */
  pthread_cond_t work_cv;   /* new work, releases, unpause: wakes the worker */
  int worker_started;       /* the worker thread exists (in this process) */
  int worker_idle;          /* the worker found nothing runnable and sleeps */
  int inline_worker;        /* no worker thread (a fork child): waiters run the work */
  int paused;               /* fake_cuda_pause: the worker runs nothing */
  int lazy;                 /* the worker runs work only while a host thread waits */
  int demand;               /* host threads waiting for work now (lazy mode) */
  uint64_t delay_us;        /* simulated device time per op */
  int initialized;          /* cuInit succeeded */
  int device_count;         /* from FAKE_CUDA_DEVICE_COUNT at the last cuInit */
  uint64_t total_mem;       /* per device, from FAKE_CUDA_TOTAL_MEM at the last cuInit */
  uint64_t other_used;      /* bytes "other processes" hold on every device */
  int other_used_set;       /* other_used came from the control call */
  uint64_t used_mem[FAKE_MAX_DEVICES]; /* accounted bytes allocated per device */
  struct CUctx_st ctx[FAKE_MAX_DEVICES]; /* the primary contexts */
  uint64_t calls;           /* counted calls (fault injection counts these) */
  uint64_t per_call[FAKE_N_IDS]; /* every call, per entry point */
  uint64_t fail_at;         /* fail this counted call; 0 = never */
  CUresult fail_result;     /* with this result */
  int fail_sticky;          /* and poison the contexts with it */
  int fault_hit;            /* the armed fault fired */
  const char *fault_call;   /* the entry point it fired in */
  CUresult host_register_result; /* every cuMemHostRegister fails with it; 0: no */
  int hold_all;             /* every event record enqueued stays held */
  uint64_t bad_event_destroys; /* cuEventDestroy of an already destroyed event */
  uint64_t bad_handles;     /* INVALID_HANDLE answers for a stream or event */
  uint64_t next_capture_id; /* ids handed to captures */
  uint64_t n_global_captures; /* ongoing captures begun in GLOBAL mode */
  fake_dalloc *dallocs;     /* live device allocations */
  fake_hreg *hregs;         /* live host registrations */
  fake_managed *manageds;   /* live managed allocations */
  uint64_t managed_evicted; /* bytes of managed pages evicted to make room for a prefetch */
  fake_vres *vres;          /* VMM reservations */
  fake_vphys *vphys;        /* VMM physical allocations (live: not released or still mapped) */
  fake_vphys **vtab;        /* vtab[handle]: the live allocation of that handle, or NULL */
  size_t vtab_cap;          /* entries of vtab */
  fake_vmap *vmaps;         /* VMM mappings */
  uint64_t next_vhandle;    /* handles given by cuMemCreate */
  uint64_t vmm_unmaps_in_use; /* cuMemUnmap of a range queued work still touched */
  uint64_t stream_races;    /* issue 26: ops queued unordered after another stream's pending
                               op on the same memory, one of them writing it */
  uint64_t race_epoch;      /* issue 26: the race check's visit marks */
  uint64_t registered_bytes; /* page-rounded bytes of hregs */
  struct CUstream_st *streams; /* all streams (user, test, legacy, per-thread, draining) */
  struct CUevent_st *events;   /* live events */
  struct CUgraph_st *graphs;   /* live graphs */
  void *dead_events[FAKE_DEAD_EVENTS]; /* recently destroyed event handles */
  unsigned dead_next;       /* next slot of dead_events to overwrite */
} F = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .cv = PTHREAD_COND_INITIALIZER,
    .work_cv = PTHREAD_COND_INITIALIZER,
    .fail_result = CUDA_ERROR_UNKNOWN,
    .fault_call = "",
    .next_capture_id = 1,
};

static _Thread_local struct CUctx_st *tls_ctx[FAKE_CTX_STACK];
static _Thread_local int tls_depth;
static _Thread_local struct CUstream_st *tls_per_thread[FAKE_MAX_DEVICES];
static _Thread_local CUstreamCaptureMode tls_capture_mode; /* 0 = GLOBAL, the default */
static _Thread_local uint64_t tls_strict_captures; /* own ongoing non-RELAXED captures */
static _Thread_local uint64_t tls_global_captures; /* own ongoing GLOBAL captures */

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
  X(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state") \
  X(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing") \
  X(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture") \
  X(CUDA_ERROR_STREAM_CAPTURE_MERGE, "operation would result in a merge of separate capture sequences") \
  X(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "capture was not ended in the same stream as it began") \
  X(CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "capturing stream has unjoined work") \
  X(CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "dependency created on uncaptured work in another stream") \
  X(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "operation would make the legacy stream depend on a capturing blocking stream") \
  X(CUDA_ERROR_CAPTURED_EVENT, "operation not permitted on an event last recorded in a capturing stream") \
  X(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "attempt to terminate a thread-local capture sequence from another thread") \
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

static void fake_read_env_locked(void) {
  F.delay_us = (uint64_t)fake_env_long("FAKE_CUDA_DELAY_US", 0);
  F.lazy = fake_env_long("FAKE_CUDA_LAZY", 0) != 0;
  if (!F.other_used_set) F.other_used = fake_parse_size(getenv("FAKE_CUDA_OTHER_USED"), 0);
  F.host_register_result =
      fake_parse_result(getenv("FAKE_CUDA_HOST_REGISTER_RESULT"), CUDA_SUCCESS);
}

/* fork(): the child has no worker and must find the mutex free. */
static void fake_atfork_prepare(void) { pthread_mutex_lock(&F.mu); }
static void fake_atfork_parent(void) { pthread_mutex_unlock(&F.mu); }
static void fake_atfork_child(void) {
  /* A thread started in a child of a threaded process is unsafe (and TSan
   * refuses it): the child's waiters run its work themselves. */
  F.inline_worker = 1;
  F.worker_started = 0;
  F.worker_idle = 0;
  F.demand = 0;
  /* An op the parent's worker was running is run again by the child's. */
  for (struct CUstream_st *s = F.streams; s; s = s->next)
    if (s->head) s->head->running = 0;
  pthread_mutex_unlock(&F.mu);
}

__attribute__((constructor)) static void fake_load(void) {
  pthread_atfork(fake_atfork_prepare, fake_atfork_parent, fake_atfork_child);
  pthread_mutex_lock(&F.mu);
  F.fail_at = (uint64_t)fake_env_long("FAKE_CUDA_FAIL_AT", 0);
  F.fail_result = fake_parse_result(getenv("FAKE_CUDA_FAIL_RESULT"), CUDA_ERROR_UNKNOWN);
  fake_read_env_locked();
  pthread_mutex_unlock(&F.mu);
}

/* Poison every retained primary context with a sticky error. */
static void fake_poison_locked(CUresult r) {
  for (int d = 0; d < FAKE_MAX_DEVICES; d++)
    if (F.ctx[d].retains > 0) F.ctx[d].sticky = r;
  pthread_cond_broadcast(&F.work_cv);
}

/* Count a call; the armed fault's result when this is the one to fail. */
static CUresult fake_count(int id, int counted) {
  pthread_mutex_lock(&F.mu);
  F.per_call[id]++;
  CUresult r = CUDA_SUCCESS;
  if (counted) {
    uint64_t n = ++F.calls;
    if (F.fail_at != 0 && n == F.fail_at && !F.fault_hit) {
      F.fault_hit = 1;
      F.fault_call = fake_call_names[id];
      r = F.fail_result;
      if (F.fail_sticky) fake_poison_locked(r);
    }
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* A counted entry point: counts it and returns an armed fault's result. */
#define FAKE_COUNT(name)                               \
  do {                                                 \
    CUresult fr_ = fake_count(FAKE_ID_##name, 1);      \
    if (fr_ != CUDA_SUCCESS) return fr_;               \
  } while (0)
/* An uncounted one (never fails by injection): only its call counter. */
#define FAKE_TALLY(name) ((void)fake_count(FAKE_ID_##name, 0))

/* Checks below run under F.mu. */
static CUresult fake_need_init_locked(void) {
  return F.initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* The thread's current context, which must be a retained primary context
 * not poisoned by a sticky error. */
static CUresult fake_need_ctx_locked(struct CUctx_st **out) {
  if (!F.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (tls_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  struct CUctx_st *c = tls_ctx[tls_depth - 1];
  if (c->retains <= 0) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  if (c->sticky != CUDA_SUCCESS) return c->sticky;
  if (out) *out = c;
  return CUDA_SUCCESS;
}

static uint64_t fake_ctx_overhead_locked(void) {
  uint64_t dflt = F.total_mem < FAKE_CTX_OVERHEAD * FAKE_SMALL_DEVICE_DIVISOR
                      ? F.total_mem / FAKE_SMALL_DEVICE_DIVISOR
                      : FAKE_CTX_OVERHEAD;
  return fake_parse_size(getenv("FAKE_CUDA_CTX_OVERHEAD"), dflt);
}

/* cuMemGetInfo's free: total - context reservation - other processes - allocations. */
static uint64_t fake_free_mem_locked(int device) {
  uint64_t taken = fake_ctx_overhead_locked() + F.other_used + F.used_mem[device];
  return taken < F.total_mem ? F.total_mem - taken : 0;
}

/* ---- streams, ops and the worker ---- */

static struct CUstream_st *fake_new_stream_locked(fake_stream_kind kind, struct CUctx_st *ctx,
                                                  unsigned flags, int priority) {
  struct CUstream_st *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->magic = FAKE_OBJ_MAGIC;
  s->kind = kind;
  s->ctx = ctx;
  s->flags = flags;
  s->priority = priority;
  s->next = F.streams;
  F.streams = s;
  return s;
}

static void fake_free_stream_locked(struct CUstream_st *s) {
  for (struct CUstream_st **pp = &F.streams; *pp; pp = &(*pp)->next)
    if (*pp == s) {
      *pp = s->next;
      break;
    }
  s->magic = 0;
  free(s);
}

/* A live stream handle given by the caller: a stream of the caller's, the
 * test's, or a default stream resolved for context c (which may be NULL for
 * lookups that do not need the default streams). */
static CUresult fake_stream_locked(CUstream h, struct CUctx_st *c, struct CUstream_st **out) {
  *out = NULL;
  if (h == NULL || h == CU_STREAM_LEGACY) {
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!c->legacy) c->legacy = fake_new_stream_locked(FAKE_STREAM_LEGACY, c, 0, 0);
    *out = c->legacy;
    return c->legacy ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (h == CU_STREAM_PER_THREAD) {
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st **slot = &tls_per_thread[c->device];
    if (!*slot) {
      *slot = fake_new_stream_locked(FAKE_STREAM_PER_THREAD, c, 0, 0);
      if (*slot) (*slot)->owner = pthread_self();
    }
    *out = *slot;
    return *slot ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
  }
  for (struct CUstream_st *x = F.streams; x; x = x->next)
    if (x == h && !x->destroyed &&
        (x->kind == FAKE_STREAM_USER || x->kind == FAKE_STREAM_TEST)) {
      *out = x;
      return CUDA_SUCCESS;
    }
  F.bad_handles++;
  return CUDA_ERROR_INVALID_HANDLE;
}

static struct CUevent_st *fake_event_locked(CUevent e) {
  for (struct CUevent_st *x = F.events; x; x = x->next)
    if (x == e) return x;
  F.bad_handles++;
  return NULL;
}

static void fake_op_unref_locked(fake_op *op) {
  if (!op || --op->refs > 0) return;
  for (int i = 0; i < op->n_deps; i++) fake_op_unref_locked(op->deps[i]);
  free(op->deps);
  free(op->staged);
  free(op);
}

static fake_op *fake_op_ref(fake_op *op) {
  if (op) op->refs++;
  return op;
}

/* Add a dependency on dep (if it is not done yet). */
static CUresult fake_op_add_dep_locked(fake_op *op, fake_op *dep) {
  if (!dep || dep->done) return CUDA_SUCCESS;
  fake_op **d = realloc(op->deps, sizeof *d * (size_t)(op->n_deps + 1));
  if (!d) return CUDA_ERROR_OUT_OF_MEMORY;
  op->deps = d;
  d[op->n_deps++] = fake_op_ref(dep);
  return CUDA_SUCCESS;
}

static bool fake_blocking(const struct CUstream_st *s) {
  return !(s->flags & CU_STREAM_NON_BLOCKING) && s->kind != FAKE_STREAM_LEGACY;
}

/* The implicit synchronisation of the legacy stream, as dependencies of an op
 * about to be queued on s: legacy work waits for every blocking stream of its
 * context, blocking work for the legacy stream. */
static CUresult fake_implicit_deps_locked(fake_op *op, struct CUstream_st *s) {
  CUresult r = CUDA_SUCCESS;
  if (s->kind == FAKE_STREAM_LEGACY) {
    for (struct CUstream_st *x = F.streams; x && r == CUDA_SUCCESS; x = x->next)
      if (x != s && x->ctx == s->ctx && fake_blocking(x)) r = fake_op_add_dep_locked(op, x->tail);
  } else if (fake_blocking(s) && s->ctx->legacy) {
    r = fake_op_add_dep_locked(op, s->ctx->legacy->tail);
  }
  return r;
}

/* A blocking stream of c that captures (the legacy stream cannot be used then). */
static struct CUstream_st *fake_blocking_capture_locked(struct CUctx_st *c) {
  for (struct CUstream_st *x = F.streams; x; x = x->next)
    if (x->ctx == c && fake_blocking(x) && x->cap_status != CU_STREAM_CAPTURE_STATUS_NONE)
      return x;
  return NULL;
}

static void fake_invalidate_capture_locked(uint64_t id) {
  for (struct CUstream_st *x = F.streams; x; x = x->next)
    if (x->cap_status == CU_STREAM_CAPTURE_STATUS_ACTIVE && x->cap_id == id)
      x->cap_status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
}

/* Before using the legacy stream of c: STREAM_CAPTURE_IMPLICIT (and the
 * capture invalidated) while a blocking stream of c captures. */
static CUresult fake_legacy_use_locked(struct CUstream_st *s) {
  if (s->kind != FAKE_STREAM_LEGACY) return CUDA_SUCCESS;
  struct CUstream_st *cap = fake_blocking_capture_locked(s->ctx);
  if (!cap) return CUDA_SUCCESS;
  fake_invalidate_capture_locked(cap->cap_id);
  return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
}

/* A potentially unsafe call (cuMemAlloc...) from this thread during capture:
 * STREAM_CAPTURE_UNSUPPORTED, and the captures that forbid it invalidated. */
static CUresult fake_capture_unsafe_locked(void) {
  if (tls_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  bool own = tls_strict_captures > 0;
  bool others = tls_capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL &&
                F.n_global_captures > tls_global_captures;
  if (!own && !others) return CUDA_SUCCESS;
  pthread_t me = pthread_self();
  for (struct CUstream_st *x = F.streams; x; x = x->next) {
    if (!x->cap_origin || x->cap_status != CU_STREAM_CAPTURE_STATUS_ACTIVE) continue;
    bool mine = pthread_equal(x->cap_thread, me) && x->cap_mode != CU_STREAM_CAPTURE_MODE_RELAXED;
    bool global = x->cap_mode == CU_STREAM_CAPTURE_MODE_GLOBAL &&
                  tls_capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
    if (mine || global) fake_invalidate_capture_locked(x->cap_id);
  }
  return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

static bool fake_runnable(const fake_op *op) {
  if (op->held || op->running || op->done) return false;
  for (int i = 0; i < op->n_deps; i++)
    if (!op->deps[i]->done) return false;
  return true;
}

/* The runnable head op of the highest-priority stream (lowest number). */
static fake_op *fake_next_runnable_locked(void) {
  if (F.paused || (F.lazy && F.demand == 0)) return NULL;
  fake_op *best = NULL;
  for (struct CUstream_st *s = F.streams; s; s = s->next)
    if (s->head && fake_runnable(s->head) &&
        (!best || s->priority < best->stream->priority))
      best = s->head;
  return best;
}

static bool fake_ranges_overlap(uintptr_t a, size_t an, uintptr_t b, size_t bn) {
  return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

static void fake_kernel_read(const fake_op *op);
static void fake_execute(fake_op *op, int poisoned) {
  if (poisoned || op->n == 0) return;
  if (op->kind == FAKE_OP_COPY)
    memmove((void *)op->dst, op->staged ? op->staged : (const void *)op->src, op->n);
  else if (op->kind == FAKE_OP_MEMSET || (op->kind == FAKE_OP_KERNEL && op->write))
    memset((void *)op->dst, op->value, op->n);
  else if (op->kind == FAKE_OP_KERNEL)
    fake_kernel_read(op);
}

static void fake_managed_move_locked(uintptr_t addr, size_t n, int to);
static CUresult fake_managed_free(uintptr_t base);
static CUresult fake_target_locked(CUstream h, struct CUctx_st **c, struct CUstream_st **s);

/* Run op (runnable, taken by the caller): drops F.mu while it works. */
static void fake_run_locked(fake_op *op) {
  op->running = 1;
  uint64_t delay = F.delay_us + op->run_us;
  int poisoned = op->stream->ctx->sticky != CUDA_SUCCESS;
  pthread_mutex_unlock(&F.mu);
  if (delay > 0) {
    struct timespec ts = {(time_t)(delay / 1000000), (long)(delay % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
  fake_execute(op, poisoned);
  pthread_mutex_lock(&F.mu);
  if (op->kind == FAKE_OP_PREFETCH && !poisoned) fake_managed_move_locked(op->dst, op->n, op->value);
  struct CUstream_st *s = op->stream;
  op->running = 0;
  op->done = 1;
  s->head = op->next;
  if (!s->head) s->tail = NULL;
  op->next = NULL;
  op->stream = NULL;
  fake_op_unref_locked(op); /* the queue's reference */
  if (s->destroyed && !s->head) fake_free_stream_locked(s);
  pthread_cond_broadcast(&F.cv);
}

static void *fake_worker(void *arg) {
  (void)arg;
  pthread_mutex_lock(&F.mu);
  for (;;) {
    fake_op *op = fake_next_runnable_locked();
    if (!op) {
      F.worker_idle = 1;
      pthread_cond_broadcast(&F.cv);
      pthread_cond_wait(&F.work_cv, &F.mu);
      continue;
    }
    F.worker_idle = 0;
    fake_run_locked(op);
  }
  return NULL;
}

/* A waiter's turn: without a worker thread (a fork child) the waiter runs the
 * next runnable op itself; else it sleeps until an op completes. */
static void fake_wait_progress_locked(void) {
  if (F.inline_worker) {
    fake_op *op = fake_next_runnable_locked();
    if (op) {
      fake_run_locked(op);
      return;
    }
  }
  pthread_cond_wait(&F.cv, &F.mu);
}

static CUresult fake_start_worker_locked(void) {
  if (F.worker_started || F.inline_worker) return CUDA_SUCCESS;
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&t, &attr, fake_worker, NULL);
  pthread_attr_destroy(&attr);
  if (rc != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  F.worker_started = 1;
  return CUDA_SUCCESS;
}

/* Block until the worker can make no more progress: everything not held,
 * paused or waiting on held work is done. */
static void fake_settle_locked(void) {
  F.demand++;
  for (fake_op *op; F.inline_worker && (op = fake_next_runnable_locked()) != NULL;)
    fake_run_locked(op);
  pthread_cond_broadcast(&F.work_cv);
  while (F.worker_started && (fake_next_runnable_locked() || !F.worker_idle)) {
    F.worker_idle = 0;
    pthread_cond_broadcast(&F.work_cv);
    pthread_cond_wait(&F.cv, &F.mu);
  }
  F.demand--;
}

static void fake_race_check_locked(struct CUstream_st *s, fake_op *op);

/* Queue op on s (its implicit dependencies added); in a capture, count it
 * instead. On success *queued is the op (a new reference for the caller
 * when want_ref), or NULL when captured. */
static CUresult fake_enqueue_locked(struct CUstream_st *s, fake_op *op, fake_op **queued) {
  if (queued) *queued = NULL;
  CUresult r = fake_legacy_use_locked(s);
  if (r != CUDA_SUCCESS) goto out_free;
  if (s->cap_status == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    goto out_free;
  }
  if (s->cap_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
    s->cap_nodes++;
    if (s->cap_graph) s->cap_graph->nodes++;
    goto out_free; /* captured, not executed */
  }
  if ((r = fake_start_worker_locked()) != CUDA_SUCCESS) goto out_free;
  if ((r = fake_implicit_deps_locked(op, s)) != CUDA_SUCCESS) goto out_free;
  fake_race_check_locked(s, op); /* issue 26 */
  op->stream = s;
  op->refs = 1;
  if (s->tail) s->tail->next = op;
  else s->head = op;
  s->tail = op;
  if (queued) *queued = fake_op_ref(op);
  pthread_cond_broadcast(&F.work_cv);
  return CUDA_SUCCESS;
out_free:
  for (int i = 0; i < op->n_deps; i++) fake_op_unref_locked(op->deps[i]);
  free(op->deps);
  free(op->staged);
  free(op);
  return r;
}

/* Wait for op (a reference the caller holds, dropped here). */
static void fake_wait_op_locked(fake_op *op) {
  if (!op) return;
  F.demand++; /* a lazy device runs while someone waits */
  pthread_cond_broadcast(&F.work_cv);
  while (!op->done) fake_wait_progress_locked();
  F.demand--;
  fake_op_unref_locked(op);
}

/* The work of s enqueued so far, as one marker op to wait for: its tail, and
 * for the legacy stream what its next op would implicitly wait for. Returns a
 * reference (or NULL: nothing pending). */
static CUresult fake_stream_marker_locked(struct CUstream_st *s, fake_op **out) {
  *out = NULL;
  fake_op *m = calloc(1, sizeof *m);
  if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
  m->kind = FAKE_OP_WAIT;
  m->refs = 1;
  CUresult r = fake_op_add_dep_locked(m, s->tail);
  if (r == CUDA_SUCCESS && s->kind == FAKE_STREAM_LEGACY) r = fake_implicit_deps_locked(m, s);
  if (r != CUDA_SUCCESS || m->n_deps == 0) {
    fake_op_unref_locked(m);
    return r;
  }
  /* Not queued: done once every dependency is (checked by the waiter). */
  *out = m;
  return CUDA_SUCCESS;
}

static bool fake_marker_done(const fake_op *m) {
  for (int i = 0; i < m->n_deps; i++)
    if (!m->deps[i]->done) return false;
  return true;
}

static void fake_wait_marker_locked(fake_op *m) {
  if (!m) return;
  F.demand++;
  pthread_cond_broadcast(&F.work_cv);
  while (!fake_marker_done(m)) fake_wait_progress_locked();
  F.demand--;
  fake_op_unref_locked(m);
}

/* op reads or writes device memory in [base, base + n) when it runs (a copy,
 * a memset, a kernel; not done yet). */
static bool fake_op_touches(const fake_op *op, uintptr_t base, size_t n) {
  if (op->done || op->n == 0) return false;
  if (op->kind != FAKE_OP_COPY && op->kind != FAKE_OP_MEMSET && op->kind != FAKE_OP_KERNEL)
    return false;
  return fake_ranges_overlap(op->dst, op->n, base, n) ||
         (op->kind == FAKE_OP_COPY && !op->staged && fake_ranges_overlap(op->src, op->n, base, n));
}

/* Wait until no queued op touches [base, base + n). */
static void fake_wait_range_locked(uintptr_t base, size_t n) {
  for (;;) {
    fake_op *busy = NULL;
    for (struct CUstream_st *s = F.streams; s && !busy; s = s->next)
      for (fake_op *op = s->head; op && !busy; op = op->next)
        if (fake_op_touches(op, base, n) ||
            (op->kind == FAKE_OP_PREFETCH && fake_ranges_overlap(op->dst, op->n, base, n)))
          busy = op;
    if (!busy) return;
    fake_op_ref(busy);
    fake_wait_op_locked(busy);
  }
}

/* True when [addr, addr + n) is device-addressable: inside one allocation or
 * one registered (device-mapped) host range. */
static bool fake_vmm_range_locked(uintptr_t addr, size_t n);
static bool fake_vmm_supported(void);
static bool fake_device_range_locked(uintptr_t addr, size_t n) {
  for (fake_dalloc *a = F.dallocs; a; a = a->next)
    if (addr >= a->base && n <= a->size && addr - a->base <= a->size - n) return true;
  for (fake_managed *m = F.manageds; m; m = m->next)
    if (addr >= m->base && n <= m->size && addr - m->base <= m->size - n) return true;
  if (fake_vmm_range_locked(addr, n)) return true;
  for (fake_hreg *h = F.hregs; h; h = h->next)
    if ((h->flags & CU_MEMHOSTREGISTER_DEVICEMAP) && addr >= h->base && n <= h->size &&
        addr - h->base <= h->size - n)
      return true;
  return false;
}

/* True when [addr, addr + n) is registered (page-locked) host memory. */
static bool fake_pinned_range_locked(uintptr_t addr, size_t n) {
  for (fake_hreg *h = F.hregs; h; h = h->next)
    if (addr >= h->base && n <= h->size && addr - h->base <= h->size - n) return true;
  return false;
}

/* ---- the entry points: device and context ---- */

/* The name (name true) or description of error from the table, as
 * cuGetErrorName / cuGetErrorString answer: INVALID_VALUE for one unknown. */
static CUresult fake_error_text(CUresult error, const char **pStr, bool name) {
  if (!pStr) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof fake_errors / sizeof fake_errors[0]; i++)
    if (fake_errors[i].r == error) {
      *pStr = name ? fake_errors[i].name : fake_errors[i].str;
      return CUDA_SUCCESS;
    }
  *pStr = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult cuGetErrorName(CUresult error, const char **pStr) {
  FAKE_TALLY(cuGetErrorName);
  return fake_error_text(error, pStr, true);
}

FAKE_API CUresult cuGetErrorString(CUresult error, const char **pStr) {
  FAKE_TALLY(cuGetErrorString);
  return fake_error_text(error, pStr, false);
}

static int fake_driver_version(void) {
  return (int)fake_env_long("FAKE_CUDA_DRIVER_VERSION", FAKE_DEFAULT_DRIVER_VERSION);
}

FAKE_API CUresult cuDriverGetVersion(int *driverVersion) {
  FAKE_TALLY(cuDriverGetVersion);
  if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
  *driverVersion = fake_driver_version();
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuInit(unsigned int Flags) {
  FAKE_COUNT(cuInit);
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
  FAKE_COUNT(cuDeviceGetCount);
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
  FAKE_COUNT(cuDeviceGet);
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(ordinal);
  if (r == CUDA_SUCCESS) *device = ordinal;
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
  FAKE_COUNT(cuDeviceGetAttribute);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  if (!pi) return CUDA_ERROR_INVALID_VALUE;
  switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
      *pi = (int)fake_env_long("FAKE_CUDA_CAN_MAP_HOST", 1);
      break;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED:
      *pi = (int)fake_env_long("FAKE_CUDA_HOST_REGISTER_SUPPORTED", 1);
      break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
      *pi = (int)fake_env_long("FAKE_CUDA_CONCURRENT_MANAGED", 1);
      break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
      *pi = 1;
      break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS:
      *pi = 1;
      break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
      *pi = fake_vmm_supported() ? 1 : 0;
      break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: *pi = 2; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
    default: *pi = 0; break;
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  FAKE_COUNT(cuDeviceGetName);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  snprintf(name, (size_t)len, "sgm fake CUDA device %d (test double)", dev);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
  FAKE_COUNT(cuDeviceGetPCIBusId);
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

/* The device's UUID (both ABIs: no MIG slices here, so v1 and v2 agree):
 * FAKE_CUDA_UUID for device 0 (32 hex digits, dashes and a "GPU-" prefix
 * allowed), else 5fa4e1c0-0000-4000-8000-0000000000<ordinal>. */
FAKE_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
  FAKE_COUNT(cuDeviceGetUuid);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  if (!uuid) return CUDA_ERROR_INVALID_VALUE;
  static const unsigned char base[16] = {0x5f, 0xa4, 0xe1, 0xc0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0};
  memcpy(uuid->bytes, base, 16);
  uuid->bytes[15] = (char)dev;
  const char *fixed = dev == 0 ? getenv("FAKE_CUDA_UUID") : NULL;
  if (fixed && strncmp(fixed, "GPU-", 4) == 0) fixed += 4;
  for (int i = 0; fixed && *fixed && i < 32; fixed++) {
    if (*fixed == '-') continue;
    char d[2] = {*fixed, 0};
    char *end;
    unsigned long v = strtoul(d, &end, 16);
    if (*end) break;
    uuid->bytes[i / 2] = (char)(i % 2 ? (uuid->bytes[i / 2] & 0xf0) | (int)v : (int)(v << 4));
    i++;
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
  FAKE_COUNT(cuDeviceTotalMem);
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  if (r == CUDA_SUCCESS) *bytes = (size_t)F.total_mem;
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  FAKE_COUNT(cuDevicePrimaryCtxRetain);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
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
  FAKE_COUNT(cuDevicePrimaryCtxRelease);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  if (r == CUDA_SUCCESS) {
    if (F.ctx[dev].retains > 0) {
      /* The last release destroys the context: a sticky error goes with it.
       * Live objects stay listed so leak checks still see them. */
      if (--F.ctx[dev].retains == 0) F.ctx[dev].sticky = CUDA_SUCCESS;
    } else {
      r = CUDA_ERROR_INVALID_CONTEXT;
    }
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuCtxGetCurrent(CUcontext *pctx) {
  FAKE_COUNT(cuCtxGetCurrent);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_init_locked();
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  *pctx = tls_depth ? tls_ctx[tls_depth - 1] : NULL;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxPushCurrent(CUcontext ctx) {
  FAKE_COUNT(cuCtxPushCurrent);
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
  FAKE_COUNT(cuCtxPopCurrent);
  if (tls_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  CUcontext c = tls_ctx[--tls_depth];
  if (pctx) *pctx = c;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
  FAKE_COUNT(cuCtxGetStreamPriorityRange);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  if (leastPriority) *leastPriority = FAKE_PRIORITY_LEAST;
  if (greatestPriority) *greatestPriority = FAKE_PRIORITY_GREATEST;
  return CUDA_SUCCESS;
}

/* Wait for all work queued so far in context c. */
static CUresult fake_ctx_sync_locked(struct CUctx_st *c) {
  fake_op *m = calloc(1, sizeof *m);
  if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
  m->kind = FAKE_OP_WAIT;
  m->refs = 1;
  CUresult r = CUDA_SUCCESS;
  for (struct CUstream_st *x = F.streams; x && r == CUDA_SUCCESS; x = x->next)
    if (x->ctx == c) r = fake_op_add_dep_locked(m, x->tail);
  if (r != CUDA_SUCCESS) {
    fake_op_unref_locked(m);
    return r;
  }
  fake_wait_marker_locked(m);
  return c->sticky;
}

FAKE_API CUresult cuCtxSynchronize(void) {
  FAKE_COUNT(cuCtxSynchronize);
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked();
  if (r == CUDA_SUCCESS) r = fake_ctx_sync_locked(c);
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* ---- device memory ---- */

FAKE_API CUresult cuMemGetInfo(size_t *free, size_t *total) {
  FAKE_COUNT(cuMemGetInfo);
  if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) {
    *free = (size_t)fake_free_mem_locked(c->device);
    *total = (size_t)F.total_mem;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
  FAKE_COUNT(cuMemAlloc);
  if (!dptr) return CUDA_ERROR_INVALID_VALUE;
  *dptr = 0;
  if (bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  uint64_t acc = ((uint64_t)bytesize + 255) & ~(uint64_t)255;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked();
  if (r == CUDA_SUCCESS && acc > fake_free_mem_locked(c->device)) r = CUDA_ERROR_OUT_OF_MEMORY;
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
    *a = (fake_dalloc){(uintptr_t)p, bytesize, mapped, acc, c->device, F.dallocs, NULL};
    F.dallocs = a;
    *dptr = (CUdeviceptr)(uintptr_t)p;
  }
  pthread_mutex_unlock(&F.mu);
  if (!a && p != MAP_FAILED) munmap(p, mapped);
  return r;
}

FAKE_API CUresult cuMemFree(CUdeviceptr dptr) {
  FAKE_COUNT(cuMemFree);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked();
  fake_dalloc *found = NULL;
  if (r == CUDA_SUCCESS) {
    for (fake_dalloc *a = F.dallocs; a; a = a->next)
      if (a->base == (uintptr_t)dptr) found = a;
    if (!found) {
      pthread_mutex_unlock(&F.mu);
      return fake_managed_free((uintptr_t)dptr);
    }
  }
  if (found) {
    /* The driver synchronises before freeing: no queued copy may still
     * touch the memory when it is unmapped. */
    fake_wait_range_locked(found->base, found->size);
    for (fake_dalloc **pp = &F.dallocs; *pp; pp = &(*pp)->next)
      if (*pp == found) {
        *pp = found->next;
        break;
      }
    F.used_mem[found->device] -= found->accounted;
    if (found->pool) fake_pool_unref_locked(found->pool); /* issue 27: stream-ordered */
  }
  pthread_mutex_unlock(&F.mu);
  if (found) {
    munmap((void *)found->base, found->mapped);
    free(found);
  }
  return r;
}

/* ---- managed memory ---- */

static fake_managed *fake_managed_of_locked(uintptr_t addr, size_t n) {
  for (fake_managed *m = F.manageds; m; m = m->next)
    if (addr >= m->base && n <= m->size && addr - m->base <= m->size - n) return m;
  return NULL;
}

/* The driver's own eviction: device-placed managed pages of other ranges go
 * to host memory until `need` bytes are free on device (counted). */
static void fake_managed_evict_locked(int device, uint64_t need, const fake_managed *keep) {
  for (fake_managed *m = F.manageds; m && fake_free_mem_locked(device) < need; m = m->next) {
    if (m == keep || m->device != device) continue;
    for (size_t i = 0; i < m->mapped / FAKE_PAGE && fake_free_mem_locked(device) < need; i++) {
      if (m->at[i] != FAKE_AT_DEVICE) continue;
      m->at[i] = FAKE_AT_HOST;
      F.used_mem[device] -= FAKE_PAGE;
      F.managed_evicted += FAKE_PAGE;
    }
  }
}

/* A prefetch runs: pages of [addr, addr + n) move to `to` (F.mu held). */
static void fake_managed_move_locked(uintptr_t addr, size_t n, int to) {
  fake_managed *m = fake_managed_of_locked(addr, n);
  if (!m) return; /* freed meanwhile: cuMemFree waits for prefetches, so never */
  size_t p0 = (addr - m->base) / FAKE_PAGE;
  size_t p1 = (addr - m->base + n + FAKE_PAGE - 1) / FAKE_PAGE;
  if (to == FAKE_AT_DEVICE) {
    uint64_t need = 0;
    for (size_t i = p0; i < p1; i++) need += m->at[i] != FAKE_AT_DEVICE ? FAKE_PAGE : 0;
    if (need > fake_free_mem_locked(m->device)) fake_managed_evict_locked(m->device, need, m);
  }
  for (size_t i = p0; i < p1; i++) {
    if (m->at[i] == to) continue;
    if (m->at[i] == FAKE_AT_DEVICE) F.used_mem[m->device] -= FAKE_PAGE;
    if (to == FAKE_AT_DEVICE) F.used_mem[m->device] += FAKE_PAGE;
    m->at[i] = (uint8_t)to;
  }
}

static CUresult fake_managed_free(uintptr_t base) {
  pthread_mutex_lock(&F.mu);
  fake_managed *found = NULL;
  for (fake_managed **pp = &F.manageds; *pp; pp = &(*pp)->next)
    if ((*pp)->base == base) {
      found = *pp;
      break;
    }
  if (!found) {
    pthread_mutex_unlock(&F.mu);
    return CUDA_ERROR_INVALID_VALUE;
  }
  fake_wait_range_locked(found->base, found->size);
  for (fake_managed **pp = &F.manageds; *pp; pp = &(*pp)->next)
    if (*pp == found) {
      *pp = found->next;
      break;
    }
  for (size_t i = 0; i < found->mapped / FAKE_PAGE; i++)
    if (found->at[i] == FAKE_AT_DEVICE) F.used_mem[found->device] -= FAKE_PAGE;
  pthread_mutex_unlock(&F.mu);
  munmap((void *)found->base, found->mapped);
  free(found->at);
  free(found->preferred);
  free(found->accessed_by);
  free(found);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
  FAKE_COUNT(cuMemAllocManaged);
  if (!dptr) return CUDA_ERROR_INVALID_VALUE;
  *dptr = 0;
  if (bytesize == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked();
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  size_t mapped = (bytesize + FAKE_PAGE - 1) & ~(size_t)(FAKE_PAGE - 1);
  size_t pages = mapped / FAKE_PAGE;
  fake_managed *m = calloc(1, sizeof *m);
  void *p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m) {
    m->at = calloc(pages, 1);
    m->preferred = malloc(pages);
    m->accessed_by = calloc(pages, 1);
  }
  if (!m || p == MAP_FAILED || !m->at || !m->preferred || !m->accessed_by) {
    if (p != MAP_FAILED) munmap(p, mapped);
    if (m) {
      free(m->at);
      free(m->preferred);
      free(m->accessed_by);
      free(m);
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  memset(m->preferred, -1, pages);
  m->base = (uintptr_t)p;
  m->size = bytesize;
  m->mapped = mapped;
  m->device = c->device;
  pthread_mutex_lock(&F.mu);
  m->next = F.manageds;
  F.manageds = m;
  pthread_mutex_unlock(&F.mu);
  *dptr = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

/* A location a prefetch may target, or preferred-location advice name. */
static CUresult fake_check_location_locked(CUmemLocation l, bool accessed_by) {
  switch (l.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
      if (l.id < 0 || l.id >= F.device_count) return CUDA_ERROR_INVALID_DEVICE;
      if (!fake_env_long("FAKE_CUDA_CONCURRENT_MANAGED", 1)) return CUDA_ERROR_INVALID_DEVICE;
      return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST: return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
      return !accessed_by && l.id >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
      return accessed_by ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

FAKE_API CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUmemLocation location) {
  FAKE_COUNT(cuMemAdvise);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  fake_managed *m = NULL;
  if (r == CUDA_SUCCESS && (count == 0 || !(m = fake_managed_of_locked((uintptr_t)devPtr, count))))
    r = CUDA_ERROR_INVALID_VALUE;
  bool loc_used = advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION ||
                  advice == CU_MEM_ADVISE_SET_ACCESSED_BY || advice == CU_MEM_ADVISE_UNSET_ACCESSED_BY;
  if (r == CUDA_SUCCESS && (advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && loc_used)
    r = fake_check_location_locked(location, advice != CU_MEM_ADVISE_SET_PREFERRED_LOCATION);
  if (r == CUDA_SUCCESS) {
    size_t p0 = ((uintptr_t)devPtr - m->base) / FAKE_PAGE;
    size_t p1 = ((uintptr_t)devPtr - m->base + count + FAKE_PAGE - 1) / FAKE_PAGE;
    for (size_t i = p0; i < p1; i++) {
      if (advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION) m->preferred[i] = (int8_t)location.type;
      if (advice == CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION) m->preferred[i] = -1;
      if (advice == CU_MEM_ADVISE_SET_ACCESSED_BY) m->accessed_by[i] = 1;
      if (advice == CU_MEM_ADVISE_UNSET_ACCESSED_BY) m->accessed_by[i] = 0;
    }
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* The CUDA 8.0 form: a device ordinal, CU_DEVICE_CPU for host memory. */
static CUresult fake_mem_advise_v1(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUdevice device) {
  CUmemLocation l = {.type = device == CU_DEVICE_CPU ? CU_MEM_LOCATION_TYPE_HOST
                                                     : CU_MEM_LOCATION_TYPE_DEVICE,
                     .id = device == CU_DEVICE_CPU ? 0 : device};
  return cuMemAdvise(devPtr, count, advice, l);
}

FAKE_API CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                     unsigned int flags, CUstream hStream) {
  FAKE_COUNT(cuMemPrefetchAsync);
  fake_op *op = calloc(1, sizeof *op);
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = FAKE_OP_PREFETCH;
  op->dst = (uintptr_t)devPtr;
  op->n = count;
  op->value = location.type == CU_MEM_LOCATION_TYPE_DEVICE ? FAKE_AT_DEVICE : FAKE_AT_HOST;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  CUresult r = fake_target_locked(hStream, &c, &s);
  if (r == CUDA_SUCCESS && (flags != 0 || count == 0 || !fake_managed_of_locked((uintptr_t)devPtr, count)))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = fake_check_location_locked(location, false);
  if (r == CUDA_SUCCESS) {
    r = fake_enqueue_locked(s, op, NULL);
    op = NULL;
  }
  pthread_mutex_unlock(&F.mu);
  free(op);
  return r;
}

static CUresult fake_prefetch_v1(CUdeviceptr devPtr, size_t count, CUdevice dst, CUstream h) {
  CUmemLocation l = {.type = dst == CU_DEVICE_CPU ? CU_MEM_LOCATION_TYPE_HOST
                                                  : CU_MEM_LOCATION_TYPE_DEVICE,
                     .id = dst == CU_DEVICE_CPU ? 0 : dst};
  return cuMemPrefetchAsync(devPtr, count, l, 0, h);
}

/* ---- virtual memory management (issue 17) ---- */

static bool fake_vmm_supported(void) { return fake_env_long("FAKE_CUDA_VMM_SUPPORTED", 1) != 0; }

static size_t fake_vmm_granule(void) {
  long g = fake_env_long("FAKE_CUDA_VMM_GRANULE", 2L << 20);
  return g > 0 ? (size_t)g : (size_t)2 << 20;
}

/* The reservation holding [addr, addr + n) whole, or NULL. */
static fake_vres *fake_vres_of_locked(uintptr_t addr, size_t n) {
  for (fake_vres *v = F.vres; v; v = v->next)
    if (addr >= v->base && n <= v->size && addr - v->base <= v->size - n) return v;
  return NULL;
}

/* True when [addr, addr + n) is tiled by mappings with access granted. */
static bool fake_vmm_range_locked(uintptr_t addr, size_t n) {
  if (!fake_vres_of_locked(addr, n ? n : 1)) return false;
  uintptr_t at = addr, end = addr + n;
  while (at < end) {
    fake_vmap *hit = NULL;
    for (fake_vmap *m = F.vmaps; m && !hit; m = m->next)
      if (at >= m->base && at < m->base + m->size) hit = m;
    if (!hit || !hit->access) return false;
    at = hit->base + hit->size;
  }
  return true;
}

/* A device-located pinned allocation prop of a valid device. */
static CUresult fake_vmm_prop_locked(const CUmemAllocationProp *prop) {
  CUresult r = fake_need_init_locked();
  if (r != CUDA_SUCCESS) return r;
  if (!fake_vmm_supported()) return CUDA_ERROR_NOT_SUPPORTED;
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  return fake_need_device_locked(prop->location.id) == CUDA_SUCCESS ? CUDA_SUCCESS
                                                                     : CUDA_ERROR_INVALID_DEVICE;
}

/* Initialized, and the device has the API. */
static CUresult fake_vmm_ready_locked(void) {
  CUresult r = fake_need_init_locked();
  if (r == CUDA_SUCCESS && !fake_vmm_supported()) r = CUDA_ERROR_NOT_SUPPORTED;
  return r;
}

FAKE_API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                CUmemAllocationGranularity_flags option) {
  FAKE_COUNT(cuMemGetAllocationGranularity);
  if (!granularity) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_vmm_prop_locked(prop);
  pthread_mutex_unlock(&F.mu);
  if (r == CUDA_SUCCESS && option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
      option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) *granularity = fake_vmm_granule();
  return r;
}

FAKE_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                      CUdeviceptr addr, unsigned long long flags) {
  FAKE_COUNT(cuMemAddressReserve);
  (void)addr; /* a hint only */
  if (!ptr) return CUDA_ERROR_INVALID_VALUE;
  *ptr = 0;
  size_t g = fake_vmm_granule();
  if (size == 0 || size % g || flags || (alignment & (alignment - 1)))
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_vmm_ready_locked();
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  size_t align = alignment > g ? alignment : g;
  void *p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  /* Keep only the aligned part. */
  uintptr_t base = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
  if (base > (uintptr_t)p) munmap(p, base - (uintptr_t)p);
  munmap((void *)(base + size), (uintptr_t)p + size + align - (base + size));
  fake_vres *v = malloc(sizeof *v);
  if (!v) {
    munmap((void *)base, size);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  pthread_mutex_lock(&F.mu);
  *v = (fake_vres){base, size, F.vres};
  F.vres = v;
  pthread_mutex_unlock(&F.mu);
  *ptr = (CUdeviceptr)base;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  FAKE_COUNT(cuMemAddressFree);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_vmm_ready_locked();
  fake_vres *found = NULL;
  for (fake_vres **pp = &F.vres; r == CUDA_SUCCESS && *pp; pp = &(*pp)->next)
    if ((*pp)->base == (uintptr_t)ptr && (*pp)->size == size) {
      found = *pp;
      for (fake_vmap *m = F.vmaps; m && found; m = m->next)
        if (fake_ranges_overlap(m->base, m->size, found->base, found->size)) found = NULL;
      if (found) *pp = found->next;
      break;
    }
  if (r == CUDA_SUCCESS && !found) r = CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_unlock(&F.mu);
  if (found) {
    munmap((void *)found->base, found->size);
    free(found);
  }
  return r;
}

FAKE_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                              const CUmemAllocationProp *prop, unsigned long long flags) {
  FAKE_COUNT(cuMemCreate);
  if (!handle) return CUDA_ERROR_INVALID_VALUE;
  *handle = 0;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_vmm_prop_locked(prop);
  if (r == CUDA_SUCCESS && (size == 0 || size % fake_vmm_granule() || flags))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked(); /* issue 24 */
  int dev = prop ? prop->location.id : 0;
  if (r == CUDA_SUCCESS && size > fake_free_mem_locked(dev)) r = CUDA_ERROR_OUT_OF_MEMORY;
  fake_vphys *ph = r == CUDA_SUCCESS ? calloc(1, sizeof *ph) : NULL;
  if (r == CUDA_SUCCESS && !ph) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS && F.next_vhandle + 1 >= F.vtab_cap) {
    size_t cap = F.vtab_cap ? F.vtab_cap * 2 : 1024;
    fake_vphys **t = realloc(F.vtab, cap * sizeof *t);
    if (t) {
      memset(t + F.vtab_cap, 0, (cap - F.vtab_cap) * sizeof *t);
      F.vtab = t;
      F.vtab_cap = cap;
    } else {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  if (r == CUDA_SUCCESS) {
    *ph = (fake_vphys){++F.next_vhandle, size, dev, 0, 0, F.vphys, NULL};
    if (F.vphys) F.vphys->prev = ph;
    F.vphys = ph;
    F.vtab[ph->handle] = ph;
    F.used_mem[dev] += size;
    *handle = (CUmemGenericAllocationHandle)ph->handle;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

static fake_vphys *fake_vphys_of_locked(CUmemGenericAllocationHandle h) {
  fake_vphys *x = (uint64_t)h < F.vtab_cap ? F.vtab[(uint64_t)h] : NULL;
  return x && !x->released ? x : NULL;
}

/* Free ph once it is released and unmapped. */
static void fake_vphys_drop_locked(fake_vphys *ph) {
  if (!ph->released || ph->mapped) return;
  if (ph->prev) ph->prev->next = ph->next;
  else F.vphys = ph->next;
  if (ph->next) ph->next->prev = ph->prev;
  F.vtab[ph->handle] = NULL;
  F.used_mem[ph->device] -= ph->size;
  free(ph);
}

FAKE_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  FAKE_COUNT(cuMemRelease);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_vmm_ready_locked();
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked(); /* issue 24 */
  fake_vphys *ph = r == CUDA_SUCCESS ? fake_vphys_of_locked(handle) : NULL;
  if (r == CUDA_SUCCESS && !ph) r = CUDA_ERROR_INVALID_VALUE;
  if (ph) {
    ph->released = 1;
    fake_vphys_drop_locked(ph);
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                           CUmemGenericAllocationHandle handle, unsigned long long flags) {
  FAKE_COUNT(cuMemMap);
  size_t g = fake_vmm_granule();
  if (size == 0 || size % g || (uintptr_t)ptr % g || offset || flags) return CUDA_ERROR_INVALID_VALUE;
  fake_vmap *m = malloc(sizeof *m);
  if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_vmm_ready_locked();
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked(); /* issue 24 */
  fake_vphys *ph = r == CUDA_SUCCESS ? fake_vphys_of_locked(handle) : NULL;
  if (r == CUDA_SUCCESS && (!ph || size > ph->size || !fake_vres_of_locked((uintptr_t)ptr, size)))
    r = CUDA_ERROR_INVALID_VALUE;
  for (fake_vmap *x = F.vmaps; r == CUDA_SUCCESS && x; x = x->next)
    if (fake_ranges_overlap(x->base, x->size, (uintptr_t)ptr, size)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && ph->mapped) r = CUDA_ERROR_NOT_SUPPORTED;
  if (r == CUDA_SUCCESS) {
    /* Memory behind the range, but no access until cuMemSetAccess. */
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (r == CUDA_SUCCESS) {
    *m = (fake_vmap){(uintptr_t)ptr, size, ph, 0, F.vmaps};
    F.vmaps = m;
    ph->mapped = 1;
    m = NULL;
  }
  pthread_mutex_unlock(&F.mu);
  free(m);
  return r;
}

/* True when mappings tile [addr, addr + n) exactly (whole mappings, no gap). */
static bool fake_vmaps_tile_locked(uintptr_t addr, size_t n) {
  uintptr_t at = addr, end = addr + n;
  while (at < end) {
    fake_vmap *hit = NULL;
    for (fake_vmap *m = F.vmaps; m && !hit; m = m->next)
      if (m->base == at) hit = m;
    if (!hit || hit->size > end - at) return false;
    at += hit->size;
  }
  return n > 0;
}

FAKE_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                 size_t count) {
  FAKE_COUNT(cuMemSetAccess);
  if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_vmm_ready_locked();
  for (size_t i = 0; r == CUDA_SUCCESS && i < count; i++) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE &&
         desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE))
      r = CUDA_ERROR_INVALID_VALUE;
    else if (fake_need_device_locked(desc[i].location.id) != CUDA_SUCCESS)
      r = CUDA_ERROR_INVALID_DEVICE;
  }
  if (r == CUDA_SUCCESS && !fake_vmaps_tile_locked((uintptr_t)ptr, size)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    int rw = desc[count - 1].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (fake_vmap *m = F.vmaps; m; m = m->next)
      if (m->base >= (uintptr_t)ptr && m->base < (uintptr_t)ptr + size) m->access = rw;
    mprotect((void *)(uintptr_t)ptr, size, rw ? PROT_READ | PROT_WRITE : PROT_NONE);
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  FAKE_COUNT(cuMemUnmap);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_vmm_ready_locked();
  if (r == CUDA_SUCCESS && !fake_vmaps_tile_locked((uintptr_t)ptr, size)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked(); /* issue 24 */
  if (r == CUDA_SUCCESS) {
    /* The driver does not wait: queued work on this range is a caller's bug
     * (on a GPU it faults). Counted; work not started yet is dropped (it
     * will touch nothing), work running now is waited for. */
    for (;;) {
      fake_op *running = NULL;
      for (struct CUstream_st *st = F.streams; st && !running; st = st->next)
        for (fake_op *op = st->head; op && !running; op = op->next) {
          if (!fake_op_touches(op, (uintptr_t)ptr, size)) continue;
          if (op->running) {
            running = op;
          } else {
            F.vmm_unmaps_in_use++;
            op->n = 0;
          }
        }
      if (!running) break;
      F.vmm_unmaps_in_use++;
      fake_op_ref(running);
      fake_wait_op_locked(running);
    }
    for (fake_vmap **pp = &F.vmaps; *pp;) {
      fake_vmap *m = *pp;
      if (m->base >= (uintptr_t)ptr && m->base < (uintptr_t)ptr + size) {
        *pp = m->next;
        m->phys->mapped = 0;
        fake_vphys_drop_locked(m->phys);
        free(m);
      } else {
        pp = &m->next;
      }
    }
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
         -1, 0);
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* ---- host registration ---- */

/* Every page of [lo, hi) is mapped in this process. */
static bool fake_mapped(uintptr_t lo, uintptr_t hi) {
  unsigned char vec[64];
  for (uintptr_t p = lo; p < hi;) {
    size_t pages = (hi - p) / FAKE_PAGE;
    if (pages > sizeof vec) pages = sizeof vec;
    if (mincore((void *)p, pages * FAKE_PAGE, vec) != 0) return false; /* ENOMEM: unmapped */
    p += pages * FAKE_PAGE;
  }
  return true;
}

FAKE_API CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags) {
  FAKE_COUNT(cuMemHostRegister);
  const unsigned known = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                         CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY;
  if (!p || bytesize == 0 || (Flags & ~known)) return CUDA_ERROR_INVALID_VALUE;
  uintptr_t base = (uintptr_t)p;
  if (base + bytesize < base) return CUDA_ERROR_INVALID_VALUE;
  uintptr_t lo = base & ~(uintptr_t)(FAKE_PAGE - 1);
  uintptr_t hi = (base + bytesize + FAKE_PAGE - 1) & ~(uintptr_t)(FAKE_PAGE - 1);
  fake_hreg *h = malloc(sizeof *h);
  if (!h) return CUDA_ERROR_OUT_OF_MEMORY;
  uint64_t limit = fake_parse_size(getenv("FAKE_CUDA_PINNED_LIMIT"), UINT64_MAX);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked();
  if (r == CUDA_SUCCESS && fake_env_long("FAKE_CUDA_HOST_REGISTER_SUPPORTED", 1) == 0)
    r = CUDA_ERROR_NOT_SUPPORTED;
  if (r == CUDA_SUCCESS && F.host_register_result != CUDA_SUCCESS) r = F.host_register_result;
  if (r == CUDA_SUCCESS && !fake_mapped(lo, hi)) r = CUDA_ERROR_INVALID_VALUE;
  for (fake_hreg *x = F.hregs; r == CUDA_SUCCESS && x; x = x->next)
    if (lo < x->page_hi && x->page_lo < hi) r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  if (r == CUDA_SUCCESS && (hi - lo > limit || F.registered_bytes > limit - (hi - lo)))
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    *h = (fake_hreg){base, bytesize, lo, hi, Flags, F.hregs};
    F.hregs = h;
    F.registered_bytes += hi - lo;
    h = NULL;
  }
  pthread_mutex_unlock(&F.mu);
  free(h);
  return r;
}

FAKE_API CUresult cuMemHostUnregister(void *p) {
  FAKE_COUNT(cuMemHostUnregister);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked();
  fake_hreg *found = NULL;
  if (r == CUDA_SUCCESS) {
    for (fake_hreg *x = F.hregs; x; x = x->next)
      if (x->base == (uintptr_t)p) found = x;
    if (!found) r = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  }
  if (found) {
    fake_wait_range_locked(found->base, found->size);
    for (fake_hreg **pp = &F.hregs; *pp; pp = &(*pp)->next)
      if (*pp == found) {
        *pp = found->next;
        break;
      }
    F.registered_bytes -= found->page_hi - found->page_lo;
  }
  pthread_mutex_unlock(&F.mu);
  free(found);
  return r;
}

FAKE_API CUresult cuMemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
  FAKE_COUNT(cuMemHostGetDevicePointer);
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

/* ---- copies and memsets: queued, done later by the worker ---- */

/* The current context and the stream h of it, for an enqueue. */
static CUresult fake_target_locked(CUstream h, struct CUctx_st **c, struct CUstream_st **s) {
  CUresult r = fake_need_ctx_locked(c);
  if (r == CUDA_SUCCESS) r = fake_stream_locked(h, *c, s);
  if (r == CUDA_SUCCESS && (*s)->ctx != *c) {
    F.bad_handles++;
    r = CUDA_ERROR_INVALID_HANDLE; /* a stream of another context */
  }
  return r;
}

/* A copy: check the context, the stream and every device range, then queue
 * it. Pageable host memory as the driver treats it: a source is staged now,
 * a destination is written before the call returns. */
static CUresult fake_copy(uintptr_t dst, bool dst_dev, uintptr_t src, bool src_dev, size_t n,
                          CUstream h) {
  fake_op *op = calloc(1, sizeof *op);
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = FAKE_OP_COPY;
  op->dst = dst;
  op->src = src;
  op->n = n;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  fake_op *queued = NULL;
  bool sync_after = false;
  CUresult r = fake_target_locked(h, &c, &s);
  if (r == CUDA_SUCCESS && n > 0 &&
      (!dst || !src || (dst_dev && !fake_device_range_locked(dst, n)) ||
       (src_dev && !fake_device_range_locked(src, n))))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && n > 0 && !src_dev && !fake_pinned_range_locked(src, n)) {
    op->staged = malloc(n);
    if (!op->staged) r = CUDA_ERROR_OUT_OF_MEMORY;
    else memcpy(op->staged, (const void *)src, n);
  }
  if (r == CUDA_SUCCESS && !dst_dev && !fake_pinned_range_locked(dst, n)) sync_after = true;
  if (r == CUDA_SUCCESS) {
    r = fake_enqueue_locked(s, op, sync_after ? &queued : NULL);
    op = NULL;
  }
  if (queued) fake_wait_op_locked(queued);
  pthread_mutex_unlock(&F.mu);
  if (op) {
    free(op->staged);
    free(op);
  }
  return r;
}

FAKE_API CUresult cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                    CUstream hStream) {
  FAKE_COUNT(cuMemcpyHtoDAsync);
  return fake_copy((uintptr_t)dstDevice, true, (uintptr_t)srcHost, false, ByteCount, hStream);
}

FAKE_API CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                    CUstream hStream) {
  FAKE_COUNT(cuMemcpyDtoHAsync);
  return fake_copy((uintptr_t)dstHost, false, (uintptr_t)srcDevice, true, ByteCount, hStream);
}

FAKE_API CUresult cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                    CUstream hStream) {
  FAKE_COUNT(cuMemcpyDtoDAsync);
  return fake_copy((uintptr_t)dstDevice, true, (uintptr_t)srcDevice, true, ByteCount, hStream);
}

/* Queue op (a memset or a kernel over [op->dst, op->dst + op->n)) on stream h
 * of the current context, the range device memory; op is the callee's. */
static CUresult fake_enqueue_on_range(fake_op *op, CUstream h) {
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  CUresult r = fake_target_locked(h, &c, &s);
  if (r == CUDA_SUCCESS && op->n > 0 && !fake_device_range_locked(op->dst, op->n))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    r = fake_enqueue_locked(s, op, NULL);
    op = NULL;
  }
  pthread_mutex_unlock(&F.mu);
  free(op);
  return r;
}

FAKE_API CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N,
                                  CUstream hStream) {
  FAKE_COUNT(cuMemsetD8Async);
  fake_op *op = calloc(1, sizeof *op);
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  *op = (fake_op){.kind = FAKE_OP_MEMSET, .dst = (uintptr_t)dstDevice, .n = N, .value = uc};
  return fake_enqueue_on_range(op, hStream);
}

/* ---- streams ---- */

static CUresult fake_stream_create(CUstream *phStream, unsigned int Flags, int priority) {
  if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
  *phStream = NULL;
  /* Out-of-range priorities are clamped, as the driver does. */
  if (priority > FAKE_PRIORITY_LEAST) priority = FAKE_PRIORITY_LEAST;
  if (priority < FAKE_PRIORITY_GREATEST) priority = FAKE_PRIORITY_GREATEST;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) {
    struct CUstream_st *s = fake_new_stream_locked(FAKE_STREAM_USER, c, Flags, priority);
    if (s) *phStream = s;
    else r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
  FAKE_COUNT(cuStreamCreate);
  return fake_stream_create(phStream, Flags, FAKE_PRIORITY_LEAST);
}

FAKE_API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
  FAKE_COUNT(cuStreamCreateWithPriority);
  return fake_stream_create(phStream, flags, priority);
}

/* Ends the capture s takes part in (all its streams), dropping its counts. */
static void fake_end_capture_locked(struct CUstream_st *origin) {
  uint64_t id = origin->cap_id;
  if (origin->cap_mode == CU_STREAM_CAPTURE_MODE_GLOBAL) F.n_global_captures--;
  if (pthread_equal(origin->cap_thread, pthread_self())) {
    if (origin->cap_mode != CU_STREAM_CAPTURE_MODE_RELAXED) tls_strict_captures--;
    if (origin->cap_mode == CU_STREAM_CAPTURE_MODE_GLOBAL) tls_global_captures--;
  }
  for (struct CUstream_st *x = F.streams; x; x = x->next)
    if (x->cap_status != CU_STREAM_CAPTURE_STATUS_NONE && x->cap_id == id) {
      x->cap_status = CU_STREAM_CAPTURE_STATUS_NONE;
      x->cap_origin = 0;
      x->cap_graph = NULL;
      x->cap_nodes = x->cap_joined = 0;
    }
}

/* Destroy a stream handle; its queued work goes on and the stream is freed
 * once it drains. */
static void fake_destroy_stream_locked(struct CUstream_st *s) {
  if (s->cap_origin) {
    struct CUgraph_st *g = s->cap_graph;
    fake_end_capture_locked(s);
    if (g) g->magic = FAKE_OBJ_MAGIC; /* stays listed; freed by reset */
  }
  s->destroyed = 1;
  s->magic = 0;
  if (!s->head) fake_free_stream_locked(s);
}

FAKE_API CUresult cuStreamDestroy(CUstream hStream) {
  FAKE_COUNT(cuStreamDestroy);
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  struct CUstream_st *s = NULL;
  if (r == CUDA_SUCCESS && (hStream == NULL || hStream == CU_STREAM_LEGACY ||
                            hStream == CU_STREAM_PER_THREAD)) {
    F.bad_handles++;
    r = CUDA_ERROR_INVALID_HANDLE;
  }
  if (r == CUDA_SUCCESS) r = fake_stream_locked(hStream, c, &s);
  if (r == CUDA_SUCCESS && s->kind != FAKE_STREAM_USER) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) fake_destroy_stream_locked(s);
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* Synchronize or query: not on a capturing stream (the capture is then
 * invalidated), nor the legacy stream while a blocking one captures. */
static CUresult fake_stream_check_sync_locked(struct CUstream_st *s) {
  CUresult r = fake_legacy_use_locked(s);
  if (r != CUDA_SUCCESS) return r;
  if (s->cap_status != CU_STREAM_CAPTURE_STATUS_NONE) {
    fake_invalidate_capture_locked(s->cap_id);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  return CUDA_SUCCESS;
}

/* The start of cuStreamSynchronize and cuStreamQuery: the current context
 * (*c), the stream checked for a sync, and a marker behind its work (*m). */
static CUresult fake_stream_sync_marker_locked(CUstream hStream, struct CUctx_st **c, fake_op **m) {
  struct CUstream_st *s = NULL;
  CUresult r = fake_need_ctx_locked(c);
  if (r == CUDA_SUCCESS) r = fake_stream_locked(hStream, *c, &s);
  if (r == CUDA_SUCCESS) r = fake_stream_check_sync_locked(s);
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked(); /* issue 24 */
  if (r == CUDA_SUCCESS) r = fake_stream_marker_locked(s, m);
  return r;
}

FAKE_API CUresult cuStreamSynchronize(CUstream hStream) {
  FAKE_COUNT(cuStreamSynchronize);
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  fake_op *m = NULL;
  CUresult r = fake_stream_sync_marker_locked(hStream, &c, &m);
  if (r == CUDA_SUCCESS) {
    fake_wait_marker_locked(m);
    r = c->sticky;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuStreamQuery(CUstream hStream) {
  FAKE_COUNT(cuStreamQuery);
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  fake_op *m = NULL;
  CUresult r = fake_stream_sync_marker_locked(hStream, &c, &m);
  if (r == CUDA_SUCCESS && m) {
    if (!fake_marker_done(m)) r = CUDA_ERROR_NOT_READY;
    fake_op_unref_locked(m);
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuStreamGetPriority(CUstream hStream, int *priority) {
  FAKE_COUNT(cuStreamGetPriority);
  if (!priority) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) r = fake_stream_locked(hStream, c, &s);
  if (r == CUDA_SUCCESS) *priority = s->priority;
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuStreamGetFlags(CUstream hStream, unsigned int *flags) {
  FAKE_COUNT(cuStreamGetFlags);
  if (!flags) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) r = fake_stream_locked(hStream, c, &s);
  if (r == CUDA_SUCCESS) *flags = s->flags;
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* ---- events ---- */

FAKE_API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  FAKE_COUNT(cuEventCreate);
  const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (!phEvent) return CUDA_ERROR_INVALID_VALUE;
  *phEvent = NULL;
  /* An interprocess event must not time. */
  if ((Flags & ~known) ||
      ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING)))
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) {
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (e) {
      e->magic = FAKE_OBJ_MAGIC;
      e->ctx = c;
      e->flags = Flags;
      e->next = F.events;
      F.events = e;
      *phEvent = e;
      /* The handle is live again: a destroy of it is no longer a double one. */
      for (unsigned i = 0; i < FAKE_DEAD_EVENTS; i++)
        if (F.dead_events[i] == (void *)e) F.dead_events[i] = NULL;
    } else {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

static void fake_event_set_last_locked(struct CUevent_st *e, fake_op *op) {
  fake_op_unref_locked(e->last);
  e->last = op;
}

FAKE_API CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
  FAKE_COUNT(cuEventRecord);
  fake_op *op = calloc(1, sizeof *op);
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = FAKE_OP_RECORD;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  struct CUevent_st *e = NULL;
  fake_op *queued = NULL;
  CUresult r = fake_target_locked(hStream, &c, &s);
  if (r == CUDA_SUCCESS && !(e = fake_event_locked(hEvent))) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && e->ctx != s->ctx) {
    F.bad_handles++;
    r = CUDA_ERROR_INVALID_HANDLE; /* event and stream of different contexts */
  }
  if (r == CUDA_SUCCESS) {
    op->held = F.hold_all || s->held;
    bool capturing = s->cap_status == CU_STREAM_CAPTURE_STATUS_ACTIVE;
    r = fake_enqueue_locked(s, op, &queued);
    op = NULL;
    if (r == CUDA_SUCCESS) {
      fake_event_set_last_locked(e, queued); /* a re-record replaces the earlier one */
      e->captured = capturing;
      e->cap_id = capturing ? s->cap_id : 0;
      e->cap_stream = capturing ? s : NULL;
      e->cap_seq = capturing ? s->cap_nodes : 0;
    }
  }
  pthread_mutex_unlock(&F.mu);
  free(op);
  return r;
}

/* Query or synchronize: not on an event last recorded in a capture. */
static CUresult fake_event_check_locked(CUevent hEvent, struct CUevent_st **out) {
  CUresult r = fake_need_ctx_locked(NULL);
  if (r != CUDA_SUCCESS) return r;
  if (!(*out = fake_event_locked(hEvent))) return CUDA_ERROR_INVALID_HANDLE;
  if ((*out)->captured) return CUDA_ERROR_CAPTURED_EVENT;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventQuery(CUevent hEvent) {
  FAKE_COUNT(cuEventQuery);
  pthread_mutex_lock(&F.mu);
  struct CUevent_st *e = NULL;
  CUresult r = fake_event_check_locked(hEvent, &e);
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked(); /* issue 24 */
  if (r == CUDA_SUCCESS && e->last && !e->last->done) r = CUDA_ERROR_NOT_READY;
  if (r == CUDA_SUCCESS) r = e->ctx->sticky;
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuEventSynchronize(CUevent hEvent) {
  FAKE_COUNT(cuEventSynchronize);
  pthread_mutex_lock(&F.mu);
  struct CUevent_st *e = NULL;
  CUresult r = fake_event_check_locked(hEvent, &e);
  if (r == CUDA_SUCCESS) r = fake_capture_unsafe_locked(); /* issue 24 */
  if (r == CUDA_SUCCESS) {
    struct CUctx_st *c = e->ctx;
    fake_wait_op_locked(fake_op_ref(e->last)); /* the event may be destroyed meanwhile */
    r = c->sticky;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuEventDestroy(CUevent hEvent) {
  FAKE_COUNT(cuEventDestroy);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  struct CUevent_st *e = NULL;
  if (r == CUDA_SUCCESS && !(e = fake_event_locked(hEvent))) {
    r = CUDA_ERROR_INVALID_HANDLE;
    for (unsigned i = 0; hEvent && i < FAKE_DEAD_EVENTS; i++)
      if (F.dead_events[i] == (void *)hEvent) {
        F.bad_event_destroys++;
        break;
      }
  }
  if (r == CUDA_SUCCESS) {
    /* The recorded work goes on: only the handle goes. */
    fake_event_set_last_locked(e, NULL);
    for (struct CUevent_st **pp = &F.events; *pp; pp = &(*pp)->next)
      if (*pp == e) {
        *pp = e->next;
        break;
      }
    F.dead_events[F.dead_next++ % FAKE_DEAD_EVENTS] = e;
    e->magic = 0;
    free(e);
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  FAKE_COUNT(cuStreamWaitEvent);
  if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
  fake_op *op = calloc(1, sizeof *op);
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = FAKE_OP_WAIT;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  struct CUevent_st *e = NULL;
  /* The event may belong to another context or device. */
  CUresult r = fake_target_locked(hStream, &c, &s);
  if (r == CUDA_SUCCESS && !(e = fake_event_locked(hEvent))) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && e->captured) {
    struct CUstream_st *src = e->cap_stream;
    if (s->cap_status == CU_STREAM_CAPTURE_STATUS_NONE) {
      /* Fork: the stream joins the capture the event was recorded in. */
      struct CUstream_st *origin = NULL;
      for (struct CUstream_st *x = F.streams; x; x = x->next)
        if (x->cap_origin && x->cap_id == e->cap_id) origin = x;
      if (!origin) {
        r = CUDA_ERROR_STREAM_CAPTURE_ISOLATION; /* that capture has ended */
      } else {
        s->cap_status = origin->cap_status;
        s->cap_mode = origin->cap_mode;
        s->cap_id = origin->cap_id;
        s->cap_thread = origin->cap_thread;
        s->cap_graph = origin->cap_graph;
        s->cap_nodes = s->cap_joined = 0;
      }
    } else if (s->cap_id != e->cap_id) {
      r = CUDA_ERROR_STREAM_CAPTURE_MERGE;
    } else if (src && src != s && !src->cap_origin && e->cap_seq == src->cap_nodes) {
      src->cap_joined = src->cap_nodes; /* join: the forked stream's work is waited for */
    }
    if (r == CUDA_SUCCESS && s->cap_status == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
      r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    goto out;
  }
  if (r == CUDA_SUCCESS && s->cap_status != CU_STREAM_CAPTURE_STATUS_NONE && e->last &&
      !(Flags & CU_EVENT_WAIT_EXTERNAL)) {
    fake_invalidate_capture_locked(s->cap_id);
    r = CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
  }
  if (r == CUDA_SUCCESS) r = fake_op_add_dep_locked(op, e->last);
  if (r == CUDA_SUCCESS) {
    r = fake_enqueue_locked(s, op, NULL);
    op = NULL;
  }
out:
  if (op) {
    op->refs = 1;
    fake_op_unref_locked(op); /* never queued: drops its dependencies */
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* ---- stream capture ---- */

static CUresult fake_begin_capture(CUstream hStream, CUstreamCaptureMode mode) {
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  struct CUgraph_st *g = calloc(1, sizeof *g);
  if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) r = fake_stream_locked(hStream, c, &s);
  if (r == CUDA_SUCCESS && s->kind == FAKE_STREAM_LEGACY) r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (r == CUDA_SUCCESS && s->cap_status != CU_STREAM_CAPTURE_STATUS_NONE)
    r = CUDA_ERROR_ILLEGAL_STATE;
  if (r == CUDA_SUCCESS) {
    g->magic = FAKE_OBJ_MAGIC;
    g->next = F.graphs;
    F.graphs = g;
    g = NULL;
    s->cap_status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    s->cap_mode = mode;
    s->cap_id = F.next_capture_id++;
    s->cap_origin = 1;
    s->cap_thread = pthread_self();
    s->cap_graph = F.graphs;
    s->cap_nodes = s->cap_joined = 0;
    if (mode == CU_STREAM_CAPTURE_MODE_GLOBAL) {
      F.n_global_captures++;
      tls_global_captures++;
    }
    if (mode != CU_STREAM_CAPTURE_MODE_RELAXED) tls_strict_captures++;
  }
  pthread_mutex_unlock(&F.mu);
  free(g);
  return r;
}

FAKE_API CUresult cuStreamBeginCapture(CUstream hStream, CUstreamCaptureMode mode) {
  FAKE_COUNT(cuStreamBeginCapture);
  return fake_begin_capture(hStream, mode);
}

/* The CUDA 10.0 form: no mode (GLOBAL). */
static CUresult fake_begin_capture_v1(CUstream hStream) {
  FAKE_COUNT(cuStreamBeginCapture);
  return fake_begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

static void fake_free_graph_locked(struct CUgraph_st *g) {
  for (struct CUgraph_st **pp = &F.graphs; *pp; pp = &(*pp)->next)
    if (*pp == g) {
      *pp = g->next;
      break;
    }
  g->magic = 0;
  free(g);
}

FAKE_API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
  FAKE_COUNT(cuStreamEndCapture);
  if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
  *phGraph = NULL;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) r = fake_stream_locked(hStream, c, &s);
  if (r == CUDA_SUCCESS && s->cap_status == CU_STREAM_CAPTURE_STATUS_NONE)
    r = CUDA_ERROR_ILLEGAL_STATE;
  if (r == CUDA_SUCCESS && !s->cap_origin) r = CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
  if (r == CUDA_SUCCESS && s->cap_mode != CU_STREAM_CAPTURE_MODE_RELAXED &&
      !pthread_equal(s->cap_thread, pthread_self()))
    r = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
  if (r == CUDA_SUCCESS) {
    for (struct CUstream_st *x = F.streams; x; x = x->next)
      if (x != s && x->cap_status != CU_STREAM_CAPTURE_STATUS_NONE && x->cap_id == s->cap_id &&
          x->cap_nodes > x->cap_joined)
        r = CUDA_ERROR_STREAM_CAPTURE_UNJOINED;
    if (s->cap_status == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
      r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    struct CUgraph_st *g = s->cap_graph;
    fake_end_capture_locked(s);
    if (r == CUDA_SUCCESS) *phGraph = g;
    else if (g) fake_free_graph_locked(g);
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuGraphDestroy(CUgraph hGraph) {
  FAKE_COUNT(cuGraphDestroy);
  pthread_mutex_lock(&F.mu);
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  for (struct CUgraph_st *g = F.graphs; g; g = g->next)
    if (g == hGraph) {
      bool capturing = false;
      for (struct CUstream_st *x = F.streams; x; x = x->next) capturing |= x->cap_graph == g;
      r = capturing ? CUDA_ERROR_ILLEGAL_STATE : CUDA_SUCCESS;
      if (!capturing) fake_free_graph_locked(g);
      break;
    }
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* Status and id of the capture hStream takes part in (the legacy stream
 * while a blocking stream captures: STREAM_CAPTURE_IMPLICIT). */
static CUresult fake_capture_info(CUstream hStream, CUstreamCaptureStatus *status, cuuint64_t *id,
                                  CUgraph *graph) {
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) r = fake_stream_locked(hStream, c, &s);
  if (r == CUDA_SUCCESS && s->kind == FAKE_STREAM_LEGACY && fake_blocking_capture_locked(s->ctx))
    r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (r == CUDA_SUCCESS) {
    if (status) *status = s->cap_status;
    if (id && s->cap_status != CU_STREAM_CAPTURE_STATUS_NONE) *id = s->cap_id;
    if (graph) *graph = s->cap_status != CU_STREAM_CAPTURE_STATUS_NONE ? s->cap_graph : NULL;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
  FAKE_COUNT(cuStreamIsCapturing);
  if (!captureStatus) return CUDA_ERROR_INVALID_VALUE;
  return fake_capture_info(hStream, captureStatus, NULL, NULL);
}

/* CUDA 12.3+ (v3): with edge data. No dependency nodes are modelled. */
FAKE_API CUresult cuStreamGetCaptureInfo(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                         cuuint64_t *id_out, CUgraph *graph_out,
                                         const CUgraphNode **dependencies_out,
                                         const CUgraphEdgeData **edgeData_out,
                                         size_t *numDependencies_out) {
  FAKE_COUNT(cuStreamGetCaptureInfo);
  if (!captureStatus_out) return CUDA_ERROR_INVALID_VALUE;
  if (dependencies_out) *dependencies_out = NULL;
  if (edgeData_out) *edgeData_out = NULL;
  if (numDependencies_out) *numDependencies_out = 0;
  return fake_capture_info(hStream, captureStatus_out, id_out, graph_out);
}

/* CUDA 11.3 (v2): no edge data. */
static CUresult fake_get_capture_info_v2(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                         cuuint64_t *id_out, CUgraph *graph_out,
                                         const CUgraphNode **dependencies_out,
                                         size_t *numDependencies_out) {
  return cuStreamGetCaptureInfo(hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                                NULL, numDependencies_out);
}

/* CUDA 10.1 (v1): status and id. */
static CUresult fake_get_capture_info_v1(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                         cuuint64_t *id_out) {
  return cuStreamGetCaptureInfo(hStream, captureStatus_out, id_out, NULL, NULL, NULL, NULL);
}

FAKE_API CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
  FAKE_COUNT(cuThreadExchangeStreamCaptureMode);
  if (!mode || (*mode != CU_STREAM_CAPTURE_MODE_GLOBAL &&
                *mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
                *mode != CU_STREAM_CAPTURE_MODE_RELAXED))
    return CUDA_ERROR_INVALID_VALUE;
  CUstreamCaptureMode old = tls_capture_mode;
  tls_capture_mode = *mode;
  *mode = old;
  return CUDA_SUCCESS;
}

/* ---- per-thread default stream variants (_ptsz): NULL is CU_STREAM_PER_THREAD ---- */

static CUstream fake_ptsz(CUstream s) { return s == NULL ? CU_STREAM_PER_THREAD : s; }

static CUresult fake_prefetch_ptsz(CUdeviceptr d, size_t n, CUmemLocation l, unsigned f, CUstream h) {
  return cuMemPrefetchAsync(d, n, l, f, fake_ptsz(h));
}
static CUresult fake_prefetch_v1_ptsz(CUdeviceptr d, size_t n, CUdevice dst, CUstream h) {
  return fake_prefetch_v1(d, n, dst, fake_ptsz(h));
}

static CUresult fake_memcpy_htod_ptsz(CUdeviceptr d, const void *s, size_t n, CUstream h) {
  return cuMemcpyHtoDAsync(d, s, n, fake_ptsz(h));
}
static CUresult fake_memcpy_dtoh_ptsz(void *d, CUdeviceptr s, size_t n, CUstream h) {
  return cuMemcpyDtoHAsync(d, s, n, fake_ptsz(h));
}
static CUresult fake_memcpy_dtod_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) {
  return cuMemcpyDtoDAsync(d, s, n, fake_ptsz(h));
}
static CUresult fake_memset_d8_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream h) {
  return cuMemsetD8Async(d, v, n, fake_ptsz(h));
}
static CUresult fake_stream_sync_ptsz(CUstream h) { return cuStreamSynchronize(fake_ptsz(h)); }
static CUresult fake_stream_query_ptsz(CUstream h) { return cuStreamQuery(fake_ptsz(h)); }
static CUresult fake_stream_wait_event_ptsz(CUstream h, CUevent e, unsigned int f) {
  return cuStreamWaitEvent(fake_ptsz(h), e, f);
}
static CUresult fake_event_record_ptsz(CUevent e, CUstream h) {
  return cuEventRecord(e, fake_ptsz(h));
}
static CUresult fake_begin_capture_ptsz(CUstream h, CUstreamCaptureMode m) {
  return cuStreamBeginCapture(fake_ptsz(h), m);
}
static CUresult fake_begin_capture_v1_ptsz(CUstream h) { return fake_begin_capture_v1(fake_ptsz(h)); }
static CUresult fake_end_capture_ptsz(CUstream h, CUgraph *g) {
  return cuStreamEndCapture(fake_ptsz(h), g);
}
static CUresult fake_is_capturing_ptsz(CUstream h, CUstreamCaptureStatus *st) {
  return cuStreamIsCapturing(fake_ptsz(h), st);
}
static CUresult fake_capture_info_v3_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id,
                                          CUgraph *g, const CUgraphNode **d,
                                          const CUgraphEdgeData **ed, size_t *n) {
  return cuStreamGetCaptureInfo(fake_ptsz(h), st, id, g, d, ed, n);
}
static CUresult fake_capture_info_v2_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id,
                                          CUgraph *g, const CUgraphNode **d, size_t *n) {
  return fake_get_capture_info_v2(fake_ptsz(h), st, id, g, d, n);
}
static CUresult fake_capture_info_v1_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id) {
  return fake_get_capture_info_v1(fake_ptsz(h), st, id);
}
static CUresult fake_stream_priority_ptsz(CUstream h, int *p) {
  return cuStreamGetPriority(fake_ptsz(h), p);
}
static CUresult fake_stream_flags_ptsz(CUstream h, unsigned int *f) {
  return cuStreamGetFlags(fake_ptsz(h), f);
}

/* ======================================================================== */
/* Issue 27: the entry points of the preload's test programs (a runtime-style
 * loader, a direct link, dlsym of _v2 names, cudaMallocAsync-style pools).
 * Kept in one block so that other branches growing the double merge easily.
 *
 *  - cuCtxSetCurrent: issue 24's block below.
 *  - cuCtxGetDevice: the current context's device (INVALID_CONTEXT without one).
 *  - cuMemcpyHtoD_v2 / cuMemcpyDtoH_v2: synchronous copies on the legacy
 *    stream of the current context: they return once the copy (and the work
 *    queued before it there) is done; ranges checked as the async copies.
 *  - Stream-ordered allocation: cuMemAllocAsync takes from the current
 *    device's default pool (cuDeviceGetDefaultMemPool), cuMemAllocFromPoolAsync
 *    from a pool of cuMemPoolCreate (pinned, device-located, a valid ordinal:
 *    else INVALID_VALUE). Both charge the device like cuMemAlloc (OUT_OF_MEMORY
 *    past its free memory), check the stream (a stream of the current
 *    context), and need size > 0. cuMemFreeAsync frees only a stream-ordered
 *    allocation (else INVALID_VALUE): the memory goes back once the work
 *    queued on the stream before the free is done (the double waits for it
 *    on the host). cuMemFree of a stream-ordered allocation is allowed (the
 *    driver synchronises). cuMemPoolDestroy of a pool with live allocations
 *    returns at once; the pool goes when its last allocation is freed. The
 *    default pool cannot be destroyed (INVALID_VALUE). Pools keep nothing
 *    cached (release threshold 0).
 *  - cuPointerGetAttribute: MEMORY_TYPE (DEVICE for device and managed
 *    memory, HOST for registered host memory) and DEVICE_ORDINAL; a pointer
 *    the double does not know: INVALID_VALUE; other attributes: NOT_SUPPORTED
 *    (not modelled).
 *  - cuIpcGetMemHandle: the base of a cuMemAlloc allocation (else
 *    INVALID_VALUE: the driver refuses stream-ordered and host memory too).
 */

struct CUmemPoolHandle_st {
  uint32_t magic;        /* FAKE_OBJ_MAGIC while live */
  int device;            /* where its memory lives */
  bool is_default;       /* a device's default pool (never destroyed) */
  bool dying;            /* cuMemPoolDestroy called: freed with its last allocation */
  uint64_t n_live;       /* live allocations from it */
};
static struct CUmemPoolHandle_st fake_default_pools[FAKE_MAX_DEVICES];

static void fake_pool_unref_locked(struct CUmemPoolHandle_st *pool) {
  if (--pool->n_live == 0 && pool->dying) {
    pool->magic = 0;
    free(pool);
  }
}

static bool fake_ctx_known_locked(CUcontext ctx) {
  for (int d = 0; d < FAKE_MAX_DEVICES; d++)
    if (ctx == &F.ctx[d]) return ctx->retains > 0;
  return false;
}

FAKE_API CUresult cuCtxGetDevice(CUdevice *device) {
  FAKE_COUNT(cuCtxGetDevice);
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  CUresult r = fake_need_ctx_locked(&c);
  if (r == CUDA_SUCCESS) *device = c->device;
  pthread_mutex_unlock(&F.mu);
  return r;
}

/* A synchronous copy: queued on the legacy stream, waited for. */
static CUresult fake_copy_sync(uintptr_t dst, bool dst_dev, uintptr_t src, bool src_dev, size_t n) {
  CUresult r = fake_copy(dst, dst_dev, src, src_dev, n, NULL);
  if (r != CUDA_SUCCESS) return r;
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  fake_op *m = NULL;
  r = fake_stream_sync_marker_locked(NULL, &c, &m);
  if (r == CUDA_SUCCESS) {
    fake_wait_marker_locked(m);
    r = c->sticky;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
  FAKE_COUNT(cuMemcpyHtoD);
  return fake_copy_sync((uintptr_t)dstDevice, true, (uintptr_t)srcHost, false, ByteCount);
}

FAKE_API CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
  FAKE_COUNT(cuMemcpyDtoH);
  return fake_copy_sync((uintptr_t)dstHost, false, (uintptr_t)srcDevice, true, ByteCount);
}

/* A stream-ordered allocation from pool (NULL: the current device's default). */
static CUresult fake_alloc_async(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream h) {
  if (!dptr) return CUDA_ERROR_INVALID_VALUE;
  *dptr = 0;
  if (bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  uint64_t acc = ((uint64_t)bytesize + 255) & ~(uint64_t)255;
  size_t mapped = (bytesize + FAKE_PAGE - 1) & ~(size_t)(FAKE_PAGE - 1);
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  CUresult r = fake_target_locked(h, &c, &s);
  if (r == CUDA_SUCCESS && !pool) {
    pool = &fake_default_pools[c->device];
    if (pool->magic != FAKE_OBJ_MAGIC)
      *pool = (struct CUmemPoolHandle_st){FAKE_OBJ_MAGIC, c->device, true, false, 0};
  }
  if (r == CUDA_SUCCESS && (pool->magic != FAKE_OBJ_MAGIC || pool->dying)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && acc > fake_free_mem_locked(pool->device)) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    F.used_mem[pool->device] += acc;
    pool->n_live++;
  }
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  void *p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  fake_dalloc *a = p == MAP_FAILED ? NULL : malloc(sizeof *a);
  pthread_mutex_lock(&F.mu);
  if (!a) {
    F.used_mem[pool->device] -= acc;
    pool->n_live--;
    r = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    *a = (fake_dalloc){(uintptr_t)p, bytesize, mapped, acc, pool->device, F.dallocs, pool};
    F.dallocs = a;
    *dptr = (CUdeviceptr)(uintptr_t)p;
  }
  pthread_mutex_unlock(&F.mu);
  if (!a && p != MAP_FAILED) munmap(p, mapped);
  return r;
}

FAKE_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
  FAKE_COUNT(cuMemAllocAsync);
  return fake_alloc_async(dptr, bytesize, NULL, hStream);
}

FAKE_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                          CUstream hStream) {
  FAKE_COUNT(cuMemAllocFromPoolAsync);
  if (!pool) return CUDA_ERROR_INVALID_VALUE;
  return fake_alloc_async(dptr, bytesize, pool, hStream);
}

FAKE_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
  FAKE_COUNT(cuMemFreeAsync);
  pthread_mutex_lock(&F.mu);
  struct CUctx_st *c = NULL;
  struct CUstream_st *s = NULL;
  fake_dalloc *found = NULL;
  CUresult r = fake_target_locked(hStream, &c, &s);
  if (r == CUDA_SUCCESS) {
    for (fake_dalloc **pp = &F.dallocs; *pp; pp = &(*pp)->next)
      if ((*pp)->base == (uintptr_t)dptr && (*pp)->pool) {
        found = *pp;
        *pp = found->next; /* unlisted now: nothing new may be queued on it */
        break;
      }
    if (!found) r = CUDA_ERROR_INVALID_VALUE;
  }
  fake_op *m = NULL;
  if (r == CUDA_SUCCESS) r = fake_stream_marker_locked(s, &m);
  if (r == CUDA_SUCCESS && m) fake_wait_marker_locked(m); /* the stream's earlier work first */
  if (found && r != CUDA_SUCCESS) { /* nothing freed: listed again */
    found->next = F.dallocs;
    F.dallocs = found;
    found = NULL;
  }
  if (found) {
    F.used_mem[found->device] -= found->accounted;
    fake_pool_unref_locked(found->pool);
  }
  pthread_mutex_unlock(&F.mu);
  if (found) {
    munmap((void *)found->base, found->mapped);
    free(found);
  }
  return r;
}

static CUresult fake_alloc_async_ptsz(CUdeviceptr *d, size_t n, CUstream h) {
  return cuMemAllocAsync(d, n, fake_ptsz(h));
}
static CUresult fake_alloc_pool_ptsz(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream h) {
  return cuMemAllocFromPoolAsync(d, n, p, fake_ptsz(h));
}
static CUresult fake_free_async_ptsz(CUdeviceptr d, CUstream h) { return cuMemFreeAsync(d, fake_ptsz(h)); }

FAKE_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
  FAKE_COUNT(cuMemPoolCreate);
  if (!pool) return CUDA_ERROR_INVALID_VALUE;
  *pool = NULL;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_init_locked();
  if (r == CUDA_SUCCESS &&
      (!poolProps || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
       poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE || poolProps->location.id < 0 ||
       poolProps->location.id >= F.device_count))
    r = CUDA_ERROR_INVALID_VALUE;
  struct CUmemPoolHandle_st *p = r == CUDA_SUCCESS ? calloc(1, sizeof *p) : NULL;
  if (r == CUDA_SUCCESS && !p) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (p) {
    *p = (struct CUmemPoolHandle_st){FAKE_OBJ_MAGIC, poolProps->location.id, false, false, 0};
    *pool = p;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  FAKE_COUNT(cuMemPoolDestroy);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_init_locked();
  if (r == CUDA_SUCCESS && (!pool || pool->magic != FAKE_OBJ_MAGIC || pool->dying || pool->is_default))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    pool->dying = true;
    if (pool->n_live == 0) {
      pool->magic = 0;
      free(pool);
    }
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
  FAKE_COUNT(cuDeviceGetDefaultMemPool);
  if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
  *pool_out = NULL;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_device_locked(dev);
  if (r == CUDA_SUCCESS) {
    struct CUmemPoolHandle_st *p = &fake_default_pools[dev];
    if (p->magic != FAKE_OBJ_MAGIC) *p = (struct CUmemPoolHandle_st){FAKE_OBJ_MAGIC, dev, true, false, 0};
    *pool_out = p;
  }
  pthread_mutex_unlock(&F.mu);
  return r;
}

FAKE_API CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  FAKE_COUNT(cuPointerGetAttribute);
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_init_locked();
  int type = 0, device = 0;
  if (r == CUDA_SUCCESS) {
    for (fake_dalloc *a = F.dallocs; a && !type; a = a->next)
      if ((uintptr_t)ptr >= a->base && (uintptr_t)ptr - a->base < a->size) {
        type = CU_MEMORYTYPE_DEVICE;
        device = a->device;
      }
    if (!type && fake_managed_of_locked((uintptr_t)ptr, 1)) type = CU_MEMORYTYPE_DEVICE;
    if (!type && fake_pinned_range_locked((uintptr_t)ptr, 1)) type = CU_MEMORYTYPE_HOST;
    if (!type) r = CUDA_ERROR_INVALID_VALUE;
  }
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  switch (attribute) {
  case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = (unsigned int)type; return CUDA_SUCCESS;
  case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = device; return CUDA_SUCCESS;
  default: return CUDA_ERROR_NOT_SUPPORTED;
  }
}

FAKE_API CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
  FAKE_COUNT(cuIpcGetMemHandle);
  if (!pHandle) return CUDA_ERROR_INVALID_VALUE;
  memset(pHandle, 0, sizeof *pHandle);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_ctx_locked(NULL);
  bool ok = false;
  for (fake_dalloc *a = F.dallocs; r == CUDA_SUCCESS && a && !ok; a = a->next)
    ok = a->base == (uintptr_t)dptr && !a->pool;
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  if (!ok) return CUDA_ERROR_INVALID_VALUE;
  memcpy(pHandle->reserved, &dptr, sizeof dptr);
  return CUDA_SUCCESS;
}
/* ======================== end of issue 27's block ======================== */

/* ---- cuGetProcAddress: base name and version -> an implementation ---- */

FAKE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *symbolStatus);
static CUresult fake_get_proc_address_v1(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags);

/*
 * X(name, intro, abi, fn, ptsz): the base name, the CUDA version it first
 * appeared in, the CUDA version whose signature fn implements, fn, and its
 * per-thread default stream variant (NULL: takes no stream). A name with
 * several ABIs has one row per ABI, oldest first.
 */
#define FAKE_ENTRY_POINTS(X)                                                                     \
  X(cuGetErrorName, 6000, 6000, cuGetErrorName, NULL)                                           \
  X(cuGetErrorString, 6000, 6000, cuGetErrorString, NULL)                                       \
  X(cuDriverGetVersion, 2020, 2020, cuDriverGetVersion, NULL)                                   \
  X(cuGetProcAddress, 11030, 11030, fake_get_proc_address_v1, NULL)                             \
  X(cuGetProcAddress, 11030, 12000, cuGetProcAddress, NULL)                                     \
  X(cuInit, 2000, 2000, cuInit, NULL)                                                           \
  X(cuDeviceGetCount, 2000, 2000, cuDeviceGetCount, NULL)                                       \
  X(cuDeviceGet, 2000, 2000, cuDeviceGet, NULL)                                                 \
  X(cuDeviceGetAttribute, 2000, 2000, cuDeviceGetAttribute, NULL)                               \
  X(cuDeviceGetName, 2000, 2000, cuDeviceGetName, NULL)                                         \
  X(cuDeviceGetPCIBusId, 4010, 4010, cuDeviceGetPCIBusId, NULL)                                 \
  X(cuDeviceTotalMem, 2000, 3020, cuDeviceTotalMem, NULL)                                       \
  X(cuDevicePrimaryCtxRetain, 7000, 7000, cuDevicePrimaryCtxRetain, NULL)                       \
  X(cuDevicePrimaryCtxRelease, 7000, 11000, cuDevicePrimaryCtxRelease, NULL)                    \
  X(cuCtxGetCurrent, 4000, 4000, cuCtxGetCurrent, NULL)                                         \
  X(cuCtxPushCurrent, 2000, 4000, cuCtxPushCurrent, NULL)                                       \
  X(cuCtxPopCurrent, 2000, 4000, cuCtxPopCurrent, NULL)                                         \
  X(cuCtxSetCurrent, 4000, 4000, cuCtxSetCurrent, NULL)                                         \
  X(cuCtxSynchronize, 2000, 2000, cuCtxSynchronize, NULL)                                       \
  X(cuCtxGetStreamPriorityRange, 5050, 5050, cuCtxGetStreamPriorityRange, NULL)                 \
  X(cuMemGetInfo, 2000, 3020, cuMemGetInfo, NULL)                                               \
  X(cuMemAlloc, 2000, 3020, cuMemAlloc, NULL)                                                   \
  X(cuMemFree, 2000, 3020, cuMemFree, NULL)                                                     \
  X(cuMemHostRegister, 4000, 6050, cuMemHostRegister, NULL)                                     \
  X(cuMemHostUnregister, 4000, 4000, cuMemHostUnregister, NULL)                                 \
  X(cuMemHostGetDevicePointer, 2020, 3020, cuMemHostGetDevicePointer, NULL)                     \
  X(cuMemcpyHtoDAsync, 2000, 3020, cuMemcpyHtoDAsync, fake_memcpy_htod_ptsz)                    \
  X(cuMemcpyDtoHAsync, 2000, 3020, cuMemcpyDtoHAsync, fake_memcpy_dtoh_ptsz)                    \
  X(cuMemcpyDtoDAsync, 3000, 3020, cuMemcpyDtoDAsync, fake_memcpy_dtod_ptsz)                    \
  X(cuMemsetD8Async, 3020, 3020, cuMemsetD8Async, fake_memset_d8_ptsz)                          \
  X(cuStreamCreate, 2000, 2000, cuStreamCreate, NULL)                                           \
  X(cuStreamCreateWithPriority, 5050, 5050, cuStreamCreateWithPriority, NULL)                   \
  X(cuStreamDestroy, 2000, 4000, cuStreamDestroy, NULL)                                         \
  X(cuStreamSynchronize, 2000, 2000, cuStreamSynchronize, fake_stream_sync_ptsz)                \
  X(cuStreamQuery, 2000, 2000, cuStreamQuery, fake_stream_query_ptsz)                           \
  X(cuStreamWaitEvent, 3020, 3020, cuStreamWaitEvent, fake_stream_wait_event_ptsz)              \
  X(cuStreamGetPriority, 5050, 5050, cuStreamGetPriority, fake_stream_priority_ptsz)            \
  X(cuStreamGetFlags, 5050, 5050, cuStreamGetFlags, fake_stream_flags_ptsz)                     \
  X(cuEventCreate, 2000, 2000, cuEventCreate, NULL)                                             \
  X(cuEventRecord, 2000, 2000, cuEventRecord, fake_event_record_ptsz)                           \
  X(cuEventQuery, 2000, 2000, cuEventQuery, NULL)                                               \
  X(cuEventSynchronize, 2000, 2000, cuEventSynchronize, NULL)                                   \
  X(cuEventDestroy, 2000, 4000, cuEventDestroy, NULL)                                           \
  X(cuStreamBeginCapture, 10000, 10000, fake_begin_capture_v1, fake_begin_capture_v1_ptsz)      \
  X(cuStreamBeginCapture, 10000, 10010, cuStreamBeginCapture, fake_begin_capture_ptsz)          \
  X(cuStreamEndCapture, 10000, 10000, cuStreamEndCapture, fake_end_capture_ptsz)                \
  X(cuStreamIsCapturing, 10000, 10000, cuStreamIsCapturing, fake_is_capturing_ptsz)             \
  X(cuStreamGetCaptureInfo, 10010, 10010, fake_get_capture_info_v1, fake_capture_info_v1_ptsz)  \
  X(cuStreamGetCaptureInfo, 10010, 11030, fake_get_capture_info_v2, fake_capture_info_v2_ptsz)  \
  X(cuStreamGetCaptureInfo, 10010, 12030, cuStreamGetCaptureInfo, fake_capture_info_v3_ptsz)    \
  X(cuThreadExchangeStreamCaptureMode, 10010, 10010, cuThreadExchangeStreamCaptureMode, NULL)   \
  X(cuGraphDestroy, 10000, 10000, cuGraphDestroy, NULL)                                         \
  X(cuMemAllocManaged, 6000, 6000, cuMemAllocManaged, NULL)                                     \
  X(cuMemAdvise, 8000, 8000, fake_mem_advise_v1, NULL)                                          \
  X(cuMemAdvise, 8000, 12020, cuMemAdvise, NULL)                                                \
  X(cuMemPrefetchAsync, 8000, 8000, fake_prefetch_v1, fake_prefetch_v1_ptsz)                    \
  X(cuMemPrefetchAsync, 8000, 12020, cuMemPrefetchAsync, fake_prefetch_ptsz)                  \
  X(cuMemGetAllocationGranularity, 10020, 10020, cuMemGetAllocationGranularity, NULL)           \
  X(cuMemAddressReserve, 10020, 10020, cuMemAddressReserve, NULL)                               \
  X(cuMemAddressFree, 10020, 10020, cuMemAddressFree, NULL)                                     \
  X(cuMemCreate, 10020, 10020, cuMemCreate, NULL)                                               \
  X(cuMemRelease, 10020, 10020, cuMemRelease, NULL)                                             \
  X(cuMemMap, 10020, 10020, cuMemMap, NULL)                                                     \
  X(cuMemUnmap, 10020, 10020, cuMemUnmap, NULL)                                                 \
  X(cuMemSetAccess, 10020, 10020, cuMemSetAccess, NULL)                                         \
  X(cuDeviceGetUuid, 9020, 9020, cuDeviceGetUuid, NULL)                                         \
  X(cuDeviceGetUuid, 9020, 11040, cuDeviceGetUuid, NULL)                                       \
  X(cuMemcpyHtoD, 2000, 3020, cuMemcpyHtoD, NULL)                                               \
  X(cuMemcpyDtoH, 2000, 3020, cuMemcpyDtoH, NULL)                                               \
  X(cuMemAllocAsync, 11020, 11020, cuMemAllocAsync, fake_alloc_async_ptsz)                      \
  X(cuMemFreeAsync, 11020, 11020, cuMemFreeAsync, fake_free_async_ptsz)                         \
  X(cuMemAllocFromPoolAsync, 11020, 11020, cuMemAllocFromPoolAsync, fake_alloc_pool_ptsz)       \
  X(cuMemPoolCreate, 11020, 11020, cuMemPoolCreate, NULL)                                       \
  X(cuMemPoolDestroy, 11020, 11020, cuMemPoolDestroy, NULL)                                     \
  X(cuDeviceGetDefaultMemPool, 11020, 11020, cuDeviceGetDefaultMemPool, NULL)                   \
  X(cuPointerGetAttribute, 4000, 4000, cuPointerGetAttribute, NULL)                             \
  X(cuIpcGetMemHandle, 4010, 4010, cuIpcGetMemHandle, NULL)                                     \
  X(cuCtxGetDevice, 2000, 2000, cuCtxGetDevice, NULL)

static const struct {
  const char *name; /* base name, as cuGetProcAddress is asked */
  int intro;        /* CUDA version the name first appeared in */
  int abi;          /* CUDA version of fn's signature */
  void *fn;         /* this double's implementation */
  void *ptsz;       /* its per-thread default stream variant, or NULL */
} fake_entries[] = {
/* #name is not macro-expanded ("cuMemAlloc"); fn is (cuMemAlloc_v2). */
#define FAKE_ENTRY_ROW(name, intro, abi, fn, ptsz) {#name, intro, abi, (void *)&fn, (void *)ptsz},
    FAKE_ENTRY_POINTS(FAKE_ENTRY_ROW)
#undef FAKE_ENTRY_ROW
};

FAKE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *symbolStatus) {
  FAKE_TALLY(cuGetProcAddress);
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  *pfn = NULL;
  if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  if (cudaVersion > fake_driver_version()) return CUDA_ERROR_INVALID_VALUE;
  if (flags > (CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
    return CUDA_ERROR_INVALID_VALUE;
  bool per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) &&
                    !(flags & CU_GET_PROC_ADDRESS_LEGACY_STREAM);
  int best = -1, intro = 0;
  for (size_t i = 0; i < sizeof fake_entries / sizeof fake_entries[0]; i++) {
    if (strcmp(symbol, fake_entries[i].name) != 0) continue;
    intro = fake_entries[i].intro;
    if (fake_entries[i].abi <= cudaVersion) best = (int)i; /* rows are oldest first */
  }
  if (best < 0) {
    /* CUDA_SUCCESS and a NULL pfn, as the driver answers. Unknown, versioned
     * ("cuMemAlloc_v2"), or an ABI this double lacks: not found; older than
     * the name itself: version not sufficient. */
    if (intro != 0 && cudaVersion < intro && symbolStatus)
      *symbolStatus = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    return CUDA_SUCCESS;
  }
  *pfn = per_thread && fake_entries[best].ptsz ? fake_entries[best].ptsz : fake_entries[best].fn;
  if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}

/* The CUDA 11.3 to 11.8 form, without the status. */
static CUresult fake_get_proc_address_v1(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags) {
  return cuGetProcAddress(symbol, pfn, cudaVersion, flags, NULL);
}

/* Exported under its 11.x name too, for loaders that dlsym it. */
#undef cuGetProcAddress
FAKE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
FAKE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
  return fake_get_proc_address_v1(symbol, pfn, cudaVersion, flags);
}

/* ---- control API (fake_cuda.h) ---- */

static void fake_release_holds_locked(struct CUstream_st *only) {
  for (struct CUstream_st *s = F.streams; s; s = s->next)
    if (!only || s == only)
      for (fake_op *op = s->head; op; op = op->next) op->held = 0;
}

FAKE_API void fake_cuda_reset(void) {
  pthread_mutex_lock(&F.mu);
  F.calls = 0;
  memset(F.per_call, 0, sizeof F.per_call);
  F.fail_at = 0;
  F.fail_sticky = 0;
  F.fault_hit = 0;
  F.fault_call = "";
  F.hold_all = 0;
  F.paused = 0;
  F.other_used_set = 0;
  F.bad_event_destroys = 0;
  F.bad_handles = 0;
  fake_read_env_locked();
  for (int d = 0; d < FAKE_MAX_DEVICES; d++) F.ctx[d].sticky = CUDA_SUCCESS;
  for (struct CUstream_st *s = F.streams; s; s = s->next) s->held = 0;
  fake_release_holds_locked(NULL);
  fake_settle_locked();
  pthread_mutex_unlock(&F.mu);
}

static void fake_arm_locked(uint64_t n, int result, int sticky) {
  F.calls = 0;
  F.fail_at = n;
  F.fail_result = (CUresult)result;
  F.fail_sticky = sticky;
  F.fault_hit = 0;
  F.fault_call = "";
}

FAKE_API void fake_cuda_set_fail_at(uint64_t n, int result) {
  pthread_mutex_lock(&F.mu);
  fake_arm_locked(n, result, 0);
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_set_sticky_at(uint64_t n, int result) {
  pthread_mutex_lock(&F.mu);
  fake_arm_locked(n, result, 1);
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_set_sticky(int result) {
  pthread_mutex_lock(&F.mu);
  if (result == CUDA_SUCCESS)
    for (int d = 0; d < FAKE_MAX_DEVICES; d++) F.ctx[d].sticky = CUDA_SUCCESS;
  else
    fake_poison_locked((CUresult)result);
  pthread_mutex_unlock(&F.mu);
}

FAKE_API const char *fake_cuda_fault_call(void) {
  pthread_mutex_lock(&F.mu);
  const char *s = F.fault_call;
  pthread_mutex_unlock(&F.mu);
  return s;
}

FAKE_API int fake_cuda_managed_page(const void *p, int *preferred, int *accessed_by) {
  pthread_mutex_lock(&F.mu);
  fake_managed *m = fake_managed_of_locked((uintptr_t)p, 1);
  int at = -1;
  if (m) {
    size_t i = ((uintptr_t)p - m->base) / FAKE_PAGE;
    at = m->at[i];
    if (preferred) *preferred = m->preferred[i];
    if (accessed_by) *accessed_by = m->accessed_by[i];
  }
  pthread_mutex_unlock(&F.mu);
  return at;
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
  for (fake_managed *m = F.manageds; m; m = m->next) {
    out->managed_allocs++;
    for (size_t i = 0; i < m->mapped / FAKE_PAGE; i++) {
      out->managed_device_bytes += m->at[i] == FAKE_AT_DEVICE ? FAKE_PAGE : 0;
      out->managed_host_bytes += m->at[i] == FAKE_AT_HOST ? FAKE_PAGE : 0;
    }
  }
  out->managed_evicted_bytes = F.managed_evicted;
  for (fake_vres *v = F.vres; v; v = v->next) out->vmm_reservations++;
  for (fake_vphys *ph = F.vphys; ph; ph = ph->next) {
    out->vmm_allocations++;
    out->vmm_bytes += ph->size;
  }
  for (fake_vmap *m = F.vmaps; m; m = m->next) out->vmm_mappings++;
  out->vmm_unmaps_in_use = F.vmm_unmaps_in_use;
  out->stream_races = F.stream_races;
  for (struct CUstream_st *s = F.streams; s; s = s->next) {
    out->streams += s->kind == FAKE_STREAM_USER && !s->destroyed;
    for (fake_op *op = s->head; op; op = op->next) out->pending_ops++;
    out->captures_active += s->cap_origin;
  }
  for (struct CUevent_st *e = F.events; e; e = e->next) {
    out->events++;
    out->pending_events += e->last && !e->last->done;
  }
  for (struct CUgraph_st *g = F.graphs; g; g = g->next) out->graphs++;
  for (int d = 0; d < FAKE_MAX_DEVICES; d++) {
    out->ctx_retains += (uint64_t)F.ctx[d].retains;
    if (F.ctx[d].sticky != CUDA_SUCCESS) out->sticky_result = (uint64_t)F.ctx[d].sticky;
  }
  out->fault_hit = (uint64_t)F.fault_hit;
  out->bad_event_destroys = F.bad_event_destroys;
  out->bad_handles = F.bad_handles;
  pthread_mutex_unlock(&F.mu);
}

FAKE_API uint64_t fake_cuda_live_allocations(void) {
  fake_cuda_stats st;
  fake_cuda_get_stats(&st);
  return st.device_allocs + st.host_registrations + st.vmm_allocations + st.vmm_reservations;
}

FAKE_API void fake_cuda_hold_events(int on) {
  pthread_mutex_lock(&F.mu);
  F.hold_all = on != 0;
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_complete_events(void) {
  pthread_mutex_lock(&F.mu);
  fake_release_holds_locked(NULL);
  fake_settle_locked();
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void *fake_cuda_stream_create(void) {
  pthread_mutex_lock(&F.mu);
  void *s = fake_new_stream_locked(FAKE_STREAM_TEST, &F.ctx[0], 0, FAKE_PRIORITY_LEAST);
  pthread_mutex_unlock(&F.mu);
  return s;
}

FAKE_API void fake_cuda_stream_destroy(void *stream) {
  pthread_mutex_lock(&F.mu);
  struct CUstream_st *s = NULL;
  if (stream && fake_stream_locked(stream, NULL, &s) == CUDA_SUCCESS) fake_destroy_stream_locked(s);
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_hold_stream(void *stream, int on) {
  pthread_mutex_lock(&F.mu);
  struct CUstream_st *s = NULL;
  if (fake_stream_locked(stream, &F.ctx[0], &s) == CUDA_SUCCESS) s->held = on != 0;
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_complete_stream(void *stream) {
  pthread_mutex_lock(&F.mu);
  struct CUstream_st *s = NULL;
  if (fake_stream_locked(stream, &F.ctx[0], &s) == CUDA_SUCCESS) {
    fake_release_holds_locked(s);
    fake_settle_locked();
  }
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_set_delay_us(uint64_t us) {
  pthread_mutex_lock(&F.mu);
  F.delay_us = us;
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_pause(int on) {
  pthread_mutex_lock(&F.mu);
  F.paused = on != 0;
  pthread_cond_broadcast(&F.work_cv);
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_set_lazy(int on) {
  pthread_mutex_lock(&F.mu);
  F.lazy = on != 0;
  pthread_cond_broadcast(&F.work_cv);
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_settle(void) {
  pthread_mutex_lock(&F.mu);
  fake_settle_locked();
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_set_other_used(uint64_t bytes) {
  pthread_mutex_lock(&F.mu);
  F.other_used = bytes;
  F.other_used_set = 1;
  pthread_mutex_unlock(&F.mu);
}

FAKE_API void fake_cuda_set_host_register_result(int result) {
  pthread_mutex_lock(&F.mu);
  F.host_register_result = (CUresult)result;
  pthread_mutex_unlock(&F.mu);
}

FAKE_API uint64_t fake_cuda_calls(const char *name) {
  pthread_mutex_lock(&F.mu);
  uint64_t n = 0;
  if (!name || !*name) {
    n = F.calls;
  } else {
    for (int i = 0; i < FAKE_N_IDS; i++)
      if (strcmp(name, fake_call_names[i]) == 0) n = F.per_call[i];
  }
  pthread_mutex_unlock(&F.mu);
  return n;
}

/* FAKE_CUDA_DUMP_CALLS=1: at exit, the calls of every entry point that was
 * called, one "fake_cuda: NAME N" line each on stderr (finding where a
 * program's driver calls go, issue 26). */
__attribute__((destructor)) static void fake_dump_calls(void) {
  const char *e = getenv("FAKE_CUDA_DUMP_CALLS");
  if (!e || strcmp(e, "1") != 0) return;
  for (int i = 0; i < FAKE_N_IDS; i++)
    if (F.per_call[i])
      fprintf(stderr, "fake_cuda: %s %llu\n", fake_call_names[i], (unsigned long long)F.per_call[i]);
}

/* ==== issue 24 (first contact): the current context set, kernels ====
 * Kept in one block (other branches grow the double too). */

/* cuCtxSetCurrent: replaces the top of the thread's context stack (pushes
 * onto an empty one); NULL pops the top (nothing when the stack is empty),
 * as cuda.h documents. The context must be a retained primary context. Every
 * later call that needs a context is charged to the one current then (its
 * device's memory, its legacy stream). */
FAKE_API CUresult cuCtxSetCurrent(CUcontext ctx) {
  FAKE_COUNT(cuCtxSetCurrent);
  pthread_mutex_lock(&F.mu);
  CUresult r = fake_need_init_locked();
  if (r == CUDA_SUCCESS && ctx && !fake_ctx_known_locked(ctx)) r = CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_unlock(&F.mu);
  if (r != CUDA_SUCCESS) return r;
  if (!ctx) {
    if (tls_depth > 0) tls_depth--;
  } else if (tls_depth == 0) {
    tls_ctx[tls_depth++] = ctx;
  } else {
    tls_ctx[tls_depth - 1] = ctx;
  }
  return CUDA_SUCCESS;
}

/* A read kernel's work: every byte of its range is loaded (a faulting range
 * would crash here, as a GPU would fault; cuMemUnmap drops or waits for it
 * first, and counts it). */
static void fake_kernel_read(const fake_op *op) {
  volatile const unsigned char *p = (volatile const unsigned char *)op->dst;
  unsigned sum = 0;
  for (size_t i = 0; i < op->n; i += 64) sum += p[i];
  (void)sum;
}

FAKE_API int fake_cuda_kernel(void *stream, void *ptr, uint64_t n, int value, uint64_t us) {
  if (n == 0 || !ptr || value > 255) return CUDA_ERROR_INVALID_VALUE;
  fake_op *op = calloc(1, sizeof *op);
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  *op = (fake_op){.kind = FAKE_OP_KERNEL, .dst = (uintptr_t)ptr, .n = (size_t)n,
                  .value = (unsigned char)(value < 0 ? 0 : value), .write = value >= 0,
                  .run_us = us};
  return (int)fake_enqueue_on_range(op, (CUstream)stream);
}

/* ==== issue 26: work of two streams on the same memory, unordered ====
 * Kept in one block (other branches grow the double too).
 *
 * A GPU runs the work of two streams concurrently unless something orders
 * them: a cuStreamWaitEvent on an event recorded after the earlier work, or
 * the legacy stream's implicit order with blocking streams. An allocator
 * that hands one stream memory another stream's queued kernel still writes
 * (or reads, when the new work writes) without such an order makes the two
 * race. The double counts each operation queued that way (stats.
 * stream_races): when a copy, memset or kernel is queued on stream s, every
 * pending operation of another stream touching an overlapping range, one of
 * the two writing it, must be one it already depends on (its explicit
 * dependencies, s's earlier work, and theirs, transitively). */

/* The bytes op writes ([*w, *w + *wn)) and reads ([*r, *r + *rn)) when it
 * runs; 0 lengths for none. */
static void fake_op_access(const fake_op *op, uintptr_t *w, size_t *wn, uintptr_t *r, size_t *rn) {
  *w = *r = 0;
  *wn = *rn = 0;
  if (op->kind == FAKE_OP_COPY) {
    *w = op->dst;
    *wn = op->n;
    if (!op->staged) {
      *r = op->src;
      *rn = op->n;
    }
  } else if (op->kind == FAKE_OP_MEMSET || (op->kind == FAKE_OP_KERNEL && op->write)) {
    *w = op->dst;
    *wn = op->n;
  } else if (op->kind == FAKE_OP_KERNEL) {
    *r = op->dst;
    *rn = op->n;
  }
}

/* Do a and b touch common bytes, one of them writing them? */
static bool fake_ops_conflict(const fake_op *a, const fake_op *b) {
  uintptr_t aw, ar, bw, br;
  size_t awn, arn, bwn, brn;
  fake_op_access(a, &aw, &awn, &ar, &arn);
  fake_op_access(b, &bw, &bwn, &br, &brn);
  return fake_ranges_overlap(aw, awn, bw, bwn) || fake_ranges_overlap(aw, awn, br, brn) ||
         fake_ranges_overlap(ar, arn, bw, bwn);
}

/* Is the pending op y among the work op (about to be queued on s) runs
 * after? A walk over pending operations: op's dependencies and s's queue,
 * each visited op's dependencies and the ops before it in its own queue. */
static bool fake_ordered_after_locked(const fake_op *y, struct CUstream_st *s, const fake_op *op) {
  uint64_t epoch = ++F.race_epoch;
  size_t n = 0, cap = 64;
  const fake_op **stack = malloc(cap * sizeof *stack);
  if (!stack) return true; /* cannot tell: no race counted */
  bool found = false;
#define FAKE_PUSH(x)                                                        \
  do {                                                                      \
    if (n == cap) {                                                         \
      const fake_op **g = realloc(stack, 2 * cap * sizeof *stack);          \
      if (!g) {                                                             \
        found = true;                                                       \
        goto out;                                                           \
      }                                                                     \
      stack = g;                                                            \
      cap *= 2;                                                             \
    }                                                                       \
    stack[n++] = (x);                                                       \
  } while (0)
  for (int i = 0; i < op->n_deps; i++) FAKE_PUSH(op->deps[i]);
  for (fake_op *q = s->head; q; q = q->next) FAKE_PUSH(q);
  while (n > 0 && !found) {
    fake_op *z = (fake_op *)stack[--n];
    if (z == y) {
      found = true;
      break;
    }
    if (z->done || z->mark == epoch) continue;
    z->mark = epoch;
    for (int i = 0; i < z->n_deps; i++) FAKE_PUSH(z->deps[i]);
    if (z->stream)
      for (fake_op *q = z->stream->head; q && q != z; q = q->next) FAKE_PUSH(q);
  }
#undef FAKE_PUSH
out:
  free(stack);
  return found;
}

static void fake_race_check_locked(struct CUstream_st *s, fake_op *op) {
  if (op->n == 0 || (op->kind != FAKE_OP_COPY && op->kind != FAKE_OP_MEMSET && op->kind != FAKE_OP_KERNEL))
    return;
  for (struct CUstream_st *x = F.streams; x; x = x->next) {
    if (x == s) continue;
    for (fake_op *y = x->head; y; y = y->next) {
      if (y->done || y->n == 0 || !fake_ops_conflict(y, op)) continue;
      if (!fake_ordered_after_locked(y, s, op)) {
        F.stream_races++;
        return; /* one count per operation */
      }
    }
  }
}
