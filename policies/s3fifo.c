/*
 * s3fifo.c — S3-FIFO (Yang, Zhang, Qiu, Yue, Vinayak, "FIFO queues are all
 * you need for cache eviction", SOSP 2023), counted in bytes.
 *
 * Design note. Three FIFO queues: S, small, about 10% of the bytes held; M,
 * main, the rest; G, ghosts: ids (no data) of buffers S evicted, about as many
 * bytes as M holds. A new buffer enters S, or M straight away when its ghost
 * is in G. A hit only bumps a 2-bit frequency (0..3): nothing moves, FIFO's
 * lazy promotion. Eviction ("quick demotion"):
 *
 *   - while S holds at least 10% (or M is empty): look at S's tail; if it was
 *     hit since it came in, move it to M's head (frequency reset) and look
 *     again; else it is the victim, and its id goes to G.
 *   - otherwise look at M's tail: if its frequency is above 0, decrement it
 *     and move it to M's head (reinsertion); else it is the victim.
 *
 *          G: head … … tail (forgotten)
 *               ↑ ids of S's victims              ghost hit ─┐
 *     new → S: head … … tail ─(hit)→ M: head … … tail ─→ victim
 *                          └─(not hit)→ victim   ↑   └─(freq > 0: freq−1)┘
 *
 * Most buffers in skewed workloads are used once in a short window; S lets
 * them go after a short stay, so a one-time scan never reaches M. Every step
 * of a victim search either returns, moves an item from S to M (once per
 * insertion) or spends a frequency point (earned by a hit): O(1) amortised.
 *
 * Pinned items keep their place (a hit costs only the frequency bump); when a
 * search meets one at a tail it takes it out (its place is lost). Used, it
 * comes back at M's head (it was hit); restored unused, at its queue's tail.
 * The 10% is of the bytes S and M hold now, not of the tier's budget, so that
 * a tier mostly taken by fixed allocations still has a small queue that
 * filters; G's limit is 90% of the most bytes S and M have held.
 */
#include "builtin.h"
#include "common.h"

enum { S3_SMALL = 0, S3_MAIN = 1 };
/* A hit saturates the frequency here (2 bits, as in the paper). */
#define S3_MAX_FREQ 3u
/* S holds 10% of the bytes: the paper's default, robust across its traces. */
#define S3_SMALL_PERCENT 10u

typedef struct s3_state {
  pol_node node;          /* in S or M; linked while pinned unless a search passed it */
  sgm_policy_item *item;  /* back to the item */
  uint8_t queue;          /* S3_SMALL or S3_MAIN */
  uint8_t freq;           /* hits since it entered its queue, saturating at 3 */
  uint8_t pinned;         /* out (on_remove PIN) until access, restore or drop */
} s3_state;

typedef struct s3_policy {
  pol_node q[2];           /* S and M: head = newest */
  uint64_t q_bytes[2];     /* unpinned bytes in each */
  uint64_t q_n[2];         /* unpinned items in each */
  uint64_t n_pinned;       /* pinned items still holding a place */
  pol_node g;              /* ghost FIFO: head = newest */
  uint64_t g_bytes;        /* sizes of the ghosts */
  pol_ghosts ghosts;       /* ghosts by id */
  uint64_t peak_bytes;     /* the most S + M have held */
} s3_policy;

static s3_state *s3_of(pol_node *n) { return (s3_state *)(void *)n; }

static sgm_status s3_create(const sgm_policy_params *params, sgm_policy **out) {
  (void)params;
  s3_policy *p = (s3_policy *)calloc(1, sizeof *p);
  *out = NULL;
  if (!p) return SGM_ERR_NOMEM;
  if (!pol_ghosts_init(&p->ghosts)) {
    free(p);
    return SGM_ERR_NOMEM;
  }
  pol_list_init(&p->q[0]);
  pol_list_init(&p->q[1]);
  pol_list_init(&p->g);
  *out = (sgm_policy *)p;
  return SGM_OK;
}

static void s3_destroy(sgm_policy *pp) {
  s3_policy *p = (s3_policy *)pp;
  pol_ghosts_fini(&p->ghosts);
  free(p);
}

