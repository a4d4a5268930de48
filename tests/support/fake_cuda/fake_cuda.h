/*
 * fake_cuda.h — the control API of the CUDA driver TEST DOUBLE
 * (tests/support/fake_cuda/fake_cuda.c, built as a file named libcuda.so.1 in
 * its own build folder). Not a driver: see fake_cuda.c.
 *
 * sgm loads the double with dlopen(RTLD_LOCAL), so a test reaches these
 * functions with dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) and dlsym after
 * sgm has loaded it; FAKE_CUDA_CONTROL(X) lists them for such a lookup table.
 */
#ifndef SGM_FAKE_CUDA_H
#define SGM_FAKE_CUDA_H

#include <stdint.h>

/* What the double holds now (all live counts are what sgm must give back). */
typedef struct fake_cuda_stats {
  uint64_t calls;              /* counted driver calls since load or fake_cuda_reset() */
  uint64_t device_allocs;      /* live cuMemAlloc allocations */
  uint64_t device_bytes;       /* their bytes (as accounted: rounded up to 256) */
  uint64_t host_registrations; /* live cuMemHostRegister ranges */
  uint64_t streams;            /* live streams from cuStreamCreate (not the test's own) */
  uint64_t events;             /* live events from cuEventCreate */
  uint64_t pending_events;     /* recorded events not yet complete */
  uint64_t ctx_retains;        /* primary-context retains not yet released, all devices */
  uint64_t fault_hit;          /* 1 once the armed fault has fired */
} fake_cuda_stats;

/*
 * X(return type, name, parameters) for every control function:
 *  fake_cuda_reset             disarm faults, zero the call count, stop holding events
 *                              (live objects stay: they are what leak checks count)
 *  fake_cuda_set_fail_at       the nth counted call from now fails with result (once);
 *                              n = 0 disarms
 *  fake_cuda_fault_call        name of the entry point the fault hit, "" before it did
 *  fake_cuda_get_stats         fill *out
 *  fake_cuda_live_allocations  device allocations + host registrations now
 *  fake_cuda_hold_events       on != 0: events recorded from now on stay pending
 *  fake_cuda_complete_events   complete every pending event (wakes waiters)
 *  fake_cuda_stream_create     a stream for the test itself (no context needed)
 *  fake_cuda_stream_destroy    destroy such a stream
 *  fake_cuda_hold_stream       on != 0: events recorded on stream stay pending
 *  fake_cuda_complete_stream   complete the pending events of stream
 */
#define FAKE_CUDA_CONTROL(X)                                            \
  X(void, fake_cuda_reset, (void))                                      \
  X(void, fake_cuda_set_fail_at, (uint64_t n, int result))              \
  X(const char *, fake_cuda_fault_call, (void))                         \
  X(void, fake_cuda_get_stats, (fake_cuda_stats * out))                 \
  X(uint64_t, fake_cuda_live_allocations, (void))                       \
  X(void, fake_cuda_hold_events, (int on))                              \
  X(void, fake_cuda_complete_events, (void))                            \
  X(void *, fake_cuda_stream_create, (void))                            \
  X(void, fake_cuda_stream_destroy, (void *stream))                     \
  X(void, fake_cuda_hold_stream, (void *stream, int on))                \
  X(void, fake_cuda_complete_stream, (void *stream))

#define FAKE_CUDA_DECLARE(ret, name, params) ret name params;
FAKE_CUDA_CONTROL(FAKE_CUDA_DECLARE)
#undef FAKE_CUDA_DECLARE

#endif /* SGM_FAKE_CUDA_H */
