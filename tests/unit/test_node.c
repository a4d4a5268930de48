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
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "internal.h"
#include "sgm.h"
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
       OP_CREATE2, OP_BUFFER2, OP_TICK2, OP_DESTROY2 };

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

/* The registry as a reader sees it (live owners only), via a join of ours
 * that we leave at once. */
static size_t live_procs(const char *key) {
  char path[256];
  sgm__node_path(node_dir, key, path, sizeof path);
  int fd;
  unsigned char *mem;
  size_t len;
  char why[256];
  if (sgm__node_map(path, false, false, &fd, &mem, &len, why, sizeof why) != SGM_OK) return 0;
  sgm_node_view *v = malloc(sizeof *v);
  assert_non_null(v);
  assert_int_equal(sgm__node_parse(mem, len, v, why, sizeof why), SGM_OK);
  size_t live = 0;
  for (size_t i = 0; i < v->n_procs; i++) live += sgm__node_slot_alive(fd, v->procs[i].slot);
  free(v);
  munmap(mem, len);
  close(fd);
  return live;
}

/* The live slots a process holds (a reader's view) and their published VRAM
 * use, summed. */
static size_t slots_of(const char *key, pid_t pid, uint64_t *vram_used) {
  char path[256], why[256];
  sgm__node_path(node_dir, key, path, sizeof path);
  int fd;
  unsigned char *mem;
  size_t len;
  *vram_used = 0;
  if (sgm__node_map(path, false, false, &fd, &mem, &len, why, sizeof why) != SGM_OK) return 0;
  sgm_node_view *v = malloc(sizeof *v);
  assert_non_null(v);
  assert_int_equal(sgm__node_parse(mem, len, v, why, sizeof why), SGM_OK);
  size_t n = 0;
  for (size_t i = 0; i < v->n_procs; i++) {
    if (v->procs[i].pid != pid || !sgm__node_slot_alive(fd, v->procs[i].slot)) continue;
    n++;
    *vram_used += v->procs[i].u.w[SGM_NODE_F_USED + SGM_TIER_VRAM];
  }
  free(v);
  munmap(mem, len);
  close(fd);
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
  bool seen[SGM_NODE_DEFAULT_SLOTS] = {false};
  rsp r[8];
  for (int i = 0; i < 8; i++) {
    cmd c = {.op = OP_CREATE};
    assert_int_equal(write(k[i].to, &c, sizeof c), (ssize_t)sizeof c);
  }
  for (int i = 0; i < 8; i++) {
    assert_int_equal(read(k[i].from, &r[i], sizeof r[i]), (ssize_t)sizeof r[i]);
    assert_int_equal(r[i].rc, SGM_OK);
    assert_int_equal(r[i].v[V_TRACKED], 1);
    assert_true(r[i].v[V_SLOT] < SGM_NODE_DEFAULT_SLOTS);
    assert_false(seen[r[i].v[V_SLOT]]);
    seen[r[i].v[V_SLOT]] = true;
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

/* SIGKILL inside the critical section (holding the robust mutex, in the
 * middle of writing a slot, or of reserving device memory): nobody blocks;
 * the next locker repairs the table and a new process joins. */
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
    rsp r = kid_do(&a, OP_TICK, 0, NULL); /* takes the dead owner's mutex */
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
    teardown_dir();
  }
}

/* A slot marked live whose pid is alive (ours: as a reused pid would be) but
 * whose liveness lock nobody holds is dead: it is not shown and is
 * reclaimed. Pids are shown, never trusted. */
static void test_pid_reuse_not_trusted(void **state) {
  (void)state;
  setup_env("pid", "16MiB");
  sgm_node_params p = {.dir = node_dir, .key = "emu-pid", .name = "me", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB};
  sgm_node *n = NULL;
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  /* Forge: copy our live slot into the next one, lock-less. */
  int fd;
  unsigned char *mem;
  size_t len;
  char why[256];
  assert_int_equal(sgm__node_map(sgm__node_file(n), true, false, &fd, &mem, &len, why, sizeof why), SGM_OK);
  uint32_t s = sgm__node_slot(n);
  memcpy(mem + 512 + (s + 1) * 256, mem + 512 + s * 256, 256);
  sgm_node_view *v = malloc(sizeof *v);
  assert_non_null(v);
  assert_int_equal(sgm__node_parse(mem, len, v, why, sizeof why), SGM_OK);
  assert_int_equal(v->n_procs, 2); /* the raw table holds the forgery */
  assert_int_equal(v->procs[1].pid, getpid());
  assert_int_equal(sgm__node_view(n, v), SGM_OK);
  assert_int_equal(v->n_procs, 1); /* a live pid does not make a live slot */
  assert_int_equal(sgm__node_reclaim(n), 1);
  assert_int_equal(sgm__node_parse(mem, len, v, why, sizeof why), SGM_OK);
  assert_int_equal(v->n_procs, 1);
  free(v);
  munmap(mem, len);
  close(fd);
  sgm__node_leave(n);
  teardown_dir();
}

