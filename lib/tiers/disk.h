/*
 * disk.h — the disk tier: one spill file per context, carved into extents.
 *
 * The spill file lives in SGM_SPILL_DIR, is opened O_TMPFILE (or created
 * with a unique name and unlinked at once) with mode 0600: it is never visible
 * in the directory and nothing outlives the process. Extents are carved from
 * [0, limit) by the sub-allocator (4 KiB granule, so O_DIRECT is possible);
 * every extent carries the XXH3-64 of its data, verified on every read.
 *
 * Threading: every function is safe from any thread (one lock, rank
 * SGM_LOCK_TIER_DISK, held only for bookkeeping, never across I/O). One
 * extent is used by one thread at a time: do not free an extent while it is
 * being read. Call these functions without holding any tier lock: they do I/O.
 * Design note and measurements: docs/disk.md.
 */
#ifndef SGM_DISK_H
#define SGM_DISK_H

#include <linux/aio_abi.h>
#include <sys/types.h>

#include "internal.h"

typedef struct sgm_disk sgm_disk;

typedef struct sgm_disk_extent {
  uint64_t offset;   /* bytes: position in the spill file (multiple of 4 KiB) */
  uint64_t bytes;    /* bytes of data (the extent on disk is rounded up to 4 KiB) */
  uint64_t checksum; /* XXH3-64 of the data */
} sgm_disk_extent;

/* How the tier moves data to and from the file (docs/disk.md has the numbers). */
typedef enum sgm_disk_io {
  SGM_DISK_IO_AUTO = 0,   /* the measured default: DIRECT where the file system allows it */
  SGM_DISK_IO_DIRECT,     /* O_DIRECT: no page cache; unaligned parts go through a bounce buffer */
  SGM_DISK_IO_BUFFERED,   /* page cache, then write-back and POSIX_FADV_DONTNEED per extent */
} sgm_disk_io;

/* Open the spill file in dir. limit is resolved against the free space of
 * dir's file system now (statvfs); unset = 50% of it; rounded down to 4 KiB.
 * *out = NULL on failure; errors (SGM_ERR_INVALID, SGM_ERR_IO, SGM_ERR_NOMEM)
 * name the directory, the errno text and what to do. dir must not be NULL. */
int sgm__disk_open(const char *dir, sgm_size limit, int verbose, sgm_disk **out);
/* What sgm__disk_open_ex can choose beyond sgm__disk_open (benchmarks, tests). */
typedef struct sgm_disk_open_opts {
  sgm_disk_io io;  /* AUTO; DIRECT falls back to BUFFERED (logged) where O_DIRECT is refused */
  bool no_tmpfile; /* tests: skip O_TMPFILE and take the create-and-unlink fallback */
} sgm_disk_open_opts;
/* sgm__disk_open with options; opts NULL = all defaults. */
int sgm__disk_open_ex(const char *dir, sgm_size limit, int verbose,
                      const sgm_disk_open_opts *opts, sgm_disk **out);
/* Close the file (its space goes back to the file system) and free d; live
 * extents are dropped. NULL is a no-op. No call may be in flight on d. */
void sgm__disk_close(sgm_disk *d);

/* Write n (> 0) bytes from host memory src into a new extent; *out describes
 * it. On any failure nothing stays allocated, *out is zeroed and the caller's
 * data is untouched: budget full → SGM_ERR_NOMEM naming SGM_SPILL_LIMIT;
 * ENOSPC, EIO, a short write → SGM_ERR_IO naming the file system (type and
 * mount point) and the limit; n == 0 or too large → SGM_ERR_INVALID. */
int sgm__disk_write(sgm_disk *d, const void *src, uint64_t n, sgm_disk_extent *out);
/* The budget, counted here only: live extents plus reservations. reserve
 * promises bytes (rounded to 4 KiB) to data that is not written yet (a
 * buffer created straight on disk): SGM_ERR_NOMEM naming SGM_SPILL_LIMIT
 * when they do not fit beside what is in use; unreserve gives them back.
 * write_ex with reserved = true carves its extent out of such a promise
 * (it cannot fail for budget); free_ex with reserve = true turns the extent
 * back into one. sgm__disk_write = write_ex(..., false, ...). */
