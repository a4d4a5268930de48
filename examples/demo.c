/*
 * demo.c — sgm's story in two parts.
 *
 * Part 1, the VRAM pool: a model-like mix of allocations in growth mode and
 * in reserve mode, shown like the Windows Task Manager's GPU page (dedicated
 * memory used / budget, and what sgm committed), before and after sgm_trim.
 *
 * Part 2, oversubscription: a working set three times the VRAM budget, held
 * in movable buffers — the weights of an LLM's layers, swept in order every
 * step with the next layer prefetched, and KV-cache blocks of which a few are
 * hot — touched for ten steps. VRAM short, borrow RAM; RAM short, borrow disk.
 * It prints progress per step and ends with the Task-Manager view of all three
 * tiers and a byte-for-byte check of everything written.
 *
 * Runs on a real GPU when SGM_BACKEND=cuda; without SGM_BACKEND set it uses
 * SGM_BACKEND=auto, which says when it falls back to the emulated device.
 *
 * --plot out.png: samples its own sgm_get_stats at every step into out.csv
 * (docs/record-format.md, the format of sgm-smi --record) and then draws it
 * with `python3 -m sgm.plot` (SGM_PYTHON names another interpreter).
 */
#define _POSIX_C_SOURCE 200809L /* setenv, mkdtemp, clock_gettime */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sgm.h"

#define MiB (UINT64_C(1) << 20)

static void fmt(uint64_t b, char *out, size_t n) {
  if (b >= (UINT64_C(1) << 30)) snprintf(out, n, "%.2f GiB", (double)b / (double)(UINT64_C(1) << 30));
  else snprintf(out, n, "%.1f MiB", (double)b / (double)MiB);
}

static void record_sample(sgm_context *ctx);

static void task_manager(sgm_context *ctx, const char *moment) {
  record_sample(ctx);
  sgm_stats st;
  if (sgm_get_stats(ctx, &st) != SGM_OK) return;
  const sgm_tier_stats *v = &st.tier[SGM_TIER_VRAM], *sh = &st.tier[SGM_TIER_SHARED];
  char used[32], budget[32], comm[32], sused[32], sbudget[32], scomm[32];
  fmt(v->used_bytes, used, sizeof used);
  fmt(v->budget_bytes, budget, sizeof budget);
  fmt(v->committed_bytes, comm, sizeof comm);
  fmt(sh->used_bytes, sused, sizeof sused);
  fmt(sh->budget_bytes, sbudget, sizeof sbudget);
  fmt(sh->committed_bytes, scomm, sizeof scomm);
  printf("  %-20s Dedicated GPU memory %10s / %-10s (committed %10s, %2llu chunks)\n", moment, used,
         budget, comm, (unsigned long long)v->n_chunks);
  printf("  %-20s Shared GPU memory    %10s / %-10s (committed %10s)\n", "", sused, sbudget, scomm);
}

/* ---- --plot: a record of this process's memory over time ---- */

static FILE *rec_file;          /* the CSV being written; NULL without --plot */
static double rec_start_s;      /* CLOCK_MONOTONIC at the start of the record */
static uint64_t rec_fallbacks;  /* fallbacks of the contexts already destroyed */
static uint64_t rec_evictions;  /* evictions of the contexts already destroyed */
static char rec_device[64] = "emu0"; /* the last context's backend and device */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t evictions_of(const sgm_stats *st) {
  uint64_t n = 0;
  for (int t = 0; t < SGM_TIER_COUNT; t++) n += st->tier[t].n_evictions;
  return n;
}

