/*
 * main.c — sgm-replay: replay a trace through sgm's eviction policies and
 * compare each with Belady's OPT.
 *
 *   sgm-replay [--policy NAME|all] [--vram BYTES | --vram-blocks N]
 *              [--shared BYTES] [--spill DIR] [--block-size BYTES] [--hints N[,N...]]
 *              [--cold] [--json] TRACE
 *
 * Formats, the access models and the output: docs/traces.md.
 * Exit status: 0 done, 1 a replay or the trace failed, 2 bad usage.
 */
#define _POSIX_C_SOURCE 200809L

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "replay.h"
#include "sgm.h"

/* With no --vram / --vram-blocks: a tenth of the footprint, the middle case of
 * the table (1/5/10/25%). */
#define MAIN_DEFAULT_VRAM_PERCENT 10.0
#define MAIN_MAX_POLICIES 64
/* --hints: at most this many queue lengths, each at most MAIN_MAX_QUEUE requests. */
#define MAIN_MAX_HINTS 8
#define MAIN_MAX_QUEUE 1000000u

static const char USAGE[] =
    "usage: sgm-replay [--policy NAME[,NAME...]|all] [--vram BYTES | --vram-blocks N]\n"
    "                  [--shared BYTES] [--spill DIR] [--block-size BYTES] [--cold] [--json] TRACE\n"
    "\n"
    "Replays TRACE through sgm's buffer API on the emulated device, once per policy,\n"
    "and reports the VRAM hit ratio, bytes moved, evictions and time beside Belady's OPT.\n"
    "  TRACE              Mooncake JSONL (hash_ids), MiniMalloc CSV (id,lower,upper,size)\n"
    "                     or sgm-replay CSV (op,id,size); told apart by the first line\n"
    "  --policy P         a policy name, a comma-separated list, all (default), opt or\n"
    "                     opt-admit (Belady without bypass; all includes it)\n"
    "  --vram BYTES       VRAM capacity: 64MiB, 1.5G, 1048576, or 10%% of the footprint\n"
    "  --vram-blocks N    VRAM capacity in blocks (traces whose blocks are all one size)\n"
    "                     (default: 10%% of the footprint, in whole blocks when sizes are equal)\n"
    "  --shared BYTES     shared-memory budget (default: enough for the whole trace)\n"
    "  --spill DIR        give sgm a disk tier in DIR (default: none)\n"
    "  --block-size BYTES size of every Mooncake block and of CSV accesses without a size\n"
    "                     (default 4KiB)\n"
    "  --hints N[,N...]   also replay each policy with residency hints derived from a Mooncake\n"
    "                     trace as an engine has them: parents (block chains), done-with\n"
    "                     (request ends) and, N > 0, the next N queued requests' blocks as\n"
    "                     future use (sgm_will_use); 0, 16, 64, 256 are the usual N. Adds\n"
    "                     plain lru as the reference of the gap closed (docs/traces.md)\n"
    "  --cold             time the replay with the shared pool uncommitted and VRAM untouched\n"
    "                     (default: both are warmed up first, untimed; see docs/traces.md)\n"
    "  --json             one JSON object on stdout instead of the table\n";

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("sgm-replay: ", stderr);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputs("\n(sgm-replay --help for the usage)\n", stderr);
  return 2;
}


/* ---- progress on stderr, only on a terminal ---- */

typedef struct progress {
  bool on;        /* stderr is a terminal */
  double start;   /* when the current replay began */
  double last;    /* when the last line was drawn */
  bool drawn;     /* a line is on the screen */
} progress;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void progress_cb(void *user, const char *policy, size_t done, size_t total) {
  progress *p = user;
  if (!p->on) return;
  double t = now_s();
  if (done == 0) {
    p->start = p->last = t;
    return;
  }
  if (done == total) {
    if (p->drawn) fputs("\r\033[K", stderr);
    p->drawn = false;
    return;
  }
  if (t - p->last < 1.0) return;
  p->last = t;
  p->drawn = true;
  fprintf(stderr, "\r\033[Ksgm-replay: %s: %5.1f%% (%zu of %zu events, %.0f s)", policy,
          100.0 * (double)done / (double)total, done, total, t - p->start);
  fflush(stderr);
}

/* ---- output ---- */

static void json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

