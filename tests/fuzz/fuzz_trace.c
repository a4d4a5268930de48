/*
 * fuzz_trace.c — fuzz target for sgm-replay's trace readers
 * (benchmarks/replay/trace.c): the own CSV, MiniMalloc and Mooncake formats,
 * one target per format (FUZZ_TRACE_FORMAT picks it at compile time), plus
 * format detection on the same bytes.
 *
 * The readers take a path, so each input goes into a memfd and is read back
 * through /proc/self/fd/N: the reader runs exactly as on a file, with no
 * temporary file left behind.
 *
 * Invariants checked on every input (a violation aborts, which libFuzzer and
 * the plain regression driver report as a crash):
 *  - a reader either succeeds or fails with a non-empty message, and a failed
 *    read leaves the trace empty (as replay.h promises);
 *  - a trace that was read is consistent: every event names a block below
 *    n_blocks, n_access + n_free == n_ev, no block is touched after its free,
 *    every block size is positive, total_bytes is at least every block's size
 *    and peak_live_bytes is at most total_bytes (no wrap-around);
 *  - Belady's OPT over the trace counts no more hits than accesses.
 *
 * Threading: none.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "replay.h"

#ifndef FUZZ_TRACE_FORMAT
#error "build with -DFUZZ_TRACE_FORMAT=REPLAY_FMT_CSV (or _MINIMALLOC, _MOONCAKE)"
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Stop with a message; abort() is what both drivers report as a crash. */
static void fuzz_trace_fail(const char *what, const char *detail) {
  fprintf(stderr, "fuzz_trace(%s): invariant broken: %s%s%s\n",
          replay_format_name(FUZZ_TRACE_FORMAT), what, detail ? ": " : "", detail ? detail : "");
  abort();
}

/* The invariants of a trace a reader accepted (see the file comment). */
static void fuzz_trace_check(const replay_trace *t) {
  if (t->n_access + t->n_free != t->n_ev) fuzz_trace_fail("n_access + n_free != n_ev", NULL);
  uint8_t *freed = calloc(t->n_blocks ? t->n_blocks : 1, 1);
  if (!freed) abort();
  for (size_t i = 0; i < t->n_ev; i++) {
    uint32_t b = REPLAY_EV_ID(t->ev[i]);
    if (b >= t->n_blocks) fuzz_trace_fail("an event names a block past n_blocks", NULL);
    if (freed[b]) fuzz_trace_fail("a block is used after its free", NULL);
    if (t->ev[i] & REPLAY_EV_FREE) freed[b] = 1;
  }
  free(freed);
  for (uint32_t b = 0; b < t->n_blocks; b++) {
    if (t->size[b] == 0) fuzz_trace_fail("a block of size 0 was accepted", NULL);
    if (t->total_bytes < t->size[b])
      fuzz_trace_fail("total_bytes is below one block's size (the sum wrapped around)", NULL);
  }
  if (t->peak_live_bytes > t->total_bytes) fuzz_trace_fail("peak_live_bytes > total_bytes", NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int fd = memfd_create("sgm-fuzz-trace", MFD_CLOEXEC);
  if (fd < 0) abort();
  size_t done = 0;
  while (done < size) {
    ssize_t n = write(fd, data + done, size - done);
    if (n <= 0) abort();
    done += (size_t)n;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);

  char err[REPLAY_ERR_MAX] = "";
  replay_trace t = {0};
  if (replay_trace_load_as(path, FUZZ_TRACE_FORMAT, 0, &t, err, sizeof err) == 0) {
    fuzz_trace_check(&t);
    replay_result r;
    char oerr[REPLAY_ERR_MAX] = "";
    /* A capacity of a few blocks, so that OPT evicts and bypasses. */
    if (replay_opt(&t, 4 * REPLAY_DEFAULT_BLOCK_BYTES, &r, oerr, sizeof oerr) == 0 &&
        r.hits > r.accesses)
      fuzz_trace_fail("OPT counted more hits than accesses", NULL);
  } else {
    if (err[0] == '\0') fuzz_trace_fail("a failed read left no message", NULL);
    if (t.ev || t.size || t.n_ev || t.n_blocks)
      fuzz_trace_fail("a failed read left a non-empty trace", err);
  }
  replay_trace_free(&t);

  /* Detection on the same bytes: it answers a format or fails with a message. */
  replay_format f = REPLAY_FMT_UNKNOWN;
  err[0] = '\0';
  if (replay_detect_format(path, &f, err, sizeof err) != 0 && err[0] == '\0')
    fuzz_trace_fail("a failed detection left no message", NULL);
  close(fd);
  return 0;
}
