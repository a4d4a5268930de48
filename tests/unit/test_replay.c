/*
 * test_replay.c — the core of sgm-replay (benchmarks/replay/): Belady's OPT,
 * with bypass ("opt") and without ("opt-admit"), against answers worked out
 * by hand and against exhaustive searches, no policy of sgm (admission
 * policies included) beating OPT on random traces (and sgm's LRU equal to a
 * reference LRU, which pins the driver's definition of a hit and its
 * capacity), the three trace readers on small samples and on malformed input,
 * and format detection.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "replay.h"
#include "test_util.h"

#define BLK UINT64_C(4096)

/* ---- helpers ---- */

/* A trace of equal-size accesses (refs[i] = dense block id; -1 - b frees b). */
static replay_trace make_trace(const int *refs, size_t n, uint64_t block_bytes) {
  replay_trace t = {0};
  uint32_t n_blocks = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t b = (uint32_t)(refs[i] < 0 ? -1 - refs[i] : refs[i]);
    if (b + 1 > n_blocks) n_blocks = b + 1;
  }
  t.ev = malloc((n ? n : 1) * sizeof *t.ev);
  t.size = malloc((n_blocks ? n_blocks : 1) * sizeof *t.size);
  assert_non_null(t.ev);
  assert_non_null(t.size);
  for (size_t i = 0; i < n; i++)
    t.ev[i] = refs[i] < 0 ? (uint32_t)(-1 - refs[i]) | REPLAY_EV_FREE : (uint32_t)refs[i];
  t.n_ev = t.cap_ev = n;
  for (uint32_t b = 0; b < n_blocks; b++) t.size[b] = block_bytes;
  t.n_blocks = t.cap_blocks = n_blocks;
  char err[REPLAY_ERR_MAX];
  if (replay_trace_finish(&t, err, sizeof err) != 0) fail_msg("make_trace: %s", err);
  return t;
}

/* OPT with bypass: what sgm-replay reports as "opt". */
static replay_result run_opt(const replay_trace *t, uint64_t capacity) {
  replay_result r;
  char err[REPLAY_ERR_MAX];
  if (replay_opt(t, capacity, &r, err, sizeof err) != 0) fail_msg("opt: %s", err);
  assert_string_equal(r.policy, "opt");
  return r;
}

/* OPT without bypass (every missed block enters): "opt-admit". */
static replay_result run_opt_admit(const replay_trace *t, uint64_t capacity) {
  replay_result r;
  char err[REPLAY_ERR_MAX];
  if (replay_opt_ex(t, capacity, REPLAY_OPT_ADMIT, &r, err, sizeof err) != 0) fail_msg("opt: %s", err);
  assert_string_equal(r.policy, "opt-admit");
  assert_int_equal(r.bypassed, 0);
  return r;
}

static replay_result run_sgm(const replay_trace *t, const char *policy, uint64_t capacity, bool cold) {
  replay_result r;
  char err[REPLAY_ERR_MAX];
  replay_sgm_params p = {.policy = policy, .vram_bytes = capacity, .cold = cold};
  if (replay_sgm(t, &p, &r, err, sizeof err) != 0) fail_msg("replay %s: %s", policy, err);
  return r;
}

/* Write text to a new temporary file; its path in path[64]. */
static void write_tmp(char *path, const char *text) {
  snprintf(path, 64, "/tmp/sgm_replay_XXXXXX");
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  size_t n = strlen(text);
  assert_int_equal(write(fd, text, n), (ssize_t)n);
  close(fd);
}

static replay_trace load_ok(const char *text, uint64_t block_bytes, replay_format want) {
  char path[64], err[REPLAY_ERR_MAX];
  write_tmp(path, text);
  replay_trace t;
  int rc = replay_trace_load(path, block_bytes, &t, err, sizeof err);
  unlink(path);
  if (rc != 0) fail_msg("load: %s", err);
  assert_int_equal(t.format, want);
  return t;
}

/* Load must fail, and the message must contain ":<line>:" and `word`. */
static void load_fails(const char *text, int line, const char *word) {
  char path[64], err[REPLAY_ERR_MAX] = "", at[32];
  write_tmp(path, text);
  replay_trace t;
  int rc = replay_trace_load(path, BLK, &t, err, sizeof err);
  unlink(path);
  if (rc == 0) fail_msg("load accepted malformed input:\n%s", text);
  assert_int_equal(t.n_ev, 0);
  assert_null(t.ev);
  snprintf(at, sizeof at, ":%d:", line);
  if (!strstr(err, at) || !strstr(err, path))
    fail_msg("error does not name %s line %d: %s", path, line, err);
  if (!strstr(err, word)) fail_msg("error does not say \"%s\": %s", word, err);
  printf("# rejected as expected: %s\n", err);
}

static void assert_events(const replay_trace *t, const uint32_t *want, size_t n) {
  assert_int_equal(t->n_ev, n);
  for (size_t i = 0; i < n; i++) {
    if (t->ev[i] != want[i])
      fail_msg("event %zu: got %s%u, want %s%u", i, t->ev[i] & REPLAY_EV_FREE ? "free " : "",
               (unsigned)REPLAY_EV_ID(t->ev[i]), want[i] & REPLAY_EV_FREE ? "free " : "",
               (unsigned)REPLAY_EV_ID(want[i]));
  }
}

#define F(b) ((uint32_t)(b) | REPLAY_EV_FREE)

/* ---- OPT by hand ---- */

/*
 * Trace a b c a d b a (a=0 b=1 c=2 d=3), capacity 2 blocks. Next uses: a@0→3,
 * b@1→5, c@2→never, a@3→6, d@4→never, b@5→never, a@6→never.
 *
 * opt-admit (every missed block enters):
 *   t0 a  miss            cache {a}
 *   t1 b  miss            cache {a b}
 *   t2 c  miss, full: a next 3, b next 5 → evict b        {a c}
 *   t3 a  HIT                                              {a c}
 *   t4 d  miss, full: a next 6, c never → evict c         {a d}
 *   t5 b  miss, full: a next 6, d never → evict d         {a b}   (b re-fetched)
 *   t6 a  HIT
 * 2 hits of 7, 3 evictions, 1 block promoted, 3 demoted.
 *
 * opt (with bypass: a missed block used no sooner than every cached one is
 * not cached):
 *   t0 a  miss            cache {a}
 *   t1 b  miss            cache {a b}
 *   t2 c  miss, full: c never ≥ a 3, b 5 → bypass         {a b}
 *   t3 a  HIT (a next 6)                                   {a b}
 *   t4 d  miss, full: d never ≥ a 6, b 5 → bypass         {a b}
 *   t5 b  HIT                                              {a b}
 *   t6 a  HIT
 * 3 hits of 7, 0 evictions, 2 bypassed, nothing promoted or demoted: keeping
 * b, which admit-always had to throw out for c, is what bypass buys.
 *
 * LRU for comparison: a b c(evict a) a(evict b) d(evict c) b(evict a) a(evict d):
 * 0 hits.
 */
