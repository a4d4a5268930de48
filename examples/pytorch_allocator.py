#!/usr/bin/env python3
"""PyTorch on sgm: tensors beyond the VRAM budget land in shared GPU memory.

Routes every CUDA allocation PyTorch makes through libsgm.so (PyTorch's
CUDAPluggableAllocator calling sgm_torch_malloc / sgm_torch_free), allocates
int32 tensors worth 1.5x the VRAM budget (SGM_VRAM_LIMIT, 1GiB unless set),
computes x*2+1 and a sum on each, checks the results against the CPU, and
prints where the bytes landed and sgm's statistics.

    python3 examples/pytorch_allocator.py [path/to/libsgm.so]

libsgm.so: argv[1], else $SGM_LIB, else ../build/release/lib/libsgm.so next to
this script, else the loader's search path (LD_LIBRARY_PATH, ldconfig).

Needs an NVIDIA GPU and PyTorch 2.0 or newer; without them it prints
"no GPU: skipping" and exits 0.

Note: PyTorch does not check the allocator's result for NULL. When sgm cannot
allocate, it prints one line to stderr saying why; the kernel that uses the
tensor then fails. See docs/frameworks.md.
"""
import ctypes
import json
import os
import sys

MiB = 1 << 20
TIERS = {0: "vram", 1: "shared", 2: "disk", -1: "none"}


def skip(why):
    print(f"no GPU: skipping ({why})")
    sys.exit(0)


def find_lib():
    if len(sys.argv) > 1:
        return os.path.abspath(sys.argv[1])
    if os.environ.get("SGM_LIB"):
        return os.path.abspath(os.environ["SGM_LIB"])
    here = os.path.dirname(os.path.abspath(__file__))
    built = os.path.normpath(os.path.join(here, "..", "build", "release", "lib", "libsgm.so"))
    if os.path.exists(built):
        return built
    return "libsgm.so"  # the dynamic loader's search path


def load_sgm(path):
    """libsgm.so through ctypes, with the signatures this example calls."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        print(f"cannot load {path}: {e}\n"
              "build it (cmake --preset release && cmake --build build/release) or pass its "
              "path as the first argument or in SGM_LIB", file=sys.stderr)
        sys.exit(1)
    c = ctypes
    lib.sgm_hook_context.argtypes = [c.c_int]
    lib.sgm_hook_context.restype = c.c_void_p
    lib.sgm_torch_empty_cache.argtypes = []
    lib.sgm_torch_empty_cache.restype = None
    lib.sgm_pointer_tier.argtypes = [c.c_void_p, c.c_void_p]
    lib.sgm_pointer_tier.restype = c.c_int
    lib.sgm_stats_json.argtypes = [c.c_void_p, c.POINTER(c.c_void_p)]
    lib.sgm_stats_json.restype = c.c_int
    lib.sgm_string_free.argtypes = [c.c_void_p]
    lib.sgm_string_free.restype = None
    lib.sgm_last_error.argtypes = []
    lib.sgm_last_error.restype = c.c_char_p
    return lib


def stats(lib, ctx):
    """The context's statistics as a dict (sgm_stats_json; shape in docs/stats.md)."""
    out = ctypes.c_void_p()
    if lib.sgm_stats_json(ctx, ctypes.byref(out)) != 0:
        raise RuntimeError("sgm_stats_json: " + lib.sgm_last_error().decode())
    try:
        return json.loads(ctypes.string_at(out.value).decode())
    finally:
        lib.sgm_string_free(out)


def task_manager(st, moment):
    print(f"{moment}:")
    for name, key in (("Dedicated GPU memory", "vram"), ("Shared GPU memory", "shared")):
        t = st["tiers"][key]
        print(f"  {name:21s} {t['used_bytes'] / MiB:9.1f} / {t['budget_bytes'] / MiB:.1f} MiB"
              f"  (committed {t['committed_bytes'] / MiB:.1f} MiB)")
    print(f"  fallbacks: {st['n_fallbacks']} ({st['fallback_bytes'] / MiB:.1f} MiB)")


