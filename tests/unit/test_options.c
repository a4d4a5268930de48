/*
 * test_options.c — the option table (lib/options.c): every row's defaults and
 * environment parsing, the size syntax, precedence and validation of values
 * set in code, TensorFlow's growth variable, the scheduler memory limit, the
 * unknown-variable warning, and docs/options.md against the table.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "test_util.h"

/* ------------------------------------------------------------------------ */
/* Helpers. */

static const sgm_option *find_row(const char *env) {
  size_t n;
  const sgm_option *t = sgm__options_table(&n);
  for (size_t i = 0; i < n; i++)
    if (strcmp(t[i].env, env) == 0) return &t[i];
  return NULL;
}

/* The field a row fills, as a canonical string. */
static void field_repr(const sgm_option *opt, const sgm_config *cfg, char *buf, size_t len) {
  const char *f = (const char *)cfg + opt->offset;
  switch (opt->kind) {
    case SGM_OPT_SIZE: {
      sgm_size s;
      memcpy(&s, f, sizeof s);
      snprintf(buf, len, "b=%llu f=%g", (unsigned long long)s.bytes, s.fraction);
      break;
    }
    case SGM_OPT_BYTES:
    case SGM_OPT_U64: {
      uint64_t v;
      memcpy(&v, f, sizeof v);
      snprintf(buf, len, "%llu", (unsigned long long)v);
      break;
    }
    case SGM_OPT_FRACTION: {
      double v;
      memcpy(&v, f, sizeof v);
      snprintf(buf, len, "%g", v);
      break;
    }
    case SGM_OPT_BOOL:
    case SGM_OPT_INT:
    case SGM_OPT_ENUM: {
      int v;
      memcpy(&v, f, sizeof v);
      snprintf(buf, len, "%d", v);
      break;
    }
    case SGM_OPT_STRING: snprintf(buf, len, "%s", f); break;
  }
}

/* Capture what fn writes to fd 2 into out (NUL-terminated). */
static void capture_stderr(void (*fn)(void *), void *arg, char *out, size_t len) {
  char path[] = "/tmp/sgm_test_stderr_XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  unlink(path);
  fflush(stderr);
  int saved = dup(2);
  assert_true(saved >= 0);
  assert_true(dup2(fd, 2) >= 0);
  fn(arg);
  fflush(stderr);
  assert_true(dup2(saved, 2) >= 0);
  close(saved);
  ssize_t n = pread(fd, out, len - 1, 0);
  close(fd);
  out[n > 0 ? (size_t)n : 0] = '\0';
}

static void run_config_init(void *arg) { sgm_config_init((sgm_config *)arg); }

/* The environment with nothing sgm reads set, not even the test defaults. */
static void bare_env(void) {
  sgm_test_clean_env();
  unsetenv("SGM_BACKEND");
  unsetenv("SGM_VERBOSE");
  unsetenv("SGM_NODE");
}

/* ------------------------------------------------------------------------ */
/* The table itself. */

/* Every row is well formed, every config field but error has exactly one row,
 * and every default parses. */
static void test_table_rows_are_sane(void **state) {
  (void)state;
  sgm_test_clean_env();
  size_t n;
  const sgm_option *t = sgm__options_table(&n);
  assert_int_equal(n, 28);
  size_t fields[] = {
      offsetof(sgm_config, backend),        offsetof(sgm_config, device),
      offsetof(sgm_config, vram_limit),     offsetof(sgm_config, vram_fraction),
      offsetof(sgm_config, allow_growth),   offsetof(sgm_config, shared_limit),
      offsetof(sgm_config, spill_dir),      offsetof(sgm_config, spill_limit),
      offsetof(sgm_config, policy),         offsetof(sgm_config, verbose),
      offsetof(sgm_config, emu_vram_bytes), offsetof(sgm_config, growth_chunk_bytes),
      offsetof(sgm_config, emu_fail_at),    offsetof(sgm_config, shared_fallback),
      offsetof(sgm_config, idle_trim_ms),   offsetof(sgm_config, policy_vram),
      offsetof(sgm_config, policy_shared),  offsetof(sgm_config, shared_chunk_bytes),
      offsetof(sgm_config, node),           offsetof(sgm_config, node_dir),
      offsetof(sgm_config, node_group),     offsetof(sgm_config, share_mode),
      offsetof(sgm_config, share_weight),   offsetof(sgm_config, vram_reserve),
      offsetof(sgm_config, node_period_ms), offsetof(sgm_config, emu_device),
      offsetof(sgm_config, pointers),       offsetof(sgm_config, emu_managed)};
  for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++) {
    int rows = 0;
    for (size_t i = 0; i < n; i++) rows += t[i].offset == fields[f];
    assert_int_equal(rows, 1);
  }
  for (size_t i = 0; i < n; i++) {
    assert_non_null(t[i].env);
    assert_int_equal(strncmp(t[i].env, "SGM_", 4), 0);
    assert_non_null(t[i].field);
    assert_non_null(t[i].help);
    assert_true(strlen(t[i].help) > 10);
    assert_non_null(t[i].default_value);
    assert_true(t[i].offset + t[i].field_size <= offsetof(sgm_config, error));
    if (t[i].kind == SGM_OPT_ENUM) assert_non_null(t[i].names);
    for (size_t j = i + 1; j < n; j++) assert_string_not_equal(t[i].env, t[j].env);
    sgm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    char err[SGM_ERROR_MAX];
    assert_int_equal(sgm__options_parse(&t[i], t[i].default_value, &cfg, err, sizeof err), SGM_OK);
    assert_string_equal(err, "");
  }
  /* The enum names are indexed by sgm_backend_kind. */
  const sgm_option *b = find_row("SGM_BACKEND");
  assert_string_equal(b->names[SGM_BACKEND_CUDA], "cuda");
  assert_string_equal(b->names[SGM_BACKEND_EMU], "emu");
  assert_string_equal(b->names[SGM_BACKEND_AUTO], "auto");
}

