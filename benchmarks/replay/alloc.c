/*
 * alloc.c — replays a trace as an allocation stream through sgm's public
 * allocation API (sgm_alloc / sgm_free) on the emulated device, and finds the
 * smallest reserved VRAM budget that serves it. Used by sgm-alloc-replay
 * (alloc_main.c) and tests/unit/test_replay.c. Figures: docs/benchmarks.md.
 *
 * Model: a block's first access is its sgm_alloc (of its size, on the legacy
 * stream), its free event is its sgm_free; later accesses are ignored (they
 * touch memory, not the allocator). Blocks alive at the end are freed after
 * the stream. MiniMalloc traces thus become exactly the README's online
 * replay: an allocation at `lower`, a free at `upper`, frees first at equal
 * times (trace.c orders them so).
 *
 * A run is served when every allocation lands in VRAM: an allocation that
 * falls back to shared memory (sgm_pointer_tier) or fails ends the run. The
 * shared tier is kept small (REPLAY_ALLOC_SHARED_BYTES) so that a fallback is
 * cheap: its first chunk is all a failed run ever commits there.
 *
 * Threading: none.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "replay.h"
#include "sgm.h"

/* The emulated device is never smaller than SGM_EMU_VRAM's lower bound. */
#define ALLOC_MIN_EMU_BYTES (UINT64_C(1) << 20)
/* Shared budget of every run: a fallback ends the run, so this only has to
 * hold the one allocation that fell back; 64 MiB is the tier's floor. */
#define REPLAY_ALLOC_SHARED_BYTES (UINT64_C(64) << 20)

static double alloc_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}


uint64_t replay_alloc_growth_budget(const replay_trace *t) {
  /* Room enough that growth never meets the budget: twice the footprint
   * (chunk growth commits at most about that) and 1 GiB for small traces. */
  return (t->peak_live_bytes * 2 + (UINT64_C(1) << 30)) & ~(REPLAY_ALIGN - 1);
}

int replay_alloc(const replay_trace *t, const replay_alloc_params *p, replay_alloc_result *out,
                 char *err, size_t err_len) {
  memset(out, 0, sizeof *out);
  uint64_t vram = p->vram_bytes ? p->vram_bytes / REPLAY_ALIGN * REPLAY_ALIGN
                                : replay_alloc_growth_budget(t);
  if (vram == 0)
    return replay_fail(err, err_len, "the VRAM budget must be at least %llu bytes",
                      (unsigned long long)REPLAY_ALIGN);
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = p->cuda ? SGM_BACKEND_CUDA : SGM_BACKEND_EMU;
  cfg.allow_growth = p->growth ? 1 : 0;
  cfg.vram_fraction = 1.0;
  cfg.vram_limit = (sgm_size){.bytes = vram, .fraction = 0};
  cfg.emu_vram_bytes = vram > ALLOC_MIN_EMU_BYTES ? vram : ALLOC_MIN_EMU_BYTES;
  cfg.shared_limit = (sgm_size){.bytes = REPLAY_ALLOC_SHARED_BYTES, .fraction = 0};
  cfg.shared_fallback = 1;
  cfg.idle_trim_ms = 0;
  cfg.verbose = 0;
  cfg.emu_fail_at = 0;
  if (p->vmm >= 0) cfg.vram_vmm = p->vmm;

  sgm_context *ctx = NULL;
  sgm_status st = sgm_context_create(&cfg, &ctx);
  if (st != SGM_OK)
    return replay_fail(err, err_len, "cannot create the sgm context (VRAM %llu bytes, %s): %s (%s)",
                      (unsigned long long)vram, p->growth ? "growth" : "reserved",
                      sgm_last_error(), sgm_status_string(st));
  void **ptr = calloc(t->n_blocks ? t->n_blocks : 1, sizeof *ptr);
  int rc = -1;
  sgm_stats s;
  if (!ptr) {
    replay_fail(err, err_len, "out of memory for %u pointers", (unsigned)t->n_blocks);
    goto out;
  }
  if (sgm_get_stats(ctx, &s) != SGM_OK || s.tier[SGM_TIER_VRAM].budget_bytes != vram ||
      sgm_context_config(ctx)->allow_growth != cfg.allow_growth) {
    replay_fail(err, err_len, "sgm did not give the VRAM budget asked for (%llu bytes, %s): "
               "unset CUDA_DEVICE_MEMORY_LIMIT and TF_FORCE_GPU_ALLOW_GROWTH for a replay",
               (unsigned long long)vram, p->growth ? "growth" : "reserved");
    goto out;
  }
  out->vmm = s.vram_granule_bytes != 0;
  out->served = true;
  unsigned passes = p->passes ? p->passes : 1;
  if (passes > REPLAY_ALLOC_MAX_PASSES) passes = REPLAY_ALLOC_MAX_PASSES;
  double t0 = alloc_now();
  for (unsigned pass = 0; pass < passes; pass++) {
    replay_alloc_pass *pr = &out->pass[pass];
    sgm_get_stats(ctx, &s);
    uint64_t calls0 = s.driver_calls, maps0 = s.vram_map_calls;
    for (size_t i = 0; i < t->n_ev; i++) {
      uint32_t e = t->ev[i], b = REPLAY_EV_ID(e);
      if (e & REPLAY_EV_FREE) {
        sgm_free(ctx, ptr[b], p->stream);
        ptr[b] = NULL;
        pr->events++;
        continue;
      }
      if (ptr[b]) continue; /* a later use: no allocator event */
      ptr[b] = sgm_alloc(ctx, (size_t)t->size[b], p->stream);
      pr->events++;
      if (!ptr[b] || (p->stop_on_fallback && sgm_pointer_tier(ctx, ptr[b]) != SGM_TIER_VRAM)) {
        out->served = false;
        if (p->stop_on_fallback) break;
      }
      if (p->sample) {
        sgm_get_stats(ctx, &s);
        uint64_t c = s.tier[SGM_TIER_VRAM].committed_bytes;
        if (c > out->peak_committed_bytes) out->peak_committed_bytes = c;
      }
    }
    if (pass + 1 == passes) {
      out->seconds = alloc_now() - t0;
      sgm_get_stats(ctx, &s);
      out->end_committed_bytes = s.tier[SGM_TIER_VRAM].committed_bytes;
    }
    for (uint32_t b = 0; b < t->n_blocks; b++)
      if (ptr[b]) {
        sgm_free(ctx, ptr[b], p->stream);
        ptr[b] = NULL;
        pr->events++;
      }
    sgm_get_stats(ctx, &s);
    pr->driver_calls = s.driver_calls - calls0;
    pr->map_calls = s.vram_map_calls - maps0;
    out->events += pr->events;
    if (!out->served && p->stop_on_fallback) break;
  }
  sgm_get_stats(ctx, &s);
  out->peak_used_bytes = s.tier[SGM_TIER_VRAM].peak_used_bytes;
  out->n_fallbacks = s.n_fallbacks;
  out->idle_committed_bytes = s.tier[SGM_TIER_VRAM].committed_bytes;
  sgm_trim(ctx);
  sgm_get_stats(ctx, &s);
  out->trimmed_committed_bytes = s.tier[SGM_TIER_VRAM].committed_bytes;
  if (s.n_fallbacks) out->served = false;
  rc = 0;
out:
  free(ptr);
  sgm_context_destroy(ctx);
  return rc;
}

