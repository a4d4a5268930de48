/*
 * stats.c — the two costs of statistics: sgm_get_stats (counters, fast, any
 * thread: each tier's lock is taken briefly, one at a time) and sgm_stats_json
 * (the whole state as one JSON object; shape in docs/stats.md).
 *
 * Threading: any thread; no lock of its own. Layer (lib/LAYERS):
 * context-services, below context.c. Calls down: the context's accessors
 * (context_state.c; the fork check inline in context.h), placement's and
 * the managed blocks' stats, the tiers' stats.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "context.h"
#include "internal.h"
#include "tiers/tier.h"

SGM_API sgm_status sgm_get_stats(sgm_context *ctx, sgm_stats *out) {
  if (!out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_get_stats: out is NULL");
  memset(out, 0, sizeof *out);
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_get_stats: context is NULL");
  if (sgm__context_forked(ctx)) return (sgm_status)sgm__context_fork_error(ctx, "sgm_get_stats");
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    if (sgm__context_tier(ctx, t)) sgm__tier_stats(sgm__context_tier(ctx, t), &out->tier[t]);
    else out->tier[t].budget_bytes = sgm__context_budget(ctx, t);
  }
  sgm__placement_stats(ctx, out);
  sgm__managed_stats(ctx, out);
  sgm__context_counters(ctx, out);
  return SGM_OK;
}

void sgm__strbuf_printf(sgm_strbuf *b, const char *fmt, ...) {
  if (b->failed) return;
  for (;;) {
    size_t room = b->cap - b->len;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? room : 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->failed = true;
      return;
    }
    if (b->s && (size_t)n < room) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < b->len + (size_t)n + 1) cap *= 2;
    char *s = realloc(b->s, cap);
    if (!s) {
      b->failed = true;
      return;
    }
    b->s = s;
    b->cap = cap;
  }
}

static void stats_json_string(sgm_strbuf *b, const char *s) {
  sgm__strbuf_printf(b, "\"");
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') sgm__strbuf_printf(b, "\\%c", c);
    else if (c < 0x20) sgm__strbuf_printf(b, "\\u%04x", c);
    else sgm__strbuf_printf(b, "%c", c);
  }
  sgm__strbuf_printf(b, "\"");
}

SGM_API sgm_status sgm_stats_json(sgm_context *ctx, char **out) {
  if (!out) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_stats_json: out is NULL");
  *out = NULL;
  sgm_stats st;
  sgm_status rc = sgm_get_stats(ctx, &st);
  if (rc != SGM_OK) return rc;
  sgm_strbuf b = {0};
  sgm__strbuf_printf(&b, "{\"version\":\"%d.%d.%d\",\"backend\":", SGM_VERSION_MAJOR,
                     SGM_VERSION_MINOR, SGM_VERSION_PATCH);
  stats_json_string(&b, sgm__context_bops(ctx)->name);
  sgm__strbuf_printf(&b, ",\"device\":%d,\"allow_growth\":%s,\"device_total_bytes\":%llu,"
                     "\"physical_ram_bytes\":%llu,\"n_fallbacks\":%llu,\"fallback_bytes\":%llu,"
                     "\"n_bad_frees\":%llu,",
                     sgm__context_cfg(ctx)->device, sgm__context_cfg(ctx)->allow_growth ? "true" : "false",
                     (unsigned long long)st.device_total_bytes,
                     (unsigned long long)st.physical_ram_bytes, (unsigned long long)st.n_fallbacks,
                     (unsigned long long)st.fallback_bytes, (unsigned long long)st.n_bad_frees);
  sgm__strbuf_printf(&b, "\"driver_calls\":%llu,", (unsigned long long)st.driver_calls);
  sgm__strbuf_printf(&b, "\"pointers\":\"%s\",\"managed\":{\"n_live\":%llu,\"n_promotions\":%llu,"
                     "\"n_demotions\":%llu,\"promoted_bytes\":%llu,\"demoted_bytes\":%llu,"
                     "\"n_cache_hits\":%llu,\"cached_bytes\":%llu,\"slack_bytes\":%llu,",
                     sgm__context_managed(ctx) ? "managed" : "fixed", (unsigned long long)st.n_managed_live,
                     (unsigned long long)st.n_managed_promotions,
                     (unsigned long long)st.n_managed_demotions,
                     (unsigned long long)st.managed_promoted_bytes,
                     (unsigned long long)st.managed_demoted_bytes,
                     (unsigned long long)st.n_managed_cache_hits,
                     (unsigned long long)st.managed_cached_bytes,
                     (unsigned long long)st.managed_slack_bytes);
  /* the copy-stream worker's queue (issue 14) */
  sgm__strbuf_printf(&b, "\"n_moves_queued\":%llu,\"n_moves_done\":%llu,\"n_moves_cancelled\":%llu,"
                     "\"queued_bytes\":%llu,\"inline_moved_bytes\":%llu,\"worker_moved_bytes\":%llu},"
                     "\"tiers\":{",
                     (unsigned long long)st.n_managed_moves_queued, (unsigned long long)st.n_managed_moves_done,
                     (unsigned long long)st.n_managed_moves_cancelled,
                     (unsigned long long)st.managed_queued_bytes,
                     (unsigned long long)st.managed_inline_moved_bytes,
                     (unsigned long long)st.managed_worker_moved_bytes);
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    const sgm_tier_stats *s = &st.tier[t];
    sgm__strbuf_printf(&b,
                       "%s\"%s\":{\"budget_bytes\":%llu,\"committed_bytes\":%llu,\"used_bytes\":%llu,"
                       "\"peak_used_bytes\":%llu,\"n_live\":%llu,\"bytes_in\":%llu,"
                       "\"bytes_out\":%llu,\"n_evictions\":%llu,\"n_chunks\":%llu,"
                       "\"n_allocs\":%llu,\"n_frees\":%llu,\"n_failed\":%llu,\"cached_bytes\":%llu}",
                       t ? "," : "", sgm_tier_name((sgm_tier)t),
                       (unsigned long long)s->budget_bytes, (unsigned long long)s->committed_bytes,
                       (unsigned long long)s->used_bytes, (unsigned long long)s->peak_used_bytes,
                       (unsigned long long)s->n_live, (unsigned long long)s->bytes_in,
                       (unsigned long long)s->bytes_out, (unsigned long long)s->n_evictions,
                       (unsigned long long)s->n_chunks, (unsigned long long)s->n_allocs,
                       (unsigned long long)s->n_frees, (unsigned long long)s->n_failed,
                       (unsigned long long)s->cached_bytes);
  }
  /* Expandable VRAM (issue 17): how VRAM grows. */
  sgm__strbuf_printf(&b, "},\"vram_growth\":\"%s\",\"vram_granule_bytes\":%llu,"
                     "\"vram_reserved_bytes\":%llu,\"vram_map_calls\":%llu}",
                     sgm__tier_vmm_pooled(sgm__context_tier(ctx, SGM_TIER_VRAM)) ? "reserved_vmm"
                     : !sgm__context_cfg(ctx)->allow_growth ? "reserved"
                     : st.vram_granule_bytes ? "vmm" : "chunks",
                     (unsigned long long)st.vram_granule_bytes,
                     (unsigned long long)st.vram_reserved_bytes,
                     (unsigned long long)st.vram_map_calls);
  if (b.failed) {
    free(b.s);
    return (sgm_status)sgm__error_set(SGM_ERR_NOMEM, "sgm_stats_json: out of host memory");
  }
  *out = b.s;
  return SGM_OK;
}

SGM_API void sgm_string_free(char *s) { free(s); }
