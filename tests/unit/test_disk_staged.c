/*
 * test_disk_staged.c — the disk tier's public path on the emulated device
 * (issue 11): an eviction VRAM -> disk and a promotion disk -> VRAM move in
 * one hop through the disk tier's pinned staging slots, pipelined (the I/O of
 * piece k in flight while piece k+1 is copied), one checksummed extent per
 * 4 MiB piece; freed extents keep their blocks for the next write.
 *
 * The disk tier's I/O engine is the spy (tests/support/disk_spy.c): it counts
 * every request the engine is asked for, how many extents have requests in
 * flight at once, and fails the nth extent write on demand. Random data
 * prints its seed (SGM_TEST_SEED replays it).
 */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "backend/backend.h"
#include "disk_spy.h"
#include "placement/placement.h"
#include "test_util.h"
#include "tiers/disk.h"

#define MiB (UINT64_C(1) << 20)
#define PIECE SGM_DISK_CHUNK

static char spill_dir[64];
static uint64_t seed;

static int setup(void **state) {
  (void)state;
  snprintf(spill_dir, sizeof spill_dir, "/tmp/sgm_staged_XXXXXX");
  seed = sgm_test_seed("disk staged", (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32));
  return mkdtemp(spill_dir) ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  return rmdir(spill_dir);
}

/* An emulated device with 64 MiB of VRAM, room in shared memory (so that a
 * two-hop eviction would find a block there), and spill_limit of disk. */
static sgm_context *make_ctx(const char *spill_limit) {
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_SHARED_LIMIT", "64MiB", 1);
  setenv("SGM_SPILL_DIR", spill_dir, 1);
  setenv("SGM_SPILL_LIMIT", spill_limit, 1);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) fail_msg("create: %s", sgm_last_error());
  return ctx;
}

static void fill_random(unsigned char *p, size_t n, uint64_t s) {
  sgm_test_rng r;
  sgm_test_rng_init(&r, s);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = sgm_test_rng_next(&r);
    memcpy(p + i, &x, n - i < 8 ? n - i : 8);
  }
}

/* A VRAM-resident buffer of n bytes holding random data (*data, malloc'd). */
static sgm_buffer *make_buffer(sgm_context *ctx, size_t n, uint64_t s, unsigned char **data) {
  sgm_buffer *b = NULL;
  assert_int_equal(sgm_buffer_create(ctx, n, &b), SGM_OK);
  assert_int_equal(sgm_buffer_tier(b), SGM_TIER_VRAM);
  *data = malloc(n);
  assert_non_null(*data);
  fill_random(*data, n, s);
  assert_int_equal(sgm_buffer_write(b, 0, *data, n), SGM_OK);
  return b;
}

static void check_buffer(sgm_buffer *b, const unsigned char *data, size_t n) {
  unsigned char *back = malloc(n);
  assert_non_null(back);
  memset(back, 0xEE, n);
  assert_int_equal(sgm_buffer_read(b, 0, back, n), SGM_OK);
  assert_memory_equal(back, data, n);
  free(back);
}

static sgm_tier_stats tier_stats(sgm_context *ctx, sgm_tier t) {
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  return st.tier[t];
}

static uint64_t n_pieces(uint64_t n) { return (n + PIECE - 1) / PIECE; }

/* Bytes the file sees for n bytes of data: every piece padded to 4 KiB in
 * DIRECT mode. */
static uint64_t padded(sgm_disk *d, uint64_t n) {
  if (sgm__disk_io_mode(d) != SGM_DISK_IO_DIRECT) return n;
  uint64_t full = n / PIECE, rest = n % PIECE;
  return full * PIECE + (rest + 4095) / 4096 * 4096;
}

/* Invariant (one hop, pipelined): evicting a VRAM-resident buffer to disk
 * while shared memory has room takes no shared-memory block (shared memory's
 * peak and bytes_in do not move), writes exactly its pieces once (one extent
 * each), and keeps more than one piece's I/O in flight; acquiring it back
 * reads each extent once with more than one in flight, into VRAM, byte for
 * byte. A two-hop or an unpipelined path fails it. */
