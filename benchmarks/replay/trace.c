/*
 * trace.c — the trace readers of sgm-replay and format detection.
 *
 * Three formats (docs/traces.md): the replayer's own CSV (op,id,size), the
 * MiniMalloc buffer-lifetime CSVs (id,lower,upper,size) and the Mooncake JSON
 * Lines (hash_ids). Each reader streams the file line by line and appends
 * events over dense block ids; ids of the file map to dense ids through an
 * open-addressing hash table, so a trace of n references costs O(n) time and
 * 4 bytes an event plus 8 a block, whatever the ids look like.
 *
 * Every input error names the file and the line (1-based) and what was wrong.
 */
#define _POSIX_C_SOURCE 200809L

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "replay.h"

const char *replay_format_name(replay_format f) {
  switch (f) {
    case REPLAY_FMT_CSV: return "csv";
    case REPLAY_FMT_MINIMALLOC: return "minimalloc";
    case REPLAY_FMT_MOONCAKE: return "mooncake";
    default: return "unknown";
  }
}

int replay_fail(char *err, size_t err_len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, err_len, fmt, ap);
  va_end(ap);
  return -1;
}

/* ---- id map: file id (u64) -> dense id + 1; 0 = empty slot ---- */

/* Marks a file id whose lifetime ended (own CSV: freed); a later access makes
 * a new dense block. */
#define IDMAP_DEAD UINT32_MAX

typedef struct idmap {
  uint64_t *keys; /* file ids */
  uint32_t *vals; /* dense id + 1, IDMAP_DEAD, or 0 for an empty slot */
  size_t cap;     /* slots, a power of two */
  size_t n;       /* slots used */
} idmap;

static uint64_t idmap_mix(uint64_t x) {
  /* splitmix64's finaliser: sequential ids spread over the whole table. */
  x ^= x >> 30;
  x *= UINT64_C(0xbf58476d1ce4e5b9);
  x ^= x >> 27;
  x *= UINT64_C(0x94d049bb133111eb);
  x ^= x >> 31;
  return x;
}

static void idmap_free(idmap *m) {
  free(m->keys);
  free(m->vals);
  *m = (idmap){0};
}

/* The slot of key: its own, or the empty one where it would go. */
static size_t idmap_find(const idmap *m, uint64_t key) {
  size_t mask = m->cap - 1, i = (size_t)idmap_mix(key) & mask;
  while (m->vals[i] != 0 && m->keys[i] != key) i = (i + 1) & mask;
  return i;
}

static uint32_t idmap_get(const idmap *m, uint64_t key) {
  return m->cap ? m->vals[idmap_find(m, key)] : 0;
}

/* Set key's value (val != 0); false when out of memory. */
static bool idmap_put(idmap *m, uint64_t key, uint32_t val) {
  if ((m->n + 1) * 2 > m->cap) {
    /* Load factor at most 1/2: linear probing stays short. */
    size_t cap = m->cap ? m->cap * 2 : 1024;
    idmap g = {calloc(cap, sizeof *g.keys), calloc(cap, sizeof *g.vals), cap, 0};
    if (!g.keys || !g.vals) {
      idmap_free(&g);
      return false;
    }
    for (size_t i = 0; i < m->cap; i++) {
      if (!m->vals[i]) continue;
      size_t j = idmap_find(&g, m->keys[i]);
      g.keys[j] = m->keys[i];
      g.vals[j] = m->vals[i];
      g.n++;
    }
    idmap_free(m);
    *m = g;
  }
  size_t i = idmap_find(m, key);
  if (!m->vals[i]) m->n++;
  m->keys[i] = key;
  m->vals[i] = val;
  return true;
}

/* ---- the trace being built ---- */

void replay_trace_free(replay_trace *t) {
  free(t->ev);
  free(t->size);
  free(t->req);
  *t = (replay_trace){0};
}

