/*
 * admin.c — the admin policy (issue 28): a file outside the users' reach,
 * SGM_ADMIN_CONF_PATH (fixed at build time, /etc/sgm/node.conf by default),
 * that names the node registry's folder and group, per-user and per-group
 * VRAM caps and reservations, and SGM_* options users may not override.
 * docs/admin.md is the admin's walk-through; the format:
 *
 *   # comment
 *   registry_dir = /srv/sgm/node      (the registry folder: SGM_NODE_DIR forced)
 *   group = gpu                       (records shared with this group, 0640)
 *   SGM_NODE = on                     (any SGM_* option: forced, the environment
 *   SGM_SHARE_MODE = fair              and the program's code cannot change it)
 *   vram_cap = 50%                    (every user: a ceiling on SGM_VRAM_LIMIT)
 *   vram_cap.group.students = 25%     (members of students, unless a user line)
 *   vram_cap.user.alice = 80%         (alice)
 *   vram_reserve.user.bob = 4GiB      (bob's processes reserve 4 GiB, and at most that)
 *
 * Lookup: a user line, else the first group line (file order) of a group
 * the process is in, else the plain line, else none.
 *
 * Who may point elsewhere: SGM_ADMIN_CONF names another file only for root,
 * or when the build-time file does not exist and the named file and its
 * folder are root's and writable by root alone (so a user can choose among
 * files root wrote, never write one, and never escape the installed one).
 * Otherwise the variable is ignored with a warning.
 *
 * A file that exists but cannot be read or parsed fails sgm_context_create
 * with a message naming the line: users are told to ask the admin, rather
 * than run outside the policy.
 *
 * Threading: the policy is loaded once per process (pthread_once) and then
 * read-only; sgm__admin_reset_for_tests reloads (no other thread may use it).
 */
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#ifndef SGM_ADMIN_CONF_PATH
#define SGM_ADMIN_CONF_PATH "/etc/sgm/node.conf"
#endif

#define ADMIN_MAX_FORCED 64
#define ADMIN_MAX_RULES 128

typedef struct admin_rule {
  int kind;            /* 0 everyone, 1 group, 2 user */
  uint32_t id;         /* the gid or uid */
  bool cap_set, reserve_set;
  sgm_size cap, reserve;
} admin_rule;

struct sgm_admin_policy {
  bool present;                  /* a policy file is in force */
  char path[SGM_PATH_MAX];       /* which */
  char error[SGM_ERROR_MAX];     /* non-empty: it could not be used */
  char registry_dir[SGM_PATH_MAX];
  int64_t gid;                   /* the group; -1 none */
  char group_name[64];
  size_t n_forced;
  const sgm_option *forced[ADMIN_MAX_FORCED];
  char forced_value[ADMIN_MAX_FORCED][128];
  size_t n_rules;
  admin_rule rules[ADMIN_MAX_RULES];
};

static sgm_admin_policy admin_policy;
static pthread_once_t admin_once = PTHREAD_ONCE_INIT;
static char admin_ignored[SGM_ERROR_MAX]; /* why SGM_ADMIN_CONF was ignored ("" none) */

const char *sgm__policy_path(void) { return SGM_ADMIN_CONF_PATH; }

/* Root's and writable by root alone (file and folder). */
static bool admin_root_only(const char *path) {
  struct stat st;
  if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != 0 || (st.st_mode & 022)) return false;
  char dir[SGM_PATH_MAX];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash) return false;
  if (slash == dir) slash[1] = '\0';
  else *slash = '\0';
  return stat(dir, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == 0 && !(st.st_mode & 022);
}

static char *admin_trim(char *s) {
  while (*s == ' ' || *s == '\t') s++;
  size_t l = strlen(s);
  while (l && (s[l - 1] == ' ' || s[l - 1] == '\t' || s[l - 1] == '\r' || s[l - 1] == '\n')) s[--l] = '\0';
  return s;
}

static const sgm_option *admin_option(const char *name) {
  size_t n = 0;
  const sgm_option *t = sgm__options_table(&n);
  for (size_t i = 0; i < n; i++)
    if (strcmp(t[i].env, name) == 0) return &t[i];
  return NULL;
}

/* A user or group by name, or by number (accounts that exist only as ids,
 * as in containers). */
