/*
 * sgm/policy.h — the plug-in interface for eviction policies.
 *
 * A policy decides which released buffer leaves a resident tier (VRAM or
 * shared memory) when something new needs room. sgm makes one *instance* of
 * the chosen policy per (tier, priority level): buffers of a lower
 * sgm_priority always leave first, and within a level the policy chooses.
 * The built-ins (lru, clock, lfu, arc, s3fifo, tinylfu, lirs) live in policies/ and use
 * nothing but this header; a program adds its own with sgm_policy_register()
 * and selects it by name (SGM_POLICY, SGM_POLICY_VRAM, SGM_POLICY_SHARED).
 * Longer prose, with a worked example: docs/policies.md.
 *
 * What a policy sees. Every buffer that is *released*, *resident* in the
 * instance's tier and *movable* is an item of exactly one instance. Acquired
 * buffers, buffers being copied or moved, and buffers on disk are not: an item
 * goes out with on_remove(PIN) before it is used and comes back afterwards.
 * next_victim() therefore never offers a buffer that is in use.
 *
 * Two optional members let a policy see beyond its items: record() hears of
 * every acquire of every buffer, resident in the tier or not (a frequency
 * sketch counts there), and admit() may refuse to evict for a newcomer to the
 * VRAM tier, which then lives in shared memory instead (an admission policy:
 * W-TinyLFU in policies/tinylfu.c).
 *
 * The contract, for every method but create and destroy:
 *  - It runs under its tier's residency lock (one lock per resident tier of a
 *    context: residency.c's pl->res[t], ranks SGM_LOCK_RES_VRAM and
 *    SGM_LOCK_RES_SHARED; "the tier lock" for buffers). Calls on one instance
 *    are never concurrent; calls on different instances (tiers, contexts) may
 *    be, and the VRAM and shared-memory instances of one context are.
 *  - It must not block (no sleeping, no I/O, no waiting on other threads), must
 *    not call back into sgm, and should be O(1) (next_victim O(1) amortised):
 *    acquire of a VRAM-resident buffer costs about 100 ns in all, policy included.
 *  - It must not fail: a policy that cannot allocate (a ghost entry, say)
 *    degrades its choices, never its contract.
 *
 * C11 and C++17 clean. Fields are only ever added at the end of the structs;
 * an incompatible change bumps SGM_POLICY_ABI_VERSION, and a vtable built for
 * another version is refused at registration.
 */
#ifndef SGM_POLICY_H
#define SGM_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <sgm.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The plug-in ABI this header describes. A vtable built for any version from
 * 1 up to this one loads; the members its version predates count as absent.
 * Version 2 added record and admit at the end of sgm_policy_ops, version 3
 * promote_before, version 4 the residency hints (on_hint, and hint,
 * will_use_distance and parent at the end of sgm_policy_item). */
#define SGM_POLICY_ABI_VERSION 4u

/* sgm_policy_item.hint: what the application said about the buffer
 * (sgm_will_use, sgm_buffer_done; docs/policies.md "Residency hints"). Both
 * end at the buffer's next use (acquire, host read or write): a hint is about
 * the use to come. */
#define SGM_POLICY_HINT_WILL_USE 1u /* expected after about will_use_distance steps: keep it */
#define SGM_POLICY_HINT_DONE 2u     /* not read again soon: first out */

/* The most per-buffer state a policy may ask for. Every buffer carries it
 * inline, sized for the larger of its context's two policies: 256 bytes is
 * four cache lines, eight times what a built-in needs (at most 32). */
#define SGM_POLICY_STATE_MAX 256u

/* How many policies the registry holds, built-ins included: a fixed table, so
 * lookups never race with a reallocation; 32 leaves 27 for programs. */
#define SGM_POLICY_REGISTRY_MAX 32u

/* One instance of a policy: the policy's own type, opaque to sgm. */
typedef struct sgm_policy sgm_policy;

/*
 * A buffer as a policy sees it. sgm owns it; the policy reads id, size_bytes
 * and priority and owns the bytes at state. The struct lives inside the buffer,
 * so its address is stable for the buffer's whole life and a policy may link
 * items through their state (intrusive lists).
 */
typedef struct sgm_policy_item {
  uint64_t id;         /* unique in the context for the buffer's life, never reused: ghosts key on it */
  uint64_t size_bytes; /* the buffer's size in bytes; constant */
  int priority;        /* sgm_priority; constant while the item is in (or pinned by) an instance */
  void *state;         /* state_bytes bytes for the policy, 16-byte aligned; NULL if state_bytes == 0 */
  /* ---- ABI version 4: residency hints (read-only for the policy) ---- */
  uint32_t hint;              /* SGM_POLICY_HINT_* in force (0: none) */
  uint32_t will_use_distance; /* with SGM_POLICY_HINT_WILL_USE: the distance given (steps ahead) */
  /* The parent (prefix) buffer's item when the application named one
   * (sgm_buffer_set_parent) and it is an item of this same instance now
   * (listed, not pinned); else NULL. Set by sgm just before on_insert,
   * on_access and on_hint; valid for that call only. */
  struct sgm_policy_item *parent;
} sgm_policy_item;

