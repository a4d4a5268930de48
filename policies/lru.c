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
 * Chains (the instance has seen an item with a parent, sgm_buffer_set_parent:
 * the application says its buffers are prefix chains, KV blocks in a radix
 * tree). Then the list is split in two, a segmented LRU: *probation*, the
 * list above, for blocks only the request that made them has used, and
 * *protected*, at most LRU_PROTECTED_PERCENT of the listed bytes, for blocks
 * a later use matched again (a shared prefix: on_access, or a new item whose
 * id is among the ghosts, the ids of the last evicted blocks, about the
 * tier's capacity in bytes). A hit goes to protected's head; protected's
 * overflow goes back to probation's head; victims come from probation's tail,
 * then protected's. On the Mooncake traces a block used once is used again
 * about a quarter of the time, a block used twice half the time, so the
 * blocks of one-off requests leave before the prefixes sessions come back to
 * (docs/policies.md "Residency hints"). Without a parent ever seen, nothing
 * of this runs: one list, no ghosts, plain LRU.
 *
 * The classic baseline (and what sgm did before policies were plug-ins). It
 * has no defence against a scan: a one-time sweep over more buffers than fit
 * flushes everything.
 */
#include "builtin.h"
#include "common.h"

/* With chains: protected holds at most this share of the listed bytes. 30%
 * measured best on the Mooncake conversation trace (40%: 20.3% of the gap
 * to OPT, 30%: 21.4%, 50%: 13.9%, in a simulation of the rule). */
#define LRU_PROTECTED_PERCENT 30u

enum { LRU_PROBATION = 0, LRU_PROTECTED = 1 };

typedef struct lru_state {
  pol_node node;          /* in its list; unlinked while pinned */
  sgm_policy_item *item;  /* back to the item */
  uint8_t seg;            /* LRU_PROBATION or LRU_PROTECTED (always probation without chains) */
} lru_state;

typedef struct lru_policy {
  pol_node list[2];   /* probation (the only list without chains), protected; head = MRU */
  uint64_t n[2];      /* items in each */
  uint64_t bytes[2];  /* their sizes */
  bool chains;        /* an item with a parent was seen: segmented, ghosts kept */
  bool ghosts_ok;     /* ghosts initialised */
  pol_ghosts ghosts;  /* ids of evicted items (chains only) */
  pol_node g;         /* their FIFO, head = newest */
  uint64_t g_bytes;   /* their sizes */
  uint64_t g_limit;   /* the most bytes of ghosts: the tier's capacity */
} lru_policy;

static sgm_status lru_create(const sgm_policy_params *params, sgm_policy **out) {
  lru_policy *p = (lru_policy *)calloc(1, sizeof *p);
  *out = (sgm_policy *)p;
  if (!p) return SGM_ERR_NOMEM;
  pol_list_init(&p->list[0]);
  pol_list_init(&p->list[1]);
  pol_list_init(&p->g);
  p->g_limit = params ? params->capacity_bytes : 0;
  return SGM_OK;
}

static void lru_destroy(sgm_policy *pp) {
  lru_policy *p = (lru_policy *)pp;
  if (p->ghosts_ok) pol_ghosts_fini(&p->ghosts);
  free(pp);
}

/* The first item with a parent turns chains on (once; ghosts may fail to
 * allocate: then protected is reached by hits only). */
static void lru_see_parent(lru_policy *p, const sgm_policy_item *it) {
  if (!it->parent || p->chains) return;
  p->chains = true;
  p->ghosts_ok = pol_ghosts_init(&p->ghosts);
}

static void lru_count(lru_policy *p, const lru_state *s, int sign) {
  if (sign > 0) {
    p->n[s->seg]++;
    p->bytes[s->seg] += s->item->size_bytes;
  } else {
    p->n[s->seg]--;
    p->bytes[s->seg] -= s->item->size_bytes;
  }
}

static void lru_link(lru_policy *p, lru_state *s, bool at_head) {
  if (at_head) pol_push_head(&p->list[s->seg], &s->node);
  else pol_push_tail(&p->list[s->seg], &s->node);
  lru_count(p, s, +1);
}

/* Chains: it goes to protected's head; protected's overflow to probation's head. */
static void lru_protect(lru_policy *p, lru_state *s) {
  s->seg = LRU_PROTECTED;
  lru_link(p, s, true);
  uint64_t held = p->bytes[0] + p->bytes[1];
  pol_node *t;
  while (p->bytes[1] * 100 > held * LRU_PROTECTED_PERCENT && p->n[1] > 1 &&
         (t = pol_list_tail(&p->list[1])) != NULL) {
    lru_state *o = (lru_state *)(void *)t;
    pol_unlink(t);
    lru_count(p, o, -1);
    o->seg = LRU_PROBATION;
    lru_link(p, o, true);
  }
}

/* Chains: a ghost of id? (forgotten if so: it is back) */
static bool lru_ghost_take(lru_policy *p, uint64_t id) {
  pol_ghost *g = p->ghosts_ok ? pol_ghosts_find(&p->ghosts, id) : NULL;
  if (!g) return false;
  pol_unlink(&g->link);
  p->g_bytes -= g->size_bytes;
  pol_ghosts_del(&p->ghosts, g);
  return true;
}

/* Chains: remember an evicted item's id, oldest ghosts out past g_limit. */
static void lru_ghost_add(lru_policy *p, const sgm_policy_item *it) {
  if (!p->ghosts_ok || lru_ghost_take(p, it->id)) return;
  pol_ghost *g = pol_ghosts_add(&p->ghosts, it->id, it->size_bytes, 0);
  if (!g) return;
  pol_push_head(&p->g, &g->link);
  p->g_bytes += it->size_bytes;
  pol_node *t;
  while (p->g_bytes > p->g_limit && (t = pol_list_tail(&p->g)) != NULL) {
    pol_ghost *e = pol_ghost_of(t);
    pol_unlink(t);
    p->g_bytes -= e->size_bytes;
    pol_ghosts_del(&p->ghosts, e);
  }
}

/* A used or new item whose parent (prefix) is listed here goes right behind
 * it, towards the tail, instead of to the head: a chain used root to leaf
 * then leaves leaf first, and its prefix stays (sgm_buffer_set_parent). */
static void lru_link_used(lru_policy *p, lru_state *s, const sgm_policy_item *it) {
  lru_state *ps = it->parent ? (lru_state *)it->parent->state : NULL;
  s->seg = LRU_PROBATION;
  if (ps && ps->item == it->parent && pol_linked(&ps->node) && ps->seg == LRU_PROBATION) {
    pol_link_between(&s->node, &ps->node, ps->node.next);
    lru_count(p, s, +1);
    return;
  }
  lru_link(p, s, true);
}

static void lru_insert(sgm_policy *pp, sgm_policy_item *it, sgm_policy_insert how) {
  lru_policy *p = (lru_policy *)pp;
  lru_state *s = (lru_state *)it->state;
  if (how == SGM_POLICY_INSERT_NEW) s->item = it;
  pol_assert(s->item == it);
  lru_see_parent(p, it);
  if (how != SGM_POLICY_INSERT_NEW) lru_link(p, s, false); /* restored: its list's tail */
  else if (p->chains && lru_ghost_take(p, it->id)) lru_protect(p, s);
  else lru_link_used(p, s, it);
}

static void lru_access(sgm_policy *pp, sgm_policy_item *it) {
  lru_policy *p = (lru_policy *)pp;
  lru_state *s = (lru_state *)it->state;
  pol_assert(s->item == it && !pol_linked(&s->node));
  lru_see_parent(p, it);
  if (p->chains) lru_protect(p, s);
  else lru_link_used(p, s, it);
}

static void lru_remove(sgm_policy *pp, sgm_policy_item *it, sgm_policy_remove why) {
  lru_policy *p = (lru_policy *)pp;
  lru_state *s = (lru_state *)it->state;
  if (!pol_linked(&s->node)) return; /* a pinned item dropped: nothing held */
  pol_unlink(&s->node);
  lru_count(p, s, -1);
  if (why == SGM_POLICY_REMOVE_EVICT && p->chains) lru_ghost_add(p, it);
}

static uint64_t lru_reclaimable(const sgm_policy *pp) {
  const lru_policy *p = (const lru_policy *)pp;
  return p->bytes[0] + p->bytes[1];
}

static sgm_policy_item *lru_next_victim(sgm_policy *pp, uint64_t bytes_wanted) {
  lru_policy *p = (lru_policy *)pp;
  (void)bytes_wanted;
  pol_node *t = pol_list_tail(&p->list[LRU_PROBATION]);
  if (!t) t = pol_list_tail(&p->list[LRU_PROTECTED]);
  return t ? ((lru_state *)(void *)t)->item : NULL;
}

static sgm_status lru_check(const sgm_policy *pp, char *why, size_t len) {
  const lru_policy *p = (const lru_policy *)pp;
  for (int k = 0; k < 2; k++) {
    size_t n;
    if (!pol_list_valid(&p->list[k], &n)) return pol_fail(why, len, "lru: broken list links");
    uint64_t bytes = 0;
    for (const pol_node *x = p->list[k].next; x != &p->list[k]; x = x->next) {
      const lru_state *s = (const lru_state *)(const void *)x;
      if (!s->item || s->item->state != s) return pol_fail(why, len, "lru: a node's item does not own it");
      if (s->seg != k) return pol_fail(why, len, "lru: an item in list %d marked %d", k, s->seg);
      if (p->ghosts_ok && pol_ghosts_find(&p->ghosts, s->item->id))
        return pol_fail(why, len, "lru: item %llu is listed and a ghost", (unsigned long long)s->item->id);
      bytes += s->item->size_bytes;
    }
    if (n != p->n[k] || bytes != p->bytes[k])
      return pol_fail(why, len, "lru: %zu items of %llu bytes in list %d, counters say %llu of %llu", n,
                      (unsigned long long)bytes, k, (unsigned long long)p->n[k],
                      (unsigned long long)p->bytes[k]);
  }
  if (!p->chains && p->n[LRU_PROTECTED]) return pol_fail(why, len, "lru: protected items without chains");
  if (p->ghosts_ok && p->ghosts.n) {
    size_t ng;
    if (!pol_list_valid(&p->g, &ng) || ng != p->ghosts.n) return pol_fail(why, len, "lru: ghost list broken");
  }
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
