/*
 * test_node.c — the node registry and fair budgets (lib/node.c, lib/share.c)
 * with real processes: each case forks children that each run a context on
 * one shared emulated device (SGM_EMU_DEVICE) and obey commands over a pipe,
 * answering with their figures. Every wait is a blocking read of a reply or
 * a waitpid: no sleeps. Budgets are recomputed by explicit ticks
 * (sgm__share_tick_sync; the ticker's own period is set far away), so every
 * number is deterministic. Each case uses its own SGM_NODE_DIR.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "tiers/tier.h"
#include "internal.h"
#include "sgm.h"
#include "sgm/node.h"
#include "test_util.h"

#define MiB (UINT64_C(1) << 20)

static char node_dir[64];

/* A fresh registry directory and the environment every child inherits. */
static void setup_env(const char *device, const char *emu_vram) {
  sgm_test_clean_env();
  snprintf(node_dir, sizeof node_dir, "/tmp/sgm-node-test-XXXXXX");
  assert_non_null(mkdtemp(node_dir));
  setenv("SGM_NODE", "on", 1);
  setenv("SGM_NODE_DIR", node_dir, 1);
  setenv("SGM_EMU_DEVICE", device, 1);
  setenv("SGM_EMU_VRAM", emu_vram, 1);
  setenv("SGM_VRAM_FRACTION", "1", 1);
  setenv("SGM_GROWTH_CHUNK", "1MiB", 1);
  setenv("SGM_SHARED_CHUNK", "1MiB", 1);
  setenv("SGM_IDLE_TRIM_MS", "0", 1);     /* demand = use, no hold: exact numbers */
  setenv("SGM_NODE_PERIOD_MS", "10000", 1); /* ticks come from the test */
}

