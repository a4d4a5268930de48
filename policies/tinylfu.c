/*
 * tinylfu.c — W-TinyLFU (Einziger, Friedman, Manes, "TinyLFU: A Highly
 * Efficient Cache Admission Policy", ACM Transactions on Storage 13(4), 2017),
 * counted in bytes, with the adaptive window of Caffeine's "hill climbing".
 *
 * Design note. An *admission* policy: it does not only pick victims, it also
 * decides whether a newcomer is worth a victim. Three LRU segments share the
 * instance's bytes, and a frequency sketch remembers how often every buffer
 * was acquired lately, whether it is resident here or not:
 *
 *   record(id) ──→ [ count-min sketch: 4 rows of 4-bit counters, halved every
 *                    TL_SAMPLE_FACTOR × items held; optional doorkeeper ]
 *                                        │ est(id)
 *   newcomer ─→ WINDOW (1%, LRU)         ▼
 *                 tail ── duel: est(window tail) > est(main victim)? ──┐
 *                  │ no: the window tail leaves              yes: it   │
 *                  ▼                                          moves to │
 *               victim      MAIN = PROBATION (20%) + PROTECTED (80%)  ◀┘
 *                           hit in probation → protected head;
 *                           protected overflow → probation head;
 *                           main's victim: probation tail (else protected tail)
 *
 * - The window takes every newcomer that fits in it (the VRAM tier asks admit,
 *   which says yes), so a buffer used twice in quick succession hits as under
 *   LRU. When a newcomer of `want` bytes would push the window over its share,
 *   next_victim holds the duel: the window's LRU buffer against main's
 *   victim, by estimated frequency; the loser is the victim, the winner is (or
 *   stays) in main. A one-time scan therefore passes through the window and
 *   leaves without touching main.
 * - A newcomer larger than the whole window (or any newcomer when the window's
 *   share is 0) is itself the candidate for main: admit() lets it push out
 *   main's victim only if its estimate beats the victim's. Refused, it lives
 *   in shared memory (sgm's placement rule 5) and is counted on each acquire
 *   there, until it is asked about often enough to win. This is TinyLFU's
 *   filter in its original form, with a bypass: sgm loses nothing by refusing.
 * - The sketch counts every acquire (record), hit or miss: it must see the
 *   buffers that are *not* resident, or it could not tell a returning buffer
 *   from a new one. 4-bit counters saturate at 15; after TL_SAMPLE_FACTOR ×
 *   (most items held) additions every counter halves (the paper's "reset"),
 *   so old popularity fades. Increments are conservative (only the counters at
 *   the minimum grow), which keeps one-hit buffers from inflating their
 *   neighbours. The optional doorkeeper (a Bloom filter of 8 bits per record
 *   of a period, two probes, cleared on reset; off by default) absorbs each
 *   buffer's first acquire per period, so the one-time majority never
 *   reaches the counters; est() adds it back.
 *   Rows grow with the items held (four counters per item per row): a
 *   grown row copies each old counter into the new slots that now hash there
 *   (indices are the top bits of a hash), so estimates survive growth.
 * - Hill climbing (the adaptive window of Caffeine; Einziger et al., "Adaptive
 *   Software Cache Management", Middleware 2018): once per cache's worth of
 *   requests (records), compare the period's hit ratio with the previous
 *   one; keep moving the window's share the same way while it improves, turn
 *   round when it does not; steps start at 6.25% of the cache, shrink by 2% a
 *   period, and start over when the ratio jumps by 5 points (a new phase of
 *   the workload). The window stays within 0..80%. At 0 every newcomer goes
 *   through admit (pure TinyLFU); near 80% the policy is close to an SLRU.
 *   As in Caffeine, a growing window takes main's LRU buffers into its head
 *   and a shrinking one gives its LRU buffers to probation: resizing evicts
 *   nothing, and every eviction from a full cache stays a duel.
 *
 * Sizes. Shares are of the cache: the tier's budget (Caffeine's maximum
 * size), or the most bytes the instance has held when the budget is unknown
 * (0). Not the bytes held: while a cache fills, a share of what it holds
 * would keep protected too small and send hot buffers back to probation. A
 * window share of 1%, probation 20% / protected 80% of main: the paper's and
 * Caffeine's defaults. Fixed allocations in the tier only make the cache
 * smaller than the budget: protected then rarely overflows, and main's
 * victims come from probation, the buffers not used since they entered main.
 *
 * Costs. record: 4 counter reads, at most 4 increments, 2 doorkeeper bits;
 * every other method O(1) (next_victim: one duel at most; a hit in probation
 * moves protected buffers back only as far as it pushed protected over its
 * share; the window spills into main only during warm-up or after it shrank,
 * each buffer once per insertion): O(1) amortised. Halving is O(counters)
 * once per TL_SAMPLE_FACTOR × items records, growing the rows O(counters) per
 * doubling of the items: both O(1) amortised. Memory: 4 rows of 4-bit
 * counters, four per item held (rounded up to a power of two): 8 to 16 bytes
 * per item, per priority level that holds items (10 more with the
 * doorkeeper); the rows never shrink.
 *
 * Pins. A pinned buffer is unlinked and keeps its segment in its state; used,
 * it comes back as a hit (window: window head; probation: promoted;
 * protected: protected head); restored unused, at its segment's tail.
 *
 * Invariants (tl_check): every listed item is in the list of the segment its
 * state names, not pinned, owned by its item; each segment's byte and item
 * counters match its list; the window's share is at most 100%. Threading:
 * none of its own — the placement lock serialises every call.
 */