typedef struct run_info {
  const char *path;
  const replay_trace *t;
  uint64_t block_bytes;   /* uniform block size, 0 when sizes differ */
  uint64_t vram_bytes;    /* VRAM capacity */
  uint64_t shared_bytes;  /* shared budget */
  const char *spill_dir;  /* "" = none */
  bool cold;              /* --cold: no warm-up */
} run_info;

/* The plain LRU run among r[0..n), the reference of the gap closed; NULL if none. */
static const replay_result *find_lru(const replay_result *r, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (r[i].hint_queue < 0 && strcmp(r[i].policy, "lru") == 0) return &r[i];
  return NULL;
}

/* The share of the LRU -> OPT gap x closes, in percent; NAN without a gap. */
static double gap_closed(const replay_result *x, const replay_result *lru, const replay_result *opt) {
  if (!lru || opt->hits <= lru->hits) return NAN;
  return 100.0 * ((double)x->hits - (double)lru->hits) / ((double)opt->hits - (double)lru->hits);
}

static void print_json(const run_info *ri, const replay_result *r, size_t n, const replay_result *opt) {
  static const char *const tiers[] = {"vram", "shared", "disk"};
  const replay_trace *t = ri->t;
  printf("{\"trace\": ");
  json_string(stdout, ri->path);
  printf(", \"format\": \"%s\", \"accesses\": %llu, \"blocks\": %u, ",
         replay_format_name(t->format), (unsigned long long)t->n_access, (unsigned)t->n_blocks);
  if (ri->block_bytes) printf("\"block_size\": %llu", (unsigned long long)ri->block_bytes);
  else printf("\"block_size\": null");
  printf(", \"footprint_bytes\": %llu, \"capacity_bytes\": %llu",
         (unsigned long long)t->peak_live_bytes, (unsigned long long)ri->vram_bytes);
  if (ri->block_bytes)
    printf(", \"capacity_blocks\": %llu", (unsigned long long)(ri->vram_bytes / ri->block_bytes));
  printf(", \"shared_bytes\": %llu, \"opt_variant\": \"%s\", \"results\": [",
         (unsigned long long)ri->shared_bytes,
         ri->block_bytes ? "belady-bypass" : "belady-size-bypass (heuristic for unequal sizes)");
  const replay_result *lru = find_lru(r, n);
  for (size_t i = 0; i < n; i++) {
    const replay_result *x = &r[i];
    printf("%s\n  {\"policy\": ", i ? "," : "");
    json_string(stdout, x->policy);
    if (x->hint_queue >= 0) printf(", \"hint_queue\": %d", x->hint_queue);
    else printf(", \"hint_queue\": null");
    double gc = gap_closed(x, lru, opt);
    if (x != opt && !isnan(gc)) printf(", \"gap_closed_percent\": %.2f", gc);
    printf(", \"hit_ratio\": %.6f, \"hits\": %llu, \"accesses\": %llu, \"bytes_promoted\": %llu, "
           "\"bytes_demoted\": %llu, \"evictions\": %llu, \"seconds\": %.6f, "
           "\"setup_seconds\": %.6f, \"accesses_per_second\": %.0f, \"gap_to_opt_points\": %.4f, "
           "\"tiers\": {",
           replay_hit_ratio(x), (unsigned long long)x->hits, (unsigned long long)x->accesses,
           (unsigned long long)x->bytes_promoted, (unsigned long long)x->bytes_demoted,
           (unsigned long long)x->evictions, x->seconds, x->setup_seconds,
           x->seconds > 0 ? (double)x->accesses / x->seconds : 0.0,
           100.0 * (replay_hit_ratio(opt) - replay_hit_ratio(x)));
    for (int k = 0; k < 3; k++)
      printf("%s\"%s\": {\"bytes_in\": %llu, \"bytes_out\": %llu, \"evictions\": %llu}",
             k ? ", " : "", tiers[k], (unsigned long long)x->tier_in[k],
             (unsigned long long)x->tier_out[k], (unsigned long long)x->tier_evictions[k]);
    printf("}}");
  }
  printf("\n]}\n");
}

