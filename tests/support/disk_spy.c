/*
 * disk_spy.c — the spy I/O engine of the disk tier (see disk_spy.h).
 *
 * State per tier: what is armed and how many writes remain before it fires;
 * per write transfer (begin): OFF, ARMED (the next write call fails, or for a
 * pipelined body the second io_submit) or STALL (SHORT fired: every further
 * write call makes no progress). Threading: one mutex; the tests that inject
 * run one transfer at a time.
 */
#include "disk_spy.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef enum spy_state { SPY_OFF, SPY_ARMED, SPY_STALL } spy_state;

/* AIO requests tracked in flight (the tier keeps at most 32 per context). */
#define SPY_MAX_REQS 256

typedef struct disk_spy {
  pthread_mutex_t mu;     /* guards everything below */
  sgm_disk_fault kind;    /* how the armed write fails */
  uint64_t countdown;     /* writes until it fires; 0 = disarmed; UINT64_MAX = every write */
  spy_state state;        /* the current write transfer's state */
  sgm_disk_fault firing;  /* the kind armed for the current transfer */
  unsigned n_submits;     /* io_submit calls in the current armed transfer */
  sgm_disk_spy_counts counts; /* what the engine was asked to move */
  uint64_t transfer;      /* the current transfer's number (begin calls so far) */
  uint64_t in_flight;     /* AIO requests submitted, not reaped */
  uint64_t req_transfer[SPY_MAX_REQS]; /* the transfer of each request in flight (by aio_data) */
  uint64_t req_data[SPY_MAX_REQS];     /* their aio_data; 0 = free entry */
} disk_spy;

/* Transfers with a request in flight now. Under s->mu. */
static uint64_t spy_extents_in_flight(const disk_spy *s) {
  uint64_t seen[SPY_MAX_REQS], n = 0;
  for (unsigned i = 0; i < SPY_MAX_REQS; i++) {
    if (!s->req_data[i]) continue;
    bool dup = false;
    for (uint64_t k = 0; k < n && !dup; k++) dup = seen[k] == s->req_transfer[i];
    if (!dup) seen[n++] = s->req_transfer[i];
  }
  return n;
}

static const sgm_disk_engine *spy_inner(void) { return &sgm__disk_kernel_engine; }

static void spy_begin(void *user, bool writing, uint64_t bytes) {
  (void)bytes;
  disk_spy *s = user;
  pthread_mutex_lock(&s->mu);
  s->transfer++;
  if (writing) s->counts.n_write_transfers++;
  else s->counts.n_read_transfers++;
  if (!writing) {
    pthread_mutex_unlock(&s->mu);
    return;
  }
  s->state = SPY_OFF;
  s->n_submits = 0;
  if (s->kind != SGM_DISK_FAULT_NONE && s->countdown == UINT64_MAX) {
    s->state = SPY_ARMED;
    s->firing = s->kind;
  } else if (s->countdown && --s->countdown == 0) {
    s->state = SPY_ARMED;
    s->firing = s->kind;
    s->kind = SGM_DISK_FAULT_NONE;
  }
  pthread_mutex_unlock(&s->mu);
}

static ssize_t spy_pwrite(void *user, int fd, const void *buf, size_t n, uint64_t off) {
  disk_spy *s = user;
  pthread_mutex_lock(&s->mu);
  spy_state st = s->state;
  sgm_disk_fault k = s->firing;
  if (st == SPY_ARMED) s->state = k == SGM_DISK_FAULT_SHORT ? SPY_STALL : SPY_OFF;
  s->counts.write_requests++;
  s->counts.write_bytes += n;
  pthread_mutex_unlock(&s->mu);
  if (st == SPY_STALL) return 0;
  if (st == SPY_ARMED && k != SGM_DISK_FAULT_SHORT) {
    errno = k == SGM_DISK_FAULT_ENOSPC ? ENOSPC : EIO;
    return -1;
  }
  if (st == SPY_ARMED) { /* SHORT: half for real (aligned, for O_DIRECT) */
    size_t half = (n / 2) & ~(size_t)4095;
    return half ? spy_inner()->pwrite(NULL, fd, buf, half, off) : 0;
  }
  return spy_inner()->pwrite(NULL, fd, buf, n, off);
}

static ssize_t spy_pread(void *user, int fd, void *buf, size_t n, uint64_t off) {
  disk_spy *s = user;
  pthread_mutex_lock(&s->mu);
  s->counts.read_requests++;
  s->counts.read_bytes += n;
  pthread_mutex_unlock(&s->mu);
  return spy_inner()->pread(NULL, fd, buf, n, off);
}

