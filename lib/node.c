/*
 * node.c — the node registry: every sgm process on the machine publishes a
 * small record per device it uses, so that budgets can be shared and sgm-smi
 * can show who holds what (DESIGN.md §8 "Node registry"; docs/node.md).
 *
 * Design (layout 3, issue 28): one file per process per device, owned by
 * its writer, <dir>/sgm-node-<key>@<pid>-<nonce> (dir: the admin policy's,
 * else SGM_NODE_DIR, else /dev/shm), NODE_RECORD_BYTES long:
 *
 *   0     header: magic, version, size, device total, the node's shared cap,
 *         a check word, join time, PID namespace, device key, UUID, PCI id
 *   256   the process's slot: 64 words (see NODE_W_*), inside a seqlock
 *   768   its Kubernetes namespace, pod and container names (64 bytes each;
 *         from POD_NAMESPACE, POD_NAME, CONTAINER_NAME: sgm-smi's labels)
 *
 * Why: a registry shared by several users cannot be a file they all write.
 * Each process writes only its own record (mode 0600, or 0640 for the
 * node's group), so no other user can truncate, scribble on or lock what
 * another reads or writes; there is no lock shared across processes at all;
 * every process computes the same fair split from the records it reads.
 *
 * Invariants:
 *  - A record is visible under its name only fully written and locked: it is
 *    built as <name>.tmp (locked first, space allocated with
 *    posix_fallocate, so a full folder is ENOSPC here and never SIGBUS later)
 *    and renamed into place. A failure unlinks the .tmp: nothing is left.
 *  - Liveness is an open-file-description write lock (F_OFD_SETLK) on byte 0
 *    of the record, which the kernel drops when the owner dies. Readers test
 *    for a *write* lock (F_OFD_GETLK with F_RDLCK), which only the owner can
 *    take: a reader holding a read lock cannot keep a dead record alive.
 *  - The writer's mapping of its record is MADV_DONTFORK and its descriptor
 *    is closed in fork children: a child holds no reference to the open file
 *    description, so a parent that dies is dead at once, child or not.
 *  - Readers never map another process's record: they pread it into private
 *    memory (nobody can shrink it under them: no SIGBUS), opened with
 *    O_NOFOLLOW | O_NONBLOCK after an lstat says it is a regular file (a FIFO,
 *    device or link at a record's name is skipped, never opened), of exactly
 *    NODE_RECORD_BYTES, writable by its owner alone. Every byte is untrusted
 *    (sgm__node_record_parse, the fuzz target).
 *  - Who counts: a record owned by this user; with group sharing (the
 *    policy's group, or SGM_NODE_GROUP), one of that group readable by it;
 *    other users' records are never counted and make one warning that says
 *    what to do. One inode counts once (hard links).
 *  - Dead records (no lock) are skipped by every reader; their owner's uid
 *    unlinks them (the only one who can in a sticky folder).
 *  - The emulated shared device's capacity: announce, then check. A process
 *    adds its bytes to its own record, then sums everyone's; over the total,
 *    it withdraws and fails (or retries after a short random wait when the
 *    excess is another announcement in flight). Two racers may both
 *    withdraw; neither can overcommit.
 *
 * Threading: an sgm_node is used by its members' threads: publish, the
 * emulated device's reservations and leave take node->mu (the seqlock writer
 * side; held across folder scans, which take no other lock, and guarding
 * the scans' cache of open records);
 * node_open_mu (the process's list of records, members joining and leaving)
 * is taken outside it. Ranks, checked by the witness: SGM_LOCK_NODE_OPEN <
 * SGM_LOCK_NODE. Readers (sgm__node_scan, sgm__node_record_parse) take no lock.
 */
#include <dirent.h>
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

/* "SGMNODE" + version byte 0 in little-endian memory (the version word tells layouts apart). */
#define NODE_MAGIC UINT64_C(0x0045444f4e4d4753)
#define NODE_SLOT_BASE 256u
#define NODE_SLOT_WORDS 64u
/* A reader gives up on a record whose sequence stays odd or keeps moving
 * after this many tries (its writer publishes 256 bytes: a live one is done
 * within a few; a dead one never). */
#define NODE_READ_TRIES 64
/* Announce-then-check retries of the emulated device's reservations. */
#define NODE_RESERVE_TRIES 8

/* Header (byte offsets). */
#define NODE_H_MAGIC 0
#define NODE_H_VERSION 8       /* uint32 */
#define NODE_H_RECORD_BYTES 12 /* uint32 */
#define NODE_H_DEVICE_TOTAL 16
#define NODE_H_SHARED_CAP 24
#define NODE_H_CHECK 32
#define NODE_H_JOIN_NS 40      /* CLOCK_REALTIME ns at join: orders "the first" */
#define NODE_H_PID_NS 48       /* the writer's PID namespace inode (0: unknown) */
#define NODE_H_KEY 64          /* char[SGM_NODE_KEY_MAX] */
#define NODE_H_UUID 128        /* uint8[16] */
#define NODE_H_PCI 144         /* char[SGM_NODE_PCI_MAX] */
#define NODE_H_END 176         /* the check word covers [0, CHECK) and [JOIN_NS, END) */

/* Slot words (after NODE_SLOT_BASE). */
enum {
  NODE_W_SEQ = 0,     /* seqlock sequence: odd while the owner writes */
  NODE_W_STATE = 1,   /* 1 live; 0 leaving */
  NODE_W_PID = 2,     /* the owner's pid in its namespace (shown, not trusted) */
  NODE_W_START = 3,   /* the owner's start time in clock ticks since boot */
  NODE_W_NAME = 4,    /* 4 words: the owner's short name, NUL-padded */
  NODE_W_FIELDS = 8,  /* SGM_NODE_N_FIELDS published words (sgm_node_usage order) */
};
#define NODE_STATE_LIVE 1u