static void print_table(const run_info *ri, const replay_result *r, size_t n, const replay_result *opt) {
  const replay_trace *t = ri->t;
  char a[32], b[32];
  printf("trace      %s (%s)\n", ri->path, replay_format_name(t->format));
  printf("accesses   %llu to %u blocks", (unsigned long long)t->n_access, (unsigned)t->n_blocks);
  if (ri->block_bytes) printf(" of %llu bytes each", (unsigned long long)ri->block_bytes);
  else printf(" of unequal sizes");
  if (t->n_free) printf(", %llu frees", (unsigned long long)t->n_free);
  printf("; footprint %s\n", replay_fmt_bytes(t->peak_live_bytes, a, sizeof a));
  printf("VRAM       %llu bytes", (unsigned long long)ri->vram_bytes);
  if (ri->block_bytes)
    printf(" = %llu blocks", (unsigned long long)(ri->vram_bytes / ri->block_bytes));
  printf(" (%.2f%% of the footprint); shared budget %s; disk tier %s\n",
         t->peak_live_bytes ? 100.0 * (double)ri->vram_bytes / (double)t->peak_live_bytes : 0.0,
         replay_fmt_bytes(ri->shared_bytes, b, sizeof b), ri->spill_dir[0] ? ri->spill_dir : "off");
  printf("OPT        %s\n\n", ri->block_bytes
                                 ? "Belady with bypass (furthest next use leaves or is not "
                                   "cached; exact for equal sizes)"
                                 : "Belady-size with bypass (furthest next use until it fits; a "
                                   "heuristic, not optimal for unequal sizes)");
  printf("%-10s %9s %11s %10s %10s %10s %14s %14s %9s %12s %8s\n", "policy", "hit ratio", "gap to OPT",
         "gap closed", "hits", "evictions", "promoted", "demoted", "seconds", "accesses/s", "setup s");
  const replay_result *lru = find_lru(r, n);
  for (size_t i = 0; i < n; i++) {
    const replay_result *x = &r[i];
    char gap[32], closed[32];
    double gc = gap_closed(x, lru, opt);
    if (x == opt) snprintf(gap, sizeof gap, "-");
    else snprintf(gap, sizeof gap, "%.2f pt", 100.0 * (replay_hit_ratio(opt) - replay_hit_ratio(x)));
    if (x == opt || isnan(gc)) snprintf(closed, sizeof closed, "-");
    else snprintf(closed, sizeof closed, "%.1f%%", gc);
    printf("%-10s %8.2f%% %11s %10s %10llu %10llu %14s %14s %9.3f %12.0f %8.3f\n", x->policy,
           100.0 * replay_hit_ratio(x), gap, closed, (unsigned long long)x->hits,
           (unsigned long long)x->evictions, replay_fmt_bytes(x->bytes_promoted, a, sizeof a),
           replay_fmt_bytes(x->bytes_demoted, b, sizeof b), x->seconds,
           x->seconds > 0 ? (double)x->accesses / x->seconds : 0.0, x->setup_seconds);
  }
  if (lru) printf("\ngap closed: the share of the gap from plain lru to OPT that the run closes\n");
  printf("\nseconds: the replay loop; setup s: the untimed warm-up before it (committing the "
         "shared pool, touching VRAM; %s)\n", ri->cold ? "skipped: --cold" : "--cold skips it");
  printf("\nbytes moved per tier (in / out; evictions out of the tier)\n");
  printf("%-10s %29s %29s %29s\n", "policy", "vram", "shared", "disk");
  for (size_t i = 0; i < n; i++) {
    const replay_result *x = &r[i];
    printf("%-10s", x->policy);
    for (int k = 0; k < 3; k++) {
      char cell[96];
      snprintf(cell, sizeof cell, "%s / %s; %llu", replay_fmt_bytes(x->tier_in[k], a, sizeof a),
               replay_fmt_bytes(x->tier_out[k], b, sizeof b), (unsigned long long)x->tier_evictions[k]);
      printf(" %29s", cell);
    }
    printf("\n");
  }
}

/* Split a comma-separated list in place into names[]; count, or -1 if too many. */
static int split_policies(char *list, const char **names, int max) {
  int n = 0;
  for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
    while (isspace((unsigned char)*tok)) tok++;
    if (!*tok) continue;
    if (n == max) return -1;
    names[n++] = tok;
  }
  return n;
}