static void test_opt_by_hand(void **state) {
  (void)state;
  const int refs[] = {0, 1, 2, 0, 3, 1, 0};
  replay_trace t = make_trace(refs, 7, BLK);
  replay_result r = run_opt_admit(&t, 2 * BLK);
  assert_int_equal(r.accesses, 7);
  assert_int_equal(r.hits, 2);
  assert_int_equal(r.evictions, 3);
  assert_int_equal(r.bytes_promoted, 1 * BLK);
  assert_int_equal(r.bytes_demoted, 3 * BLK);
  r = run_opt(&t, 2 * BLK);
  assert_int_equal(r.accesses, 7);
  assert_int_equal(r.hits, 3);
  assert_int_equal(r.evictions, 0);
  assert_int_equal(r.bypassed, 2);
  assert_int_equal(r.bytes_promoted, 0);
  assert_int_equal(r.bytes_demoted, 0);
  replay_result l = run_sgm(&t, "lru", 2 * BLK, false);
  assert_int_equal(l.accesses, 7);
  assert_int_equal(l.hits, 0);
  replay_trace_free(&t);
}

/*
 * The textbook reference string (Silberschatz, Operating System Concepts,
 * "Optimal page replacement"): 7 0 1 2 0 3 0 4 2 3 0 3 2 1 2 0 1 7 0 1 with 3
 * frames: OPT has 9 faults (11 hits), LRU 12 faults (8 hits). By hand, OPT:
 *   7 m {7}  0 m {7 0}  1 m {7 0 1}  2 m evict 7 (next at 17) {2 0 1}  0 HIT
 *   3 m evict 1 (next 13) {2 0 3}  0 HIT  4 m evict 0 (next 10)... no: at t7
 *   next uses are 2→8, 0→10, 3→9: evict 0 {2 4 3}  2 HIT  3 HIT
 *   0 m evict 4 (never) {2 0 3}  3 HIT  2 HIT
 *   1 m evict 3 (never) {2 0 1}  2 HIT  0 HIT  1 HIT
 *   7 m evict 2 (never) {7 0 1}  0 HIT  1 HIT
 * misses: 7 0 1 2 3 4 0 1 7 = 9; hits 11.
 *
 * With bypass, the same until t7: 4 is never used again, no sooner than any
 * cached block (2→8, 3→9, 0→10), so it is not cached, and 0 at t10 hits:
 *   t7 4 bypass {2 0 3}  2 HIT  3 HIT  0 HIT  3 HIT  2 HIT
 *   1 m evict 3 (never) {2 0 1}  2 HIT  0 HIT  1 HIT
 *   7 m bypass (never, as 2)  0 HIT  1 HIT
 * misses: 7 0 1 2 3 4 1 7 = 8; hits 12 (the exhaustive search agrees).
 */
static void test_opt_textbook(void **state) {
  (void)state;
  const int refs[] = {7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1};
  replay_trace t = make_trace(refs, 20, BLK);
  replay_result r = run_opt_admit(&t, 3 * BLK);
  assert_int_equal(r.hits, 11);
  r = run_opt(&t, 3 * BLK);
  assert_int_equal(r.hits, 12);
  assert_int_equal(r.bypassed, 2);
  replay_result l = run_sgm(&t, "lru", 3 * BLK, true);
  assert_int_equal(l.hits, 8);
  assert_int_equal(l.accesses, 20);
  replay_trace_free(&t);
}

/*
 * Frees give room back without a demotion. Capacity 2: a b free(a) c b:
 *   a m {a}; b m {a b}; free a {b}; c m, room: {b c}; b HIT.
 * 1 hit, 0 evictions (both variants: with room, nothing is bypassed).
 * Without the free, opt-admit's c evicts a (never used again): still 1 hit
 * but 1 eviction; opt's c (never used again, as a) is bypassed: 0.
 */
static void test_opt_frees(void **state) {
  (void)state;
  const int with_free[] = {0, 1, -1, 2, 1};
  replay_trace t = make_trace(with_free, 5, BLK);
  replay_result r = run_opt(&t, 2 * BLK);
  assert_int_equal(r.accesses, 4);
  assert_int_equal(r.hits, 1);
  assert_int_equal(r.evictions, 0);
  replay_result l = run_sgm(&t, "lru", 2 * BLK, false);
  assert_int_equal(l.hits, 1);
  assert_int_equal(l.evictions, 0);
  r = run_opt_admit(&t, 2 * BLK);
  assert_int_equal(r.hits, 1);
  assert_int_equal(r.evictions, 0);
  replay_trace_free(&t);
  const int without[] = {0, 1, 2, 1};
  t = make_trace(without, 4, BLK);
  r = run_opt_admit(&t, 2 * BLK);
  assert_int_equal(r.hits, 1);
  assert_int_equal(r.evictions, 1);
  r = run_opt(&t, 2 * BLK);
  assert_int_equal(r.hits, 1);
  assert_int_equal(r.evictions, 0);
  assert_int_equal(r.bypassed, 1);
  replay_trace_free(&t);
}

/*
 * Unequal sizes, Belady-size (evict by furthest next use until the block
 * fits; with bypass, a block whose next use is no nearer than the furthest
 * cached one's is not cached). Units of 256 bytes; capacity 4 units. a=1u
 * b=2u c=2u d=4u:
 *   a m {a}=1; b m {a b}=3; c m: 3+2 > 4; c next 4 is nearer than b's
 *   (never): no bypass; furthest: a next 3, b never → evict b {a c}=3;
 *   a HIT; c HIT; d m (4u): d next 6, nearer than a and c (never): no bypass;
 *   evict by furthest until it fits → both go {d}=4; d HIT.
 * 3 hits of 6, 3 evictions (both variants); nothing re-fetched. A block
 * larger than the whole capacity (e=5u) is never cached: both its accesses
 * miss and nothing is evicted for it.
 */
