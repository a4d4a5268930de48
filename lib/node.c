/*
 * node.c — the node registry: one small shared-memory table per device that
 * every sgm process on the machine joins, so that budgets can be shared and
 * sgm-smi can show who holds what (DESIGN.md §8 "Node registry").
 *
 * The segment is a file, <dir>/sgm-node-<key> (dir: SGM_NODE_DIR, else
 * /dev/shm; key: the device's, from the backend), mapped MAP_SHARED:
 *
 *   0     header: magic, version, sizes, slot count, device total, the node's
 *         shared-memory cap, a check word over those, the device key, its
 *         UUID and PCI bus id (version 2)
 *   256   the robust process-shared mutex (joins, leaves, reclaims, the
 *         emulated device's capacity)
 *   512   n_slots slots of 256 bytes: 32 words each (see NODE_W_*)
 *
 * Invariants:
 *  - A segment is visible under its name only fully initialised: the creator
 *    builds it in a temporary file and link()s it into place (link fails when
 *    another process won the race; the loser opens the winner's).
 *  - A slot's state changes (free <-> live) only under the mutex. The fields
 *    of a live slot are written by its owner alone, inside the slot's seqlock
 *    (an odd sequence means "being written"); readers copy the words and
 *    retry a bounded number of times, so they never block the writer and a
 *    writer that died mid-write cannot hang them.
 *  - Liveness is a lock the kernel drops when the owner dies: the owner holds
 *    an open-file-description lock (F_OFD_SETLK) on byte NODE_LOCK_BASE + slot
 *    of the segment file. A live slot whose byte nobody holds belongs to a
 *    dead process and is reclaimed (zeroed, its emulated-device bytes freed)
 *    by the next process that takes the mutex. Neither kill(pid, 0) nor the
 *    pid is trusted: the pid and its start time are shown, not believed.
 *  - The mutex is PTHREAD_MUTEX_ROBUST: a holder killed inside the critical
 *    section hands the next locker EOWNERDEAD; it repairs the table (every
 *    slot re-validated as above) and marks the mutex consistent. It is taken
 *    with a timeout, so a corrupt mutex word means "untracked", not a hang.
 *  - Everything read from the segment is untrusted: the header is checked
 *    (magic, version, sizes, check word, file size) before any slot is
 *    indexed, and every value taken from a slot is bounded by the reader.
 *    Any failure makes the process run untracked with one warning.
 *  - Private to its user: created 0600 (0660 with SGM_NODE_GROUP); opened
 *    with O_NOFOLLOW; a file that is not a regular file, is owned by another
 *    user (or, with group sharing, another group) or grants more than that
 *    is refused.
 *
 *  - One slot per process per device: contexts join as members
 *    (sgm__node_member_join); the members of one process on one segment
 *    share one sgm_node (one slot, one liveness lock), and the slot
 *    publishes the sum of their figures. The last member out leaves.
 *  - The key a process asked for is the header's (two keys may sanitise to
 *    one file name): another key is refused, the process runs untracked.
 *
 * Threading: an sgm_node is used by its members' threads: publish and the
 * emulated device's reservations take node->mu (the seqlock writer side),
 * the mutex is taken outside it; node_open_mu (the process's list of slots,
 * members joining and leaving) is taken outside both. Ranks, checked by the
 * witness: SGM_LOCK_NODE_OPEN < SGM_LOCK_NODE_TABLE (the segment's mutex,
 * witnessed by node_take/node_give) < SGM_LOCK_NODE. Readers
 * (sgm__node_parse) take no lock.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* "SGMNODE" + version byte 0 in little-endian memory. */
#define NODE_MAGIC UINT64_C(0x0045444f4e4d4753)
#define NODE_HEADER_BYTES 512u
#define NODE_MUTEX_OFFSET 256u
#define NODE_SLOT_BYTES 256u
#define NODE_SLOT_WORDS (NODE_SLOT_BYTES / 8u)
/* Liveness lock bytes lie far past the end of any segment: locks beyond EOF
 * are allowed and never collide with the data. */
#define NODE_LOCK_BASE (INT64_C(1) << 40)
/* A reader gives up on a slot whose sequence stays odd or keeps moving after
 * this many tries (its writer publishes a few hundred bytes: a live one is
 * done within a few tries; a dead one never will be). */
#define NODE_READ_TRIES 1000
/* The mutex is held for microseconds; a second means it is corrupt or its
 * holder is stuck, and the process goes on untracked rather than wait. */
#define NODE_MUTEX_TIMEOUT_MS 1000

/* Header words (byte offsets). */
#define NODE_H_MAGIC 0
#define NODE_H_VERSION 8      /* uint32 */
#define NODE_H_HEADER_BYTES 12 /* uint32 */
#define NODE_H_SLOT_BYTES 16  /* uint32 */
#define NODE_H_N_SLOTS 20     /* uint32 */
#define NODE_H_DEVICE_TOTAL 24
#define NODE_H_SHARED_CAP 32
#define NODE_H_CHECK 40
#define NODE_H_GENERATION 48
#define NODE_H_KEY 64         /* char[SGM_NODE_KEY_MAX] */
#define NODE_H_UUID 128       /* uint8[16]: the device's UUID (version 2) */
#define NODE_H_PCI 144        /* char[SGM_NODE_PCI_MAX]: its PCI bus id (version 2) */
#define NODE_H_END 176        /* the check word covers [0, CHECK) and [KEY, END) */

/* Slot words. */
enum {
  NODE_W_SEQ = 0,     /* seqlock sequence: odd while the owner writes */
  NODE_W_STATE = 1,   /* 0 free, 1 live (changed under the mutex) */
  NODE_W_PID = 2,     /* the owner's pid (shown, not trusted) */
  NODE_W_START = 3,   /* the owner's start time in clock ticks since boot */
  NODE_W_NAME = 4,    /* 4 words: the owner's short name, NUL-padded */
  NODE_W_FIELDS = 8,  /* SGM_NODE_N_FIELDS published words (sgm_node_usage order) */
};
#define NODE_STATE_LIVE 1u

