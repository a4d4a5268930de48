"""torch.cuda of the stand-in: streams (synchronous), CUDA graphs that record
and replay tensor operations, and torch.cuda.memory's functions."""
import contextlib
import itertools
import os
import threading

from .. import _C
from . import memory
from .memory import (change_current_allocator, empty_cache, memory_stats,  # noqa: F401
                     memory_summary, set_per_process_memory_fraction,
                     memory_allocated, memory_reserved, max_memory_allocated)

if hasattr(memory, "MemPool"):
    from .memory import MemPool, use_mem_pool  # noqa: F401

_local = threading.local()
_handles = itertools.count(0x5000, 0x100)


def is_available():
    return os.environ.get("STANDIN_TORCH_CUDA", "1") == "1"


def is_initialized():
    return _C.state["cuda_initialized"]


def init():
    _C._cuda_init()


_lazy_init = init


def current_device():
    return 0


def device_count():
    return 1


class _Props:
    def __init__(self):
        self.total_memory = int(os.environ.get("STANDIN_TORCH_VRAM", str(64 << 20)))
        self.name = "stand-in device (host memory)"


def get_device_properties(device=None):
    return _Props()


def synchronize(device=None):
    pass


def _sleep(cycles):
    pass  # synchronous streams: nothing can race


class Stream:
    def __init__(self, device=None, priority=0, _handle=None):
        self.cuda_stream = next(_handles) if _handle is None else _handle

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


_default = Stream(_handle=0)


def current_stream(device=None):
    return getattr(_local, "stream", _default)


def default_stream(device=None):
    return _default


@contextlib.contextmanager
def stream(s):
    prev = current_stream()
    _local.stream = s
    try:
        yield
    finally:
        _local.stream = prev


_graph_ids = itertools.count(1)


def _launch(fn):
    g = getattr(_local, "capturing", None)
    if g is not None:
        g._ops.append(fn)
    else:
        fn()


class CUDAGraph:
    def __init__(self, keep_graph=False):
        self._ops = []
        self._pool = None
        self._released = True

    def capture_begin(self, pool=None, capture_error_mode="global"):
        _C._cuda_init()
        self._pool = tuple(pool) if pool is not None else (next(_graph_ids), 0)
        self._stream = current_stream().cuda_stream
        _C.state["current"].begin_allocate_to_pool(0, self._pool, self._stream)
        self._released = False
        _local.capturing = self

    def capture_end(self):
        _local.capturing = None
        _C.state["current"].end_allocate_to_pool(0, self._pool, self._stream)

    def replay(self):
        for fn in self._ops:
            fn()

    def pool(self):
        return self._pool

    def reset(self):
        if not self._released:
            self._released = True
            self._ops = []
            _C.state["current"].release_pool(0, self._pool)

    def __del__(self):
        self.reset()


class graph:
    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        self.g, self.pool, self.stream = cuda_graph, pool, stream

    def __enter__(self):
        self._ctx = stream(self.stream or Stream())
        self._ctx.__enter__()
        self.g.capture_begin(self.pool)

    def __exit__(self, *exc):
        self.g.capture_end()
        self._ctx.__exit__(*exc)
        return False
