/*
 * test_nodeview.c — the public registry reader (include/sgm/node.h): a
 * registry written by two processes' contexts read back (list, device,
 * processes, liveness, versioned record sizes), corrupt records, records
 * from another sgm version, unsafe files, a missing folder.
 * The processes are forked children holding a context until told to go.
 */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"
#include "sgm.h"
#include "sgm/node.h"
#include "test_util.h"

#define MiB (UINT64_C(1) << 20)

static char nv_dir[64];

static void nv_setup(const char *device) {
  sgm_test_clean_env();
  snprintf(nv_dir, sizeof nv_dir, "/tmp/sgm-nodeview-XXXXXX");
  assert_non_null(mkdtemp(nv_dir));
  setenv("SGM_NODE", "on", 1);
  setenv("SGM_NODE_DIR", nv_dir, 1);
  setenv("SGM_EMU_DEVICE", device, 1);
  setenv("SGM_EMU_VRAM", "16MiB", 1);
  setenv("SGM_NODE_PERIOD_MS", "10000", 1); /* no ticker reclaims behind the test's back */
}

static void nv_teardown(void) {
  DIR *d = opendir(nv_dir);
  struct dirent *e;
  char p[512];
  while (d && (e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    snprintf(p, sizeof p, "%s/%s", nv_dir, e->d_name);
    unlink(p);
  }
  if (d) closedir(d);
  rmdir(nv_dir);
  unsetenv("SGM_NODE_DIR");
  unsetenv("SGM_NODE");
  unsetenv("SGM_EMU_DEVICE");
  unsetenv("SGM_NODE_PERIOD_MS");
}

/* A child with a context on the environment's device: joined once it
 * answers; it leaves (destroys the context) when its pipe closes. */
typedef struct nv_kid {
  pid_t pid;   /* the child */
  int to_kid;  /* closing it ends the child */
} nv_kid;

static nv_kid nv_kid_start(void) {
  int up[2], down[2];
  assert_int_equal(pipe(up), 0);
  assert_int_equal(pipe(down), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    sgm_context *c = NULL;
    char ok = sgm_context_create(NULL, &c) == SGM_OK;
    if (write(up[1], &ok, 1) != 1) _exit(2);
    char x;
    while (read(down[0], &x, 1) > 0) {
    }
    sgm_context_destroy(c);
    _exit(0);
  }
  close(up[1]);
  close(down[0]);
  char ok = 0;
  assert_int_equal(read(up[0], &ok, 1), 1);
  assert_true(ok);
  close(up[0]);
  return (nv_kid){pid, down[1]};
}

static void nv_kid_stop(nv_kid *k) {
  close(k->to_kid);
  int st = 0;
  assert_int_equal(waitpid(k->pid, &st, 0), k->pid);
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static sgm_node_device nv_device(void) {
  sgm_node_device d;
  memset(&d, 0x5a, sizeof d);
  d.struct_size = sizeof d;
  return d;
}

/* Invariant: a registry written by two processes' contexts reads back as
 * one device (its key, UUID, total, version) with both processes alive, in
 * slot order, each with its pid, name and budgets; n_processes counts both
 * even when max_procs holds one; a larger caller record (a newer header)
 * gets its tail zeroed and keeps its struct_size; a smaller one is refused. */
static void test_two_processes(void **state) {
  (void)state;
  nv_setup("nvtwo");
  /* The child first: a fork of a process whose context threads may hold the
   * sanitizer allocator's lock would deadlock in the child's malloc. */
  nv_kid kid = nv_kid_start();
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);

  sgm_node_entry list[4];
  size_t n = 99;
  assert_int_equal(sgm_node_list(NULL, list, 4, &n), SGM_OK); /* NULL: SGM_NODE_DIR */
  assert_int_equal(n, 1);
  char want[256];
  snprintf(want, sizeof want, "%s/sgm-node-emu-nvtwo", nv_dir);
  assert_string_equal(list[0].path, want);

  sgm_node_device d = nv_device();
  sgm_node_process p[4];
  memset(p, 0x5a, sizeof p);
  p[0].struct_size = sizeof p[0];
  assert_int_equal(sgm_node_read(list[0].path, 0, &d, p, 4), SGM_OK);
  assert_int_equal(d.struct_size, sizeof d);
  assert_string_equal(d.key, "emu-nvtwo");
  assert_int_equal(strlen(d.uuid_text), 36);
  assert_int_equal(d.version, SGM_NODE_VERSION);
  assert_true(d.n_slots >= 2);
  assert_int_equal(d.device_total_bytes, 16 * MiB);
  assert_true(d.shared_cap_bytes > 0);
  assert_int_equal(d.n_processes, 2);
  assert_int_equal(d.n_unstable, 0);
  assert_int_not_equal(p[0].slot, p[1].slot); /* a record each */
  assert_int_equal(p[0].pid, kid.pid);        /* join order: the kid joined first */
  assert_int_equal(p[0].uid, geteuid());
  assert_true(p[0].pid_ns != 0);
  bool seen_self = false, seen_kid = false;
  for (int i = 0; i < 2; i++) {
    assert_true(p[i].alive);
    assert_true(p[i].name[0] != '\0');
    assert_true(p[i].budget_bytes[SGM_TIER_VRAM] > 0);
    assert_true(p[i].weight > 0);
    seen_self |= p[i].pid == getpid();
    seen_kid |= p[i].pid == kid.pid;
  }
  assert_true(seen_self && seen_kid);
  /* Records past n_processes are zeroed. */
  assert_int_equal(p[2].pid, 0);
  assert_int_equal(p[3].alive, 0);

  /* Room for one: both counted, one written. */
  sgm_node_process one[1];
  one[0].struct_size = sizeof one[0];
  assert_int_equal(sgm_node_read(list[0].path, 0, &d, one, 1), SGM_OK);
  assert_int_equal(d.n_processes, 2);
  assert_int_equal(one[0].slot, p[0].slot);
  /* No room: the device and the count only. */
  assert_int_equal(sgm_node_read(list[0].path, 0, &d, NULL, 0), SGM_OK);
  assert_int_equal(d.n_processes, 2);

  /* A newer header's larger records: the stride is struct_size, the tails zero. */
  struct big {
    sgm_node_process p;
    uint64_t later[3];
  } b[2];
  memset(b, 0x5a, sizeof b);
  b[0].p.struct_size = sizeof b[0];
  struct bigdev {
    sgm_node_device d;
    uint64_t later[2];
  } bd;
  memset(&bd, 0x5a, sizeof bd);
  bd.d.struct_size = sizeof bd;
  assert_int_equal(sgm_node_read(list[0].path, 0, &bd.d, &b[0].p, 2), SGM_OK);
  assert_int_equal(bd.d.struct_size, sizeof bd);
  assert_int_equal(bd.later[0] | bd.later[1], 0);
  assert_int_equal(b[0].p.struct_size, sizeof b[0]);
  assert_int_equal(b[1].p.pid, p[1].pid);
  assert_int_equal(b[1].p.slot, p[1].slot);
  assert_int_equal(b[0].later[2] | b[1].later[0], 0);

  /* Smaller than the first version: refused, named. */
  d.struct_size = 8;
  assert_int_equal(sgm_node_read(list[0].path, 0, &d, NULL, 0), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "struct_size"));
  d = nv_device();
  p[0].struct_size = 16;
  assert_int_equal(sgm_node_read(list[0].path, 0, &d, p, 4), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "procs[0].struct_size"));

  /* The child leaves: one process left. */
  nv_kid_stop(&kid);
  d = nv_device();
  assert_int_equal(sgm_node_read(list[0].path, SGM_NODE_READ_DEAD, &d, NULL, 0), SGM_OK);
  assert_int_equal(d.n_processes, 1);
  sgm_context_destroy(ctx);
  nv_teardown();
}

