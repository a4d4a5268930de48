/*
 * sgm-smi — the Task-Manager view of a node: every sgm process on every
 * device of this machine, read from the node registries (lib/node.c) without
 * joining them. See docs/smi.md for the output formats and exit codes.
 *
 *   sgm-smi [-v]                table (80 columns; -v: details per process)
 *   sgm-smi --watch [-i MS]     the table, refreshed in place like top
 *   sgm-smi --json              one JSON document (schema "sgm-smi/1")
 *   sgm-smi --prometheus        node-exporter textfile format
 *   sgm-smi --record FILE [-i MS] [--count N]
 *                               CSV samples appended to FILE (docs/record-format.md)
 *
 * It reads through the public reader, include/sgm/node.h (sgm_node_list,
 * sgm_node_read: bounds-checked, the one reader of the registry files), and
 * shows only live owners (their liveness lock held). Root sees every user's
 * processes; others see their own and those shared with their groups. A
 * registry that cannot be read (another version, the folder unreadable) is
 * named on stderr with the reason, and the exit code says so. Everything
 * shown from the registry folder (file names, keys, names) is printable
 * ASCII: other users choose those bytes.
 *
 * Threading: none.
 */
#include <dirent.h>
#include <errno.h>
#include <pwd.h>
#include <sys/stat.h>
#include <stddef.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "tool_support.h"
#include "sgm/node.h"

/* Exit codes (docs/smi.md). */
#define SMI_EXIT_OK 0          /* at least one sgm process shown */
#define SMI_EXIT_NONE 1        /* no sgm process on this node */
#define SMI_EXIT_UNREADABLE 2  /* a registry could not be read (stderr says why) */
#define SMI_EXIT_WRITE 3       /* the output could not be written (full disk, --record FILE) */
#define SMI_EXIT_USAGE 64      /* bad command line */

typedef struct smi_device {
  char file[SGM_PATH_MAX];     /* the segment's path */
  bool ok;                     /* read; false: unreadable (error says why) */
  sgm_node_device info;        /* the device, when ok */
  sgm_node_process *procs;     /* its live processes (info.n_processes), malloc'ed; NULL when none */
  char error[SGM_ERROR_MAX];   /* why it is unreadable; "" when read */
  char uuid[SGM_NODE_UUID_TEXT_BYTES + 4]; /* "GPU-<uuid>" as nvidia-smi -L prints it; "" when unknown */
} smi_device;

typedef struct smi_node {
  size_t n;                         /* devices found */
  smi_device *dev;                  /* in name order (malloc'ed, n of them) */
  size_t n_procs;                   /* live processes in all */
  size_t n_errors;                  /* registries that could not be read */
} smi_node;

static volatile sig_atomic_t smi_stop;
static void smi_on_signal(int sig) {
  (void)sig;
  smi_stop = 1;
}

/* Read one registry through the public reader (include/sgm/node.h): the
 * device and its live processes; the count first, then as many records. */
static void smi_read_device(smi_device *d, unsigned flags) {
  d->ok = false;
  d->procs = NULL;
  d->uuid[0] = '\0';
  d->info = (sgm_node_device){.struct_size = sizeof d->info};
  sgm_status rc = sgm_node_read(d->file, flags, &d->info, NULL, 0);
  size_t n = d->info.n_processes;
  if (rc == SGM_OK && n) {
    /* Room for processes joining between the two reads (the rest are counted, not shown). */
    size_t room = n + 16;
    d->procs = calloc(room, sizeof *d->procs);
    if (!d->procs) {
      snprintf(d->error, sizeof d->error, "out of memory");
      return;
    }
    d->procs[0].struct_size = sizeof *d->procs;
    rc = sgm_node_read(d->file, flags, &d->info, d->procs, room);
    if (d->info.n_processes > room) d->info.n_processes = room;
  }
  if (rc != SGM_OK) {
    /* The reason alone: the file is shown beside it. */
    const char *why = sgm_last_error();
    char prefix[SGM_PATH_MAX + 32];
    snprintf(prefix, sizeof prefix, "sgm_node_read: %s: ", d->file);
    if (strncmp(why, prefix, strlen(prefix)) == 0) why += strlen(prefix);
    snprintf(d->error, sizeof d->error, "%s", why);
    free(d->procs);
    d->procs = NULL;
    return;
  }
  sgm_node_device *v = &d->info;
  if (v->uuid_text[0]) snprintf(d->uuid, sizeof d->uuid, "GPU-%s", v->uuid_text);
  /* The key is printed in labels and CSV: keep it to a safe alphabet. */
  for (char *c = v->key; *c; c++)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
          *c == '.' || *c == '-' || *c == '_' || *c == ':'))
      *c = '_';
  d->ok = true;
}

