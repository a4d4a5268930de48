/*
 * test_smi.c — sgm-smi against a known registry: this process joins a
 * registry twice (two slots, two names) and publishes fixed figures, then
 * runs the sgm-smi binary (TEST_SGM_SMI) and checks the table (80 columns),
 * the JSON document, the Prometheus text format (with the strict checker
 * TEST_CHECK_PROMETHEUS, also for two processes in two PID namespaces), the
 * --record CSV (and a write that fails), --watch under tmux, hostile names
 * in the registry folder, and the exit codes.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"
#include "sgm.h"
#include "test_util.h"

#define MiB (UINT64_C(1) << 20)
#define GiB (UINT64_C(1) << 30)

static char dir[64];
static const char *smi, *checker;
static sgm_node *train, *serve;
static char uuid_text[SGM_NODE_UUID_TEXT + 4]; /* "GPU-<uuid>" of the known registry */

/* Run sgm-smi with args (a shell fragment); its stdout into out, its exit code. */
static int run_smi(const char *args, char *out, size_t len) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "timeout 20 '%s' --dir '%s' %s 2>&1", smi, dir, args);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(out, 1, len - 1, p);
  out[n] = '\0';
  int st = pclose(p);
  assert_true(WIFEXITED(st));
  return WEXITSTATUS(st);
}

/* The device's used memory every joined process publishes (the driver's
 * figure, everyone's): known_registry's processes hold 8 GiB of it, the
 * rest is outside sgm. 0 = not published. */
static uint64_t device_used;

static sgm_node *join_as(const char *name, uint64_t vram_used, uint64_t vram_budget,
                         uint64_t shared_used, uint64_t fallbacks) {
  sgm_node_params p = {.dir = dir, .key = "emu-smi", .name = name, .device_total_bytes = 8 * GiB,
                       .shared_cap_bytes = 16 * GiB, .pci_bus_id = "0000:65:00.0"};
  sgm__node_uuid_derive("smi", p.uuid);
  char text[SGM_NODE_UUID_TEXT];
  sgm__node_uuid_format(p.uuid, text, sizeof text);
  snprintf(uuid_text, sizeof uuid_text, "GPU-%s", text);
  sgm_node *n = NULL;
  assert_int_equal(sgm__node_join(&p, &n), SGM_OK);
  sgm_node_usage u = {0};
  u.w[SGM_NODE_F_USED + SGM_TIER_VRAM] = vram_used;
  u.w[SGM_NODE_F_BUDGET + SGM_TIER_VRAM] = vram_budget;
  u.w[SGM_NODE_F_PEAK + SGM_TIER_VRAM] = vram_used;
  u.w[SGM_NODE_F_USED + SGM_TIER_SHARED] = shared_used;
  u.w[SGM_NODE_F_BUDGET + SGM_TIER_SHARED] = 8 * GiB;
  u.w[SGM_NODE_F_FALLBACKS] = fallbacks;
  u.w[SGM_NODE_F_WEIGHT] = 1;
  u.w[SGM_NODE_F_HEARTBEAT] = sgm__clock_monotonic_ns();
  u.w[SGM_NODE_F_COMMITTED + SGM_TIER_VRAM] = vram_used; /* held from the driver */
  u.w[SGM_NODE_F_DEVICE_USED] = device_used;
  sgm__node_publish(n, &u);
  return n;
}

static int setup(void **state) {
  (void)state;
  sgm_test_clean_env();
  smi = getenv("TEST_SGM_SMI");
  assert_non_null(smi);
  checker = getenv("TEST_CHECK_PROMETHEUS");
  assert_non_null(checker);
  unsetenv("POD_NAMESPACE"); /* the Kubernetes labels come from the test's own workers */
  unsetenv("POD_NAME");
  unsetenv("CONTAINER_NAME");
  snprintf(dir, sizeof dir, "/tmp/sgm-smi-test-XXXXXX");
  assert_non_null(mkdtemp(dir));
  return 0;
}

static int teardown(void **state) {
  (void)state;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  assert_int_equal(system(cmd), 0);
  return 0;
}

/* No registry, or one with nobody alive: exit 1 and say so. */
static void test_no_process(void **state) {
  (void)state;
  char out[4096];
  assert_int_equal(run_smi("", out, sizeof out), 1);
  assert_non_null(strstr(out, "No sgm process"));
  assert_int_equal(run_smi("--json", out, sizeof out), 1);
  assert_non_null(strstr(out, "\"devices\": []"));
}

