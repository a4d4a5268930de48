"""gpu_common.py — the start-up the PyTorch GPU scripts of tests/gpu/ share
(graph_capture.py, two_stream_stress.py): point the sgm package at the
libsgm.so given on the command line, then import PyTorch and route its CUDA
allocations through sgm.

The bundle (tests/gpu/bundle.sh) copies this file next to the scripts and the
sgm package into py/."""
import os
import sys


def torch_through_sgm():
    """PyTorch with sgm as its CUDA allocator, or None after printing why the
    script must skip (exit status 77): no PyTorch, or no GPU it can use.
    argv[1], when given, is the libsgm.so to load (SGM_LIBRARY)."""
    if len(sys.argv) > 1:
        os.environ["SGM_LIBRARY"] = os.path.abspath(sys.argv[1])
    import sgm.torch

    try:
        import torch
    except ImportError:
        print("no GPU: skipping (PyTorch is not installed)")
        return None
    if not torch.cuda.is_available():
        print("no GPU: skipping (torch.cuda.is_available() is False)")
        return None
    sgm.torch.use()
    return torch
