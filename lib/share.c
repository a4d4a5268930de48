/*
 * share.c — fair budgets: a context's life in the node registry (node.c).
 *
 * A context whose device has a key (every GPU; an emulated device named by
 * SGM_EMU_DEVICE) joins the device's registry at create and leaves it at
 * destroy. A ticker thread, every SGM_NODE_PERIOD_MS (and at once when an
 * allocation falls back, at most once per quarter period), publishes this
 * process's figures, reclaims the slots of dead processes and, in fair mode,
 * recomputes its budgets from everyone's published claims:
 *
 *   budget = reservation + a weighted share of what the reservations leave,
 *            water-filled: a process that demands less than its share gets
 *            its demand, and what it leaves is lent to the others (by
 *            weight), up to each one's own cap.
 *
 * Every process computes the same split from the same claims and applies its
 * own part, so no process ever writes another's budget. The contexts of one
 * process on one device are members of one slot (node.c), which publishes
 * the sum of their claims: the split counts the process once, and its part
 * is then split between its contexts by the same rule. Demand is what a
 * process holds resident (VRAM + shared) plus headroom (an eighth, at least
 * one growth chunk), held at its recent peak for SGM_IDLE_TRIM_MS so that a
 * process between two steps does not lend its share away; a process that
 * just joined claims its whole cap for that long. A process whose budget
 * drops below its use stops growing, returns free chunks and demotes
 * released buffers (WDDM's TrimToBudget); its allocations, which cannot
 * move, stay, and new ones fall back to shared memory. The shared tier's cap
 * (the node's max(RAM / 2, 64 MiB)) is split the same way. With one process
 * the split is the whole device: today's budgets. Solo processes publish but
 * keep their own budgets; fair ones count what a solo one holds as reserved.
 *
 * Threading: the ticker is the only thread that ticks once the context is
 * built (create runs the first tick itself, before anyone else sees ctx).
 * share->mu (a leaf) guards the ticker's stop and tick counters.
 *
 * Layer (lib/LAYERS): context-services, below context.c, which calls join,
 * start, poke, stop and leave. Calls down: the context's accessors
 * (context_state.c), sgm_get_stats (stats.c, same floor), the node registry,
 * the tiers' budgets, placement's trim to budget and the managed cache, the
 * backend.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "internal.h"
#include "tiers/tier.h"

struct sgm_share {
  sgm_node_member *member;     /* this context in the device's registry */
  sgm_node *node;              /* its process's slot there (shared with the process's other contexts) */
  sgm_node_view *view;         /* the ticker's snapshot (large: kept, not on the stack) */
  uint64_t pool_bytes;         /* VRAM to share: the node's device total x SGM_VRAM_FRACTION */
  uint64_t reserve_bytes;      /* SGM_VRAM_RESERVE, resolved */
  uint64_t hold_bytes;         /* demand held at its recent peak (see the opening comment) */
  uint64_t hold_since_ms;      /* when hold_bytes was last raised */
  uint64_t device_used_bytes;  /* the device's used memory, last asked of the driver (ticker only) */
  uint64_t device_used_ms;     /* when (0: never) */
  sgm_lock mu;                 /* guards the fields below (rank SGM_LOCK_SHARE) */
  pthread_cond_t cond;         /* wakes the ticker (stop, poke) and tick waiters */
  pthread_t thread;            /* the ticker */
  bool running;                /* the ticker was started */
  bool stop;                   /* asks the ticker to end */
  uint64_t n_requested;        /* ticks asked for by sgm__share_tick_sync and pokes */
  uint64_t n_completed;        /* the request count the last finished tick served */
  uint64_t poke_at;            /* the context's clock at the last poke that asked for a tick,
                                  plus 1 (0: none yet; atomic, read without mu) */
  uint64_t n_pokes;            /* pokes that asked for a tick (atomic; tests) */
};

/* Pokes ask for a tick at most once per SHARE_POKE_DIVISOR-th of the node
 * period (at least 1 ms; 12 ms at the default 50). Every fallback poked:
 * a program falling back in a loop made the ticker tick back to back (a
 * 64-block ring of 256 B-256 KiB over the driver double with 8 MiB of VRAM:
 * 14,785 ticks in 1.2 s where the period asks for 24, and its pairs ran at
 * 748-758 ns against 426-505 with SGM_NODE=off), one core publishing and
 * splitting for nothing while the split cannot change faster than the
 * others publish. */
