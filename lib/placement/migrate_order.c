/*
 * migrate_order.c — the copy discipline (DESIGN.md §8): every copy of a
 * buffer's data, and every use of a buffer that does not move, runs after
 * the GPU work queued before its release.
 *
 * While that work is pending (b->event not complete) a copy runs on the
 * release's own stream (sgm__migrate_order_copy), so the device orders it,
 * and the host waits only for the copy's completion, which the backend's
 * copy contract gives before the source block is freed, reused or unpinned.
 * Once the copy is done the release event is complete too and is dropped. A
 * released buffer on the legacy stream, or on a per-thread default stream
 * (whose handle names another stream on the mover's thread), is copied on
 * the legacy stream, which follows the earlier work of every blocking
 * stream. A use on another stream (sgm__migrate_order_use) waits for the
 * release's work on the host. Spilling from shared memory to disk is the one
 * migration the host does itself (migrate.c): it waits for the release's
 * work first. An explicit eviction therefore proceeds with the release's
 * work pending (victim searches still prefer buffers whose work is done).
 *
 * Threading: the caller owns the buffer (BUSY: b->event is its to change)
 * and holds no sgm lock; the copies and event waits here block. Calls: the
 * backend's copy and event operations only.
 */
#include "backend/backend.h"
#include "placement.h"

/* True when work queued on stream a before now is ordered before work queued
 * on b afterwards by stream order alone (the same stream). */
static bool migrate_order_same_stream(void *a, void *b) {
  if (!a) a = SGM_STREAM_LEGACY;
  if (!b) b = SGM_STREAM_LEGACY;
  return a == b;
}

/* Drop b's release event if its work has completed; else say which stream a
 * copy of b's data must run on to follow that work (see the file comment). */
static void *migrate_order_stream(sgm_context *ctx, sgm_buffer *b) {
  if (!b->event) return NULL;
  if (sgm__parts_bops(ctx)->event_query(sgm__parts_be(ctx), b->event) == 1) {
    sgm__parts_bops(ctx)->event_destroy(sgm__parts_be(ctx), b->event);
    b->event = NULL;
    return NULL;
  }
  void *s = b->event_stream;
  return !s || s == SGM_STREAM_PER_THREAD ? SGM_STREAM_LEGACY : s;
}

/* Copy n bytes of b's data (from or to it), after the work queued before its
 * release; complete when this returns. */
int sgm__migrate_order_copy(sgm_context *ctx, sgm_buffer *b, sgm_copy_kind kind, uint64_t dst,
                            uint64_t src, uint64_t n) {
  void *stream = migrate_order_stream(ctx, b);
  int rc = sgm__parts_bops(ctx)->copy(sgm__parts_be(ctx), kind, dst, src, n, stream);
  if (rc == SGM_OK && stream) {
    /* The copy followed the release's work on its stream and is complete. */
    sgm__parts_bops(ctx)->event_destroy(sgm__parts_be(ctx), b->event);
    b->event = NULL;
  }
  return rc;
}

int sgm__migrate_order_use(sgm_context *ctx, void **event, void *event_stream, void *stream) {
  if (!*event) return SGM_OK;
  if (!migrate_order_same_stream(event_stream, stream)) {
    /* Another stream: its work must see the release's work done. Until the
     * backend can make one stream wait for another's event on the device,
     * the host waits (only here: a pending release and a stream change). */
    int rc = sgm__parts_bops(ctx)->event_wait(sgm__parts_be(ctx), *event);
    if (rc != SGM_OK) return rc;
  }
  sgm__parts_bops(ctx)->event_destroy(sgm__parts_be(ctx), *event);
  *event = NULL;
  return SGM_OK;
}
