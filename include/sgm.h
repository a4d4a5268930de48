/*
 * sgm.h — shared GPU memory for Linux: the whole user API.
 *
 * sgm hands out device memory from three tiers: dedicated VRAM, a pinned
 * host "shared GPU memory" pool, and disk spill. Everything a user needs is in
 * this header; it is C11 and C++17 clean.
 *
 * Conventions
 *  - Calls that can fail return sgm_status (0 = SGM_OK, negative = error). The
 *    calling thread's sgm_last_error() then holds a message that says what was
 *    wrong and what to do.
 *  - Out-parameters are always written, also on failure (NULL / 0).
 *  - Every call on a context is safe from any thread.
 *  - The library never prints to stdout, never calls abort() or exit() on a
 *    recoverable error; warnings go to stderr only when SGM_VERBOSE >= 1.
 *
 * Longer prose: docs/ (options.md lists every environment variable).
 */
#ifndef SGM_H
#define SGM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define SGM_API __attribute__((visibility("default")))
#else
#define SGM_API
#endif

#define SGM_VERSION_MAJOR 0
#define SGM_VERSION_MINOR 1
#define SGM_VERSION_PATCH 0

typedef struct sgm_context sgm_context;
typedef struct sgm_buffer sgm_buffer;

/* Where memory lives. SGM_TIER_NONE answers "not an sgm pointer". */
typedef enum sgm_tier {
  SGM_TIER_NONE = -1,
  SGM_TIER_VRAM = 0,   /* dedicated GPU memory */
  SGM_TIER_SHARED = 1, /* page-locked, device-mapped host RAM */
  SGM_TIER_DISK = 2,   /* spill file */
  SGM_TIER_COUNT = 3
} sgm_tier;

typedef enum sgm_status {
  SGM_OK = 0,
  SGM_ERR_INVALID = -1,     /* a bad argument or configuration value */
  SGM_ERR_NOMEM = -2,       /* a budget or the device is full */
  SGM_ERR_BACKEND = -3,     /* the driver (or emulated device) failed */
  SGM_ERR_IO = -4,          /* disk I/O failed; data stayed where it was */
  SGM_ERR_CORRUPT = -5,     /* a checksum did not match */
  SGM_ERR_BUSY = -6,        /* the object is in use */
  SGM_ERR_UNSUPPORTED = -7  /* not available on this backend or build */
} sgm_status;

typedef enum sgm_backend_kind {
  SGM_BACKEND_CUDA = 0, /* a real NVIDIA GPU through libcuda.so.1 (the default) */
  SGM_BACKEND_EMU = 1,  /* the emulated device: host memory stands in for VRAM */
  SGM_BACKEND_AUTO = 2  /* cuda when a device answers, else emu with a notice */
} sgm_backend_kind;

/* What sgm_alloc hands out (SGM_POINTERS; docs/managed.md). */
typedef enum sgm_pointer_mode {
  SGM_POINTERS_FIXED = 0,   /* a pointer is placed once and never moves (the default) */
  SGM_POINTERS_MANAGED = 1, /* blocks from 2 MiB up are CUDA Unified Memory that sgm moves between
                               VRAM and shared memory under the same address */
  SGM_POINTERS_AUTO = 2     /* managed where the device and driver support it, else fixed */
} sgm_pointer_mode;

/*
 * A size option: an absolute byte count, or a fraction of a reference (the
 * device's memory for VRAM sizes, physical RAM for host sizes, free disk space
 * for the spill limit). Both zero means "unset": the documented default.
 */
typedef struct sgm_size {
  uint64_t bytes;  /* absolute size in bytes; used when fraction == 0 */
  double fraction; /* 0 < fraction <= 1: share of the reference; 0 = use bytes */
} sgm_size;

#define SGM_PATH_MAX 4096
#define SGM_NAME_MAX 32
#define SGM_ERROR_MAX 512

/*
 * Configuration of one context. Fill with sgm_config_init(), then change
 * fields in code (code wins over the environment). Fields are only ever added
 * at the end.
 */
/* SGM_SHARE_MODE: how a process's budgets follow the others on its device. */
typedef enum sgm_share_mode {
  SGM_SHARE_FAIR = 0, /* reservation + a weighted share of the rest; idle shares lent */
  SGM_SHARE_SOLO = 1  /* budgets as if alone (sgm before the node registry) */
} sgm_share_mode;

