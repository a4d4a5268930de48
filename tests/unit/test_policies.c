/*
 * test_policies.c — eviction policies (include/sgm/policy.h, policies/,
 * lib/policy.c) and their use by placement.c.
 *
 * Conformance, run against every registered policy (the built-ins and two
 * FIFOs this file registers, as a program would: one without the optional
 * members, one with record and admit): driven through the vtable with
 * synthetic buffers and a fake clock, and through the real buffer API on the
 * emulated device. Then each built-in's signature behaviour, the priority
 * layer under every policy, admission and record through the buffer API,
 * placement's refusal to evict for what cannot fit, registration errors, and
 * the policy options.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "internal.h"
#include "sgm/policy.h"
#include "builtin.h"
#include "test_util.h"

/* placement.c's test hooks (declared there, next to their definitions). */
void sgm__placement_set_clock(sgm_context *ctx, uint64_t (*clock_ns)(void *user), void *user);
int sgm__placement_check(sgm_context *ctx, char *why, size_t why_len);
const char *sgm__placement_policy_name(sgm_context *ctx, sgm_tier t);

#define KiB (UINT64_C(1) << 10)
#define MiB (UINT64_C(1) << 20)

/* ------------------------------------------------------------------------ */
/* A fake clock: time moves only when a test says so. */

/* Atomic: the context's prefetch and idle threads read the clock too. */
static uint64_t fake_now_ns;
static uint64_t fake_clock(void *user) {
  (void)user;
  return __atomic_load_n(&fake_now_ns, __ATOMIC_RELAXED);
}

static void fake_clock_set(uint64_t ns) { __atomic_store_n(&fake_now_ns, ns, __ATOMIC_RELAXED); }

static void fake_clock_advance(uint64_t ns) { __atomic_add_fetch(&fake_now_ns, ns, __ATOMIC_RELAXED); }

/* ------------------------------------------------------------------------ */
/* A user policy, registered the way a program would: FIFO, no check member. */

typedef struct tfifo_state {
  struct tfifo_state *prev, *next; /* list links; prev == NULL and not head: unlinked */
  sgm_policy_item *item;           /* back to the item */
  int linked;                      /* in the list */
} tfifo_state;

typedef struct tfifo {
  tfifo_state *head, *tail; /* newest, oldest */
  uint64_t bytes;           /* listed bytes */
} tfifo;

static sgm_status tfifo_create(const sgm_policy_params *params, sgm_policy **out) {
  (void)params;
  *out = (sgm_policy *)calloc(1, sizeof(tfifo));
  return *out ? SGM_OK : SGM_ERR_NOMEM;
}
static void tfifo_destroy(sgm_policy *p) { free(p); }
static void tfifo_link(tfifo *f, tfifo_state *s, bool at_head) {
  s->linked = 1;
  if (at_head) {
    s->prev = NULL;
    s->next = f->head;
    if (f->head) f->head->prev = s;
    else f->tail = s;
    f->head = s;
  } else {
    s->next = NULL;
    s->prev = f->tail;
    if (f->tail) f->tail->next = s;
    else f->head = s;
    f->tail = s;
  }
  f->bytes += s->item->size_bytes;
}
static void tfifo_insert(sgm_policy *p, sgm_policy_item *it, sgm_policy_insert how) {
  tfifo_state *s = (tfifo_state *)it->state;
  s->item = it;
  tfifo_link((tfifo *)p, s, how == SGM_POLICY_INSERT_NEW);
}
static void tfifo_access(sgm_policy *p, sgm_policy_item *it) {
  tfifo_link((tfifo *)p, (tfifo_state *)it->state, true);
}
static void tfifo_remove(sgm_policy *p, sgm_policy_item *it, sgm_policy_remove why) {
  tfifo *f = (tfifo *)p;
  tfifo_state *s = (tfifo_state *)it->state;
  (void)why;
  if (!s->linked) return;
  if (s->prev) s->prev->next = s->next;
  else f->head = s->next;
  if (s->next) s->next->prev = s->prev;
  else f->tail = s->prev;
  s->linked = 0;
  f->bytes -= it->size_bytes;
}
static uint64_t tfifo_reclaimable(const sgm_policy *p) { return ((const tfifo *)p)->bytes; }
static sgm_policy_item *tfifo_victim(sgm_policy *p, uint64_t want) {
  (void)want;
  tfifo *f = (tfifo *)p;
  return f->tail ? f->tail->item : NULL;
}

static const sgm_policy_ops tfifo_ops = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "testfifo",
    .summary = "first in, first out (tests/unit/test_policies.c)",
    .state_bytes = sizeof(tfifo_state),
    .create = tfifo_create,
    .destroy = tfifo_destroy,
    .on_insert = tfifo_insert,
    .on_access = tfifo_access,
    .on_remove = tfifo_remove,
    .reclaimable_bytes = tfifo_reclaimable,
    .next_victim = tfifo_victim,
};

/* A second user policy: the same FIFO with the ABI-2 members. record counts
 * the acquires it hears of; admit refuses while gate_refuse is set (and
 * counts what it was asked). Admits by default, so the conformance loops
 * treat it as a plain FIFO. */
static bool gate_refuse;            /* admit says no */
static uint64_t gate_n_records;     /* record calls */
static uint64_t gate_last_record;   /* the id of the last one */
static uint64_t gate_n_admits;      /* admit calls */
static uint64_t gate_last_candidate; /* the candidate id of the last one */

/* Atomics: the prefetch worker calls admit while the test thread reads. */
static void gate_record(sgm_policy *p, uint64_t id) {
  (void)p;
  __atomic_fetch_add(&gate_n_records, 1, __ATOMIC_SEQ_CST);
  __atomic_store_n(&gate_last_record, id, __ATOMIC_SEQ_CST);
}
static bool gate_admit(sgm_policy *p, const sgm_policy_item *cand, const sgm_policy_item *victim) {
  (void)p;
  assert_null(cand->state); /* sgm's copy: the state is not ours to touch */
  assert_true(cand->id != victim->id);
  __atomic_store_n(&gate_last_candidate, cand->id, __ATOMIC_SEQ_CST);
  __atomic_fetch_add(&gate_n_admits, 1, __ATOMIC_SEQ_CST);
  return !__atomic_load_n(&gate_refuse, __ATOMIC_SEQ_CST);
}

static const sgm_policy_ops gate_ops = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "testgate",
    .summary = "FIFO with record and a switchable admit (tests/unit/test_policies.c)",
    .state_bytes = sizeof(tfifo_state),
    .create = tfifo_create,
    .destroy = tfifo_destroy,
    .on_insert = tfifo_insert,
    .on_access = tfifo_access,
    .on_remove = tfifo_remove,
    .reclaimable_bytes = tfifo_reclaimable,
    .next_victim = tfifo_victim,
    .record = gate_record,
    .admit = gate_admit,
};

static int group_setup(void **state) {
  (void)state;
  /* Registered once for the whole suite, so every conformance loop covers a
   * user policy without a check member, and one with record and admit. */
  if (sgm_policy_register(&tfifo_ops) != SGM_OK) return -1;
  return sgm_policy_register(&gate_ops) == SGM_OK ? 0 : -1;
}

/* ------------------------------------------------------------------------ */
/* Synthetic buffers and a model of what the instance should hold. */

enum { OUT = 0, IN = 1, PINNED = 2 };

typedef struct titem {
  sgm_policy_item it;                                    /* what the policy sees */
  int where;                                             /* OUT, IN or PINNED */
  _Alignas(16) unsigned char state[SGM_POLICY_STATE_MAX]; /* the policy's state */
} titem;

typedef struct harness {
  const sgm_policy_ops *ops; /* under test */
  sgm_policy *p;             /* the instance */
  titem *items;              /* the buffers */
  size_t n;                  /* how many */
  uint64_t in_bytes;         /* model: bytes of IN items */
  uint64_t used_bytes;       /* cache model: bytes of IN and PINNED items */
  uint64_t n_victim_calls;   /* next_victim calls */
  uint64_t n_refused;        /* h_touch misses the policy did not admit */
} harness;