static void test_one_hop_pipelined(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("256MiB");
  sgm_disk *disk = sgm__placement_disk(ctx);
  const size_t n = 3 * PIECE + 17;
  unsigned char *data;
  sgm_buffer *b = make_buffer(ctx, n, seed, &data);
  sgm_tier_stats sh0 = tier_stats(ctx, SGM_TIER_SHARED);
  sgm_disk_spy_counts c;
  sgm__disk_spy_counts(disk, true, &c);

  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
  assert_int_equal(sgm_buffer_tier(b), SGM_TIER_DISK);
  sgm_tier_stats sh1 = tier_stats(ctx, SGM_TIER_SHARED);
  assert_int_equal(sh1.peak_used_bytes, sh0.peak_used_bytes);
  assert_int_equal(sh1.bytes_in, sh0.bytes_in);
  assert_int_equal(sh1.used_bytes, sh0.used_bytes);
  sgm_tier_stats dk = tier_stats(ctx, SGM_TIER_DISK);
  assert_int_equal(dk.bytes_in, n);
  assert_int_equal(tier_stats(ctx, SGM_TIER_VRAM).bytes_out, n);
  sgm__disk_spy_counts(disk, true, &c);
  assert_int_equal(c.n_write_transfers, n_pieces(n));
  assert_int_equal(c.write_bytes, padded(disk, n));
  bool aio = sgm__disk_io_mode(disk) == SGM_DISK_IO_DIRECT && c.max_in_flight > 0;
  if (aio) assert_true(c.max_extents_in_flight >= 2);

  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
  assert_int_equal(sgm_pointer_tier(ctx, d), SGM_TIER_VRAM);
  assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
  sgm__disk_spy_counts(disk, true, &c);
  assert_int_equal(c.n_read_transfers, n_pieces(n));
  assert_int_equal(c.read_bytes, padded(disk, n));
  assert_int_equal(c.n_write_transfers, 0);
  if (aio) assert_true(c.max_extents_in_flight >= 2);
  assert_int_equal(tier_stats(ctx, SGM_TIER_SHARED).peak_used_bytes, sh0.peak_used_bytes);
  check_buffer(b, data, n);
  if (!aio) print_message("# no Linux AIO or O_DIRECT here: pipelining not checked\n");
  free(data);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

/* Invariant: bytes survive evict/acquire byte for byte at sizes that are
 * not multiples of the staging piece (1 B, 4 KiB - 1, one piece, one piece
 * + 1, three pieces + 17 B, five pieces + 4095 B: more pieces than staging
 * slots), three round trips each, also read straight from disk. */
static void test_sizes_survive(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("256MiB");
  const size_t sizes[] = {1, 4095, PIECE, PIECE + 1, 3 * PIECE + 17, 5 * PIECE + 4095};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    unsigned char *data;
    sgm_buffer *b = make_buffer(ctx, sizes[i], seed + i, &data);
    for (int round = 0; round < 3; round++) {
      assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
      assert_int_equal(sgm_buffer_tier(b), SGM_TIER_DISK);
      if (round == 1) check_buffer(b, data, sizes[i]); /* from disk, through one piece */
      void *d = NULL;
      assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
      assert_int_equal(sgm_buffer_tier(b), SGM_TIER_VRAM);
      assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
      check_buffer(b, data, sizes[i]);
    }
    free(data);
    sgm_buffer_destroy(b);
  }
  assert_int_equal(tier_stats(ctx, SGM_TIER_DISK).used_bytes, 0);
  sgm_context_destroy(ctx);
}

/* Invariant: a write failure injected at piece k (ENOSPC or EIO, k = 1..4
 * of a four-piece buffer) fails the eviction with SGM_ERR_IO naming
 * SGM_SPILL_LIMIT, and leaves the buffer in VRAM with its bytes, the disk
 * budget (used, live extents) unchanged and nothing counted as moved; the
 * next eviction works. A full budget is SGM_ERR_NOMEM naming
 * SGM_SPILL_LIMIT, with the buffer in VRAM and no byte written. */
