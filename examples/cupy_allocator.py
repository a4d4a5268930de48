#!/usr/bin/env python3
"""CuPy on sgm: arrays beyond the VRAM budget land in shared GPU memory.

sgm.cupy.use() makes sgm CuPy's device allocator; the script allocates int32
arrays worth 1.5x the VRAM budget (SGM_VRAM_LIMIT, 1GiB unless set), computes
x*2+1 and a sum on each, checks them against NumPy, and prints where the bytes
landed and sgm's statistics.

    python3 examples/cupy_allocator.py [path/to/libsgm.so]

The sgm package: installed (cmake --install), or PYTHONPATH=<source>/python.
libsgm.so: argv[1], else as the package finds it (docs/python.md). Needs an
NVIDIA GPU and CuPy; without CuPy it prints "CuPy is not installed: skipping", without a GPU "no GPU: skipping", and exits 0.
Unlike PyTorch, CuPy sees a failed allocation: sgm.NoMemoryError (a MemoryError).
"""
import importlib.util
import os
import sys

MiB = 1 << 20
if len(sys.argv) > 1:
    os.environ["SGM_LIBRARY"] = os.path.abspath(sys.argv[1])
import sgm  # noqa: E402
import sgm.cupy  # noqa: E402


def main():
    if importlib.util.find_spec("cupy") is None:
        print("CuPy is not installed: skipping (pip install cupy, or your distribution's package)")
        return 0
    try:
        sgm.cupy.use(vram_limit=os.environ.get("SGM_VRAM_LIMIT", "1GiB"))
    except sgm.UnsupportedError as e:
        print(f"no GPU: skipping ({e.message})")
        return 0
    import cupy
    import numpy as np
    print(f"CuPy {cupy.__version__}: device allocations go through {sgm.library_path()}")
    cupy.cuda.Device(0).use()  # CUDA initialised by CuPy before sgm opens device 0

    budget = sgm.stats(0)["tiers"]["vram"]["budget_bytes"]
    n = (budget // 8) // 4          # int32 elements per array: 1/8 of the budget
    count = 12                      # 12 x 1/8 = 1.5x the budget
    print(f"VRAM budget {budget / MiB:.1f} MiB: {count} int32 arrays of {n * 4 / MiB:.1f} MiB")
    arrays, landed = [], {}
    for i in range(count):
        x = cupy.arange(n, dtype=cupy.int32)
        x %= 1024
        x += i
        arrays.append(x)
    for x in arrays:
        tier = sgm.pointer_tier(x.data.ptr).name.lower()
        landed[tier] = landed.get(tier, 0) + x.nbytes
    print("where the bytes landed: " + ", ".join(f"{k} {v / MiB:.1f} MiB"
                                                 for k, v in sorted(landed.items())))

    ok = True
    base = np.arange(n, dtype=np.int64) % 1024
    for i, x in enumerate(arrays):
        x *= 2
        x += 1
        want = (base + i) * 2 + 1
        if int(x.sum(dtype=cupy.int64)) != int(want.sum()) or \
                not np.array_equal(cupy.asnumpy(x[-4096:]), want[-4096:]):
            print(f"array {i}: wrong result")
            ok = False
    cupy.cuda.get_current_stream().synchronize()
    print(f"x*2+1 and sum on {count} arrays: {'match numpy' if ok else 'MISMATCH'}")
    st = sgm.stats(0)
    print(f"VRAM used {st['tiers']['vram']['used_bytes'] / MiB:.1f} MiB, shared used "
          f"{st['tiers']['shared']['used_bytes'] / MiB:.1f} MiB, fallbacks {st['n_fallbacks']}")
    del arrays, x
    cupy.cuda.Device().synchronize()
    sgm.cupy.empty_cache()
    print(f"after empty_cache: VRAM committed "
          f"{sgm.stats(0)['tiers']['vram']['committed_bytes'] / MiB:.1f} MiB")
    if not landed.get("shared"):
        print("nothing landed in shared GPU memory: is SGM_SHARED_FALLBACK off?")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
