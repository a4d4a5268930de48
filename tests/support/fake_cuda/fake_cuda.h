/*
 * fake_cuda.h — the control API of the CUDA driver TEST DOUBLE
 * (tests/support/fake_cuda/fake_cuda.c, built as a file named libcuda.so.1 in
 * its own build folder). Not a driver: see fake_cuda.c.
 *
 * sgm loads the double with dlopen(RTLD_LOCAL), so a test reaches these
 * functions with dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) and dlsym after
 * sgm has loaded it; FAKE_CUDA_CONTROL(X) lists them for such a lookup table.
 *
 * Work is asynchronous in the double as on a GPU: a copy or an event record
 * completes later, on a worker thread. Tests never sleep for it: they hold
 * records (fake_cuda_hold_*), pause the worker, and release or settle.
 */
#ifndef SGM_FAKE_CUDA_H
#define SGM_FAKE_CUDA_H

#include <stdint.h>

/* What the double holds now (all live counts are what sgm must give back).
 * Fields only ever grow at the end. */
typedef struct fake_cuda_stats {
  uint64_t calls;              /* counted driver calls since load or fake_cuda_reset() */
  uint64_t device_allocs;      /* live cuMemAlloc allocations */
  uint64_t device_bytes;       /* their bytes (as accounted: rounded up to 256) */
  uint64_t host_registrations; /* live cuMemHostRegister ranges */
  uint64_t streams;            /* live streams from cuStreamCreate* (not the test's own) */
  uint64_t events;             /* live events from cuEventCreate */
  uint64_t pending_events;     /* live events whose latest record is not complete */
  uint64_t ctx_retains;        /* primary-context retains not yet released, all devices */
  uint64_t fault_hit;          /* 1 once the armed fault has fired */
  uint64_t pending_ops;        /* queued operations not complete (incl. destroyed events') */
  uint64_t bad_event_destroys; /* cuEventDestroy of an already destroyed event (must stay 0) */
  uint64_t bad_handles;        /* INVALID_HANDLE answers for streams and events */
  uint64_t graphs;             /* live graphs from cuStreamEndCapture */
  uint64_t captures_active;    /* captures begun and not ended */
  uint64_t sticky_result;      /* a sticky CUresult poisoning a context, 0 when none */
  uint64_t managed_allocs;     /* live cuMemAllocManaged ranges */
  uint64_t managed_device_bytes; /* bytes of managed pages placed on a device */
  uint64_t managed_host_bytes; /* bytes of managed pages placed in host memory */
  uint64_t managed_evicted_bytes; /* managed bytes the "driver" evicted on its own to fit a
                                     prefetch (sgm must keep this 0) */
  uint64_t vmm_reservations;   /* live cuMemAddressReserve ranges */
  uint64_t vmm_allocations;    /* live cuMemCreate allocations (not released, or still mapped) */
  uint64_t vmm_bytes;          /* their bytes (charged to the device) */
  uint64_t vmm_mappings;       /* live cuMemMap mappings */
  uint64_t vmm_unmaps_in_use;  /* cuMemUnmap of memory queued work still used (must stay 0) */
  uint64_t stream_races;       /* (issue 26) operations queued on one stream over memory that
                                  pending work of another stream writes, or writing memory it
                                  reads, without being ordered after that work (a wait on an
                                  event recorded after it, the legacy stream's implicit order):
                                  a GPU would race; must stay 0 */
} fake_cuda_stats;