static void h_init(harness *h, const sgm_policy_ops *ops, size_t n, uint64_t capacity) {
  memset(h, 0, sizeof *h);
  h->ops = ops;
  h->n = n;
  h->items = calloc(n, sizeof *h->items);
  assert_non_null(h->items);
  for (size_t i = 0; i < n; i++) {
    h->items[i].it.id = 1000 + i;
    h->items[i].it.size_bytes = 4 * KiB;
    h->items[i].it.priority = SGM_PRIORITY_NORMAL;
    h->items[i].it.state = ops->state_bytes ? h->items[i].state : NULL;
  }
  sgm_policy_params params = {.abi_version = SGM_POLICY_ABI_VERSION,
                              .tier = SGM_TIER_VRAM,
                              .priority = SGM_PRIORITY_NORMAL,
                              .capacity_bytes = capacity,
                              .clock_ns = fake_clock};
  assert_int_equal(ops->create(&params, &h->p), SGM_OK);
  assert_non_null(h->p);
}

static void h_fini(harness *h) {
  h->ops->destroy(h->p);
  free(h->items);
}

/* The instance is valid and holds exactly the model's IN bytes. */
static void h_verify(harness *h) {
  char why[256] = "";
  if (h->ops->check && h->ops->check(h->p, why, sizeof why) != SGM_OK)
    fail_msg("%s: check failed: %s", h->ops->name, why);
  uint64_t r = h->ops->reclaimable_bytes(h->p);
  if (r != h->in_bytes)
    fail_msg("%s: reclaimable %llu bytes, the evictable buffers add up to %llu", h->ops->name,
             (unsigned long long)r, (unsigned long long)h->in_bytes);
}

static void h_insert(harness *h, size_t i) {
  titem *t = &h->items[i];
  assert_int_equal(t->where, OUT);
  h->ops->on_insert(h->p, &t->it, SGM_POLICY_INSERT_NEW);
  t->where = IN;
  h->in_bytes += t->it.size_bytes;
  h->used_bytes += t->it.size_bytes;
}

static void h_pin(harness *h, size_t i) {
  titem *t = &h->items[i];
  assert_int_equal(t->where, IN);
  h->ops->on_remove(h->p, &t->it, SGM_POLICY_REMOVE_PIN);
  t->where = PINNED;
  h->in_bytes -= t->it.size_bytes;
}

static void h_access(harness *h, size_t i) {
  titem *t = &h->items[i];
  assert_int_equal(t->where, PINNED);
  h->ops->on_access(h->p, &t->it);
  t->where = IN;
  h->in_bytes += t->it.size_bytes;
}

static void h_restore(harness *h, size_t i) {
  titem *t = &h->items[i];
  assert_int_equal(t->where, PINNED);
  h->ops->on_insert(h->p, &t->it, SGM_POLICY_INSERT_RESTORE);
  t->where = IN;
  h->in_bytes += t->it.size_bytes;
}

static void h_drop(harness *h, size_t i) {
  titem *t = &h->items[i];
  assert_int_not_equal(t->where, OUT);
  h->ops->on_remove(h->p, &t->it, SGM_POLICY_REMOVE_DROP);
  if (t->where == IN) h->in_bytes -= t->it.size_bytes;
  h->used_bytes -= t->it.size_bytes;
  t->where = OUT;
}

static titem *h_item_of(harness *h, sgm_policy_item *it) {
  assert_true(it >= &h->items[0].it && it <= &h->items[h->n - 1].it);
  return (titem *)(void *)it;
}

/* Ask for a victim: it must be an evictable (IN) buffer; NULL only when none is. */
static titem *h_victim(harness *h, uint64_t want) {
  h->n_victim_calls++;
  sgm_policy_item *v = h->ops->next_victim(h->p, want);
  if (!v) {
    if (h->in_bytes) fail_msg("%s: no victim with %llu bytes evictable", h->ops->name,
                              (unsigned long long)h->in_bytes);
    return NULL;
  }
  titem *t = h_item_of(h, v);
  if (t->where != IN) fail_msg("%s: victim %llu is %s", h->ops->name, (unsigned long long)t->it.id,
                               t->where == PINNED ? "pinned (acquired)" : "not in the policy");
  return t;
}

/* Evict t, the victim next_victim just offered. */
static size_t h_evict_this(harness *h, titem *t) {
  h->ops->on_remove(h->p, &t->it, SGM_POLICY_REMOVE_EVICT);
  t->where = OUT;
  h->in_bytes -= t->it.size_bytes;
  h->used_bytes -= t->it.size_bytes;
  return (size_t)(t - h->items);
}

static size_t h_evict(harness *h, uint64_t want) {
  titem *t = h_victim(h, want);
  assert_non_null(t);
  h->ops->on_remove(h->p, &t->it, SGM_POLICY_REMOVE_EVICT);
  t->where = OUT;
  h->in_bytes -= t->it.size_bytes;
  h->used_bytes -= t->it.size_bytes;
  return (size_t)(t - h->items);
}

/* A cache of cap bytes in front of the items, as placement drives the VRAM
 * tier: the access is recorded; a hit when the buffer is resident (it is
 * pinned and used, as acquire/release do), else victims leave until it fits
 * and it comes in — unless the policy's admit refuses the newcomer before a
 * victim leaves: then it stays out (in sgm: in shared memory). Returns
 * whether it hit. */
static bool h_touch(harness *h, size_t i, uint64_t cap) {
  titem *t = &h->items[i];
  if (h->ops->record) h->ops->record(h->p, t->it.id);
  if (t->where == IN) {
    h_pin(h, i);
    h_access(h, i);
    return true;
  }
  while (h->used_bytes + t->it.size_bytes > cap) {
    titem *v = h_victim(h, t->it.size_bytes);
    assert_non_null(v);
    if (h->ops->admit) {
      sgm_policy_item c = {.id = t->it.id, .size_bytes = t->it.size_bytes,
                           .priority = t->it.priority, .state = NULL};
      if (!h->ops->admit(h->p, &c, &v->it)) {
        h->n_refused++;
        return false;
      }
    }
    h_evict_this(h, v);
  }
  h_insert(h, i);
  return false;
}

static bool h_resident(const harness *h, size_t i) { return h->items[i].where != OUT; }

/* ------------------------------------------------------------------------ */
/* Conformance through the vtable, every registered policy. */

/* Invariant: under a random storm of inserts, hits, pins, restores, drops and
 * evictions with random sizes, the instance stays valid, reclaimable bytes
 * equal the evictable buffers' sizes, victims are only evictable buffers, and
 * next_victim says NULL only when nothing is evictable. */
