/*
 * priority.c — the priority layer every policy runs under.
 *
 * Design note. Buffers of a lower sgm_priority leave a tier first (as D3D12's
 * residency priorities). The layer holds one instance of the chosen policy per
 * priority level and routes each item to the instance of its priority; the
 * victim is the chosen policy's victim in the lowest level that holds an item.
 * So the policy decides *within* a level, and levels never mix: a MINIMUM
 * buffer used a moment ago still leaves before a NORMAL one untouched for an
 * hour. (That is what placement.c did with its built-in per-priority LRU
 * lists before policies were plug-ins.)
 *
 *     level MINIMUM  [ policy instance ]  ← victims from here while it holds any
 *     level LOW      [ policy instance ]
 *     level NORMAL   [ policy instance ]  ← almost everything, by default
 *     level HIGH     [ policy instance ]
 *     level MAXIMUM  [ policy instance ]  ← last to leave
 *
 * Cost: one indirect call per operation, plus up to five O(1) emptiness
 * checks (reclaimable_bytes) per victim. The optional members are forwarded
 * too: record to the level of the buffer's priority (so each level's
 * frequency sketch counts its own buffers), admit to the victim's level
 * unless the candidate's priority is higher (then it is admitted: priorities
 * come before any policy's opinion). The layer keeps no per-item state:
 * sgm keeps an item's priority constant while it is in or pinned by a level
 * (a priority change is a DROP from the old level and an insert into the new).
 */
#include "builtin.h"
#include "common.h"

struct sgm__prio_layer {
  const sgm_policy_ops *ops;               /* the policy every level runs */
  sgm_policy *level[SGM__PRIO_LEVELS];     /* one instance per priority */
};

static sgm_policy *prio_level(const sgm__prio_layer *l, const sgm_policy_item *it) {
  pol_assert(it->priority >= 0 && it->priority < SGM__PRIO_LEVELS);
  return l->level[it->priority];
}

sgm_status sgm__prio_create(const sgm_policy_ops *inner, const sgm_policy_params *params,
                            sgm__prio_layer **out) {
  *out = NULL;
  sgm__prio_layer *l = (sgm__prio_layer *)calloc(1, sizeof *l);
  if (!l) return SGM_ERR_NOMEM;
  l->ops = inner;
  for (int k = 0; k < SGM__PRIO_LEVELS; k++) {
    sgm_policy_params pp = *params;
    pp.priority = k;
    sgm_status rc = inner->create(&pp, &l->level[k]);
    if (rc != SGM_OK || !l->level[k]) {
      l->level[k] = NULL;
      sgm__prio_destroy(l);
      return rc != SGM_OK ? rc : SGM_ERR_NOMEM;
    }
  }
  *out = l;
  return SGM_OK;
}

void sgm__prio_destroy(sgm__prio_layer *l) {
  if (!l) return;
  for (int k = 0; k < SGM__PRIO_LEVELS; k++)
    if (l->level[k]) l->ops->destroy(l->level[k]);
  free(l);
}

const sgm_policy_ops *sgm__prio_inner(const sgm__prio_layer *l) { return l->ops; }

void sgm__prio_insert(sgm__prio_layer *l, sgm_policy_item *it, sgm_policy_insert how) {
  l->ops->on_insert(prio_level(l, it), it, how);
}

void sgm__prio_access(sgm__prio_layer *l, sgm_policy_item *it) {
  l->ops->on_access(prio_level(l, it), it);
}

void sgm__prio_remove(sgm__prio_layer *l, sgm_policy_item *it, sgm_policy_remove why) {
  l->ops->on_remove(prio_level(l, it), it, why);
}

void sgm__prio_hint(sgm__prio_layer *l, sgm_policy_item *it) {
  if (l->ops->on_hint) l->ops->on_hint(prio_level(l, it), it);
}

void sgm__prio_record(sgm__prio_layer *l, int priority, uint64_t id) {
  pol_assert(priority >= 0 && priority < SGM__PRIO_LEVELS);
  if (l->ops->record) l->ops->record(l->level[priority], id);
}

bool sgm__prio_admit(sgm__prio_layer *l, const sgm_policy_item *candidate,
                     const sgm_policy_item *victim) {
  /* Priorities come first: a newcomer of a higher level may always push out
   * a lower one; within a level, or upwards, the policy decides. */
  if (!l->ops->admit || candidate->priority > victim->priority) return true;
  return l->ops->admit(prio_level(l, victim), candidate, victim);
}

int sgm__prio_promote_before(sgm__prio_layer *l, const sgm_policy_item *a, const sgm_policy_item *b) {
  if (!l->ops->promote_before) return -1;
  return l->ops->promote_before(prio_level(l, a), a, b) ? 1 : 0;
}

sgm_policy_item *sgm__prio_next_victim(sgm__prio_layer *l, uint64_t bytes_wanted) {
  for (int k = 0; k < SGM__PRIO_LEVELS; k++) {
    if (l->ops->reclaimable_bytes(l->level[k]) == 0) continue;
    sgm_policy_item *v = l->ops->next_victim(l->level[k], bytes_wanted);
    if (v) return v;
  }
  return NULL;
}

uint64_t sgm__prio_reclaimable(const sgm__prio_layer *l) {
  uint64_t sum = 0;
  for (int k = 0; k < SGM__PRIO_LEVELS; k++) sum += l->ops->reclaimable_bytes(l->level[k]);
  return sum;
}

sgm_status sgm__prio_check(const sgm__prio_layer *l, char *why, size_t why_len) {
  if (!l->ops->check) return SGM_OK;
  for (int k = 0; k < SGM__PRIO_LEVELS; k++) {
    sgm_status rc = l->ops->check(l->level[k], why, why_len);
    if (rc != SGM_OK) {
      char inner[256];
      snprintf(inner, sizeof inner, "%s", why ? why : "");
      return pol_fail(why, why_len, "priority level %d: %s", k, inner);
    }
  }
  return SGM_OK;
}
