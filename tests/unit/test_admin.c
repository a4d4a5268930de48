/*
 * test_admin.c — the admin policy file (lib/admin.c): parsing (every key,
 * numeric ids, a bad line named with its number), applying it over the
 * environment and the program's code (forced options, the registry folder,
 * the group, the reservation), the per-user cap, and who may name another
 * policy file (SGM_ADMIN_CONF: root, or a root-only file where none is
 * installed; never a user's file, never past an installed one).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"
#include "sgm.h"
#include "test_util.h"

static char adir[64];

static const char *write_policy(const char *name, const char *text) {
  static char path[160];
  snprintf(path, sizeof path, "%s/%s", adir, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  return path;
}

static int setup(void **state) {
  (void)state;
  sgm_test_clean_env();
  snprintf(adir, sizeof adir, "/tmp/sgm-admin-test-XXXXXX");
  assert_non_null(mkdtemp(adir));
  assert_int_equal(chmod(adir, 0755), 0);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", adir);
  assert_int_equal(system(cmd), 0);
  return 0;
}

/* Invariant: a good file's every key lands; apply forces the options over
 * what the environment and the code set, names the registry folder and
 * group, and gives this user the admin's reservation. */
static void test_parse_and_apply(void **state) {
  (void)state;
  char text[512];
  snprintf(text, sizeof text,
           "# lab server\n\nregistry_dir = /srv/sgm/node   # bind-mounted into containers\n"
           "group = %u\nSGM_NODE = on\nSGM_SHARE_MODE = fair\nvram_cap = 50%%\n"
           "vram_cap.user.%u = 80%%\nvram_reserve.user.%u = 1GiB\nvram_cap.group.%u = 10%%\n",
           (unsigned)getegid(), (unsigned)geteuid(), (unsigned)geteuid(), (unsigned)getegid());
  const char *path = write_policy("good.conf", text);
  sgm_admin_policy *pol = calloc(1, sgm__admin_policy_bytes());
  assert_non_null(pol);
  assert_int_equal(sgm__admin_parse(path, pol), SGM_OK);
  setenv("SGM_NODE", "off", 1);
  sgm_config cfg;
  sgm_config_init(&cfg);
  assert_int_equal(cfg.node, 0); /* the environment's word... */
  cfg.share_mode = SGM_SHARE_SOLO; /* ...and the code's */
  assert_int_equal(sgm__admin_apply(pol, &cfg), SGM_OK);
  assert_int_equal(cfg.node, 1); /* ...lose to the admin's */
  assert_int_equal(cfg.share_mode, SGM_SHARE_FAIR);
  assert_string_equal(cfg.node_dir, "/srv/sgm/node");
  assert_int_equal(cfg.node_group, 1);
  assert_int_equal(sgm__admin_gid(pol), (int64_t)getegid());
  assert_int_equal(cfg.vram_reserve.bytes, UINT64_C(1) << 30);
  /* The user line beats the group line and the plain one. */
  assert_int_equal(sgm__admin_vram_cap(pol, (uint32_t)geteuid(), true, 1000), 800);
  assert_int_equal(sgm__admin_vram_cap(pol, 4242424, false, 1000), 500);
  assert_int_equal(sgm__admin_vram_reserve(pol, (uint32_t)geteuid(), 1u << 31), UINT64_C(1) << 30);
  assert_int_equal(sgm__admin_vram_reserve(pol, 4242424, 1u << 31), 0); /* granted none */
  unsetenv("SGM_NODE");
  free(pol);
}

/* Invariant: a bad line fails apply (so sgm_context_create) with the file,
 * the line number and what is wrong; a missing file is no policy. */
