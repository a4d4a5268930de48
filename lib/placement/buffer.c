/*
 * buffer.c — the public movable-buffer API (sgm_buffer_*): argument checks,
 * create and destroy, and the order of steps of each call.
 *
 * A public call takes the buffer (buffer_state.c: waits, asleep on the
 * buffer's own state word, while another thread owns it BUSY; then one
 * compare-and-swap makes it BUSY and, under its tier's residency lock, takes
 * it out of its policy), lets residency.c or migrate.c do the work with no
 * lock held, and gives it back (sgm__buffer_finish, under the residency lock
 * of the tier it is in then). Nothing here decides a tier or moves data; no
 * call takes a lock shared by every buffer but create and destroy (pl->lock:
 * the list of all buffers, the graveyard).
 *
 * Threading: every call is safe from any thread; a buffer is used by one
 * thread at a time, but a prefetch or an eviction for another allocation may
 * own it briefly — callers then wait for it. Calls: buffer_state.c,
 * residency.c, migrate.c, the tier pools (to free) and the backend's event
 * record, query and destroy (no sgm lock held).
 */
#include <stdlib.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

/* Free b's block in VRAM or shared memory. While the work queued before its
 * release may still use it (b->event not seen complete), the block is freed
 * the stream-ordered way on the release's stream (sgm__tier_free_own_on): that
 * stream's later work may reuse it at once, any other only through a fence,
 * and no trim unmaps or unpins it before that work is done (issue 24). A
 * per-thread default stream is named by the legacy stream, which follows the
 * earlier work of every blocking stream (the destroying thread may not be the
 * releasing one). */
static void buffer_free_block(sgm_context *ctx, sgm_buffer *b) {
  sgm_tier_pool *pool = sgm__parts_tier(ctx, b->tier);
  const sgm_backend_ops *o = sgm__parts_bops(ctx);
  uint64_t sz;
  if (b->event && o->event_query(sgm__parts_be(ctx), b->event) != 1) {
    void *s = b->event_stream == SGM_STREAM_PER_THREAD ? NULL : b->event_stream;
    sgm_stream_ref ref;
    o->stream_ref(sgm__parts_be(ctx), s, &ref);
    if (sgm__tier_free_own_on(pool, b->dptr, &ref) == SGM_OK) return;
    /* No room to remember the stream: wait for the work, then free. */
    if (o->event_wait(sgm__parts_be(ctx), b->event) != SGM_OK)
      sgm__log(sgm__parts_cfg(ctx)->verbose, 1, "sgm_buffer_destroy: waiting for the work queued "
               "before the release failed (%s); the block is freed anyway", sgm_last_error());
  }
  sgm__tier_free(pool, b->dptr, &sz);
}

void sgm__buffer_free_storage(sgm_context *ctx, sgm_buffer *b) {
  if (b->managed) {
    sgm__parts_bops(ctx)->managed_free(sgm__parts_be(ctx), b->dptr, b->size);
    sgm__tier_uncharge(sgm__parts_tier(ctx, b->tier), b->size);
  } else if (b->tier == SGM_TIER_DISK) {
    sgm__migrate_disk_drop(ctx, b);
  } else {
    buffer_free_block(ctx, b);
  }
  if (b->event) sgm__parts_bops(ctx)->event_destroy(sgm__parts_be(ctx), b->event);
}

#define BUF_CHECK(b, what)                                   \
  do {                                                       \
    int check_rc_ = sgm__buffer_check((b), what);            \
    if (check_rc_ != SGM_OK) return (sgm_status)check_rc_;   \
  } while (0)

/* Poison a destroyed buffer and keep its memory until 16 more were destroyed
 * (every build: destroy is off the hot path and takes pl->lock anyway), so a
 * second destroy (or any use) finds SGM_BUFFER_DEAD instead of reading freed
 * memory. Returns what may be freed now. */
