"""sgm.torch — PyTorch's CUDA allocations through sgm, two ways.

Whole process (every CUDA tensor through sgm):

    import sgm.torch
    sgm.torch.use(vram_limit="8GiB")      # before the first CUDA allocation
    x = torch.empty(1 << 30, device="cuda")   # VRAM, else shared GPU memory
    torch.cuda.memory_stats()              # after sgm.torch.patch_memory_stats()

use() installs libsgm.so's sgm_torch_malloc / sgm_torch_free as PyTorch's
CUDAPluggableAllocator and wires every hook that PyTorch's allocator object
offers (feature-detected; hooks() says which): record_stream, empty_cache,
set_per_process_memory_fraction, CUDA graph pools (begin/end allocate to pool,
release pool), init and base allocation. A hook this PyTorch lacks is named in
a one-line warning; record_stream missing is a loud one (corruption risk).

Only what does not fit (PyTorch keeps its own allocator, statistics, graphs):

    pool = sgm.torch.pool(use_on_oom=True)     # a torch.cuda.MemPool over sgm
    with torch.cuda.use_mem_pool(pool):        # or: only this scope from sgm
        kv = torch.empty(n, device="cuda")

docs/frameworks.md says which PyTorch version offers what, and which route
to choose. prefetch() and set_priority() need a libsgm.so with the managed
pointer mode (sgm_prefetch / sgm_advise); without it they raise
sgm.UnsupportedError.
"""
import ctypes
import inspect
import os
import sys
import warnings

from . import (Priority, Tier, _apply_hook_env, _hook_context, _hook_env, _hooks, _lib, _stream,
               options_env, pointer_tier)
from . import stats as _hook_stats

_state = {"active": False, "wired": {}, "allocators": []}
# Tests run the stand-in torch on the emulated device (tests/python/standin).
_EMU_FOR_TESTS = {"on": False}

# PyTorch's CUDAPluggableAllocator setters (torch/csrc/cuda/Module.cpp), the
# sgm symbol each one gets, and what does not work without it.
_HOOKS = (
    ("set_record_stream_fn", "sgm_torch_record_stream",
     "Tensor.record_stream() will not reach sgm: memory a side stream still reads can be "
     "handed to the next allocation (silent corruption); synchronize streams before freeing"),
    ("set_reset_fn", "sgm_torch_empty_cache",
     "torch.cuda.empty_cache() will not return sgm's cached memory (call sgm.torch.empty_cache())"),
    ("set_memory_fraction_fn", "sgm_torch_set_memory_fraction",
     "torch.cuda.set_per_process_memory_fraction() will not set sgm's VRAM budget "
     "(call sgm.torch.set_memory_fraction())"),
    ("set_init_fn", "sgm_torch_init",
     "a device count above what sgm's hooks serve will not be reported at CUDA init"),
    ("set_base_alloc_fn", "sgm_torch_base_alloc",
     "CUDA IPC of tensors (torch.multiprocessing) will not see the driver allocation holding them"),
)
# CUDA graph pools: PyTorch 2.3+ form, then the 2.1-2.2 stream form.
_POOL_FORMS = (
    (("set_begin_allocate_to_pool", "sgm_torch_begin_allocate_to_pool"),
     ("set_end_allocate_to_pool_fn", "sgm_torch_end_allocate_to_pool")),
    (("set_begin_allocate_stream_to_pool", "sgm_torch_begin_allocate_stream_to_pool"),
     ("set_end_allocate_stream_to_pool_fn", "sgm_torch_end_allocate_stream_to_pool")),
)
_RELEASE = ("set_release_pool", "sgm_torch_release_pool")
_NO_POOLS = ("CUDA graphs (torch.cuda.graph, torch.compile(mode='reduce-overhead')) will not "
             "keep their memory: sgm may reuse or trim memory a captured graph replays into")


def _torch():
    try:
        import torch
    except ImportError as e:
        raise _lib.UnsupportedError(
            f"PyTorch is not installed ({e}): sgm.torch.use() routes PyTorch's CUDA "
            "allocations and needs torch with CUDA", call="sgm.torch.use") from None
    return torch


