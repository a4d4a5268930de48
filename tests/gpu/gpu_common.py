"""gpu_common.py — the start-up the PyTorch GPU scripts of tests/gpu/ share
(graph_capture.py, two_stream_stress.py, torch_steps.py): point the sgm
package at the libsgm.so given on the command line, then import PyTorch and
route its CUDA allocations through sgm.

The bundle (tests/gpu/bundle.sh) copies this file next to the scripts and the
sgm package into py/.

Dry run without a GPU (tests/gpu/torch_steps_check.sh): GPU_CHECK_STANDIN
names the folder of the tests' stand-in torch (tests/python/standin), which
is then imported instead of PyTorch and served by the emulated device
(SGM_BACKEND=emu; its device memory is host memory, its "kernels" copies)."""
import os
import sys


def _standin():
    path = os.environ.get("GPU_CHECK_STANDIN")
    if path:
        sys.path.insert(0, path)
    return bool(path)


def torch_module():
    """PyTorch (or the stand-in), or None after printing why the script must
    skip (exit status 77): no PyTorch, or no GPU it can use. sgm is not
    installed as its allocator. argv[1], when given, is the libsgm.so to load
    (SGM_LIBRARY): the caller takes its arguments from argv[2:]."""
    if len(sys.argv) > 1:
        os.environ["SGM_LIBRARY"] = os.path.abspath(sys.argv[1])
    standin = _standin()
    import sgm.torch

    if standin:
        sgm.torch._EMU_FOR_TESTS["on"] = True
    try:
        import torch
    except ImportError:
        print("no GPU: skipping (PyTorch is not installed)")
        return None
    if not torch.cuda.is_available():
        print("no GPU: skipping (torch.cuda.is_available() is False)")
        return None
    return torch


def torch_through_sgm():
    """PyTorch with sgm as its CUDA allocator (every hook PyTorch offers
    wired), or None after printing why the script must skip (exit 77)."""
    torch = torch_module()
    if torch is None:
        return None
    import sgm.torch
    sgm.torch.use()
    return torch