_Static_assert(NODE_W_FIELDS + SGM_NODE_N_FIELDS <= NODE_SLOT_WORDS, "slot too small");
#define NODE_K8S 768u /* 3 x SGM_NODE_K8S_MAX: namespace, pod, container */
_Static_assert(NODE_SLOT_BASE + NODE_SLOT_WORDS * 8u == NODE_K8S, "slot size");
_Static_assert(NODE_K8S + 3u * SGM_NODE_K8S_MAX <= SGM_NODE_RECORD_BYTES, "record size");
_Static_assert(NODE_H_KEY + SGM_NODE_KEY_MAX <= NODE_H_UUID && NODE_H_UUID + 16 <= NODE_H_PCI &&
               NODE_H_PCI + SGM_NODE_PCI_MAX <= NODE_H_END && NODE_H_END <= NODE_SLOT_BASE,
               "header fields overlap");

struct sgm_node {
  int fd;                   /* our record, O_RDWR; holds our liveness lock */
  unsigned char *mem;       /* its mapping (MADV_DONTFORK) */
  dev_t dev;                /* our record's identity (self in views) */
  ino_t ino;
  char path[SGM_PATH_MAX];  /* our record's path */
  char reg[SGM_PATH_MAX];   /* the registry's name, dir/sgm-node-<key> (members match it) */
  char dir[SGM_PATH_MAX];   /* the registry folder */
  char key[SGM_NODE_KEY_MAX]; /* the device key */
  sgm_node_accept acc;      /* whose records count */
  uint32_t n_slots;         /* the most processes that join */
  uint64_t device_total;    /* adopted at join: the first live process's */
  uint64_t shared_cap;
  bool saw_dead;            /* a scan met a dead record of ours to unlink (relaxed atomic) */
  sgm_node_peers *peers;    /* the records our scans keep open (under mu; NULL until the first) */
  sgm_lock mu;              /* the seqlock writer side of our slot (rank SGM_LOCK_NODE); also
                               guards members' figures */
  int verbose;              /* log level */
  unsigned refs;            /* members sharing this record (under node_open_mu) */
  sgm_node_member *members; /* this process's members (under node_open_mu and mu) */
  sgm_node *next_open;      /* the next record this process holds (under node_open_mu) */
};

void (*sgm__node_test_hook)(const char *where);

/* The descriptors of this process's records, for the fork child handler: a
 * child would share the parent's open file descriptions, and with them the
 * liveness locks; the child closes its copies at once (the mappings are
 * MADV_DONTFORK: the child has none), so a parent that dies while a child
 * lives on is dead at once. Lock-free: the handler runs in a child that may
 * have been forked in the middle of a join. */
#define NODE_MAX_OPEN 64
static int node_open_fds[NODE_MAX_OPEN];
static pthread_once_t node_fork_once = PTHREAD_ONCE_INIT;

static sgm_lock node_open_mu = SGM_LOCK_INITIALIZER(SGM_LOCK_NODE_OPEN);
static sgm_node *node_open_list;

static void node_atfork_child(void) {
  for (int i = 0; i < NODE_MAX_OPEN; i++) {
    int fd = __atomic_exchange_n(&node_open_fds[i], 0, __ATOMIC_RELAXED);
    if (fd > 0) close(fd);
  }
  /* The parent's records are not the child's: a context the child creates
   * joins afresh (the parent's entries leak in the child, as its contexts). */
  node_open_list = NULL;
  sgm__lock_init(&node_open_mu, SGM_LOCK_NODE_OPEN);
}

static void node_fork_register(void) { pthread_atfork(NULL, NULL, node_atfork_child); }

/* A record's descriptor is never 0 (stdin is open), so 0 marks an empty entry. */
static void node_fd_track(int fd, bool add) {
  for (int i = 0; i < NODE_MAX_OPEN; i++) {
    int expect = add ? 0 : fd;
    if (__atomic_compare_exchange_n(&node_open_fds[i], &expect, add ? fd : 0, false,
                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED))
      return;
  }
}

static void node_hook(const char *where) {
  void (*h)(const char *) = __atomic_load_n(&sgm__node_test_hook, __ATOMIC_ACQUIRE);
  if (h) h(where);
}

/* ------------------------------------------------------------------------ */
/* Words: our own mapping is written with atomics (readers in other
 * processes copy it with pread, inside the seqlock); records read from a
 * private copy are plain memory. */

static uint64_t *node_word(unsigned char *mem, size_t off) { return (uint64_t *)(void *)(mem + off); }
static uint64_t node_load(const unsigned char *mem, size_t off) {
  return __atomic_load_n((const uint64_t *)(const void *)(mem + off), __ATOMIC_ACQUIRE);
}
static void node_store(unsigned char *mem, size_t off, uint64_t v) {
  __atomic_store_n(node_word(mem, off), v, __ATOMIC_RELEASE);
}
static uint64_t node_get64(const unsigned char *b, size_t off) {
  uint64_t v;
  memcpy(&v, b + off, 8);
  return v;
}
static uint32_t node_get32(const unsigned char *b, size_t off) {
  uint32_t v;
  memcpy(&v, b + off, 4);
  return v;
}
static size_t node_w(uint32_t w) { return NODE_SLOT_BASE + (size_t)w * 8u; }

/* FNV-1a over the header: catches a record that was overwritten or cut (not
 * an attacker, who owns only the records they wrote). */
static uint64_t node_header_check(const unsigned char *b) {
  uint64_t h = UINT64_C(0xcbf29ce484222325);
  for (size_t i = 0; i < NODE_H_CHECK; i++) h = (h ^ b[i]) * UINT64_C(0x100000001b3);
  for (size_t i = NODE_H_JOIN_NS; i < NODE_H_END; i++) h = (h ^ b[i]) * UINT64_C(0x100000001b3);
  return h;
}

void sgm__node_record_seal(void *buf, size_t len) {
  if (len >= SGM_NODE_RECORD_BYTES) {
    uint64_t c = node_header_check(buf);
    memcpy((unsigned char *)buf + NODE_H_CHECK, &c, 8);
  }
}

/* Printable for tables, CSV, JSON and terminals: no control bytes, no
 * non-ASCII, no space, comma, quote or backslash. */
static void node_clean(char *s) {
  for (unsigned char *c = (unsigned char *)s; *c; c++)
    if (*c < 0x21 || *c > 0x7e || *c == ',' || *c == '"' || *c == '\\' || *c == '\'') *c = '_';
}

/* ------------------------------------------------------------------------ */
/* The reader: bounds-checked from the first byte (also the fuzz target's). */

