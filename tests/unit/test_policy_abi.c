/*
 * test_policy_abi.c — plug-in ABI compatibility of the policy registry
 * (lib/policy.c): a policy built against the frozen ABI-1 header
 * (tests/support/policy_abi1/) registers, its missing ABI-2 members read as
 * absent, and a context runs on it; versions the library does not know are
 * refused with a message that says which versions it speaks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "sgm/policy.h"
#include "test_util.h"

#define MiB (UINT64_C(1) << 20)

/* tests/support/policy_abi1/fifo_abi1.c */
const void *sgm_test_policy_abi1_fifo(void);
size_t sgm_test_policy_abi1_ops_bytes(void);

/* 8 MiB of VRAM, 16 MiB of shared memory; `var` (a policy variable) = policy. */
static sgm_context *abi_ctx(const char *var, const char *policy) {
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "8MiB", 1);
  setenv("SGM_SHARED_LIMIT", "16MiB", 1);
  setenv(var, policy, 1);
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) fail_msg("create: %s", sgm_last_error());
  return ctx;
}

/* Invariant: an ABI-1 vtable (shorter than today's: no record, no admit)
 * registers; the registry's entry reads record and admit as NULL and keeps
 * every ABI-1 member; a context whose VRAM tier runs it evicts in its order
 * (first in, first out) with every placement invariant intact. Under ASan a
 * read past the end of the plug-in's vtable fails this test. */
static void test_abi1_policy_loads(void **state) {
  (void)state;
  const sgm_policy_ops *old = sgm_test_policy_abi1_fifo();
  assert_true(sgm_test_policy_abi1_ops_bytes() < sizeof(sgm_policy_ops));
  assert_int_equal(old->abi_version, 1);
  sgm_status rc = sgm_policy_register(old);
  if (rc != SGM_OK) fail_msg("register: %s", sgm_last_error());
  const sgm_policy_ops *ops = sgm_policy_find("fifo_abi1");
  assert_non_null(ops);
  assert_null(ops->record);
  assert_null(ops->admit);
  assert_null(ops->promote_before);
  assert_null(ops->on_hint);
  assert_ptr_equal(ops->create, old->create);
  assert_ptr_equal(ops->next_victim, old->next_victim);
  assert_ptr_equal(ops->name, old->name);
  assert_int_equal(ops->state_bytes, old->state_bytes);
  assert_int_equal(ops->abi_version, SGM_POLICY_ABI_VERSION);
  assert_ptr_equal(sgm_policy_at(sgm_policy_count() - 1), ops);

  sgm_context *ctx = abi_ctx("SGM_POLICY_VRAM", "fifo_abi1");
  assert_string_equal(sgm__placement_policy_name(ctx, SGM_TIER_VRAM), "fifo_abi1");
  sgm_buffer *b[10];
  for (int i = 0; i < 8; i++) {
    assert_int_equal(sgm_buffer_create(ctx, MiB, &b[i]), SGM_OK);
    assert_int_equal(sgm_buffer_tier(b[i]), SGM_TIER_VRAM);
  }
  /* Each newcomer evicts the oldest listed buffer: b[0], then b[1]. */
  for (int i = 8; i < 10; i++) {
    assert_int_equal(sgm_buffer_create(ctx, MiB, &b[i]), SGM_OK);
    assert_int_equal(sgm_buffer_tier(b[i]), SGM_TIER_VRAM);
    assert_int_equal(sgm_buffer_tier(b[i - 8]), SGM_TIER_SHARED);
  }
  for (int i = 2; i < 8; i++) assert_int_equal(sgm_buffer_tier(b[i]), SGM_TIER_VRAM);
  char why[256];
  if (sgm__placement_check(ctx, why, sizeof why) != SGM_OK) fail_msg("placement: %s", why);
  for (int i = 0; i < 10; i++) sgm_buffer_destroy(b[i]);
  sgm_context_destroy(ctx);
}

static void abi3_on_hint_trap(sgm_policy *p, sgm_policy_item *it) {
  (void)p;
  (void)it;
  fail_msg("on_hint called on an ABI-3 policy (the member postdates it)");
}

/* Invariant: an ABI-3 vtable (before residency hints) registers with on_hint
 * read as absent, even when the bytes past its end hold a pointer there; its
 * context takes every hint call (will-use, done, parent, cancel) without
 * calling it and evicts in the policy's own order (FIFO), as before hints. */
static void test_abi3_policy_ignores_hints(void **state) {
  (void)state;
  sgm_policy_ops ops;
  memset(&ops, 0, sizeof ops);
  memcpy(&ops, sgm_test_policy_abi1_fifo(), sgm_test_policy_abi1_ops_bytes());
  ops.abi_version = 3;
  ops.name = "fifo_abi3";
  ops.on_hint = abi3_on_hint_trap; /* past an ABI-3 vtable's end: must not be read */
  sgm_status rc = sgm_policy_register(&ops);
  if (rc != SGM_OK) fail_msg("register: %s", sgm_last_error());
  const sgm_policy_ops *got = sgm_policy_find("fifo_abi3");
  assert_non_null(got);
  assert_null(got->on_hint);

  sgm_context *ctx = abi_ctx("SGM_POLICY", "fifo_abi3");
  sgm_buffer *b[10];
  for (int i = 0; i < 8; i++) assert_int_equal(sgm_buffer_create(ctx, MiB, &b[i]), SGM_OK);
  assert_int_equal(sgm_will_use(ctx, &b[0], 2, 1), SGM_OK);
  assert_int_equal(sgm_buffer_done(b[7]), SGM_OK);
  assert_int_equal(sgm_buffer_set_parent(b[3], b[2]), SGM_OK);
  assert_int_equal(sgm_will_use(ctx, &b[1], 1, SGM_WILL_USE_CANCEL), SGM_OK);
  /* FIFO as before: the hints change nothing. */
  for (int i = 8; i < 10; i++) {
    assert_int_equal(sgm_buffer_create(ctx, MiB, &b[i]), SGM_OK);
    assert_int_equal(sgm_buffer_tier(b[i - 8]), SGM_TIER_SHARED);
  }
  assert_int_equal(sgm_buffer_tier(b[7]), SGM_TIER_VRAM);
  char why[256];
  if (sgm__placement_check(ctx, why, sizeof why) != SGM_OK) fail_msg("placement: %s", why);
  for (int i = 0; i < 10; i++) sgm_buffer_destroy(b[i]);
  sgm_context_destroy(ctx);
}

/* Invariant: a vtable for ABI 0 or for a version after this library's is
 * refused with SGM_ERR_INVALID and a message naming the versions spoken. */
static void test_unknown_abi_refused(void **state) {
  (void)state;
  sgm_policy_ops ops = *sgm_policy_find("lru");
  ops.name = "lru_future";
  ops.abi_version = SGM_POLICY_ABI_VERSION + 1;
  assert_int_equal(sgm_policy_register(&ops), SGM_ERR_INVALID);
  char want[96];
  snprintf(want, sizeof want, "this library speaks versions 1 to %u", SGM_POLICY_ABI_VERSION);
  assert_non_null(strstr(sgm_last_error(), want));
  ops.abi_version = 0;
  assert_int_equal(sgm_policy_register(&ops), SGM_ERR_INVALID);
  assert_null(sgm_policy_find("lru_future"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_abi1_policy_loads),
      cmocka_unit_test(test_abi3_policy_ignores_hints),
      cmocka_unit_test(test_unknown_abi_refused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
