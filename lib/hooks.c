/*
 * hooks.c — framework hooks: PyTorch's CUDAPluggableAllocator entry points
 * (sgm_torch_malloc / sgm_torch_free and the optional empty_cache,
 * set_memory_fraction and record_stream), and sgm_hook_context for CuPy and C
 * callers.
 *
 * A framework hands sgm nothing but (size, device, stream), so the hooks keep
 * one context per device ordinal (0 .. HOOKS_MAX_DEVICES - 1), created lazily
 * on first use from sgm_config_init() (the SGM_* environment) with
 * cfg.device = that ordinal. This table is one of the two mutable globals
 * STYLE.md allows.
 *
 * Invariants: a slot goes from NULL to a fully created context exactly once
 * (until sgm__hooks_reset_for_tests); a slot is only written under hooks_mu,
 * and published with a release store after the context is fully built.
 *
 * Threading: the fast path is one acquire load of the slot, no lock. The
 * first use takes hooks_mu, loads the slot again (another thread may have
 * won), and creates the context under it, so concurrent first calls from many
 * threads create exactly one context. hooks_mu has the lowest rank
 * (SGM_LOCK_HOOKS): it is always the outermost lock, sgm never takes it from
 * inside, and context creation (which takes tier and backend locks) runs
 * under it. It is one mutex for all devices: creation is
 * rare, and serialising it also serialises driver initialisation.
 * Calls on an existing context (alloc, free, trim, set_vram_fraction) run
 * without hooks_mu; the context locks itself.
 *
 * Errors: PyTorch does not check sgm_torch_malloc's result for NULL, so a
 * silent NULL becomes a confusing crash far away. Every failure of a hook is
 * therefore written to stderr as one line whatever SGM_VERBOSE says
 * ("sgm: error: sgm_torch_malloc(<size>, device <d>): <why>"), in addition to
 * this thread's sgm_last_error(). When the context cannot be created (a bad
 * SGM_* value, no device) every call retries and says so again: one line per
 * failed call, and a program that fixes its environment recovers.
 *
 * Size 0: PyTorch's CUDAPluggableAllocator calls the allocator for empty
 * tensors too; its own caching allocator answers size 0 with a NULL data
 * pointer, and a NULL DataPtr never reaches the free function. So
 * sgm_torch_malloc(0, ...) returns NULL silently, creating nothing.
 *
 * Teardown: hook contexts are never destroyed while the process runs. An
 * atexit handler or destructor is not safe here: frameworks free tensors from
 * their own static destructors and from interpreter shutdown, in an order
 * relative to ours that nobody controls, and CUDA's runtime tears the driver
 * down from its own exit handler, after which freeing device memory fails.
 * The OS reclaims VRAM, pinned pages and the unlinked spill file when the
 * process exits. The contexts stay reachable from this table, so leak
 * checkers do not report them. Tests reset the table with
 * sgm__hooks_reset_for_tests().
 */
#include <pthread.h>
#include <stdint.h>

#include "internal.h"
#include "tiers/tier.h"

/* 64 ordinals: more GPUs than any one machine has (DGX-class nodes have 8 or
 * 16), and the table stays 512 bytes. */
#define HOOKS_MAX_DEVICES 64

static sgm_context *hooks_contexts[HOOKS_MAX_DEVICES]; /* per device; NULL until first use */
static sgm_lock hooks_mu = SGM_LOCK_INITIALIZER(SGM_LOCK_HOOKS); /* serialises creation and reset */
static uint64_t hooks_n_created; /* contexts created since start (or the last reset) */

/* One line to stderr whatever SGM_VERBOSE says: level 0 ("error") always prints. */
#define hooks_report(...) sgm__log(0, 0, __VA_ARGS__)

static bool hooks_device_ok(int device) {
  if (device >= 0 && device < HOOKS_MAX_DEVICES) return true;
  sgm__error_set(SGM_ERR_INVALID, "device %d is out of range: the hooks serve devices 0 to %d",
                 device, HOOKS_MAX_DEVICES - 1);
  return false;
}

/*
 * The device's context, creating it if needed. fraction > 0 sets the VRAM
 * fraction of a context created by this call. *created (may be NULL) tells
 * whether this call created it. NULL with the thread's error set on failure.
 */
static sgm_context *hooks_get_or_create(int device, double fraction, bool *created) {
  if (created) *created = false;
  if (!hooks_device_ok(device)) return NULL;
  sgm_context *ctx = __atomic_load_n(&hooks_contexts[device], __ATOMIC_ACQUIRE);
  if (sgm_likely(ctx != NULL)) return ctx;

  sgm__lock_take(&hooks_mu);
  ctx = __atomic_load_n(&hooks_contexts[device], __ATOMIC_ACQUIRE);
  if (!ctx) {
    sgm_config cfg;
    sgm_config_init(&cfg);
    cfg.device = device;
    if (fraction > 0) cfg.vram_fraction = fraction;
    if (sgm_context_create(&cfg, &ctx) == SGM_OK) {
      __atomic_store_n(&hooks_contexts[device], ctx, __ATOMIC_RELEASE);
      __atomic_fetch_add(&hooks_n_created, 1, __ATOMIC_RELAXED);
      if (created) *created = true;
    }
  }
  sgm__lock_drop(&hooks_mu);
  return ctx;
}

