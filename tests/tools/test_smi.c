/*
 * test_smi.c — sgm-smi against a known registry: this process joins a
 * registry twice (two slots, two names) and publishes fixed figures, then
 * runs the sgm-smi binary (TEST_SGM_SMI) and checks the table, the JSON document,
 * the Prometheus text format, the --record CSV, --watch under tmux, and the
 * exit codes for "no sgm process" and "registry unreadable".
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"
#include "sgm.h"
#include "test_util.h"

#define MiB (UINT64_C(1) << 20)
#define GiB (UINT64_C(1) << 30)

static char dir[64];
static const char *smi;
static sgm_node *train, *serve;
static char uuid_text[SGM_NODE_UUID_TEXT + 4]; /* "GPU-<uuid>" of the known registry */

/* Run sgm-smi with args (a shell fragment); its stdout into out, its exit code. */
static int run_smi(const char *args, char *out, size_t len) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "'%s' --dir '%s' %s 2>&1", smi, dir, args);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(out, 1, len - 1, p);
  out[n] = '\0';
  int st = pclose(p);
  assert_true(WIFEXITED(st));
  return WEXITSTATUS(st);
}

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
  sgm__node_publish(n, &u);
  return n;
}

static int setup(void **state) {
  (void)state;
  sgm_test_clean_env();
  smi = getenv("TEST_SGM_SMI");
  assert_non_null(smi);
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
  train = join_as("train", 6 * GiB, 6 * GiB, 512 * MiB, 3);
  serve = join_as("serve", 1 * GiB, 2 * GiB, 0, 0);
}

static void leave_known(void) {
  sgm__node_leave(serve);
  sgm__node_leave(train);
}

/* The table: one line per process with its figures, totals against the
 * device and the shared cap. */
static void test_table(void **state) {
  (void)state;
  known_registry();
  char out[8192];
  assert_int_equal(run_smi("", out, sizeof out), 0);
  print_message("%s", out);
  char head[256];
  snprintf(head, sizeof head, "Device emu-smi   UUID %s   PCI 0000:65:00.0   2 processes   device "
           "8.00 GiB   shared cap 16.00 GiB", uuid_text);
  assert_non_null(strstr(out, head));
  char line[160];
  snprintf(line, sizeof line, "%8d  %-16s %23s  %23s", getpid(), "train", "6.00 GiB / 6.00 GiB",
           "512.00 MiB / 8.00 GiB");
  assert_non_null(strstr(out, line));
  snprintf(line, sizeof line, "%8d  %-16s %23s", getpid(), "serve", "1.00 GiB / 2.00 GiB");
  assert_non_null(strstr(out, line));
  assert_non_null(strstr(out, "7.00 GiB / 8.00 GiB")); /* total VRAM / device */
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
  snprintf(dev, sizeof dev, "\"key\": \"emu-smi\", \"uuid\": \"%s\", \"pci_bus_id\": \"0000:65:00.0\", "
           "\"version\": %u, \"n_slots\": 128, \"device_total_bytes\": 8589934592, "
           "\"shared_cap_bytes\": 17179869184, \"n_processes\": 2", uuid_text, SGM_NODE_VERSION);
  assert_non_null(strstr(out, dev));
  assert_non_null(strstr(out, "\"totals\": {\"vram_used_bytes\": 7516192768, \"shared_used_bytes\": "
                              "536870912, \"disk_used_bytes\": 0}"));
  char frag[256];
  snprintf(frag, sizeof frag, "{\"pid\": %d, \"start_ticks\": %llu, \"name\": \"train\", \"mode\": \"fair\"",
           getpid(), (unsigned long long)sgm__node_start_ticks_of_self());
  assert_non_null(strstr(out, frag));
  assert_non_null(strstr(out, "\"vram\": {\"used_bytes\": 6442450944, \"committed_bytes\": 0, "
                              "\"budget_bytes\": 6442450944, \"peak_bytes\": 6442450944}"));
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

/* Prometheus text format: every sample line is NAME{LABELS} VALUE and
 * follows its metric's HELP and TYPE lines. */
static void test_prometheus(void **state) {
  (void)state;
  known_registry();
  char out[16384];
  assert_int_equal(run_smi("--prometheus", out, sizeof out), 0);
  char sample[300];
  snprintf(sample, sizeof sample, "sgm_vram_used_bytes{device=\"emu-smi\",uuid=\"%s\",pci_bus_id=\"0000:65:00.0\","
           "pid=\"%d\",name=\"train\"} 6442450944\n", uuid_text, getpid());
  assert_non_null(strstr(out, sample));
  snprintf(sample, sizeof sample, "sgm_processes{device=\"emu-smi\",uuid=\"%s\",pci_bus_id=\"0000:65:00.0\"} 2\n",
           uuid_text);
  assert_non_null(strstr(out, sample));
  assert_non_null(strstr(out, "# TYPE sgm_fallbacks_total counter\n"));
  char typed[64] = "";
  for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
    if (strncmp(line, "# HELP ", 7) == 0) continue;
    if (strncmp(line, "# TYPE ", 7) == 0) {
      sscanf(line + 7, "%63s", typed);
      continue;
    }
    size_t name_len = strspn(line, "abcdefghijklmnopqrstuvwxyz_");
    assert_true(name_len > 0);
    assert_int_equal(strncmp(line, typed, strlen(typed)), 0); /* under its TYPE line */
    const char *p = line + name_len;
    if (*p == '{') {
      p = strchr(p, '}');
      assert_non_null(p);
      p++;
    }
    assert_int_equal(*p, ' ');
    p++;
    assert_true(strlen(p) > 0);
    assert_int_equal(strspn(p, "0123456789"), strlen(p));
  }
  leave_known();
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
      snprintf(tail, sizeof tail, ",train,6442450944,6442450944,536870912,8589934592,0,6442450944,3,0,"
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

/* An unreadable registry: exit 2, and the reason on stderr. */
static void test_unreadable(void **state) {
  (void)state;
  char path[256], out[4096];
  snprintf(path, sizeof path, "%s/sgm-node-emu-broken", dir);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  assert_true(fd >= 0);
  char junk[1024];
  memset(junk, 0x42, sizeof junk);
  assert_int_equal(write(fd, junk, sizeof junk), (ssize_t)sizeof junk);
  close(fd);
  assert_int_equal(run_smi("", out, sizeof out), 2);
  assert_non_null(strstr(out, "bad magic"));
  assert_int_equal(run_smi("--json", out, sizeof out), 2);
  assert_non_null(strstr(out, "\"error\": \"not an sgm node segment (bad magic)\""));
  chmod(path, 0644);
  assert_int_equal(run_smi("", out, sizeof out), 2);
  assert_non_null(strstr(out, "grants more than"));
  unlink(path);
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
      cmocka_unit_test(test_record),         cmocka_unit_test(test_unreadable),
      cmocka_unit_test(test_watch_under_tmux),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
