/*
 * prog_common.h — what the preload's four test programs share (tests/preload/).
 * The programs stand for unmodified CUDA programs: they know nothing of sgm.
 * Each allocates 1.5x the device's memory (FAKE_CUDA_TOTAL_MEM) in blocks,
 * writes every byte, reads every byte back and frees everything. Exit codes:
 * 0 all done and intact, 2 the driver answered OUT_OF_MEMORY (what a program
 * without the preload must see), 1 anything else wrong.
 * With TEST_EXPECT_PRELOAD=1 they also check, while the blocks are live, that
 * sgm-smi (TEST_SGM_SMI) lists them as interposed with fallback bytes.
 */
#ifndef SGM_TEST_PRELOAD_PROG_COMMON_H
#define SGM_TEST_PRELOAD_PROG_COMMON_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda.h>

#include "fake_cuda.h"

#define PROG_BLOCK ((size_t)4 << 20)
#define PROG_MAX_BLOCKS 256

#define PROG_FAIL(...)                                                                \
  do {                                                                                \
    fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                                   \
    fprintf(stderr, __VA_ARGS__);                                                     \
    fputc('\n', stderr);                                                              \
    exit(1);                                                                          \
  } while (0)

#define PROG_CHECK(call)                                                              \
  do {                                                                                \
    CUresult r_ = (call);                                                             \
    if (r_ != CUDA_SUCCESS) PROG_FAIL("%s failed: %d", #call, (int)r_);               \
  } while (0)

static inline uint64_t prog_env_u64(const char *name, uint64_t dflt) {
  const char *v = getenv(name);
  return v && *v ? strtoull(v, NULL, 0) : dflt;
}

static inline int prog_expect_preload(void) { return prog_env_u64("TEST_EXPECT_PRELOAD", 0) != 0; }

/* Blocks to allocate: 1.5x the device's memory. */
static inline size_t prog_n_blocks(void) {
  size_t n = (size_t)(prog_env_u64("FAKE_CUDA_TOTAL_MEM", (uint64_t)64 << 20) * 3 / 2 / PROG_BLOCK);
  return n > PROG_MAX_BLOCKS ? PROG_MAX_BLOCKS : n;
}

/* Byte j of block i: distinct per block and position. */
static inline void prog_fill(unsigned char *buf, size_t n, size_t i) {
  for (size_t j = 0; j < n; j++) buf[j] = (unsigned char)((j * 131u + i * 7u + (j >> 12)) & 0xff);
}

static inline void prog_verify(const unsigned char *buf, size_t n, size_t i) {
  for (size_t j = 0; j < n; j++)
    if (buf[j] != (unsigned char)((j * 131u + i * 7u + (j >> 12)) & 0xff))
      PROG_FAIL("block %zu byte %zu: read %u back, wrote %u", i, j, buf[j],
                (unsigned)((j * 131u + i * 7u + (j >> 12)) & 0xff));
}

/* Read every block back (dtoh), check its bytes, free it (free_fn). */
static inline void prog_read_back(size_t n, const CUdeviceptr *d, unsigned char *buf,
                                  CUresult (*dtoh)(void *, CUdeviceptr, size_t),
                                  CUresult (*free_fn)(CUdeviceptr)) {
  for (size_t i = 0; i < n; i++) {
    memset(buf, 0, PROG_BLOCK);
    PROG_CHECK(dtoh(buf, d[i], PROG_BLOCK));
    prog_verify(buf, PROG_BLOCK, i);
    PROG_CHECK(free_fn(d[i]));
  }
}

/* The OOM exit, for the run without the preload. */
static inline void prog_oom(const char *what, size_t i) {
  printf("OOM at block %zu (%s)\n", i, what);
  exit(2);
}

/* With the preload: poll sgm-smi (the registry publishes every
 * SGM_NODE_PERIOD_MS, and at once after a fallback) until this process is
 * listed as interposed with shared bytes; fail after ~10 s. */
static inline void prog_check_smi(void) {
  const char *smi = getenv("TEST_SGM_SMI");
  if (!prog_expect_preload() || !smi) return;
  char cmd[4200], key[64];
  snprintf(cmd, sizeof cmd, "%s --json", smi);
  snprintf(key, sizeof key, "\"pid\": %d,", (int)getpid());
  static char out[1 << 16];
  for (int tries = 0; tries < 400; tries++) {
    FILE *p = popen(cmd, "r");
    if (!p) PROG_FAIL("cannot run %s", cmd);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    pclose(p);
    const char *me = strstr(out, key);
    const char *end = me ? strstr(me, "heartbeat_age_ms") : NULL;
    if (me && end) {
      char rec[4096];
      size_t len = (size_t)(end - me) < sizeof rec - 1 ? (size_t)(end - me) : sizeof rec - 1;
      memcpy(rec, me, len);
      rec[len] = 0;
      const char *sh = strstr(rec, "\"shared\": {\"used_bytes\": ");
      const char *vr = strstr(rec, "\"vram\": {\"used_bytes\": ");
      unsigned long long su = sh ? strtoull(sh + strlen("\"shared\": {\"used_bytes\": "), NULL, 10) : 0;
      unsigned long long vu = vr ? strtoull(vr + strlen("\"vram\": {\"used_bytes\": "), NULL, 10) : 0;
      if (strstr(rec, "\"interposed\": true") && su > 0 && vu > 0) {
        printf("sgm-smi: interposed, vram %llu bytes, shared (fallback) %llu bytes\n", vu, su);
        /* the text view marks the process's line */
        FILE *t = popen(smi, "r");
        if (!t) PROG_FAIL("cannot run %s", smi);
        char line[512], pid[32];
        int marked = 0;
        snprintf(pid, sizeof pid, " %d ", (int)getpid());
        while (fgets(line, sizeof line, t))
          if (strstr(line, pid) && (strstr(line, " i\n") || strstr(line, " i "))) {
            marked = 1;
            printf("sgm-smi line: %s", line);
          }
        pclose(t);
        if (!marked) PROG_FAIL("sgm-smi's text view does not mark pid %d with \" i\" (interposed)", (int)getpid());
        return;
      }
    }
    struct timespec ts = {0, 25 * 1000 * 1000};
    nanosleep(&ts, NULL); /* a poll of another process's publication, bounded */
  }
  PROG_FAIL("sgm-smi never listed pid %d as interposed with VRAM and shared bytes; last output:\n%s",
            (int)getpid(), out);
}

/* The double's live device allocations (its control API, reached through the
 * driver's handle): everything must be freed by the end. */
static inline void prog_check_no_leak(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  uint64_t (*live)(void) = h ? (uint64_t(*)(void))dlsym(h, "fake_cuda_live_allocations") : NULL;
  if (!live) return; /* a real driver: nothing to ask */
  void (*stats)(fake_cuda_stats *) = (void (*)(fake_cuda_stats *))dlsym(h, "fake_cuda_get_stats");
  fake_cuda_stats st = {0};
  if (stats) stats(&st);
  if (st.device_allocs != 0)
    PROG_FAIL("%llu device allocations still live", (unsigned long long)st.device_allocs);
  dlclose(h);
}

#endif
