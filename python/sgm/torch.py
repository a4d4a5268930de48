"""sgm.torch — PyTorch's CUDA allocations through sgm.

    import sgm.torch
    sgm.torch.use(vram_limit="8GiB")      # before the first CUDA allocation
    x = torch.empty(1 << 30, device="cuda")   # VRAM, else shared GPU memory
    sgm.torch.stats()["allocated_bytes.all.current"]

use() installs libsgm.so's sgm_torch_malloc / sgm_torch_free as PyTorch's
CUDAPluggableAllocator. Under a pluggable allocator torch.cuda.memory_stats()
raises and torch.cuda.empty_cache() / set_per_process_memory_fraction() do not
reach the allocator: stats(), empty_cache() and set_memory_fraction() here do.
prefetch() and set_priority() need a libsgm.so with the managed pointer mode
(sgm_prefetch / sgm_advise); without it they raise sgm.UnsupportedError.
"""
import ctypes

from . import (Priority, Tier, _apply_hook_env, _hook_context, _hook_env, _lib, _stream,
               pointer_tier)
from . import stats as _hook_stats

_state = {"active": False}  # use() installed the hooks in this process


def _torch():
    try:
        import torch
    except ImportError as e:
        raise _lib.UnsupportedError(
            f"PyTorch is not installed ({e}): sgm.torch.use() routes PyTorch's CUDA "
            "allocations and needs torch with CUDA", call="sgm.torch.use") from None
    return torch


def use(**options):
    """Route every CUDA allocation PyTorch makes through sgm. Call it before the
    first CUDA allocation (PyTorch cannot swap an allocator in use).

    options: sgm's SGM_* variables by short name (vram_limit="8GiB",
    shared_limit="32GiB", spill_dir=..., shared_fallback=False, ...). They are
    set in the environment, where the hook contexts read them when first used;
    backend must be "cuda" (the default: the emulated device cannot run kernels).
    Calling use() again with the same options is a no-op; with other options
    than an earlier sgm.torch.use() or sgm.cupy.use() it raises InvalidError
    (the hook contexts are configured once per process).

    Raises sgm.UnsupportedError without PyTorch, without a CUDA device or with
    a PyTorch older than 2.0, and sgm.BusyError after the first CUDA allocation.
    """
    env = _hook_env(options, "PyTorch", "sgm.torch.use")
    if _state["active"]:
        return
    torch = _torch()
    memory = getattr(torch.cuda, "memory", None)
    if not hasattr(memory, "CUDAPluggableAllocator"):
        raise _lib.UnsupportedError(
            f"PyTorch {torch.__version__} has no CUDAPluggableAllocator: 2.0 or newer is needed",
            call="sgm.torch.use")
    if not torch.cuda.is_available():
        raise _lib.UnsupportedError(
            "no CUDA device: torch.cuda.is_available() is False (sgm.torch needs an NVIDIA "
            "GPU; sgm.Context(backend='emu') runs without one)", call="sgm.torch.use")
    path = _lib.path()  # the same file as ctypes' handle: one library instance
    try:
        allocator = memory.CUDAPluggableAllocator(path, "sgm_torch_malloc", "sgm_torch_free")
        memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise _lib.BusyError(
            f"PyTorch already allocated CUDA memory with its own allocator ({e}); call "
            "sgm.torch.use() at the start of the program, before any tensor is put on the GPU",
            call="sgm.torch.use") from None
    # The hook contexts read the environment at the first allocation, which comes later.
    _apply_hook_env(env)
    _state["active"] = True


def active():
    """Whether use() has installed sgm as PyTorch's allocator in this process."""
    return _state["active"]


def _device(device):
    if device is None:
        return _torch().cuda.current_device()
    if hasattr(device, "index"):  # torch.device
        return device.index or 0
    if isinstance(device, str):
        return int(device.split(":")[1]) if ":" in device else 0
    return int(device)


