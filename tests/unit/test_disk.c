/*
 * test_disk.c — the disk tier (lib/tiers/disk.c) on its own: data survives
 * the spill file byte for byte in both I/O modes, corruption is caught by the
 * checksum, every write failure (injected ENOSPC / EIO / short write, a real
 * full tmpfs, a full budget) leaves nothing allocated and names the cause, the
 * file is invisible and private, and concurrent use is safe.
 *
 * Every test gets a fresh mkdtemp directory under /tmp (removed in teardown,
 * after unmounting anything mounted there).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "internal.h"
#include "test_util.h"
#include "disk_spy.h"
#include "tiers/disk.h"

#define KiB (UINT64_C(1) << 10)
#define MiB (UINT64_C(1) << 20)

typedef struct fixture {
  char dir[64];   /* the test's own directory under /tmp */
  char mnt[96];   /* a tmpfs mounted inside it, "" when none */
} fixture;

static int setup(void **state) {
  sgm_test_clean_env();
  fixture *f = calloc(1, sizeof *f);
  if (!f) return -1;
  snprintf(f->dir, sizeof f->dir, "/tmp/sgm-test-disk-XXXXXX");
  if (!mkdtemp(f->dir)) return -1;
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  if (f->mnt[0]) {
    umount2(f->mnt, MNT_DETACH);
    rmdir(f->mnt);
  }
  rmdir(f->dir);
  free(f);
  return 0;
}

static sgm_size abs_size(uint64_t bytes) {
  sgm_size s = {bytes, 0};
  return s;
}

