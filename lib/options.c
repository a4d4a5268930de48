/*
 * options.c — THE option table: every SGM_* environment variable, its
 * sgm_config field, parser, bounds, default and help line, in one place.
 *
 * Invariants:
 *  - One row per variable. A default is a string that goes through the same
 *    parser as the environment, so a default can never be a value the user
 *    could not type; a test parses every default.
 *  - Precedence: default < environment < code. sgm_config_init() applies the
 *    first two; whatever a program writes into the struct afterwards wins and is
 *    checked by sgm__options_validate() at create.
 *  - A bad value is never silently replaced by a default: the first one is
 *    recorded in cfg->error naming the variable, the value and what is accepted,
 *    and sgm_context_create() refuses the config. (mimalloc warns and keeps its
 *    default; a GPU job that ignores its memory limit is worse than one that stops.)
 *  - Sizes are binary throughout: 1K = 1KB = 1KiB = 1024, as nvidia-smi, the CUDA
 *    tools and GPU-sharing schedulers such as HAMi count.
 *  - docs/options.md lists the rows in the same order with the same defaults;
 *    tests/unit/test_options.c checks it.
 *
 * Threading: the table is constant. sgm_config_init() reads the environment and
 * is safe as long as no thread changes the environment meanwhile.
 */
#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "sgm/policy.h"

/* ------------------------------------------------------------------------ */
/* The table. */

/* Indexed by sgm_backend_kind: CUDA = 0, EMU = 1, AUTO = 2. */
static const char *const backend_names[] = {"cuda", "emu", "auto", NULL};
static const char *const pointer_names[] = {"fixed", "managed", "auto", NULL};

/* The built-in eviction policies (policies/, in lib/policy.c's order), for
 * the docs. The policy rows are checked against the registry instead (see
 * string_known), which programs extend with sgm_policy_register();
 * tests/unit/test_policies.c checks this list against it. */
static const char *const policy_names[] = {"lru", "clock", "lfu", "arc", "s3fifo", "tinylfu", "lirs",
                                           NULL};
/* The same for the per-tier rows, where "" means "as SGM_POLICY". */
static const char *const policy_names_or_empty[] = {"", "lru", "clock", "lfu", "arc", "s3fifo",
                                                    "tinylfu", "lirs", NULL};

/* Indexed by sgm_share_mode. */
static const char *const share_mode_names[] = {"fair", "solo", NULL};

/* Keywords meaning "unset: the documented default" for size options. */
static const char *const keyword_none[] = {"none", NULL};
static const char *const keyword_auto[] = {"auto", NULL};

#define FIELD(f) \
  .field = #f, .offset = offsetof(sgm_config, f), .field_size = sizeof(((sgm_config *)0)->f)