static void smi_free(smi_node *nd) {
  for (size_t i = 0; i < nd->n; i++) free(nd->dev[i].procs);
  free(nd->dev);
  nd->dev = NULL;
  nd->n = 0;
}

/* A copy of s for a terminal, CSV or JSON: printable ASCII, others '?'. */
static const char *smi_safe(const char *s, char *buf, size_t len) {
  size_t k = 0;
  for (const unsigned char *c = (const unsigned char *)s; *c && k + 1 < len; c++)
    buf[k++] = *c >= 0x20 && *c < 0x7f ? (char)*c : '?';
  if (len) buf[k] = '\0';
  return buf;
}

/* Every registry in dir (a missing folder: no sgm process, not an error):
 * all of them, however many (a list no junk can crowd). */
static int smi_read(const char *dir, unsigned flags, smi_node *nd) {
  nd->n = nd->n_procs = nd->n_errors = 0;
  size_t n = 0;
  sgm_status rc = sgm_node_list(dir, NULL, 0, &n);
  sgm_node_entry *entries = NULL;
  for (int tries = 0; rc == SGM_OK && n && tries < 4; tries++) {
    size_t room = n + 8, got = 0;
    free(entries);
    entries = calloc(room, sizeof *entries);
    if (!entries) break;
    rc = sgm_node_list(dir, entries, room, &got);
    if (got <= room) {
      n = got;
      break;
    }
    n = got;
  }
  if (rc == SGM_ERR_INVALID) {
    free(entries);
    return SGM_OK;
  }
  char safe[SGM_ERROR_MAX];
  if (rc != SGM_OK || (n && !entries)) {
    fprintf(stderr, "sgm-smi: %s\n", rc != SGM_OK ? smi_safe(sgm_last_error(), safe, sizeof safe) : "out of memory");
    free(entries);
    nd->n_errors++;
    return rc;
  }
  nd->dev = n ? calloc(n, sizeof *nd->dev) : NULL;
  for (size_t i = 0; i < n && nd->dev; i++) {
    smi_device *d = &nd->dev[nd->n++];
    snprintf(d->file, sizeof d->file, "%s", entries[i].path);
    d->error[0] = '\0';
    smi_read_device(d, flags);
    if (d->ok) nd->n_procs += d->info.n_processes;
    else nd->n_errors++;
  }
  free(entries);
  return SGM_OK;
}

static void smi_report_errors(const smi_node *nd) {
  char a[SGM_PATH_MAX], b[SGM_ERROR_MAX];
  for (size_t i = 0; i < nd->n; i++)
    if (!nd->dev[i].ok)
      fprintf(stderr, "sgm-smi: registry %s is unreadable: %s\n", smi_safe(nd->dev[i].file, a, sizeof a),
              smi_safe(nd->dev[i].error, b, sizeof b));
}

/* A user's name, or the number when it has none here. */
static const char *smi_user(uint32_t uid, char *buf, size_t len) {
  struct passwd pw, *pp = NULL;
  char pbuf[4096];
  if (getpwuid_r(uid, &pw, pbuf, sizeof pbuf, &pp) == 0 && pp) smi_safe(pp->pw_name, buf, len);
  else snprintf(buf, len, "%u", uid);
  return buf;
}

/* The process's container: its Kubernetes pod where it said so, else its
 * PID namespace ("-" when it is sgm-smi's own, "ns:<inode>" otherwise). */
