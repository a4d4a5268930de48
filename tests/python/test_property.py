"""Property test of the Python layer (issue 29), with Hypothesis (Debian's
python3-hypothesis): random sizes (in and out of range), offsets, dtypes,
threads and closes against a model of what each buffer holds.

Properties:
  - every size, offset and pointer out of [0, 2**64) (or past the buffer) is
    an sgm.InvalidError, and the buffer's bytes are unchanged by it;
  - in range, write-then-read returns the bytes written, whatever the dtype
    and wherever the buffer was moved (evict to shared / disk in between);
  - threads that each own a buffer never see another's bytes, and a close of
    the context while they run ends every thread with sgm.Error, never a hang
    or a crash.
Derandomized (a fixed seed, printed) so that CI is reproducible; a few seconds.
"""
import threading

import numpy as np
import pytest

import sgm

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

ints = st.one_of(st.integers(min_value=-(2**70), max_value=2**70),
                 st.sampled_from([0, 1, 2**63, 2**64 - 1, 2**64, 2**64 + 1, -1]))
DTYPES = ["uint8", "int16", "float32", "float64", "complex64", "int64"]


def _ctx(tmp_path):
    return sgm.Context(backend="emu", emu_vram="64MiB", vram_limit="256KiB",
                       shared_limit="512KiB", spill_dir=str(tmp_path), verbose=0)


@pytest.fixture(scope="module")
def mctx(tmp_path_factory):
    print("# hypothesis: derandomized (fixed seed), max_examples=60")
    with _ctx(tmp_path_factory.mktemp("prop")) as c:
        yield c


@SETTINGS
@given(size=ints, offset=ints, n=st.integers(min_value=0, max_value=4096))
def test_any_size_and_offset_is_checked(mctx, size, offset, n):
    """Out-of-range integers are refused by name; in range they do what C does."""
    if 1 <= size <= 1 << 20:
        b = mctx.buffer(size)
        try:
            before = b.read()
            data = bytes((offset + i) & 0xFF for i in range(n))
            if 0 <= offset and offset + n <= size:
                b.write(data, offset=offset)
                assert b.read(n, offset=offset) == data
            else:
                with pytest.raises(sgm.InvalidError):
                    b.write(data, offset=offset)
                assert b.read() == before
        finally:
            b.close()
    elif not 0 <= size < 2**64:
        with pytest.raises(sgm.InvalidError, match="size"):
            mctx.buffer(size)
        with pytest.raises(sgm.InvalidError, match="size"):
            mctx.alloc(size)
    if not 0 <= offset < 2**64:
        with pytest.raises(sgm.InvalidError, match="ptr"):
            mctx.free(offset)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), count=st.integers(min_value=1, max_value=20000),
       where=st.sampled_from(["vram", "shared", "disk"]), seed=st.integers(0, 2**32 - 1),
       off_items=st.integers(min_value=0, max_value=64))
def test_numpy_round_trip_wherever_it_lives(mctx, dtype, count, where, seed, off_items):
    """Bytes written from any dtype read back equal after a move to any tier."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 255, size=count * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    off = off_items * np.dtype(dtype).itemsize
    b = mctx.buffer(a.nbytes + off)
    try:
        b.write(a, offset=off)
        if where != "vram":
            b.evict(where)
        out = b.numpy(dtype, a.shape, offset=off)
        assert out.tobytes() == a.tobytes()
    finally:
        b.close()


@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(n_threads=st.integers(min_value=1, max_value=4), ops=st.integers(min_value=0, max_value=60),
       close_early=st.booleans(), size=st.integers(min_value=1, max_value=200_000))
def test_threads_and_close(tmp_path_factory, n_threads, ops, close_early, size):
    """Each thread's buffer keeps its own bytes; a close while they run ends
    them with sgm.Error (no hang, no other exception)."""
    ctx = _ctx(tmp_path_factory.mktemp("thr"))
    go = threading.Barrier(n_threads + 1)
    bad = []

    def worker(k):
        try:
            b = ctx.buffer(bytes([k + 1]) * size)
        except sgm.Error:
            go.wait()
            return
        go.wait()
        try:
            for i in range(ops):
                pat = bytes([(k + i) & 0xFF]) * min(size, 512)
                b.write(pat)
                if b.read(len(pat)) != pat:
                    bad.append(f"thread {k} op {i}: wrong bytes")
                if i % 3 == 0:
                    b.evict("disk" if i % 2 else "shared")
        except sgm.Error as e:
            if "closed" not in str(e) and not isinstance(e, sgm.NoMemoryError):
                bad.append(repr(e))
        except BaseException as e:  # noqa: BLE001 (reported below)
            bad.append(repr(e))

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in ts:
        t.start()
    go.wait()
    if close_early:
        ctx.close()
    for t in ts:
        t.join(timeout=60)
        assert not t.is_alive(), "a thread hung"
    ctx.close()
    assert not bad, bad
