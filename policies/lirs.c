/*
 * lirs.c — Low Inter-reference Recency Set (Song Jiang & Xiaodong Zhang,
 * "LIRS: An Efficient Low Inter-reference Recency Set Replacement Policy to
 * Improve Buffer Cache Performance", SIGMETRICS 2002), counted in bytes.
 *
 * Design note. A buffer's inter-reference recency (IRR) is the number of
 * other buffers used between its last two uses. LIRS keeps the buffers of low
 * IRR (the LIR set, about 1 - Lhirs of the cache) resident and lets only the
 * high-IRR ones (HIR) compete for the rest, a small share Lhirs:
 *
 *   S (recency stack; LIR, resident HIR, ghost HIR)       Q (resident HIR only)
 *   top  x7:LIR  g3:ghost  x2:HIR  x9:LIR  …  x4:LIR bottom    front x5 x2 x8 end
 *        ^ newest                           ^ always LIR       ^ next victim  ^ newest
 *
 *  - S orders everything LIRS still knows about by recency. Its bottom is
 *    always a LIR buffer ("stack pruning" drops the HIR entries below the
 *    oldest LIR one), so being in S means "used more recently than the
 *    oldest LIR buffer": an IRR lower than the largest LIR recency.
 *  - Q holds the resident HIR buffers in order of use; victims come from
 *    its front. An evicted HIR buffer still in S stays there as a ghost
 *    (id and size only): if it comes back while its ghost is in S, its IRR
 *    beat the oldest LIR buffer's recency, so it enters as LIR, and the
 *    bottom LIR buffer is demoted to the end of Q (and out of S).
 *  - A hit on a LIR buffer moves it to the top of S (pruning if it was the
 *    bottom); a hit on a resident HIR buffer in S promotes it to LIR (the
 *    same demotion follows); one not in S stays HIR, to S's top and Q's end.
 *  - A miss with no ghost enters as HIR (S top, Q end), or as LIR while the
 *    LIR set is below its target (warm-up).
 *
 * Lhirs is 65% here, not the paper's 1%: on the Mooncake conversation trace
 * a buffer used once is worth more than an old LIR one, and a 1% Q evicts
 * newcomers before their second use (23.0% hits at 10% VRAM against 29.0%;
 * docs/policies.md has the sweep; 65% rather than 50% since issue 30: better
 * at 5, 10 and 25% of the blocks, and with residency hints on both Mooncake
 * traces, worse only at 1%). The algorithm is the paper's either way.
 *
 * Bytes: c, the cache size, is the most bytes this instance has held (the
 * tier's effective size for movable buffers), never above the tier's budget
 * (as arc.c). The LIR set is kept at or below (1 - Lhirs) · c bytes by
 * demoting from S's bottom; with equal sizes this is the paper's algorithm
 * with L_lirs = (1 - Lhirs) · c / size. Ghosts are bounded: their bytes stay
 * under LIRS_GHOST_MULT · c, the oldest ghost (by the time it became one, a
 * FIFO of its own) leaving first, so memory is O(buffers held).
 *
 * sgm's order of events: a pinned buffer (acquired, being moved) keeps its
 * place in S and its LIR/HIR status, but leaves Q, so next_victim never offers
 * it; if the bottom LIR is demoted while pinned it leaves S and rejoins Q when
 * it comes back. A victim restored unused goes back to Q's front. sgm evicts
 * before it inserts the missing buffer, so next_victim may find Q empty (all
 * of the cache LIR, e.g. when the tier's room for movable buffers shrank):
 * it then demotes the bottom LIR buffer first. Every operation is O(1)
 * amortised: pruning removes each entry at most once per entry pushed.
 *
 * S holds two kinds of entries, resident states and ghosts; both begin with
 * lirs_hdr, whose kind tells them apart. Ghosts are found by id in a chained
 * hash table (ids are never reused within a context).
 */
#include "builtin.h"
#include "common.h"