#define SHARE_POKE_DIVISOR 4

/* ------------------------------------------------------------------------ */
/* The split (pure: tests call it directly). */

static uint64_t share_min(uint64_t a, uint64_t b) { return a < b ? a : b; }

void sgm__share_fair(uint64_t total, const sgm_share_claim *c, size_t n, uint64_t *out) {
  long double sum_base = 0;
  for (size_t j = 0; j < n; j++) {
    out[j] = share_min(c[j].reserve_bytes, c[j].cap_bytes);
    sum_base += (long double)out[j];
  }
  if (sum_base > (long double)total) {
    /* Reservations past the device: each gets its proportion of it. */
    for (size_t j = 0; j < n; j++)
      out[j] = (uint64_t)((long double)out[j] * (long double)total / sum_base);
    goto out_align;
  }
  long double rem = (long double)total - sum_base;
  /* Water-fill the wants (demand beyond the reservation, up to the cap). */
  bool progress = true;
  while (progress && rem > 0) {
    progress = false;
    long double w = 0;
    for (size_t j = 0; j < n; j++) {
      uint64_t want = share_min(c[j].demand_bytes, c[j].cap_bytes);
      if (want > out[j]) w += c[j].weight;
    }
    if (w == 0) break;
    long double unit = rem / w;
    for (size_t j = 0; j < n; j++) {
      uint64_t want = share_min(c[j].demand_bytes, c[j].cap_bytes);
      if (want > out[j] && (long double)(want - out[j]) <= unit * c[j].weight) {
        rem -= (long double)(want - out[j]);
        out[j] = want;
        progress = true;
      }
    }
    if (!progress) {
      /* Nobody is satisfied by an equal share: each takes its share. */
      for (size_t j = 0; j < n; j++) {
        uint64_t want = share_min(c[j].demand_bytes, c[j].cap_bytes);
        if (want > out[j]) out[j] += (uint64_t)(unit * c[j].weight);
      }
      rem = 0;
    }
  }
  /* Lend what nobody wants now, by weight, up to each cap (a few rounds:
   * caps reached in one round free their part for the next). */
  for (size_t round = 0; round < n && rem >= 1; round++) {
    long double w = 0;
    for (size_t j = 0; j < n; j++)
      if (out[j] < c[j].cap_bytes) w += c[j].weight;
    if (w == 0) break;
    long double unit = rem / w;
    for (size_t j = 0; j < n; j++) {
      if (out[j] >= c[j].cap_bytes) continue;
      uint64_t g = (uint64_t)share_min((uint64_t)(unit * c[j].weight), c[j].cap_bytes - out[j]);
      out[j] += g;
      rem -= (long double)g;
    }
  }
out_align:
  for (size_t j = 0; j < n; j++) {
    out[j] &= ~(uint64_t)(SGM_DEVICE_ALIGN - 1);
    if (out[j] < SGM_DEVICE_ALIGN) out[j] = SGM_DEVICE_ALIGN; /* a budget holds one block */
  }
}

/* ------------------------------------------------------------------------ */
/* Claims from the published figures. */

static uint64_t share_sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }


