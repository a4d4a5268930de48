/*
 * driver.c — replays a trace through sgm's real buffer API on the emulated
 * device, one context per policy.
 *
 * The context is made so that VRAM is exactly the capacity asked for: growth
 * off with the budget reserved as one contiguous chunk (SGM_VRAM_VMM off: no
 * chunk rounding, no granules; see replay_sgm's note on why), budget
 * fraction 1 of an emulated device at least that big, no idle trim, no log
 * output. The shared tier gets enough room for the whole trace unless told
 * otherwise; the disk tier only with a spill directory. After create the
 * driver checks that the budget it got is the one it asked for (the
 * environment can cap it: CUDA_DEVICE_MEMORY_LIMIT, TF_FORCE_GPU_ALLOW_GROWTH).
 *
 * cfg.policy names the policy of every tier; a per-tier override in the
 * environment (SGM_POLICY_VRAM, SGM_POLICY_SHARED) would win over it, so
 * sgm-replay's main() unsets those.
 *
 * Before the timed loop (unless cold) the context is warmed up: the shared
 * pool committed and the emulated VRAM faulted in (see the two functions).
 *
 * Per access: hit = sgm_buffer_tier() is VRAM before the acquire; then
 * acquire and release (create first on the block's first access: a miss).
 * Per free: destroy. The buffer handles live in an array indexed by dense id.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "replay.h"
#include "sgm.h"

/* The emulated device must be at least this big (SGM_EMU_VRAM's lower bound). */
#define DRIVER_MIN_EMU_BYTES (UINT64_C(1) << 20)
/* Progress is reported every this many events (a power of two: a mask test). */
#define DRIVER_PROGRESS_EVERY 65536u

static double driver_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t replay_default_shared_bytes(const replay_trace *t) {
  /* The whole footprint may be demoted at once; a quarter more and 64 MiB
   * absorb the rounding of growth chunks and fragmentation between them. */
  uint64_t b = t->peak_live_bytes + t->peak_live_bytes / 4 + (UINT64_C(64) << 20);
  return (b + 0xFFFF) & ~UINT64_C(0xFFFF);
}

/* The policy registry (include/sgm/policy.h) when this sgm has one. */
#if defined(__has_include)
#if __has_include(<sgm/policy.h>)
#include <sgm/policy.h>
#define DRIVER_HAVE_REGISTRY 1
#endif
#endif

const char *const *replay_policy_names(void) {
#ifdef DRIVER_HAVE_REGISTRY
  /* Refilled on each call: policies registered since show up. */
  static const char *names[SGM_POLICY_REGISTRY_MAX + 1];
  size_t n = 0, count = sgm_policy_count();
  for (size_t i = 0; i < count && n < SGM_POLICY_REGISTRY_MAX; i++) {
    const sgm_policy_ops *ops = sgm_policy_at(i);
    if (ops && ops->name) names[n++] = ops->name;
  }
  names[n] = NULL;
  return names;
#else
  /* No registry to enumerate: the one policy every sgm has. */
  static const char *const names[] = {"lru", NULL};
  return names;
#endif
}


/*
 * Commit the shared pool before the timed loop: fill VRAM with one allocation,
 * then allocate pieces (which fall back to shared memory) until the pool has
 * committed want_bytes or is full, and free everything. Committed chunks stay
 * (growth mode returns them only on trim; idle trim is off), so the replay
 * does not pay for page-locking host memory, a once-per-process cost that
 * would otherwise dominate its time. Allocations are not buffers: no policy
 * sees any of this. Best effort: stops at the first failure.
 */