static void test_storm_every_policy(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("policies.storm", 5150);
  size_t np = sgm_policy_count();
  assert_true(np >= 6);
  for (size_t k = 0; k < np; k++) {
    const sgm_policy_ops *ops = sgm_policy_at(k);
    sgm_test_rng r;
    sgm_test_rng_init(&r, seed + k);
    harness h;
    enum { N = 96 };
    h_init(&h, ops, N, 64 * 64 * KiB);
    for (size_t i = 0; i < N; i++) h.items[i].it.size_bytes = sgm_test_rng_log_range(&r, 256, 256 * KiB);
    fake_clock_set(0);
    for (int step = 0; step < 6000; step++) {
      size_t i = (size_t)sgm_test_rng_range(&r, 0, N - 1);
      fake_clock_advance(sgm_test_rng_range(&r, 0, 50000000)); /* up to 50 ms a step: LFU ages */
      /* Acquires are recorded whatever the item's state; some are of ids the
       * instance never holds (buffers of other tiers or levels). */
      if (ops->record && sgm_test_rng_range(&r, 0, 1) == 0)
        ops->record(h.p, sgm_test_rng_range(&r, 0, 3) ? h.items[i].it.id : 5000000 + (uint64_t)step);
      switch (sgm_test_rng_range(&r, 0, 7)) {
        case 0:
        case 1:
          if (h.items[i].where == OUT) h_insert(&h, i);
          else if (h.items[i].where == IN) h_pin(&h, i);
          else h_access(&h, i);
          break;
        case 2:
          if (h.items[i].where == IN) h_pin(&h, i);
          else if (h.items[i].where == PINNED) h_restore(&h, i);
          break;
        case 3:
          if (h.items[i].where != OUT) h_drop(&h, i);
          break;
        case 4:
        case 5: {
          /* A victim search: sometimes the candidate is busy on the GPU and
           * is pinned, the search goes on, and it is restored afterwards. */
          size_t skipped[4];
          int n_skipped = 0;
          titem *t;
          while ((t = h_victim(&h, 64 * KiB)) != NULL) {
            if (n_skipped < 4 && sgm_test_rng_range(&r, 0, 2) == 0) {
              skipped[n_skipped++] = (size_t)(t - h.items);
              h_pin(&h, (size_t)(t - h.items));
              continue;
            }
            /* Admission asked for an outside newcomer; a refusal leaves the
             * victim where it is. */
            if (ops->admit && h.items[i].where == OUT) {
              sgm_policy_item c = {.id = h.items[i].it.id, .size_bytes = h.items[i].it.size_bytes,
                                   .priority = SGM_PRIORITY_NORMAL, .state = NULL};
              if (!ops->admit(h.p, &c, &t->it)) break;
            }
            h_evict_this(&h, t);
            break;
          }
          while (n_skipped) h_restore(&h, skipped[--n_skipped]);
          break;
        }
        default:
          if (h.items[i].where == PINNED) h_access(&h, i);
          else if (h.items[i].where == IN) h_pin(&h, i);
          break;
      }
      h_verify(&h);
    }
    /* Drain: every evictable buffer comes out, each once. */
    for (size_t i = 0; i < N; i++)
      if (h.items[i].where == PINNED) h_access(&h, i);
    while (h.in_bytes) h_evict(&h, 1);
    assert_null(ops->next_victim(h.p, 1));
    h_verify(&h);
    print_message("# %s: storm ok (%llu victim searches)\n", ops->name,
                  (unsigned long long)h.n_victim_calls);
    h_fini(&h);
  }
}

/* Invariant: a pinned buffer is never offered, even when it is what the
 * policy would evict first, and a pin can end in a drop (the buffer was
 * destroyed while acquired) without a trace. */
static void test_pinned_never_victims(void **state) {
  (void)state;
  for (size_t k = 0; k < sgm_policy_count(); k++) {
    const sgm_policy_ops *ops = sgm_policy_at(k);
    harness h;
    enum { N = 16 };
    h_init(&h, ops, N, N * 4 * KiB);
    for (size_t i = 0; i < N; i++) h_insert(&h, i);
    /* Pin the oldest half: the natural victims of every policy here. */
    for (size_t i = 0; i < N / 2; i++) h_pin(&h, i);
    for (size_t i = N / 2; i < N; i++) {
      size_t v = h_evict(&h, 4 * KiB);
      assert_true(v >= N / 2);
      h_verify(&h);
    }
    assert_null(ops->next_victim(h.p, 4 * KiB));
    /* Back from their pins: two used, two restored, the rest dropped. */
    h_access(&h, 0);
    h_access(&h, 1);
    h_restore(&h, 2);
    h_restore(&h, 3);
    for (size_t i = 4; i < N / 2; i++) h_drop(&h, i);
    h_verify(&h);
    for (int j = 0; j < 4; j++) assert_true(h_evict(&h, 1) < 4);
    assert_null(ops->next_victim(h.p, 1));
    h_verify(&h);
    h_fini(&h);
  }
}

/* Invariant: one big request takes several small victims, one per call, each
 * an evictable buffer, and the calls stay few (O(1) amortised each: the
 * policy does not re-walk its whole structure per call). */
static void test_size_aware_every_policy(void **state) {
  (void)state;
  for (size_t k = 0; k < sgm_policy_count(); k++) {
    const sgm_policy_ops *ops = sgm_policy_at(k);
    harness h;
    enum { N = 4096 };
    uint64_t cap = N * KiB;
    h_init(&h, ops, N + 1, cap);
    for (size_t i = 0; i < N; i++) {
      h.items[i].it.size_bytes = KiB;
      h_touch(&h, i, cap);
    }
    for (size_t i = 0; i < N; i += 3) h_touch(&h, i, cap); /* some hits, so policies reorder */
    h.items[N].it.size_bytes = 512 * KiB;
    /* Asked for often: an admission policy takes it (it is the candidate
     * for every one of the 512 victims). */
    for (int j = 0; j < 32 && ops->record; j++) ops->record(h.p, h.items[N].it.id);
    h.n_victim_calls = 0;
    assert_false(h_touch(&h, N, cap));
    assert_int_equal(h.n_victim_calls, 512); /* one victim a call, no more */
    assert_true(h_resident(&h, N));
    assert_true(h.used_bytes <= cap);
    h_verify(&h);
    h_fini(&h);
  }
}

/* ------------------------------------------------------------------------ */
/* Signature behaviours. */

static const sgm_policy_ops *policy(const char *name) {
  const sgm_policy_ops *ops = sgm_policy_find(name);
  if (!ops) fail_msg("policy %s is not registered", name);
  return ops;
}

/* LRU: victims in order of last use. */
static void test_lru_evicts_least_recently_used(void **state) {
  (void)state;
  harness h;
  h_init(&h, policy("lru"), 6, 6 * 4 * KiB);
  for (size_t i = 0; i < 6; i++) h_insert(&h, i);
  h_touch(&h, 2, UINT64_MAX);
  h_touch(&h, 0, UINT64_MAX);
  h_touch(&h, 4, UINT64_MAX);
  size_t want[] = {1, 3, 5, 2, 0, 4};
  for (size_t j = 0; j < 6; j++) assert_int_equal(h_evict(&h, 1), want[j]);
  h_fini(&h);
}

/* CLOCK: a referenced buffer is spared once (its bit cleared, the hand moves
 * on), and a hit does not reorder buffers. */
static void test_clock_second_chance(void **state) {
  (void)state;
  harness h;
  h_init(&h, policy("clock"), 4, 4 * 4 * KiB);
  for (size_t i = 0; i < 4; i++) h_insert(&h, i);
  h_touch(&h, 0, UINT64_MAX);
  h_touch(&h, 2, UINT64_MAX);
  assert_int_equal(h_evict(&h, 1), 1); /* 0 spared, bit cleared */
  assert_int_equal(h_evict(&h, 1), 3); /* 2 spared */
  assert_int_equal(h_evict(&h, 1), 0); /* the hand came round: no bit left */
  assert_int_equal(h_evict(&h, 1), 2);
  h_fini(&h);
}

/* LFU keeps a hot buffer through a one-time scan bigger than the cache; and
 * with ageing, a once-hot buffer eventually leaves: through traffic, and
 * through (fake) time. */
static void test_lfu_hot_survives_scan_and_ages(void **state) {
  (void)state;
  const uint64_t cap = 8 * 4 * KiB;
  for (int by_time = 0; by_time <= 1; by_time++) {
    harness h;
    enum { N = 20000 };
    h_init(&h, policy("lfu"), N, cap);
    fake_clock_set(0);
    for (int j = 0; j < 20; j++) h_touch(&h, 0, cap); /* item 0: hot */
    for (size_t i = 1; i <= 100; i++) h_touch(&h, i, cap); /* scan: 12x the cache */
    assert_true(h_resident(&h, 0));
    h_verify(&h);
    /* The hot buffer is never touched again: it must leave in the end. */
    size_t i = 101;
    for (; i < N && h_resident(&h, 0); i++) {
      if (by_time) fake_clock_advance(UINT64_C(2000000000));
      h_touch(&h, i, cap);
    }
    print_message("# lfu: a hot buffer left after %zu cold ones (%s)\n", i - 101,
                  by_time ? "2 s each" : "frozen clock");
    assert_false(h_resident(&h, 0));
    if (by_time) assert_true(i - 101 < 1000);
    h_verify(&h);
    h_fini(&h);
  }
}

