/*
 * prefetch.c — sgm_buffer_prefetch: a queue of released buffers to bring up
 * toward VRAM, and the worker thread that does it.
 *
 * Invariant: b->prefetch_queued exactly when b is in the queue; a buffer that
 * is acquired, evicted or destroyed meanwhile leaves the queue (its taker
 * cancels it), so the worker only ever moves RELEASED buffers.
 * Threading: one worker per context, started on the first prefetch, stopped
 * at destroy. pl->pf_lock guards the queue; the worker takes the buffer at
 * the head while it still holds that lock (so a destroy, which cancels under
 * the lock, cannot free it first), taking the residency lock of its tier
 * inside (pf_lock ranks below the residency locks), then drops both and
 * moves the buffer, which it owns (BUSY) meanwhile.
 * The same thread runs the managed move queue (managed_queue.c) when woken
 * for it (pl->mq_wake): one worker per context, one idle loop.
 */
#include <pthread.h>
#include <string.h>

#include "placement.h"

static void prefetch_unlink(struct sgm_placement *pl, sgm_buffer *b) {
  if (b->pf_prev) b->pf_prev->pf_next = b->pf_next;
  else pl->pf_head = b->pf_next;
  if (b->pf_next) b->pf_next->pf_prev = b->pf_prev;
  else pl->pf_tail = b->pf_prev;
  b->pf_prev = b->pf_next = NULL;
  __atomic_store_n(&b->prefetch_queued, false, __ATOMIC_RELEASE);
}

void sgm__prefetch_cancel(struct sgm_placement *pl, sgm_buffer *b) {
  sgm__lock_take(&pl->pf_lock);
  if (b->prefetch_queued) prefetch_unlink(pl, b);
  sgm__lock_drop(&pl->pf_lock);
}

/* Take b (pl->pf_lock held) if it is RELEASED: BUSY, out of its policy with
 * a pin, as any taker. False when another thread has it. */
static bool prefetch_take(struct sgm_placement *pl, sgm_buffer *b) {
  for (;;) {
    uint32_t w = __atomic_load_n(&b->state, __ATOMIC_SEQ_CST);
    if ((w & SGM_BUF_STATE_MASK) != SGM_BUF_RELEASED) return false;
    sgm_tier t = __atomic_load_n(&b->tier, __ATOMIC_RELAXED);
    sgm_lock *l = t < SGM_N_RESIDENT ? sgm__residency_lock(pl, t) : NULL;
    if (l) sgm__lock_take(l);
    bool won = __atomic_compare_exchange_n(&b->state, &w,
                                           ((w & SGM_BUF_GEN_MASK) + SGM_BUF_GEN_ONE) | SGM_BUF_BUSY, false,
                                           __ATOMIC_SEQ_CST, __ATOMIC_RELAXED);
    if (won && l) sgm__residency_take(pl, b, SGM_POLICY_REMOVE_PIN);
    if (l) sgm__lock_drop(l);
    if (won) return true;
  }
}

/* The managed moves queued (managed_queue.c): run them with pf_lock dropped.
 * A queue whose head another thread holds is looked at again in
 * PREFETCH_RETRY_MS, or at the next wake (that thread may free the block,
 * so the worker never sleeps on its state word). */
#define PREFETCH_RETRY_MS 1
static void prefetch_managed(sgm_context *ctx, struct sgm_placement *pl) {
  pl->mq_wake = false;
  sgm__lock_drop(&pl->pf_lock);
  bool stalled = sgm__managed_queue_work(ctx);
  sgm__lock_take(&pl->pf_lock);
  if (!stalled || pl->stop || pl->mq_wake || pl->pf_head) return;
  struct timespec until = sgm__clock_deadline(PREFETCH_RETRY_MS);
  pthread_cond_timedwait(&pl->work_cond, &pl->pf_lock.mu, &until);
  pl->mq_wake = true; /* look again either way */
}