_Static_assert(NODE_W_FIELDS + SGM_NODE_N_FIELDS <= NODE_SLOT_WORDS, "slot too small");
_Static_assert(NODE_H_KEY + SGM_NODE_KEY_MAX <= NODE_H_UUID && NODE_H_UUID + 16 <= NODE_H_PCI &&
               NODE_H_PCI + SGM_NODE_PCI_MAX <= NODE_H_END && NODE_H_END <= NODE_MUTEX_OFFSET,
               "header fields overlap");

struct sgm_node {
  int fd;                 /* the segment file, O_RDWR; holds our liveness lock */
  unsigned char *mem;     /* the mapping */
  size_t map_bytes;       /* its length */
  uint32_t n_slots;       /* validated slot count */
  uint32_t slot;          /* our slot index */
  char path[SGM_PATH_MAX]; /* the segment's path (messages, sgm-smi) */
  sgm_lock mu;            /* the seqlock writer side of our slot (rank SGM_LOCK_NODE); also
                             guards members' figures */
  int verbose;            /* log level */
  unsigned refs;          /* members sharing this slot (under node_open_mu) */
  sgm_node_member *members; /* this process's members on the slot (under node_open_mu and mu) */
  sgm_node *next_open;    /* the next slot this process holds (under node_open_mu) */
};

void (*sgm__node_test_hook)(const char *where);

/* The descriptors of this process's segments, for the fork child handler: a
 * child shares the parent's open file descriptions, and with them the
 * liveness locks; the child closes its copies at once, so that a parent that
 * dies while a child lives on is still seen dead. Lock-free: the handler runs
 * in a child that may have been forked in the middle of a join. */
#define NODE_MAX_OPEN 64
static int node_open_fds[NODE_MAX_OPEN];
static pthread_once_t node_fork_once = PTHREAD_ONCE_INIT;

/* The slots this process holds, one per segment, for sgm__node_member_join
 * (see "One slot per process" below). */
static sgm_lock node_open_mu = SGM_LOCK_INITIALIZER(SGM_LOCK_NODE_OPEN);
static sgm_node *node_open_list;

static void node_atfork_child(void) {
  for (int i = 0; i < NODE_MAX_OPEN; i++) {
    int fd = __atomic_exchange_n(&node_open_fds[i], 0, __ATOMIC_RELAXED);
    if (fd > 0) close(fd);
  }
  /* The parent's slots are not the child's: a context the child creates
   * joins afresh (the parent's entries leak in the child, as its contexts). */
  node_open_list = NULL;
  sgm__lock_init(&node_open_mu, SGM_LOCK_NODE_OPEN);
}

static void node_fork_register(void) { pthread_atfork(NULL, NULL, node_atfork_child); }

/* A segment's descriptor is never 0 (stdin is open), so 0 marks an empty entry. */
static void node_fd_track(int fd, bool add) {
  for (int i = 0; i < NODE_MAX_OPEN; i++) {
    int expect = add ? 0 : fd;
    if (__atomic_compare_exchange_n(&node_open_fds[i], &expect, add ? fd : 0, false,
                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED))
      return;
  }
}

/* ------------------------------------------------------------------------ */
/* Words in shared memory: every access is an atomic of its own, so that a
 * reader racing a writer (another process, or a thread of this one) is a
 * retry, never a torn value the compiler assumed stable. */

static uint64_t *node_word(unsigned char *mem, size_t off) { return (uint64_t *)(void *)(mem + off); }
/* Acquire loads and release stores, word by word, are the seqlock's order
 * without fences (which TSan cannot see): a release store keeps every store
 * before it (the odd sequence) before it, an acquire load keeps every load
 * after it (the second sequence read) after it. Plain moves on x86-64. */
static uint64_t node_load(const unsigned char *mem, size_t off) {
  return __atomic_load_n((const uint64_t *)(const void *)(mem + off), __ATOMIC_ACQUIRE);
}
static void node_store(unsigned char *mem, size_t off, uint64_t v) {
  __atomic_store_n(node_word(mem, off), v, __ATOMIC_RELEASE);
}
static uint32_t node_load32(const unsigned char *mem, size_t off) {
  return __atomic_load_n((const uint32_t *)(const void *)(mem + off), __ATOMIC_ACQUIRE);
}
static size_t node_slot_off(uint32_t slot, uint32_t w) {
  return NODE_HEADER_BYTES + (size_t)slot * NODE_SLOT_BYTES + (size_t)w * 8u;
}

/* FNV-1a over the header's fixed fields and key: catches a segment that was
 * overwritten or half-written (not an attacker: only its user can write it). */
static uint64_t node_header_check(const unsigned char *mem) {
  uint64_t h = UINT64_C(0xcbf29ce484222325);
  for (size_t i = 0; i < NODE_H_CHECK; i++) h = (h ^ mem[i]) * UINT64_C(0x100000001b3);
  for (size_t i = NODE_H_KEY; i < NODE_H_END; i++) h = (h ^ mem[i]) * UINT64_C(0x100000001b3);
  return h;
}

void sgm__node_header_seal(void *mem, size_t len) {
  if (len >= NODE_HEADER_BYTES) node_store(mem, NODE_H_CHECK, node_header_check(mem));
}

/* ------------------------------------------------------------------------ */
/* The reader: bounds-checked from the first byte (also the fuzz target's). */

