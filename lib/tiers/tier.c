/*
 * tier.c — the chunk pool every tier is built on (see tier.h for the model).
 *
 * Invariants (checked by sgm__tier_check):
 *  - committed_bytes <= budget_bytes (unless the budget was lowered below what
 *    was committed, see sgm__tier_set_budget), committed_bytes >= the sum of the
 *    live chunks' sizes (it also counts chunks being taken right now);
 *  - every chunk is one range of the sub-allocator, at its device address;
 *  - used_bytes and n_live equal the sub-allocator's.
 *
 * Threading: every function takes the pool lock; none holds it across a
 * backend call (see tier.h).
 */
#include "tiers/tier.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Dedicated chunks are rounded to 64 KiB, the smallest page the GPU maps. */
#define TIER_DEDICATED_GRANULE (UINT64_C(64) << 10)
/* A caller that keeps losing the chunk it just grew to other threads gives up
 * after this many rounds rather than spin forever. */
#define TIER_MAX_GROW_ROUNDS 16

static bool tier_is_pending_locked(const sgm_tier_pool *p, sgm_devptr ptr);

/* Keep room_bytes = budget - used (0 when over) for the lock-free check. */
static void tier_update_room_locked(sgm_tier_pool *p) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  uint64_t room = p->p.budget_bytes > p->used_bytes ? p->p.budget_bytes - p->used_bytes : 0;
  __atomic_store_n(&p->room_bytes, room, __ATOMIC_RELAXED);
}

static int tier_add_chunk_locked(sgm_tier_pool *p, const sgm_chunk *c) {
  sgm_assert_internal(sgm__lock_held(&p->lock));
  if (p->n_chunks == p->cap_chunks) {
    size_t cap = p->cap_chunks ? p->cap_chunks * 2 : 8;
    sgm_chunk *n = realloc(p->chunks, cap * sizeof *n);
    if (!n) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory for chunk metadata");
    p->chunks = n;
    p->cap_chunks = cap;
  }
  int rc = sgm__suballoc_add_range(p->sa, c->base, c->bytes);
  if (rc != SGM_OK) return rc;
  p->chunks[p->n_chunks] = *c;
  p->chunks[p->n_chunks].free_seen_ms = UINT64_MAX;
  p->n_chunks++;
  return SGM_OK;
}

int sgm__tier_create(const sgm_tier_params *params, sgm_tier_pool **out) {
  *out = NULL;
  sgm_tier_pool *p = calloc(1, sizeof *p);
  if (!p) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating the %s tier",
                                sgm_tier_name(params->tier));
  p->p = *params;
  p->room_bytes = params->budget_bytes;
  pthread_cond_init(&p->grown, NULL);
  sgm__lock_init(&p->lock, SGM_LOCK_TIER_VRAM + (int)params->tier);
  int rc = sgm__suballoc_create(SGM_DEVICE_ALIGN, &p->sa);
  if (rc != SGM_OK) goto out_free;
  if (!params->growth && params->budget_bytes > 0) {
    /* Reserve mode: the whole budget as one contiguous range, so that any
     * block up to the budget fits. */
    sgm_chunk c = {0};
    rc = params->ops->chunk_alloc(p, params->budget_bytes, &c);
    if (rc != SGM_OK) {
      char b[32];
      rc = sgm__error_set(rc, "cannot reserve the %s budget of %s at create (growth mode off): %s; "
                          "lower SGM_VRAM_LIMIT / SGM_VRAM_FRACTION or set SGM_ALLOW_GROWTH=1",
                          sgm_tier_name(params->tier),
                          sgm__fmt_bytes(params->budget_bytes, b, sizeof b), sgm_last_error());
      goto out_sa;
    }
    sgm__lock_take(&p->lock);
    rc = tier_add_chunk_locked(p, &c);
    if (rc == SGM_OK) p->committed_bytes = c.bytes;
    sgm__lock_drop(&p->lock);
    if (rc != SGM_OK) {
      params->ops->chunk_free(p, &c);
      goto out_sa;
    }
  }
  *out = p;
  return SGM_OK;

