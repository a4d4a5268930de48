/*
 * disk_spy.h — a spy I/O engine for the disk tier (lib/tiers/disk.h): makes
 * the nth spill write from now fail the way a full or failing disk does,
 * through the system calls the transfer loops make, so fault injection lives
 * here and not in the production loops.
 */
#ifndef SGM_DISK_SPY_H
#define SGM_DISK_SPY_H

#include <stdint.h>

#include "tiers/disk.h"

typedef enum sgm_disk_fault {
  SGM_DISK_FAULT_NONE,
  SGM_DISK_FAULT_ENOSPC, /* the first write call of the transfer fails with ENOSPC */
  SGM_DISK_FAULT_EIO,    /* ... with EIO */
  SGM_DISK_FAULT_SHORT   /* half of it is written for real, then no call makes progress */
} sgm_disk_fault;

/* Make the nth sgm__disk_write from now (1 = the next one) fail the given
 * way; nth 0 or kind NONE disarms; nth UINT64_MAX fails every write from now
 * (a full file system). A pipelined write fails on its second piece, with the
 * first in flight (SHORT: a real partial AIO completion). Installs the spy on
 * d the first time (it wraps the kernel engine and goes with the tier). */
void sgm__disk_inject(sgm_disk *d, sgm_disk_fault kind, uint64_t nth);

/* What the engine was asked to move since the spy was installed on d (or
 * its counts last reset). Write or read "requests" are pwrite/pread calls
 * plus AIO requests submitted; an extent is "in flight" from its first
 * request's submission until the io_getevents call that reaps its last. */
typedef struct sgm_disk_spy_counts {
  uint64_t n_write_transfers; /* begin(writing) calls: one per extent written */
  uint64_t n_read_transfers;  /* begin(reading) calls: one per extent read */
  uint64_t write_requests;    /* pwrite calls and write requests submitted */
  uint64_t read_requests;     /* pread calls and read requests submitted */
  uint64_t write_bytes;       /* bytes those write requests asked for */
  uint64_t read_bytes;        /* bytes those read requests asked for */
  uint64_t max_in_flight;     /* most AIO requests submitted and not yet reaped at once */
  uint64_t max_extents_in_flight; /* most transfers (extents) with a request in flight at once */
} sgm_disk_spy_counts;
/* Install the spy on d if it is not there, read its counts, and reset them
 * when reset is true. */
void sgm__disk_spy_counts(sgm_disk *d, bool reset, sgm_disk_spy_counts *out);

#endif /* SGM_DISK_SPY_H */
