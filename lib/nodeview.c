/*
 * nodeview.c — the public reader of the node registry (include/sgm/node.h):
 * list a folder's registries and copy one registry's snapshot into the
 * caller's versioned records. The reading is node.c's (sgm__node_scan:
 * regular files only, pread into private memory, bounds-checked,
 * seqlock-consistent, liveness by each record's lock);
 * this file turns its view into the public records and its reasons into
 * sgm_last_error() messages. sgm-smi and the benchmarks read through here.
 *
 * Versioned records: the library fills a record of its own size, then copies
 * min(its size, the caller's struct_size) bytes and zeroes the caller's
 * tail, keeping the caller's struct_size. A struct_size below the first
 * published version's size is refused.
 *
 * Threading: none shared; every call works on its own memory.
 */
#include <dirent.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "sgm/node.h"

/* The records' sizes in the first published version (they only grow). */
#define NODEVIEW_DEVICE_V1 (offsetof(sgm_node_device, n_unstable) + sizeof(size_t))
#define NODEVIEW_PROCESS_V1 (offsetof(sgm_node_process, heartbeat_ns) + sizeof(uint64_t))

_Static_assert(SGM_NODE_KEY_BYTES == SGM_NODE_KEY_MAX, "public and internal key sizes differ");
_Static_assert(SGM_NODE_NAME_BYTES == SGM_NODE_NAME_MAX, "public and internal name sizes differ");
_Static_assert(SGM_NODE_PCI_BYTES == SGM_NODE_PCI_MAX, "public and internal PCI id sizes differ");
_Static_assert(SGM_NODE_UUID_TEXT_BYTES == SGM_NODE_UUID_TEXT, "public and internal UUID sizes differ");
_Static_assert(SGM_NODE_K8S_BYTES == SGM_NODE_K8S_MAX, "public and internal label sizes differ");

static int nodeview_name_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* A registry name for the list: the record name's part before its last '@'
 * when the name is a record's (sgm-node-<key>@...), a regular file of a
 * record's size (lstat: nothing is opened). Junk names, FIFOs and files of
 * other sizes are not registries and cannot crowd the list. */
static bool nodeview_registry_of(int dfd, const char *name, char *out, size_t len) {
  size_t l = strlen(name);
  if (strncmp(name, "sgm-node-", 9) != 0 || (l > 4 && strcmp(name + l - 4, ".tmp") == 0)) return false;
  const char *at = strrchr(name, '@');
  if (!at && l < len) { /* an older layout's shared segment: listed so that reading it says so */
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_size < 16)
      return false;
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) return false;
    unsigned char h[16] = {0};
    bool old = pread(fd, h, sizeof h, 0) == (ssize_t)sizeof h && memcmp(h, "SGMNODE", 8) == 0 &&
               h[8] < SGM_NODE_VERSION;
    close(fd);
    if (old) memcpy(out, name, l + 1);
    return old;
  }
  if (!at || at == name + 9 || (size_t)(at - name) >= len) return false;
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
      st.st_size != SGM_NODE_RECORD_BYTES)
    return false;
  memcpy(out, name, (size_t)(at - name));
  out[at - name] = '\0';
  return true;
}

static const char *nodeview_dir(const char *dir) {
  if (!dir || !*dir) {
    const sgm_admin_policy *pol = sgm__admin_current();
    dir = sgm__admin_registry_dir(pol);
  }
  if (!dir || !*dir) dir = getenv("SGM_NODE_DIR");
  if (!dir || !*dir) dir = "/dev/shm";
  return dir;
}

sgm_status sgm_node_list(const char *dir, sgm_node_entry *out, size_t max, size_t *n_out) {
  if (!n_out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_list: n_out is NULL");
  *n_out = 0;
  if (!out && max)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_list: out is NULL, max %zu", max);
  dir = nodeview_dir(dir);
  DIR *dp = opendir(dir);
  if (!dp) {
    int e = errno;
    if (e == ENOENT || e == ENOTDIR)
      return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_list: the registry folder %.300s %s (no "
                                        "sgm process has used it: check SGM_NODE_DIR)", dir,
                                        e == ENOENT ? "does not exist" : "is not a folder");
    return (sgm_status)sgm__error_set(SGM_ERR_IO, "sgm_node_list: cannot read the registry folder %.300s: %s",
                                      dir, strerror(e));
  }
  int rc = SGM_OK;
  char **names = NULL;
  size_t n = 0, cap = 0;
  struct dirent *e;
  while ((e = readdir(dp)) != NULL) {
    char reg[256];
    if (!nodeview_registry_of(dirfd(dp), e->d_name, reg, sizeof reg)) continue;
    bool seen = false;
    for (size_t i = 0; i < n && !seen; i++) seen = strcmp(names[i], reg) == 0;
    if (seen) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      char **grown = realloc(names, cap * sizeof *names);
      if (!grown) goto out_nomem;
      names = grown;
    }
    if (!(names[n] = strdup(reg))) goto out_nomem;
    n++;
  }
  if (n) qsort(names, n, sizeof *names, nodeview_name_cmp);
  for (size_t i = 0; i < n && i < max; i++)
    snprintf(out[i].path, sizeof out[i].path, "%s/%s", dir, names[i]);
  *n_out = n;
  goto out_free;
out_nomem:
  rc = sgm__error_set(SGM_ERR_NOMEM, "sgm_node_list: out of memory listing %.300s", dir);
out_free:
  for (size_t i = 0; i < n; i++) free(names[i]);
  free(names);
  closedir(dp);
  return (sgm_status)rc;
}