def main():
    try:
        import torch
    except ImportError:
        skip("PyTorch is not installed")
    if not torch.cuda.is_available():
        skip("torch.cuda.is_available() is False")
    if not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        print(f"PyTorch {torch.__version__} has no CUDAPluggableAllocator: 2.0 or newer is needed",
              file=sys.stderr)
        return 1
    try:
        import numpy as np
    except ImportError:
        np = None

    # Before libsgm.so reads its environment (the first hook call).
    os.environ.setdefault("SGM_VRAM_LIMIT", "1GiB")
    if os.environ.get("SGM_BACKEND", "cuda") != "cuda":
        print(f"SGM_BACKEND={os.environ['SGM_BACKEND']} cannot serve PyTorch's kernels: using cuda")
    os.environ["SGM_BACKEND"] = "cuda"

    path = find_lib()
    lib = load_sgm(path)
    # Before any CUDA allocation: PyTorch refuses to swap an allocator in use.
    # The same path as the ctypes handle, so both see one libsgm.so instance.
    allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "sgm_torch_malloc", "sgm_torch_free")
    torch.cuda.memory.change_current_allocator(allocator)
    print(f"PyTorch {torch.__version__}: CUDA allocations go through {path}")

    device = 0
    torch.cuda.set_device(device)
    ctx = lib.sgm_hook_context(device)  # sgm printed why if this is NULL
    if not ctx:
        return 1
    budget = stats(lib, ctx)["tiers"]["vram"]["budget_bytes"]
    block = (budget // 8) // 4 * 4
    n_blocks = (budget * 3 // 2 + block - 1) // block
    n = block // 4
    print(f"VRAM budget {budget / MiB:.1f} MiB: {n_blocks} int32 tensors of {block / MiB:.1f} MiB "
          f"= 1.5x the budget")

    tensors = []
    for i in range(n_blocks):
        x = torch.arange(n, dtype=torch.int32, device=f"cuda:{device}")
        x.remainder_(1024).add_(i)
        tensors.append(x)
    landed = {}
    for x in tensors:
        tier = TIERS.get(lib.sgm_pointer_tier(ctx, x.data_ptr()), "?")
        landed[tier] = landed.get(tier, 0) + x.numel() * x.element_size()
    print("where the bytes landed: " +
          ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in sorted(landed.items())))
    task_manager(stats(lib, ctx), "with all tensors live")

    # Compute on every tensor, VRAM and shared alike, and check against the CPU.
    ok = True
    base = np.arange(n, dtype=np.int64) % 1024 if np is not None else None
    for i, x in enumerate(tensors):
        x.mul_(2).add_(1)
        got = int(x.sum(dtype=torch.int64).item())
        if np is not None:
            want_all = base + i
            want_all = want_all * 2 + 1
            want = int(want_all.sum())
            head = x[:4096].cpu().numpy()
            tail = x[-4096:].cpu().numpy()
            same = (head == want_all[:4096]).all() and (tail == want_all[-4096:]).all()
        else:
            ref = (torch.arange(n, dtype=torch.int64) % 1024 + i) * 2 + 1
            want = int(ref.sum())
            same = torch.equal(x[:4096].cpu().to(torch.int64), ref[:4096])
        if got != want or not same:
            print(f"tensor {i}: sum {got}, CPU says {want}; elements match: {bool(same)}")
            ok = False
    torch.cuda.synchronize()
    print(f"x*2+1 and sum on {n_blocks} tensors: {'match the CPU' if ok else 'MISMATCH'}")

    st = stats(lib, ctx)
    print("sgm stats:", json.dumps(st, indent=2))
    del tensors, x
    torch.cuda.synchronize()
    lib.sgm_torch_empty_cache()
    task_manager(stats(lib, ctx), "after freeing the tensors and sgm_torch_empty_cache")
    if landed.get("shared", 0) == 0:
        print("nothing landed in shared GPU memory: is SGM_SHARED_FALLBACK off, or the budget "
              "larger than expected?")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