#include <stdint.h>

#include "builtin.h"
#include "common.h"

enum { TL_WINDOW = 0, TL_PROBATION = 1, TL_PROTECTED = 2, TL_SEGS = 3 };

/* Parts per million: the unit of the shares below. */
#define TL_PPM 1000000u
/* The window's share of the cache: 1%, the paper's and Caffeine's default;
 * big enough for a buffer reused within a few hundred others to hit. */
#define TL_WINDOW_PPM 10000u
/* Protected's share of main: 80% (SLRU as in the paper). */
#define TL_PROTECTED_PPM 800000u
/* Halve the sketch every this many records per item held: 10, the usual
 * sample size W = 10 × C (Caffeine's; the paper's W/C is 8 to 16). */
#define TL_SAMPLE_FACTOR 10u
/* Counters per row, per item held: 4 (rounded up to a power of two), about
 * Caffeine's sizing (16 counters per item over 4 rows): a period brings up to
 * TL_SAMPLE_FACTOR × items distinct buffers, and narrower rows let one-time
 * buffers collide into estimates that beat the hot ones'. */
#define TL_WIDTH_FACTOR 4u
/* Doorkeeper off: the paper's option to keep one-time buffers out of the
 * counters, sized to the period (tl_door_log2), measured on and off with no
 * gain on the Mooncake trace (docs/policies.md); off saves its memory. */
#define TL_DOORKEEPER 0
/* Hill climbing on, as in Caffeine: a fixed 1% window suits frequency-skewed
 * workloads and fails recency-skewed ones (docs/policies.md). */
#define TL_CLIMB 1
/* Climb once per this many records per 1000 items held: once per cache's
 * worth of requests, the natural unit (a quarter did better on the Mooncake
 * trace; we did not tune it to one trace). */
#define TL_CLIMB_PERIOD 1000u
/* First step: 6.25% of the cache, Caffeine's; decays 2% per period;
 * restarts when the hit ratio jumps by 5 points. */
#define TL_CLIMB_STEP_PPM 62500
#define TL_CLIMB_DECAY_PERMILLE 980
#define TL_CLIMB_RESTART_PPM 50000
/* The window never takes more than this share when climbing: 80%, so that
 * main stays big enough to keep what frequency says is worth keeping. */
#define TL_CLIMB_MAX_PPM 800000u
/* Rows: 4, the paper's depth. */
#define TL_ROWS 4u
/* Smallest and largest row: 64 counters (one cache line of words for all
 * rows) to 2^24 (32 MiB of counters per level; far beyond any VRAM's count
 * of buffers). */
#define TL_MIN_LOG2_WIDTH 6u
#define TL_MAX_LOG2_WIDTH 24u
/* A 4-bit counter saturates here. */
#define TL_COUNTER_MAX 15u

