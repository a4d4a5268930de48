#!/usr/bin/env python3
"""torch_steps.py — the GPU check's PyTorch steps of issue 25, each checked
byte for byte (the two-stream stress with record_stream is
two_stream_stress.py):

  graph-idle   sgm.torch.use(); a CUDA graph captures a temporary it frees
               inside the capture and an output; later tensors are allocated
               and filled, the process idles for ten SGM_IDLE_TRIM_MS periods
               and empties the cache; the replay must leave the later tensors
               intact and write the right output (the capture pool keeps the
               graph's memory, issue 24 defect 7); the graph's reset returns it.
  mempool-oom  PyTorch keeps its own allocator; sgm.torch.pool(use_on_oom=True)
               serves what PyTorch cannot once VRAM is full: all but
               GPU_CHECK_VRAM_LIMIT bytes of the device are held outside
               PyTorch, tensors are made up to 1.5x that limit, sgm's VRAM
               budget is 256 MiB (a quarter of a smaller limit), so the rest comes
               from shared GPU memory.
  stats-patch  sgm.torch.use() + patch_memory_stats(): torch.cuda.memory_stats(),
               memory_allocated() and memory_summary() answer with the exact
               bytes PyTorch holds.

    python3 torch_steps.py path/to/libsgm.so STEP      (SGM_BACKEND=cuda)
Prints "key: ..." on success; exits 1 with the reason on a failure, 77
(saying "skipping") without PyTorch, a GPU, or the PyTorch feature a step
needs. Dry run without a GPU: torch_steps_check.sh (the stand-in torch)."""
import ctypes
import os
import sys
import time

from gpu_common import torch_module, torch_through_sgm  # the bundle's py/ holds them

MiB = 1 << 20


def fail(msg):
    print(f"torch_steps: {msg}", file=sys.stderr)
    return 1


def full(torch, n, v):
    return torch.full((n,), v, dtype=torch.uint8, device="cuda")


def graph_idle():
    torch = torch_through_sgm()
    if torch is None:
        return 77
    import sgm.torch
    wired = sgm.torch.hooks()
    if not any(k.startswith("set_begin_allocate") for k in wired):
        print(f"skipping: PyTorch {torch.__version__} has no graph pool hooks (2.1+)")
        return 77
    idle_ms = int(os.environ.get("SGM_IDLE_TRIM_MS", "2000"))
    n, t = 4 * MiB, 16 * MiB
    x = full(torch, n, 3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as PyTorch asks
        w = torch.empty((n,), dtype=torch.uint8, device="cuda")
        w.copy_(x)
        w.add_(1)
        del w
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tmp = torch.empty((t,), dtype=torch.uint8, device="cuda")  # the graph's temporary
        tmp.fill_(0)
        tmp.add_(7)
        y = torch.empty((n,), dtype=torch.uint8, device="cuda")
        y.copy_(x)
        y.add_(1)
        del tmp  # freed inside the capture: parked in the graph's pool
    torch.cuda.synchronize()
    kept = sgm.torch.memory_stats()["sgm.capture_pools.parked_bytes"]
    others = [full(torch, t, 0xAB) for _ in range(2)]
    torch.cuda.synchronize()
    time.sleep(10 * idle_ms / 1000.0)
    torch.cuda.empty_cache()
    for i in range(3):
        x.fill_(40 + i)
        g.replay()
        torch.cuda.synchronize()
        if not torch.equal(y, full(torch, n, 41 + i)):
            return fail(f"replay {i}: the graph's output is wrong")
        for k, o in enumerate(others):
            if not torch.equal(o, full(torch, t, 0xAB)):
                return fail(f"replay {i}: tensor {k}, made after the capture, was overwritten: "
                            "the graph's memory was handed out again")
    if kept < t:
        return fail(f"the capture pool kept {kept} bytes, not the {t}-byte temporary")
    del g
    torch.cuda.synchronize()
    left = sgm.torch.memory_stats()["sgm.capture_pools.n_pools"]
    if left:
        return fail(f"{left} capture pool(s) left after the graph was destroyed")
    print(f"key: graph replayed 3x after {10 * idle_ms} ms idle + empty_cache: output and "
          f"{2 * t // MiB} MiB of later tensors byte-exact; its pool kept {kept // MiB} MiB "
          f"until release (PyTorch {torch.__version__})")
    return 0


def _hold_vram(torch, keep_bytes):
    """Leave keep_bytes of device memory free: hold the rest outside PyTorch
    and sgm (cuMemAlloc in PyTorch's primary context). Returns a function that
    gives it back. The stand-in torch has its own limit (STANDIN_TORCH_VRAM)."""
    if torch.__version__.endswith("+standin"):
        return lambda: None
    cu = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the primary context is current
    free, _ = torch.cuda.mem_get_info()
    hold = free - keep_bytes
    if hold <= 0:
        return lambda: None
    ptr = ctypes.c_uint64()
    rc = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(hold))
    if rc != 0:
        raise RuntimeError(f"cuMemAlloc of {hold} bytes to hold VRAM failed: CUresult {rc}")
    return lambda: cu.cuMemFree_v2(ptr)


