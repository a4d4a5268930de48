/*
 * fifo_abi1.c — a first-in first-out eviction policy built against the
 * frozen ABI-1 header (policy_abi1/sgm/policy.h), the way a plug-in compiled
 * before ABI 2 looks to the library: its vtable ends after `check`.
 *
 * Items are linked through their state: new ones at the tail, victims from
 * the head; a pinned item is unlinked, a restored one goes back to the head
 * (the eviction end), a used one to the tail.
 */
#include <stdlib.h>

#include "sgm/policy.h"

#if SGM_POLICY_ABI_VERSION != 1
#error "fifo_abi1.c must be built against the frozen ABI-1 header"
#endif

typedef struct fifo_node {
  struct fifo_node *prev, *next; /* list links; both NULL when not linked */
  sgm_policy_item *item;         /* the item this state belongs to */
} fifo_node;

struct sgm_policy {
  fifo_node head;       /* sentinel: head.next is the oldest */
  uint64_t bytes;       /* sum of linked items' sizes */
};

static sgm_status fifo_create(const sgm_policy_params *params, sgm_policy **out) {
  (void)params;
  sgm_policy *p = calloc(1, sizeof *p);
  *out = p;
  if (!p) return SGM_ERR_NOMEM;
  p->head.prev = p->head.next = &p->head;
  return SGM_OK;
}

static void fifo_destroy(sgm_policy *p) { free(p); }

static void fifo_link(sgm_policy *p, sgm_policy_item *it, int at_head) {
  fifo_node *n = it->state;
  fifo_node *before = at_head ? &p->head : p->head.prev;
  n->item = it;
  n->prev = before;
  n->next = before->next;
  before->next->prev = n;
  before->next = n;
  p->bytes += it->size_bytes;
}

static void fifo_unlink(sgm_policy *p, sgm_policy_item *it) {
  fifo_node *n = it->state;
  if (!n->prev) return; /* pinned: not linked */
  n->prev->next = n->next;
  n->next->prev = n->prev;
  n->prev = n->next = NULL;
  p->bytes -= it->size_bytes;
}

static void fifo_on_insert(sgm_policy *p, sgm_policy_item *it, sgm_policy_insert how) {
  fifo_link(p, it, how == SGM_POLICY_INSERT_RESTORE);
}

static void fifo_on_access(sgm_policy *p, sgm_policy_item *it) { fifo_link(p, it, 0); }

static void fifo_on_remove(sgm_policy *p, sgm_policy_item *it, sgm_policy_remove why) {
  (void)why;
  fifo_unlink(p, it);
}

static uint64_t fifo_reclaimable(const sgm_policy *p) { return p->bytes; }

static sgm_policy_item *fifo_next_victim(sgm_policy *p, uint64_t want) {
  (void)want;
  return p->head.next == &p->head ? NULL : p->head.next->item;
}

static const sgm_policy_ops fifo_abi1_ops = {
    .abi_version = SGM_POLICY_ABI_VERSION,
    .name = "fifo_abi1",
    .summary = "first in, first out, built for plug-in ABI 1",
    .state_bytes = sizeof(fifo_node),
    .create = fifo_create,
    .destroy = fifo_destroy,
    .on_insert = fifo_on_insert,
    .on_access = fifo_on_access,
    .on_remove = fifo_on_remove,
    .reclaimable_bytes = fifo_reclaimable,
    .next_victim = fifo_next_victim,
};

/* The vtable, as the old plug-in would hand it to sgm_policy_register; its
 * size is the ABI-1 size, so reading past it trips AddressSanitizer. */
const void *sgm_test_policy_abi1_fifo(void);
const void *sgm_test_policy_abi1_fifo(void) { return &fifo_abi1_ops; }

/* sizeof the ABI-1 vtable, for the test to compare with the current one. */
size_t sgm_test_policy_abi1_ops_bytes(void);
size_t sgm_test_policy_abi1_ops_bytes(void) { return sizeof(sgm_policy_ops); }
