/*
 * placement.c — movable buffers, eviction and migration: the only code that
 * touches two tiers (DESIGN.md §3).
 *
 * A buffer's data lives in exactly one tier: a block of the VRAM or shared
 * pool (b->dptr), or an extent of the spill file (b->ext; none yet for a
 * buffer created straight on disk and never written: it reads as zeros).
 *
 * Residency lists: every *released* buffer resident in VRAM or shared memory
 * sits in one list per (tier, priority), most recently used at the head:
 *
 *     lru[VRAM][MINIMUM]  head → b7 → b2 → b9 ← tail   (victims come from the
 *     lru[VRAM][LOW]      head → b4 ← tail               tail of the lowest
 *     ...                                                 non-empty priority)
 *     lru[SHARED][...]    same, victims go to disk
 *
 * Acquired buffers and buffers being moved are in no list, so they are never
 * victims. A buffer with GPU work pending (its release event not complete) is
 * skipped. The issue of policies (plug-ins) will replace this built-in LRU.
 *
 * States: RELEASED (in a list, or on disk), ACQUIRED, BUSY (one thread owns it
 * while moving or copying; others wait on pl->cond). Only the owner of a BUSY
 * buffer touches its data fields.
 *
 * Locking: pl->lock (rank SGM_LOCK_BUFFERS) guards states, lists, the prefetch
 * queue and the counters. It is never held across a copy, disk I/O or a pool
 * call: a mover marks the buffer BUSY, drops the lock, moves, retakes it. The
 * one exception is the event query while choosing victims: a non-blocking
 * driver call, made under the lock so a chosen victim is known to be idle.
 *
 * Threads: a prefetch worker per context, started on the first prefetch.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "internal.h"
#include "tiers/disk.h"
#include "tiers/tier.h"

#define N_PRIO (SGM_PRIORITY_MAXIMUM + 1)
#define N_RESIDENT 2 /* VRAM and shared: the tiers with lists */

typedef enum buf_state { BUF_RELEASED, BUF_ACQUIRED, BUF_BUSY } buf_state;

struct sgm_buffer {
  sgm_context *ctx;          /* owner */
  uint64_t size;             /* bytes asked for */
  sgm_tier tier;             /* where the data is now */
  sgm_devptr dptr;           /* block address in VRAM / shared; 0 on disk */
  sgm_disk_extent ext;       /* on disk: the extent; bytes == 0: never written (zeros) */
  buf_state state;           /* see the module comment */
  int priority;              /* sgm_priority */
  void *event;               /* GPU work queued before release; NULL = none pending */
  bool prefetch_queued;      /* in pl's prefetch queue */
  sgm_buffer *prev, *next;   /* residency list links */
  sgm_buffer *pf_prev, *pf_next;   /* prefetch queue links */
  sgm_buffer *all_prev, *all_next; /* every live buffer of the context */
};

typedef struct buf_list {
  sgm_buffer *head; /* most recently used */
  sgm_buffer *tail; /* least recently used: the next victim */
} buf_list;

struct sgm_placement {
  sgm_lock lock;                       /* guards everything below */
  pthread_cond_t cond;                 /* broadcast when a buffer stops being BUSY */
  buf_list lru[N_RESIDENT][N_PRIO];    /* released resident buffers */
  uint64_t n_listed[N_RESIDENT];       /* buffers in each tier's lists */
  sgm_buffer *all;                     /* every live buffer */
  sgm_disk *disk;                      /* the spill tier, NULL when off */
  uint64_t bytes_in[SGM_TIER_COUNT];   /* migrated into each tier */
  uint64_t bytes_out[SGM_TIER_COUNT];  /* migrated out of each tier */
  uint64_t n_evictions[SGM_TIER_COUNT]; /* buffers moved out to make room */
  uint64_t n_disk_live;                /* buffers on disk (with or without extent) */
  uint64_t disk_used_bytes;            /* their sizes */
  pthread_t worker;                    /* prefetch worker */
  bool worker_started;                 /* the worker runs */
  bool stop;                           /* asks the worker to end */
  pthread_cond_t work_cond;            /* wakes the worker */
  sgm_buffer *pf_head, *pf_tail;       /* prefetch queue, oldest at the head */
};