static const sgm_option option_rows[] = {
    /* cuda by default: the emulated device is for machines without a GPU and is
     * never chosen silently (DESIGN.md §6). */
    {.env = "SGM_BACKEND", FIELD(backend), .kind = SGM_OPT_ENUM, .default_value = "cuda",
     .names = backend_names,
     .help = "device backend: cuda (NVIDIA GPU via libcuda.so.1), emu (emulated device in "
             "host memory), auto (cuda when a device answers, else emu with a notice)"},
    /* Device 0, as CUDA's own default device. */
    {.env = "SGM_DEVICE", FIELD(device), .kind = SGM_OPT_INT, .default_value = "0", .min = 0,
     .help = "device ordinal the context opens (as counted by CUDA: 0 to the number of GPUs - 1)"},
    /* No cap by default: the fraction below already sizes the budget. */
    {.env = "SGM_VRAM_LIMIT", FIELD(vram_limit), .kind = SGM_OPT_SIZE, .default_value = "none",
     .names = keyword_none,
     .help = "cap on the VRAM budget: bytes or % of device memory; none = no cap"},
    /* 0.95: leave room for the CUDA context, library workspaces (cuBLAS, cuDNN)
     * and the driver, which all live outside sgm's budget. */
    {.env = "SGM_VRAM_FRACTION", FIELD(vram_fraction), .kind = SGM_OPT_FRACTION,
     .default_value = "0.95", .min = 0, .max = 1,
     .help = "share of device memory the VRAM budget may take, in (0, 1] (0.9 or 90%)"},
    /* On: a shared GPU is kinder to its other processes when nothing is reserved
     * up front; TF_FORCE_GPU_ALLOW_GROWTH overrides it as in TensorFlow. */
    {.env = "SGM_ALLOW_GROWTH", FIELD(allow_growth), .kind = SGM_OPT_BOOL,
     .default_value = "on",
     .help = "grow VRAM on demand (on) or reserve the whole budget at create (off; with the "
             "virtual-memory API the budget's memory is taken at create and mapped where blocks "
             "land: SGM_VRAM_VMM)"},
    /* auto = max(RAM/2, 64 MiB): Windows' cap on shared GPU memory. */
    {.env = "SGM_SHARED_LIMIT", FIELD(shared_limit), .kind = SGM_OPT_SIZE,
     .default_value = "auto", .names = keyword_auto,
     .help = "cap on the shared (pinned host) tier: bytes or % of physical RAM; "
             "auto = max(RAM/2, 64 MiB) as Windows, which is also the most it may be"},
    /* No disk tier unless asked: spilling writes the user's data to a disk. */
    {.env = "SGM_SPILL_DIR", FIELD(spill_dir), .kind = SGM_OPT_STRING, .default_value = "",
     .help = "directory for the spill file of the disk tier; empty = no disk tier"},
    /* Half the free space: spilling must not fill the disk other programs use. */
    {.env = "SGM_SPILL_LIMIT", FIELD(spill_limit), .kind = SGM_OPT_SIZE,
     .default_value = "50%",
     .help = "cap on the disk tier: bytes or % of the free space in SGM_SPILL_DIR at create"},
    /* LRU: the classic baseline, and what sgm did before policies were
     * plug-ins; see docs/policies.md for when another one wins. */
    {.env = "SGM_POLICY", FIELD(policy), .kind = SGM_OPT_STRING, .default_value = "lru",
     .names = policy_names,
     .help = "eviction policy of every tier: lru, clock, lfu, arc, s3fifo, tinylfu, lirs, or a name "
             "registered with sgm_policy_register (docs/policies.md)"},
    /* Empty: one policy for both tiers unless asked; the tiers see different
     * traffic (shared memory holds what VRAM let go), so they may differ. */
    {.env = "SGM_POLICY_VRAM", FIELD(policy_vram), .kind = SGM_OPT_STRING, .default_value = "",
     .names = policy_names_or_empty,
     .help = "eviction policy of the VRAM tier only; empty = SGM_POLICY"},
    {.env = "SGM_POLICY_SHARED", FIELD(policy_shared), .kind = SGM_OPT_STRING, .default_value = "",
     .names = policy_names_or_empty,
     .help = "eviction policy of the shared-memory tier only (its victims go to disk); empty = "
             "SGM_POLICY"},
    /* 1 = warnings: problems are visible, nothing else is printed. */
    {.env = "SGM_VERBOSE", FIELD(verbose), .kind = SGM_OPT_INT, .default_value = "1", .min = 0,
     .max = 3, .help = "stderr log level: 0 silent, 1 warnings, 2 info, 3 debug"},
    /* 1 GiB: fits any CI machine yet holds real workloads; 1 MiB at least so
     * that a chunk or two fit; at most 128 TiB, the user address space of
     * x86-64 that the emulated device's memory comes from (and far below
     * 2^64, so no budget arithmetic on it can overflow). */
    {.env = "SGM_EMU_VRAM", FIELD(emu_vram_bytes), .kind = SGM_OPT_BYTES,
     .default_value = "1GiB", .min = (double)SGM_MiB, .max = (double)(SGM_GiB * 1024 * 128),
     .help = "memory of the emulated device (SGM_BACKEND=emu), from 1 MiB to 128 TiB"},
    /* 2 MiB: CUDA's allocation granularity (cuMemGetAllocationGranularity on
     * current GPUs, and the large-page size cuMemAlloc rounds to), so a smaller
     * chunk would waste the rest of the page. Multiples of 64 KiB, the smallest
     * page the driver maps, from 64 KiB to 1 TiB. */
    {.env = "SGM_GROWTH_CHUNK", FIELD(growth_chunk_bytes), .kind = SGM_OPT_BYTES,
     .default_value = "2MiB", .min = (double)(64 * SGM_KiB), .max = (double)(SGM_GiB * 1024),
     .granule_bytes = 64 * SGM_KiB,
     .help = "first VRAM chunk taken from the driver in growth mode; a multiple of 64 KiB up to "
             "1 TiB (shared memory has SGM_SHARED_CHUNK)"},
    /* On: the point of sgm. Off is the Windows driver's "prefer no sysmem
     * fallback": a full VRAM budget fails instead of slowing down. */
    {.env = "SGM_SHARED_FALLBACK", FIELD(shared_fallback), .kind = SGM_OPT_BOOL,
     .default_value = "on",
     .help = "when the VRAM budget is full, allocate in shared GPU memory (on) or fail (off)"},
    /* 2 s: longer than a training or serving step, so a busy loop keeps its
     * chunks; short enough that an idle process hands pinned RAM back soon.
     * Up to one day. */
    {.env = "SGM_IDLE_TRIM_MS", FIELD(idle_trim_ms), .kind = SGM_OPT_U64,
     .default_value = "2000", .max = 86400000.0,
     .help = "free shared-memory chunks (and growth-mode VRAM chunks) idle this many ms go back "
             "to the OS/driver; 0 = only on sgm_trim"},
    /* 2 MiB, as SGM_GROWTH_CHUNK's default, but its own row: pinned host RAM
     * is paid at once (faulted in and locked) and taken from every other
     * program, so it must not follow a VRAM chunk size chosen for a big card.
     * At most 64 MiB, where doubling stops anyway (lib/context.c). */
    {.env = "SGM_SHARED_CHUNK", FIELD(shared_chunk_bytes), .kind = SGM_OPT_BYTES,
     .default_value = "2MiB", .min = (double)(64 * SGM_KiB), .max = (double)(64 * SGM_MiB),
     .granule_bytes = 64 * SGM_KiB,
     .help = "first pinned chunk of the shared tier (doubling up to 64 MiB); a multiple of "
             "64 KiB up to 64 MiB"},
    /* ---- The node registry and fair budgets (lib/node.c, lib/share.c). ---- */
    /* On: two processes on one GPU must see each other, or both believe they
     * own it; off is for a program that wants none of it (and benchmarks). */
    {.env = "SGM_NODE", FIELD(node), .kind = SGM_OPT_BOOL, .default_value = "on",
     .help = "join the node registry of the device (fair budgets, sgm-smi); off = untracked"},
    /* /dev/shm: memory-backed and per machine; containers that share a host
     * path name it here to see each other. */
    {.env = "SGM_NODE_DIR", FIELD(node_dir), .kind = SGM_OPT_STRING, .default_value = "",
     .help = "directory of the node registry's record files; empty = /dev/shm"},
    /* Off: the registry is private to its user unless sharing is asked for. */
    {.env = "SGM_NODE_GROUP", FIELD(node_group), .kind = SGM_OPT_BOOL, .default_value = "off",
     .help = "share this process's record with its group (0640) and count its groups' records, "
             "instead of this user's alone (0600)"},
    /* Fair: the Windows model, each process a share of the device. */
    {.env = "SGM_SHARE_MODE", FIELD(share_mode), .kind = SGM_OPT_ENUM, .default_value = "fair",
     .names = share_mode_names,
     .help = "fair: VRAM and shared budgets are a reservation plus a weighted share of the "
             "device, idle shares lent; solo: budgets as if this process were alone"},
    /* 1: every process counts the same unless told otherwise; 1000 bounds a
     * share's ratio to what anyone would set by hand. */
    {.env = "SGM_SHARE_WEIGHT", FIELD(share_weight), .kind = SGM_OPT_INT, .default_value = "1",
     .min = 1, .max = 1000, .help = "weight of this process in fair shares, 1 to 1000"},
    /* None: a guarantee is a promise other processes pay for; asked, not given. */
    {.env = "SGM_VRAM_RESERVE", FIELD(vram_reserve), .kind = SGM_OPT_SIZE, .default_value = "none",
     .names = keyword_none,
     .help = "VRAM guaranteed to this process in fair mode (bytes or % of device memory), as "
             "DXGI's SetVideoMemoryReservation; none = 0"},
    /* 50 ms: budgets follow joins and demand within a frame of a training
     * step, and publishing costs ~1 us per period. 1 ms to 10 s. */
    {.env = "SGM_NODE_PERIOD_MS", FIELD(node_period_ms), .kind = SGM_OPT_U64, .default_value = "50",
     .min = 1, .max = 10000,
     .help = "period of publishing this process's figures and recomputing its fair budgets, in ms (a "
             "fallback asks for a recomputation sooner, at most once per quarter period)"},
    /* Empty: each process has its own emulated device, as before. */
    {.env = "SGM_EMU_DEVICE", FIELD(emu_device), .kind = SGM_OPT_STRING, .default_value = "",
     .help = "name of an emulated device shared by every process that opens it (its memory "
             "counted across them in the node registry); empty = a private device"},
    /* fixed: a pointer that never moves is what every framework expects, and
     * Unified Memory cannot be shared between processes (docs/managed.md). */
    {.env = "SGM_POINTERS", FIELD(pointers), .kind = SGM_OPT_ENUM, .default_value = "fixed",
     .names = pointer_names,
     .help = "what sgm_alloc hands out: fixed (placed once), managed (blocks from 2 MiB up are "
             "Unified Memory that sgm moves between VRAM and shared memory; refused where "
             "unsupported), auto (managed where supported, else fixed with a notice)"},
    /* On: the emulated device models a GPU with concurrent managed access;
     * off models one without (or a driver too old), to try the refusal and
     * auto's fallback without a GPU. */
    {.env = "SGM_EMU_MANAGED", FIELD(emu_managed), .kind = SGM_OPT_BOOL, .default_value = "on",
     .help = "the emulated device offers Unified Memory (on) or answers as a GPU without "
             "concurrent managed access (off)"},
    /* On: growth mode then commits what blocks touch, within a few granules
     * (docs/benchmarks.md, sgm-alloc-replay); off keeps the chunk path, which
     * is also what devices without the virtual-memory API get. */
    {.env = "SGM_VRAM_VMM", FIELD(vram_vmm), .kind = SGM_OPT_BOOL, .default_value = "on",
     .help = "use the device's virtual-memory API when it has one (on): growth mode maps granules "
             "of one reserved address range on demand, reserve mode takes the budget as granules "
             "at create and maps them where blocks land; off: growth in chunks, reserve as one "
             "contiguous chunk"},
    /* 0 = never: fault injection is only for tests. */
    {.env = "SGM_EMU_FAIL_AT", FIELD(emu_fail_at), .kind = SGM_OPT_U64, .default_value = "0",
     .help = "testing: the Nth call to the emulated device fails (open is call 1); 0 = never"},
};

