/*
 * backend.h — the contract between sgm and a device driver.
 *
 * Only lib/backend/ talks to a driver. The rest of sgm sees a device through
 * the sgm_backend_ops vtable below and never dereferences device memory: it
 * moves bytes only through the copy functions.
 *
 * Contract (every backend):
 *  - open() takes the resolved config and returns an opened device or an
 *    sgm_status < 0 with the thread's error set (via sgm__error_set) to a message
 *    that names what failed and what to do.
 *  - Every function that returns int returns SGM_OK or a negative sgm_status and
 *    sets the error message on failure; on failure nothing was allocated and all
 *    out-parameters are 0 / NULL.
 *  - device_alloc() returns device memory aligned to at least 256 bytes
 *    (SGM_DEVICE_ALIGN), not zeroed. The address is a device address: the CPU may
 *    not touch it (the emulated device happens to use host memory, but sgm does
 *    not rely on that).
 *  - host_alloc() returns page-locked host memory that the device can address,
 *    with both the host pointer and the device address, placed on NUMA node
 *    numa_node; numa_node < 0 means "the device's own node" (the GPU's node from
 *    its PCI bus id on CUDA, the calling CPU's node on the emulated device).
 *  - The free functions cannot fail from sgm's point of view: a driver error
 *    there is reported through the log, never returned.
 *  - copy() copies n bytes between any two addresses the kind names, in order on
 *    `stream` (NULL = the backend's own stream, which waits for nobody's work;
 *    SGM_STREAM_LEGACY = the legacy default stream), and returns when the copy
 *    is complete as seen from the host: the source may be reused, freed or
 *    unpinned at once, the destination is ready for any later work.
 *    Ordering: a copy on the caller's stream starts only after all work queued
 *    there before it. That is how sgm orders a migration after the work that
 *    last used a buffer (the release event's stream): on the device, without
 *    waiting for that work on the host first. A copy on a stream that is
 *    capturing a CUDA graph would be captured instead of run: it is refused
 *    with SGM_ERR_BUSY (nothing copied).
 *  - Every function is safe to call from any thread at once; sgm holds none of
 *    its locks across a backend call (but the outermost hooks lock while a
 *    context opens its backend), except event_query() and event_destroy(),
 *    which never block and are called under a residency lock while choosing
 *    victims. Debug builds check it: every other operation of cuda.c and
 *    emu.c starts with sgm__lock_assert_none_held().
 *  - The backend counts its live allocations; close() with allocations still
 *    live frees them and reports the leak at SGM_VERBOSE >= 1.
 *
 * Events (stream-ordered safety: "may this memory be touched by other work
 * yet?"). `stream` is the caller's stream as an opaque pointer (a CUstream on
 * CUDA, the same handle a cudaStream_t is); NULL names the legacy default
 * stream 0. An event is an opaque token owned by sgm until event_destroy().
 *  - event_record() records an event at the current end of `stream`: it
 *    completes when all work queued on that stream before it has completed.
 *    *event_out is NULL on failure.
 *  - event_query() returns 1 when the event has completed, 0 while work before
 *    it is pending, or a negative sgm_status (error message set). Never blocks.
 *    While the event's stream is capturing a CUDA graph it answers 0 without
 *    asking the driver (an event recorded into a capture is a graph node;
 *    querying it would invalidate the capture): blocks freed or buffers
 *    released during a capture wait for its end.
 *  - event_wait() blocks the calling thread until the event has completed;
 *    SGM_OK or a negative sgm_status (SGM_ERR_BUSY while its stream captures).
 *  - Graph capture: the memory functions (device/host alloc and free) never
 *    invalidate another thread's capture (CUDA: relaxed capture mode around
 *    the driver's memory calls).
 *  - event_destroy() releases the token (also while still pending: the work
 *    goes on, only the token is gone); NULL is a no-op; cannot fail.
 *  - The emulated device finishes all work before returning, so its events are
 *    complete as soon as they are recorded; it still allocates a token per
 *    event so that leaks show in counters.n_events_live.
 *  - Tokens live in the backend: close() destroys those still live (and
 *    reports them as a leak at SGM_VERBOSE >= 1).
 *
 * Streams and pooled events (the stream-ordered caches of lib/tiers/pool):
 *  - stream_ref() names the caller's stream: a key equal for two handles
 *    exactly when they are the same stream, and the handle to pass back. It
 *    makes no driver call and cannot fail. NULL and CU_STREAM_LEGACY (0x1) are
 *    the legacy stream, key 0; CU_STREAM_PER_THREAD (0x2) is the calling
 *    thread's own default stream, a key of its own per thread (never a
 *    pointer value); any other handle is its own key. A synchronous backend
 *    answers key 0 for every stream: all its work is finished already.
 *  - event_create() makes an event that is not recorded yet (it counts as
 *    complete); sgm pools these and records them again and again.
 *  - event_record_on() records an existing event at the current end of the
 *    named stream. A per-thread stream of another thread cannot be named from
 *    here: the event is then recorded on the legacy stream, which the driver
 *    orders after all earlier work of every blocking stream (per-thread
 *    default streams are blocking), so it still covers that work.
 *  - stream_wait_event() makes all work queued on the stream after this call
 *    wait, on the device, for the event's last recording; the host never
 *    waits. The event may be recorded again at once after the call.
 *  - Both refuse with SGM_ERR_BUSY (nothing recorded or waited) while their
 *    stream captures a CUDA graph, or, for the legacy stream, while a blocking
 *    stream captures (any work on it would invalidate that capture): memory
 *    does not cross streams during a capture (CUDA: one cuStreamIsCapturing
 *    before each).
 *  - Transfers: stream_transfer(event, owner, taker) makes all work queued on
 *    taker after the call wait, on the device, for all work queued on owner
 *    before it; `event` is a pooled event it may record (and that may be
 *    recorded again at once after the call). SGM_ERR_BUSY (nothing ordered)
 *    while a capture makes that unsafe, as above. The CUDA backend uses the
 *    legacy stream's implicit ordering where both streams are blocking: one
 *    or two driver calls, four with a non-blocking stream (cuda.c).
 *  - stream_transfer_fence(event, owner, taker, fenced) does what
 *    stream_transfer does and also says whether `event` now stands, outside
 *    any capture, after all work queued on owner before the call (*fenced:
 *    recorded on owner, or on the legacy stream when owner is blocking) —
 *    also when it fails afterwards on the taker's side (the taker captures).
 *    The caller then keeps the event as the owner's fence (queried later,
 *    waited on by other takers) instead of pooling it again. *fenced false:
 *    nothing of the event's is left to keep. NULL op: stream_transfer.
 *  - These four, with event_query/event_wait/event_destroy, are the only
 *    calls on sgm's steady allocation path, and that path makes none of them
 *    unless memory crosses from one stream to another: no backend-wide lock
 *    and no query of the current context is taken on the way.
 *
 * Expandable VRAM (the driver's virtual-memory API; growth mode's VRAM pool,
 * DESIGN.md §8). A *range* is a reserved span of device addresses with no
 * memory behind it; memory is mapped into it and unmapped again in
 * *granules*, each its own physical allocation, so that any granule can go
 * back alone.
 *  - vmm_granularity() answers the granule size in bytes (a power of two,
 *    2 MiB on current GPUs), or 0 when the device has no virtual-memory API
 *    (CUDA: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED); sgm then
 *    grows in device_alloc chunks.
 *  - vmm_reserve() reserves bytes (a multiple of the granule) aligned to the
 *    granule: *range_out is the backend's token, *base_out its first address.
 *    Reserving costs address space only.
 *  - vmm_map() maps device memory at [base + offset, + bytes), granule
 *    aligned, every granule of it unmapped now, as ONE mapping, and makes it
 *    readable and writable by the device before it returns (CUDA: one
 *    cuMemCreate of the run's bytes, one cuMemMap, one cuMemSetAccess: the
 *    calls do not grow with the run, issue 26). All or nothing: on failure
 *    nothing of the run stays mapped (SGM_ERR_NOMEM when the device is out of
 *    memory). Mapped bytes count in device_live_bytes.
 *  - vmm_unmap() unmaps whole mappings made by vmm_map (a run that starts at
 *    one's first granule and ends at one's last; several neighbours at once
 *    are fine) and frees their memory: as cuMemUnmap, a mapping is never
 *    unmapped in part (a run that would is a broken contract, asserted and
 *    ignored). The driver does not wait for device work: the caller unmaps
 *    only memory no queued work uses. Cannot fail from sgm's point of view
 *    (a driver error is logged).
 *  - vmm_map_runs() maps several runs, each as ONE mapping as vmm_map would,
 *    in order, and stops at the first that fails: *n_done runs are mapped,
 *    each whole, the status is the failure's; a backend may map neighbouring
 *    runs as a group that stands or falls together (CUDA: one cuMemSetAccess
 *    for the group), so a failed run can take its mapped neighbours with it.
 *    vmm_unmap_runs() unmaps several runs as vmm_unmap would. CUDA: the
 *    context is entered and the capture mode relaxed once for all the runs,
 *    where a call per run paid those three driver calls each time (issue
 *    26). NULL: the caller calls vmm_map and vmm_unmap per run.
 *  - vmm_free() releases a range; granules still mapped are unmapped first
 *    and reported as a leak at SGM_VERBOSE >= 1. NULL is a no-op.
 *  - None of them is on the steady allocation path: sgm maps when committed
 *    memory grows and unmaps on trim.
 */
