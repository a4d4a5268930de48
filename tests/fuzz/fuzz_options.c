/*
 * fuzz_options.c — fuzz target for the environment/option parser: the
 * SGM_* table of lib/options.c through sgm_config_init(), then the budgets
 * sgm_context_create() resolves from it on the emulated device.
 *
 * Input: text lines NAME=VALUE (a line without '=' sets NAME to ""). Every
 * name is set with setenv() — known SGM_* rows, misspelt or unknown SGM_*
 * names (the typo warning), CUDA_DEVICE_MEMORY_LIMIT[_N] and
 * TF_FORCE_GPU_ALLOW_GROWTH; other names are ignored so that the fuzzer cannot
 * change PATH or the sanitizers' settings. Before each input every variable of
 * those families is unset, so inputs do not leak into each other.
 *
 * Invariants (a violation aborts: a crash for libFuzzer and for the plain
 * regression driver):
 *  - cfg.error is NUL-terminated within SGM_ERROR_MAX;
 *  - a config sgm_config_init() accepted passes sgm__options_validate(), and
 *    one it refused names a variable ("NAME=\"value\" why");
 *  - sgm_context_create() on it (backend forced to emu, any spill directory
 *    and the node registry's directory redirected into one private temporary
 *    folder) succeeds or fails with a
 *    message; a context that was created resolves a VRAM budget of at least
 *    one device block and at most the device, and a shared budget of at most
 *    max(physical RAM, 64 MiB) (issue 12, defect 6).
 *
 * LLVMFuzzerInitialize also checks, when SGM_FUZZ_DICT names the dictionary
 * (tests/fuzz/options.dict), that every row of the option table is in it, so
 * the dictionary cannot fall behind the table.
 *
 * Threading: none (the environment is process-wide).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "internal.h"
#include "sgm.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

extern char **environ;

static char fuzz_spill_dir[64]; /* the one folder a fuzzed SGM_SPILL_DIR may name */

static void fuzz_options_fail(const char *what, const char *detail) {
  fprintf(stderr, "fuzz_options: invariant broken: %s%s%s\n", what, detail ? ": " : "",
          detail ? detail : "");
  abort();
}

/* The variable families sgm reads; only these are set from an input. */
static int fuzz_options_family(const char *name, size_t n) {
  static const char *const prefixes[] = {"SGM_", "CUDA_DEVICE_MEMORY_LIMIT",
                                         "TF_FORCE_GPU_ALLOW_GROWTH"};
  for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++) {
    size_t p = strlen(prefixes[i]);
    if (n >= p && memcmp(name, prefixes[i], p) == 0) return 1;
  }
  return 0;
}

/* Unset every variable of the families (from a copy of the names: unsetenv
 * changes environ under the loop). */
static void fuzz_options_clear(void) {
  for (;;) {
    char name[256] = "";
    for (char **e = environ; e && *e; e++) {
      const char *eq = strchr(*e, '=');
      size_t n = eq ? (size_t)(eq - *e) : strlen(*e);
      if (fuzz_options_family(*e, n) && n < sizeof name) {
        memcpy(name, *e, n);
        name[n] = '\0';
        break;
      }
    }
    if (!name[0]) return;
    unsetenv(name);
  }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  const char *tmp = getenv("TMPDIR");
  snprintf(fuzz_spill_dir, sizeof fuzz_spill_dir, "%s/sgm-fuzz-XXXXXX",
           tmp && strlen(tmp) < 40 ? tmp : "/tmp");
  if (!mkdtemp(fuzz_spill_dir)) fuzz_options_fail("cannot create a temporary folder", NULL);

  const char *dict = getenv("SGM_FUZZ_DICT");
  if (dict && dict[0]) {
    FILE *f = fopen(dict, "r");
    if (!f) fuzz_options_fail("cannot open SGM_FUZZ_DICT", dict);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    size_t n_rows = 0;
    const sgm_option *rows = sgm__options_table(&n_rows);
    for (size_t i = 0; i < n_rows; i++) {
      char quoted[80];
      snprintf(quoted, sizeof quoted, "\"%s=\"", rows[i].env);
      if (!strstr(text, quoted)) fuzz_options_fail("the dictionary lacks an option row", quoted);
    }
  }
  return 0;
}

