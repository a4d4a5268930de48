/*
 * managed_queue.c — the managed move queue: moves of movable blocks that the
 * free, trim and hint paths hand to a worker instead of running them on the
 * caller's thread, and their runs on sgm's copy stream.
 *
 * What is queued (managed.c decides; docs/managed.md): a free or a cold hint
 * moves at most SGM_MANAGED_INLINE_BYTES on the calling thread; the
 * promotions past that bound, and the demotion a cold hint asks for of a
 * block above it, are queued. A demotion that an allocation needs to fit is
 * never queued: it runs inline, bounded by that allocation's own size.
 *
 * Accounting: the target tier's budget is charged with the block's bytes
 * before its move is queued (a queued promotion holds its VRAM room, so
 * nothing else is placed there meanwhile); the move gives the old tier's
 * charge back as any move does (sgm__migrate_managed); a move that does not
 * happen gives the target's back.
 *
 * Ordering: queuing records an event on the block's stream (the last one its
 * user named), so the event stands after the work its user queued before.
 * The run makes the backend's copy stream wait for that event on the device
 * (copy_stream_wait_event: no host wait), then moves the pages on the copy
 * stream; the move is complete when it returns (as every copy).
 *
 * Cancellation: a queued move ends without running when its block is freed,
 * when anything else moves the block first (sgm_prefetch, sgm_advise, a
 * victim search: sgm__migrate_managed drops it, so the newer intent wins),
 * and at context destroy; sgm_trim runs what is queued on its own thread
 * (sgm__managed_queue_drain).
 *
 * Threading: the queue and the counters are guarded by pl->mlock. A run takes
 * its block BUSY (sgm__managed_try_take_locked) while that lock is held and
 * unlinks it, so a block is run once; whoever owns a queued block (a free, a
 * mover) may cancel it under the lock. The worker (prefetch.c's thread) never
 * sleeps on a block's state word: a head that another thread holds BUSY makes
 * it stop and look again later (that owner may free the block).
 *
 * Layer (lib/LAYERS): placement-queue, the floor below the moves: migrate.c
 * drops a block's queued move when it moves the block itself and counts the
 * worker's bytes (sgm__managed_queue_drop, _on_worker), so the run of a
 * queued move is asked of it through pl->ask.managed_move
 * (sgm__migrate_managed_on). Calls down: the state word, the tiers, the
 * backend; waking the worker and promoting after a demotion are asked of the
 * layers above through pl->ask (prefetch_wake, managed_promote), never called.
 */
#include <stdlib.h>

#include "backend/backend.h"
#include "placement.h"
#include "tiers/tier.h"

/* Set on the worker's thread while it runs moves: its bytes are counted apart
 * from those moved on the calling threads. */
static __thread bool mq_on_worker;

bool sgm__managed_queue_on_worker(void) { return mq_on_worker; }

/* Out of the queue (pl->mlock held; b->mqueued). */
static void mq_unlink_locked(struct sgm_placement *pl, sgm_buffer *b) {
  if (b->mq_prev) b->mq_prev->mq_next = b->mq_next;
  else pl->mq_head = b->mq_next;
  if (b->mq_next) b->mq_next->mq_prev = b->mq_prev;
  else pl->mq_tail = b->mq_prev;
  b->mq_prev = b->mq_next = NULL;
  b->mqueued = false;
  __atomic_store_n(&pl->n_mq, pl->n_mq - 1, __ATOMIC_RELAXED);
  pl->mq_bytes -= b->size;
}

int sgm__managed_queue(sgm_context *ctx, sgm_buffer *b, sgm_tier to) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  const sgm_backend_ops *o = sgm__parts_bops(ctx);
  sgm_assert(b->managed && !b->mqueued && to < SGM_N_RESIDENT && to != b->tier);
  sgm_stream_ref ref;
  o->stream_ref(sgm__parts_be(ctx), b->mstream, &ref);
  void *ev = NULL;
  int rc = o->event_create(sgm__parts_be(ctx), &ev);
  if (rc == SGM_OK) rc = o->event_record_on(sgm__parts_be(ctx), ev, &ref);
  if (rc != SGM_OK) goto out_event;
  sgm__lock_take(&pl->mlock);
  b->mqueued = true;
  b->mq_to = to;
  b->mq_event = ev;
  b->mq_next = NULL;
  b->mq_prev = pl->mq_tail;
  if (pl->mq_tail) pl->mq_tail->mq_next = b;
  else pl->mq_head = b;
  pl->mq_tail = b;
  __atomic_store_n(&pl->n_mq, pl->n_mq + 1, __ATOMIC_RELAXED);
  pl->mq_bytes += b->size;
  pl->n_mq_queued++;
  sgm__lock_drop(&pl->mlock);
  return SGM_OK;
