/*
 * test_suballoc.c — the offset-based sub-allocator (lib/suballoc.c).
 *
 * Every test states the invariant it checks. The random tests compare the
 * allocator with a shadow model (the list of live blocks and the ranges) and
 * print their seed (SGM_TEST_SEED replays a failure).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test_util.h"

/* ------------------------------------------------------------------------ */
/* Shadow model. */

#define MAX_RANGES 8
/* Free blocks under this many granules sit in one-size LIFO bins: among
 * equal sizes the most recently freed wins; from here up, the lowest offset
 * (lib/suballoc.c, SUBALLOC_N_EXACT_BINS). */
#define EXACT_BIN_GRANULES 512

typedef struct shadow_block {
  uint64_t off;            /* bytes: offset the allocator returned */
  uint64_t size;           /* bytes: rounded size it returned */
  sgm_suballoc_node *node; /* the node it returned with the block (live blocks) */
} shadow_block;

typedef struct shadow {
  shadow_block *live;               /* live blocks, unordered */
  size_t n_live;                    /* entries in live */
  size_t cap;                       /* entries allocated in live */
  shadow_block ranges[MAX_RANGES];  /* the ranges added (off, size) */
  size_t n_ranges;                  /* entries in ranges */
  uint64_t used;                    /* bytes: sum of live sizes */
} shadow;

static void shadow_add(shadow *m, uint64_t off, uint64_t size, sgm_suballoc_node *node) {
  if (m->n_live == m->cap) {
    m->cap = m->cap ? m->cap * 2 : 256;
    m->live = realloc(m->live, m->cap * sizeof *m->live);
    assert_non_null(m->live);
  }
  m->live[m->n_live++] = (shadow_block){off, size, node};
  m->used += size;
}

static shadow_block shadow_take(shadow *m, size_t i) {
  shadow_block b = m->live[i];
  m->live[i] = m->live[--m->n_live];
  m->used -= b.size;
  return b;
}

static int cmp_off(const void *a, const void *b) {
  const shadow_block *x = a, *y = b;
  return x->off < y->off ? -1 : x->off > y->off;
}

/* The free gaps the model implies, in address order; returns their count. */
static size_t shadow_gaps(const shadow *m, shadow_block *gaps, size_t max_gaps,
                          shadow_block *range_of_gap) {
  shadow_block *s = malloc((m->n_live + 1) * sizeof *s);
  assert_non_null(s);
  if (m->n_live) memcpy(s, m->live, m->n_live * sizeof *s);
  qsort(s, m->n_live, sizeof *s, cmp_off);
  shadow_block r[MAX_RANGES];
  memcpy(r, m->ranges, m->n_ranges * sizeof *r);
  qsort(r, m->n_ranges, sizeof *r, cmp_off);
  size_t n = 0, j = 0;
  for (size_t i = 0; i < m->n_ranges; i++) {
    uint64_t pos = r[i].off, end = r[i].off + r[i].size;
    for (; j < m->n_live && s[j].off < end; j++) {
      if (s[j].off > pos) {
        assert_true(n < max_gaps);
        range_of_gap[n] = r[i];
        gaps[n++] = (shadow_block){pos, s[j].off - pos, NULL};
      }
      pos = s[j].off + s[j].size;
    }
    if (pos < end) {
      assert_true(n < max_gaps);
      range_of_gap[n] = r[i];
      gaps[n++] = (shadow_block){pos, end - pos, NULL};
    }
  }
  free(s);
  return n;
}

/* Invariant: a new block [off, off+size) is aligned, lies inside one range
 * and overlaps no live block of the model. */
static void assert_block_fits_model(const shadow *m, uint64_t align, uint64_t off, uint64_t size) {
  assert_int_equal(off % align, 0);
  assert_int_equal(size % align, 0);
  assert_true(size > 0);
  bool inside = false;
  for (size_t i = 0; i < m->n_ranges; i++)
    if (off >= m->ranges[i].off && off + size <= m->ranges[i].off + m->ranges[i].size) inside = true;
  assert_true(inside);
  for (size_t i = 0; i < m->n_live; i++)
    assert_true(off + size <= m->live[i].off || m->live[i].off + m->live[i].size <= off);
}

/* Invariant: the allocator's stats equal the model's. */
static void assert_stats_match(const sgm_suballoc *sa, const shadow *m) {
  sgm_suballoc_stats st;
  sgm__suballoc_stats(sa, &st);
  uint64_t cap = 0;
  for (size_t i = 0; i < m->n_ranges; i++) cap += m->ranges[i].size;
  assert_int_equal(st.capacity_bytes, cap);
  assert_int_equal(st.used_bytes, m->used);
  assert_int_equal(st.n_live, m->n_live);
  assert_int_equal(st.n_ranges, m->n_ranges);
  assert_true(st.largest_free_bytes <= cap - m->used);
}

static void assert_check(const sgm_suballoc *sa) {
  if (!sgm__suballoc_check(sa)) fail_msg("sgm__suballoc_check: %s", sgm_last_error());
}

static sgm_suballoc *new_sa(uint64_t align) {
  sgm_suballoc *sa = NULL;
  assert_int_equal(sgm__suballoc_create(align, &sa), SGM_OK);
  assert_non_null(sa);
  return sa;
}

/* ------------------------------------------------------------------------ */