# torch.cuda.memory_stats() keys whose meaning sgm's counters share, summed
# over the tiers a framework pointer can live in (VRAM and shared memory).
def _torch_keys(st):
    tiers = [st["tiers"][t] for t in ("vram", "shared")]

    def total(key):
        return sum(t[key] for t in tiers)
    return {
        "allocated_bytes.all.current": total("used_bytes"),
        "reserved_bytes.all.current": total("committed_bytes"),
        "allocation.all.current": total("n_live"),
        "allocation.all.allocated": total("n_allocs"),
        "allocation.all.freed": total("n_frees"),
        "segment.all.current": total("n_chunks"),
        "inactive_split_bytes.all.current": total("cached_bytes"),
    }


def _flatten(prefix, value, out):
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = value


def stats(device=None):
    """The hook context's statistics in torch.cuda.memory_stats()'s shape:
    the keys whose meaning sgm shares (allocated_bytes.all.current: bytes
    handed out; reserved_bytes.all.current: committed; allocation.all.*:
    counts; segment.all.current: chunks; inactive_split_bytes.all.current:
    freed blocks cached for their stream), then every sgm counter as
    "sgm.<key>" ("sgm.tiers.vram.used_bytes", "sgm.n_fallbacks", ...).
    Peaks are per tier only (sgm.tiers.*.peak_used_bytes): sgm does not track
    the peak of the sum."""
    st = _hook_stats(_device(device))
    out = _torch_keys(st)
    _flatten("sgm", st, out)
    return out


def empty_cache():
    """Return cached and free committed memory of every hook context to the
    driver (sgm_torch_empty_cache; torch.cuda.empty_cache() does not reach a
    pluggable allocator)."""
    _lib.lib().sgm_torch_empty_cache()


def set_memory_fraction(fraction, device=None):
    """Set a device's VRAM budget to fraction x its memory (0 < fraction <= 1)."""
    fraction = float(fraction)
    if not 0.0 < fraction <= 1.0:
        raise _lib.InvalidError(f"memory fraction {fraction} is outside (0, 1]",
                                call="sgm.torch.set_memory_fraction")
    _lib.lib().sgm_torch_set_memory_fraction(fraction, _device(device))


def _tensor_span(tensor):
    if not getattr(tensor, "is_cuda", False):
        raise _lib.InvalidError("the tensor is not on a CUDA device", call="sgm.torch")
    storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()
    return storage.data_ptr(), storage.nbytes()


def tier(tensor):
    """The Tier holding a CUDA tensor's memory (VRAM, SHARED; NONE when sgm did
    not allocate it)."""
    ptr, _ = _tensor_span(tensor)
    return pointer_tier(ptr, _device(tensor.device))


def _need(symbol, what):
    if not _lib.has(symbol):
        raise _lib.UnsupportedError(
            f"{what} needs {symbol}() from sgm's managed pointer mode, which {_lib.path()} "
            "does not export: use a newer libsgm.so", call=f"sgm.torch.{what}")
    return getattr(_lib.lib(), symbol)


def prefetch(tensor, tier=Tier.VRAM, stream=None):
    """Move a tensor's memory to a tier ahead of use (sgm_prefetch: MakeResident
    for a framework pointer; managed pointer mode). stream: where it will be used
    (default: PyTorch's current stream)."""
    fn = _need("sgm_prefetch", "prefetch")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                   ctypes.c_void_p]
    ptr, size = _tensor_span(tensor)
    if stream is None:
        stream = _torch().cuda.current_stream(tensor.device)
    ctx = _hook_context(_device(tensor.device))
    _lib.check(fn(ctx, ptr, size, int(Tier.of(tier)), _stream(stream)), "sgm_prefetch")


def set_priority(tensor, priority, hint=0):
    """Set the residency priority of a tensor's memory (sgm_advise; managed
    pointer mode): a Priority, its name or 0..4 (lower leaves VRAM first).
    hint: 0 none, 1 hot (into VRAM now if room can be made), 2 cold (to shared
    memory now, until a hot hint or a prefetch to VRAM)."""
    if isinstance(priority, str):
        priority = Priority[priority.upper()]
    fn = _need("sgm_advise", "set_priority")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    ptr, _ = _tensor_span(tensor)
    ctx = _hook_context(_device(tensor.device))
    _lib.check(fn(ctx, ptr, int(priority), int(hint)), "sgm_advise")