/* ARC, S3-FIFO, LFU and TinyLFU resist a one-time scan: a hot set used a few
 * times stays resident while a sequential scan of 8x the cache in cold
 * buffers passes. LRU, as the control, loses it. (TinyLFU's window is 1% of
 * 16 buffers, smaller than one: every newcomer is judged by admit, and the
 * scan's buffers are refused.) */
static void test_scan_resistance(void **state) {
  (void)state;
  const char *names[] = {"arc", "s3fifo", "lfu", "tinylfu", "lru"};
  const uint64_t cap = 16 * 4 * KiB;
  for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
    harness h;
    enum { HOT = 8, SCAN = 128 };
    h_init(&h, policy(names[k]), HOT + SCAN, cap);
    for (int round = 0; round < 3; round++)
      for (size_t i = 0; i < HOT; i++) h_touch(&h, i, cap);
    for (size_t i = HOT; i < HOT + SCAN; i++) h_touch(&h, i, cap);
    int kept = 0;
    for (size_t i = 0; i < HOT; i++) kept += h_resident(&h, i);
    print_message("# %s: %d of %d hot buffers survived the scan\n", names[k], kept, HOT);
    if (strcmp(names[k], "lru") == 0) assert_int_equal(kept, 0);
    else assert_int_equal(kept, HOT);
    h_verify(&h);
    h_fini(&h);
  }
}

/* ARC adapts: when T1's victims come back (ghost hits in B1) it grows T1, so
 * a recency-friendly loop slightly bigger than T1's share starts hitting. */
static void test_arc_ghosts_adapt(void **state) {
  (void)state;
  const uint64_t cap = 16 * 4 * KiB;
  harness h;
  h_init(&h, policy("arc"), 24, cap);
  for (int round = 0; round < 3; round++)
    for (size_t i = 0; i < 8; i++) h_touch(&h, i, cap); /* T2: 8 frequent buffers */
  int hits_late = 0;
  for (int round = 0; round < 12; round++)
    for (size_t i = 8; i < 20; i++) {
      bool hit = h_touch(&h, i, cap); /* a loop of 12 in T1: more than the 8 left */
      if (round >= 9) hits_late += hit;
    }
  print_message("# arc: %d hits in the last rounds of a 12-buffer loop\n", hits_late);
  assert_true(hits_late > 0);
  h_verify(&h);
  h_fini(&h);
}

/* The priority layer, under every policy: victims come from the lowest level
 * that holds any, and levels never mix. */
static void test_priority_layer_every_policy(void **state) {
  (void)state;
  for (size_t k = 0; k < sgm_policy_count(); k++) {
    const sgm_policy_ops *ops = sgm_policy_at(k);
    sgm_policy_params params = {.abi_version = SGM_POLICY_ABI_VERSION,
                                .tier = SGM_TIER_VRAM,
                                .capacity_bytes = 64 * 4 * KiB,
                                .clock_ns = fake_clock};
    sgm__prio_layer *l;
    assert_int_equal(sgm__prio_create(ops, &params, &l), SGM_OK);
    enum { N = 40 };
    titem *it = calloc(N, sizeof *it);
    assert_non_null(it);
    for (int i = 0; i < N; i++) {
      it[i].it.id = (uint64_t)i + 1;
      it[i].it.size_bytes = 4 * KiB;
      it[i].it.priority = (i * 7) % SGM__PRIO_LEVELS;
      it[i].it.state = ops->state_bytes ? it[i].state : NULL;
      sgm__prio_insert(l, &it[i].it, SGM_POLICY_INSERT_NEW);
    }
    char why[256] = "";
    assert_int_equal(sgm__prio_check(l, why, sizeof why), SGM_OK);
    assert_int_equal(sgm__prio_reclaimable(l), N * 4 * KiB);
    int last = 0;
    for (int j = 0; j < N; j++) {
      sgm_policy_item *v = sgm__prio_next_victim(l, 1);
      assert_non_null(v);
      assert_true(v->priority >= last);
      last = v->priority;
      sgm__prio_remove(l, v, SGM_POLICY_REMOVE_EVICT);
    }
    assert_null(sgm__prio_next_victim(l, 1));
    assert_int_equal(sgm__prio_reclaimable(l), 0);
    sgm__prio_destroy(l);
    free(it);
  }
}

/* ------------------------------------------------------------------------ */
/* Through the buffer API (emulated device), every registered policy. */

/* 8 MiB of VRAM, 16 MiB of shared memory, no disk tier; policy by name. */
static sgm_context *make_ctx(const char *policy_name) {
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "8MiB", 1);
  setenv("SGM_SHARED_LIMIT", "16MiB", 1);
  setenv("SGM_POLICY", policy_name, 1);
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fail_msg("create with %s: %s", policy_name, sgm_last_error());
  sgm__placement_set_clock(ctx, fake_clock, NULL);
  return ctx;
}

static void ctx_verify(sgm_context *ctx, const char *name) {
  char why[256] = "";
  if (sgm__placement_check(ctx, why, sizeof why) != SGM_OK) fail_msg("%s: %s", name, why);
}

/* Invariant: acquired buffers are never victims — under pressure that moves
 * everything else, they stay in VRAM at the same address — and after every
 * call the policies' reclaimable bytes equal the released resident buffers. */
static void test_api_acquired_never_victims(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("policies.api", 77);
  for (size_t k = 0; k < sgm_policy_count(); k++) {
    const char *name = sgm_policy_at(k)->name;
    sgm_test_rng r;
    sgm_test_rng_init(&r, seed + k);
    sgm_context *ctx = make_ctx(name);
    assert_string_equal(sgm__placement_policy_name(ctx, SGM_TIER_VRAM), name);
    enum { N = 40 };
    sgm_buffer *b[N];
    void *ptr[N];
    bool held[N];
    for (int i = 0; i < N; i++) {
      assert_int_equal(sgm_buffer_create(ctx, 512 * KiB, &b[i]), SGM_OK);
      held[i] = false;
    }
    for (int step = 0; step < 600; step++) {
      int i = (int)sgm_test_rng_range(&r, 0, N - 1);
      fake_clock_advance(10000000);
      if (held[i]) {
        assert_int_equal(sgm_buffer_tier(b[i]), SGM_TIER_VRAM);
        assert_int_equal(sgm_buffer_release(b[i], NULL), SGM_OK);
        held[i] = false;
      } else {
        int n_held = 0;
        for (int j = 0; j < N; j++) n_held += held[j];
        void *d = NULL;
        sgm_status rc = sgm_buffer_acquire(b[i], NULL, &d);
        if (rc != SGM_OK) fail_msg("%s: acquire: %s", name, sgm_last_error());
        /* Keep at most 6 of VRAM's 16 places held, so VRAM has victims. */
        if (sgm_buffer_tier(b[i]) == SGM_TIER_VRAM && n_held < 6) {
          held[i] = true;
          ptr[i] = d;
        } else {
          assert_int_equal(sgm_buffer_release(b[i], NULL), SGM_OK);
        }
      }
      if (sgm_test_rng_range(&r, 0, 9) == 0) {
        int j = (int)sgm_test_rng_range(&r, 0, N - 1);
        if (!held[j]) assert_int_equal(sgm_buffer_set_priority(b[j], (int)sgm_test_rng_range(&r, 0, 4)), SGM_OK);
      }
      for (int j = 0; j < N; j++) {
        if (!held[j]) continue;
        assert_int_equal(sgm_buffer_tier(b[j]), SGM_TIER_VRAM);
        void *again = NULL;
        assert_int_equal(sgm_buffer_acquire(b[j], NULL, &again), SGM_ERR_BUSY);
        (void)ptr;
      }
      ctx_verify(ctx, name);
    }
    sgm_stats st;
    sgm_get_stats(ctx, &st);
    print_message("# %s: %llu evictions from VRAM\n", name,
                  (unsigned long long)st.tier[SGM_TIER_VRAM].n_evictions);
    assert_true(st.tier[SGM_TIER_VRAM].n_evictions > 0);
    /* Destroy some while acquired (their pins end in a drop), the rest with the context. */
    for (int i = 0; i < N; i += 2) sgm_buffer_destroy(b[i]);
    ctx_verify(ctx, name);
    sgm_context_destroy(ctx);
  }
}

