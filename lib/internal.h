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

#include "sgm.h"

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

SGM_NORETURN void sgm__assert_fail(const char *cond, const char *file, int line);
/* Set this thread's error message; returns status so callers can `return sgm__error_set(...)`. */
int sgm__error_set(int status, const char *fmt, ...) SGM_PRINTF(2, 3);
void sgm__error_clear(void);
/* Write one line "sgm: <level>: <msg>" to stderr when verbose >= level. */
void sgm__log(int verbose, int level, const char *fmt, ...) SGM_PRINTF(3, 4);
/* Format bytes for people: "1.50 GiB". buf of at least 32 bytes; returns buf. */
const char *sgm__fmt_bytes(uint64_t bytes, char *buf, size_t len);

/* ------------------------------------------------------------------------ */
/* Locks with a fixed order, checked when SGM_DEBUG >= 2: a thread may only take
 * a lock of a higher rank than every lock it holds. */
typedef enum sgm_lock_rank {
  SGM_LOCK_HOOKS = 0,   /* hooks.c: creation of the per-device contexts (outermost) */
  SGM_LOCK_CONTEXT = 1, /* context-wide state (callback, clock) */
  SGM_LOCK_BUFFERS = 2, /* buffer states and residency lists (placement.c) */
  SGM_LOCK_TIER_VRAM = 3,
  SGM_LOCK_TIER_SHARED = 4,
  SGM_LOCK_TIER_DISK = 5,
  SGM_LOCK_BACKEND = 6,  /* inside a backend only */
  SGM_LOCK_IDLE = 7,     /* context.c: the idle thread's stop flag (a leaf) */
  SGM_LOCK_REGISTRY = 8  /* policy.c: the policy registry (a leaf) */
} sgm_lock_rank;

typedef struct sgm_lock {
  pthread_mutex_t mu; /* the lock itself */
  int rank;           /* sgm_lock_rank: position in the lock order */
} sgm_lock;

/* A statically initialised lock of that rank (process-wide locks). */
#define SGM_LOCK_INITIALIZER(rank) {PTHREAD_MUTEX_INITIALIZER, (rank)}

void sgm__lock_init(sgm_lock *l, int rank);
void sgm__lock_destroy(sgm_lock *l);
void sgm__lock_take(sgm_lock *l);
void sgm__lock_drop(sgm_lock *l);
/* True when this thread holds l (tracked only when SGM_DEBUG >= 2; else true). */
bool sgm__lock_held(const sgm_lock *l);
/* Debug builds (SGM_DEBUG >= 2): abort unless this thread holds no sgm lock
 * (but the outermost hooks lock, held while a context is brought up). Called
 * at the top of the backend operations that may block (mem_info, allocations,
 * frees, copies, event record and wait): no sgm lock is held across such a
 * driver call (STYLE.md, Threads). event_query and event_destroy do not block
 * and are called under the placement lock while choosing victims. */
void sgm__lock_assert_none_held(void);
/* Sleep while *word == expected (returns at once if it differs; may return
 * spuriously: callers loop). Wake every thread sleeping on word. Private to
 * the process (Linux futexes). */
void sgm__word_wait(uint32_t *word, uint32_t expected);
void sgm__word_wake_all(uint32_t *word);

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
/* ASCII case-insensitive string equality (option values, policy names). */
bool sgm__options_str_ieq(const char *a, const char *b);
/* Resolve a size against its reference (device memory, RAM, free disk); unset gives dflt. */
uint64_t sgm__size_resolve(sgm_size s, uint64_t reference, uint64_t dflt);

/* ------------------------------------------------------------------------ */
/* prim/clock.c — the one monotonic clock. */

/* CLOCK_MONOTONIC in nanoseconds. Any thread; never fails. */
uint64_t sgm__clock_monotonic_ns(void);

/* ------------------------------------------------------------------------ */
/* prim/host.c — the host machine: RAM, cgroup limit, NUMA. */

/* Physical RAM of the machine (hwloc), in bytes; 0 if unknown. */
uint64_t sgm__host_machine_ram(void);
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
/* Free the live block that starts at offset; SGM_ERR_INVALID (nothing changed)
 * when no live block starts there. *size_out: its size (0 on error). */