/* ---- lists (pl->lock held) ---- */

static void list_push_head(struct sgm_placement *pl, sgm_buffer *b) {
  sgm_assert_internal(b->tier < N_RESIDENT);
  buf_list *l = &pl->lru[b->tier][b->priority];
  b->prev = NULL;
  b->next = l->head;
  if (l->head) l->head->prev = b;
  else l->tail = b;
  l->head = b;
  pl->n_listed[b->tier]++;
}

static void list_remove(struct sgm_placement *pl, sgm_buffer *b) {
  buf_list *l = &pl->lru[b->tier][b->priority];
  if (b->prev) b->prev->next = b->next;
  else l->head = b->next;
  if (b->next) b->next->prev = b->prev;
  else l->tail = b->prev;
  b->prev = b->next = NULL;
  pl->n_listed[b->tier]--;
}

static bool buf_listed(const sgm_buffer *b) {
  return b->state == BUF_RELEASED && b->tier < N_RESIDENT;
}

static void pf_remove(struct sgm_placement *pl, sgm_buffer *b) {
  if (b->pf_prev) b->pf_prev->pf_next = b->pf_next;
  else pl->pf_head = b->pf_next;
  if (b->pf_next) b->pf_next->pf_prev = b->pf_prev;
  else pl->pf_tail = b->pf_prev;
  b->pf_prev = b->pf_next = NULL;
  b->prefetch_queued = false;
}

/* Wait until b is not BUSY, then take it: out of its list, BUSY. Returns the
 * state it had (RELEASED or ACQUIRED). A queued prefetch is cancelled: the
 * caller is about to do the work itself. */
static buf_state buf_take_locked(struct sgm_placement *pl, sgm_buffer *b) {
  while (b->state == BUF_BUSY) pthread_cond_wait(&pl->cond, &pl->lock.mu);
  buf_state was = b->state;
  if (buf_listed(b)) list_remove(pl, b);
  if (b->prefetch_queued) pf_remove(pl, b);
  b->state = BUF_BUSY;
  return was;
}

/* Give b back in state `to` (RELEASED goes to the head of its list). */
static void buf_finish(struct sgm_placement *pl, sgm_buffer *b, buf_state to) {
  sgm__lock_take(&pl->lock);
  b->state = to;
  if (buf_listed(b)) list_push_head(pl, b);
  pthread_cond_broadcast(&pl->cond);
  sgm__lock_drop(&pl->lock);
}

/* ---- data movement (caller owns b: BUSY) ---- */

static void *shared_host(sgm_context *ctx, sgm_devptr d) {
  return sgm__shared_host_ptr(ctx->tiers[SGM_TIER_SHARED], d);
}

static int copy(sgm_context *ctx, sgm_copy_kind kind, uint64_t dst, uint64_t src, uint64_t n) {
  return ctx->bops->copy(ctx->be, kind, dst, src, n, NULL);
}

static void count_move(struct sgm_placement *pl, sgm_tier from, sgm_tier to, uint64_t n, bool evict) {
  sgm__lock_take(&pl->lock);
  pl->bytes_out[from] += n;
  pl->bytes_in[to] += n;
  if (evict) pl->n_evictions[from]++;
  if (to == SGM_TIER_DISK) {
    pl->n_disk_live++;
    pl->disk_used_bytes += n;
  }
  if (from == SGM_TIER_DISK) {
    pl->n_disk_live--;
    pl->disk_used_bytes -= n;
  }
  sgm__lock_drop(&pl->lock);
}

/* Read a disk-resident buffer's bytes into host memory dst (zeros if never written). */
static int disk_load(sgm_context *ctx, const sgm_buffer *b, void *dst) {
  if (b->ext.bytes == 0) {
    memset(dst, 0, b->size);
    return SGM_OK;
  }
  return sgm__disk_read(ctx->pl->disk, &b->ext, dst);
}

static int demote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict);

/* Pick a victim in resident tier t: lowest priority first, least recently
 * used first, idle GPU-wise. Returns it BUSY, or NULL. */