static sgm_disk *open_disk(const char *dir, uint64_t limit, sgm_disk_io io) {
  sgm_disk_open_opts o = {io, false};
  sgm_disk *d = NULL;
  int rc = sgm__disk_open_ex(dir, abs_size(limit), 0, &o, &d);
  if (rc != SGM_OK) fprintf(stderr, "open: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  assert_non_null(d);
  return d;
}

static sgm_tier_stats disk_stats(sgm_disk *d) {
  sgm_tier_stats st;
  sgm__disk_stats(d, &st);
  return st;
}

static void fill_random(sgm_test_rng *r, unsigned char *p, uint64_t n) {
  for (uint64_t i = 0; i < n; i++) p[i] = (unsigned char)sgm_test_rng_next(r);
}

static bool extent_is_zero(const sgm_disk_extent *e) {
  return e->offset == 0 && e->bytes == 0 && e->checksum == 0;
}

/* ------------------------------------------------------------------------ */

typedef struct live_extent {
  sgm_disk_extent e;  /* where it is */
  unsigned char *data; /* what was written (malloc'd) */
} live_extent;

/* Invariant: random data of random sizes (1 B .. 3 MiB) from random
 * (mis)alignments reads back byte for byte into random (mis)alignments, in
 * DIRECT and BUFFERED mode, while extents are freed and their space reused;
 * used_bytes and n_live always match the live set; after the last free the
 * file holds (almost) no blocks — freed space went back to the file system. */
static void test_roundtrip_random(void **state) {
  fixture *f = *state;
  uint64_t seed = sgm_test_seed("disk roundtrip", 0xD15C0001);
  for (int mode = 0; mode < 2; mode++) {
    sgm_disk_io io = mode == 0 ? SGM_DISK_IO_DIRECT : SGM_DISK_IO_BUFFERED;
    sgm_test_rng r;
    sgm_test_rng_init(&r, seed + (uint64_t)mode);
    sgm_disk *d = open_disk(f->dir, 64 * MiB, io);
    enum { MAX_LIVE = 24, ROUNDS = 200 };
    live_extent live[MAX_LIVE] = {{{0, 0, 0}, NULL}};
    unsigned char *scratch = malloc(3 * MiB + 8192);
    assert_non_null(scratch);
    uint64_t used = 0, n_live = 0;
    for (int round = 0; round < ROUNDS; round++) {
      int slot = (int)sgm_test_rng_range(&r, 0, MAX_LIVE - 1);
      live_extent *l = &live[slot];
      if (l->data) {
        /* Read it back into a random alignment, then free it. */
        unsigned char *dst = scratch + sgm_test_rng_range(&r, 0, 1) * 4096 +
                             sgm_test_rng_range(&r, 0, 3) * 64;
        memset(dst, 0xEE, l->e.bytes);
        int rc = sgm__disk_read(d, &l->e, dst);
        if (rc != SGM_OK) fprintf(stderr, "read: %s\n", sgm_last_error());
        assert_int_equal(rc, SGM_OK);
        assert_memory_equal(dst, l->data, l->e.bytes);
        sgm__disk_free(d, &l->e);
        used -= sgm__align_up(l->e.bytes, 4096);
        n_live--;
        free(l->data);
        l->data = NULL;
      } else {
        uint64_t n = sgm_test_rng_log_range(&r, 1, 3 * MiB);
        unsigned char *buf = malloc(n + 8192);
        assert_non_null(buf);
        /* Page-aligned (the shared tier's case) or not (the bounce path). */
        uint64_t mis = sgm_test_rng_range(&r, 0, 1) ? 0 : sgm_test_rng_range(&r, 1, 4095);
        unsigned char *src = (unsigned char *)sgm__align_up((uintptr_t)buf, 4096) + mis;
        fill_random(&r, src, n);
        int rc = sgm__disk_write(d, src, n, &l->e);
        if (rc != SGM_OK) fprintf(stderr, "write: %s\n", sgm_last_error());
        assert_int_equal(rc, SGM_OK);
        assert_int_equal(l->e.bytes, n);
        assert_int_equal(l->e.offset % 4096, 0);
        l->data = malloc(n);
        assert_non_null(l->data);
        memcpy(l->data, src, n);
        free(buf);
        used += sgm__align_up(n, 4096);
        n_live++;
      }
      sgm_tier_stats st = disk_stats(d);
      assert_int_equal(st.used_bytes, used);
      assert_int_equal(st.n_live, n_live);
      assert_true(st.peak_used_bytes >= used);
      assert_int_equal(st.budget_bytes, 64 * MiB);
    }
    /* Every survivor still reads back, then goes. */
    for (int i = 0; i < MAX_LIVE; i++) {
      if (!live[i].data) continue;
      assert_int_equal(sgm__disk_read(d, &live[i].e, scratch), SGM_OK);
      assert_memory_equal(scratch, live[i].data, live[i].e.bytes);
      sgm__disk_free(d, &live[i].e);
      free(live[i].data);
    }
    sgm_tier_stats st = disk_stats(d);
    assert_int_equal(st.used_bytes, 0);
    assert_int_equal(st.n_live, 0);
    assert_true(st.bytes_in > 0 && st.bytes_out == st.bytes_in);
    /* Freed extents keep their blocks for reuse until a trim (a quarter of
     * the limit at most); then the holes are punched: blocks returned. */
    assert_true(st.committed_bytes <= 16 * MiB + 1 * MiB);
    sgm__disk_trim(d);
    st = disk_stats(d);
    assert_true(st.committed_bytes < 1 * MiB);
    free(scratch);
    sgm__disk_close(d);
  }
}

/* Invariant: freed extents are reused — with a budget of exactly 16 extents,
 * filling it, freeing everything and filling it again succeeds ten times; the
 * seventeenth extent is refused each time. */
static void test_reuse_exact_budget(void **state) {
  fixture *f = *state;
  sgm_disk *d = open_disk(f->dir, 16 * 64 * KiB, SGM_DISK_IO_AUTO);
  unsigned char *buf = aligned_alloc(4096, 64 * KiB);
  assert_non_null(buf);
  sgm_disk_extent e[16], extra;
  for (int round = 0; round < 10; round++) {
    for (int i = 0; i < 16; i++) {
      memset(buf, round * 16 + i, 64 * KiB);
      assert_int_equal(sgm__disk_write(d, buf, 64 * KiB, &e[i]), SGM_OK);
    }
    assert_int_equal(sgm__disk_write(d, buf, 1, &extra), SGM_ERR_NOMEM);
    for (int i = 0; i < 16; i++) {
      assert_int_equal(sgm__disk_read(d, &e[i], buf), SGM_OK);
      assert_int_equal(buf[0], (unsigned char)(round * 16 + i));
      assert_int_equal(buf[64 * KiB - 1], (unsigned char)(round * 16 + i));
      sgm__disk_free(d, &e[i]);
    }
    assert_int_equal(disk_stats(d).used_bytes, 0);
  }
  free(buf);
  sgm__disk_close(d);
}

/* Flip one byte of the spill file at pos through /proc/self/fd/N. */
static void flip_byte(sgm_disk *d, uint64_t pos) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", sgm__disk_fd(d));
  int fd = open(path, O_RDWR);
  assert_true(fd >= 0);
  unsigned char b = 0;
  assert_int_equal(pread(fd, &b, 1, (off_t)pos), 1);
  b ^= 0x5A;
  assert_int_equal(pwrite(fd, &b, 1, (off_t)pos), 1);
  close(fd);
}