out_sa:
  sgm__suballoc_destroy(p->sa);
out_free:
  pthread_cond_destroy(&p->grown);
  sgm__lock_destroy(&p->lock);
  free(p);
  return rc;
}

void sgm__tier_destroy(sgm_tier_pool *p) {
  if (!p) return;
  sgm__tier_reclaim(p, NULL, true);
  free(p->pending);
  for (size_t i = 0; i < p->n_chunks; i++) p->p.ops->chunk_free(p, &p->chunks[i]);
  free(p->chunks);
  sgm__suballoc_destroy(p->sa);
  pthread_cond_destroy(&p->grown);
  sgm__lock_destroy(&p->lock);
  free(p);
}

/* Size of the next chunk for a block of need bytes (already aligned); 0 when
 * the budget has no room for it. Sets *dedicated. */
static uint64_t tier_next_chunk_locked(sgm_tier_pool *p, uint64_t need, bool *dedicated) {
  if (p->committed_bytes >= p->p.budget_bytes) return 0;
  uint64_t remaining = p->p.budget_bytes - p->committed_bytes;
  uint64_t initial = p->p.growth_chunk_bytes;
  uint64_t max = p->p.max_chunk_bytes > initial ? p->p.max_chunk_bytes : initial;
  uint64_t geo = p->n_geometric >= 40 ? max : initial << p->n_geometric;
  if (geo > max) geo = max;
  *dedicated = need > geo;
  uint64_t size = *dedicated ? sgm__align_up(need, TIER_DEDICATED_GRANULE) : geo;
  if (size > remaining) size = remaining & ~(uint64_t)(SGM_DEVICE_ALIGN - 1);
  return size >= need ? size : 0;
}

/* Detach wholly free chunks (growth mode) into *out (malloc'd); returns count.
 * With idle_ms != UINT64_MAX only chunks seen free since now_ms - idle_ms go;
 * the others that are free are stamped as seen free now. */
static size_t tier_detach_free_locked(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms,
                                      sgm_chunk **out) {
  *out = NULL;
  if (!p->p.growth) return 0;
  size_t n_free = 0;
  for (size_t i = 0; i < p->n_chunks; i++) {
    sgm_chunk *c = &p->chunks[i];
    if (!sgm__suballoc_range_is_free(p->sa, c->base)) {
      c->free_seen_ms = UINT64_MAX;
      continue;
    }
    if (idle_ms != UINT64_MAX) {
      if (c->free_seen_ms == UINT64_MAX || c->free_seen_ms > now_ms) {
        c->free_seen_ms = now_ms;
        continue;
      }
      if (now_ms - c->free_seen_ms < idle_ms) continue;
    }
    n_free++;
  }
  if (n_free == 0) return 0;
  sgm_chunk *list = malloc(n_free * sizeof *list);
  if (!list) return 0; /* trimming is best effort: keep the chunks */
  size_t k = 0, w = 0;
  for (size_t i = 0; i < p->n_chunks; i++) {
    sgm_chunk c = p->chunks[i];
    bool due = idle_ms == UINT64_MAX ||
               (c.free_seen_ms != UINT64_MAX && now_ms - c.free_seen_ms >= idle_ms);
    if (due && k < n_free && sgm__suballoc_try_remove_range(p->sa, c.base)) {
      list[k++] = c;
      if (!c.dedicated && p->n_geometric > 0) p->n_geometric--;
    } else {
      p->chunks[w++] = c;
    }
  }
  p->n_chunks = w;
  *out = list;
  return k;
}

/* Give detached chunks back to the backend (lock not held); bytes returned. */
static uint64_t tier_release_chunks(sgm_tier_pool *p, sgm_chunk *list, size_t n) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; i++) {
    p->p.ops->chunk_free(p, &list[i]);
    bytes += list[i].bytes;
  }
  free(list);
  if (bytes) {
    sgm__lock_take(&p->lock);
    p->committed_bytes -= bytes;
    sgm__lock_drop(&p->lock);
  }
  return bytes;
}