def _env(options, call):
    """The hooks' SGM_* variables; the emulated device only for the tests'
    stand-in torch (its "kernels" are host copies)."""
    backend = options.get("backend") or os.environ.get("SGM_BACKEND")
    if _EMU_FOR_TESTS["on"] and backend == "emu":
        env = options_env({k: v for k, v in options.items() if k != "backend"})
        env["SGM_BACKEND"] = "emu"
        if _hooks["env"] is not None and _hooks["env"] != env:
            raise _lib.InvalidError(f"the framework hooks were already set up with other options "
                                    f"({_hooks['env']})", call=call)
        return env
    return _hook_env(options, "PyTorch", call)


def _address(symbol):
    """The raw address of an exported sgm function, as PyTorch's setters take it."""
    return ctypes.cast(getattr(_lib.lib(), symbol), ctypes.c_void_p).value


def _wire(native):
    """Give PyTorch's allocator object every hook it has a setter for.
    Returns {setter: symbol} for what was wired and [(what, why)] for what not."""
    wired, missing = {}, []

    def put(setter, symbol):
        getattr(native, setter)(_address(symbol))
        wired[setter] = symbol

    for setter, symbol, lost in _HOOKS:
        if hasattr(native, setter):
            put(setter, symbol)
        else:
            missing.append((setter, lost))
    for begin, end in _POOL_FORMS:
        if hasattr(native, begin[0]) and hasattr(native, end[0]):
            put(*begin)
            put(*end)
            break
    if hasattr(native, _RELEASE[0]) and any(b[0] in wired for b, _ in _POOL_FORMS):
        put(*_RELEASE)
    else:
        missing.append(("set_begin_allocate_to_pool", _NO_POOLS))
    return wired, missing


def _warn_missing(torch, missing):
    for setter, lost in missing:
        if setter == "set_record_stream_fn":
            msg = (f"sgm.torch: CORRUPTION RISK: PyTorch {torch.__version__} has no {setter}: "
                   f"{lost}")
            print(f"sgm: warning: {msg}", file=sys.stderr)
        else:
            msg = f"sgm.torch: PyTorch {torch.__version__} has no {setter}: {lost}"
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


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

    Every hook the allocator object has a setter for is wired (hooks() lists
    them); each one missing gets a one-line RuntimeWarning naming what will
    not work, and a missing record_stream hook also a line on stderr.

    Raises sgm.UnsupportedError without PyTorch, without a CUDA device or with
    a PyTorch older than 2.0, sgm.BusyError after the first CUDA allocation,
    and sgm.InvalidError after sgm.torch.pool() (one route per process).
    """
    env = _env(options, "sgm.torch.use")
    if _state["active"]:
        return
    if _state.get("allocators"):
        raise _lib.InvalidError(
            "sgm.torch.pool() already gave PyTorch's own allocator a MemPool over sgm; "
            "sgm.torch.use() would replace that allocator: choose one route per process "
            "(docs/frameworks.md)", call="sgm.torch.use")
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
    allocator = memory.CUDAPluggableAllocator(path, "sgm_torch_malloc", "sgm_torch_free")
    native = allocator.allocator() if callable(getattr(allocator, "allocator", None)) else None
    wired, missing = _wire(native) if native is not None else ({}, [])
    if native is None:
        missing = [(s, lost) for s, _, lost in _HOOKS] + [("set_begin_allocate_to_pool", _NO_POOLS)]
    try:
        memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise _lib.BusyError(
            f"PyTorch already allocated CUDA memory with its own allocator ({e}); call "
            "sgm.torch.use() at the start of the program, before any tensor is put on the GPU",
            call="sgm.torch.use") from None
    # The hook contexts read the environment at the first allocation, which comes later.
    _apply_hook_env(env)
    _state["active"] = True
    _state["allocator"] = allocator  # kept for the process's life, as PyTorch keeps its copy
    _state["wired"] = wired
    _warn_missing(torch, missing)


def hooks():
    """What use() wired: {PyTorch setter name: sgm symbol}; empty before use()."""
    return dict(_state.get("wired", {}))


def pool(use_on_oom=True, no_split=False, **options):
    """A torch.cuda.MemPool whose segments come from sgm, for PyTorch's own
    allocator (which keeps its statistics, record_stream, graph pools and
    snapshots). With use_on_oom=True (PyTorch 2.8+) PyTorch turns to it only
    after an out-of-memory: Windows' sysmem fallback, with PyTorch's
    statistics intact. Without it, or in addition, route a scope:
    ``with torch.cuda.use_mem_pool(pool): ...``. Segments land in VRAM while
    sgm's budget has room, then in shared GPU memory.

    options: as use(). Keep the pool alive as long as tensors from it live.
    Raises sgm.UnsupportedError without torch.cuda.MemPool (PyTorch < 2.5) or,
    for use_on_oom/no_split, a MemPool without that argument; InvalidError
    after sgm.torch.use() (one route per process)."""
    env = _env(options, "sgm.torch.pool")
    if _state["active"]:
        raise _lib.InvalidError(
            "sgm.torch.use() made sgm PyTorch's whole allocator; a MemPool over sgm is the other "
            "route (PyTorch's allocator first, sgm for what does not fit): choose one per process",
            call="sgm.torch.pool")
    torch = _torch()
    memory = getattr(torch.cuda, "memory", None)
    mempool = getattr(memory, "MemPool", None) or getattr(torch.cuda, "MemPool", None)
    if mempool is None:
        raise _lib.UnsupportedError(
            f"PyTorch {torch.__version__} has no torch.cuda.MemPool (2.5 or newer); use "
            "sgm.torch.use() instead", call="sgm.torch.pool")
    params = inspect.signature(mempool.__init__).parameters
    kwargs = {}
    for name, value, since in (("use_on_oom", use_on_oom, "PyTorch 2.8 or newer"),
                               ("no_split", no_split, "a newer PyTorch")):
        if not value:
            continue
        if name not in params:
            raise _lib.UnsupportedError(
                f"torch.cuda.MemPool of PyTorch {torch.__version__} has no {name} ("
                f"{since}); pool({name}=False) with torch.cuda.use_mem_pool() works",
                call="sgm.torch.pool")
        kwargs[name] = True
    if not torch.cuda.is_available():
        raise _lib.UnsupportedError(
            "no CUDA device: torch.cuda.is_available() is False", call="sgm.torch.pool")
    _apply_hook_env(env)
    allocator = memory.CUDAPluggableAllocator(_lib.path(), "sgm_torch_malloc", "sgm_torch_free")
    _state.setdefault("allocators", []).append(allocator)  # its functions outlive every pool made from it
    return mempool(allocator.allocator(), **kwargs)


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


class _PoolStats(ctypes.Structure):
    """sgm_capture_pool_stats."""
    _fields_ = [("n_pools", ctypes.c_uint64), ("live_bytes", ctypes.c_uint64),
                ("parked_bytes", ctypes.c_uint64), ("n_live", ctypes.c_uint64),
                ("n_parked", ctypes.c_uint64)]


def _capture_pools(device):
    """What the capture pools of a device's hook context hold (sgm_capture_pool_info)."""
    out = _PoolStats()
    if _lib.has("sgm_capture_pool_info"):
        fn = _lib.lib().sgm_capture_pool_info
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(_PoolStats)]
        _lib.check(fn(_hook_context(device), 0, ctypes.byref(out)), "sgm_capture_pool_info")
    return {name: getattr(out, name) for name, _ in _PoolStats._fields_}