/* Invariant: a process killed without leaving is not listed (its liveness
 * lock is gone) unless SGM_NODE_READ_DEAD asks, and then with alive = 0. */
static void test_dead_process(void **state) {
  (void)state;
  nv_setup("nvdead");
  /* The child first: a fork of a process whose context threads may hold the
   * sanitizer allocator's lock would deadlock in the child's malloc. */
  nv_kid kid = nv_kid_start();
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  kill(kid.pid, SIGKILL);
  waitpid(kid.pid, NULL, 0);
  close(kid.to_kid);
  char path[256];
  snprintf(path, sizeof path, "%s/sgm-node-emu-nvdead", nv_dir);
  sgm_node_device d = nv_device();
  sgm_node_process p[2];
  p[0].struct_size = sizeof p[0];
  assert_int_equal(sgm_node_read(path, 0, &d, p, 2), SGM_OK);
  assert_int_equal(d.n_processes, 1);
  assert_int_equal(p[0].pid, getpid());
  assert_int_equal(sgm_node_read(path, SGM_NODE_READ_DEAD, &d, p, 2), SGM_OK);
  assert_int_equal(d.n_processes, 2);
  int dead = p[0].pid == kid.pid ? 0 : 1;
  assert_int_equal(p[dead].pid, kid.pid);
  assert_false(p[dead].alive);
  assert_true(p[1 - dead].alive);
  sgm_context_destroy(ctx);
  nv_teardown();
}