static sgm_buffer *pick_victim(sgm_context *ctx, sgm_tier t) {
  struct sgm_placement *pl = ctx->pl;
  sgm_buffer *v = NULL;
  sgm__lock_take(&pl->lock);
  for (int pr = 0; pr < N_PRIO && !v; pr++) {
    for (sgm_buffer *b = pl->lru[t][pr].tail; b; b = b->prev) {
      if (b->event) {
        if (ctx->bops->event_query(ctx->be, b->event) != 1) continue;
        ctx->bops->event_destroy(ctx->be, b->event);
        b->event = NULL;
      }
      v = b;
      break;
    }
  }
  if (v) {
    list_remove(pl, v);
    v->state = BUF_BUSY;
  }
  sgm__lock_drop(&pl->lock);
  return v;
}

int sgm__placement_alloc(sgm_context *ctx, sgm_tier t, uint64_t size, uint64_t *out) {
  for (;;) {
    int rc = sgm__tier_alloc(ctx->tiers[t], size, out);
    if (rc != SGM__ERR_BUDGET && rc != SGM_ERR_NOMEM) return rc;
    if (__atomic_load_n(&ctx->pl->n_listed[t], __ATOMIC_RELAXED) == 0) return rc;
    sgm_buffer *v = pick_victim(ctx, t);
    if (!v) return rc;
    int drc = demote(ctx, v, (sgm_tier)(t + 1), true);
    buf_finish(ctx->pl, v, BUF_RELEASED);
    if (drc != SGM_OK) return drc;
  }
}

/* Spill a VRAM-resident b (BUSY) to disk through a host staging copy. */
static int vram_to_disk(sgm_context *ctx, sgm_buffer *b) {
  void *stage = malloc(b->size);
  if (!stage)
    return sgm__error_set(SGM_ERR_NOMEM, "out of host memory staging %llu bytes for disk",
                          (unsigned long long)b->size);
  int rc = copy(ctx, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)stage, b->dptr, b->size);
  sgm_disk_extent ext;
  if (rc == SGM_OK) rc = sgm__disk_write(ctx->pl->disk, stage, b->size, &ext);
  free(stage);
  if (rc != SGM_OK) return rc;
  uint64_t sz;
  sgm__tier_free(ctx->tiers[SGM_TIER_VRAM], b->dptr, &sz);
  b->dptr = 0;
  b->ext = ext;
  b->tier = SGM_TIER_DISK;
  return SGM_OK;
}

/* Move b (BUSY) one or more tiers down to `to`. On failure b is unchanged. */
static int demote(sgm_context *ctx, sgm_buffer *b, sgm_tier to, bool evict) {
  struct sgm_placement *pl = ctx->pl;
  while (b->tier < to) {
    sgm_tier from = b->tier;
    sgm_tier next = (sgm_tier)(from + 1);
    if (next == SGM_TIER_DISK) {
      if (!pl->disk)
        return sgm__error_set(SGM_ERR_NOMEM, "no disk tier to spill to: set SGM_SPILL_DIR to a "
                              "directory (and SGM_SPILL_LIMIT) to let buffers spill to disk");
      void *host = shared_host(ctx, b->dptr);
      sgm_disk_extent ext;
      int rc = sgm__disk_write(pl->disk, host, b->size, &ext);
      if (rc != SGM_OK) return rc; /* the data stays in shared memory */
      uint64_t sz;
      sgm__tier_free(ctx->tiers[SGM_TIER_SHARED], b->dptr, &sz);
      b->dptr = 0;
      b->ext = ext;
    } else {
      sgm_devptr dst = 0;
      int rc = sgm__placement_alloc(ctx, next, b->size, &dst);
      if ((rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM) && pl->disk) {
        /* Shared memory is full of what cannot move: skip it, straight to disk. */
        rc = vram_to_disk(ctx, b);
        if (rc != SGM_OK) return rc;
        count_move(pl, from, SGM_TIER_DISK, b->size, evict);
        continue;
      }
      if (rc == SGM__ERR_BUDGET) rc = sgm__tier_explain_budget(ctx->tiers[next], b->size);
      if (rc != SGM_OK) return rc;
      rc = copy(ctx, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)shared_host(ctx, dst), b->dptr, b->size);
      if (rc != SGM_OK) {
        uint64_t sz;
        sgm__tier_free(ctx->tiers[next], dst, &sz);
        return rc;
      }
      uint64_t sz;
      sgm__tier_free(ctx->tiers[from], b->dptr, &sz);
      b->dptr = dst;
    }
    b->tier = next;
    count_move(pl, from, next, b->size, evict);
  }
  return SGM_OK;
}

