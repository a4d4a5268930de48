/*
 * sgm-smi — the Task-Manager view of a node: every sgm process on every
 * device of this machine, read from the node registries (lib/node.c) without
 * joining them. See docs/smi.md for the output formats and exit codes.
 *
 *   sgm-smi                     table
 *   sgm-smi --watch [-i MS]     the table, refreshed in place like top
 *   sgm-smi --json              one JSON document (schema "sgm-smi/1")
 *   sgm-smi --prometheus        node-exporter textfile format
 *   sgm-smi --record FILE [-i MS] [--count N]
 *                               CSV samples appended to FILE (docs/record-format.md)
 *
 * It reads through the public reader, include/sgm/node.h (sgm_node_list,
 * sgm_node_read: bounds-checked, the one reader of the registry files), and
 * shows only live owners (their liveness lock held). A registry that cannot be read (refused, corrupt, another
 * version) is named on stderr with the reason, and the exit code says so.
 *
 * Threading: none.
 */
#include <dirent.h>
#include <errno.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "sgm/node.h"

/* Exit codes (docs/smi.md). */
#define SMI_EXIT_OK 0          /* at least one sgm process shown */
#define SMI_EXIT_NONE 1        /* no sgm process on this node */
#define SMI_EXIT_UNREADABLE 2  /* a registry could not be read (stderr says why) */
#define SMI_EXIT_USAGE 64      /* bad command line */

/* The most registries (devices) one node has in practice, with room. */
#define SMI_MAX_DEVICES 64

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
  smi_device dev[SMI_MAX_DEVICES];  /* in name order */
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
  nd->n = 0;
}

/* Every registry in dir (a missing folder: no sgm process, not an error). */
static int smi_read(const char *dir, bool group, smi_node *nd) {
  nd->n = nd->n_procs = nd->n_errors = 0;
  static sgm_node_entry entries[SMI_MAX_DEVICES];
  size_t n = 0;
  sgm_status rc = sgm_node_list(dir, entries, SMI_MAX_DEVICES, &n);
  if (rc == SGM_ERR_INVALID) return SGM_OK;
  if (rc != SGM_OK) {
    fprintf(stderr, "sgm-smi: %s\n", sgm_last_error());
    nd->n_errors++;
    return rc;
  }
  for (size_t i = 0; i < n && i < SMI_MAX_DEVICES; i++) {
    smi_device *d = &nd->dev[nd->n++];
    snprintf(d->file, sizeof d->file, "%s", entries[i].path);
    d->error[0] = '\0';
    smi_read_device(d, group ? SGM_NODE_READ_GROUP : 0);
    if (d->ok) nd->n_procs += d->info.n_processes;
    else nd->n_errors++;
  }
  return SGM_OK;
}

static void smi_report_errors(const smi_node *nd) {
  for (size_t i = 0; i < nd->n; i++)
    if (!nd->dev[i].ok)
      fprintf(stderr, "sgm-smi: registry %s is unreadable: %s\n", nd->dev[i].file, nd->dev[i].error);
}


/* ------------------------------------------------------------------------ */
/* The table. */

static const char *smi_b(uint64_t v, char *buf) { return sgm__fmt_bytes(v, buf, 32); }

