/*
 * test_hints.c — residency hints (issue 30): the hint shell of policies/hinted.c
 * driven through the vtable (lru, s3fifo, lirs, arc), LRU's chains behind
 * their parents, and the public calls (sgm_will_use, sgm_buffer_done,
 * sgm_buffer_set_parent) through the buffer API on the emulated device.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtin.h"
#include "sgm.h"
#include "sgm/policy.h"
#include "test_util.h"

#define KiB (UINT64_C(1) << 10)

/* int sgm__placement_check: placement.c's test hook. */
int sgm__placement_check(sgm_context *ctx, char *why, size_t why_len);

static const char *const hinted_policies[] = {"lru", "s3fifo", "lirs", "arc"};

/* ---- a small harness over one instance ---- */

enum { OUT = 0, IN = 1, PINNED = 2 };

typedef struct titem {
  sgm_policy_item it;
  int where;
  _Alignas(16) unsigned char state[SGM_POLICY_STATE_MAX];
} titem;

typedef struct harness {
  const sgm_policy_ops *ops;
  sgm_policy *p;
  titem *items;
  size_t n;
  uint64_t in_bytes; /* model: bytes of IN items */
} harness;

static uint64_t zero_clock(void *u) {
  (void)u;
  return 0;
}

static void h_init(harness *h, const char *name, size_t n) {
  memset(h, 0, sizeof *h);
  h->ops = sgm_policy_find(name);
  assert_non_null(h->ops);
  assert_non_null(h->ops->on_hint); /* the built-ins of issue 30 read hints */
  h->n = n;
  h->items = calloc(n, sizeof *h->items);
  assert_non_null(h->items);
  for (size_t i = 0; i < n; i++) {
    h->items[i].it.id = 1 + i;
    h->items[i].it.size_bytes = 4 * KiB;
    h->items[i].it.priority = SGM_PRIORITY_NORMAL;
    h->items[i].it.state = h->items[i].state;
  }
  sgm_policy_params params = {.abi_version = SGM_POLICY_ABI_VERSION, .tier = SGM_TIER_VRAM,
                              .priority = SGM_PRIORITY_NORMAL, .capacity_bytes = n * 4 * KiB,
                              .clock_ns = zero_clock};
  assert_int_equal(h->ops->create(&params, &h->p), SGM_OK);
}

static void h_fini(harness *h) {
  h->ops->destroy(h->p);
  free(h->items);
}

static void h_verify(harness *h) {
  char why[256] = "";
  if (h->ops->check(h->p, why, sizeof why) != SGM_OK) fail_msg("%s: %s", h->ops->name, why);
  if (h->ops->reclaimable_bytes(h->p) != h->in_bytes)
    fail_msg("%s: reclaimable %llu, model %llu", h->ops->name,
             (unsigned long long)h->ops->reclaimable_bytes(h->p), (unsigned long long)h->in_bytes);
}

static void h_insert(harness *h, size_t i) {
  assert_int_equal(h->items[i].where, OUT);
  h->ops->on_insert(h->p, &h->items[i].it, SGM_POLICY_INSERT_NEW);
  h->items[i].where = IN;
  h->in_bytes += 4 * KiB;
}

/* A use: pinned, sgm clears the hints, then on_access. */
static void h_use(harness *h, size_t i) {
  titem *t = &h->items[i];
  assert_int_equal(t->where, IN);
  h->ops->on_remove(h->p, &t->it, SGM_POLICY_REMOVE_PIN);
  t->it.hint = 0;
  t->it.will_use_distance = 0;
  h->ops->on_access(h->p, &t->it);
}

/* What sgm does on a hint: set the fields; tell a listed item's policy. */
static void h_hint(harness *h, size_t i, uint32_t hint, uint32_t distance) {
  titem *t = &h->items[i];
  t->it.hint = hint;
  t->it.will_use_distance = distance;
  if (t->where == IN) h->ops->on_hint(h->p, &t->it);
}

static size_t h_evict(harness *h) {
  sgm_policy_item *v = h->ops->next_victim(h->p, 4 * KiB);
  assert_non_null(v);
  titem *t = (titem *)(void *)v;
  assert_int_equal(t->where, IN);
  h->ops->on_remove(h->p, v, SGM_POLICY_REMOVE_EVICT);
  t->where = OUT;
  h->in_bytes -= 4 * KiB;
  return (size_t)(t - h->items);
}

