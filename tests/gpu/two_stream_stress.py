#!/usr/bin/env python3
"""two_stream_stress.py — PyTorch tensors on two torch.cuda.Stream()s through
sgm's allocator, checked byte for byte.

Each round: stream A fills a fresh tensor x with a round-specific byte; stream
B waits for A, lags behind (torch.cuda._sleep), copies x into y and x is
declared used on B (x.record_stream(B)); x is then freed and A at once
allocates and fills another tensor, which may get x's memory. If the
allocator hands x's block to A before B's copy ran, y holds the wrong byte.
The same again with the roles of A and B swapped. After every few rounds all
y are compared with their expected byte on the device; any mismatch fails.

    python3 two_stream_stress.py path/to/libsgm.so  (SGM_BACKEND=cuda)
Env: STRESS_ROUNDS (default 200), STRESS_SEED (default 1; printed)."""
import os
import random
import sys

from gpu_common import torch_through_sgm  # the bundle's py/ holds it and the sgm package


def main():
    torch = torch_through_sgm()
    if torch is None:
        return 77
    rounds = int(os.environ.get("STRESS_ROUNDS", "200"))
    seed = int(os.environ.get("STRESS_SEED", "1"))
    print(f"two_stream_stress: seed {seed}, {rounds} rounds")
    rng = random.Random(seed)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    sleep = getattr(torch.cuda, "_sleep", None)
    pending, checked, bad = [], 0, 0

    def check():
        nonlocal checked, bad
        torch.cuda.synchronize()
        for y, want in pending:
            bad += int(torch.count_nonzero(y != want).item())
            checked += y.numel()
        pending.clear()

    for r in range(rounds):
        a, b = streams if r % 2 == 0 else streams[::-1]
        n = rng.choice((1 << 16, 1 << 20, 3 << 20, 8 << 20))
        want = r % 251
        with torch.cuda.stream(a):
            x = torch.full((n,), want, dtype=torch.uint8, device="cuda")
        b.wait_stream(a)
        with torch.cuda.stream(b):
            if sleep:
                sleep(rng.randrange(20000, 200000))  # B lags: A races ahead
            y = x.clone()
            x.record_stream(b)
        del x  # freed; B's copy may still be pending
        with torch.cuda.stream(a):
            w = torch.full((n,), 255 - want % 2, dtype=torch.uint8, device="cuda")
        pending.append((y, want))
        del w
        if len(pending) >= 16:
            check()
    check()
    if bad:
        print(f"two_stream_stress: {bad} of {checked} bytes wrong: a block in use on one "
              "stream was handed to another", file=sys.stderr)
        return 1
    print(f"key: {rounds} rounds, {checked / 2**20:.0f} MiB checked byte for byte, 0 wrong "
          f"(seed {seed}{'' if sleep else ', no torch.cuda._sleep: weaker'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