/* Remove the directory; true when it was empty but for the files named. */
static int count_files(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

static void teardown_dir(void) {
  DIR *d = opendir(node_dir);
  if (d) {
    struct dirent *e;
    char p[256];
    while ((e = readdir(d)) != NULL) {
      if (e->d_name[0] == '.') continue;
      snprintf(p, sizeof p, "%s/%.150s", node_dir, e->d_name);
      unlink(p);
    }
    closedir(d);
  }
  rmdir(node_dir);
}

/* ------------------------------------------------------------------------ */
/* Children obeying commands. */

enum { OP_CREATE = 1, OP_ALLOC, OP_BUFFER, OP_FREE_ALL, OP_TICK, OP_DIE_AT, OP_QUIT,
       /* the child's second context on the same device (one slot per process) */
       OP_CREATE2, OP_BUFFER2, OP_TICK2, OP_DESTROY2,
       /* fork a child that lives on (until killed); its pid in rsp.tier */
       OP_FORK_CHILD,
       /* the VRAM budget-exhausted message for arg bytes, in rsp.msg */
       OP_EXPLAIN };

typedef struct cmd {
  int op;
  uint64_t arg;
  char where[24];
} cmd;

enum { V_VRAM_USED, V_VRAM_BUDGET, V_SHARED_USED, V_SHARED_BUDGET, V_SLOT, V_TRACKED, V_EVICTIONS,
       V_DEVICE_FREE, V_N };

typedef struct rsp {
  int rc;       /* the command's status; -999 when the child is gone */
  int tier;     /* where an allocation or buffer landed */
  uint64_t v[V_N];  /* the first context's figures */
  uint64_t v2[V_N]; /* the second context's (OP_CREATE2 to OP_DESTROY2) */
  char msg[1024];   /* OP_EXPLAIN's message */
} rsp;

typedef struct kid {
  pid_t pid;
  int to, from;
} kid;

static char die_where[24];
static void die_hook(const char *where) {
  if (strcmp(where, die_where) == 0) raise(SIGKILL);
}

static void kid_figures(sgm_context *ctx, uint64_t *v) {
  if (!ctx) return;
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  v[V_VRAM_USED] = st.tier[SGM_TIER_VRAM].used_bytes;
  v[V_VRAM_BUDGET] = st.tier[SGM_TIER_VRAM].budget_bytes;
  v[V_SHARED_USED] = st.tier[SGM_TIER_SHARED].used_bytes;
  v[V_SHARED_BUDGET] = st.tier[SGM_TIER_SHARED].budget_bytes;
  v[V_EVICTIONS] = st.tier[SGM_TIER_VRAM].n_evictions;
  sgm_node *n = sgm__share_node(ctx);
  v[V_TRACKED] = n != NULL;
  v[V_SLOT] = n ? sgm__node_slot(n) : UINT64_MAX;
  uint64_t fr = 0, tot = 0;
  sgm__context_bops(ctx)->mem_info(sgm__context_be(ctx), &fr, &tot);
  v[V_DEVICE_FREE] = fr;
}

/* A buffer of bytes on ctx, kept in bufs (256 at most). */
static void kid_buffer(sgm_context *ctx, uint64_t bytes, sgm_buffer **bufs, size_t *n_bufs, rsp *r) {
  sgm_buffer *b = NULL;
  r->rc = sgm_buffer_create(ctx, bytes, &b);
  if (!b) return;
  r->tier = sgm_buffer_tier(b);
  if (*n_bufs < 256) bufs[(*n_bufs)++] = b;
}

static void kid_main(int in, int out) {
  sgm_context *ctx = NULL, *ctx2 = NULL;
  void *ptrs[256];
  size_t n_ptrs = 0;
  sgm_buffer *bufs[256], *bufs2[256];
  size_t n_bufs = 0, n_bufs2 = 0;
  cmd c;
  while (read(in, &c, sizeof c) == (ssize_t)sizeof c) {
    rsp r;
    memset(&r, 0, sizeof r);
    r.tier = -1;
    switch (c.op) {
      case OP_CREATE: r.rc = sgm_context_create(NULL, &ctx); break;
      case OP_ALLOC: {
        void *p = sgm_alloc(ctx, c.arg, NULL);
        r.rc = p ? 0 : -1;
        if (p) {
          r.tier = sgm_pointer_tier(ctx, p);
          if (n_ptrs < 256) ptrs[n_ptrs++] = p;
        }
        break;
      }
      case OP_BUFFER: kid_buffer(ctx, c.arg, bufs, &n_bufs, &r); break;
      case OP_FREE_ALL:
        while (n_ptrs) sgm_free(ctx, ptrs[--n_ptrs], NULL);
        while (n_bufs) sgm_buffer_destroy(bufs[--n_bufs]);
        r.rc = sgm_trim(ctx);
        break;
      case OP_TICK: r.rc = sgm__share_tick_sync(ctx) ? 0 : -1; break;
      case OP_DIE_AT:
        snprintf(die_where, sizeof die_where, "%s", c.where);
        sgm__node_test_hook = die_hook;
        break;
      case OP_CREATE2: r.rc = sgm_context_create(NULL, &ctx2); break;
      case OP_EXPLAIN:
        r.rc = sgm__tier_explain_budget(sgm__context_tier(ctx, SGM_TIER_VRAM), c.arg);
        snprintf(r.msg, sizeof r.msg, "%s", sgm_last_error());
        break;
      case OP_FORK_CHILD: {
        pid_t g = fork();
        if (g == 0)
          for (;;) pause(); /* lives on after its parent, as a DataLoader worker; the test kills it */
        r.tier = (int)g;
        break;
      }
      case OP_BUFFER2: kid_buffer(ctx2, c.arg, bufs2, &n_bufs2, &r); break;
      case OP_TICK2: r.rc = sgm__share_tick_sync(ctx2) ? 0 : -1; break;
      case OP_DESTROY2:
        while (n_bufs2) sgm_buffer_destroy(bufs2[--n_bufs2]);
        sgm_context_destroy(ctx2);
        ctx2 = NULL;
        break;
      case OP_QUIT:
        while (n_bufs) sgm_buffer_destroy(bufs[--n_bufs]);
        while (n_bufs2) sgm_buffer_destroy(bufs2[--n_bufs2]);
        sgm_context_destroy(ctx2);
        sgm_context_destroy(ctx);
        _exit(0);
    }
    kid_figures(ctx, r.v);
    kid_figures(ctx2, r.v2);
    if (write(out, &r, sizeof r) != (ssize_t)sizeof r) _exit(3);
  }
  _exit(0);
}

/* Fork a child; go: when >= 0, it first waits for one byte there (races). */
static kid kid_start_on(int go) {
  int a[2], b[2];
  assert_int_equal(pipe(a), 0);
  assert_int_equal(pipe(b), 0);
  kid k = {.pid = fork()};
  assert_true(k.pid >= 0);
  if (k.pid == 0) {
    close(a[1]);
    close(b[0]);
    if (go >= 0) {
      char x;
      if (read(go, &x, 1) != 1) _exit(4);
    }
    kid_main(a[0], b[1]);
  }
  close(a[0]);
  close(b[1]);
  k.to = a[1];
  k.from = b[0];
  return k;
}
static kid kid_start(void) { return kid_start_on(-1); }

/* Fork a child that drops root for uid, primary gid and one supplementary
 * group (as a lab user of the GPU group would run), then obeys commands. */
static kid kid_start_as(uid_t uid, gid_t gid, gid_t group) {
  int a[2], b[2];
  assert_int_equal(pipe(a), 0);
  assert_int_equal(pipe(b), 0);
  kid k = {.pid = fork()};
  assert_true(k.pid >= 0);
  if (k.pid == 0) {
    close(a[1]);
    close(b[0]);
    gid_t groups[1] = {group};
    if (setgroups(1, groups) != 0 || setgid(gid) != 0 || setuid(uid) != 0) _exit(6);
    sgm__admin_reset_for_tests(); /* the policy as this user finds it, not the parent's copy */
    kid_main(a[0], b[1]);
  }
  close(a[0]);
  close(b[1]);
  k.to = a[1];
  k.from = b[0];
  return k;
}


static rsp kid_do(kid *k, int op, uint64_t arg, const char *where) {
  cmd c = {.op = op, .arg = arg};
  if (where) snprintf(c.where, sizeof c.where, "%s", where);
  rsp r;
  memset(&r, 0, sizeof r);
  r.rc = -999;
  if (write(k->to, &c, sizeof c) != (ssize_t)sizeof c) return r;
  ssize_t n = read(k->from, &r, sizeof r);
  if (n != (ssize_t)sizeof r) r.rc = -999;
  return r;
}

/* Wait for the child's end; its wait status. */
static int kid_reap(kid *k) {
  int st = 0;
  close(k->to);
  close(k->from);
  assert_int_equal(waitpid(k->pid, &st, 0), k->pid);
  return st;
}

static void kid_quit(kid *k) {
  cmd c = {.op = OP_QUIT};
  assert_int_equal(write(k->to, &c, sizeof c), (ssize_t)sizeof c);
  int st = kid_reap(k);
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static void kid_kill(kid *k) {
  kill(k->pid, SIGKILL);
  int st = kid_reap(k);
  assert_true(WIFSIGNALED(st));
}

/* The registry as a reader sees it: this user's live records of key. */
static sgm_node_view *scan_key(const char *key) {
  char prefix[128];
  sgm__node_prefix(key, prefix, sizeof prefix);
  sgm_node_view *v = malloc(sizeof *v);
  assert_non_null(v);
  sgm_node_accept acc = {.gid = -1};
  assert_int_equal(sgm__node_scan(node_dir, prefix, key, &acc, false, v), SGM_OK);
  return v;
}

static size_t live_procs(const char *key) {
  sgm_node_view *v = scan_key(key);
  size_t n = v->n_procs;
  free(v);
  return n;
}

/* The live records a process holds (a reader's view) and their published
 * VRAM use, summed. */
static size_t slots_of(const char *key, pid_t pid, uint64_t *vram_used) {
  sgm_node_view *v = scan_key(key);
  size_t n = 0;
  *vram_used = 0;
  for (size_t i = 0; i < v->n_procs; i++) {
    if (v->procs[i].pid != pid) continue;
    n++;
    *vram_used += v->procs[i].u.w[SGM_NODE_F_USED + SGM_TIER_VRAM];
  }
  free(v);
  return n;
}

/* ------------------------------------------------------------------------ */
/* The split itself. */

/* Invariants of sgm__share_fair: never more than the total in all, never
 * more than a cap, reservations honoured, one process = the whole pool,
 * idle shares lent, weights respected. */
static void test_fair_split(void **state) {
  (void)state;
  uint64_t out[4];
  const uint64_t T = 1024 * MiB, NONE = UINT64_MAX;
  sgm_share_claim one[] = {{0, 10 * MiB, NONE, 1}};
  sgm__share_fair(T, one, 1, out);
  assert_int_equal(out[0], T); /* alone: today's behaviour */

  sgm_share_claim busy[] = {{0, T, NONE, 1}, {0, T, NONE, 1}};
  sgm__share_fair(T, busy, 2, out);
  assert_int_equal(out[0], T / 2);
  assert_int_equal(out[1], T / 2);

  sgm_share_claim lend[] = {{0, T, NONE, 1}, {0, 100 * MiB, NONE, 1}};
  sgm__share_fair(T, lend, 2, out);
  assert_int_equal(out[1], 100 * MiB); /* the idle one keeps its demand */
  assert_int_equal(out[0], T - 100 * MiB); /* the rest is lent to the busy one */

  sgm_share_claim reserve[] = {{600 * MiB, 0, NONE, 1}, {0, T, NONE, 1}};
  sgm__share_fair(T, reserve, 2, out);
  assert_true(out[0] >= 600 * MiB);
  assert_true(out[0] + out[1] <= T);

  sgm_share_claim capped[] = {{0, T, 100 * MiB, 1}, {0, T, NONE, 1}};
  sgm__share_fair(T, capped, 2, out);
  assert_int_equal(out[0], 100 * MiB);
  assert_int_equal(out[1], T - 100 * MiB);

  sgm_share_claim weighted[] = {{0, T, NONE, 3}, {0, T, NONE, 1}};
  sgm__share_fair(T, weighted, 2, out);
  assert_int_equal(out[0], T / 4 * 3);
  assert_int_equal(out[1], T / 4);

  sgm_share_claim over[] = {{T, T, NONE, 1}, {T, T, NONE, 1}};
  sgm__share_fair(T, over, 2, out);
  assert_true(out[0] + out[1] <= T);
  assert_int_equal(out[0], T / 2);

  /* Random claims: the sum never passes the total, no cap is passed. */
  uint64_t seed = sgm_test_seed("test_node.fair", 13);
  sgm_test_rng r;
  sgm_test_rng_init(&r, seed);
  for (int it = 0; it < 2000; it++) {
    sgm_share_claim c[4];
    size_t n = (size_t)sgm_test_rng_range(&r, 1, 4);
    for (size_t j = 0; j < n; j++) {
      c[j].reserve_bytes = sgm_test_rng_range(&r, 0, 3) ? 0 : sgm_test_rng_range(&r, 0, T);
      c[j].demand_bytes = sgm_test_rng_range(&r, 0, 2 * T);
      c[j].cap_bytes = sgm_test_rng_range(&r, 0, 1) ? NONE : sgm_test_rng_range(&r, 256, 2 * T);
      c[j].weight = (uint32_t)sgm_test_rng_range(&r, 1, 5);
    }
    sgm__share_fair(T, c, n, out);
    uint64_t sum = 0;
    for (size_t j = 0; j < n; j++) {
      sum += out[j];
      assert_true(out[j] >= 256);
      if (c[j].cap_bytes >= 256) assert_true(out[j] <= c[j].cap_bytes);
    }
    assert_true(sum <= T + n * 256);
  }
}

/* ------------------------------------------------------------------------ */
/* Processes. */

/* Eight processes racing to join get eight distinct slots, all visible;
 * when the last one leaves, the registry file is gone. */
static void test_eight_race_to_join(void **state) {
  (void)state;
  setup_env("race", "64MiB");
  int go[2];
  assert_int_equal(pipe(go), 0);
  kid k[8];
  for (int i = 0; i < 8; i++) k[i] = kid_start_on(go[0]);
  assert_int_equal(write(go[1], "xxxxxxxx", 8), 8); /* all at once */
  rsp r[8];
  for (int i = 0; i < 8; i++) {
    cmd c = {.op = OP_CREATE};
    assert_int_equal(write(k[i].to, &c, sizeof c), (ssize_t)sizeof c);
  }
  for (int i = 0; i < 8; i++) {
    assert_int_equal(read(k[i].from, &r[i], sizeof r[i]), (ssize_t)sizeof r[i]);
    assert_int_equal(r[i].rc, SGM_OK);
    assert_int_equal(r[i].v[V_TRACKED], 1);
    for (int j = 0; j < i; j++) assert_int_not_equal(r[i].v[V_SLOT], r[j].v[V_SLOT]); /* a record each */
  }
  assert_int_equal(live_procs("emu-race"), 8);
  for (int i = 0; i < 8; i++) kid_quit(&k[i]);
  close(go[0]);
  close(go[1]);
  assert_int_equal(count_files(node_dir), 0);
  teardown_dir();
}

/* Budgets follow joins and leaves: alone a process gets the whole device;
 * when a second one needs memory, the first one's budget drops within one
 * tick, it demotes released buffers until it fits (TrimToBudget), and the
 * second's allocation past its budget fell back instead of failing; when
 * the second leaves, the first gets the whole device back. */
static void test_budgets_follow_join_and_leave(void **state) {
  (void)state;
  setup_env("fair", "64MiB");
  kid a = kid_start();
  rsp r = kid_do(&a, OP_CREATE, 0, NULL);
  assert_int_equal(r.rc, SGM_OK);
  r = kid_do(&a, OP_TICK, 0, NULL);
  assert_int_equal(r.v[V_VRAM_BUDGET], 64 * MiB); /* alone: the whole device */
  for (int i = 0; i < 12; i++) {
    r = kid_do(&a, OP_BUFFER, 4 * MiB, NULL);
    assert_int_equal(r.rc, SGM_OK);
    assert_int_equal(r.tier, SGM_TIER_VRAM);
  }
  r = kid_do(&a, OP_TICK, 0, NULL);
  assert_int_equal(r.v[V_VRAM_USED], 48 * MiB);

  kid b = kid_start();
  rsp rb = kid_do(&b, OP_CREATE, 0, NULL);
  assert_int_equal(rb.rc, SGM_OK);
  assert_true(rb.v[V_VRAM_BUDGET] < 24 * MiB); /* A is busy, B idle: A keeps most */
  rb = kid_do(&b, OP_ALLOC, 24 * MiB, NULL);
  assert_int_equal(rb.rc, 0); /* over budget: fallback, not failure */
  assert_int_equal(rb.tier, SGM_TIER_SHARED);
  rb = kid_do(&b, OP_TICK, 0, NULL); /* B's demand (24 MiB + 1/8) is now published */
  assert_true(rb.v[V_VRAM_BUDGET] >= 24 * MiB);
  r = kid_do(&a, OP_TICK, 0, NULL); /* A: budget down, buffers demoted */
  print_message("# A budget %llu used %llu evictions %llu; B budget %llu\n",
                (unsigned long long)r.v[V_VRAM_BUDGET], (unsigned long long)r.v[V_VRAM_USED],
                (unsigned long long)r.v[V_EVICTIONS], (unsigned long long)rb.v[V_VRAM_BUDGET]);
  assert_true(r.v[V_VRAM_BUDGET] + rb.v[V_VRAM_BUDGET] <= 64 * MiB);
  assert_true(r.v[V_VRAM_USED] <= r.v[V_VRAM_BUDGET]);
  assert_true(r.v[V_EVICTIONS] > 0);
  assert_true(r.v[V_SHARED_USED] > 0);
  /* B allocates within its new budget: VRAM, now that A made room. */
  rb = kid_do(&b, OP_ALLOC, 8 * MiB, NULL);
  assert_int_equal(rb.tier, SGM_TIER_VRAM);

  /* The node's shared-memory cap (half of RAM) is split the same way. */
  uint64_t ram = sgm__host_physical_ram("");
  uint64_t cap = ram / 2 > 64 * MiB ? ram / 2 : 64 * MiB;
  r = kid_do(&a, OP_TICK, 0, NULL);
  rb = kid_do(&b, OP_TICK, 0, NULL);
  print_message("# shared budgets %llu + %llu of %llu\n", (unsigned long long)r.v[V_SHARED_BUDGET],
                (unsigned long long)rb.v[V_SHARED_BUDGET], (unsigned long long)cap);
  assert_true(r.v[V_SHARED_BUDGET] < cap && rb.v[V_SHARED_BUDGET] < cap);
  assert_true(r.v[V_SHARED_BUDGET] + rb.v[V_SHARED_BUDGET] <= cap);
  assert_true(rb.v[V_SHARED_BUDGET] >= rb.v[V_SHARED_USED]);

  kid_quit(&b);
  r = kid_do(&a, OP_TICK, 0, NULL);
  assert_int_equal(r.v[V_VRAM_BUDGET], 64 * MiB); /* alone again */
  assert_true(r.v[V_SHARED_BUDGET] >= (cap & ~(uint64_t)255) - 256); /* the whole cap again */
  kid_quit(&a);
  teardown_dir();
}

/* Quotas come on top of fair shares: SGM_VRAM_LIMIT caps its process, and
 * what it cannot take is lent to the other one. */
static void test_quota_on_top(void **state) {
  (void)state;
  setup_env("quota", "64MiB");
  setenv("SGM_VRAM_LIMIT", "8MiB", 1);
  kid a = kid_start();
  unsetenv("SGM_VRAM_LIMIT");
  setenv("CUDA_DEVICE_MEMORY_LIMIT", "40m", 1); /* HAMi's cap, the other one's */
  kid b = kid_start();
  unsetenv("CUDA_DEVICE_MEMORY_LIMIT");
  assert_int_equal(kid_do(&a, OP_CREATE, 0, NULL).rc, SGM_OK);
  assert_int_equal(kid_do(&b, OP_CREATE, 0, NULL).rc, SGM_OK);
  kid_do(&a, OP_ALLOC, 6 * MiB, NULL);
  rsp rb = kid_do(&b, OP_ALLOC, 30 * MiB, NULL);
  assert_int_equal(rb.rc, 0);
  rsp r = kid_do(&a, OP_TICK, 0, NULL);
  rb = kid_do(&b, OP_TICK, 0, NULL);
  assert_true(r.v[V_VRAM_BUDGET] <= 8 * MiB);
  assert_int_equal(rb.v[V_VRAM_BUDGET], 40 * MiB);
  /* Past its quota, A falls back. */
  r = kid_do(&a, OP_ALLOC, 4 * MiB, NULL);
  assert_int_equal(r.rc, 0);
  assert_int_equal(r.tier, SGM_TIER_SHARED);
  kid_quit(&a);
  kid_quit(&b);
  teardown_dir();
}

/* SGM_VRAM_RESERVE: a reserved process keeps its minimum even while another
 * one wants the whole device. */
static void test_reserve(void **state) {
  (void)state;
  setup_env("reserve", "64MiB");
  setenv("SGM_VRAM_RESERVE", "40MiB", 1);
  kid a = kid_start();
  unsetenv("SGM_VRAM_RESERVE");
  kid b = kid_start();
  assert_int_equal(kid_do(&a, OP_CREATE, 0, NULL).rc, SGM_OK);
  assert_int_equal(kid_do(&b, OP_CREATE, 0, NULL).rc, SGM_OK);
  for (int i = 0; i < 6; i++) kid_do(&b, OP_ALLOC, 8 * MiB, NULL);
  rsp rb = kid_do(&b, OP_TICK, 0, NULL);
  rsp r = kid_do(&a, OP_TICK, 0, NULL);
  assert_true(r.v[V_VRAM_BUDGET] >= 40 * MiB);
  assert_true(rb.v[V_VRAM_BUDGET] <= 24 * MiB);
  kid_quit(&a);
  kid_quit(&b);
  teardown_dir();
}

/* The emulated device is one device for every process that names it: full
 * because of another process, an allocation falls back; when that one frees
 * and trims, the device has room again. */
static void test_emu_device_shared(void **state) {
  (void)state;
  setup_env("shared-emu", "16MiB");
  setenv("SGM_SHARE_MODE", "solo", 1); /* capacity only: budgets as if alone */
  kid a = kid_start(), b = kid_start();
  assert_int_equal(kid_do(&a, OP_CREATE, 0, NULL).rc, SGM_OK);
  assert_int_equal(kid_do(&b, OP_CREATE, 0, NULL).rc, SGM_OK);
  rsp r = kid_do(&a, OP_ALLOC, 12 * MiB, NULL);
  assert_int_equal(r.tier, SGM_TIER_VRAM);
  rsp rb = kid_do(&b, OP_ALLOC, 8 * MiB, NULL);
  assert_int_equal(rb.rc, 0);
  assert_int_equal(rb.tier, SGM_TIER_SHARED); /* the device is full because of A */
  assert_true(rb.v[V_DEVICE_FREE] < 8 * MiB);
  kid_do(&a, OP_FREE_ALL, 0, NULL);
  rb = kid_do(&b, OP_ALLOC, 8 * MiB, NULL);
  assert_int_equal(rb.tier, SGM_TIER_VRAM);
  kid_quit(&a);
  kid_quit(&b);
  teardown_dir();
}

/* SIGKILL outside the critical section: the others go on, the dead one's
 * slot and its device memory are reclaimed by the next tick. */
static void test_sigkill_reclaims(void **state) {
  (void)state;
  setup_env("kill", "16MiB");
  setenv("SGM_SHARE_MODE", "solo", 1);
  kid a = kid_start(), b = kid_start();
  assert_int_equal(kid_do(&a, OP_CREATE, 0, NULL).rc, SGM_OK);
  assert_int_equal(kid_do(&b, OP_CREATE, 0, NULL).rc, SGM_OK);
  assert_int_equal(kid_do(&b, OP_ALLOC, 12 * MiB, NULL).tier, SGM_TIER_VRAM);
  assert_int_equal(live_procs("emu-kill"), 2);
  kid_kill(&b);
  rsp r = kid_do(&a, OP_TICK, 0, NULL);
  assert_int_equal(r.rc, 0);
  assert_int_equal(live_procs("emu-kill"), 1);
  assert_int_equal(r.v[V_DEVICE_FREE], 16 * MiB); /* B's 12 MiB came back */
  r = kid_do(&a, OP_ALLOC, 12 * MiB, NULL);
  assert_int_equal(r.tier, SGM_TIER_VRAM);
  kid_quit(&a);
  teardown_dir();
}

/* SIGKILL anywhere in joining, reserving or leaving: nobody blocks (there
 * is no lock shared between processes), the dead one's device bytes come
 * back, its leftovers are unlinked by the next joiner of the same user, and
 * a new process joins. */
static void test_sigkill_inside_critical_section(void **state) {
  (void)state;
  static const char *const wheres[] = {"join-locked", "join-writing", "reserve-locked",
                                       "leave-locked"};
  for (size_t w = 0; w < sizeof wheres / sizeof wheres[0]; w++) {
    setup_env("crit", "16MiB");
    setenv("SGM_SHARE_MODE", "solo", 1);
    kid a = kid_start(), b = kid_start();
    assert_int_equal(kid_do(&a, OP_CREATE, 0, NULL).rc, SGM_OK);
    bool joined_first = strcmp(wheres[w], "join-locked") != 0 && strcmp(wheres[w], "join-writing") != 0;
    if (joined_first) assert_int_equal(kid_do(&b, OP_CREATE, 0, NULL).rc, SGM_OK);
    kid_do(&b, OP_DIE_AT, 0, wheres[w]);
    rsp rb;
    if (!joined_first) rb = kid_do(&b, OP_CREATE, 0, NULL);
    else if (strcmp(wheres[w], "reserve-locked") == 0) rb = kid_do(&b, OP_ALLOC, 4 * MiB, NULL);
    else {
      cmd c = {.op = OP_QUIT};
      assert_int_equal(write(b.to, &c, sizeof c), (ssize_t)sizeof c);
      rb.rc = -999;
    }
    assert_int_equal(rb.rc, -999); /* it died there */
    int st = kid_reap(&b);
    assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    print_message("# died at %s\n", wheres[w]);
    rsp r = kid_do(&a, OP_TICK, 0, NULL);
    assert_int_equal(r.rc, 0);
    assert_int_equal(r.v[V_DEVICE_FREE], 16 * MiB);
    assert_int_equal(live_procs("emu-crit"), 1);
    kid c = kid_start();
    rsp rc = kid_do(&c, OP_CREATE, 0, NULL);
    assert_int_equal(rc.rc, SGM_OK);
    assert_int_equal(rc.v[V_TRACKED], 1);
    assert_int_equal(live_procs("emu-crit"), 2);
    kid_quit(&c);
    kid_quit(&a);
    if (strcmp(wheres[w], "join-writing") != 0) /* a dead .tmp waits out its grace period */
      assert_int_equal(count_files(node_dir), 0);
    teardown_dir();
  }
}

/* A record whose pid is alive (ours: as a reused pid would be) but whose
 * liveness lock nobody holds is dead: it is not counted, and this user's
 * next process unlinks it. Pids are shown, never trusted. */
static void test_pid_reuse_not_trusted(void **state) {
  (void)state;
  setup_env("pid", "16MiB");
  sgm_node_params p = {.dir = node_dir, .key = "emu-pid", .name = "me", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB};
  sgm_node *n = NULL;
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  /* Forge: a copy of our live record under another record name, lock-less. */
  unsigned char rec[SGM_NODE_RECORD_BYTES];
  int fd = open(sgm__node_file(n), O_RDONLY);
  assert_int_equal(read(fd, rec, sizeof rec), (ssize_t)sizeof rec);
  close(fd);
  char forged[300];
  snprintf(forged, sizeof forged, "%s/sgm-node-emu-pid@%d-forged", node_dir, (int)getpid());
  fd = open(forged, O_WRONLY | O_CREAT | O_EXCL, 0600);
  assert_int_equal(write(fd, rec, sizeof rec), (ssize_t)sizeof rec);
  close(fd);
  char prefix[64];
  sgm__node_prefix("emu-pid", prefix, sizeof prefix);
  sgm_node_view *v = malloc(sizeof *v);
  assert_non_null(v);
  sgm_node_accept acc = {.gid = -1};
  assert_int_equal(sgm__node_scan(node_dir, prefix, "emu-pid", &acc, true, v), SGM_OK);
  assert_int_equal(v->n_procs, 2); /* with the dead: the forgery is there */
  assert_int_equal(v->procs[0].pid, getpid());
  assert_int_equal(v->procs[1].pid, getpid());
  assert_int_equal(sgm__node_view(n, v), SGM_OK);
  assert_int_equal(v->n_procs, 1); /* a live pid does not make a live record */
  assert_true(v->procs[0].self);
  assert_int_equal(sgm__node_reclaim(n), 1);
  assert_int_equal(access(forged, F_OK), -1);
  free(v);
  sgm__node_leave(n);
  assert_int_equal(count_files(node_dir), 0);
  teardown_dir();
}

/* A live hostile record: a file of ours at a record's name whose write lock
 * this test holds (as its hostile writer would), so that only its bytes can
 * keep it out. */
static int hostile_record(const char *key, const char *tag, const void *data, size_t len, mode_t mode) {
  char path[300], prefix[64];
  sgm__node_prefix(key, prefix, sizeof prefix);
  snprintf(path, sizeof path, "%s/%s%s", node_dir, prefix, tag);
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, mode);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, data, len), (ssize_t)len);
  assert_int_equal(fchmod(fd, mode), 0);
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
  assert_int_equal(fcntl(fd, F_OFD_SETLK, &fl), 0);
  return fd;
}