/* Check the header against len: SGM_OK with *n_slots_out, or a status and why. */
static int node_check_header(const unsigned char *mem, size_t len, uint32_t *n_slots_out, char *why,
                             size_t why_len) {
  *n_slots_out = 0;
  if (why_len) why[0] = '\0';
  if (len < NODE_HEADER_BYTES) {
    snprintf(why, why_len, "truncated: %zu bytes, a segment has at least %u", len, NODE_HEADER_BYTES);
    return SGM_ERR_CORRUPT;
  }
  if (node_load(mem, NODE_H_MAGIC) != NODE_MAGIC) {
    snprintf(why, why_len, "not an sgm node segment (bad magic)");
    return SGM_ERR_CORRUPT;
  }
  uint32_t version = node_load32(mem, NODE_H_VERSION);
  if (version != SGM_NODE_VERSION) {
    snprintf(why, why_len, "version %u, this sgm reads version %u%s", version, SGM_NODE_VERSION,
             version > SGM_NODE_VERSION ? " (written by a newer sgm: upgrade this one)"
                                        : " (written by an older sgm: end its processes, or "
                                          "remove the file once none runs)");
    return SGM_ERR_UNSUPPORTED;
  }
  uint32_t hb = node_load32(mem, NODE_H_HEADER_BYTES), sb = node_load32(mem, NODE_H_SLOT_BYTES);
  uint32_t n = node_load32(mem, NODE_H_N_SLOTS);
  if (hb != NODE_HEADER_BYTES || sb != NODE_SLOT_BYTES || n == 0 || n > SGM_NODE_MAX_SLOTS) {
    snprintf(why, why_len, "bad geometry (header %u, slot %u bytes, %u slots)", hb, sb, n);
    return SGM_ERR_CORRUPT;
  }
  if (node_load(mem, NODE_H_CHECK) != node_header_check(mem)) {
    snprintf(why, why_len, "header check word does not match (corrupt)");
    return SGM_ERR_CORRUPT;
  }
  size_t need = NODE_HEADER_BYTES + (size_t)n * NODE_SLOT_BYTES;
  if (len < need) {
    snprintf(why, why_len, "truncated: %zu bytes, %u slots need %zu", len, n, need);
    return SGM_ERR_CORRUPT;
  }
  *n_slots_out = n;
  return SGM_OK;
}

int sgm__node_parse(const void *mem_in, size_t len, sgm_node_view *out, char *why, size_t why_len) {
  const unsigned char *mem = mem_in;
  memset(out, 0, offsetof(sgm_node_view, procs));
  uint32_t n = 0;
  int rc = node_check_header(mem, len, &n, why, why_len);
  if (rc != SGM_OK) return rc;
  out->version = SGM_NODE_VERSION;
  out->n_slots = n;
  out->device_total_bytes = node_load(mem, NODE_H_DEVICE_TOTAL);
  out->shared_cap_bytes = node_load(mem, NODE_H_SHARED_CAP);
  out->generation = node_load(mem, NODE_H_GENERATION);
  memcpy(out->key, mem + NODE_H_KEY, SGM_NODE_KEY_MAX);
  out->key[SGM_NODE_KEY_MAX - 1] = '\0';
  memcpy(out->uuid, mem + NODE_H_UUID, sizeof out->uuid);
  sgm__node_uuid_format(out->uuid, out->uuid_text, sizeof out->uuid_text);
  memcpy(out->pci_bus_id, mem + NODE_H_PCI, SGM_NODE_PCI_MAX);
  out->pci_bus_id[SGM_NODE_PCI_MAX - 1] = '\0';
  /* Shown in tables, labels and CSV: hex digits, ':' and '.' only. */
  for (char *c = out->pci_bus_id; *c; c++)
    if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f') || (*c >= 'A' && *c <= 'F') ||
          *c == ':' || *c == '.'))
      *c = '_';
  for (uint32_t s = 0; s < n; s++) {
    uint64_t w[NODE_SLOT_WORDS];
    bool stable = false;
    for (int tries = 0; tries < NODE_READ_TRIES && !stable; tries++) {
      uint64_t s1 = __atomic_load_n((const uint64_t *)(const void *)(mem + node_slot_off(s, NODE_W_SEQ)),
                                    __ATOMIC_ACQUIRE);
      if (s1 & 1u) continue;
      for (uint32_t i = 0; i < NODE_SLOT_WORDS; i++) w[i] = node_load(mem, node_slot_off(s, i));
      stable = node_load(mem, node_slot_off(s, NODE_W_SEQ)) == s1;
    }
    if (!stable) {
      out->n_unstable++;
      continue;
    }
    if (w[NODE_W_STATE] != NODE_STATE_LIVE) continue;
    sgm_node_proc *p = &out->procs[out->n_procs++];
    p->slot = s;
    p->pid = w[NODE_W_PID] <= (uint64_t)INT32_MAX ? (int)w[NODE_W_PID] : -1;
    p->start_ticks = w[NODE_W_START];
    memcpy(p->name, &w[NODE_W_NAME], SGM_NODE_NAME_MAX);
    p->name[SGM_NODE_NAME_MAX - 1] = '\0';
    /* Shown by sgm-smi in tables, CSV and JSON: printable, no comma or quote. */
    for (char *c = p->name; *c; c++)
      if (*c < 0x21 || *c > 0x7e || *c == ',' || *c == '"' || *c == '\\') *c = '_';
    memcpy(p->u.w, &w[NODE_W_FIELDS], sizeof p->u.w);
  }
  return SGM_OK;
}

/* ------------------------------------------------------------------------ */
/* Opening: the file, its owner and mode, the mapping. */

static int node_warned;