out_event:
  if (ev) o->event_destroy(sgm__parts_be(ctx), ev);
  return rc;
}

void sgm__managed_queue_kick(sgm_context *ctx) {
  if (sgm__parts_pl(ctx)->ask.prefetch_wake(ctx) == SGM_OK) return;
  /* No worker thread: the moves run here, still on the copy stream. */
  sgm__log(sgm__parts_cfg(ctx)->verbose, 1, "%s; running the queued managed moves on the calling thread",
           sgm_last_error());
  sgm__error_clear();
  sgm__managed_queue_drain(ctx);
}

void sgm__managed_queue_cancel_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_mq_undo *undo) {
  undo->tier = SGM_TIER_NONE;
  undo->bytes = 0;
  undo->event = NULL;
  if (!b->mqueued) return;
  mq_unlink_locked(pl, b);
  undo->tier = b->mq_to;
  undo->bytes = b->size;
  undo->event = b->mq_event;
  b->mq_event = NULL;
  pl->n_mq_cancelled++;
  pthread_cond_broadcast(&pl->mq_cond);
}

void sgm__managed_queue_undo(sgm_context *ctx, const sgm_mq_undo *undo) {
  if (undo->tier != SGM_TIER_NONE) sgm__tier_uncharge(sgm__parts_tier(ctx, undo->tier), undo->bytes);
  if (undo->event) sgm__parts_bops(ctx)->event_destroy(sgm__parts_be(ctx), undo->event);
}

void sgm__managed_queue_drop(sgm_context *ctx, sgm_buffer *b) {
  if (!b->mqueued) return; /* only b's owner changes it */
  sgm_mq_undo undo;
  sgm__lock_take(&sgm__parts_pl(ctx)->mlock);
  sgm__managed_queue_cancel_locked(sgm__parts_pl(ctx), b, &undo);
  sgm__lock_drop(&sgm__parts_pl(ctx)->mlock);
  sgm__managed_queue_undo(ctx, &undo);
}

/* Run b's queued move to `to` (b BUSY, taken and unlinked by this thread;
 * `to` charged): after ev on the copy stream. */
static void mq_run(sgm_context *ctx, sgm_buffer *b, sgm_tier to, void *ev) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  const sgm_backend_ops *o = sgm__parts_bops(ctx);
  int rc = SGM_OK;
  bool moved = false;
  if (b->tier != to) { /* else a mover got there first: nothing to do */
    rc = o->copy_stream_wait_event ? o->copy_stream_wait_event(sgm__parts_be(ctx), ev)
                                   : o->event_wait(sgm__parts_be(ctx), ev);
    if (rc == SGM_OK) rc = pl->ask.managed_move(ctx, b, to, false, NULL);
    moved = rc == SGM_OK;
  }
  if (!moved) sgm__tier_uncharge(sgm__parts_tier(ctx, to), b->size);
  if (rc != SGM_OK) {
    sgm__log(sgm__parts_cfg(ctx)->verbose, 2, "a queued move of a %llu-byte managed block to %s failed: %s",
             (unsigned long long)b->size, sgm_tier_name(to), sgm_last_error());
    sgm__error_clear();
  }
  o->event_destroy(sgm__parts_be(ctx), ev);
  sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false); /* the owner may free b from here on */
  /* The room a demotion left goes to the most valuable shared-placed blocks
   * (still counted as running: sgm__managed_queue_wait covers them). */
  if (moved && to == SGM_TIER_SHARED) pl->ask.managed_promote(ctx, UINT64_MAX);
  sgm__lock_take(&pl->mlock);
  pl->n_mq_running--;
  if (moved) pl->n_mq_done++;
  else pl->n_mq_cancelled++;
  pthread_cond_broadcast(&pl->mq_cond);
  sgm__lock_drop(&pl->mlock);
}

