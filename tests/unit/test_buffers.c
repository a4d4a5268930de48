/*
 * test_buffers.c — movable buffers on the emulated device with a real spill
 * file: data survives every path, acquired buffers never move, priorities
 * order evictions, corruption and I/O failures are caught without losing
 * data, allocations evict released buffers, prefetch races with acquire and
 * destroy (run under TSan in CI).
 */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "internal.h"
#include "test_util.h"
#include "disk_spy.h"
#include "tiers/disk.h"
#include "tiers/tier.h"

#define MiB (UINT64_C(1) << 20)

static char spill_dir[64];

static int setup(void **state) {
  (void)state;
  snprintf(spill_dir, sizeof spill_dir, "/tmp/sgm_buffers_XXXXXX");
  return mkdtemp(spill_dir) ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  return rmdir(spill_dir);
}

/* 8 MiB of VRAM, 16 MiB of shared memory, 256 MiB of spill. */
static sgm_context *make_ctx(bool spill) {
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "8MiB", 1);
  setenv("SGM_SHARED_LIMIT", "16MiB", 1);
  if (spill) {
    setenv("SGM_SPILL_DIR", spill_dir, 1);
    setenv("SGM_SPILL_LIMIT", "256MiB", 1);
  }
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fprintf(stderr, "create: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  return ctx;
}

/* A context with the spill directory and the given SGM_* pairs (NULL-ended). */
static sgm_context *make_ctx_env(const char *const *kv) {
  sgm_test_clean_env();
  setenv("SGM_SPILL_DIR", spill_dir, 1);
  for (size_t i = 0; kv[i]; i += 2) setenv(kv[i], kv[i + 1], 1);
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fail_msg("create: %s", sgm_last_error());
  return ctx;
}

static void fill_pattern(unsigned char *p, size_t n, uint64_t seed) {
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = sgm_test_rng_next(&r);
    size_t k = n - i < 8 ? n - i : 8;
    memcpy(p + i, &x, k);
  }
}

static void check_buffer(sgm_buffer *b, uint64_t seed) {
  size_t n = sgm_buffer_size(b);
  unsigned char *want = malloc(n), *got = malloc(n);
  fill_pattern(want, n, seed);
  sgm_status rc = sgm_buffer_read(b, 0, got, n);
  if (rc != SGM_OK) fail_msg("read: %s", sgm_last_error());
  if (memcmp(want, got, n) != 0) fail_msg("buffer (seed %llu) differs", (unsigned long long)seed);
  free(want);
  free(got);
}

static void write_buffer(sgm_buffer *b, uint64_t seed) {
  size_t n = sgm_buffer_size(b);
  unsigned char *p = malloc(n);
  fill_pattern(p, n, seed);
  assert_int_equal(sgm_buffer_write(b, 0, p, n), SGM_OK);
  free(p);
}

/* Invariant: random data survives every path (VRAM -> shared -> disk -> VRAM,
 * in any order, by explicit eviction and by pressure), byte for byte; stats
 * count bytes moved. */
