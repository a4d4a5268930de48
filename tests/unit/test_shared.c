/*
 * test_shared.c — the shared GPU memory tier and the VRAM → shared fallback on
 * the emulated device: placement order, exhaustion messages, data integrity,
 * lazy commit, trim and idle trim (with an injected clock), the fallback
 * switch and callback, and a pinning failure that names RLIMIT_MEMLOCK.
 */
#include <linux/capability.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "internal.h"
#include "test_util.h"
#include "tiers/tier.h"

#define MiB (UINT64_C(1) << 20)

/* A context with a 16 MiB VRAM budget and a 64 MiB shared budget. */
static sgm_context *make_ctx(const char *fallback) {
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "64MiB", 1);
  setenv("SGM_VRAM_LIMIT", "16MiB", 1);
  setenv("SGM_SHARED_LIMIT", "64MiB", 1);
  setenv("SGM_SHARED_FALLBACK", fallback, 1);
  sgm_context *ctx = NULL;
  sgm_status rc = sgm_context_create(NULL, &ctx);
  if (rc != SGM_OK) fprintf(stderr, "create: %s\n", sgm_last_error());
  assert_int_equal(rc, SGM_OK);
  return ctx;
}

static sgm_stats stats(sgm_context *ctx) {
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  return st;
}

typedef struct fallback_log {
  int calls;       /* callback invocations */
  uint64_t bytes;  /* sizes reported */
} fallback_log;

static void on_fallback(void *user, void *ptr, size_t size) {
  fallback_log *l = user;
  assert_non_null(ptr);
  l->calls++;
  l->bytes += size;
}

/* Invariants: allocating 3x the VRAM budget succeeds; blocks go to VRAM while
 * it fits and to shared memory after; every fallback is counted in the stats
 * and reported to the callback; after VRAM blocks are freed, new allocations
 * go back to VRAM. Nothing is pinned before the first fallback. */
static void test_fallback_order(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("on");
  sgm_stats st = stats(ctx);
  assert_int_equal(st.tier[SGM_TIER_SHARED].committed_bytes, 0);
  assert_int_equal(st.tier[SGM_TIER_SHARED].budget_bytes, 64 * MiB);
  fallback_log log = {0};
  assert_int_equal(sgm_set_fallback_callback(ctx, on_fallback, &log), SGM_OK);
  enum { N = 48 }; /* 48 MiB = 3x the VRAM budget */
  void *p[N];
  bool seen_shared = false;
  int n_vram = 0, n_shared = 0;
  for (int i = 0; i < N; i++) {
    p[i] = sgm_alloc(ctx, 1 * MiB, NULL);
    assert_non_null(p[i]);
    sgm_tier t = sgm_pointer_tier(ctx, p[i]);
    assert_true(t == SGM_TIER_VRAM || t == SGM_TIER_SHARED);
    if (t == SGM_TIER_SHARED) seen_shared = true, n_shared++;
    else assert_false(seen_shared), n_vram++; /* VRAM first, then shared */
  }
  assert_int_equal(n_vram, 16);
  st = stats(ctx);
  assert_int_equal(st.n_fallbacks, (uint64_t)n_shared);
  assert_int_equal(st.fallback_bytes, (uint64_t)n_shared * MiB);
  assert_int_equal(log.calls, n_shared);
  assert_int_equal(log.bytes, (uint64_t)n_shared * MiB);
  assert_int_equal(st.tier[SGM_TIER_SHARED].used_bytes, (uint64_t)n_shared * MiB);
  assert_int_equal(st.tier[SGM_TIER_SHARED].n_live, (uint64_t)n_shared);
  for (int i = 0; i < 4; i++) sgm_free(ctx, p[i], NULL); /* four VRAM blocks */
  for (int i = 0; i < 4; i++) {
    p[i] = sgm_alloc(ctx, 1 * MiB, NULL);
    assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_VRAM);
  }
  assert_int_equal(log.calls, n_shared);
  for (int i = 0; i < N; i++) assert_int_equal(sgm_free_ex(ctx, p[i], NULL), SGM_OK);
  st = stats(ctx);
  assert_int_equal(st.tier[SGM_TIER_SHARED].n_live, 0);
  assert_int_equal(st.n_bad_frees, 0);
  sgm_context_destroy(ctx);
}