/* One warning per process: the program goes on untracked. */
static int node_untracked(int verbose, int rc, const char *fmt, ...) SGM_PRINTF(3, 4);
static int node_untracked(int verbose, int rc, const char *fmt, ...) {
  char msg[SGM_ERROR_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (!__atomic_exchange_n(&node_warned, 1, __ATOMIC_RELAXED))
    sgm__log(verbose, 1, "node registry: %s; this process runs untracked (budgets as if alone, "
             "invisible to sgm-smi)", msg);
  return sgm__error_set(rc, "node registry: %s", msg);
}

void sgm__node_reset_warning(void) { __atomic_store_n(&node_warned, 0, __ATOMIC_RELAXED); }

int sgm__node_path(const char *dir, const char *key, char *out, size_t len) {
  if (!dir || !*dir) dir = "/dev/shm";
  int n = snprintf(out, len, "%s/sgm-node-", dir);
  if (n < 0 || (size_t)n >= len) return sgm__error_set(SGM_ERR_INVALID, "SGM_NODE_DIR is too long");
  size_t k = (size_t)n;
  for (const char *c = key; *c && k + 1 < len && c - key < SGM_NODE_KEY_MAX - 1; c++)
    out[k++] = ((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
                *c == '.' || *c == '-' || *c == '_') ? *c : '_';
  out[k] = '\0';
  return SGM_OK;
}

/* Is the opened file ours to trust? A message into why when not. */
static bool node_file_ok(int fd, bool group, char *why, size_t len) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    snprintf(why, len, "fstat failed: %s", strerror(errno));
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    snprintf(why, len, "not a regular file");
    return false;
  }
  if (st.st_uid != geteuid() && !(group && st.st_gid == getegid())) {
    snprintf(why, len, "owned by uid %u, not by this user (uid %u)%s; refusing it",
             (unsigned)st.st_uid, (unsigned)geteuid(), group ? " nor this group" : "");
    return false;
  }
  mode_t allowed = group ? 0660 : 0600;
  if (st.st_mode & 07777 & ~allowed) {
    snprintf(why, len, "mode %04o grants more than %04o; refusing it (remove the file, or set "
             "SGM_NODE_GROUP to share with the group)", (unsigned)(st.st_mode & 07777),
             (unsigned)allowed);
    return false;
  }
  return true;
}

int sgm__node_map(const char *path, bool writable, bool group, int *fd_out, unsigned char **mem_out,
                  size_t *len_out, char *why, size_t why_len) {
  *fd_out = -1;
  *mem_out = NULL;
  *len_out = 0;
  int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    int e = errno;
    snprintf(why, why_len, "%.300s: %s", path, e == ELOOP ? "is a symbolic link; refusing it" : strerror(e));
    return e == ENOENT ? SGM_ERR_INVALID : SGM_ERR_IO;
  }
  if (!node_file_ok(fd, group, why, why_len)) {
    close(fd);
    return SGM_ERR_IO;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < (off_t)NODE_HEADER_BYTES ||
      st.st_size > (off_t)(NODE_HEADER_BYTES + (size_t)SGM_NODE_MAX_SLOTS * NODE_SLOT_BYTES)) {
    snprintf(why, why_len, "%.300s: size %lld is not a segment's", path, (long long)st.st_size);
    close(fd);
    return SGM_ERR_CORRUPT;
  }
  void *m = mmap(NULL, (size_t)st.st_size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                 fd, 0);
  if (m == MAP_FAILED) {
    snprintf(why, why_len, "%.300s: mmap failed: %s", path, strerror(errno));
    close(fd);
    return SGM_ERR_IO;
  }
  *fd_out = fd;
  *mem_out = m;
  *len_out = (size_t)st.st_size;
  return SGM_OK;
}

/* Build a segment in a temporary file next to path and link it into place.
 * SGM_OK when ours or another process's is there now. */
static int node_create(const sgm_node_params *p, const char *path, char *why, size_t why_len) {
  char tmp[SGM_PATH_MAX + 32];
  snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
  mode_t mode = p->group ? 0660 : 0600;
  int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) {
    snprintf(why, why_len, "cannot create %.300s: %s (check SGM_NODE_DIR)", tmp, strerror(errno));
    return SGM_ERR_IO;
  }
  int rc = SGM_ERR_IO;
  uint32_t n = p->n_slots ? p->n_slots : SGM_NODE_DEFAULT_SLOTS;
  size_t len = NODE_HEADER_BYTES + (size_t)n * NODE_SLOT_BYTES;
  unsigned char *mem = NULL;
  if (fchmod(fd, mode) != 0 || ftruncate(fd, (off_t)len) != 0) {
    snprintf(why, why_len, "cannot size %.300s: %s", tmp, strerror(errno));
    goto out_unlink;
  }
  mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mem == MAP_FAILED) {
    mem = NULL;
    snprintf(why, why_len, "cannot map %.300s: %s", tmp, strerror(errno));
    goto out_unlink;
  }
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  int e = pthread_mutex_init((pthread_mutex_t *)(void *)(mem + NODE_MUTEX_OFFSET), &a);
  pthread_mutexattr_destroy(&a);
  if (e != 0) {
    snprintf(why, why_len, "cannot make a process-shared robust mutex: %s", strerror(e));
    goto out_unlink;
  }
  uint32_t *h32 = (uint32_t *)(void *)mem;
  h32[NODE_H_VERSION / 4] = SGM_NODE_VERSION;
  h32[NODE_H_HEADER_BYTES / 4] = NODE_HEADER_BYTES;
  h32[NODE_H_SLOT_BYTES / 4] = NODE_SLOT_BYTES;
  h32[NODE_H_N_SLOTS / 4] = n;
  node_store(mem, NODE_H_DEVICE_TOTAL, p->device_total_bytes);
  node_store(mem, NODE_H_SHARED_CAP, p->shared_cap_bytes);
  snprintf((char *)mem + NODE_H_KEY, SGM_NODE_KEY_MAX, "%s", p->key);
  memcpy(mem + NODE_H_UUID, p->uuid, sizeof p->uuid);
  snprintf((char *)mem + NODE_H_PCI, SGM_NODE_PCI_MAX, "%s", p->pci_bus_id ? p->pci_bus_id : "");
  node_store(mem, NODE_H_MAGIC, NODE_MAGIC);
  node_store(mem, NODE_H_CHECK, node_header_check(mem));
  if (link(tmp, path) == 0 || errno == EEXIST) {
    rc = SGM_OK;
  } else {
    snprintf(why, why_len, "cannot link %.300s into place: %s", path, strerror(errno));
  }
out_unlink:
  if (mem) munmap(mem, len);
  unlink(tmp);
  close(fd);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* The mutex and liveness. */

static pthread_mutex_t *node_mutex(sgm_node *n) {
  return (pthread_mutex_t *)(void *)(n->mem + NODE_MUTEX_OFFSET);
}