/* With no environment, sgm_config_init gives the documented defaults. */
static void test_defaults(void **state) {
  (void)state;
  bare_env();
  sgm_config cfg;
  memset(&cfg, 0xAB, sizeof cfg);
  sgm_config_init(&cfg);
  assert_string_equal(cfg.error, "");
  assert_int_equal(cfg.backend, SGM_BACKEND_CUDA);
  assert_int_equal(cfg.device, 0);
  assert_int_equal(cfg.vram_limit.bytes, 0);
  assert_true(cfg.vram_limit.fraction == 0);
  assert_true(cfg.vram_fraction == 0.95);
  assert_int_equal(cfg.allow_growth, 1);
  assert_int_equal(cfg.shared_limit.bytes, 0);
  assert_true(cfg.shared_limit.fraction == 0);
  assert_string_equal(cfg.spill_dir, "");
  assert_int_equal(cfg.spill_limit.bytes, 0);
  assert_true(cfg.spill_limit.fraction == 0.5);
  assert_string_equal(cfg.policy, "lru");
  assert_string_equal(cfg.policy_vram, "");
  assert_string_equal(cfg.policy_shared, "");
  assert_int_equal(cfg.verbose, 1);
  assert_int_equal(cfg.emu_vram_bytes, SGM_GiB);
  assert_int_equal(cfg.growth_chunk_bytes, 2 * SGM_MiB);
  assert_int_equal(cfg.emu_fail_at, 0);
  assert_int_equal(sgm__options_validate(&cfg), SGM_OK);
}

/* ------------------------------------------------------------------------ */
/* Every row through the environment. */

typedef struct env_case {
  const char *env;
  const char *value;
  const char *expect; /* field_repr after init; NULL = a bad value */
} env_case;