/* The HIR share of the cache (Lhirs), in parts per million, and the ghost
 * bound in multiples of c. Tuned on the Mooncake conversation trace (see
 * docs/policies.md); -DLIRS_TUNING reads both from the environment. */
#ifndef LIRS_HIR_PPM
#define LIRS_HIR_PPM 650000u
#endif
#ifndef LIRS_GHOST_MULT
#define LIRS_GHOST_MULT 2u
#endif

enum { LIRS_RES = 0, LIRS_GHOST = 1 };
enum { LIRS_LIR = 0, LIRS_HIR = 1 };

typedef struct lirs_hdr {
  pol_node s;    /* in S, or unlinked */
  uint8_t kind;  /* LIRS_RES or LIRS_GHOST */
} lirs_hdr;

typedef struct lirs_state {
  lirs_hdr h;            /* S membership */
  uint8_t status;        /* LIRS_LIR or LIRS_HIR */
  uint8_t pinned;        /* out of the instance for a while (on_remove PIN) */
  pol_node q;            /* in Q (resident, unpinned HIR only) */
  sgm_policy_item *item; /* back to the item */
} lirs_state;

typedef struct lirs_ghost {
  pol_ghost g; /* id, size when evicted, hash chain; g.link: in the ghost FIFO, head = newest */
  lirs_hdr h;  /* in S (a ghost is always in S) */
} lirs_ghost;

typedef struct lirs_policy {
  pol_node s;              /* stack S: head = top (newest), tail = bottom */
  pol_node q;              /* list Q: head = end (newest), tail = front (next victim) */
  pol_node ages;           /* every ghost, head = newest */
  uint64_t lir_bytes, lir_n;   /* the LIR set (pinned ones included; all in S) */
  uint64_t hir_bytes, hir_n;   /* resident HIR (pinned ones included) */
  uint64_t pinned_bytes;       /* of the above, pinned */
  uint64_t q_n;                /* entries of Q */
  uint64_t ghost_bytes;     /* of the ghosts (ghosts.n of them) */
  uint64_t c;              /* cache size: the most bytes held, at most the budget */
  uint64_t capacity_bytes; /* the tier's budget */
  uint32_t hir_ppm;        /* Lhirs */
  uint32_t ghost_mult;     /* ghosts' bound in multiples of c */
  pol_ghosts ghosts;       /* every ghost by id (entries: lirs_ghost) */
} lirs_policy;

/* ---- ghosts (common.h's table, each entry a lirs_ghost) ---- */

static lirs_ghost *lirs_ghost_of(const lirs_hdr *h) {
  return (lirs_ghost *)(void *)((char *)(uintptr_t)h - offsetof(lirs_ghost, h));
}

static lirs_ghost *lirs_ghost_find(const lirs_policy *p, uint64_t id) {
  return (lirs_ghost *)(void *)pol_ghosts_find(&p->ghosts, id);
}

/* A new ghost for id, in the table and the age FIFO but not in S; NULL when
 * out of memory. */
static lirs_ghost *lirs_ghost_new(lirs_policy *p, uint64_t id, uint64_t size) {
  lirs_ghost *g = (lirs_ghost *)(void *)pol_ghosts_add(&p->ghosts, id, size, LIRS_GHOST);
  if (!g) return NULL;
  g->h.kind = LIRS_GHOST;
  g->h.s.prev = g->h.s.next = NULL;
  pol_push_head(&p->ages, &g->g.link);
  p->ghost_bytes += size;
  return g;
}

/* Forget a ghost: out of S, the FIFO and the table. */
static void lirs_ghost_del(lirs_policy *p, lirs_ghost *g) {
  if (pol_linked(&g->h.s)) pol_unlink(&g->h.s);
  pol_unlink(&g->g.link);
  p->ghost_bytes -= g->g.size_bytes;
  pol_ghosts_del(&p->ghosts, &g->g);
}