static void test_data_survives_every_path(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("buffers.paths", 2024);
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  sgm_context *ctx = make_ctx(true);
  enum { N = 40 }; /* about 3x VRAM + shared in all */
  sgm_buffer *b[N];
  uint64_t pat[N];
  for (int i = 0; i < N; i++) {
    size_t sz = (size_t)sgm_test_rng_range(&r, 1000, 1536 * 1024);
    assert_int_equal(sgm_buffer_create(ctx, sz, &b[i]), SGM_OK);
    pat[i] = seed * 1000 + (uint64_t)i;
    write_buffer(b[i], pat[i]);
  }
  for (int step = 0; step < 400; step++) {
    int i = (int)sgm_test_rng_range(&r, 0, N - 1);
    switch (sgm_test_rng_range(&r, 0, 4)) {
      case 0: {
        void *d = NULL;
        sgm_status rc = sgm_buffer_acquire(b[i], NULL, &d);
        if (rc != SGM_OK) fail_msg("acquire: %s", sgm_last_error());
        assert_non_null(d);
        sgm_tier t = sgm_buffer_tier(b[i]);
        assert_true(t == SGM_TIER_VRAM || t == SGM_TIER_SHARED);
        assert_int_equal(sgm_buffer_release(b[i], NULL), SGM_OK);
        break;
      }
      case 1: assert_int_equal(sgm_buffer_evict(b[i], SGM_TIER_SHARED), SGM_OK); break;
      case 2: assert_int_equal(sgm_buffer_evict(b[i], SGM_TIER_DISK), SGM_OK); break;
      case 3: check_buffer(b[i], pat[i]); break;
      case 4:
        pat[i] = sgm_test_rng_next(&r);
        write_buffer(b[i], pat[i]);
        break;
    }
  }
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_true(st.tier[SGM_TIER_DISK].bytes_in > 0);
  assert_true(st.tier[SGM_TIER_VRAM].bytes_out > 0);
  assert_true(st.tier[SGM_TIER_VRAM].bytes_in > 0);
  for (int i = 0; i < N; i++) check_buffer(b[i], pat[i]);
  for (int i = 0; i < N; i++) sgm_buffer_destroy(b[i]);
  sgm_get_stats(ctx, &st);
  for (int t = 0; t < SGM_TIER_COUNT; t++) assert_int_equal(st.tier[t].n_live, 0);
  assert_int_equal(st.tier[SGM_TIER_DISK].used_bytes, 0);
  sgm_context_destroy(ctx);
}

/* Invariant: an acquired buffer never moves: under pressure that evicts
 * everything else, its device address, tier and data stay. */
static void test_acquired_never_move(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(true);
  sgm_buffer *held[3];
  void *ptr[3];
  for (int i = 0; i < 3; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &held[i]), SGM_OK);
    write_buffer(held[i], 77 + (uint64_t)i);
    assert_int_equal(sgm_buffer_acquire(held[i], NULL, &ptr[i]), SGM_OK);
    assert_int_equal(sgm_buffer_tier(held[i]), SGM_TIER_VRAM);
  }
  void *again = NULL;
  assert_int_equal(sgm_buffer_acquire(held[0], NULL, &again), SGM_ERR_BUSY);
  assert_int_equal(sgm_buffer_evict(held[0], SGM_TIER_DISK), SGM_ERR_BUSY);
  sgm_buffer *other[30];
  for (int i = 0; i < 30; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &other[i]), SGM_OK);
    void *d;
    assert_int_equal(sgm_buffer_acquire(other[i], NULL, &d), SGM_OK);
    assert_int_equal(sgm_buffer_release(other[i], NULL), SGM_OK);
  }
  for (int i = 0; i < 3; i++) {
    assert_int_equal(sgm_buffer_tier(held[i]), SGM_TIER_VRAM);
    check_buffer(held[i], 77 + (uint64_t)i);
    assert_int_equal(sgm_buffer_release(held[i], NULL), SGM_OK);
  }
  /* And an allocation that needs their room now may take it. */
  for (int i = 0; i < 30; i++) sgm_buffer_destroy(other[i]);
  for (int i = 0; i < 3; i++) sgm_buffer_destroy(held[i]);
  sgm_context_destroy(ctx);
}

/* Invariant: a lower priority leaves VRAM first; within a priority the least
 * recently used leaves first. */
