/*
 * soak.c — sgm-soak: the model-based random test (model.h) run long, as a
 * benchmark-style program, not a test: every check of the CI run holds, and
 * at every checkpoint it prints the process's resident memory, each tier's
 * committed and used bytes and the open file descriptors, so that slow leaks
 * (memory, pinned chunks, spill-file space, descriptors) show as a trend.
 *
 *   sgm-soak [--threads N] [--ops N] [--seed N] [--every N] [--idle-trim-ms N] [--spill DIR]
 *
 * Defaults: 4 threads, 200000 operations per thread, a checkpoint every 2000,
 * idle trim at 5 ms, the spill folder a new one under /tmp (removed at the
 * end). Exit status 0 when every check held, 1 when one broke (the message
 * names the seed), 2 for bad usage.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "model.h"

typedef struct soak_state {
  struct timespec t0; /* start */
  long page_bytes;    /* sysconf(_SC_PAGESIZE) */
} soak_state;

static uint64_t soak_rss_bytes(const soak_state *s) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long size = 0, rss = 0;
  if (f) {
    if (fscanf(f, "%lu %lu", &size, &rss) != 2) rss = 0;
    fclose(f);
  }
  return (uint64_t)rss * (uint64_t)s->page_bytes;
}

static int soak_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the one opendir holds */
}

static void soak_checkpoint(void *user, uint64_t ops_done, sgm_context *ctx) {
  soak_state *s = user;
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  double secs = (double)(now.tv_sec - s->t0.tv_sec) + (double)(now.tv_nsec - s->t0.tv_nsec) / 1e9;
  sgm_stats st;
  if (sgm_get_stats(ctx, &st) != SGM_OK) return;
  printf("%8.1f s %10llu ops/thread  rss %7.1f MiB  committed vram %6.1f shared %6.1f disk %6.1f MiB"
         "  used vram %6.1f shared %6.1f disk %6.1f MiB  fds %d\n",
         secs, (unsigned long long)ops_done, (double)soak_rss_bytes(s) / 1048576.0,
         (double)st.tier[0].committed_bytes / 1048576.0, (double)st.tier[1].committed_bytes / 1048576.0,
         (double)st.tier[2].committed_bytes / 1048576.0, (double)st.tier[0].used_bytes / 1048576.0,
         (double)st.tier[1].used_bytes / 1048576.0, (double)st.tier[2].used_bytes / 1048576.0,
         soak_open_fds());
  fflush(stdout);
}

int main(int argc, char **argv) {
  model_params p = {.seed = (uint64_t)time(NULL), .n_ops = 200000, .n_threads = 4,
                    .ops_per_checkpoint = 2000, .idle_trim_ms = 5};
  const char *spill = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) goto usage;
    if (strcmp(a, "--threads") == 0) p.n_threads = atoi(v);
    else if (strcmp(a, "--ops") == 0) p.n_ops = strtoull(v, NULL, 0);
    else if (strcmp(a, "--seed") == 0) p.seed = strtoull(v, NULL, 0);
    else if (strcmp(a, "--every") == 0) p.ops_per_checkpoint = strtoull(v, NULL, 0);
    else if (strcmp(a, "--idle-trim-ms") == 0) p.idle_trim_ms = strtoull(v, NULL, 0);
    else if (strcmp(a, "--spill") == 0) spill = v;
    else goto usage;
    i++;
  }
  if (p.n_threads < 1 || p.n_threads > MODEL_MAX_THREADS || p.n_ops == 0) goto usage;
  char dir[] = "/tmp/sgm-soak-XXXXXX";
  if (!spill) {
    if (!mkdtemp(dir)) {
      perror("mkdtemp");
      return 1;
    }
    spill = dir;
  }
  p.spill_dir = spill;
  soak_state s = {.page_bytes = sysconf(_SC_PAGESIZE)};
  clock_gettime(CLOCK_MONOTONIC, &s.t0);
  p.checkpoint = soak_checkpoint;
  p.checkpoint_user = &s;
  printf("sgm-soak: seed %llu, %d threads, %llu operations per thread, spill %s, fds at start %d\n",
         (unsigned long long)p.seed, p.n_threads, (unsigned long long)p.n_ops, spill, soak_open_fds());
  model_result r;
  char err[MODEL_ERR_MAX] = "";
  int rc = model_run(&p, &r, err, sizeof err);
  printf("sgm-soak: %llu ops, %llu checkpoints, %llu refused for room, %llu I/O; fds at end %d, "
         "rss %.1f MiB\n",
         (unsigned long long)r.n_ops, (unsigned long long)r.n_checkpoints,
         (unsigned long long)r.n_nomem, (unsigned long long)r.n_io, soak_open_fds(),
         (double)soak_rss_bytes(&s) / 1048576.0);
  if (spill == dir) rmdir(dir);
  if (rc != 0) {
    fprintf(stderr, "sgm-soak: FAILED: %s\n", err);
    return 1;
  }
  return 0;
usage:
  fprintf(stderr, "usage: %s [--threads N] [--ops N] [--seed N] [--every N] [--idle-trim-ms N] "
                  "[--spill DIR]\n", argv[0]);
  return 2;
}
