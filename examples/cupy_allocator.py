#!/usr/bin/env python3
"""CuPy on sgm: arrays beyond the VRAM budget land in shared GPU memory.

Routes every CuPy device allocation through libsgm.so (cupy.cuda.set_allocator
with a function that calls sgm_torch_malloc through ctypes and hands CuPy an
UnownedMemory whose owner frees it with sgm_torch_free), allocates int32
arrays worth 1.5x the VRAM budget (SGM_VRAM_LIMIT, 1GiB unless set), computes
x*2+1 and a sum on each, checks the results against numpy, and prints where
the bytes landed and sgm's statistics.

    python3 examples/cupy_allocator.py [path/to/libsgm.so]

libsgm.so: argv[1], else $SGM_LIB, else ../build/release/lib/libsgm.so next to
this script, else the loader's search path (LD_LIBRARY_PATH, ldconfig).

Needs an NVIDIA GPU and CuPy; without them it prints "no GPU: skipping" and
exits 0. Unlike PyTorch, CuPy sees a failed allocation: the allocator below
raises MemoryError (and sgm prints one line on stderr saying why).
"""
import json
import os
import sys

from sgm_ctypes import MiB, TIERS, find_lib, load_sgm, skip, stats, task_manager, work_plan


class SgmBlock:
    """Owner of one sgm allocation: CuPy keeps it alive as long as the memory
    is in use (UnownedMemory's owner) and dropping it frees the block."""

    __slots__ = ("ptr", "size", "device", "stream", "_free")

    def __init__(self, lib, ptr, size, device, stream):
        self.ptr, self.size, self.device, self.stream = ptr, size, device, stream
        self._free = lib.sgm_torch_free  # held here: module globals may be gone at exit

    def __del__(self):
        self._free(self.ptr, self.size, self.device, self.stream)


def make_allocator(cupy, lib):
    def sgm_malloc(size):
        device = cupy.cuda.runtime.getDevice()
        if size == 0:  # as CuPy's own allocator: a null pointer for an empty array
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
        stream = cupy.cuda.get_current_stream().ptr or None
        ptr = lib.sgm_torch_malloc(size, device, stream)
        if not ptr:  # sgm printed one line on stderr saying why
            raise MemoryError(f"sgm could not allocate {size} bytes on device {device}")
        owner = SgmBlock(lib, ptr, size, device, stream)
        mem = cupy.cuda.UnownedMemory(ptr, size, owner, device)
        return cupy.cuda.MemoryPointer(mem, 0)
    return sgm_malloc


def main():
    try:
        import cupy
        import numpy as np
    except ImportError as e:
        skip(f"CuPy is not installed: {e}")
    try:
        n_devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device: CUDARuntimeError
        skip(f"CUDA: {e}")
    if n_devices == 0:
        skip("no CUDA device")

    # Before libsgm.so reads its environment (the first hook call).
    os.environ.setdefault("SGM_VRAM_LIMIT", "1GiB")
    if os.environ.get("SGM_BACKEND", "cuda") != "cuda":
        print(f"SGM_BACKEND={os.environ['SGM_BACKEND']} cannot serve CuPy's kernels: using cuda")
    os.environ["SGM_BACKEND"] = "cuda"

    path = find_lib()
    lib = load_sgm(path)
    # Before any allocation; CuPy's default memory pool is replaced, so sgm
    # sees (and can place) every allocation.
    cupy.cuda.set_allocator(make_allocator(cupy, lib))
    print(f"CuPy {cupy.__version__}: device allocations go through {path}")

    device = 0
    cupy.cuda.Device(device).use()
    ctx = lib.sgm_hook_context(device)  # sgm printed why if this is NULL
    if not ctx:
        return 1
    budget = stats(lib, ctx)["tiers"]["vram"]["budget_bytes"]
    block, n_blocks, n = work_plan(budget)
    print(f"VRAM budget {budget / MiB:.1f} MiB: {n_blocks} int32 arrays of {block / MiB:.1f} MiB "
          f"= 1.5x the budget")

    arrays = []
    for i in range(n_blocks):
        x = cupy.arange(n, dtype=cupy.int32)
        x %= 1024
        x += i
        arrays.append(x)
    landed = {}
    for x in arrays:
        tier = TIERS.get(lib.sgm_pointer_tier(ctx, x.data.ptr), "?")
        landed[tier] = landed.get(tier, 0) + x.nbytes
    print("where the bytes landed: " +
          ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in sorted(landed.items())))
    task_manager(stats(lib, ctx), "with all arrays live")

    # Compute on every array, VRAM and shared alike, and check against numpy.
    ok = True
    base = np.arange(n, dtype=np.int64) % 1024
    for i, x in enumerate(arrays):
        x *= 2
        x += 1
        got = int(x.sum(dtype=cupy.int64))
        want_all = (base + i) * 2 + 1
        want = int(want_all.sum())
        same = (np.array_equal(cupy.asnumpy(x[:4096]), want_all[:4096]) and
                np.array_equal(cupy.asnumpy(x[-4096:]), want_all[-4096:]))
        if got != want or not same:
            print(f"array {i}: sum {got}, numpy says {want}; elements match: {same}")
            ok = False
    cupy.cuda.get_current_stream().synchronize()
    print(f"x*2+1 and sum on {n_blocks} arrays: {'match numpy' if ok else 'MISMATCH'}")

    st = stats(lib, ctx)
    print("sgm stats:", json.dumps(st, indent=2))
    del arrays, x
    cupy.cuda.Device(device).synchronize()
    lib.sgm_torch_empty_cache()
    task_manager(stats(lib, ctx), "after freeing the arrays and sgm_torch_empty_cache")
    if landed.get("shared", 0) == 0:
        print("nothing landed in shared GPU memory: is SGM_SHARED_FALLBACK off, or the budget "
              "larger than expected?")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