static void driver_warm_shared(sgm_context *ctx, uint64_t vram_bytes, uint64_t want_bytes) {
  /* 1 MiB pieces: small next to the 2 MiB and larger growth chunks, so every
   * chunk fills before the next is taken. */
  const size_t piece = (size_t)1 << 20;
  size_t cap = (size_t)(want_bytes / piece) + 2, n = 0;
  void **ptrs = malloc(cap * sizeof *ptrs);
  void *whole = sgm_alloc(ctx, (size_t)vram_bytes, NULL);
  if (!ptrs || !whole) goto out;
  sgm_stats s;
  while (n < cap && sgm_get_stats(ctx, &s) == SGM_OK &&
         s.tier[SGM_TIER_SHARED].committed_bytes < want_bytes) {
    void *q = sgm_alloc(ctx, piece, NULL);
    if (!q) break;
    ptrs[n++] = q;
  }
out:
  while (n) sgm_free(ctx, ptrs[--n], NULL);
  if (whole) sgm_free(ctx, whole, NULL);
  free(ptrs);
}

/*
 * Touch the first touch_bytes of VRAM: the emulated device's memory is an
 * anonymous mapping whose pages the OS supplies (and zeroes) on first write,
 * a cost a real GPU's memory does not have. One buffer of the whole budget is
 * created in the empty VRAM, written once and destroyed: the policy sees one
 * insert, one access and one removal, no eviction (a policy that ages by
 * event counts, like lfu, is shifted by those events). Best effort.
 */
static void driver_warm_vram(sgm_context *ctx, uint64_t vram_bytes, uint64_t touch_bytes) {
  sgm_buffer *b = NULL;
  /* calloc'd: untouched zero pages, so the source costs nothing to read. */
  void *zeros = calloc(1, (size_t)touch_bytes);
  if (zeros && sgm_buffer_create(ctx, (size_t)vram_bytes, &b) == SGM_OK &&
      sgm_buffer_tier(b) == SGM_TIER_VRAM)
    (void)sgm_buffer_write(b, 0, zeros, (size_t)touch_bytes);
  sgm_buffer_destroy(b);
  free(zeros);
}

/* The configuration of a replay: the emulated device, growth off (the VRAM
 * budget exact and reserved), the shared budget given or enough for the trace. */
static void driver_config(const replay_trace *t, const replay_sgm_params *p, uint64_t vram,
                          sgm_config *cfg) {
  sgm_config_init(cfg);
  cfg->backend = SGM_BACKEND_EMU;
  cfg->allow_growth = 0;
  cfg->vram_fraction = 1.0;
  cfg->vram_limit = (sgm_size){.bytes = vram, .fraction = 0};
  cfg->emu_vram_bytes = vram > DRIVER_MIN_EMU_BYTES ? vram : DRIVER_MIN_EMU_BYTES;
  uint64_t shared = p->shared_bytes ? p->shared_bytes : replay_default_shared_bytes(t);
  cfg->shared_limit = (sgm_size){.bytes = shared, .fraction = 0};
  cfg->shared_fallback = 1;
  cfg->idle_trim_ms = 0;
  cfg->verbose = 0;
  cfg->emu_fail_at = 0;
  /* One contiguous chunk, not reserve mode's pool of granules on the
   * virtual-memory API (the default past 32 granules since b03984e): there a
   * block holds memory only through the 2 MiB granules it touches, so the
   * tier is full while the blocks live in it add up to less than the budget
   * (freed blocks leave partly used granules behind; the last partial granule
   * is dropped when the device has no room for it). On the conversation trace
   * at 18279 blocks of 4 KiB that was ~17400 blocks' worth: LRU read 27.25%
   * instead of the reference 27.84%. A replay compares policies at an exact
   * capacity; test_replay's test_lru_exact_past_granules pins it. */
  cfg->vram_vmm = 0;
  snprintf(cfg->policy, sizeof cfg->policy, "%s", p->policy);
  snprintf(cfg->spill_dir, sizeof cfg->spill_dir, "%s", p->spill_dir ? p->spill_dir : "");
}