/* Invariant: one flipped byte anywhere in an extent (the aligned body or the
 * partial last block) makes the read SGM_ERR_CORRUPT with the offset and both
 * checksums in the message — never silent garbage; the extent stays
 * allocated, and flipping the byte back makes it read correctly again. */
static void test_corrupt_byte(void **state) {
  fixture *f = *state;
  uint64_t seed = sgm_test_seed("disk corrupt", 0xD15C0002);
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  for (int mode = 0; mode < 2; mode++) {
    sgm_disk_io io = mode == 0 ? SGM_DISK_IO_DIRECT : SGM_DISK_IO_BUFFERED;
    sgm_disk *d = open_disk(f->dir, 64 * MiB, io);
    const uint64_t n = 1 * MiB + 777;
    unsigned char *src = aligned_alloc(4096, 2 * MiB), *dst = aligned_alloc(4096, 2 * MiB);
    assert_non_null(src);
    assert_non_null(dst);
    fill_random(&r, src, n);
    sgm_disk_extent pad, e;
    assert_int_equal(sgm__disk_write(d, src, 12345, &pad), SGM_OK); /* e is not at offset 0 */
    assert_int_equal(sgm__disk_write(d, src, n, &e), SGM_OK);
    const uint64_t where[] = {0, 4096 * 7 + 3, n - 1, n - 700};
    for (size_t i = 0; i < sizeof where / sizeof where[0]; i++) {
      flip_byte(d, e.offset + where[i]);
      memset(dst, 0, n);
      assert_int_equal(sgm__disk_read(d, &e, dst), SGM_ERR_CORRUPT);
      char off[32], sum[32];
      snprintf(off, sizeof off, "offset %llu", (unsigned long long)e.offset);
      snprintf(sum, sizeof sum, "%016llx", (unsigned long long)e.checksum);
      assert_non_null(strstr(sgm_last_error(), off));
      assert_non_null(strstr(sgm_last_error(), sum));
      assert_int_equal(disk_stats(d).n_live, 2);
      flip_byte(d, e.offset + where[i]);
      assert_int_equal(sgm__disk_read(d, &e, dst), SGM_OK);
      assert_memory_equal(dst, src, n);
    }
    sgm__disk_free(d, &e);
    sgm__disk_free(d, &pad);
    free(src);
    free(dst);
    sgm__disk_close(d);
  }
}

/* Invariant: an injected ENOSPC, EIO or short write is SGM_ERR_IO naming the
 * file system and SGM_SPILL_LIMIT; *out is zeroed; used, n_live and the
 * file's blocks are what they were (no space leaked); the fault fires on the
 * nth write exactly once, and the next write works and reads back. Both
 * modes, aligned and unaligned sources. */