/*
 * Managed memory (CUDA Unified Memory; SGM_POINTERS=managed, lib/placement/managed.c).
 * One address the CPU and the device share; its pages live in device memory
 * or in host memory and move under advice and prefetches.
 *  - managed_support() answers SGM_OK when the device and driver can run
 *    managed mode (CUDA: CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS and the
 *    CUmemLocation forms of cuMemAdvise and cuMemPrefetchAsync), else
 *    SGM_ERR_UNSUPPORTED with a message that says what is missing.
 *  - managed_alloc() returns a range of `bytes` rounded up to whole pages
 *    (SGM_MANAGED_PAGE), pages no other allocation shares, aligned to at
 *    least SGM_DEVICE_ALIGN; no page is placed yet (not counted as device
 *    memory until prefetched there). managed_free() cannot fail and gives
 *    back every page of the range wherever it is (the driver waits for the
 *    work using it).
 *  - managed_advise() sets advice on the pages of [ptr, ptr + n): the
 *    preferred location (device or host) and whether the device maps host
 *    pages so that it reads them over the bus without faulting. Advice is
 *    page granular: every page the range touches gets it.
 *  - managed_prefetch() moves the pages of [ptr, ptr + n) (whole pages: a
 *    page the range touches moves entirely) to `to` (SGM_TIER_VRAM or
 *    SGM_TIER_SHARED), in order on `stream` (as copy(): after all work
 *    queued there before it; NULL = the backend's own stream; refused with
 *    SGM_ERR_BUSY while the stream captures a graph), and returns once the
 *    move is complete, as copy() does, so sgm counts pages where they are. Bytes
 *    survive the move. Device-placed pages count as device memory in
 *    mem_info. A move to the device that does not fit in its free memory is
 *    refused with SGM_ERR_NOMEM by the emulated device: sgm must never ask the
 *    driver to evict on its own.
 */