static void test_priorities_order_evictions(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(true);
  sgm_buffer *b[8];
  for (int i = 0; i < 8; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &b[i]), SGM_OK);
    assert_int_equal(sgm_buffer_tier(b[i]), SGM_TIER_VRAM);
  }
  assert_int_equal(sgm_buffer_set_priority(b[0], SGM_PRIORITY_MAXIMUM), SGM_OK);
  assert_int_equal(sgm_buffer_set_priority(b[1], SGM_PRIORITY_HIGH), SGM_OK);
  assert_int_equal(sgm_buffer_set_priority(b[6], SGM_PRIORITY_MINIMUM), SGM_OK);
  assert_int_equal(sgm_buffer_set_priority(b[7], SGM_PRIORITY_LOW), SGM_OK);
  assert_int_equal(sgm_buffer_set_priority(b[7], 9), SGM_ERR_INVALID);
  /* Touch b[2] so that b[3] is the least recently used of the NORMAL ones. */
  void *d;
  assert_int_equal(sgm_buffer_acquire(b[2], NULL, &d), SGM_OK);
  assert_int_equal(sgm_buffer_release(b[2], NULL), SGM_OK);
  int expect[] = {6, 7, 3, 4, 5, 2, 1, 0};
  for (int k = 0; k < 8; k++) {
    sgm_buffer *n;
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &n), SGM_OK);
    assert_int_equal(sgm_buffer_tier(n), SGM_TIER_VRAM);
    for (int j = 0; j <= k; j++) assert_int_equal(sgm_buffer_tier(b[expect[j]]), SGM_TIER_SHARED);
    for (int j = k + 1; j < 8; j++) assert_int_equal(sgm_buffer_tier(b[expect[j]]), SGM_TIER_VRAM);
    /* Keep the newcomer out of the way: acquired, so never a victim. */
    assert_int_equal(sgm_buffer_acquire(n, NULL, &d), SGM_OK);
  }
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  assert_int_equal(st.tier[SGM_TIER_VRAM].n_evictions, 8);
  sgm_context_destroy(ctx); /* frees every buffer still alive */
}

/* Flip one bit of the byte at `at` in b's first extent in the spill file. */
static void corrupt_extent(sgm_context *ctx, sgm_buffer *b, uint64_t at) {
  uint64_t off;
  assert_true(sgm__buffer_disk_offset(b, &off));
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", sgm__disk_fd(sgm__placement_disk(ctx)));
  int fd = open(path, O_RDWR);
  assert_true(fd >= 0);
  unsigned char byte;
  assert_int_equal(pread(fd, &byte, 1, (off_t)(off + at)), 1);
  byte ^= 0x40;
  assert_int_equal(pwrite(fd, &byte, 1, (off_t)(off + at)), 1);
  close(fd);
}

/* Invariant: a flipped byte in the spill file is caught by the checksum:
 * read and acquire fail with SGM_ERR_CORRUPT, never return garbage, and the
 * buffer stays on disk. */
static void test_corruption_detected(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(true);
  sgm_buffer *b;
  assert_int_equal(sgm_buffer_create(ctx, 100000, &b), SGM_OK);
  write_buffer(b, 5);
  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
  assert_int_equal(sgm_buffer_tier(b), SGM_TIER_DISK);
  check_buffer(b, 5);
  corrupt_extent(ctx, b, 4321);
  unsigned char out[16];
  assert_int_equal(sgm_buffer_read(b, 0, out, sizeof out), SGM_ERR_CORRUPT);
  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_ERR_CORRUPT);
  assert_null(d);
  assert_int_equal(sgm_buffer_tier(b), SGM_TIER_DISK);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

/* Invariant: injected ENOSPC, EIO and short writes make a spill fail with
 * SGM_ERR_IO and leave the buffer readable where it was. */
static void test_io_errors_lose_nothing(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(true);
  sgm_disk *disk = sgm__placement_disk(ctx);
  assert_non_null(disk);
  sgm_disk_fault kinds[] = {SGM_DISK_FAULT_ENOSPC, SGM_DISK_FAULT_EIO, SGM_DISK_FAULT_SHORT};
  for (int k = 0; k < 3; k++) {
    sgm_buffer *b;
    assert_int_equal(sgm_buffer_create(ctx, 300000, &b), SGM_OK);
    write_buffer(b, 900 + (uint64_t)k);
    assert_int_equal(sgm_buffer_evict(b, SGM_TIER_SHARED), SGM_OK);
    sgm__disk_inject(disk, kinds[k], 1);
    assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_ERR_IO);
    assert_true(strlen(sgm_last_error()) > 0);
    assert_int_equal(sgm_buffer_tier(b), SGM_TIER_SHARED);
    check_buffer(b, 900 + (uint64_t)k);
    /* The fault was one-shot: the next spill works. */
    assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
    check_buffer(b, 900 + (uint64_t)k);
    sgm_buffer_destroy(b);
  }
  sgm_context_destroy(ctx);
}

