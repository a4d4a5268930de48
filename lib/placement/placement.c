/*
 * placement.c — the placement state of a context: its buffers, the two
 * resident tiers' policies, the spill tier, the migration counters; create,
 * destroy, statistics and the invariant walk. The rules live in residency.c
 * (the policy host in residency_host.c), the moves in migrate*.c, the public
 * buffer calls in buffer.c, the buffer states in buffer_state.c, the prefetch
 * worker in prefetch.c; placement.h lists the files, what they share and how
 * they lock.
 *
 * Invariant (checked by placement_check_locked): a buffer is listed in its
 * tier's policy exactly when it is RELEASED and resident, never both listed
 * and pinned, listed at the priority the user set; each policy's reclaimable
 * bytes equal the sizes of the buffers listed there.
 * Threading: create and destroy run with no other call on the context; the
 * locks are placement.h's and residency.c's (the order).
 */
#include <stdio.h>
#include <stdlib.h>

#include "placement.h"
#include "tiers/tier.h"

/* Take every lock the walk needs, in rank order, or drop them. */
static void placement_lock_all(struct sgm_placement *pl, bool take) {
  if (take) {
    sgm__lock_take(&pl->lock);
    for (int t = 0; t < SGM_N_RESIDENT; t++) sgm__lock_take(&pl->res[t]);
  } else {
    for (int t = SGM_N_RESIDENT - 1; t >= 0; t--) sgm__lock_drop(&pl->res[t]);
    sgm__lock_drop(&pl->lock);
  }
}

/* Walk the policies and every buffer (placement_lock_all held): SGM_OK or
 * SGM_ERR_CORRUPT with the first broken invariant in why. O(n). A buffer
 * listed nowhere may be taken meanwhile without a residency lock (one on
 * disk, one acquired): its state word read twice around its tier says
 * whether the pair belongs together (the generation); if not, it is skipped. */
static int placement_check_locked(struct sgm_placement *pl, char *why, size_t len) {
  uint64_t n[SGM_N_RESIDENT] = {0}, bytes[SGM_N_RESIDENT] = {0};
  for (sgm_buffer *b = pl->all; b; b = b->all_next) {
    uint32_t w = __atomic_load_n(&b->state, __ATOMIC_SEQ_CST);
    sgm_buf_state st = (sgm_buf_state)(w & SGM_BUF_STATE_MASK);
    sgm_tier tier = __atomic_load_n(&b->tier, __ATOMIC_RELAXED);
    if (st != SGM_BUF_BUSY && __atomic_load_n(&b->state, __ATOMIC_SEQ_CST) != w) continue;
    if (st == SGM_BUF_BUSY) { /* its mover owns tier and data: only the flags are ours */
      if (b->listed) {
        snprintf(why, len, "buffer %llu is BUSY and listed", (unsigned long long)b->item.id);
        return SGM_ERR_CORRUPT;
      }
      continue;
    }
    bool want = st == SGM_BUF_RELEASED && tier < SGM_N_RESIDENT;
    if (b->listed != want) {
      snprintf(why, len, "buffer %llu (state %d, tier %d) is %slisted",
               (unsigned long long)b->item.id, (int)st, (int)tier, b->listed ? "" : "not ");
      return SGM_ERR_CORRUPT;
    }
    if (b->listed && b->pinned) {
      snprintf(why, len, "buffer %llu is both listed and pinned", (unsigned long long)b->item.id);
      return SGM_ERR_CORRUPT;
    }
    int priority = __atomic_load_n(&b->priority, __ATOMIC_RELAXED);
    if (b->listed && b->item.priority != priority) {
      snprintf(why, len, "buffer %llu is listed at priority %d, set to %d",
               (unsigned long long)b->item.id, b->item.priority, priority);
      return SGM_ERR_CORRUPT;
    }
    if (b->listed) {
      n[tier]++;
      bytes[tier] += b->size;
    }
  }
  for (int t = 0; t < SGM_N_RESIDENT; t++) {
    int rc = sgm__prio_check(pl->pol[t], why, len);
    if (rc != SGM_OK) return rc;
    uint64_t r = sgm__prio_reclaimable(pl->pol[t]);
    if (r != bytes[t] || n[t] != pl->n_listed[t]) {
      snprintf(why, len, "%s: the policy holds %llu reclaimable bytes, the %llu listed buffers "
               "%llu (counter: %llu listed)", sgm_tier_name((sgm_tier)t), (unsigned long long)r,
               (unsigned long long)n[t], (unsigned long long)bytes[t],
               (unsigned long long)pl->n_listed[t]);
      return SGM_ERR_CORRUPT;
    }
  }
  return SGM_OK;
}