static void *prefetch_main(void *arg) {
  sgm_context *ctx = arg;
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm__lock_take(&pl->pf_lock);
  for (;;) {
    while (!pl->stop && !pl->pf_head && !pl->mq_wake) pthread_cond_wait(&pl->work_cond, &pl->pf_lock.mu);
    if (pl->stop) break;
    if (!pl->pf_head) {
      prefetch_managed(ctx, pl);
      continue;
    }
    sgm_buffer *b = pl->pf_head;
    prefetch_unlink(pl, b);
    bool mine = prefetch_take(pl, b); /* else acquired meanwhile: nothing to do */
    sgm__lock_drop(&pl->pf_lock);
    if (mine) {
      int rc = sgm__residency_make_resident(ctx, b);
      if (rc != SGM_OK)
        sgm__log(sgm__parts_cfg(ctx)->verbose, 2, "prefetch of a %llu-byte buffer failed: %s",
                 (unsigned long long)b->size, sgm_last_error());
      sgm__buffer_finish(pl, b, SGM_BUF_RELEASED, false); /* a prefetch is no use: stays fresh */
    }
    sgm__lock_take(&pl->pf_lock);
  }
  sgm__lock_drop(&pl->pf_lock);
  return NULL;
}

void sgm__prefetch_stop(struct sgm_placement *pl) {
  if (!pl->worker_started) return;
  sgm__lock_take(&pl->pf_lock);
  __atomic_store_n(&pl->stop, true, __ATOMIC_RELAXED); /* the managed queue's runs read it unlocked */
  pthread_cond_signal(&pl->work_cond);
  sgm__lock_drop(&pl->pf_lock);
  pthread_join(pl->worker, NULL);
  pl->worker_started = false;
}

/* Start the worker if it does not run (pl->pf_lock held). */
static int prefetch_start_locked(sgm_context *ctx, struct sgm_placement *pl) {
  if (pl->worker_started) return SGM_OK;
  int e = pthread_create(&pl->worker, NULL, prefetch_main, ctx);
  if (e != 0) return sgm__error_set(SGM_ERR_NOMEM, "cannot start the prefetch thread: %s", strerror(e));
  pl->worker_started = true;
  return SGM_OK;
}

int sgm__prefetch_wake(sgm_context *ctx) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  sgm__lock_take(&pl->pf_lock);
  int rc = pl->stop ? sgm__error_set(SGM_ERR_INVALID, "the context is being destroyed")
                    : prefetch_start_locked(ctx, pl);
  if (rc == SGM_OK) {
    pl->mq_wake = true;
    pthread_cond_signal(&pl->work_cond);
  }
  sgm__lock_drop(&pl->pf_lock);
  return rc;
}

SGM_API sgm_status sgm_buffer_prefetch(sgm_buffer *b, void *stream) {
  (void)stream;
  int check = sgm__buffer_check(b, "sgm_buffer_prefetch");
  if (check != SGM_OK) return (sgm_status)check;
  sgm_context *ctx = b->ctx;
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  int rc = SGM_OK;
  sgm__lock_take(&pl->pf_lock);
  if (sgm__buffer_state(b) == SGM_BUF_RELEASED && __atomic_load_n(&b->tier, __ATOMIC_RELAXED) != SGM_TIER_VRAM &&
      !b->prefetch_queued) {
    rc = prefetch_start_locked(ctx, pl);
    if (rc == SGM_OK) {
      __atomic_store_n(&b->prefetch_queued, true, __ATOMIC_RELEASE);
      b->pf_prev = pl->pf_tail;
      b->pf_next = NULL;
      if (pl->pf_tail) pl->pf_tail->pf_next = b;
      else pl->pf_head = b;
      pl->pf_tail = b;
      pthread_cond_signal(&pl->work_cond);
    }
  }
  sgm__lock_drop(&pl->pf_lock);
  return (sgm_status)rc;
}