static void known_registry(void) {
  device_used = 8 * GiB + 512 * MiB; /* 512 MiB outside sgm */
  train = join_as("train", 7 * GiB, 6 * GiB, 512 * MiB, 3); /* over its budget: giving back */
  serve = join_as("serve", 1 * GiB, 2 * GiB, 0, 0);
  device_used = 0;
}

static void leave_known(void) {
  sgm__node_leave(serve);
  sgm__node_leave(train);
}

/* The table: one line per process with its figures (USER, container,
 * over-budget mark), totals against the device and the shared cap; no
 * line wider than 80 columns; details under -v. */
static void test_table(void **state) {
  (void)state;
  known_registry();
  char out[8192];
  assert_int_equal(run_smi("", out, sizeof out), 0);
  print_message("%s", out);
  assert_non_null(strstr(out, "Device emu-smi  2 processes  memory 8.00G  shared cap 16.0G\n"));
  char line[160];
  snprintf(line, sizeof line, "%7d %-8s %-12s %-15s %11s %11s %6d !\n", getpid(), "root", "-", "train",
           "7.00G/6.00G", "512M/8.00G", 3);
  if (geteuid() != 0) memcpy(line + 8, "        ", 8); /* the user column is checked as root only */
  assert_non_null(strstr(out, geteuid() == 0 ? line : line + 16));
  snprintf(line, sizeof line, "%-15s %11s %11s %6d\n", "serve", "1.00G/2.00G", "0/8.00G", 0);
  assert_non_null(strstr(out, line));
  assert_non_null(strstr(out, "TOTAL           8.00G/8.00G  512M/16.0G")); /* totals / device, cap */
  assert_non_null(strstr(out, "! over its budget"));
  snprintf(line, sizeof line, "%7s %-8s %-12s %-15s %11s\n", "-", "-", "-", "(not sgm)", "512M");
  assert_non_null(strstr(out, line)); /* the device's used 8.5 GiB less sgm's 8 GiB */
  for (char *l = out; *l;) { /* 80 columns */
    char *nl = strchr(l, '\n');
    size_t w = nl ? (size_t)(nl - l) : strlen(l);
    assert_true(w <= 80);
    l += w + (nl != NULL);
  }
  assert_int_equal(run_smi("-v", out, sizeof out), 0);
  print_message("%s", out);
  char uuid_line[128];
  snprintf(uuid_line, sizeof uuid_line, "  UUID %s  PCI 0000:65:00.0\n", uuid_text);
  assert_non_null(strstr(out, uuid_line));
  assert_non_null(strstr(out, "pid_ns "));
  leave_known();
  assert_int_equal(run_smi("", out, sizeof out), 1); /* gone with their owners */
}

/* The JSON document: the schema's fields with the published values, and
 * well-formed (braces and brackets balance outside strings). */
static void test_json(void **state) {
  (void)state;
  known_registry();
  char out[16384];
  assert_int_equal(run_smi("--json", out, sizeof out), 0);
  print_message("%s", out);
  assert_non_null(strstr(out, "{\"schema\": \"sgm-smi/1\""));
  char dev[512];
  snprintf(dev, sizeof dev, "\"key\": \"emu-smi\", \"outside_sgm_bytes\": 536870912, \"uuid\": \"%s\", \"pci_bus_id\": \"0000:65:00.0\", "
           "\"version\": %u, \"n_slots\": 128, \"device_total_bytes\": 8589934592, "
           "\"shared_cap_bytes\": 17179869184, \"n_processes\": 2", uuid_text, SGM_NODE_VERSION);
  assert_non_null(strstr(out, dev));
  assert_non_null(strstr(out, "\"totals\": {\"vram_used_bytes\": 8589934592, \"shared_used_bytes\": "
                              "536870912, \"disk_used_bytes\": 0}"));
  char frag[256];
  snprintf(frag, sizeof frag, "{\"pid\": %d, \"pid_ns\": ", getpid());
  assert_non_null(strstr(out, frag));
  snprintf(frag, sizeof frag, "\"uid\": %u, ", (unsigned)geteuid());
  assert_non_null(strstr(out, frag));
  assert_non_null(strstr(out, "\"over_budget\": true, \"flags\": 0, "));
  snprintf(frag, sizeof frag, "\"start_ticks\": %llu, \"name\": \"train\", \"mode\": \"fair\"",
           (unsigned long long)sgm__node_start_ticks_of_self());
  assert_non_null(strstr(out, frag));
  assert_non_null(strstr(out, "\"vram\": {\"used_bytes\": 7516192768, \"committed_bytes\": 7516192768, "
                              "\"budget_bytes\": 6442450944, \"peak_bytes\": 7516192768}"));
  assert_non_null(strstr(out, "\"fallbacks\": 3, \"evictions\": 0"));
  assert_non_null(strstr(out, "\"errors\": []"));
  int depth = 0;
  bool in_str = false;
  for (const char *c = out; *c; c++) {
    if (in_str) {
      if (*c == '\\') c++;
      else if (*c == '"') in_str = false;
      continue;
    }
    if (*c == '"') in_str = true;
    else if (*c == '{' || *c == '[') depth++;
    else if (*c == '}' || *c == ']') assert_true(--depth >= 0);
  }
  assert_int_equal(depth, 0);
  assert_false(in_str);
  leave_known();
}