/* Invariant: when shared memory is full too, sgm_alloc returns NULL with
 * SGM_ERR_NOMEM and a message naming both budgets and their variables. */
static void test_shared_exhaustion(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("on");
  void *p[100];
  int n = 0;
  while (n < 100 && (p[n] = sgm_alloc(ctx, 4 * MiB, NULL)) != NULL) n++;
  assert_int_equal(n, 4 + 16); /* 16 MiB VRAM + 64 MiB shared */
  const char *m = sgm_last_error();
  assert_non_null(strstr(m, "budget 16.00 MiB"));
  assert_non_null(strstr(m, "budget 64.00 MiB"));
  assert_non_null(strstr(m, "SGM_VRAM_LIMIT"));
  assert_non_null(strstr(m, "SGM_SHARED_LIMIT"));
  for (int i = 0; i < n; i++) sgm_free(ctx, p[i], NULL);
  sgm_context_destroy(ctx);
}

/* Invariant: with the fallback off, a full VRAM budget is SGM_ERR_NOMEM and
 * nothing lands in shared memory (the message says how to turn it on). */
static void test_fallback_off(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("off");
  void *p[32];
  int n = 0;
  while (n < 32 && (p[n] = sgm_alloc(ctx, 1 * MiB, NULL)) != NULL) n++;
  assert_int_equal(n, 16);
  assert_non_null(strstr(sgm_last_error(), "SGM_SHARED_FALLBACK"));
  sgm_stats st = stats(ctx);
  assert_int_equal(st.n_fallbacks, 0);
  assert_int_equal(st.tier[SGM_TIER_SHARED].committed_bytes, 0);
  for (int i = 0; i < n; i++) sgm_free(ctx, p[i], NULL);
  sgm_context_destroy(ctx);
}

/* Invariant: bytes written through the backend into shared-tier blocks read
 * back intact, through the device address and through the host address. */
static void test_shared_data_intact(void **state) {
  (void)state;
  sgm_test_rng r;
  sgm_test_rng_init(&r, sgm_test_seed("shared.data", 11));
  sgm_context *ctx = make_ctx("on");
  void *fill = sgm_alloc(ctx, 16 * MiB, NULL); /* VRAM full */
  assert_int_equal(sgm_pointer_tier(ctx, fill), SGM_TIER_VRAM);
  enum { N = 20 };
  void *p[N];
  size_t sz[N];
  unsigned char *src = malloc(3 * MiB), *back = malloc(3 * MiB);
  for (int i = 0; i < N; i++) {
    sz[i] = (size_t)sgm_test_rng_range(&r, 1, 3 * MiB);
    p[i] = sgm_alloc(ctx, sz[i], NULL);
    assert_non_null(p[i]);
    assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_SHARED);
    for (size_t k = 0; k < sz[i]; k++) src[k] = (unsigned char)(i * 31 + k * 7);
    assert_int_equal(sgm__context_bops(ctx)->copy(sgm__context_be(ctx), SGM_COPY_HOST_TO_DEVICE, (uintptr_t)p[i],
                                     (uintptr_t)src, sz[i], NULL), SGM_OK);
  }
  for (int i = 0; i < N; i++) {
    assert_int_equal(sgm__context_bops(ctx)->copy(sgm__context_be(ctx), SGM_COPY_DEVICE_TO_HOST, (uintptr_t)back,
                                     (uintptr_t)p[i], sz[i], NULL), SGM_OK);
    const unsigned char *host = sgm__shared_host_ptr(sgm__context_tier(ctx, SGM_TIER_SHARED), (uintptr_t)p[i]);
    assert_non_null(host);
    for (size_t k = 0; k < sz[i]; k++) {
      unsigned char want = (unsigned char)(i * 31 + k * 7);
      if (back[k] != want || host[k] != want) fail_msg("block %d byte %zu differs", i, k);
    }
  }
  for (int i = 0; i < N; i++) sgm_free(ctx, p[i], NULL);
  sgm_free(ctx, fill, NULL);
  free(src);
  free(back);
  sgm_context_destroy(ctx);
}