/* Invariant: the alignment must be a power of two; *out is NULL on failure. */
static void test_create_rejects_bad_alignment(void **state) {
  (void)state;
  const uint64_t bad[] = {0, 3, 6, 100, UINT64_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    sgm_suballoc *sa = (sgm_suballoc *)&bad;
    assert_int_equal(sgm__suballoc_create(bad[i], &sa), SGM_ERR_INVALID);
    assert_null(sa);
    assert_true(strlen(sgm_last_error()) > 0);
  }
  sgm_suballoc *sa = new_sa(1);
  assert_check(sa);
  sgm__suballoc_destroy(sa);
  sgm__suballoc_destroy(NULL);
}

/* Invariant: add_range refuses empty, unaligned, wrapping and overlapping
 * ranges with SGM_ERR_INVALID and changes nothing. */
static void test_add_range_rejects_bad_ranges(void **state) {
  (void)state;
  sgm_suballoc *sa = new_sa(256);
  assert_int_equal(sgm__suballoc_add_range(sa, 4096, 4096), SGM_OK);
  sgm_suballoc_stats before, after;
  sgm__suballoc_stats(sa, &before);
  const uint64_t bad[][2] = {{0, 0},        {100, 256},       {0, 100},
                             {3840, 512},   {4096, 256},      {7936, 1024},
                             {0, 1 << 20},  {UINT64_MAX - 255, 512}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    assert_int_equal(sgm__suballoc_add_range(sa, bad[i][0], bad[i][1]), SGM_ERR_INVALID);
    assert_true(strlen(sgm_last_error()) > 0);
  }
  sgm__suballoc_stats(sa, &after);
  assert_memory_equal(&before, &after, sizeof before);
  /* Touching ranges on either side are fine. */
  assert_int_equal(sgm__suballoc_add_range(sa, 0, 4096), SGM_OK);
  assert_int_equal(sgm__suballoc_add_range(sa, 8192, 256), SGM_OK);
  assert_check(sa);
  sgm__suballoc_stats(sa, &after);
  assert_int_equal(after.n_ranges, 3);
  assert_int_equal(after.capacity_bytes, 8192 + 256);
  assert_int_equal(after.n_free_blocks, 3);
  sgm__suballoc_destroy(sa);
}

/* Invariant: sizes round up to the alignment (0 to one granule), every
 * offset is a multiple of it, and block_size reports the rounded size. */
static void test_rounding_and_alignment(void **state) {
  (void)state;
  const uint64_t aligns[] = {1, 8, 256, 65536};
  for (size_t k = 0; k < 4; k++) {
    uint64_t a = aligns[k];
    sgm_suballoc *sa = new_sa(a);
    assert_int_equal(sgm__suballoc_add_range(sa, 16 * a, 4096 * a), SGM_OK);
    const uint64_t sizes[] = {0, 1, a - 1 ? a - 1 : 1, a, a + 1, 3 * a + 1, 100 * a - 1};
    uint64_t used = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
      uint64_t off = 1, got = 1;
      assert_true(sgm__suballoc_try_alloc(sa, sizes[i], &off, &got));
      uint64_t want = sizes[i] ? sgm__align_up(sizes[i], a) : a;
      assert_int_equal(got, want);
      assert_int_equal(off % a, 0);
      assert_int_equal(sgm__suballoc_block_size(sa, off), want);
      used += want;
    }
    sgm_suballoc_stats st;
    sgm__suballoc_stats(sa, &st);
    assert_int_equal(st.used_bytes, used);
    /* A size that overflows when rounded fits nowhere. */
    uint64_t off = 1, got = 1;
    if (a > 1) assert_false(sgm__suballoc_try_alloc(sa, UINT64_MAX, &off, &got));
    assert_false(sgm__suballoc_try_alloc(sa, UINT64_MAX - 2 * a, &off, &got));
    assert_int_equal(off, 0);
    assert_int_equal(got, 0);
    assert_check(sa);
    sgm__suballoc_destroy(sa);
  }
}

/* Free a model block: by offset or by node (an indexed allocator takes
 * both, the caller alternates); an unindexed one knows no offset. */
static void free_model_block(sgm_suballoc *sa, bool indexed, bool by_node, shadow_block b) {
  if (indexed) assert_int_equal(sgm__suballoc_block_size(sa, b.off), b.size);
  uint64_t sz = 0;
  if (by_node || !indexed) assert_int_equal(sgm__suballoc_free_node(sa, b.node, &sz), SGM_OK);
  else assert_int_equal(sgm__suballoc_free(sa, b.off, &sz), SGM_OK);
  assert_int_equal(sz, b.size);
  assert_int_equal(sgm__suballoc_block_size(sa, b.off), 0);
}

/* One random run: ranges with gaps and touching pairs, allocs and frees in
 * phases that fill and drain, checked against the model; indexed false runs
 * the allocator without its offset table (frees by node). */
