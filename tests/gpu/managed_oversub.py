#!/usr/bin/env python3
"""managed_oversub.py — a PyTorch job at 1.5x a VRAM limit three ways, timed:
fixed pointers (SGM_POINTERS=fixed: what does not fit stays in shared GPU
memory), managed pointers (SGM_POINTERS=managed: sgm moves Unified Memory
blocks between VRAM and shared memory) and plain Unified Memory
oversubscription (cuMemAllocManaged tensors, no sgm, the driver pages on
fault), issue 14.

    python3 managed_oversub.py [path/to/libsgm.so]            all three, one summary line
    python3 managed_oversub.py --dry-run [--free-bytes N]     sizes and arguments only (no torch)
    python3 managed_oversub.py --mode fixed|managed|um [lib]  one run (what the full run spawns)

The job: 12 int32 tensors of 1/8 of the limit each (1.5x the limit), then
ROUNDS passes that update every tensor in place (x.mul_(3).add_(1)) and
check one sum per pass against the value computed on the CPU.

Sizes: the card's free memory is queried first (torch.cuda.mem_get_info).
The limit is min(GPU_CHECK_MANAGED_LIMIT or 1 GiB, free / 4), so the managed
memory the job asks for (1.5x the limit) is never more than the card has
free: asking for more managed memory than is free can hang a GPU. The plain
Unified Memory run gets the same limit by holding the rest of the free
memory in an ordinary (non-managed) allocation, less 512 MiB of headroom for
the CUDA context and PyTorch; the driver then has only about the limit for
managed pages and must evict, which is what oversubscription means.

Prints "key: fixed F s, managed M s, um U s; managed/um X, managed/fixed Y"
(ratios as speed-ups: > 1 means managed was faster). Exits 0 with
"skipping" where there is no GPU or no PyTorch; the dry run needs neither.
"""
import os
import subprocess
import sys
import time

MiB = 1 << 20
GiB = 1 << 30
COUNT = 12          # tensors: 12 x 1/8 = 1.5x the limit
ROUNDS = int(os.environ.get("GPU_CHECK_MANAGED_ROUNDS", "4"))
HEADROOM = 512 * MiB
MODES = ("fixed", "managed", "um")
MODE_TIMEOUT_S = int(os.environ.get("GPU_CHECK_MANAGED_TIMEOUT_S", "60"))