/* Invariant: sgm_alloc makes room by demoting released buffers (rule 2), and
 * without a spill directory, running out says how to turn the disk tier on. */
static void test_alloc_evicts_and_no_disk_message(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(false);
  sgm_buffer *b[8];
  for (int i = 0; i < 8; i++) assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &b[i]), SGM_OK);
  void *p = sgm_alloc(ctx, 4 * MiB, NULL);
  assert_non_null(p);
  assert_int_equal(sgm_pointer_tier(ctx, p), SGM_TIER_VRAM);
  int moved = 0;
  for (int i = 0; i < 8; i++) moved += sgm_buffer_tier(b[i]) == SGM_TIER_SHARED;
  assert_true(moved >= 4);
  sgm_buffer *more[40];
  int n = 0;
  sgm_status rc = SGM_OK;
  while (n < 40 && (rc = sgm_buffer_create(ctx, 1 * MiB, &more[n])) == SGM_OK) n++;
  assert_int_equal(rc, SGM_ERR_NOMEM);
  assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_DIR"));
  sgm_free(ctx, p, NULL);
  sgm_context_destroy(ctx);
}

/* Invariant: a buffer created straight on disk reads as zeros until written,
 * and comes up when acquired once there is room. */
static void test_created_on_disk(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(true);
  /* 8 MiB of VRAM and 16 MiB of shared memory, all acquired: nothing to evict. */
  sgm_buffer *b[24];
  for (int i = 0; i < 24; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &b[i]), SGM_OK);
    void *d;
    assert_int_equal(sgm_buffer_acquire(b[i], NULL, &d), SGM_OK);
    assert_int_equal(sgm_buffer_tier(b[i]), i < 8 ? SGM_TIER_VRAM : SGM_TIER_SHARED);
  }
  sgm_buffer *z;
  assert_int_equal(sgm_buffer_create(ctx, 64 * 1024, &z), SGM_OK);
  assert_int_equal(sgm_buffer_tier(z), SGM_TIER_DISK);
  unsigned char buf[64];
  memset(buf, 0xAA, sizeof buf);
  assert_int_equal(sgm_buffer_read(z, 1000, buf, sizeof buf), SGM_OK);
  for (size_t i = 0; i < sizeof buf; i++) assert_int_equal(buf[i], 0);
  write_buffer(z, 31337);
  check_buffer(z, 31337);
  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(z, NULL, &d), SGM_ERR_NOMEM); /* no room anywhere */
  assert_int_equal(sgm_buffer_tier(z), SGM_TIER_DISK);
  assert_int_equal(sgm_buffer_release(b[0], NULL), SGM_OK);
  assert_int_equal(sgm_buffer_acquire(z, NULL, &d), SGM_OK); /* b[0] makes way */
  assert_int_equal(sgm_buffer_tier(z), SGM_TIER_VRAM);
  check_buffer(z, 31337);
  sgm_context_destroy(ctx);
}

/* Prefetch worker against acquire/release/destroy from other threads. */
typedef struct race_arg {
  sgm_buffer **b; /* shared buffer array */
  int n;          /* entries */
  uint64_t seed;  /* per-thread seed */
  int errors;     /* unexpected statuses */
} race_arg;

static void *race_thread(void *vp) {
  race_arg *a = vp;
  sgm_test_rng r;
  sgm_test_rng_init(&r, a->seed);
  for (int i = 0; i < 300; i++) {
    /* Each thread owns the buffers i % 2 == its parity (one buffer, one thread). */
    int k = (int)(sgm_test_rng_range(&r, 0, (uint64_t)a->n / 2 - 1) * 2 + (a->seed & 1));
    void *d;
    sgm_status rc = sgm_buffer_prefetch(a->b[k], NULL);
    if (rc != SGM_OK) a->errors++;
    if (sgm_test_rng_range(&r, 0, 1)) {
      rc = sgm_buffer_acquire(a->b[k], NULL, &d);
      if (rc == SGM_OK) rc = sgm_buffer_release(a->b[k], NULL);
      if (rc != SGM_OK) a->errors++;
    } else {
      rc = sgm_buffer_evict(a->b[k], SGM_TIER_DISK);
      if (rc != SGM_OK) a->errors++;
    }
  }
  return NULL;
}