/* Keep the ghosts under ghost_mult · c bytes, oldest first. */
static void lirs_ghost_trim(lirs_policy *p) {
  uint64_t limit = p->c * p->ghost_mult;
  while (p->ghost_bytes > limit) {
    pol_node *t = pol_list_tail(&p->ages);
    if (!t) break;
    lirs_ghost_del(p, (lirs_ghost *)(void *)pol_ghost_of(t));
  }
}

/* ---- S and Q ---- */

static lirs_state *lirs_res(pol_node *n) { return (lirs_state *)(void *)n; }

static uint64_t lirs_lir_target(const lirs_policy *p) {
  uint64_t hir = p->c / 1000000u * p->hir_ppm + p->c % 1000000u * p->hir_ppm / 1000000u;
  return p->c - hir;
}

/* Stack pruning: drop the HIR entries at S's bottom until a LIR one is there. */
static void lirs_prune(lirs_policy *p) {
  for (;;) {
    pol_node *b = pol_list_tail(&p->s);
    if (!b) return;
    lirs_hdr *h = (lirs_hdr *)(void *)b;
    if (h->kind == LIRS_GHOST) {
      lirs_ghost_del(p, lirs_ghost_of(h));
      continue;
    }
    if (lirs_res(b)->status == LIRS_LIR) return;
    pol_unlink(b); /* a resident HIR buffer: stays in Q, leaves S */
  }
}

/* Q's end (newest) or front (next victim), when the buffer is not pinned. */
static void lirs_q_add(lirs_policy *p, lirs_state *s, bool at_end) {
  if (s->pinned) return;
  if (at_end) pol_push_head(&p->q, &s->q);
  else pol_push_tail(&p->q, &s->q);
  p->q_n++;
}

static void lirs_q_del(lirs_policy *p, lirs_state *s) {
  if (!pol_linked(&s->q)) return;
  pol_unlink(&s->q);
  p->q_n--;
}

/* The bottom LIR buffer of S becomes HIR: out of S, to Q's end. */
static bool lirs_demote_bottom(lirs_policy *p) {
  pol_node *b = pol_list_tail(&p->s);
  if (!b) return false;
  lirs_state *s = lirs_res(b); /* pruned: the bottom is a LIR resident */
  pol_assert(s->h.kind == LIRS_RES && s->status == LIRS_LIR);
  pol_unlink(b);
  s->status = LIRS_HIR;
  p->lir_bytes -= s->item->size_bytes;
  p->lir_n--;
  p->hir_bytes += s->item->size_bytes;
  p->hir_n++;
  lirs_q_add(p, s, true);
  lirs_prune(p);
  return true;
}

/* Keep the LIR set within its target (never emptying it for one buffer). */
static void lirs_fit_lir(lirs_policy *p) {
  uint64_t target = lirs_lir_target(p);
  while (p->lir_bytes > target && p->lir_n > 1 && lirs_demote_bottom(p)) {
  }
}

static void lirs_grow_c(lirs_policy *p) {
  uint64_t held = p->lir_bytes + p->hir_bytes;
  if (held > p->c) p->c = held < p->capacity_bytes ? held : p->capacity_bytes;
}

static void lirs_make_lir(lirs_policy *p, lirs_state *s) {
  s->status = LIRS_LIR;
  p->lir_bytes += s->item->size_bytes;
  p->lir_n++;
}

static void lirs_make_hir(lirs_policy *p, lirs_state *s) {
  s->status = LIRS_HIR;
  p->hir_bytes += s->item->size_bytes;
  p->hir_n++;
}

/* ---- the vtable ---- */