static void test_opt_sizes_by_hand(void **state) {
  (void)state;
  const int refs[] = {0, 1, 2, 0, 2, 3, 3, 4, 4};
  replay_trace t = make_trace(refs, 9, REPLAY_ALIGN);
  const uint64_t u = REPLAY_ALIGN;
  t.size[0] = 1 * u;
  t.size[1] = 2 * u;
  t.size[2] = 2 * u;
  t.size[3] = 4 * u;
  t.size[4] = 5 * u;
  char err[REPLAY_ERR_MAX];
  assert_int_equal(replay_trace_finish(&t, err, sizeof err), 0);
  assert_int_equal(t.uniform_bytes, 0);
  for (int v = 0; v < 2; v++) {
    replay_result r = v ? run_opt(&t, 4 * u) : run_opt_admit(&t, 4 * u);
    assert_int_equal(r.accesses, 9);
    assert_int_equal(r.hits, 3);
    assert_int_equal(r.evictions, 3);
    assert_int_equal(r.bytes_promoted, 0);
  }
  /* Sizes are charged rounded up to 256 bytes, as sgm rounds them: 100 bytes
   * take a whole unit, so four of them fill 4 units and a fifth needs room
   * (unrounded, all five would fit): opt-admit evicts one of those never
   * used again (1 2 3, not 0, which comes back):
   *   0 1 2 3 m; 4 m evict 3; 0 HIT → 1 hit, 1 eviction;
   * opt bypasses 4 (never used again, no sooner than 1 2 3): 1 hit, 0. */
  const int small[] = {0, 1, 2, 3, 4, 0};
  replay_trace s = make_trace(small, 6, 100);
  replay_result r = run_opt_admit(&s, 4 * u);
  assert_int_equal(r.hits, 1);
  assert_int_equal(r.evictions, 1);
  r = run_opt(&s, 4 * u);
  assert_int_equal(r.hits, 1);
  assert_int_equal(r.evictions, 0);
  assert_int_equal(r.bypassed, 1);
  replay_trace_free(&s);
  replay_trace_free(&t);
}

/* With room for everything, only first accesses miss and nothing moves. */
static void test_opt_compulsory_only(void **state) {
  (void)state;
  const int refs[] = {0, 1, 0, 2, 1, 0, 3, 3, 2};
  replay_trace t = make_trace(refs, 9, BLK);
  replay_result r = run_opt(&t, 4 * BLK);
  assert_int_equal(r.hits, 9 - 4);
  assert_int_equal(r.evictions, 0);
  assert_int_equal(r.bypassed, 0);
  assert_int_equal(r.bytes_demoted, 0);
  r = run_opt_admit(&t, 4 * BLK);
  assert_int_equal(r.hits, 9 - 4);
  replay_result l = run_sgm(&t, "lru", 4 * BLK, false);
  assert_int_equal(l.hits, 9 - 4);
  assert_int_equal(l.evictions, 0);
  replay_trace_free(&t);
}

/* ---- OPT against an exhaustive search ---- */

#define BF_MAX_N 16
#define BF_MAX_BLOCKS 6

/* Most hits from position i on with cache `mask`, trying every choice on
 * every miss: every victim when full, and, with bypass, not caching the block
 * at all (whether or not there is room). Memoised per variant. */
static int bf_best(const int *refs, int n, int cap, bool bypass, int i, unsigned mask,
                   signed char *memo) {
  if (i == n) return 0;
  signed char *m = &memo[i * (1 << BF_MAX_BLOCKS) + (int)mask];
  if (*m >= 0) return *m;
  unsigned bit = 1u << refs[i];
  int best = -1;
  if (mask & bit) {
    best = 1 + bf_best(refs, n, cap, bypass, i + 1, mask, memo);
  } else {
    if (bypass) best = bf_best(refs, n, cap, bypass, i + 1, mask, memo);
    if (__builtin_popcount(mask) < cap) {
      int h = bf_best(refs, n, cap, bypass, i + 1, mask | bit, memo);
      if (h > best) best = h;
    } else {
      for (int v = 0; v < BF_MAX_BLOCKS; v++) {
        if (!(mask & (1u << v))) continue;
        int h = bf_best(refs, n, cap, bypass, i + 1, (mask & ~(1u << v)) | bit, memo);
        if (h > best) best = h;
      }
    }
  }
  *m = (signed char)best;
  return best;
}

/* Invariant: for equal sizes, both variants' hits equal the true optimum of
 * their model (an exhaustive search over every choice at every miss), and
 * bypass never has fewer hits than admit-always. */
static void test_opt_equals_exhaustive_search(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("replay.opt_exhaustive", 5);
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  static signed char memo[BF_MAX_N * (1 << BF_MAX_BLOCKS)];
  int n_better = 0;
  for (int round = 0; round < 600; round++) {
    int n = (int)sgm_test_rng_range(&r, 1, BF_MAX_N);
    int nb = (int)sgm_test_rng_range(&r, 1, BF_MAX_BLOCKS);
    int cap = (int)sgm_test_rng_range(&r, 1, 4);
    int refs[BF_MAX_N];
    for (int i = 0; i < n; i++) refs[i] = (int)sgm_test_rng_range(&r, 0, (uint64_t)nb - 1);
    replay_trace t = make_trace(refs, (size_t)n, BLK);
    for (int bypass = 0; bypass <= 1; bypass++) {
      memset(memo, -1, sizeof memo);
      int want = bf_best(refs, n, cap, bypass, 0, 0, memo);
      replay_result o = bypass ? run_opt(&t, (uint64_t)cap * BLK) : run_opt_admit(&t, (uint64_t)cap * BLK);
      if ((int)o.hits != want)
        fail_msg("round %d (seed %llu): %s %llu hits, optimum %d", round, (unsigned long long)seed,
                 o.policy, (unsigned long long)o.hits, want);
    }
    replay_result a = run_opt_admit(&t, (uint64_t)cap * BLK), b = run_opt(&t, (uint64_t)cap * BLK);
    assert_true(b.hits >= a.hits);
    n_better += b.hits > a.hits;
    replay_trace_free(&t);
  }
  print_message("# bypass beat admit-always on %d of 600 traces\n", n_better);
  assert_true(n_better > 0);
}

/* ---- no online policy beats OPT ---- */

/* Reference LRU of cap equal blocks: hits. */
static uint64_t ref_lru(const replay_trace *t, uint32_t cap) {
  uint32_t *stack = malloc(cap * sizeof *stack); /* [0] = most recent */
  uint32_t n = 0;
  uint64_t hits = 0;
  for (size_t i = 0; i < t->n_ev; i++) {
    uint32_t b = REPLAY_EV_ID(t->ev[i]);
    uint32_t k = 0;
    while (k < n && stack[k] != b) k++;
    if (t->ev[i] & REPLAY_EV_FREE) {
      if (k < n) memmove(&stack[k], &stack[k + 1], (n - k - 1) * sizeof *stack), n--;
      continue;
    }
    if (k < n) {
      hits++;
    } else {
      if (n == cap) n--; /* drop the least recent */
      k = n++;
    }
    memmove(&stack[1], &stack[0], k * sizeof *stack);
    stack[0] = b;
  }
  free(stack);
  return hits;
}

/*
 * Invariant: on random traces (skewed so that there is reuse, with frees in
 * half of them) and capacities from 1 block to all of them, every policy sgm
 * knows — tinylfu, whose admit may leave a newcomer in shared memory,
 * included — driven through the real buffer API, has at most OPT's hits (OPT
 * with bypass: the bound for admission policies too); sgm's LRU has exactly
 * the reference LRU's hits (so the driver's hit and capacity are the
 * simulation's).
 */