static void s3_count(s3_policy *p, s3_state *s, int sign) {
  if (sign > 0) {
    p->q_bytes[s->queue] += s->item->size_bytes;
    p->q_n[s->queue]++;
    uint64_t held = p->q_bytes[0] + p->q_bytes[1];
    if (held > p->peak_bytes) p->peak_bytes = held;
  } else {
    p->q_bytes[s->queue] -= s->item->size_bytes;
    p->q_n[s->queue]--;
  }
}

static void s3_ghost_trim(s3_policy *p) {
  uint64_t limit = p->peak_bytes / 100 * (100 - S3_SMALL_PERCENT);
  pol_node *t;
  while (p->g_bytes > limit && (t = pol_list_tail(&p->g)) != NULL) {
    pol_ghost *e = pol_ghost_of(t);
    pol_unlink(t);
    p->g_bytes -= e->size_bytes;
    pol_ghosts_del(&p->ghosts, e);
  }
}

static void s3_insert(sgm_policy *pp, sgm_policy_item *it, sgm_policy_insert how) {
  s3_policy *p = (s3_policy *)pp;
  s3_state *s = (s3_state *)it->state;
  if (how == SGM_POLICY_INSERT_RESTORE) {
    pol_assert(s->item == it && s->pinned);
    s->pinned = 0;
    if (pol_linked(&s->node)) p->n_pinned--;
    else pol_push_tail(&p->q[s->queue], &s->node);
    s3_count(p, s, +1);
    return;
  }
  s->item = it;
  s->freq = 0;
  s->pinned = 0;
  s->queue = S3_SMALL;
  pol_ghost *g = pol_ghosts_find(&p->ghosts, it->id);
  if (g) {
    s->queue = S3_MAIN; /* S let it go too early: straight to M */
    pol_unlink(&g->link);
    p->g_bytes -= g->size_bytes;
    pol_ghosts_del(&p->ghosts, g);
  }
  pol_push_head(&p->q[s->queue], &s->node);
  s3_count(p, s, +1);
}

static void s3_access(sgm_policy *pp, sgm_policy_item *it) {
  s3_policy *p = (s3_policy *)pp;
  s3_state *s = (s3_state *)it->state;
  pol_assert(s->item == it && s->pinned);
  s->pinned = 0;
  if (s->freq < S3_MAX_FREQ) s->freq++;
  if (pol_linked(&s->node)) {
    p->n_pinned--;
  } else {
    /* A search passed it while in use: treat it as the hit item it is. */
    s->queue = S3_MAIN;
    pol_push_head(&p->q[S3_MAIN], &s->node);
  }
  s3_count(p, s, +1);
}

static void s3_remove(sgm_policy *pp, sgm_policy_item *it, sgm_policy_remove why) {
  s3_policy *p = (s3_policy *)pp;
  s3_state *s = (s3_state *)it->state;
  pol_assert(s->item == it);
  if (s->pinned) {
    pol_assert(why == SGM_POLICY_REMOVE_DROP);
    pol_drop_pinned(&s->node, &s->pinned, &p->n_pinned);
    return;
  }
  s3_count(p, s, -1);
  if (why == SGM_POLICY_REMOVE_PIN) {
    s->pinned = 1;
    p->n_pinned++;
    return;
  }
  pol_unlink(&s->node);
  if (why != SGM_POLICY_REMOVE_EVICT || s->queue != S3_SMALL) return;
  pol_ghost *old = pol_ghosts_find(&p->ghosts, it->id);
  if (old) {
    pol_unlink(&old->link);
    p->g_bytes -= old->size_bytes;
    pol_ghosts_del(&p->ghosts, old);
  }
  pol_ghost *g = pol_ghosts_add(&p->ghosts, it->id, it->size_bytes, 0);
  if (!g) return; /* out of memory: not remembered */
  pol_push_head(&p->g, &g->link);
  p->g_bytes += it->size_bytes;
  s3_ghost_trim(p);
}

static uint64_t s3_reclaimable(const sgm_policy *pp) {
  const s3_policy *p = (const s3_policy *)pp;
  return p->q_bytes[0] + p->q_bytes[1];
}