/* Garbage in every byte of a live record, a truncated one, one that
 * others may write, a FIFO, a symbolic link and a device node at records'
 * names, and 64 junk names that sort first: none hangs, crashes or opts
 * anyone out. The good processes stay tracked and see each other; readers
 * (sgm_node_list / sgm_node_read, what sgm-smi runs) list the registry and
 * count the rest as refused. Each hostile byte is checked on its own: the
 * record as it was but for one byte, at all 1024 offsets. */
static void test_hostile_records(void **state) {
  (void)state;
  setup_env("host", "16MiB");
  alarm(60); /* a hang fails the test rather than the suite's timeout */
  kid a = kid_start();
  rsp r = kid_do(&a, OP_CREATE, 0, NULL);
  assert_int_equal(r.rc, SGM_OK);
  assert_int_equal(r.v[V_TRACKED], 1);
  /* A good record to mutate: the kid's. */
  char prefix[64];
  sgm__node_prefix("emu-host", prefix, sizeof prefix);
  unsigned char good[SGM_NODE_RECORD_BYTES];
  {
    DIR *d = opendir(node_dir);
    struct dirent *e;
    bool found = false;
    while ((e = readdir(d)) != NULL && !found) {
      if (strncmp(e->d_name, prefix, strlen(prefix)) != 0) continue;
      char p[300];
      snprintf(p, sizeof p, "%s/%.200s", node_dir, e->d_name);
      int fd = open(p, O_RDONLY);
      found = read(fd, good, sizeof good) == (ssize_t)sizeof good;
      close(fd);
    }
    closedir(d);
    assert_true(found);
  }
  /* Hostile names (a reader must not open them, or not block in them). */
  char path[300];
  snprintf(path, sizeof path, "%s/%sfifo", node_dir, prefix);
  assert_int_equal(mkfifo(path, 0600), 0);
  snprintf(path, sizeof path, "%s/sgm-node-emu-host", node_dir); /* the old layout's name */
  assert_int_equal(mkfifo(path, 0600), 0);
  snprintf(path, sizeof path, "%s/%slink", node_dir, prefix);
  assert_int_equal(symlink("/dev/zero", path), 0);
  for (int i = 0; i < 64; i++) {
    snprintf(path, sizeof path, "%s/sgm-node-%02d-junk@x", node_dir, i);
    int fd = open(path, O_WRONLY | O_CREAT, 0600);
    assert_true(fd >= 0);
    close(fd);
  }
  int trunc_fd = hostile_record("emu-host", "trunc", good, 100, 0600);
  int wide_fd = hostile_record("emu-host", "wide", good, sizeof good, 0666);
  int fd = hostile_record("emu-host", "garbage", good, sizeof good, 0600);
  unsigned seed = (unsigned)time(NULL);
  print_message("# seed %u\n", seed);
  srand(seed);
  sgm_node_view *v = malloc(sizeof *v);
  assert_non_null(v);
  sgm_node_accept acc = {.gid = -1};
  size_t counted_garbage = 0;
  for (size_t off = 0; off < sizeof good; off++) {
    unsigned char bad[SGM_NODE_RECORD_BYTES];
    memcpy(bad, good, sizeof bad);
    bad[off] = (unsigned char)(bad[off] ^ (1 + rand() % 255));
    assert_int_equal(pwrite(fd, bad, sizeof bad, 0), (ssize_t)sizeof bad);
    assert_int_equal(sgm__node_scan(node_dir, prefix, "emu-host", &acc, false, v), SGM_OK);
    bool kid_seen = false;
    for (size_t i = 0; i < v->n_procs; i++) {
      kid_seen |= v->procs[i].pid == a.pid && v->procs[i].ino != 0 && v->procs[i].alive;
      for (const char *c = v->procs[i].name; *c; c++) assert_true(*c > 0x20 && *c < 0x7f);
    }
    assert_true(kid_seen);
    counted_garbage += v->n_procs - 1;
    assert_true(v->n_refused >= 3); /* trunc, wide, fifo/link (never opened) */
  }
  /* Most flips are caught (check word, magic, sizes); those in the published
   * figures are a live record's own business: counted, bounded by the split. */
  print_message("# %zu of %zu one-byte corruptions still parse as a record\n", counted_garbage, sizeof good);
  /* Truncated to nothing under a reader: no SIGBUS (records are read, not mapped). */
  assert_int_equal(ftruncate(fd, 0), 0);
  r = kid_do(&a, OP_TICK, 0, NULL);
  assert_int_equal(r.rc, 0);
  assert_int_equal(r.v[V_TRACKED], 1);
  /* A second process joins, tracked, and both see each other. */
  kid b = kid_start();
  r = kid_do(&b, OP_CREATE, 0, NULL);
  assert_int_equal(r.rc, SGM_OK);
  assert_int_equal(r.v[V_TRACKED], 1);
  assert_int_equal(live_procs("emu-host"), 2);
  /* The public reader: the registry is listed (junk is not), read, refused names counted. */
  sgm_node_entry e[4];
  size_t n = 0;
  assert_int_equal(sgm_node_list(node_dir, e, 4, &n), SGM_OK);
  assert_int_equal(n, 1);
  sgm_node_device dev = {.struct_size = sizeof dev};
  sgm_node_process procs[4];
  procs[0].struct_size = sizeof procs[0];
  assert_int_equal(sgm_node_read(e[0].path, 0, &dev, procs, 4), SGM_OK);
  assert_int_equal(dev.n_processes, 2);
  assert_true(dev.n_refused >= 3);
  free(v);
  close(fd);
  close(trunc_fd);
  close(wide_fd);
  kid_quit(&b);
  kid_quit(&a);
  alarm(0);
  teardown_dir();
}

