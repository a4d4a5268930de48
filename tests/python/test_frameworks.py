"""sgm.torch and sgm.cupy without a GPU: use() refuses cleanly without the
framework or without a device, and with a stand-in framework module (the
real one needs a GPU: tests/gpu/run.sh) installs libsgm.so's hooks, whose
allocations the hook context of the emulated device serves."""
import subprocess
import sys
import textwrap
import types

import pytest

import sgm
import sgm.cupy
import sgm.torch
from conftest import child_env


@pytest.fixture
def no_module(monkeypatch):
    def hide(name):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    return hide


def fake_torch(available=True, in_use=False, calls=None):
    calls = calls if calls is not None else []

    class Allocator:
        def __init__(self, path, malloc, free):
            calls.append(("allocator", path, malloc, free))

    def change(alloc):
        if in_use:
            raise RuntimeError("Can't swap an already initialized allocator")
        calls.append(("change", alloc))
    memory = types.SimpleNamespace(CUDAPluggableAllocator=Allocator,
                                   change_current_allocator=change)
    cuda = types.SimpleNamespace(memory=memory, is_available=lambda: available,
                                 current_device=lambda: 0)
    return types.SimpleNamespace(__version__="2.99-fake", cuda=cuda)


@pytest.fixture
def fresh(monkeypatch):
    """use()'s once-per-process state, and SGM_* variables, restored after."""
    monkeypatch.setattr(sgm.torch, "_state", {"active": False})
    monkeypatch.setattr(sgm.cupy, "_state", {"active": False})
    monkeypatch.setattr(sgm, "_hooks", {"env": None})
    for k in ("SGM_BACKEND", "SGM_VRAM_LIMIT", "SGM_SHARED_FALLBACK"):
        monkeypatch.setenv(k, "")  # records the value to restore after the test ...
        monkeypatch.delenv(k)      # ... and starts without it


def test_torch_use_without_pytorch(no_module, fresh):
    no_module("torch")
    with pytest.raises(sgm.UnsupportedError) as e:
        sgm.torch.use()
    assert "PyTorch is not installed" in e.value.message
    assert isinstance(e.value, NotImplementedError)
    assert not sgm.torch.active()


def test_torch_use_without_a_gpu(monkeypatch, fresh):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(available=False))
    with pytest.raises(sgm.UnsupportedError) as e:
        sgm.torch.use(vram_limit="1GiB")
    assert "no CUDA device" in e.value.message
    import os
    assert "SGM_VRAM_LIMIT" not in os.environ  # nothing applied on refusal


def test_torch_use_after_the_first_allocation(monkeypatch, fresh):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(in_use=True))
    with pytest.raises(sgm.BusyError) as e:
        sgm.torch.use()
    assert "before any tensor" in e.value.message


def test_torch_use_refuses_emu_and_unknown_options(monkeypatch, fresh):
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    with pytest.raises(sgm.InvalidError):
        sgm.torch.use(backend="emu")
    with pytest.raises(sgm.InvalidError):
        sgm.torch.use(vram_limt="1G")


def test_torch_use_installs_the_hooks_and_options(monkeypatch, fresh):
    """Invariant: use() hands PyTorch the very libsgm.so file the package
    loaded and its two hook names, sets the options as SGM_* variables, is a
    no-op when repeated with the same options and refuses other ones."""
    import os
    calls = []
    monkeypatch.setitem(sys.modules, "torch", fake_torch(calls=calls))
    sgm.torch.use(vram_limit="3GiB", shared_fallback=False)
    assert calls[0] == ("allocator", sgm.library_path(), "sgm_torch_malloc", "sgm_torch_free")
    assert calls[1][0] == "change"
    assert os.environ["SGM_VRAM_LIMIT"] == "3GiB"
    assert os.environ["SGM_SHARED_FALLBACK"] == "0"
    assert os.environ["SGM_BACKEND"] == "cuda"
    assert sgm.torch.active()
    sgm.torch.use(vram_limit="3GiB", shared_fallback=False)
    assert len(calls) == 2
    with pytest.raises(sgm.InvalidError):
        sgm.torch.use(vram_limit="4GiB")
    # CuPy shares the hook contexts: other options are refused there too.
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace())
    with pytest.raises(sgm.InvalidError) as e:
        sgm.cupy.use(vram_limit="4GiB")
    assert "already set up with other options" in e.value.message


def test_torch_prefetch_needs_the_managed_mode(monkeypatch):
    from sgm import _lib
    monkeypatch.setattr(_lib, "has", lambda name: False)
    with pytest.raises(sgm.UnsupportedError) as e:
        sgm.torch.prefetch(types.SimpleNamespace(is_cuda=True))
    assert "sgm_prefetch" in e.value.message