static void smi_print_table(FILE *f, const char *dir, const smi_node *nd) {
  time_t now = time(NULL);
  char when[32];
  strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", localtime(&now));
  fprintf(f, "sgm-smi  %s  registry %s\n", when, dir);
  if (nd->n_procs == 0 && nd->n_errors == 0) fprintf(f, "No sgm process on this node.\n");
  for (size_t i = 0; i < nd->n; i++) {
    const smi_device *d = &nd->dev[i];
    if (!d->ok) {
      fprintf(f, "\n%s: unreadable: %s\n", d->file, d->error);
      continue;
    }
    const sgm_node_device *v = &d->info;
    const sgm_node_process *procs = d->procs;
    if (v->n_processes == 0) continue;
    char a[32], b[32], c[32], e[32], g[32];
    /* The UUID where the key is not already it (a GPU's key is GPU-<UUID>). */
    bool uuid_shown = d->uuid[0] && strcmp(d->uuid, v->key) != 0;
    fprintf(f, "\nDevice %s%s%s%s%s   %zu process%s   device %s   shared cap %s (half of RAM)\n",
            v->key, uuid_shown ? "   UUID " : "", uuid_shown ? d->uuid : "",
            v->pci_bus_id[0] ? "   PCI " : "", v->pci_bus_id, v->n_processes, v->n_processes == 1 ? "" : "es",
            smi_b(v->device_total_bytes, a), smi_b(v->shared_cap_bytes, b));
    fprintf(f, "%8s  %-16s %23s  %23s  %11s  %11s  %9s\n", "PID", "NAME", "DEDICATED used / budget",
            "SHARED used / budget", "DISK", "PEAK VRAM", "FALLBACKS");
    uint64_t tv = 0, ts = 0, td = 0;
    for (size_t k = 0; k < v->n_processes; k++) {
      const sgm_node_process *p = &procs[k];
      char vu[32], vb[32], su[32], sb[32];
      snprintf(vu, sizeof vu, "%s / %s", smi_b(p->used_bytes[SGM_TIER_VRAM], a),
               smi_b(p->budget_bytes[SGM_TIER_VRAM], b));
      snprintf(su, sizeof su, "%s / %s", smi_b(p->used_bytes[SGM_TIER_SHARED], a),
               smi_b(p->budget_bytes[SGM_TIER_SHARED], b));
      (void)vb;
      (void)sb;
      fprintf(f, "%8d  %-16.16s %23s  %23s  %11s  %11s  %9llu%s%s\n", p->pid, p->name, vu, su,
              smi_b(p->used_bytes[SGM_TIER_DISK], c),
              smi_b(p->peak_bytes[SGM_TIER_VRAM], e),
              (unsigned long long)p->n_fallbacks,
              p->solo ? "  (solo)" : "", p->interposed ? "  (interposed)" : "");
      tv += p->used_bytes[SGM_TIER_VRAM];
      ts += p->used_bytes[SGM_TIER_SHARED];
      td += p->used_bytes[SGM_TIER_DISK];
    }
    char tvs[48], tss[48];
    snprintf(tvs, sizeof tvs, "%s / %s", smi_b(tv, a), smi_b(v->device_total_bytes, b));
    snprintf(tss, sizeof tss, "%s / %s", smi_b(ts, c), smi_b(v->shared_cap_bytes, e));
    fprintf(f, "%8s  %-16s %23s  %23s  %11s\n", "", "TOTAL", tvs, tss, smi_b(td, g));
  }
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
  for (const char *c = s; *c; c++) {
    if (*c == '"' || *c == '\\') fputc('\\', f);
    fputc((unsigned char)*c < 0x20 ? '?' : *c, f);
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
    fprintf(f, "%s\n  {\"key\": \"%s\", ", first ? "" : ",", v->key);
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
      fprintf(f, "%s\n    {\"pid\": %d, \"start_ticks\": %llu, \"name\": \"%s\", \"mode\": \"%s\", "
              "\"interposed\": %s, \"weight\": %llu, \"reserve_bytes\": %llu, ",
              k ? "," : "", p->pid, (unsigned long long)p->start_ticks, p->name,
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
    fprintf(f, "%s{\"file\": \"", first ? "" : ", ");
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

/* A device's labels: its key, its UUID and PCI bus id ("" when unknown). */
static void smi_prom_labels(const smi_device *d, char *out, size_t len) {
  snprintf(out, len, "device=\"%s\",uuid=\"%s\",pci_bus_id=\"%s\"", d->info.key, d->uuid,
           d->info.pci_bus_id);
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
  char labels[256];
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
      for (size_t k = 0; k < v->n_processes; k++)
        fprintf(f, "%s{%s,pid=\"%d\",name=\"%s\"} %llu\n", smi_metrics[m].name, labels,
                procs[k].pid, procs[k].name,
                smi_field(&procs[k], smi_metrics[m].offset));
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
          "  (no option)      a table of every sgm process per device\n"
          "  --json           one JSON document (schema sgm-smi/1, docs/smi.md)\n"
          "  --prometheus     node-exporter textfile format (write it to the collector's folder)\n"
          "  --watch          the table, refreshed in place every --interval ms (default 1000)\n"
          "  --record FILE    append CSV samples every --interval ms (default 500) until\n"
          "                   interrupted or --count samples (docs/record-format.md)\n"
          "  --dir DIR        the registries' folder (default: SGM_NODE_DIR, else /dev/shm)\n"
          "exit: 0 processes shown, 1 no sgm process, 2 a registry unreadable, 64 usage\n");
}

static void smi_sleep_ms(uint64_t ms) {
  struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
  while (!smi_stop && nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static int smi_exit_code(const smi_node *nd) {
  if (nd->n_errors) return SMI_EXIT_UNREADABLE;
  return nd->n_procs ? SMI_EXIT_OK : SMI_EXIT_NONE;
}

int main(int argc, char **argv) {
  enum { MODE_TABLE, MODE_JSON, MODE_PROM, MODE_WATCH, MODE_RECORD } mode = MODE_TABLE;
  const char *dir = getenv("SGM_NODE_DIR");
  if (!dir || !*dir) dir = "/dev/shm";
  const char *record = NULL;
  long long interval = -1, count = 0;
  const char *g = getenv("SGM_NODE_GROUP");
  bool group = g && (strcmp(g, "1") == 0 || strcmp(g, "on") == 0 || strcmp(g, "true") == 0 ||
                     strcmp(g, "yes") == 0);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    bool has_next = i + 1 < argc;
    if (strcmp(a, "--json") == 0) mode = MODE_JSON;
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
    uint64_t t0 = sgm__clock_monotonic_ns();
    for (long long n = 0; !smi_stop && (count == 0 || n < count); n++) {
      if (n) smi_sleep_ms((uint64_t)interval);
      if (smi_stop) break;
      smi_read(dir, group, nd);
      if (mode == MODE_WATCH) {
        fputs("\033[H\033[2J", out); /* home and clear, as top */
        smi_print_table(out, dir, nd);
      } else {
        smi_record_rows(out, (double)(sgm__clock_monotonic_ns() - t0) / 1e9, nd);
      }
      fflush(out);
      code = smi_exit_code(nd);
      smi_free(nd);
    }
    if (mode == MODE_RECORD) fclose(out);
  } else {
    smi_read(dir, group, nd);
    if (mode == MODE_JSON) smi_print_json(stdout, dir, nd);
    else if (mode == MODE_PROM) smi_print_prometheus(stdout, nd);
    else smi_print_table(stdout, dir, nd);
    smi_report_errors(nd);
    code = smi_exit_code(nd);
    smi_free(nd);
  }
  free(nd);
  return code;
}