/* Move b (BUSY) up into resident tier `to`, evicting released buffers there.
 * On failure b is unchanged (a checksum mismatch leaves it on disk). */
static int promote(sgm_context *ctx, sgm_buffer *b, sgm_tier to) {
  sgm_devptr dst = 0;
  int rc = sgm__placement_alloc(ctx, to, b->size, &dst);
  if (rc != SGM_OK) return rc;
  sgm_tier from = b->tier;
  if (from == SGM_TIER_DISK) {
    void *host = to == SGM_TIER_SHARED ? shared_host(ctx, dst) : malloc(b->size);
    rc = host ? disk_load(ctx, b, host)
              : sgm__error_set(SGM_ERR_NOMEM, "out of host memory staging %llu bytes from disk",
                               (unsigned long long)b->size);
    if (rc == SGM_OK && to == SGM_TIER_VRAM)
      rc = copy(ctx, SGM_COPY_HOST_TO_DEVICE, dst, (uintptr_t)host, b->size);
    if (to == SGM_TIER_VRAM) free(host);
    if (rc == SGM_OK && b->ext.bytes) sgm__disk_free(ctx->pl->disk, &b->ext);
  } else {
    rc = copy(ctx, SGM_COPY_HOST_TO_DEVICE, dst, (uintptr_t)shared_host(ctx, b->dptr), b->size);
    if (rc == SGM_OK) {
      uint64_t sz;
      sgm__tier_free(ctx->tiers[from], b->dptr, &sz);
    }
  }
  if (rc != SGM_OK) {
    uint64_t sz;
    sgm__tier_free(ctx->tiers[to], dst, &sz);
    return rc;
  }
  b->dptr = dst;
  b->ext = (sgm_disk_extent){0};
  b->tier = to;
  count_move(ctx->pl, from, to, b->size, false);
  return SGM_OK;
}

/* Make b (BUSY) resident: VRAM if it fits after evicting, else shared. */
static int make_resident(sgm_context *ctx, sgm_buffer *b) {
  if (b->tier == SGM_TIER_VRAM) return SGM_OK;
  int rc = promote(ctx, b, SGM_TIER_VRAM);
  if (rc == SGM_OK) return SGM_OK;
  if (rc != SGM__ERR_BUDGET && rc != SGM_ERR_NOMEM) return rc;
  if (b->tier == SGM_TIER_SHARED) return SGM_OK;
  rc = promote(ctx, b, SGM_TIER_SHARED);
  if (rc == SGM__ERR_BUDGET) {
    char vram[SGM_ERROR_MAX];
    sgm__tier_explain_budget(ctx->tiers[SGM_TIER_VRAM], b->size);
    snprintf(vram, sizeof vram, "%s", sgm_last_error());
    sgm__tier_explain_budget(ctx->tiers[SGM_TIER_SHARED], b->size);
    rc = sgm__error_set(SGM_ERR_NOMEM, "cannot make a %llu-byte buffer resident: everything "
                        "resident is acquired. VRAM: %s. Shared: %s",
                        (unsigned long long)b->size, vram, sgm_last_error());
  }
  return rc;
}

/* ---- prefetch worker ---- */

static void *prefetch_main(void *arg) {
  sgm_context *ctx = arg;
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  for (;;) {
    while (!pl->stop && !pl->pf_head) pthread_cond_wait(&pl->work_cond, &pl->lock.mu);
    if (pl->stop) break;
    sgm_buffer *b = pl->pf_head;
    pf_remove(pl, b);
    if (b->state != BUF_RELEASED) continue; /* acquired meanwhile: nothing to do */
    if (buf_listed(b)) list_remove(pl, b);
    b->state = BUF_BUSY;
    sgm__lock_drop(&pl->lock);
    int rc = make_resident(ctx, b);
    if (rc != SGM_OK)
      sgm__log(ctx->cfg.verbose, 2, "prefetch of a %llu-byte buffer failed: %s",
               (unsigned long long)b->size, sgm_last_error());
    sgm__lock_take(&pl->lock);
    b->state = BUF_RELEASED;
    if (buf_listed(b)) list_push_head(pl, b);
    pthread_cond_broadcast(&pl->cond);
  }
  sgm__lock_drop(&pl->lock);
  return NULL;
}

