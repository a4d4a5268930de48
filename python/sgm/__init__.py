"""sgm — shared GPU memory for Linux, from Python.

Pure Python over libsgm.so (ctypes, no compiled extension). What it offers:

    import sgm
    with sgm.Context(backend="emu", vram_limit="64MiB") as ctx:   # options = SGM_* names
        buf = ctx.buffer(array)            # created and written (NumPy or any buffer)
        buf.evict("disk")                  # VRAM -> shared -> disk, while released
        out = buf.numpy(array.dtype, array.shape)   # read back, wherever it lives
        print(ctx.stats()["tiers"]["vram"]["used_bytes"])

    import sgm.torch; sgm.torch.use(vram_limit="8GiB")    # PyTorch's CUDA allocations
    import sgm.cupy;  sgm.cupy.use()                      # CuPy's

Errors are sgm.Error subclasses carrying .status and sgm's .message
(NoMemoryError is also a MemoryError, InvalidError a ValueError,
UnsupportedError a NotImplementedError). Longer prose: docs/python.md.
"""
import contextlib
import ctypes
import enum
import json
import os
import threading
import weakref

from . import _lib
from ._guard import INT_MAX, INT_MIN, Guard, address, whole
from ._lib import (BackendError, BusyError, CorruptError, DiskIOError, Error,  # noqa: F401
                   InvalidError, NoMemoryError, UnsupportedError)

__all__ = ["Context", "Buffer", "Tier", "Priority", "stats", "pointer_tier", "option_names",
           "options_env", "library_path", "Error", "InvalidError", "NoMemoryError", "BackendError",
           "DiskIOError", "CorruptError", "BusyError", "UnsupportedError"]
__version__ = "0.1.0"


class Tier(enum.IntEnum):
    """Where memory lives (sgm_tier)."""
    NONE = -1
    VRAM = 0    # dedicated GPU memory
    SHARED = 1  # page-locked, device-mapped host RAM
    DISK = 2    # the spill file

    @classmethod
    def of(cls, value):
        """A Tier from a Tier, an int or a name ("vram", "shared", "disk")."""
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise InvalidError(f"unknown tier {value!r}: use 'vram', 'shared' or 'disk'",
                                   call="sgm.Tier") from None
        try:
            return cls(value)
        except ValueError:  # evict(7): an sgm.Error, like every other bad argument
            raise InvalidError(f"unknown tier {value!r}: use 'vram', 'shared' or 'disk' "
                               "(or 0, 1, 2)", call="sgm.Tier") from None


class Priority(enum.IntEnum):
    """Residency priorities (sgm_priority): a lower one leaves VRAM first."""
    MINIMUM = 0
    LOW = 1
    NORMAL = 2
    HIGH = 3
    MAXIMUM = 4


def library_path():
    """The libsgm.so this process uses (loading it if needed)."""
    return _lib.path()


def option_names():
    """Every SGM_* variable the library reads, in docs/options.md's order."""
    lib = _lib.lib()
    names, i = [], 0
    while True:
        name = lib.sgm_option_name(i)
        if name is None:
            return names
        names.append(name.decode())
        i += 1


def _env_value(value):
    if value is True:
        return "1"
    if value is False:
        return "0"
    if value is None:
        return None
    return str(value)


def options_env(options):
    """Map keyword options onto SGM_* variables: {"vram_limit": "1GiB"} ->
    {"SGM_VRAM_LIMIT": "1GiB"}. Booleans become 1/0, other values str();
    None means "unset". An unknown name raises InvalidError naming the
    closest known ones; values are checked by sgm itself (the same parser as
    the environment) when a context is created."""
    known = option_names()
    env = {}
    for key, value in options.items():
        name = key.upper()
        if not name.startswith("SGM_"):
            name = "SGM_" + name
        if name not in known:
            import difflib
            near = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(n[4:].lower() for n in near)}?" if near else ""
            raise InvalidError(f"unknown option {key!r} (no {name} among sgm's variables{hint}; "
                               f"docs/options.md lists them all)", call="sgm options")
        env[name] = _env_value(value)
        if env[name] is not None and "\0" in env[name]:
            raise InvalidError(f"option {key!r}: its value {value!r} holds a NUL character, which "
                               "no environment variable can carry", call="sgm options")
    return env


# The SGM_* options sgm.torch.use() / sgm.cupy.use() applied for the framework
# hooks' contexts: process-wide, read by each device's context when created.
_hooks = {"env": None}