/* This context's figures now (budgets: the ones in force). */
static void share_usage(sgm_context *ctx, sgm_node_usage *u) {
  sgm_share *sh = sgm__context_share(ctx);
  memset(u, 0, sizeof *u);
  sgm_stats st;
  sgm_get_stats(ctx, &st);
  for (int t = 0; t < SGM_TIER_COUNT; t++) {
    u->w[SGM_NODE_F_USED + t] = st.tier[t].used_bytes;
    u->w[SGM_NODE_F_COMMITTED + t] = st.tier[t].committed_bytes;
    u->w[SGM_NODE_F_BUDGET + t] = st.tier[t].budget_bytes;
    u->w[SGM_NODE_F_PEAK + t] = st.tier[t].peak_used_bytes;
    u->w[SGM_NODE_F_EVICTIONS] += st.tier[t].n_evictions;
    u->w[SGM_NODE_F_MOVED] += st.tier[t].bytes_in;
  }
  /* An interposed program's own driver allocations are VRAM it uses and holds. */
  uint64_t ext = 0, ext_peak = 0;
  bool interposed = sgm__context_interposed(ctx, &ext, &ext_peak);
  u->w[SGM_NODE_F_USED + SGM_TIER_VRAM] = share_sat_add(u->w[SGM_NODE_F_USED + SGM_TIER_VRAM], ext);
  u->w[SGM_NODE_F_COMMITTED + SGM_TIER_VRAM] = share_sat_add(u->w[SGM_NODE_F_COMMITTED + SGM_TIER_VRAM], ext);
  /* Peak: sgm's own peak plus the interposer's (an upper bound of their sum's peak). */
  u->w[SGM_NODE_F_PEAK + SGM_TIER_VRAM] = share_sat_add(u->w[SGM_NODE_F_PEAK + SGM_TIER_VRAM], ext_peak);
  uint64_t vcap = 0, scap = 0;
  sgm__context_budgets(ctx, &vcap, &scap);
  uint64_t vused = u->w[SGM_NODE_F_USED + SGM_TIER_VRAM], sused = st.tier[SGM_TIER_SHARED].used_bytes;
  uint64_t resident = share_sat_add(vused, sused);
  uint64_t head = resident / 8 > sgm__context_cfg(ctx)->growth_chunk_bytes ? resident / 8 : sgm__context_cfg(ctx)->growth_chunk_bytes;
  uint64_t demand = share_sat_add(resident, head);
  uint64_t now = sgm__context_now_ms(ctx);
  if (sgm__context_cfg(ctx)->idle_trim_ms == 0) {
    sh->hold_bytes = demand;
  } else if (demand >= sh->hold_bytes || now - sh->hold_since_ms >= sgm__context_cfg(ctx)->idle_trim_ms) {
    sh->hold_bytes = demand;
    sh->hold_since_ms = now;
  } else {
    demand = sh->hold_bytes; /* between two steps: keep the share */
  }
  uint64_t shead = sused / 8 > sgm__context_cfg(ctx)->shared_chunk_bytes ? sused / 8 : sgm__context_cfg(ctx)->shared_chunk_bytes;
  u->w[SGM_NODE_F_RESERVE] = sh->reserve_bytes;
  u->w[SGM_NODE_F_CAP] = vcap;
  u->w[SGM_NODE_F_DEMAND] = share_min(demand, vcap);
  u->w[SGM_NODE_F_SHARED_CAP] = scap;
  u->w[SGM_NODE_F_SHARED_DEMAND] = share_min(share_sat_add(sused, shead), scap);
  u->w[SGM_NODE_F_WEIGHT] = (uint64_t)sgm__context_cfg(ctx)->share_weight;
  u->w[SGM_NODE_F_FALLBACKS] = st.n_fallbacks;
  u->w[SGM_NODE_F_HEARTBEAT] = sgm__clock_monotonic_ns();
  u->w[SGM_NODE_F_FLAGS] = (sgm__context_cfg(ctx)->share_mode == SGM_SHARE_SOLO ? SGM_NODE_FLAG_SOLO : 0) |
                           (interposed ? SGM_NODE_FLAG_INTERPOSED : 0);
  /* The device's used memory, everyone's (sgm-smi shows what is not sgm's):
   * asked of the driver once a second, not every tick. */
  if (!sh->device_used_ms || now - sh->device_used_ms >= 1000) {
    uint64_t fr = 0, tot = 0;
    if (sgm__context_bops(ctx)->mem_info(sgm__context_be(ctx), &fr, &tot) == SGM_OK && fr <= tot)
      sh->device_used_bytes = tot - fr;
    else
      sgm__error_clear();
    sh->device_used_ms = now ? now : 1;
  }
  u->w[SGM_NODE_F_DEVICE_USED] = sh->device_used_bytes;
}

/* A published slot as a claim on tier t (VRAM or shared); values from other
 * processes are untrusted and only ever bound what they get, never ours. */
/* Another process's VRAM claim, bounded by what the admin policy gives its
 * owner (records are untrusted: a user who writes a huge reservation into
 * their own record gets no more than the admin granted them). */