/* Invariant, under every policy: a lower priority leaves VRAM first. */
static void test_api_priorities_every_policy(void **state) {
  (void)state;
  for (size_t k = 0; k < sgm_policy_count(); k++) {
    const char *name = sgm_policy_at(k)->name;
    sgm_context *ctx = make_ctx(name);
    enum { N = 8 };
    sgm_buffer *b[N];
    int prio[N] = {4, 3, 2, 2, 2, 2, 0, 1};
    for (int i = 0; i < N; i++) {
      assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &b[i]), SGM_OK);
      void *d;
      assert_int_equal(sgm_buffer_acquire(b[i], NULL, &d), SGM_OK); /* used once: not fresh */
      assert_int_equal(sgm_buffer_release(b[i], NULL), SGM_OK);
      assert_int_equal(sgm_buffer_set_priority(b[i], prio[i]), SGM_OK);
    }
    for (int k2 = 0; k2 < N; k2++) {
      sgm_buffer *n;
      assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &n), SGM_OK);
      void *d;
      assert_int_equal(sgm_buffer_acquire(n, NULL, &d), SGM_OK); /* never a victim */
      int max_gone = -1, min_left = 99;
      for (int i = 0; i < N; i++) {
        if (sgm_buffer_tier(b[i]) == SGM_TIER_VRAM) min_left = prio[i] < min_left ? prio[i] : min_left;
        else max_gone = prio[i] > max_gone ? prio[i] : max_gone;
      }
      if (max_gone > min_left)
        fail_msg("%s: a priority-%d buffer left VRAM before a priority-%d one", name, max_gone, min_left);
      ctx_verify(ctx, name);
    }
    sgm_context_destroy(ctx);
  }
}

/* A backend whose events stay pending while the test says so: the emulated
 * device's vtable with event_record / event_query wrapped. */
static const sgm_backend_ops *real_bops;
static sgm_backend_ops pending_bops;
static bool next_event_pending;   /* the next recorded event is pending */
static void *pending_events[16];  /* events that report "not complete" */
static int n_pending_events;

static int pending_record(sgm_backend *be, void *stream, void **out) {
  int rc = real_bops->event_record(be, stream, out);
  if (rc == SGM_OK && next_event_pending && n_pending_events < 16) pending_events[n_pending_events++] = *out;
  next_event_pending = false;
  return rc;
}

static int pending_query(sgm_backend *be, void *ev) {
  for (int i = 0; i < n_pending_events; i++)
    if (pending_events[i] == ev) return 0;
  return real_bops->event_query(be, ev);
}

/* Invariant, under every policy: a released buffer whose GPU work has not
 * completed is skipped as a victim (others leave instead), keeps its place in
 * the policy, and leaves once the work is done. */
static void test_api_pending_gpu_work_skipped(void **state) {
  (void)state;
  for (size_t k = 0; k < sgm_policy_count(); k++) {
    const char *name = sgm_policy_at(k)->name;
    sgm_context *ctx = make_ctx(name);
    real_bops = sgm__context_bops(ctx);
    pending_bops = *real_bops;
    pending_bops.event_record = pending_record;
    pending_bops.event_query = pending_query;
    sgm__context_set_bops(ctx, &pending_bops);
    n_pending_events = 0;
    enum { N = 8 };
    sgm_buffer *b[N];
    for (int i = 0; i < N; i++) {
      assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &b[i]), SGM_OK);
      void *d;
      assert_int_equal(sgm_buffer_acquire(b[i], NULL, &d), SGM_OK);
      next_event_pending = i < 3; /* the three oldest: work still queued */
      assert_int_equal(sgm_buffer_release(b[i], NULL), SGM_OK);
      /* Below the newcomers' priority: a newcomer of a higher level is always
       * admitted, so an admission policy (tinylfu) does not keep these used
       * buffers and send the newcomers to shared memory, as it may. */
      assert_int_equal(sgm_buffer_set_priority(b[i], SGM_PRIORITY_LOW), SGM_OK);
    }
    /* VRAM is full: five new buffers push out the five idle ones. */
    sgm_buffer *n[N];
    for (int j = 0; j < 5; j++) {
      assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &n[j]), SGM_OK);
      void *d;
      assert_int_equal(sgm_buffer_acquire(n[j], NULL, &d), SGM_OK);
      ctx_verify(ctx, name);
    }
    for (int i = 0; i < N; i++)
      assert_int_equal(sgm_buffer_tier(b[i]), i < 3 ? SGM_TIER_VRAM : SGM_TIER_SHARED);
    /* Nothing idle is left in VRAM: the next one lands in shared memory. */
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &n[5]), SGM_OK);
    assert_int_equal(sgm_buffer_tier(n[5]), SGM_TIER_SHARED);
    ctx_verify(ctx, name);
    /* The work completes: they may go now. */
    n_pending_events = 0;
    for (int j = 6; j < N; j++) {
      assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &n[j]), SGM_OK);
      assert_int_equal(sgm_buffer_tier(n[j]), SGM_TIER_VRAM);
    }
    int left = 0;
    for (int i = 0; i < 3; i++) left += sgm_buffer_tier(b[i]) == SGM_TIER_SHARED;
    assert_int_equal(left, 2);
    ctx_verify(ctx, name);
    sgm_context_destroy(ctx);
  }
}

/* Invariant, under every policy: a random mix of every buffer call —
 * create, acquire/release, host read/write, explicit eviction to shared
 * memory and disk, prefetch (a worker thread), priority changes, destroy —
 * keeps every buffer listed exactly when released and resident, the
 * policies valid, their reclaimable bytes equal to the listed buffers', and
 * the data intact. */
static void test_api_storm_every_policy(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("policies.api_storm", 4242);
  char dir[] = "/tmp/sgm_policies_XXXXXX";
  assert_non_null(mkdtemp(dir));
  for (size_t k = 0; k < sgm_policy_count(); k++) {
    const char *name = sgm_policy_at(k)->name;
    sgm_test_rng r;
    sgm_test_rng_init(&r, seed + k);
    sgm_test_clean_env();
    setenv("SGM_EMU_VRAM", "64MiB", 1);
    setenv("SGM_VRAM_LIMIT", "4MiB", 1);
    setenv("SGM_SHARED_LIMIT", "4MiB", 1);
    setenv("SGM_SPILL_DIR", dir, 1);
    setenv("SGM_SPILL_LIMIT", "256MiB", 1);
    setenv("SGM_POLICY", name, 1);
    sgm_context *ctx = NULL;
    assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
    sgm__placement_set_clock(ctx, fake_clock, NULL);
    enum { N = 40 }; /* about 8 MiB in all: twice what VRAM and shared memory hold */
    sgm_buffer *b[N] = {0};
    unsigned char tag[N] = {0};
    bool held[N] = {false};
    for (int step = 0; step < 1500; step++) {
      int i = (int)sgm_test_rng_range(&r, 0, N - 1);
      fake_clock_advance(5000000);
      if (!b[i]) {
        size_t sz = (size_t)sgm_test_rng_log_range(&r, 4 * KiB, 1 * MiB);
        assert_int_equal(sgm_buffer_create(ctx, sz, &b[i]), SGM_OK);
        tag[i] = (unsigned char)sgm_test_rng_next(&r);
        assert_int_equal(sgm_buffer_write(b[i], 0, &tag[i], 1), SGM_OK);
        continue;
      }
      void *d;
      unsigned char got = 0;
      switch (sgm_test_rng_range(&r, 0, 7)) {
        case 0:
        case 1:
          if (held[i]) {
            assert_int_equal(sgm_buffer_release(b[i], NULL), SGM_OK);
            held[i] = false;
          } else {
            sgm_status rc = sgm_buffer_acquire(b[i], NULL, &d);
            if (rc != SGM_OK && rc != SGM_ERR_NOMEM) fail_msg("%s: acquire: %s", name, sgm_last_error());
            held[i] = rc == SGM_OK;
          }
          break;
        case 2:
          assert_int_equal(sgm_buffer_read(b[i], 0, &got, 1), SGM_OK);
          assert_int_equal(got, tag[i]);
          break;
        case 3:
          tag[i]++;
          assert_int_equal(sgm_buffer_write(b[i], 0, &tag[i], 1), SGM_OK);
          break;
        case 4:
          if (!held[i])
            assert_int_equal(sgm_buffer_evict(b[i], sgm_test_rng_range(&r, 0, 1) ? SGM_TIER_DISK
                                                                            : SGM_TIER_SHARED), SGM_OK);
          break;
        case 5: assert_int_equal(sgm_buffer_prefetch(b[i], NULL), SGM_OK); break;
        case 6:
          assert_int_equal(sgm_buffer_set_priority(b[i], (int)sgm_test_rng_range(&r, 0, 4)), SGM_OK);
          break;
        default:
          sgm_buffer_destroy(b[i]); /* held or not */
          b[i] = NULL;
          held[i] = false;
          break;
      }
      ctx_verify(ctx, name);
    }
    for (int i = 0; i < N; i++) {
      if (!b[i]) continue;
      unsigned char got = 0;
      assert_int_equal(sgm_buffer_read(b[i], 0, &got, 1), SGM_OK);
      assert_int_equal(got, tag[i]);
    }
    ctx_verify(ctx, name);
    sgm_stats st;
    sgm_get_stats(ctx, &st);
    print_message("# %s: %llu evictions from VRAM, %llu from shared memory\n", name,
                  (unsigned long long)st.tier[SGM_TIER_VRAM].n_evictions,
                  (unsigned long long)st.tier[SGM_TIER_SHARED].n_evictions);
    assert_true(st.tier[SGM_TIER_VRAM].n_evictions > 0);
    assert_true(st.tier[SGM_TIER_SHARED].n_evictions > 0);
    sgm_context_destroy(ctx);
  }
  assert_int_equal(rmdir(dir), 0);
}

