/*
 * prim/clock.c — the one monotonic clock the library reads (policy clocks,
 * idle trimming). Tests replace its users' clocks, never this function.
 * Threading: any thread; no state.
 */
#include <time.h>

#include "internal.h"

uint64_t sgm__clock_monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}