/* A full registry folder (a container's 64 MiB /dev/shm filled by data
 * loaders; here a 16 KiB tmpfs, full): the join fails with a message that
 * says the folder is full and what to do, nothing is left behind, and a
 * context runs untracked (no SIGBUS). Needs a mount of its own (a mount
 * namespace, root): skipped with a message otherwise. */
static void full_folder_child(void *arg) {
  (void)arg;
  if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
      mount("tmpfs", node_dir, "tmpfs", 0, "size=16k,mode=1777") != 0)
    _exit(77);
  char p[300];
  snprintf(p, sizeof p, "%s/filler", node_dir);
  int fd = open(p, O_WRONLY | O_CREAT, 0600);
  char block[4096] = {0};
  while (write(fd, block, sizeof block) > 0) {
  }
  close(fd);
  sgm_node_params np = {.dir = node_dir, .key = "emu-fullfs", .name = "t", .device_total_bytes = 16 * MiB,
                        .shared_cap_bytes = 64 * MiB};
  sgm_node *n = NULL;
  int rc = sgm__node_join(&np, &n);
  printf("join: %d: %s\n", rc, sgm_last_error());
  if (rc == SGM_OK || !strstr(sgm_last_error(), "full") || !strstr(sgm_last_error(), "--shm-size")) _exit(3);
  if (count_files(node_dir) != 1) _exit(4); /* the filler alone: no .tmp left */
  sgm_context *ctx = NULL;
  if (sgm_context_create(NULL, &ctx) != SGM_OK) _exit(5);
  if (sgm__share_node(ctx) != NULL) _exit(6); /* untracked */
  void *q = sgm_alloc(ctx, MiB, NULL);
  if (!q) _exit(7);
  sgm_free(ctx, q, NULL);
  sgm_context_destroy(ctx);
  if (count_files(node_dir) != 1) _exit(8);
  _exit(0);
}