static void test_prefetch_races(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("buffers.prefetch", 99);
  sgm_context *ctx = make_ctx(true);
  enum { N = 24 };
  sgm_buffer *b[N];
  for (int i = 0; i < N; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 512 * 1024, &b[i]), SGM_OK);
    write_buffer(b[i], (uint64_t)i);
  }
  pthread_t th[2];
  race_arg args[2];
  for (int t = 0; t < 2; t++) {
    args[t] = (race_arg){.b = b, .n = N, .seed = seed * 2 + (uint64_t)t};
    pthread_create(&th[t], NULL, race_thread, &args[t]);
  }
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  for (int t = 0; t < 2; t++) assert_int_equal(args[t].errors, 0);
  for (int i = 0; i < N; i++) {
    sgm_buffer_prefetch(b[i], NULL);
    if (i % 2) sgm_buffer_destroy(b[i]); /* destroy with a prefetch queued or running */
    else check_buffer(b[i], (uint64_t)i);
  }
  for (int i = 0; i < N; i += 2) sgm_buffer_destroy(b[i]);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  for (int t = 0; t < SGM_TIER_COUNT; t++) assert_int_equal(st.tier[t].n_live, 0);
  sgm_context_destroy(ctx);
}

/* Invariant: bad arguments are refused with SGM_ERR_INVALID and a message. */
static void test_bad_arguments(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(false);
  sgm_buffer *b = NULL;
  assert_int_equal(sgm_buffer_create(ctx, 0, &b), SGM_ERR_INVALID);
  assert_null(b);
  assert_int_equal(sgm_buffer_create(NULL, 10, &b), SGM_ERR_INVALID);
  assert_int_equal(sgm_buffer_create(ctx, 100, &b), SGM_OK);
  char x[200];
  assert_int_equal(sgm_buffer_write(b, 50, x, 51), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "past the buffer"));
  assert_int_equal(sgm_buffer_read(b, SIZE_MAX, x, 2), SGM_ERR_INVALID);
  assert_int_equal(sgm_buffer_release(b, NULL), SGM_ERR_INVALID);
  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_VRAM), SGM_ERR_INVALID);
  assert_int_equal(sgm_buffer_tier(NULL), SGM_TIER_NONE);
  sgm_buffer_destroy(NULL);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

/* ---- hostile inputs (issue 12) ---- */

/* Invariant (#2): sgm_free of the device pointer an acquired buffer handed
 * out is refused as foreign (SGM_ERR_INVALID, counted as a bad free) and
 * frees nothing: the next allocation does not get that address and the
 * buffer's bytes stay. (It used to answer SGM_OK.) */
static void test_free_refuses_buffer_block(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(false);
  sgm_buffer *b;
  assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &b), SGM_OK);
  write_buffer(b, 77);
  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
  assert_int_equal(sgm_free_ex(ctx, d, NULL), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "sgm_buffer"));
  void *p = sgm_alloc(ctx, 1 * MiB, NULL);
  assert_non_null(p);
  assert_ptr_not_equal(p, d);
  assert_int_equal(sgm_free_ex(ctx, p, NULL), SGM_OK);
  assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
  /* In shared memory too, after a move. */
  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_SHARED), SGM_OK);
  void *big = sgm_alloc(ctx, 8 * MiB, NULL); /* VRAM full: acquire stays in shared */
  assert_non_null(big);
  assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, d), SGM_TIER_SHARED);
  assert_int_equal(sgm_free_ex(ctx, d, NULL), SGM_ERR_INVALID);
  assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
  check_buffer(b, 77);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_bad_frees, 2);
  assert_int_equal(sgm_free_ex(ctx, big, NULL), SGM_OK);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

/* Invariant (#4): a failure to demote (every spill write fails: a full file
 * system) never fails a request that fits without demoting: sgm_alloc of
 * 1000 KiB lands in the 1 MiB of shared memory left, and acquiring a buffer
 * that sits in shared memory uses it there. (Both failed with the disk's
 * ENOSPC.) */
