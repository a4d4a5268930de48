/*
 * args.c — sgm-replay's command line (replay_args_parse, replay.h): the
 * options, their values (sizes, percentages, block counts) and the checks
 * that need no trace. Split from main.c so that the fuzz target
 * tests/fuzz/fuzz_replay_args.c runs the very parser users run (issue 29).
 * Pure: no I/O, no allocation; the parsed strings point into argv.
 * Threading: none (no state).
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "replay.h"

bool replay_parse_size(const char *s, uint64_t *bytes, double *pct) {
  if (pct) *pct = 0;
  *bytes = 0;
  while (isspace((unsigned char)*s)) s++;
  if (!isdigit((unsigned char)*s) && *s != '.') return false;
  errno = 0;
  char *end;
  double v = strtod(s, &end);
  if (errno || end == s || !(v >= 0) || !isfinite(v)) return false;
  while (isspace((unsigned char)*end)) end++;
  if (*end == '%') {
    if (!pct || end[1] || v <= 0 || v > 100) return false;
    *pct = v;
    return true;
  }
  double mul = 1;
  const char *u = end;
  if (*u) {
    switch (toupper((unsigned char)*u)) {
      case 'B': mul = 1; break;
      case 'K': mul = 0x1p10; break;
      case 'M': mul = 0x1p20; break;
      case 'G': mul = 0x1p30; break;
      case 'T': mul = 0x1p40; break;
      default: return false;
    }
    u++;
    if (mul > 1) {
      if (*u == 'i' || *u == 'I') u++;
      if (*u == 'B' || *u == 'b') u++;
    }
    if (*u) return false;
  }
  double b = v * mul;
  if (b >= 0x1p63) return false;
  *bytes = (uint64_t)b;
  if ((double)*bytes != b) { /* no fractions of a byte */
    *bytes = 0;
    return false;
  }
  return true;
}

const char *replay_fmt_bytes(uint64_t b, char *buf, size_t n) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, u++;
  if (u == 0) snprintf(buf, n, "%llu B", (unsigned long long)b);
  else snprintf(buf, n, "%.2f %s", v, units[u]);
  return buf;
}

/* An argument as a message may show it: printable ASCII as is, anything else
 * (a newline, an escape, a byte of broken UTF-8) as \xNN, cut at 80 bytes, so
 * that a message stays one line and a terminal gets no control codes. */
static const char *args_show(const char *v, char *buf, size_t n) {
  size_t o = 0;
  for (size_t i = 0; v[i] && o + 5 < n; i++) {
    unsigned char c = (unsigned char)v[i];
    if (i == 80) {
      o += (size_t)snprintf(buf + o, n - o, "...");
      break;
    }
    if (c >= 0x20 && c < 0x7f) buf[o++] = (char)c;
    else o += (size_t)snprintf(buf + o, n - o, "\\x%02x", c);
  }
  buf[o < n ? o : n - 1] = '\0';
  return buf;
}

static int args_fail(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int args_fail(char *err, size_t err_len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, err_len, fmt, ap);
  va_end(ap);
  return 2;
}

int replay_args_parse(int argc, char *const *argv, replay_args *a, char *err, size_t err_len) {
  memset(a, 0, sizeof *a);
  a->policy_arg = "all";
  a->spill_dir = "";
  if (err_len) err[0] = '\0';
  const char *block_arg = NULL, *shared_arg = NULL;
  char v1[512], v2[512];
  for (int i = 1; i < argc; i++) {
    const char *s = argv[i];
    if (strcmp(s, "-h") == 0 || strcmp(s, "--help") == 0) return 1;
    if (strcmp(s, "--json") == 0) {
      a->json = true;
      continue;
    }
    if (strcmp(s, "--cold") == 0) {
      a->cold = true;
      continue;
    }
    static const char *const flags[] = {"--policy", "--vram", "--vram-blocks", "--shared",
                                        "--block-size", "--spill", "--hints"};
    const char **dst[] = {&a->policy_arg, &a->vram_arg, &a->blocks_arg, &shared_arg, &block_arg,
                          &a->spill_dir, &a->hints_arg};
    bool matched = false;
    for (size_t k = 0; k < sizeof flags / sizeof *flags; k++) {
      size_t fl = strlen(flags[k]);
      if (strncmp(s, flags[k], fl) != 0) continue;
      if (s[fl] == '=') {
        *dst[k] = s + fl + 1;
      } else if (s[fl] == '\0') {
        if (i + 1 >= argc) return args_fail(err, err_len, "%s needs a value", flags[k]);
        *dst[k] = argv[++i];
      } else {
        continue;
      }
      matched = true;
      break;
    }
    if (matched) continue;
    if (s[0] == '-' && s[1]) return args_fail(err, err_len, "unknown option %s", args_show(s, v1, sizeof v1));
    if (a->path) return args_fail(err, err_len, "one trace at a time (got %s and %s)",
                                 args_show(a->path, v1, sizeof v1), args_show(s, v2, sizeof v2));
    a->path = s;
  }
  if (!a->path) return args_fail(err, err_len, "no trace given");
  if (a->vram_arg && a->blocks_arg) return args_fail(err, err_len, "give --vram or --vram-blocks, not both");
  a->block_given = block_arg != NULL;
  if (block_arg && (!replay_parse_size(block_arg, &a->block_bytes, NULL) || a->block_bytes == 0))
    return args_fail(err, err_len, "--block-size %s: expected a positive size such as 4096 or 4KiB",
                     args_show(block_arg, v1, sizeof v1));
  if (shared_arg && (!replay_parse_size(shared_arg, &a->shared_bytes, NULL) || a->shared_bytes == 0))
    return args_fail(err, err_len, "--shared %s: expected a positive size such as 1GiB",
                     args_show(shared_arg, v1, sizeof v1));
  if (a->vram_arg && (!replay_parse_size(a->vram_arg, &a->vram_bytes, &a->vram_pct) ||
                      (a->vram_bytes == 0 && a->vram_pct == 0)))
    return args_fail(err, err_len, "--vram %s: expected a positive size such as 64MiB, or a percentage "
                     "of the footprint such as 10%%", args_show(a->vram_arg, v1, sizeof v1));
  if (a->blocks_arg) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(a->blocks_arg, &end, 10);
    if (errno || *end || end == a->blocks_arg || v == 0 || a->blocks_arg[0] == '-')
      return args_fail(err, err_len, "--vram-blocks %s: expected a positive whole number",
                       args_show(a->blocks_arg, v1, sizeof v1));
    a->n_blocks = v;
  }
  return 0;
}