static void test_full_folder(void **state) {
  (void)state;
  setup_env("fullfs", "16MiB");
  char out[2048];
  int st = sgm_test_fork_capture(full_folder_child, NULL, out, sizeof out);
  print_message("# %s", out);
  assert_true(WIFEXITED(st));
  if (WEXITSTATUS(st) == 77) {
    print_message("# cannot mount a small tmpfs here (needs root and a mount namespace): skipped\n");
    teardown_dir();
    skip();
  }
  assert_int_equal(WEXITSTATUS(st), 0);
  teardown_dir();
}

/* A killed parent with a live fork child is dead at once: the child holds
 * neither the record's mapping (MADV_DONTFORK) nor its descriptor, so the
 * liveness lock goes with the parent. Readers see it gone within one
 * second (polled every 10 ms; it is at once in practice). */
static void test_fork_child_does_not_keep_parent(void **state) {
  (void)state;
  setup_env("forkkid", "16MiB");
  kid a = kid_start();
  assert_int_equal(kid_do(&a, OP_CREATE, 0, NULL).rc, SGM_OK);
  rsp r = kid_do(&a, OP_FORK_CHILD, 0, NULL);
  pid_t grandchild = (pid_t)r.tier;
  assert_true(grandchild > 0);
  assert_int_equal(live_procs("emu-forkkid"), 1);
  uint64_t t0 = sgm__clock_monotonic_ns();
  kid_kill(&a);
  uint64_t waited = 0;
  while (live_procs("emu-forkkid") != 0 && (waited = sgm__clock_monotonic_ns() - t0) < UINT64_C(1000000000)) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  print_message("# parent gone from the registry %.1f ms after SIGKILL, its child alive\n", (double)waited / 1e6);
  int child_alive = kill(grandchild, 0) == 0;
  size_t left = live_procs("emu-forkkid");
  kill(grandchild, SIGKILL); /* before asserting: an orphan must not outlive a failed test */
  assert_true(child_alive);
  assert_int_equal(left, 0);
  teardown_dir();
}

/* The folder must not let others remove our record: one writable by others
 * without the sticky bit is refused (untracked, with what to do). A record
 * writable by others is not counted. */
static void test_unsafe_folder_and_records(void **state) {
  (void)state;
  setup_env("unsafe", "16MiB");
  sgm_node_params p = {.dir = node_dir, .key = "emu-unsafe", .name = "t", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB};
  sgm_node *n = NULL;
  assert_int_equal(chmod(node_dir, 0777), 0);
  sgm__node_reset_warning();
  assert_int_not_equal(sgm__node_join(&p, &n), SGM_OK);
  print_message("# %s\n", sgm_last_error());
  assert_non_null(strstr(sgm_last_error(), "sticky"));
  assert_int_equal(chmod(node_dir, 01777), 0);
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  assert_int_equal(live_procs("emu-unsafe"), 1);
  assert_int_equal(chmod(sgm__node_file(n), 0620), 0); /* group-writable: anyone there could scribble */
  assert_int_equal(live_procs("emu-unsafe"), 0);
  assert_int_equal(chmod(sgm__node_file(n), 0600), 0);
  assert_int_equal(live_procs("emu-unsafe"), 1);
  sgm__node_leave(n);
  assert_int_equal(chmod(node_dir, 0700), 0);
  teardown_dir();
}