/* One row for this process: ctx's counters now, or zeros (ctx NULL: no context live). */
static void record_sample(sgm_context *ctx) {
  if (!rec_file) return;
  sgm_stats st;
  memset(&st, 0, sizeof st);
  if (ctx) {
    if (sgm_get_stats(ctx, &st) != SGM_OK) return;
    /* The node registry's key for a shared emulated device; else backend and ordinal. */
    const sgm_config *cfg = sgm_context_config(ctx);
    if (strcmp(sgm_context_backend(ctx), "emu") == 0 && cfg->emu_device[0])
      snprintf(rec_device, sizeof rec_device, "emu-%s", cfg->emu_device);
    else
      snprintf(rec_device, sizeof rec_device, "%s%d", sgm_context_backend(ctx), cfg->device);
  }
  const sgm_tier_stats *v = &st.tier[SGM_TIER_VRAM], *sh = &st.tier[SGM_TIER_SHARED];
  /* The node's cap on shared GPU memory, as Windows sets it: max(RAM / 2, 64 MiB). */
  uint64_t cap = st.physical_ram_bytes / 2 > 64 * MiB ? st.physical_ram_bytes / 2 : 64 * MiB;
  fprintf(rec_file, "%.3f,%s,%ld,sgm-demo,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu\n",
          now_s() - rec_start_s, rec_device, (long)getpid(), (unsigned long long)v->used_bytes,
          (unsigned long long)v->budget_bytes, (unsigned long long)sh->used_bytes,
          (unsigned long long)sh->budget_bytes,
          (unsigned long long)st.tier[SGM_TIER_DISK].used_bytes,
          (unsigned long long)v->peak_used_bytes, (unsigned long long)(rec_fallbacks + st.n_fallbacks),
          (unsigned long long)(rec_evictions + evictions_of(&st)),
          (unsigned long long)st.device_total_bytes, (unsigned long long)(ctx ? cap : 0));
}

/* Destroy a context, keeping its cumulative counts in the record. */
static void destroy_recorded(sgm_context *ctx) {
  sgm_stats st;
  if (rec_file && sgm_get_stats(ctx, &st) == SGM_OK) {
    record_sample(ctx);
    rec_fallbacks += st.n_fallbacks;
    rec_evictions += evictions_of(&st);
  }
  sgm_context_destroy(ctx);
  record_sample(NULL);
}

/* Run argv (argv[0] looked up in PATH); its exit status, 127 if it could not start. */
static int run_command(char *const argv[], int quiet) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) return 127;
  if (pid == 0) {
    if (quiet) {
      if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr)) _exit(127);
    }
    execvp(argv[0], argv);
    _exit(127);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return 127;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

/* The interpreter --plot runs: $SGM_PYTHON, else python3 from PATH. */
static const char *plot_python(void) {
  return getenv("SGM_PYTHON") ? getenv("SGM_PYTHON") : "python3";
}

/* Before the run: can the interpreter import sgm.plot and matplotlib? Says
 * what is missing and returns nonzero when not, so no run is wasted. */
static int plot_check(void) {
  const char *py = plot_python();
#ifdef SGM_SOURCE_PYTHON_DIR
  /* A build tree: the package next to the sources, when no installed one answers. */
  char *check[] = {(char *)py, "-c", "import sgm.plot", NULL};
  if (run_command(check, 1) == 1 && access(SGM_SOURCE_PYTHON_DIR "/sgm/plot.py", R_OK) == 0) {
    const char *old = getenv("PYTHONPATH");
    char buf[4096];
    snprintf(buf, sizeof buf, "%s%s%s", SGM_SOURCE_PYTHON_DIR, old && *old ? ":" : "",
             old ? old : "");
    setenv("PYTHONPATH", buf, 1);
  }
#endif
  /* One import at a time, so the message names the one that is missing. */
  char *probe_mpl[] = {(char *)py, "-c", "import matplotlib", NULL};
  int rc = run_command(probe_mpl, 1);
  if (rc == 127) {
    fprintf(stderr, "demo: --plot: cannot run %s (install python3, or name an interpreter in "
            "SGM_PYTHON)\n", py);
    return rc;
  }
  if (rc != 0) {
    fprintf(stderr, "demo: --plot: %s cannot import matplotlib (apt-get install python3-matplotlib, "
            "or pip install matplotlib for that interpreter)\n", py);
    return rc;
  }
  char *probe_sgm[] = {(char *)py, "-c", "import sgm.plot", NULL};
  rc = run_command(probe_sgm, 1);
  if (rc != 0)
    fprintf(stderr, "demo: --plot: %s cannot import the sgm package (cmake --install it, or "
            "PYTHONPATH=<sgm source>/python)\n", py);
  return rc;
}

