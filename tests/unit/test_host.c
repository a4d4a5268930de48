/*
 * test_host.c — the host machine (lib/prim/host.c): machine RAM from hwloc
 * and the cgroup memory limit, read from fake /proc and /sys trees built in a
 * temporary directory for cgroup v2 and v1.
 */
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "test_util.h"

/* ------------------------------------------------------------------------ */
/* Fake roots. */

static void make_root(char *root, size_t len) {
  snprintf(root, len, "/tmp/sgm_host_XXXXXX");
  assert_non_null(mkdtemp(root));
}

/* mkdir -p <root>/<rel>. */
static void make_dirs(const char *root, const char *rel) {
  char path[4096];
  assert_true(snprintf(path, sizeof path, "%s/%s", root, rel) < (int)sizeof path);
  for (char *p = path + strlen(root) + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    assert_true(mkdir(path, 0700) == 0 || errno == EEXIST);
    *p = '/';
  }
  assert_true(mkdir(path, 0700) == 0 || errno == EEXIST);
}

/* Write <root>/<rel>, creating its directories. */
static void write_file(const char *root, const char *rel, const char *content) {
  char dir[4096], path[4096];
  snprintf(dir, sizeof dir, "%s", rel);
  char *slash = strrchr(dir, '/');
  if (slash) {
    *slash = '\0';
    make_dirs(root, dir);
  }
  assert_true(snprintf(path, sizeof path, "%s/%s", root, rel) < (int)sizeof path);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(content, f);
  fclose(f);
}

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static void remove_root(const char *root) {
  assert_int_equal(nftw(root, rm_one, 16, FTW_DEPTH | FTW_PHYS), 0);
}

static uint64_t limit_of(const char *root) {
  uint64_t v = 12345;
  assert_int_equal(sgm__host_cgroup_limit(root, &v), SGM_OK);
  return v;
}

/* ------------------------------------------------------------------------ */
/* Machine RAM. */

/* hwloc (or sysconf) reports the machine's RAM: more than nothing, no more than
 * the kernel's total. */
static void test_machine_ram(void **state) {
  (void)state;
  sgm_test_clean_env();
  uint64_t ram = sgm__host_machine_ram();
  uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
  print_message("# machine RAM %llu, sysconf %llu\n", (unsigned long long)ram,
                (unsigned long long)phys);
  assert_true(ram > 64 * SGM_MiB);
  assert_true(ram <= phys + phys / 100);
}

/* Invariant: hwloc's topology is loaded once per process, however many
 * times the machine's RAM is asked (every sgm_context_create asks; a load
 * costs milliseconds), and the answer stays the same. */
static void test_machine_ram_probed_once(void **state) {
  (void)state;
  sgm_test_clean_env();
  uint64_t first = sgm__host_machine_ram();
  for (int i = 0; i < 3; i++) assert_int_equal(sgm__host_machine_ram(), first);
  sgm_context *ctx = NULL;
  setenv("SGM_BACKEND", "emu", 1);
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  sgm_context_destroy(ctx);
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  sgm_context_destroy(ctx);
  assert_int_equal(sgm__host_n_topology_loads(), 1);
}

/* ------------------------------------------------------------------------ */
/* cgroup v2. */

static void test_v2_limit(void **state) {
  (void)state;
  sgm_test_clean_env();
  char root[64];
  make_root(root, sizeof root);
  write_file(root, "proc/self/cgroup", "0::/user.slice/job.scope\n");
  write_file(root, "sys/fs/cgroup/user.slice/job.scope/memory.max", "1073741824\n");
  assert_int_equal(limit_of(root), SGM_GiB);
  remove_root(root);
}

static void test_v2_max_is_no_limit(void **state) {
  (void)state;
  sgm_test_clean_env();
  char root[64];
  make_root(root, sizeof root);
  write_file(root, "proc/self/cgroup", "0::/user.slice/job.scope\n");
  write_file(root, "sys/fs/cgroup/user.slice/job.scope/memory.max", "max\n");
  write_file(root, "sys/fs/cgroup/user.slice/memory.max", "max\n");
  assert_int_equal(limit_of(root), 0);
  remove_root(root);
}