static bool admin_id(const char *name, bool group, uint32_t *out) {
  char *end;
  unsigned long v = strtoul(name, &end, 10);
  if (*name && !*end && v <= UINT32_MAX) {
    *out = (uint32_t)v;
    return true;
  }
  if (group) {
    struct group *g = getgrnam(name);
    if (g) *out = g->gr_gid;
    return g != NULL;
  }
  struct passwd *pw = getpwnam(name);
  if (pw) *out = pw->pw_uid;
  return pw != NULL;
}

/* One "key = value" line into pol; false with why. */
static bool admin_line(sgm_admin_policy *pol, char *key, char *val, char *why, size_t len) {
  if (strcmp(key, "registry_dir") == 0) {
    if (val[0] != '/' || strlen(val) >= sizeof pol->registry_dir) {
      snprintf(why, len, "registry_dir must be an absolute path");
      return false;
    }
    snprintf(pol->registry_dir, sizeof pol->registry_dir, "%s", val);
    return true;
  }
  if (strcmp(key, "group") == 0) {
    uint32_t gid;
    if (!admin_id(val, true, &gid)) {
      snprintf(why, len, "group %.64s does not exist", val);
      return false;
    }
    pol->gid = gid;
    snprintf(pol->group_name, sizeof pol->group_name, "%s", val);
    return true;
  }
  if (strncmp(key, "SGM_", 4) == 0) {
    const sgm_option *opt = admin_option(key);
    if (!opt) {
      snprintf(why, len, "%.64s is not an sgm option (docs/options.md)", key);
      return false;
    }
    sgm_config scratch;
    memset(&scratch, 0, sizeof scratch);
    char err[256];
    if (sgm__options_parse(opt, val, &scratch, err, sizeof err) != SGM_OK) {
      snprintf(why, len, "%s", err);
      return false;
    }
    if (pol->n_forced == ADMIN_MAX_FORCED || strlen(val) >= sizeof pol->forced_value[0]) {
      snprintf(why, len, "too many forced options, or a value too long");
      return false;
    }
    pol->forced[pol->n_forced] = opt;
    snprintf(pol->forced_value[pol->n_forced++], sizeof pol->forced_value[0], "%s", val);
    return true;
  }
  bool cap = strncmp(key, "vram_cap", 8) == 0, res = strncmp(key, "vram_reserve", 12) == 0;
  if (cap || res) {
    const char *rest = key + (cap ? 8 : 12);
    admin_rule r = {0};
    if (*rest == '\0') {
      r.kind = 0;
    } else if (strncmp(rest, ".user.", 6) == 0) {
      if (!admin_id(rest + 6, false, &r.id)) {
        snprintf(why, len, "user %.64s does not exist", rest + 6);
        return false;
      }
      r.kind = 2;
    } else if (strncmp(rest, ".group.", 7) == 0) {
      if (!admin_id(rest + 7, true, &r.id)) {
        snprintf(why, len, "group %.64s does not exist", rest + 7);
        return false;
      }
      r.kind = 1;
    } else {
      snprintf(why, len, "%.64s: expected %s, %s.user.NAME or %s.group.NAME", key, cap ? "vram_cap" : "vram_reserve",
               cap ? "vram_cap" : "vram_reserve", cap ? "vram_cap" : "vram_reserve");
      return false;
    }
    sgm_size s;
    if (sgm__options_parse_size(val, true, &s) != SGM_OK) {
      snprintf(why, len, "%.64s = %.64s is not a size (512MiB, 40G, 25%%)", key, val);
      return false;
    }
    admin_rule *slot = NULL; /* one rule per subject: the cap and reservation lines meet */
    for (size_t i = 0; i < pol->n_rules && !slot; i++)
      if (pol->rules[i].kind == r.kind && pol->rules[i].id == r.id) slot = &pol->rules[i];
    if (!slot) {
      if (pol->n_rules == ADMIN_MAX_RULES) {
        snprintf(why, len, "more than %d users and groups", ADMIN_MAX_RULES);
        return false;
      }
      slot = &pol->rules[pol->n_rules++];
      *slot = r;
    }
    if (cap) {
      slot->cap_set = true;
      slot->cap = s;
    } else {
      slot->reserve_set = true;
      slot->reserve = s;
    }
    return true;
  }
  snprintf(why, len, "unknown key %.64s (registry_dir, group, SGM_*, vram_cap[.user.U|.group.G], "
           "vram_reserve[...]: docs/admin.md)", key);
  return false;
}