static void test_demotion_failure_fails_nothing_that_fits(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(true); /* VRAM 8 MiB, shared 16 MiB */
  sgm_buffer *x, *s, *v[4];
  assert_int_equal(sgm_buffer_create(ctx, 2 * MiB, &x), SGM_OK);
  write_buffer(x, 41);
  assert_int_equal(sgm_buffer_evict(x, SGM_TIER_SHARED), SGM_OK);
  assert_int_equal(sgm_buffer_create(ctx, 13 * MiB, &s), SGM_OK);
  assert_int_equal(sgm_buffer_tier(s), SGM_TIER_SHARED);
  for (int i = 0; i < 4; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 2 * MiB, &v[i]), SGM_OK);
    assert_int_equal(sgm_buffer_tier(v[i]), SGM_TIER_VRAM);
  }
  sgm__disk_inject(sgm__placement_disk(ctx), SGM_DISK_FAULT_ENOSPC, UINT64_MAX);
  void *p = sgm_alloc(ctx, 1000 << 10, NULL);
  if (!p) fail_msg("sgm_alloc(1000 KiB): %s", sgm_last_error());
  assert_int_equal(sgm_pointer_tier(ctx, p), SGM_TIER_SHARED);
  assert_int_equal(sgm_free_ex(ctx, p, NULL), SGM_OK);
  void *d = NULL;
  sgm_status rc = sgm_buffer_acquire(x, NULL, &d);
  if (rc != SGM_OK) fail_msg("acquire: %s", sgm_last_error());
  assert_int_equal(sgm_pointer_tier(ctx, d), SGM_TIER_SHARED);
  assert_int_equal(sgm_buffer_release(x, NULL), SGM_OK);
  check_buffer(x, 41);
  for (int i = 0; i < 4; i++) sgm_buffer_destroy(v[i]);
  sgm_buffer_destroy(s);
  sgm_buffer_destroy(x);
  sgm__disk_inject(sgm__placement_disk(ctx), SGM_DISK_FAULT_NONE, 0);
  sgm_context_destroy(ctx);
}

/* Invariant (#7, #9): a write covering the whole of a corrupt buffer
 * replaces the lost contents (it used to return SGM_ERR_CORRUPT forever); a
 * partial write still reports the corruption; a failed write to a
 * disk-resident buffer leaves all its old contents (the documented contract). */
static void test_rewrite_corrupt_and_failed_writes(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(true);
  sgm_buffer *b;
  const size_t n = 300000;
  assert_int_equal(sgm_buffer_create(ctx, n, &b), SGM_OK);
  write_buffer(b, 61);
  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
  corrupt_extent(ctx, b, 123);
  unsigned char small[64] = {0};
  assert_int_equal(sgm_buffer_write(b, 10, small, sizeof small), SGM_ERR_CORRUPT);
  write_buffer(b, 62); /* asserts SGM_OK */
  check_buffer(b, 62);

  /* Failed writes, disk-resident: partial and whole, nothing changes. */
  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
  unsigned char *other = malloc(n);
  assert_non_null(other);
  memset(other, 0xEE, n);
  sgm__disk_inject(sgm__placement_disk(ctx), SGM_DISK_FAULT_ENOSPC, 1);
  assert_int_equal(sgm_buffer_write(b, 1000, other, 5000), SGM_ERR_IO);
  check_buffer(b, 62);
  sgm__disk_inject(sgm__placement_disk(ctx), SGM_DISK_FAULT_EIO, 1);
  assert_int_equal(sgm_buffer_write(b, 0, other, n), SGM_ERR_IO);
  check_buffer(b, 62);
  assert_int_equal(sgm_buffer_tier(b), SGM_TIER_DISK);
  free(other);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

/* Invariant (#12): when the driver has no memory for an acquire (another
 * process took the device), the message says so; it does not blame a full
 * budget nor claim that "everything resident is acquired". */
static void test_acquire_driver_oom_message(void **state) {
  (void)state;
  static const char *const env[] = {"SGM_EMU_VRAM", "4MiB", "SGM_VRAM_FRACTION", "1",
                                    "SGM_SHARED_LIMIT", "1MiB", "SGM_SPILL_LIMIT", "64MiB", NULL};
  sgm_context *ctx = make_ctx_env(env);
  sgm_devptr hog = 0; /* another process's memory, as far as sgm can tell */
  assert_int_equal(sgm__context_bops(ctx)->device_alloc(sgm__context_be(ctx), 3 * MiB + 512 * 1024, &hog), SGM_OK);
  sgm_buffer *b;
  assert_int_equal(sgm_buffer_create(ctx, 2 * MiB, &b), SGM_OK);
  assert_int_equal(sgm_buffer_tier(b), SGM_TIER_DISK);
  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_ERR_NOMEM);
  const char *msg = sgm_last_error();
  print_message("# %s\n", msg);
  assert_non_null(strstr(msg, "out of memory"));
  assert_null(strstr(msg, "everything resident is acquired"));
  assert_null(strstr(msg, "VRAM budget exhausted"));
  sgm_buffer_destroy(b);
  sgm__context_bops(ctx)->device_free(sgm__context_be(ctx), hog, 3 * MiB + 512 * 1024);
  sgm_context_destroy(ctx);
}