static void test_no_policy_beats_opt(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("replay.policy_vs_opt", 20240605);
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  enum { N = 240, BLOCKS = 24 };
  int n_above_admit = 0;
  for (int round = 0; round < 12; round++) {
    int refs[N + BLOCKS];
    size_t n = 0;
    bool frees = round % 2;
    bool freed[BLOCKS] = {false};
    for (int i = 0; i < N; i++) {
      /* Log-uniform ids: a few hot blocks, a long tail. */
      int b = (int)sgm_test_rng_log_range(&r, 1, BLOCKS) - 1;
      if (freed[b]) continue;
      refs[n++] = b;
      if (frees && sgm_test_rng_range(&r, 0, 30) == 0) {
        refs[n++] = -1 - b;
        freed[b] = true;
      }
    }
    replay_trace t = make_trace(refs, n, BLK);
    const uint32_t caps[] = {1, 2, 3, 5, 8, 13, BLOCKS};
    for (size_t c = 0; c < sizeof caps / sizeof *caps; c++) {
      uint64_t capacity = caps[c] * BLK;
      replay_result o = run_opt(&t, capacity);
      replay_result oa = run_opt_admit(&t, capacity);
      assert_true(oa.hits <= o.hits);
      for (const char *const *p = replay_policy_names(); *p; p++) {
        replay_result x = run_sgm(&t, *p, capacity, c % 2 == 0);
        assert_int_equal(x.accesses, o.accesses);
        if (x.hits > o.hits)
          fail_msg("seed %llu round %d capacity %u: %s has %llu hits, OPT %llu",
                   (unsigned long long)seed, round, caps[c], *p, (unsigned long long)x.hits,
                   (unsigned long long)o.hits);
        n_above_admit += x.hits > oa.hits; /* possible for an admission policy only */
        if (strcmp(*p, "lru") == 0) {
          uint64_t want = ref_lru(&t, caps[c]);
          if (x.hits != want)
            fail_msg("seed %llu round %d capacity %u: sgm lru %llu hits, reference LRU %llu",
                     (unsigned long long)seed, round, caps[c], (unsigned long long)x.hits,
                     (unsigned long long)want);
        }
      }
    }
    replay_trace_free(&t);
  }
  print_message("# policy runs with more hits than opt-admit (below opt): %d\n", n_above_admit);
}

/* Reference LRU of cap equal blocks in O(1) per event (a list over dense
 * ids): hits. For traces too long for ref_lru's stack walk. */
static uint64_t ref_lru_fast(const replay_trace *t, uint32_t cap) {
  uint32_t nb = t->n_blocks ? t->n_blocks : 1, none = UINT32_MAX, head = none, tail = none, n = 0;
  uint32_t *prev = malloc(nb * sizeof *prev), *next = malloc(nb * sizeof *next);
  bool *in = calloc(nb, sizeof *in);
  assert_true(prev && next && in);
  uint64_t hits = 0;
  for (size_t i = 0; i < t->n_ev; i++) {
    uint32_t b = REPLAY_EV_ID(t->ev[i]);
    if (in[b]) { /* unlink */
      if (prev[b] != none) next[prev[b]] = next[b]; else head = next[b];
      if (next[b] != none) prev[next[b]] = prev[b]; else tail = prev[b];
      in[b] = false;
      n--;
      if (t->ev[i] & REPLAY_EV_FREE) continue;
      hits++;
    } else if (t->ev[i] & REPLAY_EV_FREE) {
      continue;
    } else if (n == cap) { /* drop the least recent */
      uint32_t v = tail;
      tail = prev[v];
      if (tail != none) next[tail] = none; else head = none;
      in[v] = false;
      n--;
    }
    prev[b] = none; /* to the head */
    next[b] = head;
    if (head != none) prev[head] = b; else tail = b;
    head = b;
    in[b] = true;
    n++;
  }
  free(prev);
  free(next);
  free(in);
  return hits;
}

/*
 * Invariant: the replay's VRAM holds exactly the capacity asked for, also past
 * the 64 MiB where sgm's reserve mode would otherwise take the budget as a
 * pool of 2 MiB granules mapped where blocks land (and hold fewer blocks than
 * the budget: partly used granules, the last partial granule dropped). sgm's
 * LRU over 4 KiB blocks at 17001 blocks (66.4 MiB, not a whole number of
 * granules) has exactly the reference LRU's hits, on a trace of prefix chains
 * as a KV cache sees them. Before the fix: 27.25% instead of 27.84% on the
 * Mooncake conversation trace.
 */
static void test_lru_exact_past_granules(void **state) {
  (void)state;
  uint64_t seed = sgm_test_seed("replay.lru_exact", 20261202);
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  enum { REQS = 4000, PREFIXES = 300, MAXLEN = 24 };
  size_t cap_ev = (size_t)REQS * MAXLEN, n = 0;
  int *refs = malloc(cap_ev * sizeof *refs);
  int prefix[PREFIXES][MAXLEN / 2];
  int next_id = 0;
  for (int p = 0; p < PREFIXES; p++)
    for (int k = 0; k < MAXLEN / 2; k++) prefix[p][k] = next_id++;
  for (int q = 0; q < REQS; q++) {
    /* A shared prefix (skewed: a few hot ones), then blocks of its own. */
    int p = (int)sgm_test_rng_log_range(&r, 1, PREFIXES) - 1;
    int shared = (int)sgm_test_rng_range(&r, 1, MAXLEN / 2);
    int own = (int)sgm_test_rng_range(&r, 1, MAXLEN / 2);
    for (int k = 0; k < shared; k++) refs[n++] = prefix[p][k];
    for (int k = 0; k < own; k++) refs[n++] = next_id++;
  }
  replay_trace t = make_trace(refs, n, BLK);
  free(refs);
  const uint32_t cap = 17001;
  assert_true(cap * BLK > (UINT64_C(64) << 20));
  replay_result x = run_sgm(&t, "lru", cap * BLK, false);
  uint64_t want = ref_lru_fast(&t, cap);
  print_message("# seed %llu: %zu accesses, %u blocks, capacity %u: sgm lru %llu hits, "
                "reference %llu\n", (unsigned long long)seed, n, (unsigned)t.n_blocks, cap,
                (unsigned long long)x.hits, (unsigned long long)want);
  assert_int_equal(x.hits, want);
  replay_trace_free(&t);
}

/* ---- the shipped Mooncake traces: LRU and OPT pinned, hints ---- */

typedef struct shipped {
  const char *file;   /* under SGM_TEST_TRACES/mooncake */
  uint32_t cap;       /* VRAM in blocks: 10% of the distinct blocks, as sgm-replay's default */
  double lru, opt;    /* independent values (a Python LRU and Belady with bypass), percent */
} shipped;

/* Computed outside sgm: an OrderedDict LRU and a heap Belady with bypass over
 * the files' hash_ids (issue 30's "independent values"; the full conversation
 * trace reads 27.84 / 36.64 the same way at 18279 blocks). */