/*
 * Reserve mode on the virtual-memory API (issue 17: SGM_ALLOW_GROWTH=0 with
 * a VMM-capable device). The budget's physical memory is taken once, as a
 * *pool* of granules, and those granules are mapped into a reserved range
 * (vmm_reserve) wherever blocks land and unmapped again, but go back to the
 * pool, not to the driver, until the pool is freed.
 *  - vmm_pool_create() takes n granules (the vmm_granularity size each) of
 *    device memory now, all or nothing (SGM_ERR_NOMEM when the device has not
 *    that much free); granule i of the pool is named by its index. They count
 *    in device_live_bytes (and n_vmm_pool_granules) from here until
 *    vmm_pool_free, mapped or not. CUDA: one cuMemCreate per granule, the
 *    handles kept.
 *  - vmm_pool_map() maps pool granule idx[k] at range offset + k granules for
 *    k < n (offset granule aligned, those range granules unmapped now, each
 *    pool granule mapped nowhere now) and makes the run readable and writable
 *    by the device before it returns (CUDA: cuMemMap of each kept handle, then
 *    cuMemSetAccess over the run: access is granted after every map). A pool
 *    granule keeps its bytes while it is unmapped: mapped again (anywhere), it
 *    holds what was written to it. All or nothing, as vmm_map. Mapped bytes
 *    count in vmm_mapped_bytes, not again in device_live_bytes.
 *  - vmm_pool_unmap() unmaps whole pool-mapped granules of a range; their
 *    memory stays in the pool (CUDA: cuMemUnmap, no cuMemRelease). As
 *    vmm_unmap, the driver does not wait for device work. Cannot fail from
 *    sgm's point of view. vmm_unmap must not be given pool-mapped granules,
 *    nor vmm_pool_unmap granules mapped by vmm_map.
 *  - vmm_pool_free() gives every granule of the pool back to the driver
 *    (CUDA: cuMemRelease of each handle). A granule still mapped stays
 *    mapped until its range is unmapped or freed, as CUDA keeps a released
 *    handle's memory while a mapping holds it; sgm unmaps first. NULL is a
 *    no-op.
 *  - Only reserve mode uses them; NULL vmm_pool_create = none (reserve mode
 *    then takes the budget as one contiguous chunk).
 */