typedef struct tl_state {
  pol_node node;          /* in its segment's list; unlinked while pinned */
  sgm_policy_item *item;  /* back to the item */
  uint8_t seg;            /* TL_WINDOW, TL_PROBATION or TL_PROTECTED */
  uint8_t pinned;         /* out (on_remove PIN) until access, restore or drop */
} tl_state;

typedef struct tl_sketch {
  uint64_t *rows;         /* TL_ROWS rows of width/16 words, 16 4-bit counters a word */
  uint64_t *door;         /* doorkeeper: 1 << log2_door bits; NULL when off */
  unsigned log2_width;    /* counters per row = 1 << log2_width; 0 = no table yet */
  unsigned log2_door;     /* doorkeeper bits, log2 */
  uint64_t n_added;       /* records since the last halving */
} tl_sketch;

typedef struct tl_params {
  uint32_t window_ppm;    /* the window's starting share of the cache */
  uint32_t protected_ppm; /* protected's share of main */
  uint32_t sample_factor; /* halve every this many records per item held */
  uint32_t width_factor;  /* counters per row per item held */
  int doorkeeper;         /* 1: doorkeeper in front of the counters */
  int climb;              /* 1: hill-climb the window's share */
  uint32_t climb_period;  /* records per item held between climbs */
} tl_params;

typedef struct tl_policy {
  pol_node seg[TL_SEGS];        /* LRU lists, head = most recent */
  uint64_t seg_bytes[TL_SEGS];  /* listed bytes per segment */
  uint64_t seg_n[TL_SEGS];      /* listed items per segment */
  uint64_t pinned_bytes;        /* bytes of pinned items (not listed) */
  uint64_t pinned_n;            /* pinned items */
  uint64_t capacity_bytes;      /* the tier's budget; 0 = unknown (use peak_bytes) */
  uint64_t peak_bytes;          /* most bytes held (listed + pinned) */
  uint64_t peak_n;              /* most items held */
  tl_params par;                /* the constants above (tests and tuning may vary them) */
  uint32_t window_ppm;          /* the window's share now (moves when climbing) */
  tl_sketch sk;                 /* the frequency sketch */
  uint64_t cl_requests;         /* records in this climbing period */
  uint64_t cl_hits;             /* hits (on_access) in it */
  int64_t cl_step_ppm;          /* the next move of window_ppm (signed) */
  uint32_t cl_prev_ratio_ppm;   /* the previous period's hit ratio; UINT32_MAX = none yet */
} tl_policy;

static tl_state *tl_of(pol_node *n) { return (tl_state *)(void *)n; }

/* ---- the sketch ---- */

static uint64_t tl_mix(uint64_t x) {
  /* splitmix64's finaliser: ids are dense counters, so spread them. */
  x ^= x >> 30;
  x *= UINT64_C(0xBF58476D1CE4E5B9);
  x ^= x >> 27;
  x *= UINT64_C(0x94D049BB133111EB);
  x ^= x >> 31;
  return x;
}

/* Counter slot of id in row r: the top bits of h1 + r * h2 (double hashing),
 * so that a row twice as wide splits each slot into two. */
static inline uint64_t tl_slot(const tl_sketch *s, uint64_t h1, uint64_t h2, unsigned r) {
  return (h1 + r * h2) >> (64 - s->log2_width);
}

static inline unsigned tl_get(const tl_sketch *s, unsigned r, uint64_t slot) {
  uint64_t w = s->rows[((uint64_t)r << (s->log2_width - 4)) + (slot >> 4)];
  return (unsigned)(w >> ((slot & 15) * 4)) & 15u;
}

static inline void tl_inc(tl_sketch *s, unsigned r, uint64_t slot) {
  s->rows[((uint64_t)r << (s->log2_width - 4)) + (slot >> 4)] += (uint64_t)1 << ((slot & 15) * 4);
}

static void tl_hashes(uint64_t id, uint64_t *h1, uint64_t *h2) {
  *h1 = tl_mix(id);
  *h2 = tl_mix(id ^ UINT64_C(0x9E3779B97F4A7C15)) | 1;
}

/* Grow the rows to at least 2^log2 counters, keeping every estimate: new slot
 * j reads old slot j >> k. door_log2: the doorkeeper's size (0: none). On
 * allocation failure the sketch stays as it was. */