static const shipped shipped_traces[] = {
    {"conversation_trace.jsonl", 52, 100.0 * 85 / 992, 100.0 * 308 / 992},
    {"toolagent_synth.jsonl", 149, 100.0 * 1712 / 5716, 100.0 * 3163 / 5716},
};

static replay_trace load_shipped(const shipped *s) {
  char path[512], err[REPLAY_ERR_MAX];
  snprintf(path, sizeof path, "%s/mooncake/%s", SGM_TEST_TRACES, s->file);
  replay_trace t;
  if (replay_trace_load(path, BLK, &t, err, sizeof err) != 0) fail_msg("%s", err);
  assert_int_equal(t.format, REPLAY_FMT_MOONCAKE);
  assert_true(t.n_req > 0);
  return t;
}

/* Invariant: sgm's LRU and OPT on both shipped traces read the independent
 * values to 0.05 points, at sgm-replay's default capacity. */
static void test_shipped_lru_opt_pinned(void **state) {
  (void)state;
  for (size_t k = 0; k < sizeof shipped_traces / sizeof *shipped_traces; k++) {
    const shipped *s = &shipped_traces[k];
    replay_trace t = load_shipped(s);
    uint32_t distinct = t.n_blocks;
    assert_int_equal(s->cap, distinct / 10);
    replay_result l = run_sgm(&t, "lru", s->cap * BLK, false);
    replay_result o = run_opt(&t, s->cap * BLK);
    double lp = 100.0 * replay_hit_ratio(&l), op = 100.0 * replay_hit_ratio(&o);
    print_message("# %s at %u blocks: lru %.4f%% (want %.4f), opt %.4f%% (want %.4f)\n", s->file,
                  s->cap, lp, s->lru, op, s->opt);
    if (lp < s->lru - 0.05 || lp > s->lru + 0.05) fail_msg("%s: lru %.4f%%, want %.4f%%", s->file, lp, s->lru);
    if (op < s->opt - 0.05 || op > s->opt + 0.05) fail_msg("%s: opt %.4f%%, want %.4f%%", s->file, op, s->opt);
    replay_trace_free(&t);
  }
}

/*
 * Invariant: with hints derived from the trace (queues of 0, 16, 64 and 256
 * requests), every hinted built-in stays at or below OPT, a hinted run
 * replays every access, and with a queue of 256 requests (the whole of these
 * small traces' future) each closes at least a quarter of the LRU->OPT gap.
 */
static void test_shipped_hints(void **state) {
  (void)state;
  static const char *const pols[] = {"lru", "s3fifo", "lirs", "arc"};
  static const uint32_t queues[] = {0, 16, 64, 256};
  for (size_t k = 0; k < sizeof shipped_traces / sizeof *shipped_traces; k++) {
    const shipped *s = &shipped_traces[k];
    replay_trace t = load_shipped(s);
    replay_result l = run_sgm(&t, "lru", s->cap * BLK, false);
    replay_result o = run_opt(&t, s->cap * BLK);
    for (size_t p = 0; p < sizeof pols / sizeof *pols; p++) {
      for (size_t q = 0; q < sizeof queues / sizeof *queues; q++) {
        replay_result x;
        char err[REPLAY_ERR_MAX];
        replay_sgm_params pp = {.policy = pols[p], .vram_bytes = s->cap * BLK, .hints = true,
                                .hint_queue = queues[q]};
        if (replay_sgm(&t, &pp, &x, err, sizeof err) != 0) fail_msg("%s", err);
        assert_int_equal(x.accesses, t.n_access);
        assert_int_equal(x.hint_queue, (int)queues[q]);
        double closed = 100.0 * ((double)x.hits - (double)l.hits) / ((double)o.hits - (double)l.hits);
        print_message("# %s %s: %.2f%% (lru %.2f%%, opt %.2f%%): %.1f%% of the gap\n", s->file,
                      x.policy, 100.0 * replay_hit_ratio(&x), 100.0 * replay_hit_ratio(&l),
                      100.0 * replay_hit_ratio(&o), closed);
        if (x.hits > o.hits) fail_msg("%s: %s beats OPT", s->file, x.policy);
        if (queues[q] == 256 && closed < 25.0) fail_msg("%s: %s closes %.1f%% < 25%%", s->file, x.policy, closed);
      }
    }
    replay_trace_free(&t);
  }
  /* Hints need requests: a CSV trace is refused with a message. */
  replay_trace c = load_ok("op,id,size\na,1,1000\na,2,1000\n", 1024, REPLAY_FMT_CSV);
  replay_result x;
  char err[REPLAY_ERR_MAX] = "";
  replay_sgm_params pp = {.policy = "lru", .vram_bytes = 4096, .hints = true};
  assert_int_equal(replay_sgm(&c, &pp, &x, err, sizeof err), -1);
  assert_non_null(strstr(err, "Mooncake"));
  replay_trace_free(&c);
}

/* The policy list for --policy all names LRU and TinyLFU, and each name makes
 * a context. */
static void test_policy_names(void **state) {
  (void)state;
  bool lru = false, tinylfu = false;
  int n = 0;
  for (const char *const *p = replay_policy_names(); *p; p++, n++) {
    assert_true(strlen(*p) > 0);
    if (strcmp(*p, "lru") == 0) lru = true;
    if (strcmp(*p, "tinylfu") == 0) tinylfu = true;
  }
  assert_true(n >= 6);
  assert_true(lru && tinylfu);
  /* An unknown policy fails with sgm's message, not a crash. */
  const int refs[] = {0};
  replay_trace t = make_trace(refs, 1, BLK);
  replay_result x;
  char err[REPLAY_ERR_MAX];
  replay_sgm_params p = {.policy = "no-such-policy", .vram_bytes = BLK};
  assert_int_equal(replay_sgm(&t, &p, &x, err, sizeof err), -1);
  assert_non_null(strstr(err, "no-such-policy"));
  replay_trace_free(&t);
}

/* ---- readers ---- */

static void test_read_csv(void **state) {
  (void)state;
  replay_trace t = load_ok("op,id,size\n"
                           "a,1,4096\n"
                           "a,2,\n"          /* no size: the block size given to the loader */
                           "\n"
                           "a,1,4096\n"
                           "# a comment\n"
                           "f,1\n"
                           "a, 1 ,8192\r\n"  /* id 1 again: a new lifetime, a new block */
                           "f,2,512\n",      /* a size on a free must match: 512 here */
                           512, REPLAY_FMT_CSV);
  const uint32_t want[] = {0, 1, 0, F(0), 2, F(1)};
  assert_events(&t, want, 6);
  assert_int_equal(t.n_blocks, 3);
  assert_int_equal(t.size[0], 4096);
  assert_int_equal(t.size[1], 512);
  assert_int_equal(t.size[2], 8192);
  assert_int_equal(t.n_access, 4);
  assert_int_equal(t.n_free, 2);
  assert_int_equal(t.uniform_bytes, 0);
  assert_int_equal(t.peak_live_bytes, 512 + 8192);
  replay_trace_free(&t);
  t = load_ok("OP, ID, SIZE\na,7,\na,9,\na,7,\n", 0, REPLAY_FMT_CSV);
  assert_int_equal(t.uniform_bytes, REPLAY_DEFAULT_BLOCK_BYTES);
  assert_int_equal(t.n_blocks, 2);
  replay_trace_free(&t);
}