/* Draw the record with python3 -m sgm.plot; 0 when the PNG was written. */
static int plot(const char *csv, const char *png) {
  const char *py = plot_python();
  char *cmd[] = {(char *)py, "-m", "sgm.plot", (char *)csv, "-o", (char *)png, "--title",
                 "sgm-demo: dedicated, shared GPU memory and disk over the demo's run", NULL};
  int rc = run_command(cmd, 0);
  if (rc != 0) fprintf(stderr, "demo: --plot: %s -m sgm.plot failed (exit %d); the samples are in %s\n",
                       py, rc, csv);
  return rc != 0;
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
    record_sample(ctx);
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

  /* Past the VRAM budget, the block lands in shared GPU memory (rule 3),
   * when the shared budget can hold it. It cannot when the shared budget is
   * smaller than the VRAM budget: on a large GPU (an H200's ~132 GiB budget
   * against half of its 128 GiB of RAM, issue 24), or under a small
   * `ulimit -l` (sgm keeps the shared tier within the locked-memory limit,
   * issue 28). The demo says which instead of failing. */
  int wrong_tier = 0;
  sgm_get_stats(ctx, &st);
  uint64_t shared_budget = st.tier[SGM_TIER_SHARED].budget_bytes;
  if (budget + 1 > shared_budget) {
    char sb[32];
    fmt(shared_budget, sb, sizeof sb);
    printf("  asking for more than the VRAM budget: not shown: the shared GPU memory budget (%s) "
           "is smaller than the VRAM budget (%s), so such a block fits nowhere (the shared budget "
           "is half of RAM and at most the locked-memory limit, ulimit -l: README, Locked memory; "
           "set SGM_VRAM_LIMIT below %s to see the block land in shared memory)\n", sb, b, sb);
  } else {
    void *big = sgm_alloc(ctx, budget + 1, NULL);
    printf("  asking for more than the VRAM budget: %s\n",
           big ? sgm_tier_name(sgm_pointer_tier(ctx, big)) : sgm_last_error());
    task_manager(ctx, "with the big block");
    wrong_tier = !big || sgm_pointer_tier(ctx, big) != SGM_TIER_SHARED;
    sgm_free(ctx, big, NULL);
  }
  int x;
  sgm_free_ex(ctx, &x, NULL);
  printf("  freeing a pointer sgm did not hand out:\n    -> %s\n", sgm_last_error());
  destroy_recorded(ctx);
  return wrong_tier;
}

/* ---- part 2: oversubscription with movable buffers ---- */

enum { N_LAYERS = 48, N_KV = 48, N_STEPS = 10 };

static void fill(unsigned char *p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = (unsigned char)x;
  }
}

static void tier_line(const char *name, const sgm_tier_stats *t) {
  char used[32], budget[32], in[32], out[32];
  fmt(t->used_bytes, used, sizeof used);
  fmt(t->budget_bytes, budget, sizeof budget);
  fmt(t->bytes_in, in, sizeof in);
  fmt(t->bytes_out, out, sizeof out);
  printf("  %-22s %10s / %-10s  moved in %10s, out %10s, %4llu evictions, %3llu live\n", name,
         used, budget, in, out, (unsigned long long)t->n_evictions, (unsigned long long)t->n_live);
}

static sgm_context *rec_ctx; /* the oversubscription's context, for touch()'s samples */

