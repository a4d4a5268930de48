/*
 * lfu.c — least frequently used, with ageing.
 *
 * Design note. Each item has a use count, saturating at 63; items sit in one
 * list per count (most recent at the head of each), and a bitmap says which
 * lists are non-empty, so the victim — the least recently used item of the
 * lowest non-empty count — is found in O(1) (count trailing zeros). A new item
 * starts at 1, a hit adds 1 and moves the item to the head of its new list.
 *
 *     count 0   (empty)
 *     count 1   head → b9 → b4 ← tail   ← victims come from here first
 *     count 2   head → b7 ← tail
 *     ...
 *     count 63  head → b1 ← tail
 *
 * Ageing, so that a once-hot buffer eventually leaves: every "epoch" all
 * counts halve. Halving splices list k onto list k/2 for k = 1..63 (O(64),
 * whatever the number of items); an item stores its count with the epoch it
 * was written in, and its true count is count >> (epochs since), which is
 * exactly the list the splices have carried it to — pinned items age too. An
 * epoch ends after LFU_AGE_EVENTS_PER_ITEM inserts and hits per item held
 * (at least LFU_AGE_MIN_EVENTS), or after LFU_AGE_PERIOD_NS of the injected
 * clock, whichever comes first. Without ageing LFU keeps yesterday's hot set
 * forever; with it a count of 63 is gone after six quiet epochs.
 *
 * LFU keeps a hot buffer through a one-time scan (the scan's buffers all have
 * count 1), but a buffer used twice early on can outlive a steadily used one
 * until ageing catches up.
 */
#include "builtin.h"
#include "common.h"

/* Counts saturate here: 64 lists, one bitmap word. */
#define LFU_MAX_COUNT 63u
/* An epoch every 2 events per item held, i.e. about every second turnover of
 * the tier: a count then means use within the last few turnovers. Measured on
 * the Mooncake conversation trace (VRAM = 10% of its blocks): 8 per item gave
 * a 25.5% hit ratio (stale counts of finished conversations crowd the tier),
 * 2 gave 29.0%, 1 gave 28.1% (counts forgotten before they pay). */
#define LFU_AGE_EVENTS_PER_ITEM 2u
/* ... but never less often than every 1024 events: tiny sets do not churn. */
#define LFU_AGE_MIN_EVENTS 1024u
/* And at least once a second of wall (injected) time: a GPU job's step is well
 * under that, so a buffer unused for a few seconds has lost its rank. */
#define LFU_AGE_PERIOD_NS UINT64_C(1000000000)
/* The clock is read every this many events, to keep hits cheap. */
#define LFU_CLOCK_EVERY 64u

typedef struct lfu_state {
  pol_node node;          /* in the list of its count; unlinked while pinned */
  sgm_policy_item *item;  /* back to the item */
  uint32_t epoch;         /* the epoch count was written in */
  uint8_t count;          /* use count as of epoch */
} lfu_state;

typedef struct lfu_policy {
  pol_node list[LFU_MAX_COUNT + 1]; /* by count; head = most recent */
  uint64_t nonempty;                /* bit k: list[k] holds an item */
  uint64_t n;                       /* items in the lists */
  uint64_t bytes;                   /* their sizes */
  uint32_t epoch;                   /* halvings so far */
  uint64_t events;                  /* inserts and hits since the last halving */
  uint64_t epoch_start_ns;          /* clock at the last halving */
  uint64_t (*clock_ns)(void *);     /* injected clock */
  void *clock_user;                 /* its argument */
} lfu_policy;

static unsigned lfu_count_now(const lfu_policy *p, const lfu_state *s) {
  uint32_t age = p->epoch - s->epoch;
  return age >= 8 ? 0 : (unsigned)(s->count >> age);
}

static sgm_status lfu_create(const sgm_policy_params *params, sgm_policy **out) {
  lfu_policy *p = (lfu_policy *)calloc(1, sizeof *p);
  *out = (sgm_policy *)p;
  if (!p) return SGM_ERR_NOMEM;
  for (unsigned k = 0; k <= LFU_MAX_COUNT; k++) pol_list_init(&p->list[k]);
  p->clock_ns = params->clock_ns;
  p->clock_user = params->clock_user;
  p->epoch_start_ns = p->clock_ns ? p->clock_ns(p->clock_user) : 0;
  return SGM_OK;
}

static void lfu_destroy(sgm_policy *pp) { free(pp); }

/* Halve every count: list k moves onto list k/2 (ascending, so each target
 * has already handed its own items down). Higher counts land nearer the head. */
static void lfu_halve(lfu_policy *p) {
  for (unsigned k = 1; k <= LFU_MAX_COUNT; k++) pol_splice_head(&p->list[k / 2], &p->list[k]);
  p->nonempty = 0;
  for (unsigned k = 0; k <= LFU_MAX_COUNT; k++)
    if (!pol_list_empty(&p->list[k])) p->nonempty |= UINT64_C(1) << k;
  p->epoch++;
  p->events = 0;
}