typedef struct sgm_config {
  sgm_backend_kind backend;       /* SGM_BACKEND */
  int device;                     /* SGM_DEVICE: device ordinal */
  sgm_size vram_limit;            /* SGM_VRAM_LIMIT: cap on the VRAM budget; unset = none */
  double vram_fraction;           /* SGM_VRAM_FRACTION: budget share of device memory, (0, 1] */
  int allow_growth;               /* SGM_ALLOW_GROWTH: 1 = grow on demand, 0 = reserve at create */
  sgm_size shared_limit;          /* SGM_SHARED_LIMIT: unset = max(RAM/2, 64 MiB) */
  char spill_dir[SGM_PATH_MAX];   /* SGM_SPILL_DIR: "" = no disk tier */
  sgm_size spill_limit;           /* SGM_SPILL_LIMIT: unset = 50% of free space there */
  char policy[SGM_NAME_MAX];      /* SGM_POLICY: eviction policy of every tier (sgm/policy.h) */
  int verbose;                    /* SGM_VERBOSE: 0 silent, 1 warnings, 2 info, 3 debug */
  uint64_t emu_vram_bytes;        /* SGM_EMU_VRAM: size of the emulated device's memory */
  uint64_t growth_chunk_bytes;    /* SGM_GROWTH_CHUNK: first chunk taken in growth mode */
  uint64_t emu_fail_at;           /* SGM_EMU_FAIL_AT: testing: fail the Nth emulated call; 0 = never */
  int shared_fallback;            /* SGM_SHARED_FALLBACK: 1 = full VRAM spills to shared memory */
  uint64_t idle_trim_ms;          /* SGM_IDLE_TRIM_MS: free chunks idle this long go back; 0 = never */
  char policy_vram[SGM_NAME_MAX];   /* SGM_POLICY_VRAM: the VRAM tier's policy; "" = policy */
  char policy_shared[SGM_NAME_MAX]; /* SGM_POLICY_SHARED: the shared tier's policy; "" = policy */
  uint64_t shared_chunk_bytes;    /* SGM_SHARED_CHUNK: first pinned chunk of the shared tier */
  /* Node-wide sharing (docs/node.md): one registry per device, fair budgets. */
  int node;                       /* SGM_NODE: 1 = join the node registry, 0 = run untracked */
  char node_dir[SGM_PATH_MAX];    /* SGM_NODE_DIR: the registry's directory; "" = /dev/shm */
  int node_group;                 /* SGM_NODE_GROUP: 1 = share the registry with the group (0660) */
  int share_mode;                 /* SGM_SHARE_MODE: sgm_share_mode */
  int share_weight;               /* SGM_SHARE_WEIGHT: this process's weight in fair shares */
  sgm_size vram_reserve;          /* SGM_VRAM_RESERVE: VRAM guaranteed to this process; unset = 0 */
  uint64_t node_period_ms;        /* SGM_NODE_PERIOD_MS: publish and rebalance period */
  char emu_device[SGM_NAME_MAX];  /* SGM_EMU_DEVICE: name of an emulated device shared by processes */
  sgm_pointer_mode pointers;      /* SGM_POINTERS: fixed, managed or auto */
  int emu_managed;                /* SGM_EMU_MANAGED: the emulated device offers Unified Memory */
  int vram_vmm;                   /* SGM_VRAM_VMM: 1 = growth on one reserved range when the device can */
  /*
   * The first bad environment value sgm_config_init() met, as a message that
   * names the variable and the value; "" when all were good. A config whose
   * error is set is refused by sgm_context_create() with SGM_ERR_INVALID.
   */
  char error[SGM_ERROR_MAX];
} sgm_config;

/* A short constant name for a status ("SGM_ERR_NOMEM"); never NULL. */
SGM_API const char *sgm_status_string(sgm_status s);

/* The running library's version, "MAJOR.MINOR.PATCH" (static storage, never
 * NULL): the libsgm.so actually loaded, which may be newer than the
 * SGM_VERSION_* this program was compiled with. Thread-safe. */
SGM_API const char *sgm_version(void);

/*
 * The calling thread's last detailed error message; "" when none. Valid until
 * this thread's next sgm call. Never NULL.
 */
SGM_API const char *sgm_last_error(void);

/* A short constant name for a tier ("vram", "shared", "disk", "none"). */
SGM_API const char *sgm_tier_name(sgm_tier t);

/*
 * Fill cfg with the defaults, then with the SGM_* environment. A bad value is
 * recorded in cfg->error (and makes sgm_context_create fail); an unknown SGM_*
 * variable gets a warning on stderr naming the closest known one. cfg must not
 * be NULL. Thread-safe as long as no thread changes the environment meanwhile.
 */
SGM_API void sgm_config_init(sgm_config *cfg);

/*
 * Open a device and create a context on it. cfg NULL means sgm_config_init().
 * TF_FORCE_GPU_ALLOW_GROWTH="true"/"false" overrides cfg->allow_growth.
 * On failure *out is NULL and the status says why (SGM_ERR_INVALID for a bad
 * configuration, SGM_ERR_BACKEND when the device cannot be opened,
 * SGM_ERR_NOMEM when reserve mode cannot reserve the budget).
 */
