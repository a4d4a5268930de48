"""sgm.cupy — CuPy's device allocations through sgm.

    import sgm.cupy
    sgm.cupy.use(vram_limit="8GiB")       # before the arrays that should use sgm
    x = cupy.zeros(1 << 28)               # VRAM, else shared GPU memory

use() replaces CuPy's memory pool with an allocator that takes each block from
libsgm.so's hook context of the current device (sgm_torch_malloc on CuPy's
current stream) and frees it when CuPy drops the memory. Unlike PyTorch, CuPy
sees a failed allocation: it raises sgm.NoMemoryError (a MemoryError) with
sgm's message. Statistics: sgm.stats(device).
"""
from . import _apply_hook_env, _hook_env, _lib

_state = {"active": False}  # use() installed the allocator in this process


class _Block:
    """Owner of one sgm allocation: CuPy keeps it alive while the memory is in
    use (UnownedMemory's owner); dropping it frees the block on its stream."""

    __slots__ = ("ptr", "size", "device", "stream", "_free")

    def __init__(self, lib, ptr, size, device, stream):
        self.ptr, self.size, self.device, self.stream = ptr, size, device, stream
        self._free = lib.sgm_torch_free  # held here: module globals may be gone at exit

    def __del__(self):
        self._free(self.ptr, self.size, self.device, self.stream)


def _allocator(cupy, lib):
    def sgm_malloc(size):
        device = cupy.cuda.runtime.getDevice()
        if size == 0:  # as CuPy's own allocator: a null pointer for an empty array
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
        stream = cupy.cuda.get_current_stream().ptr or None
        ptr = lib.sgm_torch_malloc(size, device, stream)
        if not ptr:
            raise _lib.NoMemoryError(
                _lib.last_error() or f"sgm could not allocate {size} bytes on device {device}",
                call="sgm_torch_malloc")
        owner = _Block(lib, ptr, size, device, stream)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, size, owner, device), 0)
    return sgm_malloc


def use(**options):
    """Make sgm CuPy's device allocator (options as for sgm.torch.use: SGM_*
    variables by short name, set in the environment before the hook contexts
    read them; backend must be "cuda"). Arrays CuPy allocated before stay in
    its own pool. Raises sgm.UnsupportedError without CuPy or a CUDA device."""
    env = _hook_env(options, "CuPy", "sgm.cupy.use")
    if _state["active"]:
        return
    try:
        import cupy
    except ImportError as e:
        raise _lib.UnsupportedError(f"CuPy is not installed ({e}): sgm.cupy.use() needs cupy",
                                    call="sgm.cupy.use") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver: CUDARuntimeError
        raise _lib.UnsupportedError(f"no CUDA device: {e}", call="sgm.cupy.use") from None
    if n == 0:
        raise _lib.UnsupportedError("no CUDA device", call="sgm.cupy.use")
    cupy.cuda.set_allocator(_allocator(cupy, _lib.lib()))
    _apply_hook_env(env)  # before the first allocation: the hook contexts read it then
    _state["active"] = True


def active():
    """Whether use() has installed sgm as CuPy's allocator in this process."""
    return _state["active"]


def empty_cache():
    """Return cached and free committed memory of every hook context to the
    driver (sgm_torch_empty_cache; CuPy's memory pool calls do not reach sgm)."""
    _lib.lib().sgm_torch_empty_cache()