int sgm__node_record_parse(const void *buf_in, size_t len, sgm_node_proc *p, sgm_node_devinfo *d,
                           char *why, size_t why_len) {
  const unsigned char *b = buf_in;
  memset(p, 0, sizeof *p);
  memset(d, 0, sizeof *d);
  if (why_len) why[0] = '\0';
  if (len != SGM_NODE_RECORD_BYTES) {
    snprintf(why, why_len, "%zu bytes, a record has %u", len, SGM_NODE_RECORD_BYTES);
    return SGM_ERR_CORRUPT;
  }
  if (node_get64(b, NODE_H_MAGIC) != NODE_MAGIC) {
    snprintf(why, why_len, "not an sgm node record (bad magic)");
    return SGM_ERR_CORRUPT;
  }
  uint32_t version = node_get32(b, NODE_H_VERSION);
  if (version != SGM_NODE_VERSION) {
    snprintf(why, why_len, "version %u, this sgm reads version %u%s", version, SGM_NODE_VERSION,
             version > SGM_NODE_VERSION ? " (written by a newer sgm: upgrade this one)"
                                        : " (written by an older sgm: end its processes, or "
                                          "remove the file once none runs)");
    return SGM_ERR_UNSUPPORTED;
  }
  if (node_get32(b, NODE_H_RECORD_BYTES) != SGM_NODE_RECORD_BYTES) {
    snprintf(why, why_len, "bad geometry (record of %u bytes)", node_get32(b, NODE_H_RECORD_BYTES));
    return SGM_ERR_CORRUPT;
  }
  if (node_get64(b, NODE_H_CHECK) != node_header_check(b)) {
    snprintf(why, why_len, "header check word does not match (corrupt)");
    return SGM_ERR_CORRUPT;
  }
  d->device_total_bytes = node_get64(b, NODE_H_DEVICE_TOTAL);
  d->shared_cap_bytes = node_get64(b, NODE_H_SHARED_CAP);
  d->join_ns = node_get64(b, NODE_H_JOIN_NS);
  memcpy(d->key, b + NODE_H_KEY, SGM_NODE_KEY_MAX);
  d->key[SGM_NODE_KEY_MAX - 1] = '\0';
  memcpy(d->uuid, b + NODE_H_UUID, sizeof d->uuid);
  sgm__node_uuid_format(d->uuid, d->uuid_text, sizeof d->uuid_text);
  memcpy(d->pci_bus_id, b + NODE_H_PCI, SGM_NODE_PCI_MAX);
  d->pci_bus_id[SGM_NODE_PCI_MAX - 1] = '\0';
  for (char *c = d->pci_bus_id; *c; c++) /* hex digits, ':' and '.' only */
    if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f') || (*c >= 'A' && *c <= 'F') ||
          *c == ':' || *c == '.'))
      *c = '_';
  if (node_get64(b, node_w(NODE_W_SEQ)) & 1u) {
    snprintf(why, why_len, "being written (odd sequence)");
    return SGM_ERR_BUSY;
  }
  if (node_get64(b, node_w(NODE_W_STATE)) != NODE_STATE_LIVE) {
    snprintf(why, why_len, "its process is leaving");
    return SGM_ERR_BUSY;
  }
  uint64_t pid = node_get64(b, node_w(NODE_W_PID));
  p->pid = pid <= (uint64_t)INT32_MAX ? (int)pid : -1;
  p->start_ticks = node_get64(b, node_w(NODE_W_START));
  p->pid_ns = node_get64(b, NODE_H_PID_NS);
  p->join_ns = d->join_ns;
  memcpy(p->name, b + node_w(NODE_W_NAME), SGM_NODE_NAME_MAX);
  p->name[SGM_NODE_NAME_MAX - 1] = '\0';
  node_clean(p->name);
  memcpy(p->u.w, b + node_w(NODE_W_FIELDS), sizeof p->u.w);
  char *k8s[3] = {p->k8s_namespace, p->k8s_pod, p->k8s_container};
  for (int i = 0; i < 3; i++) { /* label values: a DNS name's alphabet only */
    memcpy(k8s[i], b + NODE_K8S + (size_t)i * SGM_NODE_K8S_MAX, SGM_NODE_K8S_MAX);
    k8s[i][SGM_NODE_K8S_MAX - 1] = '\0';
    for (char *c = k8s[i]; *c; c++)
      if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
            *c == '.' || *c == '-' || *c == '_'))
        *c = '_';
  }
  return SGM_OK;
}

bool sgm__node_record_alive(int fd) {
  /* A read lock conflicts only with a write lock, which only a writer (the
   * owner: the record is writable by it alone) can hold. */
  struct flock fl = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1, .l_pid = 0};
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return true; /* cannot tell: never call it dead on doubt */
  return fl.l_type == F_WRLCK;
}

/* Is gid one of this process's groups? */
static bool node_in_group(gid_t gid) {
  if (gid == getegid()) return true;
  gid_t g[256];
  int n = getgroups(256, g);
  for (int i = 0; i < n; i++)
    if (g[i] == gid) return true;
  return false;
}

/* Does a record with this owner and mode count for acc? */
static bool node_accepts(const sgm_node_accept *acc, const struct stat *st) {
  if (acc->all_users || st->st_uid == geteuid()) return true;
  if (!acc->group || !(st->st_mode & S_IRGRP)) return false;
  return acc->gid >= 0 ? st->st_gid == (gid_t)acc->gid : node_in_group(st->st_gid);
}

/* Read one record name of dirfd: its owner, liveness and a consistent copy.
 * NODE_SCAN_* says what it was. */
enum { NODE_SCAN_OK, NODE_SCAN_DEAD, NODE_SCAN_FOREIGN, NODE_SCAN_REFUSED, NODE_SCAN_UNSTABLE };

/* Open a record name for reading: NODE_SCAN_OK with *fd_out and *st_out, or
 * why not (nothing left open). */
