/*
 * sgm/node.h — reading the node registry: which sgm processes use which
 * device of this machine, with their usage, budgets and liveness.
 *
 * Every context (unless SGM_NODE=off) joins its device's registry: each
 * process writes one small record file of its own per device,
 * <dir>/sgm-node-<key>@<pid>-<nonce> (dir: the admin policy's registry_dir,
 * else SGM_NODE_DIR, else /dev/shm); the registry <dir>/sgm-node-<key> is
 * the set of them (docs/node.md). This header reads them without joining,
 * as sgm-smi does: list the devices, then take one device's snapshot into
 * caller-owned records. Joining and leaving are not here: they happen inside
 * sgm_context_create/destroy.
 *
 * Everything read is untrusted and bounds-checked; files are read with
 * pread into private memory (never mapped), opened only when they are
 * regular files, never blocking; a process's figures are a consistent copy
 * of what it last published (its seqlock), never a torn one. Reading takes
 * no lock and never blocks the processes.
 *
 * Versioned records: the caller sets struct_size to sizeof(the record) as
 * it compiled it; the library fills what it knows up to that size and zeroes
 * the rest, so a program built against a newer header reads 0 (unknown) in
 * members this library predates. Records only ever grow at the end.
 *
 * Thread-safe (no shared state). Errors return sgm_status with a message in
 * sgm_last_error() naming the file and what to do; out-parameters are
 * written on every path (zero on failure). C11 and C++17 clean.
 */
#ifndef SGM_NODE_H
#define SGM_NODE_H

#include <sgm.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SGM_NODE_KEY_BYTES 64       /* sgm_node_device.key, NUL included */
#define SGM_NODE_NAME_BYTES 32      /* sgm_node_process.name, NUL included */
#define SGM_NODE_UUID_TEXT_BYTES 37 /* a UUID as 8-4-4-4-12 hex, NUL included */
#define SGM_NODE_PCI_BYTES 32       /* sgm_node_device.pci_bus_id, NUL included */
#define SGM_NODE_K8S_BYTES 64       /* sgm_node_process.k8s_*, NUL included */

/* sgm_node_read flags. */
#define SGM_NODE_READ_DEAD 1u  /* also list slots whose owner died and nobody reclaimed yet */
#define SGM_NODE_READ_GROUP 2u /* also records of other users shared with one of our groups (0640) */
#define SGM_NODE_READ_ALL_USERS 4u /* every user's records this caller can read (root: all) */

/* One registry file, as sgm_node_list finds it. */
typedef struct sgm_node_entry {
  char path[SGM_PATH_MAX]; /* the registry's name: dir/sgm-node-<key> (its records: that + "@...") */
} sgm_node_entry;

/* One process in a device's registry. Grows only at the end. */
typedef struct sgm_node_process {
  size_t struct_size;                      /* set by the caller: sizeof(sgm_node_process) */
  uint32_t slot;                           /* an id: its record file's inode number, low 32 bits */
  int32_t pid;                             /* as it published it (-1: out of range); shown, not trusted */
  uint64_t start_ticks;                    /* its start time, clock ticks after boot (/proc/PID/stat) */
  char name[SGM_NODE_NAME_BYTES];          /* short name: printable, no space, comma or quote */
  int alive;                               /* 1: its owner holds the slot's liveness lock; 0: dead */
  int solo;                                /* 1: SGM_SHARE_MODE=solo (takes its budget as if alone) */
  uint64_t used_bytes[SGM_TIER_COUNT];     /* bytes handed out per tier (sgm_tier index) */
  uint64_t committed_bytes[SGM_TIER_COUNT]; /* bytes taken from the driver / OS per tier */
  uint64_t budget_bytes[SGM_TIER_COUNT];   /* the budget in force per tier */
  uint64_t peak_bytes[SGM_TIER_COUNT];     /* peak used per tier */
  uint64_t reserve_bytes;                  /* SGM_VRAM_RESERVE: VRAM it is guaranteed */
  uint64_t weight;                         /* SGM_SHARE_WEIGHT */
  uint64_t n_fallbacks;                    /* allocations that wanted VRAM and got shared (cumulative) */
  uint64_t n_evictions;                    /* buffers moved down a tier to make room (cumulative) */
  uint64_t moved_bytes;                    /* bytes migrated between tiers (cumulative) */
  uint64_t heartbeat_ns;                   /* CLOCK_MONOTONIC ns of its last publish (0: never) */
  /* Layout 3 (issue 28): */
  uint32_t uid;                            /* the record's owner (from the kernel, not the record) */
  uint64_t pid_ns;                         /* its PID namespace's inode (0: unknown): pid is unique
                                              only within it (containers) */
  uint64_t flags;                          /* its SGM_NODE_FLAG_* bits, unknown ones passed through */
  uint64_t cap_bytes;                      /* its VRAM budget if alone (fraction, limits, quotas) */
  uint64_t demand_bytes;                   /* VRAM it would use now */
  uint64_t emu_device_bytes;               /* bytes it holds on a shared emulated device */
  uint64_t device_used_bytes;              /* the device's used memory (everyone's, sgm or not)
                                              as its driver told it, within a second; 0 unknown */
  char k8s_namespace[SGM_NODE_K8S_BYTES];  /* its POD_NAMESPACE, POD_NAME and CONTAINER_NAME */
  char k8s_pod[SGM_NODE_K8S_BYTES];        /* (Kubernetes downward API), [A-Za-z0-9._-] */
  char k8s_container[SGM_NODE_K8S_BYTES];  /* only; "" when unset */
  int interposed;                          /* 1: an unmodified program under libsgm-preload.so (its
                                              VRAM bytes include its own driver allocations; its
                                              shared bytes are its fallbacks) */
} sgm_node_process;