/* ------------------------------------------------------------------------ */
/* Admission (ABI 2): record and admit through the buffer API. */

static uint64_t vram_evictions(sgm_context *ctx) {
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  return st.tier[SGM_TIER_VRAM].n_evictions;
}

/* Write a one-byte tag at offset 0 and at the end; read_tag checks both. */
static void write_tag(sgm_buffer *b, unsigned char tag) {
  size_t n = sgm_buffer_size(b);
  assert_int_equal(sgm_buffer_write(b, 0, &tag, 1), SGM_OK);
  assert_int_equal(sgm_buffer_write(b, n - 1, &tag, 1), SGM_OK);
}

static void read_tag(sgm_buffer *b, unsigned char tag) {
  size_t n = sgm_buffer_size(b);
  unsigned char got[2] = {0, 0};
  assert_int_equal(sgm_buffer_read(b, 0, &got[0], 1), SGM_OK);
  assert_int_equal(sgm_buffer_read(b, n - 1, &got[1], 1), SGM_OK);
  assert_int_equal(got[0], tag);
  assert_int_equal(got[1], tag);
}

static void use(sgm_buffer *b) {
  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(b, NULL, &d), SGM_OK);
  assert_non_null(d);
  assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
}

/*
 * The admission contract, with a policy whose admit is a switch: every
 * acquire is recorded (hit or miss); admit is asked only when a newcomer
 * needs a victim's room in VRAM; refused, the newcomer lands one tier down —
 * create: shared memory; acquire from shared: used there; acquire from disk:
 * shared memory; prefetch: stays — nothing is evicted for it, its data is
 * intact, and a later acquire that is admitted brings it to VRAM. Plain
 * allocations never ask and evict as before.
 */
static void test_api_admission_contract(void **state) {
  (void)state;
  char dir[] = "/tmp/sgm_admit_XXXXXX";
  assert_non_null(mkdtemp(dir));
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "8MiB", 1);
  setenv("SGM_SHARED_LIMIT", "16MiB", 1);
  setenv("SGM_SPILL_DIR", dir, 1);
  setenv("SGM_POLICY", "testgate", 1);
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  gate_refuse = false;
  gate_n_records = gate_n_admits = 0;
  enum { N = 8 };
  sgm_buffer *b[N];
  for (int i = 0; i < N; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &b[i]), SGM_OK);
    write_tag(b[i], (unsigned char)(i + 1));
    use(b[i]);
  }
  /* Room for all: recorded (both tiers' instances hear of each acquire),
   * never asked. */
  assert_int_equal(__atomic_load_n(&gate_n_records, __ATOMIC_SEQ_CST), 2 * N);
  assert_int_equal(__atomic_load_n(&gate_n_admits, __ATOMIC_SEQ_CST), 0);

  __atomic_store_n(&gate_refuse, true, __ATOMIC_SEQ_CST);
  sgm_buffer *c;
  assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &c), SGM_OK);
  assert_int_equal(sgm_buffer_tier(c), SGM_TIER_SHARED); /* refused at create */
  assert_int_equal(__atomic_load_n(&gate_n_admits, __ATOMIC_SEQ_CST), 1);
  write_tag(c, 0xC1);
  void *d = NULL;
  assert_int_equal(sgm_buffer_acquire(c, NULL, &d), SGM_OK); /* used in shared memory */
  assert_non_null(d);
  assert_int_equal(sgm_buffer_tier(c), SGM_TIER_SHARED);
  assert_int_equal(sgm_buffer_release(c, NULL), SGM_OK);
  assert_int_equal(__atomic_load_n(&gate_n_records, __ATOMIC_SEQ_CST), 2 * N + 2);
  read_tag(c, 0xC1);
  /* From disk, refused: it comes up to shared memory, not VRAM. */
  assert_int_equal(sgm_buffer_evict(c, SGM_TIER_DISK), SGM_OK);
  assert_int_equal(sgm_buffer_tier(c), SGM_TIER_DISK);
  use(c);
  assert_int_equal(sgm_buffer_tier(c), SGM_TIER_SHARED);
  read_tag(c, 0xC1);
  /* A prefetch, refused: it stays. Wait for the worker's question (a
   * counter, not a sleep), then for the buffer (a read waits while it is
   * being moved). */
  uint64_t asked = __atomic_load_n(&gate_n_admits, __ATOMIC_SEQ_CST);
  assert_int_equal(sgm_buffer_prefetch(c, NULL), SGM_OK);
  for (long spin = 0; __atomic_load_n(&gate_n_admits, __ATOMIC_SEQ_CST) == asked; spin++) {
    if (spin > 2000000000L) fail_msg("the prefetch worker never asked admit");
    sched_yield();
  }
  read_tag(c, 0xC1);
  assert_int_equal(sgm_buffer_tier(c), SGM_TIER_SHARED);
  assert_int_equal(vram_evictions(ctx), 0); /* nothing left VRAM for c */
  for (int i = 0; i < N; i++) assert_int_equal(sgm_buffer_tier(b[i]), SGM_TIER_VRAM);

  /* A plain allocation never asks: it evicts as before. */
  asked = __atomic_load_n(&gate_n_admits, __ATOMIC_SEQ_CST);
  void *p = sgm_alloc(ctx, 1 * MiB, NULL);
  assert_non_null(p);
  assert_int_equal(__atomic_load_n(&gate_n_admits, __ATOMIC_SEQ_CST), asked);
  assert_int_equal(vram_evictions(ctx), 1);
  sgm_free(ctx, p, NULL);

  /* Admitted now: the acquire brings it to VRAM, a FIFO victim leaves. */
  __atomic_store_n(&gate_refuse, false, __ATOMIC_SEQ_CST);
  use(c);
  assert_int_equal(sgm_buffer_tier(c), SGM_TIER_VRAM);
  assert_int_equal(__atomic_load_n(&gate_last_candidate, __ATOMIC_SEQ_CST),
                   __atomic_load_n(&gate_last_record, __ATOMIC_SEQ_CST));
  read_tag(c, 0xC1);
  for (int i = 0; i < N; i++) read_tag(b[i], (unsigned char)(i + 1));
  ctx_verify(ctx, "testgate");
  sgm_context_destroy(ctx);
  assert_int_equal(rmdir(dir), 0);
}