bool sgm__node_slot_alive(int fd, uint32_t slot) {
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = NODE_LOCK_BASE + slot,
                     .l_len = 1, .l_pid = 0};
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return true; /* cannot tell: never reclaim on doubt */
  return fl.l_type != F_UNLCK;
}

static bool node_lock_slot(int fd, uint32_t slot, short type) {
  struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = NODE_LOCK_BASE + slot,
                     .l_len = 1, .l_pid = 0};
  return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}

/* Zero slot s (its owner is dead or leaving): a new even sequence last. */
static void node_clear_slot(sgm_node *n, uint32_t s) {
  uint64_t seq = node_load(n->mem, node_slot_off(s, NODE_W_SEQ));
  node_store(n->mem, node_slot_off(s, NODE_W_SEQ), (seq | 1u) + 0u);
  for (uint32_t i = 1; i < NODE_SLOT_WORDS; i++) node_store(n->mem, node_slot_off(s, i), 0);
  __atomic_store_n(node_word(n->mem, node_slot_off(s, NODE_W_SEQ)), (seq | 1u) + 1u, __ATOMIC_RELEASE);
}

/* Under the mutex: free every live slot whose owner's lock is gone, and any
 * slot in a state that is neither free nor live. Returns how many. */
static unsigned node_reclaim_locked(sgm_node *n) {
  unsigned freed = 0;
  for (uint32_t s = 0; s < n->n_slots; s++) {
    if (s == n->slot) continue;
    uint64_t st = node_load(n->mem, node_slot_off(s, NODE_W_STATE));
    uint64_t seq = node_load(n->mem, node_slot_off(s, NODE_W_SEQ));
    if (st == 0 && !(seq & 1u)) continue;
    if (st == NODE_STATE_LIVE && sgm__node_slot_alive(n->fd, s)) continue;
    node_clear_slot(n, s);
    freed++;
  }
  if (freed) __atomic_add_fetch(node_word(n->mem, NODE_H_GENERATION), 1, __ATOMIC_RELEASE);
  return freed;
}

/* Take the mutex (1 s at most); a dead holder's table is repaired first.
 * Witnessed (rank SGM_LOCK_NODE_TABLE) though no sgm_lock: it is shared with
 * other processes and robust. */
static int node_take(sgm_node *n) {
  sgm__lock_witness_enter(SGM_LOCK_NODE_TABLE);
  /* trylock first: uncontended is the common case, and a holder that died
   * before we came is reported there (sanitizers see EOWNERDEAD from
   * trylock and lock, not from timedlock). */
  int e = pthread_mutex_trylock(node_mutex(n));
  if (e == EBUSY) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += NODE_MUTEX_TIMEOUT_MS / 1000;
    e = pthread_mutex_timedlock(node_mutex(n), &until);
  }
  if (e == 0 || e == EOWNERDEAD) sgm__lock_witness_note(node_mutex(n), SGM_LOCK_NODE_TABLE);
  if (e == EOWNERDEAD) {
    /* The holder died inside the critical section: whatever it half did is
     * re-validated slot by slot (its own slot's lock died with it). */
    node_reclaim_locked(n);
    pthread_mutex_consistent(node_mutex(n));
    sgm__log(n->verbose, 2, "node registry %s: a process died holding its lock; table repaired",
             n->path);
    return SGM_OK;
  }
  if (e != 0)
    return sgm__error_set(SGM_ERR_BUSY, "node registry %s: its lock cannot be taken (%s)", n->path,
                          e == ETIMEDOUT ? "held for over a second: corrupt or stuck" : strerror(e));
  return SGM_OK;
}

static void node_give(sgm_node *n) {
  sgm__lock_witness_leave(node_mutex(n));
  pthread_mutex_unlock(node_mutex(n));
}

static void node_hook(const char *where) {
  void (*h)(const char *) = __atomic_load_n(&sgm__node_test_hook, __ATOMIC_ACQUIRE);
  if (h) h(where);
}

/* ------------------------------------------------------------------------ */
/* Identity of this process. */

static uint64_t node_start_ticks(void) {
  FILE *f = fopen("/proc/self/stat", "re");
  if (!f) return 0;
  char buf[1024];
  size_t r = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[r] = '\0';
  /* Field 22; the name (field 2) may hold spaces and ')', so count after the last ')'. */
  char *p = strrchr(buf, ')');
  if (!p) return 0;
  int field = 2;
  unsigned long long v = 0;
  for (char *c = p + 1; *c; c++) {
    if (*c == ' ' && ++field == 22) {
      v = strtoull(c + 1, NULL, 10);
      break;
    }
  }
  return v;
}

uint64_t sgm__node_start_ticks_of_self(void) { return node_start_ticks(); }

/* ------------------------------------------------------------------------ */
/* Join and leave. */

static void node_unmap(sgm_node *n) {
  if (n->mem) munmap(n->mem, n->map_bytes);
  n->mem = NULL;
  if (n->fd > 0) node_fd_track(n->fd, false);
  if (n->fd >= 0) close(n->fd); /* drops the liveness lock */
  n->fd = -1;
}

static void node_close(sgm_node *n) {
  node_unmap(n);
  sgm__lock_destroy(&n->mu);
  free(n);
}

/* Open n->path (creating the segment when there is none), map and validate it. */
static int node_open_file(sgm_node *n, const sgm_node_params *p, char *why, size_t why_len) {
  int rc = sgm__node_map(n->path, true, p->group, &n->fd, &n->mem, &n->map_bytes, why, why_len);
  if (rc == SGM_ERR_INVALID) { /* ENOENT: make it */
    rc = node_create(p, n->path, why, why_len);
    if (rc == SGM_OK) rc = sgm__node_map(n->path, true, p->group, &n->fd, &n->mem, &n->map_bytes, why, why_len);
  }
  if (rc != SGM_OK) return rc;
  if (n->fd > 0) node_fd_track(n->fd, true);
  rc = node_check_header(n->mem, n->map_bytes, &n->n_slots, why, why_len);
  if (rc != SGM_OK) return rc;
  /* Two keys may sanitise to one file name: the header says whose it is. */
  char key[SGM_NODE_KEY_MAX];
  memcpy(key, n->mem + NODE_H_KEY, sizeof key);
  key[sizeof key - 1] = '\0';
  if (strncmp(key, p->key, sizeof key - 1) != 0) {
    for (char *c = key; *c; c++)
      if (*c < 0x20 || *c > 0x7e) *c = '?';
    snprintf(why, why_len, "%.300s belongs to device %s, not to %.64s (their keys name one file; "
             "give one of them another SGM_NODE_DIR)", n->path, key, p->key);
    return SGM_ERR_CORRUPT;
  }
  return SGM_OK;
}