/* Invariant (#10, issue 29): a destroyed buffer is recognised in every build,
 * release included: a call on it is SGM_ERR_INVALID ("destroyed"), and
 * destroying it again frees nothing and says so instead of freeing freed
 * memory (which crashed release builds; debug builds stopped the program). The
 * context still works and tears down cleanly afterwards. */
static void test_double_destroy_detected(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(false);
  sgm_buffer *b;
  assert_int_equal(sgm_buffer_create(ctx, 4096, &b), SGM_OK);
  sgm_buffer_destroy(b);
  unsigned char x = 1;
  assert_int_equal(sgm_buffer_write(b, 0, &x, 1), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "destroyed"));
  sgm_buffer_destroy(b);
  print_message("# %s\n", sgm_last_error());
  assert_non_null(strstr(sgm_last_error(), "sgm_buffer_destroy"));
  assert_non_null(strstr(sgm_last_error(), "destroyed"));
  sgm_buffer *c;
  assert_int_equal(sgm_buffer_create(ctx, 4096, &c), SGM_OK);
  assert_int_equal(sgm_buffer_write(c, 0, &x, 1), SGM_OK);
  sgm_buffer_destroy(c);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.tier[SGM_TIER_VRAM].n_live, 0);
  sgm_context_destroy(ctx);
}

/* Invariant (#8): a write into a disk-resident buffer moves only the
 * SGM_DISK_CHUNK-sized pieces it touches: 16 writes of 1 MiB into a 64 MiB
 * buffer with 4 MiB budgets write 64 MiB to the spill file and read back at
 * most 48 MiB (they wrote the whole 64 MiB buffer each time, reading it back
 * first: 1 GiB each way; the 64 writes took 14 s), and every byte
 * reads back as written. Measured in bytes, not time. */