static void test_write_failure_leaves_buffer(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("256MiB");
  sgm_disk *disk = sgm__placement_disk(ctx);
  const size_t n = 3 * PIECE + 17;
  unsigned char *data;
  sgm_buffer *b = make_buffer(ctx, n, seed + 100, &data);
  const sgm_disk_fault kinds[] = {SGM_DISK_FAULT_ENOSPC, SGM_DISK_FAULT_EIO};
  for (int kind = 0; kind < 2; kind++) {
    for (uint64_t k = 1; k <= n_pieces(n); k++) {
      sgm_tier_stats before = tier_stats(ctx, SGM_TIER_DISK);
      sgm__disk_inject(disk, kinds[kind], k);
      assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_ERR_IO);
      assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_LIMIT"));
      assert_int_equal(sgm_buffer_tier(b), SGM_TIER_VRAM);
      sgm_tier_stats after = tier_stats(ctx, SGM_TIER_DISK);
      assert_int_equal(after.used_bytes, before.used_bytes);
      assert_int_equal(after.n_live, before.n_live);
      assert_int_equal(after.bytes_in, before.bytes_in);
      check_buffer(b, data, n);
      /* Fired once: the next eviction works. */
      assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
      void *d = NULL;
      assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
      assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
      check_buffer(b, data, n);
    }
  }
  sgm__disk_inject(disk, SGM_DISK_FAULT_NONE, 0);
  free(data);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);

  /* A budget smaller than the buffer. */
  ctx = make_ctx("8MiB");
  disk = sgm__placement_disk(ctx);
  b = make_buffer(ctx, n, seed + 101, &data);
  sgm_disk_spy_counts c;
  sgm__disk_spy_counts(disk, true, &c);
  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_ERR_NOMEM);
  assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_LIMIT"));
  assert_int_equal(sgm_buffer_tier(b), SGM_TIER_VRAM);
  sgm__disk_spy_counts(disk, true, &c);
  assert_int_equal(c.write_requests, 0);
  assert_int_equal(tier_stats(ctx, SGM_TIER_DISK).used_bytes, 0);
  check_buffer(b, data, n);
  free(data);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

/* Flip one bit of the byte at `at` of b's data in the spill file. */
static void flip(sgm_context *ctx, sgm_buffer *b, uint64_t at) {
  const sgm_disk_extent *e = &b->ext[at / PIECE];
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", sgm__disk_fd(sgm__placement_disk(ctx)));
  int fd = open(path, O_RDWR);
  assert_true(fd >= 0);
  unsigned char byte;
  off_t pos = (off_t)(e->offset + at % PIECE);
  assert_int_equal(pread(fd, &byte, 1, pos), 1);
  byte ^= 0x10;
  assert_int_equal(pwrite(fd, &byte, 1, pos), 1);
  assert_int_equal(fdatasync(fd), 0);
  close(fd);
}

/* Invariant: a checksum failure in any piece of a staged promotion (the
 * first, one in the middle while others are in flight, the partial last)
 * is SGM_ERR_CORRUPT; the buffer stays on disk with all its extents (disk
 * used and live extents unchanged) and no VRAM kept; flipping the bit back
 * makes the acquire work with every byte intact. */
static void test_checksum_failure_keeps_extents(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("256MiB");
  const size_t n = 3 * PIECE + 17;
  unsigned char *data;
  sgm_buffer *b = make_buffer(ctx, n, seed + 200, &data);
  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
  const uint64_t where[] = {5, PIECE + PIECE / 2, 3 * PIECE + 16};
  for (size_t i = 0; i < sizeof where / sizeof where[0]; i++) {
    sgm_tier_stats before = tier_stats(ctx, SGM_TIER_DISK);
    uint64_t vram_used = tier_stats(ctx, SGM_TIER_VRAM).used_bytes;
    flip(ctx, b, where[i]);
    void *d = NULL;
    assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_ERR_CORRUPT);
    assert_non_null(strstr(sgm_last_error(), "checksum"));
    assert_int_equal(sgm_buffer_tier(b), SGM_TIER_DISK);
    sgm_tier_stats after = tier_stats(ctx, SGM_TIER_DISK);
    assert_int_equal(after.used_bytes, before.used_bytes);
    assert_int_equal(after.n_live, before.n_live);
    assert_int_equal(tier_stats(ctx, SGM_TIER_VRAM).used_bytes, vram_used);
    flip(ctx, b, where[i]);
  }
  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
  assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
  check_buffer(b, data, n);
  free(data);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

/* Invariant (kept blocks, staging kept): after the first round trip, more
 * round trips of the same buffer neither grow the spill file (freed extents'
 * blocks are overwritten, reported as cached_bytes) nor pin more staging
 * memory (one region of SGM_DISK_STAGE_BYTES); sgm_trim gives both back:
 * the file holds no block, no host memory stays pinned. */