static uint64_t smi_own_pid_ns(void) {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static const char *smi_container(const sgm_node_process *p, char *buf, size_t len) {
  if (p->k8s_pod[0]) snprintf(buf, len, "%s", p->k8s_pod);
  else if (!p->pid_ns || p->pid_ns == smi_own_pid_ns()) snprintf(buf, len, "-");
  else snprintf(buf, len, "ns:%llu", (unsigned long long)p->pid_ns);
  return buf;
}

/* Over its budget: holding more than it is given (it is giving memory back). */
static bool smi_over(const sgm_node_process *p) {
  return (p->budget_bytes[SGM_TIER_VRAM] && p->used_bytes[SGM_TIER_VRAM] > p->budget_bytes[SGM_TIER_VRAM]) ||
         (p->budget_bytes[SGM_TIER_SHARED] && p->used_bytes[SGM_TIER_SHARED] > p->budget_bytes[SGM_TIER_SHARED]);
}

/* Memory the device uses outside sgm: the device's used memory (the latest
 * figure a process published) minus what sgm processes hold there. */
static bool smi_outside(const sgm_node_device *v, const sgm_node_process *procs, uint64_t *out) {
  uint64_t used = 0, best_hb = 0, sgm_held = 0;
  for (size_t k = 0; k < v->n_processes; k++) {
    const sgm_node_process *p = &procs[k];
    if (p->device_used_bytes && p->heartbeat_ns >= best_hb) {
      best_hb = p->heartbeat_ns;
      used = p->device_used_bytes;
    }
    uint64_t held = p->emu_device_bytes > p->committed_bytes[SGM_TIER_VRAM] ? p->emu_device_bytes
                                                                            : p->committed_bytes[SGM_TIER_VRAM];
    sgm_held = held > UINT64_MAX - sgm_held ? UINT64_MAX : sgm_held + held;
  }
  *out = used > sgm_held ? used - sgm_held : 0;
  return used != 0;
}


/* ------------------------------------------------------------------------ */
/* The table. */

static const char *smi_b(uint64_t v, char *buf) { return sgm__fmt_bytes(v, buf, 32); }

/* A size in at most 5 characters for the 80-column table: "0", "512K",
 * "6.00G", "12.5G", "128G", binary units (the JSON has exact bytes). */
static const char *smi_s(uint64_t v, char *buf) {
  static const char units[] = "BKMGTPE";
  double x = (double)v;
  int u = 0;
  while (x >= 1000.0 && u < 6) {
    x /= 1024.0;
    u++;
  }
  if (u == 0) snprintf(buf, 32, "%llu", (unsigned long long)v);
  else if (x < 9.995) snprintf(buf, 32, "%.2f%c", x, units[u]);
  else if (x < 99.95) snprintf(buf, 32, "%.1f%c", x, units[u]);
  else snprintf(buf, 32, "%.0f%c", x, units[u]);
  return buf;
}

static void smi_print_table(FILE *f, const char *dir, const smi_node *nd, bool verbose) {
  time_t now = time(NULL);
  char when[32], sdir[64];
  strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", localtime(&now));
  fprintf(f, "sgm-smi  %s  registry %s\n", when, smi_safe(dir, sdir, sizeof sdir));
  if (nd->n_procs == 0 && nd->n_errors == 0) fprintf(f, "No sgm process on this node.\n");
  bool any_over = false, any_solo = false, any_interposed = false;
  for (size_t i = 0; i < nd->n; i++) {
    const smi_device *d = &nd->dev[i];
    char safe[SGM_PATH_MAX], why[SGM_ERROR_MAX];
    if (!d->ok) {
      fprintf(f, "\n%.60s: unreadable: %s\n", smi_safe(d->file, safe, sizeof safe), smi_safe(d->error, why, sizeof why));
      continue;
    }
    const sgm_node_device *v = &d->info;
    const sgm_node_process *procs = d->procs;
    if (v->n_processes == 0) continue;
    char a[32], b[32], c[32], e[32];
    fprintf(f, "\nDevice %.36s  %zu process%s  memory %s  shared cap %s\n", v->key, v->n_processes,
            v->n_processes == 1 ? "" : "es", smi_s(v->device_total_bytes, a), smi_s(v->shared_cap_bytes, b));
    bool uuid_shown = d->uuid[0] && strcmp(d->uuid, v->key) != 0;
    if (verbose && (uuid_shown || v->pci_bus_id[0]))
      fprintf(f, "  %s%s%s%s\n", uuid_shown ? "UUID " : "", uuid_shown ? d->uuid : "",
              v->pci_bus_id[0] ? "  PCI " : "", v->pci_bus_id);
    /* 80 columns at most: 7+1+8+1+12+1+15+1+11+1+11+1+6+2+2 = 80. */
    fprintf(f, "%7s %-8s %-12s %-15s %11s %11s %6s\n", "PID", "USER", "CONTAINER", "NAME", "VRAM/BUDGET",
            "SHARED/BUDG", "FALLBK");
    uint64_t tv = 0, ts = 0, td = 0;
    for (size_t k = 0; k < v->n_processes; k++) {
      const sgm_node_process *p = &procs[k];
      char vu[40], user[32], cont[80];
      char su[40];
      snprintf(vu, sizeof vu, "%s/%s", smi_s(p->used_bytes[SGM_TIER_VRAM], a),
               smi_s(p->budget_bytes[SGM_TIER_VRAM], b));
      snprintf(su, sizeof su, "%s/%s", smi_s(p->used_bytes[SGM_TIER_SHARED], a),
               smi_s(p->budget_bytes[SGM_TIER_SHARED], b));
      bool over = smi_over(p);
      any_over |= over;
      any_solo |= p->solo != 0;
      any_interposed |= p->interposed != 0;
      fprintf(f, "%7d %-8.8s %-12.12s %-15.15s %11s %11s %6llu%s%s%s\n", p->pid, smi_user(p->uid, user, sizeof user),
              smi_container(p, cont, sizeof cont), p->name, vu, su,
              p->n_fallbacks > 999999 ? 999999ULL : (unsigned long long)p->n_fallbacks, over ? " !" : "",
              p->solo ? " s" : "", p->interposed ? " i" : "");
      if (verbose)
        fprintf(f, "        uid %u  pid_ns %llu  disk %s  peak %s  committed %s\n"
                "        reserve %s  weight %llu%s%s%s%s%s%s\n",
                p->uid, (unsigned long long)p->pid_ns, smi_b(p->used_bytes[SGM_TIER_DISK], a),
                smi_b(p->peak_bytes[SGM_TIER_VRAM], b), smi_b(p->committed_bytes[SGM_TIER_VRAM], c),
                smi_b(p->reserve_bytes, e), (unsigned long long)p->weight, p->k8s_namespace[0] ? "  k8s " : "",
                p->k8s_namespace, p->k8s_pod[0] ? "/" : "", p->k8s_pod, p->k8s_container[0] ? "/" : "",
                p->k8s_container);
      tv += p->used_bytes[SGM_TIER_VRAM];
      ts += p->used_bytes[SGM_TIER_SHARED];
      td += p->used_bytes[SGM_TIER_DISK];
    }
    uint64_t outside = 0;
    if (smi_outside(v, procs, &outside))
      fprintf(f, "%7s %-8s %-12s %-15s %11s\n", "-", "-", "-", "(not sgm)", smi_s(outside, a));
    char tvs[48], tss[48];
    snprintf(tvs, sizeof tvs, "%s/%s", smi_s(tv, a), smi_s(v->device_total_bytes, b));
    snprintf(tss, sizeof tss, "%s/%s", smi_s(ts, a), smi_s(v->shared_cap_bytes, b));
    fprintf(f, "%7s %-8s %-12s %-15s %11s %11s\n", "", "", "", "TOTAL", tvs, tss);
    if (verbose && td) fprintf(f, "  disk in use: %s\n", smi_b(td, e));
    (void)c;
    if (v->n_hidden)
      fprintf(f, "  %zu process%s of other users not shown (run as root to see them)\n", v->n_hidden,
              v->n_hidden == 1 ? "" : "es");
  }
  if (any_over || any_solo || any_interposed) fputc('\n', f);
  if (any_over) fprintf(f, "! over its budget: returning memory, new allocations fall back\n");
  if (any_solo) fprintf(f, "s SGM_SHARE_MODE=solo\n");
  if (any_interposed) fprintf(f, "i interposed: an unmodified program under libsgm-preload.so\n");
}

/* ------------------------------------------------------------------------ */
/* JSON (docs/smi.md has the schema). */

static void smi_json_tier(FILE *f, const char *name, const sgm_node_process *p, int t, bool last) {
  fprintf(f, "\"%s\": {\"used_bytes\": %llu, \"committed_bytes\": %llu, \"budget_bytes\": %llu, "
          "\"peak_bytes\": %llu}%s", name,
          (unsigned long long)p->used_bytes[t],
          (unsigned long long)p->committed_bytes[t],
          (unsigned long long)p->budget_bytes[t],
          (unsigned long long)p->peak_bytes[t], last ? "" : ", ");
}

/* The inside of a JSON string: quotes and backslashes escaped, control
 * characters shown as '?'. */
static void smi_json_str(FILE *f, const char *s) {
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if (*c == '"' || *c == '\\') fputc('\\', f);
    fputc(*c < 0x20 || *c > 0x7e ? '?' : *c, f); /* valid UTF-8 whatever the bytes */
  }
}