int main(int argc, char **argv) {
  replay_args args;
  char aerr[512];
  int prc = replay_args_parse(argc, argv, &args, aerr, sizeof aerr);
  if (prc == 1) {
    fputs(USAGE, stdout);
    return 0;
  }
  if (prc != 0) return usage_error("%s", aerr);
  const char *policy_arg = args.policy_arg, *vram_arg = args.vram_arg, *blocks_arg = args.blocks_arg;
  const char *spill_dir = args.spill_dir, *path = args.path, *hints_arg = args.hints_arg;
  bool json = args.json, cold = args.cold, block_given = args.block_given;
  uint64_t block_bytes = args.block_bytes, shared_bytes = args.shared_bytes;
  uint64_t vram_bytes = args.vram_bytes, n_blocks = args.n_blocks;
  double vram_pct = args.vram_pct;

  uint32_t hq[MAIN_MAX_HINTS];
  int n_hq = 0;
  if (hints_arg) {
    const char *h = hints_arg;
    for (;;) {
      char *end;
      errno = 0;
      unsigned long long v = strtoull(h, &end, 10);
      if (errno || end == h || !isdigit((unsigned char)*h) || v > MAIN_MAX_QUEUE ||
          (*end && *end != ','))
        return usage_error("--hints %s: expected queue lengths such as 0,16,64,256 (each 0 to %u)",
                           hints_arg, MAIN_MAX_QUEUE);
      if (n_hq == MAIN_MAX_HINTS)
        return usage_error("--hints %s: at most %d queue lengths", hints_arg, MAIN_MAX_HINTS);
      hq[n_hq++] = (uint32_t)v;
      if (!*end) break;
      h = end + 1;
    }
  }

  /* The replay sets one policy for every tier through sgm_config.policy; a
   * per-tier choice from the environment would override it. */
  static const char *const per_tier[] = {"SGM_POLICY_VRAM", "SGM_POLICY_SHARED"};
  for (size_t k = 0; k < sizeof per_tier / sizeof *per_tier; k++) {
    if (getenv(per_tier[k])) {
      fprintf(stderr, "sgm-replay: note: %s is ignored: --policy picks the policy of every tier\n",
              per_tier[k]);
      unsetenv(per_tier[k]);
    }
  }

  char err[REPLAY_ERR_MAX];
  replay_format fmt;
  if (replay_detect_format(path, &fmt, err, sizeof err) != 0) {
    fprintf(stderr, "sgm-replay: %s\n", err);
    return 1;
  }
  if (block_given && fmt == REPLAY_FMT_MINIMALLOC)
    fprintf(stderr, "sgm-replay: note: --block-size is not used: MiniMalloc traces give every size\n");
  replay_trace t;
  if (replay_trace_load_as(path, fmt, block_bytes, &t, err, sizeof err) != 0) {
    fprintf(stderr, "sgm-replay: %s\n", err);
    return 1;
  }
  if (t.n_access == 0) {
    fprintf(stderr, "sgm-replay: %s: no accesses to replay\n", path);
    replay_trace_free(&t);
    return 1;
  }

  int status = 0;
  run_info ri = {.path = path, .t = &t, .block_bytes = t.uniform_bytes, .spill_dir = spill_dir,
                 .cold = cold};
  uint64_t unit = t.uniform_bytes ? (t.uniform_bytes + REPLAY_ALIGN - 1) / REPLAY_ALIGN * REPLAY_ALIGN
                                  : 0;
  if (n_blocks) {
    if (!t.uniform_bytes) {
      replay_trace_free(&t);
      return usage_error("--vram-blocks needs a trace whose blocks all have one size; this one's "
                         "differ: give --vram BYTES");
    }
    if (n_blocks > UINT64_MAX / unit) {
      replay_trace_free(&t);
      return usage_error("--vram-blocks %s is too large", blocks_arg);
    }
    vram_bytes = n_blocks * unit;
  } else if (!vram_arg || vram_pct > 0) {
    double pct = vram_arg ? vram_pct : MAIN_DEFAULT_VRAM_PERCENT;
    vram_bytes = (uint64_t)((double)t.peak_live_bytes * pct / 100.0);
    if (unit) vram_bytes = vram_bytes / unit * unit;
    if (unit && vram_bytes == 0) vram_bytes = unit;
  }
  vram_bytes = vram_bytes / REPLAY_ALIGN * REPLAY_ALIGN;
  if (vram_bytes == 0) {
    replay_trace_free(&t);
    return usage_error("the VRAM capacity rounds down to 0 bytes (sgm's granule is %llu bytes)",
                       (unsigned long long)REPLAY_ALIGN);
  }
  ri.vram_bytes = vram_bytes;
  ri.shared_bytes = shared_bytes ? shared_bytes : replay_default_shared_bytes(&t);
  /* Before anything is pinned: a footprint that cannot fit would pin all the
   * shared tier allows and still fail (issue 29). */
  replay_sgm_params room = {.policy = "lru", .vram_bytes = vram_bytes, .shared_bytes = ri.shared_bytes,
                            .spill_dir = spill_dir};
  if (replay_check_room(&t, &room, err, sizeof err) != 0) {
    fprintf(stderr, "sgm-replay: %s\n", err);
    replay_trace_free(&t);
    return 1;
  }

  /* Which policies. */
  const char *names[MAIN_MAX_POLICIES];
  int n_names = 0;
  char *list = strdup(policy_arg);
  if (!list) {
    replay_trace_free(&t);
    fprintf(stderr, "sgm-replay: out of memory\n");
    return 1;
  }
  if (strcmp(policy_arg, "all") == 0) {
    for (const char *const *p = replay_policy_names(); *p && n_names < MAIN_MAX_POLICIES; p++)
      names[n_names++] = *p;
  } else {
    n_names = split_policies(list, names, MAIN_MAX_POLICIES);
    if (n_names <= 0) {
      free(list);
      replay_trace_free(&t);
      return usage_error("--policy %s: no policy named", policy_arg);
    }
  }

  if (n_hq && fmt != REPLAY_FMT_MOONCAKE) {
    free(list);
    replay_trace_free(&t);
    return usage_error("--hints needs a Mooncake trace (requests and block chains); %s is %s",
                       path, replay_format_name(fmt));
  }
  /* With hints, plain lru is the reference of the gap closed: run it first if not named. */
  bool add_lru = false;
  if (n_hq) {
    add_lru = true;
    for (int i = 0; i < n_names; i++) add_lru &= strcmp(names[i], "lru") != 0;
  }
  /* Each policy plain and with each N; + lru, opt-admit and opt. */
  replay_result *res = calloc((size_t)n_names * (size_t)(1 + n_hq) + 3, sizeof *res);
  if (!res) {
    free(list);
    replay_trace_free(&t);
    fprintf(stderr, "sgm-replay: out of memory\n");
    return 1;
  }
  replay_result opt;
  if (replay_opt(&t, vram_bytes, &opt, err, sizeof err) != 0) {
    fprintf(stderr, "sgm-replay: %s\n", err);
    free(res);
    free(list);
    replay_trace_free(&t);
    return 1;
  }
  progress pr = {.on = isatty(STDERR_FILENO) == 1};
  size_t n_res = 0;
  bool want_admit = strcmp(policy_arg, "all") == 0;
  for (int i = add_lru ? -1 : 0; i < n_names; i++) {
    const char *name = i < 0 ? "lru" : names[i];
    if (strcmp(name, "opt") == 0) continue; /* always reported, once, last */
    if (strcmp(name, "opt-admit") == 0) {
      want_admit = true; /* reported once, before opt */
      continue;
    }
    for (int h = -1; h < (i < 0 ? 0 : n_hq); h++) {
      replay_sgm_params p = {.policy = name, .vram_bytes = vram_bytes,
                             .shared_bytes = ri.shared_bytes, .spill_dir = spill_dir, .cold = cold,
                             .hints = h >= 0, .hint_queue = h >= 0 ? hq[h] : 0,
                             .progress = progress_cb, .progress_user = &pr};
      if (replay_sgm(&t, &p, &res[n_res], err, sizeof err) != 0) {
        progress_cb(&pr, name, 1, 1);
        fprintf(stderr, "sgm-replay: %s\n", err);
        status = 1;
        continue;
      }
      n_res++;
    }
  }
  if (want_admit) {
    if (replay_opt_ex(&t, vram_bytes, REPLAY_OPT_ADMIT, &res[n_res], err, sizeof err) == 0) {
      n_res++;
    } else {
      fprintf(stderr, "sgm-replay: %s\n", err);
      status = 1;
    }
  }
  res[n_res++] = opt;
  if (json) print_json(&ri, res, n_res, &res[n_res - 1]);
  else print_table(&ri, res, n_res, &res[n_res - 1]);
  free(res);
  free(list);
  replay_trace_free(&t);
  return status;
}