static int node_record_open(int dirfd, const char *name, const sgm_node_accept *acc, int *fd_out,
                            struct stat *st_out) {
  *fd_out = -1;
  struct stat st;
  /* lstat first: a FIFO, a device or a link at a record's name is never opened. */
  if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
      st.st_size != SGM_NODE_RECORD_BYTES || (st.st_mode & (S_IWGRP | S_IWOTH)))
    return NODE_SCAN_REFUSED;
  if (!node_accepts(acc, &st)) return NODE_SCAN_FOREIGN;
  int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return errno == EACCES ? NODE_SCAN_FOREIGN : NODE_SCAN_REFUSED;
  struct stat st2;
  if (fstat(fd, &st2) != 0 || st2.st_ino != st.st_ino || st2.st_dev != st.st_dev ||
      !S_ISREG(st2.st_mode) || st2.st_size != SGM_NODE_RECORD_BYTES ||
      (st2.st_mode & (S_IWGRP | S_IWOTH)) || !node_accepts(acc, &st2)) {
    close(fd);
    return NODE_SCAN_REFUSED;
  }
  *fd_out = fd;
  *st_out = st2;
  return NODE_SCAN_OK;
}

/* A consistent copy of an open record (pread, the sequence read again
 * after it), parsed, and its liveness. With prev_seq (a cached record), a
 * sequence that moved since the last scan means its writer published within
 * a period: alive without asking the kernel; an unmoved one is asked (a dead
 * writer's never moves). *seq_out: the sequence read. */
static int node_record_read(int fd, uint32_t uid, uint64_t ino, const uint64_t *prev_seq, sgm_node_proc *p,
                            sgm_node_devinfo *d, uint64_t *seq_out) {
  unsigned char buf[SGM_NODE_RECORD_BYTES];
  char why[128];
  for (int tries = 0; tries < NODE_READ_TRIES; tries++) {
    uint64_t seq2;
    if (pread(fd, buf, sizeof buf, 0) != (ssize_t)sizeof buf) return NODE_SCAN_REFUSED; /* cut short */
    if (pread(fd, &seq2, 8, node_w(NODE_W_SEQ)) != 8) return NODE_SCAN_REFUSED;
    if (seq2 != node_get64(buf, node_w(NODE_W_SEQ))) continue; /* moved while we read */
    int prc = sgm__node_record_parse(buf, sizeof buf, p, d, why, sizeof why);
    if (prc == SGM_ERR_BUSY && (seq2 & 1u)) continue; /* mid-write */
    if (prc != SGM_OK) return NODE_SCAN_REFUSED;
    *seq_out = seq2;
    bool alive = (prev_seq && *prev_seq != seq2) || sgm__node_record_alive(fd);
    p->alive = alive;
    p->uid = uid;
    p->ino = ino;
    return alive ? NODE_SCAN_OK : NODE_SCAN_DEAD;
  }
  return NODE_SCAN_UNSTABLE;
}

/* The records a writer's scans keep open between ticks (its view every
 * period): a cached record costs two preads (and a lock query only when its
 * sequence did not move), not seven calls. Keyed by the directory entry's
 * inode; entries not met in a scan are closed. Bounded, so that descriptors
 * stay few; past the bound records are read the uncached way. */
#define NODE_MAX_PEERS 256
typedef struct node_peer {
  uint64_t ino;
  int fd;
  uint32_t uid;
  uint64_t seq;
  bool seen;
} node_peer;
struct sgm_node_peers {
  size_t n;
  node_peer e[NODE_MAX_PEERS];
};

static void node_peers_close(sgm_node_peers *c) {
  if (!c) return;
  for (size_t i = 0; i < c->n; i++) close(c->e[i].fd);
  c->n = 0;
}

int sgm__node_scan(const char *dir, const char *prefix, const char *key, const sgm_node_accept *acc,
                   bool dead_too, sgm_node_view *out) {
  return sgm__node_scan_cached(dir, prefix, key, acc, dead_too, NULL, out);
}