int replay_check_room(const replay_trace *t, const replay_sgm_params *p, char *err, size_t err_len) {
  uint64_t vram = p->vram_bytes / REPLAY_ALIGN * REPLAY_ALIGN;
  sgm_config cfg;
  driver_config(t, p, vram, &cfg);
  /* Growth on and nothing allocated: the probe reserves and pins nothing. */
  cfg.allow_growth = 1;
  sgm_context *ctx = NULL;
  sgm_status st = sgm_context_create(&cfg, &ctx);
  if (st != SGM_OK)
    return replay_fail(err, err_len, "cannot create an sgm context for the replay: %s (%s)",
                       sgm_last_error(), sgm_status_string(st));
  sgm_stats s;
  st = sgm_get_stats(ctx, &s);
  sgm_context_destroy(ctx);
  if (st != SGM_OK) return replay_fail(err, err_len, "sgm_get_stats: %s", sgm_last_error());
  char a[32], b[32], c[32], d[32], r[32];
  uint64_t room[SGM_TIER_COUNT];
  for (int k = 0; k < SGM_TIER_COUNT; k++) room[k] = s.tier[k].budget_bytes;
  /* The emulated device's VRAM is host memory the replay fills. */
  if (s.physical_ram_bytes && room[SGM_TIER_VRAM] > s.physical_ram_bytes)
    return replay_fail(err, err_len, "the VRAM capacity (%s) is more than this machine's RAM (%s), "
                       "which the emulated device's VRAM is made of: give a smaller --vram or "
                       "--vram-blocks", replay_fmt_bytes(room[SGM_TIER_VRAM], a, sizeof a),
                       replay_fmt_bytes(s.physical_ram_bytes, r, sizeof r));
  uint64_t total = room[SGM_TIER_VRAM] + room[SGM_TIER_SHARED];
  total = total + room[SGM_TIER_DISK] < total ? UINT64_MAX : total + room[SGM_TIER_DISK];
  if (t->peak_live_bytes > total)
    return replay_fail(err, err_len, "the trace's footprint (%s live at its peak) cannot fit in "
                       "VRAM %s + shared memory %s + disk %s (the shared tier holds at most half "
                       "of the RAM): give a smaller --block-size, a spill folder (--spill DIR) "
                       "or a shorter trace", replay_fmt_bytes(t->peak_live_bytes, a, sizeof a),
                       replay_fmt_bytes(room[SGM_TIER_VRAM], b, sizeof b),
                       replay_fmt_bytes(room[SGM_TIER_SHARED], c, sizeof c),
                       replay_fmt_bytes(room[SGM_TIER_DISK], d, sizeof d));
  return 0;
}

/* No hint in force for a block (driver_replay_hinted's hinted[]). */
#define DRIVER_NO_HINT UINT32_MAX

/* Create block id's buffer on its first access; 0 or -1 with the message. */
static int driver_create(sgm_context *ctx, const replay_trace *t, const replay_sgm_params *p,
                         sgm_buffer **bufs, uint32_t id, size_t i, char *err, size_t err_len) {
  sgm_status st = sgm_buffer_create(ctx, (size_t)t->size[id], &bufs[id]);
  if (st == SGM_OK) return 0;
  return replay_fail(err, err_len, "policy %s: event %zu: creating a %llu-byte buffer: %s",
                     p->policy, i, (unsigned long long)t->size[id], sgm_last_error());
}

/* Acquire and release b (one access); 0 or -1 with the message. */
static int driver_use(sgm_buffer *b, const replay_sgm_params *p, size_t i, char *err,
                      size_t err_len) {
  void *dptr;
  sgm_status st = sgm_buffer_acquire(b, NULL, &dptr);
  if (st == SGM_OK) st = sgm_buffer_release(b, NULL);
  if (st == SGM_OK) return 0;
  return replay_fail(err, err_len, "policy %s: event %zu: acquire or release: %s", p->policy, i,
                     sgm_last_error());
}