/* Why an item leaves an instance (on_remove). */
typedef enum sgm_policy_remove {
  /*
   * Out for a while: it is being acquired, copied, moved, or was skipped as a
   * victim (GPU work still pending on it). The policy must not offer it from
   * next_victim and must keep what it needs in the item's state; it may leave
   * the state linked in its own structures (the memory stays valid). Exactly
   * one of on_access, on_insert(RESTORE) or on_remove(DROP) ends the pin.
   */
  SGM_POLICY_REMOVE_PIN = 0,
  /* The victim next_victim just returned leaves the tier (it is demoted, not
   * freed, so it may come back: remember its id as a ghost if useful). */
  SGM_POLICY_REMOVE_EVICT = 1,
  /* Gone for good, without eviction: destroyed, moved by sgm_buffer_evict or a
   * prefetch, its priority changed, or a pin ends without it coming back.
   * The item may be in the structures or pinned. Forget it. */
  SGM_POLICY_REMOVE_DROP = 2
} sgm_policy_remove;

/* How an item enters an instance (on_insert). */
typedef enum sgm_policy_insert {
  /* New to this instance: created in the tier, or moved into it (promoted,
   * demoted, prefetched), or back after on_remove(DROP). The state holds
   * garbage; the policy may look the id up among its ghosts. */
  SGM_POLICY_INSERT_NEW = 0,
  /* Back from on_remove(PIN) without being used (a skipped victim, a move that
   * did not happen): put it back as if it had never left, or at the eviction
   * end when its place is lost. Not a hit. */
  SGM_POLICY_INSERT_RESTORE = 1
} sgm_policy_insert;

/* What create gets. */
typedef struct sgm_policy_params {
  uint32_t abi_version;    /* SGM_POLICY_ABI_VERSION of the caller */
  sgm_tier tier;           /* the tier this instance serves: SGM_TIER_VRAM or SGM_TIER_SHARED */
  int priority;            /* the priority level it serves (one instance per level) */
  uint64_t capacity_bytes; /* the tier's budget: the most its items can ever add up to (ARC's c) */
  /* The instance's only clock: monotonic nanoseconds. Tests pass a fake one;
   * sgm passes its context clock. Callable from every method but destroy. */
  uint64_t (*clock_ns)(void *clock_user);
  void *clock_user; /* argument of clock_ns */
} sgm_policy_params;

/*
 * The vtable. Every member must be set except the optional `summary`,
 * `check`, `record`, `admit`, `promote_before` and `on_hint`;
 * sgm_policy_register names the first required one missing.
 */