static void test_partial_writes_touch_only_their_chunks(void **state) {
  (void)state;
  static const char *const env[] = {"SGM_EMU_VRAM", "64MiB", "SGM_VRAM_LIMIT", "4MiB",
                                    "SGM_SHARED_LIMIT", "4MiB", "SGM_SPILL_LIMIT", "256MiB", NULL};
  sgm_context *ctx = make_ctx_env(env);
  sgm_buffer *b;
  assert_int_equal(sgm_buffer_create(ctx, 64 * MiB, &b), SGM_OK);
  assert_int_equal(sgm_buffer_tier(b), SGM_TIER_DISK);
  /* Created on disk: its 64 MiB are reserved in the disk tier's budget, once. */
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.tier[SGM_TIER_DISK].used_bytes, 64 * MiB);
  unsigned char *piece = malloc(MiB);
  assert_non_null(piece);
  sgm_tier_stats before, after;
  sgm__disk_stats(sgm__placement_disk(ctx), &before);
  for (size_t i = 0; i < 16; i++) {
    memset(piece, (int)(i + 1), MiB);
    assert_int_equal(sgm_buffer_write(b, i * MiB, piece, MiB), SGM_OK);
  }
  sgm__disk_stats(sgm__placement_disk(ctx), &after);
  uint64_t written = after.bytes_in - before.bytes_in, read = after.bytes_out - before.bytes_out;
  print_message("# 16 x 1 MiB writes: %llu MiB written, %llu MiB read back\n",
                (unsigned long long)(written / MiB), (unsigned long long)(read / MiB));
  assert_true(written > 0 && written <= 64 * MiB);
  assert_true(read <= 48 * MiB);
  /* Written chunks turned their reservation into extents: still 64 MiB. */
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.tier[SGM_TIER_DISK].used_bytes, 64 * MiB);
  memset(piece, 0x7F, MiB);
  assert_int_equal(sgm_buffer_write(b, 4 * MiB - MiB / 2, piece, MiB), SGM_OK);
  for (size_t i = 0; i < 17; i++) {
    assert_int_equal(sgm_buffer_read(b, i * MiB, piece, MiB), SGM_OK);
    for (size_t k = 0; k < MiB; k += 4093) {
      size_t at = i * MiB + k;
      int want = at >= 4 * MiB - MiB / 2 && at < 4 * MiB + MiB / 2 ? 0x7F : i < 16 ? (int)(i + 1) : 0;
      if (piece[k] != want) fail_msg("byte %zu is %d, want %d", at, piece[k], want);
    }
  }
  free(piece);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

/* Invariant (disk tier staging): transfers between the spill file and VRAM
 * go chunk by chunk through one pinned staging buffer the disk tier keeps:
 * the first such transfer pins SGM_DISK_STAGE_BYTES once, later ones pin
 * nothing more, and the data survives three round trips of a buffer larger
 * than one chunk. */
static void test_disk_vram_staging_is_kept(void **state) {
  (void)state;
  /* No room in shared memory: VRAM <-> disk directly. */
  static const char *const env[] = {"SGM_EMU_VRAM", "64MiB", "SGM_VRAM_LIMIT", "16MiB",
                                    "SGM_SHARED_LIMIT", "64KiB", "SGM_SPILL_LIMIT", "64MiB", NULL};
  sgm_context *ctx = make_ctx_env(env);
  sgm_buffer *b;
  assert_int_equal(sgm_buffer_create(ctx, 6 * MiB + 123, &b), SGM_OK);
  write_buffer(b, 808);
  sgm_backend_counters c0, c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c0);
  for (int round = 0; round < 3; round++) {
    assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
    void *d = NULL;
    assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
    assert_int_equal(sgm_pointer_tier(ctx, d), SGM_TIER_VRAM);
    assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
    sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
    assert_int_equal(c.n_host_live, c0.n_host_live + 1);
    assert_int_equal(c.host_live_bytes, c0.host_live_bytes + SGM_DISK_STAGE_BYTES);
  }
  check_buffer(b, 808);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_data_survives_every_path),
      cmocka_unit_test(test_acquired_never_move),
      cmocka_unit_test(test_priorities_order_evictions),
      cmocka_unit_test(test_corruption_detected),
      cmocka_unit_test(test_io_errors_lose_nothing),
      cmocka_unit_test(test_alloc_evicts_and_no_disk_message),
      cmocka_unit_test(test_created_on_disk),
      cmocka_unit_test(test_prefetch_races),
      cmocka_unit_test(test_bad_arguments),
      cmocka_unit_test(test_free_refuses_buffer_block),
      cmocka_unit_test(test_demotion_failure_fails_nothing_that_fits),
      cmocka_unit_test(test_rewrite_corrupt_and_failed_writes),
      cmocka_unit_test(test_acquire_driver_oom_message),
      cmocka_unit_test(test_double_destroy_detected),
      cmocka_unit_test(test_partial_writes_touch_only_their_chunks),
      cmocka_unit_test(test_disk_vram_staging_is_kept),
  };
  /* CMOCKA_FILTER=test_name runs one test (checking a test against old code). */
  if (getenv("CMOCKA_FILTER")) cmocka_set_test_filter(getenv("CMOCKA_FILTER"));
  return cmocka_run_group_tests_name("buffers", tests, setup, teardown);
}