static void test_injected_faults(void **state) {
  fixture *f = *state;
  const sgm_disk_fault kinds[] = {SGM_DISK_FAULT_ENOSPC, SGM_DISK_FAULT_EIO,
                                  SGM_DISK_FAULT_SHORT};
  const char *texts[] = {"No space left on device", "Input/output error", "short write"};
  unsigned char *buf = aligned_alloc(4096, 4 * MiB), *back = aligned_alloc(4096, 4 * MiB);
  assert_non_null(buf);
  assert_non_null(back);
  for (int i = 0; i < (int)(4 * MiB); i++) buf[i] = (unsigned char)(i * 7 + 1);
  for (int mode = 0; mode < 2; mode++) {
    sgm_disk_io io = mode == 0 ? SGM_DISK_IO_DIRECT : SGM_DISK_IO_BUFFERED;
    sgm_disk *d = open_disk(f->dir, 64 * MiB, io);
    sgm_disk_extent keep;
    assert_int_equal(sgm__disk_write(d, buf, 100000, &keep), SGM_OK);
    for (size_t k = 0; k < 3; k++) {
      for (int unaligned = 0; unaligned < 2; unaligned++) {
        const unsigned char *src = buf + (unaligned ? 100 : 0);
        const uint64_t n = 3 * MiB + (unaligned ? 555 : 0);
        sgm_tier_stats before = disk_stats(d);
        sgm__disk_inject(d, kinds[k], 2);
        sgm_disk_extent ok1, bad, ok2;
        assert_int_equal(sgm__disk_write(d, src, n, &ok1), SGM_OK); /* the 1st: not yet */
        sgm_tier_stats mid = disk_stats(d);
        memset(&bad, 0xAB, sizeof bad);
        assert_int_equal(sgm__disk_write(d, src, n, &bad), SGM_ERR_IO);
        const char *msg = sgm_last_error();
        assert_true(extent_is_zero(&bad));
        assert_non_null(strstr(msg, texts[k]));
        assert_non_null(strstr(msg, sgm__disk_fs_name(d)));
        assert_non_null(strstr(msg, "SGM_SPILL_LIMIT"));
        assert_non_null(strstr(msg, f->dir));
        sgm_tier_stats after = disk_stats(d);
        assert_int_equal(after.used_bytes, mid.used_bytes);
        assert_int_equal(after.n_live, mid.n_live);
        assert_int_equal(after.committed_bytes, mid.committed_bytes);
        assert_int_equal(after.bytes_in, mid.bytes_in);
        /* Fired once: the next write works and reads back. */
        assert_int_equal(sgm__disk_write(d, src, n, &ok2), SGM_OK);
        assert_int_equal(sgm__disk_read(d, &ok2, back), SGM_OK);
        assert_memory_equal(back, src, n);
        assert_int_equal(sgm__disk_read(d, &ok1, back), SGM_OK);
        assert_memory_equal(back, src, n);
        sgm__disk_free(d, &ok1);
        sgm__disk_free(d, &ok2);
        sgm_tier_stats end = disk_stats(d);
        assert_int_equal(end.used_bytes, before.used_bytes);
        assert_int_equal(end.n_live, before.n_live);
      }
    }
    /* Disarming works: nth 0 never fires. */
    sgm__disk_inject(d, SGM_DISK_FAULT_EIO, 0);
    sgm_disk_extent e;
    assert_int_equal(sgm__disk_write(d, buf, 4096, &e), SGM_OK);
    sgm__disk_free(d, &e);
    assert_int_equal(sgm__disk_read(d, &keep, back), SGM_OK);
    assert_memory_equal(back, buf, 100000);
    sgm__disk_free(d, &keep);
    sgm__disk_close(d);
  }
  free(buf);
  free(back);
}

/* Invariant: a full budget is SGM_ERR_NOMEM naming SGM_SPILL_LIMIT with
 * *out zeroed and nothing changed; freeing makes room again; a request larger
 * than the whole budget is refused the same way; 0 bytes is SGM_ERR_INVALID. */
static void test_budget_full(void **state) {
  fixture *f = *state;
  sgm_disk *d = open_disk(f->dir, 1 * MiB, SGM_DISK_IO_AUTO);
  unsigned char *buf = aligned_alloc(4096, 2 * MiB);
  assert_non_null(buf);
  memset(buf, 0x33, 2 * MiB);
  sgm_disk_extent a, b;
  assert_int_equal(sgm__disk_write(d, buf, 1 * MiB - 4096, &a), SGM_OK);
  memset(&b, 0xAB, sizeof b);
  assert_int_equal(sgm__disk_write(d, buf, 4097, &b), SGM_ERR_NOMEM);
  assert_true(extent_is_zero(&b));
  assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_LIMIT"));
  assert_int_equal(disk_stats(d).used_bytes, 1 * MiB - 4096);
  assert_int_equal(sgm__disk_write(d, buf, 4096, &b), SGM_OK); /* exactly the rest fits */
  sgm__disk_free(d, &b);
  assert_int_equal(sgm__disk_write(d, buf, 2 * MiB, &b), SGM_ERR_NOMEM);
  assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_LIMIT"));
  sgm__disk_free(d, &a);
  assert_int_equal(sgm__disk_write(d, buf, 1 * MiB, &a), SGM_OK);
  sgm__disk_free(d, &a);
  assert_int_equal(sgm__disk_write(d, buf, 0, &a), SGM_ERR_INVALID);
  assert_true(extent_is_zero(&a));
  free(buf);
  sgm__disk_close(d);
}

/* Invariant: on a really full file system (an 8 MiB tmpfs under a 64 MiB
 * limit) the write that does not fit is SGM_ERR_IO naming "tmpfs", the mount
 * point, the errno and the limit, *out zeroed, nothing leaked (its partial
 * blocks are given back: a write of the same size fits again after one free),
 * and everything written before reads back. Small extents (synchronous I/O)
 * and large ones (pipelined, with a partial last block), both modes. Skipped
 * where this process may not mount. */