static const env_case env_cases[] = {
    {"SGM_BACKEND", "emu", "1"},
    {"SGM_BACKEND", "AUTO", "2"},
    {"SGM_BACKEND", "cuda", "0"},
    {"SGM_BACKEND", "rocm", NULL},
    {"SGM_BACKEND", "", NULL},
    {"SGM_BACKEND", "1", NULL},
    {"SGM_DEVICE", "3", "3"},
    {"SGM_DEVICE", " 1 ", "1"},
    {"SGM_DEVICE", "-1", NULL},
    {"SGM_DEVICE", "one", NULL},
    {"SGM_DEVICE", "1.5", NULL},
    {"SGM_DEVICE", "99999999999", NULL},
    {"SGM_VRAM_LIMIT", "4G", "b=4294967296 f=0"},
    {"SGM_VRAM_LIMIT", "25%", "b=0 f=0.25"},
    {"SGM_VRAM_LIMIT", "none", "b=0 f=0"},
    {"SGM_VRAM_LIMIT", "NONE", "b=0 f=0"},
    {"SGM_VRAM_LIMIT", "12 parsecs", NULL},
    {"SGM_VRAM_LIMIT", "0", NULL},
    {"SGM_VRAM_LIMIT", "0%", NULL},
    {"SGM_VRAM_LIMIT", "101%", NULL},
    {"SGM_VRAM_LIMIT", "-1G", NULL},
    {"SGM_VRAM_LIMIT", "auto", NULL},
    {"SGM_VRAM_FRACTION", "0.5", "0.5"},
    {"SGM_VRAM_FRACTION", "90%", "0.9"},
    {"SGM_VRAM_FRACTION", "1", "1"},
    {"SGM_VRAM_FRACTION", ".75", "0.75"},
    {"SGM_VRAM_FRACTION", "0", NULL},
    {"SGM_VRAM_FRACTION", "1.5", NULL},
    {"SGM_VRAM_FRACTION", "-0.5", NULL},
    {"SGM_VRAM_FRACTION", "nan", NULL},
    {"SGM_VRAM_FRACTION", "0.5x", NULL},
    {"SGM_ALLOW_GROWTH", "off", "0"},
    {"SGM_ALLOW_GROWTH", "YES", "1"},
    {"SGM_ALLOW_GROWTH", "0", "0"},
    {"SGM_ALLOW_GROWTH", "False", "0"},
    {"SGM_ALLOW_GROWTH", "maybe", NULL},
    {"SGM_ALLOW_GROWTH", "2", NULL},
    {"SGM_SHARED_LIMIT", "8GiB", "b=8589934592 f=0"},
    {"SGM_SHARED_LIMIT", "50%", "b=0 f=0.5"},
    {"SGM_SHARED_LIMIT", "auto", "b=0 f=0"},
    {"SGM_SHARED_LIMIT", "none", NULL},
    {"SGM_SHARED_LIMIT", "lots", NULL},
    {"SGM_SPILL_DIR", "/tmp/spill dir", "/tmp/spill dir"},
    {"SGM_SPILL_DIR", "", ""},
    {"SGM_SPILL_LIMIT", "10G", "b=10737418240 f=0"},
    {"SGM_SPILL_LIMIT", "12.5%", "b=0 f=0.125"},
    {"SGM_SPILL_LIMIT", "200%", NULL},
    {"SGM_SPILL_LIMIT", "0", NULL},
    {"SGM_POLICY", "lru", "lru"},
    {"SGM_POLICY", "LRU", "lru"},
    {"SGM_POLICY", "arc", "arc"},
    {"SGM_POLICY", "S3FIFO", "s3fifo"},
    {"SGM_POLICY", "mru", NULL},
    {"SGM_POLICY", "", NULL},
    {"SGM_POLICY", "all", NULL},
    {"SGM_POLICY_VRAM", "Clock", "clock"},
    {"SGM_POLICY_VRAM", "", ""},
    {"SGM_POLICY_VRAM", "belady", NULL},
    {"SGM_POLICY_SHARED", "lfu", "lfu"},
    {"SGM_POLICY_SHARED", "", ""},
    {"SGM_POLICY_SHARED", "lru ", NULL},
    {"SGM_VERBOSE", "0", "0"},
    {"SGM_VERBOSE", "3", "3"},
    {"SGM_VERBOSE", "4", NULL},
    {"SGM_VERBOSE", "-1", NULL},
    {"SGM_VERBOSE", "loud", NULL},
    {"SGM_EMU_VRAM", "1MiB", "1048576"},
    {"SGM_EMU_VRAM", "64G", "68719476736"},
    {"SGM_EMU_VRAM", "512K", NULL},
    {"SGM_EMU_VRAM", "10%", NULL},
    {"SGM_EMU_VRAM", "1.5", NULL},
    {"SGM_GROWTH_CHUNK", "64KiB", "65536"},
    {"SGM_GROWTH_CHUNK", "1T", "1099511627776"},
    {"SGM_GROWTH_CHUNK", "192K", "196608"},
    {"SGM_GROWTH_CHUNK", "32K", NULL},
    {"SGM_GROWTH_CHUNK", "2T", NULL},
    {"SGM_GROWTH_CHUNK", "100K", NULL},
    {"SGM_GROWTH_CHUNK", "5%", NULL},
    {"SGM_SHARED_CHUNK", "64KiB", "65536"},
    {"SGM_SHARED_CHUNK", "64MiB", "67108864"},
    {"SGM_SHARED_CHUNK", "128MiB", NULL},
    {"SGM_SHARED_CHUNK", "100K", NULL},
    {"SGM_POINTERS", "managed", "1"},
    {"SGM_POINTERS", "AUTO", "2"},
    {"SGM_POINTERS", "fixed", "0"},
    {"SGM_POINTERS", "unified", NULL},
    {"SGM_EMU_MANAGED", "off", "0"},
    {"SGM_EMU_MANAGED", "maybe", NULL},
    {"SGM_EMU_VRAM", "18446744073709551615", NULL},
    {"SGM_EMU_VRAM", "129T", NULL},
    {"SGM_SHARED_FALLBACK", "off", "0"},
    {"SGM_SHARED_FALLBACK", "YES", "1"},
    {"SGM_SHARED_FALLBACK", "maybe", NULL},
    {"SGM_IDLE_TRIM_MS", "0", "0"},
    {"SGM_IDLE_TRIM_MS", "86400000", "86400000"},
    {"SGM_IDLE_TRIM_MS", "86400001", NULL},
    {"SGM_IDLE_TRIM_MS", "1s", NULL},
    {"SGM_EMU_FAIL_AT", "0", "0"},
    {"SGM_EMU_FAIL_AT", "7", "7"},
    {"SGM_EMU_FAIL_AT", "18446744073709551615", "18446744073709551615"},
    {"SGM_EMU_FAIL_AT", "-3", NULL},
    {"SGM_EMU_FAIL_AT", "x", NULL},
    {"SGM_EMU_FAIL_AT", "18446744073709551616", NULL},
    {"SGM_NODE", "off", "0"},
    {"SGM_NODE", "sometimes", NULL},
    {"SGM_NODE_DIR", "/tmp/node", "/tmp/node"},
    {"SGM_NODE_GROUP", "on", "1"},
    {"SGM_NODE_GROUP", "wheel", NULL},
    {"SGM_SHARE_MODE", "solo", "1"},
    {"SGM_SHARE_MODE", "FAIR", "0"},
    {"SGM_SHARE_MODE", "greedy", NULL},
    {"SGM_SHARE_WEIGHT", "3", "3"},
    {"SGM_SHARE_WEIGHT", "0", NULL},
    {"SGM_SHARE_WEIGHT", "1001", NULL},
    {"SGM_VRAM_RESERVE", "1G", "b=1073741824 f=0"},
    {"SGM_VRAM_RESERVE", "10%", "b=0 f=0.1"},
    {"SGM_VRAM_RESERVE", "lots", NULL},
    {"SGM_NODE_PERIOD_MS", "10", "10"},
    {"SGM_NODE_PERIOD_MS", "0", NULL},
    {"SGM_NODE_PERIOD_MS", "10001", NULL},
    {"SGM_EMU_DEVICE", "lab-gpu", "lab-gpu"},
    {"SGM_EMU_DEVICE", "a-name-longer-than-thirty-one-bytes", NULL},
};

/* Good values land in their field; a bad one leaves the default and puts a
 * message naming the variable and the value into cfg.error. Every row has
 * at least one case of each. */
