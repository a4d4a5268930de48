/*
 * model.h — the model-based random test of sgm's public API (issue 12).
 *
 * model_run() drives long random sequences of every public call — sgm_alloc /
 * sgm_free[_ex] on several streams, foreign frees, buffers create / write /
 * read / acquire (with writes through the device pointer) / release / evict /
 * prefetch / set_priority / destroy, sgm_trim, sgm_get_stats, sgm_stats_json —
 * on 1 to 4 threads against one context on the emulated device with a disk
 * tier, and checks them against a shadow model:
 *  - every byte of every allocation and buffer (allocation bytes and acquired
 *    buffers are read straight through their pointers: on the emulated device
 *    both tiers are host memory); allocations are also rewritten in place
 *    through their pointers, and with managed pointers (p->managed) a movable
 *    block moves between VRAM and shared memory while its owner writes it:
 *    no write may be lost (issue 29);
 *  - no two live allocations or acquired buffers overlap;
 *  - at every checkpoint (all threads stopped at a barrier), each tier's
 *    used_bytes and n_live equal the model's sums (VRAM and shared rounded to
 *    256 bytes, disk to 4 KiB) and used <= budget;
 *  - every failure is an allowed status with a message; at the end, every
 *    tier is empty again.
 * Each thread owns its objects (one buffer is used by one thread at a time, as
 * sgm.h requires); the context and the overlap table are shared.
 *
 * Used by tests/model/test_model.c (CI: a few seconds on release, ASan, TSan)
 * and tests/model/soak.c (minutes; reports RSS, committed bytes and open
 * descriptors at every checkpoint). No sleeps, no timing.
 */
#ifndef SGM_MODEL_H
#define SGM_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sgm.h"

#define MODEL_ERR_MAX 1024
#define MODEL_MAX_THREADS 8

/* Called by thread 0 at every checkpoint with every other thread waiting. */
typedef void (*model_checkpoint_fn)(void *user, uint64_t ops_done, sgm_context *ctx);

typedef struct model_params {
  uint64_t seed;               /* each thread's generator starts from seed + thread index */
  uint64_t n_ops;              /* operations per thread */
  int n_threads;               /* 1..MODEL_MAX_THREADS */
  uint64_t ops_per_checkpoint; /* operations per thread between checkpoints; 0 = 500 */
  const char *spill_dir;       /* the disk tier's folder (must exist) */
  uint64_t vram_bytes;         /* the VRAM budget (SGM_VRAM_LIMIT); 0 = 2 MiB */
  uint64_t shared_bytes;       /* the shared budget (SGM_SHARED_LIMIT); 0 = 4 MiB */
  uint64_t max_object_bytes;   /* largest allocation or buffer; 0 = 256 KiB */
  uint64_t idle_trim_ms;       /* SGM_IDLE_TRIM_MS; 0 = off */
  bool free_buffer_pointers;   /* foreign frees also try an acquired buffer's device pointer,
                                  which must be refused (issue 12, defect 2) */
  bool managed;                /* SGM_POINTERS=managed: allocations from SGM_MANAGED_MOVABLE_BYTES up
                                  are movable blocks that sgm moves between VRAM and shared memory
                                  under the same address while their owners rewrite them
                                  (issue 29); budgets and sizes grow to hold several */
  model_checkpoint_fn checkpoint; /* NULL = none */
  void *checkpoint_user;       /* its argument */
} model_params;

typedef struct model_result {
  uint64_t n_ops;              /* operations run, all threads */
  uint64_t n_checkpoints;      /* checkpoints passed */
  uint64_t n_nomem;            /* requests refused for lack of room (allowed) */
  uint64_t n_io;               /* requests refused by disk I/O errors (allowed) */
  uint64_t n_tier_seen[SGM_TIER_COUNT]; /* buffers found in each tier before an acquire */
  uint64_t n_device_writes;    /* writes made through an acquired buffer's device pointer */
  uint64_t n_alloc_writes;     /* allocations rewritten in place through their pointer */
  uint64_t n_movable;          /* movable (managed) allocations made */
} model_result;

/*
 * Run the model. 0 when every check held; -1 with the first broken invariant
 * in err (naming the thread, the operation number and the seed).
 */
int model_run(const model_params *p, model_result *out, char *err, size_t err_len);

#endif
