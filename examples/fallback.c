/*
 * fallback.c — shared GPU memory, the story of issue 3 on any machine.
 *
 * A program asks for 1.5× its VRAM budget. On Linux CUDA the last third would
 * fail with out-of-memory; with sgm it lands in *shared GPU memory* (pinned
 * host RAM the GPU reads over the bus) and the program keeps going, slower.
 * The example shows where each block landed (sgm_pointer_tier), counts the
 * fallbacks with a callback, prints the two lines of the Windows Task
 * Manager's GPU page, then frees, trims and prints them again.
 *
 * It runs on the emulated device unless SGM_BACKEND says otherwise (and says
 * so: the emulated device is never chosen silently), with a small VRAM budget
 * (SGM_VRAM_LIMIT=64MiB unless set) so the story is quick. It never writes
 * through a device pointer: on a real GPU the CPU may not touch VRAM.
 *
 * Exit status 0 only if the story held: every block was allocated, some in
 * VRAM and some in shared memory, the callback fired once per shared block,
 * and after free + trim nothing is used or committed in shared memory.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdio.h>
#include <stdlib.h>

#include "sgm.h"

#define MiB (UINT64_C(1) << 20)

/* Blocks per VRAM budget: big enough to be tensors, small enough that the
 * budget fills block by block. */
#define BLOCKS_PER_BUDGET 8
#define MAX_BLOCKS (BLOCKS_PER_BUDGET * 3 / 2 + 1)

typedef struct fallback_log {
  unsigned n_calls;      /* fallback callbacks seen */
  uint64_t bytes;        /* sizes they reported */
} fallback_log;

/* Runs on the allocating thread, without sgm locks held; must not call back
 * into the context. */
static void on_fallback(void *user, void *ptr, size_t size) {
  fallback_log *log = user;
  log->n_calls++;
  log->bytes += size;
  printf("    (callback: %zu bytes at %p went to shared GPU memory)\n", size, ptr);
}

static void fmt(uint64_t b, char *out, size_t n) {
  if (b >= (UINT64_C(1) << 30)) snprintf(out, n, "%.2f GiB", (double)b / (double)(UINT64_C(1) << 30));
  else snprintf(out, n, "%.1f MiB", (double)b / (double)MiB);
}

/* The two lines of the Task Manager's GPU page. */
static void task_manager(sgm_context *ctx, const char *moment) {
  sgm_stats st;
  if (sgm_get_stats(ctx, &st) != SGM_OK) {
    fprintf(stderr, "fallback: sgm_get_stats: %s\n", sgm_last_error());
    return;
  }
  static const char *const names[] = {"Dedicated GPU memory", "Shared GPU memory"};
  printf("  %s:\n", moment);
  for (int t = SGM_TIER_VRAM; t <= SGM_TIER_SHARED; t++) {
    char used[32], budget[32], committed[32];
    fmt(st.tier[t].used_bytes, used, sizeof used);
    fmt(st.tier[t].budget_bytes, budget, sizeof budget);
    fmt(st.tier[t].committed_bytes, committed, sizeof committed);
    printf("    %-21s %10s / %-10s  (committed %s, %llu live)\n", names[t], used, budget,
           committed, (unsigned long long)st.tier[t].n_live);
  }
  printf("    fallbacks so far: %llu (%llu bytes)\n", (unsigned long long)st.n_fallbacks,
         (unsigned long long)st.fallback_bytes);
}