/* Invariants: shared memory is committed lazily — while allocating equal
 * blocks, committed <= used + one chunk (the largest, 64 MiB cap aside, the
 * last one taken) — and after freeing and trimming, committed <= used, and the
 * backend holds exactly what is committed. */
static void test_lazy_commit_and_trim(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("on");
  void *fill = sgm_alloc(ctx, 16 * MiB, NULL);
  enum { N = 60 };
  void *p[N];
  for (int i = 0; i < N; i++) {
    p[i] = sgm_alloc(ctx, 512 * 1024, NULL);
    assert_int_equal(sgm_pointer_tier(ctx, p[i]), SGM_TIER_SHARED);
    sgm_chunk chunks[64];
    size_t n_chunks = sgm__tier_chunks(sgm__context_tier(ctx, SGM_TIER_SHARED), chunks, 64);
    assert_true(n_chunks > 0 && n_chunks <= 64);
    sgm_stats st = stats(ctx);
    uint64_t last_chunk = chunks[n_chunks - 1].bytes;
    assert_true(st.tier[SGM_TIER_SHARED].committed_bytes <=
                st.tier[SGM_TIER_SHARED].used_bytes + last_chunk);
  }
  sgm_backend_counters c;
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.host_live_bytes, stats(ctx).tier[SGM_TIER_SHARED].committed_bytes);
  /* Chunks of 2, 4, 8 and 16 MiB hold blocks 0-3, 4-11, 12-27 and 28-59. Free
   * the last chunk's blocks and every other block of the rest. */
  for (int i = 0; i < 28; i += 2) sgm_free(ctx, p[i], NULL);
  for (int i = 28; i < N; i++) sgm_free(ctx, p[i], NULL);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  sgm_stats st = stats(ctx);
  /* Trim returned the wholly free chunk; the three that hold live blocks stay. */
  assert_int_equal(st.tier[SGM_TIER_SHARED].committed_bytes, 14 * MiB);
  assert_int_equal(st.tier[SGM_TIER_SHARED].used_bytes, 14 * 512 * 1024);
  for (int i = 1; i < 28; i += 2) sgm_free(ctx, p[i], NULL);
  assert_int_equal(sgm_trim(ctx), SGM_OK);
  st = stats(ctx);
  assert_true(st.tier[SGM_TIER_SHARED].committed_bytes <= st.tier[SGM_TIER_SHARED].used_bytes);
  assert_int_equal(st.tier[SGM_TIER_SHARED].committed_bytes, 0);
  sgm__context_bops(ctx)->counters(sgm__context_be(ctx), &c);
  assert_int_equal(c.host_live_bytes, 0);
  assert_true(sgm__tier_check(sgm__context_tier(ctx, SGM_TIER_SHARED)));
  sgm_free(ctx, fill, NULL);
  sgm_context_destroy(ctx);
}

static uint64_t fake_now;
static uint64_t fake_clock(void *user) {
  (void)user;
  return __atomic_load_n(&fake_now, __ATOMIC_RELAXED);
}

/* Invariant: a free shared chunk goes back on its own once it has been seen
 * free for SGM_IDLE_TRIM_MS (judged by the injected clock, no sleeps), not
 * before; chunks with live blocks stay. */