# torch.cuda.memory_stats() keys whose meaning sgm's counters share, summed
# over the tiers a framework pointer can live in (VRAM and shared memory).
# A block freed inside a CUDA graph's pool stays used in sgm for the graph
# ("parked"): PyTorch counts such memory as reserved, not allocated.
def _torch_keys(st, pools):
    tiers = [st["tiers"][t] for t in ("vram", "shared")]

    def total(key):
        return sum(t[key] for t in tiers)
    allocated = total("used_bytes") - pools["parked_bytes"]
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": total("peak_used_bytes"),
        "active_bytes.all.current": allocated,
        "reserved_bytes.all.current": total("committed_bytes"),
        "allocation.all.current": total("n_live") - pools["n_parked"],
        "allocation.all.allocated": total("n_allocs"),
        "allocation.all.freed": total("n_frees"),
        "segment.all.current": total("n_chunks"),
        "inactive_split_bytes.all.current": total("cached_bytes") + pools["parked_bytes"],
        "num_ooms": st["tiers"]["vram"]["n_failed"] - st["n_fallbacks"],
    }


def _flatten(prefix, value, out):
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = value


def memory_stats(device=None):
    """The hook context's statistics in torch.cuda.memory_stats()'s shape.

    PyTorch's keys where sgm's counters share their meaning (over VRAM and
    shared memory): allocated_bytes.all.current (handed to PyTorch, less what
    capture pools keep for graphs), allocated_bytes.all.peak (the sum of the
    tiers' peaks: an upper bound of the peak of the sum, equal while one tier
    is used), active_bytes.all.current (= allocated: sgm has no split blocks),
    reserved_bytes.all.current (committed), allocation.all.* (counts),
    segment.all.current (chunks), inactive_split_bytes.all.current (freed,
    cached for their stream or kept by capture pools), num_ooms (allocations
    that failed: VRAM could not serve them and shared memory did not take
    them). Not given: num_alloc_retries (sgm does not flush and retry a failed
    device allocation; a full VRAM falls back to shared memory, counted in
    sgm.n_fallbacks) and the large/small pool split.

    Then every sgm counter as "sgm.<key>" ("sgm.tiers.vram.used_bytes",
    "sgm.tiers.shared.used_bytes", "sgm.n_fallbacks", ...) and the capture
    pools as "sgm.capture_pools.<key>"."""
    dev = _device(device)
    st = _hook_stats(dev)
    pools = _capture_pools(dev)
    out = _torch_keys(st, pools)
    _flatten("sgm", st, out)
    _flatten("sgm.capture_pools", pools, out)
    return out