/* "name": "value", or "name": null when value is "" (unknown). */
static void smi_json_opt(FILE *f, const char *name, const char *value) {
  if (!value[0]) {
    fprintf(f, "\"%s\": null, ", name);
    return;
  }
  fprintf(f, "\"%s\": \"", name);
  smi_json_str(f, value);
  fprintf(f, "\", ");
}

static void smi_print_json(FILE *f, const char *dir, const smi_node *nd) {
  uint64_t now_ns = sgm__clock_monotonic_ns();
  fprintf(f, "{\"schema\": \"sgm-smi/1\", \"time_unix\": %lld, \"node_dir\": \"", (long long)time(NULL));
  smi_json_str(f, dir);
  fprintf(f, "\",\n \"devices\": [");
  bool first = true;
  for (size_t i = 0; i < nd->n; i++) {
    const sgm_node_device *v = nd->dev[i].ok ? &nd->dev[i].info : NULL;
    const sgm_node_process *procs = nd->dev[i].procs;
    if (!v) continue;
    uint64_t tot[SGM_TIER_COUNT] = {0};
    for (size_t k = 0; k < v->n_processes; k++)
      for (int t = 0; t < SGM_TIER_COUNT; t++) tot[t] += procs[k].used_bytes[t];
    uint64_t outside = 0;
    bool known = smi_outside(v, procs, &outside);
    fprintf(f, "%s\n  {\"key\": \"%s\", ", first ? "" : ",", v->key);
    if (known) fprintf(f, "\"outside_sgm_bytes\": %llu, ", (unsigned long long)outside);
    else fprintf(f, "\"outside_sgm_bytes\": null, ");
    smi_json_opt(f, "uuid", nd->dev[i].uuid);
    smi_json_opt(f, "pci_bus_id", v->pci_bus_id);
    fprintf(f, "\"version\": %u, \"n_slots\": %u, \"device_total_bytes\": %llu, "
            "\"shared_cap_bytes\": %llu, \"n_processes\": %zu,\n   \"totals\": {\"vram_used_bytes\": "
            "%llu, \"shared_used_bytes\": %llu, \"disk_used_bytes\": %llu},\n   \"processes\": [",
            v->version, v->n_slots,
            (unsigned long long)v->device_total_bytes, (unsigned long long)v->shared_cap_bytes,
            v->n_processes, (unsigned long long)tot[0], (unsigned long long)tot[1],
            (unsigned long long)tot[2]);
    first = false;
    for (size_t k = 0; k < v->n_processes; k++) {
      const sgm_node_process *p = &procs[k];
      uint64_t hb = p->heartbeat_ns;
      char user[32], cont[80];
      fprintf(f, "%s\n    {\"pid\": %d, \"pid_ns\": %llu, \"uid\": %u, \"user\": \"", k ? "," : "", p->pid,
              (unsigned long long)p->pid_ns, p->uid);
      smi_json_str(f, smi_user(p->uid, user, sizeof user));
      fprintf(f, "\", \"container\": \"");
      smi_json_str(f, smi_container(p, cont, sizeof cont));
      fprintf(f, "\", \"over_budget\": %s, \"flags\": %llu, ", smi_over(p) ? "true" : "false",
              (unsigned long long)p->flags);
      fprintf(f, "\"start_ticks\": %llu, \"name\": \"%s\", \"mode\": \"%s\", "
              "\"interposed\": %s, \"weight\": %llu, \"reserve_bytes\": %llu, ",
              (unsigned long long)p->start_ticks, p->name,
              p->solo ? "solo" : "fair", p->interposed ? "true" : "false",
              (unsigned long long)p->weight,
              (unsigned long long)p->reserve_bytes);
      smi_json_tier(f, "vram", p, SGM_TIER_VRAM, false);
      smi_json_tier(f, "shared", p, SGM_TIER_SHARED, false);
      smi_json_tier(f, "disk", p, SGM_TIER_DISK, false);
      fprintf(f, "\"fallbacks\": %llu, \"evictions\": %llu, \"bytes_moved\": %llu, "
              "\"heartbeat_age_ms\": %lld}",
              (unsigned long long)p->n_fallbacks,
              (unsigned long long)p->n_evictions,
              (unsigned long long)p->moved_bytes,
              hb && hb <= now_ns ? (long long)((now_ns - hb) / 1000000u) : -1LL);
    }
    fprintf(f, "]}");
  }
  fprintf(f, "],\n \"errors\": [");
  first = true;
  for (size_t i = 0; i < nd->n; i++) {
    if (nd->dev[i].ok) continue;
    fprintf(f, "%s{\"file\": \"", first ? "" : ", "); /* smi_json_str: ASCII only */
    smi_json_str(f, nd->dev[i].file);
    fprintf(f, "\", \"error\": \"");
    smi_json_str(f, nd->dev[i].error);
    fprintf(f, "\"}");
    first = false;
  }
  fprintf(f, "]}\n");
}