/* Too many processes: the next one runs untracked, never fails. */
static void test_full_table_untracked(void **state) {
  (void)state;
  setup_env("full", "16MiB");
  sgm_node_params p = {.dir = node_dir, .key = "emu-full", .name = "t", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB, .n_slots = 2};
  sgm_node *n1 = NULL, *n2 = NULL, *n3 = NULL;
  assert_int_equal(sgm__node_join(&p, &n1), SGM_OK);
  assert_int_equal(sgm__node_join(&p, &n2), SGM_OK);
  assert_int_equal(sgm__node_join(&p, &n3), SGM_ERR_BUSY);
  assert_non_null(strstr(sgm_last_error(), "the most is 2"));
  sgm__node_leave(n2);
  assert_int_equal(sgm__node_join(&p, &n3), SGM_OK); /* room again */
  sgm__node_leave(n3);
  sgm__node_leave(n1);
  teardown_dir();
}

/* One slot per process: two contexts of one process on one device share
 * one slot that publishes the sum of their use; the fair split counts the
 * process once (against another process it gets what one process gets,
 * then its part is split between its contexts by the same rule); the slot
 * stays while one context does and goes with the last. */
static void test_one_slot_per_process(void **state) {
  (void)state;
  setup_env("one", "64MiB");
  kid a = kid_start();
  assert_int_equal(kid_do(&a, OP_CREATE, 0, NULL).rc, SGM_OK);
  rsp r = kid_do(&a, OP_CREATE2, 0, NULL);
  assert_int_equal(r.rc, SGM_OK);
  assert_int_equal(r.v[V_TRACKED], 1);
  assert_int_equal(r.v2[V_TRACKED], 1);
  assert_int_equal(r.v[V_SLOT], r.v2[V_SLOT]); /* one slot */
  assert_int_equal(live_procs("emu-one"), 1);
  assert_int_equal(kid_do(&a, OP_BUFFER, 8 * MiB, NULL).tier, SGM_TIER_VRAM);
  assert_int_equal(kid_do(&a, OP_BUFFER2, 4 * MiB, NULL).tier, SGM_TIER_VRAM);
  kid_do(&a, OP_TICK, 0, NULL);
  kid_do(&a, OP_TICK2, 0, NULL);
  uint64_t used = 0;
  assert_int_equal(slots_of("emu-one", a.pid, &used), 1);
  assert_int_equal(used, 12 * MiB); /* the sum of both contexts' use */

  /* B needs 24 MiB. Demands (use + a 1 MiB chunk, or an eighth): A's process
   * 9 + 5 = 14 MiB, B 24 + 3 = 27 MiB; the 23 MiB nobody wants is lent half
   * and half (two processes, weight 1 each): B 38.5 MiB, A 25.5 MiB, split in
   * A as 9 + 5.75 and 5 + 5.75. (Counted as two processes, A's contexts would
   * take two thirds of the 23 MiB and B only 34.67 MiB.) */
  kid b = kid_start();
  assert_int_equal(kid_do(&b, OP_CREATE, 0, NULL).rc, SGM_OK);
  assert_int_equal(kid_do(&b, OP_ALLOC, 24 * MiB, NULL).rc, 0);
  rsp rb = kid_do(&b, OP_TICK, 0, NULL);
  kid_do(&a, OP_TICK, 0, NULL);
  r = kid_do(&a, OP_TICK2, 0, NULL);
  print_message("# B %llu, A %llu + %llu (MiB/256: %.2f, %.2f + %.2f)\n",
                (unsigned long long)rb.v[V_VRAM_BUDGET], (unsigned long long)r.v[V_VRAM_BUDGET],
                (unsigned long long)r.v2[V_VRAM_BUDGET], (double)rb.v[V_VRAM_BUDGET] / MiB,
                (double)r.v[V_VRAM_BUDGET] / MiB, (double)r.v2[V_VRAM_BUDGET] / MiB);
  uint64_t slack = 4096; /* alignment and long-double rounding */
  assert_true(rb.v[V_VRAM_BUDGET] + slack >= 77 * MiB / 2 && rb.v[V_VRAM_BUDGET] <= 77 * MiB / 2);
  assert_true(r.v[V_VRAM_BUDGET] + slack >= 59 * MiB / 4 && r.v[V_VRAM_BUDGET] <= 59 * MiB / 4);
  assert_true(r.v2[V_VRAM_BUDGET] + slack >= 43 * MiB / 4 && r.v2[V_VRAM_BUDGET] <= 43 * MiB / 4);
  assert_true(rb.v[V_VRAM_BUDGET] + r.v[V_VRAM_BUDGET] + r.v2[V_VRAM_BUDGET] <= 64 * MiB);

  /* The second context goes: the slot stays, with the first one's use alone. */
  r = kid_do(&a, OP_DESTROY2, 0, NULL);
  assert_int_equal(r.v[V_TRACKED], 1);
  assert_int_equal(slots_of("emu-one", a.pid, &used), 1);
  assert_int_equal(used, 8 * MiB);
  kid_quit(&a); /* the last context: the slot goes */
  assert_int_equal(slots_of("emu-one", a.pid, &used), 0);
  assert_int_equal(live_procs("emu-one"), 1);
  kid_quit(&b);
  assert_int_equal(count_files(node_dir), 0);
  teardown_dir();
}

/* The emulated device's UUID is derived from its name: the same in every
 * process and run, different for another name, an RFC 9562 version-8 UUID;
 * the text form is nvidia-smi's 8-4-4-4-12 lowercase hex, "" when unknown. */
static void test_uuid_format_and_derive(void **state) {
  (void)state;
  uint8_t a[16], b[16], c[16], zero[16] = {0};
  sgm__node_uuid_derive("lab-gpu", a);
  sgm__node_uuid_derive("lab-gpu", b);
  sgm__node_uuid_derive("lab-gpu2", c);
  assert_memory_equal(a, b, 16);
  assert_memory_not_equal(a, c, 16);
  assert_int_equal(a[6] >> 4, 8);
  assert_int_equal(a[8] >> 6, 2);
  char text[SGM_NODE_UUID_TEXT];
  static const uint8_t fixed[16] = {0x01, 0x23, 0xab, 0xcd, 0x45, 0x67, 0x89, 0xef,
                                    0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0xff};
  sgm__node_uuid_format(fixed, text, sizeof text);
  assert_string_equal(text, "0123abcd-4567-89ef-0011-2233445566ff");
  sgm__node_uuid_format(zero, text, sizeof text);
  assert_string_equal(text, "");
}

/* Two keys that sanitise to one file name are not confused: each record
 * carries its key, and a process counts only records of its own. */
static void test_other_device_key_refused(void **state) {
  (void)state;
  setup_env("keys", "16MiB");
  sgm_node_params p = {.dir = node_dir, .key = "emu-a:b", .name = "t", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB, .n_slots = 4};
  sgm_node *n = NULL, *m = NULL;
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  p.key = "emu-a_b"; /* the same file name */
  assert_int_equal(sgm__node_join(&p, &m), SGM_OK);
  sgm_node_view *v = malloc(sizeof *v);
  assert_non_null(v);
  assert_int_equal(sgm__node_view(n, v), SGM_OK);
  assert_int_equal(v->n_procs, 1);
  assert_true(v->procs[0].self);
  assert_int_equal(v->n_refused, 1);
  assert_int_equal(sgm__node_view(m, v), SGM_OK);
  assert_int_equal(v->n_procs, 1);
  assert_true(v->procs[0].self);
  free(v);
  sgm__node_leave(m);
  sgm__node_leave(n);
  teardown_dir();
}

/* Issue 28 item 9: an allocation that falls back because other processes
 * hold the device says so: the budget is this process's fair share of a
 * shared device (with what it would have alone and what to do), not "raise
 * SGM_VRAM_LIMIT", and the largest free block it names fits in the budget. */
static void test_fallback_names_the_fair_share(void **state) {
  (void)state;
  setup_env("why", "64MiB");
  kid a = kid_start(), b = kid_start();
  assert_int_equal(kid_do(&a, OP_CREATE, 0, NULL).rc, SGM_OK);
  assert_int_equal(kid_do(&a, OP_BUFFER, 40 * MiB, NULL).tier, SGM_TIER_VRAM);
  assert_int_equal(kid_do(&b, OP_CREATE, 0, NULL).rc, SGM_OK);
  for (int i = 0; i < 2; i++) {
    kid_do(&a, OP_TICK, 0, NULL);
    kid_do(&b, OP_TICK, 0, NULL);
  }
  rsp r = kid_do(&b, OP_EXPLAIN, 48 * MiB, NULL);
  print_message("# %s\n", r.msg);
  assert_non_null(strstr(r.msg, "fair share of a device it shares with 1 other sgm process"));
  assert_non_null(strstr(r.msg, "alone it would have 64.00 MiB"));
  assert_null(strstr(r.msg, "raise SGM_VRAM_LIMIT"));
  /* Alone again, the options are the reason once more. */
  kid_quit(&a);
  kid_do(&b, OP_TICK, 0, NULL);
  r = kid_do(&b, OP_EXPLAIN, 128 * MiB, NULL);
  print_message("# %s\n", r.msg);
  assert_null(strstr(r.msg, "fair share"));
  assert_non_null(strstr(r.msg, "raise SGM_VRAM_LIMIT"));
  kid_quit(&b);
  teardown_dir();
}