/* Take a chunk of `bytes` for a block of `need` bytes from the backend (pool
 * lock not held). When the driver refuses it for lack of memory (other
 * processes use the GPU too, or the budget is larger than the card's free
 * memory), the chunk is retried at half the size, rounded up to the 64 KiB
 * granule, down to the smallest chunk the block fits in: only a request the
 * device cannot hold even alone is an out-of-memory (and may then fall back
 * one tier down). out->bytes is the size taken. */
static int tier_take_chunk(sgm_tier_pool *p, uint64_t bytes, uint64_t need, sgm_chunk *out) {
  uint64_t floor = sgm__align_up(need, TIER_DEDICATED_GRANULE);
  if (floor > bytes) floor = bytes;
  for (;;) {
    int rc = p->p.ops->chunk_alloc(p, bytes, out);
    if (rc != SGM_ERR_NOMEM || bytes <= floor) return rc;
    uint64_t half = sgm__align_up(bytes / 2, TIER_DEDICATED_GRANULE);
    char a[32], b[32];
    sgm__log(p->p.verbose, 2, "%s: the device refused a %s chunk (%s); retrying with %s",
             sgm_tier_name(p->p.tier), sgm__fmt_bytes(bytes, a, sizeof a), sgm_last_error(),
             sgm__fmt_bytes(half > floor ? half : floor, b, sizeof b));
    bytes = half > floor ? half : floor;
  }
}

/* The message for a chunk the backend would not give. */
static int tier_backend_nomem_locked(sgm_tier_pool *p, uint64_t size) {
  char a[32], b[32], u[32], c[32];
  __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
  const char *name = sgm_tier_name(p->p.tier);
  return sgm__error_set(SGM_ERR_NOMEM,
                          "%s: cannot allocate %s: the device gave no new chunk (%s); "
                          "budget %s, in use %s in %llu blocks, committed %s",
                          name, sgm__fmt_bytes(size, a, sizeof a), sgm_last_error(),
                          sgm__fmt_bytes(p->p.budget_bytes, b, sizeof b),
                          sgm__fmt_bytes(p->used_bytes, u, sizeof u), (unsigned long long)p->n_live,
                          sgm__fmt_bytes(p->committed_bytes, c, sizeof c));
}

int sgm__tier_explain_budget(sgm_tier_pool *p, uint64_t size) {
  char a[32], b[32], u[32], c[32], l[32];
  sgm__lock_take(&p->lock);
  sgm_suballoc_stats st;
  sgm__suballoc_stats(p->sa, &st);
  const char *name = sgm_tier_name(p->p.tier);
  sgm__error_set(SGM_ERR_NOMEM,
                        "%s budget exhausted: cannot allocate %s; budget %s, in use %s in %llu "
                        "blocks, committed %s, largest free block %s (free memory, or raise %s)",
                        name, sgm__fmt_bytes(size, a, sizeof a),
                        sgm__fmt_bytes(p->p.budget_bytes, b, sizeof b),
                        sgm__fmt_bytes(p->used_bytes, u, sizeof u), (unsigned long long)p->n_live,
                        sgm__fmt_bytes(p->committed_bytes, c, sizeof c),
                        sgm__fmt_bytes(st.largest_free_bytes, l, sizeof l), p->p.limit_hint);
  sgm__lock_drop(&p->lock);
  return SGM_ERR_NOMEM;
}

