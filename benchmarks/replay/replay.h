/*
 * replay.h — the core of sgm-replay: trace readers, Belady's OPT, and the
 * driver that replays a trace through the real buffer API of sgm on the
 * emulated device. main.c is only the command line around it; the unit test
 * (tests/unit/test_replay.c) links the same core.
 *
 * A trace, once read, is a list of events over *dense* block ids 0..n_blocks-1:
 * an access (acquire + release; the first access creates the buffer) or a free
 * (destroy). A block id names one buffer lifetime: an id of the file that is
 * freed and accessed again becomes a new dense block. Formats: docs/traces.md.
 *
 * Errors: functions return 0 on success, -1 on failure with a message (that
 * names the file and line for input errors) in err[REPLAY_ERR_MAX].
 *
 * Threading: none; every object is used by one thread.
 */
#ifndef SGM_REPLAY_H
#define SGM_REPLAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define REPLAY_ERR_MAX 512
/* sgm rounds every block to 256 bytes (the cudaMalloc alignment it promises,
 * sgm.h): OPT charges blocks the same way so that capacities compare. */
#define REPLAY_ALIGN UINT64_C(256)
/* The largest block a trace may name: 256 TiB, past any device, and small enough
 * that rounding to REPLAY_ALIGN cannot wrap. */
#define REPLAY_MAX_BLOCK_BYTES (UINT64_C(1) << 48)
/* Mooncake blocks and own-CSV accesses without a size: 4 KiB, the target of
 * issue 5 (one 512-token prefix block scaled down so the whole trace fits). */
#define REPLAY_DEFAULT_BLOCK_BYTES UINT64_C(4096)
/* An event: the dense block id, with this bit set for a free. */
#define REPLAY_EV_FREE UINT32_C(0x80000000)
#define REPLAY_EV_ID(e) ((e) & ~REPLAY_EV_FREE)
/* Dense ids stay below this (the top bit marks frees). */
#define REPLAY_MAX_BLOCKS (REPLAY_EV_FREE - 1u)

typedef enum replay_format {
  REPLAY_FMT_UNKNOWN = 0,
  REPLAY_FMT_CSV,       /* own CSV: header op,id,size */
  REPLAY_FMT_MINIMALLOC, /* header id,lower,upper,size */
  REPLAY_FMT_MOONCAKE   /* JSON Lines with hash_ids */
} replay_format;

