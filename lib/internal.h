/*
 * internal.h — every cross-file function of libsgm, grouped by the file that
 * defines it. Names: sgm__<module>_<verb>. Nothing here is exported.
 */
#ifndef SGM_INTERNAL_H
#define SGM_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "sgm.h"
#include "tool_support.h" /* the internals tools may use, declared once */

/* ------------------------------------------------------------------------ */
/* Assertions: levels switched by SGM_DEBUG (0 off, 1 contracts, 2 internal,
 * 3 expensive). Always compiled, so they never rot; the failure path neither
 * allocates nor locks. */
#ifndef SGM_DEBUG
#define SGM_DEBUG 0
#endif

#define sgm_assert(c) \
  ((SGM_DEBUG >= 1 && !(c)) ? sgm__assert_fail(#c, __FILE__, __LINE__) : (void)0)
#define sgm_assert_internal(c) \
  ((SGM_DEBUG >= 2 && !(c)) ? sgm__assert_fail(#c, __FILE__, __LINE__) : (void)0)
#define sgm_assert_expensive(c) \
  ((SGM_DEBUG >= 3 && !(c)) ? sgm__assert_fail(#c, __FILE__, __LINE__) : (void)0)
/* True when expensive checks are compiled in: guard whole-structure walks. */
#define SGM_EXPENSIVE_CHECKS (SGM_DEBUG >= 3)

#if defined(__GNUC__)
#define SGM_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define SGM_NORETURN __attribute__((noreturn))
#define sgm_likely(x) __builtin_expect(!!(x), 1)
#define sgm_unlikely(x) __builtin_expect(!!(x), 0)
#else
#define SGM_PRINTF(f, a)
#define SGM_NORETURN
#define sgm_likely(x) (x)
#define sgm_unlikely(x) (x)
#endif

#define SGM_KiB (UINT64_C(1) << 10)
#define SGM_MiB (UINT64_C(1) << 20)
#define SGM_GiB (UINT64_C(1) << 30)

static inline uint64_t sgm__align_up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }
static inline bool sgm__is_pow2(uint64_t x) { return x && !(x & (x - 1)); }

/* ------------------------------------------------------------------------ */
/* error.c */

/* A broken contract (sgm_assert*): write "sgm: assertion failed: <cond>
 * (<file>:<line>)" to stderr and abort(). Allocates and locks nothing, so it
 * is safe under any lock and from any thread. Never returns. */
SGM_NORETURN void sgm__assert_fail(const char *cond, const char *file, int line);
/* Set this thread's error message (thread-local: sgm_last_error; no lock);
 * returns status so callers can `return sgm__error_set(...)`. The message is
 * cut to 1023 bytes; fmt's arguments may point into the current message.
 * Cannot fail. */
int sgm__error_set(int status, const char *fmt, ...) SGM_PRINTF(2, 3);
/* Empty this thread's message. */
void sgm__error_clear(void);
/* Write one line "sgm: <level>: <msg>" to stderr when verbose >= level. */
void sgm__log(int verbose, int level, const char *fmt, ...) SGM_PRINTF(3, 4);
/* sgm__fmt_bytes (bytes for people): tool_support.h. */

/* ------------------------------------------------------------------------ */
/* Locks with a fixed order, checked when SGM_DEBUG >= 2: a thread may only take
 * a lock of a higher rank than every lock it holds. */
typedef enum sgm_lock_rank {
  SGM_LOCK_HOOKS = 0,   /* hooks.c: creation of the per-device contexts (outermost) */
  SGM_LOCK_CONTEXT = 1, /* context-wide state (callback, clock) */
  SGM_LOCK_BUFFERS = 2, /* placement.c: the buffer list, the graveyard */
  SGM_LOCK_MANAGED = 3, /* managed.c: the managed blocks' map, counters and cache of freed ranges */
  SGM_LOCK_PREFETCH = 4, /* prefetch.c: the prefetch queue */
  SGM_LOCK_RES_VRAM = 5, /* residency.c: the VRAM policy and its items (residency.c's top comment) */
  SGM_LOCK_RES_SHARED = 6, /* residency.c: the shared-memory policy and its items */
  SGM_LOCK_TIER_MAGS = 7, /* tiers/pool/mag.c: the registry of every thread's magazines (before a pool) */
  SGM_LOCK_TIER_VRAM = 8, /* tiers/pool: a pool (VRAM, shared; the disk tier's own lock) */
  SGM_LOCK_TIER_SHARED = 9,
  SGM_LOCK_TIER_DISK = 10,
  SGM_LOCK_BACKEND = 11,  /* inside a backend only */
  SGM_LOCK_IDLE = 12,     /* context.c: the idle thread's stop flag (a leaf) */
  SGM_LOCK_REGISTRY = 13, /* policy.c: the policy registry (a leaf) */
  SGM_LOCK_NODE_OPEN = 14, /* node.c: this process's list of joined node segments */
  SGM_LOCK_NODE_TABLE = 15, /* unused since layout 3 (no lock is shared between processes) */
  SGM_LOCK_NODE = 16,     /* node.c: the writer side of this process's registry slot (a leaf) */
  SGM_LOCK_SHARE = 17,    /* share.c: the node ticker's stop flag and tick counters (a leaf) */
  SGM_LOCK_CAPTURE = 18   /* capture.c: capture pools' scopes, pools and members (a leaf) */
} sgm_lock_rank;

typedef struct sgm_lock {
  pthread_mutex_t mu; /* the lock itself */
  int rank;           /* sgm_lock_rank: position in the lock order */
  uint64_t n_takes;   /* sgm__lock_take calls so far (atomic; tests count hot-path locking) */
} sgm_lock;

/* A statically initialised lock of that rank (process-wide locks). */
#define SGM_LOCK_INITIALIZER(rank) {PTHREAD_MUTEX_INITIALIZER, (rank), 0}

/* Init a lock of that rank (sgm_lock_rank) / destroy it (not held). Take
 * blocks until l is free; debug builds abort when the thread holds a lock of
 * the same or a higher rank (the order) or more than eight locks. Drop: l
 * must be held by this thread. None fails. */
void sgm__lock_init(sgm_lock *l, int rank);
void sgm__lock_destroy(sgm_lock *l);
void sgm__lock_take(sgm_lock *l);
void sgm__lock_drop(sgm_lock *l);
/* A lock that is no sgm_lock but is witnessed all the same (such as a
 * process-shared robust mutex, taken with a timeout and able to report a
 * dead holder; node.c's layout-2 registry had one, layout 3 shares no lock
 * between processes and no caller remains), so not through sgm__lock_take. Call _enter(rank)
 * before taking it (debug builds: the order is checked, as for
 * sgm__lock_take), _note(id, rank) once it is held, and _leave(id) before
 * giving it back; a failed take calls neither _note nor _leave. No-ops when
 * SGM_DEBUG < 2. id: the lock's address. */
void sgm__lock_witness_enter(int rank);
void sgm__lock_witness_note(const void *id, int rank);
void sgm__lock_witness_leave(const void *id);
/* How often l was taken with sgm__lock_take (not counting condition waits). */
uint64_t sgm__lock_takes(const sgm_lock *l);
/* True when this thread holds l (tracked only when SGM_DEBUG >= 2; else true). */
bool sgm__lock_held(const sgm_lock *l);
/* Debug builds (SGM_DEBUG >= 2): abort unless this thread holds no sgm lock
 * (but the outermost hooks lock, held while a context is brought up). Called
 * at the top of every backend operation of cuda.c and emu.c: no sgm lock is
 * held across a driver call (STYLE.md, Threads). The two exceptions,
 * event_query and event_destroy, do not block and are called under a
 * residency lock while choosing victims. */
void sgm__lock_assert_none_held(void);
/* Sleep while *word == expected (returns at once if it differs; may return
 * spuriously: callers loop). Wake every thread sleeping on word. Private to
 * the process (Linux futexes). */
void sgm__word_wait(uint32_t *word, uint32_t expected);
void sgm__word_wake_all(uint32_t *word);
/* Asymmetric fences: a frequent side that orders its store before its later
 * load with a compiler barrier only, and a rare side that pays for both
 * (sgm__fence_heavy: membarrier(2), which runs a full barrier on every thread
 * of the process now running). A Dekker pair (each side stores its flag,
 * then loads the other's) is then correct with no atomic read-modify-write
 * on the frequent side (the magazines' owners, lib/tiers/pool). Set up once
 * (sgm__fence_setup, idempotent) before any frequent side runs; where the
 * kernel refuses, sgm__fence_asym stays false and the frequent side must
 * order itself (a sequentially consistent exchange). Read-only once set. */
extern bool sgm__fence_asym;
void sgm__fence_setup(void);
void sgm__fence_heavy(void);

/* ------------------------------------------------------------------------ */
/* options.c — THE option table (see the file for every row). */

typedef enum sgm_option_kind {
  SGM_OPT_SIZE,     /* sgm_size: bytes with K/M/G/T[iB] or a percentage */
  SGM_OPT_BYTES,    /* uint64_t: bytes with K/M/G/T[iB], no percentage */
  SGM_OPT_FRACTION, /* double in (0, 1] */
  SGM_OPT_BOOL,     /* int 0/1 from 1/0/true/false/yes/no/on/off */
  SGM_OPT_INT,      /* int within [min, max] */
  SGM_OPT_U64,      /* uint64_t within [min, max] */
  SGM_OPT_ENUM,     /* int index into names */
  SGM_OPT_STRING    /* char[] of the field's size */
} sgm_option_kind;

typedef struct sgm_option {
  const char *env;           /* the environment variable, e.g. "SGM_VRAM_LIMIT" */
  size_t offset;             /* offsetof(sgm_config, field) */
  size_t field_size;         /* sizeof the field (bounds string copies) */
  sgm_option_kind kind;      /* how the value is parsed */
  const char *default_value; /* the default, parsed by the same parser as the environment */
  double min, max;           /* bounds for INT / U64 / FRACTION / BYTES (max 0 = none) */
  const char *const *names;  /* NULL-terminated: ENUM value names; STRING the only values
                                allowed (NULL = any); SIZE keywords meaning "unset" */
  const char *help;          /* one line for docs/options.md */
  const char *field;         /* the sgm_config field's name, for sgm__options_validate */
  uint64_t granule_bytes;    /* BYTES: the value must be a multiple of this; 0 = any */
} sgm_option;

/* THE option table: a static array (never freed, never written; any thread)
 * of *n_out rows, one per SGM_* variable. */
const sgm_option *sgm__options_table(size_t *n_out);
/* Parse value for opt into cfg; on failure fill err (naming variable and value) and return SGM_ERR_INVALID. */
int sgm__options_parse(const sgm_option *opt, const char *value, sgm_config *cfg, char *err,
                       size_t err_len);
/* Parse a size ("512MiB", "4G", "2.5GiB", "25%", "1048576"); percent only when allowed. */
int sgm__options_parse_size(const char *s, bool allow_percent, sgm_size *out);
/* Check values a program may have set in code; error names the field. */
int sgm__options_validate(const sgm_config *cfg);
/* Apply TF_FORCE_GPU_ALLOW_GROWTH ("true"/"false" only) to *allow_growth; other values warn. */
void sgm__options_tf_growth(int verbose, int *allow_growth);
/* CUDA_DEVICE_MEMORY_LIMIT_<device>, else CUDA_DEVICE_MEMORY_LIMIT: *out = cap in bytes, 0 if unset. */
int sgm__options_cuda_memory_limit(int device, uint64_t *out);
/* The same, and name = the variable that set it ("" if none): messages about
 * the cap name the one the scheduler wrote (issue 29). name_len >= SGM_CUDA_LIMIT_NAME_MAX. */
#define SGM_CUDA_LIMIT_NAME_MAX 48
int sgm__options_cuda_memory_limit_ex(int device, uint64_t *out, char *name, size_t name_len);
/* Resolve a size against its reference (device memory, RAM, free disk); unset gives dflt. */
uint64_t sgm__size_resolve(sgm_size s, uint64_t reference, uint64_t dflt);

/* ------------------------------------------------------------------------ */
/* prim/str.c — string helpers below options and policy. */

/* ASCII case-insensitive string equality (option values, policy names). Any thread. */
bool sgm__str_ieq(const char *a, const char *b);

/* ------------------------------------------------------------------------ */
/* prim/clock.c — the one monotonic clock. */

/* sgm__clock_monotonic_ns (CLOCK_MONOTONIC in ns): tool_support.h. */
/* Initialise a condition variable whose timed waits run on CLOCK_MONOTONIC. */
void sgm__clock_cond_init(pthread_cond_t *c);
/* The CLOCK_MONOTONIC time ms milliseconds from now, for such a wait. */
struct timespec sgm__clock_deadline(uint64_t ms);

/* ------------------------------------------------------------------------ */
/* prim/host.c — the host machine: RAM, cgroup limit, NUMA. */

/* Physical RAM of the machine (hwloc), in bytes; 0 if unknown. */
uint64_t sgm__host_machine_ram(void);
/* Tests: hwloc topologies loaded by sgm__host_machine_ram (probed once per process). */
unsigned sgm__host_n_topology_loads(void);
/* The cgroup v2 or v1 memory limit of this process, read under root ("" = "/");
 * *out = 0 when there is no limit. */
int sgm__host_cgroup_limit(const char *root, uint64_t *out);
/* min(machine RAM, cgroup limit), reading the cgroup under root. */
uint64_t sgm__host_physical_ram(const char *root);
/* Map bytes (a multiple of the page size) of anonymous memory for a backend to
 * page-lock: excluded from fork() children (MADV_DONTFORK), placed on NUMA node
 * `node` by preference (MPOL_PREFERRED; node < 0: no preference). *out = NULL
 * and a message on failure. Free with munmap. */
int sgm__host_map_pinnable(uint64_t bytes, int node, void **out);

/* ------------------------------------------------------------------------ */
/* suballoc.c — offset-based sub-allocator with metadata off-chunk.
 *
 * Hands out [offset, offset + size) ranges of an abstract offset space made of
 * ranges added by its owner; never touches the memory itself, so it can carve
 * device memory the CPU cannot address. No locks: its owner serialises it. */

typedef struct sgm_suballoc sgm_suballoc;
/* One live block of an unindexed sub-allocator, as its owner keeps it. */
typedef struct sgm_suballoc_node sgm_suballoc_node;

typedef struct sgm_suballoc_stats {
  uint64_t capacity_bytes;     /* sum of the ranges' sizes */
  uint64_t used_bytes;         /* sum of live blocks' (rounded) sizes */
  uint64_t n_live;             /* live blocks */
  uint64_t n_free_blocks;      /* free blocks (fragments) */
  uint64_t largest_free_bytes; /* the biggest free block */
  uint64_t n_ranges;           /* ranges added and not removed */
} sgm_suballoc_stats;

/* An empty allocator; align_bytes (a power of two) is every block's offset and size granule. */
int sgm__suballoc_create(uint64_t align_bytes, sgm_suballoc **out);
/* The same without a table of live blocks by offset: its owner keeps each
 * block's node (sgm__suballoc_try_alloc_node) and frees by it
 * (sgm__suballoc_free_node), one hash insert and one hash walk less per pair
 * for an owner that finds its blocks by its own map (the tier pool).
 * sgm__suballoc_free and sgm__suballoc_block_size by offset refuse. */
int sgm__suballoc_create_unindexed(uint64_t align_bytes, sgm_suballoc **out);
/* Free sa and all its metadata, live blocks or not (the memory it carves is
 * its owner's). NULL is a no-op. */
void sgm__suballoc_destroy(sgm_suballoc *sa);
/* Add [offset, offset+size) as free space; aligned, not overlapping another range.
 * Blocks never span two ranges, even adjacent ones. */
int sgm__suballoc_add_range(sgm_suballoc *sa, uint64_t offset, uint64_t size);
/* Remove the range added at offset if no live block is in it; false otherwise. */
bool sgm__suballoc_try_remove_range(sgm_suballoc *sa, uint64_t offset);
/* True when the range added at offset holds no live block. */
bool sgm__suballoc_range_is_free(const sgm_suballoc *sa, uint64_t offset);
/* Allocate size bytes (rounded up to the alignment). false when nothing fits
 * (or block metadata cannot be allocated). *size_out: the rounded size. */
bool sgm__suballoc_try_alloc(sgm_suballoc *sa, uint64_t size, uint64_t *offset_out,
                             uint64_t *size_out);
/* sgm__suballoc_try_alloc that also hands out the block's node (*node_out). */
bool sgm__suballoc_try_alloc_node(sgm_suballoc *sa, uint64_t size, uint64_t *offset_out,
                                  uint64_t *size_out, sgm_suballoc_node **node_out);
/* Free the live block that starts at offset; SGM_ERR_INVALID (nothing changed)
 * when no live block starts there. *size_out: its size (0 on error). */
int sgm__suballoc_free(sgm_suballoc *sa, uint64_t offset, uint64_t *size_out);
/* Free the live block whose node sgm__suballoc_try_alloc_node handed out;
 * SGM_ERR_INVALID (nothing changed) when that node is no live block. */
int sgm__suballoc_free_node(sgm_suballoc *sa, sgm_suballoc_node *node, uint64_t *size_out);
/* Start loading the neighbours of a live block's node (its own line must be
 * at hand): sgm__suballoc_free_node reads them to coalesce, and their loads
 * were 40% of its time once 10,000 blocks are live (issue 26). Nothing waits. */
void sgm__suballoc_prefetch_neighbours(const sgm_suballoc_node *node);
/* A split of a free block cuts the new block from the end nearer an end of
 * its range; hook(arg, low, high, size), when set, may say otherwise: < 0
 * the low end (offset low), > 0 the high end (offset high), 0 the default. */
void sgm__suballoc_set_end_hook(sgm_suballoc *sa, int (*hook)(void *, uint64_t, uint64_t, uint64_t),
                                void *arg);
/* True when node is a live block of offset and size (its owner's checks). */
bool sgm__suballoc_node_is(const sgm_suballoc_node *node, uint64_t offset, uint64_t size);
/* Size of the live block starting at offset; 0 if none. */
uint64_t sgm__suballoc_block_size(const sgm_suballoc *sa, uint64_t offset);
/* Fill *out (O(1): kept up to date by every call). */
void sgm__suballoc_stats(const sgm_suballoc *sa, sgm_suballoc_stats *out);
/* Walk everything and check every invariant; false (and a message via
 * sgm__error_set) on the first broken one. O(n). */
bool sgm__suballoc_check(const sgm_suballoc *sa);
/* Tests: make sa's n-th next metadata malloc fail (0 = the next one), then
 * succeed again; n < 0 turns it off. Lets a test walk every NOMEM path. */
void sgm__suballoc_inject_nomem(sgm_suballoc *sa, int64_t n);

/* ------------------------------------------------------------------------ */
/* context.c, context_state.c — the context. Its layout is context.h's, one
 * floor below context.c (lib/LAYERS), read there by context.c and the
 * accessors below (context_state.c); the services (stats.c, share.c,
 * capture.c), hooks.c and the tests read what they need through those
 * accessors, placement through sgm_context_parts (placement.h). */

struct sgm_tier_pool;
struct sgm_backend;
struct sgm_backend_ops;
struct sgm_placement;
struct sgm_share;

/* Set at create and constant until destroy: any thread, no lock, no failure.
 * sgm__context_cfg: the config as resolved at create (TF override applied),
 * never written after create (sgm_context_config hands it out). tier: the
 * VRAM or shared pool (NULL for the disk tier, which placement owns). budget:
 * a tier's budget as resolved at create, read without the lock (the disk's,
 * and the others' before any other thread sees ctx; later: sgm__context_budgets). */
const sgm_config *sgm__context_cfg(const sgm_context *ctx);
const struct sgm_backend_ops *sgm__context_bops(const sgm_context *ctx);
struct sgm_backend *sgm__context_be(const sgm_context *ctx);
struct sgm_tier_pool *sgm__context_tier(const sgm_context *ctx, sgm_tier t);
uint64_t sgm__context_budget(const sgm_context *ctx, sgm_tier t);
/* Placement's state (buffers, residency lists, disk tier, prefetch): set once
 * by sgm__placement_create before any other thread sees ctx, cleared by
 * sgm__placement_destroy after the last. */
struct sgm_placement *sgm__context_pl(const sgm_context *ctx);
/* Tests: put a spy vtable in front of the backend (before other threads use
 * ctx; the spy forwards to the real ops it saved). */
void sgm__context_set_bops(sgm_context *ctx, const struct sgm_backend_ops *bops);
/* The budgets in force of VRAM and shared memory (VRAM's changes with
 * sgm_set_vram_fraction: read under the context lock). */
void sgm__context_budgets(sgm_context *ctx, uint64_t *vram, uint64_t *shared);
/* The VRAM fraction in force (under the context lock). */
double sgm__context_vram_fraction(sgm_context *ctx);
/* The idle-trim clock's time (monotonic ms, or the tests' clock). */
uint64_t sgm__context_now_ms(sgm_context *ctx);
/* Device memory and usable RAM as found at create; share.c's join may learn
 * the device's total again from the node's backend (before other threads
 * use ctx). */
uint64_t sgm__context_device_total(const sgm_context *ctx);
void sgm__context_set_device_total(sgm_context *ctx, uint64_t bytes);
uint64_t sgm__context_physical_ram(const sgm_context *ctx);
/* share.c's node registry state (NULL: untracked) and managed.c's mode,
 * set while the context is created, before other threads see it. */
struct sgm_share *sgm__context_share(const sgm_context *ctx);
void sgm__context_set_share(sgm_context *ctx, struct sgm_share *sh);
bool sgm__context_managed(const sgm_context *ctx);
/* The context's own figures of sgm_stats: n_fallbacks, fallback_bytes,
 * n_bad_frees (relaxed atomic loads), device_total_bytes, physical_ram_bytes. */
void sgm__context_counters(const sgm_context *ctx, sgm_stats *out);
/* True once an interposer called sgm_interpose_vram on ctx; *vram_bytes: the
 * device memory it accounts now, *peak_bytes: the most it accounted (relaxed
 * atomic loads). */
bool sgm__context_interposed(sgm_context *ctx, uint64_t *vram_bytes, uint64_t *peak_bytes);

/* prim/fork.c — fork(): bumped in every child by a pthread_atfork handler (atomic). */
extern unsigned sgm__fork_generation;
/* Start counting forks (once per process) and return the generation now: a
 * context keeps it and is stale in a child. */
unsigned sgm__fork_watch(void);
/* True when the process forked since generation gen (one relaxed load). */
static inline bool sgm__fork_stale(unsigned gen) {
  return sgm_unlikely(__atomic_load_n(&sgm__fork_generation, __ATOMIC_RELAXED) != gen);
}
/* Set "fn: this context was created by process owner_pid before fork() ..."
 * and return SGM_ERR_UNSUPPORTED. */
int sgm__fork_error(long owner_pid, const char *fn);
/* sgm__context_forked, sgm__context_fork_error: the context's fork check,
 * inline in context.h (on every public entry's path). */

/* Replace the idle-trim clock (tests); NULL restores the monotonic clock. */
void sgm__context_set_clock(sgm_context *ctx, uint64_t (*clock_ms)(void *user), void *user);
/* One idle-trim pass over the tiers at the clock's time; bytes returned. */
uint64_t sgm__context_idle_tick(sgm_context *ctx);

/* placement.c, buffer*.c, residency*.c, migrate*.c, prefetch.c — buffers,
 * eviction and migration: the only code that touches two tiers (what they
 * share among themselves is in placement.h). */
/* Build ctx's placement (sgm__context_pl): the two resident tiers' policies (SGM_ERR_INVALID naming the
 * variable when a policy is not registered) and the spill tier when a spill
 * directory is set (its open's status). Leaves nothing on failure. Called
 * once from sgm_context_create, before any other thread sees ctx. */
int sgm__placement_create(sgm_context *ctx);
/* sgm_trim's part in placement: the disk tier's pinned staging buffer goes
 * back to the driver when no transfer holds it (it comes back on the next
 * disk<->VRAM transfer). Bytes returned. */
uint64_t sgm__placement_trim(sgm_context *ctx);
/* The idle tick's part for the disk tier: sgm__placement_trim once the disk
 * has done nothing for idle_ms by now_ms (the context's clock); bytes
 * returned. */
uint64_t sgm__placement_idle_trim(sgm_context *ctx, uint64_t now_ms, uint64_t idle_ms);
/* True when d is the block of a live buffer (sgm_free must refuse it). Takes
 * the tiers' shard locks briefly; any thread. */
bool sgm__placement_owns_block(sgm_context *ctx, uint64_t d);
/* Stops the prefetch worker and frees every buffer still alive, then the
 * policies and the spill tier. No other thread may use ctx. NULL pl: no-op. */
void sgm__placement_destroy(sgm_context *ctx);
/* residency.c, rules 1-3 for sgm_alloc: a block in VRAM if it fits, demoting
 * released buffers (cascading) to make room; else, when SGM_SHARED_FALLBACK
 * is on, in shared memory. Blocks freed on streams are reclaimed first when
 * a tier is full (stream: the caller's). *where: the tier the block landed in
 * (SGM_TIER_NONE on failure, *out 0). Fails with SGM_ERR_NOMEM and a message
 * naming the budgets, or a backend status. No lock held; may block on copies
 * and driver calls. */
int sgm__residency_alloc(sgm_context *ctx, size_t size, void *stream, uint64_t *out, sgm_tier *where);
/* residency.c, rule 3 alone for sgm_alloc_shared: a block in shared memory
 * (stream: the caller's), reclaiming cached blocks and demoting released
 * buffers to disk as rule 2 does. SGM_ERR_NOMEM naming the shared budget, or
 * a backend status; *out 0 on failure. No lock held. */
int sgm__residency_alloc_shared(sgm_context *ctx, size_t size, void *stream, uint64_t *out);
/* residency.c: demote released buffers of resident tier t (VRAM or shared)
 * until its used bytes fit its budget (lowered by fair sharing); buffers
 * moved. No lock held; may block on copies. */
uint64_t sgm__residency_trim_to_budget(sgm_context *ctx, sgm_tier t);
/* Add migration counters and the disk tier's figures to *st (the caller
 * zeroed it). Any thread; takes the placement lock. Cannot fail. */
void sgm__placement_stats(sgm_context *ctx, sgm_stats *st);
/* Tests: the spill tier (NULL when off); the context keeps ownership. */
struct sgm_disk *sgm__placement_disk(sgm_context *ctx);
/* Tests: replace the policies' clock (ns; NULL restores the monotonic one;
 * called under the placement lock, must not block). */
void sgm__placement_set_clock(sgm_context *ctx, uint64_t (*clock_ns)(void *user), void *user);
/* Tests: walk every buffer and policy instance under the placement lock;
 * SGM_OK, or SGM_ERR_CORRUPT with the first broken invariant in why. O(n). */
int sgm__placement_check(sgm_context *ctx, char *why, size_t why_len);
/* The name of the policy tier t runs (static storage); NULL for the disk
 * tier or a bad t. */
const char *sgm__placement_policy_name(sgm_context *ctx, sgm_tier t);
/* buffer_state.c, tests: where a disk-resident buffer's extent starts in the spill
 * file; false (and *offset 0) when it is not on disk or has no extent yet.
 * Waits while another thread moves b. */
bool sgm__buffer_disk_offset(sgm_buffer *b, uint64_t *offset);

/* managed.c — SGM_POINTERS=managed (docs/managed.md). */
/* Resolve cfg.pointers against the backend (ctx->managed): SGM_ERR_UNSUPPORTED
 * with a message for managed where unsupported; auto falls back to fixed with
 * a one-line notice at SGM_VERBOSE >= 1. */
int sgm__managed_open(sgm_context *ctx);
/* A movable block of size bytes (>= SGM_MANAGED_MOVABLE_BYTES): VRAM if it
 * fits after demoting colder blocks, else shared memory (when the fallback is
 * on). *where: its tier (SGM_TIER_NONE and *out 0 on failure). No lock held. */
int sgm__managed_alloc(sgm_context *ctx, size_t size, void *stream, uint64_t *out, sgm_tier *where);
/* Free the managed block at d on stream (its range is cached for reuse):
 * SGM_ERR_INVALID (no message) when d is not one. */
int sgm__managed_free(sgm_context *ctx, uint64_t d, void *stream);
/* sgm_record_stream of d: true when d is a managed block (its free then gives
 * the range back to the driver instead of caching it). */
bool sgm__managed_record_stream(sgm_context *ctx, uint64_t d);
/* The cache of freed movable ranges: give back to the driver, oldest first,
 * at least want bytes of tier t's (SGM_TIER_COUNT: both; UINT64_MAX: all);
 * those cached idle_ms or longer; those of tier t over a lowered budget.
 * Bytes given back. No lock held. */
uint64_t sgm__managed_cache_drop(sgm_context *ctx, sgm_tier t, uint64_t want);
uint64_t sgm__managed_cache_idle(sgm_context *ctx, uint64_t now_ms, uint64_t idle_ms);
uint64_t sgm__managed_cache_fit(sgm_context *ctx, sgm_tier t);
/* List the live managed blocks whose listing in their tier's policy was
 * deferred (a reused cached range: managed.c), oldest first; before any
 * victim search or other reading of the policies. No lock held. */
void sgm__managed_flush(sgm_context *ctx);
/* The tier of the managed block at d; SGM_TIER_NONE when d is not one. */
sgm_tier sgm__managed_tier(sgm_context *ctx, uint64_t d);
/* Promote shared-placed managed blocks into VRAM room that is free now (no
 * demotion), highest priority first, then the most recently touched (blocks a
 * cold hint sent down stay); stops at the first that does not fit. The first
 * up to inline_bytes move on this thread, the rest are queued to the worker
 * on the copy stream (lib/placement/managed_queue.c), their room charged. Bytes moved
 * or queued. No lock held. */
uint64_t sgm__managed_promote(sgm_context *ctx, uint64_t inline_bytes);
/* sgm_trim: run the queued managed moves now (lib/placement/managed_queue.c). */
void sgm__managed_queue_drain(sgm_context *ctx);
/* Stats: the managed counters into *st (tier used/n_live included). */
void sgm__managed_stats(sgm_context *ctx, sgm_stats *st);

/* context.c: set the VRAM budget to fraction × device memory (capped as at
 * create); free chunks above a lowered budget are returned. SGM_ERR_INVALID
 * (nothing changes) outside (0, 1]. Thread-safe; leaves ctx->cfg as created
 * (sgm_context_config hands that record out). */
int sgm__context_set_vram_fraction(sgm_context *ctx, double fraction);

/* stats.c: the JSON writer grows a string; false when out of memory. */
typedef struct sgm_strbuf {
  char *s;    /* NUL-terminated text, malloc'd */
  size_t len; /* bytes used, without the NUL */
  size_t cap; /* bytes allocated */
  bool failed; /* an append ran out of memory */
} sgm_strbuf;
void sgm__strbuf_printf(sgm_strbuf *b, const char *fmt, ...) SGM_PRINTF(2, 3);

/* ------------------------------------------------------------------------ */
/* capture.c — capture pools (DESIGN.md §9): blocks allocated under a pool's
 * scope stay live in their tier until the pool is released. Every function
 * takes the pool state's own leaf lock and calls nothing under it. */
typedef struct sgm_capture sgm_capture;
/* Made at context create (NULL: out of host memory) / freed at destroy.
 * free_ex: the context's sgm_free_ex, through which a released pool frees
 * its parked blocks (capture.c sits below context.c and never calls it up). */
sgm_capture *sgm__capture_create(sgm_status (*free_ex)(sgm_context *ctx, void *ptr, void *stream));
void sgm__capture_destroy(sgm_capture *c);
/* The context's pool state (never NULL for a created context). */
struct sgm_capture *sgm__context_capture(const sgm_context *ctx);
/* A capture state's first member: the count its inline check reads. */
typedef struct sgm_capture_head {
  uint64_t n_pools; /* pools not released (atomic: the fast path's only read) */
} sgm_capture_head;
/* True while any pool exists (one relaxed load; c may be NULL). */
static inline bool sgm__capture_active(const sgm_capture *c) {
  return c && __atomic_load_n(&((const sgm_capture_head *)(const void *)c)->n_pools, __ATOMIC_RELAXED) != 0;
}
/* *pool: the pool the calling thread allocates into on stream (0 = none);
 * answers a block of at least size (at most 1/8 more) that pool parked when
 * freed on this stream, now live again, or NULL when there is none. */
void *sgm__capture_scope_reuse(sgm_capture *c, size_t size, void *stream, uint64_t *pool);
/* Tests: how many times the capture lock was taken so far. */
uint64_t sgm__capture_lock_takes(const sgm_capture *c);
/* ptr (size bytes, just allocated on stream) joins the pool, unless it was
 * released meanwhile. */
void sgm__capture_adopt(sgm_capture *c, uint64_t pool, void *ptr, size_t size, void *stream);
/* A free of ptr on stream: 1 when ptr was a live pool member, now parked (the
 * caller frees nothing); -1 when it is parked already (a double free: the
 * caller refuses it); 0 when it is no pool's. */
int sgm__capture_park(sgm_capture *c, uint64_t ptr, void *stream);
/* Whether ptr is a parked pool member (freed, waiting for its release). */
bool sgm__capture_parked(sgm_capture *c, uint64_t ptr);
/* sgm_record_stream named ptr: if a pool member, the pool never reuses it. */
void sgm__capture_recorded(sgm_capture *c, uint64_t ptr);
/* End the calling thread's scopes on stream (PyTorch 2.1-2.2's end hook
 * names a stream, not a pool); SGM_ERR_INVALID when there was none. */
int sgm__capture_end_stream(sgm_capture *c, void *stream);
/* Release every pool (context destroy), freeing their parked blocks. */
void sgm__capture_release_all(sgm_context *ctx);

/* ------------------------------------------------------------------------ */
/* hooks.c — the framework hooks' lazily created per-device contexts. */

/* Tests only: destroy every hook context and zero the creation count. No
 * other thread may be using the hooks meanwhile. */
void sgm__hooks_reset_for_tests(void);
/* Hook contexts created since start (or the last reset). */
uint64_t sgm__hooks_n_created(void);

/* ------------------------------------------------------------------------ */
/* node.c — the node registry: one shared-memory table per device, a slot per
 * process (see the file's opening comment for the layout and its rules). */

#define SGM_NODE_VERSION 3u        /* the record layout this sgm reads and writes (3: a file per process) */
#define SGM_NODE_RECORD_BYTES 1024u
#define SGM_NODE_K8S_MAX 64          /* a Kubernetes namespace / pod / container name kept, NUL included */ /* one process's record file */
#define SGM_NODE_MAX_SLOTS 1024u   /* the most records a view holds (more are counted) */
#define SGM_NODE_DEFAULT_SLOTS 128u /* the most processes that join one device */
#define SGM_NODE_KEY_MAX 64        /* device key bytes, NUL included */
#define SGM_NODE_NAME_MAX 32       /* process name bytes, NUL included */
#define SGM_NODE_PCI_MAX 32        /* PCI bus id bytes, NUL included */
#define SGM_NODE_UUID_TEXT 37      /* a UUID in 8-4-4-4-12 hex, NUL included */

/* The words a process publishes, in its slot and in sgm_node_usage.w. */
enum {
  SGM_NODE_F_USED = 0,          /* 3 words: bytes handed out per tier (VRAM, shared, disk) */
  SGM_NODE_F_COMMITTED = 3,     /* 3 words: bytes taken from the driver / OS per tier */
  SGM_NODE_F_BUDGET = 6,        /* 3 words: the budget in force per tier */
  SGM_NODE_F_PEAK = 9,          /* 3 words: peak used per tier */
  SGM_NODE_F_RESERVE = 12,      /* SGM_VRAM_RESERVE: VRAM this process is guaranteed */
  SGM_NODE_F_CAP = 13,          /* its VRAM budget if alone (fraction, limits, quotas) */
  SGM_NODE_F_DEMAND = 14,       /* VRAM it would use if it could: resident bytes + a chunk */
  SGM_NODE_F_SHARED_CAP = 15,   /* its shared budget if alone (SGM_SHARED_LIMIT) */
  SGM_NODE_F_SHARED_DEMAND = 16, /* shared memory it would use: used + a chunk */
  SGM_NODE_F_WEIGHT = 17,       /* SGM_SHARE_WEIGHT */
  SGM_NODE_F_FALLBACKS = 18,    /* allocations that wanted VRAM and got shared (cumulative) */
  SGM_NODE_F_EVICTIONS = 19,    /* buffers moved down a tier to make room (cumulative) */
  SGM_NODE_F_MOVED = 20,        /* bytes migrated between tiers (cumulative) */
  SGM_NODE_F_HEARTBEAT = 21,    /* CLOCK_MONOTONIC ns of the last publish */
  SGM_NODE_F_FLAGS = 22,        /* SGM_NODE_FLAG_* */
  SGM_NODE_F_EMU_DEVICE = 23,   /* bytes held on the shared emulated device (announce, check) */
  SGM_NODE_F_DEVICE_USED = 24,  /* the device's used memory as the driver told this process (all
                                   processes, sgm's or not; sampled once a second; 0 = unknown) */
  SGM_NODE_N_FIELDS = 25
};
#define SGM_NODE_FLAG_SOLO UINT64_C(1) /* SGM_SHARE_MODE=solo: takes its budget as if alone */
/* Bits 2..15 of SGM_NODE_F_FLAGS are free for further marks; readers pass
 * unknown bits through (sgm_node_process.flags). */
#define SGM_NODE_FLAG_INTERPOSED UINT64_C(2) /* driven by libsgm-preload.so: its VRAM words count
                                                the program's own driver allocations too */

typedef struct sgm_node_usage {
  uint64_t w[SGM_NODE_N_FIELDS]; /* indexed by SGM_NODE_F_* */
} sgm_node_usage;

typedef struct sgm_node_proc {
  uint32_t slot;                   /* an id: its record's inode number, low 32 bits */
  int pid;                         /* as published (-1 when out of range) */
  uint64_t start_ticks;            /* its start time, clock ticks after boot (/proc/PID/stat) */
  char name[SGM_NODE_NAME_MAX];    /* short name, printable, no comma or quote */
  bool self;                       /* the calling process's own record (sgm__node_view) */
  bool alive;                      /* its owner holds the record's liveness lock */
  uint32_t uid;                    /* the record's owner (the kernel's word, not the record's) */
  uint64_t ino;                    /* the record's inode number */
  uint64_t pid_ns;                 /* the writer's PID namespace inode (0: unknown) */
  uint64_t join_ns;                /* CLOCK_REALTIME ns when it joined (as it wrote it) */
  char k8s_namespace[SGM_NODE_K8S_MAX]; /* POD_NAMESPACE, POD_NAME, CONTAINER_NAME of its */
  char k8s_pod[SGM_NODE_K8S_MAX];       /* environment (the downward API's usual names); */
  char k8s_container[SGM_NODE_K8S_MAX]; /* [A-Za-z0-9._-] only; "" when unset */
  sgm_node_usage u;                /* what it published */
} sgm_node_proc;

/* A record's device figures, as its writer saw them. */
typedef struct sgm_node_devinfo {
  uint64_t device_total_bytes;
  uint64_t shared_cap_bytes;
  uint64_t join_ns;
  char key[SGM_NODE_KEY_MAX];
  uint8_t uuid[16];
  char uuid_text[SGM_NODE_UUID_TEXT];
  char pci_bus_id[SGM_NODE_PCI_MAX];
} sgm_node_devinfo;

/* Whose records count (for budgets) or show (for readers). */
typedef struct sgm_node_accept {
  bool group;      /* also group-readable records of a group ... */
  int64_t gid;     /* ... this one (>= 0), else any group of this process */
  bool all_users;  /* every owner's (readers: root's sgm-smi) */
} sgm_node_accept;

typedef struct sgm_node_view {
  uint32_t version;                /* SGM_NODE_VERSION */
  uint32_t n_slots;                /* the most processes that join (SGM_NODE_DEFAULT_SLOTS) */
  uint64_t device_total_bytes;     /* device memory, as the first live process saw it */
  uint64_t shared_cap_bytes;       /* the node's shared-memory cap: max(RAM / 2, 64 MiB) */
  uint64_t generation;             /* a hash of the live records: changes at every join and leave */
  char key[SGM_NODE_KEY_MAX];      /* the device key */
  uint8_t uuid[16];                /* the device's UUID (all zero: unknown) */
  char uuid_text[SGM_NODE_UUID_TEXT]; /* uuid in 8-4-4-4-12 hex; "" when unknown */
  char pci_bus_id[SGM_NODE_PCI_MAX]; /* its PCI bus id, [0-9a-fA-F:.] only; "" when unknown */
  size_t n_procs;                  /* records copied into procs */
  size_t n_unstable;               /* records skipped: a writer never finished (died mid-write) */
  size_t n_refused;                /* names skipped: not a regular file, wrong size, writable by
                                      others, corrupt, another key (n_unstable included) */
  size_t n_foreign;                /* records of other users not counted */
  uint32_t foreign_uid;            /* the owner of one of them */
  size_t n_dead_own;               /* dead records of this user (to unlink) */
  size_t n_more;                   /* records past SGM_NODE_MAX_SLOTS */
  sgm_node_proc procs[SGM_NODE_MAX_SLOTS]; /* in join order */
} sgm_node_view;

typedef struct sgm_node_params {
  const char *dir;             /* SGM_NODE_DIR; NULL or "" = /dev/shm */
  const char *key;             /* the device key (sgm_backend_ops.device_key) */
  const char *name;            /* this process's short name */
  uint8_t uuid[16];            /* written into a new segment: the device's UUID (zero: unknown) */
  const char *pci_bus_id;      /* written into a new segment: its PCI bus id (NULL: unknown) */
  bool group;                  /* share with a group: records 0640, group members' counted */
  int64_t group_gid;           /* that group (>= 0: the policy's; -1: any of this process's) */
  uint64_t device_total_bytes; /* written into a new segment */
  uint64_t shared_cap_bytes;   /* written into a new segment */
  uint32_t n_slots;            /* a new segment's slots; 0 = SGM_NODE_DEFAULT_SLOTS (tests) */
  int verbose;                 /* log level */
} sgm_node_params;

typedef struct sgm_node sgm_node;

/* Tests: called at named points ("join-locked": before our record exists,
 * "join-writing": written but not in place, "leave-locked",
 * "reserve-locked": announced, not checked), so a child can die there. */
extern void (*sgm__node_test_hook)(const char *where);
/* Create this process's record for p->key. On any failure (unsafe folder,
 * full filesystem, too many processes) *out = NULL, nothing is left in the
 * folder, the status says why, and one warning per process says the
 * program runs untracked: callers go on without a registry. */
int sgm__node_join(const sgm_node_params *p, sgm_node **out);
/* Remove our record and close. NULL is a no-op. */
void sgm__node_leave(sgm_node *n);
/* Publish this process's figures (seqlock; never blocks on other processes). */
void sgm__node_publish(sgm_node *n, const sgm_node_usage *u);
/* Snapshot of every live process whose record counts (ours marked self). */
int sgm__node_view(sgm_node *n, sgm_node_view *out);
/* Unlink this user's dead records of the device (when a view saw one); how many. */
unsigned sgm__node_reclaim(sgm_node *n);
/* The device total and shared cap adopted at join; our record's path and id. */
uint64_t sgm__node_device_total(const sgm_node *n);
uint64_t sgm__node_shared_cap(const sgm_node *n);
const char *sgm__node_file(const sgm_node *n);
uint32_t sgm__node_slot(const sgm_node *n);
/* The shared emulated device: take bytes of total for this process when the
 * live processes' bytes leave room (SGM_OK), else SGM_ERR_NOMEM (no message); *free_out
 * = what is left. Release gives bytes back. Used: the live processes' sum. */
int sgm__node_device_reserve(sgm_node *n, uint64_t bytes, uint64_t total, uint64_t *free_out);
void sgm__node_device_release(sgm_node *n, uint64_t bytes);
int sgm__node_device_used(sgm_node *n, uint64_t *used_out);
/* Readers (sgm-smi, the fuzz target): parse one record's bytes (len must be
 * SGM_NODE_RECORD_BYTES); every size and string is checked. SGM_OK, or a
 * status with why filled (SGM_ERR_BUSY: mid-write or leaving). */
int sgm__node_record_parse(const void *buf, size_t len, sgm_node_proc *p, sgm_node_devinfo *d,
                           char *why, size_t why_len);
/* Fuzzing and tests: write the header's check word of a hand-made record. */
void sgm__node_record_seal(void *buf, size_t len);
/* dir/sgm-node-<key with unsafe characters as '_'>: the registry's name;
 * its records are that name + "@<pid>-<nonce>". */
int sgm__node_path(const char *dir, const char *key, char *out, size_t len);
/* "sgm-node-<sanitised key>@": the records' name prefix. */
int sgm__node_prefix(const char *key, char *out, size_t len);
/* Read every record of dir named prefix* whose key is key (NULL: any key
 * that sanitises to prefix) and whose owner
 * acc accepts (live ones; dead ones too with dead_too) into out, in join
 * order. SGM_ERR_INVALID / SGM_ERR_IO when the folder cannot be read. */
int sgm__node_scan(const char *dir, const char *prefix, const char *key, const sgm_node_accept *acc,
                   bool dead_too, sgm_node_view *out);
/* The same, keeping records open between scans in cache (a writer's view
 * every period; NULL = none). The caller serialises scans of one cache. */
typedef struct sgm_node_peers sgm_node_peers;
int sgm__node_scan_cached(const char *dir, const char *prefix, const char *key, const sgm_node_accept *acc,
                          bool dead_too, sgm_node_peers *cache, sgm_node_view *out);
/* True unless nobody holds the record's write lock (on doubt: true). */
bool sgm__node_record_alive(int fd);
/* This process's start time in clock ticks after boot (0 when unknown). */
uint64_t sgm__node_start_ticks_of_self(void);
/* Tests: warn again on the next untracked join. */
void sgm__node_reset_warning(void);
/* A UUID as 8-4-4-4-12 lowercase hex (what nvidia-smi -L prints after
 * "GPU-"); "" when all sixteen bytes are zero (unknown). */
void sgm__node_uuid_format(const uint8_t uuid[16], char *out, size_t len);
/* A stable UUID derived from a name (the emulated device's): the same bytes
 * in every process, RFC 9562 variant, version 8 (custom). */
void sgm__node_uuid_derive(const char *name, uint8_t out[16]);

/* One slot per process per device: a context joins its device's registry as
 * a member; the contexts of one process on one segment (same SGM_NODE_DIR and
 * key) share one slot (sgm__node_join once, reference counted), whose
 * published figures are the sum of theirs (weight: the largest; flags: any),
 * so the fair split counts the process once. The last member out leaves. */
typedef struct sgm_node_member sgm_node_member;
/* As sgm__node_join (same failures: untracked, *out = NULL). */
int sgm__node_member_join(const sgm_node_params *p, sgm_node_member **out);
/* Drop this member: the slot is republished without its figures, or left
 * when it was the last. NULL is a no-op. */
void sgm__node_member_leave(sgm_node_member *m);
/* Record this member's figures and publish the sum of the process's. */
void sgm__node_member_publish(sgm_node_member *m, const sgm_node_usage *u);
/* The process's slot (shared by its members). */
sgm_node *sgm__node_member_node(const sgm_node_member *m);
/* The members' last figures, m's replaced by mine, into out (the first max
 * of them): how many members there are, and *self_out = m's index. */
size_t sgm__node_member_usages(sgm_node_member *m, const sgm_node_usage *mine, sgm_node_usage *out,
                               size_t max, size_t *self_out);
/* The process's figures from its members': what its slot publishes. */
void sgm__node_usage_sum(const sgm_node_usage *u, size_t n, sgm_node_usage *out);

/* ------------------------------------------------------------------------ */
/* admin.c — the admin policy file (see the file's opening comment). */

/* sgm_admin_policy, sgm__admin_current, sgm__admin_registry_dir: tool_support.h. */
/* The build-time path of the policy file (SGM_ADMIN_CONF_PATH). */
const char *sgm__policy_path(void);
/* The size of a policy (tests allocate one for sgm__admin_parse). */
size_t sgm__admin_policy_bytes(void);
/* Parse path into pol (tests): SGM_OK also when it does not exist (no
 * policy); otherwise the status, and the message kept for apply. */
int sgm__admin_parse(const char *path, sgm_admin_policy *pol);
/* Which policy file holds, given the installed path and SGM_ADMIN_CONF
 * (env, may be NULL): env only for root, or when installed does not exist
 * and env and its folder are writable by root alone; otherwise installed,
 * with why the variable was ignored in why ("" when it was not). */
const char *sgm__admin_choose(const char *installed, const char *env, char *why, size_t why_len);
/* Tests: load the policy again (SGM_ADMIN_CONF may have changed). */
void sgm__admin_reset_for_tests(void);
/* At create, on the context's copy of the configuration (after the
 * environment and the program's code): forced options, the registry folder
 * and group, this user's reservation. SGM_ERR_INVALID when the policy file
 * exists but cannot be used (the message names its line). */
int sgm__admin_apply(const sgm_admin_policy *pol, sgm_config *cfg);
/* The VRAM cap of uid's processes (self: this process, whose supplementary
 * groups count), resolved against total; UINT64_MAX: none. */
uint64_t sgm__admin_vram_cap(const sgm_admin_policy *pol, uint32_t uid, bool self, uint64_t total);
/* The most VRAM a record of uid may reserve; UINT64_MAX when the policy
 * grants no reservations (users' own, as without one). */
uint64_t sgm__admin_vram_reserve(const sgm_admin_policy *pol, uint32_t uid, uint64_t total);
/* The registry's group from the policy; -1 none. */
int64_t sgm__admin_gid(const sgm_admin_policy *pol);
/* The policy's cap and reservation for uid: true when it names either. */
bool sgm__admin_limits(const sgm_admin_policy *pol, uint32_t uid, bool self, sgm_size *cap,
                       sgm_size *reserve);

/* ------------------------------------------------------------------------ */
/* share.c — a context in its device's node registry: fair budgets. */

typedef struct sgm_share sgm_share;

/* One process's claim on a shared pool. */
typedef struct sgm_share_claim {
  uint64_t reserve_bytes; /* guaranteed first (SGM_VRAM_RESERVE) */
  uint64_t demand_bytes;  /* what it would use now */
  uint64_t cap_bytes;     /* the most it may get (its solo budget, quotas); UINT64_MAX = none */
  uint32_t weight;        /* SGM_SHARE_WEIGHT, 1..1000 */
} sgm_share_claim;

/* Split total among n claims (see share.c): reservations first, then
 * water-filled demand by weight, then the rest lent by weight up to each
 * cap. out[j]: claim j's budget, aligned down to SGM_DEVICE_ALIGN, at least
 * one block. */
void sgm__share_fair(uint64_t total, const sgm_share_claim *c, size_t n, uint64_t *out);
/* At create, after the solo budgets are resolved: join the device's registry
 * (unless SGM_NODE=off or the device is private), attach the emulated
 * device's shared capacity, and answer the budgets the tiers start with
 * (the solo ones when untracked or solo). Registry failures leave the
 * context untracked with one warning; only a backend error is returned. */
int sgm__share_join(sgm_context *ctx, uint64_t *vram_budget, uint64_t *shared_budget);
/* After the tiers are built: the first tick, then the ticker thread. */
int sgm__share_start(sgm_context *ctx);
/* Stop the ticker (before the tiers go); leave the registry (after them). */
void sgm__share_stop(sgm_context *ctx);
void sgm__share_leave(sgm_context *ctx);
/* A budget-relevant change (a fallback): tick soon, unless a poke asked for
 * a tick within the last quarter of the node period (the context's clock).
 * Any thread; no-op when untracked. */
void sgm__share_poke(sgm_context *ctx);
/* Tests: the pokes that asked for a tick so far (0 when untracked). */
uint64_t sgm__share_pokes(sgm_context *ctx);
/* Tests: run one full tick (publish, reclaim, rebalance) and wait for it;
 * false when untracked. */
bool sgm__share_tick_sync(sgm_context *ctx);
/* Tests and benchmarks: the context's registry slot (its process's, shared
 * with the process's other contexts on the device); NULL when untracked. */
sgm_node *sgm__share_node(sgm_context *ctx);

#endif /* SGM_INTERNAL_H */
