/*
 * prim/clock.c — the one monotonic clock the library reads (policy clocks,
 * idle trimming). Tests replace its users' clocks, never this function.
 * Also the two halves of every timed wait on that clock: a condition
 * variable that waits on it, and a deadline some milliseconds from now.
 * Threading: any thread; no state.
 */
#include <pthread.h>
#include <time.h>

#include "internal.h"

uint64_t sgm__clock_monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

void sgm__clock_cond_init(pthread_cond_t *c) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(c, &ca);
  pthread_condattr_destroy(&ca);
}

struct timespec sgm__clock_deadline(uint64_t ms) {
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += (time_t)(ms / 1000);
  until.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  return until;
}
