/*
 * policy.c — the registry of eviction policies (include/sgm/policy.h).
 *
 * A fixed table of SGM_POLICY_REGISTRY_MAX vtable pointers, process-wide. The
 * built-ins (policies/) are put in first, in a fixed order, the first time
 * anything looks at the registry; programs add theirs with
 * sgm_policy_register(). Entries are never removed, so a pointer handed out
 * stays valid and an index keeps meaning the same policy.
 *
 * Older plug-ins load (the way SQLite keeps its VFS versions): a vtable built
 * for any ABI from 1 up to SGM_POLICY_ABI_VERSION is accepted. One built for
 * the current ABI is used in place; an older one is copied, only as many
 * bytes as its version had, into a current-sized vtable the registry owns,
 * with the members its version predates left NULL: absent, as the optional
 * members they all are. sgm never reads past the end of a caller's vtable.
 *
 * Invariants: every entry passed policy_validate(); names are unique ignoring
 * case; "all", "opt" and "opt-admit" are reserved (the trace replayer's
 * words for "every policy" and Belady's optimum with and without bypass).
 *
 * Threading: one lock (rank SGM_LOCK_REGISTRY, a leaf) guards the table; it is held only to read or append,
 * never while calling into a policy. This and the driver table are the
 * library's only process-wide mutable state.
 */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "builtin.h"
#include "internal.h"

static sgm_lock registry_mu = SGM_LOCK_INITIALIZER(SGM_LOCK_REGISTRY);
static const sgm_policy_ops *registry[SGM_POLICY_REGISTRY_MAX]; /* registered, in order */
static size_t registry_n;                                        /* entries used */
static bool registry_seeded;                                     /* built-ins are in */

static const sgm_policy_ops *const builtins[] = {
    &sgm__policy_lru, &sgm__policy_clock, &sgm__policy_lfu,
    &sgm__policy_arc, &sgm__policy_s3fifo, &sgm__policy_tinylfu, &sgm__policy_lirs,
};

static const char *const reserved_names[] = {"all", "opt", "opt-admit"};

/* Upgraded copies of older plug-ins' vtables; registry points at them. */
static sgm_policy_ops registry_upgraded[SGM_POLICY_REGISTRY_MAX];

/* The bytes of sgm_policy_ops that ABI version abi defines; 0 for a version
 * this library does not know. Each version only appended members. */
static size_t policy_ops_bytes(uint32_t abi) {
  switch (abi) {
    case 1: return offsetof(sgm_policy_ops, record);
    case 2: return offsetof(sgm_policy_ops, promote_before);
    case 3: return offsetof(sgm_policy_ops, on_hint);
    case 4: return sizeof(sgm_policy_ops);
    default: return 0;
  }
}

/* Index of name in the registry, or -1 (registry_mu held). */
static long registry_find_locked(const char *name) {
  for (size_t i = 0; i < registry_n; i++)
    if (sgm__str_ieq(registry[i]->name, name)) return (long)i;
  return -1;
}