/* ------------------------------------------------------------------------ */
/* Prometheus textfile (node-exporter's textfile collector). */

typedef struct smi_metric {
  const char *name;  /* metric name */
  const char *type;  /* gauge / counter */
  const char *help;  /* HELP line */
  size_t offset;     /* the uint64_t member of sgm_node_process it shows */
} smi_metric;

#define SMI_FIELD(member) offsetof(sgm_node_process, member)

static const smi_metric smi_metrics[] = {
    {"sgm_vram_used_bytes", "gauge", "Dedicated GPU memory (VRAM) an sgm process has handed out.",
     SMI_FIELD(used_bytes[SGM_TIER_VRAM])},
    {"sgm_vram_committed_bytes", "gauge", "VRAM an sgm process holds from the driver.",
     SMI_FIELD(committed_bytes[SGM_TIER_VRAM])},
    {"sgm_vram_budget_bytes", "gauge", "The VRAM budget in force for an sgm process.",
     SMI_FIELD(budget_bytes[SGM_TIER_VRAM])},
    {"sgm_vram_peak_bytes", "gauge", "Peak VRAM use of an sgm process.", SMI_FIELD(peak_bytes[SGM_TIER_VRAM])},
    {"sgm_shared_used_bytes", "gauge", "Shared GPU memory (pinned host RAM) an sgm process uses.",
     SMI_FIELD(used_bytes[SGM_TIER_SHARED])},
    {"sgm_shared_budget_bytes", "gauge", "The shared-memory budget in force for an sgm process.",
     SMI_FIELD(budget_bytes[SGM_TIER_SHARED])},
    {"sgm_disk_used_bytes", "gauge", "Bytes an sgm process has spilled to disk.",
     SMI_FIELD(used_bytes[SGM_TIER_DISK])},
    {"sgm_fallbacks_total", "counter", "Allocations that wanted VRAM and got shared memory.",
     SMI_FIELD(n_fallbacks)},
    {"sgm_evictions_total", "counter", "Buffers moved down a tier to make room.", SMI_FIELD(n_evictions)},
    {"sgm_moved_bytes_total", "counter", "Bytes migrated between tiers.", SMI_FIELD(moved_bytes)},
};