static void tl_sketch_grow(tl_sketch *s, unsigned log2, unsigned door_log2) {
  if (log2 > TL_MAX_LOG2_WIDTH) log2 = TL_MAX_LOG2_WIDTH;
  if (log2 < TL_MIN_LOG2_WIDTH) log2 = TL_MIN_LOG2_WIDTH;
  if (log2 <= s->log2_width) return;
  bool door = door_log2 != 0;
  if (door && door_log2 < 6) door_log2 = 6;
  uint64_t words = (uint64_t)1 << (log2 - 4);
  uint64_t *rows = (uint64_t *)calloc(TL_ROWS * words, sizeof *rows);
  uint64_t *dk = door ? (uint64_t *)calloc((uint64_t)1 << (door_log2 - 6), sizeof *dk) : NULL;
  if (!rows || (door && !dk)) {
    free(rows);
    free(dk);
    return;
  }
  if (s->log2_width) {
    unsigned k = log2 - s->log2_width;
    tl_sketch old = *s;
    s->rows = rows;
    s->log2_width = log2;
    for (unsigned r = 0; r < TL_ROWS; r++)
      for (uint64_t j = 0; j < ((uint64_t)1 << log2); j++) {
        unsigned v = tl_get(&old, r, j >> k);
        rows[((uint64_t)r << (log2 - 4)) + (j >> 4)] |= (uint64_t)v << ((j & 15) * 4);
      }
    /* Doorkeeper bits cannot be split without their keys: it starts empty,
     * as after a reset (at worst one more acquire per buffer goes uncounted). */
    free(old.rows);
    free(old.door);
  }
  s->rows = rows;
  s->door = dk;
  s->log2_width = log2;
  s->log2_door = door ? door_log2 : 0;
}

/* Every counter halves; the doorkeeper empties. */
static void tl_sketch_halve(tl_sketch *s) {
  uint64_t words = (uint64_t)TL_ROWS << (s->log2_width - 4);
  for (uint64_t i = 0; i < words; i++) s->rows[i] = (s->rows[i] >> 1) & UINT64_C(0x7777777777777777);
  if (s->door) memset(s->door, 0, ((uint64_t)1 << (s->log2_door - 6)) * sizeof *s->door);
  s->n_added /= 2; /* as in the paper: the halved counts stand for half the samples */
}

static inline bool tl_door_test_set(tl_sketch *s, uint64_t h1, uint64_t h2, bool set) {
  uint64_t a = h1 >> (64 - s->log2_door), b = (h2 * UINT64_C(0xD6E8FEB86659FD93)) >> (64 - s->log2_door);
  bool in = (s->door[a >> 6] >> (a & 63) & 1) && (s->door[b >> 6] >> (b & 63) & 1);
  if (set && !in) {
    s->door[a >> 6] |= (uint64_t)1 << (a & 63);
    s->door[b >> 6] |= (uint64_t)1 << (b & 63);
  }
  return in;
}

static unsigned tl_estimate(const tl_policy *p, uint64_t id) {
  const tl_sketch *s = &p->sk;
  if (!s->log2_width) return 0;
  uint64_t h1, h2;
  tl_hashes(id, &h1, &h2);
  unsigned m = TL_COUNTER_MAX;
  for (unsigned r = 0; r < TL_ROWS; r++) {
    unsigned v = tl_get(s, r, tl_slot(s, h1, h2, r));
    if (v < m) m = v;
  }
  if (s->door && tl_door_test_set((tl_sketch *)s, h1, h2, false)) m++;
  return m;
}

/* ---- sizes ---- */

static uint64_t tl_cache_bytes(const tl_policy *p) {
  return p->capacity_bytes ? p->capacity_bytes : p->peak_bytes;
}

static uint64_t tl_share(uint64_t bytes, uint32_t ppm) {
  /* bytes < 2^64 / 2^20 in any real tier; split to stay exact otherwise. */
  return bytes / TL_PPM * ppm + bytes % TL_PPM * ppm / TL_PPM;
}

static uint64_t tl_window_target(const tl_policy *p) { return tl_share(tl_cache_bytes(p), p->window_ppm); }