static void test_every_row_good_and_bad(void **state) {
  (void)state;
  size_t n;
  const sgm_option *t = sgm__options_table(&n);
  int good[32] = {0}, bad[32] = {0};
  assert_true(n <= 32);
  sgm_config dflt;
  bare_env();
  sgm_config_init(&dflt);
  for (size_t c = 0; c < sizeof env_cases / sizeof env_cases[0]; c++) {
    const env_case *k = &env_cases[c];
    const sgm_option *opt = find_row(k->env);
    assert_non_null(opt);
    bare_env();
    setenv("SGM_VERBOSE", "0", 1);
    if (strcmp(k->env, "SGM_VERBOSE") == 0) unsetenv("SGM_VERBOSE");
    setenv(k->env, k->value, 1);
    sgm_config cfg;
    sgm_config_init(&cfg);
    char got[SGM_PATH_MAX + 16], want[SGM_PATH_MAX + 16];
    field_repr(opt, &cfg, got, sizeof got);
    if (k->expect) {
      print_message("# %s=\"%s\" -> %s\n", k->env, k->value, got);
      assert_string_equal(cfg.error, "");
      assert_string_equal(got, k->expect);
      good[opt - t]++;
    } else {
      print_message("# %s=\"%s\" -> %s\n", k->env, k->value, cfg.error);
      char quoted[128];
      snprintf(quoted, sizeof quoted, "%s=\"%s\" ", k->env, k->value);
      assert_non_null(strstr(cfg.error, quoted));
      field_repr(opt, &dflt, want, sizeof want);
      assert_string_equal(got, want);
      bad[opt - t]++;
    }
  }
  for (size_t i = 0; i < n; i++) {
    /* A free-form string can only be bad by its length: tested below. */
    bool need_bad = !(t[i].kind == SGM_OPT_STRING && !t[i].names);
    if (!good[i] || (need_bad && !bad[i]))
      print_error("row %s lacks a good or a bad case\n", t[i].env);
    assert_true(good[i] > 0);
    assert_true(!need_bad || bad[i] > 0);
  }
  /* The free-form path cannot be bad but for its length. */
  bare_env();
  char *long_path = malloc(SGM_PATH_MAX + 10);
  assert_non_null(long_path);
  memset(long_path, 'd', SGM_PATH_MAX + 9);
  long_path[0] = '/';
  long_path[SGM_PATH_MAX + 9] = '\0';
  setenv("SGM_SPILL_DIR", long_path, 1);
  sgm_config cfg;
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "SGM_SPILL_DIR=\"/ddd"));
  assert_non_null(strstr(cfg.error, "too long"));
  assert_string_equal(cfg.spill_dir, "");
  free(long_path);
}

/* The messages say what is accepted. */
static void test_error_messages(void **state) {
  (void)state;
  bare_env();
  setenv("SGM_VERBOSE", "0", 1);
  setenv("SGM_VRAM_LIMIT", "12 parsecs", 1);
  sgm_config cfg;
  sgm_config_init(&cfg);
  assert_string_equal(cfg.error,
                      "SGM_VRAM_LIMIT=\"12 parsecs\" is not a size: use bytes (1048576), a unit "
                      "(512MiB, 4G, 2.5GiB) or a percentage (25%), or none");
  sgm_test_clean_env();
  setenv("SGM_POLICY", "mru", 1);
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "SGM_POLICY=\"mru\""));
  assert_non_null(strstr(cfg.error, "lru, clock, lfu, arc, s3fifo"));
  sgm_test_clean_env();
  setenv("SGM_POLICY_SHARED", "mru", 1);
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "SGM_POLICY_SHARED=\"mru\""));
  assert_non_null(strstr(cfg.error, "lru, clock, lfu, arc, s3fifo, tinylfu, lirs, or empty"));
  sgm_test_clean_env();
  setenv("SGM_BACKEND", "rocm", 1);
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "cuda, emu, auto"));
  sgm_test_clean_env();
  setenv("SGM_GROWTH_CHUNK", "100K", 1);
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "multiple of 64 KiB"));
  /* An ordinal past int says the range, not "0 or more" (which it is). */
  sgm_test_clean_env();
  setenv("SGM_DEVICE", "2147483648", 1);
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "SGM_DEVICE=\"2147483648\""));
  assert_non_null(strstr(cfg.error, "from 0 to 2147483647"));
  sgm_test_clean_env();
  setenv("SGM_EMU_VRAM", "512K", 1);
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "at least 1 MiB"));
  sgm_test_clean_env();
  setenv("SGM_VERBOSE", "9", 1);
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "from 0 to 3"));
  /* Control characters do not reach the message raw. */
  sgm_test_clean_env();
  setenv("SGM_DEVICE", "1\n2", 1);
  sgm_config_init(&cfg);
  assert_non_null(strstr(cfg.error, "SGM_DEVICE=\"1?2\""));
}

/* The first bad value is the error; later good values still apply and later
 * bad ones are logged. */
static void test_first_error_wins_later_good_apply(void **state) {
  (void)state;
  bare_env();
  setenv("SGM_DEVICE", "first", 1);
  setenv("SGM_EMU_VRAM", "2G", 1);
  setenv("SGM_POLICY", "second", 1);
  sgm_config cfg;
  char out[4096];
  capture_stderr(run_config_init, &cfg, out, sizeof out);
  assert_non_null(strstr(cfg.error, "SGM_DEVICE=\"first\""));
  assert_null(strstr(cfg.error, "SGM_POLICY"));
  assert_int_equal(cfg.emu_vram_bytes, 2 * SGM_GiB);
  assert_string_equal(cfg.policy, "lru");
  assert_non_null(strstr(out, "SGM_POLICY=\"second\""));
  assert_int_equal(sgm__options_validate(&cfg), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "SGM_DEVICE=\"first\""));
}

/* ------------------------------------------------------------------------ */
/* Size syntax. */

typedef struct size_case {
  const char *s;
  bool allow_percent;
  bool ok;
  uint64_t bytes;
  double fraction;
} size_case;