int sgm__tier_alloc(sgm_tier_pool *p, uint64_t size, sgm_devptr *out) {
  *out = 0;
  if (size == 0) return sgm__error_set(SGM_ERR_INVALID, "allocation of 0 bytes");
  if (size > UINT64_MAX - SGM_DEVICE_ALIGN)
    return sgm__error_set(SGM_ERR_INVALID, "allocation of %llu bytes overflows",
                          (unsigned long long)size);
  uint64_t need = sgm__align_up(size, SGM_DEVICE_ALIGN);
  /* A full budget is answered without the lock: this is the first step of
   * every fallback allocation. A free racing with this read may leave room a
   * moment later; the block then lands one tier down, as it would have a
   * moment earlier. */
  if (need > __atomic_load_n(&p->room_bytes, __ATOMIC_RELAXED)) {
    __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
    return SGM__ERR_BUDGET;
  }
  bool trimmed = false;
  sgm__lock_take(&p->lock);
  for (int round = 0; round < TIER_MAX_GROW_ROUNDS; round++) {
    uint64_t off = 0, got = 0;
    /* Use never passes the budget, also when a lowered budget left more
     * committed than it allows. */
    if (need > p->p.budget_bytes - (p->used_bytes < p->p.budget_bytes ? p->used_bytes : p->p.budget_bytes))
      break;
    if (sgm__suballoc_try_alloc(p->sa, need, &off, &got)) {
      p->used_bytes += got;
      if (p->used_bytes > p->peak_used_bytes) p->peak_used_bytes = p->used_bytes;
      tier_update_room_locked(p);
      p->n_live++;
      p->n_allocs++;
      sgm__lock_drop(&p->lock);
      *out = off;
      return SGM_OK;
    }
    if (!p->p.growth) break;
    bool dedicated = false;
    uint64_t chunk = tier_next_chunk_locked(p, need, &dedicated);
    if (chunk == 0 && p->n_growing > 0) {
      /* The budget is held by chunks other threads are taking right now: one
       * of them may have room for this block. Wait for it, then look again. */
      pthread_cond_wait(&p->grown, &p->lock.mu);
      round--;
      continue;
    }
    if (chunk == 0) {
      if (trimmed) break;
      /* No room in the budget for a new chunk: free chunks may be what holds
       * it (fragmentation across chunks); give them back and try once more. */
      trimmed = true;
      sgm_chunk *list;
      size_t n = tier_detach_free_locked(p, 0, UINT64_MAX, &list);
      if (n == 0) break;
      sgm__lock_drop(&p->lock);
      tier_release_chunks(p, list, n);
      sgm__lock_take(&p->lock);
      continue;
    }
    p->committed_bytes += chunk;
    if (!dedicated) p->n_geometric++;
    p->n_growing++;
    sgm__lock_drop(&p->lock);
    sgm_chunk c = {0};
    int rc = tier_take_chunk(p, chunk, need, &c);
    if (rc == SGM_OK) c.dedicated = dedicated;
    sgm__lock_take(&p->lock);
    p->n_growing--;
    pthread_cond_broadcast(&p->grown);
    if (rc == SGM_OK && c.bytes < chunk) {
      /* Got a smaller chunk: give back the budget reserved for the rest, and
       * do not let the geometric series climb while the device is short. */
      p->committed_bytes -= chunk - c.bytes;
      if (!dedicated && p->n_geometric > 0) p->n_geometric--;
      chunk = c.bytes;
    }
    if (rc == SGM_OK) {
      rc = tier_add_chunk_locked(p, &c);
      if (rc != SGM_OK) {
        p->committed_bytes -= chunk;
        if (!dedicated && p->n_geometric > 0) p->n_geometric--;
        sgm__lock_drop(&p->lock);
        p->p.ops->chunk_free(p, &c);
        return rc;
      }
      continue;
    }
    p->committed_bytes -= chunk;
    if (!dedicated && p->n_geometric > 0) p->n_geometric--;
    /* The message names the budget; the status stays the backend's. */
    if (rc == SGM_ERR_NOMEM) tier_backend_nomem_locked(p, size);
    else __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
    sgm__lock_drop(&p->lock);
    return rc;
  }
  /* The budget is full. The message is composed only if the caller needs it
   * (sgm__tier_explain_budget): on the fallback path it does not, and
   * formatting it would cost more than the fallback allocation itself. */
  __atomic_fetch_add(&p->n_failed, 1, __ATOMIC_RELAXED);
  sgm__lock_drop(&p->lock);
  return SGM__ERR_BUDGET;
}