def mempool_oom():
    torch = torch_module()
    if torch is None:
        return 77
    import sgm.torch
    limit = int(os.environ.get("GPU_CHECK_VRAM_LIMIT", str(2 << 30)))
    sgm_vram = min(256 * MiB, limit // 4)
    try:
        pool = sgm.torch.pool(use_on_oom=True, vram_limit=sgm_vram)
    except sgm.UnsupportedError as e:
        print(f"skipping: {e}")
        return 77
    release = _hold_vram(torch, limit + sgm_vram)
    try:
        piece = min(64 * MiB, limit // 32)
        tensors = []
        while len(tensors) * piece < limit * 3 // 2:
            v = len(tensors) % 251
            tensors.append((full(torch, piece, v), v))
        torch.cuda.synchronize()
        for k, (tensor, v) in enumerate(tensors):
            if not torch.equal(tensor, full(torch, piece, v)):
                return fail(f"tensor {k} holds wrong bytes")
        s = sgm.stats(0)["tiers"]
        from_sgm = s["vram"]["used_bytes"] + s["shared"]["used_bytes"]
        stats = torch.cuda.memory_stats()  # PyTorch's own: must work on this route
        if from_sgm == 0:
            return fail("nothing came from sgm: PyTorch never ran out of memory")
        if s["shared"]["used_bytes"] == 0:
            return fail(f"nothing reached shared GPU memory past sgm's {sgm_vram // MiB} MiB of VRAM")
        total = len(tensors) * piece
        print(f"key: {total // MiB} MiB of tensors at 1.5x a {limit // MiB} MiB VRAM limit: "
              f"{from_sgm // MiB} MiB from sgm's pool ({s['vram']['used_bytes'] // MiB} VRAM, "
              f"{s['shared']['used_bytes'] // MiB} shared), byte-exact; PyTorch's memory_stats "
              f"reports {stats.get('reserved_bytes.all.current', 0) // MiB} MiB reserved")
        del tensors
        return 0
    finally:
        release()


def stats_patch():
    torch = torch_through_sgm()
    if torch is None:
        return 77
    import sgm.torch
    sgm.torch.patch_memory_stats()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    a = full(torch, 3 * MiB, 1)
    b = full(torch, 5 * MiB + 1, 2)
    got = torch.cuda.memory_allocated() - base
    want = 8 * MiB + 256  # sizes rounded to sgm's 256-byte alignment
    if got != want:
        return fail(f"memory_allocated() grew by {got} bytes for tensors of {want}")
    s = torch.cuda.memory_stats()
    if s["reserved_bytes.all.current"] < s["allocated_bytes.all.current"]:
        return fail("reserved below allocated")
    if torch.cuda.max_memory_allocated() < base + want:
        return fail("max_memory_allocated() below what is held")
    summary = torch.cuda.memory_summary()
    if "Allocated memory (current)" not in summary:
        return fail("memory_summary() is not sgm's")
    del a
    torch.cuda.synchronize()
    got = torch.cuda.memory_allocated() - base
    if got != 5 * MiB + 256:
        return fail(f"after freeing 3 MiB memory_allocated() grew by {got} bytes, not {5 * MiB + 256}")
    if not torch.equal(b, full(torch, 5 * MiB + 1, 2)):
        return fail("the remaining tensor holds wrong bytes")
    print(f"key: memory_stats()/memory_allocated() through the patch: +{want} then "
          f"+{5 * MiB + 256} bytes, exact; memory_summary is sgm's (PyTorch {torch.__version__})")
    return 0


STEPS = {"graph-idle": graph_idle, "mempool-oom": mempool_oom, "stats-patch": stats_patch}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in STEPS:
        print(f"usage: torch_steps.py LIBSGM {'|'.join(STEPS)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(STEPS[sys.argv[2]]())