static void test_blocks_and_staging_kept(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("256MiB");
  const size_t n = 6 * PIECE + 123;
  unsigned char *data;
  sgm_buffer *b = make_buffer(ctx, n, seed + 300, &data);
  sgm_backend_counters c0, c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c0);
  uint64_t committed = 0;
  for (int round = 0; round < 4; round++) {
    assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
    void *d = NULL;
    assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
    assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
    sgm_tier_stats dk = tier_stats(ctx, SGM_TIER_DISK);
    assert_int_equal(dk.used_bytes, 0);
    assert_int_equal(dk.cached_bytes, 6 * PIECE + 4096);
    if (round == 0) committed = dk.committed_bytes;
    assert_int_equal(dk.committed_bytes, committed);
    sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
    assert_int_equal(c.host_live_bytes, c0.host_live_bytes + SGM_DISK_STAGE_BYTES);
  }
  assert_true(committed >= 6 * PIECE);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm_tier_stats dk = tier_stats(ctx, SGM_TIER_DISK);
  assert_int_equal(dk.cached_bytes, 0);
  assert_int_equal(dk.committed_bytes, 0);
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.host_live_bytes, c0.host_live_bytes);
  check_buffer(b, data, n);
  free(data);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

/* DESIGN.md §3 rule 7: what the disk tier keeps for reuse (the freed extents'
 * blocks, the pinned staging) goes back after the idle delay with no
 * sgm_trim, and not before. An injected clock; the delay is 100 s so that the
 * idle thread (which ticks every 25 s of real time) stays out of the test. */
static uint64_t fake_ms;
static uint64_t fake_clock(void *user) {
  (void)user;
  return __atomic_load_n(&fake_ms, __ATOMIC_RELAXED);
}

static void test_idle_tick_returns_kept_blocks(void **state) {
  (void)state;
  sgm_test_clean_env(); /* make_ctx's settings, with the delay */
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_SHARED_LIMIT", "64MiB", 1);
  setenv("SGM_SPILL_DIR", spill_dir, 1);
  setenv("SGM_SPILL_LIMIT", "256MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "100000", 1);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) fail_msg("create: %s", sgm_last_error());
  __atomic_store_n(&fake_ms, 5000, __ATOMIC_RELAXED);
  sgm__context_set_clock(ctx, fake_clock, NULL);
  const size_t n = 3 * PIECE + 17;
  unsigned char *data;
  sgm_buffer *b = make_buffer(ctx, n, seed + 400, &data);
  sgm_backend_counters c0, c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c0);
  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
  assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
  uint64_t kept = tier_stats(ctx, SGM_TIER_DISK).cached_bytes;
  assert_true(kept >= 3 * PIECE);
  sgm__context_idle_tick(ctx); /* the disk seen idle from 5 s */
  __atomic_store_n(&fake_ms, 5000 + 99999, __ATOMIC_RELAXED);
  sgm__context_idle_tick(ctx); /* not yet idle for the delay */
  assert_int_equal(tier_stats(ctx, SGM_TIER_DISK).cached_bytes, kept);
  /* Activity starts the delay again. */
  assert_int_equal(sgm_buffer_evict(b, SGM_TIER_DISK), SGM_OK);
  assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
  assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
  __atomic_store_n(&fake_ms, 5000 + 100000, __ATOMIC_RELAXED);
  sgm__context_idle_tick(ctx);
  assert_int_equal(tier_stats(ctx, SGM_TIER_DISK).cached_bytes, kept);
  __atomic_store_n(&fake_ms, 5000 + 200000, __ATOMIC_RELAXED);
  assert_true(sgm__context_idle_tick(ctx) >= kept + SGM_DISK_STAGE_BYTES);
  sgm_tier_stats dk = tier_stats(ctx, SGM_TIER_DISK);
  assert_int_equal(dk.cached_bytes, 0);
  assert_int_equal(dk.committed_bytes, 0);
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.host_live_bytes, c0.host_live_bytes);
  check_buffer(b, data, n);
  free(data);
  sgm_buffer_destroy(b);
  sgm_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_one_hop_pipelined),
      cmocka_unit_test(test_sizes_survive),
      cmocka_unit_test(test_write_failure_leaves_buffer),
      cmocka_unit_test(test_checksum_failure_keeps_extents),
      cmocka_unit_test(test_blocks_and_staging_kept),
      cmocka_unit_test(test_idle_tick_returns_kept_blocks),
  };
  int rc = cmocka_run_group_tests(tests, setup, teardown);
  return rc;
}
