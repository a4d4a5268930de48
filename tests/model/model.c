/*
 * model.c — the model-based random test (see model.h for what it checks).
 *
 * Shape: every thread runs the same number of phases; a phase is
 * ops_per_checkpoint random operations on the thread's own objects, then two
 * barriers with the checkpoint between them (thread 0 checks the whole model
 * while every other thread waits). A thread that finds a broken invariant
 * records it (the first one wins) and skips its remaining operations, but
 * still meets every barrier, so that the run ends, cleans up and reports.
 *
 * The shadow of a buffer is its bytes plus a "known" mask: a byte is known
 * once a write that covered it succeeded; a failed write leaves the range it
 * covered unknown (issue 12, defect 9: the contract does not yet say what a
 * failed write leaves), and unknown bytes are not compared.
 *
 * Threading: objects are per thread; the span table (overlap check) and the
 * first error are under one mutex.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "model.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define MODEL_MAX_OBJECTS 48      /* per thread and kind: enough to fill the budgets */
#define MODEL_ALIGN UINT64_C(256) /* sgm.h: allocations aligned as cudaMalloc's */
#define MODEL_DISK_ALIGN UINT64_C(4096) /* the disk tier's extent granule */
#define MODEL_MANAGED_PAGE UINT64_C(65536) /* a movable block's granule (docs/managed.md) */

typedef struct model_alloc {
  unsigned char *p; /* what sgm_alloc returned */
  size_t size;      /* bytes asked for */
  void *stream;     /* the stream it was allocated (and is freed) on */
  uint32_t seed;    /* its bytes are model_pattern(seed, i) */
} model_alloc;

typedef struct model_buf {
  sgm_buffer *b;         /* the handle */
  size_t size;           /* bytes */
  unsigned char *shadow; /* what its bytes must be where known */
  unsigned char *known;  /* 1 = shadow holds the byte, 0 = undefined */
  unsigned char *dev;    /* the device pointer while acquired, else NULL */
  bool prefetched;       /* a prefetch may be in flight */
} model_buf;

struct model_shared;

typedef struct model_thread {
  struct model_shared *sh; /* the run */
  int index;               /* 0 .. n_threads-1 */
  sgm_test_rng rng;        /* this thread's generator */
  uint64_t op;             /* operations done */
  model_alloc allocs[MODEL_MAX_OBJECTS]; /* live allocations */
  int n_allocs;            /* entries used */
  model_buf bufs[MODEL_MAX_OBJECTS]; /* live buffers */
  int n_bufs;              /* entries used */
  char streams[2];         /* two stream handles of this thread (addresses only) */
  model_result res;        /* this thread's counters */
  unsigned char *scratch;  /* max_object_bytes for reads and writes */
} model_thread;

typedef struct model_span {
  uintptr_t lo, hi; /* [lo, hi) */
} model_span;

typedef struct model_shared {
  const model_params *p;   /* the parameters */
  sgm_context *ctx;        /* the context under test */
  pthread_barrier_t bar;   /* phase barrier of all threads */
  pthread_mutex_t mu;      /* guards spans, n_spans and err */
  model_span *spans;       /* live allocations and acquired buffers */
  size_t n_spans, cap_spans; /* entries used / allocated */
  atomic_bool failed;      /* an invariant broke */
  char err[MODEL_ERR_MAX]; /* the first broken invariant */
  model_thread th[MODEL_MAX_THREADS]; /* the threads' states */
  uint64_t n_checkpoints;  /* checkpoints passed */
} model_shared;

/* ---- failures ---- */

