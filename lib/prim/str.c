/*
 * prim/str.c — string helpers more than one layer needs: the ASCII
 * case-insensitive compare that option values (options.c) and policy names
 * (policy.c, below options) both use. Here, below both, so that the policy
 * registry does not call up into the option parser (issue 31).
 * Threading: any thread; no state. Calls: libc only.
 */
#include <ctype.h>

#include "internal.h"

bool sgm__str_ieq(const char *a, const char *b) {
  for (; *a && *b; a++, b++)
    if (tolower((unsigned char)*a) != tolower((unsigned char)*b)) return false;
  return *a == *b;
}
