#!/usr/bin/env python3
"""graph_capture.py — a CUDA graph captured and replayed by PyTorch with every
allocation going through sgm (CUDAPluggableAllocator -> sgm_torch_malloc /
sgm_torch_free), checked against the CPU.

    python3 graph_capture.py path/to/libsgm.so      (SGM_BACKEND=cuda)

Prints "key: ..." on success; exits 1 (with the error) when the capture or a
replay fails or gives a wrong sum, 77 without PyTorch or a GPU."""
import sys
import traceback

from gpu_common import torch_through_sgm  # the bundle's py/ holds it and the sgm package


def main():
    torch = torch_through_sgm()
    if torch is None:
        return 77
    n = 1 << 20
    x = torch.zeros(n, device="cuda", dtype=torch.float64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as PyTorch asks
        for _ in range(3):
            (x * 2 + 1).sum()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            y = x * 2 + 1  # intermediate allocated during capture
            z = y.sum()
    except Exception:
        traceback.print_exc()
        print(f"graph capture through sgm failed (PyTorch {torch.__version__})", file=sys.stderr)
        return 1
    for i in range(5):
        x.fill_(float(i))
        g.replay()
        torch.cuda.synchronize()
        want = float((2 * i + 1) * n)
        if z.item() != want:
            print(f"replay {i}: sum {z.item()} != {want}", file=sys.stderr)
            return 1
    del g, y, z, x
    torch.cuda.synchronize()
    print(f"key: captured x*2+1 and a sum, replayed 5 times, sums correct (PyTorch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