static void lfu_tick(lfu_policy *p) {
  uint64_t per_items = p->n * LFU_AGE_EVENTS_PER_ITEM;
  uint64_t limit = per_items > LFU_AGE_MIN_EVENTS ? per_items : LFU_AGE_MIN_EVENTS;
  bool age = ++p->events >= limit;
  if (!age && p->clock_ns && p->events % LFU_CLOCK_EVERY == 0) {
    uint64_t now = p->clock_ns(p->clock_user);
    age = now - p->epoch_start_ns >= LFU_AGE_PERIOD_NS;
  }
  if (!age) return;
  lfu_halve(p);
  if (p->clock_ns) p->epoch_start_ns = p->clock_ns(p->clock_user);
}

static void lfu_link(lfu_policy *p, lfu_state *s, unsigned count, bool at_head) {
  s->count = (uint8_t)count;
  s->epoch = p->epoch;
  if (at_head) pol_push_head(&p->list[count], &s->node);
  else pol_push_tail(&p->list[count], &s->node);
  p->nonempty |= UINT64_C(1) << count;
  p->n++;
  p->bytes += s->item->size_bytes;
}

static void lfu_insert(sgm_policy *pp, sgm_policy_item *it, sgm_policy_insert how) {
  lfu_policy *p = (lfu_policy *)pp;
  lfu_state *s = (lfu_state *)it->state;
  if (how == SGM_POLICY_INSERT_RESTORE) {
    pol_assert(s->item == it && !pol_linked(&s->node));
    lfu_link(p, s, lfu_count_now(p, s), false); /* back at the end it was taken from */
    return;
  }
  s->item = it;
  lfu_tick(p);
  lfu_link(p, s, 1, true);
}

static void lfu_access(sgm_policy *pp, sgm_policy_item *it) {
  lfu_policy *p = (lfu_policy *)pp;
  lfu_state *s = (lfu_state *)it->state;
  pol_assert(s->item == it && !pol_linked(&s->node));
  lfu_tick(p);
  unsigned c = lfu_count_now(p, s);
  lfu_link(p, s, c < LFU_MAX_COUNT ? c + 1 : LFU_MAX_COUNT, true);
}

static void lfu_remove(sgm_policy *pp, sgm_policy_item *it, sgm_policy_remove why) {
  lfu_policy *p = (lfu_policy *)pp;
  lfu_state *s = (lfu_state *)it->state;
  (void)why;
  if (!pol_linked(&s->node)) return; /* a pinned item dropped */
  unsigned c = lfu_count_now(p, s);
  pol_unlink(&s->node);
  if (pol_list_empty(&p->list[c])) p->nonempty &= ~(UINT64_C(1) << c);
  p->n--;
  p->bytes -= it->size_bytes;
}

static uint64_t lfu_reclaimable(const sgm_policy *pp) { return ((const lfu_policy *)pp)->bytes; }

static sgm_policy_item *lfu_next_victim(sgm_policy *pp, uint64_t bytes_wanted) {
  lfu_policy *p = (lfu_policy *)pp;
  (void)bytes_wanted;
  if (!p->nonempty) return NULL;
  unsigned k = (unsigned)__builtin_ctzll(p->nonempty);
  return ((lfu_state *)(void *)pol_list_tail(&p->list[k]))->item;
}

static sgm_status lfu_check(const sgm_policy *pp, char *why, size_t len) {
  const lfu_policy *p = (const lfu_policy *)pp;
  uint64_t n = 0, bytes = 0;
  for (unsigned k = 0; k <= LFU_MAX_COUNT; k++) {
    size_t nk;
    if (!pol_list_valid(&p->list[k], &nk)) return pol_fail(why, len, "lfu: list %u broken", k);
    bool bit = (p->nonempty >> k) & 1;
    if (bit != (nk > 0)) return pol_fail(why, len, "lfu: bitmap bit %u is %d, list holds %zu", k, bit, nk);
    for (const pol_node *x = p->list[k].next; x != &p->list[k]; x = x->next) {
      const lfu_state *s = (const lfu_state *)(const void *)x;
      if (!s->item || s->item->state != s) return pol_fail(why, len, "lfu: a node's item does not own it");
      if (lfu_count_now(p, s) != k)
        return pol_fail(why, len, "lfu: item %llu has count %u but sits in list %u",
                        (unsigned long long)s->item->id, lfu_count_now(p, s), k);
      bytes += s->item->size_bytes;
    }
    n += nk;
  }
  if (n != p->n || bytes != p->bytes)
    return pol_fail(why, len, "lfu: lists hold %llu items (%llu bytes), counters say %llu (%llu)",
                    (unsigned long long)n, (unsigned long long)bytes, (unsigned long long)p->n,
                    (unsigned long long)p->bytes);
  return SGM_OK;
}

const sgm_policy_ops sgm__policy_lfu = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "lfu",
    .summary = "least frequently used leaves first; counts halve every epoch (ageing)",
    .state_bytes = sizeof(lfu_state),
    .create = lfu_create,
    .destroy = lfu_destroy,
    .on_insert = lfu_insert,
    .on_access = lfu_access,
    .on_remove = lfu_remove,
    .reclaimable_bytes = lfu_reclaimable,
    .next_victim = lfu_next_victim,
    .check = lfu_check,
};
