/*
 * error.c — status names, the thread-local error message, the log sink and
 * assertion failures.
 *
 * Invariants: the error message is per thread (no locking); the log writes one
 * whole line per call to stderr, never stdout.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

static _Thread_local char error_message[1024];

#define ERROR_STR_(x) #x
#define ERROR_STR(x) ERROR_STR_(x)

SGM_API const char *sgm_version(void) {
  return ERROR_STR(SGM_VERSION_MAJOR) "." ERROR_STR(SGM_VERSION_MINOR) "." ERROR_STR(SGM_VERSION_PATCH);
}

SGM_API const char *sgm_status_string(sgm_status s) {
  switch (s) {
    case SGM_OK: return "SGM_OK";
    case SGM_ERR_INVALID: return "SGM_ERR_INVALID";
    case SGM_ERR_NOMEM: return "SGM_ERR_NOMEM";
    case SGM_ERR_BACKEND: return "SGM_ERR_BACKEND";
    case SGM_ERR_IO: return "SGM_ERR_IO";
    case SGM_ERR_CORRUPT: return "SGM_ERR_CORRUPT";
    case SGM_ERR_BUSY: return "SGM_ERR_BUSY";
    case SGM_ERR_UNSUPPORTED: return "SGM_ERR_UNSUPPORTED";
  }
  return "SGM_ERR_UNKNOWN";
}

SGM_API const char *sgm_tier_name(sgm_tier t) {
  switch (t) {
    case SGM_TIER_VRAM: return "vram";
    case SGM_TIER_SHARED: return "shared";
    case SGM_TIER_DISK: return "disk";
    default: return "none";
  }
}

SGM_API const char *sgm_last_error(void) { return error_message; }

int sgm__error_set(int status, const char *fmt, ...) {
  /* Format into a scratch buffer first: fmt's arguments may point into
   * error_message itself (a caller adding context to a lower-level message). */
  char scratch[sizeof error_message];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(scratch, sizeof scratch, fmt, ap);
  va_end(ap);
  memcpy(error_message, scratch, sizeof scratch);
  return status;
}

void sgm__error_clear(void) { error_message[0] = '\0'; }

void sgm__log(int verbose, int level, const char *fmt, ...) {
  if (verbose < level) return;
  static const char *const names[] = {"error", "warning", "info", "debug"};
  char line[1200];
  int n = snprintf(line, sizeof line, "sgm: %s: ", names[level < 0 ? 0 : level > 3 ? 3 : level]);
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  va_end(ap);
  size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
  if (len > sizeof line - 2) len = sizeof line - 2;
  line[len++] = '\n';
  /* One write per line so lines from several threads do not interleave. */
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w;
}

const char *sgm__fmt_bytes(uint64_t bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) {
    snprintf(buf, len, "%llu B", (unsigned long long)bytes);
    return buf;
  }
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    u++;
  }
  snprintf(buf, len, "%.2f %s", v, units[u]);
  return buf;
}

void sgm__assert_fail(const char *cond, const char *file, int line) {
  char msg[512];
  int n = snprintf(msg, sizeof msg, "sgm: assertion failed: %s (%s:%d)\n", cond, file, line);
  ssize_t w = write(STDERR_FILENO, msg, n > 0 ? (size_t)n : 0);
  (void)w;
  abort();
}
