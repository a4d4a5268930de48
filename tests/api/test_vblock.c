/*
 * test_vblock.c — the public virtual block (include/sgm/vblock.h), black box:
 * argument contracts, exact fill and reuse, alignment, a seeded random run
 * checked against a model (no overlap, inside the range, aligned, stats add
 * up), free of what was never handed out, clear.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sgm.h"
#include "sgm/vblock.h"
#include "test_util.h"

/* Invariant: bad arguments are refused with SGM_ERR_INVALID and *out NULL. */
static void test_create_contract(void **state) {
  (void)state;
  sgm_vblock *vb = (sgm_vblock *)1;
  assert_int_equal(sgm_vblock_create(0, 1024, 3, &vb), SGM_ERR_INVALID);
  assert_null(vb);
  assert_non_null(strstr(sgm_last_error(), "power of two"));
  vb = (sgm_vblock *)1;
  assert_int_equal(sgm_vblock_create(8, 1024, 16, &vb), SGM_ERR_INVALID); /* misaligned start */
  assert_null(vb);
  assert_int_equal(sgm_vblock_create(0, 1000, 16, &vb), SGM_ERR_INVALID); /* misaligned size */
  assert_int_equal(sgm_vblock_create(0, 0, 1, &vb), SGM_ERR_INVALID);
  assert_int_equal(sgm_vblock_create(UINT64_MAX - 15, 32, 16, &vb), SGM_ERR_INVALID); /* wraps */
  assert_int_equal(sgm_vblock_create(0, 64, 0, NULL), SGM_ERR_INVALID);
  sgm_vblock_destroy(NULL);
  sgm_vblock_stats st;
  memset(&st, 0xff, sizeof st);
  sgm_vblock_get_stats(NULL, &st);
  assert_int_equal(st.size_bytes, 0);
  assert_int_equal(st.n_allocations, 0);
}

/* Invariant: a block fills exactly to its size in granules, then refuses
 * with SGM_ERR_NOMEM and *offset_out 0; a freed piece is reused; a double
 * free and a foreign offset are refused and change nothing. */
static void test_fill_and_reuse(void **state) {
  (void)state;
  sgm_vblock *vb;
  assert_int_equal(sgm_vblock_create(4096, 16 * 256, 256, &vb), SGM_OK);
  uint64_t off[16];
  for (int i = 0; i < 16; i++) {
    assert_int_equal(sgm_vblock_alloc(vb, 200, 0, &off[i]), SGM_OK); /* rounds up to 256 */
    assert_true(off[i] >= 4096 && off[i] + 256 <= 4096 + 16 * 256);
    assert_int_equal(off[i] % 256, 0);
  }
  sgm_vblock_stats st;
  sgm_vblock_get_stats(vb, &st);
  assert_int_equal(st.used_bytes, 16 * 256);
  assert_int_equal(st.n_allocations, 16);
  assert_int_equal(st.largest_free_bytes, 0);
  uint64_t x = 7;
  assert_int_equal(sgm_vblock_alloc(vb, 1, 0, &x), SGM_ERR_NOMEM);
  assert_int_equal(x, 0);
  assert_non_null(strstr(sgm_last_error(), "largest free: 0"));
  assert_int_equal(sgm_vblock_free(vb, off[5]), SGM_OK);
  assert_int_equal(sgm_vblock_free(vb, off[5]), SGM_ERR_INVALID); /* double free */
  assert_int_equal(sgm_vblock_free(vb, off[6] + 256 / 2), SGM_ERR_INVALID); /* inside, not a start */
  assert_int_equal(sgm_vblock_alloc(vb, 256, 0, &x), SGM_OK);
  assert_int_equal(x, off[5]);
  sgm_vblock_get_stats(vb, &st);
  assert_int_equal(st.n_allocations, 16);
  assert_int_equal(sgm_vblock_alloc(vb, 0, 0, &x), SGM_ERR_INVALID);
  assert_int_equal(sgm_vblock_alloc(vb, 1, 48, &x), SGM_ERR_INVALID); /* not a power of two */
  assert_int_equal(sgm_vblock_alloc(NULL, 1, 0, &x), SGM_ERR_INVALID);
  assert_int_equal(sgm_vblock_alloc(vb, 1, 0, NULL), SGM_ERR_INVALID);
  assert_int_equal(sgm_vblock_free(NULL, 0), SGM_ERR_INVALID);
  /* clear: everything goes, the whole range is one free fragment again. */
  assert_int_equal(sgm_vblock_clear(vb), SGM_OK);
  sgm_vblock_get_stats(vb, &st);
  assert_int_equal(st.used_bytes, 0);
  assert_int_equal(st.n_allocations, 0);
  assert_int_equal(st.n_free_ranges, 1);
  assert_int_equal(st.largest_free_bytes, 16 * 256);
  assert_int_equal(sgm_vblock_free(vb, off[0]), SGM_ERR_INVALID);
  assert_int_equal(sgm_vblock_alloc(vb, 16 * 256, 0, &x), SGM_OK);
  assert_int_equal(x, 4096);
  sgm_vblock_destroy(vb);
}