static unsigned long long smi_field(const sgm_node_process *p, size_t offset) {
  uint64_t v;
  memcpy(&v, (const char *)p + offset, sizeof v);
  return (unsigned long long)v;
}

/* A label value: printable ASCII with '\\', '"' escaped (the exposition
 * format's rule; newlines cannot occur: smi_safe made them '?'). */
static void smi_prom_value(const char *v, char *out, size_t len) {
  char safe[256];
  smi_safe(v, safe, sizeof safe);
  size_t k = 0;
  for (const char *c = safe; *c && k + 2 < len; c++) {
    if (*c == '"' || *c == '\\') out[k++] = '\\';
    out[k++] = *c;
  }
  if (len) out[k] = '\0';
}

/* A device's labels: its key, its UUID and PCI bus id ("" when unknown). */
static void smi_prom_labels(const smi_device *d, char *out, size_t len) {
  snprintf(out, len, "device=\"%s\",uuid=\"%s\",pci_bus_id=\"%s\"", d->info.key, d->uuid,
           d->info.pci_bus_id);
}

/* A process's labels: unique on the node and stable while it lives, also
 * across PID namespaces (pid is unique only within pid_ns: containers);
 * the Kubernetes namespace, pod and container where the process had them. */
static void smi_prom_proc_labels(const sgm_node_process *p, char *out, size_t len) {
  char user[64], uv[130], name[80];
  smi_prom_value(smi_user(p->uid, user, sizeof user), uv, sizeof uv);
  smi_prom_value(p->name, name, sizeof name);
  int n = snprintf(out, len, "pid=\"%d\",pid_ns=\"%llu\",uid=\"%u\",user=\"%s\",name=\"%s\"", p->pid,
                   (unsigned long long)p->pid_ns, p->uid, uv, name);
  const char *k8s_names[3] = {"namespace", "pod", "container"};
  const char *k8s[3] = {p->k8s_namespace, p->k8s_pod, p->k8s_container};
  for (int i = 0; i < 3 && n > 0 && (size_t)n < len; i++)
    if (k8s[i][0]) n += snprintf(out + n, len - (size_t)n, ",%s=\"%s\"", k8s_names[i], k8s[i]);
}

/* Was the process k of device d already written (the same labels: a record
 * copied by a hostile user)? Then it is left out, so no series repeats. */
static bool smi_prom_dup(const sgm_node_device *v, const sgm_node_process *procs, size_t k) {
  for (size_t j = 0; j < k; j++)
    if (procs[j].pid == procs[k].pid && procs[j].pid_ns == procs[k].pid_ns && procs[j].uid == procs[k].uid)
      return true;
  (void)v;
  return false;
}

/* The per-device gauges: one table, one loop. */
static unsigned long long smi_dev_total(const sgm_node_device *v) { return v->device_total_bytes; }
static unsigned long long smi_dev_shared_cap(const sgm_node_device *v) { return v->shared_cap_bytes; }
static unsigned long long smi_dev_procs(const sgm_node_device *v) { return v->n_processes; }

typedef struct smi_device_metric {
  const char *name;                                  /* metric name */
  const char *help;                                  /* HELP line */
  unsigned long long (*value)(const sgm_node_device *v); /* the device's value */
} smi_device_metric;

static const smi_device_metric smi_device_metrics[] = {
    {"sgm_device_total_bytes", "Memory of the device, as its registry records it.", smi_dev_total},
    {"sgm_shared_cap_bytes", "The node's cap on shared GPU memory (half of RAM).", smi_dev_shared_cap},
    {"sgm_processes", "sgm processes registered on the device.", smi_dev_procs},
};