SGM_API sgm_status sgm_context_create(const sgm_config *cfg, sgm_context **out);

/*
 * Destroy a context and return all its memory to the driver. Pointers it
 * handed out become invalid. NULL is a no-op. No other thread may be using
 * the context.
 *
 * fork(): a context belongs to the process that created it. In a child, every
 * call on an inherited context or its buffers fails with SGM_ERR_UNSUPPORTED
 * ("created by process P before fork()"); create a new context in the child.
 * The child's sgm_context_destroy (and sgm_buffer_destroy) of an inherited
 * one touches nothing of the parent's: it closes the child's descriptor of the
 * spill file and leaves the rest of the copy to the child's exit or exec.
 */
SGM_API void sgm_context_destroy(sgm_context *ctx);

/*
 * The configuration the context was created with, after defaults and
 * overrides. The record belongs to the context, never changes after create
 * (a later sgm_torch_set_memory_fraction changes the budget, not this
 * record: read the budget with sgm_get_stats), and may be read from any
 * thread until sgm_context_destroy. NULL when ctx is NULL.
 */
SGM_API const sgm_config *sgm_context_config(const sgm_context *ctx);

/* The backend the context runs on: "cuda" or "emu" (auto resolved). */
SGM_API const char *sgm_context_backend(const sgm_context *ctx);

/*
 * Allocate size bytes of device-accessible memory, aligned to 256 bytes (as
 * cudaMalloc). The pointer never moves. stream: the CUDA stream the memory will
 * be used on, or NULL. Returns NULL on failure (size 0, or the budgets are
 * full: SGM_ERR_NOMEM with the budgets in sgm_last_error()). Thread-safe.
 */
SGM_API void *sgm_alloc(sgm_context *ctx, size_t size, void *stream);

/*
 * Free a pointer from sgm_alloc, stream-ordered: work already queued on
 * `stream` (NULL = the legacy default stream) may still use the block, so it
 * is reused at once by later work on that stream and by other streams only
 * after a device-side wait on that work (docs/streams.md). NULL ptr is a
 * no-op. A pointer sgm did not hand out, or one freed twice, is detected:
 * nothing is freed, the thread's error is set (SGM_ERR_INVALID) and, with
 * SGM_VERBOSE >= 1, a warning is printed. Thread-safe.
 */
SGM_API void sgm_free(sgm_context *ctx, void *ptr, void *stream);

/* Like sgm_free, but returns the status instead of only setting the error. */
SGM_API sgm_status sgm_free_ex(sgm_context *ctx, void *ptr, void *stream);

/*
 * Declare that work queued on `stream` uses ptr (a live pointer from
 * sgm_alloc), as PyTorch's Tensor.record_stream: when ptr is freed, its memory
 * is reused only after the work queued on `stream` up to that free has
 * completed (an event recorded on it then). Recording the stream ptr was
 * allocated on, or one already recorded, changes nothing. SGM_ERR_INVALID when
 * ptr is not live in ctx; SGM_ERR_NOMEM out of host memory. Thread-safe.
 */
SGM_API sgm_status sgm_record_stream(sgm_context *ctx, void *ptr, void *stream);

/*
 * Capture pools (CUDA graphs; docs/frameworks.md). A captured graph replays
 * with the addresses it captured, so memory allocated for it must stay its
 * own until the framework says the graph is gone. pool_id: any non-zero value
 * the caller chooses; a pool exists from its first begin to its release.
 *  - begin: from now, sgm_alloc by the calling thread on `stream`
 *    (SGM_CAPTURE_ANY_STREAM: on any stream) allocates into the pool, which
 *    gains a reference. Several scopes (threads, streams, begins) may feed
 *    one pool; the latest begun scope of a thread wins. SGM_ERR_INVALID for
 *    pool_id 0.
 *  - A pool's block that is freed stays live in its tier, *parked*: it is
 *    never handed to another allocation, trimmed (sgm_trim, the idle trim,
 *    pressure) or unmapped; only a later allocation under the same pool on
 *    the stream it was freed on may take it again (at most 1/8 bigger). One
 *    that sgm_record_stream named is never taken again before the release.
 *  - end: every scope of the pool ends (any thread); the pool and its blocks
 *    stay. SGM_ERR_INVALID when it has no open scope.
 *  - release: drops a reference (each begin holds one, as PyTorch's graphs
 *    sharing a pool each release it). The last one ends the pool's scopes,
 *    frees its parked blocks as sgm_free on the stream they were freed on,
 *    and makes its live blocks ordinary allocations. SGM_ERR_INVALID when
 *    the pool does not exist. sgm_context_destroy releases every pool.
 * All thread-safe. Without pools sgm_alloc and sgm_free pay one load.
 */