int sgm__admin_parse(const char *path, sgm_admin_policy *pol) {
  memset(pol, 0, sizeof *pol);
  pol->gid = -1;
  snprintf(pol->path, sizeof pol->path, "%s", path);
  FILE *f = fopen(path, "re");
  if (!f) {
    if (errno == ENOENT) return SGM_OK; /* no policy: today's behaviour */
    snprintf(pol->error, sizeof pol->error, "admin policy %.300s cannot be read: %s (ask the admin: it "
             "must be readable by every user)", path, strerror(errno));
    pol->present = true;
    return SGM_ERR_IO;
  }
  pol->present = true;
  char line[1024], why[384];
  int lineno = 0;
  while (fgets(line, sizeof line, f)) {
    lineno++;
    char *hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char *s = admin_trim(line);
    if (!*s) continue;
    char *eq = strchr(s, '=');
    bool ok = eq != NULL;
    if (!ok) {
      snprintf(why, sizeof why, "expected key = value");
    } else {
      *eq = '\0';
      ok = admin_line(pol, admin_trim(s), admin_trim(eq + 1), why, sizeof why);
    }
    if (!ok) {
      for (char *c = why; *c; c++)
        if ((unsigned char)*c < 0x20 || (unsigned char)*c > 0x7e) *c = '?';
      snprintf(pol->error, sizeof pol->error, "admin policy %.200s line %d: %.200s (ask the admin to fix "
               "it; docs/admin.md)", path, lineno, why);
      fclose(f);
      return SGM_ERR_INVALID;
    }
  }
  fclose(f);
  return SGM_OK;
}

const char *sgm__admin_choose(const char *installed, const char *env, char *why, size_t why_len) {
  if (why_len) why[0] = '\0';
  if (!env || !*env || strcmp(env, installed) == 0) return installed;
  struct stat st;
  bool present = stat(installed, &st) == 0;
  if ((getuid() == 0 && geteuid() == 0) || (!present && admin_root_only(env))) return env;
  snprintf(why, why_len, "SGM_ADMIN_CONF=%.200s is ignored: only root may name another policy file than "
           "%.200s (or, where that does not exist, a file and folder writable by root alone)", env, installed);
  return installed;
}

static void admin_load(void) {
  const char *path = sgm__admin_choose(SGM_ADMIN_CONF_PATH, getenv("SGM_ADMIN_CONF"), admin_ignored,
                                       sizeof admin_ignored);
  sgm__admin_parse(path, &admin_policy);
}

const sgm_admin_policy *sgm__admin_current(void) {
  pthread_once(&admin_once, admin_load);
  return &admin_policy;
}

void sgm__admin_reset_for_tests(void) { admin_load(); }

/* The rule for (uid, groups): a user line, else the first matching group, else everyone. */
static void admin_rules_for(const sgm_admin_policy *pol, uint32_t uid, bool self, const admin_rule **cap,
                            const admin_rule **res) {
  *cap = *res = NULL;
  for (int kind = 2; kind >= 0; kind--) {
    for (size_t i = 0; i < pol->n_rules; i++) {
      const admin_rule *r = &pol->rules[i];
      if (r->kind != kind) continue;
      bool match = kind == 0 || (kind == 2 && r->id == uid);
      if (kind == 1) {
        if (self) {
          gid_t g[256];
          int n = getgroups(256, g);
          match = r->id == getegid();
          for (int k = 0; k < n && !match; k++) match = g[k] == r->id;
        } else { /* another user's: their primary group and the group's members (reentrant: the ticker) */
          struct passwd pw, *pwp = NULL;
          struct group gr, *grp = NULL;
          char pbuf[4096], gbuf[16384];
          if (getpwuid_r(uid, &pw, pbuf, sizeof pbuf, &pwp) != 0) pwp = NULL;
          match = pwp && pwp->pw_gid == r->id;
          if (!match && pwp && getgrgid_r(r->id, &gr, gbuf, sizeof gbuf, &grp) == 0 && grp)
            for (char **m = grp->gr_mem; m && *m && !match; m++) match = strcmp(*m, pwp->pw_name) == 0;
        }
      }
      if (!match) continue;
      if (!*cap && r->cap_set) *cap = r;
      if (!*res && r->reserve_set) *res = r;
    }
  }
}