static uint64_t tl_protected_target(const tl_policy *p) {
  uint64_t c = tl_cache_bytes(p), w = tl_window_target(p);
  return tl_share(c > w ? c - w : 0, p->par.protected_ppm);
}

static uint64_t tl_main_bytes(const tl_policy *p) {
  return p->seg_bytes[TL_PROBATION] + p->seg_bytes[TL_PROTECTED];
}

/* The doorkeeper's size for n items held, log2 (0: off): 8 bits for each
 * distinct buffer a sampling period can bring (TL_SAMPLE_FACTOR × n), which
 * keeps its false positives near 5% at the period's end with two probes. */
static unsigned tl_door_log2(const tl_policy *p, uint64_t n) {
  if (!p->par.doorkeeper) return 0;
  uint64_t bits = 8 * p->par.sample_factor * (n > 64 ? n : 64);
  unsigned l = 6;
  while (l < TL_MAX_LOG2_WIDTH + 6 && ((uint64_t)1 << l) < bits) l++;
  return l;
}

/* ---- lists ---- */

static tl_state *tl_main_victim(tl_policy *p);

static void tl_link(tl_policy *p, tl_state *s, unsigned seg, bool at_head) {
  s->seg = (uint8_t)seg;
  if (at_head) pol_push_head(&p->seg[seg], &s->node);
  else pol_push_tail(&p->seg[seg], &s->node);
  p->seg_bytes[seg] += s->item->size_bytes;
  p->seg_n[seg]++;
  uint64_t held = p->seg_bytes[0] + p->seg_bytes[1] + p->seg_bytes[2] + p->pinned_bytes;
  uint64_t n = p->seg_n[0] + p->seg_n[1] + p->seg_n[2] + p->pinned_n;
  if (held > p->peak_bytes) p->peak_bytes = held;
  if (n > p->peak_n) {
    p->peak_n = n;
    /* Rows of about width_factor counters per item: grow by doubling. */
    uint64_t want = n * p->par.width_factor;
    if (p->sk.log2_width < TL_MAX_LOG2_WIDTH && want > ((uint64_t)1 << p->sk.log2_width)) {
      unsigned log2 = TL_MIN_LOG2_WIDTH;
      while (log2 < TL_MAX_LOG2_WIDTH && ((uint64_t)1 << log2) < want) log2++;
      tl_sketch_grow(&p->sk, log2, tl_door_log2(p, n));
    }
  }
}

static void tl_unlink(tl_policy *p, tl_state *s) {
  pol_unlink(&s->node);
  p->seg_bytes[s->seg] -= s->item->size_bytes;
  p->seg_n[s->seg]--;
}

/* Protected over its share: its LRU buffers go back to probation's head. */
static void tl_protected_trim(tl_policy *p) {
  uint64_t target = tl_protected_target(p);
  pol_node *t;
  while (p->seg_bytes[TL_PROTECTED] > target && p->seg_n[TL_PROTECTED] > 1 &&
         (t = pol_list_tail(&p->seg[TL_PROTECTED])) != NULL) {
    tl_state *s = tl_of(t);
    tl_unlink(p, s);
    tl_link(p, s, TL_PROBATION, true);
  }
}

/* While main has not filled its share (warm-up, or after the window shrank),
 * the window's overflow moves to main without a duel. */
static void tl_window_spill(tl_policy *p) {
  uint64_t wt = tl_window_target(p), c = tl_cache_bytes(p);
  uint64_t main_target = c > wt ? c - wt : 0;
  pol_node *t;
  while (p->seg_bytes[TL_WINDOW] > wt && (t = pol_list_tail(&p->seg[TL_WINDOW])) != NULL) {
    tl_state *s = tl_of(t);
    if (tl_main_bytes(p) + s->item->size_bytes > main_target) break;
    tl_unlink(p, s);
    tl_link(p, s, TL_PROBATION, true);
  }
}

/* The window's share grew: main's LRU buffers (probation's, then
 * protected's) move to the window's head until it reaches its share, so that
 * they leave only through a duel, never for the window's sake alone. */
