/*
 * buffer_state.c — who owns a buffer: the state word (RELEASED, ACQUIRED,
 * BUSY; placement.h) and the calls that take a buffer and give it back.
 *
 * A taker makes b BUSY (or, for an acquire of an idle VRAM buffer, ACQUIRED)
 * by one compare-and-swap on b->state, made under the residency lock of b's
 * tier when b is listed there, with the policy step (unlist, pin) in the same
 * critical section: under that lock a listed buffer is never BUSY. A thread
 * that finds b BUSY sleeps on b's own word (SGM_BUF_WAITERS, a futex), so
 * only b's owner wakes it, when it gives b back (sgm__buffer_finish lists a
 * released resident buffer again, under the lock of the tier it is in then).
 * The word's generation makes "b is still as I saw it" one comparison.
 *
 * Threading: any thread. Locks: the residency lock of one tier at a time
 * (pl->res[t]), briefly, to list or unlist; the prefetch lock to cancel a
 * queued prefetch; a caller's pl->lock only dropped while waiting
 * (sgm__buffer_take_locked). No lock is held while sleeping. Calls: the
 * policy host (residency_host.c), sgm__prefetch_cancel (through pl->ask:
 * prefetch.c is a layer above), the futex wait and
 * wake (lib/prim/lock.c); never the backend.
 */
#include "placement.h"

/* Sleep until b's word is no longer w (b BUSY). held: a lock the caller
 * holds, dropped meanwhile (NULL: none). Announces the sleeper first
 * (SGM_BUF_WAITERS), so the owner's change of this word, and only that,
 * wakes it. */
static void buffer_sleep(struct sgm_placement *pl, sgm_buffer *b, uint32_t w, sgm_lock *held) {
  if (!(w & SGM_BUF_WAITERS) &&
      !__atomic_compare_exchange_n(&b->state, &w, w | SGM_BUF_WAITERS, false, __ATOMIC_SEQ_CST,
                                   __ATOMIC_RELAXED))
    return; /* changed meanwhile: look again */
  if (held) sgm__lock_drop(held);
  sgm__word_wait(&b->state, w | SGM_BUF_WAITERS);
  __atomic_fetch_add(&pl->n_busy_wakeups, 1, __ATOMIC_RELAXED);
  if (held) sgm__lock_take(held);
}