static void smi_print_prometheus(FILE *f, const smi_node *nd) {
  char labels[256], plabels[640];
  for (size_t m = 0; m < sizeof smi_device_metrics / sizeof smi_device_metrics[0]; m++) {
    const smi_device_metric *dm = &smi_device_metrics[m];
    fprintf(f, "# HELP %s %s\n# TYPE %s gauge\n", dm->name, dm->help, dm->name);
    for (size_t i = 0; i < nd->n; i++) {
      const sgm_node_device *v = nd->dev[i].ok ? &nd->dev[i].info : NULL;
      if (!v) continue;
      smi_prom_labels(&nd->dev[i], labels, sizeof labels);
      fprintf(f, "%s{%s} %llu\n", dm->name, labels, dm->value(v));
    }
  }
  for (size_t m = 0; m < sizeof smi_metrics / sizeof smi_metrics[0]; m++) {
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", smi_metrics[m].name, smi_metrics[m].help,
            smi_metrics[m].name, smi_metrics[m].type);
    for (size_t i = 0; i < nd->n; i++) {
      const sgm_node_device *v = nd->dev[i].ok ? &nd->dev[i].info : NULL;
      const sgm_node_process *procs = nd->dev[i].procs;
      if (!v) continue;
      smi_prom_labels(&nd->dev[i], labels, sizeof labels);
      for (size_t k = 0; k < v->n_processes; k++) {
        if (smi_prom_dup(v, procs, k)) continue;
        smi_prom_proc_labels(&procs[k], plabels, sizeof plabels);
        fprintf(f, "%s{%s,%s} %llu\n", smi_metrics[m].name, labels, plabels,
                smi_field(&procs[k], smi_metrics[m].offset));
      }
    }
  }
  fprintf(f, "# HELP sgm_registry_errors Registries sgm-smi could not read (see its stderr).\n"
             "# TYPE sgm_registry_errors gauge\nsgm_registry_errors %zu\n", nd->n_errors);
}

/* ------------------------------------------------------------------------ */
/* --record: CSV rows in the format of docs/record-format.md. */

static const char smi_record_header[] =
    "time_s,device,pid,name,vram_used,vram_budget,shared_used,shared_budget,disk_used,vram_peak,"
    "fallbacks,evictions,device_total,shared_cap\n";

static void smi_record_rows(FILE *f, double t, const smi_node *nd) {
  for (size_t i = 0; i < nd->n; i++) {
    const sgm_node_device *v = nd->dev[i].ok ? &nd->dev[i].info : NULL;
    const sgm_node_process *procs = nd->dev[i].procs;
    for (size_t k = 0; v && k < v->n_processes; k++) {
      const sgm_node_process *p = &procs[k];
      fprintf(f, "%.3f,%s,%d,%s,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu\n", t, v->key,
              p->pid, p->name, (unsigned long long)p->used_bytes[SGM_TIER_VRAM],
              (unsigned long long)p->budget_bytes[SGM_TIER_VRAM],
              (unsigned long long)p->used_bytes[SGM_TIER_SHARED],
              (unsigned long long)p->budget_bytes[SGM_TIER_SHARED],
              (unsigned long long)p->used_bytes[SGM_TIER_DISK],
              (unsigned long long)p->peak_bytes[SGM_TIER_VRAM],
              (unsigned long long)p->n_fallbacks,
              (unsigned long long)p->n_evictions,
              (unsigned long long)v->device_total_bytes, (unsigned long long)v->shared_cap_bytes);
    }
  }
}

/* ------------------------------------------------------------------------ */

static void smi_usage(FILE *f) {
  fprintf(f,
          "usage: sgm-smi [--json | --prometheus | --watch | --record FILE] [--interval MS]\n"
          "               [--count N] [--dir DIR]\n"
          "  (no option)      a table of every sgm process per device (80 columns)\n"
          "  -v, --verbose    the table with details per process\n"
          "  --json           one JSON document (schema sgm-smi/1, docs/smi.md)\n"
          "  --prometheus     node-exporter textfile format (write it to the collector's folder)\n"
          "  --watch          the table, refreshed in place every --interval ms (default 1000)\n"
          "  --record FILE    append CSV samples every --interval ms (default 500) until\n"
          "                   interrupted or --count samples (docs/record-format.md)\n"
          "  --dir DIR        the registries' folder (default: the admin policy's, else\n"
          "                   SGM_NODE_DIR, else /dev/shm)\n"
          "root sees every user's processes; others their own and their groups'\n"
          "exit: 0 processes shown, 1 no sgm process, 2 a registry unreadable,\n"
          "      3 the output could not be written, 64 usage\n");
}