int sgm__node_prefix(const char *key, char *out, size_t len) {
  int n = snprintf(out, len, "sgm-node-");
  if (n < 0 || (size_t)n >= len) return sgm__error_set(SGM_ERR_INVALID, "node registry: no room for a name");
  size_t k = (size_t)n;
  for (const char *c = key; *c && k + 2 < len && c - key < SGM_NODE_KEY_MAX - 1; c++)
    out[k++] = ((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
                *c == '.' || *c == '-' || *c == '_') ? *c : '_';
  out[k++] = '@';
  out[k] = '\0';
  return SGM_OK;
}

int sgm__node_path(const char *dir, const char *key, char *out, size_t len) {
  if (!dir || !*dir) dir = "/dev/shm";
  char prefix[SGM_NODE_KEY_MAX + 16];
  sgm__node_prefix(key, prefix, sizeof prefix);
  prefix[strlen(prefix) - 1] = '\0'; /* the registry's name: the records' prefix without '@' */
  int n = snprintf(out, len, "%s/%s", dir, prefix);
  if (n < 0 || (size_t)n >= len) return sgm__error_set(SGM_ERR_INVALID, "SGM_NODE_DIR is too long");
  return SGM_OK;
}

static int node_proc_cmp(const void *a, const void *b) {
  const sgm_node_proc *x = a, *y = b;
  if (x->join_ns != y->join_ns) return x->join_ns < y->join_ns ? -1 : 1;
  return x->ino < y->ino ? -1 : x->ino > y->ino;
}

int sgm__node_scan_cached(const char *dir, const char *prefix, const char *key, const sgm_node_accept *acc,
                          bool dead_too, sgm_node_peers *cache, sgm_node_view *out) {
  memset(out, 0, offsetof(sgm_node_view, procs));
  out->version = SGM_NODE_VERSION;
  out->n_slots = SGM_NODE_DEFAULT_SLOTS;
  DIR *dp = opendir(dir);
  if (!dp) {
    int e = errno;
    return sgm__error_set(e == ENOENT || e == ENOTDIR ? SGM_ERR_INVALID : SGM_ERR_IO,
                          "node registry folder %.300s: %s", dir, strerror(e));
  }
  size_t pl = strlen(prefix);
  uint64_t first_join = UINT64_MAX, gen = UINT64_C(0xcbf29ce484222325);
  struct dirent *e;
  while ((e = readdir(dp)) != NULL) {
    size_t l = strlen(e->d_name);
    if (l <= pl || strncmp(e->d_name, prefix, pl) != 0) continue;
    if (l > 4 && strcmp(e->d_name + l - 4, ".tmp") == 0) continue; /* being created */
    sgm_node_proc p;
    sgm_node_devinfo d;
    struct stat st;
    node_peer *peer = NULL;
    for (size_t i = 0; cache && i < cache->n && !peer; i++)
      if (cache->e[i].ino == (uint64_t)e->d_ino && !cache->e[i].seen) peer = &cache->e[i];
    int fd = -1, r;
    uint64_t seq = 0;
    if (peer) {
      fd = peer->fd;
      st.st_uid = peer->uid;
      st.st_ino = (ino_t)peer->ino;
      r = node_record_read(fd, peer->uid, peer->ino, &peer->seq, &p, &d, &seq);
      peer->seen = true;
      if (r == NODE_SCAN_REFUSED) { /* cut short or rewritten: read it afresh next time */
        close(fd);
        *peer = cache->e[--cache->n];
        peer = NULL;
      } else {
        peer->seq = seq;
      }
    } else {
      r = node_record_open(dirfd(dp), e->d_name, acc, &fd, &st);
      if (r == NODE_SCAN_OK) {
        r = node_record_read(fd, (uint32_t)st.st_uid, (uint64_t)st.st_ino, NULL, &p, &d, &seq);
        if (cache && r != NODE_SCAN_REFUSED && cache->n < NODE_MAX_PEERS)
          cache->e[cache->n++] = (node_peer){.ino = (uint64_t)st.st_ino, .fd = fd, .uid = (uint32_t)st.st_uid,
                                             .seq = seq, .seen = true};
        else
          close(fd);
      }
    }
    if (r == NODE_SCAN_FOREIGN) {
      out->n_foreign++;
      if (out->foreign_uid == 0) {
        struct stat fst;
        if (fstatat(dirfd(dp), e->d_name, &fst, AT_SYMLINK_NOFOLLOW) == 0) out->foreign_uid = fst.st_uid;
      }
      continue;
    }
    if (r == NODE_SCAN_UNSTABLE) out->n_unstable++;
    if (r == NODE_SCAN_REFUSED || r == NODE_SCAN_UNSTABLE) {
      out->n_refused++;
      continue;
    }
    char kp[SGM_NODE_KEY_MAX + 16];
    if (!key) sgm__node_prefix(d.key, kp, sizeof kp); /* readers: the record's key must give its name */
    if (key ? strcmp(d.key, key) != 0 : strcmp(kp, prefix) != 0) { /* two keys sanitised to one name */
      out->n_refused++;
      continue;
    }
    if (r == NODE_SCAN_DEAD) {
      if (st.st_uid == geteuid()) out->n_dead_own++;
      if (!dead_too) continue;
    }
    bool dup = false; /* one inode counts once (a hard link is not a second process) */
    for (size_t i = 0; i < out->n_procs && !dup; i++) dup = out->procs[i].ino == p.ino;
    if (dup) continue;
    if (out->n_procs == SGM_NODE_MAX_SLOTS) {
      out->n_more++;
      continue;
    }
    p.slot = (uint32_t)p.ino;
    out->procs[out->n_procs++] = p;
    if (p.alive && d.join_ns < first_join) {
      first_join = d.join_ns;
      out->device_total_bytes = d.device_total_bytes;
      out->shared_cap_bytes = d.shared_cap_bytes;
      memcpy(out->key, d.key, sizeof out->key);
      memcpy(out->uuid, d.uuid, sizeof out->uuid);
      memcpy(out->uuid_text, d.uuid_text, sizeof out->uuid_text);
      memcpy(out->pci_bus_id, d.pci_bus_id, sizeof out->pci_bus_id);
    }
  }
  closedir(dp);
  if (cache) { /* records gone from the folder are closed */
    for (size_t i = 0; i < cache->n;) {
      if (cache->e[i].seen) {
        cache->e[i++].seen = false;
        continue;
      }
      close(cache->e[i].fd);
      cache->e[i] = cache->e[--cache->n];
    }
  }
  qsort(out->procs, out->n_procs, sizeof out->procs[0], node_proc_cmp);
  for (size_t i = 0; i < out->n_procs; i++) {
    const sgm_node_proc *p = &out->procs[i];
    if (!p->alive) continue;
    for (int k = 0; k < 8; k++) gen = (gen ^ ((p->ino >> (8 * k)) & 0xff)) * UINT64_C(0x100000001b3);
  }
  out->generation = gen;
  return SGM_OK;
}

/* ------------------------------------------------------------------------ */
/* Opening: the folder, our record. */

static int node_warned, node_foreign_warned;

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

void sgm__node_reset_warning(void) {
  __atomic_store_n(&node_warned, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&node_foreign_warned, 0, __ATOMIC_RELAXED);
}

/* Other users' records are never counted: say so once, and what to do. */
static void node_warn_foreign(const sgm_node *n, const sgm_node_view *v) {
  if (!v->n_foreign || __atomic_exchange_n(&node_foreign_warned, 1, __ATOMIC_RELAXED)) return;
  sgm__log(n->verbose, 1, "node registry %s: %zu record(s) of other users (uid %u, ...) use device %s "
           "and are not counted: budgets are split among this user's processes only. To share the "
           "device fairly between users, the admin names a group in %s (docs/admin.md)",
           n->dir, v->n_foreign, (unsigned)v->foreign_uid, n->key, sgm__policy_path());
}

/* The folder must not let others remove or replace our record. */
static int node_check_dir(const char *dir, char *why, size_t why_len) {
  struct stat st;
  if (stat(dir, &st) != 0) {
    snprintf(why, why_len, "registry folder %.300s: %s (create it, or check SGM_NODE_DIR)", dir,
             strerror(errno));
    return SGM_ERR_IO;
  }
  if (!S_ISDIR(st.st_mode)) {
    snprintf(why, why_len, "registry folder %.300s is not a folder", dir);
    return SGM_ERR_IO;
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX)) {
    snprintf(why, why_len, "registry folder %.300s is writable by others without the sticky bit, so "
             "they could remove or replace this process's record (chmod +t it, as /dev/shm is)", dir);
    return SGM_ERR_IO;
  }
  return SGM_OK;
}

static uint64_t node_pid_ns(void) {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

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

static uint64_t node_nonce(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  static uint64_t counter;
  uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 17) ^
               __atomic_add_fetch(&counter, UINT64_C(0x9e3779b97f4a7c15), __ATOMIC_RELAXED);
  x ^= x >> 33;
  x *= UINT64_C(0xff51afd7ed558ccd);
  x ^= x >> 33;
  return x;
}

