/*
 * buffer.c — the public movable-buffer API (sgm_buffer_*) and the buffer
 * states: RELEASED, ACQUIRED, BUSY (placement.h).
 *
 * A public call takes the buffer (waits while another thread owns it BUSY,
 * then takes it out of its policy), drops the lock, lets residency.c or
 * migrate.c do the work, and gives it back (sgm__buffer_finish). Nothing
 * here decides a tier or moves data.
 *
 * Threading: every call is safe from any thread; a buffer is used by one
 * thread at a time, but a prefetch or an eviction for another allocation may
 * own it briefly — callers then wait for it.
 */
#include <stdlib.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

void sgm__buffer_wait_locked(struct sgm_placement *pl, sgm_buffer *b) {
  while (sgm__buffer_state(b) == SGM_BUF_BUSY) {
    /* The flag is set under the lock the owner needs to change the state,
     * so the owner's change sees it; a change between here and the sleep
     * makes the sleep return at once. */
    __atomic_store_n(&b->state, __atomic_load_n(&b->state, __ATOMIC_RELAXED) | SGM_BUF_WAITERS,
                     __ATOMIC_RELAXED);
    sgm__lock_drop(&pl->lock);
    sgm__word_wait(&b->state, SGM_BUF_BUSY | SGM_BUF_WAITERS);
    __atomic_fetch_add(&pl->n_busy_wakeups, 1, __ATOMIC_RELAXED);
    sgm__lock_take(&pl->lock);
  }
}

sgm_buf_state sgm__buffer_take_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k) {
  sgm__buffer_wait_locked(pl, b);
  sgm_buf_state was = sgm__buffer_state(b);
  if (k == SGM_TAKE_USE) sgm__residency_take_for_use(pl, b);
  else sgm__residency_take(pl, b, k == SGM_TAKE_FREE ? SGM_POLICY_REMOVE_DROP : SGM_POLICY_REMOVE_PIN);
  if (k == SGM_TAKE_FREE) sgm__residency_unpin(pl, b);
  if (b->prefetch_queued) sgm__prefetch_cancel_locked(pl, b);
  sgm__buffer_set_state(b, SGM_BUF_BUSY);
  return was;
}

void sgm__buffer_finish(struct sgm_placement *pl, sgm_buffer *b, sgm_buf_state to, bool used) {
  sgm__lock_take(&pl->lock);
  sgm__buffer_set_state(b, to); /* its waiters run once the lock is dropped */
  if (to == SGM_BUF_RELEASED) {
    if (b->tier < SGM_N_RESIDENT) sgm__residency_put(pl, b, used);
    else sgm__residency_unpin(pl, b);
  }
  sgm__lock_drop(&pl->lock);
}

void sgm__buffer_free_storage(sgm_context *ctx, sgm_buffer *b) {
  uint64_t sz;
  if (b->managed) {
    ctx->bops->managed_free(ctx->be, b->dptr, b->size);
    sgm__tier_uncharge(ctx->tiers[b->tier], b->size);
  } else if (b->tier == SGM_TIER_DISK) {
    sgm__migrate_disk_drop(ctx, b);
  } else {
    sgm__tier_free(ctx->tiers[b->tier], b->dptr, &sz);
  }
  if (b->event) ctx->bops->event_destroy(ctx->be, b->event);
}

bool sgm__buffer_disk_offset(sgm_buffer *b, uint64_t *offset) {
  struct sgm_placement *pl = b->ctx->pl;
  sgm__lock_take(&pl->lock);
  sgm__buffer_wait_locked(pl, b); /* its mover owns ext */
  bool on = b->tier == SGM_TIER_DISK && b->ext && b->ext[0].bytes != 0;
  *offset = on ? b->ext[0].offset : 0;
  sgm__lock_drop(&pl->lock);
  return on;
}

/* Take pl->lock and wait until b is not BUSY; SGM_ERR_BUSY (lock dropped)
 * when it is acquired, else SGM_OK with the lock held and b RELEASED. */