static void test_real_full_fs(void **state) {
  fixture *f = *state;
  char mnt[96];
  snprintf(mnt, sizeof mnt, "%s/mnt", f->dir);
  assert_int_equal(mkdir(mnt, 0700), 0);
  if (mount("tmpfs", mnt, "tmpfs", 0, "size=8m") != 0) {
    fprintf(stderr, "# cannot mount a tmpfs (%s): skipping\n", strerror(errno));
    rmdir(mnt);
    skip();
  }
  snprintf(f->mnt, sizeof f->mnt, "%s", mnt);
  const uint64_t sizes[] = {256 * KiB - 100, 5 * MiB / 2 + 100};
  unsigned char *buf = aligned_alloc(4096, 3 * MiB);
  assert_non_null(buf);
  for (int mode = 0; mode < 2; mode++) {
    for (int k = 0; k < 2; k++) {
      sgm_disk_io io = mode == 0 ? SGM_DISK_IO_AUTO : SGM_DISK_IO_BUFFERED;
      sgm_disk *d = open_disk(mnt, 64 * MiB, io);
      const uint64_t size = sizes[k];
      enum { MAX = 64 };
      sgm_disk_extent e[MAX];
      int n = 0, rc = SGM_OK;
      for (; n < MAX; n++) {
        sgm_tier_stats before = disk_stats(d);
        memset(buf, n + 1, size);
        memset(&e[n], 0xAB, sizeof e[n]);
        rc = sgm__disk_write(d, buf, size, &e[n]);
        if (rc != SGM_OK) {
          assert_true(extent_is_zero(&e[n]));
          sgm_tier_stats after = disk_stats(d);
          assert_int_equal(after.used_bytes, before.used_bytes);
          assert_int_equal(after.n_live, before.n_live);
          break;
        }
      }
      assert_int_equal(rc, SGM_ERR_IO);
      assert_true(n >= 1 && n < MAX);
      const char *msg = sgm_last_error();
      assert_non_null(strstr(msg, "tmpfs at "));
      assert_non_null(strstr(msg, mnt));
      assert_non_null(strstr(msg, "SGM_SPILL_LIMIT 64.00 MiB"));
      assert_non_null(strstr(msg, "No space left on device"));
      /* Nothing leaked: after one free the same write fits again. */
      sgm__disk_free(d, &e[n - 1]);
      memset(buf, n, size);
      assert_int_equal(sgm__disk_write(d, buf, size, &e[n - 1]), SGM_OK);
      for (int i = 0; i < n; i++) {
        assert_int_equal(sgm__disk_read(d, &e[i], buf), SGM_OK);
        assert_int_equal(buf[0], (unsigned char)(i + 1));
        assert_int_equal(buf[size - 1], (unsigned char)(i + 1));
        sgm__disk_free(d, &e[i]);
      }
      sgm__disk_close(d);
    }
  }
  free(buf);
  assert_int_equal(umount(mnt), 0);
  assert_int_equal(rmdir(mnt), 0);
  f->mnt[0] = '\0';
}

/* Invariant: the spill file is in no directory (readdir finds nothing, its
 * link count is 0) and has mode 0600 exactly, even under a umask that would
 * make it 0400 — for O_TMPFILE and for the create-and-unlink fallback. */
static void test_invisible_private(void **state) {
  fixture *f = *state;
  mode_t old = umask(0277);
  for (int fallback = 0; fallback < 2; fallback++) {
    sgm_disk_open_opts o = {SGM_DISK_IO_AUTO, fallback == 1};
    sgm_disk *d = NULL;
    assert_int_equal(sgm__disk_open_ex(f->dir, abs_size(4 * MiB), 0, &o, &d), SGM_OK);
    sgm_disk_extent e;
    assert_int_equal(sgm__disk_write(d, "hello", 5, &e), SGM_OK);
    DIR *dir = opendir(f->dir);
    assert_non_null(dir);
    int n = 0;
    for (struct dirent *de; (de = readdir(dir));)
      if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
        fprintf(stderr, "found %s\n", de->d_name);
        n++;
      }
    closedir(dir);
    assert_int_equal(n, 0);
    struct stat st;
    assert_int_equal(fstat(sgm__disk_fd(d), &st), 0);
    assert_true(S_ISREG(st.st_mode));
    assert_int_equal(st.st_mode & 07777, 0600);
    assert_int_equal(st.st_nlink, 0);
    char back[5];
    assert_int_equal(sgm__disk_read(d, &e, back), SGM_OK);
    assert_memory_equal(back, "hello", 5);
    sgm__disk_free(d, &e);
    sgm__disk_close(d);
  }
  umask(old);
}