/* ---- lifecycle ---- */

int sgm__placement_create(sgm_context *ctx) {
  struct sgm_placement *pl = calloc(1, sizeof *pl);
  if (!pl) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating the buffer lists");
  sgm__lock_init(&pl->lock, SGM_LOCK_BUFFERS);
  pthread_cond_init(&pl->cond, NULL);
  pthread_cond_init(&pl->work_cond, NULL);
  if (ctx->cfg.spill_dir[0]) {
    int rc = sgm__disk_open(ctx->cfg.spill_dir, ctx->cfg.spill_limit, ctx->cfg.verbose, &pl->disk);
    if (rc != SGM_OK) {
      pthread_cond_destroy(&pl->cond);
      pthread_cond_destroy(&pl->work_cond);
      sgm__lock_destroy(&pl->lock);
      free(pl);
      return rc;
    }
  }
  ctx->pl = pl;
  return SGM_OK;
}

static void buffer_free_storage(sgm_context *ctx, sgm_buffer *b) {
  uint64_t sz;
  if (b->tier == SGM_TIER_DISK) {
    if (b->ext.bytes) sgm__disk_free(ctx->pl->disk, &b->ext);
  } else {
    sgm__tier_free(ctx->tiers[b->tier], b->dptr, &sz);
  }
  if (b->event) ctx->bops->event_destroy(ctx->be, b->event);
}

void sgm__placement_destroy(sgm_context *ctx) {
  struct sgm_placement *pl = ctx->pl;
  if (!pl) return;
  if (pl->worker_started) {
    sgm__lock_take(&pl->lock);
    pl->stop = true;
    pthread_cond_signal(&pl->work_cond);
    sgm__lock_drop(&pl->lock);
    pthread_join(pl->worker, NULL);
  }
  while (pl->all) {
    sgm_buffer *b = pl->all;
    pl->all = b->all_next;
    buffer_free_storage(ctx, b);
    free(b);
  }
  if (pl->disk) sgm__disk_close(pl->disk);
  pthread_cond_destroy(&pl->cond);
  pthread_cond_destroy(&pl->work_cond);
  sgm__lock_destroy(&pl->lock);
  free(pl);
  ctx->pl = NULL;
}

void sgm__placement_stats(sgm_context *ctx, sgm_stats *st) {
  struct sgm_placement *pl = ctx->pl;
  if (pl->disk) sgm__disk_stats(pl->disk, &st->tier[SGM_TIER_DISK]);
  sgm__lock_take(&pl->lock);
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    st->tier[t].bytes_in = pl->bytes_in[t];
    st->tier[t].bytes_out = pl->bytes_out[t];
    st->tier[t].n_evictions = pl->n_evictions[t];
  }
  /* Buffers on disk without an extent yet hold no file space but are live. */
  st->tier[SGM_TIER_DISK].n_live = pl->n_disk_live;
  sgm__lock_drop(&pl->lock);
}

struct sgm_disk *sgm__placement_disk(sgm_context *ctx) { return ctx->pl->disk; }

bool sgm__buffer_disk_offset(sgm_buffer *b, uint64_t *offset) {
  struct sgm_placement *pl = b->ctx->pl;
  sgm__lock_take(&pl->lock);
  bool on = b->tier == SGM_TIER_DISK && b->ext.bytes != 0;
  *offset = on ? b->ext.offset : 0;
  sgm__lock_drop(&pl->lock);
  return on;
}

/* ---- public API ---- */

#define BUF_CHECK(b, what)                                                              \
  do {                                                                                  \
    if (!(b)) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, what ": buffer is NULL"); \
  } while (0)

