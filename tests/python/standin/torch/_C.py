"""torch._C of the stand-in (see ../README.md): the native allocator object
and the module functions torch.cuda.memory calls, with PyTorch's names and
argument order. Addresses handed to the setters are called through ctypes
with the C types of PyTorch's std::function signatures
(torch/csrc/cuda/CUDAPluggableAllocator.h), as the real one calls them.
"""
import ctypes
import os
import threading
import weakref

c = ctypes
VERSION = tuple(int(x) for x in os.environ.get("STANDIN_TORCH_VERSION", "2.9.0").split(".")[:2])

# Every call that reached an allocator hook or a setter: (what, args).
calls = []


class MempoolId(c.Structure):
    """c10::cuda::MempoolId_t: std::pair<unsigned long long, unsigned long long>."""
    _fields_ = [("first", c.c_ulonglong), ("second", c.c_ulonglong)]


ALLOC = c.CFUNCTYPE(c.c_void_p, c.c_size_t, c.c_int, c.c_void_p)
FREE = c.CFUNCTYPE(None, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p)
# setter name -> the C type PyTorch casts the address to (Module.cpp)
SETTERS_2_3 = {
    "set_init_fn": c.CFUNCTYPE(None, c.c_int),
    "set_reset_fn": c.CFUNCTYPE(None),
    "set_memory_fraction_fn": c.CFUNCTYPE(None, c.c_double, c.c_int),
    "set_base_alloc_fn": c.CFUNCTYPE(c.c_void_p, c.c_void_p, c.POINTER(c.c_size_t)),
    "set_record_stream_fn": c.CFUNCTYPE(None, c.c_void_p, c.c_void_p),
    # void(int, MempoolId_t, std::function<bool(cudaStream_t)>): the
    # std::function travels as a pointer to the caller's temporary
    "set_begin_allocate_to_pool": c.CFUNCTYPE(None, c.c_int, MempoolId, c.c_void_p),
    "set_end_allocate_to_pool_fn": c.CFUNCTYPE(None, c.c_int, MempoolId),
    "set_release_pool": c.CFUNCTYPE(None, c.c_int, MempoolId),
}
SETTERS_2_1 = dict(SETTERS_2_3)
del SETTERS_2_1["set_begin_allocate_to_pool"], SETTERS_2_1["set_end_allocate_to_pool_fn"]
SETTERS_2_1["set_begin_allocate_stream_to_pool"] = c.CFUNCTYPE(None, c.c_int, c.c_void_p, MempoolId)
SETTERS_2_1["set_end_allocate_stream_to_pool_fn"] = c.CFUNCTYPE(None, c.c_int, c.c_void_p)


def setters():
    if VERSION >= (2, 3):
        return SETTERS_2_3
    if VERSION >= (2, 1):
        return SETTERS_2_1
    return {}


class OutOfMemoryError(RuntimeError):
    pass


