/*
 * arc.c — Adaptive Replacement Cache (Megiddo & Modha, "ARC: A Self-Tuning,
 * Low Overhead Replacement Cache", FAST 2003), counted in bytes.
 *
 * Design note. Resident items are in T1 (seen once since they came in) or T2
 * (seen again); each is an LRU list. Evicted items leave a ghost — their id
 * and size, no data — in B1 (from T1) or B2 (from T2). p is the number of
 * bytes ARC wants T1 to hold; the victim is T1's LRU item when T1 holds more
 * than p, else T2's. A buffer coming back while its ghost is in B1 means T1
 * was too small: p grows (by its size, times |B2|/|B1| when B2 is larger);
 * a ghost hit in B2 shrinks p the same way. Either ghost hit enters T2. A hit
 * on a resident item moves it to T2's head.
 *
 *          B1 (ghosts)        T1 (once)    |    T2 (again)        B2 (ghosts)
 *     tail … … head ←evict— tail … head  ←p→  head … tail —evict→ head … … tail
 *
 * Ghosts are what lets ARC resist a scan: a one-time sweep fills T1 and
 * drains through it, while the hot set sits in T2 and p only moves when
 * ghosts are hit. They refer to buffers by sgm_policy_item.id (an evicted
 * buffer lives on in a lower tier and keeps its id); a hash table finds them.
 *
 * Sizes: c, ARC's cache size, is the most bytes this instance has held (the
 * tier's effective size for movable buffers; other allocations and pinned
 * buffers take the rest), never above the tier's budget. Ghost lists are
 * trimmed to |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c, in bytes.
 *
 * Differences from the paper, forced by sgm's order of events: the cache
 * evicts (next_victim) before the missing buffer is inserted, so a ghost hit
 * adapts p one eviction late, and REPLACE's tie-break ("x in B2 and |T1| = p")
 * uses whether the last insert was a B2 ghost hit.
 */
#include "builtin.h"
#include "common.h"

enum { ARC_T1 = 0, ARC_T2 = 1 };

typedef struct arc_state {
  pol_node node;          /* in T1 or T2; unlinked while pinned */
  sgm_policy_item *item;  /* back to the item */
  uint8_t list;           /* ARC_T1 or ARC_T2 */
} arc_state;

typedef struct arc_policy {
  pol_node t[2];           /* T1, T2: resident, head = most recent */
  uint64_t t_bytes[2];     /* their sizes */
  uint64_t t_n[2];         /* their item counts */
  pol_node b[2];           /* B1, B2: ghosts, head = most recent */
  uint64_t b_bytes[2];     /* their sizes */
  pol_ghosts ghosts;       /* every ghost of B1 and B2 by id (tag = list) */
  uint64_t p;              /* target bytes of T1 */
  uint64_t c;              /* cache size in bytes: the most T1 + T2 have held */
  uint64_t capacity_bytes; /* the tier's budget: c's ceiling */
  bool b2_hit_last;        /* the last insert was a ghost hit in B2 */
} arc_policy;

static sgm_status arc_create(const sgm_policy_params *params, sgm_policy **out) {
  arc_policy *p = (arc_policy *)calloc(1, sizeof *p);
  *out = NULL;
  if (!p) return SGM_ERR_NOMEM;
  if (!pol_ghosts_init(&p->ghosts)) {
    free(p);
    return SGM_ERR_NOMEM;
  }
  for (int k = 0; k < 2; k++) {
    pol_list_init(&p->t[k]);
    pol_list_init(&p->b[k]);
  }
  p->capacity_bytes = params->capacity_bytes ? params->capacity_bytes : UINT64_MAX;
  *out = (sgm_policy *)p;
  return SGM_OK;
}

static void arc_destroy(sgm_policy *pp) {
  arc_policy *p = (arc_policy *)pp;
  pol_ghosts_fini(&p->ghosts);
  free(p);
}

static void arc_ghost_drop(arc_policy *p, pol_ghost *g) {
  pol_unlink(&g->link);
  p->b_bytes[g->tag] -= g->size_bytes;
  pol_ghosts_del(&p->ghosts, g);
}

/* Drop the oldest ghost of list k; false when it is empty. */
static bool arc_ghost_drop_oldest(arc_policy *p, int k) {
  pol_node *t = pol_list_tail(&p->b[k]);
  if (!t) return false;
  arc_ghost_drop(p, pol_ghost_of(t));
  return true;
}

