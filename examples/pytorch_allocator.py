#!/usr/bin/env python3
"""PyTorch on sgm: tensors beyond the VRAM budget land in shared GPU memory.

sgm.torch.use() routes every CUDA allocation PyTorch makes through libsgm.so;
the script allocates int32 tensors worth 1.5x the VRAM budget (SGM_VRAM_LIMIT,
1GiB unless set), computes x*2+1 and a sum on each, checks them against the
CPU, and prints where the bytes landed and sgm's statistics.

    python3 examples/pytorch_allocator.py [--managed] [path/to/libsgm.so]

--managed runs with SGM_POINTERS=managed (docs/managed.md): the tensors are
Unified Memory that sgm moves between VRAM and shared memory under the same
pointer: older tensors are demoted for newer ones instead of new ones falling
back, and after half are freed the others come back into VRAM.

The sgm package: installed (cmake --install), or PYTHONPATH=<source>/python.
libsgm.so: argv[1], else as the package finds it (docs/python.md). Needs an
NVIDIA GPU and PyTorch 2.0 or newer; without PyTorch it prints "PyTorch is not installed: skipping", without a GPU "no GPU: skipping",
and exits 0. PyTorch does not check the allocator's result for NULL: when sgm
cannot allocate, it prints one line to stderr saying why (docs/frameworks.md).
"""
import importlib.util
import os
import sys

MiB = 1 << 20
MANAGED = "--managed" in sys.argv[1:]
if MANAGED:
    sys.argv.remove("--managed")
    os.environ["SGM_POINTERS"] = "managed"
if len(sys.argv) > 1:
    os.environ["SGM_LIBRARY"] = os.path.abspath(sys.argv[1])
import sgm  # noqa: E402
import sgm.torch  # noqa: E402


def main():
    if importlib.util.find_spec("torch") is None:
        print("PyTorch is not installed: skipping (pip install torch, or your distribution's package)")
        return 0
    try:
        sgm.torch.use(vram_limit=os.environ.get("SGM_VRAM_LIMIT", "1GiB"))
    except sgm.UnsupportedError as e:
        print(f"no GPU: skipping ({e.message})")
        return 0
    import torch
    print(f"PyTorch {torch.__version__}: CUDA allocations go through {sgm.library_path()}")
    torch.cuda.set_device(0)  # CUDA initialised by PyTorch before sgm opens device 0

    budget = sgm.torch.stats(0)["sgm.tiers.vram.budget_bytes"]
    n = (budget // 8) // 4          # int32 elements per tensor: 1/8 of the budget
    count = 12                      # 12 x 1/8 = 1.5x the budget
    print(f"VRAM budget {budget / MiB:.1f} MiB: {count} int32 tensors of {n * 4 / MiB:.1f} MiB")
    tensors, landed = [], {}
    for i in range(count):
        x = torch.arange(n, dtype=torch.int32, device="cuda").remainder_(1024).add_(i)
        tensors.append(x)
    for x in tensors:
        tier = sgm.torch.tier(x).name.lower()
        landed[tier] = landed.get(tier, 0) + x.numel() * 4
    print("where the bytes landed: " + ", ".join(f"{k} {v / MiB:.1f} MiB"
                                                 for k, v in sorted(landed.items())))

    ok = True
    base = torch.arange(n, dtype=torch.int64) % 1024
    for i, x in enumerate(tensors):
        x.mul_(2).add_(1)
        want = (base + i) * 2 + 1
        if int(x.sum(dtype=torch.int64).item()) != int(want.sum()) or \
                not torch.equal(x[-4096:].cpu().to(torch.int64), want[-4096:]):
            print(f"tensor {i}: wrong result")
            ok = False
    torch.cuda.synchronize()
    print(f"x*2+1 and sum on {count} tensors: {'match the CPU' if ok else 'MISMATCH'}")
    s = sgm.torch.stats(0)
    print(f"allocated {s['allocated_bytes.all.current'] / MiB:.1f} MiB, reserved "
          f"{s['reserved_bytes.all.current'] / MiB:.1f} MiB, fallbacks {s['sgm.n_fallbacks']}")
    if MANAGED:
        print(f"managed: {s['sgm.managed.n_demotions']} demotions, "
              f"{s['sgm.managed.n_promotions']} promotions so far")
        if s["sgm.managed.n_demotions"] == 0:
            print("managed mode demoted nothing: are the tensors under 2 MiB?")
            ok = False
        del tensors[::2]  # room: the shared-placed ones left come back
        torch.cuda.synchronize()
        sgm.torch.empty_cache()
        back = sum(1 for t in tensors if sgm.torch.tier(t).name.lower() == "vram")
        s = sgm.torch.stats(0)
        print(f"after freeing half: {back} of {len(tensors)} tensors in VRAM, "
              f"{s['sgm.managed.n_promotions']} promotions")
    del tensors, x
    torch.cuda.synchronize()
    sgm.torch.empty_cache()
    s = sgm.torch.stats(0)
    print(f"after empty_cache: reserved {s['reserved_bytes.all.current'] / MiB:.1f} MiB")
    if not landed.get("shared") and not MANAGED:
        print("nothing landed in shared GPU memory: is SGM_SHARED_FALLBACK off?")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