int sgm__node_join(const sgm_node_params *p, sgm_node **out) {
  *out = NULL;
  sgm_node *n = calloc(1, sizeof *n);
  if (!n) return node_untracked(p->verbose, SGM_ERR_NOMEM, "out of host memory");
  n->fd = -1;
  n->verbose = p->verbose;
  sgm__lock_init(&n->mu, SGM_LOCK_NODE);
  char why[SGM_ERROR_MAX];
  int rc = sgm__node_path(p->dir, p->key, n->path, sizeof n->path);
  if (rc != SGM_OK) goto out_untracked_msg;
  pthread_once(&node_fork_once, node_fork_register);
  uint64_t start_ticks = node_start_ticks();
  for (int attempt = 0;; attempt++) {
    rc = node_open_file(n, p, why, sizeof why);
    if (rc != SGM_OK) goto out_untracked;
    rc = node_take(n);
    if (rc != SGM_OK) {
      snprintf(why, sizeof why, "%s", sgm_last_error());
      goto out_untracked;
    }
    struct stat st;
    if (fstat(n->fd, &st) == 0 && st.st_nlink > 0) break;
    /* The last process left and removed the file between our open and our
     * lock: this one is an orphan; open the name again. */
    node_give(n);
    node_unmap(n);
    if (attempt == 3) {
      snprintf(why, sizeof why, "%.300s keeps being removed while joining", n->path);
      rc = SGM_ERR_BUSY;
      goto out_untracked;
    }
  }
  n->slot = UINT32_MAX;
  node_hook("join-locked");
  node_reclaim_locked(n);
  for (uint32_t s = 0; s < n->n_slots && n->slot == UINT32_MAX; s++) {
    if (node_load(n->mem, node_slot_off(s, NODE_W_STATE)) != 0) continue;
    /* A free slot whose byte is still locked belongs to a process between
     * its unlock and its exit, or to a foreign hand: leave it alone. */
    if (!node_lock_slot(n->fd, s, F_WRLCK)) continue;
    n->slot = s;
  }
  if (n->slot == UINT32_MAX) {
    node_give(n);
    snprintf(why, sizeof why, "all %u slots of %.300s are taken (end a process, or "
             "use another SGM_NODE_DIR)", n->n_slots, n->path);
    rc = SGM_ERR_BUSY;
    goto out_untracked;
  }
  uint32_t s = n->slot;
  uint64_t seq = node_load(n->mem, node_slot_off(s, NODE_W_SEQ));
  node_store(n->mem, node_slot_off(s, NODE_W_SEQ), seq | 1u);
  for (uint32_t i = 1; i < NODE_SLOT_WORDS; i++) node_store(n->mem, node_slot_off(s, i), 0);
  node_store(n->mem, node_slot_off(s, NODE_W_PID), (uint64_t)getpid());
  node_store(n->mem, node_slot_off(s, NODE_W_START), start_ticks);
  uint64_t name[SGM_NODE_NAME_MAX / 8] = {0};
  snprintf((char *)name, sizeof name, "%s", p->name ? p->name : "");
  for (uint32_t i = 0; i < SGM_NODE_NAME_MAX / 8; i++)
    node_store(n->mem, node_slot_off(s, NODE_W_NAME + i), name[i]);
  node_hook("join-writing");
  node_store(n->mem, node_slot_off(s, NODE_W_STATE), NODE_STATE_LIVE);
  __atomic_store_n(node_word(n->mem, node_slot_off(s, NODE_W_SEQ)), (seq | 1u) + 1u, __ATOMIC_RELEASE);
  __atomic_add_fetch(node_word(n->mem, NODE_H_GENERATION), 1, __ATOMIC_RELEASE);
  node_give(n);
  *out = n;
  return SGM_OK;

out_untracked_msg:
  snprintf(why, sizeof why, "%s", sgm_last_error());
out_untracked:
  rc = node_untracked(p->verbose, rc, "%s", why);
  node_close(n);
  return rc;
}

void sgm__node_leave(sgm_node *n) {
  if (!n) return;
  if (node_take(n) == SGM_OK) {
    node_hook("leave-locked");
    node_clear_slot(n, n->slot);
    __atomic_add_fetch(node_word(n->mem, NODE_H_GENERATION), 1, __ATOMIC_RELEASE);
    node_lock_slot(n->fd, n->slot, F_UNLCK);
    n->slot = UINT32_MAX; /* reclaim looks at every slot now */
    node_reclaim_locked(n);
    bool anyone = false;
    for (uint32_t s = 0; s < n->n_slots && !anyone; s++)
      anyone = node_load(n->mem, node_slot_off(s, NODE_W_STATE)) != 0;
    /* The last one out removes the name (joiners check for that under the
     * mutex), unless the name already points to another file. */
    struct stat mine, named;
    if (!anyone && fstat(n->fd, &mine) == 0 && lstat(n->path, &named) == 0 &&
        mine.st_ino == named.st_ino && mine.st_dev == named.st_dev)
      unlink(n->path);
    node_give(n);
  }
  /* Without the mutex the slot stays; closing drops its lock, and the next
   * process that takes the mutex reclaims it. */
  node_close(n);
}

/* ------------------------------------------------------------------------ */
/* Publishing our figures, reading everyone's. */