static sgm_buffer *buffer_bury(struct sgm_placement *pl, sgm_buffer *b) {
  b->magic = SGM_BUFFER_DEAD;
  sgm__lock_take(&pl->lock);
  unsigned slot = pl->n_graveyard++ % (unsigned)(sizeof pl->graveyard / sizeof pl->graveyard[0]);
  sgm_buffer *old = pl->graveyard[slot];
  pl->graveyard[slot] = b;
  sgm__lock_drop(&pl->lock);
  return old;
}

SGM_API sgm_status sgm_buffer_create(sgm_context *ctx, size_t size, sgm_buffer **out) {
  if (!out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: out is NULL");
  *out = NULL;
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: context is NULL");
  if (sgm__parts_forked(ctx)) return (sgm_status)sgm__parts_fork_error(ctx, "sgm_buffer_create");
  if (size == 0)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: size is 0 (ask for at least one byte)");
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm_buffer *b = calloc(1, pl->state_offset + pl->state_bytes);
  if (!b) return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "out of host memory for a buffer");
  b->ctx = ctx;
  b->size = size;
  b->magic = SGM_BUFFER_LIVE;
  b->priority = SGM_PRIORITY_NORMAL;
  b->listed_in = SGM_N_RESIDENT;
  b->item.size_bytes = size;
  b->item.priority = SGM_PRIORITY_NORMAL;
  b->item.state = pl->state_bytes ? (char *)b + pl->state_offset : NULL;
  /* The id first: the VRAM policy may be asked to admit b. */
  b->item.id = __atomic_add_fetch(&pl->next_id, 1, __ATOMIC_RELAXED);
  int rc = sgm__residency_place_buffer(ctx, b);
  if (rc != SGM_OK) {
    free(b);
    return (sgm_status)rc;
  }
  __atomic_add_fetch(&pl->n_buffers, 1, __ATOMIC_RELAXED);
  /* Listed and in the list of all buffers at once (the invariant walk holds
   * both locks): RELEASED and fresh, created and not yet used. */
  sgm__lock_take(&pl->lock);
  sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false);
  b->all_next = pl->all;
  if (pl->all) pl->all->all_prev = b;
  pl->all = b;
  sgm__lock_drop(&pl->lock);
  *out = b;
  return SGM_OK;
}

SGM_API sgm_status sgm_buffer_acquire(sgm_buffer *b, void *stream, void **device_ptr) {
  if (!device_ptr) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_acquire: device_ptr is NULL");
  *device_ptr = NULL;
  BUF_CHECK(b, "sgm_buffer_acquire");
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  /* Recorded before anything moves; not for an acquire that finds b acquired. */
  if (sgm__buffer_state(b) != SGM_BUF_ACQUIRED) sgm__residency_record(pl, b);
  /* Fast path: resident in VRAM already, nothing pending on it, straight to
   * ACQUIRED under the VRAM residency lock. */
  bool fast = false;
  if (sgm__buffer_claim(pl, b, SGM_TAKE_USE, 1u << SGM_BUF_RELEASED, SGM_CLAIM_WAIT | SGM_CLAIM_FAST_VRAM,
                        &fast) != SGM_BUF_RELEASED)
    return (sgm_status)sgm__error_set(SGM_ERR_BUSY, "sgm_buffer_acquire: the buffer is acquired (release it first)");
  if (fast) {
    *device_ptr = (void *)(uintptr_t)b->dptr;
    return SGM_OK;
  }
  /* Moving copies follow the release's work on the device (migrate.c); a
   * buffer that stays where it is gets that order for `stream` here. */
  int rc = sgm__residency_make_resident(ctx, b);
  if (rc == SGM_OK) rc = sgm__migrate_order_use(ctx, &b->event, b->event_stream, stream);
  sgm__buffer_finish(pl, b, rc == SGM_OK ? SGM_BUF_ACQUIRED : SGM_BUF_RELEASED, false);
  if (rc != SGM_OK) return (sgm_status)rc;
  *device_ptr = (void *)(uintptr_t)b->dptr;
  return SGM_OK;
}