/* Copy a record of the library's size into the caller's, zeroing its tail. */
static void nodeview_copy_out(void *dst, size_t dst_size, const void *src, size_t src_size) {
  size_t n = dst_size < src_size ? dst_size : src_size;
  memcpy((char *)dst + sizeof(size_t), (const char *)src + sizeof(size_t), n - sizeof(size_t));
  if (dst_size > n) memset((char *)dst + n, 0, dst_size - n);
}

/* One slot's published words as a public record. */
static void nodeview_process(const sgm_node_proc *p, bool alive, sgm_node_process *r) {
  memset(r, 0, sizeof *r);
  r->struct_size = sizeof *r;
  r->slot = p->slot;
  r->pid = p->pid;
  r->start_ticks = p->start_ticks;
  memcpy(r->name, p->name, sizeof r->name);
  r->alive = alive;
  r->solo = (p->u.w[SGM_NODE_F_FLAGS] & SGM_NODE_FLAG_SOLO) != 0;
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    r->used_bytes[t] = p->u.w[SGM_NODE_F_USED + t];
    r->committed_bytes[t] = p->u.w[SGM_NODE_F_COMMITTED + t];
    r->budget_bytes[t] = p->u.w[SGM_NODE_F_BUDGET + t];
    r->peak_bytes[t] = p->u.w[SGM_NODE_F_PEAK + t];
  }
  r->reserve_bytes = p->u.w[SGM_NODE_F_RESERVE];
  r->weight = p->u.w[SGM_NODE_F_WEIGHT];
  r->n_fallbacks = p->u.w[SGM_NODE_F_FALLBACKS];
  r->n_evictions = p->u.w[SGM_NODE_F_EVICTIONS];
  r->moved_bytes = p->u.w[SGM_NODE_F_MOVED];
  r->heartbeat_ns = p->u.w[SGM_NODE_F_HEARTBEAT];
  r->uid = p->uid;
  r->pid_ns = p->pid_ns;
  r->flags = p->u.w[SGM_NODE_F_FLAGS];
  r->cap_bytes = p->u.w[SGM_NODE_F_CAP];
  r->demand_bytes = p->u.w[SGM_NODE_F_DEMAND];
  r->emu_device_bytes = p->u.w[SGM_NODE_F_EMU_DEVICE];
  r->device_used_bytes = p->u.w[SGM_NODE_F_DEVICE_USED];
  memcpy(r->k8s_namespace, p->k8s_namespace, sizeof r->k8s_namespace);
  memcpy(r->k8s_pod, p->k8s_pod, sizeof r->k8s_pod);
  memcpy(r->k8s_container, p->k8s_container, sizeof r->k8s_container);
  r->interposed = (p->u.w[SGM_NODE_F_FLAGS] & SGM_NODE_FLAG_INTERPOSED) != 0;
}

/* path names a file of an older layout (one shared segment)? Then the
 * message says so. Opened only when it is a regular file (lstat), never
 * blocking (O_NONBLOCK), read with pread. */
static int nodeview_old_segment(const char *path, char *why, size_t len) {
  struct stat st;
  if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode)) return SGM_OK;
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return SGM_OK;
  unsigned char h[16] = {0};
  ssize_t r = pread(fd, h, sizeof h, 0);
  close(fd);
  uint32_t version;
  memcpy(&version, h + 8, 4);
  if (r == (ssize_t)sizeof h && memcmp(h, "SGMNODE", 7) == 0 && version < SGM_NODE_VERSION) {
    snprintf(why, len, "layout %u, written by an older sgm: end its processes, or remove the file "
             "once none runs", version);
    return SGM_ERR_UNSUPPORTED;
  }
  return SGM_OK;
}