static void random_run(uint64_t seed, uint64_t align, int n_ops, bool indexed) {
  sgm_test_rng rng;
  sgm_test_rng_init(&rng, seed);
  sgm_suballoc *sa = NULL;
  if (indexed) sa = new_sa(align);
  else assert_int_equal(sgm__suballoc_create_unindexed(align, &sa), SGM_OK);
  shadow m = {0};
  /* Layout unit g = 16 granules: sizes up to 400g = 6400 granules mix the
   * one-size list bins (< 512 granules) with the treap bins above. */
  uint64_t g = 16 * align;
  const uint64_t layout[][2] = {{0, 2048}, {2048, 1024}, {5000, 3000}, {8000, 1}, {9000, 700}};
  for (size_t i = 0; i < sizeof layout / sizeof layout[0]; i++) {
    uint64_t off = layout[i][0] * g, size = layout[i][1] * g;
    assert_int_equal(sgm__suballoc_add_range(sa, off, size), SGM_OK);
    m.ranges[m.n_ranges++] = (shadow_block){off, size, NULL};
  }
  shadow_block *gaps = malloc(4096 * sizeof *gaps), *gap_range = malloc(4096 * sizeof *gap_range);
  assert_non_null(gaps);
  assert_non_null(gap_range);
  for (int op = 0; op < n_ops; op++) {
    /* Phases of 2000 ops alternate between mostly-alloc and mostly-free. */
    uint64_t p_alloc = (op / 2000) % 2 ? 35 : 70;
    if (m.n_live == 0 || sgm_test_rng_range(&rng, 0, 99) < p_alloc) {
      uint64_t size = sgm_test_rng_range(&rng, 0, 49) == 0
                          ? 0
                          : sgm_test_rng_log_range(&rng, 1, 400 * g);
      uint64_t want = size ? sgm__align_up(size, align) : align;
      size_t n_gaps = shadow_gaps(&m, gaps, 4096, gap_range);
      uint64_t off = 1, got = 1;
      sgm_suballoc_node *node = NULL;
      bool ok = sgm__suballoc_try_alloc_node(sa, size, &off, &got, &node);
      /* Invariant: best fit — the block comes from a smallest gap that fits
       * (among those, the lowest one for gaps of 512+ granules); it sits at
       * the gap's end nearer its range's end. */
      size_t best = n_gaps;
      for (size_t i = 0; i < n_gaps; i++)
        if (gaps[i].size >= want && (best == n_gaps || gaps[i].size < gaps[best].size)) best = i;
      if (!ok) {
        /* Invariant: try_alloc fails only when no gap fits. */
        assert_int_equal(best, n_gaps);
        assert_int_equal(off, 0);
        assert_int_equal(got, 0);
        assert_null(node);
        continue;
      }
      assert_non_null(node);
      assert_true(best < n_gaps);
      assert_int_equal(got, want);
      if (gaps[best].size / align < EXACT_BIN_GRANULES) {
        /* Equal-size gaps tie in a LIFO bin: take the one holding the block. */
        for (size_t i = 0; i < n_gaps; i++)
          if (gaps[i].size == gaps[best].size && gaps[i].off <= off &&
              off < gaps[i].off + gaps[i].size)
            best = i;
      }
      assert_true(gaps[best].off <= off && off + got <= gaps[best].off + gaps[best].size);
      uint64_t lo = gaps[best].off - gap_range[best].off;
      uint64_t hi = gap_range[best].off + gap_range[best].size - (gaps[best].off + gaps[best].size);
      assert_int_equal(off, lo <= hi ? gaps[best].off : gaps[best].off + gaps[best].size - want);
      assert_block_fits_model(&m, align, off, got);
      shadow_add(&m, off, got, node);
    } else {
      size_t i = (size_t)sgm_test_rng_range(&rng, 0, m.n_live - 1);
      free_model_block(sa, indexed, op % 2, shadow_take(&m, i));
    }
    if (op % 64 == 0) {
      assert_check(sa);
      assert_stats_match(sa, &m);
    }
  }
  assert_check(sa);
  assert_stats_match(sa, &m);
  /* Invariant: freeing everything (random order) leaves each range one free
   * block: n_free_blocks == n_ranges, largest == the largest range. */
  while (m.n_live)
    free_model_block(sa, indexed, m.n_live % 2,
                     shadow_take(&m, (size_t)sgm_test_rng_range(&rng, 0, m.n_live - 1)));
  assert_check(sa);
  sgm_suballoc_stats st;
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_free_blocks, m.n_ranges);
  assert_int_equal(st.largest_free_bytes, 3000 * g);
  assert_int_equal(st.used_bytes, 0);
  assert_int_equal(st.n_live, 0);
  for (size_t i = 0; i < m.n_ranges; i++) assert_true(sgm__suballoc_range_is_free(sa, m.ranges[i].off));
  free(gaps);
  free(gap_range);
  free(m.live);
  sgm__suballoc_destroy(sa);
}

/* Invariants (against the shadow model, for alignments 1, 256 and 4096):
 * live blocks never overlap; offsets and sizes are aligned; every block lies
 * inside one range; placement is best fit toward the nearer range end;
 * failure only when nothing fits; check() holds every 64 ops; stats match the
 * model; free-all coalesces each range back to one block. The same holds
 * with frees by node, and in an allocator without its offset table (the
 * tier pool's), whose placement is the same. */
static void test_random_ops_match_shadow_model(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("suballoc", 20240601);
  random_run(seed, 1, 20000, true);
  random_run(seed + 1, 256, 20000, true);
  random_run(seed + 2, 4096, 20000, true);
  random_run(seed + 3, 256, 20000, false);
}

