#!/usr/bin/env python3
"""smoke.py — libsgm.so opens the real device: a context, a 64 MiB allocation
that lands in VRAM (tier 0) on an idle GPU, its statistics, a free.

    python3 smoke.py path/to/libsgm.so      (SGM_BACKEND=cuda)"""
import ctypes
import sys


def main():
    lib = ctypes.CDLL(sys.argv[1])
    c = ctypes
    lib.sgm_last_error.restype = c.c_char_p
    lib.sgm_alloc.restype = c.c_void_p
    lib.sgm_alloc.argtypes = [c.c_void_p, c.c_size_t, c.c_void_p]
    lib.sgm_free.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p]
    lib.sgm_pointer_tier.argtypes = [c.c_void_p, c.c_void_p]
    lib.sgm_context_create.argtypes = [c.c_void_p, c.POINTER(c.c_void_p)]
    lib.sgm_context_destroy.argtypes = [c.c_void_p]
    ctx = c.c_void_p()
    rc = lib.sgm_context_create(None, c.byref(ctx))
    if rc != 0:
        sys.exit(f"sgm_context_create on the real device failed: {rc} {lib.sgm_last_error().decode()}")
    p = lib.sgm_alloc(ctx, 64 << 20, None)
    if not p:
        sys.exit("sgm_alloc(64 MiB) failed: " + lib.sgm_last_error().decode())
    tier = lib.sgm_pointer_tier(ctx, p)
    lib.sgm_free(ctx, p, None)
    lib.sgm_context_destroy(ctx)
    if tier != 0:
        sys.exit(f"a 64 MiB allocation on an idle GPU should be in VRAM (tier 0), got {tier}")
    print("key: 64 MiB in VRAM, freed, context destroyed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
