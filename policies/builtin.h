/*
 * builtin.h — what policies/ gives the library: the built-in vtables and the
 * priority layer every policy runs under. Built, like the policies, on
 * sgm/policy.h alone. Names follow the internal convention (sgm__...): none
 * of this is exported.
 */
#ifndef SGM_POLICIES_BUILTIN_H
#define SGM_POLICIES_BUILTIN_H

#include <sgm/policy.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the built-ins, registered in this order by lib/policy.c ---- */
extern const sgm_policy_ops sgm__policy_lru;    /* policies/lru.c */
extern const sgm_policy_ops sgm__policy_clock;  /* policies/clock.c */
extern const sgm_policy_ops sgm__policy_lfu;    /* policies/lfu.c */
extern const sgm_policy_ops sgm__policy_arc;    /* policies/arc.c */
extern const sgm_policy_ops sgm__policy_s3fifo; /* policies/s3fifo.c */
extern const sgm_policy_ops sgm__policy_tinylfu; /* policies/tinylfu.c */
extern const sgm_policy_ops sgm__policy_lirs;   /* policies/lirs.c */

/* ---- policies/hinted.c: residency hints around a policy (its design note) ----
 *
 * POL_HINTED(sym, inner, inner_state, name, summary) defines the vtable `sym`:
 * the policy `inner` (a vtable with no record, admit or promote_before) in
 * the hint shell, its state the inner's followed by the shell's. The
 * pol_hinted_* functions are that vtable's members. */
#define POL_HINTED_STATE_BYTES(inner_bytes) ((((inner_bytes) + 15u) & ~(size_t)15u) + 32u)
sgm_status pol_hinted_create(const sgm_policy_ops *inner, const sgm_policy_params *params,
                             sgm_policy **out);
void pol_hinted_destroy(sgm_policy *p);
void pol_hinted_insert(sgm_policy *p, sgm_policy_item *it, sgm_policy_insert how);
void pol_hinted_access(sgm_policy *p, sgm_policy_item *it);
void pol_hinted_remove(sgm_policy *p, sgm_policy_item *it, sgm_policy_remove why);
void pol_hinted_hint(sgm_policy *p, sgm_policy_item *it);
uint64_t pol_hinted_reclaimable(const sgm_policy *p);
sgm_policy_item *pol_hinted_next_victim(sgm_policy *p, uint64_t bytes_wanted);
sgm_status pol_hinted_check(const sgm_policy *p, char *why, size_t why_len);
#define POL_HINTED(sym, inner, inner_state, name_, summary_)                              \
  static sgm_status sym##_create(const sgm_policy_params *params, sgm_policy **out) {    \
    return pol_hinted_create(&(inner), params, out);                                      \
  }                                                                                       \
  const sgm_policy_ops sym = {                                                            \
      .abi_version = SGM_POLICY_ABI_VERSION,                                              \
      .name = name_,                                                                      \
      .summary = summary_,                                                                \
      .state_bytes = POL_HINTED_STATE_BYTES(sizeof(inner_state)),                         \
      .create = sym##_create,                                                             \
      .destroy = pol_hinted_destroy,                                                      \
      .on_insert = pol_hinted_insert,                                                     \
      .on_access = pol_hinted_access,                                                     \
      .on_remove = pol_hinted_remove,                                                     \
      .reclaimable_bytes = pol_hinted_reclaimable,                                        \
      .next_victim = pol_hinted_next_victim,                                              \
      .check = pol_hinted_check,                                                          \
      .on_hint = pol_hinted_hint,                                                         \
  }

/* ---- policies/priority.c: one instance of a policy per priority level ----
 *
 * Items go to the instance of their sgm_policy_item.priority; victims come
 * from the lowest level that has one. Same contract as the vtable (called
 * under the placement lock, never blocks). */
#define SGM__PRIO_LEVELS (SGM_PRIORITY_MAXIMUM + 1)

typedef struct sgm__prio_layer sgm__prio_layer;

/* Create one instance of inner per level (params->priority is set per level). */
sgm_status sgm__prio_create(const sgm_policy_ops *inner, const sgm_policy_params *params,
                            sgm__prio_layer **out);
void sgm__prio_destroy(sgm__prio_layer *l);
const sgm_policy_ops *sgm__prio_inner(const sgm__prio_layer *l);
void sgm__prio_insert(sgm__prio_layer *l, sgm_policy_item *it, sgm_policy_insert how);
void sgm__prio_access(sgm__prio_layer *l, sgm_policy_item *it);
void sgm__prio_remove(sgm__prio_layer *l, sgm_policy_item *it, sgm_policy_remove why);
/* The lowest level's next victim; NULL when every level is empty. */
sgm_policy_item *sgm__prio_next_victim(sgm__prio_layer *l, uint64_t bytes_wanted);
/* The hints of `it` (listed at its level) changed: that level's on_hint, if any. */
void sgm__prio_hint(sgm__prio_layer *l, sgm_policy_item *it);
/* A use of buffer `id`, of priority `priority`, is being acquired: to that
 * level's instance, when the policy has a record member (cheap otherwise). */
void sgm__prio_record(sgm__prio_layer *l, int priority, uint64_t id);
/* May `victim` (just returned by sgm__prio_next_victim) be evicted to make
 * room for `candidate`? true when the candidate's priority is above the
 * victim's or the policy has no admit member; else the victim's level decides. */
bool sgm__prio_admit(sgm__prio_layer *l, const sgm_policy_item *candidate,
                     const sgm_policy_item *victim);
/* Should the shared-placed movable block a come back into VRAM before b (both
 * of one priority level)? The policy's promote_before at that level: 1 or 0;
 * -1 when the policy has none (the caller's own order applies). */
int sgm__prio_promote_before(sgm__prio_layer *l, const sgm_policy_item *a, const sgm_policy_item *b);
/* Sum over the levels. */
uint64_t sgm__prio_reclaimable(const sgm__prio_layer *l);
/* Every level's check (those whose policy has one); SGM_OK or SGM_ERR_CORRUPT. */
sgm_status sgm__prio_check(const sgm__prio_layer *l, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif /* SGM_POLICIES_BUILTIN_H */