#define N_OPTIONS (sizeof option_rows / sizeof option_rows[0])

const sgm_option *sgm__options_table(size_t *n_out) {
  if (n_out) *n_out = N_OPTIONS;
  return option_rows;
}

/* ------------------------------------------------------------------------ */
/* Helpers. */

/* A parsed value of any non-string kind. */
typedef union opt_value {
  sgm_size size;   /* SGM_OPT_SIZE */
  uint64_t u64;    /* SGM_OPT_BYTES, SGM_OPT_U64 */
  double fraction; /* SGM_OPT_FRACTION */
  int i;           /* SGM_OPT_BOOL, SGM_OPT_INT, SGM_OPT_ENUM */
} opt_value;

/* value as it may go into a message: at most 64 characters, unprintables as '?'. */
static const char *show_value(const char *v, char *buf, size_t len) {
  size_t n = 0, i = 0;
  for (; v[i] && i < 64 && n + 4 < len; i++)
    buf[n++] = isprint((unsigned char)v[i]) ? v[i] : '?';
  if (v[i] && n + 4 <= len) {
    memcpy(buf + n, "...", 3);
    n += 3;
  }
  buf[n] = '\0';
  return buf;
}

/* "a, b, c" from a NULL-terminated list. */
static const char *join_names(const char *const *names, char *buf, size_t len) {
  size_t n = 0;
  buf[0] = '\0';
  for (size_t i = 0; names && names[i] && n < len; i++) {
    int w = snprintf(buf + n, len - n, "%s%s", i ? ", " : "", names[i]);
    if (w < 0) break;
    n += (size_t)w;
  }
  return buf;
}

/* Bytes for messages, exact: "64 KiB", "1 TiB", else "1000000 bytes". */
static const char *fmt_exact(uint64_t b, char *buf, size_t len) {
  static const char *const units[] = {"TiB", "GiB", "MiB", "KiB"};
  for (int u = 0; u < 4; u++) {
    uint64_t unit = UINT64_C(1) << (10 * (4 - u));
    if (b && b % unit == 0) {
      snprintf(buf, len, "%llu %s", (unsigned long long)(b / unit), units[u]);
      return buf;
    }
  }
  snprintf(buf, len, "%llu bytes", (unsigned long long)b);
  return buf;
}

/* The range of an INT / U64 row as a phrase: "from 0 to 3", "0 or more". An
 * INT row without a max still has one: the largest int. */
static void fmt_range(const sgm_option *opt, char *buf, size_t len) {
  if (opt->max > 0)
    snprintf(buf, len, "from %.0f to %.0f", opt->min, opt->max);
  else if (opt->kind == SGM_OPT_INT)
    snprintf(buf, len, "from %.0f to %d", opt->min, INT_MAX);
  else
    snprintf(buf, len, "%.0f or more", opt->min);
}