/*
 * X(return type, name, parameters) for every control function:
 *  fake_cuda_reset             disarm faults, clear sticky errors, zero the call
 *                              counters, stop holding, release every held record,
 *                              unpause, re-read the FAKE_CUDA_* knobs, wait for the
 *                              worker to settle (live objects stay: they are what
 *                              leak checks count)
 *  fake_cuda_set_fail_at       the nth counted call from now fails with result
 *                              (once); n = 0 disarms
 *  fake_cuda_fault_call        name of the entry point the fault hit, "" before it did
 *  fake_cuda_get_stats         fill *out
 *  fake_cuda_live_allocations  device allocations + host registrations + VMM
 *                              allocations and reservations now
 *  fake_cuda_hold_events       on != 0: event records enqueued from now on are held:
 *                              they (and all later work of their stream, and work
 *                              that waits on them) stay pending until released
 *  fake_cuda_complete_events   release every held record, then wait until the
 *                              worker has run everything it can
 *  fake_cuda_stream_create     a blocking stream of device 0's primary context for
 *                              the test itself (no context needs to be current)
 *  fake_cuda_stream_destroy    destroy such a stream (its work goes on)
 *  fake_cuda_hold_stream       on != 0: event records enqueued on stream are held
 *  fake_cuda_complete_stream   release the held records of stream, then settle
 *  fake_cuda_set_delay_us      simulated device time per queued operation
 *                              (also FAKE_CUDA_DELAY_US)
 *  fake_cuda_pause             on != 0: the worker runs nothing (every queued
 *                              operation stays pending); 0: it resumes
 *  fake_cuda_set_lazy          on != 0: the worker runs work only while a host
 *                              thread waits for some (also FAKE_CUDA_LAZY=1)
 *  fake_cuda_settle            wait until the worker has run everything it can
 *                              (held, paused or blocked work stays pending)
 *  fake_cuda_set_other_used    bytes "other processes" hold on every device
 *                              (also FAKE_CUDA_OTHER_USED)
 *  fake_cuda_set_host_register_result  every cuMemHostRegister fails with result
 *                              (e.g. CUDA_ERROR_NOT_PERMITTED); 0 = normal
 *                              (also FAKE_CUDA_HOST_REGISTER_RESULT)
 *  fake_cuda_set_sticky_at     the nth counted call from now fails with result and
 *                              poisons every retained primary context with it
 *  fake_cuda_set_sticky        poison every retained primary context now with
 *                              result (CUDA_SUCCESS clears)
 *  fake_cuda_calls             calls of one entry point by base name
 *  fake_cuda_managed_page      the managed page holding p: where it is (0 nowhere yet,
 *                              1 device, 2 host; -1 not managed memory), and its
 *                              preferred location type (-1 none) and accessed-by flag
 *                              ("cuMemAlloc") since load or reset; NULL or "":
 *                              all counted calls
 *  fake_cuda_kernel            (issue 24) queue on stream (NULL: the current
 *                              context's legacy stream) a "kernel" of us
 *                              microseconds of device time over the device range
 *                              [ptr, ptr + n): at its end it writes byte value
 *                              there (value >= 0) or reads every byte (value
 *                              -1). Ordered, captured, waited for by frees and
 *                              counted by cuMemUnmap (vmm_unmaps_in_use) like a
 *                              copy; a CUresult (0: queued)
 *
 * Other knobs, read from the environment: FAKE_CUDA_DEVICE_COUNT,
 * FAKE_CUDA_TOTAL_MEM, FAKE_CUDA_DRIVER_VERSION (default 13000),
 * FAKE_CUDA_INIT_RESULT, FAKE_CUDA_FAIL_AT, FAKE_CUDA_FAIL_RESULT,
 * FAKE_CUDA_CAN_MAP_HOST, FAKE_CUDA_HOST_REGISTER_SUPPORTED (default 1),
 * FAKE_CUDA_PINNED_LIMIT, FAKE_CUDA_VMM_SUPPORTED (default 1), FAKE_CUDA_VMM_GRANULE
 * (default 2 MiB), FAKE_CUDA_CTX_OVERHEAD (default 300 MiB, total/8 on
 * devices under 2.4 GiB), FAKE_CUDA_PCI_BUS_ID. The rules the double enforces
 * are listed at the top of fake_cuda.c.
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
  X(void, fake_cuda_complete_stream, (void *stream))                    \
  X(void, fake_cuda_set_delay_us, (uint64_t us))                        \
  X(void, fake_cuda_pause, (int on))                                    \
  X(void, fake_cuda_set_lazy, (int on))                                 \
  X(void, fake_cuda_settle, (void))                                     \
  X(void, fake_cuda_set_other_used, (uint64_t bytes))                   \
  X(void, fake_cuda_set_host_register_result, (int result))             \
  X(void, fake_cuda_set_sticky_at, (uint64_t n, int result))            \
  X(void, fake_cuda_set_sticky, (int result))                           \
  X(uint64_t, fake_cuda_calls, (const char *name))                      \
  X(int, fake_cuda_managed_page, (const void *p, int *preferred, int *accessed_by)) \
  X(int, fake_cuda_kernel, (void *stream, void *ptr, uint64_t n, int value, uint64_t us))

#define FAKE_CUDA_DECLARE(ret, name, params) ret name params;
FAKE_CUDA_CONTROL(FAKE_CUDA_DECLARE)
#undef FAKE_CUDA_DECLARE

#endif /* SGM_FAKE_CUDA_H */