def plan(free_bytes):
    """The sizes for a card with free_bytes free: a dict, or raise ValueError."""
    want = int(os.environ.get("GPU_CHECK_MANAGED_LIMIT", str(GiB)))
    if want <= 0:
        raise ValueError(f"GPU_CHECK_MANAGED_LIMIT={want}: give a positive number of bytes")
    limit = min(want, free_bytes // 4)
    per = (limit // 8) // (2 * MiB) * (2 * MiB)  # whole 2 MiB: every tensor is movable
    if per < 2 * MiB:
        raise ValueError(f"{free_bytes} bytes free: too little for a 1.5x job of 2 MiB tensors")
    limit = per * 8
    managed = per * COUNT
    filler = free_bytes - limit - HEADROOM
    if managed > free_bytes:
        raise ValueError(f"the job would ask for {managed} bytes of managed memory, more than the "
                         f"{free_bytes} free")
    if filler <= 0:
        raise ValueError(f"{free_bytes} bytes free leave no room to hold all but the limit "
                         f"({limit}) and {HEADROOM} bytes of headroom for the plain Unified Memory run")
    return {"free": free_bytes, "limit": limit, "per_tensor": per, "managed": managed,
            "filler": filler}


def describe(p):
    return (f"free {p['free'] / MiB:.0f} MiB: limit {p['limit'] / MiB:.0f} MiB, "
            f"{COUNT} tensors of {p['per_tensor'] / MiB:.0f} MiB = {p['managed'] / MiB:.0f} MiB "
            f"(1.5x), um filler {p['filler'] / MiB:.0f} MiB, {ROUNDS} rounds")


def expected_sums(n, rounds):
    """What the job's per-round check expects, computed on the CPU (int32 wraps)."""
    out = []
    base = [(i % 1024) for i in range(min(n, 4096))]
    for r in range(1, rounds + 1):
        vals = base
        for _ in range(r):
            vals = [((v * 3 + 1) + 2**31) % 2**32 - 2**31 for v in vals]
        out.append(sum(vals))
    return out


def job(torch, tensors, n):
    """ROUNDS in-place passes over every tensor; checked each round."""
    want = expected_sums(n, ROUNDS)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for r in range(ROUNDS):
        for x in tensors:
            x.mul_(3).add_(1)
        got = int(tensors[r % len(tensors)][:4096].sum(dtype=torch.int64).item())
        if got != want[r]:
            raise SystemExit(f"round {r}: sum {got}, expected {want[r]}: wrong bytes")
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_sgm(mode, p):
    os.environ["SGM_POINTERS"] = mode
    import sgm
    import sgm.torch
    try:
        sgm.torch.use(vram_limit=str(p["limit"]))
    except sgm.UnsupportedError as e:
        print(f"no GPU: skipping ({e.message})")
        return None
    import torch
    torch.cuda.set_device(0)
    n = p["per_tensor"] // 4
    tensors = [torch.arange(n, dtype=torch.int32, device="cuda").remainder_(1024) for _ in range(COUNT)]
    dt = job(torch, tensors, n)
    st = sgm.torch.stats(0)
    # sgm.torch.stats flattens sgm_stats_json: the managed counters are under "managed".
    print(f"{mode}: fallbacks {st.get('sgm.n_fallbacks', '?')}, "
          f"promotions {st.get('sgm.managed.n_promotions', '?')}, "
          f"demotions {st.get('sgm.managed.n_demotions', '?')}, "
          f"moves queued to the copy-stream worker {st.get('sgm.managed.n_moves_queued', '?')} "
          f"(done {st.get('sgm.managed.n_moves_done', '?')})")
    return dt


class _Managed:
    """A cuMemAllocManaged range as a CUDA array PyTorch can wrap."""

    def __init__(self, cuda, n):
        import ctypes
        self.cuda, self.ptr = cuda, ctypes.c_uint64()
        rc = cuda.cuMemAllocManaged(ctypes.byref(self.ptr), ctypes.c_size_t(n * 4), 1)  # GLOBAL
        if rc != 0:
            raise SystemExit(f"cuMemAllocManaged({n * 4}) failed: CUresult {rc}")
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i4",
                                         "data": (self.ptr.value, False), "version": 3}

    def free(self):
        self.cuda.cuMemFree_v2(self.ptr)


def run_um(p):
    import ctypes
    import torch
    torch.cuda.set_device(0)
    torch.cuda.init()
    cuda = ctypes.CDLL("libcuda.so.1")
    filler = torch.empty(p["filler"], dtype=torch.uint8, device="cuda")  # not managed: stays put
    n = p["per_tensor"] // 4
    ranges = [_Managed(cuda, n) for _ in range(COUNT)]
    tensors = [torch.as_tensor(r, device="cuda") for r in ranges]
    for x in tensors:
        x.copy_(torch.arange(n, dtype=torch.int32, device="cuda").remainder_(1024))
    dt = job(torch, tensors, n)
    del tensors, filler
    torch.cuda.synchronize()
    for r in ranges:
        r.free()
    return dt


def query_free():
    """Free bytes on device 0 (a torch import, in a child: the parent stays CUDA-free)."""
    code = "import torch; print(torch.cuda.mem_get_info(0)[0] if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"querying free memory failed: {e}"
    if out.returncode != 0:
        return None, "no PyTorch (" + (out.stderr.strip().splitlines() or ["?"])[-1] + ")"
    return int(out.stdout.strip() or 0), ""


def main(argv):
    args = list(argv)
    dry = "--dry-run" in args
    if dry:
        args.remove("--dry-run")
    free = None
    if "--free-bytes" in args:
        i = args.index("--free-bytes")
        free = int(args[i + 1])
        del args[i:i + 2]
    mode = None
    if "--mode" in args:
        i = args.index("--mode")
        mode = args[i + 1]
        del args[i:i + 2]
        if mode not in MODES:
            raise SystemExit(f"--mode {mode}: one of {', '.join(MODES)}")
    if len(args) > 1:
        raise SystemExit("usage: managed_oversub.py [--dry-run [--free-bytes N]] [--mode M] [libsgm.so]")
    if args:
        os.environ["SGM_LIBRARY"] = os.path.abspath(args[0])

    try:
        return run(dry, free, mode)
    except ValueError as e:
        raise SystemExit(f"managed_oversub.py: {e}")


def run(dry, free, mode):
    if dry:
        p = plan(free if free is not None else 80 * GiB)
        assert p["managed"] <= p["free"] and p["limit"] * 3 // 2 == p["managed"]
        print("dry run: " + describe(p))
        print("dry run: would run " + ", ".join(f"--mode {m}" for m in MODES))
        return 0

    if free is None:
        free, why = query_free()
        if free is None:
            print(f"skipping: {why}")
            return 0
        if free == 0:
            print("no GPU: skipping (torch.cuda is not available)")
            return 0
    p = plan(free)
    if mode:
        dt = run_um(p) if mode == "um" else run_sgm(mode, p)
        if dt is not None:
            print(f"time: {dt:.3f}")
        return 0

    print(describe(p))
    times = {}
    for m in MODES:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", m, "--free-bytes", str(free)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=MODE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"{m}: timed out after {MODE_TIMEOUT_S}s")
            times[m] = None
            continue
        sys.stdout.write(out.stdout)
        sys.stderr.write(out.stderr)
        if "skipping" in out.stdout:
            return 0
        line = [x for x in out.stdout.splitlines() if x.startswith("time: ")]
        if out.returncode != 0 or not line:
            raise SystemExit(f"{m}: exit {out.returncode}")
        times[m] = float(line[-1].split()[1])

    def fmt(m):
        return f"{times[m]:.2f} s" if times[m] is not None else "timeout"

    def ratio(a, b):
        return f"{times[a] / times[b]:.2f}" if times[a] and times[b] else "-"
    print(f"key: fixed {fmt('fixed')}, managed {fmt('managed')}, um {fmt('um')}; "
          f"managed/um {ratio('um', 'managed')}, managed/fixed {ratio('fixed', 'managed')}")
    return 0 if all(times.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