static void model_fail(model_thread *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void model_fail(model_thread *t, const char *fmt, ...) {
  model_shared *sh = t->sh;
  pthread_mutex_lock(&sh->mu);
  if (!atomic_load(&sh->failed)) {
    char what[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(sh->err, sizeof sh->err,
             "thread %d, operation %llu (seed %llu, %d threads): %s [sgm_last_error: %s]",
             t->index, (unsigned long long)t->op, (unsigned long long)sh->p->seed,
             sh->p->n_threads, what, sgm_last_error());
    atomic_store(&sh->failed, true);
  }
  pthread_mutex_unlock(&sh->mu);
}

static bool model_failed(const model_thread *t) { return atomic_load(&t->sh->failed); }

/* A status a request may fail with for lack of room or disk trouble; counts it. */
static bool model_allowed_refusal(model_thread *t, sgm_status rc) {
  if (rc == SGM_ERR_NOMEM) {
    t->res.n_nomem++;
    return true;
  }
  if (rc == SGM_ERR_IO) {
    t->res.n_io++;
    return true;
  }
  return false;
}

/* ---- the span table: no two live allocations / acquired buffers overlap ---- */

static void model_span_add(model_thread *t, const void *p, size_t n, const char *what) {
  model_shared *sh = t->sh;
  uintptr_t lo = (uintptr_t)p, hi = lo + n;
  pthread_mutex_lock(&sh->mu);
  for (size_t i = 0; i < sh->n_spans; i++) {
    if (lo < sh->spans[i].hi && sh->spans[i].lo < hi) {
      model_span o = sh->spans[i];
      pthread_mutex_unlock(&sh->mu);
      model_fail(t, "%s [%#lx, %#lx) overlaps a live allocation or acquired buffer [%#lx, %#lx)",
                 what, (unsigned long)lo, (unsigned long)hi, (unsigned long)o.lo,
                 (unsigned long)o.hi);
      return;
    }
  }
  if (sh->n_spans == sh->cap_spans) {
    size_t cap = sh->cap_spans ? sh->cap_spans * 2 : 256;
    model_span *s = realloc(sh->spans, cap * sizeof *s);
    if (!s) abort();
    sh->spans = s;
    sh->cap_spans = cap;
  }
  sh->spans[sh->n_spans++] = (model_span){lo, hi};
  pthread_mutex_unlock(&sh->mu);
}

static void model_span_remove(model_thread *t, const void *p) {
  model_shared *sh = t->sh;
  pthread_mutex_lock(&sh->mu);
  for (size_t i = 0; i < sh->n_spans; i++) {
    if (sh->spans[i].lo == (uintptr_t)p) {
      sh->spans[i] = sh->spans[--sh->n_spans];
      break;
    }
  }
  pthread_mutex_unlock(&sh->mu);
}

/* ---- bytes ---- */

static unsigned char model_pattern(uint32_t seed, size_t i) {
  uint32_t x = seed ^ (uint32_t)(i * 2654435761u) ^ (uint32_t)(i >> 13);
  x ^= x >> 15;
  return (unsigned char)(x * 0x2c1b3c6du >> 24);
}

static void model_fill_random(model_thread *t, unsigned char *p, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint64_t r = sgm_test_rng_next(&t->rng);
    for (int k = 0; k < 8 && i < n; k++, i++) p[i] = (unsigned char)(r >> (8 * k));
  }
}

/* Compare the known bytes of [off, off + n) of buffer m with got. */
static bool model_buf_matches(model_thread *t, const model_buf *m, size_t off, const unsigned char *got,
                              size_t n, const char *how) {
  for (size_t i = 0; i < n; i++) {
    if (m->known[off + i] && got[i] != m->shadow[off + i]) {
      model_fail(t, "buffer of %zu bytes, %s: byte %zu is %#x, the model says %#x", m->size, how,
                 off + i, got[i], m->shadow[off + i]);
      return false;
    }
  }
  return true;
}

static bool model_alloc_intact(model_thread *t, const model_alloc *a, const char *when) {
  for (size_t i = 0; i < a->size; i++) {
    if (a->p[i] != model_pattern(a->seed, i)) {
      model_fail(t, "allocation %p of %zu bytes (tier %s), %s: byte %zu was overwritten", (void *)a->p,
                 a->size, sgm_tier_name(sgm_pointer_tier(t->sh->ctx, a->p)), when, i);
      return false;
    }
  }
  return true;
}

static void *model_stream(model_thread *t) {
  uint64_t k = sgm_test_rng_range(&t->rng, 0, 2);
  return k == 0 ? NULL : &t->streams[k - 1];
}

static size_t model_size(model_thread *t) {
  return (size_t)sgm_test_rng_log_range(&t->rng, 1, t->sh->p->max_object_bytes);
}

/* An allocation's size: with managed pointers one in four is movable
 * (SGM_MANAGED_MOVABLE_BYTES to twice that), so that several live at once
 * and the budgets make sgm move them. */
static size_t model_alloc_size(model_thread *t) {
  if (t->sh->p->managed && sgm_test_rng_range(&t->rng, 0, 3) == 0)
    return (size_t)sgm_test_rng_range(&t->rng, SGM_MANAGED_MOVABLE_BYTES, 2 * SGM_MANAGED_MOVABLE_BYTES);
  return model_size(t);
}

/* ---- operations ---- */

static void model_op_alloc(model_thread *t) {
  if (t->n_allocs == MODEL_MAX_OBJECTS) return;
  model_alloc a = {.size = model_alloc_size(t), .stream = model_stream(t),
                   .seed = (uint32_t)sgm_test_rng_next(&t->rng)};
  a.p = sgm_alloc(t->sh->ctx, a.size, a.stream);
  if (!a.p) {
    if (!sgm_last_error()[0]) model_fail(t, "sgm_alloc(%zu) returned NULL without a message", a.size);
    t->res.n_nomem++;
    return;
  }
  if ((uintptr_t)a.p % MODEL_ALIGN != 0)
    model_fail(t, "sgm_alloc(%zu) = %p is not %llu-byte aligned", a.size, (void *)a.p,
               (unsigned long long)MODEL_ALIGN);
  sgm_tier tier = sgm_pointer_tier(t->sh->ctx, a.p);
  if (tier != SGM_TIER_VRAM && tier != SGM_TIER_SHARED)
    model_fail(t, "a live allocation reports tier %s", sgm_tier_name(tier));
  model_span_add(t, a.p, a.size, "a new allocation");
  for (size_t i = 0; i < a.size; i++) a.p[i] = model_pattern(a.seed, i);
  if (a.size >= SGM_MANAGED_MOVABLE_BYTES) t->res.n_movable++;
  t->allocs[t->n_allocs++] = a;
}

/* What a host-side user of a (managed) pointer does: check it, then rewrite
 * every byte with a new pattern through the pointer, while other threads'
 * calls may move the block (issue 29: none of these writes may be lost). */
static void model_op_alloc_write(model_thread *t) {
  if (t->n_allocs == 0) return;
  model_alloc *a = &t->allocs[sgm_test_rng_range(&t->rng, 0, (uint64_t)t->n_allocs - 1)];
  if (!model_alloc_intact(t, a, "before a rewrite through its pointer")) return;
  a->seed = (uint32_t)sgm_test_rng_next(&t->rng);
  for (size_t i = 0; i < a->size; i++) a->p[i] = model_pattern(a->seed, i);
  t->res.n_alloc_writes++;
}

static void model_free_at(model_thread *t, int k) {
  model_alloc a = t->allocs[k];
  model_alloc_intact(t, &a, "before its free");
  model_span_remove(t, a.p);
  sgm_status rc = sgm_free_ex(t->sh->ctx, a.p, a.stream);
  if (rc != SGM_OK) model_fail(t, "sgm_free_ex of a live allocation: %s", sgm_status_string(rc));
  t->allocs[k] = t->allocs[--t->n_allocs];
  /* Alone, nothing can reuse the address meanwhile: a second free is a double free. */
  if (t->sh->p->n_threads == 1 && sgm_test_rng_range(&t->rng, 0, 7) == 0) {
    if (sgm_pointer_tier(t->sh->ctx, a.p) != SGM_TIER_NONE)
      model_fail(t, "a freed pointer still reports a tier");
    rc = sgm_free_ex(t->sh->ctx, a.p, a.stream);
    if (rc != SGM_ERR_INVALID)
      model_fail(t, "a double free answered %s, not SGM_ERR_INVALID", sgm_status_string(rc));
  }
}

static void model_op_free(model_thread *t) {
  if (t->n_allocs == 0) return;
  model_free_at(t, (int)sgm_test_rng_range(&t->rng, 0, (uint64_t)t->n_allocs - 1));
}

static model_buf *model_pick_buf(model_thread *t) {
  if (t->n_bufs == 0) return NULL;
  return &t->bufs[sgm_test_rng_range(&t->rng, 0, (uint64_t)t->n_bufs - 1)];
}

/* Pointers sgm did not hand out: refused, and nothing changes. */
static void model_op_foreign_free(model_thread *t) {
  char on_stack[16];
  void *p = on_stack;
  model_alloc *a = NULL;
  model_buf *m = t->sh->p->free_buffer_pointers ? model_pick_buf(t) : NULL;
  if (m && m->dev) {
    /* A buffer's block is not an allocation: sgm_free must refuse it. */
    sgm_status rc = sgm_free_ex(t->sh->ctx, m->dev, NULL);
    if (rc != SGM_ERR_INVALID)
      model_fail(t, "sgm_free_ex of an acquired buffer's device pointer answered %s",
                 sgm_status_string(rc));
    return;
  }
  if (t->n_allocs > 0) {
    a = &t->allocs[sgm_test_rng_range(&t->rng, 0, (uint64_t)t->n_allocs - 1)];
    if (a->size > 1) p = a->p + sgm_test_rng_range(&t->rng, 1, a->size - 1);
  }
  sgm_status rc = sgm_free_ex(t->sh->ctx, p, NULL);
  if (rc != SGM_ERR_INVALID)
    model_fail(t, "sgm_free_ex of a foreign pointer answered %s", sgm_status_string(rc));
  if (a) model_alloc_intact(t, a, "after a foreign free inside it");
}

static void model_op_create(model_thread *t) {
  if (t->n_bufs == MODEL_MAX_OBJECTS) return;
  model_buf m = {.size = model_size(t)};
  sgm_status rc = sgm_buffer_create(t->sh->ctx, m.size, &m.b);
  if (rc != SGM_OK) {
    if (m.b) model_fail(t, "a failed sgm_buffer_create left *out set");
    if (!model_allowed_refusal(t, rc))
      model_fail(t, "sgm_buffer_create(%zu): %s", m.size, sgm_status_string(rc));
    return;
  }
  if (sgm_buffer_size(m.b) != m.size)
    model_fail(t, "sgm_buffer_size = %zu, created with %zu", sgm_buffer_size(m.b), m.size);
  m.shadow = malloc(m.size);
  m.known = calloc(m.size, 1);
  if (!m.shadow || !m.known) abort();
  model_fill_random(t, m.shadow, m.size);
  rc = sgm_buffer_write(m.b, 0, m.shadow, m.size);
  if (rc == SGM_OK)
    memset(m.known, 1, m.size);
  else if (!model_allowed_refusal(t, rc))
    model_fail(t, "first write of a new buffer: %s", sgm_status_string(rc));
  t->bufs[t->n_bufs++] = m;
}

static void model_range(model_thread *t, size_t size, size_t *off, size_t *n) {
  *off = (size_t)sgm_test_rng_range(&t->rng, 0, size - 1);
  *n = (size_t)sgm_test_rng_range(&t->rng, 1, size - *off);
}

static void model_op_write(model_thread *t) {
  model_buf *m = model_pick_buf(t);
  if (!m) return;
  size_t off, n;
  if (sgm_test_rng_range(&t->rng, 0, 15) == 0) {
    /* Out of bounds: refused, nothing written. */
    sgm_status rc = sgm_buffer_write(m->b, m->size - 1, t->scratch, 2);
    if (rc != SGM_ERR_INVALID)
      model_fail(t, "a write past the end answered %s", sgm_status_string(rc));
    return;
  }
  bool whole = sgm_test_rng_range(&t->rng, 0, 7) == 0;
  if (whole) {
    off = 0;
    n = m->size;
  } else {
    model_range(t, m->size, &off, &n);
  }
  model_fill_random(t, t->scratch, n);
  sgm_status rc = sgm_buffer_write(m->b, off, t->scratch, n);
  if (rc == SGM_OK) {
    memcpy(m->shadow + off, t->scratch, n);
    memset(m->known + off, 1, n);
  } else if (rc == SGM_ERR_BUSY && m->dev) {
    /* An acquired buffer may refuse host writes; then nothing changed. */
  } else if (model_allowed_refusal(t, rc)) {
    memset(m->known + off, 0, n);
  } else {
    model_fail(t, "sgm_buffer_write(%zu, %zu) of %zu bytes: %s", off, n, m->size,
               sgm_status_string(rc));
  }
}

static void model_op_read(model_thread *t) {
  model_buf *m = model_pick_buf(t);
  if (!m) return;
  size_t off, n;
  model_range(t, m->size, &off, &n);
  sgm_status rc = sgm_buffer_read(m->b, off, t->scratch, n);
  if (rc == SGM_OK)
    model_buf_matches(t, m, off, t->scratch, n, "sgm_buffer_read");
  else if (!(rc == SGM_ERR_BUSY && m->dev) && !model_allowed_refusal(t, rc))
    model_fail(t, "sgm_buffer_read(%zu, %zu) of %zu bytes: %s", off, n, m->size,
               sgm_status_string(rc));
}

static void model_acquire(model_thread *t, model_buf *m, void *stream) {
  sgm_tier before = sgm_buffer_tier(m->b);
  if (before >= 0 && before < SGM_TIER_COUNT) t->res.n_tier_seen[before]++;
  void *d = (void *)1;
  sgm_status rc = sgm_buffer_acquire(m->b, stream, &d);
  m->prefetched = false; /* acquire waits for a prefetch in flight */
  if (rc != SGM_OK) {
    if (d) model_fail(t, "a failed acquire left *device_ptr set");
    if (!model_allowed_refusal(t, rc)) model_fail(t, "sgm_buffer_acquire: %s", sgm_status_string(rc));
    return;
  }
  sgm_tier tier = sgm_buffer_tier(m->b);
  if (!d || (tier != SGM_TIER_VRAM && tier != SGM_TIER_SHARED)) {
    model_fail(t, "an acquired buffer is at %p in tier %s", d, sgm_tier_name(tier));
    return;
  }
  m->dev = d;
  model_span_add(t, d, m->size, "an acquired buffer");
  model_buf_matches(t, m, 0, m->dev, m->size, "read through the device pointer after acquire");
}

static void model_release(model_thread *t, model_buf *m, void *stream) {
  model_span_remove(t, m->dev);
  m->dev = NULL;
  sgm_status rc = sgm_buffer_release(m->b, stream);
  if (rc != SGM_OK) model_fail(t, "sgm_buffer_release: %s", sgm_status_string(rc));
}

static void model_op_acquire(model_thread *t) {
  model_buf *m = model_pick_buf(t);
  if (!m) return;
  if (m->dev) {
    void *d = (void *)1;
    sgm_status rc = sgm_buffer_acquire(m->b, NULL, &d);
    if (rc != SGM_ERR_BUSY || d)
      model_fail(t, "acquiring an acquired buffer answered %s", sgm_status_string(rc));
    return;
  }
  model_acquire(t, m, model_stream(t));
}

static void model_op_release(model_thread *t) {
  model_buf *m = model_pick_buf(t);
  if (m && m->dev) model_release(t, m, model_stream(t));
}

/* What a kernel does: write an acquired buffer through its device pointer. */
static void model_op_device_write(model_thread *t) {
  model_buf *m = model_pick_buf(t);
  if (!m || !m->dev) return;
  size_t off, n;
  model_range(t, m->size, &off, &n);
  model_fill_random(t, m->dev + off, n);
  memcpy(m->shadow + off, m->dev + off, n);
  memset(m->known + off, 1, n);
  t->res.n_device_writes++;
}

static void model_op_evict(model_thread *t) {
  model_buf *m = model_pick_buf(t);
  if (!m) return;
  sgm_tier to = sgm_test_rng_range(&t->rng, 0, 1) ? SGM_TIER_DISK : SGM_TIER_SHARED;
  sgm_status rc = sgm_buffer_evict(m->b, to);
  if (m->dev) {
    if (rc != SGM_ERR_BUSY) model_fail(t, "evicting an acquired buffer answered %s", sgm_status_string(rc));
    return;
  }
  if (rc == SGM_OK) {
    /* Other threads may push it further down meanwhile, never up. */
    sgm_tier now = sgm_buffer_tier(m->b);
    if ((int)now < (int)to) model_fail(t, "evicted to %s, found in %s", sgm_tier_name(to), sgm_tier_name(now));
  } else if (rc != SGM_ERR_INVALID && !model_allowed_refusal(t, rc)) {
    model_fail(t, "sgm_buffer_evict(%s): %s", sgm_tier_name(to), sgm_status_string(rc));
  }
}

static void model_op_prefetch(model_thread *t) {
  model_buf *m = model_pick_buf(t);
  if (!m) return;
  sgm_status rc = sgm_buffer_prefetch(m->b, model_stream(t));
  if (rc == SGM_OK)
    m->prefetched = true;
  else if (!(rc == SGM_ERR_BUSY && m->dev) && !model_allowed_refusal(t, rc))
    model_fail(t, "sgm_buffer_prefetch: %s", sgm_status_string(rc));
}

static void model_op_priority(model_thread *t) {
  model_buf *m = model_pick_buf(t);
  if (!m) return;
  if (sgm_test_rng_range(&t->rng, 0, 4) == 0) {
    int bad = sgm_test_rng_range(&t->rng, 0, 1) ? -1 : SGM_PRIORITY_MAXIMUM + 1;
    sgm_status rc = sgm_buffer_set_priority(m->b, bad);
    if (rc != SGM_ERR_INVALID) model_fail(t, "priority %d answered %s", bad, sgm_status_string(rc));
    return;
  }
  int pr = (int)sgm_test_rng_range(&t->rng, SGM_PRIORITY_MINIMUM, SGM_PRIORITY_MAXIMUM);
  sgm_status rc = sgm_buffer_set_priority(m->b, pr);
  if (rc != SGM_OK) model_fail(t, "sgm_buffer_set_priority(%d): %s", pr, sgm_status_string(rc));
}

static void model_destroy_at(model_thread *t, int k, bool verify) {
  model_buf *m = &t->bufs[k];
  if (m->dev) {
    model_buf_matches(t, m, 0, m->dev, m->size, "through the device pointer before destroy");
    model_release(t, m, NULL);
  } else if (verify) {
    sgm_status rc = sgm_buffer_read(m->b, 0, t->scratch, m->size);
    if (rc == SGM_OK)
      model_buf_matches(t, m, 0, t->scratch, m->size, "whole read before destroy");
    else if (!model_allowed_refusal(t, rc))
      model_fail(t, "sgm_buffer_read of the whole buffer: %s", sgm_status_string(rc));
  }
  sgm_buffer_destroy(m->b);
  free(m->shadow);
  free(m->known);
  t->bufs[k] = t->bufs[--t->n_bufs];
}

static void model_op_destroy(model_thread *t) {
  if (t->n_bufs == 0) return;
  model_destroy_at(t, (int)sgm_test_rng_range(&t->rng, 0, (uint64_t)t->n_bufs - 1), true);
}

static void model_check_stats_bounds(model_thread *t, const sgm_stats *st) {
  for (int k = 0; k < SGM_TIER_COUNT; k++) {
    const sgm_tier_stats *s = &st->tier[k];
    if (s->used_bytes > s->budget_bytes)
      model_fail(t, "tier %s: used %llu > budget %llu", sgm_tier_name((sgm_tier)k),
                 (unsigned long long)s->used_bytes, (unsigned long long)s->budget_bytes);
    if (s->peak_used_bytes < s->used_bytes)
      model_fail(t, "tier %s: peak %llu < used %llu", sgm_tier_name((sgm_tier)k),
                 (unsigned long long)s->peak_used_bytes, (unsigned long long)s->used_bytes);
  }
}

static void model_op_stats(model_thread *t) {
  sgm_stats st;
  sgm_status rc = sgm_get_stats(t->sh->ctx, &st);
  if (rc != SGM_OK) {
    model_fail(t, "sgm_get_stats: %s", sgm_status_string(rc));
    return;
  }
  model_check_stats_bounds(t, &st);
}

static void model_op_json(model_thread *t) {
  char *js = NULL;
  sgm_status rc = sgm_stats_json(t->sh->ctx, &js);
  if (rc != SGM_OK || !js) {
    model_fail(t, "sgm_stats_json: %s", sgm_status_string(rc));
    return;
  }
  size_t n = strlen(js);
  if (n < 2 || js[0] != '{' || js[n - 1] != '}') model_fail(t, "sgm_stats_json is not one object");
  sgm_string_free(js);
}

static void model_op_trim(model_thread *t) {
  sgm_status rc = sgm_trim(t->sh->ctx);
  if (rc != SGM_OK) model_fail(t, "sgm_trim: %s", sgm_status_string(rc));
}

static void model_step(model_thread *t) {
  uint64_t r = sgm_test_rng_range(&t->rng, 0, 99);
  if (r < 16) model_op_alloc(t);
  else if (r < 29) model_op_free(t);
  else if (r < 31) model_op_foreign_free(t);
  else if (r < 40) model_op_create(t);
  else if (r < 48) model_op_write(t);
  else if (r < 56) model_op_read(t);
  else if (r < 66) model_op_acquire(t);
  else if (r < 75) model_op_release(t);
  else if (r < 80) model_op_evict(t);
  else if (r < 84) model_op_prefetch(t);
  else if (r < 86) model_op_priority(t);
  else if (r < 91) model_op_destroy(t);
  else if (r < 92) model_op_trim(t);
  else if (r < 94) model_op_stats(t);
  else if (r < 95) model_op_json(t);
  else if (r < 98) model_op_device_write(t);
  else model_op_alloc_write(t);
  t->op++;
}

/* ---- checkpoints (thread 0, every other thread at the barrier) ---- */

static uint64_t model_round(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

static void model_checkpoint(model_thread *t0) {
  model_shared *sh = t0->sh;
  uint64_t used[SGM_TIER_COUNT] = {0}, live[SGM_TIER_COUNT] = {0};
  /* First let every prefetch land (acquire waits for it): a prefetch in
   * flight moves its buffer and may evict others while the model counts. */
  for (int k = 0; k < sh->p->n_threads; k++) {
    model_thread *t = &sh->th[k];
    for (int i = 0; i < t->n_bufs; i++) {
      model_buf *m = &t->bufs[i];
      if (m->prefetched && !m->dev) {
        model_acquire(t0, m, NULL);
        if (m->dev) model_release(t0, m, NULL);
      }
      m->prefetched = false;
    }
  }
  for (int k = 0; k < sh->p->n_threads; k++) {
    model_thread *t = &sh->th[k];
    for (int i = 0; i < t->n_allocs; i++) {
      model_alloc_intact(t0, &t->allocs[i], "at a checkpoint");
      sgm_tier tier = sgm_pointer_tier(sh->ctx, t->allocs[i].p);
      if (tier != SGM_TIER_VRAM && tier != SGM_TIER_SHARED) {
        model_fail(t0, "a live allocation reports tier %s at a checkpoint", sgm_tier_name(tier));
        continue;
      }
      bool movable = sh->p->managed && t->allocs[i].size >= SGM_MANAGED_MOVABLE_BYTES;
      used[tier] += model_round(t->allocs[i].size, movable ? MODEL_MANAGED_PAGE : MODEL_ALIGN);
      live[tier]++;
    }
    for (int i = 0; i < t->n_bufs; i++) {
      model_buf *m = &t->bufs[i];
      if (m->dev) model_buf_matches(t0, m, 0, m->dev, m->size, "through the device pointer at a checkpoint");
      sgm_tier tier = sgm_buffer_tier(m->b);
      if (tier < 0 || tier >= SGM_TIER_COUNT) {
        model_fail(t0, "a live buffer reports tier %s", sgm_tier_name(tier));
        continue;
      }
      used[tier] += model_round(m->size, tier == SGM_TIER_DISK ? MODEL_DISK_ALIGN : MODEL_ALIGN);
      live[tier]++;
    }
  }
  sgm_stats st;
  if (sgm_get_stats(sh->ctx, &st) != SGM_OK) {
    model_fail(t0, "sgm_get_stats at a checkpoint");
    return;
  }
  model_check_stats_bounds(t0, &st);
  for (int k = 0; k < SGM_TIER_COUNT; k++) {
    if (st.tier[k].used_bytes != used[k] || st.tier[k].n_live != live[k])
      model_fail(t0, "checkpoint %llu: tier %s holds %llu bytes in %llu objects, the model %llu in %llu",
                 (unsigned long long)sh->n_checkpoints, sgm_tier_name((sgm_tier)k),
                 (unsigned long long)st.tier[k].used_bytes, (unsigned long long)st.tier[k].n_live,
                 (unsigned long long)used[k], (unsigned long long)live[k]);
  }
  sh->n_checkpoints++;
}

/* ---- threads ---- */

static void *model_thread_main(void *arg) {
  model_thread *t = arg;
  model_shared *sh = t->sh;
  uint64_t per = sh->p->ops_per_checkpoint;
  uint64_t n_phases = (sh->p->n_ops + per - 1) / per;
  for (uint64_t ph = 0; ph < n_phases; ph++) {
    for (uint64_t i = 0; i < per && t->op < sh->p->n_ops && !model_failed(t); i++) model_step(t);
    pthread_barrier_wait(&sh->bar);
    if (t->index == 0 && !model_failed(t)) {
      model_checkpoint(t);
      if (sh->p->checkpoint) sh->p->checkpoint(sh->p->checkpoint_user, t->op, sh->ctx);
    }
    pthread_barrier_wait(&sh->bar);
  }
  /* Tear down: everything is checked once more, then freed. */
  while (t->n_bufs) model_destroy_at(t, t->n_bufs - 1, !model_failed(t));
  while (t->n_allocs) model_free_at(t, t->n_allocs - 1);
  return NULL;
}

int model_run(const model_params *p_in, model_result *out, char *err, size_t err_len) {
  memset(out, 0, sizeof *out);
  model_params p = *p_in;
  if (p.n_threads < 1 || p.n_threads > MODEL_MAX_THREADS || !p.spill_dir) {
    snprintf(err, err_len, "model_run: bad parameters");
    return -1;
  }
  if (!p.ops_per_checkpoint) p.ops_per_checkpoint = 500;
  if (!p.vram_bytes) p.vram_bytes = UINT64_C(2) << 20;
  if (!p.shared_bytes) p.shared_bytes = UINT64_C(4) << 20;
  if (!p.max_object_bytes) p.max_object_bytes = UINT64_C(256) << 10;
  if (p.managed) {
    /* Room for a few movable blocks (2-4 MiB) beside the small ones, and
     * little enough that new ones demote the others. */
    if (p.vram_bytes < (UINT64_C(10) << 20)) p.vram_bytes = UINT64_C(10) << 20;
    if (p.shared_bytes < (UINT64_C(24) << 20)) p.shared_bytes = UINT64_C(24) << 20;
  }

  model_shared *sh = calloc(1, sizeof *sh);
  if (!sh) abort();
  sh->p = &p;
  pthread_mutex_init(&sh->mu, NULL);
  pthread_barrier_init(&sh->bar, NULL, (unsigned)p.n_threads);

  sgm_config cfg;
  sgm_config_init(&cfg);
  cfg.backend = SGM_BACKEND_EMU;
  cfg.verbose = 0;
  cfg.emu_vram_bytes = UINT64_C(64) << 20;
  cfg.vram_limit = (sgm_size){.bytes = p.vram_bytes};
  cfg.shared_limit = (sgm_size){.bytes = p.shared_bytes};
  snprintf(cfg.spill_dir, sizeof cfg.spill_dir, "%s", p.spill_dir);
  cfg.spill_limit = (sgm_size){.bytes = UINT64_C(256) << 20};
  cfg.idle_trim_ms = p.idle_trim_ms;
  if (p.managed) {
    cfg.pointers = SGM_POINTERS_MANAGED;
    cfg.emu_managed = 1;
  }
  int rc = -1;
  if (sgm_context_create(&cfg, &sh->ctx) != SGM_OK) {
    snprintf(err, err_len, "sgm_context_create: %s", sgm_last_error());
    goto out;
  }
  pthread_t tid[MODEL_MAX_THREADS];
  for (int k = 0; k < p.n_threads; k++) {
    model_thread *t = &sh->th[k];
    t->sh = sh;
    t->index = k;
    sgm_test_rng_init(&t->rng, p.seed + (uint64_t)k);
    t->scratch = malloc(p.max_object_bytes);
    if (!t->scratch) abort();
  }
  for (int k = 1; k < p.n_threads; k++) pthread_create(&tid[k], NULL, model_thread_main, &sh->th[k]);
  model_thread_main(&sh->th[0]);
  for (int k = 1; k < p.n_threads; k++) pthread_join(tid[k], NULL);

  if (!atomic_load(&sh->failed)) {
    sgm_stats st;
    if (sgm_get_stats(sh->ctx, &st) != SGM_OK) model_fail(&sh->th[0], "sgm_get_stats at the end");
    for (int k = 0; k < SGM_TIER_COUNT && !atomic_load(&sh->failed); k++)
      if (st.tier[k].used_bytes || st.tier[k].n_live)
        model_fail(&sh->th[0], "everything freed, yet tier %s holds %llu bytes in %llu objects",
                   sgm_tier_name((sgm_tier)k), (unsigned long long)st.tier[k].used_bytes,
                   (unsigned long long)st.tier[k].n_live);
    if (!atomic_load(&sh->failed) && sgm_trim(sh->ctx) != SGM_OK) model_fail(&sh->th[0], "final sgm_trim");
  }
  for (int k = 0; k < p.n_threads; k++) {
    model_thread *t = &sh->th[k];
    out->n_ops += t->op;
    out->n_nomem += t->res.n_nomem;
    out->n_io += t->res.n_io;
    out->n_device_writes += t->res.n_device_writes;
    out->n_alloc_writes += t->res.n_alloc_writes;
    out->n_movable += t->res.n_movable;
    for (int i = 0; i < SGM_TIER_COUNT; i++) out->n_tier_seen[i] += t->res.n_tier_seen[i];
    free(t->scratch);
  }
  out->n_checkpoints = sh->n_checkpoints;
  sgm_context_destroy(sh->ctx);
  if (atomic_load(&sh->failed)) {
    snprintf(err, err_len, "%s", sh->err);
    goto out;
  }
  rc = 0;
out:
  free(sh->spans);
  pthread_barrier_destroy(&sh->bar);
  pthread_mutex_destroy(&sh->mu);
  free(sh);
  return rc;
}