/* A decimal "digits[.digits]" (or ".digits"): whole part, up to 18 fractional
 * digits as an integer with their count (further digits are dropped). */
typedef struct decimal {
  uint64_t whole;  /* the part before the point */
  bool overflow;   /* whole did not fit in 64 bits */
  uint64_t frac;   /* fractional digits as an integer */
  uint64_t scale;  /* 10^(number of fractional digits kept) */
  bool has_point;  /* a '.' was present */
} decimal;

/* Returns the end of the number, or NULL when s does not start with one. */
static const char *decimal_parse(const char *s, decimal *d) {
  memset(d, 0, sizeof *d);
  d->scale = 1;
  const char *p = s;
  while (isdigit((unsigned char)*p)) {
    unsigned dig = (unsigned)(*p - '0');
    if (d->whole > (UINT64_MAX - dig) / 10) d->overflow = true;
    else d->whole = d->whole * 10 + dig;
    p++;
  }
  bool any = p != s;
  if (*p == '.') {
    d->has_point = true;
    const char *q = ++p;
    int kept = 0;
    while (isdigit((unsigned char)*p)) {
      if (kept < 18) {
        d->frac = d->frac * 10 + (uint64_t)(*p - '0');
        d->scale *= 10;
        kept++;
      }
      p++;
    }
    if (p == q) return NULL; /* "5." is not a number */
    any = true;
  }
  return any ? p : NULL;
}

static double decimal_value(const decimal *d) {
  return (double)d->whole + (double)d->frac / (double)d->scale;
}

static const char *skip_space(const char *p) {
  while (isspace((unsigned char)*p)) p++;
  return p;
}

/* Copy s without surrounding white space into buf; false when it does not fit. */
static bool trim_copy(const char *s, char *buf, size_t len) {
  s = skip_space(s);
  size_t n = strlen(s);
  while (n && isspace((unsigned char)s[n - 1])) n--;
  if (n >= len) return false;
  memcpy(buf, s, n);
  buf[n] = '\0';
  return true;
}

/* ------------------------------------------------------------------------ */
/* Sizes. */

typedef enum size_reason {
  SIZE_OK,
  SIZE_EMPTY,
  SIZE_NEGATIVE,
  SIZE_SYNTAX,
  SIZE_OVERFLOW,
  SIZE_PERCENT_RANGE,
  SIZE_PERCENT_REFUSED,
  SIZE_FRACTIONAL_BYTES
} size_reason;

/*
 * "1048576", "512K", "512KB", "512KiB", "512Ki" (any case), "2.5GiB", "25%",
 * "12.5%"; white space around and between number and unit is allowed.
 * Units are binary. A byte count without a unit must be whole.
 */
static size_reason size_parse(const char *s, bool allow_percent, sgm_size *out) {
  out->bytes = 0;
  out->fraction = 0;
  const char *p = skip_space(s);
  if (!*p) return SIZE_EMPTY;
  if (*p == '-') return SIZE_NEGATIVE;
  decimal d;
  p = decimal_parse(p, &d);
  if (!p) return SIZE_SYNTAX;
  p = skip_space(p);
  if (*p == '%') {
    if (*skip_space(p + 1)) return SIZE_SYNTAX;
    if (!allow_percent) return SIZE_PERCENT_REFUSED;
    if (d.overflow) return SIZE_PERCENT_RANGE;
    double pct = decimal_value(&d);
    if (!(pct > 0) || pct > 100) return SIZE_PERCENT_RANGE;
    out->fraction = pct / 100.0;
    return SIZE_OK;
  }
  int shift = 0;
  switch (toupper((unsigned char)*p)) {
    case 'K': shift = 10; break;
    case 'M': shift = 20; break;
    case 'G': shift = 30; break;
    case 'T': shift = 40; break;
    default: break;
  }
  if (shift) {
    p++;
    if (toupper((unsigned char)*p) == 'I') p++;
    if (toupper((unsigned char)*p) == 'B') p++;
  } else if (toupper((unsigned char)*p) == 'B') {
    p++;
  }
  if (*skip_space(p)) return SIZE_SYNTAX;
  if (d.overflow) return SIZE_OVERFLOW;
  if (!shift && d.frac) return SIZE_FRACTIONAL_BYTES;
  uint64_t whole;
  if (shift && d.whole > (UINT64_MAX >> shift)) return SIZE_OVERFLOW;
  whole = d.whole << shift;
  /* floor(frac * 2^shift / scale) by binary long division: the remainder stays
   * below scale <= 10^18 < 2^60, so doubling it cannot overflow. */
  uint64_t part = 0, rem = d.frac;
  for (int k = 0; k < shift; k++) {
    rem <<= 1;
    part <<= 1;
    if (rem >= d.scale) {
      rem -= d.scale;
      part |= 1;
    }
  }
  if (whole > UINT64_MAX - part) return SIZE_OVERFLOW;
  out->bytes = whole + part;
  return SIZE_OK;
}

int sgm__options_parse_size(const char *s, bool allow_percent, sgm_size *out) {
  sgm_size tmp;
  if (!s) s = "";
  size_reason r = size_parse(s, allow_percent, &tmp);
  if (out) *out = r == SIZE_OK ? tmp : (sgm_size){0, 0};
  return r == SIZE_OK ? SGM_OK : SGM_ERR_INVALID;
}