int sgm__disk_reserve(sgm_disk *d, uint64_t bytes);
void sgm__disk_unreserve(sgm_disk *d, uint64_t bytes);
int sgm__disk_write_ex(sgm_disk *d, const void *src, uint64_t n, bool reserved,
                       sgm_disk_extent *out);
void sgm__disk_free_ex(sgm_disk *d, const sgm_disk_extent *e, bool reserve);

/* Read extent e back into dst (at least e->bytes long) and verify its
 * checksum: a mismatch → SGM_ERR_CORRUPT naming the offset and both checksums;
 * I/O errors → SGM_ERR_IO; e not a live extent → SGM_ERR_INVALID. The extent
 * stays allocated either way; on failure dst holds unspecified bytes. */
int sgm__disk_read(sgm_disk *d, const sgm_disk_extent *e, void *dst);
/* Return extent e's space to the budget at once. Its blocks stay in the file
 * for the next write of the same size while the kept ranges hold under a
 * quarter of the limit (and 1 GiB): that write overwrites them, with no
 * block allocation, and no hole is punched now; otherwise (or with reserve)
 * they go back to the file system (hole punched where supported) before the
 * range is free. sgm__disk_trim and a carve that finds no room punch every
 * kept range. A zeroed extent
 * (bytes 0, as a failed write leaves it) is a no-op; one that is not live is
 * a caller bug: asserted when SGM_DEBUG >= 1, else ignored. */
void sgm__disk_free(sgm_disk *d, const sgm_disk_extent *e);
/* Give the blocks of every kept range back to the file system (holes
 * punched); returns their bytes. For sgm_trim. */
uint64_t sgm__disk_trim(sgm_disk *d);
/* How many extents were carved, read or freed so far (a counter that only
 * grows): the idle trim returns the kept blocks once it stops moving. */
uint64_t sgm__disk_activity(const sgm_disk *d);

/* Staging for transfers between the spill file and device memory: pieces of
 * SGM_DISK_BOUNCE_BYTES, page-aligned, kept by the tier (no malloc per
 * transfer). lend_bounce gives the tier one pinned region of
 * SGM_DISK_STAGE_BYTES = SGM_DISK_STAGE_SLOTS pieces (the caller allocated it
 * through its backend, keeps ownership and frees it after sgm__disk_close);
 * the staged transfers below take the whole region, stage_get its first piece,
 * when it is free, else cached unpinned pieces (NULL when out of memory);
 * stage_put takes either back. */
#define SGM_DISK_BOUNCE_BYTES (UINT64_C(4) << 20)
#define SGM_DISK_STAGE_SLOTS 4
#define SGM_DISK_STAGE_BYTES (SGM_DISK_STAGE_SLOTS * SGM_DISK_BOUNCE_BYTES)
void sgm__disk_lend_bounce(sgm_disk *d, void *pinned);
/* Take the lent pinned buffer back if no transfer holds it (then the tier
 * stages through its own buffers); returns it, or NULL. */
void *sgm__disk_take_back_bounce(sgm_disk *d);
void *sgm__disk_stage_get(sgm_disk *d);
void sgm__disk_stage_put(sgm_disk *d, void *p);

/* ---- staged transfers: device memory <-> the spill file in one hop ----
 *
 * Data that the host cannot address (VRAM) moves through the staging region
 * in pieces of `piece` bytes (<= SGM_DISK_BOUNCE_BYTES, a multiple of 4 KiB),
 * one extent per piece, pipelined: while the file I/O of piece k is in flight
 * (Linux AIO, DIRECT mode) the callback fills or drains piece k+1's staging
 * slot (a device copy), up to SGM_DISK_STAGE_SLOTS pieces at once. Every
 * extent is checksummed as sgm__disk_write's (hashed in the slot after the
 * fill; verified before the drain). Without AIO or in BUFFERED mode the
 * pieces move one after the other, equally correct.
 *
 * A callback returns SGM_OK or a status with its message set; it runs on the
 * calling thread with no disk-tier lock held (it may call the backend), and
 * must be finished with the slot when it returns (the copy is complete).
 */