bool sgm__placement_valid(struct sgm_placement *pl) {
  char why[256];
  placement_lock_all(pl, true);
  int rc = placement_check_locked(pl, why, sizeof why);
  placement_lock_all(pl, false);
  if (rc == SGM_OK) return true;
  fprintf(stderr, "sgm: placement check: %s\n", why);
  return false;
}

/* ---- lifecycle ---- */

static uint64_t placement_monotonic_ns(void *user) {
  (void)user;
  return sgm__clock_monotonic_ns();
}

/* The policies' clock, read under pl->res[t] (the policy contract). */
static uint64_t placement_clock(void *user) {
  struct sgm_placement *pl = user;
  return pl->clock_ns(pl->clock_user);
}

/* The policy name tier t runs: its own setting, else SGM_POLICY. */
static const char *placement_policy_setting(const sgm_config *cfg, sgm_tier t, const char **var) {
  const char *own = t == SGM_TIER_VRAM ? cfg->policy_vram : cfg->policy_shared;
  if (own[0]) {
    *var = t == SGM_TIER_VRAM ? "SGM_POLICY_VRAM" : "SGM_POLICY_SHARED";
    return own;
  }
  *var = "SGM_POLICY";
  return cfg->policy;
}

static void placement_free(struct sgm_placement *pl) {
  for (size_t i = 0; i < sizeof pl->graveyard / sizeof pl->graveyard[0]; i++) free(pl->graveyard[i]);
  for (int t = 0; t < SGM_N_RESIDENT; t++) sgm__prio_destroy(pl->pol[t]);
  if (pl->disk) sgm__disk_close(pl->disk);
  pthread_cond_destroy(&pl->work_cond);
  pthread_cond_destroy(&pl->mq_cond);
  sgm__lock_destroy(&pl->pf_lock);
  for (int t = 0; t < SGM_N_RESIDENT; t++) sgm__lock_destroy(&pl->res[t]);
  sgm__lock_destroy(&pl->mlock);
  sgm__lock_destroy(&pl->lock);
  free(pl);
}