/* The smallest limit on the way up wins, wherever it sits. */
static void test_v2_nested_ancestors(void **state) {
  (void)state;
  sgm_test_clean_env();
  char root[64];
  make_root(root, sizeof root);
  write_file(root, "proc/self/cgroup", "0::/a/b/c\n");
  write_file(root, "sys/fs/cgroup/a/b/c/memory.max", "max\n");
  write_file(root, "sys/fs/cgroup/a/b/memory.max", "8589934592\n");
  write_file(root, "sys/fs/cgroup/a/memory.max", "2147483648\n");
  assert_int_equal(limit_of(root), 2 * SGM_GiB);
  /* A smaller child limit under a larger parent. */
  write_file(root, "sys/fs/cgroup/a/b/c/memory.max", "536870912\n");
  assert_int_equal(limit_of(root), 512 * SGM_MiB);
  /* A limit at the mount root counts too (a container's own cgroup). */
  write_file(root, "sys/fs/cgroup/memory.max", "268435456\n");
  assert_int_equal(limit_of(root), 256 * SGM_MiB);
  /* A trailing slash in the path changes nothing. */
  write_file(root, "proc/self/cgroup", "0::/a/b/c/\n");
  assert_int_equal(limit_of(root), 256 * SGM_MiB);
  remove_root(root);
}

/* Inside a container the host's path does not exist: the mount root is the
 * container's cgroup. */
static void test_v2_missing_dir_falls_back_to_mount_root(void **state) {
  (void)state;
  sgm_test_clean_env();
  char root[64];
  make_root(root, sizeof root);
  write_file(root, "proc/self/cgroup", "0::/system.slice/docker-abc.scope\n");
  write_file(root, "sys/fs/cgroup/memory.max", "268435456\n");
  assert_int_equal(limit_of(root), 256 * SGM_MiB);
  /* The same with a cgroup namespace: the path is "/". */
  write_file(root, "proc/self/cgroup", "0::/\n");
  assert_int_equal(limit_of(root), 256 * SGM_MiB);
  write_file(root, "sys/fs/cgroup/memory.max", "max\n");
  assert_int_equal(limit_of(root), 0);
  remove_root(root);
}

/* Unreadable or malformed limit files are no limit, not an error. */
static void test_v2_malformed_is_no_limit(void **state) {
  (void)state;
  sgm_test_clean_env();
  char root[64];
  make_root(root, sizeof root);
  write_file(root, "proc/self/cgroup", "0::/job\n");
  write_file(root, "sys/fs/cgroup/job/memory.max", "lots\n");
  assert_int_equal(limit_of(root), 0);
  write_file(root, "sys/fs/cgroup/job/memory.max", "");
  assert_int_equal(limit_of(root), 0);
  write_file(root, "sys/fs/cgroup/job/memory.max", "123abc\n");
  assert_int_equal(limit_of(root), 0);
  write_file(root, "sys/fs/cgroup/job/memory.max", "99999999999999999999999\n");
  assert_int_equal(limit_of(root), 0);
  remove_root(root);
}

/* ------------------------------------------------------------------------ */
/* cgroup v1. */

static void test_v1_limit(void **state) {
  (void)state;
  sgm_test_clean_env();
  char root[64];
  make_root(root, sizeof root);
  /* A hybrid system: the memory controller on v1 wins over the "0::" line. */
  write_file(root, "proc/self/cgroup",
             "12:pids:/docker/abc\n"
             "11:cpu,cpuacct:/docker/abc\n"
             "9:memory:/docker/abc\n"
             "1:name=systemd:/docker/abc\n"
             "0::/docker/abc\n");
  write_file(root, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "536870912\n");
  write_file(root, "sys/fs/cgroup/docker/abc/memory.max", "1073741824\n");
  assert_int_equal(limit_of(root), 512 * SGM_MiB);
  /* The controller inside a list. */
  write_file(root, "proc/self/cgroup", "4:cpuacct,memory,cpu:/docker/abc\n");
  assert_int_equal(limit_of(root), 512 * SGM_MiB);
  /* A smaller ancestor limit wins. */
  write_file(root, "sys/fs/cgroup/memory/docker/memory.limit_in_bytes", "268435456\n");
  assert_int_equal(limit_of(root), 256 * SGM_MiB);
  /* "memoryx" is not the memory controller. */
  write_file(root, "proc/self/cgroup", "4:memoryx:/docker/abc\n");
  assert_int_equal(limit_of(root), 0);
  remove_root(root);
}