static sgm_policy_item *s3_next_victim(sgm_policy *pp, uint64_t bytes_wanted) {
  s3_policy *p = (s3_policy *)pp;
  (void)bytes_wanted;
  for (;;) {
    uint64_t held = p->q_bytes[0] + p->q_bytes[1];
    bool small = !pol_list_empty(&p->q[S3_SMALL]) &&
                 (p->q_bytes[S3_SMALL] * 100 >= held * S3_SMALL_PERCENT || p->q_n[S3_MAIN] == 0);
    pol_node *t = pol_list_tail(&p->q[small ? S3_SMALL : S3_MAIN]);
    if (!t) {
      t = pol_list_tail(&p->q[S3_SMALL]);
      if (!t) return NULL;
      small = true;
    }
    s3_state *s = s3_of(t);
    if (s->pinned) {
      pol_unlink(t); /* in use: its place is lost */
      p->n_pinned--;
      continue;
    }
    if (s->freq == 0) return s->item;
    pol_unlink(t);
    if (small) {
      s3_count(p, s, -1);
      s->queue = S3_MAIN;
      s->freq = 0;
      s3_count(p, s, +1);
    } else {
      s->freq--;
    }
    pol_push_head(&p->q[S3_MAIN], t);
  }
}

static sgm_status s3_check(const sgm_policy *pp, char *why, size_t len) {
  const s3_policy *p = (const s3_policy *)pp;
  uint64_t pinned = 0;
  for (int k = 0; k < 2; k++) {
    size_t n;
    if (!pol_list_valid(&p->q[k], &n)) return pol_fail(why, len, "s3fifo: queue %d broken", k);
    uint64_t bytes = 0, un = 0;
    for (const pol_node *x = p->q[k].next; x != &p->q[k]; x = x->next) {
      const s3_state *s = (const s3_state *)(const void *)x;
      if (!s->item || s->item->state != s) return pol_fail(why, len, "s3fifo: a node's item does not own it");
      if (s->queue != k) return pol_fail(why, len, "s3fifo: item in queue %d marked %d", k, s->queue);
      if (s->freq > S3_MAX_FREQ || s->pinned > 1) return pol_fail(why, len, "s3fifo: bad freq or flag");
      if (pol_ghosts_find(&p->ghosts, s->item->id))
        return pol_fail(why, len, "s3fifo: item %llu is resident and a ghost", (unsigned long long)s->item->id);
      if (s->pinned) {
        pinned++;
        continue;
      }
      un++;
      bytes += s->item->size_bytes;
    }
    if (un != p->q_n[k] || bytes != p->q_bytes[k])
      return pol_fail(why, len, "s3fifo: queue %d holds %llu items (%llu bytes), counters say %llu (%llu)",
                      k, (unsigned long long)un, (unsigned long long)bytes,
                      (unsigned long long)p->q_n[k], (unsigned long long)p->q_bytes[k]);
  }
  if (pinned != p->n_pinned) return pol_fail(why, len, "s3fifo: pinned count wrong");
  size_t ng;
  if (!pol_list_valid(&p->g, &ng)) return pol_fail(why, len, "s3fifo: ghost queue broken");
  uint64_t gb = 0;
  for (const pol_node *x = p->g.next; x != &p->g; x = x->next) {
    const pol_ghost *g = (const pol_ghost *)(const void *)((const char *)x - offsetof(pol_ghost, link));
    if (pol_ghosts_find(&p->ghosts, g->id) != g) return pol_fail(why, len, "s3fifo: ghost not in the table");
    gb += g->size_bytes;
  }
  if (gb != p->g_bytes || ng != p->ghosts.n) return pol_fail(why, len, "s3fifo: ghost counters wrong");
  if (p->g_bytes > p->peak_bytes) return pol_fail(why, len, "s3fifo: ghosts above their limit");
  return SGM_OK;
}

/* The policy on its own; registered inside the hint shell (hinted.c). */
static const sgm_policy_ops s3fifo_inner = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "s3fifo",
    .summary = "S3-FIFO: small, main and ghost FIFO queues; one-hit buffers leave quickly",
    .state_bytes = sizeof(s3_state),
    .create = s3_create,
    .destroy = s3_destroy,
    .on_insert = s3_insert,
    .on_access = s3_access,
    .on_remove = s3_remove,
    .reclaimable_bytes = s3_reclaimable,
    .next_victim = s3_next_victim,
    .check = s3_check,
};

POL_HINTED(sgm__policy_s3fifo, s3fifo_inner, s3_state, "s3fifo", "S3-FIFO: small, main and ghost FIFO queues; one-hit buffers leave quickly");