int sgm__tier_free(sgm_tier_pool *p, sgm_devptr ptr, uint64_t *size_out) {
  *size_out = 0;
  sgm__lock_take(&p->lock);
  uint64_t sz = 0;
  /* Not ours: say so without a message; the caller tries the next tier and
   * composes the message only if no tier owns the pointer. */
  if (sgm__suballoc_block_size(p->sa, ptr) == 0 ||
      (p->n_pending && tier_is_pending_locked(p, ptr))) {
    sgm__lock_drop(&p->lock);
    return SGM_ERR_INVALID;
  }
  int rc = sgm__suballoc_free(p->sa, ptr, &sz);
  if (rc == SGM_OK) {
    sgm_assert_internal(p->used_bytes >= sz && p->n_live > 0);
    p->used_bytes -= sz;
    tier_update_room_locked(p);
    p->n_live--;
    p->n_frees++;
  }
  sgm__lock_drop(&p->lock);
  *size_out = sz;
  return rc;
}

static bool tier_is_pending_locked(const sgm_tier_pool *p, sgm_devptr ptr) {
  for (size_t i = 0; i < p->n_pending; i++)
    if (p->pending[i].ptr == ptr) return true;
  return false;
}

int sgm__tier_free_deferred(sgm_tier_pool *p, sgm_devptr ptr, void *stream, void *event) {
  sgm__lock_take(&p->lock);
  int rc = SGM_OK;
  if (sgm__suballoc_block_size(p->sa, ptr) == 0 || tier_is_pending_locked(p, ptr)) {
    rc = SGM_ERR_INVALID;
  } else {
    if (p->n_pending == p->cap_pending) {
      size_t cap = p->cap_pending ? p->cap_pending * 2 : 16;
      sgm_pending_free *n = realloc(p->pending, cap * sizeof *n);
      if (!n) rc = sgm__error_set(SGM_ERR_NOMEM, "out of host memory for pending frees");
      else {
        p->pending = n;
        p->cap_pending = cap;
      }
    }
    if (rc == SGM_OK) {
      p->pending[p->n_pending] = (sgm_pending_free){ptr, stream, event};
      __atomic_store_n(&p->n_pending, p->n_pending + 1, __ATOMIC_RELAXED);
    }
  }
  sgm__lock_drop(&p->lock);
  return rc;
}

size_t sgm__tier_n_pending(sgm_tier_pool *p) {
  return __atomic_load_n(&p->n_pending, __ATOMIC_RELAXED);
}

size_t sgm__tier_reclaim(sgm_tier_pool *p, void *stream, bool wait) {
  /* Snapshot the list under the lock, ask the driver without it, then free
   * the ready blocks under the lock again. Frees arriving meanwhile are left
   * for the next round. */
  sgm__lock_take(&p->lock);
  size_t n = p->n_pending;
  sgm_pending_free *snap = n ? malloc(n * sizeof *snap) : NULL;
  if (snap) memcpy(snap, p->pending, n * sizeof *snap);
  sgm__lock_drop(&p->lock);
  if (!snap) return 0;
  size_t n_ready = 0;
  for (size_t i = 0; i < n; i++) {
    bool ready = stream != NULL && snap[i].stream == stream;
    /* When waiting (the context is going away), a failed wait counts as done:
     * the driver has nothing more to say about that work. */
    if (!ready) ready = wait ? (p->p.bops->event_wait(p->p.be, snap[i].event), true)
                             : p->p.bops->event_query(p->p.be, snap[i].event) == 1;
    if (ready) snap[n_ready++] = snap[i];
  }
  sgm__lock_take(&p->lock);
  for (size_t i = 0; i < n_ready; i++) {
    for (size_t k = 0; k < p->n_pending; k++) {
      if (p->pending[k].ptr != snap[i].ptr) continue;
      p->pending[k] = p->pending[p->n_pending - 1];
      __atomic_store_n(&p->n_pending, p->n_pending - 1, __ATOMIC_RELAXED);
      uint64_t sz = 0;
      if (sgm__suballoc_free(p->sa, snap[i].ptr, &sz) == SGM_OK) {
        p->used_bytes -= sz;
        p->n_live--;
        p->n_frees++;
        tier_update_room_locked(p);
      }
      break;
    }
  }
  sgm__lock_drop(&p->lock);
  for (size_t i = 0; i < n_ready; i++) p->p.bops->event_destroy(p->p.be, snap[i].event);
  free(snap);
  return n_ready;
}