typedef int (*sgm_disk_stage_fn)(void *user, uint64_t index, void *slot, uint64_t len);
/* Write `total` (> 0) bytes as ceil(total / piece) extents (out[i] for piece
 * i; the last piece is the remainder): fill(user, i, slot, len) puts piece
 * i's bytes in slot. The budget for every extent is carved before the first
 * fill (SGM_ERR_NOMEM naming SGM_SPILL_LIMIT when it does not fit); on any
 * failure (a fill's status, SGM_ERR_IO as sgm__disk_write's) every extent is
 * released, out[] is zeroed and nothing else changed: the source still holds
 * the data. */
int sgm__disk_write_staged(sgm_disk *d, uint64_t total, uint64_t piece, sgm_disk_stage_fn fill,
                           void *user, sgm_disk_extent *out);
/* Read `total` bytes back from the extents sgm__disk_write_staged made with
 * the same piece size, in order: drain(user, i, slot, len) gets piece i's
 * verified bytes; a piece whose extent has bytes 0 (never written) is drained
 * as zeros. Failures as sgm__disk_read's (SGM_ERR_CORRUPT, SGM_ERR_IO,
 * SGM_ERR_INVALID) or the drain's status; the extents stay allocated either
 * way, and pieces drained before the failure stay drained. */
int sgm__disk_read_staged(sgm_disk *d, uint64_t total, uint64_t piece, const sgm_disk_extent *ext,
                          sgm_disk_stage_fn drain, void *user);

/* budget_bytes = the resolved limit; committed_bytes = disk space the spill
 * file holds now (st_blocks); used_bytes / peak_used_bytes = live extents
 * (rounded to 4 KiB) plus reservations; n_live = live extents; bytes_in / bytes_out = data
 * written / read back successfully since open; cached_bytes = the kept ranges
 * of freed extents (in committed, not in used); n_evictions = 0. */
void sgm__disk_stats(sgm_disk *d, sgm_tier_stats *out);
/* The spill file's descriptor (tests reach the file through /proc/self/fd/N). */
int sgm__disk_fd(const sgm_disk *d);
/* The I/O mode in use (AUTO resolved). */
sgm_disk_io sgm__disk_io_mode(const sgm_disk *d);
/* "ext4 at /home" — the file system of the spill directory, for messages. */
const char *sgm__disk_fs_name(const sgm_disk *d);

/* The I/O engine: the system calls that move a transfer's data, behind a
 * small vtable so that tests install a spy (tests/support/disk_spy.c) that
 * fails, shortens or stalls them, and no fault injection lives in the
 * transfer loops. Each function behaves as its system call: -1 with errno
 * set on failure. begin (optional) is called once at the start of each
 * sgm__disk_write (writing) or sgm__disk_read, before any call of the
 * others; release (optional) when the engine is replaced or the tier closed. */
typedef struct sgm_disk_engine {
  const char *name;
  ssize_t (*pwrite)(void *user, int fd, const void *buf, size_t n, uint64_t off);
  ssize_t (*pread)(void *user, int fd, void *buf, size_t n, uint64_t off);
  long (*io_submit)(void *user, aio_context_t ctx, long nr, struct iocb **cbs);
  long (*io_getevents)(void *user, aio_context_t ctx, long min_nr, long nr, struct io_event *ev);
  void (*begin)(void *user, bool writing, uint64_t bytes);
  void (*release)(void *user);
} sgm_disk_engine;
/* The production engine: pwrite, pread, io_submit, io_getevents as they are. */
extern const sgm_disk_engine sgm__disk_kernel_engine;
/* Install e (NULL: the kernel's) with its argument; the previous engine's
 * release runs. No transfer may be in flight. */
void sgm__disk_set_engine(sgm_disk *d, const sgm_disk_engine *e, void *user);
/* The engine in use and its argument. */
const sgm_disk_engine *sgm__disk_get_engine(sgm_disk *d, void **user);

#endif /* SGM_DISK_H */