static const size_case size_cases[] = {
    {"1048576", false, true, 1048576, 0},
    {"0", false, true, 0, 0},
    {"1", false, true, 1, 0},
    {"1B", false, true, 1, 0},
    {"1K", false, true, 1024, 0},
    {"1k", false, true, 1024, 0},
    {"1KB", false, true, 1024, 0},
    {"1kb", false, true, 1024, 0},
    {"1KiB", false, true, 1024, 0},
    {"1kib", false, true, 1024, 0},
    {"1Ki", false, true, 1024, 0},
    {"512MiB", false, true, 512 * SGM_MiB, 0},
    {"512MB", false, true, 512 * SGM_MiB, 0},
    {"512m", false, true, 512 * SGM_MiB, 0},
    {"4G", false, true, 4 * SGM_GiB, 0},
    {"4g", false, true, 4 * SGM_GiB, 0},
    {"4Gi", false, true, 4 * SGM_GiB, 0},
    {"1T", false, true, 1024 * SGM_GiB, 0},
    {"1TiB", false, true, 1024 * SGM_GiB, 0},
    {"2.5GiB", false, true, 2684354560u, 0},
    {"0.5K", false, true, 512, 0},
    {".5G", false, true, 512 * SGM_MiB, 0},
    {"0.1K", false, true, 102, 0}, /* rounded down */
    {"1.5 G", false, true, 1536 * SGM_MiB, 0},
    {"  4G  ", false, true, 4 * SGM_GiB, 0},
    {"18446744073709551615", false, true, UINT64_MAX, 0},
    {"16777215T", false, true, 16777215ull << 40, 0},
    {"25%", true, true, 0, 0.25},
    {"12.5%", true, true, 0, 0.125},
    {"100%", true, true, 0, 1.0},
    {"0.5 %", true, true, 0, 0.005},
    {"25%", false, false, 0, 0},
    {"0%", true, false, 0, 0},
    {"100.1%", true, false, 0, 0},
    {"-1", false, false, 0, 0},
    {"-5%", true, false, 0, 0},
    {"", false, false, 0, 0},
    {"   ", false, false, 0, 0},
    {"1.5", false, false, 0, 0},
    {"12 parsecs", true, false, 0, 0},
    {"4GG", false, false, 0, 0},
    {"4GiBs", false, false, 0, 0},
    {"4iB", false, false, 0, 0},
    {"G", false, false, 0, 0},
    {".", false, false, 0, 0},
    {"5.", false, false, 0, 0},
    {"5.G", false, false, 0, 0},
    {"1e9", false, false, 0, 0},
    {"0x10", false, false, 0, 0},
    {"1,5G", false, false, 0, 0},
    {"+5", false, false, 0, 0},
    {"4 G B", false, false, 0, 0},
    {"16777216T", false, false, 0, 0},
    {"17179869184G", false, false, 0, 0},
    {"18446744073709551616", false, false, 0, 0},
    {"99999999999999999999999K", false, false, 0, 0},
    {"15.99999999999999999999T", false, true, 17592186044415ull, 0}, /* digits past 18 dropped */
};

static void test_size_syntax(void **state) {
  (void)state;
  sgm_test_clean_env();
  for (size_t i = 0; i < sizeof size_cases / sizeof size_cases[0]; i++) {
    const size_case *c = &size_cases[i];
    sgm_size s = {123, 0.5};
    int rc = sgm__options_parse_size(c->s, c->allow_percent, &s);
    print_message("# \"%s\"%s -> %d bytes=%llu fraction=%g\n", c->s,
                  c->allow_percent ? " (%)" : "", rc, (unsigned long long)s.bytes, s.fraction);
    assert_int_equal(rc, c->ok ? SGM_OK : SGM_ERR_INVALID);
    assert_int_equal(s.bytes, c->bytes);
    assert_true(s.fraction == c->fraction);
  }
  sgm_size s = {1, 1};
  assert_int_equal(sgm__options_parse_size(NULL, true, &s), SGM_ERR_INVALID);
  assert_int_equal(s.bytes, 0);
}

/* Unset gives the default, a fraction its share rounded down, bytes themselves. */
static void test_size_resolve(void **state) {
  (void)state;
  sgm_test_clean_env();
  assert_int_equal(sgm__size_resolve((sgm_size){0, 0}, 1000, 77), 77);
  assert_int_equal(sgm__size_resolve((sgm_size){4096, 0}, 1000, 77), 4096);
  assert_int_equal(sgm__size_resolve((sgm_size){0, 0.25}, SGM_GiB, 77), 256 * SGM_MiB);
  assert_int_equal(sgm__size_resolve((sgm_size){0, 0.95}, 100, 77), 95);
  assert_int_equal(sgm__size_resolve((sgm_size){0, 1.0 / 3}, 10, 77), 3);
  assert_int_equal(sgm__size_resolve((sgm_size){0, 0.999}, 1, 77), 0);
  assert_int_equal(sgm__size_resolve((sgm_size){0, 1.0}, UINT64_MAX, 77), UINT64_MAX);
  assert_int_equal(sgm__size_resolve((sgm_size){5, 0.5}, 1000, 77), 500); /* fraction wins */
  assert_int_equal(sgm__size_resolve((sgm_size){0, -0.5}, 1000, 77), 77);
  assert_int_equal(sgm__size_resolve((sgm_size){0, NAN}, 1000, 77), 77);
  assert_int_equal(sgm__size_resolve((sgm_size){0, 2.0}, 1000, 77), 77);
  /* The parsed percentage resolves to the exact share. */
  sgm_size s;
  assert_int_equal(sgm__options_parse_size("95%", true, &s), SGM_OK);
  assert_int_equal(sgm__size_resolve(s, 100, 0), 95);
  assert_int_equal(sgm__options_parse_size("12.5%", true, &s), SGM_OK);
  assert_int_equal(sgm__size_resolve(s, 80 * SGM_GiB, 0), 10 * SGM_GiB);
}