/* The owner's end hook: answers from *arg, and records what it was asked. */
typedef struct end_hook_state {
  int answer;                      /* what the hook says */
  uint64_t low, high, size, calls; /* its last question, and how many */
} end_hook_state;

static int end_hook(void *arg, uint64_t low, uint64_t high, uint64_t size) {
  end_hook_state *h = arg;
  h->low = low;
  h->high = high;
  h->size = size;
  h->calls++;
  return h->answer;
}

/* Invariant: a split asks the owner's end hook with both candidate offsets
 * (the free block's two ends) and the size; < 0 cuts from the low end, > 0
 * from the high end, 0 keeps the default (nearer the range's end: low on a
 * tie); an exact fit asks nothing; check() holds throughout. */
static void test_end_hook_chooses_the_end(void **state) {
  (void)state;
  sgm_suballoc *sa = new_sa(256);
  end_hook_state h = {0};
  sgm__suballoc_set_end_hook(sa, end_hook, &h);
  assert_int_equal(sgm__suballoc_add_range(sa, 1 << 20, 1 << 20), SGM_OK);
  uint64_t off, got;
  h.answer = 1;
  assert_true(sgm__suballoc_try_alloc(sa, 4096, &off, &got));
  assert_int_equal(h.calls, 1);
  assert_int_equal(h.low, 1 << 20);
  assert_int_equal(h.high, (2 << 20) - 4096);
  assert_int_equal(h.size, 4096);
  assert_int_equal(off, (2 << 20) - 4096);
  h.answer = -1;
  assert_true(sgm__suballoc_try_alloc(sa, 8192, &off, &got));
  assert_int_equal(off, 1 << 20);
  /* Default: the free block [1 MiB + 8 KiB, 2 MiB - 4 KiB) is nearer the
   * high end of its range (4 KiB against 8 KiB away): cut there. */
  h.answer = 0;
  assert_true(sgm__suballoc_try_alloc(sa, 256, &off, &got));
  assert_int_equal(off, (2 << 20) - 4096 - 256);
  /* An exact fit: no split, no question. */
  uint64_t calls = h.calls, rest = (1 << 20) - 4096 - 8192 - 256;
  assert_true(sgm__suballoc_try_alloc(sa, rest, &off, &got));
  assert_int_equal(h.calls, calls);
  assert_int_equal(off, (1 << 20) + 8192);
  assert_check(sa);
  sgm__suballoc_destroy(sa);
}

/* Invariant: an allocator without an offset table refuses a free by offset
 * (SGM_ERR_INVALID, a message saying to free by node, nothing changed) and
 * knows no block size by offset; a node freed twice is refused and changes
 * nothing; check() holds with its table empty. */
static void test_unindexed_frees_by_node_only(void **state) {
  (void)state;
  sgm_suballoc *sa = NULL;
  assert_int_equal(sgm__suballoc_create_unindexed(256, &sa), SGM_OK);
  assert_int_equal(sgm__suballoc_add_range(sa, 1 << 20, 1 << 20), SGM_OK);
  uint64_t a, b, got, sz = 7;
  sgm_suballoc_node *na, *nb;
  assert_true(sgm__suballoc_try_alloc_node(sa, 1000, &a, &got, &na));
  assert_true(sgm__suballoc_try_alloc_node(sa, 5000, &b, &got, &nb));
  assert_int_equal(sgm__suballoc_free(sa, a, &sz), SGM_ERR_INVALID);
  assert_int_equal(sz, 0);
  assert_non_null(strstr(sgm_last_error(), "by its node"));
  assert_int_equal(sgm__suballoc_block_size(sa, a), 0);
  sgm_suballoc_stats st;
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_live, 2);
  assert_int_equal(st.used_bytes, 1024 + 5120);
  assert_check(sa);
  assert_int_equal(sgm__suballoc_free_node(sa, nb, &sz), SGM_OK);
  assert_int_equal(sz, 5120);
  assert_int_equal(sgm__suballoc_free_node(sa, nb, &sz), SGM_ERR_INVALID);
  assert_int_equal(sz, 0);
  assert_non_null(strstr(sgm_last_error(), "not live"));
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_live, 1);
  assert_int_equal(st.used_bytes, 1024);
  assert_check(sa);
  assert_int_equal(sgm__suballoc_free_node(sa, na, &sz), SGM_OK);
  assert_true(sgm__suballoc_range_is_free(sa, 1 << 20));
  assert_check(sa);
  sgm__suballoc_destroy(sa);
}

/* Invariant: freeing an offset that does not start a live block (double
 * free, the middle of a block, free space, outside every range) returns
 * SGM_ERR_INVALID with a message, *size_out 0, and changes nothing. */
