/*
 * disk.c — the disk tier: one spill file per context, carved into extents by
 * the sub-allocator, every extent checksummed (XXH3-64) and verified on read.
 *
 * File. Opened O_TMPFILE in the spill directory (fallback: a unique name
 * created O_EXCL and unlinked at once), mode 0600: never visible in the
 * directory, gone when the process ends however it ends. The offset space
 * [0, limit) is one range of the sub-allocator with a 4 KiB granule, so an
 * extent's offset *is* its place in the file and every extent starts and ends
 * on a block boundary O_DIRECT accepts. The file is sized to the limit at open
 * but sparse: only live extents hold blocks; freeing an extent punches a hole,
 * so the file system gets the space back at once (DESIGN.md §3.7: nothing is
 * held "just in case").
 *
 * I/O. DIRECT mode (the default where the file system takes O_DIRECT; the
 * measurements are in docs/disk.md): the aligned part of the caller's buffer
 * goes straight to the device in pieces kept in flight with Linux AIO, each
 * piece hashed while the others move, so the checksum hides behind the I/O;
 * an unaligned buffer or the last partial block goes through a 4 KiB-aligned
 * bounce buffer (a few are cached). BUFFERED mode (where O_DIRECT is
 * refused): the page cache, then write-back of the extent and
 * POSIX_FADV_DONTNEED, so spilled data does not stay in RAM either way.
 * pread/pwrite loops retry EINTR and partial transfers; a transfer that stops
 * making progress is a short write.
 *
 * Invariants:
 *  - used_bytes and n_live equal the sub-allocator's, less the kept ranges
 *    (freed extents whose blocks stay for the next write of their size);
 *    peak_used_bytes >= used;
 *  - an extent is in the sub-allocator from before its first byte is written
 *    until after its hole is punched (a kept range stays carved), so no two
 *    extents ever share a block;
 *  - a failed write leaves nothing allocated (range freed, blocks punched).
 *
 * Threading: one lock (rank SGM_LOCK_TIER_DISK) guards the sub-allocator, the
 * counters, the engine pointer and the bounce and AIO caches; it is never held across
 * I/O, hashing or copying: an extent is carved under the lock, the lock is
 * dropped, the data moves, and the lock is retaken to publish the outcome.
 * The caller serialises use of one extent (no free during its read).
 */
#include "tiers/disk.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <mntent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

/* Extent granule and O_DIRECT unit: the page size and the largest logical
 * block size of current disks, so any device accepts direct I/O on it. */
#define DISK_ALIGN UINT64_C(4096)
/* Bounce buffer for unaligned buffers and partial blocks: 1, 4, 8 and 16 MiB
 * were within this VM's noise (docs/disk.md); 4 MiB is one request at the
 * usual max_sectors_kb and small enough to cache a few. */
#define DISK_BOUNCE_BYTES SGM_DISK_BOUNCE_BYTES
/* Bounce buffers kept for reuse: one per concurrent spiller of a typical
 * 4-thread workload; more are allocated and freed on demand. */
#define DISK_BOUNCE_CACHE 4
/* One pread/pwrite moves at most this: Linux caps a call at 2 GiB - 4 KiB,
 * and 1 GiB keeps every call block-aligned. */
#define DISK_IO_MAX (UINT64_C(1) << 30)
/* A transfer that stopped making progress (pwrite/pread returned 0). */
#define DISK_SHORT (-1)
/* Pipelined DIRECT transfers (Linux AIO): 1 MiB pieces keep the hash of the
 * last piece, the only part not overlapped with I/O, under 0.1 ms; 32 in
 * flight (32 MiB) keep any SSD's queue full. Smaller bodies are cut in
 * quarters of at least 512 KiB (256 KiB pieces made 1 MiB reads ~10% slower
 * than one request: docs/disk.md); bodies under two pieces go synchronously. */
#define DISK_AIO_CHUNK (UINT64_C(1) << 20)
#define DISK_AIO_MIN_CHUNK (UINT64_C(512) << 10)
#define DISK_AIO_DEPTH 32
/* AIO contexts kept for reuse, as the bounce buffers. */
#define DISK_AIO_CACHE 4
/* Freed extents whose blocks the file keeps for the next writes (no hole
 * punched on the free, none allocated on the reuse: docs/disk.md measured a
 * punch at 7 ms a call here, as long as the read it followed). At most this
 * many, holding at most a quarter of the limit and DISK_KEPT_BYTES_MAX; the
 * rest is punched at once, and sgm_trim punches all. */
#define DISK_KEPT_MAX 256
#define DISK_KEPT_BYTES_MAX (UINT64_C(1) << 30)
/* Names tried by the create-and-unlink fallback before giving up. */
#define DISK_NAME_TRIES 64
/* Paths in messages are cut in the middle to this many bytes (with the NUL):
 * a message is at most 1 KiB (error.c) and callers keep copies in
 * SGM_ERROR_MAX (512) bytes; the errno and the hint after a long path must
 * survive both. Both ends stay: the mount point and the leaf are
 * what a reader recognises. */
#define DISK_SHOWN_MAX 72

/* A freed extent's range, still carved, its blocks kept (see DISK_KEPT_MAX). */
typedef struct disk_kept {
  uint64_t off;  /* bytes: file offset */
  uint64_t size; /* bytes: the carved range */
} disk_kept;

struct sgm_disk {
  sgm_lock lock;                 /* guards the fields marked (L) */
  int fd;                        /* the spill file; O_DIRECT set in DIRECT mode */
  int verbose;                   /* log level */
  sgm_disk_io io;                /* DIRECT or BUFFERED, fixed at open */
  uint64_t mem_align;            /* bytes: buffer address alignment O_DIRECT needs here */
  uint64_t limit_bytes;          /* the budget: size of the offset space */
  int punch_ok;                  /* hole punching works here (atomic; cleared on EOPNOTSUPP) */
  int aio_ok;                    /* Linux AIO works here (atomic; cleared when io_setup fails) */
  char dir[DISK_SHOWN_MAX];      /* the spill directory as given, cut in the middle if long */
  char fs_name[DISK_SHOWN_MAX + 64]; /* "ext4 at /home": type and mount point (cut likewise) */
  sgm_suballoc *sa;              /* (L) carves [0, limit_bytes); offsets are file offsets */
  uint64_t used_bytes;           /* (L) bytes of live extents, rounded to DISK_ALIGN */
  uint64_t reserved_bytes;       /* (L) budget promised to data not written yet (sgm__disk_reserve) */
  uint64_t peak_used_bytes;      /* (L) highest used_bytes */
  uint64_t n_live;               /* (L) live extents */
  uint64_t bytes_in;             /* (L) data bytes written successfully since open */
  uint64_t bytes_out;            /* (L) data bytes read back and verified since open */
  const sgm_disk_engine *engine; /* the system calls that move data (tests install a spy) */
  void *engine_user;             /* the engine's argument */
  void *bounce[DISK_BOUNCE_CACHE]; /* (L) cached bounce buffers, DISK_BOUNCE_BYTES each */
  unsigned n_bounce;             /* (L) entries used in bounce */
  void *pinned;                  /* (L) the lent pinned staging buffer (not ours to free), or NULL */
  bool pinned_busy;              /* (L) pinned is handed out now */
  aio_context_t aio[DISK_AIO_CACHE]; /* (L) cached AIO contexts, DISK_AIO_DEPTH deep */
  unsigned n_aio;                /* (L) entries used in aio */
  disk_kept kept[DISK_KEPT_MAX]; /* (L) freed ranges whose blocks stay for reuse (not in used_bytes) */
  unsigned n_kept;               /* (L) entries used in kept */
  uint64_t kept_bytes;           /* (L) bytes of the ranges in kept */
  uint64_t kept_limit;           /* the most kept_bytes may reach */
  uint64_t n_ops;                /* extents carved, read or freed so far (atomic: the idle trim
                                    watches it) */
};

/* ------------------------------------------------------------------------ */
/* The kernel's I/O engine: the system calls as they are. */

static ssize_t disk_sys_pwrite(void *user, int fd, const void *buf, size_t n, uint64_t off) {
  (void)user;
  return pwrite(fd, buf, n, (off_t)off);
}

static ssize_t disk_sys_pread(void *user, int fd, void *buf, size_t n, uint64_t off) {
  (void)user;
  return pread(fd, buf, n, (off_t)off);
}

static long disk_sys_io_submit(void *user, aio_context_t ctx, long nr, struct iocb **cbs) {
  (void)user;
  return syscall(SYS_io_submit, ctx, nr, cbs);
}

static long disk_sys_io_getevents(void *user, aio_context_t ctx, long min_nr, long nr,
                                  struct io_event *ev) {
  (void)user;
  return syscall(SYS_io_getevents, ctx, min_nr, nr, ev, NULL);
}

const sgm_disk_engine sgm__disk_kernel_engine = {
    .name = "kernel",
    .pwrite = disk_sys_pwrite,
    .pread = disk_sys_pread,
    .io_submit = disk_sys_io_submit,
    .io_getevents = disk_sys_io_getevents,
};