static void test_idle_trim(void **state) {
  (void)state;
  sgm_context *ctx = make_ctx("on");
  sgm__context_set_clock(ctx, fake_clock, NULL);
  __atomic_store_n(&fake_now, 1000, __ATOMIC_RELAXED);
  uint64_t idle = sgm__context_cfg(ctx)->idle_trim_ms;
  assert_int_equal(idle, 2000);
  void *fill = sgm_alloc(ctx, 16 * MiB, NULL);
  void *a = sgm_alloc(ctx, 1 * MiB, NULL); /* first shared chunk (2 MiB) */
  void *b = sgm_alloc(ctx, 3 * MiB, NULL); /* second chunk (4 MiB) */
  assert_int_equal(sgm_pointer_tier(ctx, b), SGM_TIER_SHARED);
  assert_int_equal(stats(ctx).tier[SGM_TIER_SHARED].committed_bytes, 6 * MiB);
  sgm_free(ctx, b, NULL);
  sgm__context_idle_tick(ctx); /* sees chunk 2 free at t=1000 */
  __atomic_store_n(&fake_now, 1000 + idle - 1, __ATOMIC_RELAXED);
  sgm__context_idle_tick(ctx);
  assert_int_equal(stats(ctx).tier[SGM_TIER_SHARED].committed_bytes, 6 * MiB);
  __atomic_store_n(&fake_now, 1000 + idle, __ATOMIC_RELAXED);
  sgm__context_idle_tick(ctx);
  assert_int_equal(stats(ctx).tier[SGM_TIER_SHARED].committed_bytes, 2 * MiB);
  /* The VRAM chunk holding fill stays, and so does the chunk holding a. */
  __atomic_store_n(&fake_now, 100000, __ATOMIC_RELAXED);
  sgm__context_idle_tick(ctx);
  assert_int_equal(stats(ctx).tier[SGM_TIER_SHARED].committed_bytes, 2 * MiB);
  assert_int_equal(stats(ctx).tier[SGM_TIER_VRAM].committed_bytes, 16 * MiB);
  sgm_free(ctx, a, NULL);
  sgm_free(ctx, fill, NULL);
  sgm__context_idle_tick(ctx);
  __atomic_store_n(&fake_now, 100000 + idle, __ATOMIC_RELAXED);
  sgm__context_idle_tick(ctx);
  sgm_stats st = stats(ctx);
  assert_int_equal(st.tier[SGM_TIER_SHARED].committed_bytes, 0);
  assert_int_equal(st.tier[SGM_TIER_VRAM].committed_bytes, 0);
  sgm_context_destroy(ctx);
}

/* Invariant: when pinning fails (RLIMIT_MEMLOCK too low for a process without
 * CAP_IPC_LOCK), the fallback fails with a message naming the limit and how
 * to raise it, and VRAM allocations keep working. Runs in a child that drops
 * the capability; skipped where that cannot be arranged. */
static void test_pinning_failure(void **state) {
  (void)state;
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    struct rlimit rl = {64 * 1024, 64 * 1024};
    if (setrlimit(RLIMIT_MEMLOCK, &rl) != 0) _exit(77);
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    if (syscall(SYS_capget, &h, d) != 0) _exit(77);
    d[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
    if (syscall(SYS_capset, &h, d) != 0) _exit(77);
    /* Where mlock does not enforce the limit (AddressSanitizer makes mlock a
     * no-op), there is no failure to observe. */
    void *probe = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (probe == MAP_FAILED || mlock(probe, 1 << 20) == 0) _exit(77);
    munmap(probe, 1 << 20);
    sgm_test_clean_env();
    setenv("SGM_EMU_VRAM", "64MiB", 1);
    setenv("SGM_VRAM_LIMIT", "16MiB", 1);
    sgm_context *ctx = NULL;
    if (sgm_context_create(NULL, &ctx) != SGM_OK) _exit(10);
    void *v = sgm_alloc(ctx, 16 * MiB, NULL);
    if (!v) _exit(11);
    void *s = sgm_alloc(ctx, 1 * MiB, NULL);
    if (s) _exit(12); /* pinning should have failed */
    if (!strstr(sgm_last_error(), "RLIMIT_MEMLOCK") || !strstr(sgm_last_error(), "ulimit -l"))
      _exit(13);
    sgm_free(ctx, v, NULL);
    void *v2 = sgm_alloc(ctx, 1 * MiB, NULL);
    if (!v2 || sgm_pointer_tier(ctx, v2) != SGM_TIER_VRAM) _exit(14);
    sgm_free(ctx, v2, NULL);
    sgm_context_destroy(ctx);
    _exit(0);
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) skip();
  assert_int_equal(WEXITSTATUS(status), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fallback_order),     cmocka_unit_test(test_shared_exhaustion),
      cmocka_unit_test(test_fallback_off),       cmocka_unit_test(test_shared_data_intact),
      cmocka_unit_test(test_lazy_commit_and_trim), cmocka_unit_test(test_idle_trim),
      cmocka_unit_test(test_pinning_failure),
  };
  return cmocka_run_group_tests_name("shared", tests, NULL, NULL);
}