static void test_invalid_free_changes_nothing(void **state) {
  (void)state;
  sgm_suballoc *sa = new_sa(256);
  assert_int_equal(sgm__suballoc_add_range(sa, 1 << 20, 1 << 20), SGM_OK);
  uint64_t a, b, c, got;
  assert_true(sgm__suballoc_try_alloc(sa, 1000, &a, &got));
  assert_true(sgm__suballoc_try_alloc(sa, 5000, &b, &got));
  assert_true(sgm__suballoc_try_alloc(sa, 256, &c, &got));
  uint64_t sz = 0;
  assert_int_equal(sgm__suballoc_free(sa, c, &sz), SGM_OK);
  sgm_suballoc_stats before, after;
  sgm__suballoc_stats(sa, &before);
  const uint64_t bad[] = {c, b + 256, b + 1, a + 1, 0, 1 << 19, (1 << 21) + 256, UINT64_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    sgm__error_clear();
    sz = 12345;
    assert_int_equal(sgm__suballoc_free(sa, bad[i], &sz), SGM_ERR_INVALID);
    assert_int_equal(sz, 0);
    assert_non_null(strstr(sgm_last_error(), "no live block"));
    sgm__suballoc_stats(sa, &after);
    assert_memory_equal(&before, &after, sizeof before);
    assert_check(sa);
  }
  /* The real blocks are untouched and still free cleanly, once. */
  assert_int_equal(sgm__suballoc_free(sa, a, &sz), SGM_OK);
  assert_int_equal(sz, 1024);
  assert_int_equal(sgm__suballoc_free(sa, a, &sz), SGM_ERR_INVALID);
  assert_int_equal(sgm__suballoc_free(sa, b, &sz), SGM_OK);
  assert_int_equal(sz, 5120);
  sgm__suballoc_stats(sa, &after);
  assert_int_equal(after.n_free_blocks, 1);
  assert_int_equal(after.largest_free_bytes, 1 << 20);
  assert_check(sa);
  sgm__suballoc_destroy(sa);
}

/* Invariant: try_remove_range fails (and changes nothing) while a block is
 * live in the range or when no range starts at the offset, succeeds once the
 * range is free, and later allocations never land in a removed range. */
static void test_remove_range_only_when_free(void **state) {
  (void)state;
  sgm_suballoc *sa = new_sa(256);
  const uint64_t r1 = 0, r2 = 1 << 20, r3 = 3 << 20, mib = 1 << 20;
  assert_int_equal(sgm__suballoc_add_range(sa, r1, mib), SGM_OK);
  assert_int_equal(sgm__suballoc_add_range(sa, r2, mib), SGM_OK);
  assert_int_equal(sgm__suballoc_add_range(sa, r3, mib), SGM_OK);
  uint64_t x, y, got;
  /* Fill r1 exactly, so the next block goes to r2. */
  assert_true(sgm__suballoc_try_alloc(sa, mib, &x, &got));
  assert_true(sgm__suballoc_try_alloc(sa, 4096, &y, &got));
  uint64_t in_r1 = x < r2 ? x : y, in_r2 = x < r2 ? y : x;
  assert_true(in_r1 == r1);
  assert_true(in_r2 >= r2 && in_r2 < r2 + mib);
  assert_false(sgm__suballoc_range_is_free(sa, r1));
  assert_false(sgm__suballoc_range_is_free(sa, r2));
  assert_true(sgm__suballoc_range_is_free(sa, r3));
  assert_false(sgm__suballoc_range_is_free(sa, r2 + 256)); /* not a range start */
  assert_false(sgm__suballoc_try_remove_range(sa, r1));
  assert_false(sgm__suballoc_try_remove_range(sa, r2));
  assert_false(sgm__suballoc_try_remove_range(sa, r2 + 256));
  assert_false(sgm__suballoc_try_remove_range(sa, 2 << 20));
  sgm_suballoc_stats st;
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_ranges, 3);
  assert_int_equal(st.capacity_bytes, 3 * mib);
  assert_check(sa);

  uint64_t sz;
  assert_int_equal(sgm__suballoc_free(sa, in_r2, &sz), SGM_OK);
  assert_true(sgm__suballoc_range_is_free(sa, r2));
  assert_true(sgm__suballoc_try_remove_range(sa, r2));
  assert_true(sgm__suballoc_try_remove_range(sa, r3));
  assert_false(sgm__suballoc_try_remove_range(sa, r3)); /* already gone */
  assert_false(sgm__suballoc_range_is_free(sa, r3));
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_ranges, 1);
  assert_int_equal(st.capacity_bytes, mib);
  assert_int_equal(st.n_free_blocks, 0);
  assert_check(sa);
  /* r1 is full and the others are gone: nothing fits anywhere. */
  uint64_t off = 1;
  assert_false(sgm__suballoc_try_alloc(sa, 256, &off, &got));
  assert_int_equal(sgm__suballoc_free(sa, in_r1, &sz), SGM_OK);
  assert_true(sgm__suballoc_try_remove_range(sa, r1));
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_ranges, 0);
  assert_int_equal(st.capacity_bytes, 0);
  assert_false(sgm__suballoc_try_alloc(sa, 256, &off, &got));
  /* A removed range's space may be added again. */
  assert_int_equal(sgm__suballoc_add_range(sa, r2, mib), SGM_OK);
  assert_true(sgm__suballoc_try_alloc(sa, mib, &off, &got));
  assert_int_equal(off, r2);
  assert_check(sa);
  sgm__suballoc_destroy(sa);
}

/* Invariant: blocks never span or coalesce across two ranges, even ranges
 * that touch: a request bigger than each but smaller than both fails, and
 * freeing everything leaves one free block per range. */