/*
 * Invariant: whatever the inner policy, an item marked done leaves before any
 * other, an item declared for future use leaves after every unhinted one, and
 * among future-use items the furthest distance leaves first; a cancelled hint
 * gives the item back to the inner policy. By hand, every hinted built-in.
 */
static void test_hint_order_every_hinted_policy(void **state) {
  (void)state;
  for (size_t k = 0; k < sizeof hinted_policies / sizeof *hinted_policies; k++) {
    harness h;
    h_init(&h, hinted_policies[k], 8);
    for (size_t i = 0; i < 8; i++) h_insert(&h, i);
    h_hint(&h, 0, SGM_POLICY_HINT_WILL_USE, 3);   /* near */
    h_hint(&h, 1, SGM_POLICY_HINT_WILL_USE, 200); /* far */
    h_hint(&h, 6, SGM_POLICY_HINT_DONE, 0);
    h_hint(&h, 2, SGM_POLICY_HINT_WILL_USE, 9);
    h_hint(&h, 2, 0, 0); /* cancelled: 2 is the inner policy's again */
    h_verify(&h);
    assert_int_equal(h_evict(&h), 6); /* done first */
    /* then the unhinted ones (2..5, 7) in the inner policy's order */
    bool seen[8] = {false};
    for (int j = 0; j < 5; j++) {
      size_t v = h_evict(&h);
      if (v == 0 || v == 1 || v == 6 || seen[v]) fail_msg("%s: victim %zu too early", hinted_policies[k], v);
      seen[v] = true;
      h_verify(&h);
    }
    assert_int_equal(h_evict(&h), 1); /* the furthest future use */
    assert_int_equal(h_evict(&h), 0);
    assert_null(h.ops->next_victim(h.p, 4 * KiB));
    h_verify(&h);
    h_fini(&h);
  }
}

/*
 * Invariant: under a random storm of inserts, uses, pins that end in a restore
 * or a drop, hints given and cancelled (listed or pinned), and evictions, the
 * instance stays valid (its check, reclaimable bytes = the evictable items),
 * a victim is evictable, a done item is the victim whenever one is listed,
 * and a future-use item only when no unhinted or done item is listed.
 */
static void test_hint_storm_every_hinted_policy(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("hints.storm", 30);
  for (size_t k = 0; k < sizeof hinted_policies / sizeof *hinted_policies; k++) {
    sgm_test_rng r;
    sgm_test_rng_init(&r, seed + k);
    enum { N = 48 };
    harness h;
    h_init(&h, hinted_policies[k], N);
    for (int step = 0; step < 6000; step++) {
      size_t i = (size_t)sgm_test_rng_range(&r, 0, N - 1);
      titem *t = &h.items[i];
      switch (sgm_test_rng_range(&r, 0, 6)) {
        case 0:
          if (t->where == OUT) h_insert(&h, i);
          else if (t->where == IN) h_use(&h, i);
          break;
        case 1: /* a pin that ends in a use, a restore or a drop */
          if (t->where == IN) {
            h.ops->on_remove(h.p, &t->it, SGM_POLICY_REMOVE_PIN);
            t->where = PINNED;
            h.in_bytes -= 4 * KiB;
          } else if (t->where == PINNED) {
            int how = (int)sgm_test_rng_range(&r, 0, 2);
            if (how == 0) {
              t->it.hint = 0, t->it.will_use_distance = 0;
              h.ops->on_access(h.p, &t->it);
            } else if (how == 1) {
              h.ops->on_insert(h.p, &t->it, SGM_POLICY_INSERT_RESTORE);
            } else {
              h.ops->on_remove(h.p, &t->it, SGM_POLICY_REMOVE_DROP);
              t->where = OUT;
              break;
            }
            t->where = IN;
            h.in_bytes += 4 * KiB;
          }
          break;
        case 2:
        case 3: {
          uint32_t kind = (uint32_t)sgm_test_rng_range(&r, 0, 2);
          uint32_t hint = kind == 0 ? 0 : kind == 1 ? SGM_POLICY_HINT_WILL_USE : SGM_POLICY_HINT_DONE;
          if (t->where != OUT) h_hint(&h, i, hint, (uint32_t)sgm_test_rng_log_range(&r, 1, 1000));
          break;
        }
        default: {
          if (!h.in_bytes) break;
          bool any_done = false, any_plain = false;
          for (size_t j = 0; j < N; j++) {
            if (h.items[j].where != IN) continue;
            any_done |= (h.items[j].it.hint & SGM_POLICY_HINT_DONE) != 0;
            any_plain |= h.items[j].it.hint == 0;
          }
          size_t v = h_evict(&h);
          uint32_t vh = h.items[v].it.hint;
          if (any_done && !(vh & SGM_POLICY_HINT_DONE))
            fail_msg("seed %llu %s step %d: victim %zu (hint %u) while a done item is listed",
                     (unsigned long long)seed, hinted_policies[k], step, v, vh);
          if ((vh & SGM_POLICY_HINT_WILL_USE) && (any_done || any_plain))
            fail_msg("seed %llu %s step %d: future-use victim %zu before an unhinted one",
                     (unsigned long long)seed, hinted_policies[k], step, v);
          break;
        }
      }
      h_verify(&h);
    }
    h_fini(&h);
  }
}