static void share_admin_clamp(uint32_t uid, uint64_t total, sgm_share_claim *c) {
  const sgm_admin_policy *pol = sgm__admin_current();
  uint64_t res = sgm__admin_vram_reserve(pol, uid, total), cap = sgm__admin_vram_cap(pol, uid, false, total);
  if (c->reserve_bytes > res) c->reserve_bytes = res;
  if (c->cap_bytes > cap) c->cap_bytes = cap;
  if (c->reserve_bytes > c->cap_bytes) c->reserve_bytes = c->cap_bytes;
}

static void share_claim_of(const sgm_node_usage *u, sgm_tier t, sgm_share_claim *c) {
  bool solo = (u->w[SGM_NODE_F_FLAGS] & SGM_NODE_FLAG_SOLO) != 0;
  uint64_t w = u->w[SGM_NODE_F_WEIGHT];
  c->weight = (uint32_t)(w < 1 ? 1 : w > 1000 ? 1000 : w);
  if (t == SGM_TIER_VRAM) {
    c->cap_bytes = u->w[SGM_NODE_F_CAP] ? u->w[SGM_NODE_F_CAP] : UINT64_MAX;
    c->reserve_bytes = u->w[SGM_NODE_F_RESERVE];
    c->demand_bytes = u->w[SGM_NODE_F_DEMAND];
  } else {
    c->cap_bytes = u->w[SGM_NODE_F_SHARED_CAP] ? u->w[SGM_NODE_F_SHARED_CAP] : UINT64_MAX;
    c->reserve_bytes = 0;
    c->demand_bytes = u->w[SGM_NODE_F_SHARED_DEMAND];
  }
  if (solo) {
    /* A solo process yields nothing: what it holds is as good as reserved. */
    uint64_t held = u->w[SGM_NODE_F_COMMITTED + t];
    c->reserve_bytes = c->demand_bytes = c->cap_bytes = held;
  }
}

/* Our fair budgets for VRAM and shared memory from view, in two steps: the
 * process (its slot: the sum of its contexts' claims, ours replaced by mine)
 * against the other processes, then the process's part among its contexts
 * by the same rule. false when out of host memory. */
static bool share_compute(sgm_context *ctx, const sgm_node_view *v, const sgm_node_usage *mine,
                          uint64_t *vram_out, uint64_t *shared_out) {
  sgm_share *sh = sgm__context_share(ctx);
  size_t self_m = 0, k = 0, cap_m = 4;
  sgm_node_usage *mem = NULL;
  for (;;) { /* members may join between two counts: retry with room */
    free(mem);
    mem = malloc(cap_m * sizeof *mem);
    if (!mem) return false;
    k = sgm__node_member_usages(sh->member, mine, mem, cap_m, &self_m);
    if (k <= cap_m) break;
    cap_m = k * 2;
  }
  sgm_node_usage proc;
  sgm__node_usage_sum(mem, k, &proc);
  size_t m = (v->n_procs + 1 > k ? v->n_procs + 1 : k);
  sgm_share_claim *c = malloc(m * sizeof *c);
  uint64_t *out = malloc(m * sizeof *out);
  bool ok = c && out;
  if (ok) {
    uint64_t totals[2] = {sh->pool_bytes, sgm__node_shared_cap(sh->node)};
    uint64_t *results[2] = {vram_out, shared_out};
    for (int t = 0; t < 2; t++) {
      size_t n = 0;
      for (size_t i = 0; i < v->n_procs; i++)
        if (!v->procs[i].self) {
          share_claim_of(&v->procs[i].u, (sgm_tier)t, &c[n]);
          if (t == SGM_TIER_VRAM) share_admin_clamp(v->procs[i].uid, sh->pool_bytes, &c[n]);
          n++;
        }
      share_claim_of(&proc, (sgm_tier)t, &c[n]);
      sgm__share_fair(totals[t], c, n + 1, out);
      uint64_t process_part = out[n];
      for (size_t i = 0; i < k; i++) share_claim_of(&mem[i], (sgm_tier)t, &c[i]);
      sgm__share_fair(process_part, c, k, out);
      *results[t] = share_min(out[self_m], t == 0 ? mine->w[SGM_NODE_F_CAP] : mine->w[SGM_NODE_F_SHARED_CAP]);
    }
  }
  free(mem);
  free(c);
  free(out);
  return ok;
}