def _hook_env(options, framework, call):
    """The SGM_* variables for a framework's use(**options): backend forced to
    cuda (kernels need the real device); InvalidError for an emulated backend
    or for other options than an earlier use() of either framework applied."""
    env = options_env(options)
    backend = env.get("SGM_BACKEND") or os.environ.get("SGM_BACKEND") or "cuda"
    if backend != "cuda":
        raise InvalidError(f"backend {backend!r} cannot serve {framework}'s kernels: {call}() "
                           "needs backend='cuda' (the default)", call=call)
    env["SGM_BACKEND"] = "cuda"
    if _hooks["env"] is not None and _hooks["env"] != env:
        raise InvalidError(f"the framework hooks were already set up with other options "
                           f"({_hooks['env']}); their contexts are configured once per process",
                           call=call)
    return env


def _apply_hook_env(env):
    """Set (or, for None, unset) the hooks' SGM_* variables for good."""
    with _env_lock:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _hooks["env"] = env


# The environment is process-wide: options applied around a context's creation
# are applied under this lock, and sgm reads them only in sgm_config_init.
_env_lock = threading.Lock()


@contextlib.contextmanager
def _environment(env):
    """Set (or, for None, unset) variables for the duration of the block."""
    with _env_lock:
        saved = {k: os.environ.get(k) for k in env}
        try:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _stats_json(ctx_ptr):
    lib = _lib.lib()
    out = ctypes.c_void_p()
    _lib.check(lib.sgm_stats_json(ctx_ptr, ctypes.byref(out)), "sgm_stats_json")
    try:
        return json.loads(ctypes.string_at(out.value).decode())
    finally:
        lib.sgm_string_free(out)


def stats(device=0):
    """The statistics of the framework hooks' context of a device (the one
    sgm.torch and sgm.cupy allocate from; created on first use) as a dict in
    sgm_stats_json's shape (docs/stats.md)."""
    return _stats_json(_hook_context(device))


def _hook_context(device):
    ctx = _lib.lib().sgm_hook_context(whole(device, "device", "sgm_hook_context", INT_MIN, INT_MAX))
    if not ctx:
        raise _lib.error_for(_lib.ERR_BACKEND, _lib.last_error(), "sgm_hook_context")
    return ctx


def pointer_tier(ptr, device=0):
    """The Tier of an address the framework hooks handed out on a device
    (a tensor's data_ptr(), a CuPy array's data.ptr); Tier.NONE for others."""
    return Tier(_lib.lib().sgm_pointer_tier(_hook_context(device),
                                            address(ptr, "ptr", "sgm_pointer_tier")))


def _stream(stream):
    """A CUDA stream argument as an address: None, an int, or an object with
    .cuda_stream (torch.cuda.Stream) or .ptr (cupy.cuda.Stream)."""
    if stream is None:
        return None
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return address(getattr(stream, attr), "stream", "sgm stream")
    return address(stream, "stream", "sgm stream")


class _HostSpan:
    """The address and length of a C-contiguous buffer-protocol object, kept
    alive while the span is; readonly objects are never written."""

    def __init__(self, obj, writable):
        mv = obj if isinstance(obj, memoryview) else memoryview(obj)
        if not mv.c_contiguous:
            raise InvalidError("the buffer is not C-contiguous: pass a contiguous copy "
                               "(numpy.ascontiguousarray)", call="sgm.Buffer")
        self.nbytes = mv.nbytes
        self._keep = mv
        if mv.nbytes == 0:
            self.address = None
        elif not mv.readonly:
            raw = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
            self._keep = (mv, raw, (ctypes.c_char * mv.nbytes).from_buffer(raw))
            self.address = ctypes.addressof(self._keep[2])
        elif writable:
            raise InvalidError("the buffer is read-only: reading into it needs a writable one "
                               "(bytearray, numpy array)", call="sgm.Buffer")
        else:
            data = mv.tobytes()  # a read-only exporter: copy (ctypes cannot take its address)
            self._keep = data
            self.address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value