/* Under n->mu: write u into our slot inside its seqlock. */
static void node_write_fields_locked(sgm_node *n, const sgm_node_usage *u) {
  size_t so = node_slot_off(n->slot, NODE_W_SEQ);
  uint64_t seq = node_load(n->mem, so);
  node_store(n->mem, so, seq + 1);
  for (uint32_t i = 0; i < SGM_NODE_N_FIELDS; i++) {
    if (i == SGM_NODE_F_EMU_DEVICE) continue; /* under the mutex only */
    node_store(n->mem, node_slot_off(n->slot, NODE_W_FIELDS + i), u->w[i]);
  }
  __atomic_store_n(node_word(n->mem, so), seq + 2, __ATOMIC_RELEASE);
}

void sgm__node_publish(sgm_node *n, const sgm_node_usage *u) {
  sgm__lock_take(&n->mu);
  node_write_fields_locked(n, u);
  sgm__lock_drop(&n->mu);
}

int sgm__node_view(sgm_node *n, sgm_node_view *out) {
  char why[SGM_ERROR_MAX];
  int rc = sgm__node_parse(n->mem, n->map_bytes, out, why, sizeof why);
  if (rc != SGM_OK) return sgm__error_set(rc, "node registry %s: %s", n->path, why);
  size_t k = 0;
  for (size_t i = 0; i < out->n_procs; i++) {
    if (out->procs[i].slot != n->slot && !sgm__node_slot_alive(n->fd, out->procs[i].slot)) continue;
    out->procs[i].self = out->procs[i].slot == n->slot;
    out->procs[k++] = out->procs[i];
  }
  out->n_procs = k;
  return SGM_OK;
}

unsigned sgm__node_reclaim(sgm_node *n) {
  /* Cheap test first: only take the mutex when a live slot's owner is gone. */
  bool dead = false;
  for (uint32_t s = 0; s < n->n_slots && !dead; s++)
    dead = s != n->slot && node_load(n->mem, node_slot_off(s, NODE_W_STATE)) == NODE_STATE_LIVE &&
           !sgm__node_slot_alive(n->fd, s);
  if (!dead || node_take(n) != SGM_OK) return 0;
  unsigned freed = node_reclaim_locked(n);
  node_give(n);
  return freed;
}

uint64_t sgm__node_device_total(const sgm_node *n) { return node_load(n->mem, NODE_H_DEVICE_TOTAL); }
uint64_t sgm__node_shared_cap(const sgm_node *n) { return node_load(n->mem, NODE_H_SHARED_CAP); }
const char *sgm__node_file(const sgm_node *n) { return n->path; }
uint32_t sgm__node_slot(const sgm_node *n) { return n->slot; }

/* ------------------------------------------------------------------------ */
/* The emulated device's capacity, shared by every process that opens it. */

/* Under the mutex: bytes the other live processes hold on the device (dead
 * ones are reclaimed on the way, so their bytes come back). */
static uint64_t node_device_used_locked(sgm_node *n) {
  node_reclaim_locked(n);
  uint64_t sum = 0;
  for (uint32_t s = 0; s < n->n_slots; s++) {
    if (node_load(n->mem, node_slot_off(s, NODE_W_STATE)) != NODE_STATE_LIVE) continue;
    uint64_t b = node_load(n->mem, node_slot_off(s, NODE_W_FIELDS + SGM_NODE_F_EMU_DEVICE));
    sum = b > UINT64_MAX - sum ? UINT64_MAX : sum + b; /* untrusted: saturate */
  }
  return sum;
}

static void node_set_own_device(sgm_node *n, uint64_t bytes) {
  sgm__lock_take(&n->mu);
  size_t so = node_slot_off(n->slot, NODE_W_SEQ);
  uint64_t seq = node_load(n->mem, so);
  node_store(n->mem, so, seq + 1);
  node_store(n->mem, node_slot_off(n->slot, NODE_W_FIELDS + SGM_NODE_F_EMU_DEVICE), bytes);
  __atomic_store_n(node_word(n->mem, so), seq + 2, __ATOMIC_RELEASE);
  sgm__lock_drop(&n->mu);
}

int sgm__node_device_reserve(sgm_node *n, uint64_t bytes, uint64_t total, uint64_t *free_out) {
  *free_out = 0;
  int rc = node_take(n);
  if (rc != SGM_OK) return rc;
  uint64_t used = node_device_used_locked(n);
  uint64_t mine = node_load(n->mem, node_slot_off(n->slot, NODE_W_FIELDS + SGM_NODE_F_EMU_DEVICE));
  uint64_t free_now = used < total ? total - used : 0;
  bool fits = bytes <= free_now;
  if (fits) {
    node_hook("reserve-locked");
    node_set_own_device(n, mine + bytes);
    free_now -= bytes;
  }
  node_give(n);
  *free_out = free_now;
  return fits ? SGM_OK : SGM_ERR_NOMEM; /* no message: the caller words it */
}

void sgm__node_device_release(sgm_node *n, uint64_t bytes) {
  if (node_take(n) != SGM_OK) return; /* the bytes come back when this process exits */
  uint64_t mine = node_load(n->mem, node_slot_off(n->slot, NODE_W_FIELDS + SGM_NODE_F_EMU_DEVICE));
  node_set_own_device(n, mine > bytes ? mine - bytes : 0);
  node_give(n);
}

int sgm__node_device_used(sgm_node *n, uint64_t *used_out) {
  *used_out = 0;
  int rc = node_take(n);
  if (rc != SGM_OK) return rc;
  *used_out = node_device_used_locked(n);
  node_give(n);
  return SGM_OK;
}

/* ------------------------------------------------------------------------ */
/* The device's UUID as text, and the emulated device's UUID. */

void sgm__node_uuid_format(const uint8_t uuid[16], char *out, size_t len) {
  bool known = false;
  for (int i = 0; i < 16; i++) known |= uuid[i] != 0;
  if (!known) {
    if (len) out[0] = '\0';
    return;
  }
  snprintf(out, len, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
           uuid[0], uuid[1], uuid[2], uuid[3], uuid[4], uuid[5], uuid[6], uuid[7], uuid[8], uuid[9],
           uuid[10], uuid[11], uuid[12], uuid[13], uuid[14], uuid[15]);
}