#define SGM_CAPTURE_ANY_STREAM ((void *)~(uintptr_t)0)
SGM_API sgm_status sgm_capture_pool_begin(sgm_context *ctx, void *stream, uint64_t pool_id);
SGM_API sgm_status sgm_capture_pool_end(sgm_context *ctx, uint64_t pool_id);
SGM_API sgm_status sgm_capture_pool_release(sgm_context *ctx, uint64_t pool_id);

/* What capture pools hold (sgm_capture_pool_info); fields only grow at the end. */
typedef struct sgm_capture_pool_stats {
  uint64_t n_pools;      /* pools counted (1, or every pool for pool_id 0) */
  uint64_t live_bytes;   /* bytes of their blocks the framework holds */
  uint64_t parked_bytes; /* bytes of their freed blocks kept for them (used in the tier) */
  uint64_t n_live, n_parked; /* those blocks' counts */
} sgm_capture_pool_stats;
/* Fill *out for one pool, or for all pools with pool_id 0. *out is zeroed on
 * failure; SGM_ERR_INVALID for NULL arguments or a pool that does not exist.
 * Thread-safe. */
SGM_API sgm_status sgm_capture_pool_info(sgm_context *ctx, uint64_t pool_id, sgm_capture_pool_stats *out);

/* The tier of a live allocation, SGM_TIER_NONE for any other pointer. */
SGM_API sgm_tier sgm_pointer_tier(sgm_context *ctx, const void *ptr);

/* Counters of one tier. */
typedef struct sgm_tier_stats {
  uint64_t budget_bytes;    /* the most this tier may hold for this context */
  uint64_t committed_bytes; /* taken from the driver / OS now */
  uint64_t used_bytes;      /* handed out now (sizes as rounded to the alignment) */
  uint64_t peak_used_bytes; /* the highest used_bytes seen */
  uint64_t n_live;          /* allocations and buffers living in this tier now */
  uint64_t bytes_in;        /* moved into this tier by migration */
  uint64_t bytes_out;       /* moved out of this tier by migration */
  uint64_t n_evictions;     /* buffers moved out of this tier to make room */
  uint64_t n_chunks;        /* chunks committed from the driver / OS now */
  uint64_t n_allocs;        /* allocations served since create */
  uint64_t n_frees;         /* frees served since create */
  uint64_t n_failed;        /* allocations this tier could not serve */
  uint64_t cached_bytes;    /* freed by the user, kept for reuse on the stream it was freed on
                               (in committed, not in used; sgm_trim returns them) */
} sgm_tier_stats;

/* Counters of one context; fields are only ever added at the end. */
typedef struct sgm_stats {
  sgm_tier_stats tier[SGM_TIER_COUNT];
  uint64_t n_fallbacks;      /* allocations that wanted VRAM and got shared memory */
  uint64_t fallback_bytes;   /* bytes of those allocations */
  uint64_t device_total_bytes; /* memory of the device as the backend reports it */
  uint64_t physical_ram_bytes; /* min(machine RAM, cgroup limit) */
  uint64_t n_bad_frees;      /* frees of foreign pointers or double frees refused */
  uint64_t n_managed_promotions;   /* managed blocks moved from shared memory into VRAM */
  uint64_t n_managed_demotions;    /* managed blocks moved from VRAM into shared memory */
  uint64_t managed_promoted_bytes; /* bytes of those promotions */
  uint64_t managed_demoted_bytes;  /* bytes of those demotions */
  uint64_t n_managed_live;         /* live managed (movable) blocks, wherever placed */
  uint64_t vram_granule_bytes;  /* VRAM grows on one reserved range in granules of this size
                                   (the driver's virtual-memory API); 0 = chunks or reserved */
  uint64_t vram_reserved_bytes; /* that range's size (address space, not memory); 0 = none */
  uint64_t driver_calls;       /* calls this context's backend made into the GPU driver since
                                  create (docs/stats.md); 0 on the emulated device */
  /* managed mode: the cache of freed movable ranges (docs/managed.md) */
  uint64_t n_managed_cache_hits;   /* movable allocations served by a cached range (no driver call) */
  uint64_t managed_cached_bytes;   /* bytes of freed movable ranges kept for reuse (also in the
                                      tiers' cached_bytes and committed_bytes, not in used_bytes) */
  uint64_t managed_slack_bytes;    /* live movable blocks' bytes beyond their requests rounded to
                                      64 KiB pages (a cached range reused for up to 1/8 less) */
  /* managed mode: moves handed to the copy-stream worker (docs/managed.md) */
  uint64_t n_managed_moves_queued;    /* moves queued: promotions past a free's or a cold hint's
                                         inline bound, cold-hint demotions of blocks above it */
  uint64_t n_managed_moves_done;      /* of those, run (by the worker, or by sgm_trim) */
  uint64_t n_managed_moves_cancelled; /* of those, dropped: the block freed or moved first by another
                                         call, the move failed, or the context destroyed */
  uint64_t managed_queued_bytes;      /* bytes of the moves waiting now (their target tier's budget
                                         is charged already) */
  uint64_t managed_inline_moved_bytes; /* managed bytes moved on the threads calling sgm (alloc, free,
                                          hints, sgm_prefetch, sgm_trim, the idle tick) */
  uint64_t managed_worker_moved_bytes; /* managed bytes moved by the worker on the copy stream */
  uint64_t vram_map_calls;      /* backend calls that mapped or unmapped VRAM granules on the reserved
                                   range since create (on CUDA each is a mapping's cuMemCreate+
                                   cuMemMap+cuMemRelease, with cuMemSetAccess once for neighbouring
                                   mappings, or the cuMemUnmap of whole mappings); 0 without one */
} sgm_stats;