static void test_read_csv_errors(void **state) {
  (void)state;
  load_fails("op,id,size\na,1,4096\nx,1,4096\n", 3, "unknown op");
  load_fails("op,id,size\na,abc,4096\n", 2, "id");
  load_fails("op,id,size\na,-1,4096\n", 2, "id");
  load_fails("op,id,size\na,1,0\n", 2, "size");
  load_fails("op,id,size\na,1,4k\n", 2, "size");
  load_fails("op,id,size\na,1,4096,5\n", 2, "3 fields");
  load_fails("op,id,size\na\n", 2, "3 fields");
  load_fails("op,id,size\na,1,4096\n\nf,2\n", 4, "not live");
  load_fails("op,id,size\na,1,4096\nf,1\nf,1\n", 4, "not live");
  load_fails("op,id,size\na,1,4096\na,1,100\n", 3, "keeps its size");
  load_fails("op,id,size\na,99999999999999999999,1\n", 2, "id");
}

/*
 * MiniMalloc: buffer 0 lives [0,10), 1 [5,6), 2 [10,20). Events: create at
 * lower, last use at upper-1 (none when upper-1 == lower), free at upper;
 * at equal times frees, then last uses, then creates:
 *   t0 a0 | t5 a1 | t6 f1 | t9 a0 | t10 f0 a2 | t19 a2 | t20 f2
 */
static void test_read_minimalloc(void **state) {
  (void)state;
  replay_trace t = load_ok("id,lower,upper,size\n"
                           "0,0,10,100\n"
                           "1,5,6,200\n"
                           "2,10,20,300\n",
                           0, REPLAY_FMT_MINIMALLOC);
  const uint32_t want[] = {0, 1, F(1), 0, F(0), 2, 2, F(2)};
  assert_events(&t, want, 8);
  assert_int_equal(t.size[1], 200);
  assert_int_equal(t.n_access, 5);
  assert_int_equal(t.n_free, 3);
  /* 0 and 1 live together: 256 + 256 bytes as sgm rounds them. */
  assert_int_equal(t.peak_live_bytes, 512);
  replay_trace_free(&t);
}

/* Times are signed: idealloc's tiny_bert starts a tensor at -1. Buffer 0
 * [-1,2) and 1 [0,1) overlap; 2 [2,3) starts as 0 ends (the free first):
 *   t-1 a0 | t0 a1 | t1 f1 a0 | t2 f0 a2 | t3 f2 */
static void test_read_minimalloc_negative_times(void **state) {
  (void)state;
  replay_trace t = load_ok("id,lower,upper,size\n"
                           "0,-1,2,100\n"
                           "1,0,1,100\n"
                           "2,2,3,100\n",
                           0, REPLAY_FMT_MINIMALLOC);
  const uint32_t want[] = {0, 1, F(1), 0, F(0), 2, F(2)};
  assert_events(&t, want, 7);
  assert_int_equal(t.peak_live_bytes, 512);
  replay_trace_free(&t);
  load_fails("id,lower,upper,size\n0,-3,-5,100\n", 2, "lower");
  load_fails("id,lower,upper,size\n-1,0,1,100\n", 2, "id");
  load_fails("id,lower,upper,size\n0,0,1,-4\n", 2, "size");
  load_fails("id,lower,upper,size\n0,-9223372036854775809,1,4\n", 2, "lower");
}

/*
 * The allocation stream of a trace through sgm_alloc/sgm_free: it is served
 * in VRAM in growth mode, growth never commits less than the footprint, every
 * block freed and trimmed leaves nothing committed, and the smallest reserved
 * budget that serves it is at least the footprint and serves it while one
 * 256-byte step less than the bisection's lower end does not.
 */
static void test_alloc_replay(void **state) {
  (void)state;
  char text[16384];
  size_t n = (size_t)snprintf(text, sizeof text, "id,lower,upper,size\n");
  /* Sawtooth lifetimes of mixed sizes: holes of several sizes open and close. */
  for (int i = 0; i < 200; i++)
    n += (size_t)snprintf(text + n, sizeof text - n, "%d,%d,%d,%d\n", i, i, i + 1 + (i * 7) % 23,
                          4096 * (1 + (i * 13) % 37) + (i % 5) * 100);
  replay_trace t = load_ok(text, 0, REPLAY_FMT_MINIMALLOC);
  char err[REPLAY_ERR_MAX];
  replay_alloc_params gp = {.growth = true, .sample = true, .vmm = -1};
  replay_alloc_result g;
  assert_int_equal(replay_alloc(&t, &gp, &g, err, sizeof err), 0);
  assert_true(g.served);
  assert_int_equal(g.events, 400);
  assert_true(g.peak_committed_bytes >= t.peak_live_bytes);
  assert_true(g.peak_used_bytes >= t.peak_live_bytes);
  assert_int_equal(g.trimmed_committed_bytes, 0);
  uint64_t budget = 0;
  unsigned runs = 0;
  assert_int_equal(replay_alloc_min_budget(&t, -1, &budget, &runs, err, sizeof err), 0);
  assert_true(budget >= t.peak_live_bytes);
  assert_true(runs >= 2);
  replay_alloc_params rp = {.growth = false, .vram_bytes = budget, .stop_on_fallback = true,
                            .vmm = -1};
  replay_alloc_result r;
  assert_int_equal(replay_alloc(&t, &rp, &r, err, sizeof err), 0);
  assert_true(r.served);
  rp.vram_bytes = t.peak_live_bytes - REPLAY_ALIGN;
  assert_int_equal(replay_alloc(&t, &rp, &r, err, sizeof err), 0);
  assert_false(r.served);
  replay_trace_free(&t);
}

/*
 * The synthetic transformer stream (synth.c) is a well-formed trace: every
 * event names a block made before it, no block is freed twice, the same seed
 * gives the same stream; a step's peak is above the weights it keeps. Replayed
 * twice in one context on the emulated device, both passes make the same
 * events, and the warm second pass makes at most 0.01 mapping calls per
 * event (free granules stay mapped while the program is busy: the trace
 * repeats every step).
 */