SGM_API sgm_status sgm_buffer_create(sgm_context *ctx, size_t size, sgm_buffer **out) {
  if (!out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: out is NULL");
  *out = NULL;
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: context is NULL");
  if (size == 0)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: size is 0 (ask for at least one byte)");
  sgm_buffer *b = calloc(1, sizeof *b);
  if (!b) return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "out of host memory for a buffer");
  b->ctx = ctx;
  b->size = size;
  b->priority = SGM_PRIORITY_NORMAL;
  struct sgm_placement *pl = ctx->pl;
  int rc = sgm__placement_alloc(ctx, SGM_TIER_VRAM, size, &b->dptr);
  if (rc == SGM_OK) {
    b->tier = SGM_TIER_VRAM;
  } else if (rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM) {
    rc = sgm__placement_alloc(ctx, SGM_TIER_SHARED, size, &b->dptr);
    if (rc == SGM_OK) b->tier = SGM_TIER_SHARED;
  }
  if (rc != SGM_OK && (rc == SGM__ERR_BUDGET || rc == SGM_ERR_NOMEM)) {
    sgm_tier_stats ds = {0};
    if (pl->disk) sgm__disk_stats(pl->disk, &ds);
    sgm__lock_take(&pl->lock);
    bool fits = pl->disk && ds.budget_bytes - pl->disk_used_bytes >= size &&
                pl->disk_used_bytes <= ds.budget_bytes;
    if (fits) {
      pl->n_disk_live++;
      pl->disk_used_bytes += size;
    }
    sgm__lock_drop(&pl->lock);
    if (fits) {
      b->tier = SGM_TIER_DISK; /* rule 4: straight to disk; no extent until written */
      rc = SGM_OK;
    } else {
      char vram[SGM_ERROR_MAX], shared[SGM_ERROR_MAX];
      sgm__tier_explain_budget(ctx->tiers[SGM_TIER_VRAM], size);
      snprintf(vram, sizeof vram, "%s", sgm_last_error());
      sgm__tier_explain_budget(ctx->tiers[SGM_TIER_SHARED], size);
      snprintf(shared, sizeof shared, "%s", sgm_last_error());
      rc = sgm__error_set(SGM_ERR_NOMEM, "sgm_buffer_create(%zu): nothing fits. VRAM: %s. Shared: "
                          "%s. Disk: %s", size, vram, shared,
                          pl->disk ? "the spill limit is reached (raise SGM_SPILL_LIMIT)"
                                   : "off (set SGM_SPILL_DIR to spill to disk)");
    }
  }
  if (rc != SGM_OK) {
    free(b);
    return (sgm_status)rc;
  }
  sgm__lock_take(&pl->lock);
  b->state = BUF_RELEASED;
  if (buf_listed(b)) list_push_head(pl, b);
  b->all_next = pl->all;
  if (pl->all) pl->all->all_prev = b;
  pl->all = b;
  sgm__lock_drop(&pl->lock);
  *out = b;
  return SGM_OK;
}

SGM_API sgm_status sgm_buffer_acquire(sgm_buffer *b, void *stream, void **device_ptr) {
  (void)stream;
  if (!device_ptr) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_acquire: device_ptr is NULL");
  *device_ptr = NULL;
  BUF_CHECK(b, "sgm_buffer_acquire");
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  while (b->state == BUF_BUSY) pthread_cond_wait(&pl->cond, &pl->lock.mu);
  if (b->state == BUF_ACQUIRED) {
    sgm__lock_drop(&pl->lock);
    return (sgm_status)sgm__error_set(SGM_ERR_BUSY, "sgm_buffer_acquire: the buffer is already "
                                      "acquired (release it first)");
  }
  void *event = b->event;
  b->event = NULL;
  if (b->tier == SGM_TIER_VRAM) {
    /* Fast path: resident in VRAM already. */
    list_remove(pl, b);
    if (b->prefetch_queued) pf_remove(pl, b);
    b->state = BUF_ACQUIRED;
    sgm__lock_drop(&pl->lock);
    if (event) ctx->bops->event_destroy(ctx->be, event);
    *device_ptr = (void *)(uintptr_t)b->dptr;
    return SGM_OK;
  }
  buf_take_locked(pl, b);
  sgm__lock_drop(&pl->lock);
  if (event) ctx->bops->event_destroy(ctx->be, event);
  int rc = make_resident(ctx, b);
  buf_finish(pl, b, rc == SGM_OK ? BUF_ACQUIRED : BUF_RELEASED);
  if (rc != SGM_OK) return (sgm_status)rc;
  *device_ptr = (void *)(uintptr_t)b->dptr;
  return SGM_OK;
}