typedef struct worker {
  sgm_disk *d;        /* shared by all workers */
  uint64_t seed;      /* this worker's stream */
  int failures;       /* reads or writes that failed or came back wrong */
  uint64_t bytes;     /* data written (and read back) */
} worker;

static void *worker_main(void *arg) {
  worker *w = arg;
  sgm_test_rng r;
  sgm_test_rng_init(&r, w->seed);
  enum { KEEP = 4 };
  sgm_disk_extent e[KEEP];
  unsigned char *data[KEEP] = {NULL};
  unsigned char *back = malloc(2 * MiB);
  if (!back) return NULL;
  for (int round = 0; round < 200; round++) {
    int k = (int)sgm_test_rng_range(&r, 0, KEEP - 1);
    if (data[k]) {
      if (sgm__disk_read(w->d, &e[k], back) != SGM_OK ||
          memcmp(back, data[k], e[k].bytes) != 0)
        w->failures++;
      sgm__disk_free(w->d, &e[k]);
      free(data[k]);
      data[k] = NULL;
    } else {
      uint64_t n = sgm_test_rng_log_range(&r, 1, 2 * MiB);
      data[k] = malloc(n);
      if (!data[k]) {
        w->failures++;
        continue;
      }
      fill_random(&r, data[k], n);
      if (sgm__disk_write(w->d, data[k], n, &e[k]) != SGM_OK) {
        w->failures++;
        free(data[k]);
        data[k] = NULL;
        continue;
      }
      w->bytes += n;
    }
  }
  for (int k = 0; k < KEEP; k++) {
    if (!data[k]) continue;
    if (sgm__disk_read(w->d, &e[k], back) != SGM_OK || memcmp(back, data[k], e[k].bytes) != 0)
      w->failures++;
    sgm__disk_free(w->d, &e[k]);
    free(data[k]);
  }
  free(back);
  return NULL;
}

/* Invariant: 4 threads writing, reading back and freeing their own extents
 * on one spill file never see a failure or a wrong byte, and the counters
 * balance at the end (nothing live, everything written was read back). */
static void test_threads(void **state) {
  fixture *f = *state;
  uint64_t seed = sgm_test_seed("disk threads", 0xD15C0003);
  for (int mode = 0; mode < 2; mode++) {
    sgm_disk *d = open_disk(f->dir, 64 * MiB,
                            mode == 0 ? SGM_DISK_IO_DIRECT : SGM_DISK_IO_BUFFERED);
    enum { N = 4 };
    worker w[N];
    pthread_t t[N];
    for (int i = 0; i < N; i++) {
      w[i] = (worker){d, seed * 31 + (uint64_t)i, 0, 0};
      assert_int_equal(pthread_create(&t[i], NULL, worker_main, &w[i]), 0);
    }
    uint64_t total = 0;
    for (int i = 0; i < N; i++) {
      assert_int_equal(pthread_join(t[i], NULL), 0);
      assert_int_equal(w[i].failures, 0);
      total += w[i].bytes;
    }
    sgm_tier_stats st = disk_stats(d);
    assert_int_equal(st.used_bytes, 0);
    assert_int_equal(st.n_live, 0);
    assert_int_equal(st.bytes_in, total);
    assert_int_equal(st.bytes_out, total);
    sgm__disk_close(d);
  }
}

/* Invariant: opening on a missing directory, on a file, or with no directory
 * fails with *out NULL and a message naming the path (or SGM_SPILL_DIR). */
static void test_open_errors(void **state) {
  fixture *f = *state;
  char path[128];
  snprintf(path, sizeof path, "%s/does-not-exist", f->dir);
  sgm_disk *d = (sgm_disk *)(uintptr_t)1;
  assert_int_equal(sgm__disk_open(path, abs_size(0), 0, &d), SGM_ERR_INVALID);
  assert_null(d);
  assert_non_null(strstr(sgm_last_error(), path));
  assert_non_null(strstr(sgm_last_error(), "No such file or directory"));
  assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_DIR"));

  snprintf(path, sizeof path, "%s/a-file", f->dir);
  int fd = open(path, O_CREAT | O_WRONLY, 0600);
  assert_true(fd >= 0);
  close(fd);
  assert_int_equal(sgm__disk_open(path, abs_size(0), 0, &d), SGM_ERR_INVALID);
  assert_null(d);
  assert_non_null(strstr(sgm_last_error(), path));
  assert_non_null(strstr(sgm_last_error(), "Not a directory"));
  unlink(path);

  assert_int_equal(sgm__disk_open("", abs_size(0), 0, &d), SGM_ERR_INVALID);
  assert_null(d);
  assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_DIR"));
}

