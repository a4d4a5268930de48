#!/usr/bin/env python3
"""probe.py — does a GPU answer? Run by run.sh before anything else.

Loads the real driver (libcuda.so.1) with ctypes, cuInit, counts devices and
reads device 0's name, total and free memory through its primary context.
Prints "gpu: ..." and "FREE_BYTES=<n>"; exits 77 when no GPU answers (no
driver library, sgm's driver test double instead of the driver, cuInit
failing, no device), 1 on an unexpected driver error, 0 otherwise.
GPU_CHECK_ALLOW_DOUBLE=1 accepts the double: only to try run.sh itself here."""
import ctypes
import os
import sys


def skip(why):
    print(f"no GPU: {why}")
    sys.exit(77)


def main():
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        skip(f"libcuda.so.1 cannot be loaded ({e})")
    if hasattr(cu, "fake_cuda_reset") and os.environ.get("GPU_CHECK_ALLOW_DOUBLE") != "1":
        skip("the libcuda.so.1 found is sgm's driver test double, not the driver")
    r = cu.cuInit(0)
    if r != 0:
        skip(f"cuInit failed with CUresult {r}")
    n = ctypes.c_int(0)
    if cu.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
        skip("the driver reports no device")
    dev = ctypes.c_int(0)
    name = ctypes.create_string_buffer(256)
    ctx = ctypes.c_void_p()
    free_b, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    steps = [
        ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(dev), 0)),
        ("cuDeviceGetName", lambda: cu.cuDeviceGetName(name, 256, dev)),
        ("cuDevicePrimaryCtxRetain", lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
        ("cuCtxPushCurrent", lambda: cu.cuCtxPushCurrent_v2(ctx)),
        ("cuMemGetInfo", lambda: cu.cuMemGetInfo_v2(ctypes.byref(free_b), ctypes.byref(total))),
        ("cuCtxPopCurrent", lambda: cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))),
        ("cuDevicePrimaryCtxRelease", lambda: cu.cuDevicePrimaryCtxRelease_v2(dev)),
    ]
    for what, call in steps:
        r = call()
        if r != 0:
            print(f"probe: {what} failed with CUresult {r}", file=sys.stderr)
            return 1
    ver = ctypes.c_int(0)
    cu.cuDriverGetVersion(ctypes.byref(ver))
    print(f"gpu: {n.value} device(s); device 0 {name.value.decode()}, "
          f"{total.value / 2**30:.1f} GiB, {free_b.value / 2**30:.1f} GiB free; "
          f"driver API {ver.value // 1000}.{ver.value % 1000 // 10}")
    print(f"FREE_BYTES={free_b.value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