/* |T1| + |B1| <= c and the whole directory <= 2c. */
static void arc_trim_ghosts(arc_policy *p, uint64_t incoming) {
  while (p->t_bytes[ARC_T1] + p->b_bytes[0] + incoming > p->c && arc_ghost_drop_oldest(p, 0)) {
  }
  for (;;) {
    uint64_t all = p->t_bytes[0] + p->t_bytes[1] + p->b_bytes[0] + p->b_bytes[1] + incoming;
    if (all <= 2 * p->c) break;
    if (!arc_ghost_drop_oldest(p, 1) && !arc_ghost_drop_oldest(p, 0)) break;
  }
}

static void arc_link(arc_policy *p, arc_state *s, int list, bool at_head) {
  s->list = (uint8_t)list;
  if (at_head) pol_push_head(&p->t[list], &s->node);
  else pol_push_tail(&p->t[list], &s->node);
  p->t_bytes[list] += s->item->size_bytes;
  p->t_n[list]++;
  uint64_t held = p->t_bytes[0] + p->t_bytes[1];
  if (held > p->c) p->c = held < p->capacity_bytes ? held : p->capacity_bytes;
  arc_trim_ghosts(p, 0);
}

/* sz × max(1, num / den), saturated at limit: ARC's step for p. */
static uint64_t arc_delta(uint64_t sz, uint64_t num, uint64_t den, uint64_t limit) {
  uint64_t ratio = num > den && den ? num / den : 1;
  if (sz && ratio > limit / sz) return limit;
  return sz * ratio;
}

static void arc_insert(sgm_policy *pp, sgm_policy_item *it, sgm_policy_insert how) {
  arc_policy *p = (arc_policy *)pp;
  arc_state *s = (arc_state *)it->state;
  if (how == SGM_POLICY_INSERT_RESTORE) {
    pol_assert(s->item == it && !pol_linked(&s->node));
    arc_link(p, s, s->list, false);
    return;
  }
  s->item = it;
  pol_ghost *g = pol_ghosts_find(&p->ghosts, it->id);
  if (!g) {
    /* A plain miss: into T1, ghosts trimmed to make room in the directory. */
    p->b2_hit_last = false;
    arc_trim_ghosts(p, it->size_bytes);
    arc_link(p, s, ARC_T1, true);
    return;
  }
  uint64_t b1 = p->b_bytes[0], b2 = p->b_bytes[1], sz = it->size_bytes;
  if (g->tag == 0) {
    /* T1 was too small: give it more. */
    uint64_t delta = arc_delta(sz, b2, b1, p->c);
    p->p = p->c - p->p > delta ? p->p + delta : p->c;
    p->b2_hit_last = false;
  } else {
    uint64_t delta = arc_delta(sz, b1, b2, p->c);
    p->p = p->p > delta ? p->p - delta : 0;
    p->b2_hit_last = true;
  }
  arc_ghost_drop(p, g);
  arc_link(p, s, ARC_T2, true);
}

static void arc_access(sgm_policy *pp, sgm_policy_item *it) {
  arc_policy *p = (arc_policy *)pp;
  arc_state *s = (arc_state *)it->state;
  pol_assert(s->item == it && !pol_linked(&s->node));
  arc_link(p, s, ARC_T2, true);
}

static void arc_remove(sgm_policy *pp, sgm_policy_item *it, sgm_policy_remove why) {
  arc_policy *p = (arc_policy *)pp;
  arc_state *s = (arc_state *)it->state;
  if (!pol_linked(&s->node)) return; /* a pinned item dropped */
  pol_unlink(&s->node);
  p->t_bytes[s->list] -= it->size_bytes;
  p->t_n[s->list]--;
  if (why != SGM_POLICY_REMOVE_EVICT) return;
  /* Remember it: T1's victims in B1, T2's in B2 (an id is never in both). */
  pol_ghost *old = pol_ghosts_find(&p->ghosts, it->id);
  if (old) arc_ghost_drop(p, old);
  pol_ghost *g = pol_ghosts_add(&p->ghosts, it->id, it->size_bytes, s->list);
  if (!g) return; /* out of memory: not remembered */
  pol_push_head(&p->b[s->list], &g->link);
  p->b_bytes[s->list] += it->size_bytes;
  arc_trim_ghosts(p, 0);
}

static uint64_t arc_reclaimable(const sgm_policy *pp) {
  const arc_policy *p = (const arc_policy *)pp;
  return p->t_bytes[0] + p->t_bytes[1];
}

