"""_lib.py — finding and loading libsgm.so, the ctypes signatures of the calls
the package makes, and sgm's statuses as Python exceptions.

Where libsgm.so comes from, first match wins:
  1. $SGM_LIBRARY (a path to the file);
  2. next to the installed package: `cmake --install` writes _install.py with
     the library's path relative to the package folder;
  3. a build tree: build/<preset>/lib/libsgm.so under the source tree holding
     this package (release first), for PYTHONPATH=<source>/python;
  4. the dynamic loader's search path (libsgm.so.0, LD_LIBRARY_PATH, ldconfig).

Every caller gets the same handle (one library instance per process): the
PyTorch and CuPy hooks keep their lazily created contexts in it.

Threading: load() is guarded by a lock; ctypes drops the GIL during each call,
and sgm's own calls are thread-safe as sgm.h says.
"""
import ctypes
import os
import threading

_lock = threading.Lock()
_handle = None  # the loaded ctypes.CDLL
_path = None    # the file it was loaded from
_why = []       # the places tried, for the message when none worked

SONAME = "libsgm.so.0"

# sgm_status values (include/sgm.h).
OK = 0
ERR_INVALID = -1
ERR_NOMEM = -2
ERR_BACKEND = -3
ERR_IO = -4
ERR_CORRUPT = -5
ERR_BUSY = -6
ERR_UNSUPPORTED = -7


class Error(Exception):
    """An sgm call failed: .status is the sgm_status (negative int), .status_name
    its constant name ("SGM_ERR_NOMEM"), .message sgm's message (what was wrong
    and what to do), .call the C function that failed."""

    status = None

    def __init__(self, message, status=None, call=None):
        if status is not None:
            self.status = status
        self.message = message
        self.call = call
        super().__init__(message)

    @property
    def status_name(self):
        return STATUS_NAMES.get(self.status, "SGM_ERR_UNKNOWN")

    def __str__(self):
        head = f"{self.call}: " if self.call else ""
        return f"{head}{self.message} [{self.status_name}]"


class InvalidError(Error, ValueError):
    """SGM_ERR_INVALID: a bad argument or configuration value."""
    status = ERR_INVALID


class NoMemoryError(Error, MemoryError):
    """SGM_ERR_NOMEM: a budget or the device is full (also a MemoryError)."""
    status = ERR_NOMEM


class BackendError(Error):
    """SGM_ERR_BACKEND: the driver (or the emulated device) failed."""
    status = ERR_BACKEND


class DiskIOError(Error):
    """SGM_ERR_IO: disk I/O failed; the data stayed where it was."""
    status = ERR_IO


class CorruptError(Error):
    """SGM_ERR_CORRUPT: a checksum did not match."""
    status = ERR_CORRUPT


class BusyError(Error):
    """SGM_ERR_BUSY: the object is in use (an acquired buffer)."""
    status = ERR_BUSY


class UnsupportedError(Error, NotImplementedError):
    """SGM_ERR_UNSUPPORTED: not available on this backend, build or machine
    (also a NotImplementedError)."""
    status = ERR_UNSUPPORTED


_CLASSES = {c.status: c for c in (InvalidError, NoMemoryError, BackendError, DiskIOError,
                                  CorruptError, BusyError, UnsupportedError)}
STATUS_NAMES = {OK: "SGM_OK", ERR_INVALID: "SGM_ERR_INVALID", ERR_NOMEM: "SGM_ERR_NOMEM",
                ERR_BACKEND: "SGM_ERR_BACKEND", ERR_IO: "SGM_ERR_IO",
                ERR_CORRUPT: "SGM_ERR_CORRUPT", ERR_BUSY: "SGM_ERR_BUSY",
                ERR_UNSUPPORTED: "SGM_ERR_UNSUPPORTED"}


def error_for(status, message, call=None):
    """The Error subclass instance for a status (Error itself for an unknown one)."""
    cls = _CLASSES.get(status, Error)
    return cls(message, status=status, call=call)


def last_error():
    """The calling thread's sgm_last_error() as str."""
    return lib().sgm_last_error().decode("utf-8", "replace")


def check(status, call):
    """Raise the Error for a failed status, with the thread's message; else return."""
    if status != OK:
        raise error_for(status, last_error() or STATUS_NAMES.get(status, str(status)), call)