SGM_API sgm_status sgm_buffer_release(sgm_buffer *b, void *stream) {
  BUF_CHECK(b, "sgm_buffer_release");
  sgm_context *ctx = b->ctx;
  /* An atomic read: another thread may be moving a buffer that is not
   * acquired (a misuse this call reports, not a race it joins). */
  if (sgm__buffer_state(b) != SGM_BUF_ACQUIRED)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_release: the buffer is not acquired");
  void *ev = NULL;
  int rc = sgm__parts_bops(ctx)->event_record(sgm__parts_be(ctx), stream, &ev);
  if (rc != SGM_OK) return (sgm_status)rc; /* stays acquired: nothing may move it */
  if (sgm__parts_bops(ctx)->event_query(sgm__parts_be(ctx), ev) == 1) {
    sgm__parts_bops(ctx)->event_destroy(sgm__parts_be(ctx), ev);
    ev = NULL;
  }
  /* Taken (a host read or write of the acquired buffer may own it a moment)
   * and given back RELEASED, listed in its tier: acquired buffers are always
   * resident. */
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (sgm__buffer_claim(pl, b, SGM_TAKE_USE, 1u << SGM_BUF_ACQUIRED, SGM_CLAIM_WAIT, NULL) != SGM_BUF_ACQUIRED) {
    if (ev) sgm__parts_bops(ctx)->event_destroy(sgm__parts_be(ctx), ev);
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_release: the buffer is not acquired");
  }
  b->event = ev;
  b->event_stream = stream;
  sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, true);
  return SGM_OK;
}

static int buffer_bounds(const sgm_buffer *b, size_t offset, const void *p, size_t n, const char *fn) {
  int rc = sgm__buffer_check(b, fn);
  if (rc != SGM_OK) return rc;
  if (!p && n) return sgm__error_set(SGM_ERR_INVALID, "%s: host pointer is NULL", fn);
  if (offset > b->size || n > b->size - offset)
    return sgm__error_set(SGM_ERR_INVALID, "%s: offset %zu + %zu bytes is past the buffer's %llu bytes",
                          fn, offset, n, (unsigned long long)b->size);
  return SGM_OK;
}

/* Copy between host memory and b's data. write: host → buffer. */
static int buffer_io(sgm_buffer *b, size_t offset, void *host, size_t n, bool write) {
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (n == 0) return SGM_OK;
  sgm_buf_state was = sgm__buffer_take(pl, b, SGM_TAKE_USE);
  bool was_fresh = b->fresh; /* taking does not change it; giving back may */
  int rc = sgm__migrate_host_io(ctx, b, offset, host, n, write);
  sgm__buffer_finish(pl, b, was, !was_fresh); /* an upload into a fresh buffer is no use */
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
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  /* GPU work queued before the release may still run: the demotion's copies
   * follow it (migrate.c). */
  if (sgm__buffer_claim(pl, b, SGM_TAKE_MOVE, 1u << SGM_BUF_RELEASED, SGM_CLAIM_WAIT, NULL) != SGM_BUF_RELEASED)
    return (sgm_status)sgm__error_set(SGM_ERR_BUSY, "sgm_buffer_evict: the buffer is acquired (release it first)");
  int rc = b->tier < to ? sgm__migrate_demote(ctx, b, to, false) : SGM_OK;
  sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false);
  return (sgm_status)rc;
}

