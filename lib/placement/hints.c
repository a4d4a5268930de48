/*
 * hints.c — residency hints: what the application says about the buffers it
 * will use (sgm_will_use), is done with (sgm_buffer_done) and how they extend
 * each other (sgm_buffer_set_parent). docs/policies.md "Residency hints".
 *
 * A hint is a field of the buffer's policy item (item.hint,
 * item.will_use_distance; item.parent resolved per call) that the policy of
 * the buffer's tier reads when the item enters or is used, and, for a listed
 * item, is told of at once through on_hint (policy ABI 4; a policy without
 * it ignores hints, and behaves as before). A use ends will-use and done
 * (sgm__residency_put): the hint was about that use.
 *
 * Locks: every write here holds both residency locks, pl->res[VRAM] then
 * pl->res[SHARED] (rank order), so a reader holding either (a policy call)
 * sees a stable parent pointer and stable hints; the owner of a buffer also
 * clears its hints under its tier's lock alone (a use), which excludes these
 * writers too. Calls: the priority layer (sgm__prio_hint). Never blocks on
 * anything but those two locks; no backend call.
 */
#include <stdio.h>

#include "placement.h"

static void hints_lock(struct sgm_placement *pl) {
  sgm__lock_take(sgm__residency_lock(pl, SGM_TIER_VRAM));
  sgm__lock_take(sgm__residency_lock(pl, SGM_TIER_SHARED));
}

static void hints_unlock(struct sgm_placement *pl) {
  sgm__lock_drop(sgm__residency_lock(pl, SGM_TIER_SHARED));
  sgm__lock_drop(sgm__residency_lock(pl, SGM_TIER_VRAM));
}

/* Under both locks: the policy listing b hears that its hints changed. */
static void hints_tell_locked(struct sgm_placement *pl, sgm_buffer *b) {
  uint8_t t = b->listed_in;
  if (t >= SGM_N_RESIDENT) return; /* pinned, moving or on disk: read when it comes back */
  sgm__residency_resolve_parent(b, (sgm_tier)t);
  sgm__prio_hint(pl->pol[t], &b->item);
  b->item.parent = NULL;
}

/* Checks b for a hint call of ctx (ctx NULL: b's own). */
static int hints_check(const sgm_buffer *b, const sgm_context *ctx, const char *fn) {
  int rc = sgm__buffer_check(b, fn);
  if (rc != SGM_OK) return rc;
  if (ctx && b->ctx != ctx)
    return sgm__error_set(SGM_ERR_INVALID, "%s: the buffer belongs to another context", fn);
  if (b->managed)
    return sgm__error_set(SGM_ERR_INVALID, "%s: not a buffer of sgm_buffer_create", fn);
  return SGM_OK;
}

SGM_API sgm_status sgm_will_use(sgm_context *ctx, sgm_buffer *const *bufs, size_t n,
                                uint32_t distance) {
  if (!ctx) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_will_use: ctx is NULL");
  if (n == 0) return SGM_OK;
  if (!bufs) return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_will_use: bufs is NULL with n = %zu", n);
  if (sgm__parts_forked(ctx)) return (sgm_status)sgm__parts_fork_error(ctx, "sgm_will_use");
  /* All or nothing: every buffer is checked before any hint changes. */
  for (size_t i = 0; i < n; i++) {
    int rc = hints_check(bufs[i], ctx, "sgm_will_use");
    if (rc != SGM_OK) {
      char why[SGM_ERROR_MAX];
      snprintf(why, sizeof why, "%s", sgm_last_error());
      return (sgm_status)sgm__error_set(rc, "%s (bufs[%zu]; no hint changed)", why, i);
    }
  }
  struct sgm_placement *pl = sgm__parts_pl(ctx);
  hints_lock(pl);
  for (size_t i = 0; i < n; i++) {
    sgm_buffer *b = bufs[i];
    uint32_t h = b->item.hint & ~(SGM_POLICY_HINT_WILL_USE | SGM_POLICY_HINT_DONE);
    if (distance != SGM_WILL_USE_CANCEL) h |= SGM_POLICY_HINT_WILL_USE;
    else if (b->item.hint & SGM_POLICY_HINT_DONE) h |= SGM_POLICY_HINT_DONE; /* cancel keeps done */
    uint32_t d = distance == SGM_WILL_USE_CANCEL ? 0 : distance;
    if (h == b->item.hint && d == b->item.will_use_distance) continue;
    b->item.hint = h;
    b->item.will_use_distance = d;
    hints_tell_locked(pl, b);
  }
  hints_unlock(pl);
  return SGM_OK;
}

SGM_API sgm_status sgm_buffer_done(sgm_buffer *b) {
  int rc = hints_check(b, NULL, "sgm_buffer_done");
  if (rc != SGM_OK) return (sgm_status)rc;
  struct sgm_placement *pl = sgm__parts_pl(b->ctx);
  hints_lock(pl);
  if (b->item.hint != SGM_POLICY_HINT_DONE) {
    b->item.hint = SGM_POLICY_HINT_DONE; /* done ends will-use */
    b->item.will_use_distance = 0;
    hints_tell_locked(pl, b);
  }
  hints_unlock(pl);
  return SGM_OK;
}

/* Under both locks: b leaves its parent's list of children. */
static void hints_unlink_locked(sgm_buffer *b) {
  sgm_buffer *p = b->hparent;
  if (!p) return;
  if (b->hsib_prev) b->hsib_prev->hsib_next = b->hsib_next;
  else p->hchild = b->hsib_next;
  if (b->hsib_next) b->hsib_next->hsib_prev = b->hsib_prev;
  b->hparent = b->hsib_prev = b->hsib_next = NULL;
}

SGM_API sgm_status sgm_buffer_set_parent(sgm_buffer *b, sgm_buffer *parent) {
  int rc = hints_check(b, NULL, "sgm_buffer_set_parent");
  if (rc != SGM_OK) return (sgm_status)rc;
  if (parent) {
    rc = hints_check(parent, b->ctx, "sgm_buffer_set_parent (parent)");
    if (rc != SGM_OK) return (sgm_status)rc;
    if (parent == b)
      return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_set_parent: a buffer cannot be "
                                        "its own parent");
  }
  struct sgm_placement *pl = sgm__parts_pl(b->ctx);
  hints_lock(pl);
  /* A parent that descends from b would make a cycle. Chains are walked
   * whole: KV-cache chains are a few hundred blocks at most. */
  for (sgm_buffer *a = parent; a; a = a->hparent) {
    if (a == b) {
      hints_unlock(pl);
      return (sgm_status)sgm__error_set(SGM_ERR_INVALID, "sgm_buffer_set_parent: the parent "
                                        "descends from the buffer (a cycle); nothing changed");
    }
  }
  if (b->hparent != parent) {
    hints_unlink_locked(b);
    if (parent) {
      b->hparent = parent;
      b->hsib_next = parent->hchild;
      if (parent->hchild) parent->hchild->hsib_prev = b;
      parent->hchild = b;
    }
    hints_tell_locked(pl, b);
  }
  hints_unlock(pl);
  return SGM_OK;
}

void sgm__hints_forget(struct sgm_placement *pl, sgm_buffer *b) {
  hints_lock(pl);
  hints_unlink_locked(b);
  for (sgm_buffer *c = b->hchild, *next; c; c = next) {
    next = c->hsib_next;
    c->hparent = c->hsib_prev = c->hsib_next = NULL;
  }
  b->hchild = NULL;
  hints_unlock(pl);
}
