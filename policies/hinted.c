/*
 * hinted.c — residency hints around any policy: the shell that lru, s3fifo,
 * lirs and arc run in (policy ABI 4's on_hint; docs/policies.md "Residency
 * hints").
 *
 * Design note. A hinted item lives in one of the shell's lists, and the
 * inner policy holds it pinned meanwhile (on_remove PIN: its history, LIR
 * status or frequency, stays); its hints ending give it back as the pin would
 * end (used: on_access, a hit; cancelled: on_insert RESTORE), and its
 * eviction from the shell ends the pin with DROP. An item hinted before the
 * inner policy ever saw it enters there as new when its hints end. An item
 * without hints is the inner policy's, untouched, so with no hints the shell
 * is one branch per call around the policy it wraps.
 *
 *     done    first out: oldest done first (FIFO)
 *     inner   the policy's own order (LRU, S3-FIFO, LIRS, ARC)
 *     will    last out: buckets by log2 of the distance given; the furthest
 *             bucket first, and in a bucket the newest hint first (hints of
 *             one bucket given earlier are nearer by now)
 *
 * A use ends will-use and done (sgm clears them before on_access). An item
 * pinned by sgm stays where it was pinned (inner or shell) and is placed by
 * its hints when it comes back. Every operation is O(1): the highest non-empty bucket is one bit scan.
 *
 * Per-item state: the inner policy's state, then (16-byte aligned) a list
 * node and where the item is. Locks and contract: sgm/policy.h (the shell
 * runs under its tier lock, never blocks, never fails). Calls: the inner
 * policy's vtable only.
 */
#include "builtin.h"
#include "common.h"

enum {
  HINT_NONE = 0,     /* in no list: not an item, or dropped */
  HINT_INNER,        /* the inner policy's item */
  HINT_INNER_PINNED, /* the inner policy's item, pinned by sgm */
  HINT_DONE,         /* in the done list */
  HINT_WILL,         /* in a will bucket */
  HINT_PINNED        /* pinned by sgm while in done or will (unlinked) */
};

#define HINT_BUCKETS 33 /* log2 of a uint32_t distance, + 1 */

typedef struct hint_state {
  sgm_policy_item *item; /* back to the item (set when linked) */
  pol_node node;  /* in done or a will bucket */
  uint8_t where;  /* HINT_* */
  uint8_t bucket; /* its will bucket */
  bool inner_pin; /* in done or will (or pinned from there): the inner policy holds a pin on it */
} hint_state;

typedef struct pol_hinted {
  const sgm_policy_ops *inner; /* the wrapped policy */
  sgm_policy *in;              /* its instance */
  size_t off;                  /* hint_state's offset in an item's state */
  pol_node done;               /* head = newest */
  pol_node will[HINT_BUCKETS]; /* by log2(distance + 1); head = newest */
  uint64_t will_mask;          /* bit k: will[k] not empty */
  uint64_t bytes;              /* items in done and will */
  uint64_t n;                  /* how many */
} pol_hinted;

_Static_assert(sizeof(hint_state) <= 32, "POL_HINTED_STATE_BYTES in builtin.h reserves 32 bytes");

static hint_state *hint_of(const pol_hinted *h, const sgm_policy_item *it) {
  return (hint_state *)(void *)((char *)it->state + h->off);
}

/* The inner policy sees it->parent only when the parent is its own item too
 * (sgm resolves parents to this instance; a hinted parent is the shell's). */
static void hint_filter_parent(const pol_hinted *h, sgm_policy_item *it) {
  if (it->parent && hint_of(h, it->parent)->where != HINT_INNER) it->parent = NULL;
}

static hint_state *hint_state_of(const pol_node *n) {
  return (hint_state *)(void *)((char *)(uintptr_t)n - offsetof(hint_state, node));
}

static size_t hint_off(size_t inner_bytes) { return (inner_bytes + 15u) & ~(size_t)15u; }

sgm_status pol_hinted_create(const sgm_policy_ops *inner, const sgm_policy_params *params,
                             sgm_policy **out) {
  *out = NULL;
  pol_hinted *h = (pol_hinted *)calloc(1, sizeof *h);
  if (!h) return SGM_ERR_NOMEM;
  sgm_status rc = inner->create(params, &h->in);
  if (rc != SGM_OK || !h->in) {
    free(h);
    return rc != SGM_OK ? rc : SGM_ERR_NOMEM;
  }
  h->inner = inner;
  h->off = hint_off(inner->state_bytes);
  pol_list_init(&h->done);
  for (int k = 0; k < HINT_BUCKETS; k++) pol_list_init(&h->will[k]);
  *out = (sgm_policy *)h;
  return SGM_OK;
}