/* LRU with structure: a chain used root to leaf (each block's parent listed)
 * leaves leaf first, and a block without a listed parent is plain LRU. */
static void test_lru_chain_leaves_leaf_first(void **state) {
  (void)state;
  harness h;
  h_init(&h, "lru", 6);
  /* Chain 0 <- 1 <- 2, then 3 (no parent), then chain 4 <- 5. */
  for (size_t i = 0; i < 6; i++) {
    h.items[i].it.parent = (i == 1 || i == 2 || i == 5) ? &h.items[i - 1].it : NULL;
    h_insert(&h, i);
    h.items[i].it.parent = NULL; /* valid for the call only */
  }
  h_verify(&h);
  /* Head to tail: 4 5 3 0 1 2 (4 pushed at the head, 5 behind it). */
  size_t want[] = {2, 1, 0, 3, 5, 4};
  for (size_t j = 0; j < 6; j++) assert_int_equal(h_evict(&h), want[j]);
  h_fini(&h);
}

/*
 * LRU with chains (an item with a parent seen): a block used again (a prefix a
 * later request matched) is protected, so one-off blocks created after it
 * leave before it, where plain LRU (no parent ever named) evicts it first; an
 * evicted block that comes back while its id is a ghost is protected too; and
 * protected holds at most 30% of the listed bytes (its overflow is victim
 * after the one-off blocks, before nothing else). Runs both ways on the same
 * sequence: fails if the segmented mode is missing or leaks into plain LRU.
 */
static void test_lru_chains_protect_reused(void **state) {
  (void)state;
  for (int chains = 0; chains < 2; chains++) {
    harness h;
    h_init(&h, "lru", 12);
    /* 0 <- 1: a chain (with chains, 1 names 0 as parent); seven one-off
     * blocks 2..8; then 0 and 1 used again (2 of 9 items: 22% < 30%); then
     * one more one-off, 9. Plain LRU's order, tail first: 2..8 0 1 9. */
    h_insert(&h, 0);
    h.items[1].it.parent = chains ? &h.items[0].it : NULL;
    h_insert(&h, 1);
    h.items[1].it.parent = NULL;
    for (size_t i = 2; i < 9; i++) h_insert(&h, i);
    h_use(&h, 0);
    h_use(&h, 1);
    h_insert(&h, 9);
    h_verify(&h);
    for (size_t i = 2; i < 9; i++) assert_int_equal(h_evict(&h), i);
    if (!chains) {
      assert_int_equal(h_evict(&h), 0); /* plain LRU: the older use */
    } else {
      assert_int_equal(h_evict(&h), 9); /* the one-off before the reused prefix */
      assert_int_equal(h_evict(&h), 0);
      h_verify(&h);
      /* 0 comes back while a ghost: protected again (1, alone in protected
       * till then, overflows to probation), so new 10 leaves before it. */
      h_insert(&h, 0);
      h_insert(&h, 10);
      h_verify(&h);
      assert_int_equal(h_evict(&h), 1);
      assert_int_equal(h_evict(&h), 10);
      assert_int_equal(h_evict(&h), 0);
    }
    h_fini(&h);
  }
}

/* ---- through the buffer API ---- */

/* VRAM of 4 blocks of 64 KiB, lru. */
static sgm_context *make_ctx(void) {
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "16MiB", 1);
  setenv("SGM_VRAM_LIMIT", "256KiB", 1);
  setenv("SGM_SHARED_LIMIT", "16MiB", 1);
  setenv("SGM_POLICY", "lru", 1);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) fail_msg("create: %s", sgm_last_error());
  return ctx;
}

static void use(sgm_buffer *b) {
  void *p;
  assert_int_equal(sgm_buffer_acquire(b, NULL, &p), SGM_OK);
  assert_int_equal(sgm_buffer_release(b, NULL), SGM_OK);
}