static void test_adjacent_ranges_never_joined(void **state) {
  (void)state;
  sgm_suballoc *sa = new_sa(256);
  const uint64_t kib64 = 64 << 10;
  assert_int_equal(sgm__suballoc_add_range(sa, kib64, kib64), SGM_OK);
  assert_int_equal(sgm__suballoc_add_range(sa, 0, kib64), SGM_OK);
  assert_int_equal(sgm__suballoc_add_range(sa, 2 * kib64, kib64), SGM_OK);
  uint64_t off = 1, got = 1;
  assert_false(sgm__suballoc_try_alloc(sa, kib64 + 256, &off, &got));
  /* Fill all three with 256-byte blocks, then free them in a scattered order. */
  uint64_t *offs = malloc(768 * sizeof *offs);
  assert_non_null(offs);
  for (int i = 0; i < 768; i++) {
    assert_true(sgm__suballoc_try_alloc(sa, 256, &offs[i], &got));
    /* A block ends inside the range it starts in. */
    assert_int_equal(offs[i] / kib64, (offs[i] + got - 1) / kib64);
  }
  assert_false(sgm__suballoc_try_alloc(sa, 1, &off, &got));
  for (int i = 0; i < 768; i++) {
    uint64_t sz;
    assert_int_equal(sgm__suballoc_free(sa, offs[(i * 7) % 768], &sz), SGM_OK);
  }
  assert_check(sa);
  sgm_suballoc_stats st;
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_free_blocks, 3);
  assert_int_equal(st.largest_free_bytes, kib64);
  assert_false(sgm__suballoc_try_alloc(sa, kib64 + 256, &off, &got));
  for (int i = 0; i < 3; i++) assert_true(sgm__suballoc_try_alloc(sa, kib64, &offs[i], &got));
  assert_false(sgm__suballoc_try_alloc(sa, 256, &off, &got));
  free(offs);
  assert_check(sa);
  sgm__suballoc_destroy(sa);
}

/* Invariant: when nothing fits try_alloc returns false, writes 0 to both
 * outputs and changes nothing; a fitting request still succeeds after. */
static void test_exhaustion_returns_false(void **state) {
  (void)state;
  sgm_suballoc *sa = new_sa(256);
  uint64_t off = 1, got = 1;
  assert_false(sgm__suballoc_try_alloc(sa, 256, &off, &got)); /* no range at all */
  assert_int_equal(sgm__suballoc_add_range(sa, 0, 16 * 256), SGM_OK);
  uint64_t offs[16];
  for (int i = 0; i < 8; i++) assert_true(sgm__suballoc_try_alloc(sa, 512, &offs[i], &got));
  sgm_suballoc_stats before, after;
  sgm__suballoc_stats(sa, &before);
  assert_int_equal(before.used_bytes, 16 * 256);
  assert_int_equal(before.largest_free_bytes, 0);
  off = got = 1;
  assert_false(sgm__suballoc_try_alloc(sa, 1, &off, &got));
  assert_int_equal(off, 0);
  assert_int_equal(got, 0);
  sgm__suballoc_stats(sa, &after);
  assert_memory_equal(&before, &after, sizeof before);
  /* Two non-adjacent 512-byte holes: 1024 does not fit, 512 does. */
  uint64_t sz;
  assert_int_equal(sgm__suballoc_free(sa, offs[2], &sz), SGM_OK);
  assert_int_equal(sgm__suballoc_free(sa, offs[5], &sz), SGM_OK);
  assert_false(sgm__suballoc_try_alloc(sa, 1024, &off, &got));
  assert_true(sgm__suballoc_try_alloc(sa, 512, &off, &got));
  assert_check(sa);
  sgm__suballoc_destroy(sa);
}

/* Invariant: the placement rule — the smallest free block that fits wins;
 * among equal sizes the lowest offset (512+ granules) or the most recently
 * freed (smaller); the block goes to the end of the free block nearer an end
 * of the range (the low end on a tie). */