bool sgm__tier_owns(sgm_tier_pool *p, sgm_devptr ptr) {
  sgm__lock_take(&p->lock);
  bool owns = sgm__suballoc_block_size(p->sa, ptr) != 0 && !tier_is_pending_locked(p, ptr);
  sgm__lock_drop(&p->lock);
  return owns;
}

uint64_t sgm__tier_trim(sgm_tier_pool *p) {
  sgm__tier_reclaim(p, NULL, false);
  sgm_chunk *list;
  sgm__lock_take(&p->lock);
  size_t n = tier_detach_free_locked(p, 0, UINT64_MAX, &list);
  sgm__lock_drop(&p->lock);
  return n ? tier_release_chunks(p, list, n) : 0;
}

uint64_t sgm__tier_idle_trim(sgm_tier_pool *p, uint64_t now_ms, uint64_t idle_ms) {
  if (idle_ms == 0 || idle_ms == UINT64_MAX) return 0;
  sgm_chunk *list;
  sgm__lock_take(&p->lock);
  size_t n = tier_detach_free_locked(p, now_ms, idle_ms, &list);
  sgm__lock_drop(&p->lock);
  return n ? tier_release_chunks(p, list, n) : 0;
}

void sgm__tier_set_budget(sgm_tier_pool *p, uint64_t budget_bytes) {
  sgm__lock_take(&p->lock);
  p->p.budget_bytes = budget_bytes;
  tier_update_room_locked(p);
  bool over = p->committed_bytes > budget_bytes;
  if (over) p->budget_lowered = true;
  sgm__lock_drop(&p->lock);
  if (over) sgm__tier_trim(p);
}

void sgm__tier_stats(sgm_tier_pool *p, sgm_tier_stats *out) {
  memset(out, 0, sizeof *out);
  sgm__lock_take(&p->lock);
  out->budget_bytes = p->p.budget_bytes;
  out->committed_bytes = p->committed_bytes;
  out->used_bytes = p->used_bytes;
  out->peak_used_bytes = p->peak_used_bytes;
  out->n_live = p->n_live;
  out->n_chunks = p->n_chunks;
  out->n_allocs = p->n_allocs;
  out->n_frees = p->n_frees;
  out->n_failed = __atomic_load_n(&p->n_failed, __ATOMIC_RELAXED);
  sgm__lock_drop(&p->lock);
}

bool sgm__tier_check(sgm_tier_pool *p) {
  bool ok = true;
  sgm__lock_take(&p->lock);
  uint64_t sum = 0;
  for (size_t i = 0; i < p->n_chunks; i++) sum += p->chunks[i].bytes;
  sgm_suballoc_stats st;
  sgm__suballoc_stats(p->sa, &st);
  if (!sgm__suballoc_check(p->sa)) {
    ok = false;
  } else if (p->committed_bytes > p->p.budget_bytes && !p->budget_lowered) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: committed %llu > budget %llu",
                         sgm_tier_name(p->p.tier), (unsigned long long)p->committed_bytes,
                         (unsigned long long)p->p.budget_bytes);
  } else if (sum > p->committed_bytes || st.capacity_bytes != sum || st.n_ranges != p->n_chunks) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: chunks hold %llu bytes in %zu, sub-allocator %llu "
                         "in %llu, committed %llu", sgm_tier_name(p->p.tier),
                         (unsigned long long)sum, p->n_chunks,
                         (unsigned long long)st.capacity_bytes, (unsigned long long)st.n_ranges,
                         (unsigned long long)p->committed_bytes);
  } else if (st.used_bytes != p->used_bytes || st.n_live != p->n_live) {
    ok = !sgm__error_set(SGM_ERR_CORRUPT, "%s: used %llu/%llu blocks, sub-allocator %llu/%llu",
                         sgm_tier_name(p->p.tier), (unsigned long long)p->used_bytes,
                         (unsigned long long)p->n_live, (unsigned long long)st.used_bytes,
                         (unsigned long long)st.n_live);
  }
  sgm__lock_drop(&p->lock);
  return ok;
}