static void test_bad_lines_named(void **state) {
  (void)state;
  static const struct {
    const char *text, *says;
  } cases[] = {
      {"registry_dir = relative/path\n", "line 1: registry_dir must be an absolute path"},
      {"# ok\nSGM_NOT_AN_OPTION = 1\n", "line 2: SGM_NOT_AN_OPTION is not an sgm option"},
      {"SGM_SHARE_MODE = sometimes\n", "line 1: SGM_SHARE_MODE=\"sometimes\""},
      {"vram_cap = lots\n", "line 1: vram_cap = lots is not a size"},
      {"group = no-such-group-sgm\n", "line 1: group no-such-group-sgm does not exist"},
      {"just words\n", "line 1: expected key = value"},
      {"colour = blue\n", "line 1: unknown key colour"},
  };
  sgm_admin_policy *pol = calloc(1, sgm__admin_policy_bytes());
  assert_non_null(pol);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *path = write_policy("bad.conf", cases[i].text);
    assert_int_equal(sgm__admin_parse(path, pol), SGM_ERR_INVALID);
    sgm_config cfg;
    sgm_config_init(&cfg);
    assert_int_equal(sgm__admin_apply(pol, &cfg), SGM_ERR_INVALID);
    print_message("# %s\n", sgm_last_error());
    assert_non_null(strstr(sgm_last_error(), cases[i].says));
    assert_non_null(strstr(sgm_last_error(), "bad.conf"));
  }
  char missing[160];
  snprintf(missing, sizeof missing, "%s/none.conf", adir);
  assert_int_equal(sgm__admin_parse(missing, pol), SGM_OK);
  sgm_config cfg;
  sgm_config_init(&cfg);
  assert_int_equal(sgm__admin_apply(pol, &cfg), SGM_OK);
  assert_int_equal(sgm__admin_vram_cap(pol, 0, true, 1000), UINT64_MAX);
  free(pol);
}

/* In a child as uid 61001: which file holds for env over installed; exits
 * 0 when the answer is want_env ? env : installed. */
typedef struct choose_case {
  const char *installed, *env;
  bool want_env;
} choose_case;

static void choose_child(void *arg) {
  const choose_case *c = arg;
  if (setgid(61001) != 0 || setuid(61001) != 0) _exit(77);
  char why[512];
  const char *got = sgm__admin_choose(c->installed, c->env, why, sizeof why);
  printf("%s\n", why);
  _exit(strcmp(got, c->want_env ? c->env : c->installed) == 0 ? 0 : 1);
}

/* Invariant: SGM_ADMIN_CONF is root's to point elsewhere. A user may name a
 * root-only file only where no policy is installed, never a file of their
 * own, and never past an installed policy. */
static void test_who_may_name_the_file(void **state) {
  (void)state;
  char none[160], installed[160];
  snprintf(none, sizeof none, "%s/not-installed.conf", adir);
  snprintf(installed, sizeof installed, "%s", write_policy("installed.conf", "SGM_NODE = on\n"));
  const char *root_only = write_policy("root-only.conf", "SGM_NODE = on\n");
  char why[512];
  if (geteuid() != 0) {
    print_message("# not root: the user cases need setuid; checking the root case as this user\n");
    assert_string_equal(sgm__admin_choose(none, installed, why, sizeof why), none);
    assert_non_null(strstr(why, "only root may name another policy file"));
    return;
  }
  assert_string_equal(sgm__admin_choose(installed, root_only, why, sizeof why), root_only); /* root */
  char users[160];
  snprintf(users, sizeof users, "%s/users.conf", adir);
  FILE *f = fopen(users, "w");
  fputs("SGM_NODE = off\n", f);
  fclose(f);
  assert_int_equal(chown(users, 61001, 61001), 0);
  const choose_case cases[] = {
      {none, root_only, true},    /* nothing installed, a root-only file: taken */
      {installed, root_only, false}, /* an installed policy: never bypassed */
      {none, users, false},       /* the user's own file: ignored */
  };
  for (size_t i = 0; i < 3; i++) {
    char out[1024];
    int st = sgm_test_fork_capture(choose_child, (void *)&cases[i], out, sizeof out);
    print_message("# case %zu: %s", i, out);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_and_apply),
      cmocka_unit_test(test_bad_lines_named),
      cmocka_unit_test(test_who_may_name_the_file),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