SGM_API sgm_status sgm_buffer_set_priority(sgm_buffer *b, sgm_priority priority) {
  BUF_CHECK(b, "sgm_buffer_set_priority");
  /* Compared as an int: a C caller may pass any value. */
  if ((int)priority < SGM_PRIORITY_MINIMUM || (int)priority > SGM_PRIORITY_MAXIMUM)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_set_priority: %d is not a "
                                      "priority (SGM_PRIORITY_MINIMUM 0 .. SGM_PRIORITY_MAXIMUM 4)",
                                      (int)priority);
  struct sgm_placement *pl = sgm__parts_pl(b->ctx);
  /* A listed buffer moves to its new level at once (as new there), under
   * its tier's lock; any other is taken a moment so that whoever lists it
   * next reads the new level (a pinned one moves when its pin ends:
   * sgm__residency_put sees the levels differ). */
  for (;;) {
    uint32_t w = __atomic_load_n(&b->state, __ATOMIC_SEQ_CST);
    sgm_buf_state s = (sgm_buf_state)(w & SGM_BUF_STATE_MASK);
    if (s == SGM_BUF_BUSY) {
      sgm__buffer_wait_busy(pl, b, NULL);
      continue;
    }
    sgm_tier t = __atomic_load_n(&b->tier, __ATOMIC_RELAXED);
    if (s == SGM_BUF_RELEASED && t < SGM_N_RESIDENT) {
      sgm_lock *l = sgm__residency_lock(pl, t);
      sgm__lock_take(l);
      bool still = __atomic_load_n(&b->state, __ATOMIC_SEQ_CST) == w; /* so listed in t */
      if (still) {
        __atomic_store_n(&b->priority, (int)priority, __ATOMIC_RELAXED);
        if (b->item.priority != (int)priority) {
          bool fresh = b->fresh;
          sgm__residency_take(pl, b, SGM_POLICY_REMOVE_DROP);
          sgm__residency_put(pl, b, false);
          b->fresh = fresh;
        }
      }
      sgm__lock_drop(l);
      if (still) return SGM_OK;
      continue;
    }
    if (__atomic_compare_exchange_n(&b->state, &w, ((w & SGM_BUF_GEN_MASK) + SGM_BUF_GEN_ONE) | SGM_BUF_BUSY,
                                    false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
      __atomic_store_n(&b->priority, (int)priority, __ATOMIC_RELAXED);
      sgm__buffer_set_state(b, s);
      return SGM_OK;
    }
  }
}

SGM_API sgm_tier sgm_buffer_tier(const sgm_buffer *b) {
  if (sgm__buffer_check(b, "sgm_buffer_tier") != SGM_OK) return SGM_TIER_NONE;
  return __atomic_load_n(&b->tier, __ATOMIC_RELAXED); /* see sgm__buffer_set_tier */
}

SGM_API size_t sgm_buffer_size(const sgm_buffer *b) { return b ? (size_t)b->size : 0; }

SGM_API void sgm_buffer_destroy(sgm_buffer *b) {
  if (!b) return;
  /* Destroying twice would free freed memory: every build recognises a handle
   * still in the graveyard and refuses it with a message (issue 29: a library
   * linked into frameworks must not crash them for it). */
  if (sgm__buffer_check(b, "sgm_buffer_destroy") != SGM_OK) return;
  sgm_context *ctx = b->ctx;
  /* A child's copy of its parent's buffer: nothing here is the child's to
   * free (sgm_context_destroy explains); it goes with the child's exit. */
  if (sgm__parts_forked(ctx)) return;
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm__buffer_take(pl, b, SGM_TAKE_FREE);
  if (b->hparent || b->hchild) sgm__hints_forget(pl, b);
  sgm__lock_take(&pl->lock);
  if (b->all_prev) b->all_prev->all_next = b->all_next;
  else pl->all = b->all_next;
  if (b->all_next) b->all_next->all_prev = b->all_prev;
  sgm__lock_drop(&pl->lock);
  if (b->tier == SGM_TIER_DISK) __atomic_sub_fetch(&pl->n_disk_live, 1, __ATOMIC_RELAXED);
  sgm__buffer_free_storage(ctx, b);
  __atomic_sub_fetch(&pl->n_buffers, 1, __ATOMIC_RELAXED);
  free(buffer_bury(pl, b));
}