static sgm_status lirs_create(const sgm_policy_params *params, sgm_policy **out) {
  lirs_policy *p = (lirs_policy *)calloc(1, sizeof *p);
  *out = NULL;
  if (!p) return SGM_ERR_NOMEM;
  if (!pol_ghosts_init_ex(&p->ghosts, sizeof(lirs_ghost))) {
    free(p);
    return SGM_ERR_NOMEM;
  }
  pol_list_init(&p->s);
  pol_list_init(&p->q);
  pol_list_init(&p->ages);
  p->capacity_bytes = params->capacity_bytes ? params->capacity_bytes : UINT64_MAX;
  p->hir_ppm = LIRS_HIR_PPM;
  p->ghost_mult = LIRS_GHOST_MULT;
#ifdef LIRS_TUNING
  /* Experiments only (never in a build of sgm). */
  const char *v;
  if ((v = getenv("LIRS_HIR_PPM"))) p->hir_ppm = (uint32_t)strtoul(v, NULL, 10);
  if ((v = getenv("LIRS_GHOST_MULT"))) p->ghost_mult = (uint32_t)strtoul(v, NULL, 10);
#endif
  if (p->hir_ppm > 1000000u) p->hir_ppm = 1000000u;
  *out = (sgm_policy *)p;
  return SGM_OK;
}

static void lirs_destroy(sgm_policy *pp) {
  lirs_policy *p = (lirs_policy *)pp;
  pol_ghosts_fini(&p->ghosts);
  free(p);
}

static void lirs_insert(sgm_policy *pp, sgm_policy_item *it, sgm_policy_insert how) {
  lirs_policy *p = (lirs_policy *)pp;
  lirs_state *s = (lirs_state *)it->state;
  if (how == SGM_POLICY_INSERT_RESTORE) {
    /* Back unused: a LIR buffer never left S; a HIR one goes to Q's front. */
    pol_assert(s->item == it && s->pinned);
    s->pinned = 0;
    p->pinned_bytes -= it->size_bytes;
    if (s->status == LIRS_HIR) lirs_q_add(p, s, false);
    return;
  }
  memset(s, 0, sizeof *s);
  s->h.kind = LIRS_RES;
  s->item = it;
  lirs_ghost *g = lirs_ghost_find(p, it->id);
  if (g) {
    /* Back while its ghost is in S: low IRR, a LIR buffer; its ghost's place
     * in S is taken by the top. */
    lirs_ghost_del(p, g);
    lirs_make_lir(p, s);
    pol_push_head(&p->s, &s->h.s);
    lirs_grow_c(p);
    lirs_fit_lir(p);
    lirs_prune(p);
    return;
  }
  pol_push_head(&p->s, &s->h.s);
  if (p->lir_bytes + it->size_bytes <= lirs_lir_target(p) || p->lir_n == 0) {
    lirs_make_lir(p, s); /* warm-up: the LIR set is not full */
  } else {
    lirs_make_hir(p, s);
    lirs_q_add(p, s, true);
  }
  lirs_grow_c(p);
  lirs_fit_lir(p);
}

static void lirs_access(sgm_policy *pp, sgm_policy_item *it) {
  lirs_policy *p = (lirs_policy *)pp;
  lirs_state *s = (lirs_state *)it->state;
  pol_assert(s->item == it && s->pinned && !pol_linked(&s->q));
  s->pinned = 0;
  p->pinned_bytes -= it->size_bytes;
  if (s->status == LIRS_LIR) {
    pol_unlink(&s->h.s);
    pol_push_head(&p->s, &s->h.s);
    lirs_prune(p); /* it may have been the bottom */
    return;
  }
  if (pol_linked(&s->h.s)) {
    /* A HIR hit in S: its IRR is below the oldest LIR's recency. */
    pol_unlink(&s->h.s);
    pol_push_head(&p->s, &s->h.s);
    p->hir_bytes -= it->size_bytes;
    p->hir_n--;
    lirs_make_lir(p, s);
    lirs_fit_lir(p);
    lirs_prune(p);
    return;
  }
  pol_push_head(&p->s, &s->h.s);
  if (p->lir_n == 0 || p->lir_bytes + it->size_bytes <= lirs_lir_target(p)) {
    /* Warm-up (or no LIR buffer left to keep S's bottom LIR): promoted. */
    p->hir_bytes -= it->size_bytes;
    p->hir_n--;
    lirs_make_lir(p, s);
    return;
  }
  lirs_q_add(p, s, true); /* stays HIR */
}