static void ctx_verify(sgm_context *ctx) {
  char why[256] = "";
  if (sgm__placement_check(ctx, why, sizeof why) != SGM_OK) fail_msg("%s", why);
}

/*
 * Invariant: through sgm, a buffer declared for future use stays in VRAM while
 * unhinted ones leave (LRU would have sent it first), a done buffer leaves
 * first (LRU would have kept it), and a use ends both hints.
 */
static void test_api_will_use_and_done(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx();
  sgm_buffer *b[6];
  for (int i = 0; i < 4; i++) {
    assert_int_equal(sgm_buffer_create(ctx, 64 * KiB, &b[i]), SGM_OK);
    use(b[i]);
    assert_int_equal(sgm_buffer_tier(b[i]), SGM_TIER_VRAM);
  }
  /* b0 is the least recently used: declared, it stays; b3, the most recent, done: it goes. */
  assert_int_equal(sgm_will_use(ctx, &b[0], 1, 1), SGM_OK);
  assert_int_equal(sgm_buffer_done(b[3]), SGM_OK);
  ctx_verify(ctx);
  assert_int_equal(sgm_buffer_create(ctx, 64 * KiB, &b[4]), SGM_OK);
  assert_int_equal(sgm_buffer_tier(b[3]), SGM_TIER_SHARED);
  assert_int_equal(sgm_buffer_tier(b[0]), SGM_TIER_VRAM);
  assert_int_equal(sgm_buffer_create(ctx, 64 * KiB, &b[5]), SGM_OK);
  assert_int_equal(sgm_buffer_tier(b[1]), SGM_TIER_SHARED); /* LRU order among the unhinted */
  assert_int_equal(sgm_buffer_tier(b[0]), SGM_TIER_VRAM);
  ctx_verify(ctx);
  /* The use ends b0's hint: it is the LRU's again (most recent now). */
  use(b[0]);
  use(b[2]), use(b[4]), use(b[5]);
  ctx_verify(ctx);
  use(b[1]); /* promoted: the least recent (b0) leaves */
  assert_int_equal(sgm_buffer_tier(b[0]), SGM_TIER_SHARED);
  /* Cancelling: declared then cancelled, b2 leaves in LRU order. */
  assert_int_equal(sgm_will_use(ctx, &b[2], 1, 5), SGM_OK);
  assert_int_equal(sgm_will_use(ctx, &b[2], 1, SGM_WILL_USE_CANCEL), SGM_OK);
  use(b[0]);
  assert_int_equal(sgm_buffer_tier(b[2]), SGM_TIER_SHARED);
  ctx_verify(ctx);
  for (int i = 0; i < 6; i++) sgm_buffer_destroy(b[i]);
  sgm_context_destroy(ctx);
}

/* Bad input is refused with a message, nothing changed; the parent link ends
 * with either buffer (ASan would see a use after free). */
static void test_api_errors_and_parent_lifetime(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx(), *other = make_ctx();
  sgm_buffer *a, *b, *c, *x;
  assert_int_equal(sgm_buffer_create(ctx, 4 * KiB, &a), SGM_OK);
  assert_int_equal(sgm_buffer_create(ctx, 4 * KiB, &b), SGM_OK);
  assert_int_equal(sgm_buffer_create(ctx, 4 * KiB, &c), SGM_OK);
  assert_int_equal(sgm_buffer_create(other, 4 * KiB, &x), SGM_OK);
  assert_int_equal(sgm_will_use(NULL, &a, 1, 1), SGM_ERR_INVALID);
  assert_int_equal(sgm_will_use(ctx, NULL, 1, 1), SGM_ERR_INVALID);
  assert_int_equal(sgm_will_use(ctx, NULL, 0, 1), SGM_OK);
  sgm_buffer *mixed[] = {a, x};
  assert_int_equal(sgm_will_use(ctx, mixed, 2, 1), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "another context"));
  assert_non_null(strstr(sgm_last_error(), "bufs[1]"));
  sgm_buffer *with_null[] = {a, NULL};
  assert_int_equal(sgm_will_use(ctx, with_null, 2, 1), SGM_ERR_INVALID);
  assert_int_equal(sgm_buffer_done(NULL), SGM_ERR_INVALID);
  assert_int_equal(sgm_buffer_set_parent(a, a), SGM_ERR_INVALID);
  assert_int_equal(sgm_buffer_set_parent(a, x), SGM_ERR_INVALID);
  assert_int_equal(sgm_buffer_set_parent(b, a), SGM_OK);
  assert_int_equal(sgm_buffer_set_parent(c, b), SGM_OK);
  assert_int_equal(sgm_buffer_set_parent(a, c), SGM_ERR_INVALID); /* a cycle */
  assert_non_null(strstr(sgm_last_error(), "cycle"));
  assert_int_equal(sgm_buffer_set_parent(b, NULL), SGM_OK);
  assert_int_equal(sgm_buffer_set_parent(b, a), SGM_OK);
  sgm_buffer_destroy(b); /* c's parent goes: c keeps working */
  use(c);
  use(a);
  assert_int_equal(sgm_buffer_set_parent(c, a), SGM_OK);
  sgm_buffer_destroy(a);
  use(c);
  ctx_verify(ctx);
  sgm_buffer_destroy(c);
  sgm_buffer_destroy(x);
  sgm_context_destroy(other);
  sgm_context_destroy(ctx);
}