#ifndef SGM_BACKEND_H
#define SGM_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sgm.h"

/* cudaMalloc guarantees 256-byte alignment; sgm promises the same. */
#define SGM_DEVICE_ALIGN 256u

typedef uint64_t sgm_devptr; /* a device address (CUdeviceptr on CUDA) */
/* A run of whole granules of a reserved range: [offset, offset + bytes) from its base. */
typedef struct sgm_vmm_run {
  uint64_t offset;
  uint64_t bytes;
} sgm_vmm_run;

/* The legacy default stream, named to copy() (where NULL means the backend's
 * own stream); the value of CU_STREAM_LEGACY. Its work follows all earlier
 * work of every blocking stream, per-thread default streams included. */
#define SGM_STREAM_LEGACY ((void *)(uintptr_t)0x1)
/* The calling thread's per-thread default stream (CU_STREAM_PER_THREAD): the
 * same handle names another stream on every thread. */
#define SGM_STREAM_PER_THREAD ((void *)(uintptr_t)0x2)

/* The page of managed memory as sgm counts it: the granule of advice and of
 * moves on the emulated device, and a multiple of the driver's (4 KiB host
 * pages, 64 KiB GPU pages): sgm never lets two blocks that move on their
 * own share one. */
#define SGM_MANAGED_PAGE 65536u

/* Advice on managed pages (managed_advise). */
typedef enum sgm_managed_advice {
  SGM_ADVISE_PREFER_DEVICE = 0, /* preferred location: the device */
  SGM_ADVISE_PREFER_HOST = 1,   /* preferred location: host memory (the GPU's NUMA node where known) */
  SGM_ADVISE_ACCESSED_BY = 2,   /* the device maps the pages wherever they are (no fault on access) */
  SGM_ADVISE_UNSET_ACCESSED_BY = 3 /* undo SGM_ADVISE_ACCESSED_BY */
} sgm_managed_advice;

typedef enum sgm_copy_kind {
  SGM_COPY_HOST_TO_DEVICE = 0, /* dst device address, src host pointer */
  SGM_COPY_DEVICE_TO_HOST = 1, /* dst host pointer, src device address */
  SGM_COPY_DEVICE_TO_DEVICE = 2
} sgm_copy_kind;

typedef struct sgm_backend sgm_backend; /* one opened device, backend-private */
struct sgm_node;                        /* the node registry (lib/node.c) */

/* A caller's stream as the backend names it (see stream_ref in the contract). */
typedef struct sgm_stream_ref {
  uint64_t key;  /* equal for the same stream, different otherwise; 0 = the legacy stream */
  void *handle;  /* the handle to pass back to the backend (the caller's, as given) */
} sgm_stream_ref;

/* Counters every backend keeps, for tests and leak checks. */
typedef struct sgm_backend_counters {
  uint64_t n_calls;           /* fallible calls made (the fault knob counts these) */
  uint64_t device_live_bytes; /* device memory allocated and not freed */
  uint64_t host_live_bytes;   /* pinned host memory allocated and not freed */
  uint64_t n_device_live;     /* live device allocations */
  uint64_t n_host_live;       /* live pinned host allocations */
  uint64_t n_events_live;     /* events recorded and not yet destroyed */
  uint64_t n_managed_live;    /* live managed ranges */
  uint64_t managed_device_bytes; /* bytes of managed pages placed in device memory now (CUDA: by
                                    sgm's prefetches, at SGM_MANAGED_PAGE granularity) */
  uint64_t managed_host_bytes;   /* bytes of managed pages placed in host memory now (the same way) */
  uint64_t n_managed_moves;   /* prefetches that moved at least one page (emu; 0 on CUDA) */
  /* expandable VRAM (issue 17) */
  uint64_t vmm_mapped_bytes;  /* bytes mapped into reserved ranges (also in device_live_bytes) */
  uint64_t n_vmm_ranges;      /* reserved ranges not yet freed */
  /* driver calls (issue 16) */
  uint64_t n_driver_calls;    /* calls into the GPU driver since open (CUDA: every entry point
                                 but the error-string ones; 0 on the emulated device) */
  /* reserve mode on the virtual-memory API (issue 17) */
  uint64_t n_vmm_pool_granules; /* granules held in pools (vmm_pool_create, not yet freed) */
} sgm_backend_counters;

