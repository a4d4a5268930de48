/*
 * nodeview.c — the public reader of the node registry (include/sgm/node.h):
 * list a folder's registries and copy one registry's snapshot into the
 * caller's versioned records. The parsing is node.c's (sgm__node_map,
 * sgm__node_parse, sgm__node_slot_alive: bounds-checked, seqlock-consistent);
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
#include <sys/mman.h>
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

static int nodeview_name_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

sgm_status sgm_node_list(const char *dir, sgm_node_entry *out, size_t max, size_t *n_out) {
  if (!n_out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_list: n_out is NULL");
  *n_out = 0;
  if (!out && max)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_node_list: out is NULL, max %zu", max);
  if (!dir || !*dir) dir = getenv("SGM_NODE_DIR");
  if (!dir || !*dir) dir = "/dev/shm";
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
    size_t l = strlen(e->d_name);
    if (strncmp(e->d_name, "sgm-node-", 9) != 0) continue;
    if (l > 4 && strcmp(e->d_name + l - 4, ".tmp") == 0) continue; /* being created */
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      char **grown = realloc(names, cap * sizeof *names);
      if (!grown) goto out_nomem;
      names = grown;
    }
    if (!(names[n] = strdup(e->d_name))) goto out_nomem;
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
  r->interposed = (p->u.w[SGM_NODE_F_FLAGS] & SGM_NODE_FLAG_INTERPOSED) != 0;
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
  int fd;
  unsigned char *mem;
  size_t len;
  char why[SGM_ERROR_MAX];
  int rc = sgm__node_map(path, false, (flags & SGM_NODE_READ_GROUP) != 0, &fd, &mem, &len, why, sizeof why);
  if (rc != SGM_OK) {
    /* "sgm_node_read: <path>: <why>", whether or not the opener named the path. */
    bool named = strncmp(why, path, strlen(path)) == 0 && why[strlen(path)] == ':';
    return (sgm_status)sgm__error_set(rc, "sgm_node_read: %.300s%s%s%s", named ? "" : path, named ? "" : ": ",
                                      why, rc == SGM_ERR_INVALID ? " (no such registry: list "
                                                                 "them with sgm_node_list)" : "");
  }
  sgm_node_view *v = malloc(sizeof *v);
  if (!v) {
    rc = sgm__error_set(SGM_ERR_NOMEM, "sgm_node_read: out of memory reading %.300s", path);
    goto out_unmap;
  }
  rc = sgm__node_parse(mem, len, v, why, sizeof why);
  if (rc != SGM_OK) {
    rc = sgm__error_set(rc, "sgm_node_read: %.300s: %s", path, why);
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
  for (size_t i = 0; i < v->n_procs; i++) {
    bool alive = sgm__node_slot_alive(fd, v->procs[i].slot);
    if (!alive && !(flags & SGM_NODE_READ_DEAD)) continue;
    if (d.n_processes < max_procs) {
      sgm_node_process r;
      nodeview_process(&v->procs[i], alive, &r);
      nodeview_copy_out((char *)procs + d.n_processes * proc_size, proc_size, &r, sizeof r);
    }
    d.n_processes++;
  }
  nodeview_copy_out(dev, dev_size, &d, sizeof d);
out_free:
  free(v);
out_unmap:
  munmap(mem, len);
  close(fd);
  return (sgm_status)rc;
}