static sgm_policy_item *arc_next_victim(sgm_policy *pp, uint64_t bytes_wanted) {
  arc_policy *p = (arc_policy *)pp;
  (void)bytes_wanted;
  pol_node *t1 = pol_list_tail(&p->t[ARC_T1]), *t2 = pol_list_tail(&p->t[ARC_T2]);
  uint64_t b1 = p->t_bytes[ARC_T1];
  bool from_t1 = t1 && (!t2 || b1 > p->p || (b1 == p->p && p->b2_hit_last));
  pol_node *v = from_t1 ? t1 : t2;
  return v ? ((arc_state *)(void *)v)->item : NULL;
}

static sgm_status arc_check(const sgm_policy *pp, char *why, size_t len) {
  const arc_policy *p = (const arc_policy *)pp;
  uint64_t ghosts = 0;
  for (int k = 0; k < 2; k++) {
    size_t n;
    uint64_t bytes = 0;
    if (!pol_list_valid(&p->t[k], &n)) return pol_fail(why, len, "arc: T%d broken", k + 1);
    for (const pol_node *x = p->t[k].next; x != &p->t[k]; x = x->next) {
      const arc_state *s = (const arc_state *)(const void *)x;
      if (!s->item || s->item->state != s) return pol_fail(why, len, "arc: a node's item does not own it");
      if (s->list != k) return pol_fail(why, len, "arc: item in T%d marked T%d", k + 1, s->list + 1);
      if (pol_ghosts_find(&p->ghosts, s->item->id))
        return pol_fail(why, len, "arc: item %llu is resident and a ghost", (unsigned long long)s->item->id);
      bytes += s->item->size_bytes;
    }
    if (n != p->t_n[k] || bytes != p->t_bytes[k])
      return pol_fail(why, len, "arc: T%d holds %zu items (%llu bytes), counters say %llu (%llu)", k + 1,
                      n, (unsigned long long)bytes, (unsigned long long)p->t_n[k],
                      (unsigned long long)p->t_bytes[k]);
    if (!pol_list_valid(&p->b[k], &n)) return pol_fail(why, len, "arc: B%d broken", k + 1);
    bytes = 0;
    for (const pol_node *x = p->b[k].next; x != &p->b[k]; x = x->next) {
      const pol_ghost *g = (const pol_ghost *)(const void *)((const char *)x - offsetof(pol_ghost, link));
      if (g->tag != k) return pol_fail(why, len, "arc: ghost in B%d tagged %d", k + 1, g->tag + 1);
      if (pol_ghosts_find(&p->ghosts, g->id) != g) return pol_fail(why, len, "arc: ghost not in the table");
      bytes += g->size_bytes;
    }
    if (bytes != p->b_bytes[k]) return pol_fail(why, len, "arc: B%d byte count wrong", k + 1);
    ghosts += n;
  }
  if (ghosts != p->ghosts.n) return pol_fail(why, len, "arc: %llu ghosts listed, table holds %zu",
                                             (unsigned long long)ghosts, p->ghosts.n);
  if (p->p > p->c) return pol_fail(why, len, "arc: p > c");
  if (p->c > p->capacity_bytes) return pol_fail(why, len, "arc: c above the budget");
  if (p->t_bytes[0] + p->b_bytes[0] > p->c && p->b_bytes[0])
    return pol_fail(why, len, "arc: |T1| + |B1| > c with ghosts left in B1");
  if (p->t_bytes[0] + p->t_bytes[1] + p->b_bytes[0] + p->b_bytes[1] > 2 * p->c &&
      p->b_bytes[0] + p->b_bytes[1])
    return pol_fail(why, len, "arc: directory above 2c with ghosts left");
  return SGM_OK;
}

/* The policy on its own; registered inside the hint shell (hinted.c). */
static const sgm_policy_ops arc_inner = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "arc",
    .summary = "adaptive replacement cache: recency and frequency lists, ghosts tune the split",
    .state_bytes = sizeof(arc_state),
    .create = arc_create,
    .destroy = arc_destroy,
    .on_insert = arc_insert,
    .on_access = arc_access,
    .on_remove = arc_remove,
    .reclaimable_bytes = arc_reclaimable,
    .next_victim = arc_next_victim,
    .check = arc_check,
};

POL_HINTED(sgm__policy_arc, arc_inner, arc_state, "arc", "adaptive replacement cache: recency and frequency lists, ghosts tune the split");
