/*
 * lru.c — least recently used.
 *
 * Design note. One list, most recently used at the head; the victim is the
 * tail. A new item and a hit go to the head; an item restored unused (a
 * skipped victim) goes back to the tail, the end it was taken from. A pin
 * simply unlinks the item: it comes back at the head when used. Every
 * operation is O(1); a big request takes tail after tail.
 *
 *     head (MRU) → b7 → b2 → b9 → b4 ← tail (LRU, next victim)
 *
 * Structure (policy ABI 4): a new or used item whose parent is listed here
 * goes right behind the parent instead of at the head (lru_link_used).
 *
 * The classic baseline (and what sgm did before policies were plug-ins). It
 * has no defence against a scan: a one-time sweep over more buffers than fit
 * flushes everything.
 */
#include "builtin.h"
#include "common.h"

typedef struct lru_state {
  pol_node node;          /* in the list; unlinked while pinned */
  sgm_policy_item *item;  /* back to the item */
} lru_state;

typedef struct lru_policy {
  pol_node list;   /* head = most recently used */
  uint64_t n;      /* items in the list */
  uint64_t bytes;  /* their sizes */
} lru_policy;

static sgm_status lru_create(const sgm_policy_params *params, sgm_policy **out) {
  (void)params;
  lru_policy *p = (lru_policy *)calloc(1, sizeof *p);
  *out = (sgm_policy *)p;
  if (!p) return SGM_ERR_NOMEM;
  pol_list_init(&p->list);
  return SGM_OK;
}

static void lru_destroy(sgm_policy *pp) { free(pp); }

static void lru_link(lru_policy *p, lru_state *s, bool at_head) {
  if (at_head) pol_push_head(&p->list, &s->node);
  else pol_push_tail(&p->list, &s->node);
  p->n++;
  p->bytes += s->item->size_bytes;
}

/* A used or new item whose parent (prefix) is listed here goes right behind
 * it, towards the tail, instead of to the head: a chain used root to leaf
 * then leaves leaf first, and its prefix stays (sgm_buffer_set_parent). */
static void lru_link_used(lru_policy *p, lru_state *s, const sgm_policy_item *it) {
  lru_state *ps = it->parent ? (lru_state *)it->parent->state : NULL;
  if (ps && ps->item == it->parent && pol_linked(&ps->node)) {
    pol_link_between(&s->node, &ps->node, ps->node.next);
    p->n++;
    p->bytes += s->item->size_bytes;
    return;
  }
  lru_link(p, s, true);
}

static void lru_insert(sgm_policy *pp, sgm_policy_item *it, sgm_policy_insert how) {
  lru_policy *p = (lru_policy *)pp;
  lru_state *s = (lru_state *)it->state;
  if (how == SGM_POLICY_INSERT_NEW) s->item = it;
  pol_assert(s->item == it);
  if (how == SGM_POLICY_INSERT_NEW) lru_link_used(p, s, it);
  else lru_link(p, s, false);
}

static void lru_access(sgm_policy *pp, sgm_policy_item *it) {
  lru_state *s = (lru_state *)it->state;
  pol_assert(s->item == it && !pol_linked(&s->node));
  lru_link_used((lru_policy *)pp, s, it);
}

static void lru_remove(sgm_policy *pp, sgm_policy_item *it, sgm_policy_remove why) {
  lru_policy *p = (lru_policy *)pp;
  lru_state *s = (lru_state *)it->state;
  (void)why;
  if (!pol_linked(&s->node)) return; /* a pinned item dropped: nothing held */
  pol_unlink(&s->node);
  p->n--;
  p->bytes -= it->size_bytes;
}

static uint64_t lru_reclaimable(const sgm_policy *pp) { return ((const lru_policy *)pp)->bytes; }

static sgm_policy_item *lru_next_victim(sgm_policy *pp, uint64_t bytes_wanted) {
  lru_policy *p = (lru_policy *)pp;
  (void)bytes_wanted;
  pol_node *t = pol_list_tail(&p->list);
  return t ? ((lru_state *)(void *)t)->item : NULL;
}

static sgm_status lru_check(const sgm_policy *pp, char *why, size_t len) {
  const lru_policy *p = (const lru_policy *)pp;
  size_t n;
  if (!pol_list_valid(&p->list, &n)) return pol_fail(why, len, "lru: broken list links");
  uint64_t bytes = 0;
  for (const pol_node *x = p->list.next; x != &p->list; x = x->next) {
    const lru_state *s = (const lru_state *)(const void *)x;
    if (!s->item || s->item->state != s) return pol_fail(why, len, "lru: a node's item does not own it");
    bytes += s->item->size_bytes;
  }
  if (n != p->n || bytes != p->bytes)
    return pol_fail(why, len, "lru: %zu items of %llu bytes listed, counters say %llu of %llu", n,
                    (unsigned long long)bytes, (unsigned long long)p->n,
                    (unsigned long long)p->bytes);
  return SGM_OK;
}

/* The policy on its own; registered inside the hint shell (hinted.c). */
static const sgm_policy_ops lru_inner = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "lru",
    .summary = "least recently used leaves first",
    .state_bytes = sizeof(lru_state),
    .create = lru_create,
    .destroy = lru_destroy,
    .on_insert = lru_insert,
    .on_access = lru_access,
    .on_remove = lru_remove,
    .reclaimable_bytes = lru_reclaimable,
    .next_victim = lru_next_victim,
    .check = lru_check,
};

POL_HINTED(sgm__policy_lru, lru_inner, lru_state, "lru", "least recently used leaves first");