SGM_API sgm_status sgm_buffer_release(sgm_buffer *b, void *stream) {
  BUF_CHECK(b, "sgm_buffer_release");
  sgm_context *ctx = b->ctx;
  if (b->state != BUF_ACQUIRED)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_release: the buffer is not acquired");
  void *ev = NULL;
  int rc = ctx->bops->event_record(ctx->be, stream, &ev);
  if (rc != SGM_OK) return (sgm_status)rc; /* stays acquired: nothing may move it */
  if (ctx->bops->event_query(ctx->be, ev) == 1) {
    ctx->bops->event_destroy(ctx->be, ev);
    ev = NULL;
  }
  sgm__lock_take(&ctx->pl->lock);
  b->event = ev;
  b->state = BUF_RELEASED;
  if (buf_listed(b)) list_push_head(ctx->pl, b);
  sgm__lock_drop(&ctx->pl->lock);
  return SGM_OK;
}

static int buffer_bounds(const sgm_buffer *b, size_t offset, const void *p, size_t n, const char *fn) {
  if (!b) return sgm__error_set(SGM_ERR_INVALID, "%s: buffer is NULL", fn);
  if (!p && n) return sgm__error_set(SGM_ERR_INVALID, "%s: host pointer is NULL", fn);
  if (offset > b->size || n > b->size - offset)
    return sgm__error_set(SGM_ERR_INVALID, "%s: offset %zu + %zu bytes is past the buffer's %llu bytes",
                          fn, offset, n, (unsigned long long)b->size);
  return SGM_OK;
}

/* Copy between host memory and b's data. write: host → buffer. */
static int buffer_io(sgm_buffer *b, size_t offset, void *host, size_t n, bool write) {
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  if (n == 0) return SGM_OK;
  sgm__lock_take(&pl->lock);
  buf_state was = buf_take_locked(pl, b);
  sgm__lock_drop(&pl->lock);
  int rc = SGM_OK;
  if (b->tier == SGM_TIER_DISK) {
    void *img = malloc(b->size);
    rc = img ? disk_load(ctx, b, img)
             : sgm__error_set(SGM_ERR_NOMEM, "out of host memory staging a %llu-byte buffer",
                              (unsigned long long)b->size);
    if (rc == SGM_OK && !write) memcpy(host, (char *)img + offset, n);
    if (rc == SGM_OK && write) {
      memcpy((char *)img + offset, host, n);
      sgm_disk_extent ext;
      rc = sgm__disk_write(pl->disk, img, b->size, &ext);
      if (rc == SGM_OK) {
        if (b->ext.bytes) sgm__disk_free(pl->disk, &b->ext);
        b->ext = ext;
      }
    }
    free(img);
  } else if (write) {
    rc = copy(ctx, SGM_COPY_HOST_TO_DEVICE, b->dptr + offset, (uintptr_t)host, n);
  } else {
    rc = copy(ctx, SGM_COPY_DEVICE_TO_HOST, (uintptr_t)host, b->dptr + offset, n);
  }
  buf_finish(pl, b, was);
  return rc;
}

SGM_API sgm_status sgm_buffer_write(sgm_buffer *b, size_t offset, const void *src, size_t n) {
  int rc = buffer_bounds(b, offset, src, n, "sgm_buffer_write");
  if (rc != SGM_OK) return (sgm_status)rc;
  return (sgm_status)buffer_io(b, offset, (void *)(uintptr_t)src, n, true);
}

SGM_API sgm_status sgm_buffer_read(sgm_buffer *b, size_t offset, void *dst, size_t n) {
  int rc = buffer_bounds(b, offset, dst, n, "sgm_buffer_read");
  if (rc != SGM_OK) return (sgm_status)rc;
  return (sgm_status)buffer_io(b, offset, dst, n, false);
}