/*
 * A request that cannot fit in VRAM even if every released buffer left —
 * larger than the whole budget, or than the room plus everything evictable —
 * evicts nothing: it lands in shared memory and VRAM keeps what it holds.
 * (Before, it demoted everything first.) One that can fit still evicts.
 */
static void test_api_no_eviction_for_what_cannot_fit(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("lru");
  enum { N = 8 };
  sgm_buffer *b[N];
  for (int i = 0; i < N; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &b[i]), SGM_OK);
    use(b[i]);
  }
  void *p = sgm_alloc(ctx, 9 * MiB, NULL); /* > the 8 MiB budget */
  assert_non_null(p);                     /* the shared-memory fallback */
  sgm_free(ctx, p, NULL);
  sgm_buffer *big;
  assert_int_equal(sgm_buffer_create(ctx, 9 * MiB, &big), SGM_OK);
  assert_int_equal(sgm_buffer_tier(big), SGM_TIER_SHARED);
  use(big);
  assert_int_equal(sgm_buffer_tier(big), SGM_TIER_SHARED);
  assert_int_equal(vram_evictions(ctx), 0);
  sgm_buffer_destroy(big);
  /* Two held: 6 MiB evictable, no room; 7 MiB cannot fit either. */
  void *d0, *d1;
  assert_int_equal(sgm_buffer_acquire(b[0], NULL, &d0), SGM_OK);
  assert_int_equal(sgm_buffer_acquire(b[1], NULL, &d1), SGM_OK);
  sgm_buffer *seven;
  assert_int_equal(sgm_buffer_create(ctx, 7 * MiB, &seven), SGM_OK);
  assert_int_equal(sgm_buffer_tier(seven), SGM_TIER_SHARED);
  assert_int_equal(vram_evictions(ctx), 0);
  for (int i = 0; i < N; i++) assert_int_equal(sgm_buffer_tier(b[i]), SGM_TIER_VRAM);
  /* 6 MiB can: all six released buffers leave for it. */
  sgm_buffer *six;
  assert_int_equal(sgm_buffer_create(ctx, 6 * MiB, &six), SGM_OK);
  assert_int_equal(sgm_buffer_tier(six), SGM_TIER_VRAM);
  assert_int_equal(vram_evictions(ctx), 6);
  assert_int_equal(sgm_buffer_release(b[0], NULL), SGM_OK);
  assert_int_equal(sgm_buffer_release(b[1], NULL), SGM_OK);
  ctx_verify(ctx, "lru");
  sgm_context_destroy(ctx);
}

/*
 * TinyLFU's signature, through the vtable, with buffers small next to its
 * starting window (1% of 1000 buffers): a hot set used three times survives a
 * scan of twice the cache in cold buffers (each passes through the window
 * and loses its duel with main's victim, or is refused at the door while the
 * hill climber has shrunk the window below one buffer), and of two buffers
 * first used together, the one used four times is kept through a further
 * scan while the one used once is gone. Each hot use is followed by a cold
 * one, so that hot buffers are out of the window (in probation) when used
 * again, and move to protected; they are a quarter of its smallest share, so
 * a window the climber grows (up to 80%) takes its room from probation.
 */
static void test_tinylfu_window_and_duel(void **state) {
  (void)state;
  enum { CAP = 1000, HOT = 40, SCAN = 2000, X = 2 * HOT + SCAN, Y = X + 1, MORE = Y + 1,
         N = MORE + 2000 };
  const uint64_t cap = CAP * 4 * KiB;
  harness h;
  h_init(&h, policy("tinylfu"), N, cap);
  size_t cold = HOT;
  for (int round = 0; round < 3; round++)
    for (size_t i = 0; i < HOT; i++) {
      h_touch(&h, i, cap);
      if (round == 0) h_touch(&h, cold++, cap);
    }
  for (size_t i = cold; i < cold + SCAN; i++) h_touch(&h, i, cap);
  int kept = 0;
  for (size_t i = 0; i < HOT; i++) kept += h_resident(&h, i);
  print_message("# tinylfu: %d of %d hot buffers survived a scan of %d\n", kept, HOT, SCAN);
  assert_int_equal(kept, HOT);
  h_touch(&h, X, cap);
  h_touch(&h, Y, cap);
  for (int j = 0; j < 3; j++) h_touch(&h, X, cap);
  for (size_t i = MORE; i < N; i++) h_touch(&h, i, cap);
  assert_true(h_resident(&h, X));
  assert_false(h_resident(&h, Y));
  for (size_t i = 0; i < HOT; i++) assert_true(h_resident(&h, i));
  h_verify(&h);
  h_fini(&h);
}

/*
 * TinyLFU through the buffer API, with buffers larger than its window (1% of
 * 8 MiB): every newcomer to a full VRAM is judged by admit. A hot set used
 * four times survives a scan of cold buffers, which are never admitted: they
 * are created in shared memory, used there, read back intact, and nothing
 * leaves VRAM for them. A scan buffer acquired again (its estimate now above
 * main's victim's, a buffer used once) is admitted, and the victim is that
 * buffer, not a hot one.
 */
static void test_api_tinylfu_admission(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("tinylfu");
  enum { HOT = 6, FILL = 2, SCAN = 12 }; /* the scan fits the 16 MiB of shared memory */
  sgm_buffer *hot[HOT], *fill[FILL], *scan[SCAN];
  for (int i = 0; i < HOT; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &hot[i]), SGM_OK);
    write_tag(hot[i], (unsigned char)(0x10 + i));
  }
  for (int i = 0; i < FILL; i++) { /* VRAM's last 2 MiB: used once */
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &fill[i]), SGM_OK);
    use(fill[i]);
  }
  for (int round = 0; round < 4; round++)
    for (int i = 0; i < HOT; i++) use(hot[i]);
  for (int i = 0; i < SCAN; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 1 * MiB, &scan[i]), SGM_OK);
    write_tag(scan[i], (unsigned char)(0x40 + i));
    use(scan[i]);
  }
  /* VRAM was full: every scan buffer was refused, at create and at use. */
  for (int i = 0; i < HOT; i++) assert_int_equal(sgm_buffer_tier(hot[i]), SGM_TIER_VRAM);
  for (int i = 0; i < FILL; i++) assert_int_equal(sgm_buffer_tier(fill[i]), SGM_TIER_VRAM);
  for (int i = 0; i < SCAN; i++) assert_int_equal(sgm_buffer_tier(scan[i]), SGM_TIER_SHARED);
  assert_int_equal(vram_evictions(ctx), 0);
  for (int i = 0; i < SCAN; i++) read_tag(scan[i], (unsigned char)(0x40 + i));
  /* Asked for again while outside: admitted at its second acquire. */
  int uses = 1;
  while (sgm_buffer_tier(scan[10]) != SGM_TIER_VRAM && uses < 8) {
    use(scan[10]);
    uses++;
  }
  print_message("# tinylfu: a refused buffer was admitted at its use number %d\n", uses);
  assert_int_equal(sgm_buffer_tier(scan[10]), SGM_TIER_VRAM);
  assert_int_equal(uses, 2);
  assert_int_equal(vram_evictions(ctx), 1);
  for (int i = 0; i < HOT; i++) assert_int_equal(sgm_buffer_tier(hot[i]), SGM_TIER_VRAM);
  assert_int_equal((sgm_buffer_tier(fill[0]) == SGM_TIER_VRAM) + (sgm_buffer_tier(fill[1]) == SGM_TIER_VRAM), 1);
  read_tag(scan[10], 0x4A);
  for (int i = 0; i < HOT; i++) read_tag(hot[i], (unsigned char)(0x10 + i));
  ctx_verify(ctx, "tinylfu");
  sgm_context_destroy(ctx);
}

/* Per-tier choice: SGM_POLICY for both tiers unless SGM_POLICY_VRAM /
 * SGM_POLICY_SHARED (or the config fields) say otherwise; bad names fail
 * create naming the variable or field and listing the registered policies. */