void sgm__disk_set_engine(sgm_disk *d, const sgm_disk_engine *e, void *user) {
  sgm__lock_take(&d->lock);
  const sgm_disk_engine *old = d->engine;
  void *old_user = d->engine_user;
  d->engine = e ? e : &sgm__disk_kernel_engine;
  d->engine_user = e ? user : NULL;
  sgm__lock_drop(&d->lock);
  if (old && old->release && (old != d->engine || old_user != d->engine_user)) old->release(old_user);
}

const sgm_disk_engine *sgm__disk_get_engine(sgm_disk *d, void **user) {
  sgm__lock_take(&d->lock);
  const sgm_disk_engine *e = d->engine;
  if (user) *user = d->engine_user;
  sgm__lock_drop(&d->lock);
  return e;
}

/* The engine for one transfer, read once under the lock. */
static void disk_engine_get(sgm_disk *d, const sgm_disk_engine **e, void **user) {
  sgm__lock_take(&d->lock);
  *e = d->engine;
  *user = d->engine_user;
  sgm__lock_drop(&d->lock);
}

/* ------------------------------------------------------------------------ */
/* Opening: file system description, the file, the I/O mode. */

/* s for a message: whole when it fits in len (with the NUL), else its head
 * and tail around "...". */
static const char *disk_shorten(const char *s, char *buf, size_t len) {
  size_t n = strlen(s);
  if (n < len) {
    memcpy(buf, s, n + 1);
    return buf;
  }
  size_t keep = len - 4, head = keep / 3, tail = keep - head;
  memcpy(buf, s, head);
  memcpy(buf + head, "...", 3);
  memcpy(buf + head + 3, s + n - tail, tail + 1);
  return buf;
}

static const char *disk_fs_magic_name(long type) {
  switch ((unsigned long)type & 0xFFFFFFFFul) {
    case 0x01021994ul: return "tmpfs";
    case 0xEF53ul: return "ext2/3/4";
    case 0x58465342ul: return "xfs";
    case 0x9123683Eul: return "btrfs";
    case 0x794C7630ul: return "overlay";
    case 0x6969ul: return "nfs";
    case 0x2FC12FC1ul: return "zfs";
    case 0xF2F52010ul: return "f2fs";
    case 0x65735546ul: return "fuse";
    case 0x858458F6ul: return "ramfs";
    case 0xFF534D42ul: return "cifs";
    case 0xFE534D42ul: return "smb2";
    case 0x00C36400ul: return "ceph";
    case 0x0BD00BD0ul: return "lustre";
    case 0x47504653ul: return "gpfs";
    default: return NULL;
  }
}

/* "type at mountpoint" for dir: the longest mount point that contains it
 * (later lines win ties: they are mounted on top); the type from statfs when
 * /proc is not there. */
static void disk_describe_fs(const char *dir, char *out, size_t len) {
  char real[SGM_PATH_MAX];
  if (!realpath(dir, real)) snprintf(real, sizeof real, "%s", dir);
  char best_dir[SGM_PATH_MAX] = "", best_type[64] = "";
  size_t best_len = 0;
  FILE *f = setmntent("/proc/self/mounts", "r");
  if (f) {
    struct mntent m;
    char buf[3 * SGM_PATH_MAX];
    while (getmntent_r(f, &m, buf, sizeof buf)) {
      size_t n = strlen(m.mnt_dir);
      bool inside = strncmp(real, m.mnt_dir, n) == 0 &&
                    (real[n] == '\0' || real[n] == '/' || (n == 1 && m.mnt_dir[0] == '/'));
      if (inside && n >= best_len) {
        best_len = n;
        snprintf(best_dir, sizeof best_dir, "%s", m.mnt_dir);
        snprintf(best_type, sizeof best_type, "%s", m.mnt_type);
      }
    }
    endmntent(f);
  }
  if (!best_type[0]) {
    struct statfs sf;
    const char *name = statfs(dir, &sf) == 0 ? disk_fs_magic_name((long)sf.f_type) : NULL;
    if (name) snprintf(best_type, sizeof best_type, "%s", name);
    else if (statfs(dir, &sf) == 0)
      snprintf(best_type, sizeof best_type, "file system 0x%lx", (unsigned long)sf.f_type);
    else snprintf(best_type, sizeof best_type, "unknown file system");
  }
  char shown[DISK_SHOWN_MAX];
  if (best_dir[0]) snprintf(out, len, "%s at %s", best_type, disk_shorten(best_dir, shown, sizeof shown));
  else snprintf(out, len, "%s holding %s", best_type, disk_shorten(real, shown, sizeof shown));
}

/* The create-and-unlink fallback for file systems without O_TMPFILE. */
static int disk_create_named(const char *dir, int *fd_out) {
  *fd_out = -1;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t x = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^
               ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)fd_out;
  for (int i = 0; i < DISK_NAME_TRIES; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17; /* xorshift: names only need to differ */
    char path[SGM_PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/.sgm-spill-%d-%016llx", dir, (int)getpid(),
             (unsigned long long)x);
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
      if (errno == EEXIST || errno == EINTR) continue;
      return errno;
    }
    if (unlink(path) != 0) {
      int e = errno;
      close(fd);
      return e;
    }
    *fd_out = fd;
    return 0;
  }
  return EEXIST;
}

/* Switch fd to O_DIRECT and prove it works with one aligned block; false
 * (fd left buffered) where the file system refuses it. */