/* The context's clock, moved by hand: pokes between moves happen at one
 * instant. Atomic: the ticker thread reads it too. */
static uint64_t poke_clock_ms = 1000;
static uint64_t poke_clock(void *user) {
  (void)user;
  return __atomic_load_n(&poke_clock_ms, __ATOMIC_RELAXED);
}

/* Invariant: a program falling back in a loop asks the ticker for one tick
 * per quarter of the node period, not one per fallback (each asked-for tick
 * publishes and splits the device again; back to back they kept a core
 * busy). With the context's clock frozen, 200 fallbacks ask once; a tick
 * asked for and the clock moved past the gap, a fallback asks again. */
static void test_fallbacks_poke_the_ticker_once_per_gap(void **state) {
  (void)state;
  setup_env("pokes", "4MiB");
  setenv("SGM_NODE_PERIOD_MS", "400", 1); /* a gap of 100 ms */
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  assert_non_null(sgm__share_node(ctx));
  sgm__context_set_clock(ctx, poke_clock, NULL);
  void *fill = sgm_alloc(ctx, 4 * MiB, NULL); /* VRAM's whole budget */
  assert_non_null(fill);
  enum { N = 200 };
  void *p[N];
  sgm_stats st0, st1;
  assert_int_equal(sgm_get_stats(ctx, &st0), SGM_OK);
  uint64_t pokes0 = sgm__share_pokes(ctx);
  for (int i = 0; i < N; i++) {
    p[i] = sgm_alloc(ctx, 64 * 1024, NULL);
    assert_non_null(p[i]);
  }
  assert_int_equal(sgm_get_stats(ctx, &st1), SGM_OK);
  uint64_t asked = sgm__share_pokes(ctx) - pokes0;
  print_message("# %llu fallbacks at one instant asked for %llu ticks\n",
                (unsigned long long)(st1.n_fallbacks - st0.n_fallbacks), (unsigned long long)asked);
  assert_int_equal(st1.n_fallbacks - st0.n_fallbacks, N);
  assert_true(asked <= 1);
  __atomic_add_fetch(&poke_clock_ms, 100, __ATOMIC_RELAXED); /* the gap has passed: the next fallback asks */
  void *q = sgm_alloc(ctx, 64 * 1024, NULL);
  assert_non_null(q);
  assert_int_equal(sgm__share_pokes(ctx) - pokes0, asked + 1);
  sgm_free(ctx, q, NULL);
  for (int i = 0; i < N; i++) sgm_free(ctx, p[i], NULL);
  sgm_free(ctx, fill, NULL);
  sgm_context_destroy(ctx);
  teardown_dir();
}

/* ------------------------------------------------------------------------ */
/* Several users (issue 28): test accounts are plain ids (61001, 61002,
 * 61003 in group 61000), which the kernel needs no passwd entry for; the
 * test runs them as root and skips, saying so, otherwise. */

#define LAB_GROUP 61000
#define LAB_A 61001
#define LAB_B 61002
#define LAB_C 61003

/* A root-owned policy file in a root-owned folder that users can read. */
static void lab_policy(char *path, size_t len, const char *reg, const char *extra) {
  char pdir[64] = "/tmp/sgm-admin-XXXXXX";
  assert_non_null(mkdtemp(pdir));
  assert_int_equal(chmod(pdir, 0755), 0);
  snprintf(path, len, "%s/node.conf", pdir);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fprintf(f, "# a lab server's policy (docs/admin.md)\nregistry_dir = %s\ngroup = %d\nSGM_NODE = on\n"
          "SGM_SHARE_MODE = fair\n%s", reg, LAB_GROUP, extra);
  fclose(f);
  assert_int_equal(chmod(path, 0644), 0);
}

static void lab_policy_remove(const char *path) {
  unlink(path);
  char d[256];
  snprintf(d, sizeof d, "%s", path);
  *strrchr(d, '/') = '\0';
  rmdir(d);
}

/* Two users share one emulated device under the admin's policy: both are
 * tracked (though each asked for SGM_NODE=off and SGM_SHARE_MODE=solo in
 * its environment, and B for SGM_VRAM_LIMIT=100%, above the admin's 25%),
 * their budgets sum to at most the device, the emulated device's capacity
 * is shared between them, and root reads both (what sgm-smi shows). A third
 * user's FIFO, junk and a live record of garbage in the folder opt nobody
 * out. */
static void test_two_users_share_one_device(void **state) {
  (void)state;
  if (geteuid() != 0) {
    print_message("# not root: two users need setuid (CI runs as root); skipped\n");
    skip();
  }
  setup_env("lab", "64MiB");
  setenv("SGM_NODE", "off", 1);        /* the users' own wishes, overridden by the policy */
  setenv("SGM_SHARE_MODE", "solo", 1);
  setenv("SGM_VRAM_LIMIT", "100%", 1);
  char reg[64] = "/tmp/sgm-lab-XXXXXX", policy[128];
  assert_non_null(mkdtemp(reg));
  assert_int_equal(chown(reg, 0, LAB_GROUP), 0);
  assert_int_equal(chmod(reg, 03770), 0); /* setgid + sticky, the group writes */
  char extra[128];
  snprintf(extra, sizeof extra, "vram_cap.user.%d = 25%%\n", LAB_B);
  lab_policy(policy, sizeof policy, reg, extra);
  setenv("SGM_ADMIN_CONF", policy, 1);
  /* The third user's hostile names: a FIFO, junk, a live record of garbage. */
  char p[300];
  snprintf(p, sizeof p, "%s/sgm-node-emu-lab@fifo", reg);
  assert_int_equal(mkfifo(p, 0640), 0);
  assert_int_equal(chown(p, LAB_C, LAB_GROUP), 0);
  snprintf(p, sizeof p, "%s/sgm-node-emu-lab@garbage", reg);
  int gfd = open(p, O_RDWR | O_CREAT, 0640);
  assert_true(gfd >= 0);
  unsigned char junk[SGM_NODE_RECORD_BYTES];
  memset(junk, 0xa5, sizeof junk);
  assert_int_equal(write(gfd, junk, sizeof junk), (ssize_t)sizeof junk);
  assert_int_equal(fchown(gfd, LAB_C, LAB_GROUP), 0);
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
  assert_int_equal(fcntl(gfd, F_OFD_SETLK, &fl), 0);

  kid a = kid_start_as(LAB_A, LAB_A, LAB_GROUP), b = kid_start_as(LAB_B, LAB_B, LAB_GROUP);
  rsp ra = kid_do(&a, OP_CREATE, 0, NULL), rb = kid_do(&b, OP_CREATE, 0, NULL);
  assert_int_equal(ra.rc, SGM_OK);
  assert_int_equal(rb.rc, SGM_OK);
  assert_int_equal(ra.v[V_TRACKED], 1);
  assert_int_equal(rb.v[V_TRACKED], 1);
  assert_true(rb.v[V_VRAM_BUDGET] <= 16 * MiB); /* the admin's cap, not the user's 100% */
  assert_int_equal(kid_do(&a, OP_ALLOC, 40 * MiB, NULL).tier, SGM_TIER_VRAM);
  rb = kid_do(&b, OP_ALLOC, 8 * MiB, NULL);
  assert_int_equal(rb.rc, 0);
  assert_true(rb.v[V_DEVICE_FREE] <= 64 * MiB - 48 * MiB); /* B sees A's 40 MiB on the device */
  for (int i = 0; i < 2; i++) {
    ra = kid_do(&a, OP_TICK, 0, NULL);
    rb = kid_do(&b, OP_TICK, 0, NULL);
  }
  print_message("# budgets: A %llu MiB, B %llu MiB of 64 MiB\n", (unsigned long long)(ra.v[V_VRAM_BUDGET] / MiB),
                (unsigned long long)(rb.v[V_VRAM_BUDGET] / MiB));
  assert_true(ra.v[V_VRAM_BUDGET] + rb.v[V_VRAM_BUDGET] <= 64 * MiB);
  assert_true(ra.v[V_VRAM_BUDGET] < 64 * MiB); /* fair, not solo: A yields B's part */
  assert_true(rb.v[V_VRAM_BUDGET] <= 16 * MiB);

  /* Root sees both users (sgm-smi's read); the garbage and the FIFO are refused. */
  char name[128];
  snprintf(name, sizeof name, "%s/sgm-node-emu-lab", reg);
  sgm_node_device dev = {.struct_size = sizeof dev};
  sgm_node_process procs[4];
  procs[0].struct_size = sizeof procs[0];
  assert_int_equal(sgm_node_read(name, SGM_NODE_READ_ALL_USERS, &dev, procs, 4), SGM_OK);
  assert_int_equal(dev.n_processes, 2);
  assert_true(dev.n_refused >= 2);
  bool seen_a = false, seen_b = false;
  for (int i = 0; i < 2; i++) {
    seen_a |= procs[i].uid == LAB_A && procs[i].pid == a.pid;
    seen_b |= procs[i].uid == LAB_B && procs[i].pid == b.pid;
  }
  assert_true(seen_a && seen_b);
  /* sgm-smi as root shows both users (when the test runs under ctest, which names it). */
  const char *smi = getenv("TEST_SGM_SMI");
  if (smi) {
    char cmd[512], out[16384];
    snprintf(cmd, sizeof cmd, "timeout 20 '%s' --json --dir '%s'", smi, reg);
    FILE *sp = popen(cmd, "r");
    assert_non_null(sp);
    size_t got = fread(out, 1, sizeof out - 1, sp);
    out[got] = '\0';
    int st = pclose(sp);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    char want[64];
    snprintf(want, sizeof want, "\"uid\": %d, ", LAB_A);
    assert_non_null(strstr(out, want));
    snprintf(want, sizeof want, "\"uid\": %d, ", LAB_B);
    assert_non_null(strstr(out, want));
  } else {
    print_message("# TEST_SGM_SMI unset (run outside ctest): sgm-smi not run\n");
  }
  /* Without the flag root reads its own records only, and says how many it hid. */
  assert_int_equal(sgm_node_read(name, 0, &dev, procs, 4), SGM_OK);
  assert_int_equal(dev.n_processes, 0);
  assert_int_equal(dev.n_hidden, 3); /* A's, B's and the third user's record: not opened */
  kid_quit(&a);
  kid_quit(&b);
  close(gfd);
  unsetenv("SGM_ADMIN_CONF");
  unsetenv("SGM_VRAM_LIMIT");
  lab_policy_remove(policy);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", reg);
  assert_int_equal(system(cmd), 0);
  teardown_dir();
}