static int buffer_lock_released(struct sgm_placement *pl, sgm_buffer *b, const char *fn) {
  sgm__lock_take(&pl->lock);
  sgm__buffer_wait_locked(pl, b);
  if (sgm__buffer_state(b) != SGM_BUF_ACQUIRED) return SGM_OK;
  sgm__lock_drop(&pl->lock);
  return sgm__error_set(SGM_ERR_BUSY, "%s: the buffer is acquired (release it first)", fn);
}

int sgm__buffer_check(const sgm_buffer *b, const char *fn) {
  if (!b) return sgm__error_set(SGM_ERR_INVALID, "%s: buffer is NULL", fn);
  /* Only debug builds look: there a destroyed buffer's memory is kept a
   * while (the graveyard), so reading it is defined; release builds free it. */
  if (SGM_DEBUG >= 1 && sgm_unlikely(b->magic != SGM_BUFFER_LIVE))
    return sgm__error_set(SGM_ERR_INVALID, "%s: %p is not a live buffer (%s)", fn, (const void *)b,
                          b->magic == SGM_BUFFER_DEAD ? "it was destroyed" : "not from sgm_buffer_create");
  if (sgm__context_forked(b->ctx)) return sgm__context_fork_error(b->ctx, fn);
  return SGM_OK;
}

#define BUF_CHECK(b, what)                                   \
  do {                                                       \
    int check_rc_ = sgm__buffer_check((b), what);            \
    if (check_rc_ != SGM_OK) return (sgm_status)check_rc_;   \
  } while (0)

/* Debug builds: poison a destroyed buffer and keep its memory until 16 more
 * were destroyed, so a second destroy (or any use) finds SGM_BUFFER_DEAD
 * instead of reading freed memory. Returns what may be freed now. */
static sgm_buffer *buffer_bury(struct sgm_placement *pl, sgm_buffer *b) {
  b->magic = SGM_BUFFER_DEAD;
  if (SGM_DEBUG < 1) return b;
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
  if (sgm__context_forked(ctx)) return (sgm_status)sgm__context_fork_error(ctx, "sgm_buffer_create");
  if (size == 0)
    return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_create: size is 0 (ask for at least one byte)");
  struct sgm_placement *pl = ctx->pl;
  sgm_buffer *b = calloc(1, pl->state_offset + pl->state_bytes);
  if (!b) return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "out of host memory for a buffer");
  b->ctx = ctx;
  b->size = size;
  b->magic = SGM_BUFFER_LIVE;
  b->priority = SGM_PRIORITY_NORMAL;
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
  sgm__lock_take(&pl->lock);
  sgm__buffer_set_state(b, SGM_BUF_RELEASED);
  if (b->tier < SGM_N_RESIDENT) sgm__residency_put(pl, b, false); /* fresh: created, not yet used */
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
  struct sgm_placement *pl = ctx->pl;
  int rc = buffer_lock_released(pl, b, "sgm_buffer_acquire");
  if (rc != SGM_OK) return (sgm_status)rc;
  sgm__residency_record(pl, b);
  if (b->tier == SGM_TIER_VRAM && !b->event) {
    /* Fast path: resident in VRAM already, nothing pending on it. */
    sgm__residency_take_for_use(pl, b);
    if (b->prefetch_queued) sgm__prefetch_cancel_locked(pl, b);
    sgm__buffer_set_state(b, SGM_BUF_ACQUIRED);
    sgm__lock_drop(&pl->lock);
    *device_ptr = (void *)(uintptr_t)b->dptr;
    return SGM_OK;
  }
  sgm__buffer_take_locked(pl, b, SGM_TAKE_USE);
  sgm__lock_drop(&pl->lock);
  /* Moving copies follow the release's work on the device (migrate.c); a
   * buffer that stays where it is gets that order for `stream` here. */
  rc = sgm__residency_make_resident(ctx, b);
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
  int rc = ctx->bops->event_record(ctx->be, stream, &ev);
  if (rc != SGM_OK) return (sgm_status)rc; /* stays acquired: nothing may move it */
  if (ctx->bops->event_query(ctx->be, ev) == 1) {
    ctx->bops->event_destroy(ctx->be, ev);
    ev = NULL;
  }
  sgm__lock_take(&ctx->pl->lock);
  b->event = ev;
  b->event_stream = stream;
  sgm__buffer_set_state(b, SGM_BUF_RELEASED);
  sgm__residency_put(ctx->pl, b, true); /* acquired buffers are always resident */
  sgm__lock_drop(&ctx->pl->lock);
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
  struct sgm_placement *pl = ctx->pl;
  if (n == 0) return SGM_OK;
  sgm__lock_take(&pl->lock);
  bool was_fresh = b->fresh;
  sgm_buf_state was = sgm__buffer_take_locked(pl, b, SGM_TAKE_USE);
  sgm__lock_drop(&pl->lock);
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
  struct sgm_placement *pl = ctx->pl;
  int rc = buffer_lock_released(pl, b, "sgm_buffer_evict");
  if (rc != SGM_OK) return (sgm_status)rc;
  /* GPU work queued before the release may still run: the demotion's copies
   * follow it (migrate.c). */
  sgm__buffer_take_locked(pl, b, SGM_TAKE_MOVE);
  sgm__lock_drop(&pl->lock);
  rc = b->tier < to ? sgm__migrate_demote(ctx, b, to, false) : SGM_OK;
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
  struct sgm_placement *pl = b->ctx->pl;
  sgm__lock_take(&pl->lock);
  bool listed = b->listed, fresh = b->fresh;
  /* A listed buffer moves to its new level at once (as new there); a pinned
   * one when its pin ends (sgm__residency_put sees the levels differ). */
  sgm__residency_take(pl, b, SGM_POLICY_REMOVE_DROP);
  b->priority = priority;
  if (listed) {
    sgm__residency_put(pl, b, false);
    b->fresh = fresh;
  }
  sgm__lock_drop(&pl->lock);
  return SGM_OK;
}