/* Fill *out with the context's counters. Fast, any thread. On failure *out is zeroed. */
SGM_API sgm_status sgm_get_stats(sgm_context *ctx, sgm_stats *out);

/*
 * The context's state as one JSON object (shape: docs/stats.md). *out is a
 * NUL-terminated string the caller owns, to free with sgm_string_free; NULL
 * on failure: SGM_ERR_INVALID (ctx or out NULL), SGM_ERR_UNSUPPORTED (a
 * context inherited through fork()), SGM_ERR_NOMEM. Slow (walks every chunk);
 * any thread.
 */
SGM_API sgm_status sgm_stats_json(sgm_context *ctx, char **out);
/* Free a string sgm handed out (sgm_stats_json). NULL is a no-op. */
SGM_API void sgm_string_free(char *s);

/*
 * Return committed memory that is not in use to the driver / OS: blocks cached
 * for reuse by the streams they were freed on (after waiting, on the host, for
 * the work those streams had queued at their frees, as torch.cuda.empty_cache
 * does), then whole free chunks, and the blocks the spill file kept for freed
 * extents. In reserve mode (growth off) the reservation is kept. Thread-safe.
 */
SGM_API sgm_status sgm_trim(sgm_context *ctx);

/* ---- Movable buffers: data that may live in VRAM, shared memory or on disk
 * while released, and is made resident by acquire. One buffer is used by one
 * thread at a time; different buffers of a context from any threads. ---- */

/* Residency priorities (as D3D12's): a lower priority leaves VRAM first. */
typedef enum sgm_priority {
  SGM_PRIORITY_MINIMUM = 0,
  SGM_PRIORITY_LOW = 1,
  SGM_PRIORITY_NORMAL = 2, /* the default */
  SGM_PRIORITY_HIGH = 3,
  SGM_PRIORITY_MAXIMUM = 4
} sgm_priority;

/*
 * Create a released buffer of size bytes (contents undefined until written),
 * placed by the placement rules: VRAM if it fits (evicting released buffers),
 * else shared memory, else the disk tier. The caller owns the buffer until
 * sgm_buffer_destroy (or sgm_context_destroy, which frees what is left).
 * *out NULL on failure: SGM_ERR_INVALID (ctx or out NULL, size 0),
 * SGM_ERR_NOMEM (nothing fits: the message names each tier's budget), or a
 * backend/disk status from an eviction. Thread-safe.
 */
SGM_API sgm_status sgm_buffer_create(sgm_context *ctx, size_t size, sgm_buffer **out);

/*
 * Make the buffer resident (VRAM if it fits after evicting released buffers,
 * else shared memory; read back from disk with its checksum verified) and lock
 * it there until sgm_buffer_release. *device_ptr: its device address, NULL on
 * failure. Waits for a prefetch in flight. SGM_ERR_BUSY if already acquired.
 * stream: where the caller will use it (NULL = the default stream): the data
 * is ready for work queued there after the call, and follows the GPU work
 * queued before the last release (copies run after it on the device).
 */
SGM_API sgm_status sgm_buffer_acquire(sgm_buffer *b, void *stream, void **device_ptr);

/*
 * Unlock an acquired buffer. stream: where GPU work using it was queued (NULL =
 * the default stream); the buffer does not move before that work completes.
 * Fails with SGM_ERR_INVALID when b is NULL or not acquired (nothing
 * changes), or with the backend's status when the event cannot be recorded
 * on stream: the buffer then stays acquired (nothing may move it) and the
 * call may be retried. Call it from the thread that uses the buffer.
 */
SGM_API sgm_status sgm_buffer_release(sgm_buffer *b, void *stream);