/* Run the strict exposition-format checker on text; its verdict (0 valid). */
static int check_prometheus(const char *text) {
  char file[128], cmd[512];
  snprintf(file, sizeof file, "%s/prom.txt", dir);
  FILE *f = fopen(file, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "python3 '%s' '%s'", checker, file);
  int st = system(cmd);
  unlink(file);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Prometheus text format: the samples with their labels (pid, its PID
 * namespace, uid, user, name), and the whole passes the strict checker. */
static void test_prometheus(void **state) {
  (void)state;
  known_registry();
  char out[16384];
  assert_int_equal(run_smi("--prometheus", out, sizeof out), 0);
  char sample[400];
  snprintf(sample, sizeof sample, "sgm_vram_used_bytes{device=\"emu-smi\",uuid=\"%s\",pci_bus_id=\"0000:65:00.0\","
           "pid=\"%d\",pid_ns=\"", uuid_text, getpid());
  assert_non_null(strstr(out, sample));
  assert_non_null(strstr(out, ",name=\"train\"} 7516192768\n"));
  snprintf(sample, sizeof sample, "sgm_processes{device=\"emu-smi\",uuid=\"%s\",pci_bus_id=\"0000:65:00.0\"} 2\n",
           uuid_text);
  assert_non_null(strstr(out, sample));
  assert_non_null(strstr(out, "# TYPE sgm_fallbacks_total counter\n"));
  assert_int_equal(check_prometheus(out), 0);
  /* The checker is strict: a repeated series fails it. */
  char dup[20000];
  const char *first = strstr(out, "sgm_vram_used_bytes{");
  const char *eol = strchr(first, '\n');
  snprintf(dup, sizeof dup, "%.*s%.*s%s", (int)(eol + 1 - out), out, (int)(eol + 1 - first), first, eol + 1);
  assert_int_equal(check_prometheus(dup), 1);
  leave_known();
}

/* In a forked child: a new PID namespace whose first process (pid 1 there)
 * joins as "worker" with the Kubernetes variables of its pod, and waits
 * for the pipe to close. Exit 77: no PID namespaces here. */
static void ns_worker(int ready, int hold, const char *pod) {
  if (unshare(CLONE_NEWPID) != 0) _exit(77);
  pid_t p = fork();
  if (p < 0) _exit(3);
  if (p > 0) {
    int st = 0;
    waitpid(p, &st, 0);
    _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 4);
  }
  setenv("POD_NAMESPACE", "lab", 1);
  setenv("POD_NAME", pod, 1);
  setenv("CONTAINER_NAME", "trainer", 1);
  sgm_node *n = join_as("worker", GiB, 2 * GiB, 0, 0);
  char ok = getpid() == 1 ? 'y' : 'n';
  if (write(ready, &ok, 1) != 1) _exit(5);
  char x;
  while (read(hold, &x, 1) > 0) {
  }
  sgm__node_leave(n);
  _exit(0);
}

/* Two containers (two PID namespaces) each run a process that is pid 1
 * with the same name: the series stay unique (pid_ns, and the pods'
 * labels), and the output passes the strict checker. Skipped, saying so,
 * where PID namespaces cannot be made (not root, no unshare). */