/* Write a message into err (as snprintf) and return -1: the error convention above. */
int replay_fail(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* "csv", "minimalloc", "mooncake", "unknown". */
const char *replay_format_name(replay_format f);

typedef struct replay_trace {
  replay_format format;     /* what the file was read as */
  uint32_t *ev;             /* events in replay order: dense id | REPLAY_EV_FREE */
  size_t n_ev;              /* events used */
  size_t cap_ev;            /* events allocated */
  uint64_t *size;           /* bytes of each dense block, as given by the trace */
  uint32_t n_blocks;        /* dense blocks (buffer lifetimes) */
  uint32_t cap_blocks;      /* entries allocated in size */
  uint64_t n_access;        /* access events */
  uint64_t n_free;          /* free events */
  uint64_t uniform_bytes;   /* the size every block has; 0 when sizes differ */
  uint64_t total_bytes;     /* sum of every block's size (rounded to REPLAY_ALIGN) */
  uint64_t peak_live_bytes; /* most bytes alive at once (rounded): the footprint */
  /* Mooncake only (else NULL / 0): where each request's accesses start in ev,
   * in file order, its hash_ids in order (a block chain: each extends the one
   * before). The hint replay (replay_sgm's hint_queue) derives hints from them. */
  size_t *req;
  size_t n_req;
  size_t cap_req;
} replay_trace;

/* Tell the format from the first non-blank line of the file. */
int replay_detect_format(const char *path, replay_format *out, char *err, size_t err_len);

/*
 * Read a trace. block_bytes: the size of every Mooncake block and of own-CSV
 * accesses that give no size (0 = REPLAY_DEFAULT_BLOCK_BYTES); MiniMalloc
 * sizes come from the file. On failure *t is empty (replay_trace_free-able).
 */
int replay_trace_load(const char *path, uint64_t block_bytes, replay_trace *t, char *err,
                      size_t err_len);
/* The same with a known format (the readers on their own). */
int replay_trace_load_as(const char *path, replay_format fmt, uint64_t block_bytes,
                         replay_trace *t, char *err, size_t err_len);
void replay_trace_free(replay_trace *t);
/* Fill n_access, n_free, uniform_bytes, total_bytes and peak_live_bytes from
 * ev, size and n_blocks (the readers call it; tests that build a trace by hand,
 * with malloc'd ev and size, too). */
int replay_trace_finish(replay_trace *t, char *err, size_t err_len);

/* What one replay (a policy through sgm, or OPT) measured. */
typedef struct replay_result {
  char policy[32];          /* "lru", ..., "opt-admit", "opt"; "lru+h64": with hints, N = 64 */
  int hint_queue;           /* replay_sgm_params.hint_queue with hints; -1 = no hints */
  uint64_t accesses;        /* block accesses replayed */
  uint64_t hits;            /* accesses that found the block in VRAM */
  uint64_t evictions;       /* blocks moved out of VRAM to make room */
  uint64_t bypassed;        /* OPT only: misses left in the slower tier (not cached) */
  uint64_t bytes_promoted;  /* bytes moved into VRAM (from shared memory or disk) */
  uint64_t bytes_demoted;   /* bytes moved out of VRAM */
  uint64_t tier_in[3];      /* per tier (vram, shared, disk): bytes migrated in */
  uint64_t tier_out[3];     /* per tier: bytes migrated out */
  uint64_t tier_evictions[3]; /* per tier: buffers moved out to make room */
  double seconds;           /* wall time of the replay loop (no setup, no teardown) */
  double setup_seconds;     /* sgm: committing the shared pool before the loop (not timed) */
} replay_result;

static inline double replay_hit_ratio(const replay_result *r) {
  return r->accesses ? (double)r->hits / (double)r->accesses : 0.0;
}

/* Which Belady (opt.c's comment has the details). */
typedef enum replay_opt_variant {
  /* "opt": a missed block whose next use is no nearer than every cached
   * block's is not cached (it stays in the slower tier); else evict by
   * furthest next use. The upper bound on every policy, admission included. */
  REPLAY_OPT_BYPASS = 0,
  /* "opt-admit": every missed block enters (demand fetching); evict by
   * furthest next use. The bound on policies that admit everything. */
  REPLAY_OPT_ADMIT = 1
} replay_opt_variant;

/*
 * Belady's OPT by simulation (no sgm): a cache of capacity_bytes; a block
 * larger than the capacity is never cached; on a miss with no room, the
 * variant decides whether the block enters, then the cached blocks whose next
 * use is furthest away (never-used-again first) leave until it fits
 * ("Belady-size": exact for equal sizes, a heuristic for unequal sizes).
 * Sizes are rounded up to REPLAY_ALIGN as sgm rounds them. O(n log n): next
 * uses precomputed backwards, a binary max-heap with lazy deletion.
 * replay_opt is replay_opt_ex with REPLAY_OPT_BYPASS.
 */
int replay_opt(const replay_trace *t, uint64_t capacity_bytes, replay_result *out, char *err,
               size_t err_len);
int replay_opt_ex(const replay_trace *t, uint64_t capacity_bytes, replay_opt_variant variant,
                  replay_result *out, char *err, size_t err_len);

/* Called every few thousand events during a replay; done of total events. */
typedef void (*replay_progress_fn)(void *user, const char *policy, size_t done, size_t total);

typedef struct replay_sgm_params {
  const char *policy;        /* sgm_config.policy */
  uint64_t vram_bytes;       /* the VRAM budget (exact: growth off, one reserved range) */
  uint64_t shared_bytes;     /* the shared budget; 0 = enough for the whole trace */
  const char *spill_dir;     /* NULL or "" = no disk tier */
  bool cold;                 /* true: do not commit the shared pool before the timed loop */
  /* Residency hints derived from the trace as a serving engine has them
   * (Mooncake traces only; docs/traces.md "Hints"): false = none; true = the
   * structure (each block's parent: the block before it in its request), the
   * request's last block done at its end, and, with hint_queue N > 0, the
   * blocks of the next N requests declared with sgm_will_use (distance: how
   * many requests ahead), never more of the future than that queue. */
  bool hints;
  uint32_t hint_queue;
  replay_progress_fn progress; /* NULL = none */
  void *progress_user;       /* its argument */
} replay_sgm_params;

/*
 * Replay t through sgm's buffer API on the emulated device with policy p->policy:
 * for each access, a hit when sgm_buffer_tier() says VRAM, then acquire and
 * release (create first on the block's first access, a miss); for each free,
 * destroy. Counters come from sgm_get_stats.
 */
int replay_sgm(const replay_trace *t, const replay_sgm_params *p, replay_result *out, char *err,
               size_t err_len);

/* The shared budget replay_sgm uses when none is given: the footprint and room
 * for chunk rounding. */
uint64_t replay_default_shared_bytes(const replay_trace *t);

/*
 * The eviction policies sgm knows, for --policy all: sgm's policy registry
 * (sgm_policy_count / sgm_policy_at) where this sgm has one, else {"lru"}. A
 * NULL-terminated array of names, valid until the next call.
 */
const char *const *replay_policy_names(void);

/* ---- sgm-replay's command line (args.c) ---- */

/* What sgm-replay's options say; strings point into argv. */
typedef struct replay_args {
  const char *policy_arg;  /* --policy (default "all") */
  const char *vram_arg;    /* --vram as given, NULL if not */
  const char *blocks_arg;  /* --vram-blocks as given, NULL if not */
  const char *spill_dir;   /* --spill ("" = no disk tier) */
  const char *path;        /* the trace */
  const char *hints_arg;   /* --hints as given (main parses the list), NULL if not */
  bool json, cold;         /* --json, --cold */
  bool block_given;        /* --block-size was given */
  uint64_t block_bytes;    /* --block-size (0 = the format's default) */
  uint64_t shared_bytes;   /* --shared (0 = enough for the whole trace) */
  uint64_t vram_bytes;     /* --vram in bytes (0 when given as a percentage or not at all) */
  double vram_pct;         /* --vram as a percentage of the footprint, 0 if not */
  uint64_t n_blocks;       /* --vram-blocks, 0 if not */
} replay_args;

/* "4096", "4KiB", "4K", "1.5GiB", and "10%" when pct != NULL (*pct set, *bytes
 * 0). False for anything else, 2^63 bytes and more, or a fraction of a byte
 * (then *bytes = 0). */
bool replay_parse_size(const char *s, uint64_t *bytes, double *pct);

/* b as "512 B" or "1.50 GiB" in buf; returns buf. */
const char *replay_fmt_bytes(uint64_t b, char *buf, size_t n);

/* Before a replay pins anything (issue 29): 0 when the trace's footprint fits
 * in the budgets sgm gives p (VRAM + shared, clamped to half of RAM, + disk) and
 * the emulated VRAM fits in RAM; else -1 with what to change in err. */
int replay_check_room(const replay_trace *t, const replay_sgm_params *p, char *err, size_t err_len);

/* Parse argv: 0 = run, 1 = --help asked, 2 = bad usage with the reason in
 * err (one line, no "sgm-replay: " prefix). Never allocates, never prints. */
int replay_args_parse(int argc, char *const *argv, replay_args *a, char *err, size_t err_len);

/* ---- allocation streams (alloc.c) ---- */

/* One replay of a trace as sgm_alloc / sgm_free calls (alloc.c). */
typedef struct replay_alloc_params {
  bool growth;            /* true: growth mode; false: the budget reserved at create */
  uint64_t vram_bytes;    /* the VRAM budget; 0 = replay_alloc_growth_budget() */
  bool sample;            /* read the stats after every allocation (peak committed) */
  bool stop_on_fallback;  /* end the run at the first allocation not placed in VRAM */
  int vmm;                /* sgm_config.vram_vmm: -1 leave it (auto), 0 chunks, 1 auto */
  bool cuda;              /* the CUDA backend (a GPU, or the driver double) instead of the emulated device */
  void *stream;           /* the stream every alloc and free names (a CUstream; NULL = legacy) */
  unsigned passes;        /* the trace replayed this many times in one context (0 = 1): every
                             block of a pass is freed before the next starts */
} replay_alloc_params;

/* What one pass of replay_alloc cost in driver work. */
typedef struct replay_alloc_pass {
  uint64_t events;              /* allocations and frees made (the leftovers' frees included) */
  uint64_t driver_calls;        /* sgm_stats.driver_calls made during the pass (0 on emu) */
  uint64_t map_calls;           /* sgm_stats.vram_map_calls made during the pass */
} replay_alloc_pass;
#define REPLAY_ALLOC_MAX_PASSES 4

typedef struct replay_alloc_result {
  bool served;                  /* every allocation was placed in VRAM */
  int vmm;                      /* sgm_stats.vram_vmm: 1 = one reserved range, granules mapped */
  uint64_t events;              /* allocations and frees made, over every pass (the frees of
                                   blocks a pass left alive included) */
  uint64_t peak_committed_bytes; /* most VRAM committed after any allocation (sample only) */
  uint64_t peak_used_bytes;     /* sgm's peak used VRAM bytes */
  uint64_t end_committed_bytes; /* committed after the stream, before the leftovers are freed */
  uint64_t idle_committed_bytes; /* committed with every block freed, before sgm_trim */
  uint64_t trimmed_committed_bytes; /* committed after sgm_trim */
  uint64_t n_fallbacks;         /* allocations placed in shared memory */
  double seconds;               /* wall time of the stream loop */
  replay_alloc_pass pass[REPLAY_ALLOC_MAX_PASSES]; /* per pass (passes used) */
} replay_alloc_result;

/* The growth-mode budget a replay uses when none is given: 2 x footprint + 1 GiB. */
uint64_t replay_alloc_growth_budget(const replay_trace *t);

/* Replay t's allocation stream through sgm_alloc / sgm_free on the emulated
 * device, or with p->cuda on the CUDA backend (a block's first access
 * allocates it, its free frees it; later accesses are not allocator events),
 * p->passes times in one context. 0, or -1 with a message in err when no
 * context could be made; a run that was not served still returns 0. */
int replay_alloc(const replay_trace *t, const replay_alloc_params *p, replay_alloc_result *out,
                 char *err, size_t err_len);

/* The smallest reserved (growth off) budget that serves t with no fallback,
 * by doubling from the footprint and then bisecting to 1/4096 of it; vmm as
 * in replay_alloc_params. *n_runs: replays made. */
int replay_alloc_min_budget(const replay_trace *t, int vmm, uint64_t *budget_out,
                            unsigned *n_runs, char *err, size_t err_len);

/* The cost of committing and returning `granules` granules through the
 * public API: n rounds of sgm_alloc(granules x granule) + sgm_free + sgm_trim
 * on a growth-mode context of `backend` (SGM_BACKEND_EMU or
 * SGM_BACKEND_CUDA), vmm as in replay_alloc_params (on: one mapping of them
 * mapped and unmapped per round, up to 32 granules: issue 26; off: one chunk
 * allocated and freed). *ns_out: per round; *granule_out: the granule (0 with
 * chunks; the size used is then 2 MiB). */
int replay_alloc_granule_cost(int backend, int vmm, unsigned granules, unsigned n, double *ns_out,
                              uint64_t *granule_out, char *err, size_t err_len);

/* ---- synthetic streams (synth.c) ---- */

/* A PyTorch-like training stream: `iters` iterations of forward and backward
 * through a small transformer (weights and optimizer state allocated first
 * and kept; per layer activations, attention scores, MLP and dropout tensors
 * allocated in the forward pass and freed in reverse in the backward pass,
 * gradients and workspaces in between), the size mix of a GPT-2-small step
 * at batch 8 x 512 tokens, with small per-iteration variation in the
 * workspaces from a fixed seed. Fills t as replay_trace_load would. */
int replay_trace_transformer(replay_trace *t, unsigned iters, uint64_t seed, char *err,
                             size_t err_len);

#endif /* SGM_REPLAY_H */