static int touch(sgm_buffer *b, unsigned *hits) {
  void *d = NULL;
  sgm_tier before = sgm_buffer_tier(b);
  if (sgm_buffer_acquire(b, NULL, &d) != SGM_OK) {
    fprintf(stderr, "demo: acquire: %s\n", sgm_last_error());
    return 1;
  }
  /* ... a kernel would run on d here ... */
  *hits += before == SGM_TIER_VRAM;
  int rc = sgm_buffer_release(b, NULL) != SGM_OK;
  record_sample(rec_ctx);
  return rc;
}

static int oversubscribe(void) {
  char dir[64] = "";
  if (!getenv("SGM_SPILL_DIR")) {
    snprintf(dir, sizeof dir, "/tmp/sgm-demo-XXXXXX");
    if (!mkdtemp(dir)) {
      perror("demo: mkdtemp");
      return 1;
    }
    setenv("SGM_SPILL_DIR", dir, 1);
  }
  setenv("SGM_VRAM_LIMIT", "128MiB", 0);
  setenv("SGM_SHARED_LIMIT", "128MiB", 0);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) {
    fprintf(stderr, "demo: cannot create a context: %s\n", sgm_last_error());
    return 1;
  }
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  uint64_t vram = st.tier[SGM_TIER_VRAM].budget_bytes;
  size_t blk = (size_t)(vram * 3 / (N_LAYERS + N_KV)); /* working set = 3x VRAM */
  blk &= ~(size_t)4095;
  char b1[32], b2[32], b3[32];
  fmt(vram, b1, sizeof b1);
  fmt(st.tier[SGM_TIER_SHARED].budget_bytes, b2, sizeof b2);
  fmt((uint64_t)blk * (N_LAYERS + N_KV), b3, sizeof b3);
  printf("\n== oversubscription (backend %s): working set %s in %d buffers; VRAM %s, shared %s, "
         "spill to %s ==\n", sgm_context_backend(ctx), b3, N_LAYERS + N_KV, b1, b2,
         sgm_context_config(ctx)->spill_dir);

  rec_ctx = ctx;
  sgm_buffer *layer[N_LAYERS], *kv[N_KV];
  unsigned char *tmp = malloc(blk), *back = malloc(blk);
  int rc = 0;
  for (int i = 0; i < N_LAYERS + N_KV && !rc; i++) {
    sgm_buffer **b = i < N_LAYERS ? &layer[i] : &kv[i - N_LAYERS];
    if (sgm_buffer_create(ctx, blk, b) != SGM_OK) {
      fprintf(stderr, "demo: create: %s\n", sgm_last_error());
      rc = 1;
      break;
    }
    /* KV blocks are hot in proportion to their rank; layers are plain. */
    if (i >= N_LAYERS && i - N_LAYERS < 4) sgm_buffer_set_priority(*b, SGM_PRIORITY_HIGH);
    fill(tmp, blk, (uint64_t)i);
    rc = sgm_buffer_write(*b, 0, tmp, blk) != SGM_OK;
    record_sample(ctx);
  }
  printf("  loaded: %d buffers written\n", N_LAYERS + N_KV);

  uint64_t x = 12345;
  for (int step = 0; step < N_STEPS && !rc; step++) {
    unsigned hits = 0, touches = 0;
    sgm_stats before;
    sgm_get_stats(ctx, &before);
    for (int l = 0; l < N_LAYERS && !rc; l++) {
      if (l + 1 < N_LAYERS) sgm_buffer_prefetch(layer[l + 1], NULL);
      rc |= touch(layer[l], &hits);
      touches++;
      /* Two KV blocks per layer, skewed: low ids are hot (Zipf-like). */
      for (int k = 0; k < 2 && !rc; k++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        int id = (int)((double)N_KV * ((double)(x % 1000) / 1000.0) * ((double)(x % 997) / 997.0));
        rc |= touch(kv[id], &hits);
        touches++;
      }
    }
    sgm_stats after;
    sgm_get_stats(ctx, &after);
    char up[32], down[32];
    fmt(after.tier[SGM_TIER_VRAM].bytes_in - before.tier[SGM_TIER_VRAM].bytes_in, up, sizeof up);
    fmt(after.tier[SGM_TIER_VRAM].bytes_out - before.tier[SGM_TIER_VRAM].bytes_out, down, sizeof down);
    printf("  step %2d/%d: %3u of %3u touches found their buffer in VRAM (%4.1f%%); "
           "into VRAM %10s, out %10s\n", step + 1, N_STEPS, hits, touches,
           100.0 * hits / touches, up, down);
    fflush(stdout);
  }

  sgm_get_stats(ctx, &st);
  printf("  -- Task Manager --\n");
  tier_line("Dedicated GPU memory", &st.tier[SGM_TIER_VRAM]);
  tier_line("Shared GPU memory", &st.tier[SGM_TIER_SHARED]);
  tier_line("Disk (spill)", &st.tier[SGM_TIER_DISK]);

  unsigned bad = 0;
  for (int i = 0; i < N_LAYERS + N_KV && !rc; i++) {
    sgm_buffer *b = i < N_LAYERS ? layer[i] : kv[i - N_LAYERS];
    fill(tmp, blk, (uint64_t)i);
    if (sgm_buffer_read(b, 0, back, blk) != SGM_OK) {
      fprintf(stderr, "demo: read: %s\n", sgm_last_error());
      rc = 1;
    } else {
      bad += memcmp(tmp, back, blk) != 0;
    }
  }
  printf("  check: %s (%d buffers, every byte read back compared with what was written)\n",
         bad || rc ? "FAILED" : "all bytes intact", N_LAYERS + N_KV);
  free(tmp);
  free(back);
  rec_ctx = NULL;
  destroy_recorded(ctx);
  if (dir[0]) rmdir(dir);
  return rc || bad;
}