/* The tail of a message explaining a size error. */
static void size_why(size_reason r, bool allow_percent, const char *const *keywords, char *why,
                     size_t len) {
  char kw[64] = "";
  if (keywords && keywords[0]) {
    char names[48];
    snprintf(kw, sizeof kw, ", or %s", join_names(keywords, names, sizeof names));
  }
  const char *usage = allow_percent
                          ? "use bytes (1048576), a unit (512MiB, 4G, 2.5GiB) or a percentage (25%)"
                          : "use bytes (1048576) or a unit (512MiB, 4G, 2.5GiB)";
  switch (r) {
    case SIZE_EMPTY: snprintf(why, len, "is empty: %s%s", usage, kw); break;
    case SIZE_NEGATIVE: snprintf(why, len, "is negative: %s%s", usage, kw); break;
    case SIZE_OVERFLOW: snprintf(why, len, "is too large: sizes must be below 2^64 bytes (16 EiB)"); break;
    case SIZE_PERCENT_RANGE: snprintf(why, len, "is out of range: a percentage must be above 0%% and at most 100%%"); break;
    case SIZE_PERCENT_REFUSED: snprintf(why, len, "is a percentage, not accepted here: %s", usage); break;
    case SIZE_FRACTIONAL_BYTES: snprintf(why, len, "is not a whole number of bytes: %s", usage); break;
    default: snprintf(why, len, "is not a size: %s%s", usage, kw); break;
  }
}

uint64_t sgm__size_resolve(sgm_size s, uint64_t reference, uint64_t dflt) {
  if (s.fraction > 0 && s.fraction <= 1) {
    long double r = (long double)s.fraction * (long double)reference;
    if (r >= (long double)reference) return reference;
    /* A decimal share such as 0.95 is not exact in binary: a product within a
     * part in 10^12 of a whole number is that number (95% of 100 is 95, not 94). */
    /* Integer casts instead of roundl/floorl: libsgm does not link libm. r is
     * below reference <= 2^64 - 1, so both casts are in range. */
    uint64_t down = (uint64_t)r, up = down + 1;
    if ((long double)up - r <= r * 1e-12L) return up;
    return down;
  }
  if (s.fraction != 0) return dflt; /* negative, NaN or above 1: not a share; validate refuses it */
  return s.bytes ? s.bytes : dflt;
}

/* ------------------------------------------------------------------------ */
/* Per-kind parsing and checking. */

/* Whole decimal number, optional leading '-'; false on junk or overflow past 2^63. */
static bool parse_integer(const char *s, bool *negative, uint64_t *out) {
  const char *p = s;
  *negative = *p == '-';
  if (*p == '-' || *p == '+') p++;
  if (!isdigit((unsigned char)*p)) return false;
  uint64_t v = 0;
  for (; isdigit((unsigned char)*p); p++) {
    unsigned dig = (unsigned)(*p - '0');
    if (v > (UINT64_MAX - dig) / 10) return false;
    v = v * 10 + dig;
  }
  if (*p) return false;
  *out = v;
  return true;
}

/* Check a value against its row's bounds; on failure write the message tail. */
static bool option_check(const sgm_option *opt, const opt_value *v, char *why, size_t len) {
  char a[48], b[48];
  switch (opt->kind) {
    case SGM_OPT_SIZE:
      if (isnan(v->size.fraction) || v->size.fraction < 0 || v->size.fraction > 1) {
        snprintf(why, len, "has a fraction outside [0, 1]: use a share in (0, 1], or 0 for bytes");
        return false;
      }
      return true;
    case SGM_OPT_BYTES:
      if ((double)v->u64 < opt->min) {
        snprintf(why, len, "is too small: use at least %s", fmt_exact((uint64_t)opt->min, a, sizeof a));
        return false;
      }
      if (opt->max > 0 && (double)v->u64 > opt->max) {
        snprintf(why, len, "is too large: use at most %s", fmt_exact((uint64_t)opt->max, a, sizeof a));
        return false;
      }
      if (opt->granule_bytes && v->u64 % opt->granule_bytes) {
        snprintf(why, len, "is not a multiple of %s: use e.g. %s",
                 fmt_exact(opt->granule_bytes, a, sizeof a),
                 fmt_exact(sgm__align_up(v->u64, opt->granule_bytes), b, sizeof b));
        return false;
      }
      return true;
    case SGM_OPT_FRACTION:
      if (!(v->fraction > 0) || v->fraction > 1) {
        snprintf(why, len, "is out of range: use a share in (0, 1] such as 0.9, or a percentage such as 90%%");
        return false;
      }
      return true;
    case SGM_OPT_BOOL:
      if (v->i != 0 && v->i != 1) {
        snprintf(why, len, "is not a boolean: use 0 or 1");
        return false;
      }
      return true;
    case SGM_OPT_INT:
      if ((double)v->i < opt->min || (opt->max > 0 && (double)v->i > opt->max)) {
        fmt_range(opt, a, sizeof a);
        snprintf(why, len, "is out of range: use a whole number %s", a);
        return false;
      }
      return true;
    case SGM_OPT_U64:
      if ((double)v->u64 < opt->min || (opt->max > 0 && (double)v->u64 > opt->max)) {
        fmt_range(opt, a, sizeof a);
        snprintf(why, len, "is out of range: use a whole number %s", a);
        return false;
      }
      return true;
    case SGM_OPT_ENUM: {
      int n = 0;
      while (opt->names[n]) n++;
      if (v->i < 0 || v->i >= n) {
        char names[128];
        snprintf(why, len, "is not valid: use one of %s", join_names(opt->names, names, sizeof names));
        return false;
      }
      return true;
    }
    case SGM_OPT_STRING: break;
  }
  return true;
}