/* Copy n bytes from host memory into the buffer at offset / out of it, wherever
 * it lives (a disk-resident buffer is read back and verified). Bounds checked.
 * The copy follows the GPU work queued before the last release: the call
 * returns once that work and the copy are done.
 * A failed write leaves every byte outside [offset, offset + n) as it was; the
 * bytes inside hold old or new data (a device copy may have run before its
 * completion failed), except on a disk-resident buffer, which keeps all its old
 * contents. A write covering the whole buffer succeeds even when its contents
 * were lost (SGM_ERR_CORRUPT): it replaces them. Failures: SGM_ERR_INVALID
 * (b or the host pointer NULL with n > 0, a range past the buffer, a
 * destroyed buffer in debug builds), SGM_ERR_UNSUPPORTED (a context
 * inherited through fork()), SGM_ERR_NOMEM (no host memory to stage a
 * disk-resident buffer), SGM_ERR_CORRUPT (a read of a chunk whose checksum
 * does not match), or the backend's or the disk's status. n == 0 does
 * nothing. Thread-safe; a buffer is used by one thread at a time, and the
 * call waits while sgm moves the buffer (a prefetch, an eviction). */
SGM_API sgm_status sgm_buffer_write(sgm_buffer *b, size_t offset, const void *src, size_t n);
SGM_API sgm_status sgm_buffer_read(sgm_buffer *b, size_t offset, void *dst, size_t n);

/*
 * Move a released buffer down to tier `to` (SGM_TIER_SHARED or SGM_TIER_DISK),
 * cascading as needed. SGM_ERR_BUSY if acquired; on failure it stays where it was.
 * GPU work queued before the last release may still run: the move follows it.
 */
SGM_API sgm_status sgm_buffer_evict(sgm_buffer *b, sgm_tier to);

/* Start making the buffer resident in VRAM on a worker thread (D3D12's
 * EnqueueMakeResident); returns at once (a failure of the move itself is only
 * logged). No-op for a buffer that is acquired, in VRAM or already queued.
 * SGM_ERR_INVALID for NULL; SGM_ERR_NOMEM if the worker cannot start. stream
 * is unused for now. */
SGM_API sgm_status sgm_buffer_prefetch(sgm_buffer *b, void *stream);

/* Set the buffer's residency priority (default SGM_PRIORITY_NORMAL): at once
 * for a released resident buffer, at its release for an acquired one.
 * SGM_ERR_INVALID for NULL, a destroyed buffer (debug builds) or a value
 * outside SGM_PRIORITY_MINIMUM..MAXIMUM (nothing changes). Thread-safe: may
 * be called while another thread uses the buffer; waits while sgm moves it. */
SGM_API sgm_status sgm_buffer_set_priority(sgm_buffer *b, sgm_priority priority);
/* ---- Residency hints (docs/policies.md "Residency hints"). Advisory: the
 * eviction policies that read them (lru, s3fifo, lirs, arc, and plug-ins of
 * policy ABI 4 with on_hint) keep what will be used and give up what is done
 * first; others ignore them. Each hint lasts until the buffer's next use
 * (acquire, host read or write) or the next hint of the same kind replaces it.
 * Thread-safe; O(1) per buffer; never moves data. */

/* sgm_will_use: no longer expected (cancels a will-use hint). */
#define SGM_WILL_USE_CANCEL UINT32_MAX
/* The n buffers of bufs (a residency set, D3D12's EnqueueMakeResident but
 * advisory) will be used after about `distance` more steps (requests, batches:
 * the application's unit; 0 = next): the policies keep them resident, and give
 * up the furthest first when they must. A buffer's newest call replaces its
 * earlier one (a nearer or further distance); distance SGM_WILL_USE_CANCEL
 * cancels it. SGM_ERR_INVALID (nothing changed) when ctx is NULL, bufs is NULL
 * with n > 0, or a buffer is NULL, destroyed (debug builds) or of another
 * context. */
SGM_API sgm_status sgm_will_use(sgm_context *ctx, sgm_buffer *const *bufs, size_t n, uint32_t distance);
/* The application will not read b again soon (a finished request's last
 * block, a discarded speculative branch): among its priority level, it leaves
 * its tier first. Cancelled by a will-use hint. SGM_ERR_INVALID for NULL or a
 * destroyed buffer (debug builds). */
SGM_API sgm_status sgm_buffer_done(sgm_buffer *b);
/* b extends parent (a KV-cache block and the prefix block before it; a radix
 * tree's child and its parent): a policy that reads structure keeps prefixes
 * and gives up leaves first (lru, once it sees a parent, also keeps blocks
 * used again ahead of blocks used once: docs/policies.md "Residency hints").
 * parent NULL removes the link. The link ends when
 * either buffer is destroyed. SGM_ERR_INVALID for b NULL, parent == b, a
 * parent of another context or one that descends from b (a cycle), or a
 * destroyed buffer (debug builds). */