class Context:
    """One sgm context: a device (or the emulated one) with its three tiers.

    Context(**options): options are sgm's SGM_* variables by their short names
    (backend="emu", vram_limit="64MiB", spill_dir="/tmp", shared_fallback=False,
    ...); they override the environment for this context only, and are parsed
    and checked by sgm exactly as the environment is (a bad value raises
    InvalidError naming the variable). Use it as a context manager, or call
    close(); buffers still open are destroyed with it."""

    def __init__(self, **options):
        env = options_env(options)
        lib = _lib.lib()
        ptr = ctypes.c_void_p()
        with _environment(env):
            status = lib.sgm_context_create(None, ctypes.byref(ptr))
            if status != _lib.OK:  # read the message on this thread, before anything else
                raise _lib.error_for(status, _lib.last_error(), "sgm_context_create")
        self._ptr = ptr.value
        self._lib = lib
        self._buffers = weakref.WeakSet()
        self._guard = Guard("context")
        self.options = dict(options)

    @contextlib.contextmanager
    def _call(self, call):
        """The context's pointer for one call; close() waits for it to end."""
        self._guard.enter(call)
        try:
            yield self._ptr
        finally:
            self._guard.leave()

    @property
    def handle(self):
        """The sgm_context * as an int (for other ctypes code); Error when closed."""
        if not self._ptr:
            raise InvalidError("the context is closed", call="sgm.Context")
        return self._ptr

    @property
    def backend(self):
        """"cuda" or "emu"."""
        with self._call("sgm_context_backend") as h:
            return self._lib.sgm_context_backend(h).decode()

    def stats(self):
        """The context's state as a dict (sgm_stats_json's shape, docs/stats.md)."""
        with self._call("sgm_stats_json") as h:
            return _stats_json(h)

    def trim(self):
        """Give committed memory that is not in use back (sgm_trim)."""
        with self._call("sgm_trim") as h:
            _lib.check(self._lib.sgm_trim(h), "sgm_trim")

    def alloc(self, size, stream=None):
        """sgm_alloc: a device address (int) of size bytes that never moves."""
        size = whole(size, "size", "sgm_alloc")
        stream = _stream(stream)
        with self._call("sgm_alloc") as h:
            p = self._lib.sgm_alloc(h, size, stream)
            if not p:
                raise _lib.error_for(_lib.ERR_NOMEM if size else _lib.ERR_INVALID,
                                     _lib.last_error(), "sgm_alloc")
        return p

    def free(self, ptr, stream=None):
        """sgm_free_ex: give back an address from alloc()."""
        ptr, stream = address(ptr, "ptr", "sgm_free"), _stream(stream)
        with self._call("sgm_free") as h:
            _lib.check(self._lib.sgm_free_ex(h, ptr, stream), "sgm_free")

    def pointer_tier(self, ptr):
        """The Tier of a live allocation; Tier.NONE for any other address."""
        ptr = address(ptr, "ptr", "sgm_pointer_tier")
        with self._call("sgm_pointer_tier") as h:
            return Tier(self._lib.sgm_pointer_tier(h, ptr))

    def buffer(self, size_or_data):
        """A new Buffer: of that many bytes, or holding a copy of a
        buffer-protocol object (NumPy array, bytes, ...)."""
        if isinstance(size_or_data, int):  # bool and numpy ints are checked by Buffer
            return Buffer(self, size_or_data)
        span = _HostSpan(size_or_data, writable=False)
        b = Buffer(self, span.nbytes)
        try:
            b._write_span(span, 0)
        except BaseException:
            b.close()
            raise
        return b

    def will_use(self, buffers, distance=0):
        """Declare Buffers this context's application will use after about
        `distance` more steps (requests, batches; 0 = next) as a residency
        set (sgm_will_use): the eviction policies keep them and give up the
        furthest first. Each buffer's newest call replaces its earlier one;
        distance None cancels. Each hint ends at the buffer's next use."""
        _hint_call(self._lib, "sgm_will_use")
        bufs = list(buffers)
        for b in bufs:
            if not isinstance(b, Buffer) or b.context is not self:
                raise InvalidError("will_use takes Buffers of this context", call="sgm_will_use")
        d = 0xFFFFFFFF if distance is None else whole(distance, "distance", "sgm_will_use",
                                                       0, 0xFFFFFFFE)
        arr = (ctypes.c_void_p * max(len(bufs), 1))(*[b.handle for b in bufs])
        with self._call("sgm_will_use") as h:
            _lib.check(self._lib.sgm_will_use(h, arr, len(bufs), d), "sgm_will_use")

    def close(self):
        """Destroy the context (and the buffers still open). Idempotent and
        safe against other threads' calls: it waits for those in flight, and
        later calls raise sgm.Error; BusyError from inside a call on it."""
        if not self._ptr or not self._guard.close("sgm_context_destroy"):
            return
        for b in list(self._buffers):
            b._destroy()
        self._lib.sgm_context_destroy(self._ptr)
        self._ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_ptr", None):
            self.close()

    def __repr__(self):
        state = f"backend={self.backend}" if self._ptr and not self._guard.closed else "closed"
        return f"<sgm.Context {state}>"