static void lirs_remove(sgm_policy *pp, sgm_policy_item *it, sgm_policy_remove why) {
  lirs_policy *p = (lirs_policy *)pp;
  lirs_state *s = (lirs_state *)it->state;
  pol_assert(s->item == it);
  if (why == SGM_POLICY_REMOVE_PIN) {
    pol_assert(!s->pinned);
    lirs_q_del(p, s);
    s->pinned = 1;
    p->pinned_bytes += it->size_bytes;
    return;
  }
  if (s->pinned) {
    s->pinned = 0;
    p->pinned_bytes -= it->size_bytes;
  }
  lirs_q_del(p, s);
  bool in_s = pol_linked(&s->h.s);
  if (s->status == LIRS_LIR) {
    p->lir_bytes -= it->size_bytes;
    p->lir_n--;
  } else {
    p->hir_bytes -= it->size_bytes;
    p->hir_n--;
  }
  if (why == SGM_POLICY_REMOVE_EVICT && s->status == LIRS_HIR && in_s) {
    /* A ghost takes its place in S. */
    lirs_ghost *g = lirs_ghost_new(p, it->id, it->size_bytes);
    if (g) pol_replace(&s->h.s, &g->h.s);
    else pol_unlink(&s->h.s);
    lirs_ghost_trim(p);
  } else if (in_s) {
    pol_unlink(&s->h.s);
  }
  lirs_prune(p);
}

static uint64_t lirs_reclaimable(const sgm_policy *pp) {
  const lirs_policy *p = (const lirs_policy *)pp;
  return p->lir_bytes + p->hir_bytes - p->pinned_bytes;
}

static sgm_policy_item *lirs_next_victim(sgm_policy *pp, uint64_t bytes_wanted) {
  lirs_policy *p = (lirs_policy *)pp;
  (void)bytes_wanted;
  /* Q empty: the whole cache is LIR (or pinned); demote from S's bottom. */
  while (pol_list_empty(&p->q) && lirs_demote_bottom(p)) {
  }
  pol_node *f = pol_list_tail(&p->q);
  return f ? ((lirs_state *)(void *)((char *)f - offsetof(lirs_state, q)))->item : NULL;
}