SGM_API sgm_status sgm_buffer_set_parent(sgm_buffer *b, sgm_buffer *parent);
/* The tier holding the buffer's data now (a buffer being moved reports
 * either end); SGM_TIER_NONE for NULL. Any thread. */
SGM_API sgm_tier sgm_buffer_tier(const sgm_buffer *b);
/* The size the buffer was created with; 0 for NULL. Any thread. */
SGM_API size_t sgm_buffer_size(const sgm_buffer *b);
/* Free the buffer wherever it lives (waits for a prefetch in flight). NULL is a no-op.
 * A handle already destroyed is recognised while it is among the context's last
 * 16 destroyed buffers, in every build: nothing is freed and sgm_last_error says
 * so (other calls on it return SGM_ERR_INVALID). Older dead handles cannot be. */
SGM_API void sgm_buffer_destroy(sgm_buffer *b);

/* ---- Managed pointers (SGM_POINTERS=managed; docs/managed.md). Blocks from
 * sgm_alloc of SGM_MANAGED_MOVABLE_BYTES and more are CUDA Unified Memory:
 * the pointer stays, its pages move between VRAM and shared memory as sgm's
 * residency policy decides. Smaller blocks are placed once, as in fixed mode.
 * All calls are thread-safe. ---- */

/* Blocks of this size and up are movable in managed mode (2 MiB: the large
 * page the GPU maps; smaller blocks would share pages with their neighbours). */
#define SGM_MANAGED_MOVABLE_BYTES ((size_t)2 << 20)

/* What a caller says about a managed block (sgm_advise). */
typedef enum sgm_hint {
  SGM_HINT_NONE = 0, /* only the priority changes */
  SGM_HINT_HOT = 1,  /* about to be used: counted as a use, and brought into VRAM now if it
                        fits there after demoting colder blocks of lower or equal priority */
  SGM_HINT_COLD = 2  /* not needed for a while: moved to shared memory now */
} sgm_hint;

/*
 * Set the residency priority of the managed block at ptr (the start of a live
 * block from sgm_alloc), and apply a hint. A lower priority leaves VRAM first;
 * after VRAM room appears, shared-placed blocks come back highest priority
 * first. SGM_ERR_INVALID when ptr is not a live managed block (a fixed
 * pointer, or a context in fixed mode) or priority is out of range; the
 * status of a failed move for a hint (the block stays where it was).
 */
SGM_API sgm_status sgm_advise(sgm_context *ctx, void *ptr, sgm_priority priority, sgm_hint hint);

/*
 * Move the managed block holding [ptr, ptr + size) to tier (SGM_TIER_VRAM or
 * SGM_TIER_SHARED), in order on `stream` after the work queued there (as
 * D3D12's EnqueueMakeResident). Pages move whole, so the whole block moves.
 * To VRAM, colder blocks are demoted to make room as far as the policy
 * allows; SGM_ERR_NOMEM (the block stays) when it cannot fit.
 * SGM_ERR_INVALID when the range is not inside one live managed block.
 * Thread-safe; waits while another thread moves the same block.
 */
SGM_API sgm_status sgm_prefetch(sgm_context *ctx, void *ptr, size_t size, sgm_tier tier, void *stream);

/*
 * Fallback notification: called (on the allocating thread, without sgm locks
 * held) for every allocation that wanted VRAM and landed in shared memory.
 * It must not call back into the same context. NULL unregisters.
 * SGM_ERR_INVALID (ctx NULL) or SGM_ERR_UNSUPPORTED (a context inherited
 * through fork()); nothing changes then. Thread-safe: an allocation racing
 * with the change calls the old or the new callback.
 */
typedef void (*sgm_fallback_fn)(void *user, void *ptr, size_t size);
SGM_API sgm_status sgm_set_fallback_callback(sgm_context *ctx, sgm_fallback_fn fn, void *user);

/* ---- Interposition: what libsgm-preload.so (docs/preload.md) uses to run
 * unmodified CUDA programs on a context; any layer that keeps VRAM itself
 * (the program's own driver allocations) may use it. ---- */

/*
 * Allocate size bytes of shared GPU memory (pinned, device-mapped host RAM)
 * straight away, without trying VRAM: Windows' sysmem fallback served on
 * demand. Aligned to 256 bytes; freed with sgm_free (stream-ordered as
 * there); counted as a fallback (sgm_stats n_fallbacks, fallback_bytes; the
 * fallback callback runs). stream as sgm_alloc. NULL on failure: size 0,
 * SGM_ERR_NOMEM when the shared budget is full (the message names it), a
 * backend status. Thread-safe.
 */