static void tl_window_fill(tl_policy *p) {
  uint64_t wt = tl_window_target(p);
  tl_state *s;
  while (p->seg_bytes[TL_WINDOW] < wt && (s = tl_main_victim(p)) != NULL &&
         p->seg_bytes[TL_WINDOW] + s->item->size_bytes <= wt) {
    tl_unlink(p, s);
    tl_link(p, s, TL_WINDOW, true);
  }
}

/* ---- hill climbing ---- */

static void tl_climb(tl_policy *p) {
  uint32_t ratio = (uint32_t)(p->cl_hits * TL_PPM / p->cl_requests);
  if (p->cl_prev_ratio_ppm != UINT32_MAX) {
    int64_t delta = (int64_t)ratio - (int64_t)p->cl_prev_ratio_ppm;
    if (delta < 0) p->cl_step_ppm = -p->cl_step_ppm;
    if (delta >= TL_CLIMB_RESTART_PPM || delta <= -TL_CLIMB_RESTART_PPM)
      p->cl_step_ppm = p->cl_step_ppm < 0 ? -TL_CLIMB_STEP_PPM : TL_CLIMB_STEP_PPM;
    int64_t w = (int64_t)p->window_ppm + p->cl_step_ppm;
    if (w < 0) w = 0;
    if (w > (int64_t)TL_CLIMB_MAX_PPM) w = TL_CLIMB_MAX_PPM;
    p->window_ppm = (uint32_t)w;
    p->cl_step_ppm = p->cl_step_ppm * TL_CLIMB_DECAY_PERMILLE / 1000;
    if (p->cl_step_ppm == 0) p->cl_step_ppm = 1;
  }
  p->cl_prev_ratio_ppm = ratio;
  p->cl_requests = p->cl_hits = 0;
  tl_window_spill(p);
  tl_window_fill(p);
}

/* ---- the vtable ---- */

#ifdef TL_TUNING
/* Experiments only (never in a build of sgm): the constants from the
 * environment, TL_WINDOW_PPM=... and so on. */
static void tl_tune(tl_params *par) {
  const char *v;
  if ((v = getenv("TL_WINDOW_PPM"))) par->window_ppm = (uint32_t)strtoul(v, NULL, 10);
  if ((v = getenv("TL_PROTECTED_PPM"))) par->protected_ppm = (uint32_t)strtoul(v, NULL, 10);
  if ((v = getenv("TL_SAMPLE"))) par->sample_factor = (uint32_t)strtoul(v, NULL, 10);
  if ((v = getenv("TL_WIDTH"))) par->width_factor = (uint32_t)strtoul(v, NULL, 10);
  if ((v = getenv("TL_DOOR"))) par->doorkeeper = atoi(v);
  if ((v = getenv("TL_CLIMB"))) par->climb = atoi(v);
  if ((v = getenv("TL_CLIMB_PERIOD"))) par->climb_period = (uint32_t)strtoul(v, NULL, 10);
}

#endif

static sgm_status tl_create(const sgm_policy_params *params, sgm_policy **out) {
  tl_policy *p = (tl_policy *)calloc(1, sizeof *p);
  *out = NULL;
  if (!p) return SGM_ERR_NOMEM;
  for (unsigned k = 0; k < TL_SEGS; k++) pol_list_init(&p->seg[k]);
  p->capacity_bytes = params->capacity_bytes;
  p->par = (tl_params){.window_ppm = TL_WINDOW_PPM, .protected_ppm = TL_PROTECTED_PPM,
                       .sample_factor = TL_SAMPLE_FACTOR, .width_factor = TL_WIDTH_FACTOR,
                       .doorkeeper = TL_DOORKEEPER, .climb = TL_CLIMB,
                       .climb_period = TL_CLIMB_PERIOD};
#ifdef TL_TUNING
  tl_tune(&p->par);
#endif
  if (p->par.width_factor == 0) p->par.width_factor = 1;
  if (p->par.sample_factor == 0) p->par.sample_factor = 1;
  if (p->par.climb_period == 0) p->par.climb_period = 1;
  p->window_ppm = p->par.window_ppm > TL_PPM ? TL_PPM : p->par.window_ppm;
  p->cl_step_ppm = TL_CLIMB_STEP_PPM;
  p->cl_prev_ratio_ppm = UINT32_MAX;
  tl_sketch_grow(&p->sk, TL_MIN_LOG2_WIDTH, tl_door_log2(p, 1));
  if (!p->sk.log2_width) {
    free(p);
    return SGM_ERR_NOMEM;
  }
  *out = (sgm_policy *)p;
  return SGM_OK;
}