SGM_API sgm_tier sgm_buffer_tier(const sgm_buffer *b) {
  if (sgm__buffer_check(b, "sgm_buffer_tier") != SGM_OK) return SGM_TIER_NONE;
  struct sgm_placement *pl = b->ctx->pl;
  sgm__lock_take(&pl->lock);
  sgm_tier t = __atomic_load_n(&b->tier, __ATOMIC_RELAXED); /* see sgm__buffer_set_tier */
  sgm__lock_drop(&pl->lock);
  return t;
}

SGM_API size_t sgm_buffer_size(const sgm_buffer *b) { return b ? (size_t)b->size : 0; }

SGM_API void sgm_buffer_destroy(sgm_buffer *b) {
  if (!b) return;
  /* Destroying twice is a use after free: debug builds recognise it (the
   * graveyard) and stop, as for any broken contract. */
  if (SGM_DEBUG >= 1 && b->magic == SGM_BUFFER_DEAD)
    sgm__assert_fail("sgm_buffer_destroy: this buffer was already destroyed", __FILE__, __LINE__);
  sgm_assert(b->magic == SGM_BUFFER_LIVE);
  sgm_context *ctx = b->ctx;
  /* A child's copy of its parent's buffer: nothing here is the child's to
   * free (sgm_context_destroy explains); it goes with the child's exit. */
  if (sgm__context_forked(ctx)) return;
  struct sgm_placement *pl = ctx->pl;
  sgm__lock_take(&pl->lock);
  sgm__buffer_take_locked(pl, b, SGM_TAKE_FREE);
  if (b->all_prev) b->all_prev->all_next = b->all_next;
  else pl->all = b->all_next;
  if (b->all_next) b->all_next->all_prev = b->all_prev;
  if (b->tier == SGM_TIER_DISK) {
    pl->n_disk_live--;
  }
  sgm__lock_drop(&pl->lock);
  sgm__buffer_free_storage(ctx, b);
  __atomic_sub_fetch(&pl->n_buffers, 1, __ATOMIC_RELAXED);
  free(buffer_bury(pl, b));
}