sgm_status sgm_node_read(const char *path, unsigned flags, sgm_node_device *dev, sgm_node_process *procs,
                         size_t max_procs) {
  if (!dev) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_read: dev is NULL");
  size_t dev_size = dev->struct_size;
  if (dev_size < NODEVIEW_DEVICE_V1)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_read: dev->struct_size is %zu, at least %zu "
                                      "(set it to sizeof(sgm_node_device))", dev_size,
                                      (size_t)NODEVIEW_DEVICE_V1);
  memset((char *)dev + sizeof(size_t), 0, dev_size - sizeof(size_t));
  size_t proc_size = max_procs && procs ? procs[0].struct_size : 0;
  if (max_procs && !procs)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_read: procs is NULL, max_procs %zu",
                                      max_procs);
  if (max_procs && proc_size < NODEVIEW_PROCESS_V1)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_read: procs[0].struct_size is %zu, at least "
                                      "%zu (set it to sizeof(sgm_node_process))", proc_size,
                                      (size_t)NODEVIEW_PROCESS_V1);
  if (max_procs) memset((char *)procs + sizeof(size_t), 0, max_procs * proc_size - sizeof(size_t));
  if (!path) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_read: path is NULL");
  /* path = dir/sgm-node-<key>: the records are dir/sgm-node-<key>@... */
  char dir[SGM_PATH_MAX], prefix[SGM_PATH_MAX];
  const char *slash = strrchr(path, '/');
  const char *base = slash ? slash + 1 : path;
  if (slash) snprintf(dir, sizeof dir, "%.*s", (int)(slash - path) ? (int)(slash - path) : 1, path);
  else snprintf(dir, sizeof dir, ".");
  if (strncmp(base, "sgm-node-", 9) != 0 || strchr(base, '@') || strlen(base) + 2 > SGM_NODE_KEY_MAX + 9)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_read: %.300s is not a registry name "
                                      "(dir/sgm-node-<key>, as sgm_node_list gives)", path);
  snprintf(prefix, sizeof prefix, "%s@", base);
  sgm_node_view *v = malloc(sizeof *v);
  if (!v) return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "sgm_node_read: out of memory reading %.300s", path);
  sgm_node_accept acc = {.group = (flags & SGM_NODE_READ_GROUP) != 0, .gid = -1,
                         .all_users = (flags & SGM_NODE_READ_ALL_USERS) != 0};
  /* The key is the records' own: read them with the name's (sanitised) key
   * first, then keep those whose key sanitises to the name. */
  int rc = sgm__node_scan(dir, prefix, NULL, &acc, (flags & SGM_NODE_READ_DEAD) != 0, v);
  char why[SGM_ERROR_MAX];
  if (rc == SGM_ERR_INVALID) {
    rc = sgm__error_set(rc, "sgm_node_read: %.300s: no such registry (its folder %.300s does not exist: "
                        "list them with sgm_node_list)", path, dir);
    goto out_free;
  }
  if (rc != SGM_OK) {
    rc = sgm__error_set(rc, "sgm_node_read: %.300s: %s", path, sgm_last_error());
    goto out_free;
  }
  if (v->n_procs == 0 && v->n_foreign == 0 && nodeview_old_segment(path, why, sizeof why) != SGM_OK) {
    rc = sgm__error_set(SGM_ERR_UNSUPPORTED, "sgm_node_read: %.300s: %s", path, why);
    goto out_free;
  }
  if (v->n_procs == 0 && v->n_foreign == 0 && v->n_refused == 0 && v->n_dead_own == 0) {
    rc = sgm__error_set(SGM_ERR_INVALID, "sgm_node_read: %.300s: no such registry (no process "
                        "record in %.300s: list them with sgm_node_list)", path, dir);
    goto out_free;
  }
  sgm_node_device d = {.struct_size = sizeof d};
  memcpy(d.key, v->key, sizeof d.key);
  memcpy(d.uuid, v->uuid, sizeof d.uuid);
  memcpy(d.uuid_text, v->uuid_text, sizeof d.uuid_text);
  memcpy(d.pci_bus_id, v->pci_bus_id, sizeof d.pci_bus_id);
  d.version = v->version;
  d.n_slots = v->n_slots;
  d.device_total_bytes = v->device_total_bytes;
  d.shared_cap_bytes = v->shared_cap_bytes;
  d.generation = v->generation;
  d.n_unstable = v->n_unstable;
  d.n_refused = v->n_refused;
  d.n_hidden = v->n_foreign;
  for (size_t i = 0; i < v->n_procs; i++) {
    if (d.n_processes < max_procs) {
      sgm_node_process r;
      nodeview_process(&v->procs[i], v->procs[i].alive, &r);
      nodeview_copy_out((char *)procs + d.n_processes * proc_size, proc_size, &r, sizeof r);
    }
    d.n_processes++;
  }
  d.n_processes += v->n_more;
  nodeview_copy_out(dev, dev_size, &d, sizeof d);
out_free:
  free(v);
  return (sgm_status)rc;
}