static void test_best_fit_placement(void **state) {
  (void)state;
  const uint64_t u = 1024; /* 1024 granules at alignment 1: treap bins */
  sgm_suballoc *sa = new_sa(1);
  assert_int_equal(sgm__suballoc_add_range(sa, 0, 100 * u), SGM_OK);
  uint64_t off, got, sz;
  /* An empty range is a tie between its ends: the low end. */
  assert_true(sgm__suballoc_try_alloc(sa, u, &off, &got));
  assert_int_equal(off, 0);
  /* The rest, [1u, 100u), touches the high end: carved from its top. */
  assert_true(sgm__suballoc_try_alloc(sa, u, &off, &got));
  assert_int_equal(off, 99 * u);
  /* Fill, then punch holes: [20,25) 5u, [30,33) 3u, [38,41) 3u, [60,100) 40u. */
  for (int i = 2; i < 100; i++) assert_true(sgm__suballoc_try_alloc(sa, u, &off, &got));
  assert_false(sgm__suballoc_try_alloc(sa, 1, &off, &got));
  const int holes[][2] = {{20, 25}, {30, 33}, {38, 41}, {60, 100}};
  for (int h = 3; h >= 0; h--) /* freed high to low: LIFO order would pick high */
    for (int o = holes[h][0]; o < holes[h][1]; o++)
      assert_int_equal(sgm__suballoc_free(sa, (uint64_t)o * u, &sz), SGM_OK);
  sgm_suballoc_stats st;
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_free_blocks, 4);
  assert_int_equal(st.largest_free_bytes, 40 * u);
  /* 3u: the two exact 3u holes tie; the lower one wins. */
  assert_true(sgm__suballoc_try_alloc(sa, 3 * u, &off, &got));
  assert_int_equal(off, 30 * u);
  assert_int_equal(sgm__suballoc_free(sa, off, &sz), SGM_OK);
  /* 2u: the smallest hole that fits is 3u (lowest: [30,33)), not the 5u one
   * below it; 30u below vs 67u above: its bottom. */
  assert_true(sgm__suballoc_try_alloc(sa, 2 * u, &off, &got));
  assert_int_equal(off, 30 * u);
  /* 4u: only [20,25) and [60,100) fit; the smaller wins; bottom. */
  assert_true(sgm__suballoc_try_alloc(sa, 4 * u, &off, &got));
  assert_int_equal(off, 20 * u);
  /* 30u: only [60,100), which touches the range's high end: its top. */
  assert_true(sgm__suballoc_try_alloc(sa, 30 * u, &off, &got));
  assert_int_equal(off, 70 * u);
  /* 1u: holes [24,25) and [32,33) are exact; the lower wins. */
  assert_true(sgm__suballoc_try_alloc(sa, u, &off, &got));
  assert_int_equal(off, 24 * u);
  assert_check(sa);
  sgm__suballoc_destroy(sa);

  /* Small sizes: two 8-byte holes, the higher freed last, then the lower:
   * the most recently freed wins each time. */
  sa = new_sa(1);
  assert_int_equal(sgm__suballoc_add_range(sa, 0, 64), SGM_OK);
  uint64_t b[8];
  for (int i = 0; i < 8; i++) assert_true(sgm__suballoc_try_alloc(sa, 8, &b[i], &got));
  uint64_t lo = 16, hi = 40;
  assert_int_equal(sgm__suballoc_free(sa, hi, &sz), SGM_OK);
  assert_int_equal(sgm__suballoc_free(sa, lo, &sz), SGM_OK);
  assert_true(sgm__suballoc_try_alloc(sa, 8, &off, &got));
  assert_int_equal(off, lo);
  assert_int_equal(sgm__suballoc_free(sa, lo, &sz), SGM_OK);
  assert_int_equal(sgm__suballoc_free(sa, 8, &sz), SGM_OK); /* [8, 24) coalesced, freed last */
  assert_true(sgm__suballoc_try_alloc(sa, 8, &off, &got));
  assert_int_equal(off, hi); /* the exact 8-byte hole beats the fresher 16-byte one */
  assert_check(sa);
  sgm__suballoc_destroy(sa);
}

/* Invariant: sizes at the top of the 64-bit offset space (bins in every
 * bitmap summary word) are found, best fit across them, and coalesce. */
static void test_huge_sizes(void **state) {
  (void)state;
  sgm_suballoc *sa = new_sa(1);
  const uint64_t base = UINT64_C(1) << 63;
  assert_int_equal(sgm__suballoc_add_range(sa, base, UINT64_MAX - base + 1 - 4096), SGM_OK);
  assert_int_equal(sgm__suballoc_add_range(sa, 4096, UINT64_C(1) << 40), SGM_OK);
  uint64_t off, got, sz;
  /* 2^41 only fits the huge range; 2^39 best-fits the 2^40 one. */
  assert_true(sgm__suballoc_try_alloc(sa, UINT64_C(1) << 41, &off, &got));
  assert_true(off >= base);
  uint64_t big = off;
  assert_true(sgm__suballoc_try_alloc(sa, UINT64_C(1) << 39, &off, &got));
  assert_true(off >= 4096 && off < base);
  uint64_t mid = off;
  assert_true(sgm__suballoc_try_alloc(sa, UINT64_C(1) << 62, &off, &got));
  assert_true(off >= base);
  uint64_t top = off;
  assert_true(sgm__suballoc_try_alloc(sa, 5, &off, &got));
  assert_true(off < base); /* the 2^39 remainder is the smallest block that fits */
  uint64_t tiny = off;
  assert_false(sgm__suballoc_try_alloc(sa, UINT64_C(1) << 63, &off, &got));
  assert_check(sa);
  const uint64_t all[] = {big, mid, top, tiny};
  for (int i = 0; i < 4; i++) assert_int_equal(sgm__suballoc_free(sa, all[i], &sz), SGM_OK);
  sgm_suballoc_stats st;
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_free_blocks, 2);
  assert_int_equal(st.largest_free_bytes, UINT64_MAX - base + 1 - 4096);
  assert_check(sa);
  sgm__suballoc_destroy(sa);
}

/* Invariant: when a metadata malloc fails, add_range returns SGM_ERR_NOMEM
 * and try_alloc false, both with a message and nothing changed; the same
 * calls succeed once memory is back; no leak (ASan). Walks every failure
 * point N of a fixed script. */
