/*
 * demo.c — sgm's first story: a VRAM pool in growth mode and in reserve mode.
 *
 * A model-like workload (a few large weight tensors, many activation buffers
 * that come and go per step, small workspaces) allocates and frees through
 * sgm; after each phase the demo prints, like the Windows Task Manager's GPU
 * page, dedicated memory used / budget and what sgm has committed from the
 * driver, before and after sgm_trim.
 *
 * Runs on a real GPU when SGM_BACKEND=cuda; without SGM_BACKEND set it uses
 * SGM_BACKEND=auto, which says when it falls back to the emulated device.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sgm.h"

#define MiB (UINT64_C(1) << 20)

static void fmt(uint64_t b, char *out, size_t n) {
  if (b >= (UINT64_C(1) << 30)) snprintf(out, n, "%.2f GiB", (double)b / (double)(UINT64_C(1) << 30));
  else snprintf(out, n, "%.1f MiB", (double)b / (double)MiB);
}

static void task_manager(sgm_context *ctx, const char *moment) {
  sgm_stats st;
  if (sgm_get_stats(ctx, &st) != SGM_OK) return;
  const sgm_tier_stats *v = &st.tier[SGM_TIER_VRAM];
  char used[32], budget[32], comm[32], peak[32], shared[32];
  fmt(v->used_bytes, used, sizeof used);
  fmt(v->budget_bytes, budget, sizeof budget);
  fmt(v->committed_bytes, comm, sizeof comm);
  fmt(v->peak_used_bytes, peak, sizeof peak);
  fmt(st.tier[SGM_TIER_SHARED].budget_bytes, shared, sizeof shared);
  printf("  %-22s Dedicated GPU memory %10s / %-10s  committed %10s in %2llu chunks  "
         "(peak %s, %llu live)\n",
         moment, used, budget, comm, (unsigned long long)v->n_chunks, peak,
         (unsigned long long)v->n_live);
  (void)shared;
}

/* xorshift: a fixed seed so every run tells the same story. */
static uint64_t rng_state = 0x5EED5EEDull;
static uint64_t rnd(uint64_t lo, uint64_t hi) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return lo + rng_state % (hi - lo + 1);
}

static int run(const char *mode, int growth) {
  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.allow_growth = growth;
  sgm_context *ctx = NULL;
  if (sgm_context_create(&cfg, &ctx) != SGM_OK) {
    fprintf(stderr, "demo: cannot create a context: %s\n", sgm_last_error());
    return 1;
  }
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  uint64_t budget = st.tier[SGM_TIER_VRAM].budget_bytes;
  char b[32], t[32], s[32];
  fmt(budget, b, sizeof b);
  fmt(st.device_total_bytes, t, sizeof t);
  fmt(st.tier[SGM_TIER_SHARED].budget_bytes, s, sizeof s);
  printf("\n== %s (backend %s): VRAM budget %s of %s device memory; shared GPU memory budget %s ==\n",
         mode, sgm_context_backend(ctx), b, t, s);
  task_manager(ctx, "after create");

  /* Weights: 40% of the budget in 8 tensors that live for the whole run. */
  enum { N_WEIGHTS = 8, N_ACT = 200 };
  void *weights[N_WEIGHTS];
  for (int i = 0; i < N_WEIGHTS; i++) {
    weights[i] = sgm_alloc(ctx, budget * 2 / 5 / N_WEIGHTS, NULL);
    if (!weights[i]) {
      fprintf(stderr, "demo: weights: %s\n", sgm_last_error());
      return 1;
    }
  }
  task_manager(ctx, "weights loaded");

  /* Ten steps: activations of mixed sizes (4 KiB .. 8 MiB, scaled to the budget)
   * come and go; a small workspace per step. */
  void *act[N_ACT] = {0};
  uint64_t max_act = budget / 128 > 8 * MiB ? 8 * MiB : budget / 128;
  int failed = 0;
  for (int step = 0; step < 10; step++) {
    for (int i = 0; i < N_ACT; i++) {
      if (act[i] && rnd(0, 2) == 0) {
        sgm_free(ctx, act[i], NULL);
        act[i] = NULL;
      }
      if (!act[i]) {
        act[i] = sgm_alloc(ctx, rnd(4096, max_act), NULL);
        failed += act[i] == NULL;
      }
    }
    void *ws = sgm_alloc(ctx, rnd(256, 64 * 1024), NULL);
    sgm_free(ctx, ws, NULL);
    if (step == 4) task_manager(ctx, "step 5 of 10");
  }
  task_manager(ctx, "after 10 steps");
  for (int i = 0; i < N_ACT; i++) sgm_free(ctx, act[i], NULL);
  task_manager(ctx, "activations freed");
  sgm_trim(ctx);
  task_manager(ctx, "after sgm_trim");
  for (int i = 0; i < N_WEIGHTS; i++) sgm_free(ctx, weights[i], NULL);
  sgm_trim(ctx);
  task_manager(ctx, "all freed + trim");
  if (failed) printf("  (%d activation allocations did not fit the budget)\n", failed);

  /* What the allocator refuses, and how it says so. */
  void *too_big = sgm_alloc(ctx, budget + 1, NULL);
  printf("  asking for more than the budget: %s\n    -> %s\n", too_big ? "succeeded?!" : "NULL",
         sgm_last_error());
  int x;
  sgm_free_ex(ctx, &x, NULL);
  printf("  freeing a pointer sgm did not hand out:\n    -> %s\n", sgm_last_error());
  sgm_context_destroy(ctx);
  return too_big != NULL;
}

int main(void) {
  /* The emulated device is never chosen silently: auto says when it is used. */
  setenv("SGM_BACKEND", "auto", 0);
  printf("sgm demo: dedicated GPU memory as the Windows Task Manager shows it\n");
  int rc = run("growth mode (SGM_ALLOW_GROWTH=1, like TF_FORCE_GPU_ALLOW_GROWTH=true)", 1);
  rc |= run("reserve mode (SGM_ALLOW_GROWTH=0: the whole budget taken at create)", 0);
  printf("\n%s\n", rc ? "demo FAILED" : "demo done");
  return rc;
}