SGM_API sgm_status sgm_buffer_evict(sgm_buffer *b, sgm_tier to) {
  BUF_CHECK(b, "sgm_buffer_evict");
  if (to != SGM_TIER_SHARED && to != SGM_TIER_DISK)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_evict: tier %d is not "
                                      "SGM_TIER_SHARED or SGM_TIER_DISK", (int)to);
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  while (b->state == BUF_BUSY) pthread_cond_wait(&pl->cond, &pl->lock.mu);
  if (b->state == BUF_ACQUIRED) {
    sgm__lock_drop(&pl->lock);
    return (sgm_status)sgm__error_set(SGM_ERR_BUSY, "sgm_buffer_evict: the buffer is acquired");
  }
  if (b->event && ctx->bops->event_query(ctx->be, b->event) != 1) {
    sgm__lock_drop(&pl->lock);
    return (sgm_status)sgm__error_set(SGM_ERR_BUSY, "sgm_buffer_evict: GPU work queued before "
                                      "release has not completed yet");
  }
  buf_take_locked(pl, b);
  sgm__lock_drop(&pl->lock);
  int rc = b->tier < to ? demote(ctx, b, to, false) : SGM_OK;
  buf_finish(pl, b, BUF_RELEASED);
  return (sgm_status)rc;
}

SGM_API sgm_status sgm_buffer_prefetch(sgm_buffer *b, void *stream) {
  (void)stream;
  BUF_CHECK(b, "sgm_buffer_prefetch");
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  int rc = SGM_OK;
  sgm__lock_take(&pl->lock);
  if (b->state == BUF_RELEASED && b->tier != SGM_TIER_VRAM && !b->prefetch_queued) {
    if (!pl->worker_started) {
      int e = pthread_create(&pl->worker, NULL, prefetch_main, ctx);
      if (e == 0) pl->worker_started = true;
      else rc = sgm__error_set(SGM_ERR_NOMEM, "cannot start the prefetch thread: %s", strerror(e));
    }
    if (rc == SGM_OK) {
      b->prefetch_queued = true;
      b->pf_prev = pl->pf_tail;
      b->pf_next = NULL;
      if (pl->pf_tail) pl->pf_tail->pf_next = b;
      else pl->pf_head = b;
      pl->pf_tail = b;
      pthread_cond_signal(&pl->work_cond);
    }
  }
  sgm__lock_drop(&pl->lock);
  return (sgm_status)rc;
}

SGM_API sgm_status sgm_buffer_set_priority(sgm_buffer *b, int priority) {
  BUF_CHECK(b, "sgm_buffer_set_priority");
  if (priority < SGM_PRIORITY_MINIMUM || priority > SGM_PRIORITY_MAXIMUM)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_set_priority: %d is not a "
                                      "priority (SGM_PRIORITY_MINIMUM 0 .. SGM_PRIORITY_MAXIMUM 4)",
                                      priority);
  struct sgm_placement *pl = b->ctx->pl;
  sgm__lock_take(&pl->lock);
  bool listed = buf_listed(b);
  if (listed) list_remove(pl, b);
  b->priority = priority;
  if (listed) list_push_head(pl, b);
  sgm__lock_drop(&pl->lock);
  return SGM_OK;
}

SGM_API sgm_tier sgm_buffer_tier(const sgm_buffer *b) {
  if (!b) return SGM_TIER_NONE;
  struct sgm_placement *pl = b->ctx->pl;
  sgm__lock_take(&pl->lock);
  sgm_tier t = b->tier;
  sgm__lock_drop(&pl->lock);
  return t;
}

SGM_API size_t sgm_buffer_size(const sgm_buffer *b) { return b ? (size_t)b->size : 0; }

SGM_API void sgm_buffer_destroy(sgm_buffer *b) {
  if (!b) return;
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  buf_take_locked(pl, b);
  if (b->all_prev) b->all_prev->all_next = b->all_next;
  else pl->all = b->all_next;
  if (b->all_next) b->all_next->all_prev = b->all_prev;
  if (b->tier == SGM_TIER_DISK) {
    pl->n_disk_live--;
    pl->disk_used_bytes -= b->size;
  }
  sgm__lock_drop(&pl->lock);
  buffer_free_storage(ctx, b);
  free(b);
}