/* Write a segment file by hand at the registry's path for key. */
static void write_file(const char *key, const void *data, size_t len, mode_t mode) {
  char path[256];
  sgm__node_path(node_dir, key, path, sizeof path);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, data, len), (ssize_t)len);
  fchmod(fd, mode);
  close(fd);
}

/* A corrupt, truncated or future-version segment makes sgm run untracked
 * with a message that says what is wrong; the program works on. */
static void test_bad_segments_run_untracked(void **state) {
  (void)state;
  setup_env("bad", "16MiB");
  /* A good segment to start from. */
  sgm_node_params p = {.dir = node_dir, .key = "emu-bad", .name = "t", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB, .n_slots = 4};
  sgm_node *n = NULL;
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  unsigned char good[512 + 4 * 256];
  int fd = open(sgm__node_file(n), O_RDONLY);
  assert_int_equal(read(fd, good, sizeof good), (ssize_t)sizeof good);
  close(fd);
  sgm__node_leave(n);
  struct {
    const char *what;
    size_t off, len;
    uint8_t value;
    int status;
    const char *says;
  } cases[] = {
      {"garbage", 0, 8, 0x5a, SGM_ERR_CORRUPT, "bad magic"},
      {"truncated", 0, 0, 0, SGM_ERR_CORRUPT, "truncated"},
      {"future version", 8, 1, SGM_NODE_VERSION + 1, SGM_ERR_UNSUPPORTED, "newer sgm"},
      {"older version", 8, 1, SGM_NODE_VERSION - 1, SGM_ERR_UNSUPPORTED, "older sgm"},
      {"device UUID", 128, 1, 0x77, SGM_ERR_CORRUPT, "check word"},
      {"slot count", 20, 4, 0xff, SGM_ERR_CORRUPT, "geometry"},
      {"device total", 24, 1, 0x77, SGM_ERR_CORRUPT, "check word"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    unsigned char bad[sizeof good];
    memcpy(bad, good, sizeof bad);
    memset(bad + cases[i].off, cases[i].value, cases[i].len);
    size_t len = strcmp(cases[i].what, "truncated") == 0 ? 512 + 256 : sizeof bad;
    write_file("emu-bad", bad, len, 0600);
    sgm__node_reset_warning();
    int rc = sgm__node_join(&p, &n);
    print_message("# %s: %s\n", cases[i].what, sgm_last_error());
    assert_int_equal(rc, cases[i].status);
    assert_null(n);
    assert_non_null(strstr(sgm_last_error(), cases[i].says));
    /* A context on it: untracked, working. */
    kid a = kid_start();
    rsp r = kid_do(&a, OP_CREATE, 0, NULL);
    assert_int_equal(r.rc, SGM_OK);
    assert_int_equal(r.v[V_TRACKED], 0);
    assert_int_equal(kid_do(&a, OP_ALLOC, MiB, NULL).tier, SGM_TIER_VRAM);
    kid_quit(&a);
  }
  teardown_dir();
}

/* The file must be the user's own regular file, 0600: a symbolic link, a
 * file other users may read or one owned by another user is refused; with
 * SGM_NODE_GROUP, 0660 is taken, and still nothing for others. */
static void test_unsafe_files_refused(void **state) {
  (void)state;
  setup_env("unsafe", "16MiB");
  char path[256];
  sgm__node_path(node_dir, "emu-unsafe", path, sizeof path);
  sgm_node_params p = {.dir = node_dir, .key = "emu-unsafe", .name = "t", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB};
  sgm_node *n = NULL;
  assert_int_equal(symlink("/tmp/elsewhere", path), 0);
  assert_int_not_equal(sgm__node_join(&p, &n), SGM_OK);
  assert_non_null(strstr(sgm_last_error(), "symbolic link"));
  unlink(path);
  /* A good one, then loosened. */
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  sgm__node_leave(n); /* the last one out removes it: make it again and keep it */
  sgm_node *keep = NULL;
  assert_int_equal(sgm__node_join(&p, &keep), SGM_OK);
  assert_int_equal(chmod(path, 0644), 0);
  assert_int_not_equal(sgm__node_join(&p, &n), SGM_OK);
  assert_non_null(strstr(sgm_last_error(), "grants more"));
  assert_int_equal(chmod(path, 0600), 0);
  if (geteuid() == 0) {
    assert_int_equal(chown(path, 65534, 65534), 0);
    assert_int_not_equal(sgm__node_join(&p, &n), SGM_OK);
    assert_non_null(strstr(sgm_last_error(), "owned by uid 65534"));
    assert_int_equal(chown(path, 0, 0), 0);
  } else {
    print_message("# not root: the wrong-owner case needs a file of another user; skipped\n");
  }
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  sgm__node_leave(n);
  /* Group sharing is opt-in: 0660 is refused without it, taken with it;
   * others' bits never. */
  assert_int_equal(chmod(path, 0660), 0);
  assert_int_not_equal(sgm__node_join(&p, &n), SGM_OK);
  p.group = true;
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  sgm__node_leave(n);
  assert_int_equal(chmod(path, 0664), 0);
  assert_int_not_equal(sgm__node_join(&p, &n), SGM_OK);
  assert_non_null(strstr(sgm_last_error(), "grants more than 0660"));
  assert_int_equal(chmod(path, 0600), 0);
  sgm__node_leave(keep);
  teardown_dir();
}

/* A full table: the next process runs untracked, never fails. */
static void test_full_table_untracked(void **state) {
  (void)state;
  setup_env("full", "16MiB");
  sgm_node_params p = {.dir = node_dir, .key = "emu-full", .name = "t", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB, .n_slots = 2};
  sgm_node *n1 = NULL, *n2 = NULL, *n3 = NULL;
  assert_int_equal(sgm__node_join(&p, &n1), SGM_OK);
  assert_int_equal(sgm__node_join(&p, &n2), SGM_OK);
  assert_int_equal(sgm__node_join(&p, &n3), SGM_ERR_BUSY);
  assert_non_null(strstr(sgm_last_error(), "all 2 slots"));
  kid a = kid_start();
  rsp r = kid_do(&a, OP_CREATE, 0, NULL);
  assert_int_equal(r.rc, SGM_OK);
  assert_int_equal(r.v[V_TRACKED], 0);
  assert_int_equal(kid_do(&a, OP_ALLOC, MiB, NULL).rc, 0);
  kid_quit(&a);
  sgm__node_leave(n2);
  assert_int_equal(sgm__node_join(&p, &n3), SGM_OK); /* a freed slot is reused */
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

/* Two keys that sanitise to one file name are not confused: the header says
 * whose device the segment is, and a process of the other is refused (and
 * runs untracked) instead of sharing budgets with a stranger. */
static void test_other_device_key_refused(void **state) {
  (void)state;
  setup_env("keys", "16MiB");
  sgm_node_params p = {.dir = node_dir, .key = "emu-a:b", .name = "t", .device_total_bytes = 16 * MiB,
                       .shared_cap_bytes = 64 * MiB, .n_slots = 4};
  sgm_node *n = NULL, *m = NULL;
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  p.key = "emu-a_b"; /* the same file name */
  sgm__node_reset_warning();
  assert_int_equal(sgm__node_join(&p, &m), SGM_ERR_CORRUPT);
  assert_null(m);
  print_message("# %s\n", sgm_last_error());
  assert_non_null(strstr(sgm_last_error(), "belongs to device emu-a:b, not to emu-a_b"));
  sgm__node_leave(n);
  teardown_dir();
}

/* In a forked child: join a segment and read the device's use, with an sgm
 * lock of rank SGM_LOCK_NODE (which ranks after the segment's mutex) held
 * when *(bool *)hold; exits 0 when the read worked. */
static void node_lock_order_child(void *hold) {
  sgm_node_params p = {.dir = node_dir, .key = "emu-witness", .name = "me",
                       .device_total_bytes = 16 * MiB, .shared_cap_bytes = 64 * MiB};
  sgm_node *n = NULL;
  if (sgm__node_join(&p, &n) != SGM_OK) _exit(3);
  sgm_lock l;
  sgm__lock_init(&l, SGM_LOCK_NODE);
  if (*(bool *)hold) sgm__lock_take(&l);
  uint64_t used = 0;
  int rc = sgm__node_device_used(n, &used); /* takes the segment's mutex */
  if (*(bool *)hold) sgm__lock_drop(&l);
  sgm__lock_destroy(&l);
  sgm__node_leave(n);
  _exit(rc == SGM_OK ? 0 : 4);
}

/* Invariant (issue 11 item 4, debug builds): the segment's process-shared
 * mutex, though no sgm_lock, is under the lock witness: taking it while
 * holding a lock that ranks after it aborts with the witness's assertion;
 * the same call without that lock succeeds. */
static void test_segment_mutex_witnessed(void **state) {
  (void)state;
  if (SGM_DEBUG < 2) {
    printf("# SGM_DEBUG=%d: the lock witness is compiled out here; nothing to check\n", SGM_DEBUG);
    skip();
  }
  setup_env("witness", "16MiB");
  char out[1024];
  bool hold = true;
  int status = sgm_test_fork_capture(node_lock_order_child, &hold, out, sizeof out);
  sgm_test_assert_aborted(status, out, "sgm: assertion failed: held_ranks[i] < rank");
  hold = false;
  status = sgm_test_fork_capture(node_lock_order_child, &hold, out, sizeof out);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
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
      cmocka_unit_test(test_bad_segments_run_untracked),
      cmocka_unit_test(test_unsafe_files_refused),
      cmocka_unit_test(test_full_table_untracked),
      cmocka_unit_test(test_segment_mutex_witnessed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