/* Run queued moves on this thread until the queue is empty (false) or its
 * head is held by another thread (true). */
static bool mq_work(sgm_context *ctx) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  bool stalled = false;
  /* A destroy stops the worker between two moves (the rest are cancelled). */
  while (__atomic_load_n(&pl->n_mq, __ATOMIC_RELAXED) != 0 && !__atomic_load_n(&pl->stop, __ATOMIC_RELAXED)) {
    sgm__lock_take(&pl->mlock);
    sgm_buffer *b = pl->mq_head;
    if (b && sgm__managed_try_take_locked(pl, b, SGM_TAKE_MOVE) == SGM_BUF_BUSY) {
      stalled = true; /* its owner gives it back or cancels the move */
      b = NULL;
    }
    sgm_tier to = SGM_TIER_NONE;
    void *ev = NULL;
    if (b) {
      mq_unlink_locked(pl, b);
      to = b->mq_to;
      ev = b->mq_event;
      b->mq_event = NULL;
      pl->n_mq_running++;
    }
    sgm__lock_drop(&pl->mlock);
    if (!b) break;
    mq_run(ctx, b, to, ev);
  }
  return stalled;
}

bool sgm__managed_queue_work(sgm_context *ctx) {
  mq_on_worker = true;
  bool stalled = mq_work(ctx);
  mq_on_worker = false;
  return stalled;
}

void sgm__managed_queue_drain(sgm_context *ctx) {
  mq_work(ctx);
  sgm__managed_queue_wait(ctx, false);
}

void sgm__managed_queue_wait(sgm_context *ctx, bool queued_too) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm__lock_take(&pl->mlock);
  while (pl->n_mq_running || (queued_too && pl->mq_head)) pthread_cond_wait(&pl->mq_cond, &pl->mlock.mu);
  sgm__lock_drop(&pl->mlock);
}

void sgm__managed_queue_cancel_all(sgm_context *ctx) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  while (__atomic_load_n(&pl->n_mq, __ATOMIC_RELAXED) != 0) {
    sgm_mq_undo undo;
    sgm__lock_take(&pl->mlock);
    sgm__managed_queue_cancel_locked(pl, pl->mq_head, &undo);
    sgm__lock_drop(&pl->mlock);
    sgm__managed_queue_undo(ctx, &undo);
  }
}

void sgm__managed_queue_stats(sgm_context *ctx, sgm_stats *st) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm__lock_take(&pl->mlock);
  st->n_managed_moves_queued = pl->n_mq_queued;
  st->n_managed_moves_done = pl->n_mq_done;
  st->n_managed_moves_cancelled = pl->n_mq_cancelled;
  st->managed_queued_bytes = pl->mq_bytes;
  st->managed_inline_moved_bytes = pl->mq_moved_bytes[0];
  st->managed_worker_moved_bytes = pl->mq_moved_bytes[1];
  sgm__lock_drop(&pl->mlock);
}

/* Taking a managed block for a move or a free: moved here from managed.c
 * (issue 31) so that the queue takes blocks without calling up. */

/* Pending b (BUSY, owned by the list) becomes the caller's: still BUSY,
 * never listed (pl->mlock held). */
static void managed_pending_take_locked(struct sgm_placement *pl, sgm_buffer *b) {
  if (b->mc_prev) b->mc_prev->mc_next = b->mc_next;
  else pl->mpending_head = b->mc_next;
  if (b->mc_next) b->mc_next->mc_prev = b->mc_prev;
  else pl->mpending_tail = b->mc_prev;
  b->mc_prev = b->mc_next = NULL;
  b->mpending = false;
  MANAGED_BUMP(pl->n_mpending, -1);
}

sgm_buf_state sgm__managed_try_take_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k) {
  if (!b->mpending) return sgm__buffer_try_take(pl, b, k);
  managed_pending_take_locked(pl, b);
  return SGM_BUF_RELEASED; /* as if taken from its policy */
}