stats = memory_stats  # the earlier name


def _fmt(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def memory_summary(device=None, abbreviated=False):
    """A table in the manner of torch.cuda.memory_summary(): PyTorch's totals,
    then sgm's tiers (used / committed / budget / peak) and fallbacks. The
    table's lines are plain text; abbreviated leaves out the tier rows."""
    dev = _device(device)
    m = memory_stats(dev)
    rule = "|" + "=" * 75 + "|"
    lines = [rule, f"| sgm memory summary, device {dev:<2d} (PyTorch's allocator is sgm)"
             .ljust(76) + "|", rule]

    def row(name, value):
        lines.append(f"| {name:<40}| {value:>32} |")
    row("Allocated memory (current)", _fmt(m["allocated_bytes.all.current"]))
    row("Allocated memory (peak, upper bound)", _fmt(m["allocated_bytes.all.peak"]))
    row("Reserved memory (committed)", _fmt(m["reserved_bytes.all.current"]))
    row("Cached for streams or graphs", _fmt(m["inactive_split_bytes.all.current"]))
    row("Allocations (current)", str(m["allocation.all.current"]))
    row("Out-of-memory failures", str(m["num_ooms"]))
    if not abbreviated:
        lines.append(rule)
        for t in ("vram", "shared", "disk"):
            if f"sgm.tiers.{t}.used_bytes" not in m:
                continue
            row(f"{t}: used / committed",
                f"{_fmt(m[f'sgm.tiers.{t}.used_bytes'])} / {_fmt(m[f'sgm.tiers.{t}.committed_bytes'])}")
            row(f"{t}: budget / peak used",
                f"{_fmt(m[f'sgm.tiers.{t}.budget_bytes'])} / {_fmt(m[f'sgm.tiers.{t}.peak_used_bytes'])}")
        row("Fallbacks to shared memory", f"{m['sgm.n_fallbacks']} ({_fmt(m['sgm.fallback_bytes'])})")
        row("Capture pools (kept for graphs)",
            f"{m['sgm.capture_pools.n_pools']} ({_fmt(m['sgm.capture_pools.parked_bytes'])} freed)")
    lines.append(rule)
    return "\n".join(lines) + "\n"


def patch_memory_stats():
    """Opt-in: make torch.cuda.memory_stats() and memory_summary() (and so
    memory_allocated(), max_memory_allocated(), memory_reserved(), which read
    memory_stats) answer from sgm, for tools that call them directly
    (Lightning, Accelerate, ComfyUI's model manager): under a pluggable
    allocator PyTorch's own raise (PyTorch issue #133281). Needs use() first.
    Returns a function that puts PyTorch's back."""
    if not _state["active"]:
        raise _lib.InvalidError(
            "sgm.torch.patch_memory_stats() answers torch.cuda.memory_stats() for the allocator "
            "sgm.torch.use() installed: call use() first (under sgm.torch.pool() PyTorch's own "
            "statistics work and count sgm's segments as reserved)", call="sgm.torch.patch_memory_stats")
    torch = _torch()
    saved = []
    for mod in (torch.cuda, getattr(torch.cuda, "memory", None)):
        for name, fn in (("memory_stats", memory_stats), ("memory_summary", memory_summary)):
            if mod is not None and hasattr(mod, name):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, fn)

    def unpatch():
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    return unpatch


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