/* Invariant: the limit is resolved at open: absolute sizes round down to
 * 4 KiB; a share is of the free space of the directory's file system; unset
 * is 50% of it. The file system is named by type and mount point. */
static void test_limit_resolution(void **state) {
  fixture *f = *state;
  sgm_disk *d = NULL;
  assert_int_equal(sgm__disk_open(f->dir, abs_size(10 * MiB + 100), 0, &d), SGM_OK);
  assert_int_equal(disk_stats(d).budget_bytes, 10 * MiB);
  assert_non_null(strstr(sgm__disk_fs_name(d), " at /"));
  sgm__disk_close(d);

  struct statvfs vfs;
  assert_int_equal(statvfs(f->dir, &vfs), 0);
  double free_bytes = (double)vfs.f_bavail * (double)vfs.f_frsize;
  sgm_size quarter = {0, 0.25}, unset = {0, 0};
  assert_int_equal(sgm__disk_open(f->dir, quarter, 0, &d), SGM_OK);
  double got = (double)disk_stats(d).budget_bytes;
  assert_true(got > 0.24 * free_bytes && got < 0.26 * free_bytes);
  sgm__disk_close(d);
  assert_int_equal(sgm__disk_open(f->dir, unset, 0, &d), SGM_OK);
  got = (double)disk_stats(d).budget_bytes;
  assert_true(got > 0.49 * free_bytes && got < 0.51 * free_bytes);
  sgm__disk_close(d);

  assert_int_equal(sgm__disk_open(f->dir, abs_size(100), 0, &d), SGM_ERR_INVALID);
  assert_null(d);
  assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_LIMIT"));
}

/* Invariant: reading an extent that is not live (freed, or never written) is
 * SGM_ERR_INVALID, not a read of whatever lies there. */
static void test_read_dead_extent(void **state) {
  fixture *f = *state;
  sgm_disk *d = open_disk(f->dir, 4 * MiB, SGM_DISK_IO_AUTO);
  char buf[4096] = "data";
  sgm_disk_extent e;
  assert_int_equal(sgm__disk_write(d, buf, sizeof buf, &e), SGM_OK);
  sgm_disk_extent copy = e;
  sgm__disk_free(d, &e);
  assert_int_equal(sgm__disk_read(d, &copy, buf), SGM_ERR_INVALID);
  sgm_disk_extent never = {1 * MiB, 10, 0};
  assert_int_equal(sgm__disk_read(d, &never, buf), SGM_ERR_INVALID);
  sgm__disk_close(d);
}

/* Invariant (messages): a spill directory path of ~950 bytes is cut in the
 * middle in messages, so the errno text and the hint after it survive the
 * 1 KiB thread-local message: for a missing directory and for a write that fails with
 * ENOSPC. And SGM_SPILL_LIMIT below one 4 KiB extent names the setting, not
 * "free space there" (the disk is not what is short). */
static void test_long_path_and_tiny_limit_messages(void **state) {
  fixture *f = *state;
  char path[SGM_PATH_MAX];
  size_t n = (size_t)snprintf(path, sizeof path, "%s", f->dir);
  char made[10][SGM_PATH_MAX];
  for (int level = 0; level < 10; level++) {
    n += (size_t)snprintf(path + n, sizeof path - n, "/%s%d",
                          "a-rather-long-directory-name-for-a-spill-tier-of-a-cluster-job-xx"
                          "xxxxxxxxxxxxxxxxxxxxxxx", level);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(made[level], sizeof made[level], "%s", path);
  }
  assert_true(strlen(path) > 900);
  char missing[SGM_PATH_MAX + 16];
  snprintf(missing, sizeof missing, "%.*s/nope", (int)(SGM_PATH_MAX - 8), path);
  sgm_disk *d = NULL;
  assert_int_equal(sgm__disk_open(missing, abs_size(0), 0, &d), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "No such file or directory"));
  assert_non_null(strstr(sgm_last_error(), "set SGM_SPILL_DIR to an existing writable directory)"));
  assert_non_null(strstr(sgm_last_error(), "/nope"));

  d = open_disk(path, 4 * MiB, SGM_DISK_IO_AUTO);
  unsigned char buf[8192];
  memset(buf, 7, sizeof buf);
  sgm_disk_extent e;
  sgm__disk_inject(d, SGM_DISK_FAULT_ENOSPC, 1);
  assert_int_equal(sgm__disk_write(d, buf, sizeof buf, &e), SGM_ERR_IO);
  assert_non_null(strstr(sgm_last_error(), strerror(ENOSPC)));
  assert_non_null(strstr(sgm_last_error(), "lower SGM_SPILL_LIMIT"));
  sgm__disk_close(d);

  assert_int_equal(sgm__disk_open(f->dir, abs_size(1024), 0, &d), SGM_ERR_INVALID);
  assert_null(d);
  assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_LIMIT=1024 bytes"));
  assert_null(strstr(sgm_last_error(), "free space there"));
  for (int level = 9; level >= 0; level--) assert_int_equal(rmdir(made[level]), 0);
}