/* Create our record: <prefix><pid>-<nonce>.tmp, locked, space allocated,
 * written, mapped, renamed into place. On failure nothing is left. */
static int node_create(sgm_node *n, const sgm_node_params *p, const char *prefix, char *why,
                       size_t why_len) {
  char tmp[SGM_PATH_MAX + 8];
  int k = snprintf(n->path, sizeof n->path, "%s/%s%ld-%016llx", n->dir, prefix, (long)getpid(),
                   (unsigned long long)node_nonce());
  if (k < 0 || (size_t)k >= sizeof n->path - 8) {
    snprintf(why, why_len, "registry folder name %.300s is too long", n->dir);
    return SGM_ERR_INVALID;
  }
  snprintf(tmp, sizeof tmp, "%s.tmp", n->path);
  mode_t mode = n->acc.group ? 0640 : 0600;
  int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, mode);
  if (fd < 0) {
    snprintf(why, why_len, "cannot create %.300s: %s (check the registry folder, SGM_NODE_DIR)", tmp,
             strerror(errno));
    return SGM_ERR_IO;
  }
  int rc = SGM_ERR_IO;
  unsigned char *mem = MAP_FAILED;
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1, .l_pid = 0};
  if (fcntl(fd, F_OFD_SETLK, &fl) != 0) {
    snprintf(why, why_len, "cannot lock %.300s: %s", tmp, strerror(errno));
    goto fail;
  }
  /* The record's group: the policy's; else (SGM_NODE_GROUP) the folder's
   * when this process is in it (a shared supplementary group works without
   * a setgid folder); else the process's own. */
  int64_t gid = n->acc.group ? n->acc.gid : -1;
  struct stat dst;
  if (n->acc.group && gid < 0 && stat(n->dir, &dst) == 0 && dst.st_gid != getegid() && node_in_group(dst.st_gid))
    gid = dst.st_gid;
  if (fchmod(fd, mode) != 0 || (gid >= 0 && fchown(fd, (uid_t)-1, (gid_t)gid) != 0)) {
    snprintf(why, why_len, "cannot set the mode or group of %.300s: %s", tmp, strerror(errno));
    goto fail;
  }
  int e = posix_fallocate(fd, 0, SGM_NODE_RECORD_BYTES);
  if (e != 0 && e != EOPNOTSUPP && e != EINVAL) {
    snprintf(why, why_len, "cannot write a record in %.300s: %s%s", n->dir, strerror(e),
             e == ENOSPC ? " (the folder's filesystem is full: free space in it; a container's "
                           "/dev/shm is 64 MiB unless given more, e.g. docker run --shm-size=1g)"
                         : "");
    goto fail;
  }
  unsigned char b[SGM_NODE_RECORD_BYTES];
  memset(b, 0, sizeof b);
  uint64_t v64 = NODE_MAGIC;
  memcpy(b + NODE_H_MAGIC, &v64, 8);
  uint32_t v32 = SGM_NODE_VERSION;
  memcpy(b + NODE_H_VERSION, &v32, 4);
  v32 = SGM_NODE_RECORD_BYTES;
  memcpy(b + NODE_H_RECORD_BYTES, &v32, 4);
  memcpy(b + NODE_H_DEVICE_TOTAL, &n->device_total, 8);
  memcpy(b + NODE_H_SHARED_CAP, &n->shared_cap, 8);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  v64 = (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
  memcpy(b + NODE_H_JOIN_NS, &v64, 8);
  v64 = node_pid_ns();
  memcpy(b + NODE_H_PID_NS, &v64, 8);
  snprintf((char *)b + NODE_H_KEY, SGM_NODE_KEY_MAX, "%s", p->key);
  memcpy(b + NODE_H_UUID, p->uuid, sizeof p->uuid);
  snprintf((char *)b + NODE_H_PCI, SGM_NODE_PCI_MAX, "%s", p->pci_bus_id ? p->pci_bus_id : "");
  sgm__node_record_seal(b, sizeof b);
  uint64_t w[4] = {0, NODE_STATE_LIVE, (uint64_t)getpid(), node_start_ticks()};
  memcpy(b + node_w(NODE_W_SEQ), w, sizeof w);
  snprintf((char *)b + node_w(NODE_W_NAME), SGM_NODE_NAME_MAX, "%s", p->name ? p->name : "");
  const char *k8s_env[3] = {"POD_NAMESPACE", "POD_NAME", "CONTAINER_NAME"};
  for (int i = 0; i < 3; i++) {
    const char *ev = getenv(k8s_env[i]);
    if (ev) snprintf((char *)b + NODE_K8S + (size_t)i * SGM_NODE_K8S_MAX, SGM_NODE_K8S_MAX, "%s", ev);
  }
  ssize_t wr = pwrite(fd, b, sizeof b, 0);
  if (wr != (ssize_t)sizeof b) {
    int we = wr < 0 ? errno : ENOSPC;
    snprintf(why, why_len, "cannot write a record in %.300s: %s%s", n->dir, strerror(we),
             we == ENOSPC ? " (the folder's filesystem is full: free space in it)" : "");
    goto fail;
  }
  node_hook("join-writing");
  mem = mmap(NULL, SGM_NODE_RECORD_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mem == MAP_FAILED) {
    snprintf(why, why_len, "cannot map %.300s: %s", tmp, strerror(errno));
    goto fail;
  }
  if (madvise(mem, SGM_NODE_RECORD_BYTES, MADV_DONTFORK) != 0) {
    snprintf(why, why_len, "madvise(MADV_DONTFORK) on %.300s: %s", tmp, strerror(errno));
    goto fail;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || rename(tmp, n->path) != 0) {
    snprintf(why, why_len, "cannot put %.300s in place: %s", n->path, strerror(errno));
    goto fail;
  }
  n->fd = fd;
  n->mem = mem;
  n->dev = st.st_dev;
  n->ino = st.st_ino;
  return SGM_OK;
fail:
  if (mem != MAP_FAILED) munmap(mem, SGM_NODE_RECORD_BYTES);
  unlink(tmp);
  close(fd);
  n->path[0] = '\0';
  return rc;
}