SGM_API void *sgm_alloc_shared(sgm_context *ctx, size_t size, void *stream);

/*
 * Account device memory the program holds outside sgm (its own driver
 * allocations, seen by an interposer): delta_bytes is added to (or, when
 * negative, taken from) the VRAM this process publishes in the node registry
 * (used and committed; fair shares count it as demand), and the process is
 * marked "interposed" there (sgm-smi shows it so). Taking back more than is
 * accounted is SGM_ERR_INVALID and changes nothing. Lock-free; thread-safe.
 */
SGM_API sgm_status sgm_interpose_vram(sgm_context *ctx, int64_t delta_bytes);

/* ---- Framework hooks: one lazily created context per device, configured
 * from the environment; thread-safe first use. ---- */

/*
 * PyTorch CUDAPluggableAllocator entry points:
 *   torch.cuda.memory.CUDAPluggableAllocator("libsgm.so", "sgm_torch_malloc", "sgm_torch_free")
 * PyTorch does not check for NULL: on failure sgm_torch_malloc always logs one
 * line to stderr saying why, then returns NULL.
 */
SGM_API void *sgm_torch_malloc(size_t size, int device, void *stream);
SGM_API void sgm_torch_free(void *ptr, size_t size, int device, void *stream);
/* Optional hooks: empty_cache trims every hook context; set_memory_fraction
 * sets the VRAM budget of a device's context to fraction × device memory. */
SGM_API void sgm_torch_empty_cache(void);
SGM_API void sgm_torch_set_memory_fraction(double fraction, int device);
/* Tensor.record_stream for the C++ CUDAPluggableAllocator's set_record_stream_fn
 * (the Python wrapper cannot install it): sgm_record_stream on the hook
 * context holding ptr; a pointer no hook context holds is reported on stderr. */
SGM_API void sgm_torch_record_stream(void *ptr, void *stream);
/*
 * The other CUDAPluggableAllocator hooks, with the C types of PyTorch's
 * function pointers (docs/frameworks.md: which PyTorch has which setter).
 * sgm.torch.use() installs them; C++ users pass them to the set_*_fn setters.
 *   set_init_fn                 sgm_torch_init(device_count): checks the count
 *   set_reset_fn                sgm_torch_empty_cache (above)
 *   set_memory_fraction_fn      sgm_torch_set_memory_fraction (above)
 *   set_base_alloc_fn           sgm_torch_base_alloc: the driver allocation
 *                               holding ptr (a chunk-mode VRAM chunk, *size
 *                               set), else ptr itself with *size unchanged
 *   set_record_stream_fn        sgm_torch_record_stream (above)
 *   set_begin_allocate_to_pool  (2.3+) capture pool begin for the calling
 *                               thread, any stream (the filter is not called)
 *   set_end_allocate_to_pool_fn (2.3+) capture pool end
 *   set_release_pool            capture pool release
 *   set_begin_allocate_stream_to_pool / set_end_allocate_stream_to_pool_fn
 *                               (2.1-2.2) the same, scoped to one stream
 * PyTorch's MempoolId_t {a, b} is sgm pool a when a != 0, else b | 1 << 63.
 * Failures are logged to stderr (PyTorch's hooks return nothing).
 */
typedef struct sgm_torch_pool_id {
  unsigned long long first, second; /* c10::cuda::MempoolId_t, by value */
} sgm_torch_pool_id;
SGM_API void sgm_torch_init(int device_count);
SGM_API void *sgm_torch_base_alloc(void *ptr, size_t *size);
SGM_API void sgm_torch_begin_allocate_to_pool(int device, sgm_torch_pool_id pool, const void *filter);
SGM_API void sgm_torch_end_allocate_to_pool(int device, sgm_torch_pool_id pool);
SGM_API void sgm_torch_release_pool(int device, sgm_torch_pool_id pool);
SGM_API void sgm_torch_begin_allocate_stream_to_pool(int device, void *stream, sgm_torch_pool_id pool);
SGM_API void sgm_torch_end_allocate_stream_to_pool(int device, void *stream);
/* The hook context of a device (created on first use); NULL with the error set on failure. */
SGM_API sgm_context *sgm_hook_context(int device);

/* ---- Option names (for bindings that map their own option names onto the
 * SGM_* variables, as the Python package does). ---- */

/*
 * The i-th SGM_* environment variable sgm_config_init() reads ("SGM_BACKEND",
 * "SGM_VRAM_LIMIT", ...; docs/options.md lists them in this order), or NULL
 * when i is past the last one. Constant strings; any thread.
 */
SGM_API const char *sgm_option_name(size_t i);

#ifdef __cplusplus
}
#endif

#endif /* SGM_H */