static void tl_destroy(sgm_policy *pp) {
  tl_policy *p = (tl_policy *)pp;

  free(p->sk.rows);
  free(p->sk.door);
  free(p);
}

static void tl_record(sgm_policy *pp, uint64_t id) {
  tl_policy *p = (tl_policy *)pp;
  tl_sketch *s = &p->sk;
  uint64_t h1, h2;
  tl_hashes(id, &h1, &h2);
  if (!s->door || tl_door_test_set(s, h1, h2, true)) {
    uint64_t slot[TL_ROWS];
    unsigned v[TL_ROWS], m = TL_COUNTER_MAX;
    for (unsigned r = 0; r < TL_ROWS; r++) {
      slot[r] = tl_slot(s, h1, h2, r);
      v[r] = tl_get(s, r, slot[r]);
      if (v[r] < m) m = v[r];
    }
    if (m < TL_COUNTER_MAX)
      for (unsigned r = 0; r < TL_ROWS; r++)
        if (v[r] == m) tl_inc(s, r, slot[r]);
  }
  uint64_t n = p->peak_n > 64 ? p->peak_n : 64;
  if (++s->n_added >= n * p->par.sample_factor) tl_sketch_halve(s);
  if (p->par.climb && ++p->cl_requests >= n * p->par.climb_period / 1000) tl_climb(p);
}

static void tl_insert(sgm_policy *pp, sgm_policy_item *it, sgm_policy_insert how) {
  tl_policy *p = (tl_policy *)pp;
  tl_state *s = (tl_state *)it->state;
  if (how == SGM_POLICY_INSERT_RESTORE) {
    pol_assert(s->item == it && s->pinned);
    s->pinned = 0;
    p->pinned_bytes -= it->size_bytes;
    p->pinned_n--;
    tl_link(p, s, s->seg, false);
    return;
  }
  s->item = it;
  s->pinned = 0;
  s->node.prev = s->node.next = NULL;
  /* Too big for the window: it was admitted to main (or there was room). */
  tl_link(p, s, it->size_bytes > tl_window_target(p) ? TL_PROBATION : TL_WINDOW, true);
  tl_window_spill(p);
}

static void tl_access(sgm_policy *pp, sgm_policy_item *it) {
  tl_policy *p = (tl_policy *)pp;
  tl_state *s = (tl_state *)it->state;
  pol_assert(s->item == it && s->pinned && !pol_linked(&s->node));
  s->pinned = 0;
  p->pinned_bytes -= it->size_bytes;
  p->pinned_n--;
  p->cl_hits++;
  if (s->seg == TL_PROBATION) {
    tl_link(p, s, TL_PROTECTED, true);
    tl_protected_trim(p);
  } else {
    tl_link(p, s, s->seg, true);
  }
}

static void tl_remove(sgm_policy *pp, sgm_policy_item *it, sgm_policy_remove why) {
  tl_policy *p = (tl_policy *)pp;
  tl_state *s = (tl_state *)it->state;
  pol_assert(s->item == it);
  if (s->pinned) {
    pol_assert(why == SGM_POLICY_REMOVE_DROP);
    s->pinned = 0;
    p->pinned_bytes -= it->size_bytes;
    p->pinned_n--;
    return;
  }
  tl_unlink(p, s);
  if (why == SGM_POLICY_REMOVE_PIN) {
    s->pinned = 1;
    p->pinned_bytes += it->size_bytes;
    p->pinned_n++;
  }
}

static uint64_t tl_reclaimable(const sgm_policy *pp) {
  const tl_policy *p = (const tl_policy *)pp;
  return p->seg_bytes[0] + p->seg_bytes[1] + p->seg_bytes[2];
}

static tl_state *tl_main_victim(tl_policy *p) {
  pol_node *t = pol_list_tail(&p->seg[TL_PROBATION]);
  if (!t) t = pol_list_tail(&p->seg[TL_PROTECTED]);
  return t ? tl_of(t) : NULL;
}

