/*
 * prefetch.c — sgm_buffer_prefetch: a queue of released buffers to bring up
 * toward VRAM, and the worker thread that does it.
 *
 * Invariant: b->prefetch_queued exactly when b is in the queue; a buffer that
 * is acquired, evicted or destroyed meanwhile leaves the queue (the taker
 * cancels it), so the worker only ever moves RELEASED buffers.
 * Threading: one worker per context, started on the first prefetch, stopped
 * at destroy. The queue is guarded by pl->lock; the worker drops the lock
 * while it moves a buffer, which it owns (BUSY) meanwhile.
 */
#include <pthread.h>
#include <string.h>

#include "placement.h"

void sgm__prefetch_cancel_locked(struct sgm_placement *pl, sgm_buffer *b) {
  if (b->pf_prev) b->pf_prev->pf_next = b->pf_next;
  else pl->pf_head = b->pf_next;
  if (b->pf_next) b->pf_next->pf_prev = b->pf_prev;
  else pl->pf_tail = b->pf_prev;
  b->pf_prev = b->pf_next = NULL;
  b->prefetch_queued = false;
}

static void *prefetch_main(void *arg) {
  sgm_context *ctx = arg;
  struct sgm_placement *pl = sgm__context_pl(ctx);
  sgm__lock_take(&pl->lock);
  for (;;) {
    while (!pl->stop && !pl->pf_head) pthread_cond_wait(&pl->work_cond, &pl->lock.mu);
    if (pl->stop) break;
    sgm_buffer *b = pl->pf_head;
    sgm__prefetch_cancel_locked(pl, b);
    if (sgm__buffer_state(b) != SGM_BUF_RELEASED) continue; /* acquired meanwhile: nothing to do */
    sgm__residency_take(pl, b, SGM_POLICY_REMOVE_PIN);
    sgm__buffer_set_state(b, SGM_BUF_BUSY);
    sgm__lock_drop(&pl->lock);
    int rc = sgm__residency_make_resident(ctx, b);
    if (rc != SGM_OK)
      sgm__log(sgm__context_cfg(ctx)->verbose, 2, "prefetch of a %llu-byte buffer failed: %s",
               (unsigned long long)b->size, sgm_last_error());
    sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false); /* a prefetch is no use: stays fresh */
    sgm__lock_take(&pl->lock);
  }
  sgm__lock_drop(&pl->lock);
  return NULL;
}

void sgm__prefetch_stop(struct sgm_placement *pl) {
  if (!pl->worker_started) return;
  sgm__lock_take(&pl->lock);
  pl->stop = true;
  pthread_cond_signal(&pl->work_cond);
  sgm__lock_drop(&pl->lock);
  pthread_join(pl->worker, NULL);
  pl->worker_started = false;
}

SGM_API sgm_status sgm_buffer_prefetch(sgm_buffer *b, void *stream) {
  (void)stream;
  int check = sgm__buffer_check(b, "sgm_buffer_prefetch");
  if (check != SGM_OK) return (sgm_status)check;
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = sgm__context_pl(ctx);
  int rc = SGM_OK;
  sgm__lock_take(&pl->lock);
  if (sgm__buffer_state(b) == SGM_BUF_RELEASED && b->tier != SGM_TIER_VRAM && !b->prefetch_queued) {
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