static void nv_write(const char *path, const void *bytes, size_t len, mode_t mode) {
  unlink(path);
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, mode);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, bytes, len), (ssize_t)len);
  fchmod(fd, mode);
  close(fd);
}

/* Invariant: records that are corrupt, of an older or a newer sgm, or
 * writable by others are skipped and counted (n_refused), never a failure
 * of the read and never a hang: the good process is still listed. A
 * record's copy counts only while its lock is held (a live writer). */
static void test_bad_records(void **state) {
  (void)state;
  nv_setup("nvbad");
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  char reg[256], path[300];
  snprintf(reg, sizeof reg, "%s/sgm-node-emu-nvbad", nv_dir);
  snprintf(path, sizeof path, "%s/sgm-node-emu-nvbad@bad", nv_dir);
  unsigned char good[SGM_NODE_RECORD_BYTES], bad[SGM_NODE_RECORD_BYTES];
  {
    DIR *d = opendir(nv_dir);
    struct dirent *e;
    bool found = false;
    while ((e = readdir(d)) != NULL && !found) {
      if (strncmp(e->d_name, "sgm-node-emu-nvbad@", 19) != 0) continue;
      char p[300];
      snprintf(p, sizeof p, "%s/%.200s", nv_dir, e->d_name);
      int fd = open(p, O_RDONLY);
      found = read(fd, good, sizeof good) == (ssize_t)sizeof good;
      close(fd);
    }
    closedir(d);
    assert_true(found);
  }
  struct {
    const char *what;
    size_t off, n;
    uint8_t value;
    mode_t mode;
    size_t listed, refused;
  } cases[] = {
      {"garbage", 0, 8, 0x5a, 0600, 1, 1},
      {"check word", 24, 1, 0x77, 0600, 1, 1},
      {"newer sgm", 8, 1, SGM_NODE_VERSION + 1, 0600, 1, 1},
      {"older sgm", 8, 1, SGM_NODE_VERSION - 1, 0600, 1, 1},
      {"writable by others", 0, 0, 0, 0666, 1, 1},
      {"a live copy", 0, 0, 0, 0600, 2, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    memcpy(bad, good, sizeof bad);
    memset(bad + cases[i].off, cases[i].value, cases[i].n);
    nv_write(path, bad, sizeof bad, cases[i].mode);
    int fd = open(path, O_RDWR);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    assert_int_equal(fcntl(fd, F_OFD_SETLK, &fl), 0); /* its writer lives */
    sgm_node_device d = nv_device();
    sgm_node_process p[2];
    p[0].struct_size = sizeof p[0];
    assert_int_equal(sgm_node_read(reg, 0, &d, p, 2), SGM_OK);
    print_message("# %s: %zu listed, %zu refused\n", cases[i].what, d.n_processes, d.n_refused);
    assert_int_equal(d.n_processes, cases[i].listed);
    assert_int_equal(d.n_refused, cases[i].refused);
    assert_int_equal(p[0].pid, getpid());
    close(fd); /* its writer dies: the copy no longer counts */
    assert_int_equal(sgm_node_read(reg, 0, &d, p, 2), SGM_OK);
    assert_int_equal(d.n_processes, 1);
  }
  /* The listing names the registry once. */
  size_t n = 0;
  assert_int_equal(sgm_node_list(nv_dir, NULL, 0, &n), SGM_OK);
  assert_int_equal(n, 1);
  sgm_context_destroy(ctx);
  nv_teardown();
}

/* Invariant: an empty registry folder lists nothing without an error; a
 * folder that does not exist, a file that does not, and NULL arguments are
 * SGM_ERR_INVALID with a message saying which, and the out-parameters are
 * zero. */
static void test_missing(void **state) {
  (void)state;
  size_t n = 7;
  assert_int_equal(sgm_node_list("/nonexistent/sgm-registry", NULL, 0, &n), SGM_ERR_INVALID);
  assert_int_equal(n, 0);
  assert_non_null(strstr(sgm_last_error(), "does not exist"));
  assert_non_null(strstr(sgm_last_error(), "SGM_NODE_DIR"));
  assert_int_equal(sgm_node_list("/etc/hostname", NULL, 0, &n), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "not a folder"));
  /* An empty folder: no registry, no error. */
  char empty[] = "/tmp/sgm-nodeview-empty-XXXXXX";
  assert_non_null(mkdtemp(empty));
  n = 7;
  assert_int_equal(sgm_node_list(empty, NULL, 0, &n), SGM_OK);
  assert_int_equal(n, 0);
  rmdir(empty);
  assert_int_equal(sgm_node_list(NULL, NULL, 0, NULL), SGM_ERR_INVALID);
  sgm_node_entry e[1];
  assert_int_equal(sgm_node_list(NULL, NULL, 1, &n), SGM_ERR_INVALID);
  (void)e;
  sgm_node_device d = nv_device();
  assert_int_equal(sgm_node_read("/nonexistent/sgm-node-x", 0, &d, NULL, 0), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "sgm_node_list"));
  assert_int_equal(d.n_processes, 0);
  assert_int_equal(sgm_node_read(NULL, 0, &d, NULL, 0), SGM_ERR_INVALID);
  assert_int_equal(sgm_node_read("/x", 0, NULL, NULL, 0), SGM_ERR_INVALID);
  assert_int_equal(sgm_node_read("/x", 0, &d, NULL, 3), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "procs is NULL"));
}