void sgm__node_uuid_derive(const char *name, uint8_t out[16]) {
  /* Two FNV-1a hashes of the name with different offsets: stable across
   * processes and builds (a name, not a secret). */
  uint64_t h[2] = {UINT64_C(0xcbf29ce484222325), UINT64_C(0x84222325cbf29ce4)};
  for (int k = 0; k < 2; k++)
    for (const char *c = name; *c; c++) h[k] = (h[k] ^ (unsigned char)*c) * UINT64_C(0x100000001b3);
  for (int i = 0; i < 16; i++) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
  out[6] = (uint8_t)((out[6] & 0x0f) | 0x80); /* version 8: custom */
  out[8] = (uint8_t)((out[8] & 0x3f) | 0x80); /* the RFC 9562 variant */
}

/* ------------------------------------------------------------------------ */
/* One slot per process per device: members.
 *
 * node_open_list holds the slots this process has joined through members,
 * at most one per segment path; node_open_mu guards that list, each slot's
 * refs and members list (taken before a slot's mu and its robust mutex,
 * never inside them). A member's figures are written under its slot's mu,
 * with the sum published in the same critical section, so the slot always
 * shows the sum of the members' latest figures. */

struct sgm_node_member {
  sgm_node *node;            /* the process's slot on the device */
  sgm_node_usage u;          /* this member's last figures (under node->mu) */
  sgm_node_member *next;     /* the slot's next member (under node_open_mu and node->mu) */
};

/* sum += u, field by field as sgm__node_usage_sum says. */
static void node_usage_add(sgm_node_usage *sum, const sgm_node_usage *u) {
  for (uint32_t f = 0; f < SGM_NODE_N_FIELDS; f++) {
    uint64_t v = u->w[f], *o = &sum->w[f];
    switch (f) {
      case SGM_NODE_F_WEIGHT:
      case SGM_NODE_F_HEARTBEAT:
        if (v > *o) *o = v; /* the process weighs as its heaviest member */
        break;
      case SGM_NODE_F_FLAGS: *o |= v; break;
      case SGM_NODE_F_EMU_DEVICE: break; /* the slot's own, under the mutex */
      default: *o = v > UINT64_MAX - *o ? UINT64_MAX : *o + v; break;
    }
  }
}

void sgm__node_usage_sum(const sgm_node_usage *u, size_t n, sgm_node_usage *out) {
  memset(out, 0, sizeof *out);
  for (size_t j = 0; j < n; j++) node_usage_add(out, &u[j]);
}

/* Under n->mu: publish the sum of the members' figures. */
static void node_publish_members_locked(sgm_node *n) {
  sgm_node_usage sum;
  memset(&sum, 0, sizeof sum);
  for (sgm_node_member *m = n->members; m; m = m->next) node_usage_add(&sum, &m->u);
  node_write_fields_locked(n, &sum);
}

int sgm__node_member_join(const sgm_node_params *p, sgm_node_member **out) {
  *out = NULL;
  char path[SGM_PATH_MAX];
  int rc = sgm__node_path(p->dir, p->key, path, sizeof path);
  if (rc != SGM_OK) return node_untracked(p->verbose, rc, "%s", sgm_last_error());
  sgm_node_member *m = calloc(1, sizeof *m);
  if (!m) return node_untracked(p->verbose, SGM_ERR_NOMEM, "out of host memory");
  pthread_once(&node_fork_once, node_fork_register);
  sgm__lock_take(&node_open_mu);
  sgm_node *n = node_open_list;
  while (n && strcmp(n->path, path) != 0) n = n->next_open;
  if (!n) {
    rc = sgm__node_join(p, &n);
    if (rc != SGM_OK) {
      sgm__lock_drop(&node_open_mu);
      free(m);
      return rc;
    }
    n->next_open = node_open_list;
    node_open_list = n;
  }
  n->refs++;
  m->node = n;
  sgm__lock_take(&n->mu);
  m->next = n->members;
  n->members = m;
  sgm__lock_drop(&n->mu);
  sgm__lock_drop(&node_open_mu);
  *out = m;
  return SGM_OK;
}

void sgm__node_member_leave(sgm_node_member *m) {
  if (!m) return;
  sgm_node *n = m->node;
  sgm__lock_take(&node_open_mu);
  sgm__lock_take(&n->mu);
  for (sgm_node_member **pp = &n->members; *pp; pp = &(*pp)->next) {
    if (*pp == m) {
      *pp = m->next;
      break;
    }
  }
  if (n->members) node_publish_members_locked(n); /* the others' figures alone */
  sgm__lock_drop(&n->mu);
  bool last = --n->refs == 0;
  if (last) {
    for (sgm_node **pp = &node_open_list; *pp; pp = &(*pp)->next_open) {
      if (*pp == n) {
        *pp = n->next_open;
        break;
      }
    }
    sgm__node_leave(n);
  }
  sgm__lock_drop(&node_open_mu);
  free(m);
}

void sgm__node_member_publish(sgm_node_member *m, const sgm_node_usage *u) {
  sgm_node *n = m->node;
  sgm__lock_take(&n->mu);
  m->u = *u;
  node_publish_members_locked(n);
  sgm__lock_drop(&n->mu);
}

sgm_node *sgm__node_member_node(const sgm_node_member *m) { return m->node; }

size_t sgm__node_member_usages(sgm_node_member *m, const sgm_node_usage *mine, sgm_node_usage *out,
                               size_t max, size_t *self_out) {
  sgm_node *n = m->node;
  size_t k = 0;
  *self_out = 0;
  sgm__lock_take(&n->mu);
  for (sgm_node_member *o = n->members; o; o = o->next, k++) {
    if (o == m) *self_out = k;
    if (k < max) out[k] = o == m ? *mine : o->u;
  }
  sgm__lock_drop(&n->mu);
  return k;
}