/*
 * The replay with hints derived from the trace as a serving engine has them
 * (replay_sgm_params.hint_queue = N; Mooncake traces, no frees):
 *  - structure: a block created by request i names the block before it in
 *    that request as its parent (the prefix it extends);
 *  - done-with: at the end of request i, its last block (the partial one a
 *    longer turn rewrites) is done, unless a queued request uses it;
 *  - future use (N > 0): the queue holds requests i+1 .. i+N; when request j
 *    enters it, its blocks that exist and have no nearer hint are declared
 *    with sgm_will_use(distance j - i); after each use, a block that a queued
 *    request uses again is declared for the nearest such request. Nothing
 *    beyond the queue is looked at: the next use of a block is only asked
 *    whether it falls within i+1 .. i+N.
 * The hint calls are timed with the accesses (they are the engine's cost).
 */
static int driver_replay_hinted(sgm_context *ctx, const replay_trace *t, const replay_sgm_params *p,
                                sgm_buffer **bufs, replay_result *out, char *err, size_t err_len) {
  size_t n_req = t->n_req, nb = t->n_blocks ? t->n_blocks : 1;
  uint32_t q = p->hint_queue;
  uint32_t *next_req = malloc((t->n_ev ? t->n_ev : 1) * sizeof *next_req);
  uint32_t *last = malloc(nb * sizeof *last), *hinted = malloc(nb * sizeof *hinted);
  sgm_buffer **batch = malloc((t->n_ev ? t->n_ev : 1) * sizeof *batch);
  int rc = -1;
  if (!next_req || !last || !hinted || !batch) {
    replay_fail(err, err_len, "out of memory for the hint plan of %zu events", t->n_ev);
    goto out;
  }
  if (t->n_free) {
    replay_fail(err, err_len, "hints: the trace frees blocks; the hint replay takes Mooncake "
                "traces (no frees)");
    goto out;
  }
  /* The next request using each access's block (a replay device: the engine
   * sees it only through its queue, and it is only asked within N). */
  for (size_t b = 0; b < nb; b++) last[b] = DRIVER_NO_HINT, hinted[b] = DRIVER_NO_HINT;
  for (size_t r = n_req; r-- > 0;) {
    size_t e0 = t->req[r], e1 = r + 1 < n_req ? t->req[r + 1] : t->n_ev;
    for (size_t e = e0; e < e1; e++) next_req[e] = last[REPLAY_EV_ID(t->ev[e])];
    for (size_t e = e0; e < e1; e++) last[REPLAY_EV_ID(t->ev[e])] = (uint32_t)r;
  }
  double t0 = driver_now();
  uint64_t hits = 0, accesses = 0;
  for (size_t r = 0; r < n_req; r++) {
    size_t e0 = t->req[r], e1 = r + 1 < n_req ? t->req[r + 1] : t->n_ev;
    if (p->progress && (r & 1023u) == 0) p->progress(p->progress_user, out->policy, e0, t->n_ev);
    /* Requests entering the queue: all of 1..N at the start, then r + N. */
    for (size_t j = r == 0 ? 1 : r + q; q && j <= r + q && j < n_req; j++) {
      size_t k = 0, f0 = t->req[j], f1 = j + 1 < n_req ? t->req[j + 1] : t->n_ev;
      for (size_t e = f0; e < f1; e++) {
        uint32_t id = REPLAY_EV_ID(t->ev[e]);
        if (!bufs[id] || hinted[id] != DRIVER_NO_HINT) continue;
        hinted[id] = (uint32_t)j;
        batch[k++] = bufs[id];
      }
      if (k && sgm_will_use(ctx, batch, k, (uint32_t)(j - r)) != SGM_OK) {
        replay_fail(err, err_len, "policy %s: sgm_will_use: %s", p->policy, sgm_last_error());
        goto out;
      }
    }
    for (size_t e = e0; e < e1; e++) {
      uint32_t id = REPLAY_EV_ID(t->ev[e]);
      accesses++;
      if (!bufs[id]) {
        if (driver_create(ctx, t, p, bufs, id, e, err, err_len) != 0) goto out;
        sgm_buffer *parent = e > e0 ? bufs[REPLAY_EV_ID(t->ev[e - 1])] : NULL;
        if (parent && parent != bufs[id] && sgm_buffer_set_parent(bufs[id], parent) != SGM_OK) {
          replay_fail(err, err_len, "policy %s: sgm_buffer_set_parent: %s", p->policy,
                      sgm_last_error());
          goto out;
        }
      } else if (sgm_buffer_tier(bufs[id]) == SGM_TIER_VRAM) {
        hits++;
      }
      if (driver_use(bufs[id], p, e, err, err_len) != 0) goto out;
      /* The use ended its hint; a queued request that uses it again renews it. */
      uint32_t nr = next_req[e];
      hinted[id] = DRIVER_NO_HINT;
      if (q && nr != DRIVER_NO_HINT && nr <= r + q) {
        hinted[id] = nr;
        if (sgm_will_use(ctx, &bufs[id], 1, (uint32_t)(nr - r)) != SGM_OK) {
          replay_fail(err, err_len, "policy %s: sgm_will_use: %s", p->policy, sgm_last_error());
          goto out;
        }
      }
    }
    if (e1 > e0) {
      uint32_t id = REPLAY_EV_ID(t->ev[e1 - 1]);
      if (hinted[id] == DRIVER_NO_HINT && sgm_buffer_done(bufs[id]) != SGM_OK) {
        replay_fail(err, err_len, "policy %s: sgm_buffer_done: %s", p->policy, sgm_last_error());
        goto out;
      }
    }
  }
  out->seconds = driver_now() - t0;
  if (p->progress) p->progress(p->progress_user, out->policy, t->n_ev, t->n_ev);
  out->accesses = accesses;
  out->hits = hits;
  rc = 0;
out:
  free(next_req);
  free(last);
  free(hinted);
  free(batch);
  return rc;
}