void pol_hinted_destroy(sgm_policy *pp) {
  pol_hinted *h = (pol_hinted *)pp;
  h->inner->destroy(h->in);
  free(h);
}

static unsigned hint_bucket(uint32_t distance) {
  unsigned k = 0;
  for (uint64_t d = (uint64_t)distance + 1; d > 1; d >>= 1) k++;
  return k; /* 0 .. 32 */
}

/* Link it (hinted, in no list) into done or its will bucket. */
static void hint_link(pol_hinted *h, sgm_policy_item *it) {
  hint_state *s = hint_of(h, it);
  s->item = it;
  if (it->hint & SGM_POLICY_HINT_DONE) {
    pol_push_head(&h->done, &s->node);
    s->where = HINT_DONE;
  } else {
    unsigned k = hint_bucket(it->will_use_distance);
    pol_push_head(&h->will[k], &s->node);
    h->will_mask |= UINT64_C(1) << k;
    s->bucket = (uint8_t)k;
    s->where = HINT_WILL;
  }
  h->bytes += it->size_bytes;
  h->n++;
}

/* Unlink it from the shell's list it is in. */
static void hint_unlink(pol_hinted *h, sgm_policy_item *it) {
  hint_state *s = hint_of(h, it);
  pol_unlink(&s->node);
  if (s->where == HINT_WILL && pol_list_empty(&h->will[s->bucket]))
    h->will_mask &= ~(UINT64_C(1) << s->bucket);
  h->bytes -= it->size_bytes;
  h->n--;
}

static bool hinted(const sgm_policy_item *it) {
  return (it->hint & (SGM_POLICY_HINT_WILL_USE | SGM_POLICY_HINT_DONE)) != 0;
}

/* Take it (hinted, not in a list, not pinned by sgm) into done or will. An
 * item the inner policy knows (inner_pin) stays pinned there meanwhile: its
 * history (LIR status, frequency, ghosts) waits for it. */
static void hint_take(pol_hinted *h, sgm_policy_item *it, bool inner_knows) {
  hint_state *s = hint_of(h, it);
  if (inner_knows) h->inner->on_remove(h->in, it, SGM_POLICY_REMOVE_PIN);
  s->inner_pin = inner_knows;
  hint_link(h, it);
}

/* Give it (hints gone, in no list, not pinned by sgm) back to the inner
 * policy: used (a hit there) or not (restored, or new if it never knew it). */
static void hint_give_back(pol_hinted *h, sgm_policy_item *it, bool used) {
  hint_state *s = hint_of(h, it);
  if (!s->inner_pin) h->inner->on_insert(h->in, it, SGM_POLICY_INSERT_NEW);
  else if (used) h->inner->on_access(h->in, it);
  else h->inner->on_insert(h->in, it, SGM_POLICY_INSERT_RESTORE);
  s->inner_pin = false;
  s->where = HINT_INNER;
}

/* it comes back from sgm (new, restored, or used), hinted or not. */
static void hint_back(pol_hinted *h, sgm_policy_item *it, sgm_policy_insert how, bool used) {
  hint_state *s = hint_of(h, it);
  hint_filter_parent(h, it);
  if (how == SGM_POLICY_INSERT_NEW && !used) {
    s->where = HINT_NONE;
    s->inner_pin = false;
  }
  switch (s->where) {
    case HINT_INNER_PINNED: /* the inner policy's pin ends as sgm's did */
      if (used) h->inner->on_access(h->in, it);
      else h->inner->on_insert(h->in, it, how);
      s->where = HINT_INNER;
      if (hinted(it)) hint_take(h, it, true);
      break;
    case HINT_PINNED: /* a shell item back */
      if (hinted(it)) hint_link(h, it);
      else hint_give_back(h, it, used);
      break;
    default: /* new */
      if (hinted(it)) {
        hint_take(h, it, false);
      } else {
        h->inner->on_insert(h->in, it, SGM_POLICY_INSERT_NEW);
        s->where = HINT_INNER;
      }
      break;
  }
}

void pol_hinted_insert(sgm_policy *pp, sgm_policy_item *it, sgm_policy_insert how) {
  hint_back((pol_hinted *)pp, it, how, false);
}

void pol_hinted_access(sgm_policy *pp, sgm_policy_item *it) {
  hint_back((pol_hinted *)pp, it, SGM_POLICY_INSERT_RESTORE, true);
}