typedef struct sgm_backend_ops {
  const char *name; /* "cuda", "emu" */
  /* true when all device work is finished before a call returns (the emulated
   * device): a block freed on a stream is then reusable by anyone at once. */
  bool synchronous;
  /* true when host_alloc page-locks with mlock(2), which RLIMIT_MEMLOCK
   * (ulimit -l) bounds for a process without CAP_IPC_LOCK: the context then
   * keeps the shared budget within the limit (the emulated device). */
  bool pins_with_mlock;
  int (*open)(const sgm_config *cfg, sgm_backend **out);
  void (*close)(sgm_backend *be);
  /* Device memory as the driver reports it now. */
  int (*mem_info)(sgm_backend *be, uint64_t *free_bytes, uint64_t *total_bytes);
  int (*device_alloc)(sgm_backend *be, uint64_t bytes, sgm_devptr *out);
  void (*device_free)(sgm_backend *be, sgm_devptr ptr, uint64_t bytes);
  int (*host_alloc)(sgm_backend *be, uint64_t bytes, int numa_node, void **host_out,
                    sgm_devptr *dev_out);
  void (*host_free)(sgm_backend *be, void *host, uint64_t bytes);
  int (*copy)(sgm_backend *be, sgm_copy_kind kind, uint64_t dst, uint64_t src, uint64_t n,
              void *stream);
  void (*counters)(sgm_backend *be, sgm_backend_counters *out);
  /* Events on streams: see "Events" in the contract above. */
  int (*event_record)(sgm_backend *be, void *stream, void **event_out);
  int (*event_query)(sgm_backend *be, void *event);
  int (*event_wait)(sgm_backend *be, void *event);
  void (*event_destroy)(sgm_backend *be, void *event);
  /* Streams and pooled events: see "Streams and pooled events" above. */
  void (*stream_ref)(sgm_backend *be, void *stream, sgm_stream_ref *out);
  int (*event_create)(sgm_backend *be, void **event_out);
  int (*event_record_on)(sgm_backend *be, void *event, const sgm_stream_ref *stream);
  int (*stream_wait_event)(sgm_backend *be, const sgm_stream_ref *stream, void *event);
  /* Cross-stream transfer: see "Transfers" in the contract above. */
  int (*stream_transfer)(sgm_backend *be, void *event, const sgm_stream_ref *owner,
                         const sgm_stream_ref *taker);
  /* ---- The node registry (lib/node.c, lib/share.c) ---- */
  /* The device's key on this machine, the same in every process that opens
   * it ("GPU-<UUID>" on CUDA, "emu-<SGM_EMU_DEVICE>" on the emulated
   * device); "" when the device is private to this process (an unnamed
   * emulated device). NULL op = "". */
  void (*device_key)(sgm_backend *be, char *out, size_t len);
  /* The emulated device named by SGM_EMU_DEVICE: from now on its capacity
   * (the registry's device total) is shared with every process attached to
   * the same registry. Called once, right after open, before any allocation.
   * NULL op: the device's capacity is the driver's business. */
  void (*node_attach)(sgm_backend *be, struct sgm_node *node);
  /* Managed memory: see "Managed memory" in the contract above. */
  int (*managed_support)(sgm_backend *be);
  int (*managed_alloc)(sgm_backend *be, uint64_t bytes, sgm_devptr *out);
  void (*managed_free)(sgm_backend *be, sgm_devptr ptr, uint64_t bytes);
  int (*managed_advise)(sgm_backend *be, sgm_devptr ptr, uint64_t n, sgm_managed_advice advice);
  int (*managed_prefetch)(sgm_backend *be, sgm_devptr ptr, uint64_t n, sgm_tier to, void *stream);
  /* ---- expandable VRAM: see "Expandable VRAM" above (issue 17). NULL vmm_granularity = none. */
  int (*vmm_granularity)(sgm_backend *be, uint64_t *bytes_out);
  int (*vmm_reserve)(sgm_backend *be, uint64_t bytes, void **range_out, sgm_devptr *base_out);
  int (*vmm_map)(sgm_backend *be, void *range, uint64_t offset, uint64_t bytes);
  void (*vmm_unmap)(sgm_backend *be, void *range, uint64_t offset, uint64_t bytes);
  void (*vmm_free)(sgm_backend *be, void *range);
  int (*vmm_map_runs)(sgm_backend *be, void *range, const sgm_vmm_run *runs, size_t n,
                      size_t *n_done);
  void (*vmm_unmap_runs)(sgm_backend *be, void *range, const sgm_vmm_run *runs, size_t n);
  /* ---- the device's identity in the node registry (issue 13) ----
   * device_uuid: the device's 16-byte UUID, the one nvidia-smi -L prints as
   * GPU-<8-4-4-4-12 hex> (CUDA: cuDeviceGetUuid_v2, a MIG slice's own UUID;
   * the emulated device: a stable UUID derived from its name, the same in
   * every process). SGM_OK and out, or a status with the reason (out zeroed).
   * device_pci_bus_id: "0000:65:00.0" where the device has one, "" where it
   * has none (the emulated device). NULL op: unknown. */
  int (*device_uuid)(sgm_backend *be, uint8_t out[16]);
  void (*device_pci_bus_id)(sgm_backend *be, char *out, size_t len);
  /* ---- a transfer that leaves the owner a fence (issue 10): see "Transfers"
   * above. NULL op: stream_transfer, no fence. */
  int (*stream_transfer_fence)(sgm_backend *be, void *event, const sgm_stream_ref *owner,
                               const sgm_stream_ref *taker, bool *fenced);
  /* ---- reserve mode on the virtual-memory API: see "Reserve mode on the
   * virtual-memory API" above (issue 17). NULL vmm_pool_create = none. */
  int (*vmm_pool_create)(sgm_backend *be, uint64_t n_granules, void **pool_out);
  int (*vmm_pool_map)(sgm_backend *be, void *range, uint64_t offset, void *pool,
                      const uint32_t *idx, uint64_t n);
  void (*vmm_pool_unmap)(sgm_backend *be, void *range, uint64_t offset, uint64_t bytes);
  void (*vmm_pool_free)(sgm_backend *be, void *pool);
  /* ---- the managed move queue (issue 14, lib/placement/managed_queue.c) ----
   * copy_stream_wait_event: work queued from now on on the backend's own
   * copy stream (the NULL stream of copy() and managed_prefetch()) waits, on
   * the device, for the event's last recording; the host never waits (CUDA:
   * cuStreamWaitEvent on that stream). NULL op: sgm waits on the host
   * (event_wait) instead. */
  int (*copy_stream_wait_event)(sgm_backend *be, void *event);
} sgm_backend_ops;

/* o->stream_ref, the NULL stream answered here as the contract names it (the
 * legacy stream: key 0, handle NULL; every backend's own answer, which
 * tests/unit/test_cuda_backend.c and test_context.c hold): the public pair
 * on the NULL stream makes no indirect call for it (issue 26). */
static inline void sgm__stream_ref(const sgm_backend_ops *o, sgm_backend *be, void *stream,
                                   sgm_stream_ref *out) {
  if (!stream) {
    out->key = 0;
    out->handle = NULL;
    return;
  }
  o->stream_ref(be, stream, out);
}

/* backend.c: pick the ops for a kind; SGM_BACKEND_AUTO is resolved by open. */
extern const sgm_backend_ops sgm__backend_emu_ops;
extern const sgm_backend_ops sgm__backend_cuda_ops;

/*
 * Open the backend cfg asks for. *ops_out and *be_out are written (NULL on
 * failure). SGM_BACKEND_AUTO tries cuda, else emu with a notice at verbose >= 1.
 */
int sgm__backend_open(const sgm_config *cfg, const sgm_backend_ops **ops_out,
                      sgm_backend **be_out);

#endif /* SGM_BACKEND_H */