class _PluggableBase:
    """CUDAPluggableAllocator (C++): malloc/free plus optional hooks."""

    def __init__(self, alloc_fn, free_fn):
        if not isinstance(alloc_fn, int) or not isinstance(free_fn, int):
            raise TypeError("_cuda_customAllocator(): incompatible function arguments")
        self._alloc = ALLOC(alloc_fn)
        self._free = FREE(free_fn)
        self._fns = {}
        self._meta = {}
        self._lock = threading.Lock()
        self.initialized = False
        self.is_pluggable = True

    def _set(self, name, addr):
        if not isinstance(addr, int) or isinstance(addr, bool) or addr <= 0:
            raise TypeError(f"{name}(): incompatible function arguments: uint64 address expected")
        calls.append((name, addr))
        self._fns[name] = setters()[name](addr)

    # The C++ side (what PyTorch's allocator does with the hooks)
    def malloc(self, size, device, stream):
        p = self._alloc(size, device, stream or None)
        calls.append(("malloc", size, device, stream, p))
        with self._lock:
            self._meta[p] = (size, device, stream)
        return p

    def raw_delete(self, ptr):
        with self._lock:
            if ptr not in self._meta:
                raise RuntimeError("Trying to free a pointer not allocated here")
            size, device, stream = self._meta.pop(ptr)
        calls.append(("free", ptr, size, device, stream))
        self._free(ptr, size, device, stream or None)

    def init(self, device_count):
        fn = self._fns.get("set_init_fn")
        if fn:
            fn(device_count)
        self.initialized = True

    def empty_cache(self):
        fn = self._fns.get("set_reset_fn")
        if fn:
            fn()

    def set_memory_fraction(self, fraction, device):
        fn = self._fns.get("set_memory_fraction_fn")
        if fn:
            fn(fraction, device)

    def record_stream(self, ptr, stream):
        fn = self._fns.get("set_record_stream_fn")
        if fn:
            fn(ptr, stream or None)

    def base_allocation(self, ptr):
        fn = self._fns.get("set_base_alloc_fn")
        size = c.c_size_t(0)
        if not fn:
            return ptr, 0
        return fn(ptr, c.byref(size)), size.value

    def begin_allocate_to_pool(self, device, pool_id, stream):
        """CUDAGraph::capture_begin / use_mem_pool: the 2.3+ hook gets a
        filter (a std::function the C side must not call: a pointer to 32
        bytes of zeros stands for it), 2.1-2.2 the capture stream."""
        pid = MempoolId(*pool_id)
        if "set_begin_allocate_to_pool" in self._fns:
            filt = c.create_string_buffer(32)
            self._fns["set_begin_allocate_to_pool"](device, pid, c.cast(filt, c.c_void_p))
        elif "set_begin_allocate_stream_to_pool" in self._fns:
            self._fns["set_begin_allocate_stream_to_pool"](device, stream or None, pid)

    def end_allocate_to_pool(self, device, pool_id, stream):
        if "set_end_allocate_to_pool_fn" in self._fns:
            self._fns["set_end_allocate_to_pool_fn"](device, MempoolId(*pool_id))
        elif "set_end_allocate_stream_to_pool_fn" in self._fns:
            self._fns["set_end_allocate_stream_to_pool_fn"](device, stream or None)

    def release_pool(self, device, pool_id):
        fn = self._fns.get("set_release_pool")
        if fn:
            fn(device, MempoolId(*pool_id))


def _make_setter(name):
    def setter(self, func_ptr):
        self._set(name, func_ptr)
    setter.__name__ = name
    return setter


def _allocator_class():
    return type("_cuda_CUDAAllocator", (_PluggableBase,),
                {n: _make_setter(n) for n in setters()})


_cuda_CUDAAllocator = _allocator_class()


def _cuda_customAllocator(alloc_fn, free_fn):
    a = _cuda_CUDAAllocator(alloc_fn, free_fn)
    return a