int replay_sgm(const replay_trace *t, const replay_sgm_params *p, replay_result *out, char *err,
               size_t err_len) {
  memset(out, 0, sizeof *out);
  out->hint_queue = p->hints ? (int)p->hint_queue : -1;
  if (p->hints) snprintf(out->policy, sizeof out->policy, "%.20s+h%u", p->policy, (unsigned)p->hint_queue);
  else snprintf(out->policy, sizeof out->policy, "%s", p->policy);
  if (p->hints && !t->req)
    return replay_fail(err, err_len, "hints are derived from Mooncake traces (requests and their "
                       "block chains); this trace is %s", replay_format_name(t->format));
  if (strlen(p->policy) >= SGM_NAME_MAX)
    return replay_fail(err, err_len, "policy name \"%s\" is too long", p->policy);
  uint64_t vram = p->vram_bytes / REPLAY_ALIGN * REPLAY_ALIGN;
  if (vram == 0)
    return replay_fail(err, err_len, "the VRAM capacity must be at least %llu bytes",
                       (unsigned long long)REPLAY_ALIGN);

  sgm_config cfg;
  driver_config(t, p, vram, &cfg);
  uint64_t shared = cfg.shared_limit.bytes;

  sgm_context *ctx = NULL;
  sgm_status st = sgm_context_create(&cfg, &ctx);
  if (st != SGM_OK)
    return replay_fail(err, err_len, "policy %s: cannot create the sgm context: %s (%s)",
                       p->policy, sgm_last_error(), sgm_status_string(st));
  sgm_buffer **bufs = NULL;
  int rc = -1;
  double w0 = driver_now();
  if (!p->cold) {
    uint64_t want = t->peak_live_bytes > vram ? t->peak_live_bytes - vram : 0;
    driver_warm_shared(ctx, vram, want < shared ? want : shared);
    driver_warm_vram(ctx, vram, t->peak_live_bytes < vram ? t->peak_live_bytes : vram);
  }
  out->setup_seconds = driver_now() - w0;
  sgm_stats s0;
  if (sgm_get_stats(ctx, &s0) != SGM_OK) {
    replay_fail(err, err_len, "policy %s: sgm_get_stats: %s", p->policy, sgm_last_error());
    goto out;
  }
  const sgm_config *got = sgm_context_config(ctx);
  if (s0.tier[SGM_TIER_VRAM].budget_bytes != vram || got->allow_growth) {
    replay_fail(err, err_len, "policy %s: sgm gave a VRAM budget of %llu bytes (%s) instead of "
                "exactly %llu reserved: unset CUDA_DEVICE_MEMORY_LIMIT and "
                "TF_FORCE_GPU_ALLOW_GROWTH for a replay", p->policy,
                (unsigned long long)s0.tier[SGM_TIER_VRAM].budget_bytes,
                got->allow_growth ? "growth mode" : "reserved", (unsigned long long)vram);
    goto out;
  }
  bufs = calloc(t->n_blocks ? t->n_blocks : 1, sizeof *bufs);
  if (!bufs) {
    replay_fail(err, err_len, "out of memory for %u buffer handles", (unsigned)t->n_blocks);
    goto out;
  }

  if (p->hints) {
    if (driver_replay_hinted(ctx, t, p, bufs, out, err, err_len) != 0) goto out;
    goto stats;
  }
  double t0 = driver_now();
  uint64_t hits = 0, accesses = 0;
  for (size_t i = 0; i < t->n_ev; i++) {
    uint32_t e = t->ev[i], id = REPLAY_EV_ID(e);
    if (p->progress && (i & (DRIVER_PROGRESS_EVERY - 1)) == 0)
      p->progress(p->progress_user, p->policy, i, t->n_ev);
    if (e & REPLAY_EV_FREE) {
      sgm_buffer_destroy(bufs[id]);
      bufs[id] = NULL;
      continue;
    }
    accesses++;
    sgm_buffer *b = bufs[id];
    if (!b) {
      st = sgm_buffer_create(ctx, (size_t)t->size[id], &bufs[id]);
      if (st != SGM_OK) {
        replay_fail(err, err_len, "policy %s: event %zu: creating a %llu-byte buffer: %s",
                    p->policy, i, (unsigned long long)t->size[id], sgm_last_error());
        goto out;
      }
      b = bufs[id];
    } else if (sgm_buffer_tier(b) == SGM_TIER_VRAM) {
      hits++;
    }
    void *dptr;
    st = sgm_buffer_acquire(b, NULL, &dptr);
    if (st != SGM_OK) {
      replay_fail(err, err_len, "policy %s: event %zu: acquire of a %llu-byte buffer: %s",
                  p->policy, i, (unsigned long long)t->size[id], sgm_last_error());
      goto out;
    }
    st = sgm_buffer_release(b, NULL);
    if (st != SGM_OK) {
      replay_fail(err, err_len, "policy %s: event %zu: release: %s", p->policy, i,
                  sgm_last_error());
      goto out;
    }
  }
  out->seconds = driver_now() - t0;
  if (p->progress) p->progress(p->progress_user, p->policy, t->n_ev, t->n_ev);
  out->accesses = accesses;
  out->hits = hits;

stats:;
  sgm_stats s;
  if (sgm_get_stats(ctx, &s) != SGM_OK) {
    replay_fail(err, err_len, "policy %s: sgm_get_stats: %s", p->policy, sgm_last_error());
    goto out;
  }
  for (int k = 0; k < 3; k++) {
    out->tier_in[k] = s.tier[k].bytes_in - s0.tier[k].bytes_in;
    out->tier_out[k] = s.tier[k].bytes_out - s0.tier[k].bytes_out;
    out->tier_evictions[k] = s.tier[k].n_evictions - s0.tier[k].n_evictions;
  }
  out->bytes_promoted = out->tier_in[SGM_TIER_VRAM];
  out->bytes_demoted = out->tier_out[SGM_TIER_VRAM];
  out->evictions = out->tier_evictions[SGM_TIER_VRAM];
  rc = 0;
out:
  /* The context frees every buffer still alive. */
  free(bufs);
  sgm_context_destroy(ctx);
  return rc;
}