/* Read this process's record from the environment's registry (a tick first). */
static void nv_self(sgm_context *ctx, sgm_node_process *me) {
  assert_true(sgm__share_tick_sync(ctx));
  sgm_node_entry list[2];
  size_t n = 0;
  assert_int_equal(sgm_node_list(NULL, list, 2, &n), SGM_OK);
  assert_int_equal(n, 1);
  sgm_node_device d = nv_device();
  sgm_node_process p[2];
  memset(p, 0, sizeof p);
  p[0].struct_size = sizeof p[0];
  assert_int_equal(sgm_node_read(list[0].path, 0, &d, p, 2), SGM_OK);
  assert_int_equal(d.n_processes, 1);
  *me = p[0];
}

/* Invariant (issue 27): an interposer's own driver VRAM (sgm_interpose_vram)
 * is published as the process's VRAM used and committed, with the
 * "interposed" mark, and comes off again; taking back more than is accounted
 * changes nothing. sgm_alloc_shared serves shared memory at once, counted as
 * a fallback and published as shared bytes. A context nobody interposes is
 * not marked. */
static void test_interposed_process(void **state) {
  (void)state;
  nv_setup("nvint");
  sgm_context *ctx = NULL;
  assert_int_equal(sgm_context_create(NULL, &ctx), SGM_OK);
  sgm_node_process me;
  nv_self(ctx, &me);
  assert_int_equal(me.interposed, 0);
  uint64_t vram0 = me.used_bytes[SGM_TIER_VRAM];

  assert_int_equal(sgm_interpose_vram(ctx, (int64_t)(3 * MiB)), SGM_OK);
  assert_int_equal(sgm_interpose_vram(ctx, -(int64_t)(4 * MiB)), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "nothing changed"));
  assert_null(sgm_alloc_shared(ctx, 0, NULL));
  assert_null(sgm_alloc_shared(NULL, 1, NULL));
  void *p = sgm_alloc_shared(ctx, MiB, NULL);
  assert_non_null(p);
  assert_int_equal(sgm_pointer_tier(ctx, p), SGM_TIER_SHARED);
  sgm_stats st;
  assert_int_equal(sgm_get_stats(ctx, &st), SGM_OK);
  assert_int_equal(st.n_fallbacks, 1);
  assert_int_equal(st.fallback_bytes, MiB);
  assert_int_equal(st.tier[SGM_TIER_VRAM].used_bytes, vram0); /* the interposed bytes are not sgm's */
  nv_self(ctx, &me);
  assert_int_equal(me.interposed, 1);
  assert_int_equal(me.used_bytes[SGM_TIER_VRAM], vram0 + 3 * MiB);
  assert_true(me.peak_bytes[SGM_TIER_VRAM] >= 3 * MiB);
  assert_true(me.committed_bytes[SGM_TIER_VRAM] >= 3 * MiB);
  assert_true(me.used_bytes[SGM_TIER_SHARED] >= MiB);
  assert_int_equal(me.n_fallbacks, 1);

  sgm_free(ctx, p, NULL);
  assert_int_equal(sgm_interpose_vram(ctx, -(int64_t)(3 * MiB)), SGM_OK);
  nv_self(ctx, &me);
  assert_int_equal(me.interposed, 1); /* once interposed, always shown so */
  assert_int_equal(me.used_bytes[SGM_TIER_VRAM], vram0);
  assert_int_equal(me.used_bytes[SGM_TIER_SHARED], 0);
  assert_true(me.peak_bytes[SGM_TIER_VRAM] >= 3 * MiB); /* a peak stays */
  sgm_context_destroy(ctx);
  nv_teardown();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_processes),
      cmocka_unit_test(test_dead_process),
      cmocka_unit_test(test_bad_records),
      cmocka_unit_test(test_missing),
      cmocka_unit_test(test_interposed_process),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