static bool disk_try_direct(sgm_disk *d) {
  uint64_t mem_align = DISK_ALIGN;
#ifdef STATX_DIOALIGN
  struct statx sx;
  if (statx(d->fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
    if (sx.stx_dio_offset_align == 0 || sx.stx_dio_offset_align > DISK_ALIGN) return false;
    if (sx.stx_dio_mem_align && sx.stx_dio_mem_align <= DISK_ALIGN)
      mem_align = sx.stx_dio_mem_align;
  }
#endif
  int fl = fcntl(d->fd, F_GETFL);
  if (fl < 0 || fcntl(d->fd, F_SETFL, fl | O_DIRECT) != 0) return false;
  void *probe = NULL;
  if (posix_memalign(&probe, DISK_ALIGN, DISK_ALIGN) != 0) goto out_buffered;
  memset(probe, 0, DISK_ALIGN);
  ssize_t w = pwrite(d->fd, probe, DISK_ALIGN, 0);
  int e = w < 0 ? errno : 0;
  ssize_t r = w == (ssize_t)DISK_ALIGN ? pread(d->fd, probe, DISK_ALIGN, 0) : 0;
  if (r < 0 && !e) e = errno;
  free(probe);
  if (ftruncate(d->fd, 0) != 0) { /* an empty file either way; nothing to undo */ }
  /* EINVAL is the refusal; ENOSPC and friends say nothing about O_DIRECT. */
  if (e == EINVAL) goto out_buffered;
  d->mem_align = mem_align;
  return true;
out_buffered:
  fcntl(d->fd, F_SETFL, fl);
  return false;
}

int sgm__disk_open(const char *dir, sgm_size limit, int verbose, sgm_disk **out) {
  return sgm__disk_open_ex(dir, limit, verbose, NULL, out);
}

int sgm__disk_open_ex(const char *dir, sgm_size limit, int verbose,
                      const sgm_disk_open_opts *opts, sgm_disk **out) {
  *out = NULL;
  sgm_disk_open_opts o = {0};
  if (opts) o = *opts;
  if (!dir || !dir[0])
    return sgm__error_set(SGM_ERR_INVALID, "no spill directory: set SGM_SPILL_DIR to a writable "
                                           "directory to turn the disk tier on");
  if (strlen(dir) >= SGM_PATH_MAX)
    return sgm__error_set(SGM_ERR_INVALID, "spill directory path is longer than %d bytes",
                          SGM_PATH_MAX - 1);
  char shown[DISK_SHOWN_MAX];
  disk_shorten(dir, shown, sizeof shown);
  struct stat st;
  int e = stat(dir, &st) != 0 ? errno : !S_ISDIR(st.st_mode) ? ENOTDIR : 0;
  if (e) {
    if (e == ENOENT || e == ENOTDIR)
      return sgm__error_set(SGM_ERR_INVALID, "spill directory %s: %s (create it, or set "
                            "SGM_SPILL_DIR to an existing writable directory)", shown, strerror(e));
    return sgm__error_set(SGM_ERR_IO, "spill directory %s: %s (set SGM_SPILL_DIR to a directory "
                          "this process can write)", shown, strerror(e));
  }
  struct statvfs vfs;
  if (statvfs(dir, &vfs) != 0)
    return sgm__error_set(SGM_ERR_IO, "spill directory %s: statvfs: %s (set SGM_SPILL_DIR to a "
                          "local writable directory)", shown, strerror(errno));
  uint64_t free_bytes = (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize;
  uint64_t budget = sgm__size_resolve(limit, free_bytes, free_bytes / 2);
  if (budget > (uint64_t)INT64_MAX) budget = (uint64_t)INT64_MAX; /* the largest off_t */
  budget &= ~(DISK_ALIGN - 1);

  sgm_disk *d = calloc(1, sizeof *d);
  if (!d) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory opening the disk tier");
  d->fd = -1;
  d->verbose = verbose;
  d->limit_bytes = budget;
  d->kept_limit = budget / 4 < DISK_KEPT_BYTES_MAX ? budget / 4 : DISK_KEPT_BYTES_MAX;
  d->punch_ok = 1;
  d->aio_ok = 1;
  d->mem_align = DISK_ALIGN;
  d->engine = &sgm__disk_kernel_engine;
  snprintf(d->dir, sizeof d->dir, "%s", shown);
  disk_describe_fs(dir, d->fs_name, sizeof d->fs_name);
  sgm__lock_init(&d->lock, SGM_LOCK_TIER_DISK);
  char b[32], f[32];
  int rc;
  if (budget == 0 && limit.fraction == 0 && limit.bytes) {
    /* A byte count below one extent: the setting, not the disk, is short. */
    rc = sgm__error_set(SGM_ERR_INVALID, "SGM_SPILL_LIMIT=%llu bytes is below one 4 KiB spill "
                        "extent: set SGM_SPILL_LIMIT to at least 4KiB (or unset it for 50%% of "
                        "the free space in %s)", (unsigned long long)limit.bytes, d->dir);
    goto out_free;
  }
  if (budget == 0) {
    rc = sgm__error_set(SGM_ERR_INVALID, "spill limit resolves to 0 bytes: %s (%s) has %s free; "
                        "free space there, set SGM_SPILL_LIMIT to at least 4KiB, or point "
                        "SGM_SPILL_DIR at a file system with room", d->dir, d->fs_name,
                        sgm__fmt_bytes(free_bytes, f, sizeof f));
    goto out_free;
  }
  if (budget > free_bytes)
    sgm__log(verbose, 1, "SGM_SPILL_LIMIT (%s) is more than the %s free on %s: spilling may fail "
             "with SGM_ERR_IO before the limit", sgm__fmt_bytes(budget, b, sizeof b),
             sgm__fmt_bytes(free_bytes, f, sizeof f), d->fs_name);

  int err = 0;
  if (!o.no_tmpfile) {
    d->fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (d->fd < 0) err = errno;
  }
  /* No O_TMPFILE here (old kernel: EISDIR; file system: EOPNOTSUPP): a named
   * file, unlinked before anyone can use it. */
  if (d->fd < 0 && (o.no_tmpfile || err == EOPNOTSUPP || err == EISDIR || err == EINVAL))
    err = disk_create_named(dir, &d->fd);
  if (d->fd < 0) {
    rc = sgm__error_set(SGM_ERR_IO, "cannot create the spill file in %s (%s): %s (make the "
                        "directory writable or set SGM_SPILL_DIR elsewhere)", d->dir, d->fs_name,
                        strerror(err));
    goto out_free;
  }
  /* O_TMPFILE applies the umask; 0600 exactly: spilled data is private. */
  if (fchmod(d->fd, 0600) != 0) {
    rc = sgm__error_set(SGM_ERR_IO, "cannot make the spill file in %s private (chmod 0600): %s",
                        d->dir, strerror(errno));
    goto out_free;
  }
  d->io = SGM_DISK_IO_BUFFERED;
  if (o.io != SGM_DISK_IO_BUFFERED) {
    if (disk_try_direct(d)) d->io = SGM_DISK_IO_DIRECT;
    else
      sgm__log(verbose, o.io == SGM_DISK_IO_DIRECT ? 1 : 2,
               "%s does not take O_DIRECT: the disk tier uses the page cache and drops spilled "
               "pages after each write", d->fs_name);
  }
  /* No readahead: see disk_read_buffered. */
  if (d->io == SGM_DISK_IO_BUFFERED) posix_fadvise(d->fd, 0, 0, POSIX_FADV_RANDOM);
  /* The file is as long as the limit from the start (sparse: no blocks): no
   * write ever extends it, so direct writes stay asynchronous (file systems
   * serialise size-changing direct I/O) and no read meets end of file. */
  if (ftruncate(d->fd, (off_t)budget) != 0)
    sgm__log(verbose, 1, "cannot size the spill file in %s to %s (%s): spilling may be slower",
             d->dir, sgm__fmt_bytes(budget, b, sizeof b), strerror(errno));
  rc = sgm__suballoc_create(DISK_ALIGN, &d->sa);
  if (rc != SGM_OK) goto out_free;
  rc = sgm__suballoc_add_range(d->sa, 0, budget);
  if (rc != SGM_OK) goto out_free;
  sgm__log(verbose, 2, "disk tier: spill file in %s (%s), limit %s, %s I/O", d->dir, d->fs_name,
           sgm__fmt_bytes(budget, b, sizeof b),
           d->io == SGM_DISK_IO_DIRECT ? "direct" : "buffered");
  *out = d;
  return SGM_OK;
out_free:
  sgm__disk_close(d);
  return rc;
}

void sgm__disk_close(sgm_disk *d) {
  if (!d) return;
  if (d->engine && d->engine->release) d->engine->release(d->engine_user);
  if (d->fd >= 0) close(d->fd);
  for (unsigned i = 0; i < d->n_bounce; i++) free(d->bounce[i]);
  for (unsigned i = 0; i < d->n_aio; i++) syscall(SYS_io_destroy, d->aio[i]);
  sgm__suballoc_destroy(d->sa);
  sgm__lock_destroy(&d->lock);
  free(d);
}

/* ------------------------------------------------------------------------ */
/* Bounce buffers, AIO contexts and the transfer loops. */

static void *disk_bounce_get(sgm_disk *d) {
  void *p = NULL;
  sgm__lock_take(&d->lock);
  if (d->n_bounce) p = d->bounce[--d->n_bounce];
  sgm__lock_drop(&d->lock);
  if (!p && posix_memalign(&p, DISK_ALIGN, DISK_BOUNCE_BYTES) != 0) p = NULL;
  return p;
}

static void disk_bounce_put(sgm_disk *d, void *p) {
  if (!p) return;
  sgm__lock_take(&d->lock);
  if (d->n_bounce < DISK_BOUNCE_CACHE) d->bounce[d->n_bounce++] = p, p = NULL;
  sgm__lock_drop(&d->lock);
  free(p);
}

void sgm__disk_lend_bounce(sgm_disk *d, void *pinned) {
  sgm__lock_take(&d->lock);
  if (!d->pinned) d->pinned = pinned;
  sgm__lock_drop(&d->lock);
}

void *sgm__disk_take_back_bounce(sgm_disk *d) {
  sgm__lock_take(&d->lock);
  void *p = d->pinned && !d->pinned_busy ? d->pinned : NULL;
  if (p) d->pinned = NULL;
  sgm__lock_drop(&d->lock);
  return p;
}

void *sgm__disk_stage_get(sgm_disk *d) {
  sgm__lock_take(&d->lock);
  void *p = d->pinned && !d->pinned_busy ? d->pinned : NULL;
  if (p) d->pinned_busy = true;
  sgm__lock_drop(&d->lock);
  return p ? p : disk_bounce_get(d);
}

void sgm__disk_stage_put(sgm_disk *d, void *p) {
  if (!p) return;
  sgm__lock_take(&d->lock);
  bool mine = p == d->pinned;
  if (mine) d->pinned_busy = false;
  sgm__lock_drop(&d->lock);
  if (!mine) disk_bounce_put(d, p);
}

/* A cached AIO context or a new one; false where the kernel will not give one
 * (then the transfer is synchronous: slower, equally correct). */
static bool disk_aio_get(sgm_disk *d, aio_context_t *ctx) {
  *ctx = 0;
  if (!__atomic_load_n(&d->aio_ok, __ATOMIC_RELAXED)) return false;
  sgm__lock_take(&d->lock);
  bool cached = d->n_aio > 0;
  if (cached) *ctx = d->aio[--d->n_aio];
  sgm__lock_drop(&d->lock);
  if (cached) return true;
  if (syscall(SYS_io_setup, DISK_AIO_DEPTH, ctx) == 0) return true;
  /* EAGAIN: fs.aio-max-nr is used up for now; anything else (ENOSYS, EPERM
   * under seccomp) will not change: stop asking. */
  if (errno != EAGAIN) {
    __atomic_store_n(&d->aio_ok, 0, __ATOMIC_RELAXED);
    sgm__log(d->verbose, 2, "no Linux AIO (%s): spill I/O is synchronous", strerror(errno));
  }
  *ctx = 0;
  return false;
}

static void disk_aio_put(sgm_disk *d, aio_context_t ctx) {
  sgm__lock_take(&d->lock);
  bool cached = d->n_aio < DISK_AIO_CACHE;
  if (cached) d->aio[d->n_aio++] = ctx;
  sgm__lock_drop(&d->lock);
  if (!cached) syscall(SYS_io_destroy, ctx);
}

/* One transfer's state: its engine and the bytes moved. */
typedef struct disk_xfer {
  const sgm_disk_engine *e; /* the engine, fixed for the transfer */
  void *user;               /* its argument */
  int fd;                   /* the spill file */
  uint64_t done;            /* bytes: data moved so far */
} disk_xfer;

/* Move all len bytes at off through the transfer's engine (writing: buf to
 * the file, else the file to buf; a write only reads buf, whatever its
 * type); 0, an errno, or DISK_SHORT (a read at end of file, or a write the
 * file system took none of). Retries EINTR; counts x->done. */
static int disk_io_all(disk_xfer *x, bool writing, unsigned char *buf, uint64_t len, uint64_t off) {
  while (len) {
    size_t chunk = (size_t)(len > DISK_IO_MAX ? DISK_IO_MAX : len);
    ssize_t n = writing ? x->e->pwrite(x->user, x->fd, buf, chunk, off)
                        : x->e->pread(x->user, x->fd, buf, chunk, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return DISK_SHORT;
    buf += n, off += (uint64_t)n, len -= (uint64_t)n, x->done += (uint64_t)n;
  }
  return 0;
}

/* One piece of a pipelined transfer. */
typedef struct disk_slot {
  struct iocb cb; /* the request as submitted */
  int64_t res;    /* once done: bytes moved, or -errno */
  int err;        /* moved synchronously instead: 0, an errno or DISK_SHORT */
  bool async;     /* submitted to the kernel (else moved synchronously) */
  bool done;      /* finished: res / err are valid */
} disk_slot;

/* Wait for at least one completion. false when the context broke (then it is
 * destroyed, which waits for everything in flight, and every pending slot
 * fails with EIO). */
static bool disk_aio_reap(const disk_xfer *x, aio_context_t ctx, disk_slot *slots,
                          uint64_t *in_flight) {
  struct io_event ev[DISK_AIO_DEPTH];
  long r = x->e->io_getevents(x->user, ctx, 1, DISK_AIO_DEPTH, ev);
  if (r < 0 && errno == EINTR) return true;
  if (r < 0) {
    syscall(SYS_io_destroy, ctx);
    for (int i = 0; i < DISK_AIO_DEPTH; i++)
      if (!slots[i].done) slots[i].done = true, slots[i].res = -EIO;
    *in_flight = 0;
    return false;
  }
  for (long i = 0; i < r; i++) {
    disk_slot *s = (disk_slot *)(uintptr_t)ev[i].data;
    s->res = ev[i].res;
    s->done = true;
    (*in_flight)--;
  }
  return true;
}

/* DIRECT, aligned buffer, len a multiple of DISK_ALIGN: move it in pieces
 * of piece bytes with up to DISK_AIO_DEPTH in flight, hashing each
 * piece while later ones move (writes: just before it is submitted; reads: as
 * soon as it and all before it have arrived), so the checksum costs almost
 * nothing over the I/O. A piece that comes back short is finished with the
 * synchronous loop, which names the errno. Returns only when nothing is in
 * flight. *ctx_ok = false when the context broke and must not be reused. */
static int disk_aio_body(sgm_disk *d, aio_context_t ctx, bool writing, unsigned char *buf,
                         uint64_t len, uint64_t off, uint64_t piece, disk_xfer *x,
                         XXH3_state_t *hs, bool *ctx_ok) {
  disk_slot slots[DISK_AIO_DEPTH];
  memset(slots, 0, sizeof slots);
  const uint64_t n_chunks = (len + piece - 1) / piece;
  uint64_t next_submit = 0, next_done = 0, in_flight = 0;
  int err = 0;
  *ctx_ok = true;
  while (next_done < n_chunks && !err) {
    while (next_submit < n_chunks && next_submit - next_done < DISK_AIO_DEPTH) {
      disk_slot *s = &slots[next_submit % DISK_AIO_DEPTH];
      const uint64_t i = next_submit++, pos = i * piece;
      const uint64_t c = len - pos < piece ? len - pos : piece;
      memset(s, 0, sizeof *s);
      if (writing) XXH3_64bits_update(hs, buf + pos, (size_t)c);
      s->cb.aio_data = (uint64_t)(uintptr_t)s;
      s->cb.aio_lio_opcode = writing ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
      s->cb.aio_fildes = (uint32_t)d->fd;
      s->cb.aio_buf = (uint64_t)(uintptr_t)(buf + pos);
      s->cb.aio_nbytes = c;
      s->cb.aio_offset = (int64_t)(off + pos);
      struct iocb *p = &s->cb;
      long r;
      do r = x->e->io_submit(x->user, ctx, 1, &p);
      while (r < 0 && errno == EINTR);
      if (r == 1) {
        s->async = true;
        in_flight++;
        continue;
      }
      /* Not queued (the kernel said EAGAIN, say): this piece moves
       * synchronously. */
      s->err = disk_io_all(x, writing, buf + pos, c, off + pos);
      s->done = true;
    }
    disk_slot *s = &slots[next_done % DISK_AIO_DEPTH];
    while (!s->done)
      if (!disk_aio_reap(x, ctx, slots, &in_flight)) *ctx_ok = false;
    uint64_t pos = next_done * piece;
    uint64_t c = len - pos < piece ? len - pos : piece;
    if (s->err) {
      err = s->err;
    } else if (s->async && s->res < 0) {
      err = (int)-s->res;
    } else if (s->async) {
      uint64_t got = (uint64_t)s->res;
      x->done += got;
      if (got < c)
        err = disk_io_all(x, writing, buf + pos + got, c - got, off + pos + got);
    }
    if (!err && !writing) XXH3_64bits_update(hs, buf + pos, (size_t)c);
    next_done++;
  }
  /* The kernel may still be moving later pieces of this buffer. */
  while (in_flight)
    if (!disk_aio_reap(x, ctx, slots, &in_flight)) *ctx_ok = false;
  return err;
}

/* Move the aligned body of a DIRECT transfer: pipelined when it is at least
 * two pieces long and AIO is there, else one synchronous call. */
static int disk_direct_body(sgm_disk *d, bool writing, unsigned char *buf, uint64_t len,
                            uint64_t off, disk_xfer *x, XXH3_state_t *hs) {
  /* Quarters of a small body, so even a 1 MiB extent overlaps 3/4 of its hash. */
  uint64_t piece = (len / 4) & ~(DISK_ALIGN - 1);
  if (piece < DISK_AIO_MIN_CHUNK) piece = DISK_AIO_MIN_CHUNK;
  if (piece > DISK_AIO_CHUNK) piece = DISK_AIO_CHUNK;
  aio_context_t ctx;
  if (len >= 2 * piece && disk_aio_get(d, &ctx)) {
    bool ctx_ok = true;
    int err = disk_aio_body(d, ctx, writing, buf, len, off, piece, x, hs, &ctx_ok);
    if (ctx_ok) disk_aio_put(d, ctx);
    return err;
  }
  if (writing) XXH3_64bits_update(hs, buf, (size_t)len);
  int err = disk_io_all(x, writing, buf, len, off);
  if (!err && !writing) XXH3_64bits_update(hs, buf, (size_t)len);
  return err;
}

/* DIRECT write: the aligned body straight from src, the rest through a bounce
 * buffer padded with zeros to a whole block. *sum = XXH3 of the n bytes. */
static int disk_write_direct(sgm_disk *d, const unsigned char *src, uint64_t n, uint64_t off,
                             disk_xfer *x, uint64_t *sum) {
  XXH3_state_t hs;
  XXH3_64bits_reset(&hs);
  uint64_t pos = 0;
  int err = 0;
  if (((uintptr_t)src & (d->mem_align - 1)) == 0) {
    pos = n & ~(DISK_ALIGN - 1);
    /* The body is only read: the cast serves the shared read/write helper. */
    err = pos ? disk_direct_body(d, true, (unsigned char *)(uintptr_t)src, pos, off, x, &hs) : 0;
  }
  if (!err && pos < n) {
    unsigned char *bounce = disk_bounce_get(d);
    if (!bounce) return ENOMEM;
    while (pos < n && !err) {
      uint64_t c = n - pos < DISK_BOUNCE_BYTES ? n - pos : DISK_BOUNCE_BYTES;
      uint64_t padded = sgm__align_up(c, DISK_ALIGN);
      memcpy(bounce, src + pos, (size_t)c);
      memset(bounce + c, 0, (size_t)(padded - c));
      XXH3_64bits_update(&hs, bounce, (size_t)c);
      uint64_t before = x->done;
      err = disk_io_all(x, true, bounce, padded, off + pos);
      if (x->done - before > c) x->done = before + c; /* the padding is not data */
      pos += c;
    }
    disk_bounce_put(d, bounce);
  }
  if (!err) *sum = XXH3_64bits_digest(&hs);
  return err;
}

/* BUFFERED write: through the page cache, then write-back (errors surface
 * here, not at close) and drop the pages, so spilled data does not stay in
 * RAM. */
static int disk_write_buffered(sgm_disk *d, const unsigned char *src, uint64_t n, uint64_t off,
                               disk_xfer *x, uint64_t *sum) {
  *sum = XXH3_64bits(src, (size_t)n);
  int err = disk_io_all(x, true, (unsigned char *)(uintptr_t)src, n, off); /* only read */
  if (err) return err;
  if (sync_file_range(d->fd, (off_t)off, (off_t)n, SYNC_FILE_RANGE_WAIT_BEFORE |
                      SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) != 0)
    return errno;
  posix_fadvise(d->fd, (off_t)off, (off_t)n, POSIX_FADV_DONTNEED);
  return 0;
}

/* DIRECT read: the aligned body straight into dst, the rest through the
 * bounce buffer, hashed while it is in cache. */
static int disk_read_direct(sgm_disk *d, unsigned char *dst, uint64_t n, uint64_t off,
                            disk_xfer *x, uint64_t *sum) {
  XXH3_state_t hs;
  XXH3_64bits_reset(&hs);
  uint64_t pos = 0;
  int err = 0;
  if (((uintptr_t)dst & (d->mem_align - 1)) == 0) {
    pos = n & ~(DISK_ALIGN - 1);
    err = pos ? disk_direct_body(d, false, dst, pos, off, x, &hs) : 0;
  }
  if (!err && pos < n) {
    unsigned char *bounce = disk_bounce_get(d);
    if (!bounce) return ENOMEM;
    while (pos < n && !err) {
      uint64_t c = n - pos < DISK_BOUNCE_BYTES ? n - pos : DISK_BOUNCE_BYTES;
      err = disk_io_all(x, false, bounce, sgm__align_up(c, DISK_ALIGN), off + pos);
      if (err) break;
      XXH3_64bits_update(&hs, bounce, (size_t)c);
      memcpy(dst + pos, bounce, (size_t)c);
      pos += c;
    }
    disk_bounce_put(d, bounce);
  }
  if (!err) *sum = XXH3_64bits_digest(&hs);
  return err;
}

/* BUFFERED read. Readahead is off (POSIX_FADV_RANDOM at open: extents are not
 * read in file order, and pages read ahead past an extent would stay cached);
 * WILLNEED asks for exactly this extent at once, then the pages are dropped. */
static int disk_read_buffered(sgm_disk *d, unsigned char *dst, uint64_t n, uint64_t off,
                              disk_xfer *x, uint64_t *sum) {
  posix_fadvise(d->fd, (off_t)off, (off_t)n, POSIX_FADV_WILLNEED);
  int err = disk_io_all(x, false, dst, n, off);
  posix_fadvise(d->fd, (off_t)off, (off_t)n, POSIX_FADV_DONTNEED);
  if (!err) *sum = XXH3_64bits(dst, (size_t)n);
  return err;
}

/* Give an extent's blocks back to the file system (and its pages, in
 * BUFFERED mode). Without hole punching the blocks stay in the file and are
 * reused by later extents. */
static void disk_punch(sgm_disk *d, uint64_t off, uint64_t size) {
  if (!__atomic_load_n(&d->punch_ok, __ATOMIC_RELAXED)) return;
  if (fallocate(d->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)size) != 0 &&
      (errno == EOPNOTSUPP || errno == ENOSYS)) {
    __atomic_store_n(&d->punch_ok, 0, __ATOMIC_RELAXED);
    sgm__log(d->verbose, 2, "%s cannot punch holes: freed spill extents keep their blocks until "
             "reused or the context ends", d->fs_name);
  }
}

/* Return a carved range to the budget (reserve: to the reservation it came from). */
static void disk_release_range(sgm_disk *d, uint64_t off, bool reserve) {
  sgm__lock_take(&d->lock);
  uint64_t size = 0;
  int rc = sgm__suballoc_free(d->sa, off, &size);
  sgm_assert_internal(rc == SGM_OK);
  (void)rc;
  d->used_bytes -= size;
  if (reserve) d->reserved_bytes += size;
  d->n_live--;
  sgm__lock_drop(&d->lock);
}

/* The message for a failed transfer: what failed, the file system with its
 * free space, the limit and what to do. */
static int disk_io_error(sgm_disk *d, bool writing, int err, uint64_t n, uint64_t off,
                         uint64_t done) {
  char a[32], b[32], c[32], l[32], u[32], fr[32];
  struct statvfs vfs;
  uint64_t free_bytes = 0, total = 0;
  if (fstatvfs(d->fd, &vfs) == 0) {
    free_bytes = (uint64_t)vfs.f_bavail * vfs.f_frsize;
    total = (uint64_t)vfs.f_blocks * vfs.f_frsize;
  }
  sgm__lock_take(&d->lock);
  uint64_t used = d->used_bytes;
  sgm__lock_drop(&d->lock);
  const char *why = err == DISK_SHORT ? (writing ? "short write (no progress)" : "short read "
                                                   "(end of file)")
                                      : strerror(err);
  const char *hint = !writing ? "the spilled data cannot be read back; check the disk (dmesg)"
                     : err == ENOSPC || err == DISK_SHORT || err == EDQUOT
                         ? "the data stays where it was; free space there, lower SGM_SPILL_LIMIT "
                           "below the free space, or set SGM_SPILL_DIR to a larger file system"
                         : "the data stays where it was; check the disk (dmesg) or set "
                           "SGM_SPILL_DIR to another file system";
  /* The errno and the hint first: the paths after them are the part a
   * message cut at SGM_ERROR_MAX can lose. */
  return sgm__error_set(SGM_ERR_IO,
                        "spill %s of %s at offset %llu failed after %s: %s; %s (spill file in %s "
                        "on %s, %s free of %s, SGM_SPILL_LIMIT %s with %s spilled now)",
                        writing ? "write" : "read", sgm__fmt_bytes(n, a, sizeof a),
                        (unsigned long long)off, sgm__fmt_bytes(done, b, sizeof b), why, hint,
                        d->dir, d->fs_name, sgm__fmt_bytes(free_bytes, fr, sizeof fr),
                        sgm__fmt_bytes(total, c, sizeof c),
                        sgm__fmt_bytes(d->limit_bytes, l, sizeof l),
                        sgm__fmt_bytes(used, u, sizeof u));
}

/* ------------------------------------------------------------------------ */
/* Extents. */

/* ------------------------------------------------------------------------ */
/* The budget: extents carved plus reservations, counted here only. */

int sgm__disk_reserve(sgm_disk *d, uint64_t bytes) {
  uint64_t size = sgm__align_up(bytes, DISK_ALIGN);
  sgm__lock_take(&d->lock);
  uint64_t in_use = d->used_bytes + d->reserved_bytes;
  bool fits = size <= d->limit_bytes && in_use <= d->limit_bytes - size;
  if (fits) {
    d->reserved_bytes += size;
    if (d->used_bytes + d->reserved_bytes > d->peak_used_bytes)
      d->peak_used_bytes = d->used_bytes + d->reserved_bytes;
  }
  sgm__lock_drop(&d->lock);
  if (fits) return SGM_OK;
  char a[32], l[32], u[32];
  return sgm__error_set(SGM_ERR_NOMEM, "disk tier budget exhausted: cannot place %s; "
                        "SGM_SPILL_LIMIT gives %s, %s in use (raise SGM_SPILL_LIMIT or free "
                        "spilled buffers)", sgm__fmt_bytes(bytes, a, sizeof a),
                        sgm__fmt_bytes(d->limit_bytes, l, sizeof l),
                        sgm__fmt_bytes(in_use, u, sizeof u));
}

void sgm__disk_unreserve(sgm_disk *d, uint64_t bytes) {
  uint64_t size = sgm__align_up(bytes, DISK_ALIGN);
  sgm__lock_take(&d->lock);
  sgm_assert_internal(d->reserved_bytes >= size);
  d->reserved_bytes -= size < d->reserved_bytes ? size : d->reserved_bytes;
  sgm__lock_drop(&d->lock);
}

/* The size of the live extent at off, 0 when there is none (a kept range is
 * not live). Under d->lock. */
static uint64_t disk_live_size_locked(sgm_disk *d, uint64_t off) {
  for (unsigned k = 0; k < d->n_kept; k++)
    if (d->kept[k].off == off) return 0;
  return sgm__suballoc_block_size(d->sa, off);
}

/* SGM_ERR_INVALID unless e is a live extent of at least e->bytes. */
static int disk_check_live(sgm_disk *d, const sgm_disk_extent *e) {
  sgm__lock_take(&d->lock);
  uint64_t size = disk_live_size_locked(d, e->offset);
  sgm__lock_drop(&d->lock);
  if (size >= e->bytes) return SGM_OK;
  return sgm__error_set(SGM_ERR_INVALID, "spill read at offset %llu: no live extent of %llu "
                        "bytes there", (unsigned long long)e->offset, (unsigned long long)e->bytes);
}

/* SGM_ERR_CORRUPT: extent e read back with checksum sum. */
static int disk_corrupt(sgm_disk *d, const sgm_disk_extent *e, uint64_t sum) {
  char a[32];
  return sgm__error_set(SGM_ERR_CORRUPT,
                        "spilled data failed its checksum: extent of %s at offset %llu in the "
                        "spill file in %s (%s) was stored with XXH3 %016llx and reads back as "
                        "%016llx; the file was changed or the disk returned bad data, and "
                        "this buffer's contents are lost",
                        sgm__fmt_bytes(e->bytes, a, sizeof a), (unsigned long long)e->offset,
                        d->dir, d->fs_name, (unsigned long long)e->checksum,
                        (unsigned long long)sum);
}

/* Punch every kept range and give it back to the sub-allocator; returns the
 * bytes. Punched before the release, as sgm__disk_free does. */
static uint64_t disk_kept_flush(sgm_disk *d) {
  disk_kept batch[DISK_KEPT_MAX];
  sgm__lock_take(&d->lock);
  unsigned n = d->n_kept;
  memcpy(batch, d->kept, n * sizeof *batch);
  d->n_kept = 0;
  d->kept_bytes = 0;
  sgm__lock_drop(&d->lock);
  uint64_t bytes = 0;
  for (unsigned k = 0; k < n; k++) {
    disk_punch(d, batch[k].off, batch[k].size);
    bytes += batch[k].size;
  }
  sgm__lock_take(&d->lock);
  for (unsigned k = 0; k < n; k++) {
    uint64_t size = 0;
    int rc = sgm__suballoc_free(d->sa, batch[k].off, &size);
    sgm_assert_internal(rc == SGM_OK);
    (void)rc;
  }
  sgm__lock_drop(&d->lock);
  return bytes;
}

/* Keep a freed extent's range (size bytes at off) for reuse instead of
 * punching it, if there is room; the budget and n_live let go of it now. */
static bool disk_keep(sgm_disk *d, uint64_t off, uint64_t size) {
  if (!__atomic_load_n(&d->punch_ok, __ATOMIC_RELAXED)) return false; /* nothing to save */
  sgm__lock_take(&d->lock);
  bool keep = d->n_kept < DISK_KEPT_MAX && d->kept_bytes + size <= d->kept_limit;
  if (keep) {
    d->kept[d->n_kept++] = (disk_kept){off, size};
    d->kept_bytes += size;
    d->used_bytes -= size;
    d->n_live--;
  }
  sgm__lock_drop(&d->lock);
  return keep;
}

uint64_t sgm__disk_trim(sgm_disk *d) { return disk_kept_flush(d); }

uint64_t sgm__disk_activity(const sgm_disk *d) { return __atomic_load_n(&d->n_ops, __ATOMIC_RELAXED); }

/* Carve an extent of n bytes (reserved: out of a reservation) and charge the
 * budget; SGM_ERR_NOMEM naming SGM_SPILL_LIMIT when it does not fit.
 * *reused: the range is a kept one (its blocks are there). */
static int disk_carve(sgm_disk *d, uint64_t n, bool reserved, uint64_t *off, uint64_t *size,
                      bool *reused) {
  __atomic_add_fetch(&d->n_ops, 1, __ATOMIC_RELAXED);
  bool flushed = false;
  *reused = false;
again:
  sgm__lock_take(&d->lock);
  /* Reservations hold budget the sub-allocator does not see: a write that
   * does not come from one must fit beside them. */
  uint64_t want = sgm__align_up(n, DISK_ALIGN);
  bool over = !reserved && d->used_bytes + d->reserved_bytes + want > d->limit_bytes;
  bool got = false;
  for (unsigned k = 0; !over && k < d->n_kept && !got; k++) {
    if (d->kept[k].size != want) continue;
    /* A kept range of this size: its blocks are there, the write overwrites them all. */
    *off = d->kept[k].off;
    *size = d->kept[k].size;
    d->kept_bytes -= *size;
    d->kept[k] = d->kept[--d->n_kept];
    got = *reused = true;
  }
  if (!got && !over) {
    got = sgm__suballoc_try_alloc(d->sa, n, off, size);
    if (!got && d->n_kept && !flushed) {
      /* Kept ranges stand in the way: give them back, then try again. */
      sgm__lock_drop(&d->lock);
      disk_kept_flush(d);
      flushed = true;
      goto again;
    }
  }
  if (over || !got) {
    char a[32], l[32], u[32], f[32];
    sgm_suballoc_stats st;
    sgm__suballoc_stats(d->sa, &st);
    int rc;
    if (!over && st.largest_free_bytes >= want)
      rc = sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill extent metadata");
    else
      rc = sgm__error_set(SGM_ERR_NOMEM,
                          "disk tier budget exhausted: cannot spill %s; SGM_SPILL_LIMIT gives %s, "
                          "%s spilled now in %llu extents, largest free extent %s (raise "
                          "SGM_SPILL_LIMIT or free spilled buffers)",
                          sgm__fmt_bytes(n, a, sizeof a),
                          sgm__fmt_bytes(d->limit_bytes, l, sizeof l),
                          sgm__fmt_bytes(d->used_bytes + d->reserved_bytes, u, sizeof u),
                          (unsigned long long)d->n_live,
                          sgm__fmt_bytes(st.largest_free_bytes, f, sizeof f));
    sgm__lock_drop(&d->lock);
    return rc;
  }
  d->used_bytes += *size;
  if (reserved) d->reserved_bytes -= *size < d->reserved_bytes ? *size : d->reserved_bytes;
  if (d->used_bytes + d->reserved_bytes > d->peak_used_bytes)
    d->peak_used_bytes = d->used_bytes + d->reserved_bytes;
  d->n_live++;
  sgm__lock_drop(&d->lock);
  return SGM_OK;
}

int sgm__disk_write(sgm_disk *d, const void *src, uint64_t n, sgm_disk_extent *out) {
  return sgm__disk_write_ex(d, src, n, false, out);
}

int sgm__disk_write_ex(sgm_disk *d, const void *src, uint64_t n, bool reserved,
                       sgm_disk_extent *out) {
  memset(out, 0, sizeof *out);
  if (n == 0) return sgm__error_set(SGM_ERR_INVALID, "spill write of 0 bytes");
  if (n > UINT64_MAX - DISK_ALIGN || n > (uint64_t)SIZE_MAX)
    return sgm__error_set(SGM_ERR_INVALID, "spill write of %llu bytes overflows",
                          (unsigned long long)n);
  uint64_t off = 0, size = 0;
  disk_xfer x = {NULL, NULL, d->fd, 0};
  disk_engine_get(d, &x.e, &x.user);
  if (x.e->begin) x.e->begin(x.user, true, n);
  bool reused = false;
  int rc = disk_carve(d, n, reserved, &off, &size, &reused);
  if (rc != SGM_OK) return rc;

  uint64_t sum = 0;
  int err = d->io == SGM_DISK_IO_DIRECT ? disk_write_direct(d, src, n, off, &x, &sum)
                                        : disk_write_buffered(d, src, n, off, &x, &sum);
  if (sgm_unlikely(err)) {
    /* Give back what was carved and whatever reached the file; a kept
     * range goes back to being kept, its blocks as they were. */
    if (!reused || reserved || !disk_keep(d, off, size)) {
      disk_punch(d, off, size);
      disk_release_range(d, off, reserved);
    }
    if (err == ENOMEM)
      return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for a spill bounce buffer");
    return disk_io_error(d, true, err, n, off, x.done);
  }
  sgm__lock_take(&d->lock);
  d->bytes_in += n;
  sgm__lock_drop(&d->lock);
  out->offset = off;
  out->bytes = n;
  out->checksum = sum;
  return SGM_OK;
}

int sgm__disk_read(sgm_disk *d, const sgm_disk_extent *e, void *dst) {
  __atomic_add_fetch(&d->n_ops, 1, __ATOMIC_RELAXED);
  if (!e || e->bytes == 0)
    return sgm__error_set(SGM_ERR_INVALID, "spill read of an empty extent");
  int rc = disk_check_live(d, e);
  if (rc != SGM_OK) return rc;
  disk_xfer x = {NULL, NULL, d->fd, 0};
  disk_engine_get(d, &x.e, &x.user);
  if (x.e->begin) x.e->begin(x.user, false, e->bytes);
  uint64_t sum = 0;
  int err = d->io == SGM_DISK_IO_DIRECT ? disk_read_direct(d, dst, e->bytes, e->offset, &x, &sum)
                                        : disk_read_buffered(d, dst, e->bytes, e->offset, &x, &sum);
  if (sgm_unlikely(err)) {
    if (err == ENOMEM)
      return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for a spill bounce buffer");
    return disk_io_error(d, false, err, e->bytes, e->offset, x.done);
  }
  if (sgm_unlikely(sum != e->checksum)) return disk_corrupt(d, e, sum);
  sgm__lock_take(&d->lock);
  d->bytes_out += e->bytes;
  sgm__lock_drop(&d->lock);
  return SGM_OK;
}

void sgm__disk_free(sgm_disk *d, const sgm_disk_extent *e) { sgm__disk_free_ex(d, e, false); }

void sgm__disk_free_ex(sgm_disk *d, const sgm_disk_extent *e, bool reserve) {
  __atomic_add_fetch(&d->n_ops, 1, __ATOMIC_RELAXED);
  if (!e || e->bytes == 0) return;
  sgm__lock_take(&d->lock);
  uint64_t size = disk_live_size_locked(d, e->offset);
  sgm__lock_drop(&d->lock);
  sgm_assert(size >= e->bytes); /* a stale extent: the caller's bookkeeping is broken */
  if (size < e->bytes) return;
  /* Kept for the next write of its size (no punch now, no allocation then),
   * or punched before the range is free again: a write that got it next
   * could otherwise lose its fresh data to this hole. */
  if (!reserve && disk_keep(d, e->offset, size)) return;
  disk_punch(d, e->offset, size);
  disk_release_range(d, e->offset, reserve);
}

/* ------------------------------------------------------------------------ */
/* Staged transfers: device memory <-> the file through the staging slots,
 * pipelined. Slot s holds piece i (i % SGM_DISK_STAGE_SLOTS == s) from its
 * fill until its write completed, or from the read's submission until its
 * drain; its AIO requests are req[s * DISK_PIPE_REQS ...]. */

#define DISK_PIPE_REQS (DISK_AIO_DEPTH / SGM_DISK_STAGE_SLOTS)
_Static_assert(SGM_DISK_BOUNCE_BYTES / DISK_AIO_MIN_CHUNK <= DISK_PIPE_REQS,
               "a staging slot's AIO requests fit in its share of the context");

typedef struct disk_pipe_slot {
  unsigned char *buf; /* the slot's staging memory, SGM_DISK_BOUNCE_BYTES */
  uint64_t index;     /* the piece it holds */
  uint64_t off;       /* bytes: the piece's extent offset in the file */
  uint64_t len;       /* bytes of data (padded to DISK_ALIGN on disk) */
  uint64_t sum;       /* BUFFERED reads: XXH3 of the data, computed by the read */
  unsigned n_req;     /* AIO requests in flight for it (0: moved synchronously) */
  int err;            /* a synchronous move's outcome: 0, an errno or DISK_SHORT */
  bool busy;          /* its I/O is started and not finished */
} disk_pipe_slot;

typedef struct disk_pipe {
  sgm_disk *d;          /* the tier */
  bool writing;         /* the direction */
  bool pinned;          /* the slots are the lent pinned region */
  disk_xfer x;          /* engine and bytes moved */
  aio_context_t ctx;    /* 0: no AIO (synchronous pieces) */
  bool ctx_ok;          /* ctx may go back to the cache */
  uint64_t in_flight;   /* AIO requests submitted and not reaped */
  disk_slot req[DISK_AIO_DEPTH];                 /* the requests, DISK_PIPE_REQS per slot */
  disk_pipe_slot slot[SGM_DISK_STAGE_SLOTS];     /* the staging slots */
} disk_pipe;

/* The pipe's slots (the pinned region when free, else cached pieces) and an
 * AIO context in DIRECT mode; ENOMEM when no staging memory. */
static int disk_pipe_open(sgm_disk *d, bool writing, disk_pipe *p) {
  memset(p, 0, sizeof *p);
  p->d = d;
  p->writing = writing;
  p->x.fd = d->fd;
  disk_engine_get(d, &p->x.e, &p->x.user);
  sgm__lock_take(&d->lock);
  unsigned char *pinned = d->pinned && !d->pinned_busy ? d->pinned : NULL;
  if (pinned) d->pinned_busy = true;
  sgm__lock_drop(&d->lock);
  p->pinned = pinned != NULL;
  for (unsigned s = 0; s < SGM_DISK_STAGE_SLOTS; s++) {
    p->slot[s].buf = pinned ? pinned + s * SGM_DISK_BOUNCE_BYTES : disk_bounce_get(d);
    if (!p->slot[s].buf) return ENOMEM; /* disk_pipe_close gives back what was taken */
  }
  if (d->io == SGM_DISK_IO_DIRECT && disk_aio_get(d, &p->ctx)) p->ctx_ok = true;
  return 0;
}

static void disk_pipe_close(disk_pipe *p) {
  sgm_disk *d = p->d;
  if (p->ctx && p->ctx_ok) disk_aio_put(d, p->ctx);
  if (p->pinned) {
    sgm__lock_take(&d->lock);
    d->pinned_busy = false;
    sgm__lock_drop(&d->lock);
    return;
  }
  for (unsigned s = 0; s < SGM_DISK_STAGE_SLOTS; s++) disk_bounce_put(d, p->slot[s].buf);
}

/* Start slot s's I/O: its padded bytes to or from the file. DIRECT with AIO:
 * requests of a quarter of the piece (512 KiB .. 1 MiB, as disk_direct_body),
 * a piece under two requests synchronously; BUFFERED: synchronously through
 * the page cache (sum computed there). A request the kernel does not take
 * moves synchronously; its outcome waits in the request for disk_pipe_finish. */
static void disk_pipe_start(disk_pipe *p, unsigned s) {
  disk_pipe_slot *sl = &p->slot[s];
  sgm_disk *d = p->d;
  sl->busy = true;
  sl->n_req = 0;
  sl->err = 0;
  if (p->x.e->begin) p->x.e->begin(p->x.user, p->writing, sl->len);
  if (d->io == SGM_DISK_IO_BUFFERED) {
    sl->err = p->writing ? disk_write_buffered(d, sl->buf, sl->len, sl->off, &p->x, &sl->sum)
                         : disk_read_buffered(d, sl->buf, sl->len, sl->off, &p->x, &sl->sum);
    return;
  }
  uint64_t padded = sgm__align_up(sl->len, DISK_ALIGN);
  uint64_t piece = (padded / 4) & ~(DISK_ALIGN - 1);
  if (piece < DISK_AIO_MIN_CHUNK) piece = DISK_AIO_MIN_CHUNK;
  if (piece > DISK_AIO_CHUNK) piece = DISK_AIO_CHUNK;
  if (!p->ctx || padded < 2 * piece) {
    uint64_t before = p->x.done;
    sl->err = disk_io_all(&p->x, p->writing, sl->buf, padded, sl->off);
    if (p->x.done - before > sl->len) p->x.done = before + sl->len; /* padding is not data */
    return;
  }
  for (uint64_t pos = 0; pos < padded; pos += piece) {
    disk_slot *r = &p->req[s * DISK_PIPE_REQS + sl->n_req++];
    uint64_t c = padded - pos < piece ? padded - pos : piece;
    memset(r, 0, sizeof *r);
    r->cb.aio_data = (uint64_t)(uintptr_t)r;
    r->cb.aio_lio_opcode = p->writing ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    r->cb.aio_fildes = (uint32_t)d->fd;
    r->cb.aio_buf = (uint64_t)(uintptr_t)(sl->buf + pos);
    r->cb.aio_nbytes = c;
    r->cb.aio_offset = (int64_t)(sl->off + pos);
    struct iocb *cb = &r->cb;
    long rc = -1;
    if (p->ctx) {
      do rc = p->x.e->io_submit(p->x.user, p->ctx, 1, &cb);
      while (rc < 0 && errno == EINTR);
    }
    if (rc == 1) {
      r->async = true;
      p->in_flight++;
      continue;
    }
    r->err = disk_io_all(&p->x, p->writing, sl->buf + pos, c, sl->off + pos);
    r->done = true;
  }
}

/* Wait for slot s's I/O; 0 or the first errno / DISK_SHORT. complete: a
 * request that came back short is finished synchronously (else, on a
 * failed transfer's way out, only reaped). */
static int disk_pipe_finish(disk_pipe *p, unsigned s, bool complete) {
  disk_pipe_slot *sl = &p->slot[s];
  int err = sl->err;
  for (unsigned k = 0; k < sl->n_req; k++) {
    disk_slot *r = &p->req[s * DISK_PIPE_REQS + k];
    while (!r->done)
      if (!disk_aio_reap(&p->x, p->ctx, p->req, &p->in_flight)) {
        /* The context is gone (destroyed, every request failed): the
         * rest of this transfer moves synchronously. */
        p->ctx = 0;
        p->ctx_ok = false;
      }
    uint64_t c = r->cb.aio_nbytes;
    int e = r->err;
    if (!e && r->async && r->res < 0) e = (int)-r->res;
    if (!e && r->async) {
      uint64_t got = (uint64_t)r->res;
      p->x.done += got;
      unsigned char *b = (unsigned char *)(uintptr_t)r->cb.aio_buf;
      uint64_t o = (uint64_t)r->cb.aio_offset;
      if (got < c && complete)
        e = disk_io_all(&p->x, p->writing, b + got, c - got, o + got);
      else if (got < c)
        e = DISK_SHORT;
    }
    if (!err) err = e;
  }
  sl->busy = false;
  sl->n_req = 0;
  return err;
}

/* Wait for every busy slot (a failed transfer's way out). */
static void disk_pipe_drain(disk_pipe *p) {
  for (unsigned s = 0; s < SGM_DISK_STAGE_SLOTS; s++)
    if (p->slot[s].busy) disk_pipe_finish(p, s, false);
  sgm_assert_internal(p->in_flight == 0);
}

static uint64_t disk_piece_len(uint64_t total, uint64_t piece, uint64_t i) {
  return total - i * piece < piece ? total - i * piece : piece;
}

static int disk_staged_args(uint64_t total, uint64_t piece, const char *what) {
  if (total == 0 || piece == 0 || piece % DISK_ALIGN || piece > SGM_DISK_BOUNCE_BYTES ||
      total > UINT64_MAX - piece)
    return sgm__error_set(SGM_ERR_INVALID, "staged spill %s of %llu bytes in pieces of %llu: "
                          "pieces must be a multiple of 4 KiB up to %llu bytes", what,
                          (unsigned long long)total, (unsigned long long)piece,
                          (unsigned long long)SGM_DISK_BOUNCE_BYTES);
  return SGM_OK;
}

int sgm__disk_write_staged(sgm_disk *d, uint64_t total, uint64_t piece, sgm_disk_stage_fn fill,
                           void *user, sgm_disk_extent *out) {
  int rc = disk_staged_args(total, piece, "write");
  if (rc != SGM_OK) return rc;
  const uint64_t n = (total + piece - 1) / piece;
  memset(out, 0, (size_t)n * sizeof *out);
  /* The budget first, every extent of it: nothing moves unless all fit. */
  uint64_t carved = 0, size = 0;
  for (; carved < n; carved++) {
    bool reused = false; /* a failed staged write punches every range, kept or not */
    rc = disk_carve(d, disk_piece_len(total, piece, carved), false, &out[carved].offset, &size,
                    &reused);
    if (rc != SGM_OK) break;
    out[carved].bytes = disk_piece_len(total, piece, carved);
  }
  if (rc != SGM_OK) goto out_release;
  disk_pipe p;
  int err = disk_pipe_open(d, true, &p);
  uint64_t failed = 0; /* the piece whose I/O failed first */
  for (uint64_t i = 0; i < n && rc == SGM_OK && !err; i++) {
    disk_pipe_slot *sl = &p.slot[i % SGM_DISK_STAGE_SLOTS];
    /* The slot's previous piece must be on disk before the fill reuses it. */
    if (sl->busy && (err = disk_pipe_finish(&p, (unsigned)(i % SGM_DISK_STAGE_SLOTS), true)) != 0) {
      failed = sl->index;
      break;
    }
    sl->index = i;
    sl->off = out[i].offset;
    sl->len = out[i].bytes;
    rc = fill(user, i, sl->buf, sl->len);
    if (rc != SGM_OK) break;
    /* Hashed while the fill's bytes are in cache. O_DIRECT writes whole
     * blocks: the last one's tail is zeros, not stale staging. */
    out[i].checksum = XXH3_64bits(sl->buf, (size_t)sl->len);
    if (d->io == SGM_DISK_IO_DIRECT)
      memset(sl->buf + sl->len, 0, (size_t)(sgm__align_up(sl->len, DISK_ALIGN) - sl->len));
    disk_pipe_start(&p, (unsigned)(i % SGM_DISK_STAGE_SLOTS));
  }
  /* The last pieces, in piece order, so the first failure is the one named. */
  for (uint64_t i = n > SGM_DISK_STAGE_SLOTS ? n - SGM_DISK_STAGE_SLOTS : 0;
       i < n && rc == SGM_OK && !err; i++) {
    unsigned s = (unsigned)(i % SGM_DISK_STAGE_SLOTS);
    if (p.slot[s].busy && (err = disk_pipe_finish(&p, s, true)) != 0) failed = p.slot[s].index;
  }
  if (rc != SGM_OK || err) disk_pipe_drain(&p);
  disk_pipe_close(&p);
  if (err == ENOMEM)
    rc = sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill staging buffers");
  else if (err)
    rc = disk_io_error(d, true, err, out[failed].bytes, out[failed].offset, p.x.done);
  if (rc == SGM_OK) {
    sgm__lock_take(&d->lock);
    d->bytes_in += total;
    sgm__lock_drop(&d->lock);
    return SGM_OK;
  }
  /* Whatever reached the file goes back with the ranges. */
  for (uint64_t i = 0; i < carved; i++) disk_punch(d, out[i].offset, sgm__align_up(out[i].bytes, DISK_ALIGN));
out_release:
  for (uint64_t i = 0; i < carved; i++) disk_release_range(d, out[i].offset, false);
  memset(out, 0, (size_t)n * sizeof *out);
  return rc;
}

/* Verify slot s's piece against its extent's checksum. */
static int disk_pipe_verify(disk_pipe *p, unsigned s, const sgm_disk_extent *e) {
  disk_pipe_slot *sl = &p->slot[s];
  uint64_t sum = p->d->io == SGM_DISK_IO_BUFFERED ? sl->sum : XXH3_64bits(sl->buf, (size_t)sl->len);
  if (sgm_likely(sum == e->checksum)) return SGM_OK;
  return disk_corrupt(p->d, e, sum);
}

int sgm__disk_read_staged(sgm_disk *d, uint64_t total, uint64_t piece, const sgm_disk_extent *ext,
                          sgm_disk_stage_fn drain, void *user) {
  __atomic_add_fetch(&d->n_ops, 1, __ATOMIC_RELAXED);
  int rc = disk_staged_args(total, piece, "read");
  if (rc != SGM_OK) return rc;
  const uint64_t n = (total + piece - 1) / piece;
  for (uint64_t i = 0; i < n; i++) {
    if (ext[i].bytes == 0) continue; /* never written: zeros */
    rc = disk_check_live(d, &ext[i]);
    if (rc == SGM_OK && ext[i].bytes != disk_piece_len(total, piece, i))
      rc = sgm__error_set(SGM_ERR_INVALID, "staged spill read: extent %llu holds %llu bytes, its "
                          "piece %llu", (unsigned long long)i, (unsigned long long)ext[i].bytes,
                          (unsigned long long)disk_piece_len(total, piece, i));
    if (rc != SGM_OK) return rc;
  }
  disk_pipe p;
  int err = disk_pipe_open(d, false, &p);
  uint64_t failed = 0;
  /* Up to one piece per slot in flight ahead of the drain. */
  for (uint64_t i = 0; i < n && i < SGM_DISK_STAGE_SLOTS && !err; i++) {
    disk_pipe_slot *sl = &p.slot[i];
    sl->index = i;
    sl->off = ext[i].offset;
    sl->len = disk_piece_len(total, piece, i);
    if (ext[i].bytes) disk_pipe_start(&p, (unsigned)i);
  }
  for (uint64_t i = 0; i < n && rc == SGM_OK && !err; i++) {
    unsigned s = (unsigned)(i % SGM_DISK_STAGE_SLOTS);
    disk_pipe_slot *sl = &p.slot[s];
    if (ext[i].bytes == 0) {
      memset(sl->buf, 0, (size_t)sl->len);
    } else {
      if ((err = disk_pipe_finish(&p, s, true)) != 0) {
        failed = i;
        break;
      }
      rc = disk_pipe_verify(&p, s, &ext[i]);
      if (rc != SGM_OK) break;
    }
    rc = drain(user, i, sl->buf, sl->len);
    uint64_t next = i + SGM_DISK_STAGE_SLOTS;
    if (rc == SGM_OK && next < n) {
      sl->index = next;
      sl->off = ext[next].offset;
      sl->len = disk_piece_len(total, piece, next);
      if (ext[next].bytes) disk_pipe_start(&p, s);
    }
  }
  if (rc != SGM_OK || err) disk_pipe_drain(&p);
  disk_pipe_close(&p);
  if (err == ENOMEM)
    return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for spill staging buffers");
  if (err) return disk_io_error(d, false, err, ext[failed].bytes, ext[failed].offset, p.x.done);
  if (rc != SGM_OK) return rc;
  uint64_t moved = 0;
  for (uint64_t i = 0; i < n; i++) moved += ext[i].bytes;
  sgm__lock_take(&d->lock);
  d->bytes_out += moved;
  sgm__lock_drop(&d->lock);
  return SGM_OK;
}

void sgm__disk_stats(sgm_disk *d, sgm_tier_stats *out) {
  memset(out, 0, sizeof *out);
  sgm__lock_take(&d->lock);
  out->budget_bytes = d->limit_bytes;
  out->used_bytes = d->used_bytes + d->reserved_bytes;
  out->peak_used_bytes = d->peak_used_bytes;
  out->n_live = d->n_live;
  out->bytes_in = d->bytes_in;
  out->bytes_out = d->bytes_out;
  out->cached_bytes = d->kept_bytes;
  sgm__lock_drop(&d->lock);
  struct stat st;
  out->committed_bytes = fstat(d->fd, &st) == 0 ? (uint64_t)st.st_blocks * 512u : out->used_bytes;
}

int sgm__disk_fd(const sgm_disk *d) { return d->fd; }

sgm_disk_io sgm__disk_io_mode(const sgm_disk *d) { return d->io; }

const char *sgm__disk_fs_name(const sgm_disk *d) { return d->fs_name; }