/* Invariant (budget, counted in disk.c only): reservations and extents share
 * SGM_SPILL_LIMIT: a plain write must fit beside what is reserved, a write
 * out of a reservation always fits and turns it into an extent (used bytes
 * unchanged), freeing it back into the reservation keeps the promise, and
 * unreserve gives the budget back. */
static void test_reservations_share_the_budget(void **state) {
  fixture *f = *state;
  sgm_disk *d = open_disk(f->dir, 1 * MiB, SGM_DISK_IO_AUTO);
  unsigned char *buf = aligned_alloc(4096, 512 * 1024);
  assert_non_null(buf);
  memset(buf, 0x5A, 512 * 1024);
  assert_int_equal(sgm__disk_reserve(d, 768 * 1024), SGM_OK);
  assert_int_equal(disk_stats(d).used_bytes, 768 * 1024);
  assert_int_equal(sgm__disk_reserve(d, 512 * 1024), SGM_ERR_NOMEM);
  assert_non_null(strstr(sgm_last_error(), "SGM_SPILL_LIMIT"));
  sgm_disk_extent e;
  assert_int_equal(sgm__disk_write(d, buf, 512 * 1024, &e), SGM_ERR_NOMEM);
  assert_true(extent_is_zero(&e));
  assert_int_equal(sgm__disk_write_ex(d, buf, 512 * 1024, true, &e), SGM_OK);
  assert_int_equal(disk_stats(d).used_bytes, 768 * 1024);
  unsigned char *back = aligned_alloc(4096, 512 * 1024);
  assert_non_null(back);
  assert_int_equal(sgm__disk_read(d, &e, back), SGM_OK);
  assert_memory_equal(back, buf, 512 * 1024);
  sgm__disk_free_ex(d, &e, true);
  assert_int_equal(disk_stats(d).used_bytes, 768 * 1024);
  assert_int_equal(sgm__disk_write(d, buf, 512 * 1024, &e), SGM_ERR_NOMEM);
  sgm__disk_unreserve(d, 768 * 1024);
  assert_int_equal(disk_stats(d).used_bytes, 0);
  assert_int_equal(sgm__disk_write(d, buf, 512 * 1024, &e), SGM_OK);
  sgm__disk_free(d, &e);
  free(buf);
  free(back);
  sgm__disk_close(d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_roundtrip_random, setup, teardown),
      cmocka_unit_test_setup_teardown(test_reuse_exact_budget, setup, teardown),
      cmocka_unit_test_setup_teardown(test_corrupt_byte, setup, teardown),
      cmocka_unit_test_setup_teardown(test_injected_faults, setup, teardown),
      cmocka_unit_test_setup_teardown(test_budget_full, setup, teardown),
      cmocka_unit_test_setup_teardown(test_real_full_fs, setup, teardown),
      cmocka_unit_test_setup_teardown(test_invisible_private, setup, teardown),
      cmocka_unit_test_setup_teardown(test_threads, setup, teardown),
      cmocka_unit_test_setup_teardown(test_open_errors, setup, teardown),
      cmocka_unit_test_setup_teardown(test_limit_resolution, setup, teardown),
      cmocka_unit_test_setup_teardown(test_read_dead_extent, setup, teardown),
      cmocka_unit_test_setup_teardown(test_long_path_and_tiny_limit_messages, setup, teardown),
      cmocka_unit_test_setup_teardown(test_reservations_share_the_budget, setup, teardown),
  };
  /* CMOCKA_FILTER=test_name runs one test (checking a test against old code). */
  if (getenv("CMOCKA_FILTER")) cmocka_set_test_filter(getenv("CMOCKA_FILTER"));
  return cmocka_run_group_tests_name("disk", tests, NULL, NULL);
}