void pol_hinted_remove(sgm_policy *pp, sgm_policy_item *it, sgm_policy_remove why) {
  pol_hinted *h = (pol_hinted *)pp;
  hint_state *s = hint_of(h, it);
  switch (s->where) {
    case HINT_INNER:
      h->inner->on_remove(h->in, it, why);
      s->where = why == SGM_POLICY_REMOVE_PIN ? HINT_INNER_PINNED : HINT_NONE;
      return;
    case HINT_INNER_PINNED:
      h->inner->on_remove(h->in, it, why); /* DROP of a pinned item */
      s->where = HINT_NONE;
      return;
    case HINT_DONE:
    case HINT_WILL:
      hint_unlink(h, it);
      if (why == SGM_POLICY_REMOVE_PIN) {
        s->where = HINT_PINNED; /* the inner pin stays: sgm's pin decides */
        return;
      }
      break;
    default:
      break; /* HINT_PINNED dropped */
  }
  /* Gone (evicted or dropped): the inner policy's pin ends too. */
  if (s->inner_pin) h->inner->on_remove(h->in, it, SGM_POLICY_REMOVE_DROP);
  s->inner_pin = false;
  s->where = HINT_NONE;
}

void pol_hinted_hint(sgm_policy *pp, sgm_policy_item *it) {
  pol_hinted *h = (pol_hinted *)pp;
  hint_state *s = hint_of(h, it);
  hint_filter_parent(h, it);
  if (s->where == HINT_INNER && hinted(it)) {
    hint_take(h, it, true);
  } else if (s->where == HINT_DONE || s->where == HINT_WILL) {
    hint_unlink(h, it);
    if (hinted(it)) hint_link(h, it);
    else hint_give_back(h, it, false); /* cancelled: as if it had never left */
  } else if (s->where == HINT_INNER && it->parent && h->inner->on_hint) {
    h->inner->on_hint(h->in, it); /* structure: the inner policy's business */
  }
}

uint64_t pol_hinted_reclaimable(const sgm_policy *pp) {
  const pol_hinted *h = (const pol_hinted *)pp;
  return h->bytes + h->inner->reclaimable_bytes(h->in);
}

sgm_policy_item *pol_hinted_next_victim(sgm_policy *pp, uint64_t bytes_wanted) {
  pol_hinted *h = (pol_hinted *)pp;
  pol_node *t = pol_list_tail(&h->done);
  if (t) return hint_state_of(t)->item;
  if (h->inner->reclaimable_bytes(h->in) > 0) {
    sgm_policy_item *v = h->inner->next_victim(h->in, bytes_wanted);
    if (v) return v;
  }
  if (!h->will_mask) return NULL;
  unsigned k = 63u - (unsigned)__builtin_clzll(h->will_mask);
  return hint_state_of(pol_list_head(&h->will[k]))->item;
}

sgm_status pol_hinted_check(const sgm_policy *pp, char *why, size_t len) {
  const pol_hinted *h = (const pol_hinted *)pp;
  if (h->inner->check) {
    sgm_status rc = h->inner->check(h->in, why, len);
    if (rc != SGM_OK) return rc;
  }
  size_t n = 0, k;
  uint64_t bytes = 0;
  for (int b = -1; b < HINT_BUCKETS; b++) {
    const pol_node *l = b < 0 ? &h->done : &h->will[b];
    if (!pol_list_valid(l, &k)) return pol_fail(why, len, "hints: broken list links");
    if (b >= 0 && (k != 0) != ((h->will_mask >> b) & 1u))
      return pol_fail(why, len, "hints: will bucket %d has %zu items, mask says otherwise", b, k);
    for (const pol_node *x = l->next; x != l; x = x->next) {
      const sgm_policy_item *it = hint_state_of(x)->item;
      const hint_state *s = it ? hint_of(h, it) : NULL;
      if (!s || &s->node != x || s->where != (b < 0 ? HINT_DONE : HINT_WILL))
        return pol_fail(why, len, "hints: a listed item's state disagrees");
      if (!hinted(it)) return pol_fail(why, len, "hints: an item without hints in a hint list");
      bytes += it->size_bytes;
    }
    n += k;
  }
  if (n != h->n || bytes != h->bytes)
    return pol_fail(why, len, "hints: %zu items of %llu bytes listed, counters say %llu of %llu", n,
                    (unsigned long long)bytes, (unsigned long long)h->n,
                    (unsigned long long)h->bytes);
  return SGM_OK;
}