/* Set the environment from the input's NAME=VALUE lines. */
static void fuzz_options_apply(const uint8_t *data, size_t size) {
  size_t i = 0;
  while (i < size) {
    size_t end = i;
    while (end < size && data[end] != '\n') end++;
    size_t len = end - i;
    char line[1024];
    if (len < sizeof line) {
      memcpy(line, data + i, len);
      line[len] = '\0';
      /* setenv cannot carry a NUL; the value ends at the first one. */
      char *eq = strchr(line, '=');
      size_t name_len = eq ? (size_t)(eq - line) : strlen(line);
      if (name_len > 0 && fuzz_options_family(line, name_len)) {
        if (eq) *eq = '\0';
        setenv(line, eq ? eq + 1 : "", 1);
      }
    }
    i = end + 1;
  }
}

/* The budget invariants of a created context (defect 6 of issue 12). */
static void fuzz_options_check_budgets(sgm_context *ctx) {
  sgm_stats st;
  if (sgm_get_stats(ctx, &st) != SGM_OK) fuzz_options_fail("sgm_get_stats failed", sgm_last_error());
  uint64_t vram = st.tier[SGM_TIER_VRAM].budget_bytes;
  uint64_t shared = st.tier[SGM_TIER_SHARED].budget_bytes;
  char why[160];
  if (vram < SGM_DEVICE_ALIGN) {
    snprintf(why, sizeof why, "VRAM budget %llu B is below one %u-byte block",
             (unsigned long long)vram, (unsigned)SGM_DEVICE_ALIGN);
    fuzz_options_fail("a context was created with a budget it cannot use", why);
  }
  if (vram > st.device_total_bytes)
    fuzz_options_fail("the VRAM budget exceeds the device", NULL);
  uint64_t ram_cap = st.physical_ram_bytes > (UINT64_C(64) << 20) ? st.physical_ram_bytes
                                                                    : (UINT64_C(64) << 20);
  if (st.physical_ram_bytes && shared > ram_cap) {
    snprintf(why, sizeof why, "shared budget %llu B on %llu B of RAM",
             (unsigned long long)shared, (unsigned long long)st.physical_ram_bytes);
    fuzz_options_fail("the shared budget exceeds physical RAM", why);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!fuzz_spill_dir[0]) LLVMFuzzerInitialize(NULL, NULL);
  fuzz_options_clear();
  fuzz_options_apply(data, size);

  sgm_config cfg;
  sgm_config_init(&cfg);
  if (!memchr(cfg.error, '\0', sizeof cfg.error))
    fuzz_options_fail("cfg.error is not NUL-terminated", NULL);
  int valid = sgm__options_validate(&cfg);
  if (cfg.error[0] == '\0' && valid != SGM_OK)
    fuzz_options_fail("sgm_config_init accepted what validation refuses", sgm_last_error());
  if (cfg.error[0] != '\0' && (valid == SGM_OK || !strchr(cfg.error, '=')))
    fuzz_options_fail("a refused config does not name its variable", cfg.error);

  if (cfg.error[0] == '\0') {
    cfg.backend = SGM_BACKEND_EMU;
    if (cfg.spill_dir[0]) snprintf(cfg.spill_dir, sizeof cfg.spill_dir, "%s", fuzz_spill_dir);
    /* The node registry too: never a file outside the private folder. */
    snprintf(cfg.node_dir, sizeof cfg.node_dir, "%s", fuzz_spill_dir);
    sgm_context *ctx = NULL;
    sgm_status rc = sgm_context_create(&cfg, &ctx);
    if (rc == SGM_OK) {
      if (!ctx) fuzz_options_fail("create answered SGM_OK without a context", NULL);
      fuzz_options_check_budgets(ctx);
      sgm_context_destroy(ctx);
    } else {
      if (ctx) fuzz_options_fail("a failed create left *out set", NULL);
      if (sgm_last_error()[0] == '\0') fuzz_options_fail("a failed create left no message", NULL);
    }
  }
  fuzz_options_clear();
  return 0;
}
