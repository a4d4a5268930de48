/*
 * residency_host.c — the host of the eviction policies: how a buffer enters,
 * leaves and is pinned in the policy of its tier. residency.c decides where
 * data lives (DESIGN.md §3) and asks the policies for victims; the calls here
 * keep the policies' lists in step with the buffers.
 *
 * Eviction policies (include/sgm/policy.h, policies/): each resident tier
 * (VRAM, shared) has a priority layer running the policy the config names
 * (SGM_POLICY, or SGM_POLICY_VRAM / SGM_POLICY_SHARED): one instance per
 * priority level, victims from the lowest level that has one.
 *
 *     pol[VRAM]    MINIMUM [lru] LOW [lru] NORMAL [lru] HIGH [lru] MAXIMUM [lru]
 *     pol[SHARED]  the same with its own policy; victims go to disk
 *
 * Invariant: a buffer is an item of pol[b->tier] (b->listed) exactly when it
 * is RELEASED and resident; acquired and BUSY buffers are not, so they are
 * never victims. The policy's per-buffer state lives inline after the buffer
 * struct (pl->state_offset), sized for the larger of the two policies.
 *
 * Pins: taking a listed buffer out for use, a copy or a move is on_remove(PIN);
 * the instance keeps its state until the pin ends with on_access (used),
 * on_insert(RESTORE) (back unused in the same instance) or on_remove(DROP)
 * (destroyed, or back in another tier or priority level). b->pinned and
 * b->pin_tier say which instance holds a pin; b->item.priority is the level
 * that holds or pins the item, b->priority the one the user set. The victim
 * search (residency.c) pins the candidates it skips and restores them once
 * it is over.
 *
 * Record (an optional member of ABI 2): every acquire is recorded, before
 * anything moves, with each tier's policy that counts (pl->any_record keeps
 * the check to one branch for those that do not).
 *
 * Fresh buffers: a buffer that entered its tier without being used (created
 * there, prefetched into it, demoted into it) is fresh. Its first acquire is
 * the reference that brought it in, not a hit: it leaves the policy with DROP
 * and comes back as new. Host reads and writes of a fresh buffer keep it fresh
 * (an upload is not a use); of any other buffer they count as a use.
 *
 * Locks: every call here but sgm__residency_record_slow runs under
 * pl->res[t] (sgm__residency_lock) of the tier whose policy lists or pins the
 * buffer, and takes no lock; _record_slow takes each counting tier's lock in
 * turn (rank order, one at a time). The policy callbacks they make run under
 * that lock and neither block nor call back into sgm. Calls: the priority
 * layer (sgm__prio_*, policy.c) only.
 */
#include "placement.h"

static void residency_count_listed(struct sgm_placement *pl, sgm_tier t, int64_t d) {
  __atomic_store_n(&pl->n_listed[t], pl->n_listed[t] + (uint64_t)d, __ATOMIC_RELAXED);
}

void sgm__residency_take(struct sgm_placement *pl, sgm_buffer *b, sgm_policy_remove why) {
  if (!b->listed) return;
  sgm_assert_internal(b->tier < SGM_N_RESIDENT && !b->pinned);
  sgm__prio_remove(pl->pol[b->tier], &b->item, why);
  b->listed = false;
  __atomic_store_n(&b->listed_in, (uint8_t)SGM_N_RESIDENT, __ATOMIC_RELEASE);
  residency_count_listed(pl, b->tier, -1);
  if (why == SGM_POLICY_REMOVE_PIN) {
    b->pinned = true;
    b->pin_tier = b->tier;
  }
}

void sgm__residency_take_for_use(struct sgm_placement *pl, sgm_buffer *b) {
  sgm__residency_take(pl, b, b->fresh ? SGM_POLICY_REMOVE_DROP : SGM_POLICY_REMOVE_PIN);
}

void sgm__residency_unpin(struct sgm_placement *pl, sgm_buffer *b) {
  if (!b->pinned) return;
  sgm__prio_remove(pl->pol[b->pin_tier], &b->item, SGM_POLICY_REMOVE_DROP);
  b->pinned = false;
}

void sgm__residency_put(struct sgm_placement *pl, sgm_buffer *b, bool used) {
  /* A pin of another tier ended before (sgm__buffer_finish): one lock. */
  sgm_assert_internal(sgm__buffer_state(b) != SGM_BUF_ACQUIRED && b->tier < SGM_N_RESIDENT && !b->listed &&
                      (!b->pinned || b->pin_tier == b->tier));
  sgm__prio_layer *l = pl->pol[b->tier];
  int priority = __atomic_load_n(&b->priority, __ATOMIC_SEQ_CST);
  bool back = false;
  /* A use ends the hints about it (they were about this use). */
  if (used) {
    b->item.hint = 0;
    b->item.will_use_distance = 0;
  }
  if (b->hparent) sgm__residency_resolve_parent(b, b->tier);
  if (b->pinned) {
    back = b->item.priority == priority;
    if (!back) sgm__prio_remove(pl->pol[b->pin_tier], &b->item, SGM_POLICY_REMOVE_DROP);
    b->pinned = false;
  }
  if (back && used) {
    sgm__prio_access(l, &b->item);
  } else if (back) {
    sgm__prio_insert(l, &b->item, SGM_POLICY_INSERT_RESTORE);
  } else {
    b->item.priority = priority;
    sgm__prio_insert(l, &b->item, SGM_POLICY_INSERT_NEW);
    b->fresh = !used;
  }
  b->item.parent = NULL; /* valid for the call only */
  b->listed = true;
  __atomic_store_n(&b->listed_in, (uint8_t)b->tier, __ATOMIC_RELEASE);
  residency_count_listed(pl, b->tier, +1);
}

void sgm__residency_record_slow(struct sgm_placement *pl, const sgm_buffer *b) {
  int priority = __atomic_load_n(&b->priority, __ATOMIC_RELAXED);
  for (int t = 0; t < SGM_N_RESIDENT; t++) {
    if (!pl->record[t]) continue;
    sgm__lock_take(sgm__residency_lock(pl, (sgm_tier)t));
    sgm__prio_record(pl->pol[t], priority, b->item.id);
    sgm__lock_drop(sgm__residency_lock(pl, (sgm_tier)t));
  }
}

void sgm__residency_resolve_parent(sgm_buffer *b, sgm_tier t) {
  sgm_buffer *p = b->hparent;
  b->item.parent = NULL;
  /* listed_in only changes under the lock of the tier it names: read as t,
   * it stays t while the caller holds pl->res[t], and so do p's item fields. */
  if (p && __atomic_load_n(&p->listed_in, __ATOMIC_ACQUIRE) == (uint8_t)t &&
      p->item.priority == b->item.priority)
    b->item.parent = &p->item;
}