/* Invariant: an allocation aligned above the granule gets an aligned offset;
 * the start of the padded piece behind it was never handed out and cannot be
 * freed; freeing the aligned offset returns the padding too. */
static void test_alignment_above_granule(void **state) {
  (void)state;
  sgm_vblock *vb;
  assert_int_equal(sgm_vblock_create(1, 1024, 1, &vb), SGM_OK);
  uint64_t at;
  assert_int_equal(sgm_vblock_alloc(vb, 8, 64, &at), SGM_OK);
  assert_int_equal(at % 64, 0);
  assert_true(at >= 1 && at + 8 <= 1025);
  assert_int_equal(sgm_vblock_free(vb, 1), SGM_ERR_INVALID); /* the padded piece's start */
  sgm_vblock_stats st;
  sgm_vblock_get_stats(vb, &st);
  assert_int_equal(st.n_allocations, 1);
  assert_true(st.used_bytes >= 8 && st.used_bytes <= 8 + 63);
  assert_int_equal(sgm_vblock_free(vb, at), SGM_OK);
  sgm_vblock_get_stats(vb, &st);
  assert_int_equal(st.n_allocations, 0);
  assert_int_equal(st.used_bytes, 0);
  assert_int_equal(st.largest_free_bytes, 1024);
  /* A size plus padding past 2^64 is refused, not wrapped. */
  assert_int_equal(sgm_vblock_alloc(vb, UINT64_MAX - 1, UINT64_C(1) << 63, &at), SGM_ERR_NOMEM);
  assert_int_equal(at, 0);
  sgm_vblock_destroy(vb);
}

typedef struct live {
  uint64_t offset; /* what alloc returned */
  uint64_t size;   /* what was asked */
} live;

static int live_cmp(const void *a, const void *b) {
  const live *x = a, *y = b;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Invariant (seeded random run, model-checked every 64 steps): every live
 * allocation lies inside the range, is aligned as asked, overlaps no other;
 * the count matches; used_bytes is at least the sizes asked; after freeing
 * everything the range is one free fragment again. */
static void test_random_against_model(void **state) {
  (void)state;
  sgm_test_rng r;
  sgm_test_rng_init(&r, sgm_test_seed("vblock.random", 20261201));
  const uint64_t base = UINT64_C(1) << 40, size = UINT64_C(64) << 20;
  sgm_vblock *vb;
  assert_int_equal(sgm_vblock_create(base, size, 16, &vb), SGM_OK);
  enum { CAP = 4096 };
  live *l = malloc(CAP * sizeof *l), *sorted = malloc(CAP * sizeof *l);
  size_t n = 0;
  for (int step = 0; step < 20000; step++) {
    if (n < CAP && (n == 0 || sgm_test_rng_range(&r, 0, 99) < 55)) {
      uint64_t sz = sgm_test_rng_log_range(&r, 1, 256 << 10);
      uint64_t al = UINT64_C(1) << sgm_test_rng_range(&r, 0, 16);
      uint64_t off;
      sgm_status rc = sgm_vblock_alloc(vb, sz, al, &off);
      if (rc == SGM_OK) {
        assert_int_equal(off % (al > 16 ? al : 16), 0);
        assert_true(off >= base && off + sz <= base + size);
        l[n++] = (live){off, sz};
      } else {
        assert_int_equal(rc, SGM_ERR_NOMEM);
      }
    } else {
      size_t k = (size_t)sgm_test_rng_range(&r, 0, n - 1);
      assert_int_equal(sgm_vblock_free(vb, l[k].offset), SGM_OK);
      l[k] = l[--n];
    }
    if (step % 64 == 0) {
      memcpy(sorted, l, n * sizeof *l);
      qsort(sorted, n, sizeof *sorted, live_cmp);
      uint64_t asked = 0;
      for (size_t i = 0; i < n; i++) {
        asked += sorted[i].size;
        if (i) assert_true(sorted[i - 1].offset + sorted[i - 1].size <= sorted[i].offset);
      }
      sgm_vblock_stats st;
      sgm_vblock_get_stats(vb, &st);
      assert_int_equal(st.n_allocations, n);
      assert_true(st.used_bytes >= asked && st.used_bytes <= size);
    }
  }
  while (n) assert_int_equal(sgm_vblock_free(vb, l[--n].offset), SGM_OK);
  sgm_vblock_stats st;
  sgm_vblock_get_stats(vb, &st);
  assert_int_equal(st.used_bytes, 0);
  assert_int_equal(st.n_free_ranges, 1);
  assert_int_equal(st.largest_free_bytes, size);
  free(l);
  free(sorted);
  sgm_vblock_destroy(vb);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_create_contract),
      cmocka_unit_test(test_fill_and_reuse),
      cmocka_unit_test(test_alignment_above_granule),
      cmocka_unit_test(test_random_against_model),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