def _hint_call(lib, name):
    if getattr(getattr(lib, name, None), "argtypes", None) is None:
        raise UnsupportedError(f"{name}: this libsgm.so predates residency hints; rebuild it",
                               call=name)


class Buffer:
    """A movable sgm buffer: data that may live in VRAM, shared memory or on
    disk while released, made resident and locked by acquire().

    write()/read()/readinto()/numpy() copy between host memory (any
    buffer-protocol object; NumPy arrays included) and the buffer wherever it
    lives. One buffer is used by one thread at a time (sgm.h)."""

    def __init__(self, context, size):
        size = whole(size, "size", "sgm_buffer_create")
        if size <= 0:
            raise InvalidError(f"a buffer needs a size of at least 1 byte (got {size})",
                               call="sgm_buffer_create")
        self._ptr = None
        self._mu = threading.RLock()  # one thread at a time on the buffer (sgm.h); close waits
        ptr = ctypes.c_void_p()
        with context._call("sgm_buffer_create") as h:
            _lib.check(context._lib.sgm_buffer_create(h, size, ctypes.byref(ptr)),
                       "sgm_buffer_create")
            self._ptr = ptr.value
            self._lib = context._lib
            self.context = context
            self._acquired = None
            context._buffers.add(self)

    @contextlib.contextmanager
    def _call(self, call):
        """The buffer's pointer for one call: its context stays open and its
        other calls and close() wait until the call ends; calls after close
        raise sgm.Error (InvalidError)."""
        with self.context._call(call), self._mu:
            if not self._ptr:
                raise InvalidError("the buffer is closed", call=call)
            yield self._ptr

    @property
    def handle(self):
        if not self._ptr:
            raise InvalidError("the buffer is closed", call="sgm.Buffer")
        return self._ptr

    @property
    def size(self):
        with self._call("sgm_buffer_size") as h:
            return self._lib.sgm_buffer_size(h)

    def __len__(self):
        return self.size

    @property
    def tier(self):
        """The Tier holding the data now."""
        with self._call("sgm_buffer_tier") as h:
            return Tier(self._lib.sgm_buffer_tier(h))

    def _write_span(self, span, offset):
        offset = whole(offset, "offset", "sgm_buffer_write")
        with self._call("sgm_buffer_write") as h:
            _lib.check(self._lib.sgm_buffer_write(h, offset, span.address, span.nbytes),
                       "sgm_buffer_write")

    def write(self, data, offset=0):
        """Copy a buffer-protocol object (bytes, bytearray, memoryview, NumPy
        array; C-contiguous) into the buffer at offset. Returns the byte count."""
        span = _HostSpan(data, writable=False)
        self._write_span(span, offset)
        return span.nbytes

    def readinto(self, out, offset=0):
        """Fill a writable buffer-protocol object (bytearray, NumPy array) from
        the buffer at offset. Returns the byte count."""
        offset = whole(offset, "offset", "sgm_buffer_read")
        span = _HostSpan(out, writable=True)
        with self._call("sgm_buffer_read") as h:
            _lib.check(self._lib.sgm_buffer_read(h, offset, span.address, span.nbytes),
                       "sgm_buffer_read")
        return span.nbytes

    def read(self, size=None, offset=0):
        """size bytes (default: to the end) from offset, as bytes."""
        offset = whole(offset, "offset", "sgm_buffer_read")
        total = self.size
        if size is None:
            size = max(total - offset, 0)
        size = whole(size, "size", "sgm_buffer_read")
        if size > total:  # before allocating what could never be read
            raise InvalidError(f"size = {size} is more than the buffer's {total} bytes",
                               call="sgm_buffer_read")
        out = bytearray(size)
        self.readinto(out, offset)
        return bytes(out)

    def numpy(self, dtype="uint8", shape=None, offset=0):
        """A new NumPy array read from the buffer (dtype, shape; default: the
        whole buffer from offset as a flat array)."""
        import numpy as np
        dt = np.dtype(dtype)
        offset = whole(offset, "offset", "sgm_buffer_read")
        if shape is None:
            shape = (max(self.size - offset, 0) // dt.itemsize,)
        out = np.empty(shape, dtype=dt)
        self.readinto(out, offset)
        return out

    def acquire(self, stream=None):
        """Make the buffer resident (VRAM if it fits, else shared memory) and
        lock it there; returns its device address (int). BusyError if held."""
        dptr = ctypes.c_void_p()
        stream = _stream(stream)
        with self._call("sgm_buffer_acquire") as h:
            _lib.check(self._lib.sgm_buffer_acquire(h, stream, ctypes.byref(dptr)),
                       "sgm_buffer_acquire")
            self._acquired = dptr.value
        return dptr.value

    def release(self, stream=None):
        """Unlock an acquired buffer; it may move once the work on stream is done."""
        stream = _stream(stream)
        with self._call("sgm_buffer_release") as h:
            _lib.check(self._lib.sgm_buffer_release(h, stream), "sgm_buffer_release")
            self._acquired = None

    @contextlib.contextmanager
    def acquired(self, stream=None):
        """with buf.acquired() as device_ptr: ... (released at the end)."""
        ptr = self.acquire(stream)
        try:
            yield ptr
        finally:
            self.release(stream)

    def evict(self, to=Tier.SHARED):
        """Move the released buffer down to "shared" or "disk" (cascading)."""
        to = int(Tier.of(to))
        with self._call("sgm_buffer_evict") as h:
            _lib.check(self._lib.sgm_buffer_evict(h, to), "sgm_buffer_evict")

    def prefetch(self, stream=None):
        """Start moving it into VRAM on sgm's worker; returns at once."""
        stream = _stream(stream)
        with self._call("sgm_buffer_prefetch") as h:
            _lib.check(self._lib.sgm_buffer_prefetch(h, stream), "sgm_buffer_prefetch")

    def set_priority(self, priority):
        """Residency priority: a Priority, its name or 0..4 (lower leaves VRAM first)."""
        if isinstance(priority, str):
            try:
                priority = Priority[priority.upper()]
            except KeyError:
                raise InvalidError(f"unknown priority {priority!r}: use one of "
                                   f"{', '.join(p.name.lower() for p in Priority)}",
                                   call="sgm_buffer_set_priority") from None
        priority = whole(priority, "priority", "sgm_buffer_set_priority", INT_MIN, INT_MAX)
        with self._call("sgm_buffer_set_priority") as h:
            _lib.check(self._lib.sgm_buffer_set_priority(h, priority), "sgm_buffer_set_priority")

    # ---- residency hints (sgm.h; docs/policies.md "Residency hints") ----

    def will_use(self, distance=0):
        """Say the buffer will be used after about `distance` more steps
        (requests, batches): the eviction policy keeps it. None cancels. Ends
        at its next use. Context.will_use declares many at once."""
        self.context.will_use([self], distance)

    def done(self):
        """Say the buffer will not be read again soon: it leaves its tier
        first (a finished request's last block). Ends at its next use."""
        _hint_call(self._lib, "sgm_buffer_done")
        with self._call("sgm_buffer_done") as h:
            _lib.check(self._lib.sgm_buffer_done(h), "sgm_buffer_done")

    @property
    def parent(self):
        """The parent (prefix) Buffer this one extends, or None."""
        return self._parent() if getattr(self, "_parent", None) else None

    @parent.setter
    def parent(self, parent):
        """Name the buffer this one extends (a KV block's prefix block; a
        radix tree's parent): policies keep prefixes and give up leaves first.
        None removes the link."""
        _hint_call(self._lib, "sgm_buffer_set_parent")
        other = parent.handle if parent is not None else None
        with self._call("sgm_buffer_set_parent") as h:
            _lib.check(self._lib.sgm_buffer_set_parent(h, other), "sgm_buffer_set_parent")
        self._parent = weakref.ref(parent) if parent is not None else None

    def close(self):
        """Destroy the buffer wherever it lives. Idempotent; waits for a call
        on it in flight in another thread. A no-op once its context is closed
        (that destroyed it)."""
        if not self._ptr or self.context._guard.closed:
            return
        try:
            with self.context._call("sgm_buffer_destroy"):
                self._destroy()
        except InvalidError:  # the context closed meanwhile, and destroyed it
            pass

    def _destroy(self):
        with self._mu:
            self._parent = None
            if self._ptr:
                self._lib.sgm_buffer_destroy(self._ptr)
                self._ptr = None
                self.context._buffers.discard(self)

    destroy = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_ptr", None) and self.context._ptr and not self.context._guard.closed:
            self.close()

    def __repr__(self):
        if not self._ptr:
            return "<sgm.Buffer closed>"
        return f"<sgm.Buffer {self.size} bytes in {self.tier.name.lower()}>"