static void test_prometheus_two_pid_namespaces(void **state) {
  (void)state;
  int ready[2], hold[2];
  assert_int_equal(pipe(ready), 0);
  assert_int_equal(pipe(hold), 0);
  pid_t kids[2];
  const char *pods[2] = {"train-a", "train-b"};
  for (int i = 0; i < 2; i++) {
    kids[i] = fork();
    assert_true(kids[i] >= 0);
    if (kids[i] == 0) {
      close(ready[0]);
      close(hold[1]);
      ns_worker(ready[1], hold[0], pods[i]);
    }
  }
  close(ready[1]);
  close(hold[0]);
  char ok[2] = {0};
  ssize_t got = 0, r;
  while (got < 2 && (r = read(ready[0], ok + got, (size_t)(2 - got))) > 0) got += r;
  if (got < 2) {
    close(hold[1]);
    for (int i = 0; i < 2; i++) waitpid(kids[i], NULL, 0);
    print_message("# no PID namespaces here (unshare(CLONE_NEWPID) needs root): skipped\n");
    skip();
  }
  assert_int_equal(ok[0], 'y'); /* both really are pid 1 */
  assert_int_equal(ok[1], 'y');
  char out[16384];
  assert_int_equal(run_smi("--prometheus", out, sizeof out), 0);
  print_message("%s", strstr(out, "# HELP sgm_vram_used_bytes"));
  assert_non_null(strstr(out, "pid=\"1\""));
  assert_non_null(strstr(out, "namespace=\"lab\",pod=\"train-a\",container=\"trainer\""));
  assert_non_null(strstr(out, "namespace=\"lab\",pod=\"train-b\",container=\"trainer\""));
  assert_int_equal(check_prometheus(out), 0);
  close(hold[1]);
  for (int i = 0; i < 2; i++) {
    int st = 0;
    assert_int_equal(waitpid(kids[i], &st, 0), kids[i]);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  close(ready[0]);
}

/* --record: the header once, then one row per live process per sample,
 * 14 columns, time in seconds with 3 decimals. */
static void test_record(void **state) {
  (void)state;
  known_registry();
  char file[128], out[4096], args[256];
  snprintf(file, sizeof file, "%s/rec.csv", dir);
  snprintf(args, sizeof args, "--record '%s' --interval 1 --count 3", file);
  assert_int_equal(run_smi(args, out, sizeof out), 0);
  FILE *f = fopen(file, "r");
  assert_non_null(f);
  char line[512];
  assert_non_null(fgets(line, sizeof line, f));
  assert_string_equal(line, "time_s,device,pid,name,vram_used,vram_budget,shared_used,shared_budget,"
                            "disk_used,vram_peak,fallbacks,evictions,device_total,shared_cap\n");
  int rows = 0;
  while (fgets(line, sizeof line, f)) {
    rows++;
    int commas = 0;
    for (char *c = line; *c; c++) commas += *c == ',';
    assert_int_equal(commas, 13);
    char *dot = strchr(line, '.');
    assert_non_null(dot);
    assert_int_equal(strspn(dot + 1, "0123456789"), 3);
    assert_non_null(strstr(line, ",emu-smi,"));
    if (strstr(line, ",train,")) {
      char tail[128];
      snprintf(tail, sizeof tail, ",train,7516192768,6442450944,536870912,8589934592,0,7516192768,3,0,"
               "8589934592,17179869184\n");
      assert_non_null(strstr(line, tail));
    }
  }
  fclose(f);
  assert_int_equal(rows, 6);
  /* Appending again adds rows, not a second header. */
  snprintf(args, sizeof args, "--record '%s' --interval 1 --count 1", file);
  assert_int_equal(run_smi(args, out, sizeof out), 0);
  f = fopen(file, "r");
  int headers = 0, lines = 0;
  while (fgets(line, sizeof line, f)) {
    lines++;
    headers += strncmp(line, "time_s,", 7) == 0;
  }
  fclose(f);
  assert_int_equal(headers, 1);
  assert_int_equal(lines, 1 + 8);
  leave_known();
}

/* --record onto a full device: exit 3 and say so (never a run that
 * recorded nothing and exits 0). */
static void test_record_fails_loudly(void **state) {
  (void)state;
  known_registry();
  char out[4096];
  assert_int_equal(run_smi("--record /dev/full --interval 1 --count 2", out, sizeof out), 3);
  print_message("%s", out);
  assert_non_null(strstr(out, "cannot write to /dev/full"));
  assert_int_equal(run_smi("--prometheus >/dev/full", out, sizeof out), 3);
  leave_known();
}

/* A registry of an older layout: exit 2, and the reason on stderr. */
static void test_unreadable(void **state) {
  (void)state;
  char path[256], out[4096];
  snprintf(path, sizeof path, "%s/sgm-node-emu-broken", dir);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  assert_true(fd >= 0);
  unsigned char old[1024];
  memset(old, 0x42, sizeof old);
  memcpy(old, "SGMNODE\0\2\0\0\0", 12);
  assert_int_equal(write(fd, old, sizeof old), (ssize_t)sizeof old);
  close(fd);
  assert_int_equal(run_smi("", out, sizeof out), 2);
  assert_non_null(strstr(out, "older sgm"));
  assert_int_equal(run_smi("--json", out, sizeof out), 2);
  assert_non_null(strstr(out, "layout 2, written by an older sgm"));
  unlink(path);
}

/* Other users choose the bytes of the folder's names: a FIFO at a
 * registry's name hangs nothing, names with escape sequences and non-UTF-8
 * bytes reach neither the terminal nor the JSON raw, and 64 junk names that
 * sort first hide nothing. */
static void test_hostile_names(void **state) {
  (void)state;
  known_registry();
  char path[256], out[16384];
  snprintf(path, sizeof path, "%s/sgm-node-emu-aaa", dir);
  assert_int_equal(mkfifo(path, 0600), 0);
  snprintf(path, sizeof path, "%s/sgm-node-emu-aab@fifo", dir);
  assert_int_equal(mkfifo(path, 0600), 0);
  snprintf(path, sizeof path, "%s/sgm-node-\033]0;pwned\007\033[2J\xff\xfe@x", dir);
  int fd = open(path, O_WRONLY | O_CREAT, 0600);
  assert_true(fd >= 0);
  char zero[SGM_NODE_RECORD_BYTES] = {0};
  assert_int_equal(write(fd, zero, sizeof zero), (ssize_t)sizeof zero);
  close(fd);
  for (int i = 0; i < 64; i++) {
    snprintf(path, sizeof path, "%s/sgm-node-%02d-junk", dir, i);
    fd = open(path, O_WRONLY | O_CREAT, 0600);
    close(fd);
  }
  const char *modes[] = {"", "-v", "--json", "--prometheus"};
  for (size_t m = 0; m < 4; m++) {
    int code = run_smi(modes[m], out, sizeof out);
    assert_int_equal(code, 0); /* the real registry shown, nothing hangs (timeout 20) */
    assert_non_null(strstr(out, "train"));
    for (const unsigned char *c = (const unsigned char *)out; *c; c++)
      assert_true(*c == '\n' || (*c >= 0x20 && *c < 0x7f));
  }
  assert_int_equal(check_prometheus(out), 0);
  leave_known();
  char cmd[128];
  snprintf(cmd, sizeof cmd, "find '%s' -mindepth 1 -delete", dir);
  assert_int_equal(system(cmd), 0);
}

/* --watch in a terminal (tmux): the screen shows the table. Synchronised
 * with tmux wait-for, not with sleeps. */
static void test_watch_under_tmux(void **state) {
  (void)state;
  if (system("command -v tmux >/dev/null 2>&1") != 0) {
    print_message("# tmux not installed: --watch not tested here\n");
    skip();
  }
  known_registry();
  char cmd[1024], out[8192];
  char sess[64];
  snprintf(sess, sizeof sess, "sgm-smi-test-%d", getpid());
  snprintf(cmd, sizeof cmd,
           "tmux -L %s new-session -d -s %s -x 160 -y 40 \"'%s' --dir '%s' --watch --interval 1 --count 3; "
           "tmux -L %s wait-for -S %s-done; tmux -L %s wait-for %s-hold\" && tmux -L %s wait-for %s-done",
           sess, sess, smi, dir, sess, sess, sess, sess, sess, sess);
  assert_int_equal(system(cmd), 0);
  snprintf(cmd, sizeof cmd, "tmux -L %s capture-pane -p -t %s", sess, sess);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(out, 1, sizeof out - 1, p);
  out[n] = '\0';
  pclose(p);
  snprintf(cmd, sizeof cmd, "tmux -L %s kill-server", sess);
  assert_int_equal(system(cmd), 0);
  print_message("%s", out);
  assert_non_null(strstr(out, "Device emu-smi"));
  assert_non_null(strstr(out, "train"));
  assert_non_null(strstr(out, "serve"));
  /* Refreshed in place: one screen, not three tables one after the other. */
  const char *first = strstr(out, "Device emu-smi");
  assert_null(strstr(first + 1, "Device emu-smi"));
  leave_known();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_no_process),     cmocka_unit_test(test_table),
      cmocka_unit_test(test_json),           cmocka_unit_test(test_prometheus),
      cmocka_unit_test(test_prometheus_two_pid_namespaces),
      cmocka_unit_test(test_record),         cmocka_unit_test(test_record_fails_loudly),
      cmocka_unit_test(test_unreadable),     cmocka_unit_test(test_hostile_names),
      cmocka_unit_test(test_watch_under_tmux),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