typedef struct sgm_policy_ops {
  uint32_t abi_version; /* the SGM_POLICY_ABI_VERSION it was built with (1 up to this one) */
  const char *name;     /* [a-z0-9_-], 1 to SGM_NAME_MAX - 1 characters; matched ignoring case */
  const char *summary;  /* one line for listings; may be NULL */
  size_t state_bytes;   /* per-buffer state, at most SGM_POLICY_STATE_MAX; 0 allowed */

  /* Make an instance. Not under any sgm lock; may allocate. SGM_OK and *out,
   * or an error status (*out NULL). */
  sgm_status (*create)(const sgm_policy_params *params, sgm_policy **out);
  /* Free an instance. Items may still be in it or pinned: do not touch them
   * (their buffers are being freed); free only what the instance allocated. */
  void (*destroy)(sgm_policy *p);

  /* `it` enters the instance (see sgm_policy_insert). */
  void (*on_insert)(sgm_policy *p, sgm_policy_item *it, sgm_policy_insert how);
  /* `it`, pinned since on_remove(PIN), is back after being used (acquired and
   * released, or read or written by the host): a hit. */
  void (*on_access)(sgm_policy *p, sgm_policy_item *it);
  /* `it` leaves the instance (see sgm_policy_remove). */
  void (*on_remove)(sgm_policy *p, sgm_policy_item *it, sgm_policy_remove why);

  /* The sum of size_bytes of the items in the instance (pinned ones excluded). */
  uint64_t (*reclaimable_bytes)(const sgm_policy *p);
  /*
   * The item to evict next, to make room for a request of bytes_wanted (a
   * hint: sgm calls again, after each eviction, until the request fits, so a
   * big request takes several small victims). Returns NULL only when the
   * instance holds no item. Must not remove the item: sgm follows with
   * on_remove(EVICT), or on_remove(PIN) when it cannot move it now and then
   * asks again. May reorganise the instance (advance a clock hand, move items
   * between queues); O(1) amortised.
   */
  sgm_policy_item *(*next_victim)(sgm_policy *p, uint64_t bytes_wanted);

  /* Optional: walk the whole instance and check its invariants; SGM_OK, or
   * SGM_ERR_CORRUPT with a message in why. Tests and debug builds call it. */
  sgm_status (*check)(const sgm_policy *p, char *why, size_t why_len);

  /* ---- ABI version 2 ---- */

  /*
   * Optional (NULL: nothing is counted). The buffer whose item id is `id` is
   * being acquired: called once per sgm_buffer_acquire, before sgm decides
   * where the buffer goes, whether it is resident in this tier, in another
   * one, or not an item anywhere (hit or miss alike; host reads and writes are
   * not counted). Sent to the instance of the buffer's priority level in each
   * tier whose policy has the member. The id may belong to no item of this
   * instance: count it, never look for its state. Same contract as the other
   * methods (under the placement lock, O(1), must not block or fail); it is
   * on the path of every acquire, so keep it to a few memory accesses.
   */
  void (*record)(sgm_policy *p, uint64_t id);
  /*
   * Optional (NULL: always admit). sgm is about to evict `victim` (just
   * returned by next_victim, idle, not yet removed) to make room in the VRAM
   * tier for `candidate`: a buffer being created there, or promoted there by
   * an acquire or a prefetch. true: evict as usual. false: sgm evicts nothing
   * more for this candidate and it lands one tier down (create: in shared
   * memory; acquire: it stays in, or comes to, shared memory and is used
   * there; prefetch: it stays where it is); the victim stays an item, untouched
   * (no on_remove follows). candidate is sgm's copy: id, size_bytes and
   * priority are the buffer's, state is NULL (the buffer is no item of this
   * instance, or the state belongs to its tier's policy). Asked once per
   * victim (a big candidate may be refused after some victims already left).
   * Asked of the victim's priority level, and only when the candidate's
   * priority is not above the victim's: a higher-priority candidate is always
   * admitted. Never asked for plain sgm_alloc allocations, for demotions, nor
   * by the shared tier (a buffer coming up from disk must be resident
   * somewhere). Same contract as the other methods; it may reorganise the
   * instance as next_victim may, but must not remove the victim.
   */
  bool (*admit)(sgm_policy *p, const sgm_policy_item *candidate, const sgm_policy_item *victim);

  /* ---- ABI version 3 ---- */

  /*
   * Optional (NULL: sgm's own order, the block most recently allocated, hinted
   * hot or prefetched to VRAM first). VRAM room has appeared and movable
   * blocks (SGM_POINTERS=managed, docs/managed.md) wait in shared memory:
   * should `a` come back into VRAM before `b`? sgm keeps the block no other
   * is asked to come before, and promotes it first. Asked of the VRAM tier's
   * instance of the blocks' priority level, and only for two blocks of the
   * same level (a higher level always comes back first). a and b are sgm's
   * copies, as admit's candidate: id, size_bytes and priority, state NULL
   * (the blocks are items of the shared tier's policy, not of this instance).
   * Answer as a strict order (false for a block and itself). Same contract as
   * the other methods; it must not reorganise the instance.
   */
  bool (*promote_before)(sgm_policy *p, const sgm_policy_item *a, const sgm_policy_item *b);

  /* ---- ABI version 4 ---- */

  /*
   * Optional (NULL: hints are ignored; the item fields still say them). The
   * hints of `it`, an item of this instance (listed, not pinned), changed:
   * it->hint and it->will_use_distance hold the new ones (0: cancelled). A
   * pinned item's hints may change too, without a call: read them when it
   * comes back (on_access, on_insert). it->parent as in sgm_policy_item.
   * Same contract as the other methods.
   */
  void (*on_hint)(sgm_policy *p, sgm_policy_item *it);
} sgm_policy_ops;

/*
 * Add a policy to the process-wide registry, so that SGM_POLICY and the config
 * can name it. ops (and the strings it points to) must outlive every context
 * using it; sgm keeps the pointer (a vtable of an older ABI is copied, and
 * sgm_policy_find then returns the copy). Refused with SGM_ERR_INVALID and a
 * message (sgm_last_error) when ops is NULL, its abi_version is 0 or above
 * SGM_POLICY_ABI_VERSION, a member is missing (the message names it), the
 * name is malformed, reserved ("all", "opt", "opt-admit") or already registered; with
 * SGM_ERR_NOMEM when the registry is full. Thread-safe; register before
 * creating the contexts that use it.
 */
SGM_API sgm_status sgm_policy_register(const sgm_policy_ops *ops);

/* The registered policy of that name (case ignored), NULL if none. Thread-safe. */
SGM_API const sgm_policy_ops *sgm_policy_find(const char *name);

/* How many policies are registered (built-ins first, in this order: lru,
 * clock, lfu, arc, s3fifo, tinylfu), and the i-th of them (NULL past the end).
 * Thread-safe; the list only grows. */
SGM_API size_t sgm_policy_count(void);
SGM_API const sgm_policy_ops *sgm_policy_at(size_t i);

#ifdef __cplusplus
}
#endif

#endif /* SGM_POLICY_H */