def test_cupy_use_without_cupy(no_module, fresh):
    no_module("cupy")
    with pytest.raises(sgm.UnsupportedError) as e:
        sgm.cupy.use()
    assert "CuPy is not installed" in e.value.message


def test_cupy_use_without_a_gpu(monkeypatch, fresh):
    def count():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    runtime = types.SimpleNamespace(getDeviceCount=count)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime)))
    with pytest.raises(sgm.UnsupportedError) as e:
        sgm.cupy.use()
    assert "no CUDA device" in e.value.message


# A child process: the hook context of device 0 is created on the emulated
# device first, then the framework's hook is installed and allocates from it.
_CHILD_HEAD = textwrap.dedent("""
    import os, sys, types
    import sgm, sgm.{mod}
    MiB = 1 << 20
    assert sgm.stats(0)["backend"] == "emu"       # device 0's hook context: emu
    del os.environ["SGM_BACKEND"]                 # use() asks for cuda (the default)
""")


def run_child(mod, body):
    code = _CHILD_HEAD.format(mod=mod) + textwrap.dedent(body) + "\nprint('child ok')\n"
    r = subprocess.run([sys.executable, "-c", code], env=child_env(SGM_BACKEND="emu"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "child ok" in r.stdout, r.stdout + r.stderr


def test_torch_stats_in_memory_stats_shape():
    """Invariant: what PyTorch would allocate through the hooks shows in
    sgm.torch.stats() under memory_stats() keys, and goes away when freed
    and emptied."""
    run_child("torch", """
        lib = sgm._lib.lib()
        p = lib.sgm_torch_malloc(3 * MiB, 0, None)     # what PyTorch's allocator calls
        assert p
        s = sgm.torch.stats(0)
        assert s["allocated_bytes.all.current"] >= 3 * MiB, s
        assert s["allocation.all.current"] == 1 and s["allocation.all.allocated"] == 1
        assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
        assert s["sgm.tiers.vram.used_bytes"] >= 3 * MiB and s["sgm.backend"] == "emu"
        assert sgm.pointer_tier(p, 0) is sgm.Tier.VRAM
        assert sgm.pointer_tier(p + (1 << 40), 0) is sgm.Tier.NONE
        lib.sgm_torch_free(p, 3 * MiB, 0, None)
        sgm.torch.empty_cache()
        s = sgm.torch.stats(0)
        assert s["allocated_bytes.all.current"] == 0 and s["allocation.all.freed"] == 1
        assert s["reserved_bytes.all.current"] == 0, s
        budget = s["sgm.tiers.vram.budget_bytes"]
        sgm.torch.set_memory_fraction(0.25, 0)
        assert sgm.torch.stats(0)["sgm.tiers.vram.budget_bytes"] == s["sgm.device_total_bytes"] // 4
        try:
            sgm.torch.set_memory_fraction(1.5, 0)
            raise SystemExit("fraction 1.5 accepted")
        except sgm.InvalidError:
            pass
    """)


def test_cupy_allocator_serves_and_frees_through_sgm():
    """Invariant: the allocator sgm.cupy.use() installs takes each block from
    the hook context, hands CuPy an owner that frees it when dropped, maps a
    refusal to NoMemoryError with sgm's message, and returns a null block for 0."""
    run_child("cupy", """
        installed = []
        class UnownedMemory:
            def __init__(self, ptr, size, owner, device):
                self.ptr, self.size, self.owner = ptr, size, owner
        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset
        stream = types.SimpleNamespace(ptr=0)
        cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0),
            get_current_stream=lambda: stream, set_allocator=installed.append,
            UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer)
        sys.modules["cupy"] = types.SimpleNamespace(cuda=cuda)
        sgm.cupy.use(vram_limit="32MiB")   # read by hook contexts created from now on
        assert sgm.cupy.active() and len(installed) == 1
        alloc = installed[0]
        mp = alloc(2 * MiB)
        assert mp.ptr and mp.mem.size == 2 * MiB
        assert sgm.stats(0)["tiers"]["vram"]["n_live"] == 1
        assert alloc(0).ptr == 0
        try:
            alloc(1 << 50)
            raise SystemExit("a 1 PiB allocation succeeded")
        except MemoryError as e:
            assert isinstance(e, sgm.NoMemoryError) and e.message, e
        assert sgm.pointer_tier(mp.ptr) is sgm.Tier.VRAM
        del mp
        import gc; gc.collect()
        assert sgm.stats(0)["tiers"]["vram"]["n_live"] == 0
        sgm.cupy.empty_cache()
        assert sgm.stats(0)["tiers"]["vram"]["committed_bytes"] == 0
    """)