int sgm__placement_create(sgm_context *ctx) {
  struct sgm_placement *pl = calloc(1, sizeof *pl);
  if (!pl) return sgm__error_set(SGM_ERR_NOMEM, "out of host memory creating the buffer lists");
  sgm__lock_init(&pl->lock, SGM_LOCK_BUFFERS);
  sgm__lock_init(&pl->mlock, SGM_LOCK_MANAGED);
  sgm__lock_init(&pl->res[SGM_TIER_VRAM], SGM_LOCK_RES_VRAM);
  sgm__lock_init(&pl->res[SGM_TIER_SHARED], SGM_LOCK_RES_SHARED);
  sgm__lock_init(&pl->pf_lock, SGM_LOCK_PREFETCH);
  sgm__clock_cond_init(&pl->work_cond); /* monotonic: the managed queue's retry waits on it */
  pthread_cond_init(&pl->mq_cond, NULL);
  pl->clock_ns = placement_monotonic_ns;
  pl->ask = (sgm_placement_asks){
      .prefetch_cancel = sgm__prefetch_cancel,
      .prefetch_wake = sgm__prefetch_wake,
      .managed_promote = sgm__managed_promote,
      .managed_flush = sgm__managed_flush,
      .managed_cache_drop = sgm__managed_cache_drop,
      .residency_alloc_for = sgm__residency_alloc_for,
      .residency_charge_for = sgm__residency_charge_for,
      .valid = sgm__placement_valid,
      .managed_move = sgm__migrate_managed_on,
  };
  pl->disk_seen_ms = UINT64_MAX;
  int rc = SGM_OK;
  size_t state_bytes = 0;
  for (int t = 0; t < SGM_N_RESIDENT && rc == SGM_OK; t++) {
    const char *var;
    const char *name = placement_policy_setting(sgm__parts_cfg(ctx), (sgm_tier)t, &var);
    const sgm_policy_ops *ops = sgm_policy_find(name);
    if (!ops) {
      rc = sgm__error_set(SGM_ERR_INVALID, "%s names policy \"%s\", which is not registered",
                          var, name);
      break;
    }
    sgm_policy_params params = {
        .abi_version = SGM_POLICY_ABI_VERSION,
        .tier = (sgm_tier)t,
        .capacity_bytes = sgm__parts_budget(ctx, t),
        .clock_ns = placement_clock,
        .clock_user = pl,
    };
    rc = sgm__prio_create(ops, &params, &pl->pol[t]);
    if (rc != SGM_OK)
      rc = sgm__error_set(rc, "cannot create the %s policy \"%s\" for the %s tier (%s)", var, ops->name,
                          sgm_tier_name((sgm_tier)t), sgm_status_string((sgm_status)rc));
    if (ops->state_bytes > state_bytes) state_bytes = ops->state_bytes;
    pl->record[t] = ops->record != NULL;
    pl->any_record = pl->any_record || pl->record[t];
  }
  pl->state_offset = sgm__align_up(sizeof(sgm_buffer), 16);
  pl->state_bytes = sgm__align_up(state_bytes, 16);
  if (rc == SGM_OK && sgm__parts_cfg(ctx)->spill_dir[0])
    rc = sgm__disk_open(sgm__parts_cfg(ctx)->spill_dir, sgm__parts_cfg(ctx)->spill_limit, sgm__parts_cfg(ctx)->verbose, &pl->disk);
  if (rc != SGM_OK) {
    placement_free(pl);
    return rc;
  }
  sgm__parts_w(ctx)->pl = pl;
  return SGM_OK;
}

void sgm__placement_set_clock(sgm_context *ctx, uint64_t (*clock_ns)(void *user), void *user) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  placement_lock_all(pl, true); /* the policies read it under their tier's lock */
  pl->clock_ns = clock_ns ? clock_ns : placement_monotonic_ns;
  pl->clock_user = clock_ns ? user : NULL;
  placement_lock_all(pl, false);
}

int sgm__placement_check(sgm_context *ctx, char *why, size_t why_len) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  placement_lock_all(pl, true);
  int rc = placement_check_locked(pl, why, why_len);
  placement_lock_all(pl, false);
  return rc;
}

const char *sgm__placement_policy_name(sgm_context *ctx, sgm_tier t) {
  if (t < 0 || t >= SGM_N_RESIDENT) return NULL;
  return sgm__prio_inner(sgm__parts_pl(ctx)->pol[t])->name;
}

void sgm__placement_destroy(sgm_context *ctx) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (!pl) return;
  sgm__prefetch_stop(pl);
  sgm__managed_queue_cancel_all(ctx); /* the worker is gone: its queue's charges and events go back */
  sgm__managed_cache_drop(ctx, SGM_TIER_COUNT, UINT64_MAX);
  /* The policies are destroyed after the buffers without being told about
   * them: the contract says destroy must not touch items. */
  while (pl->all) {
    sgm_buffer *b = pl->all;
    pl->all = b->all_next;
    sgm__buffer_free_storage(ctx, b);
    free(b);
  }
  void *bounce = __atomic_load_n(&pl->disk_bounce, __ATOMIC_ACQUIRE);
  placement_free(pl); /* closes the disk tier, which only borrowed the bounce */
  if (bounce) sgm__parts_bops(ctx)->host_free(sgm__parts_be(ctx), bounce, SGM_DISK_STAGE_BYTES);
  sgm__parts_w(ctx)->pl = NULL;
}