int replay_alloc_min_budget(const replay_trace *t, int vmm, uint64_t *budget_out,
                            unsigned *n_runs, char *err, size_t err_len) {
  *budget_out = 0;
  *n_runs = 0;
  replay_alloc_params p = {.growth = false, .stop_on_fallback = true, .vmm = vmm};
  replay_alloc_result r;
  /* Nothing below the footprint can serve; find a budget that does by doubling. */
  uint64_t lo = t->peak_live_bytes ? t->peak_live_bytes : REPLAY_ALIGN, hi = lo;
  for (;;) {
    p.vram_bytes = hi;
    if (replay_alloc(t, &p, &r, err, err_len) != 0) return -1;
    ++*n_runs;
    if (r.served) break;
    if (hi > REPLAY_MAX_BLOCK_BYTES)
      return replay_fail(err, err_len, "no budget up to %llu bytes serves the trace",
                        (unsigned long long)hi);
    lo = hi + REPLAY_ALIGN;
    hi *= 2;
  }
  /* Served at hi; find the smallest served budget in [lo, hi], to 1/4096 of
   * the footprint (a finer step changes the ratio past its third decimal only). */
  uint64_t step = t->peak_live_bytes / 4096 / REPLAY_ALIGN * REPLAY_ALIGN;
  if (step < REPLAY_ALIGN) step = REPLAY_ALIGN;
  while (lo < hi && hi - lo >= step) {
    uint64_t mid = (lo + (hi - lo) / 2) / REPLAY_ALIGN * REPLAY_ALIGN;
    if (mid < lo) mid = lo;
    p.vram_bytes = mid;
    if (replay_alloc(t, &p, &r, err, err_len) != 0) return -1;
    ++*n_runs;
    if (r.served) hi = mid;
    else lo = mid + REPLAY_ALIGN;
  }
  *budget_out = hi;
  return 0;
}

int replay_alloc_granule_cost(int backend, int vmm, unsigned granules, unsigned n, double *ns_out,
                              uint64_t *granule_out, char *err, size_t err_len) {
  *ns_out = 0;
  *granule_out = 0;
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = (sgm_backend_kind)backend;
  cfg.allow_growth = 1;
  cfg.vram_vmm = vmm;
  cfg.vram_limit = (sgm_size){.bytes = UINT64_C(256) << 20, .fraction = 0};
  cfg.emu_vram_bytes = UINT64_C(256) << 20;
  cfg.shared_fallback = 0;
  cfg.idle_trim_ms = 0;
  cfg.verbose = 0;
  sgm_context *ctx = NULL;
  sgm_status st = sgm_context_create(&cfg, &ctx);
  if (st != SGM_OK)
    return replay_fail(err, err_len, "cannot create the sgm context: %s (%s)", sgm_last_error(),
                      sgm_status_string(st));
  sgm_stats s;
  sgm_get_stats(ctx, &s);
  *granule_out = s.vram_granule_bytes;
  size_t bytes = (s.vram_granule_bytes ? (size_t)s.vram_granule_bytes : (size_t)2 << 20) * granules;
  int rc = 0;
  double t0 = alloc_now();
  for (unsigned i = 0; i < n; i++) {
    void *p = sgm_alloc(ctx, bytes, NULL);
    if (!p) {
      rc = replay_fail(err, err_len, "sgm_alloc of %zu bytes failed: %s", bytes, sgm_last_error());
      break;
    }
    sgm_free(ctx, p, NULL);
    sgm_trim(ctx);
  }
  *ns_out = n ? (alloc_now() - t0) * 1e9 / n : 0;
  sgm_get_stats(ctx, &s);
  if (rc == 0 && s.tier[SGM_TIER_VRAM].committed_bytes != 0)
    rc = replay_fail(err, err_len, "sgm_trim left %llu bytes committed",
                    (unsigned long long)s.tier[SGM_TIER_VRAM].committed_bytes);
  sgm_context_destroy(ctx);
  return rc;
}