static void test_synthetic_transformer(void **state) {
  (void)state;
  char err[REPLAY_ERR_MAX];
  replay_trace a, b;
  assert_int_equal(replay_trace_transformer(&a, 3, 7, err, sizeof err), 0);
  assert_int_equal(replay_trace_transformer(&b, 3, 7, err, sizeof err), 0);
  assert_int_equal(a.n_ev, b.n_ev);
  assert_memory_equal(a.ev, b.ev, a.n_ev * sizeof a.ev[0]);
  assert_memory_equal(a.size, b.size, a.n_blocks * sizeof a.size[0]);
  char *freed = calloc(a.n_blocks, 1), *made = calloc(a.n_blocks, 1);
  assert_non_null(freed);
  assert_non_null(made);
  for (size_t i = 0; i < a.n_ev; i++) {
    uint32_t id = REPLAY_EV_ID(a.ev[i]);
    assert_true(id < a.n_blocks);
    if (a.ev[i] & REPLAY_EV_FREE) {
      assert_true(made[id]);
      assert_false(freed[id]);
      freed[id] = 1;
    } else {
      assert_false(made[id]);
      made[id] = 1;
    }
  }
  free(freed);
  free(made);
  assert_true(a.peak_live_bytes > (UINT64_C(1) << 30)); /* a training step, not a toy */
  replay_alloc_params p = {.growth = true, .sample = true, .vmm = -1, .passes = 2};
  replay_alloc_result r;
  assert_int_equal(replay_alloc(&a, &p, &r, err, sizeof err), 0);
  assert_true(r.served);
  assert_int_equal(r.pass[0].events, r.pass[1].events);
  assert_int_equal(r.events, r.pass[0].events + r.pass[1].events);
  assert_true(r.peak_committed_bytes >= a.peak_live_bytes);
  assert_true(r.pass[0].map_calls > 0);
  /* Issue 26's target: at most 0.01 mapping calls per event once warm (911
   * on 5,526 events before hysteresis, 3 after). */
  assert_true(r.pass[1].map_calls * 100 <= r.pass[1].events);
  replay_trace_free(&a);
  replay_trace_free(&b);
}

static void test_read_minimalloc_errors(void **state) {
  (void)state;
  load_fails("id,lower,upper,size\n0,0,10,100\n1,7,7,5\n", 3, "lower");
  load_fails("id,lower,upper,size\n0,9,3,100\n", 2, "lower");
  load_fails("id,lower,upper,size\n0,0,10\n", 2, "4 fields");
  load_fails("id,lower,upper,size\n0,0,x,10\n", 2, "upper");
  load_fails("id,lower,upper,size\n0,0,1,10\n0,1,2,10\n", 3, "twice");
  load_fails("id,lower,upper,size\n0,0,1,0\n", 2, "size");
}

static void test_read_mooncake(void **state) {
  (void)state;
  replay_trace t = load_ok(
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [5, 7, 5]}\n"
      "\n"
      "{\"timestamp\": 1, \"hash_ids\": [7, 18446744073709551615], \"x\": {\"a\": [1, -2.5e3, "
      "\"q\\\"\\u00e9\"], \"b\": null, \"c\": true}}\n"
      "{\"hash_ids\": []}\n",
      8192, REPLAY_FMT_MOONCAKE);
  const uint32_t want[] = {0, 1, 0, 1, 2};
  assert_events(&t, want, 5);
  assert_int_equal(t.n_blocks, 3);
  assert_int_equal(t.uniform_bytes, 8192);
  assert_int_equal(t.peak_live_bytes, 3 * 8192);
  replay_trace_free(&t);
}

/* Invariant (issue 29): a replay whose footprint cannot fit in what sgm may
 * hold (VRAM + shared memory clamped to half of RAM + disk), or whose emulated
 * VRAM is larger than RAM, is refused before anything is pinned, with advice;
 * a footprint that fits is accepted. (`sgm-replay --block-size 1TiB` on a
 * two-line trace pinned all of RAM.) */
static void test_check_room_refuses_before_pinning(void **state) {
  (void)state;
  const char *two = "{\"timestamp\": 0, \"hash_ids\": [1, 2]}\n{\"timestamp\": 1, \"hash_ids\": [1]}\n";
  replay_trace t = load_ok(two, UINT64_C(1) << 40, REPLAY_FMT_MOONCAKE);
  char err[REPLAY_ERR_MAX] = "";
  replay_sgm_params p = {.policy = "lru", .vram_bytes = UINT64_C(1) << 20};
  assert_int_equal(replay_check_room(&t, &p, err, sizeof err), -1);
  print_message("# %s\n", err);
  assert_non_null(strstr(err, "cannot fit"));
  assert_non_null(strstr(err, "--block-size"));
  p.vram_bytes = UINT64_C(1) << 40; /* 10% of 2 TiB is more RAM than a test machine has */
  assert_int_equal(replay_check_room(&t, &p, err, sizeof err), -1);
  assert_non_null(strstr(err, "more than this machine's RAM"));
  replay_trace_free(&t);
  t = load_ok(two, 4096, REPLAY_FMT_MOONCAKE);
  p.vram_bytes = 4096;
  assert_int_equal(replay_check_room(&t, &p, err, sizeof err), 0);
  replay_trace_free(&t);
}

/* Invariant: sgm-replay's parser (args.c, fuzzed by fuzz_replay_args) takes
 * every option form and refuses bad values with a message naming them. */
