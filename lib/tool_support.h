/*
 * tool_support.h — the few libsgm internals that sgm's own tools (tools/:
 * sgm-smi) use besides the public API (include/sgm.h, include/sgm/node.h):
 * byte formatting, the library's monotonic clock and the admin policy's
 * registry folder, so that a tool shows bytes and time as the library does and
 * looks where the library writes. Tools include this header, never
 * internal.h; internal.h includes it, so each declaration exists once.
 * These are not public API: they link from the static library (libsgm.a) and
 * may change with the library.
 */
#ifndef SGM_TOOL_SUPPORT_H
#define SGM_TOOL_SUPPORT_H

#include <stddef.h>
#include <stdint.h>

/* error.c: format bytes for people, "1.50 GiB". buf of at least 32 bytes; returns buf. */
const char *sgm__fmt_bytes(uint64_t bytes, char *buf, size_t len);

/* prim/clock.c: CLOCK_MONOTONIC in nanoseconds. Any thread; never fails. */
uint64_t sgm__clock_monotonic_ns(void);

/* admin.c: the policy in force for this process (loaded once), and its
 * registry folder (NULL: none). */
typedef struct sgm_admin_policy sgm_admin_policy;
const sgm_admin_policy *sgm__admin_current(void);
const char *sgm__admin_registry_dir(const sgm_admin_policy *pol);

#endif
