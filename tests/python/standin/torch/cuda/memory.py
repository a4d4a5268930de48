"""torch.cuda.memory of the stand-in, with PyTorch's names and argument order."""
import contextlib
import ctypes

from .. import _C

_cuda_CUDAAllocator = _C._cuda_CUDAAllocator


def _dev(device):
    return 0 if device is None else getattr(device, "index", device) or 0


def memory_stats(device=None):
    if not _C.state["cuda_initialized"]:
        return {}
    out = {}

    def flat(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                flat(f"{prefix}.{k}" if prefix else k, x)
        else:
            out[prefix] = v
    flat("", _C._cuda_memoryStats(_dev(device)))
    return dict(sorted(out.items()))


def memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.current", 0)


def memory_summary(device=None, abbreviated=False):
    stats = memory_stats(device)
    return "\n".join(f"{k}: {v}" for k, v in stats.items())


def empty_cache():
    if _C.state["cuda_initialized"]:
        _C._cuda_emptyCache()


def set_per_process_memory_fraction(fraction, device=None):
    _C._cuda_init()
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _C._cuda_setMemoryFraction(fraction, _dev(device))


class _CUDAAllocator:
    def __init__(self, allocator):
        self._allocator = allocator

    def allocator(self):
        return self._allocator


class CUDAPluggableAllocator(_CUDAAllocator):
    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        allocator = ctypes.CDLL(path_to_so_file)
        alloc_fn = ctypes.cast(getattr(allocator, alloc_fn_name), ctypes.c_void_p).value
        free_fn = ctypes.cast(getattr(allocator, free_fn_name), ctypes.c_void_p).value
        assert alloc_fn is not None
        assert free_fn is not None
        self._allocator = _C._cuda_customAllocator(alloc_fn, free_fn)


def change_current_allocator(allocator):
    _C._cuda_changeCurrentAllocator(allocator.allocator())


def _get_current_allocator():
    return _CUDAAllocator(_C._cuda_getAllocator())


class MemPool(_C._MemPool):
    # torch.cuda.MemPool: (allocator) from 2.5, use_on_oom from 2.8, no_split after
    def __init__(self, allocator=None, use_on_oom=False, no_split=False):
        super().__init__(allocator, True, use_on_oom, no_split)

    @property
    def id(self):
        return super().id


if _C.VERSION < (2, 8):
    class MemPool(_C._MemPool):  # noqa: F811
        def __init__(self, allocator=None):
            super().__init__(allocator, True)

        @property
        def id(self):
            return super().id


@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    device_index = _dev(device)
    _C._cuda_init()
    _C._cuda_beginAllocateCurrentThreadToPool(device_index, pool.id)
    try:
        yield
    finally:
        _C._cuda_endAllocateToPool(device_index, pool.id)
        _C._cuda_releasePool(device_index, pool.id)


if _C.VERSION < (2, 5):
    del MemPool, use_mem_pool