def _candidates():
    env = os.environ.get("SGM_LIBRARY")
    if env:
        yield os.path.abspath(env), "SGM_LIBRARY"
        return  # an explicit choice is never silently replaced by another library
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from . import _install  # written by cmake --install
        yield os.path.normpath(os.path.join(here, _install.LIBRARY)), "the installed package"
    except ImportError:
        pass
    source = os.path.dirname(os.path.dirname(here))
    for preset in ("release", "debug"):
        yield os.path.join(source, "build", preset, "lib", "libsgm.so"), "the build tree"
    yield SONAME, "the loader's search path"


def load():
    """The loaded libsgm.so (a ctypes.CDLL), loading it on first use."""
    global _handle, _path
    if _handle is not None:
        return _handle
    with _lock:
        if _handle is not None:
            return _handle
        tried = []
        for path, where in _candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append(f"{path} ({where}): no such file")
                continue
            try:
                handle = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path} ({where}): {e}")
                continue
            _declare(handle)
            _path = path if os.sep in path else _loaded_from(handle, path)
            _handle = handle
            return _handle
        raise ImportError("sgm: cannot load libsgm.so; tried:\n  " + "\n  ".join(tried) +
                          "\nbuild it (cmake --preset release && cmake --build --preset release), "
                          "install it (cmake --install), or set SGM_LIBRARY to its path")


lib = load


def path():
    """The file libsgm.so was loaded from (loading it if needed)."""
    load()
    return _path


def _loaded_from(handle, name):
    """The absolute path the loader chose for a bare name (via dladdr), else the name."""
    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]
    try:
        libdl = ctypes.CDLL(None)
        info = DlInfo()
        addr = ctypes.cast(handle.sgm_last_error, ctypes.c_void_p)
        if libdl.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            return os.path.abspath(info.dli_fname.decode())
    except (OSError, AttributeError):
        pass
    return name


def _sig(handle, name, restype, *argtypes):
    f = getattr(handle, name)
    f.restype = restype
    f.argtypes = list(argtypes)


def _declare(h):
    c = ctypes
    vp, st, i, sz = c.c_void_p, c.c_int, c.c_int, c.c_size_t
    _sig(h, "sgm_status_string", c.c_char_p, i)
    _sig(h, "sgm_last_error", c.c_char_p)
    _sig(h, "sgm_tier_name", c.c_char_p, i)
    _sig(h, "sgm_context_create", st, vp, c.POINTER(vp))
    _sig(h, "sgm_context_destroy", None, vp)
    _sig(h, "sgm_context_backend", c.c_char_p, vp)
    _sig(h, "sgm_alloc", vp, vp, sz, vp)
    _sig(h, "sgm_free_ex", st, vp, vp, vp)
    _sig(h, "sgm_pointer_tier", i, vp, vp)
    _sig(h, "sgm_stats_json", st, vp, c.POINTER(vp))
    _sig(h, "sgm_string_free", None, vp)
    _sig(h, "sgm_trim", st, vp)
    _sig(h, "sgm_buffer_create", st, vp, sz, c.POINTER(vp))
    _sig(h, "sgm_buffer_acquire", st, vp, vp, c.POINTER(vp))
    _sig(h, "sgm_buffer_release", st, vp, vp)
    _sig(h, "sgm_buffer_write", st, vp, sz, vp, sz)
    _sig(h, "sgm_buffer_read", st, vp, sz, vp, sz)
    _sig(h, "sgm_buffer_evict", st, vp, i)
    _sig(h, "sgm_buffer_prefetch", st, vp, vp)
    _sig(h, "sgm_buffer_set_priority", st, vp, i)
    _sig(h, "sgm_buffer_tier", i, vp)
    _sig(h, "sgm_buffer_size", sz, vp)
    _sig(h, "sgm_buffer_destroy", None, vp)
    # Residency hints (sgm.h, issue 30): absent from older libraries (has()).
    for name, args in (("sgm_will_use", (vp, c.POINTER(vp), sz, c.c_uint32)),
                       ("sgm_buffer_done", (vp,)), ("sgm_buffer_set_parent", (vp, vp))):
        if hasattr(h, name):
            _sig(h, name, st, *args)
    _sig(h, "sgm_torch_malloc", vp, sz, i, vp)
    _sig(h, "sgm_torch_free", None, vp, sz, i, vp)
    _sig(h, "sgm_torch_empty_cache", None)
    _sig(h, "sgm_torch_set_memory_fraction", None, c.c_double, i)
    _sig(h, "sgm_hook_context", vp, i)
    _sig(h, "sgm_option_name", c.c_char_p, sz)


def has(name):
    """Whether the loaded library exports a function (newer calls are detected at run time)."""
    try:
        getattr(load(), name)
        return True
    except AttributeError:
        return False