sgm_buf_state sgm__buffer_claim(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k, unsigned accept,
                                unsigned flags, bool *fast) {
  for (;;) {
    uint32_t w = __atomic_load_n(&b->state, __ATOMIC_SEQ_CST);
    sgm_buf_state s = (sgm_buf_state)(w & SGM_BUF_STATE_MASK);
    if (s == SGM_BUF_BUSY && (flags & SGM_CLAIM_WAIT)) {
      buffer_sleep(pl, b, w, (flags & SGM_CLAIM_PL_HELD) ? &pl->lock : NULL);
      continue;
    }
    if (!(accept & (1u << s))) return s;
    /* Valid if the swap below succeeds: only an owner changes the tier. */
    sgm_tier t = __atomic_load_n(&b->tier, __ATOMIC_RELAXED);
    sgm_lock *l = s == SGM_BUF_RELEASED && t < SGM_N_RESIDENT ? sgm__residency_lock(pl, t) : NULL;
    if (l) {
      sgm__lock_take(l);
      /* Still as seen, so listed in t: nobody takes it without l, and its
       * fields (event) are the lock's to read. */
      if (__atomic_load_n(&b->state, __ATOMIC_SEQ_CST) != w) {
        sgm__lock_drop(l);
        continue;
      }
    }
    bool straight = (flags & SGM_CLAIM_FAST_VRAM) && t == SGM_TIER_VRAM && l && !b->event;
    uint32_t to = straight ? SGM_BUF_ACQUIRED : SGM_BUF_BUSY;
    if (!__atomic_compare_exchange_n(&b->state, &w, ((w & SGM_BUF_GEN_MASK) + SGM_BUF_GEN_ONE) | to,
                                     false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
      if (l) sgm__lock_drop(l);
      continue;
    }
    if (l) {
      if (k == SGM_TAKE_USE) sgm__residency_take_for_use(pl, b);
      else sgm__residency_take(pl, b, k == SGM_TAKE_FREE ? SGM_POLICY_REMOVE_DROP : SGM_POLICY_REMOVE_PIN);
      sgm__lock_drop(l);
    }
    if (k == SGM_TAKE_FREE && b->pinned) {
      sgm_lock *pin = sgm__residency_lock(pl, b->pin_tier);
      sgm__lock_take(pin);
      sgm__residency_unpin(pl, b);
      sgm__lock_drop(pin);
    }
    if (__atomic_load_n(&b->prefetch_queued, __ATOMIC_ACQUIRE)) pl->ask.prefetch_cancel(pl, b);
    if (fast) *fast = straight;
    return s;
  }
}

#define BUFFER_CLAIM_ANY ((1u << SGM_BUF_RELEASED) | (1u << SGM_BUF_ACQUIRED))

sgm_buf_state sgm__buffer_take(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k) {
  return sgm__buffer_claim(pl, b, k, BUFFER_CLAIM_ANY, SGM_CLAIM_WAIT, NULL);
}

sgm_buf_state sgm__buffer_take_locked(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k) {
  return sgm__buffer_claim(pl, b, k, BUFFER_CLAIM_ANY, SGM_CLAIM_WAIT | SGM_CLAIM_PL_HELD, NULL);
}

sgm_buf_state sgm__buffer_try_take(struct sgm_placement *pl, sgm_buffer *b, sgm_take_kind k) {
  return sgm__buffer_claim(pl, b, k, BUFFER_CLAIM_ANY, 0, NULL);
}

void sgm__buffer_wait_busy(struct sgm_placement *pl, sgm_buffer *b, sgm_lock *held) {
  uint32_t w = __atomic_load_n(&b->state, __ATOMIC_SEQ_CST);
  if ((w & SGM_BUF_STATE_MASK) == SGM_BUF_BUSY) buffer_sleep(pl, b, w, held);
}

void sgm__buffer_finish(struct sgm_placement *pl, sgm_buffer *b, sgm_buf_state to, bool used) {
  if (to == SGM_BUF_RELEASED) {
    /* A pin held by another tier's policy (b moved) ends under that tier's
     * lock first: one residency lock at a time. */
    if (b->pinned && (b->tier >= SGM_N_RESIDENT || b->pin_tier != b->tier)) {
      sgm_lock *pin = sgm__residency_lock(pl, b->pin_tier);
      sgm__lock_take(pin);
      sgm__residency_unpin(pl, b);
      sgm__lock_drop(pin);
    }
    if (b->tier < SGM_N_RESIDENT) {
      sgm_lock *l = sgm__residency_lock(pl, b->tier);
      sgm__lock_take(l);
      sgm__residency_put(pl, b, used);
      sgm__buffer_set_state(b, to);
      sgm__lock_drop(l);
      return;
    }
  }
  sgm__buffer_set_state(b, to);
}

bool sgm__buffer_disk_offset(sgm_buffer *b, uint64_t *offset) {
  struct sgm_placement *pl = sgm__parts_pl(b->ctx);
  *offset = 0;
  /* Only a buffer on disk is taken (it is listed nowhere): its mover owns ext. */
  for (;;) {
    uint32_t w = __atomic_load_n(&b->state, __ATOMIC_SEQ_CST);
    if ((w & SGM_BUF_STATE_MASK) == SGM_BUF_BUSY) {
      buffer_sleep(pl, b, w, false);
      continue;
    }
    if (__atomic_load_n(&b->tier, __ATOMIC_RELAXED) != SGM_TIER_DISK) {
      if (__atomic_load_n(&b->state, __ATOMIC_SEQ_CST) == w) return false;
      continue;
    }
    sgm_buf_state was = (sgm_buf_state)(w & SGM_BUF_STATE_MASK);
    if (__atomic_compare_exchange_n(&b->state, &w, ((w & SGM_BUF_GEN_MASK) + SGM_BUF_GEN_ONE) | SGM_BUF_BUSY,
                                    false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
      bool on = b->ext && b->ext[0].bytes != 0;
      *offset = on ? b->ext[0].offset : 0;
      sgm__buffer_set_state(b, was);
      return on;
    }
  }
}