/* Parse a non-string value; on failure write the message tail. */
static bool option_parse_value(const sgm_option *opt, const char *value, opt_value *v, char *why,
                               size_t len) {
  char t[128];
  memset(v, 0, sizeof *v);
  switch (opt->kind) {
    case SGM_OPT_SIZE: {
      if (trim_copy(value, t, sizeof t) && opt->names)
        for (size_t i = 0; opt->names[i]; i++)
          if (sgm__str_ieq(t, opt->names[i])) return true; /* unset: the documented default */
      size_reason r = size_parse(value, true, &v->size);
      if (r == SIZE_OK && v->size.bytes == 0 && v->size.fraction == 0) {
        char names[48];
        snprintf(why, len, "is zero: a size must be positive%s%s%s (or unset the variable)",
                 opt->names ? "; use " : "", opt->names ? join_names(opt->names, names, sizeof names) : "",
                 opt->names ? " for the default" : "");
        return false;
      }
      if (r != SIZE_OK) {
        size_why(r, true, opt->names, why, len);
        return false;
      }
      break;
    }
    case SGM_OPT_BYTES: {
      sgm_size s;
      size_reason r = size_parse(value, false, &s);
      if (r != SIZE_OK) {
        size_why(r, false, NULL, why, len);
        return false;
      }
      v->u64 = s.bytes;
      break;
    }
    case SGM_OPT_FRACTION: {
      decimal d;
      const char *p = skip_space(value);
      const char *e = *p == '-' ? NULL : decimal_parse(p, &d);
      bool pct = false;
      if (e) {
        e = skip_space(e);
        if (*e == '%') {
          pct = true;
          e = skip_space(e + 1);
        }
      }
      if (!e || *e || d.overflow) {
        snprintf(why, len, "is not a fraction: use a share in (0, 1] such as 0.9, or a percentage such as 90%%");
        return false;
      }
      v->fraction = pct ? decimal_value(&d) / 100.0 : decimal_value(&d);
      break;
    }
    case SGM_OPT_BOOL: {
      static const char *const yes[] = {"1", "true", "yes", "on", NULL};
      static const char *const no[] = {"0", "false", "no", "off", NULL};
      bool ok = trim_copy(value, t, sizeof t);
      v->i = -1;
      for (size_t i = 0; ok && yes[i]; i++) {
        if (sgm__str_ieq(t, yes[i])) v->i = 1;
        if (sgm__str_ieq(t, no[i])) v->i = 0;
      }
      if (v->i < 0) {
        snprintf(why, len, "is not a boolean: use 1/0, true/false, yes/no or on/off");
        return false;
      }
      break;
    }
    case SGM_OPT_INT:
    case SGM_OPT_U64: {
      bool neg = false;
      uint64_t x = 0;
      char range[48];
      fmt_range(opt, range, sizeof range);
      if (!trim_copy(value, t, sizeof t) || !parse_integer(t, &neg, &x)) {
        snprintf(why, len, "is not a whole number: use a whole number %s", range);
        return false;
      }
      if (neg && x) {
        snprintf(why, len, "is out of range: use a whole number %s", range);
        return false;
      }
      if (opt->kind == SGM_OPT_INT) {
        if (x > INT_MAX) {
          snprintf(why, len, "is out of range: use a whole number %s", range);
          return false;
        }
        v->i = (int)x;
      } else {
        v->u64 = x;
      }
      break;
    }
    case SGM_OPT_ENUM: {
      v->i = -1;
      if (trim_copy(value, t, sizeof t))
        for (int i = 0; opt->names[i]; i++)
          if (sgm__str_ieq(t, opt->names[i])) v->i = i;
      if (v->i < 0) {
        char names[128];
        snprintf(why, len, "is not valid: use one of %s", join_names(opt->names, names, sizeof names));
        return false;
      }
      break;
    }
    case SGM_OPT_STRING: break;
  }
  return option_check(opt, v, why, len);
}

static void option_store(const sgm_option *opt, sgm_config *cfg, const opt_value *v) {
  char *f = (char *)cfg + opt->offset;
  switch (opt->kind) {
    case SGM_OPT_SIZE: sgm_assert(opt->field_size == sizeof(sgm_size)); memcpy(f, &v->size, sizeof v->size); break;
    case SGM_OPT_BYTES:
    case SGM_OPT_U64: sgm_assert(opt->field_size == sizeof(uint64_t)); memcpy(f, &v->u64, sizeof v->u64); break;
    case SGM_OPT_FRACTION: sgm_assert(opt->field_size == sizeof(double)); memcpy(f, &v->fraction, sizeof v->fraction); break;
    case SGM_OPT_BOOL:
    case SGM_OPT_INT:
    case SGM_OPT_ENUM: sgm_assert(opt->field_size == sizeof(int)); memcpy(f, &v->i, sizeof v->i); break;
    case SGM_OPT_STRING: break;
  }
}

static void option_load(const sgm_option *opt, const sgm_config *cfg, opt_value *v) {
  const char *f = (const char *)cfg + opt->offset;
  memset(v, 0, sizeof *v);
  switch (opt->kind) {
    case SGM_OPT_SIZE: memcpy(&v->size, f, sizeof v->size); break;
    case SGM_OPT_BYTES:
    case SGM_OPT_U64: memcpy(&v->u64, f, sizeof v->u64); break;
    case SGM_OPT_FRACTION: memcpy(&v->fraction, f, sizeof v->fraction); break;
    case SGM_OPT_BOOL:
    case SGM_OPT_INT:
    case SGM_OPT_ENUM: memcpy(&v->i, f, sizeof v->i); break;
    case SGM_OPT_STRING: break;
  }
}

/* Rows naming an eviction policy: their values are checked against the
 * policy registry, not against the names list. */
static bool policy_row(const sgm_option *opt) {
  return opt->names == policy_names || opt->names == policy_names_or_empty;
}

/* STRING: the canonical known name matching value (any case), or NULL. */
static const char *string_known(const sgm_option *opt, const char *value) {
  if (policy_row(opt)) {
    if (!value[0]) return opt->names == policy_names_or_empty ? "" : NULL;
    const sgm_policy_ops *ops = sgm_policy_find(value);
    return ops ? ops->name : NULL;
  }
  for (size_t i = 0; opt->names[i]; i++)
    if (sgm__str_ieq(value, opt->names[i])) return opt->names[i];
  return NULL;
}

/* STRING: the accepted values for a message: "a, b, c". */
static const char *string_choices(const sgm_option *opt, char *buf, size_t len) {
  if (!policy_row(opt)) return join_names(opt->names, buf, len);
  size_t n = 0;
  buf[0] = '\0';
  for (size_t i = 0; n < len; i++) {
    const sgm_policy_ops *ops = sgm_policy_at(i);
    if (!ops) break;
    int w = snprintf(buf + n, len - n, "%s%s", i ? ", " : "", ops->name);
    if (w < 0) break;
    n += (size_t)w;
  }
  if (opt->names == policy_names_or_empty && n < len)
    snprintf(buf + n, len - n, ", or empty for SGM_POLICY's");
  return buf;
}