#define SGM_NODE_PROCESS_SOLO 1u /* sgm_node_process.flags: SGM_SHARE_MODE=solo (bit values are internal.h's SGM_NODE_FLAG_*) */

/* One device's registry. Grows only at the end. */
typedef struct sgm_node_device {
  size_t struct_size;                    /* set by the caller: sizeof(sgm_node_device) */
  char key[SGM_NODE_KEY_BYTES];          /* the device key ("GPU-<uuid>", "emu-<name>") */
  uint8_t uuid[16];                      /* the device's UUID (all zero: unknown) */
  char uuid_text[SGM_NODE_UUID_TEXT_BYTES]; /* uuid in 8-4-4-4-12 hex; "" when unknown */
  char pci_bus_id[SGM_NODE_PCI_BYTES];   /* its PCI bus id ([0-9a-fA-F:.]); "" when unknown */
  uint32_t version;                      /* the registry layout version (3) */
  uint32_t n_slots;                      /* the most processes that join one device */
  uint64_t device_total_bytes;           /* device memory, as its first live process saw it */
  uint64_t shared_cap_bytes;             /* the node's shared-memory cap: max(RAM / 2, 64 MiB) */
  uint64_t generation;                   /* changes at every join and leave (a hash of the records) */
  size_t n_processes;                    /* processes found, also those past max_procs */
  size_t n_unstable;                     /* records skipped: their writer died mid-write */
  /* Layout 3 (issue 28): */
  size_t n_refused;                      /* names skipped: not regular files, wrong size, writable
                                            by others, corrupt (n_unstable included) */
  size_t n_hidden;                       /* other users' records these flags leave out */
} sgm_node_device;

/*
 * List the registries in dir (NULL or "": the admin policy's registry_dir,
 * else SGM_NODE_DIR, else /dev/shm), in name order: the first max of them
 * into out (out may be NULL when max is 0), *n_out = how many there are
 * (call again with more room when it exceeds max). A registry is listed when
 * a regular file of a record's size carries its name (junk names, FIFOs and
 * links are not listed and are never opened). Failures: SGM_ERR_INVALID
 * (n_out NULL, out NULL with max > 0, or dir does not exist: no sgm process
 * has run with that registry folder), SGM_ERR_IO (dir cannot be read),
 * SGM_ERR_NOMEM. *n_out = 0 on failure.
 */
SGM_API sgm_status sgm_node_list(const char *dir, sgm_node_entry *out, size_t max, size_t *n_out);

/*
 * Read the registry at path (from sgm_node_list) into *dev and the first
 * max_procs of its live processes into procs (join order; with
 * SGM_NODE_READ_DEAD also records whose owner died and were not removed
 * yet, alive = 0). Records of this user are read; SGM_NODE_READ_GROUP adds
 * other users' records shared with one of our groups, SGM_NODE_READ_ALL_USERS
 * every record this caller may read (root: all). Records that are not
 * regular files, not of a record's size, writable by anyone but their owner
 * or corrupt are skipped and counted (dev->n_refused), never a failure.
 * dev->struct_size and, when max_procs > 0, procs[0].struct_size (the
 * stride of the array) are set by the caller; dev->n_processes counts every
 * process found. Failures (dev and procs zeroed, struct sizes kept):
 * SGM_ERR_INVALID (a NULL argument, a struct_size below this library's
 * first version, no record of that name), SGM_ERR_IO (the folder cannot be
 * read), SGM_ERR_UNSUPPORTED (only a registry of an older layout is there:
 * the message says so), SGM_ERR_NOMEM.
 */
SGM_API sgm_status sgm_node_read(const char *path, unsigned flags, sgm_node_device *dev,
                                 sgm_node_process *procs, size_t max_procs);

#ifdef __cplusplus
}
#endif

#endif /* SGM_NODE_H */