SGM_API sgm_context *sgm_hook_context(int device) {
  sgm_context *ctx = hooks_get_or_create(device, 0, NULL);
  if (!ctx) hooks_report("sgm_hook_context(device %d): %s", device, sgm_last_error());
  return ctx;
}

SGM_API void *sgm_torch_malloc(size_t size, int device, void *stream) {
  if (size == 0) {
    sgm__error_clear();
    return NULL;
  }
  sgm_context *ctx = hooks_get_or_create(device, 0, NULL);
  void *p = ctx ? sgm_alloc(ctx, size, stream) : NULL;
  if (sgm_unlikely(!p))
    hooks_report("sgm_torch_malloc(%zu, device %d): %s", size, device, sgm_last_error());
  return p;
}

SGM_API void sgm_torch_free(void *ptr, size_t size, int device, void *stream) {
  if (!ptr) return;
  if (!hooks_device_ok(device)) {
    hooks_report("sgm_torch_free(%p, %zu, device %d): %s; nothing was freed", ptr, size, device,
                 sgm_last_error());
    return;
  }
  sgm_context *ctx = __atomic_load_n(&hooks_contexts[device], __ATOMIC_ACQUIRE);
  if (!ctx) {
    sgm__error_set(SGM_ERR_INVALID,
                   "sgm_torch_free(%p, %zu, device %d): no sgm context exists for device %d, so "
                   "this pointer cannot be sgm's (was the allocator switched after tensors were "
                   "made?); nothing was freed",
                   ptr, size, device, device);
    hooks_report("%s", sgm_last_error());
    return;
  }
  /* A foreign pointer or a double free is refused and logged by sgm_free
   * itself (SGM_VERBOSE >= 1, the default), and counted in n_bad_frees. */
  sgm_free(ctx, ptr, stream);
}

SGM_API void sgm_torch_record_stream(void *ptr, void *stream) {
  if (!ptr) return;
  /* PyTorch's record-stream hook passes no device: the pointer is live in
   * exactly one hook context, the one whose sgm_record_stream accepts it. */
  for (int d = 0; d < HOOKS_MAX_DEVICES; d++) {
    sgm_context *ctx = __atomic_load_n(&hooks_contexts[d], __ATOMIC_ACQUIRE);
    if (!ctx) continue;
    sgm_status rc = sgm_record_stream(ctx, ptr, stream);
    if (rc == SGM_OK) return;
    if (rc != SGM_ERR_INVALID) {
      hooks_report("sgm_torch_record_stream(%p, stream %p): %s", ptr, stream, sgm_last_error());
      return;
    }
  }
  sgm__error_set(SGM_ERR_INVALID, "sgm_torch_record_stream(%p, stream %p): no hook context holds "
                 "this pointer live (freed already, or not from sgm_torch_malloc); nothing was "
                 "recorded", ptr, stream);
  hooks_report("%s", sgm_last_error());
}

SGM_API void sgm_torch_empty_cache(void) {
  for (int d = 0; d < HOOKS_MAX_DEVICES; d++) {
    sgm_context *ctx = __atomic_load_n(&hooks_contexts[d], __ATOMIC_ACQUIRE);
    if (ctx && sgm_trim(ctx) != SGM_OK)
      hooks_report("sgm_torch_empty_cache: device %d: %s", d, sgm_last_error());
  }
}

SGM_API void sgm_torch_set_memory_fraction(double fraction, int device) {
  /* !(x > 0) also catches NaN. */
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    sgm__error_set(SGM_ERR_INVALID,
                   "the VRAM fraction %g is out of range: it must be in (0, 1]; nothing changed",
                   fraction);
    hooks_report("sgm_torch_set_memory_fraction(%g, device %d): %s", fraction, device,
                 sgm_last_error());
    return;
  }
  bool created = false;
  sgm_context *ctx = hooks_get_or_create(device, fraction, &created);
  int rc = SGM_OK;
  if (!ctx) rc = SGM_ERR_INVALID; /* the error is set */
  else if (!created) rc = sgm__context_set_vram_fraction(ctx, fraction);
  if (rc != SGM_OK)
    hooks_report("sgm_torch_set_memory_fraction(%g, device %d): %s", fraction, device,
                 sgm_last_error());
}

/*
 * PyTorch's remaining CUDAPluggableAllocator hooks (torch/csrc/cuda/
 * CUDAPluggableAllocator.h; docs/frameworks.md says which version has which).
 * PyTorch calls them through function pointers of C++ types; each signature
 * below is the C type with the same calling convention on x86-64 and
 * aarch64: c10::cuda::MempoolId_t (std::pair<unsigned long long, unsigned
 * long long>, trivially copyable) travels by value as a two-word struct, and
 * a std::function argument (not trivially copyable) as a pointer to the
 * caller's temporary, which sgm never calls (it dies when the hook returns).
 */