bool sgm__admin_limits(const sgm_admin_policy *pol, uint32_t uid, bool self, sgm_size *cap,
                       sgm_size *reserve) {
  const admin_rule *c, *r;
  admin_rules_for(pol, uid, self, &c, &r);
  memset(cap, 0, sizeof *cap);
  memset(reserve, 0, sizeof *reserve);
  if (c) *cap = c->cap;
  if (r) *reserve = r->reserve;
  return c || r;
}

int sgm__admin_apply(const sgm_admin_policy *pol, sgm_config *cfg) {
  if (admin_ignored[0]) sgm__log(cfg->verbose, 1, "%s", admin_ignored);
  if (!pol->present) return SGM_OK;
  if (pol->error[0]) return sgm__error_set(SGM_ERR_INVALID, "%s", pol->error);
  char err[256];
  for (size_t i = 0; i < pol->n_forced; i++) {
    const sgm_option *opt = pol->forced[i];
    const char *user = getenv(opt->env);
    if (user && strcmp(user, pol->forced_value[i]) != 0)
      sgm__log(cfg->verbose, 1, "%s=%.64s is not yours to set: the admin policy %s sets %s=%s", opt->env,
               user, pol->path, opt->env, pol->forced_value[i]);
    if (sgm__options_parse(opt, pol->forced_value[i], cfg, err, sizeof err) != SGM_OK)
      return sgm__error_set(SGM_ERR_INVALID, "admin policy %s: %s", pol->path, err);
  }
  if (pol->registry_dir[0]) {
    snprintf(cfg->node_dir, sizeof cfg->node_dir, "%s", pol->registry_dir);
    cfg->node = 1; /* a policy names a registry: every process joins it */
  }
  if (pol->gid >= 0) cfg->node_group = 1;
  sgm_size cap, res;
  if (sgm__admin_limits(pol, (uint32_t)geteuid(), true, &cap, &res) && (res.bytes || res.fraction)) {
    /* The admin's reservation is this user's: theirs by default, and at most. */
    bool user_set = cfg->vram_reserve.bytes || cfg->vram_reserve.fraction;
    bool above = user_set && ((res.fraction && cfg->vram_reserve.fraction > res.fraction) ||
                              (!res.fraction && !cfg->vram_reserve.fraction && cfg->vram_reserve.bytes > res.bytes));
    if (!user_set || above || (res.fraction == 0) != (cfg->vram_reserve.fraction == 0)) cfg->vram_reserve = res;
  }
  return SGM_OK;
}

uint64_t sgm__admin_vram_cap(const sgm_admin_policy *pol, uint32_t uid, bool self, uint64_t total) {
  sgm_size cap, res;
  if (!pol->present || pol->error[0] || !sgm__admin_limits(pol, uid, self, &cap, &res)) return UINT64_MAX;
  return sgm__size_resolve(cap, total, UINT64_MAX);
}

uint64_t sgm__admin_vram_reserve(const sgm_admin_policy *pol, uint32_t uid, uint64_t total) {
  if (!pol->present || pol->error[0]) return UINT64_MAX;
  bool any = false; /* no reservation lines: reservations are the users' own, as without a policy */
  for (size_t i = 0; i < pol->n_rules && !any; i++) any = pol->rules[i].reserve_set;
  if (!any) return UINT64_MAX;
  sgm_size cap, res;
  sgm__admin_limits(pol, uid, false, &cap, &res);
  return sgm__size_resolve(res, total, 0);
}

int64_t sgm__admin_gid(const sgm_admin_policy *pol) { return pol->present && !pol->error[0] ? pol->gid : -1; }

const char *sgm__admin_registry_dir(const sgm_admin_policy *pol) {
  return pol->present && !pol->error[0] && pol->registry_dir[0] ? pol->registry_dir : NULL;
}

size_t sgm__admin_policy_bytes(void) { return sizeof(sgm_admin_policy); }