/* SGM_NODE_GROUP=on without a policy: two users whose primary groups
 * differ and who share a supplementary group (the folder's, not setgid) are
 * both tracked and count each other (issue 28 item 1: a shared
 * supplementary group was refused). */
static void test_node_group_supplementary(void **state) {
  (void)state;
  if (geteuid() != 0) {
    print_message("# not root: two users need setuid (CI runs as root); skipped\n");
    skip();
  }
  setup_env("supp", "64MiB");
  setenv("SGM_NODE_GROUP", "on", 1);
  assert_int_equal(chown(node_dir, 0, LAB_GROUP), 0);
  assert_int_equal(chmod(node_dir, 01770), 0); /* sticky, group-writable, not setgid */
  kid a = kid_start_as(LAB_A, LAB_A, LAB_GROUP), b = kid_start_as(LAB_B, LAB_B, LAB_GROUP);
  assert_int_equal(kid_do(&a, OP_CREATE, 0, NULL).v[V_TRACKED], 1);
  assert_int_equal(kid_do(&b, OP_CREATE, 0, NULL).v[V_TRACKED], 1);
  assert_int_equal(kid_do(&a, OP_ALLOC, 40 * MiB, NULL).tier, SGM_TIER_VRAM);
  rsp rb = kid_do(&b, OP_TICK, 0, NULL);
  assert_true(rb.v[V_DEVICE_FREE] <= 24 * MiB); /* B counts A's 40 MiB */
  rsp ra = kid_do(&a, OP_TICK, 0, NULL);
  rb = kid_do(&b, OP_TICK, 0, NULL);
  assert_true(ra.v[V_VRAM_BUDGET] + rb.v[V_VRAM_BUDGET] <= 64 * MiB);
  kid_quit(&a);
  kid_quit(&b);
  unsetenv("SGM_NODE_GROUP");
  assert_int_equal(chmod(node_dir, 0700), 0);
  teardown_dir();
}

/* Without a policy, another user's records are not counted, and the first
 * join that meets them says so, naming the policy file to set up (issue 28
 * item 2: "a warning that names what to do"). A live record of uid 61001 is
 * planted (chowned, its lock held); the join runs in a child at verbose 1. */
static void foreign_join_child(void *arg) {
  (void)arg;
  sgm_node_params p = {.dir = node_dir, .key = "emu-foreign", .name = "me", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB, .verbose = 1};
  sgm_node *n = NULL;
  if (sgm__node_join(&p, &n) != SGM_OK) _exit(3);
  sgm_node_view *v = malloc(sizeof *v);
  if (!v || sgm__node_view(n, v) != SGM_OK) _exit(4);
  int only_self = v->n_procs == 1 && v->procs[0].self && v->n_foreign == 1;
  free(v);
  sgm__node_leave(n);
  _exit(only_self ? 0 : 5);
}

static void test_other_users_records_warned(void **state) {
  (void)state;
  if (geteuid() != 0) {
    print_message("# not root: a record of another user needs chown; skipped\n");
    skip();
  }
  setup_env("foreign", "16MiB");
  sgm_node_params p = {.dir = node_dir, .key = "emu-foreign", .name = "other", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB};
  sgm_node *other = NULL;
  assert_int_equal(sgm__node_join(&p, &other), SGM_OK); /* a live record, then given away */
  assert_int_equal(chown(sgm__node_file(other), LAB_A, LAB_A), 0);
  char out[4096];
  int st = sgm_test_fork_capture(foreign_join_child, NULL, out, sizeof out);
  print_message("# %s", out);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
  assert_non_null(strstr(out, "of other users (uid 61001"));
  assert_non_null(strstr(out, "are not counted"));
  assert_non_null(strstr(out, sgm__policy_path()));
  assert_non_null(strstr(out, "docs/admin.md"));
  sgm__node_leave(other);
  teardown_dir();
}

/* A user cannot bring their own policy: SGM_ADMIN_CONF naming a file the
 * user owns is ignored (here: its "SGM_NODE = off" has no effect). Root's
 * naming one is honoured (the test above). */
static void test_user_policy_ignored(void **state) {
  (void)state;
  if (geteuid() != 0) {
    print_message("# not root: needs a second user; skipped\n");
    skip();
  }
  setup_env("own", "16MiB");
  assert_int_equal(chmod(node_dir, 01777), 0);
  char mine[128];
  snprintf(mine, sizeof mine, "%s/mine.conf", node_dir);
  FILE *f = fopen(mine, "w");
  assert_non_null(f);
  fprintf(f, "SGM_NODE = off\n");
  fclose(f);
  assert_int_equal(chown(mine, LAB_A, LAB_A), 0);
  setenv("SGM_ADMIN_CONF", mine, 1);
  kid a = kid_start_as(LAB_A, LAB_A, LAB_A);
  rsp r = kid_do(&a, OP_CREATE, 0, NULL);
  assert_int_equal(r.rc, SGM_OK);
  assert_int_equal(r.v[V_TRACKED], 1); /* the user's "policy" did not turn the registry off */
  kid_quit(&a);
  unsetenv("SGM_ADMIN_CONF");
  teardown_dir();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_one_slot_per_process),
      cmocka_unit_test(test_uuid_format_and_derive),
      cmocka_unit_test(test_other_device_key_refused),
      cmocka_unit_test(test_fair_split),
      cmocka_unit_test(test_eight_race_to_join),
      cmocka_unit_test(test_budgets_follow_join_and_leave),
      cmocka_unit_test(test_quota_on_top),
      cmocka_unit_test(test_reserve),
      cmocka_unit_test(test_emu_device_shared),
      cmocka_unit_test(test_sigkill_reclaims),
      cmocka_unit_test(test_sigkill_inside_critical_section),
      cmocka_unit_test(test_pid_reuse_not_trusted),
      cmocka_unit_test(test_hostile_records),
      cmocka_unit_test(test_full_folder),
      cmocka_unit_test(test_fork_child_does_not_keep_parent),
      cmocka_unit_test(test_unsafe_folder_and_records),
      cmocka_unit_test(test_full_table_untracked),
      cmocka_unit_test(test_fallback_names_the_fair_share),
      cmocka_unit_test(test_fallbacks_poke_the_ticker_once_per_gap),
      cmocka_unit_test(test_two_users_share_one_device),
      cmocka_unit_test(test_user_policy_ignored),
      cmocka_unit_test(test_node_group_supplementary),
      cmocka_unit_test(test_other_users_records_warned),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
