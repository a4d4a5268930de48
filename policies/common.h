/*
 * common.h — small helpers every built-in policy uses: intrusive circular
 * lists, a ghost table (ids of evicted buffers, found by hash, kept in the
 * policy's own order), checks and assertions. Header-only, built on
 * sgm/policy.h and libc like the policies themselves; no locks (the placement
 * lock serialises every call).
 */
#ifndef SGM_POLICIES_COMMON_H
#define SGM_POLICIES_COMMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sgm/policy.h>

#ifndef SGM_DEBUG
#define SGM_DEBUG 0
#endif

/* Cheap internal invariants, on at SGM_DEBUG >= 2 (as sgm_assert_internal). */
#define pol_assert(c) ((SGM_DEBUG >= 2 && !(c)) ? pol_assert_fail(#c, __FILE__, __LINE__) : (void)0)

static inline void pol_assert_fail(const char *cond, const char *file, int line) {
  fprintf(stderr, "sgm: policy assertion failed: %s (%s:%d)\n", cond, file, line);
  abort();
}

/* Fill why and return SGM_ERR_CORRUPT: the failure path of a check. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static inline sgm_status pol_fail(char *why, size_t len, const char *fmt, ...) {
  if (why && len) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
  }
  return SGM_ERR_CORRUPT;
}

/* ------------------------------------------------------------------------ */
/* Intrusive circular doubly linked lists with a sentinel. head->next is the
 * newest ("head"), head->prev the oldest ("tail"). An unlinked node has
 * next == NULL. */

typedef struct pol_node {
  struct pol_node *prev; /* towards the head (newer); the sentinel links both ways */
  struct pol_node *next; /* towards the tail (older); NULL when unlinked */
} pol_node;

static inline void pol_list_init(pol_node *h) { h->prev = h->next = h; }
static inline bool pol_list_empty(const pol_node *h) { return h->next == h; }
static inline bool pol_linked(const pol_node *n) { return n->next != NULL; }
static inline pol_node *pol_list_tail(pol_node *h) { return h->prev == h ? NULL : h->prev; }
static inline pol_node *pol_list_head(pol_node *h) { return h->next == h ? NULL : h->next; }

static inline void pol_unlink(pol_node *n) {
  n->prev->next = n->next;
  n->next->prev = n->prev;
  n->prev = n->next = NULL;
}

/* Drop a pinned item for good (on_remove DROP) in a policy that keeps pinned
 * items in place in its ring or queue: unlink it if it still holds a place,
 * counting it out of *n_pinned, and clear the pin. */
static inline void pol_drop_pinned(pol_node *n, uint8_t *pinned, uint64_t *n_pinned) {
  if (pol_linked(n)) {
    pol_unlink(n);
    (*n_pinned)--;
  }
  *pinned = 0;
}

/* Insert n between a and b (a->next == b). */
static inline void pol_link_between(pol_node *n, pol_node *a, pol_node *b) {
  n->prev = a;
  n->next = b;
  a->next = n;
  b->prev = n;
}

/* Newest end. Note the sentinel's next is the head: head-side insertion goes
 * right after the sentinel. */
static inline void pol_push_head(pol_node *h, pol_node *n) { pol_link_between(n, h, h->next); }
/* Oldest end: the next one out. */
static inline void pol_push_tail(pol_node *h, pol_node *n) { pol_link_between(n, h->prev, h); }

/* Put n where old is, unlinking old (a pinned item's place handed back). */
static inline void pol_replace(pol_node *old, pol_node *n) {
  pol_link_between(n, old->prev, old->next);
  old->prev = old->next = NULL;
}

/* Move every node of src to the head end of dst (src's order kept); src ends empty. */
static inline void pol_splice_head(pol_node *dst, pol_node *src) {
  if (pol_list_empty(src)) return;
  pol_node *first = src->next, *last = src->prev;
  last->next = dst->next;
  dst->next->prev = last;
  dst->next = first;
  first->prev = dst;
  pol_list_init(src);
}

/* Walk a list checking its links; counts nodes into *n. */
static inline bool pol_list_valid(const pol_node *h, size_t *n) {
  size_t k = 0;
  const pol_node *p = h;
  do {
    if (!p->next || !p->prev || p->next->prev != p || p->prev->next != p) return false;
    p = p->next;
    if (++k > ((size_t)1 << 40)) return false; /* a cycle not through the sentinel */
  } while (p != h);
  if (n) *n = k - 1;
  return true;
}

/* ------------------------------------------------------------------------ */
/* Ghosts: ids of evicted buffers (the buffers live on in lower tiers). Found
 * by id through a chained hash table; kept in lists of the policy's choosing
 * through `link`. Entries come from chunks of 64 and are recycled; a failed
 * allocation just means the ghost is not recorded. A policy that keeps more
 * per ghost (LIRS: its place in the stack S) makes each entry a struct that
 * starts with a pol_ghost and says its size to pol_ghosts_init_ex. */

typedef struct pol_ghost {
  uint64_t id;              /* the buffer's sgm_policy_item.id */
  uint64_t size_bytes;      /* its size when evicted */
  pol_node link;            /* in one of the policy's ghost lists */
  struct pol_ghost *hnext;  /* hash chain; on the free list: next free entry */
  int tag;                  /* which ghost list (the policy's numbering) */
} pol_ghost;