/* Everything but the table: a complete, well-formed vtable. */
static int policy_validate(const sgm_policy_ops *ops) {
  if (!ops) return sgm__error_set(SGM_ERR_INVALID, "sgm_policy_register: ops is NULL");
  if (ops->abi_version < 1 || ops->abi_version > SGM_POLICY_ABI_VERSION)
    return sgm__error_set(SGM_ERR_INVALID, "sgm_policy_register: the policy was built for plug-in ABI "
                          "version %u, this library speaks versions 1 to %u (rebuild it against this "
                          "sgm/policy.h)", ops->abi_version, SGM_POLICY_ABI_VERSION);
  if (!ops->name) return sgm__error_set(SGM_ERR_INVALID, "sgm_policy_register: member name is NULL");
  size_t len = strnlen(ops->name, SGM_NAME_MAX);
  if (len == 0 || len >= SGM_NAME_MAX)
    return sgm__error_set(SGM_ERR_INVALID, "sgm_policy_register: name must have 1 to %d characters",
                          SGM_NAME_MAX - 1);
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)ops->name[i];
    if (!(isalnum(c) || c == '_' || c == '-'))
      return sgm__error_set(SGM_ERR_INVALID, "sgm_policy_register: name \"%s\" may only hold letters, "
                            "digits, '_' and '-'", ops->name);
  }
  const char *missing = !ops->create              ? "create"
                        : !ops->destroy           ? "destroy"
                        : !ops->on_insert         ? "on_insert"
                        : !ops->on_access         ? "on_access"
                        : !ops->on_remove         ? "on_remove"
                        : !ops->reclaimable_bytes ? "reclaimable_bytes"
                        : !ops->next_victim       ? "next_victim"
                                                  : NULL;
  if (missing)
    return sgm__error_set(SGM_ERR_INVALID, "sgm_policy_register: policy \"%s\" lacks member %s "
                          "(every member but summary, check, record, admit, promote_before and on_hint is required)", ops->name, missing);
  if (ops->state_bytes > SGM_POLICY_STATE_MAX)
    return sgm__error_set(SGM_ERR_INVALID, "sgm_policy_register: policy \"%s\" asks for %zu bytes of "
                          "state per buffer; at most %u", ops->name, ops->state_bytes,
                          SGM_POLICY_STATE_MAX);
  for (size_t i = 0; i < sizeof reserved_names / sizeof reserved_names[0]; i++)
    if (sgm__str_ieq(ops->name, reserved_names[i]))
      return sgm__error_set(SGM_ERR_INVALID, "sgm_policy_register: the name \"%s\" is reserved",
                            ops->name);
  return SGM_OK;
}

/* Append ops (registry_mu held; validated): in place when it speaks the
 * current ABI, else as an upgraded copy. */
static int registry_add_locked(const sgm_policy_ops *ops) {
  if (registry_find_locked(ops->name) >= 0)
    return sgm__error_set(SGM_ERR_INVALID, "sgm_policy_register: a policy named \"%s\" is already "
                          "registered", ops->name);
  if (registry_n == SGM_POLICY_REGISTRY_MAX)
    return sgm__error_set(SGM_ERR_NOMEM, "sgm_policy_register: the registry is full (%u policies)",
                          SGM_POLICY_REGISTRY_MAX);
  if (ops->abi_version != SGM_POLICY_ABI_VERSION) {
    sgm_policy_ops *up = &registry_upgraded[registry_n];
    memset(up, 0, sizeof *up);
    memcpy(up, ops, policy_ops_bytes(ops->abi_version));
    up->abi_version = SGM_POLICY_ABI_VERSION;
    ops = up;
  }
  registry[registry_n++] = ops;
  return SGM_OK;
}

/* Put the built-ins in on first use (registry_mu held). */
static void registry_seed_locked(void) {
  if (registry_seeded) return;
  registry_seeded = true;
  for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++) {
    int rc = policy_validate(builtins[i]);
    if (rc == SGM_OK) rc = registry_add_locked(builtins[i]);
    sgm_assert(rc == SGM_OK); /* a malformed built-in is a bug */
    (void)rc;
  }
}

SGM_API sgm_status sgm_policy_register(const sgm_policy_ops *ops) {
  int rc = policy_validate(ops);
  if (rc != SGM_OK) return (sgm_status)rc;
  sgm__lock_take(&registry_mu);
  registry_seed_locked();
  rc = registry_add_locked(ops);
  sgm__lock_drop(&registry_mu);
  return (sgm_status)rc;
}

SGM_API const sgm_policy_ops *sgm_policy_find(const char *name) {
  if (!name) return NULL;
  sgm__lock_take(&registry_mu);
  registry_seed_locked();
  long i = registry_find_locked(name);
  const sgm_policy_ops *ops = i >= 0 ? registry[i] : NULL;
  sgm__lock_drop(&registry_mu);
  return ops;
}

SGM_API size_t sgm_policy_count(void) {
  sgm__lock_take(&registry_mu);
  registry_seed_locked();
  size_t n = registry_n;
  sgm__lock_drop(&registry_mu);
  return n;
}

SGM_API const sgm_policy_ops *sgm_policy_at(size_t i) {
  sgm__lock_take(&registry_mu);
  registry_seed_locked();
  const sgm_policy_ops *ops = i < registry_n ? registry[i] : NULL;
  sgm__lock_drop(&registry_mu);
  return ops;
}
