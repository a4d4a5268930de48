"""Argument checks and the in-flight guard of the Python layer (issue 29).

Every integer that crosses into C goes through whole() (or address()) first:
ctypes converts a Python int to size_t, int or a pointer modulo 2**N, so
alloc(2**64 + 16) used to be a 16-byte block and write(..., offset=2**64) a
write at offset 0. Out of range is an InvalidError that names the argument.

Guard counts the calls in flight on a Context: close() refuses new calls at
once, then waits for those in flight before the C objects are freed (a close
racing a call from another thread was a use after free in C). A close from
inside a call on the same object, on the same thread, would wait for itself:
it raises BusyError instead.

Threading: Guard's state is under its condition's lock; whole() and
address() are pure.
"""
import operator
import threading

from ._lib import BusyError, InvalidError

U64_MAX = (1 << 64) - 1
INT_MIN = -(1 << 31)
INT_MAX = (1 << 31) - 1


def whole(value, name, call, lo=0, hi=U64_MAX):
    """value as an int in [lo, hi]; InvalidError naming the argument when it is
    not a whole number (bool included) or out of range."""
    if isinstance(value, bool):
        raise InvalidError(f"{name} must be a whole number, not a bool ({value!r})", call=call)
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidError(f"{name} must be a whole number, not {type(value).__name__} "
                           f"({value!r})", call=call) from None
    if not lo <= v <= hi:
        top = "2**64 - 1" if hi == U64_MAX else str(hi)
        raise InvalidError(f"{name} = {v} is out of range: it must be between {lo} and {top}",
                           call=call)
    return v


def address(value, name, call):
    """A pointer argument: None (NULL) or an int in [0, 2**64 - 1]."""
    if value is None:
        return None
    return whole(value, name, call) or None


class Guard:
    """Calls in flight on one object, and whether it is closed."""

    def __init__(self, what):
        self._what = what                  # "context", for messages
        self._cond = threading.Condition(threading.Lock())
        self._n = 0                        # calls in flight, all threads
        self._closed = False
        self._mine = threading.local()     # .n: calls in flight on this thread

    @property
    def closed(self):
        return self._closed

    def enter(self, call):
        """Count a call in; InvalidError (an sgm.Error) once closed."""
        with self._cond:
            if self._closed:
                raise InvalidError(f"the {self._what} is closed", call=call)
            self._n += 1
        self._mine.n = getattr(self._mine, "n", 0) + 1

    def leave(self):
        self._mine.n -= 1
        with self._cond:
            self._n -= 1
            if self._n == 0:
                self._cond.notify_all()

    def close(self, call):
        """Refuse new calls and wait for those in flight. False when it was
        closed already; BusyError when this thread is inside a call on it."""
        if getattr(self._mine, "n", 0):
            raise BusyError(f"the {self._what} cannot be closed from inside a call on it",
                            call=call)
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            while self._n:
                self._cond.wait()
        return True