SGM_API void sgm_torch_init(int device_count) {
  if (device_count > HOOKS_MAX_DEVICES)
    hooks_report("sgm_torch_init(%d devices): the hooks serve devices 0 to %d; allocations on "
                 "the others will fail", device_count, HOOKS_MAX_DEVICES - 1);
}

SGM_API void *sgm_torch_base_alloc(void *ptr, size_t *size) {
  /* The chunk holding ptr is the base allocation where it is one driver
   * allocation (chunk mode VRAM): CUDA IPC can share it whole. Elsewhere
   * (VMM ranges, pinned host memory) ptr is its own base, as PyTorch's default. */
  for (int d = 0; ptr && d < HOOKS_MAX_DEVICES; d++) {
    sgm_context *ctx = __atomic_load_n(&hooks_contexts[d], __ATOMIC_ACQUIRE);
    if (!ctx || sgm_pointer_tier(ctx, ptr) != SGM_TIER_VRAM) continue;
    struct sgm_tier_pool *vram = sgm__context_tier(ctx, SGM_TIER_VRAM);
    uint64_t granule = 0, reserved = 0;
    sgm__tier_vmm_info(vram, &granule, &reserved);
    sgm_chunk c;
    if (reserved == 0 && sgm__tier_chunk_of(vram, (sgm_devptr)(uintptr_t)ptr, &c)) {
      if (size) *size = c.bytes;
      return (void *)(uintptr_t)c.base;
    }
    break;
  }
  return ptr;
}

/* PyTorch's pool id as sgm's: graph pools are {n, 0}, MemPool pools {0, n}
 * (counters from 1); the second kind gets the top bit. {0, 0} is no pool. */
static uint64_t hooks_pool_id(sgm_torch_pool_id id) {
  return id.first ? (uint64_t)id.first : id.second ? ((uint64_t)id.second | (UINT64_C(1) << 63)) : 0;
}

static void hooks_pool_call(const char *what, int device, sgm_torch_pool_id id, void *stream,
                            int op) {
  uint64_t pool = hooks_pool_id(id);
  sgm_context *ctx = hooks_get_or_create(device, 0, NULL);
  sgm_status rc = SGM_ERR_INVALID; /* the error is set when ctx is NULL */
  if (ctx && op == 0) rc = sgm_capture_pool_begin(ctx, stream, pool);
  else if (ctx && op == 1) rc = sgm_capture_pool_end(ctx, pool);
  else if (ctx) rc = sgm_capture_pool_release(ctx, pool);
  if (rc != SGM_OK)
    hooks_report("%s(device %d, pool {%llu, %llu}): %s", what, device, id.first, id.second,
                 sgm_last_error());
}

SGM_API void sgm_torch_begin_allocate_to_pool(int device, sgm_torch_pool_id pool, const void *filter) {
  /* The filter (which streams PyTorch means) cannot be called from C; the
   * thread that begins is the one that captures (CUDAGraph::capture_begin,
   * torch.cuda.use_mem_pool), so its allocations on any stream join. */
  (void)filter;
  hooks_pool_call("sgm_torch_begin_allocate_to_pool", device, pool, SGM_CAPTURE_ANY_STREAM, 0);
}

SGM_API void sgm_torch_end_allocate_to_pool(int device, sgm_torch_pool_id pool) {
  hooks_pool_call("sgm_torch_end_allocate_to_pool", device, pool, NULL, 1);
}

SGM_API void sgm_torch_release_pool(int device, sgm_torch_pool_id pool) {
  hooks_pool_call("sgm_torch_release_pool", device, pool, NULL, 2);
}

SGM_API void sgm_torch_begin_allocate_stream_to_pool(int device, void *stream, sgm_torch_pool_id pool) {
  hooks_pool_call("sgm_torch_begin_allocate_stream_to_pool", device, pool, stream, 0);
}

SGM_API void sgm_torch_end_allocate_stream_to_pool(int device, void *stream) {
  sgm_context *ctx = hooks_get_or_create(device, 0, NULL);
  if (!ctx || sgm__capture_end_stream(sgm__context_capture(ctx), stream) != SGM_OK)
    hooks_report("sgm_torch_end_allocate_stream_to_pool(device %d, stream %p): %s", device,
                 stream, sgm_last_error());
}

void sgm__hooks_reset_for_tests(void) {
  sgm__lock_take(&hooks_mu);
  for (int d = 0; d < HOOKS_MAX_DEVICES; d++) {
    sgm_context *ctx = __atomic_exchange_n(&hooks_contexts[d], NULL, __ATOMIC_ACQ_REL);
    sgm_context_destroy(ctx);
  }
  __atomic_store_n(&hooks_n_created, 0, __ATOMIC_RELAXED);
  sgm__lock_drop(&hooks_mu);
}

uint64_t sgm__hooks_n_created(void) { return __atomic_load_n(&hooks_n_created, __ATOMIC_RELAXED); }
