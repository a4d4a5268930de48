#!/usr/bin/env python3
"""PyTorch on sgm: tensors beyond the VRAM budget land in shared GPU memory.

Routes every CUDA allocation PyTorch makes through libsgm.so (PyTorch's
CUDAPluggableAllocator calling sgm_torch_malloc / sgm_torch_free), allocates
int32 tensors worth 1.5x the VRAM budget (SGM_VRAM_LIMIT, 1GiB unless set),
computes x*2+1 and a sum on each, checks the results against the CPU, and
prints where the bytes landed and sgm's statistics.

    python3 examples/pytorch_allocator.py [--managed] [path/to/libsgm.so]

--managed runs with SGM_POINTERS=managed (docs/managed.md): the tensors are
Unified Memory that sgm moves between VRAM and shared memory; after the work,
half the tensors are freed and the others come back into VRAM (promotions in
the stats). Where the GPU has no concurrent managed access sgm says so and the
script exits 1.

libsgm.so: argv[1], else $SGM_LIB, else ../build/release/lib/libsgm.so next to
this script, else the loader's search path (LD_LIBRARY_PATH, ldconfig).

Needs an NVIDIA GPU and PyTorch 2.0 or newer; without them it prints
"no GPU: skipping" and exits 0.

Note: PyTorch does not check the allocator's result for NULL. When sgm cannot
allocate, it prints one line to stderr saying why; the kernel that uses the
tensor then fails. See docs/frameworks.md.
"""
import json
import os
import sys

from sgm_ctypes import MiB, TIERS, find_lib, load_sgm, skip, stats, task_manager, work_plan


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

    managed = "--managed" in sys.argv[1:]
    if managed:
        sys.argv.remove("--managed")
        os.environ["SGM_POINTERS"] = "managed"
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
    block, n_blocks, n = work_plan(budget)
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
    if managed:
        # Free every other tensor: the shared-placed ones left come back into
        # the room, highest priority first (all NORMAL here: most recent first).
        del tensors[::2]
        torch.cuda.synchronize()
        lib.sgm_torch_empty_cache()
        m = stats(lib, ctx).get("managed", {})
        back = sum(1 for t in tensors if lib.sgm_pointer_tier(ctx, t.data_ptr()) == 0)
        print(f"managed: {m.get('n_demotions', 0)} demotions, {m.get('n_promotions', 0)} "
              f"promotions; after freeing half, {back} of {len(tensors)} tensors are in VRAM")
        if st.get("managed", {}).get("n_demotions", 0) == 0:
            print("managed mode demoted nothing: were the tensors under 2 MiB?")
            ok = False
    del tensors, x
    torch.cuda.synchronize()
    lib.sgm_torch_empty_cache()
    task_manager(stats(lib, ctx), "after freeing the tensors and sgm_torch_empty_cache")
    if landed.get("shared", 0) == 0 and not managed:
        print("nothing landed in shared GPU memory: is SGM_SHARED_FALLBACK off, or the budget "
              "larger than expected?")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