static long spy_io_submit(void *user, aio_context_t ctx, long nr, struct iocb **cbs) {
  disk_spy *s = user;
  pthread_mutex_lock(&s->mu);
  bool fire = s->state == SPY_ARMED && ++s->n_submits == 2;
  sgm_disk_fault k = s->firing;
  if (fire && k == SGM_DISK_FAULT_SHORT) s->state = SPY_STALL;
  pthread_mutex_unlock(&s->mu);
  if (fire && k == SGM_DISK_FAULT_SHORT && cbs[0]->aio_lio_opcode == IOCB_CMD_PWRITE) {
    /* A real partial completion: the kernel writes half of this piece. */
    cbs[0]->aio_nbytes = (cbs[0]->aio_nbytes / 2) & ~(uint64_t)4095;
    if (cbs[0]->aio_nbytes == 0) {
      errno = EAGAIN; /* nothing to submit: the loop writes it, and stalls */
      return -1;
    }
  } else if (fire) {
    /* Refused for now: the loop moves this piece with pwrite, which fails. */
    errno = EAGAIN;
    return -1;
  }
  long r = spy_inner()->io_submit(NULL, ctx, nr, cbs);
  pthread_mutex_lock(&s->mu);
  for (long i = 0; i < r; i++) {
    bool w = cbs[i]->aio_lio_opcode == IOCB_CMD_PWRITE;
    *(w ? &s->counts.write_requests : &s->counts.read_requests) += 1;
    *(w ? &s->counts.write_bytes : &s->counts.read_bytes) += cbs[i]->aio_nbytes;
    for (unsigned k = 0; k < SPY_MAX_REQS; k++)
      if (!s->req_data[k]) {
        s->req_data[k] = cbs[i]->aio_data;
        s->req_transfer[k] = s->transfer;
        break;
      }
    s->in_flight++;
  }
  if (s->in_flight > s->counts.max_in_flight) s->counts.max_in_flight = s->in_flight;
  uint64_t ext = spy_extents_in_flight(s);
  if (ext > s->counts.max_extents_in_flight) s->counts.max_extents_in_flight = ext;
  pthread_mutex_unlock(&s->mu);
  return r;
}

static long spy_io_getevents(void *user, aio_context_t ctx, long min_nr, long nr,
                             struct io_event *ev) {
  disk_spy *s = user;
  long r = spy_inner()->io_getevents(NULL, ctx, min_nr, nr, ev);
  pthread_mutex_lock(&s->mu);
  for (long i = 0; i < r; i++) {
    for (unsigned k = 0; k < SPY_MAX_REQS; k++)
      if (s->req_data[k] == ev[i].data) {
        s->req_data[k] = 0;
        break;
      }
    if (s->in_flight) s->in_flight--;
  }
  pthread_mutex_unlock(&s->mu);
  return r;
}

static void spy_release(void *user) {
  disk_spy *s = user;
  pthread_mutex_destroy(&s->mu);
  free(s);
}

static const sgm_disk_engine spy_engine = {
    .name = "spy",
    .pwrite = spy_pwrite,
    .pread = spy_pread,
    .io_submit = spy_io_submit,
    .io_getevents = spy_io_getevents,
    .begin = spy_begin,
    .release = spy_release,
};

/* The spy on d, installed the first time. */
static disk_spy *spy_on(sgm_disk *d) {
  void *user = NULL;
  if (sgm__disk_get_engine(d, &user) == &spy_engine) return user;
  disk_spy *s = calloc(1, sizeof *s);
  if (!s) abort();
  pthread_mutex_init(&s->mu, NULL);
  sgm__disk_set_engine(d, &spy_engine, s);
  return s;
}

void sgm__disk_spy_counts(sgm_disk *d, bool reset, sgm_disk_spy_counts *out) {
  disk_spy *s = spy_on(d);
  pthread_mutex_lock(&s->mu);
  *out = s->counts;
  if (reset) memset(&s->counts, 0, sizeof s->counts);
  pthread_mutex_unlock(&s->mu);
}

void sgm__disk_inject(sgm_disk *d, sgm_disk_fault kind, uint64_t nth) {
  disk_spy *s = spy_on(d);
  pthread_mutex_lock(&s->mu);
  s->kind = nth ? kind : SGM_DISK_FAULT_NONE;
  s->countdown = kind == SGM_DISK_FAULT_NONE ? 0 : nth;
  pthread_mutex_unlock(&s->mu);
}