int main(int argc, char **argv) {
  const char *png = NULL;
  char csv[4096];
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--plot") == 0 && i + 1 < argc) {
      png = argv[++i];
    } else {
      fprintf(stderr, "usage: %s [--plot out.png]\n", argv[0]);
      return 2;
    }
  }
  if (png) {
    if (plot_check() != 0) return 2;
    /* out.png -> out.csv next to it. */
    size_t n = strlen(png);
    int dot = n > 4 && strcmp(png + n - 4, ".png") == 0;
    if (snprintf(csv, sizeof csv, "%.*s.csv", (int)(dot ? n - 4 : n), png) >= (int)sizeof csv) {
      fprintf(stderr, "demo: --plot: path too long\n");
      return 2;
    }
    rec_file = fopen(csv, "w");
    if (!rec_file) {
      perror(csv);
      return 2;
    }
    fprintf(rec_file, "time_s,device,pid,name,vram_used,vram_budget,shared_used,shared_budget,"
            "disk_used,vram_peak,fallbacks,evictions,device_total,shared_cap\n");
    rec_start_s = now_s();
  }
  /* The emulated device is never chosen silently: auto says when it is used. */
  setenv("SGM_BACKEND", "auto", 0);
  printf("sgm demo: dedicated and shared GPU memory as the Windows Task Manager shows them\n");
  int rc = run("growth mode (SGM_ALLOW_GROWTH=1, like TF_FORCE_GPU_ALLOW_GROWTH=true)", 1);
  rc |= run("reserve mode (SGM_ALLOW_GROWTH=0: the whole budget taken at create)", 0);
  rc |= oversubscribe();
  printf("\n%s\n", rc ? "demo FAILED" : "demo done");
  if (png) {
    int bad = fclose(rec_file) != 0;
    rec_file = NULL;
    if (bad) {
      perror(csv);
      return 1;
    }
    rc |= plot(csv, png);
  }
  return rc;
}
