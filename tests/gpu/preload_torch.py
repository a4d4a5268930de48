#!/usr/bin/env python3
"""preload_torch.py — the GPU check's unmodified PyTorch job under
libsgm-preload.so (issue 27), timed against plain Unified Memory
oversubscription. The job and its sizes are managed_oversub.py's (12 int32
tensors of 1/8 of a limit = 1.5x the limit, ROUNDS in-place passes, one
checked sum per pass); this script only changes how the memory is reached:

  preload  plain torch tensors (PyTorch's own caching allocator, cudaMalloc,
           the runtime's cuGetProcAddress) in a child run with
           LD_PRELOAD=libsgm-preload.so SGM_VRAM_LIMIT=<limit>: what passes
           the limit falls back to shared GPU memory
  um       cuMemAllocManaged tensors while an ordinary allocation holds all
           free memory but the limit (managed_oversub.py's run_um)

    python3 preload_torch.py PRELOAD_SO                   both, one key line
    python3 preload_torch.py --dry-run [--free-bytes N] PRELOAD_SO   sizes and commands only
    python3 preload_torch.py --mode preload|um [--free-bytes N]      one run (what the full run spawns)

Prints "key: preload P s (F fallbacks), um U s; um/preload X" (> 1: the
preload was faster). Exits 0 with "skipping" where there is no GPU or no
PyTorch; the dry run needs neither.
"""
import os
import subprocess
import sys
import tempfile

import managed_oversub as mo

MODES = ("preload", "um")
TIMEOUT_S = int(os.environ.get("GPU_CHECK_PRELOAD_TIMEOUT_S", "60"))


def run_preload(p):
    import torch
    torch.cuda.set_device(0)
    n = p["per_tensor"] // 4
    tensors = [torch.arange(n, dtype=torch.int32, device="cuda").remainder_(1024) for _ in range(mo.COUNT)]
    return mo.job(torch, tensors, n)


def child_cmd(mode, free):
    return [sys.executable, os.path.abspath(__file__), "--mode", mode, "--free-bytes", str(free)]


def child_env(mode, p, preload, report):
    env = dict(os.environ)
    if mode == "preload":
        env.update(LD_PRELOAD=preload, SGM_VRAM_LIMIT=str(p["limit"]), SGM_PRELOAD_REPORT=report)
    return env


def report_field(path, name):
    try:
        with open(path) as f:
            last = f.read().strip().splitlines()[-1]
    except (OSError, IndexError):
        return None
    for kv in last.split():
        k, _, v = kv.partition("=")
        if k == name:
            return int(v)
    return None


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
    if mode:
        p = mo.plan(free)
        dt = mo.run_um(p) if mode == "um" else run_preload(p)
        print(f"time: {dt:.3f}")
        return 0
    if len(args) != 1:
        raise SystemExit("usage: preload_torch.py [--dry-run [--free-bytes N]] PRELOAD_SO")
    preload = os.path.abspath(args[0])
    if dry:
        p = mo.plan(free if free is not None else 80 * mo.GiB)
        assert p["managed"] == p["limit"] * 3 // 2 <= p["free"]
        print("dry run: " + mo.describe(p))
        for m in MODES:
            env = child_env(m, p, preload, "<report>")
            pre = " ".join(f"{k}={env[k]}" for k in ("LD_PRELOAD", "SGM_VRAM_LIMIT") if k in env and m == "preload")
            print(f"dry run: would run {pre + ' ' if pre else ''}{' '.join(child_cmd(m, p['free']))}")
        if not os.path.exists(preload):
            raise SystemExit(f"dry run: {preload} does not exist")
        return 0
    if free is None:
        free, why = mo.query_free()
        if free is None:
            print(f"skipping: {why}")
            return 0
        if free == 0:
            print("no GPU: skipping (torch.cuda is not available)")
            return 0
    p = mo.plan(free)
    print(mo.describe(p))
    times, fallbacks = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report")
        for m in MODES:
            try:
                out = subprocess.run(child_cmd(m, free), capture_output=True, text=True, timeout=TIMEOUT_S,
                                     env=child_env(m, p, preload, report))
            except subprocess.TimeoutExpired:
                print(f"{m}: timed out after {TIMEOUT_S}s")
                times[m] = None
                continue
            sys.stdout.write(out.stdout)
            sys.stderr.write(out.stderr)
            line = [x for x in out.stdout.splitlines() if x.startswith("time: ")]
            if out.returncode != 0 or not line:
                raise SystemExit(f"{m}: exit {out.returncode}")
            times[m] = float(line[-1].split()[1])
        fallbacks = report_field(report, "fallbacks")
    if not fallbacks:
        raise SystemExit(f"the preload reported {fallbacks} fallbacks: the job did not spill (not interposed?)")
    um_ratio = f"{times['um'] / times['preload']:.2f}" if times.get("um") and times.get("preload") else "-"
    fmt = {m: (f"{times[m]:.2f} s" if times[m] is not None else "timeout") for m in MODES}
    print(f"key: preload {fmt['preload']} ({fallbacks} fallbacks), um {fmt['um']}; um/preload {um_ratio}")
    return 0 if all(times.values()) else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ValueError as e:
        raise SystemExit(f"preload_torch.py: {e}")