int sgm__options_parse(const sgm_option *opt, const char *value, sgm_config *cfg, char *err,
                       size_t err_len) {
  char why[256] = "", shown[80];
  bool ok;
  if (err && err_len) err[0] = '\0';
  if (!opt || !cfg) return SGM_ERR_INVALID;
  if (!value) {
    snprintf(why, sizeof why, "has no value");
    value = "";
    ok = false;
  } else if (opt->kind == SGM_OPT_STRING) {
    /* Strings are taken as they are: a path may well end in a space. */
    const char *canon = value;
    ok = true;
    if (opt->names && !(canon = string_known(opt, value))) {
      char names[192];
      snprintf(why, sizeof why, "is not known: valid values are %s",
               string_choices(opt, names, sizeof names));
      ok = false;
    } else if (strlen(canon) >= opt->field_size) {
      snprintf(why, sizeof why, "is too long: at most %zu bytes", opt->field_size - 1);
      ok = false;
    } else {
      memcpy((char *)cfg + opt->offset, canon, strlen(canon) + 1);
    }
  } else {
    opt_value v;
    ok = option_parse_value(opt, value, &v, why, sizeof why);
    if (ok) option_store(opt, cfg, &v);
  }
  if (ok) return SGM_OK;
  if (err && err_len)
    snprintf(err, err_len, "%s=\"%s\" %s", opt->env, show_value(value, shown, sizeof shown), why);
  return SGM_ERR_INVALID;
}

int sgm__options_validate(const sgm_config *cfg) {
  if (!cfg) return sgm__error_set(SGM_ERR_INVALID, "configuration is NULL");
  size_t elen = strnlen(cfg->error, sizeof cfg->error);
  if (elen) return sgm__error_set(SGM_ERR_INVALID, "%.*s", (int)elen, cfg->error);
  for (size_t i = 0; i < N_OPTIONS; i++) {
    const sgm_option *opt = &option_rows[i];
    char why[256], shown[128];
    if (opt->kind == SGM_OPT_STRING) {
      const char *s = (const char *)cfg + opt->offset;
      if (!memchr(s, '\0', opt->field_size))
        return sgm__error_set(SGM_ERR_INVALID, "sgm_config.%s is not NUL-terminated within its %zu bytes",
                              opt->field, opt->field_size);
      if (opt->names && !string_known(opt, s)) {
        char names[192];
        return sgm__error_set(SGM_ERR_INVALID, "sgm_config.%s = \"%s\" is not known: valid values are %s",
                              opt->field, show_value(s, shown, sizeof shown),
                              string_choices(opt, names, sizeof names));
      }
      continue;
    }
    opt_value v;
    option_load(opt, cfg, &v);
    if (option_check(opt, &v, why, sizeof why)) continue;
    switch (opt->kind) {
      case SGM_OPT_SIZE:
        snprintf(shown, sizeof shown, "{bytes = %llu, fraction = %g}", (unsigned long long)v.size.bytes,
                 v.size.fraction);
        break;
      case SGM_OPT_BYTES:
      case SGM_OPT_U64: snprintf(shown, sizeof shown, "%llu", (unsigned long long)v.u64); break;
      case SGM_OPT_FRACTION: snprintf(shown, sizeof shown, "%g", v.fraction); break;
      default: snprintf(shown, sizeof shown, "%d", v.i); break;
    }
    return sgm__error_set(SGM_ERR_INVALID, "sgm_config.%s = %s %s", opt->field, shown, why);
  }
  return SGM_OK;
}

/* ------------------------------------------------------------------------ */
/* The environment. */

/* Optimal-string-alignment distance (edits and adjacent swaps), ignoring case;
 * names longer than 63 characters are compared on their first 63. */
static size_t edit_distance(const char *a, const char *b) {
  enum { L = 64 };
  size_t la = strnlen(a, L - 1), lb = strnlen(b, L - 1);
  size_t rows[3][L];
  size_t *pp = rows[0], *prev = rows[1], *cur = rows[2];
  for (size_t j = 0; j <= lb; j++) prev[j] = j;
  for (size_t i = 1; i <= la; i++) {
    cur[0] = i;
    for (size_t j = 1; j <= lb; j++) {
      int ca = toupper((unsigned char)a[i - 1]), cb = toupper((unsigned char)b[j - 1]);
      size_t c = prev[j - 1] + (ca != cb);
      if (prev[j] + 1 < c) c = prev[j] + 1;
      if (cur[j - 1] + 1 < c) c = cur[j - 1] + 1;
      if (i > 1 && j > 1 && ca == toupper((unsigned char)b[j - 2]) &&
          toupper((unsigned char)a[i - 2]) == cb && pp[j - 2] + 1 < c)
        c = pp[j - 2] + 1;
      cur[j] = c;
    }
    size_t *t = pp;
    pp = prev;
    prev = cur;
    cur = t;
  }
  return prev[lb];
}

/* SGM_* variables read by sgm's tools, not by the library: never warned about. */
static const char *const tool_variables[] = {
    "SGM_TEST_SEED", /* the test suites' seed */
    "SGM_LIBRARY",   /* the Python package: which libsgm.so to load (docs/python.md) */
    "SGM_PYTHON",    /* sgm-demo --plot: the interpreter that runs sgm.plot */
    "SGM_ADMIN_CONF", /* the admin policy file, root's to point elsewhere (lib/admin.c, docs/admin.md) */
    "SGM_PRELOAD_FALLBACK", /* libsgm-preload.so: off = accounting and quotas only (docs/preload.md) */
    "SGM_PRELOAD_REPORT",   /* libsgm-preload.so: a file its counters are appended to at exit */
    NULL};

static bool not_an_option(const char *name) {
  for (const char *const *t = tool_variables; *t; t++)
    if (strcmp(name, *t) == 0) return true;
  return false;
}