/* A new dense block of size bytes; its id, or -1 (message set). */
static int64_t trace_add_block(replay_trace *t, uint64_t size, char *err, size_t err_len) {
  if (t->n_blocks >= REPLAY_MAX_BLOCKS) {
    replay_fail(err, err_len, "more than %u blocks: too many for one replay",
               (unsigned)REPLAY_MAX_BLOCKS);
    return -1;
  }
  if (t->n_blocks == t->cap_blocks) {
    uint32_t cap = t->cap_blocks ? t->cap_blocks * 2 : 1024;
    if (cap > REPLAY_MAX_BLOCKS || cap < t->cap_blocks) cap = REPLAY_MAX_BLOCKS;
    uint64_t *n = realloc(t->size, (size_t)cap * sizeof *n);
    if (!n) {
      replay_fail(err, err_len, "out of memory for %u blocks", (unsigned)cap);
      return -1;
    }
    t->size = n;
    t->cap_blocks = cap;
  }
  t->size[t->n_blocks] = size;
  return (int64_t)t->n_blocks++;
}

static int trace_add_event(replay_trace *t, uint32_t e, char *err, size_t err_len) {
  if (t->n_ev == t->cap_ev) {
    size_t cap = t->cap_ev ? t->cap_ev * 2 : 4096;
    uint32_t *n = realloc(t->ev, cap * sizeof *n);
    if (!n) return replay_fail(err, err_len, "out of memory for %zu events", cap);
    t->ev = n;
    t->cap_ev = cap;
  }
  t->ev[t->n_ev++] = e;
  return 0;
}

static uint64_t trace_rounded(uint64_t size) {
  return (size + REPLAY_ALIGN - 1) / REPLAY_ALIGN * REPLAY_ALIGN;
}

int replay_trace_finish(replay_trace *t, char *err, size_t err_len) {
  enum { NEW = 0, LIVE = 1, FREED = 2 };
  uint8_t *state = calloc(t->n_blocks ? t->n_blocks : 1, 1);
  if (!state) return replay_fail(err, err_len, "out of memory");
  int rc = -1;
  uint64_t live = 0;
  t->n_access = t->n_free = 0;
  t->total_bytes = t->peak_live_bytes = 0;
  t->uniform_bytes = t->n_blocks ? t->size[0] : 0;
  for (uint32_t b = 0; b < t->n_blocks; b++) {
    if (t->size[b] == 0) {
      replay_fail(err, err_len, "block %u has size 0", (unsigned)b);
      goto out;
    }
    /* Sizes are rounded and summed in 64 bits: refuse what would wrap rather
     * than replay a trace whose byte counts are nonsense. */
    if (t->size[b] > REPLAY_MAX_BLOCK_BYTES) {
      replay_fail(err, err_len, "block %u has %llu bytes, more than the %llu a replay can hold",
                 (unsigned)b, (unsigned long long)t->size[b],
                 (unsigned long long)REPLAY_MAX_BLOCK_BYTES);
      goto out;
    }
    if (__builtin_add_overflow(t->total_bytes, trace_rounded(t->size[b]), &t->total_bytes)) {
      replay_fail(err, err_len, "the blocks' sizes add up to more than 2^64 bytes");
      goto out;
    }
    if (t->size[b] != t->uniform_bytes) t->uniform_bytes = 0;
  }
  for (size_t i = 0; i < t->n_ev; i++) {
    uint32_t b = REPLAY_EV_ID(t->ev[i]);
    if (b >= t->n_blocks) {
      replay_fail(err, err_len, "event %zu names block %u of %u", i, (unsigned)b,
                 (unsigned)t->n_blocks);
      goto out;
    }
    if (t->ev[i] & REPLAY_EV_FREE) {
      if (state[b] != LIVE) {
        replay_fail(err, err_len, "event %zu frees block %u, which is not live", i, (unsigned)b);
        goto out;
      }
      state[b] = FREED;
      t->n_free++;
      live -= trace_rounded(t->size[b]);
    } else {
      if (state[b] == FREED) {
        replay_fail(err, err_len, "event %zu accesses block %u after its free", i, (unsigned)b);
        goto out;
      }
      t->n_access++;
      if (state[b] == NEW) {
        state[b] = LIVE;
        live += trace_rounded(t->size[b]);
        if (live > t->peak_live_bytes) t->peak_live_bytes = live;
      }
    }
  }
  rc = 0;
out:
  free(state);
  return rc;
}

/* ---- lines ---- */

typedef struct line_reader {
  FILE *f;
  const char *path;
  char *buf;     /* getline's buffer */
  size_t cap;    /* its size */
  size_t lineno; /* of the line just read, 1-based */
} line_reader;