static void node_close(sgm_node *n) {
  node_peers_close(n->peers);
  free(n->peers);
  n->peers = NULL;
  if (n->mem) munmap(n->mem, SGM_NODE_RECORD_BYTES);
  n->mem = NULL;
  if (n->fd > 0) node_fd_track(n->fd, false);
  if (n->fd >= 0) close(n->fd); /* drops the liveness lock */
  n->fd = -1;
  sgm__lock_destroy(&n->mu);
  free(n);
}

unsigned sgm__node_reclaim(sgm_node *n) {
  if (!__atomic_exchange_n(&n->saw_dead, false, __ATOMIC_RELAXED)) return 0;
  char prefix[SGM_NODE_KEY_MAX + 16];
  sgm__node_prefix(n->key, prefix, sizeof prefix);
  DIR *dp = opendir(n->dir);
  if (!dp) return 0;
  size_t pl = strlen(prefix);
  unsigned freed = 0;
  struct dirent *e;
  while ((e = readdir(dp)) != NULL) {
    if (strncmp(e->d_name, prefix, pl) != 0) continue;
    struct stat st;
    if (fstatat(dirfd(dp), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid() || st.st_ino == n->ino)
      continue;
    int fd = openat(dirfd(dp), e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) continue;
    struct stat st2;
    /* Ours and dead: nobody holds its write lock. A .tmp is locked a moment
     * after its creation: one younger than a few seconds may be a joiner's. */
    size_t l = strlen(e->d_name);
    bool tmp = l > 4 && strcmp(e->d_name + l - 4, ".tmp") == 0;
    if (fstat(fd, &st2) == 0 && st2.st_ino == st.st_ino && !sgm__node_record_alive(fd) &&
        (!tmp || time(NULL) - st2.st_mtime > 5) && unlinkat(dirfd(dp), e->d_name, 0) == 0)
      freed++;
    close(fd);
  }
  closedir(dp);
  return freed;
}

int sgm__node_join(const sgm_node_params *p, sgm_node **out) {
  *out = NULL;
  sgm_node *n = calloc(1, sizeof *n);
  if (!n) return node_untracked(p->verbose, SGM_ERR_NOMEM, "out of host memory");
  sgm_node_view *v = malloc(sizeof *v);
  n->fd = -1;
  n->verbose = p->verbose;
  sgm__lock_init(&n->mu, SGM_LOCK_NODE);
  char why[SGM_ERROR_MAX], prefix[SGM_NODE_KEY_MAX + 16];
  int rc = SGM_ERR_NOMEM;
  snprintf(why, sizeof why, "out of host memory");
  if (!v) goto out_untracked;
  snprintf(n->dir, sizeof n->dir, "%s", p->dir && *p->dir ? p->dir : "/dev/shm");
  snprintf(n->key, sizeof n->key, "%s", p->key);
  n->acc.group = p->group;
  n->acc.gid = p->group ? p->group_gid : -1;
  n->n_slots = p->n_slots ? p->n_slots : SGM_NODE_DEFAULT_SLOTS;
  n->device_total = p->device_total_bytes;
  n->shared_cap = p->shared_cap_bytes;
  sgm__node_prefix(p->key, prefix, sizeof prefix);
  rc = sgm__node_path(n->dir, p->key, n->reg, sizeof n->reg);
  if (rc != SGM_OK) {
    snprintf(why, sizeof why, "%s", sgm_last_error());
    goto out_untracked;
  }
  pthread_once(&node_fork_once, node_fork_register);
  rc = node_check_dir(n->dir, why, sizeof why);
  if (rc != SGM_OK) goto out_untracked;
  rc = sgm__node_scan(n->dir, prefix, n->key, &n->acc, false, v);
  if (rc != SGM_OK) {
    snprintf(why, sizeof why, "%s", sgm_last_error());
    goto out_untracked;
  }
  node_warn_foreign(n, v);
  if (v->n_dead_own) __atomic_store_n(&n->saw_dead, true, __ATOMIC_RELAXED);
  if (v->n_procs + v->n_more >= n->n_slots) {
    snprintf(why, sizeof why, "%zu processes already use device %.64s in %.300s, the most is %u (end "
             "a process, or use another SGM_NODE_DIR)", v->n_procs + v->n_more, n->key, n->dir, n->n_slots);
    rc = SGM_ERR_BUSY;
    goto out_untracked;
  }
  if (v->n_procs) { /* the first live process's device figures hold for all */
    n->device_total = v->device_total_bytes;
    n->shared_cap = v->shared_cap_bytes;
  }
  node_hook("join-locked");
  rc = node_create(n, p, prefix, why, sizeof why);
  if (rc != SGM_OK) goto out_untracked;
  node_fd_track(n->fd, true);
  __atomic_store_n(&n->saw_dead, true, __ATOMIC_RELAXED); /* also a dead joiner's .tmp */
  sgm__node_reclaim(n);
  free(v);
  *out = n;
  return SGM_OK;

out_untracked:
  free(v);
  rc = node_untracked(p->verbose, rc, "%s", why);
  node_close(n);
  return rc;
}

void sgm__node_leave(sgm_node *n) {
  if (!n) return;
  node_hook("leave-locked");
  sgm__lock_take(&n->mu);
  size_t so = node_w(NODE_W_SEQ);
  uint64_t seq = node_load(n->mem, so);
  node_store(n->mem, so, seq + 1);
  node_store(n->mem, node_w(NODE_W_STATE), 0);
  node_store(n->mem, so, seq + 2);
  sgm__lock_drop(&n->mu);
  struct stat named;
  if (lstat(n->path, &named) == 0 && named.st_ino == n->ino && named.st_dev == n->dev) unlink(n->path);
  node_close(n);
}

/* ------------------------------------------------------------------------ */
/* Publishing our figures, reading everyone's. */

/* Under n->mu: write u into our slot inside its seqlock. */
static void node_write_fields_locked(sgm_node *n, const sgm_node_usage *u) {
  size_t so = node_w(NODE_W_SEQ);
  uint64_t seq = node_load(n->mem, so);
  node_store(n->mem, so, seq + 1);
  for (uint32_t i = 0; i < SGM_NODE_N_FIELDS; i++) {
    if (i == SGM_NODE_F_EMU_DEVICE) continue; /* the reservations' own */
    node_store(n->mem, node_w(NODE_W_FIELDS + i), u->w[i]);
  }
  __atomic_store_n(node_word(n->mem, so), seq + 2, __ATOMIC_RELEASE);
}

void sgm__node_publish(sgm_node *n, const sgm_node_usage *u) {
  sgm__lock_take(&n->mu);
  node_write_fields_locked(n, u);
  sgm__lock_drop(&n->mu);
}

/* Under n->mu: this node's view, through its cache of open records. */
static int node_view_scan_locked(sgm_node *n, sgm_node_view *out) {
  char prefix[SGM_NODE_KEY_MAX + 16];
  sgm__node_prefix(n->key, prefix, sizeof prefix);
  if (!n->peers) n->peers = calloc(1, sizeof *n->peers); /* NULL: uncached reads */
  int rc = sgm__node_scan_cached(n->dir, prefix, n->key, &n->acc, false, n->peers, out);
  if (rc != SGM_OK) return rc;
  if (out->n_dead_own) __atomic_store_n(&n->saw_dead, true, __ATOMIC_RELAXED);
  for (size_t i = 0; i < out->n_procs; i++) out->procs[i].self = out->procs[i].ino == (uint64_t)n->ino;
  return SGM_OK;
}

int sgm__node_view(sgm_node *n, sgm_node_view *out) {
  sgm__lock_take(&n->mu);
  int rc = node_view_scan_locked(n, out);
  sgm__lock_drop(&n->mu);
  if (rc == SGM_OK) node_warn_foreign(n, out);
  return rc;
}

uint64_t sgm__node_device_total(const sgm_node *n) { return n->device_total; }
uint64_t sgm__node_shared_cap(const sgm_node *n) { return n->shared_cap; }
const char *sgm__node_file(const sgm_node *n) { return n->path; }
uint32_t sgm__node_slot(const sgm_node *n) { return (uint32_t)n->ino; }

/* ------------------------------------------------------------------------ */
/* The emulated device's capacity, shared by every process that opens it:
 * announce, then check (see the opening comment). */

/* Under n->mu: our own bytes on the device. */
static void node_set_own_device_locked(sgm_node *n, uint64_t bytes) {
  size_t so = node_w(NODE_W_SEQ);
  uint64_t seq = node_load(n->mem, so);
  node_store(n->mem, so, seq + 1);
  node_store(n->mem, node_w(NODE_W_FIELDS + SGM_NODE_F_EMU_DEVICE), bytes);
  __atomic_store_n(node_word(n->mem, so), seq + 2, __ATOMIC_RELEASE);
}

/* Under n->mu: bytes the other live processes hold (or announce) on the device. */
static int node_others_device_locked(sgm_node *n, sgm_node_view *v, uint64_t *sum_out) {
  *sum_out = 0;
  int rc = node_view_scan_locked(n, v);
  if (rc != SGM_OK) return rc;
  uint64_t sum = 0;
  for (size_t i = 0; i < v->n_procs; i++) {
    if (v->procs[i].self) continue;
    uint64_t b = v->procs[i].u.w[SGM_NODE_F_EMU_DEVICE];
    sum = b > UINT64_MAX - sum ? UINT64_MAX : sum + b; /* untrusted: saturate */
  }
  *sum_out = sum;
  return SGM_OK;
}

static uint64_t node_sat_add(uint64_t a, uint64_t b) { return b > UINT64_MAX - a ? UINT64_MAX : a + b; }

int sgm__node_device_reserve(sgm_node *n, uint64_t bytes, uint64_t total, uint64_t *free_out) {
  *free_out = 0;
  sgm_node_view *v = malloc(sizeof *v);
  if (!v) return sgm__error_set(SGM_ERR_NOMEM, "node registry: out of host memory");
  int rc = SGM_ERR_NOMEM;
  sgm__lock_take(&n->mu);
  uint64_t mine = node_load(n->mem, node_w(NODE_W_FIELDS + SGM_NODE_F_EMU_DEVICE));
  for (int attempt = 0; attempt < NODE_RESERVE_TRIES; attempt++) {
    node_set_own_device_locked(n, node_sat_add(mine, bytes)); /* announce */
    node_hook("reserve-locked");
    uint64_t others = 0;
    int src = node_others_device_locked(n, v, &others);
    uint64_t want = node_sat_add(node_sat_add(others, mine), bytes);
    if (src == SGM_OK && want <= total) {
      *free_out = total - want;
      rc = SGM_OK;
      break;
    }
    node_set_own_device_locked(n, mine); /* withdraw */
    if (src != SGM_OK) {
      rc = src;
      break;
    }
    /* Over: for good, or only because another announcement is in flight? */
    if (node_others_device_locked(n, v, &others) != SGM_OK) break;
    uint64_t held = node_sat_add(others, mine);
    *free_out = held < total ? total - held : 0;
    if (node_sat_add(held, bytes) > total) break;
    struct timespec ts = {0, (long)(node_nonce() % 200000u) + 10000};
    nanosleep(&ts, NULL);
  }
  sgm__lock_drop(&n->mu);
  free(v);
  return rc; /* SGM_ERR_NOMEM without a message: the caller words it */
}

void sgm__node_device_release(sgm_node *n, uint64_t bytes) {
  sgm__lock_take(&n->mu);
  uint64_t mine = node_load(n->mem, node_w(NODE_W_FIELDS + SGM_NODE_F_EMU_DEVICE));
  node_set_own_device_locked(n, mine > bytes ? mine - bytes : 0);
  sgm__lock_drop(&n->mu);
}

int sgm__node_device_used(sgm_node *n, uint64_t *used_out) {
  *used_out = 0;
  sgm_node_view *v = malloc(sizeof *v);
  if (!v) return sgm__error_set(SGM_ERR_NOMEM, "node registry: out of host memory");
  uint64_t others = 0;
  sgm__lock_take(&n->mu);
  int rc = node_others_device_locked(n, v, &others);
  uint64_t mine = node_load(n->mem, node_w(NODE_W_FIELDS + SGM_NODE_F_EMU_DEVICE));
  sgm__lock_drop(&n->mu);
  free(v);
  if (rc != SGM_OK) return rc;
  *used_out = node_sat_add(others, mine);
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
      case SGM_NODE_F_DEVICE_USED:
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
  while (n && strcmp(n->reg, path) != 0) n = n->next_open;
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