/* Warn about SGM_* variables no row reads, naming the closest known one. */
static void options_warn_unknown(int verbose) {
  if (verbose < 1) return;
  for (char **e = environ; e && *e; e++) {
    if (strncmp(*e, "SGM_", 4) != 0) continue;
    char name[128];
    const char *eq = strchr(*e, '=');
    size_t n = eq ? (size_t)(eq - *e) : strlen(*e);
    if (n >= sizeof name) n = sizeof name - 1;
    memcpy(name, *e, n);
    name[n] = '\0';
    if (not_an_option(name)) continue;
    const sgm_option *best = NULL;
    size_t best_d = SIZE_MAX;
    for (size_t i = 0; i < N_OPTIONS; i++) {
      if (strcmp(name, option_rows[i].env) == 0) {
        best = NULL;
        best_d = 0;
        break;
      }
      size_t d = edit_distance(name + 4, option_rows[i].env + 4);
      if (d < best_d) {
        best_d = d;
        best = &option_rows[i];
      }
    }
    if (best_d == 0 && !best) continue; /* a known variable */
    /* A suggestion only when it is plausibly a typo: at most a third of the name changed. */
    if (best && best_d <= 1 + strlen(best->env + 4) / 3)
      sgm__log(verbose, 1, "unknown variable %s; did you mean %s?", name, best->env);
    else
      sgm__log(verbose, 1, "unknown variable %s is ignored (the closest option is %s; see docs/options.md)",
               name, best ? best->env : "none");
  }
}

SGM_API void sgm_config_init(sgm_config *cfg) {
  /* A caller's mistake, not sgm's: reported like every bad argument, also in
   * debug builds (an assertion here would abort the program). */
  if (!cfg) {
    sgm__error_set(SGM_ERR_INVALID, "sgm_config_init: cfg is NULL (pass the address of an "
                   "sgm_config to fill)");
    return;
  }
  memset(cfg, 0, sizeof *cfg);
  char err[SGM_ERROR_MAX];
  for (size_t i = 0; i < N_OPTIONS; i++) {
    int rc = sgm__options_parse(&option_rows[i], option_rows[i].default_value, cfg, err, sizeof err);
    sgm_assert(rc == SGM_OK); /* a default that does not parse is a bug in the table */
    (void)rc;
  }
  /* Only the first bad value goes into cfg->error; the others are logged once
   * the final verbosity is known, so that all can be fixed in one go. */
  size_t bad[N_OPTIONS], n_bad = 0;
  for (size_t i = 0; i < N_OPTIONS; i++) {
    const char *v = getenv(option_rows[i].env);
    if (!v) continue;
    if (sgm__options_parse(&option_rows[i], v, cfg, err, sizeof err) == SGM_OK) continue;
    if (n_bad == 0) memcpy(cfg->error, err, sizeof cfg->error);
    bad[n_bad++] = i;
  }
  for (size_t k = 1; k < n_bad; k++) {
    const sgm_option *opt = &option_rows[bad[k]];
    sgm_config scratch;
    memset(&scratch, 0, sizeof scratch);
    const char *v = getenv(opt->env);
    if (v && sgm__options_parse(opt, v, &scratch, err, sizeof err) != SGM_OK)
      sgm__log(cfg->verbose, 1, "%s", err);
  }
  options_warn_unknown(cfg->verbose);
}

void sgm__options_tf_growth(int verbose, int *allow_growth) {
  const char *v = getenv("TF_FORCE_GPU_ALLOW_GROWTH");
  if (!v || !allow_growth) return;
  /* TensorFlow compares with strcmp: only these two exact strings count. */
  if (strcmp(v, "true") == 0) {
    *allow_growth = 1;
  } else if (strcmp(v, "false") == 0) {
    *allow_growth = 0;
  } else {
    char shown[80];
    sgm__log(verbose, 1,
             "TF_FORCE_GPU_ALLOW_GROWTH=\"%s\" is ignored: only \"true\" and \"false\" are "
             "recognised (as in TensorFlow); keeping allow_growth=%d",
             show_value(v, shown, sizeof shown), *allow_growth);
  }
}

int sgm__options_cuda_memory_limit(int device, uint64_t *out) {
  char name[SGM_CUDA_LIMIT_NAME_MAX];
  return sgm__options_cuda_memory_limit_ex(device, out, name, sizeof name);
}

int sgm__options_cuda_memory_limit_ex(int device, uint64_t *out, char *name, size_t name_len) {
  const char *v = NULL;
  if (out) *out = 0;
  if (name_len) name[0] = '\0';
  if (!out || !name || name_len < SGM_CUDA_LIMIT_NAME_MAX)
    return sgm__error_set(SGM_ERR_INVALID, "sgm__options_cuda_memory_limit: out is NULL");
  /* Empty counts as unset: the variables belong to the scheduler, not to us. */
  if (device >= 0) {
    snprintf(name, name_len, "CUDA_DEVICE_MEMORY_LIMIT_%d", device);
    v = getenv(name);
    if (v && !*skip_space(v)) v = NULL;
  }
  if (!v) {
    snprintf(name, name_len, "CUDA_DEVICE_MEMORY_LIMIT");
    v = getenv(name);
    if (v && !*skip_space(v)) v = NULL;
  }
  if (!v) {
    name[0] = '\0';
    return SGM_OK;
  }
  sgm_size s;
  if (size_parse(v, false, &s) != SIZE_OK) {
    char shown[80];
    return sgm__error_set(SGM_ERR_INVALID,
                          "%s=\"%s\" is not a memory limit: use bytes (1073741824) or a binary unit "
                          "(1g, 1024m, 1048576k), as GPU-sharing schedulers such as HAMi write it",
                          name, show_value(v, shown, sizeof shown));
  }
  *out = s.bytes; /* "0" reads as no cap, as HAMi does */
  return SGM_OK;
}

/* ------------------------------------------------------------------------ */
/* Option names for bindings (sgm.h). */

const char *sgm_option_name(size_t i) {
  return i < N_OPTIONS ? option_rows[i].env : NULL;
}