static void test_metadata_nomem_is_clean(void **state) {
  (void)state;
  int n_failures_seen = 0;
  for (int64_t n = 0; n < 64; n++) {
    sgm_suballoc *sa = new_sa(256);
    sgm__suballoc_inject_nomem(sa, n);
    bool injected = false;
    uint64_t *offs = malloc(2000 * sizeof *offs);
    assert_non_null(offs);
    size_t n_offs = 0;
    /* Script: 20 ranges (array growth), 1500 splits (slab refills, hash
     * growth), frees, more allocs. Each step that fails must be clean and
     * is retried with injection off. */
    for (int r = 0; r < 20; r++) {
      sgm_suballoc_stats before, after;
      sgm__suballoc_stats(sa, &before);
      int rc = sgm__suballoc_add_range(sa, (uint64_t)r << 24, 1 << 20);
      if (rc != SGM_OK) {
        assert_int_equal(rc, SGM_ERR_NOMEM);
        assert_non_null(strstr(sgm_last_error(), "out of host memory"));
        sgm__suballoc_stats(sa, &after);
        assert_memory_equal(&before, &after, sizeof before);
        assert_check(sa);
        injected = true;
        assert_int_equal(sgm__suballoc_add_range(sa, (uint64_t)r << 24, 1 << 20), SGM_OK);
      }
    }
    for (int i = 0; i < 1500; i++) {
      sgm_suballoc_stats before, after;
      sgm__suballoc_stats(sa, &before);
      uint64_t off = 1, got = 1;
      if (!sgm__suballoc_try_alloc(sa, 4096, &off, &got)) {
        assert_int_equal(off, 0);
        assert_int_equal(got, 0);
        assert_non_null(strstr(sgm_last_error(), "out of host memory"));
        sgm__suballoc_stats(sa, &after);
        assert_memory_equal(&before, &after, sizeof before);
        assert_check(sa);
        injected = true;
        assert_true(sgm__suballoc_try_alloc(sa, 4096, &off, &got));
      }
      offs[n_offs++] = off;
    }
    assert_check(sa);
    /* Hash growth may have failed silently: lookups must still work. */
    for (size_t i = 0; i < n_offs; i += 2) {
      uint64_t sz;
      assert_int_equal(sgm__suballoc_free(sa, offs[i], &sz), SGM_OK);
      assert_int_equal(sz, 4096);
    }
    for (size_t i = 1; i < n_offs; i += 2) assert_int_equal(sgm__suballoc_block_size(sa, offs[i]), 4096);
    assert_check(sa);
    n_failures_seen += injected;
    free(offs);
    sgm__suballoc_destroy(sa);
  }
  /* The script passes through more than a few failure points. */
  assert_true(n_failures_seen >= 8);
}

/* Invariant: at scale (20,000 live blocks, many slabs, several hash
 * growths), lookups, stats and check() stay right, and freeing in random
 * order restores one free block. */
static void test_many_blocks(void **state) {
  (void)state;
  sgm_test_rng rng;
  sgm_test_rng_init(&rng, sgm_test_seed("suballoc_many", 7));
  sgm_suballoc *sa = new_sa(256);
  assert_int_equal(sgm__suballoc_add_range(sa, UINT64_C(1) << 40, UINT64_C(1) << 32), SGM_OK);
  enum { N = 20000 };
  shadow m = {0};
  m.ranges[0] = (shadow_block){UINT64_C(1) << 40, UINT64_C(1) << 32, NULL};
  m.n_ranges = 1;
  for (int i = 0; i < N; i++) {
    uint64_t off, got;
    assert_true(sgm__suballoc_try_alloc(sa, sgm_test_rng_log_range(&rng, 1, 1 << 18), &off, &got));
    shadow_add(&m, off, got, NULL);
  }
  assert_check(sa);
  assert_stats_match(sa, &m);
  /* No two blocks overlap: sorted, each ends before the next starts. */
  shadow_block *s = malloc(N * sizeof *s);
  assert_non_null(s);
  memcpy(s, m.live, N * sizeof *s);
  qsort(s, N, sizeof *s, cmp_off);
  for (int i = 1; i < N; i++) assert_true(s[i - 1].off + s[i - 1].size <= s[i].off);
  free(s);
  while (m.n_live) {
    shadow_block b = shadow_take(&m, (size_t)sgm_test_rng_range(&rng, 0, m.n_live - 1));
    uint64_t sz;
    assert_int_equal(sgm__suballoc_free(sa, b.off, &sz), SGM_OK);
    assert_int_equal(sz, b.size);
    if (m.n_live % 4096 == 0) assert_check(sa);
  }
  sgm_suballoc_stats st;
  sgm__suballoc_stats(sa, &st);
  assert_int_equal(st.n_free_blocks, 1);
  assert_int_equal(st.largest_free_bytes, UINT64_C(1) << 32);
  assert_true(sgm__suballoc_try_remove_range(sa, UINT64_C(1) << 40));
  assert_check(sa);
  free(m.live);
  sgm__suballoc_destroy(sa);
}

int main(void) {
  sgm_test_clean_env();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_create_rejects_bad_alignment),
      cmocka_unit_test(test_add_range_rejects_bad_ranges),
      cmocka_unit_test(test_rounding_and_alignment),
      cmocka_unit_test(test_random_ops_match_shadow_model),
      cmocka_unit_test(test_invalid_free_changes_nothing),
      cmocka_unit_test(test_unindexed_frees_by_node_only),
      cmocka_unit_test(test_end_hook_chooses_the_end),
      cmocka_unit_test(test_remove_range_only_when_free),
      cmocka_unit_test(test_adjacent_ranges_never_joined),
      cmocka_unit_test(test_exhaustion_returns_false),
      cmocka_unit_test(test_best_fit_placement),
      cmocka_unit_test(test_huge_sizes),
      cmocka_unit_test(test_metadata_nomem_is_clean),
      cmocka_unit_test(test_many_blocks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