/* Next line without its end-of-line (\n, \r\n); NULL at the end of the file
 * (or on a read error: *io_err). A UTF-8 byte-order mark is dropped. */
static char *line_next(line_reader *r, size_t *len, bool *io_err) {
  *io_err = false;
  errno = 0;
  ssize_t n = getline(&r->buf, &r->cap, r->f);
  if (n < 0) {
    *io_err = ferror(r->f) != 0;
    return NULL;
  }
  r->lineno++;
  char *s = r->buf;
  if (r->lineno == 1 && n >= 3 && (unsigned char)s[0] == 0xEF && (unsigned char)s[1] == 0xBB &&
      (unsigned char)s[2] == 0xBF) {
    s += 3;
    n -= 3;
  }
  while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == '\r')) n--;
  s[n] = '\0';
  *len = (size_t)n;
  return s;
}

static bool line_blank(const char *s) {
  while (*s == ' ' || *s == '\t') s++;
  return *s == '\0';
}

/* Trim spaces and tabs around [*s, *s + *n). */
static void trim(const char **s, size_t *n) {
  while (*n && (**s == ' ' || **s == '\t')) (*s)++, (*n)--;
  while (*n && ((*s)[*n - 1] == ' ' || (*s)[*n - 1] == '\t')) (*n)--;
}