static sgm_status lirs_check(const sgm_policy *pp, char *why, size_t len) {
  const lirs_policy *p = (const lirs_policy *)pp;
  size_t n;
  if (!pol_list_valid(&p->s, &n)) return pol_fail(why, len, "lirs: S broken");
  if (!pol_list_valid(&p->q, &n)) return pol_fail(why, len, "lirs: Q broken");
  if (n != p->q_n) return pol_fail(why, len, "lirs: Q holds %zu, counter %llu", n, (unsigned long long)p->q_n);
  if (!pol_list_valid(&p->ages, &n)) return pol_fail(why, len, "lirs: ghost FIFO broken");
  if (n != p->ghosts.n) return pol_fail(why, len, "lirs: %zu ghosts listed, counter %llu", n,
                                       (unsigned long long)p->ghosts.n);
  uint64_t lir_n = 0, lir_b = 0, gn = 0, gb = 0;
  const pol_node *bottom = p->s.prev;
  if (bottom != &p->s) {
    const lirs_hdr *h = (const lirs_hdr *)(const void *)bottom;
    if (h->kind != LIRS_RES || ((const lirs_state *)(const void *)h)->status != LIRS_LIR)
      return pol_fail(why, len, "lirs: S's bottom is not a LIR buffer");
  }
  for (const pol_node *x = p->s.next; x != &p->s; x = x->next) {
    const lirs_hdr *h = (const lirs_hdr *)(const void *)x;
    if (h->kind == LIRS_GHOST) {
      const lirs_ghost *g = lirs_ghost_of(h);
      if (lirs_ghost_find(p, g->g.id) != g) return pol_fail(why, len, "lirs: ghost not in the table");
      gn++;
      gb += g->g.size_bytes;
      continue;
    }
    if (h->kind != LIRS_RES) return pol_fail(why, len, "lirs: bad entry kind %d in S", h->kind);
    const lirs_state *s = (const lirs_state *)(const void *)h;
    if (!s->item || s->item->state != s) return pol_fail(why, len, "lirs: a node's item does not own it");
    if (lirs_ghost_find(p, s->item->id))
      return pol_fail(why, len, "lirs: item %llu is resident and a ghost", (unsigned long long)s->item->id);
    if (s->status == LIRS_LIR) {
      lir_n++;
      lir_b += s->item->size_bytes;
      if (pol_linked(&s->q)) return pol_fail(why, len, "lirs: a LIR buffer in Q");
    } else if (s->status != LIRS_HIR) {
      return pol_fail(why, len, "lirs: bad status %d", s->status);
    } else if (!s->pinned && !pol_linked(&s->q)) {
      return pol_fail(why, len, "lirs: an idle resident HIR buffer not in Q");
    }
  }
  if (lir_n != p->lir_n || lir_b != p->lir_bytes)
    return pol_fail(why, len, "lirs: S holds %llu LIR buffers (%llu bytes), counters say %llu (%llu)",
                    (unsigned long long)lir_n, (unsigned long long)lir_b, (unsigned long long)p->lir_n,
                    (unsigned long long)p->lir_bytes);
  if (gn != p->ghosts.n || gb != p->ghost_bytes)
    return pol_fail(why, len, "lirs: S holds %llu ghosts (%llu bytes), counters say %llu (%llu)",
                    (unsigned long long)gn, (unsigned long long)gb, (unsigned long long)p->ghosts.n,
                    (unsigned long long)p->ghost_bytes);
  uint64_t qb = 0;
  for (const pol_node *x = p->q.next; x != &p->q; x = x->next) {
    const lirs_state *s = (const lirs_state *)(const void *)((const char *)x - offsetof(lirs_state, q));
    if (!s->item || s->item->state != s) return pol_fail(why, len, "lirs: a Q node's item does not own it");
    if (s->h.kind != LIRS_RES || s->status != LIRS_HIR || s->pinned)
      return pol_fail(why, len, "lirs: Q holds a buffer that is not an idle resident HIR one");
    qb += s->item->size_bytes;
  }
  if (qb > p->hir_bytes) return pol_fail(why, len, "lirs: Q holds more bytes than the HIR set");
  if (p->pinned_bytes > p->lir_bytes + p->hir_bytes) return pol_fail(why, len, "lirs: pinned bytes too large");
  if (p->c > p->capacity_bytes) return pol_fail(why, len, "lirs: c above the budget");
  if (p->ghost_bytes > p->c * p->ghost_mult) return pol_fail(why, len, "lirs: ghosts above their bound");
  return SGM_OK;
}

/* The policy on its own; registered inside the hint shell (hinted.c). */
static const sgm_policy_ops lirs_inner = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "lirs",
    .summary = "low inter-reference recency set: a LIR set by reuse distance, a small HIR queue with ghosts",
    .state_bytes = sizeof(lirs_state),
    .create = lirs_create,
    .destroy = lirs_destroy,
    .on_insert = lirs_insert,
    .on_access = lirs_access,
    .on_remove = lirs_remove,
    .reclaimable_bytes = lirs_reclaimable,
    .next_victim = lirs_next_victim,
    .check = lirs_check,
};

POL_HINTED(sgm__policy_lirs, lirs_inner, lirs_state, "lirs", "low inter-reference recency set: a LIR set by reuse distance, a small HIR queue with ghosts");