/* Ghost entries are allocated 64 at a time (about 3.5 KiB): few mallocs under
 * the placement lock, little waste for a tier that evicts rarely. */
enum { POL_GHOST_CHUNK = 64 };

typedef struct pol_ghost_chunk {
  struct pol_ghost_chunk *next;      /* all chunks, freed at fini */
  pol_ghost e[];                     /* POL_GHOST_CHUNK entries of entry_bytes each */
} pol_ghost_chunk;

typedef struct pol_ghosts {
  pol_ghost **bucket;      /* 2^shift chains */
  unsigned shift;          /* log2 of the bucket count */
  size_t n;                /* entries in the table */
  pol_ghost *free_list;    /* recycled entries */
  pol_ghost_chunk *chunks; /* every chunk allocated */
  size_t entry_bytes;      /* one entry: sizeof(pol_ghost), or the policy's struct that starts
                              with one (a multiple of pol_ghost's alignment) */
} pol_ghosts;

static inline size_t pol_ghost_hash(const pol_ghosts *g, uint64_t id) {
  return (size_t)((id * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - g->shift));
}

/* An empty table whose entries are entry_bytes long, each starting with a
 * pol_ghost; false when out of memory. */
static inline bool pol_ghosts_init_ex(pol_ghosts *g, size_t entry_bytes) {
  memset(g, 0, sizeof *g);
  g->shift = 6;
  g->entry_bytes = entry_bytes;
  g->bucket = (pol_ghost **)calloc((size_t)1 << g->shift, sizeof *g->bucket);
  return g->bucket != NULL;
}

static inline bool pol_ghosts_init(pol_ghosts *g) { return pol_ghosts_init_ex(g, sizeof(pol_ghost)); }

static inline void pol_ghosts_fini(pol_ghosts *g) {
  while (g->chunks) {
    pol_ghost_chunk *c = g->chunks;
    g->chunks = c->next;
    free(c);
  }
  free(g->bucket);
  memset(g, 0, sizeof *g);
}

static inline pol_ghost *pol_ghosts_find(const pol_ghosts *g, uint64_t id) {
  for (pol_ghost *e = g->bucket[pol_ghost_hash(g, id)]; e; e = e->hnext)
    if (e->id == id) return e;
  return NULL;
}

/* Double the table when it is as full as it has buckets: O(1) amortised. */
static inline void pol_ghosts_grow(pol_ghosts *g) {
  if (g->n < ((size_t)1 << g->shift) || g->shift >= 40) return;
  unsigned shift = g->shift + 1;
  pol_ghost **nb = (pol_ghost **)calloc((size_t)1 << shift, sizeof *nb);
  if (!nb) return; /* longer chains, still correct */
  size_t old_n = (size_t)1 << g->shift;
  pol_ghost **ob = g->bucket;
  g->bucket = nb;
  g->shift = shift;
  for (size_t i = 0; i < old_n; i++) {
    pol_ghost *e = ob[i];
    while (e) {
      pol_ghost *nx = e->hnext;
      size_t h = pol_ghost_hash(g, e->id);
      e->hnext = nb[h];
      nb[h] = e;
      e = nx;
    }
  }
  free(ob);
}

/* A new entry for id (not already present), unlinked from any list; NULL when
 * out of memory. */
static inline pol_ghost *pol_ghosts_add(pol_ghosts *g, uint64_t id, uint64_t size_bytes, int tag) {
  if (!g->free_list) {
    pol_ghost_chunk *c = (pol_ghost_chunk *)malloc(sizeof *c + POL_GHOST_CHUNK * g->entry_bytes);
    if (!c) return NULL;
    c->next = g->chunks;
    g->chunks = c;
    for (int i = POL_GHOST_CHUNK - 1; i >= 0; i--) {
      pol_ghost *e = (pol_ghost *)(void *)((char *)c->e + (size_t)i * g->entry_bytes);
      e->hnext = g->free_list;
      g->free_list = e;
    }
  }
  pol_ghosts_grow(g);
  pol_ghost *e = g->free_list;
  g->free_list = e->hnext;
  e->id = id;
  e->size_bytes = size_bytes;
  e->tag = tag;
  e->link.prev = e->link.next = NULL;
  size_t h = pol_ghost_hash(g, id);
  e->hnext = g->bucket[h];
  g->bucket[h] = e;
  g->n++;
  return e;
}

/* Take e out of the table (the caller unlinks it from its list first). */
static inline void pol_ghosts_del(pol_ghosts *g, pol_ghost *e) {
  pol_ghost **pp = &g->bucket[pol_ghost_hash(g, e->id)];
  while (*pp != e) pp = &(*pp)->hnext;
  *pp = e->hnext;
  e->hnext = g->free_list;
  g->free_list = e;
  g->n--;
}

/* The ghost entry owning list node n. */
static inline pol_ghost *pol_ghost_of(pol_node *n) {
  return (pol_ghost *)(void *)((char *)n - offsetof(pol_ghost, link));
}

#endif /* SGM_POLICIES_COMMON_H */
