"""The stand-in torch (tests/python/standin/README.md): uint8 CUDA tensors
whose memory comes from the current CUDA allocator and whose operations are
host memset/memmove on it (the emulated device's memory is host memory)."""
import ctypes
import os

from . import _C

__version__ = os.environ.get("STANDIN_TORCH_VERSION", "2.9.0") + "+standin"
OutOfMemoryError = _C.OutOfMemoryError
uint8 = "uint8"


class device:
    def __init__(self, type="cuda", index=None):
        if isinstance(type, str) and ":" in type:
            type, index = type.split(":")[0], int(type.split(":")[1])
        self.type, self.index = type, index if index is not None else 0

    def __repr__(self):
        return f"device(type='{self.type}', index={self.index})"


class _Storage:
    def __init__(self, t):
        self._t = t

    def data_ptr(self):
        return self._t._ptr or 0

    def nbytes(self):
        return self._t._n


class Tensor:
    def __init__(self, n, dev):
        from . import cuda
        _C._cuda_init()
        self._n = int(n)
        self.device = device(dev) if not isinstance(dev, device) else dev
        self.is_cuda = self.device.type == "cuda"
        self._stream = cuda.current_stream().cuda_stream
        self._alloc = _C.state["current"]
        self._ptr = self._alloc.malloc(self._n, self.device.index, self._stream) if self._n else None
        if self._n and not self._ptr:
            raise OutOfMemoryError(f"CUDA out of memory: the allocator returned NULL for {n} bytes")

    def __del__(self):
        if getattr(self, "_ptr", None):
            self._alloc.raw_delete(self._ptr)
            self._ptr = None

    def data_ptr(self):
        return self._ptr or 0

    def untyped_storage(self):
        return _Storage(self)

    def numel(self):
        return self._n

    def element_size(self):
        return 1

    def _run(self, fn):
        from . import cuda
        cuda._launch(fn)
        return self

    def fill_(self, value):
        ptr, n = self._ptr, self._n
        return self._run(lambda: ctypes.memset(ptr, int(value) & 0xFF, n))

    def copy_(self, src):
        if src._n != self._n:
            raise RuntimeError("copy_: sizes differ")
        dst, s, n = self._ptr, src._ptr, self._n
        return self._run(lambda: ctypes.memmove(dst, s, n))

    def add_(self, value):
        ptr, n, v = self._ptr, self._n, int(value) & 0xFF
        table = bytes((i + v) & 0xFF for i in range(256))

        def add():
            data = ctypes.string_at(ptr, n).translate(table)
            ctypes.memmove(ptr, data, n)
        return self._run(add)

    def clone(self):
        return empty(self._n, device=self.device).copy_(self)

    def __ne__(self, value):
        """(t != v): here only as torch.count_nonzero(t != v).item() uses it."""
        t = self
        return _Count(lambda: t._n - ctypes.string_at(t._ptr, t._n).count(bytes([int(value)])))

    def record_stream(self, stream):
        self._alloc.record_stream(self._ptr, stream.cuda_stream)


class _Count:
    def __init__(self, fn):
        self._fn = fn

    def item(self):
        return self._fn()


def count_nonzero(mask):
    return mask


def empty(n, dtype=uint8, device="cuda"):
    if isinstance(n, (tuple, list)):
        n = n[0]
    return Tensor(n, device)


def full(size, fill_value, dtype=uint8, device="cuda"):
    return empty(size, dtype=dtype, device=device).fill_(fill_value)


def equal(a, b):
    return a._n == b._n and ctypes.string_at(a._ptr, a._n) == ctypes.string_at(b._ptr, b._n)


from . import cuda  # noqa: E402,F401