/* Set tier t's budget; over it, demote released buffers and return chunks.
 * others: the other processes counted in the split (for the message that
 * says why an allocation fell back: the budget is a fair share, not the
 * options, when it is below what the process would have alone). */
static void share_apply(sgm_context *ctx, sgm_tier t, uint64_t budget, size_t others) {
  sgm_tier_stats ts;
  sgm__tier_stats(sgm__context_tier(ctx, t), &ts);
  uint64_t cap[2];
  sgm__context_budgets(ctx, &cap[SGM_TIER_VRAM], &cap[SGM_TIER_SHARED]);
  char why[400] = "", c[32];
  if (others && budget < cap[t])
    snprintf(why, sizeof why, "this process's fair share of a device it shares with %zu other sgm "
             "process%s (alone it would have %s): they hold the rest. Wait for them, or give this "
             "process a larger share (SGM_SHARE_WEIGHT, SGM_VRAM_RESERVE, or the admin's "
             "policy); sgm-smi shows who holds what", others, others == 1 ? "" : "es",
             sgm__fmt_bytes(cap[t], c, sizeof c));
  if (ts.budget_bytes != budget || why[0]) sgm__tier_set_budget_why(sgm__context_tier(ctx, t), budget, why);
  if (sgm__context_managed(ctx)) sgm__managed_cache_fit(ctx, t); /* cached ranges over it go back */
  if (ts.used_bytes <= budget) return;
  if (t == SGM_TIER_SHARED && !sgm__placement_disk(ctx)) return; /* nowhere to demote to */
  if (sgm__residency_trim_to_budget(ctx, t)) sgm__tier_trim(sgm__context_tier(ctx, t));
}

static void share_tick(sgm_context *ctx) {
  sgm_share *sh = sgm__context_share(ctx);
  sgm_node_usage u;
  share_usage(ctx, &u);
  if (sgm__context_cfg(ctx)->share_mode == SGM_SHARE_FAIR && sgm__node_view(sh->node, sh->view) == SGM_OK) {
    uint64_t vb, sb;
    if (share_compute(ctx, sh->view, &u, &vb, &sb)) {
      size_t others = sh->view->n_procs ? sh->view->n_procs - 1 : 0;
      share_apply(ctx, SGM_TIER_VRAM, vb, others);
      share_apply(ctx, SGM_TIER_SHARED, sb, others);
      u.w[SGM_NODE_F_BUDGET + SGM_TIER_VRAM] = vb;
      u.w[SGM_NODE_F_BUDGET + SGM_TIER_SHARED] = sb;
    }
  }
  sgm__node_member_publish(sh->member, &u);
  /* After the view: dead records of this user that it met are unlinked in
   * the same tick (they stopped counting the moment their owner died). */
  sgm__node_reclaim(sh->node);
}

/* ------------------------------------------------------------------------ */
/* The ticker. */

static void *share_main(void *arg) {
  sgm_context *ctx = arg;
  sgm_share *sh = sgm__context_share(ctx);
  uint64_t period = sgm__context_cfg(ctx)->node_period_ms;
  sgm__lock_take(&sh->mu);
  while (!sh->stop) {
    if (sh->n_completed == sh->n_requested) {
      struct timespec until = sgm__clock_deadline(period);
      int rc = 0;
      while (!sh->stop && sh->n_completed == sh->n_requested && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&sh->cond, &sh->mu.mu, &until);
      if (sh->stop) break;
    }
    uint64_t serving = sh->n_requested;
    sgm__lock_drop(&sh->mu);
    share_tick(ctx);
    sgm__lock_take(&sh->mu);
    sh->n_completed = serving;
    pthread_cond_broadcast(&sh->cond);
  }
  sgm__lock_drop(&sh->mu);
  return NULL;
}