static void test_per_tier_policy_choice(void **state) {
  (void)state;
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_POLICY", "clock", 1);
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  assert_string_equal(sgm__placement_policy_name(ctx, SGM_TIER_VRAM), "clock");
  assert_string_equal(sgm__placement_policy_name(ctx, SGM_TIER_SHARED), "clock");
  sgm_context_destroy(ctx);

  setenv("SGM_POLICY_VRAM", "ARC", 1);
  setenv("SGM_POLICY_SHARED", "testfifo", 1);
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  assert_string_equal(sgm__placement_policy_name(ctx, SGM_TIER_VRAM), "arc");
  assert_string_equal(sgm__placement_policy_name(ctx, SGM_TIER_SHARED), "testfifo");
  sgm_context_destroy(ctx);

  setenv("SGM_POLICY_VRAM", "belady", 1);
  sgm_config cfg;
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "SGM_POLICY_VRAM=\"belady\""));
  assert_non_null(strstr(cfg.error, "lru, clock, lfu, arc, s3fifo, tinylfu, lirs, testfifo, testgate"));
  assert_int_equal(sgm_context_create(&cfg, &ctx), SGM_ERR_INVALID);
  assert_null(ctx);

  unsetenv("SGM_POLICY_VRAM");
  sgm_config_init(&cfg);
  assert_string_equal(cfg.error, "");
  strcpy(cfg.policy_shared, "mru");
  assert_int_equal(sgm_context_create(&cfg, &ctx), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "sgm_config.policy_shared"));
  assert_non_null(strstr(sgm_last_error(), "s3fifo"));
  strcpy(cfg.policy_shared, "S3FIFO");
  assert_int_equal(sgm_context_create(&cfg, &ctx), SGM_OK);
  assert_string_equal(sgm__placement_policy_name(ctx, SGM_TIER_SHARED), "s3fifo");
  sgm_context_destroy(ctx);
}

/* ------------------------------------------------------------------------ */
/* The registry. */

/* The built-ins come first in a fixed order, names match ignoring case, and
 * options.c's list of built-in names is the registry's. */
static void test_registry_builtins(void **state) {
  (void)state;
  const char *want[] = {"lru", "clock", "lfu", "arc", "s3fifo", "tinylfu", "lirs"};
  assert_true(sgm_policy_count() >= 7);
  for (size_t i = 0; i < 7; i++) {
    const sgm_policy_ops *ops = sgm_policy_at(i);
    assert_non_null(ops);
    assert_string_equal(ops->name, want[i]);
    assert_non_null(ops->check); /* every built-in can be checked */
    assert_non_null(ops->summary);
    assert_ptr_equal(sgm_policy_find(want[i]), ops);
    /* Only the admission policy counts and admits. */
    bool tiny = strcmp(want[i], "tinylfu") == 0;
    assert_true((ops->record != NULL) == tiny && (ops->admit != NULL) == tiny);
  }
  assert_ptr_equal(sgm_policy_find("S3FIFO"), sgm_policy_at(4));
  assert_null(sgm_policy_find("mru"));
  assert_null(sgm_policy_find(NULL));
  assert_null(sgm_policy_at(sgm_policy_count()));
  size_t n;
  const sgm_option *t = sgm__options_table(&n);
  const sgm_option *row = NULL;
  for (size_t i = 0; i < n; i++)
    if (strcmp(t[i].env, "SGM_POLICY") == 0) row = &t[i];
  assert_non_null(row);
  size_t j = 0;
  for (; row->names[j]; j++) assert_string_equal(row->names[j], want[j]);
  assert_int_equal(j, 7);
}

static sgm_policy_ops complete_ops(const char *name) {
  sgm_policy_ops o = sgm__policy_lru;
  o.name = name;
  return o;
}

/* Registration refuses what it cannot run, and says why. */
static void test_register_errors(void **state) {
  (void)state;
  size_t before = sgm_policy_count();
  assert_int_equal(sgm_policy_register(NULL), SGM_ERR_INVALID);

  sgm_policy_ops o = complete_ops("abi_test");
  o.abi_version = SGM_POLICY_ABI_VERSION + 1;
  assert_int_equal(sgm_policy_register(&o), SGM_ERR_INVALID);
  print_message("# %s\n", sgm_last_error());
  assert_non_null(strstr(sgm_last_error(), "ABI"));

  /* Each required member missing in turn: the message names it. */
  static const char *const members[] = {"create", "destroy", "on_insert", "on_access",
                                        "on_remove", "reclaimable_bytes", "next_victim"};
  for (size_t m = 0; m < sizeof members / sizeof members[0]; m++) {
    o = complete_ops("incomplete");
    switch (m) {
      case 0: o.create = NULL; break;
      case 1: o.destroy = NULL; break;
      case 2: o.on_insert = NULL; break;
      case 3: o.on_access = NULL; break;
      case 4: o.on_remove = NULL; break;
      case 5: o.reclaimable_bytes = NULL; break;
      default: o.next_victim = NULL; break;
    }
    assert_int_equal(sgm_policy_register(&o), SGM_ERR_INVALID);
    print_message("# %s\n", sgm_last_error());
    char want[64];
    snprintf(want, sizeof want, "lacks member %s ", members[m]);
    assert_non_null(strstr(sgm_last_error(), want));
  }
  o = complete_ops(NULL);
  assert_int_equal(sgm_policy_register(&o), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "name"));
  const char *bad_names[] = {"", "has space", "semi;colon", "a-name-that-is-far-too-long-for-sgm"};
  for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++) {
    o = complete_ops(bad_names[i]);
    assert_int_equal(sgm_policy_register(&o), SGM_ERR_INVALID);
  }
  o = complete_ops("LRU");
  assert_int_equal(sgm_policy_register(&o), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "already registered"));
  o = complete_ops("testfifo");
  assert_int_equal(sgm_policy_register(&o), SGM_ERR_INVALID);
  o = complete_ops("Opt");
  assert_int_equal(sgm_policy_register(&o), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "reserved"));
  o = complete_ops("all");
  assert_int_equal(sgm_policy_register(&o), SGM_ERR_INVALID);
  o = complete_ops("fat_state");
  o.state_bytes = SGM_POLICY_STATE_MAX + 1;
  assert_int_equal(sgm_policy_register(&o), SGM_ERR_INVALID);
  assert_int_equal(sgm_policy_count(), before); /* nothing half-registered */
  /* The optional members may be missing. */
  static sgm_policy_ops minimal;
  minimal = complete_ops("minimal_ok");
  minimal.summary = NULL;
  minimal.check = NULL;
  assert_int_equal(sgm_policy_register(&minimal), SGM_OK);
  assert_int_equal(sgm_policy_count(), before + 1);
  assert_ptr_equal(sgm_policy_find("Minimal_OK"), &minimal);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_registry_builtins),
      cmocka_unit_test(test_storm_every_policy),
      cmocka_unit_test(test_pinned_never_victims),
      cmocka_unit_test(test_size_aware_every_policy),
      cmocka_unit_test(test_lru_evicts_least_recently_used),
      cmocka_unit_test(test_clock_second_chance),
      cmocka_unit_test(test_lfu_hot_survives_scan_and_ages),
      cmocka_unit_test(test_scan_resistance),
      cmocka_unit_test(test_arc_ghosts_adapt),
      cmocka_unit_test(test_priority_layer_every_policy),
      cmocka_unit_test(test_api_acquired_never_victims),
      cmocka_unit_test(test_api_priorities_every_policy),
      cmocka_unit_test(test_api_pending_gpu_work_skipped),
      cmocka_unit_test(test_api_storm_every_policy),
      cmocka_unit_test(test_api_admission_contract),
      cmocka_unit_test(test_api_no_eviction_for_what_cannot_fit),
      cmocka_unit_test(test_tinylfu_window_and_duel),
      cmocka_unit_test(test_api_tinylfu_admission),
      cmocka_unit_test(test_per_tier_policy_choice),
      cmocka_unit_test(test_register_errors),
  };
  return cmocka_run_group_tests_name("policies", tests, group_setup, NULL);
}