void sgm__placement_stats(sgm_context *ctx, sgm_stats *st) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (pl->disk) sgm__disk_stats(pl->disk, &st->tier[SGM_TIER_DISK]);
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    st->tier[t].bytes_in = __atomic_load_n(&pl->bytes_in[t], __ATOMIC_RELAXED);
    st->tier[t].bytes_out = __atomic_load_n(&pl->bytes_out[t], __ATOMIC_RELAXED);
    st->tier[t].n_evictions = __atomic_load_n(&pl->n_evictions[t], __ATOMIC_RELAXED);
  }
  /* Buffers on disk without an extent yet hold no file space but are live. */
  st->tier[SGM_TIER_DISK].n_live = __atomic_load_n(&pl->n_disk_live, __ATOMIC_RELAXED);
}

struct sgm_disk *sgm__placement_disk(sgm_context *ctx) { return sgm__parts_pl(ctx)->disk; }

uint64_t sgm__placement_trim(sgm_context *ctx) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (!pl->disk) return 0;
  uint64_t kept = sgm__disk_trim(pl->disk); /* the blocks freed extents kept */
  if (!__atomic_load_n(&pl->disk_bounce, __ATOMIC_ACQUIRE)) return kept;
  void *p = sgm__disk_take_back_bounce(pl->disk);
  if (!p) return kept; /* a transfer holds it, or it is not lent yet */
  __atomic_store_n(&pl->disk_bounce, NULL, __ATOMIC_RELEASE);
  sgm__parts_bops(ctx)->host_free(sgm__parts_be(ctx), p, SGM_DISK_STAGE_BYTES);
  /* The next disk<->VRAM transfer pins one again. */
  __atomic_store_n(&pl->disk_bounce_tried, false, __ATOMIC_RELEASE);
  return kept + SGM_DISK_STAGE_BYTES;
}

/* DESIGN.md §3 rule 7 for the disk tier: the blocks freed extents kept and
 * the pinned staging go back once the tier has done nothing for idle_ms (seen
 * by two ticks at least idle_ms apart with the same activity count). */
uint64_t sgm__placement_idle_trim(sgm_context *ctx, uint64_t now_ms, uint64_t idle_ms) {
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  if (!pl->disk) return 0;
  /* Atomics: a test may tick beside the idle thread (at worst one trim more). */
  uint64_t ops = sgm__disk_activity(pl->disk);
  uint64_t seen_ms = __atomic_load_n(&pl->disk_seen_ms, __ATOMIC_RELAXED);
  if (seen_ms == UINT64_MAX || ops != __atomic_load_n(&pl->disk_seen_ops, __ATOMIC_RELAXED)) {
    __atomic_store_n(&pl->disk_seen_ops, ops, __ATOMIC_RELAXED);
    __atomic_store_n(&pl->disk_seen_ms, now_ms, __ATOMIC_RELAXED);
    return 0;
  }
  if (now_ms - seen_ms < idle_ms) return 0;
  __atomic_store_n(&pl->disk_seen_ms, UINT64_MAX, __ATOMIC_RELAXED);
  return sgm__placement_trim(ctx);
}

bool sgm__placement_owns_block(sgm_context *ctx, sgm_devptr d) {
  /* Programs without buffers pay one relaxed load per free. */
  if (__atomic_load_n(&sgm__parts_pl(ctx)->n_buffers, __ATOMIC_RELAXED) == 0) return false;
  for (int t = 0; t < SGM_N_RESIDENT; t++)
    if (sgm__parts_tier(ctx, t) && sgm__tier_owns_own(sgm__parts_tier(ctx, t), d)) return true;
  return false;
}