void sgm__share_poke(sgm_context *ctx) {
  sgm_share *sh = sgm__context_share(ctx);
  if (!sh || !sh->running) return;
  uint64_t gap = sgm__context_cfg(ctx)->node_period_ms / SHARE_POKE_DIVISOR;
  uint64_t now = sgm__context_now_ms(ctx) + 1, last = __atomic_load_n(&sh->poke_at, __ATOMIC_RELAXED);
  if (last && now - last < (gap ? gap : 1)) return; /* a tick was asked for lately */
  /* One of the threads falling back at once asks. */
  if (!__atomic_compare_exchange_n(&sh->poke_at, &last, now, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
    return;
  __atomic_add_fetch(&sh->n_pokes, 1, __ATOMIC_RELAXED);
  sgm__lock_take(&sh->mu);
  sh->n_requested++;
  pthread_cond_broadcast(&sh->cond);
  sgm__lock_drop(&sh->mu);
}

uint64_t sgm__share_pokes(sgm_context *ctx) {
  sgm_share *sh = sgm__context_share(ctx);
  return sh ? __atomic_load_n(&sh->n_pokes, __ATOMIC_RELAXED) : 0;
}

bool sgm__share_tick_sync(sgm_context *ctx) {
  sgm_share *sh = sgm__context_share(ctx);
  if (!sh) return false;
  if (!sh->running) {
    share_tick(ctx);
    return true;
  }
  sgm__lock_take(&sh->mu);
  uint64_t want = ++sh->n_requested;
  pthread_cond_broadcast(&sh->cond);
  while (sh->n_completed < want && !sh->stop) pthread_cond_wait(&sh->cond, &sh->mu.mu);
  sgm__lock_drop(&sh->mu);
  return true;
}

/* ------------------------------------------------------------------------ */
/* Join and leave. */

/* A short name for sgm-smi: the program's, without a path. */
static void share_name(char *out, size_t len) {
  FILE *f = fopen("/proc/self/comm", "re");
  size_t r = f ? fread(out, 1, len - 1, f) : 0;
  if (f) fclose(f);
  out[r] = '\0';
  char *nl = strchr(out, '\n');
  if (nl) *nl = '\0';
  if (!out[0]) snprintf(out, len, "?");
}

int sgm__share_join(sgm_context *ctx, uint64_t *vram_budget, uint64_t *shared_budget) {
  sgm__context_set_share(ctx, NULL);
  if (!sgm__context_cfg(ctx)->node || !sgm__context_bops(ctx)->device_key) return SGM_OK;
  char key[SGM_NODE_KEY_MAX] = "";
  sgm__context_bops(ctx)->device_key(sgm__context_be(ctx), key, sizeof key);
  if (!key[0]) return SGM_OK; /* a private device: nobody to share with */
  sgm_share *sh = calloc(1, sizeof *sh);
  sgm_node_view *view = malloc(sizeof *view);
  if (!sh || !view) {
    free(sh);
    free(view);
    sgm__log(sgm__context_cfg(ctx)->verbose, 1, "node registry: out of host memory; this process runs untracked");
    return SGM_OK;
  }
  sh->view = view;
  char name[SGM_NODE_NAME_MAX], pci[SGM_NODE_PCI_MAX] = "";
  share_name(name, sizeof name);
  uint8_t uuid[16] = {0};
  const sgm_backend_ops *ops = sgm__context_bops(ctx);
  if (ops->device_uuid && ops->device_uuid(sgm__context_be(ctx), uuid) != SGM_OK) {
    memset(uuid, 0, sizeof uuid); /* shown as unknown; the key (device_key) still names it */
    sgm__error_clear();
  }
  if (ops->device_pci_bus_id) ops->device_pci_bus_id(sgm__context_be(ctx), pci, sizeof pci);
  uint64_t ram = sgm__context_physical_ram(ctx);
  uint64_t shared_cap = ram / 2 > 64 * SGM_MiB ? ram / 2 : 64 * SGM_MiB;
  sgm_node_params p = {.dir = sgm__context_cfg(ctx)->node_dir, .key = key, .name = name,
                       .pci_bus_id = pci, .group = sgm__context_cfg(ctx)->node_group != 0,
                       .group_gid = sgm__admin_gid(sgm__admin_current()),
                       .device_total_bytes = sgm__context_device_total(ctx),
                       .shared_cap_bytes = shared_cap, .verbose = sgm__context_cfg(ctx)->verbose};
  memcpy(p.uuid, uuid, sizeof uuid);
  if (sgm__node_member_join(&p, &sh->member) != SGM_OK) {
    /* Untracked (node.c warned once): the context works alone. */
    sgm__error_clear();
    free(view);
    free(sh);
    return SGM_OK;
  }
  sh->node = sgm__node_member_node(sh->member);
  sgm__context_set_share(ctx, sh);
  sgm__lock_init(&sh->mu, SGM_LOCK_SHARE);
  sgm__clock_cond_init(&sh->cond);
  if (sgm__context_bops(ctx)->node_attach) {
    sgm__context_bops(ctx)->node_attach(sgm__context_be(ctx), sh->node);
    uint64_t free_bytes = 0, total_bytes = 0;
    int rc = sgm__context_bops(ctx)->mem_info(sgm__context_be(ctx), &free_bytes, &total_bytes);
    if (rc != SGM_OK) return rc; /* the caller leaves */
    sgm__context_set_device_total(ctx, total_bytes);
  }
  uint64_t total = sgm__node_device_total(sh->node);
  long double pool = (long double)total * (long double)sgm__context_vram_fraction(ctx);
  sh->pool_bytes = pool >= (long double)total ? total : (uint64_t)pool;
  sh->reserve_bytes = sgm__size_resolve(sgm__context_cfg(ctx)->vram_reserve, total, 0);
  /* Just joined: claim the whole cap until our use says otherwise. */
  sgm__context_budgets(ctx, vram_budget, shared_budget);
  sh->hold_bytes = sgm__context_cfg(ctx)->idle_trim_ms ? *vram_budget : 0;
  sh->hold_since_ms = sgm__context_now_ms(ctx);
  if (sgm__context_cfg(ctx)->share_mode != SGM_SHARE_FAIR) return SGM_OK;
  /* The budgets the tiers start with: this process with nothing in use (and
   * claiming its cap in reserve mode, which takes the budget at once). */
  sgm_node_usage u = {0};
  u.w[SGM_NODE_F_RESERVE] = sh->reserve_bytes;
  u.w[SGM_NODE_F_CAP] = *vram_budget;
  u.w[SGM_NODE_F_DEMAND] = sgm__context_cfg(ctx)->allow_growth && !sh->hold_bytes ? sgm__context_cfg(ctx)->growth_chunk_bytes
                                                                    : u.w[SGM_NODE_F_CAP];
  u.w[SGM_NODE_F_SHARED_CAP] = *shared_budget;
  u.w[SGM_NODE_F_SHARED_DEMAND] = sgm__context_cfg(ctx)->shared_chunk_bytes;
  u.w[SGM_NODE_F_WEIGHT] = (uint64_t)sgm__context_cfg(ctx)->share_weight;
  if (sgm__node_view(sh->node, sh->view) == SGM_OK)
    share_compute(ctx, sh->view, &u, vram_budget, shared_budget);
  sgm__error_clear();
  return SGM_OK;
}

int sgm__share_start(sgm_context *ctx) {
  sgm_share *sh = sgm__context_share(ctx);
  if (!sh) return SGM_OK;
  share_tick(ctx);
  int e = pthread_create(&sh->thread, NULL, share_main, ctx);
  if (e != 0)
    return sgm__error_set(SGM_ERR_NOMEM, "cannot start the node registry's thread: %s (set "
                          "SGM_NODE=off to run without the registry)", strerror(e));
  sh->running = true;
  return SGM_OK;
}

void sgm__share_stop(sgm_context *ctx) {
  sgm_share *sh = sgm__context_share(ctx);
  if (!sh || !sh->running) return;
  sgm__lock_take(&sh->mu);
  sh->stop = true;
  pthread_cond_broadcast(&sh->cond);
  sgm__lock_drop(&sh->mu);
  pthread_join(sh->thread, NULL);
  sh->running = false;
}

void sgm__share_leave(sgm_context *ctx) {
  sgm_share *sh = sgm__context_share(ctx);
  if (!sh) return;
  sgm__share_stop(ctx);
  sgm__node_member_leave(sh->member);
  pthread_cond_destroy(&sh->cond);
  sgm__lock_destroy(&sh->mu);
  free(sh->view);
  free(sh);
  sgm__context_set_share(ctx, NULL);
}

sgm_node *sgm__share_node(sgm_context *ctx) { return sgm__context_share(ctx) ? sgm__context_share(ctx)->node : NULL; }