int sgm__suballoc_free(sgm_suballoc *sa, uint64_t offset, uint64_t *size_out);
/* Size of the live block starting at offset; 0 if none. */
uint64_t sgm__suballoc_block_size(const sgm_suballoc *sa, uint64_t offset);
void sgm__suballoc_stats(const sgm_suballoc *sa, sgm_suballoc_stats *out);
/* Walk everything and check every invariant; false (and a message via
 * sgm__error_set) on the first broken one. O(n). */
bool sgm__suballoc_check(const sgm_suballoc *sa);
/* Tests: make sa's n-th next metadata malloc fail (0 = the next one), then
 * succeed again; n < 0 turns it off. Lets a test walk every NOMEM path. */
void sgm__suballoc_inject_nomem(sgm_suballoc *sa, int64_t n);

/* ------------------------------------------------------------------------ */
/* context.c — the context. Its layout is context.c's own (struct
 * sgm_context is opaque everywhere else); other files read what they need
 * through the accessors below. */

struct sgm_tier_pool;
struct sgm_backend;
struct sgm_backend_ops;
struct sgm_placement;

/* Set at create and constant until destroy: any thread, no lock, no failure.
 * sgm__context_cfg: the config as resolved at create (TF override applied),
 * never written after create (sgm_context_config hands it out). tier: the
 * VRAM or shared pool (NULL for the disk tier, which placement owns). budget:
 * each tier's budget as resolved at create. */
const sgm_config *sgm__context_cfg(const sgm_context *ctx);
const struct sgm_backend_ops *sgm__context_bops(const sgm_context *ctx);
struct sgm_backend *sgm__context_be(const sgm_context *ctx);
struct sgm_tier_pool *sgm__context_tier(const sgm_context *ctx, sgm_tier t);
uint64_t sgm__context_budget(const sgm_context *ctx, sgm_tier t);
/* Placement's state (buffers, residency lists, disk tier, prefetch): set once
 * by sgm__placement_create before any other thread sees ctx, cleared by
 * sgm__placement_destroy after the last. */
struct sgm_placement *sgm__context_pl(const sgm_context *ctx);
void sgm__context_set_pl(sgm_context *ctx, struct sgm_placement *pl);
/* Tests: put a spy vtable in front of the backend (before other threads use
 * ctx; the spy forwards to the real ops it saved). */
void sgm__context_set_bops(sgm_context *ctx, const struct sgm_backend_ops *bops);
/* The context's own figures of sgm_stats: n_fallbacks, fallback_bytes,
 * n_bad_frees (relaxed atomic loads), device_total_bytes, physical_ram_bytes. */
void sgm__context_counters(const sgm_context *ctx, sgm_stats *out);

/* fork(): bumped in every child by a pthread_atfork handler (atomic). */
extern unsigned sgm__fork_generation;
/* True in a child of the process that created ctx: every public entry asks
 * (one relaxed load) and answers sgm__context_fork_error. */
bool sgm__context_forked(const sgm_context *ctx);
/* Set "fn: this context was created by process P before fork() ..." and
 * return SGM_ERR_UNSUPPORTED. */
int sgm__context_fork_error(const sgm_context *ctx, const char *fn);

/* Replace the idle-trim clock (tests); NULL restores the monotonic clock. */
void sgm__context_set_clock(sgm_context *ctx, uint64_t (*clock_ms)(void *user), void *user);
/* One idle-trim pass over the tiers at the clock's time; bytes returned. */
uint64_t sgm__context_idle_tick(sgm_context *ctx);

/* placement.c, buffer.c, residency.c, migrate.c, prefetch.c — buffers,
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
/* buffer.c, tests: where a disk-resident buffer's extent starts in the spill
 * file; false (and *offset 0) when it is not on disk or has no extent yet.
 * Waits while another thread moves b. */
bool sgm__buffer_disk_offset(sgm_buffer *b, uint64_t *offset);

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
/* hooks.c — the framework hooks' lazily created per-device contexts. */

/* Tests only: destroy every hook context and zero the creation count. No
 * other thread may be using the hooks meanwhile. */
void sgm__hooks_reset_for_tests(void);
/* Hook contexts created since start (or the last reset). */
uint64_t sgm__hooks_n_created(void);

#endif /* SGM_INTERNAL_H */