static sgm_policy_item *tl_next_victim(sgm_policy *pp, uint64_t want) {
  tl_policy *p = (tl_policy *)pp;
  tl_state *mv = tl_main_victim(p);
  pol_node *wn = pol_list_tail(&p->seg[TL_WINDOW]);
  if (!wn) return mv ? mv->item : NULL;
  tl_state *wv = tl_of(wn);
  if (!mv) return wv->item;
  uint64_t wt = tl_window_target(p);
  /* Room for a window newcomer: the window's LRU buffer must go somewhere. */
  if (want <= wt && p->seg_bytes[TL_WINDOW] + want > wt) {
    if (tl_estimate(p, wv->item->id) <= tl_estimate(p, mv->item->id)) return wv->item;
    tl_unlink(p, wv);
    tl_link(p, wv, TL_PROBATION, true); /* at the head: mv is still main's victim */
    return mv->item;
  }
  /* A newcomer for main (too big for the window, admitted by admit), or a
   * plain request: main gives. If the window is over its share (it shrank),
   * its tail duels first. */
  if (p->seg_bytes[TL_WINDOW] > wt && tl_estimate(p, wv->item->id) <= tl_estimate(p, mv->item->id))
    return wv->item;
  return mv->item;
}

static bool tl_admit(sgm_policy *pp, const sgm_policy_item *cand, const sgm_policy_item *victim) {
  tl_policy *p = (tl_policy *)pp;
  /* Window newcomers are always in: the window is where they prove themselves. */
  if (cand->size_bytes <= tl_window_target(p)) return true;
  return tl_estimate(p, cand->id) > tl_estimate(p, victim->id);
}

static sgm_status tl_check(const sgm_policy *pp, char *why, size_t len) {
  const tl_policy *p = (const tl_policy *)pp;
  static const char *const names[TL_SEGS] = {"window", "probation", "protected"};
  for (unsigned k = 0; k < TL_SEGS; k++) {
    size_t n;
    if (!pol_list_valid(&p->seg[k], &n)) return pol_fail(why, len, "tinylfu: broken %s links", names[k]);
    uint64_t bytes = 0;
    for (const pol_node *x = p->seg[k].next; x != &p->seg[k]; x = x->next) {
      const tl_state *s = (const tl_state *)(const void *)x;
      if (!s->item || s->item->state != s)
        return pol_fail(why, len, "tinylfu: a %s node's item does not own it", names[k]);
      if (s->seg != k || s->pinned)
        return pol_fail(why, len, "tinylfu: buffer %llu in %s says segment %u%s",
                        (unsigned long long)s->item->id, names[k], s->seg, s->pinned ? ", pinned" : "");
      bytes += s->item->size_bytes;
    }
    if (n != p->seg_n[k] || bytes != p->seg_bytes[k])
      return pol_fail(why, len, "tinylfu: %s holds %zu items of %llu bytes, counters say %llu of %llu",
                      names[k], n, (unsigned long long)bytes, (unsigned long long)p->seg_n[k],
                      (unsigned long long)p->seg_bytes[k]);
  }
  if (p->window_ppm > TL_PPM) return pol_fail(why, len, "tinylfu: window share %u ppm", p->window_ppm);
  if (!p->sk.rows || p->sk.log2_width < TL_MIN_LOG2_WIDTH || p->sk.log2_width > TL_MAX_LOG2_WIDTH)
    return pol_fail(why, len, "tinylfu: sketch of 2^%u counters", p->sk.log2_width);
  return SGM_OK;
}

const sgm_policy_ops sgm__policy_tinylfu = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "tinylfu",
    .summary = "W-TinyLFU: LRU window, frequency-sketch admission into a segmented LRU",
    .state_bytes = sizeof(tl_state),
    .create = tl_create,
    .destroy = tl_destroy,
    .on_insert = tl_insert,
    .on_access = tl_access,
    .on_remove = tl_remove,
    .reclaimable_bytes = tl_reclaimable,
    .next_victim = tl_next_victim,
    .check = tl_check,
    .record = tl_record,
    .admit = tl_admit,
};