/* v1 writes PAGE_COUNTER_MAX (about 2^63, page-rounded) for no limit. */
static void test_v1_huge_is_no_limit(void **state) {
  (void)state;
  sgm_test_clean_env();
  char root[64];
  make_root(root, sizeof root);
  write_file(root, "proc/self/cgroup", "9:memory:/job\n");
  write_file(root, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", "9223372036854771712\n");
  assert_int_equal(limit_of(root), 0);
  write_file(root, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", "4611686018427387904\n");
  assert_int_equal(limit_of(root), 0); /* 2^62 */
  write_file(root, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", "4611686018427387903\n");
  assert_int_equal(limit_of(root), (UINT64_C(1) << 62) - 1);
  remove_root(root);
}

static void test_v1_missing_dir_falls_back_to_mount_root(void **state) {
  (void)state;
  sgm_test_clean_env();
  char root[64];
  make_root(root, sizeof root);
  write_file(root, "proc/self/cgroup", "9:memory:/kubepods/pod1/ctr\n");
  write_file(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "134217728\n");
  assert_int_equal(limit_of(root), 128 * SGM_MiB);
  remove_root(root);
}

/* ------------------------------------------------------------------------ */
/* No cgroup at all, the real root, physical RAM. */

static void test_no_cgroup_file(void **state) {
  (void)state;
  sgm_test_clean_env();
  char root[64];
  make_root(root, sizeof root);
  assert_int_equal(limit_of(root), 0);
  /* A cgroup file with no usable line. */
  write_file(root, "proc/self/cgroup", "garbage\n\n3:cpu:relative\n");
  assert_int_equal(limit_of(root), 0);
  /* The v2 line with no files under /sys at all. */
  write_file(root, "proc/self/cgroup", "0::/job\n");
  assert_int_equal(limit_of(root), 0);
  remove_root(root);
  assert_int_equal(sgm__host_cgroup_limit(root, NULL), SGM_ERR_INVALID);
}

/* The real machine's files read without error ("" and NULL both mean "/"). */
static void test_real_root(void **state) {
  (void)state;
  sgm_test_clean_env();
  uint64_t a = 1, b = 2;
  assert_int_equal(sgm__host_cgroup_limit("", &a), SGM_OK);
  assert_int_equal(sgm__host_cgroup_limit(NULL, &b), SGM_OK);
  assert_int_equal(a, b);
  uint64_t machine = sgm__host_machine_ram();
  uint64_t phys = sgm__host_physical_ram("");
  print_message("# cgroup limit %llu, physical RAM %llu\n", (unsigned long long)a,
                (unsigned long long)phys);
  assert_true(phys > 0);
  assert_true(phys <= machine);
  if (a) assert_true(phys <= a);
}

/* Physical RAM is the smaller of the machine's and the cgroup's. */
static void test_physical_ram_is_min(void **state) {
  (void)state;
  sgm_test_clean_env();
  uint64_t machine = sgm__host_machine_ram();
  assert_true(machine > 64 * SGM_MiB);
  char root[64], buf[64];
  make_root(root, sizeof root);
  assert_int_equal(sgm__host_physical_ram(root), machine); /* no cgroup */
  write_file(root, "proc/self/cgroup", "0::/job\n");
  write_file(root, "sys/fs/cgroup/job/memory.max", "67108864\n");
  assert_int_equal(sgm__host_physical_ram(root), 64 * SGM_MiB);
  snprintf(buf, sizeof buf, "%llu\n", (unsigned long long)(machine * 2));
  write_file(root, "sys/fs/cgroup/job/memory.max", buf);
  assert_int_equal(sgm__host_physical_ram(root), machine);
  write_file(root, "sys/fs/cgroup/job/memory.max", "max\n");
  assert_int_equal(sgm__host_physical_ram(root), machine);
  remove_root(root);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_machine_ram),
      cmocka_unit_test(test_machine_ram_probed_once),
      cmocka_unit_test(test_v2_limit),
      cmocka_unit_test(test_v2_max_is_no_limit),
      cmocka_unit_test(test_v2_nested_ancestors),
      cmocka_unit_test(test_v2_missing_dir_falls_back_to_mount_root),
      cmocka_unit_test(test_v2_malformed_is_no_limit),
      cmocka_unit_test(test_v1_limit),
      cmocka_unit_test(test_v1_huge_is_no_limit),
      cmocka_unit_test(test_v1_missing_dir_falls_back_to_mount_root),
      cmocka_unit_test(test_no_cgroup_file),
      cmocka_unit_test(test_real_root),
      cmocka_unit_test(test_physical_ram_is_min),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