/* ------------------------------------------------------------------------ */
/* Precedence and validation. */

static void expect_invalid(const sgm_config *cfg, const char *field) {
  assert_int_equal(sgm__options_validate(cfg), SGM_ERR_INVALID);
  print_message("# %s\n", sgm_last_error());
  char want[64];
  snprintf(want, sizeof want, "sgm_config.%s ", field);
  assert_non_null(strstr(sgm_last_error(), want));
}

static void test_precedence_default_env_code(void **state) {
  (void)state;
  sgm_test_clean_env();
  sgm_config cfg;
  sgm_config_init(&cfg);
  assert_true(cfg.vram_fraction == 0.95); /* default */
  setenv("SGM_VRAM_FRACTION", "0.5", 1);
  setenv("SGM_GROWTH_CHUNK", "4MiB", 1);
  sgm_config_init(&cfg);
  assert_true(cfg.vram_fraction == 0.5); /* environment over default */
  assert_int_equal(cfg.growth_chunk_bytes, 4 * SGM_MiB);
  cfg.vram_fraction = 0.7; /* code over environment */
  cfg.growth_chunk_bytes = 8 * SGM_MiB;
  assert_int_equal(sgm__options_validate(&cfg), SGM_OK);
  assert_true(cfg.vram_fraction == 0.7);
  assert_int_equal(cfg.growth_chunk_bytes, 8 * SGM_MiB);
}

/* Values set in code are checked, and the message names the field. */
static void test_validate_names_the_field(void **state) {
  (void)state;
  sgm_test_clean_env();
  sgm_config base, cfg;
  sgm_config_init(&base);
  assert_int_equal(sgm__options_validate(&base), SGM_OK);
  assert_int_equal(sgm__options_validate(NULL), SGM_ERR_INVALID);

  cfg = base; cfg.vram_fraction = 1.5; expect_invalid(&cfg, "vram_fraction");
  cfg = base; cfg.vram_fraction = 0; expect_invalid(&cfg, "vram_fraction");
  cfg = base; cfg.vram_fraction = NAN; expect_invalid(&cfg, "vram_fraction");
  cfg = base; cfg.verbose = 4; expect_invalid(&cfg, "verbose");
  cfg = base; cfg.verbose = -1; expect_invalid(&cfg, "verbose");
  cfg = base; cfg.backend = (sgm_backend_kind)7; expect_invalid(&cfg, "backend");
  cfg = base; cfg.device = -1; expect_invalid(&cfg, "device");
  cfg = base; cfg.allow_growth = 2; expect_invalid(&cfg, "allow_growth");
  cfg = base; cfg.vram_limit.fraction = 1.5; expect_invalid(&cfg, "vram_limit");
  cfg = base; cfg.shared_limit.fraction = -0.1; expect_invalid(&cfg, "shared_limit");
  cfg = base; cfg.spill_limit.fraction = NAN; expect_invalid(&cfg, "spill_limit");
  cfg = base; cfg.emu_vram_bytes = SGM_MiB - 1; expect_invalid(&cfg, "emu_vram_bytes");
  cfg = base; cfg.growth_chunk_bytes = 0; expect_invalid(&cfg, "growth_chunk_bytes");
  cfg = base; cfg.growth_chunk_bytes = 100 * SGM_KiB; expect_invalid(&cfg, "growth_chunk_bytes");
  cfg = base; cfg.growth_chunk_bytes = 2048 * SGM_GiB; expect_invalid(&cfg, "growth_chunk_bytes");
  cfg = base; strcpy(cfg.policy, "mru"); expect_invalid(&cfg, "policy");
  assert_non_null(strstr(sgm_last_error(), "lru, clock, lfu, arc, s3fifo"));
  cfg = base; strcpy(cfg.policy, ""); expect_invalid(&cfg, "policy");
  cfg = base; strcpy(cfg.policy_vram, "nope"); expect_invalid(&cfg, "policy_vram");
  cfg = base; strcpy(cfg.policy_shared, "opt"); expect_invalid(&cfg, "policy_shared");
  cfg = base; memset(cfg.policy_vram, 'x', sizeof cfg.policy_vram); expect_invalid(&cfg, "policy_vram");
  cfg = base; memset(cfg.spill_dir, 'x', sizeof cfg.spill_dir); expect_invalid(&cfg, "spill_dir");

  /* Good values in code pass. */
  cfg = base;
  cfg.vram_limit = (sgm_size){0, 1.0};
  cfg.shared_limit = (sgm_size){SGM_GiB, 0};
  cfg.growth_chunk_bytes = 192 * SGM_KiB;
  cfg.backend = SGM_BACKEND_AUTO;
  cfg.verbose = 3;
  strcpy(cfg.spill_dir, "/tmp");
  strcpy(cfg.policy, "ARC");
  strcpy(cfg.policy_vram, "s3fifo");
  assert_int_equal(sgm__options_validate(&cfg), SGM_OK);

  /* A config carrying an environment error is refused with that message. */
  cfg = base;
  strcpy(cfg.error, "SGM_DEVICE=\"x\" is not a whole number");
  assert_int_equal(sgm__options_validate(&cfg), SGM_ERR_INVALID);
  assert_string_equal(sgm_last_error(), "SGM_DEVICE=\"x\" is not a whole number");
}

/* ------------------------------------------------------------------------ */
/* TF_FORCE_GPU_ALLOW_GROWTH. */

typedef struct tf_args {
  int verbose;
  int growth;
} tf_args;