/* A decimal unsigned integer filling the whole field; false if not one or it overflows. */
static bool parse_u64(const char *s, size_t n, uint64_t *out) {
  trim(&s, &n);
  if (n == 0) return false;
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) {
    if (s[i] < '0' || s[i] > '9') return false;
    unsigned d = (unsigned)(s[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

/* A signed decimal integer (an optional '-', then digits) that fits int64_t. */
static bool parse_i64(const char *s, size_t n, int64_t *out) {
  trim(&s, &n);
  bool neg = n > 0 && s[0] == '-';
  uint64_t v;
  if (!parse_u64(s + neg, n - neg, &v)) return false;
  if (v > (uint64_t)INT64_MAX + neg) return false;
  *out = neg ? (int64_t)(0 - v) : (int64_t)v;
  return true;
}

#define CSV_MAX_FIELDS 8

typedef struct csv_field {
  const char *s; /* start, not NUL-terminated */
  size_t n;      /* length after trimming */
} csv_field;

/* Split at commas (no quoting: no format here needs it); the field count, or
 * CSV_MAX_FIELDS + 1 when there are more. */
static size_t csv_split(const char *s, csv_field *f) {
  size_t k = 0;
  for (;;) {
    const char *c = strchr(s, ',');
    size_t n = c ? (size_t)(c - s) : strlen(s);
    if (k == CSV_MAX_FIELDS) return CSV_MAX_FIELDS + 1;
    f[k].s = s;
    f[k].n = n;
    trim(&f[k].s, &f[k].n);
    k++;
    if (!c) return k;
    s = c + 1;
  }
}

static bool field_is(const csv_field *f, const char *word) {
  size_t n = strlen(word);
  if (f->n != n) return false;
  for (size_t i = 0; i < n; i++)
    if (tolower((unsigned char)f->s[i]) != word[i]) return false;
  return true;
}

/* True when line is the header made of these words (case-insensitive, spaces allowed). */
static bool header_is(const char *line, const char *const *words, size_t n_words) {
  csv_field f[CSV_MAX_FIELDS];
  size_t k = csv_split(line, f);
  if (k != n_words) return false;
  for (size_t i = 0; i < k; i++)
    if (!field_is(&f[i], words[i])) return false;
  return true;
}

static const char *const CSV_HEADER[] = {"op", "id", "size"};
static const char *const MINIMALLOC_HEADER[] = {"id", "lower", "upper", "size"};

static replay_format detect_line(const char *s) {
  while (*s == ' ' || *s == '\t') s++;
  if (*s == '{') return strstr(s, "\"hash_ids\"") ? REPLAY_FMT_MOONCAKE : REPLAY_FMT_UNKNOWN;
  if (header_is(s, CSV_HEADER, 3)) return REPLAY_FMT_CSV;
  if (header_is(s, MINIMALLOC_HEADER, 4)) return REPLAY_FMT_MINIMALLOC;
  return REPLAY_FMT_UNKNOWN;
}

static int open_reader(const char *path, line_reader *r, char *err, size_t err_len) {
  *r = (line_reader){.path = path};
  r->f = fopen(path, "r");
  if (!r->f) return replay_fail(err, err_len, "%s: cannot open: %s", path, strerror(errno));
  return 0;
}

static void close_reader(line_reader *r) {
  if (r->f) fclose(r->f);
  free(r->buf);
  r->f = NULL;
  r->buf = NULL;
}

int replay_detect_format(const char *path, replay_format *out, char *err, size_t err_len) {
  *out = REPLAY_FMT_UNKNOWN;
  line_reader r;
  if (open_reader(path, &r, err, err_len) != 0) return -1;
  int rc = -1;
  char *s;
  size_t n;
  bool io;
  while ((s = line_next(&r, &n, &io)) && line_blank(s)) {
  }
  if (!s) {
    if (io) replay_fail(err, err_len, "%s: read error: %s", path, strerror(errno));
    else replay_fail(err, err_len, "%s: the file is empty: no header or data line to tell the format", path);
    goto out;
  }
  *out = detect_line(s);
  if (*out != REPLAY_FMT_UNKNOWN) {
    rc = 0;
    goto out;
  }
  char shown[64];
  snprintf(shown, sizeof shown, "%.60s", s);
  replay_fail(err, err_len,
             "%s:%zu: cannot tell the trace format from \"%s\": expected a JSON object with "
             "\"hash_ids\" (Mooncake), the header id,lower,upper,size (MiniMalloc) or the header "
             "op,id,size (sgm-replay CSV)",
             path, r.lineno, shown);
out:
  close_reader(&r);
  return rc;
}

/* ---- own CSV: op,id,size ---- */

static int read_csv(line_reader *r, uint64_t block_bytes, replay_trace *t, char *err,
                    size_t err_len) {
  idmap m = {0};
  int rc = -1;
  bool header = false, io;
  char *s;
  size_t n;
  while ((s = line_next(r, &n, &io))) {
    if (line_blank(s)) continue;
    const char *p = s;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '#') continue;
    if (!header) {
      if (!header_is(s, CSV_HEADER, 3)) {
        replay_fail(err, err_len, "%s:%zu: expected the header op,id,size", r->path, r->lineno);
        goto out;
      }
      header = true;
      continue;
    }
    csv_field f[CSV_MAX_FIELDS];
    size_t k = csv_split(s, f);
    if (k < 2 || k > 3) {
      replay_fail(err, err_len, "%s:%zu: expected op,id,size (3 fields), found %s%zu", r->path,
                 r->lineno, k > CSV_MAX_FIELDS ? "more than " : "",
                 k > CSV_MAX_FIELDS ? (size_t)CSV_MAX_FIELDS : k);
      goto out;
    }
    bool is_access = field_is(&f[0], "a"), is_free = field_is(&f[0], "f");
    if (!is_access && !is_free) {
      replay_fail(err, err_len, "%s:%zu: unknown op \"%.*s\" (a = access, f = free)", r->path,
                 r->lineno, (int)(f[0].n > 20 ? 20 : f[0].n), f[0].s);
      goto out;
    }
    uint64_t id, size = 0;
    if (!parse_u64(f[1].s, f[1].n, &id)) {
      replay_fail(err, err_len, "%s:%zu: id \"%.*s\" is not an unsigned integer", r->path,
                 r->lineno, (int)(f[1].n > 24 ? 24 : f[1].n), f[1].s);
      goto out;
    }
    bool has_size = k == 3 && f[2].n > 0;
    if (has_size && (!parse_u64(f[2].s, f[2].n, &size) || size == 0)) {
      replay_fail(err, err_len, "%s:%zu: size \"%.*s\" is not a positive integer (bytes)",
                 r->path, r->lineno, (int)(f[2].n > 24 ? 24 : f[2].n), f[2].s);
      goto out;
    }
    uint32_t v = idmap_get(&m, id);
    bool live = v != 0 && v != IDMAP_DEAD;
    uint32_t b = live ? v - 1 : 0;
    if (live && has_size && size != t->size[b]) {
      replay_fail(err, err_len, "%s:%zu: id %llu has %llu bytes, not %llu: a live buffer keeps "
                 "its size (free it first)", r->path, r->lineno, (unsigned long long)id,
                 (unsigned long long)t->size[b], (unsigned long long)size);
      goto out;
    }
    if (is_free) {
      if (!live) {
        replay_fail(err, err_len, "%s:%zu: free of id %llu, which is not live (never accessed, "
                   "or freed already)", r->path, r->lineno, (unsigned long long)id);
        goto out;
      }
      if (trace_add_event(t, b | REPLAY_EV_FREE, err, err_len) != 0) goto out;
      if (!idmap_put(&m, id, IDMAP_DEAD)) {
        replay_fail(err, err_len, "out of memory for the id table");
        goto out;
      }
      continue;
    }
    if (!live) {
      int64_t nb = trace_add_block(t, has_size ? size : block_bytes, err, err_len);
      if (nb < 0) goto out;
      b = (uint32_t)nb;
      if (!idmap_put(&m, id, b + 1)) {
        replay_fail(err, err_len, "out of memory for the id table");
        goto out;
      }
    }
    if (trace_add_event(t, b, err, err_len) != 0) goto out;
  }
  if (io) {
    replay_fail(err, err_len, "%s: read error after line %zu: %s", r->path, r->lineno,
               strerror(errno));
    goto out;
  }
  if (!header) {
    replay_fail(err, err_len, "%s: no header op,id,size", r->path);
    goto out;
  }
  rc = 0;
out:
  idmap_free(&m);
  return rc;
}

/* ---- MiniMalloc: id,lower,upper,size ---- */

/* One event before sorting: time, then class (free 0 < last use 1 < create
 * 2), then the file's row order. */
typedef struct mm_event {
  int64_t time;   /* logical time (idealloc's tiny_bert starts at -1) */
  uint32_t cls;   /* 0 free, 1 last use, 2 create (first access) */
  uint32_t block; /* dense id = row order */
} mm_event;

static int mm_cmp(const void *a, const void *b) {
  const mm_event *x = a, *y = b;
  if (x->time != y->time) return x->time < y->time ? -1 : 1;
  if (x->cls != y->cls) return x->cls < y->cls ? -1 : 1;
  return x->block < y->block ? -1 : x->block > y->block;
}

static int read_minimalloc(line_reader *r, replay_trace *t, char *err, size_t err_len) {
  idmap m = {0};
  mm_event *ev = NULL;
  size_t n_ev = 0, cap_ev = 0;
  int rc = -1;
  bool header = false, io;
  char *s;
  size_t n;
  while ((s = line_next(r, &n, &io))) {
    if (line_blank(s)) continue;
    if (!header) {
      if (!header_is(s, MINIMALLOC_HEADER, 4)) {
        replay_fail(err, err_len, "%s:%zu: expected the header id,lower,upper,size", r->path,
                   r->lineno);
        goto out;
      }
      header = true;
      continue;
    }
    csv_field f[CSV_MAX_FIELDS];
    size_t k = csv_split(s, f);
    int64_t v[4];
    static const char *const what[] = {"id", "lower", "upper", "size"};
    if (k != 4) {
      replay_fail(err, err_len, "%s:%zu: expected id,lower,upper,size (4 fields), found %s%zu",
                 r->path, r->lineno, k > CSV_MAX_FIELDS ? "more than " : "",
                 k > CSV_MAX_FIELDS ? (size_t)CSV_MAX_FIELDS : k);
      goto out;
    }
    uint64_t id = 0, size = 0;
    for (int i = 0; i < 4; i++) {
      /* Times are signed (a planner may start before 0); id and size are not. */
      bool ok = i == 1 || i == 2 ? parse_i64(f[i].s, f[i].n, &v[i])
                                 : parse_u64(f[i].s, f[i].n, i == 0 ? &id : &size);
      if (!ok) {
        replay_fail(err, err_len, "%s:%zu: %s \"%.*s\" is not %s integer", r->path, r->lineno,
                   what[i], (int)(f[i].n > 24 ? 24 : f[i].n), f[i].s,
                   i == 1 || i == 2 ? "a 64-bit" : "an unsigned");
        goto out;
      }
    }
    if (v[1] >= v[2]) {
      replay_fail(err, err_len, "%s:%zu: lower %lld is not below upper %lld (the lifetime "
                 "[lower, upper) is empty)", r->path, r->lineno, (long long)v[1],
                 (long long)v[2]);
      goto out;
    }
    if (size == 0) {
      replay_fail(err, err_len, "%s:%zu: size is 0", r->path, r->lineno);
      goto out;
    }
    if (idmap_get(&m, id)) {
      replay_fail(err, err_len, "%s:%zu: id %llu appears twice", r->path, r->lineno,
                 (unsigned long long)id);
      goto out;
    }
    int64_t b = trace_add_block(t, size, err, err_len);
    if (b < 0) goto out;
    if (!idmap_put(&m, id, (uint32_t)b + 1)) {
      replay_fail(err, err_len, "out of memory for the id table");
      goto out;
    }
    if (n_ev + 3 > cap_ev) {
      size_t cap = cap_ev ? cap_ev * 2 : 1024;
      mm_event *nev = realloc(ev, cap * sizeof *nev);
      if (!nev) {
        replay_fail(err, err_len, "out of memory for %zu events", cap);
        goto out;
      }
      ev = nev;
      cap_ev = cap;
    }
    ev[n_ev++] = (mm_event){v[1], 2, (uint32_t)b};
    if (v[2] - 1 > v[1]) ev[n_ev++] = (mm_event){v[2] - 1, 1, (uint32_t)b};
    ev[n_ev++] = (mm_event){v[2], 0, (uint32_t)b};
  }
  if (io) {
    replay_fail(err, err_len, "%s: read error after line %zu: %s", r->path, r->lineno,
               strerror(errno));
    goto out;
  }
  if (!header) {
    replay_fail(err, err_len, "%s: no header id,lower,upper,size", r->path);
    goto out;
  }
  if (n_ev) qsort(ev, n_ev, sizeof *ev, mm_cmp);
  for (size_t i = 0; i < n_ev; i++)
    if (trace_add_event(t, ev[i].block | (ev[i].cls == 0 ? REPLAY_EV_FREE : 0), err, err_len))
      goto out;
  rc = 0;
out:
  free(ev);
  idmap_free(&m);
  return rc;
}

/* ---- Mooncake: one JSON object a line, with "hash_ids": [ints] ---- */

/* Nesting deeper than this is refused rather than recursed into. */
#define JSON_MAX_DEPTH 64

typedef struct json_line {
  const char *p;   /* next character */
  const char *s;   /* start of the line (for the column) */
  line_reader *r;  /* file and line number, for messages */
  char *err;       /* where a failure's message goes */
  size_t err_len;  /* its size */
} json_line;

static int json_fail(json_line *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int json_fail(json_line *j, const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return replay_fail(j->err, j->err_len, "%s:%zu: column %zu: %s", j->r->path, j->r->lineno,
                    (size_t)(j->p - j->s) + 1, msg);
}

static void json_ws(json_line *j) {
  while (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r') j->p++;
}

/* A string at j->p ('"'); its raw contents in [*start, *start + *len). */
static int json_string(json_line *j, const char **start, size_t *len) {
  if (*j->p != '"') return json_fail(j, "expected a string");
  const char *b = ++j->p;
  for (;;) {
    unsigned char c = (unsigned char)*j->p;
    if (c == '\0') return json_fail(j, "unterminated string");
    if (c < 0x20) return json_fail(j, "control character in a string");
    if (c == '"') break;
    if (c == '\\') {
      j->p++;
      if (*j->p == 'u') {
        for (int i = 1; i <= 4; i++)
          if (!isxdigit((unsigned char)j->p[i])) return json_fail(j, "bad \\u escape");
        j->p += 4;
      } else if (!*j->p || !strchr("\"\\/bfnrt", *j->p)) {
        return json_fail(j, "bad escape in a string");
      }
    }
    j->p++;
  }
  if (start) *start = b;
  if (len) *len = (size_t)(j->p - b);
  j->p++;
  return 0;
}

/* A number; *uint set when it is a plain non-negative integer that fits u64 (in *val). */
static int json_number(json_line *j, bool *uint, uint64_t *val) {
  bool neg = *j->p == '-', frac = false;
  if (neg) j->p++;
  if (!isdigit((unsigned char)*j->p)) return json_fail(j, "expected a value");
  if (*j->p == '0' && isdigit((unsigned char)j->p[1]))
    return json_fail(j, "a number with a leading zero");
  uint64_t v = 0;
  bool fits = true;
  while (isdigit((unsigned char)*j->p)) {
    unsigned d = (unsigned)(*j->p - '0');
    if (v > (UINT64_MAX - d) / 10) fits = false;
    else v = v * 10 + d;
    j->p++;
  }
  if (*j->p == '.') {
    frac = true;
    j->p++;
    if (!isdigit((unsigned char)*j->p)) return json_fail(j, "bad number");
    while (isdigit((unsigned char)*j->p)) j->p++;
  }
  if (*j->p == 'e' || *j->p == 'E') {
    frac = true;
    j->p++;
    if (*j->p == '+' || *j->p == '-') j->p++;
    if (!isdigit((unsigned char)*j->p)) return json_fail(j, "bad number");
    while (isdigit((unsigned char)*j->p)) j->p++;
  }
  *uint = !neg && !frac && fits;
  *val = v;
  return 0;
}

static int json_value(json_line *j, int depth);

static int json_container(json_line *j, int depth, char open) {
  char close = open == '{' ? '}' : ']';
  if (depth >= JSON_MAX_DEPTH) return json_fail(j, "nested deeper than %d", JSON_MAX_DEPTH);
  j->p++;
  json_ws(j);
  if (*j->p == close) {
    j->p++;
    return 0;
  }
  for (;;) {
    json_ws(j);
    if (open == '{') {
      if (json_string(j, NULL, NULL) != 0) return -1;
      json_ws(j);
      if (*j->p != ':') return json_fail(j, "expected ':' after an object key");
      j->p++;
      json_ws(j);
    }
    if (json_value(j, depth + 1) != 0) return -1;
    json_ws(j);
    if (*j->p == ',') {
      j->p++;
      continue;
    }
    if (*j->p == close) {
      j->p++;
      return 0;
    }
    return json_fail(j, "expected ',' or '%c'", close);
  }
}

static int json_value(json_line *j, int depth) {
  switch (*j->p) {
    case '{':
    case '[': return json_container(j, depth, *j->p);
    case '"': return json_string(j, NULL, NULL);
    case 't':
      if (strncmp(j->p, "true", 4) == 0) return j->p += 4, 0;
      break;
    case 'f':
      if (strncmp(j->p, "false", 5) == 0) return j->p += 5, 0;
      break;
    case 'n':
      if (strncmp(j->p, "null", 4) == 0) return j->p += 4, 0;
      break;
    default: {
      bool u;
      uint64_t v;
      return json_number(j, &u, &v);
    }
  }
  return json_fail(j, "expected a value");
}

/* The hash_ids array: each element a non-negative integer, appended as an access. */
static int json_hash_ids(json_line *j, idmap *m, replay_trace *t, uint64_t block_bytes) {
  if (*j->p != '[') return json_fail(j, "\"hash_ids\" is not an array");
  j->p++;
  json_ws(j);
  if (*j->p == ']') {
    j->p++;
    return 0;
  }
  for (size_t k = 0;; k++) {
    json_ws(j);
    bool u;
    uint64_t id;
    if (*j->p != '-' && !isdigit((unsigned char)*j->p))
      return json_fail(j, "hash_ids[%zu] is not a number", k);
    if (json_number(j, &u, &id) != 0) return -1;
    if (!u) return json_fail(j, "hash_ids[%zu] is not a non-negative integer below 2^64", k);
    uint32_t v = idmap_get(m, id);
    uint32_t b;
    if (v) {
      b = v - 1;
    } else {
      int64_t nb = trace_add_block(t, block_bytes, j->err, j->err_len);
      if (nb < 0) return -1;
      b = (uint32_t)nb;
      if (!idmap_put(m, id, b + 1)) return json_fail(j, "out of memory for the id table");
    }
    if (trace_add_event(t, b, j->err, j->err_len) != 0) return -1;
    json_ws(j);
    if (*j->p == ',') {
      j->p++;
      continue;
    }
    if (*j->p == ']') {
      j->p++;
      return 0;
    }
    return json_fail(j, "expected ',' or ']' in hash_ids");
  }
}

static int read_mooncake(line_reader *r, uint64_t block_bytes, replay_trace *t, char *err,
                         size_t err_len) {
  idmap m = {0};
  int rc = -1;
  bool io;
  char *s;
  size_t n;
  while ((s = line_next(r, &n, &io))) {
    if (line_blank(s)) continue;
    json_line j = {.p = s, .s = s, .r = r, .err = err, .err_len = err_len};
    if (strlen(s) != n) {
      json_fail(&j, "NUL byte in the line");
      goto out;
    }
    json_ws(&j);
    if (*j.p != '{') {
      json_fail(&j, "expected a JSON object (one request a line)");
      goto out;
    }
    j.p++;
    bool seen = false;
    json_ws(&j);
    if (*j.p == '}') {
      j.p++;
    } else {
      for (;;) {
        json_ws(&j);
        const char *key;
        size_t klen;
        if (json_string(&j, &key, &klen) != 0) goto out;
        json_ws(&j);
        if (*j.p != ':') {
          json_fail(&j, "expected ':' after an object key");
          goto out;
        }
        j.p++;
        json_ws(&j);
        if (klen == 8 && memcmp(key, "hash_ids", 8) == 0) {
          if (seen) {
            json_fail(&j, "\"hash_ids\" appears twice");
            goto out;
          }
          seen = true;
          if (t->n_req == t->cap_req) {
            size_t cap = t->cap_req ? t->cap_req * 2 : 1024;
            size_t *q = realloc(t->req, cap * sizeof *q);
            if (!q) {
              replay_fail(err, err_len, "out of memory for %zu requests", cap);
              goto out;
            }
            t->req = q;
            t->cap_req = cap;
          }
          t->req[t->n_req++] = t->n_ev;
          if (json_hash_ids(&j, &m, t, block_bytes) != 0) goto out;
        } else if (json_value(&j, 1) != 0) {
          goto out;
        }
        json_ws(&j);
        if (*j.p == ',') {
          j.p++;
          continue;
        }
        if (*j.p == '}') {
          j.p++;
          break;
        }
        json_fail(&j, "expected ',' or '}'");
        goto out;
      }
    }
    json_ws(&j);
    if (*j.p) {
      json_fail(&j, "text after the JSON object");
      goto out;
    }
    if (!seen) {
      replay_fail(err, err_len, "%s:%zu: the request has no \"hash_ids\" array", r->path,
                 r->lineno);
      goto out;
    }
  }
  if (io) {
    replay_fail(err, err_len, "%s: read error after line %zu: %s", r->path, r->lineno,
               strerror(errno));
    goto out;
  }
  rc = 0;
out:
  idmap_free(&m);
  return rc;
}

int replay_trace_load_as(const char *path, replay_format fmt, uint64_t block_bytes,
                         replay_trace *t, char *err, size_t err_len) {
  *t = (replay_trace){0};
  if (block_bytes == 0) block_bytes = REPLAY_DEFAULT_BLOCK_BYTES;
  line_reader r;
  if (open_reader(path, &r, err, err_len) != 0) return -1;
  int rc;
  switch (fmt) {
    case REPLAY_FMT_CSV: rc = read_csv(&r, block_bytes, t, err, err_len); break;
    case REPLAY_FMT_MINIMALLOC: rc = read_minimalloc(&r, t, err, err_len); break;
    case REPLAY_FMT_MOONCAKE: rc = read_mooncake(&r, block_bytes, t, err, err_len); break;
    default: rc = replay_fail(err, err_len, "%s: unknown trace format", path); break;
  }
  close_reader(&r);
  if (rc == 0) rc = replay_trace_finish(t, err, err_len);
  if (rc != 0) {
    replay_trace_free(t);
    return -1;
  }
  t->format = fmt;
  return 0;
}

int replay_trace_load(const char *path, uint64_t block_bytes, replay_trace *t, char *err,
                      size_t err_len) {
  *t = (replay_trace){0};
  replay_format fmt;
  if (replay_detect_format(path, &fmt, err, err_len) != 0) return -1;
  return replay_trace_load_as(path, fmt, block_bytes, t, err, err_len);
}