int main(void) {
  /* Line-buffered, so sgm's stderr notices interleave where they happen. */
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!getenv("SGM_BACKEND")) {
    setenv("SGM_BACKEND", "emu", 1);
    printf("SGM_BACKEND is not set: using the emulated device (SGM_BACKEND=emu); "
           "set SGM_BACKEND=cuda to run on a GPU\n");
  }
  setenv("SGM_VRAM_LIMIT", "64MiB", 0);

  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) {
    fprintf(stderr, "fallback: cannot create a context: %s\n", sgm_last_error());
    return 1;
  }
  fallback_log log = {0};
  if (sgm_set_fallback_callback(ctx, on_fallback, &log) != SGM_OK) {
    fprintf(stderr, "fallback: cannot register the callback: %s\n", sgm_last_error());
    sgm_context_destroy(ctx);
    return 1;
  }

  sgm_stats st;
  sgm_get_stats(ctx, &st);
  uint64_t budget = st.tier[SGM_TIER_VRAM].budget_bytes;
  uint64_t block = budget / BLOCKS_PER_BUDGET;
  int n_blocks = (int)((budget * 3 / 2 + block - 1) / block);
  if (block == 0 || n_blocks > MAX_BLOCKS) {
    fprintf(stderr, "fallback: a VRAM budget of %llu bytes is too small for the story\n",
            (unsigned long long)budget);
    sgm_context_destroy(ctx);
    return 1;
  }
  char b[32], s[32], blk[32];
  fmt(budget, b, sizeof b);
  fmt(st.tier[SGM_TIER_SHARED].budget_bytes, s, sizeof s);
  fmt(block, blk, sizeof blk);
  printf("backend %s: VRAM budget %s, shared GPU memory budget %s\n", sgm_context_backend(ctx),
         b, s);
  printf("allocating %d blocks of %s = 1.5x the VRAM budget:\n", n_blocks, blk);

  void *p[MAX_BLOCKS] = {0};
  int n_tier[SGM_TIER_COUNT] = {0}, n_failed = 0;
  for (int i = 0; i < n_blocks; i++) {
    p[i] = sgm_alloc(ctx, (size_t)block, NULL);
    if (!p[i]) {
      printf("  block %2d: FAILED: %s\n", i + 1, sgm_last_error());
      n_failed++;
      continue;
    }
    sgm_tier t = sgm_pointer_tier(ctx, p[i]);
    if (t >= 0 && t < SGM_TIER_COUNT) n_tier[t]++;
    const char *where = t == SGM_TIER_VRAM     ? "dedicated GPU memory (VRAM)"
                        : t == SGM_TIER_SHARED ? "shared GPU memory (pinned host RAM)"
                                               : sgm_tier_name(t);
    printf("  block %2d: %s\n", i + 1, where);
  }
  task_manager(ctx, "with all blocks live");
  sgm_get_stats(ctx, &st);
  uint64_t n_fallbacks = st.n_fallbacks;

  for (int i = 0; i < n_blocks; i++) sgm_free(ctx, p[i], NULL);
  sgm_trim(ctx);
  task_manager(ctx, "after free + sgm_trim");
  sgm_get_stats(ctx, &st);

  int ok = 1;
#define CHECK(cond, what)                       \
  do {                                          \
    if (!(cond)) {                              \
      printf("  story broken: %s\n", what);     \
      ok = 0;                                   \
    }                                           \
  } while (0)
  CHECK(n_failed == 0, "an allocation failed");
  CHECK(n_tier[SGM_TIER_VRAM] > 0, "no block landed in VRAM");
  CHECK(n_tier[SGM_TIER_SHARED] > 0, "no block landed in shared GPU memory");
  CHECK(log.n_calls == (unsigned)n_tier[SGM_TIER_SHARED],
        "the callback did not fire once per shared block");
  CHECK(n_fallbacks == (uint64_t)n_tier[SGM_TIER_SHARED],
        "stats do not count one fallback per shared block");
  CHECK(st.tier[SGM_TIER_VRAM].used_bytes == 0 && st.tier[SGM_TIER_SHARED].used_bytes == 0,
        "memory still in use after freeing everything");
  CHECK(st.tier[SGM_TIER_SHARED].committed_bytes == 0,
        "shared GPU memory still committed after sgm_trim");
  printf("%d blocks in VRAM, %d in shared GPU memory, %u fallback callbacks: %s\n",
         n_tier[SGM_TIER_VRAM], n_tier[SGM_TIER_SHARED], log.n_calls,
         ok ? "the program slowed down instead of failing" : "FAILED");
  sgm_context_destroy(ctx);
  return ok ? 0 : 1;
}
