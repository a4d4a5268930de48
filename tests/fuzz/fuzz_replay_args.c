/*
 * fuzz_replay_args.c — fuzz target for sgm-replay's command line
 * (benchmarks/replay/args.c: replay_args_parse, replay_parse_size), the
 * parser users run (issue 29).
 *
 * The input is argv: NUL-separated arguments (at most 32), argv[0] added.
 * Invariants checked on every input (a violation aborts, which libFuzzer and
 * the plain regression driver report as a crash):
 *  - the parser answers 0 (run), 1 (help) or 2 (bad usage) and, for 2, a
 *    non-empty one-line message;
 *  - on 0: a trace path, not both --vram and --vram-blocks, every size below
 *    2^63 bytes, --block-size positive when given, --vram a positive size or
 *    a percentage in (0, 100], --vram-blocks positive when given;
 *  - replay_parse_size on every argument: true only with a value below 2^63
 *    (and *bytes 0 when false, or for a percentage).
 * Threading: none.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "replay.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_MAX_ARGS 32

static void broken(const char *what) {
  fprintf(stderr, "fuzz_replay_args: invariant broken: %s\n", what);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *buf = malloc(size + 1);
  if (!buf) return 0;
  memcpy(buf, data, size);
  buf[size] = '\0';
  char *argv[FUZZ_MAX_ARGS + 2];
  int argc = 0;
  argv[argc++] = "sgm-replay";
  for (size_t i = 0; i <= size && argc <= FUZZ_MAX_ARGS;) {
    argv[argc++] = buf + i;
    i += strlen(buf + i) + 1;
  }
  argv[argc] = NULL;
  for (int i = 1; i < argc; i++) {
    uint64_t b = 1;
    double pct = -1;
    bool ok = replay_parse_size(argv[i], &b, &pct);
    if (ok && b >= (UINT64_C(1) << 63)) broken("replay_parse_size accepted 2^63 bytes or more");
    if (!ok && b != 0) broken("replay_parse_size failed and left *bytes set");
    if (ok && pct > 0 && (b != 0 || pct > 100)) broken("a percentage with bytes, or above 100");
  }
  replay_args a;
  char err[256];
  int rc = replay_args_parse(argc, argv, &a, err, sizeof err);
  if (rc == 2) {
    if (!err[0] || strchr(err, '\n')) broken("a usage error without a one-line message");
  } else if (rc == 0) {
    if (!a.path) broken("run without a trace");
    if (a.vram_arg && a.blocks_arg) broken("both --vram and --vram-blocks accepted");
    if (a.block_given && (a.block_bytes == 0 || a.block_bytes >= (UINT64_C(1) << 63)))
      broken("--block-size out of range accepted");
    if (a.shared_bytes >= (UINT64_C(1) << 63)) broken("--shared out of range accepted");
    if (a.vram_arg && !(a.vram_bytes > 0 || (a.vram_pct > 0 && a.vram_pct <= 100)))
      broken("--vram neither a positive size nor a percentage in (0, 100]");
    if (a.blocks_arg && a.n_blocks == 0) broken("--vram-blocks 0 accepted");
  } else if (rc != 1) {
    broken("an answer other than 0, 1 or 2");
  }
  free(buf);
  return 0;
}
