/*
 * clock.c — CLOCK (second chance), as a FIFO with reinsertion.
 *
 * Design note. The ring is a list; the hand points at the tail. New items
 * enter at the head, just behind the hand, with their reference bit clear. A
 * hit only sets the bit: the item keeps its place (that is CLOCK's point, and
 * why it is cheaper than LRU). To find a victim the hand looks at the tail: a
 * set bit is cleared and the item goes to the head (the hand moves past it); a
 * clear bit makes it the victim. Each bit cleared was set by a hit, so a
 * search is O(1) amortised; a big request takes several tails in a row.
 *
 *              hand
 *               ↓
 *     head → b5 → b3* → b8 → b1* ← tail        (* = referenced)
 *       ↑ new items enter here                  ↓ hand examines here
 *
 * Pinned items (acquired while released elsewhere in the ring) keep their
 * node in the ring, marked, so a hit costs nothing but the mark; when the hand
 * meets a pinned item it takes it out of the ring (its place is lost), and the
 * item comes back at the head when used, or at the tail when restored unused.
 */
#include "builtin.h"
#include "common.h"

typedef struct clock_state {
  pol_node node;          /* in the ring; linked while pinned unless the hand passed it */
  sgm_policy_item *item;  /* back to the item */
  uint8_t ref;            /* the reference bit */
  uint8_t pinned;         /* out (on_remove PIN) until access, restore or drop */
} clock_state;

typedef struct clock_policy {
  pol_node ring;        /* head = just behind the hand; tail = under the hand */
  uint64_t n;           /* unpinned items in the ring */
  uint64_t bytes;       /* their sizes */
  uint64_t n_pinned;    /* pinned items still holding a place in the ring */
} clock_policy;

static clock_state *clock_of(pol_node *n) { return (clock_state *)(void *)n; }

static sgm_status clock_create(const sgm_policy_params *params, sgm_policy **out) {
  (void)params;
  clock_policy *p = (clock_policy *)calloc(1, sizeof *p);
  *out = (sgm_policy *)p;
  if (!p) return SGM_ERR_NOMEM;
  pol_list_init(&p->ring);
  return SGM_OK;
}

static void clock_destroy(sgm_policy *pp) { free(pp); }

/* A pinned item comes back: in its old place when it still has one. */
static void clock_unpin(clock_policy *p, clock_state *s, bool used) {
  pol_assert(s->pinned);
  s->pinned = 0;
  if (pol_linked(&s->node)) {
    p->n_pinned--;
  } else if (used) {
    pol_push_head(&p->ring, &s->node);
  } else {
    pol_push_tail(&p->ring, &s->node);
  }
  if (used) s->ref = 1;
  p->n++;
  p->bytes += s->item->size_bytes;
}

static void clock_insert(sgm_policy *pp, sgm_policy_item *it, sgm_policy_insert how) {
  clock_policy *p = (clock_policy *)pp;
  clock_state *s = (clock_state *)it->state;
  if (how == SGM_POLICY_INSERT_RESTORE) {
    clock_unpin(p, s, false);
    return;
  }
  s->item = it;
  s->ref = 0;
  s->pinned = 0;
  pol_push_head(&p->ring, &s->node);
  p->n++;
  p->bytes += it->size_bytes;
}

static void clock_access(sgm_policy *pp, sgm_policy_item *it) {
  clock_unpin((clock_policy *)pp, (clock_state *)it->state, true);
}

static void clock_remove(sgm_policy *pp, sgm_policy_item *it, sgm_policy_remove why) {
  clock_policy *p = (clock_policy *)pp;
  clock_state *s = (clock_state *)it->state;
  pol_assert(s->item == it);
  if (s->pinned) {
    pol_assert(why == SGM_POLICY_REMOVE_DROP);
    pol_drop_pinned(&s->node, &s->pinned, &p->n_pinned);
    return;
  }
  p->n--;
  p->bytes -= it->size_bytes;
  if (why == SGM_POLICY_REMOVE_PIN) {
    s->pinned = 1; /* keeps its place */
    p->n_pinned++;
  } else {
    pol_unlink(&s->node);
  }
}

static uint64_t clock_reclaimable(const sgm_policy *pp) { return ((const clock_policy *)pp)->bytes; }

static sgm_policy_item *clock_next_victim(sgm_policy *pp, uint64_t bytes_wanted) {
  clock_policy *p = (clock_policy *)pp;
  (void)bytes_wanted;
  pol_node *t;
  while ((t = pol_list_tail(&p->ring)) != NULL) {
    clock_state *s = clock_of(t);
    if (s->pinned) {
      pol_unlink(t); /* the hand passes an item in use: its place is lost */
      p->n_pinned--;
    } else if (s->ref) {
      s->ref = 0;
      pol_unlink(t);
      pol_push_head(&p->ring, t);
    } else {
      return s->item;
    }
  }
  return NULL;
}

static sgm_status clock_check(const sgm_policy *pp, char *why, size_t len) {
  const clock_policy *p = (const clock_policy *)pp;
  size_t n;
  if (!pol_list_valid(&p->ring, &n)) return pol_fail(why, len, "clock: broken ring links");
  uint64_t bytes = 0, unpinned = 0, pinned = 0;
  for (const pol_node *x = p->ring.next; x != &p->ring; x = x->next) {
    const clock_state *s = (const clock_state *)(const void *)x;
    if (!s->item || s->item->state != s) return pol_fail(why, len, "clock: a node's item does not own it");
    if (s->ref > 1 || s->pinned > 1) return pol_fail(why, len, "clock: bad flags");
    if (s->pinned) {
      pinned++;
    } else {
      unpinned++;
      bytes += s->item->size_bytes;
    }
  }
  if (unpinned != p->n || bytes != p->bytes || pinned != p->n_pinned)
    return pol_fail(why, len, "clock: ring holds %llu items (%llu bytes) and %llu pinned; counters "
                    "say %llu (%llu bytes) and %llu", (unsigned long long)unpinned,
                    (unsigned long long)bytes, (unsigned long long)pinned,
                    (unsigned long long)p->n, (unsigned long long)p->bytes,
                    (unsigned long long)p->n_pinned);
  return SGM_OK;
}

const sgm_policy_ops sgm__policy_clock = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "clock",
    .summary = "CLOCK / second chance: a hit sets a bit, the hand spares it once",
    .state_bytes = sizeof(clock_state),
    .create = clock_create,
    .destroy = clock_destroy,
    .on_insert = clock_insert,
    .on_access = clock_access,
    .on_remove = clock_remove,
    .reclaimable_bytes = clock_reclaimable,
    .next_victim = clock_next_victim,
    .check = clock_check,
};