/* ---- concurrency ---- */

enum { CONC_N = 24, CONC_STEPS = 3000 };

typedef struct conc {
  sgm_context *ctx;
  sgm_buffer *b[CONC_N];
  uint64_t seed;
  int role; /* 0, 1: users; 2: will-use and done; 3: parents */
} conc;

static void *conc_thread(void *arg) {
  conc *c = arg;
  sgm_test_rng r;
  sgm_test_rng_init(&r, c->seed);
  for (int step = 0; step < CONC_STEPS; step++) {
    /* Users take disjoint halves: a buffer is used by one thread at a time. */
    size_t i = (size_t)sgm_test_rng_range(&r, 0, CONC_N / 2 - 1) + (c->role == 1 ? CONC_N / 2 : 0);
    size_t j = (size_t)sgm_test_rng_range(&r, 0, CONC_N - 1);
    switch (c->role) {
      case 0:
      case 1: {
        void *p;
        if (sgm_buffer_acquire(c->b[i], NULL, &p) == SGM_OK) sgm_buffer_release(c->b[i], NULL);
        break;
      }
      case 2:
        if (step % 3 == 0) sgm_buffer_done(c->b[j]);
        else sgm_will_use(c->ctx, &c->b[j], 1, step % 5 == 0 ? SGM_WILL_USE_CANCEL : (uint32_t)step);
        break;
      default:
        /* Parents only point to lower indices: no cycle is ever asked for. */
        sgm_buffer_set_parent(c->b[j], j && step % 4 ? c->b[(size_t)sgm_test_rng_range(&r, 0, j - 1)] : NULL);
        break;
    }
  }
  return NULL;
}

/* Invariant: hints (will-use, done, cancel, parents) given from other threads
 * while two threads acquire and release the buffers under pressure (24 blocks
 * of 64 KiB, VRAM for 4) leave every placement and policy invariant intact
 * (TSan: no race between the hint writers and the policy calls). */
static void test_api_hints_concurrent(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("hints.concurrent", 3030);
  conc c[4];
  c[0].ctx = make_ctx();
  for (int i = 0; i < CONC_N; i++) assert_int_equal(sgm_buffer_create(c[0].ctx, 64 * KiB, &c[0].b[i]), SGM_OK);
  pthread_t th[4];
  for (int k = 0; k < 4; k++) {
    if (k) c[k] = c[0];
    c[k].role = k;
    c[k].seed = seed + (uint64_t)k;
    assert_int_equal(pthread_create(&th[k], NULL, conc_thread, &c[k]), 0);
  }
  for (int k = 0; k < 4; k++) pthread_join(th[k], NULL);
  ctx_verify(c[0].ctx);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(c[0].ctx, &st), SGM_OK);
  print_message("# %llu evictions from VRAM\n", (unsigned long long)st.tier[SGM_TIER_VRAM].n_evictions);
  assert_true(st.tier[SGM_TIER_VRAM].n_evictions > 1000); /* under pressure all along */
  for (int i = 0; i < CONC_N; i++) sgm_buffer_destroy(c[0].b[i]);
  sgm_context_destroy(c[0].ctx);
}

int main(void) {
  sgm_test_clean_env();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hint_order_every_hinted_policy),
      cmocka_unit_test(test_hint_storm_every_hinted_policy),
      cmocka_unit_test(test_lru_chain_leaves_leaf_first),
      cmocka_unit_test(test_lru_chains_protect_reused),
      cmocka_unit_test(test_api_will_use_and_done),
      cmocka_unit_test(test_api_errors_and_parent_lifetime),
      cmocka_unit_test(test_api_hints_concurrent),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