static void run_tf(void *arg) {
  tf_args *a = arg;
  sgm__options_tf_growth(a->verbose, &a->growth);
}

static void test_tf_force_gpu_allow_growth(void **state) {
  (void)state;
  sgm_test_clean_env();
  char out[1024];
  tf_args a = {1, 1};
  capture_stderr(run_tf, &a, out, sizeof out); /* unset: nothing happens */
  assert_int_equal(a.growth, 1);
  assert_string_equal(out, "");
  setenv("TF_FORCE_GPU_ALLOW_GROWTH", "false", 1);
  sgm__options_tf_growth(1, &a.growth);
  assert_int_equal(a.growth, 0);
  setenv("TF_FORCE_GPU_ALLOW_GROWTH", "true", 1);
  sgm__options_tf_growth(1, &a.growth);
  assert_int_equal(a.growth, 1);
  a.growth = 0;
  sgm__options_tf_growth(1, &a.growth);
  assert_int_equal(a.growth, 1);
  /* Anything but the two exact strings is ignored, with a warning. */
  const char *ignored[] = {"TRUE", "True", "1", "yes", "on", "", "true ", "FALSE", "0"};
  for (size_t i = 0; i < sizeof ignored / sizeof ignored[0]; i++) {
    for (int start = 0; start <= 1; start++) {
      setenv("TF_FORCE_GPU_ALLOW_GROWTH", ignored[i], 1);
      a.verbose = 1;
      a.growth = start;
      capture_stderr(run_tf, &a, out, sizeof out);
      assert_int_equal(a.growth, start);
      assert_non_null(strstr(out, "TF_FORCE_GPU_ALLOW_GROWTH"));
      assert_non_null(strstr(out, "ignored"));
      a.verbose = 0;
      capture_stderr(run_tf, &a, out, sizeof out);
      assert_int_equal(a.growth, start);
      assert_string_equal(out, "");
    }
  }
}

/* ------------------------------------------------------------------------ */
/* CUDA_DEVICE_MEMORY_LIMIT. */

static void test_cuda_device_memory_limit(void **state) {
  (void)state;
  sgm_test_clean_env();
  uint64_t cap = 99;
  assert_int_equal(sgm__options_cuda_memory_limit(0, &cap), SGM_OK);
  assert_int_equal(cap, 0);
  const struct {
    const char *v;
    uint64_t bytes;
  } good[] = {{"1g", SGM_GiB},          {"1G", SGM_GiB},         {"1024m", SGM_GiB},
              {"1024M", SGM_GiB},       {"1048576k", SGM_GiB},   {"1048576K", SGM_GiB},
              {"1073741824", SGM_GiB},  {"1GiB", SGM_GiB},       {"0", 0},
              {"", 0}};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    setenv("CUDA_DEVICE_MEMORY_LIMIT", good[i].v, 1);
    cap = 99;
    assert_int_equal(sgm__options_cuda_memory_limit(0, &cap), SGM_OK);
    assert_int_equal(cap, good[i].bytes);
  }
  /* The per-device variable wins for its device only. */
  setenv("CUDA_DEVICE_MEMORY_LIMIT", "4g", 1);
  setenv("CUDA_DEVICE_MEMORY_LIMIT_1", "2g", 1);
  assert_int_equal(sgm__options_cuda_memory_limit(1, &cap), SGM_OK);
  assert_int_equal(cap, 2 * SGM_GiB);
  assert_int_equal(sgm__options_cuda_memory_limit(0, &cap), SGM_OK);
  assert_int_equal(cap, 4 * SGM_GiB);
  unsetenv("CUDA_DEVICE_MEMORY_LIMIT");
  assert_int_equal(sgm__options_cuda_memory_limit(1, &cap), SGM_OK);
  assert_int_equal(cap, 2 * SGM_GiB);
  assert_int_equal(sgm__options_cuda_memory_limit(0, &cap), SGM_OK);
  assert_int_equal(cap, 0);
  /* Empty per-device value: fall back to the general one. */
  setenv("CUDA_DEVICE_MEMORY_LIMIT", "3g", 1);
  setenv("CUDA_DEVICE_MEMORY_LIMIT_1", "", 1);
  assert_int_equal(sgm__options_cuda_memory_limit(1, &cap), SGM_OK);
  assert_int_equal(cap, 3 * SGM_GiB);
  /* Bad values fail and name the variable that held them. */
  setenv("CUDA_DEVICE_MEMORY_LIMIT", "lots", 1);
  cap = 99;
  assert_int_equal(sgm__options_cuda_memory_limit(0, &cap), SGM_ERR_INVALID);
  assert_int_equal(cap, 0);
  assert_non_null(strstr(sgm_last_error(), "CUDA_DEVICE_MEMORY_LIMIT=\"lots\""));
  setenv("CUDA_DEVICE_MEMORY_LIMIT_1", "50%", 1);
  assert_int_equal(sgm__options_cuda_memory_limit(1, &cap), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "CUDA_DEVICE_MEMORY_LIMIT_1=\"50%\""));
  setenv("CUDA_DEVICE_MEMORY_LIMIT_1", "-1g", 1);
  assert_int_equal(sgm__options_cuda_memory_limit(1, &cap), SGM_ERR_INVALID);
  assert_non_null(strstr(sgm_last_error(), "CUDA_DEVICE_MEMORY_LIMIT_1"));
  assert_int_equal(sgm__options_cuda_memory_limit(0, NULL), SGM_ERR_INVALID);
}

/* ------------------------------------------------------------------------ */
/* Unknown variables. */