static void smi_sleep_ms(uint64_t ms) {
  struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
  while (!smi_stop && nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static int smi_write_failed(const char *what, int e) {
  fprintf(stderr, "sgm-smi: cannot write to %s: %s; nothing more was recorded (free space there, or "
          "choose another file)\n", what, e ? strerror(e) : "write error");
  return SMI_EXIT_WRITE;
}

static int smi_exit_code(const smi_node *nd) {
  if (nd->n_errors) return SMI_EXIT_UNREADABLE;
  return nd->n_procs ? SMI_EXIT_OK : SMI_EXIT_NONE;
}

int main(int argc, char **argv) {
  enum { MODE_TABLE, MODE_JSON, MODE_PROM, MODE_WATCH, MODE_RECORD } mode = MODE_TABLE;
  const char *dir = sgm__admin_registry_dir(sgm__admin_current());
  if (!dir || !*dir) dir = getenv("SGM_NODE_DIR");
  if (!dir || !*dir) dir = "/dev/shm";
  const char *record = NULL;
  long long interval = -1, count = 0;
  bool verbose = false;
  /* Show what this user may read: its own records and its groups'; root all. */
  unsigned flags = SGM_NODE_READ_GROUP | (geteuid() == 0 ? SGM_NODE_READ_ALL_USERS : 0u);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    bool has_next = i + 1 < argc;
    if (strcmp(a, "--json") == 0) mode = MODE_JSON;
    else if (strcmp(a, "-v") == 0 || strcmp(a, "--verbose") == 0) verbose = true;
    else if (strcmp(a, "--prometheus") == 0) mode = MODE_PROM;
    else if (strcmp(a, "--watch") == 0) mode = MODE_WATCH;
    else if (strcmp(a, "--record") == 0 && has_next) {
      mode = MODE_RECORD;
      record = argv[++i];
    } else if ((strcmp(a, "--interval") == 0 || strcmp(a, "-i") == 0) && has_next) {
      char *end;
      interval = strtoll(argv[++i], &end, 10);
      if (*end || interval < 1 || interval > 3600000) {
        fprintf(stderr, "sgm-smi: --interval wants milliseconds from 1 to 3600000, not %s\n", argv[i]);
        return SMI_EXIT_USAGE;
      }
    } else if (strcmp(a, "--count") == 0 && has_next) {
      char *end;
      count = strtoll(argv[++i], &end, 10);
      if (*end || count < 1) {
        fprintf(stderr, "sgm-smi: --count wants a positive number, not %s\n", argv[i]);
        return SMI_EXIT_USAGE;
      }
    } else if (strcmp(a, "--dir") == 0 && has_next) {
      dir = argv[++i];
    } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      smi_usage(stdout);
      return SMI_EXIT_OK;
    } else {
      fprintf(stderr, "sgm-smi: unknown or incomplete option %s\n", a);
      smi_usage(stderr);
      return SMI_EXIT_USAGE;
    }
  }
  smi_node *nd = calloc(1, sizeof *nd);
  if (!nd) {
    fprintf(stderr, "sgm-smi: out of memory\n");
    return SMI_EXIT_UNREADABLE;
  }
  int code = SMI_EXIT_OK;
  if (mode == MODE_WATCH || mode == MODE_RECORD) {
    signal(SIGINT, smi_on_signal);
    signal(SIGTERM, smi_on_signal);
    if (interval < 0) interval = mode == MODE_WATCH ? 1000 : 500;
    FILE *out = stdout;
    if (mode == MODE_RECORD) {
      out = fopen(record, "a");
      if (!out) {
        fprintf(stderr, "sgm-smi: cannot open %s: %s\n", record, strerror(errno));
        free(nd);
        return SMI_EXIT_UNREADABLE;
      }
      if (ftell(out) == 0) fputs(smi_record_header, out);
    }
    /* Writes are checked after every sample: a full disk is an error, never
     * a run that records nothing and exits 0. */
    uint64_t t0 = sgm__clock_monotonic_ns();
    for (long long n = 0; !smi_stop && (count == 0 || n < count); n++) {
      if (n) smi_sleep_ms((uint64_t)interval);
      if (smi_stop) break;
      errno = 0;
      smi_read(dir, flags, nd);
      if (mode == MODE_WATCH) {
        fputs("\033[H\033[2J", out); /* home and clear, as top */
        smi_print_table(out, dir, nd, verbose);
      } else {
        smi_record_rows(out, (double)(sgm__clock_monotonic_ns() - t0) / 1e9, nd);
      }
      code = smi_exit_code(nd);
      smi_free(nd);
      if (fflush(out) != 0 || ferror(out)) {
        code = smi_write_failed(mode == MODE_RECORD ? record : "standard output", errno);
        break;
      }
    }
    if (mode == MODE_RECORD && fclose(out) != 0 && code != SMI_EXIT_WRITE)
      code = smi_write_failed(record, errno);
  } else {
    smi_read(dir, flags, nd);
    if (mode == MODE_JSON) smi_print_json(stdout, dir, nd);
    else if (mode == MODE_PROM) smi_print_prometheus(stdout, nd);
    else smi_print_table(stdout, dir, nd, verbose);
    smi_report_errors(nd);
    code = smi_exit_code(nd);
    smi_free(nd);
    if (fflush(stdout) != 0 || ferror(stdout)) code = smi_write_failed("standard output", errno);
  }
  free(nd);
  return code;
}