static void test_args_parse(void **state) {
  (void)state;
  replay_args a;
  char err[256];
  char *ok[] = {"sgm-replay", "--policy=lru,clock", "--vram", "10%", "--shared", "1GiB",
                "--block-size=4KiB", "--json", "--cold", "trace.jsonl"};
  assert_int_equal(replay_args_parse(10, ok, &a, err, sizeof err), 0);
  assert_string_equal(a.policy_arg, "lru,clock");
  assert_true(a.vram_pct == 10.0 && a.vram_bytes == 0);
  assert_int_equal(a.shared_bytes, UINT64_C(1) << 30);
  assert_int_equal(a.block_bytes, 4096);
  assert_true(a.json && a.cold && a.block_given);
  assert_string_equal(a.path, "trace.jsonl");
  char *help[] = {"sgm-replay", "--help"};
  assert_int_equal(replay_args_parse(2, help, &a, err, sizeof err), 1);
  struct {
    int argc;
    char *argv[4];
    const char *why;
  } bad[] = {
      {2, {"sgm-replay", "--vram"}, "--vram needs a value"},
      {3, {"sgm-replay", "--block-size=0", "t"}, "--block-size 0"},
      {3, {"sgm-replay", "--block-size=8EiB", "t"}, "--block-size 8EiB"},
      {3, {"sgm-replay", "--shared=1.5", "t"}, "--shared 1.5"},
      {3, {"sgm-replay", "--vram=101%", "t"}, "--vram 101%"},
      {3, {"sgm-replay", "--vram-blocks=-1", "t"}, "--vram-blocks -1"},
      {4, {"sgm-replay", "--vram=1M", "--vram-blocks=2", "t"}, "not both"},
      {3, {"sgm-replay", "a", "b"}, "one trace at a time"},
      {2, {"sgm-replay", "--bogus"}, "unknown option --bogus"},
      {1, {"sgm-replay"}, "no trace given"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    assert_int_equal(replay_args_parse(bad[i].argc, bad[i].argv, &a, err, sizeof err), 2);
    if (!strstr(err, bad[i].why)) fail_msg("case %zu: \"%s\" lacks \"%s\"", i, err, bad[i].why);
  }
}

static void test_read_mooncake_errors(void **state) {
  (void)state;
  const char *ok = "{\"hash_ids\": [1, 2]}\n";
  char buf[256];
  snprintf(buf, sizeof buf, "%s{\"hash_ids\": [1, -2]}\n", ok);
  load_fails(buf, 2, "hash_ids[1]");
  snprintf(buf, sizeof buf, "%s%s{\"hash_ids\": [1.5]}\n", ok, ok);
  load_fails(buf, 3, "hash_ids[0]");
  snprintf(buf, sizeof buf, "%s{\"hash_ids\": [1, 2]\n", ok);
  load_fails(buf, 2, "expected ',' or '}'");
  snprintf(buf, sizeof buf, "%s{\"timestamp\": 3}\n", ok);
  load_fails(buf, 2, "no \"hash_ids\"");
  snprintf(buf, sizeof buf, "%s[1, 2]\n", ok);
  load_fails(buf, 2, "JSON object");
  snprintf(buf, sizeof buf, "%s{\"hash_ids\": []} x\n", ok);
  load_fails(buf, 2, "after the JSON object");
  snprintf(buf, sizeof buf, "%s{\"hash_ids\": [1], \"hash_ids\": [2]}\n", ok);
  load_fails(buf, 2, "twice");
  snprintf(buf, sizeof buf, "%s{\"hash_ids\": \"1\"}\n", ok);
  load_fails(buf, 2, "not an array");
  snprintf(buf, sizeof buf, "%s{\"a\": \"unterminated}\n", ok);
  load_fails(buf, 2, "unterminated");
}

static void detect(const char *text, replay_format want) {
  char path[64], err[REPLAY_ERR_MAX];
  write_tmp(path, text);
  replay_format f;
  int rc = replay_detect_format(path, &f, err, sizeof err);
  unlink(path);
  if (rc != 0) fail_msg("detect: %s", err);
  assert_int_equal(f, want);
}

static void test_detect_format(void **state) {
  (void)state;
  detect("{\"timestamp\": 0, \"hash_ids\": [1]}\n", REPLAY_FMT_MOONCAKE);
  detect("\n  \n{\"hash_ids\": [1]}\n", REPLAY_FMT_MOONCAKE);
  detect("id,lower,upper,size\n0,0,1,1\n", REPLAY_FMT_MINIMALLOC);
  detect("\xEF\xBB\xBFid, lower, upper, size\r\n", REPLAY_FMT_MINIMALLOC);
  detect("op,id,size\n", REPLAY_FMT_CSV);
  detect("Op,Id,Size\r\n", REPLAY_FMT_CSV);
  /* Unknown: the message names the line and the formats expected. */
  char path[64], err[REPLAY_ERR_MAX];
  const char *bad[] = {"\nid,size\n", "\n{\"tokens\": [1]}\n", "\nop,id\n"};
  for (size_t i = 0; i < 3; i++) {
    write_tmp(path, bad[i]);
    replay_format f;
    assert_int_equal(replay_detect_format(path, &f, err, sizeof err), -1);
    assert_int_equal(f, REPLAY_FMT_UNKNOWN);
    assert_non_null(strstr(err, ":2:"));
    assert_non_null(strstr(err, "MiniMalloc"));
    unlink(path);
  }
  write_tmp(path, "");
  replay_format f;
  assert_int_equal(replay_detect_format(path, &f, err, sizeof err), -1);
  assert_non_null(strstr(err, "empty"));
  unlink(path);
  assert_int_equal(replay_detect_format("/nonexistent/trace.csv", &f, err, sizeof err), -1);
  assert_non_null(strstr(err, "cannot open"));
}

/* The three formats replay end to end through sgm and OPT, unequal sizes too. */
static void test_replay_each_format(void **state) {
  (void)state;
  const char *texts[] = {
      "op,id,size\na,1,1000\na,2,3000\na,3,700\na,1,\nf,2\na,4,5000\na,1,\na,3,\n",
      "id,lower,upper,size\n0,0,10,1000\n1,2,8,3000\n2,3,12,700\n3,9,20,2000\n",
      "{\"hash_ids\": [1, 2, 3]}\n{\"hash_ids\": [1, 2, 4, 5]}\n{\"hash_ids\": [1, 6]}\n"};
  for (int i = 0; i < 3; i++) {
    replay_trace t = load_ok(texts[i], 1024, (replay_format)(REPLAY_FMT_CSV + i));
    for (uint64_t cap = 1024; cap <= 8192; cap *= 2) {
      replay_result o = run_opt(&t, cap);
      replay_result x = run_sgm(&t, "lru", cap, false);
      assert_int_equal(x.accesses, t.n_access);
      assert_int_equal(o.accesses, t.n_access);
      assert_true(x.hits <= x.accesses);
      assert_true(o.hits <= o.accesses);
      /* What leaves VRAM went to shared memory (no disk tier here). */
      assert_int_equal(x.tier_out[0], x.bytes_demoted);
      assert_int_equal(x.tier_in[0], x.bytes_promoted);
      assert_int_equal(x.tier_in[2], 0);
      if (t.uniform_bytes) assert_true(x.hits <= o.hits);
    }
    replay_trace_free(&t);
  }
}

int main(void) {
  sgm_test_clean_env();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_opt_by_hand),
      cmocka_unit_test(test_opt_textbook),
      cmocka_unit_test(test_opt_frees),
      cmocka_unit_test(test_opt_sizes_by_hand),
      cmocka_unit_test(test_opt_compulsory_only),
      cmocka_unit_test(test_opt_equals_exhaustive_search),
      cmocka_unit_test(test_no_policy_beats_opt),
      cmocka_unit_test(test_lru_exact_past_granules),
      cmocka_unit_test(test_shipped_lru_opt_pinned),
      cmocka_unit_test(test_shipped_hints),
      cmocka_unit_test(test_policy_names),
      cmocka_unit_test(test_read_csv),
      cmocka_unit_test(test_read_csv_errors),
      cmocka_unit_test(test_read_minimalloc),
      cmocka_unit_test(test_read_minimalloc_errors),
      cmocka_unit_test(test_read_minimalloc_negative_times),
      cmocka_unit_test(test_alloc_replay),
      cmocka_unit_test(test_synthetic_transformer),
      cmocka_unit_test(test_read_mooncake),
      cmocka_unit_test(test_read_mooncake_errors),
      cmocka_unit_test(test_detect_format),
      cmocka_unit_test(test_replay_each_format),
      cmocka_unit_test(test_check_room_refuses_before_pinning),
      cmocka_unit_test(test_args_parse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