static void test_unknown_variable_warning(void **state) {
  (void)state;
  sgm_test_clean_env();
  setenv("SGM_VERBOSE", "1", 1);
  setenv("SGM_VRAM_LIMTI", "4G", 1);
  setenv("SGM_POLICI", "lru", 1);
  setenv("SGM_growth_chunk", "2M", 1);
  setenv("SGM_TEST_SEED", "42", 1);
  setenv("SGM_LIBRARY", "/opt/sgm/lib/libsgm.so", 1); /* the Python package's */
  setenv("SGM_PYTHON", "/usr/bin/python3", 1);       /* sgm-demo --plot's */
  setenv("SGM_COMPLETELY_DIFFERENT_THING", "1", 1);
  sgm_config cfg;
  char out[4096];
  capture_stderr(run_config_init, &cfg, out, sizeof out);
  print_message("%s", out);
  assert_string_equal(cfg.error, "");
  assert_non_null(strstr(out, "unknown variable SGM_VRAM_LIMTI; did you mean SGM_VRAM_LIMIT?"));
  assert_non_null(strstr(out, "unknown variable SGM_POLICI; did you mean SGM_POLICY?"));
  assert_non_null(strstr(out, "unknown variable SGM_growth_chunk; did you mean SGM_GROWTH_CHUNK?"));
  assert_non_null(strstr(out, "unknown variable SGM_COMPLETELY_DIFFERENT_THING"));
  assert_null(strstr(out, "SGM_TEST_SEED"));
  assert_null(strstr(out, "SGM_LIBRARY"));
  assert_null(strstr(out, "SGM_PYTHON"));
  /* Exactly the four unknown ones: known variables are not warned about. */
  int n_warn = 0;
  for (const char *p = out; (p = strstr(p, "unknown variable")) != NULL; p++) n_warn++;
  assert_int_equal(n_warn, 4);
  /* Silent at verbose 0. */
  setenv("SGM_VERBOSE", "0", 1);
  capture_stderr(run_config_init, &cfg, out, sizeof out);
  assert_string_equal(out, "");
  unsetenv("SGM_TEST_SEED");
  unsetenv("SGM_LIBRARY");
  unsetenv("SGM_PYTHON");
}

/* ------------------------------------------------------------------------ */
/* docs/options.md against the table. */

/* The doc's path from this source file's: tests/unit/x.c -> docs/options.md. */
static void doc_path(char *buf, size_t len) {
  const char *file = __FILE__;
  const char *slash = strrchr(file, '/');
  if (!slash) {
    snprintf(buf, len, "../../docs/options.md");
    return;
  }
  snprintf(buf, len, "%.*s/../../docs/options.md", (int)(slash - file), file);
}

/* Split "| a | b | c |" into trimmed cells; returns the count. */
static int split_row(char *line, char **cells, int max) {
  int n = 0;
  char *p = strchr(line, '|');
  while (p && n < max) {
    char *q = strchr(p + 1, '|');
    if (!q) break;
    *q = '\0';
    char *s = p + 1;
    while (*s == ' ') s++;
    char *e = s + strlen(s);
    while (e > s && e[-1] == ' ') *--e = '\0';
    cells[n++] = s;
    p = q;
  }
  return n;
}

/* `x` -> x; `""` -> "". */
static void unquote(const char *cell, char *out, size_t len) {
  size_t n = strlen(cell);
  if (n >= 2 && cell[0] == '`' && cell[n - 1] == '`') {
    cell++;
    n -= 2;
  }
  if (n == 2 && cell[0] == '"' && cell[1] == '"') n = 0;
  snprintf(out, len, "%.*s", (int)n, cell);
}

static void test_docs_match_table(void **state) {
  (void)state;
  sgm_test_clean_env();
  char path[1024];
  doc_path(path, sizeof path);
  FILE *f = fopen(path, "r");
  if (!f) print_error("cannot open %s\n", path);
  assert_non_null(f);
  size_t n;
  const sgm_option *t = sgm__options_table(&n);
  size_t row = 0;
  char line[2048];
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "| `SGM_", 7) != 0) continue;
    char *cells[8];
    int nc = split_row(line, cells, 8);
    assert_int_equal(nc, 4);
    char name[128], dflt[128];
    unquote(cells[0], name, sizeof name);
    unquote(cells[2], dflt, sizeof dflt);
    const sgm_option *opt = find_row(name);
    if (!opt) print_error("docs/options.md lists %s, which is not in the table\n", name);
    assert_non_null(opt);
    if (row >= n || opt != &t[row])
      print_error("docs/options.md: %s is out of the table's order\n", name);
    assert_true(row < n && opt == &t[row]);
    if (strcmp(dflt, opt->default_value) != 0)
      print_error("docs/options.md: %s default \"%s\", table \"%s\"\n", name, dflt,
                  opt->default_value);
    assert_string_equal(dflt, opt->default_value);
    assert_true(strlen(cells[3]) > 0);
    row++;
  }
  fclose(f);
  if (row != n) print_error("docs/options.md lists %zu of the %zu options\n", row, n);
  assert_int_equal(row, n);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_table_rows_are_sane),
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_every_row_good_and_bad),
      cmocka_unit_test(test_error_messages),
      cmocka_unit_test(test_first_error_wins_later_good_apply),
      cmocka_unit_test(test_size_syntax),
      cmocka_unit_test(test_size_resolve),
      cmocka_unit_test(test_precedence_default_env_code),
      cmocka_unit_test(test_validate_names_the_field),
      cmocka_unit_test(test_tf_force_gpu_allow_growth),
      cmocka_unit_test(test_cuda_device_memory_limit),
      cmocka_unit_test(test_unknown_variable_warning),
      cmocka_unit_test(test_docs_match_table),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