class NativeAllocator:
    """The caching allocator, as far as its bytes go: device memory is host
    memory here, limited to STANDIN_TORCH_VRAM; private pools (MemPool) get
    whole segments from their pluggable allocator."""

    is_pluggable = False

    def __init__(self):
        self.limit = int(os.environ.get("STANDIN_TORCH_VRAM", str(64 << 20)))
        self.initialized = False
        self.used = 0
        self.peak = 0
        self.n_ooms = 0
        self.bufs = {}         # ptr -> (buffer, size, pool or None)
        self.oom_pools = []    # MemPools with use_on_oom, in creation order
        self.thread_pool = threading.local()
        self.graph_kept = []   # buffers freed during a capture (kept: no release here)

    def init(self, device_count):
        self.initialized = True

    def _pool_alloc(self, pool, size, stream):
        seg = (size + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        for i, (p, s) in enumerate(pool._free_segments):
            if s >= size:  # freed pool memory comes back only for requests it fits (#159674)
                del pool._free_segments[i]
                pool._live[p] = s
                return p
        p = pool._allocator.malloc(seg, 0, stream)
        if not p:
            raise OutOfMemoryError(f"CUDA out of memory in a private pool ({seg} bytes)")
        pool._live[p] = seg
        pool.segments_bytes += seg
        return p

    def malloc(self, size, device, stream):
        pool = getattr(self.thread_pool, "pool", None)
        if pool is not None and pool._allocator is not None:
            p = self._pool_alloc(pool, size, stream)
            self.bufs[p] = (None, size, pool)
            return p
        if self.used + size > self.limit:
            for oom_pool in self.oom_pools:
                if oom_pool._allocator is not None:
                    p = self._pool_alloc(oom_pool, size, stream)
                    self.bufs[p] = (None, size, oom_pool)
                    return p
            self.n_ooms += 1
            raise OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {size} bytes (stand-in limit {self.limit})")
        buf = c.create_string_buffer(size)
        p = c.addressof(buf)
        self.bufs[p] = (buf, size, None)
        self.used += size
        self.peak = max(self.peak, self.used)
        return p

    def raw_delete(self, ptr):
        buf, size, pool = self.bufs.pop(ptr)
        if getattr(self.thread_pool, "graph", False):
            self.graph_kept.append(buf)  # a graph's private pool keeps it
        if pool is not None:
            # cached in the pool; empty_cache does not return it (#145168)
            pool._free_segments.append((ptr, pool._live.pop(ptr)))
        else:
            self.used -= size

    def record_stream(self, ptr, stream):
        pass  # synchronous streams: nothing to wait for

    def empty_cache(self):
        pass

    def set_memory_fraction(self, fraction, device):
        self.limit = int(fraction * int(os.environ.get("STANDIN_TORCH_VRAM", str(64 << 20))))

    def begin_allocate_to_pool(self, device, pool_id, stream):
        self.thread_pool.pool = _pools.get(tuple(pool_id))
        self.thread_pool.graph = stream is not None

    def end_allocate_to_pool(self, device, pool_id, stream):
        self.thread_pool.pool = None
        self.thread_pool.graph = False

    def release_pool(self, device, pool_id):
        pass

    def stats(self):
        pool_bytes = sum(b[1] for b in self.bufs.values() if b[2] is not None)
        return {
            "allocated_bytes": {"all": {"current": self.used + pool_bytes, "peak": self.peak}},
            "reserved_bytes": {"all": {"current": self.used}},
            "num_ooms": self.n_ooms,
            "num_alloc_retries": 0,
        }


native = NativeAllocator()
state = {"current": native, "cuda_initialized": False}


def _cuda_changeCurrentAllocator(allocator):
    calls.append(("change_current_allocator", allocator))
    if state["current"].initialized:
        raise RuntimeError("Can't swap an already initialized allocator")
    state["current"] = allocator


def _cuda_getAllocator():
    return state["current"]


def _cuda_init():
    if not state["cuda_initialized"]:
        state["cuda_initialized"] = True
        state["current"].init(1)


def _cuda_memoryStats(device):
    a = state["current"]
    if a.is_pluggable:
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats. If you "
                           "need it, please file an issue describing your use case.")
    return a.stats()


def _cuda_emptyCache():
    state["current"].empty_cache()


def _cuda_setMemoryFraction(fraction, device):
    state["current"].set_memory_fraction(fraction, device)


_pool_ids = [0]
_pools = weakref.WeakValueDictionary()  # MemPool id -> pool


class _MemPool:
    """torch._C._MemPool(allocator, is_user_created, use_on_oom[, no_split])."""

    def __init__(self, allocator=None, is_user_created=True, use_on_oom=False, no_split=False):
        _pool_ids[0] += 1
        self._id = (0, _pool_ids[0])
        self._allocator = allocator
        self._free_segments = []
        self._live = {}
        self.segments_bytes = 0
        self.no_split = no_split
        _pools[self._id] = self
        if use_on_oom:
            native.oom_pools.append(self)

    @property
    def id(self):
        return self._id

    @property
    def allocator(self):
        return self._allocator

    def __del__(self):
        if self in native.oom_pools:
            native.oom_pools.remove(self)
        for p, _ in getattr(self, "_free_segments", []):
            self._allocator.raw_delete(p)


def _cuda_beginAllocateCurrentThreadToPool(device, pool_id):
    a = state["current"]
    calls.append(("beginAllocateCurrentThreadToPool", device, pool_id))
    a.begin_allocate_to_pool(device, pool_id, None)


def _cuda_endAllocateToPool(device, pool_id):
    state["current"].end_allocate_to_pool(device, pool_id, None)


def _cuda_releasePool(device, pool_id):
    state["current"].release_pool(device, pool_id)
